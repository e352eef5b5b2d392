//! Test scaffolding: a fake CSI driver, the bridge started as Cube would use it (the
//! `serve` daemon dialed over its socket, or the executable forked per hook with Cube's
//! exact argv; both behind `callers::CubeCaller`, with the Go cubeclient as a third
//! caller), and mount hygiene for tests that make real mounts.

#![allow(dead_code)]

pub mod callers;
pub mod csi_mock;
pub mod cube_node;
pub mod cube_peers;
pub mod fake_driver;
pub mod k8s;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use callers::{BinaryCaller, CubeCaller, GoCaller, GoTransport, RpcCaller};
use cube_csi_bridge::mount::{MountTable, ops};
use cube_csi_bridge::proto::cube::v1 as pb;
use fake_driver::{Caps, FakeDriver, Running};

pub use callers::CubeError;

pub const BRIDGE: &str = env!("CARGO_BIN_EXE_cube-csi-bridge");
/// What a binary registration forks: the hook front, which answers the hot paths itself and
/// execs BRIDGE (its sibling) for everything else; every binary-mode test goes through it.
pub const HOOK: &str = env!("CARGO_BIN_EXE_cube-csi-hook");
/// The Cube driver name the tests register.
pub const DRIVER: &str = "fake";

/// A loopback TCP port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether the tests run in CI (`CI` set, as `CI=true bash .ci/run` does), where no test
/// may skip itself.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Reports why a test cannot run here. Outside CI it skips (the caller returns); in CI
/// it fails: CI provides root and every peer, so a skip there would hide a lost test.
pub fn skip(reason: &str) {
    assert!(
        !in_ci(),
        "CI must run every test, but this one would be skipped: {reason}"
    );
    eprintln!("skipped: {reason}");
}

/// Polls `done` (a condition outside the fake driver: a file, a mount, a process) until it
/// holds; panics with `what` and the time waited after `limit`. The way to wait for
/// something that sends no signal, instead of sleeping and hoping it happened.
pub async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let until = std::time::Instant::now() + limit;
    while !done() {
        assert!(
            std::time::Instant::now() < until,
            "not within {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One `GET /metrics` on the loopback port, the whole HTTP answer as text.
pub async fn scrape_metrics(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).await.unwrap();
    text
}

/// Skips a test that needs root (real mounts) when not root; fails it in CI.
#[macro_export]
macro_rules! require_root {
    () => {
        if !nix::unistd::Uid::effective().is_root() {
            $crate::common::skip("this test makes real mounts and needs root");
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

/// One test's world: temp dir, fake driver, bridge config, and (rpc mode) the daemon.
pub struct World {
    pub mode: Mode,
    pub dir: tempfile::TempDir,
    pub driver: FakeDriver,
    pub driver_server: Option<Running>,
    pub config_path: PathBuf,
    pub base_dir: PathBuf,
    pub daemon: Option<tokio::process::Child>,
    hook_logs: Arc<Mutex<Vec<String>>>,
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
        self.start_daemon_with_env(&[]).await
    }

    /// [`World::start_daemon`] with extra environment (e.g. a fault-injection point).
    pub async fn start_daemon_with_env(&mut self, env: &[(&str, &str)]) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.daemon_log_path())
            .unwrap();
        let mut child = tokio::process::Command::new(BRIDGE)
            .args(["serve", "--config"])
            .arg(&self.config_path)
            .env("RUST_LOG", "debug")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // Generous: a debug build on a loaded machine can take seconds to start.
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < until {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "daemon exited with {status}: {}",
                    std::fs::read_to_string(self.daemon_log_path()).unwrap_or_default()
                ));
            }
            // The kernel accepts a connection as soon as the socket listens, before the
            // daemon serves it: an answer of its health service is what says it serves.
            if tokio::net::UnixStream::connect(self.socket()).await.is_ok()
                && self.health_answers(until).await
            {
                self.daemon = Some(child);
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err("daemon did not listen within 30 s".into())
    }

    /// Whether the daemon's health service answers a check (any status) before `until`.
    async fn health_answers(&self, until: std::time::Instant) -> bool {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_client::HealthClient;
        let channel = cube_csi_bridge::csi::client::channel(&cube_csi_bridge::csi::Endpoint::Unix(
            self.socket(),
        ));
        let mut client = HealthClient::new(channel);
        let check = client.check(HealthCheckRequest {
            service: String::new(),
        });
        matches!(
            tokio::time::timeout_at(until.into(), check).await,
            Ok(Ok(_))
        )
    }

    /// How many lines of the daemon log (every daemon this world started) contain `needle`.
    pub fn daemon_log_lines(&self, needle: &str) -> usize {
        std::fs::read_to_string(self.daemon_log_path())
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits until `count` lines of the daemon log contain `needle`; panics with the log
    /// after `limit`.
    pub async fn wait_for_daemon_log(&self, needle: &str, count: usize, limit: Duration) {
        let until = std::time::Instant::now() + limit;
        while self.daemon_log_lines(needle) < count {
            assert!(
                std::time::Instant::now() < until,
                "the daemon did not log {needle:?} {count} time(s) within {limit:?}:\n{}",
                std::fs::read_to_string(self.daemon_log_path()).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Everything the bridge logged: the daemon's stderr and every forked hook's.
    pub fn logs(&self) -> String {
        let mut all = std::fs::read_to_string(self.daemon_log_path()).unwrap_or_default();
        for log in self.hook_logs.lock().unwrap().iter() {
            all.push_str(log);
        }
        all
    }

    /// The caller of this world's mode: the rpc client, or the forked executable.
    pub fn caller(&self) -> Box<dyn CubeCaller> {
        match self.mode {
            Mode::Rpc => Box::new(self.rpc_caller()),
            Mode::Binary => Box::new(self.binary_caller()),
        }
    }

    pub fn rpc_caller(&self) -> RpcCaller {
        RpcCaller::new(&self.socket())
    }

    /// Forks the executable with this world's config; its stderr joins [`World::logs`].
    pub fn binary_caller(&self) -> BinaryCaller {
        BinaryCaller {
            logs: self.hook_logs.clone(),
            ..BinaryCaller::new(&self.config_path)
        }
    }

    /// cubeclient (from `peers_bin`) in this world's mode.
    pub fn go_caller(&self, peers_bin: &Path) -> GoCaller {
        let transport = match self.mode {
            Mode::Rpc => GoTransport::Rpc {
                socket: self.socket(),
            },
            Mode::Binary => GoTransport::Binary {
                config: self.config_path.clone(),
            },
        };
        GoCaller::new(peers_bin, transport)
    }

    pub async fn create(&self, volume_id: &str) -> Result<pb::CreateResponse, CubeError> {
        self.caller()
            .create(callers::create_request(volume_id))
            .await
    }

    pub async fn destroy(&self, volume_id: &str) -> Result<(), CubeError> {
        self.caller()
            .destroy(pb::DestroyRequest {
                volume_id: volume_id.into(),
            })
            .await
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
        let request = callers::attach_request(
            namespace,
            base_dir,
            sandbox,
            volume_id,
            ref_count,
            private_data,
        );
        self.caller().attach(request).await
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
        let request = callers::detach_request(namespace, sandbox, volume_id, ref_count, metadata);
        self.caller().detach(request).await
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

    /// Edits `volume`'s node journal record (JSON) in place.
    pub fn edit_node_record(&self, volume: &str, edit: impl FnOnce(&mut serde_json::Value)) {
        let path = self.dir.path().join(format!("state/node/{volume}.json"));
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut json);
        std::fs::write(&path, json.to_string()).unwrap();
    }

    /// Leaves `volume`'s record and holder log as a hook stopped before it recorded a
    /// holder leaves them: nobody holds it (in whatever form the journal keeps holders);
    /// `edit` changes the rest of the record.
    pub fn leave_held_by_nobody(&self, volume: &str, edit: impl FnOnce(&mut serde_json::Value)) {
        self.edit_node_record(volume, |json| {
            json["holders"] = match json["holders"] {
                serde_json::Value::Array(_) => serde_json::json!([]),
                _ => serde_json::json!({}),
            };
            edit(json);
        });
        let log = self.dir.path().join(format!("state/node/{volume}.holders"));
        std::fs::write(log, "*\t0\n").unwrap();
    }
}

impl Drop for World {
    fn drop(&mut self) {
        unmount_everything_under(self.dir.path());
    }
}

/// Detaches every mount under `dir`, deepest first. A test's world does this when it is
/// dropped, so that a test that fails midway leaves no mount on the host and never has
/// its temp dir deleted through a live one.
pub fn unmount_everything_under(dir: &Path) {
    let Ok(table) = MountTable::read(None) else {
        return;
    };
    let mut mounts: Vec<PathBuf> = table.under(dir).map(Path::to_path_buf).collect();
    mounts.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for m in mounts {
        let _ = ops::unmount_lazy(&m);
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

/// The World's config with the forked workers' log in a file of its state dir.
pub fn with_worker_log(text: String) -> String {
    let file = format!("{}/worker.log", state_dir(&text));
    with_worker_log_at(text, &file)
}

/// The World's config with the forked workers' log in `file`.
pub fn with_worker_log_at(text: String, file: &str) -> String {
    text.replacen(
        "[state]\n",
        &format!("[state]\nworker_log = \"{file}\"\n"),
        1,
    )
}

/// The state dir a World's config names.
pub fn state_dir(text: &str) -> String {
    text.lines()
        .find_map(|l| {
            l.strip_prefix("dir = \"")?
                .strip_suffix('"')
                .map(str::to_string)
        })
        .expect("the World's config names its state dir")
}

/// What is left in a volume base dir once every volume is detached: its entries and
/// those of `.staging`, which itself stays (the bridge's own directory, kept for the next
/// volume to stage), and anything but an empty directory in `.staging/.parked`.
pub fn left_in_base_dir(base: &Path) -> Vec<PathBuf> {
    let entries = |dir: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let mut left = entries(base);
    let staging = base.join(".staging");
    if std::fs::symlink_metadata(&staging).is_ok_and(|m| m.is_dir()) {
        left.retain(|path| path != &staging);
        left.extend(entries(&staging));
    }
    // Staging dirs parked for their volume's next first Attach are the bridge's, and
    // empty: one that holds anything is left over.
    let parked = staging.join(".parked");
    if std::fs::symlink_metadata(&parked).is_ok_and(|m| m.is_dir()) {
        left.retain(|path| path != &parked);
        left.extend(entries(&parked).into_iter().filter(|dir| {
            dir.file_name() != Some(std::ffi::OsStr::new(".pruned"))
                && !(std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir())
                    && entries(dir).is_empty())
        }));
    }
    left
}

/// Whether a process forked for the binary hooks of the World whose config is `config`
/// is still alive (a front, or a worker, which goes on after its hook has answered to
/// finish work that earlier, killed workers abandoned): they carry the config in their
/// environment. A test that changes the state dir under them (fills its disk) waits for
/// none to be left.
pub fn hook_processes_alive(config: &Path) -> bool {
    let needle = format!("CUBE_CSI_BRIDGE_CONFIG={}", config.display());
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| {
            entry
                .file_name()
                .to_str()
                .is_some_and(|name| name.bytes().all(|b| b.is_ascii_digit()))
        })
        .any(|entry| {
            std::fs::read(entry.path().join("environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|var| var == needle.as_bytes()))
        })
}

/// The children of process `pid` (a forked hook's front: its worker, once forked).
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// xorshift64*: enough to spread choices, reproducible from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A duration in [from, to) milliseconds.
    pub fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.next() % (to - from))
    }
}

/// The seed of a randomised test: `env` when it is set (to replay a run), else a fresh
/// odd one from the clock. The test prints it.
pub fn seed_from(env: &str) -> u64 {
    std::env::var(env)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        })
}

/// Whether `name` is `base`, `-` and the 12 hex digits the bridge gives each Create's
/// CreateVolume name (`cube-<volume_id>` is the base with the default prefix).
pub fn is_name_of_a_create(name: &str, base: &str) -> bool {
    name.strip_prefix(base)
        .and_then(|rest| rest.strip_prefix('-'))
        .is_some_and(|nonce| nonce.len() == 12 && nonce.bytes().all(|b| b.is_ascii_hexdigit()))
}
