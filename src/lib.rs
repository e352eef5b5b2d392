//! cube-csi-bridge: serve any Kubernetes CSI driver as a CubeSandbox volume plugin.
//!
//! North side (`cube`): Cube's volume-plugin protocol, as a gRPC daemon and as a forked
//! binary hook. South side (`csi`): a CSI container orchestrator. Between them, the
//! translation core (`bridge`), over `mount` queries and persistent `store`s.

pub mod admin;
pub mod app;
pub mod blocking;
pub mod bridge;
pub mod cli;
pub mod config;
pub mod copies;
pub mod csi;
pub mod cube;
pub mod demo;
pub mod k8s;
pub mod metrics;
pub mod mount;
pub mod probe;
pub mod proto;
pub mod store;
pub mod system;
pub mod telemetry;
#[cfg(test)]
pub(crate) mod testing;
pub mod transport;
