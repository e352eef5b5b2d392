//! Where work that waits for a disk runs: on the caller's own thread when no other such
//! wait of this process is under way, on a blocking thread otherwise.
//!
//! A durable save of the node journal waits for an `fdatasync` (0.2–0.5 ms on a local
//! disk), and so does a commit of the embedded controller store. Handed to a blocking
//! thread, each costs two thread wake-ups on top: one to start the thread, one to resume
//! the hook, each a scheduler round trip on the hook's critical path (issue 20: about
//! 0.1 ms of a first Attach's median; a third of a Create's context switches). Run on the
//! runtime's worker, it costs neither, but that worker runs nothing else meanwhile. So
//! only one worker at a time does it: while one wait runs there, every other goes to a
//! blocking thread as before, and a disk that stops answering holds at most one worker,
//! never the runtime. A current-thread runtime (a forked hook's worker), whose only
//! thread also runs the hook's deadline, always hands the work off.

use std::sync::atomic::{AtomicBool, Ordering};

/// One caller at a time runs its work on its own thread (see the module's doc).
#[derive(Debug, Default)]
pub struct LoneOnCaller {
    busy: AtomicBool,
}

/// The process's one turn: the node journal's durable saves and the embedded controller
/// store's reads and commits share it, so that however many drivers and stores a process
/// serves, at most one of its runtime workers waits for a disk.
static DISK_WAIT: LoneOnCaller = LoneOnCaller::new();

/// Runs `work`, which may wait for a disk, where the process's `LoneOnCaller` puts it.
pub async fn wait_for_disk<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    DISK_WAIT.run(work).await
}

/// Runs `work` on a blocking thread and returns what it returned; its panic goes on in the
/// caller.
pub async fn on_blocking_thread<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// Frees the caller's turn when its work ends, panics, or is dropped mid-way.
struct Turn<'a>(&'a AtomicBool);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl LoneOnCaller {
    pub const fn new() -> Self {
        Self {
            busy: AtomicBool::new(false),
        }
    }

    /// Runs `work` here when nothing else runs here through this, on a blocking thread
    /// otherwise; either way returns what it returned.
    pub async fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        if let Some(_turn) = self.take_turn() {
            // Whatever this task woke last waits in this worker's next-task slot, which no
            // other worker may take: it runs first, not after the disk answers.
            tokio::task::yield_now().await;
            return work();
        }
        on_blocking_thread(work).await
    }

    fn take_turn(&self) -> Option<Turn<'_>> {
        let multi_thread = tokio::runtime::Handle::try_current().is_ok_and(|runtime| {
            runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
        });
        let free = multi_thread
            && self
                .busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok();
        free.then_some(Turn(&self.busy))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::sync::Arc;
    use std::sync::mpsc;

    /// The task that ran `work`: the caller's own when it ran on the caller's thread, a
    /// blocking task's otherwise.
    fn ran_in() -> Option<tokio::task::Id> {
        tokio::task::try_id()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_call_runs_on_the_callers_thread_and_a_concurrent_one_does_not() {
        let lone = Arc::new(LoneOnCaller::default());
        let (entered_tx, entered) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let first = tokio::spawn({
            let lone = lone.clone();
            async move {
                let caller = tokio::task::try_id();
                let inside = lone
                    .run(move || {
                        entered_tx.send(()).unwrap();
                        release_rx.recv().unwrap();
                        ran_in()
                    })
                    .await;
                (caller, inside)
            }
        });
        entered.recv().unwrap();
        // The first call waits on its worker: this one is handed to a blocking thread.
        let second = tokio::spawn({
            let lone = lone.clone();
            async move {
                let caller = tokio::task::try_id();
                (caller, lone.run(ran_in).await)
            }
        })
        .await
        .unwrap();
        assert_ne!(
            second.0, second.1,
            "a concurrent call runs on a blocking thread"
        );
        release.send(()).unwrap();
        let first = first.await.unwrap();
        assert_eq!(first.0, first.1, "a lone call runs on the caller's thread");
        // The turn is free again.
        let caller = tokio::task::try_id();
        assert_eq!(lone.run(ran_in).await, caller);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_dropped_or_panicking_frees_the_turn() {
        let lone = Arc::new(LoneOnCaller::default());
        let caller = tokio::task::try_id();
        // Dropped while it yields, before its work ran.
        let mut pending = Box::pin(lone.run(ran_in));
        let waker = std::task::Waker::noop();
        let polled = pending
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker));
        assert!(polled.is_pending(), "it yields first");
        drop(pending);
        assert_eq!(lone.run(ran_in).await, caller);
        let panicked = tokio::spawn({
            let lone = lone.clone();
            async move { lone.run(|| panic!("a save that panicked")).await }
        })
        .await;
        assert!(panicked.unwrap_err().is_panic());
        assert_eq!(lone.run(ran_in).await, caller);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_current_thread_runtime_always_hands_the_work_off() {
        let lone = LoneOnCaller::default();
        let caller = tokio::task::try_id();
        assert_ne!(lone.run(ran_in).await, caller);
        assert!(
            lone.run(ran_in).await.is_some(),
            "it ran in a blocking task"
        );
    }
}
