//! The node's intent log: one append-only file whose single `fdatasync` makes the journal
//! records of every Attach and Detach waiting at that moment durable together.
//!
//! Every save of a node record (and every removal) appends the record's exact bytes (or a
//! removal mark) to `<journal>/intents/log` besides writing the record's own file, which
//! is never synced. A save that must survive a power loss (before a mutating CSI call)
//! then waits for a group commit: one `fdatasync` of the log covers every entry appended
//! before it started, whoever appended it. Within a boot the record files are the truth
//! (a killed process loses nothing the page cache holds); the log only speaks after a
//! reboot. Its first line names the boot that writes it: the first process of a new boot
//! to open the journal puts each volume's last complete entry back into its record file
//! (what a power loss may have lost or left torn) before anything reads them, and starts
//! the log afresh for its boot with a checkpoint. A checkpoint keeps the log
//! short without syncing any record file: the last entry of every live volume goes to a
//! snapshot file (`intents/snapshot`, made durable like any replaced file), then the log
//! is emptied; a reboot reads the snapshot and the log over it. The header counts the
//! checkpoints of its boot, and the snapshot names the count of the log it goes with.
//!
//! A record file is rewritten in place (`Overwrite::InPlace`), not replaced by a rename,
//! only when the log on disk already holds a complete entry of that volume: one that an
//! `fdatasync` of this process covered since the last checkpoint, or the one this
//! process's own checkpoint put in the snapshot that goes with the log. A power loss
//! that tears the file in the middle of that rewrite then finds the entry, and the next
//! boot puts it back, as it would for a replaced file that lost its new content.
//!
//! Why that is as durable as the old `fdatasync` + rename + directory fsync of each record:
//! docs/reliability.md, "The node intent log".

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::fcntl::{Flock, FlockArg};

use super::fsutil::{DirSync, GroupCommit, open_private, write_atomic};

/// The log is checkpointed once it passes this size (about 1,500 saves of a typical
/// record): a reboot then replays at most this much.
pub const CHECKPOINT_BYTES: u64 = 1 << 20;

/// The first line's fixed part; the boot id follows.
const HEADER: &str = "cube-csi-bridge node intents 1\tboot\t";

/// The first line of the snapshot a checkpoint writes; the boot id and the checkpoint
/// count of the log it goes with follow, tab-separated.
const SNAPSHOT_HEADER: &str = "cube-csi-bridge node intents snapshot 1\tboot\t";

/// What follows the boot id in the header of a log that was checkpointed.
const CHECKPOINT_TAG: &str = "checkpoint\t";

/// The payload of an entry that says the volume's record was removed.
const REMOVED: &str = "-";

/// An error of the log or of the record file it was writing, with its path.
pub type IntentError = (PathBuf, io::Error);

/// How a save may write its record file (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overwrite {
    /// The log on disk has a complete entry of this volume: the file may be rewritten
    /// where it is.
    InPlace,
    /// Write a new file and rename it over the old one.
    Replace,
}

/// Each volume's last complete entry: its record's bytes, or None when it was removed.
type LastEntries = BTreeMap<String, Option<Vec<u8>>>;

/// The intent log of one journal directory, shared by the threads of one process.
#[derive(Debug)]
pub struct IntentLog {
    /// `<journal>/intents`: the log and the lock file that orders checkpoints.
    dir: PathBuf,
    /// The journal directory, where the record files are.
    records: PathBuf,
    boot_id: String,
    /// The log, opened for appending.
    file: Mutex<Option<Arc<File>>>,
    commit: GroupCommit,
    checkpoint_bytes: u64,
    /// Volumes whose entry an fdatasync of this process covered, with the checkpoint
    /// count of the log it was in (a checkpoint of any process makes them stale).
    synced: Mutex<std::collections::HashMap<String, u64>>,
    /// The last checkpoint that failed (a full disk has no room for the snapshot): the
    /// log's size then, and when. The next is tried only once the log has grown by a
    /// quarter of `checkpoint_bytes` or `CHECKPOINT_RETRY_AFTER` has passed: each try
    /// reads and hashes the whole log under the exclusive lock every other save waits for.
    failed_checkpoint: Mutex<Option<(u64, std::time::Instant)>>,
    /// Checkpoints tried so far, for tests.
    checkpoints_tried: std::sync::atomic::AtomicU64,
}

/// How long after a failed checkpoint the next save tries again, whatever the log's size.
const CHECKPOINT_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

impl IntentLog {
    /// Opens the log of the journal at `records` for a process of boot `boot_id`; if the
    /// log was written in another boot, first puts its last entries back into the record
    /// files (see the module doc).
    pub fn open(records: &Path, boot_id: &str) -> Result<Self, IntentError> {
        Self::with_checkpoint(records, boot_id, CHECKPOINT_BYTES)
    }

    pub fn with_checkpoint(
        records: &Path,
        boot_id: &str,
        checkpoint_bytes: u64,
    ) -> Result<Self, IntentError> {
        let log = Self {
            dir: records.join("intents"),
            records: records.to_path_buf(),
            boot_id: boot_id.to_string(),
            file: Mutex::new(None),
            commit: GroupCommit::default(),
            checkpoint_bytes,
            synced: Mutex::new(std::collections::HashMap::new()),
            failed_checkpoint: Mutex::new(None),
            checkpoints_tried: Default::default(),
        };
        let path = log.log_path();
        // Never through a link: whoever planted one (in a state dir that failed its
        // check, or before it was made) would have root's recovery truncate its target.
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Made now, while the disk has room for its first page: the first save of
                // a nearly full disk then needs no more than the record did before.
                log.file()?;
                return Ok(log);
            }
            Err(e) => return Err((path, e)),
        };
        if !log.header_is_ours(&file)? {
            let _exclusive = log.lock(FlockArg::LockExclusive)?;
            if !log.header_is_ours(&file)? {
                log.recover(&file)?;
            }
        }
        *log.file.lock().expect("intent log poisoned") = Some(Arc::new(file));
        Ok(log)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("log")
    }

    fn record_path(&self, volume_id: &str) -> PathBuf {
        super::journal::record_path(&self.records, volume_id)
    }

    /// The first line of this boot's log after `checkpoints` checkpoints (the first has
    /// no count: it is what builds before the count wrote).
    fn header(&self, checkpoints: u64) -> String {
        match checkpoints {
            0 => format!("{HEADER}{}\n", self.boot_id),
            n => format!("{HEADER}{}\t{CHECKPOINT_TAG}{n}\n", self.boot_id),
        }
    }

    /// (boot id, checkpoints) of the log's first line; None when it is no header (a log
    /// being made, or damaged).
    fn read_header(file: &File) -> Result<Option<(String, u64)>, io::Error> {
        let mut first = [0u8; 256];
        let mut read = 0;
        while read < first.len() {
            match file.read_at(&mut first[read..], read as u64)? {
                0 => break,
                n => read += n,
            }
        }
        let Some(end) = first[..read].iter().position(|b| *b == b'\n') else {
            return Ok(None);
        };
        let Some(rest) = std::str::from_utf8(&first[..end])
            .ok()
            .and_then(|line| line.strip_prefix(HEADER))
        else {
            return Ok(None);
        };
        Ok(match rest.split_once('\t') {
            None => Some((rest.to_string(), 0)),
            Some((boot, count)) => count
                .strip_prefix(CHECKPOINT_TAG)
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
                .map(|n| (boot.to_string(), n)),
        })
    }

    /// Appends `volume_id`'s new record (None: its removal) and, under the same shared
    /// lock (no checkpoint between them), lets `apply` write the record file itself, told
    /// whether it may rewrite the file in place; with `durable`, returns once an
    /// `fdatasync` of the log covers the entry.
    pub fn append(
        &self,
        volume_id: &str,
        record: Option<&[u8]>,
        durable: bool,
        apply: impl FnOnce(Overwrite) -> Result<(), IntentError>,
    ) -> Result<(), IntentError> {
        let file = self.file()?;
        let log = self.log_path();
        let mark;
        let checkpoints = {
            let _shared = self.lock(FlockArg::LockShared)?;
            // Read under the lock: no checkpoint moves it until the record is written.
            let checkpoints = Self::read_header(&file)
                .map_err(|e| (log.clone(), e))?
                .filter(|(boot, _)| *boot == self.boot_id)
                .map(|(_, n)| n);
            // One write (O_APPEND: at the end, whoever else appends). It starts with a
            // newline, so that a torn entry before it (a full disk) ends there and this one
            // is read on its own line. A flush that fails from here on may have dropped it.
            mark = self.commit.mark();
            if let Err(error) = (&*file).write_all(entry(volume_id, record).as_bytes()) {
                if durable {
                    // Nothing written yet but what the log tore: the save changed nothing.
                    return Err((log, error));
                }
                // A save without fsync is not owed to a power loss: the record file alone
                // does what it always did, and a reboot replays the entry before it.
                tracing::warn!(log = %log.display(), %error, volume_id, "could not append to the node intent log");
            }
            let synced = self
                .synced
                .lock()
                .expect("intent log poisoned")
                .get(volume_id)
                .copied();
            let overwrite = match checkpoints {
                Some(n) if synced == Some(n) => Overwrite::InPlace,
                _ => Overwrite::Replace,
            };
            apply(overwrite)?;
            checkpoints
        };
        if durable {
            self.commit
                .sync_since(mark, || self.flush(&file))
                .map_err(|e| (log.clone(), e))?;
        }
        {
            let mut synced = self.synced.lock().expect("intent log poisoned");
            match (record, checkpoints) {
                // Stale at once if a checkpoint came between the append and the sync: the
                // count read above is then behind the log's.
                (Some(_), Some(n)) if durable => {
                    // Never back: this process's own checkpoint may have counted the
                    // entry at a later count meanwhile.
                    let at = synced.entry(volume_id.to_string()).or_insert(n);
                    *at = (*at).max(n);
                }
                (None, _) => {
                    synced.remove(volume_id);
                }
                _ => {}
            }
        }
        if let Err((path, error)) = self.checkpoint_if_long(&file) {
            tracing::warn!(path = %path.display(), %error, "could not checkpoint the node intent log; it is tried again on a later save");
        }
        Ok(())
    }

    /// Whether the log on disk (after an `fdatasync` of it, here) or the snapshot that
    /// goes with it holds a complete entry of `volume_id`: then its record file may be
    /// rewritten in place whatever this process has synced, since a power loss that tore
    /// the rewrite finds that entry. For a save that cannot replace its file (a full
    /// disk: no inode or block for a new one). Call under `append`'s shared lock (from
    /// its `apply`): no checkpoint runs meanwhile.
    pub fn holds_durable_entry(&self, volume_id: &str) -> Result<bool, IntentError> {
        let file = self.file()?;
        // Through the group commit, as every flush of the log: the kernel reports a failed
        // writeback to one flush only, and a durable save waiting on another thread whose
        // entry it dropped must learn of it.
        self.commit
            .sync(|| self.flush(&file))
            .map_err(|e| (self.log_path(), e))?;
        if !self.header_is_ours(&file)? {
            return Ok(false);
        }
        Ok(matches!(
            self.last_entries_on_disk(&file)?.get(volume_id),
            Some(Some(_))
        ))
    }

    /// One `fdatasync` of the log (tests may make it fail, as a lost writeback does).
    fn flush(&self, file: &File) -> io::Result<()> {
        #[cfg(test)]
        if tests::flush_fails(&self.log_path()) {
            return Err(io::Error::other(
                "injected: writeback of the intent log failed",
            ));
        }
        file.sync_data()
    }

    /// (durable saves so far, fdatasyncs of the log they needed), for tests.
    pub fn commit_counts(&self) -> (u64, u64) {
        self.commit.counts()
    }

    /// The open log, made (with its header on disk) on first use.
    fn file(&self) -> Result<Arc<File>, IntentError> {
        let mut slot = self.file.lock().expect("intent log poisoned");
        if let Some(file) = &*slot {
            return Ok(file.clone());
        }
        crate::mount::ops::ensure_dir(&self.dir, 0o700).map_err(|e| (self.dir.clone(), e))?;
        let path = self.log_path();
        let _exclusive = self.lock(FlockArg::LockExclusive)?;
        let new = match std::fs::symlink_metadata(&path) {
            Ok(_) => false,
            Err(e) if e.kind() == io::ErrorKind::NotFound => true,
            Err(e) => return Err((path, e)),
        };
        if new {
            // A new log starts at count 0: a snapshot left from before (the log removed
            // by hand) must not pass for one of its checkpoints. Removed before the log
            // is made: a log with no header beside a snapshot is a checkpoint cut short,
            // whose snapshot counts (`last_entries_on_disk`).
            match std::fs::remove_file(self.snapshot_path()) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err((self.snapshot_path(), e));
                }
                _ => {}
            }
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| (path.clone(), e))?;
        let size = file.metadata().map_err(|e| (path.clone(), e))?.len();
        if new && size == 0 {
            // The log, its name and its directory's name (and the snapshot's removal) are
            // on disk before any entry relies on them.
            (&file)
                .write_all(self.header(0).as_bytes())
                .and_then(|()| file.sync_data())
                .map_err(|e| (path.clone(), e))?;
            for dir in [&self.dir, &self.records] {
                sync_dir(dir)?;
            }
        } else if !self.header_is_ours(&file)? {
            self.recover(&file)?;
        }
        let file = Arc::new(file);
        *slot = Some(file.clone());
        Ok(file)
    }

    /// Whether the log's first line names this boot.
    fn header_is_ours(&self, file: &File) -> Result<bool, IntentError> {
        Ok(Self::read_header(file)
            .map_err(|e| (self.log_path(), e))?
            .is_some_and(|(boot, _)| boot == self.boot_id))
    }

    /// A takes of the lock that orders appends (shared) before checkpoints and recoveries
    /// (exclusive). Each take opens the lock file anew: flock belongs to an open file, and
    /// threads of one process must not share (and release) each other's.
    fn lock(&self, arg: FlockArg) -> Result<Flock<File>, IntentError> {
        self.try_lock(arg)?.ok_or_else(|| {
            (
                self.dir.join("lock"),
                io::Error::from(io::ErrorKind::WouldBlock),
            )
        })
    }

    fn try_lock(&self, arg: FlockArg) -> Result<Option<Flock<File>>, IntentError> {
        let path = self.dir.join("lock");
        let file = open_private(&path).map_err(|e| (path.clone(), e))?;
        match Flock::lock(file, arg) {
            Ok(lock) => Ok(Some(lock)),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, errno)) => Err((path, io::Error::from(errno))),
        }
    }

    /// After a reboot (the caller holds the exclusive lock): each volume's last entry (the
    /// snapshot's and the log's) back into its record file where the file says otherwise,
    /// then a checkpoint that starts the log afresh for this boot.
    fn recover(&self, file: &File) -> Result<(), IntentError> {
        let path = self.log_path();
        let last = self.last_entries_on_disk(file)?;
        if !self.written_in_another_boot(file)? {
            // A checkpoint of this boot stopped before it wrote the log's header: the
            // record files are the truth within a boot (a killed process loses nothing
            // the page cache holds), so only the checkpoint is finished.
            return self.checkpoint(file, last);
        }
        let mut restored = 0;
        for (volume_id, record) in &last {
            let record_path = self.record_path(volume_id);
            let on_disk = std::fs::read(&record_path).ok();
            // A file rewritten in place ends in the spaces that padded it to its old size.
            let content = on_disk.as_deref().map(|b| b.trim_ascii_end());
            match record {
                Some(bytes) if content != Some(bytes.as_slice()) => {
                    write_atomic(&record_path, bytes, None).map_err(|e| (record_path, e))?;
                    restored += 1;
                }
                None if on_disk.is_some() => {
                    super::journal::remove_files(&self.records, volume_id)?;
                    restored += 1;
                }
                _ => {}
            }
        }
        if restored > 0 {
            tracing::warn!(
                log = %path.display(),
                restored,
                "the node journal lost writes in a power loss; its records were restored from the intent log"
            );
        }
        // The restored files are not synced one by one: the checkpoint's snapshot holds
        // every live record, durably, before the log is emptied.
        self.checkpoint(file, last)
    }

    /// Whether the log (its header; with none, the snapshot beside it, which a
    /// checkpoint stopped before the header made) was written in a boot other than this
    /// one. A log with neither was being made in this boot.
    fn written_in_another_boot(&self, file: &File) -> Result<bool, IntentError> {
        let path = self.log_path();
        if let Some((boot, _)) = Self::read_header(file).map_err(|e| (path, e))? {
            return Ok(boot != self.boot_id);
        }
        let text = self.read_snapshot()?.unwrap_or_default();
        Ok(snapshot_named(&text).is_some_and(|(boot, _)| boot != self.boot_id))
    }

    /// The snapshot file's bytes; None when there is none.
    fn read_snapshot(&self) -> Result<Option<Vec<u8>>, IntentError> {
        let path = self.snapshot_path();
        match std::fs::read(&path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err((path, e)),
        }
    }

    /// Checkpoints a log past its size (or past its snapshot's, for a node with so many
    /// volumes that the snapshot is the larger): see `checkpoint`. Skipped when another
    /// save or checkpoint holds the lock (a later save tries again).
    fn checkpoint_if_long(&self, file: &File) -> Result<(), IntentError> {
        let path = self.log_path();
        let size = |file: &File| {
            file.metadata()
                .map(|m| m.len())
                .map_err(|e| (path.clone(), e))
        };
        if size(file)? <= self.checkpoint_bytes {
            return Ok(());
        }
        let limit = self.checkpoint_bytes.max(self.snapshot_size());
        let now = size(file)?;
        if now <= limit {
            return Ok(());
        }
        let failed = *self.failed_checkpoint.lock().expect("intent log poisoned");
        if let Some((at_size, at)) = failed
            && now < at_size + self.checkpoint_bytes / 4
            && at.elapsed() < CHECKPOINT_RETRY_AFTER
        {
            return Ok(());
        }
        let Some(_exclusive) = self.try_lock(FlockArg::LockExclusiveNonblock)? else {
            return Ok(());
        };
        if size(file)? <= limit {
            return Ok(());
        }
        self.checkpoints_tried
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let result = self
            .last_entries_on_disk(file)
            .and_then(|last| self.checkpoint(file, last));
        *self.failed_checkpoint.lock().expect("intent log poisoned") = match &result {
            Ok(()) => None,
            Err(_) => Some((now, std::time::Instant::now())),
        };
        result
    }

    /// The size of the snapshot file (0 when there is none).
    fn snapshot_size(&self) -> u64 {
        std::fs::metadata(self.snapshot_path()).map_or(0, |m| m.len())
    }

    fn snapshot_path(&self) -> PathBuf {
        self.dir.join("snapshot")
    }

    /// Each volume's last complete entry in the snapshot and the log together (the log's
    /// are later). The caller holds the exclusive lock. The snapshot counts only when it
    /// is the one this log was started with (same boot, same checkpoint count), or the
    /// one a checkpoint cut short wrote just before it would have emptied this log (the
    /// count one more: it holds every entry of this log already).
    fn last_entries_on_disk(&self, file: &File) -> Result<LastEntries, IntentError> {
        let path = self.log_path();
        let text = std::fs::read(&path).map_err(|e| (path.clone(), e))?;
        let header = Self::read_header(file).map_err(|e| (path.clone(), e))?;
        // No header: a checkpoint emptied the log and was stopped before it wrote one (a
        // kill, or a power loss that kept the truncate), so the snapshot it had just made
        // holds every live record. (A new log's snapshot is removed before the log is
        // made, so none is left over beside one.)
        let mut last =
            self.snapshot_entries(header.as_ref().map(|(boot, n)| (boot.as_str(), *n)))?;
        last.extend(last_entries(&text));
        Ok(last)
    }

    /// The snapshot's entries when its header names `log`'s boot and checkpoint count (or
    /// the count after it); none otherwise (no snapshot, or one of another boot or log).
    /// `log` None (a log with no header): whatever snapshot there is.
    fn snapshot_entries(&self, log: Option<(&str, u64)>) -> Result<LastEntries, IntentError> {
        let Some(text) = self.read_snapshot()? else {
            return Ok(LastEntries::new());
        };
        let named = snapshot_named(&text).and_then(|(at, n)| Some((at, n.parse::<u64>().ok()?)));
        Ok(match (named, log) {
            (Some(_), None) => last_entries(&text),
            (Some((at, n)), Some((boot, count)))
                if at == boot && (n == count || n == count + 1) =>
            {
                last_entries(&text)
            }
            _ => LastEntries::new(),
        })
    }

    /// Empties the log without syncing any record file: the last entry of every live
    /// volume (`last`: the snapshot and the log together) is written to a new snapshot
    /// (a temporary file, `fdatasync`, `rename`, the directory's `fsync`), named by the
    /// count the log is about to start at; removals are made durable (the journal
    /// directory's `fsync`) and dropped; then the log starts afresh. A power loss at any
    /// point leaves either the old snapshot with the whole log, or the new snapshot, which
    /// holds all of it. The caller holds the exclusive lock.
    fn checkpoint(&self, file: &File, last: LastEntries) -> Result<(), IntentError> {
        let path = self.log_path();
        let next = Self::read_header(file)
            .map_err(|e| (path.clone(), e))?
            .map_or(0, |(_, n)| n + 1);
        // Unlinks of removed records reach the disk before their removal marks go.
        sync_dir(&self.records)?;
        let mut snapshot = format!("{SNAPSHOT_HEADER}{}\t{next}\n", self.boot_id);
        for (volume_id, record) in &last {
            if let Some(bytes) = record {
                snapshot.push_str(&entry(volume_id, Some(bytes)));
            }
        }
        let snapshot_path = self.snapshot_path();
        write_atomic(
            &snapshot_path,
            snapshot.as_bytes(),
            Some(&DirSync::new(&self.dir)),
        )
        .map_err(|e| (snapshot_path, e))?;
        self.start_afresh(file, next)?;
        // The snapshot, durable now, holds an entry of every live volume at the log's new
        // count: their files may go on being rewritten in place. Without this, each save
        // after a checkpoint replaced its file (a new inode, and the old one freed), the
        // checkpoint of a burst of Attaches once for every volume in it.
        let mut synced = self.synced.lock().expect("intent log poisoned");
        for (volume_id, record) in &last {
            if record.is_some() {
                synced.insert(volume_id.clone(), next);
            }
        }
        Ok(())
    }

    /// Empties the log down to this boot's header with checkpoint count `checkpoints`, on
    /// disk before any new entry.
    fn start_afresh(&self, file: &File, checkpoints: u64) -> Result<(), IntentError> {
        let path = self.log_path();
        file.set_len(0)
            .and_then(|()| {
                let mut file = file;
                file.write_all(self.header(checkpoints).as_bytes())
            })
            .and_then(|()| file.sync_data())
            .map_err(|e| (path, e))
    }
}

/// (boot id, checkpoint count as written) that a snapshot's first line names; None when
/// it is no snapshot header.
fn snapshot_named(text: &[u8]) -> Option<(&str, &str)> {
    let first = text.split(|b| *b == b'\n').next().unwrap_or_default();
    std::str::from_utf8(first)
        .ok()?
        .strip_prefix(SNAPSHOT_HEADER)?
        .split_once('\t')
}

fn sync_dir(dir: &Path) -> Result<(), IntentError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| (dir.to_path_buf(), e))
}

/// One entry: `\n<check>\t<volume id>\t<record JSON, or "-">\n`. The check (16 hex digits
/// of the SHA-256 of what follows it) tells a complete entry from one a power loss tore.
fn entry(volume_id: &str, record: Option<&[u8]>) -> String {
    let payload = record.map_or(REMOVED.into(), String::from_utf8_lossy);
    let body = format!("{volume_id}\t{payload}");
    format!("\n{}\t{body}\n", check(&body))
}

fn check(body: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(body.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The last complete entry of each volume; the header, torn and damaged lines are passed
/// over.
fn last_entries(text: &[u8]) -> LastEntries {
    let mut last = LastEntries::new();
    for line in text.split(|b| *b == b'\n') {
        let Ok(line) = std::str::from_utf8(line) else {
            continue;
        };
        let Some((sum, body)) = line.split_once('\t') else {
            continue;
        };
        if sum != check(body) {
            continue;
        }
        let Some((volume_id, payload)) = body.split_once('\t') else {
            continue;
        };
        // Only names the journal itself makes become paths.
        if volume_id.is_empty()
            || volume_id.len() > 128
            || !volume_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            continue;
        }
        let record = (payload != REMOVED).then(|| payload.as_bytes().to_vec());
        last.insert(volume_id.to_string(), record);
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logs whose next flushes fail, and how many: the kernel reports a lost writeback
    /// to the first flush of the file that comes after it, whoever makes it.
    static FAILING_FLUSHES: Mutex<Vec<(PathBuf, u32)>> = Mutex::new(Vec::new());

    pub(super) fn flush_fails(log: &Path) -> bool {
        let mut failing = FAILING_FLUSHES.lock().unwrap_or_else(|p| p.into_inner());
        match failing.iter_mut().find(|(path, n)| path == log && *n > 0) {
            Some((_, n)) => {
                *n -= 1;
                true
            }
            None => false,
        }
    }

    fn fail_next_flush(log: &Path) {
        FAILING_FLUSHES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((log.to_path_buf(), 1));
    }

    /// A durable save whose entry a lost writeback dropped fails even when the flush
    /// that learnt of the loss was a full disk's check of the log (`holds_durable_entry`,
    /// made by another save meanwhile) rather than its own: that check's flush consumed
    /// the error, and a later flush succeeds without the entry.
    #[test]
    fn a_writeback_lost_to_a_full_disks_check_fails_the_save_it_dropped() {
        let tmp = tempfile::tempdir().unwrap();
        let log = IntentLog::open(tmp.path(), "b").unwrap();
        save(&log, "other", b"{}", true);
        let path = log.record_path("v");
        let result = log.append("v", Some(b"{}"), true, |_| {
            // Another thread's save on a full disk, between this entry's write and its
            // flush: its check flushes the log first, and that flush fails.
            fail_next_flush(&log.log_path());
            assert!(log.holds_durable_entry("other").is_err());
            write_atomic(&path, b"{}", None).map_err(|e| (path.clone(), e))
        });
        let error = result.expect_err("the save's entry may be lost, and it said durable");
        assert!(error.1.to_string().contains("writeback"), "{}", error.1);
        // Saves that come after the loss go on.
        save(&log, "later", b"{}", true);
    }

    fn save(log: &IntentLog, id: &str, bytes: &[u8], durable: bool) {
        let path = log.record_path(id);
        log.append(id, Some(bytes), durable, |_| {
            write_atomic(&path, bytes, None).map_err(|e| (path.clone(), e))
        })
        .unwrap();
    }

    fn remove(log: &IntentLog, id: &str) {
        log.append(id, None, false, |_| {
            super::super::journal::remove_files(&log.records, id)
        })
        .unwrap();
    }

    fn read(dir: &Path, id: &str) -> Option<String> {
        std::fs::read_to_string(dir.join(format!("{id}.json"))).ok()
    }

    /// What a power loss may leave (each record file lost, stale or torn) is put back from
    /// the log by the first open of the next boot: every volume's last entry, removals
    /// included; a torn last entry is passed over; the log then starts afresh.
    #[test]
    fn the_next_boot_restores_what_a_power_loss_took_from_the_record_files() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log = IntentLog::open(dir, "boot-1").unwrap();
        save(&log, "lost", br#"{"v":1}"#, true);
        save(&log, "stale", br#"{"v":1}"#, true);
        save(&log, "stale", br#"{"v":2}"#, false);
        save(&log, "torn", br#"{"v":1}"#, true);
        save(&log, "gone", br#"{"v":1}"#, true);
        remove(&log, "gone");
        save(&log, "kept", br#"{"v":1}"#, true);
        drop(log);
        // The power loss: one file never reached the disk, one has its old content, one
        // is torn, a removal was lost, and the log's own last entry is torn.
        std::fs::remove_file(dir.join("lost.json")).unwrap();
        std::fs::write(dir.join("stale.json"), br#"{"v":1}"#).unwrap();
        std::fs::write(dir.join("torn.json"), b"").unwrap();
        std::fs::write(dir.join("gone.json"), br#"{"v":1}"#).unwrap();
        let log_path = dir.join("intents/log");
        let mut torn = std::fs::OpenOptions::new()
            .append(true)
            .open(&log_path)
            .unwrap();
        let last = entry("kept", Some(br#"{"v":2}"#));
        torn.write_all(&last.as_bytes()[..last.len() - 4]).unwrap();

        // The same boot trusts its record files: nothing is replayed.
        IntentLog::open(dir, "boot-1").unwrap();
        assert_eq!(read(dir, "lost"), None);

        let log = IntentLog::open(dir, "boot-2").unwrap();
        assert_eq!(read(dir, "lost").as_deref(), Some(r#"{"v":1}"#));
        assert_eq!(read(dir, "stale").as_deref(), Some(r#"{"v":2}"#));
        assert_eq!(read(dir, "torn").as_deref(), Some(r#"{"v":1}"#));
        assert_eq!(read(dir, "gone"), None);
        assert_eq!(read(dir, "kept").as_deref(), Some(r#"{"v":1}"#));
        assert_eq!(
            std::fs::read_to_string(&log_path).unwrap(),
            format!("{HEADER}boot-2\t{CHECKPOINT_TAG}1\n")
        );
        // The new boot's saves go on in the fresh log.
        save(&log, "new", br#"{"v":1}"#, true);
        drop(log);
        std::fs::remove_file(dir.join("new.json")).unwrap();
        IntentLog::open(dir, "boot-3").unwrap();
        assert_eq!(read(dir, "new").as_deref(), Some(r#"{"v":1}"#));
    }

    /// The first open makes the log, with its header; saves append to it.
    #[test]
    fn the_log_is_made_by_the_first_open() {
        let tmp = tempfile::tempdir().unwrap();
        let log = IntentLog::open(tmp.path(), "b").unwrap();
        let path = tmp.path().join("intents/log");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{HEADER}b\n")
        );
        save(&log, "v", b"{}", false);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with(&format!("{HEADER}b\n")), "{text:?}");
        assert_eq!(last_entries(text.as_bytes()).len(), 1);
    }

    /// Durable saves of many threads at once share the log's fdatasyncs; every one is in
    /// the log.
    #[test]
    fn concurrent_durable_saves_share_fdatasyncs() {
        let tmp = tempfile::tempdir().unwrap();
        let log = Arc::new(IntentLog::open(tmp.path(), "b").unwrap());
        let threads: Vec<_> = (0..32)
            .map(|i| {
                let log = log.clone();
                std::thread::spawn(move || save(&log, &format!("v{i}"), b"{}", true))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let (saves, syncs) = log.commit_counts();
        assert_eq!(saves, 32);
        assert!((1..=32).contains(&syncs), "{syncs}");
        let text = std::fs::read(tmp.path().join("intents/log")).unwrap();
        assert_eq!(last_entries(&text).len(), 32);
    }

    /// A checkpoint that fails (no room for its snapshot) is not tried again by every
    /// save: before, each one read and hashed the whole log under the exclusive lock and
    /// failed again. The log grows meanwhile; once there is room, the next try empties it.
    #[test]
    fn a_failed_checkpoint_is_not_tried_again_by_every_save() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log = IntentLog::with_checkpoint(dir, "b", 4000).unwrap();
        // No room for the snapshot: its temporary file cannot be made.
        let blocker = dir.join(format!("intents/.snapshot.{}.tmp", std::process::id()));
        std::fs::create_dir(&blocker).unwrap();
        let fill = |from: usize, n: usize| {
            for i in from..from + n {
                save(
                    &log,
                    &format!("v{}", i % 7),
                    format!("{{\"n\":{i}}}").as_bytes(),
                    false,
                );
            }
        };
        fill(0, 400);
        let tried = log
            .checkpoints_tried
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            (1..=12).contains(&tried),
            "{tried} checkpoints tried for 400 saves"
        );
        std::fs::remove_dir(&blocker).unwrap();
        fill(400, 400);
        let size = std::fs::metadata(dir.join("intents/log")).unwrap().len();
        assert!(size < 8000, "never checkpointed again: {size} bytes");
    }

    /// A log past its size is emptied once its snapshot is written; what it held is then
    /// in the snapshot and the record files, and a reboot changes nothing.
    #[test]
    fn a_long_log_is_checkpointed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log = IntentLog::with_checkpoint(dir, "b", 600).unwrap();
        let log_path = dir.join("intents/log");
        for i in 0..40 {
            save(
                &log,
                &format!("v{}", i % 5),
                format!("{{\"n\":{i}}}").as_bytes(),
                true,
            );
            assert!(std::fs::metadata(&log_path).unwrap().len() <= 600 + 80);
        }
        remove(&log, "v0");
        drop(log);
        IntentLog::open(dir, "b2").unwrap();
        assert_eq!(read(dir, "v0"), None);
        for i in 1..5 {
            assert_eq!(
                read(dir, &format!("v{i}")),
                Some(format!("{{\"n\":{}}}", 35 + i))
            );
        }
    }

    /// A checkpoint syncs no record file: the last entry of every live volume goes to
    /// the snapshot, so a power loss after any number of checkpoints (which may take
    /// every record file the kernel had not written back) still finds each record's
    /// last save, and no removed one.
    #[test]
    fn a_checkpoint_keeps_every_live_record_in_its_snapshot() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log = IntentLog::with_checkpoint(dir, "b", 600).unwrap();
        let log_path = dir.join("intents/log");
        // v0 and v1 are saved once, early; the others keep the log turning over.
        save(&log, "v0", br#"{"early":0}"#, true);
        save(&log, "v1", br#"{"early":1}"#, false);
        for i in 0..60 {
            let id = format!("w{}", i % 3);
            save(&log, &id, format!("{{\"n\":{i}}}").as_bytes(), i % 2 == 0);
        }
        remove(&log, "w2");
        let file = std::fs::File::open(&log_path).unwrap();
        let (_, checkpoints) = IntentLog::read_header(&file).unwrap().unwrap();
        assert!(checkpoints >= 2, "checkpointed {checkpoints} times");
        let text = std::fs::read(&log_path).unwrap();
        assert!(
            !last_entries(&text).contains_key("v0"),
            "v0's entry went with a checkpoint"
        );
        drop(log);
        // The power loss: no record file reached the disk (w2's removal did).
        for id in ["v0", "v1", "w0", "w1"] {
            std::fs::remove_file(dir.join(format!("{id}.json"))).unwrap();
        }
        IntentLog::open(dir, "b2").unwrap();
        assert_eq!(read(dir, "v0").as_deref(), Some(r#"{"early":0}"#));
        assert_eq!(read(dir, "v1").as_deref(), Some(r#"{"early":1}"#));
        assert_eq!(read(dir, "w0").as_deref(), Some(r#"{"n":57}"#));
        assert_eq!(read(dir, "w1").as_deref(), Some(r#"{"n":58}"#));
        assert_eq!(read(dir, "w2"), None);
        // The new boot starts with a snapshot of its own: a second power loss right away
        // loses nothing either.
        for id in ["v0", "w0"] {
            std::fs::remove_file(dir.join(format!("{id}.json"))).unwrap();
        }
        IntentLog::open(dir, "b3").unwrap();
        assert_eq!(read(dir, "v0").as_deref(), Some(r#"{"early":0}"#));
        assert_eq!(read(dir, "w0").as_deref(), Some(r#"{"n":57}"#));
    }

    /// A checkpoint cut short between its new snapshot and emptying the log leaves both:
    /// the new snapshot (the count after the log's) holds the whole log, and a reboot
    /// reads them together. A snapshot that goes with no log of this boot and count is
    /// never replayed.
    #[test]
    fn a_checkpoint_cut_short_loses_nothing_and_a_foreign_snapshot_is_ignored() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log_path = dir.join("intents/log");
        let log = IntentLog::with_checkpoint(dir, "b", 400).unwrap();
        save(&log, "old", br#"{"v":1}"#, true);
        for i in 0..12 {
            save(&log, "busy", format!("{{\"n\":{i}}}").as_bytes(), true);
        }
        // At least one checkpoint: "old" is in the snapshot alone.
        assert!(!last_entries(&std::fs::read(&log_path).unwrap()).contains_key("old"));
        save(&log, "late", br#"{"v":1}"#, true);
        let before = std::fs::read(&log_path).unwrap();
        {
            let file = log.file().unwrap();
            let _exclusive = log.lock(FlockArg::LockExclusive).unwrap();
            let last = log.last_entries_on_disk(&file).unwrap();
            log.checkpoint(&file, last).unwrap();
        }
        // The kill: the log as it was before it was emptied.
        std::fs::write(&log_path, &before).unwrap();
        drop(log);
        for id in ["old", "busy", "late"] {
            std::fs::remove_file(dir.join(format!("{id}.json"))).unwrap();
        }
        IntentLog::open(dir, "b2").unwrap();
        assert_eq!(read(dir, "old").as_deref(), Some(r#"{"v":1}"#));
        assert_eq!(read(dir, "busy").as_deref(), Some(r#"{"n":11}"#));
        assert_eq!(read(dir, "late").as_deref(), Some(r#"{"v":1}"#));

        // A snapshot of another boot, or of a log two checkpoints on, says nothing.
        let snapshot = dir.join("intents/snapshot");
        for header in [
            format!("{SNAPSHOT_HEADER}b\t1\n"),
            format!("{SNAPSHOT_HEADER}b2\t7\n"),
        ] {
            std::fs::write(
                &snapshot,
                format!("{header}{}", entry("ghost", Some(br#"{"v":1}"#))),
            )
            .unwrap();
            IntentLog::open(dir, "b3").unwrap();
            assert_eq!(read(dir, "ghost"), None, "{header:?}");
            // Started afresh for b3 with a snapshot of its own; make the next open a
            // reboot again.
            std::fs::write(&log_path, format!("{HEADER}b2\t{CHECKPOINT_TAG}1\n")).unwrap();
        }
    }

    /// A checkpoint stopped between emptying the log and writing its header (a kill; or a
    /// power loss that kept the truncate and lost the header) leaves a log with no header
    /// beside the snapshot it had just made, which holds every live record. The next open,
    /// of this boot or of the next, keeps that snapshot: a power loss after it still finds
    /// every record.
    #[test]
    fn a_checkpoint_stopped_after_it_emptied_the_log_keeps_its_snapshot() {
        for reopened_in_the_same_boot in [true, false] {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path();
            let log_path = dir.join("intents/log");
            let log = IntentLog::open(dir, "b").unwrap();
            save(&log, "a", br#"{"v":1}"#, true);
            save(&log, "c", br#"{"v":2}"#, true);
            {
                let file = log.file().unwrap();
                let _exclusive = log.lock(FlockArg::LockExclusive).unwrap();
                let last = log.last_entries_on_disk(&file).unwrap();
                log.checkpoint(&file, last).unwrap();
            }
            drop(log);
            // The stop: emptied, no header yet.
            std::fs::write(&log_path, "").unwrap();
            if reopened_in_the_same_boot {
                // Within the boot the record files are the truth: one written after the
                // snapshot, its entry lost (an append that failed), is not rolled back.
                std::fs::write(dir.join("a.json"), br#"{"v":9}"#).unwrap();
                let log = IntentLog::open(dir, "b").unwrap();
                assert_eq!(read(dir, "a").as_deref(), Some(r#"{"v":9}"#));
                save(&log, "a", br#"{"v":1}"#, false);
                save(&log, "d", br#"{"v":3}"#, false);
            }
            // A power loss takes the record files.
            for id in ["a", "c"] {
                std::fs::remove_file(dir.join(format!("{id}.json"))).unwrap();
            }
            IntentLog::open(dir, "b2").unwrap();
            let case = format!("reopened in the same boot: {reopened_in_the_same_boot}");
            assert_eq!(read(dir, "a").as_deref(), Some(r#"{"v":1}"#), "{case}");
            assert_eq!(read(dir, "c").as_deref(), Some(r#"{"v":2}"#), "{case}");
        }
    }

    /// The overwrite `append` offers for a save of `id`.
    fn offered(log: &IntentLog, id: &str, durable: bool) -> Overwrite {
        offered_for(log, id, Some(b"{}"), durable)
    }

    /// The same for a save of `record` (None: a removal) that writes nothing.
    fn offered_for(log: &IntentLog, id: &str, record: Option<&[u8]>, durable: bool) -> Overwrite {
        let mut offered = None;
        log.append(id, record, durable, |overwrite| {
            offered = Some(overwrite);
            Ok(())
        })
        .unwrap();
        offered.unwrap()
    }

    /// The log's header line.
    fn first_line(log_path: &Path) -> String {
        let text = std::fs::read_to_string(log_path).unwrap();
        text.lines().next().unwrap().to_string()
    }

    /// A record may be rewritten in place only once an fdatasync of this process has put
    /// an entry of it in the log on disk, and only until a checkpoint (of any process)
    /// empties the log; a removal forgets it.
    #[test]
    fn a_record_is_rewritten_in_place_only_while_the_log_on_disk_holds_an_entry_of_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let ours = IntentLog::with_checkpoint(dir, "b", 2000).unwrap();
        assert_eq!(
            offered(&ours, "v", false),
            Overwrite::Replace,
            "nothing synced yet"
        );
        assert_eq!(
            offered(&ours, "v", true),
            Overwrite::Replace,
            "synced after it"
        );
        assert_eq!(offered(&ours, "v", false), Overwrite::InPlace);
        assert_eq!(offered(&ours, "v", true), Overwrite::InPlace);
        assert_eq!(
            offered(&ours, "w", false),
            Overwrite::Replace,
            "another volume"
        );
        // Another process's saves fill the log until it checkpoints.
        let theirs = IntentLog::with_checkpoint(dir, "b", 2000).unwrap();
        let log_path = dir.join("intents/log");
        assert_eq!(first_line(&log_path), format!("{HEADER}b"));
        while first_line(&log_path) == format!("{HEADER}b") {
            save(&theirs, "x", &[b'1'; 100], false);
        }
        assert_eq!(
            first_line(&log_path),
            format!("{HEADER}b\t{CHECKPOINT_TAG}1")
        );
        assert_eq!(
            offered(&ours, "v", false),
            Overwrite::Replace,
            "after a checkpoint"
        );
        assert_eq!(offered(&ours, "v", true), Overwrite::Replace);
        assert_eq!(offered(&ours, "v", false), Overwrite::InPlace);
        remove(&ours, "v");
        assert_eq!(
            offered(&ours, "v", false),
            Overwrite::Replace,
            "after a removal"
        );
        // A log of a build before the count (its header ends at the boot id) is this
        // boot's, at count 0.
        drop((ours, theirs));
        std::fs::write(&log_path, format!("{HEADER}b\n")).unwrap();
        let old = IntentLog::open(dir, "b").unwrap();
        assert_eq!(offered(&old, "v", true), Overwrite::Replace);
        assert_eq!(offered(&old, "v", false), Overwrite::InPlace);
        assert!(
            std::fs::read_to_string(&log_path)
                .unwrap()
                .starts_with(&format!("{HEADER}b\n"))
        );
    }

    /// Issue 20: this process's own checkpoint puts an entry of every live volume in the
    /// durable snapshot, so their records go on being rewritten in place (before, the
    /// checkpoint in a burst of Attaches made every volume in it replace its file: a new
    /// inode, and the old one freed). A power loss that tears such a rewrite, and takes
    /// the unsynced entry of it from the log, finds the snapshot's entry at the next boot.
    #[test]
    fn after_its_own_checkpoint_a_process_rewrites_the_snapshotted_records_in_place() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let log = IntentLog::with_checkpoint(dir, "b", 600).unwrap();
        let log_path = dir.join("intents/log");
        save(&log, "v", br#"{"v":1}"#, false);
        save(&log, "gone", br#"{"v":1}"#, true);
        remove(&log, "gone");
        assert_eq!(
            offered_nothing(&log, "v"),
            Overwrite::Replace,
            "never synced"
        );
        while first_line(&log_path) == format!("{HEADER}b") {
            save(&log, "w", &[b'1'; 100], false);
        }
        assert_eq!(offered_nothing(&log, "v"), Overwrite::InPlace);
        assert_eq!(offered_nothing(&log, "w"), Overwrite::InPlace);
        assert_eq!(offered_nothing(&log, "gone"), Overwrite::Replace, "removed");
        assert_eq!(
            offered_nothing(&log, "x"),
            Overwrite::Replace,
            "never saved"
        );

        // The rewrite tears, and the power loss takes its entry from the log.
        let before = std::fs::metadata(&log_path).unwrap().len();
        let record = dir.join("v.json");
        log.append("v", Some(br#"{"v":2}"#), false, |overwrite| {
            assert_eq!(overwrite, Overwrite::InPlace);
            std::fs::write(&record, br#"{"v""#).map_err(|e| (record.clone(), e))
        })
        .unwrap();
        drop(log);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&log_path)
            .unwrap()
            .set_len(before)
            .unwrap();
        IntentLog::open(dir, "b2").unwrap();
        assert_eq!(read(dir, "v").as_deref(), Some(r#"{"v":1}"#));
    }

    /// The overwrite `append` offers for a save of `id` that changes nothing (its entry is
    /// the record file's own content, or none for a volume without one).
    fn offered_nothing(log: &IntentLog, id: &str) -> Overwrite {
        let bytes = std::fs::read(log.record_path(id)).ok();
        offered_for(log, id, bytes.as_deref(), false)
    }

    /// Entries are read back exactly; a damaged one, or one whose volume id is not a
    /// name the journal makes, is passed over.
    #[test]
    fn damaged_entries_and_foreign_names_are_passed_over() {
        let good = entry("v-1_a", Some(br#"{"a":"b\tc"}"#));
        let removed = entry("v", None);
        let mut damaged = entry("w", Some(b"{}")).into_bytes();
        damaged[5] ^= 1;
        let foreign = {
            let body = "../x\t{}";
            format!("\n{}\t{body}\n", check(body))
        };
        let mut text = format!("{HEADER}b\n{good}{removed}").into_bytes();
        text.extend_from_slice(&damaged);
        text.extend_from_slice(foreign.as_bytes());
        text.extend_from_slice(b"\0\0\0\0");
        let last = last_entries(&text);
        assert_eq!(
            last,
            LastEntries::from([
                ("v-1_a".to_string(), Some(br#"{"a":"b\tc"}"#.to_vec())),
                ("v".to_string(), None),
            ])
        );
    }
}
