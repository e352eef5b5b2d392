//! What a CSI driver can do, asked the way a CO asks: Probe, GetPluginInfo, plugin,
//! controller and node capabilities, NodeGetInfo. The answers decide which calls the
//! bridge makes; unknown capability entries are ignored.

use std::time::Duration;

use super::{CsiClient, CsiError, Deadline};
use crate::proto::csi::v1 as csi;
use csi::controller_service_capability::rpc::Type as CtrlRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use csi::plugin_capability::service::Type as PluginService;

/// How long Probe may keep saying "not ready" before discovery gives up (inside the
/// caller's deadline).
const PROBE_INTERVAL: Duration = Duration::from_millis(200);

/// The driver's identity and plugin-level capabilities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverIdentity {
    pub name: String,
    pub vendor_version: String,
    pub controller_service: bool,
}

/// Controller capabilities the bridge acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ControllerCaps {
    pub create_delete_volume: bool,
    pub publish_unpublish_volume: bool,
}

/// Node capabilities the bridge acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeCaps {
    pub stage_unstage_volume: bool,
}

/// Probes until ready (or the deadline), then reads the plugin info and capabilities.
pub async fn identity(client: &CsiClient, deadline: &Deadline) -> Result<DriverIdentity, CsiError> {
    loop {
        let probe = client.probe(csi::ProbeRequest {}, deadline).await?;
        // An absent `ready` means ready (CSI spec).
        if probe.ready.is_none_or(|r| r) {
            break;
        }
        if deadline.remaining() <= PROBE_INTERVAL {
            return Err(CsiError {
                call: "Probe",
                endpoint: client.endpoint().to_string(),
                code: tonic::Code::Unavailable,
                message: "the driver kept answering ready=false".into(),
                attempts: 1,
                gave_up_after: Some(deadline.elapsed()),
            });
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
    let info = client
        .get_plugin_info(csi::GetPluginInfoRequest {}, deadline)
        .await?;
    if info.name.is_empty() {
        return Err(CsiError {
            call: "GetPluginInfo",
            endpoint: client.endpoint().to_string(),
            code: tonic::Code::Internal,
            message: "the driver returned an empty name".into(),
            attempts: 1,
            gave_up_after: None,
        });
    }
    let caps = client
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}, deadline)
        .await?;
    let controller_service = caps.capabilities.iter().any(|c| {
        matches!(
            &c.r#type,
            Some(csi::plugin_capability::Type::Service(s))
                if s.r#type == PluginService::ControllerService as i32
        )
    });
    Ok(DriverIdentity {
        name: info.name,
        vendor_version: info.vendor_version,
        controller_service,
    })
}

pub async fn controller_caps(
    client: &CsiClient,
    deadline: &Deadline,
) -> Result<ControllerCaps, CsiError> {
    let resp = client
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {}, deadline)
        .await?;
    let has = |wanted: CtrlRpc| {
        resp.capabilities.iter().any(|c| {
            matches!(&c.r#type,
                Some(csi::controller_service_capability::Type::Rpc(r)) if r.r#type == wanted as i32)
        })
    };
    Ok(ControllerCaps {
        create_delete_volume: has(CtrlRpc::CreateDeleteVolume),
        publish_unpublish_volume: has(CtrlRpc::PublishUnpublishVolume),
    })
}

pub async fn node_caps(client: &CsiClient, deadline: &Deadline) -> Result<NodeCaps, CsiError> {
    let resp = client
        .node_get_capabilities(csi::NodeGetCapabilitiesRequest {}, deadline)
        .await?;
    let stage = resp.capabilities.iter().any(|c| {
        matches!(&c.r#type,
            Some(csi::node_service_capability::Type::Rpc(r)) if r.r#type == NodeRpc::StageUnstageVolume as i32)
    });
    Ok(NodeCaps {
        stage_unstage_volume: stage,
    })
}

pub async fn node_id(client: &CsiClient, deadline: &Deadline) -> Result<String, CsiError> {
    let info = client
        .node_get_info(csi::NodeGetInfoRequest {}, deadline)
        .await?;
    if info.node_id.is_empty() {
        return Err(CsiError {
            call: "NodeGetInfo",
            endpoint: client.endpoint().to_string(),
            code: tonic::Code::Internal,
            message: "the driver returned an empty node_id".into(),
            attempts: 1,
            gave_up_after: None,
        });
    }
    Ok(info.node_id)
}
