//! Who can reach the daemon, end to end (as root): the socket as seen on disk (mode 0660,
//! `serve.socket_group`), callers refused by `serve.allowed_uids` over the socket and over
//! loopback TCP (a client process that drops to another uid before connecting), a symlink
//! at the socket path never followed, and the socket removed at shutdown only while it is
//! still the daemon's own.

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::fake_driver::Caps;
use common::{BRIDGE, Mode, World};

const NOBODY: u32 = 65534;
/// A uid and gid that neither own the socket nor are in its group.
const STRANGER: u32 = 65533;
const HELPER_ENV: &str = "CCB_PEER_CLIENT_TARGET";

/// Calls the daemon's health service at `target` (`unix:PATH` or `tcp:ADDR`).
async fn call(target: &str) -> Result<(), String> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let channel = if let Some(path) = target.strip_prefix("unix:") {
        cube_csi_bridge::csi::client::channel(&cube_csi_bridge::csi::Endpoint::Unix(path.into()))
    } else {
        let addr = target.strip_prefix("tcp:").unwrap();
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy()
    };
    let mut client = HealthClient::new(channel);
    // Generous: a refusal comes back at once (a closed connection, EACCES); only an
    // answer from a daemon on a loaded machine may take long.
    match tokio::time::timeout(
        Duration::from_secs(30),
        client.check(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(format!("{status:?}")),
        Err(_) => Err("no answer within 30 s".into()),
    }
}

/// Not a test: the client process the tests below start as another uid (it runs only when
/// they name it, with the target in the environment).
#[tokio::test]
#[ignore = "a helper process started by the socket tests as another uid"]
async fn peer_client() {
    let target = std::env::var(HELPER_ENV).expect("started by the socket tests only");
    match call(&target).await {
        Ok(()) => println!("PEER-RESULT admitted"),
        Err(e) => println!("PEER-RESULT refused {e}"),
    }
}

/// Whether every user may traverse `dir` and each directory above it.
fn traversable_by_all(dir: &Path) -> bool {
    dir.ancestors()
        .all(|d| std::fs::metadata(d).is_ok_and(|m| m.mode() & 0o001 != 0))
}

/// This test executable copied where any uid can run it: the build's own copy may lie
/// below a directory other uids cannot traverse (a checkout in a 0700 home or `mktemp -d`).
struct Helper {
    dir: tempfile::TempDir,
    exe: PathBuf,
}

impl Helper {
    /// Copies the executable into a fresh root-owned 0755 directory under the temp dir
    /// (or /tmp, when the temp dir is not traversable by all).
    fn new() -> Helper {
        let base = [std::env::temp_dir(), PathBuf::from("/tmp")]
            .into_iter()
            .filter_map(|d| d.canonicalize().ok())
            .find(|d| traversable_by_all(d))
            .expect("neither the temp dir nor /tmp can be traversed by every user");
        let dir = tempfile::Builder::new()
            .prefix("ccb-peer-client-")
            .tempdir_in(&base)
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let exe = dir.path().join("peer-client");
        std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(traversable_by_all(dir.path()), "{}", dir.path().display());
        Helper { dir, exe }
    }
}

/// Fails clearly when other uids could not reach the world's socket for a reason the test
/// does not mean (a temp dir below a directory they cannot traverse).
fn assert_reachable_by_all(w: &World) {
    assert!(
        traversable_by_all(w.dir.path()),
        "other uids cannot reach {}: set TMPDIR to a directory every user can traverse",
        w.dir.path().display()
    );
}

/// Runs `peer_client` as `uid`:`gid` against `target`; true if the daemon answered.
fn call_as(helper: &Helper, uid: u32, gid: u32, target: &str) -> (bool, String) {
    let out = std::process::Command::new(&helper.exe)
        .args(["--ignored", "--exact", "peer_client", "--nocapture"])
        .env(HELPER_ENV, target)
        // Not the checkout (cargo's working directory), which `uid` may not reach.
        .current_dir(helper.dir.path())
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = stdout
        .lines()
        .find(|l| l.starts_with("PEER-RESULT"))
        .unwrap_or_else(|| {
            panic!(
                "the helper did not run as {uid}: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
        .to_string();
    (line == "PEER-RESULT admitted", line)
}

async fn stop_daemon(w: &mut World) {
    let mut child = w.daemon.take().expect("a running daemon");
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("the daemon stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

fn set_serve(w: &World, lines: &str) {
    let text = std::fs::read_to_string(&w.config_path).unwrap();
    let start = text.find("[serve]\n").unwrap() + "[serve]\n".len();
    let end = text[start..]
        .find("\n[")
        .map_or(text.len(), |i| start + i + 1);
    let socket = text[start..end]
        .lines()
        .find(|l| l.starts_with("socket ="))
        .unwrap()
        .to_string();
    let text = format!("{}{socket}\n{lines}\n{}", &text[..start], &text[end..]);
    std::fs::write(&w.config_path, text).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_socket_group_and_the_peer_allow_list_hold_over_the_socket_and_tcp() {
    require_root!();
    let mut w = World::start(Mode::Binary, Caps::default(), "").await;
    // Others may search the temp dir: the socket's own mode and group decide.
    std::fs::set_permissions(w.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_reachable_by_all(&w);
    let helper = Helper::new();
    let port = common::free_port();
    let unix = format!("unix:{}", w.socket().display());
    let tcp = format!("tcp:127.0.0.1:{port}");
    set_serve(
        &w,
        &format!("socket_group = \"{NOBODY}\"\nallowed_uids = [0]\ntcp = \"127.0.0.1:{port}\""),
    );
    w.mode = Mode::Rpc;
    w.start_daemon().await.unwrap();

    // On disk: a socket, root's, group nogroup, 0660.
    let meta = std::fs::symlink_metadata(w.socket()).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.mode() & 0o777, 0o660, "mode {:o}", meta.mode() & 0o777);
    assert_eq!((meta.uid(), meta.gid()), (0, NOBODY));

    // Root is on the list: admitted both ways.
    call(&unix).await.expect("root over the socket");
    call(&tcp).await.expect("root over loopback TCP");
    // nobody may open the socket (its group) but is not on the list: dropped.
    let (admitted, line) = call_as(&helper, NOBODY, NOBODY, &unix);
    assert!(!admitted, "nobody over the socket: {line}");
    let (admitted, line) = call_as(&helper, NOBODY, NOBODY, &tcp);
    assert!(!admitted, "nobody over loopback TCP: {line}");
    // A stranger cannot even open the socket.
    let (admitted, line) = call_as(&helper, STRANGER, STRANGER, &unix);
    assert!(
        !admitted && line.to_lowercase().contains("permission denied"),
        "stranger: {line}"
    );
    let logs = std::fs::read_to_string(w.daemon_log_path()).unwrap();
    assert!(
        logs.contains("refused a connection from a uid not in serve.allowed_uids")
            && logs.contains("refused a TCP connection from a uid not in serve.allowed_uids"),
        "{logs}"
    );
    stop_daemon(&mut w).await;
    assert!(!w.socket().exists(), "removed at shutdown");

    // A TCP port without the list would let any local user call every hook (a TCP port
    // has no mode and no group): such a config is refused before anything listens.
    set_serve(
        &w,
        &format!("socket_group = \"{NOBODY}\"\ntcp = \"127.0.0.1:{port}\""),
    );
    let refused = w.start_daemon().await.unwrap_err();
    assert!(
        refused.contains("exit status: 78") && refused.contains("serve.allowed_uids"),
        "{refused}"
    );
    let (admitted, line) = call_as(&helper, STRANGER, STRANGER, &tcp);
    assert!(!admitted, "nothing listens on TCP: {line}");

    // Without the list (and without TCP), the group alone decides: nobody is admitted (so
    // the refusals above came from the list, not from the file mode), the stranger still
    // is not.
    set_serve(&w, &format!("socket_group = \"{NOBODY}\""));
    w.start_daemon().await.unwrap();
    let (admitted, line) = call_as(&helper, NOBODY, NOBODY, &unix);
    assert!(admitted, "nobody in the socket's group: {line}");
    let (admitted, line) = call_as(&helper, STRANGER, STRANGER, &unix);
    assert!(!admitted, "stranger: {line}");
    stop_daemon(&mut w).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_socket_path_is_never_followed_and_only_our_socket_is_removed() {
    require_root!();
    let mut w = World::start(Mode::Binary, Caps::default(), "").await;
    w.mode = Mode::Rpc;

    // A symlink at the socket path (to a file someone wants clobbered): refused, untouched.
    let precious = w.dir.path().join("precious");
    std::fs::write(&precious, "data").unwrap();
    std::os::unix::fs::symlink(&precious, w.socket()).unwrap();
    let out = std::process::Command::new(BRIDGE)
        .args(["serve", "--config"])
        .arg(&w.config_path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("not a socket"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "data");
    assert!(
        std::fs::symlink_metadata(w.socket())
            .unwrap()
            .file_type()
            .is_symlink()
    );
    std::fs::remove_file(w.socket()).unwrap();

    // A successor took the path while the daemon ran: the daemon leaves it at shutdown.
    w.start_daemon().await.unwrap();
    std::fs::rename(w.socket(), w.dir.path().join("old.sock")).unwrap();
    let successor = std::os::unix::net::UnixListener::bind(w.socket()).unwrap();
    let inode = std::fs::metadata(w.socket()).unwrap().ino();
    stop_daemon(&mut w).await;
    assert_eq!(
        std::fs::metadata(w.socket()).map(|m| m.ino()).ok(),
        Some(inode),
        "the successor's socket was removed"
    );
    drop(successor);
    assert_socket_gone_after_restart(&mut w).await;
}

/// A stale socket (its daemon gone) is replaced at start, and removed at shutdown.
async fn assert_socket_gone_after_restart(w: &mut World) {
    w.start_daemon().await.unwrap();
    call(&format!("unix:{}", w.socket().display()))
        .await
        .expect("serving");
    stop_daemon(w).await;
    assert!(!Path::new(&w.socket()).exists());
}
