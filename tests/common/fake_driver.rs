//! The tests' CSI driver: the program's own local-directory driver (src/demo/driver.rs)
//! with the fake's profile (name `fake.csi.test`, ids `fake-<name>`), every call recorded,
//! and scripted failures (plain, or echoing the request's secrets), delays and holds. A test waits for a call to reach the fake with
//! [`FakeDriver::wait_for_call`], never by sleeping. It makes real bind mounts (volume data
//! lives in `<data_dir>/<volume id>`, so it outlives attachments).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cube_csi_bridge::demo::driver::{LocalDirDriver, Profile};
use tokio_stream::wrappers::UnixListenerStream;

pub use cube_csi_bridge::demo::driver::{Behavior, Call, ExpansionProfile, Gate, MUTATING};

pub const FAKE_NODE_ID: &str = "fake-node-1";

/// What the fake advertises.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caps {
    /// Node STAGE_UNSTAGE_VOLUME.
    pub stage: bool,
    /// Controller PUBLISH_UNPUBLISH_VOLUME.
    pub controller_publish: bool,
    /// Advertise CONTROLLER_SERVICE but answer UNIMPLEMENTED to controller calls
    /// (a node-only deployment of a driver that has a controller elsewhere).
    pub controller_unreachable: bool,
    /// Node GET_VOLUME_STATS (`statvfs` of the published path).
    pub volume_stats: bool,
    /// Node VOLUME_CONDITION: normal unless [`FakeDriver::set_abnormal`] says otherwise.
    pub volume_condition: bool,
    /// CreateVolume and DeleteVolume mount the backend's share to make or remove the
    /// volume's directory, as csi-driver-nfs does (counted by [`FakeDriver::share_mounts`]).
    pub share_mounts: bool,
    /// NodePublishVolume onto a mount point checks what is mounted there; without it an
    /// existing mount is success, as csi-driver-nfs and csi-driver-host-path answer.
    pub verifies_existing_mount: bool,
    /// Counts publishes per target as csi-driver-host-path does: a NodePublish onto an
    /// unmounted target counts again, NodeUnpublish uncounts one, and NodeUnstage fails
    /// ("still published") while any is counted.
    pub counts_publishes: bool,
    /// CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS and CLONE_VOLUME (copies of the volume's
    /// directory; a snapshot volumes were restored from cannot be deleted while they exist).
    pub snapshots: bool,
    /// This node sits in this zone (the segment [`ZONE_KEY`]): the fake has
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS and places each volume in the first preferred
    /// zone asked for, else the first requisite one, else this node's.
    pub zone: Option<&'static str>,
    /// Node VOLUME_MOUNT_GROUP (recorded in each call's `volume_mount_group`).
    pub volume_mount_group: bool,
    /// Controller and node SINGLE_NODE_MULTI_WRITER.
    pub single_node_multi_writer: bool,
    /// What it offers for volume expansion (none by default).
    pub expansion: ExpansionProfile,
}

/// The topology key of the fake's zones.
pub const ZONE_KEY: &str = "topology.fake.csi.test/zone";

impl Caps {
    /// A driver that stages (STAGE_UNSTAGE_VOLUME) and needs no ControllerPublish.
    pub fn staging() -> Self {
        Caps {
            stage: true,
            // csi-driver-host-path advertises it, and the staging node's volumes ask for
            // single_node_multi_writer.
            single_node_multi_writer: true,
            ..Default::default()
        }
    }

    /// What csi-driver-nfs offers: no staging, no ControllerPublish; each CreateVolume and
    /// DeleteVolume mounts the share; an existing mount at the target is success.
    pub fn nfs_like() -> Self {
        Caps {
            share_mounts: true,
            ..Default::default()
        }
    }

    /// Every node step exists: ControllerPublish, NodeStage and NodePublish.
    pub fn all_steps() -> Self {
        Caps {
            stage: true,
            controller_publish: true,
            ..Default::default()
        }
    }
}

/// The fake; clones share state.
#[derive(Debug, Clone)]
pub struct FakeDriver {
    driver: LocalDirDriver,
}

/// A running fake server; dropping it stops the server.
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl FakeDriver {
    pub fn new(caps: Caps, data_dir: &Path) -> Self {
        Self::named(caps, data_dir, "fake.csi.test", FAKE_NODE_ID)
    }

    /// A fake with another CSI name and node id. Two fakes on one `data_dir` are one
    /// storage backend seen from two hosts (as two csi-driver-nfs node plugins on one
    /// NFS server): what one node writes, the other reads.
    pub fn named(caps: Caps, data_dir: &Path, name: &str, node_id: &str) -> Self {
        std::fs::create_dir_all(data_dir).unwrap();
        // The share's working mounts live beside the data, never below it.
        let share_mount_dir = caps.share_mounts.then(|| {
            let dir = data_dir.with_extension(format!("share-mounts-{node_id}"));
            std::fs::create_dir_all(&dir).unwrap();
            dir
        });
        let profile = Profile {
            name: name.into(),
            node_id: node_id.into(),
            volume_id_prefix: "fake-".into(),
            volume_context: BTreeMap::from([("origin".to_string(), "fake".to_string())]),
            stage: caps.stage,
            controller_publish: caps.controller_publish,
            controller_unreachable: caps.controller_unreachable,
            record_calls: true,
            volume_stats: caps.volume_stats,
            volume_condition: caps.volume_condition,
            share_mount_dir,
            verifies_existing_mount: caps.verifies_existing_mount,
            counts_publishes: caps.counts_publishes,
            latency: Duration::ZERO,
            volumes_on_first_use: false,
            snapshots: caps.snapshots,
            topology: caps
                .zone
                .map(|zone| BTreeMap::from([(ZONE_KEY.to_string(), zone.to_string())])),
            volume_mount_group: caps.volume_mount_group,
            single_node_multi_writer: caps.single_node_multi_writer,
            expansion: caps.expansion,
        };
        Self {
            driver: LocalDirDriver::with_profile(data_dir, profile),
        }
    }

    /// Serves on `socket` (replacing a stale socket file).
    pub fn serve(&self, socket: &Path) -> Running {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (identity, controller, node) = self.driver.clone().services();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(identity)
                .add_service(controller)
                .add_service(node)
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Running {
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Queues reactions for the next calls of `method`.
    pub fn script(&self, method: &'static str, behaviors: impl IntoIterator<Item = Behavior>) {
        self.driver.script(method, behaviors);
    }

    pub fn calls(&self) -> Vec<Call> {
        self.driver.calls()
    }

    /// The names of the state-changing calls so far, in order.
    pub fn mutating_calls(&self) -> Vec<&'static str> {
        self.calls()
            .iter()
            .map(|c| c.method)
            .filter(|m| MUTATING.contains(m))
            .collect()
    }

    /// Forgets recorded calls (the script and the arrival counts are kept).
    pub fn clear_calls(&self) {
        self.driver.clear_calls();
    }

    /// How many calls of `method` have reached the fake since it was made (not reset by
    /// [`FakeDriver::clear_calls`]); the next one is number `arrivals(method) + 1`.
    pub fn arrivals(&self, method: &str) -> usize {
        self.driver.arrivals(method)
    }

    /// Waits until the `n`th call of `method` (counted as [`FakeDriver::arrivals`] counts)
    /// has reached the fake and its scripted reaction has begun (a [`Behavior::Hold`] call
    /// is then in flight); panics, naming the calls that did arrive, after `timeout`.
    pub async fn wait_for_call(&self, method: &'static str, n: usize, timeout: Duration) {
        let arrived = tokio::time::timeout(timeout, self.driver.arrived(method, n)).await;
        assert!(
            matches!(arrived, Ok(true)),
            "call {n} of {method} did not reach the fake driver within {timeout:?} \
             ({} arrived); calls recorded: {:?}",
            self.arrivals(method),
            self.calls().iter().map(|c| c.method).collect::<Vec<_>>()
        );
    }

    /// Scripts the next call of `method` to stay in flight until the returned gate is
    /// released ([`Behavior::Hold`]).
    pub fn hold(&self, method: &'static str) -> Gate {
        let gate = Gate::new();
        self.script(method, [Behavior::Hold(gate.clone())]);
        gate
    }

    /// How many times CreateVolume or DeleteVolume mounted the share.
    pub fn share_mounts(&self) -> usize {
        self.driver.share_mounts()
    }

    /// Makes CSI volume `id`'s VolumeCondition abnormal (`Some(message)`) or normal.
    pub fn set_abnormal(&self, id: &str, message: Option<&str>) {
        self.driver.set_abnormal(id, message);
    }

    /// Where a CSI volume's data lives.
    pub fn volume_dir(&self, volume_id: &str) -> PathBuf {
        self.driver.data_path(volume_id)
    }

    /// The CSI volume that exists for Cube volume `volume_id`, if one does: its id is
    /// `fake-` and the CreateVolume name, which is `cube-<volume_id>-` and 12 hex digits of
    /// the Create's own. Panics if there are several.
    pub fn csi_volume_of(&self, volume_id: &str) -> Option<String> {
        let data = self.driver.data_path("");
        let Ok(entries) = std::fs::read_dir(&data) else {
            return None;
        };
        let mut found: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| super::is_name_of_a_create(name, &format!("fake-cube-{volume_id}")))
            .collect();
        assert!(
            found.len() <= 1,
            "several CSI volumes of {volume_id}: {found:?}"
        );
        found.pop()
    }

    /// (CSI volume id, node id) pairs ControllerPublished and not unpublished since.
    pub fn controller_published(&self) -> Vec<(String, String)> {
        self.driver.controller_published()
    }

    /// The capacity CSI volume `id` has now (0 when it was never given one).
    pub fn capacity(&self, id: &str) -> i64 {
        self.driver.capacity(id)
    }
}
