//! The core's driver ports over gRPC: builds the CSI requests, asks for capabilities the
//! way a CO does, and turns the driver's NOT_FOUND answers into the core's outcomes.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use tonic::Code;

use super::CsiClient;
use super::client::code_name;
use super::redact::Redactions;
use super::retry::finality;
use crate::bridge::AccessMode;
use crate::bridge::Deadline;
use crate::bridge::ports::{
    Capability, ControllerCaps, ControllerDriver, ControllerExpand, ControllerExpanded,
    ControllerPublish, CreatedVolume, DriverError, DriverIdentity, ExpansionMode, Finality,
    NewSnapshot, NewVolume, NodeCaps, NodeDriver, NodeExpand, NodeInfo, Publish, Secrets, Segments,
    SnapshotInfo, Stage, TopologyRequirement, Undone, VolumeStats,
};
use crate::bridge::records::ContentSource;
use crate::proto::csi::v1 as csi;
use csi::controller_service_capability::rpc::Type as CtrlRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use csi::plugin_capability::service::Type as PluginService;

/// How long Probe may keep saying "not ready" between asks (inside the caller's deadline).
const PROBE_INTERVAL: Duration = Duration::from_millis(200);

/// One CSI endpoint, serving as the node or the controller side (or both).
#[derive(Debug, Clone)]
pub struct GrpcDriver {
    client: CsiClient,
}

impl GrpcDriver {
    pub fn new(client: CsiClient) -> Self {
        Self { client }
    }

    /// A call that succeeded with an answer the bridge cannot use (no volume or snapshot
    /// id): the driver made what was asked, so the failure is uncertain, and the intent
    /// that names it by name is kept for the sweep, or a Destroy, to find it again.
    /// Taken as final, the Create forgot its intent and the volume leaked.
    fn made_but_unusable(&self, call: &'static str, message: &str) -> DriverError {
        DriverError {
            finality: Finality::Uncertain,
            ..self.bad_answer(call, message)
        }
    }

    /// An error the bridge itself finds in an answer (not a gRPC status).
    fn bad_answer(&self, call: &'static str, message: &str) -> DriverError {
        DriverError {
            call,
            endpoint: self.client.endpoint().to_string(),
            status: code_name(Code::Internal),
            grpc_code: Code::Internal as i32,
            finality: finality(Code::Internal),
            message: message.to_string(),
            attempts: 1,
            gave_up_after: None,
        }
    }

    /// Probes until the driver says it is ready (an absent `ready` means ready).
    async fn probe_until_ready(&self, deadline: &Deadline) -> Result<(), DriverError> {
        loop {
            let probe = self
                .client
                .probe(csi::ProbeRequest {}, deadline, &Redactions::NONE)
                .await?;
            if probe.ready.is_none_or(|r| r) {
                return Ok(());
            }
            if deadline.remaining() <= PROBE_INTERVAL {
                return Err(DriverError {
                    status: code_name(Code::Unavailable),
                    grpc_code: Code::Unavailable as i32,
                    finality: finality(Code::Unavailable),
                    gave_up_after: Some(deadline.elapsed()),
                    ..self.bad_answer("Probe", "the driver kept answering ready=false")
                });
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
    }
}

/// NOT_FOUND from an inverse call: the driver does not know the volume (any more).
fn not_found(error: &DriverError) -> bool {
    error.grpc_code == Code::NotFound as i32
}

/// The answer of a delete or an unpublish, where NOT_FOUND says there is nothing left to
/// undo, which is the success the call was for (CSI spec).
fn absent_is_done<T>(answer: Result<T, DriverError>) -> Result<(), DriverError> {
    match answer {
        Ok(_) => Ok(()),
        Err(e) if not_found(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The VolumeCapability of `c`; `mount_group` (NodeStage and NodePublish only) becomes
/// its `volume_mount_group`.
fn capability(c: &Capability, mount_group: Option<u32>) -> csi::VolumeCapability {
    use csi::volume_capability::access_mode::Mode;
    let mode = match c.access_mode {
        AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
        AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
        AccessMode::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
        AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
        AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
        AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
    };
    csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(csi::volume_capability::AccessType::Mount(
            csi::volume_capability::MountVolume {
                fs_type: c.fs_type.clone(),
                mount_flags: c.mount_flags.clone(),
                volume_mount_group: mount_group.map(|gid| gid.to_string()).unwrap_or_default(),
            },
        )),
    }
}

/// The VolumeExpansion plugin capability: ONLINE, else OFFLINE; None when not advertised.
fn volume_expansion(caps: &[csi::PluginCapability]) -> Option<ExpansionMode> {
    use csi::plugin_capability::{Type, volume_expansion::Type as Expansion};
    let modes: Vec<i32> = caps
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Type::VolumeExpansion(e)) => Some(e.r#type),
            _ => None,
        })
        .collect();
    if modes.contains(&(Expansion::Online as i32)) {
        Some(ExpansionMode::Online)
    } else if modes.is_empty() {
        None
    } else {
        Some(ExpansionMode::Offline)
    }
}

fn capacity(required_bytes: u64) -> Option<csi::CapacityRange> {
    (required_bytes > 0).then_some(csi::CapacityRange {
        required_bytes: required_bytes.min(i64::MAX as u64) as i64,
        limit_bytes: 0,
    })
}

fn map<I: IntoIterator<Item = (String, String)>, M: FromIterator<(String, String)>>(m: I) -> M {
    m.into_iter().collect()
}

fn secrets(s: &Secrets) -> std::collections::HashMap<String, String> {
    map(s.0.clone())
}

fn content_source(source: &ContentSource) -> csi::VolumeContentSource {
    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
    csi::VolumeContentSource {
        r#type: Some(match source {
            ContentSource::Snapshot {
                csi_snapshot_id, ..
            } => Type::Snapshot(SnapshotSource {
                snapshot_id: csi_snapshot_id.clone(),
            }),
            ContentSource::Volume { csi_volume_id, .. } => Type::Volume(VolumeSource {
                volume_id: csi_volume_id.clone(),
            }),
        }),
    }
}

fn snapshot_info(snapshot: csi::Snapshot) -> SnapshotInfo {
    SnapshotInfo {
        csi_snapshot_id: snapshot.snapshot_id,
        source_csi_volume_id: snapshot.source_volume_id,
        size_bytes: snapshot.size_bytes,
        creation_time: snapshot
            .creation_time
            .map_or(0, |t| u64::try_from(t.seconds).unwrap_or(0)),
        ready_to_use: snapshot.ready_to_use,
    }
}

fn topology(segments: &Segments) -> csi::Topology {
    csi::Topology {
        segments: map(segments.clone()),
    }
}

fn requirement(r: &TopologyRequirement) -> csi::TopologyRequirement {
    csi::TopologyRequirement {
        requisite: r.requisite.iter().map(topology).collect(),
        preferred: r.preferred.iter().map(topology).collect(),
    }
}

fn path_string(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

#[async_trait]
impl ControllerDriver for GrpcDriver {
    fn endpoint(&self) -> &str {
        self.client.endpoint()
    }

    async fn identity(&self, deadline: &Deadline) -> Result<DriverIdentity, DriverError> {
        self.probe_until_ready(deadline).await?;
        let info = self
            .client
            .get_plugin_info(csi::GetPluginInfoRequest {}, deadline, &Redactions::NONE)
            .await?;
        if info.name.is_empty() {
            return Err(self.bad_answer("GetPluginInfo", "the driver returned an empty name"));
        }
        let caps = self
            .client
            .get_plugin_capabilities(
                csi::GetPluginCapabilitiesRequest {},
                deadline,
                &Redactions::NONE,
            )
            .await?;
        let service = |wanted: PluginService| {
            caps.capabilities.iter().any(|c| {
                matches!(
                    &c.r#type,
                    Some(csi::plugin_capability::Type::Service(s)) if s.r#type == wanted as i32
                )
            })
        };
        Ok(DriverIdentity {
            name: info.name,
            vendor_version: info.vendor_version,
            controller_service: service(PluginService::ControllerService),
            accessibility_constraints: service(PluginService::VolumeAccessibilityConstraints),
            volume_expansion: volume_expansion(&caps.capabilities),
        })
    }

    async fn capabilities(&self, deadline: &Deadline) -> Result<ControllerCaps, DriverError> {
        let resp = self
            .client
            .controller_get_capabilities(
                csi::ControllerGetCapabilitiesRequest {},
                deadline,
                &Redactions::NONE,
            )
            .await?;
        // Unknown entries (newer spec versions, UNKNOWN) are ignored.
        let has = |wanted: CtrlRpc| {
            resp.capabilities.iter().any(|c| {
                matches!(&c.r#type,
                    Some(csi::controller_service_capability::Type::Rpc(r)) if r.r#type == wanted as i32)
            })
        };
        Ok(ControllerCaps {
            create_delete_volume: has(CtrlRpc::CreateDeleteVolume),
            publish_unpublish_volume: has(CtrlRpc::PublishUnpublishVolume),
            create_delete_snapshot: has(CtrlRpc::CreateDeleteSnapshot),
            list_snapshots: has(CtrlRpc::ListSnapshots),
            clone_volume: has(CtrlRpc::CloneVolume),
            single_node_multi_writer: has(CtrlRpc::SingleNodeMultiWriter),
            expand_volume: has(CtrlRpc::ExpandVolume),
        })
    }

    async fn create_volume(
        &self,
        volume: &NewVolume,
        deadline: &Deadline,
    ) -> Result<CreatedVolume, DriverError> {
        let request = csi::CreateVolumeRequest {
            name: volume.name.clone(),
            capacity_range: (volume.required_bytes > 0).then_some(csi::CapacityRange {
                required_bytes: volume.required_bytes as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![capability(&volume.capability, None)],
            parameters: map(volume.parameters.clone()),
            secrets: secrets(&volume.secrets),
            volume_content_source: volume.content_source.as_ref().map(content_source),
            accessibility_requirements: volume.accessibility.as_ref().map(requirement),
            ..Default::default()
        };
        let redact = Redactions::of(&volume.secrets, Some(&volume.capability));
        let reply = self
            .client
            .create_volume(request, deadline, &redact)
            .await?;
        let created = reply
            .volume
            .filter(|v| !v.volume_id.is_empty())
            .ok_or_else(|| {
                self.made_but_unusable(
                    "CreateVolume",
                    "CreateVolume succeeded but returned no volume id",
                )
            })?;
        Ok(CreatedVolume {
            csi_volume_id: created.volume_id,
            volume_context: map(created.volume_context),
            capacity_bytes: created.capacity_bytes,
            accessible_topology: created
                .accessible_topology
                .into_iter()
                .map(|t| map(t.segments))
                .collect(),
        })
    }

    async fn delete_volume(
        &self,
        csi_volume_id: &str,
        secrets_: &Secrets,
        deadline: &Deadline,
    ) -> Result<(), DriverError> {
        let request = csi::DeleteVolumeRequest {
            volume_id: csi_volume_id.to_string(),
            secrets: secrets(secrets_),
        };
        // DeleteVolume of an unknown volume must succeed; some drivers answer NOT_FOUND.
        absent_is_done(
            self.client
                .delete_volume(request, deadline, &Redactions::of(secrets_, None))
                .await,
        )
    }

    async fn publish(
        &self,
        call: &ControllerPublish,
        deadline: &Deadline,
    ) -> Result<BTreeMap<String, String>, DriverError> {
        let request = csi::ControllerPublishVolumeRequest {
            volume_id: call.csi_volume_id.clone(),
            node_id: call.node_id.clone(),
            volume_capability: Some(capability(&call.capability, None)),
            readonly: false,
            secrets: secrets(&call.secrets),
            volume_context: map(call.volume_context.clone()),
        };
        let reply = self
            .client
            .controller_publish_volume(
                request,
                deadline,
                &Redactions::of(&call.secrets, Some(&call.capability)),
            )
            .await?;
        Ok(map(reply.publish_context))
    }

    async fn unpublish(
        &self,
        csi_volume_id: &str,
        node_id: &str,
        secrets_: &Secrets,
        deadline: &Deadline,
    ) -> Result<(), DriverError> {
        let request = csi::ControllerUnpublishVolumeRequest {
            volume_id: csi_volume_id.to_string(),
            node_id: node_id.to_string(),
            secrets: secrets(secrets_),
        };
        // Not attached, or the volume is gone: nothing to undo.
        absent_is_done(
            self.client
                .controller_unpublish_volume(request, deadline, &Redactions::of(secrets_, None))
                .await,
        )
    }

    async fn create_snapshot(
        &self,
        snapshot: &NewSnapshot,
        deadline: &Deadline,
    ) -> Result<SnapshotInfo, DriverError> {
        let request = csi::CreateSnapshotRequest {
            source_volume_id: snapshot.source_csi_volume_id.clone(),
            name: snapshot.name.clone(),
            secrets: secrets(&snapshot.secrets),
            parameters: Default::default(),
        };
        let reply = self
            .client
            .create_snapshot(request, deadline, &Redactions::of(&snapshot.secrets, None))
            .await?;
        reply
            .snapshot
            .filter(|s| !s.snapshot_id.is_empty())
            .map(snapshot_info)
            .ok_or_else(|| {
                self.made_but_unusable(
                    "CreateSnapshot",
                    "CreateSnapshot succeeded but returned no snapshot id",
                )
            })
    }

    async fn delete_snapshot(
        &self,
        csi_snapshot_id: &str,
        secrets_: &Secrets,
        deadline: &Deadline,
    ) -> Result<(), DriverError> {
        let request = csi::DeleteSnapshotRequest {
            snapshot_id: csi_snapshot_id.to_string(),
            secrets: secrets(secrets_),
        };
        // Deleting an unknown snapshot must succeed.
        absent_is_done(
            self.client
                .delete_snapshot(request, deadline, &Redactions::of(secrets_, None))
                .await,
        )
    }

    async fn get_snapshot(
        &self,
        csi_snapshot_id: &str,
        secrets_: &Secrets,
        deadline: &Deadline,
    ) -> Result<Option<SnapshotInfo>, DriverError> {
        let request = csi::ListSnapshotsRequest {
            snapshot_id: csi_snapshot_id.to_string(),
            secrets: secrets(secrets_),
            ..Default::default()
        };
        // An unknown id is an empty list (CSI spec); some drivers answer NOT_FOUND.
        match self
            .client
            .list_snapshots(request, deadline, &Redactions::of(secrets_, None))
            .await
        {
            Ok(reply) => Ok(reply
                .entries
                .into_iter()
                .filter_map(|e| e.snapshot)
                .find(|s| s.snapshot_id == csi_snapshot_id)
                .map(snapshot_info)),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn expand_volume(
        &self,
        call: &ControllerExpand,
        deadline: &Deadline,
    ) -> Result<ControllerExpanded, DriverError> {
        let request = csi::ControllerExpandVolumeRequest {
            volume_id: call.csi_volume_id.clone(),
            capacity_range: capacity(call.required_bytes),
            secrets: secrets(&call.secrets),
            volume_capability: Some(capability(&call.capability, None)),
        };
        let reply = self
            .client
            .controller_expand_volume(
                request,
                deadline,
                &Redactions::of(&call.secrets, Some(&call.capability)),
            )
            .await?;
        Ok(ControllerExpanded {
            capacity_bytes: reply.capacity_bytes,
            node_expansion_required: reply.node_expansion_required,
        })
    }
}

#[async_trait]
impl NodeDriver for GrpcDriver {
    fn endpoint(&self) -> &str {
        self.client.endpoint()
    }

    async fn probe(&self, deadline: &Deadline) -> Result<(), DriverError> {
        self.probe_until_ready(deadline).await
    }

    async fn capabilities(&self, deadline: &Deadline) -> Result<NodeCaps, DriverError> {
        let resp = self
            .client
            .node_get_capabilities(
                csi::NodeGetCapabilitiesRequest {},
                deadline,
                &Redactions::NONE,
            )
            .await?;
        let has = |wanted: NodeRpc| {
            resp.capabilities.iter().any(|c| {
                matches!(&c.r#type,
                    Some(csi::node_service_capability::Type::Rpc(r)) if r.r#type == wanted as i32)
            })
        };
        Ok(NodeCaps {
            stage_unstage_volume: has(NodeRpc::StageUnstageVolume),
            get_volume_stats: has(NodeRpc::GetVolumeStats) || has(NodeRpc::VolumeCondition),
            volume_condition: has(NodeRpc::VolumeCondition),
            single_node_multi_writer: has(NodeRpc::SingleNodeMultiWriter),
            volume_mount_group: has(NodeRpc::VolumeMountGroup),
            expand_volume: has(NodeRpc::ExpandVolume),
        })
    }

    async fn node_id(&self, deadline: &Deadline) -> Result<String, DriverError> {
        let info = self
            .client
            .node_get_info(csi::NodeGetInfoRequest {}, deadline, &Redactions::NONE)
            .await?;
        if info.node_id.is_empty() {
            return Err(self.bad_answer("NodeGetInfo", "the driver returned an empty node_id"));
        }
        Ok(info.node_id)
    }

    async fn stage(&self, call: &Stage, deadline: &Deadline) -> Result<(), DriverError> {
        let request = csi::NodeStageVolumeRequest {
            volume_id: call.csi_volume_id.clone(),
            publish_context: map(call.publish_context.clone()),
            staging_target_path: path_string(&call.staging_path),
            volume_capability: Some(capability(&call.capability, call.mount_group)),
            secrets: secrets(&call.secrets),
            volume_context: map(call.volume_context.clone()),
        };
        self.client
            .node_stage_volume(
                request,
                deadline,
                &Redactions::of(&call.secrets, Some(&call.capability)),
            )
            .await?;
        Ok(())
    }

    async fn unstage(
        &self,
        csi_volume_id: &str,
        staging_path: &Path,
        deadline: &Deadline,
    ) -> Result<Undone, DriverError> {
        let request = csi::NodeUnstageVolumeRequest {
            volume_id: csi_volume_id.to_string(),
            staging_target_path: path_string(staging_path),
        };
        match self
            .client
            .node_unstage_volume(request, deadline, &Redactions::NONE)
            .await
        {
            Ok(_) => Ok(Undone::Done),
            // csi-driver-host-path answers NOT_FOUND for volumes it no longer knows.
            Err(e) if not_found(&e) => Ok(Undone::UnknownVolume),
            Err(e) => Err(e),
        }
    }

    async fn publish(&self, call: &Publish, deadline: &Deadline) -> Result<(), DriverError> {
        let request = csi::NodePublishVolumeRequest {
            volume_id: call.csi_volume_id.clone(),
            publish_context: map(call.publish_context.clone()),
            staging_target_path: call
                .staging_path
                .as_deref()
                .map(path_string)
                .unwrap_or_default(),
            target_path: path_string(&call.target_path),
            volume_capability: Some(capability(&call.capability, call.mount_group)),
            readonly: false,
            secrets: secrets(&call.secrets),
            volume_context: map(call.volume_context.clone()),
        };
        self.client
            .node_publish_volume(
                request,
                deadline,
                &Redactions::of(&call.secrets, Some(&call.capability)),
            )
            .await?;
        Ok(())
    }

    async fn unpublish(
        &self,
        csi_volume_id: &str,
        target_path: &Path,
        deadline: &Deadline,
    ) -> Result<Undone, DriverError> {
        let request = csi::NodeUnpublishVolumeRequest {
            volume_id: csi_volume_id.to_string(),
            target_path: path_string(target_path),
        };
        match self
            .client
            .node_unpublish_volume(request, deadline, &Redactions::NONE)
            .await
        {
            Ok(_) => Ok(Undone::Done),
            Err(e) if not_found(&e) => Ok(Undone::UnknownVolume),
            Err(e) => Err(e),
        }
    }

    async fn volume_stats(
        &self,
        csi_volume_id: &str,
        target_path: &Path,
        deadline: &Deadline,
    ) -> Result<VolumeStats, DriverError> {
        use csi::volume_usage::Unit;
        let request = csi::NodeGetVolumeStatsRequest {
            volume_id: csi_volume_id.to_string(),
            volume_path: path_string(target_path),
            staging_target_path: String::new(),
        };
        let reply = self
            .client
            .node_get_volume_stats(request, deadline, &Redactions::NONE)
            .await?;
        let mut stats = VolumeStats::default();
        for usage in reply.usage.iter().filter(|u| u.unit == Unit::Bytes as i32) {
            stats.total_bytes = Some(usage.total);
            stats.used_bytes = Some(usage.used);
            stats.available_bytes = Some(usage.available);
        }
        stats.abnormal = reply
            .volume_condition
            .filter(|c| c.abnormal)
            .map(|c| super::client::driver_text(&c.message));
        Ok(stats)
    }

    async fn node_info(&self, deadline: &Deadline) -> Result<NodeInfo, DriverError> {
        let info = self
            .client
            .node_get_info(csi::NodeGetInfoRequest {}, deadline, &Redactions::NONE)
            .await?;
        if info.node_id.is_empty() {
            return Err(self.bad_answer("NodeGetInfo", "the driver returned an empty node_id"));
        }
        Ok(NodeInfo {
            node_id: info.node_id,
            accessible_topology: info
                .accessible_topology
                .map(|t| map(t.segments))
                .unwrap_or_default(),
        })
    }

    async fn expand_volume(
        &self,
        call: &NodeExpand,
        deadline: &Deadline,
    ) -> Result<i64, DriverError> {
        let request = csi::NodeExpandVolumeRequest {
            volume_id: call.csi_volume_id.clone(),
            volume_path: path_string(&call.volume_path),
            capacity_range: capacity(call.required_bytes),
            staging_target_path: call
                .staging_path
                .as_deref()
                .map(path_string)
                .unwrap_or_default(),
            volume_capability: Some(capability(&call.capability, None)),
            secrets: secrets(&call.secrets),
        };
        let reply = self
            .client
            .node_expand_volume(
                request,
                deadline,
                &Redactions::of(&call.secrets, Some(&call.capability)),
            )
            .await?;
        Ok(reply.capacity_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CreateVolume that succeeds with no volume id made a volume the bridge cannot
    /// name by id: the failure is uncertain, so the Create keeps its intent (the name
    /// finds the volume again). Before, it was final, the intent was forgotten and the
    /// volume leaked.
    #[tokio::test]
    async fn a_create_volume_answered_without_an_id_is_uncertain() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let mut conn = h2::server::handshake(stream).await.unwrap();
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let response = http::Response::builder()
                        .status(200)
                        .header("content-type", "application/grpc")
                        .body(())
                        .unwrap();
                    let mut stream = respond.send_response(response, false).unwrap();
                    // An empty CreateVolumeResponse: no volume.
                    let _ = stream.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), false);
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", "0".parse().unwrap());
                    let _ = stream.send_trailers(trailers);
                }
            }
        });
        let driver = GrpcDriver::new(CsiClient::new(&super::super::Endpoint::Unix(path)));
        let volume = NewVolume {
            name: "pvc-1".into(),
            required_bytes: 0,
            capability: Capability::default(),
            parameters: BTreeMap::new(),
            secrets: Secrets::default(),
            content_source: None,
            accessibility: None,
        };
        let error = driver
            .create_volume(&volume, &Deadline::after(Duration::from_secs(3)))
            .await
            .unwrap_err();
        assert_eq!(error.finality, Finality::Uncertain, "{error:?}");
    }

    #[test]
    fn capability_is_a_mount_volume_with_the_mode_asked_for() {
        let c = capability(
            &Capability {
                access_mode: AccessMode::SingleNodeWriter,
                fs_type: "ext4".into(),
                mount_flags: vec!["ro".into()],
            },
            None,
        );
        assert_eq!(
            c.access_mode.unwrap().mode,
            csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32
        );
        let Some(csi::volume_capability::AccessType::Mount(m)) = c.access_type else {
            panic!("not a mount volume")
        };
        assert_eq!(
            (m.fs_type.as_str(), m.mount_flags),
            ("ext4", vec!["ro".into()])
        );
        assert_eq!(
            m.volume_mount_group, "",
            "no group unless one is configured"
        );
    }

    #[test]
    fn a_mount_group_becomes_volume_mount_group_and_every_mode_maps_to_its_number() {
        use csi::volume_capability::access_mode::Mode;
        for (mode, wire) in [
            (AccessMode::SingleNodeWriter, Mode::SingleNodeWriter),
            (AccessMode::SingleNodeReaderOnly, Mode::SingleNodeReaderOnly),
            (AccessMode::MultiNodeReaderOnly, Mode::MultiNodeReaderOnly),
            (
                AccessMode::MultiNodeSingleWriter,
                Mode::MultiNodeSingleWriter,
            ),
            (AccessMode::MultiNodeMultiWriter, Mode::MultiNodeMultiWriter),
            (
                AccessMode::SingleNodeSingleWriter,
                Mode::SingleNodeSingleWriter,
            ),
            (
                AccessMode::SingleNodeMultiWriter,
                Mode::SingleNodeMultiWriter,
            ),
        ] {
            let c = capability(
                &Capability {
                    access_mode: mode,
                    ..Default::default()
                },
                Some(2000),
            );
            assert_eq!(c.access_mode.unwrap().mode, wire as i32, "{mode:?}");
            let Some(csi::volume_capability::AccessType::Mount(m)) = c.access_type else {
                panic!("not a mount volume")
            };
            assert_eq!(m.volume_mount_group, "2000");
        }
        assert_eq!(Mode::SingleNodeSingleWriter as i32, 6);
        assert_eq!(Mode::SingleNodeMultiWriter as i32, 7);
    }

    #[test]
    fn accessibility_requirements_keep_their_order() {
        let zone = |z: &str| Segments::from([("example.com/zone".to_string(), z.to_string())]);
        let r = requirement(&TopologyRequirement {
            requisite: vec![zone("b"), zone("a")],
            preferred: vec![zone("a")],
        });
        let zones = |ts: &[csi::Topology]| {
            ts.iter()
                .map(|t| t.segments["example.com/zone"].clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(zones(&r.requisite), ["b", "a"]);
        assert_eq!(zones(&r.preferred), ["a"]);
    }
}
