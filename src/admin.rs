//! Operator commands: check a driver and the host, print Cube registration entries,
//! list what this node has attached.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use std::sync::Arc;

use crate::bridge::Deadline;
use crate::bridge::ports::ControllerDriver;
use crate::config::Config;
use crate::csi::{CsiClient, GrpcDriver};
use crate::mount::{MountTable, MountView};
use crate::store::NodeJournal;

/// Checks the config, the driver and the host; prints a line per finding. Returns
/// whether everything needed is in place.
pub async fn check(config: Config, budget: Duration) -> anyhow::Result<bool> {
    let mut ok = true;
    let mut report = |good: bool, what: String| {
        println!("{} {what}", if good { "ok  " } else { "FAIL" });
        ok &= good;
    };
    report(true, format!("config {} is valid", config.source.display()));
    let deadline = Deadline::after(budget);
    let node = GrpcDriver::new(CsiClient::new(&config.csi.endpoint));
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
    let bridge = crate::app::open_bridge(Arc::new(config), roles, mounts.clone())?;
    if reachable {
        match bridge.check_driver(&deadline).await {
            Ok(()) => report(
                true,
                format!(
                    "driver capabilities fit the served roles ({})",
                    roles.as_str()
                ),
            ),
            Err(e) => report(false, e.to_string()),
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
    }
    Ok(ok)
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

/// A table of the node journal: one line per attached volume.
pub fn list(config: &Config) -> anyhow::Result<String> {
    let journal = NodeJournal::open(&config.state.journal_dir())?;
    let mounts = MountTable::read(None)?;
    let mut out = String::from("VOLUME\tMOUNTED\tPUBLISH\tSTAGE\tHOST_PATH\tHOLDERS\n");
    for volume_id in journal.volume_ids()? {
        match journal.load(&volume_id) {
            Ok(Some(r)) => {
                let holders: Vec<String> = r
                    .holders
                    .iter()
                    .flat_map(|(ns, sandboxes)| {
                        let ns = ns.clone();
                        sandboxes.iter().map(move |sb| format!("{ns}/{sb}"))
                    })
                    .collect();
                let _ = writeln!(
                    out,
                    "{}\t{}\t{}\t{}\t{}\t{}",
                    r.volume_id,
                    mounts.is_mount_point(&r.target_path),
                    r.publish.as_str(),
                    r.stage.as_str(),
                    r.target_path.display(),
                    holders.join(",")
                );
            }
            Ok(None) => {}
            Err(e) => {
                let _ = writeln!(out, "{volume_id}\t?\t?\t?\t{e}\t");
            }
        }
    }
    Ok(out)
}
