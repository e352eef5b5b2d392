//! The controller store: which CSI volume backs each Cube volume.
//!
//! Destroy carries only Cube's volume_id, so Create records the CSI handle here. The
//! store is a trait with two backends: one redb file (`embedded`, one controller host)
//! and CubeVolume objects in the Kubernetes API (implemented in `k8s/`, any number of
//! replicas). Both give records a revision: a write names the revision it read, and a
//! write over a newer one fails with `StoreError::Conflict` (optimistic concurrency).

use std::collections::BTreeMap;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// Any error a backend wraps.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A controller-store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Someone else changed the record since it was read.
    #[error("controller store: the record of volume {volume_id:?} was changed concurrently")]
    Conflict { volume_id: String },
    /// The backend failed; `transient` when retrying later could help (unreachable,
    /// overloaded, or busy past the wait bound).
    #[error("controller store {store}: {action}: {source}")]
    Backend {
        store: String,
        action: String,
        transient: bool,
        #[source]
        source: BoxError,
    },
    /// A record or the file cannot be read by this build.
    #[error("controller store {store}: {what}: {message}")]
    Corrupt {
        store: String,
        what: String,
        message: String,
    },
}

impl StoreError {
    /// Whether retrying later could help.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Backend {
                transient: true,
                ..
            }
        )
    }
}

/// Where a Cube volume's creation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeState {
    /// CreateVolume was sent but its answer is not known: a CSI volume of `csi_name`
    /// may exist.
    Creating,
    /// CreateVolume succeeded; `csi_volume_id` is the handle.
    Created,
    /// A sweep claimed an abandoned Create to delete what it may have made; a Create of
    /// the same volume must not adopt it.
    Deleting,
}

impl VolumeState {
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeState::Creating => "creating",
            VolumeState::Created => "created",
            VolumeState::Deleting => "deleting",
        }
    }
}

/// A Secret named by a StorageClass.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SecretRef {
    pub namespace: String,
    pub name: String,
}

/// How a volume is deleted, as its StorageClass said when it was created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeletionPolicy {
    /// `reclaimPolicy: Retain`: Destroy keeps the storage.
    pub retain: bool,
    /// The provisioner secret DeleteVolume gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<SecretRef>,
}

/// One Cube volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub volume_id: String,
    /// The CreateVolume name (the idempotency key).
    pub csi_name: String,
    /// The CSI driver (GetPluginInfo name) that created the volume; Destroy refuses to
    /// send its handle to another driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_driver: Option<String>,
    pub state: VolumeState,
    #[serde(default)]
    pub csi_volume_id: Option<String>,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    #[serde(default)]
    pub capacity_bytes: i64,
    /// Seconds since the Unix epoch.
    pub updated_at: u64,
    /// What Destroy needs, recorded at Create from the StorageClass (as a PersistentVolume
    /// records it) so that Destroy works even after the StorageClass changed or is gone.
    /// None: not recorded (config-file settings, or a record from before this existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion: Option<DeletionPolicy>,
    /// The version of the stored record this copy was read at; None for a record not
    /// yet stored. Set by the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The bridge's MAC over the fields Destroy acts on (bridge/integrity.rs); None for a
    /// record written before records were signed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity: Option<String>,
}

/// The controller store behind the bridge.
#[async_trait]
pub trait ControllerStore: Send + Sync + std::fmt::Debug {
    async fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError>;
    /// Stores `record` if the stored copy is still at `record.revision` (None: there must
    /// be none); then `record.revision` is the new revision.
    async fn put(&self, record: &mut VolumeRecord) -> Result<(), StoreError>;
    /// Deletes the record if it is still at `record.revision`; already gone is success.
    async fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError>;
    async fn list(&self) -> Result<Vec<VolumeRecord>, StoreError>;
    /// Where the records live, for messages.
    fn describe(&self) -> String;
    /// Where one volume's record lives, for messages that send an operator to it.
    fn locate(&self, volume_id: &str) -> String {
        format!("the record of volume {volume_id:?} in {}", self.describe())
    }
}

/// Seconds since the Unix epoch (for record timestamps).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
