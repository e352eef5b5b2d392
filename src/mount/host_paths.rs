//! The directories the node side makes and removes around the driver's calls, on the
//! host: the core's `HostPaths` port over the plain directory calls of `ops`.

use std::path::Path;

use super::ops;
use crate::bridge::ports::HostPaths;

/// Directories as the host sees them, made with the modes the CSI layout wants.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostDirs;

impl HostPaths for HostDirs {
    fn ensure_base_dir(&self, dir: &Path) -> std::io::Result<()> {
        ops::ensure_dir(dir, 0o755)
    }

    fn ensure_staging_dir(&self, dir: &Path) -> std::io::Result<()> {
        ops::ensure_dir(dir, 0o750)
    }

    fn remove_dir_if_empty(&self, dir: &Path) -> std::io::Result<bool> {
        ops::remove_dir_if_empty(dir)
    }
}
