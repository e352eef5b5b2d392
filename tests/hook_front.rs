//! The forked hook's front (`cube-csi-hook`, src/transport/front.rs): it answers the hot
//! paths by itself, hands everything else to the full binary beside it (argv[0] kept, see
//! tests/multi_driver.rs), and says what is wrong, changing nothing, when that binary is
//! missing or when the front was installed under the full binary's name. Every other
//! binary-mode test forks the front too (tests/common), so the crash matrix and the Cube
//! conditions hold through it.
//!
//! The first test needs root (real mounts); it skips without it, except in CI.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::callers::{CubeCaller, attach_request, detach_request};
use common::fake_driver::Caps;
use common::{BRIDGE, HOOK, Mode, World};

/// A copy of the front named `name`, alone in `dir`: no full binary beside it.
fn lonely_front(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::copy(HOOK, &path).unwrap();
    path
}

/// A Create forked from a lonely front named `name` in `dir` (a Create is always handed on,
/// before any config is read).
fn create_by_lonely_front(dir: &Path, name: &str) -> std::process::Output {
    output_of(
        Command::new(lonely_front(dir, name))
            .args(["--op", "create", "--volume-id", "v", "--name", "v"])
            .env("CUBE_CSI_BRIDGE_CONFIG", dir.join("none.toml")),
    )
}

/// Runs a copied executable, retrying while it is busy: until a child another test's
/// thread forked meanwhile has exec'd, it shares the copy's write descriptor (ETXTBSY).
fn output_of(command: &mut Command) -> std::process::Output {
    let mut busy = 0;
    loop {
        match command.output() {
            Err(e) if common::callers::executable_busy(&e, &mut busy) => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            out => return out.unwrap(),
        }
    }
}

/// The one JSON object a forked hook printed, and its exit code.
fn answer(out: &std::process::Output) -> (serde_json::Value, Option<i32>) {
    let text = String::from_utf8_lossy(&out.stdout);
    let value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {text:?}"));
    (value, out.status.code())
}

/// The error of a hook the front refused as an incomplete or untrusted install: its JSON
/// `error`, once the exit code has been checked to be EX_CONFIG (78).
fn install_error(out: &std::process::Output) -> String {
    let (json, code) = answer(out);
    assert_eq!(code, Some(78), "EX_CONFIG: {json}");
    json["error"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_front_answers_the_hot_paths_by_itself_and_hands_on_the_rest() {
    require_root!();
    let world = World::start(Mode::Binary, Caps::staging(), "").await;
    let created = world.create("v").await.unwrap();
    // The first Attach stages and publishes: the front hands it to the full binary.
    let first = world
        .attach("sb-1", "v", 0, &created.private_data)
        .await
        .unwrap();
    // The mount table's order is not the bridge's to keep: compare the set.
    let mounts_now = || {
        world
            .mounts()
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
    };
    let mounts = mounts_now();
    assert!(!mounts.is_empty());
    world.driver.clear_calls();

    let bin = tempfile::tempdir().unwrap();
    let alone = world
        .binary_caller()
        .with_program(&lonely_front(bin.path(), "cube-csi-hook"));
    // A second sandbox's Attach and its Detach (a holder is left) are hot: answered by the
    // front with no full binary to run, and no driver call.
    let base = &world.base_dir;
    let hot = alone
        .attach(attach_request(
            "default",
            base,
            "sb-2",
            "v",
            1,
            &created.private_data,
        ))
        .await
        .unwrap_or_else(|e| panic!("hot Attach by the front alone: {e:?}\n{}", world.logs()));
    assert_eq!(hot.host_path, first.host_path);
    alone
        .detach(detach_request("default", "sb-2", "v", 1, &hot.metadata))
        .await
        .unwrap_or_else(|e| panic!("hot Detach by the front alone: {e:?}\n{}", world.logs()));
    assert!(world.driver.mutating_calls().is_empty());

    // The last Detach unpublishes: it needs the full binary, which is missing. The error
    // names the file, and nothing was done.
    let err = alone
        .detach(detach_request("default", "sb-1", "v", 0, &first.metadata))
        .await
        .unwrap_err();
    let missing = bin.path().join("cube-csi-bridge");
    assert!(
        err.message.contains("finds no full binary")
            && err.message.contains(&missing.display().to_string()),
        "{err:?}"
    );
    assert_eq!(
        err.exit_code,
        Some(78),
        "EX_CONFIG: the install is incomplete"
    );
    assert!(world.driver.mutating_calls().is_empty());
    assert_eq!(mounts_now(), mounts);

    // Through the installed front, with the full binary beside it, the same Detach runs.
    world.detach("sb-1", "v", 0, &first.metadata).await.unwrap();
    assert_eq!(
        world.driver.mutating_calls(),
        ["NodeUnpublishVolume", "NodeUnstageVolume"]
    );
    assert!(world.mounts().is_empty());
    world.destroy("v").await.unwrap();
}

#[test]
fn a_front_without_its_full_binary_names_the_missing_file() {
    let bin = tempfile::tempdir().unwrap();
    let out = create_by_lonely_front(bin.path(), "cube-csi-hook");
    let error = install_error(&out);
    assert!(
        error.contains(&bin.path().join("cube-csi-bridge").display().to_string())
            && error.contains("install cube-csi-bridge beside cube-csi-hook"),
        "{error}"
    );
    // Cube shows a failed hook's stderr: the same message ends it.
    assert!(String::from_utf8_lossy(&out.stderr).contains("finds no full binary"));
}

#[test]
fn a_front_installed_under_the_full_binarys_name_says_so_instead_of_running_itself() {
    let bin = tempfile::tempdir().unwrap();
    let out = create_by_lonely_front(bin.path(), "cube-csi-bridge");
    let error = install_error(&out);
    assert!(
        error.contains("installed under the full binary's name"),
        "{error}"
    );
}

#[test]
fn everything_but_a_hook_is_the_full_binarys_to_answer() {
    // `--help` through the front is the full binary's help, with every subcommand.
    let out = Command::new(HOOK).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("serve") && help.contains("register"),
        "{help}"
    );
    // A malformed hook argv gets the full binary's own error (one JSON object, EX_USAGE).
    let out = Command::new(HOOK)
        .args(["--op", "attach", "--volume-id"])
        .output()
        .unwrap();
    let (json, code) = answer(&out);
    assert_eq!(code, Some(64), "{json}");
    let direct = Command::new(BRIDGE)
        .args(["--op", "attach", "--volume-id"])
        .output()
        .unwrap();
    assert_eq!(json, answer(&direct).0);
}

/// What keeps the front small: it links no CSI client (the hot path makes no driver call)
/// and no Kubernetes client. A change that pulls either in fails here, before a benchmark
/// would show it.
#[test]
fn the_front_links_no_csi_or_kubernetes_client() {
    // grep: a debug build's executables are hundreds of MB, slow to scan in a debug test.
    let contains = |file: &str, needle: &str| {
        let status = Command::new("grep")
            .args(["-q", "-a", "-F", needle, file])
            .status()
            .unwrap();
        assert!(
            status.code().is_some_and(|c| c <= 1),
            "grep failed on {file}"
        );
        status.success()
    };
    for marker in [
        // a CSI gRPC method path (tonic) and the in-cluster variable the kube client reads
        "/csi.v1.Node/NodeStageVolume",
        "KUBERNETES_SERVICE_HOST",
        // the Kubernetes store's CRD group
        "csibridge.cubesandbox.io",
    ] {
        assert!(contains(BRIDGE, marker), "the full binary has {marker}");
        assert!(!contains(HOOK, marker), "the front has {marker}");
    }
}

/// The front starts with no dynamic loader (build.rs links it static-pie): no
/// `PT_INTERP` program header, and still position-independent (`ET_DYN`), so ASLR is
/// kept. A toolchain change that brings back the loader, and its start-up on every forked
/// hook, fails here. The full binary stays dynamically linked.
#[test]
fn the_front_is_linked_without_a_dynamic_loader() {
    /// The ELF type and the program header types of a 64-bit little-endian executable
    /// (its headers only: a debug build's executables are hundreds of MB).
    fn elf_type_and_segments(path: &str) -> (u16, Vec<u32>) {
        use std::io::Read;
        let mut elf = Vec::new();
        std::fs::File::open(path)
            .unwrap()
            .take(64 * 1024)
            .read_to_end(&mut elf)
            .unwrap();
        assert_eq!(&elf[..6], b"\x7fELF\x02\x01", "{path}: not a 64-bit LE ELF");
        let u16_at = |at: usize| u16::from_le_bytes(elf[at..at + 2].try_into().unwrap());
        let u32_at = |at: usize| u32::from_le_bytes(elf[at..at + 4].try_into().unwrap());
        let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
        let (entry_size, count) = (u16_at(0x36) as usize, u16_at(0x38) as usize);
        let segments = (0..count).map(|i| u32_at(phoff + i * entry_size)).collect();
        (u16_at(0x10), segments)
    }
    const ET_DYN: u16 = 3;
    const PT_INTERP: u32 = 3;
    let (front_type, front) = elf_type_and_segments(HOOK);
    assert_eq!(front_type, ET_DYN, "the front is position-independent");
    assert!(
        !front.contains(&PT_INTERP),
        "the front asks for a dynamic loader: build.rs could not link it static \
         (see its cargo:warning)"
    );
    let (_, full) = elf_type_and_segments(BRIDGE);
    assert!(
        full.contains(&PT_INTERP),
        "the full binary is linked as before"
    );
}

/// The front loads the config as the full binary does, but looks a named
/// `serve.socket_group` up in /etc/group alone: being static, it must not `dlopen` the
/// host's NSS modules (and the host's libc with them). A group listed there is found and
/// the front answers by itself; one it cannot find there hands the hook on to the full
/// binary (here missing, so the error names it), which would ask NSS.
#[test]
fn a_front_looks_a_named_socket_group_up_in_etc_group_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let front = lonely_front(dir.path(), "cube-csi-hook");
    let config = dir.path().join("bridge.toml");
    let detach_by_front = |group: &str| {
        let text = common::config_text(dir.path(), "").replace(
            "[serve]\n",
            &format!("[serve]\nsocket_group = \"{group}\"\n"),
        );
        std::fs::write(&config, text).unwrap();
        std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
        // A Detach that leaves holders of a volume with no record: the hot path answers it.
        output_of(
            Command::new(&front)
                .args([
                    "--op",
                    "detach",
                    "--sandbox-id",
                    "sb",
                    "--namespace",
                    "default",
                ])
                .args(["--volume-id", "v", "--ref-count", "1", "--metadata", "{}"])
                .env("CUBE_CSI_BRIDGE_CONFIG", &config),
        )
    };
    // root is gid 0 in /etc/group on every host.
    let (json, code) = answer(&detach_by_front("root"));
    assert_eq!(code, Some(0), "answered by the front: {json}");
    let error = install_error(&detach_by_front("no-such-group-ccb"));
    assert!(error.contains("finds no full binary"), "{error}");
}

/// The front runs the full binary as root: one that someone else could have changed or
/// put there is refused, by the rule a config file is held to, and nothing runs.
#[test]
fn a_full_binary_others_could_change_is_not_run() {
    use std::os::unix::fs::PermissionsExt;
    let bin = tempfile::tempdir().unwrap();
    let front = lonely_front(bin.path(), "cube-csi-hook");
    let full = bin.path().join("cube-csi-bridge");
    std::fs::copy(BRIDGE, &full).unwrap();
    let help = || output_of(Command::new(&front).arg("--help"));
    assert!(help().status.success(), "a trusted install runs");

    std::fs::set_permissions(&full, std::fs::Permissions::from_mode(0o775)).unwrap();
    let error = install_error(&help());
    assert!(
        error.contains("refuses to run the full binary") && error.contains("chmod go-w"),
        "{error}"
    );

    std::fs::set_permissions(&full, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let (json, _) = answer(&help());
    assert!(
        json["error"]
            .as_str()
            .is_some_and(|e| e.contains("writable by its group or by others")),
        "{json}"
    );
}
