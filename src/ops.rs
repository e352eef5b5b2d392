//! Operator commands: check a driver and the host, print Cube registration entries,
//! list what this node has attached.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use crate::bridge::{Bridge, ProcessMode, Roles};
use crate::config::Config;
use crate::csi::{self, CsiClient, Deadline};
use crate::mount::MountTable;
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
    let node = CsiClient::new(&config.csi_endpoint());
    let reachable = match csi::discovery::identity(&node, &deadline).await {
        Ok(id) => {
            let answer = format!(
                "driver {} {} answers at {}",
                id.name,
                id.vendor_version,
                node.endpoint()
            );
            report(true, answer);
            true
        }
        Err(e) => {
            report(false, format!("driver not usable: {e}"));
            false
        }
    };
    let services = config.serve.services;
    let roles = Roles {
        controller: services.controller(),
        node: services.node(),
    };
    let base = config.node.default_volume_base_dir.clone();
    let bridge = Bridge::new(config, roles, ProcessMode::Daemon)?;
    if reachable {
        match bridge.check_driver(roles, &deadline).await {
            Ok(()) => report(
                true,
                format!("driver capabilities fit the served roles ({services:?})"),
            ),
            Err(e) => report(false, e.to_string()),
        }
    }
    if roles.node {
        report(
            true,
            format!("mount checks use {}", bridge.mount_view().describe()),
        );
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
    let socket = config.socket_path();
    let socket = socket.display();
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
    let journal = NodeJournal::open(&config.journal_dir())?;
    let mounts = MountTable::read(None)?;
    let mut out = String::from("VOLUME\tMOUNTED\tPUBLISH\tSTAGE\tHOST_PATH\tHOLDERS\n");
    for record in journal.list()? {
        match record {
            Ok(r) => {
                let _ = writeln!(
                    out,
                    "{}\t{}\t{:?}\t{:?}\t{}\t{}",
                    r.volume_id,
                    mounts.is_mount_point(&r.target_path),
                    r.publish,
                    r.stage,
                    r.target_path.display(),
                    r.holders.iter().cloned().collect::<Vec<_>>().join(",")
                );
            }
            Err(e) => {
                let _ = writeln!(out, "?\t?\t?\t?\t{e}\t");
            }
        }
    }
    Ok(out)
}
