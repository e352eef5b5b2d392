//! Cube's four hooks from wire request to wire reply, shared by the gRPC services and the
//! binary hook, in two steps: `check` (validate, before anything else happens) and `run`
//! (call the bridge, shape the reply). A request that fails the check changes nothing: no
//! state directory, no lock, no CSI call, no record.

use crate::bridge::{
    AttachVolume, Bridge, BridgeError, Caller, CreateVolume, DestroyVolume, DetachVolume,
    HookError, HookKind,
};
use crate::config::Config;
use crate::proto::cube::v1 as pb;

use super::validate;

/// One hook's request as Cube sent it, over either transport.
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

    pub fn volume_id(&self) -> &str {
        match self {
            HookRequest::Create(r) => &r.volume_id,
            HookRequest::Destroy(r) => &r.volume_id,
            HookRequest::Attach(r) => &r.volume_id,
            HookRequest::Detach(r) => &r.volume_id,
        }
    }
}

/// A request that passed the check, in the core's types.
#[derive(Debug, Clone)]
pub enum Checked {
    Create(CreateVolume),
    Destroy(DestroyVolume),
    Attach(AttachVolume),
    Detach(DetachVolume),
}

/// A hook's reply, for either transport.
#[derive(Debug, Clone)]
pub enum HookReply {
    Create(pb::CreateResponse),
    Destroy(pb::DestroyResponse),
    Attach(pb::AttachResponse),
    Detach(pb::DetachResponse),
}

/// Validates `request` against `config`.
pub fn check(request: HookRequest, config: &Config) -> Result<Checked, HookError> {
    let (hook, volume_id) = (request.kind(), request.volume_id().to_string());
    let checked = match request {
        HookRequest::Create(r) => validate::create(r).map(Checked::Create),
        HookRequest::Destroy(r) => validate::destroy(r).map(Checked::Destroy),
        HookRequest::Attach(r) => validate::attach(r, config).map(Checked::Attach),
        HookRequest::Detach(r) => validate::detach(r, config).map(Checked::Detach),
    };
    checked.map_err(|message| {
        let shown = crate::bridge::naming::short_volume_id(&volume_id);
        tracing::warn!(op = hook.as_str(), volume_id = %shown, %message, "rejected an invalid request");
        crate::metrics::hook(
            &crate::metrics::DriverLabel::of(config),
            hook.as_str(),
            "invalid_request",
            std::time::Duration::ZERO,
        );
        HookError {
            hook,
            volume_id,
            error: BridgeError::InvalidRequest(message),
        }
    })
}

/// Runs a checked request.
pub async fn run(
    bridge: &Bridge,
    request: Checked,
    caller: &Caller,
) -> Result<HookReply, HookError> {
    Ok(match request {
        Checked::Create(req) => {
            let created = bridge.create(req, caller).await?;
            HookReply::Create(pb::CreateResponse {
                token: created.token,
                private_data: created.private_data,
            })
        }
        Checked::Destroy(req) => {
            bridge.destroy(req).await?;
            HookReply::Destroy(pb::DestroyResponse {})
        }
        Checked::Attach(req) => attach_reply(bridge.attach(req, caller).await?),
        Checked::Detach(req) => {
            bridge.detach(req).await?;
            HookReply::Detach(pb::DetachResponse {})
        }
    })
}

/// Runs a checked Attach or Detach only if it is on the hot path (see
/// `Bridge::attach_if_hot`); `None` for anything else.
pub async fn run_if_hot(
    bridge: &Bridge,
    request: &Checked,
) -> Option<Result<HookReply, HookError>> {
    match request {
        Checked::Attach(req) => Some(bridge.attach_if_hot(req).await?.map(attach_reply)),
        Checked::Detach(req) => Some(
            bridge
                .detach_if_hot(req)
                .await?
                .map(|()| HookReply::Detach(pb::DetachResponse {})),
        ),
        Checked::Create(_) | Checked::Destroy(_) => None,
    }
}

fn attach_reply(attached: crate::bridge::Attached) -> HookReply {
    HookReply::Attach(pb::AttachResponse {
        host_path: attached.host_path.to_string_lossy().into_owned(),
        metadata: attached.metadata,
    })
}

/// Checks and runs `request` (the rpc path: the bridge is already open).
pub async fn handle(
    bridge: &Bridge,
    config: &Config,
    request: HookRequest,
    caller: &Caller,
) -> Result<HookReply, HookError> {
    let checked = check(request, config)?;
    run(bridge, checked, caller).await
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A volume_id refused for its length is quoted in part, with its length.
    #[test]
    fn a_huge_volume_id_is_quoted_in_part() {
        let config = Config::parse(
            "driver = \"nfs\"\n[csi]\nendpoint = \"/run/x.sock\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        let request = HookRequest::Destroy(pb::DestroyRequest {
            volume_id: "x".repeat(1_000_000),
        });
        let message = check(request, &config).unwrap_err().to_string();
        assert!(message.len() < 512, "{} bytes", message.len());
        assert!(
            message.starts_with(&format!(
                "destroy of volume \"{}\"… (1000000 bytes)",
                "x".repeat(128)
            )),
            "{message}"
        );
        assert!(message.contains("1000000 bytes long"), "{message}");
    }
}
