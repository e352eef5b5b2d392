//! In-process tests of the core: every journal step, rollback path and holder case,
//! through fake ports (a scripted driver, an in-memory mount table and controller store).
//! No root, no gRPC, no mounts.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::handoff::{AttachMetadata, VolumeHandle};
use super::ports::*;
use super::records::{
    ContentSource, DeletionPolicy, NodeRecord, SnapshotRecord, Step, VolumeRecord, VolumeState,
};
use super::*;
use crate::config::volume_settings::ConfigSettings;
use crate::config::{Config, Roles};

/// The sides `roles` names over the fake driver and mount table, `store`, and the
/// config's files (journal, locks, record key) — wired as app.rs wires the real ones.
fn sides(config: &Config, fake: &Fake, store: Arc<dyn ControllerStore>, roles: Roles) -> Bridge {
    sides_with(
        config,
        fake,
        store,
        roles,
        ConfigSettings::new(&config.volume, &config.secrets),
    )
}

fn sides_with(
    config: &Config,
    fake: &Fake,
    store: Arc<dyn ControllerStore>,
    roles: Roles,
    settings: impl VolumeSettings + 'static,
) -> Bridge {
    let journal = Arc::new(crate::store::FileJournal::open(&config.state.journal_dir()).unwrap());
    sides_over(config, fake, store, roles, settings, journal)
}

fn sides_over(
    config: &Config,
    fake: &Fake,
    store: Arc<dyn ControllerStore>,
    roles: Roles,
    settings: impl VolumeSettings + 'static,
    journal: Arc<dyn NodeJournal>,
) -> Bridge {
    let boot_id = crate::system::SystemClock.boot_id().unwrap();
    sides_in_boot(config, fake, store, roles, settings, journal, boot_id)
}

/// `sides_over`, for a node side that takes `boot_id` for its boot's.
fn sides_in_boot(
    config: &Config,
    fake: &Fake,
    store: Arc<dyn ControllerStore>,
    roles: Roles,
    settings: impl VolumeSettings + 'static,
    journal: Arc<dyn NodeJournal>,
    boot_id: String,
) -> Bridge {
    let core = crate::app::core_settings(config);
    let driver = Arc::new(discovery::DriverView::new(
        Arc::new(fake.clone()),
        Arc::new(fake.clone()),
        core.node_id.clone(),
        core.separate_controller_endpoint,
    ));
    let settings: Arc<dyn VolumeSettings> = Arc::new(settings);
    let locks: Arc<dyn VolumeLocks> =
        Arc::new(crate::store::FileLocks::new(&config.state.lock_dir).unwrap());
    let clock: Arc<dyn Clock> = Arc::new(crate::system::SystemClock);
    let recorder: Arc<dyn Recorder> = Arc::new(NoRecorder);
    let controller = if roles.controller {
        Ok(Arc::new(ControllerSide::new(
            core.clone(),
            ControllerPorts {
                driver: driver.clone(),
                store,
                record_key: Arc::new(crate::store::FileKeySource::new(
                    &config.state.dir.join("record.key"),
                )),
                settings: settings.clone(),
                locks: locks.clone(),
                clock: clock.clone(),
                recorder: recorder.clone(),
                snapshots: fake.snapshot_records.clone(),
            },
        )))
    } else {
        Err(Unserved::not_a_role("controller"))
    };
    let node = if roles.node {
        Ok(Arc::new(NodeSide::new(
            core,
            NodePorts {
                driver,
                journal,
                settings,
                mounts: Arc::new(fake.clone()),
                host_paths: Arc::new(fake.clone()),
                locks,
                recorder,
                boot_id,
                clock,
            },
        )))
    } else {
        Err(Unserved::not_a_role("node"))
    };
    Bridge { controller, node }
}

// ---------------------------------------------------------------- fakes

/// How one scripted call misbehaves.
#[derive(Debug, Clone)]
enum Fault {
    /// A final error (INTERNAL).
    Final,
    /// A non-final error (UNAVAILABLE): the call may have taken effect.
    Uncertain,
    NotFound,
    /// Answer after this long (the work is done when it answers).
    Slow(Duration),
    /// Succeed without doing anything (a driver that lies).
    Noop,
    /// Do the work, then lose the answer (UNAVAILABLE): the call took effect although the
    /// caller cannot know it. (CreateVolume only.)
    LostAnswer,
}

#[derive(Debug, Default)]
struct DriverState {
    calls: Vec<String>,
    script: HashMap<&'static str, VecDeque<Fault>>,
    /// CreateVolume name → volume id.
    volumes: BTreeMap<String, String>,
    publish_contexts: Vec<BTreeMap<String, String>>,
    node_ids: Vec<String>,
    /// Set by a scripted LostAnswer: the call in progress answers UNAVAILABLE after its work.
    lose_answer: bool,
    /// With `Fake::counts_publishes`: publishes of each target not unpublished since, as
    /// csi-driver-host-path lists them.
    published: BTreeMap<PathBuf, usize>,
    /// CreateSnapshot name → (snapshot id, source volume id).
    snapshots: BTreeMap<String, (String, String)>,
    /// Volume id → the snapshot id it was restored from: DeleteSnapshot of that snapshot
    /// fails with FAILED_PRECONDITION while the volume exists (as drivers whose restored
    /// volumes share blocks with the snapshot answer).
    restored_from: BTreeMap<String, String>,
    /// The content source of each CreateVolume, by name.
    content_sources: BTreeMap<String, Option<ContentSource>>,
    /// The id the next new volume gets, instead of `handle-<n>`.
    next_handle: Option<String>,
    /// With `Some`: the bytes each CreateVolume name was first asked for, and the same name
    /// asked for another size is ALREADY_EXISTS, as the CSI spec has drivers answer.
    asked_sizes: Option<BTreeMap<String, u64>>,
}

/// What another user put under the base dir, as the fake's `HostPaths` sees it.
#[derive(Debug, Default)]
struct Planted {
    /// Paths that are symlinks another user made, with that user's uid.
    symlinks: BTreeMap<PathBuf, u32>,
    /// A symlink to plant when the driver call of this name arrives (a swap mid-hook).
    on_call: Option<(&'static str, PathBuf)>,
    /// `HostPaths` calls made (the hot path's cost).
    checks: usize,
    /// What `answers_at_once` says of every base dir.
    answers_at_once: bool,
    /// The threads `HostPaths` calls were made on.
    threads: std::collections::HashSet<std::thread::ThreadId>,
}

/// A driver, the mount table it changes, and the directories under the base dir: the
/// real ones (in the test's temp dir), with symlinks planted in memory on top.
#[derive(Clone)]
struct Fake {
    state: Arc<Mutex<DriverState>>,
    mounted: Arc<Mutex<BTreeSet<PathBuf>>>,
    planted: Arc<Mutex<Planted>>,
    stage: bool,
    controller_publish: bool,
    unchecked: bool,
    /// Count publishes per target like csi-driver-host-path: a NodePublish onto a target
    /// that is not mounted counts again, NodeUnpublish uncounts one, and NodeUnstage fails
    /// while any publish is counted.
    counts_publishes: bool,
    /// Mounted paths whose filesystem is gone, with the errno a stat answers; unmounting
    /// one ends it.
    dead: Arc<Mutex<BTreeMap<PathBuf, i32>>>,
    /// A filesystem that stays dead: every NodePublish makes a dead mount (a FUSE daemon
    /// that does not come back).
    stays_dead: Arc<std::sync::atomic::AtomicBool>,
    /// Every health check fails (a stat that timed out on a hung filesystem).
    health_fails: Arc<std::sync::atomic::AtomicBool>,
    /// The next health check never answers (a stat stuck on a hung filesystem).
    health_stalls_once: Arc<std::sync::atomic::AtomicBool>,
    /// The VolumeCondition NodeGetVolumeStats reports: `Some(message)` when abnormal.
    condition: Arc<Mutex<Option<String>>>,
    /// CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS and CLONE_VOLUME.
    snapshots: bool,
    /// The controller store's snapshot records, shared by every side built over this fake
    /// (a restarted process reads what the last one wrote).
    snapshot_records: Arc<MemoryStore>,
    /// Topology, mount group and access mode: what the fake advertises and what it got.
    placement: Arc<Mutex<Placement>>,
    /// What the fake offers for expansion, and what it grew.
    expansion: Arc<Mutex<FakeExpansion>>,
}

/// What the fake says of topology, mount groups and single-node writer modes, and what
/// the bridge sent it of them.
#[derive(Debug, Default)]
struct Placement {
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS.
    accessibility_constraints: bool,
    /// NodeGetInfo's accessible_topology.
    node_topology: Segments,
    /// CreateVolume's accessible_topology.
    created_topology: Vec<Segments>,
    /// SINGLE_NODE_MULTI_WRITER, on the controller and on the node.
    controller_multi_writer: bool,
    node_multi_writer: bool,
    /// Node VOLUME_MOUNT_GROUP.
    volume_mount_group: bool,
    /// CreateVolume's accessibility_requirements, one per call.
    requirements: Vec<Option<TopologyRequirement>>,
    /// (call, volume_mount_group, access mode) of every NodeStage and NodePublish.
    node_calls: Vec<(&'static str, Option<u32>, AccessMode)>,
}

/// The fake's expansion capabilities and state.
#[derive(Debug, Default)]
struct FakeExpansion {
    /// Controller EXPAND_VOLUME.
    controller: bool,
    /// Node EXPAND_VOLUME.
    node: bool,
    /// The VolumeExpansion plugin capability.
    mode: Option<ExpansionMode>,
    /// ControllerExpandVolume's node_expansion_required.
    node_expansion_required: bool,
    /// CSI volume id → capacity, once expanded.
    capacity: BTreeMap<String, i64>,
    /// NodeExpandVolume calls: (volume id, volume path, staging path, required bytes).
    node_calls: Vec<(String, PathBuf, Option<PathBuf>, u64)>,
    /// The secrets each expand call carried, by call name.
    secrets: Vec<(&'static str, Secrets)>,
}

impl Fake {
    fn new(stage: bool, controller_publish: bool) -> Self {
        Self {
            state: Default::default(),
            mounted: Default::default(),
            planted: Default::default(),
            stage,
            controller_publish,
            unchecked: false,
            counts_publishes: false,
            dead: Default::default(),
            stays_dead: Default::default(),
            health_fails: Default::default(),
            health_stalls_once: Default::default(),
            condition: Default::default(),
            snapshots: true,
            snapshot_records: Default::default(),
            placement: Default::default(),
            expansion: Default::default(),
        }
    }

    fn placement(&self) -> std::sync::MutexGuard<'_, Placement> {
        self.placement.lock().unwrap()
    }

    /// The filesystem mounted at `path` dies (its FUSE daemon or server is gone): a stat
    /// there answers `errno`, while it stays a mount point.
    fn kill_filesystem(&self, path: &Path, errno: i32) {
        self.dead.lock().unwrap().insert(path.to_path_buf(), errno);
    }

    fn unmounted(&self, path: &Path) {
        self.mounted.lock().unwrap().remove(path);
        self.dead.lock().unwrap().remove(path);
    }

    /// [`Fake::new`] counting publishes (see `counts_publishes`).
    fn counting(stage: bool) -> Self {
        Self {
            counts_publishes: true,
            ..Self::new(stage, false)
        }
    }

    fn published(&self, target: &Path) -> usize {
        self.state
            .lock()
            .unwrap()
            .published
            .get(target)
            .copied()
            .unwrap_or(0)
    }

    fn script(&self, call: &'static str, fault: Fault) {
        self.state
            .lock()
            .unwrap()
            .script
            .entry(call)
            .or_default()
            .push_back(fault);
    }

    fn calls(&self) -> Vec<String> {
        self.state.lock().unwrap().calls.clone()
    }

    fn mutating_calls(&self) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter(|c| {
                !matches!(
                    c.as_str(),
                    "Probe"
                        | "GetPluginInfo"
                        | "GetPluginCapabilities"
                        | "ControllerGetCapabilities"
                        | "NodeGetCapabilities"
                        | "NodeGetInfo"
                )
            })
            .collect()
    }

    /// No NodeUnpublish nor NodeUnstage was called (since the calls were last cleared).
    fn assert_nothing_unmounted(&self) {
        let calls = self.mutating_calls();
        assert!(!calls.iter().any(|c| c.starts_with("NodeUn")), "{calls:?}");
    }

    fn clear_calls(&self) {
        self.state.lock().unwrap().calls.clear();
    }

    fn is_mounted(&self, path: &Path) -> bool {
        self.mounted.lock().unwrap().contains(path)
    }

    fn unmount_behind_our_back(&self, path: &Path) {
        self.mounted.lock().unwrap().remove(path);
    }

    /// Records the call and plays its scripted fault, if any.
    async fn enter(&self, call: &'static str) -> Result<bool, DriverError> {
        {
            let mut planted = self.planted.lock().unwrap();
            if let Some((_, path)) = planted.on_call.take_if(|(on, _)| *on == call) {
                planted.symlinks.insert(path, NOBODY);
            }
        }
        let fault = {
            let mut s = self.state.lock().unwrap();
            s.calls.push(call.to_string());
            s.script.get_mut(call).and_then(VecDeque::pop_front)
        };
        match fault {
            None => Ok(true),
            Some(Fault::Slow(d)) => {
                tokio::time::sleep(d).await;
                Ok(true)
            }
            Some(Fault::Noop) => Ok(false),
            Some(Fault::LostAnswer) => {
                self.state.lock().unwrap().lose_answer = true;
                Ok(true)
            }
            Some(Fault::Final) => Err(error(call, "Internal", 13, Finality::Final)),
            Some(Fault::Uncertain) => Err(error(call, "Unavailable", 14, Finality::Uncertain)),
            Some(Fault::NotFound) => Err(error(call, "NotFound", 5, Finality::Final)),
        }
    }
}

fn error(call: &'static str, status: &'static str, code: i32, finality: Finality) -> DriverError {
    DriverError {
        call,
        endpoint: "fake".into(),
        status,
        grpc_code: code,
        finality,
        message: format!("scripted {status}"),
        attempts: 1,
        gave_up_after: None,
    }
}

#[async_trait]
impl ControllerDriver for Fake {
    fn endpoint(&self) -> &str {
        "fake"
    }
    async fn identity(&self, _: &Deadline) -> Result<DriverIdentity, DriverError> {
        self.enter("GetPluginInfo").await?;
        Ok(DriverIdentity {
            name: "fake.csi".into(),
            vendor_version: "1".into(),
            controller_service: true,
            accessibility_constraints: self.placement().accessibility_constraints,
            volume_expansion: self.expansion.lock().unwrap().mode,
        })
    }
    async fn capabilities(&self, _: &Deadline) -> Result<ControllerCaps, DriverError> {
        self.enter("ControllerGetCapabilities").await?;
        Ok(ControllerCaps {
            create_delete_volume: true,
            publish_unpublish_volume: self.controller_publish,
            create_delete_snapshot: self.snapshots,
            list_snapshots: self.snapshots,
            clone_volume: self.snapshots,
            single_node_multi_writer: self.placement().controller_multi_writer,
            expand_volume: self.expansion.lock().unwrap().controller,
        })
    }
    async fn create_volume(
        &self,
        volume: &NewVolume,
        _: &Deadline,
    ) -> Result<CreatedVolume, DriverError> {
        self.enter("CreateVolume").await?;
        let accessible_topology = {
            let mut placement = self.placement();
            placement.requirements.push(volume.accessibility.clone());
            placement.created_topology.clone()
        };
        let mut s = self.state.lock().unwrap();
        let source_missing = match &volume.content_source {
            Some(ContentSource::Snapshot {
                csi_snapshot_id, ..
            }) => !s.snapshots.values().any(|(id, _)| id == csi_snapshot_id),
            Some(ContentSource::Volume { csi_volume_id, .. }) => {
                !s.volumes.values().any(|id| id == csi_volume_id)
            }
            None => false,
        };
        if source_missing {
            return Err(error("CreateVolume", "NotFound", 5, Finality::Final));
        }
        // CSI: the same name with another content source is ALREADY_EXISTS.
        if let Some(earlier) = s.content_sources.get(&volume.name)
            && s.volumes.contains_key(&volume.name)
            && *earlier != volume.content_source
        {
            return Err(error("CreateVolume", "AlreadyExists", 6, Finality::Final));
        }
        let exists = s.volumes.contains_key(&volume.name);
        if let Some(sizes) = &mut s.asked_sizes {
            if !exists {
                sizes.insert(volume.name.clone(), volume.required_bytes);
            } else if sizes.get(&volume.name) != Some(&volume.required_bytes) {
                return Err(error("CreateVolume", "AlreadyExists", 6, Finality::Final));
            }
        }
        s.content_sources
            .insert(volume.name.clone(), volume.content_source.clone());
        let next = s
            .next_handle
            .take()
            .unwrap_or_else(|| format!("handle-{}", s.volumes.len()));
        let id = s.volumes.entry(volume.name.clone()).or_insert(next).clone();
        if let Some(ContentSource::Snapshot {
            csi_snapshot_id, ..
        }) = &volume.content_source
        {
            s.restored_from.insert(id.clone(), csi_snapshot_id.clone());
        }
        if std::mem::take(&mut s.lose_answer) {
            return Err(error(
                "CreateVolume",
                "Unavailable",
                14,
                Finality::Uncertain,
            ));
        }
        drop(s);
        let capacity_bytes = self
            .expansion
            .lock()
            .unwrap()
            .capacity
            .get(&id)
            .copied()
            .unwrap_or(0);
        Ok(CreatedVolume {
            csi_volume_id: id,
            volume_context: BTreeMap::from([("ctx".into(), "v".into())]),
            capacity_bytes,
            accessible_topology,
        })
    }
    async fn delete_volume(&self, id: &str, _: &Secrets, _: &Deadline) -> Result<(), DriverError> {
        match self.enter("DeleteVolume").await {
            Err(e) if e.grpc_code == 5 => return Ok(()),
            other => other?,
        };
        let mut s = self.state.lock().unwrap();
        s.volumes.retain(|_, v| v != id);
        s.restored_from.remove(id);
        Ok(())
    }
    async fn publish(
        &self,
        call: &ControllerPublish,
        _: &Deadline,
    ) -> Result<BTreeMap<String, String>, DriverError> {
        self.enter("ControllerPublishVolume").await?;
        self.state
            .lock()
            .unwrap()
            .node_ids
            .push(call.node_id.clone());
        Ok(BTreeMap::from([("device".into(), "/dev/fake".into())]))
    }
    async fn unpublish(
        &self,
        _: &str,
        _: &str,
        _: &Secrets,
        _: &Deadline,
    ) -> Result<(), DriverError> {
        match self.enter("ControllerUnpublishVolume").await {
            Err(e) if e.grpc_code == 5 => Ok(()),
            other => other.map(|_| ()),
        }
    }
    async fn create_snapshot(
        &self,
        snapshot: &NewSnapshot,
        _: &Deadline,
    ) -> Result<SnapshotInfo, DriverError> {
        self.enter("CreateSnapshot").await?;
        let mut s = self.state.lock().unwrap();
        if !s
            .volumes
            .values()
            .any(|id| *id == snapshot.source_csi_volume_id)
        {
            return Err(error("CreateSnapshot", "NotFound", 5, Finality::Final));
        }
        let next = s.snapshots.len();
        // Lenient where the spec says ALREADY_EXISTS: a name asked again of another
        // source gets the snapshot that has it, which says its own source.
        let (id, source) = s
            .snapshots
            .entry(snapshot.name.clone())
            .or_insert_with(|| {
                (
                    format!("snap-{next}"),
                    snapshot.source_csi_volume_id.clone(),
                )
            })
            .clone();
        if std::mem::take(&mut s.lose_answer) {
            return Err(error(
                "CreateSnapshot",
                "Unavailable",
                14,
                Finality::Uncertain,
            ));
        }
        Ok(SnapshotInfo {
            csi_snapshot_id: id,
            source_csi_volume_id: source,
            size_bytes: 4096,
            creation_time: 7,
            ready_to_use: true,
        })
    }
    async fn delete_snapshot(
        &self,
        id: &str,
        _: &Secrets,
        _: &Deadline,
    ) -> Result<(), DriverError> {
        match self.enter("DeleteSnapshot").await {
            Err(e) if e.grpc_code == 5 => return Ok(()),
            other => other?,
        };
        let mut s = self.state.lock().unwrap();
        if s.restored_from.values().any(|from| from == id) {
            return Err(DriverError {
                message: format!("snapshot {id} has dependent volumes"),
                ..error("DeleteSnapshot", "FailedPrecondition", 9, Finality::Final)
            });
        }
        s.snapshots.retain(|_, (sid, _)| sid != id);
        Ok(())
    }
    async fn get_snapshot(
        &self,
        id: &str,
        _: &Secrets,
        _: &Deadline,
    ) -> Result<Option<SnapshotInfo>, DriverError> {
        self.enter("ListSnapshots").await?;
        let s = self.state.lock().unwrap();
        Ok(s.snapshots
            .values()
            .find(|(sid, _)| sid == id)
            .map(|(sid, source)| SnapshotInfo {
                csi_snapshot_id: sid.clone(),
                source_csi_volume_id: source.clone(),
                size_bytes: 4096,
                creation_time: 7,
                ready_to_use: true,
            }))
    }
    async fn expand_volume(
        &self,
        call: &ControllerExpand,
        _: &Deadline,
    ) -> Result<ControllerExpanded, DriverError> {
        self.enter("ControllerExpandVolume").await?;
        let mut expansion = self.expansion.lock().unwrap();
        expansion
            .secrets
            .push(("ControllerExpandVolume", call.secrets.clone()));
        let size = call.required_bytes as i64;
        let grown = expansion
            .capacity
            .entry(call.csi_volume_id.clone())
            .or_default();
        *grown = (*grown).max(size);
        Ok(ControllerExpanded {
            capacity_bytes: *grown,
            node_expansion_required: expansion.node_expansion_required,
        })
    }
}

#[async_trait]
impl NodeDriver for Fake {
    fn endpoint(&self) -> &str {
        "fake"
    }
    async fn probe(&self, _: &Deadline) -> Result<(), DriverError> {
        self.enter("Probe").await.map(|_| ())
    }
    async fn capabilities(&self, _: &Deadline) -> Result<NodeCaps, DriverError> {
        self.enter("NodeGetCapabilities").await?;
        let placement = self.placement();
        Ok(NodeCaps {
            stage_unstage_volume: self.stage,
            get_volume_stats: true,
            volume_condition: true,
            single_node_multi_writer: placement.node_multi_writer,
            volume_mount_group: placement.volume_mount_group,
            expand_volume: self.expansion.lock().unwrap().node,
        })
    }
    async fn node_id(&self, _: &Deadline) -> Result<String, DriverError> {
        self.enter("NodeGetInfo").await?;
        Ok("node-1".into())
    }
    async fn stage(&self, call: &Stage, _: &Deadline) -> Result<(), DriverError> {
        self.placement().node_calls.push((
            "NodeStageVolume",
            call.mount_group,
            call.capability.access_mode,
        ));
        if self.enter("NodeStageVolume").await? {
            self.state
                .lock()
                .unwrap()
                .publish_contexts
                .push(call.publish_context.clone());
            self.mounted
                .lock()
                .unwrap()
                .insert(call.staging_path.clone());
        }
        Ok(())
    }
    async fn unstage(&self, _: &str, path: &Path, _: &Deadline) -> Result<Undone, DriverError> {
        match self.enter("NodeUnstageVolume").await {
            Err(e) if e.grpc_code == 5 => return Ok(Undone::UnknownVolume),
            Ok(false) => return Ok(Undone::Done),
            other => other?,
        };
        if self
            .state
            .lock()
            .unwrap()
            .published
            .values()
            .any(|n| *n > 0)
        {
            return Err(error(
                "NodeUnstageVolume",
                "FailedPrecondition",
                9,
                Finality::Final,
            ));
        }
        self.unmounted(path);
        Ok(Undone::Done)
    }
    async fn publish(&self, call: &Publish, _: &Deadline) -> Result<(), DriverError> {
        self.placement().node_calls.push((
            "NodePublishVolume",
            call.mount_group,
            call.capability.access_mode,
        ));
        let entered = self.enter("NodePublishVolume").await;
        // An uncertain error may still have taken effect.
        if matches!(
            &entered,
            Ok(true)
                | Err(DriverError {
                    finality: Finality::Uncertain,
                    ..
                })
        ) {
            let fresh = self
                .mounted
                .lock()
                .unwrap()
                .insert(call.target_path.clone());
            if fresh && self.counts_publishes {
                *self
                    .state
                    .lock()
                    .unwrap()
                    .published
                    .entry(call.target_path.clone())
                    .or_default() += 1;
            }
            std::fs::create_dir_all(&call.target_path).unwrap();
            if self.stays_dead.load(std::sync::atomic::Ordering::SeqCst) {
                self.kill_filesystem(&call.target_path, nix::libc::ENOTCONN);
            }
        }
        entered.map(|_| ())
    }
    async fn unpublish(&self, _: &str, path: &Path, _: &Deadline) -> Result<Undone, DriverError> {
        match self.enter("NodeUnpublishVolume").await {
            Err(e) if e.grpc_code == 5 => return Ok(Undone::UnknownVolume),
            Ok(false) => return Ok(Undone::Done),
            other => other?,
        };
        self.unmounted(path);
        let _ = std::fs::remove_dir(path);
        if let Some(count) = self.state.lock().unwrap().published.get_mut(path) {
            *count = count.saturating_sub(1);
        }
        Ok(Undone::Done)
    }
    async fn volume_stats(
        &self,
        _: &str,
        _: &Path,
        _: &Deadline,
    ) -> Result<VolumeStats, DriverError> {
        self.enter("NodeGetVolumeStats").await?;
        Ok(VolumeStats {
            abnormal: self.condition.lock().unwrap().clone(),
            ..VolumeStats::default()
        })
    }
    async fn node_info(&self, _: &Deadline) -> Result<NodeInfo, DriverError> {
        self.enter("NodeGetInfo").await?;
        Ok(NodeInfo {
            node_id: "node-1".into(),
            accessible_topology: self.placement().node_topology.clone(),
        })
    }

    async fn expand_volume(&self, call: &NodeExpand, _: &Deadline) -> Result<i64, DriverError> {
        self.enter("NodeExpandVolume").await?;
        let mut expansion = self.expansion.lock().unwrap();
        expansion
            .secrets
            .push(("NodeExpandVolume", call.secrets.clone()));
        expansion.node_calls.push((
            call.csi_volume_id.clone(),
            call.volume_path.clone(),
            call.staging_path.clone(),
            call.required_bytes,
        ));
        Ok(call.required_bytes as i64)
    }
}

/// The uid the tests' other user has.
const NOBODY: u32 = 65534;

impl Fake {
    /// Makes `path` a symlink another user planted (in the fake's view).
    fn plant(&self, path: PathBuf) {
        self.planted.lock().unwrap().symlinks.insert(path, NOBODY);
    }

    fn unplant(&self, path: &Path) {
        self.planted.lock().unwrap().symlinks.remove(path);
    }

    /// Plants `path` when the driver call `call` arrives.
    fn plant_on(&self, call: &'static str, path: PathBuf) {
        self.planted.lock().unwrap().on_call = Some((call, path));
    }

    fn path_checks(&self) -> usize {
        self.planted.lock().unwrap().checks
    }

    /// Counts the call; refuses `path` when it or a directory above it is planted, as the
    /// real directories refuse a symlink.
    fn check_planted(&self, path: &Path) -> Result<(), PathError> {
        let mut planted = self.planted.lock().unwrap();
        planted.checks += 1;
        planted.threads.insert(std::thread::current().id());
        match path
            .ancestors()
            .find_map(|p| planted.symlinks.get(p).map(|uid| (p, *uid)))
        {
            Some((at, uid)) => Err(PathError::Refused {
                path: at.to_path_buf(),
                problem: "is a symlink (to /elsewhere)".into(),
                found: Some(Found { uid, mode: 0o777 }),
                hint: "fake",
            }),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for Fake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fake")
    }
}

impl HostPaths for Fake {
    fn ensure_base_dir(&self, base: &Path) -> Result<(), PathError> {
        self.check_planted(base)?;
        crate::mount::HostDirs::default().ensure_base_dir(base)
    }
    fn ensure_staging_dir(&self, base: &Path, path: &Path) -> Result<(), PathError> {
        self.check_planted(path)?;
        crate::mount::HostDirs::default().ensure_staging_dir(base, path)
    }
    fn verify(&self, base: &Path, path: &Path) -> Result<Leaf, PathError> {
        self.check_planted(path)?;
        crate::mount::HostDirs::default().verify(base, path)
    }
    fn remove_dir_if_empty(&self, base: &Path, path: &Path) -> Result<bool, PathError> {
        self.check_planted(path)?;
        crate::mount::HostDirs::default().remove_dir_if_empty(base, path)
    }
    fn park_staging_dir(&self, base: &Path, path: &Path) -> Result<bool, PathError> {
        self.check_planted(path)?;
        crate::mount::HostDirs::default().park_staging_dir(base, path)
    }
    fn answers_at_once(&self, _base: &Path) -> bool {
        self.planted.lock().unwrap().answers_at_once
    }
}

#[async_trait]
impl MountCheck for Fake {
    async fn visibility(&self, path: &Path, _: &Deadline) -> Result<Visibility, std::io::Error> {
        Ok(if self.unchecked {
            Visibility::Unchecked
        } else if self.is_mounted(path) {
            Visibility::Mounted
        } else {
            Visibility::NotMounted
        })
    }
    async fn health(&self, path: &Path, _: &Deadline) -> Result<MountHealth, std::io::Error> {
        if self
            .health_stalls_once
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            std::future::pending::<()>().await;
        }
        if self.health_fails.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("stat of {} timed out", path.display()),
            ));
        }
        let errno = self.dead.lock().unwrap().get(path).copied();
        Ok(match errno.filter(|_| self.is_mounted(path)) {
            Some(errno) => MountHealth::Dead(
                crate::mount::mountinfo::dead_mount_errno(errno).expect("a dead mount's errno"),
            ),
            None => MountHealth::Answers,
        })
    }
    fn describe(&self) -> String {
        "the fake mount table".into()
    }
}

/// A controller store in memory, with revisions like the real ones.
#[derive(Debug, Default)]
struct MemoryStore {
    records: Mutex<BTreeMap<String, VolumeRecord>>,
    /// Set: the next put of a created record is applied, and its answer lost (a
    /// transient error, as a replace whose response timed out).
    lose_created_answer: std::sync::atomic::AtomicBool,
    /// Reads of volume records so far.
    gets: std::sync::atomic::AtomicUsize,
    /// Puts of records claimed for deletion that fail, unapplied, with a transient error
    /// (an apiserver 500, a store lock waited on too long), before one goes through.
    failing_claims: std::sync::atomic::AtomicUsize,
    /// Reads of volume records that fail with a transient error, before one goes through.
    failing_gets: std::sync::atomic::AtomicUsize,
    next: Mutex<u64>,
    snapshots: Mutex<BTreeMap<String, SnapshotRecord>>,
}

/// Takes one of `count`'s failures to come, if any are left.
fn take_one(count: &std::sync::atomic::AtomicUsize) -> bool {
    use std::sync::atomic::Ordering::SeqCst;
    count
        .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

/// A store call that failed for a moment, unapplied (an apiserver 500, a lock waited on
/// too long).
fn did_not_answer(action: &str) -> StoreError {
    StoreError::Backend {
        store: "memory".into(),
        action: action.into(),
        transient: true,
        source: "the store did not answer in time".into(),
    }
}

#[async_trait]
impl ControllerStore for MemoryStore {
    async fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        self.gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if take_one(&self.failing_gets) {
            return Err(did_not_answer("get"));
        }
        Ok(self.records.lock().unwrap().get(volume_id).cloned())
    }
    async fn put(&self, record: &mut VolumeRecord) -> Result<(), StoreError> {
        if record.state == VolumeState::Deleting && take_one(&self.failing_claims) {
            return Err(did_not_answer("put"));
        }
        let mut records = self.records.lock().unwrap();
        let stored = records
            .get(&record.volume_id)
            .and_then(|r| r.revision.clone());
        if stored != record.revision {
            return Err(StoreError::Conflict {
                volume_id: record.volume_id.clone(),
            });
        }
        let mut next = self.next.lock().unwrap();
        *next += 1;
        record.revision = Some(next.to_string());
        records.insert(record.volume_id.clone(), record.clone());
        if record.state == VolumeState::Created
            && self
                .lose_created_answer
                .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(StoreError::Backend {
                store: "memory".into(),
                action: "put".into(),
                transient: true,
                source: "the answer was lost".into(),
            });
        }
        Ok(())
    }
    async fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        let mut records = self.records.lock().unwrap();
        match records.get(&record.volume_id) {
            None => Ok(()),
            Some(stored) if record.revision.is_some() && stored.revision != record.revision => {
                Err(StoreError::Conflict {
                    volume_id: record.volume_id.clone(),
                })
            }
            Some(_) => {
                records.remove(&record.volume_id);
                Ok(())
            }
        }
    }
    async fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        Ok(self.records.lock().unwrap().values().cloned().collect())
    }
    fn describe(&self) -> String {
        "memory".into()
    }
}

#[async_trait]
impl SnapshotStore for MemoryStore {
    async fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRecord>, StoreError> {
        Ok(self.snapshots.lock().unwrap().get(id).cloned())
    }
    async fn put_snapshot(&self, record: &mut SnapshotRecord) -> Result<(), StoreError> {
        let mut snapshots = self.snapshots.lock().unwrap();
        let stored = snapshots
            .get(&record.snapshot_id)
            .and_then(|r| r.revision.clone());
        if stored != record.revision {
            return Err(StoreError::Conflict {
                volume_id: record.snapshot_id.clone(),
            });
        }
        let mut next = self.next.lock().unwrap();
        *next += 1;
        record.revision = Some(next.to_string());
        snapshots.insert(record.snapshot_id.clone(), record.clone());
        Ok(())
    }
    async fn delete_snapshot(&self, record: &SnapshotRecord) -> Result<(), StoreError> {
        let mut snapshots = self.snapshots.lock().unwrap();
        match snapshots.get(&record.snapshot_id) {
            Some(stored) if record.revision.is_some() && stored.revision != record.revision => {
                Err(StoreError::Conflict {
                    volume_id: record.snapshot_id.clone(),
                })
            }
            _ => {
                snapshots.remove(&record.snapshot_id);
                Ok(())
            }
        }
    }
    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError> {
        Ok(self.snapshots.lock().unwrap().values().cloned().collect())
    }
    fn locate_snapshot(&self, id: &str) -> String {
        format!("memory snapshot {id:?}")
    }
}

/// One test's world: a bridge over the fakes, with its state in a temp dir.
struct World {
    dir: tempfile::TempDir,
    fake: Fake,
    store: Arc<MemoryStore>,
    bridge: Bridge,
}

/// The config of a world in `dir`; `node` is added to the `[node]` table.
fn world_config(dir: &Path, node: &str) -> Config {
    let text = format!(
        "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\ndir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n[timeouts]\nattach_secs = 10\ndetach_secs = 10\nrollback_secs = 10\n[node]\ndefault_volume_base_dir = \"{d}/vol\"\n{node}",
        d = dir.display()
    );
    Config::parse(&text, Path::new("test.toml")).unwrap()
}

impl World {
    fn new(fake: Fake) -> Self {
        Self::with_config(fake, "")
    }

    /// `node` is added to the `[node]` table.
    fn with_config(fake: Fake, node: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = Arc::new(world_config(dir.path(), node));
        let store = Arc::new(MemoryStore::default());
        let bridge = sides(&config, &fake, store.clone(), Roles::BOTH);
        World {
            dir,
            fake,
            store,
            bridge,
        }
    }

    fn base(&self) -> PathBuf {
        self.dir.path().join("vol")
    }

    fn target(&self, volume: &str) -> PathBuf {
        self.base().join(format!("fk+{volume}"))
    }

    fn staging(&self, volume: &str) -> PathBuf {
        self.base().join(".staging").join(format!("fk+{volume}"))
    }

    fn handle(&self) -> VolumeHandle {
        VolumeHandle {
            csi_volume_id: "h1".into(),
            volume_context: BTreeMap::new(),
            controller_publish: self.fake.controller_publish,
            topology: Vec::new(),
        }
    }

    fn attach_req(&self, volume: &str, ns: &str, sandbox: &str, ref_count: i64) -> AttachVolume {
        AttachVolume {
            sandbox_id: sandbox.into(),
            namespace: ns.into(),
            volume_id: volume.into(),
            ref_count,
            base_dir: self.base(),
            handle: self.handle(),
        }
    }

    async fn attach(
        &self,
        volume: &str,
        ns: &str,
        sandbox: &str,
        ref_count: i64,
    ) -> Result<Attached, HookError> {
        self.bridge
            .attach(
                self.attach_req(volume, ns, sandbox, ref_count),
                &Caller::waiting(),
            )
            .await
    }

    async fn detach(
        &self,
        volume: &str,
        ns: &str,
        sandbox: &str,
        ref_count: i64,
    ) -> Result<(), HookError> {
        let paths = super::naming::VolumePaths::new(&self.base(), "fk", volume);
        self.detach_at(paths, volume, ns, sandbox, ref_count).await
    }

    /// Detach with metadata naming `paths` (as Cube echoes what Attach answered).
    async fn detach_at(
        &self,
        paths: super::naming::VolumePaths,
        volume: &str,
        ns: &str,
        sandbox: &str,
        ref_count: i64,
    ) -> Result<(), HookError> {
        let meta = AttachMetadata {
            paths,
            csi_volume_id: "h1".into(),
            staged: self.fake.stage,
        };
        self.bridge
            .detach(
                DetachVolume {
                    sandbox_id: sandbox.into(),
                    namespace: ns.into(),
                    volume_id: volume.into(),
                    ref_count,
                    recorded: Some(meta),
                },
                &Caller::waiting(),
            )
            .await
    }

    fn record(&self, volume: &str) -> Option<NodeRecord> {
        self.bridge
            .node()
            .unwrap()
            .node_journal()
            .load(volume)
            .unwrap()
    }

    /// Empties `volume`'s record and removes its holder log: neither can say who holds
    /// the volume any more.
    fn lose_record_and_holders(&self, volume: &str) {
        std::fs::write(self.record_file(volume), b"").unwrap();
        std::fs::remove_file(self.holder_log(volume)).unwrap();
    }

    /// Leaves `volume`'s record as a hook killed half way does: nobody holds it, and it
    /// is marked pending.
    fn abandon(&self, volume: &str) {
        let journal = self.bridge.node().unwrap().node_journal();
        let mut record = journal.load(volume).unwrap().unwrap();
        record.holders.clear();
        journal.save(&record, true).unwrap();
        journal.mark_pending(volume).unwrap();
    }

    fn pending(&self) -> Vec<String> {
        self.bridge
            .node()
            .unwrap()
            .node_journal()
            .pending()
            .unwrap()
    }

    /// Nothing left for `volume`: no mount, no staging, no record, no marker.
    fn assert_clean(&self, volume: &str) {
        assert!(
            !self.fake.is_mounted(&self.target(volume)),
            "target still mounted"
        );
        assert!(!self.fake.is_mounted(&self.staging(volume)), "still staged");
        assert!(self.record(volume).is_none(), "journal record left");
        assert!(
            !self.pending().contains(&volume.to_string()),
            "pending marker left"
        );
        assert!(!self.target(volume).exists(), "target dir left");
        assert!(!self.staging(volume).exists(), "staging dir left");
    }
}

// ---------------------------------------------------------------- attach / detach

#[tokio::test]
async fn first_attach_stages_publishes_and_records_a_settled_holder() {
    let w = World::new(Fake::new(true, false));
    let attached = w.attach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(attached.host_path, w.target("v"));
    assert_eq!(
        attached.metadata["mount_dir"],
        w.target("v").display().to_string()
    );
    assert_eq!(
        w.fake.mutating_calls(),
        ["NodeStageVolume", "NodePublishVolume"]
    );
    let record = w.record("v").unwrap();
    assert!(record.is_settled(), "{record:?}");
    assert_eq!(record.holders["ns1"], BTreeSet::from(["s1".to_string()]));
    assert_eq!(
        record.boot_id,
        crate::system::SystemClock.boot_id().unwrap()
    );
    assert!(w.pending().is_empty());
}

/// Issue 20: where the base dir answers at once (a local disk or memory), a first Attach
/// and a last Detach check, make and remove their directories on the hook's own thread: a
/// trip to a blocking thread is two thread wake-ups, and a first Attach made four.
/// Elsewhere (a network filesystem) they stay on blocking threads, bounded by the hook's
/// deadline. (The test's runtime has one thread: the hook's.)
#[tokio::test]
async fn path_checks_stay_on_the_hooks_thread_where_the_base_dir_answers_at_once() {
    let here = std::thread::current().id();
    for at_once in [true, false] {
        let w = World::new(Fake::new(true, false));
        w.fake.planted.lock().unwrap().answers_at_once = at_once;
        w.attach("v", "ns1", "s1", 0).await.unwrap();
        w.detach("v", "ns1", "s1", 0).await.unwrap();
        w.assert_clean("v");
        let planted = w.fake.planted.lock().unwrap();
        assert!(planted.checks >= 4, "{}", planted.checks);
        if at_once {
            assert_eq!(planted.threads, std::collections::HashSet::from([here]));
        } else {
            assert!(!planted.threads.contains(&here), "{:?}", planted.threads);
        }
    }
}

/// Issue 20: a last Detach parks the volume's empty staging dir in `.staging/.parked` and
/// leaves `.staging`, the bridge's own directory in the base dir; the volume's next first
/// Attach takes the same directory back. Made and removed around every volume that
/// attached alone, each cost an inode allocation and release.
#[tokio::test]
async fn a_last_detach_parks_the_staging_dir_for_the_volumes_next_first_attach() {
    use std::os::unix::fs::MetadataExt;
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let dot_staging = w.staging("v").parent().unwrap().to_path_buf();
    let (made, staged) = (
        std::fs::metadata(&dot_staging).unwrap().ino(),
        std::fs::metadata(w.staging("v")).unwrap().ino(),
    );
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.assert_clean("v");
    assert!(!w.staging("v").exists(), "out of .staging");
    let names = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(names(&dot_staging), [".parked"]);
    let parked = dot_staging.join(".parked").join("fk+v");
    assert_eq!(std::fs::metadata(&parked).unwrap().ino(), staged);
    assert_eq!(std::fs::read_dir(&parked).unwrap().count(), 0);

    w.attach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(std::fs::metadata(w.staging("v")).unwrap().ino(), staged);
    assert!(!parked.exists(), "taken back");
    w.attach("v2", "ns1", "s1", 0).await.unwrap();
    assert_eq!(std::fs::metadata(&dot_staging).unwrap().ino(), made);
    for volume in ["v", "v2"] {
        w.detach(volume, "ns1", "s1", 0).await.unwrap();
        w.assert_clean(volume);
    }
    assert_eq!(
        names(&dot_staging.join(".parked")),
        [".pruned", "fk+v", "fk+v2"]
    );
}

#[tokio::test]
async fn hot_attach_and_detach_make_no_call_and_no_record_rewrite() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let json = w.dir.path().join("state/node/v.json");
    let written = std::fs::read(&json).unwrap();
    w.fake.clear_calls();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    w.attach("v", "ns1", "s2", 2).await.unwrap();
    w.detach("v", "ns1", "s2", 1).await.unwrap();
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert_eq!(
        std::fs::read(&json).unwrap(),
        written,
        "the record was rewritten"
    );
    let holders = &w.record("v").unwrap().holders;
    assert_eq!(holders["ns1"], BTreeSet::from(["s1".to_string()]));
}

#[tokio::test]
async fn last_detach_undoes_everything_in_reverse() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        ["NodeUnpublishVolume", "NodeUnstageVolume"]
    );
    w.assert_clean("v");
    // Detach of what is gone is success and calls nothing.
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert!(w.fake.mutating_calls().is_empty());
}

#[tokio::test]
async fn a_namespace_reaching_zero_does_not_unmount_what_another_namespace_holds() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    // Cubelet counts per namespace: ns2's first holder also sends ref_count 0.
    w.attach("v", "ns2", "s2", 0).await.unwrap();
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert!(w.fake.mutating_calls().is_empty(), "tore down under ns2");
    assert!(w.fake.is_mounted(&w.target("v")));
    w.detach("v", "ns2", "s2", 0).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        ["NodeUnpublishVolume", "NodeUnstageVolume"]
    );
    w.assert_clean("v");
}

#[tokio::test]
async fn stale_sandboxes_of_a_namespace_do_not_pin_the_volume() {
    let w = World::new(Fake::new(false, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    // Cubelet pruned s2 without a Detach; s1's Detach says ns1 holds nothing more.
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.assert_clean("v");
}

#[tokio::test]
async fn detach_of_an_unknown_namespace_or_sandbox_is_a_harmless_success() {
    let w = World::new(Fake::new(false, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.clear_calls();
    w.detach("v", "nsX", "sX", 0).await.unwrap();
    w.detach("v", "ns1", "sX", 1).await.unwrap();
    w.detach("other", "ns1", "s1", 0).await.unwrap();
    assert!(w.fake.mutating_calls().is_empty());
    assert!(w.fake.is_mounted(&w.target("v")));
}

#[tokio::test]
async fn a_failed_first_attach_undoes_its_stage_and_leaves_nothing() {
    let w = World::new(Fake::new(true, false));
    w.fake.script("NodePublishVolume", Fault::Final);
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(err.to_string().contains("NodePublishVolume"), "{err}");
    // NodeUnpublish too: while a stage is undone, a publish the driver may still count is
    // unpublished first (idempotent), whatever the record says.
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume"
        ]
    );
    w.assert_clean("v");
}

#[tokio::test]
async fn an_uncertain_publish_is_unpublished_on_rollback() {
    let w = World::new(Fake::new(false, false));
    // Fails non-finally (retries are the CSI client's; the port reports the last
    // answer): the bridge cannot know whether it mounted.
    w.fake.script("NodePublishVolume", Fault::Uncertain);
    w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(
        w.fake
            .mutating_calls()
            .contains(&"NodeUnpublishVolume".to_string())
    );
    w.assert_clean("v");
}

#[tokio::test]
async fn a_failed_repair_under_other_holders_undoes_only_its_own_publish() {
    let w = World::new(Fake::new(true, true));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    // The mount is lost; a second sandbox attaches and its NodePublish fails.
    w.fake.unmount_behind_our_back(&w.target("v"));
    w.fake.clear_calls();
    w.fake.script("NodePublishVolume", Fault::Final);
    w.attach("v", "ns1", "s2", 1).await.unwrap_err();
    let calls = w.fake.mutating_calls();
    assert!(
        !calls.contains(&"NodeUnstageVolume".to_string())
            && !calls.contains(&"ControllerUnpublishVolume".to_string()),
        "undid work of earlier sandboxes: {calls:?}"
    );
    let record = w.record("v").unwrap();
    assert_eq!(record.stage, Step::Done);
    assert_eq!(record.controller_publish, Step::Done);
    assert_eq!(record.holders["ns1"], BTreeSet::from(["s1".to_string()]));
    assert!(w.pending().is_empty());
    // The next Attach repairs it.
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    assert!(w.fake.is_mounted(&w.target("v")));
}

#[tokio::test]
async fn an_attach_whose_caller_left_undoes_its_work() {
    let w = World::new(Fake::new(true, false));
    w.fake
        .script("NodePublishVolume", Fault::Slow(Duration::from_millis(300)));
    let caller = Caller::waiting();
    // The caller leaves while NodePublishVolume is under way (not after a fixed time,
    // which a paused machine could let the Attach outlast).
    let leave = {
        let caller = caller.clone();
        let fake = w.fake.clone();
        async move {
            while !fake.calls().iter().any(|c| c == "NodePublishVolume") {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            caller.leave();
        }
    };
    let (result, ()) = tokio::join!(
        w.bridge.attach(w.attach_req("v", "ns1", "s1", 0), &caller),
        leave
    );
    assert!(matches!(result.unwrap_err().error, BridgeError::CallerGone));
    w.assert_clean("v");
    // A new Attach works.
    w.attach("v", "ns1", "s1", 0).await.unwrap();
}

#[tokio::test]
async fn a_hot_attach_whose_caller_left_records_no_holder() {
    let w = World::new(Fake::new(false, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let caller = Caller::waiting();
    caller.leave();
    w.bridge
        .attach(w.attach_req("v", "ns2", "s2", 0), &caller)
        .await
        .unwrap_err();
    assert!(!w.record("v").unwrap().holders.contains_key("ns2"));
}

/// csi.node_id copied from another node: ControllerPublish would attach the volume there
/// (and a rollback detach it from under that node's sandbox). Refused before any call
/// that changes anything; an id the driver agrees with is used.
#[tokio::test]
async fn a_node_id_setting_the_driver_contradicts_is_refused() {
    for (setting, refused) in [("node-2", true), ("node-1", false)] {
        let fake = Fake::new(true, true);
        let dir = tempfile::tempdir().unwrap();
        let mut config = world_config(dir.path(), "");
        config.csi.node_id = Some(setting.into());
        let store = Arc::new(MemoryStore::default());
        let bridge = sides(&config, &fake, store.clone(), Roles::BOTH);
        let w = World {
            dir,
            fake,
            store,
            bridge,
        };
        let attached = w.attach("v", "ns", "s", 0).await;
        if !refused {
            attached.unwrap();
            assert_eq!(w.fake.state.lock().unwrap().node_ids, ["node-1"]);
            continue;
        }
        let error = attached.unwrap_err().to_string();
        assert!(
            error.contains("csi.node_id") && error.contains("node-2") && error.contains("node-1"),
            "{error}"
        );
        assert!(
            w.fake.mutating_calls().is_empty(),
            "{:?}",
            w.fake.mutating_calls()
        );
    }
}

#[tokio::test]
async fn controller_publish_feeds_node_id_and_publish_context_and_is_undone_last() {
    let w = World::new(Fake::new(true, true));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume"
        ]
    );
    {
        let state = w.fake.state.lock().unwrap();
        assert_eq!(state.node_ids, ["node-1"]);
        assert_eq!(state.publish_contexts[0]["device"], "/dev/fake");
    }
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ]
    );
    w.assert_clean("v");
}

#[tokio::test]
async fn not_found_from_unpublish_is_success_only_when_nothing_is_mounted() {
    let w = World::new(Fake::new(false, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    // The driver forgot the volume but the mount is still there: an error.
    w.fake.script("NodeUnpublishVolume", Fault::NotFound);
    let err = w.detach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(err.to_string().contains("still mounted"), "{err}");
    assert!(w.record("v").is_some(), "record dropped while mounted");
    // Gone from the mount table too: NOT_FOUND is success.
    w.fake.unmount_behind_our_back(&w.target("v"));
    w.fake.script("NodeUnpublishVolume", Fault::NotFound);
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.assert_clean("v");
}

#[tokio::test]
async fn an_unpublish_that_lies_is_caught_by_the_mount_table() {
    let w = World::new(Fake::new(false, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.script("NodeUnpublishVolume", Fault::Noop);
    let err = w.detach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(
        matches!(err.error, BridgeError::StillMounted { .. }),
        "{err}"
    );
    assert!(
        w.pending().contains(&"v".to_string()),
        "a failed teardown stays pending"
    );
}

#[tokio::test]
async fn a_publish_that_does_not_propagate_is_refused_and_rolled_back() {
    let w = World::new(Fake::new(false, false));
    w.fake.script("NodePublishVolume", Fault::Noop);
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(matches!(err.error, BridgeError::NotVisible { .. }), "{err}");
    w.assert_clean("v");
}

#[tokio::test]
async fn an_empty_or_corrupt_journal_record_is_rebuilt_not_fatal() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    // A power loss left the record empty: the volume must stay attachable and detachable.
    std::fs::write(w.dir.path().join("state/node/v.json"), b"").unwrap();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    std::fs::write(w.dir.path().join("state/node/v.json"), b"{\"format\":").unwrap();
    w.detach("v", "ns1", "s2", 0).await.unwrap();
    w.assert_clean("v");
}

impl World {
    /// What a reboot leaves of `volume`: its record, stamped with an earlier boot, and
    /// none of its mounts.
    fn reboot(&self, volume: &str) {
        let journal = self.bridge.node().unwrap().node_journal();
        let mut record = journal.load(volume).unwrap().unwrap();
        record.boot_id = "an-earlier-boot".into();
        journal.save(&record, true).unwrap();
        self.fake.unmount_behind_our_back(&self.target(volume));
        self.fake.unmount_behind_our_back(&self.staging(volume));
    }
}

#[tokio::test]
async fn after_a_reboot_the_earlier_boots_holders_do_not_pin_the_volume() {
    let w = World::new(Fake::new(true, true));
    w.attach("v", "ns1", "a", 0).await.unwrap();
    w.attach("v", "ns2", "b", 0).await.unwrap();
    w.reboot("v");
    // Cubelet forgot its counts; only ns2 starts a sandbox again.
    w.fake.clear_calls();
    w.attach("v", "ns2", "c", 0).await.unwrap();
    assert!(w.fake.is_mounted(&w.target("v")));
    let record = w.record("v").unwrap();
    assert_eq!(
        record.holders,
        BTreeMap::from([("ns2".to_string(), BTreeSet::from(["c".to_string()]))]),
        "holders of the earlier boot kept"
    );
    assert_eq!(
        record.boot_id,
        crate::system::SystemClock.boot_id().unwrap()
    );
    // What the earlier boot did is undone before the volume is attached afresh.
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume",
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume"
        ]
    );
    // The last holder of this boot leaving tears it down.
    w.detach("v", "ns2", "c", 0).await.unwrap();
    w.assert_clean("v");
}

#[tokio::test]
async fn after_a_reboot_an_attach_with_mount_checks_off_is_not_answered_as_hot() {
    let mut fake = Fake::new(false, false);
    fake.unchecked = true;
    let w = World::with_config(fake, "mount_view = \"none\"\n");
    w.attach("v", "ns1", "a", 0).await.unwrap();
    w.reboot("v");
    w.fake.clear_calls();
    // Without a mount check only the boot id tells that the mount is gone.
    assert!(
        w.bridge
            .attach_if_hot(&w.attach_req("v", "ns1", "b", 0))
            .await
            .is_none(),
        "answered as hot"
    );
    w.attach("v", "ns1", "b", 0).await.unwrap();
    assert!(w.fake.is_mounted(&w.target("v")));
    assert!(
        w.fake
            .mutating_calls()
            .contains(&"NodePublishVolume".to_string())
    );
    // A Detach of the earlier boot's sandbox is not answered as hot either.
    w.reboot("v");
    assert!(
        w.bridge
            .detach_if_hot(&DetachVolume {
                sandbox_id: "b".into(),
                namespace: "ns1".into(),
                volume_id: "v".into(),
                ref_count: 1,
                recorded: None,
            })
            .await
            .is_none()
    );
}

#[tokio::test]
async fn a_teardown_cut_short_leaves_no_holder_for_reconciliation_to_remount() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    // The mount is lost; Cubelet's count of ns1 restarted (s1 is stale), and the new
    // sandbox's Attach fails, and so does the NodeUnstage of its rollback.
    w.fake.unmount_behind_our_back(&w.target("v"));
    w.fake.script("NodePublishVolume", Fault::Final);
    w.fake.script("NodeUnstageVolume", Fault::Final);
    let err = w.attach("v", "ns1", "s2", 0).await.unwrap_err();
    assert!(err.to_string().contains("NodeUnstageVolume"), "{err}");
    assert!(!w.record("v").unwrap().is_held(), "stale holder kept");
    // Reconciliation finishes the teardown rather than mounting it for nobody.
    let report = w
        .bridge
        .node()
        .unwrap()
        .reconcile_node(reconcile::Scope::Abandoned)
        .await
        .unwrap();
    assert_eq!((report.rolled_back, report.repaired), (1, 0), "{report:?}");
    w.assert_clean("v");
}

#[tokio::test]
async fn a_failed_attach_keeps_the_mount_other_holders_use() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    // An earlier repair left publish uncertain while the mount is there and in use.
    let journal = w.bridge.node().unwrap().node_journal();
    let mut record = journal.load("v").unwrap().unwrap();
    record.publish = Step::Uncertain;
    journal.save(&record, true).unwrap();
    w.fake.clear_calls();
    w.fake.script("NodePublishVolume", Fault::Final);
    w.attach("v", "ns2", "s2", 0).await.unwrap_err();
    assert!(
        !w.fake
            .mutating_calls()
            .contains(&"NodeUnpublishVolume".to_string()),
        "unmounted what ns1 uses: {:?}",
        w.fake.mutating_calls()
    );
    assert!(w.fake.is_mounted(&w.target("v")));
    let record = w.record("v").unwrap();
    assert_eq!(record.holders["ns1"], BTreeSet::from(["s1".to_string()]));
    assert!(!record.holders.contains_key("ns2"));
    // The last holder's Detach still undoes everything.
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.assert_clean("v");
}

#[tokio::test]
async fn a_final_error_on_a_retried_controller_publish_keeps_it_uncertain() {
    let w = World::new(Fake::new(false, true));
    // ControllerPublish may have happened, and the rollback's ControllerUnpublish fails.
    w.fake.script("ControllerPublishVolume", Fault::Uncertain);
    w.fake.script("ControllerUnpublishVolume", Fault::Final);
    w.attach("v", "ns", "s", 0).await.unwrap_err();
    // The retry's ControllerPublish fails finally: that says nothing of the first one.
    w.fake.clear_calls();
    w.fake.script("ControllerPublishVolume", Fault::Final);
    w.attach("v", "ns", "s", 0).await.unwrap_err();
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "ControllerPublishVolume",
            "NodeUnpublishVolume",
            "ControllerUnpublishVolume"
        ],
        "the first ControllerPublish was never undone"
    );
    w.assert_clean("v");
}

#[tokio::test]
async fn an_attach_after_a_failed_controller_unpublish_publishes_again() {
    let w = World::new(Fake::new(true, true));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    // The last Detach's ControllerUnpublish may or may not have detached the backend.
    w.fake.script("ControllerUnpublishVolume", Fault::Uncertain);
    w.detach("v", "ns1", "s1", 0).await.unwrap_err();
    assert_eq!(w.record("v").unwrap().controller_publish, Step::Uncertain);
    // A new sandbox's Attach comes before Cube's retried Detach: the volume must be
    // published to this node again before it is staged.
    w.fake.clear_calls();
    w.attach("v", "ns2", "s2", 0).await.unwrap();
    let calls = w.fake.mutating_calls();
    let published = calls.iter().position(|c| c == "ControllerPublishVolume");
    let staged = calls.iter().position(|c| c == "NodeStageVolume");
    assert!(
        matches!((published, staged), (Some(p), Some(s)) if p < s),
        "staged without publishing again: {calls:?}"
    );
}

#[tokio::test]
async fn a_teardown_killed_during_controller_unpublish_leaves_it_uncertain_on_disk() {
    let w = World::new(Fake::new(true, true));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.script(
        "ControllerUnpublishVolume",
        Fault::Slow(Duration::from_secs(30)),
    );
    let in_flight = async {
        while !w
            .fake
            .calls()
            .iter()
            .any(|c| c == "ControllerUnpublishVolume")
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    // Killed here (the call may have detached the backend): the record on disk must not
    // say the publish stands.
    tokio::select! {
        result = w.detach("v", "ns1", "s1", 0) => panic!("the Detach ended: {result:?}"),
        () = in_flight => {}
    }
    let record = w.record("v").unwrap();
    assert_eq!(record.controller_publish, Step::Uncertain);
    w.fake.clear_calls();
    w.attach("v", "ns2", "s2", 0).await.unwrap();
    assert!(
        w.fake
            .mutating_calls()
            .iter()
            .any(|c| c == "ControllerPublishVolume"),
        "{:?}",
        w.fake.mutating_calls()
    );
}

#[tokio::test]
async fn with_mount_checks_off_the_last_detach_still_succeeds() {
    let mut fake = Fake::new(true, false);
    fake.unchecked = true;
    let w = World::with_config(fake, "mount_view = \"none\"\n");
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert!(w.record("v").is_none());
}

/// With mount checks off, a Detach whose record was lost works from Cube's metadata,
/// which says the volume was staged: the stage is undone before ControllerUnpublish.
#[tokio::test]
async fn with_mount_checks_off_a_detach_from_metadata_unstages() {
    let mut fake = Fake::new(true, true);
    fake.unchecked = true;
    let w = World::with_config(fake, "mount_view = \"none\"\n");
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.bridge.node().unwrap().node_journal().remove("v").unwrap();
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ]
    );
    assert!(!w.fake.is_mounted(&w.staging("v")));
}

/// A record that no longer matches the Attach (another CSI id for the volume id) but
/// whose volume is mounted and held is never torn down, whatever it says of its publish
/// (a repair cut short leaves it uncertain).
#[tokio::test]
async fn a_mismatched_attach_never_tears_down_a_held_mount_whose_publish_is_uncertain() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let journal = w.bridge.node().unwrap().node_journal();
    let mut record = journal.load("v").unwrap().unwrap();
    record.publish = Step::Uncertain;
    journal.save(&record, true).unwrap();
    w.fake.clear_calls();
    let mut req = w.attach_req("v", "ns2", "s2", 0);
    req.handle.csi_volume_id = "h2".into();
    w.bridge.attach(req, &Caller::waiting()).await.unwrap_err();
    assert!(w.fake.is_mounted(&w.target("v")));
    assert!(
        w.fake.mutating_calls().is_empty(),
        "{:?}",
        w.fake.mutating_calls()
    );
    assert_eq!(
        w.record("v").unwrap().holders["ns1"],
        BTreeSet::from(["s1".to_string()])
    );
}

/// After a stale record (another CSI id, at other paths) is torn down, the Attach's own
/// paths get the check a first Attach's get: a mount already there (another instance's)
/// is refused, not published over.
#[tokio::test]
async fn after_a_stale_record_is_torn_down_a_foreign_mount_at_the_fresh_paths_is_refused() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let legacy = w.as_legacy_attachment("v");
    w.fake.unmounted(&legacy.target);
    w.fake.unmounted(&legacy.staging);
    std::fs::create_dir_all(w.target("v")).unwrap();
    w.fake.mounted.lock().unwrap().insert(w.target("v"));
    w.fake.clear_calls();
    let mut req = w.attach_req("v", "ns2", "s2", 0);
    req.handle.csi_volume_id = "h2".into();
    w.bridge.attach(req, &Caller::waiting()).await.unwrap_err();
    let calls = w.fake.mutating_calls();
    assert!(
        !calls
            .iter()
            .any(|c| c == "NodeStageVolume" || c == "NodePublishVolume"),
        "{calls:?}"
    );
}

// ---------------------------------------------------------------- legacy path leaves

impl World {
    /// Turns `volume`'s attachment into one a release before the `+` leaf made: its mounts,
    /// directories and journal record at `<base>/fk-<volume>` and `<base>/.staging/fk-<volume>`
    /// (the record then reads exactly as those releases wrote it; only paths differ).
    fn as_legacy_attachment(&self, volume: &str) -> super::naming::VolumePaths {
        use super::naming::{LeafForm, VolumePaths};
        let legacy = VolumePaths::with_form(&self.base(), "fk", volume, LeafForm::Legacy);
        for (current, old) in [
            (self.target(volume), &legacy.target),
            (self.staging(volume), &legacy.staging),
        ] {
            if current.exists() {
                std::fs::rename(&current, old).unwrap();
            }
            let mut mounted = self.fake.mounted.lock().unwrap();
            if mounted.remove(&current) {
                mounted.insert(old.clone());
            }
        }
        let journal = self.bridge.node().unwrap().node_journal();
        let mut record = journal.load(volume).unwrap().unwrap();
        record.target_path = legacy.target.clone();
        if record.staging_path.is_some() {
            record.staging_path = Some(legacy.staging.clone());
        }
        journal.save(&record, true).unwrap();
        legacy
    }
}

/// Issue 18, finding 5, the upgrade: a volume attached before host_path leaves became
/// `<driver>+<volume_id>` keeps its `<driver>-<volume_id>` paths (Cube holds that host_path)
/// for hot Attaches, reconciliation and its last Detach; the next first Attach takes the
/// current form.
#[tokio::test]
async fn a_volume_attached_with_legacy_paths_keeps_them_until_its_last_detach() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let legacy = w.as_legacy_attachment("v");
    w.fake.clear_calls();

    let hot = w
        .bridge
        .attach_if_hot(&w.attach_req("v", "ns1", "s2", 1))
        .await
        .expect("hot")
        .unwrap();
    assert_eq!(hot.host_path, legacy.target);
    let second = w.attach("v", "ns2", "s3", 0).await.unwrap();
    assert_eq!(second.host_path, legacy.target);
    assert_eq!(
        second.metadata["staging_dir"],
        legacy.staging.display().to_string()
    );
    assert!(
        w.fake.mutating_calls().is_empty(),
        "{:?}",
        w.fake.mutating_calls()
    );

    // A restart's reconciliation repairs a lost mount where the record has it.
    w.fake.unmount_behind_our_back(&legacy.target);
    let report = w.reconcile_all().await;
    assert_eq!((report.repaired, report.failed), (1, 0), "{report:?}");
    assert!(w.fake.is_mounted(&legacy.target));
    assert!(!w.fake.is_mounted(&w.target("v")));

    // Detach with the legacy metadata Cube kept; the last one tears the legacy paths down.
    w.detach_at(legacy.clone(), "v", "ns1", "s2", 1)
        .await
        .unwrap();
    w.detach_at(legacy.clone(), "v", "ns1", "s1", 0)
        .await
        .unwrap();
    assert!(w.fake.is_mounted(&legacy.target), "ns2 still holds it");
    w.detach_at(legacy.clone(), "v", "ns2", "s3", 0)
        .await
        .unwrap();
    for path in [&legacy.target, &legacy.staging] {
        assert!(!w.fake.is_mounted(path), "{} still mounted", path.display());
        assert!(!path.exists(), "{} left", path.display());
    }
    w.assert_clean("v");

    let fresh = w.attach("v", "ns1", "s4", 0).await.unwrap();
    assert_eq!(fresh.host_path, w.target("v"));
    assert!(w.fake.is_mounted(&w.staging("v")));
}

/// A legacy record whose mount is gone by a Detach without metadata (Cube lost it) is
/// found by the journal and torn down at its own paths.
#[tokio::test]
async fn a_legacy_record_is_torn_down_at_its_own_paths_without_metadata() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let legacy = w.as_legacy_attachment("v");
    w.bridge
        .detach(
            DetachVolume {
                sandbox_id: "s1".into(),
                namespace: "ns1".into(),
                volume_id: "v".into(),
                ref_count: 0,
                recorded: None,
            },
            &Caller::waiting(),
        )
        .await
        .unwrap();
    for path in [&legacy.target, &legacy.staging] {
        assert!(!w.fake.is_mounted(path), "{} still mounted", path.display());
        assert!(!path.exists(), "{} left", path.display());
    }
    w.assert_clean("v");
}

// ---------------------------------------------------------------- reconcile

/// A held volume whose mount was lost, whose repair at start-up fails (the driver still
/// starting), is tried again by the next scan of pending volumes and mounted. Before, the
/// repair left no marker, and only the next start-up or Attach looked at it again (the
/// report said "retried next pass").
#[tokio::test]
async fn a_repair_that_failed_at_start_up_is_tried_again_by_the_next_scan() {
    let w = World::new(Fake::new(true, false));
    w.attach("lost", "ns", "s", 0).await.unwrap();
    w.fake.unmount_behind_our_back(&w.target("lost"));
    w.fake.script("NodePublishVolume", Fault::Final);
    let node = w.bridge.node().unwrap();
    let report = node.reconcile_node(reconcile::Scope::All).await.unwrap();
    assert_eq!(report.mount_lost, 1, "{report:?}");
    let report = node
        .reconcile_node(reconcile::Scope::Abandoned)
        .await
        .unwrap();
    assert_eq!(report.repaired, 1, "{report:?}");
    assert!(w.fake.is_mounted(&w.target("lost")));
}

#[tokio::test]
async fn reconcile_rolls_back_the_unheld_tears_down_earlier_boots_and_repairs_the_held() {
    let w = World::new(Fake::new(true, false));
    // Held and healthy.
    w.attach("healthy", "ns", "s", 0).await.unwrap();
    // Held, mount lost.
    w.attach("lost", "ns", "s", 0).await.unwrap();
    w.fake.unmount_behind_our_back(&w.target("lost"));
    // An attach that died after NodeStage (nobody holds it).
    w.attach("dead", "ns", "s", 0).await.unwrap();
    let journal = w.bridge.node().unwrap().node_journal();
    let mut dead = journal.load("dead").unwrap().unwrap();
    dead.holders.clear();
    dead.publish = Step::Uncertain;
    journal.save(&dead, true).unwrap();
    // From an earlier boot, no mount left.
    w.attach("old", "ns", "s", 0).await.unwrap();
    let mut old = journal.load("old").unwrap().unwrap();
    old.boot_id = "an-earlier-boot".into();
    journal.save(&old, true).unwrap();
    w.fake.unmount_behind_our_back(&w.target("old"));

    let report = w
        .bridge
        .node()
        .unwrap()
        .reconcile_node(reconcile::Scope::All)
        .await
        .unwrap();
    assert_eq!(
        (
            report.healthy,
            report.repaired,
            report.rolled_back,
            report.earlier_boot,
            report.failed
        ),
        (1, 1, 1, 1, 0),
        "{report:?}"
    );
    assert!(w.fake.is_mounted(&w.target("lost")));
    w.assert_clean("dead");
    w.assert_clean("old");
}

/// A volume whose abandoned work fails (its backend hangs or refuses) is not tried again
/// by every scan, ahead of every other volume's: it waits, longer each time. Before, each
/// 30 s scan began with it again, and its driver got a new call each time.
#[tokio::test]
async fn abandoned_work_that_fails_is_not_retried_by_every_scan() {
    let w = World::new(Fake::new(false, false));
    for volume in ["-a", "b"] {
        w.attach(volume, "ns", "s", 0).await.unwrap();
        w.abandon(volume);
    }
    w.fake.script("NodeUnpublishVolume", Fault::Final);
    let scan = || async {
        w.bridge
            .node()
            .unwrap()
            .reconcile_node(reconcile::Scope::Abandoned)
            .await
            .unwrap()
    };
    let first = scan().await;
    assert_eq!((first.failed, first.rolled_back), (1, 1), "{first:?}");
    w.assert_clean("b");
    w.fake.clear_calls();
    let second = scan().await;
    assert_eq!((second.deferred, second.skipped), (1, 0), "{second:?}");
    assert!(
        w.fake.mutating_calls().is_empty(),
        "{:?}",
        w.fake.mutating_calls()
    );
    // The full pass (start-up) does not wait.
    let all = w
        .bridge
        .node()
        .unwrap()
        .reconcile_node(reconcile::Scope::All)
        .await
        .unwrap();
    assert_eq!(all.rolled_back, 1, "{all:?}");
    w.assert_clean("-a");
}

#[tokio::test]
async fn abandoned_scan_leaves_volumes_whose_lock_is_held() {
    let w = World::new(Fake::new(false, false));
    w.attach("v", "ns", "s", 0).await.unwrap();
    w.abandon("v");
    let held = w
        .bridge
        .node()
        .unwrap()
        .locks
        .try_acquire(LockScope::Node, "v")
        .unwrap()
        .unwrap();
    let report = w
        .bridge
        .node()
        .unwrap()
        .reconcile_node(reconcile::Scope::Abandoned)
        .await
        .unwrap();
    assert_eq!(report.skipped, 1);
    assert!(w.fake.is_mounted(&w.target("v")));
    drop(held);
    let report = w
        .bridge
        .node()
        .unwrap()
        .reconcile_node(reconcile::Scope::Abandoned)
        .await
        .unwrap();
    assert_eq!(report.rolled_back, 1, "{report:?}");
    w.assert_clean("v");
}

#[tokio::test]
async fn the_scan_after_a_failed_detach_leaves_that_volume_for_cubes_retry() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("other", "ns1", "s1", 0).await.unwrap();
    w.fake.script("NodeUnstageVolume", Fault::Final);
    w.detach("v", "ns1", "s1", 0).await.unwrap_err();
    // A killed hook's leftovers on another volume: its record, nobody holding it.
    w.abandon("other");
    let node = w.bridge.node().unwrap();
    let report = node
        .reconcile_node(reconcile::Scope::AbandonedBesides("v"))
        .await
        .unwrap();
    assert_eq!(report.rolled_back, 1, "only the other volume: {report:?}");
    w.assert_clean("other");
    assert!(
        w.record("v").is_some(),
        "the failed Detach's record is kept"
    );
    assert!(w.pending().contains(&"v".to_string()));
    // Cube's retry, or a later scan, finishes it.
    let report = node
        .reconcile_node(reconcile::Scope::Abandoned)
        .await
        .unwrap();
    assert_eq!(report.rolled_back, 1, "{report:?}");
    w.assert_clean("v");
}

// ---------------------------------------------------------------- create / destroy

impl World {
    async fn create(&self, volume: &str) -> Result<Created, HookError> {
        self.create_for(volume, &Caller::waiting()).await
    }

    /// Cube's Create of `volume`, for a caller the test controls (one that leaves, or
    /// whose answer is not delivered).
    async fn create_for(&self, volume: &str, caller: &Caller) -> Result<Created, HookError> {
        self.bridge
            .create(
                CreateVolume {
                    volume_id: volume.into(),
                    name: volume.into(),
                },
                caller,
            )
            .await
    }

    async fn destroy(&self, volume: &str) -> Result<(), HookError> {
        self.bridge
            .destroy(
                DestroyVolume {
                    volume_id: volume.into(),
                },
                &Caller::waiting(),
            )
            .await
    }

    fn stored(&self, volume: &str) -> Option<VolumeRecord> {
        self.store.records.lock().unwrap().get(volume).cloned()
    }

    fn backend_volumes(&self) -> BTreeMap<String, String> {
        self.fake.state.lock().unwrap().volumes.clone()
    }

    /// The CreateVolume name the record of `volume` holds.
    fn csi_name(&self, volume: &str) -> String {
        self.stored(volume).unwrap().csi_name
    }
}

#[tokio::test]
async fn create_records_the_handle_and_destroy_deletes_it_once() {
    let w = World::new(Fake::new(false, false));
    let created = w.create("v").await.unwrap();
    let handle = VolumeHandle::decode(&created.private_data).unwrap();
    let record = w.stored("v").unwrap();
    assert_eq!(record.state, VolumeState::Created);
    assert!(
        record.csi_name.starts_with("cube-v-"),
        "{}",
        record.csi_name
    );
    assert_eq!(
        w.backend_volumes().get(&record.csi_name),
        Some(&handle.csi_volume_id)
    );
    assert_eq!(
        record.csi_volume_id.as_deref(),
        Some(handle.csi_volume_id.as_str())
    );
    // A retried Create finds the same volume.
    assert_eq!(w.create("v").await.unwrap(), created);
    assert_eq!(w.backend_volumes().len(), 1);
    w.destroy("v").await.unwrap();
    assert!(w.stored("v").is_none() && w.backend_volumes().is_empty());
    w.fake.clear_calls();
    w.destroy("v").await.unwrap();
    assert!(w.fake.mutating_calls().is_empty());
}

/// A Create of a new volume writes its intent without reading the store first (issue
/// 20: one store call less before CreateVolume); a retried Create still finds the record
/// it left, through the conflict of that first write.
#[tokio::test]
async fn a_new_volumes_create_writes_its_intent_without_reading_first() {
    use std::sync::atomic::Ordering;
    let w = World::new(Fake::new(false, false));
    w.create("warm").await.unwrap();
    w.store.gets.store(0, Ordering::SeqCst);
    let created = w.create("v").await.unwrap();
    assert_eq!(
        w.store.gets.load(Ordering::SeqCst),
        0,
        "read before its intent"
    );
    assert_eq!(w.stored("v").unwrap().state, VolumeState::Created);
    w.fake.clear_calls();
    assert_eq!(w.create("v").await.unwrap(), created);
    assert!(w.store.gets.load(Ordering::SeqCst) > 0);
    assert_eq!(w.backend_volumes().len(), 2);
}

#[tokio::test]
async fn a_final_create_error_forgets_the_intent_an_uncertain_one_keeps_it() {
    let w = World::new(Fake::new(false, false));
    w.fake.script("CreateVolume", Fault::Final);
    w.create("v").await.unwrap_err();
    assert!(w.stored("v").is_none());
    w.fake.script("CreateVolume", Fault::Uncertain);
    w.create("v").await.unwrap_err();
    assert_eq!(w.stored("v").unwrap().state, VolumeState::Creating);
    // Destroy resolves the unfinished create by name, then deletes it.
    w.fake.clear_calls();
    w.destroy("v").await.unwrap();
    assert_eq!(w.fake.mutating_calls(), ["CreateVolume", "DeleteVolume"]);
    assert!(w.stored("v").is_none() && w.backend_volumes().is_empty());
}

#[tokio::test]
async fn a_final_error_on_a_retried_create_keeps_the_earlier_attempts_intent() {
    let w = World::new(Fake::new(false, false));
    // The first attempt's CreateVolume made the volume, but its answer was lost.
    w.fake.script("CreateVolume", Fault::LostAnswer);
    w.create("v").await.unwrap_err();
    assert_eq!(w.backend_volumes().len(), 1);
    // The retry is refused finally (say, the driver's parameters changed meanwhile).
    w.fake.script("CreateVolume", Fault::Final);
    w.create("v").await.unwrap_err();
    assert_eq!(
        w.stored("v").map(|r| r.state),
        Some(VolumeState::Creating),
        "the only record of the created volume was deleted"
    );
    w.destroy("v").await.unwrap();
    assert!(w.stored("v").is_none() && w.backend_volumes().is_empty());
}

#[tokio::test]
async fn a_create_whose_caller_left_deletes_what_it_made() {
    let w = World::new(Fake::new(false, false));
    let caller = Caller::waiting();
    caller.leave();
    let result = w.create_for("v", &caller).await;
    assert!(result.is_err());
    assert!(w.stored("v").is_none(), "record left");
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
}

/// A caller that takes every answer and says it never reached Cube (a forked hook's
/// front killed after its worker answered), counting what it was handed.
struct Undelivered(std::sync::atomic::AtomicUsize);

impl crate::bridge::Delivery for Undelivered {
    fn deliver(
        &self,
        _answer: crate::bridge::Answer,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async { false })
    }
}

fn undelivered() -> (Arc<Undelivered>, Caller) {
    let delivery = Arc::new(Undelivered(Default::default()));
    (delivery.clone(), Caller::confirming(delivery))
}

#[tokio::test]
async fn a_create_whose_answer_is_not_delivered_deletes_its_volume() {
    let w = World::new(Fake::new(false, false));
    let (delivery, caller) = undelivered();
    let result = w.create_for("v", &caller).await;
    assert!(result.is_err());
    assert_eq!(delivery.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(w.stored("v").is_none(), "record left");
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
}

/// The undo of a Create whose answer never reached Cube claims the record before it
/// deletes the volume; a claim that fails for a moment (an apiserver 500, the store file's
/// lock waited on too long) is retried within the rollback budget. Before, the undo gave
/// up at once: the record stayed created, which no sweep reclaims, Cube (told the Create
/// failed) never Destroys it, and the volume leaked for good.
#[tokio::test]
async fn an_undo_whose_claim_fails_for_a_moment_still_deletes_the_volume() {
    let w = World::new(Fake::new(false, false));
    w.store
        .failing_claims
        .store(2, std::sync::atomic::Ordering::SeqCst);
    let (_, caller) = undelivered();
    let error = w.create_for("v", &caller).await.unwrap_err();
    assert!(!error.to_string().contains("rollback"), "{error}");
    assert!(w.stored("v").is_none(), "record left");
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
    // As a lost answer of the Created write would leave it, too.
    w.store
        .failing_claims
        .store(1, std::sync::atomic::Ordering::SeqCst);
    w.store
        .lose_created_answer
        .store(true, std::sync::atomic::Ordering::SeqCst);
    w.create("v").await.unwrap_err();
    assert!(w.stored("v").is_none(), "record left");
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
    // And reads of the record that fail for a moment, before the claim (a new volume's
    // Create reads nothing before them: its writes go first).
    let (_, caller) = undelivered();
    w.store
        .failing_gets
        .store(2, std::sync::atomic::Ordering::SeqCst);
    w.create_for("w", &caller).await.unwrap_err();
    assert_eq!(
        w.store
            .failing_gets
            .load(std::sync::atomic::Ordering::SeqCst),
        0,
        "both failing reads were the undo's"
    );
    assert!(w.stored("w").is_none(), "record left");
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
}

/// A claim the undo of an unanswered Create left (its DeleteVolume failed) names the
/// volume it knew: the sweep deletes that one, with no CreateVolume. Before, the sweep
/// resolved every claim by CreateVolume again: refused (here: the driver refuses it for
/// good, as after a raised capacity or a StorageClass gone), the volume leaked and every
/// Create of the id was refused as "being reclaimed", sweep after sweep.
#[tokio::test]
async fn a_claim_left_by_an_undo_is_finished_by_the_handle_it_names() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    let handle = w.stored("v").unwrap().csi_volume_id.unwrap();
    let finished_at = w.stored("v").unwrap().updated_at;
    w.fake.script("DeleteVolume", Fault::Final);
    w.controller()
        .withdraw_unanswered_create("v", finished_at)
        .await
        .unwrap_err();
    let claimed = w.stored("v").unwrap();
    assert_eq!(claimed.state, VolumeState::Deleting);
    assert_eq!(claimed.csi_volume_id.as_deref(), Some(handle.as_str()));
    w.fake.script("CreateVolume", Fault::Final);
    w.fake.clear_calls();
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(
        !w.fake.calls().iter().any(|c| c.contains("CreateVolume")),
        "{:?}",
        w.fake.calls()
    );
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
    assert!(w.stored("v").is_none());
    // The id is Cube's to create again (the scripted refusal, never asked for, goes).
    w.fake.state.lock().unwrap().script.clear();
    w.create("v").await.unwrap();
}

/// A Destroy whose caller left before DeleteVolume (it waited for the volume's lock, a
/// restarting controller plugin, a slow apiserver, past CubeMaster's deadline) deletes
/// nothing: CubeMaster, told it failed, keeps the volume listed and may hand it to a new
/// sandbox. Before, the Destroy went on in its task and deleted the volume under it.
#[tokio::test]
async fn a_destroy_whose_caller_left_deletes_nothing() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    let left = Caller::waiting();
    left.leave();
    w.fake.clear_calls();
    let error = w.bridge.destroy(destroy_req("v"), &left).await.unwrap_err();
    assert!(error.to_string().contains("caller"), "{error}");
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert_eq!(w.backend_volumes().len(), 1);
    assert_eq!(w.stored("v").unwrap().state, VolumeState::Created);
    // CubeMaster's Destroy again, waited for: done.
    w.destroy("v").await.unwrap();
    assert!(w.backend_volumes().is_empty());
    // Nor is a volume made only to be deleted: an unfinished Create's record is resolved
    // by a CreateVolume, which a caller gone never gets.
    w.fake.script("CreateVolume", Fault::Uncertain);
    w.create("u").await.unwrap_err();
    assert_eq!(w.stored("u").unwrap().state, VolumeState::Creating);
    w.fake.clear_calls();
    w.bridge.destroy(destroy_req("u"), &left).await.unwrap_err();
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
}

/// A Create whose caller left before it got the volume's lock (it waited behind another
/// Create's undo, an operator's `expand`, a slow apiserver) writes no intent and sends no
/// CreateVolume. Before, it made a volume only for its own undo to delete, and an undo
/// that failed left a claim refusing Creates of the id until a sweep.
#[tokio::test]
async fn a_create_whose_caller_left_makes_nothing() {
    let w = World::new(Fake::new(false, false));
    let left = Caller::waiting();
    left.leave();
    let error = w.create_for("v", &left).await.unwrap_err();
    assert!(error.to_string().contains("caller"), "{error}");
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert!(w.stored("v").is_none());
}

/// A Create that finds a finished record whose volume the driver no longer has gets a new
/// volume from CreateVolume: that volume is its own, undone when its answer never
/// reaches Cube like any other it made. Before, it counted as the earlier Create's, was
/// kept, and leaked (Cube, told the Create failed, never Destroys it).
#[tokio::test]
async fn a_create_that_remade_a_vanished_volume_undoes_it_when_unanswered() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    {
        let mut driver = w.fake.state.lock().unwrap();
        driver.volumes.clear();
        driver.next_handle = Some("handle-remade".into());
    }
    let (_, caller) = undelivered();
    w.create_for("v", &caller).await.unwrap_err();
    assert!(w.backend_volumes().is_empty(), "{:?}", w.backend_volumes());
    assert!(w.stored("v").is_none());
}

/// A controller side of another replica (its own lock dir, as on another host) over the
/// world's store, driver and record key: with a shared (Kubernetes) store, replicas meet
/// only in the store.
fn other_replica(w: &World) -> ControllerSide {
    let config = Config::parse(
        &format!(
            "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\ndir = \"{d}/state\"\nlock_dir = \"{d}/replica-b-locks\"\n",
            d = w.dir.path().display()
        ),
        Path::new("replica-b.toml"),
    )
    .unwrap();
    let bridge = sides(&config, &w.fake, w.store.clone(), Roles::CONTROLLER);
    Arc::into_inner(bridge.controller.unwrap()).unwrap()
}

/// A Create whose record another replica replaced while its CreateVolume ran (a sweep or
/// a Destroy removed the intent, then a new Create of the id wrote its own, under a name
/// of its own) neither takes that record over nor leaves its own volume behind. Before,
/// it wrote its volume's handle into the other Create's record (the volume that Create
/// handed to Cube lost its record), or its undo left its own volume to that Create.
#[tokio::test]
async fn a_create_whose_record_another_create_replaced_keeps_to_its_own_volume() {
    let w = World::new(Fake::new(false, false));
    let replica_b = other_replica(&w);
    w.fake
        .script("CreateVolume", Fault::Slow(Duration::from_millis(300)));
    let on_a = async { w.create("v").await };
    let on_b = async {
        while !w.fake.calls().iter().any(|c| c == "CreateVolume") {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        w.store.records.lock().unwrap().remove("v");
        replica_b
            .create(
                CreateVolume {
                    volume_id: "v".into(),
                    name: "v".into(),
                },
                &Caller::waiting(),
            )
            .await
    };
    let (a, b) = tokio::join!(on_a, on_b);
    assert!(a.is_err(), "A's record was replaced");
    let handle = VolumeHandle::decode(&b.expect("B's Create").private_data)
        .unwrap()
        .csi_volume_id;
    assert_eq!(w.stored("v").unwrap().csi_volume_id, Some(handle.clone()));
    assert_eq!(
        w.backend_volumes().into_values().collect::<Vec<_>>(),
        [handle]
    );
}

/// Replica A's Create is slow in CreateVolume; CubeMaster, tired of waiting, asks replica
/// B, which adopts A's intent, gets the same CSI volume (CreateVolume is idempotent by
/// name) and hands it to CubeMaster. A's answer then reaches nobody. Before, A undid "what
/// it made": it claimed the record B had written and deleted the volume CubeMaster now
/// holds. A Create undoes only what its own attempt last recorded.
#[tokio::test]
async fn an_undelivered_create_leaves_the_volume_another_replica_delivered() {
    let w = World::new(Fake::new(false, false));
    let replica_b = other_replica(&w);
    w.fake
        .script("CreateVolume", Fault::Slow(Duration::from_millis(400)));
    let (_, caller_a) = undelivered();
    let on_a = async { w.create_for("v", &caller_a).await };
    let on_b = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        replica_b
            .create(
                CreateVolume {
                    volume_id: "v".into(),
                    name: "v".into(),
                },
                &Caller::waiting(),
            )
            .await
    };
    let (a, b) = tokio::join!(on_a, on_b);
    assert!(a.is_err(), "A's answer was not delivered");
    let delivered = b.expect("B's Create");
    let handle = VolumeHandle::decode(&delivered.private_data)
        .unwrap()
        .csi_volume_id;
    assert_eq!(
        w.stored("v").map(|r| (r.state, r.csi_volume_id)),
        Some((VolumeState::Created, Some(handle.clone()))),
        "the record of the volume CubeMaster holds is gone"
    );
    assert_eq!(
        w.backend_volumes().values().collect::<Vec<_>>(),
        vec![&handle],
        "the volume CubeMaster holds was deleted"
    );
    // And B's volume is Destroyed as usual.
    w.destroy("v").await.unwrap();
    assert!(w.stored("v").is_none() && w.backend_volumes().is_empty());
}

/// A CubeVolume writer points the record of a Create in progress at another volume's
/// handle: the Create refuses the record (its MAC fails) and undoes its own volume, but
/// must not sign the forged record while claiming it, or the sweep deletes the victim.
#[tokio::test]
async fn an_undone_create_never_signs_a_record_pointed_at_another_volume() {
    let w = World::new(Fake::new(false, false));
    w.create("victim").await.unwrap();
    let victim = w.stored("victim").unwrap().csi_volume_id.unwrap();
    w.fake
        .script("CreateVolume", Fault::Slow(Duration::from_secs(1)));
    w.fake.script("DeleteVolume", Fault::Final);
    let forge = async {
        while w
            .fake
            .calls()
            .iter()
            .filter(|c| *c == "CreateVolume")
            .count()
            < 2
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        w.edit_record("v", |r| {
            r.csi_volume_id = Some(victim.clone());
            r.revision = Some("9999".into());
        });
    };
    let (created, ()) = tokio::join!(w.create("v"), forge);
    created.unwrap_err();
    // Whatever is left of v's record is not signed naming the victim's volume.
    w.edit_record("v", |r| r.updated_at -= 3600);
    let _ = w
        .controller()
        .sweep_abandoned_creates(Duration::from_secs(600))
        .await;
    assert!(
        w.backend_volumes().values().any(|h| *h == victim),
        "the victim's volume was deleted: {:?}",
        w.fake.mutating_calls()
    );
}

/// The same race, the other answers lost. When A records the volume first and its answer
/// arrives, B's lost answer leaves the volume (listed as A's alone); when neither answer
/// arrives, the volume is deleted (nobody holds it, and Cube never Destroys a failed
/// Create).
#[tokio::test]
async fn concurrent_creates_delete_the_volume_only_when_no_answer_arrived() {
    for a_delivers in [true, false] {
        let w = World::new(Fake::new(false, false));
        let replica_b = other_replica(&w);
        w.fake
            .script("CreateVolume", Fault::Slow(Duration::from_millis(400)));
        if a_delivers {
            // B records the volume after A answered.
            w.fake
                .script("CreateVolume", Fault::Slow(Duration::from_millis(600)));
        }
        let (_, caller_b) = undelivered();
        let (_, lost_a) = undelivered();
        let caller_a = if a_delivers {
            Caller::waiting()
        } else {
            lost_a
        };
        let on_a = async { w.create_for("v", &caller_a).await };
        let on_b = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            replica_b
                .create(
                    CreateVolume {
                        volume_id: "v".into(),
                        name: "v".into(),
                    },
                    &caller_b,
                )
                .await
        };
        let (a, b) = tokio::join!(on_a, on_b);
        assert!(b.is_err());
        if a_delivers {
            a.expect("A's Create");
            let record = w.stored("v").expect("the record of A's volume");
            assert_eq!(record.state, VolumeState::Created);
            assert_eq!(record.answering_creates.len(), 1, "{record:?}");
            assert_eq!(w.backend_volumes().len(), 1, "A's volume was deleted");
        } else {
            assert!(a.is_err());
            assert!(w.stored("v").is_none(), "record left");
            assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
        }
    }
}

/// A volume_id shaped as another, longer one's truncated CSI name is a volume of its own:
/// before, it got that name, CreateVolume (idempotent by name) handed it the other's
/// volume, and its Destroy deleted the volume the other still held.
#[tokio::test]
async fn a_volume_id_forged_from_anothers_truncated_name_gets_its_own_volume() {
    let w = World::new(Fake::new(false, false));
    let long = "a".repeat(124);
    let held = w.create(&long).await.unwrap();
    let truncated = w.csi_name(&long);
    assert_eq!(truncated.len(), 128);
    let forged = truncated.strip_prefix("cube-").unwrap();
    let other = w.create(forged).await.unwrap();
    assert_ne!(
        VolumeHandle::decode(&other.private_data)
            .unwrap()
            .csi_volume_id,
        VolumeHandle::decode(&held.private_data)
            .unwrap()
            .csi_volume_id
    );
    assert_eq!(w.backend_volumes().len(), 2);
    w.destroy(forged).await.unwrap();
    let handle = VolumeHandle::decode(&held.private_data)
        .unwrap()
        .csi_volume_id;
    assert_eq!(
        w.backend_volumes().get(&truncated),
        Some(&handle),
        "the longer volume's CSI volume is kept"
    );
}

/// A Create whose last write, recording the volume created, is applied but answered with
/// an error (a replace whose response was lost): Cube counts the Create failed and never
/// Destroys the volume. Before, the record stayed created, which no sweep reclaims, and the
/// volume leaked; now what this Create made is deleted before it answers.
#[tokio::test]
async fn a_create_whose_last_write_is_applied_but_fails_leaves_no_volume() {
    let w = World::new(Fake::new(false, false));
    w.store
        .lose_created_answer
        .store(true, std::sync::atomic::Ordering::SeqCst);
    w.create("v").await.unwrap_err();
    assert_ne!(
        w.stored("v").map(|r| r.state),
        Some(VolumeState::Created),
        "a record of a volume Cube was told failed says created"
    );
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
    // The name is Cube's to create again.
    w.create("v").await.unwrap();
    assert_eq!(w.backend_volumes().len(), 1);
}

/// The front of a forked Create whose worker died unanswered deletes the volume only when
/// this Create finished it (recorded since the front started): one finished earlier was
/// handed out by another Create, and no record is nothing to do.
#[tokio::test]
async fn an_unanswered_forked_create_deletes_only_the_volume_it_finished() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    let finished_at = w.stored("v").unwrap().updated_at;
    let controller = w.bridge.controller().unwrap();
    let earlier = controller
        .withdraw_unanswered_create("v", finished_at + 1)
        .await
        .unwrap();
    assert!(
        !earlier,
        "a volume finished before the front started is kept"
    );
    assert!(w.stored("v").is_some() && w.backend_volumes().len() == 1);
    let this_one = controller
        .withdraw_unanswered_create("v", finished_at)
        .await
        .unwrap();
    assert!(this_one);
    assert!(w.stored("v").is_none(), "record left");
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
    let none = controller
        .withdraw_unanswered_create("v", finished_at)
        .await
        .unwrap();
    assert!(!none);
    // A restored volume that a Create adopted is the operator's data, even restored in
    // the same second as the front started.
    w.create("source").await.unwrap();
    w.controller()
        .create_snapshot("source", "s1")
        .await
        .unwrap();
    let restored_at = w.controller().restore("s1", "r").await.unwrap().updated_at;
    w.create("r").await.unwrap();
    assert_eq!(
        w.stored("r").unwrap().updated_at,
        restored_at,
        "kept by Create"
    );
    let restored = controller
        .withdraw_unanswered_create("r", restored_at)
        .await
        .unwrap();
    assert!(!restored, "a restored volume is kept");
    assert!(w.stored("r").is_some());
}

/// A withdrawal whose DeleteVolume fails (or that is killed) leaves a claimed record the
/// sweep reclaims, never one that still says created: no sweep reclaims those, and Cube
/// never Destroys the volume.
#[tokio::test]
async fn a_withdrawal_stopped_midway_leaves_a_record_the_sweep_reclaims() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    let finished_at = w.stored("v").unwrap().updated_at;
    w.fake.script("DeleteVolume", Fault::Final);
    let controller = w.bridge.controller().unwrap();
    controller
        .withdraw_unanswered_create("v", finished_at)
        .await
        .unwrap_err();
    assert_eq!(w.stored("v").map(|r| r.state), Some(VolumeState::Deleting));
    let report = controller
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.stored("v").is_none() && w.backend_volumes().is_empty());
}

/// The undo of a Create whose answer was lost, stopped between its DeleteVolume and the
/// record's removal (here DeleteVolume fails; in the crash matrix the process is killed
/// after it): the record must not still say `Created`, which names a volume that may be
/// gone, and which no sweep reclaims (Cube never Destroys after a failed Create). It is
/// claimed for deletion first, so the sweep finishes the undo.
#[tokio::test]
async fn an_undone_create_stopped_midway_leaves_a_record_the_sweep_reclaims() {
    let w = World::new(Fake::new(false, false));
    let (_delivery, caller) = undelivered();
    w.fake.script("DeleteVolume", Fault::Final);
    let result = w.create_for("v", &caller).await;
    assert!(result.is_err());
    assert_eq!(
        w.stored("v").map(|r| r.state),
        Some(VolumeState::Deleting),
        "the record of a volume being undone still says it was created"
    );
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.stored("v").is_none(), "record left");
    assert!(w.backend_volumes().is_empty(), "CSI volume leaked");
}

/// A repeated Create of a volume an earlier Create handed to CubeMaster: if this answer
/// is lost, CubeMaster still has the first one, and may be using the volume. Only what
/// this call made is undone: here, nothing.
#[tokio::test]
async fn a_repeated_create_whose_answer_is_lost_keeps_the_volume_an_earlier_one_handed_out() {
    let w = World::new(Fake::new(false, false));
    let first = w.create("v").await.unwrap();
    let (delivery, caller) = undelivered();
    let result = w.create_for("v", &caller).await;
    assert_eq!(delivery.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(result.is_err(), "this answer did not reach CubeMaster");
    assert_eq!(
        w.stored("v").map(|r| r.state),
        Some(VolumeState::Created),
        "the record of the volume CubeMaster has was deleted"
    );
    assert_eq!(w.backend_volumes().len(), 1, "the CSI volume was deleted");
    // CubeMaster's next Create (or its Destroy) finds the same volume.
    assert_eq!(
        w.create("v").await.unwrap().private_data,
        first.private_data
    );
}

#[tokio::test]
async fn an_attach_whose_answer_is_not_delivered_withdraws_its_holder() {
    // First Attach: everything it made is undone.
    let w = World::new(Fake::new(true, false));
    let (delivery, caller) = undelivered();
    w.bridge
        .attach(w.attach_req("v", "ns1", "s1", 0), &caller)
        .await
        .unwrap_err();
    assert_eq!(delivery.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    w.assert_clean("v");

    // Hot Attach of a second namespace: its holder only; the first keeps the mount.
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let (_, caller) = undelivered();
    w.bridge
        .attach(w.attach_req("v", "ns2", "s2", 0), &caller)
        .await
        .unwrap_err();
    let record = w.record("v").unwrap();
    assert!(!record.holders.contains_key("ns2"), "{:?}", record.holders);
    assert!(record.holders["ns1"].contains("s1"));
    assert!(w.fake.is_mounted(&w.target("v")));

    // Delivered: kept, as ever.
    w.attach("v", "ns2", "s2", 0).await.unwrap();
    assert!(w.record("v").unwrap().holders.contains_key("ns2"));
}

/// A retried Attach of a sandbox that already holds the volume (Cube counts it in
/// ref_count) fails or loses its answer: Cube releases the sandbox and never Detaches it
/// (its manager's Release on any plugin error). Before, the bridge kept the sandbox as a
/// holder, so a namespace Cube counted empty kept the volume mounted, with no Detach ever
/// to come. Now it leaves as in Cube, and a volume nobody holds is torn down.
#[tokio::test]
async fn a_retried_attach_that_fails_releases_the_sandbox_as_cube_does() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    w.attach("v", "ns2", "s3", 0).await.unwrap();

    // s1 again (Cube's count of ns1 is 2, s1 among them), answer lost: s1 leaves, ns1
    // stays with s2.
    let (_, caller) = undelivered();
    w.bridge
        .attach(w.attach_req("v", "ns1", "s1", 2), &caller)
        .await
        .unwrap_err();
    let holders = w.record("v").unwrap().holders;
    assert!(!holders["ns1"].contains("s1"), "{holders:?}");
    assert!(holders["ns1"].contains("s2") && holders["ns2"].contains("s3"));

    // The caller already gone before anything is recorded: the same.
    let caller = Caller::waiting();
    caller.leave();
    w.bridge
        .attach(w.attach_req("v", "ns1", "s2", 1), &caller)
        .await
        .unwrap_err();
    let holders = w.record("v").unwrap().holders;
    assert!(!holders.contains_key("ns1"), "{holders:?}");
    assert!(w.fake.is_mounted(&w.target("v")), "ns2 still holds it");

    // The last holder of all: the volume is torn down, as its Detach will never come.
    let (_, caller) = undelivered();
    w.bridge
        .attach(w.attach_req("v", "ns2", "s3", 1), &caller)
        .await
        .unwrap_err();
    w.assert_clean("v");
}

/// A sandbox of the empty namespace (Cube's field is optional, proto3 sends "" when it is
/// unset) attached on the hot path holds the volume like any other: another namespace's
/// last Detach leaves it mounted. Before, its holder line was skipped as unreadable at
/// the next load, and that Detach tore the volume down under it.
#[tokio::test]
async fn a_holder_of_the_empty_namespace_is_kept_through_the_holder_log() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "", "s2", 0).await.unwrap();
    assert!(w.record("v").unwrap().holders.contains_key(""));
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert!(w.fake.is_mounted(&w.target("v")), "s2 still holds it");
    w.detach("v", "", "s2", 0).await.unwrap();
    w.assert_clean("v");
}

/// A first Attach whose caller is gone before its first call makes no call, and no
/// inverse call either. Before, its steps were marked uncertain before the caller was
/// looked at, and the undo then sent NodeUnpublish, NodeUnstage and ControllerUnpublish
/// for steps never made.
#[tokio::test]
async fn an_attach_whose_caller_left_before_its_first_call_calls_nothing() {
    let w = World::new(Fake::new(true, true));
    let caller = Caller::waiting();
    caller.leave();
    w.bridge
        .attach(w.attach_req("v", "ns1", "s1", 0), &caller)
        .await
        .unwrap_err();
    assert_eq!(w.fake.mutating_calls(), Vec::<String>::new());
    w.assert_clean("v");
}

/// Over rpc, a retried hot Attach whose caller gives up while its mount check hangs (the
/// handler is dropped mid-check): Cube counts it failed and releases the sandbox. Before,
/// the dropped hot check left the sandbox held; now the full Attach runs in a task with
/// its caller gone and releases it.
#[tokio::test]
async fn a_hot_attach_cancelled_during_its_mount_check_releases_the_sandbox() {
    use crate::proto::cube::v1::volume_plugin_service_server::VolumePluginService;
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    // The daemon over the same state dir.
    let config = Arc::new(
        Config::parse(
            &format!(
                "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\ndir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n[node]\ndefault_volume_base_dir = \"{d}/vol\"\n",
                d = w.dir.path().display()
            ),
            Path::new("daemon.toml"),
        )
        .unwrap(),
    );
    let bridge = Arc::new(sides(&config, &w.fake, w.store.clone(), Roles::BOTH));
    let tasks = tokio_util::task::TaskTracker::new();
    let service = crate::transport::service::CubeService::new(bridge, config, tasks.clone());
    w.fake
        .health_stalls_once
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let request = crate::proto::cube::v1::AttachRequest {
        sandbox_id: "s1".into(),
        namespace: "ns1".into(),
        volume_id: "v".into(),
        volume_base_dir: w.base().display().to_string(),
        ref_count: 2,
        private_data: w.handle().encode_for("fk").unwrap(),
    };
    let answered = tokio::time::timeout(
        Duration::from_millis(100),
        service.attach(tonic::Request::new(request)),
    )
    .await;
    assert!(answered.is_err(), "the mount check did not hang");
    tasks.close();
    tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .expect("the release ran");
    let holders = w.record("v").unwrap().holders;
    assert_eq!(holders["ns1"].len(), 1, "{holders:?}");
    assert!(holders["ns1"].contains("s2"));
    assert!(w.fake.is_mounted(&w.target("v")));
}

/// A hot Attach cancelled during its mount check, with Cube's next Attach of the same
/// namespace already waiting: the cancelled one's release comes first, under the lock
/// the check held, so the next one's holder stays. Before, the dropped check released
/// the lock, the next Attach was recorded first, and the release (this Attach's
/// `ref_count` 0: Cube counted nobody in the namespace) then removed the namespace's
/// holders, the new one among them.
#[tokio::test]
async fn a_cancelled_hot_attachs_release_comes_before_the_next_attach() {
    use crate::proto::cube::v1::volume_plugin_service_server::VolumePluginService;
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns2", "s9", 0).await.unwrap();
    let config = Arc::new(world_config(w.dir.path(), ""));
    let bridge = Arc::new(sides(&config, &w.fake, w.store.clone(), Roles::BOTH));
    let tasks = tokio_util::task::TaskTracker::new();
    let service = Arc::new(crate::transport::service::CubeService::new(
        bridge,
        config,
        tasks.clone(),
    ));
    w.fake
        .health_stalls_once
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let request = |sandbox: &str| crate::proto::cube::v1::AttachRequest {
        sandbox_id: sandbox.into(),
        namespace: "ns1".into(),
        volume_id: "v".into(),
        volume_base_dir: w.base().display().to_string(),
        ref_count: 0,
        private_data: w.handle().encode_for("fk").unwrap(),
    };
    let cancelled = {
        let service = service.clone();
        let request = request("s1");
        tokio::spawn(async move {
            tokio::time::timeout(
                Duration::from_millis(300),
                service.attach(tonic::Request::new(request)),
            )
            .await
        })
    };
    // The next Attach arrives while the first one's check hangs, and waits for the lock.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let next = {
        let service = service.clone();
        let request = request("s2");
        tokio::spawn(async move { service.attach(tonic::Request::new(request)).await })
    };
    assert!(
        cancelled.await.unwrap().is_err(),
        "the mount check did not hang"
    );
    next.await.unwrap().expect("the next Attach");
    tasks.close();
    tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .expect("the release ran");
    let holders = w.record("v").unwrap().holders;
    assert_eq!(
        holders.get("ns1"),
        Some(&BTreeSet::from(["s2".to_string()])),
        "{holders:?}"
    );
    assert!(w.fake.is_mounted(&w.target("v")));
}

/// Another process (a forked worker) holds `v`'s lock; `other` stands in for a second
/// worker, with its own lock table, as a second process has.
fn second_process(w: &World) -> (Bridge, crate::store::locks::VolumeGuard) {
    let config = world_config(w.dir.path(), "");
    let other = sides(&config, &w.fake, w.store.clone(), Roles::BOTH);
    let locks = crate::store::FileLocks::new(&config.state.lock_dir).unwrap();
    let held = locks.try_lock(LockScope::Node, "v").unwrap().unwrap();
    (other, held)
}

/// Attach ("v", "ns1", "s1", ref_count 0) from a second process, waiting for the lock
/// another process holds, whose `caller` leaves; then the lock is let go and `sandbox`'s
/// Attach (ref_count 0) takes it at its first poll, before the waiting one polls again.
/// The first Attach's outcome.
async fn overtaken_attach(w: &World, caller: Caller, sandbox: &str) -> Result<Attached, HookError> {
    let (other, held) = second_process(w);
    let first = other.attach(w.attach_req("v", "ns1", "s1", 0), &caller);
    let next = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        caller.leave();
        drop(held);
        w.attach("v", "ns1", sandbox, 0).await.unwrap();
    };
    tokio::join!(first, next).0
}

/// A forked Attach whose front Cube killed while its worker waited for the lock: Cube
/// released it and sent the namespace's next Attach, whose worker took the lock first.
/// The first worker's ref_count (0) is out of date by then: releasing by it would drop
/// the namespace, the newer holder with it, and tear the volume down under it.
#[tokio::test]
async fn an_attach_whose_caller_left_while_it_waited_for_the_lock_changes_nothing() {
    let w = World::new(Fake::new(true, false));
    let first = overtaken_attach(&w, Caller::waiting(), "s2").await;
    assert!(matches!(first.unwrap_err().error, BridgeError::CallerGone));
    let holders = w.record("v").expect("torn down").holders;
    assert_eq!(
        holders.get("ns1"),
        Some(&BTreeSet::from(["s2".to_string()])),
        "{holders:?}"
    );
    assert!(w.fake.is_mounted(&w.target("v")));
}

/// The same where the later hook is Cube's retry of this very sandbox and the lock wait
/// may be overtaken (a forked worker polls the lock's byte): the retry recorded s1 and
/// answered, and Cube counts it. Before, the first worker released s1 by its stale
/// request, dropped ns1 with it, and tore the volume down under the retried sandbox.
#[tokio::test]
async fn an_overtaken_attach_whose_caller_left_keeps_cubes_retry_of_its_sandbox() {
    let w = World::new(Fake::new(true, false));
    let first = overtaken_attach(&w, Caller::waiting().overtakable(), "s1").await;
    assert!(matches!(first.unwrap_err().error, BridgeError::CallerGone));
    let holders = w.record("v").expect("torn down").holders;
    assert_eq!(
        holders.get("ns1"),
        Some(&BTreeSet::from(["s1".to_string()])),
        "{holders:?}"
    );
    assert!(w.fake.is_mounted(&w.target("v")));
}

/// The rest of a cancelled hot Attach keeps the lock its check held since its request:
/// its ref_count is current, so its release is Cube's, whole namespace and all (here
/// Cube counts nobody in ns1, its s1 a stale holder): the volume is torn down. (The
/// lock-wait check above must not catch it.)
#[tokio::test]
async fn the_rest_of_a_cancelled_hot_attach_releases_as_cube_did() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let kept = w
        .bridge
        .node()
        .unwrap()
        .locks
        .try_acquire(LockScope::Node, "v")
        .unwrap()
        .unwrap();
    let caller = Caller::waiting();
    caller.leave();
    w.bridge
        .attach_holding(w.attach_req("v", "ns1", "s2", 0), &caller, kept)
        .await
        .unwrap_err();
    w.assert_clean("v");
}

/// The same for a Detach: Cube saw it fail (its caller left while it waited), took the
/// reference back, and the namespace's next Attach (ref_count 1) ran first.
#[tokio::test]
async fn a_detach_whose_caller_left_while_it_waited_for_the_lock_changes_nothing() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let (other, held) = second_process(&w);
    let caller = Caller::waiting();
    let meta = AttachMetadata {
        paths: super::naming::VolumePaths::new(&w.base(), "fk", "v"),
        csi_volume_id: "h1".into(),
        staged: true,
    };
    let first = other.detach(
        DetachVolume {
            sandbox_id: "s1".into(),
            namespace: "ns1".into(),
            volume_id: "v".into(),
            ref_count: 0,
            recorded: Some(meta),
        },
        &caller,
    );
    let next = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        caller.leave();
        drop(held);
        w.attach("v", "ns1", "s2", 1).await.unwrap();
    };
    let (first, ()) = tokio::join!(first, next);
    assert!(matches!(first.unwrap_err().error, BridgeError::CallerGone));
    let holders = w.record("v").expect("torn down").holders;
    assert_eq!(
        holders.get("ns1"),
        Some(&BTreeSet::from(["s1".to_string(), "s2".to_string()])),
        "{holders:?}"
    );
    assert!(w.fake.is_mounted(&w.target("v")));
}

/// The same for a retried Attach that fails anywhere else after taking the lock: here the
/// mount's health check fails (a stat that timed out). The hot check leaves it to the full
/// Attach (it calls no driver, and releasing may take a teardown), whose failure releases
/// the sandbox. Before, both answered the error and kept the sandbox Cube released.
#[tokio::test]
async fn a_retried_attach_failing_its_mount_check_releases_the_sandbox() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    w.fake
        .health_fails
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let node = w.bridge.node().unwrap();
    let retried = w.attach_req("v", "ns1", "s1", 2);
    assert!(
        node.attach_if_hot(&retried, None).await.is_none(),
        "the hot check answered a failed check itself"
    );
    let error = w
        .bridge
        .attach(retried, &Caller::waiting())
        .await
        .unwrap_err();
    assert!(error.to_string().contains("timed out"), "{error}");
    let holders = w.record("v").unwrap().holders;
    assert_eq!(holders["ns1"].len(), 1, "{holders:?}");
    assert!(holders["ns1"].contains("s2"));

    // The namespace's only holder: it goes, and with it the volume's last holder.
    w.bridge
        .attach(w.attach_req("v", "ns1", "s2", 1), &Caller::waiting())
        .await
        .unwrap_err();
    assert!(
        w.record("v").is_none_or(|r| r.holders.is_empty()),
        "{:?}",
        w.record("v")
    );
}

/// On a full disk the holder log cannot take the line that releases a sandbox (it needs a
/// new block): the release rewrites the record instead (in place here: this process made
/// the volume's durable save), so a sandbox Cube has released (it never Detaches after a
/// failed Attach) is not kept. An addition that cannot be appended still fails, recording
/// nothing.
#[tokio::test]
async fn a_release_on_a_full_disk_still_takes_the_sandbox_off() {
    use std::sync::atomic::Ordering::SeqCst;
    let mut w = World::new(Fake::new(true, false));
    let journal = w.with_failing_saves();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    journal.fail_appends.store(true, SeqCst);
    w.attach("v", "ns1", "s3", 2).await.unwrap_err();
    w.fake.health_fails.store(true, SeqCst);
    let error = w
        .bridge
        .attach(w.attach_req("v", "ns1", "s1", 2), &Caller::waiting())
        .await
        .unwrap_err();
    assert!(error.to_string().contains("timed out"), "{error}");
    let holders = w.record("v").unwrap().holders;
    assert_eq!(
        holders["ns1"],
        BTreeSet::from(["s2".to_string()]),
        "{holders:?}"
    );
}

/// Releasing a holder (a forked worker's that died unanswered, withdrawn by its front;
/// or the operator's `holders release`) works on a disk too full for a durable save: it
/// needs none, since a record of an earlier boot is torn down whatever holders it names.
/// Before, the durable save failed, the front ignored it, and the holder Cube had
/// released kept the volume mounted for nobody.
#[tokio::test]
async fn a_holder_release_needs_no_durable_save() {
    use std::sync::atomic::Ordering::SeqCst;
    let mut w = World::new(Fake::new(true, false));
    let journal = w.with_failing_saves();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    journal.fail_durable.store(true, SeqCst);
    let released = w
        .bridge
        .node()
        .unwrap()
        .release_holders(
            "v",
            &Release::Sandbox {
                namespace: "ns1".into(),
                sandbox: "s2".into(),
            },
        )
        .await
        .unwrap();
    assert!(!released.torn_down);
    assert_eq!(
        w.record("v").unwrap().holders["ns1"],
        BTreeSet::from(["s1".to_string()])
    );
}

/// Both paths record when a holder was added (the full path in the record, the hot path
/// in its log line), a retried Attach keeps the first time, and a teardown keeps its
/// namespaces' last hooks after its record is gone (issue 19, defect 1: else a namespace
/// busy on other volumes would look quiet, and its holders stale).
#[tokio::test]
async fn holders_carry_their_times_and_a_teardown_keeps_its_namespaces_last_hooks() {
    let w = World::new(Fake::new(true, false));
    let before = crate::system::SystemClock.now_secs();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    w.attach("w", "ns2", "s3", 0).await.unwrap();
    let record = w.record("v").unwrap();
    let added = |sandbox| record.holder_times.added_at("ns1", sandbox).unwrap();
    assert!(
        added("s1") >= before && added("s2") >= added("s1"),
        "{record:?}"
    );
    assert!(record.holder_times.last_hook["ns1"] >= added("s2"));
    w.attach("v", "ns1", "s2", 2).await.unwrap();
    assert_eq!(w.record("v").unwrap().holder_times, record.holder_times);

    let journal = w.bridge.node().unwrap().node_journal().clone();
    assert!(journal.kept_last_hooks().unwrap().is_empty());
    w.detach("w", "ns2", "s3", 0).await.unwrap();
    w.assert_clean("w");
    let kept = journal.kept_last_hooks().unwrap();
    assert!(kept["ns2"] >= before, "{kept:?}");
    assert!(!kept.contains_key("ns1"), "{kept:?}");
}

#[tokio::test]
async fn an_operator_releases_holders_and_the_last_release_detaches() {
    use crate::bridge::Release;
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.attach("v", "ns2", "s2", 0).await.unwrap();
    let node = w.bridge.node().unwrap().clone();
    // Bad input changes nothing.
    for (volume, which) in [
        ("nope", Release::Namespace("ns1".into())),
        ("v", Release::Namespace("ns9".into())),
        (
            "v",
            Release::Sandbox {
                namespace: "ns1".into(),
                sandbox: "s9".into(),
            },
        ),
        ("v", Release::Unknown),
    ] {
        let error = node.release_holders(volume, &which).await.unwrap_err();
        assert!(matches!(error, BridgeError::InvalidRequest(_)), "{error}");
    }
    assert_eq!(w.record("v").unwrap().holders.len(), 2);
    w.fake.clear_calls();

    let released = node
        .release_holders(
            "v",
            &Release::Sandbox {
                namespace: "ns1".into(),
                sandbox: "s1".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(released.holders, ["ns1/s1"]);
    assert!(!released.torn_down);
    assert!(w.fake.is_mounted(&w.target("v")));
    assert!(w.fake.mutating_calls().is_empty());

    let released = node
        .release_holders("v", &Release::Namespace("ns2".into()))
        .await
        .unwrap();
    assert_eq!(released.holders, ["ns2/s2"]);
    assert!(released.torn_down);
    w.assert_clean("v");
}

#[tokio::test]
async fn the_sweep_reclaims_abandoned_creates_only() {
    let w = World::new(Fake::new(false, false));
    w.fake.script("CreateVolume", Fault::Uncertain);
    w.create("abandoned").await.unwrap_err();
    // The driver did create it, although the answer was lost.
    let abandoned = w.csi_name("abandoned");
    w.fake
        .state
        .lock()
        .unwrap()
        .volumes
        .insert(abandoned.clone(), "lost-handle".into());
    w.create("fresh-creating").await.unwrap();
    w.create("created").await.unwrap();
    // Age the first record; make the second one Creating but recent.
    {
        let mut records = w.store.records.lock().unwrap();
        records.get_mut("abandoned").unwrap().updated_at -= 3600;
        let fresh = records.get_mut("fresh-creating").unwrap();
        fresh.state = VolumeState::Creating;
        records.get_mut("created").unwrap().updated_at -= 3600;
    }
    let report = w
        .bridge
        .controller()
        .unwrap()
        .sweep_abandoned_creates(Duration::from_secs(600))
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.stored("abandoned").is_none());
    assert!(!w.backend_volumes().contains_key(&abandoned));
    assert_eq!(
        w.stored("fresh-creating").unwrap().state,
        VolumeState::Creating
    );
    assert_eq!(w.stored("created").unwrap().state, VolumeState::Created);
}

#[tokio::test]
async fn a_claim_on_a_refreshed_record_loses_and_a_create_refuses_a_claimed_one() {
    let w = World::new(Fake::new(false, false));
    w.fake.script("CreateVolume", Fault::Uncertain);
    w.create("v").await.unwrap_err();
    let stale = w.stored("v").unwrap();
    // A replica retrying the Create refreshes the record after the sweep read it.
    w.create("v").await.unwrap();
    assert!(
        !w.bridge.controller().unwrap().reclaim(stale).await.unwrap(),
        "claimed a record in use"
    );
    assert_eq!(w.stored("v").unwrap().state, VolumeState::Created);
    // A record claimed for deletion is not adopted by a Create.
    w.store.records.lock().unwrap().get_mut("v").unwrap().state = VolumeState::Deleting;
    let err = w.create("v").await.unwrap_err();
    assert!(err.to_string().contains("being cleaned up"), "{err}");
}

/// The daemon's sweep (watched) judges an unfinished record abandoned only once it has
/// itself seen it unchanged for the grace. A record another replica's clock dates an hour
/// back (a replica whose clock is behind this one's, its Create still running) is left
/// alone at first sight; one dated years ahead (written while a clock ran ahead, set back
/// since) is reclaimed once watched. Before, the wall clocks alone decided: the first was
/// claimed at once (its live Create failed), the second never reclaimed.
#[tokio::test]
async fn the_daemons_sweep_ages_records_by_its_own_watch() {
    let w = World::new(Fake::new(false, false));
    for id in ["past", "future"] {
        w.fake.script("CreateVolume", Fault::LostAnswer);
        w.create(id).await.unwrap_err();
    }
    let now = crate::system::now_secs();
    {
        let mut records = w.store.records.lock().unwrap();
        records.get_mut("past").unwrap().updated_at = now - 3600;
        records.get_mut("future").unwrap().updated_at = now + 10 * 365 * 86_400;
    }
    let grace = Duration::from_secs(1);
    let first = w
        .controller()
        .sweep_abandoned_creates_watched(grace)
        .await
        .unwrap();
    assert_eq!(first.reclaimed, 0, "{first:?}");
    assert_eq!(w.backend_volumes().len(), 2);
    // Watched unchanged for the grace (a lower bound, never an upper one).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = w
        .controller()
        .sweep_abandoned_creates_watched(grace)
        .await
        .unwrap();
    assert_eq!(second.reclaimed, 2, "{second:?}");
    assert!(w.backend_volumes().is_empty(), "{:?}", w.backend_volumes());
}

/// An unfinished Create resolved by the sweep is deleted whatever the reclaim policy, as
/// the undo of an unanswered Create deletes it: Cube never had the volume, and once its
/// record is gone nothing names it. Before, a Retain policy kept it for nobody.
#[tokio::test]
async fn the_sweep_deletes_an_unfinished_create_whatever_the_reclaim_policy() {
    let mut w = World::new(Fake::new(false, false));
    w.retaining();
    w.fake.script("CreateVolume", Fault::LostAnswer);
    w.create("v").await.unwrap_err();
    assert_eq!(w.backend_volumes().len(), 1, "the driver made it");
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.backend_volumes().is_empty(), "{:?}", w.backend_volumes());
    assert!(w.stored("v").is_none());
}

/// A node side that does not know its own boot takes no record for an earlier boot's.
/// Before, an unreadable boot id read as empty, every record then looked like one of a
/// dead boot, and an Attach by another namespace tore down (NodeUnpublish, NodeUnstage)
/// the volume the first namespace's sandbox still used, and forgot that holder.
#[tokio::test]
async fn a_node_side_blind_to_its_boot_tears_down_nothing_held() {
    let mut w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let config = world_config(w.dir.path(), "");
    w.bridge = sides_in_boot(
        &config,
        &w.fake,
        w.store.clone(),
        Roles::BOTH,
        ConfigSettings::new(&config.volume, &config.secrets),
        Arc::new(crate::store::FileJournal::open(&config.state.journal_dir()).unwrap()),
        String::new(),
    );
    w.fake.clear_calls();
    w.attach("v", "ns2", "s2", 0).await.unwrap();
    let calls = w.fake.mutating_calls();
    assert!(!calls.iter().any(|c| c.starts_with("NodeUn")), "{calls:?}");
    let record = w.record("v").unwrap();
    assert_eq!(record.holders["ns1"], BTreeSet::from(["s1".to_string()]));
}

/// A failed Attach of a volume another namespace's sandbox uses (its mount was there
/// before) leaves what that mount sits on, the staging, even when the record says the
/// staging is uncertain (a repair of a dead mount cut short by a crash marks it so).
/// Before, the undo kept the publish but unstaged the volume under it.
#[tokio::test]
async fn a_failed_attach_never_unstages_what_a_held_mount_sits_on() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let journal = w.bridge.node().unwrap().node_journal();
    let mut record = journal.load("v").unwrap().unwrap();
    (record.stage, record.publish) = (Step::Uncertain, Step::Uncertain);
    journal.save(&record, true).unwrap();
    journal.mark_pending("v").unwrap();
    w.fake.script("NodeStageVolume", Fault::Final);
    w.fake.clear_calls();
    w.attach("v", "ns2", "s2", 0).await.unwrap_err();
    let calls = w.fake.mutating_calls();
    assert!(!calls.iter().any(|c| c.starts_with("NodeUn")), "{calls:?}");
    assert!(w.fake.is_mounted(&w.staging("v")) && w.fake.is_mounted(&w.target("v")));
    let record = w.record("v").unwrap();
    assert_eq!(record.holders["ns1"], BTreeSet::from(["s1".to_string()]));
}

/// The extra NodeUnpublish a repair sends to a held volume's host_path that lost its
/// mount (the driver may still count the publish) goes to a path that passed its check,
/// as every unmount's does. Before, a link planted there by whoever can write the base
/// dir took that NodeUnpublish (as root, by a driver that follows it) to any mount point,
/// and only the NodePublish after it was refused.
#[tokio::test]
async fn a_repair_sends_no_unpublish_to_a_host_path_that_fails_its_check() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.unmount_behind_our_back(&w.target("v"));
    w.fake.plant(w.target("v"));
    w.fake.clear_calls();
    let _ = w
        .bridge
        .node()
        .unwrap()
        .reconcile_node(super::reconcile::Scope::All)
        .await;
    let calls = w.fake.mutating_calls();
    assert!(
        !calls.iter().any(|c| c == "NodeUnpublishVolume"),
        "{calls:?}"
    );
    // The same when the link is planted while the repair's NodeStage runs.
    w.fake.unplant(&w.target("v"));
    w.fake.plant_on("NodeStageVolume", w.target("v"));
    w.fake.clear_calls();
    w.attach("v", "ns2", "s2", 0).await.unwrap_err();
    let calls = w.fake.mutating_calls();
    assert!(
        !calls.iter().any(|c| c == "NodeUnpublishVolume"),
        "{calls:?}"
    );
}

/// The config of a world in `dir` whose volumes are `capacity` bytes.
fn config_with_capacity(dir: &Path, capacity: u64) -> Config {
    world_config(dir, &format!("[volume]\ncapacity_bytes = {capacity}"))
}

/// A Create whose answer was lost is resolved (by the sweep, a Destroy, or a repeated
/// Create) with the request it made, whatever `volume.capacity_bytes` says now: its
/// intent records the size asked for. Before, the repeat asked for the size configured
/// now, which a driver answers ALREADY_EXISTS for good (CSI: the same name with another
/// size): every sweep failed, the volume leaked, and every Create of the id was refused
/// as "being cleaned up".
#[tokio::test]
async fn an_unfinished_create_is_resolved_with_the_size_it_asked_for() {
    let mut w = World::new(Fake::new(false, false));
    w.fake.state.lock().unwrap().asked_sizes = Some(BTreeMap::new());
    let small = config_with_capacity(w.dir.path(), 1 << 20);
    let sides = |config: &Config| {
        sides_with(
            config,
            &w.fake,
            w.store.clone(),
            Roles::CONTROLLER,
            ConfigSettings::new(&config.volume, &config.secrets),
        )
    };
    w.bridge = sides(&small);
    w.fake.script("CreateVolume", Fault::LostAnswer);
    w.create("v").await.unwrap_err();
    assert_eq!(w.stored("v").unwrap().state, VolumeState::Creating);
    // The operator raises the capacity; then the sweep runs.
    let large = config_with_capacity(w.dir.path(), 2 << 20);
    w.bridge = sides(&large);
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.backend_volumes().is_empty());
    assert!(w.stored("v").is_none());
    w.create("v").await.unwrap();

    // From no size configured to one: the sweep asks with no size again.
    let unsized_config = config_with_capacity(w.dir.path(), 0);
    w.bridge = sides(&unsized_config);
    w.fake.script("CreateVolume", Fault::LostAnswer);
    w.create("z").await.unwrap_err();
    w.bridge = sides(&large);
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.stored("z").is_none());

    // The same for a repeated Create that finds the intent.
    w.bridge = sides(&small);
    w.fake.script("CreateVolume", Fault::LostAnswer);
    w.create("u").await.unwrap_err();
    w.bridge = sides(&large);
    w.create("u").await.unwrap();
    assert_eq!(w.stored("u").unwrap().state, VolumeState::Created);
}

/// A StorageClass with `reclaimPolicy: Retain`, over the config's settings.
struct RetainingSettings(ConfigSettings);

impl World {
    /// The world's sides again, their volume settings with a Retain policy.
    fn retaining(&mut self) {
        let config = world_config(self.dir.path(), "");
        self.bridge = sides_with(
            &config,
            &self.fake,
            self.store.clone(),
            Roles::BOTH,
            RetainingSettings(ConfigSettings::new(&config.volume, &config.secrets)),
        );
    }
}

#[async_trait]
impl VolumeSettings for RetainingSettings {
    async fn spec(&self, driver_name: &str) -> Result<VolumeSpec, SettingsError> {
        let mut spec = self.0.spec(driver_name).await?;
        spec.deletion = Some(DeletionPolicy {
            retain: true,
            secret: None,
        });
        Ok(spec)
    }

    async fn secrets(&self, usage: SecretUse) -> Result<Secrets, SettingsError> {
        self.0.secrets(usage).await
    }

    async fn deletion_secrets(
        &self,
        deletion: Option<&DeletionPolicy>,
    ) -> Result<Secrets, SettingsError> {
        self.0.deletion_secrets(deletion).await
    }

    async fn check(&self, driver_name: Option<&str>) -> Result<Option<String>, SettingsError> {
        self.0.check(driver_name).await
    }
}

/// Volume settings that make a hook's caller leave while they read a Secret (an
/// apiserver read that takes long enough for CubeMaster to give up): the deletion Secret
/// (`usage` None) or the Secret of `usage`.
struct CallerLeavesAtSecret {
    inner: ConfigSettings,
    caller: Mutex<Option<Caller>>,
    usage: Option<SecretUse>,
}

impl CallerLeavesAtSecret {
    fn leave_if(&self, usage: Option<SecretUse>) {
        if usage == self.usage
            && let Some(caller) = self.caller.lock().unwrap().take()
        {
            caller.leave();
        }
    }
}

impl World {
    /// The world's sides again, `caller` leaving when the Secret of `usage` is read.
    fn caller_leaves_at_secret(&mut self, caller: &Caller, usage: Option<SecretUse>) {
        let config = world_config(self.dir.path(), "");
        self.bridge = sides_with(
            &config,
            &self.fake,
            self.store.clone(),
            Roles::BOTH,
            CallerLeavesAtSecret {
                inner: ConfigSettings::new(&config.volume, &config.secrets),
                caller: Mutex::new(Some(caller.clone())),
                usage,
            },
        );
    }
}

#[async_trait]
impl VolumeSettings for CallerLeavesAtSecret {
    async fn spec(&self, driver_name: &str) -> Result<VolumeSpec, SettingsError> {
        self.inner.spec(driver_name).await
    }

    async fn secrets(&self, usage: SecretUse) -> Result<Secrets, SettingsError> {
        self.leave_if(Some(usage));
        self.inner.secrets(usage).await
    }

    async fn deletion_secrets(
        &self,
        deletion: Option<&DeletionPolicy>,
    ) -> Result<Secrets, SettingsError> {
        self.leave_if(None);
        self.inner.deletion_secrets(deletion).await
    }

    async fn check(&self, driver_name: Option<&str>) -> Result<Option<String>, SettingsError> {
        self.inner.check(driver_name).await
    }
}

/// A Destroy whose caller leaves while its deletion Secret is read deletes nothing: Cube
/// was told it failed and keeps the volume. Before, the caller was looked at before that
/// read, and the volume was deleted under a Cube that still listed it.
#[tokio::test]
async fn a_destroy_whose_caller_left_during_its_secret_read_deletes_nothing() {
    let mut w = World::new(Fake::new(false, false));
    w.create("data").await.unwrap();
    let caller = Caller::waiting();
    w.caller_leaves_at_secret(&caller, None);
    w.bridge
        .destroy(
            DestroyVolume {
                volume_id: "data".into(),
            },
            &caller,
        )
        .await
        .unwrap_err();
    assert_eq!(w.backend_volumes().len(), 1);
    assert!(w.stored("data").is_some());
    // Cube's retry deletes it.
    w.destroy("data").await.unwrap();
    assert!(w.backend_volumes().is_empty());
}

/// A snapshot name the driver already gave another volume's snapshot (another bridge on
/// the same CSI driver with the same name prefix, or a record lost here) is refused, and
/// nothing is recorded: the driver handed back the other volume's snapshot. Before, it
/// was recorded as this one's, and a `snapshot delete` or `restore` through it reached
/// the other's data.
#[tokio::test]
async fn a_snapshot_the_driver_answers_with_another_volumes_is_refused() {
    let w = World::new(Fake::new(false, false));
    w.create("a").await.unwrap();
    w.create("b").await.unwrap();
    w.controller()
        .create_snapshot("a", "nightly")
        .await
        .unwrap();
    // The record is another bridge's (its own store), not this one's.
    w.fake
        .snapshot_records
        .snapshots
        .lock()
        .unwrap()
        .remove("nightly");
    let err = w
        .controller()
        .create_snapshot("b", "nightly")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("another bridge"), "{err}");
    assert!(
        !w.fake
            .snapshot_records
            .snapshots
            .lock()
            .unwrap()
            .contains_key("nightly")
    );
    assert!(
        !w.fake
            .mutating_calls()
            .contains(&"DeleteSnapshot".to_string())
    );
    // An attempt whose answer was lost leaves its record unfinished; deleting it finds
    // the name is the other volume's snapshot, and removes only the record.
    w.fake.script("CreateSnapshot", Fault::Uncertain);
    w.controller()
        .create_snapshot("b", "nightly")
        .await
        .unwrap_err();
    let recorded = |id: &str| {
        w.fake
            .snapshot_records
            .snapshots
            .lock()
            .unwrap()
            .contains_key(id)
    };
    assert!(recorded("nightly"));
    w.controller().delete_snapshot("nightly").await.unwrap();
    assert!(!recorded("nightly"));
    assert!(
        !w.fake
            .mutating_calls()
            .contains(&"DeleteSnapshot".to_string())
    );
}

/// A Create whose caller leaves while the provisioner Secret is read (after its intent
/// is written) makes no volume, and leaves no intent. Before, the caller was looked at
/// only before the intent, and a volume was made for nobody, only for the undo to
/// delete it (and leaked if the undo failed).
#[tokio::test]
async fn a_create_whose_caller_left_before_create_volume_makes_nothing() {
    let mut w = World::new(Fake::new(false, false));
    let caller = Caller::waiting();
    w.caller_leaves_at_secret(&caller, Some(SecretUse::Provisioner));
    w.create_for("data", &caller).await.unwrap_err();
    assert_eq!(w.fake.mutating_calls(), Vec::<String>::new());
    assert!(w.stored("data").is_none());
    assert!(w.backend_volumes().is_empty());
}

/// Cube lets a volume_id be used again once its volume is destroyed. With a Retain
/// policy the destroyed volume's CSI volume (and its data) is kept; a new Create of the
/// same id gets a new one. Before, both Creates sent CreateVolume the same name, and the
/// driver, idempotent by name, handed the new volume the kept one with the old owner's
/// data.
#[tokio::test]
async fn a_reused_volume_id_never_gets_the_volume_a_retain_policy_kept() {
    let mut w = World::new(Fake::new(false, false));
    w.retaining();
    let first = w.create("data").await.unwrap();
    w.destroy("data").await.unwrap();
    let kept = VolumeHandle::decode(&first.private_data).unwrap();
    assert_eq!(w.backend_volumes().len(), 1, "the Retain policy keeps it");
    let second = w.create("data").await.unwrap();
    let new = VolumeHandle::decode(&second.private_data).unwrap();
    assert_ne!(new.csi_volume_id, kept.csi_volume_id);
    assert_eq!(w.backend_volumes().len(), 2);
}

#[tokio::test]
async fn private_data_too_large_deletes_the_volume_and_the_record() {
    let w = World::new(Fake::new(false, false));
    // A driver whose volume handle cannot fit in Cube's 1024 bytes.
    w.fake.state.lock().unwrap().next_handle = Some("x".repeat(1100));
    let err = w.create("v").await.unwrap_err();
    assert!(err.to_string().contains("1024"), "{err}");
    assert!(w.stored("v").is_none());
    assert!(w.backend_volumes().is_empty());
}

#[tokio::test]
async fn destroy_refuses_to_hand_a_handle_to_another_driver() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.store
        .records
        .lock()
        .unwrap()
        .get_mut("v")
        .unwrap()
        .csi_driver = Some("other.csi".into());
    let err = w.destroy("v").await.unwrap_err();
    assert!(err.to_string().contains("other.csi"), "{err}");
    assert_eq!(w.backend_volumes().len(), 1);
}

#[tokio::test]
async fn the_holder_log_stays_bounded_however_long_a_volume_stays_mounted() {
    let w = World::new(Fake::new(false, false));
    w.attach("v", "ns1", "holder", 0).await.unwrap();
    let log = w.dir.path().join("state/node/v.holders");
    let mut longest = 0;
    for n in 0..500 {
        let sandbox = format!("sandbox-with-a-long-name-{n}");
        w.attach("v", "ns1", &sandbox, 1).await.unwrap();
        w.detach("v", "ns1", &sandbox, 1).await.unwrap();
        longest = longest.max(std::fs::metadata(&log).map_or(0, |m| m.len()));
    }
    assert!(
        longest <= super::records::HOLDER_LOG_LIMIT + 128,
        "the holder log grew to {longest} bytes"
    );
    let record = w.record("v").unwrap();
    assert_eq!(
        record.holders["ns1"],
        BTreeSet::from(["holder".to_string()])
    );
    assert!(
        w.fake.mutating_calls().len() == 1,
        "{:?}",
        w.fake.mutating_calls()
    );
}

// ---------------------------------------------------------------- record integrity

impl World {
    fn edit_record(&self, volume: &str, edit: impl FnOnce(&mut VolumeRecord)) {
        edit(self.store.records.lock().unwrap().get_mut(volume).unwrap());
    }
}

#[tokio::test]
async fn a_record_pointed_at_another_volumes_handle_deletes_nothing() {
    let w = World::new(Fake::new(false, false));
    w.create("mine").await.unwrap();
    w.create("theirs").await.unwrap();
    let theirs = w.stored("theirs").unwrap().csi_volume_id.unwrap();
    assert!(w.stored("mine").unwrap().integrity.is_some(), "signed");
    w.edit_record("mine", |r| r.csi_volume_id = Some(theirs.clone()));
    w.fake.clear_calls();
    let err = w.destroy("mine").await.unwrap_err().to_string();
    assert!(
        err.contains("integrity") && err.contains(&theirs) && err.contains("\"mine\""),
        "{err}"
    );
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert_eq!(w.backend_volumes().len(), 2);
    assert!(
        w.stored("mine").is_some(),
        "the record is kept for the operator"
    );
    // Restoring the original value makes Destroy work again.
    let original = w.stored("theirs").unwrap();
    let mine = w.csi_name("mine");
    w.edit_record("mine", |r| {
        r.csi_volume_id = Some(w.fake.state.lock().unwrap().volumes[&mine].clone())
    });
    w.destroy("mine").await.unwrap();
    assert_eq!(w.backend_volumes().len(), 1);
    assert_eq!(w.stored("theirs"), Some(original));
}

#[tokio::test]
async fn the_sweep_refuses_a_tampered_abandoned_record() {
    let w = World::new(Fake::new(false, false));
    w.create("victim").await.unwrap();
    w.fake.script("CreateVolume", Fault::Uncertain);
    w.create("abandoned").await.unwrap_err();
    // Aged (not covered by the MAC) and pointed at the victim's CSI name (covered).
    let victim = w.csi_name("victim");
    w.edit_record("abandoned", |r| {
        r.updated_at -= 3600;
        r.csi_name = victim.clone();
    });
    w.fake.clear_calls();
    let report = w
        .bridge
        .controller()
        .unwrap()
        .sweep_abandoned_creates(Duration::from_secs(600))
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (0, 1), "{report:?}");
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert!(w.backend_volumes().contains_key(&victim));
    assert_eq!(w.stored("abandoned").unwrap().state, VolumeState::Creating);
}

#[tokio::test]
async fn records_from_before_macs_are_signed_once_when_the_key_is_made() {
    let w = World::new(Fake::new(false, false));
    // Records an earlier version wrote: no MAC, and no key on disk yet.
    let legacy = |volume: &str, handle: &str| VolumeRecord {
        volume_id: volume.into(),
        csi_name: format!("cube-{volume}"),
        csi_driver: Some("fake.csi".into()),
        state: VolumeState::Created,
        csi_volume_id: Some(handle.into()),
        volume_context: Default::default(),
        capacity_bytes: 0,
        updated_at: 1,
        deletion: None,
        revision: Some("0".into()),
        integrity: None,
        content_source: None,
        accessible_topology: Vec::new(),
        node_expansion_required: false,
        answering_creates: Vec::new(),
    };
    {
        let mut backend = w.fake.state.lock().unwrap();
        backend
            .volumes
            .insert("cube-old".into(), "old-handle".into());
        backend
            .volumes
            .insert("cube-late".into(), "late-handle".into());
    }
    w.store
        .records
        .lock()
        .unwrap()
        .insert("old".into(), legacy("old", "old-handle"));
    let key_file = w.dir.path().join("state/record.key");
    assert!(!key_file.exists());
    // The first controller hook makes the key and signs what was there.
    w.destroy("old").await.unwrap();
    assert!(key_file.exists());
    assert!(!w.backend_volumes().contains_key("cube-old"));
    // An unsigned record that appears later is refused: a MAC may have been stripped.
    w.store
        .records
        .lock()
        .unwrap()
        .insert("late".into(), legacy("late", "late-handle"));
    let err = w.destroy("late").await.unwrap_err().to_string();
    assert!(
        err.contains("no integrity MAC") && err.contains("sign_unsigned_records"),
        "{err}"
    );
    assert!(w.backend_volumes().contains_key("cube-late"));
    // An operator who checked it names it for a re-sign (one restart with the setting).
    let restarted = sides_with(
        &Config::parse(
            &format!(
                "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\ndir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n[controller]\nsign_unsigned_records = [\"late\"]\n",
                d = w.dir.path().display()
            ),
            Path::new("test.toml"),
        )
        .unwrap(),
        &w.fake,
        w.store.clone(),
        Roles::CONTROLLER,
        ConfigSettings::new(&Default::default(), &Default::default()),
    );
    restarted
        .destroy(
            DestroyVolume {
                volume_id: "late".into(),
            },
            &Caller::waiting(),
        )
        .await
        .unwrap();
    assert!(!w.backend_volumes().contains_key("cube-late"));
}

/// A store whose first `list` fails as an unreachable API server would.
#[derive(Debug)]
struct FlakyList {
    inner: Arc<MemoryStore>,
    failed_once: Mutex<bool>,
}

#[async_trait]
impl ControllerStore for FlakyList {
    async fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        self.inner.get(volume_id).await
    }
    async fn put(&self, record: &mut VolumeRecord) -> Result<(), StoreError> {
        self.inner.put(record).await
    }
    async fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        self.inner.delete(record).await
    }
    async fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        let first = !std::mem::replace(&mut *self.failed_once.lock().unwrap(), true);
        if first {
            return Err(StoreError::Backend {
                store: "flaky".into(),
                action: "listing".into(),
                transient: true,
                source: "unreachable".into(),
            });
        }
        self.inner.list().await
    }
    fn describe(&self) -> String {
        "flaky".into()
    }
}

#[tokio::test]
async fn a_signing_pass_cut_short_by_an_unreachable_store_is_retried() {
    let w = World::new(Fake::new(false, false));
    let store = Arc::new(FlakyList {
        inner: w.store.clone(),
        failed_once: Mutex::new(false),
    });
    let config = Arc::new(
        Config::parse(
            &format!(
                "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\ndir = \"{d}/fresh-state\"\nlock_dir = \"{d}/locks\"\n",
                d = w.dir.path().display()
            ),
            Path::new("test.toml"),
        )
        .unwrap(),
    );
    let bridge = sides_with(
        &config,
        &w.fake,
        store,
        Roles::CONTROLLER,
        ConfigSettings::new(&Default::default(), &Default::default()),
    );
    w.fake
        .state
        .lock()
        .unwrap()
        .volumes
        .insert("cube-old".into(), "old-handle".into());
    w.store.records.lock().unwrap().insert(
        "old".into(),
        VolumeRecord {
            volume_id: "old".into(),
            csi_name: "cube-old".into(),
            csi_driver: Some("fake.csi".into()),
            state: VolumeState::Created,
            csi_volume_id: Some("old-handle".into()),
            volume_context: Default::default(),
            capacity_bytes: 0,
            updated_at: 1,
            deletion: None,
            revision: Some("0".into()),
            integrity: None,
            content_source: None,
            accessible_topology: Vec::new(),
            node_expansion_required: false,
            answering_creates: Vec::new(),
        },
    );
    let caller = Caller::waiting();
    let destroy = || {
        bridge.destroy(
            DestroyVolume {
                volume_id: "old".into(),
            },
            &caller,
        )
    };
    let err = destroy().await.unwrap_err();
    assert!(
        matches!(&err.error, BridgeError::Store(e) if e.is_transient()),
        "{err}"
    );
    // The key exists now, but this process still owes the signing pass.
    destroy().await.unwrap();
    assert!(!w.backend_volumes().contains_key("cube-old"));
}

/// A journal whose record writes fail on demand (a full disk) while appends still work.
#[derive(Debug)]
struct FailingSaves {
    inner: crate::store::FileJournal,
    fail: std::sync::atomic::AtomicBool,
    /// The disk fills up right after the next durable save (the one before the first CSI
    /// call): every later save fails.
    fill_after_durable: std::sync::atomic::AtomicBool,
    /// Holder lines cannot be appended (the log needs a block a full disk has not).
    fail_appends: std::sync::atomic::AtomicBool,
    /// Durable saves fail (the intent log needs a block a full disk has not); others work.
    fail_durable: std::sync::atomic::AtomicBool,
    /// Pending markers cannot be made (a disk out of inodes).
    fail_marks: std::sync::atomic::AtomicBool,
    /// Every record written, in order.
    saved: Mutex<Vec<NodeRecord>>,
    /// The next save that is no durable one (a fold of the holder log) says so on the
    /// first channel, then stalls until the second one speaks, then fails: a hook Cube
    /// kills while it waits for a disk.
    stall_next_fold: Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
}

impl NodeJournal for FailingSaves {
    fn load(&self, volume_id: &str) -> Result<Option<NodeRecord>, JournalError> {
        self.inner.load(volume_id)
    }
    fn save(&self, record: &NodeRecord, durable: bool) -> Result<(), JournalError> {
        use std::sync::atomic::Ordering::SeqCst;
        let stall = (!durable)
            .then(|| self.stall_next_fold.lock().unwrap().take())
            .flatten();
        if let Some((reached, release)) = stall {
            reached.send(()).unwrap();
            let _ = release.recv();
            return Err(JournalError::Io {
                path: "record".into(),
                source: std::io::Error::from_raw_os_error(28),
            });
        }
        if self.fail.load(SeqCst) || (durable && self.fail_durable.load(SeqCst)) {
            return Err(JournalError::Io {
                path: "record".into(),
                source: std::io::Error::from_raw_os_error(28),
            });
        }
        self.inner.save(record, durable)?;
        self.saved.lock().unwrap().push(record.clone());
        if durable && self.fill_after_durable.swap(false, SeqCst) {
            self.fail.store(true, SeqCst);
        }
        Ok(())
    }
    fn append_holder(
        &self,
        volume_id: &str,
        change: &super::records::HolderChange,
    ) -> Result<u64, JournalError> {
        if self.fail_appends.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(JournalError::Io {
                path: "holder log".into(),
                source: std::io::Error::from_raw_os_error(28),
            });
        }
        self.inner.append_holder(volume_id, change)
    }
    fn holder_log_changes(&self, volume_id: &str) -> u64 {
        self.inner.holder_log_changes(volume_id)
    }
    fn load_holders(
        &self,
        volume_id: &str,
    ) -> Result<Option<(super::records::Holders, super::records::HolderTimes)>, JournalError> {
        self.inner.load_holders(volume_id)
    }
    fn keep_last_hooks(&self, last_hook: &BTreeMap<String, u64>) -> Result<(), JournalError> {
        self.inner.keep_last_hooks(last_hook)
    }
    fn kept_last_hooks(&self) -> Result<BTreeMap<String, u64>, JournalError> {
        self.inner.kept_last_hooks()
    }
    fn remove(&self, volume_id: &str) -> Result<(), JournalError> {
        self.inner.remove(volume_id)
    }
    fn volume_ids(&self) -> Result<BTreeSet<String>, JournalError> {
        self.inner.volume_ids()
    }
    fn mark_pending(&self, volume_id: &str) -> Result<(), JournalError> {
        if self.fail_marks.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(JournalError::Io {
                path: "pending marker".into(),
                source: std::io::Error::from_raw_os_error(28),
            });
        }
        self.inner.mark_pending(volume_id)
    }
    fn clear_pending(&self, volume_id: &str) -> Result<(), JournalError> {
        self.inner.clear_pending(volume_id)
    }
    fn pending_since(&self) -> Result<Vec<(String, Option<std::time::SystemTime>)>, JournalError> {
        self.inner.pending_since()
    }
}

impl World {
    /// Rewires the bridge over a journal whose saves fail on demand.
    fn with_failing_saves(&mut self) -> Arc<FailingSaves> {
        let config = Config::parse(
            &format!(
                "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\ndir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n[node]\ndefault_volume_base_dir = \"{d}/vol\"\n",
                d = self.dir.path().display()
            ),
            Path::new("test.toml"),
        )
        .unwrap();
        let journal = Arc::new(FailingSaves {
            inner: crate::store::FileJournal::open(&config.state.journal_dir()).unwrap(),
            fail: Default::default(),
            fill_after_durable: Default::default(),
            fail_appends: Default::default(),
            fail_durable: Default::default(),
            fail_marks: Default::default(),
            saved: Default::default(),
            stall_next_fold: Default::default(),
        });
        self.bridge = sides_over(
            &config,
            &self.fake,
            self.store.clone(),
            Roles::BOTH,
            ConfigSettings::new(&config.volume, &config.secrets),
            journal.clone(),
        );
        journal
    }
}

/// A fold of a long holder log into its record that fails (a full disk) does not fail the
/// hot Attach or Detach Cube sees: the change is still appended, the log stays long.
#[tokio::test]
async fn a_failed_fold_of_the_holder_log_does_not_fail_the_hook() {
    let mut w = World::new(Fake::new(false, false));
    let journal = w.with_failing_saves();
    w.attach("v", "ns1", "holder", 0).await.unwrap();
    journal
        .fail
        .store(true, std::sync::atomic::Ordering::SeqCst);
    for n in 0..200 {
        let sandbox = format!("sandbox-with-a-long-name-{n}");
        w.attach("v", "ns1", &sandbox, 1)
            .await
            .unwrap_or_else(|e| panic!("hot attach {n}: {e}"));
        w.detach("v", "ns1", &sandbox, 1)
            .await
            .unwrap_or_else(|e| panic!("hot detach {n}: {e}"));
    }
    let log = w.dir.path().join("state/node/v.holders");
    assert!(
        std::fs::metadata(&log).unwrap().len() > super::records::HOLDER_LOG_LIMIT,
        "the folds were tried and failed"
    );
    journal
        .fail
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        w.record("v").unwrap().holders["ns1"],
        BTreeSet::from(["holder".to_string()])
    );
}

/// Cube kills a forked hook at any instant and then counts it failed: an Attach's sandbox
/// is released and never Detached. A hot Attach that must fold a long holder log into its
/// record does so before it writes its own line, so a hook stopped in the fold (here: a
/// disk that stalls, the files looked at as a kill would leave them) has recorded nothing
/// of its sandbox.
#[test]
fn a_hot_attach_stopped_while_it_folds_the_log_has_not_recorded_its_sandbox() {
    let (reached_tx, reached) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    let (journal_dir_tx, journal_dir) = std::sync::mpsc::channel();
    let attaching = Arc::new(Mutex::new(String::new()));
    let hooks = {
        let attaching = attaching.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let mut w = World::new(Fake::new(false, false));
                let journal = w.with_failing_saves();
                journal_dir_tx
                    .send(w.dir.path().join("state/node"))
                    .unwrap();
                w.attach("v", "ns1", "holder", 0).await.unwrap();
                *journal.stall_next_fold.lock().unwrap() = Some((reached_tx, release_rx));
                for n in 0..1000 {
                    let sandbox = format!("sandbox-with-a-long-name-{n}");
                    *attaching.lock().unwrap() = sandbox.clone();
                    w.attach("v", "ns1", &sandbox, 1).await.unwrap();
                    if journal.stall_next_fold.lock().unwrap().is_none() {
                        return;
                    }
                }
                panic!("no fold in 1000 hot Attaches");
            });
        })
    };
    reached
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("a hot Attach folded the log");
    let stopped = attaching.lock().unwrap().clone();
    let journal = crate::store::FileJournal::open(&journal_dir.recv().unwrap()).unwrap();
    let holders = journal.load("v").unwrap().unwrap().holders;
    release.send(()).unwrap();
    hooks.join().unwrap();
    assert!(holders["ns1"].contains("holder"));
    assert!(
        !holders["ns1"].contains(&stopped),
        "{stopped}, stopped in its fold, is recorded as a holder"
    );
}

/// A first Attach whose host_path is already a mount point (another instance's: colliding
/// driver and volume names) is refused before any CSI call, and leaves that mount alone.
#[tokio::test]
async fn a_first_attach_never_publishes_onto_a_mount_it_did_not_make() {
    let w = World::new(Fake::new(true, false));
    w.fake.mounted.lock().unwrap().insert(w.target("v"));
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(err.to_string().contains("no record"), "{err}");
    assert!(
        w.fake
            .state
            .lock()
            .unwrap()
            .calls
            .iter()
            .all(|c| !c.starts_with("Node") && !c.starts_with("ControllerPublish")),
        "{:?}",
        w.fake.state.lock().unwrap().calls
    );
    assert!(w.fake.is_mounted(&w.target("v")), "the other mount stays");
    assert!(w.record("v").is_none());
}

// ---------------------------------------------------------------- paths under the base dir

/// The refusal of `path` by another user's symlink, as Cube reads it.
fn assert_refuses(err: &HookError, path: &Path) {
    let text = err.to_string();
    assert!(
        matches!(
            &err.error,
            BridgeError::Path(PathError::Refused { path: p, .. }) if p == path
        ) && text.contains(&format!("refusing {}", path.display()))
            && text.contains("owner uid 65534"),
        "{text}"
    );
}

/// A symlink at the host_path is refused before anything is recorded or called.
#[tokio::test]
async fn a_symlink_at_the_host_path_is_refused_and_nothing_changes() {
    let w = World::new(Fake::new(true, false));
    w.fake.plant(w.target("v"));
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert_refuses(&err, &w.target("v"));
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert!(w.record("v").is_none());
    assert!(w.pending().is_empty());
    // Once it is gone, the volume attaches.
    w.fake.unplant(&w.target("v"));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
}

/// A symlink at .staging is refused too, whether it was there first or planted while
/// ControllerPublish ran (the check just before NodeStage).
#[tokio::test]
async fn a_symlink_at_staging_is_refused_before_the_driver_gets_the_path() {
    let w = World::new(Fake::new(true, false));
    let dot_staging = w.base().join(".staging");
    w.fake.plant(dot_staging.clone());
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert_refuses(&err, &dot_staging);
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert!(w.record("v").is_none());
    w.fake.unplant(&dot_staging);

    let w = World::new(Fake::new(true, true));
    let dot_staging = w.base().join(".staging");
    w.fake
        .plant_on("ControllerPublishVolume", dot_staging.clone());
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert_refuses(&err, &dot_staging);
    assert_eq!(
        w.fake.mutating_calls(),
        ["ControllerPublishVolume", "ControllerUnpublishVolume"],
        "no NodeStage, no NodeUnstage through the symlink"
    );
    assert!(w.record("v").is_none(), "rolled back");
    assert!(w.pending().is_empty());
}

/// A host_path swapped for a symlink after NodeStage: NodePublish is never called, and the
/// rollback unstages (its own, checked path) but neither unpublishes nor removes the link.
#[tokio::test]
async fn a_host_path_swapped_mid_attach_is_not_published_and_the_rollback_finishes() {
    let w = World::new(Fake::new(true, false));
    w.fake.plant_on("NodeStageVolume", w.target("v"));
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert_refuses(&err, &w.target("v"));
    assert_eq!(
        w.fake.mutating_calls(),
        ["NodeStageVolume", "NodeUnstageVolume"]
    );
    assert!(!w.fake.is_mounted(&w.staging("v")));
    assert!(w.record("v").is_none(), "rolled back, not left pending");
    assert!(w.pending().is_empty());
}

/// Detach never unstages through a swapped .staging: it answers the refusal, keeps the
/// volume pending with its staging mount, and finishes once the path is repaired.
#[tokio::test]
async fn a_detach_never_unstages_through_a_swapped_staging_dir() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let dot_staging = w.base().join(".staging");
    w.fake.plant(dot_staging.clone());
    w.fake.clear_calls();
    let err = w.detach("v", "ns1", "s1", 0).await.unwrap_err();
    assert_refuses(&err, &dot_staging);
    assert_eq!(w.fake.mutating_calls(), ["NodeUnpublishVolume"]);
    assert!(
        w.fake.is_mounted(&w.staging("v")),
        "the real staging mount stays known"
    );
    assert!(w.pending().contains(&"v".to_string()));
    // The same answer on a retry, not another error.
    let again = w.detach("v", "ns1", "s1", 0).await.unwrap_err();
    assert_refuses(&again, &dot_staging);
    w.fake.unplant(&dot_staging);
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    // The unpublish again (idempotent), since the stage is still to be undone: a driver
    // that counts publishes must not refuse the unstage.
    assert_eq!(
        w.fake.mutating_calls(),
        ["NodeUnpublishVolume", "NodeUnstageVolume"]
    );
    w.assert_clean("v");
}

/// A first Attach checks each path once per step, each step one trip to a blocking
/// thread: Attach's check (base dir made, target, staging), the staging dir made, then
/// target and staging before NodePublish. Issue 20: it made 9 checks in 5 trips, because
/// a volume with no record had Attach's check twice, establish made the base dir again,
/// and the staging path ensure_staging_dir had just checked was checked again.
#[tokio::test]
async fn a_first_attach_checks_each_path_once_per_step() {
    let w = World::new(Fake::new(true, false));
    let before = w.fake.path_checks();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(w.fake.path_checks() - before, 6);
    // With ControllerPublish between, the staging path is checked again before NodeStage.
    let w = World::new(Fake::new(true, true));
    let before = w.fake.path_checks();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(w.fake.path_checks() - before, 7);
}

/// The hot path checks no path: nothing on it reaches the driver or the directories.
#[tokio::test]
async fn a_hot_attach_and_detach_check_no_path() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let before = w.fake.path_checks();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    w.detach("v", "ns1", "s2", 1).await.unwrap();
    assert_eq!(w.fake.path_checks(), before);
}

/// A symlinked .staging is named as what it is, not taken for another instance's mount
/// that the mount check sees through it.
#[tokio::test]
async fn a_symlink_below_the_base_is_named_before_a_mount_seen_through_it() {
    let w = World::new(Fake::new(true, false));
    let dot_staging = w.base().join(".staging");
    w.fake.plant(dot_staging.clone());
    w.fake.mounted.lock().unwrap().insert(w.staging("v"));
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert_refuses(&err, &dot_staging);
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
}

// ---------------------------------------------------------------- issue 19: lost records, repaired mounts, full disks

impl World {
    fn record_file(&self, volume: &str) -> PathBuf {
        self.dir.path().join(format!("state/node/{volume}.json"))
    }

    fn holder_log(&self, volume: &str) -> PathBuf {
        self.dir.path().join(format!("state/node/{volume}.holders"))
    }

    async fn reconcile_all(&self) -> super::reconcile::ReconcileReport {
        self.bridge
            .node()
            .unwrap()
            .reconcile_node(super::reconcile::Scope::All)
            .await
            .unwrap()
    }
}

/// Issue 19, defect 3: a lost record (emptied or truncated) is rebuilt with the holders
/// its log's snapshot names, so one namespace's last Detach leaves the mount another
/// namespace holds, whichever namespace attached first (the first one's holder is only in
/// the snapshot, not among the logged changes).
#[tokio::test]
async fn a_lost_record_keeps_the_holders_of_other_namespaces() {
    for (first, second) in [("nsA", "nsB"), ("nsB", "nsA")] {
        let w = World::new(Fake::new(true, false));
        w.attach("v", "nsA", "a", 0).await.unwrap();
        w.attach("v", "nsB", "b", 0).await.unwrap();
        std::fs::write(w.record_file("v"), b"").unwrap();
        w.detach("v", first, "x", 0).await.unwrap();
        assert!(
            w.fake.is_mounted(&w.target("v")),
            "{first}'s last Detach unmounted what {second} holds"
        );
        let record = w.record("v").unwrap();
        assert!(!record.holders_unknown, "{record:?}");
        assert_eq!(record.holders.keys().collect::<Vec<_>>(), [second]);
        // Truncated this time: the rebuilt record's own snapshot still says who holds it.
        std::fs::write(w.record_file("v"), b"{\"format\":2,\"vol").unwrap();
        w.detach("v", second, "x", 0).await.unwrap();
        w.assert_clean("v");
    }
}

/// Issue 19, defect 3: when neither the record nor its log can say who holds the volume,
/// the record is rebuilt marked so (`list` and the inventory show it), and no last Detach
/// nor reconciliation pass tears down what may be mounted: it is kept and reported.
#[tokio::test]
async fn a_lost_record_whose_holders_cannot_be_known_is_never_torn_down_while_mounted() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "nsA", "a", 0).await.unwrap();
    w.attach("v", "nsB", "b", 0).await.unwrap();
    w.lose_record_and_holders("v");
    w.fake.clear_calls();
    w.detach("v", "nsA", "a", 0).await.unwrap();
    assert!(
        w.fake.is_mounted(&w.target("v")),
        "nsB's mount was torn down"
    );
    let record = w.record("v").unwrap();
    assert!(record.holders_unknown, "{record:?}");
    let node = w.bridge.node().unwrap();
    let listed = super::inventory::node_volumes(node.node_journal().as_ref(), &w.fake)
        .await
        .unwrap();
    assert!(listed[0].holders_unknown, "{listed:?}");
    // Neither the periodic scan nor nsB's own last Detach releases it: it needs an operator.
    let report = w.reconcile_all().await;
    assert_eq!(report.holders_unknown, 1, "{report:?}");
    w.detach("v", "nsB", "b", 0).await.unwrap();
    assert!(w.fake.is_mounted(&w.target("v")));
    w.fake.assert_nothing_unmounted();
    // A later Attach keeps it attached (a new holder does not reveal the others).
    w.attach("v", "nsC", "c", 0).await.unwrap();
    assert!(w.record("v").unwrap().holders_unknown);
    // Once nothing is mounted, nobody can be using it: the last Detach tears it down.
    w.fake.unmount_behind_our_back(&w.target("v"));
    w.detach("v", "nsC", "c", 0).await.unwrap();
    w.assert_clean("v");
}

/// A failed Attach of a volume whose record was lost with its holders leaves what other
/// namespaces may use: before, its undo, finding no other holder it knew of, tore the
/// volume down (NodeUnpublish, NodeUnstage) under them.
#[tokio::test]
async fn a_failed_attach_of_a_volume_whose_holders_are_unknown_keeps_it_mounted() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "nsA", "a", 0).await.unwrap();
    w.lose_record_and_holders("v");
    w.fake.clear_calls();
    w.fake.script("NodePublishVolume", Fault::Final);
    w.attach("v", "nsC", "c", 0).await.unwrap_err();
    assert!(
        w.fake.is_mounted(&w.target("v")),
        "nsA's mount was torn down: {:?}",
        w.fake.mutating_calls()
    );
    w.fake.assert_nothing_unmounted();
    let record = w.record("v").unwrap();
    assert!(record.holders_unknown && !record.is_held(), "{record:?}");
    // Reconciliation reports it rather than finishing a teardown.
    let report = w.reconcile_all().await;
    assert_eq!(report.holders_unknown, 1, "{report:?}");
    assert!(w.fake.is_mounted(&w.target("v")));
    // Cube's retry attaches it; it stays marked.
    w.attach("v", "nsC", "c", 0).await.unwrap();
    assert!(w.record("v").unwrap().holders_unknown);
}

/// Issue 19, defect 5: a lost mount is repaired by NodeUnpublish, then NodePublish, so a
/// driver that counts publishes per target (csi-driver-host-path) counts it once, and the
/// last Detach unstages; before, it counted two and NodeUnstage failed for good.
#[tokio::test]
async fn a_repaired_lost_mount_is_unpublished_before_it_is_published_again() {
    let w = World::new(Fake::counting(true));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.unmount_behind_our_back(&w.target("v"));
    w.fake.clear_calls();
    w.attach("v", "ns1", "s2", 1).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "NodeStageVolume",
            "NodeUnpublishVolume",
            "NodePublishVolume"
        ]
    );
    assert_eq!(w.fake.published(&w.target("v")), 1);
    w.detach("v", "ns1", "s2", 1).await.unwrap();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.assert_clean("v");

    // The same repair by reconciliation (a daemon restart, the periodic scan).
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.unmount_behind_our_back(&w.target("v"));
    assert_eq!(w.reconcile_all().await.repaired, 1);
    assert_eq!(w.fake.published(&w.target("v")), 1);
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.assert_clean("v");
}

/// Issue 19, defect 5: teardown unpublishes whenever the driver may still count the
/// target, not only while the record says published: a volume left with two publishes
/// counted (by an older build's repair) detaches on Cube's retry instead of failing with
/// "still published" forever.
#[tokio::test]
async fn teardown_unpublishes_a_publish_the_record_no_longer_names() {
    let w = World::new(Fake::counting(true));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    *w.fake
        .state
        .lock()
        .unwrap()
        .published
        .get_mut(&w.target("v"))
        .unwrap() = 2;
    let err = w.detach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(err.to_string().contains("NodeUnstageVolume"), "{err}");
    assert_eq!(w.record("v").unwrap().publish, Step::Absent);
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        ["NodeUnpublishVolume", "NodeUnstageVolume"]
    );
    w.assert_clean("v");
}

/// Issue 19, defect 6: when the last journal write of an Attach fails (a full disk) after
/// its CSI calls succeeded, the Attach is rolled back before it answers, although every
/// save of the rollback fails too; nothing is left for the next scan.
#[tokio::test]
async fn an_attach_whose_last_save_fails_is_rolled_back_before_it_answers() {
    let mut w = World::new(Fake::new(true, false));
    let journal = w.with_failing_saves();
    journal
        .fill_after_durable
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(err.to_string().contains("os error 28"), "{err}");
    assert!(
        !matches!(err.error, BridgeError::RollbackFailed { .. }),
        "{err}"
    );
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume"
        ]
    );
    w.assert_clean("v");
    // Space again: the volume attaches as new.
    journal
        .fail
        .store(false, std::sync::atomic::Ordering::SeqCst);
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    assert!(w.record("v").unwrap().is_settled());
}

/// Issue 19, defect 6: a failed repair's last save under other holders undoes only the
/// repair's own publish and keeps the holders that were there.
#[tokio::test]
async fn a_repair_whose_last_save_fails_keeps_the_other_holders() {
    let mut w = World::new(Fake::new(true, false));
    let journal = w.with_failing_saves();
    w.attach("v", "nsA", "a", 0).await.unwrap();
    w.fake.unmount_behind_our_back(&w.target("v"));
    journal
        .fill_after_durable
        .store(true, std::sync::atomic::Ordering::SeqCst);
    w.attach("v", "nsB", "b", 0).await.unwrap_err();
    journal
        .fail
        .store(false, std::sync::atomic::Ordering::SeqCst);
    // The record on disk is the one written before the calls (its last saves failed):
    // steps uncertain, holders as they were. That only overstates what exists.
    let record = w.record("v").unwrap();
    assert_eq!(record.holders.keys().collect::<Vec<_>>(), ["nsA"]);
    assert!(
        w.fake.is_mounted(&w.staging("v")),
        "the stage nsA relies on was undone"
    );
    assert!(!w.fake.is_mounted(&w.target("v")));
    // The next pass mounts it again for nsA.
    assert_eq!(w.reconcile_all().await.repaired, 1);
    assert!(w.fake.is_mounted(&w.target("v")));
}

/// Issue 19, defect 6: a teardown whose progress saves fail (a full disk) still undoes
/// everything and removes the record: stopping would leave the mount for nobody.
#[tokio::test]
async fn a_last_detach_on_a_full_disk_still_tears_down() {
    let mut w = World::new(Fake::new(true, false));
    let journal = w.with_failing_saves();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    journal
        .fail
        .store(true, std::sync::atomic::Ordering::SeqCst);
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.assert_clean("v");
}

/// A last Detach tears down on a disk where no pending marker can be made (out of
/// inodes, and the volume's parked marker pruned): the marker only helps a scan find a
/// teardown cut short. Before, it failed at the marker and left the volume mounted; the
/// same teardown releases what a failed Attach or a dead worker held, which Cube never
/// retries.
#[tokio::test]
async fn a_teardown_goes_on_when_its_pending_marker_cannot_be_made() {
    use std::sync::atomic::Ordering::SeqCst;
    let mut w = World::new(Fake::new(true, false));
    let journal = w.with_failing_saves();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    journal.fail_marks.store(true, SeqCst);
    journal.fail.store(true, SeqCst);
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.assert_clean("v");
}

/// Issue 20: a last Detach writes its record once, saying nobody holds the volume, before
/// the first inverse call, and then removes it: not again after each inverse call (a crash
/// between them only repeats an idempotent one, which the crash matrix proves).
#[tokio::test]
async fn a_last_detach_saves_its_record_once_before_undoing() {
    let mut w = World::new(Fake::new(true, true));
    let journal = w.with_failing_saves();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    journal.saved.lock().unwrap().clear();
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ]
    );
    let saved = journal.saved.lock().unwrap().clone();
    assert_eq!(saved.len(), 1, "{saved:#?}");
    assert!(saved[0].holders.is_empty());
    assert_eq!(
        (
            saved[0].publish,
            saved[0].stage,
            saved[0].controller_publish
        ),
        (Step::Done, Step::Done, Step::Uncertain),
        "written before anything was undone (the publish no longer sure to stand)"
    );
    w.assert_clean("v");
}

/// A teardown stopped by a failing inverse call leaves the record saying exactly what is
/// left (the steps undone before it are Absent), and the next Detach resumes there.
#[tokio::test]
async fn a_teardown_that_stops_records_the_steps_it_undid() {
    let mut w = World::new(Fake::new(true, true));
    let journal = w.with_failing_saves();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.script("ControllerUnpublishVolume", Fault::Final);
    w.detach("v", "ns1", "s1", 0).await.unwrap_err();
    let left = w.record("v").expect("kept for the retry");
    assert_eq!(
        (left.publish, left.stage, left.controller_publish),
        (Step::Absent, Step::Absent, Step::Uncertain)
    );
    assert!(left.holders.is_empty());
    assert_eq!(journal.saved.lock().unwrap().last(), Some(&left));
    w.fake.clear_calls();
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    assert_eq!(w.fake.mutating_calls(), ["ControllerUnpublishVolume"]);
    w.assert_clean("v");
}

// ---------------------------------------------------------------- the record key's provenance

/// A record no bridge signed (written before MACs, or forged with its MAC left off).
fn unsigned_record(volume: &str, handle: &str) -> VolumeRecord {
    VolumeRecord {
        volume_id: volume.into(),
        csi_name: format!("cube-{volume}"),
        csi_driver: Some("fake.csi".into()),
        state: VolumeState::Created,
        csi_volume_id: Some(handle.into()),
        volume_context: Default::default(),
        capacity_bytes: 0,
        updated_at: 1,
        deletion: None,
        revision: Some("0".into()),
        integrity: None,
        content_source: None,
        accessible_topology: Vec::new(),
        node_expansion_required: false,
        answering_creates: Vec::new(),
    }
}

/// The world's config (its state dir) with `controller` added to `[controller]`.
fn config_of(w: &World, controller: &str) -> Config {
    Config::parse(
        &format!(
            "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\ndir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n[controller]\n{controller}\n",
            d = w.dir.path().display()
        ),
        Path::new("test.toml"),
    )
    .unwrap()
}

/// The embedded store's key file, standing in for a key kept where whoever may delete it
/// is not the bridge (Kubernetes' Secret): making it proves no key existed before.
#[derive(Debug)]
struct RemovableKey(crate::store::FileKeySource);

#[async_trait]
impl integrity::RecordKeySource for RemovableKey {
    async fn read(&self) -> Result<Option<integrity::RecordKey>, BridgeError> {
        self.0.read().await
    }
    async fn create(&self) -> Result<integrity::LoadedKey, BridgeError> {
        self.0.create().await
    }
    fn making_proves_first_key(&self) -> bool {
        false
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// A controller side as a fresh process of `w` would make it, its key in a
/// `RemovableKey`.
fn controller_with_removable_key(w: &World, controller: &str) -> ControllerSide {
    let config = config_of(w, controller);
    let core = crate::app::core_settings(&config);
    ControllerSide::new(
        core.clone(),
        ControllerPorts {
            driver: Arc::new(discovery::DriverView::new(
                Arc::new(w.fake.clone()),
                Arc::new(w.fake.clone()),
                core.node_id.clone(),
                core.separate_controller_endpoint,
            )),
            store: w.store.clone(),
            record_key: Arc::new(RemovableKey(crate::store::FileKeySource::new(
                &config.state.dir.join("record.key"),
            ))),
            settings: Arc::new(ConfigSettings::new(&config.volume, &config.secrets)),
            locks: Arc::new(crate::store::FileLocks::new(&config.state.lock_dir).unwrap()),
            clock: Arc::new(crate::system::SystemClock),
            recorder: Arc::new(NoRecorder),
            snapshots: w.fake.snapshot_records.clone(),
        },
    )
}

fn destroy_req(volume: &str) -> DestroyVolume {
    DestroyVolume {
        volume_id: volume.into(),
    }
}

#[tokio::test]
async fn a_lost_key_is_not_replaced_while_signed_records_exist() {
    let w = World::new(Fake::new(false, false));
    w.create("mine").await.unwrap();
    let key_file = w.dir.path().join("state/record.key");
    std::fs::remove_file(&key_file).unwrap();
    // Someone adds a record without a MAC, hoping a new key signs it.
    w.fake
        .state
        .lock()
        .unwrap()
        .volumes
        .insert("cube-planted".into(), "planted-handle".into());
    w.store.records.lock().unwrap().insert(
        "planted".into(),
        unsigned_record("planted", "planted-handle"),
    );
    w.fake.clear_calls();
    // A fresh process (the running one keeps the key it read).
    let restarted = restarted_controller(&w);
    for volume in ["planted", "mine"] {
        let err = restarted
            .destroy(destroy_req(volume), &Caller::waiting())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("record key (file ")
                && err.contains("is missing")
                && err.contains("1 controller record(s) are signed")
                && err.contains("Restore the key"),
            "{err}"
        );
    }
    assert!(!key_file.exists(), "no new key replaces the lost one");
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert!(w.stored("planted").unwrap().integrity.is_none());
}

#[tokio::test]
async fn where_making_a_key_proves_nothing_only_named_unsigned_records_are_signed() {
    let w = World::new(Fake::new(false, false));
    {
        let mut backend = w.fake.state.lock().unwrap();
        backend
            .volumes
            .insert("cube-old".into(), "old-handle".into());
        backend
            .volumes
            .insert("cube-victim".into(), "victim-handle".into());
    }
    // With every MAC stripped and the key gone, a store with a forged record looks like
    // one from before records were signed.
    for (volume, handle) in [("old", "old-handle"), ("forged", "victim-handle")] {
        w.store
            .records
            .lock()
            .unwrap()
            .insert(volume.into(), unsigned_record(volume, handle));
    }
    let controller = controller_with_removable_key(&w, "");
    let err = controller
        .destroy(destroy_req("forged"), &Caller::waiting())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no integrity MAC") && err.contains("sign_unsigned_records = [\"forged\"]"),
        "{err}"
    );
    assert!(
        w.dir.path().join("state/record.key").exists(),
        "the key is made"
    );
    for volume in ["old", "forged"] {
        assert!(
            w.stored(volume).unwrap().integrity.is_none(),
            "{volume} signed"
        );
    }
    // The operator checks "old" against the backend and names it: only it is signed.
    let named = controller_with_removable_key(&w, "sign_unsigned_records = [\"old\", \"gone\"]");
    named
        .destroy(destroy_req("old"), &Caller::waiting())
        .await
        .unwrap();
    assert!(!w.backend_volumes().contains_key("cube-old"));
    named
        .destroy(destroy_req("forged"), &Caller::waiting())
        .await
        .unwrap_err();
    assert!(w.backend_volumes().contains_key("cube-victim"));
    assert!(w.stored("forged").unwrap().integrity.is_none());
}

#[tokio::test]
async fn a_record_signed_under_another_key_is_never_re_signed() {
    let w = World::new(Fake::new(false, false));
    w.create("mine").await.unwrap();
    w.fake
        .state
        .lock()
        .unwrap()
        .volumes
        .insert("cube-victim".into(), "victim-handle".into());
    let someone_elses = integrity::RecordKey::from_bytes(&[9; integrity::KEY_LEN]).unwrap();
    let mut forged = unsigned_record("forged", "victim-handle");
    forged.integrity = Some(someone_elses.sign("fk", &forged));
    let mac = forged.integrity.clone();
    w.store
        .records
        .lock()
        .unwrap()
        .insert("forged".into(), forged);
    let named = "sign_unsigned_records = [\"forged\"]";
    let embedded = sides(
        &config_of(&w, named),
        &w.fake,
        w.store.clone(),
        Roles::CONTROLLER,
    );
    for controller in [
        Arc::new(controller_with_removable_key(&w, named)),
        embedded.controller.unwrap(),
    ] {
        let err = controller
            .destroy(destroy_req("forged"), &Caller::waiting())
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("fails its integrity check"), "{err}");
        assert_eq!(w.stored("forged").unwrap().integrity, mac);
    }
    assert!(w.backend_volumes().contains_key("cube-victim"));
}

/// The controller side of a daemon restarted over `w`'s store and state (its record key
/// file included), with the default config.
fn restarted_controller(w: &World) -> Bridge {
    sides(
        &config_of(w, ""),
        &w.fake,
        w.store.clone(),
        Roles::CONTROLLER,
    )
}

#[tokio::test]
async fn a_key_that_made_none_of_the_signed_records_is_refused_at_start() {
    let w = World::new(Fake::new(false, false));
    w.create("a").await.unwrap();
    w.create("b").await.unwrap();
    // The key file replaced (by whoever could): every signed record fails under it.
    let key_file = w.dir.path().join("state/record.key");
    std::fs::write(&key_file, format!("{}\n", "ab".repeat(32))).unwrap();
    let restarted = restarted_controller(&w);
    let err = restarted
        .check(&Deadline::after(Duration::from_secs(10)))
        .await
        .unwrap_err()
        .to_string();
    let replaced = integrity::RecordKey::from_bytes(&[0xab; 32]).unwrap();
    assert!(
        err.contains("made none of the MACs of the 2 signed controller records")
            && err.contains(&replaced.fingerprint())
            && err.contains("Restore the original key"),
        "{err}"
    );
    // One edited record is that record's problem: the key that made the other is kept.
    let w = World::new(Fake::new(false, false));
    w.create("a").await.unwrap();
    w.create("b").await.unwrap();
    w.edit_record("b", |r| r.csi_volume_id = Some("elsewhere".into()));
    let restarted = restarted_controller(&w);
    restarted
        .check(&Deadline::after(Duration::from_secs(10)))
        .await
        .unwrap();
}

/// Snapshot records are signed too, so they testify against a replaced key: with only
/// snapshots left signed (their volume destroyed), a key that made none of their MACs is
/// refused at start; one edited snapshot among good records is only reported.
#[tokio::test]
async fn a_key_that_made_none_of_the_snapshot_records_is_refused_at_start() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.controller().create_snapshot("v", "s1").await.unwrap();
    w.controller().create_snapshot("v", "s2").await.unwrap();
    w.destroy("v").await.unwrap();
    assert!(w.stored("v").is_none());
    let key_file = w.dir.path().join("state/record.key");
    std::fs::write(&key_file, format!("{}\n", "cd".repeat(32))).unwrap();
    let restarted = restarted_controller(&w);
    let err = restarted
        .check(&Deadline::after(Duration::from_secs(10)))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("made none of the MACs of the 2 signed controller records")
            && err.contains("s1")
            && err.contains("Restore the original key"),
        "{err}"
    );

    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.controller().create_snapshot("v", "s1").await.unwrap();
    w.fake
        .snapshot_records
        .snapshots
        .lock()
        .unwrap()
        .get_mut("s1")
        .unwrap()
        .csi_snapshot_id = Some("someone-elses".into());
    let restarted = restarted_controller(&w);
    restarted
        .check(&Deadline::after(Duration::from_secs(10)))
        .await
        .unwrap();
}

// ---------------------------------------------------------------- dead mounts (issue 19, defect 8)

/// Only the target's filesystem stopped answering (a driver that mounts the target on its
/// own); the stage the holders' mounts sit on still answers, and is kept.
#[tokio::test]
async fn a_dead_target_over_a_stage_that_answers_keeps_the_stage() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.kill_filesystem(&w.target("v"), nix::libc::EIO);
    w.fake.clear_calls();
    w.attach("v", "ns2", "s2", 0).await.unwrap();
    let calls = w.fake.mutating_calls();
    assert!(!calls.iter().any(|c| c == "NodeUnstageVolume"), "{calls:?}");
    assert!(calls.iter().any(|c| c == "NodePublishVolume"), "{calls:?}");
    assert!(w.fake.is_mounted(&w.staging("v")));
}

/// Issue 19, defect 8: a mount whose filesystem is gone (a FUSE daemon or NFS server that
/// restarted) is still a mount point; a hot Attach must not hand it out. It is repaired
/// first (unpublish, unstage, stage, publish), for every errno a dead mount answers, and
/// the holders it had stay.
#[tokio::test]
async fn a_hot_attach_repairs_a_dead_mount_before_it_answers() {
    for errno in [nix::libc::ENOTCONN, nix::libc::ESTALE, nix::libc::EIO] {
        let w = World::new(Fake::new(true, false));
        w.attach("v", "ns1", "s1", 0).await.unwrap();
        // The staged filesystem dies, and the target (a bind of it) with it.
        w.fake.kill_filesystem(&w.staging("v"), errno);
        w.fake.kill_filesystem(&w.target("v"), errno);
        w.fake.clear_calls();
        assert!(
            w.bridge
                .attach_if_hot(&w.attach_req("v", "ns1", "s2", 1))
                .await
                .is_none(),
            "errno {errno}: a dead mount was answered on the hot path"
        );
        let attached = w.attach("v", "ns1", "s2", 1).await.unwrap();
        assert_eq!(attached.host_path, w.target("v"));
        assert_eq!(
            w.fake.mutating_calls(),
            [
                "NodeUnpublishVolume",
                "NodeUnstageVolume",
                "NodeStageVolume",
                "NodePublishVolume"
            ],
            "errno {errno}"
        );
        let deadline = Deadline::after(Duration::from_secs(5));
        assert_eq!(
            w.fake.health(&w.target("v"), &deadline).await.unwrap(),
            MountHealth::Answers
        );
        let record = w.record("v").unwrap();
        assert!(record.is_settled(), "{record:?}");
        assert_eq!(
            record.holders["ns1"],
            BTreeSet::from(["s1".to_string(), "s2".to_string()])
        );
        assert!(w.pending().is_empty());
        // Healthy again: the next Attach is hot.
        w.fake.clear_calls();
        assert!(
            w.bridge
                .attach_if_hot(&w.attach_req("v", "ns1", "s3", 2))
                .await
                .is_some()
        );
        assert!(w.fake.mutating_calls().is_empty());
        for (sandbox, ref_count) in [("s3", 2), ("s2", 1), ("s1", 0)] {
            w.detach("v", "ns1", sandbox, ref_count).await.unwrap();
        }
        w.assert_clean("v");
    }
}

/// Issue 19, defect 8: the first Attach of a namespace (as after a daemon restart, when
/// the volume is mounted from an earlier session) applies the same check.
#[tokio::test]
async fn a_first_attach_repairs_a_dead_mount_left_by_an_earlier_session() {
    let w = World::new(Fake::counting(true));
    w.attach("v", "nsA", "a", 0).await.unwrap();
    // The staged filesystem went stale, and the target (a bind of it) with it.
    w.fake.kill_filesystem(&w.staging("v"), nix::libc::ESTALE);
    w.fake.kill_filesystem(&w.target("v"), nix::libc::ESTALE);
    w.fake.clear_calls();
    w.attach("v", "nsB", "b", 0).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "NodeStageVolume",
            "NodePublishVolume"
        ]
    );
    // csi-driver-host-path counts the target once: the last Detach unstages.
    assert_eq!(w.fake.published(&w.target("v")), 1);
    assert_eq!(
        w.record("v").unwrap().holders.keys().collect::<Vec<_>>(),
        ["nsA", "nsB"]
    );
    w.detach("v", "nsA", "a", 0).await.unwrap();
    w.detach("v", "nsB", "b", 0).await.unwrap();
    w.assert_clean("v");
}

/// Issue 19, defect 8: a repair that fails fails the Attach with the path, the errno and
/// the step, and keeps the holders the volume had; so does a filesystem that is still
/// dead once mounted again.
#[tokio::test]
async fn a_failed_dead_mount_repair_names_path_errno_and_step_and_keeps_the_holders() {
    let w = World::new(Fake::new(true, false));
    w.attach("v", "nsA", "a", 0).await.unwrap();
    w.fake.kill_filesystem(&w.target("v"), nix::libc::ENOTCONN);
    w.fake.script("NodeStageVolume", Fault::Final);
    let err = w.attach("v", "nsB", "b", 0).await.unwrap_err().to_string();
    for needed in [
        &w.target("v").display().to_string(),
        "ENOTCONN",
        "mounting it again",
        "NodeStageVolume",
    ] {
        assert!(err.contains(needed), "{needed:?} missing from: {err}");
    }
    let record = w.record("v").unwrap();
    assert_eq!(record.holders.keys().collect::<Vec<_>>(), ["nsA"]);

    // The unpublish fails: the step says so, the holders stay, the dead mount too.
    let w = World::new(Fake::new(true, false));
    w.attach("v", "nsA", "a", 0).await.unwrap();
    w.fake.kill_filesystem(&w.target("v"), nix::libc::EIO);
    w.fake.script("NodeUnpublishVolume", Fault::Final);
    let err = w.attach("v", "nsA", "a2", 1).await.unwrap_err().to_string();
    for needed in ["EIO", "taking it down", "NodeUnpublishVolume"] {
        assert!(err.contains(needed), "{needed:?} missing from: {err}");
    }
    assert_eq!(
        w.record("v").unwrap().holders["nsA"],
        BTreeSet::from(["a".to_string()])
    );

    // The filesystem does not come back: the repaired mount is dead again.
    let w = World::new(Fake::new(true, false));
    w.attach("v", "nsA", "a", 0).await.unwrap();
    w.fake.kill_filesystem(&w.target("v"), nix::libc::ENOTCONN);
    w.fake
        .stays_dead
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let err = w.attach("v", "nsA", "a2", 1).await.unwrap_err();
    assert_eq!(err.error.kind(), "dead_mount", "{err}");
    assert!(err.to_string().contains("still does not answer"), "{err}");
    assert_eq!(
        w.record("v").unwrap().holders["nsA"],
        BTreeSet::from(["a".to_string()])
    );
}

/// Issue 19, defect 8: the periodic check reports a dead mount and the driver's abnormal
/// VolumeCondition of volumes with holders (in `list`'s inventory and the condition
/// map it logs changes from), and repairs nothing behind the holders' back.
#[tokio::test]
async fn the_condition_check_reports_dead_mounts_and_abnormal_volumes_without_repairing() {
    use super::inventory::Condition;
    let w = World::new(Fake::new(true, false));
    w.attach("dead", "ns1", "s1", 0).await.unwrap();
    w.attach("sick", "ns1", "s1", 0).await.unwrap();
    w.attach("well", "ns1", "s1", 0).await.unwrap();
    w.fake
        .kill_filesystem(&w.target("dead"), nix::libc::ENOTCONN);
    let node = w.bridge.node().unwrap();
    let check = |volume: &str| {
        node.conditions
            .lock()
            .unwrap()
            .get(volume)
            .cloned()
            .expect("checked")
    };
    node.check_volume_conditions().await.unwrap();
    assert!(
        matches!(check("dead"), Condition::DeadMount { error } if error.starts_with("ENOTCONN"))
    );
    assert_eq!(check("sick"), Condition::Normal);
    *w.fake.condition.lock().unwrap() = Some("disk failing".into());
    w.fake.clear_calls();
    node.check_volume_conditions().await.unwrap();
    assert_eq!(
        check("sick"),
        Condition::DriverAbnormal {
            message: "disk failing".into()
        }
    );
    assert!(
        w.fake
            .mutating_calls()
            .iter()
            .all(|c| c == "NodeGetVolumeStats"),
        "the check repaired something: {:?}",
        w.fake.mutating_calls()
    );
    let listed = super::inventory::node_volumes(node.node_journal().as_ref(), &w.fake)
        .await
        .unwrap();
    let dead = listed.iter().find(|v| v.volume_id == "dead").unwrap();
    assert_eq!(
        dead.condition.as_ref().unwrap().as_column(),
        "dead:ENOTCONN"
    );
    let well = listed.iter().find(|v| v.volume_id == "well").unwrap();
    assert_eq!(well.condition, Some(Condition::Normal));
    // Detached volumes are forgotten.
    w.detach("well", "ns1", "s1", 0).await.unwrap();
    node.check_volume_conditions().await.unwrap();
    assert!(!node.conditions.lock().unwrap().contains_key("well"));
}

// ---------------------------------------------------------------- snapshots and copies

impl World {
    fn controller(&self) -> &ControllerSide {
        self.bridge.controller().unwrap()
    }

    fn snapshot_record(&self, id: &str) -> Option<SnapshotRecord> {
        self.fake
            .snapshot_records
            .snapshots
            .lock()
            .unwrap()
            .get(id)
            .cloned()
    }

    fn backend_snapshots(&self) -> BTreeMap<String, (String, String)> {
        self.fake.state.lock().unwrap().snapshots.clone()
    }

    /// Everything the controller side keeps and the driver holds, to prove a refusal
    /// changed nothing.
    fn controller_state(&self) -> String {
        format!(
            "{:?} {:?} {:?} {:?}",
            self.store.records.lock().unwrap(),
            self.fake.snapshot_records.snapshots.lock().unwrap(),
            self.backend_volumes(),
            self.backend_snapshots()
        )
    }
}

#[tokio::test]
async fn a_snapshot_is_recorded_signed_and_a_repeated_create_adopts_it() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    let taken = w.controller().create_snapshot("v", "s1").await.unwrap();
    assert_eq!(taken.state, VolumeState::Created);
    assert_eq!(taken.csi_name, "cube-snap-s1");
    assert_eq!(taken.csi_snapshot_id.as_deref(), Some("snap-0"));
    assert_eq!(
        taken.source_csi_volume_id,
        w.stored("v").unwrap().csi_volume_id.unwrap()
    );
    assert!(taken.integrity.is_some());
    assert_eq!(w.snapshot_record("s1"), Some(taken.clone()));
    w.fake.clear_calls();
    // A repeated command adopts it: no second snapshot.
    assert_eq!(
        w.controller().create_snapshot("v", "s1").await.unwrap(),
        taken
    );
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert_eq!(w.backend_snapshots().len(), 1);
    let listed = w.controller().list_snapshots().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].integrity,
            listed[0].driver_says,
            listed[0].size_bytes
        ),
        ("valid", "ready", 4096)
    );
}

#[tokio::test]
async fn an_unanswered_create_snapshot_is_retried_by_name_and_otherwise_swept() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    // The driver made the snapshot but its answer was lost: the intent stays.
    w.fake.script("CreateSnapshot", Fault::LostAnswer);
    w.controller().create_snapshot("v", "s1").await.unwrap_err();
    assert_eq!(
        w.snapshot_record("s1").unwrap().state,
        VolumeState::Creating
    );
    assert_eq!(w.backend_snapshots().len(), 1);
    // A retry finds the same snapshot by its name.
    let taken = w.controller().create_snapshot("v", "s1").await.unwrap();
    assert_eq!(taken.csi_snapshot_id.as_deref(), Some("snap-0"));
    assert_eq!(w.backend_snapshots().len(), 1);

    // An abandoned one is reclaimed by the sweep.
    w.fake.script("CreateSnapshot", Fault::LostAnswer);
    w.controller().create_snapshot("v", "s2").await.unwrap_err();
    assert_eq!(w.backend_snapshots().len(), 2);
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.snapshot_record("s2").is_none());
    assert_eq!(w.backend_snapshots().len(), 1);
    assert!(w.snapshot_record("s1").is_some());
}

/// A world where `volume` was created and its snapshot `snapshot` left unfinished (its
/// CreateSnapshot answer lost).
async fn with_unfinished_snapshot(volume: &str, snapshot: &str) -> World {
    let w = World::new(Fake::new(false, false));
    w.create(volume).await.unwrap();
    w.fake.script("CreateSnapshot", Fault::Uncertain);
    w.controller()
        .create_snapshot(volume, snapshot)
        .await
        .unwrap_err();
    assert_eq!(
        w.snapshot_record(snapshot).unwrap().state,
        VolumeState::Creating
    );
    w
}

/// An unfinished snapshot whose source volume was destroyed since: CreateSnapshot, asked
/// again to resolve the name, answers NOT_FOUND for good. Before, every sweep failed on it
/// and its name stayed taken; now the record goes (with a warning naming what may be left).
#[tokio::test]
async fn an_unfinished_snapshot_whose_source_is_gone_is_swept() {
    let w = with_unfinished_snapshot("v", "s2").await;
    w.destroy("v").await.unwrap();
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.snapshot_record("s2").is_none());
}

/// The same NOT_FOUND while the source is still recorded (a driver's passing trouble, a
/// missing pool): the record of what may have been made is kept.
#[tokio::test]
async fn an_unfinished_snapshot_whose_source_is_there_is_kept_on_not_found() {
    let w = with_unfinished_snapshot("v", "s2").await;
    w.fake.script("CreateSnapshot", Fault::NotFound);
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (0, 1), "{report:?}");
    assert!(w.snapshot_record("s2").is_some());
}

#[tokio::test]
async fn a_final_create_snapshot_error_forgets_the_intent() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.fake.script("CreateSnapshot", Fault::Final);
    w.controller().create_snapshot("v", "s1").await.unwrap_err();
    assert!(w.snapshot_record("s1").is_none());
}

#[tokio::test]
async fn bad_snapshot_input_is_refused_before_any_call_or_record() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.controller().create_snapshot("v", "s1").await.unwrap();
    let before = w.controller_state();
    w.fake.clear_calls();
    let c = w.controller();
    let cases: Vec<(BridgeError, &str)> = vec![
        (
            c.create_snapshot("nope", "s2").await.unwrap_err(),
            "unknown volume \"nope\"",
        ),
        (
            c.create_snapshot("v", "bad/name").await.unwrap_err(),
            "snapshot name \"bad/name\"",
        ),
        (
            c.delete_snapshot("nope").await.unwrap_err(),
            "unknown snapshot \"nope\"",
        ),
        (
            c.restore("nope", "r").await.unwrap_err(),
            "unknown snapshot \"nope\"",
        ),
        (
            c.restore("s1", "v").await.unwrap_err(),
            "volume \"v\" already exists",
        ),
        (
            c.clone_volume("nope", "c").await.unwrap_err(),
            "unknown volume \"nope\"",
        ),
        (
            c.clone_volume("v", "v").await.unwrap_err(),
            "choose a new id",
        ),
    ];
    for (error, expected) in cases {
        assert!(error.to_string().contains(expected), "{error}");
        assert!(matches!(error, BridgeError::InvalidRequest(_)), "{error:?}");
    }
    assert_eq!(w.controller_state(), before);
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    // `--as` an id that exists, for a clone too (it has a record of its own).
    w.create("other").await.unwrap();
    let before_other = w.controller_state();
    w.fake.clear_calls();
    let error = c.clone_volume("v", "other").await.unwrap_err();
    assert!(error.to_string().contains("already exists"), "{error}");
    assert_eq!(w.controller_state(), before_other);
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert_ne!(before, before_other);
}

/// A snapshot record edited while CreateSnapshot runs (its source pointed at another
/// volume): the conflicting write re-reads it, and must not sign it as the bridge's.
#[tokio::test]
async fn a_snapshot_never_signs_a_record_edited_while_it_was_taken() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.fake
        .script("CreateSnapshot", Fault::Slow(Duration::from_secs(1)));
    let forge = async {
        while !w.fake.calls().iter().any(|c| c == "CreateSnapshot") {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut snapshots = w.fake.snapshot_records.snapshots.lock().unwrap();
        let record = snapshots.get_mut("s1").unwrap();
        record.source_csi_volume_id = "someone-elses".into();
        record.revision = Some("9999".into());
    };
    let (taken, ()) = tokio::join!(w.controller().create_snapshot("v", "s1"), forge);
    let error = taken.unwrap_err().to_string();
    assert!(error.contains("integrity"), "{error}");
    let refused = w.controller().delete_snapshot("s1").await.unwrap_err();
    assert!(refused.to_string().contains("integrity"), "{refused}");
}

#[tokio::test]
async fn another_drivers_snapshot_is_neither_restored_nor_deleted() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.controller().create_snapshot("v", "s1").await.unwrap();
    // A snapshot taken (and signed) by this bridge when another CSI driver served it.
    let key = w.controller().record_key().await.unwrap().clone();
    {
        let mut snapshots = w.fake.snapshot_records.snapshots.lock().unwrap();
        let record = snapshots.get_mut("s1").unwrap();
        record.csi_driver = "other.csi".into();
        record.integrity = Some(key.sign_snapshot("fk", record));
    }
    let before = w.controller_state();
    w.fake.clear_calls();
    for error in [
        w.controller().restore("s1", "r").await.unwrap_err(),
        w.controller().delete_snapshot("s1").await.unwrap_err(),
    ] {
        let text = error.to_string();
        assert!(
            text.contains("other.csi") && text.contains("fake.csi"),
            "{text}"
        );
    }
    assert_eq!(w.controller_state(), before);
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
}

/// A record the bridge did not write (planted without a MAC, or a signed one edited) is
/// neither followed nor signed by a Create of its volume: its content source would have
/// the driver fill the new volume with another volume's data, and the refreshed record
/// would carry a valid MAC for what the planter wrote.
#[tokio::test]
async fn a_create_refuses_a_record_the_bridge_did_not_write_and_signs_nothing() {
    let w = World::new(Fake::new(false, false));
    w.create("victim").await.unwrap();
    w.create("edited").await.unwrap();
    let victims_data = Some(ContentSource::Volume {
        volume_id: "victim".into(),
        csi_volume_id: w.stored("victim").unwrap().csi_volume_id.unwrap(),
    });
    let mut planted = Vec::new();
    for state in [VolumeState::Creating, VolumeState::Created] {
        let mut record = unsigned_record("v", "handle-planted");
        record.state = state;
        record.csi_driver = None;
        record.content_source = victims_data.clone();
        planted.push(record);
    }
    let mut edited = w.stored("edited").unwrap();
    edited.content_source = victims_data.clone();
    planted.push(edited);
    for record in planted {
        let volume = record.volume_id.clone();
        w.store
            .records
            .lock()
            .unwrap()
            .insert(volume.clone(), record.clone());
        w.fake.clear_calls();
        let error = w.create(&volume).await.unwrap_err().to_string();
        assert!(error.contains("integrity"), "{error}");
        assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
        assert!(
            !w.fake
                .state
                .lock()
                .unwrap()
                .content_sources
                .get(&format!("cube-{volume}"))
                .is_some_and(|source| *source == victims_data),
            "no volume is filled from the victim's data"
        );
        assert_eq!(
            w.stored(&volume).unwrap(),
            record,
            "nothing signed or changed"
        );
    }
}

/// A record lost (emptied, or gone with its holder log) is rebuilt saying nothing of
/// ControllerPublish; the last Detach must still undo it, or the volume stays published to
/// this node at the backend, recorded nowhere.
#[tokio::test]
async fn a_last_detach_after_a_lost_record_still_controller_unpublishes() {
    for lose_the_log_too in [false, true] {
        let w = World::new(Fake::new(true, true));
        w.attach("v", "ns1", "s1", 0).await.unwrap();
        let node = w.dir.path().join("state/node");
        if lose_the_log_too {
            std::fs::remove_file(node.join("v.json")).unwrap();
            std::fs::remove_file(node.join("v.holders")).unwrap();
        } else {
            std::fs::write(node.join("v.json"), b"").unwrap();
        }
        w.fake.clear_calls();
        w.detach("v", "ns1", "s1", 0).await.unwrap();
        assert!(
            w.fake
                .mutating_calls()
                .iter()
                .any(|call| call == "ControllerUnpublishVolume"),
            "log lost too: {lose_the_log_too}: {:?}",
            w.fake.calls()
        );
        w.assert_clean("v");
    }
}

#[tokio::test]
async fn an_edited_snapshot_record_is_refused() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.create("mine").await.unwrap();
    w.controller().create_snapshot("v", "s1").await.unwrap();
    // Pointed at another snapshot handle without the key.
    w.fake
        .snapshot_records
        .snapshots
        .lock()
        .unwrap()
        .get_mut("s1")
        .unwrap()
        .csi_snapshot_id = Some("someone-elses".into());
    let before = w.controller_state();
    w.fake.clear_calls();
    for error in [
        w.controller().restore("s1", "r").await.unwrap_err(),
        w.controller().delete_snapshot("s1").await.unwrap_err(),
    ] {
        assert!(error.to_string().contains("integrity"), "{error}");
    }
    assert_eq!(w.controller_state(), before);
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    // And a restored volume's record edited to another content source fails Destroy.
    w.fake
        .snapshot_records
        .snapshots
        .lock()
        .unwrap()
        .get_mut("s1")
        .unwrap()
        .csi_snapshot_id = Some("snap-0".into());
    w.controller().restore("s1", "r").await.unwrap();
    w.store
        .records
        .lock()
        .unwrap()
        .get_mut("r")
        .unwrap()
        .content_source = Some(ContentSource::Volume {
        volume_id: "mine".into(),
        csi_volume_id: w.stored("mine").unwrap().csi_volume_id.unwrap(),
    });
    let error = w.destroy("r").await.unwrap_err();
    assert!(error.to_string().contains("integrity"), "{error}");
}

#[tokio::test]
async fn a_restored_volume_is_what_cubes_create_answers_and_destroy_deletes() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.controller().create_snapshot("v", "s1").await.unwrap();
    let restored = w.controller().restore("s1", "r").await.unwrap();
    assert_eq!(restored.state, VolumeState::Created);
    assert!(
        restored.csi_name.starts_with("cube-r-"),
        "{}",
        restored.csi_name
    );
    assert_eq!(
        restored.content_source,
        Some(ContentSource::Snapshot {
            snapshot_id: "s1".into(),
            csi_snapshot_id: "snap-0".into()
        })
    );
    let handle = restored.csi_volume_id.clone().unwrap();
    assert_eq!(w.backend_volumes().len(), 2);
    // CubeMaster's Create of the id answers with that volume (the driver saw the same
    // content source again: a different one would be ALREADY_EXISTS).
    let created = w.create("r").await.unwrap();
    assert_eq!(
        VolumeHandle::decode(&created.private_data)
            .unwrap()
            .csi_volume_id,
        handle
    );
    assert_eq!(w.backend_volumes().len(), 2);
    let listed = w.controller().list_snapshots().await.unwrap();
    assert_eq!(listed[0].restored_into, ["r"]);
    // A restore again under the same id is refused: it exists.
    let error = w.controller().restore("s1", "r").await.unwrap_err();
    assert!(error.to_string().contains("already exists"), "{error}");
    // The snapshot is in use while the restored volume lives: the driver's refusal is
    // passed on, and the record stays.
    let error = w.controller().delete_snapshot("s1").await.unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("FailedPrecondition")
            && text.contains("has dependent volumes")
            && text.contains("volumes restored from it: r")
            && text.contains("kept"),
        "{text}"
    );
    assert!(w.snapshot_record("s1").is_some());
    assert_eq!(w.backend_snapshots().len(), 1);
    // Destroy treats it like any volume; then the snapshot goes.
    w.destroy("r").await.unwrap();
    assert!(w.stored("r").is_none());
    assert!(!w.backend_volumes().values().any(|id| *id == handle));
    w.controller().delete_snapshot("s1").await.unwrap();
    assert!(w.snapshot_record("s1").is_none() && w.backend_snapshots().is_empty());
}

#[tokio::test]
async fn a_clone_copies_a_volume_under_a_new_id() {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    let source = w.stored("v").unwrap().csi_volume_id.unwrap();
    let cloned = w.controller().clone_volume("v", "c").await.unwrap();
    assert_eq!(
        cloned.content_source,
        Some(ContentSource::Volume {
            volume_id: "v".into(),
            csi_volume_id: source.clone()
        })
    );
    assert_ne!(cloned.csi_volume_id.as_deref(), Some(source.as_str()));
    let created = w.create("c").await.unwrap();
    assert_eq!(
        Some(
            VolumeHandle::decode(&created.private_data)
                .unwrap()
                .csi_volume_id
        ),
        cloned.csi_volume_id
    );
    w.destroy("c").await.unwrap();
    assert!(w.stored("c").is_none());
    assert!(w.stored("v").is_some());
}

/// A world where volume "v" has snapshot "s1", and a restore of it as "r" lost the
/// answer to its CreateVolume: "r" is left a `Creating` intent with that content source.
async fn unanswered_restore() -> World {
    let w = World::new(Fake::new(false, false));
    w.create("v").await.unwrap();
    w.controller().create_snapshot("v", "s1").await.unwrap();
    w.fake.script("CreateVolume", Fault::Uncertain);
    w.controller().restore("s1", "r").await.unwrap_err();
    w
}

#[tokio::test]
async fn an_unanswered_restore_is_resolved_by_the_sweep_with_its_content_source() {
    let w = unanswered_restore().await;
    assert_eq!(w.stored("r").unwrap().state, VolumeState::Creating);
    let restored = w.csi_name("r");
    let report = w
        .controller()
        .sweep_abandoned_creates(Duration::ZERO)
        .await
        .unwrap();
    assert_eq!((report.reclaimed, report.failed), (1, 0), "{report:?}");
    assert!(w.stored("r").is_none());
    // The sweep asked for the volume as the restore did (the fake refuses otherwise).
    assert_eq!(
        w.fake.state.lock().unwrap().content_sources.get(&restored),
        Some(&Some(ContentSource::Snapshot {
            snapshot_id: "s1".into(),
            csi_snapshot_id: "snap-0".into()
        }))
    );
    assert_eq!(w.backend_volumes().len(), 1);
    // Nothing of it holds the snapshot any more.
    w.controller().delete_snapshot("s1").await.unwrap();
}

/// A restore repeated after a lost answer goes on with the `Creating` intent of the same
/// copy, and signs it anew: only if the bridge wrote it. One planted (unsigned, here with
/// a Retain policy a Destroy of the finished copy would honour) or edited is refused and
/// stays unsigned.
#[tokio::test]
async fn a_repeated_restore_does_not_sign_a_planted_intent() {
    let w = unanswered_restore().await;
    w.edit_record("r", |r| {
        r.integrity = None;
        r.deletion = Some(DeletionPolicy {
            retain: true,
            secret: None,
        });
    });
    let before = w.controller_state();
    w.fake.clear_calls();
    let error = w.controller().restore("s1", "r").await.unwrap_err();
    assert!(error.to_string().contains("integrity"), "{error}");
    assert_eq!(w.controller_state(), before);
    assert!(w.stored("r").unwrap().integrity.is_none(), "not signed");
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
}

#[tokio::test]
async fn a_driver_without_snapshots_or_clones_is_refused_clearly() {
    let mut fake = Fake::new(false, false);
    fake.snapshots = false;
    let w = World::new(fake);
    w.create("v").await.unwrap();
    let before = w.controller_state();
    let error = w.controller().create_snapshot("v", "s").await.unwrap_err();
    assert!(
        error.to_string().contains("CREATE_DELETE_SNAPSHOT"),
        "{error}"
    );
    let error = w.controller().clone_volume("v", "c").await.unwrap_err();
    assert!(error.to_string().contains("CLONE_VOLUME"), "{error}");
    assert_eq!(w.controller_state(), before);
}

// ---------------------------------------------------------------- topology, mount group, access modes

fn zone(z: &str) -> Segments {
    Segments::from([("example.com/zone".to_string(), z.to_string())])
}

/// A config that asks CreateVolume for zone a or b, preferring b.
const IN_ZONES: &str = "[volume.accessibility_requirements]\n\
    requisite = [{ \"example.com/zone\" = \"a\" }, { \"example.com/zone\" = \"b\" }]\n\
    preferred = [{ \"example.com/zone\" = \"b\" }]\n";

fn precondition(error: &HookError) -> &str {
    match &error.error {
        BridgeError::Precondition(message) => message,
        other => panic!("not FAILED_PRECONDITION: {other:?}"),
    }
}

#[tokio::test]
async fn create_asks_for_the_configured_topology_and_hands_on_where_the_volume_is() {
    let fake = Fake::new(false, false);
    fake.placement().accessibility_constraints = true;
    fake.placement().created_topology = vec![zone("b")];
    let w = World::with_config(fake, IN_ZONES);
    w.bridge
        .check(&Deadline::after(Duration::from_secs(5)))
        .await
        .unwrap();
    let created = w.create("v").await.unwrap();
    assert_eq!(
        w.fake.placement().requirements,
        [Some(TopologyRequirement {
            requisite: vec![zone("a"), zone("b")],
            preferred: vec![zone("b")],
        })]
    );
    let handle = VolumeHandle::decode(&created.private_data).unwrap();
    assert_eq!(handle.topology, [zone("b")]);
    let record = w.stored("v").unwrap();
    assert_eq!(record.accessible_topology, [zone("b")]);
    // The record's MAC covers it: Destroy works on the record as written.
    w.destroy("v").await.unwrap();
    assert!(w.backend_volumes().is_empty());
}

#[tokio::test]
async fn without_requirements_create_sends_none_and_the_volume_attaches_anywhere() {
    let w = World::new(Fake::new(false, false));
    let created = w.create("v").await.unwrap();
    assert_eq!(w.fake.placement().requirements, [None]);
    assert!(
        VolumeHandle::decode(&created.private_data)
            .unwrap()
            .topology
            .is_empty()
    );
    assert!(w.stored("v").unwrap().accessible_topology.is_empty());
}

#[tokio::test]
async fn requirements_for_a_driver_without_topology_are_refused_at_start_and_at_create() {
    let w = World::with_config(Fake::new(false, false), IN_ZONES);
    let err = w
        .bridge
        .check(&Deadline::after(Duration::from_secs(5)))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("VOLUME_ACCESSIBILITY_CONSTRAINTS") && text.contains("fake.csi"),
        "{text}"
    );
    let err = w.create("v").await.unwrap_err();
    assert!(precondition(&err).contains("VOLUME_ACCESSIBILITY_CONSTRAINTS"));
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    assert!(w.stored("v").is_none(), "nothing recorded");
}

#[tokio::test]
async fn an_attach_outside_the_volumes_topology_fails_before_any_change() {
    let fake = Fake::new(true, true);
    fake.placement().node_topology = zone("c");
    let w = World::new(fake);
    let mut req = w.attach_req("v", "ns1", "s1", 0);
    req.handle.topology = vec![zone("a"), zone("b")];
    let err = w
        .bridge
        .attach(req.clone(), &Caller::waiting())
        .await
        .unwrap_err();
    let text = precondition(&err);
    assert!(
        text.contains("{example.com/zone=a} or {example.com/zone=b}")
            && text.contains("{example.com/zone=c}"),
        "{text}"
    );
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    w.assert_clean("v");

    // A node that reports no topology is outside any topology too.
    let w2 = World::new(Fake::new(true, true));
    let mut req2 = w2.attach_req("v", "ns1", "s1", 0);
    req2.handle.topology = vec![zone("a")];
    let err = w2
        .bridge
        .attach(req2, &Caller::waiting())
        .await
        .unwrap_err();
    assert!(precondition(&err).contains("no topology at all"), "{err}");
    assert!(w2.fake.mutating_calls().is_empty());
    w2.assert_clean("v");
}

#[tokio::test]
async fn an_attach_inside_the_volumes_topology_proceeds_and_records_it() {
    let fake = Fake::new(true, false);
    fake.placement().node_topology = Segments::from([
        ("example.com/zone".into(), "b".into()),
        ("rack".into(), "7".into()),
    ]);
    let w = World::new(fake);
    let mut req = w.attach_req("v", "ns1", "s1", 0);
    req.handle.topology = vec![zone("a"), zone("b")];
    w.bridge.attach(req, &Caller::waiting()).await.unwrap();
    assert_eq!(
        w.fake.mutating_calls(),
        ["NodeStageVolume", "NodePublishVolume"]
    );
    assert_eq!(
        w.record("v").unwrap().accessible_topology,
        [zone("a"), zone("b")]
    );
}

#[tokio::test]
async fn the_mount_group_reaches_stage_and_publish_when_the_driver_has_the_capability() {
    let fake = Fake::new(true, false);
    fake.placement().volume_mount_group = true;
    let w = World::with_config(fake, "[volume]\nmount_group = 2000\n");
    w.bridge
        .check(&Deadline::after(Duration::from_secs(5)))
        .await
        .unwrap();
    w.attach("v", "ns1", "s1", 0).await.unwrap();
    let groups: Vec<_> = w
        .fake
        .placement()
        .node_calls
        .iter()
        .map(|(call, group, _)| (*call, *group))
        .collect();
    assert_eq!(
        groups,
        [
            ("NodeStageVolume", Some(2000)),
            ("NodePublishVolume", Some(2000))
        ]
    );
    // Without a mount group, none is sent.
    let plain = World::new(Fake::new(true, false));
    plain.attach("v", "ns1", "s1", 0).await.unwrap();
    assert!(
        plain
            .fake
            .placement()
            .node_calls
            .iter()
            .all(|(_, group, _)| group.is_none())
    );
}

#[tokio::test]
async fn a_mount_group_the_driver_cannot_honour_is_refused_and_attach_changes_nothing() {
    let w = World::with_config(Fake::new(true, false), "[volume]\nmount_group = 2000\n");
    let err = w
        .bridge
        .check(&Deadline::after(Duration::from_secs(5)))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("VOLUME_MOUNT_GROUP") && text.contains("fake.csi") && text.contains("2000"),
        "{text}"
    );
    let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
    assert!(precondition(&err).contains("VOLUME_MOUNT_GROUP"));
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
    w.assert_clean("v");
}

/// A world whose driver has SINGLE_NODE_MULTI_WRITER on the controller and the node as
/// told, configured for access mode `mode`.
fn multi_writer_world(mode: &str, controller: bool, node: bool) -> World {
    let fake = Fake::new(true, false);
    fake.placement().controller_multi_writer = controller;
    fake.placement().node_multi_writer = node;
    World::with_config(fake, &format!("[volume]\naccess_mode = \"{mode}\"\n"))
}

#[tokio::test]
async fn single_node_writer_modes_need_the_multi_writer_capability_on_both_sides() {
    let deadline = || Deadline::after(Duration::from_secs(5));
    for (mode, wanted) in [
        (
            "single_node_single_writer",
            AccessMode::SingleNodeSingleWriter,
        ),
        (
            "single_node_multi_writer",
            AccessMode::SingleNodeMultiWriter,
        ),
    ] {
        let w = multi_writer_world(mode, false, false);
        let err = w.bridge.check(&deadline()).await.unwrap_err().to_string();
        assert!(
            err.contains("SINGLE_NODE_MULTI_WRITER controller capability")
                && err.contains(&mode.to_ascii_uppercase()),
            "{err}"
        );
        let err = w.create("v").await.unwrap_err();
        assert!(precondition(&err).contains("controller capability"));
        assert!(w.stored("v").is_none() && w.fake.mutating_calls().is_empty());

        let w = multi_writer_world(mode, true, false);
        let err = w.bridge.check(&deadline()).await.unwrap_err().to_string();
        assert!(
            err.contains("SINGLE_NODE_MULTI_WRITER node capability"),
            "{err}"
        );
        let err = w.attach("v", "ns1", "s1", 0).await.unwrap_err();
        assert!(precondition(&err).contains("node capability"));
        assert!(w.fake.mutating_calls().is_empty());
        w.assert_clean("v");

        let w = multi_writer_world(mode, true, true);
        w.bridge.check(&deadline()).await.unwrap();
        w.create("v").await.unwrap();
        w.attach("v", "ns1", "s1", 0).await.unwrap();
        let sent: Vec<_> = w.fake.placement().node_calls.iter().map(|c| c.2).collect();
        assert_eq!(
            sent,
            [wanted, wanted],
            "NodeStage and NodePublish carry the mode"
        );
    }
}
mod expansion;
