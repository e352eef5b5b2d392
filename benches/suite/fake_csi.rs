//! The suite's CSI driver, run as a child process (`suite fake-csi …`): the project's own
//! driver (`cube_csi_bridge::demo::driver`, the one the demo and the tests use) with a
//! bench profile. Every call answers after a fixed latency (0 for "the bridge alone",
//! 10 ms for a slow driver); volumes are directories of the data directory, and
//! NodeStage/NodePublish make real bind mounts, so the bridge's check that host_path is a
//! mount point sees what it would see with a real driver. The same-run baselines call
//! this same process directly.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use cube_csi_bridge::demo::driver::{LocalDirDriver, Profile};
use tokio_stream::wrappers::UnixListenerStream;

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

/// The bench profile of the project's driver: named as the suite expects, every call
/// answered after the fixed latency, nothing recorded (it would only grow), volumes made
/// on first use (the suite attaches volumes it never created).
fn profile(options: &Options) -> Profile {
    Profile {
        name: NAME.into(),
        stage: options.stage,
        record_calls: false,
        latency: options.latency,
        volumes_on_first_use: true,
        ..Profile::demo(NODE_ID)
    }
}

/// Serves the driver until SIGTERM or SIGINT.
pub fn run(options: Options) -> anyhow::Result<()> {
    std::fs::create_dir_all(&options.data_dir)
        .with_context(|| format!("making {}", options.data_dir.display()))?;
    let driver = LocalDirDriver::with_profile(&options.data_dir, profile(&options));
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = bind(&options.socket)?;
        let (identity, controller, node) = driver.services();
        tonic::transport::Server::builder()
            // Real Go drivers take any number of concurrent calls; so does this one.
            .max_concurrent_streams(Some(4096))
            .add_service(identity)
            .add_service(controller)
            .add_service(node)
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
