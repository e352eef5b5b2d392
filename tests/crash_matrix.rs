//! The crash matrix (issue 13). For every fault-injection point of Create, Destroy, Attach
//! and Detach (`faults::POINTS`), the `serve` daemon — and, separately, a forked hook's
//! worker — is killed with SIGKILL exactly there; then the bridge is restarted, Cube
//! carries on as Cube does (retries Destroy and Detach with the same request; never
//! Destroys after a failed Create, never Detaches after a failed Attach, but creates the
//! sandbox again later), and the test checks convergence: no mount nobody holds, no
//! staging, no journal record or pending marker, no ControllerPublish left, controller
//! records exactly as expected (none lost, none duplicated, no CSI volume leaked) and the
//! data on a persisting volume intact.
//!
//! The outcome table (docs/reliability.md) is printed and written to
//! `$CARGO_TARGET_TMPDIR/crash-matrix.md`. Needs root and `--features fault-injection`
//! (scripts/test.sh builds the tests with it); in CI neither may be missing.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::callers::{
    CubeCaller, Hook, RpcCaller, attach_request, create_request, detach_request,
};
use common::fake_driver::Caps;
use common::{Mode, World};
use cube_csi_bridge::bridge::HookKind;
use cube_csi_bridge::bridge::caller::CALLER_LEFT;
use cube_csi_bridge::bridge::faults::{self, When};
use cube_csi_bridge::bridge::ports::ControllerStore;
use cube_csi_bridge::bridge::records::VolumeState;
use cube_csi_bridge::proto::cube::v1 as pb;
use cube_csi_bridge::store::EmbeddedStore;

const CRASH_AT: &str = "CUBE_CSI_BRIDGE_CRASH_AT";
const CRASH_MARK: &str = "CUBE_CSI_BRIDGE_CRASH_MARK";
/// How many cases run at once (they are independent: one world each).
const JOBS_ENV: &str = "CUBE_CSI_BRIDGE_CRASH_MATRIX_JOBS";
/// Runs only the cases whose point or transport contains this text (for debugging).
const ONLY_ENV: &str = "CUBE_CSI_BRIDGE_CRASH_MATRIX_ONLY";
/// The one volume each case works on, and the file written to it before the crash.
const VOLUME: &str = "v";
const BEFORE_FILE: &str = "before.txt";
const BEFORE_TEXT: &str = "written before the crash\n";
/// A volume that lives through every case untouched: created first (and, in node cases,
/// attached in another namespace with a file on it). No crash or recovery may disturb it.
const BYSTANDER: &str = "w";
const BYSTANDER_NS: &str = "ns2";
/// Upper bound for anything the bridge does on its own (reconciliation, the sweep).
const CONVERGE_LIMIT: Duration = Duration::from_secs(60);

/// Who is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Transport {
    /// `cube-csi-bridge serve`, driven over its socket.
    Daemon,
    /// The forked hook's worker process (src/transport/worker.rs).
    Worker,
}

const TRANSPORTS: [Transport; 2] = [Transport::Daemon, Transport::Worker];

/// How a case reaches its point: each scenario reaches the *first* occurrence of the
/// points of its steps (a point is `hook:when:step`; a hook reaches some steps twice).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Scenario {
    /// Create of a new volume.
    Create,
    /// Create whose caller leaves during CreateVolume: Create deletes what it made.
    CreateAbandoned,
    /// Destroy of a created volume.
    Destroy,
    /// Destroy of a volume whose Create died after recording its intent.
    DestroyUnfinished,
    /// The daemon's sweep reclaiming a Create that died (driven through `serve` here; forked
    /// controller hooks sweep too, which tests/cube_conditions.rs covers).
    Sweep,
    /// First Attach of a volume (ControllerPublish, NodeStage, NodePublish).
    Attach,
    /// First Attach whose caller leaves during NodePublishVolume: Attach undoes itself.
    AttachAbandoned,
    /// The last Detach.
    Detach,
}

const SCENARIOS: [Scenario; 8] = [
    Scenario::Create,
    Scenario::CreateAbandoned,
    Scenario::Destroy,
    Scenario::DestroyUnfinished,
    Scenario::Sweep,
    Scenario::Attach,
    Scenario::AttachAbandoned,
    Scenario::Detach,
];

impl Scenario {
    fn hook(self) -> HookKind {
        match self {
            Scenario::Create | Scenario::CreateAbandoned => HookKind::Create,
            Scenario::Destroy | Scenario::DestroyUnfinished | Scenario::Sweep => HookKind::Destroy,
            Scenario::Attach | Scenario::AttachAbandoned => HookKind::Attach,
            Scenario::Detach => HookKind::Detach,
        }
    }

    /// The steps whose points this scenario reaches first.
    fn steps(self) -> &'static [&'static str] {
        match self {
            Scenario::Create => &["store", "CreateVolume"],
            Scenario::CreateAbandoned => &["DeleteVolume"],
            Scenario::Destroy => &["DeleteVolume", "store"],
            Scenario::DestroyUnfinished => &["CreateVolume"],
            Scenario::Sweep => &["store", "CreateVolume", "DeleteVolume"],
            Scenario::Attach => &[
                "journal",
                "ControllerPublishVolume",
                "NodeStageVolume",
                "NodePublishVolume",
            ],
            Scenario::AttachAbandoned => &[
                "NodeUnpublishVolume",
                "NodeUnstageVolume",
                "ControllerUnpublishVolume",
            ],
            Scenario::Detach => &[
                "NodeUnpublishVolume",
                "journal",
                "NodeUnstageVolume",
                "ControllerUnpublishVolume",
            ],
        }
    }

    fn transports(self) -> &'static [Transport] {
        match self {
            Scenario::Sweep => &[Transport::Daemon],
            _ => &TRANSPORTS,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Scenario::Create => "Create",
            Scenario::CreateAbandoned => "Create, caller leaves during CreateVolume",
            Scenario::Destroy => "Destroy",
            Scenario::DestroyUnfinished => "Destroy of a Create that died after its intent",
            Scenario::Sweep => "sweep of an abandoned Create (daemon only)",
            Scenario::Attach => "first Attach",
            Scenario::AttachAbandoned => "first Attach, caller leaves during NodePublish",
            Scenario::Detach => "last Detach",
        }
    }

    fn is_node(self) -> bool {
        self.hook().is_node()
    }
}

/// One cell of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Case {
    scenario: Scenario,
    step: &'static str,
    when: When2,
    transport: Transport,
}

/// `When`, ordered (before first) for the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum When2 {
    Before,
    After,
}

impl When2 {
    fn when(self) -> When {
        match self {
            When2::Before => When::Before,
            When2::After => When::After,
        }
    }
}

impl Case {
    fn point(&self) -> String {
        faults::name(self.scenario.hook(), self.when.when(), self.step)
    }
}

/// Every case: each scenario's points, before and after, in each of its transports.
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for scenario in SCENARIOS {
        for &step in scenario.steps() {
            for when in [When2::Before, When2::After] {
                for &transport in scenario.transports() {
                    cases.push(Case {
                        scenario,
                        step,
                        when,
                        transport,
                    });
                }
            }
        }
    }
    cases
}

// --- the list of points is the code's ---------------------------------------------------

/// The `faults::point(hook, When::X, "step")` calls in src/bridge, as (hook expression,
/// when, step).
fn point_calls_in_source() -> Vec<(String, String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bridge");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") || path.ends_with("faults.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (at, _) in text.match_indices("faults::point(") {
            let rest = &text[at + "faults::point(".len()..];
            let args = &rest[..rest.find(')').expect("a closing parenthesis")];
            let args: Vec<String> = args
                .split(',')
                .map(|a| a.split_whitespace().collect::<String>())
                .filter(|a| !a.is_empty())
                .collect();
            assert_eq!(args.len(), 3, "{}: faults::point({args:?})", path.display());
            let when = args[1]
                .strip_prefix("When::")
                .unwrap_or_else(|| panic!("{}: {args:?}", path.display()))
                .to_lowercase();
            let step = args[2].trim_matches('"').to_string();
            found.push((args[0].clone(), when, step));
        }
    }
    assert!(
        !found.is_empty(),
        "no faults::point calls found in src/bridge"
    );
    found
}

#[test]
fn every_fault_point_in_the_code_is_listed_and_in_the_matrix() {
    let listed: BTreeSet<String> = faults::POINTS
        .iter()
        .map(|&(hook, when, step)| faults::name(hook, when, step))
        .collect();
    assert_eq!(listed.len(), faults::POINTS.len(), "POINTS has duplicates");
    let listed_by_step = |when: &str, step: &str| -> Vec<String> {
        listed
            .iter()
            .filter(|p| p.ends_with(&format!(":{when}:{step}")))
            .cloned()
            .collect()
    };
    let calls = point_calls_in_source();
    for (hook, when, step) in &calls {
        match hook.strip_prefix("HookKind::") {
            // A literal hook: exactly this point must be listed.
            Some(kind) => {
                let name = format!("{}:{when}:{step}", kind.to_lowercase());
                assert!(listed.contains(&name), "{name} is not in faults::POINTS");
            }
            // A hook passed in: the step must be listed for some hook (which hooks reach
            // it is checked at run time: with the feature, an unlisted point panics).
            None => assert!(
                !listed_by_step(when, step).is_empty(),
                "faults::point({hook}, {when}, {step}) matches nothing in faults::POINTS"
            ),
        }
    }
    // Nothing listed that the code no longer has.
    for &(hook, when, step) in faults::POINTS {
        let in_code = calls.iter().any(|(h, w, s)| {
            w == when.as_str()
                && s == step
                && (h == "hook" || h.eq_ignore_ascii_case(&format!("HookKind::{hook}")))
        });
        assert!(
            in_code,
            "{} is listed but no faults::point call makes it",
            faults::name(hook, when, step)
        );
    }
    // The matrix crashes at every listed point in both transports, and nowhere else.
    let matrix: BTreeSet<(String, Transport)> =
        cases().iter().map(|c| (c.point(), c.transport)).collect();
    for point in &listed {
        for transport in TRANSPORTS {
            assert!(
                matrix.contains(&(point.clone(), transport)),
                "the crash matrix has no case for {point} in {transport:?}"
            );
        }
    }
    for (point, _) in &matrix {
        assert!(
            listed.contains(point),
            "the matrix crashes at unlisted {point}"
        );
    }
}

// --- one case -----------------------------------------------------------------------------

/// A case's world and what it observed.
struct Lab {
    w: World,
    case: Case,
    mark: PathBuf,
    /// What Create answered (the handle Attach gets).
    private_data: String,
    /// The bystander's attachment (node cases).
    bystander: Option<pb::AttachResponse>,
    /// What happened, for the failure message.
    trail: Vec<String>,
}

/// The config's extra part: short budgets, and the sweep only when asked for.
fn extra(sweep: bool) -> String {
    let sweep = if sweep {
        "sweep_interval_secs = 1\nabandoned_create_secs = 8\n"
    } else {
        "sweep_interval_secs = 0\n"
    };
    format!(
        "[controller]\n{sweep}\n[timeouts]\ncreate_secs = 4\ndestroy_secs = 10\n\
         attach_secs = 10\ndetach_secs = 10\nrollback_secs = 10\n"
    )
}

impl Lab {
    async fn new(case: Case) -> Lab {
        let mut w = World::start(Mode::Binary, Caps::all_steps(), &extra(false)).await;
        if case.transport == Transport::Daemon {
            w.mode = Mode::Rpc;
        }
        let mark = w.dir.path().join("crash-mark");
        Lab {
            w,
            case,
            mark,
            private_data: String::new(),
            bystander: None,
            trail: Vec::new(),
        }
    }

    fn note(&mut self, what: impl Into<String>) {
        self.trail.push(what.into());
    }

    fn set_sweep(&self, on: bool) {
        let text = common::config_text(self.w.dir.path(), &extra(on));
        std::fs::write(&self.w.config_path, text).unwrap();
    }

    /// (Re)starts the daemon: the old one is killed first (idle, so harmless).
    async fn daemon(&mut self, crash_at: Option<&str>) -> Result<(), String> {
        if let Some(mut old) = self.w.daemon.take() {
            let _ = old.kill().await;
        }
        let mark = self.mark.display().to_string();
        let env: Vec<(&str, &str)> = match crash_at {
            Some(point) => vec![(CRASH_AT, point), (CRASH_MARK, &mark)],
            None => Vec::new(),
        };
        self.w.start_daemon_with_env(&env).await
    }

    /// The caller Cube uses in this transport (no crash point).
    fn cube(&self) -> Box<dyn CubeCaller> {
        self.w.caller()
    }

    /// Drives `hook` with the crash point armed and checks that the process died there by
    /// SIGKILL. `leave_during`: the caller gives up once the driver is inside that (slow)
    /// CSI call — rpc: the client drops the call, as at its deadline; forked: Cube
    /// SIGKILLs the process it started.
    /// Runs `hook` until the crash point kills it. With `leave_during`, the caller leaves
    /// (Cube's deadline) while that driver call is held, and the call is let go only then,
    /// so the hook cannot finish first however slow the machine is.
    async fn crash(
        &mut self,
        hook: Hook,
        leave_during: Option<&'static str>,
    ) -> Result<(), String> {
        let point = self.case.point();
        let held = leave_during.map(|method| self.w.driver.hold(method));
        let _ = std::fs::remove_file(&self.mark);
        self.w.driver.clear_calls();
        match self.case.transport {
            Transport::Daemon => {
                self.daemon(Some(&point)).await?;
                let rpc = RpcCaller::new(&self.w.socket());
                let call = tokio::spawn(async move { rpc.call(hook).await });
                let answer = match leave_during {
                    None => call.await.unwrap().ok(),
                    Some(method) => {
                        let left_before = self.w.logs().matches(CALLER_LEFT).count();
                        self.wait_for_call(method).await?;
                        call.abort();
                        // Let the driver answer only once the daemon saw the caller go: an
                        // answer that wins that race is handed to a caller that is gone
                        // (a holder Cube does not know of, the case of the next Detach).
                        converge(CONVERGE_LIMIT, || async {
                            if self.w.logs().matches(CALLER_LEFT).count() > left_before {
                                Ok(())
                            } else {
                                Err("the daemon never saw its caller leave".to_string())
                            }
                        })
                        .await?;
                        if let Some(gate) = &held {
                            gate.release();
                        }
                        None
                    }
                };
                if let Some(answer) = answer {
                    return Err(format!(
                        "{point} was not reached: the hook answered {answer:?}"
                    ));
                }
                let mut daemon = self.w.daemon.take().expect("the daemon runs");
                let status = tokio::time::timeout(CONVERGE_LIMIT, daemon.wait())
                    .await
                    .map_err(|_| format!("{point} was not reached: the daemon is still running"))?
                    .unwrap();
                if status.signal() != Some(nix::libc::SIGKILL) {
                    return Err(format!("the daemon ended with {status}, not SIGKILL"));
                }
                self.expect_mark(&point, Duration::ZERO).await?;
            }
            Transport::Worker => {
                let binary = self
                    .w
                    .binary_caller()
                    .with_env(CRASH_AT, &point)
                    .with_env(CRASH_MARK, &self.mark.display().to_string());
                match leave_during {
                    None => {
                        if let Ok(answer) = binary.call(hook).await {
                            return Err(format!(
                                "{point} was not reached: the hook answered {answer:?}"
                            ));
                        }
                    }
                    Some(method) => {
                        let mut front = binary.spawn(&hook);
                        self.wait_for_call(method).await?;
                        // What Cube does at its deadline: SIGKILL the process it forked.
                        front.start_kill().unwrap();
                        let _ = front.wait().await;
                        if let Some(gate) = &held {
                            gate.release();
                        }
                    }
                }
                let pid = self.expect_mark(&point, CONVERGE_LIMIT).await?;
                wait_until_dead(pid).await?;
            }
        }
        self.w.driver.clear_calls();
        self.note(format!("killed at {point}"));
        Ok(())
    }

    /// Waits until the driver has received a call of `method`.
    async fn wait_for_call(&self, method: &str) -> Result<(), String> {
        let until = Instant::now() + CONVERGE_LIMIT;
        while !self.w.driver.calls().iter().any(|c| c.method == method) {
            if Instant::now() >= until {
                return Err(format!("the hook never called {method}"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// Waits for the crash mark of `point`; returns the pid that wrote it.
    async fn expect_mark(&self, point: &str, limit: Duration) -> Result<i32, String> {
        let until = Instant::now() + limit;
        loop {
            if let Ok(text) = std::fs::read_to_string(&self.mark)
                && let Some((pid, at)) = text.trim().split_once(' ')
            {
                if at != point {
                    return Err(format!("crashed at {at}, not {point}"));
                }
                return Ok(pid.parse().unwrap());
            }
            if Instant::now() >= until {
                return Err(format!("{point} was not reached (no crash mark)"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn staging(&self) -> PathBuf {
        self.w
            .base_dir
            .join(".staging")
            .join(format!("fake+{VOLUME}"))
    }

    fn host_path(&self) -> PathBuf {
        self.w.base_dir.join(format!("fake+{VOLUME}"))
    }

    /// `VOLUME`'s CSI volume at the driver (named by its Create, `fake-cube-<id>-<12 hex>`),
    /// or a name no volume has when there is none.
    fn csi_volume(&self) -> String {
        self.csi_volume_of(VOLUME)
    }

    fn csi_volume_of(&self, volume_id: &str) -> String {
        self.w
            .driver
            .csi_volume_of(volume_id)
            .unwrap_or_else(|| format!("fake-cube-{volume_id} (none)"))
    }

    /// What is left on the node of an attachment of `VOLUME` nobody holds (or, with
    /// `everything`, of any volume); empty when nothing is.
    fn node_leftovers(&self, everything: bool) -> Vec<String> {
        let ours = |name: &str| everything || !name.contains(&format!("fake+{BYSTANDER}"));
        let mut left = Vec::new();
        let mounts: Vec<PathBuf> = self
            .w
            .mounts()
            .into_iter()
            .filter(|m| ours(&m.display().to_string()))
            .collect();
        if !mounts.is_empty() {
            left.push(format!("mounts {mounts:?}"));
        }
        if self.staging().exists() {
            left.push(format!("staging dir {}", self.staging().display()));
        }
        if self.host_path().exists() {
            left.push(format!("host_path dir {}", self.host_path().display()));
        }
        let journal = self.w.dir.path().join("state/node");
        let files = |dir: &Path| -> Vec<String> {
            std::fs::read_dir(dir)
                .map(|d| {
                    d.filter_map(Result::ok)
                        .filter(|e| e.path().is_file())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|name| everything || name.split('.').next() == Some(VOLUME))
                        .collect()
                })
                .unwrap_or_default()
        };
        let records = files(&journal);
        if !records.is_empty() {
            left.push(format!("journal files {records:?}"));
        }
        let pending = files(&journal.join("pending"));
        if !pending.is_empty() {
            left.push(format!("pending markers {pending:?}"));
        }
        let published: Vec<_> = self
            .w
            .driver
            .controller_published()
            .into_iter()
            .filter(|(volume, _)| everything || *volume == self.csi_volume())
            .collect();
        if !published.is_empty() {
            left.push(format!("ControllerPublished {published:?}"));
        }
        left
    }

    /// The controller store's records: (volume id, state, CSI volume id).
    async fn store_records(&self) -> Vec<(String, VolumeState, Option<String>)> {
        let path = self.w.dir.path().join("state/controller.redb");
        if !path.exists() {
            return Vec::new();
        }
        let store = Arc::new(EmbeddedStore::open(&path).unwrap());
        let mut records: Vec<_> = ControllerStore::list(&store)
            .await
            .unwrap()
            .into_iter()
            .map(|r| (r.volume_id, r.state, r.csi_volume_id))
            .collect();
        records.sort_by(|a, b| a.0.cmp(&b.0));
        records
    }

    /// The CSI volumes the driver holds.
    fn driver_volumes(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.w.dir.path().join("driver-data"))
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Checks that the bystander and (`exists`) `VOLUME` are recorded as Created and exist
    /// at the driver, and nothing else: no record lost or duplicated, no CSI volume leaked.
    async fn expect_controller(&self, exists: bool) -> Result<(), String> {
        let records = self.store_records().await;
        let volumes = self.driver_volumes();
        let mut want_records = vec![(
            BYSTANDER.to_string(),
            VolumeState::Created,
            Some(self.csi_volume_of(BYSTANDER)),
        )];
        let mut want_volumes = vec![self.csi_volume_of(BYSTANDER)];
        if exists {
            want_records.push((
                VOLUME.to_string(),
                VolumeState::Created,
                Some(self.csi_volume()),
            ));
            want_volumes.push(self.csi_volume());
        }
        want_records.sort_by(|a, b| a.0.cmp(&b.0));
        want_volumes.sort();
        if records != want_records || volumes != want_volumes {
            return Err(format!(
                "controller: records {records:?} (want {want_records:?}), driver volumes \
                 {volumes:?} (want {want_volumes:?})"
            ));
        }
        Ok(())
    }

    /// The bystander, before the crash: created, and in node cases attached in another
    /// namespace with a file on it.
    async fn bystander_up(&mut self) -> Result<(), String> {
        if self.case.transport == Transport::Daemon {
            self.daemon(None).await?;
        }
        let created = self
            .cube()
            .create(create_request(BYSTANDER))
            .await
            .map_err(err("Create of the bystander"))?;
        if self.case.scenario.is_node() {
            let attached = self
                .cube()
                .attach(attach_request(
                    BYSTANDER_NS,
                    &self.w.base_dir,
                    "sb-bystander",
                    BYSTANDER,
                    0,
                    &created.private_data,
                ))
                .await
                .map_err(err("Attach of the bystander"))?;
            std::fs::write(
                Path::new(&attached.host_path).join(BEFORE_FILE),
                BEFORE_TEXT,
            )
            .unwrap();
            self.bystander = Some(attached);
        }
        Ok(())
    }

    /// The bystander after recovery: still mounted with its file (node cases), then
    /// detached; afterwards nothing at all is left on the node.
    async fn bystander_down(&mut self) -> Result<(), String> {
        let Some(attached) = self.bystander.take() else {
            return Ok(());
        };
        let host_path = PathBuf::from(&attached.host_path);
        if !self.w.mounts().contains(&host_path) {
            return Err("the bystander's mount was lost".into());
        }
        let read = std::fs::read_to_string(host_path.join(BEFORE_FILE)).unwrap_or_default();
        if read != BEFORE_TEXT {
            return Err(format!("the bystander's file reads {read:?}"));
        }
        self.cube()
            .detach(detach_request(
                BYSTANDER_NS,
                "sb-bystander",
                BYSTANDER,
                0,
                &attached.metadata,
            ))
            .await
            .map_err(err("Detach of the bystander"))?;
        let left = self.node_leftovers(true);
        if !left.is_empty() {
            return Err(format!("after all detaches: {}", left.join("; ")));
        }
        Ok(())
    }

    /// The mutating CSI calls the recovery made, in short.
    fn recovery_calls(&self) -> String {
        let calls: Vec<&str> = self
            .w
            .driver
            .mutating_calls()
            .into_iter()
            .map(short_call)
            .collect();
        if calls.is_empty() {
            "no CSI call".into()
        } else {
            calls.join(", ")
        }
    }
}

fn short_call(call: &str) -> &'static str {
    match call {
        "CreateVolume" => "Create",
        "DeleteVolume" => "Delete",
        "ControllerPublishVolume" => "CtrlPublish",
        "ControllerUnpublishVolume" => "CtrlUnpublish",
        "NodeStageVolume" => "Stage",
        "NodeUnstageVolume" => "Unstage",
        "NodePublishVolume" => "Publish",
        "NodeUnpublishVolume" => "Unpublish",
        _ => "?",
    }
}

/// Waits until `pid` has exited (gone, or a zombie nobody reaps).
async fn wait_until_dead(pid: i32) -> Result<(), String> {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return Ok(()),
            Ok(stat) => {
                let state = stat.rsplit_once(") ").map(|(_, rest)| &rest[..1]);
                if state == Some("Z") || state == Some("X") {
                    return Ok(());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("process {pid} marked its crash but did not die"))
}

/// Polls `check` until it returns `Ok`, or returns its last error after `limit`.
async fn converge<F, Fut>(limit: Duration, mut check: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let until = Instant::now() + limit;
    loop {
        let outcome = check().await;
        if outcome.is_ok() || Instant::now() >= until {
            return outcome;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn err(what: &str) -> impl Fn(common::CubeError) -> String + '_ {
    move |e| format!("{what} failed: {e:?}")
}

fn attach_req(lab: &Lab, sandbox: &str) -> pb::AttachRequest {
    attach_request(
        "default",
        &lab.w.base_dir,
        sandbox,
        VOLUME,
        0,
        &lab.private_data,
    )
}

/// Runs one case; `Ok` describes how the bridge recovered.
async fn run_case(case: Case) -> Result<String, String> {
    let mut lab = Lab::new(case).await;
    let outcome = async {
        lab.bystander_up().await?;
        let recovered = match case.scenario {
            Scenario::Create | Scenario::CreateAbandoned | Scenario::Sweep => {
                create_case(&mut lab).await?
            }
            Scenario::Destroy | Scenario::DestroyUnfinished => destroy_case(&mut lab).await?,
            Scenario::Attach | Scenario::AttachAbandoned | Scenario::Detach => {
                node_case(&mut lab).await?
            }
        };
        lab.bystander_down().await?;
        Ok::<_, String>(recovered)
    }
    .await;
    outcome.map_err(|e| {
        let log = lab.w.logs();
        let tail: Vec<&str> = log.lines().rev().take(25).collect();
        format!(
            "{e}\n  trail: {:?}\n  calls since the crash: {:?}\n  log tail:\n    {}",
            lab.trail,
            lab.w.driver.mutating_calls(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n    ")
        )
    })
}

/// A Create that died (or a sweep that died reclaiming one): only the sweep can reclaim
/// what it made, since Cube never Destroys after a failed Create. Then Cube's next Create
/// of the same id must give exactly one volume.
async fn create_case(lab: &mut Lab) -> Result<String, String> {
    let create = Hook::Create(create_request(VOLUME));
    match lab.case.scenario {
        Scenario::Create => lab.crash(create, None).await?,
        Scenario::CreateAbandoned => {
            lab.crash(create, Some("CreateVolume")).await?;
        }
        Scenario::Sweep => {
            // A Create that died after recording its intent, then a sweep that dies.
            let first = lab.case.point();
            lab.case.scenario = Scenario::Create;
            lab.case.step = "store";
            lab.case.when = When2::After;
            lab.crash(create, None).await?;
            lab.case.scenario = Scenario::Sweep;
            let (step, when) = parse_point(&first);
            lab.case.step = step;
            lab.case.when = when;
            lab.set_sweep(true);
            let point = lab.case.point();
            let _ = std::fs::remove_file(&lab.mark);
            lab.daemon(Some(&point)).await?;
            let mut daemon = lab.w.daemon.take().unwrap();
            let status = tokio::time::timeout(CONVERGE_LIMIT, daemon.wait())
                .await
                .map_err(|_| format!("{point} was not reached by the sweep"))?
                .unwrap();
            if status.signal() != Some(nix::libc::SIGKILL) {
                return Err(format!("the daemon ended with {status}, not SIGKILL"));
            }
            lab.expect_mark(&point, Duration::ZERO).await?;
            lab.w.driver.clear_calls();
            lab.note(format!("sweep killed at {point}"));
        }
        _ => unreachable!(),
    }
    // Only `serve` sweeps: start one (for the forked transport too, sharing the store).
    lab.set_sweep(true);
    lab.daemon(None).await?;
    converge(CONVERGE_LIMIT, || lab.expect_controller(false)).await?;
    let recovered = if lab.w.driver.mutating_calls().is_empty() {
        "nothing to reclaim (no record, no CSI volume)".to_string()
    } else {
        format!("reclaimed by the sweep: {}", lab.recovery_calls())
    };
    lab.note(&recovered);
    // Cube creates the volume again: one record, one CSI volume; then Destroy.
    lab.cube()
        .create(create_request(VOLUME))
        .await
        .map_err(err("Create after recovery"))?;
    lab.expect_controller(true).await?;
    lab.cube()
        .destroy(pb::DestroyRequest {
            volume_id: VOLUME.into(),
        })
        .await
        .map_err(err("Destroy"))?;
    lab.expect_controller(false).await?;
    Ok(recovered)
}

fn parse_point(point: &str) -> (&'static str, When2) {
    let mut parts = point.split(':');
    let (_, when, step) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
    let step = faults::POINTS
        .iter()
        .map(|p| p.2)
        .find(|s| *s == step)
        .unwrap();
    let when = if when == "before" {
        When2::Before
    } else {
        When2::After
    };
    (step, when)
}

/// A Destroy that died: Cube retries it until it succeeds.
async fn destroy_case(lab: &mut Lab) -> Result<String, String> {
    let destroy = Hook::Destroy(pb::DestroyRequest {
        volume_id: VOLUME.into(),
    });
    match lab.case.scenario {
        Scenario::Destroy => {
            lab.cube()
                .create(create_request(VOLUME))
                .await
                .map_err(err("Create"))?;
            lab.expect_controller(true).await?;
            lab.crash(destroy.clone(), None).await?;
        }
        Scenario::DestroyUnfinished => {
            // A Create that died after recording its intent (nothing created yet).
            let target = lab.case;
            lab.case.scenario = Scenario::Create;
            lab.case.step = "store";
            lab.case.when = When2::After;
            lab.crash(Hook::Create(create_request(VOLUME)), None)
                .await?;
            lab.case = target;
            let records = lab.store_records().await;
            let ours: Vec<_> = records.iter().filter(|r| r.0 == VOLUME).collect();
            if ours.len() != 1 || ours[0].1 != VolumeState::Creating {
                return Err(format!(
                    "expected a Creating record of {VOLUME}: {records:?}"
                ));
            }
            lab.crash(destroy.clone(), None).await?;
        }
        _ => unreachable!(),
    }
    if lab.case.transport == Transport::Daemon {
        lab.daemon(None).await?;
    }
    lab.cube()
        .call(destroy)
        .await
        .map_err(err("the retried Destroy"))?;
    lab.expect_controller(false).await?;
    let recovered = format!("retried Destroy: {}", lab.recovery_calls());
    lab.note(&recovered);
    Ok(recovered)
}

/// Attach or Detach killed half way, on a volume holding a file written before.
async fn node_case(lab: &mut Lab) -> Result<String, String> {
    let daemon = lab.case.transport == Transport::Daemon;
    let cube = lab.cube();
    lab.private_data = cube
        .create(create_request(VOLUME))
        .await
        .map_err(err("Create"))?
        .private_data;
    // The data that must survive: written through host_path by an earlier sandbox.
    let first = cube
        .attach(attach_req(lab, "sb-writer"))
        .await
        .map_err(err("Attach"))?;
    std::fs::write(Path::new(&first.host_path).join(BEFORE_FILE), BEFORE_TEXT).unwrap();

    let recovered = if lab.case.scenario == Scenario::Detach {
        let detach = Hook::Detach(detach_request(
            "default",
            "sb-writer",
            VOLUME,
            0,
            &first.metadata,
        ));
        lab.crash(detach.clone(), None).await?;
        // Cube retries the Detach with the same metadata until it succeeds.
        if daemon {
            lab.daemon(None).await?;
        }
        lab.cube()
            .call(detach)
            .await
            .map_err(err("the retried Detach"))?;
        converge(CONVERGE_LIMIT, || async { leftovers(lab) }).await?;
        if daemon {
            format!("restart, then the retried Detach: {}", lab.recovery_calls())
        } else {
            format!("the retried Detach: {}", lab.recovery_calls())
        }
    } else {
        lab.cube()
            .detach(detach_request(
                "default",
                "sb-writer",
                VOLUME,
                0,
                &first.metadata,
            ))
            .await
            .map_err(err("Detach"))?;
        leftovers(lab).map_err(|e| format!("before the crash: {e}"))?;
        let attach = Hook::Attach(attach_req(lab, "sb-crash"));
        if lab.case.scenario == Scenario::AttachAbandoned {
            lab.crash(attach, Some("NodePublishVolume")).await?;
        } else {
            lab.crash(attach, None).await?;
        }
        // Cube never Detaches after a failed Attach: the bridge alone must undo it.
        let who = if daemon {
            lab.daemon(None).await?;
            "start-up reconciliation"
        } else {
            // Any later node hook finishes what killed workers abandoned.
            lab.w
                .binary_caller()
                .detach(detach_request(
                    "default",
                    "sb-other",
                    "other",
                    0,
                    &Default::default(),
                ))
                .await
                .map_err(err("an unrelated Detach"))?;
            "the next node hook"
        };
        converge(CONVERGE_LIMIT, || async { leftovers(lab) }).await?;
        format!("{who}: {}", lab.recovery_calls())
    };
    lab.note(&recovered);

    // Cube attaches the volume again later: the data is intact; then it is detached.
    let again = lab
        .cube()
        .attach(attach_req(lab, "sb-later"))
        .await
        .map_err(err("Attach after recovery"))?;
    let host_path = PathBuf::from(&again.host_path);
    let read = std::fs::read_to_string(host_path.join(BEFORE_FILE)).unwrap_or_default();
    if read != BEFORE_TEXT {
        return Err(format!("{BEFORE_FILE} reads {read:?} after recovery"));
    }
    std::fs::write(host_path.join("after.txt"), "after\n").unwrap();
    lab.cube()
        .detach(detach_request(
            "default",
            "sb-later",
            VOLUME,
            0,
            &again.metadata,
        ))
        .await
        .map_err(err("Detach after recovery"))?;
    leftovers(lab)?;
    let data = lab.w.driver.volume_dir(&lab.csi_volume());
    if !data.join(BEFORE_FILE).is_file() || !data.join("after.txt").is_file() {
        return Err("the volume's files are not all in the driver's data".into());
    }
    lab.expect_controller(true).await?;
    Ok(recovered)
}

fn leftovers(lab: &Lab) -> Result<(), String> {
    let left = lab.node_leftovers(false);
    if left.is_empty() {
        Ok(())
    } else {
        Err(format!("left behind: {}", left.join("; ")))
    }
}

// --- the matrix ---------------------------------------------------------------------------

/// Whether this build can run the matrix; skips (or, in CI, fails) when not.
fn can_run() -> bool {
    if !cfg!(feature = "fault-injection") {
        common::skip(
            "the crash matrix needs the fault-injection points: cargo test --features \
             fault-injection (scripts/test.sh does)",
        );
        return false;
    }
    if !nix::unistd::Uid::effective().is_root() {
        common::skip("the crash matrix makes real mounts and needs root");
        return false;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_crash_point_converges_in_both_transports() {
    if !can_run() {
        return;
    }
    let jobs: usize = std::env::var(JOBS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let started = Instant::now();
    let limit = Arc::new(tokio::sync::Semaphore::new(jobs));
    let only = std::env::var(ONLY_ENV).unwrap_or_default();
    let mut running = Vec::new();
    for case in cases() {
        if !format!("{} {:?}", case.point(), case.transport).contains(&only) {
            continue;
        }
        let limit = limit.clone();
        running.push(tokio::spawn(async move {
            let _permit = limit.acquire().await.unwrap();
            let began = Instant::now();
            let outcome = run_case(case).await;
            (case, outcome, began.elapsed())
        }));
    }
    let mut results = Vec::new();
    for task in running {
        results.push(task.await.expect("a case panicked"));
    }
    results.sort_by_key(|(case, _, _)| *case);

    let table = render(&results);
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("crash-matrix.md");
    std::fs::write(&path, &table).unwrap();
    println!("{table}");
    println!(
        "crash matrix: {} cases in {:.1} s ({jobs} at a time); table in {}",
        results.len(),
        started.elapsed().as_secs_f64(),
        path.display()
    );
    let failures: Vec<String> = results
        .iter()
        .filter_map(|(case, outcome, _)| {
            outcome
                .as_ref()
                .err()
                .map(|e| format!("{} / {:?}: {e}", case.point(), case.transport))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases did not converge:\n\n{}",
        failures.len(),
        results.len(),
        failures.join("\n\n")
    );
}

/// The markdown table: one row per (point, scenario), one column per transport.
fn render(results: &[(Case, Result<String, String>, Duration)]) -> String {
    let mut rows: BTreeMap<(Scenario, usize, When2), BTreeMap<Transport, String>> = BTreeMap::new();
    for (case, outcome, elapsed) in results {
        let cell = match outcome {
            Ok(how) => format!("✔ {how} ({:.1} s)", elapsed.as_secs_f64()),
            Err(e) => format!("✘ {}", e.lines().next().unwrap_or_default()),
        };
        let order = case.scenario.steps().iter().position(|s| *s == case.step);
        rows.entry((
            case.scenario,
            order.expect("a step of its scenario"),
            case.when,
        ))
        .or_default()
        .insert(case.transport, cell.replace('|', "\\|"));
    }
    let mut out = String::from(
        "| point | scenario | kill -9 of `serve` | kill -9 of the forked hook's worker |\n\
         |---|---|---|---|\n",
    );
    for ((scenario, order, when), cells) in rows {
        let step = scenario.steps()[order];
        let point = faults::name(scenario.hook(), when.when(), step);
        let cell = |t: Transport| {
            cells
                .get(&t)
                .cloned()
                .unwrap_or_else(|| "n/a (the daemon's sweep)".into())
        };
        out.push_str(&format!(
            "| `{point}` | {} | {} | {} |\n",
            scenario.describe(),
            cell(Transport::Daemon),
            cell(Transport::Worker)
        ));
    }
    out
}

#[test]
fn the_matrix_names_each_case_once() {
    let all = cases();
    let unique: BTreeSet<_> = all.iter().collect();
    assert_eq!(unique.len(), all.len());
    // Node scenarios need every node step to exist: ControllerPublish and NodeStage.
    assert!(SCENARIOS.iter().any(|s| s.is_node()));
    let caps = Caps::all_steps();
    assert!(caps.stage && caps.controller_publish);
}
