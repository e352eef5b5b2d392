//! Logging: structured tracing to stderr, text or JSON, filtered by `RUST_LOG`.
//!
//! stdout is reserved: the binary hook's reply goes there and nothing else may.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

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
