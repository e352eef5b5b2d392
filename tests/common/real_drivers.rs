//! The real CSI drivers behind the bridge: csi-driver-host-path's `hostpathplugin` and
//! csi-driver-nfs's `nfsplugin`, unmodified, built from the pinned release sources by
//! scripts/install-real-drivers.sh (their directory is `$CUBE_CSI_BRIDGE_REAL_DRIVERS_BIN`).
//!
//! A [`RealNode`] is one Cube node as the tests build it: a driver process, a simulated
//! Cubelet namespace, the volume base dir as a shared mount, and the bridge (the `serve`
//! daemon, or the executable Cube forks), with cubeclient as Cube. nfsplugin runs in a
//! mount namespace of its own where `/sbin/mount.nfs` is the test-only helper
//! tests/peers/nfs-sbin/mount.nfs (tests/peers/nfs-driver-ns.sh): NFS "servers" are
//! directories under [`RealNode::exports`]; only the kernel NFS client is stood in for.
//! Everything a node mounts is unmounted when it is dropped, even after a failed test.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use cube_csi_bridge::mount::{MountTable, ops};

use super::cube_peers::{BaseDir, Cube, CubeletNs, PEERS_BIN_ENV, PEERS_DIR, peer_dir};
use super::{BRIDGE, Mode};

pub const REAL_DRIVERS_BIN_ENV: &str = "CUBE_CSI_BRIDGE_REAL_DRIVERS_BIN";
/// The NFS server name the tests' volumes use, and its exported directory.
pub const NFS_SERVER: &str = "nfs.test";
pub const NFS_SHARE: &str = "/export";
/// Mount flags given to nfsplugin (they reach mount.nfs, which records them).
pub const NFS_MOUNT_FLAGS: [&str; 2] = ["nfsvers=4.1", "hard"];
/// How long a driver or the daemon may take to listen on a loaded machine.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Skips the test unless root, the real drivers and cubeclient are built (in CI a
/// missing one fails instead); yields the [`Bins`].
#[macro_export]
macro_rules! require_real_drivers {
    () => {{
        require_root!();
        match common::real_drivers::Bins::from_env() {
            Some(bins) => bins,
            None => return,
        }
    }};
}

/// Where the peers' executables are.
#[derive(Debug, Clone)]
pub struct Bins {
    /// hostpathplugin and nfsplugin.
    pub drivers: PathBuf,
    /// cubeclient.
    pub peers: PathBuf,
}

impl Bins {
    pub fn from_env() -> Option<Bins> {
        let drivers = peer_dir(
            REAL_DRIVERS_BIN_ENV,
            &["hostpathplugin", "nfsplugin"],
            "scripts/install-real-drivers.sh",
        )?;
        let peers = peer_dir(
            PEERS_BIN_ENV,
            &["cubeclient"],
            "scripts/install-test-peers.sh",
        )?;
        Some(Bins { drivers, peers })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverKind {
    /// hostpathplugin: STAGE_UNSTAGE, a bind mount of its own directory on publish.
    HostPath,
    /// nfsplugin: no STAGE_UNSTAGE, `mount -t nfs SERVER:/SHARE/SUBDIR` on publish.
    Nfs,
}

impl DriverKind {
    /// The Cube driver name the bridge serves (the host_path prefix).
    pub fn cube_name(self) -> &'static str {
        match self {
            DriverKind::HostPath => "hostpath",
            DriverKind::Nfs => "nfs",
        }
    }

    fn volume_config(self) -> String {
        match self {
            DriverKind::HostPath => {
                "access_mode = \"single_node_multi_writer\"\ncapacity_bytes = 1073741824\n".into()
            }
            DriverKind::Nfs => format!(
                "access_mode = \"multi_node_multi_writer\"\nmount_flags = {}\nparameters = {{ server = \"{NFS_SERVER}\", share = \"{NFS_SHARE}\" }}\n",
                toml::Value::from(NFS_MOUNT_FLAGS.to_vec())
            ),
        }
    }
}

/// A driver process; killed on drop (nfsplugin's namespace ends with it).
pub struct RealDriver {
    pub kind: DriverKind,
    child: std::process::Child,
    pub socket: PathBuf,
    pub log: PathBuf,
    /// hostpathplugin's `--statedir` (its `state.json` lists its volumes).
    pub state_dir: PathBuf,
    /// Where mount.nfs records the mounts nfsplugin made (nfs only).
    pub nfs_log: PathBuf,
}

impl RealDriver {
    /// Starts hostpathplugin in the host namespace, with its state in `dir`.
    pub fn hostpath(bin: &Path, dir: &Path, node_id: &str) -> RealDriver {
        let socket = dir.join("hostpath.sock");
        let state_dir = dir.join("hostpath-state");
        let mut cmd = std::process::Command::new(bin.join("hostpathplugin"));
        cmd.arg(format!("--endpoint=unix://{}", socket.display()))
            .arg(format!("--nodeid={node_id}"))
            .arg(format!("--statedir={}", state_dir.display()))
            .arg("-v=4");
        Self::spawn(
            DriverKind::HostPath,
            cmd,
            dir,
            socket,
            state_dir,
            PathBuf::new(),
        )
    }

    /// Starts nfsplugin in its own mount namespace (nfs-driver-ns.sh) serving the NFS
    /// "servers" under `exports`, with its working mounts in `dir`.
    pub fn nfs(bin: &Path, dir: &Path, exports: &Path, node_id: &str) -> RealDriver {
        let socket = dir.join("nfs.sock");
        let work = dir.join("nfs-work");
        std::fs::create_dir_all(&work).unwrap();
        let nfs_log = dir.join("mount.nfs.log");
        let mut cmd = std::process::Command::new("sh");
        cmd.arg(Path::new(PEERS_DIR).join("nfs-driver-ns.sh"))
            .arg(exports)
            .arg(bin.join("nfsplugin"))
            .arg(format!("--endpoint=unix://{}", socket.display()))
            .arg(format!("--nodeid={node_id}"))
            .arg(format!("--working-mount-dir={}", work.display()))
            .arg("-v=4")
            .env("CUBE_TEST_NFS_LOG", &nfs_log);
        Self::spawn(DriverKind::Nfs, cmd, dir, socket, PathBuf::new(), nfs_log)
    }

    fn spawn(
        kind: DriverKind,
        mut cmd: std::process::Command,
        dir: &Path,
        socket: PathBuf,
        state_dir: PathBuf,
        nfs_log: PathBuf,
    ) -> RealDriver {
        let log = dir.join(format!("{}-driver.log", kind.cube_name()));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut driver = RealDriver {
            kind,
            child,
            socket,
            log,
            state_dir,
            nfs_log,
        };
        let deadline = std::time::Instant::now() + START_TIMEOUT;
        while std::os::unix::net::UnixStream::connect(&driver.socket).is_err() {
            if let Ok(Some(status)) = driver.child.try_wait() {
                panic!(
                    "{kind:?} driver exited with {status}: {}",
                    driver.log_text()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{kind:?} driver did not listen on {}: {}",
                driver.socket.display(),
                driver.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        driver
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// hostpathplugin's volumes as its `state.json` lists them (`VolID`, `VolPath`,
    /// `Staged`, `Published`, …).
    pub fn hostpath_volumes(&self) -> Vec<serde_json::Value> {
        let path = self.state_dir.join("state.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Vec::new();
        };
        let state: serde_json::Value = serde_json::from_str(&text).unwrap();
        state["Volumes"].as_array().cloned().unwrap_or_default()
    }

    /// The mounts mount.nfs made for nfsplugin: `(SERVER:/PATH, target, options)`.
    pub fn nfs_mounts(&self) -> Vec<(String, PathBuf, String)> {
        std::fs::read_to_string(&self.nfs_log)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let mut words = line.strip_prefix("mount ")?.splitn(3, ' ');
                let spec = words.next()?.to_string();
                let target = PathBuf::from(words.next()?);
                Some((spec, target, words.next().unwrap_or_default().to_string()))
            })
            .collect()
    }
}

impl Drop for RealDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a [`RealNode`] is set up.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// `serve.services`: "both", "node" or "controller".
    pub services: &'static str,
    pub node_id: &'static str,
    /// The NFS exports root to share with another node (default: the node's own).
    pub exports: Option<PathBuf>,
    /// TOML tables appended to the bridge's config.
    pub extra_config: String,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            services: "both",
            node_id: "node-1",
            exports: None,
            extra_config: String::new(),
        }
    }
}

/// One Cube node with a real driver (module docs). Drop it before any node whose
/// exports it shares.
pub struct RealNode {
    pub kind: DriverKind,
    pub mode: Mode,
    pub bins: Bins,
    pub base_dir: PathBuf,
    pub config_path: PathBuf,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    /// The NFS "servers": `SERVER:/PATH` is `exports/SERVER/PATH`.
    pub exports: PathBuf,
    pub driver: Option<RealDriver>,
    daemon: Option<std::process::Child>,
    daemon_log: PathBuf,
    /// Dropped before `dir`: stops the namespace and releases the base dir's bind.
    pub cubelet: Option<CubeletNs>,
    pub dir: tempfile::TempDir,
}

impl RealNode {
    pub async fn start(bins: &Bins, kind: DriverKind, mode: Mode, options: NodeOptions) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("ccb-real-{}-", kind.cube_name()))
            .tempdir()
            .unwrap();
        let root = dir.path().to_path_buf();
        let base_dir = root.join("volumes");
        let exports = options
            .exports
            .clone()
            .unwrap_or_else(|| root.join("exports"));
        if options.exports.is_none() {
            std::fs::create_dir_all(exports.join(NFS_SERVER).join(&NFS_SHARE[1..])).unwrap();
        }
        let mut node = RealNode {
            kind,
            mode,
            bins: bins.clone(),
            config_path: root.join("bridge.toml"),
            socket: root.join("bridge.sock"),
            state_dir: root.join("state"),
            base_dir: base_dir.clone(),
            exports,
            driver: None,
            daemon: None,
            daemon_log: root.join("daemon.log"),
            cubelet: None,
            dir,
        };
        // The base dir is shared before the driver starts: nfsplugin's namespace copies it
        // as a peer, so its mounts below it reach the host and the Cubelet namespace.
        let ns_dir = tempfile::Builder::new()
            .prefix("ccb-cubelet-")
            .tempdir()
            .unwrap();
        node.cubelet = Some(CubeletNs::start(ns_dir, &base_dir, BaseDir::Shared));
        node.driver = Some(match kind {
            DriverKind::HostPath => RealDriver::hostpath(&bins.drivers, &root, options.node_id),
            DriverKind::Nfs => {
                RealDriver::nfs(&bins.drivers, &root, &node.exports, options.node_id)
            }
        });
        // rpc: the daemon lives in the host and checks Cubelet's view through its ns file;
        // binary: cubeclient and the hooks it forks run inside Cubelet's namespace.
        let mount_view = match mode {
            Mode::Rpc => node.cubelet().nsfile().display().to_string(),
            Mode::Binary => "self".to_string(),
        };
        let config = format!(
            r#"driver = "{driver}"

[csi]
endpoint = "unix://{csi}"

[serve]
socket = "{socket}"
services = "{services}"

[state]
dir = "{state}"
lock_dir = "{root}/locks"

[node]
default_volume_base_dir = "{base}"
mount_view = {mount_view}

[volume]
{volume}
[timeouts]
create_secs = 45
destroy_secs = 45
attach_secs = 45
detach_secs = 40
rollback_secs = 10
{extra}
"#,
            extra = options.extra_config,
            driver = kind.cube_name(),
            csi = node.driver().socket.display(),
            socket = node.socket.display(),
            services = options.services,
            state = node.state_dir.display(),
            root = root.display(),
            base = base_dir.display(),
            mount_view = toml::Value::String(mount_view),
            volume = kind.volume_config(),
        );
        std::fs::write(&node.config_path, config).unwrap();
        if mode == Mode::Rpc {
            node.start_daemon().await;
        }
        node
    }

    async fn start_daemon(&mut self) {
        let log = std::fs::File::create(&self.daemon_log).unwrap();
        let mut child = std::process::Command::new(BRIDGE)
            .args(["serve", "--config"])
            .arg(&self.config_path)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        while tokio::net::UnixStream::connect(&self.socket).await.is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("daemon exited with {status}: {}", self.logs());
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "daemon did not listen: {}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.daemon = Some(child);
    }

    pub fn driver(&self) -> &RealDriver {
        self.driver.as_ref().expect("the driver runs")
    }

    pub fn cubelet(&self) -> &CubeletNs {
        self.cubelet.as_ref().expect("the Cubelet namespace runs")
    }

    /// Cube: cubeclient dialing the daemon, or forking the hook inside Cubelet's namespace.
    pub fn cube(&self) -> Cube {
        let cube = Cube::dialing(&self.bins.peers, self.mode, &self.socket, &self.config_path);
        match self.mode {
            Mode::Rpc => cube,
            Mode::Binary => cube.inside(&self.cubelet().nsfile()),
        }
    }

    /// The host_path Cube gets for `volume_id`.
    pub fn host_path(&self, volume_id: &str) -> PathBuf {
        self.base_dir
            .join(format!("{}-{volume_id}", self.kind.cube_name()))
    }

    /// The daemon's log and the driver's, for failure messages.
    pub fn logs(&self) -> String {
        format!(
            "--- bridge daemon ---\n{}\n--- driver ---\n{}",
            std::fs::read_to_string(&self.daemon_log).unwrap_or_default(),
            self.driver
                .as_ref()
                .map(RealDriver::log_text)
                .unwrap_or_default()
        )
    }

    /// Mount points at or below the base dir, other than the base dir's own bind, in the
    /// host and in the Cubelet namespace.
    pub fn volume_mounts(&self) -> (Vec<PathBuf>, Vec<PathBuf>) {
        let below = |table: MountTable| {
            let mut v: Vec<PathBuf> = table
                .under(&self.base_dir)
                .filter(|p| *p != self.base_dir)
                .map(Path::to_path_buf)
                .collect();
            v.sort();
            v
        };
        (
            below(MountTable::read(None).unwrap()),
            below(self.cubelet().table()),
        )
    }

    /// Asserts that nothing is mounted, staged or journaled for any volume.
    pub fn assert_nothing_left(&self, what: &str) {
        let context = || format!("{:?} {:?}: {what}", self.kind, self.mode);
        assert_eq!(
            self.volume_mounts(),
            (vec![], vec![]),
            "{}: nothing mounted (host, Cubelet)",
            context()
        );
        let entries = |dir: &Path| -> Vec<PathBuf> {
            std::fs::read_dir(dir)
                .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
                .unwrap_or_default()
        };
        assert_eq!(
            entries(&self.base_dir.join(".staging")),
            Vec::<PathBuf>::new(),
            "{}: nothing staged",
            context()
        );
        let journal: Vec<PathBuf> = entries(&self.state_dir.join("node"))
            .into_iter()
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        assert_eq!(
            journal,
            Vec::<PathBuf>::new(),
            "{}: no journal record",
            context()
        );
        if self.kind == DriverKind::HostPath {
            for volume in self.driver().hostpath_volumes() {
                for list in ["Staged", "Published"] {
                    let paths = volume[list].as_array().cloned().unwrap_or_default();
                    assert!(
                        paths.is_empty(),
                        "{}: hostpathplugin still has {list} {paths:?} for {}",
                        context(),
                        volume["VolID"]
                    );
                }
            }
        }
    }

    /// The directory holding a volume's data on the backend: hostpathplugin's `VolPath`
    /// from its state.json, or the volume's subdirectory on the NFS export.
    pub fn backend_dir(&self, private_data: &str) -> PathBuf {
        let csi_volume_id = csi_volume_id(private_data);
        match self.kind {
            DriverKind::HostPath => {
                let volumes = self.driver().hostpath_volumes();
                let volume = volumes
                    .iter()
                    .find(|v| v["VolID"] == csi_volume_id.as_str())
                    .unwrap_or_else(|| {
                        panic!("state.json does not list {csi_volume_id}: {volumes:?}")
                    });
                PathBuf::from(volume["VolPath"].as_str().expect("VolPath"))
            }
            DriverKind::Nfs => {
                // server#share#subdir#uuid#onDelete
                let fields: Vec<&str> = csi_volume_id.split('#').collect();
                assert!(fields.len() >= 3, "an nfsplugin volume id: {csi_volume_id}");
                self.exports
                    .join(fields[0])
                    .join(fields[1].trim_start_matches('/'))
                    .join(fields[2])
            }
        }
    }

    /// Whether the backend still has the volume: listed in hostpathplugin's state.json,
    /// or the subdirectory present on the export.
    pub fn backend_has(&self, private_data: &str, dir: &Path) -> bool {
        match self.kind {
            DriverKind::HostPath => {
                let id = csi_volume_id(private_data);
                let listed = self
                    .driver()
                    .hostpath_volumes()
                    .iter()
                    .any(|v| v["VolID"] == id.as_str());
                listed || dir.exists()
            }
            DriverKind::Nfs => dir.exists(),
        }
    }
}

/// The CSI volume id inside the bridge's `private_data`.
pub fn csi_volume_id(private_data: &str) -> String {
    let handle: serde_json::Value = serde_json::from_str(private_data).unwrap_or_else(|e| {
        panic!("private_data is the bridge's JSON handle ({e}): {private_data}")
    });
    handle["id"].as_str().expect("a CSI volume id").to_string()
}

impl Drop for RealNode {
    fn drop(&mut self) {
        // Stop the callers of mount first, then unmount what is left (deepest first),
        // then the Cubelet namespace and the base dir's bind (fields), then the temp dir.
        if let Some(mut daemon) = self.daemon.take() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
        drop(self.driver.take());
        if let Ok(table) = MountTable::read(None) {
            let mut mounts: Vec<PathBuf> = table
                .under(self.dir.path())
                .map(Path::to_path_buf)
                .collect();
            mounts.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
            for mount in mounts {
                let _ = ops::unmount_lazy(&mount);
            }
        }
    }
}
