//! `cube-csi-bridge expand` through the core: ControllerExpandVolume, the recorded
//! capacity, NodeExpandVolume where the volume is attached, and every refusal changing
//! nothing.

use super::*;
use crate::bridge::expansion::{ExpandReport, NodeExpansion};

const GI: u64 = 1 << 30;

/// A world whose config has `volume` and `secrets` tables and the given create budget.
fn world(fake: Fake, create_secs: u64) -> World {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\ndir = \"{d}/state\"\n\
         lock_dir = \"{d}/locks\"\n[timeouts]\nattach_secs = {create_secs}\ndetach_secs = 10\n\
         rollback_secs = 10\ncreate_secs = {create_secs}\n[node]\ndefault_volume_base_dir = \"{d}/vol\"\n\
         [volume]\ncapacity_bytes = {GI}\n[secrets.controller_expand]\nuser = \"ce-secret\"\n\
         [secrets.node_expand]\nuser = \"ne-secret\"\n",
        d = dir.path().display()
    );
    let config = Arc::new(Config::parse(&text, Path::new("test.toml")).unwrap());
    let store = Arc::new(MemoryStore::default());
    let bridge = sides(&config, &fake, store.clone(), Roles::BOTH);
    World {
        dir,
        fake,
        store,
        bridge,
    }
}

/// A staging fake that expands online on both sides and asks for node expansion.
fn online() -> Fake {
    let fake = Fake::new(true, false);
    {
        let mut e = fake.expansion.lock().unwrap();
        e.controller = true;
        e.node = true;
        e.mode = Some(ExpansionMode::Online);
        e.node_expansion_required = true;
    }
    fake
}

impl World {
    async fn expand(&self, volume: &str, size: u64) -> Result<ExpandReport, BridgeError> {
        self.bridge.expand(volume, size).await
    }

    /// Attaches `volume` with the handle Create returned for it.
    async fn attach_created(&self, volume: &str, created: &Created) {
        let mut req = self.attach_req(volume, "ns1", "s1", 0);
        req.handle = VolumeHandle::decode(&created.private_data).unwrap();
        self.bridge.attach(req, &Caller::waiting()).await.unwrap();
    }

    fn node_expand_calls(&self) -> Vec<(String, PathBuf, Option<PathBuf>, u64)> {
        self.fake.expansion.lock().unwrap().node_calls.clone()
    }
}

#[tokio::test]
async fn an_online_expand_grows_the_volume_records_it_and_grows_it_on_this_node() {
    let w = world(online(), 10);
    let created = w.create("v").await.unwrap();
    let handle = VolumeHandle::decode(&created.private_data).unwrap();
    w.attach_created("v", &created).await;
    w.fake.clear_calls();

    let report = w.expand("v", 2 * GI).await.unwrap();
    let controller = report.controller.clone().unwrap();
    assert_eq!(controller.capacity_bytes, (2 * GI) as i64);
    assert!(controller.controller_expanded && controller.node_expansion_required);
    assert_eq!(controller.expansion, ExpansionMode::Online);
    assert_eq!(
        report.node,
        Some(NodeExpansion::Expanded {
            volume_path: w.target("v"),
            capacity_bytes: (2 * GI) as i64
        })
    );
    assert_eq!(
        w.fake.mutating_calls(),
        ["ControllerExpandVolume", "NodeExpandVolume"]
    );
    assert_eq!(
        w.node_expand_calls(),
        [(
            handle.csi_volume_id.clone(),
            w.target("v"),
            Some(w.staging("v")),
            2 * GI
        )]
    );
    // Each call got its own family's secrets.
    let secrets = w.fake.expansion.lock().unwrap().secrets.clone();
    assert_eq!(secrets[0].0, "ControllerExpandVolume");
    assert_eq!(secrets[0].1.0["user"], "ce-secret");
    assert_eq!(secrets[1].0, "NodeExpandVolume");
    assert_eq!(secrets[1].1.0["user"], "ne-secret");
    let record = w.stored("v").unwrap();
    assert_eq!(record.capacity_bytes, (2 * GI) as i64);
    assert!(record.node_expansion_required);
    assert_eq!(w.record("v").unwrap().expanded_bytes, (2 * GI) as i64);

    // Again with the same size: nothing left to do anywhere.
    w.fake.clear_calls();
    let again = w.expand("v", 2 * GI).await.unwrap();
    assert!(!again.controller.unwrap().controller_expanded);
    assert_eq!(
        again.node,
        Some(NodeExpansion::AlreadyExpanded {
            capacity_bytes: (2 * GI) as i64
        })
    );
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());

    // A later Create of the same volume answers with the same handle and keeps the size.
    assert_eq!(w.create("v").await.unwrap(), created);
    assert_eq!(w.stored("v").unwrap().capacity_bytes, (2 * GI) as i64);
    // The record still verifies: Destroy (which refuses a record failing its MAC) works.
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.destroy("v").await.unwrap();
    assert!(w.stored("v").is_none());
}

/// NodeExpandVolume gets only paths that pass their check, as every path a driver gets:
/// the driver resizes what it finds there, as root. Before, a link planted at the
/// host_path by whoever can write the base dir led the resize to another filesystem.
#[tokio::test]
async fn no_node_expansion_at_a_path_that_fails_its_check() {
    let w = world(online(), 10);
    let created = w.create("v").await.unwrap();
    w.attach_created("v", &created).await;
    w.fake.plant(w.target("v"));
    let error = w.expand("v", 2 * GI).await;
    assert!(w.node_expand_calls().is_empty(), "{error:?}");
}

#[tokio::test]
async fn a_smaller_size_an_unknown_volume_and_a_bad_id_change_nothing() {
    let w = world(online(), 10);
    w.create("v").await.unwrap();
    let before = w.stored("v").unwrap();
    w.fake.clear_calls();
    // Below the configured capacity the volume was created with.
    let error = w.expand("v", GI / 2).await.unwrap_err();
    assert!(matches!(error, BridgeError::InvalidRequest(_)), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("smaller") && message.contains("1Gi") && message.contains("512Mi"),
        "{message}"
    );
    w.expand("v", 3 * GI).await.unwrap();
    let grown = w.stored("v").unwrap();
    w.fake.clear_calls();
    let error = w.expand("v", 2 * GI).await.unwrap_err();
    assert!(error.to_string().contains("3Gi"), "{error}");
    assert_eq!(w.stored("v").unwrap(), grown);
    assert_ne!(grown.capacity_bytes, before.capacity_bytes);

    let error = w.expand("nope", 2 * GI).await.unwrap_err();
    assert!(matches!(error, BridgeError::InvalidRequest(_)), "{error}");
    assert!(error.to_string().contains("unknown"), "{error}");
    assert!(w.stored("nope").is_none());
    let error = w.expand("../x", 2 * GI).await.unwrap_err();
    assert!(matches!(error, BridgeError::InvalidRequest(_)), "{error}");
    assert!(w.fake.mutating_calls().is_empty(), "{:?}", w.fake.calls());
}

#[tokio::test]
async fn a_driver_without_expansion_is_refused_by_name_and_nothing_changes() {
    let w = world(Fake::new(true, false), 10);
    w.create("v").await.unwrap();
    let before = w.stored("v").unwrap();
    w.fake.clear_calls();
    let error = w.expand("v", 2 * GI).await.unwrap_err();
    assert!(matches!(error, BridgeError::Precondition(_)), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("fake.csi") && message.contains("EXPAND_VOLUME"),
        "{message}"
    );
    assert_eq!(w.stored("v").unwrap(), before);
    assert!(w.fake.mutating_calls().is_empty());
}

#[tokio::test]
async fn an_offline_driver_is_refused_while_the_volume_is_held_here() {
    let fake = online();
    fake.expansion.lock().unwrap().mode = Some(ExpansionMode::Offline);
    let w = world(fake, 10);
    let created = w.create("v").await.unwrap();
    w.attach_created("v", &created).await;
    let before = w.stored("v").unwrap();
    w.fake.clear_calls();
    let error = w.expand("v", 2 * GI).await.unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("offline") && message.contains("ns1/s1"),
        "{message}"
    );
    assert_eq!(w.stored("v").unwrap(), before);
    assert!(w.fake.mutating_calls().is_empty());

    // Once nobody holds it, it grows; no node has it to grow.
    w.detach("v", "ns1", "s1", 0).await.unwrap();
    w.fake.clear_calls();
    let report = w.expand("v", 2 * GI).await.unwrap();
    assert_eq!(report.controller.unwrap().expansion, ExpansionMode::Offline);
    assert_eq!(report.node, Some(NodeExpansion::NotAttached));
    assert_eq!(w.fake.mutating_calls(), ["ControllerExpandVolume"]);
    assert_eq!(w.stored("v").unwrap().capacity_bytes, (2 * GI) as i64);
}

#[tokio::test]
async fn a_driver_that_grows_volumes_on_nodes_only_gets_no_controller_call() {
    let fake = online();
    fake.expansion.lock().unwrap().controller = false;
    let w = world(fake, 10);
    let created = w.create("v").await.unwrap();
    w.attach_created("v", &created).await;
    w.fake.clear_calls();
    let report = w.expand("v", 2 * GI).await.unwrap();
    let controller = report.controller.unwrap();
    assert!(!controller.controller_expanded && controller.node_expansion_required);
    assert!(matches!(report.node, Some(NodeExpansion::Expanded { .. })));
    assert_eq!(w.fake.mutating_calls(), ["NodeExpandVolume"]);
    assert_eq!(w.stored("v").unwrap().capacity_bytes, (2 * GI) as i64);
}

#[tokio::test]
async fn no_node_call_when_the_controller_says_none_is_needed() {
    let fake = online();
    fake.expansion.lock().unwrap().node_expansion_required = false;
    let w = world(fake, 10);
    let created = w.create("v").await.unwrap();
    w.attach_created("v", &created).await;
    w.fake.clear_calls();
    let report = w.expand("v", 2 * GI).await.unwrap();
    assert_eq!(report.node, Some(NodeExpansion::NotRequired));
    assert_eq!(w.fake.mutating_calls(), ["ControllerExpandVolume"]);
    assert!(!w.stored("v").unwrap().node_expansion_required);
}

#[tokio::test]
async fn a_failed_controller_expand_records_nothing() {
    let w = world(online(), 10);
    let created = w.create("v").await.unwrap();
    w.attach_created("v", &created).await;
    let before = w.stored("v").unwrap();
    w.fake.clear_calls();
    w.fake.script("ControllerExpandVolume", Fault::Final);
    let error = w.expand("v", 2 * GI).await.unwrap_err();
    assert!(
        error.to_string().contains("ControllerExpandVolume"),
        "{error}"
    );
    assert_eq!(w.stored("v").unwrap(), before);
    assert_eq!(w.record("v").unwrap().expanded_bytes, 0);
    assert_eq!(w.fake.mutating_calls(), ["ControllerExpandVolume"]);
}

#[tokio::test]
async fn an_expand_waits_for_the_hooks_locks_of_the_volume() {
    let w = world(online(), 1);
    w.create("v").await.unwrap();
    let before = w.stored("v").unwrap();
    let locks = crate::store::FileLocks::new(&w.dir.path().join("locks")).unwrap();
    for scope in [LockScope::Controller, LockScope::Node] {
        // Another process (a forked Destroy or Attach hook) holds the volume's lock.
        let held = locks.try_lock(scope, "v").unwrap().unwrap();
        w.fake.clear_calls();
        let error = w.expand("v", 2 * GI).await.unwrap_err();
        assert!(
            matches!(error, BridgeError::Busy { .. }),
            "{scope:?}: {error}"
        );
        assert!(w.fake.mutating_calls().is_empty());
        assert_eq!(w.stored("v").unwrap(), before);
        drop(held);
    }
    w.expand("v", 2 * GI).await.unwrap();
}

#[tokio::test]
async fn a_node_follows_the_capacity_its_volumes_records_ask_for() {
    let w = world(online(), 10);
    let created = w.create("v").await.unwrap();
    let handle = VolumeHandle::decode(&created.private_data).unwrap();
    w.attach_created("v", &created).await;
    w.create("other").await.unwrap();
    let node = w.bridge.node().unwrap().clone();
    let store = w.store.clone() as Arc<dyn ControllerStore>;
    // Nothing recorded yet: nothing to grow.
    assert_eq!(
        node.follow_recorded_expansions(store.as_ref())
            .await
            .unwrap(),
        0
    );

    // The controller side (another host, in Kubernetes mode) grew both volumes.
    let controller = w.bridge.controller().unwrap().clone();
    controller.expand("v", 2 * GI, &[]).await.unwrap();
    controller.expand("other", 2 * GI, &[]).await.unwrap();
    w.fake.clear_calls();
    assert_eq!(
        node.follow_recorded_expansions(store.as_ref())
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        w.node_expand_calls(),
        [(
            handle.csi_volume_id.clone(),
            w.target("v"),
            Some(w.staging("v")),
            2 * GI
        )]
    );
    assert_eq!(w.record("v").unwrap().expanded_bytes, (2 * GI) as i64);
    // Done once: the next pass makes no call.
    w.fake.clear_calls();
    assert_eq!(
        node.follow_recorded_expansions(store.as_ref())
            .await
            .unwrap(),
        0
    );
    assert!(w.fake.mutating_calls().is_empty());

    // A record naming another CSI volume than the journal's is not followed.
    let mut forged = w.stored("v").unwrap();
    forged.csi_volume_id = Some("someone-else".into());
    forged.capacity_bytes = (4 * GI) as i64;
    w.store.records.lock().unwrap().insert("v".into(), forged);
    assert_eq!(
        node.follow_recorded_expansions(store.as_ref())
            .await
            .unwrap(),
        0
    );
    assert!(w.fake.mutating_calls().is_empty());
}

/// A store whose `get` of one volume fails as a CubeVolume edited to another volume's
/// spec does (`Corrupt`).
#[derive(Debug)]
struct OneUnreadable {
    inner: Arc<MemoryStore>,
    volume: &'static str,
}

#[async_trait]
impl ControllerStore for OneUnreadable {
    async fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        if volume_id == self.volume {
            return Err(StoreError::Corrupt {
                store: "one-unreadable".into(),
                what: format!("the record of {volume_id}"),
                message: "its spec names another volume".into(),
            });
        }
        self.inner.get(volume_id).await
    }
    async fn put(&self, record: &mut VolumeRecord) -> Result<(), StoreError> {
        self.inner.put(record).await
    }
    async fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        self.inner.delete(record).await
    }
    async fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        self.inner.list().await
    }
    fn describe(&self) -> String {
        "one-unreadable".into()
    }
}

/// One volume whose record cannot be read (visited first: volumes go in id order) does
/// not keep the node from growing the others.
#[tokio::test]
async fn one_unreadable_record_does_not_stop_the_others_growing() {
    let w = world(online(), 10);
    for volume in ["a", "b"] {
        let created = w.create(volume).await.unwrap();
        w.attach_created(volume, &created).await;
    }
    let controller = w.bridge.controller().unwrap().clone();
    controller.expand("b", 2 * GI, &[]).await.unwrap();
    let node = w.bridge.node().unwrap().clone();
    let store = OneUnreadable {
        inner: w.store.clone(),
        volume: "a",
    };
    w.fake.clear_calls();
    assert_eq!(node.follow_recorded_expansions(&store).await.unwrap(), 1);
    assert_eq!(w.record("b").unwrap().expanded_bytes, (2 * GI) as i64);
}

/// A CubeVolume edited to an absurd capacity (its size is not covered by the MAC, and
/// the node has no key) makes the node grow the volume to it: the worst an edited record
/// may do. It must not leave the node answering every real growth below that size
/// "already grown": once the record says less, the node follows it again.
#[tokio::test]
async fn an_edited_capacity_does_not_stop_later_growth_on_the_node() {
    let w = world(online(), 10);
    let created = w.create("v").await.unwrap();
    w.attach_created("v", &created).await;
    let node = w.bridge.node().unwrap().clone();
    let store = w.store.clone() as Arc<dyn ControllerStore>;
    w.edit_record("v", |r| {
        r.capacity_bytes = i64::MAX;
        r.node_expansion_required = true;
    });
    assert_eq!(
        node.follow_recorded_expansions(store.as_ref())
            .await
            .unwrap(),
        1
    );
    assert_eq!(w.record("v").unwrap().expanded_bytes, i64::MAX);
    // The operator puts the record back and grows the volume for real.
    w.edit_record("v", |r| r.capacity_bytes = GI as i64);
    node.follow_recorded_expansions(store.as_ref())
        .await
        .unwrap();
    let controller = w.bridge.controller().unwrap().clone();
    controller.expand("v", 2 * GI, &[]).await.unwrap();
    w.fake.clear_calls();
    node.follow_recorded_expansions(store.as_ref())
        .await
        .unwrap();
    let calls = w.node_expand_calls();
    assert_eq!(calls.last().map(|c| c.3), Some(2 * GI), "{calls:?}");
    assert_eq!(w.record("v").unwrap().expanded_bytes, (2 * GI) as i64);
}

/// A CubeVolume writer edits the record while ControllerExpandVolume runs: the expand's
/// write conflicts, and the copy it re-reads must not be signed as the bridge's.
#[tokio::test]
async fn an_expand_never_signs_a_record_edited_while_it_ran() {
    let w = world(online(), 10);
    w.create("v").await.unwrap();
    w.fake.script(
        "ControllerExpandVolume",
        Fault::Slow(Duration::from_secs(1)),
    );
    let forge = async {
        while !w.fake.calls().iter().any(|c| c == "ControllerExpandVolume") {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        w.edit_record("v", |r| {
            r.csi_name = "pvc-someone-elses".into();
            r.revision = Some("9999".into());
        });
    };
    let (expanded, ()) = tokio::join!(w.expand("v", 2 * GI), forge);
    let error = expanded.unwrap_err().to_string();
    assert!(error.contains("integrity"), "{error}");
    // Still refused: nothing signed the edit.
    let refused = w.destroy("v").await.unwrap_err();
    assert!(refused.to_string().contains("integrity"), "{refused}");
}

/// A clone of an expanded volume asks for the size the volume has now, not the size
/// configured: drivers refuse a copy smaller than its source. Before, it asked the
/// configured size and every clone of an expanded volume failed.
#[tokio::test]
async fn a_clone_of_an_expanded_volume_asks_for_its_size() {
    let w = world(online(), 30);
    w.create("v").await.unwrap();
    w.expand("v", 4 * GI).await.unwrap();
    w.fake.state.lock().unwrap().asked_sizes = Some(BTreeMap::new());
    let copy = w.controller().clone_volume("v", "c").await.unwrap();
    assert_eq!(copy.capacity_bytes, (4 * GI) as i64);
    let asked = w.fake.state.lock().unwrap().asked_sizes.clone().unwrap();
    assert_eq!(asked.get(&copy.csi_name), Some(&(4 * GI)), "{asked:?}");
}
