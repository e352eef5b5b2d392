//! Names and paths derived from a Cube volume: the CSI volume name, host_path, staging.

use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

/// Longest Cube volume_id (CubeMaster and CubeAPI enforce the same limit).
pub const MAX_VOLUME_ID_LEN: usize = 128;
/// CSI limits names and most strings to 128 bytes.
pub const MAX_CSI_NAME_LEN: usize = 128;
/// Hex digits of the hash that replaces the tail of an over-long CSI name.
const NAME_HASH_LEN: usize = 16;

/// Most bytes of a volume_id quoted in errors and log lines: a refused one may be of any
/// length.
const MAX_QUOTED_ID: usize = 128;

/// `id` for a log field: whole when short, else its first 128 bytes, `…` and its length.
pub fn short_volume_id(id: &str) -> std::borrow::Cow<'_, str> {
    let head = id_head(id);
    if head.len() == id.len() {
        id.into()
    } else {
        format!("{head}… ({} bytes)", id.len()).into()
    }
}

/// `id` quoted for a message, as `short_volume_id` bounds it.
pub fn quote_volume_id(id: &str) -> String {
    let head = id_head(id);
    if head.len() == id.len() {
        format!("{id:?}")
    } else {
        format!("{head:?}… ({} bytes)", id.len())
    }
}

fn id_head(id: &str) -> &str {
    let mut end = id.len().min(MAX_QUOTED_ID);
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    &id[..end]
}

/// Checks a Cube volume_id: `[A-Za-z0-9_-]{1,128}` (it may begin with `-`). It becomes
/// part of paths and file names, so anything else is refused before it is used.
pub fn validate_volume_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("volume_id is empty".into());
    }
    if id.len() > MAX_VOLUME_ID_LEN {
        return Err(format!(
            "volume_id is {} bytes long; at most {MAX_VOLUME_ID_LEN} are allowed",
            id.len()
        ));
    }
    if let Some(bad) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return Err(format!(
            "volume_id {id:?} contains {bad:?}; only [A-Za-z0-9_-] is allowed"
        ));
    }
    Ok(())
}

/// The CreateVolume name for a Cube volume: `prefix + volume_id`, or, when that would
/// exceed CSI's 128 bytes, a truncated form ending in a hash of the whole volume_id. The
/// same volume_id always gives the same name, so a retried Create finds its volume.
pub fn csi_volume_name(prefix: &str, volume_id: &str) -> String {
    let full = format!("{prefix}{volume_id}");
    if full.len() <= MAX_CSI_NAME_LEN {
        return full;
    }
    let digest = Sha256::digest(volume_id.as_bytes());
    let hash: String = digest
        .iter()
        .take(NAME_HASH_LEN / 2)
        .map(|b| format!("{b:02x}"))
        .collect();
    // volume_id is ASCII, so byte slicing is safe.
    let keep = MAX_CSI_NAME_LEN - prefix.len() - 1 - NAME_HASH_LEN;
    format!("{prefix}{}-{hash}", &volume_id[..keep])
}

/// Checks Attach's volume_base_dir: absolute, already normal (no `.`, `..`, `//`), and
/// not `/` itself.
pub fn validate_base_dir(dir: &str) -> Result<PathBuf, String> {
    let path = Path::new(dir);
    if !path.is_absolute() {
        return Err(format!("volume_base_dir {dir:?} is not absolute"));
    }
    let normal: PathBuf = path.components().collect();
    if normal == Path::new("/") {
        return Err("volume_base_dir must not be /".into());
    }
    let trimmed = dir.trim_end_matches('/');
    if path
        .components()
        .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        || normal.as_os_str() != trimmed
    {
        return Err(format!(
            "volume_base_dir {dir:?} is not a normal path (no '.', '..' or '//')"
        ));
    }
    if dir.len() > 1024 {
        return Err("volume_base_dir is longer than 1024 bytes".into());
    }
    Ok(normal)
}

/// Where a volume lives on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePaths {
    /// CSI target_path = Cube host_path: `<base>/<driver>-<volume_id>`.
    pub target: PathBuf,
    /// CSI staging_target_path: `<base>/.staging/<driver>-<volume_id>`. Inside the base
    /// dir, so it sits on the same propagating mount and never collides with a host_path.
    pub staging: PathBuf,
}

impl VolumePaths {
    pub fn new(base_dir: &Path, driver: &str, volume_id: &str) -> Self {
        let leaf = format!("{driver}-{volume_id}");
        Self {
            target: base_dir.join(&leaf),
            staging: base_dir.join(".staging").join(leaf),
        }
    }

    /// Recovers the paths from a host_path Cube hands back, checking that it has exactly
    /// the shape the bridge produces for this driver and volume (so Detach metadata can
    /// never point the bridge at another directory).
    pub fn from_target(target: &Path, driver: &str, volume_id: &str) -> Result<Self, String> {
        let base = target
            .parent()
            .ok_or_else(|| format!("mount_dir {} has no parent", target.display()))?;
        let base_str = base
            .to_str()
            .ok_or_else(|| format!("mount_dir {} is not UTF-8", target.display()))?;
        let base = validate_base_dir(base_str).map_err(|e| format!("mount_dir: {e}"))?;
        let paths = Self::new(&base, driver, volume_id);
        if paths.target != target {
            return Err(format!(
                "mount_dir {} is not this volume's host_path {}",
                target.display(),
                paths.target.display()
            ));
        }
        Ok(paths)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ids_are_quoted_up_to_128_bytes() {
        assert_eq!(quote_volume_id("v-1"), "\"v-1\"");
        assert_eq!(short_volume_id("v-1"), "v-1");
        let id = "a".repeat(128);
        assert_eq!(quote_volume_id(&id), format!("{id:?}"));
        let long = format!("{}é{}", "a".repeat(127), "b".repeat(300));
        assert_eq!(
            quote_volume_id(&long),
            format!("\"{}\"… (429 bytes)", "a".repeat(127))
        );
        assert_eq!(
            short_volume_id(&long),
            format!("{}… (429 bytes)", "a".repeat(127))
        );
    }

    #[test]
    fn volume_ids() {
        for ok in ["a", "-starts-with-dash", "A_b-9", &"x".repeat(128)] {
            validate_volume_id(ok).unwrap();
        }
        for bad in ["", "a/b", "..", "a b", "ü", &"x".repeat(129), "a\0"] {
            assert!(validate_volume_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn csi_names_are_stable_and_bounded() {
        assert_eq!(csi_volume_name("cube-", "v1"), "cube-v1");
        let long = "y".repeat(128);
        let name = csi_volume_name("cube-", &long);
        assert_eq!(name.len(), 128);
        assert_eq!(name, csi_volume_name("cube-", &long));
        let other = format!("{}z", "y".repeat(127));
        assert_ne!(name, csi_volume_name("cube-", &other));
    }

    #[test]
    fn base_dirs() {
        assert_eq!(validate_base_dir("/data/v/").unwrap(), Path::new("/data/v"));
        for bad in ["rel", "/", "/a/../b", "/a/./b", "//a", "/a//b", ""] {
            assert!(validate_base_dir(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn paths_round_trip_and_reject_foreign_dirs() {
        let p = VolumePaths::new(Path::new("/data/v"), "nfs", "-x");
        assert_eq!(p.target, Path::new("/data/v/nfs--x"));
        assert_eq!(p.staging, Path::new("/data/v/.staging/nfs--x"));
        assert_eq!(VolumePaths::from_target(&p.target, "nfs", "-x").unwrap(), p);
        assert!(VolumePaths::from_target(Path::new("/etc/nfs--x"), "nfs", "-y").is_err());
        assert!(VolumePaths::from_target(Path::new("/data/../etc/nfs--x"), "nfs", "-x").is_err());
        assert!(VolumePaths::from_target(Path::new("/nfs--x"), "nfs", "-x").is_err());
    }
}
