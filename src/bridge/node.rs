//! Attach and Detach: the node side, as kubelet would do it for one pod volume.
//!
//! Attach = [ControllerPublish] → [NodeStage at the staging path] → NodePublish at the
//! host_path → check that Cubelet sees the mount. Detach tears down only when no
//! namespace holds the volume any more.
//!
//! Cubelet counts holders per (namespace, volume): each namespace's ref_count is Cube's
//! truth for that namespace, while the mount is shared by all of them. The journal keeps
//! the union: which sandboxes of which namespaces hold the volume.
//!
//! The journal is written before every mutating call. A failed (or abandoned) Attach
//! undoes only its own work before answering, since Cube never Detaches after a failed
//! Attach, and the mount table, not ref_count, decides whether a volume is really attached.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::caller::Answer;
use super::discovery::DriverView;
use super::faults::{self, When};
use super::handoff::{AttachMetadata, VolumeHandle};
use super::naming::VolumePaths;
use super::ports::{
    ControllerPublish, DeadMount, DriverError, HostPaths, JournalError, KeptLock, LockGuard,
    LockScope, MountCheck, MountHealth, NodeJournal, PathError, Publish, Recorder, SecretUse,
    Secrets, Stage, Undone, Visibility, VolumeLocks, VolumeSettings,
};
use super::records::{HOLDER_LOG_LIMIT, HolderChange, Holders, NodeRecord, Step};
use super::{
    AttachVolume, Attached, BridgeError, Caller, Deadline, DetachVolume, HookError, HookKind,
    Settings, blocking,
};

/// Which optional calls Attach makes for this driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodePlan {
    pub stage: bool,
    /// The node id to ControllerPublish to, when the driver needs ControllerPublish.
    pub controller_publish_node: Option<String>,
    /// The driver's GetPluginInfo name.
    pub driver_name: String,
}

/// Which steps an undo reverses.
#[derive(Debug, Clone, Copy)]
struct UndoSteps {
    /// NodeUnpublish: false only to keep a mount that other holders were using before a
    /// failed Attach (the one target is shared by every holder).
    publish: bool,
    controller_publish: bool,
    stage: bool,
}

impl UndoSteps {
    const ALL: UndoSteps = UndoSteps {
        publish: true,
        controller_publish: true,
        stage: true,
    };
}

/// What the node side works through, each built by the composition root.
pub struct NodePorts {
    /// The driver, shared with the controller side of the same process.
    pub driver: Arc<DriverView>,
    pub journal: Arc<dyn NodeJournal>,
    pub settings: Arc<dyn VolumeSettings>,
    /// Where Cubelet looks for mounts.
    pub mounts: Arc<dyn MountCheck>,
    pub host_paths: Arc<dyn HostPaths>,
    pub locks: Arc<dyn VolumeLocks>,
    pub recorder: Arc<dyn Recorder>,
    /// This boot's id (records of another boot hold nothing).
    pub boot_id: String,
    /// Seconds since the epoch, for the record's `since`.
    pub clock: Arc<dyn super::ports::Clock>,
}

/// Attach and Detach of one Cube driver over one CSI driver, on this node.
pub struct NodeSide {
    pub(super) config: Settings,
    pub(super) driver: Arc<DriverView>,
    pub(super) journal: Arc<dyn NodeJournal>,
    pub(super) settings: Arc<dyn VolumeSettings>,
    pub(super) mounts: Arc<dyn MountCheck>,
    pub(super) host_paths: Arc<dyn HostPaths>,
    pub(super) locks: Arc<dyn VolumeLocks>,
    pub(super) recorder: Arc<dyn Recorder>,
    pub(super) boot_id: String,
    pub(super) clock: Arc<dyn super::ports::Clock>,
    /// Each published volume's condition at the last periodic check, to log changes only.
    pub(super) conditions:
        std::sync::Mutex<std::collections::BTreeMap<String, super::inventory::Condition>>,
    /// Volumes whose abandoned work failed in a scan of this process: when to try each
    /// again, and the pause after that (`reconcile::Backoff`).
    pub(super) retry_after: std::sync::Mutex<super::reconcile::Backoff>,
}

impl std::fmt::Debug for NodeSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSide")
            .field("driver", &self.config.driver)
            .field("csi", &self.driver)
            .field("journal", &self.journal)
            .finish_non_exhaustive()
    }
}

impl NodeSide {
    pub fn new(settings: Settings, ports: NodePorts) -> Self {
        Self {
            config: settings,
            driver: ports.driver,
            journal: ports.journal,
            settings: ports.settings,
            mounts: ports.mounts,
            host_paths: ports.host_paths,
            locks: ports.locks,
            recorder: ports.recorder,
            boot_id: ports.boot_id,
            clock: ports.clock,
            conditions: Default::default(),
            retry_after: Default::default(),
        }
    }

    /// The core's settings this side runs with.
    pub fn settings(&self) -> &Settings {
        &self.config
    }

    pub fn node_journal(&self) -> &Arc<dyn NodeJournal> {
        &self.journal
    }

    /// Checks, before serving, that the driver can do what Attach needs and that the
    /// settings fit it. An unreachable driver is only a warning.
    pub async fn check(&self, deadline: &Deadline) -> Result<(), BridgeError> {
        match self.node_plan(false, deadline).await {
            Ok(plan) => tracing::info!(
                endpoint = self.driver.node().endpoint(),
                stage_unstage = plan.stage,
                controller_publish = plan.controller_publish_node.is_some(),
                "node side: CSI driver found"
            ),
            Err(e) if e.is_uncertain_driver_error() => {
                tracing::warn!(error = %e, "node side: CSI driver not reachable yet; will connect on first use");
            }
            Err(e) => return Err(e),
        }
        let known = self.driver.known_name().await;
        let outcome = async {
            if let Some(line) = self.settings.check(known.as_deref()).await? {
                tracing::info!("{line}");
            }
            if known.is_some() {
                self.check_fits(deadline).await?;
            }
            Ok(())
        }
        .await;
        super::controller::transient_is_a_warning(outcome)
    }

    /// Refuses, before anything is changed, settings the driver cannot honour now (a
    /// mount group, a single-node writer mode): it may have been replaced since start.
    async fn check_fits(&self, deadline: &Deadline) -> Result<(), BridgeError> {
        let caps = self.driver.node_caps(deadline).await?;
        let (identity, _) = self.driver.controller_view(deadline).await?;
        let spec = self.settings.spec(&identity.name).await?;
        super::fit::node_fits(
            &identity.name,
            &caps,
            spec.capability.access_mode,
            self.config.mount_group,
        )
    }

    /// Refuses to attach a volume whose accessible topology (from its handle) does not
    /// include this node's (NodeGetInfo), before anything is changed.
    async fn check_topology(
        &self,
        handle: &VolumeHandle,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        if handle.topology.is_empty() {
            return Ok(());
        }
        let node = self.driver.node_topology(deadline).await?;
        super::fit::node_in_topology(&handle.csi_volume_id, &handle.topology, &node)
    }

    /// Whether `record` was written in an earlier boot of this host: its mounts and every
    /// sandbox that held it died with that boot, and Cubelet has forgotten its counts, so
    /// none of its holders may keep the volume attached. A side that does not know its
    /// own boot (app.rs refuses to open one) judges no record so.
    pub(crate) fn is_from_earlier_boot(&self, record: &NodeRecord) -> bool {
        !record.boot_id.is_empty() && !self.boot_id.is_empty() && record.boot_id != self.boot_id
    }

    /// Decides the calls Attach makes. `volume_needs_publish` comes from the volume's
    /// handle: the controller saw PUBLISH_UNPUBLISH_VOLUME when it created the volume.
    pub(crate) async fn node_plan(
        &self,
        volume_needs_publish: bool,
        deadline: &Deadline,
    ) -> Result<NodePlan, BridgeError> {
        let stage = self.driver.node_caps(deadline).await?.stage_unstage_volume;
        let (identity, caps) = self.driver.controller_view(deadline).await?;
        let driver_publishes = caps.is_some_and(|c| c.publish_unpublish_volume);
        if volume_needs_publish && !driver_publishes {
            return Err(BridgeError::Precondition(format!(
                "this volume needs ControllerPublishVolume (its driver had \
                 PUBLISH_UNPUBLISH_VOLUME when it was created), but {} ({}) offers no \
                 controller publish; set csi.controller_endpoint to the driver's controller",
                self.driver.controller().endpoint(),
                identity.name
            )));
        }
        let controller_publish_node = if driver_publishes {
            Some(self.driver.node_id(deadline).await?)
        } else {
            None
        };
        Ok(NodePlan {
            stage,
            controller_publish_node,
            driver_name: identity.name,
        })
    }

    /// Whether `path` is a mount point where Cubelet looks.
    pub(crate) async fn visibility(
        &self,
        path: &Path,
        deadline: &Deadline,
    ) -> Result<Visibility, BridgeError> {
        self.mounts.visibility(path, deadline).await.map_err(|e| {
            BridgeError::io(format!("reading mounts of {}", self.mounts.describe()), e)
        })
    }

    /// The error the filesystem mounted at `path` answers when it is gone (a FUSE daemon
    /// or network server that restarted); `None` when it answers. One stat, on the hot
    /// path too: a dead mount is still a mount point, so the mount check alone would hand
    /// it to a sandbox.
    pub(crate) async fn dead_mount(
        &self,
        path: &Path,
        deadline: &Deadline,
    ) -> Result<Option<DeadMount>, BridgeError> {
        match self.mounts.health(path, deadline).await {
            Ok(MountHealth::Answers) => Ok(None),
            Ok(MountHealth::Dead(dead)) => Ok(Some(dead)),
            Err(e) => Err(BridgeError::io(
                format!("checking that the filesystem at {} answers", path.display()),
                e,
            )),
        }
    }

    /// Takes down a dead mount before it is mounted again: NodeUnpublish and, when
    /// staged, NodeUnstage unless the stage still answers (the stage is the dead
    /// filesystem too, when the target is a bind of it). Holders stay in the record; a ControllerPublish stays (the volume is
    /// still this node's). A failure names the path, the error it answered and the step.
    async fn take_down_dead_mount(
        &self,
        record: &mut NodeRecord,
        dead: DeadMount,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        // A stage that is mounted and answers is not the dead filesystem (the driver
        // mounted the target on its own, not as a bind of it): it stays, for the holders
        // whose binds sit on it, and NodeStage is asked again (idempotent).
        let stage_answers = match record.staging_path.clone() {
            Some(staging) => {
                self.visibility(&staging, deadline).await? == Visibility::Mounted
                    && self.dead_mount(&staging, deadline).await?.is_none()
            }
            None => false,
        };
        let steps = UndoSteps {
            publish: true,
            controller_publish: false,
            stage: !stage_answers,
        };
        self.undo_steps(HookKind::Attach, record, steps, deadline)
            .await
            .map_err(|error| BridgeError::DeadMount {
                path: record.target_path.clone(),
                dead,
                step: "taking it down (NodeUnpublishVolume, NodeUnstageVolume)",
                error: Some(Box::new(error)),
            })
    }

    /// Writes the record; `durable` (before a CSI call) waits for the disk, on this
    /// thread only when no other wait of this process is (`crate::blocking`).
    async fn save(
        &self,
        hook: HookKind,
        record: &NodeRecord,
        durable: bool,
    ) -> Result<(), BridgeError> {
        faults::point(hook, When::Before, "journal");
        if durable {
            let (journal, record) = (self.node_journal().clone(), record.clone());
            crate::blocking::wait_for_disk(move || journal.save(&record, true))
                .await
                .map_err(BridgeError::from)?;
        } else {
            self.node_journal().save(record, false)?;
        }
        faults::point(hook, When::After, "journal");
        Ok(())
    }

    /// The record of a volume. An unreadable one (a torn write after a power loss) is
    /// rebuilt from the mount table at `paths` and its holders from the holder log, so
    /// the volume never stays unattachable. When the log cannot say who holds the volume
    /// either, the record is marked so, and no Detach tears the volume down while it may
    /// be mounted: another namespace may still use it.
    async fn load_or_rebuild(
        &self,
        volume_id: &str,
        csi_volume_id: &str,
        paths: &VolumePaths,
        deadline: &Deadline,
    ) -> Result<Option<NodeRecord>, BridgeError> {
        match self.node_journal().load(volume_id) {
            Ok(found) => Ok(found),
            Err(JournalError::Corrupt { path, message }) => {
                let mut record = NodeRecord::new(volume_id, csi_volume_id, paths.target.clone());
                match self.node_journal().load_holders(volume_id) {
                    Ok(Some((holders, times))) => {
                        tracing::error!(
                            record = %path.display(),
                            %message,
                            "node journal record unusable; rebuilding it from the mount table and its holder log"
                        );
                        record.holders = holders;
                        record.holder_times = times;
                    }
                    found => {
                        let log_error = found.err().map(|e| e.to_string());
                        tracing::error!(
                            record = %path.display(),
                            %message,
                            log_error,
                            "node journal record unusable and its holder log cannot say who \
                             holds the volume: rebuilt with holders unknown. It stays mounted \
                             whatever Detach comes; once no sandbox uses it, release it with \
                             `cube-csi-bridge holders release`"
                        );
                        record.holders_unknown = true;
                    }
                }
                record.boot_id = self.boot_id.clone();
                if self.visibility(&paths.target, deadline).await? != Visibility::NotMounted {
                    record.publish = Step::Uncertain;
                }
                if path_exists(&paths.staging).await {
                    record.staging_path = Some(paths.staging.clone());
                    record.stage = Step::Uncertain;
                }
                self.may_be_controller_published(&mut record, deadline)
                    .await?;
                // The unreadable file goes now, so that `list` shows the rebuilt record and
                // its holder state; a failure here leaves it for the next save.
                if let Err(error) = self.node_journal().save(&record, false) {
                    tracing::warn!(%error, "could not write the rebuilt record yet");
                }
                Ok(Some(record))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A record rebuilt without the one that was lost says nothing of ControllerPublish:
    /// with a driver that publishes, every Attach here made it, so the rebuilt record says
    /// it was made (the volume is mounted or staged here) or may have been (neither), and
    /// the last Detach's teardown undoes it. Left absent, the volume stayed published to
    /// this node at the backend for good, recorded nowhere.
    async fn may_be_controller_published(
        &self,
        record: &mut NodeRecord,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let (_, caps) = self.driver.controller_view(deadline).await?;
        if !caps.is_some_and(|c| c.publish_unpublish_volume) {
            return Ok(());
        }
        record.node_id = self.driver.node_id(deadline).await?;
        // Done where a publish or stage is there: an Attach of other holders' volume that
        // fails then leaves the publish they use, as for a record never lost.
        record.controller_publish = if record.publish.needs_undo() || record.stage.needs_undo() {
            Step::Done
        } else {
            Step::Uncertain
        };
        Ok(())
    }

    /// Records a holder change on the hot path: one appended line when it changes the
    /// holders, after a fold of the log into the record (without fsync, like the log) when
    /// the log as loaded is past its limit. Never a CSI call.
    ///
    /// The fold comes first: Cube kills a forked hook at any instant and then counts the
    /// hook failed (an Attach's sandbox released, never Detached). A hook stopped in the
    /// fold (the intent log's lock, a checkpoint's fsyncs on a stalled disk) has then
    /// left no trace of its change; the change's line is the last thing written before the
    /// answer.
    fn record_holder_change(
        &self,
        record: &mut NodeRecord,
        change: &HolderChange,
    ) -> Result<(), BridgeError> {
        let mut holders = record.holders.clone();
        change.apply(&mut holders);
        if holders == record.holders {
            return Ok(());
        }
        if self.node_journal().holder_log_changes(&record.volume_id) > HOLDER_LOG_LIMIT {
            // A fold that fails (a full disk) leaves the log long, not the hook failed;
            // the next change tries it again.
            if let Err(error) = self.node_journal().save(record, false) {
                tracing::warn!(%error, "could not fold the holder log into its record; the log stays long");
            }
        }
        if let Err(error) = self.node_journal().append_holder(&record.volume_id, change) {
            // A removal must not fail for want of a block (a full disk): a release Cube
            // has already counted (a failed Attach's) comes no second time. The record
            // rewritten in place (the journal does so on a full disk when the intent log
            // holds a durable entry of it), its log brought to it, needs none. An
            // addition fails: Cube then releases the sandbox, and nothing was recorded.
            if !matches!(change, HolderChange::Detach { .. }) {
                return Err(error.into());
            }
            let mut changed = record.clone();
            changed.apply(change);
            if let Err(also) = self.node_journal().save(&changed, false) {
                tracing::warn!(error = %also, "could not rewrite the record either");
                return Err(error.into());
            }
            tracing::warn!(%error, "could not append to the holder log; the record was rewritten instead");
            *record = changed;
            return Ok(());
        }
        record.apply(change);
        Ok(())
    }

    /// The hot-path rule of Attach, decided here only (both `attach_if_hot` and `attach`
    /// ask it): the journal's record is this CSI volume's at this host_path, published on
    /// this boot, and its target is `mounted` where Cubelet looks. Then answering changes
    /// at most one line of the holder log: no CSI call, no rewrite, nothing to undo.
    fn attach_is_hot(
        &self,
        record: &NodeRecord,
        req: &AttachVolume,
        paths: &VolumePaths,
        mounted: bool,
    ) -> bool {
        record.target_path == paths.target
            && record.csi_volume_id == req.handle.csi_volume_id
            && record.publish == Step::Done
            && !self.is_from_earlier_boot(record)
            && mounted
    }

    /// Cube Attach, only if it is on the hot path: the volume is mounted and healthy, so
    /// answering changes at most the holder log and there is nothing to undo. `None`: not
    /// hot (or another process holds the volume's lock) — run `attach`. Never waits for a
    /// lock, never calls the driver, never starts a thread: the forked hook answers here
    /// before it forks its worker.
    ///
    /// With `kept`, the volume's lock is left there while the check awaits (the mount's
    /// health may take a blocking thread) and taken back when it ends: a check dropped at
    /// an await (its caller cancelled) leaves the lock to whoever finishes after it
    /// (`attach_holding`), ahead of the hooks that came meanwhile.
    pub async fn attach_if_hot(
        &self,
        req: &AttachVolume,
        kept: Option<&KeptLock>,
    ) -> Option<Result<Attached, HookError>> {
        super::hook_if(
            self.recorder.as_ref(),
            HookKind::Attach,
            &req.volume_id,
            async {
                let Some(guard) = self.locks.try_acquire(LockScope::Node, &req.volume_id)? else {
                    return Ok(None);
                };
                let _guard = match kept {
                    Some(kept) => {
                        kept.keep(guard);
                        None
                    }
                    None => Some(guard),
                };
                let checked = self.attach_if_hot_locked(req).await;
                // Only a check that ran to its end gets here (no await since its last
                // one): the lock is released as its own would be.
                drop(kept.and_then(KeptLock::take));
                checked
            },
        )
        .await
    }

    /// `attach_if_hot`, under the volume's lock.
    async fn attach_if_hot_locked(
        &self,
        req: &AttachVolume,
    ) -> Result<Option<Attached>, BridgeError> {
        let Ok(Some(mut record)) = self.node_journal().load(&req.volume_id) else {
            return Ok(None);
        };
        // A volume attached before the leaf changed keeps the host_path Cube holds.
        let paths = VolumePaths::for_record(
            &req.base_dir,
            &self.config.driver,
            &req.volume_id,
            &record.target_path,
        );
        let deadline = Deadline::after(self.config.timeouts.attach);
        // The mount table is read only for a record that could be hot; a dead
        // mount is never hot (`attach` repairs it). A check that fails, or a
        // holder line that cannot be written, is `attach`'s to answer: a failed
        // Attach must release the sandbox as Cube does (`release_after_failure`),
        // which may take a teardown, and this path calls no driver.
        let mounted = self.attach_is_hot(&record, req, &paths, true)
            && matches!(self.visibility(&paths.target, &deadline).await,
                Ok(seen) if seen != Visibility::NotMounted)
            && matches!(self.dead_mount(&paths.target, &deadline).await, Ok(None));
        if !self.attach_is_hot(&record, req, &paths, mounted) {
            return Ok(None);
        }
        let change = HolderChange::Attach {
            namespace: req.namespace.clone(),
            sandbox: req.sandbox_id.clone(),
            first: req.ref_count == 0,
            at: self.clock.now_secs(),
        };
        if self.record_holder_change(&mut record, &change).is_err() {
            return Ok(None);
        }
        Ok(Some(attached(&record, &req.volume_id)))
    }

    /// Cube Detach, only if it is on the hot path: other holders remain (or nothing is
    /// recorded), so answering changes at most the holder log. `None`: run `detach`.
    pub async fn detach_if_hot(&self, req: &DetachVolume) -> Option<Result<(), HookError>> {
        super::hook_if(
            self.recorder.as_ref(),
            HookKind::Detach,
            &req.volume_id,
            async {
                let Some(_guard) = self.locks.try_acquire(LockScope::Node, &req.volume_id)? else {
                    return Ok(None);
                };
                let mut record = match self.node_journal().load(&req.volume_id) {
                    Ok(Some(record)) if !self.is_from_earlier_boot(&record) => record,
                    Ok(None) if req.ref_count > 0 || req.recorded.is_none() => return Ok(Some(())),
                    _ => return Ok(None),
                };
                let change = HolderChange::Detach {
                    namespace: req.namespace.clone(),
                    sandbox: req.sandbox_id.clone(),
                    last: req.ref_count == 0,
                    at: self.clock.now_secs(),
                };
                let mut holders = record.holders.clone();
                change.apply(&mut holders);
                if !detach_is_hot(req, &holders) {
                    return Ok(None);
                }
                self.record_holder_change(&mut record, &change)?;
                Ok(Some(()))
            },
        )
        .await
    }

    /// Cube Attach.
    pub async fn attach(&self, req: AttachVolume, caller: &Caller) -> Result<Attached, HookError> {
        self.attach_with_lock(req, caller, None).await
    }

    /// Cube Attach, under the volume's lock that `guard` already holds: the rest of a hot
    /// check that was cancelled, with nothing of another hook between them.
    pub async fn attach_holding(
        &self,
        req: AttachVolume,
        caller: &Caller,
        guard: LockGuard,
    ) -> Result<Attached, HookError> {
        self.attach_with_lock(req, caller, Some(guard)).await
    }

    async fn attach_with_lock(
        &self,
        req: AttachVolume,
        caller: &Caller,
        held: Option<LockGuard>,
    ) -> Result<Attached, HookError> {
        let volume_id = req.volume_id.clone();
        super::hook(
            self.recorder.as_ref(),
            HookKind::Attach,
            &volume_id,
            async {
                let deadline = Deadline::after(self.config.timeouts.attach).while_awaited(caller);
                let holding = held.is_some();
                let _guard = match held {
                    Some(guard) => guard,
                    None => {
                        self.locks
                            .acquire(LockScope::Node, &req.volume_id, &deadline)
                            .await?
                    }
                };
                let change = HolderChange::Attach {
                    namespace: req.namespace.clone(),
                    sandbox: req.sandbox_id.clone(),
                    first: req.ref_count == 0,
                    at: self.clock.now_secs(),
                };
                if caller.is_gone() && !holding {
                    // The caller left before this began (a forked front Cube killed while
                    // its worker waited for the lock). Cube released the sandbox, and may
                    // since have sent the namespace's next hook, which may have run first:
                    // this ref_count is out of date, and the namespace it would drop may
                    // hold a sandbox Cube counts. Where hooks take the lock in the order
                    // they came (the daemon), this sandbox alone is released. Where a
                    // later hook may have overtaken this one (forked workers), that hook
                    // may be Cube's retry of this very sandbox, whose holder Cube counts:
                    // nothing is changed (at worst a holder Cube released stays, until the
                    // namespace's last Detach or `holders release`). (A hot check's rest,
                    // `held`, kept the lock since its caller's request: its ref_count is
                    // current, and its release is Cube's.)
                    if !caller.may_be_overtaken() {
                        self.release_sandbox(&req, &change).await;
                    }
                    return Err(BridgeError::CallerGone);
                }
                let mut held_before = None;
                let result = self
                    .attach_locked(&req, caller, &change, &deadline, &mut held_before)
                    .await;
                if result.is_err() {
                    self.release_after_failure(&req, &change, held_before).await;
                }
                result
            },
        )
        .await
    }

    /// Attach, under the volume's lock. `held_before` is set, once the record is read,
    /// to whether the sandbox held the volume before this Attach.
    async fn attach_locked(
        &self,
        req: &AttachVolume,
        caller: &Caller,
        change: &HolderChange,
        deadline: &Deadline,
        held_before: &mut Option<bool>,
    ) -> Result<Attached, BridgeError> {
        let (mut record, paths, paths_checked) = self.record_for_attach(req, deadline).await?;
        *held_before = Some(change.sandbox_held_in(&record.holders));
        // Only a published or held volume can be mounted for someone here: a fresh
        // record needs no check of its own (record_for_attach has already refused one
        // whose paths another instance mounted).
        let mut visible = (record.publish == Step::Done || record.is_held())
            && self.visibility(&paths.target, deadline).await? != Visibility::NotMounted;
        // A mount whose filesystem is gone is still a mount point: it is never handed
        // out, but repaired first (also when a restarted daemon meets it).
        let dead = if visible {
            self.dead_mount(&paths.target, deadline).await?
        } else {
            None
        };

        if self.attach_is_hot(&record, req, &paths, visible && dead.is_none()) {
            // Already attached and healthy: no CSI call, and at most one appended
            // line for the holder.
            let held_before = change.sandbox_held_in(&record.holders);
            if caller.is_gone() {
                self.withdraw_holder(&mut record, held_before, change, req.ref_count)
                    .await?;
                return Err(BridgeError::CallerGone);
            }
            self.record_holder_change(&mut record, change)?;
            tracing::debug!(ref_count = req.ref_count, "already mounted");
            let answer = attached(&record, &req.volume_id);
            if !caller.deliver(Answer::Attached(answer.clone())).await {
                self.withdraw_holder(&mut record, held_before, change, req.ref_count)
                    .await?;
                return Err(BridgeError::CallerGone);
            }
            return Ok(answer);
        }
        // A volume is only ever mounted where its topology allows (the hot path above
        // serves a mount made here before): a node outside it is refused before any
        // call that changes anything.
        self.check_topology(&req.handle, deadline).await?;
        self.check_fits(deadline).await?;
        if let Some(dead) = dead {
            tracing::warn!(
                host_path = %paths.target.display(),
                error = %dead,
                ref_count = req.ref_count,
                holders = record.holders.values().map(|s| s.len()).sum::<usize>(),
                "the filesystem mounted at host_path no longer answers (its FUSE daemon \
                 or server restarted?); repairing it before answering: unpublish, \
                 unstage, stage, publish"
            );
        } else if req.ref_count > 0 || record.is_held() {
            tracing::warn!(
                ref_count = req.ref_count,
                "volume has holders but is not mounted (host reboot or lost mount?); re-establishing it"
            );
        }

        // Paths that fail their check are refused before anything is recorded: a
        // refused Attach changes nothing. (A volume with no record had them checked
        // already, a moment ago.)
        if !paths_checked {
            self.check_attach_paths(&paths, deadline).await?;
        }
        if let Some(dead) = dead {
            check_caller(caller)?;
            // Marked first: a repair cut short is finished by reconciliation.
            self.node_journal().mark_pending(&req.volume_id)?;
            self.take_down_dead_mount(&mut record, dead, deadline)
                .await?;
            visible = false;
        }

        // This sandbox's holder is recorded only once the Attach has succeeded: an
        // Attach that dies half way was never answered, so nobody holds the volume
        // because of it, and reconciliation must undo it.
        let before = record.clone();
        // A mount other holders use is theirs: a failure here must not unpublish it.
        let mounted_before = before.is_held() && visible;
        record.boot_id = self.boot_id.clone();
        if record.since == 0 {
            record.since = self.clock.now_secs();
        }
        self.node_journal().mark_pending(&req.volume_id)?;
        let established = match self
            .establish(
                HookKind::Attach,
                &mut record,
                &req.handle,
                &paths,
                deadline,
                caller,
            )
            .await
        {
            Ok(()) if caller.is_gone() => Err(BridgeError::CallerGone),
            other => other,
        };
        // A repaired dead mount is checked again before it is handed out, and a repair
        // that fails says so.
        let established = match (dead, established) {
            (None, established) => established,
            (Some(_), Err(BridgeError::CallerGone)) => Err(BridgeError::CallerGone),
            (Some(dead), Err(error)) => Err(BridgeError::DeadMount {
                path: paths.target.clone(),
                dead,
                step: "mounting it again (NodeStageVolume, NodePublishVolume)",
                error: Some(Box::new(error)),
            }),
            (Some(_), Ok(())) => match self.dead_mount(&paths.target, deadline).await {
                Ok(None) => {
                    tracing::info!(host_path = %paths.target.display(), "dead mount repaired");
                    Ok(())
                }
                Ok(Some(still)) => Err(BridgeError::DeadMount {
                    path: paths.target.clone(),
                    dead: still,
                    step: "checking it after it was mounted again: it still does not answer",
                    error: None,
                }),
                Err(error) => Err(error),
            },
        };
        // The holder is recorded by the last save. If that save fails (a full disk),
        // the Attach fails, and Cube will never Detach it: it is undone like any other
        // failed Attach before answering, not left to the next scan.
        // Then the answer is handed over while the lock is still held: a caller that
        // says it never got it (a forked hook's front killed before printing it) never
        // learned of the holder, and it is undone like a failed Attach.
        let established = match established {
            Ok(()) => {
                let mut held = record.clone();
                held.apply(change);
                match self.save(HookKind::Attach, &held, false).await {
                    Ok(()) => {
                        let answer = Answer::Attached(attached(&held, &req.volume_id));
                        if caller.deliver(answer).await {
                            Ok(held)
                        } else {
                            Err(BridgeError::CallerGone)
                        }
                    }
                    Err(error) => Err(error),
                }
            }
            Err(error) => Err(error),
        };
        let result = match established {
            Ok(held) => Ok(attached(&held, &req.volume_id)),
            Err(error) => {
                let rollback = Deadline::after(self.config.timeouts.rollback);
                match self
                    .undo_attach(
                        &mut record,
                        &before,
                        mounted_before,
                        change,
                        req.ref_count,
                        &rollback,
                    )
                    .await
                {
                    Ok(()) => {
                        tracing::info!("partial attach undone");
                        self.recorder.rollback("attach", "undone");
                        Err(error)
                    }
                    Err(rollback) => {
                        self.recorder.rollback("attach", "failed");
                        Err(BridgeError::RollbackFailed {
                            error: Box::new(error),
                            rollback: Box::new(rollback),
                        })
                    }
                }
            }
        };
        // A failed undo stays pending, for reconciliation to finish. A marker that cannot
        // be removed is no reason to fail an Attach that succeeded: Cube would never
        // Detach it. (A leftover marker only makes the next scan look at the volume.)
        if !matches!(result, Err(BridgeError::RollbackFailed { .. }))
            && let Err(e) = self.node_journal().clear_pending(&req.volume_id)
        {
            if result.is_ok() {
                tracing::warn!(error = %e, "could not remove the pending marker");
            } else {
                return Err(e.into());
            }
        }
        result
    }

    /// After any failed Attach, Cube releases the sandbox and never Detaches it (its
    /// manager's Release on a plugin error, whether the sandbox held the volume before or
    /// not). The paths that undo an Attach release it themselves; this catches every other
    /// failure after the lock was taken (a refused path, a dead mount that could not be
    /// checked, a caller gone before anything changed), so that a sandbox that held the
    /// volume before is not left holding it here. `held_before` is what the record said
    /// before this Attach changed it (None: it failed before reading the record, so the
    /// record is as it was); a holder this Attach added and could not undo is released
    /// as new, which leaves the namespace's other holders. Under the volume's lock.
    async fn release_after_failure(
        &self,
        req: &AttachVolume,
        change: &HolderChange,
        held_before: Option<bool>,
    ) {
        let Ok(Some(mut record)) = self.node_journal().load(&req.volume_id) else {
            return;
        };
        if !change.sandbox_held_in(&record.holders) {
            return;
        }
        let held_before = held_before.unwrap_or(true);
        if let Err(error) = self
            .withdraw_holder(&mut record, held_before, change, req.ref_count)
            .await
        {
            tracing::warn!(
                %error,
                "could not release the sandbox of this failed Attach, which Cube released; \
                 `holders release` (or the namespace's last Detach) does"
            );
        }
    }

    /// Releases this Attach's sandbox alone, as Cube did when its caller left before the
    /// Attach began (see `attach_with_lock`), and its namespace when it was the only one
    /// recorded there; the volume is torn down if nobody is left.
    async fn release_sandbox(&self, req: &AttachVolume, change: &HolderChange) {
        let Ok(Some(mut record)) = self.node_journal().load(&req.volume_id) else {
            return;
        };
        if !change.sandbox_held_in(&record.holders) {
            return;
        }
        // The namespace goes with it only when nothing else of it is recorded: a sandbox
        // a newer hook added is there.
        let alone = record.holders[&req.namespace].len() == 1;
        let release = HolderChange::Detach {
            namespace: req.namespace.clone(),
            sandbox: req.sandbox_id.clone(),
            last: alone,
            at: self.clock.now_secs(),
        };
        if let Err(error) = self.withdraw(&mut record, &release).await {
            tracing::warn!(
                %error,
                "could not release the sandbox of this Attach, whose caller left before it \
                 began; `holders release` (or the namespace's last Detach) does"
            );
        }
    }

    /// The record Attach starts from and its paths: the journal's, or a new one at the
    /// current form's paths. A record of this volume at the legacy form's paths in this
    /// base dir keeps them (Cube holds that host_path). A record of another CSI volume or
    /// path that is no longer mounted is torn down first. The flag says whether the paths
    /// were checked here (a volume with no record), so that Attach need not again.
    async fn record_for_attach(
        &self,
        req: &AttachVolume,
        deadline: &Deadline,
    ) -> Result<(NodeRecord, VolumePaths, bool), BridgeError> {
        let paths = VolumePaths::with_form(
            &req.base_dir,
            &self.config.driver,
            &req.volume_id,
            faults::fresh_leaf_form(),
        );
        let fresh = || {
            let record = NodeRecord::new(
                &req.volume_id,
                &req.handle.csi_volume_id,
                paths.target.clone(),
            );
            (record, paths.clone(), false)
        };
        let existing = self
            .load_or_rebuild(&req.volume_id, &req.handle.csi_volume_id, &paths, deadline)
            .await?;
        let recorded_paths = existing.as_ref().map(|record| {
            VolumePaths::for_record(
                &req.base_dir,
                &self.config.driver,
                &req.volume_id,
                &record.target_path,
            )
        });
        match existing {
            Some(mut old) if self.is_from_earlier_boot(&old) => {
                // What the record says was done before the reboot is undone first (a
                // ControllerPublish outlives it; NodeUnstage lets the driver clean up), then
                // the volume is attached afresh for this boot's sandboxes only.
                tracing::info!(
                    holders = ?old.holders,
                    "tearing down an attachment from an earlier boot first (its sandboxes died with it)"
                );
                self.teardown(HookKind::Attach, &mut old, deadline).await?;
                self.fresh_checked(&paths, deadline).await?;
                Ok((fresh().0, paths.clone(), true))
            }
            Some(record)
                if recorded_paths
                    .as_ref()
                    .is_some_and(|recorded| record.target_path == recorded.target)
                    && record.csi_volume_id == req.handle.csi_volume_id =>
            {
                Ok((record, recorded_paths.unwrap_or(paths), false))
            }
            Some(mut stale) => {
                // Unknown (no mount check) counts as mounted: never tear down what may be
                // in use. Nor what holders use, whatever the record says of its publish
                // (a repair cut short, or a record rebuilt, says uncertain).
                if (stale.publish.needs_undo() || stale.is_held())
                    && self.visibility(&stale.target_path, deadline).await?
                        != Visibility::NotMounted
                {
                    return Err(BridgeError::InvalidRequest(format!(
                        "volume is already attached on this node at {} as CSI volume {:?}; \
                         detach it before attaching it at {} as {:?}",
                        stale.target_path.display(),
                        stale.csi_volume_id,
                        paths.target.display(),
                        req.handle.csi_volume_id
                    )));
                }
                tracing::warn!(
                    old_target = %stale.target_path.display(),
                    "tearing down a stale, unmounted attachment of this volume first"
                );
                self.teardown(HookKind::Attach, &mut stale, deadline)
                    .await?;
                self.fresh_checked(&paths, deadline).await?;
                Ok((fresh().0, paths.clone(), true))
            }
            None => {
                self.fresh_checked(&paths, deadline).await?;
                let (record, paths, _) = fresh();
                Ok((record, paths, true))
            }
        }
    }

    /// The checks of a first Attach's paths with no record of this volume left: a
    /// symlink below the base dir is named as such (not taken for a mount of another
    /// instance's that the mount check would find through it), and a mount already there
    /// is refused.
    async fn fresh_checked(
        &self,
        paths: &VolumePaths,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        self.check_attach_paths(paths, deadline).await?;
        self.refuse_foreign_mounts(paths, deadline).await
    }

    /// Refuses a first Attach whose host_path or staging path is already a mount point:
    /// no record of this instance accounts for it (every mount this instance makes is
    /// recorded before the call that makes it), so another bridge instance or driver put it
    /// there. Publishing onto it would hand Cube that mount's data, and a later teardown
    /// would unmount it from under its owner.
    async fn refuse_foreign_mounts(
        &self,
        paths: &VolumePaths,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        for path in [&paths.target, &paths.staging] {
            if self.visibility(path, deadline).await? == Visibility::Mounted {
                return Err(BridgeError::Precondition(format!(
                    "{} is already a mount point, but this bridge (driver {:?}) has no record \
                     of mounting it: another bridge instance or program owns it. Refusing to \
                     publish onto it; unmount it if nothing uses it",
                    path.display(),
                    self.config.driver
                )));
            }
        }
        Ok(())
    }

    /// Mirrors Cube's Release after a hot Attach whose answer never reached Cube (which
    /// then counts the Attach as failed, releases the sandbox and never Detaches it): the
    /// holder this Attach recorded is taken back, and so is the sandbox's earlier one, as
    /// Cube drops it too (`HolderChange::released_after_failure`; `held_before`: the
    /// sandbox held the volume before this Attach). A volume left with no holder at all is
    /// torn down.
    async fn withdraw_holder(
        &self,
        record: &mut NodeRecord,
        held_before: bool,
        change: &HolderChange,
        ref_count: i64,
    ) -> Result<(), BridgeError> {
        let Some(release) = change.released_after_failure(ref_count, held_before) else {
            return Ok(());
        };
        tracing::debug!(
            ref_count,
            held_before,
            "withdrawing by the Attach's ref_count"
        );
        self.withdraw(record, &release).await
    }

    /// Applies `release` (a holder Cube released) to `record`, and tears the volume down
    /// when no holder is left and none is unknown.
    async fn withdraw(
        &self,
        record: &mut NodeRecord,
        release: &HolderChange,
    ) -> Result<(), BridgeError> {
        let mut holders = record.holders.clone();
        release.apply(&mut holders);
        if holders == record.holders {
            return Ok(());
        }
        tracing::warn!(
            "Cube counts this Attach failed (its answer never reached Cube, or it failed) \
             and releases the sandbox; withdrawing its holder"
        );
        if holders.is_empty() && !record.holders_unknown {
            let rollback = Deadline::after(self.config.timeouts.rollback);
            return self.teardown(HookKind::Attach, record, &rollback).await;
        }
        self.record_holder_change(record, release)
    }

    /// Undoes what one failed or abandoned Attach did. When no other namespace held the
    /// volume before it, that is everything; otherwise only the steps this call made (the
    /// publish it attempted, and a stage or ControllerPublish that were not already done),
    /// and its holder.
    async fn undo_attach(
        &self,
        record: &mut NodeRecord,
        before: &NodeRecord,
        mounted_before: bool,
        change: &HolderChange,
        ref_count: i64,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        // Cube releases the sandbox (and never Detaches it): so do its holders here.
        let mut others = before.holders.clone();
        let held_before = change.sandbox_held_in(&before.holders);
        if let Some(release) = change.released_after_failure(ref_count, held_before) {
            release.apply(&mut others);
        }
        if others.is_empty() {
            // Holders unknown (its record was lost with them): a mount may be another
            // namespace's, and stays, as a last Detach leaves it, for an operator to
            // release; this Attach's holder was never added.
            if self.unknown_holders_may_use(before, deadline).await? {
                tracing::warn!(
                    host_path = %record.target_path.display(),
                    "failed Attach of a volume whose holders are unknown (its journal record \
                     was lost): left mounted, since another namespace may use it"
                );
                record.holders = others;
                self.save_progress(HookKind::Attach, record).await;
                return Ok(());
            }
            return self.teardown(HookKind::Attach, record, deadline).await;
        }
        // A mount that was there before is the others': it stays, and so does what it
        // sits on (the staging, the ControllerPublish), whatever the record says of them
        // (a repair cut short leaves them uncertain).
        let steps = UndoSteps {
            publish: !mounted_before,
            controller_publish: !mounted_before && before.controller_publish != Step::Done,
            stage: !mounted_before && before.stage != Step::Done,
        };
        if mounted_before && record.publish == Step::Absent {
            // The failed call changed nothing, but the mount the others use is there.
            record.publish = Step::Uncertain;
        }
        record.holders = others;
        self.undo_steps(HookKind::Attach, record, steps, deadline)
            .await?;
        self.save_progress(HookKind::Attach, record).await;
        Ok(())
    }

    /// Whether `record`'s holders are unknown (its record was lost with them) and its mount
    /// may still be there, for a namespace nobody knows of: then no teardown may take it.
    async fn unknown_holders_may_use(
        &self,
        record: &NodeRecord,
        deadline: &Deadline,
    ) -> Result<bool, BridgeError> {
        Ok(record.holders_unknown
            && self.visibility(&record.target_path, deadline).await? != Visibility::NotMounted)
    }

    /// The calls of a first (or repaired) Attach, recording each step before making it.
    /// Steps already done are not undone by a failure here.
    pub(crate) async fn establish(
        &self,
        hook: HookKind,
        record: &mut NodeRecord,
        handle: &VolumeHandle,
        paths: &VolumePaths,
        deadline: &Deadline,
        caller: &Caller,
    ) -> Result<(), BridgeError> {
        let plan = self.node_plan(handle.controller_publish, deadline).await?;
        // Everything that may fail to resolve is resolved before anything changes.
        let spec = self.settings.spec(&plan.driver_name).await?;
        super::fit::node_fits(
            &plan.driver_name,
            &self.driver.node_caps(deadline).await?,
            spec.capability.access_mode,
            self.config.mount_group,
        )?;
        let publish_secrets = if plan.controller_publish_node.is_some() {
            self.settings.secrets(SecretUse::ControllerPublish).await?
        } else {
            Secrets::default()
        };
        let stage_secrets = if plan.stage {
            self.settings.secrets(SecretUse::NodeStage).await?
        } else {
            Secrets::default()
        };
        let node_publish_secrets = self.settings.secrets(SecretUse::NodePublish).await?;
        record.volume_context = handle.volume_context.clone();
        record.accessible_topology = handle.topology.clone();
        // The base dir was made and checked by the caller (Attach's path check, or
        // reconciliation's), in a trip of its own: not again here.
        let base = base_of(&paths.target);

        // One durable write before the first mutating call: every step this Attach makes is
        // recorded as uncertain at once (a step that never ran is undone by an idempotent
        // inverse call, as CSI requires of drivers). That is what a crash or a power loss
        // needs; the record is refined without waiting for the disk once the calls answer.
        // A caller gone by now gets nothing made, and nothing marked: a step marked
        // uncertain here would have the undo call its inverse (on a volume others hold,
        // leave it unsettled for the next start-up to make again).
        check_caller(caller)?;
        let controller_publish_node = plan
            .controller_publish_node
            .filter(|_| record.controller_publish != Step::Done);
        let previous_stage = record.stage;
        let previous_controller_publish = record.controller_publish;
        let previous_publish = record.publish;
        if let Some(node_id) = &controller_publish_node {
            record.node_id = node_id.clone();
            record.controller_publish = Step::Uncertain;
        }
        if plan.stage {
            record.staging_path = Some(paths.staging.clone());
            record.stage = Step::Uncertain;
        }
        record.publish = Step::Uncertain;
        self.save(hook, record, true).await?;
        if plan.stage {
            // The CO creates the staging directory (CSI spec); the driver the target. Only
            // now that the record names it, so that a crash never strands it.
            let host_paths = self.host_paths.clone();
            let (dir, staging) = (base.clone(), paths.staging.clone());
            let made = self
                .on_paths(&base, &paths.staging, deadline, move || {
                    host_paths.ensure_staging_dir(&dir, &staging)
                })
                .await;
            if let Err(error) = made {
                // No call was made: rollback must not undo one (on a path it would refuse).
                record.controller_publish = previous_controller_publish;
                record.stage = previous_stage;
                record.publish = previous_publish;
                return Err(error);
            }
        }

        let controller_publish_ran = controller_publish_node.is_some();
        if let Some(node_id) = controller_publish_node {
            check_caller(caller)?;
            let call = ControllerPublish {
                csi_volume_id: record.csi_volume_id.clone(),
                node_id,
                capability: spec.capability.clone(),
                volume_context: record.volume_context.clone(),
                secrets: publish_secrets,
            };
            faults::point(hook, When::Before, "ControllerPublishVolume");
            let reply = self.driver.controller().publish(&call, deadline).await;
            faults::point(hook, When::After, "ControllerPublishVolume");
            record.publish_context = self
                .step_result(
                    &mut record.controller_publish,
                    previous_controller_publish,
                    reply,
                )
                .await?;
        }

        if plan.stage {
            check_caller(caller)?;
            // Checked again just before the driver gets the path when ControllerPublish ran
            // since ensure_staging_dir checked it (it may have been swapped meanwhile);
            // without one, that check was the last thing before this call.
            let checked = match controller_publish_ran {
                true => self.verify(&base, &[&paths.staging], deadline).await,
                false => Ok(()),
            };
            if let Err(error) = checked {
                record.stage = previous_stage;
                record.publish = previous_publish;
                return Err(error);
            }
            let call = Stage {
                csi_volume_id: record.csi_volume_id.clone(),
                staging_path: paths.staging.clone(),
                publish_context: record.publish_context.clone(),
                volume_context: record.volume_context.clone(),
                capability: spec.capability.clone(),
                secrets: stage_secrets,
                mount_group: self.config.mount_group,
            };
            faults::point(hook, When::Before, "NodeStageVolume");
            let reply = self.driver.node().stage(&call, deadline).await;
            faults::point(hook, When::After, "NodeStageVolume");
            self.step_result(&mut record.stage, previous_stage, reply)
                .await?;
        }

        if previous_publish.needs_undo()
            && self.visibility(&paths.target, deadline).await? == Visibility::NotMounted
        {
            // The mount was lost behind the driver's back, and the driver may still count
            // that publish (csi-driver-host-path lists published targets and refuses
            // NodeUnstage while any is left): publishing again would count the target
            // twice, and teardown's one NodeUnpublish would leave it published for good.
            // Checked first, as every unmount's path is: a driver would follow a link
            // planted there to any mount point (reconciliation's repair checked only the
            // base dir, and an Attach's check came before the calls above).
            check_caller(caller)?;
            if let Err(error) = self.verify(&base, &[&paths.target], deadline).await {
                record.publish = previous_publish;
                return Err(error);
            }
            faults::point(hook, When::Before, "NodeUnpublishVolume");
            let reply = self
                .driver
                .node()
                .unpublish(&record.csi_volume_id, &paths.target, deadline)
                .await;
            faults::point(hook, When::After, "NodeUnpublishVolume");
            self.undo_result(reply, &paths.target, "NodeUnpublishVolume", deadline)
                .await?;
        }

        check_caller(caller)?;
        let staged = record.staging_path.as_deref().filter(|_| plan.stage);
        let checked = match staged {
            Some(staging) => {
                self.verify(&base, &[&paths.target, staging], deadline)
                    .await
            }
            None => self.verify(&base, &[&paths.target], deadline).await,
        };
        if let Err(error) = checked {
            record.publish = previous_publish;
            return Err(error);
        }
        let call = Publish {
            csi_volume_id: record.csi_volume_id.clone(),
            target_path: paths.target.clone(),
            staging_path: record.staging_path.clone(),
            publish_context: record.publish_context.clone(),
            volume_context: record.volume_context.clone(),
            capability: spec.capability.clone(),
            secrets: node_publish_secrets,
            mount_group: self.config.mount_group,
        };
        faults::point(hook, When::Before, "NodePublishVolume");
        let reply = self.driver.node().publish(&call, deadline).await;
        faults::point(hook, When::After, "NodePublishVolume");
        self.step_result(&mut record.publish, previous_publish, reply)
            .await?;

        if self.visibility(&paths.target, deadline).await? == Visibility::NotMounted {
            return Err(BridgeError::NotVisible {
                path: paths.target.clone(),
                view: self.mounts.describe(),
            });
        }
        Ok(())
    }

    /// Records the outcome of a mutating call: Done on success. On failure a step that was
    /// Done before this call stays Done (the earlier success stands), and one that was
    /// Uncertain stays Uncertain (a final error says this call did nothing, not that the
    /// earlier one did nothing); otherwise it is Absent after a final error (nothing is in
    /// progress, per CSI) and still Uncertain after a non-final one.
    async fn step_result<T>(
        &self,
        step: &mut Step,
        previous: Step,
        reply: Result<T, DriverError>,
    ) -> Result<T, BridgeError> {
        match reply {
            Ok(value) => {
                *step = Step::Done;
                Ok(value)
            }
            Err(error) => {
                if previous != Step::Absent {
                    *step = previous;
                } else if !error.is_uncertain() {
                    *step = Step::Absent;
                }
                self.driver.driver(Err(error)).await
            }
        }
    }

    /// Releases holders Cube no longer counts: a phantom holder that slipped through, a
    /// record whose holders were lost (the operator's `holders release`), or the holder a
    /// forked worker saved before it died unanswered (its front). `which` names them. The
    /// volume is torn down when no holder is left and none is unknown; otherwise the
    /// record keeps the rest. Unknown volumes and holders are an error that changes
    /// nothing. The caller logs who released them.
    pub async fn release_holders(
        &self,
        volume_id: &str,
        which: &Release,
    ) -> Result<Released, BridgeError> {
        let deadline = Deadline::after(self.config.timeouts.detach);
        let _guard = self
            .locks
            .acquire(LockScope::Node, volume_id, &deadline)
            .await?;
        let Some(mut record) = self.node_journal().load(volume_id)? else {
            return Err(BridgeError::InvalidRequest(format!(
                "volume {volume_id:?} has no node journal record here: nothing to release"
            )));
        };
        let mut released = Vec::new();
        match which {
            Release::Sandbox { namespace, sandbox } => {
                let known = record
                    .holders
                    .get(namespace)
                    .is_some_and(|set| set.contains(sandbox));
                if !known {
                    return Err(BridgeError::InvalidRequest(format!(
                        "volume {volume_id:?} has no holder {namespace}/{sandbox} (holders: {})",
                        describe_holders(&record.holders)
                    )));
                }
                released.push(format!("{namespace}/{sandbox}"));
                if let Some(set) = record.holders.get_mut(namespace) {
                    set.remove(sandbox);
                    if set.is_empty() {
                        record.holders.remove(namespace);
                    }
                }
            }
            Release::Namespace(namespace) => {
                let Some(set) = record.holders.remove(namespace) else {
                    return Err(BridgeError::InvalidRequest(format!(
                        "volume {volume_id:?} has no holder in namespace {namespace:?} \
                         (holders: {})",
                        describe_holders(&record.holders)
                    )));
                };
                released.extend(set.into_iter().map(|sb| format!("{namespace}/{sb}")));
            }
            Release::Unknown => {
                if !record.holders_unknown {
                    return Err(BridgeError::InvalidRequest(format!(
                        "volume {volume_id:?} has no unknown holders (holders: {})",
                        describe_holders(&record.holders)
                    )));
                }
                released.push("UNKNOWN".to_string());
                record.holders_unknown = false;
            }
        }
        tracing::info!(volume_id, released = ?released, "holders released");
        let torn_down = !record.is_held() && !record.holders_unknown;
        if torn_down {
            self.teardown(HookKind::Detach, &mut record, &deadline)
                .await?;
        } else {
            // Not durable: a power loss makes this record an earlier boot's, torn down
            // whatever holders it names; and a disk too full for the intent log must not
            // keep a released holder (a dead worker's, which Cube never Detaches).
            self.save(HookKind::Detach, &record, false).await?;
        }
        Ok(Released {
            holders: released,
            torn_down,
        })
    }

    /// Cube Detach. Once it holds the volume's lock it runs to the end even if the caller
    /// leaves: Cube retries a failed Detach with the same metadata, and finishing is what
    /// that retry would do. A caller gone before the lock was taken changes nothing (its
    /// ref_count may be out of date by then).
    pub async fn detach(&self, req: DetachVolume, caller: &Caller) -> Result<(), HookError> {
        let volume_id = req.volume_id.clone();
        super::hook(
            self.recorder.as_ref(),
            HookKind::Detach,
            &volume_id,
            async {
                let deadline = Deadline::after(self.config.timeouts.detach);
                let _guard = self
                    .locks
                    .acquire(LockScope::Node, &req.volume_id, &deadline)
                    .await?;
                // A caller that left while this waited for the lock saw the Detach fail:
                // Cube took its reference back and repeats the Detach later, and its
                // namespace's next Attach may have run first, which this ref_count does
                // not count (its `last` would drop that holder). It changes nothing.
                check_caller(caller)?;
                let change = HolderChange::Detach {
                    namespace: req.namespace.clone(),
                    sandbox: req.sandbox_id.clone(),
                    last: req.ref_count == 0,
                    at: self.clock.now_secs(),
                };
                let paths = match &req.recorded {
                    Some(meta) => meta.paths.clone(),
                    None => VolumePaths::new(
                        &self.config.default_base_dir,
                        &self.config.driver,
                        &req.volume_id,
                    ),
                };
                let csi_volume_id = req
                    .recorded
                    .as_ref()
                    .map(|m| m.csi_volume_id.clone())
                    .unwrap_or_default();
                let loaded = self
                    .load_or_rebuild(&req.volume_id, &csi_volume_id, &paths, &deadline)
                    .await?;
                let mut record = match (loaded, req.recorded.clone()) {
                    (Some(mut record), recorded) => {
                        if let Some(meta) = recorded
                            && meta.paths.target != record.target_path
                        {
                            tracing::warn!(
                                metadata_mount_dir = %meta.paths.target.display(),
                                journal_mount_dir = %record.target_path.display(),
                                "Detach metadata and node journal disagree; following the journal"
                            );
                        }
                        if self.is_from_earlier_boot(&record) {
                            // Its holders died with the earlier boot.
                            record.holders.clear();
                            record.holders_unknown = false;
                        }
                        let mut holders = record.holders.clone();
                        change.apply(&mut holders);
                        if req.ref_count == 0
                            && holders.is_empty()
                            && self.unknown_holders_may_use(&record, &deadline).await?
                        {
                            // Nobody this record knows of holds it, but its record was lost
                            // with the holders of other namespaces: tearing it down could
                            // unmount it under them. It stays, for an operator to release.
                            self.record_holder_change(&mut record, &change)?;
                            tracing::warn!(
                                host_path = %record.target_path.display(),
                                "last Detach of a volume whose holders are unknown (its journal \
                                 record was lost): left mounted, since another namespace may \
                                 use it; once none does, release it with \
                                 `cube-csi-bridge holders release`"
                            );
                            return Ok(());
                        }
                        if detach_is_hot(&req, &holders) {
                            self.record_holder_change(&mut record, &change)?;
                            tracing::debug!(
                                ref_count = req.ref_count,
                                namespaces = record.holders.len(),
                                "other sandboxes still hold the volume"
                            );
                            return Ok(());
                        }
                        record.apply(&change);
                        record
                    }
                    (None, _) if req.ref_count > 0 => {
                        tracing::debug!(ref_count = req.ref_count, "nothing recorded on this node");
                        return Ok(());
                    }
                    (None, Some(meta)) => {
                        let mut record = self.record_from_metadata(&req.volume_id, meta);
                        // With mount checks off nothing says the stage is gone: Cube's
                        // metadata says it was made, so it is undone (NodeUnstage is
                        // idempotent), before any ControllerUnpublish under it.
                        if let Some(staging) = &record.staging_path
                            && self.visibility(staging, &deadline).await? == Visibility::Unchecked
                        {
                            record.stage = Step::Uncertain;
                        }
                        self.may_be_controller_published(&mut record, &deadline)
                            .await?;
                        record
                    }
                    (None, None) => {
                        tracing::info!("nothing attached on this node; nothing to do");
                        return Ok(());
                    }
                };
                self.teardown(HookKind::Detach, &mut record, &deadline)
                    .await
            },
        )
        .await
    }

    /// Without a journal record (lost, or never written), Detach works from Cube's
    /// metadata (its base dir was checked against node.allowed_base_dirs at the edge):
    /// steps start Absent, and teardown calls the driver only for what is still mounted.
    fn record_from_metadata(&self, volume_id: &str, meta: AttachMetadata) -> NodeRecord {
        let mut record = NodeRecord::new(volume_id, &meta.csi_volume_id, meta.paths.target.clone());
        if meta.staged {
            record.staging_path = Some(meta.paths.staging);
        }
        record
    }

    /// Undoes whatever the record says may exist, in reverse order; a step that fails
    /// leaves the record saying what is left, so a later Detach resumes where this one
    /// stopped. Removes the record when done.
    pub(crate) async fn teardown(
        &self,
        hook: HookKind,
        record: &mut NodeRecord,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        // The marker only lets a scan find a teardown cut short sooner (the record says
        // what is left, and Cube repeats a Detach it saw fail). One that cannot be made (a
        // disk out of inodes) is no reason to leave the volume mounted for nobody: some
        // callers (a failed Attach's release, a dead worker's holders) are never retried.
        if let Err(error) = self.node_journal().mark_pending(&record.volume_id) {
            tracing::warn!(%error, "could not mark the teardown pending; tearing down anyway");
        }
        // First, the record must say nobody holds the volume before anything is undone, or
        // a teardown cut short (a crash, a failed undo) would have reconciliation mount it
        // again for holders that were leaving or stale. (No fsync: a process crash keeps the
        // page cache, and after a power loss the record is from an earlier boot and is torn
        // down anyway.)
        record.holders.clear();
        record.holders_unknown = false;
        // The same write says a ControllerPublish made is no longer sure to stand: a
        // teardown cut short after its ControllerUnpublish (a kill, an uncertain answer)
        // must have the next Attach publish again, not stage a volume the backend is
        // detaching from this node.
        if record.controller_publish == Step::Done {
            record.controller_publish = Step::Uncertain;
        }
        self.save_progress(hook, record).await;
        self.undo_steps(hook, record, UndoSteps::ALL, deadline)
            .await?;
        faults::point(hook, When::Before, "journal");
        // The namespaces that hooked this volume are alive whatever becomes of its record:
        // their holders of other volumes must not be judged stale for want of it. Losing
        // this only risks a false stale report, never a release.
        if let Err(error) = self
            .node_journal()
            .keep_last_hooks(&record.holder_times.last_hook)
        {
            tracing::warn!(%error, "could not keep the namespaces' last hooks");
        }
        // Two unlinks without fsync: no need for a blocking thread.
        self.node_journal().remove(&record.volume_id)?;
        self.node_journal().clear_pending(&record.volume_id)?;
        faults::point(hook, When::After, "journal");
        Ok(())
    }

    /// Records teardown progress. A save that fails (a full disk) does not stop the
    /// teardown: the record on disk then still names steps this one has undone, or holders
    /// that are leaving, and a later teardown only repeats idempotent undo calls; stopping
    /// would leave the volume mounted for nobody. The final unlink needs no space.
    async fn save_progress(&self, hook: HookKind, record: &NodeRecord) {
        if let Err(error) = self.save(hook, record, false).await {
            tracing::warn!(%error, "could not record teardown progress; undoing the rest anyway");
        }
    }

    /// NodeUnpublish (when anything may be mounted or the driver may still count a
    /// publish, unless `which` keeps others' mount), then the steps in `which`.
    ///
    /// The record is saved when a step fails, so that it then says which steps are left;
    /// not after each step that succeeds: every caller saves or removes the record once
    /// the steps are done, and a crash in between only makes the next teardown repeat
    /// an inverse call that CSI requires to be idempotent (the record never says less
    /// than may exist). Two saves fewer per last Detach (issue 20).
    async fn undo_steps(
        &self,
        hook: HookKind,
        record: &mut NodeRecord,
        which: UndoSteps,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let undone = self.undo_each(hook, record, which, deadline).await;
        if undone.is_err() {
            self.save_progress(hook, record).await;
        }
        undone
    }

    /// `undo_steps`' calls, each step marked Absent in `record` once undone.
    async fn undo_each(
        &self,
        hook: HookKind,
        record: &mut NodeRecord,
        which: UndoSteps,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let target = record.target_path.clone();
        let base = base_of(&target);
        if which.publish {
            // While the stage is to be undone, the driver may refuse NodeUnstage over a
            // publish it still counts although the record says none (a record rebuilt
            // without its steps, or a repair by an older build that published twice):
            // NodeUnpublish is idempotent, so it is sent again.
            let published = record.publish.needs_undo()
                || self.visibility(&target, deadline).await? != Visibility::NotMounted;
            let may_count = which.stage && record.stage.needs_undo();
            // Never an unmount of a path that fails its check: the driver would unmount
            // whatever a symlink there leads to. Where something may be published there, the
            // volume stays pending, with the refusal as its error, until the path is
            // repaired; where the call would only be the extra one, it is left out (nothing
            // was published onto a path that fails its check: it was checked first).
            let checked = if published || may_count {
                match self.verify(&base, &[&target], deadline).await {
                    Ok(()) => true,
                    Err(error) if !published => {
                        tracing::warn!(%error, "not sending the extra NodeUnpublishVolume to a path that fails its check");
                        false
                    }
                    Err(error) => return Err(error),
                }
            } else {
                false
            };
            if checked {
                faults::point(hook, When::Before, "NodeUnpublishVolume");
                let reply = self
                    .driver
                    .node()
                    .unpublish(&record.csi_volume_id, &target, deadline)
                    .await;
                faults::point(hook, When::After, "NodeUnpublishVolume");
                self.undo_result(reply, &target, "NodeUnpublishVolume", deadline)
                    .await?;
                record.publish = Step::Absent;
            }
            remove_dir(&self.host_paths, &base, &target, deadline, DirEnd::Remove).await?;
        }

        if which.stage
            && let Some(staging) = record.staging_path.clone()
        {
            if record.stage.needs_undo()
                || self.visibility(&staging, deadline).await? == Visibility::Mounted
            {
                self.verify(&base, &[&staging], deadline).await?;
                faults::point(hook, When::Before, "NodeUnstageVolume");
                let reply = self
                    .driver
                    .node()
                    .unstage(&record.csi_volume_id, &staging, deadline)
                    .await;
                faults::point(hook, When::After, "NodeUnstageVolume");
                self.undo_result(reply, &staging, "NodeUnstageVolume", deadline)
                    .await?;
                record.stage = Step::Absent;
            }
            // Parked for the volume's next first Attach where the host paths can (an
            // rmdir and a mkdir cost an inode each time: see mount/host_paths.rs). Its
            // parent, .staging, stays (the bridge's one directory in the base dir,
            // checked again at every use).
            remove_dir(&self.host_paths, &base, &staging, deadline, DirEnd::Park).await?;
        }

        if which.controller_publish && record.controller_publish.needs_undo() {
            // Once ControllerUnpublish is asked for, whatever its answer, the publish may
            // be gone: a failure leaves it uncertain, so that an Attach publishes again.
            record.controller_publish = Step::Uncertain;
            let secrets = self.settings.secrets(SecretUse::ControllerPublish).await?;
            faults::point(hook, When::Before, "ControllerUnpublishVolume");
            let reply = self
                .driver
                .controller()
                .unpublish(&record.csi_volume_id, &record.node_id, &secrets, deadline)
                .await;
            faults::point(hook, When::After, "ControllerUnpublishVolume");
            self.driver.driver(reply).await?;
            record.controller_publish = Step::Absent;
        }
        Ok(())
    }

    /// Attach's check of its paths before it records anything: the base dir (made when
    /// missing), the host_path and the staging path, as `HostPaths` describes.
    async fn check_attach_paths(
        &self,
        paths: &VolumePaths,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let base = base_of(&paths.target);
        self.check_paths(&base, true, &[&paths.target, &paths.staging], deadline)
            .await
    }

    /// Makes the base dir of `paths` and checks it, for a caller that comes to
    /// `establish` without Attach's path check (reconciliation).
    pub(crate) async fn check_base_dir(
        &self,
        paths: &VolumePaths,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        self.check_paths(&base_of(&paths.target), true, &[], deadline)
            .await
    }

    /// Checks `paths` (under `base`) just before the driver gets them: each a real
    /// directory or missing, reached without a symlink.
    pub(crate) async fn verify(
        &self,
        base: &Path,
        paths: &[&Path],
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        self.check_paths(base, false, paths, deadline).await
    }

    /// `verify`, after making the base dir when `make_base`, all in one `on_paths`.
    async fn check_paths(
        &self,
        base: &Path,
        make_base: bool,
        paths: &[&Path],
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let host_paths = self.host_paths.clone();
        let dir = base.to_path_buf();
        let owned: Vec<PathBuf> = paths.iter().map(|p| p.to_path_buf()).collect();
        // What a timed-out trip names: the base dir while it may still be made.
        let named = match paths.first() {
            Some(first) if !make_base => *first,
            _ => base,
        };
        self.on_paths(base, named, deadline, move || {
            if make_base {
                host_paths.ensure_base_dir(&dir)?;
            }
            owned
                .iter()
                .try_for_each(|path| host_paths.verify(&dir, path).map(|_| ()))
        })
        .await
    }

    /// Runs `HostPaths` calls under `base` as `on_paths` does.
    async fn on_paths<T: Send + 'static>(
        &self,
        base: &Path,
        path: &Path,
        deadline: &Deadline,
        f: impl FnOnce() -> Result<T, PathError> + Send + 'static,
    ) -> Result<T, BridgeError> {
        on_paths(&self.host_paths, base, path, deadline, f).await
    }

    /// Judges an unpublish/unstage reply: success must leave `path` unmounted, and a
    /// driver that no longer knows the volume is success when nothing is mounted there
    /// (csi-driver-host-path answers NOT_FOUND for volumes it forgot).
    async fn undo_result(
        &self,
        reply: Result<Undone, DriverError>,
        path: &Path,
        call: &'static str,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let undone = self.driver.driver(reply).await?;
        let still_mounted = self.visibility(path, deadline).await? == Visibility::Mounted;
        match (undone, still_mounted) {
            (_, false) => Ok(()),
            (Undone::UnknownVolume, true) => Err(BridgeError::Precondition(format!(
                "CSI {call} answered NOT_FOUND for the volume but {} is still mounted",
                path.display()
            ))),
            (Undone::Done, true) => Err(BridgeError::StillMounted {
                path: path.to_path_buf(),
                call,
            }),
        }
    }
}

fn check_caller(caller: &Caller) -> Result<(), BridgeError> {
    if caller.is_gone() {
        Err(BridgeError::CallerGone)
    } else {
        Ok(())
    }
}

/// Attach's reply for a record.
/// The hot-path rule of Detach, decided here only (both `detach_if_hot` and `detach` ask
/// it): Cube still counts holders in the namespace, or another namespace holds the volume
/// (`holders_after` is the record's holders with this Detach applied). Then answering
/// changes at most one line of the holder log; otherwise the volume is torn down.
fn detach_is_hot(req: &DetachVolume, holders_after: &Holders) -> bool {
    req.ref_count > 0 || !holders_after.is_empty()
}

fn attached(record: &NodeRecord, volume_id: &str) -> Attached {
    let paths = VolumePaths {
        target: record.target_path.clone(),
        staging: record.staging_path.clone().unwrap_or_default(),
    };
    let meta = AttachMetadata {
        paths,
        csi_volume_id: record.csi_volume_id.clone(),
        staged: record.staging_path.is_some(),
    };
    Attached {
        host_path: record.target_path.clone(),
        metadata: meta.to_map(volume_id),
    }
}

/// Whether `path` exists. A filesystem that does not answer within a few seconds (a dead
/// network mount) counts as "exists": the caller then treats the step as uncertain and
/// asks the driver to undo it, rather than hanging the hook.
async fn path_exists(path: &Path) -> bool {
    const PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);
    tokio::time::timeout(PATIENCE, tokio::fs::symlink_metadata(path))
        .await
        .map_or(true, |found| found.is_ok())
}

/// The base dir of a host_path (`<base>/<leaf>`).
pub(crate) fn base_of(target: &Path) -> PathBuf {
    target.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Attach's paths checked as `HostPaths::verify` describes, by a process that has opened
/// nothing yet (a forked hook, before it opens the bridge's state): a base dir or a path
/// under it that another user has steered is refused, and the refused Attach leaves no
/// trace. `verify` never waits on a filesystem mounted at a leaf, so no deadline is needed.
pub fn check_attach_paths_first(
    host_paths: &dyn HostPaths,
    driver: &str,
    req: &AttachVolume,
) -> Result<(), HookError> {
    let paths = VolumePaths::new(&req.base_dir, driver, &req.volume_id);
    let base = base_of(&paths.target);
    [&paths.target, &paths.staging]
        .into_iter()
        .try_for_each(|path| host_paths.verify(&base, path).map(drop))
        .map_err(|error| HookError {
            hook: HookKind::Attach,
            volume_id: req.volume_id.clone(),
            error: error.into(),
        })
}

/// Runs `HostPaths` calls under `base` (`path` names them in a timeout's error). Where
/// the base dir's filesystem answers at once (a local disk or memory) they are made here:
/// a trip to a blocking thread is two thread wake-ups, and a first Attach made four.
/// Elsewhere they go to a blocking thread, bounded by the deadline: a stat on a dead
/// network filesystem must not hang the hook, nor hold the threads every other hook needs.
async fn on_paths<T: Send + 'static>(
    host_paths: &Arc<dyn HostPaths>,
    base: &Path,
    path: &Path,
    deadline: &Deadline,
    f: impl FnOnce() -> Result<T, PathError> + Send + 'static,
) -> Result<T, BridgeError> {
    if host_paths.answers_at_once(base) {
        return f().map_err(BridgeError::from);
    }
    let work = blocking(move || f().map_err(BridgeError::from));
    tokio::time::timeout_at(deadline.instant().into(), work)
        .await
        .unwrap_or_else(|_| {
            Err(BridgeError::io(
                format!("checking {}", path.display()),
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no answer within the hook's budget",
                ),
            ))
        })
}

/// What a teardown does with a directory the bridge or driver made.
#[derive(Debug, Clone, Copy)]
enum DirEnd {
    /// Removed (`HostPaths::remove_dir_if_empty`).
    Remove,
    /// A staging dir: parked for the volume's next first Attach where the host paths can,
    /// removed otherwise (`HostPaths::park_staging_dir`).
    Park,
}

/// Removes (or parks, `end`) a directory the bridge or driver made, if it is empty and not
/// mounted; one left in place because it still holds files is reported. A path that fails
/// its check is left alone (it is not the bridge's: a symlink, a file), with a warning:
/// removing it is no part of undoing the bridge's work. Bounded by the deadline where the
/// base dir's filesystem may hang (`on_paths`).
async fn remove_dir(
    host_paths: &Arc<dyn HostPaths>,
    base: &Path,
    dir: &Path,
    deadline: &Deadline,
    end: DirEnd,
) -> Result<(), BridgeError> {
    let (paths, owned_base, owned) = (host_paths.clone(), base.to_path_buf(), dir.to_path_buf());
    let outcome = on_paths(host_paths, base, dir, deadline, move || {
        let left = match end {
            DirEnd::Remove => paths.remove_dir_if_empty(&owned_base, &owned),
            DirEnd::Park => paths.park_staging_dir(&owned_base, &owned),
        };
        match left {
            Ok(removed) => Ok(Ok(removed)),
            Err(refused @ PathError::Refused { .. }) => Ok(Err(refused)),
            Err(error) => Err(error),
        }
    })
    .await?;
    match outcome {
        Ok(true) => {}
        Ok(false) => {
            if dir.exists() {
                tracing::warn!(dir = %dir.display(), "left a non-empty directory in place");
            }
        }
        Err(refused) => {
            tracing::warn!(error = %refused, "left a path the bridge did not make in place");
        }
    }
    Ok(())
}

/// Which holders an operator releases (`NodeSide::release_holders`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    Sandbox {
        namespace: String,
        sandbox: String,
    },
    /// Every sandbox of the namespace.
    Namespace(String),
    /// The holders a lost record could not name.
    Unknown,
}

/// What a release did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// `namespace/sandbox` (or `UNKNOWN`) of each released holder.
    pub holders: Vec<String>,
    /// No holder was left: the volume was torn down.
    pub torn_down: bool,
}

fn describe_holders(holders: &Holders) -> String {
    let all: Vec<String> = holders
        .iter()
        .flat_map(|(ns, set)| set.iter().map(move |sb| format!("{ns}/{sb}")))
        .collect();
    if all.is_empty() {
        "none".to_string()
    } else {
        all.join(", ")
    }
}
