//! The bridge's config file: types, defaults, validation, and where the file is found.
//!
//! One file configures one bridge instance, which serves one Cube driver name backed by
//! one CSI driver. Everything is validated before anything is bound, mounted or written.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Where Cube's node agent keeps plugin volumes when the request does not say.
pub const DEFAULT_VOLUME_BASE_DIR: &str = "/data/cube-shared/volume";
/// The mount-namespace file of a standard Cubelet install.
pub const CUBELET_MOUNT_NS: &str = "/usr/local/services/cubetoolbox/cubeletmnt/mnt";
/// Environment variable naming the config file (checked first).
pub const CONFIG_ENV: &str = "CUBE_CSI_BRIDGE_CONFIG";
/// Directory of per-driver config files, used with the executable-name rule.
pub const CONFIG_DIR: &str = "/etc/cube-csi-bridge";
/// The config file used when nothing else names one.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/cube-csi-bridge/config.toml";
/// Executable names of the form `<prefix><name>` select `<CONFIG_DIR>/<name>.toml`.
pub const EXECUTABLE_PREFIX: &str = "cube-csi-bridge-";

/// A config problem, always with the file and the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config file {path}: {field}: {message}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        message: String,
    },
}

/// The whole config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The Cube driver name this instance serves (the `name` registered in CubeMaster and
    /// Cubelet). It prefixes every host_path: `<volume_base_dir>/<driver>-<volume_id>`.
    pub driver: String,
    pub csi: CsiConfig,
    #[serde(default)]
    pub serve: ServeConfig,
    #[serde(default)]
    pub volume: VolumeConfig,
    #[serde(default)]
    pub secrets: SecretsConfig,
    #[serde(default)]
    pub state: StateConfig,
    #[serde(default)]
    pub node: NodeConfig,
    #[serde(default)]
    pub timeouts: TimeoutsConfig,
    #[serde(default)]
    pub kubernetes: KubernetesConfig,
    /// The file this config was read from (for messages); not part of the file.
    #[serde(skip)]
    pub source: PathBuf,
}

/// How to reach the CSI driver.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CsiConfig {
    /// The driver's endpoint: `unix:///path.sock` or a bare absolute path.
    pub endpoint: String,
    /// Where the node side sends ControllerPublish/Unpublish for drivers that need them.
    /// Defaults to `endpoint`. May be `unix://`, a bare path, or `http://host:port`.
    #[serde(default)]
    pub controller_endpoint: Option<String>,
    /// Use this node id for ControllerPublish instead of asking NodeGetInfo.
    #[serde(default)]
    pub node_id: Option<String>,
}

/// Which Cube services the daemon serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Services {
    /// VolumeControllerService (CubeMaster's Create/Destroy).
    Controller,
    /// VolumePluginService (Cubelet's Attach/Detach).
    Node,
    #[default]
    Both,
}

impl Services {
    pub fn controller(self) -> bool {
        matches!(self, Services::Controller | Services::Both)
    }
    pub fn node(self) -> bool {
        matches!(self, Services::Node | Services::Both)
    }
}

/// The daemon's listeners.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Unix socket Cube dials (`unix:///path` or a bare path).
    /// Default: `/run/cube-csi-bridge/<driver>.sock`.
    #[serde(default)]
    pub socket: Option<String>,
    #[serde(default)]
    pub services: Services,
    /// Optional TCP listener, `host:port`. Loopback only unless `allow_remote_tcp`.
    #[serde(default)]
    pub tcp: Option<String>,
    /// Permit a non-loopback TCP address. Cube's rpc transport has no TLS and no auth.
    #[serde(default)]
    pub allow_remote_tcp: bool,
    /// How long in-flight hooks may run after SIGTERM before the daemon exits anyway.
    #[serde(default = "default_shutdown_grace_secs")]
    pub shutdown_grace_secs: u64,
}

/// The access mode requested for every volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    #[default]
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

/// What every CreateVolume, NodeStage and NodePublish asks for.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeConfig {
    /// Prefix of the CSI volume name; the rest is the Cube volume_id.
    #[serde(default = "default_name_prefix")]
    pub name_prefix: String,
    /// CreateVolume capacity_range.required_bytes; 0 leaves it unset.
    #[serde(default)]
    pub capacity_bytes: u64,
    #[serde(default)]
    pub access_mode: AccessMode,
    /// VolumeCapability.mount.fs_type; empty lets the driver choose.
    #[serde(default)]
    pub fs_type: String,
    /// VolumeCapability.mount.mount_flags. May hold credentials: never logged.
    #[serde(default)]
    pub mount_flags: Vec<String>,
    /// CreateVolume parameters (a StorageClass's `parameters`).
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

impl Default for VolumeConfig {
    fn default() -> Self {
        Self {
            name_prefix: default_name_prefix(),
            capacity_bytes: 0,
            access_mode: AccessMode::default(),
            fs_type: String::new(),
            mount_flags: Vec::new(),
            parameters: BTreeMap::new(),
        }
    }
}

impl fmt::Debug for VolumeConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VolumeConfig")
            .field("name_prefix", &self.name_prefix)
            .field("capacity_bytes", &self.capacity_bytes)
            .field("access_mode", &self.access_mode)
            .field("fs_type", &self.fs_type)
            .field(
                "mount_flags",
                &format_args!("<{} redacted>", self.mount_flags.len()),
            )
            .field("parameters", &self.parameters)
            .finish()
    }
}

/// CSI secrets per call family, as a StorageClass's secret references would give them.
#[derive(Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SecretsConfig {
    /// CreateVolume and DeleteVolume.
    #[serde(default)]
    pub provisioner: BTreeMap<String, String>,
    /// ControllerPublishVolume and ControllerUnpublishVolume.
    #[serde(default)]
    pub controller_publish: BTreeMap<String, String>,
    /// NodeStageVolume.
    #[serde(default)]
    pub node_stage: BTreeMap<String, String>,
    /// NodePublishVolume.
    #[serde(default)]
    pub node_publish: BTreeMap<String, String>,
}

impl SecretsConfig {
    /// Every secret value, for tests and log scrubbing checks.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        [
            &self.provisioner,
            &self.controller_publish,
            &self.node_stage,
            &self.node_publish,
        ]
        .into_iter()
        .flat_map(|m| m.values().map(String::as_str))
    }

    pub fn is_empty(&self) -> bool {
        self.values().next().is_none()
    }
}

impl fmt::Debug for SecretsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys = |m: &BTreeMap<String, String>| m.keys().cloned().collect::<Vec<_>>();
        f.debug_struct("SecretsConfig")
            .field("provisioner_keys", &keys(&self.provisioner))
            .field("controller_publish_keys", &keys(&self.controller_publish))
            .field("node_stage_keys", &keys(&self.node_stage))
            .field("node_publish_keys", &keys(&self.node_publish))
            .finish()
    }
}

/// Where state lives on this host.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StateConfig {
    /// Controller store and node journal. Default: `/var/lib/cube-csi-bridge/<driver>`.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Per-volume lock files. Default: `/run/cube-csi-bridge/<driver>/locks`.
    #[serde(default)]
    pub lock_dir: Option<PathBuf>,
    /// Where Create records the CSI handle that Destroy needs.
    #[serde(default)]
    pub controller_store: ControllerStoreKind,
}

/// The controller store's backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ControllerStoreKind {
    /// One file under `state.dir`: one controller host.
    #[default]
    Embedded,
    /// CubeVolume custom resources: any number of controller replicas.
    Kubernetes,
}

/// The Kubernetes API: where it is, and what the bridge reads from it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// A kubeconfig file. Unset: the pod's service account, else `$KUBECONFIG` or
    /// `~/.kube/config`.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the CubeVolume objects. Unset: the service account's namespace (or
    /// the kubeconfig context's), else `default`.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Take CreateVolume parameters, mount options, fstype and secrets from this
    /// StorageClass instead of `[volume]` and `[secrets]`.
    #[serde(default)]
    pub storage_class: Option<String>,
    /// How long a StorageClass and its Secrets are reused before being read again.
    #[serde(default = "default_kube_cache_secs")]
    pub cache_secs: u64,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            namespace: None,
            storage_class: None,
            cache_secs: default_kube_cache_secs(),
        }
    }
}

/// Node-side behaviour.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Used when an Attach carries no volume_base_dir.
    #[serde(default = "default_base_dir")]
    pub default_volume_base_dir: PathBuf,
    /// Whose view of the mount table decides that a host_path is really mounted:
    /// `auto` (Cubelet's namespace file if it exists, else this process's),
    /// `self`, `none` (skip the check), or the path of a mount-namespace file.
    #[serde(default = "default_mount_view")]
    pub mount_view: String,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            default_volume_base_dir: default_base_dir(),
            mount_view: default_mount_view(),
        }
    }
}

/// Per-hook budgets: all CSI calls and retries of one hook fit in its budget.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutsConfig {
    #[serde(default = "default_create_secs")]
    pub create_secs: u64,
    #[serde(default = "default_destroy_secs")]
    pub destroy_secs: u64,
    /// Cube's Attach shares the sandbox create deadline (300 s by default).
    #[serde(default = "default_attach_secs")]
    pub attach_secs: u64,
    /// Cube gives Detach about 30 s on sandbox destroy and 10 s on create failover.
    #[serde(default = "default_detach_secs")]
    pub detach_secs: u64,
    /// Extra time a failed Attach or Create may spend undoing its own work.
    #[serde(default = "default_rollback_secs")]
    pub rollback_secs: u64,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        Self {
            create_secs: default_create_secs(),
            destroy_secs: default_destroy_secs(),
            attach_secs: default_attach_secs(),
            detach_secs: default_detach_secs(),
            rollback_secs: default_rollback_secs(),
        }
    }
}

impl TimeoutsConfig {
    pub fn create(&self) -> Duration {
        Duration::from_secs(self.create_secs)
    }
    pub fn destroy(&self) -> Duration {
        Duration::from_secs(self.destroy_secs)
    }
    pub fn attach(&self) -> Duration {
        Duration::from_secs(self.attach_secs)
    }
    pub fn detach(&self) -> Duration {
        Duration::from_secs(self.detach_secs)
    }
    pub fn rollback(&self) -> Duration {
        Duration::from_secs(self.rollback_secs)
    }
}

fn default_name_prefix() -> String {
    "cube-".into()
}
fn default_base_dir() -> PathBuf {
    DEFAULT_VOLUME_BASE_DIR.into()
}
fn default_mount_view() -> String {
    "auto".into()
}
fn default_shutdown_grace_secs() -> u64 {
    30
}
fn default_create_secs() -> u64 {
    300
}
fn default_destroy_secs() -> u64 {
    300
}
fn default_attach_secs() -> u64 {
    120
}
fn default_detach_secs() -> u64 {
    25
}
fn default_rollback_secs() -> u64 {
    20
}
fn default_kube_cache_secs() -> u64 {
    30
}

/// Where a CSI or Cube endpoint lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `http://host:port` (controller endpoints only).
    Tcp(String),
}

impl Endpoint {
    /// Parses `unix:///abs/path`, a bare absolute path, or (when `allow_tcp`)
    /// `http://host:port` / `tcp://host:port`.
    pub fn parse(value: &str, allow_tcp: bool) -> Result<Self, String> {
        let value = value.trim();
        let path = if let Some(rest) = value.strip_prefix("unix://") {
            rest
        } else if value.starts_with('/') {
            value
        } else if allow_tcp {
            let hostport = value
                .strip_prefix("http://")
                .or_else(|| value.strip_prefix("tcp://"))
                .ok_or_else(|| {
                    format!("{value:?} is neither unix:///path, /path nor http://host:port")
                })?;
            if hostport.is_empty() || !hostport.contains(':') {
                return Err(format!("{value:?} needs host:port"));
            }
            return Ok(Endpoint::Tcp(hostport.to_string()));
        } else {
            return Err(format!(
                "{value:?} is not a unix socket: use unix:///abs/path.sock or /abs/path.sock"
            ));
        };
        if !path.starts_with('/') {
            return Err(format!("{value:?}: the socket path must be absolute"));
        }
        Ok(Endpoint::Unix(PathBuf::from(path)))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
            Endpoint::Tcp(hp) => write!(f, "http://{hp}"),
        }
    }
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let config = Self::parse(&text, path)?;
        if !config.secrets.is_empty() {
            warn_if_readable_by_others(path);
        }
        Ok(config)
    }

    /// Parses and validates config text; `path` only names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let mut config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        config.source = path.to_path_buf();
        config.validate()?;
        Ok(config)
    }

    fn invalid(&self, field: &'static str, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            path: self.source.clone(),
            field,
            message: message.into(),
        }
    }

    /// Checks every field that could otherwise fail late, at the first hook.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let d = &self.driver;
        let driver_ok = !d.is_empty()
            && d.len() <= 63
            && !d.starts_with('.')
            && d.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !driver_ok {
            return Err(self.invalid(
                "driver",
                format!("{d:?} must be 1-63 characters of [A-Za-z0-9._-], not starting with '.'"),
            ));
        }
        Endpoint::parse(&self.csi.endpoint, false).map_err(|m| self.invalid("csi.endpoint", m))?;
        if let Some(ep) = &self.csi.controller_endpoint {
            Endpoint::parse(ep, true).map_err(|m| self.invalid("csi.controller_endpoint", m))?;
        }
        if let Some(id) = &self.csi.node_id
            && (id.is_empty() || id.len() > 256)
        {
            return Err(self.invalid("csi.node_id", "must be 1-256 bytes"));
        }
        Endpoint::parse(&self.socket_address(), false)
            .map_err(|m| self.invalid("serve.socket", m))?;
        if let Some(tcp) = &self.serve.tcp {
            let addr: std::net::SocketAddr = tcp
                .parse()
                .map_err(|_| self.invalid("serve.tcp", format!("{tcp:?} is not ip:port")))?;
            if !addr.ip().is_loopback() && !self.serve.allow_remote_tcp {
                return Err(self.invalid(
                    "serve.tcp",
                    format!(
                        "{addr} is not a loopback address; Cube's rpc transport has no TLS and \
                         no authentication, so set serve.allow_remote_tcp = true only on a \
                         trusted network"
                    ),
                ));
            }
        }
        let prefix = &self.volume.name_prefix;
        if prefix.len() > 64 || prefix.chars().any(char::is_control) {
            return Err(self.invalid(
                "volume.name_prefix",
                "must be at most 64 bytes with no control characters",
            ));
        }
        let base = &self.node.default_volume_base_dir;
        if !base.is_absolute() || base == Path::new("/") {
            return Err(self.invalid(
                "node.default_volume_base_dir",
                format!("{} must be an absolute path other than /", base.display()),
            ));
        }
        let view = self.node.mount_view.as_str();
        if !matches!(view, "auto" | "self" | "none") && !view.starts_with('/') {
            return Err(self.invalid(
                "node.mount_view",
                format!("{view:?} must be auto, self, none or an absolute namespace file path"),
            ));
        }
        for (dir, field) in [
            (&self.state.dir, "state.dir"),
            (&self.state.lock_dir, "state.lock_dir"),
        ] {
            if let Some(dir) = dir
                && !dir.is_absolute()
            {
                return Err(self.invalid(field, format!("{} must be absolute", dir.display())));
            }
        }
        let t = &self.timeouts;
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
        if self.serve.shutdown_grace_secs > 600 {
            return Err(self.invalid("serve.shutdown_grace_secs", "must be at most 600"));
        }
        self.validate_kubernetes()
    }

    fn validate_kubernetes(&self) -> Result<(), ConfigError> {
        let k = &self.kubernetes;
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
        if k.cache_secs > 3600 {
            return Err(self.invalid("kubernetes.cache_secs", "must be at most 3600"));
        }
        if let Some(class) = &k.storage_class {
            if !is_dns_subdomain(class) {
                return Err(self.invalid(
                    "kubernetes.storage_class",
                    format!("{class:?} is not a StorageClass name (a DNS-1123 subdomain)"),
                ));
            }
            let v = &self.volume;
            for (taken, field) in [
                (!v.parameters.is_empty(), "volume.parameters"),
                (!v.mount_flags.is_empty(), "volume.mount_flags"),
                (!v.fs_type.is_empty(), "volume.fs_type"),
                (!self.secrets.is_empty(), "secrets"),
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
        if self.state.controller_store == ControllerStoreKind::Kubernetes
            && !is_label_value(&self.driver)
        {
            return Err(self.invalid(
                "driver",
                format!(
                    "{:?} must begin and end with a letter or digit to label CubeVolume \
                     objects (state.controller_store = \"kubernetes\")",
                    self.driver
                ),
            ));
        }
        Ok(())
    }

    /// Whether anything in this config needs the Kubernetes API.
    pub fn uses_kubernetes(&self) -> bool {
        self.kubernetes.storage_class.is_some()
            || self.state.controller_store == ControllerStoreKind::Kubernetes
    }

    /// The socket Cube dials, as written in Cube's configs.
    pub fn socket_address(&self) -> String {
        self.serve
            .socket
            .clone()
            .unwrap_or_else(|| format!("/run/cube-csi-bridge/{}.sock", self.driver))
    }

    /// The Unix socket path the daemon listens on.
    pub fn socket_path(&self) -> PathBuf {
        match Endpoint::parse(&self.socket_address(), false) {
            Ok(Endpoint::Unix(p)) => p,
            // validate() rejected anything else.
            _ => unreachable!("serve.socket validated as a unix socket"),
        }
    }

    pub fn csi_endpoint(&self) -> Endpoint {
        Endpoint::parse(&self.csi.endpoint, false).expect("csi.endpoint validated")
    }

    /// Where ControllerPublish/Unpublish go, and whether it was named explicitly.
    pub fn controller_endpoint(&self) -> (Endpoint, bool) {
        match &self.csi.controller_endpoint {
            Some(ep) => (
                Endpoint::parse(ep, true).expect("csi.controller_endpoint validated"),
                true,
            ),
            None => (self.csi_endpoint(), false),
        }
    }

    pub fn state_dir(&self) -> PathBuf {
        self.state
            .dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("/var/lib/cube-csi-bridge").join(&self.driver))
    }

    pub fn lock_dir(&self) -> PathBuf {
        self.state.lock_dir.clone().unwrap_or_else(|| {
            PathBuf::from("/run/cube-csi-bridge")
                .join(&self.driver)
                .join("locks")
        })
    }

    /// The embedded controller store file.
    pub fn store_path(&self) -> PathBuf {
        self.state_dir().join("controller.redb")
    }

    /// The node journal directory.
    pub fn journal_dir(&self) -> PathBuf {
        self.state_dir().join("node")
    }
}

/// A DNS-1123 label: namespaces, and each dot-separated part of a subdomain.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS-1123 subdomain as Kubernetes checks object names (StorageClasses, Secrets):
/// at most 253 bytes of dot-separated parts, each `[a-z0-9-]` with alphanumeric ends
/// (Kubernetes does not apply DNS's 63-byte limit to the parts).
pub fn is_dns_subdomain(s: &str) -> bool {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !p.starts_with('-')
            && !p.ends_with('-')
    };
    s.len() <= 253 && s.split('.').all(part_ok)
}

/// A label value (non-empty form): `[A-Za-z0-9._-]`, alphanumeric at both ends.
pub fn is_label_value(s: &str) -> bool {
    let alnum = |c: Option<u8>| c.is_some_and(|b| b.is_ascii_alphanumeric());
    s.len() <= 63
        && alnum(s.bytes().next())
        && alnum(s.bytes().last())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            path = %path.display(),
            mode = format_args!("{:o}", meta.permissions().mode() & 0o777),
            "config file holds CSI secrets but is readable by group or others; chmod 600 it"
        );
    }
}

/// Finds the config file of a binary hook, whose argv Cube fixes and which names no
/// config. The rule, first match wins:
/// 1. `$CUBE_CSI_BRIDGE_CONFIG`;
/// 2. the executable's own name `cube-csi-bridge-<name>` (a symlink per driver) selects
///    `/etc/cube-csi-bridge/<name>.toml`;
/// 3. `/etc/cube-csi-bridge/config.toml`.
///
/// The environment is passed in so that tests never touch the process environment.
pub fn locate(env_value: Option<&str>, argv0: Option<&str>) -> PathBuf {
    if let Some(value) = env_value.filter(|v| !v.trim().is_empty()) {
        return PathBuf::from(value.trim());
    }
    if let Some(name) = argv0
        .and_then(|a| Path::new(a).file_name())
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix(EXECUTABLE_PREFIX))
        .filter(|n| !n.is_empty())
    {
        return Path::new(CONFIG_DIR).join(format!("{name}.toml"));
    }
    PathBuf::from(DEFAULT_CONFIG_PATH)
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

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.socket_path(), Path::new("/run/cube-csi-bridge/nfs.sock"));
        assert_eq!(c.serve.services, Services::Both);
        assert_eq!(c.volume.access_mode, AccessMode::MultiNodeMultiWriter);
        assert_eq!(
            c.store_path(),
            Path::new("/var/lib/cube-csi-bridge/nfs/controller.redb")
        );
        assert_eq!(c.lock_dir(), Path::new("/run/cube-csi-bridge/nfs/locks"));
        assert_eq!(
            c.node.default_volume_base_dir,
            Path::new(DEFAULT_VOLUME_BASE_DIR)
        );
        assert_eq!(c.timeouts.detach_secs, 25);
    }

    #[test]
    fn bad_fields_are_named() {
        let err = parse(&MINIMAL.replace("\"nfs\"", "\"a/b\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("driver") && err.contains("/etc/test.toml"),
            "{err}"
        );
        let err = parse("driver = \"nfs\"\n").unwrap_err().to_string();
        assert!(err.contains("csi"), "{err}");
        let err = parse(&format!("{MINIMAL}[serve]\ntcp = \"0.0.0.0:9100\"\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("serve.tcp") && err.contains("loopback"),
            "{err}"
        );
        let err = parse(&MINIMAL.replace("unix:///run/csi/nfs.sock", "localhost:1"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("csi.endpoint"), "{err}");
        let err = parse(&format!("{MINIMAL}[timeouts]\ndetach_secs = 0\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("timeouts.detach_secs"), "{err}");
        let err = parse(&format!("{MINIMAL}[node]\nmount_view = \"cubelet\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("node.mount_view"), "{err}");
        let err = parse(&format!("{MINIMAL}bogus = 1\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus"), "{err}");
    }

    #[test]
    fn kubernetes_settings_are_checked() {
        let c = parse(&format!(
            "{MINIMAL}[state]\ncontroller_store = \"kubernetes\"\n[kubernetes]\nnamespace = \"cube-system\"\nstorage_class = \"nfs-csi\"\n"
        ))
        .unwrap();
        assert!(c.uses_kubernetes());
        assert_eq!(c.kubernetes.cache_secs, 30);
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
        assert!(is_dns_subdomain("csi.example.com") && !is_dns_subdomain("a..b"));
        assert!(is_label_value("nfs.csi_1") && !is_label_value("_x"));
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
    fn endpoints_parse_strictly() {
        assert_eq!(
            Endpoint::parse("unix:///a/b.sock", false).unwrap(),
            Endpoint::Unix("/a/b.sock".into())
        );
        assert_eq!(
            Endpoint::parse("/a/b.sock", false).unwrap(),
            Endpoint::Unix("/a/b.sock".into())
        );
        assert!(Endpoint::parse("unix://rel.sock", false).is_err());
        assert!(Endpoint::parse("http://h:1", false).is_err());
        assert_eq!(
            Endpoint::parse("http://h:1", true).unwrap(),
            Endpoint::Tcp("h:1".into())
        );
        assert_eq!(
            Endpoint::parse("tcp://h:1", true).unwrap(),
            Endpoint::Tcp("h:1".into())
        );
    }

    #[test]
    fn locate_follows_the_documented_order() {
        assert_eq!(
            locate(Some("/x.toml"), Some("cube-csi-bridge-nfs")),
            Path::new("/x.toml")
        );
        assert_eq!(
            locate(None, Some("/usr/local/bin/cube-csi-bridge-nfs")),
            Path::new("/etc/cube-csi-bridge/nfs.toml")
        );
        assert_eq!(
            locate(Some(" "), Some("cube-csi-bridge")),
            Path::new(DEFAULT_CONFIG_PATH)
        );
        assert_eq!(locate(None, None), Path::new(DEFAULT_CONFIG_PATH));
    }
}
