//! Where a config file is found, and the check that nobody else can change it or read
//! its secrets.

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

/// Refuses a config file that any user could change (the bridge runs as root and does
/// what it says), or that holds `[secrets]` any user could read; warns when only its group
/// could, or when it holds mount flags others can read. "Any user" means the file's
/// permission bits for others and every directory above it searchable by others: a
/// world-readable file in a 0700 directory is private.
pub(super) fn check_access(
    path: &Path,
    holds_secrets: bool,
    mount_flags: &[String],
) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let Ok(real) = std::fs::canonicalize(path) else {
        return Ok(());
    };
    let Ok(meta) = std::fs::metadata(&real) else {
        return Ok(());
    };
    let mode = meta.permissions().mode() & 0o777;
    let others_reach = real
        .ancestors()
        .skip(1)
        .all(|dir| std::fs::metadata(dir).is_ok_and(|m| m.permissions().mode() & 0o001 != 0));
    if others_reach && mode & 0o002 != 0 {
        return Err(format!(
            "any user can write it (mode {mode:o}) and the bridge runs as root doing what \
             it says; chmod 600 it (or 644 if it holds no secrets)"
        ));
    }
    if holds_secrets && others_reach && mode & 0o004 != 0 {
        return Err(format!(
            "it holds CSI secrets ([secrets]) and any user can read it (mode {mode:o}); \
             chmod 600 it"
        ));
    }
    if (holds_secrets || !mount_flags.is_empty()) && mode & 0o044 != 0 {
        tracing::warn!(
            path = %path.display(),
            mode = format_args!("{mode:o}"),
            "config file holds CSI secrets or mount flags but is readable by group or others; \
             chmod 600 it"
        );
    }
    Ok(())
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
