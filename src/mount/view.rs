//! Whose mount table decides that a host_path is really mounted (the core's `MountCheck`).
//!
//! Cubelet lives in its own mount namespace, a one-way slave of the host's. A volume the
//! CSI driver mounted is only usable by a sandbox if the mount shows up *there*. setns()
//! into a mount namespace is refused to a multi-threaded process, so the daemon reads the
//! mountinfo of a process that lives in that namespace, and only when none is found
//! forks a short-lived child of itself that enters the namespace and prints its table
//! (killed if it does not answer in time).
//!
//! `auto` is decided at every check (one stat of Cubelet's namespace file): a daemon
//! started before Cubelet follows Cubelet's namespace as soon as it appears or changes.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::MountTable;
use super::mountinfo;
use crate::bridge::Deadline;
use crate::bridge::ports::{MountCheck, MountHealth, Visibility};
use crate::config::{CUBELET_MOUNT_NS, MountViewSetting};

/// The hidden subcommand the namespace reader runs as (see `read_in_namespace`).
pub const MOUNTINFO_SUBCOMMAND: &str = "__mountinfo-in-namespace";

/// Where mount-point checks look.
#[derive(Debug)]
pub struct MountView {
    setting: MountViewSetting,
    /// The binary hook: Cubelet forks it inside its own namespace already.
    forked_by_cube: bool,
    /// Cubelet's namespace file, for `auto`.
    cubelet_file: PathBuf,
    /// A process last seen living in the namespace, to read its mountinfo without forking.
    cached_pid: AtomicU32,
    /// Resolved parents of checked paths (mountinfo lists resolved paths; base dirs may
    /// be symlinks). A miss is re-checked with a fresh resolution.
    resolved: Mutex<HashMap<PathBuf, PathBuf>>,
    /// Which mounts answer a stat from memory.
    from_memory: mountinfo::MemoryAnswers,
    /// Health checks under way on a blocking thread, by path: a later check of the same
    /// path waits for that one's answer instead of starting another. A stat stuck on a
    /// hung filesystem holds its thread until the filesystem answers, and without this
    /// every Attach and inventory pass would strand one more (the pool has 512: all of
    /// them, within hours, and then no hook of any volume could wait for a disk).
    health_in_flight: Arc<Mutex<HashMap<PathBuf, HealthWatch>>>,
    /// Health checks sent to a blocking thread, for tests.
    #[cfg(test)]
    health_trips: std::sync::atomic::AtomicUsize,
}

/// The view one check uses.
enum Resolved<'a> {
    Own,
    Unchecked,
    Namespace(&'a Path),
}

impl MountView {
    /// The view for `setting`. `forked_by_cube` is true for the binary hook.
    pub fn new(setting: &MountViewSetting, forked_by_cube: bool) -> Self {
        Self {
            setting: setting.clone(),
            forked_by_cube,
            cubelet_file: PathBuf::from(CUBELET_MOUNT_NS),
            cached_pid: AtomicU32::new(0),
            resolved: Mutex::new(HashMap::new()),
            from_memory: Default::default(),
            health_in_flight: Default::default(),
            #[cfg(test)]
            health_trips: Default::default(),
        }
    }

    fn resolve(&self) -> Resolved<'_> {
        match &self.setting {
            MountViewSetting::Unchecked => Resolved::Unchecked,
            MountViewSetting::Own => Resolved::Own,
            MountViewSetting::Auto if self.forked_by_cube => Resolved::Own,
            MountViewSetting::Auto => {
                let file = self.cubelet_file.as_path();
                if namespace_inode(file).is_some() {
                    Resolved::Namespace(file)
                } else {
                    Resolved::Own
                }
            }
            MountViewSetting::Namespace(file) => Resolved::Namespace(file),
        }
    }

    /// A short description for messages.
    pub fn describe(&self) -> String {
        match self.resolve() {
            Resolved::Own => "this process's mount namespace".into(),
            Resolved::Unchecked => "no mount namespace (checks disabled)".into(),
            Resolved::Namespace(file) => {
                format!("the mount namespace bound at {}", file.display())
            }
        }
    }

    /// The raw mountinfo text as seen from this view; `None` when checks are disabled.
    /// Blocking, bounded by `timeout` where it has to fork.
    pub fn mountinfo(&self, timeout: Duration) -> std::io::Result<Option<String>> {
        match self.resolve() {
            Resolved::Unchecked => Ok(None),
            Resolved::Own => std::fs::read_to_string("/proc/self/mountinfo").map(Some),
            Resolved::Namespace(file) => self.namespace_mountinfo(file, timeout).map(Some),
        }
    }

    /// The mount table as seen from this view; `None` when checks are disabled.
    pub fn table(&self, timeout: Duration) -> std::io::Result<Option<MountTable>> {
        Ok(self
            .mountinfo(timeout)?
            .map(|text| MountTable::parse(&text)))
    }

    fn namespace_mountinfo(&self, file: &Path, timeout: Duration) -> std::io::Result<String> {
        let inode = namespace_inode(file).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{} is not a mount-namespace file", file.display()),
            )
        })?;
        let cached = self.cached_pid.load(Ordering::Relaxed);
        if cached != 0 && process_namespace_inode(cached) == Some(inode) {
            let text = std::fs::read_to_string(format!("/proc/{cached}/mountinfo"));
            // Re-check after reading: the pid may have been reused meanwhile.
            if process_namespace_inode(cached) == Some(inode)
                && let Ok(text) = text
            {
                return Ok(text);
            }
        }
        if let Some(pid) = find_process_in_namespace(inode) {
            self.cached_pid.store(pid, Ordering::Relaxed);
            if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")) {
                return Ok(text);
            }
        }
        read_in_namespace(file, timeout)
    }

    fn resolved_parent(&self, path: &Path, fresh: bool) -> PathBuf {
        if !fresh && let Some(hit) = self.resolved.lock().expect("poisoned").get(path) {
            return hit.clone();
        }
        let resolved = mountinfo::resolve_parent(path);
        let mut cache = self.resolved.lock().expect("poisoned");
        if cache.len() > 4096 {
            cache.clear();
        }
        cache.insert(path.to_path_buf(), resolved.clone());
        resolved
    }

    /// Whether `path` is a mount point in this view. Blocking (plain reads of /proc in the
    /// common cases; may fork the namespace reader).
    pub fn visibility_blocking(
        &self,
        path: &Path,
        timeout: Duration,
    ) -> std::io::Result<Visibility> {
        let verdict = |mounted| {
            if mounted {
                Visibility::Mounted
            } else {
                Visibility::NotMounted
            }
        };
        // O(1) first: ask the kernel whether the path is a mount root, in this namespace or,
        // through /proc/<pid>/root, in the one a cached process lives in. Parents are
        // resolved here first, so no symlink is followed out of that namespace.
        let asked = match self.resolve() {
            Resolved::Unchecked => return Ok(Visibility::Unchecked),
            Resolved::Own => mountinfo::is_mount_root(&self.resolved_parent(path, false))?,
            Resolved::Namespace(file) => match self.live_cached_pid(file) {
                Some(pid) => {
                    let inside = PathBuf::from(format!("/proc/{pid}/root")).join(
                        self.resolved_parent(path, false)
                            .strip_prefix("/")
                            .unwrap_or(path),
                    );
                    let answer = mountinfo::is_mount_root(&inside)?;
                    // The pid may have been reused while we asked.
                    answer.filter(|_| self.live_cached_pid(file) == Some(pid))
                }
                None => None,
            },
        };
        if let Some(mounted) = asked
            && (mounted || !self.resolved_parent_changed(path))
        {
            return Ok(verdict(mounted));
        }
        // The mount table, when the kernel cannot say or no process is known to live in
        // the namespace yet.
        let Some(text) = self.mountinfo(timeout)? else {
            return Ok(Visibility::Unchecked);
        };
        let check = |fresh| mountinfo::is_mount_point_in(&text, &self.resolved_parent(path, fresh));
        Ok(verdict(check(false) || check(true)))
    }

    /// The cached process, if it still lives in the namespace bound at `file`.
    fn live_cached_pid(&self, file: &Path) -> Option<u32> {
        let pid = self.cached_pid.load(Ordering::Relaxed);
        if pid == 0 {
            return None;
        }
        let namespace = namespace_inode(file)?;
        (process_namespace_inode(pid) == Some(namespace)).then_some(pid)
    }

    /// Whether resolving `path`'s parent afresh gives another path than the cached one (a
    /// base-dir symlink changed): a "not mounted" must then be asked again.
    fn resolved_parent_changed(&self, path: &Path) -> bool {
        let cached = self.resolved_parent(path, false);
        self.resolved_parent(path, true) != cached
    }
}

#[async_trait]
impl MountCheck for MountView {
    async fn visibility(
        &self,
        path: &Path,
        deadline: &Deadline,
    ) -> Result<Visibility, std::io::Error> {
        // This process's table and a cached process's table are plain reads of /proc:
        // answered here, without a hop to a blocking thread (the hot Attach path).
        // Anything that may fork or scan /proc goes to a blocking thread, bounded.
        let fast = match self.resolve() {
            Resolved::Own | Resolved::Unchecked => true,
            Resolved::Namespace(_) => self.cached_pid.load(Ordering::Relaxed) != 0,
        };
        let timeout = deadline.remaining();
        if fast {
            return self.visibility_blocking(path, timeout);
        }
        let view = MountView {
            cubelet_file: self.cubelet_file.clone(),
            ..MountView::new(&self.setting, self.forked_by_cube)
        };
        let owned = path.to_path_buf();
        let answer = tokio::task::spawn_blocking(move || {
            let v = view.visibility_blocking(&owned, timeout);
            (v, view.cached_pid.load(Ordering::Relaxed))
        });
        match tokio::time::timeout_at(deadline.instant().into(), answer).await {
            Ok(Ok((visibility, pid))) => {
                if pid != 0 {
                    self.cached_pid.store(pid, Ordering::Relaxed);
                }
                visibility
            }
            Ok(Err(join)) => Err(std::io::Error::other(join.to_string())),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "reading the mount table of {} took longer than the hook's budget",
                    self.describe()
                ),
            )),
        }
    }

    async fn health(&self, path: &Path, deadline: &Deadline) -> std::io::Result<MountHealth> {
        // Asked in this process's namespace: a mount the driver made here is the same
        // filesystem as the one Cubelet's namespace received, dead or alive. The forked
        // hook asks on its own thread (it starts none before it forks its worker, and a
        // hung filesystem hangs only that hook, which Cube kills at its timeout); the
        // daemon asks on a blocking thread, bounded, so a hung filesystem never holds
        // the threads every other hook needs.
        if self.forked_by_cube {
            return mountinfo::mount_health(path);
        }
        // A disk or memory filesystem answers that stat from its cached inode, as it
        // answers the mount check: the stat can neither hang nor find it dead, and the
        // trip to a blocking thread (two thread wake-ups on the hot path) buys nothing.
        if self.from_memory.at(path) {
            return Ok(MountHealth::Answers);
        }
        self.shared_health_check(path, deadline, mountinfo::mount_health)
            .await
    }

    fn describe(&self) -> String {
        MountView::describe(self)
    }
}

/// The answer of one health check on a blocking thread, shared by every check of its path
/// that came while it ran: None until it answers.
type HealthWatch =
    tokio::sync::watch::Receiver<Option<Result<MountHealth, (std::io::ErrorKind, String)>>>;

impl MountView {
    /// `check` of `path` on a blocking thread, bounded by `deadline`, joining the check of
    /// the same path already under way if there is one (`health_in_flight`).
    async fn shared_health_check(
        &self,
        path: &Path,
        deadline: &Deadline,
        check: fn(&Path) -> std::io::Result<MountHealth>,
    ) -> std::io::Result<MountHealth> {
        let mut answer = {
            let mut in_flight = self
                .health_in_flight
                .lock()
                .expect("health checks poisoned");
            match in_flight.get(path) {
                Some(under_way) => under_way.clone(),
                None => {
                    #[cfg(test)]
                    self.health_trips.fetch_add(1, Ordering::Relaxed);
                    let (tell, answer) = tokio::sync::watch::channel(None);
                    in_flight.insert(path.to_path_buf(), answer.clone());
                    let owned = path.to_path_buf();
                    let under_way = Arc::clone(&self.health_in_flight);
                    tokio::task::spawn_blocking(move || {
                        // Forgotten before it is told (a check that starts after this
                        // answer starts a stat of its own), and also if `check` panics.
                        let forget = Forget(under_way, owned);
                        let health = check(&forget.1).map_err(|e| (e.kind(), e.to_string()));
                        drop(forget);
                        let _ = tell.send(Some(health));
                    });
                    answer
                }
            }
        };
        let waited =
            tokio::time::timeout_at(deadline.instant().into(), answer.wait_for(Option::is_some))
                .await;
        match waited {
            Ok(Ok(told)) => match told.as_ref().expect("waited for an answer") {
                Ok(health) => Ok(*health),
                Err((kind, message)) => Err(std::io::Error::new(*kind, message.clone())),
            },
            Ok(Err(_)) => Err(std::io::Error::other(
                "the health check's thread ended without answering",
            )),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the filesystem at {} did not answer a stat within the hook's budget",
                    path.display()
                ),
            )),
        }
    }
}

/// Takes a path's check under way off `MountView::health_in_flight` when dropped.
struct Forget(Arc<Mutex<HashMap<PathBuf, HealthWatch>>>, PathBuf);

impl Drop for Forget {
    fn drop(&mut self) {
        if let Ok(mut in_flight) = self.0.lock() {
            in_flight.remove(&self.1);
        }
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

/// A process through which the namespace `inode` may be looked at: the first one in it
/// that can speak for it (`speaks_for_its_namespace`).
fn find_process_in_namespace(inode: u64) -> Option<u32> {
    let pids = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok());
    first_speaking_for(inode, pids)
}

fn first_speaking_for(inode: u64, mut pids: impl Iterator<Item = u32>) -> Option<u32> {
    pids.find(|pid| process_namespace_inode(*pid) == Some(inode) && speaks_for_its_namespace(*pid))
}

/// Whether the mount table and root seen through `/proc/<pid>` are its namespace's: the
/// process is root's and its root directory is the namespace's root. Any user's process
/// may share Cubelet's namespace (the host's, often); one that `chroot`s (after
/// `unshare -U`, no privilege needed) sees, and shows through `/proc/<pid>/mountinfo` and
/// `/proc/<pid>/root`, only what lies below its new root, so the bridge would find every
/// volume's mount absent.
fn speaks_for_its_namespace(pid: u32) -> bool {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    // The effective uid from `status`: /proc/<pid> itself is root's for any process that
    // is not dumpable, as one that dropped root is.
    let runs_as_root = std::fs::read_to_string(proc_dir.join("status")).is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|uids| uids.split_whitespace().nth(1))
            == Some("0")
    });
    runs_as_root
        && std::fs::read_link(proc_dir.join("root")).is_ok_and(|root| root == Path::new("/"))
}

/// Forks this executable as `<exe> __mountinfo-in-namespace <file>`; the child enters the
/// namespace while it is still single-threaded and prints its mountinfo. A child that
/// does not answer within `timeout` is killed.
fn read_in_namespace(file: &Path, timeout: Duration) -> std::io::Result<String> {
    use std::io::Read;
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe)
        .arg(MOUNTINFO_SUBCOMMAND)
        .arg(file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        stdout.read_to_string(&mut text).map(|_| text)
    });
    let until = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "reading mountinfo inside {} did not finish in {timeout:?}",
                    file.display()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let text = reader
        .join()
        .map_err(|_| std::io::Error::other("mountinfo reader panicked"))??;
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        return Err(std::io::Error::other(format!(
            "reading mountinfo inside {} failed: {}",
            file.display(),
            err.trim()
        )));
    }
    Ok(text)
}

/// The child side of `read_in_namespace`: must run before any thread is started.
pub fn print_mountinfo_in_namespace(file: &Path) -> std::io::Result<()> {
    let ns = std::fs::File::open(file)?;
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNS).map_err(std::io::Error::from)?;
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    use std::io::Write;
    std::io::stdout().write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process of the namespace that chrooted (an unprivileged user can, after
    /// `unshare -U`), or that another user runs, is not the one the view reads Cubelet's
    /// mounts through; before, the first process found in the namespace was. Needs root
    /// (to chroot and to drop to another uid).
    #[test]
    fn the_namespace_is_read_only_through_a_root_process_at_its_root() {
        if !crate::testing::as_root("chroot and change uid") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let own_ns = process_namespace_inode(std::process::id()).unwrap();
        // Children that only make async-signal-safe calls after the fork (chroot, setuid,
        // pause), so forking this multi-threaded test process is sound.
        let child = |become_other: &dyn Fn() -> nix::Result<()>| {
            // SAFETY: the child calls only chroot/setuid, pause and _exit.
            match unsafe { nix::unistd::fork() }.unwrap() {
                nix::unistd::ForkResult::Child => {
                    let _ = become_other();
                    loop {
                        nix::unistd::pause();
                    }
                }
                nix::unistd::ForkResult::Parent { child } => child,
            }
        };
        let root = tmp.path().to_path_buf();
        let in_chroot = child(&|| nix::unistd::chroot(&root));
        let as_nobody = child(&|| nix::unistd::setuid(nix::unistd::Uid::from_raw(65534)));
        // Let both change before looking.
        std::thread::sleep(Duration::from_millis(200));
        let candidates = [
            in_chroot.as_raw() as u32,
            as_nobody.as_raw() as u32,
            std::process::id(),
        ];
        let seen: Vec<bool> = candidates[..2]
            .iter()
            .map(|pid| process_namespace_inode(*pid) == Some(own_ns))
            .collect();
        let chosen = first_speaking_for(own_ns, candidates.into_iter());
        for pid in [in_chroot, as_nobody] {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(pid, None);
        }
        assert_eq!(seen, [true, true], "the children left the namespace");
        assert_eq!(
            chosen,
            Some(std::process::id()),
            "candidates {candidates:?}"
        );
    }

    /// A stat stuck on a hung filesystem holds its blocking thread until the filesystem
    /// answers. Every later check of that path (each Attach, each inventory pass) joins
    /// the one under way instead of stranding another thread; once it answers, the next
    /// check stats afresh. Before, each check started a stat of its own: 40 threads here,
    /// and tokio's whole pool of 512 within hours of inventory passes.
    #[tokio::test]
    async fn checks_of_a_hung_filesystem_share_one_stuck_thread() {
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        static STUCK: AtomicBool = AtomicBool::new(true);
        static STATS: AtomicUsize = AtomicUsize::new(0);
        fn hung_stat(_: &Path) -> std::io::Result<MountHealth> {
            STATS.fetch_add(1, Ordering::SeqCst);
            while STUCK.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(MountHealth::Answers)
        }
        let view = MountView::new(&MountViewSetting::Own, false);
        let path = Path::new("/hung/fk+v");
        for _ in 0..40 {
            let deadline = Deadline::after(Duration::from_millis(2));
            let error = view
                .shared_health_check(path, &deadline, hung_stat)
                .await
                .unwrap_err();
            assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
        }
        let stranded = STATS.load(Ordering::SeqCst);
        // Let the stuck stats end before anything can fail: the runtime waits for them.
        STUCK.store(false, Ordering::SeqCst);
        assert_eq!(stranded, 1, "a thread stranded per check");
        let deadline = Deadline::after(Duration::from_secs(10));
        while view.health_in_flight.lock().unwrap().contains_key(path) {
            assert!(
                !deadline.remaining().is_zero(),
                "the stuck stat never ended"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(
            view.shared_health_check(path, &deadline, hung_stat)
                .await
                .unwrap(),
            MountHealth::Answers
        );
        assert_eq!(STATS.load(Ordering::SeqCst), 2);

        // A check that panics leaves nothing under way: the next one stats afresh.
        fn panicking_stat(_: &Path) -> std::io::Result<MountHealth> {
            panic!("a stat that panicked")
        }
        let failed = view
            .shared_health_check(path, &deadline, panicking_stat)
            .await;
        assert!(failed.is_err());
        assert_eq!(
            view.shared_health_check(path, &deadline, hung_stat)
                .await
                .unwrap(),
            MountHealth::Answers
        );
        assert_eq!(STATS.load(Ordering::SeqCst), 3);
    }

    /// The daemon asks a disk or memory filesystem's health without a trip to a blocking
    /// thread (its stat is answered from memory); the kernel's mount table says which
    /// filesystem a path is on. Where the kernel cannot say (before Linux 6.8), the trip is
    /// made as before.
    #[tokio::test]
    async fn a_disk_or_memory_filesystem_is_asked_its_health_without_a_blocking_thread() {
        let deadline = Deadline::after(Duration::from_secs(5));
        let view = MountView::new(&MountViewSetting::Own, false);
        let tmp = tempfile::tempdir().unwrap();
        let kernel_says = mountinfo::unique_mount_id(tmp.path())
            .and_then(mountinfo::mount_magic)
            .map(mountinfo::answers_from_memory);
        for _ in 0..2 {
            assert_eq!(
                view.health(tmp.path(), &deadline).await.unwrap(),
                MountHealth::Answers
            );
        }
        let trips = view.health_trips.load(Ordering::Relaxed);
        match kernel_says {
            Some(true) => assert_eq!(trips, 0, "{:?}", view.from_memory),
            _ => assert_eq!(trips, 2),
        }
        // /proc is neither: its health goes to a blocking thread.
        assert_eq!(
            view.health(Path::new("/proc/self"), &deadline)
                .await
                .unwrap(),
            MountHealth::Answers
        );
        assert_eq!(view.health_trips.load(Ordering::Relaxed), trips + 1);
    }

    #[tokio::test]
    async fn own_view_sees_root_and_unchecked_sees_nothing() {
        let deadline = Deadline::after(Duration::from_secs(5));
        let own = MountView::new(&MountViewSetting::Own, false);
        assert_eq!(
            own.visibility(Path::new("/"), &deadline).await.unwrap(),
            Visibility::Mounted
        );
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(
            own.visibility(&tmp.path().join("x"), &deadline)
                .await
                .unwrap(),
            Visibility::NotMounted
        );
        let none = MountView::new(&MountViewSetting::Unchecked, false);
        assert_eq!(
            none.visibility(Path::new("/"), &deadline).await.unwrap(),
            Visibility::Unchecked
        );
    }

    #[tokio::test]
    async fn auto_follows_the_cubelet_file_only_when_it_is_a_namespace() {
        // On a host without Cubelet, auto is this process's view; forked hooks always are.
        let auto = MountView::new(&MountViewSetting::Auto, false);
        if namespace_inode(Path::new(CUBELET_MOUNT_NS)).is_none() {
            assert_eq!(auto.describe(), "this process's mount namespace");
        }
        let forked = MountView::new(&MountViewSetting::Auto, true);
        assert_eq!(forked.describe(), "this process's mount namespace");
    }

    /// Needs root (bind-mounts a namespace file); skipped otherwise, run as root in CI.
    #[tokio::test]
    async fn auto_starts_following_cubelets_namespace_when_its_file_appears() {
        if !crate::testing::as_root("bind-mount a namespace file") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("mnt");
        std::fs::write(&file, "").unwrap();
        let mut view = MountView::new(&MountViewSetting::Auto, false);
        view.cubelet_file = file.clone();
        // Cubelet has not started: the daemon checks its own namespace.
        assert_eq!(view.describe(), "this process's mount namespace");
        // Cubelet starts: its namespace (here a private one) is bound at the file.
        let mut cubelet = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sleep", "30"])
            .spawn()
            .unwrap();
        let ns = format!("/proc/{}/ns/mnt", cubelet.id());
        // unshare execs `sleep` only once its namespace exists (however slow the machine).
        let comm = format!("/proc/{}/comm", cubelet.id());
        let give_up = std::time::Instant::now() + Duration::from_secs(30);
        while !(std::fs::read_to_string(&comm).is_ok_and(|c| c.trim() == "sleep")
            && std::fs::read_link(&ns).ok() != std::fs::read_link("/proc/self/ns/mnt").ok())
        {
            assert!(
                std::time::Instant::now() < give_up,
                "unshare made no namespace"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let bound = std::process::Command::new("mount")
            .args(["--bind", &ns])
            .arg(&file)
            .status()
            .unwrap();
        assert!(bound.success());
        assert!(
            view.describe().contains(&file.display().to_string()),
            "{}",
            view.describe()
        );
        // A mount made here now is judged by Cubelet's namespace, which does not see it.
        let (source, probe) = (tmp.path().join("src"), tmp.path().join("probe"));
        std::fs::create_dir(&source).unwrap();
        std::fs::create_dir(&probe).unwrap();
        crate::mount::ops::bind_mount(&source, &probe, false).unwrap();
        let deadline = Deadline::after(Duration::from_secs(10));
        let seen = view.visibility(&probe, &deadline).await.unwrap();
        crate::mount::ops::unmount(&probe).unwrap();
        let _ = std::process::Command::new("umount").arg(&file).status();
        let _ = cubelet.kill();
        let _ = cubelet.wait();
        assert_eq!(seen, Visibility::NotMounted);
    }

    #[tokio::test]
    async fn a_file_that_is_not_a_namespace_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-ns");
        std::fs::write(&file, "").unwrap();
        let view = MountView::new(&MountViewSetting::Namespace(file), false);
        let deadline = Deadline::after(Duration::from_secs(5));
        assert!(view.visibility(Path::new("/"), &deadline).await.is_err());
    }
}
