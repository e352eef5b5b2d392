//! The binary hook's argv (NUL-separated arguments, as Cube could fork it) through the
//! parser and the request check: a request or a message, never a panic.
#![no_main]

mod common;

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use cube_csi_bridge::cli::parse_hook_argv;
use cube_csi_bridge::cube::hooks;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let args: Vec<OsString> = data
        .split(|b| *b == 0)
        .map(|a| OsString::from_vec(a.to_vec()))
        .collect();
    match parse_hook_argv(&args) {
        Ok(request) => {
            if let Err(e) = hooks::check(request, common::config()) {
                assert!(!e.to_string().is_empty());
            }
        }
        Err(message) => assert!(!message.is_empty()),
    }
});
