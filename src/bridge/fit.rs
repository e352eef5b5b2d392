//! What the configuration asks of the CSI driver, checked against what the driver
//! advertises: accessibility requirements need VOLUME_ACCESSIBILITY_CONSTRAINTS, a mount
//! group needs VOLUME_MOUNT_GROUP, and the access modes SINGLE_NODE_SINGLE_WRITER and
//! SINGLE_NODE_MULTI_WRITER need SINGLE_NODE_MULTI_WRITER on both the controller and the
//! node (CSI spec). Checked at start (`check`, `serve`) and again before a hook changes
//! anything, so that a driver replaced meanwhile fails clearly instead of deep in a call.

use super::BridgeError;
use super::ports::{
    ControllerCaps, DriverIdentity, NodeCaps, Segments, TopologyRequirement, accessible_from,
    describe_segments, describe_topologies,
};
use super::types::AccessMode;

/// Every access mode, in CSI's order.
pub const ALL_MODES: [AccessMode; 7] = [
    AccessMode::SingleNodeWriter,
    AccessMode::SingleNodeReaderOnly,
    AccessMode::MultiNodeReaderOnly,
    AccessMode::MultiNodeSingleWriter,
    AccessMode::MultiNodeMultiWriter,
    AccessMode::SingleNodeSingleWriter,
    AccessMode::SingleNodeMultiWriter,
];

/// `volume.access_mode` as written: the CSI name in lower case.
pub fn parse_mode(value: &str) -> Result<AccessMode, String> {
    ALL_MODES
        .into_iter()
        .find(|mode| snake(*mode) == value)
        .ok_or_else(|| {
            format!(
                "{:?} is not an access mode; use one of {}",
                value.chars().take(64).collect::<String>(),
                ALL_MODES.map(snake).join(", ")
            )
        })
}

/// The CSI name of an access mode, as the spec and the drivers' docs write it.
pub fn mode_name(mode: AccessMode) -> &'static str {
    match mode {
        AccessMode::SingleNodeWriter => "SINGLE_NODE_WRITER",
        AccessMode::SingleNodeReaderOnly => "SINGLE_NODE_READER_ONLY",
        AccessMode::MultiNodeReaderOnly => "MULTI_NODE_READER_ONLY",
        AccessMode::MultiNodeSingleWriter => "MULTI_NODE_SINGLE_WRITER",
        AccessMode::MultiNodeMultiWriter => "MULTI_NODE_MULTI_WRITER",
        AccessMode::SingleNodeSingleWriter => "SINGLE_NODE_SINGLE_WRITER",
        AccessMode::SingleNodeMultiWriter => "SINGLE_NODE_MULTI_WRITER",
    }
}

/// The modes a driver may only be asked for when it has SINGLE_NODE_MULTI_WRITER.
fn needs_multi_writer_cap(mode: AccessMode) -> bool {
    matches!(
        mode,
        AccessMode::SingleNodeSingleWriter | AccessMode::SingleNodeMultiWriter
    )
}

fn multi_writer_refused(driver: &str, mode: AccessMode, side: &str) -> BridgeError {
    BridgeError::Precondition(format!(
        "volume.access_mode {:?} ({}) needs the SINGLE_NODE_MULTI_WRITER {side} capability, \
         which CSI driver {driver} does not advertise; choose a mode it accepts (e.g. \
         single_node_writer)",
        snake(mode),
        mode_name(mode)
    ))
}

fn snake(mode: AccessMode) -> String {
    mode_name(mode).to_ascii_lowercase()
}

/// Refuses controller-side settings the driver cannot honour: accessibility requirements
/// without VOLUME_ACCESSIBILITY_CONSTRAINTS, a single-node writer mode without the
/// controller's SINGLE_NODE_MULTI_WRITER.
pub fn controller_fits(
    identity: &DriverIdentity,
    caps: Option<&ControllerCaps>,
    mode: AccessMode,
    accessibility: Option<&TopologyRequirement>,
) -> Result<(), BridgeError> {
    if accessibility.is_some() && !identity.accessibility_constraints {
        return Err(BridgeError::Precondition(format!(
            "volume.accessibility_requirements is set, but CSI driver {} does not advertise \
             the VOLUME_ACCESSIBILITY_CONSTRAINTS plugin capability (it has no notion of \
             topology); remove volume.accessibility_requirements",
            identity.name
        )));
    }
    if needs_multi_writer_cap(mode) && !caps.is_some_and(|c| c.single_node_multi_writer) {
        return Err(multi_writer_refused(&identity.name, mode, "controller"));
    }
    Ok(())
}

/// Refuses node-side settings the driver cannot honour: a mount group without
/// VOLUME_MOUNT_GROUP, a single-node writer mode without the node's
/// SINGLE_NODE_MULTI_WRITER.
pub fn node_fits(
    driver: &str,
    caps: &NodeCaps,
    mode: AccessMode,
    mount_group: Option<u32>,
) -> Result<(), BridgeError> {
    if let Some(gid) = mount_group
        && !caps.volume_mount_group
    {
        return Err(BridgeError::Precondition(format!(
            "volume.mount_group = {gid} is set, but CSI driver {driver} does not advertise the \
             VOLUME_MOUNT_GROUP node capability, so it cannot mount with that group; remove \
             volume.mount_group (and set the group through the driver's own mount options, \
             if it has any)"
        )));
    }
    if needs_multi_writer_cap(mode) && !caps.single_node_multi_writer {
        return Err(multi_writer_refused(driver, mode, "node"));
    }
    Ok(())
}

/// Refuses to attach a volume on a node outside its accessible topology, before any call
/// that changes anything: the driver would fail deep in NodeStage, or worse, succeed.
pub fn node_in_topology(
    csi_volume_id: &str,
    volume: &[Segments],
    node: &Segments,
) -> Result<(), BridgeError> {
    if accessible_from(volume, node) {
        return Ok(());
    }
    let here = if node.is_empty() {
        "no topology at all".to_string()
    } else {
        describe_segments(node)
    };
    Err(BridgeError::Precondition(format!(
        "CSI volume {csi_volume_id:?} is accessible only from {} (CreateVolume's \
         accessible_topology), but this node's NodeGetInfo reports {here}; attach it on a \
         node in one of those topologies",
        describe_topologies(volume)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segments(pairs: &[(&str, &str)]) -> Segments {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_node_matches_a_topology_whose_every_segment_it_has() {
        let node = segments(&[("zone", "a"), ("rack", "1")]);
        assert!(accessible_from(&[], &node), "no topology: anywhere");
        assert!(accessible_from(&[segments(&[("zone", "a")])], &node));
        assert!(accessible_from(
            &[
                segments(&[("zone", "b")]),
                segments(&[("zone", "a"), ("rack", "1")])
            ],
            &node
        ));
        assert!(!accessible_from(&[segments(&[("zone", "b")])], &node));
        assert!(!accessible_from(
            &[segments(&[("zone", "a"), ("rack", "2")])],
            &node
        ));
        assert!(!accessible_from(
            &[segments(&[("zone", "a"), ("row", "1")])],
            &node
        ));
        assert!(!accessible_from(
            &[segments(&[("zone", "a")])],
            &Segments::new()
        ));
    }

    #[test]
    fn a_refusal_names_the_volume_topology_and_the_nodes() {
        let volume = [segments(&[("zone", "a")]), segments(&[("zone", "b")])];
        let err = node_in_topology("h1", &volume, &segments(&[("zone", "c")])).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("{zone=a} or {zone=b}"), "{text}");
        assert!(
            text.contains("{zone=c}") && text.contains("\"h1\""),
            "{text}"
        );
        let err = node_in_topology("h1", &volume, &Segments::new()).unwrap_err();
        assert!(err.to_string().contains("no topology at all"), "{err}");
        assert!(matches!(err, BridgeError::Precondition(_)));
    }

    #[test]
    fn single_node_writer_modes_need_the_capability_on_both_sides() {
        let identity = DriverIdentity {
            name: "d.csi".into(),
            ..Default::default()
        };
        let without = ControllerCaps::default();
        let with = ControllerCaps {
            single_node_multi_writer: true,
            ..Default::default()
        };
        for mode in [
            AccessMode::SingleNodeSingleWriter,
            AccessMode::SingleNodeMultiWriter,
        ] {
            let err = controller_fits(&identity, Some(&without), mode, None).unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains(mode_name(mode))
                    && text.contains("SINGLE_NODE_MULTI_WRITER controller capability")
                    && text.contains("d.csi"),
                "{text}"
            );
            controller_fits(&identity, Some(&with), mode, None).unwrap();
            let err = node_fits("d.csi", &NodeCaps::default(), mode, None).unwrap_err();
            assert!(err.to_string().contains("node capability"), "{err}");
            let caps = NodeCaps {
                single_node_multi_writer: true,
                ..Default::default()
            };
            node_fits("d.csi", &caps, mode, None).unwrap();
        }
        for mode in [
            AccessMode::SingleNodeWriter,
            AccessMode::SingleNodeReaderOnly,
            AccessMode::MultiNodeReaderOnly,
            AccessMode::MultiNodeSingleWriter,
            AccessMode::MultiNodeMultiWriter,
        ] {
            controller_fits(&identity, Some(&without), mode, None).unwrap();
            node_fits("d.csi", &NodeCaps::default(), mode, None).unwrap();
        }
    }

    #[test]
    fn topology_and_mount_group_need_their_capabilities() {
        let mut identity = DriverIdentity {
            name: "d.csi".into(),
            ..Default::default()
        };
        let requirement = TopologyRequirement {
            requisite: vec![segments(&[("zone", "a")])],
            preferred: vec![],
        };
        let mode = AccessMode::MultiNodeMultiWriter;
        let err = controller_fits(&identity, None, mode, Some(&requirement)).unwrap_err();
        assert!(
            err.to_string()
                .contains("VOLUME_ACCESSIBILITY_CONSTRAINTS plugin capability"),
            "{err}"
        );
        identity.accessibility_constraints = true;
        controller_fits(&identity, None, mode, Some(&requirement)).unwrap();

        let err = node_fits("d.csi", &NodeCaps::default(), mode, Some(1000)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("VOLUME_MOUNT_GROUP node capability")
                && text.contains("d.csi")
                && text.contains("1000"),
            "{text}"
        );
        let caps = NodeCaps {
            volume_mount_group: true,
            ..Default::default()
        };
        node_fits("d.csi", &caps, mode, Some(1000)).unwrap();
    }
}
