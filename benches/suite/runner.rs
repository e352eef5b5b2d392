//! The Go side of the measurements: `cubeclient bench` (tests/peers/cubeclient/bench.go),
//! a grpc-go client dialing as Cubelet does. The suite writes it one phase (a list of hook
//! calls) per line and reads back one result per line: per-call latencies and the wall
//! time of the phase. It also forks binary hooks with Cube's argv, as Cubelet does.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// One Cube hook call. `private_data` and `metadata` left out are filled in by the runner
/// from what the volume's last Create / Attach returned, as Cube remembers them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Call {
    pub op: &'static str,
    pub volume_id: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub sandbox_id: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub ref_count: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub volume_base_dir: String,
    /// Attach's private_data, when not the one this runner's Create got.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub private_data: Option<String>,
}

pub const NAMESPACE: &str = "bench";

impl Call {
    pub fn create(volume_id: &str) -> Call {
        Call {
            op: "create",
            volume_id: volume_id.into(),
            name: volume_id.into(),
            ..Default::default()
        }
    }

    pub fn destroy(volume_id: &str) -> Call {
        Call {
            op: "destroy",
            volume_id: volume_id.into(),
            ..Default::default()
        }
    }

    pub fn attach(volume_id: &str, sandbox: &str, ref_count: i64, base: &Path) -> Call {
        Call {
            op: "attach",
            volume_id: volume_id.into(),
            sandbox_id: sandbox.into(),
            namespace: NAMESPACE.into(),
            ref_count,
            volume_base_dir: base.display().to_string(),
            ..Default::default()
        }
    }

    /// An Attach of a volume this runner did not Create, with the private_data the
    /// bridge's Create would have returned for CSI volume `csi_volume_id`.
    pub fn attach_handle(
        volume_id: &str,
        csi_volume_id: &str,
        sandbox: &str,
        base: &Path,
    ) -> anyhow::Result<Call> {
        let handle = cube_csi_bridge::bridge::handoff::VolumeHandle {
            csi_volume_id: csi_volume_id.into(),
            volume_context: Default::default(),
            controller_publish: false,
            ..Default::default()
        };
        Ok(Call {
            private_data: Some(handle.encode().map_err(anyhow::Error::msg)?),
            ..Call::attach(volume_id, sandbox, 0, base)
        })
    }

    pub fn detach(volume_id: &str, sandbox: &str, ref_count: i64) -> Call {
        Call {
            op: "detach",
            volume_id: volume_id.into(),
            sandbox_id: sandbox.into(),
            namespace: NAMESPACE.into(),
            ref_count,
            ..Default::default()
        }
    }
}

/// Where a phase's calls go.
#[derive(Debug, Clone)]
pub enum Via {
    /// rpc: a Cube plugin socket.
    Socket(PathBuf),
    /// binary: fork this executable per call with this extra environment; `raw` judges
    /// only the exit status (the exec floor).
    Fork {
        exe: PathBuf,
        env: Vec<String>,
        raw: bool,
    },
}

#[derive(Serialize)]
struct Phase<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    binary: Option<String>,
    env: &'a [String],
    raw: bool,
    concurrency: usize,
    calls: &'a [Call],
}

/// The result of one phase.
#[derive(Debug, Deserialize)]
pub struct Outcome {
    pub wall_ns: i64,
    /// One per call, in call order.
    pub samples_ns: Vec<i64>,
    errors: usize,
    #[serde(default)]
    first_error: String,
}

impl Outcome {
    /// The samples of every `stride`-th call starting at `offset` (e.g. the Attaches of
    /// alternating Attach/Detach calls).
    pub fn every(&self, offset: usize, stride: usize) -> Vec<i64> {
        self.samples_ns
            .iter()
            .skip(offset)
            .step_by(stride)
            .copied()
            .collect()
    }
}

/// A running `cubeclient bench`.
pub struct Runner {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Runner {
    pub fn start(cubeclient: &Path, log: &Path) -> anyhow::Result<Runner> {
        let log = std::fs::File::create(log)?;
        let mut child = Command::new(cubeclient)
            .arg("bench")
            // Forked hooks inherit this environment; Cubelet's has no RUST_LOG.
            .env_remove("RUST_LOG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} bench", cubeclient.display()))?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        Ok(Runner {
            child,
            stdin,
            stdout,
        })
    }

    /// Runs `calls` through `concurrency` workers; any failed call fails the phase (a
    /// benchmark of failing calls would measure nothing).
    pub fn run(
        &mut self,
        name: &str,
        via: &Via,
        concurrency: usize,
        calls: &[Call],
    ) -> anyhow::Result<Outcome> {
        let (target, binary, env, raw) = match via {
            Via::Socket(p) => (Some(p.display().to_string()), None, &[][..], false),
            Via::Fork { exe, env, raw } => (None, Some(exe.display().to_string()), &env[..], *raw),
        };
        let phase = Phase {
            name,
            target,
            binary,
            env,
            raw,
            concurrency,
            calls,
        };
        serde_json::to_writer(&mut self.stdin, &phase)?;
        self.stdin.write_all(b"\n")?;
        self.stdin.flush()?;
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("cubeclient bench exited during phase {name}");
        }
        let outcome: Outcome = serde_json::from_str(&line)
            .with_context(|| format!("cubeclient bench answered {line:?}"))?;
        if outcome.errors > 0 {
            bail!(
                "phase {name}: {} of {} calls failed; first: {}",
                outcome.errors,
                calls.len(),
                outcome.first_error
            );
        }
        Ok(outcome)
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // It may be mid-phase after an error: stop it rather than wait for the phase.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
