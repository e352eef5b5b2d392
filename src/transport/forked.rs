//! The binary hook: one hook per process, as Cubelet and CubeMaster fork it. stdout gets
//! exactly one JSON object; logs go to stderr; the exit code is 0 only on success.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use nix::fcntl::Flock;

use crate::bridge::reconcile::Scope;
use crate::bridge::{BridgeError, Caller, HookError, HookKind};
use crate::config::{Config, Roles};
use crate::cube::errors;
use crate::cube::hooks;
pub use crate::cube::hooks::HookRequest;
use crate::mount::MountView;

/// The outcome of a forked hook: what to print on stdout, and whether it succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookOutput {
    pub stdout: String,
    pub success: bool,
}

impl HookOutput {
    pub fn failure(message: &str) -> Self {
        Self {
            stdout: errors::message_json(message),
            success: false,
        }
    }
}

/// Answers a node hook on the hot path (a mounted volume's Attach, a Detach that leaves
/// holders), where the only change is one line of the holder log: then the process Cube
/// started answers by itself, without forking a worker. (If Cube kills it after the line is
/// written and before it answers, the holder stays recorded for a sandbox Cube considers
/// failed; the window is the print of one line, and the holder goes with the namespace's
/// next Detach at ref_count 0.) `None`: the full hook must run (see transport::worker). Bad
/// requests are answered here too (they change nothing).
pub async fn answer_if_hot(config: &Config, request: &HookRequest) -> Option<HookOutput> {
    use crate::config::MountViewSetting;
    if !request.kind().is_node() {
        return None;
    }
    let checked = match hooks::check(request.clone(), config) {
        Ok(checked) => checked,
        Err(error) => return Some(failure(&error)),
    };
    // Every forked node hook comes here first, so this is where an Attach's paths are
    // checked before anything opens the bridge's state.
    if let Err(error) = check_paths_first(config, &checked) {
        return Some(failure(&error));
    }
    // Only mount views checked by plain reads in this process: nothing here may start a
    // thread, since the worker is forked afterwards.
    if matches!(config.node.mount_view, MountViewSetting::Namespace(_)) {
        return None;
    }
    let mounts = Arc::new(MountView::new(&config.node.mount_view, true));
    // No driver or Kubernetes client: the hot path makes no call to either, and the
    // forked hook's front executable links neither (see transport::front).
    let bridge = crate::app::open_hot_node(config, mounts).ok()?;
    // Work an earlier, killed hook left behind is finished by a worker after it answers.
    if pending_work_blocks(
        &bridge.node().ok()?.node_journal().pending_since().ok()?,
        request.volume_id(),
        SystemTime::now(),
    ) {
        return None;
    }
    Some(match hooks::run_if_hot(&bridge, &checked).await? {
        Ok(reply) => HookOutput {
            stdout: reply.json().to_string(),
            success: true,
        },
        Err(error) => failure(&error),
    })
}

/// An Attach's paths, checked before the bridge's state is opened (which makes its
/// directories): paths another user has steered are refused without a trace.
fn check_paths_first(config: &Config, checked: &hooks::Checked) -> Result<(), HookError> {
    match checked {
        hooks::Checked::Attach(req) => crate::bridge::node::check_attach_paths_first(
            &crate::app::host_dirs(config),
            &config.driver,
            req,
        ),
        _ => Ok(()),
    }
}

/// The front's undo when its worker died without answering: Cube counts the hook failed.
/// It will never Detach this sandbox, so the holder an Attach's worker may already have
/// saved is withdrawn (the volume torn down if no holder is left); and CubeMaster will
/// never Destroy a volume it was not told of, so one a Create's worker finished since
/// `started_secs` (the front's start, seconds since the epoch) is deleted. A worker that
/// died before saving either left none, and the rest of its work is the abandoned-work
/// scan's or the sweep's.
pub async fn withdraw_unanswered(config: &Config, request: &HookRequest, started_secs: u64) {
    let open = |roles| {
        let mounts = Arc::new(MountView::new(&config.node.mount_view, true));
        crate::app::open_bridge(Arc::new(config.clone()), roles, mounts).ok()
    };
    match request {
        HookRequest::Attach(attach) => {
            let Some(bridge) = open(Roles::NODE) else {
                return;
            };
            let Ok(node) = bridge.node() else {
                return;
            };
            let which = crate::bridge::Release::Sandbox {
                namespace: attach.namespace.clone(),
                sandbox: attach.sandbox_id.clone(),
            };
            match node.release_holders(&attach.volume_id, &which).await {
                Ok(released) => tracing::warn!(
                    volume_id = %attach.volume_id,
                    torn_down = released.torn_down,
                    "the worker died without answering after saving its holder; holder withdrawn"
                ),
                // No record, or no such holder: one the worker never saved, nothing to
                // take back.
                Err(BridgeError::InvalidRequest(_)) => {}
                // Anything else (the lock held past its wait, the journal unreadable) may
                // leave a holder Cube released, the volume mounted for nobody: said, with
                // what to do.
                Err(error) => tracing::error!(
                    volume_id = %attach.volume_id,
                    namespace = %attach.namespace,
                    sandbox_id = %attach.sandbox_id,
                    %error,
                    "the worker died without answering, and its holder could not be withdrawn; \
                     if `cube-csi-bridge holders` lists it, release it with `cube-csi-bridge \
                     holders release`"
                ),
            }
        }
        HookRequest::Create(create) => {
            let Some(bridge) = open(Roles::CONTROLLER) else {
                return;
            };
            let Ok(controller) = bridge.controller() else {
                return;
            };
            match controller
                .withdraw_unanswered_create(&create.volume_id, started_secs)
                .await
            {
                Ok(true) => tracing::warn!(
                    volume_id = %create.volume_id,
                    "the worker died without answering after the volume was created; volume deleted"
                ),
                Ok(false) => {}
                Err(error) => tracing::error!(
                    volume_id = %create.volume_id,
                    %error,
                    "the worker died without answering after the volume was created, and \
                     deleting it failed; `cube-csi-bridge list --controller` shows it"
                ),
            }
        }
        _ => {}
    }
}

/// How long a marker of another volume sends every node hook to a worker (which finishes
/// the marked work after answering). Past that the marked work is one that could not be
/// finished (a failed repair, an unreadable record): it is retried by every hook that
/// forks anyway, and no longer costs the hot paths of all the other volumes.
const RECENT_PENDING: Duration = Duration::from_secs(300);

/// Whether marked work must be finished before this hook may take its hot path: work on
/// its own volume always; another volume's while it is recent.
fn pending_work_blocks(
    pending: &[(String, Option<SystemTime>)],
    volume_id: &str,
    now: SystemTime,
) -> bool {
    pending.iter().any(|(volume, marked)| {
        volume == volume_id
            || marked.is_none_or(|at| now.duration_since(at).unwrap_or_default() < RECENT_PENDING)
    })
}

/// Set when the process was asked to stop (a signal): no abandoned-work pass is begun.
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Asks the hook running in this process to begin nothing after its answer.
pub(crate) fn stop_after_answer() {
    STOPPING.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// What a forked hook does once its answer is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterAnswer {
    /// Sweeps abandoned Creates and finishes node operations an earlier, killed hook
    /// abandoned: a worker, whose front has the answer already.
    FinishAbandonedWork,
    /// Nothing: a hook run in place, whose answer is printed only when `run` returns (and
    /// counted by Cube only once the process exits). Work done before that would hold the
    /// answer back, and Cube's kill there would leave a holder or a volume it counted
    /// failed.
    Return,
}

/// Runs one hook with a bridge opened for just that hook's role. `answered` receives the
/// output as soon as it is known; what follows (`after`) no longer concerns the caller.
pub async fn run(
    config: Config,
    request: HookRequest,
    caller: &Caller,
    after: AfterAnswer,
    answered: impl FnOnce(HookOutput),
) {
    let (kind, volume_id) = (request.kind(), request.volume_id().to_string());
    let roles = if kind.is_node() {
        Roles::NODE
    } else {
        Roles::CONTROLLER
    };
    // Checked before the bridge opens its state: a bad request leaves no trace. (An
    // Attach's paths were checked by `answer_if_hot`, which every forked hook runs first.)
    let checked = match hooks::check(request, &config) {
        Ok(checked) => checked,
        Err(error) => return answered(failure(&error)),
    };
    // Cubelet forks the hook inside its own mount namespace.
    let mounts = Arc::new(MountView::new(&config.node.mount_view, true));
    let config = Arc::new(config);
    let bridge = match crate::app::open_bridge(config.clone(), roles, mounts) {
        Ok(b) => b,
        Err(error) => {
            answered(HookOutput::failure(&format!(
                "{kind} of volume {}: cannot open the bridge's state: {error}",
                crate::bridge::naming::quote_volume_id(&volume_id)
            )));
            return;
        }
    };
    let output = match hooks::run(&bridge, checked, caller).await {
        Ok(reply) => HookOutput {
            stdout: reply.json().to_string(),
            success: true,
        },
        Err(error) => failure(&error),
    };
    let failed_detach = kind == HookKind::Detach && !output.success;
    answered(output);
    if after == AfterAnswer::Return || STOPPING.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    if let Ok(controller) = &bridge.controller {
        sweep_if_due(controller, &config).await;
    }
    if let Ok(node) = &bridge.node {
        // A failed Detach is Cube's to retry (it keeps the volume attached until then); a
        // failed Attach is not (Cube never Detaches it), so its leftovers are finished here.
        let scope = if failed_detach {
            Scope::AbandonedBesides(&volume_id)
        } else {
            Scope::Abandoned
        };
        match node.reconcile_node(scope).await {
            Ok(report) if !report.is_empty() => {
                tracing::info!(
                    ?report,
                    "finished node operations an earlier hook abandoned"
                )
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "scanning for abandoned node operations failed"),
        }
    }
}

fn failure(error: &HookError) -> HookOutput {
    HookOutput {
        stdout: errors::to_json(error),
        success: false,
    }
}

/// Forked controller hooks are the only controller code a binary-only deployment runs, so
/// after answering they also sweep abandoned Creates — at most once per
/// `controller.sweep_interval_secs` across all processes (a stamp file, flocked, in the
/// state dir), so that Cube's Creates do not each pay for it.
async fn sweep_if_due(controller: &crate::bridge::ControllerSide, config: &Config) {
    let Some(interval) = config.controller.sweep_interval else {
        return;
    };
    let Some(_turn) = sweep_turn(&config.state.dir, interval) else {
        return;
    };
    match controller
        .sweep_abandoned_creates(config.controller.abandoned_create_after)
        .await
    {
        Ok(report) if report.reclaimed + report.failed > 0 => {
            tracing::info!(?report, "abandoned creates swept")
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "sweeping abandoned creates failed"),
    }
}

/// Takes this process's turn to sweep if the stamp in `dir` is older than `interval`: the
/// flock on the stamp, held while sweeping, with the stamp set to now.
fn sweep_turn(dir: &Path, interval: Duration) -> Option<Flock<File>> {
    let stamp = dir.join("last-sweep");
    if !stamp_due(&stamp, interval) {
        return None;
    }
    // A CubeMaster host with only controller hooks and the Kubernetes store may have no
    // state dir yet.
    if let Err(error) = crate::mount::ops::ensure_dir(dir, 0o700) {
        tracing::warn!(%error, "not sweeping abandoned creates");
        return None;
    }
    take_turn(&stamp, interval)
}

/// Whether the stamp is older than `interval` (or missing).
fn stamp_due(stamp: &Path, interval: Duration) -> bool {
    std::fs::metadata(stamp)
        .and_then(|m| m.modified())
        .map_or(true, |at| at.elapsed().map_or(true, |age| age >= interval))
}

/// Locks the stamp and, if it is still due, sets it to now.
fn take_turn(stamp: &Path, interval: Duration) -> Option<Flock<File>> {
    // A stamp made here must read as never swept, not as swept just now.
    match File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(stamp)
    {
        Ok(file) => {
            if let Err(error) = file.set_modified(SystemTime::UNIX_EPOCH) {
                tracing::warn!(stamp = %stamp.display(), %error, "cannot reset the sweep stamp");
            }
        }
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(error) => {
            tracing::warn!(stamp = %stamp.display(), %error, "not sweeping abandoned creates");
            return None;
        }
    }
    let turn = match crate::store::fsutil::try_lock_exclusive(stamp) {
        Ok(Some(turn)) => turn,
        Ok(None) => return None,
        Err(error) => {
            tracing::warn!(stamp = %stamp.display(), %error, "not sweeping abandoned creates");
            return None;
        }
    };
    // Another process may have swept between the first look and the lock.
    if !stamp_due(stamp, interval) {
        return None;
    }
    // Stamped before sweeping: another process that finds the lock free meanwhile waits
    // for the next interval rather than sweeping the same records again.
    if let Err(error) = turn.set_modified(SystemTime::now()) {
        tracing::warn!(stamp = %stamp.display(), %error, "cannot update the sweep stamp");
    }
    Some(turn)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn only_recent_or_own_pending_work_keeps_a_hook_off_its_hot_path() {
        let now = SystemTime::now();
        let old = Some(now - Duration::from_secs(3600));
        let recent = Some(now - Duration::from_secs(5));
        let marks = |list: &[(&str, Option<SystemTime>)]| -> Vec<(String, Option<SystemTime>)> {
            list.iter().map(|(v, t)| (v.to_string(), *t)).collect()
        };
        assert!(!pending_work_blocks(&[], "v", now));
        // A stuck marker of another volume no longer slows every hook down.
        assert!(!pending_work_blocks(&marks(&[("stuck", old)]), "v", now));
        // Recent work of another volume, or any of this one, is finished first.
        assert!(pending_work_blocks(&marks(&[("other", recent)]), "v", now));
        assert!(pending_work_blocks(&marks(&[("v", old)]), "v", now));
        assert!(pending_work_blocks(&marks(&[("other", None)]), "v", now));
    }

    /// A CubeMaster host with only Create/Destroy hooks and the Kubernetes store has no
    /// state dir until the sweep makes it.
    #[test]
    fn the_sweep_takes_its_turn_when_the_state_dir_does_not_exist_yet() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("var/lib/cube-csi-bridge");
        let interval = Duration::from_secs(60);
        let turn = sweep_turn(&dir, interval);
        assert!(turn.is_some(), "no turn taken");
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        drop(turn);
        assert!(
            sweep_turn(&dir, interval).is_none(),
            "stamped: not due again"
        );
    }

    #[tokio::test]
    async fn a_bridge_that_cannot_open_is_named_with_the_hook_and_volume() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-a-dir");
        std::fs::write(&file, b"").unwrap();
        let text = format!(
            "driver = \"nfs\"\n[csi]\nendpoint = \"unix:///run/csi/nfs.sock\"\n\
             [state]\ndir = \"{}\"\n",
            file.join("state").display()
        );
        let config = Config::parse(&text, Path::new("/etc/test.toml")).unwrap();
        let request = HookRequest::Destroy(crate::proto::cube::v1::DestroyRequest {
            volume_id: "vol-7".into(),
        });
        let mut output = None;
        run(
            config,
            request,
            &Caller::waiting(),
            AfterAnswer::Return,
            |o| output = Some(o),
        )
        .await;
        let output = output.unwrap();
        assert!(!output.success);
        assert!(
            output
                .stdout
                .contains("destroy of volume \\\"vol-7\\\": cannot open the bridge's state"),
            "{}",
            output.stdout
        );
    }

    /// Another process swept between this one's first look and its lock.
    #[test]
    fn a_sweep_done_meanwhile_is_not_repeated() {
        let tmp = tempfile::tempdir().unwrap();
        let stamp = tmp.path().join("last-sweep");
        std::fs::write(&stamp, b"").unwrap();
        assert!(take_turn(&stamp, Duration::from_secs(60)).is_none());
        assert!(take_turn(&stamp, Duration::ZERO).is_some());
    }
}
