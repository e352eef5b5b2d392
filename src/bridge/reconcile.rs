//! Reconciliation of the node journal: finish or undo what a crash, a killed hook or a
//! reboot left behind, and re-establish mounts that sandboxes still hold.
//!
//! Each volume is judged on a fresh read under its lock (a live hook may have changed it
//! since the journal was listed):
//! - a record from an earlier boot: Cubelet's counts did not survive the reboot and no
//!   Detach will come for the sandboxes that died, so it is torn down when nothing is
//!   mounted any more;
//! - a record nobody holds (an Attach that never answered, a teardown that stopped half
//!   way): torn down, unless its holders are unknown (its record was lost) and it may be
//!   mounted: then it is reported and left for an operator;
//! - a held record whose mount is gone or whose steps are uncertain: re-established;
//! - a held, mounted record: healthy.

use tracing::Instrument;

use super::handoff::VolumeHandle;
use super::naming::VolumePaths;
use super::ports::{JournalError, LockScope, Visibility};
use super::records::Step;
use super::{BridgeError, Caller, Deadline, HookKind, NodeSide};

/// Which volumes a pass looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope<'a> {
    /// Every record (start-up, periodic), waiting for each volume's lock.
    All,
    /// Only volumes marked pending whose lock is free: operations that died. Cheap enough
    /// to run after every hook.
    Abandoned,
    /// As `Abandoned`, but not this volume: the volume of a Detach that has just answered
    /// Cube with a failure. Cube keeps it attached and retries that Detach; finishing the
    /// teardown behind its back would leave the bridge's state other than what Cube saw.
    AbandonedBesides(&'a str),
}

/// What a pass found.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReconcileReport {
    pub healthy: usize,
    pub rolled_back: usize,
    pub earlier_boot: usize,
    pub repaired: usize,
    /// Held but not mounted, and repairing it failed (reported, retried next pass).
    pub mount_lost: usize,
    /// Rebuilt after its record was lost, with holders unknown, and maybe mounted: left
    /// mounted for an operator to release (reported every pass).
    pub holders_unknown: usize,
    pub failed: usize,
    /// Busy with a live hook (Abandoned scope only).
    pub skipped: usize,
    /// Failed in an earlier scan of this process, and waiting before it is tried again
    /// (`Backoff`; Abandoned scope only). Not a finding of this pass.
    pub deferred: usize,
}

impl ReconcileReport {
    pub fn is_empty(&self) -> bool {
        Self {
            deferred: 0,
            ..self.clone()
        } == Self::default()
    }
}

/// When a scan of abandoned work tries a volume whose work failed there again: after 30 s,
/// doubling to 10 min while it keeps failing. Without it, the volumes of a hung backend
/// (sorted first) took each pass's whole budget, every 30 s, before any other volume's
/// work was looked at, and the hung driver got a new call each time. Only the scans of
/// abandoned work wait; the full pass at start-up and Cube's own retries do not.
#[derive(Debug, Default)]
pub struct Backoff(std::collections::HashMap<String, (std::time::Instant, std::time::Duration)>);

const BACKOFF_FIRST: std::time::Duration = std::time::Duration::from_secs(30);
const BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(600);

impl Backoff {
    fn waiting(&self, volume_id: &str, now: std::time::Instant) -> bool {
        self.0.get(volume_id).is_some_and(|(next, _)| *next > now)
    }

    fn failed(&mut self, volume_id: &str, now: std::time::Instant) {
        let pause = self
            .0
            .get(volume_id)
            .map_or(BACKOFF_FIRST, |(_, last)| (*last * 2).min(BACKOFF_MAX));
        self.0.insert(volume_id.to_string(), (now + pause, pause));
    }

    /// Forgets volumes that succeeded, or are no longer pending.
    fn keep_only(&mut self, failing: &std::collections::HashSet<&str>) {
        self.0.retain(|id, _| failing.contains(id.as_str()));
    }
}

/// What happened to one volume.
enum Outcome {
    Healthy,
    RolledBack,
    EarlierBoot,
    Repaired,
    MountLost,
    HoldersUnknown,
    Skipped,
}

impl NodeSide {
    /// One reconciliation pass. Errors on single volumes are logged and counted.
    pub async fn reconcile_node(&self, scope: Scope<'_>) -> Result<ReconcileReport, BridgeError> {
        let journal = self.node_journal().clone();
        let every_record = scope == Scope::All;
        let mut ids = super::blocking(move || {
            let mut ids = journal.pending()?;
            if every_record {
                ids.extend(journal.volume_ids()?);
            }
            ids.sort();
            ids.dedup();
            Ok(ids)
        })
        .await?;
        if let Scope::AbandonedBesides(left_for_cube) = scope {
            ids.retain(|id| id != left_for_cube);
        }
        let mut report = ReconcileReport::default();
        let abandoned_only = scope != Scope::All;
        let mut failing = std::collections::HashSet::new();
        for volume_id in &ids {
            let volume_id = volume_id.as_str();
            let span = tracing::info_span!("reconcile", %volume_id);
            if abandoned_only
                && self
                    .retry_after
                    .lock()
                    .expect("poisoned")
                    .waiting(volume_id, std::time::Instant::now())
            {
                failing.insert(volume_id);
                report.deferred += 1;
                continue;
            }
            let outcome = self
                .reconcile_volume(volume_id, scope)
                .instrument(span.clone())
                .await;
            if abandoned_only && outcome.is_err() {
                failing.insert(volume_id);
                self.retry_after
                    .lock()
                    .expect("poisoned")
                    .failed(volume_id, std::time::Instant::now());
            }
            match outcome {
                Ok(Outcome::Healthy) => report.healthy += 1,
                Ok(Outcome::RolledBack) => report.rolled_back += 1,
                Ok(Outcome::EarlierBoot) => report.earlier_boot += 1,
                Ok(Outcome::Repaired) => report.repaired += 1,
                Ok(Outcome::MountLost) => report.mount_lost += 1,
                Ok(Outcome::HoldersUnknown) => report.holders_unknown += 1,
                Ok(Outcome::Skipped) => report.skipped += 1,
                Err(error) => {
                    span.in_scope(|| {
                        tracing::error!(%error, "reconciling failed; a later hook or pass retries")
                    });
                    report.failed += 1;
                }
            }
        }
        if abandoned_only {
            self.retry_after
                .lock()
                .expect("poisoned")
                .keep_only(&failing);
        }
        for (finding, count) in [
            ("rolled_back", report.rolled_back),
            ("earlier_boot", report.earlier_boot),
            ("repaired", report.repaired),
            ("mount_lost", report.mount_lost),
            ("holders_unknown", report.holders_unknown),
            ("failed", report.failed),
        ] {
            self.recorder.reconcile_finding(finding, count);
        }
        Ok(report)
    }

    async fn reconcile_volume(
        &self,
        volume_id: &str,
        scope: Scope<'_>,
    ) -> Result<Outcome, BridgeError> {
        let deadline = Deadline::after(self.config.timeouts.detach);
        let _guard = match scope {
            Scope::All => Some(
                self.locks
                    .acquire(LockScope::Node, volume_id, &deadline)
                    .await?,
            ),
            Scope::Abandoned | Scope::AbandonedBesides(_) => {
                match self.locks.try_acquire(LockScope::Node, volume_id)? {
                    Some(guard) => Some(guard),
                    None => return Ok(Outcome::Skipped),
                }
            }
        };
        let journal = self.node_journal();
        let mut record = match journal.load(volume_id) {
            Ok(Some(record)) => record,
            Ok(None) => {
                journal.clear_pending(volume_id)?;
                return Ok(Outcome::Healthy);
            }
            Err(e @ JournalError::Corrupt { .. }) => {
                // Without the record the paths are unknown; the next Attach or Detach of the
                // volume rebuilds it from what Cube sends.
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        let mounted = self.visibility(&record.target_path, &deadline).await?;

        if self.is_from_earlier_boot(&record) {
            if mounted == Visibility::Mounted {
                tracing::warn!(
                    target = %record.target_path.display(),
                    "record from an earlier boot is still mounted; left for its Detach"
                );
                return Ok(Outcome::Healthy);
            }
            tracing::info!(
                holders = ?record.holders,
                "tearing down an attachment from an earlier boot (its sandboxes died with it)"
            );
            self.teardown(HookKind::Detach, &mut record, &deadline)
                .await?;
            return Ok(Outcome::EarlierBoot);
        }

        if !record.is_held() && record.holders_unknown && mounted != Visibility::NotMounted {
            tracing::warn!(
                target = %record.target_path.display(),
                "a volume whose holders are unknown (its journal record was lost) stays \
                 mounted: another namespace may use it; once none does, release it with \
                 `cube-csi-bridge holders release`"
            );
            journal.clear_pending(volume_id)?;
            return Ok(Outcome::HoldersUnknown);
        }

        if !record.is_held() {
            tracing::info!("rolling back an attach or detach that never finished");
            self.teardown(HookKind::Detach, &mut record, &deadline)
                .await?;
            return Ok(Outcome::RolledBack);
        }

        if record.is_settled() && mounted != Visibility::NotMounted {
            journal.clear_pending(volume_id)?;
            return Ok(Outcome::Healthy);
        }

        tracing::warn!(
            target = %record.target_path.display(),
            holders = ?record.holders,
            "held volume is not mounted (or its steps are uncertain); re-establishing it"
        );
        let handle = VolumeHandle {
            csi_volume_id: record.csi_volume_id.clone(),
            volume_context: record.volume_context.clone(),
            controller_publish: record.controller_publish != Step::Absent,
            topology: record.accessible_topology.clone(),
        };
        let paths = VolumePaths::from_target(&record.target_path, &self.config.driver, volume_id)
            .map_err(BridgeError::Precondition)?;
        // Marked first: a repair that fails (the driver still starting), or is cut short,
        // is tried again by the next scan of pending volumes rather than only by the next
        // start-up or Attach. A marker that cannot be made (a disk out of inodes) only
        // loses that retry: the repair is still tried.
        if let Err(error) = journal.mark_pending(volume_id) {
            tracing::warn!(%error, "could not mark the repair pending; repairing anyway");
        }
        // Cubelet makes the base dir before an Attach, and Attach checks it: here nobody
        // has, and establish expects it made.
        let repaired = match self.check_base_dir(&paths, &deadline).await {
            Ok(()) => {
                self.establish(
                    HookKind::Attach,
                    &mut record,
                    &handle,
                    &paths,
                    &deadline,
                    &Caller::waiting(),
                )
                .await
            }
            Err(error) => Err(error),
        };
        match repaired {
            Ok(()) => {
                self.node_journal().save(&record, false)?;
                journal.clear_pending(volume_id)?;
                Ok(Outcome::Repaired)
            }
            Err(error) => {
                tracing::error!(%error, "re-establishing a held volume failed; the next scan (or Attach) tries again");
                self.node_journal().save(&record, false)?;
                Ok(Outcome::MountLost)
            }
        }
    }
}
