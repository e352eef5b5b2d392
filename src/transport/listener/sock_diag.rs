//! Asks the kernel who owns one TCP socket, by its exact 4-tuple, over netlink sock_diag
//! (`NETLINK_SOCK_DIAG`, `inet_diag_req_v2` without `NLM_F_DUMP`): one hash lookup in the
//! kernel and one answer, never a walk of the socket table. The kernel answers inside
//! `sendto`, so both calls are non-blocking and the lookup never waits.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::libc;
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto, socket,
};

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `NLMSG_ERROR` (linux/netlink.h).
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLMSG_HDRLEN: usize = 16;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 56;
/// `struct inet_diag_msg`.
const MSG_LEN: usize = 72;
/// `INET_DIAG_NOCOOKIE`: match on the addresses alone.
const NO_COOKIE: u32 = !0;
/// TCP states as the kernel numbers them (include/net/tcp_states.h).
pub const TCP_ESTABLISHED: u8 = 1;
#[cfg(test)]
pub const TCP_TIME_WAIT: u8 = 6;

/// What the kernel reports of one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub state: u8,
    pub uid: u32,
    /// 0 for a socket no file holds any more (TIME_WAIT and the like).
    pub inode: u32,
}

/// Why the kernel gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("sock_diag: {0}")]
    Sys(Errno),
    #[error("sock_diag sent no answer")]
    NoAnswer,
    #[error("sock_diag answered with a malformed message")]
    Malformed,
}

/// A netlink sock_diag socket, kept open for the lookups of one listener.
#[derive(Debug)]
pub struct SockDiag {
    fd: OwnedFd,
    seq: u32,
}

impl SockDiag {
    pub fn open() -> Result<Self, LookupError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            SockProtocol::NetlinkSockDiag,
        )
        .map_err(LookupError::Sys)?;
        Ok(Self { fd, seq: 0 })
    }

    /// The TCP socket bound at `local` and connected to `remote`, if the kernel has one.
    /// Addresses of different families (after unmapping IPv4-mapped IPv6) match nothing.
    pub fn lookup(
        &mut self,
        local: SocketAddr,
        remote: SocketAddr,
    ) -> Result<Option<Entry>, LookupError> {
        let Some(request) = Request::new(local, remote) else {
            return Ok(None);
        };
        self.seq = self.seq.wrapping_add(1);
        let message = request.encode(self.seq);
        let kernel = NetlinkAddr::new(0, 0);
        loop {
            match sendto(
                self.fd.as_raw_fd(),
                &message,
                &kernel,
                MsgFlags::MSG_DONTWAIT,
            ) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(LookupError::Sys(e)),
                Ok(_) => break,
            }
        }
        // One answer per request (no NLM_F_ACK): the entry, or an error. Anything else
        // with another sequence number is left over from an earlier lookup.
        let mut buf = [0u8; 8192];
        loop {
            let n = match recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return Err(LookupError::NoAnswer),
                Err(e) => return Err(LookupError::Sys(e)),
            };
            if let Reply::Ours(entry) = answer_to(&buf[..n.min(buf.len())], self.seq, &request)? {
                return Ok(entry);
            }
        }
    }
}

/// The `id` of a request: the socket's own (local) and its peer's (remote) end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Request {
    family: u8,
    local: SocketAddr,
    remote: SocketAddr,
}

impl Request {
    fn new(local: SocketAddr, remote: SocketAddr) -> Option<Self> {
        let local = SocketAddr::new(local.ip().to_canonical(), local.port());
        let remote = SocketAddr::new(remote.ip().to_canonical(), remote.port());
        let family = match (local.ip(), remote.ip()) {
            (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
            (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
            _ => return None,
        };
        Some(Self {
            family: family as u8,
            local,
            remote,
        })
    }

    /// `struct inet_diag_sockid`: ports and addresses in network order, no interface,
    /// no cookie.
    fn sockid(&self) -> [u8; 48] {
        let mut id = [0u8; 48];
        id[0..2].copy_from_slice(&self.local.port().to_be_bytes());
        id[2..4].copy_from_slice(&self.remote.port().to_be_bytes());
        id[4..20].copy_from_slice(&addr_bytes(self.local.ip()));
        id[20..36].copy_from_slice(&addr_bytes(self.remote.ip()));
        id[40..44].copy_from_slice(&NO_COOKIE.to_ne_bytes());
        id[44..48].copy_from_slice(&NO_COOKIE.to_ne_bytes());
        id
    }

    /// The request an `inet_diag_sockid` of `family` answers (addresses canonical).
    fn decode(family: u8, id: &[u8]) -> Option<Self> {
        let port = |at: usize| u16::from_be_bytes([id[at], id[at + 1]]);
        let ip = |at: usize| -> Option<IpAddr> {
            match i32::from(family) {
                libc::AF_INET => Some(IpAddr::from(<[u8; 4]>::try_from(&id[at..at + 4]).ok()?)),
                libc::AF_INET6 => Some(IpAddr::from(<[u8; 16]>::try_from(&id[at..at + 16]).ok()?)),
                _ => None,
            }
        };
        Self::new(
            SocketAddr::new(ip(4)?, port(0)),
            SocketAddr::new(ip(20)?, port(2)),
        )
    }

    /// nlmsghdr + inet_diag_req_v2.
    fn encode(&self, seq: u32) -> [u8; NLMSG_HDRLEN + REQ_LEN] {
        let mut m = [0u8; NLMSG_HDRLEN + REQ_LEN];
        m[0..4].copy_from_slice(&((NLMSG_HDRLEN + REQ_LEN) as u32).to_ne_bytes());
        m[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        m[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        m[8..12].copy_from_slice(&seq.to_ne_bytes());
        let r = &mut m[NLMSG_HDRLEN..];
        r[0] = self.family;
        r[1] = libc::IPPROTO_TCP as u8;
        // idiag_states: every state. An exact lookup ignores it; the state is judged
        // from the answer.
        r[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
        r[8..56].copy_from_slice(&self.sockid());
        m
    }
}

/// The 16 address bytes of an `idiag_src`/`idiag_dst` (IPv4 in the first 4).
fn addr_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&v4.octets());
            b
        }
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// What one datagram said of a request.
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    /// The answer to it: the socket, or none with that 4-tuple.
    Ours(Option<Entry>),
    /// Only messages of other (earlier) requests.
    Other,
}

/// Reads the messages of one datagram, looking for the answer to `seq`.
fn answer_to(datagram: &[u8], seq: u32, request: &Request) -> Result<Reply, LookupError> {
    let u32_at = |b: &[u8], at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4"));
    let mut rest = datagram;
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32_at(rest, 0) as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(LookupError::Malformed);
        }
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        let body = &rest[NLMSG_HDRLEN..len];
        if u32_at(rest, 8) == seq {
            return match kind {
                NLMSG_ERROR if body.len() >= 4 => {
                    match i32::from_ne_bytes(body[0..4].try_into().expect("4")) {
                        0 => Ok(Reply::Ours(None)),
                        e if -e == libc::ENOENT => Ok(Reply::Ours(None)),
                        e => Err(LookupError::Sys(Errno::from_raw(-e))),
                    }
                }
                SOCK_DIAG_BY_FAMILY if body.len() >= MSG_LEN => {
                    // The kernel looked the socket up by this 4-tuple; an answer about
                    // any other socket is no answer. (A dual-stack IPv6 socket answers an
                    // IPv4 lookup in its IPv4-mapped form.)
                    let found = Request::decode(body[0], &body[4..52]);
                    if found.map(|f| (f.local, f.remote)) != Some((request.local, request.remote)) {
                        return Err(LookupError::Malformed);
                    }
                    Ok(Reply::Ours(Some(Entry {
                        state: body[1],
                        uid: u32_at(body, 64),
                        inode: u32_at(body, 68),
                    })))
                }
                _ => Err(LookupError::Malformed),
            };
        }
        let aligned = (len + 3) & !3;
        rest = &rest[aligned.min(rest.len())..];
    }
    Ok(Reply::Other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_carry_the_exact_four_tuple_in_network_order() {
        let local: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let remote: SocketAddr = "[::ffff:127.0.0.2]:8080".parse().unwrap();
        let request = Request::new(local, remote).unwrap();
        assert_eq!(request.family, libc::AF_INET as u8, "mapped IPv4 is IPv4");
        let m = request.encode(7);
        assert_eq!(m.len(), 72);
        assert_eq!(u32::from_ne_bytes(m[8..12].try_into().unwrap()), 7);
        let id = &m[NLMSG_HDRLEN + 8..];
        assert_eq!(&id[0..4], &[0x9c, 0x40, 0x1f, 0x90]);
        assert_eq!(&id[4..8], &[127, 0, 0, 1]);
        assert_eq!(&id[20..24], &[127, 0, 0, 2]);
        assert!(Request::new(local, "[::1]:1".parse().unwrap()).is_none());
    }

    #[test]
    fn an_answer_about_another_socket_is_refused() {
        let request = Request::new(
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        )
        .unwrap();
        let other = Request::new(
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:3".parse().unwrap(),
        )
        .unwrap();
        let mut answer = vec![0u8; NLMSG_HDRLEN + MSG_LEN];
        answer[0..4].copy_from_slice(&((NLMSG_HDRLEN + MSG_LEN) as u32).to_ne_bytes());
        answer[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        answer[8..12].copy_from_slice(&9u32.to_ne_bytes());
        answer[NLMSG_HDRLEN] = libc::AF_INET as u8;
        answer[NLMSG_HDRLEN + 1] = TCP_ESTABLISHED;
        answer[NLMSG_HDRLEN + 4..NLMSG_HDRLEN + 52].copy_from_slice(&other.sockid());
        answer[NLMSG_HDRLEN + 64..NLMSG_HDRLEN + 68].copy_from_slice(&1000u32.to_ne_bytes());
        assert_eq!(answer_to(&answer, 9, &request), Err(LookupError::Malformed));
        let Ok(Reply::Ours(Some(entry))) = answer_to(&answer, 9, &other) else {
            panic!("no entry");
        };
        assert_eq!((entry.state, entry.uid), (TCP_ESTABLISHED, 1000));
        // A left-over answer to an earlier request is skipped.
        assert_eq!(answer_to(&answer, 10, &other), Ok(Reply::Other));
        // A dual-stack IPv6 socket answers in its IPv4-mapped form.
        answer[NLMSG_HDRLEN] = libc::AF_INET6 as u8;
        let mapped = |ip: [u8; 4]| std::net::Ipv4Addr::from(ip).to_ipv6_mapped().octets();
        answer[NLMSG_HDRLEN + 8..NLMSG_HDRLEN + 24].copy_from_slice(&mapped([127, 0, 0, 1]));
        answer[NLMSG_HDRLEN + 24..NLMSG_HDRLEN + 40].copy_from_slice(&mapped([127, 0, 0, 1]));
        assert!(matches!(
            answer_to(&answer, 9, &other),
            Ok(Reply::Ours(Some(_)))
        ));
    }
}
