//! The Kubernetes store of snapshot records: one namespaced CubeVolumeSnapshot object per
//! snapshot the bridge took, a kind of its own beside CubeVolume (a snapshot's name may
//! equal a volume id). Writes carry the resourceVersion they read, as CubeVolumes do.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::core::{ApiResource, GroupVersionKind, NotUsed, Object};
use serde::{Deserialize, Serialize};

use super::volumes::{CRD_GROUP, CRD_VERSION, DRIVER_LABEL, SpecState, object_name};
use super::{Kube, KubeError};
use crate::bridge::ports::{SnapshotStore, StoreError};
use crate::bridge::records::{SnapshotRecord, VolumeState};

pub const SNAPSHOT_KIND: &str = "CubeVolumeSnapshot";
pub const SNAPSHOT_PLURAL: &str = "cubevolumesnapshots";

/// The `spec` of a CubeVolumeSnapshot (see the chart's crds/ for the schema).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CubeVolumeSnapshotSpec {
    pub driver: String,
    pub snapshot_id: String,
    pub csi_driver: String,
    pub csi_name: String,
    pub source_volume_id: String,
    pub source_csi_volume_id: String,
    pub state: SpecState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_snapshot_id: Option<String>,
    #[serde(default)]
    pub size_bytes: i64,
    #[serde(default)]
    pub creation_time: u64,
    #[serde(default)]
    pub ready_to_use: bool,
    #[serde(default)]
    pub updated_at: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity: Option<String>,
}

type CubeVolumeSnapshot = Object<CubeVolumeSnapshotSpec, NotUsed>;

/// CubeVolumeSnapshot objects of one Cube driver, in one namespace.
#[derive(Debug)]
pub struct CubeSnapshotStore {
    kube: Arc<Kube>,
    driver: String,
    resource: ApiResource,
}

impl CubeSnapshotStore {
    pub fn new(kube: Arc<Kube>, driver: &str) -> Self {
        let gvk = GroupVersionKind::gvk(CRD_GROUP, CRD_VERSION, SNAPSHOT_KIND);
        Self {
            kube,
            driver: driver.to_string(),
            resource: ApiResource::from_gvk_with_plural(&gvk, SNAPSHOT_PLURAL),
        }
    }

    async fn api(&self) -> Result<(Api<CubeVolumeSnapshot>, &str), StoreError> {
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

    fn failed(&self, action: String, namespace: &str, error: kube::Error) -> StoreError {
        let missing_crd = matches!(&error, kube::Error::Api(s) if s.code == 404);
        let action = format!("{action} in namespace {namespace}");
        let mut e = KubeError::api(action.clone(), error);
        if missing_crd && let KubeError::Api { message, .. } = &mut e {
            message.push_str(
                " (is the CubeVolumeSnapshot CustomResourceDefinition installed? It is in \
                 the Helm chart's crds/ directory; helm does not add CRDs on upgrade: \
                 kubectl apply it)",
            );
        }
        store_error(action, e)
    }

    fn describe(&self) -> String {
        format!("{SNAPSHOT_KIND} objects ({CRD_GROUP}/{CRD_VERSION})")
    }

    fn to_spec(&self, r: &SnapshotRecord) -> CubeVolumeSnapshotSpec {
        CubeVolumeSnapshotSpec {
            driver: self.driver.clone(),
            snapshot_id: r.snapshot_id.clone(),
            csi_driver: r.csi_driver.clone(),
            csi_name: r.csi_name.clone(),
            source_volume_id: r.source_volume_id.clone(),
            source_csi_volume_id: r.source_csi_volume_id.clone(),
            state: match r.state {
                VolumeState::Creating => SpecState::Creating,
                VolumeState::Created => SpecState::Created,
                VolumeState::Deleting => SpecState::Deleting,
            },
            csi_snapshot_id: r.csi_snapshot_id.clone(),
            size_bytes: r.size_bytes,
            creation_time: r.creation_time,
            ready_to_use: r.ready_to_use,
            updated_at: r.updated_at,
            integrity: r.integrity.clone(),
        }
    }

    fn to_record(&self, object: CubeVolumeSnapshot) -> Result<SnapshotRecord, StoreError> {
        let name = object.metadata.name.clone().unwrap_or_default();
        let spec = object.spec;
        if spec.driver != self.driver || object_name(&spec.driver, &spec.snapshot_id) != name {
            return Err(StoreError::Corrupt {
                store: self.describe(),
                what: format!("{SNAPSHOT_KIND} {name}"),
                message: format!(
                    "its spec (driver {:?}, snapshotId {:?}) does not match its name; it was \
                     not written by this bridge",
                    spec.driver, spec.snapshot_id
                ),
            });
        }
        Ok(SnapshotRecord {
            snapshot_id: spec.snapshot_id,
            csi_name: spec.csi_name,
            csi_driver: spec.csi_driver,
            source_volume_id: spec.source_volume_id,
            source_csi_volume_id: spec.source_csi_volume_id,
            state: match spec.state {
                SpecState::Creating => VolumeState::Creating,
                SpecState::Created => VolumeState::Created,
                SpecState::Deleting => VolumeState::Deleting,
            },
            csi_snapshot_id: spec.csi_snapshot_id,
            size_bytes: spec.size_bytes,
            creation_time: spec.creation_time,
            ready_to_use: spec.ready_to_use,
            updated_at: spec.updated_at,
            revision: object.metadata.resource_version,
            integrity: spec.integrity,
        })
    }
}

#[async_trait]
impl SnapshotStore for CubeSnapshotStore {
    async fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotRecord>, StoreError> {
        let (api, namespace) = self.api().await?;
        let name = object_name(&self.driver, snapshot_id);
        match api.get(&name).await {
            Ok(object) => {
                let record = self.to_record(object)?;
                // Names carry a short hash: another snapshot's object is never this one's.
                if record.snapshot_id != snapshot_id {
                    return Err(StoreError::Corrupt {
                        store: self.describe(),
                        what: format!("{SNAPSHOT_KIND} {name}"),
                        message: format!(
                            "it records snapshot {:?}, not {snapshot_id:?} (a name collision)",
                            record.snapshot_id
                        ),
                    });
                }
                Ok(Some(record))
            }
            Err(e) if object_absent(&e, &name) => Ok(None),
            Err(e) => Err(self.failed(format!("reading {SNAPSHOT_KIND} {name}"), namespace, e)),
        }
    }

    async fn put_snapshot(&self, record: &mut SnapshotRecord) -> Result<(), StoreError> {
        let (api, namespace) = self.api().await?;
        let name = object_name(&self.driver, &record.snapshot_id);
        let mut object = CubeVolumeSnapshot::new(&name, &self.resource, self.to_spec(record));
        object.metadata.labels = Some(BTreeMap::from([(
            DRIVER_LABEL.to_string(),
            self.driver.clone(),
        )]));
        let params = PostParams::default();
        let written = match record.revision.clone() {
            None => api.create(&params, &object).await,
            Some(version) => {
                object.metadata.resource_version = Some(version);
                api.replace(&name, &params, &object).await
            }
        };
        let conflict = || StoreError::Conflict {
            volume_id: record.snapshot_id.clone(),
        };
        match written {
            Ok(object) => {
                record.revision = object.metadata.resource_version;
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => Err(conflict()),
            Err(e) if record.revision.is_some() && object_absent(&e, &name) => Err(conflict()),
            Err(e) => Err(self.failed(format!("writing {SNAPSHOT_KIND} {name}"), namespace, e)),
        }
    }

    async fn delete_snapshot(&self, record: &SnapshotRecord) -> Result<(), StoreError> {
        let (api, namespace) = self.api().await?;
        let name = object_name(&self.driver, &record.snapshot_id);
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
                volume_id: record.snapshot_id.clone(),
            }),
            Err(e) => Err(self.failed(format!("deleting {SNAPSHOT_KIND} {name}"), namespace, e)),
        }
    }

    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError> {
        let (api, namespace) = self.api().await?;
        let params = ListParams::default().labels(&format!("{DRIVER_LABEL}={}", self.driver));
        let objects = api
            .list(&params)
            .await
            .map_err(|e| self.failed(format!("listing {SNAPSHOT_KIND}s"), namespace, e))?;
        Ok(objects
            .items
            .into_iter()
            .filter_map(|o| match self.to_record(o) {
                Ok(record) => Some(record),
                Err(error) => {
                    tracing::warn!(%error, "leaving an unusable CubeVolumeSnapshot out of the list");
                    None
                }
            })
            .collect())
    }

    fn locate_snapshot(&self, snapshot_id: &str) -> String {
        let name = object_name(&self.driver, snapshot_id);
        match self.kube.namespace_hint() {
            Some(namespace) => format!("{SNAPSHOT_KIND} {namespace}/{name}"),
            None => format!("{SNAPSHOT_KIND} {name}"),
        }
    }
}

/// Whether an error says that object `name` does not exist (a 404 naming it; a 404
/// naming nothing means the kind is not served).
fn object_absent(error: &kube::Error, name: &str) -> bool {
    let kube::Error::Api(status) = error else {
        return false;
    };
    status.is_not_found()
        && status.details.as_ref().is_some_and(|details| {
            details.name == name
                && (details.kind.eq_ignore_ascii_case(SNAPSHOT_PLURAL)
                    || details.kind.eq_ignore_ascii_case(SNAPSHOT_KIND))
        })
}

fn store_error(action: String, e: KubeError) -> StoreError {
    StoreError::Backend {
        store: format!("{SNAPSHOT_KIND} objects"),
        action,
        transient: e.is_transient(),
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_serializes_with_the_crd_field_names() {
        let spec = CubeVolumeSnapshotSpec {
            driver: "nfs".into(),
            snapshot_id: "s1".into(),
            csi_driver: "nfs.csi.k8s.io".into(),
            csi_name: "cube-snap-s1".into(),
            source_volume_id: "v1".into(),
            source_csi_volume_id: "h1".into(),
            state: SpecState::Created,
            csi_snapshot_id: Some("cs1".into()),
            size_bytes: 5,
            creation_time: 6,
            ready_to_use: true,
            updated_at: 7,
            integrity: Some("hmac-sha256-v1:00".into()),
        };
        assert_eq!(
            serde_json::to_value(&spec).unwrap(),
            serde_json::json!({
                "driver": "nfs", "snapshotId": "s1", "csiDriver": "nfs.csi.k8s.io",
                "csiName": "cube-snap-s1", "sourceVolumeId": "v1", "sourceCsiVolumeId": "h1",
                "state": "Created", "csiSnapshotId": "cs1", "sizeBytes": 5,
                "creationTime": 6, "readyToUse": true, "updatedAt": 7,
                "integrity": "hmac-sha256-v1:00"
            })
        );
    }
}
