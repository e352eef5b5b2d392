//! `cube-csi-bridge demo`: a whole Cube volume lifecycle, through the real Cube protocol,
//! against a built-in local-directory CSI driver — no config, no external service.

pub mod driver;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

use crate::config::Config;
use crate::csi::Endpoint;
use crate::mount::MountTable;
use crate::proto::cube::v1 as pb;
use pb::volume_controller_service_client::VolumeControllerServiceClient;
use pb::volume_plugin_service_client::VolumePluginServiceClient;

const DEMO_CONFIG: &str = include_str!("../../config/demo.toml");

/// The demo's config with its directories under `dir`.
pub fn demo_config(dir: &Path) -> anyhow::Result<Config> {
    let text = DEMO_CONFIG.replace("@DIR@", &dir.display().to_string());
    Ok(Config::parse(&text, Path::new("<embedded demo config>"))?)
}

/// Serves the local-directory driver on `socket` until `stop` resolves.
pub async fn serve_local_driver(
    socket: &Path,
    data_dir: &Path,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    crate::mount::ops::ensure_dir(data_dir, 0o755)?;
    let listener =
        UnixListener::bind(socket).with_context(|| format!("binding {}", socket.display()))?;
    let (identity, controller, node) =
        driver::LocalDirDriver::new(data_dir, "demo-node").services();
    Ok(tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(identity)
            .add_service(controller)
            .add_service(node)
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
            .await;
        if let Err(e) = served {
            eprintln!("demo driver stopped: {e}");
        }
    }))
}

struct Step {
    started: Instant,
}

impl Step {
    fn begin(what: &str) -> Self {
        print!("  {what:<58}");
        Self {
            started: Instant::now(),
        }
    }

    fn done(self, detail: impl std::fmt::Display) {
        println!(
            "{:>8.2} ms  {detail}",
            self.started.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// Runs the demo.
pub async fn run(keep: bool) -> anyhow::Result<()> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!(
            "the demo's CSI driver bind-mounts volumes, which needs root; run it as root \
             (e.g. sudo cube-csi-bridge demo)"
        );
    }
    let tmp = tempfile::Builder::new()
        .prefix("cube-csi-bridge-demo-")
        .tempdir()?;
    let dir = tmp.path().to_path_buf();
    println!("cube-csi-bridge demo in {}", dir.display());
    let result = lifecycle(&dir).await;
    if keep {
        println!("kept {}", tmp.keep().display());
    } else {
        // Anything the lifecycle left mounted (after a failure) must not be deleted through.
        if let Ok(table) = MountTable::read(None) {
            let mut leftovers: Vec<PathBuf> = table.under(&dir).map(Path::to_path_buf).collect();
            leftovers.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
            for path in leftovers {
                let _ = crate::mount::ops::unmount_lazy(&path);
            }
        }
    }
    result
}

async fn lifecycle(dir: &Path) -> anyhow::Result<()> {
    let config = demo_config(dir)?;
    let data_dir = dir.join("driver-data");
    let (driver_stop, driver_stopped) = tokio::sync::oneshot::channel::<()>();
    let (bridge_stop, bridge_stopped) = tokio::sync::oneshot::channel::<()>();
    let Endpoint::Unix(csi_socket) = config.csi.endpoint.clone() else {
        unreachable!("csi.endpoint is always a unix socket")
    };
    let driver = serve_local_driver(&csi_socket, &data_dir, async {
        let _ = driver_stopped.await;
    })
    .await?;
    println!(
        "  driver:  {} on {}",
        driver::DRIVER_NAME,
        csi_socket.display()
    );

    let bridge_socket = config.socket_path().to_path_buf();
    let base_dir = config.node.default_volume_base_dir.clone();
    // Open returns once the socket is bound: calls can be made at once.
    let daemon = crate::transport::server::Daemon::open(vec![config]).await?;
    let bridge = tokio::spawn(daemon.run(async {
        let _ = bridge_stopped.await;
    }));
    let channel = crate::csi::client::channel(&Endpoint::Unix(bridge_socket.clone()));
    println!(
        "  bridge:  serving Cube hooks on {}\n",
        bridge_socket.display()
    );

    let mut controller = VolumeControllerServiceClient::new(channel.clone());
    let mut node = VolumePluginServiceClient::new(channel);
    let volume_id = "demo-volume";
    let outcome = async {
        let step = Step::begin("Create (CubeMaster) → CreateVolume");
        let created = controller
            .create(pb::CreateRequest {
                volume_id: volume_id.into(),
                name: volume_id.into(),
            })
            .await?
            .into_inner();
        step.done(format!("private_data={}", created.private_data));

        let attach = |sandbox: &str, ref_count: i64| pb::AttachRequest {
            sandbox_id: sandbox.into(),
            namespace: "default".into(),
            volume_id: volume_id.into(),
            volume_base_dir: base_dir.display().to_string(),
            ref_count,
            private_data: created.private_data.clone(),
        };
        let step = Step::begin("Attach sandbox-a, ref 0 → NodeStage + NodePublish");
        let a = node.attach(attach("sandbox-a", 0)).await?.into_inner();
        step.done(format!("host_path={}", a.host_path));
        let step = Step::begin("Attach sandbox-b, ref 1 → already mounted, no CSI call");
        let b = node.attach(attach("sandbox-b", 1)).await?.into_inner();
        step.done(format!("host_path={}", b.host_path));
        ensure!(
            a.host_path == b.host_path,
            "both sandboxes must share one host_path"
        );

        let step = Step::begin("sandbox-a writes hello.txt through host_path");
        let file = Path::new(&a.host_path).join("hello.txt");
        tokio::fs::write(&file, b"hello from sandbox-a\n").await?;
        step.done(file.display());
        let step = Step::begin("sandbox-b reads it back");
        let read = tokio::fs::read_to_string(Path::new(&b.host_path).join("hello.txt")).await?;
        ensure!(read == "hello from sandbox-a\n", "read back {read:?}");
        step.done(format!("{:?}", read.trim_end()));

        let detach =
            |sandbox: &str,
             ref_count: i64,
             metadata: &std::collections::HashMap<String, String>| pb::DetachRequest {
                sandbox_id: sandbox.into(),
                namespace: "default".into(),
                volume_id: volume_id.into(),
                metadata: metadata.clone(),
                ref_count,
            };
        let step = Step::begin("Detach sandbox-b, ref 1 → still in use, no CSI call");
        node.detach(detach("sandbox-b", 1, &b.metadata)).await?;
        step.done("");
        let step = Step::begin("Detach sandbox-a, ref 0 → NodeUnpublish + NodeUnstage");
        node.detach(detach("sandbox-a", 0, &a.metadata)).await?;
        let mounted = MountTable::read(None)?.is_mount_point(Path::new(&a.host_path));
        ensure!(
            !mounted,
            "{} is still mounted after the last Detach",
            a.host_path
        );
        step.done("host_path unmounted");
        let csi_volume = crate::bridge::handoff::VolumeHandle::decode(&created.private_data)
            .map_err(|e| anyhow::anyhow!("the private_data Create answered: {e}"))?
            .csi_volume_id;
        let kept = data_dir.join(csi_volume).join("hello.txt");
        ensure!(kept.exists(), "the data must outlive the attachment");

        let step = Step::begin("Destroy (CubeMaster) → DeleteVolume");
        controller
            .destroy(pb::DestroyRequest {
                volume_id: volume_id.into(),
            })
            .await?;
        ensure!(!kept.exists(), "DeleteVolume must remove the volume's data");
        step.done("volume data removed");
        Ok::<_, anyhow::Error>(())
    }
    .await;

    let _ = bridge_stop.send(());
    let _ = driver_stop.send(());
    let served = bridge.await.context("bridge task")?;
    let _ = driver.await;
    outcome?;
    served?;
    println!("\ndemo finished: every step succeeded");
    Ok(())
}
