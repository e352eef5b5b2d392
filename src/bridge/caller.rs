//! Whether whoever asked for a hook is still waiting for its answer.
//!
//! Cube cancels an Attach when its sandbox create fails or times out, and never Detaches
//! after a failed Attach. A hook therefore runs to completion independently of its caller,
//! and checks here before each step and at the end: once the caller is gone, the hook
//! undoes its own work instead of leaving a volume mounted that nobody holds.

use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Default)]
pub struct Caller {
    gone: CancellationToken,
}

impl Caller {
    /// A caller that waits for the answer (tests, in-process callers).
    pub fn waiting() -> Self {
        Self::default()
    }

    /// The caller stopped waiting (its deadline passed, it disconnected, it was killed).
    pub fn leave(&self) {
        self.gone.cancel();
    }

    pub fn is_gone(&self) -> bool {
        self.gone.is_cancelled()
    }

    /// A guard that marks the caller gone when dropped, unless disarmed: the rpc handler
    /// holds one while it waits, so dropping the handler (the client's deadline fired)
    /// tells the hook.
    pub fn leave_on_drop(&self) -> LeaveOnDrop {
        LeaveOnDrop(Some(self.clone()))
    }
}

/// See `Caller::leave_on_drop`.
#[derive(Debug)]
pub struct LeaveOnDrop(Option<Caller>);

impl LeaveOnDrop {
    /// The answer was delivered: the caller did not leave.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for LeaveOnDrop {
    fn drop(&mut self) {
        if let Some(caller) = self.0.take() {
            caller.leave();
        }
    }
}
