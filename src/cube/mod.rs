//! North side: Cube's volume-plugin protocol — the gRPC services and their listeners,
//! the forked binary hook, request validation, and the one mapping of errors to what
//! Cube sees.

pub mod authority;
pub mod binary;
pub mod errors;
pub mod health;
pub mod hooks;
pub mod listener;
pub mod server;
pub mod service;
pub mod validate;
pub mod worker;
