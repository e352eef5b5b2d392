//! The embedded store's record key (bridge/integrity.rs says what it signs): a 0600 file
//! beside the store, as hex, made on first use.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use async_trait::async_trait;

use crate::bridge::BridgeError;
use crate::bridge::integrity::{LoadedKey, RecordKey, RecordKeySource, decode_hex};

/// The key of the embedded store: a 0600 file beside it, as hex.
#[derive(Debug, Clone)]
pub struct FileKeySource {
    path: PathBuf,
}

impl FileKeySource {
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
        }
    }

    /// The key if one has been made, without making one (tools that sign records the
    /// bridge reads, such as the benchmark's store filler, use this).
    pub fn read_existing(&self) -> Result<Option<RecordKey>, BridgeError> {
        let io = |e| BridgeError::io(format!("record key {}", self.path.display()), e);
        let meta = match std::fs::symlink_metadata(&self.path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e)),
        };
        let mode = meta.permissions().mode();
        if !meta.is_file() || mode & 0o077 != 0 {
            return Err(BridgeError::Precondition(format!(
                "record key {} must be a regular file of mode 0600 (it is {}, mode {:o}): \
                 whoever can read it can forge controller records; chmod 600 it",
                self.path.display(),
                if meta.is_file() {
                    "a file"
                } else {
                    "not a file"
                },
                mode & 0o777
            )));
        }
        let text = std::fs::read_to_string(&self.path).map_err(io)?;
        let key = decode_hex(text.trim())
            .ok_or_else(|| "not hex".to_string())
            .and_then(|bytes| RecordKey::from_bytes(&bytes))
            .map_err(|e| {
                BridgeError::Precondition(format!(
                    "record key {} is damaged ({e}); restore it from a backup (records \
                     signed with the lost key no longer verify)",
                    self.path.display()
                ))
            })?;
        Ok(Some(key))
    }

    /// Writes a new key under a temporary name, then links it into place: the link fails
    /// if another process made the key first, and then its key is read instead.
    fn make(&self) -> Result<LoadedKey, BridgeError> {
        let io = |e| BridgeError::io(format!("record key {}", self.path.display()), e);
        if let Some(dir) = self.path.parent() {
            crate::mount::ops::ensure_dir(dir, 0o700).map_err(io)?;
        }
        let key = RecordKey::generate().map_err(io)?;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        // A unique 0600 file, linked into place only if no key is there yet.
        let written = (|| {
            let mut file = tempfile::Builder::new()
                .prefix(".record.key.")
                .permissions(std::fs::Permissions::from_mode(0o600))
                .tempfile_in(dir)?;
            let hex: String = key.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
            file.write_all(format!("{hex}\n").as_bytes())?;
            file.as_file().sync_all()?;
            file.persist_noclobber(&self.path).map_err(|e| e.error)?;
            // The link must outlive a power loss too: records signed with a lost key are
            // refused for good.
            std::fs::File::open(dir)?.sync_all()?;
            Ok::<_, std::io::Error>(())
        })();
        match written {
            Ok(()) => Ok(LoadedKey { key, created: true }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let key = self.read_existing()?.ok_or_else(|| {
                    BridgeError::Precondition(format!(
                        "record key {} vanished while being made",
                        self.path.display()
                    ))
                })?;
                Ok(LoadedKey {
                    key,
                    created: false,
                })
            }
            Err(e) => Err(io(e)),
        }
    }
}

#[async_trait]
impl RecordKeySource for FileKeySource {
    async fn read(&self) -> Result<Option<RecordKey>, BridgeError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.read_existing())
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    async fn create(&self) -> Result<LoadedKey, BridgeError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.make())
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    /// The state dir is root's (the bridge's uid's): only it could remove an earlier key.
    fn making_proves_first_key(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_key_file_is_made_once_0600_and_refused_when_others_can_read_it() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("state/record.key");
        let source = FileKeySource::new(&path);
        assert_eq!(source.read().await.unwrap(), None);
        let first = source.create().await.unwrap();
        assert!(first.created);
        let again = source.read().await.unwrap();
        assert_eq!(Some(first.key), again);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // Concurrent first loads agree on one key.
        let path2 = tmp.path().join("race/record.key");
        let loads: Vec<_> = (0..8)
            .map(|_| {
                let s = FileKeySource::new(&path2);
                tokio::spawn(async move { s.create().await.unwrap() })
            })
            .collect();
        let mut keys = Vec::new();
        let mut made = 0;
        for load in loads {
            let loaded = load.await.unwrap();
            made += usize::from(loaded.created);
            keys.push(loaded.key);
        }
        assert_eq!(made, 1);
        assert!(keys.windows(2).all(|w| w[0] == w[1]));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = source.read().await.unwrap_err().to_string();
        assert!(err.contains("0600") && err.contains("644"), "{err}");
    }
}
