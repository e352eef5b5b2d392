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

use std::collections::HashMap;

use super::handoff::VolumeHandle;
use super::locks::LockScope;
use super::naming::csi_volume_name;
use super::profile::VolumeSpec;
use super::{Bridge, BridgeError, CreateVolume, Created, DestroyVolume, HookError, HookKind};
use crate::csi::{ControllerCaps, CsiError, Deadline, DriverIdentity};
use crate::k8s::SecretUse;
use crate::proto::csi::v1 as csi;
use crate::store::controller::now_secs;
use crate::store::{ControllerStore, DeletionPolicy, StoreError, VolumeRecord, VolumeState};

/// How often a write that lost a race to another replica is retried on a fresh read.
const STORE_RACE_RETRIES: usize = 3;

/// Refuses a driver that cannot create volumes.
pub(crate) fn require_create_delete(
    identity: &DriverIdentity,
    caps: Option<&ControllerCaps>,
) -> Result<(), BridgeError> {
    match caps {
        Some(c) if c.create_delete_volume => Ok(()),
        Some(_) => Err(BridgeError::Driver(format!(
            "CSI driver {} lacks the CREATE_DELETE_VOLUME controller capability, so it cannot \
             back Cube's Create and Destroy",
            identity.name
        ))),
        None => Err(BridgeError::Driver(format!(
            "CSI driver {} has no controller service at this endpoint, so it cannot back \
             Cube's Create and Destroy; point csi.controller_endpoint (or csi.endpoint) at \
             the driver's controller",
            identity.name
        ))),
    }
}

impl Bridge {
    fn store(&self) -> &ControllerStore {
        self.store
            .as_ref()
            .expect("controller hooks are only routed to a bridge with the controller role")
    }

    /// The CreateVolume request for a Cube volume (the same every time for one id).
    async fn create_request(
        &self,
        csi_name: &str,
        spec: &VolumeSpec,
    ) -> Result<csi::CreateVolumeRequest, BridgeError> {
        let volume = &self.config.volume;
        Ok(csi::CreateVolumeRequest {
            name: csi_name.to_string(),
            capacity_range: (volume.capacity_bytes > 0).then_some(csi::CapacityRange {
                required_bytes: volume.capacity_bytes as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![spec.capability.clone()],
            parameters: spec.parameters.clone().into_iter().collect(),
            secrets: self.secrets(SecretUse::Provisioner).await?,
            ..Default::default()
        })
    }

    async fn create_volume(
        &self,
        csi_name: &str,
        spec: &VolumeSpec,
        deadline: &Deadline,
    ) -> Result<csi::Volume, BridgeError> {
        let request = self.create_request(csi_name, spec).await?;
        let reply = self.controller_csi.create_volume(request, deadline).await;
        match reply {
            Ok(reply) => reply
                .volume
                .filter(|v| !v.volume_id.is_empty())
                .ok_or_else(|| {
                    BridgeError::Driver(
                        "CSI CreateVolume succeeded but returned no volume id".into(),
                    )
                }),
            Err(e) => {
                self.note_csi_error(&e).await;
                Err(e.into())
            }
        }
    }

    async fn delete_volume(
        &self,
        csi_volume_id: &str,
        secrets: HashMap<String, String>,
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let request = csi::DeleteVolumeRequest {
            volume_id: csi_volume_id.to_string(),
            secrets,
        };
        match self.controller_csi.delete_volume(request, deadline).await {
            Ok(_) => Ok(()),
            // DeleteVolume of an unknown volume must succeed (CSI spec); some drivers
            // answer NOT_FOUND anyway.
            Err(CsiError {
                code: tonic::Code::NotFound,
                ..
            }) => Ok(()),
            Err(e) => {
                self.note_csi_error(&e).await;
                Err(e.into())
            }
        }
    }

    /// Records the intent to create (state Creating), or adopts the record another
    /// replica or an earlier attempt left for this volume.
    async fn begin_create(
        &self,
        volume_id: &str,
        csi_name: &str,
        csi_driver: &str,
        deletion: Option<&DeletionPolicy>,
    ) -> Result<VolumeRecord, BridgeError> {
        for _ in 0..STORE_RACE_RETRIES {
            if let Some(existing) = self.store().get(volume_id).await? {
                check_same_driver(&existing, csi_driver)?;
                if existing.csi_name != csi_name {
                    return Err(BridgeError::Driver(format!(
                        "the controller store already records this volume as CSI volume \
                         name {:?}, but volume.name_prefix now gives {csi_name:?}; restore \
                         the old name_prefix or Destroy the volume first",
                        existing.csi_name
                    )));
                }
                return Ok(existing);
            }
            let mut record = VolumeRecord {
                volume_id: volume_id.to_string(),
                csi_name: csi_name.to_string(),
                csi_driver: Some(csi_driver.to_string()),
                state: VolumeState::Creating,
                csi_volume_id: None,
                volume_context: Default::default(),
                capacity_bytes: 0,
                updated_at: now_secs(),
                deletion: deletion.cloned(),
                revision: None,
            };
            match self.store().put(&mut record).await {
                Ok(()) => return Ok(record),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Conflict {
            volume_id: volume_id.to_string(),
        }
        .into())
    }

    /// Records the created volume. A replica that raced this one and recorded the same
    /// handle first is success.
    async fn finish_create(
        &self,
        mut record: VolumeRecord,
        volume: &csi::Volume,
        deletion: Option<&DeletionPolicy>,
    ) -> Result<(), BridgeError> {
        for _ in 0..STORE_RACE_RETRIES {
            record.state = VolumeState::Created;
            record.deletion = deletion.cloned();
            record.csi_volume_id = Some(volume.volume_id.clone());
            record.volume_context = volume.volume_context.clone().into_iter().collect();
            record.capacity_bytes = volume.capacity_bytes;
            record.updated_at = now_secs();
            match self.store().put(&mut record).await {
                Ok(()) => return Ok(()),
                Err(StoreError::Conflict { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            match self.store().get(&record.volume_id).await? {
                Some(current) if current.csi_volume_id.as_deref() == Some(&volume.volume_id) => {
                    return Ok(());
                }
                Some(current) => record = current,
                None => {
                    return Err(BridgeError::Driver(format!(
                        "the record of this volume was deleted while CSI volume {:?} was \
                         being created (a concurrent Destroy?); the CSI volume may need \
                         deleting",
                        volume.volume_id
                    )));
                }
            }
        }
        Err(StoreError::Conflict {
            volume_id: record.volume_id,
        }
        .into())
    }

    /// Cube Create.
    pub async fn create(&self, req: CreateVolume) -> Result<Created, HookError> {
        let volume_id = req.volume_id.clone();
        self.hook(HookKind::Create, &volume_id, async {
            let deadline = Deadline::after(self.config.timeouts.create());
            let (identity, caps) = self.controller_view(&deadline).await?;
            require_create_delete(&identity, caps.as_ref())?;
            // Resolved before anything is written: a bad StorageClass changes nothing.
            let spec = self.volume_spec(&identity.name).await?;
            let _guard = self
                .locks
                .acquire(LockScope::Controller, &req.volume_id, &deadline)
                .await?;
            let csi_name = csi_volume_name(&self.config.volume.name_prefix, &req.volume_id);
            tracing::info!(name = %req.name, csi_name, "creating CSI volume");

            // Intent first: if the answer to CreateVolume is lost, Destroy can still find
            // the volume by its name.
            let record = self
                .begin_create(
                    &req.volume_id,
                    &csi_name,
                    &identity.name,
                    spec.deletion.as_ref(),
                )
                .await?;

            let volume = match self.create_volume(&csi_name, &spec, &deadline).await {
                Ok(v) => v,
                Err(error) => {
                    // A final error means nothing was created: forget the intent (unless
                    // the record is an earlier, finished create).
                    let uncertain = matches!(&error, BridgeError::Csi(e) if e.is_uncertain());
                    if !uncertain && record.state == VolumeState::Creating {
                        match self.store().delete(&record).await {
                            Ok(()) | Err(StoreError::Conflict { .. }) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                    return Err(error);
                }
            };

            let required = self.config.volume.capacity_bytes as i64;
            let handle = VolumeHandle {
                csi_volume_id: volume.volume_id.clone(),
                volume_context: volume.volume_context.clone().into_iter().collect(),
                controller_publish: caps.is_some_and(|c| c.publish_unpublish_volume),
            };
            let encoded = if volume.capacity_bytes != 0 && volume.capacity_bytes < required {
                Err(format!(
                    "the driver created a volume of {} bytes, less than the {required} requested",
                    volume.capacity_bytes
                ))
            } else {
                handle.encode()
            };
            let private_data = match encoded {
                Ok(private_data) => private_data,
                Err(problem) => {
                    return Err(self
                        .undo_create(&req.volume_id, &volume.volume_id, problem)
                        .await);
                }
            };

            self.finish_create(record, &volume, spec.deletion.as_ref())
                .await?;
            tracing::info!(csi_volume_id = %volume.volume_id, "CSI volume created");
            Ok(Created {
                token: String::new(),
                private_data,
            })
        })
        .await
    }

    /// Deletes a volume Create cannot hand to Cube, and reports why.
    async fn undo_create(
        &self,
        volume_id: &str,
        csi_volume_id: &str,
        problem: String,
    ) -> BridgeError {
        let error = BridgeError::Driver(problem);
        let deadline = Deadline::after(self.config.timeouts.rollback());
        let undone = async {
            let secrets = self.secrets(SecretUse::Provisioner).await?;
            self.delete_volume(csi_volume_id, secrets, &deadline)
                .await?;
            if let Some(record) = self.store().get(volume_id).await? {
                self.store().delete(&record).await?;
            }
            Ok::<_, BridgeError>(())
        }
        .await;
        match undone {
            Ok(()) => error,
            Err(rollback) => BridgeError::RollbackFailed {
                error: Box::new(error),
                rollback: Box::new(rollback),
            },
        }
    }

    /// Cube Destroy.
    pub async fn destroy(&self, req: DestroyVolume) -> Result<(), HookError> {
        let volume_id = req.volume_id.clone();
        self.hook(HookKind::Destroy, &volume_id, async {
            let deadline = Deadline::after(self.config.timeouts.destroy());
            let _guard = self
                .locks
                .acquire(LockScope::Controller, &req.volume_id, &deadline)
                .await?;
            let Some(record) = self.store().get(&req.volume_id).await? else {
                tracing::info!("no record of this volume; nothing to delete");
                return Ok(());
            };
            let (identity, _) = self.controller_view(&deadline).await?;
            check_same_driver(&record, &identity.name)?;
            // A finished create recorded how to delete it; only an unfinished one (or a
            // record from before that existed) needs the current settings.
            let (csi_volume_id, deletion) = match (&record.state, &record.csi_volume_id, &record.deletion) {
                (VolumeState::Created, Some(id), Some(deletion)) => (id.clone(), Some(deletion.clone())),
                (VolumeState::Created, Some(id), None) => {
                    (id.clone(), self.volume_spec(&identity.name).await?.deletion)
                }
                _ => {
                    // The answer to an earlier CreateVolume was lost. CreateVolume is
                    // idempotent by name: asking again returns the volume if it exists.
                    tracing::info!(csi_name = %record.csi_name, "resolving an unfinished create before deleting");
                    let spec = self.volume_spec(&identity.name).await?;
                    let id = self
                        .create_volume(&record.csi_name, &spec, &deadline)
                        .await?
                        .volume_id;
                    (id, spec.deletion)
                }
            };
            if deletion.as_ref().is_some_and(|d| d.retain) {
                tracing::warn!(%csi_volume_id, csi_name = %record.csi_name, "StorageClass reclaimPolicy is Retain: the CSI volume is kept; delete it by hand when no longer needed");
            } else {
                let secrets = self.deletion_secrets(deletion.as_ref()).await?;
                self.delete_volume(&csi_volume_id, secrets, &deadline).await?;
            }
            match self.store().delete(&record).await {
                Ok(()) => {}
                // Another replica changed or removed the record meanwhile; what matters
                // is that it no longer names a live volume.
                Err(StoreError::Conflict { .. }) => match self.store().get(&req.volume_id).await? {
                    None => {}
                    Some(current) if current.csi_volume_id.as_deref() == Some(&csi_volume_id) => {
                        self.store().delete(&current).await?;
                    }
                    Some(_) => {
                        return Err(StoreError::Conflict {
                            volume_id: req.volume_id.clone(),
                        }
                        .into());
                    }
                },
                Err(e) => return Err(e.into()),
            }
            tracing::info!(%csi_volume_id, "CSI volume deleted");
            Ok(())
        })
        .await
    }
}

/// Refuses to hand a volume's handle to a different CSI driver than created it.
fn check_same_driver(record: &VolumeRecord, driver_name: &str) -> Result<(), BridgeError> {
    match &record.csi_driver {
        Some(created_by) if created_by != driver_name => Err(BridgeError::Driver(format!(
            "this volume was created by CSI driver {created_by:?}, but the driver at the \
             controller endpoint is now {driver_name:?}; refusing to pass its handle to \
             another driver (point csi.controller_endpoint back at {created_by:?})"
        ))),
        _ => Ok(()),
    }
}
