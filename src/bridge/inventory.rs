//! What this node holds: the node journal joined with the mount table, for `list`, the
//! metrics gauges, the per-volume stats and each volume's condition (a dead mount, or
//! the driver's VolumeCondition).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::ports::{MountCheck, MountHealth, NodeDriver, NodeJournal, Visibility};
use super::records::{HolderTimes, Step};
use super::staleness::HolderAge;
use super::{BridgeError, Deadline, NodeSide};

/// The most volumes whose stats one refresh asks for (bounded work per interval).
const MAX_STATS_VOLUMES: usize = 1000;
/// How long one NodeGetVolumeStats may take.
const STATS_CALL_BUDGET: Duration = Duration::from_secs(5);
/// How long the stat of one host_path may take before its condition is unknown (a hung
/// network filesystem must not stall the listing of the others).
const HEALTH_CHECK_BUDGET: Duration = Duration::from_secs(2);

/// The condition of a mounted volume.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Condition {
    /// Its filesystem answers and the driver (if it reports conditions) says normal.
    Normal,
    /// Its filesystem is gone: a stat of host_path answered `error` (ENOTCONN, ESTALE,
    /// EIO, EHOSTDOWN). Sandboxes holding it see errors; the next Attach repairs it.
    DeadMount { error: String },
    /// The driver's VolumeCondition says abnormal, with its message.
    DriverAbnormal { message: String },
    /// The stat of host_path did not answer in time, or failed otherwise.
    Unknown { error: String },
}

impl Condition {
    pub fn is_abnormal(&self) -> bool {
        matches!(
            self,
            Condition::DeadMount { .. } | Condition::DriverAbnormal { .. }
        )
    }

    /// One word, for `list`'s text table.
    pub fn as_column(&self) -> String {
        match self {
            Condition::Normal => "ok".into(),
            Condition::DeadMount { error } => {
                let name = error.split(':').next().unwrap_or(error);
                format!("dead:{name}")
            }
            Condition::DriverAbnormal { .. } => "abnormal".into(),
            Condition::Unknown { .. } => "unknown".into(),
        }
    }
}

impl std::fmt::Display for Condition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Condition::Normal => f.write_str("normal"),
            Condition::DeadMount { error } => write!(f, "dead mount: {error}"),
            Condition::DriverAbnormal { message } => {
                write!(f, "abnormal by the driver's VolumeCondition: {message}")
            }
            Condition::Unknown { error } => write!(f, "unknown: {error}"),
        }
    }
}

/// One volume attached (or half attached) on this node.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NodeVolume {
    pub volume_id: String,
    pub csi_volume_id: String,
    pub host_path: PathBuf,
    pub staging_path: Option<PathBuf>,
    pub controller_publish: &'static str,
    pub stage: &'static str,
    pub publish: &'static str,
    /// Sandboxes by containerd namespace.
    pub holders: BTreeMap<String, BTreeSet<String>>,
    /// The record was rebuilt after it was lost: `holders` are only those seen since, and
    /// the volume stays mounted until an operator releases it.
    pub holders_unknown: bool,
    /// Seconds since the epoch of the first attach in this record (0 = unknown).
    pub since: u64,
    /// `mounted`, `missing`, or `unchecked` (mount checks disabled).
    pub mount: &'static str,
    /// Whether its filesystem answers (and what the driver says, where `list` or the
    /// periodic check asked it); None when nothing is published there.
    pub condition: Option<Condition>,
    /// Set when the record could not be read.
    pub error: Option<String>,
    /// When the holders were added and their namespaces last hooked this volume.
    #[serde(skip)]
    pub holder_times: HolderTimes,
    /// Each holder with its age and whether it is stale (`staleness::judge_holders`
    /// fills it; empty until then).
    pub holder_ages: Vec<HolderAge>,
    /// The nodes the volume can be attached on, from its handle (empty: every node).
    pub accessible_topology: Vec<super::ports::Segments>,
    /// The size NodeExpandVolume last grew it to on this node (`expand`; 0 = never).
    pub expanded_bytes: i64,
}

/// Every volume in `journal`, with its mount state as `mounts` sees it.
pub async fn node_volumes(
    journal: &dyn NodeJournal,
    mounts: &dyn MountCheck,
) -> Result<Vec<NodeVolume>, BridgeError> {
    let deadline = Deadline::after(Duration::from_secs(10));
    let mut out = Vec::new();
    for volume_id in journal.volume_ids()? {
        let entry = match journal.load(&volume_id) {
            Ok(Some(r)) => {
                let mount = match mounts.visibility(&r.target_path, &deadline).await {
                    Ok(Visibility::Mounted) => "mounted",
                    Ok(Visibility::NotMounted) => "missing",
                    Ok(Visibility::Unchecked) => "unchecked",
                    Err(_) => "unknown",
                };
                let condition = if r.publish == Step::Done && mount != "missing" {
                    Some(mount_condition(mounts, &r.target_path).await)
                } else {
                    None
                };
                NodeVolume {
                    volume_id,
                    csi_volume_id: r.csi_volume_id,
                    host_path: r.target_path,
                    staging_path: r.staging_path,
                    controller_publish: r.controller_publish.as_str(),
                    stage: r.stage.as_str(),
                    publish: r.publish.as_str(),
                    holders: r.holders,
                    holders_unknown: r.holders_unknown,
                    since: r.since,
                    mount,
                    condition,
                    error: None,
                    holder_times: r.holder_times,
                    holder_ages: Vec::new(),
                    accessible_topology: r.accessible_topology,
                    expanded_bytes: r.expanded_bytes,
                }
            }
            Ok(None) => continue,
            Err(e) => NodeVolume {
                volume_id,
                csi_volume_id: String::new(),
                host_path: PathBuf::new(),
                staging_path: None,
                controller_publish: "?",
                stage: "?",
                publish: "?",
                holders: BTreeMap::new(),
                holders_unknown: false,
                since: 0,
                mount: "unknown",
                condition: None,
                error: Some(e.to_string()),
                holder_times: HolderTimes::default(),
                holder_ages: Vec::new(),
                accessible_topology: Vec::new(),
                expanded_bytes: 0,
            },
        };
        out.push(entry);
    }
    Ok(out)
}

/// Whether the filesystem at `host_path` answers (one stat, bounded).
async fn mount_condition(mounts: &dyn MountCheck, host_path: &std::path::Path) -> Condition {
    let deadline = Deadline::after(HEALTH_CHECK_BUDGET);
    match mounts.health(host_path, &deadline).await {
        Ok(MountHealth::Answers) => Condition::Normal,
        Ok(MountHealth::Dead(dead)) => Condition::DeadMount {
            error: dead.to_string(),
        },
        Err(error) => Condition::Unknown {
            error: error.to_string(),
        },
    }
}

/// Adds the driver's VolumeCondition to the volumes whose filesystem answers, when the
/// driver reports conditions (VOLUME_CONDITION): NodeGetVolumeStats, bounded per volume.
/// A driver that cannot be asked leaves them as they are.
pub async fn add_driver_conditions(volumes: &mut [NodeVolume], driver: &dyn NodeDriver) {
    let deadline = Deadline::after(STATS_CALL_BUDGET);
    if !driver
        .capabilities(&deadline)
        .await
        .is_ok_and(|caps| caps.volume_condition)
    {
        return;
    }
    for volume in volumes
        .iter_mut()
        .filter(|v| v.condition == Some(Condition::Normal))
        .take(MAX_STATS_VOLUMES)
    {
        let deadline = Deadline::after(STATS_CALL_BUDGET);
        match driver
            .volume_stats(&volume.csi_volume_id, &volume.host_path, &deadline)
            .await
        {
            Ok(stats) => {
                if let Some(message) = stats.abnormal {
                    volume.condition = Some(Condition::DriverAbnormal { message });
                }
            }
            Err(error) => {
                tracing::debug!(volume_id = %volume.volume_id, %error, "NodeGetVolumeStats for the volume condition failed")
            }
        }
    }
}

impl NodeSide {
    /// The periodic check of every published volume's condition (a stat of its
    /// host_path; the driver's VolumeCondition when it reports one): sets each volume's
    /// condition gauge and logs each change, not each check. It repairs nothing: the
    /// sandboxes holding a dead mount have it bind-mounted already, and the next Attach
    /// repairs it before it hands it out.
    pub async fn check_volume_conditions(&self) -> Result<(), BridgeError> {
        let mut volumes = node_volumes(self.node_journal().as_ref(), self.mounts.as_ref()).await?;
        volumes.retain(|v| v.condition.is_some());
        if volumes
            .iter()
            .any(|v| v.condition == Some(Condition::Normal))
        {
            add_driver_conditions(&mut volumes, self.driver.node().as_ref()).await;
        }
        let mut known = self.conditions.lock().expect("poisoned");
        let mut seen = BTreeSet::new();
        for volume in volumes {
            let Some(condition) = volume.condition else {
                continue;
            };
            if matches!(condition, Condition::Unknown { .. }) {
                tracing::debug!(volume_id = %volume.volume_id, %condition, "volume condition not known this time");
                seen.insert(volume.volume_id);
                continue;
            }
            self.recorder
                .volume_condition(&volume.volume_id, Some(condition.is_abnormal()));
            let holders: usize = volume.holders.values().map(BTreeSet::len).sum();
            let before = known.insert(volume.volume_id.clone(), condition.clone());
            if before.as_ref() != Some(&condition) {
                if condition.is_abnormal() {
                    let consequence = match condition {
                        Condition::DeadMount { .. } => {
                            "the sandboxes holding it see I/O errors; the next Attach of the \
                             volume mounts it again before it hands it out"
                        }
                        _ => "as its driver reports it; Attach does not act on this",
                    };
                    tracing::warn!(
                        volume_id = %volume.volume_id,
                        host_path = %volume.host_path.display(),
                        holders,
                        %condition,
                        "volume condition abnormal: {consequence}"
                    );
                } else if before.is_some_and(|b| b.is_abnormal()) {
                    tracing::info!(volume_id = %volume.volume_id, "volume condition normal again");
                }
            }
            seen.insert(volume.volume_id);
        }
        known.retain(|volume_id, _| {
            let kept = seen.contains(volume_id);
            if !kept {
                self.recorder.volume_condition(volume_id, None);
            }
            kept
        });
        Ok(())
    }

    /// Refreshes the inventory gauges and, with `stats` and when the driver offers
    /// NodeGetVolumeStats, each mounted volume's capacity, usage and condition. Runs off
    /// the hook path.
    pub async fn refresh_volume_metrics(&self, stats: bool) -> Result<(), BridgeError> {
        let mut volumes = node_volumes(self.node_journal().as_ref(), self.mounts.as_ref()).await?;
        self.report_stale_holders(&mut volumes);
        let holders = volumes
            .iter()
            .map(|v| v.holders.values().map(BTreeSet::len).sum::<usize>())
            .sum();
        self.recorder.node_inventory(volumes.len(), holders);
        if !stats {
            return Ok(());
        }
        let deadline = Deadline::after(STATS_CALL_BUDGET);
        if !self.driver.node_caps(&deadline).await?.get_volume_stats {
            return Ok(());
        }
        let mut seen = BTreeSet::new();
        for volume in volumes
            .iter()
            .filter(|v| v.publish == Step::Done.as_str() && v.mount != "missing")
            .take(MAX_STATS_VOLUMES)
        {
            let deadline = Deadline::after(STATS_CALL_BUDGET);
            // The driver stats what the path leads to: never through a planted symlink.
            let base = super::node::base_of(&volume.host_path);
            if let Err(error) = self.verify(&base, &[&volume.host_path], &deadline).await {
                tracing::warn!(volume_id = %volume.volume_id, %error, "volume stats skipped");
                continue;
            }
            match self
                .driver
                .node()
                .volume_stats(&volume.csi_volume_id, &volume.host_path, &deadline)
                .await
            {
                Ok(stats) => {
                    self.recorder.volume_stats(&volume.volume_id, Some(&stats));
                    seen.insert(volume.volume_id.clone());
                }
                Err(error) => {
                    tracing::debug!(volume_id = %volume.volume_id, %error, "NodeGetVolumeStats failed")
                }
            }
        }
        self.recorder.forget_volumes_except(&seen);
        Ok(())
    }
}
