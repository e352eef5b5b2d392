//! Detach's metadata: the binary hook's `--metadata` JSON decoder, the metadata reader and
//! the whole Detach check. Whatever they accept round-trips and names only this volume's
//! own paths; never a panic.
#![no_main]

mod common;

use cube_csi_bridge::bridge::handoff::AttachMetadata;
use cube_csi_bridge::cube::hooks::{self, HookRequest};
use cube_csi_bridge::cube::validate::metadata_json;
use cube_csi_bridge::proto::cube::v1 as pb;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(map) = metadata_json(text) else {
        return;
    };
    if let Ok(Some(meta)) = AttachMetadata::from_map(&map, "fuzz", "vol-1") {
        // This volume's leaf, as the bridge makes it now or made it before `+`.
        let leaf = meta.paths.target.file_name().unwrap();
        assert!(leaf == "fuzz+vol-1" || leaf == "fuzz-vol-1", "{leaf:?}");
        assert_eq!(
            meta.paths.staging.file_name(),
            Some(leaf),
            "staging and target in one form"
        );
        assert!(
            meta.paths
                .staging
                .starts_with(meta.paths.target.parent().unwrap())
        );
        let again = AttachMetadata::from_map(&meta.to_map("vol-1"), "fuzz", "vol-1");
        assert_eq!(again.unwrap(), Some(meta));
    }
    let _ = hooks::check(
        HookRequest::Detach(pb::DetachRequest {
            sandbox_id: "sb".into(),
            namespace: "default".into(),
            volume_id: "vol-1".into(),
            metadata: map,
            ref_count: 0,
        }),
        common::config(),
    );
});
