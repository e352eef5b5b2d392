//! A CSI endpoint and the typed, retried calls the bridge makes on it.

use std::future::Future;
use std::time::Instant;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Uri};
use tonic::{Code, Status};

use super::Endpoint;
use super::direct::{BoxError, UnixConnection};
use super::redact::Redactions;
use super::retry::{Backoff, status_finality};
use crate::bridge::Deadline;
use crate::bridge::ports::{DriverError, Finality};
use crate::proto::csi::v1 as csi;
use csi::controller_client::ControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;

/// A lazily dialed gRPC channel to a Unix socket or `host:port` (used for CSI drivers,
/// and by the demo and tests for the bridge's own socket).
pub fn channel(endpoint: &Endpoint) -> Channel {
    match endpoint {
        Endpoint::Unix(path) => {
            let path = path.clone();
            // The URI is not used for dialing; "localhost" is the authority kubelet sends.
            tonic::transport::Endpoint::from_static("http://localhost").connect_with_connector_lazy(
                tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move {
                        let stream = tokio::net::UnixStream::connect(&path).await?;
                        Ok::<_, std::io::Error>(TokioIo::new(stream))
                    }
                }),
            )
        }
        Endpoint::Tcp(hostport) => {
            tonic::transport::Endpoint::from_shared(format!("http://{hostport}"))
                .expect("host:port checked by Endpoint::parse")
                .connect_lazy()
        }
    }
}

/// What a `CsiClient` sends its calls on: a driver's Unix socket directly (`direct.rs`),
/// or a tonic channel to `host:port`.
#[derive(Debug, Clone)]
pub enum CsiChannel {
    Unix(UnixConnection),
    Tcp(Channel),
}

impl CsiChannel {
    fn new(endpoint: &Endpoint) -> Self {
        match endpoint {
            Endpoint::Unix(path) => CsiChannel::Unix(UnixConnection::new(path.clone())),
            Endpoint::Tcp(_) => CsiChannel::Tcp(channel(endpoint)),
        }
    }

    /// The channel a `CsiClient` of `endpoint` sends on, its Unix socket's server also
    /// allowed to be one of `uids` (`csi.driver_uids`): for a caller that makes its own
    /// typed client (the readiness probe), held to the same check of who serves it.
    pub fn to(endpoint: &Endpoint, uids: &[u32]) -> Self {
        Self::new(endpoint).trusting(uids)
    }

    /// The same channel, its Unix socket's server also allowed to be one of `uids`.
    fn trusting(self, uids: &[u32]) -> Self {
        match self {
            CsiChannel::Unix(connection) => CsiChannel::Unix(connection.trusting(uids)),
            tcp => tcp,
        }
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for CsiChannel {
    type Response = http::Response<tonic::body::Body>;
    type Error = BoxError;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        match self {
            CsiChannel::Unix(connection) => connection.poll_ready(cx),
            CsiChannel::Tcp(channel) => channel.poll_ready(cx).map_err(Into::into),
        }
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        match self {
            CsiChannel::Unix(connection) => connection.call(request),
            CsiChannel::Tcp(channel) => {
                let call = channel.call(request);
                Box::pin(async move {
                    call.await
                        .map(super::direct::without_status_details)
                        .map_err(Into::into)
                })
            }
        }
    }
}

/// The longest driver message kept in an error, in bytes.
const DRIVER_TEXT_MAX: usize = 1024;

/// A driver's message as the bridge passes it on (Cube's stored error, root's log): its
/// control characters escaped, so that a newline cannot forge a log line, and cut to
/// `DRIVER_TEXT_MAX` bytes with its length said (a driver may send kilobytes).
pub(crate) fn driver_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(DRIVER_TEXT_MAX + 32));
    for c in text.chars() {
        if out.len() >= DRIVER_TEXT_MAX {
            out.push_str(&format!("… ({} bytes)", text.len()));
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Retries stop when less than this would be left for the next attempt.
const MIN_ATTEMPT_TIME: std::time::Duration = std::time::Duration::from_millis(50);

/// A lazily connected CSI endpoint. The channel dials on first use and re-dials after
/// the driver restarts; nothing is cached across a dead connection.
#[derive(Debug, Clone)]
pub struct CsiClient {
    channel: CsiChannel,
    endpoint: String,
    /// The driver label of this client's call metrics.
    metrics: crate::metrics::DriverLabel,
}

impl CsiClient {
    /// Creates the client without dialing (a driver that is down fails the first call,
    /// not the start of the bridge).
    pub fn new(endpoint: &Endpoint) -> Self {
        let channel = CsiChannel::new(endpoint);
        Self {
            channel,
            endpoint: endpoint.to_string(),
            metrics: crate::metrics::DriverLabel::default(),
        }
    }

    /// Also lets processes of `uids` serve the driver's Unix socket (`csi.driver_uids`);
    /// root's and the bridge's own user's always may.
    pub fn trusting(mut self, uids: &[u32]) -> Self {
        self.channel = self.channel.trusting(uids);
        self
    }

    /// Records this client's calls under `driver` (a daemon serving several drivers).
    pub fn labelled(mut self, driver: crate::metrics::DriverLabel) -> Self {
        self.metrics = driver;
        self
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The core's error for a failed call, with what the request carried in confidence
    /// scrubbed from the driver's message.
    pub fn error(
        &self,
        call: &'static str,
        status: &Status,
        attempts: u32,
        redact: &Redactions,
    ) -> DriverError {
        let code = status.code();
        DriverError {
            call,
            endpoint: self.endpoint.clone(),
            status: code_name(code),
            grpc_code: code as i32,
            finality: status_finality(status),
            // Redacted first: a cut made before could split a secret and keep its start.
            message: driver_text(&redact.apply(status.message())),
            attempts,
            gave_up_after: None,
        }
    }

    /// Sends `req` until it succeeds, fails finally, or the deadline leaves no room.
    async fn call<Req, Resp, Fut>(
        &self,
        name: &'static str,
        deadline: &Deadline,
        req: &Req,
        redact: &Redactions,
        send: impl Fn(CsiChannel, tonic::Request<Req>) -> Fut,
    ) -> Result<Resp, DriverError>
    where
        Req: Clone,
        Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let mut backoff = Backoff::default();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let remaining = deadline.remaining();
            let started = Instant::now();
            let status = if remaining < MIN_ATTEMPT_TIME {
                Status::deadline_exceeded("the hook's budget was used up before this attempt")
            } else {
                let mut request = tonic::Request::new(req.clone());
                request.set_timeout(remaining);
                match tokio::time::timeout(remaining, send(self.channel.clone(), request)).await {
                    Ok(Ok(response)) => {
                        crate::metrics::csi_call(&self.metrics, name, "Ok", started.elapsed());
                        tracing::debug!(
                            call = name,
                            attempts,
                            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
                            "CSI call succeeded"
                        );
                        return Ok(response.into_inner());
                    }
                    Ok(Err(status)) => status,
                    Err(_) => Status::deadline_exceeded(format!(
                        "no answer within the {:.1}s left of the hook's budget",
                        remaining.as_secs_f64()
                    )),
                }
            };
            let mut error = self.error(name, &status, attempts, redact);
            crate::metrics::csi_call(&self.metrics, name, error.status, started.elapsed());
            if error.finality != Finality::Uncertain {
                // An earlier attempt may have done the work (a volume made before its
                // answer was lost): the call's outcome stays uncertain, whatever the last
                // attempt answered (ALREADY_EXISTS, an "operation in progress").
                if attempts > 1 && error.finality == Finality::Final {
                    error.finality = Finality::Uncertain;
                }
                return Err(error);
            }
            let delay = backoff.next_delay();
            // Nobody waits for the answer any more: the hook undoes what it did instead.
            if deadline.caller_left() {
                return Err(error);
            }
            if deadline.remaining() < delay + MIN_ATTEMPT_TIME {
                error.gave_up_after = Some(deadline.elapsed());
                return Err(error);
            }
            crate::metrics::csi_retry(&self.metrics, name, error.status);
            tracing::warn!(
                call = name,
                code = ?status.code(),
                message = %error.message,
                attempt = attempts,
                retry_in_ms = delay.as_millis() as u64,
                "CSI call failed non-finally; retrying"
            );
            tokio::time::sleep(delay).await;
            if deadline.caller_left() {
                return Err(error);
            }
        }
    }
}

/// Generates one typed CSI call over `CsiClient::call`.
macro_rules! csi_calls {
    ($( $(#[$doc:meta])* $fn:ident: $client:ident::$method:ident($req:ident) -> $resp:ident; )*) => {
        impl CsiClient {$(
            $(#[$doc])*
            pub async fn $fn(&self, req: csi::$req, deadline: &Deadline, redact: &Redactions) -> Result<csi::$resp, DriverError> {
                self.call(stringify!($req).trim_end_matches("Request"), deadline, &req, redact, |channel, request| async move {
                    $client::new(channel).$method(request).await
                })
                .await
            }
        )*}
    };
}

csi_calls! {
    probe: IdentityClient::probe(ProbeRequest) -> ProbeResponse;
    get_plugin_info: IdentityClient::get_plugin_info(GetPluginInfoRequest) -> GetPluginInfoResponse;
    get_plugin_capabilities: IdentityClient::get_plugin_capabilities(GetPluginCapabilitiesRequest) -> GetPluginCapabilitiesResponse;
    controller_get_capabilities: ControllerClient::controller_get_capabilities(ControllerGetCapabilitiesRequest) -> ControllerGetCapabilitiesResponse;
    create_volume: ControllerClient::create_volume(CreateVolumeRequest) -> CreateVolumeResponse;
    delete_volume: ControllerClient::delete_volume(DeleteVolumeRequest) -> DeleteVolumeResponse;
    controller_publish_volume: ControllerClient::controller_publish_volume(ControllerPublishVolumeRequest) -> ControllerPublishVolumeResponse;
    controller_unpublish_volume: ControllerClient::controller_unpublish_volume(ControllerUnpublishVolumeRequest) -> ControllerUnpublishVolumeResponse;
    node_get_capabilities: NodeClient::node_get_capabilities(NodeGetCapabilitiesRequest) -> NodeGetCapabilitiesResponse;
    node_get_info: NodeClient::node_get_info(NodeGetInfoRequest) -> NodeGetInfoResponse;
    node_stage_volume: NodeClient::node_stage_volume(NodeStageVolumeRequest) -> NodeStageVolumeResponse;
    node_unstage_volume: NodeClient::node_unstage_volume(NodeUnstageVolumeRequest) -> NodeUnstageVolumeResponse;
    node_publish_volume: NodeClient::node_publish_volume(NodePublishVolumeRequest) -> NodePublishVolumeResponse;
    node_unpublish_volume: NodeClient::node_unpublish_volume(NodeUnpublishVolumeRequest) -> NodeUnpublishVolumeResponse;
    node_get_volume_stats: NodeClient::node_get_volume_stats(NodeGetVolumeStatsRequest) -> NodeGetVolumeStatsResponse;
    create_snapshot: ControllerClient::create_snapshot(CreateSnapshotRequest) -> CreateSnapshotResponse;
    delete_snapshot: ControllerClient::delete_snapshot(DeleteSnapshotRequest) -> DeleteSnapshotResponse;
    list_snapshots: ControllerClient::list_snapshots(ListSnapshotsRequest) -> ListSnapshotsResponse;
    controller_expand_volume: ControllerClient::controller_expand_volume(ControllerExpandVolumeRequest) -> ControllerExpandVolumeResponse;
    node_expand_volume: NodeClient::node_expand_volume(NodeExpandVolumeRequest) -> NodeExpandVolumeResponse;
}

/// The status name as gRPC spells it in Go and Rust alike (`NotFound`, `Internal`, …).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "Ok",
        Code::Cancelled => "Cancelled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A CreateVolume of the driver at `path` that must fail, with room for a retry even
    /// when the first attempt is slow on a loaded machine.
    /// A driver at `path` answering each call with a bare `grpc-status`: the next of
    /// `codes`, the last one once they are used up.
    fn answer_with_statuses(path: &std::path::Path, codes: &'static [&'static str]) {
        let listener = tokio::net::UnixListener::bind(path).unwrap();
        tokio::spawn(async move {
            let mut answered = 0;
            while let Ok((stream, _)) = listener.accept().await {
                let mut conn = h2::server::handshake(stream).await.unwrap();
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let code = codes[answered.min(codes.len() - 1)];
                    answered += 1;
                    let response = http::Response::builder()
                        .status(200)
                        .header("content-type", "application/grpc")
                        .header("grpc-status", code)
                        .body(())
                        .unwrap();
                    let _ = respond.send_response(response, true);
                }
            }
        });
    }

    async fn failed_create(path: &std::path::Path) -> DriverError {
        failed_create_at(&Endpoint::Unix(path.to_path_buf())).await
    }

    async fn failed_create_at(endpoint: &Endpoint) -> DriverError {
        let client = CsiClient::new(endpoint);
        let request = csi::CreateVolumeRequest {
            name: "pvc-1".into(),
            ..Default::default()
        };
        let deadline = Deadline::after(Duration::from_secs(3));
        client
            .create_volume(request, &deadline, &Redactions::NONE)
            .await
            .unwrap_err()
    }

    /// A driver that takes the request and dies before answering: the call may have
    /// been carried out, so the bridge must not take the failure as final.
    #[tokio::test]
    async fn a_connection_dropped_mid_call_is_uncertain() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen_tx = seen_tx.clone();
                tokio::spawn(async move {
                    let mut conn = h2::server::handshake(stream).await.unwrap();
                    if let Some(Ok((request, _respond))) = conn.accept().await {
                        let _ = seen_tx.send(request.uri().path().to_string());
                    }
                    // Dropping the connection closes the socket without a status or GOAWAY.
                });
            }
        });

        let error = failed_create(&path).await;
        assert_eq!(
            seen.recv().await.as_deref(),
            Some("/csi.v1.Controller/CreateVolume"),
            "the driver received the call"
        );
        assert_eq!(error.finality, Finality::Uncertain, "{error:?}");
        assert!(error.attempts > 1, "retried like UNAVAILABLE: {error:?}");
    }

    /// A driver answering a status whose details are not base64 (in the headers of a
    /// trailers-only answer, or in the trailers after a body) gets an error back, not a
    /// panic: tonic panics decoding such details, which took down the calling task (a
    /// hook before its undo, the start-up check, every housekeeping pass).
    #[tokio::test]
    async fn status_details_that_are_not_base64_are_an_error_not_a_panic() {
        /// Answers every call with status 13 and details that are not base64, by turns in
        /// the headers of a trailers-only answer and in the trailers after the headers.
        async fn answer<S>(stream: S, in_trailers: &mut bool)
        where
            S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        {
            let mut conn = h2::server::handshake(stream).await.unwrap();
            while let Some(Ok((_request, mut respond))) = conn.accept().await {
                let builder = http::Response::builder()
                    .status(200)
                    .header("content-type", "application/grpc");
                if *in_trailers {
                    let mut stream = respond
                        .send_response(builder.body(()).unwrap(), false)
                        .unwrap();
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", "13".parse().unwrap());
                    trailers.insert("grpc-status-details-bin", "%%%".parse().unwrap());
                    let _ = stream.send_trailers(trailers);
                } else {
                    let response = builder
                        .header("grpc-status", "13")
                        .header("grpc-status-details-bin", "%%%")
                        .body(())
                        .unwrap();
                    let _ = respond.send_response(response, true);
                }
                *in_trailers = !*in_trailers;
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let unix = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let mut in_trailers = false;
            while let Ok((stream, _)) = unix.accept().await {
                answer(stream, &mut in_trailers).await;
            }
        });
        // A controller endpoint over TCP goes through tonic's own channel: the same.
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = tcp.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let mut in_trailers = false;
            while let Ok((stream, _)) = tcp.accept().await {
                answer(stream, &mut in_trailers).await;
            }
        });
        for endpoint in [Endpoint::Unix(path), Endpoint::Tcp(address)] {
            for _ in 0..2 {
                let endpoint = endpoint.clone();
                let error = tokio::spawn(async move { failed_create_at(&endpoint).await })
                    .await
                    .expect("the call panicked");
                assert_eq!(error.status, "Internal", "{error:?}");
            }
        }
    }

    /// A driver's message reaches an error with its control characters escaped and cut
    /// to a bound, after its secrets are hidden: before, a newline in it forged a line of
    /// root's log, and kilobytes of it went into Cube's stored error.
    #[test]
    fn a_drivers_message_is_escaped_and_bounded() {
        let client = CsiClient::new(&Endpoint::Unix("/unused.sock".into()));
        let message = format!("bad\nINFO hook succeeded\r{}", "x".repeat(12 << 10));
        let error = client.error(
            "CreateVolume",
            &Status::internal(message),
            1,
            &Redactions::NONE,
        );
        assert!(!error.message.contains('\n') && !error.message.contains('\r'));
        assert!(
            error.message.starts_with("bad\\nINFO hook succeeded\\r"),
            "{}",
            error.message
        );
        assert!(error.message.len() < 1100, "{} bytes", error.message.len());
        assert!(error.message.ends_with(" bytes)"), "{}", error.message);
    }

    /// A call retried while the driver answers UNAVAILABLE stops retrying once its hook's
    /// caller has left (the hook then undoes what it did); before, it retried to the end
    /// of the hook's budget (two minutes for an Attach), holding the volume's lock while
    /// Cube's other hooks of the volume waited past their deadlines. Its outcome stays
    /// uncertain, for the undo.
    #[tokio::test]
    async fn a_call_whose_caller_left_is_not_retried() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        answer_with_statuses(&path, &["14"]);
        let client = CsiClient::new(&Endpoint::Unix(path));
        let caller = crate::bridge::Caller::waiting();
        let deadline = Deadline::after(Duration::from_secs(60)).while_awaited(&caller);
        let leave = {
            let caller = caller.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                caller.leave();
            })
        };
        let request = csi::CreateVolumeRequest {
            name: "pvc-1".into(),
            ..Default::default()
        };
        let error = tokio::time::timeout(
            Duration::from_secs(20),
            client.create_volume(request, &deadline, &Redactions::NONE),
        )
        .await
        .expect("still retrying 20 s after its caller left")
        .unwrap_err();
        leave.await.unwrap();
        assert_eq!(error.status, "Unavailable", "{error:?}");
        assert_eq!(error.finality, Finality::Uncertain, "{error:?}");
    }

    /// A retry that fails finally after an attempt that may have done the work (UNAVAILABLE
    /// from a driver restarting after it made the volume, then ALREADY_EXISTS) is still
    /// uncertain: taken as final, Create forgot its intent and the volume leaked.
    #[tokio::test]
    async fn a_final_answer_after_an_uncertain_attempt_is_uncertain() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        answer_with_statuses(&path, &["14", "6"]);
        let error = failed_create(&path).await;
        assert_eq!(
            (error.attempts, error.status),
            (2, "AlreadyExists"),
            "{error:?}"
        );
        assert_eq!(error.finality, Finality::Uncertain, "{error:?}");
    }
}
