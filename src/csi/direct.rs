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

type BoxError = Box<dyn StdError + Send + Sync>;

/// A lazily dialed HTTP/2 connection to a Unix socket, shared by every clone.
#[derive(Clone)]
pub struct UnixConnection {
    path: Arc<PathBuf>,
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
            sender: Default::default(),
        }
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
                .map_or("/", |p| p.as_str())
                .to_string();
            *request.uri_mut() = http::Uri::builder()
                .scheme("http")
                .authority("localhost")
                .path_and_query(path)
                .build()?;
            let mut sender = connection.sender().await?;
            sender.ready().await?;
            let response = sender.send_request(request).await?;
            Ok(response.map(Body::new))
        })
    }
}
