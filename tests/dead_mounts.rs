//! Issue 19, defect 8, end to end through both transports (the `serve` daemon over its
//! socket, and the forked binary hook) with real mounts: a FUSE filesystem whose daemon
//! died is still a mount point but answers every stat with ENOTCONN. The next Attach must
//! repair it (unpublish, unstage, stage, publish) before it hands host_path out, and
//! `list`, the daemon's log and its metrics report the condition of the volume meanwhile;
//! so they do for the driver's abnormal VolumeCondition. The dead mount is the real thing,
//! made without a FUSE library: a mount of /dev/fuse whose descriptor (the daemon's end)
//! is closed at once. Needs root and /dev/fuse; CI runs it as root.

mod common;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::fake_driver::ExpansionProfile;
use common::fake_driver::{Behavior, Caps};
use common::{BRIDGE, MODES, Mode, World};

const CAPS: Caps = Caps {
    stage: true,
    controller_publish: false,
    controller_unreachable: false,
    volume_stats: false,
    share_mounts: false,
    verifies_existing_mount: false,
    counts_publishes: true,
    volume_condition: true,
    snapshots: false,
    zone: None,
    volume_mount_group: false,
    single_node_multi_writer: false,
    expansion: ExpansionProfile {
        controller: false,
        node: false,
        online: None,
        node_expansion_required: false,
    },
};

/// Mounts a FUSE filesystem at `at` and closes its daemon's end at once: the mount stays,
/// and every request to it fails with ENOTCONN, as after a FUSE daemon's crash.
fn mount_dead_fuse(at: &Path) {
    let fuse = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .expect("opening /dev/fuse");
    let options = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0",
        fuse.as_raw_fd()
    );
    nix::mount::mount(
        Some("cube-csi-bridge-test"),
        at,
        Some("fuse.cube-csi-bridge-test"),
        nix::mount::MsFlags::empty(),
        Some(options.as_str()),
    )
    .unwrap_or_else(|e| panic!("mounting a FUSE filesystem at {}: {e}", at.display()));
    drop(fuse);
}

/// The filesystem at `host_path` dies: the driver's mounts at the staging path and at
/// host_path are replaced by a dead FUSE mount each (as when the FUSE daemon that served
/// the staged volume, and so its bind at host_path, crashed).
fn kill_filesystem(host_path: &Path, staging: &Path) {
    for path in [host_path, staging] {
        cube_csi_bridge::mount::ops::unmount(path).unwrap();
        mount_dead_fuse(path);
    }
    let error = std::fs::metadata(host_path).expect_err("a dead mount answers a stat");
    assert_eq!(error.raw_os_error(), Some(nix::libc::ENOTCONN), "{error}");
}

fn staging_of(w: &World, volume: &str) -> PathBuf {
    cube_csi_bridge::bridge::naming::VolumePaths::new(&w.base_dir, common::DRIVER, volume).staging
}

/// `cube-csi-bridge list` of this world's node, as text or JSON.
fn list(w: &World, json: bool) -> String {
    let mut command = std::process::Command::new(BRIDGE);
    command.args(["list", "--config"]).arg(&w.config_path);
    if json {
        command.args(["--output", "json"]);
    }
    let out = command.stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The `condition` of `volume` in `list --output json`.
fn listed_condition(w: &World, volume: &str) -> serde_json::Value {
    let listed: serde_json::Value = serde_json::from_str(&list(w, true)).unwrap();
    listed
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["volume_id"] == volume)
        .unwrap_or_else(|| panic!("{volume} not listed: {listed}"))["condition"]
        .clone()
}

/// The text line of `volume` in `list`.
fn listed_line(w: &World, volume: &str) -> String {
    list(w, false)
        .lines()
        .find(|l| l.starts_with(&format!("{volume}\t")))
        .unwrap_or_else(|| panic!("{volume} not listed"))
        .to_string()
}

fn require_fuse() -> bool {
    if Path::new("/dev/fuse").exists() {
        return true;
    }
    common::skip("no /dev/fuse on this host");
    false
}

/// Restarts the daemon (its condition check runs at start) and waits for its log line.
async fn restart_and_wait_for_log(w: &mut World, needle: &str) {
    let mut daemon = w.daemon.take().unwrap();
    daemon.kill().await.unwrap();
    daemon.wait().await.unwrap();
    let before = w.daemon_log_lines(needle);
    w.start_daemon().await.unwrap();
    w.wait_for_daemon_log(needle, before + 1, Duration::from_secs(30))
        .await;
}

async fn condition_gauge(port: u16, volume: &str) -> String {
    let text = common::scrape_metrics(port).await;
    let series = format!("cube_csi_bridge_volume_condition_abnormal{{volume_id=\"{volume}\"}}");
    text.lines()
        .find(|l| l.starts_with(&series))
        .unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
        .trim_start_matches(&series)
        .trim()
        .to_string()
}

fn metrics_config(port: u16) -> String {
    format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\nvolume_ids = \"plain\"\n")
}

/// A dead mount at host_path is listed (and, by the daemon, logged and counted) as such,
/// and the next Attach of another sandbox repairs it before it answers: host_path then
/// answers and shows the volume's data; the last Detach leaves nothing. Before the fix,
/// the Attach answered on the hot path with the dead host_path.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_fuse_mount_is_repaired_before_attach_hands_it_out() {
    require_root!();
    if !require_fuse() {
        return;
    }
    for mode in MODES {
        let port = common::free_port();
        let mut w = World::start(mode, CAPS, &metrics_config(port)).await;
        let created = w.create("dead").await.unwrap();
        let pd = &created.private_data;
        let a = w.attach("s1", "dead", 0, pd).await.unwrap();
        let host_path = PathBuf::from(&a.host_path);
        std::fs::write(host_path.join("f.txt"), "kept").unwrap();
        kill_filesystem(&host_path, &staging_of(&w, "dead"));

        let condition = listed_condition(&w, "dead");
        assert_eq!(condition["state"], "dead_mount", "{mode:?}: {condition}");
        assert!(
            condition["error"].as_str().unwrap().starts_with("ENOTCONN"),
            "{mode:?}: {condition}"
        );
        assert!(
            listed_line(&w, "dead").contains("\tdead:ENOTCONN\t"),
            "{mode:?}: {}",
            list(&w, false)
        );
        if mode == Mode::Rpc {
            restart_and_wait_for_log(&mut w, "volume condition abnormal").await;
            assert_eq!(condition_gauge(port, "dead").await, "1");
        }

        // A repair that fails fails the Attach, naming the path, the errno and the step,
        // and keeps the holder the volume had.
        w.driver.script(
            "NodeStageVolume",
            [Behavior::Fail(tonic::Code::Internal, "backend unreachable")],
        );
        let failed = w
            .attach("s2", "dead", 1, pd)
            .await
            .expect_err("the repair's NodeStageVolume fails");
        for needed in [
            a.host_path.as_str(),
            "ENOTCONN",
            "mounting it again",
            "NodeStageVolume",
            "backend unreachable",
        ] {
            assert!(
                failed.message.contains(needed),
                "{mode:?}: {needed:?} missing from: {}",
                failed.message
            );
        }
        assert!(
            listed_line(&w, "dead").contains("\tdefault/s1("),
            "{mode:?}: {}",
            list(&w, false)
        );

        w.driver.clear_calls();
        let b = w
            .attach("s2", "dead", 1, pd)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: the repair failed: {}\n{}", e.message, w.logs()));
        assert_eq!(b.host_path, a.host_path);
        let answered = std::fs::read_to_string(host_path.join("f.txt"));
        assert_eq!(
            answered.as_deref().ok(),
            Some("kept"),
            "{mode:?}: the Attach handed out a dead mount: {answered:?}"
        );
        // The failed repair left the volume unmounted for its holder: mounted again.
        assert_eq!(
            w.driver.mutating_calls(),
            ["NodeStageVolume", "NodePublishVolume"],
            "{mode:?}"
        );
        assert_eq!(listed_condition(&w, "dead")["state"], "normal", "{mode:?}");
        assert!(listed_line(&w, "dead").contains("\tok\t"), "{mode:?}");

        w.detach("s2", "dead", 1, &b.metadata).await.unwrap();
        w.detach("s1", "dead", 0, &a.metadata)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: the last Detach failed: {}", e.message));
        assert!(w.mounts().is_empty(), "{mode:?}: {:?}", w.mounts());
        assert_eq!(w.journal_records(), 0, "{mode:?}");
    }
}

/// The driver's abnormal VolumeCondition (VOLUME_CONDITION) shows in `list` with its
/// message, and in the daemon's log and gauge.
#[tokio::test(flavor = "multi_thread")]
async fn an_abnormal_volume_condition_of_the_driver_is_listed_logged_and_counted() {
    require_root!();
    for mode in MODES {
        let port = common::free_port();
        let mut w = World::start(mode, CAPS, &metrics_config(port)).await;
        let created = w.create("sick").await.unwrap();
        let a = w
            .attach("s1", "sick", 0, &created.private_data)
            .await
            .unwrap();
        assert_eq!(listed_condition(&w, "sick")["state"], "normal", "{mode:?}");
        let handle: serde_json::Value = serde_json::from_str(&created.private_data).unwrap();
        let csi_volume_id = handle["id"].as_str().unwrap();
        w.driver.set_abnormal(csi_volume_id, Some("disk failing"));
        let condition = listed_condition(&w, "sick");
        assert_eq!(
            condition["state"], "driver_abnormal",
            "{mode:?}: {condition}"
        );
        assert_eq!(condition["message"], "disk failing", "{mode:?}");
        assert!(listed_line(&w, "sick").contains("\tabnormal\t"), "{mode:?}");
        if mode == Mode::Rpc {
            restart_and_wait_for_log(&mut w, "volume condition abnormal").await;
            assert!(
                w.logs().contains("disk failing"),
                "the log names the driver's message"
            );
            assert_eq!(condition_gauge(port, "sick").await, "1");
        }
        w.driver.set_abnormal(csi_volume_id, None);
        assert_eq!(listed_condition(&w, "sick")["state"], "normal", "{mode:?}");
        w.detach("s1", "sick", 0, &a.metadata).await.unwrap();
        assert!(w.mounts().is_empty(), "{mode:?}: {:?}", w.mounts());
    }
}
