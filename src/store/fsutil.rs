//! Crash-safe file replacement and exclusive file locks.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

/// Replaces `path` with `bytes` atomically: write a temp file beside it, rename over.
/// With `durable` (the syncer of `path`'s directory), the data and the rename are on disk
/// before returning, so the new content survives a power loss.
pub fn write_atomic(path: &Path, bytes: &[u8], durable: Option<&DirSync>) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other(format!("{} has no parent", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("state"),
        std::process::id()
    ));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(bytes)?;
        if durable.is_some() {
            // The data and the size; the rename below is made durable by the directory's
            // sync.
            file.sync_data()?;
        }
        drop(file);
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        // A write cut short by a full disk must not leave its temporary file (and the
        // pages it took) behind for every later write to trip over.
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(dir_sync) = durable {
        dir_sync.sync()?;
    }
    Ok(())
}

/// Group commit of one directory's entries: threads that need their renames on disk at
/// the same time share one fsync of the directory instead of each paying for their own.
#[derive(Debug)]
pub struct DirSync {
    dir: PathBuf,
    group: GroupCommit,
}

impl DirSync {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            group: GroupCommit::default(),
        }
    }

    /// Returns once an fsync of the directory that started after this call has finished.
    pub fn sync(&self) -> io::Result<()> {
        self.group
            .sync(|| File::open(&self.dir).and_then(|d| d.sync_all()))
    }
}

/// Group commit: callers that need the same flush (an fsync of one file or directory) at
/// the same time share one. A caller's writes happened before it asked; it returns once
/// a flush that *started* after it asked has finished, so that flush covers its writes.
/// While one flush runs, every caller that arrives waits for it to end and then one of
/// them runs the next flush for all of them: n callers at once cost about two flushes.
#[derive(Debug, Default)]
pub struct GroupCommit {
    state: Mutex<CommitState>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct CommitState {
    /// Tickets handed out: each caller's writes happened before it took its ticket.
    issued: u64,
    /// Every ticket up to this one is covered by a completed flush.
    synced: u64,
    /// A flush is running (started after every ticket up to the one it covers).
    running: bool,
    /// Flushes run so far (each one by the leader of a group).
    flushes: u64,
    /// Flushes that failed so far, and how the last one did: a caller whose writes came
    /// before a failure may have had them dropped by the kernel, and no later flush
    /// writes them.
    failures: u64,
    last_failure: Option<(io::ErrorKind, String)>,
}

impl GroupCommit {
    /// `sync_since`, for writes made before this call.
    pub fn sync(&self, flush: impl Fn() -> io::Result<()>) -> io::Result<()> {
        self.sync_since(self.mark(), flush)
    }

    /// What `sync_since` is given: taken before the writes a flush must cover.
    pub fn mark(&self) -> u64 {
        self.state.lock().expect("group commit poisoned").failures
    }

    /// Returns once a `flush` that started after this call has succeeded; runs `flush`
    /// itself when it is the one to lead the next group. Fails when any flush failed
    /// since `mark` was taken (before the caller's writes), not only when this caller's
    /// own did: the kernel reports a failed writeback once and drops the pages it could
    /// not write, so a later flush succeeds without those writes. Callers whose writes
    /// come after go on.
    pub fn sync_since(&self, mark: u64, flush: impl Fn() -> io::Result<()>) -> io::Result<()> {
        let mut state = self.state.lock().expect("group commit poisoned");
        state.issued += 1;
        let ticket = state.issued;
        loop {
            if state.failures != mark {
                let (kind, message) = state
                    .last_failure
                    .clone()
                    .unwrap_or((io::ErrorKind::Other, "unknown".into()));
                return Err(io::Error::new(
                    kind,
                    format!("a flush made after this write failed: {message}"),
                ));
            }
            if state.synced >= ticket {
                return Ok(());
            }
            if !state.running {
                // Lead: one flush for every ticket issued so far.
                state.running = true;
                let covers = state.issued;
                drop(state);
                let result = flush();
                state = self.state.lock().expect("group commit poisoned");
                state.running = false;
                state.flushes += 1;
                match &result {
                    Ok(()) => state.synced = state.synced.max(covers),
                    Err(e) => {
                        state.failures += 1;
                        state.last_failure = Some((e.kind(), e.to_string()));
                    }
                }
                self.done.notify_all();
                result?;
                continue;
            }
            state = self.done.wait(state).expect("group commit poisoned");
        }
    }

    /// (callers so far, flushes run so far).
    pub fn counts(&self) -> (u64, u64) {
        let state = self.state.lock().expect("group commit poisoned");
        (state.issued, state.flushes)
    }
}

/// Opens `path` for reading and writing, keeping what it holds, or creates it 0600: a
/// lock file, or a log the caller appends to itself. Never through a symlink at `path`:
/// these files live in the bridge's own directories, where a link is no file of the
/// bridge's and must not lead a root process to open or create one elsewhere.
pub fn open_private(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// Refuses a directory of the bridge's own (`field` names it in the config) that anyone
/// but root or the bridge's user could write to, or replace through a directory above it,
/// saying what such a user could then do (`risk`). A directory above that others may
/// write is allowed with the sticky bit (as /tmp), when root or the bridge's user owns
/// it. A directory not made yet is judged by the ones above it: whoever could make it
/// first could own it.
pub fn check_private_dir(dir: &Path, field: &str, risk: &str) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let euid = nix::unistd::geteuid().as_raw();
    let trusted = |uid: u32| uid == 0 || uid == euid;
    let refuse = |what: String| {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{what}, so another user could {risk}; point {field} at a directory only \
                 root can write (or chown root and chmod go-w it)"
            ),
        )
    };
    let written = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let real = match std::fs::canonicalize(dir) {
        Ok(real) => Some(real),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    if let Some(real) = &real {
        let meta = std::fs::metadata(real)?;
        if !trusted(meta.uid()) {
            return Err(refuse(format!(
                "{field} {} is owned by uid {}",
                real.display(),
                meta.uid()
            )));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(refuse(format!(
                "{field} {} is writable by its group or by others (mode {:o})",
                real.display(),
                meta.mode() & 0o7777
            )));
        }
    }
    let paths = std::iter::once(written.as_path()).chain(real.as_deref());
    if let Some(replaceable) = crate::config::untrusted_on_the_way(paths, euid, false) {
        return Err(refuse(
            replaceable.describe(&format!("{field} {}", dir.display())),
        ));
    }
    Ok(())
}

/// Opens (creating it 0600) and exclusively flocks `path`, waiting while another holder
/// has it, but giving up with `ErrorKind::TimedOut` after `wait`, so that a holder that
/// hangs cannot hang every caller behind it. The lock is released when the returned guard
/// drops, or when the process dies.
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

/// Opens (creating it 0600) and exclusively flocks `path`; `Ok(None)` at once when another
/// holder has it.
pub fn try_lock_exclusive(path: &Path) -> io::Result<Option<Flock<File>>> {
    let file = open_private(path)?;
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
    fn concurrent_durable_writes_share_directory_syncs_and_all_land() {
        let tmp = tempfile::tempdir().unwrap();
        let sync = std::sync::Arc::new(DirSync::new(tmp.path()));
        let threads: Vec<_> = (0..16)
            .map(|i| {
                let (sync, dir) = (sync.clone(), tmp.path().to_path_buf());
                std::thread::spawn(move || {
                    let path = dir.join(format!("r{i}"));
                    write_atomic(&path, format!("{i}").as_bytes(), Some(&sync)).unwrap();
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        for i in 0..16 {
            let text = std::fs::read_to_string(tmp.path().join(format!("r{i}"))).unwrap();
            assert_eq!(text, i.to_string());
        }
        let state = sync.group.state.lock().unwrap();
        assert_eq!((state.issued, state.synced, state.running), (16, 16, false));
    }

    /// Callers that arrive while a flush runs share the next one: eleven callers, the
    /// first held inside its flush until the ten others wait, cost two flushes; and a
    /// caller never returns on a flush that started before it asked.
    #[test]
    fn callers_waiting_during_a_flush_share_the_next_one() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering};
        let group = Arc::new(GroupCommit::default());
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = Arc::new(Mutex::new(held));
        let started = Arc::new(AtomicU64::new(0));
        let flush = {
            let (held, started) = (held.clone(), started.clone());
            move || {
                // The first flush waits until the test lets it go.
                if started.fetch_add(1, Ordering::SeqCst) == 0 {
                    held.lock().unwrap().recv().unwrap();
                }
                Ok(())
            }
        };
        let first = {
            let (group, flush) = (group.clone(), flush.clone());
            std::thread::spawn(move || group.sync(flush).unwrap())
        };
        while started.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let others: Vec<_> = (0..10)
            .map(|_| {
                let (group, flush) = (group.clone(), flush.clone());
                std::thread::spawn(move || group.sync(flush).unwrap())
            })
            .collect();
        while group.counts().0 < 11 {
            std::thread::yield_now();
        }
        release.send(()).unwrap();
        first.join().unwrap();
        others.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(group.counts(), (11, 2));
    }

    #[test]
    fn a_failed_flush_fails_its_leader_and_the_next_caller_flushes_again() {
        let group = GroupCommit::default();
        let error = group
            .sync(|| Err(io::Error::other("disk gone")))
            .unwrap_err();
        assert_eq!(error.to_string(), "disk gone");
        group.sync(|| Ok(())).unwrap();
        assert_eq!(group.counts(), (2, 2));
    }

    /// A flush that fails fails every caller that was waiting for it, its leader or not:
    /// two callers arrive while a first flush runs, the flush their group then shares
    /// fails (EIO), and neither may return as if durable on the flush after it, which
    /// succeeds without what the kernel dropped. Before, the one that did not lead it
    /// flushed again and returned Ok. A caller that comes after goes on.
    #[test]
    fn a_failed_flush_fails_every_caller_it_was_to_cover() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering};
        let group = Arc::new(GroupCommit::default());
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = Arc::new(Mutex::new(held));
        let started = Arc::new(AtomicU64::new(0));
        let flush = {
            let (held, started) = (held.clone(), started.clone());
            move || match started.fetch_add(1, Ordering::SeqCst) {
                0 => {
                    held.lock().unwrap().recv().unwrap();
                    Ok(())
                }
                1 => Err(io::Error::from_raw_os_error(nix::libc::EIO)),
                _ => Ok(()),
            }
        };
        let first = {
            let (group, flush) = (group.clone(), flush.clone());
            std::thread::spawn(move || group.sync(flush))
        };
        while started.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let (group, flush) = (group.clone(), flush.clone());
                std::thread::spawn(move || group.sync(flush))
            })
            .collect();
        while group.counts().0 < 3 {
            std::thread::yield_now();
        }
        release.send(()).unwrap();
        first.join().unwrap().unwrap();
        for caller in waiting {
            let error = caller.join().unwrap().unwrap_err();
            let eio = io::Error::from_raw_os_error(nix::libc::EIO);
            assert_eq!(error.kind(), eio.kind());
            assert!(error.to_string().contains(&eio.to_string()), "{error}");
        }
        group.sync(flush).unwrap();
    }

    /// A write made before a flush failed is not reported durable by a later flush that
    /// succeeds, even when the caller asks only after the failure: the kernel dropped the
    /// pages it could not write. Before, a caller whose write came before another's failed
    /// flush, but whose call came after it, led a new flush and got Ok.
    #[test]
    fn a_write_made_before_a_failed_flush_is_never_reported_durable() {
        let group = GroupCommit::default();
        let mark = group.mark();
        // ... this caller writes; another caller's flush fails meanwhile ...
        group
            .sync(|| Err(io::Error::from_raw_os_error(nix::libc::EIO)))
            .unwrap_err();
        assert!(group.sync_since(mark, || Ok(())).is_err());
        // A write made after the failure is flushed as usual.
        let later = group.mark();
        group.sync_since(later, || Ok(())).unwrap();
    }

    /// A write that fails on a full file system leaves the old content and no temporary
    /// file (which would hold on to its pages); needs root for a small tmpfs (CI runs it).
    #[test]
    fn a_failed_write_on_a_full_disk_leaves_no_temporary_file() {
        if !crate::testing::as_root("mount a small tmpfs") {
            return;
        }
        crate::testing::on_small_tmpfs("size=64k", |fs| {
            let path = fs.join("record");
            write_atomic(&path, b"old", None).unwrap();
            let mut fill = File::create(fs.join("filler")).unwrap();
            while fill.write_all(&[0u8; 4096]).is_ok() {}
            drop(fill);
            let error = write_atomic(&path, &[b'n'; 8192], None).unwrap_err();
            assert_eq!(error.raw_os_error(), Some(28), "{error}");
            assert_eq!(std::fs::read(&path).unwrap(), b"old");
            let names: Vec<_> = std::fs::read_dir(fs)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(names.len(), 2, "{names:?}");
        });
    }

    #[test]
    fn a_held_lock_times_out_then_is_taken_once_free() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("l.lock");
        let held = try_lock_exclusive(&path).unwrap().unwrap();
        let err = lock_exclusive_within(&path, Duration::from_millis(30)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        drop(held);
        lock_exclusive_within(&path, Duration::from_millis(30)).unwrap();
    }
}
