//! The gRPC services Cube dials: VolumeControllerService (CubeMaster) and
//! VolumePluginService (Cubelet).
//!
//! Each hook runs as its own task, tracked for the drain on shutdown, so that it finishes
//! (or undoes its work) even when the caller's deadline fires and tonic drops the
//! handler: dropping the handler only tells the hook that its caller is gone.

use std::future::Future;
use std::sync::Arc;

use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status};

use super::{errors::to_status, hooks};
use crate::bridge::{Bridge, Caller, HookError};
use crate::proto::cube::v1 as pb;
use pb::volume_controller_service_server::VolumeControllerService;
use pb::volume_plugin_service_server::VolumePluginService;

/// Both Cube services over one bridge.
#[derive(Debug, Clone)]
pub struct CubeService {
    bridge: Arc<Bridge>,
    tasks: TaskTracker,
}

impl CubeService {
    /// `tasks` tracks every hook, so that shutdown can wait for them.
    pub fn new(bridge: Arc<Bridge>, tasks: TaskTracker) -> Self {
        Self { bridge, tasks }
    }

    async fn run<T, F>(
        &self,
        hook: impl FnOnce(Arc<Bridge>, Caller) -> F,
    ) -> Result<Response<T>, Status>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, HookError>> + Send + 'static,
    {
        let caller = Caller::waiting();
        let left = caller.leave_on_drop();
        let task = self.tasks.spawn(hook(self.bridge.clone(), caller));
        let result = match task.await {
            Ok(result) => result,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        };
        left.disarm();
        result.map(Response::new).map_err(|e| to_status(&e))
    }
}

#[tonic::async_trait]
impl VolumeControllerService for CubeService {
    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::CreateResponse>, Status> {
        let req = request.into_inner();
        self.run(|bridge, caller| async move { hooks::create(&bridge, req, &caller).await })
            .await
    }

    async fn destroy(
        &self,
        request: Request<pb::DestroyRequest>,
    ) -> Result<Response<pb::DestroyResponse>, Status> {
        let req = request.into_inner();
        self.run(|bridge, _| async move { hooks::destroy(&bridge, req).await })
            .await
    }
}

#[tonic::async_trait]
impl VolumePluginService for CubeService {
    async fn attach(
        &self,
        request: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachResponse>, Status> {
        let req = request.into_inner();
        self.run(|bridge, caller| async move { hooks::attach(&bridge, req, &caller).await })
            .await
    }

    async fn detach(
        &self,
        request: Request<pb::DetachRequest>,
    ) -> Result<Response<pb::DetachResponse>, Status> {
        let req = request.into_inner();
        self.run(|bridge, _| async move { hooks::detach(&bridge, req).await })
            .await
    }
}
