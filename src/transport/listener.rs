//! The daemon's listeners: the Unix socket Cube dials (bound here, or inherited from
//! systemd socket activation), the optional loopback TCP port, and who may connect.
//!
//! The socket is refused where another user could replace it once bound; it is bound in
//! a private directory and made 0660 (and given its group, so a non-root Cubelet in that
//! group can dial it) before it is renamed to its path, so it is never wider even for an
//! instant; an existing path is replaced only if
//! it is a stale socket (never followed if it is a symlink); and it is removed on shutdown
//! only if it is still the one this process made.
//! With `serve.allowed_uids`, every connection's peer uid is checked (SO_PEERCRED on the
//! socket; for loopback TCP, the kernel asked by the connection's exact 4-tuple over
//! netlink sock_diag) and strangers are dropped, logged at most once per 10 s per listener.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_stream::Stream;

mod sock_diag;
use sock_diag::SockDiag;

/// The first file descriptor systemd passes (sd_listen_fds(3)).
const SD_LISTEN_FDS_START: RawFd = 3;

/// Why a listener could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("{path} is in use by a running process (another bridge instance?)")]
    InUse { path: PathBuf },
    #[error("{path} exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    /// Another user could swap the socket after it is bound: rename one of their own over
    /// it (and answer Cube's hooks in the bridge's place), or a symlink the bind's next
    /// steps would follow.
    #[error(
        "{why}, so another user could replace the socket once it is bound and answer \
         Cube's hooks in the bridge's place; put serve.socket in a directory only root can \
         write, reached through no other user's symlink (chown root and chmod go-w it)"
    )]
    Replaceable { why: String },
    /// Another user may add names where the socket is (a sticky /tmp too): whenever the
    /// path is free, they could listen there themselves.
    #[error(
        "{what}: its directory {why}, so another user could listen at this path whenever \
         no bridge does (before the first start, after a stop) and answer Cube's hooks; put \
         the socket in a directory only root can write (the default /run/cube-csi-bridge)"
    )]
    DirOpenToOthers { what: String, why: String },
    /// systemd passed the only socket bound somewhere else than serve.socket.
    #[error(
        "systemd passed one socket, bound at {passed}, but serve.socket is {configured}: \
         `register` and `probe` use serve.socket, so Cube would dial a path nobody serves. \
         Set serve.socket = \"{passed}\" in the config, or name the socket unit's instance \
         after the driver (cube-csi-bridge@<driver>.socket listens at \
         /run/cube-csi-bridge/<driver>.sock)"
    )]
    PassedElsewhere {
        passed: PathBuf,
        configured: PathBuf,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// The longest path a Unix socket address holds (sun_path's 108 bytes, one for the NUL).
const MAX_SOCKET_PATH: usize = 107;

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ListenError {
    let context = context.into();
    move |source| ListenError::Io { context, source }
}

/// The Unix socket the daemon serves.
#[derive(Debug)]
pub struct UnixSocket {
    pub listener: UnixListener,
    pub file: SocketFile,
}

/// The socket's path, and whether this process must remove it on shutdown.
#[derive(Debug)]
pub struct SocketFile {
    pub path: PathBuf,
    /// (device, inode) of the socket this process created; None when inherited.
    created: Option<(u64, u64)>,
}

impl UnixSocket {
    /// Takes the socket systemd passed (`LISTEN_FDS`/`LISTEN_PID`) for `path`, if any, so
    /// calls queue in the kernel while the daemon restarts instead of failing. A daemon
    /// serving several drivers is passed one socket each and takes the one bound at its
    /// path. A `sole` driver passed one socket bound elsewhere is refused: Cube is pointed
    /// at serve.socket (`register`), and would dial a path nobody serves. No descriptor is
    /// taken twice.
    pub fn inherited(path: &Path, sole: bool) -> Result<Option<Self>, ListenError> {
        static TAKEN: std::sync::Mutex<Vec<RawFd>> = std::sync::Mutex::new(Vec::new());
        let ours = std::env::var("LISTEN_PID")
            .ok()
            .and_then(|p| p.parse::<u32>().ok())
            .is_some_and(|pid| pid == std::process::id());
        let count = std::env::var("LISTEN_FDS")
            .ok()
            .and_then(|n| n.parse::<i32>().ok())
            .unwrap_or(0);
        if !ours || count < 1 {
            return Ok(None);
        }
        let mut taken = TAKEN.lock().expect("poisoned");
        let fds = SD_LISTEN_FDS_START..SD_LISTEN_FDS_START + count;
        let bound_at = |fd: RawFd| {
            nix::sys::socket::getsockname::<nix::sys::socket::UnixAddr>(fd)
                .ok()
                .and_then(|addr| addr.path().map(Path::to_path_buf))
        };
        let chosen = fds.clone().find(|fd| {
            !taken.contains(fd) && bound_at(*fd).is_some_and(|bound| same_socket(&bound, path))
        });
        let Some(fd) = chosen else {
            // The only socket passed, bound elsewhere: serving it would leave `register`
            // and `probe` (and so Cube) at serve.socket, where nobody listens.
            if sole
                && count == 1
                && let Some(bound) = bound_at(SD_LISTEN_FDS_START)
            {
                return Err(ListenError::PassedElsewhere {
                    passed: bound,
                    configured: path.to_path_buf(),
                });
            }
            return Ok(None);
        };
        // Held to the rules a socket this process binds is held to: systemd binds where its
        // unit says, with the mode it says, and another user who may write that directory
        // could rename a socket of their own over it and answer Cube's hooks.
        match bound_at(fd) {
            Some(bound) => check_passed_socket(&bound)?,
            // An abstract socket (`ListenStream=@name`) has no file, mode or directory:
            // every process of the network namespace may connect.
            None => {
                return Err(io("the socket systemd passed")(std::io::Error::other(
                    "it is bound to no path (an abstract socket), so any process may \
                     connect; give its unit a ListenStream= path",
                )));
            }
        }
        taken.push(fd);
        // SAFETY: systemd hands this process the descriptor `fd` among its listen fds,
        // nothing else in the process owns it, and `TAKEN` makes sure it is wrapped once.
        let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
        drop(taken);
        // Children (the namespace reader) must not inherit the listener; LISTEN_PID names
        // this process only, so they would not take it anyway.
        nix::fcntl::fcntl(
            &std_listener,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(|e| io("inherited socket")(e.into()))?;
        std_listener
            .set_nonblocking(true)
            .map_err(io("inherited socket"))?;
        let listener = UnixListener::from_std(std_listener).map_err(io("inherited socket"))?;
        match bound_at(fd) {
            Some(bound) if bound != path => tracing::info!(
                socket = %bound.display(),
                config = %path.display(),
                "serving on the socket systemd passed (serve.socket, by another name)"
            ),
            _ => tracing::info!(socket = %path.display(), "serving on the socket systemd passed"),
        }
        Ok(Some(Self {
            listener,
            file: SocketFile {
                path: path.to_path_buf(),
                created: None,
            },
        }))
    }

    /// Binds `path`: refused where another user could replace it (a directory they may
    /// write, their symlink on the way), parent created, a stale socket replaced, a live
    /// one refused, mode 0660 from the first instant, group `gid` when given.
    pub async fn bind(path: &Path, gid: Option<u32>) -> Result<Self, ListenError> {
        // A Unix socket's address holds at most 107 bytes: a longer path could be bound
        // (through the private directory's descriptor) but never dialled.
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(io(format!("serve.socket {}", path.display()))(
                std::io::Error::other(format!(
                    "is {} bytes long; a Unix socket path may have at most {MAX_SOCKET_PATH}, \
                     so Cube could not dial it: choose a shorter one",
                    path.as_os_str().len()
                )),
            ));
        }
        let written = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let euid = nix::unistd::geteuid().as_raw();
        let check = |paths: &[&Path]| match crate::config::untrusted_on_the_way(
            paths.iter().copied(),
            euid,
            false,
        ) {
            Some(replaceable) => Err(ListenError::Replaceable {
                why: replaceable.describe(&format!("serve.socket {}", path.display())),
            }),
            None => Ok(()),
        };
        check(&[&written])?;
        if let Some(dir) = path.parent() {
            crate::mount::ops::ensure_dir(dir, 0o755).map_err(io("socket directory"))?;
        }
        // Again now that every directory exists (the first check passes over one not
        // made yet, which another user may have made since), as written and resolved.
        let resolved = resolved_socket_path(&written);
        check(
            &[written.as_path()]
                .into_iter()
                .chain(resolved.as_deref())
                .collect::<Vec<_>>(),
        )?;
        check_socket_dir(path, euid, &format!("serve.socket {}", path.display()))?;
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                // Stale only when nobody listens (ECONNREFUSED). Any other failure may be
                // a live server's: a full accept queue (a stalled instance) answers
                // EAGAIN, and removing its socket would hand its hooks to this one.
                match UnixStream::connect(path).await {
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        std::fs::remove_file(path)
                            .map_err(io(format!("removing stale socket {}", path.display())))?;
                    }
                    _ => {
                        return Err(ListenError::InUse {
                            path: path.to_path_buf(),
                        });
                    }
                }
            }
            Ok(_) => {
                return Err(ListenError::NotASocket {
                    path: path.to_path_buf(),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(format!("checking {}", path.display()))(e)),
        }
        // Nothing below looks at `path` again: from the rename on, anyone allowed in its
        // directory may move or replace what is there, and the socket this process
        // placed stays the one it listens on and the only one it removes.
        let (listener, created) = bind_privately(path, gid)?;
        Ok(Self {
            listener,
            file: SocketFile {
                path: path.to_path_buf(),
                created: Some(created),
            },
        })
    }
}

/// Whether the socket file at `bound` is the one `path` names: the same path, or the
/// same file through another spelling (systemd writes /var/run/… as /run/…; a directory
/// on the way may be a link).
fn same_socket(bound: &Path, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    bound == path
        || std::fs::metadata(bound)
            .ok()
            .zip(std::fs::metadata(path).ok())
            .is_some_and(|(a, b)| (a.dev(), a.ino()) == (b.dev(), b.ino()))
}

/// Binds a socket and puts it at `path` with mode 0660 (group `gid` when given) from the
/// first instant anyone can reach it: bound in a fresh 0700 directory beside `path`, made
/// 0660 and chgrp'd there (nobody else can reach it, so the chmod by path cannot be
/// steered), then renamed into place unless something is there by then. The umask is
/// never touched: it is the process's, and set for a bind it reached every directory other
/// threads made meanwhile (a daemon opening several drivers made their state dirs 0600).
/// Returns the listener and the socket file's (device, inode), both taken before the
/// file is placed at `path`.
fn bind_privately(
    path: &Path,
    gid: Option<u32>,
) -> Result<(UnixListener, (u64, u64)), ListenError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let binding = || io(format!("binding {}", path.display()));
    remove_abandoned_bind_dirs(dir);
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut last = None;
    let private = (0..8)
        .map(|_| {
            let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            dir.join(format!("{BIND_DIR_PREFIX}{}-{n}", std::process::id()))
        })
        .find(|candidate| {
            let made = std::fs::DirBuilder::new().mode(0o700).create(candidate);
            let ok = made.is_ok();
            last = made.err();
            ok
        })
        .ok_or_else(|| {
            let why = last.map_or_else(|| "no name left".to_string(), |e| e.to_string());
            binding()(std::io::Error::other(format!(
                "could not make a private directory in {} to bind in: {why}",
                dir.display()
            )))
        })?;
    let inner = private.join("s");
    let placed = (|| {
        // Through the directory's descriptor: the socket's path length is then never
        // longer than the one configured.
        let handle = std::fs::File::open(&private)?;
        let at = format!("/proc/self/fd/{}/s", handle.as_raw_fd());
        let listener = std::os::unix::net::UnixListener::bind(&at)?;
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o660))?;
        if let Some(gid) = gid {
            nix::unistd::fchownat(
                nix::fcntl::AT_FDCWD,
                &inner,
                None,
                Some(nix::unistd::Gid::from_raw(gid)),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(|e| std::io::Error::other(format!("chgrp {gid}: {e}")))?;
        }
        let meta = std::fs::symlink_metadata(&inner)?;
        if !meta.file_type().is_socket() || meta.mode() & 0o777 != 0o660 {
            return Err(std::io::Error::other(format!(
                "bound with mode {:o}, not a socket with mode 660 (a default ACL on its \
                 directory?)",
                meta.mode() & 0o7777
            )));
        }
        #[cfg(test)]
        let placed_at = path;
        match nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            &inner,
            nix::fcntl::AT_FDCWD,
            path,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        ) {
            Ok(()) => {}
            // A filesystem without RENAME_NOREPLACE (NFS, some FUSE): a hard link never
            // replaces either.
            Err(nix::errno::Errno::EINVAL) => std::fs::hard_link(&inner, path)?,
            Err(e) => return Err(e.into()),
        }
        #[cfg(test)]
        tests::AFTER_PLACING.with(|after| after.get().map(|after| after(placed_at)));
        listener.set_nonblocking(true)?;
        Ok::<_, std::io::Error>((listener, (meta.dev(), meta.ino())))
    })();
    let _ = std::fs::remove_file(&inner);
    let _ = std::fs::remove_dir(&private);
    match placed {
        Ok((listener, created)) => Ok((
            UnixListener::from_std(listener).map_err(binding())?,
            created,
        )),
        // Another instance bound the path since it was found free.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(ListenError::InUse {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(binding()(e)),
    }
}

/// The name of a bind's private directory, before `<pid>-<n>`.
const BIND_DIR_PREFIX: &str = ".cube-csi-bridge-bind-";

/// How old a private bind directory must be before another process may take it for
/// abandoned: a bind lasts microseconds; a pid seen dead may be another pid namespace's
/// (a daemon in a container sharing the socket directory), alive and binding.
const BIND_DIR_ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the private bind directories in `dir` that a process killed in the middle of
/// its bind left behind (each restart of a crashing daemon would otherwise add one): those
/// older than a minute whose pid no longer runs here. Only names of that form; `dir` is
/// checked first to let nobody else add names, so everything there is ours or root's.
fn remove_abandoned_bind_dirs(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(BIND_DIR_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, n)| n.parse::<u64>().ok().and(pid.parse::<i32>().ok()))
        else {
            continue;
        };
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        let old = meta
            .modified()
            .ok()
            .and_then(|at| at.elapsed().ok())
            .is_some_and(|age| age >= BIND_DIR_ABANDONED_AFTER);
        let dead = pid > 0
            && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
                == Err(nix::errno::Errno::ESRCH);
        if meta.is_dir() && old && dead {
            let _ = std::fs::remove_file(entry.path().join("s"));
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// `path` with its directory resolved (symlinks followed), the socket itself not: where a
/// socket at `path` really is. None when the directory cannot be resolved.
fn resolved_socket_path(path: &Path) -> Option<std::path::PathBuf> {
    path.parent()
        .and_then(|dir| std::fs::canonicalize(dir).ok())
        .zip(path.file_name())
        .map(|(dir, name)| dir.join(name))
}

/// Refuses a socket whose directory lets other users add names, the sticky bit or not
/// (/tmp): whenever the name is free (before the first start, after a stop, between a
/// stale socket's removal and the bind) they could listen there themselves, and Cube
/// would send its hooks to them.
fn check_socket_dir(socket: &Path, euid: u32, what: &str) -> Result<(), ListenError> {
    let Some(dir) = socket.parent() else {
        return Ok(());
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    match crate::config::others_may_add_names(dir, euid) {
        Some(why) => Err(ListenError::DirOpenToOthers {
            what: what.to_string(),
            why,
        }),
        None => Ok(()),
    }
}

/// Refuses a socket systemd passed, bound at `bound`, that another user could replace (a
/// directory above it they may write, their symlink on the way), or that every user may
/// connect to (a socket unit without `SocketMode=0660`).
fn check_passed_socket(bound: &Path) -> Result<(), ListenError> {
    let euid = nix::unistd::geteuid().as_raw();
    let what = format!("the socket systemd passed, {}", bound.display());
    // As written and as resolved (a directory above it may be a link).
    let resolved = resolved_socket_path(bound);
    let paths = [bound].into_iter().chain(resolved.as_deref());
    if let Some(replaceable) = crate::config::untrusted_on_the_way(paths, euid, false) {
        return Err(ListenError::Replaceable {
            why: replaceable.describe(&what),
        });
    }
    check_socket_dir(bound, euid, &what)?;
    let meta = std::fs::symlink_metadata(bound).map_err(io(what.clone()))?;
    if meta.mode() & 0o002 != 0 {
        return Err(io(what)(std::io::Error::other(format!(
            "its mode is {:o}: every user may connect and send any hook; set SocketMode=0660 \
             in its socket unit (a drop-in)",
            meta.mode() & 0o777
        ))));
    }
    Ok(())
}

impl SocketFile {
    /// Removes the socket file if this process created it and it is still that file
    /// (a successor may already have bound the path).
    pub fn remove_if_ours(&self) {
        let Some(created) = self.created else {
            return;
        };
        if let Ok(meta) = std::fs::symlink_metadata(&self.path)
            && (meta.dev(), meta.ino()) == created
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Who may call.
#[derive(Debug, Clone, Default)]
pub struct PeerPolicy {
    allowed_uids: Option<Vec<u32>>,
}

/// Why a connection was refused: its peer's uid, or why it has none.
#[derive(Debug)]
struct Refusal {
    uid: Option<u32>,
    why: Option<Unidentified>,
}

impl PeerPolicy {
    pub fn new(allowed_uids: Option<Vec<u32>>) -> Self {
        Self { allowed_uids }
    }

    fn allows(&self, uid: Option<u32>) -> bool {
        match (&self.allowed_uids, uid) {
            (None, _) => true,
            (Some(allowed), Some(uid)) => allowed.contains(&uid),
            (Some(_), None) => false,
        }
    }

    fn admit_unix(&self, stream: &UnixStream) -> Result<(), Refusal> {
        if self.allowed_uids.is_none() {
            return Ok(());
        }
        let uid = stream.peer_cred().ok().map(|c| c.uid());
        if self.allows(uid) {
            Ok(())
        } else {
            Err(Refusal { uid, why: None })
        }
    }

    fn admit_tcp(&self, stream: &TcpStream, diag: &mut Option<SockDiag>) -> Result<(), Refusal> {
        if self.allowed_uids.is_none() {
            return Ok(());
        }
        let looked_up = match (stream.peer_addr(), stream.local_addr()) {
            (Ok(peer), Ok(local)) => loopback_peer_uid(diag, peer, local),
            (Err(e), _) | (_, Err(e)) => Err(Unidentified::Lookup(e.to_string())),
        };
        let (uid, why) = match looked_up {
            Ok(uid) => (Some(uid), None),
            Err(why) => (None, Some(why)),
        };
        if self.allows(uid) {
            Ok(())
        } else {
            Err(Refusal { uid, why })
        }
    }
}

/// Accepted connections that pass the peer policy. Refusals are logged at most once per
/// `REFUSAL_LOG_EVERY` per listener, with their count.
pub struct Incoming<L> {
    listener: L,
    policy: PeerPolicy,
    refusals: RefusalLog,
    /// Opened at the first TCP lookup; dropped after a failure, so the next one reopens it.
    diag: Option<SockDiag>,
}

impl<L> Incoming<L> {
    pub fn new(listener: L, policy: PeerPolicy) -> Self {
        Self {
            listener,
            policy,
            refusals: RefusalLog::default(),
            diag: None,
        }
    }
}

/// Connections one poll may refuse before it yields: a flood of strangers must not keep
/// a worker thread to itself.
const REFUSALS_PER_POLL: usize = 64;

impl Stream for Incoming<UnixListener> {
    type Item = std::io::Result<UnixStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        for _ in 0..REFUSALS_PER_POLL {
            match this.listener.poll_accept(cx) {
                Poll::Ready(Ok((stream, _))) => match this.policy.admit_unix(&stream) {
                    Ok(()) => return Poll::Ready(Some(Ok(stream))),
                    Err(refusal) => this.refusals.note(Transport::Unix, &refusal),
                },
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Pending => return Poll::Pending,
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl Stream for Incoming<TcpListener> {
    type Item = std::io::Result<TcpStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        for _ in 0..REFUSALS_PER_POLL {
            match this.listener.poll_accept(cx) {
                Poll::Ready(Ok((stream, _))) => {
                    match this.policy.admit_tcp(&stream, &mut this.diag) {
                        Ok(()) => return Poll::Ready(Some(Ok(stream))),
                        Err(refusal) => this.refusals.note(Transport::Tcp, &refusal),
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Pending => return Poll::Pending,
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// How often a listener logs its refusals at most.
const REFUSAL_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Debug, Clone, Copy)]
enum Transport {
    Unix,
    Tcp,
}

/// Refused connections, logged at most once per `REFUSAL_LOG_EVERY`: the first at once,
/// later ones with the count refused since the last line (a flood of strangers must not
/// become a flood of log lines).
#[derive(Debug, Default)]
struct RefusalLog {
    count: u64,
    since: Option<std::time::Instant>,
}

impl RefusalLog {
    /// Counts one refusal at `now`; the count to log when a line is due.
    fn due(&mut self, now: std::time::Instant) -> Option<u64> {
        self.count += 1;
        if self
            .since
            .is_some_and(|since| now.duration_since(since) < REFUSAL_LOG_EVERY)
        {
            return None;
        }
        self.since = Some(now);
        Some(std::mem::take(&mut self.count))
    }

    fn note(&mut self, transport: Transport, refusal: &Refusal) {
        let Some(count) = self.due(std::time::Instant::now()) else {
            return;
        };
        let Refusal { uid, why } = refusal;
        match (transport, why) {
            (Transport::Unix, _) => tracing::warn!(
                ?uid,
                count,
                "refused a connection from a uid not in serve.allowed_uids"
            ),
            (Transport::Tcp, None) => tracing::warn!(
                ?uid,
                count,
                "refused a TCP connection from a uid not in serve.allowed_uids"
            ),
            (Transport::Tcp, Some(why)) => tracing::warn!(
                ?uid,
                count,
                reason = %why,
                "refused a TCP connection from a uid not in serve.allowed_uids"
            ),
        }
    }
}

/// Why a TCP peer has no uid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Unidentified {
    #[error("not a loopback peer: only loopback peers can be identified")]
    NotLoopback,
    #[error("the peer's socket is gone")]
    Gone,
    #[error("the peer's socket is not established (TCP state {0})")]
    NotEstablished(u8),
    #[error(
        "the kernel found neither end of the connection: it was reset at once, or \
         sock_diag cannot look up TCP sockets on this host (is the tcp_diag module \
         available?)"
    )]
    NotFound,
    #[error("looking the peer up failed: {0}")]
    Lookup(String),
}

/// Whether this host can tell who is at the other end of a loopback TCP connection, as
/// `serve.allowed_uids` on `serve.tcp` needs: a connection of this process to itself must
/// be found and be ours. Without it (no `tcp_diag` in the kernel) every TCP caller would
/// be refused, so the daemon refuses to start instead, saying why.
pub fn check_tcp_peer_lookup() -> Result<(), String> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).map_err(|e| e.to_string())?;
    let client = std::net::TcpStream::connect(listener.local_addr().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let (server_end, peer) = listener.accept().map_err(|e| e.to_string())?;
    let local = server_end.local_addr().map_err(|e| e.to_string())?;
    let uid = loopback_peer_uid(&mut None, peer, local).map_err(|why| why.to_string())?;
    let ours = nix::unistd::geteuid().as_raw();
    drop(client);
    if uid == ours {
        Ok(())
    } else {
        Err(format!(
            "the kernel named uid {uid} for a connection of this process (uid {ours})"
        ))
    }
}

/// The uid owning the client end of a loopback TCP connection: the kernel's established
/// socket whose local address is the peer's and whose remote address is ours, asked by
/// that exact 4-tuple (sock_diag; no table walk, no waiting).
fn loopback_peer_uid(
    diag: &mut Option<SockDiag>,
    peer: SocketAddr,
    local: SocketAddr,
) -> Result<u32, Unidentified> {
    if !peer.ip().to_canonical().is_loopback() {
        return Err(Unidentified::NotLoopback);
    }
    let lookup = |diag: &mut Option<SockDiag>, of: SocketAddr, to: SocketAddr| {
        let socket = match diag {
            Some(socket) => socket,
            None => diag.insert(SockDiag::open().map_err(|e| Unidentified::Lookup(e.to_string()))?),
        };
        socket.lookup(of, to).map_err(|e| {
            *diag = None;
            Unidentified::Lookup(e.to_string())
        })
    };
    match lookup(diag, peer, local)? {
        // Only a live, established socket: a closed one in TIME_WAIT is listed with uid 0
        // and inode 0, whoever owned it.
        Some(entry) if entry.state == sock_diag::TCP_ESTABLISHED && entry.inode != 0 => {
            Ok(entry.uid)
        }
        Some(entry) => Err(Unidentified::NotEstablished(entry.state)),
        // Our own end is there until the connection is reset: when it is not found
        // either, the kernel may be unable to answer such lookups at all, and the log
        // should say so.
        None => match lookup(diag, local, peer)? {
            Some(_) => Err(Unidentified::Gone),
            None => Err(Unidentified::NotFound),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    thread_local! {
        /// Runs on the binding thread just after the socket is placed at its path: what
        /// another process may do at that instant.
        pub(super) static AFTER_PLACING: std::cell::Cell<Option<fn(&Path)>> =
            const { std::cell::Cell::new(None) };
    }

    /// A loopback connection: (client, server end, client address, server address).
    fn loopback_pair(
        ip: &str,
    ) -> Option<(
        std::net::TcpStream,
        std::net::TcpStream,
        SocketAddr,
        SocketAddr,
    )> {
        // No IPv6 here (a container without it): nothing to test.
        let listener = std::net::TcpListener::bind((ip, 0)).ok()?;
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, peer) = listener.accept().unwrap();
        let local = server.local_addr().unwrap();
        Some((client, server, peer, local))
    }

    #[test]
    fn loopback_peers_are_named_by_one_sock_diag_lookup() {
        let me = nix::unistd::getuid().as_raw();
        for ip in ["127.0.0.1", "::1"] {
            let Some((_client, _server, peer, local)) = loopback_pair(ip) else {
                continue;
            };
            let mut diag = None;
            assert_eq!(loopback_peer_uid(&mut diag, peer, local), Ok(me), "{ip}");
            // The socket is kept for the next lookup.
            assert!(diag.is_some());
            assert_eq!(loopback_peer_uid(&mut diag, peer, local), Ok(me), "{ip}");
        }
    }

    #[test]
    fn a_time_wait_entry_never_passes_as_root() {
        use std::io::Read;
        let (client, mut server, peer, local) = loopback_pair("127.0.0.1").unwrap();
        // The client closes first, so its end goes through FIN_WAIT to TIME_WAIT once the
        // server closes too.
        drop(client);
        assert_eq!(server.read(&mut [0u8; 8]).unwrap(), 0);
        drop(server);
        let mut diag = SockDiag::open().unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let entry = loop {
            let entry = diag.lookup(peer, local).unwrap().expect("listed");
            if entry.state == sock_diag::TCP_TIME_WAIT {
                break entry;
            }
            assert!(std::time::Instant::now() < until, "{entry:?}");
            std::thread::yield_now();
        };
        // The kernel lists it as root's, with no inode: it must not pass as root.
        assert_eq!((entry.uid, entry.inode), (0, 0));
        assert_eq!(
            loopback_peer_uid(&mut Some(diag), peer, local),
            Err(Unidentified::NotEstablished(sock_diag::TCP_TIME_WAIT))
        );
        assert!(!PeerPolicy::new(Some(vec![0])).allows(None));
    }

    #[test]
    fn peers_the_kernel_cannot_name_are_unidentified() {
        let mut diag = None;
        let remote: SocketAddr = "192.0.2.7:40000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(
            loopback_peer_uid(&mut diag, remote, local),
            Err(Unidentified::NotLoopback)
        );
        assert!(diag.is_none(), "no lookup for a peer that is not loopback");
        // A 4-tuple no socket has: not found, and our own end not found either.
        let (peer, local) = (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        assert_eq!(SockDiag::open().unwrap().lookup(peer, local), Ok(None));
        assert_eq!(
            loopback_peer_uid(&mut diag, peer, local),
            Err(Unidentified::NotFound)
        );
    }

    #[test]
    fn refusals_are_logged_once_per_period_with_their_count() {
        let mut log = RefusalLog::default();
        let t0 = std::time::Instant::now();
        assert_eq!(log.due(t0), Some(1), "the first at once");
        for i in 1..1000 {
            assert_eq!(log.due(t0 + std::time::Duration::from_millis(i)), None);
        }
        assert_eq!(log.due(t0 + REFUSAL_LOG_EVERY), Some(1000));
        assert_eq!(log.due(t0 + REFUSAL_LOG_EVERY * 3), Some(1));
    }

    #[tokio::test]
    async fn socket_is_created_0660_and_removed_only_if_still_ours() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s/b.sock");
        let socket = UnixSocket::bind(&path, None).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
        // A live socket is refused; a successor that replaced the file keeps it.
        assert!(matches!(
            UnixSocket::bind(&path, None).await,
            Err(ListenError::InUse { .. })
        ));
        std::fs::remove_file(&path).unwrap();
        let successor = UnixSocket::bind(&path, None).await.unwrap();
        socket.file.remove_if_ours();
        assert!(path.exists(), "removed a socket it did not create");
        successor.file.remove_if_ours();
        assert!(!path.exists());
    }

    /// A live server whose accept queue is full (stalled, or flooded) answers a connect
    /// with EAGAIN: its socket is in use, not stale. Before, any failed connect had the
    /// socket removed, and a second instance took the first one's hooks.
    #[tokio::test]
    async fn a_socket_whose_server_has_a_full_queue_is_not_taken_for_stale() {
        use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("busy.sock");
        let server = nix::sys::socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        nix::sys::socket::bind(server.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
        nix::sys::socket::listen(&server, Backlog::new(0).unwrap()).unwrap();
        // Fill its queue: nobody accepts.
        let mut queued = Vec::new();
        loop {
            match UnixStream::connect(&path).await {
                Ok(stream) => queued.push(stream),
                Err(e) => {
                    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
                    break;
                }
            }
            assert!(queued.len() < 64, "the queue never filled");
        }
        assert!(matches!(
            UnixSocket::bind(&path, None).await,
            Err(ListenError::InUse { .. })
        ));
        assert!(path.exists());
        // Once nobody listens, the socket is stale and replaced.
        drop(server);
        UnixSocket::bind(&path, None).await.unwrap();
    }

    /// A socket systemd passed is held to the rules of one this process binds: refused in a
    /// directory another user may write, or when every user may connect. Before, it was
    /// taken wherever its unit bound it, with whatever mode.
    #[test]
    fn a_passed_socket_another_user_could_replace_or_reach_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("s.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let set = |p: &Path, mode| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        set(&dir, 0o755);
        set(&path, 0o660);
        check_passed_socket(&path).unwrap();
        set(&path, 0o666);
        let error = check_passed_socket(&path).unwrap_err().to_string();
        assert!(error.contains("SocketMode=0660"), "{error}");
        set(&path, 0o660);
        set(&dir, 0o777);
        assert!(matches!(
            check_passed_socket(&path),
            Err(ListenError::Replaceable { .. })
        ));
    }

    #[tokio::test]
    async fn a_symlink_or_a_file_is_never_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("precious");
        std::fs::write(&target, "data").unwrap();
        let link = tmp.path().join("link.sock");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(
            UnixSocket::bind(&link, None).await,
            Err(ListenError::NotASocket { .. })
        ));
        assert!(matches!(
            UnixSocket::bind(&target, None).await,
            Err(ListenError::NotASocket { .. })
        ));
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "data");
    }

    /// A socket another user could swap once it is bound is refused before anything is
    /// made: in a directory they may write (no sticky bit), or reached through their symlink.
    #[tokio::test]
    async fn a_socket_another_user_could_replace_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let refused = UnixSocket::bind(&open.join("b.sock"), None).await;
        let Err(ListenError::Replaceable { why }) = &refused else {
            panic!("a socket in a directory others may write was bound: {refused:?}");
        };
        assert!(why.contains("mode 777"), "{why}");
        assert!(!open.join("b.sock").exists());
        let refused = UnixSocket::bind(&open.join("sub/b.sock"), None).await;
        assert!(
            matches!(refused, Err(ListenError::Replaceable { .. })),
            "{refused:?}"
        );
        assert!(
            !open.join("sub").exists(),
            "made a directory before refusing"
        );
        // A root symlink to a root directory inside that one: their directory is found
        // where the path resolves (they could rename the directory the link leads to).
        std::fs::create_dir(open.join("inner")).unwrap();
        let root_link = tmp.path().join("root-link");
        std::os::unix::fs::symlink(open.join("inner"), &root_link).unwrap();
        let refused = UnixSocket::bind(&root_link.join("b.sock"), None).await;
        let Err(ListenError::Replaceable { why }) = &refused else {
            panic!(
                "a socket whose path resolves below a directory others may write was bound: {refused:?}"
            );
        };
        assert!(why.contains(&open.display().to_string()), "{why}");
        // Sticky (as /tmp): nobody else may rename over the bridge's socket, but anyone
        // may listen at its name while it is free, and Cube would talk to them.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let refused = UnixSocket::bind(&open.join("b.sock"), None).await;
        let Err(ListenError::DirOpenToOthers { why, .. }) = &refused else {
            panic!("a socket in a sticky directory others may write was bound: {refused:?}");
        };
        assert!(why.contains("mode 1777"), "{why}");
        assert!(!open.join("b.sock").exists());
        if !crate::testing::as_root("give a link to another user (the symlink part)") {
            return;
        }
        let private = tmp.path().join("private");
        std::fs::create_dir(&private).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&private, &link).unwrap();
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            &link,
            Some(nix::unistd::Uid::from_raw(65534)),
            None,
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .unwrap();
        let refused = UnixSocket::bind(&link.join("b.sock"), None).await;
        let Err(ListenError::Replaceable { why }) = &refused else {
            panic!("a socket behind another user's symlink was bound: {refused:?}");
        };
        assert!(why.contains("uid 65534"), "{why}");
        assert!(!private.join("b.sock").exists());
    }

    /// A path too long for a Unix socket address is refused, as a bind of it was before
    /// the socket was bound through its private directory's descriptor; nothing is left.
    #[tokio::test]
    async fn a_socket_path_too_long_to_dial_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let long = tmp.path().join(format!("{}.sock", "x".repeat(120)));
        let refused = UnixSocket::bind(&long, None).await.unwrap_err().to_string();
        assert!(refused.contains("at most 107"), "{refused}");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    /// The bind leaves no private directory behind.
    #[tokio::test]
    async fn a_bind_leaves_nothing_behind() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("b.sock");
        let socket = UnixSocket::bind(&path, None).await.unwrap();
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["b.sock"]);
        drop(socket);
    }

    /// From the instant the socket is placed, its path may be moved or taken (a client
    /// dials it, a successor binds it): the bind still succeeds, and shutdown removes
    /// neither the moved socket's new name nor the successor's.
    #[tokio::test(flavor = "current_thread")]
    async fn a_socket_moved_the_instant_it_is_placed_still_binds() {
        fn take_the_path(path: &Path) {
            std::fs::rename(path, path.with_extension("moved")).unwrap();
            std::mem::forget(std::os::unix::net::UnixListener::bind(path).unwrap());
        }
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("m.sock");
        AFTER_PLACING.with(|after| after.set(Some(take_the_path)));
        let bound = UnixSocket::bind(&path, None).await;
        AFTER_PLACING.with(|after| after.set(None));
        let socket = bound.expect("bound although the path was taken at once");
        let moved = std::fs::symlink_metadata(path.with_extension("moved")).unwrap();
        assert_eq!(socket.file.created, Some((moved.dev(), moved.ino())));
        socket.file.remove_if_ours();
        assert!(path.exists(), "the successor's socket was removed");
        // And the listener is the moved socket's.
        std::os::unix::net::UnixStream::connect(path.with_extension("moved")).unwrap();
        assert!(socket.listener.accept().await.is_ok());
    }

    /// What a bind killed half-way left (its private directory, a socket in it) goes at
    /// the next bind, once it is a minute old and its pid gone; a young one, a living
    /// pid's, and names of other forms stay.
    #[tokio::test]
    async fn a_bind_removes_what_an_abandoned_bind_left() {
        let tmp = tempfile::tempdir().unwrap();
        let leave = |name: &str, age_secs: u64| {
            let dir = tmp.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            drop(std::os::unix::net::UnixListener::bind(dir.join("s")).unwrap());
            let then = std::time::SystemTime::now() - std::time::Duration::from_secs(age_secs);
            std::fs::File::open(&dir)
                .unwrap()
                .set_modified(then)
                .unwrap();
        };
        // No pid above the kernel's limit (2^22) ever runs.
        let dead = 4_194_305;
        let alive = std::process::id();
        leave(&format!("{BIND_DIR_PREFIX}{dead}-0"), 3600);
        leave(&format!("{BIND_DIR_PREFIX}{dead}-1"), 5);
        leave(&format!("{BIND_DIR_PREFIX}{alive}-77"), 3600);
        leave(&format!("{BIND_DIR_PREFIX}{dead}-x"), 3600);
        leave("someone-elses", 3600);
        let socket = UnixSocket::bind(&tmp.path().join("b.sock"), None)
            .await
            .unwrap();
        let mut names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        let mut kept = vec![
            format!("{BIND_DIR_PREFIX}{alive}-77"),
            format!("{BIND_DIR_PREFIX}{dead}-1"),
            format!("{BIND_DIR_PREFIX}{dead}-x"),
            "b.sock".to_string(),
            "someone-elses".to_string(),
        ];
        kept.sort();
        assert_eq!(names, kept);
        drop(socket);
    }

    #[test]
    fn a_socket_is_the_same_through_another_spelling_of_its_path() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("run");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, tmp.path().join("var-run")).unwrap();
        let socket = real.join("x.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        assert!(same_socket(&socket, &tmp.path().join("var-run/x.sock")));
        assert!(!same_socket(&socket, &real.join("y.sock")));
    }

    /// The socket's umask must not reach other threads: a daemon opening several drivers
    /// binds one driver's socket while another makes its state dirs, which came out with
    /// the bind's umask (0600 for a 0700 dir: no search bit, so EACCES for good without
    /// DAC override).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bind_leaves_other_threads_umask_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let maker = {
            let (dir, stop) = (tmp.path().join("dirs"), stop.clone());
            std::fs::create_dir(&dir).unwrap();
            std::thread::spawn(move || {
                let mut wrong = Vec::new();
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 5000 {
                    let made = dir.join(n.to_string());
                    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
                        .create(&made)
                        .unwrap();
                    let mode = std::fs::metadata(&made).unwrap().permissions().mode() & 0o777;
                    if mode != 0o700 {
                        wrong.push((n, mode));
                    }
                    n += 1;
                }
                (n, wrong)
            })
        };
        for i in 0..2000 {
            let path = tmp.path().join(format!("s{i}.sock"));
            let socket = UnixSocket::bind(&path, None).await.unwrap();
            drop(socket);
            let _ = std::fs::remove_file(&path);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (made, wrong) = maker.join().unwrap();
        assert!(
            wrong.is_empty(),
            "{} of {made} dirs made with the bind's umask: {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
    }

    #[test]
    fn this_host_can_identify_loopback_tcp_peers() {
        // What `serve` checks before it serves TCP with allowed_uids: a failure here is a
        // kernel without sock_diag for TCP, and the daemon would refuse to start.
        check_tcp_peer_lookup().unwrap();
    }

    #[tokio::test]
    async fn peers_outside_the_allow_list_are_dropped() {
        use tokio_stream::StreamExt;
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("p.sock");
        let me = nix::unistd::getuid().as_raw();
        for (allowed, admitted) in [(vec![me], true), (vec![me + 1], false)] {
            let socket = UnixSocket::bind(&path, None).await.unwrap();
            let mut incoming = Incoming::new(socket.listener, PeerPolicy::new(Some(allowed)));
            let _client = UnixStream::connect(&path).await.unwrap();
            // An admitted peer has long to arrive; a refused one is given 300 ms to show up.
            let wait = std::time::Duration::from_millis(if admitted { 10_000 } else { 300 });
            let got = tokio::time::timeout(wait, incoming.next()).await;
            assert_eq!(got.is_ok(), admitted);
            std::fs::remove_file(&path).unwrap();
        }
        // Loopback TCP: the peer's uid comes from the kernel (sock_diag).
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut incoming = Incoming::new(tcp, PeerPolicy::new(Some(vec![me])));
        let _client = TcpStream::connect(addr).await.unwrap();
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), incoming.next()).await;
        assert!(got.is_ok(), "own uid refused over loopback TCP");
    }
}
