//! The bridge's own request and reply types, already validated by the edge that made
//! them (`cube::validate`).

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Deserialize;

use super::handoff::{AttachMetadata, VolumeHandle};

/// Cube Create.
#[derive(Debug, Clone)]
pub struct CreateVolume {
    pub volume_id: String,
    pub name: String,
}

/// Create's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    pub token: String,
    pub private_data: String,
}

/// Cube Destroy.
#[derive(Debug, Clone)]
pub struct DestroyVolume {
    pub volume_id: String,
}

/// Cube Attach.
#[derive(Debug, Clone)]
pub struct AttachVolume {
    pub sandbox_id: String,
    pub namespace: String,
    pub volume_id: String,
    /// Holders before this sandbox; informational (the mount table is the truth).
    pub ref_count: i64,
    pub base_dir: PathBuf,
    pub handle: VolumeHandle,
}

/// Attach's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    pub host_path: PathBuf,
    pub metadata: HashMap<String, String>,
}

/// Cube Detach.
#[derive(Debug, Clone)]
pub struct DetachVolume {
    pub sandbox_id: String,
    pub namespace: String,
    pub volume_id: String,
    /// Holders after this sandbox left; teardown happens only at 0.
    pub ref_count: i64,
    /// What Attach handed Cube, if Cube had it.
    pub recorded: Option<AttachMetadata>,
}

/// The access mode requested for every volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    #[default]
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

/// Which Cube services an instance (or one forked hook) answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roles {
    /// VolumeControllerService (CubeMaster's Create/Destroy).
    pub controller: bool,
    /// VolumePluginService (Cubelet's Attach/Detach).
    pub node: bool,
}

impl Roles {
    pub const BOTH: Roles = Roles {
        controller: true,
        node: true,
    };
    pub const CONTROLLER: Roles = Roles {
        controller: true,
        node: false,
    };
    pub const NODE: Roles = Roles {
        controller: false,
        node: true,
    };

    /// The config spelling: `controller`, `node` or `both`.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value {
            "controller" => Ok(Roles::CONTROLLER),
            "node" => Ok(Roles::NODE),
            "both" => Ok(Roles::BOTH),
            other => Err(format!("{other:?} must be controller, node or both")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match (self.controller, self.node) {
            (true, true) => "both",
            (true, false) => "controller",
            (false, true) => "node",
            (false, false) => "none",
        }
    }
}
