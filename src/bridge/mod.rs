//! The translation core: Cube's four hooks in terms of CSI calls, with per-volume locks,
//! rollback of failed work, and reconciliation at start-up.
//!
//! It speaks in its own request types (types.rs); `cube/` translates the wire at the
//! north edge and `csi/` at the south edge.

pub mod controller;
pub mod error;
pub mod handoff;
pub mod locks;
pub mod naming;
pub mod node;
pub mod profile;
pub mod reconcile;
pub mod types;

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tracing::Instrument;

pub use error::{BridgeError, HookError, HookKind};
pub use types::*;

use crate::config::{Config, ControllerStoreKind};
use crate::csi::{self, ControllerCaps, CsiClient, Deadline, DriverIdentity, NodeCaps};
use crate::k8s::Kube;
use crate::mount::MountView;
use crate::store::{ControllerStore, NodeJournal};
use locks::VolumeLocks;
use profile::ProfileSource;

/// Which Cube services this bridge instance answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    pub controller: bool,
    pub node: bool,
}

/// How the process was started: long-running, or forked by Cube for one hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessMode {
    Daemon,
    ForkedHook,
}

/// What has been learned about the driver; cleared when a call suggests it restarted.
#[derive(Debug, Default)]
struct Discovered {
    node_caps: Option<NodeCaps>,
    controller: Option<(DriverIdentity, Option<ControllerCaps>)>,
    node_id: Option<String>,
}

/// One bridge instance: one Cube driver name over one CSI driver.
pub struct Bridge {
    config: Arc<Config>,
    /// The driver's node endpoint (`csi.endpoint`).
    node_csi: CsiClient,
    /// Where controller calls go (`csi.controller_endpoint`, else `csi.endpoint`).
    controller_csi: CsiClient,
    controller_endpoint_explicit: bool,
    store: Option<ControllerStore>,
    journal: Option<NodeJournal>,
    /// Where volume parameters, capability and secrets come from.
    profile: ProfileSource,
    locks: VolumeLocks,
    mount_view: Arc<MountView>,
    discovered: tokio::sync::Mutex<Discovered>,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge")
            .field("driver", &self.config.driver)
            .field("node_csi", &self.node_csi.endpoint())
            .field("controller_csi", &self.controller_csi.endpoint())
            .finish_non_exhaustive()
    }
}

impl Bridge {
    /// Opens the state this instance's roles need. Does not contact the driver.
    pub fn new(config: Config, roles: Roles, mode: ProcessMode) -> Result<Self, BridgeError> {
        let (controller_endpoint, explicit) = config.controller_endpoint();
        let kube = config
            .uses_kubernetes()
            .then(|| Arc::new(Kube::new(&config.kubernetes)));
        let store = match (roles.controller, config.state.controller_store, &kube) {
            (false, _, _) => None,
            (true, ControllerStoreKind::Kubernetes, Some(kube)) => {
                Some(ControllerStore::Kubernetes(Arc::new(
                    crate::k8s::CubeVolumeStore::new(kube.clone(), &config.driver),
                )))
            }
            (true, _, _) => {
                let store = crate::store::EmbeddedStore::open(&config.store_path())?;
                Some(ControllerStore::Embedded(Arc::new(store)))
            }
        };
        let profile = profile::profile_source(&config, kube.as_ref());
        let journal = if roles.node {
            let dir = config.journal_dir();
            Some(
                NodeJournal::open(&dir)
                    .map_err(|e| BridgeError::io(format!("node journal {}", dir.display()), e))?,
            )
        } else {
            None
        };
        let lock_dir = config.lock_dir();
        let locks = VolumeLocks::new(&lock_dir)
            .map_err(|e| BridgeError::io(format!("lock dir {}", lock_dir.display()), e))?;
        let mount_view = Arc::new(MountView::from_setting(
            &config.node.mount_view,
            mode == ProcessMode::ForkedHook,
        ));
        Ok(Self {
            node_csi: CsiClient::new(&config.csi_endpoint()),
            controller_csi: CsiClient::new(&controller_endpoint),
            controller_endpoint_explicit: explicit,
            store,
            journal,
            profile,
            locks,
            mount_view,
            discovered: Default::default(),
            config: Arc::new(config),
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn mount_view(&self) -> &MountView {
        &self.mount_view
    }

    /// The one place every hook starts and ends: a span, timing, and the outcome log.
    async fn hook<T>(
        &self,
        hook: HookKind,
        volume_id: &str,
        work: impl Future<Output = Result<T, BridgeError>>,
    ) -> Result<T, HookError> {
        let span = tracing::info_span!("hook", op = hook.as_str(), volume_id);
        async move {
            let started = Instant::now();
            tracing::debug!("hook started");
            let result = work.await;
            let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
            match &result {
                Ok(_) => tracing::info!(elapsed_ms, "hook succeeded"),
                Err(error) => tracing::error!(elapsed_ms, %error, "hook failed"),
            }
            result.map_err(|error| HookError {
                hook,
                volume_id: volume_id.to_string(),
                error,
            })
        }
        .instrument(span)
        .await
    }

    /// Forgets cached capabilities after an error that may mean the driver restarted.
    async fn note_csi_error(&self, error: &csi::CsiError) {
        if error.is_uncertain() {
            *self.discovered.lock().await = Discovered::default();
        }
    }

    /// The driver identity and controller capabilities behind the controller endpoint.
    async fn controller_view(
        &self,
        deadline: &Deadline,
    ) -> Result<(DriverIdentity, Option<ControllerCaps>), BridgeError> {
        if let Some(found) = &self.discovered.lock().await.controller {
            return Ok(found.clone());
        }
        let result = async {
            let identity = csi::discovery::identity(&self.controller_csi, deadline).await?;
            let caps = if identity.controller_service {
                Some(csi::discovery::controller_caps(&self.controller_csi, deadline).await?)
            } else {
                None
            };
            Ok::<_, csi::CsiError>((identity, caps))
        }
        .await;
        match result {
            Ok(found) => {
                self.discovered.lock().await.controller = Some(found.clone());
                Ok(found)
            }
            Err(e) => {
                self.note_csi_error(&e).await;
                Err(self.explain_controller_error(e))
            }
        }
    }

    fn explain_controller_error(&self, e: csi::CsiError) -> BridgeError {
        if e.code == tonic::Code::Unimplemented && !self.controller_endpoint_explicit {
            BridgeError::Driver(format!(
                "the driver at {} advertises a controller service but does not serve {} \
                 there; point csi.controller_endpoint at the driver's controller",
                self.controller_csi.endpoint(),
                e.call
            ))
        } else {
            BridgeError::Csi(e)
        }
    }

    async fn node_caps(&self, deadline: &Deadline) -> Result<NodeCaps, BridgeError> {
        if let Some(caps) = self.discovered.lock().await.node_caps {
            return Ok(caps);
        }
        match csi::discovery::node_caps(&self.node_csi, deadline).await {
            Ok(caps) => {
                self.discovered.lock().await.node_caps = Some(caps);
                Ok(caps)
            }
            Err(e) => {
                self.note_csi_error(&e).await;
                Err(e.into())
            }
        }
    }

    async fn node_id(&self, deadline: &Deadline) -> Result<String, BridgeError> {
        if let Some(id) = &self.config.csi.node_id {
            return Ok(id.clone());
        }
        if let Some(id) = &self.discovered.lock().await.node_id {
            return Ok(id.clone());
        }
        match csi::discovery::node_id(&self.node_csi, deadline).await {
            Ok(id) => {
                self.discovered.lock().await.node_id = Some(id.clone());
                Ok(id)
            }
            Err(e) => {
                self.note_csi_error(&e).await;
                Err(e.into())
            }
        }
    }

    /// Checks, before serving, that the driver can do what the served roles need.
    /// An unreachable driver is only a warning (it may start later; calls connect
    /// lazily); a driver that answers but cannot serve Cube is an error.
    pub async fn check_driver(&self, roles: Roles, deadline: &Deadline) -> Result<(), BridgeError> {
        if roles.controller {
            match self.controller_view(deadline).await {
                Ok((identity, caps)) => {
                    tracing::info!(
                        driver = %identity.name,
                        version = %identity.vendor_version,
                        endpoint = self.controller_csi.endpoint(),
                        "controller side: CSI driver found"
                    );
                    controller::require_create_delete(&identity, caps.as_ref())?;
                }
                Err(BridgeError::Csi(e)) if e.is_uncertain() => {
                    tracing::warn!(error = %e, "controller side: CSI driver not reachable yet; will connect on first use");
                }
                Err(e) => return Err(e),
            }
        }
        if roles.node {
            match self.node_plan(false, deadline).await {
                Ok(plan) => tracing::info!(
                    endpoint = self.node_csi.endpoint(),
                    stage_unstage = plan.stage,
                    controller_publish = plan.controller_publish_node.is_some(),
                    "node side: CSI driver found"
                ),
                Err(BridgeError::Csi(e)) if e.is_uncertain() => {
                    tracing::warn!(error = %e, "node side: CSI driver not reachable yet; will connect on first use");
                }
                Err(e) => return Err(e),
            }
        }
        // Last, so that the driver's name (for the StorageClass's provisioner) is known.
        self.check_kubernetes(roles).await
    }
}

impl Bridge {
    /// Checks the Kubernetes side before serving: the StorageClass is readable and
    /// belongs to this driver, and the CubeVolume objects can be listed. An unreachable
    /// API server is only a warning, like an unreachable driver.
    async fn check_kubernetes(&self, roles: Roles) -> Result<(), BridgeError> {
        if !self.config.uses_kubernetes() {
            return Ok(());
        }
        let outcome = async {
            if let ProfileSource::StorageClass(source) = &self.profile {
                let class = source.class().await?;
                let known = self.discovered.lock().await.controller.clone();
                if let Some((identity, _)) = known {
                    class.check_provisioner(&identity.name)?;
                }
                tracing::info!(storage_class = source.name(), provisioner = %class.provisioner, "StorageClass found");
            }
            if roles.controller
                && let Some(store @ ControllerStore::Kubernetes(_)) = &self.store
            {
                let count = store.list().await?.len();
                tracing::info!(volumes = count, store = %store.describe(), "controller store reachable");
            }
            Ok::<_, BridgeError>(())
        }
        .await;
        match outcome {
            Err(BridgeError::Kubernetes(e))
            | Err(BridgeError::Store(crate::store::StoreError::Kubernetes(e)))
                if e.is_transient() =>
            {
                tracing::warn!(error = %e, "Kubernetes API not reachable yet; will retry on first use");
                Ok(())
            }
            other => other,
        }
    }
}

/// Runs blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BridgeError> + Send + 'static,
) -> Result<T, BridgeError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}
