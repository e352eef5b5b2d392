//! Kubernetes mode against a real kube-apiserver + etcd (tests/common/k8s.rs): the Helm
//! chart installs into the server (its CRD, RBAC and workloads all accepted), the bridge
//! runs with the token of the chart's ServiceAccount (so the chart's RBAC is exactly
//! enough), reuses a StorageClass and its Secrets as csi-driver-nfs users write them, and
//! keeps controller state in CubeVolume objects that another bridge instance can use.
//!
//! Needs `CUBE_CSI_BRIDGE_K8S_BIN` (the last line of scripts/install-k8s-peers.sh);
//! skips without it. The attach part needs root (real mounts) and is skipped without.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::csi_mock::{MOCK_NAME, MockDriver, MockOptions};
use common::fake_driver::{Call, Caps};
use common::k8s::{ApiServer, CHART_DIR};
use common::{Mode, World};
use cube_csi_bridge::k8s::volumes::object_name;
use cube_csi_bridge::k8s::{CRD_GROUP, CRD_KIND, CRD_PLURAL, CRD_VERSION};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};

const NAMESPACE: &str = "cube-system";
const RELEASE: &str = "ccb";
/// What the fake CSI driver calls itself (GetPluginInfo).
const FAKE_PROVISIONER: &str = "fake.csi.test";
const CLASS: &str = "fake-nfs";
const PROVISIONER_SECRET: (&str, &str) = ("password", "prov-s3cret-4711");
const MOUNT_SECRET: (&str, &str) = ("mountpassword", "mount-s3cret-0815");
const MOUNT_OPTIONS: [&str; 2] = ["nfsvers=4.1", "hard"];

fn cube_volumes(client: kube::Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(CRD_GROUP, CRD_VERSION, CRD_KIND);
    let resource = ApiResource::from_gvk_with_plural(&gvk, CRD_PLURAL);
    Api::namespaced_with(client, NAMESPACE, &resource)
}

async fn create_secret(client: &kube::Client, name: &str, (key, value): (&str, &str)) {
    let api: Api<Secret> = Api::namespaced(client.clone(), "default");
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            key.to_string(),
            ByteString(value.as_bytes().to_vec()),
        )])),
        ..Default::default()
    };
    api.create(&PostParams::default(), &secret).await.unwrap();
}

async fn create_class(
    client: &kube::Client,
    name: &str,
    provisioner: &str,
    parameters: &[(&str, &str)],
) {
    let api: Api<StorageClass> = Api::all(client.clone());
    let class = StorageClass {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        provisioner: provisioner.into(),
        parameters: Some(
            parameters
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        mount_options: Some(MOUNT_OPTIONS.iter().map(|s| s.to_string()).collect()),
        reclaim_policy: Some("Delete".into()),
        ..Default::default()
    };
    api.create(&PostParams::default(), &class).await.unwrap();
}

/// A StorageClass as a csi-driver-nfs user writes one, with its Secrets.
async fn nfs_style_class(client: &kube::Client) {
    create_secret(client, "prov-creds", PROVISIONER_SECRET).await;
    create_secret(client, "mount-creds", MOUNT_SECRET).await;
    create_class(
        client,
        CLASS,
        FAKE_PROVISIONER,
        &[
            ("server", "nfs-server.default.svc.cluster.local"),
            ("share", "/exports"),
            ("subDir", "cube"),
            ("csi.storage.k8s.io/provisioner-secret-name", "prov-creds"),
            ("csi.storage.k8s.io/provisioner-secret-namespace", "default"),
            ("csi.storage.k8s.io/node-publish-secret-name", "mount-creds"),
            (
                "csi.storage.k8s.io/node-publish-secret-namespace",
                "default",
            ),
            ("csi.storage.k8s.io/fstype", "nfs"),
        ],
    )
    .await;
}

/// `helm install`s the chart with these values files (none: its defaults); panics with
/// helm's words on failure, else returns what helm printed (the NOTES among it).
fn helm_install(api: &ApiServer, release: &str, namespace: &str, values: &[&Path]) -> String {
    let mut args = vec![
        "install",
        release,
        CHART_DIR,
        "--namespace",
        namespace,
        "--create-namespace",
    ];
    for file in values {
        args.extend(["-f", file.to_str().unwrap()]);
    }
    let (ok, out) = api.helm(&args);
    assert!(ok, "helm install {release} failed:\n{out}");
    out
}

/// Installs the chart with `values` as the tests deploy it.
fn install_chart(api: &ApiServer, release: &str, namespace: &str, values: &serde_json::Value) {
    let values_path = api.dir.path().join(format!("{release}-values.json"));
    std::fs::write(&values_path, serde_json::to_vec(values).unwrap()).unwrap();
    helm_install(api, release, namespace, &[&values_path]);
}

/// The ServiceAccount the chart made for one side (`node`, `controller`) of a release.
async fn chart_service_account(client: &kube::Client, release: &str, side: &str) -> String {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    let accounts = api
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/instance={release}")))
        .await
        .unwrap();
    let names: Vec<String> = accounts
        .items
        .into_iter()
        .filter_map(|a| a.metadata.name)
        .collect();
    names
        .iter()
        .find(|n| n.ends_with(&format!("-{side}")))
        .unwrap_or_else(|| panic!("no {side} ServiceAccount among {names:?}"))
        .clone()
}

/// Serves only one side, as the chart's pods do.
fn serving(services: &str) -> impl FnOnce(String) -> String {
    let line = format!("[serve]\nservices = \"{services}\"\n");
    move |text: String| text.replacen("[serve]\n", &line, 1)
}

/// Bridge config lines for Kubernetes mode with this kubeconfig and StorageClass.
fn kubernetes_mode(kubeconfig: &Path, class: &str) -> impl FnOnce(String) -> String {
    let section = format!(
        "\n[kubernetes]\nkubeconfig = \"{}\"\nnamespace = \"{NAMESPACE}\"\nstorage_class = \"{class}\"\n",
        kubeconfig.display()
    );
    move |text: String| {
        let text = text.replacen(
            "[state]\n",
            "[state]\ncontroller_store = \"kubernetes\"\n",
            1,
        );
        format!("{text}{section}")
    }
}

/// Points a second bridge at the first one's CSI driver (one driver, two replicas).
fn share_driver(of: &World) -> impl FnOnce(String) -> String + use<> {
    driver_at(&of.dir.path().join("csi.sock"))
}

/// Points a bridge at the CSI driver listening on `socket`.
fn driver_at(socket: &Path) -> impl FnOnce(String) -> String + use<> {
    let socket = format!("endpoint = \"unix://{}\"", socket.display());
    move |text: String| {
        let start = text.find("endpoint = ").unwrap();
        let end = start + text[start..].find('\n').unwrap();
        format!("{}{socket}{}", &text[..start], &text[end..])
    }
}

fn mutating(calls: &[Call], method: &str) -> Vec<Call> {
    calls
        .iter()
        .filter(|c| c.method == method)
        .cloned()
        .collect()
}

fn secret_map((k, v): (&str, &str)) -> BTreeMap<String, String> {
    BTreeMap::from([(k.to_string(), v.to_string())])
}

#[tokio::test(flavor = "multi_thread")]
async fn storage_class_reuse_and_crd_store_shared_by_two_bridges() {
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    let admin = api.admin().await;

    install_chart(
        &api,
        RELEASE,
        NAMESPACE,
        &serde_json::json!({
            "driver": common::DRIVER,
            "kubernetes": {
                "storageClass": CLASS,
                "secrets": [
                    {"namespace": "default", "names": ["prov-creds"], "usedBy": ["controller"]},
                    {"namespace": "default", "names": ["mount-creds"], "usedBy": ["node"]},
                ],
            },
        }),
    );
    nfs_style_class(&admin).await;
    let account = chart_service_account(&admin, RELEASE, "controller").await;
    let kubeconfig = api.service_account_kubeconfig(NAMESPACE, &account).await;

    // Replica A creates; the bridge runs as the chart's controller ServiceAccount.
    let a = World::start_with_config(Mode::Rpc, Caps::default(), "", |text| {
        serving("controller")(kubernetes_mode(&kubeconfig, CLASS)(text))
    })
    .await;
    let created = a.create("vol-k8s-1").await.expect("create");
    let calls = a.driver.calls();
    let create_calls = mutating(&calls, "CreateVolume");
    assert_eq!(create_calls.len(), 1, "{calls:?}");
    let create = &create_calls[0];
    assert_eq!(
        create.parameters,
        BTreeMap::from([
            (
                "server".to_string(),
                "nfs-server.default.svc.cluster.local".to_string()
            ),
            ("share".to_string(), "/exports".to_string()),
            ("subDir".to_string(), "cube".to_string()),
        ]),
        "csi.storage.k8s.io/ parameters are consumed and stripped"
    );
    assert_eq!(create.secrets, secret_map(PROVISIONER_SECRET));
    assert_eq!(create.mount_flags, MOUNT_OPTIONS.map(String::from).to_vec());

    let handle: serde_json::Value = serde_json::from_str(&created.private_data).unwrap();
    let csi_volume_id = handle["id"].as_str().unwrap().to_string();
    let volumes = cube_volumes(admin.clone());
    let object = volumes
        .get(&object_name(common::DRIVER, "vol-k8s-1"))
        .await
        .expect("a CubeVolume for the created volume");
    assert_eq!(object.data["spec"]["csiVolumeId"], csi_volume_id.as_str());
    assert_eq!(object.data["spec"]["state"], "Created");
    assert_eq!(object.data["spec"]["volumeId"], "vol-k8s-1");
    assert_eq!(object.data["spec"]["csiDriver"], FAKE_PROVISIONER);

    // The same Create again (Cube retries) is answered from the same record.
    let again = a.create("vol-k8s-1").await.expect("repeated create");
    assert_eq!(again.private_data, created.private_data);

    // Replica B: its own state dir and locks, the same driver, a forked hook.
    let b = World::start_with_config(Mode::Binary, Caps::default(), "", |text| {
        serving("controller")(share_driver(&a)(kubernetes_mode(&kubeconfig, CLASS)(text)))
    })
    .await;
    a.driver.clear_calls();
    b.destroy("vol-k8s-1")
        .await
        .expect("destroy by the other replica");
    let calls = a.driver.calls();
    let deletes = mutating(&calls, "DeleteVolume");
    assert_eq!(deletes.len(), 1, "{calls:?}");
    assert_eq!(deletes[0].volume_id, csi_volume_id);
    assert_eq!(deletes[0].secrets, secret_map(PROVISIONER_SECRET));
    let gone = volumes
        .get_opt(&object_name(common::DRIVER, "vol-k8s-1"))
        .await
        .unwrap();
    assert!(gone.is_none(), "the CubeVolume is deleted: {gone:?}");
    // Destroying it again (Cube retries) is success and calls nothing.
    a.driver.clear_calls();
    b.destroy("vol-k8s-1").await.expect("repeated destroy");
    assert!(mutating(&a.driver.calls(), "DeleteVolume").is_empty());

    // Two replicas creating one volume at once meet on one object and one handle.
    let (x, y) = tokio::join!(a.create("vol-k8s-race"), b.create("vol-k8s-race"));
    let (x, y) = (x.expect("replica A"), y.expect("replica B"));
    assert_eq!(x.private_data, y.private_data);
    let listed = volumes.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1, "{:?}", listed.items);

    // With root: a node-side bridge, as the chart's node ServiceAccount, gives Attach
    // the StorageClass's mount options and node-publish secret.
    let node_account = chart_service_account(&admin, RELEASE, "node").await;
    let node_kubeconfig = api
        .service_account_kubeconfig(NAMESPACE, &node_account)
        .await;
    if nix::unistd::Uid::effective().is_root() {
        let node = World::start_with_config(Mode::Rpc, Caps::default(), "", |text| {
            serving("node")(share_driver(&a)(kubernetes_mode(&node_kubeconfig, CLASS)(
                text,
            )))
        })
        .await;
        a.driver.clear_calls();
        let attached = node
            .attach("sandbox-1", "vol-k8s-race", 0, &x.private_data)
            .await
            .expect("attach");
        let calls = a.driver.calls();
        let publishes = mutating(&calls, "NodePublishVolume");
        assert_eq!(publishes.len(), 1, "{calls:?}");
        assert_eq!(publishes[0].secrets, secret_map(MOUNT_SECRET));
        assert_eq!(
            publishes[0].mount_flags,
            MOUNT_OPTIONS.map(String::from).to_vec()
        );
        node.detach("sandbox-1", "vol-k8s-race", 0, &attached.metadata)
            .await
            .expect("detach");
        assert!(node.mounts().is_empty());
        let logs = node.logs();
        for secret in [MOUNT_SECRET.1, "nfsvers=4.1"] {
            assert!(
                !logs.contains(secret),
                "node side logged {secret:?}: {logs}"
            );
        }
    } else {
        common::skip("the attach part makes real mounts and needs root");
    }
    b.destroy("vol-k8s-race").await.expect("destroy");
    assert!(
        volumes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // A created volume recorded how to delete it, as a PersistentVolume does: Destroy
    // still works once its StorageClass is gone.
    let kept = a.create("vol-k8s-orphan").await.expect("create");
    let kept_id = serde_json::from_str::<serde_json::Value>(&kept.private_data).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let object = volumes
        .get(&object_name(common::DRIVER, "vol-k8s-orphan"))
        .await
        .unwrap();
    assert_eq!(object.data["spec"]["reclaimPolicy"], "Delete");
    assert_eq!(
        object.data["spec"]["provisionerSecretRef"],
        serde_json::json!({"namespace": "default", "name": "prov-creds"})
    );
    Api::<StorageClass>::all(admin.clone())
        .delete(CLASS, &Default::default())
        .await
        .unwrap();
    a.driver.clear_calls();
    b.destroy("vol-k8s-orphan")
        .await
        .expect("destroy after the StorageClass was deleted");
    let deletes = mutating(&a.driver.calls(), "DeleteVolume");
    assert_eq!(deletes.len(), 1);
    assert_eq!(deletes[0].volume_id, kept_id);
    assert_eq!(deletes[0].secrets, secret_map(PROVISIONER_SECRET));

    // No secret value, and not the API token, reached any log line of either replica.
    let kubeconfig_json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&kubeconfig).unwrap()).unwrap();
    let token = kubeconfig_json["users"][0]["user"]["token"]
        .as_str()
        .unwrap()
        .to_string();
    for (name, world) in [("A", &a), ("B", &b)] {
        let logs = world.logs();
        assert!(logs.contains("vol-k8s-1"), "replica {name} logged: {logs}");
        for secret in [PROVISIONER_SECRET.1, MOUNT_SECRET.1, "nfsvers=4.1", &token] {
            assert!(
                !logs.contains(secret),
                "replica {name} logged {secret:?}: {logs}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn unusable_storage_classes_are_refused_before_anything_changes() {
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    let admin = api.admin().await;
    // The chart with its defaults, for its CRD; the bridges below run as admin.
    helm_install(&api, "defaults", NAMESPACE, &[]);
    create_class(
        &admin,
        "typo",
        FAKE_PROVISIONER,
        &[("csi.storage.k8s.io/provisioner-secret-nam", "x")],
    )
    .await;
    create_class(&admin, "other-driver", "nfs.csi.k8s.io", &[]).await;

    for (class, expected) in [
        ("typo", "csi.storage.k8s.io/provisioner-secret-nam"),
        ("other-driver", "nfs.csi.k8s.io"),
        ("missing", "does not exist"),
    ] {
        let world = World::start_with_config(
            Mode::Binary,
            Caps::default(),
            "",
            kubernetes_mode(&api.kubeconfig, class),
        )
        .await;
        let err = world.create("vol-bad").await.expect_err(class);
        assert!(
            err.message.contains(expected) && err.message.contains("StorageClass"),
            "{class}: {}",
            err.message
        );
        assert!(
            mutating(&world.driver.calls(), "CreateVolume").is_empty(),
            "{class}: no CreateVolume"
        );
        let listed = cube_volumes(admin.clone())
            .list(&ListParams::default())
            .await
            .unwrap();
        assert!(listed.items.is_empty(), "{class}: no CubeVolume written");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn chart_examples_install_into_a_real_api_server() {
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    for (release, example) in [
        ("nfs", "values-nfs.yaml"),
        ("hostpath", "values-hostpath.yaml"),
    ] {
        let values = Path::new(CHART_DIR).join("examples").join(example);
        let namespace = format!("cube-{release}");
        let out = helm_install(&api, release, &namespace, &[&values]);
        // NOTES.txt: the Cube entries for this release, ready to paste.
        for entry in [
            "volume_plugins:\n  - name: ",
            "type: rpc\n    socket_path: /run/cube-csi-bridge/",
            "[[plugins.\"io.cubelet.internal.v1.storage\".volume_plugins]]",
            "socket_path = \"/run/cube-csi-bridge/",
        ] {
            assert!(
                out.contains(entry),
                "{example}: NOTES lack {entry:?}:\n{out}"
            );
        }
        let (ok, out) = api.helm(&["get", "manifest", release, "--namespace", &namespace]);
        assert!(ok, "{out}");
        for kind in [
            "DaemonSet",
            "ConfigMap",
            "ServiceAccount",
            "Role",
            "RoleBinding",
        ] {
            assert!(
                out.contains(&format!("kind: {kind}")),
                "{example} renders a {kind}:\n{out}"
            );
        }
    }
    // The CRD came from the chart's crds/ and is served.
    let admin = api.admin().await;
    cube_volumes(admin)
        .list(&ListParams::default())
        .await
        .expect("the CubeVolume resource is served");
}

#[tokio::test(flavor = "multi_thread")]
async fn cubevolume_store_refuses_stale_writes() {
    use cube_csi_bridge::bridge::ports::{ControllerStore, StoreError};
    use cube_csi_bridge::bridge::records::{VolumeRecord, VolumeState};
    use cube_csi_bridge::config::KubernetesSettings;
    use cube_csi_bridge::k8s::{CubeVolumeStore, Kube};
    use std::sync::Arc;

    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    helm_install(&api, "defaults", NAMESPACE, &[]);
    let settings = KubernetesSettings {
        kubeconfig: Some(api.kubeconfig.clone()),
        namespace: Some(NAMESPACE.into()),
        ..Default::default()
    };
    // Two replicas: separate clients, one namespace.
    let one = CubeVolumeStore::new(Arc::new(Kube::new(&settings)), "nfs");
    let two = CubeVolumeStore::new(Arc::new(Kube::new(&settings)), "nfs");
    let mut record = VolumeRecord {
        volume_id: "v1".into(),
        csi_name: "cube-v1".into(),
        csi_driver: Some("nfs.csi.k8s.io".into()),
        state: VolumeState::Creating,
        csi_volume_id: None,
        volume_context: Default::default(),
        capacity_bytes: 0,
        updated_at: 1,
        deletion: None,
        revision: None,
        integrity: None,
        content_source: None,
        accessible_topology: vec![[("example.com/zone".to_string(), "a".to_string())].into()],
        node_expansion_required: false,
        answering_creates: Vec::new(),
    };
    one.put(&mut record).await.expect("create");
    let created_at = record.revision.clone().expect("a resourceVersion");

    // The second replica also tries to create it: it must learn it lost.
    let mut rival = record.clone();
    rival.revision = None;
    assert!(matches!(
        two.put(&mut rival).await,
        Err(StoreError::Conflict { .. })
    ));

    // It reads, updates, and the first replica's copy is now stale.
    let mut read = two
        .get("v1")
        .await
        .unwrap()
        .expect("visible to the other replica");
    assert_eq!(read.revision.as_deref(), Some(created_at.as_str()));
    assert_eq!(
        read.accessible_topology, record.accessible_topology,
        "the accessible topology is kept in the CubeVolume"
    );
    read.state = VolumeState::Created;
    read.csi_volume_id = Some("handle-1".into());
    read.answering_creates = vec!["a1-0".into(), "b2-3".into()];
    two.put(&mut read)
        .await
        .expect("update at the read version");
    assert_eq!(
        one.get("v1").await.unwrap().unwrap().answering_creates,
        read.answering_creates,
        "the Creates answering with the volume are kept (an annotation)"
    );
    record.state = VolumeState::Created;
    record.csi_volume_id = Some("handle-2".into());
    assert!(matches!(
        one.put(&mut record).await,
        Err(StoreError::Conflict { .. })
    ));
    assert!(matches!(
        one.delete(&record).await,
        Err(StoreError::Conflict { .. })
    ));
    let current = one.get("v1").await.unwrap().unwrap();
    assert_eq!(current.csi_volume_id.as_deref(), Some("handle-1"));
    assert_eq!(one.list().await.unwrap().len(), 1);
    assert!(
        two.list()
            .await
            .unwrap()
            .iter()
            .all(|r| r.volume_id == "v1")
    );

    // Deleting at the current version works; deleting again is success.
    one.delete(&current).await.expect("delete");
    one.delete(&current).await.expect("already gone");
    assert!(two.get("v1").await.unwrap().is_none());
    // Replacing the deleted object is a lost race too.
    let mut stale = current.clone();
    assert!(matches!(
        one.put(&mut stale).await,
        Err(StoreError::Conflict { .. })
    ));

    // Without the CRD the API server answers 404 for the resource, not the object: that
    // must not read as "no record" (Destroy would answer success having deleted nothing).
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: Api<CustomResourceDefinition> = Api::all(api.admin().await);
    crds.delete(&format!("{CRD_PLURAL}.{CRD_GROUP}"), &Default::default())
        .await
        .expect("delete the CRD");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let error = loop {
        match two.get("v1").await {
            Err(e) => break e,
            Ok(found) => {
                assert!(found.is_none());
                assert!(
                    std::time::Instant::now() < deadline,
                    "still read as absent 30s after the CRD was deleted"
                );
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    };
    assert!(
        error
            .to_string()
            .contains("CustomResourceDefinition installed"),
        "{error}"
    );
    assert!(!matches!(
        one.delete(&current).await,
        Ok(()) | Err(StoreError::Conflict { .. })
    ));
    let mut stale = current.clone();
    assert!(!matches!(
        one.put(&mut stale).await,
        Ok(()) | Err(StoreError::Conflict { .. })
    ));
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_csi_mock_driver_behind_two_bridges() {
    let bin = require_k8s_peers!();
    let peers = require_csi_mock!();
    let api = ApiServer::start(&bin);
    let admin = api.admin().await;
    install_chart(
        &api,
        RELEASE,
        NAMESPACE,
        &serde_json::json!({
            "driver": "mock",
            "node": {"enabled": false},
            "kubernetes": {
                "storageClass": "mock-nfs",
                "secrets": [{"namespace": "default", "names": ["prov-creds"]}],
            },
        }),
    );
    create_secret(&admin, "prov-creds", PROVISIONER_SECRET).await;
    create_class(
        &admin,
        "mock-nfs",
        MOCK_NAME,
        &[
            ("server", "nfs-server.default.svc.cluster.local"),
            ("share", "/exports"),
            ("csi.storage.k8s.io/provisioner-secret-name", "prov-creds"),
            ("csi.storage.k8s.io/provisioner-secret-namespace", "default"),
        ],
    )
    .await;
    let account = chart_service_account(&admin, RELEASE, "controller").await;
    let kubeconfig = api.service_account_kubeconfig(NAMESPACE, &account).await;
    let mock = MockDriver::start(
        &peers,
        api.dir.path(),
        &MockOptions {
            disable_attach: true,
            ..MockOptions::default()
        },
    );
    let bridge = |mode| {
        let (kubeconfig, socket) = (kubeconfig.clone(), mock.socket.clone());
        World::start_with_config(mode, Caps::default(), "", move |text| {
            let text = text.replacen("driver = \"fake\"", "driver = \"mock\"", 1);
            serving("controller")(driver_at(&socket)(
                kubernetes_mode(&kubeconfig, "mock-nfs")(text),
            ))
        })
    };
    let a = bridge(Mode::Rpc).await;
    let b = bridge(Mode::Binary).await;

    let created = a
        .create("vol-mock-1")
        .await
        .expect("create through the mock driver");
    let handle: serde_json::Value = serde_json::from_str(&created.private_data).unwrap();
    let csi_volume_id = handle["id"].as_str().unwrap().to_string();
    let creates = mock.requests("CreateVolume");
    assert_eq!(creates.len(), 1, "{creates:?}");
    assert!(
        creates[0]["name"]
            .as_str()
            .is_some_and(|name| common::is_name_of_a_create(name, "cube-vol-mock-1")),
        "{creates:?}"
    );
    assert_eq!(
        creates[0]["parameters"],
        serde_json::json!({"server": "nfs-server.default.svc.cluster.local", "share": "/exports"})
    );
    assert_eq!(
        creates[0]["secrets"],
        serde_json::json!({PROVISIONER_SECRET.0: PROVISIONER_SECRET.1})
    );
    let object = cube_volumes(admin.clone())
        .get(&object_name("mock", "vol-mock-1"))
        .await
        .expect("a CubeVolume");
    assert_eq!(object.data["spec"]["csiVolumeId"], csi_volume_id.as_str());
    assert_eq!(object.data["spec"]["csiDriver"], MOCK_NAME);

    b.destroy("vol-mock-1")
        .await
        .expect("destroy by the other replica");
    let deletes = mock.requests("DeleteVolume");
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(deletes[0]["volume_id"], csi_volume_id.as_str());
    assert_eq!(
        deletes[0]["secrets"],
        serde_json::json!({PROVISIONER_SECRET.0: PROVISIONER_SECRET.1})
    );
    assert!(
        cube_volumes(admin)
            .get_opt(&object_name("mock", "vol-mock-1"))
            .await
            .unwrap()
            .is_none()
    );
}

/// The StorageClass test once more (was `real_nfsplugin_behind_a_storage_class_…`), with
/// the chart installed from its own csi-driver-nfs example, the StorageClass written as
/// csi-driver-nfs documents it (`server`, `share`, mountOptions, and the provisioner
/// secret whose `mountOptions` csi-driver-nfs reads in DeleteVolume), and behind it the
/// fake in csi-driver-nfs's shape under csi-driver-nfs's name (no staging, the share
/// mounted by CreateVolume and DeleteVolume): Create → Attach → Detach → Destroy, with a
/// real mount seen in the simulated Cubelet namespace.
#[tokio::test(flavor = "multi_thread")]
async fn nfs_like_driver_behind_a_storage_class_as_csi_driver_nfs_documents_it() {
    use common::cube_peers::{BaseDir, CubeletNs};
    use common::fake_driver::FakeDriver;
    use cube_csi_bridge::mount::MountTable;

    const SERVER: &str = "nfs-server.default.svc.cluster.local";
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    let admin = api.admin().await;
    helm_install(
        &api,
        "cube-nfs",
        NAMESPACE,
        &[&Path::new(CHART_DIR).join("examples/values-nfs.yaml")],
    );
    create_secret(&admin, "mount-options", ("mountOptions", "nfsvers=4.1")).await;
    let class: StorageClass = serde_json::from_value(serde_json::json!({
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": "nfs-csi"},
        "provisioner": "nfs.csi.k8s.io",
        "parameters": {
            "server": SERVER,
            "share": "/",
            "csi.storage.k8s.io/provisioner-secret-name": "mount-options",
            "csi.storage.k8s.io/provisioner-secret-namespace": "default",
        },
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
        "allowVolumeExpansion": true,
        "mountOptions": ["nfsvers=4.1"],
    }))
    .unwrap();
    Api::<StorageClass>::all(admin.clone())
        .create(&PostParams::default(), &class)
        .await
        .unwrap();
    let controller_kubeconfig = api
        .service_account_kubeconfig(
            NAMESPACE,
            &chart_service_account(&admin, "cube-nfs", "controller").await,
        )
        .await;
    let node_kubeconfig = api
        .service_account_kubeconfig(
            NAMESPACE,
            &chart_service_account(&admin, "cube-nfs", "node").await,
        )
        .await;

    // The backend, the node's shared base dir and Cubelet namespace, and the driver
    // (dropped in reverse: the driver, then the namespace and every mount).
    let dir = tempfile::Builder::new()
        .prefix("ccb-k8s-nfs-")
        .tempdir()
        .unwrap();
    let base = dir.path().join("volumes");
    let ns_dir = tempfile::Builder::new()
        .prefix("ccb-cubelet-")
        .tempdir()
        .unwrap();
    let cubelet = CubeletNs::start(ns_dir, &base, BaseDir::Shared);
    let driver = FakeDriver::named(
        Caps::nfs_like(),
        &dir.path().join("backend"),
        "nfs.csi.k8s.io",
        "node-1",
    );
    let socket = dir.path().join("nfs.sock");
    let _driver_server = driver.serve(&socket);
    let nsfile = cubelet.nsfile().display().to_string();
    let bridge = |mode, services, kubeconfig: &Path| {
        let (kubeconfig, socket, nsfile, base_dir) = (
            kubeconfig.to_path_buf(),
            socket.clone(),
            nsfile.clone(),
            base.display().to_string(),
        );
        World::start_with_config(mode, Caps::default(), "", move |text| {
            // Attach names the simulated Cubelet's base dir: the bridge allows only listed ones.
            let text = text
                .replacen("driver = \"fake\"", "driver = \"nfs\"", 1)
                .replacen(
                    "allowed_base_dirs = [",
                    &format!(
                        "allowed_base_dirs = [{}, ",
                        toml::Value::String(base_dir.clone())
                    ),
                    1,
                )
                .replacen(
                    "\nmount_view = \"self\"\n",
                    &format!("\nmount_view = {}\n", toml::Value::String(nsfile)),
                    1,
                );
            serving(services)(driver_at(&socket)(kubernetes_mode(&kubeconfig, "nfs-csi")(
                text,
            )))
        })
    };
    let controller = bridge(Mode::Rpc, "controller", &controller_kubeconfig).await;
    let node = bridge(Mode::Binary, "node", &node_kubeconfig).await;

    let created = controller.create("vol-nfs-1").await.expect("create");
    let handle: serde_json::Value = serde_json::from_str(&created.private_data).unwrap();
    let csi_volume_id = handle["id"].as_str().unwrap().to_string();
    assert!(
        common::is_name_of_a_create(&csi_volume_id, "fake-cube-vol-nfs-1"),
        "{csi_volume_id}"
    );
    let volume_dir = driver.volume_dir(&csi_volume_id);
    assert!(
        volume_dir.is_dir(),
        "CreateVolume made {}",
        volume_dir.display()
    );
    let creates = mutating(&driver.calls(), "CreateVolume");
    assert_eq!(creates.len(), 1, "{creates:?}");
    assert_eq!(
        creates[0].parameters,
        BTreeMap::from([
            ("server".to_string(), SERVER.to_string()),
            ("share".to_string(), "/".to_string()),
        ])
    );
    assert_eq!(
        creates[0].secrets,
        secret_map(("mountOptions", "nfsvers=4.1"))
    );
    let object = cube_volumes(admin.clone())
        .get(&object_name("nfs", "vol-nfs-1"))
        .await
        .expect("a CubeVolume");
    assert_eq!(object.data["spec"]["csiDriver"], "nfs.csi.k8s.io");
    assert_eq!(object.data["spec"]["csiVolumeId"], csi_volume_id.as_str());

    let attached = node
        .attach_in(&base, "sb-1", "vol-nfs-1", 0, &created.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", node.logs()));
    let host_path = base.join("nfs+vol-nfs-1");
    assert_eq!(Path::new(&attached.host_path), host_path);
    assert!(MountTable::read(None).unwrap().is_mount_point(&host_path));
    cubelet.assert_mounted_inside(&host_path, "attached through the StorageClass");
    std::fs::write(host_path.join("data"), "on nfs").unwrap();
    assert_eq!(
        std::fs::read_to_string(volume_dir.join("data")).unwrap(),
        "on nfs"
    );
    // The volume's publish got the StorageClass's mountOptions, and no staging.
    let publishes = mutating(&driver.calls(), "NodePublishVolume");
    assert_eq!(publishes.len(), 1, "{publishes:?}");
    assert_eq!(Path::new(&publishes[0].target_path), host_path);
    assert_eq!(publishes[0].mount_flags, ["nfsvers=4.1"]);
    assert!(mutating(&driver.calls(), "NodeStageVolume").is_empty());

    node.detach("sb-1", "vol-nfs-1", 0, &attached.metadata)
        .await
        .expect("detach");
    assert!(!MountTable::read(None).unwrap().is_mount_point(&host_path));
    assert_eq!(node.journal_records(), 0);

    controller.destroy("vol-nfs-1").await.expect("destroy");
    assert!(!volume_dir.exists(), "DeleteVolume removed the volume");
    assert!(
        cube_volumes(admin)
            .get_opt(&object_name("nfs", "vol-nfs-1"))
            .await
            .unwrap()
            .is_none()
    );
    // DeleteVolume got the provisioner secret (csi-driver-nfs reads its mountOptions
    // there), and CreateVolume and DeleteVolume each mounted the share.
    let deletes = mutating(&driver.calls(), "DeleteVolume");
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(deletes[0].volume_id, csi_volume_id);
    assert_eq!(
        deletes[0].secrets,
        secret_map(("mountOptions", "nfsvers=4.1"))
    );
    assert_eq!(driver.share_mounts(), 2);
}

/// Runs an operator command against `w`'s config; its stdout as JSON, or its stderr.
fn operator(w: &World, args: &[&str]) -> Result<serde_json::Value, String> {
    let out = std::process::Command::new(common::BRIDGE)
        .args(args)
        .args(["--output", "json", "--config"])
        .arg(&w.config_path)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout).unwrap())
}

/// Snapshots in Kubernetes mode: CubeVolumeSnapshot objects (the chart's CRD, written
/// with the chart's controller RBAC) that another replica restores from; the restored
/// volume is a CubeVolume carrying its content source, which the other replica's Create
/// answers with; bad input and a snapshot in use leave every object as it was.
#[tokio::test(flavor = "multi_thread")]
async fn snapshots_are_cubevolumesnapshots_shared_by_replicas() {
    use cube_csi_bridge::k8s::snapshots::{SNAPSHOT_KIND, SNAPSHOT_PLURAL};
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    let admin = api.admin().await;
    install_chart(
        &api,
        RELEASE,
        NAMESPACE,
        &serde_json::json!({
            "driver": common::DRIVER,
            "kubernetes": {
                "storageClass": CLASS,
                "secrets": [
                    {"namespace": "default", "names": ["prov-creds"], "usedBy": ["controller"]},
                    {"namespace": "default", "names": ["mount-creds"], "usedBy": ["node"]},
                ],
            },
        }),
    );
    nfs_style_class(&admin).await;
    let account = chart_service_account(&admin, RELEASE, "controller").await;
    let kubeconfig = api.service_account_kubeconfig(NAMESPACE, &account).await;
    let caps = Caps {
        snapshots: true,
        ..Caps::default()
    };
    let a = World::start_with_config(Mode::Rpc, caps, "", |text| {
        serving("controller")(kubernetes_mode(&kubeconfig, CLASS)(text))
    })
    .await;
    let b = World::start_with_config(Mode::Binary, caps, "", |text| {
        serving("controller")(share_driver(&a)(kubernetes_mode(&kubeconfig, CLASS)(text)))
    })
    .await;
    a.create("ws-1").await.expect("create");
    let taken = operator(&a, &["snapshot", "create", "ws-1", "--name", "snap-1"]).unwrap();
    let calls = a.driver.calls();
    let snapshot_calls = mutating(&calls, "CreateSnapshot");
    assert_eq!(snapshot_calls.len(), 1, "{calls:?}");
    assert_eq!(snapshot_calls[0].secrets, secret_map(PROVISIONER_SECRET));
    let gvk = GroupVersionKind::gvk(CRD_GROUP, CRD_VERSION, SNAPSHOT_KIND);
    let snapshots: Api<DynamicObject> = Api::namespaced_with(
        admin.clone(),
        NAMESPACE,
        &ApiResource::from_gvk_with_plural(&gvk, SNAPSHOT_PLURAL),
    );
    let object = snapshots
        .get(&object_name(common::DRIVER, "snap-1"))
        .await
        .expect("a CubeVolumeSnapshot for the snapshot");
    let spec = &object.data["spec"];
    assert_eq!(spec["snapshotId"], "snap-1");
    assert_eq!(spec["sourceVolumeId"], "ws-1");
    assert_eq!(spec["state"], "Created");
    assert_eq!(spec["csiSnapshotId"], taken["csi_snapshot_id"]);
    assert_eq!(spec["csiDriver"], FAKE_PROVISIONER);
    assert!(
        spec["integrity"]
            .as_str()
            .unwrap()
            .starts_with("hmac-sha256-v1:")
    );

    // The other replica restores from it, and its Create of the new id answers with it.
    let restored = operator(&b, &["restore", "snap-1", "--as", "ws-2"]).unwrap();
    let volumes = cube_volumes(admin.clone());
    let copy = volumes
        .get(&object_name(common::DRIVER, "ws-2"))
        .await
        .expect("a CubeVolume for the restored volume");
    assert_eq!(
        copy.data["spec"]["contentSource"],
        serde_json::json!({"kind": "Snapshot", "id": "snap-1", "csiId": taken["csi_snapshot_id"]})
    );
    let created = b.create("ws-2").await.expect("create of the restored id");
    assert!(
        created
            .private_data
            .contains(restored["csi_volume_id"].as_str().unwrap())
    );
    let listed = operator(&a, &["snapshot", "list"]).unwrap();
    assert_eq!(listed[0]["restored_into"], serde_json::json!(["ws-2"]));
    assert_eq!(listed[0]["integrity"], "valid");

    // Bad input and a snapshot in use change no object.
    let before = (
        volumes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        snapshots
            .get(&object_name(common::DRIVER, "snap-1"))
            .await
            .unwrap()
            .data,
    );
    for (args, expected) in [
        (&["restore", "snap-1", "--as", "ws-1"][..], "already exists"),
        (&["restore", "nope", "--as", "ws-3"], "unknown snapshot"),
        (&["snapshot", "delete", "snap-1"], "FailedPrecondition"),
    ] {
        let error = operator(&a, args).unwrap_err();
        assert!(error.contains(expected), "{args:?}: {error}");
        let after = (
            volumes
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .len(),
            snapshots
                .get(&object_name(common::DRIVER, "snap-1"))
                .await
                .unwrap()
                .data,
        );
        assert_eq!(after, before, "{args:?}");
    }

    // Destroy treats the restored volume like any other; then the snapshot goes.
    a.destroy("ws-2").await.expect("destroy");
    operator(&b, &["snapshot", "delete", "snap-1"]).unwrap();
    let gone = snapshots
        .get_opt(&object_name(common::DRIVER, "snap-1"))
        .await
        .unwrap();
    assert!(gone.is_none(), "{gone:?}");
    assert_eq!(mutating(&a.driver.calls(), "DeleteSnapshot").len(), 2);
}

/// With CubeVolume records, the accessible topology CreateVolume answered is kept in the
/// object (`spec.accessibleTopology`), covered by its MAC (Destroy verifies it), listed by
/// `list --controller`, and handed to the node in private_data.
#[tokio::test(flavor = "multi_thread")]
async fn the_accessible_topology_is_kept_in_the_cubevolume() {
    use common::fake_driver::ZONE_KEY;
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    helm_install(&api, "defaults", NAMESPACE, &[]);
    let admin = api.admin().await;
    let kubeconfig = api.kubeconfig.clone();
    let caps = Caps {
        zone: Some("zone-a"),
        ..Default::default()
    };
    let volume = format!(
        "[volume.accessibility_requirements]\nrequisite = [{{ \"{ZONE_KEY}\" = \"zone-b\" }}]\n"
    );
    let w = World::start_with_config(Mode::Rpc, caps, &volume, in_kubernetes(&kubeconfig)).await;
    let created = w.create("vol-topo").await.expect("create");
    let object = cube_volumes(admin.clone())
        .get(&object_name(common::DRIVER, "vol-topo"))
        .await
        .expect("a CubeVolume");
    let topology = serde_json::json!([{ ZONE_KEY: "zone-b" }]);
    assert_eq!(object.data["spec"]["accessibleTopology"], topology);
    let handle: serde_json::Value = serde_json::from_str(&created.private_data).unwrap();
    assert_eq!(handle["t"], topology);
    let out = std::process::Command::new(common::BRIDGE)
        .args(["list", "--controller", "--output", "json", "--config"])
        .arg(&w.config_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["accessible_topology"], topology, "{listed}");
    // The node (zone-a) is outside it: refused before any node call.
    let err = w
        .attach("sb", "vol-topo", 0, &created.private_data)
        .await
        .expect_err("zone-b volume on a zone-a node");
    assert_eq!(err.code, Some(tonic::Code::FailedPrecondition), "{err:?}");
    assert!(
        !w.driver
            .calls()
            .iter()
            .any(|c| c.method.starts_with("NodeStage") || c.method.starts_with("NodePublish"))
    );
    w.destroy("vol-topo").await.expect("the record verifies");
    assert!(
        cube_volumes(admin.clone())
            .get_opt(&object_name(common::DRIVER, "vol-topo"))
            .await
            .unwrap()
            .is_none()
    );
    drop(w);

    // A CRD older than the bridge (Helm never upgrades one), without accessibleTopology:
    // the API server would prune the field from every record, which then failed its MAC
    // at Destroy, forever. A new bridge refuses the Create, naming the CRD, before any
    // CreateVolume; once the CRD is applied it creates without a restart.
    let saved = set_topology_in_crd(&admin, None).await;
    let w = World::start_with_config(Mode::Rpc, caps, &volume, in_kubernetes(&kubeconfig)).await;
    let refused = w.create("vol-topo-2").await.expect_err("the CRD prunes");
    assert!(
        refused.message.contains("spec.accessibleTopology")
            && refused.message.contains("CustomResourceDefinition"),
        "{refused:?}"
    );
    assert!(
        !w.driver.calls().iter().any(|c| c.method == "CreateVolume"),
        "{:?}",
        w.driver.calls()
    );
    assert!(
        cube_volumes(admin.clone())
            .get_opt(&object_name(common::DRIVER, "vol-topo-2"))
            .await
            .unwrap()
            .is_none()
    );
    set_topology_in_crd(&admin, saved).await;
    w.create("vol-topo-2").await.expect("the CRD applied");
    w.destroy("vol-topo-2").await.expect("the record verifies");
}

/// A bridge config's edit: its controller records in CubeVolumes of NAMESPACE, through
/// `kubeconfig`.
fn in_kubernetes(kubeconfig: &Path) -> impl FnOnce(String) -> String {
    let kubeconfig = kubeconfig.to_path_buf();
    move |text| {
        let text = text.replacen(
            "[state]\n",
            "[state]\ncontroller_store = \"kubernetes\"\n",
            1,
        );
        format!(
            "{text}\n[kubernetes]\nkubeconfig = \"{}\"\nnamespace = \"{NAMESPACE}\"\n",
            kubeconfig.display()
        )
    }
}

/// Sets (Some) or removes (None) `spec.accessibleTopology` in the CubeVolume CRD's schema,
/// and waits until the API server serves the change (a dry-run create keeps the field, or
/// prunes it); returns the schema of the field before.
async fn set_topology_in_crd(
    admin: &kube::Client,
    field: Option<serde_json::Value>,
) -> Option<serde_json::Value> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let name = format!("{CRD_PLURAL}.{CRD_GROUP}");
    let mut crd = serde_json::to_value(crds.get(&name).await.unwrap()).unwrap();
    let properties = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"];
    let before = properties
        .as_object_mut()
        .unwrap()
        .remove("accessibleTopology");
    if let Some(field) = &field {
        properties["accessibleTopology"] = field.clone();
    }
    crds.replace(
        &name,
        &PostParams::default(),
        &serde_json::from_value(crd).unwrap(),
    )
    .await
    .unwrap();
    let volumes = cube_volumes(admin.clone());
    let probe: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": format!("{CRD_GROUP}/{CRD_VERSION}"),
        "kind": CRD_KIND,
        "metadata": { "generateName": "probe-" },
        "spec": {
            "driver": "d", "volumeId": "v", "csiName": "n", "state": "Creating",
            "accessibleTopology": [{ "k": "v" }],
        },
    }))
    .unwrap();
    let dry_run = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let stored = volumes.create(&dry_run, &probe).await.unwrap();
        if stored.data["spec"].get("accessibleTopology").is_some() == field.is_some() {
            return before;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the API server did not serve the changed CRD within 60 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// `expand` in Kubernetes mode, behind csi-mock: the controller replica grows the volume
/// (ControllerExpandVolume with the StorageClass's controller-expand secret) and records
/// the new capacity in the CubeVolume; the node daemon, which `expand` never talks to,
/// notices the recorded capacity and calls NodeExpandVolume at the volume's host_path,
/// once.
#[tokio::test(flavor = "multi_thread")]
async fn expand_records_the_capacity_and_the_node_daemon_follows_it() {
    let bin = require_k8s_peers!();
    let peers = require_csi_mock!();
    const GI: i64 = 1 << 30;
    let api = ApiServer::start(&bin);
    let admin = api.admin().await;
    install_chart(
        &api,
        RELEASE,
        NAMESPACE,
        &serde_json::json!({
            "driver": "mock",
            "kubernetes": {
                "storageClass": "mock-expand",
                "secrets": [{"namespace": "default", "names": ["prov-creds"]}],
            },
        }),
    );
    create_secret(&admin, "prov-creds", PROVISIONER_SECRET).await;
    create_class(
        &admin,
        "mock-expand",
        MOCK_NAME,
        &[
            ("csi.storage.k8s.io/provisioner-secret-name", "prov-creds"),
            ("csi.storage.k8s.io/provisioner-secret-namespace", "default"),
            (
                "csi.storage.k8s.io/controller-expand-secret-name",
                "prov-creds",
            ),
            (
                "csi.storage.k8s.io/controller-expand-secret-namespace",
                "default",
            ),
            ("csi.storage.k8s.io/node-expand-secret-name", "prov-creds"),
            ("csi.storage.k8s.io/node-expand-secret-namespace", "default"),
        ],
    )
    .await;
    // Each bridge as the chart's ServiceAccount of its side: the node daemon reads the
    // CubeVolume with the node account's `get`, the only CubeVolume access it has.
    let mut kubeconfigs = BTreeMap::new();
    for side in ["controller", "node"] {
        let account = chart_service_account(&admin, RELEASE, side).await;
        kubeconfigs.insert(
            side,
            api.service_account_kubeconfig(NAMESPACE, &account).await,
        );
    }
    let mock = MockDriver::start(
        &peers,
        api.dir.path(),
        &MockOptions {
            disable_attach: true,
            flags: vec!["-node-expand-required"],
            ..MockOptions::default()
        },
    );
    let bridge = |services: &'static str| {
        let (kubeconfig, socket) = (kubeconfigs[services].clone(), mock.socket.clone());
        World::start_with_config(Mode::Rpc, Caps::default(), "", move |text| {
            let text = text
                .replacen("driver = \"fake\"", "driver = \"mock\"", 1)
                .replacen("\nmount_view = \"self\"\n", "\nmount_view = \"none\"\n", 1)
                .replacen(
                    "[node]\n",
                    &format!("[volume]\ncapacity_bytes = {GI}\n\n[node]\n"),
                    1,
                );
            serving(services)(driver_at(&socket)(kubernetes_mode(
                &kubeconfig,
                "mock-expand",
            )(text)))
        })
    };
    let controller = bridge("controller").await;
    let node = bridge("node").await;

    let created = controller.create("vol-grow").await.expect("create");
    let attached = node
        .attach("sb", "vol-grow", 0, &created.private_data)
        .await
        .unwrap_or_else(|e| panic!("attach: {e:?}\n{}", node.logs()));
    let out = std::process::Command::new(common::BRIDGE)
        .args([
            "expand", "vol-grow", "--size", "3Gi", "--output", "json", "--config",
        ])
        .arg(&controller.config_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "expand: {out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["controller"]["capacity_bytes"], 3 * GI, "{report}");
    assert_eq!(report["node"], serde_json::Value::Null, "{report}");
    let expands = mock.requests("ControllerExpandVolume");
    assert_eq!(expands.len(), 1, "{expands:?}");
    assert_eq!(
        expands[0]["secrets"],
        serde_json::json!({PROVISIONER_SECRET.0: PROVISIONER_SECRET.1})
    );
    let object = cube_volumes(admin.clone())
        .get(&object_name("mock", "vol-grow"))
        .await
        .unwrap();
    assert_eq!(object.data["spec"]["capacityBytes"], 3 * GI);
    assert_eq!(object.data["spec"]["nodeExpansionRequired"], true);

    // The node daemon follows what the CubeVolume records.
    common::wait_until(
        "the node daemon's NodeExpandVolume",
        std::time::Duration::from_secs(60),
        || !mock.requests("NodeExpandVolume").is_empty(),
    )
    .await;
    let grown = mock.requests("NodeExpandVolume");
    assert_eq!(grown[0]["volume_path"], attached.host_path.as_str());
    assert_eq!(grown[0]["capacity_range"]["required_bytes"], 3 * GI);
    // csi-mock's CSI spec predates NodeExpandVolumeRequest.secrets, so its log cannot show
    // them (tests/expansion.rs checks them against the fake driver).
    node.wait_for_daemon_log(
        "grew the volume on this node",
        1,
        std::time::Duration::from_secs(30),
    )
    .await;

    node.detach("sb", "vol-grow", 0, &attached.metadata)
        .await
        .expect("detach");
    controller.destroy("vol-grow").await.expect("destroy");
    assert_eq!(mock.requests("NodeExpandVolume").len(), 1);
}
