//! South side: the bridge as a CSI client — connections, retry policy, typed calls and
//! capability discovery. Nothing here knows about Cube.

pub mod client;
pub mod discovery;
pub mod error;
pub mod retry;

pub use client::CsiClient;
pub use discovery::{ControllerCaps, DriverIdentity, NodeCaps};
pub use error::CsiError;
pub use retry::Deadline;
