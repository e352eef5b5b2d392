//! The daemon's listeners: the Unix socket Cube dials (bound here, or inherited from
//! systemd socket activation), the optional loopback TCP port, and who may connect.
//!
//! The socket is created under a umask so it is never wider than 0660, even for an
//! instant; its group can be set so a non-root Cubelet in that group can dial it; an
//! existing path is replaced only if it is a stale socket (never followed if it is a
//! symlink); and it is removed on shutdown only if it is still the one this process made.
//! With `serve.allowed_uids`, every connection's peer uid is checked (SO_PEERCRED on the
//! socket; the kernel's socket table for loopback TCP) and strangers are dropped.

use std::net::SocketAddr;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_stream::Stream;

/// The first file descriptor systemd passes (sd_listen_fds(3)).
const SD_LISTEN_FDS_START: RawFd = 3;

/// Why a listener could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("{path} is in use by a running process (another bridge instance?)")]
    InUse { path: PathBuf },
    #[error("{path} exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

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
    /// path; a `sole` socket also takes the only one passed, wherever it is bound (the
    /// socket unit, not the config, says where then). No descriptor is taken twice.
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
        let chosen = fds
            .clone()
            .find(|fd| !taken.contains(fd) && bound_at(*fd).as_deref() == Some(path))
            .or_else(|| {
                (sole && count == 1 && !taken.contains(&SD_LISTEN_FDS_START))
                    .then_some(SD_LISTEN_FDS_START)
            });
        let Some(fd) = chosen else {
            return Ok(None);
        };
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
                "serving on the socket systemd passed (bound where its socket unit says, not at serve.socket)"
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

    /// Binds `path`: parent created, a stale socket replaced, a live one refused, mode at
    /// most 0660 from the first instant, group `gid` when given.
    pub async fn bind(path: &Path, gid: Option<u32>) -> Result<Self, ListenError> {
        if let Some(dir) = path.parent() {
            crate::mount::ops::ensure_dir(dir, 0o755).map_err(io("socket directory"))?;
        }
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                if UnixStream::connect(path).await.is_ok() {
                    return Err(ListenError::InUse {
                        path: path.to_path_buf(),
                    });
                }
                std::fs::remove_file(path)
                    .map_err(io(format!("removing stale socket {}", path.display())))?;
            }
            Ok(_) => {
                return Err(ListenError::NotASocket {
                    path: path.to_path_buf(),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(format!("checking {}", path.display()))(e)),
        }
        let listener = {
            // bind(2) creates the file with the process umask applied: 0117 leaves 0660.
            // The umask is process-wide, so it is restored at once.
            let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o117));
            let bound = UnixListener::bind(path);
            nix::sys::stat::umask(old);
            bound.map_err(io(format!("binding {}", path.display())))?
        };
        if let Some(gid) = gid {
            nix::unistd::fchownat(
                nix::fcntl::AT_FDCWD,
                path,
                None,
                Some(nix::unistd::Gid::from_raw(gid)),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(|e| io(format!("chgrp {gid} {}", path.display()))(e.into()))?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
            .map_err(io(format!("chmod 0660 {}", path.display())))?;
        let meta = std::fs::symlink_metadata(path).map_err(io(path.display().to_string()))?;
        Ok(Self {
            listener,
            file: SocketFile {
                path: path.to_path_buf(),
                created: Some((meta.dev(), meta.ino())),
            },
        })
    }
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

    fn admit_unix(&self, stream: &UnixStream) -> bool {
        if self.allowed_uids.is_none() {
            return true;
        }
        let uid = stream.peer_cred().ok().map(|c| c.uid());
        let ok = self.allows(uid);
        if !ok {
            tracing::warn!(
                ?uid,
                "refused a connection from a uid not in serve.allowed_uids"
            );
        }
        ok
    }

    fn admit_tcp(&self, stream: &TcpStream) -> bool {
        if self.allowed_uids.is_none() {
            return true;
        }
        let uid = match (stream.peer_addr(), stream.local_addr()) {
            (Ok(peer), Ok(local)) => loopback_peer_uid(peer, local),
            _ => None,
        };
        let ok = self.allows(uid);
        if !ok {
            tracing::warn!(
                ?uid,
                "refused a TCP connection from a uid not in serve.allowed_uids"
            );
        }
        ok
    }
}

/// Accepted connections that pass the peer policy.
pub struct Incoming<L> {
    listener: L,
    policy: PeerPolicy,
}

impl<L> Incoming<L> {
    pub fn new(listener: L, policy: PeerPolicy) -> Self {
        Self { listener, policy }
    }
}

impl Stream for Incoming<UnixListener> {
    type Item = std::io::Result<UnixStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            match self.listener.poll_accept(cx) {
                Poll::Ready(Ok((stream, _))) if self.policy.admit_unix(&stream) => {
                    return Poll::Ready(Some(Ok(stream)));
                }
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Stream for Incoming<TcpListener> {
    type Item = std::io::Result<TcpStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            match self.listener.poll_accept(cx) {
                Poll::Ready(Ok((stream, _))) if self.policy.admit_tcp(&stream) => {
                    return Poll::Ready(Some(Ok(stream)));
                }
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The uid owning the client end of a loopback TCP connection, from the kernel's socket
/// table (`/proc/net/tcp{,6}`): the established entry whose local address is the peer's
/// and whose remote address is ours.
fn loopback_peer_uid(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    if !peer.ip().is_loopback() {
        return None;
    }
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            text.lines().skip(1).find_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let (l, r, state, uid, inode) = (
                    fields.get(1)?,
                    fields.get(2)?,
                    fields.get(3)?,
                    fields.get(7)?,
                    fields.get(9)?,
                );
                // Only a live, established socket: a closed one in TIME_WAIT is listed
                // with uid 0 and inode 0, whoever owned it.
                (proc_addr(l)? == peer && proc_addr(r)? == local && *state == "01" && *inode != "0")
                    .then(|| uid.parse().ok())
                    .flatten()
            })
        })
}

/// Parses `0100007F:1F90` (IPv4) or the 32-hex-digit IPv6 form of /proc/net/tcp{,6}.
fn proc_addr(field: &str) -> Option<SocketAddr> {
    let (addr, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..addr.len() / 8)
        .map(|i| u32::from_str_radix(&addr[i * 8..i * 8 + 8], 16))
        .collect::<Result<_, _>>()
        .ok()?;
    // Each 32-bit word is in host (little-endian) order.
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let ip = match bytes.len() {
        4 => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => {
            let v6 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?);
            v6.to_ipv4_mapped()
                .map(std::net::IpAddr::V4)
                .unwrap_or(std::net::IpAddr::V6(v6))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_addresses_parse() {
        assert_eq!(
            proc_addr("0100007F:1F90").unwrap(),
            "127.0.0.1:8080".parse().unwrap()
        );
        assert_eq!(
            proc_addr("00000000000000000000000001000000:0016").unwrap(),
            "[::1]:22".parse().unwrap()
        );
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
            let got =
                tokio::time::timeout(std::time::Duration::from_millis(300), incoming.next()).await;
            assert_eq!(got.is_ok(), admitted);
            std::fs::remove_file(&path).unwrap();
        }
        // Loopback TCP: the peer's uid comes from the kernel's socket table.
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut incoming = Incoming::new(tcp, PeerPolicy::new(Some(vec![me])));
        let _client = TcpStream::connect(addr).await.unwrap();
        let got = tokio::time::timeout(std::time::Duration::from_secs(2), incoming.next()).await;
        assert!(got.is_ok(), "own uid refused over loopback TCP");
    }
}
