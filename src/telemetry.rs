//! Logging: structured tracing to stderr, text or JSON, filtered by `RUST_LOG`.
//!
//! stdout is reserved: the binary hook's reply goes there and nothing else may.

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;

/// What a forked hook's worker logs once it has answered, when `RUST_LOG` does not say.
const AFTER_ANSWER_LEVEL: &str = "info";

/// Raises a forked hook's log filter to `AFTER_ANSWER_LEVEL` (set by `init_hook`).
static RAISE_AFTER_ANSWER: OnceLock<Box<dyn Fn() + Send + Sync>> = OnceLock::new();

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Installs the global subscriber. `default_level` applies when `RUST_LOG` is unset.
pub fn init(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal: journald and Cube (which shows a failed
        // hook's stderr as its error message) get plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        // A log line that cannot be written is dropped: the default reports it with
        // eprintln!, which panics when stderr is a pipe nobody reads any more (a binary
        // hook's worker after Cube killed the process it started), and a hook must never
        // die half way for a log line.
        .log_internal_errors(false);
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    // A second init (tests) keeps the first subscriber.
    let _ = result;
}

/// `init` for a forked hook. Cube shows a failed hook's whole stderr as its error message,
/// so nothing is logged before the answer unless `RUST_LOG` says; once the hook has
/// answered, its worker's stderr goes to the worker log and `after_answer` lets the work
/// that follows (finishing abandoned operations, the sweep) log at `info`.
pub fn init_hook(format: LogFormat) {
    let from_env = EnvFilter::try_from_default_env().ok();
    let explicit = from_env.is_some();
    let filter = from_env.unwrap_or_else(|| EnvFilter::new("off"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(false)
        .log_internal_errors(false);
    let result = match format {
        LogFormat::Text => {
            let builder = builder.with_filter_reloading();
            let handle = builder.reload_handle();
            remember_raise(explicit, move |f| handle.reload(f).is_ok());
            builder.try_init()
        }
        LogFormat::Json => {
            let builder = builder.json().with_filter_reloading();
            let handle = builder.reload_handle();
            remember_raise(explicit, move |f| handle.reload(f).is_ok());
            builder.try_init()
        }
    };
    let _ = result;
}

fn remember_raise(explicit: bool, reload: impl Fn(EnvFilter) -> bool + Send + Sync + 'static) {
    if !explicit {
        let _ = RAISE_AFTER_ANSWER.set(Box::new(move || {
            reload(EnvFilter::new(AFTER_ANSWER_LEVEL));
        }));
    }
}

/// The hook has answered: what it logs from now on goes to the worker log, at
/// `AFTER_ANSWER_LEVEL` unless `RUST_LOG` chose a level.
pub fn after_answer() {
    if let Some(raise) = RAISE_AFTER_ANSWER.get() {
        raise();
    }
}
