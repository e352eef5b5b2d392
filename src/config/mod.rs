//! The bridge's config: the typed settings every other module reads.
//!
//! A `Config` is one Cube driver name backed by one CSI driver. A file configures one
//! driver (its tables at the top level), or several served by one daemon (a `[[drivers]]`
//! list of such entries, and one `[metrics]` for the process). The file (file.rs) is parsed
//! into typed values here, every field checked with its name in the error, before anything
//! is bound, mounted or written: endpoints are parsed endpoints, the mount view and the
//! roles are enums, and every default is resolved, so nothing later can find an invalid
//! value. Where the file is found, and which of its drivers a forked hook serves, is in
//! locate.rs.

mod file;
pub mod locate;
pub mod volume_settings;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use crate::bridge::ports::{Segments, TopologyRequirement};
pub use crate::bridge::{AccessMode, Roles};
use crate::csi::Endpoint;
use crate::k8s::names::{dns_name_chars, is_dns_label, is_dns_subdomain, is_label_value};
pub use locate::{
    CONFIG_DIR, CONFIG_ENV, DEFAULT_CONFIG_PATH, DriverChoice, EXECUTABLE_PREFIX, Located,
    Replaceable, check_trusted_file, locate, others_may_add_names, untrusted_on_the_way,
};

/// Where Cube's node agent keeps plugin volumes when the request does not say.
pub const DEFAULT_VOLUME_BASE_DIR: &str = "/data/cube-shared/volume";
/// The mount-namespace file of a standard Cubelet install.
pub const CUBELET_MOUNT_NS: &str = "/usr/local/services/cubetoolbox/cubeletmnt/mnt";

/// A config problem, always with the file and the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The TOML does not parse or does not fit the schema. The message never quotes the
    /// file's text or values: the file may hold secrets.
    #[error("config file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    /// The file's permissions let other users read its secrets or change it.
    #[error("config file {path}: {message}")]
    Insecure { path: PathBuf, message: String },
    #[error(
        "config file {path}: {}{field}: {message}",
        .entry.as_deref().map(|e| format!("{e}: ")).unwrap_or_default()
    )]
    Invalid {
        path: PathBuf,
        /// In a file listing `[[drivers]]`: which entry (`drivers[1] (nfs)`).
        entry: Option<String>,
        field: &'static str,
        message: String,
    },
    /// The file's drivers, taken together, or the choice of one of them, do not work.
    #[error("config file {path}: {message}")]
    Drivers { path: PathBuf, message: String },
}

/// The whole, validated config.
#[derive(Debug, Clone)]
pub struct Config {
    /// The Cube driver name this instance serves (the `name` registered in CubeMaster and
    /// Cubelet). It prefixes every host_path: `<volume_base_dir>/<driver>+<volume_id>`.
    pub driver: String,
    pub csi: CsiSettings,
    pub serve: ServeSettings,
    pub volume: CsiVolumeSettings,
    pub secrets: SecretsSettings,
    pub state: StateSettings,
    pub node: NodeSettings,
    pub timeouts: TimeoutSettings,
    pub kubernetes: KubernetesSettings,
    pub controller: ControllerSettings,
    pub metrics: MetricsSettings,
    /// The file this config was read from (for messages).
    pub source: PathBuf,
}

/// How to reach the CSI driver.
#[derive(Debug, Clone)]
pub struct CsiSettings {
    /// The driver's node (and, by default, controller) endpoint: a Unix socket.
    pub endpoint: Endpoint,
    /// Where controller calls go when the driver's controller is elsewhere: a Unix
    /// socket or `http://host:port`.
    pub controller_endpoint: Option<Endpoint>,
    /// Use this node id for ControllerPublish instead of asking NodeGetInfo.
    pub node_id: Option<String>,
    /// Users besides root and the bridge's own whose processes may serve the driver's
    /// Unix sockets (a driver that runs as another user); anyone else's is refused.
    pub driver_uids: Vec<u32>,
}

impl CsiSettings {
    /// Where controller calls go.
    pub fn controller(&self) -> &Endpoint {
        self.controller_endpoint.as_ref().unwrap_or(&self.endpoint)
    }
}

/// The daemon's listeners.
#[derive(Debug, Clone)]
pub struct ServeSettings {
    /// The Unix socket Cube dials.
    pub socket: PathBuf,
    pub roles: Roles,
    /// Optional TCP listener (loopback unless `allow_remote_tcp`).
    pub tcp: Option<SocketAddr>,
    /// How long in-flight hooks may run after SIGTERM before the daemon exits anyway.
    pub shutdown_grace: Duration,
    /// Group owning the socket, as a numeric gid (resolved from a name at load).
    pub socket_gid: Option<u32>,
    /// Peer uids allowed to call over the socket or TCP; `None` allows anyone who can
    /// reach the listener.
    pub allowed_uids: Option<Vec<u32>>,
}

/// What every CreateVolume, NodeStage and NodePublish asks for.
#[derive(Clone, Default)]
pub struct CsiVolumeSettings {
    /// Prefix of the CSI volume name; the rest is the Cube volume_id.
    pub name_prefix: String,
    /// CreateVolume capacity_range.required_bytes; 0 leaves it unset.
    pub capacity_bytes: u64,
    pub access_mode: AccessMode,
    /// VolumeCapability.mount.fs_type; empty lets the driver choose.
    pub fs_type: String,
    /// VolumeCapability.mount.mount_flags. May hold credentials: never logged.
    pub mount_flags: Vec<String>,
    /// CreateVolume parameters (a StorageClass's `parameters`).
    pub parameters: BTreeMap<String, String>,
    /// The group id NodeStage and NodePublish ask the driver to mount with
    /// (`volume_mount_group`; needs the driver's VOLUME_MOUNT_GROUP).
    pub mount_group: Option<u32>,
    /// CreateVolume's accessibility_requirements (needs the driver's
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS).
    pub accessibility: Option<TopologyRequirement>,
}

impl fmt::Debug for CsiVolumeSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CsiVolumeSettings")
            .field("name_prefix", &self.name_prefix)
            .field("capacity_bytes", &self.capacity_bytes)
            .field("access_mode", &self.access_mode)
            .field("fs_type", &self.fs_type)
            .field(
                "mount_flags",
                &format_args!("<{} redacted>", self.mount_flags.len()),
            )
            .field("parameters", &self.parameters)
            .field("mount_group", &self.mount_group)
            .field("accessibility", &self.accessibility)
            .finish()
    }
}

/// CSI secrets per call family, as a StorageClass's secret references would give them.
#[derive(Clone, Default)]
pub struct SecretsSettings {
    /// CreateVolume and DeleteVolume.
    pub provisioner: BTreeMap<String, String>,
    /// ControllerPublishVolume and ControllerUnpublishVolume.
    pub controller_publish: BTreeMap<String, String>,
    /// NodeStageVolume.
    pub node_stage: BTreeMap<String, String>,
    /// NodePublishVolume.
    pub node_publish: BTreeMap<String, String>,
    /// ControllerExpandVolume (`cube-csi-bridge expand`).
    pub controller_expand: BTreeMap<String, String>,
    /// NodeExpandVolume.
    pub node_expand: BTreeMap<String, String>,
}

impl SecretsSettings {
    /// Every secret value, for tests and log scrubbing checks.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        [
            &self.provisioner,
            &self.controller_publish,
            &self.node_stage,
            &self.node_publish,
            &self.controller_expand,
            &self.node_expand,
        ]
        .into_iter()
        .flat_map(|m| m.values().map(String::as_str))
    }

    pub fn is_empty(&self) -> bool {
        self.values().next().is_none()
    }
}

impl fmt::Debug for SecretsSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys = |m: &BTreeMap<String, String>| m.keys().cloned().collect::<Vec<_>>();
        f.debug_struct("SecretsSettings")
            .field("provisioner_keys", &keys(&self.provisioner))
            .field("controller_publish_keys", &keys(&self.controller_publish))
            .field("node_stage_keys", &keys(&self.node_stage))
            .field("node_publish_keys", &keys(&self.node_publish))
            .field("controller_expand_keys", &keys(&self.controller_expand))
            .field("node_expand_keys", &keys(&self.node_expand))
            .finish()
    }
}

/// Where state lives on this host.
#[derive(Debug, Clone)]
pub struct StateSettings {
    /// Controller store and node journal. Default: `/var/lib/cube-csi-bridge/<driver>`.
    pub dir: PathBuf,
    /// Per-volume lock files. Default: `/run/cube-csi-bridge/<driver>/locks`.
    pub lock_dir: PathBuf,
    /// Which installation of the driver this bridge is, claimed in the state dir: two
    /// installations whose other settings agree (two Helm releases of one driver name,
    /// whose paths and in-container endpoint are alike) are told apart by it.
    pub instance: Option<String>,
    /// Where Create records the CSI handle that Destroy needs.
    pub controller_store: ControllerStoreKind,
    /// Where a forked hook's worker logs once it has answered (Cube no longer reads its
    /// stderr then).
    pub worker_log: WorkerLog,
}

/// Where a forked hook's worker logs once it has answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerLog {
    /// The systemd journal when it runs, else `<state.dir>/worker.log`. The default.
    Auto,
    /// The systemd journal (nothing when it does not run).
    Journal,
    /// This file (appended to; kept under a few MiB by one rotation to `<file>.1`).
    File(PathBuf),
}

impl StateSettings {
    /// The embedded controller store file.
    pub fn store_path(&self) -> PathBuf {
        self.dir.join("controller.redb")
    }

    /// The node journal directory.
    pub fn journal_dir(&self) -> PathBuf {
        self.dir.join("node")
    }
}

/// The controller store's backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControllerStoreKind {
    /// One file under `state.dir`: one controller host.
    Embedded,
    /// CubeVolume custom resources: any number of controller replicas.
    Kubernetes,
}

/// The Kubernetes API: where it is, and what the bridge reads from it.
#[derive(Debug, Clone, Default)]
pub struct KubernetesSettings {
    /// A kubeconfig file. Unset: `$KUBECONFIG` or `~/.kube/config` when there is one, else
    /// the pod's service account (kube's order: on a host with an admin kubeconfig in
    /// root's home, set this to the bridge's own).
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the CubeVolume objects. Unset: the service account's namespace (or
    /// the kubeconfig context's), else `default`.
    pub namespace: Option<String>,
    /// Take CreateVolume parameters, mount options, fstype and secrets from this
    /// StorageClass instead of `[volume]` and `[secrets]`.
    pub storage_class: Option<String>,
    /// How long a StorageClass and its Secrets are reused before being read again.
    pub cache: Duration,
    /// The Secret (in the CubeVolume namespace) holding the key controller records are
    /// signed with; the bridge makes it on first use. Only the controller side reads it.
    /// Default: `cube-csi-bridge-<driver>-record-key` (see `Config::record_key_secret`).
    pub record_key_secret: Option<String>,
    /// The SHA-256 (lower-case hex) of the record key the operator pinned: a key Secret
    /// holding another key is refused, and a missing one is never made anew.
    pub record_key_sha256: Option<String>,
}

/// Whose view of the mount table decides that a host_path is really mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountViewSetting {
    /// Cubelet's namespace file when it exists (looked up at every check, so a daemon
    /// started before Cubelet follows it once it appears), else this process's; a forked
    /// hook already runs in Cubelet's namespace and uses its own.
    Auto,
    /// This process's mount namespace.
    Own,
    /// No check: the driver's answers and the journal are trusted.
    Unchecked,
    /// The mount namespace bound at this file.
    Namespace(PathBuf),
}

impl MountViewSetting {
    pub fn parse(value: &str) -> Result<Self, String> {
        match value {
            "auto" => Ok(Self::Auto),
            "self" => Ok(Self::Own),
            "none" => Ok(Self::Unchecked),
            path if path.starts_with('/') => Ok(Self::Namespace(PathBuf::from(path))),
            other => Err(format!(
                "{other:?} must be auto, self, none or an absolute namespace file path"
            )),
        }
    }
}

/// Node-side behaviour.
#[derive(Debug, Clone)]
pub struct NodeSettings {
    /// Used when an Attach carries no volume_base_dir.
    pub default_volume_base_dir: PathBuf,
    /// The only base dirs an Attach may name (the bridge creates directories and the
    /// driver mounts there, as root). Default: the default base dir.
    pub allowed_base_dirs: Vec<PathBuf>,
    pub mount_view: MountViewSetting,
    /// Why base dirs of any owner and mode are accepted (`node.allow_untrusted_base_dir`);
    /// `None`: a base dir must be owned by root (or the bridge's uid) and writable by no
    /// group or other user.
    pub untrusted_base_dir_reason: Option<String>,
    /// A holder whose namespace has made no Attach or Detach on this node for this long
    /// is reported stale (`list`, a metric): maybe a phantom Cube never learned of, for an
    /// operator to release. `None`: never reported.
    pub stale_holder_after: Option<Duration>,
}

impl NodeSettings {
    /// Whether Attach may use `dir` (compared as written: Cube checks host_paths
    /// lexically too).
    pub fn base_dir_allowed(&self, dir: &Path) -> bool {
        self.allowed_base_dirs.iter().any(|a| a == dir)
    }
}

/// Controller-side housekeeping.
#[derive(Debug, Clone)]
pub struct ControllerSettings {
    /// How often the daemon looks for abandoned Creates; `None` turns the sweep off.
    pub sweep_interval: Option<Duration>,
    /// A `Creating` record untouched for this long is an abandoned Create.
    pub abandoned_create_after: Duration,
    /// Cube volume ids whose records carry no MAC and are to be signed (once per
    /// process): records the operator checked against the storage backend. Only the
    /// embedded store's records are signed without being named, when its key is made.
    pub sign_unsigned_records: Vec<String>,
}

/// The Prometheus endpoint.
#[derive(Debug, Clone)]
pub struct MetricsSettings {
    /// Where `GET /metrics` is served; `None` (the default) serves nothing.
    pub listen: Option<SocketAddr>,
    /// How often the daemon asks the driver for attached volumes' stats
    /// (NodeGetVolumeStats, when the driver offers it); `None` never.
    pub volume_stats_interval: Option<Duration>,
    /// How the per-volume series name their volume.
    pub volume_ids: VolumeIdLabels,
    /// Every series carries a `driver` label: the file lists `[[drivers]]`, so several
    /// drivers share the process's endpoint. A one-driver file keeps its series as they
    /// were.
    pub driver_label: bool,
}

/// How the per-volume metrics series (`volume_id` label) name their volume: the endpoint
/// has no authentication, and Cube volume ids often say whose data they hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VolumeIdLabels {
    /// A stable hash of the id (`sha256:` and 16 hex digits): series stay apart and can
    /// be matched to a volume by whoever knows its id, but do not reveal it. The default.
    #[default]
    Hashed,
    /// The volume id itself.
    Plain,
    /// No per-volume series at all (the node totals remain).
    None,
}

/// Per-hook budgets: all CSI calls and retries of one hook fit in its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeoutSettings {
    pub create: Duration,
    pub destroy: Duration,
    /// Cube's Attach shares the sandbox create deadline (300 s by default).
    pub attach: Duration,
    /// Cube gives Detach about 30 s on sandbox destroy and 10 s on create failover.
    pub detach: Duration,
    /// Extra time a failed Attach or Create may spend undoing its own work.
    pub rollback: Duration,
}

const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 30;
const DEFAULT_SWEEP_INTERVAL_SECS: u64 = 300;
/// A holder's namespace quiet for a day is worth an operator's look.
const DEFAULT_STALE_HOLDER_SECS: u64 = 86_400;
/// The longest `node.stale_holder_secs`: a year.
const MAX_STALE_HOLDER_SECS: u64 = 366 * 86_400;
/// An abandoned Create is judged only well after any Create could still be running.
const MIN_ABANDONED_CREATE_SECS: u64 = 600;

impl Config {
    /// Reads, parses and validates a config file that configures one driver (or lists
    /// exactly one); a file listing several needs `load_driver`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_driver(path, &DriverChoice::Any)
    }

    /// Reads a config file and takes the driver `choice` names from it.
    pub fn load_driver(path: &Path, choice: &DriverChoice) -> Result<Self, ConfigError> {
        choose(Self::load_all(path)?, choice, path)
    }

    /// Reads, parses and validates a config file: every driver it configures, in order.
    pub fn load_all(path: &Path) -> Result<Vec<Self>, ConfigError> {
        // Read through one descriptor whose file is the one checked: by path twice, a file
        // swapped or unlinked between the read and the check was read unchecked.
        let read = |source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(read)?;
        let opened = file.metadata().map_err(read)?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut file, &mut text).map_err(read)?;
        let mut configs = Self::parse_all(&text, path)?;
        if let Ok(instance) = std::env::var(INSTANCE_ENV) {
            for config in configs.iter_mut().filter(|c| c.state.instance.is_none()) {
                check_instance(&instance).map_err(|why| ConfigError::Invalid {
                    path: path.to_path_buf(),
                    entry: None,
                    field: INSTANCE_ENV,
                    message: why,
                })?;
                config.state.instance = Some(instance.clone());
            }
        }
        let holds_secrets = configs.iter().any(|c| !c.secrets.is_empty());
        let mount_flags: Vec<String> = configs
            .iter()
            .flat_map(|c| c.volume.mount_flags.iter().cloned())
            .collect();
        locate::check_access(path, &opened, holds_secrets, &mount_flags).map_err(|message| {
            ConfigError::Insecure {
                path: path.to_path_buf(),
                message,
            }
        })?;
        Ok(configs)
    }

    /// Parses and validates the text of a one-driver config; `path` only names it in
    /// errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        choose(Self::parse_all(text, path)?, &DriverChoice::Any, path)
    }

    /// Parses and validates config text of either form: every driver, in order.
    pub fn parse_all(text: &str, path: &Path) -> Result<Vec<Self>, ConfigError> {
        let parse_error = |e: toml::de::Error| ConfigError::Parse {
            path: path.to_path_buf(),
            message: describe_toml_error(text, &e),
        };
        let form: file::FileForm = toml::from_str(text).map_err(parse_error)?;
        if form.drivers.is_none() {
            let mut raw: file::ConfigFile = toml::from_str(text).map_err(parse_error)?;
            let metrics = raw.metrics.take().unwrap_or_default();
            let checker = Checker { path, entry: None };
            let metrics = checker.metrics(metrics, false)?;
            return Ok(vec![checker.config(raw, metrics)?]);
        }
        let raw: file::DriversFile = toml::from_str(text).map_err(parse_error)?;
        let metrics = Checker { path, entry: None }.metrics(raw.metrics, true)?;
        let mut configs = Vec::with_capacity(raw.drivers.len());
        for (index, entry) in raw.drivers.into_iter().enumerate() {
            let checker = Checker {
                path,
                entry: Some(format!("drivers[{index}] ({})", entry.driver)),
            };
            if entry.metrics.is_some() {
                return Err(checker.invalid(
                    "metrics",
                    "is set once for the daemon, at the top level of a file listing \
                     [[drivers]]; move it there",
                ));
            }
            configs.push(checker.config(entry, metrics.clone())?);
        }
        check_apart(&configs).map_err(|message| ConfigError::Drivers {
            path: path.to_path_buf(),
            message,
        })?;
        Ok(configs)
    }

    /// Whether anything in this config needs the Kubernetes API.
    pub fn uses_kubernetes(&self) -> bool {
        self.kubernetes.storage_class.is_some()
            || self.state.controller_store == ControllerStoreKind::Kubernetes
    }

    /// The Secret holding the CubeVolume record key: `kubernetes.record_key_secret`, else
    /// `cube-csi-bridge-<driver>-record-key` with the driver name made a DNS label (the
    /// chart renders the same name and grants exactly it).
    pub fn record_key_secret(&self) -> String {
        self.kubernetes
            .record_key_secret
            .clone()
            .unwrap_or_else(|| {
                format!(
                    "cube-csi-bridge-{}-record-key",
                    dns_name_chars(&self.driver)
                )
            })
    }

    /// The socket Cube dials.
    pub fn socket_path(&self) -> &Path {
        &self.serve.socket
    }
}

/// The driver `choice` names among `configs`, all read from `path`.
fn choose(
    mut configs: Vec<Config>,
    choice: &DriverChoice,
    path: &Path,
) -> Result<Config, ConfigError> {
    let names = || {
        configs
            .iter()
            .map(|c| c.driver.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let listed = configs.first().is_some_and(|c| c.metrics.driver_label);
    let wanted = match choice {
        DriverChoice::Any => None,
        DriverChoice::IfListed(name) => listed.then_some(name),
        DriverChoice::Named(name) => Some(name),
    };
    let found = match wanted {
        Some(name) => configs
            .iter()
            .position(|c| &c.driver == name)
            .ok_or_else(|| {
                format!(
                    "has no driver {name:?} (it configures {}); name one of those with --driver, \
                 or invoke the hook as cube-csi-bridge-<driver>",
                    names()
                )
            }),
        None if configs.len() == 1 => Ok(0),
        None => Err(format!(
            "configures several drivers ({}); name one with --driver, or invoke the hook as \
             cube-csi-bridge-<driver>",
            names()
        )),
    };
    match found {
        Ok(index) => Ok(configs.swap_remove(index)),
        Err(message) => Err(ConfigError::Drivers {
            path: path.to_path_buf(),
            message,
        }),
    }
}

/// Refuses drivers of one file that would share what each must own alone: a name, a
/// socket, a TCP port, state and lock dirs, or a record-key Secret. (Their host_paths never
/// meet: the leaf `<driver>+<volume_id>` splits one way only.)
fn check_apart(configs: &[Config]) -> Result<(), String> {
    if configs.is_empty() {
        return Err("[[drivers]] lists no driver".to_string());
    }
    for (i, a) in configs.iter().enumerate() {
        for b in &configs[i + 1..] {
            let (x, y) = (&a.driver, &b.driver);
            let shared = [
                (x == y, "a driver name"),
                (a.serve.socket == b.serve.socket, "serve.socket"),
                (
                    a.serve.tcp.is_some() && a.serve.tcp == b.serve.tcp,
                    "serve.tcp",
                ),
                (a.state.dir == b.state.dir, "state.dir"),
                (a.state.lock_dir == b.state.lock_dir, "state.lock_dir"),
                (
                    a.state.controller_store == ControllerStoreKind::Kubernetes
                        && b.state.controller_store == ControllerStoreKind::Kubernetes
                        && a.record_key_secret() == b.record_key_secret(),
                    "kubernetes.record_key_secret",
                ),
            ];
            if let Some((_, what)) = shared.iter().find(|(same, _)| *same) {
                return Err(format!(
                    "drivers {x:?} and {y:?} share {what}; each driver needs its own"
                ));
            }
            // A socket is a file: one driver's dir beneath another's socket path (driver
            // `a.sock`'s default lock dir under driver `a`'s default socket) cannot both be.
            let dirs = |c: &Config| {
                [
                    ("state.dir", c.state.dir.clone()),
                    ("state.lock_dir", c.state.lock_dir.clone()),
                ]
            };
            for ((socket_of, owner), (dirs_of, other)) in [((a, x), (b, y)), ((b, y), (a, x))] {
                let socket = &socket_of.serve.socket;
                for (field, dir) in dirs(dirs_of) {
                    if dir.starts_with(socket) {
                        return Err(format!(
                            "driver {other:?}'s {field} {} lies under driver {owner:?}'s \
                             serve.socket {}; set either one elsewhere",
                            dir.display(),
                            socket.display()
                        ));
                    }
                }
            }
            // One CSI driver behind both: CreateVolume is idempotent by name, so equal
            // names would share a CSI volume, and one driver's sweep of its abandoned
            // Create would delete the volume the other handed to Cube.
            if a.csi.controller() == b.csi.controller()
                && a.volume.name_prefix == b.volume.name_prefix
            {
                return Err(format!(
                    "drivers {x:?} and {y:?} send CreateVolume to the same CSI endpoint with \
                     the same volume.name_prefix {:?}: a volume_id of each would name one CSI \
                     volume; give each its own volume.name_prefix",
                    a.volume.name_prefix
                ));
            }
        }
    }
    Ok(())
}

/// Turns the file into typed settings, naming the field of the first problem.
struct Checker<'a> {
    path: &'a Path,
    /// Which `[[drivers]]` entry is checked, in a file listing several.
    entry: Option<String>,
}

impl Checker<'_> {
    fn invalid(&self, field: &'static str, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_path_buf(),
            entry: self.entry.clone(),
            field,
            message: message.into(),
        }
    }

    fn config(
        &self,
        raw: file::ConfigFile,
        metrics: MetricsSettings,
    ) -> Result<Config, ConfigError> {
        let driver = raw.driver;
        let driver_ok = !driver.is_empty()
            && driver.len() <= 63
            && !driver.starts_with('.')
            && driver
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !driver_ok {
            return Err(self.invalid(
                "driver",
                format!(
                    "{driver:?} must be 1-63 characters of [A-Za-z0-9._-], not starting with '.'"
                ),
            ));
        }
        let csi = self.csi(raw.csi)?;
        let serve = self.serve(raw.serve, &driver)?;
        let volume = self.volume(raw.volume)?;
        let state = self.state(raw.state, &driver)?;
        let node = self.node(raw.node)?;
        let timeouts = self.timeouts(&raw.timeouts)?;
        let controller = self.controller(raw.controller, &raw.timeouts)?;
        let kubernetes = self.kubernetes_settings(raw.kubernetes)?;
        let config = Config {
            driver,
            csi,
            serve,
            volume,
            secrets: SecretsSettings {
                provisioner: raw.secrets.provisioner,
                controller_publish: raw.secrets.controller_publish,
                node_stage: raw.secrets.node_stage,
                node_publish: raw.secrets.node_publish,
                controller_expand: raw.secrets.controller_expand,
                node_expand: raw.secrets.node_expand,
            },
            state,
            node,
            timeouts,
            kubernetes,
            controller,
            metrics,
            source: self.path.to_path_buf(),
        };
        self.kubernetes(&config)?;
        Ok(config)
    }

    fn csi(&self, raw: file::CsiFile) -> Result<CsiSettings, ConfigError> {
        let endpoint =
            Endpoint::parse_unix(&raw.endpoint).map_err(|m| self.invalid("csi.endpoint", m))?;
        let controller_endpoint = raw
            .controller_endpoint
            .map(|ep| Endpoint::parse(&ep))
            .transpose()
            .map_err(|m| self.invalid("csi.controller_endpoint", m))?;
        if let Some(id) = &raw.node_id
            && (id.is_empty() || id.len() > 256)
        {
            return Err(self.invalid("csi.node_id", "must be 1-256 bytes"));
        }
        Ok(CsiSettings {
            endpoint,
            controller_endpoint,
            node_id: raw.node_id,
            driver_uids: raw.driver_uids,
        })
    }

    fn serve(&self, raw: file::ServeFile, driver: &str) -> Result<ServeSettings, ConfigError> {
        let socket = raw
            .socket
            .unwrap_or_else(|| format!("/run/cube-csi-bridge/{driver}.sock"));
        let socket = match Endpoint::parse_unix(&socket) {
            Ok(Endpoint::Unix(path)) => path,
            Ok(Endpoint::Tcp(_)) => unreachable!("parse_unix gives unix endpoints"),
            Err(m) => return Err(self.invalid("serve.socket", m)),
        };
        let roles = Roles::parse(raw.services.as_deref().unwrap_or("both"))
            .map_err(|m| self.invalid("serve.services", m))?;
        let tcp = match raw.tcp {
            None => None,
            Some(tcp) => {
                let addr: SocketAddr = tcp
                    .parse()
                    .map_err(|_| self.invalid("serve.tcp", format!("{tcp:?} is not ip:port")))?;
                if !addr.ip().is_loopback() && !raw.allow_remote_tcp {
                    return Err(self.invalid(
                        "serve.tcp",
                        format!(
                            "{addr} is not a loopback address; Cube's rpc transport has no TLS \
                             and no authentication, so set serve.allow_remote_tcp = true only \
                             on a trusted network"
                        ),
                    ));
                }
                Some(addr)
            }
        };
        let grace = raw
            .shutdown_grace_secs
            .unwrap_or(DEFAULT_SHUTDOWN_GRACE_SECS);
        if grace > 600 {
            return Err(self.invalid("serve.shutdown_grace_secs", "must be at most 600"));
        }
        let socket_gid = raw
            .socket_group
            .map(|group| resolve_group(&group))
            .transpose()
            .map_err(|m| self.invalid("serve.socket_group", m))?;
        if raw.allowed_uids.as_ref().is_some_and(Vec::is_empty) {
            return Err(self.invalid(
                "serve.allowed_uids",
                "is empty, which would refuse every caller; remove it to allow any caller",
            ));
        }
        if let (Some(addr), None) = (tcp, &raw.allowed_uids) {
            // A socket file has a mode and a group; a TCP port has neither, and Cube's rpc
            // transport no authentication: without the list any local user could call
            // every hook (and Destroy another user's volume).
            return Err(self.invalid(
                "serve.tcp",
                format!(
                    "{addr} is set without serve.allowed_uids, so any local user could call \
                     every hook over it; list the uids of Cubelet and CubeMaster in \
                     serve.allowed_uids (e.g. [0]), or remove serve.tcp"
                ),
            ));
        }
        Ok(ServeSettings {
            socket,
            roles,
            tcp,
            shutdown_grace: Duration::from_secs(grace),
            socket_gid,
            allowed_uids: raw.allowed_uids,
        })
    }

    fn volume(&self, volume: file::VolumeFile) -> Result<CsiVolumeSettings, ConfigError> {
        let prefix = &volume.name_prefix;
        if prefix.len() > 64 || prefix.chars().any(char::is_control) {
            return Err(self.invalid(
                "volume.name_prefix",
                "must be at most 64 bytes with no control characters",
            ));
        }
        // CSI's capacity_range is int64: the core and the driver adapter cast to it.
        if i64::try_from(volume.capacity_bytes).is_err() {
            return Err(self.invalid(
                "volume.capacity_bytes",
                format!("must be at most {}", i64::MAX),
            ));
        }
        let mount_group = volume
            .mount_group
            .as_ref()
            .map(mount_group)
            .transpose()
            .map_err(|m| self.invalid("volume.mount_group", m))?;
        let accessibility = volume
            .accessibility_requirements
            .map(accessibility)
            .transpose()
            .map_err(|m| self.invalid("volume.accessibility_requirements", m))?;
        let access_mode = volume
            .access_mode
            .as_deref()
            .map(crate::bridge::fit::parse_mode)
            .transpose()
            .map_err(|m| self.invalid("volume.access_mode", m))?
            .unwrap_or_default();
        Ok(CsiVolumeSettings {
            name_prefix: volume.name_prefix,
            capacity_bytes: volume.capacity_bytes,
            access_mode,
            fs_type: volume.fs_type,
            mount_flags: volume.mount_flags,
            parameters: volume.parameters,
            mount_group,
            accessibility,
        })
    }

    fn state(&self, raw: file::StateFile, driver: &str) -> Result<StateSettings, ConfigError> {
        for (dir, field) in [(&raw.dir, "state.dir"), (&raw.lock_dir, "state.lock_dir")] {
            if let Some(dir) = dir
                && !dir.is_absolute()
            {
                return Err(self.invalid(field, format!("{} must be absolute", dir.display())));
            }
        }
        let controller_store = match raw.controller_store.as_deref().unwrap_or("embedded") {
            "embedded" => ControllerStoreKind::Embedded,
            "kubernetes" => ControllerStoreKind::Kubernetes,
            other => {
                return Err(self.invalid(
                    "state.controller_store",
                    format!("{other:?} must be embedded or kubernetes"),
                ));
            }
        };
        let worker_log = match raw.worker_log.as_deref() {
            None | Some("auto") => WorkerLog::Auto,
            Some("journal") => WorkerLog::Journal,
            Some(path) if path.starts_with('/') => WorkerLog::File(PathBuf::from(path)),
            Some(other) => {
                return Err(self.invalid(
                    "state.worker_log",
                    format!("{other:?} must be auto, journal or an absolute file path"),
                ));
            }
        };
        if let Some(instance) = &raw.instance {
            check_instance(instance).map_err(|why| self.invalid("state.instance", why))?;
        }
        Ok(StateSettings {
            instance: raw.instance,
            worker_log,
            dir: raw
                .dir
                .unwrap_or_else(|| PathBuf::from("/var/lib/cube-csi-bridge").join(driver)),
            lock_dir: raw.lock_dir.unwrap_or_else(|| {
                PathBuf::from("/run/cube-csi-bridge")
                    .join(driver)
                    .join("locks")
            }),
            controller_store,
        })
    }

    fn node(&self, raw: file::NodeFile) -> Result<NodeSettings, ConfigError> {
        let base = raw
            .default_volume_base_dir
            .unwrap_or_else(|| PathBuf::from(DEFAULT_VOLUME_BASE_DIR));
        let base_ok = |dir: &Path| {
            crate::bridge::naming::validate_base_dir(&dir.to_string_lossy()).is_ok_and(|d| d == dir)
        };
        if !base_ok(&base) {
            return Err(self.invalid(
                "node.default_volume_base_dir",
                format!(
                    "{} must be an absolute, normalised path other than /",
                    base.display()
                ),
            ));
        }
        let allowed = raw.allowed_base_dirs.unwrap_or_else(|| vec![base.clone()]);
        if let Some(bad) = allowed.iter().find(|d| !base_ok(d)) {
            return Err(self.invalid(
                "node.allowed_base_dirs",
                format!(
                    "{} must be an absolute, normalised path other than /",
                    bad.display()
                ),
            ));
        }
        if !allowed.contains(&base) {
            return Err(self.invalid(
                "node.allowed_base_dirs",
                format!(
                    "must include node.default_volume_base_dir {}",
                    base.display()
                ),
            ));
        }
        let mount_view = MountViewSetting::parse(raw.mount_view.as_deref().unwrap_or("auto"))
            .map_err(|m| self.invalid("node.mount_view", m))?;
        if let Some(reason) = &raw.allow_untrusted_base_dir
            && (reason.trim().is_empty() || reason.len() > 512)
        {
            return Err(self.invalid(
                "node.allow_untrusted_base_dir",
                "must say, in at most 512 bytes, why base dirs other users can write are \
                 acceptable here (it is logged at start)",
            ));
        }
        let stale_holder = raw.stale_holder_secs.unwrap_or(DEFAULT_STALE_HOLDER_SECS);
        if stale_holder > MAX_STALE_HOLDER_SECS {
            return Err(self.invalid(
                "node.stale_holder_secs",
                format!("must be at most {MAX_STALE_HOLDER_SECS} (0 never reports holders stale)"),
            ));
        }
        Ok(NodeSettings {
            default_volume_base_dir: base,
            allowed_base_dirs: allowed,
            mount_view,
            untrusted_base_dir_reason: raw.allow_untrusted_base_dir,
            stale_holder_after: (stale_holder > 0).then(|| Duration::from_secs(stale_holder)),
        })
    }

    fn timeouts(&self, t: &file::TimeoutsFile) -> Result<TimeoutSettings, ConfigError> {
        for (value, field) in [
            (t.create_secs, "timeouts.create_secs"),
            (t.destroy_secs, "timeouts.destroy_secs"),
            (t.attach_secs, "timeouts.attach_secs"),
            (t.detach_secs, "timeouts.detach_secs"),
            (t.rollback_secs, "timeouts.rollback_secs"),
        ] {
            if value == 0 || value > 3600 {
                return Err(self.invalid(field, "must be between 1 and 3600 seconds"));
            }
        }
        Ok(TimeoutSettings {
            create: Duration::from_secs(t.create_secs),
            destroy: Duration::from_secs(t.destroy_secs),
            attach: Duration::from_secs(t.attach_secs),
            detach: Duration::from_secs(t.detach_secs),
            rollback: Duration::from_secs(t.rollback_secs),
        })
    }

    fn controller(
        &self,
        raw: file::ControllerFile,
        timeouts: &file::TimeoutsFile,
    ) -> Result<ControllerSettings, ConfigError> {
        let interval = raw
            .sweep_interval_secs
            .unwrap_or(DEFAULT_SWEEP_INTERVAL_SECS);
        if interval > 86_400 {
            return Err(self.invalid(
                "controller.sweep_interval_secs",
                "must be at most 86400 (0 turns the sweep off)",
            ));
        }
        let floor = MIN_ABANDONED_CREATE_SECS.max(2 * timeouts.create_secs);
        let abandoned = raw.abandoned_create_secs.unwrap_or(floor);
        if abandoned < 2 * timeouts.create_secs {
            return Err(self.invalid(
                "controller.abandoned_create_secs",
                format!(
                    "{abandoned} is less than twice timeouts.create_secs ({}): a Create still \
                     running could be taken for abandoned",
                    timeouts.create_secs
                ),
            ));
        }
        let sign_unsigned_records = match raw.sign_unsigned_records {
            None | Some(file::SignUnsigned::All(false)) => Vec::new(),
            Some(file::SignUnsigned::All(true)) => {
                return Err(self.invalid(
                    "controller.sign_unsigned_records",
                    "true would sign every record that carries no MAC, including one forged \
                     after the record key was removed; list the Cube volume ids whose records \
                     you checked instead, e.g. sign_unsigned_records = [\"vol-a\"]",
                ));
            }
            Some(file::SignUnsigned::These(ids)) => {
                if let Some(bad) = ids
                    .iter()
                    .find(|id| id.is_empty() || id.len() > 128 || id.chars().any(char::is_control))
                {
                    return Err(self.invalid(
                        "controller.sign_unsigned_records",
                        format!(
                            "{:?} is not a Cube volume id",
                            bad.chars().take(64).collect::<String>()
                        ),
                    ));
                }
                ids
            }
        };
        Ok(ControllerSettings {
            sweep_interval: (interval > 0).then(|| Duration::from_secs(interval)),
            abandoned_create_after: Duration::from_secs(abandoned),
            sign_unsigned_records,
        })
    }

    fn metrics(
        &self,
        raw: file::MetricsFile,
        driver_label: bool,
    ) -> Result<MetricsSettings, ConfigError> {
        let listen = raw
            .listen
            .map(|addr| {
                addr.parse::<SocketAddr>()
                    .map_err(|_| self.invalid("metrics.listen", format!("{addr:?} is not ip:port")))
            })
            .transpose()?;
        let interval = raw.volume_stats_interval_secs.unwrap_or(60);
        // Also keeps the period within what tokio's Interval accepts.
        if (interval > 0 && interval < 5) || interval > 86_400 {
            return Err(self.invalid(
                "metrics.volume_stats_interval_secs",
                "must be 0 (off), or at least 5 and at most 86400",
            ));
        }
        let volume_ids = match raw.volume_ids.as_deref() {
            None | Some("hashed") => VolumeIdLabels::Hashed,
            Some("plain") => VolumeIdLabels::Plain,
            Some("none") => VolumeIdLabels::None,
            Some(other) => {
                return Err(self.invalid(
                    "metrics.volume_ids",
                    format!("{other:?} must be hashed, plain or none"),
                ));
            }
        };
        Ok(MetricsSettings {
            listen,
            volume_stats_interval: (interval > 0 && listen.is_some())
                .then(|| Duration::from_secs(interval)),
            volume_ids,
            driver_label,
        })
    }

    fn kubernetes_settings(
        &self,
        raw: file::KubernetesFile,
    ) -> Result<KubernetesSettings, ConfigError> {
        if raw.cache_secs > 3600 {
            return Err(self.invalid("kubernetes.cache_secs", "must be at most 3600"));
        }
        Ok(KubernetesSettings {
            kubeconfig: raw.kubeconfig,
            namespace: raw.namespace,
            storage_class: raw.storage_class,
            cache: Duration::from_secs(raw.cache_secs),
            record_key_secret: raw.record_key_secret,
            record_key_sha256: raw.record_key_sha256.map(|pin| pin.to_ascii_lowercase()),
        })
    }

    /// What the Kubernetes settings ask of the rest of the config.
    fn kubernetes(&self, config: &Config) -> Result<(), ConfigError> {
        let k = &config.kubernetes;
        if let Some(path) = &k.kubeconfig
            && !path.is_absolute()
        {
            return Err(self.invalid(
                "kubernetes.kubeconfig",
                format!("{} must be absolute", path.display()),
            ));
        }
        if let Some(ns) = &k.namespace
            && !is_dns_label(ns)
        {
            return Err(self.invalid(
                "kubernetes.namespace",
                format!("{ns:?} is not a Kubernetes namespace name (a DNS-1123 label)"),
            ));
        }
        if let Some(name) = &k.record_key_secret
            && !is_dns_subdomain(name)
        {
            return Err(self.invalid(
                "kubernetes.record_key_secret",
                format!("{name:?} is not a Secret name (a DNS-1123 subdomain)"),
            ));
        }
        if let Some(pin) = &k.record_key_sha256 {
            if pin.len() != 64 || !pin.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(self.invalid(
                    "kubernetes.record_key_sha256",
                    "must be the 64 hex digits of the record key's SHA-256 (the daemon logs \
                     it; or kubectl get secret <record key Secret> -o \
                     jsonpath='{.data.key}' | base64 -d | sha256sum)",
                ));
            }
            if config.state.controller_store != ControllerStoreKind::Kubernetes {
                return Err(self.invalid(
                    "kubernetes.record_key_sha256",
                    "pins the CubeVolume store's key; it needs state.controller_store = \
                     \"kubernetes\"",
                ));
            }
        }
        if let Some(class) = &k.storage_class {
            if !is_dns_subdomain(class) {
                return Err(self.invalid(
                    "kubernetes.storage_class",
                    format!("{class:?} is not a StorageClass name (a DNS-1123 subdomain)"),
                ));
            }
            let v = &config.volume;
            for (taken, field) in [
                (!v.parameters.is_empty(), "volume.parameters"),
                (!v.mount_flags.is_empty(), "volume.mount_flags"),
                (!v.fs_type.is_empty(), "volume.fs_type"),
                (!config.secrets.is_empty(), "secrets"),
            ] {
                if taken {
                    return Err(self.invalid(
                        field,
                        format!(
                            "comes from StorageClass {class:?} (kubernetes.storage_class); \
                             remove it here or drop kubernetes.storage_class"
                        ),
                    ));
                }
            }
        }
        // Settings nothing reads unless something uses Kubernetes: given alone, they
        // say the operator meant the CubeVolume store (shared by every CubeMaster host)
        // and gets a store of this host's own, where another host's Destroy finds no
        // record and the volume leaks.
        if !config.uses_kubernetes() {
            for (given, field) in [
                (k.kubeconfig.is_some(), "kubernetes.kubeconfig"),
                (k.namespace.is_some(), "kubernetes.namespace"),
            ] {
                if given {
                    return Err(self.invalid(
                        field,
                        "is read only with state.controller_store = \"kubernetes\" or \
                         kubernetes.storage_class, neither of which is set: set \
                         state.controller_store = \"kubernetes\" to keep Create's records \
                         in the API server (shared by every CubeMaster host), or remove it",
                    ));
                }
            }
        }
        if k.record_key_secret.is_some()
            && config.state.controller_store != ControllerStoreKind::Kubernetes
        {
            return Err(self.invalid(
                "kubernetes.record_key_secret",
                "names the CubeVolume store's key, read only with state.controller_store = \
                 \"kubernetes\" (the embedded store keeps its key in state.dir): set that to \
                 keep Create's records in the API server (shared by every CubeMaster host), or \
                 remove it",
            ));
        }
        if config.state.controller_store == ControllerStoreKind::Kubernetes
            && !is_label_value(&config.driver)
        {
            return Err(self.invalid(
                "driver",
                format!(
                    "{:?} must begin and end with a letter or digit to label CubeVolume \
                     objects (state.controller_store = \"kubernetes\")",
                    config.driver
                ),
            ));
        }
        Ok(())
    }
}

/// `volume.mount_group`: a gid, written as a number or a string of digits. Names are
/// refused: the gid is the one the driver mounts with on every node, where a name may
/// resolve differently (or not at all).
fn mount_group(value: &toml::Value) -> Result<u32, String> {
    let number = match value {
        toml::Value::Integer(n) => Some(*n),
        toml::Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            s.parse::<i64>().ok()
        }
        _ => None,
    };
    // 4294967295 is (gid_t)-1, which chown and mount options read as "no group".
    match number {
        Some(n) if (0..i64::from(u32::MAX)).contains(&n) => Ok(n as u32),
        Some(_) => Err(format!("must be a group id from 0 to {}", u32::MAX - 1)),
        None => Err(
            "must be a numeric group id (e.g. mount_group = 1000), not a group name or any \
             other value"
                .to_string(),
        ),
    }
}

/// The longest key prefix and name, and segment value, CSI allows in a topology.
const TOPOLOGY_PART_MAX: usize = 63;

/// Checks one topology key as CSI defines it: an optional DNS-style prefix (lower-case
/// alphanumerics, `-` and `.`) and `/`, then a name (alphanumerics, `-`, `_` and `.`), each
/// at most 63 characters and beginning and ending with an alphanumeric.
fn topology_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let edges_ok = |s: &str, edge: fn(&u8) -> bool| {
        s.as_bytes().first().is_some_and(edge) && s.as_bytes().last().is_some_and(edge)
    };
    if let Some(prefix) = prefix {
        let lower = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        if prefix.len() > TOPOLOGY_PART_MAX
            || !edges_ok(prefix, lower)
            || !prefix.bytes().all(|b| lower(&b) || b == b'-' || b == b'.')
        {
            return Err(format!(
                "topology key {key:?}: its prefix must be at most {TOPOLOGY_PART_MAX} \
                 lower-case letters, digits, '-' and '.', beginning and ending with a letter \
                 or digit (a domain name such as example.com)"
            ));
        }
    }
    segment_chars(name).map_err(|m| format!("topology key {key:?}: its name {m}"))
}

/// A key name or a segment value: 1 to 63 alphanumerics, `-`, `_` and `.`, beginning and
/// ending with an alphanumeric.
fn segment_chars(value: &str) -> Result<(), String> {
    let alnum = |b: &u8| b.is_ascii_alphanumeric();
    let ok = !value.is_empty()
        && value.len() <= TOPOLOGY_PART_MAX
        && value.as_bytes().first().is_some_and(alnum)
        && value.as_bytes().last().is_some_and(alnum)
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "must be 1 to {TOPOLOGY_PART_MAX} letters, digits, '-', '_' and '.', beginning and \
             ending with a letter or digit"
        ))
    }
}

/// Checks one list of topologies (`requisite` or `preferred`).
fn topologies(list: &[Segments], field: &str) -> Result<(), String> {
    for (index, segments) in list.iter().enumerate() {
        let at = format!("{field}[{index}]");
        if segments.is_empty() {
            return Err(format!(
                "{at} is empty; a topology names at least one segment, e.g. \
                 {{ \"example.com/zone\" = \"zone-a\" }}"
            ));
        }
        let mut lower = std::collections::BTreeSet::new();
        for (key, value) in segments {
            topology_key(key).map_err(|m| format!("{at}: {m}"))?;
            segment_chars(value)
                .map_err(|m| format!("{at}: the segment of {key:?}, {value:?}, {m}"))?;
            if !lower.insert(key.to_ascii_lowercase()) {
                return Err(format!(
                    "{at}: topology keys are case-insensitive, and {key:?} is given twice"
                ));
            }
        }
        if list[..index].contains(segments) {
            return Err(format!("{at} repeats an earlier topology"));
        }
    }
    Ok(())
}

/// `[volume.accessibility_requirements]` as CSI's TopologyRequirement allows it: at least
/// one of `requisite` and `preferred`, and, when `requisite` is given, every `preferred`
/// topology among them (a preference outside what is required cannot be met).
fn accessibility(raw: file::AccessibilityFile) -> Result<TopologyRequirement, String> {
    if raw.requisite.is_empty() && raw.preferred.is_empty() {
        return Err(
            "lists neither requisite nor preferred topologies; list at least one, or remove \
             the table to let the driver choose"
                .to_string(),
        );
    }
    topologies(&raw.requisite, "requisite")?;
    topologies(&raw.preferred, "preferred")?;
    if !raw.requisite.is_empty()
        && let Some(stray) = raw.preferred.iter().find(|p| !raw.requisite.contains(p))
    {
        return Err(format!(
            "preferred topology {} is not among the requisite ones, so it can never be met \
             (CSI: every preferred topology must also be requisite); add it to requisite or \
             remove it from preferred",
            crate::bridge::ports::describe_segments(stray)
        ));
    }
    Ok(TopologyRequirement {
        requisite: raw.requisite,
        preferred: raw.preferred,
    })
}

/// Set once a process may look group names up in `/etc/group` alone.
static GROUPS_FROM_FILE_ONLY: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Makes this process look group names (`serve.socket_group`) up in `/etc/group` alone,
/// never through glibc's NSS. The hook front calls it: it is linked static, and NSS would
/// `dlopen` the host's modules (libnss_systemd, …, and the host's libc with them) into it,
/// which works only with the glibc it was built with. A group found nowhere else fails its
/// config load, and the front then hands the hook to the full binary, which asks NSS.
pub fn look_up_groups_in_etc_group_only() {
    GROUPS_FROM_FILE_ONLY.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// A group name or number as a gid.
fn resolve_group(group: &str) -> Result<u32, String> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    if GROUPS_FROM_FILE_ONLY.load(std::sync::atomic::Ordering::Relaxed) {
        let text = std::fs::read_to_string("/etc/group")
            .map_err(|e| format!("looking up group {group:?} in /etc/group: {e}"))?;
        return gid_in_group_file(&text, group).ok_or_else(|| {
            format!("group {group:?} is not in /etc/group (the hook front looks nowhere else)")
        });
    }
    match nix::unistd::Group::from_name(group) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(format!("group {group:?} does not exist on this host")),
        Err(e) => Err(format!("looking up group {group:?}: {e}")),
    }
}

/// The gid of `name` in the text of a group(5) file (`name:password:gid:members`).
fn gid_in_group_file(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        fields.nth(1)?.trim().parse().ok()
    })
}

/// Where and why the TOML is wrong, without quoting the file: toml's own message shows
/// the offending line, and serde's messages quote the offending value, either of which
/// may be a secret. Field and table names (in backticks) are kept.
fn describe_toml_error(text: &str, error: &toml::de::Error) -> String {
    let position = error.span().map(|span| {
        let before = &text[..span.start.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        format!("line {line}, column {column}: ")
    });
    let message = error.message().lines().next().unwrap_or("").trim();
    format!(
        "{}{}",
        position.unwrap_or_default(),
        redact_literals(message)
    )
}

/// The environment variable that sets `state.instance` when the file does not (the Helm
/// chart's pods: a key new to the file would be refused by a pod still running an older
/// version, which reads the file kubelet updated under it).
pub const INSTANCE_ENV: &str = "CUBE_CSI_BRIDGE_INSTANCE";

fn check_instance(instance: &str) -> Result<(), String> {
    if instance.is_empty() || instance.len() > 256 || instance.chars().any(char::is_control) {
        return Err(format!(
            "{instance:?} must be 1 to 256 characters, none of them control characters"
        ));
    }
    Ok(())
}

/// Replaces the literal values serde quotes in its messages (`string "…"`, `integer
/// \`…\``, …) with `<redacted>`.
fn redact_literals(message: &str) -> String {
    const KINDS: [&str; 8] = [
        "string ",
        "integer ",
        "floating point ",
        "boolean ",
        "character ",
        "byte array ",
        "unsigned integer ",
        "value ",
    ];
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while !rest.is_empty() {
        let next = KINDS
            .iter()
            .filter_map(|k| rest.find(k).map(|i| (i, k.len())))
            .min_by_key(|(i, _)| *i);
        let Some((at, len)) = next else {
            out.push_str(rest);
            break;
        };
        let after = &rest[at + len..];
        let quote = after.chars().next();
        let close = match quote {
            Some(q @ ('"' | '`')) => closing_quote(&after[1..], q).map(|end| end + 2),
            _ => None,
        };
        out.push_str(&rest[..at + len]);
        match close {
            Some(end) => {
                out.push_str("<redacted>");
                rest = &after[end..];
            }
            None => rest = after,
        }
    }
    // A bare quoted string anywhere else (toml's syntax errors) goes too. An escaped
    // quote (`\"`, as serde writes a `"` of the value) does not end it.
    let mut cleaned = String::with_capacity(out.len());
    let mut in_quote = false;
    let mut escaped = false;
    for c in out.chars() {
        match (c, in_quote) {
            ('"', false) => {
                in_quote = true;
                cleaned.push_str("<redacted>");
            }
            (_, true) if escaped => escaped = false,
            ('\\', true) => escaped = true,
            ('"', true) => in_quote = false,
            (_, true) => {}
            (c, false) => cleaned.push(c),
        }
    }
    cleaned
}

/// Where `quote` closes in `text` (which follows the opening one), an escaped one
/// (`\"`, as serde writes a quote of the value) skipped.
fn closing_quote(text: &str, quote: char) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            c if c == quote => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
driver = "nfs"
[csi]
endpoint = "unix:///run/csi/nfs.sock"
"#;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("/etc/test.toml"))
    }

    fn parse_all(text: &str) -> Result<Vec<Config>, ConfigError> {
        Config::parse_all(text, Path::new("/etc/test.toml"))
    }

    const TWO_DRIVERS: &str = r#"
[metrics]
listen = "127.0.0.1:9810"

[[drivers]]
driver = "nfs"
[drivers.csi]
endpoint = "unix:///run/csi/nfs.sock"

[[drivers]]
driver = "local"
[drivers.csi]
endpoint = "unix:///run/csi/local.sock"
[drivers.volume]
access_mode = "single_node_writer"
"#;

    #[test]
    fn a_file_listing_drivers_gives_each_its_own_defaults_and_the_shared_metrics() {
        let configs = parse_all(TWO_DRIVERS).unwrap();
        let names: Vec<_> = configs.iter().map(|c| c.driver.as_str()).collect();
        assert_eq!(names, ["nfs", "local"]);
        let (nfs, local) = (&configs[0], &configs[1]);
        assert_eq!(nfs.serve.socket, Path::new("/run/cube-csi-bridge/nfs.sock"));
        assert_eq!(
            local.serve.socket,
            Path::new("/run/cube-csi-bridge/local.sock")
        );
        assert_eq!(local.state.dir, Path::new("/var/lib/cube-csi-bridge/local"));
        assert_ne!(nfs.volume.access_mode, local.volume.access_mode);
        for config in &configs {
            assert_eq!(
                config.metrics.listen,
                Some("127.0.0.1:9810".parse().unwrap())
            );
            assert!(config.metrics.driver_label, "listed drivers are labelled");
        }
        assert!(
            !parse(MINIMAL).unwrap().metrics.driver_label,
            "a one-driver file keeps its series unlabelled"
        );
    }

    /// Drivers `x` and `x.sock` of one file: the second's default dirs lie under the
    /// first's default socket. Refused with both names; before, whichever started second
    /// failed with "File exists" or "not a socket".
    #[test]
    fn a_drivers_dir_under_another_drivers_socket_is_refused() {
        let text = TWO_DRIVERS.replace("\"local\"", "\"nfs.sock\"");
        let err = parse_all(&text).unwrap_err().to_string();
        assert!(
            err.contains("\"nfs.sock\"") && err.contains("serve.socket"),
            "{err}"
        );
        parse_all(TWO_DRIVERS).unwrap();
    }

    #[test]
    fn one_driver_is_chosen_by_name_and_never_guessed() {
        let path = Path::new("/etc/test.toml");
        let all = || parse_all(TWO_DRIVERS).unwrap();
        let named = |n: &str| DriverChoice::Named(n.into());
        assert_eq!(
            choose(all(), &named("local"), path).unwrap().driver,
            "local"
        );
        assert_eq!(
            choose(all(), &DriverChoice::IfListed("nfs".into()), path)
                .unwrap()
                .driver,
            "nfs"
        );
        let several = choose(all(), &DriverChoice::Any, path).unwrap_err();
        assert!(
            several.to_string().contains("several drivers (nfs, local)"),
            "{several}"
        );
        let unknown = choose(all(), &named("ceph"), path).unwrap_err();
        assert!(
            unknown.to_string().contains("no driver \"ceph\"")
                && unknown.to_string().contains("nfs, local"),
            "{unknown}"
        );
        // A one-driver file chosen by its own name serves that driver, whatever the
        // executable is called; a file found by another driver's name is refused.
        let one = || vec![parse(MINIMAL).unwrap()];
        assert_eq!(
            choose(one(), &DriverChoice::IfListed("other".into()), path)
                .unwrap()
                .driver,
            "nfs"
        );
        assert!(choose(one(), &named("other"), path).is_err());
        assert!(parse(TWO_DRIVERS).is_err(), "parse wants one driver");
    }

    #[test]
    fn listed_drivers_must_not_share_what_each_owns() {
        let with = |a: &str, b: &str| {
            format!(
                "[[drivers]]\ndriver = \"nfs\"\n[drivers.csi]\nendpoint = \"unix:///a.sock\"\n{a}\n\
                 [[drivers]]\ndriver = \"nfs-prod\"\n[drivers.csi]\nendpoint = \"unix:///b.sock\"\n{b}\n"
            )
        };
        let err = |text: String| parse_all(&text).unwrap_err().to_string();
        // Names that prefix each other share a base dir: their host_paths never meet
        // (`nfs+prod-x`, `nfs-prod+x`).
        assert!(parse_all(&with("", "")).is_ok(), "one base dir");
        let apart = "[drivers.node]\ndefault_volume_base_dir = \"/data/prod\"";
        let sock = "[drivers.serve]\nsocket = \"/run/x.sock\"";
        let e = err(with(sock, &format!("{sock}\n{apart}")));
        assert!(e.contains("share serve.socket"), "{e}");
        let state = "[drivers.state]\ndir = \"/var/lib/x\"";
        let e = err(with(state, &format!("{state}\n{apart}")));
        assert!(e.contains("share state.dir"), "{e}");
        let twice = TWO_DRIVERS.replace("driver = \"local\"", "driver = \"nfs\"");
        assert!(err(twice).contains("share a driver name"));
        // One CSI driver behind two Cube drivers: only with prefixes of their own.
        let one_csi = |a: &str, b: &str| {
            format!(
                "[[drivers]]\ndriver = \"nfs\"\n[drivers.csi]\nendpoint = \"unix:///a.sock\"\n{a}\n\
                 [[drivers]]\ndriver = \"nfs-fast\"\n[drivers.csi]\nendpoint = \"unix:///a.sock\"\n{b}\n"
            )
        };
        let e = err(one_csi("", ""));
        assert!(
            e.contains("same volume.name_prefix") && e.contains("\"cube-\""),
            "{e}"
        );
        let fast = "[drivers.volume]\nname_prefix = \"fast-\"";
        assert!(parse_all(&one_csi("", fast)).is_ok());
        assert!(err("drivers = []\n".into()).contains("lists no driver"));
    }

    #[test]
    fn a_listed_drivers_error_names_its_entry_and_metrics_sit_at_the_top() {
        let bad = TWO_DRIVERS.replace("unix:///run/csi/local.sock", "tcp://x");
        let e = parse_all(&bad).unwrap_err().to_string();
        assert!(e.contains("drivers[1] (local): csi.endpoint"), "{e}");
        let nested = format!("{TWO_DRIVERS}[drivers.metrics]\nlisten = \"127.0.0.1:1\"\n");
        let e = parse_all(&nested).unwrap_err().to_string();
        assert!(
            e.contains("drivers[1] (local): metrics") && e.contains("top level"),
            "{e}"
        );
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.socket_path(), Path::new("/run/cube-csi-bridge/nfs.sock"));
        assert_eq!(c.serve.roles, Roles::BOTH);
        assert_eq!(c.volume.access_mode, AccessMode::MultiNodeMultiWriter);
        assert_eq!(
            c.state.store_path(),
            Path::new("/var/lib/cube-csi-bridge/nfs/controller.redb")
        );
        assert_eq!(
            c.state.lock_dir,
            Path::new("/run/cube-csi-bridge/nfs/locks")
        );
        assert_eq!(
            c.node.default_volume_base_dir,
            Path::new(DEFAULT_VOLUME_BASE_DIR)
        );
        assert_eq!(
            c.node.allowed_base_dirs,
            [PathBuf::from(DEFAULT_VOLUME_BASE_DIR)]
        );
        assert_eq!(c.node.mount_view, MountViewSetting::Auto);
        assert_eq!(c.timeouts.detach, Duration::from_secs(25));
        assert_eq!(
            c.csi.controller(),
            &Endpoint::Unix("/run/csi/nfs.sock".into())
        );
        assert_eq!(
            c.controller.abandoned_create_after,
            Duration::from_secs(600)
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let cases: &[(&str, &str)] = &[
            (
                "driver = \"a/b\"\n[csi]\nendpoint = \"/x.sock\"\n",
                "driver",
            ),
            ("driver = \"nfs\"\n", "csi"),
            (
                &format!("{MINIMAL}[serve]\ntcp = \"0.0.0.0:9100\"\n"),
                "serve.tcp",
            ),
            (
                &MINIMAL.replace("unix:///run/csi/nfs.sock", "localhost:1"),
                "csi.endpoint",
            ),
            (
                &format!("{MINIMAL}[timeouts]\ndetach_secs = 0\n"),
                "timeouts.detach_secs",
            ),
            (
                &format!("{MINIMAL}[node]\nmount_view = \"cubelet\"\n"),
                "node.mount_view",
            ),
            (
                &format!("{MINIMAL}[serve]\nservices = \"all\"\n"),
                "serve.services",
            ),
            (
                &format!("{MINIMAL}[state]\ncontroller_store = \"etcd\"\n"),
                "state.controller_store",
            ),
            (
                &format!("{MINIMAL}[node]\nallowed_base_dirs = [\"/other\"]\n"),
                "node.allowed_base_dirs",
            ),
            (
                &format!("{MINIMAL}[node]\ndefault_volume_base_dir = \"/data/../etc\"\n"),
                "node.default_volume_base_dir",
            ),
            (
                &format!("{MINIMAL}[controller]\nabandoned_create_secs = 10\n"),
                "controller.abandoned_create_secs",
            ),
            (
                &format!("{MINIMAL}[serve]\nallowed_uids = []\n"),
                "serve.allowed_uids",
            ),
            (
                &format!("{MINIMAL}[serve]\ntcp = \"127.0.0.1:9100\"\n"),
                "serve.allowed_uids",
            ),
            (&format!("{MINIMAL}bogus = 1\n"), "bogus"),
        ];
        for (text, field) in cases {
            let err = parse(text).unwrap_err().to_string();
            assert!(
                err.contains(field) && err.contains("/etc/test.toml"),
                "{field}: {err}"
            );
        }
    }

    #[test]
    fn a_bad_tcp_controller_endpoint_is_a_config_error_not_a_panic() {
        let err = parse(&format!(
            "{}controller_endpoint = \"http://a:1:2\"\n",
            MINIMAL
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("csi.controller_endpoint"), "{err}");
        let ok = parse(&format!(
            "{MINIMAL}controller_endpoint = \"http://ctrl:9000\"\n"
        ))
        .unwrap();
        assert_eq!(ok.csi.controller(), &Endpoint::Tcp("ctrl:9000".into()));
    }

    #[test]
    fn kubernetes_settings_are_checked() {
        let c = parse(&format!(
            "{MINIMAL}[state]\ncontroller_store = \"kubernetes\"\n[kubernetes]\nnamespace = \"cube-system\"\nstorage_class = \"nfs-csi\"\n"
        ))
        .unwrap();
        assert!(c.uses_kubernetes());
        assert_eq!(c.kubernetes.cache, Duration::from_secs(30));
        assert!(!parse(MINIMAL).unwrap().uses_kubernetes());
        let err = parse(&format!(
            "{MINIMAL}[kubernetes]\nstorage_class = \"nfs-csi\"\n[volume]\nmount_flags = [\"nfsvers=4.1\"]\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("volume.mount_flags") && err.contains("nfs-csi"),
            "{err}"
        );
        let err = parse(&format!("{MINIMAL}[kubernetes]\nnamespace = \"Cube\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("kubernetes.namespace"), "{err}");
        // Given with nothing that uses Kubernetes: the store meant was surely the
        // CubeVolume one, and the embedded one would be used instead, in silence.
        for setting in [
            "namespace = \"cube\"",
            "kubeconfig = \"/etc/kube.conf\"",
            "record_key_secret = \"key\"",
            "record_key_secret = \"key\"\nstorage_class = \"nfs-csi\"",
        ] {
            let err = parse(&format!("{MINIMAL}[kubernetes]\n{setting}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("state.controller_store") && err.contains("kubernetes."),
                "{setting}: {err}"
            );
        }
        let err = parse(&format!(
            "{}[state]\ncontroller_store = \"kubernetes\"\n",
            MINIMAL.replace("\"nfs\"", "\"nfs-\"")
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("driver") && err.contains("CubeVolume"),
            "{err}"
        );
    }

    #[test]
    fn secrets_never_show_in_debug() {
        let c = parse(&format!(
            "{MINIMAL}[secrets.node_publish]\npassword = \"hunter2\"\n[volume]\nmount_flags = [\"password=hunter3\"]\n"
        ))
        .unwrap();
        let dump = format!("{c:?}");
        assert!(
            !dump.contains("hunter2") && !dump.contains("hunter3"),
            "{dump}"
        );
        assert!(dump.contains("password"), "keys stay visible: {dump}");
    }

    #[test]
    fn parse_errors_never_quote_the_file() {
        let secret = "hunter2-SECRET";
        for text in [
            format!("{MINIMAL}[secrets]\nnode_publish = {{ password = {secret} }}\n"),
            format!("{MINIMAL}[secrets]\nnode_publish = \"{secret}\"\n"),
            format!("{MINIMAL}[secrets.node_publish]\npassword = 1234{secret}\n"),
            format!("{MINIMAL}[secrets.node_publish]\npassword = 12345678\n"),
            format!("{MINIMAL}[volume]\nmount_flags = \"pass={secret}\"\n"),
            format!("{MINIMAL}[volume]\nmount_flags = [\"pass={secret}\"\n"),
            format!("{MINIMAL}[secrets.node_publish]\n\"{secret}\" = [1]\n"),
        ] {
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                !err.contains("hunter2") && !err.contains("12345678"),
                "leaked: {err}"
            );
            assert!(err.contains("line "), "no position: {err}");
        }
        // Field names stay, so the operator can find the problem.
        let err = parse(&format!("{MINIMAL}bogus = 1\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus"), "{err}");
    }

    #[test]
    fn stale_holders_are_reported_after_a_day_by_default_or_as_set() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.node.stale_holder_after, Some(Duration::from_secs(86_400)));
        let c = parse(&format!("{MINIMAL}[node]\nstale_holder_secs = 90\n")).unwrap();
        assert_eq!(c.node.stale_holder_after, Some(Duration::from_secs(90)));
        let c = parse(&format!("{MINIMAL}[node]\nstale_holder_secs = 0\n")).unwrap();
        assert_eq!(c.node.stale_holder_after, None);
        let err = parse(&format!(
            "{MINIMAL}[node]\nstale_holder_secs = 18446744073709551615\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("node.stale_holder_secs"), "{err}");
    }

    #[test]
    fn a_volume_stats_interval_beyond_a_day_is_a_config_error() {
        // tokio's Interval panics on a period this large.
        let err = parse(&format!(
            "{MINIMAL}[metrics]\nlisten = \"127.0.0.1:9100\"\nvolume_stats_interval_secs = 18446744073709551615\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("metrics.volume_stats_interval_secs"), "{err}");
        let err = parse(&format!(
            "{MINIMAL}[metrics]\nlisten = \"127.0.0.1:9100\"\nvolume_stats_interval_secs = 86401\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("at most 86400"), "{err}");
        let c = parse(&format!(
            "{MINIMAL}[metrics]\nlisten = \"127.0.0.1:9100\"\nvolume_stats_interval_secs = 86400\n"
        ))
        .unwrap();
        assert_eq!(
            c.metrics.volume_stats_interval,
            Some(Duration::from_secs(86_400))
        );
    }

    #[test]
    fn a_capacity_beyond_int64_is_a_config_error() {
        // CSI's required_bytes is an int64.
        let err = parse(&format!(
            "{MINIMAL}[volume]\ncapacity_bytes = 9223372036854775808\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("volume.capacity_bytes"), "{err}");
        let c = parse(&format!(
            "{MINIMAL}[volume]\ncapacity_bytes = 9223372036854775807\n"
        ))
        .unwrap();
        assert_eq!(c.volume.capacity_bytes, i64::MAX as u64);
    }

    #[test]
    fn unsigned_records_are_signed_only_by_name_and_the_key_pin_is_checked() {
        let c = parse(&format!(
            "{MINIMAL}[controller]\nsign_unsigned_records = [\"vol-a\", \"vol-b\"]\n"
        ))
        .unwrap();
        assert_eq!(c.controller.sign_unsigned_records, ["vol-a", "vol-b"]);
        let c = parse(&format!(
            "{MINIMAL}[controller]\nsign_unsigned_records = false\n"
        ))
        .unwrap();
        assert!(c.controller.sign_unsigned_records.is_empty());
        let err = parse(&format!(
            "{MINIMAL}[controller]\nsign_unsigned_records = true\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("controller.sign_unsigned_records") && err.contains("forged"),
            "{err}"
        );
        let err = parse(&format!(
            "{MINIMAL}[controller]\nsign_unsigned_records = [\"\"]\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("not a Cube volume id"), "{err}");

        let pin = "AB".repeat(32);
        let kubernetes = format!(
            "{MINIMAL}[state]\ncontroller_store = \"kubernetes\"\n[kubernetes]\nrecord_key_sha256 = \"{pin}\"\n"
        );
        let c = parse(&kubernetes).unwrap();
        assert_eq!(c.kubernetes.record_key_sha256, Some("ab".repeat(32)));
        let err = parse(&kubernetes.replace(&pin, "abc"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("kubernetes.record_key_sha256") && err.contains("64 hex"),
            "{err}"
        );
        let err = parse(&format!(
            "{MINIMAL}[kubernetes]\nrecord_key_sha256 = \"{pin}\"\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("controller_store"), "{err}");
    }

    #[test]
    fn the_record_key_secret_defaults_to_a_name_from_the_driver() {
        let c = parse(&MINIMAL.replace("\"nfs\"", "\"Nfs_A.b\"")).unwrap();
        assert_eq!(c.record_key_secret(), "cube-csi-bridge-nfs-a-b-record-key");
        let c = parse(&format!(
            "{MINIMAL}[state]\ncontroller_store = \"kubernetes\"\n[kubernetes]\nrecord_key_secret = \"k\"\n"
        ))
        .unwrap();
        assert_eq!(c.record_key_secret(), "k");
        let err = parse(&format!(
            "{MINIMAL}[kubernetes]\nrecord_key_secret = \"K_\"\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("kubernetes.record_key_secret"), "{err}");
    }

    #[test]
    fn literals_are_redacted_in_serde_messages() {
        assert_eq!(
            redact_literals("invalid type: string \"pw\", expected a map"),
            "invalid type: string <redacted>, expected a map"
        );
        assert_eq!(
            redact_literals("invalid type: integer `5`, expected a string"),
            "invalid type: integer <redacted>, expected a string"
        );
        assert_eq!(
            redact_literals("unknown field `bogus`, expected one of `a`"),
            "unknown field `bogus`, expected one of `a`"
        );
    }

    /// A secret holding a quote: serde writes it escaped (`\"`), which ended the
    /// redaction there and left the rest of the secret in the error (Cube keeps a forked
    /// hook's JSON answer, and the daemon logs it).
    #[test]
    fn a_secret_holding_a_quote_is_never_quoted() {
        assert_eq!(
            redact_literals("invalid type: string \"pw\\\"hunter2-SECRET\", expected a map"),
            "invalid type: string <redacted>, expected a map"
        );
        for text in [
            format!("{MINIMAL}[secrets]\nnode_publish = 'pw\"hunter2-SECRET'\n"),
            format!("{MINIMAL}[volume]\nmount_flags = 'password=pw\"hunter2-SECRET'\n"),
        ] {
            let err = parse(&text).unwrap_err().to_string();
            assert!(!err.contains("hunter2"), "leaked: {err}");
        }
    }

    #[test]
    fn a_group_file_gives_the_gid_of_the_named_line_only() {
        let text = "root:x:0:\ncube:x:1234:alice,bob\ncubes:x:99:\nbroken:x\n";
        assert_eq!(gid_in_group_file(text, "root"), Some(0));
        assert_eq!(gid_in_group_file(text, "cube"), Some(1234));
        // A name is matched whole, never as a prefix of another.
        assert_eq!(gid_in_group_file(text, "cub"), None);
        assert_eq!(gid_in_group_file(text, "broken"), None);
        assert_eq!(gid_in_group_file(text, "x"), None);
        assert_eq!(gid_in_group_file("", "root"), None);
    }

    #[test]
    fn mount_group_is_a_numeric_gid() {
        for (value, gid) in [("2000", 2000), ("\"2000\"", 2000), ("0", 0)] {
            let c = parse(&format!("{MINIMAL}[volume]\nmount_group = {value}\n")).unwrap();
            assert_eq!(c.volume.mount_group, Some(gid), "{value}");
        }
        assert_eq!(parse(MINIMAL).unwrap().volume.mount_group, None);
        for (value, needle) in [
            ("\"staff\"", "numeric group id"),
            ("\"\"", "numeric group id"),
            ("true", "numeric group id"),
            ("-5", "from 0 to 4294967294"),
            ("4294967295", "from 0 to 4294967294"),
        ] {
            let err = parse(&format!("{MINIMAL}[volume]\nmount_group = {value}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("volume.mount_group") && err.contains(needle),
                "{value}: {err}"
            );
        }
    }

    #[test]
    fn every_access_mode_is_accepted_by_its_csi_name_and_others_are_named() {
        for mode in crate::bridge::fit::ALL_MODES {
            let name = crate::bridge::fit::mode_name(mode).to_ascii_lowercase();
            let c = parse(&format!("{MINIMAL}[volume]\naccess_mode = \"{name}\"\n")).unwrap();
            assert_eq!(c.volume.access_mode, mode);
        }
        let err = parse(&format!("{MINIMAL}[volume]\naccess_mode = \"rwx\"\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("volume.access_mode")
                && err.contains("\"rwx\" is not an access mode")
                && err.contains("single_node_multi_writer"),
            "{err}"
        );
    }

    #[test]
    fn accessibility_requirements_follow_the_csi_rules() {
        let table = |body: &str| format!("{MINIMAL}[volume.accessibility_requirements]\n{body}");
        let c = parse(&table(
            "requisite = [{ \"example.com/zone\" = \"a\" }, { \"example.com/zone\" = \"b\", rack = \"r.1\" }]\n\
             preferred = [{ \"example.com/zone\" = \"a\" }]\n",
        ))
        .unwrap();
        let r = c.volume.accessibility.unwrap();
        assert_eq!(r.requisite.len(), 2);
        assert_eq!(r.preferred[0]["example.com/zone"], "a");
        // Preferred alone is allowed: the driver may choose any topology.
        let c = parse(&table("preferred = [{ zone = \"a\" }]\n")).unwrap();
        assert!(c.volume.accessibility.unwrap().requisite.is_empty());
        assert!(parse(MINIMAL).unwrap().volume.accessibility.is_none());
        for (body, needle) in [
            ("", "neither requisite nor preferred"),
            (
                "requisite = []\npreferred = []\n",
                "neither requisite nor preferred",
            ),
            ("requisite = [{}]\n", "requisite[0] is empty"),
            (
                "requisite = [{ zone = \"a\" }]\npreferred = [{ zone = \"b\" }]\n",
                "preferred topology {zone=b} is not among the requisite ones",
            ),
            (
                "requisite = [{ zone = \"a\" }, { zone = \"a\" }]\n",
                "requisite[1] repeats an earlier topology",
            ),
            (
                "requisite = [{ zone = \"a\", Zone = \"a\" }]\n",
                "case-insensitive",
            ),
            (
                "requisite = [{ zone = \"-a\" }]\n",
                "the segment of \"zone\"",
            ),
            ("requisite = [{ zone = \"\" }]\n", "the segment of \"zone\""),
            (
                "requisite = [{ \"Example.com/zone\" = \"a\" }]\n",
                "its prefix",
            ),
            ("requisite = [{ \"example.com/\" = \"a\" }]\n", "its name"),
            ("requisite = [{ \"a/b/c\" = \"a\" }]\n", "its name"),
            (
                &format!("requisite = [{{ zone = \"{}\" }}]\n", "a".repeat(64)),
                "1 to 63",
            ),
        ] {
            let err = parse(&table(body)).unwrap_err().to_string();
            assert!(
                err.contains("volume.accessibility_requirements") && err.contains(needle),
                "{body}: {err}"
            );
        }
        for body in [
            "requisite = [{ zone = 1 }]\n",
            "other = []\n",
            "requisite = \"a\"\n",
        ] {
            assert!(
                matches!(parse(&table(body)), Err(ConfigError::Parse { .. })),
                "{body}"
            );
        }
    }
}
