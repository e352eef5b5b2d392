//! Parsing `/proc/<pid>/mountinfo` (proc(5)) and asking whether a path is a mount point.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The mount points of one mount namespace, as one process sees them.
#[derive(Debug, Default, Clone)]
pub struct MountTable {
    /// Each mount point, and whether a mount there propagates to its peers (`shared:`).
    mount_points: HashMap<PathBuf, bool>,
}

impl MountTable {
    /// Reads the table of the namespace `pid` lives in (`None` = this process).
    pub fn read(pid: Option<u32>) -> std::io::Result<Self> {
        let path = match pid {
            Some(pid) => PathBuf::from(format!("/proc/{pid}/mountinfo")),
            None => PathBuf::from("/proc/self/mountinfo"),
        };
        Ok(Self::parse(&std::fs::read_to_string(path)?))
    }

    /// Parses mountinfo text. Lines that do not have the expected shape are skipped.
    pub fn parse(text: &str) -> Self {
        let mut mount_points = HashMap::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            let Some(mount_point) = fields.get(4) else {
                continue;
            };
            // Optional fields run from the 7th up to the "-" separator.
            let shared = fields
                .iter()
                .skip(6)
                .take_while(|f| **f != "-")
                .any(|f| f.starts_with("shared:"));
            let entry = mount_points
                .entry(PathBuf::from(unescape(mount_point)))
                .or_insert(false);
            // Of stacked mounts, the top one (listed last) is what the path shows.
            *entry = shared;
        }
        Self { mount_points }
    }

    /// Whether `path` is the mount point of at least one mount.
    pub fn is_mount_point(&self, path: &Path) -> bool {
        self.mount_points.contains_key(path)
    }

    /// Mount points at or below `dir`.
    pub fn under<'a>(&'a self, dir: &'a Path) -> impl Iterator<Item = &'a Path> + 'a {
        self.mount_points
            .keys()
            .map(PathBuf::as_path)
            .filter(move |p| p.starts_with(dir))
    }

    /// The mount `path` lies on (the longest mount point above it), and whether it is
    /// shared, i.e. whether mounts made below it propagate to other namespaces.
    pub fn mount_of(&self, path: &Path) -> Option<(&Path, bool)> {
        self.mount_points
            .iter()
            .filter(|(mount_point, _)| path.starts_with(mount_point))
            .max_by_key(|(mount_point, _)| mount_point.as_os_str().len())
            .map(|(mount_point, shared)| (mount_point.as_path(), *shared))
    }
}

/// The flags of a `statx` that nothing at the path can make wait: the last component's
/// symlink is not followed, an automount is not triggered, and cached attributes are not
/// revalidated (a network or FUSE mount whose server is gone answers from the cache).
pub(crate) const UNREVALIDATED: nix::libc::c_int =
    nix::libc::AT_STATX_DONT_SYNC | nix::libc::AT_NO_AUTOMOUNT | nix::libc::AT_SYMLINK_NOFOLLOW;

/// One `statx(2)` of `name`, relative to the directory `dir` (`AT_FDCWD`: `name` is a
/// path), asking for `mask` with `flags`: what the kernel filled in, or its errno. The one
/// place the bridge calls statx, which nix does not wrap.
pub(crate) fn statx(
    dir: std::os::fd::RawFd,
    name: &std::ffi::CStr,
    flags: nix::libc::c_int,
    mask: nix::libc::c_uint,
) -> Result<nix::libc::statx, nix::errno::Errno> {
    let mut buf = std::mem::MaybeUninit::<nix::libc::statx>::zeroed();
    // SAFETY: name is NUL-terminated, dir is AT_FDCWD or an open descriptor, and buf is a
    // zeroed statx the kernel fills.
    let rc = unsafe { nix::libc::statx(dir, name.as_ptr(), flags, mask, buf.as_mut_ptr()) };
    if rc != 0 {
        return Err(nix::errno::Errno::last());
    }
    // SAFETY: statx returned 0, so the kernel filled the buffer.
    Ok(unsafe { buf.assume_init() })
}

/// Whether `path` is the root of a mount, asked of the kernel in O(1) (`statx`'s
/// STATX_ATTR_MOUNT_ROOT, Linux 5.8+), without following a symlink at `path` itself and
/// without revalidating cached attributes (a dead network mount does not hang it).
/// `Ok(None)` when the kernel cannot say; the caller then reads the mount table.
pub fn is_mount_root(path: &Path) -> std::io::Result<Option<bool>> {
    use nix::errno::Errno;
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let stx = match statx(
        nix::libc::AT_FDCWD,
        &c_path,
        UNREVALIDATED,
        nix::libc::STATX_TYPE,
    ) {
        Ok(stx) => stx,
        Err(Errno::ENOENT | Errno::ENOTDIR) => return Ok(Some(false)),
        Err(Errno::ENOSYS | Errno::EINVAL) => return Ok(None),
        Err(errno) => return Err(errno.into()),
    };
    let bit = nix::libc::STATX_ATTR_MOUNT_ROOT as u64;
    Ok((stx.stx_attributes_mask & bit != 0).then_some(stx.stx_attributes & bit != 0))
}

/// The filesystems whose stat of a cached inode is answered from memory, never by a
/// device, daemon or server: disk filesystems (ext2/3/4, XFS, btrfs, F2FS) and memory
/// ones (tmpfs, ramfs). A mount of one of them can neither hang a stat nor answer one as a
/// dead mount does. Cluster filesystems on shared disks (GFS2, OCFS2) take locks over the
/// network to stat, and are not here.
pub fn answers_from_memory(magic: u64) -> bool {
    const EXT: u64 = 0xEF53;
    const XFS: u64 = 0x5846_5342;
    const BTRFS: u64 = 0x9123_683E;
    const F2FS: u64 = 0xF2F5_2010;
    const TMPFS: u64 = 0x0102_1994;
    const RAMFS: u64 = 0x8584_58F6;
    matches!(magic, EXT | XFS | BTRFS | F2FS | TMPFS | RAMFS)
}

/// Which mounts answer a stat from memory (`answers_from_memory`), remembered by unique
/// mount id (never reused within a boot): a path costs one `statx`, and a mount met for
/// the first time one `statmount`.
#[derive(Debug, Default)]
pub struct MemoryAnswers {
    by_mount: std::sync::Mutex<HashMap<u64, bool>>,
}

impl MemoryAnswers {
    /// Whether the filesystem `path` is on answers a stat from memory; false when the
    /// kernel cannot say (before Linux 6.8).
    pub fn at(&self, path: &Path) -> bool {
        let Some(mount_id) = unique_mount_id(path) else {
            return false;
        };
        if let Some(known) = self.by_mount.lock().expect("poisoned").get(&mount_id) {
            return *known;
        }
        let Some(magic) = mount_magic(mount_id) else {
            return false;
        };
        let answers = answers_from_memory(magic);
        let mut known = self.by_mount.lock().expect("poisoned");
        if known.len() > 4096 {
            known.clear();
        }
        known.insert(mount_id, answers);
        answers
    }
}

/// The unique id (STATX_MNT_ID_UNIQUE, Linux 6.8+: never reused within a boot) of the
/// mount `path` is on, asked without revalidating anything (a dead mount does not hang
/// it); None when the kernel cannot say.
pub fn unique_mount_id(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let unique = nix::libc::STATX_MNT_ID_UNIQUE;
    let stx = statx(nix::libc::AT_FDCWD, &c_path, UNREVALIDATED, unique).ok()?;
    (stx.stx_mask & unique != 0).then_some(stx.stx_mnt_id)
}

/// The superblock magic of the mount with unique id `mount_id` in this process's
/// namespace (`statmount`, Linux 6.8+): read from the kernel's mount table, no filesystem
/// is asked. None when the kernel cannot say.
pub fn mount_magic(mount_id: u64) -> Option<u64> {
    // The uapi's struct mnt_id_req (its first version) and the head of struct statmount.
    #[repr(C)]
    struct MountIdRequest {
        size: u32,
        spare: u32,
        mnt_id: u64,
        param: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct StatMountHead {
        size: u32,
        spare: u32,
        mask: u64,
        sb_dev_major: u32,
        sb_dev_minor: u32,
        sb_magic: u64,
        sb_flags: u32,
        fs_type: u32,
        mnt_id: u64,
    }
    const SYS_STATMOUNT: nix::libc::c_long = 457;
    const STATMOUNT_SB_BASIC: u64 = 1;
    let request = MountIdRequest {
        size: std::mem::size_of::<MountIdRequest>() as u32,
        spare: 0,
        mnt_id: mount_id,
        param: STATMOUNT_SB_BASIC,
    };
    let mut head = StatMountHead::default();
    // SAFETY: both structs are repr(C) and live for the call; the kernel writes at most
    // the size it is given into `head`.
    let rc = unsafe {
        nix::libc::syscall(
            SYS_STATMOUNT,
            &request as *const MountIdRequest,
            &mut head as *mut StatMountHead,
            std::mem::size_of::<StatMountHead>(),
            0u32,
        )
    };
    let whole = head.size as usize >= std::mem::offset_of!(StatMountHead, sb_flags);
    (rc == 0 && whole && head.mask & STATMOUNT_SB_BASIC != 0).then_some(head.sb_magic)
}

/// The errors by which a mount whose filesystem is gone answers a stat that reaches it:
/// a FUSE daemon that died (ENOTCONN), an NFS server that forgot the export's handles
/// (ESTALE), a failed device or connection (EIO), an unreachable host (EHOSTDOWN). The
/// same set Kubernetes' mount-utils calls a corrupted mount (less EACCES, which a FUSE
/// mount without `allow_other` answers root while it is healthy).
pub fn dead_mount_errno(errno: i32) -> Option<crate::bridge::ports::DeadMount> {
    use crate::bridge::ports::DeadMount;
    let name = match errno {
        nix::libc::ENOTCONN => "ENOTCONN",
        nix::libc::ESTALE => "ESTALE",
        nix::libc::EIO => "EIO",
        nix::libc::EHOSTDOWN => "EHOSTDOWN",
        _ => return None,
    };
    Some(DeadMount { errno, name })
}

/// Whether the filesystem at `path` still answers: one `statx` that its filesystem must
/// answer itself (AT_STATX_FORCE_SYNC: FUSE asks its daemon, NFS its server), without
/// following a symlink at `path`. Blocking: a hung network filesystem blocks it, so the
/// caller bounds it. Errors other than a dead mount's (a missing path) are no verdict:
/// `Answers`, and the mount check says the rest.
pub fn mount_health(path: &Path) -> std::io::Result<crate::bridge::ports::MountHealth> {
    use crate::bridge::ports::MountHealth;
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let flags = nix::libc::AT_STATX_FORCE_SYNC
        | nix::libc::AT_NO_AUTOMOUNT
        | nix::libc::AT_SYMLINK_NOFOLLOW;
    Ok(
        match statx(nix::libc::AT_FDCWD, &c_path, flags, nix::libc::STATX_TYPE) {
            Ok(_) => MountHealth::Answers,
            Err(errno) => {
                dead_mount_errno(errno as i32).map_or(MountHealth::Answers, MountHealth::Dead)
            }
        },
    )
}

/// Whether `path` is a mount point in mountinfo `text`, without building a table (the
/// hot Attach path asks exactly this).
pub fn is_mount_point_in(text: &str, path: &Path) -> bool {
    let wanted = path.as_os_str().as_encoded_bytes();
    text.lines().any(|line| {
        let Some(field) = line.split(' ').nth(4) else {
            return false;
        };
        if field.contains('\\') {
            unescape(field).as_bytes() == wanted
        } else {
            field.as_bytes() == wanted
        }
    })
}

/// `path` with its parent resolved: mountinfo lists resolved paths, while a base dir
/// may be reached through a symlink. The leaf itself is what may be mounted, so it is
/// kept as it is. A parent that cannot be resolved leaves `path` unchanged.
pub fn resolve_parent(path: &Path) -> PathBuf {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(_)) if leads_through_no_symlink(parent) => path.components().collect(),
        (Some(parent), Some(leaf)) => std::fs::canonicalize(parent)
            .map(|p| p.join(leaf))
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// Whether `dir` is its own canonical form: an absolute path of plain components (no `..`;
/// a `.` inside is dropped, as `Path::components` drops it) naming a directory that opens
/// with `RESOLVE_NO_SYMLINKS`, so no symlink lies on the way. One `openat2` and a `close`,
/// where `canonicalize` makes a `readlink` per component; false (resolve it the long way)
/// for anything else, also on a kernel without `openat2`. Asked afresh every time:
/// nothing is remembered about a name.
pub fn leads_through_no_symlink(dir: &Path) -> bool {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    use std::path::Component;
    let plain = dir.is_absolute()
        && dir
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS);
    plain && nix::fcntl::openat2(nix::fcntl::AT_FDCWD, dir, how).is_ok()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo` octal.
fn unescape(field: &str) -> String {
    if !field.contains('\\') {
        return field.to_string();
    }
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value =
                (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Test support: mounts a FUSE filesystem at `at` and closes its daemon's end at once, so
/// the mount stays and every request to it fails with ENOTCONN (a crashed FUSE daemon).
/// `None` when not root or without /dev/fuse (a skip outside CI, a failure in it).
#[cfg(test)]
pub(crate) fn mount_dead_fuse(at: &Path) -> Option<()> {
    use std::os::fd::AsRawFd;
    if !nix::unistd::Uid::effective().is_root() || !Path::new("/dev/fuse").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs this as root with /dev/fuse"
        );
        eprintln!("skipped: needs root and /dev/fuse");
        return None;
    }
    let fuse = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .unwrap();
    let options = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0",
        fuse.as_raw_fd()
    );
    nix::mount::mount(
        Some("cube-csi-bridge-test"),
        at,
        Some("fuse.cube-csi-bridge-test"),
        nix::mount::MsFlags::empty(),
        Some(options.as_str()),
    )
    .unwrap();
    drop(fuse);
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 19, defect 8: the O(1) mount check still calls a dead FUSE mount a mount
    /// root (it answers from the cache, by design), and only the health check, which the
    /// filesystem must answer itself, tells that it is dead.
    #[test]
    fn a_dead_fuse_mount_is_a_mount_root_that_does_not_answer() {
        use crate::bridge::ports::MountHealth;
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("dead");
        std::fs::create_dir(&at).unwrap();
        assert_eq!(mount_health(&at).unwrap(), MountHealth::Answers);
        if mount_dead_fuse(&at).is_none() {
            return;
        }
        let root = is_mount_root(&at);
        let health = mount_health(&at);
        super::super::ops::unmount(&at).unwrap();
        assert_eq!(root.unwrap(), Some(true));
        match health.unwrap() {
            MountHealth::Dead(dead) => {
                assert_eq!(dead.errno, nix::libc::ENOTCONN);
                assert!(dead.to_string().starts_with("ENOTCONN: "), "{dead}");
            }
            other => panic!("a dead FUSE mount answered: {other:?}"),
        }
        assert_eq!(mount_health(&at).unwrap(), MountHealth::Answers);
    }

    const SAMPLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
35 22 0:31 / /data/cube-shared/volume/nfs-v1 rw shared:20 - nfs 10.0.0.5:/exports rw
36 22 0:32 / /data/with\\040space rw - tmpfs tmpfs rw
37 22 0:33 / /data/cube-shared/volume/nfs+prod-x rw shared:21 - nfs 10.0.0.5:/x rw
";

    #[test]
    fn finds_mount_points_and_unescapes() {
        let t = MountTable::parse(SAMPLE);
        assert!(t.is_mount_point(Path::new("/")));
        assert!(t.is_mount_point(Path::new("/data/cube-shared/volume/nfs-v1")));
        assert!(t.is_mount_point(Path::new("/data/with space")));
        assert!(!t.is_mount_point(Path::new("/data/cube-shared/volume")));
        for (path, mounted) in [
            ("/", true),
            ("/data/cube-shared/volume/nfs-v1", true),
            ("/data/with space", true),
            ("/data/cube-shared/volume", false),
            ("/data/cube-shared/volume/nfs-v", false),
            // The kernel leaves `+` (the leaf separator) as it is.
            ("/data/cube-shared/volume/nfs+prod-x", true),
            ("/data/cube-shared/volume/nfs-prod-x", false),
        ] {
            assert_eq!(
                is_mount_point_in(SAMPLE, Path::new(path)),
                mounted,
                "{path}"
            );
        }
        assert_eq!(t.under(Path::new("/data")).count(), 3);
        let (mount, shared) = t.mount_of(Path::new("/data/cube-shared/volume")).unwrap();
        assert_eq!((mount, shared), (Path::new("/"), true));
        let (mount, shared) = t.mount_of(Path::new("/data/with space/x")).unwrap();
        assert_eq!((mount, shared), (Path::new("/data/with space"), false));
    }

    #[test]
    fn resolve_parent_follows_a_symlinked_parent_only() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().canonicalize().unwrap().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, tmp.path().join("link")).unwrap();
        assert_eq!(
            resolve_parent(&tmp.path().join("link/leaf")),
            real.join("leaf")
        );
        let missing = Path::new("/nonexistent-parent/leaf");
        assert_eq!(resolve_parent(missing), missing);
    }

    /// The short way (one openat2) answers only for a name that is already canonical, and
    /// then what canonicalize would; every other name is left to canonicalize.
    #[test]
    fn only_a_name_with_no_symlink_on_the_way_is_its_own_canonical_form() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().canonicalize().unwrap();
        let dir = real.join("dir");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink(&dir, real.join("link")).unwrap();
        std::fs::write(real.join("file"), b"").unwrap();

        assert!(leads_through_no_symlink(&dir));
        assert!(leads_through_no_symlink(Path::new("/")));
        // Anything canonicalize would change, or cannot resolve, is not answered here.
        for name in [
            real.join("link"),
            real.join("link/."),
            real.join("dir/../dir"),
            real.join("missing"),
            real.join("file"),
            PathBuf::from("relative/dir"),
        ] {
            assert!(!leads_through_no_symlink(&name), "{}", name.display());
        }
        // Where it answers, it agrees with canonicalize, `.` and trailing slashes and all.
        for name in [
            dir.clone(),
            real.join("dir/./"),
            PathBuf::from(format!("{}//", dir.display())),
        ] {
            assert!(leads_through_no_symlink(&name), "{}", name.display());
            assert_eq!(
                resolve_parent(&name.join("leaf")),
                std::fs::canonicalize(&name).unwrap().join("leaf")
            );
        }
        assert_eq!(resolve_parent(&real.join("link/leaf")), dir.join("leaf"));
    }

    #[test]
    fn the_kernel_says_which_paths_are_mount_roots() {
        // Kernels older than 5.8 cannot say; then there is nothing to compare.
        if let Some(root) = is_mount_root(Path::new("/")).unwrap() {
            assert!(root);
            let tmp = tempfile::tempdir().unwrap();
            let table = MountTable::read(None).unwrap();
            let dir = tmp.path().canonicalize().unwrap();
            assert_eq!(
                is_mount_root(&dir).unwrap(),
                Some(table.is_mount_point(&dir))
            );
            assert_eq!(is_mount_root(&dir.join("missing")).unwrap(), Some(false));
            let link = dir.join("link");
            std::os::unix::fs::symlink("/", &link).unwrap();
            assert_eq!(
                is_mount_root(&link).unwrap(),
                Some(false),
                "a symlink is no mount"
            );
        }
    }

    /// The kernel's mount table names the filesystem under a path by its superblock
    /// magic, the same magic statfs reports (which checks the struct layout); disk and
    /// memory filesystems answer from memory, network, FUSE and cluster ones do not.
    #[test]
    fn the_mount_table_tells_disk_and_memory_filesystems_from_the_others() {
        for path in ["/", "/proc"] {
            let Some(id) = unique_mount_id(Path::new(path)) else {
                return; // before Linux 6.8
            };
            let statfs = nix::sys::statfs::statfs(path).unwrap();
            assert_eq!(
                mount_magic(id),
                Some(statfs.filesystem_type().0 as u64),
                "{path}"
            );
        }
        assert!(!answers_from_memory(0x9FA0), "proc");
        for (magic, name) in [
            (0x6969, "nfs"),
            (0x6573_5546, "fuse"),
            (0xFF53_4D42, "cifs"),
        ] {
            assert!(!answers_from_memory(magic), "{name}");
        }
        for (magic, name) in [
            (0xEF53, "ext4"),
            (0x5846_5342, "xfs"),
            (0x0102_1994, "tmpfs"),
        ] {
            assert!(answers_from_memory(magic), "{name}");
        }
        assert_eq!(mount_magic(u64::MAX), None);
    }

    #[test]
    fn reads_this_process_table() {
        let t = MountTable::read(None).unwrap();
        assert!(t.is_mount_point(Path::new("/")));
    }
}
