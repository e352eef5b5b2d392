//! The core's ports: what the translation needs from a CSI driver, a mount table, the
//! source of volume settings and the stores, in the core's own types. `csi/`, `mount/`,
//! `store/` and `k8s/` implement them; tests implement them in memory.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use super::Deadline;
use super::records::{
    ContentSource, DeletionPolicy, HolderChange, HolderTimes, Holders, NodeRecord, SnapshotRecord,
    VolumeRecord,
};
use super::types::AccessMode;

/// A map of CSI secrets (or anything else that must never be printed). Debug shows the
/// keys only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets(pub BTreeMap<String, String>);

impl Secrets {
    pub fn values(&self) -> impl Iterator<Item = &str> {
        self.0.values().map(String::as_str)
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secrets{:?}", self.0.keys().collect::<Vec<_>>())
    }
}

impl From<BTreeMap<String, String>> for Secrets {
    fn from(map: BTreeMap<String, String>) -> Self {
        Secrets(map)
    }
}

/// The one VolumeCapability every call for a volume carries (always a mount volume).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Capability {
    pub access_mode: AccessMode,
    /// Empty lets the driver choose.
    pub fs_type: String,
    /// May hold credentials: never printed.
    pub mount_flags: Vec<String>,
}

impl fmt::Debug for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capability")
            .field("access_mode", &self.access_mode)
            .field("fs_type", &self.fs_type)
            .field(
                "mount_flags",
                &format_args!("<{} redacted>", self.mount_flags.len()),
            )
            .finish()
    }
}

/// The driver's identity and plugin-level capabilities.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DriverIdentity {
    /// The GetPluginInfo name.
    pub name: String,
    pub vendor_version: String,
    /// The driver advertises the CONTROLLER_SERVICE plugin capability.
    pub controller_service: bool,
    /// The driver advertises VOLUME_ACCESSIBILITY_CONSTRAINTS: its volumes may be
    /// reachable from some nodes only, and CreateVolume takes accessibility requirements.
    pub accessibility_constraints: bool,
    /// The VolumeExpansion plugin capability: whether volumes grow while published
    /// (None: not advertised, which a CO takes as offline).
    pub volume_expansion: Option<ExpansionMode>,
}

/// When a driver can grow a volume (the VolumeExpansion plugin capability).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpansionMode {
    /// While it is staged or published (ONLINE).
    Online,
    /// Only while no node has it staged or published (OFFLINE, or not advertised).
    Offline,
}

impl ExpansionMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ExpansionMode::Online => "online",
            ExpansionMode::Offline => "offline",
        }
    }
}

/// Controller capabilities the bridge acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ControllerCaps {
    pub create_delete_volume: bool,
    pub publish_unpublish_volume: bool,
    /// CREATE_DELETE_SNAPSHOT: `snapshot create|delete`, and `restore` from them.
    pub create_delete_snapshot: bool,
    /// LIST_SNAPSHOTS: `snapshot list` asks the driver how each snapshot is.
    pub list_snapshots: bool,
    /// CLONE_VOLUME: `clone`.
    pub clone_volume: bool,
    /// SINGLE_NODE_MULTI_WRITER: CreateVolume and ControllerPublish accept the access
    /// modes SINGLE_NODE_SINGLE_WRITER and SINGLE_NODE_MULTI_WRITER.
    pub single_node_multi_writer: bool,
    /// EXPAND_VOLUME: ControllerExpandVolume.
    pub expand_volume: bool,
}

/// Node capabilities the bridge acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeCaps {
    pub stage_unstage_volume: bool,
    pub get_volume_stats: bool,
    /// VOLUME_CONDITION: NodeGetVolumeStats says whether a volume is abnormal.
    pub volume_condition: bool,
    /// EXPAND_VOLUME: NodeExpandVolume.
    pub expand_volume: bool,
    /// SINGLE_NODE_MULTI_WRITER: NodeStage and NodePublish accept the access modes
    /// SINGLE_NODE_SINGLE_WRITER and SINGLE_NODE_MULTI_WRITER.
    pub single_node_multi_writer: bool,
    /// VOLUME_MOUNT_GROUP: NodeStage and NodePublish mount with the group id given in
    /// `volume_mount_group`.
    pub volume_mount_group: bool,
}

/// One CSI Topology: topological domains (keys such as `example.com/zone`) to segments
/// (values such as `zone-a`).
pub type Segments = BTreeMap<String, String>;

/// CreateVolume's accessibility_requirements (CSI TopologyRequirement): the volume must be
/// accessible from at least one `requisite` topology (when any is given), and the driver
/// tries the `preferred` ones first, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopologyRequirement {
    pub requisite: Vec<Segments>,
    pub preferred: Vec<Segments>,
}

/// Whether a volume whose accessible topology is `volume` can be used on a node whose
/// NodeGetInfo says `node` (CSI: accessible when every segment of some one of the
/// volume's topologies is present, with the same value, in the node's). A volume that
/// names no topology is accessible from every node.
pub fn accessible_from(volume: &[Segments], node: &Segments) -> bool {
    volume.is_empty()
        || volume
            .iter()
            .any(|topology| topology.iter().all(|(k, v)| node.get(k) == Some(v)))
}

/// Topologies as an operator reads them: `{zone=a,rack=1} or {zone=b}`; `any node` when
/// there are none.
pub fn describe_topologies(topologies: &[Segments]) -> String {
    if topologies.is_empty() {
        return "any node".to_string();
    }
    topologies
        .iter()
        .map(describe_segments)
        .collect::<Vec<_>>()
        .join(" or ")
}

/// One topology as `{zone=a,rack=1}`.
pub fn describe_segments(segments: &Segments) -> String {
    let inner = segments
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    format!("{{{inner}}}")
}

/// CreateVolume, as the core asks for it.
#[derive(Debug, Clone, Default)]
pub struct NewVolume {
    /// The idempotency key.
    pub name: String,
    /// 0 leaves the capacity range unset.
    pub required_bytes: u64,
    pub capability: Capability,
    pub parameters: BTreeMap<String, String>,
    pub secrets: Secrets,
    /// VolumeContentSource: a snapshot or a volume the new volume is a copy of.
    pub content_source: Option<ContentSource>,
    /// Where the volume must (or should) be accessible from; only sent to a driver with
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS.
    pub accessibility: Option<TopologyRequirement>,
}

/// What CreateVolume returned.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CreatedVolume {
    pub csi_volume_id: String,
    pub volume_context: BTreeMap<String, String>,
    /// 0 = unknown.
    pub capacity_bytes: i64,
    /// The nodes the volume is accessible from (empty: every node).
    pub accessible_topology: Vec<Segments>,
}

/// What NodeGetInfo says of this node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeInfo {
    pub node_id: String,
    /// Where this node sits (empty when the driver says nothing).
    pub accessible_topology: Segments,
}

/// ControllerPublishVolume.
#[derive(Debug, Clone)]
pub struct ControllerPublish {
    pub csi_volume_id: String,
    pub node_id: String,
    pub capability: Capability,
    pub volume_context: BTreeMap<String, String>,
    pub secrets: Secrets,
}

/// NodeStageVolume.
#[derive(Debug, Clone)]
pub struct Stage {
    pub csi_volume_id: String,
    pub staging_path: PathBuf,
    pub publish_context: BTreeMap<String, String>,
    pub volume_context: BTreeMap<String, String>,
    pub capability: Capability,
    pub secrets: Secrets,
    /// `volume_mount_group`: the group id the driver mounts with (VOLUME_MOUNT_GROUP).
    pub mount_group: Option<u32>,
}

/// NodePublishVolume.
#[derive(Debug, Clone)]
pub struct Publish {
    pub csi_volume_id: String,
    pub target_path: PathBuf,
    /// Set when the volume was staged.
    pub staging_path: Option<PathBuf>,
    pub publish_context: BTreeMap<String, String>,
    pub volume_context: BTreeMap<String, String>,
    pub capability: Capability,
    pub secrets: Secrets,
    /// `volume_mount_group`: the group id the driver mounts with (VOLUME_MOUNT_GROUP).
    pub mount_group: Option<u32>,
}

/// How an unpublish or unstage ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undone {
    /// The driver did it (or had nothing to do).
    Done,
    /// The driver no longer knows the volume (NOT_FOUND); the core decides from the mount
    /// table whether that is success.
    UnknownVolume,
}

/// Usage and health of one published volume (NodeGetVolumeStats).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeStats {
    pub total_bytes: Option<i64>,
    pub used_bytes: Option<i64>,
    pub available_bytes: Option<i64>,
    /// The driver's VOLUME_CONDITION, when it reports one: `Some(message)` if abnormal.
    pub abnormal: Option<String>,
}

/// ControllerExpandVolume.
#[derive(Debug, Clone)]
pub struct ControllerExpand {
    pub csi_volume_id: String,
    pub required_bytes: u64,
    pub capability: Capability,
    pub secrets: Secrets,
}

/// What ControllerExpandVolume answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControllerExpanded {
    /// 0 = not said.
    pub capacity_bytes: i64,
    /// NodeExpandVolume must follow on every node where the volume is staged or published.
    pub node_expansion_required: bool,
}

/// NodeExpandVolume.
#[derive(Debug, Clone)]
pub struct NodeExpand {
    pub csi_volume_id: String,
    /// Where the volume is available: the target when published, else the staging path.
    pub volume_path: PathBuf,
    /// Set when the volume is staged.
    pub staging_path: Option<PathBuf>,
    pub required_bytes: u64,
    pub capability: Capability,
    pub secrets: Secrets,
}

/// Whether a failed driver call may still be in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finality {
    /// Nothing is in progress (CSI's final codes).
    Final,
    /// The driver may still be working on it (CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE,
    /// RESOURCE_EXHAUSTED, ABORTED, or a transport failure): retried, and the step stays
    /// uncertain.
    Uncertain,
    /// The endpoint does not serve this call at all.
    Unimplemented,
}

/// A driver call that did not succeed, with everything an operator needs: which call, at
/// which endpoint, the status the driver answered, its own message, and how hard we tried.
#[derive(Debug, Clone)]
pub struct DriverError {
    /// The CSI RPC name, e.g. `NodePublishVolume`.
    pub call: &'static str,
    pub endpoint: String,
    /// The gRPC status name and number the driver (or the transport) answered.
    pub status: &'static str,
    pub grpc_code: i32,
    pub finality: Finality,
    /// The driver's message (or the transport's, when the driver was not reached).
    pub message: String,
    pub attempts: u32,
    /// Set when the hook's budget ran out while the call kept failing non-finally.
    pub gave_up_after: Option<Duration>,
}

impl DriverError {
    /// The driver may still be working on it.
    pub fn is_uncertain(&self) -> bool {
        self.finality == Finality::Uncertain
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CSI {} ", self.call)?;
        match self.gave_up_after {
            Some(elapsed) => write!(
                f,
                "did not succeed within its budget ({} attempts in {:.1}s); last error",
                self.attempts,
                elapsed.as_secs_f64()
            )?,
            None => write!(f, "failed")?,
        }
        write!(
            f,
            " from {}: {}: {}",
            self.endpoint, self.status, self.message
        )
    }
}

impl std::error::Error for DriverError {}

impl DriverError {
    /// The answer of an endpoint that does not serve `call` (what a port without it says).
    pub fn unimplemented(call: &'static str, endpoint: &str) -> Self {
        DriverError {
            call,
            endpoint: endpoint.to_string(),
            status: "Unimplemented",
            grpc_code: 12,
            finality: Finality::Unimplemented,
            message: format!("{call} is not served here"),
            attempts: 1,
            gave_up_after: None,
        }
    }
}

/// The controller side of a CSI driver (the endpoint in `csi.controller_endpoint`, else
/// `csi.endpoint`). NOT_FOUND from deletes and unpublishes is success here.
#[async_trait]
pub trait ControllerDriver: Send + Sync {
    /// Where the driver is, for messages.
    fn endpoint(&self) -> &str;
    /// Probe until ready, GetPluginInfo, GetPluginCapabilities.
    async fn identity(&self, deadline: &Deadline) -> Result<DriverIdentity, DriverError>;
    async fn capabilities(&self, deadline: &Deadline) -> Result<ControllerCaps, DriverError>;
    async fn create_volume(
        &self,
        volume: &NewVolume,
        deadline: &Deadline,
    ) -> Result<CreatedVolume, DriverError>;
    async fn delete_volume(
        &self,
        csi_volume_id: &str,
        secrets: &Secrets,
        deadline: &Deadline,
    ) -> Result<(), DriverError>;
    /// Returns the publish_context.
    async fn publish(
        &self,
        call: &ControllerPublish,
        deadline: &Deadline,
    ) -> Result<BTreeMap<String, String>, DriverError>;
    async fn unpublish(
        &self,
        csi_volume_id: &str,
        node_id: &str,
        secrets: &Secrets,
        deadline: &Deadline,
    ) -> Result<(), DriverError>;
    /// ControllerExpandVolume (only asked of a driver with EXPAND_VOLUME).
    async fn expand_volume(
        &self,
        call: &ControllerExpand,
        deadline: &Deadline,
    ) -> Result<ControllerExpanded, DriverError> {
        let _ = (call, deadline);
        Err(DriverError::unimplemented(
            "ControllerExpandVolume",
            self.endpoint(),
        ))
    }
    /// CreateSnapshot (idempotent by `name`).
    async fn create_snapshot(
        &self,
        snapshot: &NewSnapshot,
        deadline: &Deadline,
    ) -> Result<SnapshotInfo, DriverError>;
    /// DeleteSnapshot; NOT_FOUND is success.
    async fn delete_snapshot(
        &self,
        csi_snapshot_id: &str,
        secrets: &Secrets,
        deadline: &Deadline,
    ) -> Result<(), DriverError>;
    /// ListSnapshots of one snapshot id: None when the driver does not know it.
    async fn get_snapshot(
        &self,
        csi_snapshot_id: &str,
        secrets: &Secrets,
        deadline: &Deadline,
    ) -> Result<Option<SnapshotInfo>, DriverError>;
}

/// CreateSnapshot, as the core asks for it.
#[derive(Debug, Clone)]
pub struct NewSnapshot {
    /// The idempotency key.
    pub name: String,
    pub source_csi_volume_id: String,
    pub secrets: Secrets,
}

/// A snapshot as the driver describes it (CreateSnapshot, ListSnapshots).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SnapshotInfo {
    pub csi_snapshot_id: String,
    pub source_csi_volume_id: String,
    /// 0 = unknown.
    pub size_bytes: i64,
    /// Seconds since the epoch; 0 = unknown.
    pub creation_time: u64,
    pub ready_to_use: bool,
}

/// The node side of a CSI driver (`csi.endpoint`).
#[async_trait]
pub trait NodeDriver: Send + Sync {
    fn endpoint(&self) -> &str;
    /// Probe until ready; the driver's answer to whether it is healthy.
    async fn probe(&self, deadline: &Deadline) -> Result<(), DriverError>;
    async fn capabilities(&self, deadline: &Deadline) -> Result<NodeCaps, DriverError>;
    /// NodeGetInfo's node_id.
    async fn node_id(&self, deadline: &Deadline) -> Result<String, DriverError>;
    async fn stage(&self, call: &Stage, deadline: &Deadline) -> Result<(), DriverError>;
    async fn unstage(
        &self,
        csi_volume_id: &str,
        staging_path: &Path,
        deadline: &Deadline,
    ) -> Result<Undone, DriverError>;
    async fn publish(&self, call: &Publish, deadline: &Deadline) -> Result<(), DriverError>;
    async fn unpublish(
        &self,
        csi_volume_id: &str,
        target_path: &Path,
        deadline: &Deadline,
    ) -> Result<Undone, DriverError>;
    async fn volume_stats(
        &self,
        csi_volume_id: &str,
        target_path: &Path,
        deadline: &Deadline,
    ) -> Result<VolumeStats, DriverError>;
    /// NodeGetInfo: the node id and where the node sits.
    async fn node_info(&self, deadline: &Deadline) -> Result<NodeInfo, DriverError>;
    /// NodeExpandVolume (only asked of a driver with node EXPAND_VOLUME); returns the
    /// capacity the driver reports (0 = not said).
    async fn expand_volume(
        &self,
        call: &NodeExpand,
        deadline: &Deadline,
    ) -> Result<i64, DriverError> {
        let _ = (call, deadline);
        Err(DriverError::unimplemented(
            "NodeExpandVolume",
            self.endpoint(),
        ))
    }
}

/// What a mount-table query can say about a path, as Cubelet sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visibility {
    Mounted,
    NotMounted,
    /// Checks are disabled (`node.mount_view = "none"`): the journal and the driver's
    /// answers are trusted.
    Unchecked,
}

/// Whether the filesystem mounted at a path still answers (`MountCheck::health`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountHealth {
    /// It answered (or nothing is mounted there: `visibility` says which).
    Answers,
    /// It is still a mount point, but its filesystem is gone: a FUSE daemon or a network
    /// server that restarted or went away. Handing it to a sandbox hands it errors.
    Dead(DeadMount),
}

/// The error a dead mount answers a stat with (ENOTCONN, ESTALE, EIO, EHOSTDOWN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadMount {
    pub errno: i32,
    /// The errno's symbolic name, e.g. `ENOTCONN`.
    pub name: &'static str,
}

impl fmt::Display for DeadMount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = std::io::Error::from_raw_os_error(self.errno).to_string();
        let text = text.split(" (os error").next().unwrap_or(&text);
        write!(f, "{}: {text}", self.name)
    }
}

/// The mount table where Cubelet looks.
#[async_trait]
pub trait MountCheck: Send + Sync {
    /// Whether `path` is a mount point (a symlinked parent is resolved first). Bounded
    /// by `deadline`: a hung filesystem is an error, not a hang.
    async fn visibility(
        &self,
        path: &Path,
        deadline: &Deadline,
    ) -> Result<Visibility, std::io::Error>;
    /// Whether the filesystem mounted at `path` still answers: one stat that its
    /// filesystem must answer itself, not from a cache (a dead FUSE or NFS mount answers
    /// a cached stat, and the mount table still lists it). Bounded by `deadline`: a
    /// filesystem that does not answer in time is an error.
    async fn health(&self, path: &Path, deadline: &Deadline)
    -> Result<MountHealth, std::io::Error>;
    /// A short description for messages.
    fn describe(&self) -> String;
}

/// Which CSI calls a set of secrets is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SecretUse {
    /// CreateVolume and DeleteVolume.
    Provisioner,
    /// ControllerPublishVolume and ControllerUnpublishVolume.
    ControllerPublish,
    NodeStage,
    NodePublish,
    /// ControllerExpandVolume (`cube-csi-bridge expand`).
    ControllerExpand,
    /// NodeExpandVolume.
    NodeExpand,
}

/// What every volume of this bridge instance is made of, resolved for one call.
#[derive(Debug, Clone)]
pub struct VolumeSpec {
    pub parameters: BTreeMap<String, String>,
    pub capability: Capability,
    /// How Destroy will delete the volume, recorded at Create (StorageClass only).
    pub deletion: Option<DeletionPolicy>,
}

/// Reading the settings failed (a StorageClass or Secret could not be read or used).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct SettingsError {
    pub message: String,
    /// Retrying later could help (the API server was unreachable or overloaded).
    pub transient: bool,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// Where volume parameters, the capability and the secrets come from: the config file, or
/// a StorageClass and the Secrets it references.
#[async_trait]
pub trait VolumeSettings: Send + Sync {
    /// The settings for this instance's volumes. `driver_name` (GetPluginInfo) is checked
    /// against a StorageClass's provisioner.
    async fn spec(&self, driver_name: &str) -> Result<VolumeSpec, SettingsError>;
    /// The secrets for one family of calls.
    async fn secrets(&self, usage: SecretUse) -> Result<Secrets, SettingsError>;
    /// DeleteVolume's secrets for a volume whose Create recorded `deletion`.
    async fn deletion_secrets(
        &self,
        deletion: Option<&DeletionPolicy>,
    ) -> Result<Secrets, SettingsError>;
    /// Checks, before serving, that the settings can be read and fit the driver; returns
    /// a line for the log.
    async fn check(&self, driver_name: Option<&str>) -> Result<Option<String>, SettingsError>;
}

/// Any error a store backend wraps.
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

/// The controller store's snapshot records (`snapshot create|list|delete`), kept beside
/// the volume records with the same optimistic concurrency. Conflicts name the snapshot
/// in `StoreError::Conflict::volume_id`.
#[async_trait]
pub trait SnapshotStore: Send + Sync + std::fmt::Debug {
    async fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotRecord>, StoreError>;
    /// Stores `record` if the stored copy is still at `record.revision` (None: there must
    /// be none); then `record.revision` is the new revision.
    async fn put_snapshot(&self, record: &mut SnapshotRecord) -> Result<(), StoreError>;
    /// Deletes the record if it is still at `record.revision`; already gone is success.
    async fn delete_snapshot(&self, record: &SnapshotRecord) -> Result<(), StoreError>;
    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError>;
    /// Where one snapshot's record lives, for messages.
    fn locate_snapshot(&self, snapshot_id: &str) -> String;
}

/// Why a record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("node journal {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Unreadable content (a torn write after a power loss, or another build's format).
    #[error("node journal record {path} is unusable: {message}")]
    Corrupt { path: PathBuf, message: String },
}

/// The node journal (store/journal.rs): one record per attached volume, written before
/// each mutating CSI call; a log of holder changes per volume, folded into the record at
/// its next rewrite; and a marker per volume whose operation is under way. Calls block
/// on the file system: the core runs them off the async threads where they may wait.
pub trait NodeJournal: Send + Sync + fmt::Debug {
    /// The record of `volume_id` with its holder log applied, if the node holds one.
    fn load(&self, volume_id: &str) -> Result<Option<NodeRecord>, JournalError>;
    /// Writes `record` (holders included) and empties its holder log; `durable` waits
    /// until it is on disk (before a CSI call).
    fn save(&self, record: &NodeRecord, durable: bool) -> Result<(), JournalError>;
    /// The holders the holder log alone says, when it is complete on its own (it begins
    /// with the snapshot its record's last save wrote); None when it is absent, partial or
    /// unreadable. Lets a record that cannot be read be rebuilt without losing holders.
    /// Their times come with them.
    fn load_holders(
        &self,
        volume_id: &str,
    ) -> Result<Option<(Holders, HolderTimes)>, JournalError> {
        let _ = volume_id;
        Ok(None)
    }
    /// Records one holder change cheaply; returns the size of the changes logged since the
    /// last save, so that the core can fold a long log into the record
    /// (`HOLDER_LOG_LIMIT`).
    fn append_holder(&self, volume_id: &str, change: &HolderChange) -> Result<u64, JournalError>;
    /// The size of the changes after the snapshot in `volume_id`'s holder log as this
    /// process last loaded it (0 when it has not), read from memory: lets the core fold a
    /// long log before it appends the next change rather than after.
    fn holder_log_changes(&self, volume_id: &str) -> u64;
    /// Keeps when each namespace of `last_hook` last hooked a volume whose record is
    /// going (a teardown), so that the namespace's holders of other volumes are not
    /// judged stale for want of it. Off the hot path. Default: not kept.
    fn keep_last_hooks(&self, last_hook: &BTreeMap<String, u64>) -> Result<(), JournalError> {
        let _ = last_hook;
        Ok(())
    }
    /// The last hooks `keep_last_hooks` kept, by namespace.
    fn kept_last_hooks(&self) -> Result<BTreeMap<String, u64>, JournalError> {
        Ok(BTreeMap::new())
    }
    /// Forgets `volume_id` (after a complete teardown).
    fn remove(&self, volume_id: &str) -> Result<(), JournalError>;
    /// Every volume id with a record or a holder log.
    fn volume_ids(&self) -> Result<BTreeSet<String>, JournalError>;
    /// Marks `volume_id` as having an operation under way; the mark outlives the process.
    fn mark_pending(&self, volume_id: &str) -> Result<(), JournalError>;
    /// The operation on `volume_id` ended with the volume settled or gone.
    fn clear_pending(&self, volume_id: &str) -> Result<(), JournalError>;
    /// Volumes marked pending, with when each was marked (None if unknown).
    fn pending_since(&self) -> Result<Vec<(String, Option<SystemTime>)>, JournalError>;
    /// Volumes marked pending.
    fn pending(&self) -> Result<Vec<String>, JournalError> {
        Ok(self
            .pending_since()?
            .into_iter()
            .map(|(volume, _)| volume)
            .collect())
    }
}

/// The wall clock and the boot (system.rs): records carry when they were made and in
/// which boot, so that holders of an earlier boot never keep a volume attached.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Seconds since the Unix epoch.
    fn now_secs(&self) -> u64;
    /// This boot's id; an error when the host does not say.
    fn boot_id(&self) -> std::io::Result<String>;
}

/// Which side's operations a volume lock serializes (Create/Destroy and Attach/Detach of
/// one volume touch different state and may overlap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockScope {
    Controller,
    Node,
}

impl LockScope {
    pub fn as_str(self) -> &'static str {
        match self {
            LockScope::Controller => "controller",
            LockScope::Node => "node",
        }
    }
}

/// Held while one hook works on one volume; dropping it releases the lock.
pub type LockGuard = Box<dyn std::any::Any + Send>;

/// Where a hook that may be cancelled at an await leaves the volume's lock while it waits,
/// so that whatever must follow its cancellation takes the lock over instead of queueing
/// behind the hooks that came after it (`NodeSide::attach_if_hot`).
#[derive(Default)]
pub struct KeptLock(std::sync::Mutex<Option<LockGuard>>);

impl KeptLock {
    pub fn keep(&self, guard: LockGuard) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(guard);
    }

    /// The lock left here, if any.
    pub fn take(&self) -> Option<LockGuard> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl fmt::Debug for KeptLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kept = self.0.lock().map(|slot| slot.is_some()).unwrap_or(false);
        f.debug_struct("KeptLock").field("kept", &kept).finish()
    }
}

/// One operation per volume and scope at a time, across every process that shares the
/// state (store/locks.rs: an in-process queue and a file lock).
#[async_trait]
pub trait VolumeLocks: Send + Sync + fmt::Debug {
    /// Takes the volume's lock if nobody holds it, without waiting.
    fn try_acquire(
        &self,
        scope: LockScope,
        volume_id: &str,
    ) -> Result<Option<LockGuard>, super::BridgeError>;
    /// Waits for the volume's lock until the deadline (`BridgeError::Busy` after it).
    async fn acquire(
        &self,
        scope: LockScope,
        volume_id: &str,
        deadline: &Deadline,
    ) -> Result<LockGuard, super::BridgeError>;
}

/// Where the core reports what it did (metrics.rs exports it); every method is cheap
/// and never fails.
pub trait Recorder: Send + Sync + fmt::Debug {
    /// One hook finished with `outcome` ("success" or a `BridgeError::kind`).
    fn hook(&self, hook: &'static str, outcome: &'static str, elapsed: Duration);
    /// A failed hook's own work was undone ("undone") or could not be ("failed").
    fn rollback(&self, hook: &'static str, outcome: &'static str);
    /// Reconciliation found `count` volumes in the state `finding`.
    fn reconcile_finding(&self, finding: &'static str, count: usize);
    /// The sweep of abandoned Creates found `count` records in the state `finding`.
    fn sweep_finding(&self, finding: &'static str, count: usize);
    /// The node's attached volumes and holders, now.
    fn node_inventory(&self, attached_volumes: usize, holders: usize);
    /// Holders on this node whose namespace has gone quiet (staleness.rs), now.
    fn stale_holders(&self, count: usize);
    /// One attached volume's usage (None: unknown now).
    fn volume_stats(&self, volume_id: &str, stats: Option<&VolumeStats>);
    /// Volumes not in `keep` are no longer attached: drop their series.
    fn forget_volumes_except(&self, keep: &BTreeSet<String>);
    /// One attached volume's condition from the periodic check: abnormal (a dead mount,
    /// or the driver's VolumeCondition) or not; None drops its series (detached).
    fn volume_condition(&self, volume_id: &str, abnormal: Option<bool>);
}

/// A recorder that keeps nothing (tests, one-shot commands).
#[derive(Debug, Default)]
pub struct NoRecorder;

impl Recorder for NoRecorder {
    fn hook(&self, _: &'static str, _: &'static str, _: Duration) {}
    fn rollback(&self, _: &'static str, _: &'static str) {}
    fn reconcile_finding(&self, _: &'static str, _: usize) {}
    fn sweep_finding(&self, _: &'static str, _: usize) {}
    fn node_inventory(&self, _: usize, _: usize) {}
    fn stale_holders(&self, _: usize) {}
    fn volume_stats(&self, _: &str, _: Option<&VolumeStats>) {}
    fn forget_volumes_except(&self, _: &BTreeSet<String>) {}
    fn volume_condition(&self, _: &str, _: Option<bool>) {}
}

/// What was found at a path under a volume base dir: its owner and mode bits (from an
/// lstat: a symlink's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub uid: u32,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "owner uid {}, mode {:04o}", self.uid, self.mode)
    }
}

/// Why a path under a volume base dir was not used. Nothing was done to it.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    /// The path is not what the bridge makes or accepts: the base dir has an owner or mode
    /// that lets another user swap what lies under it, or something under the base dir is
    /// a symlink, not a directory, or not made by the bridge.
    #[error(
        "refusing {path}: it {problem}{}; the bridge mounts there as root. {hint}",
        found.map(|f| format!(" ({f})")).unwrap_or_default()
    )]
    Refused {
        path: PathBuf,
        problem: String,
        found: Option<Found>,
        hint: &'static str,
    },
    /// The path could not be made or checked.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A leaf under the base dir, once checked: what the bridge may hand the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaf {
    /// A real directory (perhaps a mount point), reached without following a symlink.
    Dir,
    /// Nothing there (or its parent is missing): nothing can be mounted at it.
    Missing,
}

/// The directories the node side makes, checks and removes around the driver's calls
/// (the CO's part of the CSI contract), on the host (mount/host_paths.rs). Synchronous:
/// the core runs them where they may block.
///
/// A *verified* path is `<base>/<leaf>` or `<base>/.staging/<leaf>` where the base dir
/// (its own name resolved as given: node.allowed_base_dirs vets where it leads) is a
/// directory its policy accepts (by default owned by root or this process's euid and not
/// writable by group or others), `.staging` is a real directory the bridge could have made
/// (owned by root or the euid, not writable by group or others), and every component
/// below the base is reached without following a symlink. The leaf itself is a real
/// directory or missing.
pub trait HostPaths: Send + Sync + fmt::Debug {
    /// Makes the volume base dir and its missing parents (Cubelet normally has), then
    /// checks it as above.
    fn ensure_base_dir(&self, base: &Path) -> Result<(), PathError>;
    /// Makes `<base>/.staging` and the staging dir `path` in it (or takes back the one
    /// `park_staging_dir` kept aside), one level at a time without following symlinks,
    /// and checks both.
    fn ensure_staging_dir(&self, base: &Path, path: &Path) -> Result<(), PathError>;
    /// Checks `path` (under `base`) as above, just before it is handed to the driver.
    fn verify(&self, base: &Path, path: &Path) -> Result<Leaf, PathError>;
    /// Removes `path` (under `base`, verified first) if it exists and is empty;
    /// `Ok(false)` when it is left in place (missing, or still holding files: data is
    /// never deleted here). A path that fails the check is `Err(Refused)`, untouched.
    fn remove_dir_if_empty(&self, base: &Path, path: &Path) -> Result<bool, PathError>;
    /// What a last Detach does with the volume's staging dir: as `remove_dir_if_empty`,
    /// but an implementation may keep the empty dir aside, out of `.staging`, for the
    /// volume's next first Attach (`ensure_staging_dir` takes it back), and remove it
    /// later if no Attach does. `Ok(true)`: it is gone from its path.
    fn park_staging_dir(&self, base: &Path, path: &Path) -> Result<bool, PathError> {
        self.remove_dir_if_empty(base, path)
    }
    /// Whether the calls above may be made for `base` on the caller's own thread: its
    /// filesystem answers from memory or a local disk, so none of them can wait on a
    /// server (the leaves, perhaps mounts of a network filesystem, are asked without
    /// revalidation). Otherwise a daemon makes them on a blocking thread, bounded by the
    /// hook's deadline. False unless an implementation knows.
    fn answers_at_once(&self, _base: &Path) -> bool {
        false
    }
}
