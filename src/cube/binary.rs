//! The binary hook: one hook per process, as Cubelet and CubeMaster fork it. stdout gets
//! exactly one JSON object; logs go to stderr; the exit code is 0 only on success.

use serde_json::json;

use super::{errors, hooks};
use crate::bridge::{Bridge, HookError, HookKind, ProcessMode, Roles};
use crate::config::Config;
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

/// Runs one hook with a bridge opened for just that hook's role.
pub async fn run(config: Config, request: HookRequest) -> HookOutput {
    let kind = request.kind();
    let roles = Roles {
        controller: matches!(kind, HookKind::Create | HookKind::Destroy),
        node: matches!(kind, HookKind::Attach | HookKind::Detach),
    };
    let bridge = match Bridge::new(config, roles, ProcessMode::ForkedHook) {
        Ok(b) => b,
        Err(error) => {
            return HookOutput::failure(&format!(
                "{kind}: cannot open the bridge's state: {error}"
            ));
        }
    };
    let result: Result<serde_json::Value, HookError> = match request {
        HookRequest::Create(req) => hooks::create(&bridge, req)
            .await
            .map(|r| json!({ "token": r.token, "private_data": r.private_data })),
        HookRequest::Destroy(req) => hooks::destroy(&bridge, req).await.map(|_| json!({})),
        HookRequest::Attach(req) => hooks::attach(&bridge, req)
            .await
            .map(|r| json!({ "host_path": r.host_path, "metadata": r.metadata })),
        HookRequest::Detach(req) => hooks::detach(&bridge, req).await.map(|_| json!({})),
    };
    match result {
        Ok(value) => HookOutput {
            stdout: value.to_string(),
            success: true,
        },
        Err(error) => HookOutput {
            stdout: errors::to_json(&error),
            success: false,
        },
    }
}
