//! The error of one CSI call, as the bridge reports it upward.

use std::fmt;
use std::time::Duration;

use tonic::Code;

/// A CSI call that did not succeed, with everything an operator needs: which call, at
/// which endpoint, the gRPC code, the driver's own message, and how hard we tried.
#[derive(Debug, Clone)]
pub struct CsiError {
    /// The CSI RPC name, e.g. `NodePublishVolume`.
    pub call: &'static str,
    pub endpoint: String,
    pub code: Code,
    /// The driver's message (or the transport's, when the driver was not reached).
    pub message: String,
    pub attempts: u32,
    /// Set when the hook's budget ran out while the call kept failing non-finally.
    pub gave_up_after: Option<Duration>,
}

impl CsiError {
    /// The driver may still be working on it (CSI's non-final codes; see retry.rs).
    pub fn is_uncertain(&self) -> bool {
        !super::retry::is_final(self.code)
    }
}

impl fmt::Display for CsiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CSI {} ", self.call)?;
        match self.gave_up_after {
            Some(elapsed) => write!(
                f,
                "did not succeed within its budget ({} attempts in {:.1}s); last error",
                self.attempts,
                elapsed.as_secs_f64()
            )?,
            None => write!(f, "failed")?,
        }
        write!(
            f,
            " from {}: {:?}: {}",
            self.endpoint, self.code, self.message
        )
    }
}

impl std::error::Error for CsiError {}
