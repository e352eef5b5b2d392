//! Volume settings from the config file: `[volume]` and `[secrets]`. (A StorageClass
//! source lives in `k8s/` and implements the same port.)

use async_trait::async_trait;

use super::{CsiVolumeSettings, SecretsSettings};
use crate::bridge::ports::{
    Capability, SecretUse, Secrets, SettingsError, VolumeSettings, VolumeSpec,
};
use crate::bridge::records::DeletionPolicy;

/// `[volume]` and `[secrets]` of the config file.
#[derive(Debug, Clone)]
pub struct ConfigSettings {
    volume: CsiVolumeSettings,
    secrets: SecretsSettings,
}

impl ConfigSettings {
    pub fn new(volume: &CsiVolumeSettings, secrets: &SecretsSettings) -> Self {
        Self {
            volume: volume.clone(),
            secrets: secrets.clone(),
        }
    }
}

#[async_trait]
impl VolumeSettings for ConfigSettings {
    async fn spec(&self, _driver_name: &str) -> Result<VolumeSpec, SettingsError> {
        Ok(VolumeSpec {
            parameters: self.volume.parameters.clone(),
            capability: Capability {
                access_mode: self.volume.access_mode,
                fs_type: self.volume.fs_type.clone(),
                mount_flags: self.volume.mount_flags.clone(),
            },
            deletion: None,
        })
    }

    async fn secrets(&self, usage: SecretUse) -> Result<Secrets, SettingsError> {
        let s = &self.secrets;
        Ok(Secrets(match usage {
            SecretUse::Provisioner => s.provisioner.clone(),
            SecretUse::ControllerPublish => s.controller_publish.clone(),
            SecretUse::NodeStage => s.node_stage.clone(),
            SecretUse::NodePublish => s.node_publish.clone(),
            SecretUse::ControllerExpand => s.controller_expand.clone(),
            SecretUse::NodeExpand => s.node_expand.clone(),
        }))
    }

    async fn deletion_secrets(
        &self,
        _deletion: Option<&DeletionPolicy>,
    ) -> Result<Secrets, SettingsError> {
        self.secrets(SecretUse::Provisioner).await
    }

    async fn check(&self, _driver_name: Option<&str>) -> Result<Option<String>, SettingsError> {
        Ok(None)
    }
}
