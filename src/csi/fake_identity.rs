//! Unit-test peers: a driver that answers only Probe, and a socket another user serves.

use std::path::Path;

use tokio_stream::wrappers::UnixListenerStream;

use crate::proto::csi::v1 as csi;

/// Answers Probe with `ready`; GetPluginInfo and GetPluginCapabilities are not needed.
pub(crate) struct ProbeOnly(pub Option<bool>);

#[tonic::async_trait]
impl csi::identity_server::Identity for ProbeOnly {
    async fn get_plugin_info(
        &self,
        _: tonic::Request<csi::GetPluginInfoRequest>,
    ) -> Result<tonic::Response<csi::GetPluginInfoResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not needed"))
    }
    async fn get_plugin_capabilities(
        &self,
        _: tonic::Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<tonic::Response<csi::GetPluginCapabilitiesResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not needed"))
    }
    async fn probe(
        &self,
        _: tonic::Request<csi::ProbeRequest>,
    ) -> Result<tonic::Response<csi::ProbeResponse>, tonic::Status> {
        Ok(tonic::Response::new(csi::ProbeResponse { ready: self.0 }))
    }
}

/// Serves `ProbeOnly(ready)` on a new socket at `path` until the returned sender is used
/// (or dropped): then it closes its connections, as a driver that exits does, and the
/// task ends.
pub(crate) fn serve(
    path: &Path,
    ready: Option<bool>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) {
    let listener = tokio::net::UnixListener::bind(path).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(csi::identity_server::IdentityServer::new(ProbeOnly(ready)))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    (stop, server)
}

/// A process of `uid` listening at `path` that never answers: a socket another user
/// serves (needs root). It is killed when the guard drops.
pub(crate) fn listen_as(path: &Path, uid: u32) -> ListeningChild {
    use std::os::fd::AsRawFd;
    let socket = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Stream,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    let address = nix::sys::socket::UnixAddr::new(path).unwrap();
    nix::sys::socket::bind(socket.as_raw_fd(), &address).unwrap();
    // The server's credentials are taken when it listens: a child that becomes `uid`
    // first (only async-signal-safe calls after the fork).
    // SAFETY: the child makes raw system calls only, then waits to be killed.
    let child = match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => unsafe {
            nix::libc::setresgid(uid, uid, uid);
            nix::libc::setresuid(uid, uid, uid);
            nix::libc::listen(socket.as_raw_fd(), 16);
            loop {
                nix::libc::pause();
            }
        },
        nix::unistd::ForkResult::Parent { child } => child,
    };
    drop(socket);
    // Listening once a connect is accepted (before, it is refused).
    for _ in 0..500 {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    ListeningChild(child)
}

/// Kills and reaps the child of `listen_as` when dropped.
pub(crate) struct ListeningChild(nix::unistd::Pid);

impl Drop for ListeningChild {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(self.0, None);
    }
}
