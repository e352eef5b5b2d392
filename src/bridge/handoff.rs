//! What the bridge hands Cube to give back later: Create's private_data (the CSI handle,
//! carried to every Attach so the node needs no controller store) and Attach's metadata
//! (carried to Detach).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::naming::VolumePaths;
use super::ports::Segments;

/// Cube stores private_data in a varchar(1024) and refuses anything longer.
pub const MAX_PRIVATE_DATA_LEN: usize = 1024;
/// Version of the private_data encoding.
pub const HANDLE_VERSION: u32 = 1;

/// Metadata keys (Attach → Detach).
pub mod keys {
    pub const MOUNT_DIR: &str = "mount_dir";
    pub const VOLUME_ID: &str = "volume_id";
    pub const CSI_VOLUME_ID: &str = "csi_volume_id";
    pub const STAGING_DIR: &str = "staging_dir";
}

/// The CSI side of a Cube volume, as the node needs it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VolumeHandle {
    pub csi_volume_id: String,
    pub volume_context: BTreeMap<String, String>,
    /// The driver had PUBLISH_UNPUBLISH_VOLUME when the volume was created, so the node
    /// must ControllerPublish before staging.
    pub controller_publish: bool,
    /// CreateVolume's accessible_topology: the nodes the volume can be attached on (empty:
    /// every node). Attach refuses a node whose NodeGetInfo topology matches none.
    pub topology: Vec<Segments>,
}

/// Compact JSON: `{"v":1,"id":"…","ctx":{…},"cp":true,"t":[{…}],"d":"nfs"}`. `d`, the
/// Cube driver the handle belongs to, and `t`, the accessible topology, came later within
/// version 1: handles without them are accepted (a handle without `t` attaches anywhere).
#[derive(Serialize, Deserialize)]
struct WireHandle {
    v: u32,
    id: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    ctx: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    cp: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    t: Vec<Segments>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    d: Option<String>,
}

impl VolumeHandle {
    /// Encodes the handle as private_data, refusing anything Cube could not store.
    pub fn encode(&self) -> Result<String, String> {
        self.encode_as(None)
    }

    /// Encodes the handle as private_data of Cube driver `driver`, so that another bridge
    /// instance refuses it (`decode_for`).
    pub fn encode_for(&self, driver: &str) -> Result<String, String> {
        self.encode_as(Some(driver))
    }

    fn encode_as(&self, driver: Option<&str>) -> Result<String, String> {
        let text = serde_json::to_string(&WireHandle {
            v: HANDLE_VERSION,
            id: self.csi_volume_id.clone(),
            ctx: self.volume_context.clone(),
            cp: self.controller_publish,
            t: self.topology.clone(),
            d: driver.map(str::to_string),
        })
        .map_err(|e| e.to_string())?;
        if text.len() > MAX_PRIVATE_DATA_LEN {
            return Err(format!(
                "the driver's volume id, volume_context and accessible topology encode to {} \
                 bytes of private_data; Cube stores at most {MAX_PRIVATE_DATA_LEN}",
                text.len()
            ));
        }
        Ok(text)
    }

    /// Decodes Attach's private_data for the bridge of Cube driver `driver`: a handle
    /// that names another driver is refused (a volume of another plugin, or a forgery).
    pub fn decode_for(private_data: &str, driver: &str) -> Result<Self, String> {
        let (handle, owner) = Self::decode_with_owner(private_data)?;
        match owner {
            Some(owner) if owner != driver => Err(format!(
                "private_data belongs to Cube driver {owner:?}, not {driver:?}: this volume \
                 was created through another volume plugin"
            )),
            _ => Ok(handle),
        }
    }

    /// Decodes Attach's private_data, whichever driver it names.
    pub fn decode(private_data: &str) -> Result<Self, String> {
        Self::decode_with_owner(private_data).map(|(handle, _)| handle)
    }

    fn decode_with_owner(private_data: &str) -> Result<(Self, Option<String>), String> {
        if private_data.is_empty() {
            return Err(
                "private_data is empty: this volume was not created through this \
                        bridge (its Create returns the CSI handle as private_data)"
                    .into(),
            );
        }
        if private_data.len() > MAX_PRIVATE_DATA_LEN {
            return Err(format!(
                "private_data is {} bytes; Cube allows at most {MAX_PRIVATE_DATA_LEN}",
                private_data.len()
            ));
        }
        let wire: WireHandle = serde_json::from_str(private_data)
            .map_err(|e| format!("private_data is not a cube-csi-bridge volume handle: {e}"))?;
        if wire.v != HANDLE_VERSION {
            return Err(format!(
                "private_data has handle version {}; this build reads version {HANDLE_VERSION}",
                wire.v
            ));
        }
        if wire.id.is_empty() {
            return Err("private_data has an empty CSI volume id".into());
        }
        Ok((
            Self {
                csi_volume_id: wire.id,
                volume_context: wire.ctx,
                controller_publish: wire.cp,
                topology: wire.t,
            },
            wire.d,
        ))
    }
}

/// What Attach recorded for Detach, read back from Cube's metadata map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachMetadata {
    pub paths: VolumePaths,
    pub csi_volume_id: String,
    pub staged: bool,
}

impl AttachMetadata {
    pub fn to_map(&self, volume_id: &str) -> HashMap<String, String> {
        let mut map = HashMap::from([
            (
                keys::MOUNT_DIR.to_string(),
                self.paths.target.display().to_string(),
            ),
            (keys::VOLUME_ID.to_string(), volume_id.to_string()),
            (keys::CSI_VOLUME_ID.to_string(), self.csi_volume_id.clone()),
        ]);
        if self.staged {
            map.insert(
                keys::STAGING_DIR.to_string(),
                self.paths.staging.display().to_string(),
            );
        }
        map
    }

    /// Parses Detach's metadata. An empty map is `Ok(None)` (Detach then relies on the
    /// node journal alone). Paths must be exactly the ones this bridge hands out for this
    /// driver and volume.
    pub fn from_map(
        map: &HashMap<String, String>,
        driver: &str,
        volume_id: &str,
    ) -> Result<Option<Self>, String> {
        if map.is_empty() {
            return Ok(None);
        }
        let get = |key: &str| {
            map.get(key)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("metadata has no {key:?}"))
        };
        if get(keys::VOLUME_ID)? != volume_id {
            return Err(format!(
                "metadata belongs to volume {}, not {volume_id:?}",
                super::naming::quote_bounded(&map[keys::VOLUME_ID])
            ));
        }
        let target = PathBuf::from(get(keys::MOUNT_DIR)?);
        let paths = VolumePaths::from_target(&target, driver, volume_id)?;
        let staged = match map.get(keys::STAGING_DIR).filter(|v| !v.is_empty()) {
            None => false,
            Some(s) if paths.staging.as_os_str() == s.as_str() => true,
            Some(s) => {
                return Err(format!(
                    "metadata staging_dir {} is not this volume's staging path {}",
                    super::naming::quote_bounded(s),
                    paths.staging.display()
                ));
            }
        };
        Ok(Some(Self {
            paths,
            csi_volume_id: get(keys::CSI_VOLUME_ID)?.clone(),
            staged,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn handle() -> VolumeHandle {
        VolumeHandle {
            csi_volume_id: "10.0.0.5#exports#cube-v1##".into(),
            volume_context: BTreeMap::from([("server".into(), "10.0.0.5".into())]),
            controller_publish: false,
            topology: Vec::new(),
        }
    }

    #[test]
    fn a_handle_carries_its_accessible_topology_and_old_handles_attach_anywhere() {
        let zone = |z: &str| Segments::from([("example.com/zone".to_string(), z.to_string())]);
        let mut placed = handle();
        placed.topology = vec![zone("a"), zone("b")];
        let text = placed.encode_for("nfs").unwrap();
        assert!(
            text.contains(r#""t":[{"example.com/zone":"a"},{"example.com/zone":"b"}]"#),
            "{text}"
        );
        assert_eq!(VolumeHandle::decode_for(&text, "nfs").unwrap(), placed);
        let old = r#"{"v":1,"id":"10.0.0.5#exports#cube-v1##","ctx":{"server":"10.0.0.5"}}"#;
        assert!(VolumeHandle::decode(old).unwrap().topology.is_empty());
        // Topology counts against Cube's 1024 bytes like everything else.
        placed.topology = (0..40).map(|i| zone(&format!("zone-{i:03}"))).collect();
        let err = placed.encode().unwrap_err();
        assert!(
            err.contains("accessible topology") && err.contains("1024"),
            "{err}"
        );
    }

    #[test]
    fn handle_round_trips_compactly() {
        let text = handle().encode().unwrap();
        assert_eq!(
            text,
            r#"{"v":1,"id":"10.0.0.5#exports#cube-v1##","ctx":{"server":"10.0.0.5"}}"#
        );
        assert_eq!(VolumeHandle::decode(&text).unwrap(), handle());
    }

    #[test]
    fn a_handle_names_its_driver_and_another_bridge_refuses_it() {
        let text = handle().encode_for("nfs").unwrap();
        assert!(text.ends_with(r#","d":"nfs"}"#), "{text}");
        assert_eq!(VolumeHandle::decode_for(&text, "nfs").unwrap(), handle());
        let err = VolumeHandle::decode_for(&text, "cephfs").unwrap_err();
        assert!(err.contains("\"nfs\"") && err.contains("cephfs"), "{err}");
        // Handles from before `d` existed still attach.
        let old = handle().encode().unwrap();
        assert_eq!(VolumeHandle::decode_for(&old, "cephfs").unwrap(), handle());
    }

    #[test]
    fn bad_private_data_is_explained() {
        let mut big = handle();
        big.volume_context.insert("k".into(), "x".repeat(1100));
        assert!(big.encode().unwrap_err().contains("at most 1024"));
        for (input, needle) in [
            ("", "empty"),
            ("volumes/v1/", "not a cube-csi-bridge volume handle"),
            (r#"{"v":2,"id":"x"}"#, "version 2"),
            (r#"{"v":1,"id":""}"#, "empty CSI volume id"),
        ] {
            let err = VolumeHandle::decode(input).unwrap_err();
            assert!(err.contains(needle), "{input}: {err}");
        }
        assert!(
            VolumeHandle::decode(&"x".repeat(1025))
                .unwrap_err()
                .contains("1025")
        );
    }

    #[test]
    fn metadata_round_trips_and_is_checked() {
        let meta = AttachMetadata {
            paths: VolumePaths::new(Path::new("/data/v"), "nfs", "v1"),
            csi_volume_id: "h".into(),
            staged: true,
        };
        let map = meta.to_map("v1");
        assert_eq!(
            AttachMetadata::from_map(&map, "nfs", "v1").unwrap(),
            Some(meta)
        );
        assert_eq!(
            AttachMetadata::from_map(&HashMap::new(), "nfs", "v1").unwrap(),
            None
        );
        let mut evil = map.clone();
        evil.insert(keys::MOUNT_DIR.into(), "/etc/nfs+v1".into());
        evil.insert(keys::STAGING_DIR.into(), "/etc/.staging/nfs+v1".into());
        assert!(
            AttachMetadata::from_map(&evil, "nfs", "v1").is_ok(),
            "same shape elsewhere is a base dir"
        );
        let mut evil = map.clone();
        evil.insert(keys::MOUNT_DIR.into(), "/data/v/other".into());
        assert!(AttachMetadata::from_map(&evil, "nfs", "v1").is_err());
        let mut evil = map.clone();
        evil.insert(keys::STAGING_DIR.into(), "/data/v/x".into());
        assert!(AttachMetadata::from_map(&evil, "nfs", "v1").is_err());
        assert!(AttachMetadata::from_map(&map, "nfs", "v2").is_err());
    }

    /// Metadata Cube kept from an Attach before the leaf changed (`<driver>-<volume_id>`)
    /// still names that volume's paths, and only as a whole: a legacy mount_dir with a
    /// current staging_dir is refused.
    #[test]
    fn legacy_metadata_is_read() {
        let map = HashMap::from([
            (keys::MOUNT_DIR.to_string(), "/data/v/nfs-v1".to_string()),
            (
                keys::STAGING_DIR.to_string(),
                "/data/v/.staging/nfs-v1".to_string(),
            ),
            (keys::VOLUME_ID.to_string(), "v1".to_string()),
            (keys::CSI_VOLUME_ID.to_string(), "h".to_string()),
        ]);
        let meta = AttachMetadata::from_map(&map, "nfs", "v1")
            .unwrap()
            .unwrap();
        assert_eq!(meta.paths.target, Path::new("/data/v/nfs-v1"));
        assert_eq!(meta.paths.staging, Path::new("/data/v/.staging/nfs-v1"));
        assert!(meta.staged);
        assert_eq!(meta.to_map("v1"), map, "round-trips as it came");
        let mut mixed = map.clone();
        mixed.insert(keys::STAGING_DIR.into(), "/data/v/.staging/nfs+v1".into());
        assert!(AttachMetadata::from_map(&mixed, "nfs", "v1").is_err());
    }
}
