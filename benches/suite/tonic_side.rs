//! The suite's own tonic pieces: a channel over a Unix socket, the trivial tonic Cube
//! plugin (`suite tonic-floor …`, a child process on a multi-thread runtime as `serve`
//! uses), the bare tonic unary hop (client → that plugin), and the same CSI calls the
//! bridge makes, made directly against a driver.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use cube_csi_bridge::proto::csi::v1 as csi;
use cube_csi_bridge::proto::cube::v1 as pb;
use hyper_util::rt::TokioIo;
use pb::volume_controller_service_server::{
    VolumeControllerService, VolumeControllerServiceServer,
};
use pb::volume_plugin_service_client::VolumePluginServiceClient;
use pb::volume_plugin_service_server::{VolumePluginService, VolumePluginServiceServer};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Uri};
use tonic::{Request, Response, Status};

use crate::fake_csi::{bind, stop_signal};

/// A tonic channel over a Unix socket, connected now.
pub async fn unix_channel(path: &Path) -> anyhow::Result<Channel> {
    let path = path.to_path_buf();
    let shown = path.display().to_string();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(&path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .with_context(|| format!("connecting to {shown}"))
}

/// A current-thread runtime for the suite's own client calls.
pub fn client_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime")
}

/// The trivial plugin: answers every hook at once, with replies of the usual shape.
#[derive(Debug, Clone, Copy)]
struct FloorPlugin;

#[tonic::async_trait]
impl VolumePluginService for FloorPlugin {
    async fn attach(
        &self,
        request: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachResponse>, Status> {
        let req = request.into_inner();
        let host_path = format!("{}/floor-{}", req.volume_base_dir, req.volume_id);
        Ok(Response::new(pb::AttachResponse {
            metadata: [("mount_dir".to_string(), host_path.clone())].into(),
            host_path,
        }))
    }

    async fn detach(
        &self,
        _: Request<pb::DetachRequest>,
    ) -> Result<Response<pb::DetachResponse>, Status> {
        Ok(Response::new(pb::DetachResponse {}))
    }
}

#[tonic::async_trait]
impl VolumeControllerService for FloorPlugin {
    async fn create(
        &self,
        _: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::CreateResponse>, Status> {
        Ok(Response::new(pb::CreateResponse::default()))
    }

    async fn destroy(
        &self,
        _: Request<pb::DestroyRequest>,
    ) -> Result<Response<pb::DestroyResponse>, Status> {
        Ok(Response::new(pb::DestroyResponse {}))
    }
}

/// `suite tonic-floor --listen SOCK`: serves the trivial plugin until SIGTERM.
pub fn run_floor(args: &[String]) -> anyhow::Result<()> {
    let socket = match args {
        [flag, path] if flag == "--listen" => PathBuf::from(path),
        _ => anyhow::bail!("usage: tonic-floor --listen SOCK"),
    };
    // The runtime `serve` uses: tokio's default multi-thread runtime.
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = bind(&socket)?;
        tonic::transport::Server::builder()
            .add_service(VolumePluginServiceServer::new(FloorPlugin))
            .add_service(VolumeControllerServiceServer::new(FloorPlugin))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop_signal())
            .await?;
        Ok(())
    })
}

/// The bare relay: a tonic Cube plugin that turns a first Attach into the same NodeStage +
/// NodePublish the bridge makes (at `<base>/.staging/relay+<id>` and `<base>/relay+<id>`),
/// a last Detach into their inverses, and a Create or Destroy into CreateVolume or
/// DeleteVolume, on one tonic channel to the driver, and keeps nothing: no record, no
/// lock, no path check, no durable write. What any tonic bridge
/// pays for the relaying alone; the bridge's figures minus this are its own work.
#[derive(Debug, Clone)]
struct RelayPlugin {
    driver: DirectCsi,
    channel: Channel,
    /// The one base dir it attaches under (Detach names none).
    base: PathBuf,
    /// The CSI volume id of each attached volume, for its Detach.
    attached: Handles,
    /// The CSI volume id of each created volume, for its Destroy (kept apart from the
    /// attached ones: a volume's Detach must not forget its Create).
    created: Handles,
}

/// CSI volume ids by Cube volume id.
type Handles = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>;

/// Records `volume_id`'s CSI volume id in `handles`.
fn remember(handles: &Handles, volume_id: String, csi_volume_id: String) {
    handles
        .lock()
        .expect("relay handles")
        .insert(volume_id, csi_volume_id);
}

/// Takes `volume_id`'s CSI volume id out of `handles`; `what` says what never happened.
fn take(handles: &Handles, volume_id: &str, what: &str) -> Result<String, Status> {
    handles
        .lock()
        .expect("relay handles")
        .remove(volume_id)
        .ok_or_else(|| Status::not_found(format!("the relay never {what} this volume")))
}

impl RelayPlugin {
    fn name(volume_id: &str) -> String {
        format!("relay+{volume_id}")
    }

    fn volume(csi_volume_id: &str) -> csi::Volume {
        csi::Volume {
            volume_id: csi_volume_id.into(),
            ..Default::default()
        }
    }
}

fn relay_error(e: anyhow::Error) -> Status {
    Status::internal(format!("{e:#}"))
}

#[tonic::async_trait]
impl VolumePluginService for RelayPlugin {
    async fn attach(
        &self,
        request: Request<pb::AttachRequest>,
    ) -> Result<Response<pb::AttachResponse>, Status> {
        let req = request.into_inner();
        let base = &self.base;
        let name = Self::name(&req.volume_id);
        if req.ref_count == 0 {
            // The handle travels in private_data when the caller has one (as from a
            // bridge's Create); the suite's fake driver makes any other id on first use.
            let csi_volume_id = if req.private_data.is_empty() {
                req.volume_id.clone()
            } else {
                cube_csi_bridge::bridge::handoff::VolumeHandle::decode(&req.private_data)
                    .map_err(Status::invalid_argument)?
                    .csi_volume_id
            };
            // The CO makes the staging dir (CSI spec).
            std::fs::create_dir_all(base.join(".staging").join(&name))
                .map_err(|e| Status::internal(e.to_string()))?;
            self.driver
                .stage_publish(&self.channel, &Self::volume(&csi_volume_id), base, &name)
                .await
                .map_err(relay_error)?;
            remember(&self.attached, req.volume_id.clone(), csi_volume_id);
        }
        let host_path = base.join(&name).display().to_string();
        Ok(Response::new(pb::AttachResponse {
            metadata: [("mount_dir".to_string(), host_path.clone())].into(),
            host_path,
        }))
    }

    async fn detach(
        &self,
        request: Request<pb::DetachRequest>,
    ) -> Result<Response<pb::DetachResponse>, Status> {
        let req = request.into_inner();
        if req.ref_count == 0 {
            let csi_volume_id = take(&self.attached, &req.volume_id, "attached")?;
            self.driver
                .unpublish_unstage(
                    &self.channel,
                    &Self::volume(&csi_volume_id),
                    &self.base,
                    &Self::name(&req.volume_id),
                )
                .await
                .map_err(relay_error)?;
        }
        Ok(Response::new(pb::DetachResponse {}))
    }
}

#[tonic::async_trait]
impl VolumeControllerService for RelayPlugin {
    /// CreateVolume of the Cube volume's id, nothing recorded but the handle in memory.
    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::CreateResponse>, Status> {
        let req = request.into_inner();
        let volume = self
            .driver
            .create(&self.channel, &req.volume_id)
            .await
            .map_err(relay_error)?;
        remember(&self.created, req.volume_id, volume.volume_id);
        Ok(Response::new(pb::CreateResponse::default()))
    }

    async fn destroy(
        &self,
        request: Request<pb::DestroyRequest>,
    ) -> Result<Response<pb::DestroyResponse>, Status> {
        let req = request.into_inner();
        let csi_volume_id = take(&self.created, &req.volume_id, "created")?;
        self.driver
            .delete(&self.channel, Self::volume(&csi_volume_id))
            .await
            .map_err(relay_error)?;
        Ok(Response::new(pb::DestroyResponse {}))
    }
}

/// `suite tonic-relay --listen SOCK --driver CSI_SOCK --base DIR`: serves the bare relay
/// (attaching under DIR, whatever base dir an Attach names) until SIGTERM.
pub fn run_relay(args: &[String]) -> anyhow::Result<()> {
    let (socket, driver, base) = match args {
        [l, socket, d, driver, b, base] if l == "--listen" && d == "--driver" && b == "--base" => (
            PathBuf::from(socket),
            PathBuf::from(driver),
            PathBuf::from(base),
        ),
        _ => anyhow::bail!("usage: tonic-relay --listen SOCK --driver CSI_SOCK --base DIR"),
    };
    // The runtime `serve` uses: tokio's default multi-thread runtime.
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let relay = RelayPlugin {
            channel: unix_channel(&driver).await?,
            driver: DirectCsi {
                socket: driver,
                access_mode: csi::volume_capability::access_mode::Mode::MultiNodeMultiWriter,
                capacity_bytes: 0,
                stage: true,
            },
            attached: Default::default(),
            created: Default::default(),
            base,
        };
        let listener = bind(&socket)?;
        tonic::transport::Server::builder()
            .add_service(VolumePluginServiceServer::new(relay.clone()))
            .add_service(VolumeControllerServiceServer::new(relay))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop_signal())
            .await?;
        Ok(())
    })
}

/// Hot Attach + Detach pairs (ref_count 1) from a tonic client on one channel, each call
/// timed: the bare tonic unary hop. Returns (attach, detach) samples in ns.
pub fn tonic_hop(socket: &Path, pairs: usize) -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
    client_runtime().block_on(async {
        let mut client = VolumePluginServiceClient::new(unix_channel(socket).await?);
        let mut attach = Vec::with_capacity(pairs);
        let mut detach = Vec::with_capacity(pairs);
        for i in 0..pairs {
            let t = Instant::now();
            client
                .attach(pb::AttachRequest {
                    sandbox_id: format!("sb-{i}"),
                    namespace: "bench".into(),
                    volume_id: "hot".into(),
                    volume_base_dir: "/bench".into(),
                    ref_count: 1,
                    private_data: String::new(),
                })
                .await?;
            attach.push(t.elapsed().as_nanos() as i64);
            let t = Instant::now();
            client
                .detach(pb::DetachRequest {
                    sandbox_id: format!("sb-{i}"),
                    namespace: "bench".into(),
                    volume_id: "hot".into(),
                    ref_count: 1,
                    metadata: Default::default(),
                })
                .await?;
            detach.push(t.elapsed().as_nanos() as i64);
        }
        Ok((attach, detach))
    })
}

/// What the direct CSI calls need to know about the driver and the volume.
#[derive(Debug, Clone)]
pub struct DirectCsi {
    pub socket: PathBuf,
    pub access_mode: csi::volume_capability::access_mode::Mode,
    pub capacity_bytes: i64,
    pub stage: bool,
}

impl DirectCsi {
    fn capability(&self) -> csi::VolumeCapability {
        use csi::volume_capability::{AccessMode, AccessType, MountVolume};
        csi::VolumeCapability {
            access_mode: Some(AccessMode {
                mode: self.access_mode as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }
    }

    async fn create(&self, channel: &Channel, name: &str) -> anyhow::Result<csi::Volume> {
        csi::controller_client::ControllerClient::new(channel.clone())
            .create_volume(csi::CreateVolumeRequest {
                name: name.into(),
                capacity_range: (self.capacity_bytes > 0).then_some(csi::CapacityRange {
                    required_bytes: self.capacity_bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![self.capability()],
                ..Default::default()
            })
            .await
            .context("direct CreateVolume")?
            .into_inner()
            .volume
            .context("CreateVolume returned no volume")
    }

    async fn delete(&self, channel: &Channel, volume: csi::Volume) -> anyhow::Result<()> {
        csi::controller_client::ControllerClient::new(channel.clone())
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: volume.volume_id,
                ..Default::default()
            })
            .await
            .context("direct DeleteVolume")?;
        Ok(())
    }

    /// NodeStage + NodePublish at the bridge's paths for `name` under `base`. The CO makes
    /// the staging directory (CSI spec): done before, and not timed, by the callers.
    async fn stage_publish(
        &self,
        channel: &Channel,
        volume: &csi::Volume,
        base: &Path,
        name: &str,
    ) -> anyhow::Result<()> {
        let mut node = csi::node_client::NodeClient::new(channel.clone());
        let staging = base.join(".staging").join(name).display().to_string();
        if self.stage {
            node.node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: volume.volume_id.clone(),
                staging_target_path: staging.clone(),
                volume_capability: Some(self.capability()),
                volume_context: volume.volume_context.clone(),
                ..Default::default()
            })
            .await
            .context("direct NodeStageVolume")?;
        }
        node.node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            staging_target_path: if self.stage { staging } else { String::new() },
            target_path: base.join(name).display().to_string(),
            volume_capability: Some(self.capability()),
            volume_context: volume.volume_context.clone(),
            ..Default::default()
        })
        .await
        .context("direct NodePublishVolume")?;
        Ok(())
    }

    /// NodeUnpublish + NodeUnstage, the reverse of `stage_publish`.
    async fn unpublish_unstage(
        &self,
        channel: &Channel,
        volume: &csi::Volume,
        base: &Path,
        name: &str,
    ) -> anyhow::Result<()> {
        let mut node = csi::node_client::NodeClient::new(channel.clone());
        node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            target_path: base.join(name).display().to_string(),
        })
        .await
        .context("direct NodeUnpublishVolume")?;
        if self.stage {
            node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: volume.volume_id.clone(),
                staging_target_path: base.join(".staging").join(name).display().to_string(),
            })
            .await
            .context("direct NodeUnstageVolume")?;
        }
        Ok(())
    }

    /// CreateVolume once, then `rounds` × (NodeStage + NodePublish) and (NodeUnpublish +
    /// NodeUnstage), each pair timed as one: the driver's own cost of a first Attach and a
    /// last Detach, with the bridge's paths (`<base>/.staging/<x>`, `<base>/<x>`).
    /// Returns (attach, detach) samples in ns.
    pub fn attach_detach(
        &self,
        base: &Path,
        name: &str,
        rounds: usize,
    ) -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
        client_runtime().block_on(async {
            let channel = unix_channel(&self.socket).await?;
            let volume = self.create(&channel, name).await?;
            let (mut attach, mut detach) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                std::fs::create_dir_all(base.join(".staging").join(name))?;
                let t = Instant::now();
                self.stage_publish(&channel, &volume, base, name).await?;
                attach.push(t.elapsed().as_nanos() as i64);
                let t = Instant::now();
                self.unpublish_unstage(&channel, &volume, base, name)
                    .await?;
                detach.push(t.elapsed().as_nanos() as i64);
            }
            self.delete(&channel, volume).await?;
            Ok((attach, detach))
        })
    }

    /// `n` × (CreateVolume, DeleteVolume) of fresh names, each call timed on its own: the
    /// driver's own cost of a Create and a Destroy. Returns (create, delete) samples in ns.
    pub fn create_delete(&self, prefix: &str, n: usize) -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
        client_runtime().block_on(async {
            let channel = unix_channel(&self.socket).await?;
            let (mut create, mut delete) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for i in 0..n {
                let t = Instant::now();
                let volume = self.create(&channel, &format!("{prefix}-{i:05}")).await?;
                create.push(t.elapsed().as_nanos() as i64);
                let t = Instant::now();
                self.delete(&channel, volume).await?;
                delete.push(t.elapsed().as_nanos() as i64);
            }
            Ok((create, delete))
        })
    }

    /// CreateVolume of every name at once over one channel (a CubeMaster create storm made
    /// directly on the driver): the wall time; the volumes are deleted afterwards, untimed.
    pub fn creates_at_once(&self, names: &[String]) -> anyhow::Result<Duration> {
        client_runtime().block_on(async {
            let channel = unix_channel(&self.socket).await?;
            let mut tasks = tokio::task::JoinSet::new();
            let started = Instant::now();
            for name in names {
                let (this, channel, name) = (self.clone(), channel.clone(), name.clone());
                tasks.spawn(async move { this.create(&channel, &name).await });
            }
            let mut volumes = Vec::with_capacity(names.len());
            while let Some(done) = tasks.join_next().await {
                volumes.push(done??);
            }
            let wall = started.elapsed();
            for volume in volumes {
                self.delete(&channel, volume).await?;
            }
            Ok(wall)
        })
    }

    /// The driver's own cost of the concurrent figure: NodeStage + NodePublish of every
    /// name at once over one channel (as the bridge's client multiplexes them), then the
    /// reverse. Returns the two wall times.
    pub fn all_at_once(
        &self,
        base: &Path,
        names: &[String],
    ) -> anyhow::Result<(Duration, Duration)> {
        client_runtime().block_on(async {
            let channel = unix_channel(&self.socket).await?;
            let mut volumes = Vec::new();
            for name in names {
                std::fs::create_dir_all(base.join(".staging").join(name))?;
                volumes.push((self.create(&channel, name).await?, name.clone()));
            }
            let volumes = std::sync::Arc::new(volumes);
            let run = |undo: bool| {
                let mut tasks = tokio::task::JoinSet::new();
                for i in 0..volumes.len() {
                    let (this, channel, volumes) = (self.clone(), channel.clone(), volumes.clone());
                    let base = base.to_path_buf();
                    tasks.spawn(async move {
                        let (volume, name) = &volumes[i];
                        if undo {
                            this.unpublish_unstage(&channel, volume, &base, name).await
                        } else {
                            this.stage_publish(&channel, volume, &base, name).await
                        }
                    });
                }
                async move {
                    let t = Instant::now();
                    while let Some(done) = tasks.join_next().await {
                        done??;
                    }
                    Ok::<_, anyhow::Error>(t.elapsed())
                }
            };
            let attach = run(false).await?;
            let detach = run(true).await?;
            for (volume, _) in volumes.iter() {
                self.delete(&channel, volume.clone()).await?;
            }
            Ok((attach, detach))
        })
    }
}

/// From spawning a daemon to its first successful hook: connect attempts every 200 µs,
/// then a Detach with ref_count 1 (a no-op for the bridge) on a fresh channel.
pub fn time_to_first_call(
    spawn: impl FnOnce() -> anyhow::Result<crate::procs::Proc>,
    socket: &Path,
    timeout: Duration,
) -> anyhow::Result<(Duration, crate::procs::Proc)> {
    let runtime = client_runtime();
    let started = Instant::now();
    let mut proc = spawn()?;
    loop {
        if started.elapsed() > timeout {
            proc.check_alive()?;
            anyhow::bail!("{} not ready within {timeout:?}", proc.name);
        }
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            let answered = runtime.block_on(async {
                let mut client = VolumePluginServiceClient::new(unix_channel(socket).await?);
                client
                    .detach(pb::DetachRequest {
                        sandbox_id: "ready".into(),
                        namespace: "bench".into(),
                        volume_id: "ready".into(),
                        ref_count: 1,
                        metadata: Default::default(),
                    })
                    .await?;
                Ok::<_, anyhow::Error>(())
            });
            if answered.is_ok() {
                return Ok((started.elapsed(), proc));
            }
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
