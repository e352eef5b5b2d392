//! The `serve` daemon: binds Cube's socket, serves the configured services, and shuts
//! down gracefully (in-flight hooks finish, new ones are refused).

use std::future::Future;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::transport::Server;

use super::authority::fix_incoming;
use super::service::CubeService;
use crate::bridge::{Bridge, ProcessMode, Roles};
use crate::config::Config;
use crate::csi::Deadline;
use crate::proto::cube::v1 as pb;
use pb::volume_controller_service_server::VolumeControllerServiceServer;
use pb::volume_plugin_service_server::VolumePluginServiceServer;

/// How long start-up waits for the driver's answers before going on without them.
const STARTUP_CHECK_BUDGET: Duration = Duration::from_secs(10);

/// A start-up refusal the operator must fix (exit code 78, EX_CONFIG).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Misconfigured(pub String);

/// Binds the Unix socket: parent created, a stale socket replaced, a live one refused,
/// and the mode set to 0660 so only root and the socket's group can reach the hooks.
pub async fn bind_unix(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        crate::mount::ops::ensure_dir(dir, 0o755)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if tokio::net::UnixStream::connect(path).await.is_ok() {
                bail!(
                    "{} is in use by a running process (another bridge instance?)",
                    path.display()
                );
            }
            std::fs::remove_file(path)
                .with_context(|| format!("removing stale socket {}", path.display()))?;
        }
        Ok(_) => bail!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("chmod 0660 {}", path.display()))?;
    Ok(listener)
}

/// Runs the daemon until `shutdown` resolves, then drains within the grace period.
pub async fn serve(config: Config, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let services = config.serve.services;
    let roles = Roles {
        controller: services.controller(),
        node: services.node(),
    };
    let grace = Duration::from_secs(config.serve.shutdown_grace_secs);
    let socket_path = config.socket_path();
    let tcp = config.serve.tcp.clone();
    let bridge = Arc::new(Bridge::new(config, roles, ProcessMode::Daemon)?);

    bridge
        .check_driver(roles, &Deadline::after(STARTUP_CHECK_BUDGET))
        .await
        .map_err(|e| Misconfigured(format!("refusing to start: {e}")))?;

    let unix = bind_unix(&socket_path).await?;
    tracing::info!(socket = %socket_path.display(), ?services, "serving Cube hooks");
    let tcp = match tcp {
        Some(addr) => {
            let listener = TcpListener::bind(&addr)
                .await
                .with_context(|| format!("binding tcp {addr}"))?;
            tracing::info!(%addr, "serving Cube hooks on tcp as well");
            Some(listener)
        }
        None => None,
    };

    if roles.node {
        let bridge = bridge.clone();
        tokio::spawn(async move {
            match bridge.reconcile_node().await {
                Ok(report) => tracing::info!(?report, "node journal reconciled"),
                Err(error) => tracing::error!(%error, "node journal reconciliation failed"),
            }
        });
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let router = || {
        let service = CubeService::new(bridge.clone());
        let mut builder = Server::builder();
        let controller = roles
            .controller
            .then(|| VolumeControllerServiceServer::new(service.clone()));
        let node = roles.node.then(|| VolumePluginServiceServer::new(service));
        builder
            .add_optional_service(controller)
            .add_optional_service(node)
    };
    // fix_incoming: every gRPC client may call the socket, not only grpc-go (authority.rs).
    let unix_server = router()
        .serve_with_incoming_shutdown(fix_incoming(UnixListenerStream::new(unix)), stopped());
    let tcp_server = async {
        match tcp {
            Some(listener) => {
                router()
                    .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stopped())
                    .await
            }
            None => Ok(()),
        }
    };
    let servers = async { tokio::try_join!(unix_server, tcp_server).map(|_| ()) };
    tokio::pin!(servers);

    tokio::select! {
        result = &mut servers => result.context("serving")?,
        () = shutdown => {
            tracing::info!(grace_secs = grace.as_secs(), "shutting down: refusing new hooks, finishing in-flight ones");
            let _ = stop_tx.send(true);
            match tokio::time::timeout(grace, &mut servers).await {
                Ok(result) => result.context("serving")?,
                Err(_) => tracing::warn!("in-flight hooks did not finish within the grace period; exiting anyway"),
            }
        }
    }
    let _ = std::fs::remove_file(&socket_path);
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on SIGTERM (systemd, Kubernetes) or SIGINT (a terminal), logging which.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(signal = name, "received shutdown signal");
}
