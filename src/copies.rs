//! Operator commands for snapshots and copies of volumes: `snapshot create|list|delete`,
//! `restore` and `clone`, run against the controller side (opened as a Create hook
//! opens it: same store, record key, locks and driver), printed as text or JSON.

use std::fmt::Write as _;
use std::sync::Arc;

use serde::Serialize;

use crate::admin::{Output, printable};
use crate::bridge::ControllerSide;
use crate::bridge::records::{ContentSource, SnapshotRecord, VolumeRecord};
use crate::config::{Config, Roles};
use crate::mount::MountView;

/// The controller side of `config`'s driver, as a forked Create hook opens it.
fn controller(config: Config) -> anyhow::Result<Arc<ControllerSide>> {
    let mounts = Arc::new(MountView::new(&config.node.mount_view, false));
    let bridge = crate::app::open_bridge(Arc::new(config), Roles::CONTROLLER, mounts)?;
    Ok(bridge.controller()?.clone())
}

/// A snapshot as `snapshot create` prints it.
#[derive(Debug, Serialize)]
struct SnapshotView {
    snapshot_id: String,
    source_volume_id: String,
    state: &'static str,
    csi_snapshot_id: Option<String>,
    size_bytes: i64,
    ready_to_use: bool,
    creation_time: u64,
}

impl From<SnapshotRecord> for SnapshotView {
    fn from(r: SnapshotRecord) -> Self {
        Self {
            state: r.state.as_str(),
            snapshot_id: r.snapshot_id,
            source_volume_id: r.source_volume_id,
            csi_snapshot_id: r.csi_snapshot_id,
            size_bytes: r.size_bytes,
            ready_to_use: r.ready_to_use,
            creation_time: r.creation_time,
        }
    }
}

/// A volume made by `restore` or `clone`, as they print it.
#[derive(Debug, Serialize)]
struct CopyView {
    volume_id: String,
    state: &'static str,
    csi_name: String,
    csi_volume_id: Option<String>,
    capacity_bytes: i64,
    content_source: Option<ContentSource>,
}

impl From<VolumeRecord> for CopyView {
    fn from(r: VolumeRecord) -> Self {
        Self {
            state: r.state.as_str(),
            volume_id: r.volume_id,
            csi_name: r.csi_name,
            csi_volume_id: r.csi_volume_id,
            capacity_bytes: r.capacity_bytes,
            content_source: r.content_source,
        }
    }
}

fn json(value: &impl Serialize) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

/// `snapshot create VOLUME_ID --name SNAPSHOT`.
pub async fn create_snapshot(
    config: Config,
    volume_id: &str,
    snapshot_id: &str,
    output: Output,
) -> anyhow::Result<String> {
    let taken = controller(config)?
        .create_snapshot(volume_id, snapshot_id)
        .await?;
    let view = SnapshotView::from(taken);
    if output == Output::Json {
        return json(&view);
    }
    Ok(format!(
        "snapshot {} of volume {}: CSI snapshot {} ({}, {} bytes)\n",
        view.snapshot_id,
        view.source_volume_id,
        view.csi_snapshot_id.as_deref().unwrap_or("-"),
        if view.ready_to_use {
            "ready to use"
        } else {
            "not ready to use yet"
        },
        view.size_bytes
    ))
}

/// `snapshot list`: every snapshot record with what the driver says of it.
pub async fn list_snapshots(config: Config, output: Output) -> anyhow::Result<String> {
    let entries = controller(config)?.list_snapshots().await?;
    if output == Output::Json {
        return json(&entries);
    }
    let mut out = String::from(
        "SNAPSHOT\tSTATE\tVOLUME\tDRIVER_SAYS\tSIZE\tCSI_SNAPSHOT_ID\tRESTORED_INTO\n",
    );
    for e in entries {
        let integrity = if e.integrity == "valid" {
            String::new()
        } else {
            format!(" (integrity: {})", e.integrity)
        };
        let _ = writeln!(
            out,
            "{}\t{}{integrity}\t{}\t{}\t{}\t{}\t{}",
            printable(&e.snapshot_id),
            e.state,
            printable(&e.source_volume_id),
            e.driver_says,
            e.size_bytes,
            printable(e.csi_snapshot_id.as_deref().unwrap_or("-")),
            if e.restored_into.is_empty() {
                "-".to_string()
            } else {
                printable(&e.restored_into.join(",")).into_owned()
            }
        );
    }
    Ok(out)
}

/// `snapshot delete SNAPSHOT`.
pub async fn delete_snapshot(
    config: Config,
    snapshot_id: &str,
    output: Output,
) -> anyhow::Result<String> {
    controller(config)?.delete_snapshot(snapshot_id).await?;
    if output == Output::Json {
        return json(&serde_json::json!({ "deleted": snapshot_id }));
    }
    Ok(format!("deleted snapshot {snapshot_id}\n"))
}

/// `restore SNAPSHOT --as VOLUME_ID`.
pub async fn restore(
    config: Config,
    snapshot_id: &str,
    as_volume_id: &str,
    output: Output,
) -> anyhow::Result<String> {
    let made = controller(config)?
        .restore(snapshot_id, as_volume_id)
        .await?;
    render_copy(made, output)
}

/// `clone VOLUME_ID --as NEW_ID`.
pub async fn clone_volume(
    config: Config,
    volume_id: &str,
    as_volume_id: &str,
    output: Output,
) -> anyhow::Result<String> {
    let made = controller(config)?
        .clone_volume(volume_id, as_volume_id)
        .await?;
    render_copy(made, output)
}

fn render_copy(made: VolumeRecord, output: Output) -> anyhow::Result<String> {
    let view = CopyView::from(made);
    if output == Output::Json {
        return json(&view);
    }
    Ok(format!(
        "volume {} made from {}: CSI volume {}; CubeMaster's Create of {} returns it\n",
        view.volume_id,
        view.content_source
            .as_ref()
            .map_or_else(|| "-".to_string(), ContentSource::describe),
        view.csi_volume_id.as_deref().unwrap_or("-"),
        view.volume_id
    ))
}
