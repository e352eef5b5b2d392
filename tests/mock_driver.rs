//! The bridge in front of a CSI implementation someone else wrote: csi-test's mock driver
//! (tests/common/csi_mock.rs), through both transports. Its log shows every request it
//! got, so the tests check the CSI side call by call: the whole life cycle with and
//! without ControllerPublish, the configured secrets reaching each call, and a failure
//! injected on each step (its `-hooks-file`) giving Cube a clear error and leaving
//! nothing behind. The mock mounts nothing, so the bridge runs with `mount_view = "none"`
//! (the driver's answers are trusted); real mounts are tests/real_mounts.rs.
//!
//! Needs `CUBE_CSI_BRIDGE_PEERS_BIN` (scripts/test.sh sets it); skips without it, except in
//! CI. No root needed: nothing is mounted.

mod common;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::csi_mock::{MOCK_NAME, MockDriver, MockOptions};
use common::fake_driver::Caps;
use common::{BRIDGE, MODES, Mode, World};

/// The Cube driver name of these bridges (the host_path prefix).
const DRIVER: &str = "mock";

/// A bridge (in `mode`) in front of a csi-mock started with `options`, with `extra` config.
async fn mock_world(
    bin: &Path,
    mode: Mode,
    options: &MockOptions,
    extra: &str,
) -> (World, MockDriver) {
    let mut w = World::start_with_config(Mode::Binary, Caps::default(), extra, |text| {
        text.replacen("driver = \"fake\"", &format!("driver = \"{DRIVER}\""), 1)
            .replacen("\nmount_view = \"self\"\n", "\nmount_view = \"none\"\n", 1)
    })
    .await;
    // The fake World starts with is not used; the mock takes its socket path.
    if let Some(fake) = w.driver_server.take() {
        fake.stop().await;
    }
    let mock_dir = w.dir.path().join("mock");
    std::fs::create_dir_all(&mock_dir).unwrap();
    let mock = MockDriver::start(bin, &mock_dir, options);
    let text = std::fs::read_to_string(&w.config_path).unwrap();
    let text = text.replacen(
        &format!("endpoint = \"unix://{}/csi.sock\"", w.dir.path().display()),
        &format!("endpoint = \"unix://{}\"", mock.socket.display()),
        1,
    );
    assert!(text.contains("mock.sock"), "{text}");
    std::fs::write(&w.config_path, text).unwrap();
    // A config with [secrets] must be private, or the bridge refuses it.
    std::fs::set_permissions(&w.config_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    if mode == Mode::Rpc {
        w.mode = Mode::Rpc;
        w.start_daemon().await.expect("daemon starts");
    }
    (w, mock)
}

/// The controller store's records, as `list --controller --output json` prints them.
fn controller_records(w: &World) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(BRIDGE)
        .args(["list", "--controller", "--output", "json", "--config"])
        .arg(&w.config_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "list: {out:?}");
    serde_json::from_slice::<Vec<serde_json::Value>>(&out.stdout).unwrap()
}

/// Asserts nothing is left: no node journal record, no controller record, and every
/// node step the mock did has been undone (stage/unstage, publish/unpublish and
/// ControllerPublish/Unpublish balanced).
fn assert_nothing_left(w: &World, mock: &MockDriver, what: &str) {
    assert_eq!(
        w.journal_records(),
        0,
        "{what}: a node journal record is left"
    );
    assert_eq!(
        controller_records(w),
        Vec::<serde_json::Value>::new(),
        "{what}: a controller record is left"
    );
    let calls = mock.mutating();
    let count = |m: &str| calls.iter().filter(|c| *c == m).count();
    for (done, undone) in [
        ("NodeStageVolume", "NodeUnstageVolume"),
        ("NodePublishVolume", "NodeUnpublishVolume"),
        ("ControllerPublishVolume", "ControllerUnpublishVolume"),
        ("CreateVolume", "DeleteVolume"),
    ] {
        assert!(
            count(undone) >= count(done),
            "{what}: {done} ×{} but {undone} ×{}: {calls:?}",
            count(done),
            count(undone)
        );
    }
}

/// Create → Attach (ns-a, ref 0) → Attach (ns-b, ref 0) → Detach (ns-b) → Detach (ns-a)
/// → Destroy, with and without ControllerPublish, checked against the mock's log.
#[tokio::test(flavor = "multi_thread")]
async fn csi_mock_whole_lifecycle_through_both_transports() {
    let bin = require_csi_mock!();
    for mode in MODES {
        for disable_attach in [true, false] {
            let label = format!("{mode:?}, disable_attach {disable_attach}");
            let options = MockOptions {
                disable_attach,
                ..MockOptions::default()
            };
            let (w, mock) = mock_world(&bin, mode, &options, "").await;
            let created = w
                .create("vol-1")
                .await
                .unwrap_or_else(|e| panic!("{label}: create: {e:?}\n{}", w.logs()));
            let handle: serde_json::Value = serde_json::from_str(&created.private_data).unwrap();
            let csi_id = handle["id"].as_str().unwrap().to_string();
            // The mock numbers its volumes; 1 to 3 exist from the start.
            assert_eq!(csi_id, "4", "{label}");
            let creates = mock.requests("CreateVolume");
            assert_eq!(creates.len(), 1, "{label}: {creates:?}");
            assert_fresh_name(&creates[0]["name"], "vol-1");

            let a = w
                .attach_as("ns-a", "sb-a", "vol-1", 0, &created.private_data)
                .await
                .unwrap_or_else(|e| panic!("{label}: attach A: {e:?}\n{}", w.logs()));
            let host_path = w.base_dir.join(format!("{DRIVER}+vol-1"));
            assert_eq!(Path::new(&a.host_path), host_path, "{label}");
            assert!(host_path.is_dir(), "{label}: the mock made the target");
            let b = w
                .attach_as("ns-b", "sb-b", "vol-1", 0, &created.private_data)
                .await
                .unwrap_or_else(|e| panic!("{label}: attach B: {e:?}\n{}", w.logs()));
            assert_eq!(a.host_path, b.host_path, "{label}");

            let expected_attach: &[&str] = if disable_attach {
                &["CreateVolume", "NodeStageVolume", "NodePublishVolume"]
            } else {
                &[
                    "CreateVolume",
                    "ControllerPublishVolume",
                    "NodeStageVolume",
                    "NodePublishVolume",
                ]
            };
            assert_eq!(mock.mutating(), expected_attach, "{label}: one attachment");
            let stage = &mock.requests("NodeStageVolume")[0];
            let publish = &mock.requests("NodePublishVolume")[0];
            assert_eq!(stage["volume_id"], csi_id.as_str(), "{label}");
            assert_eq!(publish["target_path"], host_path.to_str().unwrap());
            assert_eq!(publish["staging_target_path"], stage["staging_target_path"]);
            if !disable_attach {
                let cp = &mock.requests("ControllerPublishVolume")[0];
                assert_eq!(cp["node_id"], MOCK_NAME, "{label}: NodeGetInfo's id");
                // The mock's publish_context reaches both node steps.
                let device = serde_json::json!({"device": "/dev/mock", "readonly": "false"});
                assert_eq!(stage["publish_context"], device, "{label}");
                assert_eq!(publish["publish_context"], device, "{label}");
            }

            w.detach_as("ns-b", "sb-b", "vol-1", 0, &b.metadata)
                .await
                .unwrap_or_else(|e| panic!("{label}: detach B: {e:?}\n{}", w.logs()));
            assert_eq!(
                mock.mutating().len(),
                expected_attach.len(),
                "{label}: held"
            );
            assert_eq!(w.journal_records(), 1, "{label}: ns-a still holds it");
            w.detach_as("ns-a", "sb-a", "vol-1", 0, &a.metadata)
                .await
                .unwrap_or_else(|e| panic!("{label}: detach A: {e:?}\n{}", w.logs()));
            assert!(!host_path.exists(), "{label}: NodeUnpublish removed it");
            w.destroy("vol-1")
                .await
                .unwrap_or_else(|e| panic!("{label}: destroy: {e:?}\n{}", w.logs()));
            let deletes = mock.requests("DeleteVolume");
            assert_eq!(deletes.len(), 1, "{label}");
            assert_eq!(deletes[0]["volume_id"], csi_id.as_str(), "{label}");
            assert_nothing_left(&w, &mock, &label);
        }
    }
}

/// With `CSI_ENABLE_CREDS` the mock expects a `secretKey` secret on each call that carries
/// secrets (csi-test's driver package; v4.2.0 sets the expected values on a copy, so it
/// does not refuse a call without them: the log is what shows they arrived). The bridge's
/// `[secrets]` reach exactly the calls of their family, and never its own logs.
#[tokio::test(flavor = "multi_thread")]
async fn csi_mock_receives_the_configured_secrets_on_every_call() {
    let bin = require_csi_mock!();
    let families = [
        ("provisioner", "secretval1-prov"),
        ("controller_publish", "secretval3-cp"),
        ("node_stage", "secretval5-stage"),
        ("node_publish", "secretval6-publish"),
    ];
    let extra: String = std::iter::once("[secrets]".to_string())
        .chain(
            families
                .iter()
                .map(|(family, value)| format!("{family} = {{ secretKey = \"{value}\" }}")),
        )
        .collect::<Vec<_>>()
        .join("\n");
    for mode in MODES {
        let options = MockOptions {
            enable_creds: true,
            ..MockOptions::default()
        };
        let (w, mock) = mock_world(&bin, mode, &options, &extra).await;
        let created = w.create("vol-s").await.expect("create");
        let a = w
            .attach("sb", "vol-s", 0, &created.private_data)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: attach: {e:?}\n{}", w.logs()));
        w.detach("sb", "vol-s", 0, &a.metadata)
            .await
            .expect("detach");
        w.destroy("vol-s").await.expect("destroy");

        let secret = |value: &str| serde_json::json!({"secretKey": value});
        for (method, value) in [
            ("CreateVolume", families[0].1),
            ("DeleteVolume", families[0].1),
            ("ControllerPublishVolume", families[1].1),
            ("ControllerUnpublishVolume", families[1].1),
            ("NodeStageVolume", families[2].1),
            ("NodePublishVolume", families[3].1),
        ] {
            let requests = mock.requests(method);
            assert_eq!(requests.len(), 1, "{mode:?}: one {method}");
            assert_eq!(
                requests[0]["secrets"],
                secret(value),
                "{mode:?}: {method} got its family's secret"
            );
        }
        let logs = w.logs();
        for (_, value) in families {
            assert!(!logs.contains(value), "{mode:?}: the bridge logged {value}");
        }
        assert_nothing_left(&w, &mock, &format!("{mode:?}"));
    }
}

/// A hooks file that fails the first call reaching `hook` with `code`, then lets every
/// later call through.
fn fail_once(hook: &str, code: &str) -> String {
    format!(
        "globals: |\n  var failed = false;\n{hook}: |\n  var answer = failed ? OK : {code};\n  failed = true;\n  answer\n"
    )
}

/// A failure injected on each step (csi-mock's `-hooks-file`, a final INTERNAL error
/// before the mock acts): Cube gets an error naming the CSI call and the volume; an Attach
/// or a Create leaves nothing behind, a Detach or Destroy keeps what Cube still holds;
/// Cube's retry then completes and nothing is left.
#[tokio::test(flavor = "multi_thread")]
async fn csi_mock_injected_errors_on_each_step_leave_nothing_behind() {
    let bin = require_csi_mock!();
    let steps = [
        ("createVolumeStart", "CreateVolume", "create"),
        (
            "controllerPublishVolumeStart",
            "ControllerPublishVolume",
            "attach",
        ),
        ("nodeStageVolumeStart", "NodeStageVolume", "attach"),
        ("nodePublishVolumeStart", "NodePublishVolume", "attach"),
        ("nodeUnpublishVolumeStart", "NodeUnpublishVolume", "detach"),
        ("nodeUnstageVolumeStart", "NodeUnstageVolume", "detach"),
        (
            "controllerUnpublishVolumeStart",
            "ControllerUnpublishVolume",
            "detach",
        ),
        ("deleteVolumeStart", "DeleteVolume", "destroy"),
    ];
    for mode in MODES {
        for (hook, call, hook_of_cube) in steps {
            let label = format!("{mode:?}, {call} fails");
            let options = MockOptions {
                hooks: Some(fail_once(hook, "INTERNAL")),
                ..MockOptions::default()
            };
            let (w, mock) = mock_world(&bin, mode, &options, "").await;
            let assert_clear = |error: &common::CubeError, what: &str| {
                let text = format!("{error:?}");
                assert!(text.contains(call), "{label}: {what} names {call}: {text}");
                assert!(
                    text.contains("vol-e") || text.contains("\"4\""),
                    "{label}: {what} names the volume: {text}"
                );
            };

            let created = match w.create("vol-e").await {
                Ok(created) => created,
                Err(error) => {
                    assert_eq!(hook_of_cube, "create", "{label}: {error:?}");
                    assert_clear(&error, "create");
                    assert_nothing_left(&w, &mock, &label);
                    w.create("vol-e").await.expect("retried create")
                }
            };
            let attached = match w.attach("sb", "vol-e", 0, &created.private_data).await {
                Ok(attached) => attached,
                Err(error) => {
                    assert_eq!(hook_of_cube, "attach", "{label}: {error:?}");
                    assert_clear(&error, "attach");
                    assert_eq!(w.journal_records(), 0, "{label}: no journal record");
                    let calls = mock.mutating();
                    let count = |m: &str| calls.iter().filter(|c| *c == m).count();
                    // Every step it did is undone (an undo of a step it never reached
                    // is allowed: CSI's undo calls are idempotent).
                    for (done, undone) in [
                        ("NodeStageVolume", "NodeUnstageVolume"),
                        ("NodePublishVolume", "NodeUnpublishVolume"),
                        ("ControllerPublishVolume", "ControllerUnpublishVolume"),
                    ] {
                        assert!(
                            count(undone) >= count(done),
                            "{label}: the failed Attach undid {done}: {calls:?}"
                        );
                    }
                    assert!(
                        !w.base_dir.join(format!("{DRIVER}+vol-e")).exists(),
                        "{label}: no host_path left"
                    );
                    w.attach("sb", "vol-e", 0, &created.private_data)
                        .await
                        .unwrap_or_else(|e| panic!("{label}: retried attach: {e:?}\n{}", w.logs()))
                }
            };
            let metadata: HashMap<String, String> = attached.metadata.clone();
            if let Err(error) = w.detach("sb", "vol-e", 0, &metadata).await {
                assert_eq!(hook_of_cube, "detach", "{label}: {error:?}");
                assert_clear(&error, "detach");
                // Still attached as far as the bridge knows: Cube retries the Detach.
                assert_eq!(w.journal_records(), 1, "{label}: the record is kept");
                w.detach("sb", "vol-e", 0, &metadata)
                    .await
                    .unwrap_or_else(|e| panic!("{label}: retried detach: {e:?}\n{}", w.logs()));
            }
            assert_eq!(w.journal_records(), 0, "{label}: detached");
            if let Err(error) = w.destroy("vol-e").await {
                assert_eq!(hook_of_cube, "destroy", "{label}: {error:?}");
                assert_clear(&error, "destroy");
                assert_eq!(controller_records(&w).len(), 1, "{label}: record kept");
                w.destroy("vol-e").await.expect("retried destroy");
            }
            assert_nothing_left(&w, &mock, &label);
            let failed: Vec<_> = mock
                .calls()
                .into_iter()
                .filter(|c| !c.error.is_empty())
                .map(|c| c.method)
                .collect();
            assert_eq!(failed, [call], "{label}: the one injected failure");
        }
    }
}

/// Runs an operator command against `w`'s config: (success, stdout, stderr).
fn command(w: &World, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(BRIDGE)
        .args(args)
        .arg("--config")
        .arg(&w.config_path)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Snapshots, restores and clones through csi-mock (which has CREATE_DELETE_SNAPSHOT,
/// LIST_SNAPSHOTS and CLONE_VOLUME), in both transports: each CSI request carries what
/// the records say (the source handle, the snapshot handle as VolumeContentSource), Cube's
/// Create of a restored id repeats that content source and answers with the same volume,
/// and a DeleteSnapshot the driver refuses (FAILED_PRECONDITION, from its hooks file)
/// keeps the snapshot and says so.
#[tokio::test(flavor = "multi_thread")]
async fn csi_mock_snapshots_restores_and_clones() {
    let bin = require_csi_mock!();
    for mode in MODES {
        let options = MockOptions {
            hooks: Some(fail_once("deleteSnapshotStart", "FAILEDPRECONDITION")),
            ..MockOptions::default()
        };
        let (w, mock) = mock_world(&bin, mode, &options, "").await;
        let created = w.create("vol-1").await.unwrap();
        assert_fresh_name(&mock.requests("CreateVolume")[0]["name"], "vol-1");
        let (ok, out, err) = command(
            &w,
            &[
                "snapshot", "create", "vol-1", "--name", "snap-1", "--output", "json",
            ],
        );
        assert!(ok, "{mode:?}: {err}");
        let taken: serde_json::Value = serde_json::from_str(&out).unwrap();
        let snapshot_id = taken["csi_snapshot_id"].as_str().unwrap().to_string();
        let request = &mock.requests("CreateSnapshot")[0];
        assert_eq!(request["name"], "cube-snap-snap-1");
        let source = request["source_volume_id"].as_str().unwrap().to_string();
        assert!(
            created.private_data.contains(&source),
            "{}",
            created.private_data
        );
        // A repeated command adopts it: csi-mock sees no second CreateSnapshot.
        let (ok, _, err) = command(&w, &["snapshot", "create", "vol-1", "--name", "snap-1"]);
        assert!(ok, "{err}");
        assert_eq!(mock.requests("CreateSnapshot").len(), 1);

        let (ok, out, err) = command(
            &w,
            &["restore", "snap-1", "--as", "vol-2", "--output", "json"],
        );
        assert!(ok, "{mode:?}: {err}");
        let restored: serde_json::Value = serde_json::from_str(&out).unwrap();
        let creates = mock.requests("CreateVolume");
        assert_fresh_name(&creates[1]["name"], "vol-2");
        assert_eq!(
            creates[1]["volume_content_source"]["Type"]["Snapshot"]["snapshot_id"],
            snapshot_id.as_str(),
            "{}",
            creates[1]
        );
        // CubeMaster's Create of the new id: the same request, the same volume.
        let copy = w.create("vol-2").await.unwrap();
        assert!(
            copy.private_data
                .contains(restored["csi_volume_id"].as_str().unwrap()),
            "{}",
            copy.private_data
        );
        let creates = mock.requests("CreateVolume");
        assert_eq!(creates.len(), 3);
        assert_eq!(
            creates[2]["volume_content_source"],
            creates[1]["volume_content_source"]
        );

        let (ok, out, err) = command(&w, &["snapshot", "list", "--output", "json"]);
        assert!(ok, "{err}");
        let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(listed[0]["driver_says"], "ready");
        assert_eq!(listed[0]["restored_into"], serde_json::json!(["vol-2"]));
        assert_eq!(
            mock.requests("ListSnapshots")[0]["snapshot_id"],
            snapshot_id
        );

        // The driver refuses once: its code is passed on, and the snapshot stays.
        let (ok, _, err) = command(&w, &["snapshot", "delete", "snap-1"]);
        assert!(
            !ok && err.contains("FailedPrecondition") && err.contains("kept"),
            "{err}"
        );
        let (_, after, _) = command(&w, &["snapshot", "list", "--output", "json"]);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&after).unwrap(),
            listed
        );

        let (ok, out, err) = command(&w, &["clone", "vol-1", "--as", "vol-3", "--output", "json"]);
        assert!(ok, "{err}");
        let cloned: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(cloned["content_source"]["kind"], "volume");
        let creates = mock.requests("CreateVolume");
        assert_eq!(
            creates[3]["volume_content_source"]["Type"]["Volume"]["volume_id"],
            source.as_str(),
            "{}",
            creates[3]
        );

        for volume in ["vol-3", "vol-2"] {
            w.destroy(volume).await.unwrap();
        }
        let (ok, _, err) = command(&w, &["snapshot", "delete", "snap-1"]);
        assert!(ok, "{err}");
        let deletes: Vec<_> = mock
            .calls()
            .into_iter()
            .filter(|c| c.method == "DeleteSnapshot")
            .collect();
        assert_eq!(deletes.len(), 2, "{deletes:?}");
        assert!(!deletes[0].error.is_empty() && deletes[1].error.is_empty());
        assert_eq!(deletes[1].request["snapshot_id"], snapshot_id.as_str());
        w.destroy("vol-1").await.unwrap();
        // Every volume the mock made (three, one asked for twice) was deleted.
        let deleted: Vec<_> = mock
            .requests("DeleteVolume")
            .into_iter()
            .map(|r| r["volume_id"].clone())
            .collect();
        assert_eq!(deleted.len(), 3, "{deleted:?}");
        assert_eq!(controller_records(&w), Vec::<serde_json::Value>::new());
        let (_, listed, _) = command(&w, &["snapshot", "list", "--output", "json"]);
        assert_eq!(listed.trim(), "[]");
    }
}
/// csi-mock with `-enable-topology` gets the configured accessibility requirements, its
/// answer is recorded and listed, and its node (which reports the same topology) attaches
/// the volume; without topology, or for a mount group or a single-node writer mode it
/// does not advertise, the bridge refuses to start and its hooks change nothing.
#[tokio::test(flavor = "multi_thread")]
async fn csi_mock_topology_mount_group_and_access_modes() {
    use common::csi_mock::{MOCK_TOPOLOGY_KEY, MOCK_TOPOLOGY_NODE};
    let bin = require_csi_mock!();
    let requirements = format!(
        "[volume.accessibility_requirements]\nrequisite = [{{ \"{MOCK_TOPOLOGY_KEY}\" = \
         \"{MOCK_TOPOLOGY_NODE}\" }}]\n"
    );
    let topology = serde_json::json!([{ MOCK_TOPOLOGY_KEY: MOCK_TOPOLOGY_NODE }]);
    for mode in MODES {
        let options = MockOptions {
            enable_topology: true,
            ..MockOptions::default()
        };
        let (w, mock) = mock_world(&bin, mode, &options, &requirements).await;
        let created = w
            .create("vol-t")
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: create: {e:?}\n{}", w.logs()));
        let asked = &mock.requests("CreateVolume")[0]["accessibility_requirements"];
        assert_eq!(
            asked["requisite"][0]["segments"][MOCK_TOPOLOGY_KEY], MOCK_TOPOLOGY_NODE,
            "{mode:?}: {asked}"
        );
        let handle: serde_json::Value = serde_json::from_str(&created.private_data).unwrap();
        assert_eq!(handle["t"], topology, "{mode:?}: handed to the node");
        assert_eq!(
            controller_records(&w)[0]["accessible_topology"],
            topology,
            "{mode:?}"
        );
        let a = w
            .attach("sb", "vol-t", 0, &created.private_data)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: attach: {e:?}\n{}", w.logs()));
        w.detach("sb", "vol-t", 0, &a.metadata).await.unwrap();
        w.destroy("vol-t").await.unwrap();
        assert_nothing_left(&w, &mock, &format!("{mode:?} topology"));
    }

    for (options, extra, needle) in [
        (
            MockOptions::default(),
            requirements.as_str(),
            "VOLUME_ACCESSIBILITY_CONSTRAINTS",
        ),
        (
            MockOptions::default(),
            "[volume]\nmount_group = 1000\n",
            "VOLUME_MOUNT_GROUP",
        ),
        (
            MockOptions::default(),
            "[volume]\naccess_mode = \"single_node_multi_writer\"\n",
            "SINGLE_NODE_MULTI_WRITER controller capability",
        ),
    ] {
        let (mut w, mock) = mock_world(&bin, Mode::Binary, &options, extra).await;
        let out = std::process::Command::new(BRIDGE)
            .args(["check", "--config"])
            .arg(&w.config_path)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success() && said.contains(needle),
            "{needle}: {said}"
        );
        let refused = w.start_daemon().await.expect_err("serve refuses");
        assert!(
            refused.contains(needle) && refused.contains(MOCK_NAME),
            "{refused}"
        );
        // The forked hooks refuse too, before any call that changes anything.
        let created = w.create("vol-r").await;
        if let Ok(created) = created {
            let err = w
                .attach("sb", "vol-r", 0, &created.private_data)
                .await
                .expect_err("attach refused");
            assert!(err.message.contains(needle), "{needle}: {}", err.message);
            assert_eq!(mock.mutating(), ["CreateVolume"], "{needle}");
            w.destroy("vol-r").await.unwrap();
        } else {
            assert!(created.unwrap_err().message.contains(needle), "{needle}");
            assert!(mock.mutating().is_empty(), "{needle}");
        }
        assert_nothing_left(&w, &mock, needle);
    }
}

/// `expand` against csi-mock, which grows volumes online and, with
/// `-node-expand-required`, asks for NodeExpandVolume: its log shows both calls with the
/// right handle, size, path and secrets; the record follows; a smaller size and an
/// unknown volume change nothing; with `-disable-controller-expansion` and no node
/// expansion the driver is refused by name.
#[tokio::test(flavor = "multi_thread")]
async fn csi_mock_expands_a_volume_on_the_controller_and_the_node() {
    let bin = require_csi_mock!();
    const GI: i64 = 1 << 30;
    let extra = format!(
        "[volume]\ncapacity_bytes = {GI}\n[secrets]\ncontroller_expand = {{ secretKey = \"secretval-ce\" }}\nnode_expand = {{ secretKey = \"secretval-ne\" }}\n"
    );
    let expand = |w: &World, args: &[&str]| {
        let out = std::process::Command::new(BRIDGE)
            .arg("expand")
            .args(args)
            .arg("--config")
            .arg(&w.config_path)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for mode in MODES {
        let options = MockOptions {
            flags: vec!["-node-expand-required"],
            ..MockOptions::default()
        };
        let (w, mock) = mock_world(&bin, mode, &options, &extra).await;
        let created = w.create("vol-x").await.expect("create");
        let a = w
            .attach("sb", "vol-x", 0, &created.private_data)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: attach: {e:?}\n{}", w.logs()));
        let handle = mock.requests("CreateVolume").len();
        assert_eq!(handle, 1);

        let (code, out, err) = expand(&w, &["vol-x", "--size", "3Gi", "--output", "json"]);
        assert_eq!(code, Some(0), "{mode:?}: {err}\n{}", mock.log_text());
        let report: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["controller"]["capacity_bytes"], 3 * GI, "{out}");
        assert_eq!(
            report["controller"]["node_expansion_required"], true,
            "{out}"
        );
        assert_eq!(report["node"]["outcome"], "expanded", "{out}");
        let csi_volume_id = report["controller"]["csi_volume_id"].clone();

        let controller = mock.requests("ControllerExpandVolume");
        assert_eq!(controller.len(), 1, "{mode:?}");
        assert_eq!(controller[0]["volume_id"], csi_volume_id);
        assert_eq!(controller[0]["capacity_range"]["required_bytes"], 3 * GI);
        assert_eq!(
            controller[0]["secrets"],
            serde_json::json!({"secretKey": "secretval-ce"})
        );
        let node = mock.requests("NodeExpandVolume");
        assert_eq!(node.len(), 1, "{mode:?}");
        assert_eq!(node[0]["volume_id"], csi_volume_id);
        assert_eq!(node[0]["volume_path"], a.host_path.as_str());
        assert_eq!(node[0]["capacity_range"]["required_bytes"], 3 * GI);
        let records = controller_records(&w);
        assert_eq!(records[0]["capacity_bytes"], 3 * GI, "{records:?}");

        // Smaller than now, and an unknown volume: refused, nothing sent.
        let (code, _, err) = expand(&w, &["vol-x", "--size", "2Gi"]);
        assert_eq!(code, Some(1));
        assert!(err.contains("smaller"), "{err}");
        let (code, _, err) = expand(&w, &["vol-none", "--size", "4Gi"]);
        assert_eq!(code, Some(1));
        assert!(err.contains("unknown"), "{err}");
        assert_eq!(mock.requests("ControllerExpandVolume").len(), 1);
        assert_eq!(controller_records(&w)[0]["capacity_bytes"], 3 * GI);

        // A later Create answers with the same handle and keeps the grown size (the
        // mock's volume_context has since gained its node state, so only the id is
        // compared).
        let again = w.create("vol-x").await.expect("create again");
        let id =
            |data: &str| serde_json::from_str::<serde_json::Value>(data).unwrap()["id"].clone();
        assert_eq!(id(&again.private_data), id(&created.private_data));
        assert_eq!(id(&created.private_data), csi_volume_id);
        assert_eq!(controller_records(&w)[0]["capacity_bytes"], 3 * GI);

        w.detach("sb", "vol-x", 0, &a.metadata)
            .await
            .expect("detach");
        w.destroy("vol-x").await.expect("destroy");
        assert!(!w.logs().contains("secretval-ce") && !w.logs().contains("secretval-ne"));
        // (assert_nothing_left would count the repeated Create as a second volume.)
        assert_eq!(w.journal_records(), 0, "{mode:?}");
        assert!(controller_records(&w).is_empty(), "{mode:?}");
        assert_eq!(mock.requests("DeleteVolume").len(), 1, "{mode:?}");
    }

    // A mock that cannot expand at all.
    let options = MockOptions {
        flags: vec!["-disable-controller-expansion"],
        ..MockOptions::default()
    };
    let (w, mock) = mock_world(&bin, Mode::Binary, &options, &extra).await;
    w.create("vol-y").await.expect("create");
    let (code, _, err) = expand(&w, &["vol-y", "--size", "3Gi"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("EXPAND_VOLUME") && err.contains(MOCK_NAME),
        "{err}"
    );
    assert!(mock.requests("ControllerExpandVolume").is_empty());
    assert_eq!(controller_records(&w)[0]["capacity_bytes"], GI);
}

/// A CreateVolume name of one Create of `volume_id`.
fn assert_fresh_name(name: &serde_json::Value, volume_id: &str) {
    assert!(
        name.as_str()
            .is_some_and(|n| common::is_name_of_a_create(n, &format!("cube-{volume_id}"))),
        "{name}"
    );
}
