//! StorageClass reuse: a StorageClass's parameters, mount options, fstype and secret
//! references, consumed the way external-provisioner and kubelet consume them.
//!
//! The `csi.storage.k8s.io/` parameters are the CO's, not the driver's: they name secrets
//! and the fstype, and are stripped before CreateVolume. An unknown one is an error, as
//! upstream. Cube volumes have no PersistentVolume or claim, so secret references must be
//! literal: `${pvc.namespace}`-style templates are refused with a message saying so.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;

use super::cache::Cached;
use super::names::{is_dns_label, is_dns_subdomain};
use super::{Kube, KubeError};
use crate::bridge::AccessMode;
use crate::bridge::ports::{
    Capability, SecretUse, Secrets, SettingsError, VolumeSettings, VolumeSpec,
};
use crate::bridge::records::{DeletionPolicy, SecretRef};

/// The prefix of the parameters a CO consumes itself.
pub const PARAMETER_PREFIX: &str = "csi.storage.k8s.io/";

impl SecretUse {
    const ALL: [SecretUse; 6] = [
        SecretUse::Provisioner,
        SecretUse::ControllerPublish,
        SecretUse::NodeStage,
        SecretUse::NodePublish,
        SecretUse::ControllerExpand,
        SecretUse::NodeExpand,
    ];

    /// `<stem>-secret-name` / `<stem>-secret-namespace` after the prefix.
    fn stem(self) -> &'static str {
        match self {
            SecretUse::Provisioner => "provisioner",
            SecretUse::ControllerPublish => "controller-publish",
            SecretUse::NodeStage => "node-stage",
            SecretUse::NodePublish => "node-publish",
            SecretUse::ControllerExpand => "controller-expand",
            SecretUse::NodeExpand => "node-expand",
        }
    }

    /// The pre-prefix spelling, still honoured upstream and (unlike the prefixed form)
    /// passed on to the driver.
    fn deprecated_keys(self) -> Option<(&'static str, &'static str)> {
        match self {
            SecretUse::Provisioner => {
                Some(("csiProvisionerSecretName", "csiProvisionerSecretNamespace"))
            }
            SecretUse::ControllerPublish => Some((
                "csiControllerPublishSecretName",
                "csiControllerPublishSecretNamespace",
            )),
            SecretUse::NodeStage => Some(("csiNodeStageSecretName", "csiNodeStageSecretNamespace")),
            SecretUse::NodePublish => {
                Some(("csiNodePublishSecretName", "csiNodePublishSecretNamespace"))
            }
            SecretUse::ControllerExpand | SecretUse::NodeExpand => None,
        }
    }
}

/// A StorageClass's parameters, split into the driver's and the CO's.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ClassParameters {
    /// What CreateVolume receives.
    pub parameters: BTreeMap<String, String>,
    pub fs_type: String,
    pub secrets: BTreeMap<SecretUse, SecretRef>,
}

/// Splits StorageClass parameters as external-provisioner does. `class` names the
/// StorageClass in errors.
pub fn split_parameters(
    class: &str,
    params: &BTreeMap<String, String>,
) -> Result<ClassParameters, String> {
    let mut known: BTreeMap<String, &str> = BTreeMap::new();
    let mut parameters = BTreeMap::new();
    for (key, value) in params {
        match key.strip_prefix(PARAMETER_PREFIX) {
            Some(rest) if is_known_prefixed(rest) => {
                known.insert(rest.to_string(), value);
            }
            Some(_) => {
                return Err(format!(
                    "StorageClass {class}: unknown parameter {key:?}; parameters starting with \
                     {PARAMETER_PREFIX} are reserved for the CO (fstype and *-secret-name / \
                     *-secret-namespace)"
                ));
            }
            None => {
                parameters.insert(key.clone(), value.clone());
            }
        }
    }
    let fs_type = known
        .get("fstype")
        .map(|v| v.to_string())
        .or_else(|| params.get("fstype").cloned())
        .unwrap_or_default();

    let mut secrets = BTreeMap::new();
    for usage in SecretUse::ALL {
        let prefixed = (
            known.get(&format!("{}-secret-name", usage.stem())).copied(),
            known
                .get(&format!("{}-secret-namespace", usage.stem()))
                .copied(),
        );
        let deprecated = usage
            .deprecated_keys()
            .map(|(n, ns)| {
                (
                    params.get(n).map(String::as_str),
                    params.get(ns).map(String::as_str),
                )
            })
            .unwrap_or((None, None));
        let default = (
            known.get("secret-name").copied(),
            known.get("secret-namespace").copied(),
        );
        let chosen = [prefixed, deprecated, default]
            .into_iter()
            .find(|(n, ns)| n.is_some() || ns.is_some());
        let Some(pair) = chosen else { continue };
        let reference = secret_ref(class, usage, pair)?;
        secrets.insert(usage, reference);
    }
    Ok(ClassParameters {
        parameters,
        fs_type,
        secrets,
    })
}

fn is_known_prefixed(rest: &str) -> bool {
    if matches!(rest, "fstype" | "secret-name" | "secret-namespace") {
        return true;
    }
    SecretUse::ALL.iter().any(|u| {
        rest.strip_prefix(u.stem())
            .is_some_and(|tail| matches!(tail, "-secret-name" | "-secret-namespace"))
    })
}

fn secret_ref(
    class: &str,
    usage: SecretUse,
    (name, namespace): (Option<&str>, Option<&str>),
) -> Result<SecretRef, String> {
    let key = |what: &str| format!("{PARAMETER_PREFIX}{}-secret-{what}", usage.stem());
    let (Some(name), Some(namespace)) = (name, namespace) else {
        return Err(format!(
            "StorageClass {class}: {} and {} must be given together",
            key("name"),
            key("namespace")
        ));
    };
    if name.contains("${") || namespace.contains("${") {
        return Err(format!(
            "StorageClass {class}: {} / {} use a template (${{...}}); Cube volumes have no \
             PersistentVolume or PersistentVolumeClaim to fill it from, so name the Secret \
             and its namespace literally (or use a StorageClass made for Cube)",
            key("name"),
            key("namespace")
        ));
    }
    if !is_dns_subdomain(name) || !is_dns_label(namespace) {
        return Err(format!(
            "StorageClass {class}: secret reference {namespace}/{name} ({}) is not a valid \
             namespace/name",
            key("name")
        ));
    }
    Ok(SecretRef {
        namespace: namespace.to_string(),
        name: name.to_string(),
    })
}

/// A StorageClass, read and checked, ready to build CSI requests from.
#[derive(Clone)]
pub struct ResolvedClass {
    pub name: String,
    /// Must equal the CSI driver's GetPluginInfo name.
    pub provisioner: String,
    pub parameters: BTreeMap<String, String>,
    pub fs_type: String,
    /// Mount flags; may hold credentials, so never logged.
    pub mount_options: Vec<String>,
    /// `reclaimPolicy: Retain`: Destroy forgets the volume but keeps the storage.
    pub retain: bool,
    secret_refs: BTreeMap<SecretUse, SecretRef>,
}

impl std::fmt::Debug for ResolvedClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolvedClass")
            .field("name", &self.name)
            .field("provisioner", &self.provisioner)
            .field("parameters", &self.parameters)
            .field("fs_type", &self.fs_type)
            .field(
                "mount_options",
                &format_args!("<{} redacted>", self.mount_options.len()),
            )
            .field("retain", &self.retain)
            .field("secret_refs", &self.secret_refs)
            .finish()
    }
}

impl ResolvedClass {
    pub fn secret_ref(&self, usage: SecretUse) -> Option<&SecretRef> {
        self.secret_refs.get(&usage)
    }

    /// Checks the class belongs to the driver behind the bridge.
    pub fn check_provisioner(&self, driver_name: &str) -> Result<(), KubeError> {
        if self.provisioner == driver_name {
            return Ok(());
        }
        Err(KubeError::Unusable(format!(
            "StorageClass {} has provisioner {:?} but the CSI driver at csi.endpoint is {:?}; \
             set kubernetes.storage_class to a StorageClass of this driver",
            self.name, self.provisioner, driver_name
        )))
    }
}

/// The decoded data of one Secret.
type SecretData = BTreeMap<String, String>;

/// Reads a StorageClass and the Secrets it references, reusing what was read for the
/// configured time. When the API server cannot be reached, the last good copy is used
/// (with a warning) so that sandboxes keep starting through an API server outage.
pub struct StorageClassSource {
    kube: Arc<Kube>,
    name: String,
    ttl: Duration,
    /// `volume.access_mode` of the config (a StorageClass has no access mode).
    access_mode: AccessMode,
    class: Cached<ResolvedClass>,
    secrets: Mutex<BTreeMap<SecretRef, Arc<Cached<SecretData>>>>,
}

impl std::fmt::Debug for StorageClassSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageClassSource")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl StorageClassSource {
    pub fn new(kube: Arc<Kube>, name: &str, ttl: Duration, access_mode: AccessMode) -> Self {
        Self {
            kube,
            name: name.to_string(),
            ttl,
            access_mode,
            class: Cached::new(ttl),
            secrets: Default::default(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The StorageClass, from the cache while it is fresh.
    pub async fn class(&self) -> Result<Arc<ResolvedClass>, KubeError> {
        let what = format!("StorageClass {}", self.name);
        self.class.get(&what, || self.read_class()).await
    }

    async fn read_class(&self) -> Result<ResolvedClass, KubeError> {
        let (client, _) = self.kube.client().await?;
        let api: Api<StorageClass> = Api::all(client.clone());
        let action = || format!("reading StorageClass {}", self.name);
        let class = api
            .get_opt(&self.name)
            .await
            .map_err(|e| KubeError::api(action(), e))?
            .ok_or_else(|| {
                KubeError::Unusable(format!(
                    "StorageClass {} does not exist (kubernetes.storage_class)",
                    self.name
                ))
            })?;
        let params: BTreeMap<String, String> = class.parameters.clone().unwrap_or_default();
        let split = split_parameters(&self.name, &params).map_err(KubeError::Unusable)?;
        tracing::debug!(storage_class = %self.name, provisioner = %class.provisioner, "StorageClass read");
        Ok(ResolvedClass {
            name: self.name.clone(),
            provisioner: class.provisioner,
            parameters: split.parameters,
            fs_type: split.fs_type,
            mount_options: class.mount_options.unwrap_or_default(),
            retain: class.reclaim_policy.as_deref() == Some("Retain"),
            secret_refs: split.secrets,
        })
    }

    /// The secret data for one use (empty when the class references none).
    pub async fn secrets(
        &self,
        usage: SecretUse,
    ) -> Result<Arc<BTreeMap<String, String>>, KubeError> {
        let class = self.class().await?;
        match class.secret_ref(usage) {
            Some(reference) => self.secret_data(reference, SecretFrom::StorageClass).await,
            None => Ok(Default::default()),
        }
    }

    /// The data of one Secret, from the cache while it is fresh; `from` says, in errors,
    /// where the reference came from.
    pub async fn secret_data(
        &self,
        reference: &SecretRef,
        from: SecretFrom,
    ) -> Result<Arc<BTreeMap<String, String>>, KubeError> {
        let cache = self
            .secrets
            .lock()
            .expect("secret caches poisoned")
            .entry(reference.clone())
            .or_insert_with(|| Arc::new(Cached::new(self.ttl)))
            .clone();
        let what = format!("Secret {}/{}", reference.namespace, reference.name);
        cache.get(&what, || self.read_secret(reference, from)).await
    }

    async fn read_secret(
        &self,
        reference: &SecretRef,
        from: SecretFrom,
    ) -> Result<BTreeMap<String, String>, KubeError> {
        let (client, _) = self.kube.client().await?;
        let api: Api<Secret> = Api::namespaced(client.clone(), &reference.namespace);
        let what = match from {
            SecretFrom::StorageClass => format!(
                "Secret {}/{} (referenced by StorageClass {})",
                reference.namespace, reference.name, self.name
            ),
            // The StorageClass may name another one by now: the volume's record says which
            // Secret deletes it, and the chart must still let the bridge read it.
            SecretFrom::Record => format!(
                "Secret {}/{} (recorded as the volume's deletion Secret when it was created; \
                 keep it, and keep it in the chart's kubernetes.secrets, while volumes \
                 record it)",
                reference.namespace, reference.name
            ),
        };
        let secret = api
            .get_opt(&reference.name)
            .await
            .map_err(|e| KubeError::api(format!("reading {what}"), e))?
            .ok_or_else(|| KubeError::Unusable(format!("{what} does not exist")))?;
        let mut out = BTreeMap::new();
        for (key, value) in secret.data.unwrap_or_default() {
            let text = String::from_utf8(value.0).map_err(|_| {
                KubeError::Unusable(format!(
                    "{what}: the value of key {key:?} is not UTF-8 text, which CSI secrets must be"
                ))
            })?;
            out.insert(key, text);
        }
        Ok(out)
    }
}

/// Where a Secret's reference came from, for errors that name it.
#[derive(Debug, Clone, Copy)]
pub enum SecretFrom {
    /// The StorageClass, as it is now.
    StorageClass,
    /// A volume's record, as the StorageClass was at its Create.
    Record,
}

fn settings_error(e: KubeError) -> SettingsError {
    SettingsError {
        message: e.to_string(),
        transient: e.is_transient(),
        source: Some(Box::new(e)),
    }
}

#[async_trait]
impl VolumeSettings for StorageClassSource {
    async fn spec(&self, driver_name: &str) -> Result<VolumeSpec, SettingsError> {
        let class = self.class().await.map_err(settings_error)?;
        class
            .check_provisioner(driver_name)
            .map_err(settings_error)?;
        Ok(VolumeSpec {
            parameters: class.parameters.clone(),
            capability: Capability {
                access_mode: self.access_mode,
                fs_type: class.fs_type.clone(),
                mount_flags: class.mount_options.clone(),
            },
            deletion: Some(DeletionPolicy {
                retain: class.retain,
                secret: class.secret_ref(SecretUse::Provisioner).cloned(),
            }),
        })
    }

    async fn secrets(&self, usage: SecretUse) -> Result<Secrets, SettingsError> {
        let data = StorageClassSource::secrets(self, usage)
            .await
            .map_err(settings_error)?;
        Ok(Secrets((*data).clone()))
    }

    async fn deletion_secrets(
        &self,
        deletion: Option<&DeletionPolicy>,
    ) -> Result<Secrets, SettingsError> {
        match deletion {
            // Recorded at Create: works after the StorageClass changed or is gone.
            Some(policy) => match &policy.secret {
                Some(reference) => Ok(Secrets(
                    (*self
                        .secret_data(reference, SecretFrom::Record)
                        .await
                        .map_err(settings_error)?)
                    .clone(),
                )),
                None => Ok(Secrets::default()),
            },
            None => VolumeSettings::secrets(self, SecretUse::Provisioner).await,
        }
    }

    async fn check(&self, driver_name: Option<&str>) -> Result<Option<String>, SettingsError> {
        let class = self.class().await.map_err(settings_error)?;
        if let Some(name) = driver_name {
            class.check_provisioner(name).map_err(settings_error)?;
        }
        Ok(Some(format!(
            "StorageClass {} found (provisioner {})",
            self.name, class.provisioner
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pairs: &[(&str, &str)]) -> Result<ClassParameters, String> {
        let params = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        split_parameters("nfs-csi", &params)
    }

    fn reference(ns: &str, name: &str) -> SecretRef {
        SecretRef {
            namespace: ns.into(),
            name: name.into(),
        }
    }

    #[test]
    fn prefixed_keys_are_consumed_and_stripped() {
        let got = split(&[
            ("server", "nfs.example"),
            ("share", "/exports"),
            (
                "csi.storage.k8s.io/provisioner-secret-name",
                "mount-options",
            ),
            ("csi.storage.k8s.io/provisioner-secret-namespace", "default"),
            ("csi.storage.k8s.io/node-publish-secret-name", "np"),
            (
                "csi.storage.k8s.io/node-publish-secret-namespace",
                "kube-system",
            ),
            ("csi.storage.k8s.io/fstype", "nfs4"),
            ("csi.storage.k8s.io/controller-expand-secret-name", "x"),
            (
                "csi.storage.k8s.io/controller-expand-secret-namespace",
                "default",
            ),
        ])
        .unwrap();
        assert_eq!(
            got.parameters,
            BTreeMap::from([
                ("server".to_string(), "nfs.example".to_string()),
                ("share".to_string(), "/exports".to_string()),
            ])
        );
        assert_eq!(got.fs_type, "nfs4");
        assert_eq!(
            got.secrets.get(&SecretUse::Provisioner),
            Some(&reference("default", "mount-options"))
        );
        assert_eq!(
            got.secrets.get(&SecretUse::NodePublish),
            Some(&reference("kube-system", "np"))
        );
        assert_eq!(got.secrets.get(&SecretUse::NodeStage), None);
    }

    #[test]
    fn default_secret_applies_where_no_specific_one_is_named() {
        let got = split(&[
            ("csi.storage.k8s.io/secret-name", "all"),
            ("csi.storage.k8s.io/secret-namespace", "default"),
            ("csi.storage.k8s.io/node-stage-secret-name", "stage"),
            ("csi.storage.k8s.io/node-stage-secret-namespace", "default"),
        ])
        .unwrap();
        assert!(got.parameters.is_empty());
        assert_eq!(
            got.secrets[&SecretUse::Provisioner],
            reference("default", "all")
        );
        assert_eq!(
            got.secrets[&SecretUse::NodeStage],
            reference("default", "stage")
        );
        assert_eq!(
            got.secrets[&SecretUse::NodePublish],
            reference("default", "all")
        );
    }

    #[test]
    fn deprecated_keys_are_used_but_passed_on() {
        let got = split(&[
            ("csiProvisionerSecretName", "old"),
            ("csiProvisionerSecretNamespace", "default"),
            ("fstype", "ext4"),
        ])
        .unwrap();
        assert_eq!(
            got.secrets[&SecretUse::Provisioner],
            reference("default", "old")
        );
        assert_eq!(got.fs_type, "ext4");
        assert_eq!(got.parameters.len(), 3, "{:?}", got.parameters);
    }

    #[test]
    fn bad_references_are_errors_that_say_why() {
        let err = split(&[("csi.storage.k8s.io/provisioner-secret-nam", "x")]).unwrap_err();
        assert!(
            err.contains("unknown parameter") && err.contains("nfs-csi"),
            "{err}"
        );
        let err = split(&[("csi.storage.k8s.io/provisioner-secret-name", "x")]).unwrap_err();
        assert!(err.contains("together"), "{err}");
        let err = split(&[
            ("csi.storage.k8s.io/node-publish-secret-name", "${pvc.name}"),
            (
                "csi.storage.k8s.io/node-publish-secret-namespace",
                "${pvc.namespace}",
            ),
        ])
        .unwrap_err();
        assert!(
            err.contains("template") && err.contains("literally"),
            "{err}"
        );
        let err = split(&[
            ("csi.storage.k8s.io/node-publish-secret-name", "Bad_Name"),
            (
                "csi.storage.k8s.io/node-publish-secret-namespace",
                "default",
            ),
        ])
        .unwrap_err();
        assert!(err.contains("not a valid"), "{err}");
    }
}
