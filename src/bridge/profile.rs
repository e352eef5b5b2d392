//! What every volume of this bridge instance is made of: CreateVolume parameters, the
//! VolumeCapability and the CSI secrets, taken from the config file or, with
//! `kubernetes.storage_class`, from a StorageClass and the Secrets it references.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{Bridge, BridgeError};
use crate::config::{AccessMode, Config};
use crate::k8s::{SecretUse, StorageClassSource};
use crate::proto::csi::v1 as csi;
use crate::store::DeletionPolicy;

/// Where volume settings come from.
#[derive(Debug)]
pub(crate) enum ProfileSource {
    Config,
    StorageClass(StorageClassSource),
}

/// The settings of one CSI request, resolved.
pub(crate) struct VolumeSpec {
    pub parameters: BTreeMap<String, String>,
    pub capability: csi::VolumeCapability,
    /// How Destroy will delete the volume, recorded at Create (StorageClass only).
    pub deletion: Option<DeletionPolicy>,
}

impl Bridge {
    /// The parameters and capability for this instance's volumes. `driver_name` (the
    /// GetPluginInfo name) is checked against the StorageClass's provisioner.
    pub(crate) async fn volume_spec(&self, driver_name: &str) -> Result<VolumeSpec, BridgeError> {
        let volume = &self.config.volume;
        match &self.profile {
            ProfileSource::Config => Ok(VolumeSpec {
                parameters: volume.parameters.clone(),
                capability: volume_capability(
                    volume.access_mode,
                    &volume.fs_type,
                    &volume.mount_flags,
                ),
                deletion: None,
            }),
            ProfileSource::StorageClass(source) => {
                let class = source.class().await?;
                class.check_provisioner(driver_name)?;
                Ok(VolumeSpec {
                    parameters: class.parameters.clone(),
                    capability: volume_capability(
                        volume.access_mode,
                        &class.fs_type,
                        &class.mount_options,
                    ),
                    deletion: Some(DeletionPolicy {
                        retain: class.retain,
                        secret: class.secret_ref(SecretUse::Provisioner).cloned(),
                    }),
                })
            }
        }
    }

    /// The secrets for one family of CSI calls.
    pub(crate) async fn secrets(
        &self,
        usage: SecretUse,
    ) -> Result<HashMap<String, String>, BridgeError> {
        let from_config = |s: &crate::config::SecretsConfig| match usage {
            SecretUse::Provisioner => s.provisioner.clone(),
            SecretUse::ControllerPublish => s.controller_publish.clone(),
            SecretUse::NodeStage => s.node_stage.clone(),
            SecretUse::NodePublish => s.node_publish.clone(),
            SecretUse::ControllerExpand | SecretUse::NodeExpand => BTreeMap::new(),
        };
        let map = match &self.profile {
            ProfileSource::Config => from_config(&self.config.secrets),
            ProfileSource::StorageClass(source) => (*source.secrets(usage).await?).clone(),
        };
        Ok(map.into_iter().collect())
    }

    /// DeleteVolume's secrets for a volume: from the Secret recorded at its Create when
    /// there is a record, else as for a new volume.
    pub(crate) async fn deletion_secrets(
        &self,
        deletion: Option<&DeletionPolicy>,
    ) -> Result<HashMap<String, String>, BridgeError> {
        match (&self.profile, deletion) {
            (ProfileSource::StorageClass(source), Some(policy)) => match &policy.secret {
                Some(reference) => Ok((*source.secret_data(reference).await?)
                    .clone()
                    .into_iter()
                    .collect()),
                None => Ok(HashMap::new()),
            },
            _ => self.secrets(SecretUse::Provisioner).await,
        }
    }
}

/// Chooses the profile source for a config (no API contact yet).
pub(crate) fn profile_source(
    config: &Config,
    kube: Option<&Arc<crate::k8s::Kube>>,
) -> ProfileSource {
    match (&config.kubernetes.storage_class, kube) {
        (Some(class), Some(kube)) => ProfileSource::StorageClass(StorageClassSource::new(
            kube.clone(),
            class,
            std::time::Duration::from_secs(config.kubernetes.cache_secs),
        )),
        _ => ProfileSource::Config,
    }
}

/// The VolumeCapability every call for a volume sends.
pub(crate) fn volume_capability(
    access_mode: AccessMode,
    fs_type: &str,
    mount_flags: &[String],
) -> csi::VolumeCapability {
    use csi::volume_capability::access_mode::Mode;
    let mode = match access_mode {
        AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
        AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
        AccessMode::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
        AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
        AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
        AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
    };
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(csi::volume_capability::AccessType::Mount(
            csi::volume_capability::MountVolume {
                fs_type: fs_type.to_string(),
                mount_flags: mount_flags.to_vec(),
                volume_mount_group: String::new(),
            },
        )),
    }
}
