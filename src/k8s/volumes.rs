//! The Kubernetes controller store: one namespaced CubeVolume object per Cube volume.
//!
//! Any controller replica can Destroy what another created, because the CSI handle lives
//! in the API server. Writes carry the resourceVersion they read (optimistic concurrency):
//! a replica that lost a race gets `StoreError::Conflict` and re-reads. Object names are
//! derived from the driver and volume_id, so two replicas creating the same Cube volume
//! meet on one object.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;

use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::core::{ApiResource, GroupVersionKind, NotUsed, Object};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::names::dns_name_chars;
use super::{Kube, KubeError};
use crate::bridge::ports::{ControllerStore, StoreError};
use crate::bridge::records::{ContentSource, DeletionPolicy, SecretRef, VolumeRecord, VolumeState};

pub const CRD_GROUP: &str = "csibridge.cubesandbox.io";
pub const CRD_VERSION: &str = "v1alpha1";
pub const CRD_KIND: &str = "CubeVolume";
pub const CRD_PLURAL: &str = "cubevolumes";
/// Label holding the Cube driver name, for listing one bridge instance's volumes.
pub const DRIVER_LABEL: &str = "csibridge.cubesandbox.io/driver";
/// Annotation holding `VolumeRecord::answering_creates`, comma-separated: metadata, so
/// that an API server still serving an older CRD schema keeps it (it prunes unknown
/// `spec` fields).
pub const ANSWERING_CREATES_ANNOTATION: &str = "csibridge.cubesandbox.io/answering-creates";

/// The `spec` of a CubeVolume (see the chart's crds/ for the schema).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CubeVolumeSpec {
    pub driver: String,
    pub volume_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_driver: Option<String>,
    pub csi_name: String,
    pub state: SpecState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_volume_id: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub volume_context: BTreeMap<String, String>,
    #[serde(default)]
    pub capacity_bytes: i64,
    #[serde(default)]
    pub updated_at: u64,
    /// `Delete` or `Retain`, from the StorageClass at Create; absent when not recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim_policy: Option<String>,
    /// The provisioner secret DeleteVolume gets, from the StorageClass at Create.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioner_secret_ref: Option<SecretRef>,
    /// The bridge's MAC over the fields above that Destroy acts on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity: Option<String>,
    /// CreateVolume's accessible_topology: the nodes the volume can be attached on (absent:
    /// every node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<BTreeMap<String, String>>,
    /// The last expansion asks every node where the volume is staged or published to
    /// grow it to `capacityBytes` (NodeExpandVolume); node daemons watch for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub node_expansion_required: bool,
    /// What `restore` or `clone` made the volume from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<SpecContentSource>,
}

/// `spec.contentSource`: a snapshot (its name and CSI id) or a volume (its Cube and CSI
/// ids) the volume was made from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecContentSource {
    pub kind: SpecContentKind,
    /// The snapshot's name or the Cube volume id.
    pub id: String,
    /// The CSI snapshot id or CSI volume id.
    pub csi_id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpecContentKind {
    Snapshot,
    Volume,
}

impl From<&ContentSource> for SpecContentSource {
    fn from(source: &ContentSource) -> Self {
        match source {
            ContentSource::Snapshot {
                snapshot_id,
                csi_snapshot_id,
            } => SpecContentSource {
                kind: SpecContentKind::Snapshot,
                id: snapshot_id.clone(),
                csi_id: csi_snapshot_id.clone(),
            },
            ContentSource::Volume {
                volume_id,
                csi_volume_id,
            } => SpecContentSource {
                kind: SpecContentKind::Volume,
                id: volume_id.clone(),
                csi_id: csi_volume_id.clone(),
            },
        }
    }
}

impl From<SpecContentSource> for ContentSource {
    fn from(source: SpecContentSource) -> Self {
        match source.kind {
            SpecContentKind::Snapshot => ContentSource::Snapshot {
                snapshot_id: source.id,
                csi_snapshot_id: source.csi_id,
            },
            SpecContentKind::Volume => ContentSource::Volume {
                volume_id: source.id,
                csi_volume_id: source.csi_id,
            },
        }
    }
}

/// `spec.state`, spelled as Kubernetes enums are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpecState {
    Creating,
    Created,
    Deleting,
}

type CubeVolume = Object<CubeVolumeSpec, NotUsed>;

/// CubeVolume objects of one Cube driver, in one namespace.
#[derive(Debug)]
pub struct CubeVolumeStore {
    kube: Arc<Kube>,
    driver: String,
    resource: ApiResource,
    /// Set once a dry-run create showed the API server keeps every `spec` field.
    schema_checked: std::sync::OnceLock<()>,
}

impl CubeVolumeStore {
    pub fn new(kube: Arc<Kube>, driver: &str) -> Self {
        let gvk = GroupVersionKind::gvk(CRD_GROUP, CRD_VERSION, CRD_KIND);
        Self {
            kube,
            driver: driver.to_string(),
            resource: ApiResource::from_gvk_with_plural(&gvk, CRD_PLURAL),
            schema_checked: std::sync::OnceLock::new(),
        }
    }

    /// Checks, before the first record this store creates, that the API server keeps
    /// every field of a CubeVolume's `spec`: Helm never upgrades a CRD, and one older
    /// than this bridge has the fields added since pruned on write, silently. A record
    /// without its signed topology or content source then fails its MAC forever, and its
    /// volume can never be destroyed. One dry-run create with every field set; only a
    /// success is remembered, so a CRD applied meanwhile needs no restart.
    async fn check_schema(&self, api: &Api<CubeVolume>, namespace: &str) -> Result<(), StoreError> {
        if self.schema_checked.get().is_some() {
            return Ok(());
        }
        let probe = schema_probe(&self.driver);
        let mut object = CubeVolume::new("", &self.resource, probe.clone());
        object.metadata.name = None;
        object.metadata.generate_name = Some("cube-csi-bridge-schema-probe-".into());
        let params = PostParams {
            dry_run: true,
            ..Default::default()
        };
        match api.create(&params, &object).await {
            Ok(stored) => {
                self.check_stored(&probe, &stored)?;
                let _ = self.schema_checked.set(());
                Ok(())
            }
            // A dry run refused (an admission webhook that does not support one; a
            // missing CRD, which the write itself then names): what is left is each
            // write's own check. Not remembered: tried again at the next new record.
            Err(error) => {
                let error = self.failed("a dry-run create".into(), namespace, error);
                tracing::warn!(%error, "could not check the CubeVolume schema before writing; each write's stored spec is checked instead");
                Ok(())
            }
        }
    }

    /// Refuses a write whose object the API server stored with `spec` fields other than
    /// `sent` (pruned by an older CRD).
    fn check_stored(&self, sent: &CubeVolumeSpec, stored: &CubeVolume) -> Result<(), StoreError> {
        let dropped = super::spec_fields_changed(sent, &stored.spec);
        if dropped.is_empty() {
            return Ok(());
        }
        Err(StoreError::Backend {
            store: self.describe(),
            action: "writing a CubeVolume".into(),
            transient: false,
            source: format!(
                "the API server did not keep spec.{} as written: the CubeVolume \
                 CustomResourceDefinition installed is older than this bridge (Helm does not \
                 upgrade CRDs); apply the one in the chart's crds/ directory with kubectl \
                 apply -f, then retry",
                dropped.join(", spec.")
            )
            .into(),
        })
    }

    async fn api(&self) -> Result<(Api<CubeVolume>, &str), StoreError> {
        let (client, namespace) = self
            .kube
            .client()
            .await
            .map_err(|e| store_error("connecting".into(), e))?;
        Ok((
            Api::namespaced_with(client.clone(), namespace, &self.resource),
            namespace.as_str(),
        ))
    }

    /// Maps an API error, explaining the usual cause of a 404 on the collection.
    fn failed(&self, action: String, namespace: &str, error: kube::Error) -> StoreError {
        let missing_crd = matches!(&error, kube::Error::Api(s) if s.code == 404);
        let action = format!("{action} in namespace {namespace}");
        let mut e = KubeError::api(action.clone(), error);
        if missing_crd && let KubeError::Api { message, .. } = &mut e {
            message.push_str(
                " (is the CubeVolume CustomResourceDefinition installed? It is in the Helm \
                 chart's crds/ directory)",
            );
        }
        store_error(action, e)
    }
}

#[async_trait]
impl ControllerStore for CubeVolumeStore {
    async fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        let (api, namespace) = self.api().await?;
        let name = object_name(&self.driver, volume_id);
        match api.get(&name).await {
            Ok(object) => {
                let record = self.to_record(object)?;
                // Names carry a short hash: two ids may share one. Another volume's record
                // is never this one's (Destroy would delete the other volume).
                if record.volume_id != volume_id {
                    return Err(StoreError::Corrupt {
                        store: self.describe(),
                        what: format!("CubeVolume {name}"),
                        message: format!(
                            "it records volume {:?}, not {volume_id:?} (a name collision)",
                            record.volume_id
                        ),
                    });
                }
                Ok(Some(record))
            }
            Err(e) if object_absent(&e, &name) => Ok(None),
            Err(e) => Err(self.failed(format!("reading CubeVolume {name}"), namespace, e)),
        }
    }

    /// Creates (`record.revision` is None) or updates (it holds the version read) the
    /// object; on success `record.revision` is the new version.
    async fn put(&self, record: &mut VolumeRecord) -> Result<(), StoreError> {
        let (api, namespace) = self.api().await?;
        // A new record only: a Destroy of a record written before goes on (its write is
        // still checked below).
        if record.revision.is_none() {
            self.check_schema(&api, namespace).await?;
        }
        let name = object_name(&self.driver, &record.volume_id);
        let spec = self.to_spec(record);
        let mut object = CubeVolume::new(&name, &self.resource, spec.clone());
        object.metadata.labels = Some(BTreeMap::from([(
            DRIVER_LABEL.to_string(),
            self.driver.clone(),
        )]));
        if !record.answering_creates.is_empty() {
            object.metadata.annotations = Some(BTreeMap::from([(
                ANSWERING_CREATES_ANNOTATION.to_string(),
                record.answering_creates.join(","),
            )]));
        }
        let params = PostParams::default();
        let written = match record.revision.clone() {
            None => api.create(&params, &object).await,
            Some(version) => {
                object.metadata.resource_version = Some(version);
                api.replace(&name, &params, &object).await
            }
        };
        match written {
            Ok(object) => {
                record.revision = object.metadata.resource_version.clone();
                // A CRD replaced by an older one since the check: said now, not at the
                // volume's Destroy.
                self.check_stored(&spec, &object)
            }
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => {
                Err(StoreError::Conflict {
                    volume_id: record.volume_id.clone(),
                })
            }
            // Replacing an object deleted meanwhile: also a lost race.
            Err(e) if record.revision.is_some() && object_absent(&e, &name) => {
                Err(StoreError::Conflict {
                    volume_id: record.volume_id.clone(),
                })
            }
            Err(e) => Err(self.failed(format!("writing CubeVolume {name}"), namespace, e)),
        }
    }

    /// Deletes the object if it is still at `record.revision` (or unconditionally when
    /// that is None). Already gone is success.
    async fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        let (api, namespace) = self.api().await?;
        let name = object_name(&self.driver, &record.volume_id);
        let params = DeleteParams {
            preconditions: record.revision.clone().map(|version| Preconditions {
                resource_version: Some(version),
                uid: None,
            }),
            ..Default::default()
        };
        match api.delete(&name, &params).await {
            Ok(_) => Ok(()),
            Err(e) if object_absent(&e, &name) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_conflict() => Err(StoreError::Conflict {
                volume_id: record.volume_id.clone(),
            }),
            Err(e) => Err(self.failed(format!("deleting CubeVolume {name}"), namespace, e)),
        }
    }

    async fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        let (api, namespace) = self.api().await?;
        let params = ListParams::default().labels(&format!("{DRIVER_LABEL}={}", self.driver));
        let objects = api
            .list(&params)
            .await
            .map_err(|e| self.failed("listing CubeVolumes".into(), namespace, e))?;
        // One unusable object (edited by hand, another writer's) must not stop the sweep
        // and the signing pass for every other volume: it is reported and left out.
        Ok(objects
            .items
            .into_iter()
            .filter_map(|o| match self.to_record(o) {
                Ok(record) => Some(record),
                Err(error) => {
                    tracing::warn!(%error, "leaving an unusable CubeVolume out of the list");
                    None
                }
            })
            .collect())
    }

    fn describe(&self) -> String {
        format!("{CRD_KIND} objects ({CRD_GROUP}/{CRD_VERSION})")
    }

    fn locate(&self, volume_id: &str) -> String {
        let name = object_name(&self.driver, volume_id);
        match self.kube.namespace_hint() {
            Some(namespace) => format!("CubeVolume {namespace}/{name}"),
            None => format!("CubeVolume {name}"),
        }
    }
}

impl CubeVolumeStore {
    fn to_spec(&self, record: &VolumeRecord) -> CubeVolumeSpec {
        CubeVolumeSpec {
            driver: self.driver.clone(),
            volume_id: record.volume_id.clone(),
            csi_driver: record.csi_driver.clone(),
            csi_name: record.csi_name.clone(),
            state: match record.state {
                VolumeState::Creating => SpecState::Creating,
                VolumeState::Created => SpecState::Created,
                VolumeState::Deleting => SpecState::Deleting,
            },
            csi_volume_id: record.csi_volume_id.clone(),
            volume_context: record.volume_context.clone(),
            capacity_bytes: record.capacity_bytes,
            updated_at: record.updated_at,
            reclaim_policy: record
                .deletion
                .as_ref()
                .map(|d| if d.retain { "Retain" } else { "Delete" }.to_string()),
            provisioner_secret_ref: record.deletion.as_ref().and_then(|d| d.secret.clone()),
            integrity: record.integrity.clone(),
            content_source: record.content_source.as_ref().map(SpecContentSource::from),
            accessible_topology: record.accessible_topology.clone(),
            node_expansion_required: record.node_expansion_required,
        }
    }

    fn to_record(&self, object: CubeVolume) -> Result<VolumeRecord, StoreError> {
        let name = object.metadata.name.clone().unwrap_or_default();
        let spec = object.spec;
        if spec.driver != self.driver || object_name(&spec.driver, &spec.volume_id) != name {
            return Err(StoreError::Corrupt {
                store: self.describe(),
                what: format!("CubeVolume {name}"),
                message: format!(
                    "its spec (driver {:?}, volumeId {:?}) does not match its name; it was \
                     not written by this bridge",
                    spec.driver, spec.volume_id
                ),
            });
        }
        let deletion = spec.reclaim_policy.as_deref().map(|policy| DeletionPolicy {
            retain: policy == "Retain",
            secret: spec.provisioner_secret_ref.clone(),
        });
        let answering_creates = object
            .metadata
            .annotations
            .as_ref()
            .and_then(|annotations| annotations.get(ANSWERING_CREATES_ANNOTATION))
            .map(|list| {
                list.split(',')
                    .filter(|a| !a.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        Ok(VolumeRecord {
            answering_creates,
            deletion,
            volume_id: spec.volume_id,
            csi_name: spec.csi_name,
            csi_driver: spec.csi_driver,
            state: match spec.state {
                SpecState::Creating => VolumeState::Creating,
                SpecState::Created => VolumeState::Created,
                SpecState::Deleting => VolumeState::Deleting,
            },
            csi_volume_id: spec.csi_volume_id,
            volume_context: spec.volume_context,
            capacity_bytes: spec.capacity_bytes,
            updated_at: spec.updated_at,
            revision: object.metadata.resource_version,
            integrity: spec.integrity,
            content_source: spec.content_source.map(ContentSource::from),
            accessible_topology: spec.accessible_topology,
            node_expansion_required: spec.node_expansion_required,
        })
    }
}

/// A CubeVolume spec with every field set (values no record has), for the schema check.
fn schema_probe(driver: &str) -> CubeVolumeSpec {
    let one = BTreeMap::from([("k".to_string(), "v".to_string())]);
    CubeVolumeSpec {
        driver: driver.to_string(),
        volume_id: "schema-probe".into(),
        csi_driver: Some("probe.csi".into()),
        csi_name: "schema-probe".into(),
        state: SpecState::Created,
        csi_volume_id: Some("probe".into()),
        volume_context: one.clone(),
        capacity_bytes: 1,
        updated_at: 1,
        reclaim_policy: Some("Retain".into()),
        provisioner_secret_ref: Some(SecretRef {
            namespace: "probe".into(),
            name: "probe".into(),
        }),
        integrity: Some("probe".into()),
        accessible_topology: vec![one],
        node_expansion_required: true,
        content_source: Some(SpecContentSource {
            kind: SpecContentKind::Snapshot,
            id: "probe".into(),
            csi_id: "probe".into(),
        }),
    }
}

/// Whether an error says that object `name` does not exist. The API server names the
/// object in a 404's details; a 404 naming nothing ("the server could not find the
/// requested resource") means CubeVolumes are not served (no CRD) and says nothing of
/// the object.
fn object_absent(error: &kube::Error, name: &str) -> bool {
    let kube::Error::Api(status) = error else {
        return false;
    };
    status.is_not_found()
        && status.details.as_ref().is_some_and(|details| {
            details.name == name
                && (details.kind.eq_ignore_ascii_case(CRD_PLURAL)
                    || details.kind.eq_ignore_ascii_case(CRD_KIND))
        })
}

fn store_error(action: String, e: KubeError) -> StoreError {
    StoreError::Backend {
        store: format!("{CRD_KIND} objects"),
        action,
        transient: e.is_transient(),
        source: Box::new(e),
    }
}

/// The object name of a Cube volume: a readable DNS-1123 form of driver and volume_id,
/// then a hash of the exact pair, so volume ids differing only in case or in `_` versus
/// `-` never share an object.
pub fn object_name(driver: &str, volume_id: &str) -> String {
    let readable = dns_name_chars(&format!("{driver}-{volume_id}"));
    let readable = readable.trim_matches('-');
    let digest = Sha256::digest(format!("{driver}\0{volume_id}").as_bytes());
    let hash: String = digest.iter().take(5).map(|b| format!("{b:02x}")).collect();
    // 253 is the limit; stay well under it so names remain readable in kubectl.
    let keep: String = readable.chars().take(200).collect();
    let keep = keep.trim_end_matches('-');
    if keep.is_empty() {
        format!("v-{hash}")
    } else {
        format!("{keep}-{hash}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k8s::names::is_dns_subdomain;

    /// A 404 body as the API server sends it: `NewNotFound` for a missing object, or
    /// the catch-all for a resource it does not serve (empty details).
    fn not_found(body: serde_json::Value) -> kube::Error {
        kube::Error::Api(Box::new(serde_json::from_value(body).unwrap()))
    }

    #[test]
    fn only_a_404_naming_the_object_means_it_is_absent() {
        let name = object_name("nfs", "v1");
        let gone = not_found(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("cubevolumes.{CRD_GROUP} \"{name}\" not found"),
            "reason": "NotFound",
            "details": {"name": name, "group": CRD_GROUP, "kind": CRD_PLURAL},
            "code": 404
        }));
        assert!(object_absent(&gone, &name));
        // The CRD is not installed (or not served at this version): nothing is known
        // about the object, and Destroy must not take it as deleted.
        let unserved = not_found(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "the server could not find the requested resource",
            "reason": "NotFound", "details": {}, "code": 404
        }));
        assert!(!object_absent(&unserved, &name));
        let other = not_found(serde_json::json!({
            "status": "Failure", "reason": "NotFound", "code": 404,
            "details": {"name": "someone-else", "kind": CRD_PLURAL}
        }));
        assert!(!object_absent(&other, &name));
        let other_kind = not_found(serde_json::json!({
            "status": "Failure", "reason": "NotFound", "code": 404,
            "details": {"name": name, "kind": "namespaces"}
        }));
        assert!(!object_absent(&other_kind, &name));
    }

    #[test]
    fn object_names_are_valid_stable_and_distinct() {
        let a = object_name("nfs", "Vol_1");
        assert_eq!(a, object_name("nfs", "Vol_1"));
        assert!(a.starts_with("nfs-vol-1-"), "{a}");
        for name in [
            a.clone(),
            object_name("nfs", "vol-1"),
            object_name("x.y_z", "-leading"),
            object_name("-", "_"),
            object_name("nfs", &"A".repeat(128)),
        ] {
            assert!(is_dns_subdomain(&name) && name.len() <= 253, "{name}");
        }
        assert_ne!(a, object_name("nfs", "vol-1"));
        assert_ne!(a, object_name("nfs", "vol_1"));
    }

    #[test]
    fn spec_serializes_with_the_crd_field_names() {
        let spec = CubeVolumeSpec {
            driver: "nfs".into(),
            volume_id: "v1".into(),
            csi_driver: Some("nfs.csi.k8s.io".into()),
            csi_name: "cube-v1".into(),
            state: SpecState::Created,
            csi_volume_id: Some("h".into()),
            volume_context: BTreeMap::from([("k".into(), "v".into())]),
            capacity_bytes: 5,
            updated_at: 7,
            reclaim_policy: Some("Retain".into()),
            provisioner_secret_ref: Some(SecretRef {
                namespace: "default".into(),
                name: "creds".into(),
            }),
            integrity: Some("hmac-sha256-v1:00".into()),
            content_source: Some(SpecContentSource {
                kind: SpecContentKind::Snapshot,
                id: "s1".into(),
                csi_id: "cs1".into(),
            }),
            accessible_topology: vec![BTreeMap::from([("example.com/zone".into(), "a".into())])],
            node_expansion_required: true,
        };
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "driver": "nfs", "volumeId": "v1", "csiDriver": "nfs.csi.k8s.io",
                "csiName": "cube-v1", "state": "Created", "csiVolumeId": "h",
                "volumeContext": {"k": "v"}, "capacityBytes": 5, "updatedAt": 7,
                "reclaimPolicy": "Retain",
                "provisionerSecretRef": {"namespace": "default", "name": "creds"},
                "integrity": "hmac-sha256-v1:00", "nodeExpansionRequired": true,
                "accessibleTopology": [{"example.com/zone": "a"}],
                "contentSource": {"kind": "Snapshot", "id": "s1", "csiId": "cs1"}
            })
        );
    }
}
