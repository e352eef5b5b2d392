//! `snapshot create|list|delete`, `restore` and `clone` as an operator runs them, against
//! the project's fake driver (real directories, real mounts) with the embedded store,
//! beside Cube's hooks in both transports: a sandbox gets a copy of another sandbox's
//! workspace through CubeMaster's ordinary Create of the new id, Destroy treats the copy
//! like any volume, a snapshot in use is not deleted, and bad input changes nothing.
//! Needs root (real mounts); CI runs it as root.

mod common;

use std::path::Path;
use std::process::Output;

use common::fake_driver::{Caps, FakeDriver, MUTATING};
use common::{BRIDGE, MODES, Mode, World};

fn run(config: &Path, args: &[&str]) -> Output {
    std::process::Command::new(BRIDGE)
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap()
}

/// Runs a command that must succeed; its stdout as JSON.
fn json(w: &World, args: &[&str]) -> serde_json::Value {
    let out = run(&w.config_path, args);
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// Runs a command that must fail; its stderr.
fn refused(w: &World, args: &[&str]) -> String {
    let out = run(&w.config_path, args);
    assert!(
        !out.status.success(),
        "{args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn snapshots_caps() -> Caps {
    Caps {
        snapshots: true,
        ..Caps::staging()
    }
}

/// What the controller store holds, as the operator sees it.
fn stores(w: &World) -> (serde_json::Value, serde_json::Value) {
    let mut volumes = json(w, &["list", "--controller", "--output", "json"]);
    for v in volumes.as_array_mut().unwrap() {
        v.as_object_mut().unwrap().remove("age_secs");
    }
    // What the driver says now is not the store's (another driver knows none of them).
    let mut snapshots = json(w, &["snapshot", "list", "--output", "json"]);
    for s in snapshots.as_array_mut().unwrap() {
        let s = s.as_object_mut().unwrap();
        for said in ["driver_says", "size_bytes", "ready_to_use"] {
            s.remove(said);
        }
    }
    (volumes, snapshots)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_gets_a_copy_of_another_sandboxs_workspace() {
    require_root!();
    for mode in MODES {
        let w = World::start(mode, snapshots_caps(), "").await;
        let created = w.create("work").await.unwrap();
        let a = w
            .attach("s1", "work", 0, &created.private_data)
            .await
            .unwrap();
        std::fs::write(Path::new(&a.host_path).join("notes.txt"), "v1").unwrap();

        let taken = json(
            &w,
            &[
                "snapshot", "create", "work", "--name", "s1", "--output", "json",
            ],
        );
        assert_eq!(taken["snapshot_id"], "s1", "{mode:?}");
        assert_eq!(taken["source_volume_id"], "work");
        assert_eq!(taken["state"], "created");
        assert_eq!(taken["ready_to_use"], true);
        assert_eq!(taken["csi_snapshot_id"], "snap-cube-snap-s1");
        // The workspace changes after the snapshot; the restore has the old content.
        std::fs::write(Path::new(&a.host_path).join("notes.txt"), "v2").unwrap();

        let restored = json(&w, &["restore", "s1", "--as", "copy", "--output", "json"]);
        assert_eq!(restored["volume_id"], "copy");
        assert_eq!(restored["state"], "created");
        assert_eq!(
            restored["content_source"],
            serde_json::json!({"kind": "snapshot", "snapshot_id": "s1",
                "csi_snapshot_id": "snap-cube-snap-s1"})
        );
        let handle = restored["csi_volume_id"].as_str().unwrap().to_string();
        // CubeMaster's Create of the new id answers with that volume, not an empty one.
        let copy = w.create("copy").await.unwrap();
        let private: serde_json::Value = serde_json::from_str(&copy.private_data).unwrap();
        assert!(copy.private_data.contains(&handle), "{private}");
        let b = w.attach("s2", "copy", 0, &copy.private_data).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(Path::new(&b.host_path).join("notes.txt")).unwrap(),
            "v1"
        );

        let listed = json(&w, &["snapshot", "list", "--output", "json"]);
        assert_eq!(listed[0]["snapshot_id"], "s1");
        assert_eq!(listed[0]["driver_says"], "ready");
        assert_eq!(listed[0]["integrity"], "valid");
        assert_eq!(listed[0]["restored_into"], serde_json::json!(["copy"]));
        let volumes = json(&w, &["list", "--controller", "--output", "json"]);
        let copy_entry = volumes
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["volume_id"] == "copy")
            .unwrap();
        assert_eq!(copy_entry["made_from"], "snapshot:s1");

        // The driver refuses to delete a snapshot a live volume was restored from: the
        // refusal is passed on and the snapshot stays.
        let error = refused(&w, &["snapshot", "delete", "s1"]);
        assert!(
            error.contains("FailedPrecondition")
                && error.contains("in use")
                && error.contains("volumes restored from it: copy")
                && error.contains("kept"),
            "{error}"
        );
        assert_eq!(json(&w, &["snapshot", "list", "--output", "json"]), listed);

        // A clone of the live volume: the workspace as it is now.
        let cloned = json(&w, &["clone", "work", "--as", "twin", "--output", "json"]);
        assert_eq!(cloned["content_source"]["kind"], "volume");
        let twin = w.create("twin").await.unwrap();
        let c = w.attach("s3", "twin", 0, &twin.private_data).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(Path::new(&c.host_path).join("notes.txt")).unwrap(),
            "v2"
        );

        // Destroy treats the copies like any volume; then the snapshot can go.
        for (sandbox, volume, attached) in [("s2", "copy", &b), ("s3", "twin", &c)] {
            w.detach(sandbox, volume, 0, &attached.metadata)
                .await
                .unwrap();
            w.destroy(volume).await.unwrap();
        }
        assert!(!w.driver.volume_dir(&handle).exists());
        let text = run(&w.config_path, &["snapshot", "delete", "s1"]);
        assert!(text.status.success(), "{text:?}");
        assert_eq!(
            json(&w, &["snapshot", "list", "--output", "json"]),
            serde_json::json!([])
        );
        w.detach("s1", "work", 0, &a.metadata).await.unwrap();
        w.destroy("work").await.unwrap();
        assert_eq!(
            json(&w, &["list", "--controller", "--output", "json"]),
            serde_json::json!([])
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_refused_clearly_and_changes_nothing() {
    let mut w = World::start(Mode::Binary, snapshots_caps(), "").await;
    w.create("v1").await.unwrap();
    w.create("v2").await.unwrap();
    json(
        &w,
        &[
            "snapshot", "create", "v1", "--name", "s1", "--output", "json",
        ],
    );
    let before = stores(&w);
    w.driver.clear_calls();
    for (args, expected) in [
        (
            &["snapshot", "create", "nope", "--name", "s2"][..],
            "unknown volume \"nope\"",
        ),
        (
            &["snapshot", "create", "v2", "--name", "s1"],
            "snapshot \"s1\" already exists, of volume \"v1\"",
        ),
        (
            &["snapshot", "create", "v1", "--name", "a.b"],
            "snapshot name \"a.b\"",
        ),
        (&["snapshot", "delete", "nope"], "unknown snapshot \"nope\""),
        (
            &["restore", "nope", "--as", "r"],
            "unknown snapshot \"nope\"",
        ),
        (
            &["restore", "s1", "--as", "v2"],
            "volume \"v2\" already exists",
        ),
        (&["restore", "s1", "--as", "bad/id"], "only [A-Za-z0-9_-]"),
        (&["clone", "nope", "--as", "c"], "unknown volume \"nope\""),
        (
            &["clone", "v1", "--as", "v2"],
            "volume \"v2\" already exists",
        ),
    ] {
        let error = refused(&w, args);
        assert!(error.contains(expected), "{args:?}: {error}");
        assert_eq!(stores(&w), before, "{args:?} changed the store");
        let mutating: Vec<_> = w
            .driver
            .calls()
            .into_iter()
            .filter(|c| MUTATING.contains(&c.method))
            .map(|c| c.method)
            .collect();
        assert!(mutating.is_empty(), "{args:?}: {mutating:?}");
    }

    // The CSI driver behind the endpoint is now another one: the snapshot (and the
    // volumes) it recorded are not handed to it.
    w.driver_server.take().unwrap().stop().await;
    let other = FakeDriver::named(
        snapshots_caps(),
        &w.dir.path().join("other-data"),
        "other.csi.test",
        "node-2",
    );
    w.driver_server = Some(other.serve(&w.dir.path().join("csi.sock")));
    for args in [
        &["restore", "s1", "--as", "r"][..],
        &["snapshot", "delete", "s1"],
        &["snapshot", "create", "v1", "--name", "s3"],
        &["clone", "v1", "--as", "c"],
    ] {
        let error = refused(&w, args);
        assert!(
            error.contains("fake.csi.test") && error.contains("other.csi.test"),
            "{args:?}: {error}"
        );
        assert_eq!(stores(&w), before, "{args:?} changed the store");
    }
    let mutating: Vec<_> = other
        .calls()
        .into_iter()
        .filter(|c| MUTATING.contains(&c.method))
        .collect();
    assert!(mutating.is_empty(), "{mutating:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_driver_without_snapshots_is_named_in_the_refusal() {
    let w = World::start(Mode::Binary, Caps::staging(), "").await;
    w.create("v1").await.unwrap();
    let error = refused(&w, &["snapshot", "create", "v1", "--name", "s1"]);
    assert!(error.contains("CREATE_DELETE_SNAPSHOT"), "{error}");
    let error = refused(&w, &["clone", "v1", "--as", "c"]);
    assert!(error.contains("CLONE_VOLUME"), "{error}");
    assert_eq!(
        json(&w, &["snapshot", "list", "--output", "json"]),
        serde_json::json!([])
    );
}
