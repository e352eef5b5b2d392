//! Whose mount table decides that a host_path is really mounted.
//!
//! Cubelet lives in its own mount namespace, a one-way slave of the host's. A volume the
//! CSI driver mounted is only usable by a sandbox if the mount shows up *there*. setns()
//! into a mount namespace is refused to a multi-threaded process, so the daemon reads the
//! mountinfo of a process that lives in that namespace, and only when none is found
//! forks a short-lived child of itself that enters the namespace and prints its table.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use super::MountTable;

/// The hidden subcommand the namespace reader runs as (see `read_in_namespace`).
pub const MOUNTINFO_SUBCOMMAND: &str = "__mountinfo-in-namespace";

/// Where mount-point checks look.
#[derive(Debug)]
pub enum MountView {
    /// This process's own mount namespace.
    Own,
    /// Checks are skipped (only for setups where nothing else is possible).
    Unchecked,
    /// The namespace bound at `file` (Cubelet's is `.../cubeletmnt/mnt`).
    Namespace {
        file: PathBuf,
        /// A process last seen living there, to read its mountinfo without forking.
        cached_pid: AtomicU32,
    },
}

impl MountView {
    /// Builds the view from the `node.mount_view` setting. `forked_by_cube` is true for
    /// the binary hook, which Cubelet forks inside its own namespace already.
    pub fn from_setting(setting: &str, forked_by_cube: bool) -> Self {
        match setting {
            "none" => MountView::Unchecked,
            "self" => MountView::Own,
            "auto" if forked_by_cube => MountView::Own,
            "auto" => {
                let file = Path::new(crate::config::CUBELET_MOUNT_NS);
                if namespace_inode(file).is_some() {
                    MountView::namespace(file.to_path_buf())
                } else {
                    MountView::Own
                }
            }
            path => MountView::namespace(PathBuf::from(path)),
        }
    }

    pub fn namespace(file: PathBuf) -> Self {
        MountView::Namespace {
            file,
            cached_pid: AtomicU32::new(0),
        }
    }

    /// A short description for messages.
    pub fn describe(&self) -> String {
        match self {
            MountView::Own => "this process's mount namespace".into(),
            MountView::Unchecked => "no mount namespace (checks disabled)".into(),
            MountView::Namespace { file, .. } => {
                format!("the mount namespace bound at {}", file.display())
            }
        }
    }

    /// The mount table as seen from this view; `None` when checks are disabled.
    /// Blocking: call from a blocking-capable context.
    pub fn table(&self) -> std::io::Result<Option<MountTable>> {
        match self {
            MountView::Unchecked => Ok(None),
            MountView::Own => MountTable::read(None).map(Some),
            MountView::Namespace { file, cached_pid } => {
                let inode = namespace_inode(file).ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("{} is not a mount-namespace file", file.display()),
                    )
                })?;
                let cached = cached_pid.load(Ordering::Relaxed);
                if cached != 0 && process_namespace_inode(cached) == Some(inode) {
                    // Re-check after reading: the pid may have been reused meanwhile.
                    let table = MountTable::read(Some(cached));
                    if process_namespace_inode(cached) == Some(inode)
                        && let Ok(table) = table
                    {
                        return Ok(Some(table));
                    }
                }
                if let Some(pid) = find_process_in_namespace(inode) {
                    cached_pid.store(pid, Ordering::Relaxed);
                    if let Ok(table) = MountTable::read(Some(pid)) {
                        return Ok(Some(table));
                    }
                }
                read_in_namespace(file).map(Some)
            }
        }
    }

    /// Whether `path` is a mount point in this view (`true` when checks are disabled).
    /// A symlinked parent is resolved first (see `resolve_parent`).
    pub fn is_mount_point(&self, path: &Path) -> std::io::Result<bool> {
        let Some(table) = self.table()? else {
            return Ok(true);
        };
        Ok(table.is_mount_point(&super::resolve_parent(path)))
    }
}

/// The inode of the namespace a nsfs file refers to, if it is one.
fn namespace_inode(file: &Path) -> Option<u64> {
    // A bound namespace file is an nsfs inode; an ordinary empty file is not.
    let meta = std::fs::metadata(file).ok()?;
    let own = std::fs::metadata("/proc/self/ns/mnt").ok()?;
    (meta.dev() == own.dev()).then_some(meta.ino())
}

fn process_namespace_inode(pid: u32) -> Option<u64> {
    std::fs::metadata(format!("/proc/{pid}/ns/mnt"))
        .ok()
        .map(|m| m.ino())
}

fn find_process_in_namespace(inode: u64) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| process_namespace_inode(*pid) == Some(inode))
}

/// Forks this executable as `<exe> __mountinfo-in-namespace <file>`; the child enters the
/// namespace while it is still single-threaded and prints its mountinfo.
fn read_in_namespace(file: &Path) -> std::io::Result<MountTable> {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .arg(MOUNTINFO_SUBCOMMAND)
        .arg(file)
        .stdin(std::process::Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "reading mountinfo inside {} failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(MountTable::parse(&String::from_utf8_lossy(&out.stdout)))
}

/// The child side of `read_in_namespace`: must run before any thread is started.
pub fn print_mountinfo_in_namespace(file: &Path) -> std::io::Result<()> {
    let ns = std::fs::File::open(file)?;
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNS).map_err(std::io::Error::from)?;
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    use std::io::Write;
    std::io::stdout().write_all(text.as_bytes())
}
