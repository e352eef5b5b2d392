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
