//! The instant a hook must be done by. Every driver call, retry, lock wait and mount
//! query of the hook fits inside it.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::caller::Caller;

#[derive(Debug, Clone)]
pub struct Deadline {
    start: Instant,
    at: Instant,
    /// Set when the caller whose hook this is has left: no call then starts another
    /// attempt (see `while_awaited`).
    caller_gone: Option<CancellationToken>,
}

impl Deadline {
    pub fn after(budget: Duration) -> Self {
        let start = Instant::now();
        Self {
            start,
            at: start + budget,
            caller_gone: None,
        }
    }

    /// This deadline, for steps worth retrying only while `caller` waits: once it leaves,
    /// a failed attempt is not retried (the one under way still ends, so that its outcome
    /// is known), and the hook goes on to undo what it did. Without this a hook whose
    /// caller left kept retrying a driver that answers UNAVAILABLE to the end of its
    /// budget, holding the volume's lock, while Cube's other hooks of the volume waited
    /// past their own deadlines. Undo steps keep their own deadline, without it.
    pub fn while_awaited(mut self, caller: &Caller) -> Self {
        self.caller_gone = Some(caller.gone_token());
        self
    }

    /// Whether the caller this deadline works for has left (`while_awaited`).
    pub fn caller_left(&self) -> bool {
        self.caller_gone
            .as_ref()
            .is_some_and(CancellationToken::is_cancelled)
    }

    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    pub fn instant(&self) -> Instant {
        self.at
    }
}
