//! One operation per volume at a time, across the daemon and forked hook processes.
//!
//! An in-process async mutex per volume queues hooks of the same process without
//! blocking threads; an flock on `<lock_dir>/<scope>-<volume_id>.lock` then excludes other
//! processes (forked binary hooks, a second daemon). Different volumes never wait for
//! each other. A process that dies releases its flock with it.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::fcntl::Flock;
use tokio::sync::OwnedMutexGuard;

use super::fsutil::{lock_exclusive, try_lock_exclusive};
use crate::bridge::ports::{LockGuard, LockScope, VolumeLocks};
use crate::bridge::{BridgeError, Deadline};

type LocalLocks = HashMap<(LockScope, String), Arc<tokio::sync::Mutex<()>>>;

/// The per-volume locks of one process, over a directory of lock files.
#[derive(Debug)]
pub struct FileLocks {
    dir: PathBuf,
    local: Mutex<LocalLocks>,
}

/// Held while one hook works on one volume. Dropping it releases both locks (the file
/// lock first, so a waiting process can go on).
#[derive(Debug)]
pub struct VolumeGuard {
    _file: Flock<File>,
    _local: OwnedMutexGuard<()>,
}

impl FileLocks {
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        // Missing parents are made searchable (0755): the lock dir often shares one with
        // the socket (/run/cube-csi-bridge), which the socket's group must be able to reach.
        if let Some(parent) = dir.parent() {
            crate::mount::ops::ensure_dir(parent, 0o755)?;
        }
        crate::mount::ops::ensure_dir(dir, 0o700)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            local: Mutex::new(HashMap::new()),
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
        let path = self.path(scope, volume_id);
        let file = try_lock_exclusive(&path)
            .map_err(|e| BridgeError::io(format!("lock file {}", path.display()), e))?;
        Ok(file.map(|file| VolumeGuard {
            _file: file,
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

    fn path(&self, scope: LockScope, volume_id: &str) -> PathBuf {
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

        let path = self.path(scope, volume_id);
        let io_err = |e| BridgeError::io(format!("lock file {}", path.display()), e);
        if let Some(file) = try_lock_exclusive(&path).map_err(io_err)? {
            return Ok(VolumeGuard {
                _file: file,
                _local: local,
            });
        }
        tracing::debug!(
            volume_id,
            "waiting for another process working on this volume"
        );
        let blocking_path = path.clone();
        let wait = tokio::task::spawn_blocking(move || lock_exclusive(&blocking_path));
        // If the deadline passes first, the blocking thread still gets the lock later and
        // drops it at once, since nobody takes its result.
        match tokio::time::timeout_at(deadline.instant().into(), wait).await {
            Ok(Ok(Ok(file))) => Ok(VolumeGuard {
                _file: file,
                _local: local,
            }),
            Ok(Ok(Err(e))) => Err(io_err(e)),
            Ok(Err(join)) => Err(BridgeError::io(
                format!("lock file {}", path.display()),
                std::io::Error::other(join.to_string()),
            )),
            Err(_) => Err(busy()),
        }
    }
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
