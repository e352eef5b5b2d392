//! Attach and Detach: the node side, as kubelet would do it for one pod volume.
//!
//! Attach = [ControllerPublish] → [NodeStage at the staging path] → NodePublish at the
//! host_path → check that Cubelet sees the mount. Detach at ref_count 0 = the reverse.
//! The node journal is written before every mutating call, a failed Attach undoes its
//! own work before answering (Cube never Detaches after a failed Attach), and the mount
//! table, not ref_count, decides whether a volume is really attached.

use std::path::{Path, PathBuf};

use super::handoff::{AttachMetadata, VolumeHandle};
use super::locks::LockScope;
use super::naming::VolumePaths;
use super::{
    AttachVolume, Attached, Bridge, BridgeError, DetachVolume, HookError, HookKind, blocking,
};
use crate::csi::{CsiError, Deadline};
use crate::k8s::SecretUse;
use crate::mount::ops;
use crate::proto::csi::v1 as csi;
use crate::store::{NodeJournal, NodeRecord, Step};

/// Which optional calls Attach makes for this driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodePlan {
    pub stage: bool,
    /// The node id to ControllerPublish to, when the driver needs ControllerPublish.
    pub controller_publish_node: Option<String>,
    /// The driver's GetPluginInfo name.
    pub driver_name: String,
}

impl Bridge {
    pub(crate) fn journal(&self) -> &NodeJournal {
        self.journal
            .as_ref()
            .expect("node hooks are only routed to a bridge with the node role")
    }

    /// Decides the calls Attach makes. `volume_needs_publish` comes from the volume's
    /// handle: the controller saw PUBLISH_UNPUBLISH_VOLUME when it created the volume.
    pub(crate) async fn node_plan(
        &self,
        volume_needs_publish: bool,
        deadline: &Deadline,
    ) -> Result<NodePlan, BridgeError> {
        let stage = self.node_caps(deadline).await?.stage_unstage_volume;
        let (identity, caps) = self.controller_view(deadline).await?;
        let driver_publishes = caps.is_some_and(|c| c.publish_unpublish_volume);
        if volume_needs_publish && !driver_publishes {
            return Err(BridgeError::Driver(format!(
                "this volume needs ControllerPublishVolume (its driver had \
                 PUBLISH_UNPUBLISH_VOLUME when it was created), but {} ({}) offers no \
                 controller publish; set csi.controller_endpoint to the driver's controller",
                self.controller_csi.endpoint(),
                identity.name
            )));
        }
        let controller_publish_node = if driver_publishes {
            Some(self.node_id(deadline).await?)
        } else {
            None
        };
        Ok(NodePlan {
            stage,
            controller_publish_node,
            driver_name: identity.name,
        })
    }

    /// Is `path` a mount point where Cubelet looks?
    pub(crate) async fn visible(&self, path: &Path) -> Result<bool, BridgeError> {
        let (view, path) = (self.mount_view.clone(), path.to_path_buf());
        blocking(move || {
            view.is_mount_point(&path)
                .map_err(|e| BridgeError::io(format!("reading mounts of {}", view.describe()), e))
        })
        .await
    }

    async fn save(&self, record: &NodeRecord, durable: bool) -> Result<(), BridgeError> {
        let (journal, record) = (self.journal().clone(), record.clone());
        blocking(move || {
            journal.save(&record, durable).map_err(|e| {
                BridgeError::io(
                    format!("writing node journal in {}", journal.dir().display()),
                    e,
                )
            })
        })
        .await
    }

    async fn load(&self, volume_id: &str) -> Result<Option<NodeRecord>, BridgeError> {
        let (journal, id) = (self.journal().clone(), volume_id.to_string());
        blocking(move || {
            journal.load(&id).map_err(|e| {
                BridgeError::io(
                    format!("reading node journal in {}", journal.dir().display()),
                    e,
                )
            })
        })
        .await
    }

    /// Cube Attach.
    pub async fn attach(&self, req: AttachVolume) -> Result<Attached, HookError> {
        let volume_id = req.volume_id.clone();
        self.hook(HookKind::Attach, &volume_id, async {
            let deadline = Deadline::after(self.config.timeouts.attach());
            let paths = VolumePaths::new(&req.base_dir, &self.config.driver, &req.volume_id);
            let _guard = self.locks.acquire(LockScope::Node, &req.volume_id, &deadline).await?;
            let holder = format!("{}/{}", req.namespace, req.sandbox_id);

            let mut record = match self.load(&req.volume_id).await? {
                Some(existing)
                    if existing.target_path == paths.target
                        && existing.csi_volume_id == req.handle.csi_volume_id =>
                {
                    existing
                }
                Some(mut stale) => {
                    if stale.publish == Step::Done && self.visible(&stale.target_path).await? {
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
                    self.teardown(&mut stale, &deadline).await?;
                    NodeRecord::new(&req.volume_id, &req.handle.csi_volume_id, paths.target.clone())
                }
                None => NodeRecord::new(&req.volume_id, &req.handle.csi_volume_id, paths.target.clone()),
            };

            if record.publish == Step::Done && self.visible(&paths.target).await? {
                // Already attached and healthy: no CSI call, and no disk write unless this
                // sandbox is new to the record.
                if record.holders.insert(holder) {
                    self.save(&record, false).await?;
                }
                tracing::debug!(ref_count = req.ref_count, "already mounted");
                return Ok(attached(&record, &req.volume_id));
            }
            if req.ref_count > 0 {
                tracing::warn!(
                    ref_count = req.ref_count,
                    "volume has holders but is not mounted (host reboot or lost mount?); re-establishing it"
                );
            }

            record.holders.insert(holder);
            match self.establish(&mut record, &req.handle, &paths, &deadline).await {
                Ok(()) => Ok(attached(&record, &req.volume_id)),
                Err(error) => {
                    let rollback = Deadline::after(self.config.timeouts.rollback());
                    match self.teardown(&mut record, &rollback).await {
                        Ok(()) => {
                            tracing::info!("partial attach undone");
                            Err(error)
                        }
                        Err(rollback) => Err(BridgeError::RollbackFailed {
                            error: Box::new(error),
                            rollback: Box::new(rollback),
                        }),
                    }
                }
            }
        })
        .await
    }

    /// The calls of a first (or repaired) Attach, recording each step before making it.
    async fn establish(
        &self,
        record: &mut NodeRecord,
        handle: &VolumeHandle,
        paths: &VolumePaths,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let plan = self.node_plan(handle.controller_publish, deadline).await?;
        // Everything that may fail to resolve is resolved before anything changes.
        let spec = self.volume_spec(&plan.driver_name).await?;
        let publish_secrets = if plan.controller_publish_node.is_some() {
            self.secrets(SecretUse::ControllerPublish).await?
        } else {
            Default::default()
        };
        let stage_secrets = if plan.stage {
            self.secrets(SecretUse::NodeStage).await?
        } else {
            Default::default()
        };
        let node_publish_secrets = self.secrets(SecretUse::NodePublish).await?;
        record.volume_context = handle.volume_context.clone();
        let base = paths
            .target
            .parent()
            .expect("target has a parent")
            .to_path_buf();
        let staging = plan.stage.then(|| paths.staging.clone());
        blocking(move || {
            // Cubelet creates the base dir before Attach; do it too, for other callers.
            ops::ensure_dir(&base, 0o755).map_err(|e| BridgeError::io("volume base dir", e))?;
            if let Some(staging) = staging {
                // The CO creates the staging directory (CSI spec); the driver the target.
                ops::ensure_dir(&staging, 0o750).map_err(|e| BridgeError::io("staging dir", e))?;
            }
            Ok(())
        })
        .await?;

        if let Some(node_id) = plan.controller_publish_node {
            record.node_id = node_id.clone();
            record.controller_publish = Step::Uncertain;
            self.save(record, true).await?;
            let request = csi::ControllerPublishVolumeRequest {
                volume_id: record.csi_volume_id.clone(),
                node_id,
                volume_capability: Some(spec.capability.clone()),
                readonly: false,
                secrets: publish_secrets,
                volume_context: record.volume_context.clone().into_iter().collect(),
            };
            let reply = self
                .controller_csi
                .controller_publish_volume(request, deadline)
                .await;
            let reply = self
                .step_result(&mut record.controller_publish, reply)
                .await?;
            record.publish_context = reply.publish_context.into_iter().collect();
        }

        if plan.stage {
            record.staging_path = Some(paths.staging.clone());
            record.stage = Step::Uncertain;
            self.save(record, true).await?;
            let request = csi::NodeStageVolumeRequest {
                volume_id: record.csi_volume_id.clone(),
                publish_context: record.publish_context.clone().into_iter().collect(),
                staging_target_path: path_string(&paths.staging),
                volume_capability: Some(spec.capability.clone()),
                secrets: stage_secrets,
                volume_context: record.volume_context.clone().into_iter().collect(),
            };
            let reply = self.node_csi.node_stage_volume(request, deadline).await;
            self.step_result(&mut record.stage, reply).await?;
        }

        record.publish = Step::Uncertain;
        self.save(record, true).await?;
        let request = csi::NodePublishVolumeRequest {
            volume_id: record.csi_volume_id.clone(),
            publish_context: record.publish_context.clone().into_iter().collect(),
            staging_target_path: record
                .staging_path
                .as_deref()
                .map(path_string)
                .unwrap_or_default(),
            target_path: path_string(&paths.target),
            volume_capability: Some(spec.capability.clone()),
            readonly: false,
            secrets: node_publish_secrets,
            volume_context: record.volume_context.clone().into_iter().collect(),
        };
        let reply = self.node_csi.node_publish_volume(request, deadline).await;
        self.step_result(&mut record.publish, reply).await?;
        self.save(record, false).await?;

        if !self.visible(&paths.target).await? {
            return Err(BridgeError::NotVisible {
                path: paths.target.clone(),
                view: self.mount_view.describe(),
            });
        }
        Ok(())
    }

    /// Records the outcome of a mutating call: Done on success; Absent after a final
    /// error (nothing is in progress, per CSI); still Uncertain after a non-final one.
    async fn step_result<T>(
        &self,
        step: &mut Step,
        reply: Result<T, CsiError>,
    ) -> Result<T, BridgeError> {
        match reply {
            Ok(value) => {
                *step = Step::Done;
                Ok(value)
            }
            Err(error) => {
                if !error.is_uncertain() {
                    *step = Step::Absent;
                }
                self.note_csi_error(&error).await;
                Err(error.into())
            }
        }
    }

    /// Cube Detach.
    pub async fn detach(&self, req: DetachVolume) -> Result<(), HookError> {
        let volume_id = req.volume_id.clone();
        self.hook(HookKind::Detach, &volume_id, async {
            if req.ref_count > 0 {
                tracing::debug!(
                    ref_count = req.ref_count,
                    "other sandboxes still hold the volume"
                );
                return Ok(());
            }
            let deadline = Deadline::after(self.config.timeouts.detach());
            let _guard = self
                .locks
                .acquire(LockScope::Node, &req.volume_id, &deadline)
                .await?;
            let mut record = match (self.load(&req.volume_id).await?, req.recorded) {
                (Some(record), recorded) => {
                    if let Some(meta) = recorded
                        && meta.paths.target != record.target_path
                    {
                        tracing::warn!(
                            metadata_mount_dir = %meta.paths.target.display(),
                            journal_mount_dir = %record.target_path.display(),
                            "Detach metadata and node journal disagree; following the journal"
                        );
                    }
                    record
                }
                (None, Some(meta)) => self.record_from_metadata(&req.volume_id, meta).await?,
                (None, None) => {
                    tracing::info!("nothing attached on this node; nothing to do");
                    return Ok(());
                }
            };
            self.teardown(&mut record, &deadline).await
        })
        .await
    }

    /// Without a journal record (lost, or never written), Detach works from Cube's
    /// metadata: steps start Absent, and teardown calls the driver only for what is still
    /// mounted. Metadata outside the configured base dir is refused unless there is
    /// nothing there to act on.
    async fn record_from_metadata(
        &self,
        volume_id: &str,
        meta: AttachMetadata,
    ) -> Result<NodeRecord, BridgeError> {
        let base = meta
            .paths
            .target
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        if base != self.config.node.default_volume_base_dir
            && (path_exists(&meta.paths.target).await || path_exists(&meta.paths.staging).await)
        {
            return Err(BridgeError::InvalidRequest(format!(
                "metadata mount_dir {} is outside node.default_volume_base_dir {} and this node \
                 has no journal record of it; refusing to act on it (set \
                 node.default_volume_base_dir to Cubelet's volume_plugin_base_dir)",
                meta.paths.target.display(),
                self.config.node.default_volume_base_dir.display()
            )));
        }
        let mut record = NodeRecord::new(volume_id, &meta.csi_volume_id, meta.paths.target.clone());
        if meta.staged {
            record.staging_path = Some(meta.paths.staging);
        }
        Ok(record)
    }

    /// Undoes whatever the record says may exist, in reverse order, saving progress so a
    /// later Detach resumes where this one stopped. Removes the record when done.
    pub(crate) async fn teardown(
        &self,
        record: &mut NodeRecord,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let target = record.target_path.clone();
        if record.publish.needs_undo() || self.visible(&target).await? {
            let request = csi::NodeUnpublishVolumeRequest {
                volume_id: record.csi_volume_id.clone(),
                target_path: path_string(&target),
            };
            let reply = self.node_csi.node_unpublish_volume(request, deadline).await;
            self.undo_result(reply, &target, "NodeUnpublishVolume")
                .await?;
            record.publish = Step::Absent;
            self.save(record, false).await?;
        }
        remove_dir(&target, true).await?;

        if let Some(staging) = record.staging_path.clone() {
            if record.stage.needs_undo() || self.visible(&staging).await? {
                let request = csi::NodeUnstageVolumeRequest {
                    volume_id: record.csi_volume_id.clone(),
                    staging_target_path: path_string(&staging),
                };
                let reply = self.node_csi.node_unstage_volume(request, deadline).await;
                self.undo_result(reply, &staging, "NodeUnstageVolume")
                    .await?;
                record.stage = Step::Absent;
                self.save(record, false).await?;
            }
            remove_dir(&staging, true).await?;
            if let Some(parent) = staging.parent() {
                // Shared by every staged volume: removed only when the last one goes.
                remove_dir(parent, false).await?;
            }
        }

        if record.controller_publish.needs_undo() {
            let request = csi::ControllerUnpublishVolumeRequest {
                volume_id: record.csi_volume_id.clone(),
                node_id: record.node_id.clone(),
                secrets: self.secrets(SecretUse::ControllerPublish).await?,
            };
            match self
                .controller_csi
                .controller_unpublish_volume(request, deadline)
                .await
            {
                Ok(_) => {}
                Err(e) if e.code == tonic::Code::NotFound => {}
                Err(e) => {
                    self.note_csi_error(&e).await;
                    return Err(e.into());
                }
            }
            record.controller_publish = Step::Absent;
        }

        let (journal, id) = (self.journal().clone(), record.volume_id.clone());
        blocking(move || {
            journal
                .remove(&id)
                .map_err(|e| BridgeError::io(format!("removing node journal record of {id}"), e))
        })
        .await
    }

    /// Judges an unpublish/unstage reply: success must leave `path` unmounted, and
    /// NOT_FOUND counts as success when nothing is mounted there (drivers such as
    /// csi-driver-host-path answer NOT_FOUND for volumes they no longer know).
    async fn undo_result<T>(
        &self,
        reply: Result<T, CsiError>,
        path: &Path,
        call: &'static str,
    ) -> Result<(), BridgeError> {
        match reply {
            Ok(_) => {}
            Err(e) if e.code == tonic::Code::NotFound && !self.visible(path).await? => {
                tracing::info!(call, path = %path.display(), "driver no longer knows the volume and nothing is mounted");
                return Ok(());
            }
            Err(e) => {
                self.note_csi_error(&e).await;
                return Err(e.into());
            }
        }
        if self.visible(path).await? {
            return Err(BridgeError::StillMounted {
                path: path.to_path_buf(),
                call,
            });
        }
        Ok(())
    }
}

/// Attach's reply for a record.
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

fn path_string(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

async fn path_exists(path: &Path) -> bool {
    tokio::fs::symlink_metadata(path).await.is_ok()
}

/// Removes a directory the bridge or driver made, if it is empty and not mounted;
/// `warn_if_kept` reports one left in place because it still holds files.
async fn remove_dir(dir: &Path, warn_if_kept: bool) -> Result<(), BridgeError> {
    let dir: PathBuf = dir.to_path_buf();
    blocking(move || match ops::remove_dir_if_empty(&dir) {
        Ok(true) => Ok(()),
        Ok(false) => {
            if warn_if_kept && dir.exists() {
                tracing::warn!(dir = %dir.display(), "left a non-empty directory in place");
            }
            Ok(())
        }
        Err(e) => Err(BridgeError::io("cleaning up", e)),
    })
    .await
}
