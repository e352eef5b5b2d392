//! Attach's private_data decoder: any text decodes to a handle that round-trips, or is
//! refused with a message; never a panic.
#![no_main]

use cube_csi_bridge::bridge::handoff::{MAX_PRIVATE_DATA_LEN, VolumeHandle};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match VolumeHandle::decode(text) {
        Ok(handle) => {
            assert!(!handle.csi_volume_id.is_empty());
            assert!(text.len() <= MAX_PRIVATE_DATA_LEN);
            if let Ok(again) = handle.encode_for("fuzz") {
                assert_eq!(VolumeHandle::decode_for(&again, "fuzz").unwrap(), handle);
                assert!(VolumeHandle::decode_for(&again, "other").is_err());
            }
        }
        Err(message) => assert!(!message.is_empty()),
    }
    let _ = VolumeHandle::decode_for(text, "fuzz");
});
