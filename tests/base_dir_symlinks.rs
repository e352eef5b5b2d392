//! Symlinks under a volume base dir another user can write (issue 18, finding 1). A
//! non-root Cubelet makes the base dir, so its user could plant a symlink at a host_path or
//! swap `.staging` for one, and the bridge, as root, mounted onto, unmounted and removed
//! whatever the link led to. Now the bridge refuses a base dir that is not owned by root
//! (or its own euid) or that group or others can write, walks below it without following
//! symlinks, and refuses, naming the path and its owner, anything there it did not make,
//! before any CSI call, unmount or rmdir that would use it.
//!
//! The attacker is uid 65534: the test chowns the base dir to it and, as root, plants the
//! symlinks it could then plant (owned by it, as its own would be). Needs root (real
//! mounts); skips without it, except in CI.

mod common;

use std::os::unix::fs::{PermissionsExt, chown, lchown, symlink};
use std::path::{Path, PathBuf};

use common::callers::CubeError;
use common::fake_driver::Caps;
use common::{Mode, World};
use cube_csi_bridge::mount::{MountTable, ops};

/// The attacker's uid (nobody).
const NOBODY: u32 = 65534;

fn is_mount_point(path: &Path) -> bool {
    MountTable::read(None).unwrap().is_mount_point(path)
}

/// A root-owned 0755 base dir, made before the bridge would make it.
fn make_base(w: &World) -> PathBuf {
    std::fs::create_dir_all(&w.base_dir).unwrap();
    std::fs::set_permissions(&w.base_dir, PermissionsExt::from_mode(0o755)).unwrap();
    w.base_dir.clone()
}

/// A root-only directory holding a file: what a planted symlink leads to.
fn root_only_dir(w: &World, name: &str) -> PathBuf {
    let dir = w.dir.path().join(name);
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("secret"), "root's").unwrap();
    std::fs::set_permissions(&dir, PermissionsExt::from_mode(0o700)).unwrap();
    dir
}

/// A symlink at `link` to `to`, owned by the attacker as one it made would be.
fn plant(to: &Path, link: &Path) {
    symlink(to, link).unwrap();
    lchown(link, Some(NOBODY), Some(NOBODY)).unwrap();
}

fn pending(w: &World) -> usize {
    std::fs::read_dir(w.dir.path().join("state/node/pending")).map_or(0, |d| d.count())
}

/// The hook's error names `path` and each of `words`, and (rpc) is FAILED_PRECONDITION.
fn assert_names(error: &CubeError, path: &Path, words: &[&str]) {
    assert!(
        error
            .message
            .contains(&format!("refusing {}:", path.display()))
            && words.iter().all(|w| error.message.contains(w)),
        "the error names {} and {words:?}: {error:?}",
        path.display()
    );
    if let Some(code) = error.code {
        assert_eq!(code, tonic::Code::FailedPrecondition, "{error:?}");
    }
}

/// Nothing was called, recorded or mounted for a refused Attach.
fn assert_unchanged(w: &World, victim: &Path) {
    assert!(
        w.driver.mutating_calls().is_empty(),
        "no CSI call: {:?}",
        w.driver.mutating_calls()
    );
    assert!(!is_mount_point(victim), "{} overmounted", victim.display());
    assert_eq!(w.journal_records(), 0, "nothing recorded");
    assert_eq!(pending(w), 0, "nothing pending");
    assert!(w.mounts().is_empty(), "{:?}", w.mounts());
}

/// Attack 1: `<base>/<driver>-<id>` planted as a symlink to a root-only directory. The
/// bridge used to publish onto the link's target, fail the mount check, and leave the
/// volume pending for good (rollback's rmdir met ENOTDIR).
#[tokio::test(flavor = "multi_thread")]
async fn a_host_path_planted_as_a_symlink_is_never_published_onto() {
    require_root!();
    let w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let made = w.create("v1").await.expect("create");
    let base = make_base(&w);
    let root_only = root_only_dir(&w, "root-only");
    let host_path = base.join("fake+v1");
    plant(&root_only, &host_path);
    w.driver.clear_calls();

    // While the attacker owns the base dir, the base dir itself is refused.
    chown(&base, Some(NOBODY), Some(NOBODY)).unwrap();
    let error = w
        .attach("sb", "v1", 0, &made.private_data)
        .await
        .expect_err("a base dir uid 65534 owns is refused");
    assert_names(
        &error,
        &base,
        &["owned by uid 65534", "owner uid 65534, mode 0755"],
    );
    assert_unchanged(&w, &root_only);

    // Given back to root with the link still there: the link is refused.
    chown(&base, Some(0), Some(0)).unwrap();
    let error = w
        .attach("sb", "v1", 0, &made.private_data)
        .await
        .expect_err("a symlinked host_path is refused");
    assert_names(
        &error,
        &host_path,
        &[
            &format!("is a symlink (to {root_only:?})"),
            "owner uid 65534",
        ],
    );
    assert_unchanged(&w, &root_only);
    assert_eq!(
        std::fs::read_link(&host_path).unwrap(),
        root_only,
        "the link is left as it was"
    );

    // Once it is removed, the volume attaches and detaches cleanly.
    std::fs::remove_file(&host_path).unwrap();
    let attached = w
        .attach("sb", "v1", 0, &made.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", w.logs()));
    w.detach("sb", "v1", 0, &attached.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach: {e:?}\n{}", w.logs()));
    assert!(w.mounts().is_empty(), "{:?}", w.mounts());
}

/// Attack 2: `<base>/.staging` a symlink to the attacker's directory, whose
/// `<driver>-<id>` leads to a root-owned directory. The Attach used to succeed with that
/// directory overmounted by NodeStage until Detach.
#[tokio::test(flavor = "multi_thread")]
async fn a_staging_dir_planted_as_a_symlink_overmounts_nothing() {
    require_root!();
    let w = World::start(Mode::Binary, Caps::staging(), "").await;
    let made = w.create("v2").await.expect("create");
    let base = make_base(&w);
    let root_owned = root_only_dir(&w, "root-owned");
    let attacker = w.dir.path().join("attacker");
    std::fs::create_dir(&attacker).unwrap();
    chown(&attacker, Some(NOBODY), Some(NOBODY)).unwrap();
    plant(&root_owned, &attacker.join("fake+v2"));
    let dot_staging = base.join(".staging");
    plant(&attacker, &dot_staging);
    w.driver.clear_calls();

    chown(&base, Some(NOBODY), Some(NOBODY)).unwrap();
    let error = w
        .attach("sb", "v2", 0, &made.private_data)
        .await
        .expect_err("a base dir uid 65534 owns is refused");
    assert_names(&error, &base, &["owner uid 65534, mode 0755"]);
    assert_unchanged(&w, &root_owned);

    chown(&base, Some(0), Some(0)).unwrap();
    let error = w
        .attach("sb", "v2", 0, &made.private_data)
        .await
        .expect_err("a symlinked .staging is refused");
    assert_names(
        &error,
        &dot_staging,
        &[
            &format!("is a symlink (to {attacker:?})"),
            "owner uid 65534",
        ],
    );
    assert_unchanged(&w, &root_owned);

    std::fs::remove_file(&dot_staging).unwrap();
    let attached = w
        .attach("sb", "v2", 0, &made.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", w.logs()));
    assert!(!is_mount_point(&root_owned));
    w.detach("sb", "v2", 0, &attached.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach: {e:?}\n{}", w.logs()));
    assert!(w.mounts().is_empty(), "{:?}", w.mounts());
}

/// Attack 3: the same swap after a normal Attach, with `.staging` now leading to a
/// directory whose `<driver>-<id>` is someone else's mount point. Detach's NodeUnstage used
/// to unmount that mount, leak the real staging mount, and every later Detach failed with
/// "Not a directory". Now Detach refuses, naming the path, unmounts nothing of the
/// attacker's choosing, and finishes once the path is repaired.
#[tokio::test(flavor = "multi_thread")]
async fn a_staging_dir_swapped_after_attach_is_never_unstaged_through() {
    require_root!();
    let w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let made = w.create("v3").await.expect("create");
    let base = make_base(&w);
    let attached = w
        .attach("sb", "v3", 0, &made.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", w.logs()));
    let dot_staging = base.join(".staging");
    let staging = dot_staging.join("fake+v3");
    assert!(is_mount_point(&staging), "staged");

    // Someone else's mount, at a path whose leaf has the volume's name.
    let victim_source = root_only_dir(&w, "victim-source");
    let victim_parent = w.dir.path().join("victim");
    let victim = victim_parent.join("fake+v3");
    std::fs::create_dir_all(&victim).unwrap();
    ops::bind_mount(&victim_source, &victim, false).unwrap();

    // The swap, as the user who can write the base dir: .staging moved aside (a
    // directory holding a mount point can be renamed) and a symlink in its place.
    chown(&base, Some(NOBODY), Some(NOBODY)).unwrap();
    let moved = base.join(".staging-moved");
    std::fs::rename(&dot_staging, &moved).unwrap();
    plant(&victim_parent, &dot_staging);
    assert!(is_mount_point(&moved.join("fake+v3")));

    w.driver.clear_calls();
    let error = w
        .detach("sb", "v3", 0, &attached.metadata)
        .await
        .expect_err("a base dir uid 65534 owns is refused");
    assert_names(&error, &base, &["owner uid 65534, mode 0755"]);
    assert!(
        w.driver.mutating_calls().is_empty(),
        "{:?}",
        w.driver.mutating_calls()
    );
    assert!(is_mount_point(&victim), "the other mount is untouched");

    chown(&base, Some(0), Some(0)).unwrap();
    for _ in 0..2 {
        // The same clear refusal on every retry, not "Not a directory".
        let error = w
            .detach("sb", "v3", 0, &attached.metadata)
            .await
            .expect_err("a symlinked .staging is refused");
        assert_names(
            &error,
            &dot_staging,
            &[
                &format!("is a symlink (to {victim_parent:?})"),
                "owner uid 65534",
            ],
        );
    }
    assert!(
        !w.driver.mutating_calls().contains(&"NodeUnstageVolume"),
        "{:?}",
        w.driver.mutating_calls()
    );
    assert!(is_mount_point(&victim), "the other mount is untouched");
    assert!(
        is_mount_point(&moved.join("fake+v3")),
        "the real staging mount is kept"
    );
    assert_eq!(
        pending(&w),
        1,
        "the volume stays pending until it can be finished"
    );

    // Repaired: the next Detach unstages the real staging mount and leaves nothing.
    std::fs::remove_file(&dot_staging).unwrap();
    std::fs::rename(&moved, &dot_staging).unwrap();
    w.detach("sb", "v3", 0, &attached.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach after repair: {e:?}\n{}", w.logs()));
    assert!(!is_mount_point(&staging));
    assert_eq!(
        w.mounts(),
        vec![victim.clone()],
        "only the other mount is left"
    );
    assert_eq!(w.journal_records(), 0);
    assert_eq!(pending(&w), 0);
    ops::unmount(&victim).unwrap();
}

/// A base dir others can write (mode 0777) or another uid owns is refused before anything
/// else, with a message naming the path, its owner and its mode; fixed, it is used.
#[tokio::test(flavor = "multi_thread")]
async fn a_base_dir_others_can_write_or_another_uid_owns_is_refused() {
    require_root!();
    for mode in [Mode::Rpc, Mode::Binary] {
        let w = World::start(mode, Caps::staging(), "").await;
        let made = w.create("v4").await.expect("create");
        let base = make_base(&w);
        w.driver.clear_calls();

        std::fs::set_permissions(&base, PermissionsExt::from_mode(0o777)).unwrap();
        let error = w
            .attach("sb", "v4", 0, &made.private_data)
            .await
            .expect_err("a 0777 base dir is refused");
        assert_names(
            &error,
            &base,
            &["writable by group or others", "owner uid 0, mode 0777"],
        );
        assert_unchanged(&w, &base);

        std::fs::set_permissions(&base, PermissionsExt::from_mode(0o755)).unwrap();
        chown(&base, Some(1000), Some(1000)).unwrap();
        let error = w
            .attach("sb", "v4", 0, &made.private_data)
            .await
            .expect_err("a base dir uid 1000 owns is refused");
        assert_names(
            &error,
            &base,
            &["owned by uid 1000, not root", "owner uid 1000, mode 0755"],
        );
        assert_unchanged(&w, &base);
        assert!(
            std::fs::read_dir(&base).unwrap().next().is_none(),
            "nothing made in a refused base dir ({mode:?})"
        );

        chown(&base, Some(0), Some(0)).unwrap();
        let attached = w
            .attach("sb", "v4", 0, &made.private_data)
            .await
            .unwrap_or_else(|e| panic!("attach ({mode:?}): {e:?}\n{}", w.logs()));
        w.detach("sb", "v4", 0, &attached.metadata)
            .await
            .unwrap_or_else(|e| panic!("detach ({mode:?}): {e:?}\n{}", w.logs()));
        assert!(w.mounts().is_empty(), "{:?}", w.mounts());
    }
}

/// `node.allow_untrusted_base_dir` (a non-root Cubelet owns its base dir): a base dir
/// another uid owns is accepted, the reason is logged, and what lies below it is still
/// checked (a planted symlink leaf is refused).
#[tokio::test(flavor = "multi_thread")]
async fn an_operator_may_accept_a_base_dir_another_uid_owns_with_a_reason() {
    require_root!();
    let reason = "cubelet runs as uid 1000 and owns its base dir";
    let extra = format!("[node]\nallow_untrusted_base_dir = \"{reason}\"\n");
    let w = World::start_with_config(Mode::Rpc, Caps::staging(), "", move |text| {
        text.replacen("[node]\n", &extra, 1)
    })
    .await;
    let made = w.create("v5").await.expect("create");
    let base = make_base(&w);
    chown(&base, Some(1000), Some(1000)).unwrap();
    let attached = w
        .attach("sb", "v5", 0, &made.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", w.logs()));
    assert!(
        w.logs().contains(reason),
        "the reason is logged:\n{}",
        w.logs()
    );
    w.detach("sb", "v5", 0, &attached.metadata)
        .await
        .unwrap_or_else(|e| panic!("detach: {e:?}\n{}", w.logs()));

    let target = w.dir.path().join("root-only");
    std::fs::create_dir(&target).unwrap();
    std::os::unix::fs::symlink(&target, base.join(format!("{}+v5", common::DRIVER))).unwrap();
    let made = w.create("v5").await.expect("create again");
    let error = w
        .attach("sb", "v5", 0, &made.private_data)
        .await
        .expect_err("a symlinked leaf is refused all the same");
    assert!(error.message.contains("symlink"), "{error:?}");
    assert!(w.mounts().is_empty(), "{:?}", w.mounts());
}
