//! The config file as written: TOML tables and fields with their defaults. `mod.rs` turns
//! it into the typed `Config`; nothing else reads these types.

use std::path::PathBuf;

use serde::Deserialize;

use super::{KubernetesConfig, SecretsConfig, TimeoutsConfig, VolumeConfig};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ConfigFile {
    pub driver: String,
    pub csi: CsiFile,
    #[serde(default)]
    pub serve: ServeFile,
    #[serde(default)]
    pub volume: VolumeConfig,
    #[serde(default)]
    pub secrets: SecretsConfig,
    #[serde(default)]
    pub state: StateFile,
    #[serde(default)]
    pub node: NodeFile,
    #[serde(default)]
    pub timeouts: TimeoutsConfig,
    #[serde(default)]
    pub kubernetes: KubernetesConfig,
    #[serde(default)]
    pub controller: ControllerFile,
    /// Only in a one-driver file: a file listing `[[drivers]]` sets `[metrics]` once, at
    /// its top level.
    #[serde(default)]
    pub metrics: Option<MetricsFile>,
}

/// A file that lists several drivers served by one daemon: `[[drivers]]` entries, each
/// what a one-driver file holds (less `[metrics]`), and the process-wide `[metrics]`.
#[derive(Debug, Deserialize)]
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
    #[serde(default)]
    pub controller_store: Option<String>,
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
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct ControllerFile {
    #[serde(default)]
    pub sweep_interval_secs: Option<u64>,
    #[serde(default)]
    pub abandoned_create_secs: Option<u64>,
    /// Sign controller records that carry no MAC (written before records were signed).
    #[serde(default)]
    pub sign_unsigned_records: bool,
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
