//! Parsing `/proc/<pid>/mountinfo` (proc(5)) and asking whether a path is a mount point.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// The mount points of one mount namespace, as one process sees them.
#[derive(Debug, Default, Clone)]
pub struct MountTable {
    mount_points: HashSet<PathBuf>,
}

impl MountTable {
    /// Reads the table of the namespace `pid` lives in (`None` = this process).
    pub fn read(pid: Option<u32>) -> std::io::Result<Self> {
        let path = match pid {
            Some(pid) => PathBuf::from(format!("/proc/{pid}/mountinfo")),
            None => PathBuf::from("/proc/self/mountinfo"),
        };
        Ok(Self::parse(&std::fs::read_to_string(path)?))
    }

    /// Parses mountinfo text. Lines that do not have the expected shape are skipped.
    pub fn parse(text: &str) -> Self {
        let mount_points = text
            .lines()
            .filter_map(|line| line.split(' ').nth(4))
            .map(|field| PathBuf::from(unescape(field)))
            .collect();
        Self { mount_points }
    }

    /// Whether `path` is the mount point of at least one mount.
    pub fn is_mount_point(&self, path: &Path) -> bool {
        self.mount_points.contains(path)
    }

    /// Mount points at or below `dir`.
    pub fn under<'a>(&'a self, dir: &'a Path) -> impl Iterator<Item = &'a Path> + 'a {
        self.mount_points
            .iter()
            .map(PathBuf::as_path)
            .filter(move |p| p.starts_with(dir))
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo` octal.
pub(crate) fn unescape(field: &str) -> String {
    if !field.contains('\\') {
        return field.to_string();
    }
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value =
                (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
35 22 0:31 / /data/cube-shared/volume/nfs-v1 rw shared:20 - nfs 10.0.0.5:/exports rw
36 22 0:32 / /data/with\\040space rw - tmpfs tmpfs rw
";

    #[test]
    fn finds_mount_points_and_unescapes() {
        let t = MountTable::parse(SAMPLE);
        assert!(t.is_mount_point(Path::new("/")));
        assert!(t.is_mount_point(Path::new("/data/cube-shared/volume/nfs-v1")));
        assert!(t.is_mount_point(Path::new("/data/with space")));
        assert!(!t.is_mount_point(Path::new("/data/cube-shared/volume")));
        assert_eq!(t.under(Path::new("/data")).count(), 2);
    }

    #[test]
    fn reads_this_process_table() {
        let t = MountTable::read(None).unwrap();
        assert!(t.is_mount_point(Path::new("/")));
    }
}
