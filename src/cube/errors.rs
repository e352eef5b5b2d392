//! The one place errors become what Cube sees: a gRPC status (rpc plugins) or the
//! binary hook's `{"error": …}` JSON.

use tonic::{Code, Status};

use crate::bridge::ports::{PathError, StoreError};
use crate::bridge::{BridgeError, HookError};

/// The error table: which status each failure answers with.
fn code(error: &BridgeError) -> Code {
    match error {
        BridgeError::InvalidRequest(_) => Code::InvalidArgument,
        BridgeError::Driver(e) if e.gave_up_after.is_some() => Code::DeadlineExceeded,
        BridgeError::Driver(e) => Code::from_i32(e.grpc_code),
        BridgeError::Precondition(_)
        | BridgeError::NotVisible { .. }
        | BridgeError::Path(PathError::Refused { .. }) => Code::FailedPrecondition,
        BridgeError::Busy { .. } => Code::Aborted,
        BridgeError::Unavailable(_) => Code::Unavailable,
        BridgeError::Store(StoreError::Conflict { .. }) => Code::Aborted,
        BridgeError::Store(e) if e.is_transient() => Code::Unavailable,
        BridgeError::Settings(e) if e.transient => Code::Unavailable,
        BridgeError::Settings(_) => Code::FailedPrecondition,
        BridgeError::StillMounted { .. }
        | BridgeError::Store(_)
        | BridgeError::Journal(_)
        | BridgeError::Path(PathError::Io { .. })
        | BridgeError::Io { .. } => Code::Internal,
        BridgeError::RollbackFailed { error, .. } => code(error),
        BridgeError::DeadMount {
            error: Some(error), ..
        } => code(error),
        // Its filesystem still does not answer: its driver or server is down.
        BridgeError::DeadMount { error: None, .. } => Code::Unavailable,
        BridgeError::CallerGone => Code::Cancelled,
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
    message_json(&error.to_string())
}

/// The JSON for a failure that happened before any hook ran (bad argv, no config).
pub fn message_json(message: &str) -> String {
    serde_json::json!({ "error": message }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::HookKind;

    fn status_of(error: BridgeError) -> Code {
        to_status(&HookError {
            hook: HookKind::Create,
            volume_id: "v".into(),
            error,
        })
        .code()
    }

    #[test]
    fn store_failures_map_by_kind_not_by_backend() {
        assert_eq!(
            status_of(
                StoreError::Conflict {
                    volume_id: "v".into()
                }
                .into()
            ),
            Code::Aborted
        );
        let outage = |transient| StoreError::Backend {
            store: "s".into(),
            action: "a".into(),
            transient,
            source: "down".into(),
        };
        assert_eq!(status_of(outage(true).into()), Code::Unavailable);
        assert_eq!(status_of(outage(false).into()), Code::Internal);
        let settings = |transient| {
            BridgeError::Settings(crate::bridge::ports::SettingsError {
                message: "m".into(),
                transient,
                source: None,
            })
        };
        assert_eq!(status_of(settings(true)), Code::Unavailable);
        assert_eq!(status_of(settings(false)), Code::FailedPrecondition);
    }

    #[test]
    fn a_refused_path_is_a_failed_precondition_naming_the_path() {
        let refused = PathError::Refused {
            path: "/v/.staging".into(),
            problem: "is a symlink (to /x)".into(),
            found: Some(crate::bridge::ports::Found {
                uid: 65534,
                mode: 0o777,
            }),
            hint: "h",
        };
        let status = to_status(&HookError {
            hook: HookKind::Detach,
            volume_id: "v".into(),
            error: refused.into(),
        });
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert!(
            status.message().contains(
                "refusing /v/.staging: it is a symlink (to /x) (owner uid 65534, mode 0777)"
            ),
            "{}",
            status.message()
        );
        let failed = PathError::Io {
            op: "check",
            path: "/v".into(),
            source: std::io::ErrorKind::PermissionDenied.into(),
        };
        assert_eq!(status_of(failed.into()), Code::Internal);
    }
}
