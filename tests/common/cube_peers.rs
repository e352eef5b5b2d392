//! Cube's side of the end-to-end tests: cubeclient (tests/peers/cubeclient, a Cube-like
//! caller in Go) driving the bridge in rpc or binary mode and reporting as Cube would, and
//! a simulated Cubelet mount namespace (tests/peers/cubelet-ns.sh) with the volume base
//! dir's shared or private bind mount (tests/peers/shared-dir.sh).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use cube_csi_bridge::mount::MountTable;

use super::{BRIDGE, Mode, World};

pub const PEERS_BIN_ENV: &str = "CUBE_CSI_BRIDGE_PEERS_BIN";

/// A directory of built test peers named by `env` and holding `files`, or `None` (the
/// test skips) when `env` is unset. In CI (`CI=true`) an unset `env` is a failure: CI
/// must run every test, and scripts/test.sh sets them all (`installer` builds them).
pub fn peer_dir(env: &str, files: &[&str], installer: &str) -> Option<PathBuf> {
    let Some(dir) = std::env::var_os(env).filter(|v| !v.is_empty()) else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{env} is not set in CI: run the tests through scripts/test.sh ({installer})"
        );
        eprintln!("skipped: {env} is not set (see {installer})");
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
/// Upper bound for one cubeclient call (the bridge's own budgets are 20 s in tests).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A failed hook as cubeclient reports it.
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

#[derive(Debug)]
pub struct Attached {
    pub host_path: PathBuf,
    pub metadata: HashMap<String, String>,
}

/// Cube, as far as the bridge can tell: cubeclient in rpc or binary mode.
pub struct Cube {
    client: PathBuf,
    mode: Mode,
    socket: PathBuf,
    config: PathBuf,
    /// A mount namespace file cubeclient runs in (so a forked hook runs there too).
    namespace: Option<PathBuf>,
}

impl Cube {
    pub fn new(bin: &Path, w: &World) -> Cube {
        Cube::dialing(bin, w.mode, &w.socket(), &w.config_path)
    }

    /// cubeclient from `bin`: in rpc mode dialing `socket`, in binary mode forking the
    /// bridge with `config` in its environment.
    pub fn dialing(bin: &Path, mode: Mode, socket: &Path, config: &Path) -> Cube {
        Cube {
            client: bin.join("cubeclient"),
            mode,
            socket: socket.to_path_buf(),
            config: config.to_path_buf(),
            namespace: None,
        }
    }

    /// Runs cubeclient (and so every hook it forks) inside the mount namespace bound at
    /// `nsfile`, as Cubelet forks hooks inside its own.
    pub fn inside(mut self, nsfile: &Path) -> Cube {
        self.namespace = Some(nsfile.to_path_buf());
        self
    }

    /// Runs one hook; `Ok` is cubeclient's success object.
    pub async fn call(&self, op: &[&str]) -> Result<serde_json::Value, Failure> {
        let mut cmd = match &self.namespace {
            None => tokio::process::Command::new(&self.client),
            Some(nsfile) => {
                let mut nsenter = tokio::process::Command::new("nsenter");
                nsenter
                    .arg(format!("--mount={}", nsfile.display()))
                    .arg(&self.client);
                nsenter
            }
        };
        match self.mode {
            // The bare socket path, as Cube's plugin config holds it.
            Mode::Rpc => cmd.arg("rpc").arg("--target").arg(&self.socket),
            // The forked hook inherits cubeclient's environment, as it would Cubelet's.
            Mode::Binary => cmd
                .arg("binary")
                .arg("--path")
                .arg(BRIDGE)
                .env("CUBE_CSI_BRIDGE_CONFIG", &self.config),
        };
        cmd.args(op)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let out = tokio::time::timeout(CALL_TIMEOUT, cmd.output())
            .await
            .unwrap_or_else(|_| panic!("cubeclient {:?} {op:?} hung", self.mode))
            .expect("cubeclient runs");
        let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let context = || {
            format!(
                "cubeclient {:?} {op:?}: stdout {stdout:?}, stderr {stderr}",
                self.mode
            )
        };
        assert_eq!(stdout.lines().count(), 1, "one line: {}", context());
        let value: serde_json::Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", context()));
        match out.status.code() {
            Some(0) => Ok(value),
            Some(1) => {
                let text = |k: &str| value.get(k).and_then(|v| v.as_str()).map(str::to_string);
                let failure = Failure {
                    error: text("error").unwrap_or_default(),
                    code: text("code"),
                    exit_code: value.get("exit_code").and_then(|v| v.as_i64()),
                    stdout: text("stdout"),
                };
                assert!(
                    !failure.error.is_empty(),
                    "failure without error: {}",
                    context()
                );
                Err(failure)
            }
            _ => panic!(
                "cubeclient usage error or crash ({}): {}",
                out.status,
                context()
            ),
        }
    }

    pub async fn create(&self, volume_id: &str) -> Result<(String, String), Failure> {
        let out = self
            .call(&["create", "--volume-id", volume_id, "--name", volume_id])
            .await?;
        let field = |k: &str| out[k].as_str().expect("string field").to_string();
        Ok((field("token"), field("private_data")))
    }

    pub async fn destroy(&self, volume_id: &str) -> Result<(), Failure> {
        self.call(&["destroy", "--volume-id", volume_id])
            .await
            .map(|_| ())
    }

    pub async fn attach(
        &self,
        base_dir: &Path,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        private_data: &str,
    ) -> Result<Attached, Failure> {
        let (ref_count, base) = (ref_count.to_string(), base_dir.display().to_string());
        let mut op = vec![
            "attach",
            "--sandbox-id",
            sandbox,
            "--namespace",
            "default",
            "--volume-id",
            volume_id,
            "--ref-count",
            &ref_count,
            "--volume-base-dir",
            &base,
        ];
        if !private_data.is_empty() {
            op.extend(["--private-data", private_data]);
        }
        let out = self.call(&op).await?;
        let metadata = out["metadata"]
            .as_object()
            .expect("metadata is an object")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().expect("string value").to_string()))
            .collect();
        Ok(Attached {
            host_path: PathBuf::from(out["host_path"].as_str().expect("host_path")),
            metadata,
        })
    }

    pub async fn detach(
        &self,
        sandbox: &str,
        volume_id: &str,
        ref_count: i64,
        metadata: &HashMap<String, String>,
    ) -> Result<(), Failure> {
        let ref_count = ref_count.to_string();
        let metadata = serde_json::to_string(&metadata.iter().collect::<BTreeMap<_, _>>()).unwrap();
        self.call(&[
            "detach",
            "--sandbox-id",
            sandbox,
            "--namespace",
            "default",
            "--volume-id",
            volume_id,
            "--ref-count",
            &ref_count,
            "--metadata",
            &metadata,
        ])
        .await
        .map(|_| ())
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
