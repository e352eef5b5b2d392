//! What the unit tests share: the guard of the tests that need root, and a small tmpfs for
//! the full-disk cases.

use std::path::Path;

/// Whether a test that needs root (to `what`) may go on. Off root it says why it skips; CI
/// runs as root, so there a skip fails instead.
pub(crate) fn as_root(what: &str) -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    assert!(
        std::env::var("CI").is_err(),
        "CI runs as root: this test must not skip"
    );
    eprintln!("skipped: needs root to {what}");
    false
}

/// Runs `test` on a tmpfs mounted with `options` (e.g. `size=64k`) in a temporary
/// directory, and detaches it whatever the test does. Needs root (`as_root` first).
pub(crate) fn on_small_tmpfs(options: &str, test: impl FnOnce(&Path) + std::panic::UnwindSafe) {
    let tmp = tempfile::tempdir().unwrap();
    let fs = tmp.path().join("fs");
    std::fs::create_dir(&fs).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        &fs,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some(options),
    )
    .unwrap();
    let outcome = std::panic::catch_unwind(|| test(&fs));
    nix::mount::umount2(&fs, nix::mount::MntFlags::MNT_DETACH).unwrap();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}
