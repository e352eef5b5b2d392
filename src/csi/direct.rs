//! The connection CSI calls take to a driver's Unix socket: one HTTP/2 connection, each
//! call sent on it from the caller's own task.
//!
//! tonic's `Channel` hands every request to a buffer task, which sends it on and hands the
//! response future back: two wake-ups between tasks (often between threads) per call, on
//! the way of every first Attach's NodeStage and NodePublish (issue 20). Here the caller
//! sends on the connection itself. The connection is dialed on first use and dialed again
//! once it is closed (the driver restarted); a call on a connection that breaks fails as
//! a transport error, which the retry policy treats as uncertain, as it does tonic's.

use std::error::Error as StdError;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tonic::body::Body;

/// The error a CSI channel's calls fail with (tonic turns it into a `Status`).
pub(super) type BoxError = Box<dyn StdError + Send + Sync>;

/// A lazily dialed HTTP/2 connection to a Unix socket, shared by every clone.
#[derive(Clone)]
pub struct UnixConnection {
    path: Arc<PathBuf>,
    /// Users besides root and this process's euid whose processes may serve the socket.
    trusted: Arc<[u32]>,
    /// The open connection's sender; None until the first call, or after it closed.
    sender: Arc<tokio::sync::Mutex<Option<SendRequest<Body>>>>,
}

impl std::fmt::Debug for UnixConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnixConnection")
            .field("path", &self.path)
            .finish()
    }
}

impl UnixConnection {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path: Arc::new(path),
            trusted: Arc::new([]),
            sender: Default::default(),
        }
    }

    /// Also lets processes of `uids` serve the socket (a driver that runs as another user).
    pub fn trusting(mut self, uids: &[u32]) -> Self {
        self.trusted = uids.into();
        self
    }

    /// Refuses a connection whose server is not root, this process's user or a trusted
    /// one, before anything is sent on it: the driver's calls carry its secrets, and a
    /// socket path another user could take over (the driver restarting, its directory
    /// theirs to write) must not hand them over, nor let them answer for the driver.
    fn check_server(&self, stream: &tokio::net::UnixStream) -> Result<(), BoxError> {
        let uid = match stream.peer_cred() {
            Ok(cred) => cred.uid(),
            Err(e) => {
                let message = format!("cannot tell who serves {}: {e}", self.path.display());
                return Err(unavailable(message, e));
            }
        };
        if uid == 0 || uid == nix::unistd::geteuid().as_raw() || self.trusted.contains(&uid) {
            return Ok(());
        }
        Err(Box::new(tonic::Status::failed_precondition(format!(
            "the CSI driver socket {} is served by a process of uid {uid}, not root: nothing \
             is sent to it (the driver's calls carry its secrets); if the driver runs as \
             that user, list it in csi.driver_uids, else find who took the socket's path",
            self.path.display()
        ))))
    }

    /// A sender on the open connection, dialing it first when there is none (or it was
    /// closed). Concurrent first calls wait for one dial.
    async fn sender(&self) -> Result<SendRequest<Body>, BoxError> {
        let mut slot = self.sender.lock().await;
        if let Some(sender) = slot.as_ref()
            && !sender.is_closed()
        {
            return Ok(sender.clone());
        }
        *slot = None;
        let stream = tokio::net::UnixStream::connect(&*self.path)
            .await
            .map_err(|e| unavailable(format!("error trying to connect: {e}"), e))?;
        self.check_server(&stream)?;
        let (sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .map_err(|e| unavailable(format!("HTTP/2 handshake failed: {e}"), e))?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "the connection to the CSI driver ended");
            }
        });
        *slot = Some(sender.clone());
        Ok(sender)
    }
}

/// UNAVAILABLE with its cause as the source: a transport failure (`retry::status_finality`).
fn unavailable(message: String, cause: impl StdError + Send + Sync + 'static) -> BoxError {
    let mut status = tonic::Status::unavailable(message);
    status.set_source(Arc::new(cause));
    Box::new(status)
}

impl tower::Service<http::Request<Body>> for UnixConnection {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the connection's, awaited per call below.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let connection = self.clone();
        Box::pin(async move {
            // HTTP/2 needs a scheme and an authority; "localhost" is what kubelet sends.
            let path = request
                .uri()
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
            *request.uri_mut() = http::Uri::builder()
                .scheme("http")
                .authority("localhost")
                .path_and_query(path)
                .build()?;
            let mut sender = connection.sender().await?;
            sender.ready().await?;
            let response = sender.send_request(request).await?;
            Ok(without_status_details(response.map(Body::new)))
        })
    }
}

/// The header of a gRPC status's details, which the bridge never reads. tonic decodes it
/// while it reads the status, and a value that is not base64 panics there (tonic 0.14's
/// `Status::from_header_map` expects it): any driver could then take down the task that
/// called it (a hook before its undo, the start-up check, the housekeeping passes). It is
/// removed from every answer's headers and trailers before tonic sees them.
const STATUS_DETAILS: &str = "grpc-status-details-bin";

/// A driver's answer, over either transport, without `STATUS_DETAILS` in its headers or
/// its trailers.
pub(super) fn without_status_details(response: http::Response<Body>) -> http::Response<Body> {
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(STATUS_DETAILS);
    http::Response::from_parts(parts, Body::new(WithoutStatusDetails(body)))
}

/// A driver's answer body, its trailers without `STATUS_DETAILS`.
struct WithoutStatusDetails<B>(B);

impl<B> hyper::body::Body for WithoutStatusDetails<B>
where
    B: hyper::body::Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.0).poll_frame(cx).map(|frame| {
            frame.map(|frame| {
                frame.map(|frame| match frame.into_trailers() {
                    Ok(mut trailers) => {
                        trailers.remove(STATUS_DETAILS);
                        hyper::body::Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.0.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::bridge::Deadline;
    use crate::bridge::ports::Finality;
    use crate::csi::fake_identity::serve;
    use crate::csi::redact::Redactions;
    use crate::csi::{CsiClient, Endpoint};
    use crate::proto::csi::v1 as csi;

    async fn probe(client: &CsiClient, within: Duration) -> Result<Option<bool>, String> {
        client
            .probe(
                csi::ProbeRequest::default(),
                &Deadline::after(within),
                &Redactions::NONE,
            )
            .await
            .map(|reply| reply.ready)
            .map_err(|e| format!("{e:?}"))
    }

    /// Calls share one connection, and a driver that restarts (its connection closed, a
    /// new server on the same socket) is dialed again: the next call reaches the new one.
    #[tokio::test]
    async fn a_restarted_driver_is_dialed_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let client = CsiClient::new(&Endpoint::Unix(path.clone()));
        let (stop, first) = serve(&path, Some(false));
        for _ in 0..3 {
            assert_eq!(
                probe(&client, Duration::from_secs(5)).await,
                Ok(Some(false))
            );
        }
        stop.send(()).unwrap();
        first.await.unwrap().unwrap();
        std::fs::remove_file(&path).unwrap();
        let _second = serve(&path, Some(true));
        // The first call after the restart may meet the old connection closing: a
        // transport failure, retried inside the budget.
        assert_eq!(
            probe(&client, Duration::from_secs(10)).await,
            Ok(Some(true))
        );
    }

    /// Needs root (CI runs it as root). A socket served by another user's process (one
    /// that took the driver's path) gets nothing: the call fails at once, final, before
    /// any byte is sent, naming the uid and the setting; listed in `csi.driver_uids`, the
    /// same process is spoken to.
    #[tokio::test]
    async fn a_socket_served_by_another_user_gets_nothing() {
        if !crate::testing::as_root("serve a socket as another user") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let child = crate::csi::fake_identity::listen_as(&path, 65534);
        let probe_with = |client: CsiClient| async move {
            client
                .probe(
                    csi::ProbeRequest::default(),
                    &Deadline::after(Duration::from_millis(1500)),
                    &Redactions::NONE,
                )
                .await
                .unwrap_err()
        };
        let refused = probe_with(CsiClient::new(&Endpoint::Unix(path.clone()))).await;
        let trusted =
            probe_with(CsiClient::new(&Endpoint::Unix(path.clone())).trusting(&[65534])).await;
        drop(child);
        assert_eq!(refused.status, "FailedPrecondition", "{refused:?}");
        assert_eq!(refused.finality, Finality::Final, "{refused:?}");
        assert_eq!(refused.attempts, 1, "{refused:?}");
        assert!(
            refused.message.contains("uid 65534") && refused.message.contains("csi.driver_uids"),
            "{refused:?}"
        );
        // Trusted, it is dialed and spoken to (it never answers: the call runs out).
        assert_ne!(trusted.status, "FailedPrecondition", "{trusted:?}");
    }

    /// No driver on the socket: UNAVAILABLE, uncertain (retried until the budget is
    /// spent), naming the connect error.
    #[tokio::test]
    async fn no_driver_is_unavailable_and_uncertain() {
        let dir = tempfile::tempdir().unwrap();
        let client = CsiClient::new(&Endpoint::Unix(dir.path().join("absent.sock")));
        let error = client
            .probe(
                csi::ProbeRequest::default(),
                &Deadline::after(Duration::from_millis(400)),
                &Redactions::NONE,
            )
            .await
            .unwrap_err();
        assert_eq!(error.status, "Unavailable", "{error:?}");
        assert_eq!(error.finality, Finality::Uncertain);
        assert!(
            error.message.contains("error trying to connect"),
            "{error:?}"
        );
        assert!(error.attempts > 1, "{error:?}");
    }
}
