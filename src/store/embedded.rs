//! The embedded controller store: one redb file on the controller host.
//!
//! redb allows one open handle per file, and the binary hook forks a process per call, so
//! every operation takes an exclusive flock on a side lock file (waiting at most
//! `LOCK_WAIT`), opens the database, does one transaction and closes it again.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

use super::fsutil::{Turnstile, lock_exclusive_within};
use crate::bridge::ports::{ControllerStore, SnapshotStore, StoreError};
use crate::bridge::records::{SnapshotRecord, VolumeRecord};

/// Version of the records and tables in the file; recorded in the `meta` table.
pub const STORE_FORMAT: u64 = 1;

const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
/// Snapshot records by snapshot name (made on the first snapshot: a file without it has
/// none). Their revisions come from the same store-wide counter.
const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const FORMAT_KEY: &str = "format";
/// The last revision handed out, store-wide: a record deleted and created again never
/// gets a revision a copy read before the delete could hold.
const REVISION_KEY: &str = "revision";

/// How long an operation waits for another process's transaction on the file.
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// One redb file, shared safely by any number of processes.
#[derive(Debug)]
pub struct EmbeddedStore {
    path: PathBuf,
    lock_path: PathBuf,
    /// This process's callers queue here before the file lock (see `Turnstile`).
    turnstile: Turnstile,
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store at `path` and checks its format.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let store = Self {
            path: path.to_path_buf(),
            lock_path: path.with_extension("lock"),
            turnstile: Turnstile::default(),
        };
        if let Some(dir) = path.parent() {
            crate::mount::ops::ensure_dir(dir, 0o700).map_err(|e| store.err(e))?;
        }
        store.with_db(|_| Ok(()))?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Backend {
            store: self.path.display().to_string(),
            action: "redb".into(),
            transient: false,
            source: e.to_string().into(),
        }
    }

    /// Runs `f` with the database open and exclusively locked against other processes.
    fn with_db<T>(
        &self,
        f: impl FnOnce(&redb::Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let until = std::time::Instant::now() + LOCK_WAIT;
        let _pass = self
            .turnstile
            .enter_within(LOCK_WAIT)
            .map_err(|e| StoreError::Backend {
                store: self.path.display().to_string(),
                action: format!(
                    "waiting for this process's other use of {}",
                    self.path.display()
                ),
                transient: true,
                source: e.into(),
            })?;
        let left = until.saturating_duration_since(std::time::Instant::now());
        let _lock =
            lock_exclusive_within(&self.lock_path, left).map_err(|e| StoreError::Backend {
                store: self.path.display().to_string(),
                action: format!("locking {}", self.lock_path.display()),
                transient: e.kind() == std::io::ErrorKind::TimedOut,
                source: e.into(),
            })?;
        // redb panics on some damaged files (an invalid page type, a truncated region)
        // instead of answering an error: a damaged store must fail its own calls, not
        // the process that also serves Attach and Detach.
        let work = std::panic::AssertUnwindSafe(|| {
            let db = redb::Database::create(&self.path).map_err(|e| self.err(e))?;
            self.check_format(&db)?;
            f(&db)
        });
        std::panic::catch_unwind(work).unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("redb panicked");
            Err(StoreError::Corrupt {
                store: self.path.display().to_string(),
                what: "the database file".into(),
                message: format!("{message}; restore it from a backup"),
            })
        })
    }

    fn check_format(&self, db: &redb::Database) -> Result<(), StoreError> {
        // A read transaction answers for every file but a new one: no write, no sync.
        let stored = {
            let txn = db.begin_read().map_err(|e| self.err(e))?;
            match txn.open_table(META) {
                Ok(meta) => meta
                    .get(FORMAT_KEY)
                    .map_err(|e| self.err(e))?
                    .map(|v| v.value()),
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(self.err(e)),
            }
        };
        if stored == Some(STORE_FORMAT) {
            return Ok(());
        }
        let txn = db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            let found = meta
                .get(FORMAT_KEY)
                .map_err(|e| self.err(e))?
                .map(|v| v.value());
            match found {
                Some(STORE_FORMAT) => return Ok(()),
                Some(found) => {
                    return Err(StoreError::Corrupt {
                        store: self.path.display().to_string(),
                        what: "format".into(),
                        message: format!(
                            "the file has format {found}; this build reads format {STORE_FORMAT}"
                        ),
                    });
                }
                None => {
                    meta.insert(FORMAT_KEY, STORE_FORMAT)
                        .map_err(|e| self.err(e))?;
                    txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
                }
            }
        }
        txn.commit().map_err(|e| self.err(e))
    }

    /// Reads a stored record; records written before revisions existed are at "0".
    fn decode(&self, bytes: &[u8]) -> Result<VolumeRecord, StoreError> {
        let mut record: VolumeRecord =
            serde_json::from_slice(bytes).map_err(|e| self.err(format!("corrupt record: {e}")))?;
        record.revision.get_or_insert_with(|| "0".into());
        Ok(record)
    }

    fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read().map_err(|e| self.err(e))?;
            let table = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
            match table.get(volume_id).map_err(|e| self.err(e))? {
                Some(v) => self.decode(v.value()).map(Some),
                None => Ok(None),
            }
        })
    }

    /// The stored revision of `volume_id` inside a write transaction.
    fn stored_revision(
        &self,
        table: &redb::Table<&str, &[u8]>,
        volume_id: &str,
    ) -> Result<Option<String>, StoreError> {
        let stored = table.get(volume_id).map_err(|e| self.err(e))?;
        stored
            .map(|v| {
                self.decode(v.value())
                    .map(|r| r.revision.unwrap_or_default())
            })
            .transpose()
    }

    /// The last revision handed out. A file from before the store-wide counter counted
    /// per record: start above every revision its records hold.
    fn last_revision(
        &self,
        meta: &redb::Table<&str, u64>,
        table: &redb::Table<&str, &[u8]>,
    ) -> Result<u64, StoreError> {
        if let Some(last) = meta.get(REVISION_KEY).map_err(|e| self.err(e))? {
            return Ok(last.value());
        }
        let mut highest = 0;
        for entry in table.iter().map_err(|e| self.err(e))? {
            let (_, v) = entry.map_err(|e| self.err(e))?;
            let revision = self.decode(v.value())?.revision.unwrap_or_default();
            highest = highest.max(revision.parse::<u64>().unwrap_or(0));
        }
        Ok(highest)
    }

    /// Writes `record` if the stored revision is `record.revision`; returns the new one.
    fn put(&self, record: &VolumeRecord) -> Result<String, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write().map_err(|e| self.err(e))?;
            let revision = {
                let mut table = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
                let stored = self.stored_revision(&table, &record.volume_id)?;
                if stored != record.revision {
                    return Err(StoreError::Conflict {
                        volume_id: record.volume_id.clone(),
                    });
                }
                let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
                let next = self.last_revision(&meta, &table)? + 1;
                meta.insert(REVISION_KEY, next).map_err(|e| self.err(e))?;
                let mut copy = record.clone();
                copy.revision = Some(next.to_string());
                let bytes = serde_json::to_vec(&copy).map_err(|e| self.err(e))?;
                table
                    .insert(record.volume_id.as_str(), bytes.as_slice())
                    .map_err(|e| self.err(e))?;
                next.to_string()
            };
            txn.commit().map_err(|e| self.err(e))?;
            Ok(revision)
        })
    }

    /// Deletes the record if it is still at `record.revision` (any revision when None).
    fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write().map_err(|e| self.err(e))?;
            {
                let mut table = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
                let stored = self.stored_revision(&table, &record.volume_id)?;
                match (&stored, &record.revision) {
                    (None, _) => return Ok(()),
                    (Some(s), Some(r)) if s != r => {
                        return Err(StoreError::Conflict {
                            volume_id: record.volume_id.clone(),
                        });
                    }
                    _ => {}
                }
                // Keep the revision being deleted counted (it matters only for a file
                // from before the counter, where it would otherwise be forgotten).
                let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
                let last = self.last_revision(&meta, &table)?;
                meta.insert(REVISION_KEY, last).map_err(|e| self.err(e))?;
                table
                    .remove(record.volume_id.as_str())
                    .map_err(|e| self.err(e))?;
            }
            txn.commit().map_err(|e| self.err(e))
        })
    }

    fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read().map_err(|e| self.err(e))?;
            let table = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
            let mut out = Vec::new();
            for entry in table.iter().map_err(|e| self.err(e))? {
                let (k, v) = entry.map_err(|e| self.err(e))?;
                // One unreadable record must not stop the sweep and the signing pass for
                // every other volume: it is reported and left out.
                match self.decode(v.value()) {
                    Ok(record) => out.push(record),
                    Err(error) => tracing::warn!(
                        volume_id = k.value(),
                        %error,
                        "leaving an unreadable record out of the list"
                    ),
                }
            }
            Ok(out)
        })
    }
}

/// Snapshot records, in their own table of the same file.
impl EmbeddedStore {
    fn decode_snapshot(&self, bytes: &[u8]) -> Result<SnapshotRecord, StoreError> {
        let mut record: SnapshotRecord = serde_json::from_slice(bytes)
            .map_err(|e| self.err(format!("corrupt snapshot record: {e}")))?;
        record.revision.get_or_insert_with(|| "0".into());
        Ok(record)
    }

    fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read().map_err(|e| self.err(e))?;
            let table = match txn.open_table(SNAPSHOTS) {
                Ok(table) => table,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(self.err(e)),
            };
            match table.get(snapshot_id).map_err(|e| self.err(e))? {
                Some(v) => self.decode_snapshot(v.value()).map(Some),
                None => Ok(None),
            }
        })
    }

    /// The revision the snapshot is stored at, inside a write transaction.
    fn stored_snapshot_revision(
        &self,
        table: &redb::Table<&str, &[u8]>,
        snapshot_id: &str,
    ) -> Result<Option<String>, StoreError> {
        let stored = table.get(snapshot_id).map_err(|e| self.err(e))?;
        stored
            .map(|v| {
                self.decode_snapshot(v.value())
                    .map(|r| r.revision.unwrap_or_default())
            })
            .transpose()
    }

    fn put_snapshot(&self, record: &SnapshotRecord) -> Result<String, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write().map_err(|e| self.err(e))?;
            let revision = {
                let mut table = txn.open_table(SNAPSHOTS).map_err(|e| self.err(e))?;
                let stored = self.stored_snapshot_revision(&table, &record.snapshot_id)?;
                if stored != record.revision {
                    return Err(StoreError::Conflict {
                        volume_id: record.snapshot_id.clone(),
                    });
                }
                let volumes = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
                let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
                let next = self.last_revision(&meta, &volumes)? + 1;
                meta.insert(REVISION_KEY, next).map_err(|e| self.err(e))?;
                let mut copy = record.clone();
                copy.revision = Some(next.to_string());
                let bytes = serde_json::to_vec(&copy).map_err(|e| self.err(e))?;
                table
                    .insert(record.snapshot_id.as_str(), bytes.as_slice())
                    .map_err(|e| self.err(e))?;
                next.to_string()
            };
            txn.commit().map_err(|e| self.err(e))?;
            Ok(revision)
        })
    }

    fn delete_snapshot(&self, record: &SnapshotRecord) -> Result<(), StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write().map_err(|e| self.err(e))?;
            {
                let mut table = txn.open_table(SNAPSHOTS).map_err(|e| self.err(e))?;
                let stored = self.stored_snapshot_revision(&table, &record.snapshot_id)?;
                match (&stored, &record.revision) {
                    (None, _) => return Ok(()),
                    (Some(s), Some(r)) if s != r => {
                        return Err(StoreError::Conflict {
                            volume_id: record.snapshot_id.clone(),
                        });
                    }
                    _ => {}
                }
                table
                    .remove(record.snapshot_id.as_str())
                    .map_err(|e| self.err(e))?;
            }
            txn.commit().map_err(|e| self.err(e))
        })
    }

    fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read().map_err(|e| self.err(e))?;
            let table = match txn.open_table(SNAPSHOTS) {
                Ok(table) => table,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(self.err(e)),
            };
            let mut out = Vec::new();
            for entry in table.iter().map_err(|e| self.err(e))? {
                let (k, v) = entry.map_err(|e| self.err(e))?;
                match self.decode_snapshot(v.value()) {
                    Ok(record) => out.push(record),
                    Err(error) => tracing::warn!(
                        snapshot_id = k.value(),
                        %error,
                        "leaving an unreadable snapshot record out of the list"
                    ),
                }
            }
            Ok(out)
        })
    }
}

#[async_trait]
impl SnapshotStore for Arc<EmbeddedStore> {
    async fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotRecord>, StoreError> {
        let (s, id) = (self.clone(), snapshot_id.to_string());
        blocking(move || EmbeddedStore::get_snapshot(&s, &id)).await
    }

    async fn put_snapshot(&self, record: &mut SnapshotRecord) -> Result<(), StoreError> {
        let (s, copy) = (self.clone(), record.clone());
        record.revision = Some(blocking(move || EmbeddedStore::put_snapshot(&s, &copy)).await?);
        Ok(())
    }

    async fn delete_snapshot(&self, record: &SnapshotRecord) -> Result<(), StoreError> {
        let (s, copy) = (self.clone(), record.clone());
        blocking(move || EmbeddedStore::delete_snapshot(&s, &copy)).await
    }

    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError> {
        let s = self.clone();
        blocking(move || EmbeddedStore::list_snapshots(&s)).await
    }

    fn locate_snapshot(&self, snapshot_id: &str) -> String {
        format!(
            "the record of snapshot {snapshot_id:?} in {}",
            self.path.display()
        )
    }
}

/// The async face of the store: each operation on a blocking thread.
#[async_trait]
impl ControllerStore for Arc<EmbeddedStore> {
    async fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        let (s, id) = (self.clone(), volume_id.to_string());
        blocking(move || EmbeddedStore::get(&s, &id)).await
    }

    async fn put(&self, record: &mut VolumeRecord) -> Result<(), StoreError> {
        let (s, copy) = (self.clone(), record.clone());
        record.revision = Some(blocking(move || EmbeddedStore::put(&s, &copy)).await?);
        Ok(())
    }

    async fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        let (s, copy) = (self.clone(), record.clone());
        blocking(move || EmbeddedStore::delete(&s, &copy)).await
    }

    async fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        let s = self.clone();
        blocking(move || EmbeddedStore::list(&s)).await
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::records::VolumeState;
    use crate::system::now_secs;
    use std::collections::BTreeMap;

    fn record(id: &str) -> VolumeRecord {
        VolumeRecord {
            volume_id: id.into(),
            csi_name: format!("cube-{id}"),
            state: VolumeState::Created,
            csi_volume_id: Some(format!("h-{id}")),
            volume_context: BTreeMap::from([("k".into(), "v".into())]),
            capacity_bytes: 0,
            updated_at: now_secs(),
            csi_driver: None,
            deletion: None,
            revision: None,
            integrity: None,
            content_source: None,
            accessible_topology: Vec::new(),
            node_expansion_required: false,
        }
    }

    fn snapshot(id: &str) -> SnapshotRecord {
        SnapshotRecord {
            snapshot_id: id.into(),
            csi_name: format!("cube-snap-{id}"),
            csi_driver: "d".into(),
            source_volume_id: "v".into(),
            source_csi_volume_id: "h-v".into(),
            state: VolumeState::Creating,
            csi_snapshot_id: None,
            size_bytes: 0,
            creation_time: 0,
            ready_to_use: false,
            updated_at: now_secs(),
            revision: None,
            integrity: None,
        }
    }

    /// Snapshots keep their own records beside the volumes', with the same revisions
    /// (a file from before snapshots simply has none), and a volume of the same name is
    /// another record.
    #[tokio::test]
    async fn snapshot_records_round_trip_beside_volumes_and_conflict_like_them() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap());
        assert!(store.list_snapshots().await.unwrap().is_empty());
        assert!(store.get_snapshot("s").await.unwrap().is_none());
        let mut volume = record("s");
        ControllerStore::put(&store, &mut volume).await.unwrap();
        let mut snap = snapshot("s");
        store.put_snapshot(&mut snap).await.unwrap();
        assert_ne!(snap.revision, volume.revision, "one store-wide counter");
        let stale = snap.clone();
        snap.state = VolumeState::Created;
        snap.csi_snapshot_id = Some("cs".into());
        store.put_snapshot(&mut snap).await.unwrap();
        let mut lost = stale.clone();
        assert!(matches!(
            store.put_snapshot(&mut lost).await,
            Err(StoreError::Conflict { .. })
        ));
        assert!(matches!(
            store.delete_snapshot(&stale).await,
            Err(StoreError::Conflict { .. })
        ));
        // A new handle on the same file (another process) reads what was written.
        let again = Arc::new(EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap());
        assert_eq!(again.get_snapshot("s").await.unwrap(), Some(snap.clone()));
        assert_eq!(again.list_snapshots().await.unwrap(), vec![snap.clone()]);
        assert_eq!(ControllerStore::list(&again).await.unwrap().len(), 1);
        again.delete_snapshot(&snap).await.unwrap();
        again.delete_snapshot(&snap).await.unwrap();
        assert!(store.get_snapshot("s").await.unwrap().is_none());
        assert!(ControllerStore::get(&store, "s").await.unwrap().is_some());
    }

    /// A damaged file is an error of the store's calls, never a panic of the process:
    /// redb panics on some damage (here every page past the header zeroed: "Invalid page
    /// type byte 0"), and a panic took the whole daemon down.
    #[test]
    fn a_damaged_file_is_an_error_not_a_panic() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("controller.redb");
        std::fs::write(&path, b"not a redb file").unwrap();
        let error = EmbeddedStore::open(&path).unwrap_err().to_string();
        assert!(error.contains(&path.display().to_string()), "{error}");

        let path = tmp.path().join("zeroed.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        store.put(&record("v1")).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096..].fill(0);
        std::fs::write(&path, bytes).unwrap();
        let outcome =
            std::panic::catch_unwind(|| EmbeddedStore::open(&path).and_then(|store| store.list()));
        let error = outcome
            .expect("the store's own call, not the caller, meets redb's panic")
            .unwrap_err()
            .to_string();
        assert!(error.contains(&path.display().to_string()), "{error}");
    }

    #[test]
    fn crud_round_trip_and_reopen() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s/controller.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        assert_eq!(store.get("a").unwrap(), None);
        assert_eq!(store.put(&record("a")).unwrap(), "1");
        store.put(&record("b")).unwrap();
        let got = store.get("a").unwrap().unwrap();
        assert_eq!(got.csi_volume_id.as_deref(), Some("h-a"));
        assert_eq!(got.state, VolumeState::Created);
        assert_eq!(got.revision.as_deref(), Some("1"));
        drop(store);
        let store = EmbeddedStore::open(&path).unwrap();
        assert_eq!(store.list().unwrap().len(), 2);
        store.delete(&got).unwrap();
        store.delete(&got).unwrap();
        assert_eq!(store.get("a").unwrap(), None);
    }

    #[test]
    fn an_unreadable_record_is_left_out_of_the_list() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        store.put(&record("good")).unwrap();
        store
            .with_db(|db| {
                let txn = db.begin_write().unwrap();
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert("bad", b"not a record".as_slice())
                    .unwrap();
                txn.commit().unwrap();
                Ok(())
            })
            .unwrap();
        let listed: Vec<String> = store
            .list()
            .unwrap()
            .into_iter()
            .map(|r| r.volume_id)
            .collect();
        assert_eq!(listed, ["good"]);
        // Read on its own, it is still an error that names it.
        assert!(store.get("bad").is_err());
    }

    #[test]
    fn stale_writes_and_deletes_conflict() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        store.put(&record("a")).unwrap();
        // A second creator that did not see the first record.
        let conflict = store.put(&record("a")).unwrap_err();
        assert!(
            matches!(conflict, StoreError::Conflict { .. }),
            "{conflict}"
        );
        let mut first = store.get("a").unwrap().unwrap();
        let stale = first.clone();
        first.revision = Some(store.put(&first).unwrap());
        assert_eq!(first.revision.as_deref(), Some("2"));
        assert!(matches!(
            store.put(&stale),
            Err(StoreError::Conflict { .. })
        ));
        assert!(matches!(
            store.delete(&stale),
            Err(StoreError::Conflict { .. })
        ));
        store.delete(&first).unwrap();
        assert_eq!(store.get("a").unwrap(), None);
    }

    /// A copy read before a delete must not match the record created after it (ABA):
    /// a stale sweep would otherwise claim and delete a fresh Create.
    #[test]
    fn a_recreated_record_never_reuses_a_revision() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        let mut stale = record("a");
        stale.revision = Some(store.put(&stale).unwrap());
        store.delete(&stale).unwrap();
        let fresh = store.put(&record("a")).unwrap();
        assert_ne!(Some(fresh.as_str()), stale.revision.as_deref());
        assert!(matches!(
            store.delete(&stale),
            Err(StoreError::Conflict { .. })
        ));
        assert!(matches!(
            store.put(&stale),
            Err(StoreError::Conflict { .. })
        ));
        assert_eq!(store.get("a").unwrap().unwrap().revision, Some(fresh));
    }

    /// A file written by per-record counting: the store-wide counter starts above every
    /// revision already handed out.
    #[test]
    fn the_counter_starts_above_revisions_of_an_older_file() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        let mut old = record("old");
        old.revision = Some("7".into());
        let bytes = serde_json::to_vec(&old).unwrap();
        store
            .with_db(|db| {
                let txn = db.begin_write().unwrap();
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert("old", bytes.as_slice())
                    .unwrap();
                txn.commit().unwrap();
                Ok(())
            })
            .unwrap();
        let stale = store.get("old").unwrap().unwrap();
        store.delete(&stale).unwrap();
        let fresh = store.put(&record("old")).unwrap();
        assert!(fresh.parse::<u64>().unwrap() > 7, "{fresh}");
    }

    #[test]
    fn records_from_before_revisions_can_be_updated() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        let legacy = serde_json::to_vec(&record("old")).unwrap();
        store
            .with_db(|db| {
                let txn = db.begin_write().unwrap();
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert("old", legacy.as_slice())
                    .unwrap();
                txn.commit().unwrap();
                Ok(())
            })
            .unwrap();
        let mut got = store.get("old").unwrap().unwrap();
        assert_eq!(got.revision.as_deref(), Some("0"));
        got.revision = Some(store.put(&got).unwrap());
        store.delete(&got).unwrap();
        assert_eq!(store.get("old").unwrap(), None);
    }

    #[test]
    fn many_threads_share_one_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("controller.redb");
        EmbeddedStore::open(&path).unwrap();
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let path = path.clone();
                std::thread::spawn(move || {
                    // A separate handle per thread behaves like a separate process.
                    let store = EmbeddedStore::open(&path).unwrap();
                    for i in 0..10 {
                        store.put(&record(&format!("t{t}-{i}"))).unwrap();
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(
            EmbeddedStore::open(&path).unwrap().list().unwrap().len(),
            80
        );
    }
}
