//! Issue 19, defects 3, 5 and 6, end to end through both transports (the `serve` daemon
//! over its socket, and the forked binary hook) with real bind mounts: a lost journal
//! record does not drop other namespaces' holders, a repaired lost mount does not wedge
//! Detach on a driver that counts publishes, and an Attach whose last journal write fails
//! on a full state dir is rolled back before it answers. Each test failed on the bridge
//! before its fix. Needs root (mounts, a tmpfs); CI runs it as root.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::fake_driver::Caps;
use common::{BRIDGE, MODES, Mode, World};

fn is_mounted(path: &Path) -> bool {
    cube_csi_bridge::mount::MountTable::read(None)
        .unwrap()
        .is_mount_point(path)
}

fn node_dir(w: &World) -> PathBuf {
    w.dir.path().join("state/node")
}

/// Mounts of volumes (the state dir's own tmpfs, if any, is not one).
fn volume_mounts(w: &World) -> Vec<PathBuf> {
    let state = w.dir.path().join("state");
    w.mounts().into_iter().filter(|m| *m != state).collect()
}

/// Nothing left of `volume` on this node: no mount, no staging dir, no record or log.
fn nothing_left(w: &World, volume: &str) -> bool {
    volume_mounts(w).is_empty()
        && !w
            .base_dir
            .join(".staging")
            .join(format!("fake+{volume}"))
            .exists()
        && !node_dir(w).join(format!("{volume}.json")).exists()
        && !node_dir(w).join(format!("{volume}.holders")).exists()
}

/// `cube-csi-bridge list` of this world's node.
fn list(w: &World) -> String {
    let out = std::process::Command::new(BRIDGE)
        .args(["list", "--config"])
        .arg(&w.config_path)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Defect 3: nsA and nsB hold a volume, its record is emptied or truncated (a write torn
/// by a power loss, a damaged disk), and nsA's last Detach must leave nsB's mount. Before,
/// the record was rebuilt with no holders and the log was ignored: nsA's Detach unmounted
/// the volume under nsB. Either namespace may leave first: the one that attached first
/// is only in the log's snapshot.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_record_keeps_the_mount_another_namespace_holds() {
    require_root!();
    for mode in MODES {
        for (damage, leaving, staying) in [
            (&b""[..], "nsA", "nsB"),
            (&b"{\"format\":2,\"volume_id\":\"sha"[..], "nsB", "nsA"),
        ] {
            let w = World::start(mode, Caps::staging(), "").await;
            let created = w.create("shared").await.unwrap();
            let pd = &created.private_data;
            let a = w.attach_as("nsA", "sa", "shared", 0, pd).await.unwrap();
            let b = w.attach_as("nsB", "sb", "shared", 0, pd).await.unwrap();
            std::fs::write(node_dir(&w).join("shared.json"), damage).unwrap();
            let meta = if leaving == "nsA" { &a } else { &b };
            w.detach_as(leaving, "x", "shared", 0, &meta.metadata)
                .await
                .unwrap_or_else(|e| panic!("{mode:?}: {}", e.message));
            assert!(
                is_mounted(Path::new(&a.host_path)),
                "{mode:?}: {leaving}'s last Detach unmounted the volume {staying} holds"
            );
            let stay = if staying == "nsA" { &a } else { &b };
            w.detach_as(staying, "x", "shared", 0, &stay.metadata)
                .await
                .unwrap_or_else(|e| panic!("{mode:?}: {}", e.message));
            assert!(nothing_left(&w, "shared"), "{mode:?}: {:?}", w.mounts());
        }
    }
}

/// Defect 3: when the holder log is lost with the record, nobody can say who holds the
/// volume: nsA's last Detach succeeds but keeps the mount, the bridge logs why, and
/// `list` shows the holders as unknown. The release is an operator's (the planned
/// `holders release` command).
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_record_and_log_leave_the_volume_mounted_and_reported() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let created = w.create("orphan").await.unwrap();
        let pd = &created.private_data;
        let a = w.attach_as("nsA", "sa", "orphan", 0, pd).await.unwrap();
        w.attach_as("nsB", "sb", "orphan", 0, pd).await.unwrap();
        std::fs::write(node_dir(&w).join("orphan.json"), b"").unwrap();
        std::fs::remove_file(node_dir(&w).join("orphan.holders")).unwrap();
        w.detach_as("nsA", "sa", "orphan", 0, &a.metadata)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: {}", e.message));
        assert!(
            is_mounted(Path::new(&a.host_path)),
            "{mode:?}: a volume whose holders are unknown was torn down"
        );
        let logs = w.logs();
        assert!(
            logs.contains("holders unknown") && logs.contains("holders release"),
            "{mode:?}: no warning names the state and the release:\n{logs}"
        );
        let listed = list(&w);
        let line = listed
            .lines()
            .find(|l| l.starts_with("orphan\t"))
            .unwrap_or_else(|| panic!("{mode:?}: {listed}"));
        assert!(line.contains("UNKNOWN"), "{mode:?}: {listed}");
        assert!(line.contains("\tmounted\t"), "{mode:?}: {listed}");
        // Once no namespace uses it any more, the operator releases the unknown holders,
        // and the volume is detached.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_cube-csi-bridge"))
            .args(["holders", "release", "orphan", "--unknown", "--config"])
            .arg(&w.config_path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{mode:?}: {text}");
        assert!(text.contains("released UNKNOWN"), "{mode:?}: {text}");
        assert!(
            !is_mounted(Path::new(&a.host_path)),
            "{mode:?}: released, yet still mounted: {text}"
        );
        assert_eq!(w.journal_records(), 0, "{mode:?}");
    }
}

/// Defect 5: the mount at host_path is lost, the next Attach (ref 1) mounts it again, and
/// the last Detach must then unstage. The driver counts publishes per target, as
/// csi-driver-host-path does; before, the repair published a second time without an
/// unpublish, and every last Detach failed with "NodeUnstageVolume … still published".
#[tokio::test(flavor = "multi_thread")]
async fn a_repaired_lost_mount_does_not_wedge_the_last_detach() {
    require_root!();
    let caps = Caps {
        counts_publishes: true,
        ..Caps::staging()
    };
    for mode in MODES {
        let w = World::start(mode, caps, "").await;
        let created = w.create("lost").await.unwrap();
        let pd = &created.private_data;
        let a = w.attach("s1", "lost", 0, pd).await.unwrap();
        cube_csi_bridge::mount::ops::unmount(Path::new(&a.host_path)).unwrap();
        let b = w.attach("s2", "lost", 1, pd).await.unwrap();
        assert!(
            is_mounted(Path::new(&b.host_path)),
            "{mode:?}: not repaired"
        );
        w.detach("s2", "lost", 1, &b.metadata).await.unwrap();
        // Cube retries a failed Detach: the retry must not meet the same refusal.
        let mut last = w.detach("s1", "lost", 0, &a.metadata).await;
        if last.is_err() {
            last = w.detach("s1", "lost", 0, &a.metadata).await;
        }
        last.unwrap_or_else(|e| panic!("{mode:?}: the last Detach is wedged: {}", e.message));
        assert!(nothing_left(&w, "lost"), "{mode:?}: {:?}", w.mounts());
    }
}

/// Defect 5, the restart path: the daemon's start-up reconciliation repairs the lost mount
/// of a held volume; the last Detach still unstages.
#[tokio::test(flavor = "multi_thread")]
async fn a_mount_repaired_at_start_up_does_not_wedge_the_last_detach() {
    require_root!();
    let caps = Caps {
        counts_publishes: true,
        ..Caps::staging()
    };
    let mut w = World::start(Mode::Rpc, caps, "").await;
    let created = w.create("lost").await.unwrap();
    let a = w
        .attach("s1", "lost", 0, &created.private_data)
        .await
        .unwrap();
    let mut daemon = w.daemon.take().unwrap();
    daemon.kill().await.unwrap();
    daemon.wait().await.unwrap();
    cube_csi_bridge::mount::ops::unmount(Path::new(&a.host_path)).unwrap();
    w.start_daemon().await.unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while !is_mounted(Path::new(&a.host_path)) {
        assert!(Instant::now() < until, "not repaired at start-up");
        // The poll interval while the daemon's reconciliation runs.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut last = w.detach("s1", "lost", 0, &a.metadata).await;
    if last.is_err() {
        last = w.detach("s1", "lost", 0, &a.metadata).await;
    }
    last.unwrap_or_else(|e| panic!("the last Detach is wedged: {}", e.message));
    assert!(nothing_left(&w, "lost"), "{:?}", w.mounts());
}

/// Fills the tmpfs at `dir` but for `free_pages` pages; returns the filler file.
fn fill(dir: &Path, free_pages: u64) -> PathBuf {
    use std::io::Write;
    let filler = dir.join("filler");
    let mut file = std::fs::File::create(&filler).unwrap();
    while file.write_all(&[0u8; 4096]).is_ok() {}
    drop(file);
    let len = std::fs::metadata(&filler).unwrap().len() / 4096 * 4096;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&filler)
        .unwrap();
    file.set_len(len.saturating_sub(free_pages * 4096)).unwrap();
    filler
}

/// Defect 6: with one free page in the state dir, the first Attach's record is written
/// before its CSI calls. Its later saves rewrite that record in place and need no more
/// space, so the Attach succeeds with the holder recorded (before the in-place rewrite,
/// the last save failed with ENOSPC and the Attach was rolled back: the core's test
/// `an_attach_whose_last_save_fails_is_rolled_back_before_it_answers` keeps that path covered);
/// nothing it wrote fails half-way, and no temporary file is left behind.
#[tokio::test(flavor = "multi_thread")]
async fn an_attach_on_a_disk_that_fills_after_its_first_save_succeeds() {
    require_root!();
    for mode in MODES {
        // Started as a binary world so that the daemon (rpc) starts on the tmpfs. The
        // forked workers log outside it: a line an earlier hook's worker writes after the
        // disk is filled would take the one free page the test leaves (by default their
        // log is a file of the state dir).
        let mut w = World::start_with_config(Mode::Binary, Caps::staging(), "", |text| {
            let outside = format!("{}/../worker.log", common::state_dir(&text));
            common::with_worker_log_at(text, &outside)
        })
        .await;
        let state = w.dir.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &state,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            // 0700: a tmpfs root is 1777 by default, which the bridge refuses as a state
            // dir (any user could make files in it).
            Some("size=512k,mode=0700"),
        )
        .unwrap();
        w.mode = mode;
        if mode == Mode::Rpc {
            w.start_daemon().await.unwrap();
        }
        let created = w.create("full").await.unwrap();
        let pd = &created.private_data;
        // The journal directory exists once the node side has opened.
        w.detach("s0", "never", 0, &Default::default())
            .await
            .unwrap();
        // That hook's worker may still be finishing up after its answer: a file it wrote
        // after the disk is filled would take the one free page (a CI run failed so).
        common::wait_until(
            "the earlier hooks' workers to exit",
            Duration::from_secs(10),
            || !common::hook_processes_alive(&w.config_path),
        )
        .await;
        let filler = fill(&state, 1);
        w.driver.clear_calls();
        let attached = w
            .attach("s1", "full", 0, pd)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: a full disk failed the Attach: {}", e.message));
        assert_eq!(
            w.driver.mutating_calls(),
            ["NodeStageVolume", "NodePublishVolume"],
            "{mode:?}"
        );
        assert!(!volume_mounts(&w).is_empty(), "{mode:?}: {:?}", w.mounts());
        let leftovers: Vec<_> = std::fs::read_dir(node_dir(&w))
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{mode:?}: {leftovers:?}");
        let record: serde_json::Value =
            serde_json::from_slice(&std::fs::read(node_dir(&w).join("full.json")).unwrap())
                .unwrap();
        assert!(
            record["holders"].to_string().contains("\"s1\""),
            "{mode:?}: the holder is not in the record: {record}"
        );
        std::fs::remove_file(&filler).unwrap();
        w.detach("s1", "full", 0, &attached.metadata).await.unwrap();
        assert!(nothing_left(&w, "full"), "{mode:?}: {:?}", w.mounts());
        // It attaches and detaches as new.
        let a = w.attach("s1", "full", 0, pd).await.unwrap();
        w.detach("s1", "full", 0, &a.metadata).await.unwrap();
        assert!(nothing_left(&w, "full"), "{mode:?}: {:?}", w.mounts());
        if let Some(mut daemon) = w.daemon.take() {
            daemon.kill().await.unwrap();
            daemon.wait().await.unwrap();
        }
        nix::mount::umount2(&state, nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
}
