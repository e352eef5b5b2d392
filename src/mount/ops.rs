//! Mount syscalls and directory hygiene.
//!
//! The bridge itself never mounts: the CSI driver does. These are used by the demo's
//! built-in driver, by test fakes, and for the directories the bridge creates and removes
//! around the driver's calls. Each call is synchronous: run it on a blocking thread.

use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};

fn with_path(op: &str, path: &Path, err: impl Into<io::Error>) -> io::Error {
    let err: io::Error = err.into();
    io::Error::new(err.kind(), format!("{op} {}: {err}", path.display()))
}

/// Bind-mounts `source` onto `target` (both must exist); `read_only` adds the second
/// remount step that makes the bind read-only (mount(2) ignores MS_RDONLY on the first).
pub fn bind_mount(source: &Path, target: &Path, read_only: bool) -> io::Result<()> {
    nix::mount::mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| with_path("bind mount onto", target, e))?;
    if read_only {
        let remount = nix::mount::mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        );
        if let Err(e) = remount {
            let _ = unmount(target);
            return Err(with_path("read-only remount of", target, e));
        }
    }
    Ok(())
}

/// Unmounts `target`; a target that is not mounted (or does not exist) is success.
pub fn unmount(target: &Path) -> io::Result<()> {
    match nix::mount::umount2(target, MntFlags::UMOUNT_NOFOLLOW) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(with_path("unmount", target, e)),
    }
}

/// Detaches `target` lazily (for cleanup paths that must not block).
pub fn unmount_lazy(target: &Path) -> io::Result<()> {
    match nix::mount::umount2(target, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(with_path("lazy unmount", target, e)),
    }
}

/// Creates `dir` and its missing parents with `mode` (existing ones are left alone).
pub fn ensure_dir(dir: &Path, mode: u32) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
        .map_err(|e| with_path("create directory", dir, e))
}

/// Creates `dir` (parents must exist) with exactly `mode`, whatever the umask.
pub fn create_dir_exact(dir: &Path, mode: u32) -> io::Result<()> {
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
            .map_err(|e| with_path("chmod", dir, e)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(with_path("create directory", dir, e)),
    }
}

/// Removes `dir` if it exists and is empty. A missing or non-empty directory is left as
/// it is and reported as `Ok(false)`: data is never deleted here.
pub fn remove_dir_if_empty(dir: &Path) -> io::Result<bool> {
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc_enotempty()) => Ok(false),
        Err(e) => Err(with_path("remove directory", dir, e)),
    }
}

fn libc_enotempty() -> i32 {
    Errno::ENOTEMPTY as i32
}
