//! The node journal: one small JSON file per volume attached on this node.
//!
//! Like kubelet's vol_data.json, a record is written (durably) *before* each mutating CSI
//! call, with that step marked `Uncertain`, so that after a crash the bridge knows what
//! may exist and can tear it down or finish it. Completed steps are recorded without
//! waiting for the disk: losing one only makes a step look uncertain, never absent.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::fsutil::{remove_durable, write_atomic};

/// The on-disk format of a record; bumped on incompatible change.
pub const JOURNAL_FORMAT: u32 = 1;

/// How far one mutating step has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Never called, or undone.
    #[default]
    Absent,
    /// Called without a known result: it may or may not have taken effect.
    Uncertain,
    /// Succeeded.
    Done,
}

impl Step {
    /// Whether teardown must call the inverse of this step.
    pub fn needs_undo(self) -> bool {
        self != Step::Absent
    }
}

/// What this node did for one volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub format: u32,
    /// The Cube volume id.
    pub volume_id: String,
    pub csi_volume_id: String,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    /// From ControllerPublish; passed to NodeStage and NodePublish.
    #[serde(default)]
    pub publish_context: BTreeMap<String, String>,
    /// The node id ControllerPublish was called with (empty when it was not).
    #[serde(default)]
    pub node_id: String,
    /// The CSI target path, which is Cube's host_path.
    pub target_path: PathBuf,
    /// The CSI staging path, when the driver stages.
    #[serde(default)]
    pub staging_path: Option<PathBuf>,
    #[serde(default)]
    pub controller_publish: Step,
    #[serde(default)]
    pub stage: Step,
    #[serde(default)]
    pub publish: Step,
    /// Sandboxes that attached, as `<namespace>/<sandbox_id>` (informational: Cube's
    /// ref_count decides teardown).
    #[serde(default)]
    pub holders: BTreeSet<String>,
}

impl NodeRecord {
    pub fn new(volume_id: &str, csi_volume_id: &str, target_path: PathBuf) -> Self {
        Self {
            format: JOURNAL_FORMAT,
            volume_id: volume_id.to_string(),
            csi_volume_id: csi_volume_id.to_string(),
            volume_context: BTreeMap::new(),
            publish_context: BTreeMap::new(),
            node_id: String::new(),
            target_path,
            staging_path: None,
            controller_publish: Step::Absent,
            stage: Step::Absent,
            publish: Step::Absent,
            holders: BTreeSet::new(),
        }
    }

    /// Whether any step may have left something behind.
    pub fn has_work_to_undo(&self) -> bool {
        self.controller_publish.needs_undo() || self.stage.needs_undo() || self.publish.needs_undo()
    }
}

/// The journal directory.
#[derive(Debug, Clone)]
pub struct NodeJournal {
    dir: PathBuf,
}

impl NodeJournal {
    /// Opens the journal at `dir`, creating the directory (0700) if needed.
    pub fn open(dir: &Path) -> io::Result<Self> {
        crate::mount::ops::ensure_dir(dir, 0o700)?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, volume_id: &str) -> PathBuf {
        self.dir.join(format!("{volume_id}.json"))
    }

    /// The record of `volume_id`, if the node holds one.
    pub fn load(&self, volume_id: &str) -> io::Result<Option<NodeRecord>> {
        let path = self.path(volume_id);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        Self::decode(&path, &bytes).map(Some)
    }

    fn decode(path: &Path, bytes: &[u8]) -> io::Result<NodeRecord> {
        let record: NodeRecord = serde_json::from_slice(bytes).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("journal record {} is corrupt: {e}", path.display()),
            )
        })?;
        if record.format != JOURNAL_FORMAT {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "journal record {} has format {}, this build reads {JOURNAL_FORMAT}",
                    path.display(),
                    record.format
                ),
            ));
        }
        Ok(record)
    }

    /// Writes `record`; `durable` waits until it is on disk (use before a CSI call).
    pub fn save(&self, record: &NodeRecord, durable: bool) -> io::Result<()> {
        let bytes = serde_json::to_vec(record).map_err(io::Error::other)?;
        write_atomic(&self.path(&record.volume_id), &bytes, durable)
    }

    /// Forgets `volume_id` (after a complete teardown).
    pub fn remove(&self, volume_id: &str) -> io::Result<()> {
        remove_durable(&self.path(volume_id))
    }

    /// Every record, for start-up reconciliation and the node inventory. Corrupt files are
    /// reported, not skipped silently.
    pub fn list(&self) -> io::Result<Vec<Result<NodeRecord, io::Error>>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let is_record = path.extension().is_some_and(|e| e == "json")
                && !path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with('.'));
            if is_record {
                out.push(std::fs::read(&path).and_then(|b| Self::decode(&path, &b)));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_load_remove_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let journal = NodeJournal::open(&tmp.path().join("node")).unwrap();
        assert_eq!(journal.load("-v1").unwrap(), None);
        let mut rec = NodeRecord::new("-v1", "csi-1", "/base/drv--v1".into());
        rec.stage = Step::Uncertain;
        journal.save(&rec, true).unwrap();
        assert_eq!(journal.load("-v1").unwrap(), Some(rec.clone()));
        assert_eq!(journal.list().unwrap().len(), 1);
        journal.remove("-v1").unwrap();
        journal.remove("-v1").unwrap();
        assert_eq!(journal.load("-v1").unwrap(), None);
    }

    #[test]
    fn corrupt_or_future_records_are_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let journal = NodeJournal::open(tmp.path()).unwrap();
        std::fs::write(tmp.path().join("a.json"), b"{").unwrap();
        assert!(
            journal
                .load("a")
                .unwrap_err()
                .to_string()
                .contains("corrupt")
        );
        let mut rec = NodeRecord::new("b", "x", "/t".into());
        rec.format = 99;
        std::fs::write(tmp.path().join("b.json"), serde_json::to_vec(&rec).unwrap()).unwrap();
        assert!(
            journal
                .load("b")
                .unwrap_err()
                .to_string()
                .contains("format 99")
        );
    }
}
