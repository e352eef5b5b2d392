//! Two bridge instances on one host whose host paths collide (issue 18, item 5): driver
//! `nfs` with volume `prod-x` and driver `nfs-prod` with volume `x` both map to
//! `<base>/nfs-prod-x` (and `<base>/.staging/nfs-prod-x`). With a driver that takes an
//! existing mount as success, as csi-driver-nfs does, the second instance's Attach used to
//! answer with the first one's data, and its Detach unmounted it. Now a first Attach whose
//! paths are already mount points no record of this instance accounts for is refused
//! before any CSI call, and the first instance's volume is untouched.
//!
//! Needs root (real mounts); skips without it, except in CI.

mod common;

use common::fake_driver::Caps;
use common::{Mode, World};

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_never_publishes_onto_a_path_another_instance_mounted() {
    require_root!();
    // Instance A: driver "nfs", through the daemon.
    let a = World::start_with_config(Mode::Rpc, Caps::staging(), "", |text| {
        text.replacen("driver = \"fake\"", "driver = \"nfs\"", 1)
    })
    .await;
    let base = a.base_dir.clone();
    // Instance B: driver "nfs-prod", forked, told to use A's base dir.
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

    let made_a = a.create("prod-x").await.expect("create on A");
    let attached_a = a
        .attach("sb-a", "prod-x", 0, &made_a.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach on A: {e:?}\n{}", a.logs()));
    let host_path = base.join("nfs-prod-x");
    assert_eq!(std::path::Path::new(&attached_a.host_path), host_path);
    std::fs::write(host_path.join("owner"), "A's data").unwrap();

    let made_b = b.create("x").await.expect("create on B");
    b.driver.clear_calls();
    let error = b
        .attach_in(&base, "sb-b", "x", 0, &made_b.private_data)
        .await
        .expect_err("B must not attach onto A's mount");
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
    // A's volume is untouched: still mounted, still A's data, A detaches cleanly.
    assert!(
        cube_csi_bridge::mount::MountTable::read(None)
            .unwrap()
            .is_mount_point(&host_path)
    );
    assert_eq!(
        std::fs::read_to_string(host_path.join("owner")).unwrap(),
        "A's data"
    );
    assert_eq!(b.journal_records(), 0, "B recorded nothing");
    a.detach("sb-a", "prod-x", 0, &attached_a.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach on A: {e:?}\n{}", a.logs()));
    assert!(a.mounts().is_empty(), "{:?}", a.mounts());

    // Once A's mount is gone, B's volume attaches there (the paths are B's to use now).
    let attached_b = b
        .attach_in(&base, "sb-b", "x", 0, &made_b.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach on B: {e:?}\n{}", b.logs()));
    assert!(!host_path.join("owner").exists(), "B sees its own volume");
    b.detach("sb-b", "x", 0, &attached_b.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach on B: {e:?}\n{}", b.logs()));
}
