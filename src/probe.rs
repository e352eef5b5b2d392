//! `cube-csi-bridge probe`: asks a running `serve` daemon over its own socket whether it is
//! alive, or with `--ready` whether it is also ready (its CSI driver answers `Probe`), using
//! the standard gRPC health check. Made for systemd, Kubernetes exec probes and operators:
//! one line on stdout, exit 0 when healthy and 1 otherwise.

use std::path::Path;
use std::time::Duration;

use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::config::Config;
use crate::csi::Endpoint;
use crate::transport::health::READY_SERVICE;

/// The outcome of one probe: whether it passed, and the line to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub healthy: bool,
    pub line: String,
}

/// Runs one health check against the daemon `config` describes.
pub async fn probe(config: &Config, ready: bool, timeout: Duration) -> Verdict {
    let socket = config.socket_path();
    let service = if ready { READY_SERVICE } else { "" };
    let verdict = check(socket, service, timeout).await;
    let who = format!(
        "cube-csi-bridge {:?} on {}",
        config.driver,
        socket.display()
    );
    match verdict {
        Ok(status) if status == ServingStatus::Serving as i32 => Verdict {
            healthy: true,
            line: if ready {
                format!("ready: {who} is serving and its CSI driver answers Probe")
            } else {
                format!("alive: {who} is serving")
            },
        },
        Ok(status) if ready && status == ServingStatus::NotServing as i32 => {
            let down = down_roles(socket, timeout).await;
            Verdict {
                healthy: false,
                line: if down.is_empty() {
                    format!(
                        "not ready: {who} is serving, but its CSI driver ({}) does not answer \
                         Probe (the daemon's log says why)",
                        config.csi.endpoint
                    )
                } else {
                    format!(
                        "not ready: {who} is serving, but its {} role is down: its hooks answer \
                         UNAVAILABLE (the daemon's log says why; restart it once that is fixed)",
                        down.join(" and ")
                    )
                },
            }
        }
        Ok(status) => Verdict {
            healthy: false,
            line: format!(
                "not {}: {who} reports {}",
                if ready { "ready" } else { "alive" },
                ServingStatus::try_from(status)
                    .map(|s| s.as_str_name().to_string())
                    .unwrap_or_else(|_| format!("status {status}"))
            ),
        },
        Err(failure) => Verdict {
            healthy: false,
            line: format!("not {}: {failure}", if ready { "ready" } else { "alive" }),
        },
    }
}

/// The Cube roles the daemon reports NOT_SERVING (their side could not open).
async fn down_roles(socket: &Path, timeout: Duration) -> Vec<&'static str> {
    use crate::proto::cube::v1 as pb;
    use pb::volume_controller_service_server::VolumeControllerServiceServer as Controller;
    use pb::volume_plugin_service_server::VolumePluginServiceServer as Node;
    use tonic::server::NamedService;
    let mut down = Vec::new();
    for (role, service) in [
        ("controller", <Controller<()> as NamedService>::NAME),
        ("node", <Node<()> as NamedService>::NAME),
    ] {
        if check(socket, service, timeout).await == Ok(ServingStatus::NotServing as i32) {
            down.push(role);
        }
    }
    down
}

/// One `grpc.health.v1.Health/Check` of `service` on the Unix socket `socket`.
async fn check(socket: &Path, service: &str, timeout: Duration) -> Result<i32, String> {
    if !socket.exists() {
        return Err(format!("no daemon: {} does not exist", socket.display()));
    }
    let channel = crate::csi::client::channel(&Endpoint::Unix(socket.to_path_buf()));
    let request = HealthCheckRequest {
        service: service.to_string(),
    };
    let answer = tokio::time::timeout(timeout, HealthClient::new(channel).check(request)).await;
    match answer {
        Ok(Ok(reply)) => Ok(reply.into_inner().status),
        Err(_) => Err(format!(
            "the daemon on {} did not answer within {}s",
            socket.display(),
            timeout.as_secs()
        )),
        Ok(Err(status)) => Err(match status.code() {
            Code::Unimplemented => format!(
                "the daemon on {} serves no gRPC health service (a bridge older than this \
                 command?)",
                socket.display()
            ),
            Code::NotFound => format!(
                "the daemon on {} does not report {service:?}",
                socket.display()
            ),
            code => format!(
                "no daemon answers on {} ({code:?}: {})",
                socket.display(),
                status.message()
            ),
        }),
    }
}
