//! The translation core: Cube's four hooks in terms of CSI calls, with per-volume locks,
//! holders per namespace, rollback of a hook's own failed work, and reconciliation.
//!
//! It speaks in its own types (types.rs) and reaches the outside only through its ports
//! (ports.rs): a CSI driver, a mount table, the volume settings, and the stores. `cube/`
//! translates the wire at the north edge; `csi/`, `mount/` and `k8s/` implement the ports;
//! `app.rs` wires real adapters to a `Bridge`; tests wire in-memory ones.

pub mod caller;
pub mod controller;
mod deadline;
pub mod error;
pub mod faults;
pub mod handoff;
pub mod integrity;
pub mod inventory;
pub mod locks;
pub mod naming;
pub mod node;
pub mod ports;
pub mod profile;
pub mod reconcile;
#[cfg(test)]
mod tests;
pub mod types;

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tracing::Instrument;

pub use caller::Caller;
pub use deadline::Deadline;
pub use error::{BridgeError, HookError, HookKind};
pub use types::*;

use crate::config::{Config, ControllerStoreKind, Roles};
use crate::store::{ControllerStore, NodeJournal};
use locks::VolumeLocks;
use ports::{
    ControllerCaps, ControllerDriver, DriverError, DriverIdentity, Finality, MountCheck, NodeCaps,
    NodeDriver, VolumeSettings,
};

/// What has been learned about the driver; cleared when a call suggests it restarted.
#[derive(Debug, Default)]
struct Discovered {
    node_caps: Option<NodeCaps>,
    controller: Option<(DriverIdentity, Option<ControllerCaps>)>,
    node_id: Option<String>,
}

/// The adapters a bridge works through.
pub struct Ports {
    /// Where controller calls go (`csi.controller_endpoint`, else `csi.endpoint`).
    pub controller: Arc<dyn ControllerDriver>,
    /// The driver's node endpoint (`csi.endpoint`).
    pub node: Arc<dyn NodeDriver>,
    /// Required for the controller role.
    pub store: Option<Arc<dyn ControllerStore>>,
    pub settings: Arc<dyn VolumeSettings>,
    /// Where Cubelet looks for mounts.
    pub mounts: Arc<dyn MountCheck>,
}

/// One bridge instance: one Cube driver name over one CSI driver.
pub struct Bridge {
    config: Arc<Config>,
    roles: Roles,
    controller: Arc<dyn ControllerDriver>,
    node: Arc<dyn NodeDriver>,
    store: Option<Arc<dyn ControllerStore>>,
    journal: Option<NodeJournal>,
    settings: Arc<dyn VolumeSettings>,
    mounts: Arc<dyn MountCheck>,
    locks: VolumeLocks,
    discovered: tokio::sync::Mutex<Discovered>,
    /// This boot, recorded in node journal records.
    boot_id: String,
    /// Where the key controller records are signed with is kept (controller role).
    record_key_source: Option<Arc<dyn integrity::RecordKeySource>>,
    /// That key, once loaded.
    record_key: tokio::sync::OnceCell<integrity::RecordKey>,
    /// This process made the key and has not yet signed the records from before keys.
    unsigned_records_pending: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge")
            .field("driver", &self.config.driver)
            .field("roles", &self.roles)
            .field("node_csi", &self.node.endpoint())
            .field("controller_csi", &self.controller.endpoint())
            .finish_non_exhaustive()
    }
}

impl Bridge {
    /// Opens the state `roles` need (node journal, lock directory). Does not contact the
    /// driver.
    pub fn new(config: Arc<Config>, roles: Roles, ports: Ports) -> Result<Self, BridgeError> {
        if roles.controller && ports.store.is_none() {
            return Err(BridgeError::Precondition(
                "the controller role needs a controller store".into(),
            ));
        }
        let journal = if roles.node {
            let dir = config.state.journal_dir();
            Some(
                NodeJournal::open(&dir)
                    .map_err(|e| BridgeError::io(format!("node journal {}", dir.display()), e))?,
            )
        } else {
            None
        };
        let lock_dir = &config.state.lock_dir;
        let locks = VolumeLocks::new(lock_dir)
            .map_err(|e| BridgeError::io(format!("lock dir {}", lock_dir.display()), e))?;
        // The embedded store's key sits beside it; a shared store's key comes from where
        // every replica can read it (`with_record_key_source`).
        let record_key_source = (roles.controller
            && config.state.controller_store == ControllerStoreKind::Embedded)
            .then(|| {
                Arc::new(integrity::FileKeySource::new(
                    &config.state.dir.join("record.key"),
                )) as Arc<dyn integrity::RecordKeySource>
            });
        Ok(Self {
            roles,
            controller: ports.controller,
            node: ports.node,
            store: ports.store,
            journal,
            settings: ports.settings,
            mounts: ports.mounts,
            locks,
            discovered: Default::default(),
            boot_id: crate::store::journal::boot_id(),
            record_key_source,
            record_key: tokio::sync::OnceCell::new(),
            unsigned_records_pending: Default::default(),
            config,
        })
    }

    /// Signs controller records with the key `source` keeps (instead of the embedded
    /// store's key file).
    pub fn with_record_key_source(mut self, source: Arc<dyn integrity::RecordKeySource>) -> Self {
        self.record_key_source = Some(source);
        self
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn roles(&self) -> Roles {
        self.roles
    }

    /// The one place every hook starts and ends: a span, timing, the outcome log and the
    /// metrics.
    async fn hook<T>(
        &self,
        hook: HookKind,
        volume_id: &str,
        work: impl Future<Output = Result<T, BridgeError>>,
    ) -> Result<T, HookError> {
        self.hook_if(hook, volume_id, async { work.await.map(Some) })
            .await
            .expect("work that never declines always answers")
    }

    /// Like `hook`, for work that may decline (`Ok(None)`: it is not for this process to
    /// do); a declined hook is neither logged nor counted.
    async fn hook_if<T>(
        &self,
        hook: HookKind,
        volume_id: &str,
        work: impl Future<Output = Result<Option<T>, BridgeError>>,
    ) -> Option<Result<T, HookError>> {
        let span = tracing::info_span!("hook", op = hook.as_str(), volume_id);
        async move {
            let started = Instant::now();
            tracing::debug!("hook started");
            let result = match work.await {
                Ok(None) => return None,
                Ok(Some(answer)) => Ok(answer),
                Err(error) => Err(error),
            };
            let elapsed = started.elapsed();
            let elapsed_ms = elapsed.as_secs_f64() * 1e3;
            match &result {
                Ok(_) => tracing::info!(elapsed_ms, "hook succeeded"),
                Err(error) => tracing::error!(elapsed_ms, %error, "hook failed"),
            }
            let outcome = result
                .as_ref()
                .map_or_else(BridgeError::kind, |_| "success");
            crate::metrics::hook(hook.as_str(), outcome, elapsed);
            Some(result.map_err(|error| HookError {
                hook,
                volume_id: volume_id.to_string(),
                error,
            }))
        }
        .instrument(span)
        .await
    }

    /// Forgets cached capabilities after an error that may mean the driver restarted.
    async fn note_driver_error(&self, error: &DriverError) {
        if error.is_uncertain() {
            *self.discovered.lock().await = Discovered::default();
        }
    }

    /// A driver call's result, noting errors that may mean the driver restarted.
    async fn driver<T>(&self, reply: Result<T, DriverError>) -> Result<T, BridgeError> {
        match reply {
            Ok(value) => Ok(value),
            Err(e) => {
                self.note_driver_error(&e).await;
                Err(e.into())
            }
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
            let identity = self.controller.identity(deadline).await?;
            let caps = if identity.controller_service {
                Some(self.controller.capabilities(deadline).await?)
            } else {
                None
            };
            Ok::<_, DriverError>((identity, caps))
        }
        .await;
        match result {
            Ok(found) => {
                self.discovered.lock().await.controller = Some(found.clone());
                Ok(found)
            }
            Err(e) => {
                self.note_driver_error(&e).await;
                Err(self.explain_controller_error(e))
            }
        }
    }

    fn explain_controller_error(&self, e: DriverError) -> BridgeError {
        if e.finality == Finality::Unimplemented && self.config.csi.controller_endpoint.is_none() {
            BridgeError::Precondition(format!(
                "the driver at {} advertises a controller service but does not serve {} \
                 there; point csi.controller_endpoint at the driver's controller",
                self.controller.endpoint(),
                e.call
            ))
        } else {
            BridgeError::Driver(Box::new(e))
        }
    }

    async fn node_caps(&self, deadline: &Deadline) -> Result<NodeCaps, BridgeError> {
        if let Some(caps) = self.discovered.lock().await.node_caps {
            return Ok(caps);
        }
        let caps = self.driver(self.node.capabilities(deadline).await).await?;
        self.discovered.lock().await.node_caps = Some(caps);
        Ok(caps)
    }

    async fn node_id(&self, deadline: &Deadline) -> Result<String, BridgeError> {
        if let Some(id) = &self.config.csi.node_id {
            return Ok(id.clone());
        }
        if let Some(id) = &self.discovered.lock().await.node_id {
            return Ok(id.clone());
        }
        let id = self.driver(self.node.node_id(deadline).await).await?;
        self.discovered.lock().await.node_id = Some(id.clone());
        Ok(id)
    }

    /// Checks, before serving, that the driver can do what the served roles need.
    /// An unreachable driver is only a warning (it may start later; calls connect
    /// lazily); a driver that answers but cannot serve Cube is an error.
    pub async fn check_driver(&self, deadline: &Deadline) -> Result<(), BridgeError> {
        let unreachable = |e: &BridgeError| e.is_uncertain_driver_error();
        if self.roles.controller {
            match self.controller_view(deadline).await {
                Ok((identity, caps)) => {
                    tracing::info!(
                        driver = %identity.name,
                        version = %identity.vendor_version,
                        endpoint = self.controller.endpoint(),
                        "controller side: CSI driver found"
                    );
                    controller::require_create_delete(&identity, caps.as_ref())?;
                }
                Err(e) if unreachable(&e) => {
                    tracing::warn!(error = %e, "controller side: CSI driver not reachable yet; will connect on first use");
                }
                Err(e) => return Err(e),
            }
        }
        if self.roles.node {
            match self.node_plan(false, deadline).await {
                Ok(plan) => tracing::info!(
                    endpoint = self.node.endpoint(),
                    stage_unstage = plan.stage,
                    controller_publish = plan.controller_publish_node.is_some(),
                    "node side: CSI driver found"
                ),
                Err(e) if unreachable(&e) => {
                    tracing::warn!(error = %e, "node side: CSI driver not reachable yet; will connect on first use");
                }
                Err(e) => return Err(e),
            }
        }
        // Last, so that the driver's name (for a StorageClass's provisioner) is known.
        self.check_settings_and_store().await
    }

    /// Checks the settings source and, for the Kubernetes store, that CubeVolumes can be
    /// listed. An unreachable API server is only a warning, like an unreachable driver.
    async fn check_settings_and_store(&self) -> Result<(), BridgeError> {
        let known = self
            .discovered
            .lock()
            .await
            .controller
            .as_ref()
            .map(|(identity, _)| identity.name.clone());
        let outcome = async {
            if let Some(line) = self.settings.check(known.as_deref()).await? {
                tracing::info!("{line}");
            }
            if self.config.state.controller_store == ControllerStoreKind::Kubernetes
                && let Some(store) = &self.store
            {
                let count = store.list().await?.len();
                tracing::info!(volumes = count, store = %store.describe(), "controller store reachable");
            }
            if self.roles.controller {
                // Made (and records from before keys existed signed) before the first hook.
                self.record_key().await?;
            }
            Ok::<_, BridgeError>(())
        }
        .await;
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
}

/// Runs blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BridgeError> + Send + 'static,
) -> Result<T, BridgeError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}
