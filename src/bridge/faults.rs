//! Fault-injection points for the crash matrix (tests only).
//!
//! With the `fault-injection` feature, `CUBE_CSI_BRIDGE_CRASH_AT=<hook>:<before|after>:<step>`
//! makes the process SIGKILL itself when it reaches that point, exactly as a `kill -9`
//! at that instant would. Without the feature the points compile to nothing.

/// Marks a point of `hook` just before or after `step` (a CSI call name, `journal` or
/// `store`).
#[inline(always)]
pub fn point(hook: super::HookKind, when: When, step: &str) {
    #[cfg(feature = "fault-injection")]
    {
        if let Some(target) = crash_target()
            && target == format!("{hook}:{}:{step}", when.as_str())
        {
            // Not eprintln!: it panics when nobody reads stderr any more.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "fault injection: crashing at {target}");
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = (hook, when, step);
    }
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
