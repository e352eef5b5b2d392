//! Cube's four hooks from wire request to wire reply, shared by the gRPC services and the
//! binary hook: validate, call the bridge, shape the reply. A request that fails
//! validation changes nothing: no lock, no directory, no CSI call, no record.

use crate::bridge::{Bridge, BridgeError, Caller, HookError, HookKind};
use crate::proto::cube::v1 as pb;

use super::validate;

fn invalid(hook: HookKind, volume_id: &str, message: String) -> HookError {
    tracing::warn!(op = hook.as_str(), volume_id, %message, "rejected an invalid request");
    HookError {
        hook,
        volume_id: volume_id.to_string(),
        error: BridgeError::InvalidRequest(message),
    }
}

pub async fn create(
    bridge: &Bridge,
    req: pb::CreateRequest,
    caller: &Caller,
) -> Result<pb::CreateResponse, HookError> {
    let volume_id = req.volume_id.clone();
    let req = validate::create(req).map_err(|m| invalid(HookKind::Create, &volume_id, m))?;
    let created = bridge.create(req, caller).await?;
    Ok(pb::CreateResponse {
        token: created.token,
        private_data: created.private_data,
    })
}

pub async fn destroy(
    bridge: &Bridge,
    req: pb::DestroyRequest,
) -> Result<pb::DestroyResponse, HookError> {
    let volume_id = req.volume_id.clone();
    let req = validate::destroy(req).map_err(|m| invalid(HookKind::Destroy, &volume_id, m))?;
    bridge.destroy(req).await?;
    Ok(pb::DestroyResponse {})
}

pub async fn attach(
    bridge: &Bridge,
    req: pb::AttachRequest,
    caller: &Caller,
) -> Result<pb::AttachResponse, HookError> {
    let volume_id = req.volume_id.clone();
    let req = validate::attach(req, bridge.config())
        .map_err(|m| invalid(HookKind::Attach, &volume_id, m))?;
    let attached = bridge.attach(req, caller).await?;
    Ok(pb::AttachResponse {
        host_path: attached.host_path.to_string_lossy().into_owned(),
        metadata: attached.metadata,
    })
}

pub async fn detach(
    bridge: &Bridge,
    req: pb::DetachRequest,
) -> Result<pb::DetachResponse, HookError> {
    let volume_id = req.volume_id.clone();
    let req = validate::detach(req, bridge.config())
        .map_err(|m| invalid(HookKind::Detach, &volume_id, m))?;
    bridge.detach(req).await?;
    Ok(pb::DetachResponse {})
}
