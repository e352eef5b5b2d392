//! A fake CSI driver for the bridge's tests: records every call, can be scripted to fail,
//! hang or slow down per method, and makes real bind mounts at the paths it is given
//! (volume data lives in `<data_dir>/<volume id>`, so it outlives attachments).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use csi::controller_server::{Controller, ControllerServer};
use csi::identity_server::{Identity, IdentityServer};
use csi::node_server::{Node, NodeServer};
use cube_csi_bridge::mount::{MountTable, ops, resolve_parent};
use cube_csi_bridge::proto::csi::v1 as csi;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Code, Request, Response, Status};

pub const FAKE_NODE_ID: &str = "fake-node-1";

/// What the fake advertises.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caps {
    /// Node STAGE_UNSTAGE_VOLUME.
    pub stage: bool,
    /// Controller PUBLISH_UNPUBLISH_VOLUME.
    pub controller_publish: bool,
    /// Advertise CONTROLLER_SERVICE but answer UNIMPLEMENTED to controller calls
    /// (a node-only deployment of a driver that has a controller elsewhere).
    pub controller_unreachable: bool,
}

impl Caps {
    /// A driver that stages (STAGE_UNSTAGE_VOLUME) and needs no ControllerPublish.
    pub fn staging() -> Self {
        Caps {
            stage: true,
            ..Default::default()
        }
    }
}

/// One scripted reaction, consumed by the next call of its method.
#[derive(Debug, Clone)]
pub enum Behavior {
    Fail(Code, &'static str),
    /// Sleep, then behave normally (the call is dropped if the client gives up).
    Delay(Duration),
}

/// One recorded call.
#[derive(Debug, Clone, Default)]
pub struct Call {
    pub method: &'static str,
    pub volume_id: String,
    pub node_id: String,
    pub target_path: String,
    pub staging_target_path: String,
    pub publish_context: BTreeMap<String, String>,
    pub secrets: BTreeMap<String, String>,
    pub parameters: BTreeMap<String, String>,
    pub mount_flags: Vec<String>,
}

/// Calls that change state (discovery calls are recorded too but filtered here).
pub const MUTATING: &[&str] = &[
    "CreateVolume",
    "DeleteVolume",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
    "NodeStageVolume",
    "NodeUnstageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
];

#[derive(Debug, Default)]
struct State {
    calls: Vec<Call>,
    script: HashMap<&'static str, VecDeque<Behavior>>,
}

#[derive(Debug)]
struct Inner {
    caps: Caps,
    data_dir: PathBuf,
    state: Mutex<State>,
}

/// The fake; clones share state.
#[derive(Debug, Clone)]
pub struct FakeDriver {
    inner: Arc<Inner>,
}

/// A running fake server; dropping it stops the server.
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl FakeDriver {
    pub fn new(caps: Caps, data_dir: &Path) -> Self {
        std::fs::create_dir_all(data_dir).unwrap();
        Self {
            inner: Arc::new(Inner {
                caps,
                data_dir: data_dir.to_path_buf(),
                state: Mutex::default(),
            }),
        }
    }

    /// Serves on `socket` (replacing a stale socket file).
    pub fn serve(&self, socket: &Path) -> Running {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let me = self.clone();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(IdentityServer::new(me.clone()))
                .add_service(ControllerServer::new(me.clone()))
                .add_service(NodeServer::new(me))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Running {
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Queues reactions for the next calls of `method`.
    pub fn script(&self, method: &'static str, behaviors: impl IntoIterator<Item = Behavior>) {
        let mut state = self.inner.state.lock().unwrap();
        state.script.entry(method).or_default().extend(behaviors);
    }

    pub fn calls(&self) -> Vec<Call> {
        self.inner.state.lock().unwrap().calls.clone()
    }

    /// The names of the state-changing calls so far, in order.
    pub fn mutating_calls(&self) -> Vec<&'static str> {
        self.calls()
            .iter()
            .map(|c| c.method)
            .filter(|m| MUTATING.contains(m))
            .collect()
    }

    /// Forgets recorded calls (the script is kept).
    pub fn clear_calls(&self) {
        self.inner.state.lock().unwrap().calls.clear();
    }

    pub fn volume_dir(&self, volume_id: &str) -> PathBuf {
        self.inner.data_dir.join(volume_id)
    }

    async fn enter(&self, call: Call) -> Result<(), Status> {
        let behavior = {
            let mut state = self.inner.state.lock().unwrap();
            let method = call.method;
            state.calls.push(call);
            state.script.get_mut(method).and_then(VecDeque::pop_front)
        };
        match behavior {
            None => Ok(()),
            Some(Behavior::Fail(code, message)) => Err(Status::new(code, message)),
            Some(Behavior::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
        }
    }

    fn controller_reachable(&self) -> Result<(), Status> {
        if self.inner.caps.controller_unreachable {
            return Err(Status::unimplemented("this endpoint serves the node only"));
        }
        Ok(())
    }
}

fn map(m: &HashMap<String, String>) -> BTreeMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn mounted(path: &Path) -> bool {
    MountTable::read(None)
        .unwrap()
        .is_mount_point(&resolve_parent(path))
}

fn io(e: std::io::Error) -> Status {
    Status::internal(e.to_string())
}

fn flags(cap: &Option<csi::VolumeCapability>) -> Vec<String> {
    match cap.as_ref().and_then(|c| c.access_type.as_ref()) {
        Some(csi::volume_capability::AccessType::Mount(m)) => m.mount_flags.clone(),
        _ => Vec::new(),
    }
}

#[tonic::async_trait]
impl Identity for FakeDriver {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        self.enter(Call {
            method: "GetPluginInfo",
            ..Default::default()
        })
        .await?;
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: "fake.csi.test".into(),
            vendor_version: "0.0.1".into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{Service, Type, service::Type as S};
        self.enter(Call {
            method: "GetPluginCapabilities",
            ..Default::default()
        })
        .await?;
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
        self.enter(Call {
            method: "Probe",
            ..Default::default()
        })
        .await?;
        Ok(Response::new(csi::ProbeResponse { ready: None }))
    }
}

#[tonic::async_trait]
impl Controller for FakeDriver {
    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::{Rpc, Type, rpc::Type as R};
        self.enter(Call {
            method: "ControllerGetCapabilities",
            ..Default::default()
        })
        .await?;
        self.controller_reachable()?;
        let mut caps = vec![R::CreateDeleteVolume];
        if self.inner.caps.controller_publish {
            caps.push(R::PublishUnpublishVolume);
        }
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: caps
                .into_iter()
                .map(|c| csi::ControllerServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: c as i32 })),
                })
                .collect(),
        }))
    }

    async fn create_volume(
        &self,
        request: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "CreateVolume",
            volume_id: req.name.clone(),
            secrets: map(&req.secrets),
            parameters: map(&req.parameters),
            mount_flags: req
                .volume_capabilities
                .first()
                .cloned()
                .map(|c| flags(&Some(c)))
                .unwrap_or_default(),
            ..Default::default()
        })
        .await?;
        self.controller_reachable()?;
        let id = format!("fake-{}", req.name);
        std::fs::create_dir_all(self.volume_dir(&id)).map_err(io)?;
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(csi::Volume {
                volume_id: id,
                volume_context: HashMap::from([("origin".to_string(), "fake".to_string())]),
                ..Default::default()
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "DeleteVolume",
            volume_id: req.volume_id.clone(),
            secrets: map(&req.secrets),
            ..Default::default()
        })
        .await?;
        match std::fs::remove_dir_all(self.volume_dir(&req.volume_id)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        request: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "ControllerPublishVolume",
            volume_id: req.volume_id.clone(),
            node_id: req.node_id.clone(),
            secrets: map(&req.secrets),
            ..Default::default()
        })
        .await?;
        Ok(Response::new(csi::ControllerPublishVolumeResponse {
            publish_context: HashMap::from([(
                "device".to_string(),
                format!("/dev/fake-{}", req.node_id),
            )]),
        }))
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "ControllerUnpublishVolume",
            volume_id: req.volume_id.clone(),
            node_id: req.node_id.clone(),
            secrets: map(&req.secrets),
            ..Default::default()
        })
        .await?;
        Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}))
    }
}

#[tonic::async_trait]
impl Node for FakeDriver {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodeStageVolume",
            volume_id: req.volume_id.clone(),
            staging_target_path: req.staging_target_path.clone(),
            publish_context: map(&req.publish_context),
            secrets: map(&req.secrets),
            mount_flags: flags(&req.volume_capability),
            ..Default::default()
        })
        .await?;
        let staging = PathBuf::from(&req.staging_target_path);
        if !staging.is_dir() {
            return Err(Status::failed_precondition(
                "the CO must create the staging path",
            ));
        }
        let source = self.volume_dir(&req.volume_id);
        if !source.is_dir() {
            return Err(Status::not_found(format!("no volume {}", req.volume_id)));
        }
        if !mounted(&staging) {
            ops::bind_mount(&source, &staging, false).map_err(io)?;
        }
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodeUnstageVolume",
            volume_id: req.volume_id.clone(),
            staging_target_path: req.staging_target_path.clone(),
            ..Default::default()
        })
        .await?;
        ops::unmount(Path::new(&req.staging_target_path)).map_err(io)?;
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodePublishVolume",
            volume_id: req.volume_id.clone(),
            target_path: req.target_path.clone(),
            staging_target_path: req.staging_target_path.clone(),
            publish_context: map(&req.publish_context),
            secrets: map(&req.secrets),
            mount_flags: flags(&req.volume_capability),
            ..Default::default()
        })
        .await?;
        let target = PathBuf::from(&req.target_path);
        let source = if self.inner.caps.stage {
            let staging = PathBuf::from(&req.staging_target_path);
            if !mounted(&staging) {
                return Err(Status::failed_precondition("volume is not staged"));
            }
            staging
        } else {
            self.volume_dir(&req.volume_id)
        };
        if !mounted(&target) {
            ops::create_dir_exact(&target, 0o755).map_err(io)?;
            ops::bind_mount(&source, &target, req.readonly).map_err(io)?;
        }
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(Call {
            method: "NodeUnpublishVolume",
            volume_id: req.volume_id.clone(),
            target_path: req.target_path.clone(),
            ..Default::default()
        })
        .await?;
        let target = PathBuf::from(&req.target_path);
        ops::unmount(&target).map_err(io)?;
        ops::remove_dir_if_empty(&target).map_err(io)?;
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::{Rpc, Type, rpc::Type as R};
        self.enter(Call {
            method: "NodeGetCapabilities",
            ..Default::default()
        })
        .await?;
        let caps = if self.inner.caps.stage {
            vec![csi::NodeServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: R::StageUnstageVolume as i32,
                })),
            }]
        } else {
            Vec::new()
        };
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities: caps,
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        self.enter(Call {
            method: "NodeGetInfo",
            ..Default::default()
        })
        .await?;
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: FAKE_NODE_ID.into(),
            ..Default::default()
        }))
    }
}
