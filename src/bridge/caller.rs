//! Whether whoever asked for a hook is still waiting for its answer.
//!
//! Cube cancels an Attach when its sandbox create fails or times out, and never Detaches
//! after a failed Attach. A hook therefore runs to completion independently of its caller,
//! and checks here before each step and at the end: once the caller is gone, the hook
//! undoes its own work instead of leaving a volume mounted that nobody holds.

//!
//! Some callers can also say whether the answer reached them (`Delivery`): a forked hook's
//! worker hands its answer to the process Cube started and learns whether that process
//! printed it and exited, or was killed first. The core delivers an Attach's or a
//! Create's answer while it still holds the volume's lock, and undoes the holder or the
//! volume Cube never learned of.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::types::{Attached, Created};

/// A successful answer, handed to the caller before the hook lets go of its volume.
#[derive(Debug, Clone)]
pub enum Answer {
    Attached(Attached),
    Created(Created),
}

/// How a caller takes an answer and says whether it reached Cube.
pub trait Delivery: Send + Sync {
    /// Hands `answer` over; resolves to whether the caller took it (false: it is gone, and
    /// the hook must undo what the answer reported).
    fn deliver(&self, answer: Answer) -> Pin<Box<dyn Future<Output = bool> + Send + '_>>;
}

/// Says, without waiting, whether the caller is gone now.
pub type GoneNow = Arc<dyn Fn() -> bool + Send + Sync>;

#[derive(Clone, Default)]
pub struct Caller {
    gone: CancellationToken,
    delivery: Option<Arc<dyn Delivery>>,
    /// Asked at every check, so that a caller gone before the task watching it first ran
    /// (a worker that takes a free lock never yields to it) is seen anyway.
    gone_now: Option<GoneNow>,
    /// Cube's later hooks of the volume may take its lock before this one: a forked
    /// worker polls the lock's byte, where the daemon's lock table serves hooks in the
    /// order they came.
    overtakable: bool,
}

impl std::fmt::Debug for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caller")
            .field("gone", &self.is_gone())
            .field("confirms_delivery", &self.delivery.is_some())
            .finish()
    }
}

impl Caller {
    /// A caller that waits for the answer (tests, in-process callers).
    pub fn waiting() -> Self {
        Self::default()
    }

    /// A caller that says whether each answer reached it.
    pub fn confirming(delivery: Arc<dyn Delivery>) -> Self {
        Self {
            delivery: Some(delivery),
            ..Self::default()
        }
    }

    /// A forked hook's worker: the answer goes to its front (`delivery`), whose presence
    /// `gone_now` reads without waiting, and its lock wait may be overtaken.
    pub fn forked_worker(delivery: Arc<dyn Delivery>, gone_now: GoneNow) -> Self {
        Self {
            gone: CancellationToken::new(),
            delivery: Some(delivery),
            gone_now: Some(gone_now),
            overtakable: true,
        }
    }

    /// This caller, its lock wait overtakable (what a forked worker's is).
    #[cfg(test)]
    pub fn overtakable(mut self) -> Self {
        self.overtakable = true;
        self
    }

    /// Whether Cube's later hooks of the volume may have taken its lock before this one.
    pub fn may_be_overtaken(&self) -> bool {
        self.overtakable
    }

    /// Hands over `answer`, if this caller takes answers that way; whether it reached the
    /// caller (a caller that does not confirm delivery is taken at its word while it
    /// waits).
    pub async fn deliver(&self, answer: Answer) -> bool {
        super::faults::pause_before_delivery().await;
        let delivered = match &self.delivery {
            Some(delivery) if !self.is_gone() => delivery.deliver(answer).await,
            _ => !self.is_gone(),
        };
        if delivered {
            super::faults::pause_after_delivery().await;
        }
        delivered
    }

    /// The caller stopped waiting (its deadline passed, it disconnected, it was killed).
    pub fn leave(&self) {
        self.gone.cancel();
    }

    /// Cancelled once the caller is known to be gone (a check, or the task watching it).
    pub(crate) fn gone_token(&self) -> CancellationToken {
        self.gone.clone()
    }

    pub fn is_gone(&self) -> bool {
        if self.gone.is_cancelled() {
            return true;
        }
        if self.gone_now.as_ref().is_some_and(|gone_now| gone_now()) {
            self.gone.cancel();
            return true;
        }
        false
    }

    /// A guard that marks the caller gone when dropped, unless disarmed: the rpc handler
    /// holds one while it waits, so dropping the handler (the client's deadline fired)
    /// tells the hook.
    pub fn leave_on_drop(&self) -> LeaveOnDrop {
        LeaveOnDrop(Some(self.clone()))
    }
}

/// What the log says when an rpc caller stopped waiting for its answer (it cancelled, or
/// its deadline passed).
pub const CALLER_LEFT: &str = "the caller stopped waiting for the answer";

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
            // Worth a line: Cube counts this hook failed, whatever it goes on to do.
            tracing::info!("{CALLER_LEFT}: the hook undoes what it did instead of answering");
            caller.leave();
        }
    }
}
