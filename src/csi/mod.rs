//! South side: the bridge as a CSI client — connections, retry policy, typed calls, and
//! the core's driver ports implemented over gRPC. Nothing here knows about Cube.

pub mod client;
mod direct;
pub mod driver;
pub mod endpoint;
#[cfg(test)]
pub(crate) mod fake_identity;
pub mod redact;
pub mod retry;

pub use client::CsiClient;
pub use driver::GrpcDriver;
pub use endpoint::Endpoint;
