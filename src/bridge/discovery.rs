//! What the core learns about its CSI driver, once, and forgets when a call suggests the
//! driver restarted: its identity and controller capabilities behind the controller
//! endpoint, its node capabilities and its node id. Both sides of a process share one.

use std::sync::Arc;

use super::ports::{
    ControllerCaps, ControllerDriver, DriverError, DriverIdentity, Finality, NodeCaps, NodeDriver,
    Segments,
};
use super::{BridgeError, Deadline};

/// How long NodeGetInfo may take when it only checks `csi.node_id`.
const NODE_ID_CHECK_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);
/// How long after a NodeGetInfo that failed for the moment it is asked again (each time
/// at the cost of a first Attach's wait).
const NODE_ID_CHECK_RETRY: std::time::Duration = std::time::Duration::from_secs(60);

/// What has been learned about the driver.
#[derive(Debug, Default)]
struct Discovered {
    node_caps: Option<NodeCaps>,
    controller: Option<(DriverIdentity, Option<ControllerCaps>)>,
    node_id: Option<String>,
    /// The driver's NodeGetInfo agreed with `node_id_override`, or finally could not
    /// answer.
    override_agreed: bool,
    /// Not before then is a NodeGetInfo that failed for the moment asked again.
    override_retry_at: Option<std::time::Instant>,
    /// NodeGetInfo's accessible_topology.
    node_topology: Option<Segments>,
}

/// The driver's endpoints and what they said about themselves.
pub struct DriverView {
    controller: Arc<dyn ControllerDriver>,
    node: Arc<dyn NodeDriver>,
    /// The node id ControllerPublish uses instead of NodeGetInfo's.
    node_id_override: Option<String>,
    /// Controller calls go to an endpoint of their own.
    separate_controller_endpoint: bool,
    discovered: tokio::sync::Mutex<Discovered>,
}

impl std::fmt::Debug for DriverView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverView")
            .field("controller_csi", &self.controller.endpoint())
            .field("node_csi", &self.node.endpoint())
            .finish_non_exhaustive()
    }
}

impl DriverView {
    pub fn new(
        controller: Arc<dyn ControllerDriver>,
        node: Arc<dyn NodeDriver>,
        node_id_override: Option<String>,
        separate_controller_endpoint: bool,
    ) -> Self {
        Self {
            controller,
            node,
            node_id_override,
            separate_controller_endpoint,
            discovered: Default::default(),
        }
    }

    /// Where controller calls go.
    pub fn controller(&self) -> &Arc<dyn ControllerDriver> {
        &self.controller
    }

    /// The driver's node endpoint.
    pub fn node(&self) -> &Arc<dyn NodeDriver> {
        &self.node
    }

    /// Forgets cached capabilities after an error that may mean the driver restarted.
    pub async fn note_driver_error(&self, error: &DriverError) {
        if error.is_uncertain() {
            *self.discovered.lock().await = Discovered::default();
        }
    }

    /// A driver call's result, noting errors that may mean the driver restarted.
    pub async fn driver<T>(&self, reply: Result<T, DriverError>) -> Result<T, BridgeError> {
        match reply {
            Ok(value) => Ok(value),
            Err(e) => {
                self.note_driver_error(&e).await;
                Err(e.into())
            }
        }
    }

    /// The driver identity and controller capabilities behind the controller endpoint.
    pub async fn controller_view(
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

    /// The driver's name, if it has already been learned.
    pub async fn known_name(&self) -> Option<String> {
        self.discovered
            .lock()
            .await
            .controller
            .as_ref()
            .map(|(identity, _)| identity.name.clone())
    }

    fn explain_controller_error(&self, e: DriverError) -> BridgeError {
        if e.finality == Finality::Unimplemented && !self.separate_controller_endpoint {
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

    pub async fn node_caps(&self, deadline: &Deadline) -> Result<NodeCaps, BridgeError> {
        if let Some(caps) = self.discovered.lock().await.node_caps {
            return Ok(caps);
        }
        let caps = self.driver(self.node.capabilities(deadline).await).await?;
        self.discovered.lock().await.node_caps = Some(caps);
        Ok(caps)
    }

    pub async fn node_id(&self, deadline: &Deadline) -> Result<String, BridgeError> {
        if let Some(id) = &self.node_id_override {
            return self.checked_override(id, deadline).await;
        }
        if let Some(id) = &self.discovered.lock().await.node_id {
            return Ok(id.clone());
        }
        let id = self.driver(self.node.node_id(deadline).await).await?;
        self.discovered.lock().await.node_id = Some(id.clone());
        Ok(id)
    }

    /// `csi.node_id`, once the driver's NodeGetInfo does not contradict it: a config
    /// copied to every node with one node's id would have ControllerPublish attach the
    /// volume to that node, and a rollback's ControllerUnpublish detach it from under the
    /// sandbox there. A driver that cannot answer NodeGetInfo (the reason to set it)
    /// leaves it unchecked.
    async fn checked_override(&self, id: &str, deadline: &Deadline) -> Result<String, BridgeError> {
        {
            let discovered = self.discovered.lock().await;
            let waiting = discovered
                .override_retry_at
                .is_some_and(|at| std::time::Instant::now() < at);
            if discovered.override_agreed || waiting {
                return Ok(id.to_string());
            }
        }
        // Briefly: a driver whose NodeGetInfo hangs must not spend the Attach's budget.
        let brief = Deadline::after(deadline.remaining().min(NODE_ID_CHECK_BUDGET));
        match self.node.node_id(&brief).await {
            Ok(said) if said != id => Err(BridgeError::Precondition(format!(
                "csi.node_id is {id:?}, but the driver at {} says this node is {said:?} \
                 (NodeGetInfo): ControllerPublishVolume for {id:?} would attach volumes to \
                 another node. Remove csi.node_id (NodeGetInfo's id is used then) or set it \
                 to this node's",
                self.node.endpoint()
            ))),
            Ok(_) => {
                self.discovered.lock().await.override_agreed = true;
                Ok(id.to_string())
            }
            Err(error) => {
                // A final answer (UNIMPLEMENTED, a driver that cannot say) is not asked
                // again until the driver restarts (what it learned is forgotten then); a
                // timeout or an unavailable driver is, a minute later at the earliest.
                tracing::warn!(%error, node_id = id, "NodeGetInfo failed: csi.node_id is used unchecked");
                let mut discovered = self.discovered.lock().await;
                if error.is_uncertain() {
                    discovered.override_retry_at =
                        Some(std::time::Instant::now() + NODE_ID_CHECK_RETRY);
                } else {
                    discovered.override_agreed = true;
                }
                Ok(id.to_string())
            }
        }
    }

    /// Where this node sits: NodeGetInfo's accessible_topology (empty when the driver
    /// says nothing), asked once.
    pub async fn node_topology(&self, deadline: &Deadline) -> Result<Segments, BridgeError> {
        if let Some(topology) = &self.discovered.lock().await.node_topology {
            return Ok(topology.clone());
        }
        let info = self.driver(self.node.node_info(deadline).await).await?;
        let mut discovered = self.discovered.lock().await;
        discovered.node_topology = Some(info.accessible_topology.clone());
        discovered.node_id.get_or_insert(info.node_id);
        Ok(info.accessible_topology)
    }
}
