//! Operator commands: check a driver and the host, print Cube registration entries,
//! list what this node has attached.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use std::sync::Arc;

use crate::bridge::Deadline;
use crate::bridge::integrity::Verdict;
use crate::bridge::inventory::{NodeVolume, add_driver_conditions, node_volumes};
use crate::bridge::ports::{ControllerDriver, Segments, describe_topologies};
use crate::config::Config;
use crate::csi::{CsiClient, GrpcDriver};
use crate::mount::{MountTable, MountView};
use crate::store::FileJournal;

/// One finding of `check`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finding {
    pub ok: bool,
    pub what: String,
}

/// Checks the config, the driver and the host: every finding, good or bad.
pub async fn check(config: Config, budget: Duration) -> anyhow::Result<Vec<Finding>> {
    let mut findings = Vec::new();
    let mut report = |ok: bool, what: String| findings.push(Finding { ok, what });
    report(true, format!("config {} is valid", config.source.display()));
    let deadline = Deadline::after(budget);
    let node =
        GrpcDriver::new(CsiClient::new(&config.csi.endpoint).trusting(&config.csi.driver_uids));
    let reachable = match node.identity(&deadline).await {
        Ok(id) => {
            let answer = format!(
                "driver {} {} answers at {}",
                id.name,
                id.vendor_version,
                ControllerDriver::endpoint(&node)
            );
            report(true, answer);
            true
        }
        Err(e) => {
            report(false, format!("driver not usable: {e}"));
            false
        }
    };
    let roles = config.serve.roles;
    let base = config.node.default_volume_base_dir.clone();
    let mounts = Arc::new(MountView::new(&config.node.mount_view, false));
    let dirs = crate::app::host_dirs(&config);
    if reachable {
        // Opened (which claims the state dir for this driver, endpoint and lock dir) only
        // for a driver that answers: a check of a config with a mistyped endpoint must not
        // claim the dir for it, locking out the corrected one.
        let bridge = crate::app::open_bridge(Arc::new(config), roles, mounts.clone())?;
        match bridge.check(&deadline).await {
            Ok(()) => report(
                true,
                format!(
                    "driver capabilities fit the served roles ({})",
                    roles.as_str()
                ),
            ),
            Err(e) => report(false, e.to_string()),
        }
    } else {
        let keeper = match roles.node {
            true => crate::store::owner::Keeper::Node,
            false => crate::store::owner::Keeper::Controller,
        };
        if let Err(e) = crate::app::check_state_dir_to_read(&config, keeper) {
            report(false, e.to_string());
        }
    }
    if roles.node {
        report(true, format!("mount checks use {}", mounts.describe()));
        match propagation_of(&base) {
            Some((mount_point, shared)) => report(
                shared,
                format!(
                    "volume base dir {} lies on mount {} which is {}",
                    base.display(),
                    mount_point,
                    if shared {
                        "shared (mounts propagate to Cubelet)"
                    } else {
                        "NOT shared: mounts made there do not reach Cubelet; run mount --make-rshared on it"
                    }
                ),
            ),
            None => report(
                false,
                format!("volume base dir {} does not exist yet", base.display()),
            ),
        }
        let (ok, what) = prove_visibility(&base, &dirs, mounts.as_ref(), &deadline).await;
        report(ok, what);
    }
    Ok(findings)
}

/// Prints findings as text (`ok  `/`FAIL` lines) or one JSON document.
pub fn render_findings(findings: &[Finding], output: Output) -> String {
    match output {
        Output::Json => {
            let ok = findings.iter().all(|f| f.ok);
            serde_json::json!({ "ok": ok, "findings": findings }).to_string() + "\n"
        }
        Output::Text => findings
            .iter()
            .map(|f| format!("{} {}\n", if f.ok { "ok  " } else { "FAIL" }, f.what))
            .collect(),
    }
}

/// Makes a bind mount under the base dir, as a CSI driver would, and asks the mount view
/// (Cubelet's namespace, when it exists) whether it sees it; then removes it. This is
/// what every Attach depends on, proven before the first sandbox needs it.
async fn prove_visibility(
    base: &Path,
    dirs: &crate::mount::HostDirs,
    mounts: &dyn crate::bridge::ports::MountCheck,
    deadline: &Deadline,
) -> (bool, String) {
    use crate::bridge::ports::Visibility;
    if !nix::unistd::Uid::effective().is_root() {
        return (
            false,
            "propagation not proven: making a test mount needs root".into(),
        );
    }
    let name = format!(".cube-csi-bridge-check-{}", std::process::id());
    let made = dirs.probe_mount(base, &name);
    let verdict = match &made {
        Err(e) => (
            false,
            format!(
                "propagation not proven: cannot make a test mount under {}: {e}",
                base.display()
            ),
        ),
        Ok(probe) => match mounts.visibility(&probe.path, deadline).await {
            Ok(Visibility::Mounted) => (
                true,
                format!(
                    "a test mount under {} is visible in {}",
                    base.display(),
                    mounts.describe()
                ),
            ),
            Ok(Visibility::Unchecked) => (
                true,
                "propagation not checked (node.mount_view = \"none\")".into(),
            ),
            Ok(Visibility::NotMounted) => (
                false,
                format!(
                    "a test mount under {} does NOT show in {}: volumes would be invisible \
                     to sandboxes; make the base dir a shared mount (mount --make-rshared) \
                     or run the bridge as Cubelet's binary plugin",
                    base.display(),
                    mounts.describe()
                ),
            ),
            Err(e) => (
                false,
                format!("propagation not proven: reading {}: {e}", mounts.describe()),
            ),
        },
    };
    if let Ok(probe) = made {
        probe.remove();
    }
    verdict
}

/// The mount point `path` lies on and whether it propagates (is shared).
fn propagation_of(path: &Path) -> Option<(String, bool)> {
    let path = path.canonicalize().ok()?;
    let table = MountTable::read(None).ok()?;
    let (mount_point, shared) = table.mount_of(&path)?;
    Some((mount_point.display().to_string(), shared))
}

/// The CubeMaster and Cubelet entries that register this instance, both ways.
pub fn registration_snippets(config: &Config, binary: &Path) -> String {
    let name = &config.driver;
    let socket = config.socket_path().display();
    let binary = binary.display();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# --- as an rpc plugin (run `cube-csi-bridge serve`) ---"
    );
    let _ = writeln!(out, "# CubeMaster conf.yaml:");
    let _ = writeln!(
        out,
        "volume_plugins:\n  - name: {name}\n    type: rpc\n    socket_path: {socket}\n"
    );
    let _ = writeln!(out, "# Cubelet config.toml:");
    let _ = writeln!(
        out,
        "[[plugins.\"io.cubelet.internal.v1.storage\".volume_plugins]]\n  name = \"{name}\"\n  type = \"rpc\"\n  socket_path = \"{socket}\"\n"
    );
    let _ = writeln!(
        out,
        "# --- as a binary plugin (Cube forks the executable per hook) ---"
    );
    let _ = writeln!(
        out,
        "# Config lookup: $CUBE_CSI_BRIDGE_CONFIG, else /etc/cube-csi-bridge/<name>.toml when the\n\
         # executable is a symlink named cube-csi-bridge-<name>:\n\
         #   ln -s {binary} /usr/local/bin/cube-csi-bridge-{name}"
    );
    let _ = writeln!(out, "# CubeMaster conf.yaml:");
    let _ = writeln!(
        out,
        "volume_plugins:\n  - name: {name}\n    type: binary\n    binary_path: /usr/local/bin/cube-csi-bridge-{name}\n"
    );
    let _ = writeln!(out, "# Cubelet config.toml:");
    let _ = writeln!(
        out,
        "[[plugins.\"io.cubelet.internal.v1.storage\".volume_plugins]]\n  name = \"{name}\"\n  type = \"binary\"\n  binary_path = \"/usr/local/bin/cube-csi-bridge-{name}\""
    );
    out
}

/// How `list` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// `list` over the drivers of one file: one driver prints as it always has; several print
/// one section each (text) or one object keyed by driver name (JSON).
pub async fn list_drivers(
    configs: &[Config],
    controller: bool,
    output: Output,
) -> anyhow::Result<String> {
    async fn one(config: &Config, controller: bool, output: Output) -> anyhow::Result<String> {
        if controller {
            list_controller(config, output).await
        } else {
            list(config, output).await
        }
    }
    if let [config] = configs {
        return one(config, controller, output).await;
    }
    let mut text = String::new();
    let mut json = serde_json::Map::new();
    for config in configs {
        let listed = one(config, controller, output)
            .await
            .map_err(|e| e.context(format!("driver {}", config.driver)))?;
        match output {
            Output::Text => {
                let _ = write!(text, "== driver {} ==\n{listed}", config.driver);
            }
            Output::Json => {
                json.insert(config.driver.clone(), serde_json::from_str(&listed)?);
            }
        }
    }
    if output == Output::Json {
        text = serde_json::to_string_pretty(&json)? + "\n";
    }
    Ok(text)
}

/// For a file listing several drivers: the systemd drop-in that makes the template
/// socket unit of the file's instance (`cube-csi-bridge@<file stem>`, whose service reads
/// `/etc/cube-csi-bridge/<file stem>.toml`) listen on every driver's socket. The daemon
/// tells the passed sockets apart by the path each is bound at.
pub fn systemd_socket_drop_in(configs: &[Config]) -> String {
    let instance = configs
        .first()
        .and_then(|c| c.source.file_stem())
        .map_or_else(|| "config".into(), |s| s.to_string_lossy().into_owned());
    let mut out = format!(
        "# --- systemd: one daemon for every driver of this file ---\n\
         # The instance is named after the file: cube-csi-bridge@{instance}.service serves\n\
         # /etc/cube-csi-bridge/{instance}.toml. Its socket unit listens on every driver's socket\n\
         # with this drop-in, /etc/systemd/system/cube-csi-bridge@{instance}.socket.d/drivers.conf:\n\
         [Socket]\n\
         ListenStream=\n"
    );
    for config in configs {
        let _ = writeln!(out, "ListenStream={}", config.socket_path().display());
    }
    out
}

/// `holders release`: the node side, opened as a hook opens it, releases the holders
/// `which` names (see `NodeSide::release_holders`).
pub async fn release_holders(
    config: Config,
    volume_id: &str,
    which: &crate::bridge::Release,
) -> anyhow::Result<String> {
    crate::bridge::naming::validate_volume_id(volume_id).map_err(anyhow::Error::msg)?;
    let mounts = Arc::new(MountView::new(&config.node.mount_view, false));
    let bridge = crate::app::open_bridge(Arc::new(config), crate::config::Roles::NODE, mounts)?;
    let released = bridge.node()?.release_holders(volume_id, which).await?;
    tracing::warn!(
        volume_id,
        released = ?released.holders,
        torn_down = released.torn_down,
        "holders released by the operator"
    );
    Ok(format!(
        "released {} of volume {volume_id}; {}\n",
        released.holders.join(", "),
        if released.torn_down {
            "no holder is left: the volume was detached from this node"
        } else {
            "other holders remain: the volume stays attached"
        }
    ))
}

/// This node's volumes (the node journal joined with the mount table), their holders
/// judged for age and staleness.
async fn judged_volumes(config: &Config) -> anyhow::Result<Vec<NodeVolume>> {
    use crate::bridge::ports::NodeJournal;
    // Checked as `serve` checks it before anything in it is opened (opening the journal
    // recovers its intent log, which writes), and read only if it is this bridge's.
    if !crate::app::check_state_dir_to_read(config, crate::store::owner::Keeper::Node)? {
        return Ok(Vec::new());
    }
    let journal = FileJournal::open(&config.state.journal_dir())?;
    let mounts = MountView::new(&config.node.mount_view, false);
    let mut volumes = node_volumes(&journal, &mounts).await?;
    crate::bridge::staleness::judge_holders(
        &mut volumes,
        &journal.kept_last_hooks()?,
        crate::system::now_secs(),
        config.node.stale_holder_after,
    );
    Ok(volumes)
}

/// The HOLDERS column of `list`: `namespace/sandbox(age)`, `(age STALE)` when its
/// namespace has gone quiet, `(?)` when the age is unknown.
fn holders_column(volume: &NodeVolume) -> Vec<String> {
    volume
        .holder_ages
        .iter()
        .map(|h| {
            let age = h.age_secs.map_or_else(|| "?".to_string(), duration);
            let stale = if h.stale { " STALE" } else { "" };
            format!("{}/{}({age}{stale})", h.namespace, h.sandbox)
        })
        .collect()
}

/// `holders list` over the drivers of one file: one driver prints as it always has;
/// several print one section each (text) or one object keyed by driver name (JSON). A
/// volume id need only be in one driver's journal.
pub async fn list_holders_drivers(
    configs: &[Config],
    volume_id: Option<&str>,
    output: Output,
) -> anyhow::Result<String> {
    if let Some(volume_id) = volume_id {
        crate::bridge::naming::validate_volume_id(volume_id).map_err(anyhow::Error::msg)?;
    }
    let mut listed = Vec::new();
    for config in configs {
        let volumes: Vec<NodeVolume> = judged_volumes(config)
            .await
            .map_err(|e| e.context(format!("driver {}", config.driver)))?
            .into_iter()
            .filter(|v| volume_id.is_none_or(|id| v.volume_id == id))
            .collect();
        listed.push((config.driver.as_str(), volumes));
    }
    if let Some(volume_id) = volume_id
        && listed.iter().all(|(_, volumes)| volumes.is_empty())
    {
        anyhow::bail!("volume {volume_id:?} has no node journal record here");
    }
    if let [(_, volumes)] = listed.as_slice() {
        return render_holders(volumes, output);
    }
    let mut text = String::new();
    let mut json = serde_json::Map::new();
    for (driver, volumes) in &listed {
        let rendered = render_holders(volumes, output)?;
        match output {
            Output::Text => {
                let _ = write!(text, "== driver {driver} ==\n{rendered}");
            }
            Output::Json => {
                json.insert(driver.to_string(), serde_json::from_str(&rendered)?);
            }
        }
    }
    if output == Output::Json {
        text = serde_json::to_string_pretty(&json)? + "\n";
    }
    Ok(text)
}

/// `holders list` of one driver's volumes: every holder with when it was added, how long
/// its namespace has made no hook, and whether that makes it stale.
fn render_holders(volumes: &[NodeVolume], output: Output) -> anyhow::Result<String> {
    if output == Output::Json {
        let holders: Vec<_> = volumes
            .iter()
            .flat_map(|v| {
                v.holder_ages.iter().map(|h| {
                    let mut entry = serde_json::to_value(h).expect("plain fields");
                    entry["volume_id"] = v.volume_id.clone().into();
                    entry
                })
            })
            .collect();
        return Ok(serde_json::to_string_pretty(&holders)? + "\n");
    }
    let now = crate::system::now_secs();
    let mut out = String::from("VOLUME\tNAMESPACE\tSANDBOX\tAGE\tNAMESPACE_QUIET\tSTALE\n");
    for v in volumes {
        if v.holders_unknown {
            let _ = writeln!(out, "{}\t?\tUNKNOWN\t?\t?\t-", v.volume_id);
        }
        for h in &v.holder_ages {
            let _ = writeln!(
                out,
                "{}\t{}\t{}\t{}\t{}\t{}",
                v.volume_id,
                h.namespace,
                h.sandbox,
                h.age_secs.map_or_else(|| "?".to_string(), duration),
                h.namespace_last_hook
                    .map_or_else(|| "?".to_string(), |at| duration(now.saturating_sub(at))),
                if h.stale { "STALE" } else { "-" }
            );
        }
    }
    Ok(out)
}

/// This node's volumes: the node journal joined with the mount table.
pub async fn list(config: &Config, output: Output) -> anyhow::Result<String> {
    let mut volumes = judged_volumes(config).await?;
    // The driver's VolumeCondition of the volumes whose mount answers, when it reports
    // one; a driver that is down leaves the column to the mount check.
    if volumes
        .iter()
        .any(|v| v.condition == Some(crate::bridge::inventory::Condition::Normal))
    {
        let driver =
            GrpcDriver::new(CsiClient::new(&config.csi.endpoint).trusting(&config.csi.driver_uids));
        add_driver_conditions(&mut volumes, &driver).await;
    }
    if output == Output::Json {
        return Ok(serde_json::to_string_pretty(&volumes)? + "\n");
    }
    let mut out = String::from(
        "VOLUME\tMOUNT\tCONDITION\tPUBLISH\tSTAGE\tSINCE\tHOST_PATH\tHOLDERS\tATTACHABLE_ON\n",
    );
    for v in volumes {
        if let Some(error) = &v.error {
            let _ = writeln!(out, "{}\t?\t?\t?\t?\t?\t{error}\t", v.volume_id);
            continue;
        }
        let mut holders = holders_column(&v);
        if v.holders_unknown {
            // Its record was lost: others may hold it too (see docs/reliability.md).
            holders.insert(0, "UNKNOWN".into());
        }
        let condition = v
            .condition
            .as_ref()
            .map_or_else(|| "-".to_string(), |c| c.as_column());
        let _ = writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            v.volume_id,
            v.mount,
            condition,
            v.publish,
            v.stage,
            age(v.since),
            v.host_path.display(),
            holders.join(","),
            describe_topologies(&v.accessible_topology)
        );
    }
    Ok(out)
}

/// One controller record, as `list --controller` shows it.
#[derive(Debug, serde::Serialize)]
struct ControllerEntry {
    volume_id: String,
    state: &'static str,
    /// What the record's MAC says under the record key: `valid`, `unsigned` (written
    /// before records carried one, or stripped), `mismatch` (forged or damaged: Destroy
    /// and the sweep refuse it), `no key` (none made yet), `key error` (the key could not
    /// be read: the listing says why).
    integrity: &'static str,
    csi_name: String,
    csi_volume_id: Option<String>,
    csi_driver: Option<String>,
    age_secs: u64,
    /// What `restore` or `clone` made it from: `snapshot:<name>` or `volume:<id>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    made_from: Option<String>,
    /// Where the volume can be attached: CreateVolume's accessible_topology (empty: on
    /// every node).
    accessible_topology: Vec<Segments>,
    /// The recorded capacity (0 = unknown): while creating, what CreateVolume asks for;
    /// then CreateVolume's answer, then what `expand` grew it to.
    capacity_bytes: i64,
    /// Nodes still grow it to `capacity_bytes` (NodeExpandVolume) where it is attached.
    node_expansion_required: bool,
}

/// The controller store's records: state, age and CSI handle of every Cube volume, so
/// that leaks (a `created` volume Cube no longer knows) can be found and cleaned by hand.
pub async fn list_controller(config: &Config, output: Output) -> anyhow::Result<String> {
    let kube = config
        .uses_kubernetes()
        .then(|| Arc::new(crate::k8s::Kube::new(&config.kubernetes)));
    // An embedded store is opened (and its dir claimed) only where one is, and this
    // bridge's: a listing changes nothing.
    if config.state.controller_store == crate::config::ControllerStoreKind::Embedded
        && (!crate::app::check_state_dir_to_read(config, crate::store::owner::Keeper::Controller)?
            || !config.state.store_path().exists())
    {
        return Ok(match output {
            Output::Json => "[]\n".to_string(),
            Output::Text => format!(
                "no controller store at {}: nothing recorded\n",
                config.state.store_path().display()
            ),
        });
    }
    let store = crate::app::controller_store(config, kube.as_ref())?;
    // The key is read, never made here. A key that cannot be read (a
    // pinned key missing or replaced, no right to read it) is when the listing is needed
    // most: the records are listed all the same, their integrity unknown, and why said.
    let (key, key_error) = match crate::app::record_key_source(config, kube.as_ref())
        .read()
        .await
    {
        Ok(key) => (key, None),
        Err(error) => (None, Some(error.to_string())),
    };
    let now = crate::system::now_secs();
    let mut entries: Vec<ControllerEntry> = store
        .list()
        .await?
        .into_iter()
        .map(|r| ControllerEntry {
            integrity: match key.as_ref().map(|key| key.verify(&config.driver, &r)) {
                None if key_error.is_some() => "key error",
                None => "no key",
                Some(Verdict::Valid) => "valid",
                Some(Verdict::Unsigned) => "unsigned",
                Some(Verdict::Mismatch) => "mismatch",
            },
            state: r.state.as_str(),
            age_secs: now.saturating_sub(r.updated_at),
            made_from: r.content_source.as_ref().map(|s| s.describe()),
            volume_id: r.volume_id,
            csi_name: r.csi_name,
            csi_volume_id: r.csi_volume_id,
            csi_driver: r.csi_driver,
            accessible_topology: r.accessible_topology,
            capacity_bytes: r.capacity_bytes,
            node_expansion_required: r.node_expansion_required,
        })
        .collect();
    entries.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
    if output == Output::Json {
        return Ok(serde_json::to_string_pretty(&entries)? + "\n");
    }
    let mut out = format!("# {}\n", store.describe());
    if let Some(error) = &key_error {
        let _ = writeln!(
            out,
            "# the record key could not be read: {}",
            printable(error)
        );
    }
    out.push_str(
        "VOLUME\tSTATE\tAGE\tCSI_VOLUME_ID\tCSI_NAME\tCAPACITY\tATTACHABLE_ON\tINTEGRITY\n",
    );
    for e in entries {
        let _ = writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            printable(&e.volume_id),
            e.state,
            age(now.saturating_sub(e.age_secs)),
            printable(e.csi_volume_id.as_deref().unwrap_or("-")),
            printable(&e.csi_name),
            match e.capacity_bytes {
                0 => "-".to_string(),
                bytes => crate::bridge::expansion::human_size(bytes),
            },
            printable(&describe_topologies(&e.accessible_topology)),
            e.integrity
        );
    }
    Ok(out)
}

/// A stored value for a terminal: as it is, or quoted with its control characters
/// escaped when it has any. Whoever writes the records (a CubeVolume writer) must not
/// forge rows with a newline or a tab, or move the operator's cursor with an escape.
pub(crate) fn printable(value: &str) -> std::borrow::Cow<'_, str> {
    if value.chars().any(char::is_control) {
        format!("{value:?}").into()
    } else {
        value.into()
    }
}

/// `3d4h`, `5m`, … since `since` (seconds since the epoch); `-` when unknown.
fn age(since: u64) -> String {
    if since == 0 {
        return "-".into();
    }
    duration(crate::system::now_secs().saturating_sub(since))
}

/// `3d4h`, `5m`, `12s`: `secs` as a person reads it.
fn duration(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        s => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `expand`: the sides this instance serves, opened as the daemon opens them, grow the
/// volume (see `Bridge::expand`); text or one JSON object.
pub async fn expand(
    config: Config,
    volume_id: &str,
    size: u64,
    output: Output,
) -> anyhow::Result<String> {
    use crate::bridge::expansion::{NodeExpansion, human_size};
    crate::bridge::naming::validate_volume_id(volume_id).map_err(anyhow::Error::msg)?;
    let roles = config.serve.roles;
    let mounts = Arc::new(MountView::new(&config.node.mount_view, false));
    let bridge = crate::app::open_bridge(Arc::new(config), roles, mounts)?;
    let report = bridge.expand(volume_id, size).await?;
    tracing::info!(volume_id, size, report = ?report, "volume expanded by the operator");
    if output == Output::Json {
        return Ok(serde_json::to_string_pretty(&report)? + "\n");
    }
    let mut out = String::new();
    match &report.controller {
        Some(c) => {
            let how = if c.controller_expanded {
                "ControllerExpandVolume"
            } else if c.previous_bytes == c.capacity_bytes {
                "already that size"
            } else {
                "recorded for NodeExpandVolume"
            };
            let _ = writeln!(
                out,
                "volume {volume_id}: {} -> {} ({} bytes; {how}; {} expansion)",
                match c.previous_bytes {
                    0 => "unknown".to_string(),
                    bytes => human_size(bytes),
                },
                human_size(c.capacity_bytes),
                c.capacity_bytes,
                c.expansion.as_str()
            );
        }
        None => {
            let _ = writeln!(
                out,
                "volume {volume_id}: this instance does not serve the controller role; \
                 growing it on this node only, to {} ({size} bytes)",
                human_size(size as i64)
            );
        }
    }
    let node_line = match &report.node {
        None => "this node: not served here (no node role); node daemons or a run of \
                 `expand` on each node grow it where it is attached"
            .to_string(),
        Some(NodeExpansion::Expanded {
            volume_path,
            capacity_bytes,
        }) => format!(
            "this node: NodeExpandVolume grew it at {} to {}",
            volume_path.display(),
            human_size(*capacity_bytes)
        ),
        Some(NodeExpansion::AlreadyExpanded { capacity_bytes }) => format!(
            "this node: already grown to {}",
            human_size(*capacity_bytes)
        ),
        Some(NodeExpansion::NotAttached) => "this node: not attached here; other nodes \
             where it is attached grow it (their daemon in Kubernetes mode, else run `expand` \
             there)"
            .to_string(),
        Some(NodeExpansion::NotRequired) => {
            "nodes: nothing to do (the driver needs no NodeExpandVolume)".to_string()
        }
        Some(NodeExpansion::Unsupported) => "this node: the driver's node service lacks \
             EXPAND_VOLUME; nothing to do here"
            .to_string(),
    };
    let _ = writeln!(out, "{node_line}");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MountViewSetting;
    use crate::mount::{BaseDirPolicy, HostDirs};
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn node_config(tmp: &Path, driver: &str) -> Config {
        let d = tmp.display();
        Config::parse(
            &format!(
                "driver = \"{driver}\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\n\
                 dir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n[node]\n\
                 default_volume_base_dir = \"{d}/vol\"\nmount_view = \"none\"\n"
            ),
            Path::new("/test.toml"),
        )
        .unwrap()
    }

    /// `list` reads the node journal only from a state dir `serve` would accept, and only
    /// if it is this bridge's: before, it opened (and recovered, which writes) whatever
    /// was there.
    #[tokio::test]
    async fn listing_checks_the_state_dir_as_serve_does_and_writes_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let config = node_config(tmp.path(), "fk");
        // None yet: nothing recorded, and nothing made.
        assert!(list(&config, Output::Json).await.is_ok());
        assert!(!tmp.path().join("state").exists());
        // One others may write.
        std::fs::create_dir(tmp.path().join("state")).unwrap();
        std::fs::set_permissions(
            tmp.path().join("state"),
            std::fs::Permissions::from_mode(0o777),
        )
        .unwrap();
        let refused = list(&config, Output::Text).await.unwrap_err().to_string();
        assert!(refused.contains("state.dir"), "{refused}");
        assert!(
            !tmp.path().join("state/node").exists(),
            "opened the journal"
        );
        // Another bridge's.
        std::fs::set_permissions(
            tmp.path().join("state"),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        let mounts = std::sync::Arc::new(MountView::new(&MountViewSetting::Unchecked, false));
        crate::app::open_hot_node(&node_config(tmp.path(), "other"), mounts).unwrap();
        let refused = list(&config, Output::Text).await.unwrap_err().to_string();
        assert!(refused.contains("another bridge"), "{refused}");
    }

    /// A check of a config whose driver does not answer (a mistyped endpoint) claims no
    /// state dir for it: before, the claim locked the corrected config out ("belongs to
    /// another bridge"). A listing of a controller store makes none.
    #[tokio::test]
    async fn a_check_or_listing_on_bad_input_claims_and_makes_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("state")).unwrap();
        std::fs::set_permissions(
            tmp.path().join("state"),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        let config = node_config(tmp.path(), "fk");
        let findings = check(config.clone(), Duration::from_millis(200))
            .await
            .unwrap();
        assert!(findings.iter().any(|f| !f.ok), "{findings:?}");
        let left = || -> Vec<_> {
            std::fs::read_dir(tmp.path().join("state"))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect()
        };
        assert!(left().is_empty(), "check: {:?}", left());
        let listed = list_controller(&config, Output::Text).await.unwrap();
        assert!(listed.contains("nothing recorded"), "{listed}");
        assert!(left().is_empty(), "list --controller: {:?}", left());
    }

    /// A link planted at the intent log is never followed: recovery would truncate what
    /// it leads to.
    #[test]
    fn the_intent_log_is_never_opened_through_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        let records = tmp.path().join("node");
        std::fs::create_dir_all(records.join("intents")).unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        symlink(&victim, records.join("intents/log")).unwrap();
        assert!(crate::store::FileJournal::open(&records).is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    }

    /// `list --controller` shows whether each record's MAC holds, and a stored value with
    /// control characters (written by whoever may write CubeVolumes) quoted and escaped:
    /// no forged row, no terminal escape. Before, the record below printed as an ordinary
    /// leak, on two rows, with an escape that erased the line.
    #[tokio::test]
    async fn listing_the_controller_store_shows_integrity_and_escapes_stored_values() {
        use crate::bridge::records::{VolumeRecord, VolumeState};
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().display();
        let config = Config::parse(
            &format!(
                "driver = \"fk\"\n[csi]\nendpoint = \"/unused.sock\"\n[state]\n\
                 dir = \"{d}/state\"\nlock_dir = \"{d}/locks\"\n"
            ),
            Path::new("/test.toml"),
        )
        .unwrap();
        let forged = VolumeRecord {
            volume_id: "victim".into(),
            csi_name: "cube-victim".into(),
            state: VolumeState::Created,
            csi_volume_id: Some("h\nforged\tcreated\x1b[2K".into()),
            volume_context: Default::default(),
            capacity_bytes: 0,
            updated_at: 1,
            csi_driver: None,
            deletion: None,
            revision: None,
            integrity: None,
            content_source: None,
            accessible_topology: Vec::new(),
            node_expansion_required: false,
            answering_creates: Vec::new(),
        };
        crate::app::controller_store(&config, None)
            .unwrap()
            .put(&mut forged.clone())
            .await
            .unwrap();
        let text = list_controller(&config, Output::Text).await.unwrap();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(!text.contains('\x1b'), "{text}");
        let row = text.lines().last().unwrap();
        assert!(row.ends_with("\tno key"), "{row}");
        let json = list_controller(&config, Output::Json).await.unwrap();
        assert!(json.contains("\"integrity\": \"no key\""), "{json}");
        // A key that cannot be read (here: not one the bridge made) is when the listing
        // is needed most: the records are listed all the same, and why is said.
        std::fs::write(tmp.path().join("state/record.key"), "not a key\n").unwrap();
        let text = list_controller(&config, Output::Text).await.unwrap();
        assert!(
            text.contains("# the record key could not be read"),
            "{text}"
        );
        assert!(
            text.lines().last().unwrap().ends_with("\tkey error"),
            "{text}"
        );
    }

    /// Needs root (CI runs it as root). `check`'s test mount is made only on directories
    /// it has just made in a base dir that passes the hooks' check: names planted in the
    /// base dir (its pid is known before the mount) never get a directory of root's
    /// covered, whatever the base dir policy.
    #[tokio::test]
    async fn the_check_mount_never_covers_a_directory_planted_in_the_base_dir() {
        if !crate::testing::as_root("mount") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        let evil = tmp.path().join("evil");
        std::fs::create_dir(&victim).unwrap();
        std::fs::create_dir(&evil).unwrap();
        std::fs::write(victim.join("orig"), "").unwrap();
        std::fs::write(evil.join("marker"), "").unwrap();
        let base = tmp.path().join("base");
        std::fs::create_dir(&base).unwrap();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o777)).unwrap();
        let name = format!(".cube-csi-bridge-check-{}", std::process::id());
        symlink(&victim, base.join(&name)).unwrap();
        symlink(&evil, base.join(format!("{name}.src"))).unwrap();
        let mounts = MountView::new(&MountViewSetting::Own, false);
        let deadline = Deadline::after(Duration::from_secs(10));
        let policies = [
            BaseDirPolicy::Strict,
            BaseDirPolicy::AnyOwner {
                reason: "a test".into(),
            },
        ];
        for policy in policies {
            let dirs = HostDirs::new(policy.clone());
            let (ok, what) = prove_visibility(&base, &dirs, &mounts, &deadline).await;
            let covered = victim.join("marker").exists();
            if covered {
                let _ = crate::mount::ops::unmount_lazy(&victim);
            }
            assert!(
                !covered,
                "{policy:?}: the check mounted over {}",
                victim.display()
            );
            assert!(!ok, "{policy:?}: {what}");
            assert!(victim.join("orig").exists());
            assert!(
                base.join(&name).is_symlink(),
                "{policy:?}: removed what it did not make"
            );
        }
        // A base dir that passes: the test mount is made, seen and removed.
        let good = tmp.path().join("good");
        std::fs::create_dir(&good).unwrap();
        let (ok, what) = prove_visibility(&good, &HostDirs::default(), &mounts, &deadline).await;
        assert!(ok, "{what}");
        assert_eq!(std::fs::read_dir(&good).unwrap().count(), 0, "left behind");
    }
}
