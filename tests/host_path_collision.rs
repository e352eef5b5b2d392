//! Two bridge instances on one host, one base dir (issue 18, finding 5). Driver `nfs` with
//! volume `prod-x` and driver `nfs-prod` with volume `x` used to share `<base>/nfs-prod-x`
//! (and `<base>/.staging/nfs-prod-x`): with a driver that takes an existing mount as
//! success, as csi-driver-nfs does, the second instance's Attach answered with the first
//! one's data, and its Detach unmounted it. Now the leaf is `<driver>+<volume_id>`, and
//! `+` is in neither alphabet, so their paths differ (`nfs+prod-x`, `nfs-prod+x`); and a
//! first Attach whose paths are already mount points no record of this instance accounts
//! for is still refused before any CSI call. Volumes attached before the upgrade, at
//! `<driver>-<volume_id>`, keep that host_path until their last Detach.
//!
//! Needs root (real mounts); skips without it, except in CI.

mod common;

use std::path::{Path, PathBuf};

use common::fake_driver::Caps;
use common::{MODES, Mode, World, callers};
use cube_csi_bridge::mount::MountTable;

/// Makes a fresh Attach name its paths as the releases before `+` did (fault-injection
/// builds only; src/bridge/faults.rs).
const LEGACY_LEAF: &str = "CUBE_CSI_BRIDGE_LEGACY_LEAF";

fn is_mount_point(path: &Path) -> bool {
    MountTable::read(None).unwrap().is_mount_point(path)
}

/// Instance A (driver `nfs`, through the daemon) and instance B (driver `nfs-prod`,
/// forked), B told to use A's base dir.
async fn two_instances() -> (World, World, PathBuf) {
    let a = World::start_with_config(Mode::Rpc, Caps::staging(), "", |text| {
        text.replacen("driver = \"fake\"", "driver = \"nfs\"", 1)
    })
    .await;
    let base = a.base_dir.clone();
    let base_text = toml::Value::String(base.display().to_string()).to_string();
    let b = World::start_with_config(Mode::Binary, Caps::staging(), "", move |text| {
        text.replacen("driver = \"fake\"", "driver = \"nfs-prod\"", 1)
            .replacen(
                "allowed_base_dirs = [",
                &format!("allowed_base_dirs = [{base_text}, "),
                1,
            )
    })
    .await;
    (a, b, base)
}

#[tokio::test(flavor = "multi_thread")]
async fn instances_whose_legacy_paths_collided_attach_apart_and_detach_apart() {
    require_root!();
    let (a, b, base) = two_instances().await;
    let made_a = a.create("prod-x").await.expect("create on A");
    let made_b = b.create("x").await.expect("create on B");

    let attached_a = a
        .attach("sb-a", "prod-x", 0, &made_a.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach on A: {e:?}\n{}", a.logs()));
    let path_a = base.join("nfs+prod-x");
    assert_eq!(Path::new(&attached_a.host_path), path_a);
    std::fs::write(path_a.join("owner"), "A's data").unwrap();

    let attached_b = b
        .attach_in(&base, "sb-b", "x", 0, &made_b.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach on B: {e:?}\n{}", b.logs()));
    let path_b = base.join("nfs-prod+x");
    assert_eq!(Path::new(&attached_b.host_path), path_b);
    assert!(!path_b.join("owner").exists(), "B sees its own volume");
    std::fs::write(path_b.join("owner"), "B's data").unwrap();
    assert_eq!(
        std::fs::read_to_string(path_a.join("owner")).unwrap(),
        "A's data"
    );

    // B's Detach leaves A's mount and data; then A's leaves B's.
    b.detach("sb-b", "x", 0, &attached_b.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach on B: {e:?}\n{}", b.logs()));
    assert!(!is_mount_point(&path_b) && !path_b.exists());
    assert!(is_mount_point(&path_a), "B's Detach unmounted A's volume");
    assert_eq!(
        std::fs::read_to_string(path_a.join("owner")).unwrap(),
        "A's data"
    );
    let attached_b = b
        .attach_in(&base, "sb-b", "x", 0, &made_b.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach on B again: {e:?}\n{}", b.logs()));
    assert_eq!(
        std::fs::read_to_string(path_b.join("owner")).unwrap(),
        "B's data"
    );
    a.detach("sb-a", "prod-x", 0, &attached_a.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach on A: {e:?}\n{}", a.logs()));
    assert!(!is_mount_point(&path_a) && !path_a.exists());
    assert!(is_mount_point(&path_b), "A's Detach unmounted B's volume");
    assert_eq!(
        std::fs::read_to_string(path_b.join("owner")).unwrap(),
        "B's data"
    );
    b.detach("sb-b", "x", 0, &attached_b.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach on B: {e:?}\n{}", b.logs()));
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());
}

/// Whoever mounted on a volume's paths (another program, a bridge whose record is gone),
/// a first Attach never publishes onto it, and changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_instance_never_publishes_onto_a_path_someone_else_mounted() {
    require_root!();
    let (_a, b, base) = two_instances().await;
    let made_b = b.create("x").await.expect("create on B");
    let host_path = base.join("nfs-prod+x");
    std::fs::create_dir_all(&host_path).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "someone-else"])
        .arg(&host_path)
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::write(host_path.join("owner"), "theirs").unwrap();

    b.driver.clear_calls();
    let error = b
        .attach_in(&base, "sb-b", "x", 0, &made_b.private_data)
        .await
        .expect_err("B must not attach onto another mount");
    let unmounted = std::process::Command::new("umount")
        .arg(&host_path)
        .status()
        .unwrap();
    assert!(
        error.message.contains(&host_path.display().to_string())
            && error.message.contains("no record"),
        "names the path and why: {error:?}"
    );
    assert!(
        b.driver.mutating_calls().is_empty(),
        "no CSI call from B: {:?}",
        b.driver.mutating_calls()
    );
    assert_eq!(b.journal_records(), 0, "B recorded nothing");
    assert!(unmounted.success(), "the planted mount was still there");

    // Once that mount is gone, B's volume attaches there.
    let attached_b = b
        .attach_in(&base, "sb-b", "x", 0, &made_b.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach on B: {e:?}\n{}", b.logs()));
    assert_eq!(Path::new(&attached_b.host_path), host_path);
    assert!(!host_path.join("owner").exists(), "B sees its own volume");
    b.detach("sb-b", "x", 0, &attached_b.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach on B: {e:?}\n{}", b.logs()));
}

/// The upgrade: a volume a release before `+` attached (at `<base>/fake-old`, its record
/// and Cube's metadata naming that path) keeps its host_path for a hot Attach, Detaches
/// at it, and the next first Attach takes the new form. In rpc mode the daemon restarts
/// across the upgrade (its startup reconciliation sees the legacy record).
#[tokio::test(flavor = "multi_thread")]
async fn volumes_attached_before_the_upgrade_keep_their_host_path() {
    require_root!();
    if !cfg!(feature = "fault-injection") {
        common::skip(
            "attaching as the releases before did needs the fault-injection build: cargo \
             test --features fault-injection",
        );
        return;
    }
    for mode in MODES {
        let mut w = World::start(mode, Caps::staging(), "").await;
        let made = w.create("old").await.expect("create");
        let request =
            callers::attach_request("default", &w.base_dir, "sb-1", "old", 0, &made.private_data);
        let first = match mode {
            Mode::Rpc => {
                w.daemon.take().unwrap().kill().await.unwrap();
                w.start_daemon_with_env(&[(LEGACY_LEAF, "1")])
                    .await
                    .unwrap();
                let first = w.attach("sb-1", "old", 0, &made.private_data).await;
                w.daemon.take().unwrap().kill().await.unwrap();
                w.start_daemon().await.unwrap();
                first
            }
            Mode::Binary => {
                use callers::CubeCaller;
                w.binary_caller()
                    .with_env(LEGACY_LEAF, "1")
                    .attach(request)
                    .await
            }
        }
        .unwrap_or_else(|e| panic!("{mode:?}: legacy attach: {e:?}\n{}", w.logs()));
        let legacy = w.base_dir.join("fake-old");
        let legacy_staging = w.base_dir.join(".staging/fake-old");
        assert_eq!(Path::new(&first.host_path), legacy, "{mode:?}");
        assert_eq!(first.metadata["mount_dir"], legacy.display().to_string());
        std::fs::write(legacy.join("data"), "from before").unwrap();

        // Upgraded: another sandbox's Attach answers the path Cube already holds.
        w.driver.clear_calls();
        let hot = w
            .attach("sb-2", "old", 1, &made.private_data)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: hot attach: {e:?}\n{}", w.logs()));
        assert_eq!(hot.host_path, first.host_path, "{mode:?}");
        assert_eq!(hot.metadata, first.metadata, "{mode:?}");
        assert!(
            w.driver.mutating_calls().is_empty(),
            "{mode:?}: {:?}",
            w.driver.mutating_calls()
        );
        assert_eq!(
            std::fs::read_to_string(legacy.join("data")).unwrap(),
            "from before"
        );
        w.detach("sb-2", "old", 1, &hot.metadata)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: detach: {e:?}\n{}", w.logs()));
        assert!(is_mount_point(&legacy), "{mode:?}: sb-1 still holds it");
        w.detach("sb-1", "old", 0, &first.metadata)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: last detach: {e:?}\n{}", w.logs()));
        assert!(w.mounts().is_empty(), "{mode:?}: {:?}", w.mounts());
        assert!(!legacy.exists() && !legacy_staging.exists(), "{mode:?}");

        let again = w
            .attach("sb-3", "old", 0, &made.private_data)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: fresh attach: {e:?}\n{}", w.logs()));
        assert_eq!(Path::new(&again.host_path), w.base_dir.join("fake+old"));
        assert_eq!(
            std::fs::read_to_string(w.base_dir.join("fake+old/data")).unwrap(),
            "from before",
            "{mode:?}: the same volume"
        );
        w.detach("sb-3", "old", 0, &again.metadata)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: detach: {e:?}\n{}", w.logs()));
        assert!(w.mounts().is_empty(), "{mode:?}: {:?}", w.mounts());
    }
}
