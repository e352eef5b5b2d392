//! Snapshots and copies of Cube volumes, the operator's commands on the controller side:
//! `snapshot create|list|delete` (CreateSnapshot, ListSnapshots, DeleteSnapshot), and
//! `restore` / `clone`, which make a CSI volume from a snapshot or another volume and
//! record it under a new Cube volume id, so that CubeMaster's Create of that id answers
//! with it (a `Created` record is what a repeated Create answers with).
//!
//! Snapshot records live beside volume records and follow their rules: a MAC over what a
//! delete acts on, a CreateSnapshot name derived from the snapshot's name (a retry adopts
//! what an earlier attempt made), a `Creating` intent written before CreateSnapshot (the
//! sweep resolves one left behind), and the same per-volume locks as the hooks. Bad input
//! (an unknown volume or snapshot, another driver's, an id that exists) changes nothing:
//! it is refused before any CSI call or record.

use super::*;
use crate::bridge::integrity::Verdict;
use crate::bridge::naming::{MAX_VOLUME_ID_LEN, csi_volume_name, validate_volume_id};
use crate::bridge::ports::{NewSnapshot, SnapshotInfo};
use crate::bridge::records::SnapshotRecord;

/// The CreateSnapshot name of snapshot `snapshot_id`: the volume name prefix, `snap-`,
/// then the snapshot's name (hashed where it would pass CSI's 128-byte limit).
pub fn csi_snapshot_name(prefix: &str, snapshot_id: &str) -> String {
    csi_volume_name(&format!("{prefix}snap-"), snapshot_id)
}

/// The lock a snapshot's operations take: never a volume id's (those have no `.`).
fn snapshot_lock(snapshot_id: &str) -> String {
    format!("snapshot.{snapshot_id}")
}

fn validate_snapshot_id(snapshot_id: &str) -> Result<(), BridgeError> {
    validate_volume_id(snapshot_id).map_err(|_| {
        BridgeError::InvalidRequest(format!(
            "snapshot name {snapshot_id:?} is not 1 to {MAX_VOLUME_ID_LEN} characters of \
             [A-Za-z0-9_-]"
        ))
    })
}

fn validate_id(volume_id: &str) -> Result<(), BridgeError> {
    validate_volume_id(volume_id).map_err(BridgeError::InvalidRequest)
}

/// One snapshot, as `snapshot list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SnapshotEntry {
    pub snapshot_id: String,
    pub state: &'static str,
    pub source_volume_id: String,
    pub csi_snapshot_id: Option<String>,
    pub csi_driver: String,
    pub size_bytes: i64,
    pub ready_to_use: bool,
    /// Seconds since the epoch the driver gave (0: unknown).
    pub creation_time: u64,
    pub updated_at: u64,
    /// `valid`, `mismatch` (edited since the bridge wrote it) or `unsigned`.
    pub integrity: &'static str,
    /// What ListSnapshots says now: `ready`, `not_ready`, `missing` (the driver does not
    /// know it), or `unknown` (no LIST_SNAPSHOTS, the driver not reachable, or not created).
    pub driver_says: &'static str,
    /// Cube volumes restored from it.
    pub restored_into: Vec<String>,
}

impl ControllerSide {
    /// The driver's identity, refusing one without snapshots.
    async fn snapshot_driver(
        &self,
        deadline: &Deadline,
    ) -> Result<(DriverIdentity, ControllerCaps), BridgeError> {
        let (identity, caps) = self.driver.controller_view(deadline).await?;
        require_create_delete(&identity, caps.as_ref())?;
        let caps = caps.unwrap_or_default();
        if !caps.create_delete_snapshot {
            return Err(BridgeError::Precondition(format!(
                "CSI driver {} lacks the CREATE_DELETE_SNAPSHOT controller capability: it \
                 takes no snapshots",
                identity.name
            )));
        }
        Ok((identity, caps))
    }

    /// Takes the controller locks of `a` and `b` in one order, so that two commands
    /// naming the same pair the other way round never wait on each other.
    async fn lock_pair(
        &self,
        a: &str,
        b: &str,
        deadline: &Deadline,
    ) -> Result<[super::super::ports::LockGuard; 2], BridgeError> {
        let (first, second) = if a <= b { (a, b) } else { (b, a) };
        let first = self
            .locks
            .acquire(LockScope::Controller, first, deadline)
            .await?;
        let second = self
            .locks
            .acquire(LockScope::Controller, second, deadline)
            .await?;
        Ok([first, second])
    }

    /// Refuses a record the bridge did not write as it is (see `check_integrity`), for an
    /// operation that hands what it names to the driver.
    fn refuse_unverified(
        &self,
        verdict: Verdict,
        place: String,
        what: String,
    ) -> Result<(), BridgeError> {
        match verdict {
            Verdict::Valid => Ok(()),
            Verdict::Mismatch => Err(BridgeError::Precondition(format!(
                "refusing to use {place}: it fails its integrity check ({what}, but those \
                 fields are not what the bridge recorded: it was edited after the bridge \
                 wrote it, or signed with another record key than the {} one)",
                self.record_key_source.describe()
            ))),
            Verdict::Unsigned => Err(BridgeError::Precondition(format!(
                "refusing to use {place}: it carries no integrity MAC ({what}); the bridge \
                 signs every record it writes. If it is right, name its volume in \
                 controller.sign_unsigned_records for one restart"
            ))),
        }
    }

    /// The `Created`, verified record of Cube volume `volume_id`, made by `csi_driver`,
    /// and its CSI handle.
    async fn copyable_volume(
        &self,
        volume_id: &str,
        csi_driver: &str,
    ) -> Result<(VolumeRecord, String), BridgeError> {
        let key = self.record_key().await?;
        let Some(record) = self.controller_store().get(volume_id).await? else {
            return Err(BridgeError::InvalidRequest(format!(
                "unknown volume {volume_id:?}: {} holds no record of it",
                self.store.describe()
            )));
        };
        self.refuse_unverified(
            key.verify(&self.config.driver, &record),
            self.controller_store().locate(volume_id),
            format!(
                "it names CSI volume {:?}",
                record.csi_volume_id.as_deref().unwrap_or("")
            ),
        )?;
        check_same_driver(&record, csi_driver)?;
        if record.state == VolumeState::Created
            && let Some(handle) = record.csi_volume_id.clone()
        {
            return Ok((record, handle));
        }
        Err(BridgeError::InvalidRequest(format!(
            "volume {volume_id:?} is {}, not created: nothing to copy yet",
            record.state.as_str()
        )))
    }

    /// The verified record of snapshot `snapshot_id`; None when there is none.
    async fn verified_snapshot(
        &self,
        snapshot_id: &str,
    ) -> Result<Option<SnapshotRecord>, BridgeError> {
        let key = self.record_key().await?;
        let Some(record) = self.snapshots.get_snapshot(snapshot_id).await? else {
            return Ok(None);
        };
        self.refuse_unverified(
            key.verify_snapshot(&self.config.driver, &record),
            self.snapshots.locate_snapshot(snapshot_id),
            format!(
                "it names CSI snapshot {:?} of CSI volume {:?}",
                record.csi_snapshot_id.as_deref().unwrap_or(""),
                record.source_csi_volume_id
            ),
        )?;
        Ok(Some(record))
    }

    fn unknown_snapshot(&self, snapshot_id: &str) -> BridgeError {
        BridgeError::InvalidRequest(format!(
            "unknown snapshot {snapshot_id:?}: {} holds no record of it (`snapshot list` \
             shows the snapshots there are)",
            self.snapshots.locate_snapshot(snapshot_id)
        ))
    }

    async fn put_snapshot(&self, record: &mut SnapshotRecord) -> Result<(), BridgeError> {
        let key = self.record_key().await?;
        record.integrity = Some(key.sign_snapshot(&self.config.driver, record));
        Ok(self.snapshots.put_snapshot(record).await?)
    }

    /// `snapshot create VOLUME_ID --name SNAPSHOT`: CreateSnapshot of the volume, recorded
    /// as `snapshot_id`. A repeated command adopts what an earlier one made.
    pub async fn create_snapshot(
        &self,
        volume_id: &str,
        snapshot_id: &str,
    ) -> Result<SnapshotRecord, BridgeError> {
        validate_id(volume_id)?;
        validate_snapshot_id(snapshot_id)?;
        let deadline = Deadline::after(self.config.timeouts.create);
        let (identity, _) = self.snapshot_driver(&deadline).await?;
        let _locks = self
            .lock_pair(volume_id, &snapshot_lock(snapshot_id), &deadline)
            .await?;
        let (_, source_handle) = self.copyable_volume(volume_id, &identity.name).await?;
        let csi_name = csi_snapshot_name(&self.config.name_prefix, snapshot_id);
        let (mut record, ours) = self
            .begin_snapshot(
                snapshot_id,
                &csi_name,
                &identity.name,
                volume_id,
                &source_handle,
            )
            .await?;
        if record.state == VolumeState::Created {
            tracing::info!(snapshot_id, "the snapshot exists already");
            return Ok(record);
        }
        tracing::info!(snapshot_id, volume_id, csi_name, "creating CSI snapshot");
        let taken = self.take_snapshot(&record, &deadline).await;
        let info = match taken.and_then(|info| own_snapshot(&record, info)) {
            Ok(info) => info,
            Err(error) => {
                // As with volumes: only a final error proves nothing was made.
                if !error.is_uncertain_driver_error() && ours {
                    match self.snapshots.delete_snapshot(&record).await {
                        Ok(()) | Err(StoreError::Conflict { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                return Err(error);
            }
        };
        for _ in 0..STORE_RACE_RETRIES {
            record.state = VolumeState::Created;
            record.csi_snapshot_id = Some(info.csi_snapshot_id.clone());
            record.size_bytes = info.size_bytes;
            record.creation_time = info.creation_time;
            record.ready_to_use = info.ready_to_use;
            record.updated_at = self.now_secs();
            match self.put_snapshot(&mut record).await {
                Ok(()) => {
                    tracing::info!(snapshot_id, csi_snapshot_id = %info.csi_snapshot_id, "CSI snapshot created");
                    return Ok(record);
                }
                Err(BridgeError::Store(StoreError::Conflict { .. })) => {}
                Err(e) => return Err(e),
            }
            // Signed again below: only a record as the bridge wrote it is adopted. One that
            // fails its check is left; the snapshot just made is named for the operator.
            let current = self.verified_snapshot(snapshot_id).await.map_err(|error| {
                BridgeError::Precondition(format!(
                    "{error}; CSI snapshot {:?} was made by this call and is recorded \
                     nowhere: delete it by hand once the record is dealt with",
                    info.csi_snapshot_id
                ))
            })?;
            match current {
                Some(current) if current.state == VolumeState::Deleting => {
                    return Err(being_reclaimed(snapshot_id));
                }
                Some(current) => record = current,
                None => {
                    return Err(BridgeError::Precondition(format!(
                        "the record of snapshot {snapshot_id:?} was deleted while CSI \
                         snapshot {:?} was being created; the CSI snapshot may need deleting",
                        info.csi_snapshot_id
                    )));
                }
            }
        }
        Err(StoreError::Conflict {
            volume_id: snapshot_id.to_string(),
        }
        .into())
    }

    /// Records the intent to snapshot, or adopts the record an earlier attempt left for
    /// this snapshot. The flag says whether this call wrote it.
    async fn begin_snapshot(
        &self,
        snapshot_id: &str,
        csi_name: &str,
        csi_driver: &str,
        volume_id: &str,
        source_handle: &str,
    ) -> Result<(SnapshotRecord, bool), BridgeError> {
        for _ in 0..STORE_RACE_RETRIES {
            let existing = self.verified_snapshot(snapshot_id).await?;
            let ours = existing.is_none();
            let mut record = match existing {
                Some(existing) => {
                    if existing.source_volume_id != volume_id
                        || existing.source_csi_volume_id != source_handle
                    {
                        return Err(BridgeError::InvalidRequest(format!(
                            "snapshot {snapshot_id:?} already exists, of volume {:?}; \
                             choose another name",
                            existing.source_volume_id
                        )));
                    }
                    if existing.csi_driver != csi_driver {
                        return Err(other_driver_snapshot(&existing, csi_driver));
                    }
                    if existing.csi_name != csi_name {
                        return Err(BridgeError::Precondition(format!(
                            "snapshot {snapshot_id:?} is recorded with CSI name {:?}, but \
                             volume.name_prefix now gives {csi_name:?}; restore the old \
                             name_prefix or delete the snapshot first",
                            existing.csi_name
                        )));
                    }
                    match existing.state {
                        VolumeState::Created => return Ok((existing, false)),
                        VolumeState::Deleting => return Err(being_reclaimed(snapshot_id)),
                        VolumeState::Creating => {}
                    }
                    let mut touched = existing;
                    touched.updated_at = self.now_secs();
                    touched
                }
                None => SnapshotRecord {
                    snapshot_id: snapshot_id.to_string(),
                    csi_name: csi_name.to_string(),
                    csi_driver: csi_driver.to_string(),
                    source_volume_id: volume_id.to_string(),
                    source_csi_volume_id: source_handle.to_string(),
                    state: VolumeState::Creating,
                    csi_snapshot_id: None,
                    size_bytes: 0,
                    creation_time: 0,
                    ready_to_use: false,
                    updated_at: self.now_secs(),
                    revision: None,
                    integrity: None,
                },
            };
            match self.put_snapshot(&mut record).await {
                Ok(()) => return Ok((record, ours)),
                Err(BridgeError::Store(StoreError::Conflict { .. })) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::Conflict {
            volume_id: snapshot_id.to_string(),
        }
        .into())
    }

    /// CreateSnapshot as `record` asks for it (the same request every time).
    async fn take_snapshot(
        &self,
        record: &SnapshotRecord,
        deadline: &Deadline,
    ) -> Result<SnapshotInfo, BridgeError> {
        let snapshot = NewSnapshot {
            name: record.csi_name.clone(),
            source_csi_volume_id: record.source_csi_volume_id.clone(),
            secrets: self.settings.secrets(SecretUse::Provisioner).await?,
        };
        let reply = self
            .driver
            .controller()
            .create_snapshot(&snapshot, deadline)
            .await;
        self.driver.driver(reply).await
    }
}

/// Whether the driver answered CreateSnapshot with a snapshot of another source volume
/// than the record's (when it says the source at all).
fn is_of_another_source(record: &SnapshotRecord, info: &SnapshotInfo) -> bool {
    !info.source_csi_volume_id.is_empty()
        && info.source_csi_volume_id != record.source_csi_volume_id
}

/// `info`, when it is a snapshot of the record's source volume. CreateSnapshot is
/// idempotent by name, and a name asked of another source is ALREADY_EXISTS by the spec;
/// a driver that hands back the snapshot of another volume instead (the name another
/// bridge on this driver took, with the same `volume.name_prefix`) must not have it
/// recorded here: a delete or a restore through this record would reach that bridge's
/// data.
fn own_snapshot(record: &SnapshotRecord, info: SnapshotInfo) -> Result<SnapshotInfo, BridgeError> {
    if is_of_another_source(record, &info) {
        return Err(BridgeError::Precondition(format!(
            "the CSI driver answered CreateSnapshot {:?} with snapshot {:?} of volume \
             {:?}, not of {:?}: that name belongs to another snapshot (another bridge \
             on this CSI driver with the same volume.name_prefix?); give each bridge \
             its own prefix",
            record.csi_name,
            info.csi_snapshot_id,
            info.source_csi_volume_id,
            record.source_csi_volume_id
        )));
    }
    Ok(info)
}

impl ControllerSide {
    /// `snapshot list`: every snapshot record, what the driver says of each (with
    /// LIST_SNAPSHOTS), and the volumes restored from it.
    pub async fn list_snapshots(&self) -> Result<Vec<SnapshotEntry>, BridgeError> {
        let key = self.record_key().await?.clone();
        let records = self.snapshots.list_snapshots().await?;
        let volumes = self.controller_store().list().await?;
        let deadline = Deadline::after(self.config.timeouts.create);
        let lister = match self.driver.controller_view(&deadline).await {
            Ok((_, caps)) => caps.is_some_and(|c| c.list_snapshots),
            Err(error) => {
                tracing::warn!(%error, "the CSI driver did not answer; listing the records only");
                false
            }
        };
        let secrets = if lister {
            self.settings.secrets(SecretUse::Provisioner).await?
        } else {
            Secrets::default()
        };
        let mut entries = Vec::with_capacity(records.len());
        for r in records {
            let integrity = match key.verify_snapshot(&self.config.driver, &r) {
                Verdict::Valid => "valid",
                Verdict::Mismatch => "mismatch",
                Verdict::Unsigned => "unsigned",
            };
            let mut driver_says = "unknown";
            let (mut size_bytes, mut ready_to_use) = (r.size_bytes, r.ready_to_use);
            if let (true, VolumeState::Created, Some(id)) = (lister, r.state, &r.csi_snapshot_id) {
                let reply = self
                    .driver
                    .controller()
                    .get_snapshot(id, &secrets, &deadline)
                    .await;
                match reply {
                    Ok(Some(info)) => {
                        driver_says = if info.ready_to_use {
                            "ready"
                        } else {
                            "not_ready"
                        };
                        ready_to_use = info.ready_to_use;
                        if info.size_bytes != 0 {
                            size_bytes = info.size_bytes;
                        }
                    }
                    Ok(None) => driver_says = "missing",
                    Err(error) => {
                        tracing::warn!(snapshot_id = %r.snapshot_id, %error, "ListSnapshots failed")
                    }
                }
            }
            let restored_into = volumes
                .iter()
                .filter(|v| {
                    matches!(&v.content_source,
                        Some(ContentSource::Snapshot { snapshot_id, .. }) if *snapshot_id == r.snapshot_id)
                })
                .map(|v| v.volume_id.clone())
                .collect();
            entries.push(SnapshotEntry {
                state: r.state.as_str(),
                snapshot_id: r.snapshot_id,
                source_volume_id: r.source_volume_id,
                csi_snapshot_id: r.csi_snapshot_id,
                csi_driver: r.csi_driver,
                size_bytes,
                ready_to_use,
                creation_time: r.creation_time,
                updated_at: r.updated_at,
                integrity,
                driver_says,
                restored_into,
            });
        }
        entries.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
        Ok(entries)
    }

    /// `snapshot delete SNAPSHOT`: DeleteSnapshot, then the record. A driver that refuses
    /// (a snapshot volumes were restored from, still in use) keeps both.
    pub async fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), BridgeError> {
        validate_snapshot_id(snapshot_id)?;
        let deadline = Deadline::after(self.config.timeouts.destroy);
        let _lock = self
            .locks
            .acquire(
                LockScope::Controller,
                &snapshot_lock(snapshot_id),
                &deadline,
            )
            .await?;
        let Some(record) = self.verified_snapshot(snapshot_id).await? else {
            return Err(self.unknown_snapshot(snapshot_id));
        };
        let (identity, _) = self.snapshot_driver(&deadline).await?;
        if record.csi_driver != identity.name {
            return Err(other_driver_snapshot(&record, &identity.name));
        }
        self.delete_snapshot_recorded(record, &deadline).await
    }

    /// Deletes the CSI snapshot a record names (resolving an unfinished create by name
    /// first) and then the record.
    async fn delete_snapshot_recorded(
        &self,
        record: SnapshotRecord,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let csi_snapshot_id = match (&record.state, &record.csi_snapshot_id) {
            (VolumeState::Created, Some(id)) => id.clone(),
            _ => {
                tracing::info!(csi_name = %record.csi_name, "resolving an unfinished snapshot before deleting");
                let info = match self.take_snapshot(&record, deadline).await {
                    Ok(info) => info,
                    // NOT_FOUND: the source volume is gone (CSI), so the name can never be
                    // resolved again. Kept, the record would fail every sweep and hold its
                    // name for good; what the driver may have made under it before the
                    // source went is named for the operator instead.
                    Err(BridgeError::Driver(e))
                        if e.grpc_code == tonic_code::NOT_FOUND
                            && self.source_is_gone(&record).await? =>
                    {
                        tracing::warn!(
                            csi_name = %record.csi_name,
                            source_csi_volume_id = %record.source_csi_volume_id,
                            "the unfinished snapshot's source volume is gone, so whether the \
                             driver made a snapshot under this name cannot be asked again: the \
                             record is removed; if the driver lists a snapshot of that source \
                             (ListSnapshots), delete it by hand"
                        );
                        return Ok(self.snapshots.delete_snapshot(&record).await?);
                    }
                    Err(error) => return Err(error),
                };
                if is_of_another_source(&record, &info) {
                    // The name is another volume's snapshot: nothing of this record's was
                    // made under it, so only the record goes (never that snapshot).
                    tracing::warn!(csi_name = %record.csi_name, "the snapshot name belongs to another volume's snapshot: only the unfinished record is removed");
                    // A conflict is another process's change: the record stays, and says so.
                    return Ok(self.snapshots.delete_snapshot(&record).await?);
                }
                info.csi_snapshot_id
            }
        };
        let secrets = self.settings.secrets(SecretUse::Provisioner).await?;
        let reply = self
            .driver
            .controller()
            .delete_snapshot(&csi_snapshot_id, &secrets, deadline)
            .await;
        if let Err(error) = self.driver.driver(reply).await {
            let in_use = matches!(&error, BridgeError::Driver(e)
                if e.grpc_code == tonic_code::FAILED_PRECONDITION);
            if !in_use {
                return Err(error);
            }
            let restored: Vec<String> = self
                .controller_store()
                .list()
                .await
                .unwrap_or_default()
                .into_iter()
                .filter(|v| {
                    matches!(&v.content_source,
                        Some(ContentSource::Snapshot { snapshot_id, .. }) if *snapshot_id == record.snapshot_id)
                })
                .map(|v| v.volume_id)
                .collect();
            return Err(BridgeError::Precondition(format!(
                "the CSI driver refuses to delete snapshot {:?} while it is in use{}: {error}. \
                 The snapshot and its record are kept; Destroy what uses it first",
                record.snapshot_id,
                if restored.is_empty() {
                    String::new()
                } else {
                    format!(" (volumes restored from it: {})", restored.join(", "))
                }
            )));
        }
        match self.snapshots.delete_snapshot(&record).await {
            Ok(()) => {}
            Err(StoreError::Conflict { .. }) => {
                match self.snapshots.get_snapshot(&record.snapshot_id).await? {
                    None => {}
                    Some(current)
                        if current.csi_snapshot_id.as_deref() == Some(&csi_snapshot_id) =>
                    {
                        self.snapshots.delete_snapshot(&current).await?;
                    }
                    Some(_) => {
                        return Err(StoreError::Conflict {
                            volume_id: record.snapshot_id.clone(),
                        }
                        .into());
                    }
                }
            }
            Err(e) => return Err(e.into()),
        }
        tracing::info!(snapshot_id = %record.snapshot_id, %csi_snapshot_id, "CSI snapshot deleted");
        Ok(())
    }

    /// `restore SNAPSHOT --as VOLUME_ID`: a CSI volume made from the snapshot, recorded
    /// as Cube volume `as_volume_id`.
    pub async fn restore(
        &self,
        snapshot_id: &str,
        as_volume_id: &str,
    ) -> Result<VolumeRecord, BridgeError> {
        validate_snapshot_id(snapshot_id)?;
        validate_id(as_volume_id)?;
        let deadline = Deadline::after(self.config.timeouts.create);
        let (identity, _) = self.snapshot_driver(&deadline).await?;
        let _locks = self
            .lock_pair(&snapshot_lock(snapshot_id), as_volume_id, &deadline)
            .await?;
        let Some(snapshot) = self.verified_snapshot(snapshot_id).await? else {
            return Err(self.unknown_snapshot(snapshot_id));
        };
        if snapshot.csi_driver != identity.name {
            return Err(other_driver_snapshot(&snapshot, &identity.name));
        }
        let csi_snapshot_id = match (&snapshot.state, &snapshot.csi_snapshot_id) {
            (VolumeState::Created, Some(id)) => id.clone(),
            (state, _) => {
                return Err(BridgeError::InvalidRequest(format!(
                    "snapshot {snapshot_id:?} is {}, not created: nothing to restore",
                    state.as_str()
                )));
            }
        };
        let source = ContentSource::Snapshot {
            snapshot_id: snapshot_id.to_string(),
            csi_snapshot_id,
        };
        self.make_copy(
            as_volume_id,
            &identity,
            source,
            snapshot.size_bytes,
            &deadline,
        )
        .await
    }

    /// `clone VOLUME_ID --as NEW_ID`: a CSI volume made from another (CLONE_VOLUME),
    /// recorded as Cube volume `as_volume_id`.
    pub async fn clone_volume(
        &self,
        volume_id: &str,
        as_volume_id: &str,
    ) -> Result<VolumeRecord, BridgeError> {
        validate_id(volume_id)?;
        validate_id(as_volume_id)?;
        if volume_id == as_volume_id {
            return Err(BridgeError::InvalidRequest(format!(
                "--as names the volume being cloned ({volume_id:?}); choose a new id"
            )));
        }
        let deadline = Deadline::after(self.config.timeouts.create);
        let (identity, caps) = self.driver.controller_view(&deadline).await?;
        require_create_delete(&identity, caps.as_ref())?;
        if !caps.is_some_and(|c| c.clone_volume) {
            return Err(BridgeError::Precondition(format!(
                "CSI driver {} lacks the CLONE_VOLUME controller capability: it cannot \
                 make a volume from another",
                identity.name
            )));
        }
        let _locks = self.lock_pair(volume_id, as_volume_id, &deadline).await?;
        let (original, csi_volume_id) = self.copyable_volume(volume_id, &identity.name).await?;
        let source = ContentSource::Volume {
            volume_id: volume_id.to_string(),
            csi_volume_id,
        };
        let source_bytes = original.capacity_bytes;
        self.make_copy(as_volume_id, &identity, source, source_bytes, &deadline)
            .await
    }

    /// CreateVolume of a copy, recorded under `as_volume_id` as Create would record it
    /// (intent first, then `Created`). An id with any record is refused, except the
    /// `Creating` intent of this very copy (a repeated command after a lost answer).
    async fn make_copy(
        &self,
        as_volume_id: &str,
        identity: &DriverIdentity,
        source: ContentSource,
        source_bytes: i64,
        deadline: &Deadline,
    ) -> Result<VolumeRecord, BridgeError> {
        // At least the source's size (an expanded volume, a larger snapshot): drivers
        // refuse a copy smaller than what it copies (CSI: OUT_OF_RANGE).
        let copy_bytes = (self.config.capacity_bytes as i64).max(source_bytes);
        // Resolved before anything is written: a bad StorageClass changes nothing.
        let spec = self.settings.spec(&identity.name).await?;
        let fresh_name = fresh_csi_volume_name(&self.config.name_prefix, as_volume_id);
        let attempt = new_create_attempt();
        let mut intent = None;
        for _ in 0..STORE_RACE_RETRIES {
            let (mut record, ours) = match self.controller_store().get(as_volume_id).await? {
                Some(existing)
                    if existing.state == VolumeState::Creating
                        && existing.content_source.as_ref() == Some(&source)
                        && existing.csi_driver.as_deref() == Some(identity.name.as_str()) =>
                {
                    // Signed anew below, so only if the bridge wrote it: a record planted
                    // by whoever can write the store (a Retain policy, a deletion secret,
                    // a CSI handle of theirs) would otherwise come out signed.
                    self.check_integrity_before(&existing, "go on with this copy")
                        .await?;
                    let mut touched = existing;
                    touched.updated_at = self.now_secs();
                    (touched, false)
                }
                Some(existing) => {
                    return Err(BridgeError::InvalidRequest(format!(
                        "volume {as_volume_id:?} already exists ({}, {}); choose another id \
                         with --as",
                        existing.state.as_str(),
                        self.controller_store().locate(as_volume_id)
                    )));
                }
                None => (
                    VolumeRecord {
                        volume_id: as_volume_id.to_string(),
                        csi_name: fresh_name.clone(),
                        csi_driver: Some(identity.name.clone()),
                        state: VolumeState::Creating,
                        csi_volume_id: None,
                        volume_context: Default::default(),
                        // What CreateVolume asks for, so that a repeat asks the same.
                        capacity_bytes: copy_bytes,
                        updated_at: self.now_secs(),
                        deletion: spec.deletion.clone(),
                        revision: None,
                        integrity: None,
                        content_source: Some(source.clone()),
                        accessible_topology: Vec::new(),
                        node_expansion_required: false,
                        answering_creates: Vec::new(),
                    },
                    true,
                ),
            };
            match self.store_put(HookKind::Create, &mut record).await {
                Ok(()) => {
                    intent = Some((record, ours));
                    break;
                }
                Err(BridgeError::Store(StoreError::Conflict { .. })) => continue,
                Err(e) => return Err(e),
            }
        }
        let Some((record, ours)) = intent else {
            return Err(StoreError::Conflict {
                volume_id: as_volume_id.to_string(),
            }
            .into());
        };
        tracing::info!(volume_id = as_volume_id, source = %source.describe(), csi_name = %record.csi_name, "creating a CSI volume from a content source");
        let volume = match self
            .create_volume(
                HookKind::Create,
                &record,
                self.asked_bytes(&record),
                &spec,
                deadline,
                None,
            )
            .await
        {
            Ok(volume) => volume,
            Err(error) => {
                if !error.is_uncertain_driver_error() && ours {
                    match self.store_delete(HookKind::Create, &record).await {
                        Ok(()) | Err(StoreError::Conflict { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                return Err(error);
            }
        };
        // What this call asked for (an adopted intent's recorded size).
        let required = self.asked_bytes(&record) as i64;
        let handle = VolumeHandle {
            csi_volume_id: volume.csi_volume_id.clone(),
            volume_context: volume.volume_context.clone(),
            controller_publish: false,
            topology: volume.accessible_topology.clone(),
        };
        // What Create would refuse to hand to Cube is undone now, not at Create.
        let problem = if volume.capacity_bytes != 0 && volume.capacity_bytes < required {
            Some(format!(
                "the driver made a volume of {} bytes, less than the {required} asked for",
                volume.capacity_bytes
            ))
        } else {
            handle.encode_for(&self.config.driver).err()
        };
        if let Some(problem) = problem {
            return Err(self
                .undo_create(
                    as_volume_id,
                    &record.csi_name,
                    &volume.csi_volume_id,
                    &attempt,
                    problem,
                )
                .await);
        }
        self.finish_create(record, &volume, spec.deletion.as_ref(), &attempt)
            .await?;
        tracing::info!(volume_id = as_volume_id, csi_volume_id = %volume.csi_volume_id, "CSI volume created from its content source");
        self.controller_store()
            .get(as_volume_id)
            .await?
            .ok_or_else(|| {
                BridgeError::Precondition(format!(
                    "the record of volume {as_volume_id:?} was deleted right after it was \
                     written (a concurrent Destroy?)"
                ))
            })
    }

    /// Resolves abandoned snapshot creates, as `sweep_abandoned_creates` does volumes:
    /// claims the record, finds the snapshot by repeating CreateSnapshot, deletes it and
    /// drops the record.
    pub(super) async fn sweep_abandoned_snapshots(
        &self,
        grace: Duration,
        watched: bool,
        report: &mut SweepReport,
    ) -> Result<(), BridgeError> {
        let records = self.snapshots.list_snapshots().await?;
        self.forget_sightings(
            "snapshot",
            records
                .iter()
                .filter(|r| r.state != VolumeState::Created)
                .map(|r| r.snapshot_id.as_str()),
        );
        for record in records {
            let abandoned = record.state != VolumeState::Created
                && self.abandoned_after(
                    sighting_key("snapshot", &record.snapshot_id),
                    (record.revision.clone(), record.updated_at, record.state),
                    grace,
                    watched,
                );
            if !abandoned {
                continue;
            }
            let snapshot_id = record.snapshot_id.clone();
            let outcome = self.reclaim_snapshot(record).await;
            self.recorder.sweep_finding(
                match &outcome {
                    Ok(true) => "reclaimed",
                    Ok(false) => "skipped",
                    Err(_) => "failed",
                },
                1,
            );
            match outcome {
                Ok(true) => {
                    tracing::warn!(
                        snapshot_id,
                        "deleted the CSI snapshot of an abandoned snapshot create"
                    );
                    report.reclaimed += 1;
                }
                Ok(false) => report.skipped += 1,
                Err(error) => {
                    tracing::error!(snapshot_id, %error, "reclaiming an abandoned snapshot create failed; the next sweep retries");
                    report.failed += 1;
                }
            }
        }
        Ok(())
    }

    async fn reclaim_snapshot(&self, record: SnapshotRecord) -> Result<bool, BridgeError> {
        let Some(_guard) = self
            .locks
            .try_acquire(LockScope::Controller, &snapshot_lock(&record.snapshot_id))?
        else {
            return Ok(false);
        };
        let key = self.record_key().await?;
        self.refuse_unverified(
            key.verify_snapshot(&self.config.driver, &record),
            self.snapshots.locate_snapshot(&record.snapshot_id),
            format!("it names CSI snapshot name {:?}", record.csi_name),
        )?;
        let mut claimed = record;
        claimed.state = VolumeState::Deleting;
        claimed.updated_at = self.now_secs();
        match self.put_snapshot(&mut claimed).await {
            Ok(()) => {}
            Err(BridgeError::Store(StoreError::Conflict { .. })) => return Ok(false),
            Err(e) => return Err(e),
        }
        let deadline = Deadline::after(self.config.timeouts.destroy);
        self.delete_snapshot_recorded(claimed, &deadline).await?;
        Ok(true)
    }
}

impl ControllerSide {
    /// Whether the volume `record` was taken of is gone by this bridge's own records: no
    /// record of it, or one of another CSI volume (a NOT_FOUND from CreateSnapshot is
    /// then the source's absence, not a driver's passing trouble).
    async fn source_is_gone(&self, record: &SnapshotRecord) -> Result<bool, BridgeError> {
        let source = self
            .controller_store()
            .get(&record.source_volume_id)
            .await?;
        Ok(source.is_none_or(|v| {
            v.csi_volume_id.as_deref() != Some(record.source_csi_volume_id.as_str())
        }))
    }
}

/// The gRPC codes the core compares driver errors with.
mod tonic_code {
    /// NOT_FOUND: what a driver answers CreateSnapshot of a source volume that is gone.
    pub const NOT_FOUND: i32 = 5;
    /// FAILED_PRECONDITION: what a driver answers DeleteSnapshot of a snapshot in use.
    pub const FAILED_PRECONDITION: i32 = 9;
}

/// Refuses to hand one driver's snapshot to another.
fn other_driver_snapshot(record: &SnapshotRecord, driver_name: &str) -> BridgeError {
    BridgeError::InvalidRequest(format!(
        "snapshot {:?} was taken by CSI driver {:?}, but the driver at the controller \
         endpoint is {driver_name:?}; refusing to pass its handle to another driver",
        record.snapshot_id, record.csi_driver
    ))
}
