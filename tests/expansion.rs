//! `cube-csi-bridge expand` as an operator runs it, beside a bridge serving Cube over
//! both transports, against the project's fake driver (real mounts): the driver grows the
//! volume (ControllerExpandVolume, then NodeExpandVolume at the mounted host_path), the
//! new capacity is recorded and listed, a later Create keeps it, and bad input (a smaller
//! size, an unknown volume, a bad size, a driver that cannot expand, an offline driver's
//! volume in use) is a clear error that changes nothing. Needs root (real mounts); CI
//! runs it as root.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::fake_driver::{Caps, ExpansionProfile};
use common::{BRIDGE, MODES, Mode, World};

const GI: i64 = 1 << 30;
const CONTROLLER_SECRET: &str = "ce-secret-value-9";
const NODE_SECRET: &str = "ne-secret-value-7";

fn expanding(online: bool) -> Caps {
    Caps {
        stage: true,
        expansion: ExpansionProfile {
            controller: true,
            node: true,
            online: Some(online),
            node_expansion_required: true,
        },
        ..Caps::default()
    }
}

/// A world (in `mode`) whose config asks for 1Gi volumes and has expansion secrets.
async fn world(mode: Mode, caps: Caps) -> Option<World> {
    if !nix::unistd::Uid::effective().is_root() {
        common::skip("expansion tests mount; run as root");
        return None;
    }
    let extra = format!(
        "[volume]\ncapacity_bytes = {GI}\n[secrets]\ncontroller_expand = {{ key = \"{CONTROLLER_SECRET}\" }}\nnode_expand = {{ key = \"{NODE_SECRET}\" }}\n"
    );
    let mut w = World::start(Mode::Binary, caps, &extra).await;
    // A config with [secrets] must be private, or the bridge refuses it.
    std::fs::set_permissions(&w.config_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    if mode == Mode::Rpc {
        w.mode = Mode::Rpc;
        w.start_daemon().await.expect("daemon starts");
    }
    Some(w)
}

/// Runs the executable with `args` and this world's config: (exit code, stdout, stderr).
fn run(w: &World, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(BRIDGE)
        .args(args)
        .arg("--config")
        .arg(&w.config_path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The recorded capacity of `volume` as `list --controller --output json` shows it.
fn listed_capacity(w: &World, volume: &str) -> i64 {
    let (code, out, err) = run(w, &["list", "--controller", "--output", "json"]);
    assert_eq!(code, 0, "{err}");
    let records: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let record = records
        .iter()
        .find(|r| r["volume_id"] == volume)
        .unwrap_or_else(|| panic!("{volume} not listed: {out}"));
    record["capacity_bytes"].as_i64().unwrap()
}

fn expand_calls(w: &World) -> Vec<common::fake_driver::Call> {
    w.driver
        .calls()
        .into_iter()
        .filter(|c| c.method.ends_with("ExpandVolume"))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn expand_grows_an_attached_volume_records_it_and_refuses_bad_input() {
    for mode in MODES {
        let Some(w) = world(mode, expanding(true)).await else {
            return;
        };
        let created = w.create("ws").await.expect("create");
        let attached = w
            .attach("sb1", "ws", 0, &created.private_data)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: attach: {e:?}\n{}", w.logs()));
        let host_path = attached.host_path.clone();
        assert_eq!(listed_capacity(&w, "ws"), GI, "{mode:?}");

        let (code, out, err) = run(&w, &["expand", "ws", "--size", "2Gi", "--output", "json"]);
        assert_eq!(code, 0, "{mode:?}: {err}");
        let report: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["controller"]["previous_bytes"], GI, "{out}");
        assert_eq!(report["controller"]["capacity_bytes"], 2 * GI, "{out}");
        assert_eq!(report["controller"]["controller_expanded"], true, "{out}");
        assert_eq!(report["controller"]["expansion"], "online", "{out}");
        assert_eq!(report["node"]["outcome"], "expanded", "{out}");
        assert_eq!(report["node"]["volume_path"], host_path.as_str(), "{out}");

        let calls = expand_calls(&w);
        assert_eq!(calls.len(), 2, "{mode:?}: {calls:?}");
        let (controller, node) = (&calls[0], &calls[1]);
        assert_eq!(controller.method, "ControllerExpandVolume");
        assert_eq!(controller.required_bytes, 2 * GI);
        assert_eq!(controller.secrets["key"], CONTROLLER_SECRET);
        assert_eq!(node.method, "NodeExpandVolume");
        assert_eq!(node.target_path, host_path);
        assert!(node.staging_target_path.contains(".staging"), "{node:?}");
        assert_eq!(node.required_bytes, 2 * GI);
        assert_eq!(node.secrets["key"], NODE_SECRET);
        assert_eq!(w.driver.capacity(&controller.volume_id), 2 * GI);
        assert_eq!(listed_capacity(&w, "ws"), 2 * GI, "{mode:?}");
        let (_, text, _) = run(&w, &["list", "--controller"]);
        assert!(text.contains("2Gi"), "{text}");

        // Bad input: a clear error, nothing changed.
        for (args, code_wanted, says) in [
            (vec!["expand", "ws", "--size", "1Gi"], 1, "smaller"),
            (vec!["expand", "ws", "--size", "1536Mi"], 1, "2Gi"),
            (vec!["expand", "nope", "--size", "3Gi"], 1, "unknown"),
            (vec!["expand", "ws", "--size", "3Xi"], 2, "Gi"),
            (vec!["expand", "ws", "--size", "0"], 2, "zero"),
            (vec!["expand", "../ws", "--size", "3Gi"], 1, "volume_id"),
        ] {
            let (code, out, err) = run(&w, &args);
            assert_eq!(code, code_wanted, "{mode:?} {args:?}: {out}{err}");
            assert!(err.contains(says), "{mode:?} {args:?}: {err}");
        }
        assert_eq!(
            expand_calls(&w).len(),
            2,
            "{mode:?}: a refusal called the driver"
        );
        assert_eq!(listed_capacity(&w, "ws"), 2 * GI, "{mode:?}");

        // Repeated: nothing left to do.
        let (code, out, err) = run(&w, &["expand", "ws", "--size", "2Gi"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("already"), "{out}");
        assert_eq!(expand_calls(&w).len(), 2, "{mode:?}");

        // A later Create of the same volume asks for (and keeps) the grown size.
        w.driver.clear_calls();
        let again = w.create("ws").await.expect("create again");
        assert_eq!(again.private_data, created.private_data);
        let create = w
            .driver
            .calls()
            .into_iter()
            .find(|c| c.method == "CreateVolume")
            .unwrap();
        assert_eq!(create.required_bytes, 2 * GI, "{mode:?}");
        assert_eq!(listed_capacity(&w, "ws"), 2 * GI, "{mode:?}");

        w.detach("sb1", "ws", 0, &attached.metadata)
            .await
            .expect("detach");
        w.destroy("ws")
            .await
            .expect("destroy: the re-signed record verifies");
        let logs = w.logs();
        for secret in [CONTROLLER_SECRET, NODE_SECRET] {
            assert!(
                !logs.contains(secret),
                "{mode:?}: a log line holds {secret}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_driver_without_expansion_is_named_and_nothing_changes() {
    let Some(w) = world(Mode::Binary, Caps::staging()).await else {
        return;
    };
    w.create("ws").await.expect("create");
    let (code, out, err) = run(&w, &["expand", "ws", "--size", "2Gi"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        err.contains("EXPAND_VOLUME") && err.contains("fake.csi.test"),
        "{err}"
    );
    assert!(expand_calls(&w).is_empty());
    assert_eq!(listed_capacity(&w, "ws"), GI);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_offline_driver_waits_until_nobody_holds_the_volume() {
    for mode in MODES {
        let Some(w) = world(mode, expanding(false)).await else {
            return;
        };
        let created = w.create("ws").await.expect("create");
        let attached = w
            .attach("sb1", "ws", 0, &created.private_data)
            .await
            .expect("attach");
        let (code, out, err) = run(&w, &["expand", "ws", "--size", "2Gi"]);
        assert_eq!(code, 1, "{mode:?}: {out}");
        assert!(
            err.contains("offline") && err.contains("default/sb1"),
            "{mode:?}: {err}"
        );
        assert!(expand_calls(&w).is_empty(), "{mode:?}");
        assert_eq!(listed_capacity(&w, "ws"), GI);

        w.detach("sb1", "ws", 0, &attached.metadata)
            .await
            .expect("detach");
        let (code, out, err) = run(&w, &["expand", "ws", "--size", "2Gi", "--output", "json"]);
        assert_eq!(code, 0, "{mode:?}: {err}");
        let report: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["controller"]["expansion"], "offline", "{out}");
        assert_eq!(report["node"]["outcome"], "not_attached", "{out}");
        assert_eq!(listed_capacity(&w, "ws"), 2 * GI);
        // The grown volume attaches again.
        w.attach("sb2", "ws", 0, &created.private_data)
            .await
            .expect("attach after expanding");
    }
}
