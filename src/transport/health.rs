//! The daemon's health, served on its own socket as the standard gRPC health service
//! (`grpc.health.v1.Health`): service `""` is SERVING while the daemon runs (liveness), and
//! [`READY_SERVICE`] is SERVING only while every served role is up and the CSI driver
//! answers `Probe` (readiness). Each Cube service has its own status under its gRPC name:
//! NOT_SERVING for a role whose side could not open (its hooks answer UNAVAILABLE).
//!
//! Readiness is kept up to date by a background task that probes the driver at an
//! interval, each attempt bounded by a timeout. A health check only reads the last verdict:
//! it never calls the driver, and the hooks never wait for the prober.

use std::time::Duration;

use tokio::time::MissedTickBehavior;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use crate::config::{Config, Roles};
use crate::csi::Endpoint;
use crate::csi::client::CsiChannel;
use crate::proto::csi::v1 as csi;
use crate::proto::cube::v1 as pb;
use csi::identity_client::IdentityClient;

/// The health "service name" whose status says whether the daemon's CSI driver answers.
pub const READY_SERVICE: &str = "cube-csi-bridge.ready";

/// How often the driver is probed.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(2);

/// How long one `Probe` may take before the driver counts as not answering (the default
/// probe timeout of Kubernetes' CSI livenessprobe sidecar, for the same call).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The health service of one daemon, and the task that keeps its readiness current.
/// Dropping it stops the task.
pub struct DaemonHealth {
    server: HealthServer<HealthService>,
    prober: tokio::task::JoinHandle<()>,
}

impl DaemonHealth {
    /// Starts probing the driver endpoints the served `roles` call: the node endpoint for
    /// Attach/Detach, the controller endpoint for Create/Destroy. Must run inside a Tokio
    /// runtime. Readiness is NOT_SERVING until the first probe succeeds.
    /// `down` lists the served roles whose side could not open, with why, as it changes
    /// (a role opened later serves).
    pub fn start(
        config: &Config,
        roles: Roles,
        down: tokio::sync::watch::Receiver<crate::transport::live::DownRoles>,
    ) -> Self {
        let reporter = HealthReporter::new();
        let server = HealthServer::new(HealthService::from_health_reporter(reporter.clone()));
        let mut endpoints = Vec::new();
        if roles.node {
            endpoints.push(config.csi.endpoint.clone());
        }
        if roles.controller && !endpoints.contains(config.csi.controller()) {
            endpoints.push(config.csi.controller().clone());
        }
        let trusted = config.csi.driver_uids.clone();
        let prober = tokio::spawn(keep_readiness(reporter, roles, down, endpoints, trusted));
        Self { server, prober }
    }

    /// The gRPC service to add to the daemon's router (cheap to clone, one per listener).
    pub fn service(&self) -> HealthServer<HealthService> {
        self.server.clone()
    }
}

impl Drop for DaemonHealth {
    fn drop(&mut self) {
        self.prober.abort();
    }
}

impl std::fmt::Debug for DaemonHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonHealth").finish_non_exhaustive()
    }
}

/// Marks the served Cube services SERVING, then probes the driver forever, publishing each
/// change of verdict (and logging it once, not at every interval).
async fn keep_readiness(
    reporter: HealthReporter,
    roles: Roles,
    mut down_roles: tokio::sync::watch::Receiver<crate::transport::live::DownRoles>,
    endpoints: Vec<Endpoint>,
    trusted: Vec<u32>,
) {
    let mut down = down_roles.borrow_and_update().clone();
    set_role_statuses(&reporter, roles, &down).await;
    reporter
        .set_service_status(READY_SERVICE, ServingStatus::NotServing)
        .await;
    // The hooks' own channel: a socket another user serves is probed no more than it
    // is called (`csi.driver_uids`), and readiness says why.
    let clients: Vec<(String, IdentityClient<CsiChannel>)> = endpoints
        .iter()
        .map(|e| {
            (
                e.to_string(),
                IdentityClient::new(CsiChannel::to(e, &trusted)),
            )
        })
        .collect();
    let mut ticker = tokio::time::interval(PROBE_INTERVAL);
    // A slow probe delays the next one instead of being followed by a burst.
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut was_ready = None;
    loop {
        ticker.tick().await;
        if down_roles.has_changed().unwrap_or(false) {
            down = down_roles.borrow_and_update().clone();
            set_role_statuses(&reporter, roles, &down).await;
        }
        let verdict = match down.first() {
            Some((role, why)) => Err(format!("the {role} role is down: {why}")),
            None => probe_all(&clients).await,
        };
        let ready = verdict.is_ok();
        if was_ready == Some(ready) {
            continue;
        }
        match &verdict {
            Ok(()) => tracing::info!(
                service = READY_SERVICE,
                "ready: the CSI driver answers Probe"
            ),
            Err(reason) => tracing::warn!(service = READY_SERVICE, %reason, "not ready"),
        }
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        reporter.set_service_status(READY_SERVICE, status).await;
        was_ready = Some(ready);
    }
}

/// Each served Cube service's status under its gRPC name, for callers that check one by
/// name: NOT_SERVING while its role is down.
async fn set_role_statuses(
    reporter: &HealthReporter,
    roles: Roles,
    down: &crate::transport::live::DownRoles,
) {
    use pb::volume_controller_service_server::VolumeControllerServiceServer as Controller;
    use pb::volume_plugin_service_server::VolumePluginServiceServer as Node;
    let is_down = |role| down.iter().any(|(r, _)| *r == role);
    if roles.controller {
        if is_down("controller") {
            reporter.set_not_serving::<Controller<()>>().await;
        } else {
            reporter.set_serving::<Controller<()>>().await;
        }
    }
    if roles.node {
        if is_down("node") {
            reporter.set_not_serving::<Node<()>>().await;
        } else {
            reporter.set_serving::<Node<()>>().await;
        }
    }
}

/// Probes every endpoint once; the first failure explains the verdict.
async fn probe_all(clients: &[(String, IdentityClient<CsiChannel>)]) -> Result<(), String> {
    for (endpoint, client) in clients {
        probe_once(client.clone(), PROBE_TIMEOUT)
            .await
            .map_err(|why| format!("the CSI driver at {endpoint} {why}"))?;
    }
    Ok(())
}

/// One `Probe`, with no retry: the next interval is the retry.
async fn probe_once(
    mut client: IdentityClient<CsiChannel>,
    timeout: Duration,
) -> Result<(), String> {
    // Bounded here rather than by a grpc-timeout header, which tonic's client reports as
    // CANCELLED, indistinguishable from a driver that cancelled.
    match tokio::time::timeout(timeout, client.probe(csi::ProbeRequest {})).await {
        Err(_) => Err(format!(
            "did not answer Probe within {:.1}s",
            timeout.as_secs_f64()
        )),
        Ok(Err(status)) => Err(format!(
            "answered Probe with {:?}: {}",
            status.code(),
            status.message()
        )),
        // An absent `ready` means ready (CSI spec).
        Ok(Ok(reply)) if reply.get_ref().ready == Some(false) => {
            Err("answered Probe with ready=false".into())
        }
        Ok(Ok(_)) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::fake_identity;
    use tokio_stream::wrappers::UnixListenerStream;
    use tonic::transport::Channel;

    async fn verdict_for(ready: Option<bool>) -> Result<(), String> {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("csi.sock");
        let (_stop, server) = fake_identity::serve(&socket, ready);
        let client = IdentityClient::new(CsiChannel::to(&Endpoint::Unix(socket), &[]));
        let verdict = probe_once(client, Duration::from_secs(5)).await;
        server.abort();
        verdict
    }

    #[tokio::test]
    async fn ready_false_is_not_ready_and_absent_ready_is_ready() {
        assert_eq!(verdict_for(None).await, Ok(()));
        assert_eq!(verdict_for(Some(true)).await, Ok(()));
        let err = verdict_for(Some(false)).await.unwrap_err();
        assert!(err.contains("ready=false"), "{err}");
    }

    /// Needs root (CI runs it as root). Readiness probes over the hooks' own channel: a
    /// driver socket another user serves is sent nothing, and the verdict says why.
    #[tokio::test]
    async fn a_driver_socket_another_user_serves_is_not_ready() {
        if !crate::testing::as_root("serve a socket as another user") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("csi.sock");
        let _stranger = fake_identity::listen_as(&socket, 65534);
        let endpoint = Endpoint::Unix(socket);
        let client = IdentityClient::new(CsiChannel::to(&endpoint, &[]));
        let err = probe_once(client, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            err.contains("FailedPrecondition") && err.contains("uid 65534"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_driver_that_never_answers_is_cut_off_by_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("silent.sock");
        // Accepts connections and never speaks.
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let client = IdentityClient::new(CsiChannel::to(&Endpoint::Unix(socket), &[]));
        let err = probe_once(client, Duration::from_millis(300))
            .await
            .unwrap_err();
        hold.abort();
        assert!(err.contains("within 0.3s"), "{err}");
    }

    /// Serves `health` on a temp socket and returns a client for it.
    async fn health_client(
        health: &DaemonHealth,
        dir: &std::path::Path,
    ) -> tonic_health::pb::health_client::HealthClient<Channel> {
        let socket = dir.join("bridge.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health.service())
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
        tonic_health::pb::health_client::HealthClient::new(crate::csi::client::channel(
            &Endpoint::Unix(socket),
        ))
    }

    async fn status(
        client: &mut tonic_health::pb::health_client::HealthClient<Channel>,
        service: &str,
    ) -> Result<i32, tonic::Code> {
        client
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .map(|r| r.into_inner().status)
            .map_err(|s| s.code())
    }

    #[tokio::test]
    async fn publishes_liveness_the_served_cube_services_and_readiness() {
        use tonic_health::pb::health_check_response::ServingStatus as Wire;
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("csi.sock");
        let (stop, driver) = fake_identity::serve(&socket, None);
        let text = format!(
            "driver = \"t\"\n[csi]\nendpoint = \"unix://{}\"\n",
            socket.display()
        );
        let config = Config::parse(&text, std::path::Path::new("t.toml")).unwrap();
        let health = DaemonHealth::start(
            &config,
            Roles::NODE,
            tokio::sync::watch::channel(Vec::new()).1,
        );
        let mut client = health_client(&health, dir.path()).await;

        assert_eq!(status(&mut client, "").await, Ok(Wire::Serving as i32));
        let node = "cubelet.services.volumeplugin.v1.VolumePluginService";
        let controller = "cubelet.services.volumeplugin.v1.VolumeControllerService";
        // The first probe runs at once; wait for its verdict (bounded).
        let mut ready = Err(tonic::Code::Unknown);
        for _ in 0..100 {
            ready = status(&mut client, READY_SERVICE).await;
            if ready == Ok(Wire::Serving as i32) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(ready, Ok(Wire::Serving as i32));
        assert_eq!(status(&mut client, node).await, Ok(Wire::Serving as i32));
        assert_eq!(
            status(&mut client, controller).await,
            Err(tonic::Code::NotFound),
            "a role not served is not reported"
        );

        // The driver goes away: readiness follows within about one interval.
        // (A graceful stop closes its connections too, as a driver that exits does.)
        let _ = stop.send(());
        let _ = driver.await;
        let mut ready = Ok(Wire::Serving as i32);
        for _ in 0..(2 * PROBE_INTERVAL.as_millis() / 50 + 100) {
            ready = status(&mut client, READY_SERVICE).await;
            if ready == Ok(Wire::NotServing as i32) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(ready, Ok(Wire::NotServing as i32));
        assert_eq!(status(&mut client, "").await, Ok(Wire::Serving as i32));
    }
}
