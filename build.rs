//! Compiles the CSI and Cube protocol definitions in proto/ into Rust gRPC bindings.
//!
//! protox is a pure-Rust protobuf compiler: no system protoc, no network.

use std::path::PathBuf;

const PROTOS: &[&str] = &["csi/v1/csi.proto", "cube/v1/volumeplugin.proto"];

/// CSI requests whose fields are marked `csi_secret` (or carry mount flags, which may
/// hold credentials). Their Debug output is written by hand in src/proto.rs so that a
/// `{:?}` can never print a secret.
const REDACTED_DEBUG: &[&str] = &[
    ".csi.v1.CreateVolumeRequest",
    ".csi.v1.DeleteVolumeRequest",
    ".csi.v1.ControllerPublishVolumeRequest",
    ".csi.v1.ControllerUnpublishVolumeRequest",
    ".csi.v1.ValidateVolumeCapabilitiesRequest",
    ".csi.v1.CreateSnapshotRequest",
    ".csi.v1.DeleteSnapshotRequest",
    ".csi.v1.ListSnapshotsRequest",
    ".csi.v1.GetSnapshotRequest",
    ".csi.v1.ControllerExpandVolumeRequest",
    ".csi.v1.ControllerModifyVolumeRequest",
    ".csi.v1.NodeStageVolumeRequest",
    ".csi.v1.NodePublishVolumeRequest",
    ".csi.v1.NodeExpandVolumeRequest",
    ".csi.v1.CreateVolumeGroupSnapshotRequest",
    ".csi.v1.DeleteVolumeGroupSnapshotRequest",
    ".csi.v1.GetVolumeGroupSnapshotRequest",
    ".csi.v1.GetMetadataAllocatedRequest",
    ".csi.v1.GetMetadataDeltaRequest",
    ".csi.v1.VolumeCapability.MountVolume",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The hook front starts once per forked hook: its relative relocations packed
    // (DT_RELR, glibc 2.36+) are applied faster at every start.
    println!("cargo:rustc-link-arg-bin=cube-csi-hook=-Wl,-z,pack-relative-relocs");
    link_hook_front_static()?;
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    let fds = protox::compile(PROTOS, [&root])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Unimplemented RPCs answer UNIMPLEMENTED, as the CSI spec expects of optional calls.
        .generate_default_stubs(true)
        .skip_debug(REDACTED_DEBUG.iter().copied())
        .compile_fds(fds)?;
    Ok(())
}

/// The C libraries the Rust standard library and the libc crate name on linux-gnu, each
/// as the static archive the hook front is given instead.
const FRONT_STATIC_LIBS: &[&str] = &["c", "m", "pthread", "dl", "rt", "util"];

/// Links the hook front as a static PIE, where the C toolchain has the static archives.
///
/// Its start-up is what a forked hook pays on every Attach and Detach Cube forks: without
/// an interpreter there is no dynamic loader resolving libc, libm and libgcc_s, and no
/// constructor of libgcc_s probing the CPU (docs/benchmarks.md, *The hook front linked
/// static*). It stays position-independent, so ASLR is kept.
///
/// Cargo has no per-binary `-C target-feature=+crt-static`, and rustc names the shared
/// libraries (`-lgcc_s`, `-lc`, …) for every binary of the package. So the front alone gets
/// `-static-pie` and a search directory listed before the system's, in which each of those
/// names is the static archive: `libc.a` and the rest as links to glibc's, `libgcc_s.a` a
/// linker script that stands for libgcc_eh.a and libgcc.a (what rustc links with
/// crt-static). The full binary is untouched. Where an archive is missing the front is
/// linked as before, with a warning; tests/hook_front.rs fails on such a build.
fn link_hook_front_static() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let target_env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if target_os != "linux" || target_env != "gnu" {
        return Ok(());
    }
    let linker = std::env::var("RUSTC_LINKER").unwrap_or_else(|_| "cc".to_owned());
    // `cc -print-file-name=X` answers the bare name when it does not find X.
    let locate = |file: &str| -> Option<PathBuf> {
        let out = std::process::Command::new(&linker)
            .arg(format!("-print-file-name={file}"))
            .output()
            .ok()?;
        let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
        (out.status.success() && path.is_absolute() && path.exists()).then_some(path)
    };
    let mut wanted: Vec<String> = FRONT_STATIC_LIBS
        .iter()
        .map(|lib| format!("lib{lib}.a"))
        .collect();
    wanted.extend(["libgcc_eh.a", "libgcc.a", "rcrt1.o"].map(String::from));
    let mut found = std::collections::BTreeMap::new();
    for file in &wanted {
        match locate(file) {
            Some(path) => found.insert(file.clone(), path),
            None => {
                println!(
                    "cargo:warning=cube-csi-hook is linked dynamically: {linker} finds no {file} \
                     (Debian: libc6-dev and libgcc-*-dev); every forked hook then starts slower"
                );
                return Ok(());
            }
        };
    }
    let dir = PathBuf::from(std::env::var("OUT_DIR")?).join("hook-front-static");
    std::fs::create_dir_all(&dir)?;
    for lib in FRONT_STATIC_LIBS {
        let name = format!("lib{lib}.a");
        let link = dir.join(&name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&found[&name], &link)?;
    }
    std::fs::write(
        dir.join("libgcc_s.a"),
        format!(
            "INPUT(\"{}\" \"{}\")\n",
            found["libgcc_eh.a"].display(),
            found["libgcc.a"].display()
        ),
    )?;
    println!("cargo:rustc-link-arg-bin=cube-csi-hook=-static-pie");
    println!("cargo:rustc-link-arg-bin=cube-csi-hook=-L{}", dir.display());
    Ok(())
}
