//! A driver that answers only Probe, served on a socket (unit tests).

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
