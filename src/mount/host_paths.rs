//! The directories the node side makes, checks and removes around the driver's calls, on
//! the host: the core's `HostPaths` port. Below the base dir every step is an
//! openat/mkdirat/fstatat/unlinkat relative to a directory already checked, with
//! O_NOFOLLOW, so a symlink planted there never redirects a mount, an unmount or an rmdir.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use std::time::Duration;

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, OFlag, RenameFlags, openat, readlinkat, renameat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat, mkdirat};
use nix::sys::time::TimeSpec;
use nix::unistd::{UnlinkatFlags, unlinkat};

use super::ops;
use crate::bridge::ports::{Found, HostPaths, Leaf, PathError};

/// Which base dirs the bridge accepts, by owner and mode.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum BaseDirPolicy {
    /// Owned by root or this process's euid, and not writable by group or others: no
    /// other user can put anything under it. The default.
    #[default]
    Strict,
    /// Any owner and mode, for the operator's `reason` (a non-root Cubelet that owns its
    /// base dir). Everything under the base dir is still checked as under `Strict`; what
    /// is lost is that its owner could swap a checked directory between the check and the
    /// driver's use of the path.
    AnyOwner { reason: String },
}

/// Directories as the host sees them, made with the modes the CSI layout wants and checked
/// as the port describes.
#[derive(Debug, Clone, Default)]
pub struct HostDirs {
    policy: BaseDirPolicy,
    /// Which base dirs are on a filesystem that answers from memory or a local disk.
    from_memory: std::sync::Arc<super::mountinfo::MemoryAnswers>,
}

const BASE_HINT: &str = "A volume base dir must be owned by root and not writable by group \
     or others, or its users can put a symlink where the bridge mounts: chown root and \
     chmod go-w it (see docs/security.md for a non-root Cubelet)";
const BELOW_HINT: &str = "Nothing under a volume base dir may be a symlink, and .staging is \
     the bridge's own: remove what is there (it was not made by the bridge) and retry";

/// Opened without following, for walking only: O_PATH needs no read permission.
fn dir_flags() -> OFlag {
    OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

fn found(stat: &FileStat) -> Found {
    Found {
        uid: stat.st_uid,
        mode: stat.st_mode & 0o7777,
    }
}

fn io(op: &'static str, path: &Path, errno: Errno) -> PathError {
    PathError::Io {
        op,
        path: path.to_path_buf(),
        source: errno.into(),
    }
}

fn refused(
    path: &Path,
    problem: impl Into<String>,
    found: Option<Found>,
    hint: &'static str,
) -> PathError {
    PathError::Refused {
        path: path.to_path_buf(),
        problem: problem.into(),
        found,
        hint,
    }
}

/// Whether the bridge (root, or this euid) could have made `stat` and nobody else can
/// change what is in it.
fn owned_and_closed(stat: &FileStat) -> Option<String> {
    // The daemon never changes its euid: asked once, not at every directory of every walk.
    static EUID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let euid = *EUID.get_or_init(|| nix::unistd::Uid::effective().as_raw());
    if stat.st_uid != 0 && stat.st_uid != euid {
        return Some(format!("is owned by uid {}, not root", stat.st_uid));
    }
    if stat.st_mode & 0o022 != 0 {
        return Some("is writable by group or others".into());
    }
    None
}

/// The refusal for `name` in `dir` (at `path`), which is not a real directory.
fn not_a_dir(dir: &OwnedFd, name: &OsStr, path: &Path) -> PathError {
    match fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(stat) if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK => {
            // Quoted: whoever planted the link chose its target, newlines included.
            let to = readlinkat(dir, name)
                .map(|t| format!("{:?}", PathBuf::from(t)))
                .unwrap_or_else(|_| "?".into());
            refused(
                path,
                format!("is a symlink (to {to})"),
                Some(found(&stat)),
                BELOW_HINT,
            )
        }
        Ok(stat) => refused(path, "is not a directory", Some(found(&stat)), BELOW_HINT),
        Err(e) => io("check", path, e),
    }
}

/// Whether `name` in `dir` is a real directory (a symlink is not). The leaf may be the
/// root of a volume's mount, perhaps of a network or FUSE filesystem whose server is gone:
/// its type is taken from the cached attributes (`AT_STATX_DONT_SYNC`), so the check never
/// waits on that server, and a forked hook can make it before it has any deadline to keep;
/// a dead mount root stays a directory to the checks, so it can be unmounted and repaired.
fn leaf_is_dir(dir: &OwnedFd, name: &OsStr) -> Result<bool, Errno> {
    use nix::libc;
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(name.as_bytes()).map_err(|_| Errno::EINVAL)?;
    let stx = super::mountinfo::statx(
        dir.as_raw_fd(),
        &name,
        super::mountinfo::UNREVALIDATED,
        libc::STATX_TYPE,
    )?;
    Ok(u32::from(stx.stx_mode) & libc::S_IFMT == libc::S_IFDIR)
}

/// The names of `path` below `base`: one or two plain names (`<leaf>`, `.staging/<leaf>`).
fn below<'a>(base: &Path, path: &'a Path) -> Result<Vec<&'a OsStr>, PathError> {
    let names: Option<Vec<&OsStr>> = path.strip_prefix(base).ok().and_then(|rest| {
        rest.components()
            .map(|c| match c {
                Component::Normal(name) => Some(name),
                _ => None,
            })
            .collect()
    });
    match names {
        Some(names) if (1..=2).contains(&names.len()) => Ok(names),
        _ => Err(refused(
            path,
            format!("is not a volume path under the base dir {}", base.display()),
            None,
            BELOW_HINT,
        )),
    }
}

/// Where a walk below the base dir stopped.
enum Walk {
    /// The leaf's parent, checked, and what the leaf is.
    At(OwnedFd, Leaf),
    /// A directory above the leaf is missing.
    Missing,
}

impl HostDirs {
    /// Directories checked with `policy` for the base dir.
    pub fn new(policy: BaseDirPolicy) -> Self {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if let BaseDirPolicy::AnyOwner { reason } = &policy
            && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            // Said once per process: the operator chose a weaker check and must see why.
            tracing::warn!(
                %reason,
                "volume base dirs of any owner and mode are accepted; their owner can race \
                 the checks of the paths under them"
            );
        }
        Self {
            policy,
            from_memory: Default::default(),
        }
    }

    /// Opens the base dir (its own name is resolved as given) and checks its owner and
    /// mode; `None` when it is missing (nothing can be mounted under it then).
    fn open_base(&self, base: &Path) -> Result<Option<OwnedFd>, PathError> {
        let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let fd = match openat(AT_FDCWD, base, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(None),
            Err(Errno::ENOTDIR) => {
                return Err(refused(base, "is not a directory", None, BASE_HINT));
            }
            Err(e) => return Err(io("open the volume base dir", base, e)),
        };
        let stat = fstat(&fd).map_err(|e| io("check", base, e))?;
        if self.policy == BaseDirPolicy::Strict
            && let Some(problem) = owned_and_closed(&stat)
        {
            return Err(refused(base, problem, Some(found(&stat)), BASE_HINT));
        }
        Ok(Some(fd))
    }

    /// Walks from the base dir to `path`'s parent without following symlinks, checking
    /// each directory between them as the bridge's own; `make` creates the missing ones
    /// (and the leaf) first.
    fn walk(&self, base: &Path, path: &Path, make: bool) -> Result<Walk, PathError> {
        let names = below(base, path)?;
        let (leaf, between) = names.split_last().expect("one or two names");
        let Some(mut dir) = self.open_base(base)? else {
            return Ok(Walk::Missing);
        };
        let mut at = base.to_path_buf();
        for name in between {
            at.push(name);
            // Opened before it is made: a mkdir that finds the directory there still takes
            // the lock of the directory it is in, the base dir, where the driver makes and
            // removes every target dir.
            let opened = match openat(&dir, *name, dir_flags(), Mode::empty()) {
                Err(Errno::ENOENT) if make => {
                    mkdir(&dir, name, &at)?;
                    openat(&dir, *name, dir_flags(), Mode::empty())
                }
                opened => opened,
            };
            dir = match opened {
                Ok(fd) => fd,
                Err(Errno::ENOENT) => return Ok(Walk::Missing),
                Err(Errno::ENOTDIR | Errno::ELOOP) => return Err(not_a_dir(&dir, name, &at)),
                Err(e) => return Err(io("open", &at, e)),
            };
            let stat = fstat(&dir).map_err(|e| io("check", &at, e))?;
            if let Some(problem) = owned_and_closed(&stat) {
                return Err(refused(&at, problem, Some(found(&stat)), BELOW_HINT));
            }
        }
        // A staging dir its volume's last Detach parked is taken back instead of made.
        if make && !(between == [OsStr::new(STAGING)] && unpark(&dir, leaf)) {
            mkdir(&dir, leaf, path)?;
        }
        let leaf_is = match leaf_is_dir(&dir, leaf) {
            Ok(true) => Leaf::Dir,
            Ok(false) => return Err(not_a_dir(&dir, leaf, path)),
            Err(Errno::ENOENT) => Leaf::Missing,
            Err(e) => return Err(io("check", path, e)),
        };
        Ok(Walk::At(dir, leaf_is))
    }
}

/// The bridge's directory in the base dir, holding the staging dirs.
const STAGING: &str = ".staging";
/// Where a last Detach leaves its volume's empty staging dir, under its own name, for the
/// volume's next first Attach (`.staging/.parked/<leaf>`): a rename each way, where an
/// rmdir and a mkdir free and allocate an inode (on ext4 without a journal each new inode
/// is found past every one freed in the last minutes, and with `discard` each rmdir waits
/// for the device while it holds `.staging`'s lock). No leaf is named so: every leaf holds
/// a `+` (or, legacy, a `-`).
const PARKED: &str = ".parked";
/// The file in `.parked` whose mtime says when it was last pruned.
const PRUNED_STAMP: &str = ".pruned";
/// A parked dir not taken back for this long is removed...
const PARKED_KEEP: Duration = Duration::from_secs(3600);
/// ...by the first park after this long since the last prune.
const PRUNE_EVERY: Duration = Duration::from_secs(600);

/// `name` in `dir`, a directory opened for walking, when it passes the check of the
/// bridge's own directories; None otherwise (missing, a symlink, anyone else's).
fn open_own_dir(dir: &OwnedFd, name: &str) -> Option<OwnedFd> {
    let fd = openat(dir, name, dir_flags(), Mode::empty()).ok()?;
    let stat = fstat(&fd).ok()?;
    owned_and_closed(&stat).is_none().then_some(fd)
}

/// Moves the parked staging dir `leaf` back into `.staging` (`staging`); false when there
/// is none (or `.parked` fails its check: a mkdir follows, as without one). Never over an
/// existing entry.
fn unpark(staging: &OwnedFd, leaf: &OsStr) -> bool {
    let Some(parked) = open_own_dir(staging, PARKED) else {
        return false;
    };
    renameat2(&parked, leaf, staging, leaf, RenameFlags::RENAME_NOREPLACE).is_ok()
}

/// Whether `name` in `dir` is a directory with nothing in it. A symlink or anything else
/// is an error (ENOTDIR, ELOOP), as for an rmdir.
fn is_empty_dir(dir: &OwnedFd, name: &OsStr) -> Result<bool, Errno> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut entries = Dir::openat(dir, name, flags, Mode::empty())?;
    for entry in entries.iter() {
        if !matches!(entry?.file_name().to_bytes(), b"." | b"..") {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Removes the parked dirs of `.parked` (`parked`) not taken back for `keep`, at most once
/// per `every` across processes (the stamp's mtime). A rename sets the moved dir's ctime,
/// so that is when it was parked. Best effort: what cannot be removed waits for the next
/// prune, and one that holds files (nothing the bridge parks does) is only reported.
fn prune_parked(parked: &OwnedFd, keep: Duration, every: Duration) {
    use std::time::SystemTime;
    let now = SystemTime::now();
    let ago = |secs: i64, nanos: i64| {
        let at = SystemTime::UNIX_EPOCH
            + Duration::new(secs.max(0) as u64, nanos.clamp(0, 999_999_999) as u32);
        now.duration_since(at).unwrap_or_default()
    };
    let nofollow = nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW;
    if let Ok(stamp) = fstatat(parked, PRUNED_STAMP, nofollow)
        && ago(stamp.st_mtime, stamp.st_mtime_nsec) < every
    {
        return;
    }
    let stamped = openat(
        parked,
        PRUNED_STAMP,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .and_then(|fd| nix::sys::stat::futimens(&fd, &TimeSpec::UTIME_NOW, &TimeSpec::UTIME_NOW));
    if let Err(error) = stamped {
        tracing::debug!(%error, "could not stamp the pruning of parked staging dirs");
        return;
    }
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let Ok(mut entries) = Dir::openat(parked, ".", flags, Mode::empty()) else {
        return;
    };
    let names: Vec<std::ffi::CString> = entries
        .iter()
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_owned())
        .filter(|name| !name.to_bytes().starts_with(b"."))
        .collect();
    for name in names {
        let Ok(stat) = fstatat(parked, name.as_c_str(), nofollow) else {
            continue;
        };
        let is_dir = SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR;
        if !is_dir || ago(stat.st_ctime, stat.st_ctime_nsec) < keep {
            continue;
        }
        match unlinkat(parked, name.as_c_str(), UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(error) => {
                tracing::warn!(%error, dir = ?name, "could not remove a parked staging dir")
            }
        }
    }
}

/// mkdir of `name` in `dir` (an existing entry is left for the check that follows).
fn mkdir(dir: &OwnedFd, name: &OsStr, path: &Path) -> Result<(), PathError> {
    match mkdirat(dir, name, Mode::from_bits_truncate(0o750)) {
        Ok(()) | Err(Errno::EEXIST) => Ok(()),
        Err(e) => Err(io("create directory", path, e)),
    }
}

/// A bind mount `check` made under a base dir (`HostDirs::probe_mount`): in a directory of
/// the bridge's own there, `<name>/source` bind-mounted onto `<name>/mount`. Unmounted
/// and its directories removed by `remove`.
#[derive(Debug)]
pub struct ProbeMount {
    base: OwnedFd,
    name: String,
    /// `<base>/<name>`, made here 0700: nobody else can touch what is in it, wherever
    /// its owner of the base dir moves it.
    dir: OwnedFd,
    /// The mount's root, once mounted: what it is unmounted through.
    root: Option<OwnedFd>,
    /// The mount point, `<base>/<name>/mount`.
    pub path: PathBuf,
}

/// The path through which a syscall reaches what `fd` is open on.
fn through(fd: &OwnedFd) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

impl ProbeMount {
    /// Unmounts the probe (through its root: the directory above it may have been moved;
    /// detached lazily if busy) and removes its directories (best effort: this is
    /// `check`'s cleanup). `<name>` goes only while it is still the directory made here.
    pub fn remove(self) {
        if let Some(root) = &self.root
            && nix::mount::umount2(&through(root), nix::mount::MntFlags::empty()).is_err()
        {
            let _ = nix::mount::umount2(&through(root), nix::mount::MntFlags::MNT_DETACH);
        }
        drop(self.root);
        for inside in [PROBE_MOUNT, PROBE_SOURCE] {
            let _ = unlinkat(&self.dir, inside, UnlinkatFlags::RemoveDir);
        }
        let nofollow = nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW;
        let same = |a: &FileStat, b: &FileStat| (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino);
        if let (Ok(there), Ok(made)) = (
            fstatat(&self.base, self.name.as_str(), nofollow),
            fstat(&self.dir),
        ) && same(&there, &made)
        {
            let _ = unlinkat(&self.base, self.name.as_str(), UnlinkatFlags::RemoveDir);
        }
    }
}

/// The probe's mount point and source, in its directory.
const PROBE_MOUNT: &str = "mount";
const PROBE_SOURCE: &str = "source";

impl HostDirs {
    /// Makes a directory `name` of its own in the base dir `base` and, in it, bind-mounts
    /// `source` onto `mount`, as a driver mounts a volume: `check`'s proof that mounts
    /// made there reach Cubelet. The base dir is checked as for a volume (its owner and
    /// mode, with this policy); `name` is made here (one already there is refused, never
    /// reused) and reached from the base dir's descriptor without following; what is in
    /// it, 0700, only root can change. So a name planted in the base dir (a symlink to a
    /// directory of root's) is refused, never mounted over.
    pub fn probe_mount(&self, base: &Path, name: &str) -> Result<ProbeMount, PathError> {
        let Some(base_fd) = self.open_base(base)? else {
            return Err(io("open the volume base dir", base, Errno::ENOENT));
        };
        let at = base.join(name);
        match mkdirat(&base_fd, name, Mode::from_bits_truncate(0o700)) {
            Ok(()) => {}
            Err(Errno::EEXIST) => {
                return Err(refused(
                    &at,
                    "already exists, and check makes its test mount only in a directory it \
                     has just made",
                    None,
                    BELOW_HINT,
                ));
            }
            Err(e) => return Err(io("create directory", &at, e)),
        }
        let dir = openat(&base_fd, name, dir_flags(), Mode::empty())
            .map_err(|e| io("open", &at, e))
            .and_then(|dir| {
                let stat = fstat(&dir).map_err(|e| io("check", &at, e))?;
                match owned_and_closed(&stat) {
                    None => Ok(dir),
                    Some(problem) => Err(refused(&at, problem, Some(found(&stat)), BELOW_HINT)),
                }
            });
        let dir = match dir {
            Ok(dir) => dir,
            Err(e) => {
                // Swapped since it was made: an empty directory of that name goes, nothing
                // else can.
                let _ = unlinkat(&base_fd, name, UnlinkatFlags::RemoveDir);
                return Err(e);
            }
        };
        let mut probe = ProbeMount {
            base: base_fd,
            name: name.to_string(),
            dir,
            root: None,
            path: at.join(PROBE_MOUNT),
        };
        let made = (|| {
            let mut opened = Vec::new();
            for inside in [PROBE_MOUNT, PROBE_SOURCE] {
                let path = at.join(inside);
                mkdirat(&probe.dir, inside, Mode::from_bits_truncate(0o700))
                    .map_err(|e| io("create directory", &path, e))?;
                opened.push(
                    openat(&probe.dir, inside, dir_flags(), Mode::empty())
                        .map_err(|e| io("open", &path, e))?,
                );
            }
            ops::bind_mount(&through(&opened[1]), &through(&opened[0]), false).map_err(
                |source| PathError::Io {
                    op: "make a test mount at",
                    path: probe.path.clone(),
                    source,
                },
            )?;
            // Looked up again, the name now leads into the mount: its root.
            openat(&probe.dir, PROBE_MOUNT, dir_flags(), Mode::empty())
                .map_err(|e| io("open", &probe.path, e))
        })();
        match made {
            Ok(root) => {
                probe.root = Some(root);
                Ok(probe)
            }
            Err(e) => {
                probe.remove();
                Err(e)
            }
        }
    }
}

impl HostPaths for HostDirs {
    fn ensure_base_dir(&self, base: &Path) -> Result<(), PathError> {
        // Made only when it is missing (a mkdir that finds it takes its parent's lock).
        if self.open_base(base)?.is_some() {
            return Ok(());
        }
        ops::ensure_dir(base, 0o755).map_err(|source| PathError::Io {
            op: "create the volume base dir",
            path: base.to_path_buf(),
            source,
        })?;
        match self.open_base(base)? {
            Some(_) => Ok(()),
            None => Err(io("open the volume base dir", base, Errno::ENOENT)),
        }
    }

    fn ensure_staging_dir(&self, base: &Path, path: &Path) -> Result<(), PathError> {
        match self.walk(base, path, true)? {
            Walk::At(_, Leaf::Dir) => Ok(()),
            // Made just now, and gone already: someone else is at work in the base dir.
            _ => Err(io("create directory", path, Errno::ENOENT)),
        }
    }

    fn verify(&self, base: &Path, path: &Path) -> Result<Leaf, PathError> {
        Ok(match self.walk(base, path, false)? {
            Walk::At(_, leaf) => leaf,
            Walk::Missing => Leaf::Missing,
        })
    }

    fn remove_dir_if_empty(&self, base: &Path, path: &Path) -> Result<bool, PathError> {
        let Walk::At(dir, Leaf::Dir) = self.walk(base, path, false)? else {
            return Ok(false);
        };
        let leaf = path.file_name().expect("checked by below()");
        match unlinkat(&dir, leaf, UnlinkatFlags::RemoveDir) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT | Errno::ENOTEMPTY | Errno::EEXIST) => Ok(false),
            // Swapped for something else since the check: not ours to remove.
            Err(Errno::ENOTDIR) => Err(not_a_dir(&dir, leaf, path)),
            Err(e) => Err(io("remove directory", path, e)),
        }
    }

    fn park_staging_dir(&self, base: &Path, path: &Path) -> Result<bool, PathError> {
        if below(base, path)?.first() != Some(&OsStr::new(STAGING)) {
            return self.remove_dir_if_empty(base, path);
        }
        let Walk::At(staging, Leaf::Dir) = self.walk(base, path, false)? else {
            return Ok(false);
        };
        let leaf = path.file_name().expect("checked by below()");
        match is_empty_dir(&staging, leaf) {
            Ok(true) => {}
            Ok(false) | Err(Errno::ENOENT) => return Ok(false),
            Err(Errno::ENOTDIR | Errno::ELOOP) => return Err(not_a_dir(&staging, leaf, path)),
            // Unreadable (a dead mount answering ENOTCONN, say): what an rmdir does.
            Err(_) => return self.remove_dir_if_empty(base, path),
        }
        // Opened first: a mkdir that finds it takes .staging's lock for nothing.
        let parked = open_own_dir(&staging, PARKED).or_else(|| {
            let _ = mkdirat(&staging, PARKED, Mode::from_bits_truncate(0o750));
            open_own_dir(&staging, PARKED)
        });
        let Some(parked) = parked else {
            // .parked is not the bridge's (someone else's, a symlink): removed instead.
            return self.remove_dir_if_empty(base, path);
        };
        match renameat2(&staging, leaf, &parked, leaf, RenameFlags::RENAME_NOREPLACE) {
            Ok(()) => {
                prune_parked(&parked, PARKED_KEEP, PRUNE_EVERY);
                Ok(true)
            }
            // Mounted (in this namespace), or gone since the check.
            Err(Errno::EBUSY | Errno::ENOENT) => Ok(false),
            // One of that name is parked already (a process killed between a park and
            // the record's removal), or `.parked` is not where `.staging` is: removed.
            Err(_) => self.remove_dir_if_empty(base, path),
        }
    }

    fn answers_at_once(&self, base: &Path) -> bool {
        self.from_memory.at(base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    /// Issue 20: a base dir on a disk or memory filesystem is checked on the caller's
    /// thread; one the kernel cannot place (before Linux 6.8) or on another kind of
    /// filesystem (/proc stands in for a network one) is not.
    #[test]
    fn only_a_base_dir_on_a_disk_or_memory_filesystem_answers_at_once() {
        let (_dir, base) = base();
        let dirs = HostDirs::default();
        let kernel_says = crate::mount::mountinfo::unique_mount_id(&base)
            .and_then(crate::mount::mountinfo::mount_magic)
            .map(crate::mount::mountinfo::answers_from_memory);
        assert_eq!(dirs.answers_at_once(&base), kernel_says == Some(true));
        assert!(!dirs.answers_at_once(Path::new("/proc/self")));
        assert!(!dirs.answers_at_once(&base.join("missing")));
    }

    /// Issue 19, defect 8: a dead mount at a checked leaf (its stat answers ENOTCONN) is a
    /// directory to the checks, so it can be unpublished and repaired, and removed once
    /// unmounted.
    #[test]
    fn a_dead_mount_root_is_a_directory_to_the_path_checks() {
        let (_dir, base) = base();
        let dirs = HostDirs::default();
        let target = base.join("d-v");
        std::fs::create_dir(&target).unwrap();
        if crate::mount::mountinfo::mount_dead_fuse(&target).is_none() {
            return;
        }
        let checked = dirs.verify(&base, &target);
        ops::unmount(&target).unwrap();
        assert_eq!(checked.unwrap(), Leaf::Dir);
        assert!(dirs.remove_dir_if_empty(&base, &target).unwrap());
    }

    fn base() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("vol");
        HostDirs::default().ensure_base_dir(&base).unwrap();
        (dir, base)
    }

    fn refused_path(error: PathError) -> PathBuf {
        match error {
            PathError::Refused { path, .. } => path,
            other => panic!("not a refusal: {other}"),
        }
    }

    #[test]
    fn staging_dirs_are_made_and_removed_below_a_checked_base() {
        let (_dir, base) = base();
        let dirs = HostDirs::default();
        let staging = base.join(".staging/d-v");
        dirs.ensure_staging_dir(&base, &staging).unwrap();
        assert_eq!(dirs.verify(&base, &staging).unwrap(), Leaf::Dir);
        assert_eq!(
            dirs.verify(&base, &base.join("d-v")).unwrap(),
            Leaf::Missing
        );
        assert_eq!(
            dirs.verify(&base, &base.join(".nothing/d-v")).unwrap(),
            Leaf::Missing
        );
        let gone = base.join("gone");
        assert_eq!(
            dirs.verify(&gone, &gone.join("d-v")).unwrap(),
            Leaf::Missing
        );
        assert!(!dirs.remove_dir_if_empty(&gone, &gone.join("d-v")).unwrap());
        std::fs::write(staging.join("data"), "x").unwrap();
        assert!(
            !dirs.remove_dir_if_empty(&base, &staging).unwrap(),
            "data kept"
        );
        std::fs::remove_file(staging.join("data")).unwrap();
        assert!(dirs.remove_dir_if_empty(&base, &staging).unwrap());
        assert!(
            dirs.remove_dir_if_empty(&base, &base.join(".staging"))
                .unwrap()
        );
        assert!(!dirs.remove_dir_if_empty(&base, &staging).unwrap(), "gone");
    }

    /// Issue 20: an empty staging dir is parked in `.staging/.parked` and taken back by the
    /// next `ensure_staging_dir` of its path; one that holds anything, a symlink, a target
    /// dir, or a `.parked` that is not the bridge's is never parked (a `.parked` of
    /// anyone else is never taken from either).
    #[test]
    fn only_an_empty_staging_dir_is_parked_and_only_from_the_bridges_own_parked_dir() {
        use std::os::unix::fs::MetadataExt;
        let (dir, base) = base();
        let dirs = HostDirs::default();
        let staging = base.join(".staging/d+v");
        let parked = base.join(".staging/.parked/d+v");
        dirs.ensure_staging_dir(&base, &staging).unwrap();
        let ino = std::fs::metadata(&staging).unwrap().ino();
        std::fs::write(staging.join("data"), "x").unwrap();
        assert!(
            !dirs.park_staging_dir(&base, &staging).unwrap(),
            "data kept"
        );
        assert!(staging.join("data").exists());
        std::fs::remove_file(staging.join("data")).unwrap();
        assert!(dirs.park_staging_dir(&base, &staging).unwrap());
        assert!(!staging.exists());
        assert_eq!(std::fs::metadata(&parked).unwrap().ino(), ino);
        assert!(!dirs.park_staging_dir(&base, &staging).unwrap(), "gone");
        dirs.ensure_staging_dir(&base, &staging).unwrap();
        assert_eq!(
            std::fs::metadata(&staging).unwrap().ino(),
            ino,
            "taken back"
        );
        assert!(!parked.exists());

        // A parked dir of the same name already there: this one is removed.
        std::fs::create_dir(&parked).unwrap();
        assert!(dirs.park_staging_dir(&base, &staging).unwrap());
        assert!(!staging.exists() && parked.is_dir());
        std::fs::remove_dir(&parked).unwrap();

        // A target dir (in the base dir itself) is removed, never parked.
        let target = base.join("d+v");
        std::fs::create_dir(&target).unwrap();
        assert!(dirs.park_staging_dir(&base, &target).unwrap());
        assert!(!target.exists() && !parked.exists());

        // A symlink where the staging dir was: refused, its target untouched.
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        symlink(&elsewhere, &staging).unwrap();
        let error = dirs.park_staging_dir(&base, &staging).unwrap_err();
        assert!(error.to_string().contains("is a symlink"), "{error}");
        assert!(elsewhere.is_dir() && !parked.exists());
        std::fs::remove_file(&staging).unwrap();

        // A .parked another user could write to: not parked into, not taken from.
        let dot_parked = base.join(".staging/.parked");
        std::fs::set_permissions(&dot_parked, PermissionsExt::from_mode(0o777)).unwrap();
        std::fs::create_dir(&parked).unwrap();
        let planted = std::fs::metadata(&parked).unwrap().ino();
        dirs.ensure_staging_dir(&base, &staging).unwrap();
        assert_ne!(std::fs::metadata(&staging).unwrap().ino(), planted);
        assert!(parked.is_dir(), "left where it was");
        std::fs::remove_dir(&parked).unwrap();
        assert!(dirs.park_staging_dir(&base, &staging).unwrap());
        assert!(!staging.exists() && !parked.exists(), "removed instead");
        // A symlink at .parked: the same.
        std::fs::remove_dir_all(&dot_parked).unwrap();
        symlink(&elsewhere, &dot_parked).unwrap();
        dirs.ensure_staging_dir(&base, &staging).unwrap();
        assert!(dirs.park_staging_dir(&base, &staging).unwrap());
        assert!(!staging.exists());
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    }

    /// Needs root (CI runs it as root): `check`'s probe takes only a name it makes; made,
    /// it is a bind mount of its source, and removed it leaves nothing, even when the
    /// base dir's owner moved its directory away meanwhile (the mount is reached through
    /// its root, not by path).
    #[test]
    fn a_probe_mount_is_made_only_in_a_directory_it_made() {
        if !crate::testing::as_root("mount") {
            return;
        }
        let (dir, base) = base();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        symlink(&elsewhere, base.join("p")).unwrap();
        let dirs = HostDirs::default();
        let refused = refused_path(dirs.probe_mount(&base, "p").unwrap_err());
        assert_eq!(refused, base.join("p"));
        assert!(base.join("p").is_symlink(), "removed what it did not make");
        std::fs::remove_file(base.join("p")).unwrap();

        let probe = dirs.probe_mount(&base, "p").unwrap();
        assert_eq!(probe.path, base.join("p/mount"));
        std::fs::write(base.join("p/source/seen"), "").unwrap();
        assert!(
            probe.path.join("seen").exists(),
            "not a bind mount of the source"
        );
        std::fs::remove_file(base.join("p/source/seen")).unwrap();
        probe.remove();
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 0);

        // Moved away after the mount: still unmounted; the moved directory left empty.
        let probe = dirs.probe_mount(&base, "p").unwrap();
        let moved = dir.path().join("moved");
        std::fs::rename(base.join("p"), &moved).unwrap();
        probe.remove();
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !table.contains(&moved.display().to_string()),
            "the probe's mount was left behind"
        );
        assert_eq!(std::fs::read_dir(&moved).unwrap().count(), 0);
    }

    /// Needs root (CI runs it as root): a staging dir still mounted is not parked (the
    /// rename answers EBUSY, as an rmdir would), so the mount is never moved aside.
    #[test]
    fn a_mounted_staging_dir_is_not_parked() {
        if !crate::testing::as_root("mount") {
            return;
        }
        let (_dir, base) = base();
        let dirs = HostDirs::default();
        let staging = base.join(".staging/d+v");
        dirs.ensure_staging_dir(&base, &staging).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &staging,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .unwrap();
        let parked = dirs.park_staging_dir(&base, &staging);
        ops::unmount(&staging).unwrap();
        assert!(!parked.unwrap());
        assert!(!base.join(".staging/.parked/d+v").exists());
        assert!(dirs.park_staging_dir(&base, &staging).unwrap());
    }

    /// A parked dir not taken back for the keep time is removed by a later park, at most
    /// once per prune interval; one that holds files is left.
    #[test]
    fn parked_staging_dirs_not_taken_back_are_pruned() {
        let (_dir, base) = base();
        let dirs = HostDirs::default();
        for leaf in ["d+a", "d+b"] {
            let staging = base.join(".staging").join(leaf);
            dirs.ensure_staging_dir(&base, &staging).unwrap();
            assert!(dirs.park_staging_dir(&base, &staging).unwrap());
        }
        let dot_parked = base.join(".staging/.parked");
        std::fs::write(dot_parked.join("d+b/data"), "x").unwrap();
        let fd = openat(AT_FDCWD, &dot_parked, dir_flags(), Mode::empty()).unwrap();
        let names = || {
            let mut names: Vec<String> = std::fs::read_dir(&dot_parked)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        // Pruned within the interval already (by the parks above): nothing goes.
        prune_parked(&fd, Duration::ZERO, Duration::from_secs(600));
        assert_eq!(names(), [".pruned", "d+a", "d+b"]);
        // Kept for an hour: nothing goes either.
        prune_parked(&fd, Duration::from_secs(3600), Duration::ZERO);
        assert_eq!(names(), [".pruned", "d+a", "d+b"]);
        prune_parked(&fd, Duration::ZERO, Duration::ZERO);
        assert_eq!(names(), [".pruned", "d+b"], "the one with data stays");
    }

    #[test]
    fn symlinks_below_the_base_are_refused_and_never_followed() {
        let (dir, base) = base();
        let dirs = HostDirs::default();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir_all(elsewhere.join("d-v")).unwrap();
        // A leaf that is a symlink.
        symlink(elsewhere.join("d-v"), base.join("d-v")).unwrap();
        let error = dirs.verify(&base, &base.join("d-v")).unwrap_err();
        assert!(error.to_string().contains("is a symlink"), "{error}");
        assert_eq!(refused_path(error), base.join("d-v"));
        let error = dirs
            .remove_dir_if_empty(&base, &base.join("d-v"))
            .unwrap_err();
        assert!(matches!(error, PathError::Refused { .. }), "{error}");
        assert!(
            elsewhere.join("d-v").is_dir(),
            "the link's target is untouched"
        );
        // .staging a symlink to a directory holding the leaf.
        symlink(&elsewhere, base.join(".staging")).unwrap();
        let staging = base.join(".staging/d-v");
        for error in [
            dirs.verify(&base, &staging).unwrap_err(),
            dirs.ensure_staging_dir(&base, &staging).unwrap_err(),
            dirs.remove_dir_if_empty(&base, &staging).unwrap_err(),
        ] {
            assert!(
                error
                    .to_string()
                    .contains(&format!("refusing {}", base.join(".staging").display()))
                    && error.to_string().contains("symlink"),
                "{error}"
            );
        }
        assert!(elsewhere.join("d-v").is_dir());
        // A .staging that another user could write to is not the bridge's.
        std::fs::remove_file(base.join(".staging")).unwrap();
        std::fs::create_dir(base.join(".staging")).unwrap();
        std::fs::set_permissions(base.join(".staging"), PermissionsExt::from_mode(0o777)).unwrap();
        let error = dirs.verify(&base, &staging).unwrap_err();
        assert!(
            error.to_string().contains("writable by group or others"),
            "{error}"
        );
        // A file where a directory belongs.
        std::fs::write(base.join("d-f"), "").unwrap();
        let error = dirs.verify(&base, &base.join("d-f")).unwrap_err();
        assert!(error.to_string().contains("is not a directory"), "{error}");
        // Paths that are not a volume's are refused outright.
        for path in [
            dir.path().join("x"),
            base.join("a/b/c"),
            base.join("../vol/x"),
        ] {
            assert!(dirs.verify(&base, &path).is_err(), "{}", path.display());
        }
    }

    #[test]
    fn a_base_dir_others_can_write_is_refused_unless_the_policy_says_why() {
        let (_dir, base) = base();
        std::fs::set_permissions(&base, PermissionsExt::from_mode(0o777)).unwrap();
        let error = HostDirs::default().ensure_base_dir(&base).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains(&base.display().to_string())
                && text.contains("writable by group or others")
                && text.contains("mode 0777")
                && text.contains("owner uid"),
            "{text}"
        );
        let trusting = HostDirs::new(BaseDirPolicy::AnyOwner {
            reason: "test".into(),
        });
        trusting.ensure_base_dir(&base).unwrap();
        trusting
            .ensure_staging_dir(&base, &base.join(".staging/d-v"))
            .unwrap();
    }
}
