//! Test scaffolding: a fake CSI driver, the bridge started as Cube would use it (the
//! `serve` daemon dialed over its socket, or the executable forked per hook with Cube's
//! exact argv), and mount hygiene for tests that make real mounts.

#![allow(dead_code)]

pub mod cube_peers;
pub mod fake_driver;
pub mod k8s;
pub mod real_drivers;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use cube_csi_bridge::csi::Endpoint;
use cube_csi_bridge::mount::{MountTable, ops};
use cube_csi_bridge::proto::cube::v1 as pb;
use fake_driver::{Caps, FakeDriver, Running};
use pb::volume_controller_service_client::VolumeControllerServiceClient;
use pb::volume_plugin_service_client::VolumePluginServiceClient;

pub const BRIDGE: &str = env!("CARGO_BIN_EXE_cube-csi-bridge");
/// The Cube driver name the tests register.
pub const DRIVER: &str = "fake";

/// Skips a test that needs root (real mounts) when not root.
#[macro_export]
macro_rules! require_root {
    () => {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: this test makes real mounts and needs root");
            return;
        }
    };
}

/// How the test reaches the bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `cube-csi-bridge serve`, dialed over its Unix socket (Cube type `rpc`).
    Rpc,
    /// The executable forked per hook with Cube's argv (Cube type `binary`).
    Binary,
}

pub const MODES: [Mode; 2] = [Mode::Rpc, Mode::Binary];

/// A failed hook as Cube sees it.
#[derive(Debug)]
pub struct CubeError {
    pub message: String,
    /// The gRPC code (rpc mode only).
    pub code: Option<tonic::Code>,
}

/// One test's world: temp dir, fake driver, bridge config, and (rpc mode) the daemon.
pub struct World {
    pub mode: Mode,
    pub dir: tempfile::TempDir,
    pub driver: FakeDriver,
    pub driver_server: Option<Running>,
    pub config_path: PathBuf,
    pub base_dir: PathBuf,
    pub daemon: Option<tokio::process::Child>,
    hook_logs: std::sync::Mutex<Vec<String>>,
}

/// The config every test starts from; `extra` is appended (TOML tables).
pub fn config_text(dir: &Path, extra: &str) -> String {
    format!(
        r#"driver = "{DRIVER}"
[csi]
endpoint = "unix://{dir}/csi.sock"

[serve]
socket = "{dir}/bridge.sock"

[state]
dir = "{dir}/state"
lock_dir = "{dir}/locks"

[node]
default_volume_base_dir = "{dir}/volumes"
allowed_base_dirs = ["{dir}/volumes", "{dir}/link"]
mount_view = "self"

{extra}
"#,
        dir = dir.display()
    )
}

impl World {
    /// A world whose config has `[timeouts]` tight enough for tests unless `extra` sets them.
    pub async fn start(mode: Mode, caps: Caps, extra: &str) -> World {
        let dir = tempfile::Builder::new()
            .prefix("ccb-test-")
            .tempdir()
            .unwrap();
        let driver = FakeDriver::new(caps, &dir.path().join("driver-data"));
        let driver_server = Some(driver.serve(&dir.path().join("csi.sock")));
        let extra = if extra.contains("[timeouts]") {
            extra.to_string()
        } else {
            format!(
                "{extra}\n[timeouts]\ncreate_secs = 20\ndestroy_secs = 20\nattach_secs = 20\ndetach_secs = 20\nrollback_secs = 10\n"
            )
        };
        let config_path = dir.path().join("bridge.toml");
        std::fs::write(&config_path, config_text(dir.path(), &extra)).unwrap();
        let base_dir = dir.path().join("volumes");
        let mut world = World {
            mode,
            driver,
            driver_server,
            config_path,
            base_dir,
            daemon: None,
            hook_logs: Default::default(),
            dir,
        };
        if mode == Mode::Rpc {
            world.start_daemon().await.expect("daemon starts");
        }
        world
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("bridge.sock")
    }

    pub fn daemon_log_path(&self) -> PathBuf {
        self.dir.path().join("daemon.log")
    }

    /// Starts `cube-csi-bridge serve` and waits until its socket accepts connections.
    pub async fn start_daemon(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.daemon_log_path())
            .unwrap();
        let mut child = tokio::process::Command::new(BRIDGE)
            .args(["serve", "--config"])
            .arg(&self.config_path)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        for _ in 0..500 {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "daemon exited with {status}: {}",
                    std::fs::read_to_string(self.daemon_log_path()).unwrap_or_default()
                ));
            }
            if tokio::net::UnixStream::connect(self.socket()).await.is_ok() {
                self.daemon = Some(child);
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err("daemon did not listen within 5 s".into())
    }

    fn channel(&self) -> tonic::transport::Channel {
        cube_csi_bridge::csi::client::channel(&Endpoint::Unix(self.socket()))
    }

    /// Everything the bridge logged: the daemon's stderr and every forked hook's.
    pub fn logs(&self) -> String {
        let mut all = std::fs::read_to_string(self.daemon_log_path()).unwrap_or_default();
        for log in self.hook_logs.lock().unwrap().iter() {
            all.push_str(log);
        }
        all
    }

    /// Forks the executable exactly as Cube does and judges the result as Cube does:
    /// exit 0 and the whole stdout one JSON object, with no non-empty `error`.
    async fn fork(
        &self,
        argv: Vec<String>,
    ) -> Result<serde_json::Map<String, serde_json::Value>, CubeError> {
        let out = tokio::process::Command::new(BRIDGE)
            .args(&argv)
            .env("CUBE_CSI_BRIDGE_CONFIG", &self.config_path)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        self.hook_logs.lock().unwrap().push(stderr.clone());
        // Exactly one JSON object, success or failure.
        let object: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
                panic!("stdout of {argv:?} is not one JSON object ({e}): {stdout:?}")
            });
        assert!(
            stdout.trim_end().lines().count() == 1,
            "one line of stdout: {stdout:?}"
        );
        let error = object
            .get("error")
            .and_then(|e| e.as_str())
            .unwrap_or_default();
        if out.status.success() {
            assert!(error.is_empty(), "exit 0 with an error: {stdout}");
            Ok(object)
        } else {
            assert!(
                !error.is_empty(),
                "non-zero exit without an error: {stdout}"
            );
            Err(CubeError {
                message: error.to_string(),
                code: None,
            })
        }
    }

    fn status(e: tonic::Status) -> CubeError {
        CubeError {
            message: e.message().to_string(),
            code: Some(e.code()),
        }
    }

    pub async fn create(&self, volume_id: &str) -> Result<pb::CreateResponse, CubeError> {
        match self.mode {
            Mode::Rpc => VolumeControllerServiceClient::new(self.channel())
                .create(pb::CreateRequest {
                    volume_id: volume_id.into(),
                    name: volume_id.into(),
                })
                .await
                .map(|r| r.into_inner())
                .map_err(Self::status),
            Mode::Binary => {
                let argv = [
                    "--op",
                    "create",
                    "--volume-id",
                    volume_id,
                    "--name",
                    volume_id,
                ];
                let out = self
                    .fork(argv.iter().map(|s| s.to_string()).collect())
                    .await?;
                Ok(pb::CreateResponse {
                    token: out["token"].as_str().unwrap().into(),
                    private_data: out["private_data"].as_str().unwrap().into(),
                })
            }
        }
    }

    pub async fn destroy(&self, volume_id: &str) -> Result<(), CubeError> {
        match self.mode {
            Mode::Rpc => VolumeControllerServiceClient::new(self.channel())
                .destroy(pb::DestroyRequest {
                    volume_id: volume_id.into(),
                })
                .await
                .map(|_| ())
                .map_err(Self::status),
            Mode::Binary => {
                let argv = ["--op", "destroy", "--volume-id", volume_id];
                self.fork(argv.iter().map(|s| s.to_string()).collect())
                    .await
                    .map(|_| ())
            }
        }
    }

    pub async fn attach_in(
        &self,
        base_dir: &Path,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        private_data: &str,
    ) -> Result<pb::AttachResponse, CubeError> {
        self.attach_full(
            "default",
            base_dir,
            sandbox,
            volume_id,
            ref_count,
            private_data,
        )
        .await
    }

    /// Attach as a sandbox of containerd namespace `namespace`.
    pub async fn attach_as(
        &self,
        namespace: &str,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        private_data: &str,
    ) -> Result<pb::AttachResponse, CubeError> {
        self.attach_full(
            namespace,
            &self.base_dir,
            sandbox,
            volume_id,
            ref_count,
            private_data,
        )
        .await
    }

    async fn attach_full(
        &self,
        namespace: &str,
        base_dir: &Path,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        private_data: &str,
    ) -> Result<pb::AttachResponse, CubeError> {
        let base = base_dir.display().to_string();
        match self.mode {
            Mode::Rpc => VolumePluginServiceClient::new(self.channel())
                .attach(pb::AttachRequest {
                    sandbox_id: sandbox.into(),
                    namespace: namespace.into(),
                    volume_id: volume_id.into(),
                    volume_base_dir: base,
                    ref_count,
                    private_data: private_data.into(),
                })
                .await
                .map(|r| r.into_inner())
                .map_err(Self::status),
            Mode::Binary => {
                // Cubelet's order; --private-data only when non-empty.
                let mut argv: Vec<String> = [
                    "--op",
                    "attach",
                    "--sandbox-id",
                    sandbox,
                    "--namespace",
                    namespace,
                    "--volume-id",
                    volume_id,
                    "--ref-count",
                    &ref_count.to_string(),
                    "--volume-base-dir",
                    &base,
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                if !private_data.is_empty() {
                    argv.extend(["--private-data".to_string(), private_data.to_string()]);
                }
                let out = self.fork(argv).await?;
                let metadata = out["metadata"]
                    .as_object()
                    .expect("metadata is an object")
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            v.as_str().expect("metadata values are strings").to_string(),
                        )
                    })
                    .collect();
                Ok(pb::AttachResponse {
                    host_path: out["host_path"].as_str().unwrap().into(),
                    metadata,
                })
            }
        }
    }

    pub async fn attach(
        &self,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        private_data: &str,
    ) -> Result<pb::AttachResponse, CubeError> {
        self.attach_in(&self.base_dir, sandbox, volume_id, ref_count, private_data)
            .await
    }

    pub async fn detach(
        &self,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        metadata: &HashMap<String, String>,
    ) -> Result<(), CubeError> {
        self.detach_as("default", sandbox, volume_id, ref_count, metadata)
            .await
    }

    /// Detach as a sandbox of containerd namespace `namespace`.
    pub async fn detach_as(
        &self,
        namespace: &str,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        metadata: &HashMap<String, String>,
    ) -> Result<(), CubeError> {
        match self.mode {
            Mode::Rpc => VolumePluginServiceClient::new(self.channel())
                .detach(pb::DetachRequest {
                    sandbox_id: sandbox.into(),
                    namespace: namespace.into(),
                    volume_id: volume_id.into(),
                    metadata: metadata.clone(),
                    ref_count,
                })
                .await
                .map(|_| ())
                .map_err(Self::status),
            Mode::Binary => {
                // Go's json.Marshal of a map: compact, sorted keys.
                let sorted: std::collections::BTreeMap<_, _> = metadata.iter().collect();
                let json = serde_json::to_string(&sorted).unwrap();
                let argv = [
                    "--op",
                    "detach",
                    "--sandbox-id",
                    sandbox,
                    "--namespace",
                    namespace,
                    "--volume-id",
                    volume_id,
                    "--ref-count",
                    &ref_count.to_string(),
                    "--metadata",
                    &json,
                ];
                self.fork(argv.iter().map(|s| s.to_string()).collect())
                    .await
                    .map(|_| ())
            }
        }
    }

    /// Mount points at or below the test's temp dir.
    pub fn mounts(&self) -> Vec<PathBuf> {
        let table = MountTable::read(None).unwrap();
        table
            .under(self.dir.path())
            .map(Path::to_path_buf)
            .collect()
    }

    /// Node journal records left.
    pub fn journal_records(&self) -> usize {
        match std::fs::read_dir(self.dir.path().join("state/node")) {
            Ok(entries) => entries
                .filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
                .count(),
            Err(_) => 0,
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Never let a failed test delete its temp dir through a live mount.
        let mut mounts = self.mounts();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
        for m in mounts {
            let _ = ops::unmount_lazy(&m);
        }
    }
}

impl World {
    /// Like [`World::start`], but `edit` rewrites the config text before the daemon
    /// (if any) starts.
    pub async fn start_with_config(
        mode: Mode,
        caps: Caps,
        extra: &str,
        edit: impl FnOnce(String) -> String,
    ) -> World {
        let mut world = World::start(Mode::Binary, caps, extra).await;
        let text = std::fs::read_to_string(&world.config_path).unwrap();
        std::fs::write(&world.config_path, edit(text)).unwrap();
        world.mode = mode;
        if mode == Mode::Rpc {
            world.start_daemon().await.expect("daemon starts");
        }
        world
    }

    /// Like [`World::start`], but the bridge's `[node] mount_view` is `mount_view` (a
    /// namespace file path, `auto`, `none`) instead of `self`.
    pub async fn start_with_mount_view(
        mode: Mode,
        caps: Caps,
        extra: &str,
        mount_view: &str,
    ) -> World {
        World::start_with_config(mode, caps, extra, |text| {
            let default = "\nmount_view = \"self\"\n";
            assert!(
                text.contains(default),
                "config_text sets mount_view: {text}"
            );
            let setting = format!(
                "\nmount_view = {}\n",
                toml::Value::String(mount_view.to_string())
            );
            text.replacen(default, &setting, 1)
        })
        .await
    }
}
