//! Secrets never leave the bridge in an error: a CSI driver that echoes its whole request
//! (every secret, every mount flag) in its error messages, fed secrets from every place a
//! secret can live — the config's `[secrets]` (all four families), `volume.mount_flags`,
//! and (Kubernetes mode) a StorageClass's Secrets and mountOptions — must not get one of
//! them into a gRPC status, a binary hook's stdout or stderr, or a log line, over both
//! transports. A config whose broken line holds a secret is covered for every command.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::fake_driver::Caps;
use common::{BRIDGE, MODES, Mode, World};
use csi::controller_server::{Controller, ControllerServer};
use csi::identity_server::{Identity, IdentityServer};
use csi::node_server::{Node, NodeServer};
use cube_csi_bridge::proto::csi::v1 as csi;
use tonic::{Request, Response, Status};

// ---------------------------------------------------------------- an echoing CSI driver

/// A CSI driver whose listed methods fail with a message quoting their request's secrets
/// and mount flags, as careless drivers do ("mount -o <flags> failed", "bad secret …").
/// Every other call succeeds without doing anything.
#[derive(Clone, Default)]
struct EchoDriver {
    echoing: Arc<Mutex<Vec<&'static str>>>,
    calls: Arc<Mutex<Vec<&'static str>>>,
}

impl EchoDriver {
    fn echo_only(&self, methods: &[&'static str]) {
        *self.echoing.lock().unwrap() = methods.to_vec();
    }

    fn calls(&self) -> Vec<&'static str> {
        self.calls.lock().unwrap().clone()
    }

    /// Fails `method` with its request quoted, if it is to echo.
    fn enter(
        &self,
        method: &'static str,
        secrets: &HashMap<String, String>,
        capability: Option<&csi::VolumeCapability>,
    ) -> Result<(), Status> {
        self.calls.lock().unwrap().push(method);
        if !self.echoing.lock().unwrap().contains(&method) {
            return Ok(());
        }
        let flags = match capability.and_then(|c| c.access_type.as_ref()) {
            Some(csi::volume_capability::AccessType::Mount(m)) => m.mount_flags.join(","),
            _ => String::new(),
        };
        let pairs: BTreeMap<_, _> = secrets.iter().collect();
        Err(Status::invalid_argument(format!(
            "{method}: mount -o {flags} failed: permission denied; secrets {pairs:?}; \
             password was {}",
            secrets.values().cloned().collect::<Vec<_>>().join(" and ")
        )))
    }

    fn serve(&self, socket: &Path) -> tokio::sync::oneshot::Sender<()> {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let me = self.clone();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(IdentityServer::new(me.clone()))
                .add_service(ControllerServer::new(me.clone()))
                .add_service(NodeServer::new(me))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });
        stop
    }
}

fn rpc_type(kind: i32) -> Option<csi::controller_service_capability::Type> {
    Some(csi::controller_service_capability::Type::Rpc(
        csi::controller_service_capability::Rpc { r#type: kind },
    ))
}

#[tonic::async_trait]
impl Identity for EchoDriver {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: "fake.csi.test".into(),
            vendor_version: "1".into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{Service, Type, service::Type as S};
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities: vec![csi::PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: S::ControllerService as i32,
                })),
            }],
        }))
    }

    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}

#[tonic::async_trait]
impl Controller for EchoDriver {
    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::rpc::Type as R;
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: [R::CreateDeleteVolume, R::PublishUnpublishVolume]
                .into_iter()
                .map(|r| csi::ControllerServiceCapability {
                    r#type: rpc_type(r as i32),
                })
                .collect(),
        }))
    }

    async fn create_volume(
        &self,
        request: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(
            "CreateVolume",
            &req.secrets,
            req.volume_capabilities.first(),
        )?;
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(csi::Volume {
                volume_id: format!("echo-{}", req.name),
                ..Default::default()
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter("DeleteVolume", &req.secrets, None)?;
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        request: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(
            "ControllerPublishVolume",
            &req.secrets,
            req.volume_capability.as_ref(),
        )?;
        Ok(Response::new(
            csi::ControllerPublishVolumeResponse::default(),
        ))
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter("ControllerUnpublishVolume", &req.secrets, None)?;
        Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}))
    }
}

#[tonic::async_trait]
impl Node for EchoDriver {
    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::{Rpc, Type, rpc::Type as R};
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities: vec![csi::NodeServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: R::StageUnstageVolume as i32,
                })),
            }],
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: "echo-node".into(),
            ..Default::default()
        }))
    }

    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(
            "NodeStageVolume",
            &req.secrets,
            req.volume_capability.as_ref(),
        )?;
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        _: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        self.calls.lock().unwrap().push("NodeUnstageVolume");
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.enter(
            "NodePublishVolume",
            &req.secrets,
            req.volume_capability.as_ref(),
        )?;
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        _: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        self.calls.lock().unwrap().push("NodeUnpublishVolume");
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }
}

// ---------------------------------------------------------------- harness

/// A world whose CSI driver is an `EchoDriver` (in place of the fake) and whose config is
/// `extra` on top of the test defaults.
async fn echo_world(
    mode: Mode,
    extra: &str,
    edit: impl FnOnce(String) -> String,
) -> (World, EchoDriver, tokio::sync::oneshot::Sender<()>) {
    let mut w = World::start_with_config(Mode::Binary, Caps::default(), extra, edit).await;
    // It holds secrets: private, or the bridge refuses it.
    std::fs::set_permissions(&w.config_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    if let Some(fake) = w.driver_server.take() {
        fake.stop().await;
    }
    let echo = EchoDriver::default();
    let stop = echo.serve(&w.dir.path().join("csi.sock"));
    if mode == Mode::Rpc {
        w.mode = Mode::Rpc;
        w.start_daemon().await.unwrap();
    }
    (w, echo, stop)
}

/// Checks that a failed hook's message (status or JSON error; stderr is in the logs)
/// says which call failed, shows the driver's scrubbed words, and holds no secret.
fn assert_scrubbed(what: &str, message: &str, call: &str, secrets: &[&str]) {
    assert!(message.contains(call), "{what}: names no {call}: {message}");
    assert!(
        message.contains("<redacted>") && message.contains("permission denied"),
        "{what}: the driver's message is not there, scrubbed: {message}"
    );
    for secret in secrets {
        assert!(
            !message.contains(secret),
            "{what}: {secret:?} leaked: {message}"
        );
    }
}

fn assert_logs_clean(what: &str, logs: &str, secrets: &[&str]) {
    assert!(
        logs.contains("permission denied"),
        "{what}: the driver's error was not logged at all: {logs}"
    );
    for secret in secrets {
        assert!(!logs.contains(secret), "{what}: {secret:?} logged: {logs}");
    }
}

const CONFIG_SECRETS: &str = r#"
[volume]
mount_flags = ["nfsvers=4.1", "password=FLAG-SECRET-1", "sec=krb5"]

[secrets.provisioner]
token = "PROV-SECRET-2"
[secrets.controller_publish]
key = "CTRL-SECRET-3"
[secrets.node_stage]
key = "STAGE-SECRET-4"
[secrets.node_publish]
password = "PUBLISH-SECRET-5"
"#;

const CONFIG_SECRET_VALUES: [&str; 5] = [
    "FLAG-SECRET-1",
    "PROV-SECRET-2",
    "CTRL-SECRET-3",
    "STAGE-SECRET-4",
    "PUBLISH-SECRET-5",
];

#[tokio::test(flavor = "multi_thread")]
async fn config_secrets_and_mount_flags_echoed_by_the_driver_reach_no_error_or_log() {
    for mode in MODES {
        let (w, echo, _stop) = echo_world(mode, CONFIG_SECRETS, |t| t).await;
        let what = |step: &str| format!("{mode:?} {step}");

        echo.echo_only(&["CreateVolume"]);
        let err = w.create("sec-vol").await.expect_err("echoing CreateVolume");
        assert_scrubbed(
            &what("create"),
            &err.message,
            "CreateVolume",
            &CONFIG_SECRET_VALUES,
        );

        echo.echo_only(&[]);
        let created = w.create("sec-vol").await.expect("create");
        for call in [
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
        ] {
            echo.echo_only(&[call]);
            let err = w
                .attach("sb-1", "sec-vol", 0, &created.private_data)
                .await
                .expect_err("echoing attach");
            assert_scrubbed(&what(call), &err.message, call, &CONFIG_SECRET_VALUES);
        }
        assert!(echo.calls().contains(&"NodeUnstageVolume"), "rolled back");

        echo.echo_only(&["DeleteVolume"]);
        let err = w
            .destroy("sec-vol")
            .await
            .expect_err("echoing DeleteVolume");
        assert_scrubbed(
            &what("destroy"),
            &err.message,
            "DeleteVolume",
            &CONFIG_SECRET_VALUES,
        );
        echo.echo_only(&[]);
        w.destroy("sec-vol").await.expect("destroy");

        // Every log line, the daemon's and each forked hook's stderr (RUST_LOG=debug).
        assert_logs_clean(&what("logs"), &w.logs(), &CONFIG_SECRET_VALUES);
    }
}

/// `node_publish = { password = hunter2-SECRET }` (unquoted): every command that reads
/// the config reports where it is broken, never the line.
#[tokio::test(flavor = "multi_thread")]
async fn a_broken_config_line_holding_a_secret_is_never_quoted() {
    let w = World::start(Mode::Binary, Caps::default(), "").await;
    let good = std::fs::read_to_string(&w.config_path).unwrap();
    for broken in [
        format!("{good}\n[secrets]\nnode_publish = {{ password = hunter2-SECRET }}\n"),
        format!("{good}\n[secrets.node_publish]\npassword = hunter2-SECRET\n"),
        format!("{good}\n[volume]\nmount_flags = [\"pass=hunter2-SECRET\"\n"),
        format!("{good}\n[secrets.node_publish]\npassword = [\"hunter2-SECRET\"]\n"),
    ] {
        std::fs::write(&w.config_path, &broken).unwrap();
        let config = w.config_path.display().to_string();
        let runs: Vec<Vec<&str>> = vec![
            vec!["--op", "destroy", "--volume-id", "v1"],
            vec!["serve", "--config", &config],
            vec!["check", "--config", &config],
            vec!["list", "--config", &config],
            vec!["list", "--controller", "--config", &config],
            vec!["register", "--config", &config],
            vec!["probe", "--config", &config],
            vec!["--log-format", "json", "serve", "--config", &config],
        ];
        for argv in runs {
            let out = std::process::Command::new(BRIDGE)
                .args(&argv)
                .env("CUBE_CSI_BRIDGE_CONFIG", &w.config_path)
                .env("RUST_LOG", "debug")
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            assert_eq!(out.status.code(), Some(78), "{argv:?}: {stdout} {stderr}");
            assert!(
                format!("{stdout}{stderr}").contains("line "),
                "{argv:?}: the position is reported: {stdout} {stderr}"
            );
            assert!(
                !stdout.contains("hunter2") && !stderr.contains("hunter2"),
                "{argv:?} leaked: {stdout} {stderr}"
            );
        }
    }
}

// ---------------------------------------------------------------- Kubernetes mode

/// A StorageClass's Secrets (all four families) and mountOptions, read by bridges running
/// as the chart's ServiceAccounts against a real kube-apiserver, echoed by the driver.
#[tokio::test(flavor = "multi_thread")]
async fn storage_class_secrets_echoed_by_the_driver_reach_no_error_or_log() {
    use common::k8s::{ApiServer, CHART_DIR};
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
    use k8s_openapi::api::storage::v1::StorageClass;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::api::{Api, ListParams, PostParams};

    let bin = require_k8s_peers!();
    const NAMESPACE: &str = "cube-system";
    const CLASS: &str = "echo-class";
    let secrets = [
        ("prov-creds", "provisioner", "SC-PROV-SECRET-1"),
        ("ctrl-creds", "controller-publish", "SC-CTRL-SECRET-2"),
        ("stage-creds", "node-stage", "SC-STAGE-SECRET-3"),
        ("publish-creds", "node-publish", "SC-PUBLISH-SECRET-4"),
    ];
    let leaks = [
        "SC-PROV-SECRET-1",
        "SC-CTRL-SECRET-2",
        "SC-STAGE-SECRET-3",
        "SC-PUBLISH-SECRET-4",
        "SC-FLAG-SECRET-5",
    ];
    let api = ApiServer::start(&bin);
    let values = serde_json::json!({
        "driver": common::DRIVER,
        "kubernetes": {
            "storageClass": CLASS,
            "secrets": [{"namespace": "default", "names": secrets.map(|s| s.0)}],
        },
    });
    let values_path = api.dir.path().join("values.json");
    std::fs::write(&values_path, values.to_string()).unwrap();
    let (ok, out) = api.helm(&[
        "install",
        "echo",
        CHART_DIR,
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "-f",
        values_path.to_str().unwrap(),
    ]);
    assert!(ok, "helm install: {out}");
    let admin = api.admin().await;
    for (name, _, value) in secrets {
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(
                "password".to_string(),
                ByteString(value.as_bytes().to_vec()),
            )])),
            ..Default::default()
        };
        Api::<Secret>::namespaced(admin.clone(), "default")
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
    }
    let mut parameters = BTreeMap::from([("server".to_string(), "10.0.0.5".to_string())]);
    for (name, family, _) in secrets {
        parameters.insert(
            format!("csi.storage.k8s.io/{family}-secret-name"),
            name.into(),
        );
        parameters.insert(
            format!("csi.storage.k8s.io/{family}-secret-namespace"),
            "default".into(),
        );
    }
    let class = StorageClass {
        metadata: ObjectMeta {
            name: Some(CLASS.into()),
            ..Default::default()
        },
        provisioner: "fake.csi.test".into(),
        parameters: Some(parameters),
        mount_options: Some(vec![
            "nfsvers=4.1".into(),
            "password=SC-FLAG-SECRET-5".into(),
        ]),
        reclaim_policy: Some("Delete".into()),
        ..Default::default()
    };
    Api::<StorageClass>::all(admin.clone())
        .create(&PostParams::default(), &class)
        .await
        .unwrap();
    let accounts = Api::<ServiceAccount>::namespaced(admin.clone(), NAMESPACE)
        .list(&ListParams::default().labels("app.kubernetes.io/instance=echo"))
        .await
        .unwrap();
    let account = |side: &str| {
        accounts
            .items
            .iter()
            .filter_map(|a| a.metadata.name.clone())
            .find(|n| n.ends_with(&format!("-{side}")))
            .unwrap()
    };
    let kubernetes_mode = |kubeconfig: &Path, services: &str| {
        let section = format!(
            "\n[kubernetes]\nkubeconfig = \"{}\"\nnamespace = \"{NAMESPACE}\"\nstorage_class = \"{CLASS}\"\n",
            kubeconfig.display()
        );
        let services = format!("[serve]\nservices = \"{services}\"\n");
        move |text: String| {
            let text = text
                .replacen(
                    "[state]\n",
                    "[state]\ncontroller_store = \"kubernetes\"\n",
                    1,
                )
                .replacen("[serve]\n", &services, 1);
            format!("{text}{section}")
        }
    };
    let controller_kubeconfig = api
        .service_account_kubeconfig(NAMESPACE, &account("controller"))
        .await;
    let node_kubeconfig = api
        .service_account_kubeconfig(NAMESPACE, &account("node"))
        .await;

    for mode in MODES {
        let (controller, echo, _stop) = echo_world(
            mode,
            "",
            kubernetes_mode(&controller_kubeconfig, "controller"),
        )
        .await;
        let volume = format!("sc-vol-{mode:?}").to_lowercase();
        echo.echo_only(&["CreateVolume"]);
        let err = controller
            .create(&volume)
            .await
            .expect_err("echoing create");
        assert_scrubbed(
            &format!("{mode:?} create"),
            &err.message,
            "CreateVolume",
            &leaks,
        );
        echo.echo_only(&[]);
        let created = controller.create(&volume).await.expect("create");

        let (node, node_echo, _node_stop) =
            echo_world(mode, "", kubernetes_mode(&node_kubeconfig, "node")).await;
        for call in [
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
        ] {
            node_echo.echo_only(&[call]);
            let err = node
                .attach("sb-1", &volume, 0, &created.private_data)
                .await
                .expect_err("echoing attach");
            assert_scrubbed(&format!("{mode:?} {call}"), &err.message, call, &leaks);
        }

        echo.echo_only(&["DeleteVolume"]);
        let err = controller
            .destroy(&volume)
            .await
            .expect_err("echoing destroy");
        assert_scrubbed(
            &format!("{mode:?} destroy"),
            &err.message,
            "DeleteVolume",
            &leaks,
        );
        echo.echo_only(&[]);
        controller.destroy(&volume).await.expect("destroy");

        assert_logs_clean(
            &format!("{mode:?} controller logs"),
            &controller.logs(),
            &leaks,
        );
        assert_logs_clean(&format!("{mode:?} node logs"), &node.logs(), &leaks);
    }
}
