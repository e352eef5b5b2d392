//! The bridge driven by a Cube-like caller written in Go (tests/peers/cubeclient), not by
//! the Rust harness: the `serve` daemon dialed by grpc-go at the bare socket path Cube
//! configures, and the executable forked per hook with Cube's argv and judged as Cube
//! judges it. Also a simulated Cubelet mount namespace (tests/peers/cubelet-ns.sh): the
//! host_path Attach returns must be a mount point there, or Attach must fail and roll back.
//!
//! Needs root (real mounts) and `CUBE_CSI_BRIDGE_PEERS_BIN`, the directory holding
//! `cubeclient` (the last line of `scripts/install-test-peers.sh`); skips without either.

mod common;

use std::path::{Path, PathBuf};

use common::callers::{
    CubeCaller, CubeError, GoCaller, attach_request, create_request, detach_request, peers_bin,
};
use common::cube_peers::{BaseDir, CubeletNs};
use common::fake_driver::{Behavior, Caps};
use common::{MODES, Mode, World};
use cube_csi_bridge::mount::MountTable;
use cube_csi_bridge::proto::cube::v1 as pb;
use tonic::Code;

/// Skips the test unless root and the Go peers are built (fails it in CI); yields the
/// peers' bin dir.
macro_rules! require_root_and_peers {
    () => {{
        require_root!();
        match peers_bin() {
            Some(dir) => dir,
            None => return,
        }
    }};
}

/// The Go caller's hooks, spelled as these tests use them.
async fn create(cube: &GoCaller, volume_id: &str) -> Result<pb::CreateResponse, CubeError> {
    cube.create(create_request(volume_id)).await
}

async fn attach(
    cube: &GoCaller,
    base_dir: &Path,
    sandbox: &str,
    volume_id: &str,
    ref_count: i64,
    private_data: &str,
) -> Result<pb::AttachResponse, CubeError> {
    cube.attach(attach_request(
        "default",
        base_dir,
        sandbox,
        volume_id,
        ref_count,
        private_data,
    ))
    .await
}

async fn detach(
    cube: &GoCaller,
    sandbox: &str,
    volume_id: &str,
    answer: &pb::AttachResponse,
    ref_count: i64,
) -> Result<(), CubeError> {
    cube.detach(detach_request(
        "default",
        sandbox,
        volume_id,
        ref_count,
        &answer.metadata,
    ))
    .await
}

fn mounted_at(answer: &pb::AttachResponse) -> &Path {
    Path::new(&answer.host_path)
}

/// Asserts what the fake driver was asked to change since the last check, and forgets it.
fn expect_calls(w: &World, expected: &[&str], what: &str) {
    assert_eq!(w.driver.mutating_calls(), expected, "{:?}: {what}", w.mode);
    w.driver.clear_calls();
}

/// The full Cube lifecycle of one volume shared by two sandboxes, through cubeclient.
async fn whole_lifecycle(bin: &Path, mode: Mode) {
    let w = World::start(mode, Caps::staging(), "").await;
    let cube = w.go_caller(bin);

    let pb::CreateResponse {
        token,
        private_data,
    } = create(&cube, "vol-1").await.unwrap();
    assert_eq!(token, "");
    assert!(!private_data.is_empty());
    expect_calls(&w, &["CreateVolume"], "create");

    let a = attach(&cube, &w.base_dir, "sb-a", "vol-1", 0, &private_data)
        .await
        .unwrap();
    let host_path = w.base_dir.join("fake+vol-1");
    assert_eq!(mounted_at(&a), host_path);
    assert!(w.mounts().contains(&host_path), "host_path is mounted");
    expect_calls(
        &w,
        &["NodeStageVolume", "NodePublishVolume"],
        "first attach",
    );
    let csi_volume_id = a.metadata.get("csi_volume_id").expect("metadata").clone();
    let volume_dir = w.driver.volume_dir(&csi_volume_id);
    assert!(volume_dir.is_dir(), "{}", volume_dir.display());

    let b = attach(&cube, &w.base_dir, "sb-b", "vol-1", 1, &private_data)
        .await
        .unwrap();
    assert_eq!(mounted_at(&b), host_path);
    expect_calls(&w, &[], "second holder");

    // Sandbox A writes, sandbox B reads: one volume.
    std::fs::write(mounted_at(&a).join("f.txt"), "from sb-a").unwrap();
    assert_eq!(
        std::fs::read_to_string(mounted_at(&b).join("f.txt")).unwrap(),
        "from sb-a"
    );

    detach(&cube, "sb-b", "vol-1", &b, 1).await.unwrap();
    expect_calls(&w, &[], "detach with another holder left");
    assert!(w.mounts().contains(&host_path), "still mounted for sb-a");
    assert_eq!(
        std::fs::read_to_string(mounted_at(&a).join("f.txt")).unwrap(),
        "from sb-a"
    );

    detach(&cube, "sb-a", "vol-1", &a, 0).await.unwrap();
    expect_calls(
        &w,
        &["NodeUnpublishVolume", "NodeUnstageVolume"],
        "last detach",
    );
    assert_eq!(w.mounts(), Vec::<PathBuf>::new(), "nothing mounted");
    assert!(!host_path.exists(), "host_path removed");
    assert!(
        !w.base_dir.join(".staging/fake+vol-1").exists(),
        "staging removed"
    );
    assert_eq!(w.journal_records(), 0);
    assert!(
        volume_dir.join("f.txt").is_file(),
        "the data stays in the volume"
    );

    let again = attach(&cube, &w.base_dir, "sb-c", "vol-1", 0, &private_data)
        .await
        .unwrap();
    assert_eq!(mounted_at(&again), host_path);
    expect_calls(&w, &["NodeStageVolume", "NodePublishVolume"], "re-attach");
    assert_eq!(
        std::fs::read_to_string(mounted_at(&again).join("f.txt")).unwrap(),
        "from sb-a"
    );
    detach(&cube, "sb-c", "vol-1", &again, 0).await.unwrap();
    expect_calls(
        &w,
        &["NodeUnpublishVolume", "NodeUnstageVolume"],
        "detach after re-attach",
    );
    assert_eq!(w.mounts(), Vec::<PathBuf>::new());

    cube.destroy(pb::DestroyRequest {
        volume_id: "vol-1".into(),
    })
    .await
    .unwrap();
    expect_calls(&w, &["DeleteVolume"], "destroy");
    assert!(!volume_dir.exists(), "the driver deleted the volume");
    assert_eq!(w.journal_records(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn go_rpc_client_drives_the_daemon_through_a_whole_lifecycle() {
    let bin = require_root_and_peers!();
    whole_lifecycle(&bin, Mode::Rpc).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn go_binary_caller_drives_forked_hooks_through_a_whole_lifecycle() {
    let bin = require_root_and_peers!();
    whole_lifecycle(&bin, Mode::Binary).await;
}

/// The failure as Cube would see it (rpc: status; binary: exit code and stdout object).
fn assert_failure(mode: Mode, f: &CubeError, code: Code, needles: &[&str]) {
    for needle in needles {
        assert!(f.message.contains(needle), "{mode:?}: {needle:?} in {f:?}");
    }
    match mode {
        Mode::Rpc => assert_eq!(f.code, Some(code), "{f:?}"),
        Mode::Binary => {
            assert!(f.exit_code.is_some_and(|c| c > 0), "{f:?}");
            // The hook's own stdout is one JSON object with the error too.
            let raw: serde_json::Value =
                serde_json::from_str(f.stdout.as_deref().unwrap_or_default()).unwrap();
            let error = raw["error"].as_str().unwrap_or_default();
            for needle in needles {
                assert!(error.contains(needle), "{needle:?} in hook stdout {raw}");
            }
        }
    }
}

fn assert_nothing_left(w: &World, base_mounts: &[PathBuf]) {
    assert_eq!(w.mounts(), base_mounts, "{:?}: nothing mounted", w.mode);
    // What is left in .staging (an empty staging dir parked for the volume's next first
    // Attach is not).
    let staging = w.base_dir.join(".staging");
    let staged: Vec<_> = common::left_in_base_dir(&w.base_dir)
        .into_iter()
        .filter(|path| path.starts_with(&staging))
        .collect();
    assert_eq!(
        staged,
        Vec::<PathBuf>::new(),
        "{:?}: nothing staged",
        w.mode
    );
    assert_eq!(w.journal_records(), 0, "{:?}: no journal record", w.mode);
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_attach_through_the_go_client_leaves_nothing_mounted_or_staged() {
    let bin = require_root_and_peers!();
    for mode in MODES {
        let w = World::start(mode, Caps::staging(), "").await;
        let cube = w.go_caller(&bin);
        let private_data = create(&cube, "bad").await.unwrap().private_data;
        w.driver.clear_calls();

        // Sandbox creation with a handle the bridge never issued, or none at all.
        for bad in ["not-a-handle", ""] {
            let err = attach(&cube, &w.base_dir, "sb", "bad", 0, bad)
                .await
                .unwrap_err();
            assert_failure(mode, &err, Code::InvalidArgument, &["private_data"]);
            expect_calls(&w, &[], "a bad request reaches no driver");
            assert_nothing_left(&w, &[]);
            assert!(!w.base_dir.join("fake+bad").exists(), "no host_path");
        }

        // The driver fails to publish: the stage is undone before Attach answers.
        w.driver.script(
            "NodePublishVolume",
            [Behavior::Fail(Code::Internal, "mount: wrong fs type")],
        );
        let err = attach(&cube, &w.base_dir, "sb", "bad", 0, &private_data)
            .await
            .unwrap_err();
        assert_failure(
            mode,
            &err,
            Code::Internal,
            &["NodePublishVolume", "mount: wrong fs type"],
        );
        // NodeUnpublish before NodeUnstage: a publish the driver may still count is
        // unpublished first (idempotent; issue 19, defect 5).
        expect_calls(
            &w,
            &[
                "NodeStageVolume",
                "NodePublishVolume",
                "NodeUnpublishVolume",
                "NodeUnstageVolume",
            ],
            "rolled back",
        );
        assert_nothing_left(&w, &[]);
        assert!(!w.base_dir.join("fake+bad").exists(), "no host_path");

        // Cube retries the sandbox later: it works and cleans up.
        let ok = attach(&cube, &w.base_dir, "sb", "bad", 0, &private_data)
            .await
            .unwrap();
        detach(&cube, "sb", "bad", &ok, 0).await.unwrap();
        assert_nothing_left(&w, &[]);
    }
}

// --- simulated Cubelet mount namespace ------------------------------------------------

/// Asserts that the namespace, its file and the base dir's bind are gone.
fn assert_cleaned_up(ns: CubeletNs) {
    let (pid, nsfile, base) = (ns.pid, ns.nsfile(), ns.base.clone());
    let ns_inode = std::fs::metadata(format!("/proc/{pid}/ns/mnt")).map(|m| {
        use std::os::unix::fs::MetadataExt;
        m.ino()
    });
    drop(ns);
    let table = MountTable::read(None).unwrap();
    assert!(!table.is_mount_point(&nsfile), "ns file unbound");
    assert!(!table.is_mount_point(&base), "base dir bind released");
    // The holder is gone (or its pid reused by an unrelated process elsewhere).
    let now = std::fs::metadata(format!("/proc/{pid}/ns/mnt")).map(|m| {
        use std::os::unix::fs::MetadataExt;
        m.ino()
    });
    assert!(
        now.is_err() || now.ok() != ns_inode.ok(),
        "holder {pid} stopped"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn host_paths_are_mount_points_in_the_cubelet_namespace_when_attach_returns() {
    let bin = require_root_and_peers!();
    for mode in MODES {
        let ns_dir = tempfile::Builder::new()
            .prefix("ccb-cubelet-")
            .tempdir()
            .unwrap();
        let nsfile = CubeletNs::nsfile_in(ns_dir.path());
        let w =
            World::start_with_mount_view(mode, Caps::staging(), "", &nsfile.display().to_string())
                .await;
        let ns = CubeletNs::start(ns_dir, &w.base_dir, BaseDir::Shared);
        let cube = w.go_caller(&bin);
        let pd1 = create(&cube, "v1").await.unwrap().private_data;
        let pd2 = create(&cube, "v2").await.unwrap().private_data;
        w.driver.clear_calls();

        let a = attach(&cube, &w.base_dir, "sb-a", "v1", 0, &pd1)
            .await
            .unwrap();
        ns.assert_mounted_inside(mounted_at(&a), "first attach of v1");
        expect_calls(&w, &["NodeStageVolume", "NodePublishVolume"], "attach v1");
        let b = attach(&cube, &w.base_dir, "sb-b", "v1", 1, &pd1)
            .await
            .unwrap();
        ns.assert_mounted_inside(mounted_at(&b), "second holder of v1");
        let c = attach(&cube, &w.base_dir, "sb-a", "v2", 0, &pd2)
            .await
            .unwrap();
        ns.assert_mounted_inside(mounted_at(&c), "attach of v2");
        assert_ne!(mounted_at(&a), mounted_at(&c));

        // What a sandbox started by Cubelet would see: the volume's data.
        std::fs::write(mounted_at(&a).join("hello"), "from the host").unwrap();
        assert_eq!(
            ns.read_inside(&mounted_at(&b).join("hello")),
            "from the host"
        );

        detach(&cube, "sb-b", "v1", &b, 1).await.unwrap();
        ns.assert_mounted_inside(mounted_at(&a), "v1 still held by sb-a");
        detach(&cube, "sb-a", "v1", &a, 0).await.unwrap();
        detach(&cube, "sb-a", "v2", &c, 0).await.unwrap();
        // Unmounts propagate too: the namespace is left with the base dir alone.
        assert_eq!(
            ns.mounts_under_base(),
            std::slice::from_ref(&w.base_dir),
            "{mode:?}"
        );
        assert_eq!(w.mounts(), std::slice::from_ref(&w.base_dir), "{mode:?}");
        assert_eq!(w.journal_records(), 0);
        assert_cleaned_up(ns);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn attach_fails_and_rolls_back_when_the_mount_does_not_propagate() {
    let bin = require_root_and_peers!();
    for mode in MODES {
        let ns_dir = tempfile::Builder::new()
            .prefix("ccb-cubelet-")
            .tempdir()
            .unwrap();
        let nsfile = CubeletNs::nsfile_in(ns_dir.path());
        let w =
            World::start_with_mount_view(mode, Caps::staging(), "", &nsfile.display().to_string())
                .await;
        let ns = CubeletNs::start(ns_dir, &w.base_dir, BaseDir::Private);
        let cube = w.go_caller(&bin);
        let private_data = create(&cube, "np").await.unwrap().private_data;
        w.driver.clear_calls();

        let err = attach(&cube, &w.base_dir, "sb", "np", 0, &private_data)
            .await
            .unwrap_err();
        let host_path = w.base_dir.join("fake+np");
        let host_path_text = host_path.display().to_string();
        assert_failure(
            mode,
            &err,
            Code::FailedPrecondition,
            &["propagate", &host_path_text, "shared"],
        );
        expect_calls(
            &w,
            &[
                "NodeStageVolume",
                "NodePublishVolume",
                "NodeUnpublishVolume",
                "NodeUnstageVolume",
            ],
            "published, found invisible, rolled back",
        );
        assert_nothing_left(&w, std::slice::from_ref(&w.base_dir));
        assert!(!host_path.exists(), "host_path removed");
        assert_eq!(
            ns.mounts_under_base(),
            std::slice::from_ref(&w.base_dir),
            "{mode:?}"
        );
        assert_cleaned_up(ns);
    }
}
