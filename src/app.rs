//! The composition root: the one place that knows the concrete adapters. It builds each
//! side of the core complete from the config (CSI over gRPC, the mount view the edge
//! chose, the controller store, the record key, the volume settings, the journal, the
//! locks, the clock and the metrics recorder).

use std::sync::Arc;

use crate::bridge::discovery::DriverView;
use crate::bridge::integrity::RecordKeySource;
use crate::bridge::ports::{
    Clock, ControllerDriver, ControllerStore, MountCheck, NoRecorder, NodeDriver, Recorder,
    VolumeLocks, VolumeSettings,
};
use crate::bridge::{
    Bridge, BridgeError, ControllerPorts, ControllerSide, NodePorts, NodeSide, Settings, Timeouts,
    Unserved,
};
use crate::config::volume_settings::ConfigSettings;
use crate::config::{Config, ControllerStoreKind, Roles};
use crate::csi::{CsiClient, GrpcDriver};
use crate::k8s::record_key::SecretKeySource;
use crate::k8s::{CubeSnapshotStore, CubeVolumeStore, Kube, StorageClassSource};
use crate::metrics::{DriverLabel, PrometheusRecorder};
use crate::mount::{BaseDirPolicy, HostDirs};
use crate::store::owner::Keeper;
use crate::store::{EmbeddedStore, FileJournal, FileKeySource, FileLocks};
use crate::system::SystemClock;

mod hot_path;

/// The core's settings, taken from the config file.
pub fn core_settings(config: &Config) -> Settings {
    Settings {
        driver: config.driver.clone(),
        timeouts: Timeouts {
            create: config.timeouts.create,
            destroy: config.timeouts.destroy,
            attach: config.timeouts.attach,
            detach: config.timeouts.detach,
            rollback: config.timeouts.rollback,
        },
        name_prefix: config.volume.name_prefix.clone(),
        capacity_bytes: config.volume.capacity_bytes,
        default_base_dir: config.node.default_volume_base_dir.clone(),
        node_id: config.csi.node_id.clone(),
        separate_controller_endpoint: config.csi.controller_endpoint.is_some(),
        sign_unsigned_records: config.controller.sign_unsigned_records.clone(),
        shared_store: config.state.controller_store == ControllerStoreKind::Kubernetes,
        stale_holder_after: config.node.stale_holder_after,
        accessibility: config.volume.accessibility.clone(),
        mount_group: config.volume.mount_group,
    }
}

/// What both sides of one process share.
struct Shared {
    settings: Settings,
    driver: Arc<DriverView>,
    volume_settings: Arc<dyn VolumeSettings>,
    locks: Arc<dyn VolumeLocks>,
    clock: Arc<dyn Clock>,
    recorder: Arc<dyn Recorder>,
    kube: Option<Arc<Kube>>,
}

/// The sides `roles` names, over the driver, stores and settings `config` names, checking
/// mounts through `mounts` (the edge picks the view: a forked hook already lives in
/// Cubelet's mount namespace, the daemon does not). Each side opens on its own; a served
/// side that cannot open fails the whole call, with its error.
pub fn open_bridge(
    config: Arc<Config>,
    roles: Roles,
    mounts: Arc<dyn MountCheck>,
) -> Result<Bridge, BridgeError> {
    let bridge = open_sides(&config, roles, mounts)?;
    if let (true, Err(why)) = (roles.controller, &bridge.controller) {
        return Err(BridgeError::Unavailable(why.0.clone()));
    }
    if let (true, Err(why)) = (roles.node, &bridge.node) {
        return Err(BridgeError::Unavailable(why.0.clone()));
    }
    Ok(bridge)
}

/// Like `open_bridge`, but a side that cannot open is left out with its reason (the
/// other side serves regardless). Fails only when what both share cannot be made.
pub fn open_sides(
    config: &Config,
    roles: Roles,
    mounts: Arc<dyn MountCheck>,
) -> Result<Bridge, BridgeError> {
    open_sides_reopenable(config, roles, mounts).map(|(bridge, _)| bridge)
}

/// What it takes to open a side again over the same driver, locks, metrics and mount
/// view as the rest of its process: a daemon whose state dir was full or failing when it
/// started serves that side once it is fixed, without a restart.
pub struct Reopen {
    config: Config,
    shared: Shared,
    mounts: Arc<dyn MountCheck>,
}

impl Reopen {
    pub fn controller(&self) -> Result<Arc<ControllerSide>, BridgeError> {
        open_controller(&self.config, &self.shared).map(Arc::new)
    }

    pub fn node(&self) -> Result<Arc<NodeSide>, BridgeError> {
        open_node(&self.config, &self.shared, self.mounts.clone()).map(Arc::new)
    }
}

/// `open_sides`, and what it takes to open a side that could not open again later.
pub fn open_sides_reopenable(
    config: &Config,
    roles: Roles,
    mounts: Arc<dyn MountCheck>,
) -> Result<(Bridge, Reopen), BridgeError> {
    // Claimed for the records each role keeps: a controller-only bridge claims no node
    // endpoint (a node-only bridge of the same driver, on its own endpoint, shares the dir).
    let keeper = if roles.node {
        Some(Keeper::Node)
    } else if roles.controller && config.state.controller_store == ControllerStoreKind::Embedded {
        Some(Keeper::Controller)
    } else {
        None
    };
    let shared = shared(config, keeper)?;
    let controller = if roles.controller {
        open_controller(config, &shared)
            .map(Arc::new)
            .map_err(|e| Unserved(e.to_string()))
    } else {
        Err(Unserved::not_a_role("controller"))
    };
    let node = if roles.node {
        open_node(config, &shared, mounts.clone())
            .map(Arc::new)
            .map_err(|e| Unserved(e.to_string()))
    } else {
        Err(Unserved::not_a_role("node"))
    };
    let reopen = Reopen {
        config: config.clone(),
        shared,
        mounts,
    };
    Ok((Bridge { controller, node }, reopen))
}

fn shared(config: &Config, keeper: Option<Keeper>) -> Result<Shared, BridgeError> {
    let label = DriverLabel::of(config);
    let client = |endpoint| {
        CsiClient::new(endpoint)
            .trusting(&config.csi.driver_uids)
            .labelled(label.clone())
    };
    let node_driver = Arc::new(GrpcDriver::new(client(&config.csi.endpoint)));
    let controller_driver: Arc<dyn ControllerDriver> = match &config.csi.controller_endpoint {
        Some(endpoint) => Arc::new(GrpcDriver::new(client(endpoint))),
        None => node_driver.clone(),
    };
    let node_driver: Arc<dyn NodeDriver> = node_driver;
    let kube = config
        .uses_kubernetes()
        .then(|| Arc::new(Kube::new(&config.kubernetes)));
    let volume_settings: Arc<dyn VolumeSettings> = match (&config.kubernetes.storage_class, &kube) {
        (Some(class), Some(kube)) => Arc::new(StorageClassSource::new(
            kube.clone(),
            class,
            config.kubernetes.cache,
            config.volume.access_mode,
        )),
        _ => Arc::new(ConfigSettings::new(&config.volume, &config.secrets)),
    };
    shared_over(
        config,
        controller_driver,
        node_driver,
        volume_settings,
        kube,
        keeper,
    )
}

/// The node side alone, for a process that answers only a hook's hot path (the forked
/// hook's front): the same journal, locks, mount view and clock as `open_bridge`'s, but no
/// driver or Kubernetes client (`hot_path::NotConnected`), so that the executable serving
/// it links neither.
pub fn open_hot_node(config: &Config, mounts: Arc<dyn MountCheck>) -> Result<Bridge, BridgeError> {
    let absent = Arc::new(hot_path::NotConnected::new(
        &config.csi.endpoint.to_string(),
    ));
    let mut shared = shared_over(
        config,
        absent.clone(),
        absent.clone(),
        absent,
        None,
        Some(Keeper::Node),
    )?;
    // A forked hook serves no metrics: counts made here would be for nobody.
    shared.recorder = Arc::new(NoRecorder);
    let node = open_node(config, &shared, mounts)?;
    Ok(Bridge {
        controller: Err(Unserved::not_a_role("controller")),
        node: Ok(Arc::new(node)),
    })
}

/// What both sides share, over the given drivers. With a `keeper` (a node side, or the
/// embedded controller store, will read and write records in `state.dir`) the state dir
/// is claimed for it first, before even its lock dir is made.
fn shared_over(
    config: &Config,
    controller_driver: Arc<dyn ControllerDriver>,
    node_driver: Arc<dyn NodeDriver>,
    volume_settings: Arc<dyn VolumeSettings>,
    kube: Option<Arc<Kube>>,
    keeper: Option<Keeper>,
) -> Result<Shared, BridgeError> {
    let label = DriverLabel::of(config);
    let settings = core_settings(config);
    let driver = Arc::new(DriverView::new(
        controller_driver,
        node_driver,
        settings.node_id.clone(),
        settings.separate_controller_endpoint,
    ));
    check_state_dir(config)?;
    let lock_dir = &config.state.lock_dir;
    let lock_dir_error = |e| BridgeError::io(format!("lock dir {}", lock_dir.display()), e);
    // Checked before anything is claimed (a refused bridge leaves no claim of its own);
    // claimed once the lock dir is made.
    crate::store::owner::check_lock_dir(lock_dir, &config.driver, &config.state.dir)
        .map_err(lock_dir_error)?;
    if let Some(instance) = &config.state.instance {
        crate::store::owner::check_instance(&config.state.dir, instance)
            .map_err(|e| BridgeError::io(format!("state dir {}", config.state.dir.display()), e))?;
    }
    if let Some(keeper) = keeper {
        claim_state_dir(config, keeper)?;
    }
    if let Some(instance) = &config.state.instance {
        crate::store::owner::claim_instance(&config.state.dir, instance)
            .map_err(|e| BridgeError::io(format!("state dir {}", config.state.dir.display()), e))?;
    }
    let locks = Arc::new(FileLocks::new(lock_dir).map_err(lock_dir_error)?);
    crate::store::owner::claim_lock_dir(lock_dir, &config.driver, &config.state.dir)
        .map_err(lock_dir_error)?;
    Ok(Shared {
        settings,
        driver,
        volume_settings,
        locks,
        clock: Arc::new(SystemClock),
        recorder: Arc::new(PrometheusRecorder::new(config.metrics.volume_ids, label)),
        kube,
    })
}

fn open_controller(config: &Config, shared: &Shared) -> Result<ControllerSide, BridgeError> {
    let store = controller_store(config, shared.kube.as_ref())?;
    let snapshots = snapshot_store(config, shared.kube.as_ref())?;
    let record_key = record_key_source(config, shared.kube.as_ref());
    Ok(ControllerSide::new(
        shared.settings.clone(),
        ControllerPorts {
            driver: shared.driver.clone(),
            store,
            record_key,
            settings: shared.volume_settings.clone(),
            locks: shared.locks.clone(),
            clock: shared.clock.clone(),
            recorder: shared.recorder.clone(),
            snapshots,
        },
    ))
}

/// The controller store's snapshot records: CubeVolumeSnapshot objects, or a table of
/// the embedded store's file.
pub fn snapshot_store(
    config: &Config,
    kube: Option<&Arc<Kube>>,
) -> Result<Arc<dyn crate::bridge::ports::SnapshotStore>, BridgeError> {
    Ok(match (config.state.controller_store, kube) {
        (ControllerStoreKind::Kubernetes, Some(kube)) => {
            Arc::new(CubeSnapshotStore::new(kube.clone(), &config.driver))
        }
        (ControllerStoreKind::Kubernetes, None) => {
            unreachable!("a Kubernetes store makes the config use Kubernetes")
        }
        (ControllerStoreKind::Embedded, _) => {
            Arc::new(Arc::new(EmbeddedStore::open(&config.state.store_path())?))
        }
    })
}

/// The node side's directories under the volume base dirs, with the config's policy for
/// who may own a base dir.
pub fn host_dirs(config: &Config) -> HostDirs {
    HostDirs::new(match &config.node.untrusted_base_dir_reason {
        Some(reason) => BaseDirPolicy::AnyOwner {
            reason: reason.clone(),
        },
        None => BaseDirPolicy::Strict,
    })
}

fn open_node(
    config: &Config,
    shared: &Shared,
    mounts: Arc<dyn MountCheck>,
) -> Result<NodeSide, BridgeError> {
    let dir = config.state.journal_dir();
    let journal = FileJournal::open(&dir)
        .map_err(|e| BridgeError::io(format!("node journal {}", dir.display()), e))?;
    Ok(NodeSide::new(
        shared.settings.clone(),
        NodePorts {
            driver: shared.driver.clone(),
            journal: Arc::new(journal),
            settings: shared.volume_settings.clone(),
            mounts,
            host_paths: Arc::new(host_dirs(config)),
            locks: shared.locks.clone(),
            recorder: shared.recorder.clone(),
            boot_id: shared
                .clock
                .boot_id()
                .map_err(|e| BridgeError::io("the node side", e))?,
            clock: shared.clock.clone(),
        },
    ))
}

/// Where the key the controller records are signed with is. The embedded store's key
/// sits beside it; a shared store's key comes from where every replica can read it.
pub fn record_key_source(config: &Config, kube: Option<&Arc<Kube>>) -> Arc<dyn RecordKeySource> {
    match (kube, config.state.controller_store) {
        (Some(kube), ControllerStoreKind::Kubernetes) => Arc::new(SecretKeySource::new(
            kube.clone(),
            &config.record_key_secret(),
            config.kubernetes.record_key_sha256.as_deref(),
        )),
        _ => Arc::new(FileKeySource::new(&config.state.dir.join("record.key"))),
    }
}

/// The controller store backend the config names.
pub fn controller_store(
    config: &Config,
    kube: Option<&Arc<Kube>>,
) -> Result<Arc<dyn ControllerStore>, BridgeError> {
    Ok(match (config.state.controller_store, kube) {
        (ControllerStoreKind::Kubernetes, Some(kube)) => {
            Arc::new(CubeVolumeStore::new(kube.clone(), &config.driver))
        }
        (ControllerStoreKind::Kubernetes, None) => {
            unreachable!("a Kubernetes store makes the config use Kubernetes")
        }
        (ControllerStoreKind::Embedded, _) => {
            claim_state_dir(config, Keeper::Controller)?;
            Arc::new(Arc::new(EmbeddedStore::open(&config.state.store_path())?))
        }
    })
}

/// Claims `state.dir` for this driver, lock dir and the CSI endpoint whose volumes the
/// `keeper` records before any record is read or written there (`store::owner`): a bridge
/// of another config file that named the same dir is refused, with the fix.
fn claim_state_dir(config: &Config, keeper: Keeper) -> Result<(), BridgeError> {
    let csi_endpoint = keeper_endpoint(config, keeper);
    crate::store::owner::claim(
        &config.state.dir,
        &state_owner(config, keeper, &csi_endpoint),
    )
    .map_err(|e| BridgeError::io(format!("state dir {}", config.state.dir.display()), e))
}

/// For a command that only reads the state dir: it is checked as `serve` checks it (a
/// dir another user could write or replace is refused) and must not be another bridge's;
/// nothing is written. `Ok(false)`: there is no state dir, so nothing is recorded.
pub fn check_state_dir_to_read(config: &Config, keeper: Keeper) -> Result<bool, BridgeError> {
    let dir = &config.state.dir;
    check_state_dir(config)?;
    if !dir.exists() {
        return Ok(false);
    }
    let csi_endpoint = keeper_endpoint(config, keeper);
    crate::store::owner::check_claimed(dir, &state_owner(config, keeper, &csi_endpoint))
        .map_err(|e| BridgeError::io(format!("state dir {}", dir.display()), e))?;
    Ok(true)
}

/// Refuses a state dir another user could write or replace (`fsutil::check_private_dir`).
fn check_state_dir(config: &Config) -> Result<(), BridgeError> {
    let dir = &config.state.dir;
    crate::store::fsutil::check_private_dir(dir, "state.dir", crate::store::owner::STATE_DIR_RISK)
        .map_err(|e| BridgeError::io(format!("state dir {}", dir.display()), e))
}

fn keeper_endpoint(config: &Config, keeper: Keeper) -> String {
    match keeper {
        Keeper::Node => config.csi.endpoint.to_string(),
        Keeper::Controller => config.csi.controller().to_string(),
    }
}

fn state_owner<'a>(
    config: &'a Config,
    keeper: Keeper,
    csi_endpoint: &'a str,
) -> crate::store::owner::Owner<'a> {
    crate::store::owner::Owner {
        driver: &config.driver,
        lock_dir: &config.state.lock_dir,
        keeper,
        csi_endpoint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    fn config_in(dir: &std::path::Path) -> Config {
        let d = dir.display();
        Config::parse(
            &format!(
                "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\n\
                 dir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n[node]\n\
                 default_volume_base_dir = \"{d}/vol\"\n"
            ),
            std::path::Path::new("/test.toml"),
        )
        .unwrap()
    }

    #[test]
    fn a_state_dir_another_user_could_write_is_refused_before_anything_opens() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
        let mounts = Arc::new(crate::mount::MountView::new(
            &crate::config::MountViewSetting::Unchecked,
            false,
        ));
        let config = config_in(tmp.path());
        let err = open_hot_node(&config, mounts.clone())
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("state.dir") && err.contains("(mode 777)") && err.contains("chmod go-w"),
            "{err}"
        );
        assert!(!tmp.path().join("locks").exists(), "the lock dir was made");
        assert!(
            std::fs::read_dir(&state).unwrap().next().is_none(),
            "state written"
        );

        // Kept by its owner alone it opens; and a state dir not made yet is judged by the
        // directories above it.
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
        open_hot_node(&config, mounts.clone()).map(|_| ()).unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let missing = config_in(&tmp.path().join("later"));
        let err = open_hot_node(&missing, mounts)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("above state.dir"), "{err}");
    }

    /// A controller-only and a node-only bridge of one driver, each on its own CSI
    /// endpoint, share a state dir (docs/security.md): the controller-only one claims only
    /// the controller's endpoint. Before, it claimed the node's too, with its own endpoint,
    /// and whichever started second was refused as another bridge's.
    #[test]
    fn a_controller_only_and_a_node_only_bridge_of_one_driver_share_a_state_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let mounts = Arc::new(crate::mount::MountView::new(
            &crate::config::MountViewSetting::Unchecked,
            false,
        ));
        let d = tmp.path().display();
        let on = |endpoint: &str| {
            Config::parse(
                &format!(
                    "driver = \"fk\"\n[csi]\nendpoint = \"{endpoint}\"\n[state]\n\
                     dir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n[node]\n\
                     default_volume_base_dir = \"{d}/vol\"\n"
                ),
                std::path::Path::new("/test.toml"),
            )
            .unwrap()
        };
        let controller = on("/run/controller.sock");
        let node = on("/run/node.sock");
        for _ in 0..2 {
            open_sides(&controller, Roles::CONTROLLER, mounts.clone())
                .map(|_| ())
                .unwrap();
            open_sides(&node, Roles::NODE, mounts.clone())
                .map(|_| ())
                .unwrap();
        }
    }

    /// Two bridges of separate config files naming one state dir: the second is refused
    /// before it makes its lock dir or reads a record (before, it opened, and each one's
    /// scan could tear down the other's volumes through the wrong driver).
    #[test]
    fn a_state_dir_another_bridge_keeps_records_in_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let mounts = Arc::new(crate::mount::MountView::new(
            &crate::config::MountViewSetting::Unchecked,
            false,
        ));
        let first = config_in(tmp.path());
        open_hot_node(&first, mounts.clone()).map(|_| ()).unwrap();
        let d = tmp.path().display();
        let second = Config::parse(
            &format!(
                "driver = \"other\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\n\
                 dir = \"{d}/state\"\nlock_dir = \"{d}/other-locks\"\n[node]\n\
                 default_volume_base_dir = \"{d}/vol\"\n"
            ),
            std::path::Path::new("/other.toml"),
        )
        .unwrap();
        for roles in [Roles::NODE, Roles::CONTROLLER, Roles::BOTH] {
            let err = open_sides(&second, roles, mounts.clone())
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("belongs to another bridge")
                    && err.contains("driver \"fk\"")
                    && err.contains("driver \"other\""),
                "{err}"
            );
        }
        assert!(
            open_hot_node(&second, mounts.clone()).is_err(),
            "the hook's front opened"
        );
        assert!(
            !tmp.path().join("other-locks").exists(),
            "its lock dir was made"
        );
        assert!(!tmp.path().join("state/controller.redb").exists());
        // The first bridge keeps its dir, its own restart included.
        open_sides(&first, Roles::BOTH, mounts).map(|_| ()).unwrap();
    }

    /// A config of driver `driver` in `dir`, its state in `dir/<state>` and its locks in
    /// `dir/locks`, with `extra` lines in its [state] table.
    fn claims_config(dir: &Path, driver: &str, state: &str, extra: &str) -> Config {
        let d = dir.display();
        Config::parse(
            &format!(
                "driver = \"{driver}\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\n\
                 dir = \"{d}/{state}\"\nlock_dir = \"{d}/locks\"\n{extra}[node]\n\
                 default_volume_base_dir = \"{d}/vol\"\n"
            ),
            Path::new("/test.toml"),
        )
        .unwrap()
    }

    /// `second` is refused in every role (the error passing `refusal`), and by the hook's
    /// front, while `first` opens before and after.
    fn refused_beside(first: &Config, second: &Config, refusal: impl Fn(&str) -> bool) {
        let mounts = Arc::new(crate::mount::MountView::new(
            &crate::config::MountViewSetting::Unchecked,
            false,
        ));
        open_sides(first, Roles::BOTH, mounts.clone())
            .map(|_| ())
            .unwrap();
        for roles in [Roles::NODE, Roles::CONTROLLER, Roles::BOTH] {
            let err = open_sides(second, roles, mounts.clone())
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(refusal(&err), "{err}");
        }
        assert!(open_hot_node(second, mounts.clone()).is_err());
        open_sides(first, Roles::BOTH, mounts).map(|_| ()).unwrap();
    }

    /// Two installations of one driver alike in everything else (two Helm releases of
    /// one driver name) but `state.instance`: the second is refused, naming both; before,
    /// it opened, and its start-up scan could tear the first one's volumes down through
    /// its own CSI driver.
    #[test]
    fn a_state_dir_another_instance_claimed_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let as_instance = |instance: &str| {
            claims_config(
                tmp.path(),
                "fk",
                "state",
                &format!("instance = \"{instance}\"\n"),
            )
        };
        refused_beside(&as_instance("ns-a/nfs"), &as_instance("ns-b/nfs"), |err| {
            err.contains("ns-a/nfs") && err.contains("ns-b/nfs")
        });
        // Refused before it claimed anything: no endpoint file of the controller side
        // (which the first one, opened with both roles, also claimed) is the second's,
        // and a controller-only second one added none.
        let claimed = |name: &str| std::fs::read_to_string(tmp.path().join("state").join(name));
        let before = claimed("owner.controller_csi_endpoint").unwrap();
        std::fs::remove_file(tmp.path().join("state/owner.controller_csi_endpoint")).unwrap();
        let mounts = Arc::new(crate::mount::MountView::new(
            &crate::config::MountViewSetting::Unchecked,
            false,
        ));
        open_sides(&as_instance("ns-b/nfs"), Roles::CONTROLLER, mounts)
            .map(|_| ())
            .unwrap_err();
        assert!(
            claimed("owner.controller_csi_endpoint").is_err(),
            "the refused one claimed the controller's endpoint: was {before:?}"
        );
    }

    /// Two bridges of one driver (a daemon's config and a forked hook's, say) with
    /// separate state dirs but one lock dir (the default one, by driver name): the second
    /// is refused, naming both state dirs; before, each kept its own journal of volumes
    /// at the same paths, and a Detach reaching the other one tore down what this one
    /// attached.
    #[test]
    fn a_lock_dir_another_state_dir_uses_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().display();
        let first = claims_config(tmp.path(), "fk", "state", "");
        refused_beside(
            &first,
            &claims_config(tmp.path(), "fk", "other-state", ""),
            |err| {
                err.contains("another bridge of driver \"fk\"")
                    && err.contains(&format!("{d}/state\""))
                    && err.contains(&format!("{d}/other-state\""))
            },
        );
        // The refused one claimed nothing of its own (it may be pointed elsewhere).
        assert!(
            !tmp.path().join("other-state/owner").exists(),
            "the refused bridge claimed its state dir"
        );
        let mounts = Arc::new(crate::mount::MountView::new(
            &crate::config::MountViewSetting::Unchecked,
            false,
        ));
        // The same dir spelled with a trailing slash is the same bridge; another driver
        // may share the lock dir (each volume's lock is its own).
        for (driver, state) in [("fk", "state/"), ("other", "other-state")] {
            open_sides(
                &claims_config(tmp.path(), driver, state, ""),
                Roles::BOTH,
                mounts.clone(),
            )
            .map(|_| ())
            .unwrap_or_else(|e| panic!("{driver} in {state}: {e}"));
        }
    }
}
