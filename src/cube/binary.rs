//! The binary hook: one hook per process, as Cubelet and CubeMaster fork it. stdout gets
//! exactly one JSON object; logs go to stderr; the exit code is 0 only on success.

use std::sync::Arc;

use serde_json::json;

use super::errors;
pub use super::hooks::HookRequest;
use super::hooks::{self, HookReply};
use crate::bridge::reconcile::Scope;
use crate::bridge::{Caller, HookError};
use crate::config::{Config, Roles};
use crate::mount::MountView;

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
    // Checked before the bridge opens its state: a bad request leaves no trace.
    let checked = match hooks::check(request, &config) {
        Ok(checked) => checked,
        Err(error) => return answered(failure(&error)),
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
    answered(match hooks::run(&bridge, checked, caller).await {
        Ok(reply) => HookOutput {
            stdout: reply_json(reply).to_string(),
            success: true,
        },
        Err(error) => failure(&error),
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

fn failure(error: &HookError) -> HookOutput {
    HookOutput {
        stdout: errors::to_json(error),
        success: false,
    }
}

/// The JSON object Cube reads from a successful hook's stdout.
fn reply_json(reply: HookReply) -> serde_json::Value {
    match reply {
        HookReply::Create(r) => json!({ "token": r.token, "private_data": r.private_data }),
        HookReply::Attach(r) => json!({ "host_path": r.host_path, "metadata": r.metadata }),
        HookReply::Destroy(_) | HookReply::Detach(_) => json!({}),
    }
}
