//! The instant a hook must be done by. Every driver call, retry, lock wait and mount
//! query of the hook fits inside it.

use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    start: Instant,
    at: Instant,
}

impl Deadline {
    pub fn after(budget: Duration) -> Self {
        let start = Instant::now();
        Self {
            start,
            at: start + budget,
        }
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
