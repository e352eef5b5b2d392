//! Mount-table queries, the mount-namespace view Cubelet has, mount syscalls for the
//! built-in demo driver and test fakes, and directory hygiene.

pub mod host_paths;
pub mod mountinfo;
pub mod ops;
pub mod view;

pub use host_paths::{BaseDirPolicy, HostDirs};
pub use mountinfo::{MountTable, resolve_parent};
pub use view::MountView;
