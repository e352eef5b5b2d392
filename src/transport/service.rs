//! The gRPC services Cube dials: VolumeControllerService (CubeMaster) and
//! VolumePluginService (Cubelet).
//!
//! A hot Attach or Detach (the volume mounted, other holders left) is answered in the
//! handler itself (`run`). Every other hook runs in the handler's poll too, until it
//! answers; what is left of it then, or when tonic drops the handler (the caller's
//! deadline fired), runs on as a task of its own, tracked for the drain on shutdown, so
//! that it finishes (or undoes its work): dropping the handler only tells the hook that
//! its caller is gone (`InlineHook`). An Attach's or a Create's answer is handed to the
//! handler while the hook still holds the volume, and counts only if the handler took it
//! (see `InHandler`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio_util::task::{TaskTracker, task_tracker::TaskTrackerToken};
use tonic::{Request, Response, Status};

use crate::bridge::ports::KeptLock;
use crate::bridge::{Answer, Bridge, Caller, Delivery, HookError, HookKind, LeaveOnDrop};
use crate::config::Config;
use crate::cube::errors::to_status;
use crate::cube::hooks::{self, Attach, Create, Destroy, Detach, HookReply, HookRequest, Listed};
use crate::proto::cube::v1 as pb;
use crate::transport::live::LiveBridge;
use pb::volume_controller_service_server::VolumeControllerService;
use pb::volume_plugin_service_server::VolumePluginService;

/// What a hook the handler runs has done with its answer (`InHandler`).
enum Slot {
    /// Nothing delivered yet, and the handler is still there.
    Waiting,
    /// Delivered in the handler's poll; the handler returns it before that poll ends.
    Handed(HookReply),
    /// Delivered once (taken or not), or the handler is gone: a later delivery gets this
    /// verdict.
    Done(bool),
}

/// The rpc side of `Delivery`: the core hands an Attach's or a Create's answer to the
/// handler, and it reached Cube as far as the daemon can tell once the handler took it.
/// The hook runs inside the handler's poll (`InlineHook`) until the handler returns or is
/// dropped, so an answer delivered while the slot is `Waiting` is delivered in that poll,
/// and the handler returns it before the poll ends: nothing can drop the handler in
/// between. A handler already dropped (the caller's deadline passed, the stream was
/// reset) has set `Done(false)`, and the hook undoes what it reported instead of keeping
/// a holder or a volume for a caller that was answered an error.
struct InHandler(std::sync::Mutex<Slot>);

impl InHandler {
    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        // No code panics while holding it; a poisoned slot still holds a valid state.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The answer delivered in the poll that just ended, now taken.
    fn take_handed(&self) -> Option<HookReply> {
        let mut slot = self.slot();
        match std::mem::replace(&mut *slot, Slot::Done(true)) {
            Slot::Handed(reply) => Some(reply),
            other => {
                *slot = other;
                None
            }
        }
    }

    /// The handler is gone: no answer is taken any more.
    fn refuse(&self) {
        let mut slot = self.slot();
        if matches!(*slot, Slot::Waiting) {
            *slot = Slot::Done(false);
        }
    }
}

impl Delivery for InHandler {
    fn deliver(&self, answer: Answer) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        let taken = {
            let mut slot = self.slot();
            match &*slot {
                Slot::Waiting => {
                    *slot = Slot::Handed(hooks::answer_reply(&answer));
                    true
                }
                Slot::Handed(_) => true,
                Slot::Done(taken) => *taken,
            }
        };
        Box::pin(std::future::ready(taken))
    }
}

type HookFuture = Pin<Box<dyn Future<Output = Result<HookReply, HookError>> + Send>>;

/// A hook run in the rpc handler's own poll, with no task of its own and no hand-off
/// between threads on the way to the answer (issue 20: a spawned task and two oneshot
/// wake-ups per cold hook). What is left of it once the handler no longer waits for it
/// (the answer was taken, or the handler was dropped) is spawned, tracked for the drain
/// on shutdown like every hook: a hook always runs to completion, or to its undo.
struct InlineHook {
    /// None once it completed (or panicked in a poll: never polled again).
    hook: Option<HookFuture>,
    handoff: Arc<InHandler>,
    left: Option<LeaveOnDrop>,
    tasks: TaskTracker,
    runtime: tokio::runtime::Handle,
    /// Counts this hook in `tasks` while the handler runs it.
    _tracked: TaskTrackerToken,
}

impl InlineHook {
    /// The hook `make` builds for the caller it is given, run by the handler; that
    /// caller, which confirms a delivery only while this handler takes it, is returned
    /// too. Must be made on the runtime that serves the handler.
    fn new(tasks: &TaskTracker, make: impl FnOnce(Caller) -> HookFuture) -> (Self, Caller) {
        let handoff = Arc::new(InHandler(std::sync::Mutex::new(Slot::Waiting)));
        let caller = Caller::confirming(handoff.clone());
        let hook = Self {
            hook: Some(make(caller.clone())),
            handoff,
            left: Some(caller.leave_on_drop()),
            tasks: tasks.clone(),
            runtime: tokio::runtime::Handle::current(),
            _tracked: tasks.token(),
        };
        (hook, caller)
    }

    /// The caller was answered: it did not leave.
    fn disarm(&mut self) {
        if let Some(left) = self.left.take() {
            left.disarm();
        }
    }

    /// Spawns what is left of the hook, if anything.
    fn finish_elsewhere(&mut self) {
        if let Some(hook) = self.hook.take() {
            self.tasks.spawn_on(
                async move {
                    // Its outcome is logged and counted by the hook itself.
                    let _ = hook.await;
                },
                &self.runtime,
            );
        }
    }
}

impl Future for InlineHook {
    type Output = Result<HookReply, HookError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(mut hook) = this.hook.take() else {
            unreachable!("an InlineHook is not polled after it answered")
        };
        let polled = hook.as_mut().poll(cx);
        if polled.is_pending() {
            this.hook = Some(hook);
        }
        // Taken and returned to tonic in this one poll: once the hook hears that it was
        // taken, the reply is tonic's to write, and no deadline can turn it into an error
        // any more. The hook finishes on its own.
        if let Some(reply) = this.handoff.take_handed() {
            this.finish_elsewhere();
            this.disarm();
            return Poll::Ready(Ok(reply));
        }
        if polled.is_ready() {
            this.disarm();
        }
        polled
    }
}

impl Drop for InlineHook {
    /// The handler was dropped before the hook answered: its caller is gone (the hook
    /// hears it before its next step), and the hook goes on in a task of its own.
    fn drop(&mut self) {
        if self.hook.is_some() {
            self.handoff.refuse();
            drop(self.left.take());
            self.finish_elsewhere();
        }
    }
}

/// A hot Attach whose caller went away while it checked the mount (a hung filesystem's
/// stat outlasting Cube's deadline): Cube counts the Attach failed and releases the
/// sandbox, also one that held the volume before, and never Detaches it. Dropped armed,
/// it runs the full Attach in a task with its caller gone, which takes over the volume's
/// lock the check kept and releases the sandbox as Cube did (`NodeSide::attach_holding`;
/// a check cancelled before it took the lock releases only its own sandbox). Other hooks need nothing:
/// nothing is awaited after a hot hook's one write, and a failed Detach Cube retries.
///
/// The hot check leaves the volume's lock in `kept` while it awaits, and the full Attach
/// takes it over from there: no hook that came meanwhile runs between them. (Before, the
/// lock was released with the dropped check, and Cube's next Attach of the namespace
/// could be recorded first, with the release then working from this Attach's stale
/// `ref_count`: it removed the namespace's holders, the new one among them.)
struct ReleaseIfCancelled {
    armed: Option<(Arc<Bridge>, hooks::Checked, TaskTracker)>,
    kept: KeptLock,
    runtime: tokio::runtime::Handle,
}

impl ReleaseIfCancelled {
    fn arm(service: &CubeService, bridge: &Arc<Bridge>, checked: &hooks::Checked) -> Self {
        let armed = matches!(checked, hooks::Checked::Attach(_))
            .then(|| (bridge.clone(), checked.clone(), service.tasks.clone()));
        Self {
            armed,
            kept: KeptLock::default(),
            runtime: tokio::runtime::Handle::current(),
        }
    }

    /// The hot check, leaving the lock where a cancellation finds it.
    async fn run_if_hot(
        &self,
        bridge: &Bridge,
        checked: &hooks::Checked,
    ) -> Option<Result<HookReply, HookError>> {
        match checked {
            hooks::Checked::Attach(req) => Some(
                bridge
                    .attach_if_hot_keeping(req, &self.kept)
                    .await?
                    .map(|attached| HookReply::Attach(hooks::attach_reply(attached))),
            ),
            _ => hooks::run_if_hot(bridge, checked).await,
        }
    }

    /// The hot check answered, or declined: the handler goes on, and answers.
    fn disarm(&mut self) {
        self.armed = None;
    }
}

impl Drop for ReleaseIfCancelled {
    fn drop(&mut self) {
        if let Some((bridge, checked, tasks)) = self.armed.take() {
            let kept = self.kept.take();
            tasks.spawn_on(
                async move {
                    let caller = Caller::waiting();
                    caller.leave();
                    // Its outcome is logged and counted by the hook itself.
                    let _ = match (checked, kept) {
                        (hooks::Checked::Attach(req), Some(guard)) => {
                            bridge.attach_holding(req, &caller, guard).await.map(drop)
                        }
                        (checked, _) => hooks::run(&bridge, checked, &caller).await.map(drop),
                    };
                },
                &self.runtime,
            );
        }
    }
}

/// How often a hook of a role that is down may try to open it again (besides the
/// daemon's own attempts): often enough that a fixed disk serves at Cube's next hooks,
/// rarely enough that a burst of them does not open the state each time.
const REOPEN_SPACING: Duration = Duration::from_secs(5);
/// How long such a hook waits for the attempt it started.
const REOPEN_WAIT: Duration = Duration::from_secs(1);

/// Both Cube services over one bridge.
#[derive(Debug, Clone)]
pub struct CubeService {
    bridge: Arc<LiveBridge>,
    config: Arc<Config>,
    tasks: TaskTracker,
}

impl CubeService {
    /// `tasks` tracks every hook, so that shutdown can wait for them.
    pub fn new(bridge: Arc<Bridge>, config: Arc<Config>, tasks: TaskTracker) -> Self {
        Self::live(Arc::new(LiveBridge::fixed(bridge)), config, tasks)
    }

    /// Over a bridge whose roles that are down are tried again.
    pub fn live(bridge: Arc<LiveBridge>, config: Arc<Config>, tasks: TaskTracker) -> Self {
        Self {
            bridge,
            config,
            tasks,
        }
    }

    /// The bridge a hook of `kind` runs on: its role, if down, tried again first when due.
    async fn bridge_for(&self, kind: HookKind) -> Arc<Bridge> {
        let bridge = self.bridge.current();
        let down = if kind.is_node() {
            bridge.node.is_err()
        } else {
            bridge.controller.is_err()
        };
        if !down {
            return bridge;
        }
        // A quick attempt serves this very hook; a slow one goes on without it.
        if let Some(attempt) = self.bridge.reopen_if_due(REOPEN_SPACING) {
            let _ = tokio::time::timeout(REOPEN_WAIT, attempt).await;
        }
        self.bridge.current()
    }

    async fn run(&self, request: HookRequest) -> Result<HookReply, Status> {
        let kind = request.kind();
        let checked = hooks::check(request, &self.config).map_err(|e| to_status(&e))?;
        let bridge = self.bridge_for(kind).await;
        // A hot Attach or Detach is answered here, in the handler, with no task and no
        // handoff: it changes at most one line of the holder log, and nothing is awaited
        // after that line is written. A caller that goes away before then drops this
        // future before anything changed; once it is written, the answer is returned in
        // the same poll, as a handed-over answer is.
        let mut cancelled = ReleaseIfCancelled::arm(self, &bridge, &checked);
        let hot = cancelled.run_if_hot(&bridge, &checked).await;
        cancelled.disarm();
        if let Some(result) = hot {
            return result.map_err(|e| to_status(&e));
        }
        let (hook, _) = InlineHook::new(&self.tasks, |caller| {
            Box::pin(async move { hooks::run(&bridge, checked, &caller).await })
        });
        hook.await.map_err(|e| to_status(&e))
    }

    /// Serves one hook of the table (`cube::hooks`).
    async fn serve<H: Listed>(
        &self,
        request: Request<H::Request>,
    ) -> Result<Response<H::Reply>, Status> {
        let reply = self.run(H::request(request.into_inner())).await?;
        let reply = H::reply(reply)
            .unwrap_or_else(|| unreachable!("hooks::run answers a {} with its own reply", H::KIND));
        Ok(Response::new(reply))
    }
}

#[tonic::async_trait]
impl VolumeControllerService for CubeService {
    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::CreateResponse>, Status> {
        self.serve::<Create>(request).await
    }

    async fn destroy(
        &self,
        request: Request<pb::DestroyRequest>,
    ) -> Result<Response<pb::DestroyResponse>, Status> {
        self.serve::<Destroy>(request).await
    }
}

#[tonic::async_trait]
impl VolumePluginService for CubeService {
    async fn attach(
        &self,
        request: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachResponse>, Status> {
        self.serve::<Attach>(request).await
    }

    async fn detach(
        &self,
        request: Request<pb::DetachRequest>,
    ) -> Result<Response<pb::DetachResponse>, Status> {
        self.serve::<Detach>(request).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::oneshot;

    use super::*;
    use crate::bridge::Created;

    fn created() -> Answer {
        Answer::Created(Created {
            token: "t".into(),
            private_data: "p".into(),
        })
    }

    /// A handler dropped before its hook answers (the caller's deadline fired) leaves the
    /// hook running in a task the drain waits for; the hook hears that its caller is gone
    /// and that its answer was not taken, so it undoes instead of keeping what it did.
    #[tokio::test]
    async fn a_dropped_handler_leaves_its_hook_running_and_refuses_the_answer() {
        let tasks = TaskTracker::new();
        let (go, wait) = oneshot::channel::<()>();
        let (heard, hears) = oneshot::channel();
        let (hook, caller) = InlineHook::new(&tasks, |hook_caller| {
            Box::pin(async move {
                wait.await.unwrap();
                let gone = hook_caller.is_gone();
                let answer = created();
                let taken = hook_caller.deliver(answer.clone()).await;
                heard.send((gone, taken)).unwrap();
                Ok(hooks::answer_reply(&answer))
            })
        });
        let handler = tokio::time::timeout(Duration::from_millis(20), hook).await;
        assert!(handler.is_err(), "the hook waits: the handler times out");
        assert!(caller.is_gone());
        tasks.close();
        assert_eq!(
            tasks.len(),
            1,
            "the rest of the hook is tracked for the drain"
        );
        go.send(()).unwrap();
        assert_eq!(hears.await.unwrap(), (true, false));
        tasks.wait().await;
    }

    /// An answer delivered in the handler's poll is returned by that poll, while the hook
    /// goes on (its lock released, its marker cleared) in a tracked task; the caller was
    /// answered, so it is not gone, and a second delivery gets the same verdict.
    #[tokio::test]
    async fn an_answer_is_returned_at_once_and_the_hook_finishes_on_its_own() {
        let tasks = TaskTracker::new();
        let (go, wait) = oneshot::channel::<()>();
        let (heard, hears) = oneshot::channel();
        let (hook, caller) = InlineHook::new(&tasks, |hook_caller| {
            Box::pin(async move {
                let answer = created();
                let first = hook_caller.deliver(answer.clone()).await;
                wait.await.unwrap();
                let again = hook_caller.deliver(answer.clone()).await;
                heard.send((first, again)).unwrap();
                Ok(hooks::answer_reply(&answer))
            })
        });
        let reply = tokio::time::timeout(Duration::from_secs(5), hook)
            .await
            .expect("answered before the hook ended")
            .expect("the answer");
        assert!(matches!(reply, HookReply::Create(r) if r.private_data == "p"));
        assert!(!caller.is_gone());
        tasks.close();
        assert_eq!(tasks.len(), 1);
        go.send(()).unwrap();
        assert_eq!(hears.await.unwrap(), (true, true));
        tasks.wait().await;
    }

    /// A hook that ends without answering (a Detach, a failure) is returned as it ended,
    /// with nothing left to run.
    #[tokio::test]
    async fn a_hook_that_ends_in_the_handler_leaves_no_task() {
        let tasks = TaskTracker::new();
        let (hook, caller) = InlineHook::new(&tasks, |_| {
            Box::pin(async { Ok(hooks::answer_reply(&created())) })
        });
        hook.await.unwrap();
        assert!(!caller.is_gone());
        assert!(tasks.is_empty());
    }
}
