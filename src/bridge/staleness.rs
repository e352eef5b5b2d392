//! Holder ages and stale holders: a holder whose namespace has made no Attach or Detach
//! on this node for `node.stale_holder_secs` may be a phantom (an Attach Cube counted as
//! failed, docs/reliability.md). It is reported — `list`, a metric, a log line — for an
//! operator to release; never released here: a long-lived sandbox in a quiet namespace
//! looks the same.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Serialize;

use super::NodeSide;
use super::inventory::NodeVolume;

/// One holder of a volume, with its age and whether its namespace has gone quiet.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct HolderAge {
    pub namespace: String,
    pub sandbox: String,
    /// When the holder was added (seconds since the epoch); None: recorded before times
    /// were kept.
    pub added_at: Option<u64>,
    pub age_secs: Option<u64>,
    /// The namespace's last Attach or Detach of any volume of this bridge (its state dir)
    /// on this node, if known: another driver's hooks are not seen here.
    pub namespace_last_hook: Option<u64>,
    /// The namespace has made no hook for longer than `node.stale_holder_secs`.
    pub stale: bool,
}

/// The latest hook of each namespace on this node: every record's last hooks and holder
/// times, and the last hooks kept past teardowns (`NodeJournal::kept_last_hooks`). Hooks
/// of forked hooks count as much as the daemon's: all of them are in the journal.
pub fn namespace_last_hooks(
    volumes: &[NodeVolume],
    kept: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    let mut last = kept.clone();
    let mut saw = |namespace: &str, at: u64| {
        if at > 0 {
            let entry = last.entry(namespace.to_string()).or_default();
            *entry = (*entry).max(at);
        }
    };
    for volume in volumes {
        for (namespace, at) in &volume.holder_times.last_hook {
            saw(namespace, *at);
        }
        for (namespace, added) in &volume.holder_times.added {
            for at in added.values() {
                saw(namespace, *at);
            }
        }
    }
    last
}

/// Fills each volume's `holder_ages` as of `now`; returns how many holders are stale.
/// Without `stale_after`, or without a known last hook of its namespace (a journal of a
/// build that kept no times), no holder is stale.
pub fn judge_holders(
    volumes: &mut [NodeVolume],
    kept: &BTreeMap<String, u64>,
    now: u64,
    stale_after: Option<Duration>,
) -> usize {
    let last_hooks = namespace_last_hooks(volumes, kept);
    let mut stale_count = 0;
    for volume in volumes.iter_mut() {
        volume.holder_ages = volume
            .holders
            .iter()
            .flat_map(|(namespace, sandboxes)| {
                sandboxes.iter().map(move |sandbox| (namespace, sandbox))
            })
            .map(|(namespace, sandbox)| {
                let added_at = volume.holder_times.added_at(namespace, sandbox);
                let namespace_last_hook = last_hooks.get(namespace).copied();
                let stale = match (stale_after, namespace_last_hook) {
                    (Some(after), Some(last)) => now.saturating_sub(last) > after.as_secs(),
                    _ => false,
                };
                stale_count += usize::from(stale);
                HolderAge {
                    namespace: namespace.clone(),
                    sandbox: sandbox.clone(),
                    added_at,
                    age_secs: added_at.map(|at| now.saturating_sub(at)),
                    namespace_last_hook,
                    stale,
                }
            })
            .collect();
    }
    stale_count
}

impl NodeSide {
    /// Judges the holders of `volumes` (the inventory's, off the hook path) and reports
    /// the stale ones: the metric, and a warning for each holder once it turns stale.
    pub(super) fn report_stale_holders(&self, volumes: &mut [NodeVolume]) {
        let kept = match self.node_journal().kept_last_hooks() {
            Ok(kept) => kept,
            Err(error) => {
                tracing::warn!(%error, "could not read the namespaces' kept last hooks");
                BTreeMap::new()
            }
        };
        let now = self.clock.now_secs();
        let stale = judge_holders(volumes, &kept, now, self.config.stale_holder_after);
        self.recorder.stale_holders(stale);
        let now_stale: BTreeSet<StaleHolder> = volumes
            .iter()
            .flat_map(|v| {
                v.holder_ages
                    .iter()
                    .filter(|h| h.stale)
                    .map(|h| (v.volume_id.clone(), h.namespace.clone(), h.sandbox.clone()))
            })
            .collect();
        let mut reported = REPORTED.lock().unwrap_or_else(|e| e.into_inner());
        let before = reported
            .insert(self.config.driver.clone(), now_stale.clone())
            .unwrap_or_default();
        for (volume_id, namespace, sandbox) in now_stale.difference(&before) {
            tracing::warn!(
                volume_id,
                namespace,
                sandbox,
                "stale holder: its namespace has made no Attach or Detach on this node for \
                 longer than node.stale_holder_secs; if Cube no longer runs this sandbox, \
                 release it with `cube-csi-bridge holders release`"
            );
        }
    }
}

/// The stale holders last reported, by driver: each is logged once when it turns stale,
/// not at every refresh.
static REPORTED: std::sync::Mutex<BTreeMap<String, BTreeSet<StaleHolder>>> =
    std::sync::Mutex::new(BTreeMap::new());

/// (volume id, namespace, sandbox) of a stale holder.
type StaleHolder = (String, String, String);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::records::{HolderChange, HolderTimes, Holders};

    fn volume(id: &str, changes: &[HolderChange]) -> NodeVolume {
        let (mut holders, mut times) = (Holders::new(), HolderTimes::default());
        for change in changes {
            change.apply_timed(&mut holders, &mut times);
        }
        NodeVolume {
            volume_id: id.into(),
            csi_volume_id: String::new(),
            host_path: Default::default(),
            staging_path: None,
            controller_publish: "done",
            stage: "done",
            publish: "done",
            holders,
            holders_unknown: false,
            since: 1,
            mount: "mounted",
            error: None,
            holder_times: times,
            holder_ages: Vec::new(),
            condition: None,
            accessible_topology: Vec::new(),
            expanded_bytes: 0,
        }
    }

    fn attach(ns: &str, sb: &str, first: bool, at: u64) -> HolderChange {
        HolderChange::Attach {
            namespace: ns.into(),
            sandbox: sb.into(),
            first,
            at,
        }
    }

    fn detach(ns: &str, sb: &str, last: bool, at: u64) -> HolderChange {
        HolderChange::Detach {
            namespace: ns.into(),
            sandbox: sb.into(),
            last,
            at,
        }
    }

    /// A holder is stale when its namespace has been quiet on every volume (and in the
    /// hooks kept past teardowns) for longer than the setting; its own age does not
    /// matter, and a holder of unknown time in a quiet namespace of unknown time is not.
    #[test]
    fn a_holder_is_stale_only_when_its_namespace_is_quiet_everywhere() {
        let after = Some(Duration::from_secs(100));
        let mut volumes = vec![
            volume(
                "v1",
                &[
                    attach("quiet", "phantom", true, 1000),
                    attach("busy", "old", true, 1000),
                    attach("unknown", "legacy", true, 0),
                    attach("kept", "k", true, 1000),
                ],
            ),
            // busy hooked v2 lately: a Detach leaves no holder but counts.
            volume(
                "v2",
                &[
                    attach("busy", "b", true, 1900),
                    detach("busy", "x", false, 1950),
                ],
            ),
        ];
        let kept = BTreeMap::from([("kept".to_string(), 1990)]);
        let stale = judge_holders(&mut volumes, &kept, 2000, after);
        let verdict: BTreeMap<_, _> = volumes
            .iter()
            .flat_map(|v| &v.holder_ages)
            .map(|h| {
                (
                    h.sandbox.as_str(),
                    (h.stale, h.age_secs, h.namespace_last_hook),
                )
            })
            .collect();
        assert_eq!(verdict["phantom"], (true, Some(1000), Some(1000)));
        assert_eq!(verdict["old"], (false, Some(1000), Some(1950)));
        assert_eq!(verdict["legacy"], (false, None, None));
        assert_eq!(verdict["k"], (false, Some(1000), Some(1990)));
        assert_eq!(stale, 1);
        // Off: nothing is stale.
        assert_eq!(judge_holders(&mut volumes, &kept, 2000, None), 0);
        assert!(
            volumes
                .iter()
                .flat_map(|v| &v.holder_ages)
                .all(|h| !h.stale)
        );
    }

    /// A retried Attach keeps the holder's first time; a first Attach of a namespace
    /// starts afresh; times of holders that left are forgotten, the namespace's last hook
    /// is not.
    #[test]
    fn holder_times_follow_the_changes() {
        let (mut holders, mut times) = (Holders::new(), HolderTimes::default());
        for change in [
            attach("ns", "a", true, 10),
            attach("ns", "b", false, 20),
            attach("ns", "b", false, 30),
            detach("ns", "a", false, 40),
        ] {
            change.apply_timed(&mut holders, &mut times);
        }
        assert_eq!(holders["ns"], BTreeSet::from(["b".to_string()]));
        assert_eq!(times.added_at("ns", "b"), Some(20));
        assert_eq!(times.added_at("ns", "a"), None);
        assert_eq!(times.last_hook["ns"], 40);
        attach("ns", "c", true, 50).apply_timed(&mut holders, &mut times);
        assert_eq!(times.added["ns"], BTreeMap::from([("c".to_string(), 50)]));
        detach("ns", "c", true, 60).apply_timed(&mut holders, &mut times);
        assert!(holders.is_empty() && times.added.is_empty());
        assert_eq!(times.last_hook["ns"], 60);
    }
}
