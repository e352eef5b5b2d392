//! The record key of the CubeVolume store: a Secret in the bridge's namespace, so that
//! every controller replica, on any host, signs and verifies with one key. The first
//! replica to need it makes it (an immutable Secret of the bridge's own type and labels,
//! with 32 random bytes); a replica that loses that race reads the winner's. A Secret of
//! that name the bridge did not make, or whose key is not the one the operator pinned
//! (`kubernetes.record_key_sha256`), is refused and left alone: whoever made it may know
//! the key. Only the controller ServiceAccount may read it (the chart's Role names it).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

use super::{Kube, KubeError};
use crate::bridge::BridgeError;
use crate::bridge::integrity::{LoadedKey, RecordKey, RecordKeySource};
use crate::bridge::ports::StoreError;

/// The data key of the Secret.
pub const KEY_FIELD: &str = "key";
/// The Secret type the bridge gives the key (a Secret's type cannot change after it is
/// made).
pub const SECRET_TYPE: &str = "csibridge.cubesandbox.io/record-key";
/// The labels the bridge gives the key.
pub const LABELS: [(&str, &str); 2] = [
    ("app.kubernetes.io/managed-by", "cube-csi-bridge"),
    ("app.kubernetes.io/component", "record-key"),
];
/// How the first version of the record key was marked (type Opaque): still accepted.
const EARLIER_LABEL: (&str, &str) = ("app.kubernetes.io/part-of", "cube-csi-bridge");
const PURPOSE_ANNOTATION: &str = "csibridge.cubesandbox.io/purpose";

/// The Secret holding the key.
#[derive(Debug)]
pub struct SecretKeySource {
    kube: Arc<Kube>,
    name: String,
    /// The key's SHA-256 (lower-case hex) the operator pinned, if any.
    pinned_sha256: Option<String>,
}

impl SecretKeySource {
    pub fn new(kube: Arc<Kube>, name: &str, pinned_sha256: Option<&str>) -> Self {
        Self {
            kube,
            name: name.to_string(),
            pinned_sha256: pinned_sha256.map(str::to_ascii_lowercase),
        }
    }

    /// An API failure, transient when the server was unreachable (the daemon then starts
    /// anyway and retries on first use).
    fn failed(&self, action: &str, error: KubeError) -> BridgeError {
        BridgeError::Store(StoreError::Backend {
            store: format!("record key Secret {}", self.name),
            action: format!(
                "{action} (the controller side reads and, the first time, creates this \
                 Secret; see the chart's Role)"
            ),
            transient: error.is_transient(),
            source: Box::new(error),
        })
    }

    /// The key of a Secret found at the key's name, if the bridge may trust it.
    fn key_of(&self, secret: &Secret) -> Result<RecordKey, BridgeError> {
        let problems = provenance_problems(secret);
        if !problems.is_empty() {
            return Err(BridgeError::Precondition(format!(
                "record key {} was not made by the bridge: {}. The bridge neither uses nor \
                 replaces it: whoever made it may know the key and forge CubeVolumes that \
                 verify. Delete it (and find out who could create Secrets in this \
                 namespace) and restart the controller to make a new one; a key you made \
                 yourself on purpose must be recreated with type {SECRET_TYPE}, the labels \
                 {}, immutable: true, and its SHA-256 pinned in \
                 kubernetes.record_key_sha256",
                self.describe(),
                problems.join("; "),
                LABELS
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(KEY_FIELD))
            .map(|b| b.0.as_slice())
            .unwrap_or_default();
        let key = RecordKey::from_bytes(bytes).map_err(|e| {
            BridgeError::Precondition(format!(
                "record key {} has no usable {KEY_FIELD:?} ({e}); restore it from a \
                 backup (records signed with the lost key no longer verify)",
                self.describe()
            ))
        })?;
        if let Some(pinned) = &self.pinned_sha256 {
            let found = key.fingerprint();
            if &found != pinned {
                return Err(BridgeError::Precondition(format!(
                    "record key {} holds a key whose SHA-256 is {found}, not the {pinned} \
                     that kubernetes.record_key_sha256 pins: the Secret was replaced, and \
                     the bridge does not use it. Restore the original Secret from a backup \
                     (or, if you replaced the key on purpose, set record_key_sha256 to the \
                     new key's SHA-256)",
                    self.describe()
                )));
            }
        }
        if secret.type_.as_deref() != Some(SECRET_TYPE) {
            tracing::warn!(
                key = %self.describe(),
                "the record key Secret was made by an earlier version of the bridge (type \
                 Opaque); it is used, but pin its SHA-256 in kubernetes.record_key_sha256"
            );
        }
        Ok(key)
    }

    fn missing_but_pinned(&self) -> BridgeError {
        BridgeError::Precondition(format!(
            "record key {} is missing, and kubernetes.record_key_sha256 pins the key \
             CubeVolumes are signed with: the bridge does not make a new one. Restore the \
             Secret from a backup (its SHA-256 must be {})",
            self.describe(),
            self.pinned_sha256.as_deref().unwrap_or_default()
        ))
    }

    /// The key Secret as the bridge makes it.
    fn new_secret(&self, key: &RecordKey) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(
                    LABELS
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                annotations: Some(BTreeMap::from([(
                    PURPOSE_ANNOTATION.to_string(),
                    "HMAC key of the CubeVolume records, made by cube-csi-bridge; losing it \
                     makes every record unverifiable, so back it up with them"
                        .to_string(),
                )])),
                ..Default::default()
            },
            immutable: Some(true),
            type_: Some(SECRET_TYPE.into()),
            data: Some(BTreeMap::from([(
                KEY_FIELD.to_string(),
                ByteString(key.as_bytes().to_vec()),
            )])),
            ..Default::default()
        }
    }
}

/// Why `secret` is not a key Secret the bridge made (empty: it carries every mark).
/// Anyone who may create Secrets can copy these marks: they catch a Secret made by
/// something else at this name, not a deliberate forger (the pin does).
pub fn provenance_problems(secret: &Secret) -> Vec<String> {
    let mut problems = Vec::new();
    let labels = secret.metadata.labels.clone().unwrap_or_default();
    let annotations = secret.metadata.annotations.clone().unwrap_or_default();
    let has = |(k, v): (&str, &str)| labels.get(k).is_some_and(|found| found == v);
    match secret.type_.as_deref() {
        Some(SECRET_TYPE) => {
            for (k, v) in LABELS {
                if !has((k, v)) {
                    problems.push(format!("label {k}={v} is missing"));
                }
            }
        }
        // The bridge's first version made it this way.
        Some("Opaque") if has(EARLIER_LABEL) && annotations.contains_key(PURPOSE_ANNOTATION) => {}
        other => problems.push(format!(
            "its type is {:?}, not {SECRET_TYPE}",
            other.unwrap_or("")
        )),
    }
    if secret.immutable != Some(true) {
        problems.push("it is not immutable".into());
    }
    let fields: Vec<&String> = secret.data.iter().flat_map(|d| d.keys()).collect();
    if fields != [KEY_FIELD] || secret.string_data.is_some() {
        problems.push(format!(
            "its data holds {fields:?}, not exactly {KEY_FIELD:?}"
        ));
    }
    problems
}

#[async_trait]
impl RecordKeySource for SecretKeySource {
    async fn read(&self) -> Result<Option<RecordKey>, BridgeError> {
        let (client, namespace) = self
            .kube
            .client()
            .await
            .map_err(|e| self.failed("connecting", e))?;
        let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
        match api.get_opt(&self.name).await {
            Ok(Some(secret)) => Ok(Some(self.key_of(&secret)?)),
            Ok(None) if self.pinned_sha256.is_some() => Err(self.missing_but_pinned()),
            Ok(None) => Ok(None),
            Err(e) => Err(self.failed("reading", KubeError::api("get", e))),
        }
    }

    async fn create(&self) -> Result<LoadedKey, BridgeError> {
        if self.pinned_sha256.is_some() {
            // A new key could never match the pin.
            return Err(self.missing_but_pinned());
        }
        let (client, namespace) = self
            .kube
            .client()
            .await
            .map_err(|e| self.failed("connecting", e))?;
        let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let key =
            RecordKey::generate().map_err(|e| BridgeError::io("generating a record key", e))?;
        match api
            .create(&PostParams::default(), &self.new_secret(&key))
            .await
        {
            Ok(_) => Ok(LoadedKey { key, created: true }),
            // Another replica made it first: use its key, checked as any found key.
            Err(kube::Error::Api(s)) if s.is_already_exists() => {
                let secret = api
                    .get(&self.name)
                    .await
                    .map_err(|e| self.failed("reading", KubeError::api("get", e)))?;
                Ok(LoadedKey {
                    key: self.key_of(&secret)?,
                    created: false,
                })
            }
            Err(e) => Err(self.failed("creating", KubeError::api("create", e))),
        }
    }

    /// Whoever may delete Secrets in the namespace can remove the key unseen.
    fn making_proves_first_key(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        match self.kube.namespace_hint() {
            Some(ns) => format!("Secret {ns}/{}", self.name),
            None => format!("Secret {}", self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KubernetesSettings;

    fn source(pinned: Option<&str>) -> SecretKeySource {
        let kube = Arc::new(Kube::new(&KubernetesSettings {
            namespace: Some("cube-system".into()),
            ..Default::default()
        }));
        SecretKeySource::new(kube, "k", pinned)
    }

    #[test]
    fn only_a_secret_with_the_bridges_marks_and_the_pinned_key_is_used() {
        let key = RecordKey::from_bytes(&[3; 32]).unwrap();
        let made = source(None).new_secret(&key);
        assert!(provenance_problems(&made).is_empty());
        assert_eq!(source(None).key_of(&made).unwrap(), key);
        // What `kubectl create secret generic k --from-file=key=...` makes.
        let mut plain = made.clone();
        plain.type_ = Some("Opaque".into());
        plain.metadata.labels = None;
        plain.immutable = None;
        let err = source(None).key_of(&plain).unwrap_err().to_string();
        assert!(
            err.contains("Secret cube-system/k was not made by the bridge")
                && err.contains("\"Opaque\"")
                && err.contains("not immutable")
                && err.contains("record_key_sha256"),
            "{err}"
        );
        // Each mark on its own is required.
        type Edit = fn(&mut Secret);
        let edits: [Edit; 5] = [
            |s| s.type_ = None,
            |s| {
                s.metadata.labels.as_mut().unwrap().remove(LABELS[0].0);
            },
            |s| s.immutable = Some(false),
            |s| {
                s.data
                    .as_mut()
                    .unwrap()
                    .insert("extra".into(), ByteString(vec![1]));
            },
            |s| s.string_data = Some(BTreeMap::from([("key".into(), "x".into())])),
        ];
        for edit in edits {
            let mut marked_less = made.clone();
            edit(&mut marked_less);
            assert!(
                !provenance_problems(&marked_less).is_empty(),
                "{marked_less:?}"
            );
        }
        // The first version's marks (type Opaque) are still the bridge's.
        let mut earlier = made.clone();
        earlier.type_ = Some("Opaque".into());
        earlier.metadata.labels = Some(BTreeMap::from([(
            EARLIER_LABEL.0.to_string(),
            EARLIER_LABEL.1.to_string(),
        )]));
        assert!(provenance_problems(&earlier).is_empty());
        // Pinned: only that key, whatever the marks say.
        let pin = key.fingerprint();
        assert_eq!(
            source(Some(&pin.to_uppercase())).key_of(&made).unwrap(),
            key
        );
        let other = source(None).new_secret(&RecordKey::from_bytes(&[4; 32]).unwrap());
        let err = source(Some(&pin)).key_of(&other).unwrap_err().to_string();
        assert!(
            err.contains(&pin)
                && err.contains(&RecordKey::from_bytes(&[4; 32]).unwrap().fingerprint())
                && err.contains("replaced"),
            "{err}"
        );
        assert!(!err.contains("0303"), "no key bytes in a message: {err}");
    }
}
