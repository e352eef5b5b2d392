//! The `serve` daemon, in two steps: `Daemon::open` (each configured driver's config →
//! its bridge, driver checked, listeners bound; errors typed) and `Daemon::run` (serve
//! every driver on its own socket until shutdown, then refuse new hooks and let in-flight
//! ones finish within the grace period). Drivers share nothing but the process, its
//! metrics endpoint and its shutdown.

use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;
use tonic::transport::Server;
use tracing::Instrument;

use super::authority_filter::fix_incoming;
use super::listener::{Incoming, ListenError, PeerPolicy, UnixSocket};
use super::service::CubeService;
use crate::bridge::reconcile::Scope;
use crate::bridge::{Bridge, BridgeError, Deadline, NodeSide};
use crate::config::Config;
use crate::mount::MountView;
use crate::proto::cube::v1 as pb;
use crate::transport::live::LiveBridge;
use pb::volume_controller_service_server::VolumeControllerServiceServer;
use pb::volume_plugin_service_server::VolumePluginServiceServer;

/// How long start-up waits for the driver's answers before going on without them.
const STARTUP_CHECK_BUDGET: Duration = Duration::from_secs(10);
/// How often the daemon looks for node operations a killed hook abandoned.
const ABANDONED_SCAN_INTERVAL: Duration = Duration::from_secs(30);

/// Why the daemon could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The operator must fix the setup (exit code 78, EX_CONFIG).
    #[error("refusing to start: {0}")]
    Misconfigured(#[source] BridgeError),
    #[error(transparent)]
    Listen(#[from] ListenError),
    #[error("serving: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// This host cannot do what the config asks (exit code 78: the operator must change
    /// one of them).
    #[error("refusing to start: {0}")]
    Host(String),
}

impl ServeError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            ServeError::Misconfigured(_) | ServeError::Host(_) => 78,
            ServeError::Listen(
                ListenError::InUse { .. }
                | ListenError::NotASocket { .. }
                | ListenError::Replaceable { .. }
                | ListenError::DirOpenToOthers { .. }
                | ListenError::PassedElsewhere { .. },
            ) => 78,
            _ => 1,
        }
    }
}

/// One driver's part of the daemon: its sides of the core and its listeners.
struct Instance {
    config: Arc<Config>,
    bridge: Bridge,
    reopen: crate::app::Reopen,
    unix: UnixSocket,
    tcp: Option<TcpListener>,
    policy: PeerPolicy,
}

/// An opened daemon: one instance per configured driver, and the metrics listener they
/// share; not yet serving.
pub struct Daemon {
    instances: Vec<Instance>,
    metrics: Option<TcpListener>,
    grace: Duration,
}

impl Daemon {
    /// Opens every driver's instance (each its bridge for the configured roles, its driver
    /// checked, its listeners bound or taken from systemd) and the metrics endpoint. When
    /// this returns, calls can be made on every socket. The drivers' start-up checks run at
    /// once, so a slow driver delays the others by its own check at most.
    pub async fn open(configs: Vec<Config>) -> Result<Self, ServeError> {
        raise_open_file_limit();
        let Some(first) = configs.first() else {
            return Err(ServeError::Misconfigured(BridgeError::Unavailable(
                "the config names no driver".into(),
            )));
        };
        let metrics_addr = first.metrics.listen;
        let grace = configs
            .iter()
            .map(|c| c.serve.shutdown_grace)
            .max()
            .unwrap_or_default();
        // Bound before any instance binds its Cube socket: whoever finds the socket
        // answering finds the metrics endpoint there too.
        let metrics = match metrics_addr {
            Some(addr) => {
                let listener = crate::metrics::bind(addr)
                    .await
                    .map_err(|source| metrics_bind_error(addr, source))?;
                tracing::info!(%addr, "serving Prometheus metrics at /metrics");
                Some(listener)
            }
            None => None,
        };
        let sole = configs.len() == 1;
        let mut opening = tokio::task::JoinSet::new();
        for (index, config) in configs.into_iter().enumerate() {
            let span = instance_span(&config, sole);
            opening
                .spawn(async move { (index, Instance::open(config, sole).await) }.instrument(span));
        }
        let mut opened = Vec::new();
        while let Some(joined) = opening.join_next().await {
            let (index, instance) = joined.expect("opening an instance panicked");
            opened.push((index, instance?));
        }
        opened.sort_by_key(|(index, _)| *index);
        let instances = opened.into_iter().map(|(_, instance)| instance).collect();
        Ok(Self {
            instances,
            metrics,
            grace,
        })
    }

    /// Serves until `shutdown` resolves, then drains within the grace period.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
        let Daemon {
            instances,
            metrics,
            grace,
        } = self;
        let sole = instances.len() == 1;
        let metrics = metrics
            .map(|listener| tokio::spawn(crate::metrics::serve(listener, std::future::pending())));
        let hooks = TaskTracker::new();
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let background: Background = Arc::new(std::sync::Mutex::new(Some(Vec::new())));
        let mut stopped_tasks = Vec::new();
        let mut healths = Vec::new();
        let mut socket_files = Vec::new();
        let mut servers = tokio::task::JoinSet::new();
        for instance in instances {
            let span = instance_span(&instance.config, sole);
            let _entered = span.enter();
            let Instance {
                config,
                bridge,
                reopen,
                unix,
                tcp,
                policy,
            } = instance;
            let roles = config.serve.roles;
            let bridge = Arc::new(bridge);
            spawn_background(&bridge, &config, &background);
            // A role down at start is tried again: at each hook of it (spaced), and here.
            let bridge = Arc::new(LiveBridge::new(bridge, roles, reopen, {
                let (config, background) = (config.clone(), background.clone());
                let span = span.clone();
                Box::new(move |side| {
                    let _entered = span.enter();
                    spawn_background(&side, &config, &background);
                })
            }));
            let down_roles = bridge.down_roles();
            if !down_roles.borrow().is_empty() {
                let live = bridge.clone();
                push(
                    &background,
                    tokio::spawn(
                        async move {
                            let mut down_roles = live.down_roles();
                            while !down_roles.borrow_and_update().is_empty() {
                                tokio::time::sleep(REOPEN_INTERVAL).await;
                                if let Some(attempt) = live.reopen_if_due(Duration::ZERO) {
                                    let _ = attempt.await;
                                }
                            }
                        }
                        .in_current_span(),
                    ),
                );
            }
            let health = super::health::DaemonHealth::start(&config, roles, down_roles);
            let router = || {
                let service = CubeService::live(bridge.clone(), config.clone(), hooks.clone());
                let controller = roles
                    .controller
                    .then(|| VolumeControllerServiceServer::new(service.clone()));
                let node = roles.node.then(|| VolumePluginServiceServer::new(service));
                Server::builder()
                    .add_service(health.service())
                    .add_optional_service(controller)
                    .add_optional_service(node)
            };
            let stopped = || {
                let mut rx = stop_rx.clone();
                async move {
                    let _ = rx.wait_for(|stop| *stop).await;
                }
            };
            let UnixSocket { listener, file } = unix;
            // grpc-core and grpc-java clients send the socket path as :authority, which h2
            // refuses; the shim rewrites it to what grpc-go sends (see
            // transport/authority_filter.rs).
            servers.spawn(
                router()
                    .serve_with_incoming_shutdown(
                        fix_incoming(Incoming::new(listener, policy.clone())),
                        stopped(),
                    )
                    .in_current_span(),
            );
            if let Some(listener) = tcp {
                servers.spawn(
                    router()
                        .serve_with_incoming_shutdown(Incoming::new(listener, policy), stopped())
                        .in_current_span(),
                );
            }
            healths.push(health);
            socket_files.push(file);
        }
        // Servers end only on shutdown, or with an error.
        let serving = async {
            while let Some(joined) = servers.join_next().await {
                joined.expect("a server task panicked")?;
            }
            Ok::<(), tonic::transport::Error>(())
        };
        let result = {
            tokio::pin!(serving);
            tokio::select! {
                result = &mut serving => result.map_err(ServeError::from),
                () = shutdown => {
                    tracing::info!(grace_secs = grace.as_secs(), "shutting down: refusing new hooks, finishing in-flight ones");
                    let _ = stop_tx.send(true);
                    // Work running goes on through the drain; work a side opened from now
                    // on would start is aborted at once.
                    stopped_tasks = background.lock().expect("poisoned").take().unwrap_or_default();
                    // Now, while our listeners still hold the sockets' inodes (so no
                    // successor's socket can have the same one): after the drain a
                    // successor may have bound the paths.
                    for file in &socket_files {
                        file.remove_if_ours();
                    }
                    let drained = async {
                        let served = (&mut serving).await;
                        // Hooks whose callers already left still run to the end (or to
                        // their rollback).
                        hooks.close();
                        hooks.wait().await;
                        served
                    };
                    match tokio::time::timeout(grace, drained).await {
                        Ok(result) => result.map_err(ServeError::from),
                        Err(_) => {
                            tracing::warn!("in-flight hooks did not finish within the grace period; exiting anyway");
                            Ok(())
                        }
                    }
                }
            }
        };
        let background = background
            .lock()
            .expect("poisoned")
            .take()
            .unwrap_or_default();
        for task in background.into_iter().chain(stopped_tasks).chain(metrics) {
            task.abort();
        }
        drop(healths);
        for file in &socket_files {
            file.remove_if_ours();
            tracing::info!(socket = %file.path.display(), "stopped");
        }
        result
    }
}

/// The span an instance's work runs in: named by its driver when the daemon serves
/// several (a one-driver daemon's log lines stay as they were).
fn instance_span(config: &Config, sole: bool) -> tracing::Span {
    if sole {
        tracing::Span::none()
    } else {
        tracing::info_span!("driver", name = %config.driver)
    }
}

impl Instance {
    /// Opens the bridge for the configured roles, checks the driver, and binds (or takes
    /// from systemd) the instance's listeners.
    async fn open(config: Config, sole: bool) -> Result<Self, ServeError> {
        let roles = config.serve.roles;
        let policy = PeerPolicy::new(config.serve.allowed_uids.clone());
        let socket_path = config.socket_path().to_path_buf();
        let socket_gid = config.serve.socket_gid;
        let tcp_addr = config.serve.tcp;
        let mounts = Arc::new(MountView::new(&config.node.mount_view, false));
        let config = Arc::new(config);
        // Each served role opens on its own: a controller store that cannot be opened must
        // not take Cubelet's Attach and Detach down with it (and the other way round). The
        // role that failed answers UNAVAILABLE with its error, and readiness says it is down.
        let (bridge, reopen) = crate::app::open_sides_reopenable(&config, roles, mounts)
            .map_err(ServeError::Misconfigured)?;
        let down = bridge.down_roles(roles);
        for (role, why) in &down {
            tracing::error!(role, reason = %why, "this role cannot serve; its hooks answer UNAVAILABLE until it opens (tried again every 30 s and at its hooks; fix what the reason names)");
        }
        if down.len() == usize::from(roles.controller) + usize::from(roles.node) {
            let (_, why) = down.into_iter().next().expect("a served role");
            return Err(ServeError::Misconfigured(BridgeError::Unavailable(why)));
        }
        bridge
            .check(&Deadline::after(STARTUP_CHECK_BUDGET))
            .await
            .map_err(ServeError::Misconfigured)?;
        let unix = match UnixSocket::inherited(&socket_path, sole)? {
            Some(inherited) => {
                // systemd made the socket: its owner and mode are the socket unit's.
                let gid = std::fs::metadata(&socket_path).map(|m| m.gid()).ok();
                if let Some(wanted) = socket_gid
                    && gid != Some(wanted)
                {
                    tracing::warn!(
                        socket = %socket_path.display(),
                        socket_group = wanted,
                        "serve.socket_group is not applied to a socket systemd passed; set \
                         SocketGroup= in the socket unit (a drop-in) instead"
                    );
                }
                inherited
            }
            None => UnixSocket::bind(&socket_path, socket_gid).await?,
        };
        if tcp_addr.is_some() && config.serve.allowed_uids.is_some() {
            super::listener::check_tcp_peer_lookup().map_err(|why| {
                ServeError::Host(format!(
                    "serve.tcp with serve.allowed_uids needs the kernel to name the uid of each \
                     loopback TCP caller (netlink sock_diag), and it cannot here ({why}); load \
                     the tcp_diag module (modprobe tcp_diag), or remove serve.tcp and let Cube \
                     dial the Unix socket"
                ))
            })?;
        }
        let tcp = match tcp_addr {
            Some(addr) => {
                let listener = TcpListener::bind(addr)
                    .await
                    .map_err(|source| ListenError::Io {
                        context: format!("binding tcp {addr}"),
                        source,
                    })?;
                tracing::info!(%addr, "serving Cube hooks on tcp as well");
                Some(listener)
            }
            None => None,
        };
        tracing::info!(socket = %socket_path.display(), roles = roles.as_str(), "serving Cube hooks");
        Ok(Self {
            config,
            bridge,
            reopen,
            unix,
            tcp,
            policy,
        })
    }
}

/// Raises the soft limit on open files to the hard one: a daemon serving many sandboxes
/// holds many connections and files, and the default soft limit (1024) is easy to reach.
/// (The unit sets LimitNOFILE; the metrics endpoint caps its own share either way.)
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(error) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!(%error, soft, hard, "could not raise the open-file limit");
    }
}

/// How often the daemon tries again to open a role that could not open.
const REOPEN_INTERVAL: Duration = Duration::from_secs(30);

/// The daemon's background tasks, aborted once the drain at shutdown ends (None from its
/// start); sides opened late add theirs.
type Background = Arc<std::sync::Mutex<Option<Vec<tokio::task::JoinHandle<()>>>>>;

/// Adds `task`, or aborts it when the daemon is stopping (a side opened meanwhile gets no
/// work that nothing would stop).
fn push(background: &Background, task: tokio::task::JoinHandle<()>) {
    match background.lock().expect("poisoned").as_mut() {
        Some(tasks) => tasks.push(task),
        None => task.abort(),
    }
}

/// The background work of each side `bridge` has open: housekeeping, and on the node
/// side the volumes' conditions, recorded expansions and volume metrics.
fn spawn_background(bridge: &Arc<Bridge>, config: &Arc<Config>, background: &Background) {
    push(background, spawn_housekeeping(bridge.clone(), config));
    // The inventory gauges whenever metrics are served; the driver's volume stats
    // only when asked for.
    // Each published volume's condition (a dead mount, the driver's
    // VolumeCondition): a log line on each change, and a gauge.
    if let Ok(node) = &bridge.node {
        push(
            background,
            tokio::spawn(check_volume_conditions(node.clone()).in_current_span()),
        );
    }
    // Kubernetes mode: node daemons grow what `expand` recorded in a CubeVolume.
    if let (Ok(node), true) = (
        &bridge.node,
        config.state.controller_store == crate::config::ControllerStoreKind::Kubernetes,
    ) {
        let kube = Arc::new(crate::k8s::Kube::new(&config.kubernetes));
        match crate::app::controller_store(config, Some(&kube)) {
            Ok(store) => push(
                background,
                tokio::spawn(follow_recorded_expansions(node.clone(), store).in_current_span()),
            ),
            Err(error) => {
                tracing::warn!(%error, "not following recorded expansions: no store")
            }
        }
    }
    if let (Ok(node), true) = (&bridge.node, config.metrics.listen.is_some()) {
        let stats_every = config.metrics.volume_stats_interval;
        push(
            background,
            tokio::spawn(poll_volume_metrics(node.clone(), stats_every).in_current_span()),
        );
    }
}

/// Start-up reconciliation and the periodic passes: abandoned node operations, and
/// abandoned Creates on the controller side.
fn spawn_housekeeping(bridge: Arc<Bridge>, config: &Config) -> tokio::task::JoinHandle<()> {
    let node = bridge.node.clone().ok();
    let controller = bridge.controller.clone().ok();
    let sweep = config
        .controller
        .sweep_interval
        .filter(|_| controller.is_some());
    let grace = config.controller.abandoned_create_after;
    tokio::spawn(
        async move {
            if let Some(node) = &node {
                match node.reconcile_node(Scope::All).await {
                    Ok(report) => tracing::info!(?report, "node journal reconciled"),
                    Err(error) => tracing::error!(%error, "node journal reconciliation failed"),
                }
            }
            let node_pass = node.map(|node| {
                move || {
                    let node = node.clone();
                    async move { abandoned_node_pass(&node).await }
                }
            });
            let sweep_pass = controller.zip(sweep).map(|(controller, every)| {
                let pass = move || {
                    let controller = controller.clone();
                    async move { abandoned_create_pass(&controller, grace).await }
                };
                (every, pass)
            });
            periodic_passes(ABANDONED_SCAN_INTERVAL, node_pass, sweep_pass).await
        }
        .in_current_span(),
    )
}

/// Runs the node scan every `scan` and the create sweep at its interval, each on a clock
/// of its own: a sweep whose reclaims each wait out a Destroy's budget (a controller
/// plugin down, when abandoned Creates pile up) never holds back the node scan, the
/// backstop for failed Attaches Cube never Detaches. That holds for the first passes too,
/// which run at once, each in its own loop; the line logged once both have ended says
/// that these passes write nothing more until their next interval.
async fn periodic_passes<N, NF, S, SF>(
    scan: Duration,
    node_pass: Option<N>,
    sweep_pass: Option<(Duration, S)>,
) where
    N: Fn() -> NF,
    NF: std::future::Future<Output = ()>,
    S: Fn() -> SF,
    SF: std::future::Future<Output = ()>,
{
    let firsts_left = std::sync::atomic::AtomicUsize::new(2);
    let first_done = || {
        if firsts_left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            tracing::info!("{HOUSEKEEPING_STARTED}");
        }
    };
    tokio::join!(
        repeat_pass(node_pass.map(|pass| (scan, pass)), &first_done),
        repeat_pass(sweep_pass, &first_done),
    );
}

/// Runs `pass` at once, says so through `first_done`, then once every period; with no
/// pass, says so at once and never ends.
async fn repeat_pass<P, F>(pass: Option<(Duration, P)>, first_done: &impl Fn())
where
    P: Fn() -> F,
    F: std::future::Future<Output = ()>,
{
    let Some((period, pass)) = pass else {
        first_done();
        return std::future::pending().await;
    };
    pass().await;
    first_done();
    let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        timer.tick().await;
        pass().await;
    }
}

/// Logged once the start-up reconciliation and the first abandoned-work passes are done.
pub const HOUSEKEEPING_STARTED: &str = "start-up housekeeping finished";

async fn abandoned_node_pass(node: &crate::bridge::NodeSide) {
    match node.reconcile_node(Scope::Abandoned).await {
        Ok(report) if !report.is_empty() => {
            tracing::info!(?report, "abandoned node operations resolved")
        }
        Ok(_) => {}
        Err(error) => tracing::error!(%error, "scanning for abandoned node operations failed"),
    }
}

async fn abandoned_create_pass(controller: &crate::bridge::ControllerSide, grace: Duration) {
    match controller.sweep_abandoned_creates_watched(grace).await {
        Ok(report) if report.reclaimed + report.failed > 0 => {
            tracing::info!(?report, "abandoned creates swept")
        }
        Ok(_) => {}
        Err(error) => tracing::error!(%error, "sweeping abandoned creates failed"),
    }
}

/// How often the inventory gauges are refreshed when volume stats are not polled.
const INVENTORY_INTERVAL: Duration = Duration::from_secs(10);

/// Keeps the node inventory gauges, and with `stats_every` the per-volume stats gauges,
/// current, off the hook path.
async fn poll_volume_metrics(node: Arc<NodeSide>, stats_every: Option<Duration>) {
    let mut timer = tokio::time::interval(stats_every.unwrap_or(INVENTORY_INTERVAL));
    loop {
        timer.tick().await;
        if let Err(error) = node.refresh_volume_metrics(stats_every.is_some()).await {
            tracing::warn!(%error, "refreshing volume metrics failed");
        }
    }
}

/// How often a node daemon in Kubernetes mode looks for expansions recorded in the
/// CubeVolumes of its attached volumes.
const EXPANSION_FOLLOW_INTERVAL: Duration = Duration::from_secs(10);

/// Grows this node's attached volumes whose CubeVolume records a larger capacity (see
/// `NodeSide::follow_recorded_expansions`), off the hook path.
async fn follow_recorded_expansions(
    node: Arc<NodeSide>,
    store: Arc<dyn crate::bridge::ports::ControllerStore>,
) {
    let mut timer = tokio::time::interval(EXPANSION_FOLLOW_INTERVAL);
    loop {
        timer.tick().await;
        if let Err(error) = node.follow_recorded_expansions(store.as_ref()).await {
            tracing::warn!(%error, "following recorded expansions failed");
        }
    }
}

/// Checks every published volume's condition at start and then at each abandoned-work
/// scan interval, off the hook path (see `NodeSide::check_volume_conditions`).
async fn check_volume_conditions(node: Arc<NodeSide>) {
    let mut timer = tokio::time::interval(ABANDONED_SCAN_INTERVAL);
    loop {
        timer.tick().await;
        if let Err(error) = node.check_volume_conditions().await {
            tracing::warn!(%error, "checking volume conditions failed");
        }
    }
}

/// Resolves on SIGTERM (systemd, Kubernetes) or SIGINT (a terminal), logging which.
/// The handlers are installed when this is called, not when the future is first polled:
/// call it before binding anything, so that a SIGTERM that comes as soon as the socket
/// answers (systemd, a test) is a graceful stop, not the default action's kill.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "received shutdown signal");
    }
}

/// Why the metrics endpoint could not be bound, with what to do about an address in use:
/// the chart gives every release the same ports on the host network.
fn metrics_bind_error(addr: std::net::SocketAddr, source: std::io::Error) -> ListenError {
    let context = if source.kind() == std::io::ErrorKind::AddrInUse {
        format!(
            "binding the metrics endpoint {addr} (another process listens there: another \
             bridge instance or Helm release on this host?; give each its own metrics.listen, \
             in the chart metrics.port)"
        )
    } else {
        format!("binding the metrics endpoint {addr}")
    };
    ListenError::Io { context, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A metrics port another process holds is named, with the fix; before, the error
    /// said only "Address already in use", and a second release crash-looped on it.
    #[tokio::test]
    async fn a_metrics_port_in_use_says_who_may_hold_it_and_what_to_do() {
        let held = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = held.local_addr().unwrap();
        let error = crate::metrics::bind(addr).await.unwrap_err();
        let message = metrics_bind_error(addr, error).to_string();
        assert!(
            message.contains("another bridge instance") && message.contains("metrics.listen"),
            "{message}"
        );
    }
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A sweep pass that lasts (three reclaims, each waiting out a Destroy's budget on a
    /// controller plugin that is down) does not hold back the node scan: here the long
    /// sweep ends only once the scan has run three more times meanwhile (or gives up after
    /// 60 s). Before, both ran in one loop, one pass at a time: the scan waited for the
    /// sweep, which waited for the scan, until it gave up.
    #[tokio::test]
    async fn a_long_sweep_never_holds_back_the_node_scan() {
        let scans = Arc::new(AtomicUsize::new(0));
        let sweeps = Arc::new(AtomicUsize::new(0));
        let scanned = Arc::new(tokio::sync::Notify::new());
        let node_pass = {
            let (scans, scanned) = (scans.clone(), scanned.clone());
            move || {
                scans.fetch_add(1, Ordering::SeqCst);
                scanned.notify_waiters();
                async {}
            }
        };
        let (gave_up_tx, mut gave_up) = tokio::sync::mpsc::unbounded_channel();
        let sweep_pass = {
            let (sweeps, scans, scanned) = (sweeps.clone(), scans.clone(), scanned.clone());
            move || {
                let first = sweeps.fetch_add(1, Ordering::SeqCst) == 0;
                let (scans, scanned, gave_up) =
                    (scans.clone(), scanned.clone(), gave_up_tx.clone());
                async move {
                    if first {
                        return;
                    }
                    let start = scans.load(Ordering::SeqCst);
                    let three_more = async {
                        while scans.load(Ordering::SeqCst) < start + 3 {
                            let next = scanned.notified();
                            if scans.load(Ordering::SeqCst) >= start + 3 {
                                break;
                            }
                            next.await;
                        }
                    };
                    let waited = tokio::time::timeout(Duration::from_secs(60), three_more).await;
                    let _ = gave_up.send(waited.is_err());
                }
            }
        };
        let passes = tokio::spawn(periodic_passes(
            Duration::from_millis(10),
            Some(node_pass),
            Some((Duration::from_millis(20), sweep_pass)),
        ));
        let gave_up = gave_up.recv().await.unwrap();
        passes.abort();
        assert!(!gave_up, "the node scan did not run during a long sweep");
    }

    /// Nor does the first sweep, which runs at start-up: with abandoned Creates piled up
    /// while the controller plugin is down, it lasts one Destroy budget per record. Here
    /// it never ends, and the node scan still runs again and again. Before, the first
    /// passes ran one after the other ahead of both loops: the scan ran once, then waited.
    #[tokio::test]
    async fn a_first_sweep_that_lasts_never_holds_back_the_node_scan() {
        let scans = Arc::new(AtomicUsize::new(0));
        let scanned = Arc::new(tokio::sync::Notify::new());
        let node_pass = {
            let (scans, scanned) = (scans.clone(), scanned.clone());
            move || {
                scans.fetch_add(1, Ordering::SeqCst);
                scanned.notify_waiters();
                async {}
            }
        };
        let sweep_pass = || std::future::pending::<()>();
        let passes = tokio::spawn(periodic_passes(
            Duration::from_millis(10),
            Some(node_pass),
            Some((Duration::from_millis(20), sweep_pass)),
        ));
        let three_scans = async {
            loop {
                let next = scanned.notified();
                if scans.load(Ordering::SeqCst) >= 3 {
                    break;
                }
                next.await;
            }
        };
        let waited = tokio::time::timeout(Duration::from_secs(60), three_scans).await;
        passes.abort();
        assert!(
            waited.is_ok(),
            "the node scan ran {} time(s) while the first sweep lasted",
            scans.load(Ordering::SeqCst)
        );
    }
}
