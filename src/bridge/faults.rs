//! Fault-injection points for the crash matrix (tests only).
//!
//! With the `fault-injection` feature, `CUBE_CSI_BRIDGE_CRASH_AT=<hook>:<before|after>:<step>`
//! makes the process SIGKILL itself when it first reaches that point, exactly as a
//! `kill -9` at that instant would; `CUBE_CSI_BRIDGE_CRASH_MARK=<file>`, if set, receives
//! `<pid> <point>` just before, so that a test can tell which process died where (a forked
//! hook's worker is not the test's child). Without the feature the points compile to
//! nothing.

use super::HookKind;

/// Every point a hook can reach: `(hook, when, step)`. tests/crash_matrix.rs crashes at
/// each of them and checks this list against the `point` calls in the source; with the
/// feature on, reaching a point missing here panics (so no test run can pass one by).
pub const POINTS: &[(HookKind, When, &str)] = &{
    use HookKind::*;
    use When::*;
    [
        (Create, Before, "store"),
        (Create, After, "store"),
        (Create, Before, "CreateVolume"),
        (Create, After, "CreateVolume"),
        (Create, Before, "DeleteVolume"),
        (Create, After, "DeleteVolume"),
        (Destroy, Before, "store"),
        (Destroy, After, "store"),
        (Destroy, Before, "CreateVolume"),
        (Destroy, After, "CreateVolume"),
        (Destroy, Before, "DeleteVolume"),
        (Destroy, After, "DeleteVolume"),
        (Attach, Before, "journal"),
        (Attach, After, "journal"),
        (Attach, Before, "ControllerPublishVolume"),
        (Attach, After, "ControllerPublishVolume"),
        (Attach, Before, "NodeStageVolume"),
        (Attach, After, "NodeStageVolume"),
        (Attach, Before, "NodePublishVolume"),
        (Attach, After, "NodePublishVolume"),
        (Attach, Before, "NodeUnpublishVolume"),
        (Attach, After, "NodeUnpublishVolume"),
        (Attach, Before, "NodeUnstageVolume"),
        (Attach, After, "NodeUnstageVolume"),
        (Attach, Before, "ControllerUnpublishVolume"),
        (Attach, After, "ControllerUnpublishVolume"),
        (Detach, Before, "journal"),
        (Detach, After, "journal"),
        (Detach, Before, "NodeUnpublishVolume"),
        (Detach, After, "NodeUnpublishVolume"),
        (Detach, Before, "NodeUnstageVolume"),
        (Detach, After, "NodeUnstageVolume"),
        (Detach, Before, "ControllerUnpublishVolume"),
        (Detach, After, "ControllerUnpublishVolume"),
    ]
};

/// The name of a point, as `CUBE_CSI_BRIDGE_CRASH_AT` spells it.
pub fn name(hook: HookKind, when: When, step: &str) -> String {
    format!("{hook}:{}:{step}", when.as_str())
}

/// Marks a point of `hook` just before or after `step` (a CSI call name, `journal` or
/// `store`).
#[inline(always)]
pub fn point(hook: HookKind, when: When, step: &str) {
    #[cfg(feature = "fault-injection")]
    {
        assert!(
            POINTS.contains(&(hook, when, step)),
            "fault point {} is missing from faults::POINTS",
            name(hook, when, step)
        );
        if let Some(target) = crash_target()
            && target == name(hook, when, step)
        {
            crash(target);
        }
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = (hook, when, step);
    }
}

/// With the feature, `CUBE_CSI_BRIDGE_PAUSE_AFTER_DELIVERY_MS=<ms>` holds a hook that long
/// once its answer was delivered, before it lets go of its volume: the window between the
/// delivery and the reply reaching Cube, made wide enough for a test to land in.
pub async fn pause_after_delivery() {
    pause("CUBE_CSI_BRIDGE_PAUSE_AFTER_DELIVERY_MS").await;
}

/// With the feature, `CUBE_CSI_BRIDGE_PAUSE_BEFORE_DELIVERY_MS=<ms>` holds a hook that long
/// before it hands its answer over (its holder or volume already saved): the window in
/// which a dying worker leaves work Cube never learns of.
pub async fn pause_before_delivery() {
    pause("CUBE_CSI_BRIDGE_PAUSE_BEFORE_DELIVERY_MS").await;
}

async fn pause(variable: &str) {
    #[cfg(feature = "fault-injection")]
    if let Some(ms) = std::env::var(variable).ok().and_then(|ms| ms.parse().ok()) {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    #[cfg(not(feature = "fault-injection"))]
    let _ = variable;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Before,
    After,
}

impl When {
    pub fn as_str(self) -> &'static str {
        match self {
            When::Before => "before",
            When::After => "after",
        }
    }
}

#[cfg(feature = "fault-injection")]
fn crash_target() -> Option<&'static str> {
    static TARGET: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    TARGET
        .get_or_init(|| std::env::var("CUBE_CSI_BRIDGE_CRASH_AT").ok())
        .as_deref()
}

#[cfg(feature = "fault-injection")]
fn crash(target: &str) {
    use std::io::Write;
    let line = format!("{} {target}\n", std::process::id());
    if let Some(mark) = std::env::var_os("CUBE_CSI_BRIDGE_CRASH_MARK") {
        let _ = std::fs::write(mark, &line);
    }
    // Not eprintln!: it panics when nobody reads stderr any more.
    let _ = writeln!(std::io::stderr(), "fault injection: crashing at {target}");
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
}

/// Whether a forked hook must run in place, as it does when it cannot fork its worker
/// (a pids limit) or its process has threads. With the `fault-injection` feature,
/// `CUBE_CSI_BRIDGE_IN_PLACE=1` says so (tests/phantom_holders.rs).
pub fn forced_in_place() -> bool {
    #[cfg(feature = "fault-injection")]
    return std::env::var_os("CUBE_CSI_BRIDGE_IN_PLACE").is_some_and(|v| v == "1");
    #[cfg(not(feature = "fault-injection"))]
    false
}

/// The leaf form a fresh Attach gives its paths. With the `fault-injection` feature,
/// `CUBE_CSI_BRIDGE_LEGACY_LEAF=1` makes it the legacy `<driver>-<volume_id>` of the releases
/// before: a test attaches as they did, then checks an upgraded bridge still serves those
/// volumes (tests/host_path_collision.rs).
pub fn fresh_leaf_form() -> super::naming::LeafForm {
    #[cfg(feature = "fault-injection")]
    {
        static LEGACY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *LEGACY.get_or_init(|| {
            std::env::var_os("CUBE_CSI_BRIDGE_LEGACY_LEAF").is_some_and(|v| v == "1")
        }) {
            return super::naming::LeafForm::Legacy;
        }
    }
    super::naming::LeafForm::Current
}
