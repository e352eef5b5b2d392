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
use cube_csi_bridge::k8s::volumes::object_name;
use cube_csi_bridge::k8s::{CRD_GROUP, CRD_KIND, CRD_PLURAL, CRD_VERSION};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
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
