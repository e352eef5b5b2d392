//! Cube's real conditions, end to end through both transports (issue 13): holders counted
//! per namespace, Attach cancelled by its caller's deadline or killed with SIGKILL,
//! reconciliation racing live hooks, reboots, lost mounts, corrupt journal records, and
//! Creates abandoned after CreateVolume. Each test failed on the bridge before the fix
//! it names. Needs root (real bind mounts); CI runs it as root.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::callers::{Hook, attach_request};
use common::fake_driver::{Behavior, Caps};
use common::{BRIDGE, MODES, Mode, World};
use cube_csi_bridge::csi::Endpoint;
use cube_csi_bridge::proto::cube::v1 as pb;

/// How long a test waits for a call to reach the fake driver or for the daemon to log
/// something: generous, for a debug build on a loaded machine.
const SIGNAL: Duration = Duration::from_secs(30);

/// Waits until `done` holds, or `limit` passes; returns whether it held.
async fn eventually(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if done() {
            return true;
        }
        // The poll interval (each caller asserts on the result with its own message).
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    done()
}

fn staging_dir(w: &World, volume: &str) -> PathBuf {
    w.base_dir.join(".staging").join(format!("fake+{volume}"))
}

fn is_mounted(path: &Path) -> bool {
    cube_csi_bridge::mount::MountTable::read(None)
        .unwrap()
        .is_mount_point(path)
}

/// Nothing left of `volume` on this node: no mount, no staging, no journal record.
fn nothing_left(w: &World, volume: &str) -> bool {
    w.mounts().is_empty()
        && !staging_dir(w, volume).exists()
        && !w
            .dir
            .path()
            .join(format!("state/node/{volume}.json"))
            .exists()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_reaching_zero_leaves_the_mount_another_namespace_holds() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let created = w.create("shared").await.unwrap();
        let pd = &created.private_data;
        // Cubelet counts holders per (namespace, volume): both first holders send 0.
        let a = w.attach_as("ns1", "s1", "shared", 0, pd).await.unwrap();
        let b = w.attach_as("ns2", "s2", "shared", 0, pd).await.unwrap();
        assert_eq!(a.host_path, b.host_path);
        w.detach_as("ns1", "s1", "shared", 0, &a.metadata)
            .await
            .unwrap();
        assert!(
            is_mounted(Path::new(&b.host_path)),
            "{mode:?}: ns1's last Detach unmounted the volume ns2 still uses"
        );
        // A Detach of a namespace that holds nothing changes nothing either.
        w.detach_as("ns9", "s9", "shared", 0, &a.metadata)
            .await
            .unwrap();
        assert!(is_mounted(Path::new(&b.host_path)), "{mode:?}");
        w.detach_as("ns2", "s2", "shared", 0, &b.metadata)
            .await
            .unwrap();
        assert!(nothing_left(&w, "shared"), "{mode:?}: {:?}", w.mounts());
        w.destroy("shared").await.unwrap();
    }
}

/// An Attach over rpc whose caller gives up after 1 s while NodePublishVolume takes 3 s.
#[tokio::test(flavor = "multi_thread")]
async fn an_rpc_attach_cancelled_by_its_callers_deadline_is_rolled_back() {
    require_root!();
    let w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let created = w.create("cancelled").await.unwrap();
    w.driver.script(
        "NodePublishVolume",
        [Behavior::Delay(Duration::from_secs(3))],
    );
    let channel = cube_csi_bridge::csi::client::channel(&Endpoint::Unix(w.socket()));
    let mut client = pb::volume_plugin_service_client::VolumePluginServiceClient::new(channel);
    let mut request = tonic::Request::new(pb::AttachRequest {
        sandbox_id: "sb".into(),
        namespace: "default".into(),
        volume_id: "cancelled".into(),
        volume_base_dir: w.base_dir.display().to_string(),
        ref_count: 0,
        private_data: created.private_data.clone(),
    });
    request.set_timeout(Duration::from_secs(1));
    let answer = client.attach(request).await;
    assert!(answer.is_err(), "the caller's deadline must cut the call");
    // The driver finishes the publish after the caller left; the bridge undoes it.
    assert!(
        eventually(Duration::from_secs(60), || nothing_left(&w, "cancelled")).await,
        "left behind: mounts {:?}, calls {:?}",
        w.mounts(),
        w.driver.mutating_calls()
    );
    // Cube's next create attaches the volume afresh.
    let again = w
        .attach("sb", "cancelled", 0, &created.private_data)
        .await
        .unwrap();
    w.detach("sb", "cancelled", 0, &again.metadata)
        .await
        .unwrap();
}

/// A forked Attach that Cube SIGKILLs while its NodePublishVolume is in flight.
#[tokio::test(flavor = "multi_thread")]
async fn a_binary_attach_killed_by_cube_is_rolled_back() {
    require_root!();
    let w = World::start(Mode::Binary, Caps::staging(), "").await;
    let created = w.create("killed").await.unwrap();
    // NodePublishVolume stays in flight until released.
    let publish = w.driver.hold("NodePublishVolume");
    let next = w.driver.arrivals("NodePublishVolume") + 1;
    let mut hook = w.binary_caller().spawn(&Hook::Attach(attach_request(
        "default",
        &w.base_dir,
        "sb",
        "killed",
        0,
        &created.private_data,
    )));
    w.driver
        .wait_for_call("NodePublishVolume", next, SIGNAL)
        .await;
    // What Go's exec.CommandContext does at the deadline: SIGKILL the process it started.
    hook.start_kill().unwrap();
    // Cube then waits for the pipes: nothing may hold them for long (the worker is still
    // in NodePublishVolume, held until after this wait, so a worker holding them would be
    // seen however long the bound).
    let waited = tokio::time::timeout(Duration::from_secs(20), hook.wait_with_output()).await;
    assert!(
        waited.is_ok(),
        "a child of the killed hook kept Cube's pipes open"
    );
    // The driver finishes the publish after the caller was killed; the bridge undoes it.
    publish.release();
    assert!(
        eventually(Duration::from_secs(60), || nothing_left(&w, "killed")).await,
        "left behind: mounts {:?}, calls {:?}",
        w.mounts(),
        w.driver.mutating_calls()
    );
    let again = w
        .attach("sb", "killed", 0, &created.private_data)
        .await
        .unwrap();
    w.detach("sb", "killed", 0, &again.metadata).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn start_up_reconciliation_never_acts_on_a_stale_copy() {
    require_root!();
    let mut w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let mut handles = std::collections::HashMap::new();
    for volume in ["a-slow", "b-live"] {
        let created = w.create(volume).await.unwrap();
        w.attach("sb", volume, 0, &created.private_data)
            .await
            .unwrap();
        handles.insert(volume, created.private_data);
    }
    // Two attaches interrupted by a crash in NodePublishVolume: nobody holds them.
    let mut daemon = w.daemon.take().unwrap();
    daemon.kill().await.unwrap();
    for volume in ["a-slow", "b-live"] {
        // The record and holder log as the save before NodePublishVolume left them.
        w.leave_held_by_nobody(volume, |json| json["publish"] = "uncertain".into());
    }
    // Reconciling a-slow stays in NodeUnpublishVolume until released; meanwhile Cube
    // attaches b-live again.
    let unpublish = w.driver.hold("NodeUnpublishVolume");
    let next = w.driver.arrivals("NodeUnpublishVolume") + 1;
    let reconciled = w.daemon_log_lines("node journal reconciled");
    w.start_daemon().await.unwrap();
    w.driver
        .wait_for_call("NodeUnpublishVolume", next, SIGNAL)
        .await;
    let held = w.driver.calls();
    let held = held.iter().rfind(|c| c.method == "NodeUnpublishVolume");
    assert!(
        held.is_some_and(|c| common::is_name_of_a_create(&c.volume_id, "fake-cube-a-slow")),
        "reconciliation began with another volume than a-slow: {held:?}"
    );
    let live = w
        .attach("sb", "b-live", 0, &handles["b-live"])
        .await
        .unwrap();
    // Reconciliation reaches b-live after the Attach: it must see the fresh record.
    unpublish.release();
    w.wait_for_daemon_log("node journal reconciled", reconciled + 1, SIGNAL)
        .await;
    assert!(
        is_mounted(Path::new(&live.host_path)),
        "reconciliation tore down the volume an Attach had just re-established"
    );
    w.detach("sb", "b-live", 0, &live.metadata).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_reboot_attachments_of_the_earlier_boot_are_torn_down() {
    require_root!();
    let mut w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let created = w.create("old").await.unwrap();
    let a = w
        .attach("sb", "old", 0, &created.private_data)
        .await
        .unwrap();
    let mut daemon = w.daemon.take().unwrap();
    daemon.kill().await.unwrap();
    // The reboot: the mount is gone, the journal says it was another boot, and the
    // sandbox that held it died without a Detach.
    cube_csi_bridge::mount::ops::unmount(Path::new(&a.host_path)).unwrap();
    w.edit_node_record("old", |json| json["boot_id"] = "an-earlier-boot".into());
    w.driver.clear_calls();
    w.start_daemon().await.unwrap();
    assert!(
        eventually(Duration::from_secs(60), || nothing_left(&w, "old")).await,
        "left behind: staging {}, calls {:?}",
        staging_dir(&w, "old").exists(),
        w.driver.mutating_calls()
    );
    assert!(
        w.driver.mutating_calls().contains(&"NodeUnstageVolume"),
        "the staged volume was not unstaged: {:?}",
        w.driver.mutating_calls()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_held_volume_whose_mount_was_lost_is_mounted_again_at_start_up() {
    require_root!();
    let mut w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let created = w.create("lost").await.unwrap();
    let a = w
        .attach("sb", "lost", 0, &created.private_data)
        .await
        .unwrap();
    let mut daemon = w.daemon.take().unwrap();
    daemon.kill().await.unwrap();
    cube_csi_bridge::mount::ops::unmount(Path::new(&a.host_path)).unwrap();
    w.start_daemon().await.unwrap();
    assert!(
        eventually(Duration::from_secs(60), || is_mounted(Path::new(
            &a.host_path
        )))
        .await,
        "the lost mount of a held volume was only reported"
    );
    w.detach("sb", "lost", 0, &a.metadata).await.unwrap();
    assert!(nothing_left(&w, "lost"));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_journal_record_does_not_make_a_volume_unattachable() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let created = w.create("torn").await.unwrap();
        let a = w
            .attach("s1", "torn", 0, &created.private_data)
            .await
            .unwrap();
        // A forked Attach's worker may still be at work after its answer.
        common::wait_until(
            "the earlier hooks' workers to exit",
            Duration::from_secs(30),
            || !common::hook_processes_alive(&w.config_path),
        )
        .await;
        // A power loss after a non-durable save: the record is an empty file.
        std::fs::write(w.dir.path().join("state/node/torn.json"), b"").unwrap();
        let b = w
            .attach("s2", "torn", 1, &created.private_data)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: {}", e.message));
        w.detach("s2", "torn", 0, &b.metadata).await.unwrap();
        let _ = a;
        assert!(nothing_left(&w, "torn"), "{mode:?}: {:?}", w.mounts());
    }
}

/// The sweep tests' config: a Create is abandoned after 6 s (twice create_secs, which a
/// loaded machine's Create stays within), and the sweep runs every second.
const SWEEP_EVERY_SECOND: &str = "[controller]\nsweep_interval_secs = 1\nabandoned_create_secs = 6\n\
     [timeouts]\ncreate_secs = 3\ndestroy_secs = 20\nattach_secs = 20\ndetach_secs = 20\nrollback_secs = 10\n";

#[tokio::test(flavor = "multi_thread")]
async fn a_create_killed_after_create_volume_is_reclaimed_by_the_sweep() {
    require_root!();
    let mut w = World::start(Mode::Rpc, Caps::default(), SWEEP_EVERY_SECOND).await;
    // CreateVolume answers after the daemon is gone: the handle is never recorded.
    let create_volume = w.driver.hold("CreateVolume");
    let next = w.driver.arrivals("CreateVolume") + 1;
    let creating = {
        let channel = cube_csi_bridge::csi::client::channel(&Endpoint::Unix(w.socket()));
        let mut client =
            pb::volume_controller_service_client::VolumeControllerServiceClient::new(channel);
        tokio::spawn(async move {
            client
                .create(pb::CreateRequest {
                    volume_id: "leak".into(),
                    name: "leak".into(),
                })
                .await
        })
    };
    w.driver.wait_for_call("CreateVolume", next, SIGNAL).await;
    let mut daemon = w.daemon.take().unwrap();
    daemon.kill().await.unwrap();
    create_volume.release();
    let _ = creating.await;
    w.driver.clear_calls();
    w.start_daemon().await.unwrap();
    // The sweep finds the volume by its name (CreateVolume is idempotent) and deletes it.
    assert!(
        eventually(Duration::from_secs(30), || {
            w.driver.mutating_calls() == ["CreateVolume", "DeleteVolume"]
                && w.driver.csi_volume_of("leak").is_none()
        })
        .await,
        "the abandoned create was not reclaimed: calls {:?}",
        w.driver.mutating_calls()
    );
    // Cube can create the same name again afterwards.
    w.create("leak").await.unwrap();
    w.destroy("leak").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_repair_undoes_only_its_own_publish_not_the_stage_others_rely_on() {
    require_root!();
    let caps = Caps {
        stage: true,
        controller_publish: true,
        ..Default::default()
    };
    for mode in MODES {
        let w = World::start(mode, caps, "").await;
        let created = w.create("own").await.unwrap();
        let a = w
            .attach("s1", "own", 0, &created.private_data)
            .await
            .unwrap();
        // The target mount is lost; the next sandbox's NodePublish fails.
        cube_csi_bridge::mount::ops::unmount(Path::new(&a.host_path)).unwrap();
        w.driver.clear_calls();
        w.driver.script(
            "NodePublishVolume",
            [Behavior::Fail(tonic::Code::Internal, "publish broke")],
        );
        w.attach("s2", "own", 1, &created.private_data)
            .await
            .unwrap_err();
        let calls = w.driver.mutating_calls();
        assert!(
            !calls.contains(&"NodeUnstageVolume") && !calls.contains(&"ControllerUnpublishVolume"),
            "{mode:?}: the failed Attach undid the stage and publish s1 relies on: {calls:?}"
        );
        assert!(staging_dir(&w, "own").exists(), "{mode:?}");
        // The next Attach repairs it, and the last Detach removes everything.
        let b = w
            .attach("s2", "own", 1, &created.private_data)
            .await
            .unwrap();
        assert!(is_mounted(Path::new(&b.host_path)), "{mode:?}");
        w.detach("s2", "own", 0, &b.metadata).await.unwrap();
        assert!(nothing_left(&w, "own"), "{mode:?}: {:?}", w.mounts());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn with_mount_checks_off_the_last_detach_succeeds() {
    require_root!();
    for mode in MODES {
        let w = World::start_with_mount_view(mode, Caps::staging(), "", "none").await;
        let created = w.create("unchecked").await.unwrap();
        let a = w
            .attach("s1", "unchecked", 0, &created.private_data)
            .await
            .unwrap();
        w.detach("s1", "unchecked", 0, &a.metadata)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: {}", e.message));
        assert!(nothing_left(&w, "unchecked"), "{mode:?}: {:?}", w.mounts());
    }
}

/// A binary-only deployment has no daemon to sweep: a forked Create whose worker is killed
/// after CreateVolume is reclaimed by a later forked controller hook.
#[tokio::test(flavor = "multi_thread")]
async fn forked_controller_hooks_sweep_an_abandoned_create() {
    require_root!();
    let w = World::start(Mode::Binary, Caps::default(), SWEEP_EVERY_SECOND).await;
    // CreateVolume stays in flight until both processes are killed.
    let create_volume = w.driver.hold("CreateVolume");
    let next = w.driver.arrivals("CreateVolume") + 1;
    let mut front = tokio::process::Command::new(BRIDGE)
        .args(["--op", "create", "--volume-id", "leak", "--name", "leak"])
        .env("CUBE_CSI_BRIDGE_CONFIG", &w.config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The worker (the front's child) is the one calling CreateVolume.
    w.driver.wait_for_call("CreateVolume", next, SIGNAL).await;
    // Kill the worker itself (the front's child), then the front: nothing undoes it.
    let pid = front.id().unwrap();
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    for child in children.split_whitespace() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.parse().unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    front.start_kill().unwrap();
    let _ = front.wait().await;
    create_volume.release();
    // The record says creating; the driver may or may not have made the volume. A sweep
    // reclaims it only once it is older than abandoned_create_secs (6 s): this sleep is
    // that age, the threshold under test, which no process signals.
    tokio::time::sleep(Duration::from_secs(7)).await;
    w.driver.clear_calls();
    // Any later forked controller hook sweeps (here a Destroy of another volume).
    w.destroy("unrelated").await.unwrap();
    assert!(
        eventually(Duration::from_secs(30), || {
            w.driver.mutating_calls() == ["CreateVolume", "DeleteVolume"]
                && w.driver.csi_volume_of("leak").is_none()
        })
        .await,
        "the abandoned create was not reclaimed: calls {:?}",
        w.driver.mutating_calls()
    );
    // Cube can create the same name again afterwards.
    w.create("leak").await.unwrap();
    w.destroy("leak").await.unwrap();
}
