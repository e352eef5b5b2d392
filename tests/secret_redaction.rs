//! Secrets never leave the bridge in an error: the fake CSI driver scripted to echo its
//! whole request (every secret, every mount flag) in its error messages, fed secrets from every place a
//! secret can live — the config's `[secrets]` (all four families), `volume.mount_flags`,
//! and (Kubernetes mode) a StorageClass's Secrets and mountOptions — must not get one of
//! them into a gRPC status, a binary hook's stdout or stderr, or a log line, over both
//! transports. A config whose broken line holds a secret is covered for every command.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::fake_driver::{Behavior, Caps, FakeDriver};
use common::{BRIDGE, MODES, Mode, World};
use tonic::Code;

// ---------------------------------------------------------------- harness

/// The next call of `method` fails with a message quoting its request's secrets and mount
/// flags, as careless drivers do ([`Behavior::FailEchoing`]); every other call is served
/// as usual.
fn echo_next(driver: &FakeDriver, method: &'static str) {
    driver.script(method, [Behavior::FailEchoing(Code::InvalidArgument)]);
}

/// A world whose config is `extra` on top of the test defaults and whose fake driver
/// advertises every step. With `shared_data`, the driver is one on that data directory
/// (the storage a controller-side world's driver created the volumes on).
async fn echo_world(
    mode: Mode,
    extra: &str,
    edit: impl FnOnce(String) -> String,
    shared_data: Option<&Path>,
) -> (World, FakeDriver) {
    let mut w = World::start_with_config(Mode::Binary, Caps::all_steps(), extra, edit).await;
    // It holds secrets: private, or the bridge refuses it.
    std::fs::set_permissions(&w.config_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    if let Some(data) = shared_data {
        if let Some(fake) = w.driver_server.take() {
            fake.stop().await;
        }
        w.driver = FakeDriver::new(Caps::all_steps(), data);
        w.driver_server = Some(w.driver.serve(&w.dir.path().join("csi.sock")));
    }
    if mode == Mode::Rpc {
        w.mode = Mode::Rpc;
        w.start_daemon().await.unwrap();
    }
    let driver = w.driver.clone();
    (w, driver)
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
        let (w, echo) = echo_world(mode, CONFIG_SECRETS, |t| t, None).await;
        let what = |step: &str| format!("{mode:?} {step}");

        echo_next(&echo, "CreateVolume");
        let err = w.create("sec-vol").await.expect_err("echoing CreateVolume");
        assert_scrubbed(
            &what("create"),
            &err.message,
            "CreateVolume",
            &CONFIG_SECRET_VALUES,
        );

        let created = w.create("sec-vol").await.expect("create");
        for call in [
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
        ] {
            echo_next(&echo, call);
            let err = w
                .attach("sb-1", "sec-vol", 0, &created.private_data)
                .await
                .expect_err("echoing attach");
            assert_scrubbed(&what(call), &err.message, call, &CONFIG_SECRET_VALUES);
        }
        assert!(
            echo.mutating_calls().contains(&"NodeUnstageVolume"),
            "rolled back"
        );

        echo_next(&echo, "DeleteVolume");
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
        // A quote in the secret: serde escapes it, which must not end the redaction.
        format!("{good}\n[secrets]\nnode_publish = 'pw\"hunter2-SECRET'\n"),
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
        let (controller, echo) = echo_world(
            mode,
            "",
            kubernetes_mode(&controller_kubeconfig, "controller"),
            None,
        )
        .await;
        let volume = format!("sc-vol-{mode:?}").to_lowercase();
        echo_next(&echo, "CreateVolume");
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
        let created = controller.create(&volume).await.expect("create");

        // The node's driver sees the storage the controller's driver created the volume on.
        let storage = controller.dir.path().join("driver-data");
        let (node, node_echo) = echo_world(
            mode,
            "",
            kubernetes_mode(&node_kubeconfig, "node"),
            Some(&storage),
        )
        .await;
        for call in [
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
        ] {
            echo_next(&node_echo, call);
            let err = node
                .attach("sb-1", &volume, 0, &created.private_data)
                .await
                .expect_err("echoing attach");
            assert_scrubbed(&format!("{mode:?} {call}"), &err.message, call, &leaks);
        }

        echo_next(&echo, "DeleteVolume");
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
        controller.destroy(&volume).await.expect("destroy");

        assert_logs_clean(
            &format!("{mode:?} controller logs"),
            &controller.logs(),
            &leaks,
        );
        assert_logs_clean(&format!("{mode:?} node logs"), &node.logs(), &leaks);
    }
}
