//! The forked hook's front executable, `cube-csi-hook`: what Cube should fork for a binary
//! registration. It answers a node hook's hot path by itself (the same code as the full
//! binary's, `forked::answer_if_hot`) and execs the full `cube-csi-bridge` beside it for
//! everything else, with the same argv, environment and pid.
//!
//! Why a second executable: a forked hook's cost is mostly the kernel's, for mapping and
//! relocating the executable (docs/benchmarks.md, "forked hook"). The full binary carries
//! the CSI and Kubernetes clients, the daemon and the operator commands; this one links
//! only the node journal, the locks, the mount view and the hook's argv, because the hot
//! path needs nothing else (`app::open_hot_node`).
//!
//! What does not change: the exec keeps the process Cube started (same pid, same pipes),
//! so Cube's deadline kill, the worker's liveness pipe and the answer on stdout are exactly
//! the full binary's; a hot path that does not answer has changed nothing (it declines
//! before it writes), so the full binary starts from the same state. Anything the front
//! does not fully understand (another subcommand, `--help`, an argv it cannot parse, a
//! config it cannot load) is the full binary's to answer, so errors have one wording.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use crate::cli;
use crate::telemetry;
use crate::transport::forked::{self, HookOutput};

/// The full binary's file name; the front looks for it in its own directory.
pub const FULL_BINARY: &str = "cube-csi-bridge";
/// The front's file name, as installed beside the full binary.
pub const FRONT_BINARY: &str = "cube-csi-hook";

/// What a binary registration should fork, given the full binary's path: the front beside
/// it when installed, else the full binary itself (which answers every hook too, slower).
pub fn front_beside(full: &Path) -> PathBuf {
    let front = full.with_file_name(FRONT_BINARY);
    if front.is_file() {
        front
    } else {
        full.to_path_buf()
    }
}

/// What std's runtime would have done before `main` that the front needs (its executable
/// is `no_main`): standard descriptors that are open, so that no file this process opens
/// becomes its stdout; and SIGPIPE ignored, so that an answer written to a closed pipe is
/// an error, not a silent death.
pub fn start() {
    use nix::fcntl::{FcntlArg, OFlag, fcntl, open};
    use nix::sys::signal::{SigHandler, Signal, signal};
    for fd in 0..=2 {
        // SAFETY: only asks whether the descriptor exists.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        if fcntl(fd, FcntlArg::F_GETFD) == Err(nix::errno::Errno::EBADF) {
            // The lowest free descriptor is this one; it stays open for the process.
            if let Ok(null) = open("/dev/null", OFlag::O_RDWR, nix::sys::stat::Mode::empty()) {
                std::mem::forget(null);
            }
        }
    }
    // SAFETY: SIG_IGN installs no handler code.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigIgn) };
}

/// The front executable's entry point; returns the exit code.
pub fn main(args: Vec<OsString>) -> u8 {
    if let Some(answer) = answer_here(&args) {
        return cli::print_hook_answer(answer, cli::EXIT_FAILURE).0;
    }
    let error = match full_binary() {
        Ok(full) => exec(&full, &args),
        Err(why) => why,
    };
    cli::print_hook_answer(HookOutput::failure(&error), cli::EXIT_CONFIG).0
}

/// The hot path's answer, when this process can give it; `None`: the full binary answers.
fn answer_here(args: &[OsString]) -> Option<HookOutput> {
    let (log_format, hook) = cli::parse_front_argv(args)?;
    let request = hook.request().ok()?;
    if !request.kind().is_node() {
        return None;
    }
    // Without RUST_LOG a forked hook logs nothing before it answers: then no subscriber
    // is needed (building one parses filters the process would never use).
    if std::env::var_os("RUST_LOG").is_some() {
        telemetry::init_hook(log_format);
    }
    let argv0 = args.first().and_then(|a| a.to_str());
    crate::config::look_up_groups_in_etc_group_only();
    let config = cli::hook_config(&hook, argv0).ok()?;
    // Timers only: the hot path waits on no socket, and an I/O driver is an epoll set and
    // a signal registry made for nothing.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .ok()?;
    runtime.block_on(forked::answer_if_hot(&config, &request))
}

/// `cube-csi-bridge` in the directory of this executable's file (symlinks resolved, so a
/// per-driver link `cube-csi-bridge-<driver>` to the front finds the front's sibling).
fn full_binary() -> Result<PathBuf, String> {
    let own = std::fs::read_link("/proc/self/exe")
        .map_err(|e| format!("the hook front cannot find its own executable: {e}"))?;
    full_binary_beside(&own)
}

fn full_binary_beside(own: &Path) -> Result<PathBuf, String> {
    let full = own.with_file_name(FULL_BINARY);
    if full == own {
        return Err(format!(
            "{} is the hook front installed under the full binary's name: install the front \
             as cube-csi-hook beside the full cube-csi-bridge",
            own.display()
        ));
    }
    // This process runs as root what it finds there: nobody else may have put it there
    // (the same rule as for a config file). Checked whether or not it is there now: one
    // put there after an existence check would run unchecked.
    if let Err(e) = std::fs::symlink_metadata(&full)
        && e.kind() == std::io::ErrorKind::NotFound
    {
        return Err(format!(
            "the hook front finds no full binary {}: install cube-csi-bridge beside \
             cube-csi-hook",
            full.display()
        ));
    }
    crate::config::check_trusted_file(&full).map_err(|why| {
        format!(
            "the hook front refuses to run the full binary {}: {why}",
            full.display()
        )
    })?;
    Ok(full)
}

/// Replaces this process with the full binary; returns only on failure, with the error.
fn exec(full: &Path, args: &[OsString]) -> String {
    let mut command = std::process::Command::new(full);
    // argv[0] is kept: its name (cube-csi-bridge-<driver>) picks the config.
    if let Some(argv0) = args.first() {
        command.arg0(argv0);
    }
    let error = command.args(args.iter().skip(1)).exec();
    format!(
        "the hook front could not run the full binary {}: {error}; install cube-csi-bridge \
         beside cube-csi-hook",
        full.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_binary_is_the_fronts_sibling_and_never_the_front_itself() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let front = dir.path().join("cube-csi-hook");
        let full = dir.path().join(FULL_BINARY);
        // Missing: refused now, not left to a check skipped and an exec of whatever is
        // put there in between (before, a missing binary skipped the check).
        let err = full_binary_beside(&front).unwrap_err();
        assert!(err.contains("finds no full binary"), "{err}");
        std::fs::write(&full, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&full, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(full_binary_beside(&front).unwrap(), full);
        std::fs::set_permissions(&full, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = full_binary_beside(&front).unwrap_err();
        assert!(err.contains("refuses to run the full binary"), "{err}");
        let err = full_binary_beside(Path::new("/opt/x/cube-csi-bridge")).unwrap_err();
        assert!(
            err.contains("installed under the full binary's name"),
            "{err}"
        );
    }

    #[test]
    fn only_a_node_hooks_argv_is_answered_here() {
        let argv = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        // Create and Destroy are the controller's: never answered by the front.
        assert!(
            answer_here(&argv(&[
                "cube-csi-hook",
                "--op",
                "create",
                "--volume-id",
                "v",
                "--name",
                "n"
            ]))
            .is_none()
        );
        // Unparseable argv: the full binary words the error.
        assert!(answer_here(&argv(&["cube-csi-hook", "--op", "attach", "--bogus", "x"])).is_none());
        assert!(answer_here(&argv(&["cube-csi-hook", "serve"])).is_none());
        assert!(answer_here(&argv(&["cube-csi-hook", "--help"])).is_none());
    }
}
