//! The retry policy for CSI calls.
//!
//! CSI (and kubelet, external-provisioner, external-attacher) call an error *non-final*
//! when the driver may still be working on the request: CANCELLED, DEADLINE_EXCEEDED,
//! UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED, or a transport failure. Those are retried
//! with exponential backoff, with the same arguments, inside the hook's budget. Every
//! other code is final: nothing is in progress, so retrying would not change the answer.

use std::time::Duration;

use tonic::Code;

use crate::bridge::ports::Finality;

/// First backoff delay; doubled after each failure up to `MAX_BACKOFF`.
pub const INITIAL_BACKOFF: Duration = Duration::from_millis(100);
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Whether a CSI error code means "nothing is in progress".
pub fn is_final(code: Code) -> bool {
    !matches!(
        code,
        Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Unavailable
            | Code::ResourceExhausted
            | Code::Aborted
    )
}

/// How the core must treat a failure with `code`.
pub fn finality(code: Code) -> Finality {
    match code {
        Code::Unimplemented => Finality::Unimplemented,
        c if is_final(c) => Finality::Final,
        _ => Finality::Uncertain,
    }
}

/// How the core must treat a failed call. A status tonic made itself from a broken
/// connection (hyper/h2 error as its source; one decoded from the driver's trailers has
/// none) is a transport failure whatever its code: the driver may have acted on the
/// request before it died.
pub fn status_finality(status: &tonic::Status) -> Finality {
    if std::error::Error::source(status).is_some() {
        return Finality::Uncertain;
    }
    finality(status.code())
}

/// Exponential backoff state.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            next: INITIAL_BACKOFF,
        }
    }
}

impl Backoff {
    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(MAX_BACKOFF);
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_codes_match_kubernetes() {
        for code in [
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::Aborted,
        ] {
            assert!(!is_final(code), "{code:?}");
            assert_eq!(finality(code), Finality::Uncertain);
        }
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::FailedPrecondition,
            Code::Internal,
            Code::Unknown,
        ] {
            assert!(is_final(code), "{code:?}");
            assert_eq!(finality(code), Finality::Final);
        }
        assert_eq!(finality(Code::Unimplemented), Finality::Unimplemented);
    }

    #[test]
    fn a_local_transport_status_is_uncertain() {
        let io = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "connection reset");
        let local = tonic::Status::from_error(Box::new(io));
        assert_eq!(local.code(), Code::Unknown);
        assert_eq!(status_finality(&local), Finality::Uncertain);
        // The same code answered by the driver is final.
        let answered = tonic::Status::unknown("the driver said so");
        assert_eq!(status_finality(&answered), Finality::Final);
    }

    #[test]
    fn backoff_doubles_to_a_cap() {
        let mut b = Backoff::default();
        let delays: Vec<_> = (0..8).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
    }
}
