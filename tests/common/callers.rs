//! Cube's callers behind one trait: the rpc client (tonic, dialing the `serve` socket as
//! Cubelet and CubeMaster do), the executable forked with Cube's exact argv and judged as
//! Cube judges it, and the Go cubeclient (tests/peers/cubeclient) in either transport.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use cube_csi_bridge::csi::Endpoint;
use cube_csi_bridge::proto::cube::v1 as pb;
use pb::volume_controller_service_client::VolumeControllerServiceClient;
use pb::volume_plugin_service_client::VolumePluginServiceClient;

use super::HOOK;

/// A failed hook as Cube sees it.
#[derive(Debug, Clone)]
pub struct CubeError {
    /// The message Cube would log.
    pub message: String,
    /// rpc: the gRPC code.
    pub code: Option<tonic::Code>,
    /// binary: the hook's exit code.
    pub exit_code: Option<i32>,
    /// binary: the hook's whole stdout (one JSON object).
    pub stdout: Option<String>,
}

/// One of Cube's four hooks, as Cube sends it.
#[derive(Debug, Clone)]
pub enum Hook {
    Create(pb::CreateRequest),
    Destroy(pb::DestroyRequest),
    Attach(pb::AttachRequest),
    Detach(pb::DetachRequest),
}

impl Hook {
    /// The argv after the executable, exactly as Cubelet and CubeMaster fork it: fixed
    /// order, `--private-data` only when non-empty, `--metadata` as Go's json.Marshal
    /// writes a map (compact, sorted keys).
    pub fn argv(&self) -> Vec<String> {
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        match self {
            Hook::Create(r) => words(&[
                "--op",
                "create",
                "--volume-id",
                &r.volume_id,
                "--name",
                &r.name,
            ]),
            Hook::Destroy(r) => words(&["--op", "destroy", "--volume-id", &r.volume_id]),
            Hook::Attach(r) => {
                let mut argv = words(&[
                    "--op",
                    "attach",
                    "--sandbox-id",
                    &r.sandbox_id,
                    "--namespace",
                    &r.namespace,
                    "--volume-id",
                    &r.volume_id,
                    "--ref-count",
                    &r.ref_count.to_string(),
                    "--volume-base-dir",
                    &r.volume_base_dir,
                ]);
                if !r.private_data.is_empty() {
                    argv.extend(words(&["--private-data", &r.private_data]));
                }
                argv
            }
            Hook::Detach(r) => {
                let sorted: BTreeMap<_, _> = r.metadata.iter().collect();
                words(&[
                    "--op",
                    "detach",
                    "--sandbox-id",
                    &r.sandbox_id,
                    "--namespace",
                    &r.namespace,
                    "--volume-id",
                    &r.volume_id,
                    "--ref-count",
                    &r.ref_count.to_string(),
                    "--metadata",
                    &serde_json::to_string(&sorted).unwrap(),
                ])
            }
        }
    }
}

/// Cube, as far as the bridge can tell.
#[async_trait]
pub trait CubeCaller: Send + Sync {
    /// Which caller this is, for messages.
    fn name(&self) -> String;
    async fn create(&self, req: pb::CreateRequest) -> Result<pb::CreateResponse, CubeError>;
    async fn destroy(&self, req: pb::DestroyRequest) -> Result<(), CubeError>;
    async fn attach(&self, req: pb::AttachRequest) -> Result<pb::AttachResponse, CubeError>;
    async fn detach(&self, req: pb::DetachRequest) -> Result<(), CubeError>;

    /// Any hook.
    async fn call(&self, hook: Hook) -> Result<Answer, CubeError> {
        Ok(match hook {
            Hook::Create(r) => Answer::Created(self.create(r).await?),
            Hook::Destroy(r) => self.destroy(r).await.map(|()| Answer::Done)?,
            Hook::Attach(r) => Answer::Attached(self.attach(r).await?),
            Hook::Detach(r) => self.detach(r).await.map(|()| Answer::Done)?,
        })
    }
}

/// A hook's successful answer.
#[derive(Debug, Clone)]
pub enum Answer {
    Created(pb::CreateResponse),
    Attached(pb::AttachResponse),
    Done,
}

/// Create, as CubeMaster sends it (the name is the volume id).
pub fn create_request(volume_id: &str) -> pb::CreateRequest {
    pb::CreateRequest {
        volume_id: volume_id.into(),
        name: volume_id.into(),
    }
}

/// Attach, as Cubelet sends it.
pub fn attach_request(
    namespace: &str,
    base_dir: &Path,
    sandbox: &str,
    volume_id: &str,
    ref_count: i64,
    private_data: &str,
) -> pb::AttachRequest {
    pb::AttachRequest {
        sandbox_id: sandbox.into(),
        namespace: namespace.into(),
        volume_id: volume_id.into(),
        volume_base_dir: base_dir.display().to_string(),
        ref_count,
        private_data: private_data.into(),
    }
}

/// Detach, as Cubelet sends it (`metadata` is what Attach answered).
pub fn detach_request(
    namespace: &str,
    sandbox: &str,
    volume_id: &str,
    ref_count: i64,
    metadata: &std::collections::HashMap<String, String>,
) -> pb::DetachRequest {
    pb::DetachRequest {
        sandbox_id: sandbox.into(),
        namespace: namespace.into(),
        volume_id: volume_id.into(),
        metadata: metadata.clone(),
        ref_count,
    }
}

/// Whether an exec failed only because the executable was still open for writing, which
/// is to retry (at most 100 times): a test that has just copied an executable shares its
/// write descriptor with any child another test's thread forks meanwhile, until that
/// child's exec closes it (ETXTBSY).
pub fn executable_busy(error: &std::io::Error, tries: &mut u32) -> bool {
    *tries += 1;
    error.kind() == std::io::ErrorKind::ExecutableFileBusy && *tries <= 100
}

// --- rpc -------------------------------------------------------------------------------

/// The `serve` daemon dialed over its Unix socket (Cube type `rpc`).
#[derive(Debug, Clone)]
pub struct RpcCaller {
    pub socket: PathBuf,
    /// The caller's deadline (grpc-timeout), as Cube sets one per hook.
    pub timeout: Option<Duration>,
}

impl RpcCaller {
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_path_buf(),
            timeout: None,
        }
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    fn channel(&self) -> tonic::transport::Channel {
        cube_csi_bridge::csi::client::channel(&Endpoint::Unix(self.socket.clone()))
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(timeout) = self.timeout {
            request.set_timeout(timeout);
        }
        request
    }
}

fn status(e: tonic::Status) -> CubeError {
    CubeError {
        message: e.message().to_string(),
        code: Some(e.code()),
        exit_code: None,
        stdout: None,
    }
}

#[async_trait]
impl CubeCaller for RpcCaller {
    fn name(&self) -> String {
        "rpc".into()
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::CreateResponse, CubeError> {
        VolumeControllerServiceClient::new(self.channel())
            .create(self.request(req))
            .await
            .map(tonic::Response::into_inner)
            .map_err(status)
    }

    async fn destroy(&self, req: pb::DestroyRequest) -> Result<(), CubeError> {
        VolumeControllerServiceClient::new(self.channel())
            .destroy(self.request(req))
            .await
            .map(|_| ())
            .map_err(status)
    }

    async fn attach(&self, req: pb::AttachRequest) -> Result<pb::AttachResponse, CubeError> {
        VolumePluginServiceClient::new(self.channel())
            .attach(self.request(req))
            .await
            .map(tonic::Response::into_inner)
            .map_err(status)
    }

    async fn detach(&self, req: pb::DetachRequest) -> Result<(), CubeError> {
        VolumePluginServiceClient::new(self.channel())
            .detach(self.request(req))
            .await
            .map(|_| ())
            .map_err(status)
    }
}

// --- forked binary ---------------------------------------------------------------------

/// The executable forked per hook with Cube's argv (Cube type `binary`).
#[derive(Debug, Clone)]
pub struct BinaryCaller {
    /// What is forked: the hook front unless a test names another executable.
    pub program: PathBuf,
    pub config: PathBuf,
    /// Extra environment for the forked process.
    pub env: Vec<(String, String)>,
    /// Every forked hook's stderr, in order.
    pub logs: Arc<Mutex<Vec<String>>>,
}

impl BinaryCaller {
    pub fn new(config: &Path) -> Self {
        Self {
            program: PathBuf::from(HOOK),
            config: config.to_path_buf(),
            env: Vec::new(),
            logs: Default::default(),
        }
    }

    pub fn with_env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Forks `program` instead of the hook front.
    pub fn with_program(mut self, program: &Path) -> Self {
        self.program = program.to_path_buf();
        self
    }

    fn command(&self, hook: &Hook) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.args(hook.argv())
            .env("CUBE_CSI_BRIDGE_CONFIG", &self.config)
            .env("RUST_LOG", "debug")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Starts the hook without waiting, for tests that kill it as Cube's deadline does.
    pub fn spawn(&self, hook: &Hook) -> tokio::process::Child {
        let mut busy = 0;
        loop {
            match self.command(hook).spawn() {
                Err(e) if executable_busy(&e, &mut busy) => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                started => return started.expect("the bridge executable starts"),
            }
        }
    }

    /// Forks the hook and judges the result as Cube does: exit 0 and the whole stdout one
    /// JSON object with no non-empty `error`.
    pub async fn run(
        &self,
        hook: &Hook,
    ) -> Result<serde_json::Map<String, serde_json::Value>, CubeError> {
        let mut busy = 0;
        let out = loop {
            match self.command(hook).output().await {
                Err(e) if executable_busy(&e, &mut busy) => {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await
                }
                out => break out.unwrap(),
            }
        };
        let argv = hook.argv();
        let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        self.logs.lock().unwrap().push(stderr);
        // Exactly one JSON object, success or failure.
        let object: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
                panic!("stdout of {argv:?} is not one JSON object ({e}): {stdout:?}")
            });
        assert!(
            stdout.trim_end().lines().count() == 1,
            "one line of stdout: {stdout:?}"
        );
        let error = object
            .get("error")
            .and_then(|e| e.as_str())
            .unwrap_or_default();
        if out.status.success() {
            assert!(error.is_empty(), "exit 0 with an error: {stdout}");
            Ok(object)
        } else {
            assert!(
                !error.is_empty(),
                "non-zero exit without an error: {stdout}"
            );
            Err(CubeError {
                message: error.to_string(),
                code: None,
                exit_code: out.status.code(),
                stdout: Some(stdout),
            })
        }
    }
}

fn text(object: &serde_json::Map<String, serde_json::Value>, key: &str) -> String {
    object
        .get(key)
        .and_then(|v| v.as_str())
        .unwrap_or_else(|| panic!("{key} is a string in {object:?}"))
        .to_string()
}

fn attach_answer(object: &serde_json::Map<String, serde_json::Value>) -> pb::AttachResponse {
    let metadata = object["metadata"]
        .as_object()
        .expect("metadata is an object")
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_str().expect("metadata values are strings").to_string(),
            )
        })
        .collect();
    pb::AttachResponse {
        host_path: text(object, "host_path"),
        metadata,
    }
}

#[async_trait]
impl CubeCaller for BinaryCaller {
    fn name(&self) -> String {
        "binary".into()
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::CreateResponse, CubeError> {
        let out = self.run(&Hook::Create(req)).await?;
        Ok(pb::CreateResponse {
            token: text(&out, "token"),
            private_data: text(&out, "private_data"),
        })
    }

    async fn destroy(&self, req: pb::DestroyRequest) -> Result<(), CubeError> {
        self.run(&Hook::Destroy(req)).await.map(|_| ())
    }

    async fn attach(&self, req: pb::AttachRequest) -> Result<pb::AttachResponse, CubeError> {
        let out = self.run(&Hook::Attach(req)).await?;
        Ok(attach_answer(&out))
    }

    async fn detach(&self, req: pb::DetachRequest) -> Result<(), CubeError> {
        self.run(&Hook::Detach(req)).await.map(|_| ())
    }
}

// --- Go: cubeclient --------------------------------------------------------------------

/// The directory holding cubeclient, or `None` when it is not configured (the test then
/// skips; in CI it fails instead, see [`super::skip`]).
pub fn peers_bin() -> Option<PathBuf> {
    super::cube_peers::peer_dir(
        super::cube_peers::PEERS_BIN_ENV,
        &["cubeclient"],
        "scripts/install-test-peers.sh",
    )
}

/// Upper bound for one cubeclient call (the bridge's own budgets are 20 s in tests).
const GO_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// How cubeclient reaches the bridge.
#[derive(Debug, Clone)]
pub enum GoTransport {
    /// grpc-go dialing the bare socket path, as Cube's plugin config holds it.
    Rpc { socket: PathBuf },
    /// os/exec forking the executable; the hook inherits cubeclient's environment (with
    /// the config), as it would Cubelet's.
    Binary { config: PathBuf },
}

/// Cube's own language driving the bridge: tests/peers/cubeclient.
#[derive(Debug, Clone)]
pub struct GoCaller {
    pub client: PathBuf,
    pub transport: GoTransport,
    /// A mount namespace file cubeclient runs in (so a forked hook runs there too).
    pub namespace: Option<PathBuf>,
}

impl GoCaller {
    pub fn new(peers_bin: &Path, transport: GoTransport) -> Self {
        Self {
            client: peers_bin.join("cubeclient"),
            transport,
            namespace: None,
        }
    }

    /// Runs cubeclient (and so every hook it forks) inside the mount namespace bound at
    /// `nsfile`, as Cubelet forks hooks inside its own.
    pub fn inside(mut self, nsfile: &Path) -> Self {
        self.namespace = Some(nsfile.to_path_buf());
        self
    }

    /// Runs one hook; `Ok` is cubeclient's success object.
    async fn run(&self, op: &[String]) -> Result<serde_json::Value, CubeError> {
        let mut cmd = match &self.namespace {
            None => tokio::process::Command::new(&self.client),
            Some(nsfile) => {
                let mut nsenter = tokio::process::Command::new("nsenter");
                nsenter
                    .arg(format!("--mount={}", nsfile.display()))
                    .arg(&self.client);
                nsenter
            }
        };
        match &self.transport {
            GoTransport::Rpc { socket } => cmd.arg("rpc").arg("--target").arg(socket),
            GoTransport::Binary { config } => cmd
                .arg("binary")
                .arg("--path")
                .arg(HOOK)
                .env("CUBE_CSI_BRIDGE_CONFIG", config),
        };
        cmd.args(op)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let name = self.name();
        let out = tokio::time::timeout(GO_CALL_TIMEOUT, cmd.output())
            .await
            .unwrap_or_else(|_| panic!("{name} {op:?} hung"))
            .expect("cubeclient runs");
        let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let context = || format!("{name} {op:?}: stdout {stdout:?}, stderr {stderr}");
        assert_eq!(stdout.lines().count(), 1, "one line: {}", context());
        let value: serde_json::Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", context()));
        match out.status.code() {
            Some(0) => Ok(value),
            Some(1) => {
                let text = |k: &str| value.get(k).and_then(|v| v.as_str()).map(str::to_string);
                let failure = CubeError {
                    message: text("error").unwrap_or_default(),
                    code: text("code").map(|name| code_named(&name)),
                    exit_code: value
                        .get("exit_code")
                        .and_then(|v| v.as_i64())
                        .map(|c| c as i32),
                    stdout: text("stdout"),
                };
                assert!(
                    !failure.message.is_empty(),
                    "failure without error: {}",
                    context()
                );
                Err(failure)
            }
            _ => panic!(
                "cubeclient usage error or crash ({}): {}",
                out.status,
                context()
            ),
        }
    }
}

/// The tonic code grpc-go names `name` (its String(): `InvalidArgument`, `NotFound`, …).
fn code_named(name: &str) -> tonic::Code {
    (0..=16)
        .map(tonic::Code::from_i32)
        .find(|code| format!("{code:?}") == name)
        .unwrap_or_else(|| panic!("cubeclient reported an unknown gRPC code {name:?}"))
}

#[async_trait]
impl CubeCaller for GoCaller {
    fn name(&self) -> String {
        match self.transport {
            GoTransport::Rpc { .. } => "go rpc".into(),
            GoTransport::Binary { .. } => "go binary".into(),
        }
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::CreateResponse, CubeError> {
        // cubeclient takes the hook's argv, without `--op`, in both transports.
        let out = self.run(&Hook::Create(req).argv()[1..]).await?;
        let field = |k: &str| out[k].as_str().expect("string field").to_string();
        Ok(pb::CreateResponse {
            token: field("token"),
            private_data: field("private_data"),
        })
    }

    async fn destroy(&self, req: pb::DestroyRequest) -> Result<(), CubeError> {
        self.run(&Hook::Destroy(req).argv()[1..]).await.map(|_| ())
    }

    async fn attach(&self, req: pb::AttachRequest) -> Result<pb::AttachResponse, CubeError> {
        let out = self.run(&Hook::Attach(req).argv()[1..]).await?;
        let object = out.as_object().expect("an object");
        Ok(attach_answer(object))
    }

    async fn detach(&self, req: pb::DetachRequest) -> Result<(), CubeError> {
        self.run(&Hook::Detach(req).argv()[1..]).await.map(|_| ())
    }
}
