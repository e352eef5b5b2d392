//! The command line: subcommands, and the binary-hook argv exactly as Cube forks it.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::bridge::HookKind;
use crate::config::{self, Config};
use crate::cube::hooks::HookArgv;
use crate::mount::view::{MOUNTINFO_SUBCOMMAND, print_mountinfo_in_namespace};
use crate::telemetry::{self, LogFormat};
use crate::transport::forked::{HookOutput, HookRequest};

/// Exit code for a hook or command that failed.
pub(crate) const EXIT_FAILURE: u8 = 1;
/// Exit code for a malformed command line (EX_USAGE).
const EXIT_USAGE: u8 = 64;
/// Exit code for a config the operator must fix (EX_CONFIG).
pub(crate) const EXIT_CONFIG: u8 = 78;

/// How long `serve` keeps the embedded store's file open after its last call: long enough
/// for the calls of one Create against a fast driver, short enough that a forked hook or
/// an operator's command waiting for the file lock hardly notices.
const SERVE_STORE_LINGER: std::time::Duration = std::time::Duration::from_millis(5);

#[derive(Debug, Parser)]
#[command(
    name = "cube-csi-bridge",
    version,
    about = "Serve any Kubernetes CSI driver as a CubeSandbox volume plugin",
    long_about = "Serve any Kubernetes CSI driver as a CubeSandbox volume plugin.\n\n\
        Cube calls the bridge's Create/Destroy (CubeMaster) and Attach/Detach (Cubelet) hooks, \
        either over gRPC (`serve`, registered as type rpc) or by forking this executable \
        (registered as type binary; Cube passes `--op …` directly). The bridge turns each hook \
        into CSI calls on an unmodified CSI driver.",
    after_help = "The config file of `serve`, `check`, `list`, `register` and `probe` is --config, else \
        $CUBE_CSI_BRIDGE_CONFIG, else /etc/cube-csi-bridge/<name>.toml when the executable is \
        invoked as cube-csi-bridge-<name> and that file exists, else \
        /etc/cube-csi-bridge/config.toml. A file may list several drivers ([[drivers]]): `serve` \
        serves them all, the other commands cover them all unless --driver names one, and a \
        forked hook serves the one its executable name cube-csi-bridge-<driver> names."
)]
pub struct Cli {
    /// Log line format on stderr (filter with RUST_LOG, e.g. RUST_LOG=debug).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t,
        env = "CUBE_CSI_BRIDGE_LOG_FORMAT"
    )]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon: serve Cube's hooks over gRPC on a Unix socket (Cube type `rpc`).
    Serve(ServeArgs),
    /// Run one hook as Cube's binary plugin (Cube forks the executable with `--op …`;
    /// the word `hook` may be left out).
    Hook(HookArgs),
    /// Run a whole Cube volume lifecycle against a built-in local-directory CSI driver,
    /// with no config and no external service (needs root for mounts).
    Demo(DemoArgs),
    /// Check the config, the CSI driver and the host before registering the bridge
    /// (including that a test mount under the base dir is visible to Cubelet).
    Check(CheckArgs),
    /// Print the CubeMaster conf.yaml and Cubelet config.toml entries for this instance.
    Register(RegisterArgs),
    /// List the volumes this node has attached (node journal joined with the mount
    /// table), or with --controller the controller store's records (state, age, handle).
    List(ListArgs),
    /// Release holders Cube no longer counts (a sandbox it never Detaches, or the holders
    /// a lost journal record could not name): the volume is torn down once none is left.
    Holders(HoldersArgs),
    /// Ask the running daemon over its socket whether it is alive (or, with --ready, ready:
    /// its CSI driver answers Probe); exit 0 if so, 1 if not, 78 for a bad config.
    Probe(ProbeArgs),
    /// Snapshots of Cube volumes (CSI CreateSnapshot, ListSnapshots, DeleteSnapshot),
    /// recorded in the controller store.
    Snapshot(SnapshotArgs),
    /// Make a CSI volume from a snapshot and record it as a new Cube volume id: CubeMaster's
    /// Create of that id then returns it instead of an empty volume.
    Restore(CopyArgs),
    /// Make a CSI volume from another volume (CLONE_VOLUME) and record it as a new Cube
    /// volume id: CubeMaster's Create of that id then returns it.
    Clone(CopyArgs),
    /// Grow a volume: ControllerExpandVolume, the new capacity recorded, then
    /// NodeExpandVolume where this node has it staged or published.
    Expand(ExpandArgs),
}

#[derive(Debug, Args)]
pub struct SnapshotArgs {
    #[command(subcommand)]
    pub action: SnapshotAction,
}

#[derive(Debug, clap::Subcommand)]
pub enum SnapshotAction {
    /// Snapshot Cube volume VOLUME_ID as --name (a repeated command adopts what an earlier
    /// one made).
    Create(SnapshotCreateArgs),
    /// List the snapshots with what the driver says of each (LIST_SNAPSHOTS) and the
    /// volumes restored from them.
    List(SnapshotListArgs),
    /// Delete a snapshot (the driver refuses one still in use; then both it and its record
    /// are kept).
    Delete(SnapshotDeleteArgs),
}

#[derive(Debug, Args)]
pub struct SnapshotCreateArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The Cube volume to snapshot.
    #[arg(value_name = "VOLUME_ID", allow_hyphen_values = true)]
    pub volume_id: String,
    /// The snapshot's name ([A-Za-z0-9_-]{1,128}).
    #[arg(long, value_name = "SNAPSHOT", allow_hyphen_values = true)]
    pub name: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = crate::admin::Output::Text)]
    pub output: crate::admin::Output,
}

#[derive(Debug, Args)]
pub struct SnapshotListArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Output format.
    #[arg(long, value_enum, default_value_t = crate::admin::Output::Text)]
    pub output: crate::admin::Output,
}

#[derive(Debug, Args)]
pub struct SnapshotDeleteArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The snapshot's name.
    #[arg(value_name = "SNAPSHOT", allow_hyphen_values = true)]
    pub snapshot: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = crate::admin::Output::Text)]
    pub output: crate::admin::Output,
}

/// `restore SNAPSHOT --as VOLUME_ID` and `clone VOLUME_ID --as NEW_ID`.
#[derive(Debug, Args)]
pub struct CopyArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The snapshot (restore) or Cube volume (clone) to copy.
    #[arg(value_name = "SOURCE", allow_hyphen_values = true)]
    pub source: String,
    /// The new Cube volume id; it must not exist yet.
    #[arg(long = "as", value_name = "VOLUME_ID", allow_hyphen_values = true)]
    pub as_volume_id: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = crate::admin::Output::Text)]
    pub output: crate::admin::Output,
}

#[derive(Debug, Args)]
pub struct ExpandArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The Cube volume id.
    #[arg(value_name = "VOLUME_ID", allow_hyphen_values = true)]
    pub volume_id: String,
    /// The new size: bytes, or with a suffix Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or
    /// k, M, G, T, P, E (powers of 1000), e.g. 20Gi. Never smaller than the current one.
    #[arg(long, value_name = "SIZE", value_parser = crate::bridge::expansion::parse_size)]
    pub size: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = crate::admin::Output::Text)]
    pub output: crate::admin::Output,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Output format.
    #[arg(long, value_enum, default_value_t = crate::admin::Output::Text)]
    pub output: crate::admin::Output,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// List the controller store's records instead of this node's volumes.
    #[arg(long)]
    pub controller: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = crate::admin::Output::Text)]
    pub output: crate::admin::Output,
}

#[derive(Debug, Args)]
pub struct HoldersArgs {
    #[command(subcommand)]
    pub action: HoldersAction,
}

#[derive(Debug, clap::Subcommand)]
pub enum HoldersAction {
    /// Release one sandbox (--namespace and --sandbox), every sandbox of a namespace
    /// (--namespace), or the unknown holders of a record that lost them (--unknown).
    Release(ReleaseArgs),
    /// List the holders of this node's volumes (or of VOLUME_ID) with their age, how
    /// long their namespace has made no hook, and STALE past node.stale_holder_secs.
    List(ListHoldersArgs),
}

#[derive(Debug, Args)]
pub struct ListHoldersArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Only this Cube volume's holders.
    #[arg(value_name = "VOLUME_ID")]
    pub volume_id: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = crate::admin::Output::Text)]
    pub output: crate::admin::Output,
}

#[derive(Debug, Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The Cube volume id.
    #[arg(value_name = "VOLUME_ID")]
    pub volume_id: String,
    /// The containerd namespace whose holder(s) to release.
    #[arg(long, conflicts_with = "unknown", required_unless_present = "unknown")]
    pub namespace: Option<String>,
    /// The sandbox to release (default: every sandbox of --namespace).
    #[arg(long, requires = "namespace")]
    pub sandbox: Option<String>,
    /// Release the holders a lost journal record could not name.
    #[arg(long)]
    pub unknown: bool,
}

/// The `probe` command line.
#[derive(Debug, Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Readiness: also require the daemon's CSI driver to answer Probe (without it:
    /// liveness, the daemon answers).
    #[arg(long)]
    pub ready: bool,
    /// How long to wait for the daemon's answer, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=300))]
    pub timeout: u64,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Serve metrics on this address instead of metrics.listen's (its port is kept): the
    /// pod's own IP in Kubernetes (the chart passes `$(POD_IP)`), so that the endpoint is
    /// bound where Prometheus scrapes and no wider, even on the host network.
    #[arg(long, value_name = "IP")]
    pub metrics_listen_ip: Option<std::net::IpAddr>,
}

#[derive(Debug, Args)]
pub struct ConfigArg {
    /// The config file (TOML).
    #[arg(long, short = 'c', value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// In a config file listing several drivers: only this one (default: every driver).
    #[arg(long, value_name = "NAME")]
    pub driver: Option<String>,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Keep the demo's temporary directory (driver data, state, sockets) for inspection.
    #[arg(long)]
    pub keep: bool,
}

#[derive(Debug, Args)]
pub struct RegisterArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// For binary registration: the installed executable the printed `ln -s` line links
    /// `/usr/local/bin/cube-csi-bridge-<driver>` to (default: the hook front cube-csi-hook
    /// beside this executable, else this executable); Cube forks that symlink, whose name
    /// selects the config.
    #[arg(long, value_name = "PATH")]
    pub binary_path: Option<PathBuf>,
}

/// The binary-hook argv. Cube passes flag and value as separate arguments, never
/// `--k=v`, and values may begin with `-` (volume ids may), so every value accepts that.
#[derive(Debug, Args)]
pub struct HookArgs {
    /// The hook: create and destroy come from CubeMaster, attach and detach from Cubelet.
    #[arg(long, value_parser = HookKind::parse, value_name = "create|destroy|attach|detach")]
    pub op: HookKind,
    /// Cube volume id ([A-Za-z0-9_-]{1,128}); every op.
    #[arg(long, allow_hyphen_values = true, value_name = "ID")]
    pub volume_id: Option<String>,
    /// Cube volume name; create.
    #[arg(long, allow_hyphen_values = true)]
    pub name: Option<String>,
    /// Sandbox id; attach, detach.
    #[arg(long, allow_hyphen_values = true, value_name = "ID")]
    pub sandbox_id: Option<String>,
    /// containerd namespace of the sandbox; attach, detach.
    #[arg(long, allow_hyphen_values = true)]
    pub namespace: Option<String>,
    /// Holders before (attach) or after (detach) this sandbox on this node; attach, detach.
    #[arg(long, allow_hyphen_values = true, value_name = "N")]
    pub ref_count: Option<String>,
    /// Cubelet's volume_plugin_base_dir; attach.
    #[arg(long, allow_hyphen_values = true, value_name = "DIR")]
    pub volume_base_dir: Option<String>,
    /// What create returned as private_data; attach (omitted by Cube when empty).
    #[arg(long, allow_hyphen_values = true)]
    pub private_data: Option<String>,
    /// What attach returned as metadata, as a JSON object of strings; detach.
    #[arg(long, allow_hyphen_values = true, value_name = "JSON")]
    pub metadata: Option<String>,
    /// The config file (not passed by Cube; see the config lookup rule in --help).
    #[arg(long, short = 'c', value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// In a config file listing several drivers, the one this hook is for (not passed
    /// by Cube: the executable's name cube-csi-bridge-<driver> picks it).
    #[arg(long, value_name = "NAME")]
    pub driver: Option<String>,
}

impl HookArgs {
    /// Builds the wire request, naming the first missing or malformed argument.
    pub fn request(&self) -> Result<HookRequest, String> {
        let argv = HookArgv {
            volume_id: self.volume_id.clone(),
            name: self.name.clone(),
            sandbox_id: self.sandbox_id.clone(),
            namespace: self.namespace.clone(),
            ref_count: self.ref_count.clone(),
            volume_base_dir: self.volume_base_dir.clone(),
            private_data: self.private_data.clone(),
            metadata: self.metadata.clone(),
        };
        HookRequest::from_argv(self.op, &argv)
    }
}

/// The forked hook's command line as its front executable reads it (`transport::front`):
/// the hook's own flags and the log format, nothing else, so that it builds no other
/// command's parser. `None` for anything else (another subcommand, `--help`, a malformed
/// argv): the full binary answers those, with its own errors.
pub fn parse_front_argv(args: &[OsString]) -> Option<(LogFormat, HookArgs)> {
    #[derive(Debug, Parser)]
    #[command(
        name = "cube-csi-hook",
        disable_help_flag = true,
        disable_version_flag = true
    )]
    struct FrontCli {
        #[arg(long, value_enum, default_value_t, env = "CUBE_CSI_BRIDGE_LOG_FORMAT")]
        log_format: LogFormat,
        #[command(flatten)]
        hook: HookArgs,
    }
    let mut args = args.to_vec();
    if args.get(1).is_some_and(|a| a == "hook") {
        args.remove(1);
    }
    FrontCli::try_parse_from(args)
        .ok()
        .map(|cli| (cli.log_format, cli.hook))
}

/// Locates and loads a forked hook's config (the lookup rule of `config::locate`).
pub fn hook_config(hook: &HookArgs, argv0: Option<&str>) -> Result<Config, config::ConfigError> {
    let located = locate_config(hook.config.clone(), hook.driver.clone(), argv0);
    Config::load_driver(&located.path, &located.driver)
}

/// Parses the arguments Cube passes a forked hook (everything after the executable name,
/// `--op …`) into the hook's wire request, as a forked hook does before it reads its
/// config or touches anything. The error is what the hook would print.
pub fn parse_hook_argv(args: &[OsString]) -> Result<HookRequest, String> {
    let mut full = vec![OsString::from("cube-csi-bridge"), OsString::from("hook")];
    full.extend(args.iter().cloned());
    match Cli::try_parse_from(full) {
        Ok(Cli {
            command: Command::Hook(hook),
            ..
        }) => hook.request(),
        Ok(_) => Err("not a hook".into()),
        Err(e) => Err(e.render().to_string()),
    }
}

/// Entry point of the executable.
pub fn main(args: Vec<OsString>) -> ExitCode {
    // The namespace reader must setns() before any thread exists (see mount::view).
    if args.get(1).is_some_and(|a| a == MOUNTINFO_SUBCOMMAND) {
        let Some(file) = args.get(2) else {
            return ExitCode::from(EXIT_USAGE);
        };
        return match print_mountinfo_in_namespace(std::path::Path::new(file)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{}: {e}", std::path::Path::new(file).display());
                ExitCode::from(EXIT_FAILURE)
            }
        };
    }
    let argv0 = args.first().and_then(|a| a.to_str()).map(str::to_string);
    let is_hook_form = args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|a| a == "--op" || a.starts_with("--op=") || a == "hook");
    let mut args = args;
    if args.get(1).is_some_and(|a| a != "hook") && is_hook_form {
        args.insert(1, OsString::from("hook"));
    }
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) if is_hook_form && e.use_stderr() => {
            // A forked hook answers even a bad argv with one JSON object.
            let message = e.render().to_string();
            return finish_hook(HookOutput::failure(message.trim()), EXIT_USAGE);
        }
        Err(e) => e.exit(),
    };
    match cli.command {
        Command::Hook(hook) => run_hook(cli.log_format, hook, argv0.as_deref()),
        Command::Serve(arg) => {
            telemetry::init(cli.log_format, "info");
            let mut configs = match load_configs(arg.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if let Some(ip) = arg.metrics_listen_ip {
                for config in &mut configs {
                    let Some(listen) = &mut config.metrics.listen else {
                        eprintln!(
                            "--metrics-listen-ip {ip}: the config sets no metrics.listen (whose \
                             port it keeps)"
                        );
                        return ExitCode::from(EXIT_CONFIG);
                    };
                    listen.set_ip(ip);
                }
            }
            let runtime = tokio::runtime::Runtime::new().expect("starting the async runtime");
            // The daemon lives on: the embedded store's file stays open a moment after
            // each call, so that a Create's second write and the next Create find it open.
            crate::store::embedded::keep_open_when_idle(SERVE_STORE_LINGER);
            let served = runtime.block_on(async {
                // Before anything is bound: a SIGTERM from then on stops the daemon cleanly.
                let shutdown = crate::transport::server::shutdown_signal();
                let daemon = crate::transport::server::Daemon::open(configs).await?;
                daemon.run(shutdown).await
            });
            crate::store::embedded::close_idle_files();
            match served {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e}");
                    ExitCode::from(e.exit_code())
                }
            }
        }
        Command::Demo(demo) => {
            telemetry::init(cli.log_format, "warn");
            let runtime = tokio::runtime::Runtime::new().expect("starting the async runtime");
            match runtime.block_on(crate::demo::run(demo.keep)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("demo failed: {e:#}");
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Command::Check(args) => {
            // Findings are printed; retry warnings would only repeat them.
            telemetry::init(cli.log_format, "error");
            let configs = match load_configs(args.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let runtime = tokio::runtime::Runtime::new().expect("starting the async runtime");
            let several = configs.len() > 1;
            let mut all_ok = true;
            for config in configs {
                let driver = config.driver.clone();
                match runtime.block_on(crate::admin::check(config, Duration::from_secs(10))) {
                    Ok(findings) => {
                        if several && args.output == crate::admin::Output::Text {
                            println!("== driver {driver} ==");
                        }
                        print!("{}", crate::admin::render_findings(&findings, args.output));
                        all_ok &= findings.iter().all(|f| f.ok);
                    }
                    Err(e) => {
                        eprintln!("check of driver {driver} failed: {e:#}");
                        all_ok = false;
                    }
                }
            }
            if all_ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_FAILURE)
            }
        }
        Command::Register(reg) => {
            telemetry::init(cli.log_format, "warn");
            // One driver of several gets no socket drop-in: that lists every driver's.
            let narrowed = reg.config.driver.is_some();
            let configs = match load_configs(reg.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let binary = reg.binary_path.unwrap_or_else(|| {
                let own = std::env::current_exe()
                    .unwrap_or_else(|_| PathBuf::from("/usr/local/bin/cube-csi-bridge"));
                crate::transport::front::front_beside(&own)
            });
            for config in &configs {
                print!("{}", crate::admin::registration_snippets(config, &binary));
            }
            if !narrowed && configs.first().is_some_and(|c| c.metrics.driver_label) {
                print!("{}", crate::admin::systemd_socket_drop_in(&configs));
            }
            ExitCode::SUCCESS
        }
        Command::Probe(args) => {
            telemetry::init(cli.log_format, "off");
            let configs = match load_configs(args.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("starting the async runtime");
            let timeout = Duration::from_secs(args.timeout);
            let several = configs.len() > 1;
            let mut healthy = true;
            for config in &configs {
                let verdict = runtime.block_on(crate::probe::probe(config, args.ready, timeout));
                if several {
                    println!("{}: {}", config.driver, verdict.line);
                } else {
                    println!("{}", verdict.line);
                }
                healthy &= verdict.healthy;
            }
            ExitCode::from(if healthy { 0 } else { EXIT_FAILURE })
        }
        Command::Holders(HoldersArgs {
            action: HoldersAction::Release(args),
        }) => {
            telemetry::init(cli.log_format, "warn");
            let mut configs = match load_configs(args.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if configs.len() != 1 {
                eprintln!("the config lists several drivers; name the volume's with --driver");
                return ExitCode::from(EXIT_USAGE);
            }
            let release = match (args.namespace, args.sandbox, args.unknown) {
                (Some(namespace), Some(sandbox), false) => {
                    crate::bridge::Release::Sandbox { namespace, sandbox }
                }
                (Some(namespace), None, false) => crate::bridge::Release::Namespace(namespace),
                _ => crate::bridge::Release::Unknown,
            };
            let runtime = tokio::runtime::Runtime::new().expect("starting the async runtime");
            let config = configs.remove(0);
            match runtime.block_on(crate::admin::release_holders(
                config,
                &args.volume_id,
                &release,
            )) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("holders release failed: {e:#}");
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Command::Holders(HoldersArgs {
            action: HoldersAction::List(args),
        }) => {
            telemetry::init(cli.log_format, "warn");
            let configs = match load_configs(args.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("starting the async runtime");
            match runtime.block_on(crate::admin::list_holders_drivers(
                &configs,
                args.volume_id.as_deref(),
                args.output,
            )) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("holders list failed: {e:#}");
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Command::Snapshot(SnapshotArgs { action }) => {
            telemetry::init(cli.log_format, "warn");
            let (config, name) = match &action {
                SnapshotAction::Create(a) => (&a.config, "snapshot create"),
                SnapshotAction::List(a) => (&a.config, "snapshot list"),
                SnapshotAction::Delete(a) => (&a.config, "snapshot delete"),
            };
            let config = match one_config(config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let work = async {
                match &action {
                    SnapshotAction::Create(a) => {
                        crate::copies::create_snapshot(config, &a.volume_id, &a.name, a.output)
                            .await
                    }
                    SnapshotAction::List(a) => {
                        crate::copies::list_snapshots(config, a.output).await
                    }
                    SnapshotAction::Delete(a) => {
                        crate::copies::delete_snapshot(config, &a.snapshot, a.output).await
                    }
                }
            };
            run_command(name, work)
        }
        Command::Restore(args) => {
            telemetry::init(cli.log_format, "warn");
            let config = match one_config(&args.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            run_command(
                "restore",
                crate::copies::restore(config, &args.source, &args.as_volume_id, args.output),
            )
        }
        Command::Clone(args) => {
            telemetry::init(cli.log_format, "warn");
            let config = match one_config(&args.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            run_command(
                "clone",
                crate::copies::clone_volume(config, &args.source, &args.as_volume_id, args.output),
            )
        }

        Command::Expand(args) => {
            telemetry::init(cli.log_format, "warn");
            let mut configs = match load_configs(args.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if configs.len() != 1 {
                eprintln!("the config lists several drivers; name the volume's with --driver");
                return ExitCode::from(EXIT_USAGE);
            }
            let runtime = tokio::runtime::Runtime::new().expect("starting the async runtime");
            let config = configs.remove(0);
            match runtime.block_on(crate::admin::expand(
                config,
                &args.volume_id,
                args.size,
                args.output,
            )) {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("expand failed: {e:#}");
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Command::List(args) => {
            telemetry::init(cli.log_format, "warn");
            let configs = match load_configs(args.config, argv0.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("starting the async runtime");
            let listed = runtime.block_on(crate::admin::list_drivers(
                &configs,
                args.controller,
                args.output,
            ));
            match listed {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("list failed: {e:#}");
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
    }
}

/// The one driver a command acts on: the config's only driver, or the one --driver names.
fn one_config(arg: &ConfigArg, argv0: Option<&str>) -> Result<Config, ExitCode> {
    let arg = ConfigArg {
        config: arg.config.clone(),
        driver: arg.driver.clone(),
    };
    let mut configs = load_configs(arg, argv0)?;
    if configs.len() != 1 {
        eprintln!("the config lists several drivers; name the one to act on with --driver");
        return Err(ExitCode::from(EXIT_USAGE));
    }
    Ok(configs.remove(0))
}

/// Runs one operator command to completion: its text on stdout, or its error on stderr
/// and exit 1.
fn run_command(
    name: &str,
    work: impl std::future::Future<Output = anyhow::Result<String>>,
) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("starting the async runtime");
    match runtime.block_on(work) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{name} failed: {e:#}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// Where a command's config is and which of its drivers it is about: `--config` (every
/// driver in it), else the lookup rule; `--driver` narrows either to one.
fn locate_config(
    flag: Option<PathBuf>,
    driver: Option<String>,
    argv0: Option<&str>,
) -> config::Located {
    let env = std::env::var(config::CONFIG_ENV).ok();
    let mut located = match flag {
        Some(path) => config::Located {
            path,
            driver: config::DriverChoice::Any,
        },
        None => config::locate(env.as_deref(), argv0, |p| p.exists()),
    };
    if let Some(name) = driver {
        located.driver = config::DriverChoice::Named(name);
    }
    located
}

/// The drivers a command is about (every driver of the file unless one is chosen).
fn load_configs(arg: ConfigArg, argv0: Option<&str>) -> Result<Vec<Config>, ExitCode> {
    let located = locate_config(arg.config, arg.driver, argv0);
    let loaded = match &located.driver {
        config::DriverChoice::Any => Config::load_all(&located.path),
        choice => Config::load_driver(&located.path, choice).map(|c| vec![c]),
    };
    loaded.map_err(|e| {
        tracing::error!("{e}");
        eprintln!("{e}");
        ExitCode::from(EXIT_CONFIG)
    })
}

fn run_hook(format: LogFormat, hook: HookArgs, argv0: Option<&str>) -> ExitCode {
    // Cube discards a successful hook's stderr and shows a failed one's whole stderr as
    // its error message, so by default that message is all a hook writes there.
    // RUST_LOG turns logging on for troubleshooting.
    telemetry::init_hook(format);
    let request = match hook.request() {
        Ok(r) => r,
        Err(message) => return finish_hook(HookOutput::failure(&message), EXIT_USAGE),
    };
    let config = match hook_config(&hook, argv0) {
        Ok(c) => c,
        Err(e) => return finish_hook(HookOutput::failure(&e.to_string()), EXIT_CONFIG),
    };
    // Still single-threaded: the hook runs in a worker that outlives a SIGKILL of this
    // process (see transport::worker).
    let (output, acknowledgement) = crate::transport::worker::run_in_worker(config, request);
    let (code, printed) = print_hook_answer(output, EXIT_FAILURE);
    // Cube counts the hook once this process exits 0 with the answer on stdout: only an
    // answer that was written out is acknowledged to the worker (which otherwise undoes
    // what it reported).
    if printed {
        acknowledgement.confirm();
    }
    ExitCode::from(code)
}

/// Prints the hook's one JSON object and picks the exit code; on failure the message
/// also ends stderr, which is what Cube shows for a non-zero exit.
fn finish_hook(output: HookOutput, failure_code: u8) -> ExitCode {
    ExitCode::from(print_hook_answer(output, failure_code).0)
}

/// `finish_hook`, also saying whether the answer was written out whole.
pub fn print_hook_answer(output: HookOutput, failure_code: u8) -> (u8, bool) {
    let mut stdout = std::io::stdout().lock();
    let printed = writeln!(stdout, "{}", output.stdout).is_ok() && stdout.flush().is_ok();
    if output.success {
        return (0, printed);
    }
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_str(&output.stdout)
        && let Some(serde_json::Value::String(message)) = map.get("error")
    {
        eprintln!("{message}");
    }
    (failure_code, printed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::cube::v1 as pb;

    fn parse(args: &[&str]) -> HookArgs {
        let mut full = vec!["cube-csi-bridge", "hook"];
        full.extend_from_slice(args);
        match Cli::try_parse_from(full).unwrap().command {
            Command::Hook(h) => h,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn hyphen_leading_values_are_values() {
        let h = parse(&[
            "--op",
            "attach",
            "--sandbox-id",
            "-sb",
            "--namespace",
            "--ns",
            "--volume-id",
            "-v",
            "--ref-count",
            "-0",
            "--volume-base-dir",
            "/d",
            "--private-data",
            "-x",
        ]);
        let HookRequest::Attach(req) = h.request().unwrap() else {
            panic!()
        };
        assert_eq!(req.sandbox_id, "-sb");
        assert_eq!(req.namespace, "--ns");
        assert_eq!(req.volume_id, "-v");
        assert_eq!(req.private_data, "-x");
    }

    #[test]
    fn missing_and_malformed_arguments_are_named() {
        let err = parse(&["--op", "attach", "--volume-id", "v"])
            .request()
            .unwrap_err();
        assert!(err.contains("--sandbox-id"), "{err}");
        let err = parse(&[
            "--op",
            "detach",
            "--sandbox-id",
            "s",
            "--namespace",
            "n",
            "--volume-id",
            "v",
            "--ref-count",
            "x",
            "--metadata",
            "{}",
        ])
        .request()
        .unwrap_err();
        assert!(err.contains("--ref-count"), "{err}");
    }

    #[test]
    fn private_data_is_optional_and_metadata_is_parsed() {
        let h = parse(&[
            "--op",
            "attach",
            "--sandbox-id",
            "s",
            "--namespace",
            "n",
            "--volume-id",
            "v",
            "--ref-count",
            "1",
            "--volume-base-dir",
            "/d",
        ]);
        let HookRequest::Attach(req) = h.request().unwrap() else {
            panic!()
        };
        assert_eq!(req.private_data, "");
        let h = parse(&[
            "--op",
            "detach",
            "--sandbox-id",
            "s",
            "--namespace",
            "n",
            "--volume-id",
            "v",
            "--ref-count",
            "0",
            "--metadata",
            r#"{"mount_dir":"/d/x-v"}"#,
        ]);
        let HookRequest::Detach(req) = h.request().unwrap() else {
            panic!()
        };
        assert_eq!(req.metadata["mount_dir"], "/d/x-v");
    }

    #[test]
    fn parse_hook_argv_is_the_forked_hooks_parser() {
        let argv: Vec<OsString> = ["--op", "destroy", "--volume-id", "-v"]
            .into_iter()
            .map(OsString::from)
            .collect();
        assert!(matches!(
            parse_hook_argv(&argv),
            Ok(HookRequest::Destroy(pb::DestroyRequest { volume_id })) if volume_id == "-v"
        ));
        let err = parse_hook_argv(&argv[..2]).unwrap_err();
        assert!(err.contains("--volume-id"), "{err}");
        let err = parse_hook_argv(&[OsString::from("--op"), OsString::from("x")]).unwrap_err();
        assert!(err.contains("\"x\""), "{err}");
    }

    #[test]
    fn every_flag_has_help() {
        use clap::CommandFactory;
        let cmd = Cli::command();
        for sub in cmd.get_subcommands() {
            for arg in sub.get_arguments() {
                assert!(
                    arg.get_help().is_some() || arg.get_id() == "help",
                    "{} --{} has no help",
                    sub.get_name(),
                    arg.get_id()
                );
            }
        }
    }
}
