//! The composition root: wires the real adapters to the core — CSI over gRPC, the mount
//! view, and the controller store and volume settings the config chooses.

use std::sync::Arc;

use crate::bridge::ports::{ControllerDriver, MountCheck, NodeDriver, VolumeSettings};
use crate::bridge::profile::ConfigSettings;
use crate::bridge::{Bridge, BridgeError, Ports};
use crate::config::{Config, ControllerStoreKind, Roles};
use crate::csi::{CsiClient, GrpcDriver};
use crate::k8s::record_key::SecretKeySource;
use crate::k8s::{CubeVolumeStore, Kube, StorageClassSource};
use crate::store::{ControllerStore, EmbeddedStore};

/// A bridge for `roles` over the driver, stores and settings `config` names, checking
/// mounts through `mounts` (the edge picks the view: a forked hook already lives in
/// Cubelet's mount namespace, the daemon does not).
pub fn open_bridge(
    config: Arc<Config>,
    roles: Roles,
    mounts: Arc<dyn MountCheck>,
) -> Result<Bridge, BridgeError> {
    let node_driver = Arc::new(GrpcDriver::new(CsiClient::new(&config.csi.endpoint)));
    let controller: Arc<dyn ControllerDriver> = match &config.csi.controller_endpoint {
        Some(endpoint) => Arc::new(GrpcDriver::new(CsiClient::new(endpoint))),
        None => node_driver.clone(),
    };
    let node: Arc<dyn NodeDriver> = node_driver;
    let kube = config
        .uses_kubernetes()
        .then(|| Arc::new(Kube::new(&config.kubernetes)));
    let store = if roles.controller {
        Some(controller_store(&config, kube.as_ref())?)
    } else {
        None
    };
    let settings: Arc<dyn VolumeSettings> = match (&config.kubernetes.storage_class, &kube) {
        (Some(class), Some(kube)) => Arc::new(StorageClassSource::new(
            kube.clone(),
            class,
            std::time::Duration::from_secs(config.kubernetes.cache_secs),
            config.volume.access_mode,
        )),
        _ => Arc::new(ConfigSettings::new(&config.volume, &config.secrets)),
    };
    let bridge = Bridge::new(
        config.clone(),
        roles,
        Ports {
            controller,
            node,
            store,
            settings,
            mounts,
        },
    )?;
    // Replicas on other hosts verify each other's CubeVolumes: the key is a Secret.
    Ok(
        match (roles.controller, config.state.controller_store, &kube) {
            (true, ControllerStoreKind::Kubernetes, Some(kube)) => {
                bridge.with_record_key_source(Arc::new(SecretKeySource::new(
                    kube.clone(),
                    &config.record_key_secret(),
                )))
            }
            _ => bridge,
        },
    )
}

/// The controller store backend the config names.
pub fn controller_store(
    config: &Config,
    kube: Option<&Arc<Kube>>,
) -> Result<Arc<dyn ControllerStore>, BridgeError> {
    Ok(match (config.state.controller_store, kube) {
        (ControllerStoreKind::Kubernetes, Some(kube)) => {
            Arc::new(CubeVolumeStore::new(kube.clone(), &config.driver))
        }
        (ControllerStoreKind::Kubernetes, None) => {
            unreachable!("a Kubernetes store makes the config use Kubernetes")
        }
        (ControllerStoreKind::Embedded, _) => {
            Arc::new(Arc::new(EmbeddedStore::open(&config.state.store_path())?))
        }
    })
}
