//! The binary hook: one hook per process, as Cubelet and CubeMaster fork it. stdout gets
//! exactly one JSON object; logs go to stderr; the exit code is 0 only on success.

use std::sync::Arc;

use serde_json::json;

use super::{errors, hooks};
use crate::bridge::reconcile::Scope;
use crate::bridge::{Caller, HookError, HookKind};
use crate::config::{Config, Roles};
use crate::mount::MountView;
use crate::proto::cube::v1 as pb;

/// One forked hook's request, already parsed from argv.
#[derive(Debug, Clone)]
pub enum HookRequest {
    Create(pb::CreateRequest),
    Destroy(pb::DestroyRequest),
    Attach(pb::AttachRequest),
    Detach(pb::DetachRequest),
}

impl HookRequest {
    pub fn kind(&self) -> HookKind {
        match self {
            HookRequest::Create(_) => HookKind::Create,
            HookRequest::Destroy(_) => HookKind::Destroy,
            HookRequest::Attach(_) => HookKind::Attach,
            HookRequest::Detach(_) => HookKind::Detach,
        }
    }
}

/// The outcome of a forked hook: what to print on stdout, and whether it succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookOutput {
    pub stdout: String,
    pub success: bool,
}

impl HookOutput {
    pub fn failure(message: &str) -> Self {
        Self {
            stdout: errors::message_json(message),
            success: false,
        }
    }
}

/// Runs one hook with a bridge opened for just that hook's role. `answered` receives the
/// output as soon as it is known; what follows (finishing node operations that an earlier,
/// killed hook abandoned) no longer concerns the caller.
pub async fn run(
    config: Config,
    request: HookRequest,
    caller: &Caller,
    answered: impl FnOnce(HookOutput),
) {
    let kind = request.kind();
    let roles = if kind.is_node() {
        Roles::NODE
    } else {
        Roles::CONTROLLER
    };
    // Cubelet forks the hook inside its own mount namespace.
    let mounts = Arc::new(MountView::new(&config.node.mount_view, true));
    let bridge = match crate::app::open_bridge(Arc::new(config), roles, mounts) {
        Ok(b) => b,
        Err(error) => {
            answered(HookOutput::failure(&format!(
                "{kind}: cannot open the bridge's state: {error}"
            )));
            return;
        }
    };
    let result: Result<serde_json::Value, HookError> = match request {
        HookRequest::Create(req) => hooks::create(&bridge, req, caller)
            .await
            .map(|r| json!({ "token": r.token, "private_data": r.private_data })),
        HookRequest::Destroy(req) => hooks::destroy(&bridge, req).await.map(|_| json!({})),
        HookRequest::Attach(req) => hooks::attach(&bridge, req, caller)
            .await
            .map(|r| json!({ "host_path": r.host_path, "metadata": r.metadata })),
        HookRequest::Detach(req) => hooks::detach(&bridge, req).await.map(|_| json!({})),
    };
    answered(match result {
        Ok(value) => HookOutput {
            stdout: value.to_string(),
            success: true,
        },
        Err(error) => HookOutput {
            stdout: errors::to_json(&error),
            success: false,
        },
    });
    if roles.node {
        match bridge.reconcile_node(Scope::Abandoned).await {
            Ok(report) if !report.is_empty() => {
                tracing::info!(
                    ?report,
                    "finished node operations an earlier hook abandoned"
                )
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "scanning for abandoned node operations failed"),
        }
    }
}
