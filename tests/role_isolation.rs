//! One `serve` with both roles: a side that cannot open does not take the other down.
//! A truncated controller store used to make the daemon refuse to start, so Cubelet's
//! Attach and Detach failed too although they never touch that store (issue 19, item 7).
//! Now the node role serves, the controller role answers UNAVAILABLE with the store's
//! error, and `probe --ready` names the role that is down.
//!
//! Needs root (real mounts); skips without it, except in CI.

mod common;

use common::fake_driver::Caps;
use common::{BRIDGE, Mode, World};

/// Runs `cube-csi-bridge probe` (with `extra` flags) against `w`'s daemon.
fn probe(w: &World, extra: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(BRIDGE)
        .arg("probe")
        .args(extra)
        .arg("--config")
        .arg(&w.config_path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_controller_store_leaves_attach_and_detach_serving() {
    require_root!();
    // A volume created while the store was sound (a forked controller hook). No sweep:
    // the forked hook's worker would otherwise open the store after answering, racing
    // the damage below (and redb rewrites what it opens).
    let mut w = World::start(
        Mode::Binary,
        Caps::staging(),
        "[controller]\nsweep_interval_secs = 0\n",
    )
    .await;
    let created = w.create("v1").await.expect("create before the damage");
    let store = w.dir.path().join("state/controller.redb");
    assert!(store.is_file(), "the embedded store is {}", store.display());
    // The store is damaged (a torn write, a full disk, a bad restore).
    std::fs::write(&store, b"not a redb file").unwrap();

    w.mode = Mode::Rpc;
    w.start_daemon()
        .await
        .expect("the daemon starts with its node role although the controller store is broken");

    // Cubelet's hooks work: a real mount, then a clean teardown.
    let attached = w
        .attach("sb-1", "v1", 0, &created.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", w.logs()));
    assert_eq!(
        w.mounts().len(),
        2,
        "staged and published: {:?}",
        w.mounts()
    );
    w.detach("sb-1", "v1", 0, &attached.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach: {e:?}\n{}", w.logs()));
    assert!(w.mounts().is_empty(), "{:?}", w.mounts());
    assert_eq!(w.journal_records(), 0);

    // CubeMaster's hooks answer UNAVAILABLE with the store's error, and change nothing.
    let calls_before = w.driver.mutating_calls().len();
    for error in [
        w.create("v2").await.unwrap_err(),
        w.destroy("v1").await.unwrap_err(),
    ] {
        assert_eq!(error.code, Some(tonic::Code::Unavailable), "{error:?}");
        assert!(
            error.message.contains(&store.display().to_string()),
            "names the store: {error:?}"
        );
    }
    assert_eq!(w.driver.mutating_calls().len(), calls_before, "no CSI call");

    // Alive, but not ready, naming the role that is down.
    let (code, line) = probe(&w, &[]);
    assert_eq!(code, 0, "{line}");
    let (code, line) = probe(&w, &["--ready"]);
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("controller role is down"), "{line}");
    assert!(!line.contains("node role"), "{line}");
    let logs = w.logs();
    assert!(
        logs.contains("this role cannot serve") && logs.contains("controller"),
        "{logs}"
    );

    // The store is fixed (here: removed, so a fresh one is made; on a full disk, space
    // freed): the role serves at Cube's next hooks, without a restart. Before, it
    // answered UNAVAILABLE with the start-up error until someone restarted the daemon.
    std::fs::remove_file(&store).unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let created = loop {
        match w.create("v3").await {
            Ok(created) => break created,
            Err(error) => {
                assert_eq!(error.code, Some(tonic::Code::Unavailable), "{error:?}");
                assert!(
                    std::time::Instant::now() < until,
                    "the controller role did not come back: {error:?}\n{}",
                    w.logs()
                );
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
    };
    w.destroy("v3").await.expect("destroy");
    assert!(!created.private_data.is_empty());
    assert!(w.logs().contains("opened now"), "{}", w.logs());
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (code, line) = probe(&w, &["--ready"]);
        if code == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "never ready again: {line}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// A daemon none of whose served roles can open still refuses to start, as before.
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_whose_only_role_cannot_open_refuses_to_start() {
    require_root!();
    let mut w = World::start_with_config(Mode::Binary, Caps::staging(), "", |text| {
        text.replacen("[serve]\n", "[serve]\nservices = \"controller\"\n", 1)
    })
    .await;
    let store = w.dir.path().join("state/controller.redb");
    std::fs::create_dir_all(store.parent().unwrap()).unwrap();
    std::fs::write(&store, b"not a redb file").unwrap();
    w.mode = Mode::Rpc;
    let error = w.start_daemon().await.unwrap_err();
    assert!(
        error.contains("exited with exit status: 78") && error.contains("controller"),
        "{error}"
    );
}
