//! Generated gRPC bindings for the two protocols the bridge speaks, plus the hand-written
//! Debug output of CSI messages that carry secrets.

#![allow(clippy::all, missing_docs)]

/// The Container Storage Interface, v1.12 (the bridge is its client; tests and the demo
/// serve it).
pub mod csi {
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

/// CubeSandbox's volume-plugin protocol (the bridge serves it).
pub mod cube {
    pub mod v1 {
        tonic::include_proto!("cubelet.services.volumeplugin.v1");
    }
}

/// Debug for a CSI message that shows only the named fields. Secrets maps and mount flags
/// are never among them: build.rs turns off the derived Debug for exactly these types.
macro_rules! debug_without_secrets {
    ($($ty:ident { $($field:ident),* $(,)? })*) => {$(
        impl std::fmt::Debug for csi::v1::$ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($ty))
                    $(.field(stringify!($field), &self.$field))*
                    .finish_non_exhaustive()
            }
        }
    )*};
}

debug_without_secrets! {
    CreateVolumeRequest { name, capacity_range, parameters }
    DeleteVolumeRequest { volume_id }
    ControllerPublishVolumeRequest { volume_id, node_id, readonly }
    ControllerUnpublishVolumeRequest { volume_id, node_id }
    ValidateVolumeCapabilitiesRequest { volume_id }
    CreateSnapshotRequest { source_volume_id, name }
    DeleteSnapshotRequest { snapshot_id }
    ListSnapshotsRequest { snapshot_id, source_volume_id, max_entries }
    GetSnapshotRequest { snapshot_id }
    ControllerExpandVolumeRequest { volume_id, capacity_range }
    ControllerModifyVolumeRequest { volume_id }
    NodeStageVolumeRequest { volume_id, staging_target_path }
    NodePublishVolumeRequest { volume_id, staging_target_path, target_path, readonly }
    NodeExpandVolumeRequest { volume_id, volume_path, capacity_range }
    CreateVolumeGroupSnapshotRequest { name, source_volume_ids }
    DeleteVolumeGroupSnapshotRequest { group_snapshot_id }
    GetVolumeGroupSnapshotRequest { group_snapshot_id }
    GetMetadataAllocatedRequest { snapshot_id, starting_offset }
    GetMetadataDeltaRequest { base_snapshot_id, target_snapshot_id, starting_offset }
}

impl std::fmt::Debug for csi::v1::volume_capability::MountVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // mount_flags may carry credentials (CSI spec): show how many, not what.
        f.debug_struct("MountVolume")
            .field("fs_type", &self.fs_type)
            .field(
                "mount_flags",
                &format_args!("<{} redacted>", self.mount_flags.len()),
            )
            .field("volume_mount_group", &self.volume_mount_group)
            .finish()
    }
}
