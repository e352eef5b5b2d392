//! The bridge's error: what went wrong in one hook, with the hook and the volume.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::csi::CsiError;
use crate::store::StoreError;

/// The four Cube hooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookKind {
    Create,
    Destroy,
    Attach,
    Detach,
}

impl HookKind {
    pub fn as_str(self) -> &'static str {
        match self {
            HookKind::Create => "create",
            HookKind::Destroy => "destroy",
            HookKind::Attach => "attach",
            HookKind::Detach => "detach",
        }
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
    Csi(#[from] CsiError),
    /// The driver cannot do what this setup needs (capabilities, configuration).
    #[error("{0}")]
    Driver(String),
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
    /// Another hook on the same volume did not finish in time.
    #[error("another operation on this volume still held its lock after {waited:.1?}")]
    Busy { waited: Duration },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Reading the StorageClass or its Secrets failed.
    #[error(transparent)]
    Kubernetes(#[from] crate::k8s::KubeError),
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
    #[error("the bridge is shutting down")]
    ShuttingDown,
}

impl BridgeError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        BridgeError::Io {
            context: context.into(),
            source,
        }
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
            "{} of volume {:?}: {}",
            self.hook, self.volume_id, self.error
        )
    }
}

impl std::error::Error for HookError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
