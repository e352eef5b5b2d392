//! Prometheus metrics: what hooks, CSI calls, rollbacks, reconciliation and volumes do.
//!
//! Recording is always on (a few atomic operations); the endpoint is served only when
//! `[metrics] listen` is set. Names follow Prometheus conventions: the
//! `cube_csi_bridge_` prefix, base units (seconds, bytes) and `_total` counters. A daemon
//! serving the drivers of a file listing `[[drivers]]` adds a `driver` label to every
//! series; a one-driver daemon's series carry none, as before.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HookLabels {
    hook: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CsiLabels {
    rpc: &'static str,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FindingLabels {
    finding: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VolumeLabels {
    volume_id: String,
}

/// The driver a series belongs to: none in a one-driver process, so its series keep the
/// labels they always had.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct DriverLabel(Option<Arc<str>>);

impl DriverLabel {
    /// The label `config`'s series carry (only a file listing `[[drivers]]` has one).
    pub fn of(config: &crate::config::Config) -> Self {
        Self(
            config
                .metrics
                .driver_label
                .then(|| Arc::from(config.driver.as_str())),
        )
    }
}

impl EncodeLabelSet for DriverLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        match &self.0 {
            Some(driver) => [("driver", driver.as_ref())].as_slice().encode(encoder),
            None => Ok(()),
        }
    }
}

/// A series' own labels and its driver's.
type Labeled<L> = (L, DriverLabel);

/// Every metric of the process.
pub struct Metrics {
    registry: Registry,
    hook_calls: Family<Labeled<HookLabels>, Counter>,
    hook_seconds: Family<Labeled<HookLabels>, Histogram>,
    csi_seconds: Family<Labeled<CsiLabels>, Histogram>,
    csi_retries: Family<Labeled<CsiLabels>, Counter>,
    rollbacks: Family<Labeled<HookLabels>, Counter>,
    reconcile_findings: Family<Labeled<FindingLabels>, Counter>,
    sweep_findings: Family<Labeled<FindingLabels>, Counter>,
    attached_volumes: Family<DriverLabel, Gauge>,
    holders: Family<DriverLabel, Gauge>,
    stale_holders: Family<DriverLabel, Gauge>,
    volume_capacity: Family<Labeled<VolumeLabels>, Gauge>,
    volume_used: Family<Labeled<VolumeLabels>, Gauge>,
    volume_available: Family<Labeled<VolumeLabels>, Gauge>,
    volume_abnormal: Family<Labeled<VolumeLabels>, Gauge>,
    volume_condition_abnormal: Family<Labeled<VolumeLabels>, Gauge>,
}

fn latency_histogram() -> Histogram {
    // 50 µs to about 100 s: a hot Attach to a slow NFS mount.
    Histogram::new(exponential_buckets(0.000_05, 2.5, 16))
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("cube_csi_bridge");
        let hook_calls = Family::<Labeled<HookLabels>, Counter>::default();
        registry.register(
            "hook_calls",
            "Cube hooks answered, by hook and outcome",
            hook_calls.clone(),
        );
        let hook_seconds = Family::<Labeled<HookLabels>, Histogram>::new_with_constructor(
            latency_histogram as fn() -> _,
        );
        registry.register_with_unit(
            "hook_duration",
            "Time to answer a Cube hook",
            Unit::Seconds,
            hook_seconds.clone(),
        );
        let csi_seconds = Family::<Labeled<CsiLabels>, Histogram>::new_with_constructor(
            latency_histogram as fn() -> _,
        );
        registry.register_with_unit(
            "csi_call_duration",
            "Time of one CSI call attempt, by RPC and gRPC code",
            Unit::Seconds,
            csi_seconds.clone(),
        );
        let csi_retries = Family::<Labeled<CsiLabels>, Counter>::default();
        registry.register(
            "csi_retries",
            "CSI calls retried after a non-final error, by RPC and the code that caused it",
            csi_retries.clone(),
        );
        let rollbacks = Family::<Labeled<HookLabels>, Counter>::default();
        registry.register(
            "rollbacks",
            "Partial work undone after a failed or abandoned hook, by hook and outcome",
            rollbacks.clone(),
        );
        let reconcile_findings = Family::<Labeled<FindingLabels>, Counter>::default();
        registry.register(
            "reconcile_findings",
            "Volumes judged by node reconciliation, by finding",
            reconcile_findings.clone(),
        );
        let sweep_findings = Family::<Labeled<FindingLabels>, Counter>::default();
        registry.register(
            "sweep_findings",
            "Abandoned Creates judged by the controller sweep, by finding",
            sweep_findings.clone(),
        );
        let attached_volumes = Family::<DriverLabel, Gauge>::default();
        registry.register(
            "attached_volumes",
            "Volumes attached on this node (node journal records)",
            attached_volumes.clone(),
        );
        let holders = Family::<DriverLabel, Gauge>::default();
        registry.register(
            "volume_holders",
            "Sandboxes holding volumes on this node",
            holders.clone(),
        );
        let stale_holders = Family::<DriverLabel, Gauge>::default();
        registry.register(
            "stale_holders",
            "Sandboxes holding volumes on this node whose containerd namespace has made no \
             hook for longer than node.stale_holder_secs (list names them)",
            stale_holders.clone(),
        );
        let volume_capacity = Family::<Labeled<VolumeLabels>, Gauge>::default();
        registry.register_with_unit(
            "volume_capacity",
            "Capacity of an attached volume (NodeGetVolumeStats)",
            Unit::Bytes,
            volume_capacity.clone(),
        );
        let volume_used = Family::<Labeled<VolumeLabels>, Gauge>::default();
        registry.register_with_unit(
            "volume_used",
            "Used space of an attached volume (NodeGetVolumeStats)",
            Unit::Bytes,
            volume_used.clone(),
        );
        let volume_available = Family::<Labeled<VolumeLabels>, Gauge>::default();
        registry.register_with_unit(
            "volume_available",
            "Available space of an attached volume (NodeGetVolumeStats)",
            Unit::Bytes,
            volume_available.clone(),
        );
        let volume_abnormal = Family::<Labeled<VolumeLabels>, Gauge>::default();
        registry.register(
            "volume_abnormal",
            "1 when the driver reports an attached volume's condition as abnormal",
            volume_abnormal.clone(),
        );
        let volume_condition_abnormal = Family::<Labeled<VolumeLabels>, Gauge>::default();
        registry.register(
            "volume_condition_abnormal",
            "1 when an attached volume's periodic check finds its mount dead (a stat of \
             host_path answers ENOTCONN, ESTALE, EIO or EHOSTDOWN) or its driver reports \
             its VolumeCondition abnormal",
            volume_condition_abnormal.clone(),
        );
        Self {
            registry,
            hook_calls,
            hook_seconds,
            csi_seconds,
            csi_retries,
            rollbacks,
            reconcile_findings,
            sweep_findings,
            attached_volumes,
            holders,
            stale_holders,
            volume_capacity,
            volume_used,
            volume_available,
            volume_abnormal,
            volume_condition_abnormal,
        }
    }
}

/// The process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// One answered hook; `outcome` is `success` or the kind of failure.
pub fn hook(driver: &DriverLabel, hook: &'static str, outcome: &'static str, elapsed: Duration) {
    let labels = (HookLabels { hook, outcome }, driver.clone());
    let m = metrics();
    m.hook_calls.get_or_create(&labels).inc();
    m.hook_seconds
        .get_or_create(&labels)
        .observe(elapsed.as_secs_f64());
}

/// One CSI call attempt; `code` is the gRPC code name (`Ok` on success).
pub fn csi_call(driver: &DriverLabel, rpc: &'static str, code: &'static str, elapsed: Duration) {
    metrics()
        .csi_seconds
        .get_or_create(&(CsiLabels { rpc, code }, driver.clone()))
        .observe(elapsed.as_secs_f64());
}

pub fn csi_retry(driver: &DriverLabel, rpc: &'static str, code: &'static str) {
    metrics()
        .csi_retries
        .get_or_create(&(CsiLabels { rpc, code }, driver.clone()))
        .inc();
}

/// A rollback of `hook`'s partial work; `outcome` is `undone` or `failed`.
pub fn rollback(driver: &DriverLabel, hook: &'static str, outcome: &'static str) {
    metrics()
        .rollbacks
        .get_or_create(&(HookLabels { hook, outcome }, driver.clone()))
        .inc();
}

pub fn reconcile_finding(driver: &DriverLabel, finding: &'static str, count: usize) {
    if count > 0 {
        metrics()
            .reconcile_findings
            .get_or_create(&(FindingLabels { finding }, driver.clone()))
            .inc_by(count as u64);
    }
}

pub fn sweep_finding(driver: &DriverLabel, finding: &'static str, count: usize) {
    if count > 0 {
        metrics()
            .sweep_findings
            .get_or_create(&(FindingLabels { finding }, driver.clone()))
            .inc_by(count as u64);
    }
}

/// What the node journal holds now.
pub fn node_inventory(driver: &DriverLabel, attached_volumes: usize, holders: usize) {
    let m = metrics();
    m.attached_volumes
        .get_or_create(driver)
        .set(attached_volumes as i64);
    m.holders.get_or_create(driver).set(holders as i64);
}

/// Holders whose namespace has gone quiet, now (no volume label: `list` names them).
pub fn stale_holders(driver: &DriverLabel, count: usize) {
    metrics()
        .stale_holders
        .get_or_create(driver)
        .set(count as i64);
}

/// Volumes whose stats gauges exist, by driver and volume label.
fn volumes_with_stats()
-> &'static std::sync::Mutex<std::collections::BTreeSet<(DriverLabel, String)>> {
    static KNOWN: OnceLock<std::sync::Mutex<std::collections::BTreeSet<(DriverLabel, String)>>> =
        OnceLock::new();
    KNOWN.get_or_init(Default::default)
}

/// Drops the stats gauges of `driver`'s volumes not in `keep` (detached since the last
/// refresh).
pub fn forget_volumes_except(driver: &DriverLabel, keep: &std::collections::BTreeSet<String>) {
    let gone: Vec<String> = volumes_with_stats()
        .lock()
        .expect("poisoned")
        .iter()
        .filter(|(d, volume)| d == driver && !keep.contains(volume))
        .map(|(_, volume)| volume.clone())
        .collect();
    for volume_id in gone {
        volume_stats(driver, &volume_id, None);
    }
}

/// One volume's stats, or `None` to forget a volume that is no longer attached.
pub fn volume_stats(
    driver: &DriverLabel,
    volume_id: &str,
    stats: Option<&crate::bridge::ports::VolumeStats>,
) {
    {
        let mut known = volumes_with_stats().lock().expect("poisoned");
        let key = (driver.clone(), volume_id.to_string());
        match stats {
            Some(_) => known.insert(key),
            None => known.remove(&key),
        };
    }
    let m = metrics();
    let labels = (
        VolumeLabels {
            volume_id: volume_id.to_string(),
        },
        driver.clone(),
    );
    let families = [
        &m.volume_capacity,
        &m.volume_used,
        &m.volume_available,
        &m.volume_abnormal,
    ];
    let Some(stats) = stats else {
        for family in families {
            family.remove(&labels);
        }
        return;
    };
    for (family, value) in [
        (&m.volume_capacity, stats.total_bytes),
        (&m.volume_used, stats.used_bytes),
        (&m.volume_available, stats.available_bytes),
    ] {
        match value {
            Some(v) => {
                family.get_or_create(&labels).set(v);
            }
            None => {
                family.remove(&labels);
            }
        }
    }
    m.volume_abnormal
        .get_or_create(&labels)
        .set(i64::from(stats.abnormal.is_some()));
}

/// One volume's condition from the periodic check, or `None` to forget the volume.
pub fn volume_condition(driver: &DriverLabel, volume_id: &str, abnormal: Option<bool>) {
    let labels = (
        VolumeLabels {
            volume_id: volume_id.to_string(),
        },
        driver.clone(),
    );
    let family = &metrics().volume_condition_abnormal;
    match abnormal {
        Some(abnormal) => {
            family.get_or_create(&labels).set(i64::from(abnormal));
        }
        None => {
            family.remove(&labels);
        }
    }
}

/// The text exposition of every metric.
pub fn encode() -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &metrics().registry)
        .expect("writing to a String cannot fail");
    out
}

/// At most this many metrics connections are served at once; more are closed at accept.
/// A scraper needs one; the cap keeps anyone who can reach the port from taking the file
/// descriptors the hooks need.
pub const MAX_CONNECTIONS: usize = 16;
/// How long one metrics connection may stay open, headers and answer included (an idle
/// or half-sent request is cut off then).
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest pause after a failed accept (EMFILE and the like), doubled from 10 ms.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// At most one log line per this long about refused or failed accepts, with a count.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Counts refused or failed accepts and logs them at most once per `REFUSAL_LOG_EVERY`.
struct RateLimitedWarning {
    what: &'static str,
    count: u64,
    since: Option<std::time::Instant>,
}

impl RateLimitedWarning {
    fn new(what: &'static str) -> Self {
        Self {
            what,
            count: 0,
            since: None,
        }
    }

    fn note(&mut self, error: &dyn std::fmt::Display) {
        self.count += 1;
        let now = std::time::Instant::now();
        if self
            .since
            .is_none_or(|since| now.duration_since(since) >= REFUSAL_LOG_EVERY)
        {
            tracing::warn!(count = self.count, last = %error, "metrics endpoint: {}", self.what);
            self.count = 0;
            self.since = Some(now);
        }
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves: one request per
/// connection, at most `MAX_CONNECTIONS` at once, each cut off after `CONNECTION_TIMEOUT`;
/// a failed accept backs off instead of spinning.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) {
    use hyper::body::Incoming;
    use hyper::{Request, Response, StatusCode};
    use hyper_util::rt::TokioIo;
    let answer = |request: Request<Incoming>| async move {
        let (status, body, kind) = match (request.method().as_str(), request.uri().path()) {
            ("GET", "/metrics") => (
                StatusCode::OK,
                encode(),
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            ),
            _ => (
                StatusCode::NOT_FOUND,
                "only GET /metrics is served here\n".to_string(),
                "text/plain; charset=utf-8",
            ),
        };
        Response::builder()
            .status(status)
            .header("content-type", kind)
            .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
    };
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut refused = RateLimitedWarning::new("refused connections over the limit");
    let mut failed = RateLimitedWarning::new("accept failed; backing off");
    let mut backoff = Duration::ZERO;
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    backoff = Duration::ZERO;
                    stream
                }
                Err(error) => {
                    failed.note(&error);
                    backoff = (backoff * 2).clamp(Duration::from_millis(10), MAX_ACCEPT_BACKOFF);
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => continue,
                        () = &mut shutdown => return,
                    }
                }
            },
            () = &mut shutdown => return,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refused.note(&format_args!("{MAX_CONNECTIONS} connections open"));
            drop(stream);
            continue;
        };
        tokio::spawn(async move {
            let _slot = slot;
            let connection = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), hyper::service::service_fn(answer));
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::debug!(%error, "metrics connection ended"),
                Err(_) => tracing::debug!("metrics connection cut off after its time"),
            }
        });
    }
}

/// Binds the metrics endpoint.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// The core's `Recorder` port, recording one driver's series into this process's
/// registry, with volume ids labelled as `metrics.volume_ids` says.
#[derive(Debug, Default, Clone)]
pub struct PrometheusRecorder {
    volume_ids: crate::config::VolumeIdLabels,
    driver: DriverLabel,
}

impl PrometheusRecorder {
    pub fn new(volume_ids: crate::config::VolumeIdLabels, driver: DriverLabel) -> Self {
        Self { volume_ids, driver }
    }

    /// The label a volume's series carry; `None`: no per-volume series.
    fn volume_label(&self, volume_id: &str) -> Option<String> {
        use crate::config::VolumeIdLabels;
        use sha2::Digest;
        match self.volume_ids {
            VolumeIdLabels::Plain => Some(volume_id.to_string()),
            VolumeIdLabels::None => None,
            VolumeIdLabels::Hashed => {
                let digest = sha2::Sha256::digest(volume_id.as_bytes());
                let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
                Some(format!("sha256:{hex}"))
            }
        }
    }
}

impl crate::bridge::ports::Recorder for PrometheusRecorder {
    fn hook(&self, hook_name: &'static str, outcome: &'static str, elapsed: Duration) {
        hook(&self.driver, hook_name, outcome, elapsed);
    }

    fn rollback(&self, hook: &'static str, outcome: &'static str) {
        rollback(&self.driver, hook, outcome);
    }

    fn reconcile_finding(&self, finding: &'static str, count: usize) {
        reconcile_finding(&self.driver, finding, count);
    }

    fn sweep_finding(&self, finding: &'static str, count: usize) {
        sweep_finding(&self.driver, finding, count);
    }

    fn node_inventory(&self, attached_volumes: usize, holders: usize) {
        node_inventory(&self.driver, attached_volumes, holders);
    }

    fn stale_holders(&self, count: usize) {
        stale_holders(&self.driver, count);
    }

    fn volume_stats(&self, volume_id: &str, stats: Option<&crate::bridge::ports::VolumeStats>) {
        if let Some(label) = self.volume_label(volume_id) {
            volume_stats(&self.driver, &label, stats);
        }
    }

    fn forget_volumes_except(&self, keep: &std::collections::BTreeSet<String>) {
        let labels = keep
            .iter()
            .filter_map(|volume_id| self.volume_label(volume_id))
            .collect();
        forget_volumes_except(&self.driver, &labels);
    }

    fn volume_condition(&self, volume_id: &str, abnormal: Option<bool>) {
        if let Some(label) = self.volume_label(volume_id) {
            volume_condition(&self.driver, &label, abnormal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ids_are_hashed_by_default_plain_or_left_out_on_request() {
        use crate::config::VolumeIdLabels;
        let hashed = PrometheusRecorder::default().volume_label("tenant-acme-payroll");
        let hashed = hashed.expect("a series");
        assert!(
            hashed.starts_with("sha256:") && hashed.len() == 7 + 16,
            "{hashed}"
        );
        assert!(!hashed.contains("acme"));
        assert_eq!(
            PrometheusRecorder::default().volume_label("tenant-acme-payroll"),
            Some(hashed),
            "stable"
        );
        let plain = PrometheusRecorder::new(VolumeIdLabels::Plain, DriverLabel::default());
        assert_eq!(plain.volume_label("v1").as_deref(), Some("v1"));
        assert_eq!(
            PrometheusRecorder::new(VolumeIdLabels::None, DriverLabel::default())
                .volume_label("v1"),
            None
        );
    }

    #[test]
    fn recorded_metrics_appear_with_their_conventional_names() {
        let none = DriverLabel::default();
        hook(&none, "attach", "success", Duration::from_millis(2));
        csi_call(&none, "NodePublishVolume", "Ok", Duration::from_millis(3));
        csi_retry(&none, "NodePublishVolume", "Unavailable");
        rollback(&none, "attach", "undone");
        node_inventory(&none, 2, 3);
        volume_stats(
            &none,
            "v1",
            Some(&crate::bridge::ports::VolumeStats {
                total_bytes: Some(100),
                used_bytes: Some(40),
                available_bytes: Some(60),
                abnormal: None,
            }),
        );
        let text = encode();
        for needle in [
            "cube_csi_bridge_hook_calls_total{hook=\"attach\",outcome=\"success\"}",
            "cube_csi_bridge_hook_duration_seconds_bucket{",
            "cube_csi_bridge_csi_call_duration_seconds_count{rpc=\"NodePublishVolume\",code=\"Ok\"}",
            "cube_csi_bridge_csi_retries_total{rpc=\"NodePublishVolume\",code=\"Unavailable\"}",
            "cube_csi_bridge_rollbacks_total{hook=\"attach\",outcome=\"undone\"}",
            "cube_csi_bridge_attached_volumes 2",
            "cube_csi_bridge_volume_used_bytes{volume_id=\"v1\"} 40",
            "cube_csi_bridge_volume_abnormal{volume_id=\"v1\"} 0",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        volume_stats(&none, "v1", None);
        assert!(!encode().contains("volume_id=\"v1\""));
    }

    /// Issue 19, defect 8: the periodic check's condition gauge, by the volume label
    /// `metrics.volume_ids` chooses (none at all with `none`), dropped once detached.
    #[test]
    fn the_volume_condition_gauge_follows_the_volume_id_setting() {
        use crate::bridge::ports::Recorder;
        use crate::config::VolumeIdLabels;
        let plain = PrometheusRecorder::new(VolumeIdLabels::Plain, DriverLabel::default());
        plain.volume_condition("cond-plain", Some(true));
        let series = "cube_csi_bridge_volume_condition_abnormal{volume_id=\"cond-plain\"} 1";
        assert!(encode().contains(series), "{series} missing:\n{}", encode());
        plain.volume_condition("cond-plain", Some(false));
        assert!(encode().contains(&series.replace("} 1", "} 0")));
        plain.volume_condition("cond-plain", None);
        assert!(!encode().contains("cond-plain"));
        let hashed = PrometheusRecorder::default();
        hashed.volume_condition("cond-tenant-secret", Some(true));
        let none = PrometheusRecorder::new(VolumeIdLabels::None, DriverLabel::default());
        none.volume_condition("cond-other-secret", Some(true));
        let text = encode();
        assert!(!text.contains("secret"), "{text}");
        let label = hashed.volume_label("cond-tenant-secret").unwrap();
        assert!(text.contains(&format!(
            "cube_csi_bridge_volume_condition_abnormal{{volume_id=\"{label}\"}} 1"
        )));
        hashed.volume_condition("cond-tenant-secret", None);
    }

    #[test]
    fn a_named_driver_labels_its_series_apart_from_the_others() {
        let (a, b) = (
            DriverLabel(Some(Arc::from("drv-a"))),
            DriverLabel(Some(Arc::from("drv-b"))),
        );
        hook(&a, "detach", "success", Duration::from_millis(1));
        node_inventory(&a, 7, 9);
        node_inventory(&b, 1, 1);
        let stats = crate::bridge::ports::VolumeStats {
            total_bytes: Some(5),
            used_bytes: None,
            available_bytes: None,
            abnormal: None,
        };
        volume_stats(&a, "shared-id", Some(&stats));
        volume_stats(&b, "shared-id", Some(&stats));
        forget_volumes_except(&a, &Default::default());
        let text = encode();
        for needle in [
            "cube_csi_bridge_hook_calls_total{hook=\"detach\",outcome=\"success\",driver=\"drv-a\"} 1",
            "cube_csi_bridge_attached_volumes{driver=\"drv-a\"} 7",
            "cube_csi_bridge_attached_volumes{driver=\"drv-b\"} 1",
            "cube_csi_bridge_volume_capacity_bytes{volume_id=\"shared-id\",driver=\"drv-b\"} 5",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        assert!(
            !text.contains("volume_id=\"shared-id\",driver=\"drv-a\""),
            "forgetting a's volumes left b's alone and dropped a's:\n{text}"
        );
    }
}
