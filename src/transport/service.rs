//! The gRPC services Cube dials: VolumeControllerService (CubeMaster) and
//! VolumePluginService (Cubelet).
//!
//! A hot Attach or Detach (the volume mounted, other holders left) is answered in the
//! handler itself (`run`). Every other hook runs as its own task, tracked for the drain
//! on shutdown, so that it finishes (or undoes its work) even when the caller's deadline
//! fires and tonic drops the handler: dropping the handler only tells the hook that its
//! caller is gone. An
//! Attach's or a Create's answer is handed to the handler while the hook still holds the
//! volume, and counts only if the handler took it (see `ToHandler`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status};

use crate::bridge::{Answer, Bridge, Caller, Delivery};
use crate::config::Config;
use crate::cube::errors::to_status;
use crate::cube::hooks::{self, Attach, Create, Destroy, Detach, HookReply, HookRequest, Listed};
use crate::proto::cube::v1 as pb;
use pb::volume_controller_service_server::VolumeControllerService;
use pb::volume_plugin_service_server::VolumePluginService;

/// An answer handed to the rpc handler, with the handler's word that it took it.
type Handed = (HookReply, oneshot::Sender<()>);

/// The rpc side of `Delivery`: the core hands an Attach's or a Create's answer to the
/// handler, and it reached Cube as far as the daemon can tell once the handler took it.
/// A handler already dropped (the caller's deadline passed, the stream was reset) never
/// takes it, and the hook undoes what it reported instead of keeping a holder or a volume
/// for a caller that was answered an error.
struct ToHandler(tokio::sync::Mutex<Handoff>);

enum Handoff {
    Waiting(oneshot::Sender<Handed>),
    /// Delivered once (taken or not); a second delivery gets the same verdict.
    Done(bool),
}

impl Delivery for ToHandler {
    fn deliver(&self, answer: Answer) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        Box::pin(async move {
            let mut handoff = self.0.lock().await;
            let to_handler = match std::mem::replace(&mut *handoff, Handoff::Done(false)) {
                Handoff::Done(taken) => {
                    *handoff = Handoff::Done(taken);
                    return taken;
                }
                Handoff::Waiting(to_handler) => to_handler,
            };
            let (taken_tx, taken_rx) = oneshot::channel();
            let taken = to_handler
                .send((hooks::answer_reply(&answer), taken_tx))
                .is_ok()
                && taken_rx.await.is_ok();
            *handoff = Handoff::Done(taken);
            taken
        })
    }
}

/// Both Cube services over one bridge.
#[derive(Debug, Clone)]
pub struct CubeService {
    bridge: Arc<Bridge>,
    config: Arc<Config>,
    tasks: TaskTracker,
}

impl CubeService {
    /// `tasks` tracks every hook, so that shutdown can wait for them.
    pub fn new(bridge: Arc<Bridge>, config: Arc<Config>, tasks: TaskTracker) -> Self {
        Self {
            bridge,
            config,
            tasks,
        }
    }

    async fn run(&self, request: HookRequest) -> Result<HookReply, Status> {
        let checked = hooks::check(request, &self.config).map_err(|e| to_status(&e))?;
        // A hot Attach or Detach is answered here, in the handler, with no task and no
        // handoff: it changes at most one line of the holder log, and nothing is awaited
        // after that line is written. A caller that goes away before then drops this
        // future before anything changed; once it is written, the answer is returned in
        // the same poll, as a handed-over answer is.
        if let Some(result) = hooks::run_if_hot(&self.bridge, &checked).await {
            return result.map_err(|e| to_status(&e));
        }
        let (to_handler, mut handed) = oneshot::channel();
        let caller = Caller::confirming(Arc::new(ToHandler(tokio::sync::Mutex::new(
            Handoff::Waiting(to_handler),
        ))));
        let left = caller.leave_on_drop();
        let bridge = self.bridge.clone();
        let hook_caller = caller.clone();
        let mut task = self
            .tasks
            .spawn(async move { hooks::run(&bridge, checked, &hook_caller).await });
        let result = tokio::select! {
            biased;
            Ok((reply, taken)) = &mut handed => {
                // Taken and returned to tonic in this one poll: once the hook hears that it
                // was taken, the reply is tonic's to write, and no deadline can turn it into
                // an error any more. The hook finishes on its own (tracked for the drain).
                let _ = taken.send(());
                left.disarm();
                return Ok(reply);
            }
            joined = &mut task => match joined {
                Ok(result) => result,
                Err(join) => std::panic::resume_unwind(join.into_panic()),
            },
        };
        left.disarm();
        result.map_err(|e| to_status(&e))
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
