//! What this node holds: the node journal joined with the mount table, for `list`, the
//! metrics gauges and the per-volume stats.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::ports::{MountCheck, NodeJournal, Visibility};
use super::records::{HolderTimes, Step};
use super::staleness::HolderAge;
use super::{BridgeError, Deadline, NodeSide};

/// The most volumes whose stats one refresh asks for (bounded work per interval).
const MAX_STATS_VOLUMES: usize = 1000;
/// How long one NodeGetVolumeStats may take.
const STATS_CALL_BUDGET: Duration = Duration::from_secs(5);

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
    /// Set when the record could not be read.
    pub error: Option<String>,
    /// When the holders were added and their namespaces last hooked this volume.
    #[serde(skip)]
    pub holder_times: HolderTimes,
    /// Each holder with its age and whether it is stale (`staleness::judge_holders`
    /// fills it; empty until then).
    pub holder_ages: Vec<HolderAge>,
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
                    error: None,
                    holder_times: r.holder_times,
                    holder_ages: Vec::new(),
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
                error: Some(e.to_string()),
                holder_times: HolderTimes::default(),
                holder_ages: Vec::new(),
            },
        };
        out.push(entry);
    }
    Ok(out)
}

impl NodeSide {
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
