//! Start-up reconciliation of the node journal: finish what a crash interrupted.
//!
//! A record whose publish step is not Done is an Attach that never answered Cube, so
//! nobody uses it: it is torn down. A Done record whose mount is gone (host reboot) is
//! kept: the next Attach re-establishes it, or Detach cleans it up.

use tracing::Instrument;

use super::locks::LockScope;
use super::{Bridge, BridgeError};
use crate::csi::Deadline;
use crate::store::Step;

/// What reconciliation found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    pub healthy: usize,
    pub rolled_back: usize,
    pub mount_lost: usize,
    pub failed: usize,
}

impl Bridge {
    /// Walks the node journal once. Errors on single volumes are logged and counted.
    pub async fn reconcile_node(&self) -> Result<ReconcileReport, BridgeError> {
        let journal = self.journal().clone();
        let records = super::blocking(move || {
            journal.list().map_err(|e| {
                BridgeError::io(
                    format!("listing node journal {}", journal.dir().display()),
                    e,
                )
            })
        })
        .await?;
        let mut report = ReconcileReport::default();
        for record in records {
            let mut record = match record {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(error = %e, "unreadable node journal record; left in place");
                    report.failed += 1;
                    continue;
                }
            };
            let deadline = Deadline::after(self.config.timeouts.detach());
            let span = tracing::info_span!("reconcile", volume_id = %record.volume_id);
            let outcome = async {
                let _guard = self
                    .locks
                    .acquire(LockScope::Node, &record.volume_id, &deadline)
                    .await?;
                let mounted = self.visible(&record.target_path).await?;
                if record.publish == Step::Done {
                    if mounted {
                        report.healthy += 1;
                    } else {
                        tracing::warn!(
                            target = %record.target_path.display(),
                            holders = ?record.holders,
                            "attached volume is no longer mounted; the next Attach re-establishes it"
                        );
                        report.mount_lost += 1;
                    }
                    return Ok(());
                }
                tracing::info!("rolling back an attach that never completed");
                self.teardown(&mut record, &deadline).await?;
                report.rolled_back += 1;
                Ok::<_, BridgeError>(())
            };
            if let Err(error) = outcome.instrument(span).await {
                tracing::error!(%error, "reconciling failed; a later Detach or restart retries");
                report.failed += 1;
            }
        }
        Ok(report)
    }
}
