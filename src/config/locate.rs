//! Where a config file is found, and the check that one holding secrets is private.

use std::path::{Path, PathBuf};

/// Environment variable naming the config file (checked first).
pub const CONFIG_ENV: &str = "CUBE_CSI_BRIDGE_CONFIG";
/// Directory of per-driver config files, used with the executable-name rule.
pub const CONFIG_DIR: &str = "/etc/cube-csi-bridge";
/// The config file used when nothing else names one.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/cube-csi-bridge/config.toml";
/// Executable names of the form `<prefix><name>` select `<CONFIG_DIR>/<name>.toml`.
pub const EXECUTABLE_PREFIX: &str = "cube-csi-bridge-";

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

/// Warns when a config that holds secrets can be read by group or others.
pub(super) fn warn_if_readable_by_others(path: &Path) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
