//! What an operator runs and watches: the metrics endpoint, `list` and `list
//! --controller` in JSON, `check` proving mount propagation, and a restart under systemd
//! socket activation that fails no call. Needs root (real mounts); CI runs it as root.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::Duration;

use common::fake_driver::Caps;
use common::{BRIDGE, Mode, World};

async fn scrape(port: u16) -> String {
    let text = common::scrape_metrics(port).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text
}

/// The value of the first sample line starting with `prefix`, or 0.
fn sample(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn run_cli(w: &World, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(BRIDGE)
        .args(args)
        .arg("--config")
        .arg(&w.config_path)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_move_with_hooks_and_list_shows_both_stores_in_json() {
    require_root!();
    let port = common::free_port();
    // No volume stats polling: the inventory gauges must move all the same.
    let w = World::start(
        Mode::Rpc,
        Caps::staging(),
        &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\nvolume_stats_interval_secs = 0\n"),
    )
    .await;
    let before = scrape(port).await;
    let created = w.create("m1").await.unwrap();
    let a = w
        .attach("s1", "m1", 0, &created.private_data)
        .await
        .unwrap();
    w.attach("s2", "m1", 1, &created.private_data)
        .await
        .unwrap();

    // The inventory gauges, refreshed off the hook path (every 10 s without stats polling).
    let gauges = [
        "cube_csi_bridge_attached_volumes 1",
        "cube_csi_bridge_volume_holders 2",
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(25);
    loop {
        let text = scrape(port).await;
        if gauges.iter().all(|g| text.lines().any(|l| l == *g)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "inventory gauges never moved:\n{text}"
        );
        // The poll interval of this wait on the metrics endpoint (a deadline above).
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Inventories, while attached.
    let (ok, json) = run_cli(&w, &["list", "--output", "json"]);
    assert!(ok, "{json}");
    let volumes: serde_json::Value = serde_json::from_str(&json).unwrap();
    let v = &volumes[0];
    assert_eq!(v["volume_id"], "m1");
    assert_eq!(v["mount"], "mounted");
    assert_eq!(v["publish"], "done");
    assert_eq!(v["stage"], "done");
    assert_eq!(v["host_path"], a.host_path.as_str());
    assert_eq!(v["holders"]["default"], serde_json::json!(["s1", "s2"]));
    assert!(v["since"].as_u64().unwrap() > 0);
    let (ok, json) = run_cli(&w, &["list", "--controller", "--output", "json"]);
    assert!(ok, "{json}");
    let records: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(records[0]["volume_id"], "m1");
    assert_eq!(records[0]["state"], "created");
    assert!(
        records[0]["csi_volume_id"]
            .as_str()
            .is_some_and(|id| common::is_name_of_a_create(id, "fake-cube-m1")),
        "{records}"
    );
    let (ok, text) = run_cli(&w, &["list", "--controller"]);
    assert!(ok && text.contains("m1\tcreated\t"), "{text}");

    w.detach("s2", "m1", 1, &a.metadata).await.unwrap();
    w.detach("s1", "m1", 0, &a.metadata).await.unwrap();
    w.attach("s1", "missing", 0, "not a handle")
        .await
        .unwrap_err();
    let after = scrape(port).await;
    for (series, at_least) in [
        (
            "cube_csi_bridge_hook_calls_total{hook=\"attach\",outcome=\"success\"}",
            2.0,
        ),
        (
            "cube_csi_bridge_hook_calls_total{hook=\"detach\",outcome=\"success\"}",
            2.0,
        ),
        (
            "cube_csi_bridge_hook_calls_total{hook=\"create\",outcome=\"success\"}",
            1.0,
        ),
        (
            "cube_csi_bridge_hook_calls_total{hook=\"attach\",outcome=\"invalid_request\"}",
            1.0,
        ),
        (
            "cube_csi_bridge_hook_duration_seconds_count{hook=\"attach\",outcome=\"success\"}",
            2.0,
        ),
        (
            "cube_csi_bridge_csi_call_duration_seconds_count{rpc=\"NodePublishVolume\",code=\"Ok\"}",
            1.0,
        ),
        (
            "cube_csi_bridge_csi_call_duration_seconds_count{rpc=\"NodeUnstageVolume\",code=\"Ok\"}",
            1.0,
        ),
    ] {
        let moved = sample(&after, series) - sample(&before, series);
        assert!(moved >= at_least, "{series} moved by {moved}:\n{after}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn check_proves_that_a_mount_under_the_base_dir_reaches_the_mount_view() {
    require_root!();
    let w = World::start(Mode::Binary, Caps::staging(), "").await;
    std::fs::create_dir_all(&w.base_dir).unwrap();
    let (ok, json) = run_cli(&w, &["check", "--output", "json"]);
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    let proof = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["what"].as_str().unwrap().contains("test mount"))
        .cloned()
        .unwrap_or_else(|| panic!("no propagation finding: {json}"));
    assert_eq!(proof["ok"], true, "{json}");
    let _ = ok;

    // A namespace that receives no propagation (a private one): the proof fails.
    let mut private = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sleep", "60"])
        .spawn()
        .unwrap();
    let ns = format!("/proc/{}/ns/mnt", private.id());
    // unshare execs `sleep` only once its namespace exists and propagates nothing.
    let comm = format!("/proc/{}/comm", private.id());
    common::wait_until(
        "unshare did not make its private mount namespace and exec sleep",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(&comm).is_ok_and(|c| c.trim() == "sleep")
                && std::fs::read_link(&ns).ok() != std::fs::read_link("/proc/self/ns/mnt").ok()
        },
    )
    .await;
    let text = std::fs::read_to_string(&w.config_path).unwrap();
    std::fs::write(
        &w.config_path,
        text.replace("mount_view = \"self\"", &format!("mount_view = \"{ns}\"")),
    )
    .unwrap();
    let (ok, json) = run_cli(&w, &["check", "--output", "json"]);
    let _ = private.kill();
    let _ = private.wait();
    assert!(!ok, "{json}");
    let report: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(report["ok"], false);
    assert!(json.contains("does NOT show"), "{json}");
    // The test mount is gone again, and so is its directory.
    assert!(w.mounts().is_empty(), "{:?}", w.mounts());
    let leftovers = common::left_in_base_dir(&w.base_dir);
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Starts `serve` as systemd would with socket activation: the listening socket at fd 3,
/// LISTEN_FDS=1 and LISTEN_PID naming the daemon itself.
fn start_activated(w: &World, listener: &std::os::unix::net::UnixListener) -> std::process::Child {
    let fd = listener.as_raw_fd();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(w.daemon_log_path())
        .unwrap();
    let mut command = std::process::Command::new("sh");
    command
        .arg("-c")
        .arg("LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" serve --config \"$1\"")
        .arg(BRIDGE)
        .arg(&w.config_path)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    // SAFETY: dup2 and fcntl are async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if nix::libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            nix::libc::fcntl(3, nix::libc::F_SETFD, 0);
            Ok(())
        });
    }
    command.spawn().unwrap()
}

/// Cube's own client: tests/peers/cubeclient (grpc-go, one connection for the process
/// lifetime, as Cubelet dials). Required in CI.
fn cubeclient() -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("CUBE_CSI_BRIDGE_PEERS_BIN").filter(|v| !v.is_empty());
    match dir {
        Some(dir) => Some(std::path::PathBuf::from(dir).join("cubeclient")),
        None if std::env::var_os("CI").is_some() => {
            panic!("CUBE_CSI_BRIDGE_PEERS_BIN is not set (scripts/install-test-peers.sh)")
        }
        None => None,
    }
}

/// How many of the loop's Attaches each daemon serves before it is restarted (four daemons:
/// with their Detaches, more than the 20 calls the test requires).
const CALLS_PER_DAEMON: usize = 4;

#[tokio::test(flavor = "multi_thread")]
async fn a_restart_under_socket_activation_fails_no_call() {
    require_root!();
    let Some(cubeclient) = cubeclient() else {
        common::skip("CUBE_CSI_BRIDGE_PEERS_BIN is not set (scripts/install-test-peers.sh)");
        return;
    };
    // The socket belongs to "systemd" (this test); the World starts no daemon of its own.
    let w = World::start(Mode::Binary, Caps::staging(), "").await;
    let listener = std::os::unix::net::UnixListener::bind(w.socket()).unwrap();
    let mut daemon = start_activated(&w, &listener);
    let created = rpc_call_create(&w).await;
    let stop_file = w.dir.path().join("stop-loop");
    let looping = tokio::process::Command::new(&cubeclient)
        .arg("loop")
        .arg("--target")
        .arg(w.socket())
        .args(["--volume-id", "restart", "--private-data", &created])
        .arg("--volume-base-dir")
        .arg(&w.base_dir)
        .arg("--stop-file")
        .arg(&stop_file)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Each daemon serves some of the loop's Attaches before it goes: they reach the driver.
    let served = async |w: &World| {
        let next = w.driver.arrivals("NodePublishVolume") + CALLS_PER_DAEMON;
        w.driver
            .wait_for_call("NodePublishVolume", next, Duration::from_secs(60))
            .await;
    };
    for _ in 0..3 {
        served(&w).await;
        // systemctl restart: SIGTERM, wait for the drain, start again on the same socket.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(daemon.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = daemon.wait().unwrap();
        assert!(status.success(), "daemon exit: {status}");
        daemon = start_activated(&w, &listener);
    }
    served(&w).await;
    std::fs::write(&stop_file, "").unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), looping.wait_with_output())
        .await
        .expect("the loop stops")
        .unwrap();
    let _ = daemon.kill();
    let _ = daemon.wait();
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "cubeclient loop: {e}: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let calls = summary["calls"].as_u64().unwrap();
    assert!(calls > 20, "too few calls to prove anything: {summary}");
    assert_eq!(
        summary["failures"],
        serde_json::json!([]),
        "calls failed across restarts: {summary}"
    );
    assert!(w.socket().exists(), "the activated socket was removed");
    assert!(w.mounts().is_empty(), "{:?}", w.mounts());
}

/// systemd passes the only socket bound somewhere else than serve.socket (a unit instance
/// named unlike the driver): `register` and `probe` would point Cube at serve.socket,
/// where nobody listens. Before, the daemon served the passed socket and logged it at
/// info; now it refuses to start, naming both paths and the fix.
#[tokio::test(flavor = "multi_thread")]
async fn a_passed_socket_bound_elsewhere_than_serve_socket_is_refused() {
    require_root!();
    let w = World::start(Mode::Binary, Caps::staging(), "").await;
    let elsewhere = w.dir.path().join("elsewhere.sock");
    let listener = std::os::unix::net::UnixListener::bind(&elsewhere).unwrap();
    let mut daemon = start_activated(&w, &listener);
    let status = (0..300)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            daemon.try_wait().unwrap()
        })
        .unwrap_or_else(|| {
            let _ = daemon.kill();
            panic!("the daemon serves a socket Cube is not pointed at")
        });
    assert_eq!(status.code(), Some(78), "{status}");
    let log = std::fs::read_to_string(w.daemon_log_path()).unwrap();
    assert!(
        log.contains(&elsewhere.display().to_string())
            && log.contains(&w.socket().display().to_string()),
        "{log}"
    );
}

async fn rpc_call_create(w: &World) -> String {
    use cube_csi_bridge::proto::cube::v1 as pb;
    let channel =
        cube_csi_bridge::csi::client::channel(&cube_csi_bridge::csi::Endpoint::Unix(w.socket()));
    pb::volume_controller_service_client::VolumeControllerServiceClient::new(channel)
        .create(pb::CreateRequest {
            volume_id: "restart".into(),
            name: "restart".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .private_data
}

/// `serve --metrics-listen-ip` (what the chart passes, with the pod's IP) binds the metrics
/// endpoint at that address with the config's port, and nowhere else (issue 18, finding 2:
/// the chart used to bind 0.0.0.0 on the host network).
#[tokio::test(flavor = "multi_thread")]
async fn metrics_bind_only_the_address_serve_is_given() {
    require_root!();
    let port = common::free_port();
    let w = World::start(
        Mode::Binary,
        Caps::staging(),
        &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"),
    )
    .await;
    let log = std::fs::File::create(w.daemon_log_path()).unwrap();
    let _daemon = tokio::process::Command::new(BRIDGE)
        .args(["serve", "--metrics-listen-ip", "127.0.0.2", "--config"])
        .arg(&w.config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    common::wait_until(
        "the metrics endpoint at 127.0.0.2",
        Duration::from_secs(30),
        || std::net::TcpStream::connect(("127.0.0.2", port)).is_ok(),
    )
    .await;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the config's own address is not bound as well"
    );
    // A flag without metrics.listen in the config is a config error, not a guess.
    let bare = World::start(Mode::Binary, Caps::staging(), "").await;
    let out = std::process::Command::new(BRIDGE)
        .args(["serve", "--metrics-listen-ip", "127.0.0.2", "--config"])
        .arg(&bare.config_path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("metrics.listen"));
}
