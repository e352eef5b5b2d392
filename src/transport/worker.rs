//! The binary hook's worker: the hook runs in a child of the process Cube forked, so that
//! a SIGKILL at Cube's deadline does not strand its work.
//!
//! Cube kills the process it started (and only that one) when its deadline passes, and
//! never Detaches after a failed Attach. The process Cube started ("the front") forks a
//! worker before any thread exists, relays the worker's stderr and answer, and exits with
//! the answer's code. The worker holds none of Cube's pipes, so Cube is never kept
//! waiting by it. It watches a pipe only the front holds open: end of file there means
//! the front is gone, and the worker treats its caller as gone — it undoes its own work,
//! exactly as an rpc hook does when its caller's deadline fires. After answering, the
//! worker also finishes node operations that earlier, killed workers abandoned.
//!
//! Cube counts a forked hook as done only when the process it started exits 0 with the
//! answer on stdout. So the front acknowledges (one byte on that same pipe) only after it
//! has printed and flushed the answer, right before it exits, and an Attach's worker
//! hands its answer over while it still holds the volume: end of file without the byte
//! means Cube never learned of the holder, and the worker takes it back. What remains is
//! the instant between the front's acknowledgement and its exit.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::unistd::{ForkResult, dup2_stderr, dup2_stdin, dup2_stdout, fork};

use super::forked::{self as binary, HookOutput, HookRequest};
use crate::bridge::{Answer, Caller, Delivery, HookKind};
use crate::config::{Config, WorkerLog};

/// What the front owes its worker once the answer is out: the acknowledgement that it
/// was printed (`confirm`, right before the front exits). Dropped unconfirmed, or with the
/// front killed, it tells the worker the answer never reached Cube.
#[derive(Debug, Default)]
pub struct Acknowledgement(Option<OwnedFd>);

impl Acknowledgement {
    pub fn confirm(self) {
        if let Some(alive) = self.0 {
            let _ = std::fs::File::from(alive).write_all(ACKNOWLEDGED);
        }
    }
}

/// The byte the front writes on the liveness pipe once the answer is printed.
const ACKNOWLEDGED: &[u8] = b"A";

/// Runs `request` in a worker process and returns its output, with what the front owes
/// the worker once it has printed that output. Must be called while the process is still
/// single-threaded (before any runtime starts).
pub fn run_in_worker(config: Config, request: HookRequest) -> (HookOutput, Acknowledgement) {
    let (output, alive) = run_in_worker_inner(config, request);
    (output, Acknowledgement(alive))
}

fn run_in_worker_inner(config: Config, request: HookRequest) -> (HookOutput, Option<OwnedFd>) {
    // The hot paths are answered here, without a worker: they change one line of the
    // holder log, and the window in which Cube could kill this process after that line and
    // before it exits is the print of the answer.
    if let Some(answer) = runtime().block_on(binary::answer_if_hot(&config, &request)) {
        return (answer, None);
    }
    if crate::bridge::faults::forced_in_place() {
        return (run_here(config, request), None);
    }
    if !single_threaded() {
        // Forking a multi-threaded process is not safe: run here instead (a SIGKILL is then
        // left to the next hook or the daemon's reconciliation).
        tracing::warn!("more than one thread before forking the worker; running the hook in place");
        return (run_here(config, request), None);
    }
    let pipes = (|| Ok::<_, nix::Error>((worker_pipe()?, worker_pipe()?, worker_pipe()?)))();
    let Ok(((answer_r, answer_w), (log_r, log_w), (alive_r, alive_w))) = pipes else {
        // No pipes, no worker: run here (a SIGKILL is then left to reconciliation).
        return (run_here(config, request), None);
    };
    let (hook, volume_id) = (request.kind(), request.volume_id().to_string());
    let started_secs = crate::system::now_secs();
    // SAFETY: the process is single-threaded here (the caller's contract), so the child
    // may run arbitrary code after fork.
    match unsafe { fork() } {
        Err(_) => (run_here(config, request), None),
        Ok(ForkResult::Child) => {
            drop((answer_r, log_r, alive_w));
            worker(config, request, answer_w, log_w, alive_r)
        }
        Ok(ForkResult::Parent { .. }) => {
            drop((answer_w, log_w, alive_r));
            let output = front(answer_r, log_r).unwrap_or_else(|| {
                // Cube will count this hook failed, so a holder or a volume the worker saved
                // before it died is one Cube never learns of: take it back before answering.
                runtime().block_on(binary::withdraw_unanswered(&config, &request, started_secs));
                no_answer(hook, &volume_id)
            });
            // `alive_w` stays open until the answer is printed (then acknowledged) or this
            // process dies: either tells the worker.
            (output, Some(alive_w))
        }
    }
}

/// A pipe between the front and its worker, closed on exec: a program the worker runs
/// (the mountinfo reader of another namespace) must not hold the answer's or the log's
/// write end, or the front would wait for that program's end, not the worker's, to see
/// that its worker died.
fn worker_pipe() -> nix::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
}

/// Whether this process has one thread (the precondition of forking it).
fn single_threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|tasks| tasks.count() == 1)
}

/// Runs the hook in this process, which Cube may kill at any moment before it exits: the
/// answer is printed only when this returns, so nothing follows the hook (the work earlier
/// hooks abandoned is left to the next forked hook or the daemon's scan).
fn run_here(config: Config, request: HookRequest) -> HookOutput {
    let mut output = None;
    runtime().block_on(binary::run(
        config,
        request,
        &Caller::waiting(),
        binary::AfterAnswer::Return,
        |o| output = Some(o),
    ));
    output.expect("every hook answers")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("starting the async runtime")
}

/// The front: relay the worker's log lines to our stderr, collect its answer.
fn front(answer: OwnedFd, log: OwnedFd) -> Option<HookOutput> {
    let mut answer_file = std::fs::File::from(answer);
    let mut log_file = std::fs::File::from(log);
    let mut answer_bytes = Vec::new();
    let mut open = (true, true);
    let mut buf = [0u8; 8192];
    while open.0 || open.1 {
        let mut fds = Vec::new();
        if open.0 {
            fds.push(PollFd::new(answer_file.as_fd(), PollFlags::POLLIN));
        }
        if open.1 {
            fds.push(PollFd::new(log_file.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break,
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        let mut i = 0;
        if open.0 {
            if ready[i] {
                match answer_file.read(&mut buf) {
                    Ok(0) | Err(_) => open.0 = false,
                    Ok(n) => answer_bytes.extend_from_slice(&buf[..n]),
                }
            }
            i += 1;
        }
        if open.1 && ready[i] {
            match log_file.read(&mut buf) {
                Ok(0) | Err(_) => open.1 = false,
                Ok(n) => {
                    let _ = std::io::stderr().write_all(&buf[..n]);
                }
            }
        }
    }
    decode_answer(&answer_bytes)
}

/// What the front answers when its worker ended without answering.
fn no_answer(hook: HookKind, volume_id: &str) -> HookOutput {
    HookOutput::failure(&format!(
        "{hook} of volume {}: the hook's worker process ended without answering (killed?); \
         whatever it started is undone by the next hook or the daemon's reconciliation",
        crate::bridge::naming::quote_volume_id(volume_id)
    ))
}

/// `1` or `0` (success), then the JSON line.
fn encode_answer(output: &HookOutput) -> Vec<u8> {
    let mut bytes = vec![if output.success { b'1' } else { b'0' }];
    bytes.extend_from_slice(output.stdout.as_bytes());
    bytes
}

fn decode_answer(bytes: &[u8]) -> Option<HookOutput> {
    let (flag, json) = bytes.split_first()?;
    Some(HookOutput {
        success: *flag == b'1',
        stdout: String::from_utf8(json.to_vec()).ok()?,
    })
}

/// The worker: run the hook, answer through `answer`, then finish abandoned work.
fn worker(
    config: Config,
    request: HookRequest,
    answer: OwnedFd,
    log: OwnedFd,
    alive: OwnedFd,
) -> ! {
    // Cube's stdin/stdout are not ours to hold; stderr goes to the front until we answer.
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let _ = dup2_stdin(&null);
        let _ = dup2_stdout(&null);
    }
    let _ = dup2_stderr(&log);
    drop(log);
    let answer = Arc::new(Mutex::new(Some(std::fs::File::from(answer))));
    let log_to = (config.state.worker_log.clone(), config.state.dir.clone());
    let runtime = runtime();
    runtime.block_on(async {
        let (front_tx, front_rx) = tokio::sync::watch::channel(None);
        let delivery = Arc::new(FrontDelivery {
            answer: answer.clone(),
            front: front_rx,
            log_to: log_to.clone(),
        });
        let front = FrontWatch::new(alive).map(Arc::new);
        let gone_now: crate::bridge::caller::GoneNow = match &front {
            Some(front) => {
                let front = front.clone();
                Arc::new(move || front.read_now() == Some(Front::Gone))
            }
            None => Arc::new(|| false),
        };
        let caller = Caller::forked_worker(delivery, gone_now);
        let watcher = {
            let caller = caller.clone();
            tokio::spawn(async move {
                let outcome = match front {
                    Some(front) => front.wait().await,
                    // Cannot watch: behave as if the front never leaves.
                    None => std::future::pending().await,
                };
                if outcome == Front::Gone {
                    tracing::warn!("the process Cube started is gone; undoing this hook's work");
                    caller.leave();
                }
                let _ = front_tx.send(Some(outcome));
            })
        };
        // A stop of Cubelet's service signals every process of its group at once, this
        // worker with its front: the front dies before it can take back what the worker
        // did, so the worker does, as when the front alone is gone, and then ends without
        // the abandoned-work pass (the handler replaces the signal's default).
        let stopped = {
            let caller = caller.clone();
            use tokio::signal::unix::{SignalKind, signal};
            let mut term = signal(SignalKind::terminate()).ok();
            let mut int = signal(SignalKind::interrupt()).ok();
            let mut hup = signal(SignalKind::hangup()).ok();
            tokio::spawn(async move {
                tokio::select! {
                    () = received(&mut term) => {}
                    () = received(&mut int) => {}
                    () = received(&mut hup) => {}
                }
                // Stopped: work not answered yet is undone (an answer handed over but not
                // acknowledged too: the front that dies with us never printed it), as when
                // the front alone is gone, and nothing after the answer (the abandoned-work
                // pass) is begun; the worker then ends as it would have. systemd's SIGKILL
                // after its stop timeout bounds what is left.
                tracing::warn!("stopped by a signal; undoing this hook's unanswered work, and finishing no abandoned work");
                crate::transport::forked::stop_after_answer();
                caller.leave();
            })
        };
        binary::run(
            config,
            request,
            &caller,
            binary::AfterAnswer::FinishAbandonedWork,
            |output| {
                send_answer(&answer, &output, &log_to);
            },
        )
        .await;
        watcher.abort();
        stopped.abort();
    });
    std::process::exit(0)
}

/// The next delivery of a signal whose handler could be installed; never otherwise.
async fn received(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// Where the worker logs once it has answered: `state.worker_log`, and the state dir.
type LogTo = (WorkerLog, std::path::PathBuf);

/// Writes the answer to the front, once (a delivered answer is not sent again), and lets
/// go of the front's pipes so that it sees end of file on both: from now on the worker
/// logs to the worker log.
fn send_answer(answer: &Mutex<Option<std::fs::File>>, output: &HookOutput, log_to: &LogTo) {
    let Some(mut file) = answer.lock().expect("poisoned").take() else {
        return;
    };
    let _ = file.write_all(&encode_answer(output));
    drop(file);
    let sink = worker_log(log_to).or_else(|| {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .ok()
            .map(OwnedFd::from)
    });
    if let Some(sink) = sink {
        let _ = dup2_stderr(&sink);
    }
    crate::telemetry::after_answer();
}

/// Opens (creating it 0600) the worker log file for appending, as root, refusing what is
/// not the bridge's own plain file: a symlink, a FIFO (whose open would block the worker,
/// which still holds its volume's lock, until someone reads it; hence `O_NONBLOCK`), a
/// file another user owns (they would read root's logs), or one with another name linked
/// to it (a hard link to a root file, where the kernel's `protected_hardlinks` is off).
/// `state.worker_log` may name a directory others can write.
fn open_log_file(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    let euid = nix::unistd::geteuid().as_raw();
    if !meta.file_type().is_file() || meta.uid() != euid || meta.nlink() != 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a plain file of the bridge's own with one name (owner uid {}, \
                 {} links)",
                path.display(),
                meta.uid(),
                meta.nlink()
            ),
        ));
    }
    Ok(file)
}

/// Logs past this size start a new file (the old one kept as `<file>.1`).
const WORKER_LOG_LIMIT: u64 = 4 << 20;
/// The systemd journal's stream socket (what a service's stderr is connected to).
const JOURNAL_STREAM: &str = "/run/systemd/journal/stdout";

/// The worker log to write to: the journal (a stream connection, as systemd gives a
/// service) or a file of the state dir; `None` when neither can be opened.
fn worker_log((setting, state_dir): &LogTo) -> Option<OwnedFd> {
    let journal = || {
        let mut stream = std::os::unix::net::UnixStream::connect(JOURNAL_STREAM).ok()?;
        // The stream header: identifier, unit id, priority (info), level prefix, and no
        // forwarding to syslog, kmsg or the console.
        stream
            .write_all(b"cube-csi-bridge-worker\n\n6\n0\n0\n0\n0\n")
            .ok()?;
        Some(OwnedFd::from(stream))
    };
    let file = |path: &std::path::Path| {
        // Its size is asked of the file opened and checked, never of the path: a stat by
        // path follows a symlink (to a hung network mount, it would hold the worker and
        // its volume's lock), and a rename would move another user's link.
        let opened = open_log_file(path).ok()?;
        if opened.metadata().is_ok_and(|m| m.len() > WORKER_LOG_LIMIT) {
            let _ = std::fs::rename(path, path.with_extension("log.1"));
            return open_log_file(path).ok().map(OwnedFd::from);
        }
        Some(OwnedFd::from(opened))
    };
    match setting {
        WorkerLog::Journal => journal(),
        WorkerLog::File(path) => file(path),
        WorkerLog::Auto => journal().or_else(|| file(&state_dir.join("worker.log"))),
    }
}

/// What became of the front.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Front {
    /// It printed the answer and acknowledged it.
    Acknowledged,
    /// It exited or was killed without acknowledging.
    Gone,
}

/// The worker's side of `Delivery`: the answer goes to the front, and it reached Cube if
/// the front acknowledges it.
struct FrontDelivery {
    answer: Arc<Mutex<Option<std::fs::File>>>,
    front: tokio::sync::watch::Receiver<Option<Front>>,
    log_to: LogTo,
}

impl Delivery for FrontDelivery {
    fn deliver(
        &self,
        answer: Answer,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>> {
        Box::pin(async move {
            let output = HookOutput {
                stdout: crate::cube::hooks::answer_json(&answer).to_string(),
                success: true,
            };
            send_answer(&self.answer, &output, &self.log_to);
            // No time limit: a front that neither acknowledges nor exits is one Cube
            // has stopped, and Cube kills it at its deadline.
            let mut front = self.front.clone();
            matches!(
                front.wait_for(Option::is_some).await.map(|f| *f),
                Ok(Some(Front::Acknowledged))
            )
        })
    }
}

/// The worker's end of `alive`, whose other end the front holds: a byte when it has
/// printed the answer, end of file when it exits or is killed without one.
struct FrontWatch {
    pipe: tokio::net::unix::pipe::Receiver,
    /// What was read, once anything was. Read and set under this lock, by the task
    /// waiting for the front and by the hook's own checks alike, so that neither takes
    /// the front's byte from under the other and then reads the end of file as "gone".
    seen: Mutex<Option<Front>>,
}

impl FrontWatch {
    /// None when the pipe cannot be watched (then the front is taken as never leaving).
    fn new(alive: OwnedFd) -> Option<Self> {
        Some(Self {
            pipe: tokio::net::unix::pipe::Receiver::from_owned_fd(alive).ok()?,
            seen: Mutex::new(None),
        })
    }

    /// What became of the front, without waiting: None while it is there and said nothing.
    fn read_now(&self) -> Option<Front> {
        let mut seen = self.seen.lock().expect("poisoned");
        if seen.is_none() {
            let mut byte = [0u8; 1];
            // A read of the descriptor itself: the runtime's `try_read` answers "would
            // block" without reading until its reactor has seen the pipe ready, which it
            // has not when nothing has waited yet.
            *seen = match nix::unistd::read(&self.pipe, &mut byte) {
                Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => None,
                Ok(1) if byte == *ACKNOWLEDGED => Some(Front::Acknowledged),
                // End of file (or any error): the front is gone.
                _ => Some(Front::Gone),
            };
        }
        *seen
    }

    /// Resolves when the front acknowledges or its end closes without a byte.
    async fn wait(&self) -> Front {
        loop {
            if self.pipe.readable().await.is_err() {
                let mut seen = self.seen.lock().expect("poisoned");
                return *seen.get_or_insert(Front::Gone);
            }
            // Through the runtime, so that a wake-up with nothing to read clears the
            // pipe's readiness instead of waking this again at once.
            let read = self.pipe.try_io(|| {
                self.read_now()
                    .ok_or_else(|| std::io::ErrorKind::WouldBlock.into())
            });
            if let Ok(front) = read {
                return front;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A front gone before the worker's runtime ever ran the task watching it (a worker
    /// that takes a free lock never yields to it) is seen at the hook's first check; a
    /// front still there, or one that acknowledged and exited, is not gone.
    #[tokio::test(flavor = "current_thread")]
    async fn a_front_gone_before_anything_waited_is_seen_at_once() {
        let delivery = |front: Arc<FrontWatch>| {
            let (_, rx) = tokio::sync::watch::channel(None);
            let delivery = Arc::new(FrontDelivery {
                answer: Arc::new(Mutex::new(None)),
                front: rx,
                log_to: (WorkerLog::Auto, std::path::PathBuf::from("/nonexistent")),
            });
            Caller::forked_worker(
                delivery,
                Arc::new(move || front.read_now() == Some(Front::Gone)),
            )
        };
        let (alive, front_end) = nix::unistd::pipe().unwrap();
        drop(front_end);
        let front = Arc::new(FrontWatch::new(alive).unwrap());
        assert!(delivery(front.clone()).is_gone(), "killed front not seen");
        assert_eq!(front.wait().await, Front::Gone);

        let (alive, front_end) = nix::unistd::pipe().unwrap();
        let front = Arc::new(FrontWatch::new(alive).unwrap());
        assert!(
            !delivery(front.clone()).is_gone(),
            "a living front taken for gone"
        );
        nix::unistd::write(&front_end, ACKNOWLEDGED).unwrap();
        drop(front_end);
        let caller = delivery(front.clone());
        assert!(!caller.is_gone(), "an acknowledging front taken for gone");
        assert_eq!(front.wait().await, Front::Acknowledged);
        assert!(!caller.is_gone(), "an acknowledged front taken for gone");
    }

    #[test]
    fn answers_round_trip() {
        for output in [
            HookOutput {
                stdout: "{\"host_path\":\"/x\"}".into(),
                success: true,
            },
            HookOutput::failure("boom"),
        ] {
            assert_eq!(decode_answer(&encode_answer(&output)), Some(output));
        }
        assert_eq!(decode_answer(b""), None);
    }

    /// What another user could put at `state.worker_log` in a directory they can write:
    /// a FIFO (before, opening it blocked the worker, its volume's lock held, until
    /// someone read it), a file of theirs, a hard link to a root file. None is written to;
    /// the bridge's own file is.
    #[test]
    fn the_worker_log_is_only_ever_the_bridges_own_plain_file() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("fifo.log");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap();
        let (done, opened) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || done.send(open_log_file(&path).is_ok()));
        let opened = opened
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("opening a FIFO as the worker log blocked");
        assert!(!opened, "a FIFO was taken for the worker log");

        let own = tmp.path().join("worker.log");
        open_log_file(&own).unwrap();
        let linked = tmp.path().join("linked.log");
        std::fs::hard_link(&own, &linked).unwrap();
        assert!(open_log_file(&linked).is_err(), "a file with two names");
        std::fs::remove_file(&linked).unwrap();
        open_log_file(&own).unwrap();
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&own, Some(1000), None).unwrap();
            assert!(open_log_file(&own).is_err(), "another user's file");
        }
    }

    /// A symlink at the worker log's path is neither followed nor moved, even when it
    /// leads to a file past the size that starts a new log (before, its target was
    /// stat'ed by path, and the link renamed aside).
    #[test]
    fn a_symlink_at_the_worker_log_is_neither_followed_nor_moved() {
        let tmp = tempfile::tempdir().unwrap();
        let big = tmp.path().join("big");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(WORKER_LOG_LIMIT + 1)
            .unwrap();
        let path = tmp.path().join("worker.log");
        std::os::unix::fs::symlink(&big, &path).unwrap();
        let setting = (WorkerLog::File(path.clone()), tmp.path().to_path_buf());
        assert!(
            worker_log(&setting).is_none(),
            "a symlink was taken for the worker log"
        );
        assert!(path.is_symlink(), "the link was moved");
        assert!(!tmp.path().join("worker.log.1").exists());
        // The bridge's own log past the limit starts a new file.
        std::fs::remove_file(&path).unwrap();
        open_log_file(&path)
            .unwrap()
            .set_len(WORKER_LOG_LIMIT + 1)
            .unwrap();
        assert!(worker_log(&setting).is_some());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        assert!(tmp.path().join("worker.log.1").exists());
    }

    #[test]
    fn the_front_and_worker_pipes_are_closed_on_exec() {
        let (read, write) = worker_pipe().unwrap();
        for end in [&read, &write] {
            let flags = nix::fcntl::fcntl(end, nix::fcntl::FcntlArg::F_GETFD).unwrap();
            assert!(
                nix::fcntl::FdFlag::from_bits_truncate(flags)
                    .contains(nix::fcntl::FdFlag::FD_CLOEXEC),
                "a program the worker runs would inherit it"
            );
        }
    }

    #[test]
    fn a_worker_that_never_answered_is_named_with_its_hook_and_volume() {
        let (answer_r, answer_w) = worker_pipe().unwrap();
        let (log_r, log_w) = worker_pipe().unwrap();
        drop((answer_w, log_w));
        assert_eq!(front(answer_r, log_r), None);
        let output = no_answer(HookKind::Attach, "vol-7");
        assert!(!output.success);
        assert!(
            output
                .stdout
                .contains("attach of volume \\\"vol-7\\\": the hook's worker"),
            "{}",
            output.stdout
        );
    }
}
