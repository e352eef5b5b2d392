//! Volume expansion (`cube-csi-bridge expand`): ControllerExpandVolume on the controller
//! side, then NodeExpandVolume wherever the volume is staged or published, as
//! external-resizer and kubelet do it. Cube's hooks carry no size, so the size comes from
//! the operator, and the controller record keeps it: `list --controller` shows it and a
//! later Create of the same volume asks for (and records) at least that much.
//!
//! Who does the node's part: the command itself on the node it runs on (the embedded
//! store: run it on every node that has the volume attached), and in Kubernetes mode each
//! node daemon, which notices a CubeVolume whose recorded capacity is above what it last
//! grew the volume to (`NodeRecord::expanded_bytes`).
//!
//! Locks: the command takes the volume's node lock (when it serves the node role) and
//! then its controller lock, the only holder of both, always in that order; Attach and
//! Detach take the node lock, Create and Destroy the controller lock. So an expansion
//! never interleaves with a hook of the same volume in any process on this host, and an
//! offline driver's volume cannot be attached here between the check that nobody holds
//! it and ControllerExpandVolume.

use std::path::{Path, PathBuf};

use super::ports::{ExpansionMode, LockScope, NodeExpand, SecretUse};
use super::records::{NodeRecord, Step};
use super::{Bridge, BridgeError, Deadline, NodeSide, blocking};

/// Parses an operator's size: plain bytes, or a number with a decimal (`k`/`K`, `M`,
/// `G`, `T`, `P`, `E`, optionally followed by `B`) or binary (`Ki`, `Mi`, `Gi`, `Ti`, `Pi`,
/// `Ei`, optionally followed by `B`) suffix, as Kubernetes quantities and `df` write them.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let digits = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, suffix) = trimmed.split_at(digits);
    let bad = |why: &str| {
        format!(
            "size {text:?} {why}: give bytes (e.g. 1073741824) or a number with a suffix: \
             Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or k, M, G, T, P, E (powers of 1000)"
        )
    };
    if number.is_empty() {
        return Err(bad("does not start with a whole number"));
    }
    let value: u64 = number.parse().map_err(|_| bad("is too large"))?;
    let suffix = suffix.strip_suffix('B').unwrap_or(suffix);
    let multiplier: u64 = match suffix {
        "" => 1,
        "k" | "K" => 1000,
        "M" => 1000u64.pow(2),
        "G" => 1000u64.pow(3),
        "T" => 1000u64.pow(4),
        "P" => 1000u64.pow(5),
        "E" => 1000u64.pow(6),
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        _ => return Err(bad("has an unknown suffix")),
    };
    let bytes = value
        .checked_mul(multiplier)
        .filter(|b| *b <= i64::MAX as u64)
        .ok_or_else(|| bad("is too large (CSI sizes are at most 2^63-1 bytes)"))?;
    if bytes == 0 {
        return Err(bad("is zero"));
    }
    Ok(bytes)
}

/// `2Gi`, `1.5Gi`, `512` (bytes): a size as a person reads it.
pub fn human_size(bytes: i64) -> String {
    const UNITS: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let mut unit = None;
    let mut value = bytes as f64;
    for name in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = Some(name);
    }
    match unit {
        None => format!("{bytes}B"),
        Some(unit) if value.fract() == 0.0 => format!("{value}{unit}"),
        Some(unit) => format!("{value:.2}{unit}"),
    }
}

/// What the node's part of an expansion did on this node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum NodeExpansion {
    /// NodeExpandVolume grew the volume where it is available on this node.
    Expanded {
        volume_path: PathBuf,
        /// What the driver reported (the size asked for when it said nothing).
        capacity_bytes: i64,
    },
    /// This node had already grown it to at least that size.
    AlreadyExpanded { capacity_bytes: i64 },
    /// The volume is neither staged nor published on this node: nothing to grow here (a
    /// later Attach mounts the grown volume; in Kubernetes mode the node daemon grows it
    /// once attached).
    NotAttached,
    /// The driver said no node needs to grow it (`node_expansion_required` false).
    NotRequired,
    /// The driver's node service lacks EXPAND_VOLUME, so nothing more can be done here.
    Unsupported,
}

impl NodeSide {
    /// Where this node has `volume_id` staged or published, and who holds it there; None
    /// when it does not. The caller holds the volume's node lock.
    pub(crate) fn attachment_here(&self, volume_id: &str) -> Result<Option<String>, BridgeError> {
        let Some(record) = self.journal.load(volume_id)? else {
            return Ok(None);
        };
        if !is_attached(&record) && !record.holders_unknown && !record.is_held() {
            return Ok(None);
        }
        let holders: Vec<String> = record
            .holders
            .iter()
            .flat_map(|(ns, sandboxes)| sandboxes.iter().map(move |sb| format!("{ns}/{sb}")))
            .chain(record.holders_unknown.then(|| "UNKNOWN".to_string()))
            .collect();
        Ok(Some(format!(
            "this node has it at {} (holders: {})",
            record.target_path.display(),
            if holders.is_empty() {
                "none".to_string()
            } else {
                holders.join(", ")
            }
        )))
    }

    /// The node's part of an expansion: NodeExpandVolume at the volume's path on this
    /// node when it is staged or published there and has not been grown to `size` yet;
    /// the journal keeps the size it was grown to. Takes the volume's node lock unless
    /// the caller holds it (`locked`).
    pub async fn expand_here(
        &self,
        volume_id: &str,
        size: i64,
        required: bool,
        locked: bool,
    ) -> Result<NodeExpansion, BridgeError> {
        let deadline = Deadline::after(self.config.timeouts.attach);
        let _guard = if locked {
            None
        } else {
            Some(
                self.locks
                    .acquire(LockScope::Node, volume_id, &deadline)
                    .await?,
            )
        };
        if !required {
            return Ok(NodeExpansion::NotRequired);
        }
        let Some(mut record) = self.journal.load(volume_id)? else {
            return Ok(NodeExpansion::NotAttached);
        };
        if !is_attached(&record) {
            return Ok(NodeExpansion::NotAttached);
        }
        if record.expanded_bytes >= size {
            return Ok(NodeExpansion::AlreadyExpanded {
                capacity_bytes: record.expanded_bytes,
            });
        }
        if !self.driver.node_caps(&deadline).await?.expand_volume {
            return Ok(NodeExpansion::Unsupported);
        }
        let identity = self.driver.controller_view(&deadline).await?.0;
        let spec = self.settings.spec(&identity.name).await?;
        let staging_path = record
            .staging_path
            .clone()
            .filter(|_| record.stage == Step::Done);
        let volume_path = match (&record.publish, &staging_path) {
            (Step::Done, _) | (_, None) => record.target_path.clone(),
            (_, Some(staging)) => staging.clone(),
        };
        // The driver resizes what it finds at these paths, as root: checked as any path a
        // driver gets (a link planted under the base dir would lead it elsewhere).
        let checked: Vec<&Path> = std::iter::once(volume_path.as_path())
            .chain(staging_path.as_deref())
            .collect();
        self.verify(
            &super::node::base_of(&record.target_path),
            &checked,
            &deadline,
        )
        .await?;
        let call = NodeExpand {
            csi_volume_id: record.csi_volume_id.clone(),
            volume_path: volume_path.clone(),
            staging_path,
            required_bytes: size.max(0) as u64,
            capability: spec.capability,
            secrets: self.settings.secrets(SecretUse::NodeExpand).await?,
        };
        tracing::info!(volume_id, path = %volume_path.display(), size, "expanding the volume on this node");
        let reply = self.driver.node().expand_volume(&call, &deadline).await;
        let reported = self.driver.driver(reply).await?;
        // The size asked for, not a larger one the driver reports (rounded up): a record
        // asking for exactly what was asked here is then done, never "above" the record.
        record.expanded_bytes = size;
        let journal = self.journal.clone();
        let saved = record.clone();
        blocking(move || journal.save(&saved, true).map_err(BridgeError::from)).await?;
        Ok(NodeExpansion::Expanded {
            volume_path,
            capacity_bytes: size.max(reported),
        })
    }
}

impl NodeSide {
    /// Kubernetes mode, the node daemon's part: grows every volume attached here whose
    /// controller record (a CubeVolume) asks nodes to grow it to a capacity above what
    /// this node last grew it to. Only the records of this node's own volumes are read,
    /// and only a record naming the CSI volume the journal has is followed (the journal's
    /// handle is the one NodeExpandVolume gets). Returns how many volumes it grew; one
    /// volume's failure is logged and retried next time, not the others'.
    pub async fn follow_recorded_expansions(
        &self,
        store: &dyn super::ports::ControllerStore,
    ) -> Result<usize, BridgeError> {
        let journal = self.journal.clone();
        let volumes = blocking(move || Ok(journal.volume_ids()?)).await?;
        let mut grown = 0;
        for volume_id in volumes {
            let Ok(Some(here)) = self.journal.load(&volume_id) else {
                continue;
            };
            // One record that cannot be read (one edited to another volume's spec, an
            // apiserver hiccup) is that volume's problem, not every later one's.
            let record = match store.get(&volume_id).await {
                Ok(Some(record)) => record,
                Ok(None) => continue,
                Err(error) => {
                    tracing::warn!(volume_id = %volume_id, %error, "reading the volume's controller record failed; its growth, if any, waits for the next pass");
                    continue;
                }
            };
            let followed = record.state == super::records::VolumeState::Created
                && record.node_expansion_required
                && record.csi_volume_id.as_deref() == Some(here.csi_volume_id.as_str())
                && is_attached(&here);
            if followed && record.capacity_bytes < here.expanded_bytes {
                // The record's capacity is not covered by its MAC, and the node has no
                // key to check one: a size it grew to earlier may have come from an
                // edited record (i64::MAX). Kept above the record's, that memory would
                // answer every real growth below it "already grown".
                if let Err(error) = self
                    .forget_growth_above(&volume_id, here.expanded_bytes, record.capacity_bytes)
                    .await
                {
                    tracing::warn!(volume_id = %volume_id, %error, "lowering the size this node grew the volume to failed; retrying later");
                }
                continue;
            }
            if !followed || record.capacity_bytes == here.expanded_bytes {
                continue;
            }
            match self
                .expand_here(&volume_id, record.capacity_bytes, true, false)
                .await
            {
                Ok(NodeExpansion::Expanded { .. }) => {
                    tracing::info!(
                        volume_id = %volume_id,
                        capacity_bytes = record.capacity_bytes,
                        "grew the volume on this node, as its controller record asks"
                    );
                    grown += 1;
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(volume_id = %volume_id, %error, "growing the volume on this node failed; retrying later")
                }
            }
        }
        Ok(grown)
    }
}

impl NodeSide {
    /// Lowers the size the journal says this node grew `volume_id` to, from `seen` (read
    /// before the lock) to `size` (the controller record's), under the volume's node
    /// lock: the next growth the record asks for above it is followed again. A size that
    /// changed since it was seen (an `expand` meanwhile) is left. Nothing is asked of the
    /// driver.
    async fn forget_growth_above(
        &self,
        volume_id: &str,
        seen: i64,
        size: i64,
    ) -> Result<(), BridgeError> {
        let deadline = Deadline::after(self.config.timeouts.attach);
        let _guard = self
            .locks
            .acquire(LockScope::Node, volume_id, &deadline)
            .await?;
        let Some(mut record) = self.journal.load(volume_id)? else {
            return Ok(());
        };
        if record.expanded_bytes != seen || record.expanded_bytes <= size {
            return Ok(());
        }
        tracing::warn!(
            volume_id,
            grown_to = record.expanded_bytes,
            recorded = size,
            "this node grew the volume above its controller record's capacity (an edited \
             record?); following the record's size from now on"
        );
        record.expanded_bytes = size;
        let journal = self.journal.clone();
        blocking(move || journal.save(&record, true).map_err(BridgeError::from)).await
    }
}

/// Staged or published on this node (a step that may have taken effect counts).
fn is_attached(record: &NodeRecord) -> bool {
    record.publish != Step::Absent || record.stage != Step::Absent
}

/// What `cube-csi-bridge expand` did, for its text and JSON output.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ExpandReport {
    pub volume_id: String,
    /// Asked for.
    pub requested_bytes: u64,
    /// The controller's part; None when this instance does not serve the controller role
    /// (the node's part only, with the size given).
    pub controller: Option<ControllerReport>,
    /// This node's part; None when this instance does not serve the node role.
    pub node: Option<NodeExpansion>,
}

/// The controller's part of an `ExpandReport`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ControllerReport {
    pub csi_volume_id: String,
    pub previous_bytes: i64,
    pub capacity_bytes: i64,
    /// ControllerExpandVolume was called.
    pub controller_expanded: bool,
    pub node_expansion_required: bool,
    /// The driver's VolumeExpansion mode.
    pub expansion: ExpansionMode,
}

impl Bridge {
    /// `cube-csi-bridge expand`: the controller's part where this instance serves the
    /// controller role, then this node's part where it serves the node role (see the
    /// module doc for the locks). Bad input (an unknown volume, a smaller size, a driver
    /// that cannot expand, an offline driver's volume in use) changes nothing.
    pub async fn expand(&self, volume_id: &str, size: u64) -> Result<ExpandReport, BridgeError> {
        super::naming::validate_volume_id(volume_id).map_err(BridgeError::InvalidRequest)?;
        let controller = self.controller().ok();
        let node = self.node().ok();
        if controller.is_none() && node.is_none() {
            return Err(BridgeError::Unavailable(
                "this instance serves neither the controller nor the node role".into(),
            ));
        }
        // Held through the controller's part: no Attach here between the offline check
        // and ControllerExpandVolume.
        let node_guard = match node {
            Some(node) => {
                let deadline = Deadline::after(node.config.timeouts.attach);
                Some(
                    node.locks
                        .acquire(LockScope::Node, volume_id, &deadline)
                        .await?,
                )
            }
            None => None,
        };
        let attached: Vec<String> = match node {
            Some(node) => node.attachment_here(volume_id)?.into_iter().collect(),
            None => Vec::new(),
        };
        let controller_part = match controller {
            Some(side) => Some(side.expand(volume_id, size, &attached).await?),
            None => None,
        };
        let node_part = match node {
            Some(node) => {
                let (target, required) = match &controller_part {
                    Some(done) => (done.capacity_bytes, done.node_expansion_required),
                    None => (size as i64, true),
                };
                Some(node.expand_here(volume_id, target, required, true).await?)
            }
            None => None,
        };
        drop(node_guard);
        Ok(ExpandReport {
            volume_id: volume_id.to_string(),
            requested_bytes: size,
            controller: controller_part.map(|c| ControllerReport {
                csi_volume_id: c.csi_volume_id,
                previous_bytes: c.previous_bytes,
                capacity_bytes: c.capacity_bytes,
                controller_expanded: c.controller_call,
                node_expansion_required: c.node_expansion_required,
                expansion: c.mode,
            }),
            node: node_part,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_bytes_and_binary_or_decimal_suffixes() {
        for (text, bytes) in [
            ("1073741824", 1u64 << 30),
            ("2Gi", 2 << 30),
            ("2GiB", 2 << 30),
            ("512Mi", 512 << 20),
            ("3G", 3_000_000_000),
            ("3GB", 3_000_000_000),
            ("10k", 10_000),
            ("10K", 10_000),
            ("1Ti", 1 << 40),
            ("7", 7),
            (" 1Ki ", 1024),
            ("7Ei", 7 << 60),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        for bad in [
            "",
            "Gi",
            "-1Gi",
            "1.5Gi",
            "2gi",
            "2Xi",
            "0",
            "0Gi",
            "8Ei",
            "99999999999999999999",
        ] {
            let error = parse_size(bad).unwrap_err();
            assert!(error.contains(&format!("{bad:?}")), "{error}");
            assert!(
                error.contains("Gi"),
                "the error names the suffixes: {error}"
            );
        }
    }

    #[test]
    fn human_sizes_are_binary() {
        assert_eq!(human_size(512), "512B");
        assert_eq!(human_size(1 << 30), "1Gi");
        assert_eq!(human_size(3 << 29), "1.50Gi");
        assert_eq!(human_size(0), "0B");
    }
}
