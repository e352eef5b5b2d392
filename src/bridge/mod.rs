//! The translation core: Cube's four hooks in terms of CSI calls, with per-volume locks,
//! holders per namespace, rollback of a hook's own failed work, and reconciliation.
//!
//! It speaks in its own types (types.rs, records.rs) and reaches the outside only through
//! its ports (ports.rs): a CSI driver, a mount table, the volume settings, the stores, the
//! locks, the host's directories, the clock and a metrics recorder. It has two sides, each
//! built complete by the composition root (`app.rs`) or by a test: the controller side
//! (Create, Destroy; controller.rs) and the node side (Attach, Detach; node.rs). `cube/`
//! translates the wire at the north edge; `csi/`, `mount/`, `store/`, `k8s/` and
//! `metrics` implement the ports.

pub mod caller;
pub mod controller;
mod deadline;
pub mod discovery;
pub mod error;
pub mod expansion;
pub mod faults;
pub mod fit;
pub mod handoff;
pub mod integrity;
pub mod inventory;
pub mod naming;
pub mod node;
pub mod ports;
pub mod reconcile;
pub mod records;
pub mod staleness;
#[cfg(test)]
mod tests;
pub mod types;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

pub use caller::{Answer, Caller, Delivery, LeaveOnDrop};
pub use controller::{ControllerPorts, ControllerSide};
pub use deadline::Deadline;
pub use error::{BridgeError, HookError, HookKind};
pub use node::{NodePorts, NodeSide, Release, Released};
pub use types::*;

use ports::Recorder;

/// How long each hook may take (`[timeouts]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    pub create: Duration,
    pub destroy: Duration,
    pub attach: Duration,
    pub detach: Duration,
    /// Undoing a failed hook's own work, after its budget ran out.
    pub rollback: Duration,
}

/// What the core needs of the configuration; `app.rs` takes it from the config file.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The Cube driver name: the host_path prefix, the key records are signed for.
    pub driver: String,
    pub timeouts: Timeouts,
    /// Prefix of the CSI volume name; the rest is the Cube volume_id.
    pub name_prefix: String,
    /// CreateVolume capacity_range.required_bytes; 0 leaves it unset.
    pub capacity_bytes: u64,
    /// Where volumes go when an Attach names no base dir.
    pub default_base_dir: PathBuf,
    /// The node id ControllerPublish uses instead of NodeGetInfo's.
    pub node_id: Option<String>,
    /// Controller calls go to an endpoint of their own (`csi.controller_endpoint`).
    pub separate_controller_endpoint: bool,
    /// Cube volume ids whose records carry no MAC and are to be signed: the operator
    /// checked them (`controller.sign_unsigned_records`).
    pub sign_unsigned_records: Vec<String>,
    /// The controller store is shared with other replicas (listed at start to check it).
    pub shared_store: bool,
    /// Holders whose namespace has made no hook for this long are reported stale (the
    /// inventory's metric); `None`: never.
    pub stale_holder_after: Option<Duration>,
    /// CreateVolume's accessibility_requirements (`volume.accessibility_requirements`).
    pub accessibility: Option<ports::TopologyRequirement>,
    /// NodeStage's and NodePublish's volume_mount_group (`volume.mount_group`).
    pub mount_group: Option<u32>,
}

/// The sides one process serves. A side this process does not serve, or one that could
/// not open, answers with that reason; the other side serves regardless.
#[derive(Debug, Clone)]
pub struct Bridge {
    pub controller: Result<Arc<ControllerSide>, Unserved>,
    pub node: Result<Arc<NodeSide>, Unserved>,
}

/// Why a side does not serve in this process.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct Unserved(pub String);

impl Unserved {
    /// The side is not among the roles this process serves.
    pub fn not_a_role(side: &str) -> Self {
        Unserved(format!("this instance does not serve the {side} role"))
    }
}

impl Bridge {
    /// The sides among `roles` that could not open, as (role, reason): "controller" first.
    pub fn down_roles(&self, roles: Roles) -> Vec<(&'static str, String)> {
        let mut down = Vec::new();
        if let (true, Err(why)) = (roles.controller, &self.controller) {
            down.push(("controller", why.0.clone()));
        }
        if let (true, Err(why)) = (roles.node, &self.node) {
            down.push(("node", why.0.clone()));
        }
        down
    }

    /// The controller side, or why there is none here.
    pub fn controller(&self) -> Result<&Arc<ControllerSide>, BridgeError> {
        self.controller
            .as_ref()
            .map_err(|why| BridgeError::Unavailable(why.0.clone()))
    }

    /// The node side, or why there is none here.
    pub fn node(&self) -> Result<&Arc<NodeSide>, BridgeError> {
        self.node
            .as_ref()
            .map_err(|why| BridgeError::Unavailable(why.0.clone()))
    }

    /// Checks, before serving, that the driver can do what each side here needs (see
    /// `ControllerSide::check`, `NodeSide::check`).
    pub async fn check(&self, deadline: &Deadline) -> Result<(), BridgeError> {
        if let Ok(controller) = &self.controller {
            controller.check(deadline).await?;
        }
        if let Ok(node) = &self.node {
            node.check(deadline).await?;
        }
        Ok(())
    }

    pub async fn create(&self, req: CreateVolume, caller: &Caller) -> Result<Created, HookError> {
        let side = self.side(HookKind::Create, &req.volume_id, self.controller())?;
        side.create(req, caller).await
    }

    pub async fn destroy(&self, req: DestroyVolume, caller: &Caller) -> Result<(), HookError> {
        let side = self.side(HookKind::Destroy, &req.volume_id, self.controller())?;
        side.destroy(req, caller).await
    }

    pub async fn attach(&self, req: AttachVolume, caller: &Caller) -> Result<Attached, HookError> {
        let side = self.side(HookKind::Attach, &req.volume_id, self.node())?;
        side.attach(req, caller).await
    }

    pub async fn detach(&self, req: DetachVolume, caller: &Caller) -> Result<(), HookError> {
        let side = self.side(HookKind::Detach, &req.volume_id, self.node())?;
        side.detach(req, caller).await
    }

    /// A hot Attach (see `NodeSide::attach_if_hot`); `None` when it is not one, or when
    /// there is no node side to answer it.
    pub async fn attach_if_hot(&self, req: &AttachVolume) -> Option<Result<Attached, HookError>> {
        self.node().ok()?.attach_if_hot(req, None).await
    }

    /// `attach_if_hot`, leaving the volume's lock in `kept` while it awaits: a check
    /// dropped there (its caller cancelled) leaves the lock for `attach_holding`.
    pub async fn attach_if_hot_keeping(
        &self,
        req: &AttachVolume,
        kept: &ports::KeptLock,
    ) -> Option<Result<Attached, HookError>> {
        self.node().ok()?.attach_if_hot(req, Some(kept)).await
    }

    /// Cube Attach under the volume's lock `guard` holds (see `NodeSide::attach_holding`).
    pub async fn attach_holding(
        &self,
        req: AttachVolume,
        caller: &Caller,
        guard: ports::LockGuard,
    ) -> Result<Attached, HookError> {
        let side = self.side(HookKind::Attach, &req.volume_id, self.node())?;
        side.attach_holding(req, caller, guard).await
    }

    /// A hot Detach (see `NodeSide::detach_if_hot`); `None` otherwise.
    pub async fn detach_if_hot(&self, req: &DetachVolume) -> Option<Result<(), HookError>> {
        self.node().ok()?.detach_if_hot(req).await
    }

    fn side<'a, S>(
        &self,
        hook: HookKind,
        volume_id: &str,
        side: Result<&'a Arc<S>, BridgeError>,
    ) -> Result<&'a Arc<S>, HookError> {
        side.map_err(|error| HookError {
            hook,
            volume_id: volume_id.to_string(),
            error,
        })
    }
}

/// The one place every hook starts and ends: a span, timing, the outcome log and the
/// recorder.
async fn hook<T>(
    recorder: &dyn Recorder,
    hook: HookKind,
    volume_id: &str,
    work: impl Future<Output = Result<T, BridgeError>>,
) -> Result<T, HookError> {
    hook_if(recorder, hook, volume_id, async { work.await.map(Some) })
        .await
        .expect("work that never declines always answers")
}

/// Like `hook`, for work that may decline (`Ok(None)`: it is not for this process to
/// do); a declined hook is neither logged nor counted.
async fn hook_if<T>(
    recorder: &dyn Recorder,
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
        recorder.hook(hook.as_str(), outcome, elapsed);
        Some(result.map_err(|error| HookError {
            hook,
            volume_id: volume_id.to_string(),
            error,
        }))
    }
    .instrument(span)
    .await
}

/// Runs blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BridgeError> + Send + 'static,
) -> Result<T, BridgeError> {
    crate::blocking::on_blocking_thread(f).await
}
