//! Where and how a volume is mounted, against the fake CSI driver through both
//! transports: the accessibility requirements CreateVolume gets, the accessible topology
//! it answers (recorded, listed, handed to the node, enforced at Attach before any node
//! call), `volume.mount_group` reaching NodeStage and NodePublish, and the single-node
//! writer access modes; each refused at start (`check`, `serve`) and at the hook when the
//! driver lacks the capability it needs, changing nothing. Needs root (real mounts).

mod common;

use std::collections::BTreeMap;
use std::process::Stdio;

use common::fake_driver::{Caps, ZONE_KEY};
use common::{BRIDGE, MODES, Mode, World};

fn zone(z: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(ZONE_KEY.to_string(), z.to_string())])
}

/// `[volume]` asking for zone-a or zone-b, preferring zone-b.
fn in_zones(requisite: &[&str], preferred: &[&str]) -> String {
    let list = |zones: &[&str]| {
        zones
            .iter()
            .map(|z| format!("{{ \"{ZONE_KEY}\" = \"{z}\" }}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "[volume.accessibility_requirements]\nrequisite = [{}]\npreferred = [{}]\n",
        list(requisite),
        list(preferred)
    )
}

/// Runs the bridge with `args` and this world's config: (exit code, stdout, stderr).
fn run(w: &World, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(BRIDGE)
        .args(args)
        .arg("--config")
        .arg(&w.config_path)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(w: &World, args: &[&str]) -> Vec<serde_json::Value> {
    let mut args = args.to_vec();
    args.extend(["--output", "json"]);
    let (code, out, err) = run(w, &args);
    assert_eq!(code, 0, "{args:?}: {out}{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// `serve` refuses to start, and `check` reports the same problem: both name `needles`.
async fn refused_at_start(w: &mut World, needles: &[&str]) {
    let (code, out, err) = run(w, &["check"]);
    assert_ne!(code, 0, "check passed: {out}{err}");
    for needle in needles {
        assert!(
            out.contains(needle),
            "check does not say {needle:?}: {out}{err}"
        );
    }
    let refused = w
        .start_daemon()
        .await
        .expect_err("serve must refuse to start");
    for needle in needles {
        assert!(
            refused.contains(needle),
            "serve does not say {needle:?}: {refused}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_topology_is_asked_for_recorded_listed_and_enforced_at_attach() {
    require_root!();
    for mode in MODES {
        let caps = Caps {
            stage: true,
            zone: Some("zone-a"),
            ..Default::default()
        };
        // Placed in zone-b (preferred), while this node sits in zone-a.
        let w = World::start(mode, caps, &in_zones(&["zone-a", "zone-b"], &["zone-b"])).await;
        // (The base dir does not exist before the first Attach: that finding fails.)
        let (_, out, err) = run(&w, &["check"]);
        assert!(
            out.contains("ok   driver capabilities fit the served roles"),
            "{out}{err}"
        );
        let created = w.create("far").await.unwrap();
        let asked = w
            .driver
            .calls()
            .into_iter()
            .find(|c| c.method == "CreateVolume")
            .unwrap();
        assert_eq!(asked.requisite, [zone("zone-a"), zone("zone-b")]);
        assert_eq!(asked.preferred, [zone("zone-b")]);
        let listed = json(&w, &["list", "--controller"]);
        assert_eq!(
            listed[0]["accessible_topology"],
            serde_json::json!([{ ZONE_KEY: "zone-b" }]),
            "{listed:?}"
        );
        let (_, text, _) = run(&w, &["list", "--controller"]);
        assert!(text.contains(&format!("{{{ZONE_KEY}=zone-b}}")), "{text}");

        w.driver.clear_calls();
        let err = w
            .attach("s1", "far", 0, &created.private_data)
            .await
            .expect_err("zone-b volume on a zone-a node");
        if mode == Mode::Rpc {
            assert_eq!(err.code, Some(tonic::Code::FailedPrecondition), "{err:?}");
        }
        assert!(
            err.message.contains(&format!("{{{ZONE_KEY}=zone-b}}"))
                && err.message.contains(&format!("{{{ZONE_KEY}=zone-a}}")),
            "{mode:?}: {}",
            err.message
        );
        assert!(
            w.driver.mutating_calls().is_empty(),
            "{:?}",
            w.driver.calls()
        );
        assert_eq!(w.journal_records(), 0);
        assert!(w.mounts().is_empty(), "{:?}", w.mounts());
        w.destroy("far").await.unwrap();

        // Requiring this node's zone places the volume here: it attaches, and the node's
        // `list` says where it can be attached.
        let w = World::start(mode, caps, &in_zones(&["zone-a"], &[])).await;
        let created = w.create("near").await.unwrap();
        let attached = w
            .attach("s1", "near", 0, &created.private_data)
            .await
            .unwrap();
        let listed = json(&w, &["list"]);
        assert_eq!(
            listed[0]["accessible_topology"],
            serde_json::json!([{ ZONE_KEY: "zone-a" }]),
            "{listed:?}"
        );
        w.detach("s1", "near", 0, &attached.metadata).await.unwrap();
        w.destroy("near").await.unwrap();
        assert_eq!(w.journal_records(), 0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn requirements_for_a_driver_without_topology_are_refused_and_change_nothing() {
    let mut w = World::start(Mode::Binary, Caps::staging(), &in_zones(&["zone-a"], &[])).await;
    refused_at_start(
        &mut w,
        &["VOLUME_ACCESSIBILITY_CONSTRAINTS", "fake.csi.test"],
    )
    .await;
    let err = w.create("v").await.expect_err("refused");
    assert!(
        err.message.contains("VOLUME_ACCESSIBILITY_CONSTRAINTS"),
        "{}",
        err.message
    );
    assert!(
        w.driver.mutating_calls().is_empty(),
        "{:?}",
        w.driver.calls()
    );
    assert!(json(&w, &["list", "--controller"]).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn unsatisfiable_or_malformed_topology_config_is_refused_at_load() {
    let w = World::start(Mode::Binary, Caps::staging(), "").await;
    for (volume, needle) in [
        (
            in_zones(&["zone-a"], &["zone-b"]),
            "is not among the requisite ones",
        ),
        (
            "[volume.accessibility_requirements]\n".to_string(),
            "neither requisite nor preferred",
        ),
        (
            "[volume.accessibility_requirements]\nrequisite = [{}]\n".to_string(),
            "requisite[0] is empty",
        ),
        (in_zones(&["-zone"], &[]), "letters, digits"),
        (
            in_zones(&["zone-a", "zone-a"], &[]),
            "repeats an earlier topology",
        ),
    ] {
        let text = common::config_text(w.dir.path(), &volume);
        std::fs::write(&w.config_path, text).unwrap();
        let (code, out, err) = run(&w, &["check"]);
        assert_eq!(code, 78, "{volume}: {out}{err}");
        assert!(
            err.contains("volume.accessibility_requirements") && err.contains(needle),
            "{volume}: {err}"
        );
    }
    assert!(w.driver.calls().is_empty(), "nothing reached the driver");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_mount_group_reaches_stage_and_publish() {
    require_root!();
    for mode in MODES {
        let caps = Caps {
            stage: true,
            volume_mount_group: true,
            ..Default::default()
        };
        let w = World::start(mode, caps, "[volume]\nmount_group = 2000\n").await;
        let created = w.create("v").await.unwrap();
        let attached = w.attach("s1", "v", 0, &created.private_data).await.unwrap();
        let groups: Vec<_> = w
            .driver
            .calls()
            .into_iter()
            .filter(|c| c.method.starts_with("NodeStage") || c.method.starts_with("NodePublish"))
            .map(|c| (c.method, c.volume_mount_group))
            .collect();
        assert_eq!(
            groups,
            [
                ("NodeStageVolume", "2000".to_string()),
                ("NodePublishVolume", "2000".to_string())
            ]
        );
        let create = w
            .driver
            .calls()
            .into_iter()
            .find(|c| c.method == "CreateVolume")
            .unwrap();
        assert_eq!(create.volume_mount_group, "", "a node-side setting only");
        w.detach("s1", "v", 0, &attached.metadata).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mount_group_the_driver_cannot_honour_is_refused_and_changes_nothing() {
    let mut w = World::start(
        Mode::Binary,
        Caps::staging(),
        "[volume]\nmount_group = 2000\n",
    )
    .await;
    refused_at_start(&mut w, &["VOLUME_MOUNT_GROUP", "fake.csi.test", "2000"]).await;
    let created = w.create("v").await.unwrap();
    w.driver.clear_calls();
    let err = w
        .attach("s1", "v", 0, &created.private_data)
        .await
        .expect_err("refused");
    assert!(
        err.message.contains("VOLUME_MOUNT_GROUP"),
        "{}",
        err.message
    );
    assert!(
        w.driver.mutating_calls().is_empty(),
        "{:?}",
        w.driver.calls()
    );
    assert_eq!(w.journal_records(), 0);

    for (value, needle) in [
        ("\"staff\"", "numeric group id"),
        ("-1", "from 0 to"),
        ("4294967295", "from 0 to"),
        ("1.5", "numeric group id"),
    ] {
        let text = common::config_text(w.dir.path(), &format!("[volume]\nmount_group = {value}\n"));
        std::fs::write(&w.config_path, text).unwrap();
        let (code, out, err) = run(&w, &["check"]);
        assert_eq!(code, 78, "{value}: {out}{err}");
        assert!(
            err.contains("volume.mount_group") && err.contains(needle),
            "{value}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn single_node_writer_modes_reach_the_driver_when_it_has_the_capability() {
    require_root!();
    for (mode, wire) in [
        ("single_node_single_writer", 6),
        ("single_node_multi_writer", 7),
    ] {
        let volume = format!("[volume]\naccess_mode = \"{mode}\"\n");
        let caps = Caps {
            stage: true,
            single_node_multi_writer: true,
            ..Default::default()
        };
        let w = World::start(Mode::Rpc, caps, &volume).await;
        let created = w.create("v").await.unwrap();
        let attached = w.attach("s1", "v", 0, &created.private_data).await.unwrap();
        let modes: Vec<_> = w
            .driver
            .calls()
            .into_iter()
            .filter(|c| {
                ["CreateVolume", "NodeStageVolume", "NodePublishVolume"].contains(&c.method)
            })
            .map(|c| c.access_mode)
            .collect();
        assert_eq!(modes, [wire, wire, wire], "{mode}");
        w.detach("s1", "v", 0, &attached.metadata).await.unwrap();

        let without = Caps {
            single_node_multi_writer: false,
            ..Caps::staging()
        };
        let mut w = World::start(Mode::Binary, without, &volume).await;
        refused_at_start(
            &mut w,
            &[
                &mode.to_ascii_uppercase(),
                "SINGLE_NODE_MULTI_WRITER controller capability",
            ],
        )
        .await;
        let err = w.create("v").await.expect_err("refused");
        assert!(
            err.message.contains("SINGLE_NODE_MULTI_WRITER"),
            "{}",
            err.message
        );
        assert!(
            w.driver.mutating_calls().is_empty(),
            "{:?}",
            w.driver.calls()
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_access_mode_is_refused_at_load_naming_the_modes() {
    let w = World::start(
        Mode::Binary,
        Caps::staging(),
        "[volume]\naccess_mode = \"single_node_writers\"\n",
    )
    .await;
    let (code, out, err) = run(&w, &["check"]);
    assert_eq!(code, 78, "{out}{err}");
    assert!(err.contains("access_mode"), "{err}");
    for mode in [
        "single_node_single_writer",
        "single_node_multi_writer",
        "multi_node_multi_writer",
    ] {
        assert!(err.contains(mode), "{mode} not named: {err}");
    }
}
