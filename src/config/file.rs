//! The config file as written: TOML tables and fields with their defaults. `mod.rs` turns
//! it into the typed `Config`; nothing else reads these types.

use std::path::PathBuf;

use serde::Deserialize;

use std::collections::BTreeMap;

// No `Debug` on the file forms: `[secrets]` and `volume.mount_flags` are only ever shown
// redacted, by the checked settings.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ConfigFile {
    pub driver: String,
    pub csi: CsiFile,
    #[serde(default)]
    pub serve: ServeFile,
    #[serde(default)]
    pub volume: VolumeFile,
    #[serde(default)]
    pub secrets: SecretsFile,
    #[serde(default)]
    pub state: StateFile,
    #[serde(default)]
    pub node: NodeFile,
    #[serde(default)]
    pub timeouts: TimeoutsFile,
    #[serde(default)]
    pub kubernetes: KubernetesFile,
    #[serde(default)]
    pub controller: ControllerFile,
    /// Only in a one-driver file: a file listing `[[drivers]]` sets `[metrics]` once, at
    /// its top level.
    #[serde(default)]
    pub metrics: Option<MetricsFile>,
}

/// A file that lists several drivers served by one daemon: `[[drivers]]` entries, each
/// what a one-driver file holds (less `[metrics]`), and the process-wide `[metrics]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DriversFile {
    pub drivers: Vec<ConfigFile>,
    #[serde(default)]
    pub metrics: MetricsFile,
}

/// Just enough of a file to tell its form: whether it lists `[[drivers]]`.
#[derive(Debug, Deserialize)]
pub(super) struct FileForm {
    #[serde(default)]
    pub drivers: Option<serde::de::IgnoredAny>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CsiFile {
    pub endpoint: String,
    #[serde(default)]
    pub controller_endpoint: Option<String>,
    #[serde(default)]
    pub node_id: Option<String>,
    #[serde(default)]
    pub driver_uids: Vec<u32>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct ServeFile {
    #[serde(default)]
    pub socket: Option<String>,
    #[serde(default)]
    pub services: Option<String>,
    #[serde(default)]
    pub tcp: Option<String>,
    #[serde(default)]
    pub allow_remote_tcp: bool,
    #[serde(default)]
    pub shutdown_grace_secs: Option<u64>,
    /// Group owning the socket (name or number), so a non-root Cubelet can dial it.
    #[serde(default)]
    pub socket_group: Option<String>,
    /// Peer uids allowed to call (SO_PEERCRED); unset allows anyone who can reach it.
    #[serde(default)]
    pub allowed_uids: Option<Vec<u32>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct StateFile {
    #[serde(default)]
    pub dir: Option<PathBuf>,
    #[serde(default)]
    pub lock_dir: Option<PathBuf>,
    /// Which installation this bridge is (the Helm chart: `<namespace>/<release>`).
    #[serde(default)]
    pub instance: Option<String>,
    #[serde(default)]
    pub controller_store: Option<String>,
    /// Where a forked hook's worker logs after it has answered: `journal` or a file.
    #[serde(default)]
    pub worker_log: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct NodeFile {
    #[serde(default)]
    pub default_volume_base_dir: Option<PathBuf>,
    #[serde(default)]
    pub allowed_base_dirs: Option<Vec<PathBuf>>,
    #[serde(default)]
    pub mount_view: Option<String>,
    /// Accept base dirs of any owner and mode, for this reason (a non-root Cubelet's).
    #[serde(default)]
    pub allow_untrusted_base_dir: Option<String>,
    /// A holder whose namespace has made no hook for this long is reported stale; 0: never.
    #[serde(default)]
    pub stale_holder_secs: Option<u64>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct ControllerFile {
    #[serde(default)]
    pub sweep_interval_secs: Option<u64>,
    #[serde(default)]
    pub abandoned_create_secs: Option<u64>,
    /// Controller records without a MAC the operator checked and wants signed: a list of
    /// Cube volume ids (`true`, which once meant all of them, is refused with the reason).
    #[serde(default)]
    pub sign_unsigned_records: Option<SignUnsigned>,
}

/// `controller.sign_unsigned_records` as written.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum SignUnsigned {
    All(bool),
    These(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct MetricsFile {
    #[serde(default)]
    pub listen: Option<String>,
    #[serde(default)]
    pub volume_stats_interval_secs: Option<u64>,
    #[serde(default)]
    pub volume_ids: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct VolumeFile {
    #[serde(default = "default_name_prefix")]
    pub name_prefix: String,
    #[serde(default)]
    pub capacity_bytes: u64,
    /// Checked by name in mod.rs, so that a wrong one is refused naming the field.
    #[serde(default)]
    pub access_mode: Option<String>,
    #[serde(default)]
    pub fs_type: String,
    #[serde(default)]
    pub mount_flags: Vec<String>,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// A gid, as a number or a string of digits; anything else is refused by name.
    #[serde(default)]
    pub mount_group: Option<toml::Value>,
    #[serde(default)]
    pub accessibility_requirements: Option<AccessibilityFile>,
}

impl Default for VolumeFile {
    fn default() -> Self {
        Self {
            name_prefix: default_name_prefix(),
            capacity_bytes: 0,
            access_mode: None,
            fs_type: String::new(),
            mount_flags: Vec::new(),
            parameters: BTreeMap::new(),
            mount_group: None,
            accessibility_requirements: None,
        }
    }
}

/// `[volume.accessibility_requirements]`: CSI's TopologyRequirement, each topology an
/// inline table of segments.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct AccessibilityFile {
    #[serde(default)]
    pub requisite: Vec<BTreeMap<String, String>>,
    #[serde(default)]
    pub preferred: Vec<BTreeMap<String, String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct SecretsFile {
    #[serde(default)]
    pub provisioner: BTreeMap<String, String>,
    #[serde(default)]
    pub controller_publish: BTreeMap<String, String>,
    #[serde(default)]
    pub node_stage: BTreeMap<String, String>,
    #[serde(default)]
    pub node_publish: BTreeMap<String, String>,
    #[serde(default)]
    pub controller_expand: BTreeMap<String, String>,
    #[serde(default)]
    pub node_expand: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TimeoutsFile {
    #[serde(default = "default_create_secs")]
    pub create_secs: u64,
    #[serde(default = "default_destroy_secs")]
    pub destroy_secs: u64,
    #[serde(default = "default_attach_secs")]
    pub attach_secs: u64,
    #[serde(default = "default_detach_secs")]
    pub detach_secs: u64,
    #[serde(default = "default_rollback_secs")]
    pub rollback_secs: u64,
}

impl Default for TimeoutsFile {
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KubernetesFile {
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub storage_class: Option<String>,
    #[serde(default = "default_kube_cache_secs")]
    pub cache_secs: u64,
    #[serde(default)]
    pub record_key_secret: Option<String>,
    #[serde(default)]
    pub record_key_sha256: Option<String>,
}

impl Default for KubernetesFile {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            namespace: None,
            storage_class: None,
            cache_secs: default_kube_cache_secs(),
            record_key_secret: None,
            record_key_sha256: None,
        }
    }
}

fn default_name_prefix() -> String {
    "cube-".into()
}
fn default_create_secs() -> u64 {
    300
}
fn default_destroy_secs() -> u64 {
    300
}
/// Cube's Attach shares the sandbox create deadline (300 s by default).
fn default_attach_secs() -> u64 {
    120
}
/// Cube gives Detach about 30 s on sandbox destroy and 10 s on create failover.
fn default_detach_secs() -> u64 {
    25
}
fn default_rollback_secs() -> u64 {
    20
}
fn default_kube_cache_secs() -> u64 {
    30
}
