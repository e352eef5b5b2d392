//! Child processes of the suite (drivers, floors, bridge daemons, the Go runner): started
//! with their output in a log file, stopped with SIGTERM (SIGKILL after a grace period)
//! when dropped, and measured (resident memory) through /proc.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A running child; stopped on drop.
pub struct Proc {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Proc {
    /// Spawns `cmd` with stdin closed and stdout+stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> anyhow::Result<Proc> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({cmd:?})"))?;
        Ok(Proc {
            name: name.to_string(),
            log: log.to_path_buf(),
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails with the log's tail if the child has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 20)
            );
        }
        Ok(())
    }

    /// Waits until `socket` accepts a connection (the child is serving).
    pub fn wait_for_socket(&mut self, socket: &Path, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not listen on {} within {timeout:?}; last lines of {}:\n{}",
                    self.name,
                    socket.display(),
                    self.log.display(),
                    tail(&self.log, 20)
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Resident memory (VmRSS) in KiB.
    pub fn rss_kib(&self) -> anyhow::Result<u64> {
        rss_kib(self.pid())
    }

    /// Sends SIGINT and waits up to `grace` for the child to exit (a tracer then writes
    /// its summary); SIGTERM and SIGKILL follow if it has not.
    pub fn interrupt(&mut self, grace: Duration) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGINT);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.stop(Duration::from_secs(5));
    }

    /// SIGTERM, then SIGKILL if the child has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(10));
    }
}

/// VmRSS of `pid` in KiB.
pub fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS in /proc/<pid>/status")
}

/// CPU time (user + system, every thread the process has had) of `pid` so far, from
/// /proc/<pid>/stat (clock ticks: 10 ms on most kernels, so measure over seconds).
pub fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name is in parentheses and may hold spaces: fields count after it.
    let after_name = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("no command name in /proc/<pid>/stat")?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 (utime) and 15 (stime) of proc(5); the state, field 3, is the first here.
    let ticks = |i: usize| -> anyhow::Result<u64> {
        Ok(fields
            .get(i - 3)
            .context("short /proc/<pid>/stat")?
            .parse()?)
    };
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?
        .filter(|t| *t > 0)
        .context("no CLK_TCK")? as f64;
    Ok(Duration::from_secs_f64(
        (ticks(14)? + ticks(15)?) as f64 / per_second,
    ))
}

/// CPU time of the threads `pid` has now, summed from /proc/<pid>/task/*/schedstat (ns:
/// precise over a few ms, where `cpu_time`'s clock ticks are not). A thread that ends
/// between two readings takes its time with it: measure spans shorter than the
/// runtime's idle-thread keep-alive (tokio: 10 s).
pub fn threads_cpu(pid: u32) -> anyhow::Result<Duration> {
    let mut ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(stat) = std::fs::read_to_string(task?.path().join("schedstat")) else {
            continue; // the thread ended meanwhile
        };
        ns += stat
            .split_whitespace()
            .next()
            .context("empty /proc/<pid>/task/<tid>/schedstat")?
            .parse::<u64>()?;
    }
    Ok(Duration::from_nanos(ns))
}

/// The last `n` lines of a log file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
