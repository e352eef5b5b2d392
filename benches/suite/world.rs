//! The suite's surroundings: options and iteration counts, the executables it drives
//! (the release bridge, the Go runner, csi-test's mock driver, the Kubernetes peers),
//! its work directory, and starting drivers, floors and bridge daemons in it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use nix::mount::{MntFlags, MsFlags};

use crate::fake_csi;
use crate::procs::Proc;

/// The bridge executable under test unless --bridge names another: the release build
/// cargo made for this bench.
pub const BRIDGE: &str = env!("CARGO_BIN_EXE_cube-csi-bridge");
/// The Cube driver name every bench bridge serves.
pub const DRIVER: &str = "bench";

/// Why the csi-mock figures are not measured when `World::csi_mock` is None.
pub const CSI_MOCK_MISSING: &str =
    "no csi-mock in CUBE_CSI_BRIDGE_PEERS_BIN (scripts/install-test-peers.sh builds it)";

/// Every section, in the order they run.
pub const SECTIONS: &[&str] = &[
    "hot",
    "flood",
    "first",
    "binary",
    "concurrent",
    "store",
    "kubernetes",
    "ready",
];

#[derive(Debug, Clone, Default)]
pub struct Options {
    pub quick: bool,
    pub only: Option<Vec<String>>,
    pub keep: bool,
    pub profile: Option<PathBuf>,
    /// Another build of the bridge to measure (e.g. before and after a change).
    pub bridge: Option<PathBuf>,
    /// Where the work directory (state, journal, locks, volumes) is made: /var/tmp unless
    /// given. A tmpfs here measures the bridge without the cost of durable writes.
    pub work_dir: Option<PathBuf>,
}

impl Options {
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut o = Options::default();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--quick" => o.quick = true,
                "--keep" => o.keep = true,
                "--only" => {
                    let list = it.next().ok_or("--only needs a list of sections")?;
                    let names: Vec<String> = list.split(',').map(str::to_string).collect();
                    if let Some(bad) = names.iter().find(|n| !SECTIONS.contains(&n.as_str())) {
                        return Err(format!("unknown section {bad:?}"));
                    }
                    o.only = Some(names);
                }
                "--profile" => {
                    let dir = it.next().ok_or("--profile needs a directory")?;
                    o.profile = Some(PathBuf::from(dir));
                }
                "--bridge" => {
                    let exe = it.next().ok_or("--bridge needs an executable")?;
                    o.bridge = Some(PathBuf::from(exe));
                }
                "--work-dir" => {
                    let dir = it.next().ok_or("--work-dir needs a directory")?;
                    o.work_dir = Some(PathBuf::from(dir));
                }
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        Ok(o)
    }

    pub fn runs(&self, section: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|only| only.iter().any(|s| s == section))
    }
}

/// Iteration counts. Every sequential figure is measured in three rounds, interleaved
/// with its baseline, so that a burst of load from elsewhere on the machine lands on both.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    pub rounds: usize,
    /// Hot Attach + Detach pairs per target (the issue's runs used 3,000).
    pub hot_pairs: usize,
    pub warmup_pairs: usize,
    /// First Attach + last Detach per driver.
    pub first_fast: usize,
    pub first_slow: usize,
    pub first_mock: usize,
    /// Forked hook pairs.
    pub binary_pairs: usize,
    /// Rounds of 256 concurrent first Attaches.
    pub concurrent_rounds: usize,
    /// Create + Destroy pairs at each store size.
    pub create_destroy_pairs: usize,
    /// Daemon starts.
    pub ready_runs: usize,
    /// Seconds a daemon sits idle before its memory is read.
    pub idle_secs: u64,
}

impl Sizes {
    pub fn new(quick: bool) -> Sizes {
        if quick {
            Sizes {
                rounds: 3,
                hot_pairs: 600,
                warmup_pairs: 60,
                first_fast: 90,
                first_slow: 15,
                first_mock: 30,
                binary_pairs: 90,
                concurrent_rounds: 1,
                create_destroy_pairs: 90,
                ready_runs: 6,
                idle_secs: 1,
            }
        } else {
            Sizes {
                rounds: 3,
                hot_pairs: 3000,
                warmup_pairs: 300,
                first_fast: 600,
                first_slow: 90,
                first_mock: 150,
                binary_pairs: 600,
                concurrent_rounds: 3,
                create_destroy_pairs: 300,
                ready_runs: 21,
                idle_secs: 3,
            }
        }
    }
}

/// The executables and the work directory of one run.
pub struct World {
    pub options: Options,
    pub sizes: Sizes,
    /// The bridge executable measured.
    pub bridge: PathBuf,
    /// What Cube forks for a binary registration: the hook front beside `bridge`
    /// (`cube-csi-hook`), or `bridge` itself for a build that has none.
    pub hook: PathBuf,
    /// This executable (re-run for `fake-csi` and `tonic-floor`).
    pub suite: PathBuf,
    pub cubeclient: PathBuf,
    /// csi-test's mock driver (`csi-mock`, built beside cubeclient), when there.
    pub csi_mock: Option<PathBuf>,
    /// The directory holding kube-apiserver and etcd, when built.
    pub k8s: Option<PathBuf>,
    pub root: tempfile::TempDir,
}

fn env_dir(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

impl World {
    pub fn new(options: Options) -> anyhow::Result<World> {
        let peers = env_dir("CUBE_CSI_BRIDGE_PEERS_BIN").context(
            "CUBE_CSI_BRIDGE_PEERS_BIN is not set: run the suite with scripts/bench.sh, which \
             builds the Go Cube client (scripts/install-test-peers.sh)",
        )?;
        let cubeclient = peers.join("cubeclient");
        if !cubeclient.is_file() {
            bail!("{} does not exist", cubeclient.display());
        }
        let parent = options
            .work_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("/var/tmp"));
        let root = tempfile::Builder::new()
            .prefix("ccb-bench-")
            .tempdir_in(&parent)
            .with_context(|| format!("making the work directory in {}", parent.display()))?;
        let bridge = options
            .bridge
            .clone()
            .unwrap_or_else(|| PathBuf::from(BRIDGE));
        let bridge = bridge
            .canonicalize()
            .with_context(|| format!("the bridge executable {}", bridge.display()))?;
        let csi_mock = Some(peers.join("csi-mock")).filter(|p| p.is_file());
        let hook = Some(bridge.with_file_name("cube-csi-hook"))
            .filter(|p| p.is_file())
            .unwrap_or_else(|| bridge.clone());
        Ok(World {
            sizes: Sizes::new(options.quick),
            bridge,
            hook,
            options,
            suite: std::env::current_exe()?,
            cubeclient,
            csi_mock,
            k8s: env_dir("CUBE_CSI_BRIDGE_K8S_BIN"),
            root,
        })
    }

    /// A fresh directory for one component.
    pub fn dir(&self, name: &str) -> anyhow::Result<PathBuf> {
        let dir = self.root.path().join(name);
        std::fs::create_dir_all(&dir)?;
        Ok(dir)
    }

    /// Starts the fake CSI driver; returns it and its socket.
    pub fn fake_driver(
        &self,
        name: &str,
        latency_ms: u64,
        stage: bool,
    ) -> anyhow::Result<(Proc, PathBuf)> {
        let dir = self.dir(name)?;
        let options = fake_csi::Options {
            socket: dir.join("csi.sock"),
            data_dir: dir.join("data"),
            latency: Duration::from_millis(latency_ms),
            stage,
        };
        let mut cmd = Command::new(&self.suite);
        cmd.args(options.argv());
        let mut proc = Proc::spawn(name, cmd, &dir.join("driver.log"))?;
        proc.wait_for_socket(&options.socket, Duration::from_secs(20))?;
        Ok((proc, options.socket))
    }

    /// Starts csi-test's mock driver (`cmd/mock-driver`, v4.2.0), when it is built:
    /// `-disable-attach` (no ControllerPublish; NodeStage/NodePublish need no `device`
    /// in the publish context), klog at its default verbosity (no per-call log line).
    /// It mounts nothing: NodePublish only makes the target directory.
    pub fn mock_driver(&self, name: &str) -> anyhow::Result<Option<(Proc, PathBuf)>> {
        let Some(exe) = &self.csi_mock else {
            return Ok(None);
        };
        let dir = self.dir(name)?;
        let socket = dir.join("csi.sock");
        let mut cmd = Command::new(exe);
        cmd.env("CSI_ENDPOINT", &socket)
            .env_remove("CSI_CONTROLLER_ENDPOINT")
            .arg("-name=mock.csi.test")
            .arg("-disable-attach");
        let mut proc = Proc::spawn(name, cmd, &dir.join("driver.log"))?;
        proc.wait_for_socket(&socket, Duration::from_secs(20))?;
        Ok(Some((proc, socket)))
    }

    /// Starts a trivial plugin: `go` (grpc-go, cubeclient floor-plugin) or tonic.
    pub fn floor(&self, go: bool) -> anyhow::Result<(Proc, PathBuf)> {
        let name = if go { "floor-grpc-go" } else { "floor-tonic" };
        let dir = self.dir(name)?;
        let socket = dir.join("plugin.sock");
        let mut cmd = if go {
            let mut c = Command::new(&self.cubeclient);
            c.arg("floor-plugin");
            c
        } else {
            let mut c = Command::new(&self.suite);
            c.arg("tonic-floor");
            c
        };
        cmd.arg("--listen").arg(&socket);
        let mut proc = Proc::spawn(name, cmd, &dir.join("plugin.log"))?;
        proc.wait_for_socket(&socket, Duration::from_secs(20))?;
        Ok((proc, socket))
    }

    /// Starts the bare tonic relay (`suite tonic-relay`) in front of the driver at
    /// `driver`: returns it, its socket and the base dir it attaches under.
    pub fn relay(&self, name: &str, driver: &Path) -> anyhow::Result<(Proc, PathBuf, PathBuf)> {
        let dir = self.dir(name)?;
        let (socket, base) = (dir.join("plugin.sock"), dir.join("volumes"));
        std::fs::create_dir_all(&base)?;
        let mut cmd = Command::new(&self.suite);
        cmd.arg("tonic-relay")
            .arg("--listen")
            .arg(&socket)
            .arg("--driver")
            .arg(driver)
            .arg("--base")
            .arg(&base);
        let mut proc = Proc::spawn(name, cmd, &dir.join("plugin.log"))?;
        proc.wait_for_socket(&socket, Duration::from_secs(20))?;
        Ok((proc, socket, base))
    }

    /// Starts the Go runner, logging to the work directory.
    pub fn runner(&self) -> anyhow::Result<crate::runner::Runner> {
        crate::runner::Runner::start(&self.cubeclient, &self.root.path().join("runner.log"))
    }

    /// Which bridge build is measured: its path, and the checkout it was built from.
    /// Where the state lives, and on which file system (durable writes cost what that
    /// file system makes them cost).
    pub fn work_dir_description(&self) -> String {
        let path = self.root.path().display().to_string();
        let fs = command_line("stat", &["-f", "-c", "%T", &path]);
        format!("work directory (state, journal, locks): {path} on {fs}")
    }

    pub fn bridge_description(&self) -> String {
        if self.options.bridge.is_some() {
            return format!("{} (given with --bridge)", self.bridge.display());
        }
        let git = |args: &[&str]| {
            let mut all = vec!["-C", env!("CARGO_MANIFEST_DIR")];
            all.extend_from_slice(args);
            command_line("git", &all)
        };
        let commit = git(&["rev-parse", "--short", "HEAD"]);
        let status = git(&["status", "--porcelain", "--untracked-files=no"]);
        let dirty = !status.is_empty() && status != "unknown";
        format!(
            "{} (this checkout, commit {commit}{})",
            self.bridge.display(),
            if dirty { " with local changes" } else { "" }
        )
    }

    /// Removes the work directory (unless --keep), unmounting whatever is left in it first.
    pub fn finish(self) {
        unmount_below(self.root.path());
        if self.options.keep {
            eprintln!("work directory kept: {}", self.root.keep().display());
        }
    }
}

/// How the bridge keeps its controller store.
#[derive(Debug, Clone)]
pub enum Store {
    Embedded,
    Kubernetes { kubeconfig: PathBuf },
}

/// One bridge instance's config.
#[derive(Debug, Clone)]
pub struct BridgeSpec {
    pub name: String,
    pub csi_socket: PathBuf,
    pub services: &'static str,
    pub access_mode: &'static str,
    pub capacity_bytes: u64,
    pub store: Store,
    /// `node.mount_view`: "self" (the suite has no separate Cubelet namespace), or
    /// "none" for a driver that mounts nothing.
    pub mount_view: &'static str,
    /// More lines of `[serve]` (e.g. `tcp`, `allowed_uids`).
    pub serve_extra: String,
    /// More tables at the end of the config (e.g. `[metrics]`).
    pub extra: String,
}

impl BridgeSpec {
    pub fn new(name: &str, csi_socket: &Path) -> BridgeSpec {
        BridgeSpec {
            name: name.into(),
            csi_socket: csi_socket.to_path_buf(),
            services: "both",
            access_mode: "multi_node_multi_writer",
            capacity_bytes: 0,
            store: Store::Embedded,
            mount_view: "self",
            serve_extra: String::new(),
            extra: String::new(),
        }
    }

    /// For csi-mock: it mounts nothing, so no mount check (`mount_view = "none"`).
    pub fn mock(name: &str, csi_socket: &Path) -> BridgeSpec {
        BridgeSpec {
            mount_view: "none",
            ..BridgeSpec::new(name, csi_socket)
        }
    }
}

/// A bridge's files: config, socket, volume base dir, log.
#[derive(Debug, Clone)]
pub struct BridgeFiles {
    pub config: PathBuf,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub base_dir: PathBuf,
    pub log: PathBuf,
}

impl World {
    /// Writes the config of a bridge instance. Production defaults everywhere except the
    /// paths and `mount_view` (`"self"`: the suite has no separate Cubelet namespace;
    /// `"none"` for csi-mock, which mounts nothing).
    pub fn bridge_files(&self, spec: &BridgeSpec) -> anyhow::Result<BridgeFiles> {
        let dir = self.dir(&spec.name)?;
        let files = BridgeFiles {
            config: dir.join("bridge.toml"),
            state_dir: dir.join("state"),
            socket: dir.join("bridge.sock"),
            base_dir: dir.join("volumes"),
            log: dir.join("bridge.log"),
        };
        let (store, kube) = match &spec.store {
            Store::Embedded => ("embedded", String::new()),
            Store::Kubernetes { kubeconfig } => (
                "kubernetes",
                format!(
                    "[kubernetes]\nkubeconfig = \"{}\"\nnamespace = \"{}\"\n",
                    kubeconfig.display(),
                    crate::kube_api::NAMESPACE
                ),
            ),
        };
        let text = format!(
            r#"driver = "{DRIVER}"

[csi]
endpoint = "unix://{csi}"

[serve]
socket = "{socket}"
services = "{services}"
{serve_extra}
[volume]
access_mode = "{access}"
capacity_bytes = {capacity}

[state]
dir = "{state}"
lock_dir = "{dir}/locks"
controller_store = "{store}"

[node]
default_volume_base_dir = "{base}"
mount_view = "{mount_view}"

{kube}{extra}"#,
            csi = spec.csi_socket.display(),
            socket = files.socket.display(),
            services = spec.services,
            access = spec.access_mode,
            capacity = spec.capacity_bytes,
            dir = dir.display(),
            state = files.state_dir.display(),
            base = files.base_dir.display(),
            mount_view = spec.mount_view,
            serve_extra = spec.serve_extra,
            extra = spec.extra,
        );
        std::fs::write(&files.config, text)?;
        Ok(files)
    }

    /// The command that starts `serve` on these files; its log level is the default
    /// (`info`: one line per hook), as in production.
    pub fn serve_command(&self, files: &BridgeFiles) -> Command {
        let mut cmd = Command::new(&self.bridge);
        cmd.arg("serve").arg("--config").arg(&files.config);
        cmd.env_remove("RUST_LOG");
        cmd
    }

    /// Writes the config and starts the daemon; returns once its socket accepts.
    pub fn bridge(&self, spec: &BridgeSpec) -> anyhow::Result<(Proc, BridgeFiles)> {
        let files = self.bridge_files(spec)?;
        let mut proc = Proc::spawn(
            &format!("bridge {}", spec.name),
            self.serve_command(&files),
            &files.log,
        )?;
        proc.wait_for_socket(&files.socket, Duration::from_secs(30))?;
        Ok((proc, files))
    }
}

/// A loopback address nothing listens on right now.
pub fn free_loopback_addr() -> anyhow::Result<std::net::SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// Enters a new mount namespace whose mounts propagate nowhere.
pub fn private_mount_namespace() -> anyhow::Result<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
    nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    Ok(())
}

/// Lazily unmounts every mount point below `dir`, deepest first.
pub fn unmount_below(dir: &Path) {
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir) && p != dir)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = nix::mount::umount2(&p, MntFlags::MNT_DETACH);
    }
}

/// The machine and the moment, for the header of a run.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let date = command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    format!(
        "{date}; {cores} cores, {cpu}; Linux {}; load average {}",
        kernel.trim(),
        load_average()
    )
}

/// The 1-, 5- and 15-minute load averages.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|t| t.split(' ').take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// Peak resident memory (VmHWM) of `pid` in KiB.
pub fn peak_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/<pid>/status")
}
