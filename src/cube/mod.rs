//! North side, the protocol: Cube's volume-plugin hooks as the bridge takes them — the one
//! hook table (hooks.rs), request validation, and the one mapping of errors to what Cube
//! sees. How the hooks arrive (gRPC, a forked process) is `transport/`.

pub mod errors;
pub mod hooks;
pub mod validate;
