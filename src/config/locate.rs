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

/// Which driver of a config file a command serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverChoice {
    /// The file's only driver (a file listing several is refused).
    Any,
    /// This driver when the file lists `[[drivers]]`; a one-driver file's own otherwise
    /// (its file was chosen by this name already).
    IfListed(String),
    /// This driver, in a file of either form.
    Named(String),
}

/// A config file and the driver to take from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub path: PathBuf,
    pub driver: DriverChoice,
}

/// Finds the config file of a binary hook, whose argv Cube fixes and which names no
/// config, and the driver it serves. The rule, first match wins:
/// 1. `$CUBE_CSI_BRIDGE_CONFIG` (in a file listing `[[drivers]]`, the executable's name
///    `cube-csi-bridge-<name>` picks the driver);
/// 2. the executable's own name `cube-csi-bridge-<name>` (a symlink per driver) selects
///    `/etc/cube-csi-bridge/<name>.toml` when it exists, else driver `<name>` of
///    `/etc/cube-csi-bridge/config.toml`;
/// 3. `/etc/cube-csi-bridge/config.toml`, which must then configure one driver.
///
/// The environment and the file system are passed in so that tests touch neither.
pub fn locate(
    env_value: Option<&str>,
    argv0: Option<&str>,
    exists: impl Fn(&Path) -> bool,
) -> Located {
    let name = argv0
        .and_then(|a| Path::new(a).file_name())
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix(EXECUTABLE_PREFIX))
        .filter(|n| !n.is_empty());
    if let Some(value) = env_value.filter(|v| !v.trim().is_empty()) {
        return Located {
            path: PathBuf::from(value.trim()),
            driver: name.map_or(DriverChoice::Any, |n| DriverChoice::IfListed(n.to_string())),
        };
    }
    if let Some(name) = name {
        let own = Path::new(CONFIG_DIR).join(format!("{name}.toml"));
        return if exists(&own) {
            Located {
                path: own,
                driver: DriverChoice::IfListed(name.to_string()),
            }
        } else {
            Located {
                path: PathBuf::from(DEFAULT_CONFIG_PATH),
                driver: DriverChoice::Named(name.to_string()),
            }
        };
    }
    Located {
        path: PathBuf::from(DEFAULT_CONFIG_PATH),
        driver: DriverChoice::Any,
    }
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
        let nfs_file = |p: &Path| p == Path::new("/etc/cube-csi-bridge/nfs.toml");
        let located = |path: &str, driver: DriverChoice| Located {
            path: PathBuf::from(path),
            driver,
        };
        let named = |n: &str| DriverChoice::Named(n.to_string());
        let if_listed = |n: &str| DriverChoice::IfListed(n.to_string());
        assert_eq!(
            locate(Some("/x.toml"), Some("cube-csi-bridge-nfs"), nfs_file),
            located("/x.toml", if_listed("nfs"))
        );
        assert_eq!(
            locate(Some("/x.toml"), Some("cube-csi-bridge"), nfs_file),
            located("/x.toml", DriverChoice::Any)
        );
        assert_eq!(
            locate(None, Some("/usr/local/bin/cube-csi-bridge-nfs"), nfs_file),
            located("/etc/cube-csi-bridge/nfs.toml", if_listed("nfs"))
        );
        assert_eq!(
            locate(None, Some("/usr/local/bin/cube-csi-bridge-local"), nfs_file),
            located(DEFAULT_CONFIG_PATH, named("local")),
            "no local.toml: driver local of the shared file"
        );
        assert_eq!(
            locate(Some(" "), Some("cube-csi-bridge"), nfs_file),
            located(DEFAULT_CONFIG_PATH, DriverChoice::Any)
        );
        assert_eq!(
            locate(None, None, nfs_file),
            located(DEFAULT_CONFIG_PATH, DriverChoice::Any)
        );
    }
}
