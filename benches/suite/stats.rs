//! Sample statistics: median and p99 (nearest rank) of per-call latencies, and the units
//! the table prints them in.

use std::time::Duration;

/// The summary of one set of per-call samples.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub n: usize,
    pub median: Duration,
    pub p99: Duration,
}

impl Summary {
    /// Summarises samples given in nanoseconds. Panics on an empty set: every figure is
    /// measured at least once, so an empty set is a bug in the suite.
    pub fn of_ns(samples: &[i64]) -> Summary {
        assert!(!samples.is_empty(), "no samples to summarise");
        let mut sorted: Vec<i64> = samples.to_vec();
        sorted.sort_unstable();
        Summary {
            n: sorted.len(),
            median: ns(percentile(&sorted, 50.0)),
            p99: ns(percentile(&sorted, 99.0)),
        }
    }

    pub fn of(samples: &[Duration]) -> Summary {
        let ns: Vec<i64> = samples.iter().map(|d| d.as_nanos() as i64).collect();
        Summary::of_ns(&ns)
    }
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[i64], p: f64) -> i64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ns(v: i64) -> Duration {
    Duration::from_nanos(v.max(0) as u64)
}

/// A duration in the unit that reads best: µs below 1 ms, ms below 10 s, else s.
pub fn fmt_duration(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0} µs")
    } else if us < 10e6 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{:.1} s", us / 1e6)
    }
}

/// A size in MiB.
pub fn fmt_kib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}
