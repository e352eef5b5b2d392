//! A small but real CSI driver built into the program, for the demo: each volume is a
//! subdirectory of a data directory; NodeStage bind-mounts it at the staging path and
//! NodePublish bind-mounts the staging path at the target.

use std::path::{Path, PathBuf};

use tonic::{Request, Response, Status};

use crate::mount::ops;
use crate::proto::csi::v1 as csi;
use csi::controller_server::{Controller, ControllerServer};
use csi::identity_server::{Identity, IdentityServer};
use csi::node_server::{Node, NodeServer};

/// The driver's CSI name.
pub const DRIVER_NAME: &str = "local.csi.cube-csi-bridge";

/// Volumes as subdirectories of `data_dir`.
#[derive(Debug, Clone)]
pub struct LocalDirDriver {
    data_dir: PathBuf,
    node_id: String,
}

impl LocalDirDriver {
    pub fn new(data_dir: &Path, node_id: &str) -> Self {
        Self {
            data_dir: data_dir.to_path_buf(),
            node_id: node_id.to_string(),
        }
    }

    /// The three CSI services, ready to add to a tonic server.
    pub fn services(
        self,
    ) -> (
        IdentityServer<LocalDirDriver>,
        ControllerServer<LocalDirDriver>,
        NodeServer<LocalDirDriver>,
    ) {
        (
            IdentityServer::new(self.clone()),
            ControllerServer::new(self.clone()),
            NodeServer::new(self),
        )
    }

    /// The data directory of a volume id, refusing ids that are not plain names.
    fn volume_dir(&self, id: &str) -> Result<PathBuf, Status> {
        let plain = !id.is_empty()
            && id.len() <= 128
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !plain {
            return Err(Status::invalid_argument(format!(
                "volume id {id:?} is not a plain name"
            )));
        }
        Ok(self.data_dir.join(id))
    }
}

fn required<'a>(value: &'a str, field: &str) -> Result<&'a str, Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Ok(value)
}

fn internal(e: std::io::Error) -> Status {
    Status::internal(e.to_string())
}

/// Runs blocking mount work off the async threads.
async fn blocking(f: impl FnOnce() -> std::io::Result<()> + Send + 'static) -> Result<(), Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(internal)
}

fn is_mounted(path: &Path) -> Result<bool, Status> {
    crate::mount::MountTable::read(None)
        .map(|t| t.is_mount_point(&crate::mount::resolve_parent(path)))
        .map_err(internal)
}

#[tonic::async_trait]
impl Identity for LocalDirDriver {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{Service, Type, service::Type as S};
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities: vec![csi::PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: S::ControllerService as i32,
                })),
            }],
        }))
    }

    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}

#[tonic::async_trait]
impl Controller for LocalDirDriver {
    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::{Rpc, Type, rpc::Type as R};
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: vec![csi::ControllerServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: R::CreateDeleteVolume as i32,
                })),
            }],
        }))
    }

    async fn create_volume(
        &self,
        request: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        // Idempotent by name: the name is the id.
        let dir = self.volume_dir(required(&req.name, "name")?)?;
        ops::ensure_dir(&dir, 0o777).map_err(internal)?;
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(csi::Volume {
                volume_id: req.name,
                capacity_bytes: 0,
                ..Default::default()
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let dir = self.volume_dir(required(&request.get_ref().volume_id, "volume_id")?)?;
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(internal(e)),
        }
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }
}

#[tonic::async_trait]
impl Node for LocalDirDriver {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        let source = self.volume_dir(required(&req.volume_id, "volume_id")?)?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        if !source.is_dir() {
            return Err(Status::not_found(format!(
                "volume {} does not exist",
                req.volume_id
            )));
        }
        if !is_mounted(&staging)? {
            blocking(move || ops::bind_mount(&source, &staging, false)).await?;
        }
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let staging = PathBuf::from(required(
            &request.get_ref().staging_target_path,
            "staging_target_path",
        )?);
        blocking(move || ops::unmount(&staging)).await?;
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        if !is_mounted(&staging)? {
            return Err(Status::failed_precondition("volume is not staged"));
        }
        if is_mounted(&target)? {
            return Ok(Response::new(csi::NodePublishVolumeResponse {}));
        }
        let read_only = req.readonly;
        blocking(move || {
            // The CO makes the target's parent; the driver makes the target (CSI spec).
            ops::create_dir_exact(&target, 0o755)?;
            ops::bind_mount(&staging, &target, read_only)
        })
        .await?;
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let target = PathBuf::from(required(&request.get_ref().target_path, "target_path")?);
        blocking(move || {
            ops::unmount(&target)?;
            ops::remove_dir_if_empty(&target).map(|_| ())
        })
        .await?;
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::{Rpc, Type, rpc::Type as R};
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities: vec![csi::NodeServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: R::StageUnstageVolume as i32,
                })),
            }],
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            ..Default::default()
        }))
    }
}
