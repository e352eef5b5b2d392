//! The bridge's error: what went wrong in one hook, with the hook and the volume.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::ports::{DeadMount, DriverError, JournalError, PathError, SettingsError, StoreError};

/// The four Cube hooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HookKind {
    Create,
    Destroy,
    Attach,
    Detach,
}

impl HookKind {
    pub const ALL: [HookKind; 4] = [
        HookKind::Create,
        HookKind::Destroy,
        HookKind::Attach,
        HookKind::Detach,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            HookKind::Create => "create",
            HookKind::Destroy => "destroy",
            HookKind::Attach => "attach",
            HookKind::Detach => "detach",
        }
    }

    /// Create and Destroy come from CubeMaster; Attach and Detach from Cubelet.
    pub fn is_node(self) -> bool {
        matches!(self, HookKind::Attach | HookKind::Detach)
    }

    /// The hook named `name` (as Cube's `--op` spells it).
    pub fn parse(name: &str) -> Result<Self, String> {
        HookKind::ALL
            .into_iter()
            .find(|k| k.as_str() == name)
            .ok_or_else(|| format!("{name:?} is not one of create, destroy, attach, detach"))
    }
}

impl fmt::Display for HookKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a hook failed.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// The request itself is wrong; nothing was changed.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A CSI call failed (the message names the call and carries the driver's words).
    #[error(transparent)]
    Driver(Box<DriverError>),
    /// The driver, the state or the setup cannot do what was asked (capabilities,
    /// configuration, a record that does not fit).
    #[error("{0}")]
    Precondition(String),
    /// NodePublishVolume succeeded but the mount is not where Cubelet looks.
    #[error(
        "{path} is not a mount point in {view} although NodePublishVolume succeeded: the \
         mount did not propagate there. Make the volume base dir a shared mount on the \
         host (mount --make-rshared), run the CSI node plugin in the host mount namespace \
         or with the base dir mounted Bidirectional, or fork the bridge from Cubelet as a \
         binary plugin"
    )]
    NotVisible { path: PathBuf, view: String },
    /// NodeUnpublish/NodeUnstage answered OK but the path is still mounted.
    #[error("{path} is still mounted after CSI {call} reported success")]
    StillMounted { path: PathBuf, call: &'static str },
    /// The volume's mount was dead (its filesystem no longer answers) and repairing it
    /// failed at `step`: by `error`, or because it still did not answer afterwards.
    #[error(
        "{path} is mounted but its filesystem does not answer ({dead}); repairing it \
         (unpublish, unstage, stage, publish) failed {step}{}",
        error.as_ref().map(|e| format!(": {e}")).unwrap_or_default()
    )]
    DeadMount {
        path: PathBuf,
        dead: DeadMount,
        step: &'static str,
        error: Option<Box<BridgeError>>,
    },
    /// Another hook on the same volume did not finish in time.
    #[error("another operation on this volume still held its lock after {waited:.1?}")]
    Busy { waited: Duration },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// Reading the volume settings (a StorageClass or its Secrets) failed.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// A path under the volume base dir was refused (not what the bridge made, or a base
    /// dir others can write), or could not be checked.
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The hook failed, and undoing its partial work failed too.
    #[error("{error}; undoing the partial work also failed: {rollback}")]
    RollbackFailed {
        error: Box<BridgeError>,
        rollback: Box<BridgeError>,
    },
    /// The caller stopped waiting; the hook undid its own work.
    #[error("the caller stopped waiting; the partial work was undone")]
    CallerGone,
    /// The side that answers this hook does not serve in this process (not one of its
    /// roles, or it failed to open: the message says which).
    #[error("{0}")]
    Unavailable(String),
}

impl From<DriverError> for BridgeError {
    fn from(error: DriverError) -> Self {
        BridgeError::Driver(Box::new(error))
    }
}

impl BridgeError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        BridgeError::Io {
            context: context.into(),
            source,
        }
    }

    /// A short, stable name of the kind of failure (a metrics label).
    pub fn kind(&self) -> &'static str {
        match self {
            BridgeError::InvalidRequest(_) => "invalid_request",
            BridgeError::Driver(_) => "driver_error",
            BridgeError::Precondition(_) => "precondition",
            BridgeError::NotVisible { .. } => "not_visible",
            BridgeError::StillMounted { .. } => "still_mounted",
            BridgeError::DeadMount { .. } => "dead_mount",
            BridgeError::Busy { .. } => "busy",
            BridgeError::Store(_) => "store_error",
            BridgeError::Journal(_) => "journal_error",
            BridgeError::Settings(_) => "settings_error",
            BridgeError::Path(PathError::Refused { .. }) => "path_refused",
            BridgeError::Path(PathError::Io { .. }) | BridgeError::Io { .. } => "io_error",
            BridgeError::RollbackFailed { .. } => "rollback_failed",
            BridgeError::CallerGone => "caller_gone",
            BridgeError::Unavailable(_) => "unavailable",
        }
    }

    /// A driver error that may mean the driver is still working on the call.
    pub fn is_uncertain_driver_error(&self) -> bool {
        matches!(self, BridgeError::Driver(e) if e.is_uncertain())
    }
}

/// A failed hook: which hook, which volume, and why. This is what Cube sees.
#[derive(Debug)]
pub struct HookError {
    pub hook: HookKind,
    pub volume_id: String,
    pub error: BridgeError,
}

impl fmt::Display for HookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of volume {}: {}",
            self.hook,
            super::naming::quote_volume_id(&self.volume_id),
            self.error
        )
    }
}

impl std::error::Error for HookError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
