//! Filling the embedded controller store fast. Through the bridge, each Create commits
//! several redb transactions under the store's flock, so 10,000 of them take minutes;
//! the figure needs 10,000 records in the store, not 10,000 Creates. So the suite Creates
//! the first records through the bridge, then adds the rest in one transaction under the
//! same flock the bridge takes, each a copy of a record the bridge itself wrote (only the
//! volume id changed, and the copy signed with the bridge's record key as the bridge signs
//! its own: an unsigned or mis-signed record is refused by Destroy), and has the bridge
//! Destroy one of them to prove it reads them.
//!
//! What this knows of the store's layout: the file `<state.dir>/controller.redb`, its lock
//! file `controller.lock`, the key `<state.dir>/record.key`, and a table `volumes` from
//! volume id to record (a `VolumeRecord` as JSON). Should that
//! change, the count check below fails the section loudly rather than measuring a store
//! that does not hold what the figure says.

use std::path::Path;

use anyhow::{Context, bail};
use cube_csi_bridge::bridge::records::VolumeRecord;
use cube_csi_bridge::store::FileKeySource;
use nix::fcntl::{Flock, FlockArg};
use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");

/// Runs `f` on the store with the bridge's lock held.
fn locked<T>(
    store: &Path,
    f: impl FnOnce(&redb::Database) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let lock_path = store.with_extension("lock");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    let _lock = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| e)?;
    let db =
        redb::Database::create(store).with_context(|| format!("opening {}", store.display()))?;
    f(&db)
}

/// How many records the store holds.
pub fn count(store: &Path) -> anyhow::Result<u64> {
    locked(store, |db| {
        let txn = db.begin_read()?;
        Ok(txn.open_table(VOLUMES)?.len()?)
    })
}

/// Whether the store holds a record of `volume_id`.
pub fn holds(store: &Path, volume_id: &str) -> anyhow::Result<bool> {
    locked(store, |db| {
        let txn = db.begin_read()?;
        Ok(txn.open_table(VOLUMES)?.get(volume_id)?.is_some())
    })
}

/// Adds a copy of `template`'s record for each of `ids` (the volume id replaced wherever
/// it appears, signed for Cube driver `driver`), if the store holds exactly `expected`
/// records now.
pub fn fill(
    store: &Path,
    driver: &str,
    expected: u64,
    template: &str,
    ids: &[String],
) -> anyhow::Result<()> {
    let key_file = store.with_file_name("record.key");
    let key = FileKeySource::new(&key_file)
        .read_existing()
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .with_context(|| format!("no record key at {}", key_file.display()))?;
    locked(store, |db| {
        let txn = db.begin_write()?;
        {
            let mut table = txn.open_table(VOLUMES)?;
            let found = table.len()?;
            if found != expected {
                bail!(
                    "{} holds {found} records in table \"volumes\", not the {expected} the \
                     bridge created: the store's layout has changed; adapt benches/suite/seed.rs",
                    store.display()
                );
            }
            let bytes = table
                .get(template)?
                .with_context(|| format!("no record of {template} in {}", store.display()))?
                .value()
                .to_vec();
            let record: serde_json::Value = serde_json::from_slice(&bytes)
                .context("the bridge's records are no longer JSON; adapt benches/suite/seed.rs")?;
            for id in ids {
                let mut copy: VolumeRecord = serde_json::from_value(replaced(
                    &record, template, id,
                ))
                .context("the bridge's records are no longer VolumeRecords; adapt seed.rs")?;
                copy.integrity = Some(key.sign(driver, &copy));
                let copy = serde_json::to_vec(&copy)?;
                table.insert(id.as_str(), copy.as_slice())?;
            }
        }
        txn.commit()?;
        Ok(())
    })
}

/// `value` with `from` replaced by `to` in every string.
fn replaced(value: &serde_json::Value, from: &str, to: &str) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(s) => Value::String(s.replace(from, to)),
        Value::Array(items) => Value::Array(items.iter().map(|v| replaced(v, from, to)).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), replaced(v, from, to)))
                .collect(),
        ),
        other => other.clone(),
    }
}
