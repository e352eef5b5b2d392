//! Hostile and broken input through both transports: a table of requests, argv and configs
//! that Cube (or someone posing as it) could send. Each must get a clear error and change
//! nothing: no CSI call, no mount, and not one path or byte under the test's temp dir
//! changed (no state or lock directory, no journal or store record, no lock file). For the
//! binary hook that is strict: a rejected hook does not even create the state directory.
//!
//! The rpc side sends raw protobuf (strings as bytes) so that NUL and non-UTF-8 reach the
//! server; the binary side forks the executable with Cube's argv.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::fake_driver::Caps;
use common::{BRIDGE, DRIVER, Mode, World};
use cube_csi_bridge::bridge::naming::VolumePaths;
use cube_csi_bridge::proto::cube::v1 as pb;
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------- wire requests as bytes

/// Cube's AttachRequest with every string as bytes (same wire format).
#[derive(Clone, PartialEq, prost::Message)]
struct RawAttach {
    #[prost(bytes = "vec", tag = "1")]
    sandbox_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    namespace: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    volume_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "5")]
    volume_base_dir: Vec<u8>,
    #[prost(int64, tag = "6")]
    ref_count: i64,
    #[prost(bytes = "vec", tag = "7")]
    private_data: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawDetach {
    #[prost(bytes = "vec", tag = "1")]
    sandbox_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    namespace: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    volume_id: Vec<u8>,
    #[prost(map = "string, string", tag = "6")]
    metadata: HashMap<String, String>,
    #[prost(int64, tag = "8")]
    ref_count: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawCreate {
    #[prost(bytes = "vec", tag = "1")]
    volume_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    name: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawDestroy {
    #[prost(bytes = "vec", tag = "1")]
    volume_id: Vec<u8>,
}

#[derive(Clone, Debug)]
struct AttachFields {
    sandbox_id: Vec<u8>,
    namespace: Vec<u8>,
    volume_id: Vec<u8>,
    ref_count: i64,
    base_dir: Vec<u8>,
    private_data: Vec<u8>,
}

/// One hook as Cube would send it over either transport.
#[derive(Clone, Debug)]
enum Hook {
    Create {
        volume_id: Vec<u8>,
        name: Vec<u8>,
    },
    Destroy {
        volume_id: Vec<u8>,
    },
    Attach(AttachFields),
    Detach {
        sandbox_id: Vec<u8>,
        namespace: Vec<u8>,
        volume_id: Vec<u8>,
        ref_count: i64,
        metadata: BTreeMap<String, String>,
    },
}

const SERVICE_NODE: &str = "/cubelet.services.volumeplugin.v1.VolumePluginService";
const SERVICE_CONTROLLER: &str = "/cubelet.services.volumeplugin.v1.VolumeControllerService";

impl Hook {
    /// Cube's argv for this hook, in Cubelet's and CubeMaster's order.
    fn argv(&self) -> Vec<OsString> {
        let s = |v: &str| OsString::from(v);
        let b = |v: &[u8]| OsString::from_vec(v.to_vec());
        match self {
            Hook::Create { volume_id, name } => vec![
                s("--op"),
                s("create"),
                s("--volume-id"),
                b(volume_id),
                s("--name"),
                b(name),
            ],
            Hook::Destroy { volume_id } => {
                vec![s("--op"), s("destroy"), s("--volume-id"), b(volume_id)]
            }
            Hook::Attach(AttachFields {
                sandbox_id,
                namespace,
                volume_id,
                ref_count,
                base_dir,
                private_data,
            }) => {
                let mut argv = vec![
                    s("--op"),
                    s("attach"),
                    s("--sandbox-id"),
                    b(sandbox_id),
                    s("--namespace"),
                    b(namespace),
                    s("--volume-id"),
                    b(volume_id),
                    s("--ref-count"),
                    s(&ref_count.to_string()),
                    s("--volume-base-dir"),
                    b(base_dir),
                ];
                if !private_data.is_empty() {
                    argv.extend([s("--private-data"), b(private_data)]);
                }
                argv
            }
            Hook::Detach {
                sandbox_id,
                namespace,
                volume_id,
                ref_count,
                metadata,
            } => vec![
                s("--op"),
                s("detach"),
                s("--sandbox-id"),
                b(sandbox_id),
                s("--namespace"),
                b(namespace),
                s("--volume-id"),
                b(volume_id),
                s("--ref-count"),
                s(&ref_count.to_string()),
                s("--metadata"),
                s(&serde_json::to_string(metadata).unwrap()),
            ],
        }
    }

    /// Sends the hook over gRPC as raw protobuf.
    async fn rpc(&self, socket: &Path) -> Result<(), tonic::Status> {
        let channel = cube_csi_bridge::csi::client::channel(&cube_csi_bridge::csi::Endpoint::Unix(
            socket.to_path_buf(),
        ));
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let path = |service: &str, method: &str| {
            format!("{service}/{method}")
                .parse::<http::uri::PathAndQuery>()
                .unwrap()
        };
        macro_rules! call {
            ($msg:expr, $service:expr, $method:literal, $resp:ty) => {
                grpc.unary(
                    tonic::Request::new($msg),
                    path($service, $method),
                    tonic_prost::ProstCodec::<_, $resp>::default(),
                )
                .await
                .map(|_| ())
            };
        }
        match self.clone() {
            Hook::Create { volume_id, name } => call!(
                RawCreate { volume_id, name },
                SERVICE_CONTROLLER,
                "Create",
                pb::CreateResponse
            ),
            Hook::Destroy { volume_id } => call!(
                RawDestroy { volume_id },
                SERVICE_CONTROLLER,
                "Destroy",
                pb::DestroyResponse
            ),
            Hook::Attach(AttachFields {
                sandbox_id,
                namespace,
                volume_id,
                ref_count,
                base_dir,
                private_data,
            }) => call!(
                RawAttach {
                    sandbox_id,
                    namespace,
                    volume_id,
                    ref_count,
                    volume_base_dir: base_dir,
                    private_data,
                },
                SERVICE_NODE,
                "Attach",
                pb::AttachResponse
            ),
            Hook::Detach {
                sandbox_id,
                namespace,
                volume_id,
                ref_count,
                metadata,
            } => call!(
                RawDetach {
                    sandbox_id,
                    namespace,
                    volume_id,
                    ref_count,
                    metadata: metadata.into_iter().collect(),
                },
                SERVICE_NODE,
                "Detach",
                pb::DetachResponse
            ),
        }
    }
}

// ---------------------------------------------------------------- the table

/// What a case sends.
enum Input {
    /// The same hook over both transports.
    Hook(Hook),
    /// Over gRPC only (the binary transport cannot carry it: NUL in argv).
    RpcOnly(Hook),
    /// Forked with this argv only (there is no gRPC form: argv syntax).
    Argv(Vec<OsString>),
}

struct Case {
    name: &'static str,
    input: Input,
    /// The error names the problem: this must be in it.
    expect: &'static str,
    /// The binary hook's exit code: 64 for a malformed command line, 1 for a request the
    /// bridge refuses.
    exit: i32,
}

/// Paths a case may name.
struct Ctx {
    dir: PathBuf,
    base: PathBuf,
}

const GOOD_ID: &str = "hostile-vol";
const GOOD_HANDLE: &str = r#"{"v":1,"id":"fake-cube-hostile-vol"}"#;

fn attach(ctx: &Ctx) -> Hook {
    Hook::Attach(AttachFields {
        sandbox_id: b"sb-1".to_vec(),
        namespace: b"default".to_vec(),
        volume_id: GOOD_ID.into(),
        ref_count: 0,
        base_dir: ctx.base.as_os_str().as_encoded_bytes().to_vec(),
        private_data: GOOD_HANDLE.into(),
    })
}

fn good_metadata(ctx: &Ctx) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "mount_dir".to_string(),
            ctx.base
                .join(format!("{DRIVER}+{GOOD_ID}"))
                .display()
                .to_string(),
        ),
        ("volume_id".to_string(), GOOD_ID.to_string()),
        (
            "csi_volume_id".to_string(),
            "fake-cube-hostile-vol".to_string(),
        ),
    ])
}

fn detach(ctx: &Ctx) -> Hook {
    Hook::Detach {
        sandbox_id: b"sb-1".to_vec(),
        namespace: b"default".to_vec(),
        volume_id: GOOD_ID.into(),
        ref_count: 0,
        metadata: good_metadata(ctx),
    }
}

fn with_attach(ctx: &Ctx, edit: impl FnOnce(&mut AttachFields)) -> Hook {
    let Hook::Attach(mut fields) = attach(ctx) else {
        unreachable!()
    };
    edit(&mut fields);
    Hook::Attach(fields)
}

fn with_metadata(ctx: &Ctx, edit: impl FnOnce(&mut BTreeMap<String, String>)) -> Hook {
    let mut hook = detach(ctx);
    if let Hook::Detach { metadata, .. } = &mut hook {
        edit(metadata);
    }
    hook
}

/// The Cube argv of a good Attach with `edit` applied (flags and values as strings).
fn attach_argv(ctx: &Ctx, edit: impl FnOnce(&mut Vec<OsString>)) -> Input {
    let mut argv = attach(ctx).argv();
    edit(&mut argv);
    Input::Argv(argv)
}

fn set_flag(argv: &mut [OsString], flag: &str, value: impl Into<OsString>) {
    let at = argv.iter().position(|a| a == flag).unwrap();
    argv[at + 1] = value.into();
}

fn remove_flag(argv: &mut Vec<OsString>, flag: &str) {
    let at = argv.iter().position(|a| a == flag).unwrap();
    argv.drain(at..at + 2);
}

fn cases(ctx: &Ctx) -> Vec<Case> {
    let base = |suffix: &str| format!("{}{suffix}", ctx.base.display()).into_bytes();
    let dir = |suffix: &str| format!("{}{suffix}", ctx.dir.display()).into_bytes();
    let case = |name, input, expect, exit| Case {
        name,
        input,
        expect,
        exit,
    };
    let hook = Input::Hook;
    vec![
        // -------- volume ids (they become path components)
        case(
            "volume_id with /",
            hook(with_attach(ctx, |a| a.volume_id = b"a/b".to_vec())),
            "volume_id",
            1,
        ),
        case(
            "volume_id ..",
            hook(with_attach(ctx, |a| a.volume_id = b"..".to_vec())),
            "volume_id",
            1,
        ),
        case(
            "volume_id ../../etc",
            hook(with_attach(ctx, |a| a.volume_id = b"../../etc".to_vec())),
            "volume_id",
            1,
        ),
        case(
            "volume_id with NUL",
            Input::RpcOnly(with_attach(ctx, |a| a.volume_id = b"vol\0x".to_vec())),
            "volume_id",
            1,
        ),
        case(
            "volume_id of 129 bytes",
            hook(with_attach(ctx, |a| a.volume_id = vec![b'a'; 129])),
            "129 bytes",
            1,
        ),
        case(
            "volume_id empty",
            hook(with_attach(ctx, |a| a.volume_id.clear())),
            "volume_id is empty",
            1,
        ),
        case(
            "volume_id not UTF-8",
            hook(with_attach(ctx, |a| a.volume_id = vec![b'v', 0xff, 0xfe])),
            "UTF-8",
            64,
        ),
        case(
            "volume_id with a space",
            hook(with_attach(ctx, |a| a.volume_id = b"a b".to_vec())),
            "volume_id",
            1,
        ),
        case(
            "volume_id not ASCII",
            hook(with_attach(ctx, |a| a.volume_id = "vol-\u{fc}".into())),
            "volume_id",
            1,
        ),
        case(
            "destroy volume_id with /",
            hook(Hook::Destroy {
                volume_id: b"x/../y".to_vec(),
            }),
            "volume_id",
            1,
        ),
        case(
            "create volume_id ..",
            hook(Hook::Create {
                volume_id: b"..".to_vec(),
                name: b"n".to_vec(),
            }),
            "volume_id",
            1,
        ),
        case(
            "create name with control characters",
            hook(Hook::Create {
                volume_id: GOOD_ID.into(),
                name: b"n\x07\n".to_vec(),
            }),
            "control characters",
            1,
        ),
        case(
            "create name of 300 bytes",
            hook(Hook::Create {
                volume_id: GOOD_ID.into(),
                name: vec![b'n'; 300],
            }),
            "longer than",
            1,
        ),
        // -------- sandbox, namespace, ref_count
        case(
            "sandbox_id empty",
            hook(with_attach(ctx, |a| a.sandbox_id.clear())),
            "sandbox_id is empty",
            1,
        ),
        case(
            "sandbox_id with a newline",
            hook(with_attach(ctx, |a| a.sandbox_id = b"sb\nevil".to_vec())),
            "control characters",
            1,
        ),
        case(
            "namespace of 300 bytes",
            hook(with_attach(ctx, |a| a.namespace = vec![b'n'; 300])),
            "longer than",
            1,
        ),
        case(
            "attach ref_count -1",
            hook(with_attach(ctx, |a| a.ref_count = -1)),
            "ref",
            64,
        ),
        case(
            "attach ref_count i64::MIN",
            hook(with_attach(ctx, |a| a.ref_count = i64::MIN)),
            "ref",
            64,
        ),
        case(
            "detach ref_count -5",
            hook(match detach(ctx) {
                Hook::Detach {
                    sandbox_id,
                    namespace,
                    volume_id,
                    metadata,
                    ..
                } => Hook::Detach {
                    sandbox_id,
                    namespace,
                    volume_id,
                    ref_count: -5,
                    metadata,
                },
                _ => unreachable!(),
            }),
            "ref",
            64,
        ),
        // -------- base dirs (the bridge creates directories and mounts there, as root)
        case(
            "base dir relative",
            hook(with_attach(ctx, |a| a.base_dir = b"volumes".to_vec())),
            "not absolute",
            1,
        ),
        case(
            "base dir .",
            hook(with_attach(ctx, |a| a.base_dir = b".".to_vec())),
            "not absolute",
            1,
        ),
        case(
            "base dir /",
            hook(with_attach(ctx, |a| a.base_dir = b"/".to_vec())),
            "must not be /",
            1,
        ),
        case(
            "base dir /etc, outside the allow-list",
            hook(with_attach(ctx, |a| a.base_dir = b"/etc".to_vec())),
            "allowed_base_dirs",
            1,
        ),
        case(
            "base dir missing from disk and the allow-list",
            hook(with_attach(ctx, |a| a.base_dir = dir("/nowhere"))),
            "allowed_base_dirs",
            1,
        ),
        case(
            "base dir climbing out with ..",
            hook(with_attach(ctx, |a| a.base_dir = base("/../../../etc"))),
            "normal path",
            1,
        ),
        case(
            "base dir with //",
            hook(with_attach(ctx, |a| a.base_dir = dir("//volumes"))),
            "normal path",
            1,
        ),
        case(
            "base dir of 2000 bytes",
            hook(with_attach(ctx, |a| {
                a.base_dir = format!("/{}", "d".repeat(2000)).into_bytes()
            })),
            "1024",
            1,
        ),
        case(
            "allowed base dir that is a symlink to /",
            hook(with_attach(ctx, |a| a.base_dir = dir("/link"))),
            "symlink",
            1,
        ),
        // -------- base dirs someone other than root can steer (a non-root Cubelet's)
        case(
            "steered base dir: writable by others",
            hook(with_attach(ctx, |a| a.base_dir = dir("/open"))),
            "writable by group or others",
            1,
        ),
        case(
            "steered base dir: host_path planted as a symlink",
            hook(with_attach(ctx, |a| a.base_dir = dir("/planted"))),
            "is a symlink",
            1,
        ),
        case(
            "steered base dir: .staging planted as a symlink",
            hook(with_attach(ctx, |a| a.base_dir = dir("/swapped"))),
            "is a symlink",
            1,
        ),
        case(
            "base dir flag missing",
            attach_argv(ctx, |a| remove_flag(a, "--volume-base-dir")),
            "--volume-base-dir",
            64,
        ),
        // -------- private_data (the CSI handle Cube hands back)
        case(
            "private_data missing",
            hook(with_attach(ctx, |a| a.private_data.clear())),
            "private_data is empty",
            1,
        ),
        case(
            "private_data oversized",
            hook(with_attach(ctx, |a| {
                a.private_data = format!(r#"{{"v":1,"id":"{}"}}"#, "x".repeat(1100)).into_bytes()
            })),
            "at most 1024",
            1,
        ),
        case(
            "private_data truncated",
            hook(with_attach(ctx, |a| {
                a.private_data = GOOD_HANDLE.as_bytes()[..20].to_vec()
            })),
            "not a cube-csi-bridge volume handle",
            1,
        ),
        case(
            "private_data of another version",
            hook(with_attach(ctx, |a| {
                a.private_data = br#"{"v":2,"id":"fake-cube-hostile-vol"}"#.to_vec()
            })),
            "version 2",
            1,
        ),
        case(
            "private_data naming another driver",
            hook(with_attach(ctx, |a| {
                a.private_data = br#"{"v":1,"id":"fake-cube-hostile-vol","d":"cephfs"}"#.to_vec()
            })),
            "belongs to Cube driver",
            1,
        ),
        case(
            "private_data not JSON",
            hook(with_attach(ctx, |a| {
                a.private_data = b"volumes/hostile-vol/".to_vec()
            })),
            "not a cube-csi-bridge volume handle",
            1,
        ),
        case(
            "private_data with an empty handle",
            hook(with_attach(ctx, |a| {
                a.private_data = br#"{"v":1,"id":""}"#.to_vec()
            })),
            "empty CSI volume id",
            1,
        ),
        // -------- Detach metadata (what Attach returned, handed back by Cube)
        case(
            "metadata of another volume",
            hook(with_metadata(ctx, |m| {
                m.insert("volume_id".into(), "other".into());
            })),
            "belongs to volume",
            1,
        ),
        case(
            "metadata mount_dir outside the allow-list",
            hook(with_metadata(ctx, |m| {
                m.insert("mount_dir".into(), format!("/etc/{DRIVER}+{GOOD_ID}"));
            })),
            "allowed_base_dirs",
            1,
        ),
        case(
            "metadata mount_dir climbing out",
            hook(with_metadata(ctx, |m| {
                m.insert(
                    "mount_dir".into(),
                    format!("{}/../{DRIVER}+{GOOD_ID}", ctx.base.display()),
                );
            })),
            "normal path",
            1,
        ),
        case(
            "metadata mount_dir of another volume",
            hook(with_metadata(ctx, |m| {
                m.insert(
                    "mount_dir".into(),
                    ctx.base.join("fake+other").display().to_string(),
                );
            })),
            "not this volume's host_path",
            1,
        ),
        case(
            "metadata mount_dir of another driver's volume (its legacy leaf is this one's)",
            hook(with_metadata(ctx, |m| {
                m.insert(
                    "mount_dir".into(),
                    ctx.base.join("fake-hostile+vol").display().to_string(),
                );
            })),
            "not this volume's host_path",
            1,
        ),
        case(
            "metadata mixing a legacy mount_dir with a current staging_dir",
            hook(with_metadata(ctx, |m| {
                m.insert(
                    "mount_dir".into(),
                    ctx.base
                        .join(format!("{DRIVER}-{GOOD_ID}"))
                        .display()
                        .to_string(),
                );
                m.insert(
                    "staging_dir".into(),
                    ctx.base
                        .join(format!(".staging/{DRIVER}+{GOOD_ID}"))
                        .display()
                        .to_string(),
                );
            })),
            "staging",
            1,
        ),
        case(
            "metadata staging_dir elsewhere",
            hook(with_metadata(ctx, |m| {
                m.insert("staging_dir".into(), "/etc".into());
            })),
            "staging",
            1,
        ),
        case(
            "metadata huge",
            hook(with_metadata(ctx, |m| {
                m.insert("junk".into(), "j".repeat(60 * 1024));
            })),
            "bytes",
            1,
        ),
        case(
            "metadata with 100 entries",
            hook(with_metadata(ctx, |m| {
                m.extend((0..100).map(|i| (format!("k{i}"), "v".into())))
            })),
            "entries",
            1,
        ),
        case(
            "metadata not JSON",
            Input::Argv({
                let mut a = detach(ctx).argv();
                let n = a.len();
                a[n - 1] = "{not json".into();
                a
            }),
            "not a JSON object",
            64,
        ),
        case(
            "metadata a JSON array",
            Input::Argv({
                let mut a = detach(ctx).argv();
                let n = a.len();
                a[n - 1] = "[]".into();
                a
            }),
            "not a JSON object",
            64,
        ),
        case(
            "metadata with a number",
            Input::Argv({
                let mut a = detach(ctx).argv();
                let n = a.len();
                a[n - 1] = r#"{"mount_dir":1}"#.into();
                a
            }),
            "not a JSON object",
            64,
        ),
        // -------- argv as such
        case(
            "unknown --op",
            Input::Argv(vec![
                "--op".into(),
                "explode".into(),
                "--volume-id".into(),
                GOOD_ID.into(),
            ]),
            "explode",
            64,
        ),
        case(
            "--volume-id missing",
            Input::Argv(vec!["--op".into(), "destroy".into()]),
            "--volume-id",
            64,
        ),
        case(
            "--volume-id repeated",
            Input::Argv(vec![
                "--op".into(),
                "destroy".into(),
                "--volume-id".into(),
                GOOD_ID.into(),
                "--volume-id".into(),
                "other".into(),
            ]),
            "--volume-id",
            64,
        ),
        case(
            "--volume-id without a value",
            Input::Argv(vec!["--op".into(), "destroy".into(), "--volume-id".into()]),
            "--volume-id",
            64,
        ),
        case(
            "an unknown flag",
            attach_argv(ctx, |a| a.extend(["--password".into(), "x".into()])),
            "--password",
            64,
        ),
        case(
            "base dir value that looks like a flag",
            attach_argv(ctx, |a| set_flag(a, "--volume-base-dir", "--private-data")),
            "not absolute",
            1,
        ),
        case(
            "ref count value that looks like a flag",
            attach_argv(ctx, |a| set_flag(a, "--ref-count", "--5")),
            "--ref-count",
            64,
        ),
        case(
            "huge argv: a 100 KiB sandbox id",
            attach_argv(ctx, |a| set_flag(a, "--sandbox-id", "s".repeat(100 * 1024))),
            "longer than",
            1,
        ),
        case(
            "huge argv: 120 KiB of private_data",
            attach_argv(ctx, |a| {
                set_flag(a, "--private-data", "p".repeat(120 * 1024))
            }),
            "at most 1024",
            1,
        ),
        case(
            "huge argv: 2000 extra arguments",
            attach_argv(ctx, |a| {
                a.extend((0..2000).map(|i| OsString::from(format!("--x{i}"))))
            }),
            "unexpected argument",
            64,
        ),
        case(
            "namespace not UTF-8",
            attach_argv(ctx, |a| {
                set_flag(a, "--namespace", OsString::from_vec(vec![0xc3, 0x28]))
            }),
            "UTF-8",
            64,
        ),
    ]
}

// ---------------------------------------------------------------- "changed nothing"

/// Every path under `root` (symlinks not followed) with its kind and, for files, a hash of
/// the content; the daemon's own log is left out.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.file_name().is_some_and(|n| n == "daemon.log") {
                continue;
            }
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let kind = if meta.is_dir() {
                stack.push(path.clone());
                "dir".to_string()
            } else if meta.is_file() {
                let bytes = std::fs::read(&path).unwrap_or_default();
                format!("file {:x}", Sha256::digest(&bytes))
            } else if meta.file_type().is_symlink() {
                format!("symlink {}", std::fs::read_link(&path).unwrap().display())
            } else {
                "other".to_string()
            };
            out.insert(path.strip_prefix(root).unwrap().to_path_buf(), kind);
        }
    }
    out
}

/// The world's tree once nothing changes it in the background. Without a daemon nothing
/// runs there. A daemon's start-up housekeeping is its start-up reconciliation, then the
/// first scan for abandoned node operations and the first sweep of abandoned Creates (which
/// open, and so rewrite, the controller store); the daemon logs their end. After that line
/// the tree is also polled until two snapshots 300 ms apart agree.
async fn settled(w: &World) -> BTreeMap<PathBuf, String> {
    let root = w.dir.path();
    if w.daemon.is_none() {
        return snapshot(root);
    }
    w.wait_for_daemon_log(
        cube_csi_bridge::transport::server::HOUSEKEEPING_STARTED,
        1,
        Duration::from_secs(30),
    )
    .await;
    let until = Instant::now() + Duration::from_secs(30);
    let mut last = snapshot(root);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = snapshot(root);
        if now == last {
            return now;
        }
        assert!(
            Instant::now() < until,
            "the daemon's tree still changed 30 s after its start-up reconciliation: {}",
            changes(&last, root).unwrap_err()
        );
        last = now;
    }
}

/// What changed under `root` since `before`.
fn changes(before: &BTreeMap<PathBuf, String>, root: &Path) -> Result<(), String> {
    let after = snapshot(root);
    let added: Vec<_> = after.keys().filter(|k| !before.contains_key(*k)).collect();
    let removed: Vec<_> = before.keys().filter(|k| !after.contains_key(*k)).collect();
    let changed: Vec<_> = after
        .iter()
        .filter(|(k, v)| before.get(*k).is_some_and(|b| b != *v))
        .map(|(k, _)| k)
        .collect();
    if added.is_empty() && removed.is_empty() && changed.is_empty() {
        return Ok(());
    }
    Err(format!(
        "added {added:?}, removed {removed:?}, changed {changed:?}"
    ))
}

/// What `case` must leave unchanged. One allowance: the daemon's hot path checks no path
/// (issue 20), so an Attach in a steered base dir takes the volume's lock, and may make the
/// node scope's empty lock file, before it finds the paths refused. A lock file is no
/// state (any valid hook of any volume makes it); the binary hook checks the paths before
/// it opens anything, and leaves not even that.
fn before_case(
    mut before: BTreeMap<PathBuf, String>,
    case: &Case,
    mode: Mode,
) -> BTreeMap<PathBuf, String> {
    let lock = PathBuf::from("locks/node.volumes.lock");
    if mode == Mode::Rpc && case.name.starts_with("steered base dir") {
        let empty = format!("file {:x}", Sha256::digest(b""));
        before.entry(lock).or_insert(empty);
    }
    before
}

fn assert_unchanged(before: &BTreeMap<PathBuf, String>, root: &Path, what: &str) {
    if let Err(e) = changes(before, root) {
        panic!("{what}: {e}");
    }
}

/// A forked hook as Cube sees it: exit code, stdout, stderr.
fn fork(argv: &[OsString], config: &Path) -> (i32, String, String) {
    let out = std::process::Command::new(BRIDGE)
        .args(argv)
        .env("CUBE_CSI_BRIDGE_CONFIG", config)
        .env("RUST_LOG", "debug")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The failure of a forked hook: one JSON object with a non-empty error, a failing exit
/// code, the error also on stderr; returns the exit code and the error.
fn hook_error((code, stdout, stderr): &(i32, String, String)) -> Result<(i32, String), String> {
    let object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(stdout.trim())
        .map_err(|e| format!("stdout is not one JSON object ({e}): {stdout:?}"))?;
    if stdout.trim_end().lines().count() != 1 {
        return Err(format!("more than one line of stdout: {stdout:?}"));
    }
    let error = object
        .get("error")
        .and_then(|e| e.as_str())
        .unwrap_or_default()
        .to_string();
    if error.is_empty() || *code == 0 {
        return Err(format!("accepted: exit {code}, {stdout}"));
    }
    if !stderr.contains(error.lines().next().unwrap_or_default()) {
        return Err(format!(
            "the error does not end stderr (Cube shows stderr): {stderr}"
        ));
    }
    Ok((*code, error))
}

/// The symlinked base dir case must not have reached the real root.
fn root_path_untouched() -> Result<(), String> {
    let leaf = format!("{DRIVER}+{GOOD_ID}");
    for path in [
        Path::new("/").join(&leaf),
        Path::new("/.staging").join(&leaf),
    ] {
        if path.exists() {
            return Err(format!("{} was created", path.display()));
        }
    }
    Ok(())
}

/// Allowed base dirs someone other than root has steered, each with a trap the bridge must
/// not walk into: `open` is writable by anyone; `planted` holds a symlink where the
/// volume's host_path goes, and `swapped` a symlink for `.staging`, both leading to
/// `victim`, a root-only directory that must never be mounted over.
fn plant_base_dirs(dir: &Path) {
    let mkdir = |name: &str, mode: u32| {
        let path = dir.join(name);
        std::fs::create_dir(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    };
    let victim = mkdir("victim", 0o700);
    std::fs::write(victim.join("secret"), "root's").unwrap();
    mkdir("open", 0o777);
    let planted = mkdir("planted", 0o755);
    let leaf = VolumePaths::new(&planted, DRIVER, GOOD_ID).target;
    std::os::unix::fs::symlink(&victim, leaf).unwrap();
    let swapped = mkdir("swapped", 0o755);
    std::os::unix::fs::symlink(&victim, swapped.join(".staging")).unwrap();
}

/// A world with `{dir}/link` (an allowed base dir in the test config) a symlink to /, and
/// the steered base dirs of `plant_base_dirs`, all allowed.
async fn world(mode: Mode) -> (World, Ctx) {
    let mut w = World::start(Mode::Binary, Caps::staging(), "").await;
    let dir = w.dir.path().display().to_string();
    let config = std::fs::read_to_string(&w.config_path).unwrap().replacen(
        "allowed_base_dirs = [",
        &format!("allowed_base_dirs = [\"{dir}/open\", \"{dir}/planted\", \"{dir}/swapped\", "),
        1,
    );
    std::fs::write(&w.config_path, config).unwrap();
    std::os::unix::fs::symlink("/", w.dir.path().join("link")).unwrap();
    plant_base_dirs(w.dir.path());
    if mode == Mode::Rpc {
        w.mode = Mode::Rpc;
        w.start_daemon().await.unwrap();
    }
    let ctx = Ctx {
        dir: w.dir.path().to_path_buf(),
        base: w.base_dir.clone(),
    };
    (w, ctx)
}

/// Runs one case over one transport: Ok, or what is wrong.
async fn run_case(w: &World, case: &Case, mode: Mode) -> Option<Result<(), String>> {
    let message = match (&case.input, mode) {
        (Input::Hook(hook) | Input::RpcOnly(hook), Mode::Rpc) => {
            match hook.rpc(&w.socket()).await {
                Ok(()) => return Some(Err("accepted".into())),
                Err(status) => Ok(status.message().to_string()),
            }
        }
        (Input::Hook(hook), Mode::Binary) => {
            hook_result(case, hook_error(&fork(&hook.argv(), &w.config_path)))
        }
        (Input::Argv(argv), Mode::Binary) => {
            hook_result(case, hook_error(&fork(argv, &w.config_path)))
        }
        // No form in this transport.
        (Input::RpcOnly(_), Mode::Binary) | (Input::Argv(_), Mode::Rpc) => return None,
    };
    Some(message.and_then(|message| {
        if !message.contains(case.expect) {
            return Err(format!(
                "the error does not say {:?}: {message}",
                case.expect
            ));
        }
        if message.len() >= 2048 {
            return Err(format!(
                "the error echoes the input ({} bytes)",
                message.len()
            ));
        }
        Ok(())
    }))
}

fn hook_result(case: &Case, outcome: Result<(i32, String), String>) -> Result<String, String> {
    let (code, error) = outcome?;
    if code != case.exit {
        return Err(format!("exit code {code}, not {} ({error})", case.exit));
    }
    Ok(error)
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_requests_get_clear_errors_and_change_nothing() {
    let mut checked = 0;
    let mut failures = Vec::new();
    for mode in [Mode::Binary, Mode::Rpc] {
        let (w, ctx) = world(mode).await;
        let mut before = settled(&w).await;
        if mode == Mode::Binary {
            assert!(
                !before.contains_key(Path::new("state"))
                    && !before.contains_key(Path::new("locks")),
                "no hook ran yet: {before:?}"
            );
        }
        let table = cases(&ctx);
        assert!(table.len() >= 40, "{} cases", table.len());
        for case in &table {
            w.driver.clear_calls();
            before = before_case(before, case, mode);
            let Some(outcome) = run_case(&w, case, mode).await else {
                continue;
            };
            let calls = w.driver.mutating_calls();
            let outcome = outcome
                .and_then(|()| {
                    if calls.is_empty() {
                        Ok(())
                    } else {
                        Err(format!("CSI calls {calls:?}"))
                    }
                })
                .and_then(|()| match w.mounts() {
                    m if m.is_empty() => Ok(()),
                    m => Err(format!("mounts {m:?}")),
                })
                .and_then(|()| changes(&before, w.dir.path()))
                .and_then(|()| root_path_untouched());
            if let Err(e) = outcome {
                failures.push(format!("{mode:?}: {}: {e}", case.name));
                // Judge the next case against the state this one left.
                before = snapshot(w.dir.path());
            }
            checked += 1;
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} case runs failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(checked >= 80, "{checked} case runs");
}

/// gRPC messages at the server's 4 MiB receive limit: just under is decoded and refused
/// by validation, just over is refused by the transport; neither changes anything.
#[tokio::test(flavor = "multi_thread")]
async fn grpc_messages_at_the_4_mib_limit_are_refused_cleanly() {
    let (w, ctx) = world(Mode::Rpc).await;
    let before = settled(&w).await;
    const LIMIT: usize = 4 * 1024 * 1024;
    for (overhead, code, expect) in [
        (1024, tonic::Code::InvalidArgument, "private_data is"),
        (-1024, tonic::Code::OutOfRange, "too large"),
    ] {
        let hook = with_attach(&ctx, |a| {
            a.private_data = vec![b'p'; (LIMIT as i64 - overhead) as usize]
        });
        let status = hook.rpc(&w.socket()).await.expect_err("accepted");
        assert_eq!(status.code(), code, "{}", status.message());
        assert!(status.message().contains(expect), "{}", status.message());
        assert!(status.message().len() < 2048, "echoed the input");
        assert!(w.driver.mutating_calls().is_empty());
        assert_unchanged(&before, w.dir.path(), "4 MiB");
    }
    // The daemon still serves.
    w.destroy("never-created")
        .await
        .expect("a normal call after");
}

/// Configs that are missing, broken (with a secret on the broken line), or that others can
/// read (with secrets in it) or write (anyone, or the file's group): the hook answers a clear error with exit code 78,
/// the daemon refuses to start (78) and binds no socket; neither creates anything.
#[tokio::test(flavor = "multi_thread")]
async fn broken_missing_and_exposed_configs_are_refused_before_anything() {
    let w = World::start(Mode::Binary, Caps::staging(), "").await;
    // Others may search the temp dir, so that file modes decide who can read a config.
    std::fs::set_permissions(w.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let good = std::fs::read_to_string(&w.config_path).unwrap();
    let secret = "hunter2-SECRET";
    let with_secrets = format!("{good}\n[secrets.node_publish]\npassword = \"{secret}\"\n");
    let configs: Vec<(&str, Option<String>, u32, &str)> = vec![
        ("missing", None, 0o600, "cannot read config file"),
        (
            "broken, quoting a secret",
            Some(format!(
                "{good}\n[secrets]\nnode_publish = {{ password = {secret} }}\n"
            )),
            0o600,
            "line ",
        ),
        (
            "unknown field",
            Some(format!("bogus_field = 1\n{good}")),
            0o600,
            "bogus_field",
        ),
        (
            "not TOML at all",
            Some("\u{0}\u{1}binary junk".into()),
            0o600,
            "not valid",
        ),
        (
            "holding secrets, readable by anyone",
            Some(with_secrets.clone()),
            0o644,
            "any user can read it",
        ),
        (
            "writable by anyone",
            Some(good.clone()),
            0o666,
            "any user can write it",
        ),
        (
            "writable by its group",
            Some(with_secrets.clone()),
            0o660,
            "chmod go-w",
        ),
        (
            "signing every unsigned record (would launder forged ones)",
            Some(format!(
                "{good}\n[controller]\nsign_unsigned_records = true\n"
            )),
            0o600,
            "list the Cube volume ids",
        ),
        (
            "a record key pin that is no SHA-256",
            Some(format!(
                "{good}\n[kubernetes]\nrecord_key_sha256 = \"abc\"\n"
            )),
            0o600,
            "kubernetes.record_key_sha256",
        ),
    ];
    let before = snapshot(w.dir.path());
    for (name, text, mode, expect) in configs {
        let path = w.dir.path().join("exposed.toml");
        let _ = std::fs::remove_file(&path);
        if let Some(text) = &text {
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let mut before = before.clone();
        if text.is_some() {
            before.insert(
                PathBuf::from("exposed.toml"),
                format!("file {:x}", Sha256::digest(std::fs::read(&path).unwrap())),
            );
        }
        // The binary hook.
        let argv = attach(&Ctx {
            dir: w.dir.path().into(),
            base: w.base_dir.clone(),
        })
        .argv();
        let out = fork(&argv, &path);
        let (code, error) = hook_error(&out).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(code, 78, "{name}: {error}");
        assert!(error.contains(expect), "{name}: {error}");
        assert!(
            !out.1.contains("hunter2") && !out.2.contains("hunter2"),
            "{name}: leaked a secret: {out:?}"
        );
        assert_unchanged(&before, w.dir.path(), name);
        // The daemon.
        let served = std::process::Command::new(BRIDGE)
            .args(["serve", "--config"])
            .arg(&path)
            .env("RUST_LOG", "debug")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&served.stderr);
        assert_eq!(served.status.code(), Some(78), "{name}: {stderr}");
        assert!(stderr.contains(expect), "{name}: {stderr}");
        assert!(!stderr.contains("hunter2"), "{name}: leaked: {stderr}");
        assert!(!w.socket().exists(), "{name}: a socket was bound");
        assert_unchanged(&before, w.dir.path(), name);
    }
}
