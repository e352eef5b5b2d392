//! The bridge in front of a driver that makes real mounts, with Cube as cubeclient (grpc-go,
//! dialing the `serve` daemon as Cubelet and CubeMaster do, or forking the hook inside the
//! simulated Cubelet mount namespace as Cubelet does), every host_path checked where
//! Cubelet looks. The driver is the project's fake (tests/common/fake_driver.rs) in the
//! two shapes of tests/common/cube_node.rs: one that stages (as csi-driver-host-path
//! does) and one that publishes from a shared backend, mounts its share in CreateVolume and
//! DeleteVolume and takes an existing mount as success (as csi-driver-nfs does). The
//! third-party CSI implementation, csi-test's mock driver, is tests/mock_driver.rs.
//!
//! Needs root and `CUBE_CSI_BRIDGE_PEERS_BIN` (set by scripts/test.sh); skips without them,
//! except in CI (`CI=true`), where they must be set.

mod common;

use std::path::Path;
use std::time::Duration;

use common::cube_node::{CubeNode, DriverKind, NFS_MOUNT_FLAGS, NodeOptions, csi_volume_id};
use common::{MODES, Mode};
use cube_csi_bridge::mount::MountTable;

const KINDS: [DriverKind; 2] = [DriverKind::Staging, DriverKind::NfsLike];

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Asserts host_path is a mount point in the host and in Cubelet's namespace.
fn assert_attached(node: &CubeNode, host_path: &Path, what: &str) {
    assert!(
        MountTable::read(None).unwrap().is_mount_point(host_path),
        "{what}: {} is not mounted in the host\n{}",
        host_path.display(),
        node.logs()
    );
    node.cubelet().assert_mounted_inside(host_path, what);
}

/// create → attach (A, ref 0) → attach (B, ref 1) → A writes, B reads → detach (ref 1) →
/// detach (ref 0) → attach again, the data is there → detach → destroy → the backend
/// volume is gone → destroy again.
async fn whole_lifecycle(node: &CubeNode) {
    let label = format!("{:?} {:?}", node.kind, node.mode);
    let cube = node.cube();
    let (token, private_data) = cube
        .create("vol-1")
        .await
        .unwrap_or_else(|f| panic!("{label}: create: {f:?}\n{}", node.logs()));
    assert_eq!(token, "");
    let backend = node.backend_dir(&private_data);
    assert!(
        backend.is_dir(),
        "{label}: the driver made {}",
        backend.display()
    );

    let a = cube
        .attach(&node.base_dir, "sb-a", "vol-1", 0, &private_data)
        .await
        .unwrap_or_else(|f| panic!("{label}: attach A: {f:?}\n{}", node.logs()));
    let host_path = node.host_path("vol-1");
    assert_eq!(a.host_path, host_path, "{label}");
    assert_attached(node, &host_path, &format!("{label}: first attach"));

    let b = cube
        .attach(&node.base_dir, "sb-b", "vol-1", 1, &private_data)
        .await
        .unwrap_or_else(|f| panic!("{label}: attach B: {f:?}\n{}", node.logs()));
    assert_eq!(b.host_path, host_path, "{label}");
    assert_attached(node, &host_path, &format!("{label}: second holder"));

    // Sandbox A writes through host_path; sandbox B reads it where Cubelet looks.
    std::fs::write(a.host_path.join("f.txt"), "from sb-a").unwrap();
    assert_eq!(
        node.cubelet().read_inside(&b.host_path.join("f.txt")),
        "from sb-a",
        "{label}"
    );
    assert_eq!(
        read(&backend.join("f.txt")),
        "from sb-a",
        "{label}: on the backend"
    );

    cube.detach("sb-b", "vol-1", 1, &b.metadata)
        .await
        .unwrap_or_else(|f| panic!("{label}: detach B: {f:?}\n{}", node.logs()));
    assert_attached(node, &host_path, &format!("{label}: still held by sb-a"));
    assert_eq!(read(&a.host_path.join("f.txt")), "from sb-a", "{label}");

    cube.detach("sb-a", "vol-1", 0, &a.metadata)
        .await
        .unwrap_or_else(|f| panic!("{label}: detach A: {f:?}\n{}", node.logs()));
    node.assert_nothing_left("after the last detach");
    assert!(!host_path.exists(), "{label}: host_path removed");
    assert_eq!(
        read(&backend.join("f.txt")),
        "from sb-a",
        "{label}: data kept"
    );

    let again = cube
        .attach(&node.base_dir, "sb-c", "vol-1", 0, &private_data)
        .await
        .unwrap_or_else(|f| panic!("{label}: attach again: {f:?}\n{}", node.logs()));
    assert_attached(node, &again.host_path, &format!("{label}: attached again"));
    assert_eq!(
        node.cubelet().read_inside(&again.host_path.join("f.txt")),
        "from sb-a",
        "{label}: the file survived detach and re-attach"
    );
    cube.detach("sb-c", "vol-1", 0, &again.metadata)
        .await
        .unwrap_or_else(|f| panic!("{label}: detach again: {f:?}\n{}", node.logs()));
    node.assert_nothing_left("after detaching again");

    cube.destroy("vol-1")
        .await
        .unwrap_or_else(|f| panic!("{label}: destroy: {f:?}\n{}", node.logs()));
    assert!(
        !backend.exists(),
        "{label}: the driver deleted the volume ({})",
        backend.display()
    );
    cube.destroy("vol-1")
        .await
        .unwrap_or_else(|f| panic!("{label}: destroy again: {f:?}\n{}", node.logs()));
    node.assert_nothing_left("after destroy");
}

/// Was `hostpathplugin_whole_lifecycle_through_both_transports`: a driver that stages.
#[tokio::test(flavor = "multi_thread")]
async fn staging_driver_whole_lifecycle_through_both_transports() {
    let peers = require_cube_peers!();
    for mode in MODES {
        let node = CubeNode::start(&peers, DriverKind::Staging, mode, NodeOptions::default()).await;
        whole_lifecycle(&node).await;
        let calls = node.driver.mutating_calls();
        assert_eq!(
            calls.iter().filter(|c| **c == "NodeStageVolume").count(),
            2,
            "{mode:?}: staged on each first Attach: {calls:?}"
        );
    }
}

/// Was `nfsplugin_whole_lifecycle_through_both_transports`: a driver without staging whose
/// CreateVolume and DeleteVolume mount its share, given the configured mount flags.
#[tokio::test(flavor = "multi_thread")]
async fn nfs_like_driver_whole_lifecycle_through_both_transports() {
    let peers = require_cube_peers!();
    for mode in MODES {
        let node = CubeNode::start(&peers, DriverKind::NfsLike, mode, NodeOptions::default()).await;
        whole_lifecycle(&node).await;
        let host_path = node.host_path("vol-1");
        let publishes: Vec<_> = node
            .driver
            .calls()
            .into_iter()
            .filter(|c| c.method == "NodePublishVolume")
            .collect();
        assert_eq!(publishes.len(), 2, "{mode:?}: two first Attaches");
        for publish in &publishes {
            assert_eq!(Path::new(&publish.target_path), host_path, "{mode:?}");
            assert_eq!(publish.staging_target_path, "", "{mode:?}: no staging");
            assert_eq!(publish.mount_flags, NFS_MOUNT_FLAGS, "{mode:?}");
        }
        assert!(
            !node.driver.mutating_calls().contains(&"NodeStageVolume"),
            "{mode:?}"
        );
        // CreateVolume and DeleteVolume (twice: Destroy is repeated) mounted the share,
        // and every such mount is gone (assert_nothing_left checked it).
        assert!(
            node.driver.share_mounts() >= 2,
            "{mode:?}: the driver's own share mounts: {}",
            node.driver.share_mounts()
        );
    }
}

/// Was `two_nodes_share_one_nfs_volume`: two Cube nodes, each with its own node instance
/// of the NFS-like driver on one shared backend and its own node-side bridge (one the
/// daemon, one the forked hook), attach one volume and see each other's writes.
#[tokio::test(flavor = "multi_thread")]
async fn two_nodes_share_one_volume() {
    let peers = require_cube_peers!();
    let one = CubeNode::start(
        &peers,
        DriverKind::NfsLike,
        Mode::Rpc,
        NodeOptions::default(),
    )
    .await;
    let two = CubeNode::start(
        &peers,
        DriverKind::NfsLike,
        Mode::Binary,
        NodeOptions {
            services: "node",
            node_id: "node-2",
            backend: Some(one.backend.clone()),
            ..NodeOptions::default()
        },
    )
    .await;
    let (cube_one, cube_two) = (one.cube(), two.cube());
    let (_, private_data) = cube_one.create("shared").await.expect("create");

    let on_one = cube_one
        .attach(&one.base_dir, "sb-1", "shared", 0, &private_data)
        .await
        .unwrap_or_else(|f| panic!("attach on node 1: {f:?}\n{}", one.logs()));
    let on_two = cube_two
        .attach(&two.base_dir, "sb-2", "shared", 0, &private_data)
        .await
        .unwrap_or_else(|f| panic!("attach on node 2: {f:?}\n{}", two.logs()));
    assert_ne!(on_one.host_path, on_two.host_path);
    assert_attached(&one, &on_one.host_path, "node 1");
    assert_attached(&two, &on_two.host_path, "node 2");

    std::fs::write(on_one.host_path.join("one.txt"), "written on node 1").unwrap();
    std::fs::write(on_two.host_path.join("two.txt"), "written on node 2").unwrap();
    assert_eq!(
        two.cubelet().read_inside(&on_two.host_path.join("one.txt")),
        "written on node 1"
    );
    assert_eq!(
        one.cubelet().read_inside(&on_one.host_path.join("two.txt")),
        "written on node 2"
    );

    // Node 2 lets go; node 1 still has the volume and both files.
    cube_two
        .detach("sb-2", "shared", 0, &on_two.metadata)
        .await
        .expect("detach on node 2");
    two.assert_nothing_left("node 2 detached");
    assert_attached(&one, &on_one.host_path, "node 1 still attached");
    assert_eq!(read(&on_one.host_path.join("two.txt")), "written on node 2");
    cube_one
        .detach("sb-1", "shared", 0, &on_one.metadata)
        .await
        .expect("detach on node 1");
    one.assert_nothing_left("node 1 detached");

    let backend = one.backend_dir(&private_data);
    assert!(backend.join("one.txt").is_file() && backend.join("two.txt").is_file());
    cube_one.destroy("shared").await.expect("destroy");
    assert!(!backend.exists(), "the volume is removed from the backend");
}

/// A failed Attach leaves nothing mounted, staged or journaled: a private_data the bridge
/// never issued, and a driver that fails to publish (the volume's data directory is gone:
/// the staging driver fails to stage, the NFS-like one to publish). Once the backend is
/// repaired, Cube's retry works.
#[tokio::test(flavor = "multi_thread")]
async fn failed_attach_leaves_nothing_behind() {
    let peers = require_cube_peers!();
    for kind in KINDS {
        for mode in MODES {
            let node = CubeNode::start(&peers, kind, mode, NodeOptions::default()).await;
            let label = format!("{kind:?} {mode:?}");
            let cube = node.cube();
            let (_, private_data) = cube.create("bad").await.expect("create");
            let host_path = node.host_path("bad");

            for bad in ["not-a-handle", ""] {
                let err = cube
                    .attach(&node.base_dir, "sb", "bad", 0, bad)
                    .await
                    .unwrap_err();
                assert!(err.error.contains("private_data"), "{label}: {err:?}");
                if mode == Mode::Rpc {
                    assert_eq!(err.code.as_deref(), Some("InvalidArgument"), "{label}");
                }
                node.assert_nothing_left("bad private_data");
                assert!(!host_path.exists(), "{label}: no host_path");
            }

            let backend = node.backend_dir(&private_data);
            let parked = backend.with_extension("parked");
            std::fs::rename(&backend, &parked).unwrap();
            let err = cube
                .attach(&node.base_dir, "sb", "bad", 0, &private_data)
                .await
                .unwrap_err();
            let call = match kind {
                DriverKind::Staging => "NodeStageVolume",
                DriverKind::NfsLike => "NodePublishVolume",
            };
            assert!(
                err.error.contains(call),
                "{label}: names the CSI call: {err:?}"
            );
            assert!(
                err.error.contains(&csi_volume_id(&private_data)) || err.error.contains("bad"),
                "{label}: names the volume: {err:?}"
            );
            node.assert_nothing_left("failed publish");
            assert!(!host_path.exists(), "{label}: no host_path");

            std::fs::rename(&parked, &backend).unwrap();
            let ok = cube
                .attach(&node.base_dir, "sb", "bad", 0, &private_data)
                .await
                .unwrap_or_else(|f| panic!("{label}: retry: {f:?}\n{}", node.logs()));
            assert_attached(&node, &ok.host_path, &format!("{label}: retried"));
            cube.detach("sb", "bad", 0, &ok.metadata)
                .await
                .expect("detach");
            node.assert_nothing_left("after the retry's detach");
            cube.destroy("bad").await.expect("destroy");
        }
    }
}

/// The metrics endpoint, scraped while a staging driver with GET_VOLUME_STATS serves: hook
/// counters and CSI latency histograms move, and the driver's NodeGetVolumeStats (statvfs
/// of the published path) reaches the gauges.
#[tokio::test(flavor = "multi_thread")]
async fn volume_stats_and_hook_metrics_reach_the_metrics_endpoint() {
    let peers = require_cube_peers!();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let options = NodeOptions {
        volume_stats: true,
        extra_config: format!(
            "[metrics]\nlisten = \"127.0.0.1:{port}\"\nvolume_stats_interval_secs = 5\n"
        ),
        ..NodeOptions::default()
    };
    let node = CubeNode::start(&peers, DriverKind::Staging, Mode::Rpc, options).await;
    let cube = node.cube();
    // A volume id that says whose data it holds: the endpoint has no authentication, so by
    // default (metrics.volume_ids = "hashed") it never shows the id, only a stable hash.
    let volume = "tenant-acme-payroll";
    let label = {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(volume.as_bytes());
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("sha256:{hex}")
    };
    let (_, private_data) = cube.create(volume).await.unwrap();
    let a = cube
        .attach(&node.base_dir, "sb", volume, 0, &private_data)
        .await
        .unwrap_or_else(|f| panic!("attach: {f:?}\n{}", node.logs()));
    std::fs::write(a.host_path.join("data"), vec![7u8; 1 << 20]).unwrap();
    let scrape = || common::scrape_metrics(port);
    let series = |name: &str| format!("cube_csi_bridge_{name}{{volume_id=\"{label}\"}}");
    let gauge = series("volume_capacity_bytes");
    let mut text = scrape().await;
    for _ in 0..60 {
        if text.contains(&gauge) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        text = scrape().await;
    }
    assert!(
        !text.contains(volume),
        "the volume id is on the endpoint:\n{text}"
    );
    for needle in [
        gauge.as_str(),
        &series("volume_used_bytes"),
        &series("volume_available_bytes"),
        &series("volume_abnormal"),
        "cube_csi_bridge_attached_volumes 1",
        "cube_csi_bridge_volume_holders 1",
        "cube_csi_bridge_hook_calls_total{hook=\"attach\",outcome=\"success\"} 1",
        "cube_csi_bridge_hook_calls_total{hook=\"create\",outcome=\"success\"} 1",
        "cube_csi_bridge_csi_call_duration_seconds_count{rpc=\"NodeStageVolume\",code=\"Ok\"} 1",
        "cube_csi_bridge_csi_call_duration_seconds_count{rpc=\"NodePublishVolume\",code=\"Ok\"} 1",
        "cube_csi_bridge_csi_call_duration_seconds_count{rpc=\"NodeGetVolumeStats\",code=\"Ok\"}",
    ] {
        assert!(
            text.contains(needle),
            "{needle} missing:\n{text}\n{}",
            node.logs()
        );
    }
    cube.detach("sb", volume, 0, &a.metadata).await.unwrap();
    cube.destroy(volume).await.unwrap();
    let text = scrape().await;
    assert!(
        text.contains("cube_csi_bridge_hook_calls_total{hook=\"detach\",outcome=\"success\"} 1"),
        "{text}"
    );
}
