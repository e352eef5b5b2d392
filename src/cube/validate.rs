//! Turns Cube's wire requests into the bridge's validated types. A request that fails
//! here changes nothing: no lock, no CSI call, no record.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::bridge::handoff::{AttachMetadata, VolumeHandle};
use crate::bridge::naming::{validate_base_dir, validate_volume_id};
use crate::bridge::{AttachVolume, CreateVolume, DestroyVolume, DetachVolume};
use crate::config::Config;
use crate::proto::cube::v1 as pb;

/// Longest sandbox id, namespace or Cube volume name accepted.
const MAX_LABEL_LEN: usize = 256;

fn label(field: &str, value: &str, required: bool) -> Result<(), String> {
    if required && value.is_empty() {
        return Err(format!("{field} is empty"));
    }
    if value.len() > MAX_LABEL_LEN {
        return Err(format!("{field} is longer than {MAX_LABEL_LEN} bytes"));
    }
    if value.chars().any(char::is_control) {
        return Err(format!("{field} contains control characters"));
    }
    Ok(())
}

fn ref_count(value: i64) -> Result<(), String> {
    if value < 0 {
        return Err(format!("ref_count is {value}; it must be 0 or more"));
    }
    Ok(())
}

pub fn create(req: pb::CreateRequest) -> Result<CreateVolume, String> {
    validate_volume_id(&req.volume_id)?;
    label("name", &req.name, false)?;
    Ok(CreateVolume {
        volume_id: req.volume_id,
        name: req.name,
    })
}

pub fn destroy(req: pb::DestroyRequest) -> Result<DestroyVolume, String> {
    validate_volume_id(&req.volume_id)?;
    Ok(DestroyVolume {
        volume_id: req.volume_id,
    })
}

pub fn attach(req: pb::AttachRequest, config: &Config) -> Result<AttachVolume, String> {
    validate_volume_id(&req.volume_id)?;
    label("sandbox_id", &req.sandbox_id, true)?;
    label("namespace", &req.namespace, false)?;
    ref_count(req.ref_count)?;
    let base_dir = if req.volume_base_dir.is_empty() {
        config.node.default_volume_base_dir.clone()
    } else {
        validate_base_dir(&req.volume_base_dir)?
    };
    check_base_dir_allowed(&base_dir, config)?;
    let handle = VolumeHandle::decode_for(&req.private_data, &config.driver)?;
    Ok(AttachVolume {
        sandbox_id: req.sandbox_id,
        namespace: req.namespace,
        volume_id: req.volume_id,
        ref_count: req.ref_count,
        base_dir,
        handle,
    })
}

pub fn detach(req: pb::DetachRequest, config: &Config) -> Result<DetachVolume, String> {
    validate_volume_id(&req.volume_id)?;
    label("sandbox_id", &req.sandbox_id, false)?;
    label("namespace", &req.namespace, false)?;
    ref_count(req.ref_count)?;
    metadata_size(&req.metadata)?;
    let recorded = AttachMetadata::from_map(&req.metadata, &config.driver, &req.volume_id)
        .map_err(|e| format!("metadata: {e}"))?;
    if let Some(meta) = &recorded
        && let Some(base) = meta.paths.target.parent()
    {
        check_base_dir_allowed(base, config).map_err(|e| format!("metadata mount_dir: {e}"))?;
    }
    Ok(DetachVolume {
        sandbox_id: req.sandbox_id,
        namespace: req.namespace,
        volume_id: req.volume_id,
        ref_count: req.ref_count,
        recorded,
    })
}

/// Longest Detach metadata accepted, all keys and values together: what Attach returns is
/// a few paths and the CSI handle, well under this.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;
/// Longest `--metadata` text parsed: MAX_METADATA_BYTES with every byte escaped, and room
/// for the syntax. Checked first, since serde's errors quote what they refuse.
const MAX_METADATA_TEXT: usize = 8 * MAX_METADATA_BYTES;
/// Most metadata entries accepted (Attach returns at most four).
const MAX_METADATA_ENTRIES: usize = 32;

fn metadata_size(metadata: &HashMap<String, String>) -> Result<(), String> {
    let bytes: usize = metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
    if metadata.len() > MAX_METADATA_ENTRIES || bytes > MAX_METADATA_BYTES {
        return Err(format!(
            "metadata has {} entries and {bytes} bytes; what Attach returns has at most \
             {MAX_METADATA_ENTRIES} entries and {MAX_METADATA_BYTES} bytes",
            metadata.len()
        ));
    }
    Ok(())
}

/// The bridge creates directories and the driver mounts under the base dir, as root: only
/// the configured ones are allowed. The name is compared as written (Cube checks
/// host_paths lexically too), and where it leads must be allowed as well: a symlink at an
/// allowed name (to /, say) is refused unless its destination is also in the list.
fn check_base_dir_allowed(dir: &Path, config: &Config) -> Result<(), String> {
    if config.node.base_dir_allowed(dir) {
        return match resolved(dir) {
            Some(real) if real != dir && !config.node.base_dir_allowed(&real) => Err(format!(
                "volume_base_dir {dir:?} leads through a symlink to {real:?}, which is not \
                 one of node.allowed_base_dirs; add it there if volumes really belong there"
            )),
            _ => Ok(()),
        };
    }
    Err(format!(
        "volume_base_dir {dir:?} is not one of node.allowed_base_dirs ({}); add it there if \
         Cubelet's volume_plugin_base_dir really is that",
        config
            .node
            .allowed_base_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    ))
}

/// Where `dir` really is: symlinks resolved in the part that exists, the rest appended.
/// None when nothing of it can be resolved.
///
/// A base dir that exists and leads through no symlink is where it says: one `openat2`
/// with `RESOLVE_NO_SYMLINKS` proves that, on each hook, instead of a `readlink` per
/// component. Anything else (a component that is a symlink, a part that is missing, a
/// kernel without `openat2`) is resolved component by component. Nothing is remembered
/// between hooks: a directory renamed away and replaced by a symlink to it is the same
/// directory somewhere else, and is judged where it is now.
fn resolved(dir: &Path) -> Option<PathBuf> {
    if crate::mount::mountinfo::leads_through_no_symlink(dir) {
        return Some(dir.components().collect());
    }
    resolved_afresh(dir)
}

fn resolved_afresh(dir: &Path) -> Option<PathBuf> {
    let mut existing = dir;
    let mut rest = Vec::new();
    loop {
        match std::fs::canonicalize(existing) {
            Ok(real) => return Some(rest.iter().rev().fold(real, |p, c| p.join(c))),
            Err(_) => {
                rest.push(existing.file_name()?);
                existing = existing.parent()?;
            }
        }
    }
}

/// Parses the binary hook's `--metadata` argument: a JSON object of strings.
pub fn metadata_json(text: &str) -> Result<HashMap<String, String>, String> {
    if text.len() > MAX_METADATA_TEXT {
        return Err(format!(
            "--metadata is {} bytes; at most {MAX_METADATA_TEXT} are accepted",
            text.len()
        ));
    }
    if text.trim().is_empty() {
        return Ok(HashMap::new());
    }
    // serde's message quotes the value it met (a whole string, up to the limit above):
    // only what kind of error, and where.
    serde_json::from_str(text).map_err(|e| {
        format!(
            "--metadata is not a JSON object of strings ({:?} error at line {}, column {})",
            e.classify(),
            e.line(),
            e.column()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a caller sends is quoted in an error only bounded and escaped: the message
    /// stays short (Cube stores it, root's log keeps it) and holds no newline. Before,
    /// a base dir of megabytes, a metadata string of 100 KiB or a path with a newline
    /// came back whole.
    #[test]
    fn rejected_values_are_quoted_bounded_and_escaped() {
        let config = config();
        let long = |dir: String| {
            let mut req = attach_req();
            req.volume_base_dir = dir;
            attach(req, &config).unwrap_err()
        };
        for message in [
            long("r".repeat(3 << 20)),
            long(format!("/{}", "r".repeat(3 << 20))),
            long("/data/v\nINFO forged line".into()),
            metadata_json(&format!("{:?}", "m".repeat(100 << 10))).unwrap_err(),
        ] {
            assert!(message.len() < 2048, "{} bytes", message.len());
            assert!(!message.contains('\n'), "{message}");
        }
    }

    fn config() -> Config {
        Config::parse(
            "driver = \"nfs\"\n[csi]\nendpoint = \"/run/x.sock\"\n[node]\nallowed_base_dirs = [\"/data/v\", \"/data/cube-shared/volume\"]\n",
            Path::new("t.toml"),
        )
        .unwrap()
    }

    fn attach_req() -> pb::AttachRequest {
        pb::AttachRequest {
            sandbox_id: "sb".into(),
            namespace: "default".into(),
            volume_id: "-v1".into(),
            volume_base_dir: "/data/v".into(),
            ref_count: 0,
            private_data: r#"{"v":1,"id":"h"}"#.into(),
        }
    }

    /// Issue 20: a base dir without symlinks is taken as it is after one `openat2`, and
    /// nothing is remembered between hooks: a base dir swapped for a symlink out of the
    /// allowed list after a hook passed is refused at the next hook, also when the
    /// symlink leads to the very directory that was allowed, renamed away.
    #[test]
    fn a_base_dir_is_judged_where_it_leads_at_each_hook() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().canonicalize().unwrap();
        let (allowed, outside) = (real.join("allowed"), real.join("outside"));
        std::fs::create_dir(&outside).unwrap();
        let config = Config::parse(
            &format!(
                "driver = \"nfs\"\n[csi]\nendpoint = \"/run/x.sock\"\n[node]\nallowed_base_dirs = [{:?}]\ndefault_volume_base_dir = {:?}\n",
                allowed.display().to_string(),
                allowed.display().to_string()
            ),
            Path::new("t.toml"),
        )
        .unwrap();
        assert!(check_base_dir_allowed(&allowed, &config).is_ok(), "missing");
        std::fs::create_dir(&allowed).unwrap();
        for _ in 0..2 {
            assert!(check_base_dir_allowed(&allowed, &config).is_ok());
            assert_eq!(resolved(&allowed).as_deref(), Some(allowed.as_path()));
        }
        std::fs::remove_dir(&allowed).unwrap();
        std::os::unix::fs::symlink(&outside, &allowed).unwrap();
        let error = check_base_dir_allowed(&allowed, &config).unwrap_err();
        assert!(error.contains("leads through a symlink"), "{error}");
        // And back: allowed again.
        std::fs::remove_file(&allowed).unwrap();
        std::fs::create_dir(&allowed).unwrap();
        assert!(check_base_dir_allowed(&allowed, &config).is_ok());
        // The same directory renamed out of the list, a symlink to it in its place: the
        // directory is now outside, and refused (a memo keyed by the directory's
        // identity took it for the one it had allowed).
        let moved = real.join("moved");
        std::fs::rename(&allowed, &moved).unwrap();
        std::os::unix::fs::symlink(&moved, &allowed).unwrap();
        let error = check_base_dir_allowed(&allowed, &config).unwrap_err();
        assert!(error.contains("leads through a symlink"), "{error}");
    }

    #[test]
    fn attach_accepts_a_good_request_and_defaults_the_base_dir() {
        let ok = attach(attach_req(), &config()).unwrap();
        assert_eq!(ok.base_dir, Path::new("/data/v"));
        let mut req = attach_req();
        req.volume_base_dir.clear();
        assert_eq!(
            attach(req, &config()).unwrap().base_dir,
            Path::new(crate::config::DEFAULT_VOLUME_BASE_DIR)
        );
    }

    #[test]
    fn attach_rejects_bad_fields_with_their_names() {
        type Mutation = fn(&mut pb::AttachRequest);
        let cases: [(Mutation, &str); 7] = [
            (|r| r.volume_base_dir = "/etc".into(), "allowed_base_dirs"),
            (|r| r.volume_id = "../etc".into(), "volume_id"),
            (|r| r.volume_base_dir = "data".into(), "volume_base_dir"),
            (
                |r| r.volume_base_dir = "/data/../etc".into(),
                "volume_base_dir",
            ),
            (|r| r.ref_count = -1, "ref_count"),
            (|r| r.private_data = "garbage".into(), "private_data"),
            (|r| r.sandbox_id.clear(), "sandbox_id"),
        ];
        for (mutate, field) in cases {
            let mut req = attach_req();
            mutate(&mut req);
            let err = attach(req, &config()).unwrap_err();
            assert!(err.contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn metadata_json_is_strict() {
        assert!(metadata_json("{}").unwrap().is_empty());
        assert!(metadata_json(r#"{"a":1}"#).is_err());
        assert!(metadata_json("[]").is_err());
        assert_eq!(metadata_json(r#"{"a":"b"}"#).unwrap()["a"], "b");
        // Refused before serde, whose message would quote the string.
        let huge = format!("\"{}\"", "m".repeat(1_000_000));
        let message = metadata_json(&huge).unwrap_err();
        assert!(message.len() < 256, "{} bytes", message.len());
    }
}
