//! Create and Destroy: the controller side, as external-provisioner would do it.
//!
//! Create sends CreateVolume with a name derived from the Cube volume_id (so a retry
//! finds the same volume), records the handle in the controller store, and returns it as
//! private_data. Destroy deletes what the store names; a volume that is already gone, or
//! was never recorded, is success.
//!
//! Several controller replicas may share one store (Kubernetes mode). They meet on the
//! record: every write names the revision it read, CreateVolume is idempotent by name, and
//! a replica that loses a race re-reads and carries on from what the winner wrote.
//!
//! Cube never Destroys after a failed Create, so a Create that was killed or cancelled
//! after CreateVolume would leak the CSI volume. The sweep resolves `Creating` records
//! older than a grace period: it claims the record (state `Deleting`, a compare-and-swap
//! that a replica still working on that Create would have refreshed), finds the volume
//! by repeating CreateVolume with the recorded name, deletes it, and drops the record.

use std::sync::Arc;
use std::time::Duration;

mod snapshots;
pub use snapshots::{SnapshotEntry, csi_snapshot_name};

use super::caller::Answer;
use super::discovery::DriverView;
use super::faults::{self, When};
use super::handoff::VolumeHandle;
use super::integrity::{KeyFit, RecordKey, RecordKeySource, Verdict};
use super::naming::fresh_csi_volume_name;
use super::ports::{
    Clock, ControllerCaps, ControllerExpand, ControllerExpanded, ControllerStore, CreatedVolume,
    DriverIdentity, LockGuard, LockScope, NewVolume, Recorder, SecretUse, Secrets, SnapshotStore,
    StoreError, VolumeLocks, VolumeSettings, VolumeSpec,
};
use super::records::{
    ANSWERING_CREATES_KEPT, ContentSource, DeletionPolicy, VolumeRecord, VolumeState,
};
use super::{
    BridgeError, Caller, CreateVolume, Created, Deadline, DestroyVolume, HookError, HookKind,
    Settings,
};

/// How often a write that lost a race to another replica is retried on a fresh read.
const STORE_RACE_RETRIES: usize = 3;
/// The first pause before a store call that failed for a moment is tried again, doubled
/// each time up to the last (all within the caller's budget).
const STORE_RETRY_FIRST_PAUSE: Duration = Duration::from_millis(50);
const STORE_RETRY_MAX_PAUSE: Duration = Duration::from_secs(2);

/// Refuses a driver that cannot create volumes.
pub(crate) fn require_create_delete(
    identity: &DriverIdentity,
    caps: Option<&ControllerCaps>,
) -> Result<(), BridgeError> {
    match caps {
        Some(c) if c.create_delete_volume => Ok(()),
        Some(_) => Err(BridgeError::Precondition(format!(
            "CSI driver {} lacks the CREATE_DELETE_VOLUME controller capability, so it cannot \
             back Cube's Create and Destroy",
            identity.name
        ))),
        None => Err(BridgeError::Precondition(format!(
            "CSI driver {} has no controller service at this endpoint, so it cannot back \
             Cube's Create and Destroy; point csi.controller_endpoint (or csi.endpoint) at \
             the driver's controller",
            identity.name
        ))),
    }
}

/// What a sweep found.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SweepReport {
    /// Abandoned creates whose CSI volume was deleted and record dropped.
    pub reclaimed: usize,
    /// Records claimed by another replica or refreshed meanwhile.
    pub skipped: usize,
    pub failed: usize,
}

/// What the controller side works through, each built by the composition root.
pub struct ControllerPorts {
    /// The driver, shared with the node side of the same process.
    pub driver: Arc<DriverView>,
    pub store: Arc<dyn ControllerStore>,
    /// Where the key controller records are signed with is kept.
    pub record_key: Arc<dyn RecordKeySource>,
    pub settings: Arc<dyn VolumeSettings>,
    pub locks: Arc<dyn VolumeLocks>,
    pub clock: Arc<dyn Clock>,
    pub recorder: Arc<dyn Recorder>,
    /// The snapshot records, kept beside `store`'s.
    pub snapshots: Arc<dyn SnapshotStore>,
}

/// Create and Destroy of one Cube driver over one CSI driver.
pub struct ControllerSide {
    config: Settings,
    driver: Arc<DriverView>,
    store: Arc<dyn ControllerStore>,
    record_key_source: Arc<dyn RecordKeySource>,
    settings: Arc<dyn VolumeSettings>,
    locks: Arc<dyn VolumeLocks>,
    clock: Arc<dyn Clock>,
    recorder: Arc<dyn Recorder>,
    /// The record key, once loaded.
    record_key: tokio::sync::OnceCell<RecordKey>,
    /// This process made the key and has not yet signed the records from before keys.
    unsigned_records_pending: std::sync::atomic::AtomicBool,
    snapshots: Arc<dyn SnapshotStore>,
    /// What a watching sweep (the daemon's) has seen of each unfinished record: the
    /// version it saw, and since when on this process's monotonic clock (`Sightings`).
    sightings: std::sync::Mutex<Sightings>,
}

/// Unfinished records as a long-lived sweeper saw them: (store key) → (version: the
/// record's revision, time and state; first seen). A record's `updated_at` is the wall
/// clock of whichever host wrote it: a sweeper whose clock runs ahead of a replica's (or a
/// record written while a clock ran ahead, later fixed) must not judge a live Create
/// abandoned, nor a dead one never abandoned. Aged by this process's own watch, a record
/// is abandoned only once it has stayed the same for the whole grace.
/// The key of a record of `kind` ("volume", "snapshot") in `Sightings`.
fn sighting_key(kind: &str, id: &str) -> String {
    format!("{kind}/{id}")
}

type Sightings =
    std::collections::HashMap<String, ((Option<String>, u64, VolumeState), std::time::Instant)>;

impl std::fmt::Debug for ControllerSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerSide")
            .field("driver", &self.config.driver)
            .field("csi", &self.driver)
            .field("store", &self.store.describe())
            .finish_non_exhaustive()
    }
}

impl ControllerSide {
    pub fn new(settings: Settings, ports: ControllerPorts) -> Self {
        Self {
            config: settings,
            driver: ports.driver,
            store: ports.store,
            record_key_source: ports.record_key,
            settings: ports.settings,
            locks: ports.locks,
            clock: ports.clock,
            recorder: ports.recorder,
            record_key: tokio::sync::OnceCell::new(),
            unsigned_records_pending: Default::default(),
            snapshots: ports.snapshots,
            sightings: Default::default(),
        }
    }

    /// Whether an unfinished record written at `updated_at` (its writer's wall clock) is
    /// abandoned after `grace`. One-shot sweepers (a forked hook's) go by the wall clocks.
    /// A watching one (`watched`: the daemon's, which sweeps again and again) also needs
    /// to have seen the record unchanged for the grace itself, and then takes a record
    /// dated in the future (a clock since set back) for an old one.
    fn abandoned_after(
        &self,
        key: String,
        version: (Option<String>, u64, VolumeState),
        grace: Duration,
        watched: bool,
    ) -> bool {
        let (now, updated_at) = (self.now_secs(), version.1);
        let aged = updated_at <= now && now - updated_at >= grace.as_secs();
        if !watched {
            return aged;
        }
        let mut sightings = self.sightings.lock().expect("sightings poisoned");
        let seen = sightings
            .entry(key)
            .and_modify(|(seen, since)| {
                if *seen != version {
                    *seen = version.clone();
                    *since = std::time::Instant::now();
                }
            })
            .or_insert_with(|| (version.clone(), std::time::Instant::now()))
            .1
            .elapsed();
        seen >= grace && (aged || updated_at > now)
    }

    /// Forgets the sightings of records of `kind` ("volume", "snapshot") that are no
    /// longer listed unfinished (`unfinished`: the ids that are).
    fn forget_sightings<'a>(&self, kind: &str, unfinished: impl Iterator<Item = &'a str>) {
        let keep: std::collections::HashSet<String> =
            unfinished.map(|id| sighting_key(kind, id)).collect();
        let prefix = sighting_key(kind, "");
        self.sightings
            .lock()
            .expect("sightings poisoned")
            .retain(|key, _| !key.starts_with(&prefix) || keep.contains(key));
    }

    /// The core's settings this side runs with.
    pub fn settings(&self) -> &Settings {
        &self.config
    }

    fn controller_store(&self) -> &dyn ControllerStore {
        self.store.as_ref()
    }

    fn now_secs(&self) -> u64 {
        self.clock.now_secs()
    }

    /// Checks, before serving, that the driver can create and delete volumes, that the
    /// settings fit it, that a shared store can be read, and makes the record key. An
    /// unreachable driver or API server is only a warning (it may come later; calls
    /// connect lazily); a driver that answers but cannot serve Cube is an error.
    pub async fn check(&self, deadline: &Deadline) -> Result<(), BridgeError> {
        match self.driver.controller_view(deadline).await {
            Ok((identity, caps)) => {
                tracing::info!(
                    driver = %identity.name,
                    version = %identity.vendor_version,
                    endpoint = self.driver.controller().endpoint(),
                    "controller side: CSI driver found"
                );
                require_create_delete(&identity, caps.as_ref())?;
                // The access mode comes from the settings source, which may not answer yet
                // (a StorageClass): checked below with the other settings.
                super::fit::controller_fits(
                    &identity,
                    caps.as_ref(),
                    Default::default(),
                    self.config.accessibility.as_ref(),
                )?;
            }
            Err(e) if e.is_uncertain_driver_error() => {
                tracing::warn!(error = %e, "controller side: CSI driver not reachable yet; will connect on first use");
            }
            Err(e) => return Err(e),
        }
        let known = self.driver.known_name().await;
        let outcome = async {
            if let Some(line) = self.settings.check(known.as_deref()).await? {
                tracing::info!("{line}");
            }
            if known.is_some() {
                let (identity, caps) = self.driver.controller_view(deadline).await?;
                let spec = self.settings.spec(&identity.name).await?;
                super::fit::controller_fits(
                    &identity,
                    caps.as_ref(),
                    spec.capability.access_mode,
                    self.config.accessibility.as_ref(),
                )?;
            }
            if self.config.shared_store {
                let count = self.store.list().await?.len();
                tracing::info!(volumes = count, store = %self.store.describe(), "controller store reachable");
            }
            // Made (and records from before keys existed signed) before the first hook.
            self.check_key_fits_records().await?;
            Ok::<_, BridgeError>(())
        }
        .await;
        transient_is_a_warning(outcome)
    }

    /// Signs `record` and stores it.
    async fn store_put(
        &self,
        hook: HookKind,
        record: &mut VolumeRecord,
    ) -> Result<(), BridgeError> {
        let key = self.record_key().await?;
        record.integrity = Some(key.sign(&self.config.driver, record));
        faults::point(hook, When::Before, "store");
        let written = self.controller_store().put(record).await;
        faults::point(hook, When::After, "store");
        Ok(written?)
    }

    /// The key controller records are signed with, read (or, the first time, made) on
    /// first use. Records without a MAC are signed only when making the key proves that
    /// none existed before (then they predate keys), or when the operator names them in
    /// `controller.sign_unsigned_records`.
    pub(crate) async fn record_key(&self) -> Result<&RecordKey, BridgeError> {
        self.record_key
            .get_or_try_init(|| async {
                let source = &self.record_key_source;
                let key = match source.read().await? {
                    Some(key) => key,
                    None => self.make_record_key().await?,
                };
                tracing::debug!(key = %source.describe(), sha256 = %key.fingerprint(), "record key read");
                let pending = self
                    .unsigned_records_pending
                    .load(std::sync::atomic::Ordering::SeqCst);
                if pending {
                    self.sign_pass(self.sign_all_unsigned_records(&key)).await?;
                    self.unsigned_records_pending
                        .store(false, std::sync::atomic::Ordering::SeqCst);
                }
                if !self.config.sign_unsigned_records.is_empty() {
                    self.sign_pass(self.sign_named_records(&key)).await?;
                }
                Ok(key)
            })
            .await
    }

    /// Makes the record key; only a store without signed records may get a new one.
    /// Signed records mean a key existed and was lost or removed: a new key would leave
    /// them unverifiable and trust whatever it signs next, so the old one is restored.
    async fn make_record_key(&self) -> Result<RecordKey, BridgeError> {
        let source = &self.record_key_source;
        let store = self.controller_store();
        let records = store.list().await?;
        if let Some(signed) = records.iter().find(|r| r.integrity.is_some()) {
            // Another replica may have made the key and signed a record meanwhile.
            if let Some(key) = source.read().await? {
                return Ok(key);
            }
            let count = records.iter().filter(|r| r.integrity.is_some()).count();
            return Err(BridgeError::Precondition(format!(
                "the record key ({}) is missing, but {count} controller record(s) are signed \
                 with one (e.g. {}): the key was lost or removed, and the bridge does not \
                 make a new one (the signed records would no longer verify, and a record \
                 forged meanwhile would be trusted). Restore the key from a backup and \
                 restart",
                source.describe(),
                store.locate(&signed.volume_id)
            )));
        }
        let loaded = source.create().await?;
        if loaded.created {
            let unsigned = records.len();
            if source.making_proves_first_key() {
                tracing::info!(key = %source.describe(), "made the key controller records are signed with");
                // Kept until the signing pass succeeds, should it fail now.
                self.unsigned_records_pending
                    .store(true, std::sync::atomic::Ordering::SeqCst);
            } else if unsigned > 0 {
                tracing::warn!(
                    key = %source.describe(),
                    unsigned,
                    "made the key controller records are signed with, but signed none of \
                     the records that carry no MAC: here a key may have been removed and \
                     records forged since. Check each against the storage backend and name \
                     the good ones in controller.sign_unsigned_records"
                );
            } else {
                tracing::info!(key = %source.describe(), "made the key controller records are signed with");
            }
        }
        Ok(loaded.key)
    }

    /// Runs a signing pass; a store that cannot be reached now is retried on next use.
    async fn sign_pass(
        &self,
        pass: impl std::future::Future<Output = Result<usize, BridgeError>>,
    ) -> Result<(), BridgeError> {
        match pass.await {
            Ok(_) => Ok(()),
            Err(e @ BridgeError::Store(_)) if store_transient(&e) => Err(e),
            Err(e) => Err(BridgeError::Precondition(format!(
                "signing controller records that carry no MAC failed ({e}); check them and \
                 name the good ones in controller.sign_unsigned_records"
            ))),
        }
    }

    /// Signs every record that carries no MAC, logging each: only right after a key was
    /// made where that proves no key existed (the records predate keys).
    async fn sign_all_unsigned_records(&self, key: &RecordKey) -> Result<usize, BridgeError> {
        let store = self.controller_store();
        let mut signed = 0;
        for mut record in store.list().await? {
            for _ in 0..STORE_RACE_RETRIES {
                if record.integrity.is_some() {
                    break;
                }
                record.integrity = Some(key.sign(&self.config.driver, &record));
                match store.put(&mut record).await {
                    Ok(()) => {
                        tracing::warn!(
                            record = %store.locate(&record.volume_id),
                            csi_volume_id = record.csi_volume_id.as_deref().unwrap_or("-"),
                            "signed a controller record that carried no MAC (written before \
                             records were signed); check it if it was not written by this bridge"
                        );
                        signed += 1;
                        break;
                    }
                    Err(StoreError::Conflict { .. }) => match store.get(&record.volume_id).await? {
                        Some(current) => record = current,
                        None => break,
                    },
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(signed)
    }

    /// Signs the records `controller.sign_unsigned_records` names, if they carry no MAC.
    /// A record carrying a MAC this key did not make is never re-signed: it was edited, or
    /// signed under another key, and signing it would make the edit look like the bridge's.
    async fn sign_named_records(&self, key: &RecordKey) -> Result<usize, BridgeError> {
        let store = self.controller_store();
        let driver = &self.config.driver;
        let mut signed = 0;
        for volume_id in &self.config.sign_unsigned_records {
            for _ in 0..STORE_RACE_RETRIES {
                let Some(mut record) = store.get(volume_id).await? else {
                    tracing::warn!(
                        volume_id,
                        "controller.sign_unsigned_records names a volume that has no record"
                    );
                    break;
                };
                let place = store.locate(volume_id);
                match key.verify(driver, &record) {
                    Verdict::Valid => break,
                    Verdict::Mismatch => {
                        tracing::warn!(
                            record = %place,
                            "not signed, though controller.sign_unsigned_records names it: it \
                             carries a MAC this key did not make (edited, or signed under \
                             another key), and such a record is never re-signed"
                        );
                        break;
                    }
                    Verdict::Unsigned => {}
                }
                record.integrity = Some(key.sign(driver, &record));
                match store.put(&mut record).await {
                    Ok(()) => {
                        tracing::warn!(
                            record = %place,
                            csi_volume_id = record.csi_volume_id.as_deref().unwrap_or("-"),
                            "signed a controller record that carried no MAC, as \
                             controller.sign_unsigned_records asks"
                        );
                        signed += 1;
                        break;
                    }
                    Err(StoreError::Conflict { .. }) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(signed)
    }

    /// Refuses to serve with a key that made none of the signed records' MACs, volume and
    /// snapshot records alike: it is not the key they were signed with, so it replaced
    /// theirs. Records that fail on their own are only reported (Destroy, `snapshot
    /// delete` and `restore` refuse each).
    async fn check_key_fits_records(&self) -> Result<(), BridgeError> {
        let key = self.record_key().await?;
        tracing::info!(
            key = %self.record_key_source.describe(),
            sha256 = %key.fingerprint(),
            "controller records are signed with this key (pin its sha256 to refuse any other)"
        );
        let store = self.controller_store();
        let records = store.list().await?;
        let fit = KeyFit::tally(
            key,
            &self.config.driver,
            records.iter().map(|r| (r, store.locate(&r.volume_id))),
        );
        // Unreadable snapshot records (a cluster whose chart upgrade did not add the
        // CubeVolumeSnapshot CRD: Helm installs CRDs only on install) leave the volumes'
        // verdict to stand alone: snapshots are an operator's extra, not Cube's path.
        let snapshots = self
            .snapshots
            .list_snapshots()
            .await
            .unwrap_or_else(|error| {
                tracing::warn!(%error, "snapshot records not checked against the record key");
                Vec::new()
            });
        let snapshot_fit = KeyFit::tally_snapshots(
            key,
            &self.config.driver,
            snapshots
                .iter()
                .map(|r| (r, self.snapshots.locate_snapshot(&r.snapshot_id))),
        );
        let all = fit.clone().and(&snapshot_fit);
        if all.is_foreign_key() {
            return Err(BridgeError::Precondition(format!(
                "the record key ({}, sha256 {}) made none of the MACs of the {} signed \
                 controller records (e.g. {}): it is not the key they were signed with, so \
                 it replaced theirs, and the controller side does not serve with it. \
                 Restore the original key from a backup",
                self.record_key_source.describe(),
                key.fingerprint(),
                all.mismatched_count,
                all.mismatched.join(", ")
            )));
        }
        if snapshot_fit.mismatched_count + snapshot_fit.unsigned > 0 {
            tracing::warn!(
                count = snapshot_fit.mismatched_count + snapshot_fit.unsigned,
                records = %snapshot_fit.mismatched.join(", "),
                "snapshot records fail their integrity check (edited, or their MAC \
                 removed); `snapshot delete` and `restore` refuse each"
            );
        }
        if fit.mismatched_count > 0 {
            tracing::warn!(
                count = fit.mismatched_count,
                records = %fit.mismatched.join(", "),
                "controller records fail their integrity check; Destroy refuses each"
            );
        }
        if fit.unsigned > 0 {
            tracing::warn!(
                count = fit.unsigned,
                "controller records carry no MAC; Destroy refuses each until it is checked \
                 and named in controller.sign_unsigned_records"
            );
        }
        Ok(())
    }

    /// Refuses a record whose MAC does not verify: it may have been pointed at someone
    /// else's volume.
    async fn check_integrity(&self, record: &VolumeRecord) -> Result<(), BridgeError> {
        self.check_integrity_before(record, "delete anything").await
    }

    /// `check_integrity`, refusing to do `action` for the volume.
    async fn check_integrity_before(
        &self,
        record: &VolumeRecord,
        action: &str,
    ) -> Result<(), BridgeError> {
        let key = self.record_key().await?;
        let fields = || {
            format!(
                "It names CSI volume {:?} (CSI name {:?}, CSI driver {:?}, state {})",
                record.csi_volume_id.as_deref().unwrap_or(""),
                record.csi_name,
                record.csi_driver.as_deref().unwrap_or(""),
                record.state.as_str()
            )
        };
        let place = self.controller_store().locate(&record.volume_id);
        match key.verify(&self.config.driver, record) {
            Verdict::Valid => Ok(()),
            Verdict::Mismatch => Err(BridgeError::Precondition(format!(
                "refusing to {action} for this volume: {place} fails its integrity \
                 check. {}, but those fields are not what the bridge recorded: the record \
                 was edited after the bridge wrote it (or signed with another record key \
                 than the {} one). Compare it with the storage backend and restore the \
                 original values, or delete the CSI volume and the record by hand",
                fields(),
                self.record_key_source.describe()
            ))),
            Verdict::Unsigned => Err(BridgeError::Precondition(format!(
                "refusing to {action} for this volume: {place} carries no integrity \
                 MAC. {}. The bridge signs every record it writes; this one was written \
                 before records were signed, restored from an old backup, or forged (its \
                 MAC removed?). If it is right (compare it with the storage backend), name \
                 it in controller.sign_unsigned_records = [{:?}] for one restart to sign \
                 it; otherwise delete the CSI volume and the record by hand",
                fields(),
                record.volume_id
            ))),
        }
    }

    async fn store_delete(&self, hook: HookKind, record: &VolumeRecord) -> Result<(), StoreError> {
        faults::point(hook, When::Before, "store");
        let deleted = self.controller_store().delete(record).await;
        faults::point(hook, When::After, "store");
        deleted
    }

    /// The bytes a Create's CreateVolume asks for the volume `record` stands for. An
    /// intent's are the ones it recorded when it was written: a repeat is the same request
    /// whatever `volume.capacity_bytes` says now (a driver answers the same name with
    /// another size ALREADY_EXISTS, for good). A finished volume's recorded size, when
    /// `expand` grew it past the configured one, is asked for too (the volume satisfies
    /// it). Else, and for intents that say 0 (asked with no size, or written before
    /// intents recorded it), the configured capacity. (A repeat only to delete asks for
    /// exactly what the record says: `delete_recorded`.)
    fn asked_bytes(&self, record: &VolumeRecord) -> u64 {
        let configured = self.config.capacity_bytes;
        let recorded = record.capacity_bytes.max(0) as u64;
        match record.state {
            VolumeState::Created => configured.max(recorded),
            _ if recorded > 0 => recorded,
            _ => configured,
        }
    }

    /// CreateVolume of `required_bytes` for the volume `record` stands for.
    async fn create_volume(
        &self,
        hook: HookKind,
        record: &VolumeRecord,
        required_bytes: u64,
        spec: &VolumeSpec,
        deadline: &Deadline,
        caller: Option<&Caller>,
    ) -> Result<CreatedVolume, BridgeError> {
        let volume = NewVolume {
            name: record.csi_name.clone(),
            required_bytes,
            capability: spec.capability.clone(),
            parameters: spec.parameters.clone(),
            secrets: self.settings.secrets(SecretUse::Provisioner).await?,
            content_source: record.content_source.clone(),
            accessibility: self.config.accessibility.clone(),
        };
        // After the last await before the call: a hook's caller gone by now (it waited
        // for the store, the apiserver, a Secret) gets no volume made only to be deleted.
        if caller.is_some_and(Caller::is_gone) {
            return Err(BridgeError::CallerGone);
        }
        faults::point(hook, When::Before, "CreateVolume");
        let reply = self
            .driver
            .controller()
            .create_volume(&volume, deadline)
            .await;
        faults::point(hook, When::After, "CreateVolume");
        self.driver.driver(reply).await
    }

    async fn delete_volume(
        &self,
        hook: HookKind,
        csi_volume_id: &str,
        secrets: &Secrets,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        faults::point(hook, When::Before, "DeleteVolume");
        let reply = self
            .driver
            .controller()
            .delete_volume(csi_volume_id, secrets, deadline)
            .await;
        faults::point(hook, When::After, "DeleteVolume");
        self.driver.driver(reply).await
    }

    /// Records the intent to create (state Creating), or adopts the record another
    /// replica or an earlier attempt left for this volume, refreshing its age so that no
    /// sweep takes it for abandoned while this Create works on it. The flag says whether
    /// this call wrote the intent (no record existed before).
    async fn begin_create(
        &self,
        volume_id: &str,
        csi_name: &str,
        csi_driver: &str,
        deletion: Option<&DeletionPolicy>,
    ) -> Result<(VolumeRecord, bool), BridgeError> {
        // One more round than the other races get: the first writes without reading.
        for round in 0..=STORE_RACE_RETRIES {
            // A new volume (a Create's usual case) is written without reading first: a
            // record written with no revision is refused as a conflict when one exists,
            // and the next round reads it. One store call less before CreateVolume.
            let existing = match round {
                0 => None,
                _ => self.controller_store().get(volume_id).await?,
            };
            let ours = existing.is_none();
            let mut record = match existing {
                Some(existing) => {
                    // Its CreateVolume name is the one it records (signed below), not
                    // the fresh one this call drew.
                    check_same_driver(&existing, csi_driver)?;
                    if existing.state == VolumeState::Deleting {
                        return Err(being_reclaimed(volume_id));
                    }
                    // Whoever can write the store could have planted it: its content
                    // source would have the driver fill the new volume with another
                    // volume's data, and refreshing it would sign what it says.
                    self.check_integrity_before(&existing, "go on with Create")
                        .await?;
                    if existing.state == VolumeState::Created {
                        return Ok((existing, false));
                    }
                    let mut touched = existing;
                    touched.updated_at = self.now_secs();
                    touched
                }
                None => VolumeRecord {
                    volume_id: volume_id.to_string(),
                    csi_name: csi_name.to_string(),
                    csi_driver: Some(csi_driver.to_string()),
                    state: VolumeState::Creating,
                    csi_volume_id: None,
                    volume_context: Default::default(),
                    // What CreateVolume asks for, so that a repeat asks the same.
                    capacity_bytes: self.config.capacity_bytes as i64,
                    updated_at: self.now_secs(),
                    deletion: deletion.cloned(),
                    revision: None,
                    integrity: None,
                    content_source: None,
                    accessible_topology: Vec::new(),
                    node_expansion_required: false,
                    answering_creates: Vec::new(),
                },
            };
            match self.store_put(HookKind::Create, &mut record).await {
                Ok(()) => return Ok((record, ours)),
                Err(BridgeError::Store(StoreError::Conflict { .. })) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::Conflict {
            volume_id: volume_id.to_string(),
        }
        .into())
    }

    /// Records the created volume, with `attempt` among the Creates that answer CubeMaster
    /// with it (this call is about to). A replica that raced this one and recorded the same
    /// handle first keeps its place beside this one; a sweep that claimed the record
    /// meanwhile is a failure.
    async fn finish_create(
        &self,
        mut record: VolumeRecord,
        volume: &CreatedVolume,
        deletion: Option<&DeletionPolicy>,
        attempt: &str,
    ) -> Result<(), BridgeError> {
        // When a volume became created is kept by a Create that finds it so (a repeated
        // Create, one of a restored volume): a forked Create's front tells by it what its
        // own worker finished (`withdraw_unanswered_create`).
        let same_volume = record.csi_volume_id.as_deref() == Some(volume.csi_volume_id.as_str());
        let created_at =
            (record.state == VolumeState::Created && same_volume).then_some(record.updated_at);
        // A volume the driver made anew (the recorded one gone) was answered by nobody yet.
        if record.state == VolumeState::Created && !same_volume {
            record.answering_creates.clear();
        }
        for _ in 0..STORE_RACE_RETRIES {
            record.state = VolumeState::Created;
            record.deletion = deletion.cloned();
            record.csi_volume_id = Some(volume.csi_volume_id.clone());
            record.volume_context = volume.volume_context.clone();
            // A volume `expand` grew keeps its grown size, whatever the driver reports.
            record.capacity_bytes = volume.capacity_bytes.max(record.capacity_bytes);
            record.accessible_topology = volume.accessible_topology.clone();
            record.updated_at = created_at.unwrap_or_else(|| self.now_secs());
            if !record.answering_creates.iter().any(|a| a == attempt) {
                record.answering_creates.push(attempt.to_string());
                let extra = record
                    .answering_creates
                    .len()
                    .saturating_sub(ANSWERING_CREATES_KEPT);
                record.answering_creates.drain(..extra);
            }
            match self.store_put(HookKind::Create, &mut record).await {
                Ok(()) => return Ok(()),
                Err(BridgeError::Store(StoreError::Conflict { .. })) => {}
                Err(e) => return Err(e),
            }
            match self.controller_store().get(&record.volume_id).await? {
                Some(current)
                    if current.csi_volume_id.as_deref() == Some(&volume.csi_volume_id)
                        && current.state == VolumeState::Created
                        && current.answering_creates.iter().any(|a| a == attempt) =>
                {
                    return Ok(());
                }
                Some(current) if current.state == VolumeState::Deleting => {
                    return Err(being_reclaimed(&record.volume_id));
                }
                // Another Create's record (written after this one's was removed): it
                // stands for the volume that Create made, not this one.
                Some(current) if current.csi_name != record.csi_name => {
                    return Err(BridgeError::Precondition(format!(
                        "the record of this volume now stands for another Create's CSI volume \
                         (name {:?}, not {:?})",
                        current.csi_name, record.csi_name
                    )));
                }
                Some(current) => {
                    // Written over, so signed anew: only if the bridge wrote it.
                    self.check_integrity_before(&current, "record the created volume")
                        .await?;
                    record = current;
                }
                None => {
                    return Err(BridgeError::Precondition(format!(
                        "the record of this volume was deleted while CSI volume {:?} was \
                         being created (a concurrent Destroy?); the CSI volume may need \
                         deleting",
                        volume.csi_volume_id
                    )));
                }
            }
        }
        Err(StoreError::Conflict {
            volume_id: record.volume_id,
        }
        .into())
    }

    /// Cube Create. Cube never Destroys after a failed Create, so a Create whose caller
    /// left deletes what it made.
    pub async fn create(&self, req: CreateVolume, caller: &Caller) -> Result<Created, HookError> {
        let volume_id = req.volume_id.clone();
        super::hook(self.recorder.as_ref(), HookKind::Create, &volume_id, async {
            // Not `while_awaited`: a CreateVolume cut short by its caller's leaving would
            // be uncertain, its volume left to the sweep, where a retry that gets its
            // answer lets the undo delete it at once.
            let deadline = Deadline::after(self.config.timeouts.create);
            let (identity, caps) = self.driver.controller_view(&deadline).await?;
            require_create_delete(&identity, caps.as_ref())?;
            // Resolved before anything is written: a bad StorageClass changes nothing.
            let spec = self.settings.spec(&identity.name).await?;
            super::fit::controller_fits(
                &identity,
                caps.as_ref(),
                spec.capability.access_mode,
                self.config.accessibility.as_ref(),
            )?;
            let _guard = self
                .locks
                .acquire(LockScope::Controller, &req.volume_id, &deadline)
                .await?;
            // A caller gone while this waited (behind another Create's undo, an operator's
            // expand, the driver, the apiserver) was told the Create failed: nothing is
            // made for it, not even a volume for the undo to delete.
            if caller.is_gone() {
                return Err(BridgeError::CallerGone);
            }
            // Intent first: if the answer to CreateVolume is lost, Destroy (or the sweep)
            // can still find the volume by the name it records. A new volume gets a name
            // of its own; a Create that finds an intent asks again by the name it holds.
            let attempt = new_create_attempt();
            let (record, intent_is_ours) = self
                .begin_create(
                    &req.volume_id,
                    &fresh_csi_volume_name(&self.config.name_prefix, &req.volume_id),
                    &identity.name,
                    spec.deletion.as_ref(),
                )
                .await?;
            let csi_name = record.csi_name.clone();
            tracing::info!(name = %req.name, csi_name, "creating CSI volume");

            // A volume `restore` or `clone` recorded is asked for as it was made, and an
            // intent with the size it recorded.
            let volume = match self
                .create_volume(
                    HookKind::Create,
                    &record,
                    self.asked_bytes(&record),
                    &spec,
                    &deadline,
                    Some(caller),
                )
                .await
            {
                Ok(v) => v,
                Err(error) => {
                    // A final error means this call created nothing: forget the intent if
                    // this call wrote it. An earlier attempt's intent stays: its
                    // CreateVolume may have made the volume, and only the record lets
                    // Destroy or the sweep find it.
                    if !error.is_uncertain_driver_error() && intent_is_ours {
                        match self.store_delete(HookKind::Create, &record).await {
                            Ok(()) | Err(StoreError::Conflict { .. }) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                    return Err(error);
                }
            };

            // What this call asked for; a finished volume is held to what is configured now.
            let required = match record.state {
                VolumeState::Created => self.config.capacity_bytes as i64,
                _ => self.asked_bytes(&record) as i64,
            };
            let handle = VolumeHandle {
                csi_volume_id: volume.csi_volume_id.clone(),
                volume_context: volume.volume_context.clone(),
                controller_publish: caps.is_some_and(|c| c.publish_unpublish_volume),
                topology: volume.accessible_topology.clone(),
            };
            if volume.capacity_bytes != 0
                && volume.capacity_bytes < required
                && record.state == VolumeState::Created
            {
                // An earlier Create finished with this volume and Cube may be using it:
                // refuse, but delete nothing.
                return Err(BridgeError::Precondition(format!(
                    "CSI volume {:?} was created with {} bytes, less than the {required} now \
                     configured (volume.capacity_bytes changed?); Destroy it to make a new one",
                    volume.csi_volume_id, volume.capacity_bytes
                )));
            }
            let encoded = if volume.capacity_bytes != 0 && volume.capacity_bytes < required {
                Err(format!(
                    "the driver created a volume of {} bytes, less than the {required} requested",
                    volume.capacity_bytes
                ))
            } else if caller.is_gone() && record.state == VolumeState::Creating {
                Err("the caller stopped waiting for Create".to_string())
            } else {
                handle.encode_for(&self.config.driver)
            };
            let private_data = match encoded {
                Ok(private_data) => private_data,
                Err(problem) => {
                    return Err(self
                        .undo_create(
                            &req.volume_id,
                            &csi_name,
                            &volume.csi_volume_id,
                            &attempt,
                            problem,
                        )
                        .await);
                }
            };

            // Made by this call (or by an earlier one whose answer never reached Cube), not
            // a volume an earlier Create already handed to CubeMaster.
            // A finished record whose volume the driver no longer has (deleted behind the
            // bridge, or by a Destroy whose record removal failed, which CubeMaster then
            // forgot) got a new one from this call: that one is this call's too.
            let made_here = record.state == VolumeState::Creating
                || record.csi_volume_id.as_deref() != Some(volume.csi_volume_id.as_str());
            if record.state == VolumeState::Created && made_here {
                // Usually the old one is gone; a driver whose handles follow its parameters
                // (changed since) may still have it, and no record names it any more.
                tracing::warn!(
                    recorded = record.csi_volume_id.as_deref().unwrap_or(""),
                    answered = %volume.csi_volume_id,
                    "CreateVolume answered another CSI volume than the one recorded for this \
                     volume: the new one is recorded; delete the old one by hand if it still exists"
                );
            }
            if let Err(error) = self
                .finish_create(record, &volume, spec.deletion.as_ref(), &attempt)
                .await
            {
                if !made_here {
                    return Err(error);
                }
                // The write may have been applied all the same (a replace whose answer was
                // lost): a record left created is one no sweep reclaims, of a volume Cube,
                // told the Create failed, never Destroys. What this call made goes.
                return Err(self
                    .undo_create(
                        &req.volume_id,
                        &csi_name,
                        &volume.csi_volume_id,
                        &attempt,
                        format!("recording the created volume failed: {error}"),
                    )
                    .await);
            }
            tracing::info!(csi_volume_id = %volume.csi_volume_id, "CSI volume created");
            let created = Created {
                token: String::new(),
                private_data,
            };
            // Handed over while the lock is still held (a retried Create waits): a volume
            // whose answer never reached CubeMaster (a forked hook's front killed before
            // printing it, an rpc caller gone) is one Cube will never Destroy. A volume an
            // earlier Create handed out stays: CubeMaster has that answer, and may be using
            // the volume.
            if !caller.deliver(Answer::Created(created.clone())).await {
                if !made_here {
                    return Err(BridgeError::CallerGone);
                }
                return Err(self
                    .undo_create(
                        &req.volume_id,
                        &csi_name,
                        &volume.csi_volume_id,
                        &attempt,
                        "the answer to Create never reached CubeMaster (its caller left \
                         before it was written)"
                            .to_string(),
                    )
                    .await);
            }
            Ok(created)
        })
        .await
    }

    /// Deletes a volume Create (its `attempt`) cannot hand to Cube, and reports why.
    async fn undo_create(
        &self,
        volume_id: &str,
        csi_name: &str,
        csi_volume_id: &str,
        attempt: &str,
        problem: String,
    ) -> BridgeError {
        let error = BridgeError::Precondition(problem);
        let undone = self
            .delete_unanswered(volume_id, csi_name, csi_volume_id, Some(attempt))
            .await;
        match undone {
            Ok(Undo::Deleted) => {
                self.recorder.rollback("create", "undone");
                error
            }
            // Nothing of this call's to undo: the volume is another Create's to answer for.
            Ok(Undo::TakenOver) => error,
            Err(rollback) => {
                self.recorder.rollback("create", "failed");
                BridgeError::RollbackFailed {
                    error: Box::new(error),
                    rollback: Box::new(rollback),
                }
            }
        }
    }

    /// Deletes a volume CubeMaster never learned of from `attempt` (the Create that made
    /// it, None for the forked front that does not know its worker's), and its record,
    /// unless another Create is listed as answering with it: that one, on another replica,
    /// took this Create over and may have handed the volume to CubeMaster, so the volume
    /// is left to it and `attempt` only takes itself off the list. A record that names
    /// another CreateVolume name (`csi_name`: another Create's, written after this one's
    /// was removed) is not this volume's: the volume is deleted and the record left alone.
    async fn delete_unanswered(
        &self,
        volume_id: &str,
        csi_name: &str,
        csi_volume_id: &str,
        attempt: Option<&str>,
    ) -> Result<Undo, BridgeError> {
        let deadline = Deadline::after(self.config.timeouts.rollback);
        // The record is claimed for deletion first, at the revision read: a Create that
        // adds itself meanwhile makes the claim conflict (and is seen on the next read),
        // and one that comes after finds the claim and answers nothing. Stopped between
        // DeleteVolume and the record's removal (a kill, a failed call), the claim is
        // swept like any unfinished one; a record left saying created would name a
        // deleted volume that no sweep reclaims and Cube never Destroys.
        let mut rounds = 0;
        // A store that fails for a moment is waited out within the rollback budget: a
        // claim given up leaves the record created, which no sweep reclaims, of a volume
        // Cube was told failed and never Destroys.
        let mut pause = STORE_RETRY_FIRST_PAUSE;
        let mut wait_out = |error: BridgeError| {
            let retry = store_transient(&error) && deadline.remaining() > pause;
            let waited = pause;
            pause = (pause * 2).min(STORE_RETRY_MAX_PAUSE);
            match retry {
                true => {
                    tracing::warn!(%error, "claiming the record of the unanswered Create failed; retrying");
                    Ok(waited)
                }
                false => Err(error),
            }
        };
        loop {
            let found = match self.controller_store().get(volume_id).await {
                Ok(found) => found,
                Err(e) => {
                    tokio::time::sleep(wait_out(e.into())?).await;
                    continue;
                }
            };
            let Some(mut record) = found else {
                break;
            };
            if record.csi_name != csi_name {
                let secrets = self.settings.secrets(SecretUse::Provisioner).await?;
                self.delete_volume(HookKind::Create, csi_volume_id, &secrets, &deadline)
                    .await?;
                return Ok(Undo::Deleted);
            }
            // A record that fails its check is never signed here: the claim below would
            // give a forged handle (another volume's) a valid MAC, for the sweep to
            // delete. The volume this call made is deleted by its own handle, and the
            // record is left, unsigned by us, for the operator.
            match self.check_integrity(&record).await {
                Ok(()) => {}
                Err(BridgeError::Precondition(why)) => {
                    tracing::warn!(
                        csi_volume_id,
                        %why,
                        "undoing the unanswered Create without claiming its record"
                    );
                    let secrets = self.settings.secrets(SecretUse::Provisioner).await?;
                    self.delete_volume(HookKind::Create, csi_volume_id, &secrets, &deadline)
                        .await?;
                    return Ok(Undo::Deleted);
                }
                Err(error) => return Err(error),
            }
            let others = record
                .answering_creates
                .iter()
                .any(|a| Some(a.as_str()) != attempt);
            if others {
                tracing::warn!(
                    csi_volume_id,
                    "another Create (another replica) recorded this volume too and may have \
                     handed it to CubeMaster; leaving it to that one"
                );
                let before = record.answering_creates.len();
                record
                    .answering_creates
                    .retain(|a| Some(a.as_str()) != attempt);
                if record.answering_creates.len() == before {
                    return Ok(Undo::TakenOver);
                }
            } else if record.state != VolumeState::Deleting {
                record.state = VolumeState::Deleting;
                record.updated_at = self.now_secs();
                // A Create whose last write failed left it creating: the claim names the
                // volume it made, so that whoever finishes the claim deletes that one.
                record
                    .csi_volume_id
                    .get_or_insert_with(|| csi_volume_id.to_string());
            } else {
                break;
            }
            match self.store_put(HookKind::Create, &mut record).await {
                Ok(()) if others => return Ok(Undo::TakenOver),
                Ok(()) => break,
                Err(BridgeError::Store(StoreError::Conflict { .. }))
                    if rounds < STORE_RACE_RETRIES =>
                {
                    rounds += 1;
                }
                Err(e) => tokio::time::sleep(wait_out(e)?).await,
            }
        }
        let secrets = self.settings.secrets(SecretUse::Provisioner).await?;
        self.delete_volume(HookKind::Create, csi_volume_id, &secrets, &deadline)
            .await?;
        if let Some(record) = self.controller_store().get(volume_id).await? {
            self.store_delete(HookKind::Create, &record).await?;
        }
        Ok(Undo::Deleted)
    }

    /// The front of a forked Create whose worker died without answering: CubeMaster counts
    /// the Create failed, deletes its row and never Destroys the volume, so a volume this
    /// Create finished (recorded created at or after `since`, seconds since the epoch, when
    /// the front started) is deleted, as `undo_create` deletes one whose answer never
    /// reached an rpc caller. An unfinished one is the abandoned-create sweep's; one that
    /// became created earlier (another Create's, whose answer was lost) is left, as the
    /// rpc path leaves it; so is a restored or cloned one, even when restored in the
    /// same second: its data is an operator's, and a later Create of the id adopts it
    /// again. The record is claimed before DeleteVolume, so that a failure or a kill
    /// leaves it to the sweep. True when a volume was deleted.
    pub async fn withdraw_unanswered_create(
        &self,
        volume_id: &str,
        since: u64,
    ) -> Result<bool, BridgeError> {
        let deadline = Deadline::after(self.config.timeouts.rollback);
        let (_guard, record) = self.lock_and_load(volume_id, &deadline).await?;
        let Some(record) = record else {
            return Ok(false);
        };
        let Some(csi_volume_id) = record.csi_volume_id.clone() else {
            return Ok(false);
        };
        if record.state != VolumeState::Created
            || record.updated_at < since
            || record.content_source.is_some()
        {
            return Ok(false);
        }
        self.check_integrity(&record).await?;
        // Its worker, had it added itself, is the last listed; with any other listed, the
        // volume is left as `delete_unanswered` leaves it.
        let worker = record.answering_creates.last().map(String::as_str);
        let undone = self
            .delete_unanswered(volume_id, &record.csi_name, &csi_volume_id, worker)
            .await;
        match &undone {
            Ok(Undo::Deleted) => self.recorder.rollback("create", "undone"),
            Ok(Undo::TakenOver) => {}
            Err(_) => self.recorder.rollback("create", "failed"),
        }
        undone.map(|undo| undo == Undo::Deleted)
    }

    /// The volume's lock, and its record read under it. The record key is loaded first:
    /// making it signs records from before keys existed.
    async fn lock_and_load(
        &self,
        volume_id: &str,
        deadline: &Deadline,
    ) -> Result<(LockGuard, Option<VolumeRecord>), BridgeError> {
        let guard = self
            .locks
            .acquire(LockScope::Controller, volume_id, deadline)
            .await?;
        self.record_key().await?;
        let record = self.controller_store().get(volume_id).await?;
        Ok((guard, record))
    }

    /// Cube Destroy. A caller that left before DeleteVolume deletes nothing: CubeMaster,
    /// told the Destroy failed, keeps the volume listed and may hand it to a sandbox.
    pub async fn destroy(&self, req: DestroyVolume, caller: &Caller) -> Result<(), HookError> {
        let volume_id = req.volume_id.clone();
        super::hook(
            self.recorder.as_ref(),
            HookKind::Destroy,
            &volume_id,
            async {
                let deadline = Deadline::after(self.config.timeouts.destroy);
                let (_guard, record) = self.lock_and_load(&req.volume_id, &deadline).await?;
                let Some(record) = record else {
                    tracing::info!("no record of this volume; nothing to delete");
                    return Ok(());
                };
                let deleted = self
                    .delete_recorded(HookKind::Destroy, record, caller, &deadline)
                    .await;
                if matches!(deleted, Err(BridgeError::CallerGone)) {
                    tracing::warn!(
                        "the caller of this Destroy left before the volume was deleted, so \
                         nothing was: CubeMaster, told it failed, keeps the volume. Its next \
                         Destroy deletes it; if CubeMaster no longer lists it (the clean-up \
                         Destroy after a Create it could not save), run \
                         `cube-csi-bridge --op destroy --volume-id {}`",
                        req.volume_id
                    );
                }
                deleted
            },
        )
        .await
    }

    /// Deletes the CSI volume a record names (resolving an unfinished create by name
    /// first) and then the record.
    async fn delete_recorded(
        &self,
        hook: HookKind,
        record: VolumeRecord,
        caller: &Caller,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        self.check_integrity(&record).await?;
        let (identity, _) = self.driver.controller_view(deadline).await?;
        check_same_driver(&record, &identity.name)?;
        // A finished create recorded how to delete it; only an unfinished one (or a
        // record from before that existed) needs the current settings.
        let (csi_volume_id, deletion) = match (
            &record.state,
            &record.csi_volume_id,
            &record.deletion,
        ) {
            (VolumeState::Created, Some(id), Some(deletion)) => {
                (id.clone(), Some(deletion.clone()))
            }
            (VolumeState::Created, Some(id), None) => (
                id.clone(),
                self.settings.spec(&identity.name).await?.deletion,
            ),
            // Claimed by the undo of a Create whose answer never reached Cube, which knew
            // the volume: deleted by that handle, whatever the reclaim policy (Cube never
            // had the volume, as the undo decided), not resolved again by a CreateVolume
            // that may be refused for good (a raised capacity, a StorageClass or content
            // source gone) or would make a volume only to delete it.
            (VolumeState::Deleting, Some(id), recorded) => (
                id.clone(),
                recorded
                    .clone()
                    .map(|d| DeletionPolicy { retain: false, ..d }),
            ),
            _ => {
                // Not even a volume made to be deleted for a caller that left.
                if caller.is_gone() {
                    return Err(BridgeError::CallerGone);
                }
                // The answer to an earlier CreateVolume was lost. CreateVolume is
                // idempotent by name: asking again returns the volume if it exists.
                tracing::info!(csi_name = %record.csi_name, "resolving an unfinished create before deleting");
                let spec = self.settings.spec(&identity.name).await?;
                // Exactly what the intent recorded, 0 (no size) too: any size that
                // differs is ALREADY_EXISTS for good if the volume exists, and one that
                // does not is made only to be deleted.
                let asked = record.capacity_bytes.max(0) as u64;
                let id = self
                    .create_volume(hook, &record, asked, &spec, deadline, Some(caller))
                    .await?
                    .csi_volume_id;
                // Deleted whatever the reclaim policy, as the undo deletes: a Create
                // never finished is one whose volume Cube never had, and a Retain policy
                // would keep it for nobody (no record names it once this one is gone).
                let deletion = spec.deletion.or(record.deletion.clone());
                (id, deletion.map(|d| DeletionPolicy { retain: false, ..d }))
            }
        };
        let retain = deletion.as_ref().is_some_and(|d| d.retain);
        let secrets = if retain {
            None
        } else {
            Some(self.settings.deletion_secrets(deletion.as_ref()).await?)
        };
        // The last moment to stop, after the last await before the deletion: a Destroy's
        // caller gone by now (it waited for the lock, the driver, the apiserver, a
        // deletion Secret) was told it failed, and the volume stays Cube's.
        if caller.is_gone() {
            return Err(BridgeError::CallerGone);
        }
        match secrets {
            None => {
                tracing::warn!(%csi_volume_id, csi_name = %record.csi_name, "StorageClass reclaimPolicy is Retain: the CSI volume is kept; delete it by hand when no longer needed");
            }
            Some(secrets) => {
                self.delete_volume(hook, &csi_volume_id, &secrets, deadline)
                    .await?;
            }
        }
        match self.store_delete(hook, &record).await {
            Ok(()) => {}
            // Another replica changed or removed the record meanwhile; what matters is
            // that it no longer names a live volume.
            Err(StoreError::Conflict { .. }) => {
                match self.controller_store().get(&record.volume_id).await? {
                    None => {}
                    Some(current) if current.csi_volume_id.as_deref() == Some(&csi_volume_id) => {
                        self.store_delete(hook, &current).await?;
                    }
                    Some(_) => {
                        return Err(StoreError::Conflict {
                            volume_id: record.volume_id.clone(),
                        }
                        .into());
                    }
                }
            }
            Err(e) => return Err(e.into()),
        }
        tracing::info!(%csi_volume_id, "CSI volume deleted");
        Ok(())
    }

    /// Resolves abandoned creates: `Creating` records (and `Deleting` claims whose
    /// sweeper died) untouched for longer than `grace`, by the wall clocks of their writer
    /// and of this process (a one-shot sweep: a forked hook's). `Created` records are
    /// never judged here: only an operator can tell a leak from a volume in use.
    pub async fn sweep_abandoned_creates(
        &self,
        grace: Duration,
    ) -> Result<SweepReport, BridgeError> {
        self.sweep(grace, false).await
    }

    /// `sweep_abandoned_creates` for a process that sweeps again and again (the daemon):
    /// a record is abandoned only once this process has also seen it unchanged for the
    /// whole grace (`abandoned_after`).
    pub async fn sweep_abandoned_creates_watched(
        &self,
        grace: Duration,
    ) -> Result<SweepReport, BridgeError> {
        self.sweep(grace, true).await
    }

    async fn sweep(&self, grace: Duration, watched: bool) -> Result<SweepReport, BridgeError> {
        self.record_key().await?;
        let mut report = SweepReport::default();
        let records = self.controller_store().list().await?;
        self.forget_sightings(
            "volume",
            records
                .iter()
                .filter(|r| r.state != VolumeState::Created)
                .map(|r| r.volume_id.as_str()),
        );
        for record in records {
            let abandoned = record.state != VolumeState::Created
                && self.abandoned_after(
                    sighting_key("volume", &record.volume_id),
                    (record.revision.clone(), record.updated_at, record.state),
                    grace,
                    watched,
                );
            if !abandoned {
                continue;
            }
            let span = tracing::info_span!("sweep", volume_id = %record.volume_id);
            let volume_id = record.volume_id.clone();
            let outcome = self.reclaim(record).await;
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
                    span.in_scope(|| {
                        tracing::warn!("deleted the CSI volume of an abandoned Create")
                    });
                    report.reclaimed += 1;
                }
                Ok(false) => report.skipped += 1,
                Err(error) => {
                    span.in_scope(|| tracing::error!(%volume_id, %error, "reclaiming an abandoned Create failed; the next sweep retries"));
                    report.failed += 1;
                }
            }
        }
        // Volumes first: a store without snapshot records (a CRD not yet installed) must
        // not keep the volumes' sweep from reporting.
        if let Err(error) = self
            .sweep_abandoned_snapshots(grace, watched, &mut report)
            .await
        {
            tracing::error!(%error, "sweeping abandoned snapshot creates failed; the next sweep retries");
            report.failed += 1;
        }
        Ok(report)
    }

    /// Claims one abandoned record and deletes what it names. `false`: someone else
    /// holds or claimed it.
    pub(crate) async fn reclaim(&self, mut record: VolumeRecord) -> Result<bool, BridgeError> {
        // A Create in this process, or another process on this host, holds the lock.
        let Some(_guard) = self
            .locks
            .try_acquire(LockScope::Controller, &record.volume_id)?
        else {
            return Ok(false);
        };
        // Checked before the claim re-signs it.
        self.check_integrity(&record).await?;
        record.state = VolumeState::Deleting;
        record.updated_at = self.now_secs();
        match self.store_put(HookKind::Destroy, &mut record).await {
            Ok(()) => {}
            // A replica refreshed (a Create still retrying) or claimed it first.
            Err(BridgeError::Store(StoreError::Conflict { .. })) => return Ok(false),
            Err(e) => return Err(e),
        }
        let deadline = Deadline::after(self.config.timeouts.destroy);
        // No caller: the sweep's deletions are its own.
        self.delete_recorded(HookKind::Destroy, record, &Caller::waiting(), &deadline)
            .await?;
        Ok(true)
    }
}

impl ControllerSide {
    /// `cube-csi-bridge expand`, the controller's part: grows the recorded volume to
    /// `size` bytes with ControllerExpandVolume (or, for a driver that grows volumes on
    /// nodes only, records the size for NodeExpandVolume), then records the new capacity
    /// (re-signed). `attached` says where this process knows the volume to be staged or
    /// published: an offline driver's volume is refused while it is anywhere. Nothing
    /// changes on a refusal. Holds the volume's controller lock, so that no Create or
    /// Destroy of it interleaves.
    pub async fn expand(
        &self,
        volume_id: &str,
        size: u64,
        attached: &[String],
    ) -> Result<ControllerExpansion, BridgeError> {
        let deadline = Deadline::after(self.config.timeouts.create);
        let (_guard, record) = self.lock_and_load(volume_id, &deadline).await?;
        let Some(record) = record else {
            return Err(BridgeError::InvalidRequest(format!(
                "volume {volume_id:?} is unknown: {} has no record of it (Cube never created \
                 it through this bridge, or it was destroyed)",
                self.controller_store().describe()
            )));
        };
        if record.state != VolumeState::Created {
            return Err(BridgeError::Precondition(format!(
                "volume {volume_id:?} is still {} in {}: only a created volume can be expanded",
                record.state.as_str(),
                self.controller_store().locate(volume_id)
            )));
        }
        self.check_integrity_before(&record, "expand anything")
            .await?;
        let (identity, caps) = self.driver.controller_view(&deadline).await?;
        check_same_driver(&record, &identity.name)?;
        let controller_expands = caps.is_some_and(|c| c.expand_volume);
        let node_expands = !controller_expands
            && self
                .driver
                .node_caps(&deadline)
                .await
                .is_ok_and(|c| c.expand_volume);
        if !controller_expands && !node_expands {
            return Err(BridgeError::Precondition(format!(
                "CSI driver {} cannot expand volumes: it has neither the EXPAND_VOLUME \
                 controller capability (ControllerExpandVolume) nor the EXPAND_VOLUME node \
                 capability (NodeExpandVolume)",
                identity.name
            )));
        }
        let mode = identity
            .volume_expansion
            .unwrap_or(super::ports::ExpansionMode::Offline);
        let current = record
            .capacity_bytes
            .max(self.config.capacity_bytes.min(i64::MAX as u64) as i64);
        let wanted = size.min(i64::MAX as u64) as i64;
        if wanted < current {
            return Err(BridgeError::InvalidRequest(format!(
                "volume {volume_id:?} has {current} bytes ({}); {wanted} bytes ({}) is smaller, \
                 and CSI volumes only grow",
                super::expansion::human_size(current),
                super::expansion::human_size(wanted)
            )));
        }
        if mode == super::ports::ExpansionMode::Offline && !attached.is_empty() {
            return Err(BridgeError::Precondition(format!(
                "CSI driver {} expands volumes offline only (its VolumeExpansion plugin \
                 capability is {}), and volume {volume_id:?} is in use: {}. Expand it once \
                 every sandbox using it has stopped (no holder left)",
                identity.name,
                if identity.volume_expansion.is_some() {
                    "OFFLINE"
                } else {
                    "not advertised"
                },
                attached.join("; ")
            )));
        }
        let csi_volume_id = record.csi_volume_id.clone().unwrap_or_default();
        let previous_bytes = record.capacity_bytes;
        // A repeated expand to the recorded size only finishes the nodes' part.
        let already = record.capacity_bytes == wanted && wanted > 0;
        let answer = if already || !controller_expands {
            ControllerExpanded {
                capacity_bytes: wanted,
                node_expansion_required: if already {
                    record.node_expansion_required
                } else {
                    true
                },
            }
        } else {
            let spec = self.settings.spec(&identity.name).await?;
            let call = ControllerExpand {
                csi_volume_id: csi_volume_id.clone(),
                required_bytes: size,
                capability: spec.capability,
                secrets: self.settings.secrets(SecretUse::ControllerExpand).await?,
            };
            tracing::info!(%csi_volume_id, size, "expanding CSI volume");
            let reply = self
                .driver
                .controller()
                .expand_volume(&call, &deadline)
                .await;
            self.driver.driver(reply).await?
        };
        let capacity_bytes = answer.capacity_bytes.max(wanted);
        if !already {
            self.record_capacity(record, capacity_bytes, answer.node_expansion_required)
                .await?;
        }
        Ok(ControllerExpansion {
            csi_volume_id,
            previous_bytes,
            capacity_bytes,
            controller_call: controller_expands && !already,
            node_expansion_required: answer.node_expansion_required,
            mode,
        })
    }

    /// Records a volume's new capacity (re-signed); a replica that changed the record
    /// meanwhile (another expand) is re-read, and a larger capacity it recorded stays.
    async fn record_capacity(
        &self,
        mut record: VolumeRecord,
        capacity_bytes: i64,
        node_expansion_required: bool,
    ) -> Result<(), BridgeError> {
        for _ in 0..STORE_RACE_RETRIES {
            if record.capacity_bytes > capacity_bytes {
                return Ok(());
            }
            record.capacity_bytes = capacity_bytes;
            record.node_expansion_required = node_expansion_required;
            record.updated_at = self.now_secs();
            match self.store_put(HookKind::Create, &mut record).await {
                Ok(()) => return Ok(()),
                Err(BridgeError::Store(StoreError::Conflict { .. })) => {}
                Err(e) => return Err(e),
            }
            match self.controller_store().get(&record.volume_id).await? {
                Some(current) if current.csi_volume_id == record.csi_volume_id => {
                    // Signed again below: only as the bridge wrote it.
                    self.check_integrity_before(&current, "record a new capacity")
                        .await?;
                    record = current;
                }
                _ => {
                    return Err(BridgeError::Precondition(format!(
                        "the record of volume {:?} was deleted or replaced while it was being \
                         expanded (a concurrent Destroy?)",
                        record.volume_id
                    )));
                }
            }
        }
        Err(StoreError::Conflict {
            volume_id: record.volume_id,
        }
        .into())
    }
}

/// What the controller's part of an expansion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerExpansion {
    pub csi_volume_id: String,
    /// The capacity recorded before (0 = unknown).
    pub previous_bytes: i64,
    /// The capacity recorded now.
    pub capacity_bytes: i64,
    /// ControllerExpandVolume was called (false: the driver grows volumes on nodes only,
    /// or the volume already had this size).
    pub controller_call: bool,
    pub node_expansion_required: bool,
    pub mode: super::ports::ExpansionMode,
}

fn store_transient(error: &BridgeError) -> bool {
    matches!(error, BridgeError::Store(e) if e.is_transient())
}

/// What undoing an unanswered Create did.
#[derive(Debug, PartialEq, Eq)]
enum Undo {
    /// The volume and its record are deleted.
    Deleted,
    /// Another Create is listed as answering with the volume: it is left to that one.
    TakenOver,
}

/// A token naming one Create call, unique across calls and replicas: a per-process random
/// number (std's hasher seeds come from the OS) and a count.
fn new_create_attempt() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static PROCESS: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let process = PROCESS.get_or_init(|| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        hasher.finish()
    });
    format!("{process:016x}-{}", COUNT.fetch_add(1, Ordering::Relaxed))
}

fn being_reclaimed(volume_id: &str) -> BridgeError {
    BridgeError::Store(StoreError::Backend {
        store: "controller store".into(),
        action: format!("creating volume {volume_id:?}"),
        transient: true,
        source: "an earlier, abandoned Create of this volume is being cleaned up; retry in a \
                 moment"
            .into(),
    })
}

/// Refuses to hand a volume's handle to a different CSI driver than created it.
fn check_same_driver(record: &VolumeRecord, driver_name: &str) -> Result<(), BridgeError> {
    match &record.csi_driver {
        Some(created_by) if created_by != driver_name => Err(BridgeError::Precondition(format!(
            "this volume was created by CSI driver {created_by:?}, but the driver at the \
             controller endpoint is now {driver_name:?}; refusing to pass its handle to \
             another driver (point csi.controller_endpoint back at {created_by:?})"
        ))),
        _ => Ok(()),
    }
}

/// A transient failure of the settings source or the store at start is only a warning:
/// the API server may come later.
pub(crate) fn transient_is_a_warning(outcome: Result<(), BridgeError>) -> Result<(), BridgeError> {
    match outcome {
        Err(BridgeError::Settings(e)) if e.transient => {
            tracing::warn!(error = %e, "Kubernetes API not reachable yet; will retry on first use");
            Ok(())
        }
        Err(BridgeError::Store(e)) if e.is_transient() => {
            tracing::warn!(error = %e, "controller store not reachable yet; will retry on first use");
            Ok(())
        }
        other => other,
    }
}
