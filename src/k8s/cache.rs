//! A value read from the API server, reused for a TTL, refreshed by one caller at a time,
//! and kept through an outage.
//!
//! Hooks must not queue behind the API server: while a copy exists, nobody waits longer
//! than `STALE_WAIT` for a refresh, a refresh already under way is not waited for at all,
//! and a copy that could not be refreshed is re-stamped, so the next calls within the TTL
//! do not try again.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::KubeError;

/// The longest a caller holding a stale copy waits for a fresh one.
pub const STALE_WAIT: Duration = Duration::from_secs(2);

pub struct Cached<T> {
    ttl: Duration,
    copy: Mutex<Option<(Instant, Arc<T>)>>,
    refreshing: tokio::sync::Mutex<()>,
}

impl<T> Cached<T> {
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            copy: Mutex::new(None),
            refreshing: tokio::sync::Mutex::new(()),
        }
    }

    fn current(&self) -> Option<(Instant, Arc<T>)> {
        self.copy.lock().expect("cache poisoned").clone()
    }

    fn store(&self, value: Arc<T>) {
        *self.copy.lock().expect("cache poisoned") = Some((Instant::now(), value));
    }

    /// The value, read with `fetch` when the copy is older than the TTL. `what` names it
    /// in the warning when a stale copy is used.
    pub async fn get<F, Fut>(&self, what: &str, fetch: F) -> Result<Arc<T>, KubeError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, KubeError>>,
    {
        let stale = match self.current() {
            Some((at, value)) if at.elapsed() < self.ttl => return Ok(value),
            other => other.map(|(_, value)| value),
        };
        let _refresh = match (&stale, self.refreshing.try_lock()) {
            (_, Ok(guard)) => guard,
            // Someone is refreshing: use the copy rather than queue behind the API.
            (Some(value), Err(_)) => return Ok(value.clone()),
            (None, Err(_)) => self.refreshing.lock().await,
        };
        // Another caller may have refreshed it while we waited for the turn.
        if let Some((at, value)) = self.current()
            && at.elapsed() < self.ttl
        {
            return Ok(value);
        }
        let outcome = match &stale {
            Some(_) => tokio::time::timeout(STALE_WAIT, fetch())
                .await
                .unwrap_or_else(|_| {
                    Err(KubeError::Api {
                        action: format!("refreshing {what}"),
                        code: None,
                        message: format!("no answer within {STALE_WAIT:?}"),
                    })
                }),
            None => fetch().await,
        };
        match (outcome, stale) {
            (Ok(value), _) => {
                let value = Arc::new(value);
                self.store(value.clone());
                Ok(value)
            }
            (Err(error), Some(value)) if error.is_transient() => {
                tracing::warn!(%error, "using the last {what} read");
                self.store(value.clone());
                Ok(value)
            }
            (Err(error), _) => Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn outage() -> KubeError {
        KubeError::Api {
            action: "reading".into(),
            code: None,
            message: "connection refused".into(),
        }
    }

    #[tokio::test]
    async fn fresh_copies_are_reused_and_an_outage_serves_the_stale_one_once() {
        // A TTL no pause of the test machine reaches; expiry is made by backdating (by
        // little: a monotonic clock starts near zero at boot).
        let cache = Cached::<u32>::new(Duration::from_secs(60));
        let expire = || {
            let mut copy = cache.copy.lock().unwrap();
            let (at, _) = copy.as_mut().unwrap();
            *at = at
                .checked_sub(Duration::from_secs(61))
                .expect("the machine has been up for a minute");
        };
        let calls = AtomicUsize::new(0);
        let fetch = |v: Result<u32, KubeError>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move { v }
        };
        assert_eq!(*cache.get("x", || fetch(Ok(1))).await.unwrap(), 1);
        assert_eq!(*cache.get("x", || fetch(Ok(2))).await.unwrap(), 1);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        expire();
        assert_eq!(*cache.get("x", || fetch(Err(outage()))).await.unwrap(), 1);
        // Re-stamped: the next call within the TTL does not ask the API again.
        assert_eq!(*cache.get("x", || fetch(Err(outage()))).await.unwrap(), 1);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // A permanent error is not hidden.
        expire();
        let gone = KubeError::Unusable("deleted".into());
        assert!(cache.get("x", || fetch(Err(gone))).await.is_err());
    }

    #[tokio::test]
    async fn a_hanging_api_server_delays_a_holder_of_a_copy_by_at_most_the_stale_wait() {
        let cache = Cached::<u32>::new(Duration::from_millis(1));
        cache.get("x", || async { Ok(7) }).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let started = Instant::now();
        let value = cache
            .get("x", || async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(8)
            })
            .await
            .unwrap();
        assert_eq!(*value, 7);
        assert!(started.elapsed() < STALE_WAIT + Duration::from_secs(5));
    }
}
