//! The forked hook's front executable: answers a node hook's hot path, execs the full
//! cube-csi-bridge beside it otherwise (see transport::front).
//!
//! `no_main`: std's start-up work for a Rust `main` (the main thread's stack guard, which
//! reads /proc/self/maps, and its signal stack) is a measurable part of a process that
//! lives about a millisecond. What of it matters here is done by `front::start`. (Not under
//! `cfg(test)`: there the C `main` would replace the test harness's.)
#![cfg_attr(not(test), no_main)]

#[cfg(not(test))]
#[unsafe(no_mangle)]
extern "C" fn main(
    _argc: std::ffi::c_int,
    _argv: *const *const std::ffi::c_char,
) -> std::ffi::c_int {
    cube_csi_bridge::transport::front::start();
    cube_csi_bridge::transport::front::main(std::env::args_os().collect()).into()
}
