//! Crash-safe file replacement and exclusive file locks.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

/// Replaces `path` with `bytes` atomically: write a temp file beside it, rename over.
/// With `durable`, the data and the rename are fsync'ed before returning, so the new
/// content survives a crash or power loss.
pub fn write_atomic(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other(format!("{} has no parent", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("state"),
        std::process::id()
    ));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(bytes)?;
    if durable {
        // The data and the size; the rename below is made durable by the directory's sync.
        file.sync_data()?;
    }
    drop(file);
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if durable {
        sync_dir(dir)?;
    }
    Ok(())
}

/// Makes a directory's entries (creations, renames, removals) durable.
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Opens (creating it 0600) and exclusively flocks `path`, blocking until it is free.
/// The lock is released when the returned guard drops, or when the process dies.
pub fn lock_exclusive(path: &Path) -> io::Result<Flock<File>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, errno)| io::Error::from(errno))
}

/// Like `lock_exclusive`, but gives up with `ErrorKind::TimedOut` after `wait`, so that a
/// holder that hangs cannot hang every caller behind it.
pub fn lock_exclusive_within(path: &Path, wait: Duration) -> io::Result<Flock<File>> {
    let until = Instant::now() + wait;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(lock) = try_lock_exclusive(path)? {
            return Ok(lock);
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{} stayed locked for {wait:?}", path.display()),
            ));
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Like `lock_exclusive`, but returns `Ok(None)` at once when another holder has it.
pub fn try_lock_exclusive(path: &Path) -> io::Result<Option<Flock<File>>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, errno)) => Err(io::Error::from(errno)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_times_out_then_is_taken_once_free() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("l.lock");
        let held = lock_exclusive(&path).unwrap();
        let err = lock_exclusive_within(&path, Duration::from_millis(30)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        drop(held);
        lock_exclusive_within(&path, Duration::from_millis(30)).unwrap();
    }
}
