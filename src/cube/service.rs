//! The gRPC services Cube dials: VolumeControllerService (CubeMaster) and
//! VolumePluginService (Cubelet).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::{errors::to_status, hooks};
use crate::bridge::Bridge;
use crate::proto::cube::v1 as pb;
use pb::volume_controller_service_server::VolumeControllerService;
use pb::volume_plugin_service_server::VolumePluginService;

/// Both Cube services over one bridge.
#[derive(Debug, Clone)]
pub struct CubeService {
    bridge: Arc<Bridge>,
}

impl CubeService {
    pub fn new(bridge: Arc<Bridge>) -> Self {
        Self { bridge }
    }
}

#[tonic::async_trait]
impl VolumeControllerService for CubeService {
    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::CreateResponse>, Status> {
        hooks::create(&self.bridge, request.into_inner())
            .await
            .map(Response::new)
            .map_err(|e| to_status(&e))
    }

    async fn destroy(
        &self,
        request: Request<pb::DestroyRequest>,
    ) -> Result<Response<pb::DestroyResponse>, Status> {
        hooks::destroy(&self.bridge, request.into_inner())
            .await
            .map(Response::new)
            .map_err(|e| to_status(&e))
    }
}

#[tonic::async_trait]
impl VolumePluginService for CubeService {
    async fn attach(
        &self,
        request: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachResponse>, Status> {
        hooks::attach(&self.bridge, request.into_inner())
            .await
            .map(Response::new)
            .map_err(|e| to_status(&e))
    }

    async fn detach(
        &self,
        request: Request<pb::DetachRequest>,
    ) -> Result<Response<pb::DetachResponse>, Status> {
        hooks::detach(&self.bridge, request.into_inner())
            .await
            .map(Response::new)
            .map_err(|e| to_status(&e))
    }
}
