//! One daemon serving two Cube drivers from one config file (`[[drivers]]`), end to end:
//! two sockets, the fake CSI driver twice with different capabilities (one stages, one
//! needs ControllerPublish too), lifecycles interleaved, one driver's slowness and failures
//! unseen by the other, metrics and `list` split by driver, `register` printing both and
//! one socket unit, and the forked hook picking its driver by its executable's name.
//!
//! Needs root (real mounts); skips without it, except in CI.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::callers::{self, CubeCaller, Hook, RpcCaller};
use common::fake_driver::{Behavior, Caps, FakeDriver, Running};
use cube_csi_bridge::proto::cube::v1 as pb;
use tonic::Code;

const BRIDGE: &str = env!("CARGO_BIN_EXE_cube-csi-bridge");
const HOOK: &str = env!("CARGO_BIN_EXE_cube-csi-hook");
const WAIT: Duration = Duration::from_secs(20);

/// The two drivers of the file: (Cube driver name, fake capabilities).
type DriverSpec = (&'static str, fn() -> Caps);
const DRIVERS: [DriverSpec; 2] = [("alpha", Caps::staging), ("beta", Caps::all_steps)];

struct Host {
    dir: tempfile::TempDir,
    config: PathBuf,
    fakes: HashMap<&'static str, FakeDriver>,
    _servers: Vec<Running>,
    daemon: Option<tokio::process::Child>,
    metrics_port: u16,
}

impl Drop for Host {
    fn drop(&mut self) {
        // A test that fails with volumes attached must not leave their mounts behind.
        common::unmount_everything_under(self.dir.path());
    }
}

impl Host {
    async fn start() -> Host {
        let mut host = Host::prepare();
        host.serve(&[]).await;
        host
    }

    /// The fakes serving and the config written; no daemon yet.
    fn prepare() -> Host {
        let dir = tempfile::Builder::new()
            .prefix("ccb-multi-")
            .tempdir()
            .unwrap();
        let root = dir.path();
        let metrics_port = common::free_port();
        let mut text =
            format!("[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\nvolume_ids = \"plain\"\n");
        let (mut fakes, mut servers) = (HashMap::new(), Vec::new());
        for (name, caps) in DRIVERS {
            let fake = FakeDriver::new(caps(), &root.join(format!("{name}-data")));
            servers.push(fake.serve(&root.join(format!("{name}-csi.sock"))));
            fakes.insert(name, fake);
            let d = root.display();
            text.push_str(&format!(
                r#"
[[drivers]]
driver = "{name}"
[drivers.csi]
endpoint = "unix://{d}/{name}-csi.sock"
[drivers.serve]
socket = "{d}/{name}.sock"
[drivers.state]
dir = "{d}/{name}-state"
lock_dir = "{d}/{name}-locks"
[drivers.node]
default_volume_base_dir = "{d}/volumes"
mount_view = "self"
[drivers.timeouts]
create_secs = 20
destroy_secs = 20
attach_secs = 20
detach_secs = 20
rollback_secs = 10
"#
            ));
        }
        let config = root.join("bridge.toml");
        std::fs::write(&config, text).unwrap();
        Host::unserved(dir, config, fakes, servers, metrics_port)
    }

    fn unserved(
        dir: tempfile::TempDir,
        config: PathBuf,
        fakes: HashMap<&'static str, FakeDriver>,
        servers: Vec<Running>,
        metrics_port: u16,
    ) -> Host {
        Host {
            dir,
            config,
            fakes,
            _servers: servers,
            daemon: None,
            metrics_port,
        }
    }

    /// Starts `serve`; with `inherited` sockets, as systemd socket activation does: those
    /// listeners at fds 3, 4, … in that order, LISTEN_FDS and LISTEN_PID set.
    async fn serve(&mut self, inherited: &[&std::os::unix::net::UnixListener]) {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let log = std::fs::File::create(self.dir.path().join("daemon.log")).unwrap();
        let mut command = std::process::Command::new("sh");
        command
            .arg("-c")
            .arg(format!(
                "{} exec \"$0\" serve --config \"$1\"",
                if inherited.is_empty() {
                    String::new()
                } else {
                    format!("LISTEN_PID=$$ LISTEN_FDS={}", inherited.len())
                }
            ))
            .arg(BRIDGE)
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let fds: Vec<i32> = inherited.iter().map(|l| l.as_raw_fd()).collect();
        // SAFETY: dup2 and fcntl are async-signal-safe; nothing else runs between fork and
        // exec. The listeners' own fds lie above the targets (the test opened many files
        // before), so no dup2 overwrites a source still to be copied.
        unsafe {
            command.pre_exec(move || {
                for (i, fd) in fds.iter().enumerate() {
                    let target = 3 + i as i32;
                    if nix::libc::dup2(*fd, target) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    nix::libc::fcntl(target, nix::libc::F_SETFD, 0);
                }
                Ok(())
            });
        }
        let child = tokio::process::Command::from(command)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        let sockets: Vec<PathBuf> = DRIVERS.iter().map(|(n, _)| self.socket(n)).collect();
        let log = self.dir.path().join("daemon.log");
        common::wait_until(
            "both sockets accept connections",
            Duration::from_secs(30),
            || {
                sockets
                    .iter()
                    .all(|s| std::os::unix::net::UnixStream::connect(s).is_ok())
            },
        )
        .await;
        assert!(
            self.daemon.as_mut().unwrap().try_wait().unwrap().is_none(),
            "daemon exited: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }

    fn socket(&self, driver: &str) -> PathBuf {
        self.dir.path().join(format!("{driver}.sock"))
    }

    fn base_dir(&self) -> PathBuf {
        self.dir.path().join("volumes")
    }

    fn rpc(&self, driver: &str) -> RpcCaller {
        RpcCaller::new(&self.socket(driver))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// Create, Attach (writing a file through the host_path), Detach, Destroy of `volume`
    /// on `driver`; returns the host_path it was attached at.
    async fn lifecycle(&self, driver: &str, volume: &str) -> PathBuf {
        let cube = self.rpc(driver);
        let made = cube
            .create(callers::create_request(volume))
            .await
            .unwrap_or_else(|e| panic!("{driver} create {volume}: {e:?}\n{}", self.log()));
        let request = callers::attach_request(
            "default",
            &self.base_dir(),
            "sb-1",
            volume,
            0,
            &made.private_data,
        );
        let attached = cube
            .attach(request)
            .await
            .unwrap_or_else(|e| panic!("{driver} attach {volume}: {e:?}\n{}", self.log()));
        let host_path = PathBuf::from(&attached.host_path);
        std::fs::write(host_path.join("owner"), driver).unwrap();
        cube.detach(callers::detach_request(
            "default",
            "sb-1",
            volume,
            0,
            &attached.metadata,
        ))
        .await
        .unwrap_or_else(|e| panic!("{driver} detach {volume}: {e:?}\n{}", self.log()));
        cube.destroy(pb::DestroyRequest {
            volume_id: volume.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("{driver} destroy {volume}: {e:?}\n{}", self.log()));
        host_path
    }

    fn command(&self, args: &[&str]) -> (bool, String) {
        let out = std::process::Command::new(BRIDGE)
            .args(args)
            .arg("--config")
            .arg(&self.config)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_daemon_serves_two_drivers_each_on_its_own() {
    require_root!();
    let host = Host::start().await;
    let (alpha, beta) = (&host.fakes["alpha"], &host.fakes["beta"]);

    // Interleaved lifecycles of the same Cube volume id on both drivers: each driver's
    // own host_path, its own CSI calls, its own steps (beta ControllerPublishes, alpha
    // does not).
    let (path_a, path_b) =
        tokio::join!(host.lifecycle("alpha", "v1"), host.lifecycle("beta", "v1"));
    assert_eq!(path_a, host.base_dir().join("alpha+v1"));
    assert_eq!(path_b, host.base_dir().join("beta+v1"));
    let steps = |fake: &FakeDriver| fake.mutating_calls();
    assert!(
        !steps(alpha).contains(&"ControllerPublishVolume"),
        "alpha has no ControllerPublish: {:?}",
        steps(alpha)
    );
    assert!(
        steps(beta).contains(&"ControllerPublishVolume")
            && steps(beta).contains(&"NodeStageVolume"),
        "beta goes through every step: {:?}",
        steps(beta)
    );

    // alpha's driver hangs in NodePublish: beta's whole lifecycle goes on meanwhile.
    let gate = alpha.hold("NodePublishVolume");
    let held_publishes = alpha.arrivals("NodePublishVolume") + 1;
    let made = host
        .rpc("alpha")
        .create(callers::create_request("slow"))
        .await
        .unwrap();
    let slow_attach = {
        let request = callers::attach_request(
            "default",
            &host.base_dir(),
            "sb-slow",
            "slow",
            0,
            &made.private_data,
        );
        let cube = host.rpc("alpha");
        tokio::spawn(async move { cube.attach(request).await })
    };
    alpha
        .wait_for_call("NodePublishVolume", held_publishes, WAIT)
        .await;
    host.lifecycle("beta", "v2").await;
    assert!(!slow_attach.is_finished(), "alpha's Attach is still held");

    // beta's driver fails its CreateVolume: alpha's Create is not affected, and beta's
    // caller gets beta's error.
    beta.script(
        "CreateVolume",
        [Behavior::Fail(
            Code::InvalidArgument,
            "beta backend refuses",
        )],
    );
    let failed = host
        .rpc("beta")
        .create(callers::create_request("v3"))
        .await
        .expect_err("beta's driver refused");
    assert!(
        failed.message.contains("beta backend refuses"),
        "{failed:?}"
    );
    host.rpc("alpha")
        .create(callers::create_request("v3"))
        .await
        .expect("alpha creates while beta fails");

    gate.release();
    let attached = slow_attach
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("alpha's held Attach: {e:?}\n{}", host.log()));
    assert_eq!(
        Path::new(&attached.host_path),
        host.base_dir().join("alpha+slow")
    );

    // Metrics: one endpoint, every series labelled with its driver. An Attach answers its
    // caller before its last journal step, and is counted after it: scraped until the
    // held Attach is counted too.
    let needles = [
        "cube_csi_bridge_hook_calls_total{hook=\"attach\",outcome=\"success\",driver=\"alpha\"} 2",
        "cube_csi_bridge_hook_calls_total{hook=\"attach\",outcome=\"success\",driver=\"beta\"} 2",
        "cube_csi_bridge_hook_calls_total{hook=\"create\",outcome=\"success\",driver=\"alpha\"} 3",
        "cube_csi_bridge_csi_call_duration_seconds_count{rpc=\"ControllerPublishVolume\",code=\"Ok\",driver=\"beta\"}",
        "driver=\"beta\"",
    ];
    let mut text = common::scrape_metrics(host.metrics_port).await;
    let until = std::time::Instant::now() + WAIT;
    while !needles.iter().all(|n| text.contains(n)) && std::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        text = common::scrape_metrics(host.metrics_port).await;
    }
    for needle in needles {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    assert!(
        !text.contains("rpc=\"ControllerPublishVolume\",code=\"Ok\",driver=\"alpha\""),
        "alpha never ControllerPublished:\n{text}"
    );

    // list: one section per driver, or the one --driver names.
    let (ok, listed) = host.command(&["list"]);
    assert!(ok, "{listed}");
    let alpha_at = listed.find("== driver alpha ==").expect(&listed);
    let beta_at = listed.find("== driver beta ==").expect(&listed);
    assert!(
        listed[alpha_at..beta_at].contains("slow"),
        "alpha's attached volume under alpha: {listed}"
    );
    assert!(!listed[beta_at..].contains("slow"), "{listed}");
    let (ok, json) = host.command(&["list", "--driver", "beta", "--output", "json"]);
    assert!(ok, "{json}");
    let volumes: serde_json::Value = serde_json::from_str(&json).expect(&json);
    assert_eq!(volumes.as_array().map(Vec::len), Some(0), "{json}");
    let (ok, json) = host.command(&["list", "--output", "json"]);
    assert!(ok, "{json}");
    let by_driver: serde_json::Value = serde_json::from_str(&json).expect(&json);
    assert_eq!(
        by_driver["alpha"].as_array().map(Vec::len),
        Some(1),
        "{json}"
    );
    assert_eq!(
        by_driver["beta"].as_array().map(Vec::len),
        Some(0),
        "{json}"
    );

    // register: both drivers, and the socket unit passing both sockets to one daemon.
    let (ok, registered) = host.command(&["register"]);
    assert!(ok, "{registered}");
    for driver in ["alpha", "beta"] {
        assert!(
            registered.contains(&format!("name: {driver}"))
                && registered.contains(&format!("ListenStream={}", host.socket(driver).display())),
            "{driver} in:\n{registered}"
        );
    }

    // The held volume goes like any other: a test that ended with it attached left its
    // two mounts on the host after every run.
    host.rpc("alpha")
        .detach(callers::detach_request(
            "default",
            "sb-slow",
            "slow",
            0,
            &attached.metadata,
        ))
        .await
        .unwrap_or_else(|e| panic!("alpha detach slow: {e:?}\n{}", host.log()));
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let base = host.base_dir();
    assert!(
        !mountinfo.contains(&*base.to_string_lossy()),
        "mounts left under {}:\n{mountinfo}",
        base.display()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forked_hook_serves_the_driver_its_executable_name_picks() {
    require_root!();
    let mut host = Host::start().await;
    // The forked hook shares the daemon's state dirs; the daemon is not needed here.
    host.daemon.take();
    let link_dir = host.dir.path().join("bin");
    std::fs::create_dir(&link_dir).unwrap();
    let run = |program: PathBuf, hook: Hook| {
        let config = host.config.clone();
        async move {
            let out = tokio::process::Command::new(program)
                .args(hook.argv())
                .env("CUBE_CSI_BRIDGE_CONFIG", config)
                .output()
                .await
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            (out.status.success(), stdout)
        }
    };
    let create = || Hook::Create(callers::create_request("forked"));

    // Plain `cube-csi-bridge` cannot tell which driver is meant: a clear error.
    let (ok, answer) = run(PathBuf::from(BRIDGE), create()).await;
    assert!(!ok, "{answer}");
    assert!(
        answer.contains("several drivers (alpha, beta)"),
        "names the drivers: {answer}"
    );
    assert!(host.fakes["alpha"].mutating_calls().is_empty());

    // `cube-csi-bridge-beta` is beta's hook: beta's driver gets the call.
    let link = link_dir.join("cube-csi-bridge-beta");
    std::os::unix::fs::symlink(BRIDGE, &link).unwrap();
    host.fakes["alpha"].clear_calls();
    host.fakes["beta"].clear_calls();
    let (ok, answer) = run(link.clone(), create()).await;
    assert!(ok, "{answer}");
    assert_eq!(host.fakes["beta"].mutating_calls(), ["CreateVolume"]);
    assert!(host.fakes["alpha"].mutating_calls().is_empty());

    // A name the file does not list is refused before any call.
    let unknown = link_dir.join("cube-csi-bridge-gamma");
    std::os::unix::fs::symlink(BRIDGE, &unknown).unwrap();
    let (ok, answer) = run(unknown, create()).await;
    assert!(
        !ok && answer.contains("no driver \\\"gamma\\\""),
        "{answer}"
    );
    assert_eq!(host.fakes["beta"].mutating_calls(), ["CreateVolume"]);

    // The same link made to the hook front: the front hands a Create to the full binary
    // beside it with argv[0] kept, so the name still picks beta.
    let front_dir = host.dir.path().join("front-bin");
    std::fs::create_dir(&front_dir).unwrap();
    let front_link = front_dir.join("cube-csi-bridge-beta");
    std::os::unix::fs::symlink(HOOK, &front_link).unwrap();
    host.fakes["beta"].clear_calls();
    let create = Hook::Create(callers::create_request("forked-front"));
    let (ok, answer) = run(front_link, create).await;
    assert!(ok, "{answer}");
    assert_eq!(host.fakes["beta"].mutating_calls(), ["CreateVolume"]);
    assert!(host.fakes["alpha"].mutating_calls().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn socket_activation_hands_each_driver_the_socket_bound_at_its_path() {
    require_root!();
    let mut host = Host::prepare();
    // systemd passes the sockets in its own order (here beta's first): each driver must
    // take the one bound at its serve.socket, not the one at a position.
    let beta = std::os::unix::net::UnixListener::bind(host.socket("beta")).unwrap();
    let alpha = std::os::unix::net::UnixListener::bind(host.socket("alpha")).unwrap();
    host.serve(&[&beta, &alpha]).await;
    for driver in ["alpha", "beta"] {
        host.rpc(driver)
            .with_timeout(WAIT)
            .create(callers::create_request(&format!("on-{driver}")))
            .await
            .unwrap_or_else(|e| panic!("create on {driver}'s socket: {e:?}\n{}", host.log()));
    }
    for (driver, other) in [("alpha", "beta"), ("beta", "alpha")] {
        let names: Vec<String> = host.fakes[driver]
            .calls()
            .iter()
            .filter(|c| c.method == "CreateVolume")
            .map(|c| c.volume_id.clone())
            .collect();
        assert!(
            names.iter().any(|n| n.contains(&format!("on-{driver}")))
                && !names.iter().any(|n| n.contains(&format!("on-{other}"))),
            "{driver}'s driver got the Create sent to {driver}'s socket only: {names:?}"
        );
    }
    assert!(
        host.log()
            .matches("serving on the socket systemd passed")
            .count()
            == 2,
        "{}",
        host.log()
    );
}
