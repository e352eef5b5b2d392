//! The bridge end to end, as root with real mounts, through both Cube transports: the
//! `serve` daemon over gRPC and the executable forked per hook. A fake CSI driver records
//! every call and can be told to fail, hang or slow down.

mod common;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::fake_driver::{Behavior, Caps, FAKE_NODE_ID};
use common::{MODES, Mode, World};
use tonic::Code;

/// The whole Cube lifecycle, asserting the exact CSI calls of each hook.
async fn assert_call_sequence(
    mode: Mode,
    caps: Caps,
    attach_calls: &[&str],
    detach_calls: &[&str],
) {
    let w = World::start(mode, caps, "").await;
    let step = |expected: &[&str]| {
        assert_eq!(w.driver.mutating_calls(), expected, "{mode:?} {caps:?}");
        w.driver.clear_calls();
    };
    let created = w.create("vol-1").await.unwrap();
    assert_eq!(created.token, "");
    step(&["CreateVolume"]);

    let a = w
        .attach("sb-a", "vol-1", 0, &created.private_data)
        .await
        .unwrap();
    assert_eq!(Path::new(&a.host_path), w.base_dir.join("fake+vol-1"));
    assert!(
        w.mounts().contains(&w.base_dir.join("fake+vol-1")),
        "host_path is a mount point"
    );
    step(attach_calls);

    let b = w
        .attach("sb-b", "vol-1", 1, &created.private_data)
        .await
        .unwrap();
    assert_eq!(a.host_path, b.host_path);
    step(&[]);

    w.detach("sb-b", "vol-1", 1, &b.metadata).await.unwrap();
    step(&[]);
    assert!(
        w.mounts().contains(&w.base_dir.join("fake+vol-1")),
        "still mounted for sb-a"
    );

    w.detach("sb-a", "vol-1", 0, &a.metadata).await.unwrap();
    step(detach_calls);
    assert_eq!(
        w.mounts(),
        Vec::<std::path::PathBuf>::new(),
        "nothing left mounted"
    );
    assert!(!w.base_dir.join("fake+vol-1").exists(), "host_path removed");
    assert!(
        !w.base_dir.join(".staging/fake+vol-1").exists(),
        "staging removed"
    );
    assert_eq!(w.journal_records(), 0);

    let csi_volume = w.driver.csi_volume_of("vol-1").unwrap();
    w.destroy("vol-1").await.unwrap();
    step(&["DeleteVolume"]);
    assert!(!w.driver.volume_dir(&csi_volume).exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn call_sequence_with_stage_unstage() {
    require_root!();
    for mode in MODES {
        let caps = Caps::staging();
        assert_call_sequence(
            mode,
            caps,
            &["NodeStageVolume", "NodePublishVolume"],
            &["NodeUnpublishVolume", "NodeUnstageVolume"],
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn call_sequence_without_stage_unstage() {
    require_root!();
    for mode in MODES {
        assert_call_sequence(
            mode,
            Caps::default(),
            &["NodePublishVolume"],
            &["NodeUnpublishVolume"],
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn call_sequence_with_controller_publish() {
    require_root!();
    for mode in MODES {
        let caps = Caps {
            stage: true,
            controller_publish: true,
            ..Default::default()
        };
        assert_call_sequence(
            mode,
            caps,
            &[
                "ControllerPublishVolume",
                "NodeStageVolume",
                "NodePublishVolume",
            ],
            &[
                "NodeUnpublishVolume",
                "NodeUnstageVolume",
                "ControllerUnpublishVolume",
            ],
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn controller_publish_passes_node_id_and_publish_context() {
    require_root!();
    let caps = Caps {
        stage: true,
        controller_publish: true,
        ..Default::default()
    };
    let w = World::start(Mode::Rpc, caps, "").await;
    let created = w.create("v").await.unwrap();
    let a = w.attach("sb", "v", 0, &created.private_data).await.unwrap();
    let calls = w.driver.calls();
    let find = |m: &str| calls.iter().find(|c| c.method == m).unwrap().clone();
    assert_eq!(find("ControllerPublishVolume").node_id, FAKE_NODE_ID);
    let device = format!("/dev/fake-{FAKE_NODE_ID}");
    assert_eq!(find("NodeStageVolume").publish_context["device"], device);
    assert_eq!(find("NodePublishVolume").publish_context["device"], device);
    w.detach("sb", "v", 0, &a.metadata).await.unwrap();
    let calls = w.driver.calls();
    let unpublish = calls
        .iter()
        .find(|c| c.method == "ControllerUnpublishVolume")
        .unwrap();
    assert_eq!(unpublish.node_id, FAKE_NODE_ID);
}

#[tokio::test(flavor = "multi_thread")]
async fn data_written_through_host_path_survives_detach_and_reattach() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let created = w.create("data").await.unwrap();
        let a = w
            .attach("sb-a", "data", 0, &created.private_data)
            .await
            .unwrap();
        std::fs::write(Path::new(&a.host_path).join("f.txt"), "kept").unwrap();
        w.detach("sb-a", "data", 0, &a.metadata).await.unwrap();
        assert!(
            !Path::new(&a.host_path).join("f.txt").exists(),
            "not mounted any more"
        );
        let b = w
            .attach("sb-b", "data", 0, &created.private_data)
            .await
            .unwrap();
        let read = std::fs::read_to_string(Path::new(&b.host_path).join("f.txt")).unwrap();
        assert_eq!(read, "kept", "{mode:?}");
        w.detach("sb-b", "data", 0, &b.metadata).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn destroy_and_detach_of_what_is_gone_succeed() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::default(), "").await;
        // Never created here at all.
        w.destroy("never-created").await.unwrap();
        let created = w.create("gone").await.unwrap();
        w.destroy("gone").await.unwrap();
        w.destroy("gone").await.unwrap();
        // The backend volume vanished behind the bridge's back.
        let created2 = w.create("vanished").await.unwrap();
        let vanished = w.driver.csi_volume_of("vanished").unwrap();
        std::fs::remove_dir_all(w.driver.volume_dir(&vanished)).unwrap();
        w.destroy("vanished").await.unwrap();
        assert_eq!(
            w.driver
                .mutating_calls()
                .iter()
                .filter(|c| **c == "DeleteVolume")
                .count(),
            2,
            "only recorded volumes reach the driver"
        );

        // Detach of a volume that is not attached: with Attach-shaped metadata, and empty.
        w.driver.clear_calls();
        let meta = HashMap::from([
            (
                "mount_dir".to_string(),
                w.base_dir.join("fake+gone").display().to_string(),
            ),
            ("volume_id".to_string(), "gone".to_string()),
            ("csi_volume_id".to_string(), "fake-cube-gone".to_string()),
        ]);
        w.detach("sb", "gone", 0, &meta).await.unwrap();
        w.detach("sb", "gone", 0, &HashMap::new()).await.unwrap();
        assert_eq!(
            w.driver.mutating_calls(),
            Vec::<&str>::new(),
            "nothing to undo, no CSI call"
        );
        let _ = (created, created2);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn node_publish_error_leaves_nothing_staged_or_mounted() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let created = w.create("bad").await.unwrap();
        w.driver.clear_calls();
        w.driver.script(
            "NodePublishVolume",
            [Behavior::Fail(
                Code::Internal,
                "mount: wrong fs type, bad option",
            )],
        );
        let err = w
            .attach("sb", "bad", 0, &created.private_data)
            .await
            .unwrap_err();
        assert!(
            err.message.contains("NodePublishVolume"),
            "{mode:?}: {}",
            err.message
        );
        assert!(
            err.message.contains("mount: wrong fs type, bad option"),
            "{}",
            err.message
        );
        assert!(
            err.message.contains("\"bad\""),
            "names the volume: {}",
            err.message
        );
        if mode == Mode::Rpc {
            assert_eq!(err.code, Some(Code::Internal));
        }
        // NodeUnpublish before NodeUnstage: while a stage is undone, any publish the driver
        // may still count is unpublished first (idempotent; issue 19, defect 5).
        assert_eq!(
            w.driver.mutating_calls(),
            [
                "NodeStageVolume",
                "NodePublishVolume",
                "NodeUnpublishVolume",
                "NodeUnstageVolume"
            ]
        );
        assert_eq!(
            w.mounts(),
            Vec::<std::path::PathBuf>::new(),
            "nothing mounted"
        );
        assert!(
            !w.base_dir.join(".staging/fake+bad").exists(),
            "staging dir removed"
        );
        assert!(!w.base_dir.join("fake+bad").exists(), "target removed");
        assert_eq!(w.journal_records(), 0, "no journal record left");
        // And the volume still attaches once the driver recovers.
        let ok = w
            .attach("sb", "bad", 0, &created.private_data)
            .await
            .unwrap();
        w.detach("sb", "bad", 0, &ok.metadata).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn aborted_is_retried_to_success() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        w.driver.script(
            "CreateVolume",
            [Behavior::Fail(Code::Aborted, "operation pending")],
        );
        let created = w.create("retry").await.unwrap();
        w.driver.script(
            "NodePublishVolume",
            [
                Behavior::Fail(Code::Aborted, "pending"),
                Behavior::Fail(Code::Unavailable, "restarting"),
            ],
        );
        let a = w
            .attach("sb", "retry", 0, &created.private_data)
            .await
            .unwrap();
        assert_eq!(
            w.driver.mutating_calls(),
            [
                "CreateVolume",
                "CreateVolume",
                "NodeStageVolume",
                "NodePublishVolume",
                "NodePublishVolume",
                "NodePublishVolume"
            ],
            "{mode:?}"
        );
        w.detach("sb", "retry", 0, &a.metadata).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hanging_driver_is_cut_off_by_the_budget() {
    require_root!();
    for mode in MODES {
        let timeouts = "[timeouts]\nattach_secs = 6\nrollback_secs = 5\n";
        let w = World::start(mode, Caps::staging(), timeouts).await;
        let created = w.create("hang").await.unwrap();
        w.driver.script(
            "NodePublishVolume",
            [Behavior::Delay(Duration::from_secs(3600))],
        );
        let started = Instant::now();
        let err = w
            .attach("sb", "hang", 0, &created.private_data)
            .await
            .unwrap_err();
        let took = started.elapsed();
        assert!(err.message.contains("NodePublishVolume"), "{}", err.message);
        assert!(err.message.contains("budget"), "{}", err.message);
        if mode == Mode::Rpc {
            assert_eq!(err.code, Some(Code::DeadlineExceeded));
        }
        // Generous bound: the point is "cut off", not a timing benchmark.
        assert!(took < Duration::from_secs(30), "{mode:?} took {took:?}");
        assert_eq!(w.mounts(), Vec::<std::path::PathBuf>::new(), "rolled back");
        assert_eq!(w.journal_records(), 0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_attaches_of_one_volume_stage_and_publish_once() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let created = w.create("shared").await.unwrap();
        w.driver.clear_calls();
        // A slow stage makes the two Attach calls overlap.
        w.driver.script(
            "NodeStageVolume",
            [Behavior::Delay(Duration::from_millis(500))],
        );
        let (a, b) = tokio::join!(
            w.attach("sb-a", "shared", 0, &created.private_data),
            w.attach("sb-b", "shared", 0, &created.private_data)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.host_path, b.host_path);
        assert_eq!(
            w.driver.mutating_calls(),
            ["NodeStageVolume", "NodePublishVolume"],
            "{mode:?}"
        );
        w.detach("sb-b", "shared", 1, &b.metadata).await.unwrap();
        w.detach("sb-a", "shared", 0, &a.metadata).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn attach_with_holders_repairs_a_lost_mount() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let created = w.create("lost").await.unwrap();
        let a = w
            .attach("sb-a", "lost", 0, &created.private_data)
            .await
            .unwrap();
        // The mounts vanish (a reboot drops them) while Cube's counts survive.
        for m in [
            Path::new(&a.host_path).to_path_buf(),
            w.base_dir.join(".staging/fake+lost"),
        ] {
            cube_csi_bridge::mount::ops::unmount(&m).unwrap();
        }
        w.driver.clear_calls();
        let b = w
            .attach("sb-b", "lost", 1, &created.private_data)
            .await
            .unwrap();
        // The lost publish is unpublished before it is made again, so that a driver that
        // counts publishes counts it once (issue 19, defect 5).
        assert_eq!(
            w.driver.mutating_calls(),
            [
                "NodeStageVolume",
                "NodeUnpublishVolume",
                "NodePublishVolume"
            ],
            "{mode:?}"
        );
        assert!(
            w.mounts().contains(&Path::new(&b.host_path).to_path_buf()),
            "mounted again"
        );
        w.detach("sb-b", "lost", 1, &b.metadata).await.unwrap();
        w.detach("sb-a", "lost", 0, &a.metadata).await.unwrap();
        assert_eq!(w.mounts(), Vec::<std::path::PathBuf>::new());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_change_nothing() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let created = w.create("ok").await.unwrap();
        w.driver.clear_calls();
        let cases = [
            (
                "../etc",
                created.private_data.clone(),
                w.base_dir.clone(),
                "volume_id",
            ),
            (
                "ok",
                "not-a-handle".to_string(),
                w.base_dir.clone(),
                "private_data",
            ),
            ("ok", String::new(), w.base_dir.clone(), "private_data"),
            (
                "ok",
                created.private_data.clone(),
                w.dir.path().join("volumes/../etc"),
                "volume_base_dir",
            ),
        ];
        for (id, private_data, base, field) in cases {
            let err = w
                .attach_in(&base, "sb", id, 0, &private_data)
                .await
                .unwrap_err();
            assert!(
                err.message.contains(field),
                "{mode:?} {field}: {}",
                err.message
            );
            if mode == Mode::Rpc {
                assert_eq!(err.code, Some(Code::InvalidArgument));
            }
        }
        let err = w.create("a/b").await.unwrap_err();
        assert!(err.message.contains("volume_id"), "{}", err.message);
        let evil = HashMap::from([
            ("mount_dir".to_string(), "/etc/fake+ok".to_string()),
            ("volume_id".to_string(), "other".to_string()),
            ("csi_volume_id".to_string(), "x".to_string()),
        ]);
        let err = w.detach("sb", "ok", 0, &evil).await.unwrap_err();
        assert!(err.message.contains("metadata"), "{}", err.message);
        assert_eq!(
            w.driver.mutating_calls(),
            Vec::<&str>::new(),
            "no CSI call for a bad request"
        );
        assert_eq!(w.journal_records(), 0, "no record written");
        assert_eq!(w.mounts(), Vec::<std::path::PathBuf>::new(), "no mount");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn secrets_and_mount_flags_never_reach_the_logs() {
    require_root!();
    let secret_config = r#"
[volume]
mount_flags = ["vers=4.1", "password=FLAG-SECRET-1"]
parameters = { server = "10.0.0.5" }

[secrets.provisioner]
token = "PROV-SECRET-2"
[secrets.node_stage]
key = "STAGE-SECRET-3"
[secrets.node_publish]
key = "PUBLISH-SECRET-4"
[secrets.controller_publish]
key = "CTRL-SECRET-5"
"#;
    for mode in MODES {
        let caps = Caps {
            stage: true,
            controller_publish: true,
            ..Default::default()
        };
        // A config holding secrets must be private (the bridge refuses one others can read).
        let mut w = World::start(Mode::Binary, caps, secret_config).await;
        std::fs::set_permissions(&w.config_path, std::fs::Permissions::from_mode(0o600)).unwrap();
        if mode == Mode::Rpc {
            w.mode = mode;
            w.start_daemon().await.unwrap();
        }
        let created = w.create("sec").await.unwrap();
        let a = w
            .attach("sb", "sec", 0, &created.private_data)
            .await
            .unwrap();
        // A failing call too, so that error paths are logged.
        w.driver.script(
            "NodeUnpublishVolume",
            [Behavior::Fail(Code::Internal, "device busy")],
        );
        assert!(w.detach("sb", "sec", 0, &a.metadata).await.is_err());
        w.detach("sb", "sec", 0, &a.metadata).await.unwrap();
        w.destroy("sec").await.unwrap();

        // The secrets did reach the driver, each on its own calls.
        let calls = w.driver.calls();
        let secret_of = |m: &str| {
            calls
                .iter()
                .find(|c| c.method == m)
                .unwrap()
                .secrets
                .clone()
        };
        assert_eq!(secret_of("CreateVolume")["token"], "PROV-SECRET-2");
        assert_eq!(secret_of("DeleteVolume")["token"], "PROV-SECRET-2");
        assert_eq!(secret_of("NodeStageVolume")["key"], "STAGE-SECRET-3");
        assert_eq!(secret_of("NodePublishVolume")["key"], "PUBLISH-SECRET-4");
        assert_eq!(secret_of("ControllerPublishVolume")["key"], "CTRL-SECRET-5");
        let publish = calls
            .iter()
            .find(|c| c.method == "NodePublishVolume")
            .unwrap();
        assert!(
            publish
                .mount_flags
                .contains(&"password=FLAG-SECRET-1".to_string())
        );

        let logs = w.logs();
        assert!(
            logs.contains("hook succeeded"),
            "debug logs were captured: {mode:?}"
        );
        for secret in [
            "FLAG-SECRET-1",
            "PROV-SECRET-2",
            "STAGE-SECRET-3",
            "PUBLISH-SECRET-4",
            "CTRL-SECRET-5",
        ] {
            assert!(
                !logs.contains(secret),
                "{mode:?}: {secret} leaked into the logs"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_in_flight_hooks_finish_and_refuses_new_ones() {
    require_root!();
    let mut w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let created = w.create("slow").await.unwrap();
    // The Attach stays in NodePublishVolume until released: SIGTERM comes meanwhile.
    let publish = w.driver.hold("NodePublishVolume");
    let next = w.driver.arrivals("NodePublishVolume") + 1;
    let daemon = w.daemon.take().unwrap();
    let pid = nix::unistd::Pid::from_raw(daemon.id().unwrap() as i32);
    let socket = w.socket();
    let (attached, gone_while_draining) =
        tokio::join!(w.attach("sb", "slow", 0, &created.private_data), async {
            w.driver
                .wait_for_call("NodePublishVolume", next, Duration::from_secs(30))
                .await;
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
            // Polled while the Attach is held in flight, so the daemon is still draining.
            let until = Instant::now() + Duration::from_secs(30);
            while socket.exists() && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let gone = !socket.exists();
            publish.release();
            gone
        });
    let attached = attached.expect("the in-flight Attach finishes");
    // Removed as soon as shutdown begins, while the listener still holds its inode: a
    // successor binding the path meanwhile is never removed by this daemon.
    assert!(gone_while_draining, "the socket stayed while draining");
    assert!(
        w.mounts()
            .contains(&Path::new(&attached.host_path).to_path_buf())
    );
    // A new hook is refused while draining or after exit.
    assert!(w.create("late").await.is_err(), "new hooks are refused");
    let status = tokio::time::timeout(Duration::from_secs(20), daemon.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(status.status.success(), "clean exit: {:?}", status.status);
    assert!(!w.socket().exists(), "socket removed on exit");
}

#[tokio::test(flavor = "multi_thread")]
async fn daemon_reconnects_after_the_driver_restarts() {
    require_root!();
    let mut w = World::start(Mode::Rpc, Caps::default(), "").await;
    w.create("r1").await.unwrap();
    w.driver_server.take().unwrap().stop().await;
    // Down: the call fails after retrying within its budget (kept short here).
    let restart = w.driver.clone();
    let socket = w.dir.path().join("csi.sock");
    let retrying = r#"CSI call failed non-finally; retrying call="CreateVolume""#;
    let retries = w.daemon_log_lines(retrying);
    let (created, server) = tokio::join!(w.create("r2"), async {
        // The bridge found the driver down and is retrying: bring it back.
        w.wait_for_daemon_log(retrying, retries + 1, Duration::from_secs(30))
            .await;
        restart.serve(&socket)
    });
    w.driver_server = Some(server);
    created.expect("the call retried until the driver was back");
    w.create("r3").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_refuses_a_driver_it_cannot_use() {
    require_root!();
    // The driver advertises a controller service its endpoint does not serve, and no
    // csi.controller_endpoint points elsewhere.
    let caps = Caps {
        controller_unreachable: true,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let driver = common::fake_driver::FakeDriver::new(caps, &dir.path().join("data"));
    let _server = driver.serve(&dir.path().join("csi.sock"));
    let config = dir.path().join("c.toml");
    std::fs::write(&config, common::config_text(dir.path(), "")).unwrap();
    let out = tokio::process::Command::new(common::BRIDGE)
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(78), "EX_CONFIG");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("controller_endpoint"),
        "says what to fix: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn volume_ids_starting_with_a_dash_work_in_both_modes() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::default(), "").await;
        let created = w.create("-dash").await.unwrap();
        let a = w
            .attach("-sb", "-dash", 0, &created.private_data)
            .await
            .unwrap();
        assert_eq!(Path::new(&a.host_path), w.base_dir.join("fake+-dash"));
        w.detach("-sb", "-dash", 0, &a.metadata).await.unwrap();
        w.destroy("-dash").await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_rolls_back_an_attach_interrupted_by_a_crash() {
    require_root!();
    let mut w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let created = w.create("crash").await.unwrap();
    w.attach("sb", "crash", 0, &created.private_data)
        .await
        .unwrap();
    // kill -9 the daemon, and make the journal look as it does when the crash came while
    // NodePublishVolume was in flight (written before the call, never completed).
    let mut daemon = w.daemon.take().unwrap();
    daemon.kill().await.unwrap();
    let text = std::fs::read_to_string(w.dir.path().join("state/node/crash.json")).unwrap();
    assert!(text.contains(r#""publish":"done""#), "{text}");
    // An Attach in flight has not recorded its sandbox as a holder yet: the record and
    // the holder log as the save before the call left them.
    w.leave_held_by_nobody("crash", |json| json["publish"] = "uncertain".into());
    w.driver.clear_calls();

    w.start_daemon().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while w.journal_records() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        w.journal_records(),
        0,
        "reconciliation finished the teardown"
    );
    assert_eq!(
        w.driver.mutating_calls(),
        ["NodeUnpublishVolume", "NodeUnstageVolume"]
    );
    assert_eq!(
        w.mounts(),
        Vec::<std::path::PathBuf>::new(),
        "nothing leaked"
    );
    // Cube's retry of the Attach then starts from a clean slate.
    let a = w
        .attach("sb", "crash", 0, &created.private_data)
        .await
        .unwrap();
    w.detach("sb", "crash", 0, &a.metadata).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_base_dir_reached_through_a_symlink_works() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        std::fs::create_dir_all(&w.base_dir).unwrap();
        let link = w.dir.path().join("link");
        std::os::unix::fs::symlink(&w.base_dir, &link).unwrap();
        let created = w.create("sym").await.unwrap();
        let a = w
            .attach_in(&link, "sb", "sym", 0, &created.private_data)
            .await
            .unwrap();
        // Cube checks host_path lexically against its own base dir: keep Cube's spelling.
        assert_eq!(Path::new(&a.host_path), link.join("fake+sym"), "{mode:?}");
        w.driver.clear_calls();
        let again = w
            .attach_in(&link, "sb2", "sym", 1, &created.private_data)
            .await
            .unwrap();
        assert_eq!(
            w.driver.mutating_calls(),
            Vec::<&str>::new(),
            "recognised as mounted"
        );
        w.detach("sb2", "sym", 1, &again.metadata).await.unwrap();
        w.detach("sb", "sym", 0, &a.metadata).await.unwrap();
        assert_eq!(w.mounts(), Vec::<std::path::PathBuf>::new());
    }
}
