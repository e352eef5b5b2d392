//! The gRPC services Cube dials: VolumeControllerService (CubeMaster) and
//! VolumePluginService (Cubelet).
//!
//! Each hook runs as its own task, tracked for the drain on shutdown, so that it finishes
//! (or undoes its work) even when the caller's deadline fires and tonic drops the
//! handler: dropping the handler only tells the hook that its caller is gone.

use std::sync::Arc;

use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status};

use crate::bridge::{Bridge, Caller};
use crate::config::Config;
use crate::cube::errors::to_status;
use crate::cube::hooks::{self, Attach, Create, Destroy, Detach, HookReply, HookRequest, Listed};
use crate::proto::cube::v1 as pb;
use pb::volume_controller_service_server::VolumeControllerService;
use pb::volume_plugin_service_server::VolumePluginService;

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
        let caller = Caller::waiting();
        let left = caller.leave_on_drop();
        let (bridge, config) = (self.bridge.clone(), self.config.clone());
        let hook_caller = caller.clone();
        let task = self
            .tasks
            .spawn(async move { hooks::handle(&bridge, &config, request, &hook_caller).await });
        let result = match task.await {
            Ok(result) => result,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
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
