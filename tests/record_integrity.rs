//! CubeVolume records are not blindly trusted (Kubernetes mode, against a real
//! kube-apiserver, each bridge with the chart's controller ServiceAccount): a CubeVolume
//! hand-edited to point at another volume's CSI handle makes Destroy refuse, with no
//! DeleteVolume sent, on every replica; replicas on other hosts verify each other's records
//! through the record key Secret the first of them made.
//!
//! Needs `CUBE_CSI_BRIDGE_K8S_BIN` (scripts/install-k8s-peers.sh); skips without it.

mod common;

use common::fake_driver::Caps;
use common::k8s::{ApiServer, CHART_DIR};
use common::{DRIVER, Mode, World};
use cube_csi_bridge::bridge::integrity::RecordKey;
use cube_csi_bridge::bridge::ports::ControllerStore;
use cube_csi_bridge::bridge::records::{VolumeRecord, VolumeState};
use cube_csi_bridge::k8s::volumes::object_name;
use cube_csi_bridge::k8s::{CRD_GROUP, CRD_KIND, CRD_PLURAL, CRD_VERSION, CubeVolumeStore};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};

const NAMESPACE: &str = "cube-system";
const RELEASE: &str = "sec";

fn cube_volumes(client: kube::Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(CRD_GROUP, CRD_VERSION, CRD_KIND);
    Api::namespaced_with(
        client,
        NAMESPACE,
        &ApiResource::from_gvk_with_plural(&gvk, CRD_PLURAL),
    )
}

/// A controller-side bridge config using CubeVolumes through `kubeconfig`.
fn controller_in_kubernetes(kubeconfig: &std::path::Path) -> impl FnOnce(String) -> String {
    let section = format!(
        "\n[kubernetes]\nkubeconfig = \"{}\"\nnamespace = \"{NAMESPACE}\"\n",
        kubeconfig.display()
    );
    move |text: String| {
        let text = text
            .replacen(
                "[state]\n",
                "[state]\ncontroller_store = \"kubernetes\"\n",
                1,
            )
            .replacen("[serve]\n", "[serve]\nservices = \"controller\"\n", 1);
        format!("{text}{section}")
    }
}

fn csi_handle(private_data: &str) -> String {
    serde_json::from_str::<serde_json::Value>(private_data).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn set_spec(volumes: &Api<DynamicObject>, volume_id: &str, spec: serde_json::Value) {
    volumes
        .patch(
            &object_name(DRIVER, volume_id),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": spec })),
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hand_edited_cubevolume_deletes_nothing_on_any_replica() {
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    let (ok, out) = api.helm(&[
        "install",
        RELEASE,
        CHART_DIR,
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "--set",
        &format!("driver={DRIVER}"),
    ]);
    assert!(ok, "helm install: {out}");
    let admin = api.admin().await;
    let accounts = Api::<ServiceAccount>::namespaced(admin.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/instance={RELEASE}")))
        .await
        .unwrap();
    let account = accounts
        .items
        .iter()
        .filter_map(|a| a.metadata.name.clone())
        .find(|n| n.ends_with("-controller"))
        .expect("the chart's controller ServiceAccount");
    let kubeconfig = api.service_account_kubeconfig(NAMESPACE, &account).await;

    // Replica A (the daemon) makes the key Secret at start and signs what it writes.
    let a = World::start_with_config(
        Mode::Rpc,
        Caps::default(),
        "",
        controller_in_kubernetes(&kubeconfig),
    )
    .await;
    let mine = a.create("vol-mine").await.expect("create");
    let theirs = a.create("vol-theirs").await.expect("create");
    let (mine_handle, theirs_handle) = (
        csi_handle(&mine.private_data),
        csi_handle(&theirs.private_data),
    );
    let key = Api::<Secret>::namespaced(admin.clone(), NAMESPACE)
        .get(&format!("cube-csi-bridge-{DRIVER}-record-key"))
        .await
        .expect("the record key Secret");
    assert_eq!(key.immutable, Some(true));
    assert_eq!(key.data.unwrap()["key"].0.len(), 32);
    let volumes = cube_volumes(admin.clone());
    let object = volumes.get(&object_name(DRIVER, "vol-mine")).await.unwrap();
    assert!(
        object.data["spec"]["integrity"]
            .as_str()
            .is_some_and(|m| m.starts_with("hmac-sha256-v1:")),
        "{:?}",
        object.data
    );

    // Someone with write access to CubeVolumes points vol-mine at vol-theirs' handle.
    set_spec(
        &volumes,
        "vol-mine",
        serde_json::json!({ "csiVolumeId": theirs_handle }),
    )
    .await;

    // Replica B: another state dir, a forked hook, the same driver and namespace.
    let b = World::start_with_config(Mode::Binary, Caps::default(), "", |text| {
        let socket = format!(
            "endpoint = \"unix://{}\"",
            a.dir.path().join("csi.sock").display()
        );
        let start = text.find("endpoint = ").unwrap();
        let end = start + text[start..].find('\n').unwrap();
        controller_in_kubernetes(&kubeconfig)(format!("{}{socket}{}", &text[..start], &text[end..]))
    })
    .await;
    a.driver.clear_calls();
    for (name, world) in [("A", &a), ("B", &b)] {
        let err = world
            .destroy("vol-mine")
            .await
            .expect_err("destroy of an edited record");
        assert!(
            err.message.contains("integrity")
                && err.message.contains(&object_name(DRIVER, "vol-mine"))
                && err.message.contains(&theirs_handle),
            "replica {name}: {}",
            err.message
        );
        assert_eq!(err.code.is_some(), name == "A");
    }
    assert!(
        a.driver.mutating_calls().is_empty(),
        "{:?}",
        a.driver.calls()
    );

    // Replica B verifies what A signed: vol-theirs is deleted, with its own handle.
    b.destroy("vol-theirs").await.expect("destroy by B");
    let deleted: Vec<_> = a
        .driver
        .calls()
        .into_iter()
        .filter(|c| c.method == "DeleteVolume")
        .map(|c| c.volume_id)
        .collect();
    assert_eq!(deleted, std::slice::from_ref(&theirs_handle));

    // A MAC removed by hand is refused as well (it could hide any edit).
    set_spec(
        &volumes,
        "vol-mine",
        serde_json::json!({ "csiVolumeId": mine_handle, "integrity": null }),
    )
    .await;
    let err = b.destroy("vol-mine").await.expect_err("unsigned record");
    assert!(err.message.contains("no integrity MAC"), "{}", err.message);
    // Restoring the original record (MAC included) makes Destroy work again.
    set_spec(&volumes, "vol-mine", object.data["spec"].clone()).await;
    a.driver.clear_calls();
    b.destroy("vol-mine")
        .await
        .expect("destroy of the restored record");
    let deleted: Vec<_> = a
        .driver
        .calls()
        .into_iter()
        .filter(|c| c.method == "DeleteVolume")
        .map(|c| c.volume_id)
        .collect();
    assert_eq!(deleted, [mine_handle]);
    assert!(
        volumes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

// ---- The record key's provenance (issue 18, finding 9) ----
//
// "The attacker" below is the admin client standing in for someone granted only what each
// step names (create Secrets, delete Secrets, write CubeVolumes in the release namespace).

/// The record key Secret the chart names for DRIVER.
fn key_secret_name() -> String {
    format!("cube-csi-bridge-{DRIVER}-record-key")
}

/// A chart installed with `sets`, and a kubeconfig of its controller ServiceAccount.
async fn install(api: &ApiServer, sets: &[&str]) -> (kube::Client, std::path::PathBuf) {
    let driver = format!("driver={DRIVER}");
    let mut args = vec![
        "install",
        RELEASE,
        CHART_DIR,
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "--set",
        &driver,
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    let (ok, out) = api.helm(&args);
    assert!(ok, "helm install: {out}");
    let admin = api.admin().await;
    let account = Api::<ServiceAccount>::namespaced(admin.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/instance={RELEASE}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|a| a.metadata.name)
        .find(|n| n.ends_with("-controller"))
        .expect("the chart's controller ServiceAccount");
    let kubeconfig = api.service_account_kubeconfig(NAMESPACE, &account).await;
    (admin, kubeconfig)
}

/// The attacker's CubeVolume store (admin rights on CubeVolumes).
fn attackers_store(api: &ApiServer) -> CubeVolumeStore {
    let settings = cube_csi_bridge::config::KubernetesSettings {
        kubeconfig: Some(api.kubeconfig.clone()),
        namespace: Some(NAMESPACE.into()),
        ..Default::default()
    };
    CubeVolumeStore::new(
        std::sync::Arc::new(cube_csi_bridge::k8s::Kube::new(&settings)),
        DRIVER,
    )
}

/// A CubeVolume the bridge never wrote, pointing at `handle`, signed with `key` if given.
async fn forge(api: &ApiServer, volume_id: &str, handle: &str, key: Option<&RecordKey>) {
    let mut record = VolumeRecord {
        volume_id: volume_id.into(),
        csi_name: format!("cube-{volume_id}"),
        csi_driver: None,
        state: VolumeState::Created,
        csi_volume_id: Some(handle.into()),
        volume_context: Default::default(),
        capacity_bytes: 0,
        updated_at: 1,
        deletion: None,
        revision: None,
        integrity: None,
        content_source: None,
        accessible_topology: Vec::new(),
        node_expansion_required: false,
        answering_creates: Vec::new(),
    };
    record.integrity = key.map(|k| k.sign(DRIVER, &record));
    attackers_store(api).put(&mut record).await.unwrap();
}

/// A key Secret someone other than the bridge made; `marked`: with the bridge's type and
/// labels copied.
fn foreign_key_secret(key: &RecordKey, marked: bool) -> Secret {
    let mut secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": { "name": key_secret_name() },
        "type": "Opaque",
        "data": {},
    }))
    .unwrap();
    secret.data = Some(
        [(
            "key".to_string(),
            k8s_openapi::ByteString(key.as_bytes().to_vec()),
        )]
        .into(),
    );
    if marked {
        secret.type_ = Some("csibridge.cubesandbox.io/record-key".into());
        secret.immutable = Some(true);
        secret.metadata.labels = Some(
            [
                ("app.kubernetes.io/managed-by", "cube-csi-bridge"),
                ("app.kubernetes.io/component", "record-key"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        );
    }
    secret
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn delete_volume_calls(world: &World) -> Vec<String> {
    world
        .driver
        .calls()
        .into_iter()
        .filter(|c| c.method == "DeleteVolume")
        .map(|c| c.volume_id)
        .collect()
}

async fn stop_daemon(world: &mut World) {
    if let Some(mut daemon) = world.daemon.take() {
        daemon.kill().await.unwrap();
    }
    let _ = std::fs::remove_file(world.socket());
}

/// Adds `line` to the config's `[kubernetes]` table.
fn add_kubernetes_setting(world: &World, line: &str) {
    let text = std::fs::read_to_string(&world.config_path).unwrap();
    let text = text.replacen("[kubernetes]\n", &format!("[kubernetes]\n{line}\n"), 1);
    std::fs::write(&world.config_path, text).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_record_key_secret_the_bridge_did_not_make_is_refused() {
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    let (admin, kubeconfig) = install(&api, &[]).await;
    let secrets = Api::<Secret>::namespaced(admin.clone(), NAMESPACE);
    // Before any bridge ran, someone who may create Secrets made the key Secret with a key
    // they know (as `kubectl create secret generic` makes it), and, with CubeVolume write
    // access, a record signed with it that points at someone else's volume.
    let known = RecordKey::from_bytes(&[0x41; 32]).unwrap();
    let planted = secrets
        .create(&PostParams::default(), &foreign_key_secret(&known, false))
        .await
        .unwrap();
    forge(&api, "vol-forged", "victims-handle", Some(&known)).await;

    let mut w = World::start_with_config(
        Mode::Binary,
        Caps::default(),
        "",
        controller_in_kubernetes(&kubeconfig),
    )
    .await;
    let err = w
        .start_daemon()
        .await
        .expect_err("the daemon must not serve with a key it did not make");
    assert!(
        err.contains(&key_secret_name()) && err.contains("was not made by the bridge"),
        "{err}"
    );
    // The forked hook refuses it too, and sends nothing.
    let err = w.destroy("vol-forged").await.expect_err("forged record");
    assert!(err.message.contains(&key_secret_name()), "{}", err.message);
    assert!(delete_volume_calls(&w).is_empty(), "{:?}", w.driver.calls());
    // The Secret is neither used nor overwritten.
    let now = secrets.get(&key_secret_name()).await.unwrap();
    assert_eq!(
        now.metadata.resource_version,
        planted.metadata.resource_version
    );
    assert_eq!(now.data, planted.data);

    // A forger who copies the bridge's type and labels is caught by the operator's pin
    // (the fingerprint of the key the operator made and recorded).
    secrets
        .delete(&key_secret_name(), &Default::default())
        .await
        .unwrap();
    secrets
        .create(&PostParams::default(), &foreign_key_secret(&known, true))
        .await
        .unwrap();
    let operators = RecordKey::from_bytes(&[0x42; 32]).unwrap();
    add_kubernetes_setting(
        &w,
        &format!(
            "record_key_sha256 = \"{}\"",
            sha256_hex(operators.as_bytes())
        ),
    );
    let err = w
        .start_daemon()
        .await
        .expect_err("the daemon must not serve with a key that is not the pinned one");
    assert!(
        err.contains(&key_secret_name())
            && err.contains(&sha256_hex(known.as_bytes()))
            && err.contains("record_key_sha256"),
        "{err}"
    );
    let err = w.destroy("vol-forged").await.expect_err("forged record");
    assert!(err.message.contains("record_key_sha256"), "{}", err.message);
    assert!(delete_volume_calls(&w).is_empty(), "{:?}", w.driver.calls());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deleted_record_key_is_not_replaced_and_launders_no_record() {
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    let (admin, kubeconfig) = install(&api, &[]).await;
    let secrets = Api::<Secret>::namespaced(admin.clone(), NAMESPACE);
    let mut w = World::start_with_config(
        Mode::Rpc,
        Caps::default(),
        "",
        controller_in_kubernetes(&kubeconfig),
    )
    .await;
    let real = w.create("vol-real").await.expect("create");
    let real_handle = csi_handle(&real.private_data);
    let original = secrets.get(&key_secret_name()).await.unwrap();
    stop_daemon(&mut w).await;

    // Someone who may delete Secrets and write CubeVolumes removes the key and plants an
    // unsigned record pointing at vol-real's volume.
    secrets
        .delete(&key_secret_name(), &Default::default())
        .await
        .unwrap();
    forge(&api, "vol-forged", &real_handle, None).await;
    let err = w
        .start_daemon()
        .await
        .expect_err("a missing key with signed records left must stop the controller");
    assert!(
        err.contains(&key_secret_name()) && err.contains("missing") && err.contains("signed"),
        "{err}"
    );
    assert!(
        secrets.get_opt(&key_secret_name()).await.unwrap().is_none(),
        "no new key may replace the lost one"
    );
    // A forked hook refuses as the daemon did.
    w.driver.clear_calls();
    w.mode = Mode::Binary;
    let err = w.destroy("vol-forged").await.expect_err("forged record");
    assert!(err.message.contains("missing"), "{}", err.message);
    w.mode = Mode::Rpc;

    // Stripping every MAC as well leaves a store that looks like one from before records
    // were signed: the bridge makes a key, but signs none of the records it did not write.
    let volumes = cube_volumes(admin.clone());
    set_spec(
        &volumes,
        "vol-real",
        serde_json::json!({ "integrity": null }),
    )
    .await;
    w.start_daemon()
        .await
        .expect("daemon starts with a new key");
    let replaced = secrets.get(&key_secret_name()).await.unwrap();
    assert_ne!(replaced.data, original.data);
    for volume in ["vol-forged", "vol-real"] {
        let err = w.destroy(volume).await.expect_err("unsigned record");
        assert!(err.message.contains("no integrity MAC"), "{}", err.message);
        let object = volumes.get(&object_name(DRIVER, volume)).await.unwrap();
        assert!(object.data["spec"].get("integrity").is_none(), "{volume}");
    }
    assert!(delete_volume_calls(&w).is_empty(), "{:?}", w.driver.calls());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_key_the_bridge_made_keeps_working_across_restarts_and_can_be_pinned() {
    let bin = require_k8s_peers!();
    let api = ApiServer::start(&bin);
    let (admin, kubeconfig) = install(&api, &[]).await;
    let secrets = Api::<Secret>::namespaced(admin.clone(), NAMESPACE);
    let mut w = World::start_with_config(
        Mode::Rpc,
        Caps::default(),
        "",
        controller_in_kubernetes(&kubeconfig),
    )
    .await;
    w.create("vol-1").await.expect("create");
    let made = secrets.get(&key_secret_name()).await.unwrap();
    assert_eq!(
        made.type_.as_deref(),
        Some("csibridge.cubesandbox.io/record-key")
    );
    assert_eq!(made.immutable, Some(true));
    let labels = made.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels["app.kubernetes.io/managed-by"], "cube-csi-bridge");
    assert_eq!(labels["app.kubernetes.io/component"], "record-key");
    let key = made.data.clone().unwrap()["key"].0.clone();
    let pin = sha256_hex(&key);
    assert!(
        w.logs().contains(&pin),
        "the daemon logs the key's fingerprint"
    );

    // A restart reads the same key and verifies what it signed.
    stop_daemon(&mut w).await;
    w.start_daemon().await.expect("restart");
    w.create("vol-2").await.expect("create");
    w.destroy("vol-1").await.expect("destroy after a restart");

    // Pinned: the chart then grants no `create` on Secrets, and the bridge works as before.
    let (ok, out) = api.helm(&[
        "upgrade",
        RELEASE,
        CHART_DIR,
        "--namespace",
        NAMESPACE,
        "--reuse-values",
        "--set",
        &format!("kubernetes.recordKeySha256={pin}"),
    ]);
    assert!(ok, "helm upgrade: {out}");
    let role = Api::<k8s_openapi::api::rbac::v1::Role>::namespaced(admin.clone(), NAMESPACE)
        .get(&format!("{RELEASE}-cube-csi-bridge-cubevolumes"))
        .await
        .unwrap();
    let secret_verbs: Vec<String> = role
        .rules
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r.resources.iter().flatten().any(|x| x == "secrets"))
        .flat_map(|r| r.verbs)
        .collect();
    assert_eq!(secret_verbs, ["get"]);
    stop_daemon(&mut w).await;
    add_kubernetes_setting(&w, &format!("record_key_sha256 = \"{pin}\""));
    w.start_daemon().await.expect("restart, pinned");
    w.create("vol-3").await.expect("create, pinned");
    w.destroy("vol-2").await.expect("destroy, pinned");
    w.destroy("vol-3").await.expect("destroy, pinned");

    // Pinned and gone: the bridge refuses rather than make a key that cannot match.
    stop_daemon(&mut w).await;
    secrets
        .delete(&key_secret_name(), &Default::default())
        .await
        .unwrap();
    let err = w.start_daemon().await.expect_err("pinned key missing");
    assert!(
        err.contains(&key_secret_name()) && err.contains("missing"),
        "{err}"
    );
    assert!(secrets.get_opt(&key_secret_name()).await.unwrap().is_none());
}
