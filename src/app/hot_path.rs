//! The adapters of a process that serves only a node hook's hot path (the forked hook's
//! front, `transport::front`): no CSI client and no Kubernetes client, because the hot
//! path makes no driver call and reads no volume settings. Leaving them out is what keeps
//! that executable small; a call that reached one anyway is an error naming the rule it
//! broke, never an answer.

use std::collections::BTreeMap;
use std::path::Path;

use async_trait::async_trait;

use crate::bridge::Deadline;
use crate::bridge::ports::{
    ControllerCaps, ControllerDriver, ControllerPublish, CreatedVolume, DriverError,
    DriverIdentity, Finality, NewSnapshot, NewVolume, NodeCaps, NodeDriver, NodeInfo, Publish,
    SecretUse, Secrets, SettingsError, SnapshotInfo, Stage, Undone, VolumeSettings, VolumeSpec,
    VolumeStats,
};
use crate::bridge::records::DeletionPolicy;

/// The driver and the volume settings of a hot-path process: every call fails.
#[derive(Debug)]
pub struct NotConnected {
    endpoint: String,
}

impl NotConnected {
    pub fn new(endpoint: &str) -> Self {
        Self {
            endpoint: endpoint.to_string(),
        }
    }

    fn refuse<T>(&self, call: &'static str) -> Result<T, DriverError> {
        Err(DriverError {
            call,
            endpoint: self.endpoint.clone(),
            status: "FailedPrecondition",
            grpc_code: 9,
            finality: Finality::Final,
            message: HOT_PATH_ONLY.to_string(),
            attempts: 0,
            gave_up_after: None,
        })
    }

    fn refuse_settings<T>(&self) -> Result<T, SettingsError> {
        Err(SettingsError {
            message: format!("volume settings were not read: {HOT_PATH_ONLY}"),
            transient: false,
            source: None,
        })
    }
}

const HOT_PATH_ONLY: &str =
    "not made: this process answers only the hot path, which needs no driver call";

#[async_trait]
impl ControllerDriver for NotConnected {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }
    async fn identity(&self, _: &Deadline) -> Result<DriverIdentity, DriverError> {
        self.refuse("GetPluginInfo")
    }
    async fn capabilities(&self, _: &Deadline) -> Result<ControllerCaps, DriverError> {
        self.refuse("ControllerGetCapabilities")
    }
    async fn create_volume(
        &self,
        _: &NewVolume,
        _: &Deadline,
    ) -> Result<CreatedVolume, DriverError> {
        self.refuse("CreateVolume")
    }
    async fn delete_volume(&self, _: &str, _: &Secrets, _: &Deadline) -> Result<(), DriverError> {
        self.refuse("DeleteVolume")
    }
    async fn publish(
        &self,
        _: &ControllerPublish,
        _: &Deadline,
    ) -> Result<BTreeMap<String, String>, DriverError> {
        self.refuse("ControllerPublishVolume")
    }
    async fn unpublish(
        &self,
        _: &str,
        _: &str,
        _: &Secrets,
        _: &Deadline,
    ) -> Result<(), DriverError> {
        self.refuse("ControllerUnpublishVolume")
    }
    async fn create_snapshot(
        &self,
        _: &NewSnapshot,
        _: &Deadline,
    ) -> Result<SnapshotInfo, DriverError> {
        self.refuse("CreateSnapshot")
    }
    async fn delete_snapshot(&self, _: &str, _: &Secrets, _: &Deadline) -> Result<(), DriverError> {
        self.refuse("DeleteSnapshot")
    }
    async fn get_snapshot(
        &self,
        _: &str,
        _: &Secrets,
        _: &Deadline,
    ) -> Result<Option<SnapshotInfo>, DriverError> {
        self.refuse("ListSnapshots")
    }
}

#[async_trait]
impl NodeDriver for NotConnected {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }
    async fn probe(&self, _: &Deadline) -> Result<(), DriverError> {
        self.refuse("Probe")
    }
    async fn capabilities(&self, _: &Deadline) -> Result<NodeCaps, DriverError> {
        self.refuse("NodeGetCapabilities")
    }
    async fn node_id(&self, _: &Deadline) -> Result<String, DriverError> {
        self.refuse("NodeGetInfo")
    }
    async fn stage(&self, _: &Stage, _: &Deadline) -> Result<(), DriverError> {
        self.refuse("NodeStageVolume")
    }
    async fn unstage(&self, _: &str, _: &Path, _: &Deadline) -> Result<Undone, DriverError> {
        self.refuse("NodeUnstageVolume")
    }
    async fn publish(&self, _: &Publish, _: &Deadline) -> Result<(), DriverError> {
        self.refuse("NodePublishVolume")
    }
    async fn unpublish(&self, _: &str, _: &Path, _: &Deadline) -> Result<Undone, DriverError> {
        self.refuse("NodeUnpublishVolume")
    }
    async fn volume_stats(
        &self,
        _: &str,
        _: &Path,
        _: &Deadline,
    ) -> Result<VolumeStats, DriverError> {
        self.refuse("NodeGetVolumeStats")
    }
    async fn node_info(&self, _: &Deadline) -> Result<NodeInfo, DriverError> {
        self.refuse("NodeGetInfo")
    }
}

#[async_trait]
impl VolumeSettings for NotConnected {
    async fn spec(&self, _: &str) -> Result<VolumeSpec, SettingsError> {
        self.refuse_settings()
    }
    async fn secrets(&self, _: SecretUse) -> Result<Secrets, SettingsError> {
        self.refuse_settings()
    }
    async fn deletion_secrets(&self, _: Option<&DeletionPolicy>) -> Result<Secrets, SettingsError> {
        self.refuse_settings()
    }
    async fn check(&self, _: Option<&str>) -> Result<Option<String>, SettingsError> {
        self.refuse_settings()
    }
}
