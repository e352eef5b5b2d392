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
/// 1. `$CUBE_CSI_BRIDGE_CONFIG` (the executable's name `cube-csi-bridge-<name>` picks
///    the driver, which a one-driver file must configure: the variable reaches every
///    plugin Cube forks, each bridge hook under its own name);
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
        // The variable is in the environment of every plugin Cube forks: a hook invoked
        // as another driver's (cube-csi-bridge-ceph) must not serve the one driver of a
        // file written for another (nfs), or Cube's ceph volumes are made on NFS.
        return Located {
            path: PathBuf::from(value.trim()),
            driver: name.map_or(DriverChoice::Any, |n| DriverChoice::Named(n.to_string())),
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
/// world-readable file in a 0700 directory is private. `opened` is the file that was read
/// (its descriptor's metadata): the path must still lead to it, or nothing is known of
/// what was read, and it is refused.
pub(super) fn check_access(
    path: &Path,
    opened: &std::fs::Metadata,
    holds_secrets: bool,
    mount_flags: &[String],
) -> Result<(), String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let changed = |why: String| {
        format!(
            "{why} after it was read, so what was read cannot be checked (was it replaced \
             while the bridge read it?); keep the config where only root can change it"
        )
    };
    let real = std::fs::canonicalize(path)
        .map_err(|e| changed(format!("{} no longer resolves ({e})", path.display())))?;
    let meta = std::fs::metadata(&real)
        .map_err(|e| changed(format!("{} cannot be read ({e})", real.display())))?;
    if (meta.dev(), meta.ino()) != (opened.dev(), opened.ino()) {
        return Err(changed(format!("{} leads to another file", path.display())));
    }
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
    check_owners(path, &real, nix::unistd::geteuid().as_raw())?;
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

/// Refuses a file the bridge would act on as root (an executable it runs) that anyone but
/// root or the bridge's own user could change or replace, by the rule of `check_owners`.
pub fn check_trusted_file(path: &Path) -> Result<(), String> {
    let real = std::fs::canonicalize(path).map_err(|e| format!("{}: {e}", path.display()))?;
    check_owners(path, &real, nix::unistd::geteuid().as_raw())
}

/// What on the way to a file lets someone other than root or the bridge's own user put
/// another file in its place.
#[derive(Debug, PartialEq, Eq)]
pub enum Replaceable {
    /// A directory above it that user owns, or may write without the sticky bit; with why.
    Dir(PathBuf, String),
    /// A symlink on the path as written, owned by that uid. In a sticky directory (as
    /// /tmp) the owner of an entry may rename another link over it at any time, after any
    /// check, so where the path leads is theirs to choose.
    Link(PathBuf, u32),
}

impl Replaceable {
    /// The reason as a clause about `what` (e.g. "it", "state.dir /x").
    pub fn describe(&self, what: &str) -> String {
        match self {
            Replaceable::Dir(dir, why) => {
                format!("the directory {} above {what} {why}", dir.display())
            }
            Replaceable::Link(link, uid) => format!(
                "{what} goes through the symlink {}, owned by uid {uid}, which its owner can \
                 point elsewhere at any time",
                link.display()
            ),
        }
    }
}

/// The first thing on the way to any of `paths` through which someone other than root or
/// `euid` could replace what lies there: a symlink such a user owns, or a directory that
/// one owns, or that its group or others may write without the sticky bit (a sticky one
/// still must be owned by root or `euid`). Every path is walked as the kernel resolves it,
/// component by component, following each link to wherever it leads: every link met and
/// every directory a name is looked up in counts, also those only a link's target passes
/// through (a root link to `/opt/deploy/current`, itself a link in a directory a deploy
/// group may write, puts that directory on the way). With `read_only_passes`, anything
/// on a read-only mount passes.
pub fn untrusted_on_the_way<'a>(
    paths: impl IntoIterator<Item = &'a Path>,
    euid: u32,
    read_only_passes: bool,
) -> Option<Replaceable> {
    use std::os::unix::fs::MetadataExt;
    let trusted = |uid: u32| uid == 0 || uid == euid;
    let read_only = |p: &Path| {
        nix::sys::statvfs::statvfs(p)
            .is_ok_and(|fs| fs.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
    };
    let walks: Vec<Walked> = paths.into_iter().map(walk).collect();
    // Links first: a link another user owns decides where everything after it leads, so
    // the directories found through it say nothing.
    for (link, uid) in walks.iter().flat_map(|w| &w.links) {
        let passes = trusted(*uid) || (read_only_passes && link.parent().is_some_and(read_only));
        if !passes {
            return Some(Replaceable::Link(link.clone(), *uid));
        }
    }
    for dir in walks.iter().flat_map(|w| &w.dirs) {
        let Ok(meta) = std::fs::metadata(dir) else {
            continue;
        };
        let mode = meta.mode() & 0o7777;
        let writable_by_others = mode & 0o022 != 0 && mode & 0o1000 == 0;
        if (trusted(meta.uid()) && !writable_by_others) || (read_only_passes && read_only(dir)) {
            continue;
        }
        let why = if trusted(meta.uid()) {
            format!("is writable by its group or by others (mode {mode:o})")
        } else {
            format!("is owned by uid {}", meta.uid())
        };
        return Some(Replaceable::Dir(dir.clone(), why));
    }
    None
}

/// What resolving a path meets: each symlink (with its owner), and each directory a name
/// is looked up in.
#[derive(Debug, Default)]
struct Walked {
    links: Vec<(PathBuf, u32)>,
    dirs: Vec<PathBuf>,
}

/// Resolves `path` as the kernel would (from `/`, or the working directory), recording
/// what `Walked` holds, up to the first component that does not exist (nothing beyond it
/// is on the way yet). At most 40 links are followed, as the kernel does.
fn walk(path: &Path) -> Walked {
    use std::collections::VecDeque;
    use std::os::unix::fs::MetadataExt;
    use std::path::Component;
    let mut walked = Walked::default();
    let start = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut left: VecDeque<std::ffi::OsString> = VecDeque::new();
    let push_front = |left: &mut VecDeque<std::ffi::OsString>, p: &Path| {
        let parts: Vec<_> = p
            .components()
            .filter_map(|c| match c {
                Component::Normal(n) => Some(n.to_os_string()),
                Component::ParentDir => Some("..".into()),
                _ => None,
            })
            .collect();
        for part in parts.into_iter().rev() {
            left.push_front(part);
        }
    };
    push_front(&mut left, &start);
    let mut at = PathBuf::from("/");
    let mut hops = 0;
    while let Some(name) = left.pop_front() {
        if name == ".." {
            at.pop();
            continue;
        }
        if !walked.dirs.contains(&at) {
            walked.dirs.push(at.clone());
        }
        let next = at.join(&name);
        let Ok(meta) = std::fs::symlink_metadata(&next) else {
            break;
        };
        if meta.file_type().is_symlink() {
            walked.links.push((next.clone(), meta.uid()));
            hops += 1;
            let Ok(target) = std::fs::read_link(&next) else {
                break;
            };
            if hops > 40 {
                break;
            }
            if target.is_absolute() {
                at = PathBuf::from("/");
            }
            push_front(&mut left, &target);
            continue;
        }
        at = next;
    }
    walked
}

/// Why users other than root or `euid` may add names to `dir` (resolved): its owner is
/// someone else, or its group or others may write it, with the sticky bit too (that stops
/// renames and removals of others' entries, not a new name where none is). None when only
/// root or `euid` may, or when it cannot be read.
pub fn others_may_add_names(dir: &Path, euid: u32) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let real = std::fs::canonicalize(dir).ok()?;
    let meta = std::fs::metadata(&real).ok()?;
    let mode = meta.mode() & 0o7777;
    let trusted = meta.uid() == 0 || meta.uid() == euid;
    (!trusted || mode & 0o022 != 0).then(|| {
        format!(
            "{} lets another user add names to it (owner uid {}, mode {mode:o})",
            real.display(),
            meta.uid()
        )
    })
}

/// Refuses a config file that anyone but root (or `euid`, the user the bridge runs as)
/// could change, or replace: the file must be owned by one of them and writable by no
/// group or other user, and so must every directory above it, as written (`path`, whose
/// symlinks could be swapped; none of them may be another user's) and as resolved
/// (`real`). A directory others may write is
/// allowed only with the sticky bit (as /tmp: nobody else can remove or rename what is in
/// it; it must still be owned by root or `euid`), and
/// anything on a read-only mount is allowed (a Kubernetes ConfigMap volume).
fn check_owners(path: &Path, real: &Path, euid: u32) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let trusted = |uid: u32| uid == 0 || uid == euid;
    let read_only = |p: &Path| {
        nix::sys::statvfs::statvfs(p)
            .is_ok_and(|fs| fs.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
    };
    let owner = if euid == 0 {
        "root".to_string()
    } else {
        format!("root or uid {euid} (the bridge's own)")
    };
    let meta = std::fs::metadata(real).map_err(|e| format!("{}: {e}", real.display()))?;
    let mode = meta.mode() & 0o7777;
    if !read_only(real) {
        if !trusted(meta.uid()) {
            return Err(format!(
                "{} is owned by uid {}, who could change what the bridge does as root; \
                 it must be owned by {owner}: chown root {}",
                real.display(),
                meta.uid(),
                real.display()
            ));
        }
        if mode & 0o022 != 0 {
            return Err(format!(
                "{} is writable by its group or by others (mode {mode:o}), who could change \
                 what the bridge does as root; chmod go-w {}",
                real.display(),
                real.display()
            ));
        }
    }
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    if let Some(replaceable) = untrusted_on_the_way([absolute.as_path(), real], euid, true) {
        return Err(format!(
            "{}, so someone other than {owner} could replace the file; keep it in a \
             directory owned by {owner} and writable only by its owner, reached through no \
             other user's symlink (chown root and chmod go-w the directory, or move the file, \
             e.g. a config to /etc/cube-csi-bridge)",
            replaceable.describe("it")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A root link whose target goes through another link, kept in a directory others
    /// may write: that directory is on the way (its writers can re-point the second link),
    /// though neither the path as written nor as finally resolved passes through it.
    #[test]
    fn a_writable_directory_a_link_passes_through_is_on_the_way() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let hop = tmp.path().join("hop");
        let real = tmp.path().join("real");
        std::fs::create_dir(&hop).unwrap();
        std::fs::create_dir(&real).unwrap();
        std::fs::set_permissions(&hop, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&real, hop.join("current")).unwrap();
        std::os::unix::fs::symlink(hop.join("current"), tmp.path().join("state")).unwrap();
        let euid = nix::unistd::geteuid().as_raw();
        let written = tmp.path().join("state/nfs");
        let resolved = real.join("nfs");
        let found = untrusted_on_the_way([written.as_path(), resolved.as_path()], euid, false);
        assert_eq!(
            found,
            Some(Replaceable::Dir(
                hop.clone(),
                "is writable by its group or by others (mode 777)".into()
            ))
        );
        // Without the writable hop, nothing is.
        std::fs::set_permissions(&hop, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(untrusted_on_the_way([written.as_path()], euid, false), None);
    }

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
            located("/x.toml", named("nfs")),
            "the executable's driver, in a one-driver file too"
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

    /// What was read must be what is checked: a config unlinked after the read (its
    /// path no longer resolves) or replaced by another file is refused, however good the
    /// file now at the path looks. Before, a path that no longer resolved passed every
    /// check, so a planted config removed right after a hook read it was obeyed.
    #[test]
    fn a_config_gone_or_replaced_after_it_was_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bridge.toml");
        std::fs::write(&path, "driver = \"x\"\n").unwrap();
        let read = std::fs::metadata(&path).unwrap();
        check_access(&path, &read, false, &[]).unwrap();
        // Made while the read one still exists, so it cannot have its inode.
        let other = dir.path().join("other.toml");
        std::fs::write(&other, "driver = \"x\"\n").unwrap();
        std::fs::rename(&other, &path).unwrap();
        let e = check_access(&path, &read, false, &[]).unwrap_err();
        assert!(e.contains("leads to another file"), "{e}");
        std::fs::remove_file(&path).unwrap();
        let e = check_access(&path, &read, false, &[]).unwrap_err();
        assert!(e.contains("no longer resolves"), "{e}");
    }

    /// The three configs of issue 18 finding 6, and what stays allowed. Needs root (it
    /// gives files to other users); skipped without it.
    #[test]
    fn only_root_or_the_bridge_itself_may_change_or_replace_the_config() {
        use std::os::unix::fs::{PermissionsExt, chown};
        if !crate::testing::as_root("give files to other users") {
            return;
        }
        let root = tempfile::tempdir().unwrap();
        // What `Config::load` checks (before this check existed, it took all three).
        let check = |file: &Path| check_access(file, &std::fs::metadata(file).unwrap(), false, &[]);
        let config = |dir: &Path, mode: u32| {
            std::fs::create_dir_all(dir).unwrap();
            let file = dir.join("bridge.toml");
            std::fs::write(&file, "driver = \"x\"\n").unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            file
        };
        // Root's own 0600 file in root's 0700 directory: fine.
        let good = config(&root.path().join("good"), 0o600);
        check(&good).unwrap();

        // A 0600 config owned by an unprivileged user.
        let theirs = config(&root.path().join("theirs"), 0o600);
        chown(&theirs, Some(1000), None).unwrap();
        let e = check(&theirs).unwrap_err();
        assert!(
            e.contains(&theirs.display().to_string())
                && e.contains("uid 1000")
                && e.contains("chown root"),
            "{e}"
        );
        // A root config in a user-owned directory.
        let dir = root.path().join("user-dir");
        let in_theirs = config(&dir, 0o600);
        chown(&dir, Some(1000), None).unwrap();
        let e = check(&in_theirs).unwrap_err();
        assert!(
            e.contains(&dir.display().to_string()) && e.contains("uid 1000"),
            "{e}"
        );
        // A group-writable config (with secrets or not).
        let group = config(&root.path().join("group"), 0o660);
        let e = check(&group).unwrap_err();
        assert!(e.contains("mode 660") && e.contains("chmod go-w"), "{e}");
        // A group-writable directory above an otherwise good file.
        let dir = root.path().join("group-dir");
        let below = config(&dir, 0o600);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o775)).unwrap();
        assert!(check(&below).unwrap_err().contains("mode 775"));
        // A world-writable directory with the sticky bit (as /tmp) cannot have the file
        // replaced: allowed.
        let dir = root.path().join("sticky");
        let sticky = config(&dir, 0o644);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        check(&sticky).unwrap();
        // A symlink in a directory others may write could be swapped: its directory is
        // checked too, not only where the link leads.
        let links = root.path().join("links");
        std::fs::create_dir(&links).unwrap();
        let link = links.join("bridge.toml");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        check(&link).unwrap();
        chown(&links, Some(1000), None).unwrap();
        assert!(
            check(&link)
                .unwrap_err()
                .contains(&links.display().to_string())
        );
        // The config path itself a symlink another user owns, in a sticky directory root
        // owns: where it leads is good, but its owner can rename another link over it and
        // hand the next start any root-owned file.
        let sticky_links = root.path().join("sticky-links");
        std::fs::create_dir(&sticky_links).unwrap();
        std::fs::set_permissions(&sticky_links, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let their_link = sticky_links.join("bridge.toml");
        std::os::unix::fs::symlink(&good, &their_link).unwrap();
        check(&their_link).unwrap();
        std::os::unix::fs::lchown(&their_link, Some(1000), Some(1000)).unwrap();
        let e = check(&their_link).unwrap_err();
        assert!(
            e.contains(&format!(
                "goes through the symlink {}",
                their_link.display()
            )) && e.contains("uid 1000"),
            "{e}"
        );
        // The bridge running as uid 1000 may use its own files.
        check_owners(&theirs, &theirs, 1000).unwrap();
        check_owners(&their_link, &good, 1000).unwrap();
    }
}
