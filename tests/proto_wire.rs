//! Pins wire facts of the protocol definitions in proto/: gRPC method paths and field
//! numbers, so that a typo in a .proto file cannot slip through.

use std::collections::HashMap;

use cube_csi_bridge::proto::csi::v1 as csi;
use cube_csi_bridge::proto::cube::v1 as cube;
use prost::Message;
use tonic::server::NamedService;

/// The (field number, wire type) of every top-level field in an encoded message.
fn tags(bytes: &[u8]) -> Vec<(u32, u8)> {
    let mut out = Vec::new();
    let mut buf = bytes;
    while !buf.is_empty() {
        let key = prost::encoding::decode_varint(&mut buf).unwrap();
        let (field, wire) = ((key >> 3) as u32, (key & 7) as u8);
        out.push((field, wire));
        match wire {
            0 => {
                prost::encoding::decode_varint(&mut buf).unwrap();
            }
            2 => {
                let len = prost::encoding::decode_varint(&mut buf).unwrap() as usize;
                buf = &buf[len..];
            }
            other => panic!("unexpected wire type {other}"),
        }
    }
    out
}

#[test]
fn cube_service_names() {
    type Plugin = cube::volume_plugin_service_server::VolumePluginServiceServer<Dummy>;
    type Controller = cube::volume_controller_service_server::VolumeControllerServiceServer<Dummy>;
    assert_eq!(
        <Plugin as NamedService>::NAME,
        "cubelet.services.volumeplugin.v1.VolumePluginService"
    );
    assert_eq!(
        <Controller as NamedService>::NAME,
        "cubelet.services.volumeplugin.v1.VolumeControllerService"
    );
}

#[test]
fn csi_service_names() {
    assert_eq!(
        <csi::identity_server::IdentityServer<DummyCsi> as NamedService>::NAME,
        "csi.v1.Identity"
    );
    assert_eq!(
        <csi::controller_server::ControllerServer<DummyCsi> as NamedService>::NAME,
        "csi.v1.Controller"
    );
    assert_eq!(
        <csi::node_server::NodeServer<DummyCsi> as NamedService>::NAME,
        "csi.v1.Node"
    );
}

#[test]
fn cube_field_numbers() {
    let attach = cube::AttachRequest {
        sandbox_id: "s".into(),
        namespace: "n".into(),
        volume_id: "v".into(),
        volume_base_dir: "/b".into(),
        ref_count: 3,
        private_data: "p".into(),
    };
    // 4 stays reserved (was driver).
    assert_eq!(
        tags(&attach.encode_to_vec()),
        [(1, 2), (2, 2), (3, 2), (5, 2), (6, 0), (7, 2)]
    );
    let reply = cube::AttachResponse {
        host_path: "/b/x".into(),
        metadata: HashMap::from([("k".into(), "v".into())]),
    };
    assert_eq!(tags(&reply.encode_to_vec()), [(2, 2), (4, 2)]);
    let detach = cube::DetachRequest {
        sandbox_id: "s".into(),
        namespace: "n".into(),
        volume_id: "v".into(),
        metadata: HashMap::from([("k".into(), "v".into())]),
        ref_count: 1,
    };
    assert_eq!(
        tags(&detach.encode_to_vec()),
        [(1, 2), (2, 2), (3, 2), (6, 2), (8, 0)]
    );
    let create = cube::CreateRequest {
        volume_id: "v".into(),
        name: "n".into(),
    };
    assert_eq!(tags(&create.encode_to_vec()), [(1, 2), (2, 2)]);
    let created = cube::CreateResponse {
        token: "t".into(),
        private_data: "p".into(),
    };
    assert_eq!(tags(&created.encode_to_vec()), [(1, 2), (2, 2)]);
    assert_eq!(
        tags(
            &cube::DestroyRequest {
                volume_id: "v".into()
            }
            .encode_to_vec()
        ),
        [(1, 2)]
    );
}

#[test]
fn csi_field_numbers() {
    let publish = csi::NodePublishVolumeRequest {
        volume_id: "v".into(),
        publish_context: HashMap::from([("a".into(), "b".into())]),
        staging_target_path: "/s".into(),
        target_path: "/t".into(),
        volume_capability: Some(Default::default()),
        readonly: true,
        secrets: HashMap::from([("a".into(), "b".into())]),
        volume_context: HashMap::from([("a".into(), "b".into())]),
    };
    assert_eq!(
        tags(&publish.encode_to_vec()),
        [
            (1, 2),
            (2, 2),
            (3, 2),
            (4, 2),
            (5, 2),
            (6, 0),
            (7, 2),
            (8, 2)
        ]
    );
    let create = csi::CreateVolumeRequest {
        name: "n".into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 1,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![Default::default()],
        parameters: HashMap::from([("a".into(), "b".into())]),
        secrets: HashMap::from([("a".into(), "b".into())]),
        ..Default::default()
    };
    assert_eq!(
        tags(&create.encode_to_vec()),
        [(1, 2), (2, 2), (3, 2), (4, 2), (5, 2)]
    );
    let stage = csi::NodeStageVolumeRequest {
        volume_id: "v".into(),
        publish_context: HashMap::from([("a".into(), "b".into())]),
        staging_target_path: "/s".into(),
        volume_capability: Some(Default::default()),
        secrets: HashMap::from([("a".into(), "b".into())]),
        volume_context: HashMap::from([("a".into(), "b".into())]),
    };
    assert_eq!(
        tags(&stage.encode_to_vec()),
        [(1, 2), (2, 2), (3, 2), (4, 2), (5, 2), (6, 2)]
    );
    use csi::volume_capability::access_mode::Mode;
    assert_eq!(Mode::MultiNodeMultiWriter as i32, 5);
    assert_eq!(Mode::SingleNodeMultiWriter as i32, 7);
    use csi::node_service_capability::rpc::Type as NodeRpc;
    assert_eq!(NodeRpc::StageUnstageVolume as i32, 1);
    use csi::controller_service_capability::rpc::Type as CtrlRpc;
    assert_eq!(CtrlRpc::CreateDeleteVolume as i32, 1);
    assert_eq!(CtrlRpc::PublishUnpublishVolume as i32, 2);
}

#[test]
fn secrets_are_redacted_from_debug() {
    let req = csi::NodeStageVolumeRequest {
        volume_id: "v".into(),
        secrets: HashMap::from([("password".into(), "TOP-SECRET".into())]),
        volume_capability: Some(csi::VolumeCapability {
            access_type: Some(csi::volume_capability::AccessType::Mount(
                csi::volume_capability::MountVolume {
                    mount_flags: vec!["pass=FLAG-SECRET".into()],
                    ..Default::default()
                },
            )),
            access_mode: None,
        }),
        ..Default::default()
    };
    let shown = format!("{req:?} {:?}", req.volume_capability);
    assert!(
        !shown.contains("TOP-SECRET") && !shown.contains("FLAG-SECRET"),
        "{shown}"
    );
}

/// Real method paths, served and called raw: a path typo answers UNIMPLEMENTED.
#[tokio::test]
async fn cube_method_paths_answer() {
    use cube::volume_controller_service_server::VolumeControllerServiceServer;
    use cube::volume_plugin_service_server::VolumePluginServiceServer;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(VolumePluginServiceServer::new(Dummy))
            .add_service(VolumeControllerServiceServer::new(Dummy))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let channel =
        cube_csi_bridge::csi::client::channel(&cube_csi_bridge::csi::Endpoint::Unix(socket));
    let mut grpc = tonic::client::Grpc::new(channel);
    for path in [
        "/cubelet.services.volumeplugin.v1.VolumePluginService/Attach",
        "/cubelet.services.volumeplugin.v1.VolumePluginService/Detach",
        "/cubelet.services.volumeplugin.v1.VolumeControllerService/Create",
        "/cubelet.services.volumeplugin.v1.VolumeControllerService/Destroy",
    ] {
        grpc.ready().await.unwrap();
        let codec =
            tonic_prost::ProstCodec::<cube::DestroyRequest, cube::DestroyResponse>::default();
        let reply = grpc
            .unary(
                tonic::Request::new(cube::DestroyRequest::default()),
                path.parse().unwrap(),
                codec,
            )
            .await;
        // Dummy answers every method with this marker; UNIMPLEMENTED would mean a wrong path.
        let status = reply.unwrap_err();
        assert_eq!(status.message(), "dummy", "{path}: {status:?}");
    }
}

#[derive(Debug, Clone, Copy)]
struct Dummy;

#[tonic::async_trait]
impl cube::volume_plugin_service_server::VolumePluginService for Dummy {
    async fn attach(
        &self,
        _: tonic::Request<cube::AttachRequest>,
    ) -> Result<tonic::Response<cube::AttachResponse>, tonic::Status> {
        Err(tonic::Status::internal("dummy"))
    }
    async fn detach(
        &self,
        _: tonic::Request<cube::DetachRequest>,
    ) -> Result<tonic::Response<cube::DetachResponse>, tonic::Status> {
        Err(tonic::Status::internal("dummy"))
    }
}

#[tonic::async_trait]
impl cube::volume_controller_service_server::VolumeControllerService for Dummy {
    async fn create(
        &self,
        _: tonic::Request<cube::CreateRequest>,
    ) -> Result<tonic::Response<cube::CreateResponse>, tonic::Status> {
        Err(tonic::Status::internal("dummy"))
    }
    async fn destroy(
        &self,
        _: tonic::Request<cube::DestroyRequest>,
    ) -> Result<tonic::Response<cube::DestroyResponse>, tonic::Status> {
        Err(tonic::Status::internal("dummy"))
    }
}

#[derive(Debug, Clone, Copy)]
struct DummyCsi;
impl csi::identity_server::Identity for DummyCsi {}
impl csi::controller_server::Controller for DummyCsi {}
impl csi::node_server::Node for DummyCsi {}
