//! One Cube node as the real-mount tests build it: the fake CSI driver (which makes real
//! bind mounts) served on a socket, a simulated Cubelet namespace, the volume base dir as a
//! shared mount, and the bridge (the `serve` daemon, or the executable Cube forks), with
//! cubeclient (grpc-go) as Cube. Everything a node mounts is unmounted when it is dropped,
//! even after a failed test.
//!
//! [`DriverKind`] picks the fake's switches for the two shapes of driver the tests cover:
//! one that stages and bind-mounts (as csi-driver-host-path does) and one that publishes
//! straight from a shared backend, mounts its share in CreateVolume and DeleteVolume, and
//! answers success for a target that is already mounted (as csi-driver-nfs does).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use cube_csi_bridge::mount::{MountTable, ops};

use super::cube_peers::{BaseDir, Cube, CubeletNs, PEERS_BIN_ENV, peer_dir};
use super::fake_driver::{Caps, FakeDriver, Running};
use super::{BRIDGE, Mode};

/// Mount flags given to the NFS-like driver (they reach NodePublishVolume).
pub const NFS_MOUNT_FLAGS: [&str; 2] = ["nfsvers=4.1", "hard"];
/// How long the daemon may take to listen on a loaded machine.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Skips the test unless root and cubeclient is built (in CI a missing one fails
/// instead); yields the directory holding cubeclient.
#[macro_export]
macro_rules! require_cube_peers {
    () => {{
        require_root!();
        match common::cube_node::peers_bin() {
            Some(bin) => bin,
            None => return,
        }
    }};
}

/// The directory holding cubeclient, from `CUBE_CSI_BRIDGE_PEERS_BIN`.
pub fn peers_bin() -> Option<PathBuf> {
    peer_dir(
        PEERS_BIN_ENV,
        &["cubeclient"],
        "scripts/install-test-peers.sh",
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverKind {
    /// STAGE_UNSTAGE_VOLUME, a bind mount of the staged volume on publish.
    Staging,
    /// No STAGE_UNSTAGE; the volume's directory of a shared backend bind-mounted on
    /// publish; CreateVolume and DeleteVolume mount the share.
    NfsLike,
}

impl DriverKind {
    /// The Cube driver name the bridge serves (the host_path prefix).
    pub fn cube_name(self) -> &'static str {
        match self {
            DriverKind::Staging => "staging",
            DriverKind::NfsLike => "nfs",
        }
    }

    fn caps(self) -> Caps {
        match self {
            DriverKind::Staging => Caps::staging(),
            DriverKind::NfsLike => Caps::nfs_like(),
        }
    }

    fn volume_config(self) -> String {
        match self {
            DriverKind::Staging => {
                "access_mode = \"single_node_multi_writer\"\ncapacity_bytes = 1073741824\n".into()
            }
            DriverKind::NfsLike => format!(
                "access_mode = \"multi_node_multi_writer\"\nmount_flags = {}\nparameters = {{ server = \"nfs.test\", share = \"/export\" }}\n",
                toml::Value::from(NFS_MOUNT_FLAGS.to_vec())
            ),
        }
    }
}

/// How a [`CubeNode`] is set up.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// `serve.services`: "both", "node" or "controller".
    pub services: &'static str,
    pub node_id: &'static str,
    /// The storage backend to share with another node (its [`CubeNode::backend`]);
    /// default: the node's own.
    pub backend: Option<PathBuf>,
    /// Switches the fake gets on top of its kind's.
    pub volume_stats: bool,
    /// TOML tables appended to the bridge's config.
    pub extra_config: String,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            services: "both",
            node_id: "node-1",
            backend: None,
            volume_stats: false,
            extra_config: String::new(),
        }
    }
}

/// One Cube node with the fake driver making real mounts (module docs).
pub struct CubeNode {
    pub kind: DriverKind,
    pub mode: Mode,
    pub peers: PathBuf,
    pub base_dir: PathBuf,
    pub config_path: PathBuf,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    /// Where the driver keeps volume data (shared by the nodes of one backend).
    pub backend: PathBuf,
    pub driver: FakeDriver,
    driver_server: Option<Running>,
    daemon: Option<std::process::Child>,
    daemon_log: PathBuf,
    /// Dropped before `dir`: stops the namespace and releases the base dir's bind.
    pub cubelet: Option<CubeletNs>,
    pub dir: tempfile::TempDir,
}

impl CubeNode {
    pub async fn start(peers: &Path, kind: DriverKind, mode: Mode, options: NodeOptions) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("ccb-node-{}-", kind.cube_name()))
            .tempdir()
            .unwrap();
        let root = dir.path().to_path_buf();
        let base_dir = root.join("volumes");
        let backend = options
            .backend
            .clone()
            .unwrap_or_else(|| root.join("backend"));
        let caps = Caps {
            volume_stats: options.volume_stats,
            ..kind.caps()
        };
        let driver = FakeDriver::named(caps, &backend, "fake.csi.test", options.node_id);
        let csi_socket = root.join("csi.sock");
        let driver_server = Some(driver.serve(&csi_socket));
        let ns_dir = tempfile::Builder::new()
            .prefix("ccb-cubelet-")
            .tempdir()
            .unwrap();
        let cubelet = Some(CubeletNs::start(ns_dir, &base_dir, BaseDir::Shared));
        let mut node = CubeNode {
            kind,
            mode,
            peers: peers.to_path_buf(),
            config_path: root.join("bridge.toml"),
            socket: root.join("bridge.sock"),
            state_dir: root.join("state"),
            base_dir: base_dir.clone(),
            backend,
            driver,
            driver_server,
            daemon: None,
            daemon_log: root.join("daemon.log"),
            cubelet,
            dir,
        };
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
            csi = csi_socket.display(),
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

    pub fn cubelet(&self) -> &CubeletNs {
        self.cubelet.as_ref().expect("the Cubelet namespace runs")
    }

    /// Cube: cubeclient dialing the daemon, or forking the hook inside Cubelet's namespace.
    pub fn cube(&self) -> Cube {
        let cube = Cube::dialing(&self.peers, self.mode, &self.socket, &self.config_path);
        match self.mode {
            Mode::Rpc => cube,
            Mode::Binary => cube.inside(&self.cubelet().nsfile()),
        }
    }

    /// The host_path Cube gets for `volume_id`.
    pub fn host_path(&self, volume_id: &str) -> PathBuf {
        self.base_dir
            .join(format!("{}+{volume_id}", self.kind.cube_name()))
    }

    /// The daemon's log and the driver's calls, for failure messages.
    pub fn logs(&self) -> String {
        format!(
            "--- bridge daemon ---\n{}\n--- driver calls ---\n{:?}",
            std::fs::read_to_string(&self.daemon_log).unwrap_or_default(),
            self.driver.mutating_calls()
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

    /// Asserts that nothing is mounted, staged, ControllerPublished or journaled for any
    /// volume, and that the driver's share mounts are gone.
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
        // An empty staging dir parked for the volume's next first Attach is not staged.
        let staging = self.base_dir.join(".staging");
        let staged: Vec<PathBuf> = super::left_in_base_dir(&self.base_dir)
            .into_iter()
            .filter(|path| path.starts_with(&staging))
            .collect();
        assert_eq!(
            staged,
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
        assert_eq!(
            self.driver.controller_published(),
            Vec::<(String, String)>::new(),
            "{}: nothing ControllerPublished",
            context()
        );
        let table = MountTable::read(None).unwrap();
        // The share's working mounts sit beside the backend (fake_driver.rs).
        let backend_mounts: Vec<_> = table
            .under(self.backend.parent().unwrap())
            .filter(|p| p.to_string_lossy().contains(".share-mounts-"))
            .map(Path::to_path_buf)
            .collect();
        assert_eq!(
            backend_mounts,
            Vec::<PathBuf>::new(),
            "{}: the driver's own (share) mounts are gone",
            context()
        );
    }

    /// The directory holding a volume's data on the backend.
    pub fn backend_dir(&self, private_data: &str) -> PathBuf {
        self.driver.volume_dir(&csi_volume_id(private_data))
    }
}

/// The CSI volume id inside the bridge's `private_data`.
pub fn csi_volume_id(private_data: &str) -> String {
    let handle: serde_json::Value = serde_json::from_str(private_data).unwrap_or_else(|e| {
        panic!("private_data is the bridge's JSON handle ({e}): {private_data}")
    });
    handle["id"].as_str().expect("a CSI volume id").to_string()
}

impl Drop for CubeNode {
    fn drop(&mut self) {
        // Stop the callers of mount first, then unmount what is left (deepest first),
        // then the Cubelet namespace and the base dir's bind (fields), then the temp dir.
        if let Some(mut daemon) = self.daemon.take() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
        drop(self.driver_server.take());
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
