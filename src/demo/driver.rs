//! A small but real CSI driver built into the program: each volume is a subdirectory of a
//! data directory; NodeStage bind-mounts it at the staging path and NodePublish bind-mounts
//! the staging path (or, without staging, the volume) at the target.
//!
//! It is the project's one CSI driver double: it serves the demo, the tests
//! (tests/common/fake_driver.rs) and the benchmark suite (benches/suite/fake_csi.rs). A
//! [`Profile`] sets what it advertises, how it names things and how long every call takes,
//! and it can record every call, react to the next calls of a method as scripted (fail,
//! fail echoing the request's secrets, answer late, or hold the call until released), and
//! tell a waiting test when the Nth call of a method has arrived.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tonic::{Code, Request, Response, Status};

use crate::mount::ops;
use crate::proto::csi::v1 as csi;
use csi::controller_server::{Controller, ControllerServer};
use csi::identity_server::{Identity, IdentityServer};
use csi::node_server::{Node, NodeServer};

/// The demo driver's CSI name.
pub const DRIVER_NAME: &str = "local.csi.cube-csi-bridge";

/// What the driver advertises, and how it names volumes.
#[derive(Debug, Clone)]
pub struct Profile {
    /// GetPluginInfo's name.
    pub name: String,
    /// NodeGetInfo's node id.
    pub node_id: String,
    /// A volume's CSI id is this prefix and its CreateVolume name.
    pub volume_id_prefix: String,
    /// The volume_context CreateVolume returns.
    pub volume_context: BTreeMap<String, String>,
    /// Node STAGE_UNSTAGE_VOLUME.
    pub stage: bool,
    /// Controller PUBLISH_UNPUBLISH_VOLUME.
    pub controller_publish: bool,
    /// Advertise CONTROLLER_SERVICE but answer UNIMPLEMENTED to controller calls (a
    /// node-only deployment of a driver whose controller runs elsewhere).
    pub controller_unreachable: bool,
    /// Keep every call for [`LocalDirDriver::calls`] (tests; the list only grows).
    pub record_calls: bool,
    /// Node GET_VOLUME_STATS: NodeGetVolumeStats answers `statvfs` of the volume path.
    pub volume_stats: bool,
    /// Node VOLUME_CONDITION: NodeGetVolumeStats also reports each volume's condition,
    /// normal unless a test made it abnormal ([`LocalDirDriver::set_abnormal`]).
    pub volume_condition: bool,
    /// CreateVolume and DeleteVolume bind-mount the data directory (the "share") at a
    /// working directory below this one, make or remove the volume's subdirectory
    /// through that mount and unmount it again, as csi-driver-nfs mounts its share.
    pub share_mount_dir: Option<PathBuf>,
    /// NodePublishVolume onto a target that is already a mount point checks that the
    /// volume is what is mounted there (ALREADY_EXISTS otherwise). Without it the driver
    /// answers success whatever is mounted, as csi-driver-nfs and csi-driver-host-path do.
    pub verifies_existing_mount: bool,
    /// Keeps a list of each volume's published targets as csi-driver-host-path does:
    /// NodePublish onto a target that is not mounted adds it again (even if listed),
    /// NodeUnpublish of a listed target removes it once (and of an unlisted one does
    /// nothing), and NodeUnstage fails with FAILED_PRECONDITION while any is listed.
    pub counts_publishes: bool,
    /// Every call waits this long before it is answered (the benchmark's slow driver);
    /// zero for none.
    pub latency: Duration,
    /// NodeStage (NodePublish without staging) of a volume with no directory makes it, as
    /// if the volume had been provisioned elsewhere: the benchmark attaches volumes it
    /// never created (their CSI handle comes in Cube's private_data).
    pub volumes_on_first_use: bool,
    /// Controller CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS and CLONE_VOLUME: a snapshot is a
    /// copy of the volume's directory under `<data_dir>/.snapshots/`, and CreateVolume
    /// from a snapshot or a volume copies it into the new volume. DeleteSnapshot fails
    /// with FAILED_PRECONDITION while a volume restored from the snapshot exists, as
    /// drivers whose restored volumes share the snapshot's blocks answer.
    pub snapshots: bool,
    /// Where this node sits: advertise VOLUME_ACCESSIBILITY_CONSTRAINTS, report these
    /// segments in NodeGetInfo, and answer CreateVolume with one accessible topology: the
    /// first preferred one asked for, else the first requisite one, else this node's.
    pub topology: Option<BTreeMap<String, String>>,
    /// Node VOLUME_MOUNT_GROUP (the group is recorded, not applied: bind mounts keep the
    /// source's owners).
    pub volume_mount_group: bool,
    /// Controller and node SINGLE_NODE_MULTI_WRITER.
    pub single_node_multi_writer: bool,
    /// How it grows volumes (every volume is a directory, so growing only changes the
    /// capacity it reports); the default grows none.
    pub expansion: ExpansionProfile,
}

/// What the driver advertises for volume expansion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpansionProfile {
    /// Controller EXPAND_VOLUME: ControllerExpandVolume.
    pub controller: bool,
    /// Node EXPAND_VOLUME: NodeExpandVolume.
    pub node: bool,
    /// The VolumeExpansion plugin capability: Some(true) ONLINE, Some(false) OFFLINE
    /// (ControllerExpandVolume then refuses a volume that is staged or published, as
    /// drivers of block devices do).
    pub online: Option<bool>,
    /// ControllerExpandVolume's node_expansion_required.
    pub node_expansion_required: bool,
}

impl Profile {
    /// The demo's driver: stages, no ControllerPublish, the CreateVolume name is the id.
    pub fn demo(node_id: &str) -> Self {
        Self {
            name: DRIVER_NAME.into(),
            node_id: node_id.into(),
            volume_id_prefix: String::new(),
            volume_context: BTreeMap::new(),
            stage: true,
            controller_publish: false,
            controller_unreachable: false,
            record_calls: false,
            volume_stats: false,
            volume_condition: false,
            share_mount_dir: None,
            verifies_existing_mount: false,
            counts_publishes: false,
            latency: Duration::ZERO,
            volumes_on_first_use: false,
            snapshots: true,
            topology: None,
            volume_mount_group: false,
            single_node_multi_writer: false,
            expansion: ExpansionProfile::default(),
        }
    }
}

/// One scripted reaction, consumed by the next call of its method.
#[derive(Debug, Clone)]
pub enum Behavior {
    Fail(Code, &'static str),
    /// Fail with this code and a message quoting the request's secrets and mount flags,
    /// as careless drivers do ("mount -o <flags> failed", "bad secret …"), plain and
    /// quoted: what the bridge must scrub before anything shows it.
    FailEchoing(Code),
    /// Sleep, then behave normally (the call is dropped if the client gives up).
    Delay(Duration),
    /// Wait until the gate is released, then behave normally: the call stays in flight
    /// exactly as long as a test needs (it is dropped if the client gives up first).
    Hold(Gate),
}

/// Holds the calls scripted with [`Behavior::Hold`] until [`Gate::release`]; clones share
/// one gate, and once released it stays open (a call arriving later passes at once).
#[derive(Debug, Clone)]
pub struct Gate {
    open: Arc<watch::Sender<bool>>,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    pub fn new() -> Self {
        Self {
            open: Arc::new(watch::channel(false).0),
        }
    }

    /// Lets the held calls, and any later ones, go on.
    pub fn release(&self) {
        self.open.send_replace(true);
    }

    async fn passed(&self) {
        let mut open = self.open.subscribe();
        // The sender lives as long as `self`: this returns only once released.
        let _ = open.wait_for(|open| *open).await;
    }
}

/// One recorded call.
#[derive(Debug, Clone, Default)]
pub struct Call {
    pub method: &'static str,
    pub volume_id: String,
    pub node_id: String,
    pub target_path: String,
    pub staging_target_path: String,
    pub publish_context: BTreeMap<String, String>,
    pub secrets: BTreeMap<String, String>,
    pub parameters: BTreeMap<String, String>,
    pub mount_flags: Vec<String>,
    /// The VolumeCapability's volume_mount_group ("" when none).
    pub volume_mount_group: String,
    /// The VolumeCapability's access mode (its CSI number; 0 when absent).
    pub access_mode: i32,
    /// CreateVolume's accessibility_requirements: requisite and preferred segments.
    pub requisite: Vec<BTreeMap<String, String>>,
    pub preferred: Vec<BTreeMap<String, String>>,
    /// CreateVolume's, ControllerExpandVolume's and NodeExpandVolume's required_bytes.
    pub required_bytes: i64,
}

/// Calls that change state (discovery calls are recorded too but filtered here).
pub const MUTATING: &[&str] = &[
    "CreateVolume",
    "DeleteVolume",
    "CreateSnapshot",
    "DeleteSnapshot",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
    "NodeStageVolume",
    "NodeUnstageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "ControllerExpandVolume",
    "NodeExpandVolume",
];

#[derive(Debug, Default)]
struct State {
    calls: Vec<Call>,
    script: HashMap<&'static str, VecDeque<Behavior>>,
    /// (CSI volume id, node id) pairs ControllerPublished and not yet unpublished.
    controller_published: BTreeSet<(String, String)>,
    /// How many times CreateVolume or DeleteVolume mounted the share.
    share_mounts: usize,
    /// CSI volume id → targets published (`Profile::counts_publishes`).
    published: HashMap<String, Vec<PathBuf>>,
    /// CSI volume id → the message of its abnormal VolumeCondition.
    abnormal: HashMap<String, String>,
    /// CSI snapshot id → (its CSI source volume id, seconds since the epoch it was taken).
    snapshots: BTreeMap<String, (String, u64)>,
    /// CSI volume id → the CSI snapshot it was restored from.
    restored_from: HashMap<String, String>,
    /// CSI volume id → its capacity (the most asked of CreateVolume or an expansion).
    capacity: HashMap<String, i64>,
    /// CSI volume id → the paths NodeStage or NodePublish made it available at.
    node_paths: HashMap<String, BTreeSet<PathBuf>>,
}

#[derive(Debug)]
struct Inner {
    profile: Profile,
    data_dir: PathBuf,
    state: Mutex<State>,
    /// How many calls of each method have arrived since the driver was made (whether or
    /// not the profile records them; never cleared), for [`LocalDirDriver::arrived`].
    arrivals: watch::Sender<HashMap<&'static str, usize>>,
}

/// Volumes as subdirectories of a data directory; clones share state.
#[derive(Debug, Clone)]
pub struct LocalDirDriver {
    inner: Arc<Inner>,
}

impl LocalDirDriver {
    /// The demo's driver on `data_dir` (which must exist).
    pub fn new(data_dir: &Path, node_id: &str) -> Self {
        Self::with_profile(data_dir, Profile::demo(node_id))
    }

    pub fn with_profile(data_dir: &Path, profile: Profile) -> Self {
        Self {
            inner: Arc::new(Inner {
                profile,
                data_dir: data_dir.to_path_buf(),
                state: Mutex::default(),
                arrivals: watch::channel(HashMap::new()).0,
            }),
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.inner.profile
    }

    /// The three CSI services, ready to add to a tonic server.
    pub fn services(
        self,
    ) -> (
        IdentityServer<LocalDirDriver>,
        ControllerServer<LocalDirDriver>,
        NodeServer<LocalDirDriver>,
    ) {
        (
            IdentityServer::new(self.clone()),
            ControllerServer::new(self.clone()),
            NodeServer::new(self),
        )
    }

    /// Queues reactions for the next calls of `method`.
    pub fn script(&self, method: &'static str, behaviors: impl IntoIterator<Item = Behavior>) {
        let mut state = self.state();
        state.script.entry(method).or_default().extend(behaviors);
    }

    /// The calls recorded so far (empty unless the profile records them).
    pub fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    /// Forgets recorded calls (the script and the arrival counts are kept).
    pub fn clear_calls(&self) {
        self.state().calls.clear();
    }

    /// How many calls of `method` have arrived since the driver was made (recorded or not,
    /// and whatever [`LocalDirDriver::clear_calls`] forgot).
    pub fn arrivals(&self, method: &str) -> usize {
        self.inner
            .arrivals
            .borrow()
            .get(method)
            .copied()
            .unwrap_or(0)
    }

    /// Resolves once the `n`th call of `method` (counted as [`LocalDirDriver::arrivals`]
    /// counts) has arrived: it is recorded and its scripted reaction has begun, so a call
    /// scripted with [`Behavior::Hold`] is then in flight. False if the driver is gone first.
    pub fn arrived(&self, method: &'static str, n: usize) -> impl Future<Output = bool> + use<> {
        let mut arrivals = self.inner.arrivals.subscribe();
        async move {
            arrivals
                .wait_for(|counts| counts.get(method).copied().unwrap_or(0) >= n)
                .await
                .is_ok()
        }
    }

    /// (CSI volume id, node id) pairs ControllerPublished and not unpublished since.
    pub fn controller_published(&self) -> Vec<(String, String)> {
        self.state().controller_published.iter().cloned().collect()
    }

    /// How many times CreateVolume or DeleteVolume mounted the share (see
    /// [`Profile::share_mount_dir`]).
    pub fn share_mounts(&self) -> usize {
        self.state().share_mounts
    }

    /// Makes (`create`) or removes the volume directory `id` through a mount of the data
    /// directory, when the profile mounts a share; directly otherwise.
    async fn through_share(&self, id: &str, create: bool) -> Result<(), Status> {
        let Some(work) = self.inner.profile.share_mount_dir.clone() else {
            let dir = self.data_path(id);
            return blocking(move || change_volume_dir(&dir, create)).await;
        };
        self.state().share_mounts += 1;
        let share = self.inner.data_dir.clone();
        let id = id.to_string();
        blocking(move || {
            // One working mount per call, as csi-driver-nfs makes one per request.
            let mount = tempfile::Builder::new()
                .prefix(&format!("{id}-"))
                .tempdir_in(&work)?;
            ops::bind_mount(&share, mount.path(), false)?;
            let changed = change_volume_dir(&mount.path().join(&id), create);
            let unmounted = ops::unmount(mount.path());
            changed.and(unmounted)
        })
        .await
    }

    /// Where the data of CSI volume `id` lives (whether or not it exists).
    /// Makes the VolumeCondition of CSI volume `id` abnormal with `message`, or normal
    /// again with `None` (reported with `Profile::volume_condition`).
    pub fn set_abnormal(&self, id: &str, message: Option<&str>) {
        let mut state = self.state();
        match message {
            Some(message) => state.abnormal.insert(id.to_string(), message.to_string()),
            None => state.abnormal.remove(id),
        };
    }

    /// The capacity CSI volume `id` has now (0 when it was never given one).
    pub fn capacity(&self, id: &str) -> i64 {
        self.state().capacity.get(id).copied().unwrap_or(0)
    }

    pub fn data_path(&self, id: &str) -> PathBuf {
        self.inner.data_dir.join(id)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A test that panicked while holding the lock must not hide its own failure.
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `call` (if the profile says so), counts its arrival, waits the profile's
    /// latency and applies the next scripted reaction.
    async fn enter(&self, call: Call) -> Result<(), Status> {
        let method = call.method;
        let behavior = {
            let mut state = self.state();
            let behavior = state.script.get_mut(method).and_then(VecDeque::pop_front);
            // The echo is made before the call is moved into the record.
            let behavior = match behavior {
                Some(Behavior::FailEchoing(code)) => Err(Status::new(code, echo(&call))),
                other => Ok(other),
            };
            if self.inner.profile.record_calls {
                state.calls.push(call);
            }
            behavior
        };
        self.inner
            .arrivals
            .send_modify(|counts| *counts.entry(method).or_default() += 1);
        if !self.inner.profile.latency.is_zero() {
            tokio::time::sleep(self.inner.profile.latency).await;
        }
        match behavior? {
            None => Ok(()),
            Some(Behavior::Fail(code, message)) => Err(Status::new(code, message)),
            Some(Behavior::FailEchoing(_)) => unreachable!("answered above"),
            Some(Behavior::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            Some(Behavior::Hold(gate)) => {
                gate.passed().await;
                Ok(())
            }
        }
    }

    /// NOT_FOUND unless volume `id` has its directory `dir`, which is made first if the
    /// profile makes volumes on first use.
    async fn existing_volume(&self, dir: &Path, id: &str) -> Result<(), Status> {
        if dir.is_dir() {
            return Ok(());
        }
        if self.inner.profile.volumes_on_first_use {
            let dir = dir.to_path_buf();
            return blocking(move || change_volume_dir(&dir, true)).await;
        }
        Err(Status::not_found(format!("volume {id} does not exist")))
    }

    /// Where snapshot `id` keeps its copy of the volume's data.
    pub fn snapshot_path(&self, id: &str) -> PathBuf {
        self.inner.data_dir.join(".snapshots").join(id)
    }

    fn snapshots_served(&self) -> Result<(), Status> {
        if !self.inner.profile.snapshots {
            return Err(Status::unimplemented("this driver takes no snapshots"));
        }
        Ok(())
    }

    /// The Snapshot message of a snapshot this driver took.
    fn snapshot_message(&self, id: &str, source: &str, taken: u64) -> csi::Snapshot {
        csi::Snapshot {
            size_bytes: dir_size(&self.snapshot_path(id)) as i64,
            snapshot_id: id.to_string(),
            source_volume_id: source.to_string(),
            creation_time: Some(prost_types::Timestamp {
                seconds: taken as i64,
                nanos: 0,
            }),
            ready_to_use: true,
            group_snapshot_id: String::new(),
        }
    }

    /// Copies what a CreateVolume content source names into the new volume `id` (only
    /// when the volume is new: a repeated CreateVolume must not overwrite what was written
    /// since).
    async fn fill_from_source(
        &self,
        id: &str,
        source: Option<&csi::VolumeContentSource>,
        is_new: bool,
    ) -> Result<(), Status> {
        use csi::volume_content_source::Type;
        let Some(from) = self.source_dir(source)? else {
            return Ok(());
        };
        if let Some(Type::Snapshot(s)) = source.and_then(|s| s.r#type.as_ref()) {
            self.state()
                .restored_from
                .insert(id.to_string(), s.snapshot_id.clone());
        }
        if !is_new {
            return Ok(());
        }
        let to = self.data_path(id);
        blocking(move || copy_dir(&from, &to)).await
    }

    /// The directory a CreateVolume content source names (None without one); NOT_FOUND
    /// when the snapshot or volume does not exist.
    fn source_dir(
        &self,
        source: Option<&csi::VolumeContentSource>,
    ) -> Result<Option<PathBuf>, Status> {
        use csi::volume_content_source::Type;
        let Some(kind) = source.and_then(|s| s.r#type.as_ref()) else {
            return Ok(None);
        };
        self.snapshots_served()?;
        let (dir, exists) = match kind {
            Type::Snapshot(s) => {
                self.volume_dir(&s.snapshot_id)?;
                let exists = self.state().snapshots.contains_key(&s.snapshot_id);
                (self.snapshot_path(&s.snapshot_id), exists)
            }
            Type::Volume(v) => {
                let dir = self.volume_dir(&v.volume_id)?;
                let exists = dir.is_dir();
                (dir, exists)
            }
        };
        if !exists {
            return Err(Status::not_found(format!(
                "the content source {} does not exist",
                dir.display()
            )));
        }
        Ok(Some(dir))
    }

    /// Where CreateVolume makes a volume accessible (a driver with topology only): the first
    /// preferred topology, else the first requisite one, else this node's.
    fn placed(&self, requirements: &csi::TopologyRequirement) -> Option<csi::Topology> {
        let node = self.inner.profile.topology.as_ref()?;
        Some(
            requirements
                .preferred
                .first()
                .or(requirements.requisite.first())
                .cloned()
                .unwrap_or_else(|| csi::Topology {
                    segments: node.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                }),
        )
    }

    /// Volume `id` is no longer available at `path` on this node.
    fn forget_node_path(&self, id: &str, path: &Path) {
        let mut state = self.state();
        if let Some(paths) = state.node_paths.get_mut(id) {
            paths.remove(path);
            if paths.is_empty() {
                state.node_paths.remove(id);
            }
        }
    }

    fn controller_reachable(&self) -> Result<(), Status> {
        if self.inner.profile.controller_unreachable {
            return Err(Status::unimplemented("this endpoint serves the node only"));
        }
        Ok(())
    }

    /// The data directory of a volume id, refusing ids that are not plain names.
    fn volume_dir(&self, id: &str) -> Result<PathBuf, Status> {
        let plain = !id.is_empty()
            && id.len() <= 255
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !plain {
            return Err(Status::invalid_argument(format!(
                "volume id {id:?} is not a plain name"
            )));
        }
        Ok(self.data_path(id))
    }
}

/// The message of [`Behavior::FailEchoing`]: the mount flags as a failed mount command shows
/// them, the secrets as a Rust or Go map prints them (quoted) and each value bare.
fn echo(call: &Call) -> String {
    format!(
        "{}: mount -o {} failed: permission denied; secrets {:?}; password was {}",
        call.method,
        call.mount_flags.join(","),
        call.secrets,
        call.secrets
            .values()
            .cloned()
            .collect::<Vec<_>>()
            .join(" and ")
    )
}

fn required<'a>(value: &'a str, field: &str) -> Result<&'a str, Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Ok(value)
}

fn internal(e: std::io::Error) -> Status {
    Status::internal(e.to_string())
}

/// Runs blocking mount work off the async threads.
async fn blocking(f: impl FnOnce() -> std::io::Result<()> + Send + 'static) -> Result<(), Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(internal)
}

fn is_mounted(path: &Path) -> Result<bool, Status> {
    // Asked of the kernel in O(1) where it can say: reading the mount table on every call
    // costs as much as there are mounts (the benchmark makes thousands) and takes the
    // namespace lock that concurrent mounts need.
    if let Some(root) = crate::mount::mountinfo::is_mount_root(path).map_err(internal)? {
        return Ok(root);
    }
    crate::mount::MountTable::read(None)
        .map(|t| t.is_mount_point(&crate::mount::resolve_parent(path)))
        .map_err(internal)
}

/// Makes a volume directory, or removes it and its content (gone already is fine).
fn change_volume_dir(dir: &Path, create: bool) -> std::io::Result<()> {
    if create {
        return ops::ensure_dir(dir, 0o777);
    }
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Whether `target` shows the same directory as `source` (a bind mount of it).
/// Copies the files and directories below `from` into `to` (which exists).
fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            std::fs::create_dir_all(&target)?;
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// The bytes of the files below `dir` (0 when it cannot be read).
fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

fn same_directory(target: &Path, source: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let (t, s) = (std::fs::metadata(target)?, std::fs::metadata(source)?);
    Ok(t.dev() == s.dev() && t.ino() == s.ino())
}

fn map(m: &HashMap<String, String>) -> BTreeMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn volume_mount_group(cap: Option<&csi::VolumeCapability>) -> String {
    match cap.and_then(|c| c.access_type.as_ref()) {
        Some(csi::volume_capability::AccessType::Mount(m)) => m.volume_mount_group.clone(),
        _ => String::new(),
    }
}

fn access_mode(cap: Option<&csi::VolumeCapability>) -> i32 {
    cap.and_then(|c| c.access_mode.as_ref())
        .map_or(0, |m| m.mode)
}

fn segments_of(topologies: &[csi::Topology]) -> Vec<BTreeMap<String, String>> {
    topologies.iter().map(|t| map(&t.segments)).collect()
}

fn mount_flags(cap: Option<&csi::VolumeCapability>) -> Vec<String> {
    match cap.and_then(|c| c.access_type.as_ref()) {
        Some(csi::volume_capability::AccessType::Mount(m)) => m.mount_flags.clone(),
        _ => Vec::new(),
    }
}

#[tonic::async_trait]
impl Identity for LocalDirDriver {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        self.enter(Call {
            method: "GetPluginInfo",
            ..Default::default()
        })
        .await?;
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: self.inner.profile.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{Service, Type, service::Type as S};
        self.enter(Call {
            method: "GetPluginCapabilities",
            ..Default::default()
        })
        .await?;
        use csi::plugin_capability::{VolumeExpansion, volume_expansion::Type as E};
        let mut capabilities = vec![csi::PluginCapability {
            r#type: Some(Type::Service(Service {
                r#type: S::ControllerService as i32,
            })),
        }];
        if self.inner.profile.topology.is_some() {
            capabilities.push(csi::PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: S::VolumeAccessibilityConstraints as i32,
                })),
            });
        }
        if let Some(online) = self.inner.profile.expansion.online {
            capabilities.push(csi::PluginCapability {
                r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                    r#type: if online { E::Online } else { E::Offline } as i32,
                })),
            });
        }
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        self.enter(Call {
            method: "Probe",
            ..Default::default()
        })
        .await?;
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}

#[tonic::async_trait]
impl Controller for LocalDirDriver {
    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::{Rpc, Type, rpc::Type as R};
        self.enter(Call {
            method: "ControllerGetCapabilities",
            ..Default::default()
        })
        .await?;
        self.controller_reachable()?;
        let mut caps = vec![R::CreateDeleteVolume];
        if self.inner.profile.controller_publish {
            caps.push(R::PublishUnpublishVolume);
        }
        if self.inner.profile.snapshots {
            caps.extend([R::CreateDeleteSnapshot, R::ListSnapshots, R::CloneVolume]);
        }

        if self.inner.profile.single_node_multi_writer {
            caps.push(R::SingleNodeMultiWriter);
        }
        if self.inner.profile.expansion.controller {
            caps.push(R::ExpandVolume);
        }
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: caps
                .into_iter()
                .map(|c| csi::ControllerServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: c as i32 })),
                })
                .collect(),
        }))
    }

    async fn create_volume(
        &self,
        request: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let requirements = req.accessibility_requirements.clone().unwrap_or_default();
        self.enter(Call {
            method: "CreateVolume",
            volume_id: req.name.clone(),
            secrets: map(&req.secrets),
            parameters: map(&req.parameters),
            mount_flags: mount_flags(req.volume_capabilities.first()),
            access_mode: access_mode(req.volume_capabilities.first()),
            requisite: segments_of(&requirements.requisite),
            preferred: segments_of(&requirements.preferred),
            required_bytes: req.capacity_range.as_ref().map_or(0, |r| r.required_bytes),
            ..Default::default()
        })
        .await?;
        self.controller_reachable()?;
        // Idempotent by name: the id is derived from the name.
        let id = format!(
            "{}{}",
            self.inner.profile.volume_id_prefix,
            required(&req.name, "name")?
        );
        self.volume_dir(&id)?;
        let is_new = !self.data_path(&id).is_dir();
        // Checked before anything is made: an unknown source leaves no volume.
        self.source_dir(req.volume_content_source.as_ref())?;
        self.through_share(&id, true).await?;
        self.fill_from_source(&id, req.volume_content_source.as_ref(), is_new)
            .await?;
        let required = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes);
        let capacity_bytes = {
            let mut state = self.state();
            let capacity = state.capacity.entry(id.clone()).or_default();
            *capacity = (*capacity).max(required);
            *capacity
        };
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(csi::Volume {
                volume_id: id,
                volume_context: self
                    .inner
                    .profile
                    .volume_context
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                capacity_bytes,
                accessible_topology: self.placed(&requirements).into_iter().collect(),
                ..Default::default()
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "DeleteVolume",
            volume_id: req.volume_id.clone(),
            secrets: map(&req.secrets),
            ..Default::default()
        })
        .await?;
        let id = required(&req.volume_id, "volume_id")?;
        self.volume_dir(id)?;
        self.through_share(id, false).await?;
        self.state().restored_from.remove(id);
        self.state().capacity.remove(id);
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn create_snapshot(
        &self,
        request: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "CreateSnapshot",
            volume_id: req.source_volume_id.clone(),
            secrets: map(&req.secrets),
            parameters: map(&req.parameters),
            ..Default::default()
        })
        .await?;
        self.controller_reachable()?;
        self.snapshots_served()?;
        let name = required(&req.name, "name")?;
        let source = required(&req.source_volume_id, "source_volume_id")?;
        // Idempotent by name: the id is derived from the name.
        let id = format!("snap-{name}");
        self.volume_dir(&id)?;
        if let Some((taken_of, taken)) = self.state().snapshots.get(&id).cloned() {
            if taken_of != source {
                return Err(Status::already_exists(format!(
                    "snapshot {name} exists, of volume {taken_of}"
                )));
            }
            return Ok(Response::new(csi::CreateSnapshotResponse {
                snapshot: Some(self.snapshot_message(&id, source, taken)),
            }));
        }
        let from = self.volume_dir(source)?;
        if !from.is_dir() {
            return Err(Status::not_found(format!("volume {source} does not exist")));
        }
        let to = self.snapshot_path(&id);
        blocking(move || {
            std::fs::create_dir_all(&to)?;
            copy_dir(&from, &to)
        })
        .await?;
        let taken = crate::system::now_secs();
        self.state()
            .snapshots
            .insert(id.clone(), (source.to_string(), taken));
        Ok(Response::new(csi::CreateSnapshotResponse {
            snapshot: Some(self.snapshot_message(&id, source, taken)),
        }))
    }

    async fn delete_snapshot(
        &self,
        request: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "DeleteSnapshot",
            volume_id: req.snapshot_id.clone(),
            secrets: map(&req.secrets),
            ..Default::default()
        })
        .await?;
        self.controller_reachable()?;
        self.snapshots_served()?;
        let id = required(&req.snapshot_id, "snapshot_id")?;
        self.volume_dir(id)?;
        let dependents: Vec<String> = {
            let state = self.state();
            let mut dependents: Vec<String> = state
                .restored_from
                .iter()
                .filter(|(volume, from)| *from == id && self.data_path(volume).is_dir())
                .map(|(volume, _)| volume.clone())
                .collect();
            dependents.sort();
            dependents
        };
        if !dependents.is_empty() {
            return Err(Status::failed_precondition(format!(
                "snapshot {id} is in use by volumes restored from it: {}",
                dependents.join(", ")
            )));
        }
        let path = self.snapshot_path(id);
        blocking(move || change_volume_dir(&path, false)).await?;
        self.state().snapshots.remove(id);
        Ok(Response::new(csi::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "ListSnapshots",
            volume_id: req.snapshot_id.clone(),
            secrets: map(&req.secrets),
            ..Default::default()
        })
        .await?;
        self.controller_reachable()?;
        self.snapshots_served()?;
        let snapshots = self.state().snapshots.clone();
        let entries = snapshots
            .iter()
            .filter(|(id, (source, _))| {
                (req.snapshot_id.is_empty() || **id == req.snapshot_id)
                    && (req.source_volume_id.is_empty() || *source == req.source_volume_id)
            })
            .map(
                |(id, (source, taken))| csi::list_snapshots_response::Entry {
                    snapshot: Some(self.snapshot_message(id, source, *taken)),
                },
            )
            .collect();
        Ok(Response::new(csi::ListSnapshotsResponse {
            entries,
            next_token: String::new(),
        }))
    }

    async fn controller_publish_volume(
        &self,
        request: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "ControllerPublishVolume",
            volume_id: req.volume_id.clone(),
            node_id: req.node_id.clone(),
            secrets: map(&req.secrets),
            mount_flags: mount_flags(req.volume_capability.as_ref()),
            ..Default::default()
        })
        .await?;
        if !self.inner.profile.controller_publish {
            return Err(Status::unimplemented("no PUBLISH_UNPUBLISH_VOLUME"));
        }
        let volume = required(&req.volume_id, "volume_id")?;
        let node = required(&req.node_id, "node_id")?;
        if !self.volume_dir(volume)?.is_dir() {
            return Err(Status::not_found(format!("no volume {volume}")));
        }
        self.state()
            .controller_published
            .insert((volume.to_string(), node.to_string()));
        Ok(Response::new(csi::ControllerPublishVolumeResponse {
            publish_context: HashMap::from([("device".to_string(), format!("/dev/fake-{node}"))]),
        }))
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "ControllerUnpublishVolume",
            volume_id: req.volume_id.clone(),
            node_id: req.node_id.clone(),
            secrets: map(&req.secrets),
            ..Default::default()
        })
        .await?;
        if !self.inner.profile.controller_publish {
            return Err(Status::unimplemented("no PUBLISH_UNPUBLISH_VOLUME"));
        }
        self.state()
            .controller_published
            .remove(&(req.volume_id.clone(), req.node_id.clone()));
        Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}))
    }

    async fn controller_expand_volume(
        &self,
        request: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let wanted = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes);
        self.enter(Call {
            method: "ControllerExpandVolume",
            volume_id: req.volume_id.clone(),
            secrets: map(&req.secrets),
            mount_flags: mount_flags(req.volume_capability.as_ref()),
            required_bytes: wanted,
            ..Default::default()
        })
        .await?;
        self.controller_reachable()?;
        let expansion = self.inner.profile.expansion;
        if !expansion.controller {
            return Err(Status::unimplemented("no EXPAND_VOLUME"));
        }
        let id = required(&req.volume_id, "volume_id")?;
        if !self.volume_dir(id)?.is_dir() {
            return Err(Status::not_found(format!("no volume {id}")));
        }
        if wanted <= 0 {
            return Err(Status::invalid_argument(
                "capacity_range.required_bytes is required",
            ));
        }
        let mut state = self.state();
        if expansion.online != Some(true) && state.node_paths.get(id).is_some_and(|p| !p.is_empty())
        {
            return Err(Status::failed_precondition(format!(
                "volume {id} is in use and this driver expands volumes offline only"
            )));
        }
        let capacity = state.capacity.entry(id.to_string()).or_default();
        if *capacity > wanted {
            return Err(Status::invalid_argument(format!(
                "volume {id} has {capacity} bytes; it cannot shrink to {wanted}"
            )));
        }
        *capacity = wanted;
        Ok(Response::new(csi::ControllerExpandVolumeResponse {
            capacity_bytes: wanted,
            node_expansion_required: expansion.node_expansion_required,
        }))
    }
}

#[tonic::async_trait]
impl Node for LocalDirDriver {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodeStageVolume",
            volume_id: req.volume_id.clone(),
            staging_target_path: req.staging_target_path.clone(),
            publish_context: map(&req.publish_context),
            secrets: map(&req.secrets),
            mount_flags: mount_flags(req.volume_capability.as_ref()),
            volume_mount_group: volume_mount_group(req.volume_capability.as_ref()),
            access_mode: access_mode(req.volume_capability.as_ref()),
            ..Default::default()
        })
        .await?;
        let source = self.volume_dir(required(&req.volume_id, "volume_id")?)?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        if !staging.is_dir() {
            return Err(Status::failed_precondition(
                "the CO must create the staging path",
            ));
        }
        self.existing_volume(&source, &req.volume_id).await?;
        self.state()
            .node_paths
            .entry(req.volume_id.clone())
            .or_default()
            .insert(staging.clone());
        if !is_mounted(&staging)? {
            blocking(move || ops::bind_mount(&source, &staging, false)).await?;
        }
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodeUnstageVolume",
            volume_id: req.volume_id.clone(),
            staging_target_path: req.staging_target_path.clone(),
            ..Default::default()
        })
        .await?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        if let Some(target) = self
            .state()
            .published
            .get(&req.volume_id)
            .and_then(|t| t.first())
        {
            return Err(Status::failed_precondition(format!(
                "volume {:?} is still published at {}",
                req.volume_id,
                target.display()
            )));
        }
        let unmounted = staging.clone();
        blocking(move || ops::unmount(&unmounted)).await?;
        self.forget_node_path(&req.volume_id, &staging);
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodePublishVolume",
            volume_id: req.volume_id.clone(),
            target_path: req.target_path.clone(),
            staging_target_path: req.staging_target_path.clone(),
            publish_context: map(&req.publish_context),
            secrets: map(&req.secrets),
            mount_flags: mount_flags(req.volume_capability.as_ref()),
            volume_mount_group: volume_mount_group(req.volume_capability.as_ref()),
            access_mode: access_mode(req.volume_capability.as_ref()),
            ..Default::default()
        })
        .await?;
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        let source = if self.inner.profile.stage {
            let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
            if !is_mounted(&staging)? {
                return Err(Status::failed_precondition("volume is not staged"));
            }
            staging
        } else {
            let dir = self.volume_dir(required(&req.volume_id, "volume_id")?)?;
            self.existing_volume(&dir, &req.volume_id).await?;
            dir
        };
        if is_mounted(&target)? {
            if self.inner.profile.verifies_existing_mount
                && !same_directory(&target, &source).map_err(internal)?
            {
                return Err(Status::already_exists(format!(
                    "{} is mounted with another volume than {}",
                    target.display(),
                    req.volume_id
                )));
            }
            return Ok(Response::new(csi::NodePublishVolumeResponse {}));
        }
        self.state()
            .node_paths
            .entry(req.volume_id.clone())
            .or_default()
            .insert(target.clone());
        let read_only = req.readonly;
        let made = target.clone();
        blocking(move || {
            // The CO makes the target's parent; the driver makes the target (CSI spec).
            ops::create_dir_exact(&made, 0o755)?;
            ops::bind_mount(&source, &made, read_only)
        })
        .await?;
        if self.inner.profile.counts_publishes {
            self.state()
                .published
                .entry(req.volume_id.clone())
                .or_default()
                .push(target);
        }
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodeUnpublishVolume",
            volume_id: req.volume_id.clone(),
            target_path: req.target_path.clone(),
            ..Default::default()
        })
        .await?;
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        if self.inner.profile.counts_publishes {
            let listed = self
                .state()
                .published
                .get(&req.volume_id)
                .is_some_and(|t| t.contains(&target));
            if !listed {
                return Ok(Response::new(csi::NodeUnpublishVolumeResponse {}));
            }
        }
        let unmounted = target.clone();
        blocking(move || {
            ops::unmount(&unmounted)?;
            ops::remove_dir_if_empty(&unmounted).map(|_| ())
        })
        .await?;
        self.forget_node_path(&req.volume_id, &target);
        if self.inner.profile.counts_publishes {
            let mut state = self.state();
            if let Some(targets) = state.published.get_mut(&req.volume_id) {
                if let Some(at) = targets.iter().position(|t| *t == target) {
                    targets.remove(at);
                }
                if targets.is_empty() {
                    state.published.remove(&req.volume_id);
                }
            }
        }
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::{Rpc, Type, rpc::Type as R};
        self.enter(Call {
            method: "NodeGetCapabilities",
            ..Default::default()
        })
        .await?;
        let profile = &self.inner.profile;
        let capabilities = [
            (profile.stage, R::StageUnstageVolume),
            (profile.volume_stats, R::GetVolumeStats),
            (profile.volume_condition, R::VolumeCondition),
            (profile.volume_mount_group, R::VolumeMountGroup),
            (profile.single_node_multi_writer, R::SingleNodeMultiWriter),
            (profile.expansion.node, R::ExpandVolume),
        ]
        .into_iter()
        .filter(|(offered, _)| *offered)
        .map(|(_, rpc)| csi::NodeServiceCapability {
            r#type: Some(Type::Rpc(Rpc { r#type: rpc as i32 })),
        })
        .collect();
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodeGetVolumeStats",
            volume_id: req.volume_id.clone(),
            target_path: req.volume_path.clone(),
            ..Default::default()
        })
        .await?;
        let profile = &self.inner.profile;
        if !profile.volume_stats && !profile.volume_condition {
            return Err(Status::unimplemented("no GET_VOLUME_STATS"));
        }
        let path = PathBuf::from(required(&req.volume_path, "volume_path")?);
        if !is_mounted(&path)? {
            return Err(Status::not_found(format!(
                "{} is not published",
                path.display()
            )));
        }
        let fs = nix::sys::statvfs::statvfs(&path)
            .map_err(|e| Status::internal(format!("statvfs {}: {e}", path.display())))?;
        let block = fs.fragment_size() as i64;
        let total = fs.blocks() as i64 * block;
        let available = fs.blocks_available() as i64 * block;
        let free = fs.blocks_free() as i64 * block;
        Ok(Response::new(csi::NodeGetVolumeStatsResponse {
            usage: vec![csi::VolumeUsage {
                total,
                available,
                used: total - free,
                unit: csi::volume_usage::Unit::Bytes as i32,
            }],
            volume_condition: profile.volume_condition.then(|| {
                let abnormal = self.state().abnormal.get(&req.volume_id).cloned();
                csi::VolumeCondition {
                    abnormal: abnormal.is_some(),
                    message: abnormal.unwrap_or_default(),
                }
            }),
        }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let wanted = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes);
        self.enter(Call {
            method: "NodeExpandVolume",
            volume_id: req.volume_id.clone(),
            target_path: req.volume_path.clone(),
            staging_target_path: req.staging_target_path.clone(),
            secrets: map(&req.secrets),
            mount_flags: mount_flags(req.volume_capability.as_ref()),
            required_bytes: wanted,
            ..Default::default()
        })
        .await?;
        if !self.inner.profile.expansion.node {
            return Err(Status::unimplemented("no EXPAND_VOLUME"));
        }
        let path = PathBuf::from(required(&req.volume_path, "volume_path")?);
        if !is_mounted(&path)? {
            return Err(Status::not_found(format!(
                "volume {} is not available at {}",
                req.volume_id,
                path.display()
            )));
        }
        let capacity_bytes = self.capacity(&req.volume_id).max(wanted);
        Ok(Response::new(csi::NodeExpandVolumeResponse {
            capacity_bytes,
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        self.enter(Call {
            method: "NodeGetInfo",
            ..Default::default()
        })
        .await?;
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.inner.profile.node_id.clone(),
            accessible_topology: self.inner.profile.topology.as_ref().map(|t| csi::Topology {
                segments: t.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            }),
            ..Default::default()
        }))
    }
}
