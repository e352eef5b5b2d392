//! Cube's side of the end-to-end tests: cubeclient (tests/peers/cubeclient, a Cube-like
//! caller in Go, driven through `callers::GoCaller`) in rpc or binary mode, and a simulated
//! Cubelet mount namespace (tests/peers/cubelet-ns.sh) with the volume base
//! dir's shared or private bind mount (tests/peers/shared-dir.sh).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use cube_csi_bridge::mount::MountTable;
use cube_csi_bridge::proto::cube::v1 as pb;

use super::callers::{
    CubeCaller, CubeError, GoCaller, GoTransport, attach_request, create_request, detach_request,
};
use super::{Mode, World};

pub const PEERS_BIN_ENV: &str = "CUBE_CSI_BRIDGE_PEERS_BIN";

/// A directory of built test peers named by `env` and holding `files`, or `None` (the
/// test skips) when `env` is unset. In CI (`CI` set) an unset `env` is a failure: CI must
/// run every test, and scripts/test.sh sets them all (`installer` builds them).
pub fn peer_dir(env: &str, files: &[&str], installer: &str) -> Option<PathBuf> {
    let Some(dir) = std::env::var_os(env).filter(|v| !v.is_empty()) else {
        super::skip(&format!(
            "{env} is not set: run the tests through scripts/test.sh ({installer})"
        ));
        return None;
    };
    let dir = PathBuf::from(dir);
    for file in files {
        assert!(
            dir.join(file).is_file(),
            "{env}={} has no {file}: run {installer}",
            dir.display()
        );
    }
    Some(dir)
}
pub const PEERS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers");
/// A failed hook as cubeclient reports it (the fields real_mounts.rs reads).
#[derive(Debug)]
pub struct Failure {
    /// The message Cube would log.
    pub error: String,
    /// rpc: the gRPC code name.
    pub code: Option<String>,
    /// binary: the hook's exit code.
    pub exit_code: Option<i64>,
    /// binary: the hook's raw stdout.
    pub stdout: Option<String>,
}

impl From<CubeError> for Failure {
    fn from(e: CubeError) -> Self {
        Failure {
            error: e.message,
            code: e.code.map(|c| format!("{c:?}")),
            exit_code: e.exit_code.map(i64::from),
            stdout: e.stdout,
        }
    }
}

#[derive(Debug)]
pub struct Attached {
    pub host_path: PathBuf,
    pub metadata: HashMap<String, String>,
}

/// cubeclient with the default namespace, spelled as the real-mount tests use it; the
/// calls go through [`GoCaller`] (the one implementation of [`CubeCaller`] in Go).
pub struct Cube {
    go: GoCaller,
}

impl Cube {
    pub fn new(bin: &Path, w: &World) -> Cube {
        Cube {
            go: w.go_caller(bin),
        }
    }

    /// cubeclient from `bin`: in rpc mode dialing `socket`, in binary mode forking the
    /// bridge with `config` in its environment.
    pub fn dialing(bin: &Path, mode: Mode, socket: &Path, config: &Path) -> Cube {
        let transport = match mode {
            Mode::Rpc => GoTransport::Rpc {
                socket: socket.to_path_buf(),
            },
            Mode::Binary => GoTransport::Binary {
                config: config.to_path_buf(),
            },
        };
        Cube {
            go: GoCaller::new(bin, transport),
        }
    }

    /// Runs cubeclient (and so every hook it forks) inside the mount namespace bound at
    /// `nsfile`, as Cubelet forks hooks inside its own.
    pub fn inside(self, nsfile: &Path) -> Cube {
        Cube {
            go: self.go.inside(nsfile),
        }
    }

    pub async fn create(&self, volume_id: &str) -> Result<(String, String), Failure> {
        let created = self.go.create(create_request(volume_id)).await?;
        Ok((created.token, created.private_data))
    }

    pub async fn destroy(&self, volume_id: &str) -> Result<(), Failure> {
        let request = pb::DestroyRequest {
            volume_id: volume_id.into(),
        };
        Ok(self.go.destroy(request).await?)
    }

    pub async fn attach(
        &self,
        base_dir: &Path,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        private_data: &str,
    ) -> Result<Attached, Failure> {
        let request = attach_request(
            "default",
            base_dir,
            sandbox,
            volume_id,
            ref_count,
            private_data,
        );
        let attached = self.go.attach(request).await?;
        Ok(Attached {
            host_path: PathBuf::from(attached.host_path),
            metadata: attached.metadata,
        })
    }

    pub async fn detach(
        &self,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        metadata: &HashMap<String, String>,
    ) -> Result<(), Failure> {
        let request = detach_request("default", sandbox, volume_id, ref_count, metadata);
        Ok(self.go.detach(request).await?)
    }
}

/// Runs a helper script from tests/peers; panics with its output on failure.
pub fn peer_script(script: &str, args: &[&Path]) -> String {
    let out = std::process::Command::new("sh")
        .arg(Path::new(PEERS_DIR).join(script))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("sh runs");
    assert!(
        out.status.success(),
        "{script} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The volume base dir's own bind mount in the host: shared (mounts made below it reach
/// the Cubelet namespace) or private (they do not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseDir {
    Shared,
    Private,
}

/// A simulated Cubelet namespace (cubelet-ns.sh) plus the base dir's bind mount; both are
/// undone on drop, so declare it after the `World` whose base dir it binds.
pub struct CubeletNs {
    pub dir: tempfile::TempDir,
    pub base: PathBuf,
    pub base_bound: bool,
    pub started: bool,
    pub pid: u32,
}

impl CubeletNs {
    /// Where the namespace file of a namespace started in `dir` will be.
    pub fn nsfile_in(dir: &Path) -> PathBuf {
        dir.join("cubeletmnt/mnt")
    }

    pub fn nsfile(&self) -> PathBuf {
        Self::nsfile_in(self.dir.path())
    }

    pub fn pidfile(&self) -> PathBuf {
        self.dir.path().join("cubelet.pid")
    }

    /// Binds `base` onto itself as `propagation`, then starts the namespace (which copies
    /// the host's mounts as one-way slaves).
    pub fn start(dir: tempfile::TempDir, base: &Path, propagation: BaseDir) -> CubeletNs {
        std::fs::create_dir_all(base).unwrap();
        let mut ns = CubeletNs {
            dir,
            base: base.to_path_buf(),
            base_bound: false,
            started: false,
            pid: 0,
        };
        let cmd = match propagation {
            BaseDir::Shared => "make",
            BaseDir::Private => "private",
        };
        let bound = peer_script("shared-dir.sh", &[Path::new(cmd), base]);
        ns.base_bound = bound == "bound";
        assert!(
            ns.base_bound,
            "{} was already a mount point",
            base.display()
        );
        let shared = std::process::Command::new("sh")
            .arg(Path::new(PEERS_DIR).join("shared-dir.sh"))
            .args([Path::new("check"), base])
            .status()
            .unwrap()
            .success();
        assert_eq!(shared, propagation == BaseDir::Shared);

        ns.started = true;
        peer_script(
            "cubelet-ns.sh",
            &[Path::new("start"), &ns.nsfile(), &ns.pidfile()],
        );
        ns.pid = std::fs::read_to_string(ns.pidfile())
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        assert_eq!(
            inode(&ns.nsfile()),
            inode(Path::new(&format!("/proc/{}/ns/mnt", ns.pid))),
            "the ns file is bound to the holder's namespace"
        );
        assert_ne!(
            inode(&ns.nsfile()),
            inode(Path::new("/proc/self/ns/mnt")),
            "a namespace of its own"
        );
        ns
    }

    /// The namespace's mount table, read as the bridge reads it.
    pub fn table(&self) -> MountTable {
        MountTable::read(Some(self.pid)).expect("the holder is alive")
    }

    /// Mount points at or below the base dir, inside the namespace.
    pub fn mounts_under_base(&self) -> Vec<PathBuf> {
        let mut v: Vec<_> = self
            .table()
            .under(&self.base)
            .map(Path::to_path_buf)
            .collect();
        v.sort();
        v
    }

    /// Reads a file through the namespace, as a sandbox would see it.
    pub fn read_inside(&self, path: &Path) -> String {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--mount={}", self.nsfile().display()))
            .arg("cat")
            .arg(path)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    pub fn assert_mounted_inside(&self, path: &Path, what: &str) {
        assert!(
            self.table().is_mount_point(path),
            "{what}: {} is not a mount point in the Cubelet namespace; there: {:?}",
            path.display(),
            self.mounts_under_base()
        );
    }
}

impl Drop for CubeletNs {
    fn drop(&mut self) {
        // Best effort and quiet: a failing test must still clean up everything.
        let run = |script: &str, args: &[&Path]| {
            let _ = std::process::Command::new("sh")
                .arg(Path::new(PEERS_DIR).join(script))
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        };
        if self.started {
            run(
                "cubelet-ns.sh",
                &[Path::new("stop"), &self.nsfile(), &self.pidfile()],
            );
        }
        if self.base_bound {
            run("shared-dir.sh", &[Path::new("release"), &self.base]);
        }
    }
}
