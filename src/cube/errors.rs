//! The one place errors become what Cube sees: a gRPC status (rpc plugins) or the
//! binary hook's `{"error": …}` JSON.

use tonic::{Code, Status};

use crate::bridge::{BridgeError, HookError};

fn code(error: &BridgeError) -> Code {
    match error {
        BridgeError::InvalidRequest(_) => Code::InvalidArgument,
        BridgeError::Csi(e) if e.gave_up_after.is_some() => Code::DeadlineExceeded,
        BridgeError::Csi(e) => e.code,
        BridgeError::Driver(_) | BridgeError::NotVisible { .. } => Code::FailedPrecondition,
        BridgeError::StillMounted { .. } | BridgeError::Store(_) | BridgeError::Io { .. } => {
            Code::Internal
        }
        BridgeError::Busy { .. } => Code::Aborted,
        BridgeError::Kubernetes(e) if e.is_transient() => Code::Unavailable,
        BridgeError::Kubernetes(_) => Code::FailedPrecondition,
        BridgeError::RollbackFailed { error, .. } => code(error),
        BridgeError::ShuttingDown => Code::Unavailable,
    }
}

/// The gRPC status of a failed hook. Cube logs the message and ignores the code; the
/// code still helps other callers and tests.
pub fn to_status(error: &HookError) -> Status {
    let code = match code(&error.error) {
        Code::Ok => Code::Unknown,
        c => c,
    };
    Status::new(code, error.to_string())
}

/// The binary hook's stdout for a failure: exactly one JSON object.
pub fn to_json(error: &HookError) -> String {
    serde_json::json!({ "error": error.to_string() }).to_string()
}

/// The JSON for a failure that happened before any hook ran (bad argv, no config).
pub fn message_json(message: &str) -> String {
    serde_json::json!({ "error": message }).to_string()
}
