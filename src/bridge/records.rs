//! The core's records: what the node journal keeps for each attached volume (its steps
//! and holders) and what the controller store keeps for each Cube volume. The core owns
//! these words; `store/` and `k8s/` persist them behind the ports (ports.rs).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::ports::Segments;

/// A holder log longer than this is folded into its record at the next change: every hook
/// reads the log, so it must stay short however long a volume stays mounted.
pub const HOLDER_LOG_LIMIT: u64 = 4096;

/// The on-disk format of a record; bumped on incompatible change. Format 1 (holders as a
/// flat set of `namespace/sandbox`) is still read.
pub const JOURNAL_FORMAT: u32 = 2;

/// How far one mutating step has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Never called, or undone.
    #[default]
    Absent,
    /// Called without a known result: it may or may not have taken effect.
    Uncertain,
    /// Succeeded.
    Done,
}

impl Step {
    /// Whether teardown must call the inverse of this step.
    pub fn needs_undo(self) -> bool {
        self != Step::Absent
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Step::Absent => "absent",
            Step::Uncertain => "uncertain",
            Step::Done => "done",
        }
    }
}

/// Sandboxes holding a volume, by containerd namespace. Cubelet counts holders per
/// (namespace, volume), so each namespace's count is Cube's truth for that namespace; the
/// mount is shared by all of them.
pub type Holders = BTreeMap<String, BTreeSet<String>>;

/// One change to the holders, as Cube reported it, and when (`at`, seconds since the
/// epoch; 0 when unknown: a change logged before times were kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HolderChange {
    /// Attach. `first` when Cube's ref_count was 0: the namespace held nothing before,
    /// so sandboxes recorded for it earlier are stale (pruned without a Detach).
    Attach {
        namespace: String,
        sandbox: String,
        first: bool,
        at: u64,
    },
    /// Detach. `last` when Cube's ref_count is 0: the namespace holds nothing more.
    Detach {
        namespace: String,
        sandbox: String,
        last: bool,
        at: u64,
    },
}

impl HolderChange {
    /// What Cube's Release does after this Attach failed, or its answer reached nobody
    /// (Cube never Detaches it then): the sandbox leaves, and its namespace too once Cube
    /// counts nobody in it. Cube's `ref_count` (taken before the Attach) already counted
    /// the sandbox when it held the volume before (`held_before`), so a retried Attach of
    /// the namespace's only holder leaves the namespace empty. None for a Detach.
    pub fn released_after_failure(&self, ref_count: i64, held_before: bool) -> Option<Self> {
        let HolderChange::Attach {
            namespace,
            sandbox,
            at,
            ..
        } = self
        else {
            return None;
        };
        let left_in_cube = ref_count - i64::from(held_before);
        Some(HolderChange::Detach {
            namespace: namespace.clone(),
            sandbox: sandbox.clone(),
            last: left_in_cube <= 0,
            at: *at,
        })
    }

    /// Whether `holders` lists this change's sandbox in its namespace.
    pub fn sandbox_held_in(&self, holders: &Holders) -> bool {
        let (HolderChange::Attach {
            namespace, sandbox, ..
        }
        | HolderChange::Detach {
            namespace, sandbox, ..
        }) = self;
        holders
            .get(namespace)
            .is_some_and(|set| set.contains(sandbox))
    }

    /// Applies the change. Replaying a log suffix over its own result changes nothing:
    /// every change sets, rather than toggles, what it touches.
    pub fn apply(&self, holders: &mut Holders) {
        match self {
            HolderChange::Attach {
                namespace,
                sandbox,
                first,
                ..
            } => {
                let set = holders.entry(namespace.clone()).or_default();
                if *first {
                    set.clear();
                }
                set.insert(sandbox.clone());
            }
            HolderChange::Detach {
                namespace,
                sandbox,
                last,
                ..
            } => {
                if *last {
                    holders.remove(namespace);
                } else if let Some(set) = holders.get_mut(namespace) {
                    set.remove(sandbox);
                    // Cube says others of this namespace remain even if we never saw them
                    // attach (a record rebuilt from metadata): keep the namespace.
                }
            }
        }
    }

    /// Applies the change to `holders` and its times to `times`: a sandbox that was not a
    /// holder before is added at the change's time (a retried Attach keeps the first
    /// time), one that leaves takes its time along, and the namespace's last hook moves
    /// forward. Replaying a log suffix over its own result changes nothing here either.
    /// Touches only the change's own entries: the log replays it line by line.
    pub fn apply_timed(&self, holders: &mut Holders, times: &mut HolderTimes) {
        match self {
            HolderChange::Attach {
                namespace,
                sandbox,
                first,
                at,
            } => {
                let was_holder = !first
                    && holders
                        .get(namespace)
                        .is_some_and(|set| set.contains(sandbox));
                if !was_holder {
                    let added = times.added.entry(namespace.clone()).or_default();
                    if *first {
                        added.clear();
                    }
                    match *at {
                        0 => added.remove(sandbox),
                        at => added.insert(sandbox.clone(), at),
                    };
                    if added.is_empty() {
                        times.added.remove(namespace);
                    }
                }
            }
            HolderChange::Detach {
                namespace,
                sandbox,
                last,
                ..
            } => {
                if *last {
                    times.added.remove(namespace);
                } else if let Some(added) = times.added.get_mut(namespace) {
                    added.remove(sandbox);
                    if added.is_empty() {
                        times.added.remove(namespace);
                    }
                }
            }
        }
        self.apply(holders);
        let (HolderChange::Attach { namespace, at, .. }
        | HolderChange::Detach { namespace, at, .. }) = self;
        if *at > 0 {
            let last = times.last_hook.entry(namespace.clone()).or_default();
            *last = (*last).max(*at);
        }
    }
}

/// When each holder of a volume was added and when each namespace last hooked it, in
/// seconds since the epoch: what tells a phantom holder (one Cube never learned of, in a
/// namespace that has since gone quiet) from a live one. A holder recorded before times
/// were kept has none (its age is unknown).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderTimes {
    /// By namespace, then sandbox: when the holder was added.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub added: BTreeMap<String, BTreeMap<String, u64>>,
    /// By namespace: its last Attach or Detach of this volume (kept after the namespace
    /// stops holding it, as evidence the namespace is alive).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub last_hook: BTreeMap<String, u64>,
}

impl HolderTimes {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.last_hook.is_empty()
    }

    /// When `sandbox` of `namespace` was added, if known.
    pub fn added_at(&self, namespace: &str, sandbox: &str) -> Option<u64> {
        self.added.get(namespace)?.get(sandbox).copied()
    }

    /// Forgets the added times of sandboxes that no longer hold the volume.
    pub fn prune(&mut self, holders: &Holders) {
        self.added.retain(|namespace, added| {
            let Some(set) = holders.get(namespace) else {
                return false;
            };
            added.retain(|sandbox, _| set.contains(sandbox));
            !added.is_empty()
        });
    }
}

/// What this node did for one volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub format: u32,
    /// The Cube volume id.
    pub volume_id: String,
    pub csi_volume_id: String,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    /// From ControllerPublish; passed to NodeStage and NodePublish.
    #[serde(default)]
    pub publish_context: BTreeMap<String, String>,
    /// The node id ControllerPublish was called with (empty when it was not).
    #[serde(default)]
    pub node_id: String,
    /// The CSI target path, which is Cube's host_path.
    pub target_path: PathBuf,
    /// The CSI staging path, when the driver stages.
    #[serde(default)]
    pub staging_path: Option<PathBuf>,
    #[serde(default)]
    pub controller_publish: Step,
    #[serde(default)]
    pub stage: Step,
    #[serde(default)]
    pub publish: Step,
    #[serde(default)]
    pub holders: Holders,
    /// The boot (`/proc/sys/kernel/random/boot_id`) the steps were taken in; empty when
    /// unknown (a record from before boot ids were kept).
    #[serde(default)]
    pub boot_id: String,
    /// When the volume was first attached in this record (seconds since the epoch).
    #[serde(default)]
    pub since: u64,
    /// The record was rebuilt after its file and holder log were lost: `holders` lists only
    /// the holders seen since, and other namespaces may hold the volume too. No Detach
    /// tears such a volume down while it may be mounted; an operator releases it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub holders_unknown: bool,
    /// When the holders were added and each namespace last hooked the volume (absent
    /// from records written before times were kept: ages unknown).
    #[serde(default, skip_serializing_if = "HolderTimes::is_empty")]
    pub holder_times: HolderTimes,
    /// The nodes the volume can be attached on, from its handle (empty: every node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<Segments>,
    /// The capacity NodeExpandVolume last grew the volume to on this node (0: never).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub expanded_bytes: i64,
}

fn is_zero(value: &i64) -> bool {
    *value == 0
}

impl NodeRecord {
    pub fn new(volume_id: &str, csi_volume_id: &str, target_path: PathBuf) -> Self {
        Self {
            format: JOURNAL_FORMAT,
            volume_id: volume_id.to_string(),
            csi_volume_id: csi_volume_id.to_string(),
            volume_context: BTreeMap::new(),
            publish_context: BTreeMap::new(),
            node_id: String::new(),
            target_path,
            staging_path: None,
            controller_publish: Step::Absent,
            stage: Step::Absent,
            publish: Step::Absent,
            holders: Holders::new(),
            boot_id: String::new(),
            since: 0,
            holders_unknown: false,
            holder_times: HolderTimes::default(),
            accessible_topology: Vec::new(),
            expanded_bytes: 0,
        }
    }

    /// Applies a holder change to the holders and their times (forgetting the times of
    /// holders removed otherwise: an undone Attach, an operator's release).
    pub fn apply(&mut self, change: &HolderChange) {
        change.apply_timed(&mut self.holders, &mut self.holder_times);
        self.holder_times.prune(&self.holders);
    }

    /// Whether any namespace still holds the volume.
    pub fn is_held(&self) -> bool {
        !self.holders.is_empty()
    }

    /// A settled record is attached and held: nothing is left to finish or undo.
    pub fn is_settled(&self) -> bool {
        self.publish == Step::Done
            && self.controller_publish != Step::Uncertain
            && self.stage != Step::Uncertain
            && self.is_held()
    }
}

/// Where a Cube volume's creation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum VolumeState {
    /// CreateVolume was sent but its answer is not known: a CSI volume of `csi_name`
    /// may exist.
    #[default]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
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
    /// CreateVolume's accessible_topology: the nodes the volume can be attached on (empty:
    /// every node, or a driver without VOLUME_ACCESSIBILITY_CONSTRAINTS).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<Segments>,
    /// The last ControllerExpandVolume (or a driver that expands on nodes only) asked for
    /// NodeExpandVolume: every node where the volume is staged or published grows it to
    /// `capacity_bytes` (kubelet's part in Kubernetes).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub node_expansion_required: bool,
    /// What the volume was made from (`restore`, `clone`); None: an empty volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<ContentSource>,
    /// The Create calls (each a token unique to it, on any replica) that recorded this
    /// volume created and then answered CubeMaster with it, or may have: each adds itself
    /// before it answers. A Create whose answer reached nobody deletes the volume only
    /// when no other call is listed; otherwise it takes itself off and leaves the volume,
    /// which another replica that took the Create over may have handed to CubeMaster.
    /// The last `ANSWERING_CREATES_KEPT`. Empty in a record from before this existed. Not
    /// covered by the MAC: it only ever stops a deletion.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub answering_creates: Vec<String>,
}

/// How many `VolumeRecord::answering_creates` a record keeps: more than one is enough to
/// stop an undo, so dropping the oldest of many changes nothing.
pub const ANSWERING_CREATES_KEPT: usize = 8;

/// What a volume was made from, besides nothing: a snapshot (`restore`) or another volume
/// (`clone`). Recorded so that every later CreateVolume of the volume (CubeMaster's Create
/// of its id, the sweep resolving an unfinished one) repeats the same request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ContentSource {
    /// Restored from the bridge's snapshot `snapshot_id` (CSI snapshot `csi_snapshot_id`).
    Snapshot {
        snapshot_id: String,
        csi_snapshot_id: String,
    },
    /// Cloned from Cube volume `volume_id` (CSI volume `csi_volume_id`).
    Volume {
        volume_id: String,
        csi_volume_id: String,
    },
}

impl ContentSource {
    /// `snapshot:<id>` or `volume:<id>`, in the bridge's own ids (for lists and messages).
    pub fn describe(&self) -> String {
        match self {
            ContentSource::Snapshot { snapshot_id, .. } => format!("snapshot:{snapshot_id}"),
            ContentSource::Volume { volume_id, .. } => format!("volume:{volume_id}"),
        }
    }
}

/// One snapshot the bridge took of a Cube volume (`snapshot create`). Its states are a
/// volume's: `Creating` while the answer to CreateSnapshot is unknown (a snapshot of
/// `csi_name` may exist), `Created` with its handle, `Deleting` once a sweep claimed an
/// abandoned create.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// The operator's name of the snapshot (`[A-Za-z0-9_-]{1,128}`, like a volume id).
    pub snapshot_id: String,
    /// The CreateSnapshot name (the idempotency key).
    pub csi_name: String,
    /// The CSI driver (GetPluginInfo name) that took the snapshot.
    pub csi_driver: String,
    /// The Cube volume it is a snapshot of.
    pub source_volume_id: String,
    /// That volume's CSI handle, which CreateSnapshot was sent for.
    pub source_csi_volume_id: String,
    pub state: VolumeState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_snapshot_id: Option<String>,
    #[serde(default)]
    pub size_bytes: i64,
    /// When the driver says it took the snapshot (seconds since the epoch; 0 unknown).
    #[serde(default)]
    pub creation_time: u64,
    #[serde(default)]
    pub ready_to_use: bool,
    /// Seconds since the Unix epoch.
    pub updated_at: u64,
    /// Set by the store (see `VolumeRecord::revision`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The bridge's MAC over the fields a delete acts on (bridge/integrity.rs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity: Option<String>,
}
