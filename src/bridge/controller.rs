//! Create and Destroy: the controller side, as external-provisioner would do it.
//!
//! Create sends CreateVolume with a name derived from the Cube volume_id (so a retry
//! finds the same volume), records the handle in the controller store, and returns it as
//! private_data. Destroy deletes what the store names; a volume that is already gone, or
//! was never recorded, is success.

use super::handoff::VolumeHandle;
use super::locks::LockScope;
use super::naming::csi_volume_name;
use super::node::volume_capability;
use super::{Bridge, BridgeError, CreateVolume, Created, DestroyVolume, HookError, HookKind};
use crate::csi::{ControllerCaps, CsiError, Deadline, DriverIdentity};
use crate::proto::csi::v1 as csi;
use crate::store::controller::now_secs;
use crate::store::{ControllerStore, VolumeRecord, VolumeState};

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
    fn create_request(&self, csi_name: &str) -> csi::CreateVolumeRequest {
        let volume = &self.config.volume;
        csi::CreateVolumeRequest {
            name: csi_name.to_string(),
            capacity_range: (volume.capacity_bytes > 0).then_some(csi::CapacityRange {
                required_bytes: volume.capacity_bytes as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![volume_capability(volume)],
            parameters: volume.parameters.clone().into_iter().collect(),
            secrets: self
                .config
                .secrets
                .provisioner
                .clone()
                .into_iter()
                .collect(),
            ..Default::default()
        }
    }

    async fn create_volume(
        &self,
        csi_name: &str,
        deadline: &Deadline,
    ) -> Result<csi::Volume, BridgeError> {
        let reply = self
            .controller_csi
            .create_volume(self.create_request(csi_name), deadline)
            .await;
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
        deadline: &Deadline,
    ) -> Result<(), BridgeError> {
        let request = csi::DeleteVolumeRequest {
            volume_id: csi_volume_id.to_string(),
            secrets: self
                .config
                .secrets
                .provisioner
                .clone()
                .into_iter()
                .collect(),
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

    /// Cube Create.
    pub async fn create(&self, req: CreateVolume) -> Result<Created, HookError> {
        let volume_id = req.volume_id.clone();
        self.hook(HookKind::Create, &volume_id, async {
            let deadline = Deadline::after(self.config.timeouts.create());
            let (identity, caps) = self.controller_view(&deadline).await?;
            require_create_delete(&identity, caps.as_ref())?;
            let _guard = self
                .locks
                .acquire(LockScope::Controller, &req.volume_id, &deadline)
                .await?;
            let csi_name = csi_volume_name(&self.config.volume.name_prefix, &req.volume_id);
            tracing::info!(name = %req.name, csi_name, "creating CSI volume");

            // Intent first: if the answer to CreateVolume is lost, Destroy can still find
            // the volume by its name.
            let mut record = VolumeRecord {
                volume_id: req.volume_id.clone(),
                csi_name: csi_name.clone(),
                state: VolumeState::Creating,
                csi_volume_id: None,
                volume_context: Default::default(),
                capacity_bytes: 0,
                updated_at: now_secs(),
            };
            self.store().put(&record).await?;

            let volume = match self.create_volume(&csi_name, &deadline).await {
                Ok(v) => v,
                Err(error) => {
                    // A final error means nothing was created: forget the intent.
                    let uncertain = matches!(&error, BridgeError::Csi(e) if e.is_uncertain());
                    if !uncertain {
                        self.store().delete(&req.volume_id).await?;
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

            record.state = VolumeState::Created;
            record.csi_volume_id = Some(volume.volume_id.clone());
            record.volume_context = handle.volume_context.clone();
            record.capacity_bytes = volume.capacity_bytes;
            record.updated_at = now_secs();
            self.store().put(&record).await?;
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
            self.delete_volume(csi_volume_id, &deadline).await?;
            self.store().delete(volume_id).await?;
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
            let csi_volume_id = match (&record.state, &record.csi_volume_id) {
                (VolumeState::Created, Some(id)) => id.clone(),
                _ => {
                    // The answer to an earlier CreateVolume was lost. CreateVolume is
                    // idempotent by name: asking again returns the volume if it exists.
                    tracing::info!(csi_name = %record.csi_name, "resolving an unfinished create before deleting");
                    self.create_volume(&record.csi_name, &deadline).await?.volume_id
                }
            };
            self.delete_volume(&csi_volume_id, &deadline).await?;
            self.store().delete(&req.volume_id).await?;
            tracing::info!(%csi_volume_id, "CSI volume deleted");
            Ok(())
        })
        .await
    }
}
