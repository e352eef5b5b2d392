//! The suite's CSI driver double, run as a child process (`suite fake-csi …`): every call
//! answers after a fixed latency (0 for "the bridge alone", 10 ms for a slow driver),
//! volumes live in memory, and NodeStage/NodePublish make real bind mounts, so the
//! bridge's check that host_path is a mount point sees what it would see with a real
//! driver. It keeps which paths it mounted in memory (it is their only mounter).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use csi::controller_server::{Controller, ControllerServer};
use csi::identity_server::{Identity, IdentityServer};
use csi::node_server::{Node, NodeServer};
use cube_csi_bridge::proto::csi::v1 as csi;
use nix::mount::{MntFlags, MsFlags};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

/// The driver's GetPluginInfo name.
pub const NAME: &str = "bench.csi.cube-csi-bridge";
const NODE_ID: &str = "bench-node";

/// `fake-csi` command line: `--socket P --data-dir D --latency-ms N [--stage]`.
#[derive(Debug)]
pub struct Options {
    pub socket: PathBuf,
    pub data_dir: PathBuf,
    pub latency: Duration,
    pub stage: bool,
}

impl Options {
    pub fn parse(args: &[String]) -> anyhow::Result<Options> {
        let mut socket = None;
        let mut data_dir = None;
        let mut latency = Duration::ZERO;
        let mut stage = false;
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut value = || it.next().context("flag without a value");
            match flag.as_str() {
                "--socket" => socket = Some(PathBuf::from(value()?)),
                "--data-dir" => data_dir = Some(PathBuf::from(value()?)),
                "--latency-ms" => latency = Duration::from_millis(value()?.parse()?),
                "--stage" => stage = true,
                other => anyhow::bail!("fake-csi: unknown flag {other}"),
            }
        }
        Ok(Options {
            socket: socket.context("fake-csi needs --socket")?,
            data_dir: data_dir.context("fake-csi needs --data-dir")?,
            latency,
            stage,
        })
    }

    /// The argv that starts this driver (after the suite's own executable).
    pub fn argv(&self) -> Vec<String> {
        let mut v = vec![
            "fake-csi".to_string(),
            "--socket".into(),
            self.socket.display().to_string(),
            "--data-dir".into(),
            self.data_dir.display().to_string(),
            "--latency-ms".into(),
            self.latency.as_millis().to_string(),
        ];
        if self.stage {
            v.push("--stage".into());
        }
        v
    }
}

#[derive(Debug)]
struct Inner {
    latency: Duration,
    stage: bool,
    data_dir: PathBuf,
    mounted: Mutex<HashSet<PathBuf>>,
}

#[derive(Debug, Clone)]
struct FakeCsi(Arc<Inner>);

impl FakeCsi {
    async fn delay(&self) {
        if !self.0.latency.is_zero() {
            tokio::time::sleep(self.0.latency).await;
        }
    }

    /// Bind-mounts `source` onto `target` unless this driver already did.
    async fn bind(&self, source: PathBuf, target: PathBuf) -> Result<(), Status> {
        let this = self.clone();
        blocking(move || {
            if this.0.mounted.lock().unwrap().contains(&target) {
                return Ok(());
            }
            std::fs::create_dir_all(&source)?;
            match std::fs::create_dir(&target) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            nix::mount::mount(
                Some(&source),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )?;
            this.0.mounted.lock().unwrap().insert(target);
            Ok(())
        })
        .await
    }

    /// Unmounts `target` if this driver mounted it; `remove` also removes the directory
    /// (NodeUnpublish: the driver owns the target path).
    async fn unbind(&self, target: PathBuf, remove: bool) -> Result<(), Status> {
        let this = self.clone();
        blocking(move || {
            if this.0.mounted.lock().unwrap().remove(&target) {
                nix::mount::umount2(&target, MntFlags::empty())?;
            }
            if remove {
                match std::fs::remove_dir(&target) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
        .await
    }
}

async fn blocking(f: impl FnOnce() -> std::io::Result<()> + Send + 'static) -> Result<(), Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(|e| Status::internal(e.to_string()))
}

fn plain(id: &str) -> Result<&str, Status> {
    let ok = !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(id)
    } else {
        Err(Status::invalid_argument(format!(
            "volume id {id:?} is not a plain name"
        )))
    }
}

#[tonic::async_trait]
impl Identity for FakeCsi {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        self.delay().await;
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: NAME.into(),
            vendor_version: "1".into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{Service, Type, service::Type as S};
        self.delay().await;
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
        self.delay().await;
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}

#[tonic::async_trait]
impl Controller for FakeCsi {
    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::{Rpc, Type, rpc::Type as R};
        self.delay().await;
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
        self.delay().await;
        // Idempotent by name: the name is the id. The data directory is made on first use.
        let name = request.into_inner().name;
        plain(&name)?;
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(csi::Volume {
                volume_id: name,
                ..Default::default()
            }),
        }))
    }

    async fn delete_volume(
        &self,
        _: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        self.delay().await;
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }
}

#[tonic::async_trait]
impl Node for FakeCsi {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        self.delay().await;
        let req = request.into_inner();
        let source = self.0.data_dir.join(plain(&req.volume_id)?);
        self.bind(source, PathBuf::from(req.staging_target_path))
            .await?;
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        self.delay().await;
        let staging = PathBuf::from(request.into_inner().staging_target_path);
        self.unbind(staging, false).await?;
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        self.delay().await;
        let req = request.into_inner();
        let source = if self.0.stage {
            PathBuf::from(&req.staging_target_path)
        } else {
            self.0.data_dir.join(plain(&req.volume_id)?)
        };
        self.bind(source, PathBuf::from(req.target_path)).await?;
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        self.delay().await;
        let target = PathBuf::from(request.into_inner().target_path);
        self.unbind(target, true).await?;
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::{Rpc, Type, rpc::Type as R};
        self.delay().await;
        let capabilities = if self.0.stage {
            vec![csi::NodeServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: R::StageUnstageVolume as i32,
                })),
            }]
        } else {
            vec![]
        };
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        self.delay().await;
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: NODE_ID.into(),
            ..Default::default()
        }))
    }
}

/// Serves the driver until SIGTERM or SIGINT.
pub fn run(options: Options) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = bind(&options.socket)?;
        let driver = FakeCsi(Arc::new(Inner {
            latency: options.latency,
            stage: options.stage,
            data_dir: options.data_dir,
            mounted: Mutex::default(),
        }));
        tonic::transport::Server::builder()
            // Real Go drivers take any number of concurrent calls; so does this one.
            .max_concurrent_streams(Some(4096))
            .add_service(IdentityServer::new(driver.clone()))
            .add_service(ControllerServer::new(driver.clone()))
            .add_service(NodeServer::new(driver))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop_signal())
            .await?;
        Ok(())
    })
}

/// Binds a Unix socket, replacing a stale one.
pub fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    let _ = std::fs::remove_file(path);
    tokio::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))
}

/// Resolves on SIGTERM or SIGINT (how the suite stops its children).
pub async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
