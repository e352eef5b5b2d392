//! The controller store: which CSI volume backs each Cube volume.
//!
//! Destroy carries only Cube's volume_id, so Create records the CSI handle here. The
//! embedded store is one redb file. redb allows one open handle per file, and the binary
//! hook forks a process per call, so every operation takes an exclusive flock on a side
//! lock file, opens the database, does one transaction and closes it again.
//!
//! Both backends give records a revision: a write names the revision it read, and a
//! write over a newer one fails with `StoreError::Conflict` (optimistic concurrency).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use super::fsutil::lock_exclusive;

/// Version of the records and tables in the file; recorded in the `meta` table.
pub const STORE_FORMAT: u64 = 1;

const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const FORMAT_KEY: &str = "format";

/// A controller-store failure, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("controller store {path}: {message}")]
    Backend { path: PathBuf, message: String },
    #[error("controller store {path} has format {found}; this build reads format {STORE_FORMAT}")]
    Format { path: PathBuf, found: u64 },
    #[error("controller store: {0}")]
    Kubernetes(#[from] crate::k8s::KubeError),
    #[error("controller store: {what}: {message}")]
    Corrupt { what: String, message: String },
    /// Someone else changed the record since it was read.
    #[error("controller store: the record of volume {volume_id:?} was changed concurrently")]
    Conflict { volume_id: String },
}

/// Where a Cube volume's creation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeState {
    /// CreateVolume was sent but its answer is not known: a CSI volume of `csi_name`
    /// may exist.
    Creating,
    /// CreateVolume succeeded; `csi_volume_id` is the handle.
    Created,
}

/// One Cube volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub volume_id: String,
    /// The CreateVolume name (the idempotency key).
    pub csi_name: String,
    /// The CSI driver (GetPluginInfo name) that created the volume; Destroy refuses to
    /// send its handle to another driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_driver: Option<String>,
    pub state: VolumeState,
    #[serde(default)]
    pub csi_volume_id: Option<String>,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    #[serde(default)]
    pub capacity_bytes: i64,
    /// Seconds since the Unix epoch.
    pub updated_at: u64,
    /// What Destroy needs, recorded at Create from the StorageClass (as a PersistentVolume
    /// records it) so that Destroy works even after the StorageClass changed or is gone.
    /// None: not recorded (config-file settings, or a record from before this existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion: Option<DeletionPolicy>,
    /// The version of the stored record this copy was read at; None for a record not
    /// yet stored. Set by the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
}

/// How a volume is deleted, as its StorageClass said when it was created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeletionPolicy {
    /// `reclaimPolicy: Retain`: Destroy keeps the storage.
    pub retain: bool,
    /// The provisioner secret DeleteVolume gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::k8s::storage_class::SecretRef>,
}

/// The controller store behind the bridge.
#[derive(Debug, Clone)]
pub enum ControllerStore {
    Embedded(Arc<EmbeddedStore>),
    Kubernetes(Arc<crate::k8s::CubeVolumeStore>),
}

impl ControllerStore {
    pub async fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        match self {
            ControllerStore::Embedded(s) => {
                let (s, id) = (s.clone(), volume_id.to_string());
                blocking(move || s.get(&id)).await
            }
            ControllerStore::Kubernetes(s) => s.get(volume_id).await,
        }
    }

    /// Stores `record` if the stored copy is still at `record.revision` (None: there
    /// must be none); then `record.revision` is the new revision.
    pub async fn put(&self, record: &mut VolumeRecord) -> Result<(), StoreError> {
        match self {
            ControllerStore::Embedded(s) => {
                let (s, copy) = (s.clone(), record.clone());
                record.revision = Some(blocking(move || s.put(&copy)).await?);
                Ok(())
            }
            ControllerStore::Kubernetes(s) => s.put(record).await,
        }
    }

    /// Deletes the record if it is still at `record.revision`; already gone is success.
    pub async fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        match self {
            ControllerStore::Embedded(s) => {
                let (s, copy) = (s.clone(), record.clone());
                blocking(move || s.delete(&copy)).await
            }
            ControllerStore::Kubernetes(s) => s.delete(record).await,
        }
    }

    pub async fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        match self {
            ControllerStore::Embedded(s) => {
                let s = s.clone();
                blocking(move || s.list()).await
            }
            ControllerStore::Kubernetes(s) => s.list().await,
        }
    }

    /// Where the records live, for messages.
    pub fn describe(&self) -> String {
        match self {
            ControllerStore::Embedded(s) => s.path().display().to_string(),
            ControllerStore::Kubernetes(_) => format!(
                "{} objects ({}/{})",
                crate::k8s::CRD_KIND,
                crate::k8s::CRD_GROUP,
                crate::k8s::CRD_VERSION
            ),
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// One redb file, shared safely by any number of processes.
#[derive(Debug)]
pub struct EmbeddedStore {
    path: PathBuf,
    lock_path: PathBuf,
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store at `path` and checks its format.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let store = Self {
            path: path.to_path_buf(),
            lock_path: path.with_extension("lock"),
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
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// Runs `f` with the database open and exclusively locked against other processes.
    fn with_db<T>(
        &self,
        f: impl FnOnce(&redb::Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let _lock = lock_exclusive(&self.lock_path).map_err(|e| self.err(e))?;
        let db = redb::Database::create(&self.path).map_err(|e| self.err(e))?;
        self.check_format(&db)?;
        f(&db)
    }

    fn check_format(&self, db: &redb::Database) -> Result<(), StoreError> {
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
                    return Err(StoreError::Format {
                        path: self.path.clone(),
                        found,
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

    pub fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
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

    /// Writes `record` if the stored revision is `record.revision`; returns the new one.
    pub fn put(&self, record: &VolumeRecord) -> Result<String, StoreError> {
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
                let next = stored.map_or(0, |r| r.parse::<u64>().unwrap_or(0)) + 1;
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
    pub fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
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
                table
                    .remove(record.volume_id.as_str())
                    .map_err(|e| self.err(e))?;
            }
            txn.commit().map_err(|e| self.err(e))
        })
    }

    pub fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read().map_err(|e| self.err(e))?;
            let table = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
            let mut out = Vec::new();
            for entry in table.iter().map_err(|e| self.err(e))? {
                let (_, v) = entry.map_err(|e| self.err(e))?;
                out.push(self.decode(v.value())?);
            }
            Ok(out)
        })
    }
}

/// Seconds since the Unix epoch (for record timestamps).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
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
