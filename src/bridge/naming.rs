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
    quote_bounded(id)
}

/// Any value of a request quoted for a message or a log line: escaped (no newline or
/// control character reaches either) and cut to its first bytes, its length said.
pub fn quote_bounded(id: &str) -> String {
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

/// The CreateVolume name of one Create of `volume_id`: `prefix + volume_id + "-" +` 12 hex
/// digits of its own (cut as `csi_volume_name` cuts past 128 bytes). Each Create gets a
/// new name because CreateVolume is idempotent by name and Cube lets a volume_id be used
/// again once its volume is destroyed: with the same name every time, a Create of a reused
/// id would be handed the CSI volume an earlier Destroy kept (a StorageClass's
/// `reclaimPolicy: Retain`, csi-driver-nfs's `onDelete: retain`), and the new volume's
/// owner would read the old one's data. A retried Create finds its volume by the name its
/// intent record holds, never by deriving it again.
pub fn fresh_csi_volume_name(prefix: &str, volume_id: &str) -> String {
    csi_volume_name(prefix, &format!("{volume_id}-{}", name_nonce()))
}

/// 12 hex digits no other call of this process returns and another process returns only
/// by chance (one in 2^48): a counter hashed with keys the standard library draws from the
/// kernel's random source once per process.
fn name_nonce() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static KEYS: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut hasher = KEYS
        .get_or_init(std::collections::hash_map::RandomState::new)
        .build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
    format!("{:012x}", hasher.finish() >> 16)
}

/// A stable CreateVolume (or CreateSnapshot) name: `prefix + id`, or, when that would
/// exceed CSI's 128 bytes, a truncated form ending in a hash of the whole id. The same id
/// always gives the same name.
///
/// A plain name that reads like a truncated one (128 bytes ending in `-` and 16 hex
/// digits) is hashed too: else a volume_id crafted as another, longer one's truncated form
/// would get that volume's name, and CreateVolume, idempotent by name, would hand it the
/// other volume (and its Destroy would delete it).
pub fn csi_volume_name(prefix: &str, volume_id: &str) -> String {
    let full = format!("{prefix}{volume_id}");
    if full.len() < MAX_CSI_NAME_LEN
        || (full.len() == MAX_CSI_NAME_LEN && !reads_as_truncated(&full))
    {
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

/// Whether a 128-byte `name` ends as `csi_volume_name`'s truncated form does.
fn reads_as_truncated(name: &str) -> bool {
    let tail = &name.as_bytes()[name.len() - NAME_HASH_LEN - 1..];
    tail[0] == b'-'
        && tail[1..]
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
}

/// Checks Attach's volume_base_dir: absolute, already normal (no `.`, `..`, `//`), and
/// not `/` itself.
pub fn validate_base_dir(dir: &str) -> Result<PathBuf, String> {
    // Before anything quotes it: an error message says only bounded values.
    if dir.len() > 1024 {
        return Err(format!(
            "volume_base_dir {} is longer than 1024 bytes",
            quote_bounded(dir)
        ));
    }
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
    Ok(normal)
}

/// Joins driver and volume_id in a path leaf. It is in neither alphabet (driver names are
/// `[A-Za-z0-9._-]`, volume ids `[A-Za-z0-9_-]`), so every leaf holds exactly one and
/// splits one way only: no two (driver, volume) pairs share a host_path, whichever bridge
/// instances use one base dir. No leaf of the legacy form or of Cube's own plugins
/// (`<driver>-<volume_id>`) contains it either. Safe wherever the path travels: mountinfo
/// leaves it as it is, it means nothing to a shell or in a mount option list, and systemd
/// unit names escape it (`\x2b`) as they escape `-`.
pub const LEAF_SEPARATOR: char = '+';

/// How a path leaf joins driver and volume_id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeafForm {
    /// `<driver>+<volume_id>`: what every fresh Attach gets.
    Current,
    /// `<driver>-<volume_id>`, from the releases before [`LEAF_SEPARATOR`]: ambiguous
    /// across drivers (`nfs` + `prod-x` and `nfs-prod` + `x` meet). Still followed for
    /// volumes their records or Cube's metadata show were attached that way, so an upgrade
    /// leaves them working until their last Detach.
    Legacy,
}

/// The leaf (`<base>/<leaf>`, `<base>/.staging/<leaf>`) of a driver's volume.
pub fn path_leaf(driver: &str, volume_id: &str, form: LeafForm) -> String {
    match form {
        LeafForm::Current => format!("{driver}{LEAF_SEPARATOR}{volume_id}"),
        LeafForm::Legacy => format!("{driver}-{volume_id}"),
    }
}

/// The driver and volume_id of a current-form leaf; None for anything else (a legacy leaf
/// cannot be split: its driver and volume_id are ambiguous).
pub fn split_leaf(leaf: &str) -> Option<(&str, &str)> {
    let (driver, volume_id) = leaf.split_once(LEAF_SEPARATOR)?;
    let valid = !driver.is_empty()
        && !volume_id.contains(LEAF_SEPARATOR)
        && validate_volume_id(volume_id).is_ok();
    valid.then_some((driver, volume_id))
}

/// Where a volume lives on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePaths {
    /// CSI target_path = Cube host_path: `<base>/<driver>+<volume_id>` (legacy records:
    /// `<base>/<driver>-<volume_id>`).
    pub target: PathBuf,
    /// CSI staging_target_path: `<base>/.staging/<leaf>`, the target's leaf. Inside the
    /// base dir, so it sits on the same propagating mount and never collides with a
    /// host_path.
    pub staging: PathBuf,
}

impl VolumePaths {
    /// The paths a fresh Attach uses (the current form).
    pub fn new(base_dir: &Path, driver: &str, volume_id: &str) -> Self {
        Self::with_form(base_dir, driver, volume_id, LeafForm::Current)
    }

    /// The paths in a given form (the legacy one only for volumes attached that way).
    pub fn with_form(base_dir: &Path, driver: &str, volume_id: &str, form: LeafForm) -> Self {
        let leaf = path_leaf(driver, volume_id, form);
        Self {
            target: base_dir.join(&leaf),
            staging: base_dir.join(".staging").join(leaf),
        }
    }

    /// The paths of a volume in `base_dir` whose journal record says it is published at
    /// `recorded_target`: the legacy form when that is where the record put it (a volume
    /// attached before the upgrade keeps its host_path), else the current form.
    pub fn for_record(
        base_dir: &Path,
        driver: &str,
        volume_id: &str,
        recorded_target: &Path,
    ) -> Self {
        let legacy = Self::with_form(base_dir, driver, volume_id, LeafForm::Legacy);
        if legacy.target == recorded_target {
            legacy
        } else {
            Self::new(base_dir, driver, volume_id)
        }
    }

    /// Recovers the paths from a host_path Cube hands back, checking that it has exactly
    /// the shape the bridge produces for this driver and volume, in either form (so Detach
    /// metadata can never point the bridge at another directory, and metadata of a volume
    /// attached before the upgrade still works).
    pub fn from_target(target: &Path, driver: &str, volume_id: &str) -> Result<Self, String> {
        // The caller's path, quoted bounded in every message below.
        let shown = || quote_bounded(&target.to_string_lossy());
        let base = target
            .parent()
            .ok_or_else(|| format!("mount_dir {} has no parent", shown()))?;
        let base_str = base
            .to_str()
            .ok_or_else(|| format!("mount_dir {} is not UTF-8", shown()))?;
        let base = validate_base_dir(base_str).map_err(|e| format!("mount_dir: {e}"))?;
        let paths = Self::new(&base, driver, volume_id);
        if paths.target == target {
            return Ok(paths);
        }
        let legacy = Self::with_form(&base, driver, volume_id, LeafForm::Legacy);
        if legacy.target == target {
            return Ok(legacy);
        }
        Err(format!(
            "mount_dir {} is not this volume's host_path {}",
            shown(),
            paths.target.display()
        ))
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
        // Exactly 128 bytes, plain: kept as it is.
        let fits = "x".repeat(123);
        assert_eq!(csi_volume_name("cube-", &fits), format!("cube-{fits}"));
    }

    /// Two Creates of one volume_id never share a CreateVolume name, short or cut.
    #[test]
    fn each_create_of_a_volume_id_gets_a_name_of_its_own() {
        for id in ["v1".to_string(), "y".repeat(128)] {
            let (a, b) = (
                fresh_csi_volume_name("cube-", &id),
                fresh_csi_volume_name("cube-", &id),
            );
            assert_ne!(a, b);
            for name in [&a, &b] {
                assert!(name.len() <= MAX_CSI_NAME_LEN, "{name}");
                assert!(name.starts_with(&format!("cube-{}", &id[..2])), "{name}");
            }
        }
        let short = fresh_csi_volume_name("cube-", "v1");
        let nonce = short.strip_prefix("cube-v1-").unwrap();
        assert!(nonce.len() == 12 && nonce.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    /// A volume_id crafted as a longer one's truncated name gets a name of its own.
    #[test]
    fn a_volume_id_shaped_as_another_ones_truncated_name_gets_its_own() {
        let long = "a".repeat(124);
        let truncated = csi_volume_name("cube-", &long);
        let forged = truncated.strip_prefix("cube-").unwrap();
        validate_volume_id(forged).unwrap();
        let name = csi_volume_name("cube-", forged);
        assert_ne!(name, truncated);
        assert_eq!(name.len(), 128);
        assert_eq!(name, csi_volume_name("cube-", forged), "stable");
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
        assert_eq!(p.target, Path::new("/data/v/nfs+-x"));
        assert_eq!(p.staging, Path::new("/data/v/.staging/nfs+-x"));
        assert_eq!(VolumePaths::from_target(&p.target, "nfs", "-x").unwrap(), p);
        assert!(VolumePaths::from_target(Path::new("/etc/nfs+-x"), "nfs", "-y").is_err());
        assert!(VolumePaths::from_target(Path::new("/data/../etc/nfs+-x"), "nfs", "-x").is_err());
        assert!(VolumePaths::from_target(Path::new("/nfs+-x"), "nfs", "-x").is_err());
        // Another driver's leaf, in either form, is not this volume's.
        assert!(
            VolumePaths::from_target(Path::new("/data/v/nfs-prod+x"), "nfs", "prod-x").is_err()
        );
        assert!(
            VolumePaths::from_target(Path::new("/data/v/nfs+prod-x"), "nfs-prod", "x").is_err()
        );
    }

    #[test]
    fn legacy_paths_are_still_recognised() {
        let legacy = VolumePaths::with_form(Path::new("/data/v"), "nfs", "-x", LeafForm::Legacy);
        assert_eq!(legacy.target, Path::new("/data/v/nfs--x"));
        assert_eq!(legacy.staging, Path::new("/data/v/.staging/nfs--x"));
        assert_eq!(
            VolumePaths::from_target(&legacy.target, "nfs", "-x").unwrap(),
            legacy
        );
        assert!(VolumePaths::from_target(Path::new("/data/v/nfs--y"), "nfs", "-x").is_err());
        let base = Path::new("/data/v");
        assert_eq!(
            VolumePaths::for_record(base, "nfs", "-x", &legacy.target),
            legacy
        );
        let current = VolumePaths::new(base, "nfs", "-x");
        assert_eq!(
            VolumePaths::for_record(base, "nfs", "-x", &current.target),
            current
        );
        // A record elsewhere (another base dir) gives no reason to keep the legacy form.
        let elsewhere = Path::new("/data/w/nfs--x");
        assert_eq!(
            VolumePaths::for_record(base, "nfs", "-x", elsewhere),
            current
        );
    }

    #[test]
    fn leaves_split_one_way_only() {
        assert_eq!(split_leaf("nfs+prod-x"), Some(("nfs", "prod-x")));
        assert_eq!(split_leaf("nfs-prod+x"), Some(("nfs-prod", "x")));
        assert_eq!(split_leaf("a.b_c-d+-_-"), Some(("a.b_c-d", "-_-")));
        for bad in [
            "nfs-prod-x",
            "+x",
            "nfs+",
            "a+b+c",
            "nfs+x/y",
            "nfs+x.y",
            "",
        ] {
            assert_eq!(split_leaf(bad), None, "{bad:?}");
        }
        for (driver, id) in [("nfs", "prod-x"), ("a.b", "-"), ("x-", "-y"), ("d_1", "_")] {
            let leaf = path_leaf(driver, id, LeafForm::Current);
            assert_eq!(split_leaf(&leaf), Some((driver, id)));
        }
    }

    /// (driver, volume_id) -> leaf is injective over the names that break the legacy
    /// form: every driver's dashes, dots and underscores against every volume's; and no
    /// current leaf is any legacy leaf (of this bridge or of Cube's own plugins).
    #[test]
    fn leaves_never_collide() {
        let drivers = [
            "nfs",
            "nfs-prod",
            "nfs-",
            "nfs--prod",
            "n",
            "n-f",
            "n.f",
            "n_f",
            "a-b-c",
        ];
        let ids = [
            "x", "prod-x", "-x", "--x", "prod--x", "f-x", "b-c", "c", "_", "-", "x_y",
        ];
        let mut seen = std::collections::HashMap::new();
        let mut legacy = std::collections::HashSet::new();
        for driver in drivers {
            for id in ids {
                let leaf = path_leaf(driver, id, LeafForm::Current);
                if let Some(other) = seen.insert(leaf.clone(), (driver, id)) {
                    panic!("{leaf} is both {other:?} and {:?}", (driver, id));
                }
                legacy.insert(path_leaf(driver, id, LeafForm::Legacy));
            }
        }
        // The legacy form did collide (the reason for the change).
        assert!(legacy.len() < drivers.len() * ids.len());
        assert!(seen.keys().all(|leaf| !legacy.contains(leaf)));
        assert_eq!(
            path_leaf("nfs", "prod-x", LeafForm::Legacy),
            path_leaf("nfs-prod", "x", LeafForm::Legacy)
        );
    }
}
