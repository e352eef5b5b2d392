//! The host facts the core asks for through its `Clock` port: the wall clock and the boot.

use crate::bridge::ports::Clock;

/// The real clock and `/proc/sys/kernel/random/boot_id`.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_secs(&self) -> u64 {
        now_secs()
    }

    /// Tried a few times, 20 ms apart: what makes the read fail (ENFILE, ENOMEM) passes,
    /// and a daemon serving both roles that failed here would serve no Attach until it is
    /// restarted.
    fn boot_id(&self) -> std::io::Result<String> {
        let path = std::path::Path::new(BOOT_ID);
        let mut tries = 1;
        loop {
            match read_boot_id(path) {
                Err(_) if tries < BOOT_ID_TRIES => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    tries += 1;
                }
                read => return read,
            }
        }
    }
}

/// Reads of the boot id before the node side gives up.
const BOOT_ID_TRIES: u32 = 5;

/// Where the kernel tells this boot's id.
pub const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// The boot id the file at `path` holds. An unreadable or empty one is an error, never
/// an empty id: the node side tells this boot's attachments from an earlier boot's by it
/// (an id that matches no record's would make every live attachment look like a dead
/// boot's, to be torn down under its sandbox).
pub fn read_boot_id(path: &std::path::Path) -> std::io::Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("reading this boot's id from {}: {e}", path.display()),
        )
    })?;
    match text.trim() {
        "" => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is empty: the kernel gave no boot id", path.display()),
        )),
        id => Ok(id.to_string()),
    }
}

/// Seconds since the Unix epoch.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unreadable or empty boot id is an error, never an empty id (which every
    /// record's id differs from). Before, both read as "".
    #[test]
    fn a_boot_id_the_kernel_does_not_give_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("boot_id");
        let error = read_boot_id(&missing).unwrap_err();
        assert!(error.to_string().contains("boot_id"), "{error}");
        std::fs::write(&missing, "\n").unwrap();
        assert!(read_boot_id(&missing).is_err());
        std::fs::write(&missing, "1f0c-ab\n").unwrap();
        assert_eq!(read_boot_id(&missing).unwrap(), "1f0c-ab");
    }
}
