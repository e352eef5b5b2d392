//! One operation per volume at a time, across the daemon and forked hook processes.
//!
//! An in-process async mutex per volume queues hooks of the same process without
//! blocking threads; a lock on one byte of `<lock_dir>/<scope>.volumes.lock` then excludes
//! other processes (forked binary hooks, a second daemon). The byte is the volume's: its
//! offset is the first 62 bits of the SHA-256 of the volume id, so different volumes
//! never wait for each other (two ids on one byte would only take turns, and finding such
//! a pair is as hard as a SHA-256 collision). The lock is an open file description lock
//! (`F_OFD_SETLK`): owned by one opening of the file, released when it is closed, or when
//! the process dies.
//!
//! One file per scope, made once, rather than one per volume: making a file is an inode
//! allocation on every Create and first Attach (about 1 ms on a busy ext4 without a
//! journal), and earlier builds never removed theirs, one per volume ever seen. Every
//! process on the lock dir must map ids to bytes the same way. A build that took a file
//! per volume (`<scope>-<volume_id>.lock`, `flock`) may still run through an upgrade (a
//! forked worker finishing, a daemon not yet restarted): when the lock dir holds such
//! files as this process opens it, the volume's file (if any) is locked too, after the
//! byte, so neither build acts on a volume the other works on. (A volume whose file an
//! old build makes only after this process opened is not covered: stop the old daemon
//! before the new one starts.) The lock dir must be root's alone (`check_private_dir`).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::fcntl::FcntlArg;
use nix::libc;
use sha2::{Digest, Sha256};
use tokio::sync::OwnedMutexGuard;

use super::fsutil::{check_private_dir, open_private};
use crate::bridge::ports::{LockGuard, LockScope, VolumeLocks};
use crate::bridge::{BridgeError, Deadline};

type LocalLocks = HashMap<(LockScope, String), Arc<tokio::sync::Mutex<()>>>;

/// The per-volume locks of one process, over a directory of lock files.
#[derive(Debug)]
pub struct FileLocks {
    dir: PathBuf,
    local: Mutex<LocalLocks>,
    /// The lock dir held files of an earlier build (one per volume) when this opened:
    /// only then is each volume's looked for (one `open` per lock), the old build
    /// possibly still running through an upgrade.
    legacy: bool,
}

/// Held while one hook works on one volume. Dropping it releases both locks (the byte
/// lock first, so a waiting process can go on).
#[derive(Debug)]
pub struct VolumeGuard {
    _byte: ByteLock,
    _local: OwnedMutexGuard<()>,
}

/// One byte of a scope's lock file, locked through an opening of its own: closing the
/// file (dropping this) releases it.
#[derive(Debug)]
struct ByteLock {
    _file: File,
    /// The per-volume file of an earlier build, when there is one, locked as it locked it.
    _legacy: Option<nix::fcntl::Flock<File>>,
}

/// The byte of a scope's lock file that stands for `volume_id`. Every process sharing a
/// lock dir must compute the same one (a test pins it).
fn byte_of(volume_id: &str) -> i64 {
    let digest = Sha256::digest(volume_id.as_bytes());
    let first = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
    // 62 bits: the byte and the one after it stay far below i64::MAX.
    (first >> 2) as i64
}

impl ByteLock {
    /// Locks the byte of `volume_id` in `path` (made 0600 when missing), and the volume's
    /// file of an earlier build (`legacy`) when it exists; `Ok(None)` when another opening
    /// holds either.
    fn take(
        path: &Path,
        legacy: Option<&Path>,
        volume_id: &str,
    ) -> Result<Option<ByteLock>, BridgeError> {
        let file = open_private(path).map_err(|e| lock_error(path, e))?;
        let range = libc::flock {
            l_type: libc::F_WRLCK as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: byte_of(volume_id),
            l_len: 1,
            // Zero, as open file description locks require.
            l_pid: 0,
        };
        match nix::fcntl::fcntl(&file, FcntlArg::F_OFD_SETLK(&range)) {
            Ok(_) => {}
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EACCES) => return Ok(None),
            Err(errno) => return Err(lock_error(path, errno.into())),
        }
        let Some(legacy) = legacy else {
            return Ok(Some(ByteLock {
                _file: file,
                _legacy: None,
            }));
        };
        // Never made here: only an earlier build's file counts.
        let old = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(legacy)
        {
            Ok(old) => old,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Some(ByteLock {
                    _file: file,
                    _legacy: None,
                }));
            }
            Err(e) => return Err(lock_error(legacy, e)),
        };
        match nix::fcntl::Flock::lock(old, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(locked) => Ok(Some(ByteLock {
                _file: file,
                _legacy: Some(locked),
            })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, errno)) => Err(lock_error(legacy, errno.into())),
        }
    }
}

/// The first pause between two tries of a byte another process holds, and the longest.
/// What another user who could write `state.lock_dir` could do: the risk
/// `check_private_dir` names when it refuses one.
pub const LOCK_DIR_RISK: &str = "hold every volume's lock (each hook then waits out its \
     deadline) or plant a file there for the bridge to open as root";

const LOCK_POLL_FIRST: std::time::Duration = std::time::Duration::from_millis(1);
const LOCK_POLL_MAX: std::time::Duration = std::time::Duration::from_millis(4);

impl FileLocks {
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        // Missing parents are made searchable (0755): the lock dir often shares one with
        // the socket (/run/cube-csi-bridge), which the socket's group must be able to reach.
        if let Some(parent) = dir.parent() {
            crate::mount::ops::ensure_dir(parent, 0o755)?;
        }
        crate::mount::ops::ensure_dir(dir, 0o700)?;
        check_private_dir(dir, "state.lock_dir", LOCK_DIR_RISK)?;
        // Names only an earlier build made (`<scope>-<volume_id>.lock`; this one's are
        // `<scope>.volumes.lock`).
        // A lock dir that cannot be listed keeps the probe on: safe, one open per lock.
        let legacy = std::fs::read_dir(dir).map_or(true, |entries| {
            entries.flatten().any(|entry| {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                name.ends_with(".lock")
                    && [LockScope::Node, LockScope::Controller]
                        .iter()
                        .any(|scope| name.starts_with(&format!("{}-", scope.as_str())))
            })
        });
        Ok(Self {
            dir: dir.to_path_buf(),
            local: Mutex::new(HashMap::new()),
            legacy,
        })
    }

    /// Takes the volume's lock if nobody holds it, without waiting.
    pub fn try_lock(
        &self,
        scope: LockScope,
        volume_id: &str,
    ) -> Result<Option<VolumeGuard>, BridgeError> {
        let Ok(local) = self.local_mutex(scope, volume_id).try_lock_owned() else {
            return Ok(None);
        };
        let path = self.path(scope);
        let legacy = self.legacy.then(|| self.legacy_path(scope, volume_id));
        let byte = ByteLock::take(&path, legacy.as_deref(), volume_id)?;
        Ok(byte.map(|byte| VolumeGuard {
            _byte: byte,
            _local: local,
        }))
    }

    fn local_mutex(&self, scope: LockScope, volume_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut local = self.local.lock().expect("lock table poisoned");
        if local.len() > 1024 {
            // Forget locks nobody holds or waits for.
            local.retain(|_, m| Arc::strong_count(m) > 1);
        }
        local
            .entry((scope, volume_id.to_string()))
            .or_default()
            .clone()
    }

    fn path(&self, scope: LockScope) -> PathBuf {
        self.dir.join(format!("{}.volumes.lock", scope.as_str()))
    }

    /// The file a build before one file per scope locked for `volume_id`.
    fn legacy_path(&self, scope: LockScope, volume_id: &str) -> PathBuf {
        self.dir
            .join(format!("{}-{volume_id}.lock", scope.as_str()))
    }

    /// Waits for the volume's lock until the deadline.
    pub async fn lock(
        &self,
        scope: LockScope,
        volume_id: &str,
        deadline: &Deadline,
    ) -> Result<VolumeGuard, BridgeError> {
        let mutex = self.local_mutex(scope, volume_id);
        let busy = || BridgeError::Busy {
            waited: deadline.elapsed(),
        };
        let local = tokio::time::timeout_at(deadline.instant().into(), mutex.lock_owned())
            .await
            .map_err(|_| busy())?;

        let path = self.path(scope);
        let legacy = self.legacy.then(|| self.legacy_path(scope, volume_id));
        // Tried again after a pause, never waited for in the kernel (F_OFD_SETLKW) on a
        // blocking thread: that thread would outlive the deadline for as long as the other
        // process holds the byte (a forked worker stuck on a hung mount holds it for
        // good), and enough of them would take the blocking pool that every disk wait of
        // the daemon needs.
        let mut pause = LOCK_POLL_FIRST;
        loop {
            if let Some(byte) = ByteLock::take(&path, legacy.as_deref(), volume_id)? {
                return Ok(VolumeGuard {
                    _byte: byte,
                    _local: local,
                });
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(busy());
            }
            if pause == LOCK_POLL_FIRST {
                tracing::debug!(
                    volume_id,
                    "waiting for another process working on this volume"
                );
            }
            tokio::time::sleep(pause.min(left)).await;
            pause = (pause * 2).min(LOCK_POLL_MAX);
        }
    }
}

fn lock_error(path: &Path, e: std::io::Error) -> BridgeError {
    BridgeError::io(format!("lock file {}", path.display()), e)
}

#[async_trait::async_trait]
impl VolumeLocks for FileLocks {
    fn try_acquire(
        &self,
        scope: LockScope,
        volume_id: &str,
    ) -> Result<Option<LockGuard>, BridgeError> {
        Ok(self
            .try_lock(scope, volume_id)?
            .map(|guard| Box::new(guard) as LockGuard))
    }

    async fn acquire(
        &self,
        scope: LockScope,
        volume_id: &str,
        deadline: &Deadline,
    ) -> Result<LockGuard, BridgeError> {
        Ok(Box::new(self.lock(scope, volume_id, deadline).await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// `byte_of("v")`: the first 62 bits of SHA-256("v").
    const BYTE_OF_V: i64 = 1_379_528_753_050_839_963;

    /// A volume an earlier build (one `flock`ed file per volume) works on, through an
    /// upgrade, is held for this one too, and one it holds is free once it lets go.
    /// Before, the two builds never excluded each other: a new start-up pass took a free
    /// byte and rolled back the old worker's Attach under it.
    #[tokio::test]
    async fn a_volume_an_earlier_build_holds_is_held() {
        let tmp = tempfile::tempdir().unwrap();
        // The old build's file is there when this build opens the lock dir.
        let old = std::fs::File::create(tmp.path().join("node-v.lock")).unwrap();
        let locks = FileLocks::new(tmp.path()).unwrap();
        let held =
            nix::fcntl::Flock::lock(old, nix::fcntl::FlockArg::LockExclusiveNonblock).unwrap();
        assert!(locks.try_lock(LockScope::Node, "v").unwrap().is_none());
        let deadline = Deadline::after(Duration::from_millis(20));
        assert!(matches!(
            locks.lock(LockScope::Node, "v", &deadline).await,
            Err(BridgeError::Busy { .. })
        ));
        // Other volumes, and the other scope, are not held.
        assert!(locks.try_lock(LockScope::Node, "w").unwrap().is_some());
        assert!(
            locks
                .try_lock(LockScope::Controller, "v")
                .unwrap()
                .is_some()
        );
        drop(held);
        let guard = locks.try_lock(LockScope::Node, "v").unwrap().unwrap();
        // And the earlier build finds it held while this one works on it.
        let again = std::fs::File::open(tmp.path().join("node-v.lock")).unwrap();
        assert!(
            nix::fcntl::Flock::lock(again, nix::fcntl::FlockArg::LockExclusiveNonblock).is_err()
        );
        drop(guard);
    }

    #[test]
    fn the_lock_dir_is_private_but_its_new_parents_stay_searchable() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        // As on a bare host: /run/cube-csi-bridge holds both the socket and <driver>/locks.
        let run = tmp.path().join("run");
        FileLocks::new(&run.join("drv").join("locks")).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&run.join("drv").join("locks")), 0o700);
        // The socket's group must be able to reach a socket in `run` (umask 022 here).
        assert_eq!(mode(&run) & 0o055, 0o055, "mode {:o}", mode(&run));
    }

    /// Waiting for a byte another process holds takes no thread: waits that time out
    /// leave nothing behind. Before, each waited in the kernel on a blocking thread that
    /// outlived its deadline for as long as the byte was held; two such waits took this
    /// runtime's two blocking threads, and its next disk wait never ran.
    #[test]
    fn waits_that_time_out_leave_no_thread_behind() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let tmp = tempfile::tempdir().unwrap();
        // Another process's opening of the lock file.
        let holder = FileLocks::new(tmp.path()).unwrap();
        let _held = holder.try_lock(LockScope::Node, "v").unwrap().unwrap();
        let waiter = FileLocks::new(tmp.path()).unwrap();
        runtime.block_on(async {
            for _ in 0..3 {
                let deadline = Deadline::after(Duration::from_millis(30));
                let error = waiter
                    .lock(LockScope::Node, "v", &deadline)
                    .await
                    .unwrap_err();
                assert!(matches!(error, BridgeError::Busy { .. }), "{error}");
            }
            tokio::time::timeout(Duration::from_secs(5), tokio::task::spawn_blocking(|| ()))
                .await
                .expect("no blocking thread was free")
                .unwrap();
        });
        runtime.shutdown_background();
    }

    #[tokio::test]
    async fn same_volume_waits_other_volumes_do_not() {
        let tmp = tempfile::tempdir().unwrap();
        let locks = Arc::new(FileLocks::new(tmp.path()).unwrap());
        let deadline = Deadline::after(Duration::from_secs(5));
        let held = locks
            .acquire(LockScope::Node, "a", &deadline)
            .await
            .unwrap();
        // Another volume, and the other scope of the same volume, are free.
        let _b = locks
            .acquire(LockScope::Node, "b", &deadline)
            .await
            .unwrap();
        let _c = locks
            .acquire(LockScope::Controller, "a", &deadline)
            .await
            .unwrap();
        let short = Deadline::after(Duration::from_millis(100));
        let err = locks
            .acquire(LockScope::Node, "a", &short)
            .await
            .unwrap_err();
        assert!(matches!(err, BridgeError::Busy { .. }), "{err}");
        drop(held);
        locks
            .acquire(LockScope::Node, "a", &deadline)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn another_process_waits_for_the_same_volume_only() {
        // A second lock table stands in for another process: its openings of the scope
        // file are its own, so only the byte of the same volume conflicts.
        let tmp = tempfile::tempdir().unwrap();
        let (one, two) = (
            FileLocks::new(tmp.path()).unwrap(),
            FileLocks::new(tmp.path()).unwrap(),
        );
        let _held = one.try_lock(LockScope::Node, "v").unwrap().unwrap();
        assert!(two.try_lock(LockScope::Node, "v").unwrap().is_none());
        assert!(two.try_lock(LockScope::Node, "w").unwrap().is_some());
        assert!(two.try_lock(LockScope::Controller, "v").unwrap().is_some());
    }

    #[tokio::test]
    async fn no_file_is_made_or_left_per_volume() {
        let tmp = tempfile::tempdir().unwrap();
        let locks = FileLocks::new(tmp.path()).unwrap();
        let deadline = Deadline::after(Duration::from_secs(5));
        for i in 0..100 {
            let id = format!("vol-{i}");
            drop(
                locks
                    .acquire(LockScope::Node, &id, &deadline)
                    .await
                    .unwrap(),
            );
            drop(
                locks
                    .try_acquire(LockScope::Controller, &id)
                    .unwrap()
                    .unwrap(),
            );
        }
        let mut names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["controller.volumes.lock", "node.volumes.lock"]);
    }

    #[test]
    fn a_volume_keeps_its_byte_across_builds() {
        // Processes of one lock dir must agree on this mapping: a change here lets a
        // daemon and a hook of different builds work on one volume at once.
        assert_eq!(byte_of("v"), BYTE_OF_V);
        assert!((0..1 << 62).contains(&byte_of("v")));
        assert_ne!(byte_of("v"), byte_of("w"));
    }

    #[test]
    fn a_lock_dir_another_user_could_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = FileLocks::new(&open).unwrap_err().to_string();
        assert!(
            err.contains("writable by its group or by others (mode 777)")
                && err.contains("state.lock_dir"),
            "{err}"
        );
        // Below a directory others may write (and rename in, without the sticky bit).
        let below = open.join("locks");
        let err = FileLocks::new(&below).unwrap_err().to_string();
        assert!(err.contains("above state.lock_dir"), "{err}");
        // The same directory kept by its owner alone is fine, and so is one below /tmp's
        // kind (writable by all, sticky).
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        FileLocks::new(&below).unwrap();
        if nix::unistd::geteuid().is_root() {
            // Owned by another user: refused even when only that user may write it.
            let theirs = tmp.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
            nix::unistd::chown(&theirs, Some(1000.into()), Some(1000.into())).unwrap();
            let err = FileLocks::new(&theirs).unwrap_err().to_string();
            assert!(err.contains("is owned by uid 1000"), "{err}");
            // Root's own directory, reached through a symlink in a sticky directory: the
            // link's owner could rename another link over it after the check.
            let ours = tmp.path().join("ours");
            std::fs::create_dir(&ours).unwrap();
            std::fs::set_permissions(&ours, std::fs::Permissions::from_mode(0o700)).unwrap();
            let link = open.join("locks-link");
            std::os::unix::fs::symlink(&ours, &link).unwrap();
            FileLocks::new(&link).unwrap();
            nix::unistd::fchownat(
                nix::fcntl::AT_FDCWD,
                &link,
                Some(1000.into()),
                Some(1000.into()),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .unwrap();
            let err = FileLocks::new(&link).unwrap_err().to_string();
            assert!(
                err.contains("goes through the symlink") && err.contains("owned by uid 1000"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_symlink_at_a_lock_file_is_never_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let locks = FileLocks::new(&tmp.path().join("locks")).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, tmp.path().join("locks/node.volumes.lock")).unwrap();
        let err = locks
            .try_lock(LockScope::Node, "v")
            .unwrap_err()
            .to_string();
        assert!(err.contains("node.volumes.lock"), "{err}");
        assert!(!elsewhere.exists(), "a file was made through the link");
    }

    #[tokio::test]
    async fn file_lock_excludes_a_second_lock_table() {
        // A second VolumeLocks on the same dir stands in for another process.
        let tmp = tempfile::tempdir().unwrap();
        let one = FileLocks::new(tmp.path()).unwrap();
        let two = FileLocks::new(tmp.path()).unwrap();
        let deadline = Deadline::after(Duration::from_secs(5));
        let held = one.acquire(LockScope::Node, "v", &deadline).await.unwrap();
        let short = Deadline::after(Duration::from_millis(150));
        assert!(two.acquire(LockScope::Node, "v", &short).await.is_err());
        let waiter = tokio::spawn(async move {
            two.acquire(
                LockScope::Node,
                "v",
                &Deadline::after(Duration::from_secs(5)),
            )
            .await
            .map(|_| ())
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(held);
        waiter.await.unwrap().unwrap();
    }
}
