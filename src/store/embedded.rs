//! The embedded controller store: one redb file on the controller host.
//!
//! redb allows one open handle per file, and the binary hook forks a process per call, so
//! the file is opened under an exclusive flock on a side lock file (waited for at most
//! `LOCK_WAIT`) and closed again when this process's callers are done with it (`serve`
//! keeps it open a few ms longer, `keep_open_when_idle`). Callers of one process that
//! overlap share the open file (`Shared`), their volume writes share one write transaction
//! (`EmbeddedStore::write_volume`), and their writes share one durable commit: each write
//! commits without a sync, and no caller returns before a durable commit that began after
//! its own write (or after any write it could have read) has finished.
//! docs/reliability.md, *The controller store's group commit*, says why that is as
//! durable as a synced commit per write.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::fcntl::Flock;
use redb::{Durability, ReadableDatabase, ReadableTable, TableDefinition};

use super::fsutil::lock_exclusive_within;
use crate::blocking::wait_for_disk;
use crate::bridge::ports::{ControllerStore, SnapshotStore, StoreError};
use crate::bridge::records::{SnapshotRecord, VolumeRecord};

/// Version of the records and tables in the file; recorded in the `meta` table.
pub const STORE_FORMAT: u64 = 1;

const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
/// Snapshot records by snapshot name (made on the first snapshot: a file without it has
/// none). Their revisions come from the same store-wide counter.
const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const FORMAT_KEY: &str = "format";
/// The last revision handed out, store-wide: a record deleted and created again never
/// gets a revision a copy read before the delete could hold.
const REVISION_KEY: &str = "revision";

/// How long an operation waits for another process's transaction on the file.
const LOCK_WAIT: Duration = Duration::from_secs(10);

/// How long one opening of the file admits new callers of this process. After that the
/// callers still inside finish, the file is closed and the lock released, so that an
/// unending stream of this process's calls cannot keep other processes (forked hooks, an
/// operator's command) out for longer than this plus one call (and the linger time).
const SHARE_SPAN: Duration = Duration::from_millis(50);

/// One redb file, shared safely by any number of processes.
#[derive(Debug)]
pub struct EmbeddedStore {
    path: PathBuf,
    /// What this process's callers of the file share (one per path in a process).
    shared: Arc<Shared>,
}

/// This process's use of one store file: the file opened once for every caller that
/// overlaps with another, and one durable commit for every write waiting for one.
#[derive(Debug)]
struct Shared {
    path: PathBuf,
    lock_path: PathBuf,
    state: Mutex<SharedState>,
    // One condition per event, each notified only when it happens, so that a change
    // wakes only the callers waiting for it: with one condition for all, each of a
    // storm's writes woke every caller waiting for a durable commit (and the closer) to
    // find nothing for it, and back to sleep.
    /// The writer's place was given up: one caller queued for it takes it.
    writer_free: Condvar,
    /// A durable commit ended (or broke the file): callers waiting for theirs look.
    commit_done: Condvar,
    /// The file was opened or closed, or its last caller left: callers waiting to open,
    /// close or join afresh look.
    opening_changed: Condvar,
    /// Wakes the closer before its time (a test that shortened the linger).
    closer: Condvar,
    // A queued volume write's caller waits on a condition of its own (`write_wakers`):
    // the end of a batch wakes the callers whose writes it applied and the one caller
    // that applies the next, not every caller queued.
}

#[derive(Debug, Default)]
struct SharedState {
    open: Option<Arc<OpenFile>>,
    opened_at: Option<Instant>,
    /// One caller is opening or closing the file; the others wait for it.
    changing: bool,
    /// Callers using `open` now; the last to leave closes it (or leaves that to the
    /// closer thread when the file lingers).
    users: usize,
    /// Commits under way: begun, and their ticket not yet taken. Their writes may already
    /// be visible to a reader, who must then wait for a durable commit too.
    committing: usize,
    /// Tickets handed out: one per write committed without a sync.
    issued: u64,
    /// Every ticket up to this one is covered by a finished durable commit.
    synced: u64,
    /// A durable commit is running (begun after every ticket up to the one it covers).
    flushing: bool,
    /// A write transaction is open (redb allows one at a time). Callers queue for it here,
    /// within their deadline, rather than inside redb, where a writer that hangs (a disk
    /// that stopped answering) would hang every caller behind it with no time limit.
    writer: bool,
    /// Callers waiting for the writer's place: a write that has them commits without a
    /// sync, so that they join the group commit after it.
    writers_waiting: usize,
    /// Callers waiting on `commit_done` and on `opening_changed`: a change no one waits
    /// for wakes no one (a notify is a syscall even then).
    commit_waiters: usize,
    opening_waiters: usize,
    /// Volume writes of this process's callers queued for the next batch (see
    /// `EmbeddedStore::write_volume`), by id.
    queued: Vec<(u64, VolumeWrite)>,
    /// The condition each queued or applied write's caller waits on, by id, until it
    /// takes its outcome or gives up.
    write_wakers: std::collections::HashMap<u64, Arc<Condvar>>,
    /// A caller is applying a batch of queued writes.
    combining: bool,
    next_write: u64,
    /// Outcomes of applied writes until their callers take them.
    outcomes: std::collections::HashMap<u64, WriteOutcome>,
    /// Writes whose callers stopped waiting while theirs was applied: no one takes
    /// their outcomes.
    abandoned: std::collections::HashSet<u64>,
    /// Batches applied (one write transaction each), for the tests.
    batches: u64,
    /// Callers of queued writes woken to find neither their outcome nor a batch to
    /// apply, for the tests (a herd of wake-ups counts here).
    idle_write_wakes: u64,
    /// A write with no one to share a commit with syncs its own (see `Session::commit`);
    /// true but in the tests of writes that wait for a group commit.
    sync_lone_writes: bool,
    /// Why the open file can no longer be trusted (a durable commit failed, redb
    /// panicked): no one new joins it, and those waiting on it fail.
    broken: Option<String>,
    /// How long an opening admits new callers; `SHARE_SPAN` unless a test says otherwise.
    share_span: Option<Duration>,
    /// How long a caller waits for the others; `LOCK_WAIT` unless a test says otherwise.
    lock_wait: Option<Duration>,
    /// How long the file stays open with no caller (zero: closed by the last to leave).
    linger: Duration,
    /// Since when no caller uses the open file.
    idle_since: Option<Instant>,
    /// A thread is waiting to close the file once it has been idle for `linger`.
    closer_running: bool,
    /// Counts since this process started, for the tests and the figures.
    opens: u64,
    durable_commits: u64,
    /// Write transactions committed, durably or not.
    write_commits: u64,
}

/// The database open and the file lock held; closing it releases the lock.
#[derive(Debug)]
struct OpenFile {
    // Field order is drop order: the database closes before the lock is released.
    db: redb::Database,
    _lock: Flock<File>,
}

/// A volume write queued for the next batch: writes that overlap share one write
/// transaction and its commit (`EmbeddedStore::write_volume`).
#[derive(Debug)]
enum VolumeWrite {
    /// Store the record if the stored copy is at its revision.
    Put(VolumeRecord),
    /// Delete the record if it is still at its revision (any when None).
    Delete(VolumeRecord),
}

/// What a queued write came to: a put's new revision (None for a delete), and the ticket
/// of the commit that carried it (None when it changed nothing).
type WriteOutcome = (Result<Option<String>, StoreError>, Option<u64>);

/// One caller's use of the open file: the transactions it begins and commits.
struct Session<'a> {
    db: &'a redb::Database,
    shared: &'a Shared,
    /// When this caller stops waiting for the others.
    until: Instant,
    /// The ticket of this caller's last write, if it wrote.
    ticket: std::cell::Cell<Option<u64>>,
}

/// A write transaction of a session: it commits without a sync, through the session, so
/// that its caller waits for the durable commit that covers it. Holds the writer's place
/// until it is committed or dropped.
struct Write<'s> {
    txn: Option<redb::WriteTransaction>,
    shared: &'s Shared,
}

impl std::ops::Deref for Write<'_> {
    type Target = redb::WriteTransaction;
    fn deref(&self) -> &redb::WriteTransaction {
        self.txn
            .as_ref()
            .expect("a write is open until it is committed")
    }
}

impl Drop for Write<'_> {
    fn drop(&mut self) {
        // An uncommitted transaction aborts here, before the next writer goes.
        drop(self.txn.take());
        let mut state = self.shared.lock();
        state.writer = false;
        if state.writers_waiting > 0 {
            self.shared.writer_free.notify_one();
        }
    }
}

impl Session<'_> {
    fn read(&self) -> Result<redb::ReadTransaction, StoreError> {
        self.db.begin_read().map_err(|e| self.shared.err(e))
    }

    fn write(&self) -> Result<Write<'_>, StoreError> {
        let mut write = self.shared.begin_write(self.db, self.until)?;
        if let Some(txn) = write.txn.as_mut() {
            txn.set_durability(Durability::None)
                .map_err(|e| self.shared.err(e))?;
        }
        Ok(write)
    }

    /// Commits the write. With no durable commit running and no writer waiting for its
    /// place, nothing could share a group commit with this write: it commits with a sync
    /// itself (one commit instead of two), and that sync covers every write before it.
    fn commit(&self, mut write: Write<'_>) -> Result<(), StoreError> {
        let txn = write.txn.take().expect("a write is committed once");
        let alone = {
            let mut state = self.shared.lock();
            state.committing += 1;
            let alone = state.sync_lone_writes
                && !state.flushing
                && state.writers_waiting == 0
                && state.broken.is_none();
            if alone {
                // Taken before the commit begins: it covers every ticket up to it.
                state.flushing = true;
                state.issued += 1;
            }
            alone.then_some(state.issued)
        };
        let result = match alone {
            Some(_) => self.shared.commit_durably(txn),
            None => txn.commit().map_err(|e| self.shared.err(e)),
        };
        drop(write);
        let mut state = self.shared.lock();
        state.committing -= 1;
        state.write_commits += u64::from(result.is_ok());
        match (alone, &result) {
            (Some(ticket), Ok(())) => {
                state.flushing = false;
                state.durable_commits += 1;
                state.synced = state.synced.max(ticket);
                self.ticket.set(Some(ticket));
                self.shared.commit_ended(&state);
            }
            (Some(_), Err(e)) => {
                // As a failed group commit: the writes it would have covered fail too.
                state.flushing = false;
                state.durable_commits += 1;
                state.broken = Some(e.to_string());
                self.shared.commit_ended(&state);
            }
            (None, Ok(())) => {
                state.issued += 1;
                self.ticket.set(Some(state.issued));
            }
            (None, Err(_)) => {}
        }
        result
    }
}

/// How long this process keeps a store file open after its last caller left, in µs
/// (zero: not at all). Set by `keep_open_when_idle`.
static LINGER_MICROS: AtomicU64 = AtomicU64::new(0);

/// Makes this process keep each store file it opens from now on open for `linger` after
/// its last caller left, so that the next call (the second write of a Create, a Create
/// right after another) finds it open. Only a long-lived process should: the file stays
/// locked against other processes meanwhile, and one that ends without
/// `close_idle_files` leaves the file for redb to repair at its next opening.
pub fn keep_open_when_idle(linger: Duration) {
    let micros = u64::try_from(linger.as_micros()).unwrap_or(u64::MAX);
    LINGER_MICROS.store(micros, Ordering::Relaxed);
}

/// Closes every store file this process keeps open (at the end of `serve`).
pub fn close_idle_files() {
    let all: Vec<Arc<Shared>> = SHARED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(|(_, weak)| weak.upgrade())
        .collect();
    for shared in all {
        shared.close_now();
    }
}

/// The process-wide registry of shared files, so that two stores opened on one path
/// (the volume and the snapshot store of `serve`) queue on one lock and share commits.
static SHARED: Mutex<Vec<(PathBuf, Weak<Shared>)>> = Mutex::new(Vec::new());

impl Shared {
    fn for_path(path: &Path) -> Arc<Shared> {
        let mut all = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|(_, weak)| weak.strong_count() > 0);
        if let Some(shared) = all
            .iter()
            .find(|(p, _)| p == path)
            .and_then(|(_, weak)| weak.upgrade())
        {
            return shared;
        }
        let shared = Arc::new(Shared {
            path: path.to_path_buf(),
            lock_path: path.with_extension("lock"),
            state: Mutex::new(SharedState {
                linger: Duration::from_micros(LINGER_MICROS.load(Ordering::Relaxed)),
                sync_lone_writes: true,
                ..SharedState::default()
            }),
            writer_free: Condvar::new(),
            commit_done: Condvar::new(),
            opening_changed: Condvar::new(),
            closer: Condvar::new(),
        });
        all.push((path.to_path_buf(), Arc::downgrade(&shared)));
        shared
    }

    fn lock(&self) -> MutexGuard<'_, SharedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Backend {
            store: self.path.display().to_string(),
            action: "redb".into(),
            transient: false,
            source: e.to_string().into(),
        }
    }

    /// The error of a caller whose wait for `what` outlasted its deadline.
    fn waited_too_long(&self, what: &str) -> StoreError {
        StoreError::Backend {
            store: self.path.display().to_string(),
            action: format!("waiting for {what} of {}", self.path.display()),
            transient: true,
            source: "another caller of this process held it past this call's time limit \
                     (a disk that stopped answering?)"
                .into(),
        }
    }

    /// Waits on `condition` until it is notified or `until`, counted among its `waiters`
    /// meanwhile (whoever notifies it does so only when some wait); the guard back, and
    /// false when the time was up before the wait.
    fn wait_on<'g>(
        condition: &Condvar,
        waiters: fn(&mut SharedState) -> &mut usize,
        mut state: MutexGuard<'g, SharedState>,
        until: Instant,
    ) -> (MutexGuard<'g, SharedState>, bool) {
        if until <= Instant::now() {
            return (state, false);
        }
        *waiters(&mut state) += 1;
        let (mut state, waited) = Self::wait_until(condition, state, until);
        *waiters(&mut state) -= 1;
        (state, waited.is_some())
    }

    /// Waits on `condition` until it is notified or `until`: the guard back, and how the
    /// wait ended (None when the time was up before it).
    fn wait_until<'g>(
        condition: &Condvar,
        state: MutexGuard<'g, SharedState>,
        until: Instant,
    ) -> (
        MutexGuard<'g, SharedState>,
        Option<std::sync::WaitTimeoutResult>,
    ) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (state, None);
        }
        let (state, ended) = condition
            .wait_timeout(state, left)
            .unwrap_or_else(|p| p.into_inner());
        (state, Some(ended))
    }

    /// Waits (see `wait_on`) for a durable commit to end.
    fn wait_for_commit<'g>(
        &self,
        state: MutexGuard<'g, SharedState>,
        until: Instant,
    ) -> (MutexGuard<'g, SharedState>, bool) {
        Self::wait_on(&self.commit_done, |s| &mut s.commit_waiters, state, until)
    }

    /// Waits (see `wait_on`) for the file to be opened or closed, or its last caller to
    /// leave.
    fn wait_for_opening<'g>(
        &self,
        state: MutexGuard<'g, SharedState>,
        until: Instant,
    ) -> (MutexGuard<'g, SharedState>, bool) {
        Self::wait_on(
            &self.opening_changed,
            |s| &mut s.opening_waiters,
            state,
            until,
        )
    }

    /// Tells the callers waiting for a durable commit that one ended (the caller holds
    /// `state` and has set what it changed).
    fn commit_ended(&self, state: &SharedState) {
        if state.commit_waiters > 0 {
            self.commit_done.notify_all();
        }
    }

    /// Tells the callers waiting on the opening that it changed.
    fn tell_opening_changed(&self, state: &SharedState) {
        if state.opening_waiters > 0 {
            self.opening_changed.notify_all();
        }
    }

    /// Joins the open file, opening it (lock, database, format check) when none is.
    fn join(&self, until: Instant) -> Result<Arc<OpenFile>, StoreError> {
        let mut state = self.lock();
        loop {
            let joinable = Self::joinable(&state);
            match &state.open {
                Some(open) if !state.changing && joinable => {
                    let open = open.clone();
                    state.users += 1;
                    state.idle_since = None;
                    return Ok(open);
                }
                // Kept open past its time with no one inside: close it, then open afresh.
                Some(_) if !state.changing && state.users == 0 => {
                    self.close(state);
                    state = self.lock();
                    continue;
                }
                None if !state.changing => {
                    state.changing = true;
                    drop(state);
                    let opened = self.open_file(until);
                    state = self.lock();
                    state.changing = false;
                    self.tell_opening_changed(&state);
                    let open = Arc::new(opened?);
                    state.open = Some(open.clone());
                    state.opened_at = Some(Instant::now());
                    state.users = 1;
                    state.opens += 1;
                    return Ok(open);
                }
                _ => {}
            }
            let (next, waited) = self.wait_for_opening(state, until);
            if !waited {
                return Err(self.waited_too_long("the opening or closing"));
            }
            state = next;
        }
    }

    /// Whether callers may still join the open file (it is sound and not too old).
    fn joinable(state: &SharedState) -> bool {
        state.broken.is_none()
            && state
                .opened_at
                .is_some_and(|at| at.elapsed() < state.share_span.unwrap_or(SHARE_SPAN))
    }

    /// Leaves the open file. The last caller to leave closes it and releases the lock,
    /// unless this process keeps it open a while for the next caller (`serve` does).
    fn leave(self: &Arc<Self>) {
        let mut state = self.lock();
        state.users -= 1;
        if state.users > 0 {
            return;
        }
        // A caller may be waiting to close an opening too old to join, or to shut down.
        self.tell_opening_changed(&state);
        if state.linger.is_zero() || !Self::joinable(&state) {
            self.close(state);
            return;
        }
        state.idle_since = Some(Instant::now());
        if state.closer_running {
            return;
        }
        let shared = self.clone();
        let spawned = std::thread::Builder::new()
            .name("store-closer".into())
            .spawn(move || shared.close_when_idle());
        match spawned {
            Ok(_) => state.closer_running = true,
            // No thread for it: close now rather than hold the lock with no one to let go.
            Err(_) => self.close(state),
        }
    }

    /// Closes the open file (no caller uses it) and releases the lock.
    fn close(&self, mut state: MutexGuard<'_, SharedState>) {
        let closing = state.open.take();
        state.opened_at = None;
        state.idle_since = None;
        state.broken = None;
        state.changing = true;
        drop(state);
        drop(closing);
        let mut state = self.lock();
        state.changing = false;
        self.tell_opening_changed(&state);
    }

    /// The closer of a file kept open: closes it once it has been idle for the linger
    /// time, or once it is too old to join.
    fn close_when_idle(self: Arc<Self>) {
        let mut state = self.lock();
        loop {
            if state.open.is_none() {
                state.closer_running = false;
                return;
            }
            let idle_for = state.idle_since.map(|at| at.elapsed());
            if state.users == 0
                && !state.changing
                && (idle_for.is_some_and(|idle| idle >= state.linger) || !Self::joinable(&state))
            {
                state.closer_running = false;
                self.close(state);
                return;
            }
            let pause = state.linger - idle_for.unwrap_or_default().min(state.linger);
            // Woken by its time, not by the callers: they come and go on every call.
            let (next, _) = self
                .closer
                .wait_timeout(state, pause.max(Duration::from_micros(100)))
                .unwrap_or_else(|p| p.into_inner());
            state = next;
        }
    }

    /// Closes the file once no caller uses it, waiting at most `LOCK_WAIT` for them.
    fn close_now(&self) {
        let mut state = self.lock();
        let until = Instant::now() + state.lock_wait.unwrap_or(LOCK_WAIT);
        while state.users > 0 || state.changing {
            let (next, waited) = self.wait_for_opening(state, until);
            if !waited {
                return;
            }
            state = next;
        }
        if state.open.is_some() {
            self.close(state);
        }
    }

    fn open_file(&self, until: Instant) -> Result<OpenFile, StoreError> {
        let left = until.saturating_duration_since(Instant::now());
        let lock =
            lock_exclusive_within(&self.lock_path, left).map_err(|e| StoreError::Backend {
                store: self.path.display().to_string(),
                action: format!("locking {}", self.lock_path.display()),
                transient: e.kind() == std::io::ErrorKind::TimedOut,
                source: e.into(),
            })?;
        let db = self.unpanicked(|| {
            let db = redb::Database::create(&self.path).map_err(|e| self.err(e))?;
            self.check_format(&db)?;
            Ok(db)
        })?;
        Ok(OpenFile { db, _lock: lock })
    }

    /// Runs `work`, turning a redb panic into an error. redb panics on some damaged files
    /// (an invalid page type, a truncated region) instead of answering an error: a damaged
    /// store must fail its own calls, not the process that also serves Attach and Detach.
    fn unpanicked<T>(&self, work: impl FnOnce() -> Result<T, StoreError>) -> Result<T, StoreError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("redb panicked");
            Err(StoreError::Corrupt {
                store: self.path.display().to_string(),
                what: "the database file".into(),
                message: format!("{message}; restore it from a backup"),
            })
        })
    }

    /// The ticket a caller must see covered before it returns: its own last write, or,
    /// for a caller that only read, every write it could have seen (any write committed
    /// or being committed and not yet durable).
    fn ticket_for(&self, session: &Session) -> Option<u64> {
        let mut state = self.lock();
        if let Some(own) = session.ticket.get() {
            return Some(own);
        }
        if state.committing == 0 && state.synced >= state.issued {
            return None;
        }
        // A fresh ticket: the durable commit that covers it begins after now, so after
        // every commit this caller's reads could have seen.
        state.issued += 1;
        Some(state.issued)
    }

    /// Returns once a durable commit covering `ticket` has finished; runs it when no
    /// other caller is running one. A failed durable commit breaks the open file: every
    /// caller whose write it carried fails, and the file is closed when they have left.
    fn make_durable(
        &self,
        db: &redb::Database,
        ticket: u64,
        until: Instant,
    ) -> Result<(), StoreError> {
        let mut state = self.lock();
        loop {
            if state.synced >= ticket {
                return Ok(());
            }
            if let Some(why) = &state.broken {
                return Err(StoreError::Backend {
                    store: self.path.display().to_string(),
                    action: "committing durably".into(),
                    transient: false,
                    source: why.clone().into(),
                });
            }
            if !state.flushing {
                state.flushing = true;
                let covers = state.issued;
                drop(state);
                let result = self.unpanicked(|| self.durable_commit(db, until));
                state = self.lock();
                state.flushing = false;
                state.durable_commits += 1;
                match result {
                    Ok(()) => state.synced = state.synced.max(covers),
                    Err(e) => state.broken = Some(e.to_string()),
                }
                self.commit_ended(&state);
                continue;
            }
            let (next, waited) = self.wait_for_commit(state, until);
            if !waited {
                return Err(self.waited_too_long("the durable commit"));
            }
            state = next;
        }
    }

    /// An empty transaction committed with a sync: it makes every commit before it durable.
    fn durable_commit(&self, db: &redb::Database, until: Instant) -> Result<(), StoreError> {
        #[cfg(test)]
        self.hold_for_test_writers();
        let mut write = self.begin_write(db, until)?;
        let txn = write.txn.take().expect("just begun");
        self.commit_durably(txn)?;
        self.lock().write_commits += 1;
        Ok(())
    }

    /// Commits `txn` with a sync: every commit before it is durable once it returns.
    fn commit_durably(&self, mut txn: redb::WriteTransaction) -> Result<(), StoreError> {
        #[cfg(test)]
        if let Some(why) = tests::failing_durable_commit(&self.path) {
            return Err(self.err(why));
        }
        txn.set_durability(Durability::Immediate)
            .map_err(|e| self.err(e))?;
        txn.commit().map_err(|e| self.err(e))
    }

    /// A test's way to make writes overlap a durable commit however fast the disk is:
    /// the commit waits (up to 10 s) until the writes the test expects are queued.
    #[cfg(test)]
    fn hold_for_test_writers(&self) {
        let Some(queued) = tests::durable_commit_waits_for(&self.path) else {
            return;
        };
        let give_up = Instant::now() + Duration::from_secs(10);
        while self.lock().next_write < queued && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits (until `until`) for the writer's place, then begins a write transaction.
    fn begin_write<'s>(
        &'s self,
        db: &redb::Database,
        until: Instant,
    ) -> Result<Write<'s>, StoreError> {
        let mut state = self.lock();
        while state.writer {
            // Woken one at a time (`Write::drop`): whoever takes the place wakes the next
            // when it gives it up, so a waiter that gives up or finds it taken again
            // loses no one their turn.
            let (next, waited) =
                Self::wait_on(&self.writer_free, |s| &mut s.writers_waiting, state, until);
            if !waited {
                return Err(self.waited_too_long("the write transaction before this one"));
            }
            state = next;
        }
        state.writer = true;
        drop(state);
        let mut write = Write {
            txn: None,
            shared: self,
        };
        write.txn = Some(db.begin_write().map_err(|e| self.err(e))?);
        Ok(write)
    }

    fn check_format(&self, db: &redb::Database) -> Result<(), StoreError> {
        // A read transaction answers for every file but a new one: no write, no sync.
        let stored = {
            let txn = db.begin_read().map_err(|e| self.err(e))?;
            match txn.open_table(META) {
                Ok(meta) => meta
                    .get(FORMAT_KEY)
                    .map_err(|e| self.err(e))?
                    .map(|v| v.value()),
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(self.err(e)),
            }
        };
        if stored == Some(STORE_FORMAT) {
            return Ok(());
        }
        let txn = db.begin_write().map_err(|e| self.err(e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            let found = meta
                .get(FORMAT_KEY)
                .map_err(|e| self.err(e))?
                .map(|v| v.value());
            match found {
                Some(STORE_FORMAT) => return Ok(()),
                Some(found) => {
                    return Err(StoreError::Corrupt {
                        store: self.path.display().to_string(),
                        what: "format".into(),
                        message: format!(
                            "the file has format {found}; this build reads format {STORE_FORMAT}"
                        ),
                    });
                }
                None => {
                    meta.insert(FORMAT_KEY, STORE_FORMAT)
                        .map_err(|e| self.err(e))?;
                    txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
                }
            }
        }
        txn.commit().map_err(|e| self.err(e))
    }
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store at `path` and checks its format.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let store = Self {
            path: path.to_path_buf(),
            shared: Shared::for_path(path),
        };
        if let Some(dir) = path.parent() {
            crate::mount::ops::ensure_dir(dir, 0o700).map_err(|e| store.err(e))?;
        }
        store.with_db(|_| Ok(()))?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, e: impl std::fmt::Display) -> StoreError {
        self.shared.err(e)
    }

    /// Runs `f` on the open file (opening it, or joining this process's other callers
    /// on it) and returns once every write `f` made or could have read is durable.
    fn with_db<T>(
        &self,
        f: impl FnOnce(&Session) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let shared = &*self.shared;
        let until = Instant::now() + shared.lock().lock_wait.unwrap_or(LOCK_WAIT);
        let open = shared.join(until)?;
        let session = Session {
            db: &open.db,
            shared,
            until,
            ticket: std::cell::Cell::new(None),
        };
        let outcome = shared.unpanicked(|| f(&session));
        if let Err(StoreError::Corrupt { message, .. }) = &outcome {
            shared.lock().broken.get_or_insert_with(|| message.clone());
        }
        let durable = match shared.ticket_for(&session) {
            Some(ticket) => shared.make_durable(&open.db, ticket, until),
            None => Ok(()),
        };
        drop(open);
        self.shared.leave();
        let value = outcome?;
        durable?;
        Ok(value)
    }

    /// (openings of the file, durable commits) by this process so far.
    #[cfg(test)]
    fn activity(&self) -> (u64, u64) {
        let state = self.shared.lock();
        (state.opens, state.durable_commits)
    }

    /// Reads a stored record; records written before revisions existed are at "0".
    fn decode(&self, bytes: &[u8]) -> Result<VolumeRecord, StoreError> {
        let mut record: VolumeRecord =
            serde_json::from_slice(bytes).map_err(|e| self.err(format!("corrupt record: {e}")))?;
        record.revision.get_or_insert_with(|| "0".into());
        Ok(record)
    }

    fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.read()?;
            let table = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
            let Some(found) = table.get(volume_id).map_err(|e| self.err(e))? else {
                return Ok(None);
            };
            let record = self.decode(found.value())?;
            // Another volume's record (its value copied under this key) is never this
            // one's: its MAC verifies, and Destroy would delete the other volume.
            if record.volume_id != volume_id {
                return Err(StoreError::Corrupt {
                    store: self.path.display().to_string(),
                    what: format!("the record stored under volume {volume_id:?}"),
                    message: format!("it records volume {:?}", record.volume_id),
                });
            }
            Ok(Some(record))
        })
    }

    /// The stored revision of `volume_id` inside a write transaction.
    fn stored_revision(
        &self,
        table: &redb::Table<&str, &[u8]>,
        volume_id: &str,
    ) -> Result<Option<String>, StoreError> {
        let stored = table.get(volume_id).map_err(|e| self.err(e))?;
        stored
            .map(|v| {
                self.decode(v.value())
                    .map(|r| r.revision.unwrap_or_default())
            })
            .transpose()
    }

    /// The last revision handed out. A file from before the store-wide counter counted
    /// per record: start above every revision its records hold.
    fn last_revision(
        &self,
        meta: &redb::Table<&str, u64>,
        table: &redb::Table<&str, &[u8]>,
    ) -> Result<u64, StoreError> {
        if let Some(last) = meta.get(REVISION_KEY).map_err(|e| self.err(e))? {
            return Ok(last.value());
        }
        let mut highest = 0;
        for entry in table.iter().map_err(|e| self.err(e))? {
            let (_, v) = entry.map_err(|e| self.err(e))?;
            let revision = self.decode(v.value())?.revision.unwrap_or_default();
            highest = highest.max(revision.parse::<u64>().unwrap_or(0));
        }
        Ok(highest)
    }

    /// Writes `record` if the stored revision is `record.revision`; returns the new one.
    fn put(&self, record: &VolumeRecord) -> Result<String, StoreError> {
        let revision = self.write_volume(VolumeWrite::Put(record.clone()))?;
        Ok(revision.expect("a put returns its revision"))
    }

    /// Deletes the record if it is still at `record.revision` (any revision when None).
    fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        self.write_volume(VolumeWrite::Delete(record.clone()))
            .map(|_| ())
    }

    /// Applies `write` in the next batch: the caller that finds no batch being applied
    /// applies every write queued by then in one write transaction, and commits it once;
    /// the others wait for it. In a create storm each Create's two writes would otherwise
    /// take the writer's place in turn, each with its own commit (a write of every page
    /// it changed): the writes of a storm's callers now share them.
    fn write_volume(&self, write: VolumeWrite) -> Result<Option<String>, StoreError> {
        self.with_db(|session| {
            let shared = session.shared;
            let waker = Arc::new(Condvar::new());
            let mut state = shared.lock();
            let id = state.next_write;
            state.next_write += 1;
            state.queued.push((id, write));
            state.write_wakers.insert(id, waker.clone());
            loop {
                if let Some((result, ticket)) = state.outcomes.remove(&id) {
                    state.write_wakers.remove(&id);
                    drop(state);
                    if ticket.is_some() {
                        session.ticket.set(ticket);
                    }
                    return result;
                }
                if !state.combining {
                    state.combining = true;
                    let batch = std::mem::take(&mut state.queued);
                    drop(state);
                    let ids: Vec<u64> = batch.iter().map(|(id, _)| *id).collect();
                    let applied = shared.unpanicked(|| Ok(self.apply_batch(session, batch)));
                    state = shared.lock();
                    state.combining = false;
                    state.batches += 1;
                    let outcomes: Vec<WriteOutcome> = match applied {
                        Ok(outcomes) => outcomes,
                        Err(e) => ids.iter().map(|_| (Err(copy_error(&e)), None)).collect(),
                    };
                    for (applied_id, outcome) in ids.into_iter().zip(outcomes) {
                        if state.abandoned.remove(&applied_id) {
                            continue;
                        }
                        state.outcomes.insert(applied_id, outcome);
                        if applied_id != id {
                            Self::wake_writer(&state, applied_id);
                        }
                    }
                    Self::wake_next_combiner(&state);
                    continue;
                }
                let (next, waited) = Shared::wait_until(&waker, state, session.until);
                state = next;
                if let Some(ended) = waited {
                    if !ended.timed_out() && state.combining && !state.outcomes.contains_key(&id) {
                        state.idle_write_wakes += 1;
                    }
                    continue;
                }
                state.write_wakers.remove(&id);
                if let Some(at) = state.queued.iter().position(|(q, _)| *q == id) {
                    // Not begun: withdrawn, so the error is the whole truth. Had this
                    // caller been woken to apply the next batch, another one does.
                    state.queued.remove(at);
                    Self::wake_next_combiner(&state);
                } else if !state.outcomes.contains_key(&id) {
                    // In the batch being applied: it may yet be committed (as a write
                    // whose durable commit outlasts the caller's time).
                    state.abandoned.insert(id);
                } else {
                    // Applied after all, just in time: its outcome stands.
                    continue;
                }
                return Err(shared.waited_too_long("the writes queued before this one"));
            }
        })
    }

    /// Wakes the caller of queued write `id` (its outcome is ready, or it is to apply
    /// the next batch).
    fn wake_writer(state: &SharedState, id: u64) {
        if let Some(waker) = state.write_wakers.get(&id) {
            waker.notify_one();
        }
    }

    /// When no batch is being applied and writes are queued, wakes the caller of the
    /// first: it applies them all.
    fn wake_next_combiner(state: &SharedState) {
        if !state.combining
            && let Some((first, _)) = state.queued.first()
        {
            Self::wake_writer(state, *first);
        }
    }

    /// Applies a batch of queued writes in one write transaction, in their order, and
    /// commits it: one outcome per write. A write refused for a conflict changes nothing
    /// and leaves the others to go on; any other failure fails them all.
    fn apply_batch(
        &self,
        session: &Session,
        mut batch: Vec<(u64, VolumeWrite)>,
    ) -> Vec<WriteOutcome> {
        let writes = batch.len();
        let fail_all = |e: &StoreError| -> Vec<WriteOutcome> {
            (0..writes).map(|_| (Err(copy_error(e)), None)).collect()
        };
        let txn = match session.write() {
            Ok(txn) => txn,
            Err(e) => return fail_all(&e),
        };
        let mut results = Vec::with_capacity(writes);
        let mut changed = false;
        let applied = (|| {
            let mut table = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
            let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
            for (_, write) in &mut batch {
                match self.apply_one(&mut table, &mut meta, write) {
                    Ok((result, changes)) => {
                        changed |= changes;
                        results.push(Ok(result));
                    }
                    Err(conflict @ StoreError::Conflict { .. }) => results.push(Err(conflict)),
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })();
        if let Err(e) = applied {
            return fail_all(&e); // the transaction aborts as `txn` drops
        }
        if !changed {
            // Nothing to commit: the reads behind these answers are made durable by
            // `with_db` if they need to be.
            return results.into_iter().map(|r| (r, None)).collect();
        }
        if let Err(e) = session.commit(txn) {
            return fail_all(&e);
        }
        let ticket = session.ticket.get();
        results.into_iter().map(|r| (r, ticket)).collect()
    }

    /// One queued write inside the batch's transaction: a put's new revision, and whether
    /// it changed anything (a conflict changes nothing). A put's record takes its new
    /// revision in place (the batch is the record's last use).
    fn apply_one(
        &self,
        table: &mut redb::Table<&str, &[u8]>,
        meta: &mut redb::Table<&str, u64>,
        write: &mut VolumeWrite,
    ) -> Result<(Option<String>, bool), StoreError> {
        match write {
            VolumeWrite::Put(record) => {
                let stored = self.stored_revision(table, &record.volume_id)?;
                if stored != record.revision {
                    return Err(StoreError::Conflict {
                        volume_id: record.volume_id.clone(),
                    });
                }
                let next = self.last_revision(meta, table)? + 1;
                meta.insert(REVISION_KEY, next).map_err(|e| self.err(e))?;
                record.revision = Some(next.to_string());
                let bytes = serde_json::to_vec(&*record).map_err(|e| self.err(e))?;
                table
                    .insert(record.volume_id.as_str(), bytes.as_slice())
                    .map_err(|e| self.err(e))?;
                Ok((record.revision.clone(), true))
            }
            VolumeWrite::Delete(record) => {
                let stored = self.stored_revision(table, &record.volume_id)?;
                match (&stored, &record.revision) {
                    (None, _) => return Ok((None, false)),
                    (Some(s), Some(r)) if s != r => {
                        return Err(StoreError::Conflict {
                            volume_id: record.volume_id.clone(),
                        });
                    }
                    _ => {}
                }
                // Keep the revision being deleted counted (it matters only for a file
                // from before the counter, where it would otherwise be forgotten).
                let last = self.last_revision(meta, table)?;
                meta.insert(REVISION_KEY, last).map_err(|e| self.err(e))?;
                table
                    .remove(record.volume_id.as_str())
                    .map_err(|e| self.err(e))?;
                Ok((None, true))
            }
        }
    }

    fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.read()?;
            let table = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
            let mut out = Vec::new();
            for entry in table.iter().map_err(|e| self.err(e))? {
                let (k, v) = entry.map_err(|e| self.err(e))?;
                // One unreadable record must not stop the sweep and the signing pass for
                // every other volume: it is reported and left out.
                match self.decode(v.value()) {
                    Ok(record) => out.push(record),
                    Err(error) => tracing::warn!(
                        volume_id = k.value(),
                        %error,
                        "leaving an unreadable record out of the list"
                    ),
                }
            }
            Ok(out)
        })
    }
}

/// Snapshot records, in their own table of the same file.
impl EmbeddedStore {
    fn decode_snapshot(&self, bytes: &[u8]) -> Result<SnapshotRecord, StoreError> {
        let mut record: SnapshotRecord = serde_json::from_slice(bytes)
            .map_err(|e| self.err(format!("corrupt snapshot record: {e}")))?;
        record.revision.get_or_insert_with(|| "0".into());
        Ok(record)
    }

    fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.read()?;
            let table = match txn.open_table(SNAPSHOTS) {
                Ok(table) => table,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(self.err(e)),
            };
            match table.get(snapshot_id).map_err(|e| self.err(e))? {
                Some(v) => self.decode_snapshot(v.value()).map(Some),
                None => Ok(None),
            }
        })
    }

    /// The revision the snapshot is stored at, inside a write transaction.
    fn stored_snapshot_revision(
        &self,
        table: &redb::Table<&str, &[u8]>,
        snapshot_id: &str,
    ) -> Result<Option<String>, StoreError> {
        let stored = table.get(snapshot_id).map_err(|e| self.err(e))?;
        stored
            .map(|v| {
                self.decode_snapshot(v.value())
                    .map(|r| r.revision.unwrap_or_default())
            })
            .transpose()
    }

    fn put_snapshot(&self, record: &SnapshotRecord) -> Result<String, StoreError> {
        self.with_db(|db| {
            let txn = db.write()?;
            let revision = {
                let mut table = txn.open_table(SNAPSHOTS).map_err(|e| self.err(e))?;
                let stored = self.stored_snapshot_revision(&table, &record.snapshot_id)?;
                if stored != record.revision {
                    return Err(StoreError::Conflict {
                        volume_id: record.snapshot_id.clone(),
                    });
                }
                let volumes = txn.open_table(VOLUMES).map_err(|e| self.err(e))?;
                let mut meta = txn.open_table(META).map_err(|e| self.err(e))?;
                let next = self.last_revision(&meta, &volumes)? + 1;
                meta.insert(REVISION_KEY, next).map_err(|e| self.err(e))?;
                let mut copy = record.clone();
                copy.revision = Some(next.to_string());
                let bytes = serde_json::to_vec(&copy).map_err(|e| self.err(e))?;
                table
                    .insert(record.snapshot_id.as_str(), bytes.as_slice())
                    .map_err(|e| self.err(e))?;
                next.to_string()
            };
            db.commit(txn)?;
            Ok(revision)
        })
    }

    fn delete_snapshot(&self, record: &SnapshotRecord) -> Result<(), StoreError> {
        self.with_db(|db| {
            let txn = db.write()?;
            {
                let mut table = txn.open_table(SNAPSHOTS).map_err(|e| self.err(e))?;
                let stored = self.stored_snapshot_revision(&table, &record.snapshot_id)?;
                match (&stored, &record.revision) {
                    (None, _) => return Ok(()),
                    (Some(s), Some(r)) if s != r => {
                        return Err(StoreError::Conflict {
                            volume_id: record.snapshot_id.clone(),
                        });
                    }
                    _ => {}
                }
                table
                    .remove(record.snapshot_id.as_str())
                    .map_err(|e| self.err(e))?;
            }
            db.commit(txn)
        })
    }

    fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError> {
        self.with_db(|db| {
            let txn = db.read()?;
            let table = match txn.open_table(SNAPSHOTS) {
                Ok(table) => table,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(self.err(e)),
            };
            let mut out = Vec::new();
            for entry in table.iter().map_err(|e| self.err(e))? {
                let (k, v) = entry.map_err(|e| self.err(e))?;
                match self.decode_snapshot(v.value()) {
                    Ok(record) => out.push(record),
                    Err(error) => tracing::warn!(
                        snapshot_id = k.value(),
                        %error,
                        "leaving an unreadable snapshot record out of the list"
                    ),
                }
            }
            Ok(out)
        })
    }
}

#[async_trait]
impl SnapshotStore for Arc<EmbeddedStore> {
    async fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotRecord>, StoreError> {
        let (s, id) = (self.clone(), snapshot_id.to_string());
        blocking(move || EmbeddedStore::get_snapshot(&s, &id)).await
    }

    async fn put_snapshot(&self, record: &mut SnapshotRecord) -> Result<(), StoreError> {
        let (s, copy) = (self.clone(), record.clone());
        record.revision = Some(blocking(move || EmbeddedStore::put_snapshot(&s, &copy)).await?);
        Ok(())
    }

    async fn delete_snapshot(&self, record: &SnapshotRecord) -> Result<(), StoreError> {
        let (s, copy) = (self.clone(), record.clone());
        blocking(move || EmbeddedStore::delete_snapshot(&s, &copy)).await
    }

    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>, StoreError> {
        let s = self.clone();
        blocking(move || EmbeddedStore::list_snapshots(&s)).await
    }

    fn locate_snapshot(&self, snapshot_id: &str) -> String {
        format!(
            "the record of snapshot {snapshot_id:?} in {}",
            self.path.display()
        )
    }
}

/// The async face of the store: a list (long at 100,000 records) on a blocking thread,
/// the other operations where `crate::blocking::wait_for_disk` puts them.
#[async_trait]
impl ControllerStore for Arc<EmbeddedStore> {
    async fn get(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        let (s, id) = (self.clone(), volume_id.to_string());
        wait_for_disk(move || EmbeddedStore::get(&s, &id)).await
    }

    async fn put(&self, record: &mut VolumeRecord) -> Result<(), StoreError> {
        let (s, copy) = (self.clone(), record.clone());
        record.revision = Some(wait_for_disk(move || EmbeddedStore::put(&s, &copy)).await?);
        Ok(())
    }

    async fn delete(&self, record: &VolumeRecord) -> Result<(), StoreError> {
        let (s, copy) = (self.clone(), record.clone());
        wait_for_disk(move || EmbeddedStore::delete(&s, &copy)).await
    }

    async fn list(&self) -> Result<Vec<VolumeRecord>, StoreError> {
        let s = self.clone();
        blocking(move || EmbeddedStore::list(&s)).await
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// The same error for each caller of a failed batch (a `StoreError` holds its source
/// boxed, so it is rebuilt from its text).
fn copy_error(e: &StoreError) -> StoreError {
    match e {
        StoreError::Conflict { volume_id } => StoreError::Conflict {
            volume_id: volume_id.clone(),
        },
        StoreError::Backend {
            store,
            action,
            transient,
            source,
        } => StoreError::Backend {
            store: store.clone(),
            action: action.clone(),
            transient: *transient,
            source: source.to_string().into(),
        },
        StoreError::Corrupt {
            store,
            what,
            message,
        } => StoreError::Corrupt {
            store: store.clone(),
            what: what.clone(),
            message: message.clone(),
        },
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    crate::blocking::on_blocking_thread(f).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::records::VolumeState;
    use crate::system::now_secs;
    use std::collections::BTreeMap;

    /// Store files whose durable commits fail, for the tests of a failed group commit.
    static FAILING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    pub(super) fn failing_durable_commit(path: &Path) -> Option<&'static str> {
        let failing = FAILING.lock().unwrap_or_else(|p| p.into_inner());
        failing
            .iter()
            .any(|p| p == path)
            .then_some("injected: the durable commit failed")
    }

    /// Store files whose durable commits wait until this many volume writes are queued.
    static HELD: Mutex<Vec<(PathBuf, u64)>> = Mutex::new(Vec::new());

    pub(super) fn durable_commit_waits_for(path: &Path) -> Option<u64> {
        let held = HELD.lock().unwrap_or_else(|p| p.into_inner());
        held.iter().find(|(p, _)| p == path).map(|(_, n)| *n)
    }

    fn record(id: &str) -> VolumeRecord {
        VolumeRecord {
            volume_id: id.into(),
            csi_name: format!("cube-{id}"),
            state: VolumeState::Created,
            csi_volume_id: Some(format!("h-{id}")),
            volume_context: BTreeMap::from([("k".into(), "v".into())]),
            capacity_bytes: 0,
            updated_at: now_secs(),
            csi_driver: None,
            deletion: None,
            revision: None,
            integrity: None,
            content_source: None,
            accessible_topology: Vec::new(),
            node_expansion_required: false,
            answering_creates: Vec::new(),
        }
    }

    fn snapshot(id: &str) -> SnapshotRecord {
        SnapshotRecord {
            snapshot_id: id.into(),
            csi_name: format!("cube-snap-{id}"),
            csi_driver: "d".into(),
            source_volume_id: "v".into(),
            source_csi_volume_id: "h-v".into(),
            state: VolumeState::Creating,
            csi_snapshot_id: None,
            size_bytes: 0,
            creation_time: 0,
            ready_to_use: false,
            updated_at: now_secs(),
            revision: None,
            integrity: None,
        }
    }

    /// Snapshots keep their own records beside the volumes', with the same revisions
    /// (a file from before snapshots simply has none), and a volume of the same name is
    /// another record.
    #[tokio::test]
    async fn snapshot_records_round_trip_beside_volumes_and_conflict_like_them() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap());
        assert!(store.list_snapshots().await.unwrap().is_empty());
        assert!(store.get_snapshot("s").await.unwrap().is_none());
        let mut volume = record("s");
        ControllerStore::put(&store, &mut volume).await.unwrap();
        let mut snap = snapshot("s");
        store.put_snapshot(&mut snap).await.unwrap();
        assert_ne!(snap.revision, volume.revision, "one store-wide counter");
        let stale = snap.clone();
        snap.state = VolumeState::Created;
        snap.csi_snapshot_id = Some("cs".into());
        store.put_snapshot(&mut snap).await.unwrap();
        let mut lost = stale.clone();
        assert!(matches!(
            store.put_snapshot(&mut lost).await,
            Err(StoreError::Conflict { .. })
        ));
        assert!(matches!(
            store.delete_snapshot(&stale).await,
            Err(StoreError::Conflict { .. })
        ));
        // A new handle on the same file (another process) reads what was written.
        let again = Arc::new(EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap());
        assert_eq!(again.get_snapshot("s").await.unwrap(), Some(snap.clone()));
        assert_eq!(again.list_snapshots().await.unwrap(), vec![snap.clone()]);
        assert_eq!(ControllerStore::list(&again).await.unwrap().len(), 1);
        again.delete_snapshot(&snap).await.unwrap();
        again.delete_snapshot(&snap).await.unwrap();
        assert!(store.get_snapshot("s").await.unwrap().is_none());
        assert!(ControllerStore::get(&store, "s").await.unwrap().is_some());
    }

    /// A damaged file is an error of the store's calls, never a panic of the process:
    /// redb panics on some damage (here every page past the header zeroed: "Invalid page
    /// type byte 0"), and a panic took the whole daemon down.
    #[test]
    fn a_damaged_file_is_an_error_not_a_panic() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("controller.redb");
        std::fs::write(&path, b"not a redb file").unwrap();
        let error = EmbeddedStore::open(&path).unwrap_err().to_string();
        assert!(error.contains(&path.display().to_string()), "{error}");

        let path = tmp.path().join("zeroed.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        store.put(&record("v1")).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096..].fill(0);
        std::fs::write(&path, bytes).unwrap();
        let outcome =
            std::panic::catch_unwind(|| EmbeddedStore::open(&path).and_then(|store| store.list()));
        let error = outcome
            .expect("the store's own call, not the caller, meets redb's panic")
            .unwrap_err()
            .to_string();
        assert!(error.contains(&path.display().to_string()), "{error}");
    }

    /// A record copied by hand under another volume's key is refused, not handed out as
    /// that volume's (its MAC names the volume it was written for, so it would verify).
    #[test]
    fn a_record_stored_under_another_volumes_key_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("controller.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        store.put(&record("w")).unwrap();
        drop(store);
        {
            let db = redb::Database::open(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(VOLUMES).unwrap();
                let bytes = table.get("w").unwrap().unwrap().value().to_vec();
                table.insert("v", bytes.as_slice()).unwrap();
            }
            txn.commit().unwrap();
        }
        let store = EmbeddedStore::open(&path).unwrap();
        let error = store.get("v").unwrap_err().to_string();
        assert!(
            error.contains("stored under volume \"v\"") && error.contains("records volume \"w\""),
            "{error}"
        );
        assert_eq!(store.get("w").unwrap().unwrap().volume_id, "w");
    }

    #[test]
    fn crud_round_trip_and_reopen() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s/controller.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        assert_eq!(store.get("a").unwrap(), None);
        assert_eq!(store.put(&record("a")).unwrap(), "1");
        store.put(&record("b")).unwrap();
        let got = store.get("a").unwrap().unwrap();
        assert_eq!(got.csi_volume_id.as_deref(), Some("h-a"));
        assert_eq!(got.state, VolumeState::Created);
        assert_eq!(got.revision.as_deref(), Some("1"));
        drop(store);
        let store = EmbeddedStore::open(&path).unwrap();
        assert_eq!(store.list().unwrap().len(), 2);
        store.delete(&got).unwrap();
        store.delete(&got).unwrap();
        assert_eq!(store.get("a").unwrap(), None);
    }

    #[test]
    fn an_unreadable_record_is_left_out_of_the_list() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        store.put(&record("good")).unwrap();
        store
            .with_db(|db| {
                let txn = db.write().unwrap();
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert("bad", b"not a record".as_slice())
                    .unwrap();
                db.commit(txn).unwrap();
                Ok(())
            })
            .unwrap();
        let listed: Vec<String> = store
            .list()
            .unwrap()
            .into_iter()
            .map(|r| r.volume_id)
            .collect();
        assert_eq!(listed, ["good"]);
        // Read on its own, it is still an error that names it.
        assert!(store.get("bad").is_err());
    }

    #[test]
    fn stale_writes_and_deletes_conflict() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        store.put(&record("a")).unwrap();
        // A second creator that did not see the first record.
        let conflict = store.put(&record("a")).unwrap_err();
        assert!(
            matches!(conflict, StoreError::Conflict { .. }),
            "{conflict}"
        );
        let mut first = store.get("a").unwrap().unwrap();
        let stale = first.clone();
        first.revision = Some(store.put(&first).unwrap());
        assert_eq!(first.revision.as_deref(), Some("2"));
        assert!(matches!(
            store.put(&stale),
            Err(StoreError::Conflict { .. })
        ));
        assert!(matches!(
            store.delete(&stale),
            Err(StoreError::Conflict { .. })
        ));
        store.delete(&first).unwrap();
        assert_eq!(store.get("a").unwrap(), None);
    }

    /// A copy read before a delete must not match the record created after it (ABA):
    /// a stale sweep would otherwise claim and delete a fresh Create.
    #[test]
    fn a_recreated_record_never_reuses_a_revision() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        let mut stale = record("a");
        stale.revision = Some(store.put(&stale).unwrap());
        store.delete(&stale).unwrap();
        let fresh = store.put(&record("a")).unwrap();
        assert_ne!(Some(fresh.as_str()), stale.revision.as_deref());
        assert!(matches!(
            store.delete(&stale),
            Err(StoreError::Conflict { .. })
        ));
        assert!(matches!(
            store.put(&stale),
            Err(StoreError::Conflict { .. })
        ));
        assert_eq!(store.get("a").unwrap().unwrap().revision, Some(fresh));
    }

    /// A file written by per-record counting: the store-wide counter starts above every
    /// revision already handed out.
    #[test]
    fn the_counter_starts_above_revisions_of_an_older_file() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        let mut old = record("old");
        old.revision = Some("7".into());
        let bytes = serde_json::to_vec(&old).unwrap();
        store
            .with_db(|db| {
                let txn = db.write().unwrap();
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert("old", bytes.as_slice())
                    .unwrap();
                db.commit(txn).unwrap();
                Ok(())
            })
            .unwrap();
        let stale = store.get("old").unwrap().unwrap();
        store.delete(&stale).unwrap();
        let fresh = store.put(&record("old")).unwrap();
        assert!(fresh.parse::<u64>().unwrap() > 7, "{fresh}");
    }

    #[test]
    fn records_from_before_revisions_can_be_updated() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        let legacy = serde_json::to_vec(&record("old")).unwrap();
        store
            .with_db(|db| {
                let txn = db.write().unwrap();
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert("old", legacy.as_slice())
                    .unwrap();
                db.commit(txn).unwrap();
                Ok(())
            })
            .unwrap();
        let mut got = store.get("old").unwrap().unwrap();
        assert_eq!(got.revision.as_deref(), Some("0"));
        got.revision = Some(store.put(&got).unwrap());
        store.delete(&got).unwrap();
        assert_eq!(store.get("old").unwrap(), None);
    }

    #[test]
    fn many_threads_share_one_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("controller.redb");
        EmbeddedStore::open(&path).unwrap();
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let path = path.clone();
                std::thread::spawn(move || {
                    // A separate handle per thread behaves like a separate process.
                    let store = EmbeddedStore::open(&path).unwrap();
                    for i in 0..10 {
                        store.put(&record(&format!("t{t}-{i}"))).unwrap();
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(
            EmbeddedStore::open(&path).unwrap().list().unwrap().len(),
            80
        );
    }

    /// Runs `hold` inside one caller's use of the file, on its own thread, after that
    /// caller wrote `first`; `hold` runs while the caller is still inside, so whoever
    /// calls the store meanwhile joins its opening of the file.
    fn inside_a_caller(
        store: &Arc<EmbeddedStore>,
        first: &str,
        hold: impl FnOnce() + Send + 'static,
    ) -> std::thread::JoinHandle<Result<(), StoreError>> {
        {
            let mut state = store.shared.lock();
            state.share_span = Some(Duration::from_secs(600));
            // `first` must wait for a group commit, for `hold` to overlap it.
            state.sync_lone_writes = false;
        }
        let (store, first) = (store.clone(), record(first));
        let (entered, inside) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || {
            store.with_db(|db| {
                let txn = db.write()?;
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert(
                        first.volume_id.as_str(),
                        serde_json::to_vec(&first).unwrap().as_slice(),
                    )
                    .unwrap();
                db.commit(txn)?;
                entered.send(()).unwrap();
                hold();
                Ok(())
            })
        });
        inside.recv().unwrap();
        handle
    }

    /// Callers that overlap share one opening of the file and one durable commit for
    /// their writes (issue 20: a Create storm paid an open, commit and close per write).
    #[test]
    fn overlapping_callers_share_one_opening_and_one_durable_commit() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c.redb");
        let store = Arc::new(EmbeddedStore::open(&path).unwrap());
        let (opens_before, commits_before) = store.activity();
        let writers = 8;
        // On a fast disk each writer could finish its own durable commit before the next
        // one starts; the first durable commit waits until every write is queued, as
        // on a disk whose sync takes as long as a burst of writes (CI saw 8 for 9).
        let queued_before = store.shared.lock().next_write;
        HELD.lock()
            .unwrap()
            .push((path.clone(), queued_before + writers));
        let for_writers = store.clone();
        let holder = inside_a_caller(&store, "first", move || {
            let threads: Vec<_> = (0..writers)
                .map(|i| {
                    let store = for_writers.clone();
                    std::thread::spawn(move || {
                        EmbeddedStore::put(&store, &record(&format!("v{i}"))).map(drop)
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap().unwrap();
            }
        });
        holder.join().unwrap().unwrap();
        HELD.lock().unwrap().retain(|(p, _)| p != &path);
        let (opens, commits) = store.activity();
        assert_eq!(opens - opens_before, 1, "one opening for all of them");
        assert!(
            commits - commits_before < writers,
            "{} durable commits for {} writes",
            commits - commits_before,
            writers + 1
        );
        // And what they wrote is in the file for a process that opens it afresh.
        drop(store);
        let again = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        assert_eq!(again.list().unwrap().len(), writers as usize + 1);
    }

    /// A write (of volume "first") that takes a batch of its own and, the writer's place
    /// being held, waits inside it; returns its thread and the write id it took.
    fn first_write_applying(
        store: &Arc<EmbeddedStore>,
    ) -> (std::thread::JoinHandle<Result<String, StoreError>>, u64) {
        let queued_before = store.shared.lock().next_write;
        let first = {
            let store = store.clone();
            std::thread::spawn(move || EmbeddedStore::put(&store, &record("first")))
        };
        while !(store.shared.lock().combining && store.shared.lock().next_write > queued_before) {
            std::thread::sleep(Duration::from_millis(1));
        }
        (first, queued_before)
    }

    /// A caller on its own thread that holds the writer's place (as one whose disk stopped
    /// answering would) until the sender is used or dropped; returns once it holds it.
    fn holding_the_writer(
        store: &Arc<EmbeddedStore>,
    ) -> (
        std::thread::JoinHandle<Result<(), StoreError>>,
        std::sync::mpsc::Sender<()>,
    ) {
        let (entered, inside) = std::sync::mpsc::channel();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let store = store.clone();
        let holder = std::thread::spawn(move || {
            store.with_db(|db| {
                let _txn = db.write()?;
                entered.send(()).unwrap();
                let _ = held.recv_timeout(Duration::from_secs(60));
                Ok(())
            })
        });
        inside.recv().unwrap();
        (holder, release)
    }

    /// Writes that queue while another caller applies a batch are applied together: one
    /// write transaction and one commit for all of them (a create storm's writes), and a
    /// write refused for a conflict fails alone.
    #[test]
    fn writes_queued_together_share_one_transaction_and_a_conflict_fails_only_its_own() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap());
        store.shared.lock().share_span = Some(Duration::from_secs(600));
        // The writer's place held, so that the writes queue behind the first of them.
        let (holder, release) = holding_the_writer(&store);
        let (queued_before, batches_before) = {
            let state = store.shared.lock();
            (state.next_write, state.batches)
        };
        // Five new volumes, and two creations of the same one: one of them must lose.
        let names = ["v0", "v1", "v2", "v3", "v4", "twice", "twice"];
        let writers: Vec<_> = names
            .iter()
            .map(|name| {
                let (store, record) = (store.clone(), record(name));
                std::thread::spawn(move || EmbeddedStore::put(&store, &record))
            })
            .collect();
        while store.shared.lock().next_write < queued_before + names.len() as u64 {
            std::thread::sleep(Duration::from_millis(1));
        }
        release.send(()).unwrap();
        holder.join().unwrap().unwrap();
        let results: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
        for result in &results[..5] {
            assert!(result.is_ok(), "{result:?}");
        }
        let twice: Vec<_> = results[5..].iter().collect();
        assert_eq!(
            twice.iter().filter(|r| r.is_ok()).count(),
            1,
            "one creation of the same volume wins: {twice:?}"
        );
        assert!(
            twice
                .iter()
                .any(|r| matches!(r, Err(StoreError::Conflict { .. }))),
            "the other is refused as a conflict: {twice:?}"
        );
        // The first write's batch held only itself (it found no batch running); every
        // write queued behind it went in the next one.
        assert_eq!(
            store.shared.lock().batches - batches_before,
            2,
            "seven writes in two transactions"
        );
        assert_eq!(EmbeddedStore::list(&store).unwrap().len(), 6);
    }

    /// The end of a batch wakes the callers whose writes it applied and the one caller
    /// that applies the next batch, not every caller queued: in a create storm each
    /// batch's end woke every queued caller, to find the next batch taken by one of them
    /// and sleep again. Fails if a batch's end wakes every queued caller.
    #[test]
    fn the_end_of_a_batch_wakes_only_the_callers_it_concerns() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap());
        store.shared.lock().share_span = Some(Duration::from_secs(600));
        let (holder, release) = holding_the_writer(&store);
        let (first, queued_before) = first_write_applying(&store);
        // Six more queue behind it, each asleep until its turn.
        let writers: Vec<_> = (0..6)
            .map(|i| {
                let (store, record) = (store.clone(), record(&format!("v{i}")));
                std::thread::spawn(move || EmbeddedStore::put(&store, &record))
            })
            .collect();
        while store.shared.lock().next_write < queued_before + 7 {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Asleep on their conditions, not about to wait: nothing but a wake-up moves them.
        std::thread::sleep(Duration::from_millis(50));
        release.send(()).unwrap();
        holder.join().unwrap().unwrap();
        first.join().unwrap().unwrap();
        for writer in writers {
            writer.join().unwrap().unwrap();
        }
        assert_eq!(EmbeddedStore::list(&store).unwrap().len(), 7);
        assert_eq!(
            store.shared.lock().idle_write_wakes,
            0,
            "a caller was woken with nothing to do"
        );
    }

    /// A caller whose deadline passes while its write is still queued (another caller's
    /// batch is stuck before it) withdraws the write: it fails with a timeout and is never
    /// written, while the batch before it goes on once unstuck.
    #[test]
    fn a_queued_write_whose_caller_gives_up_is_withdrawn_and_never_written() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap());
        {
            let mut state = store.shared.lock();
            state.share_span = Some(Duration::from_secs(600));
            state.lock_wait = Some(Duration::from_secs(60));
        }
        let (holder, release) = holding_the_writer(&store);
        let (first, _) = first_write_applying(&store);
        // The second queues behind it, with a deadline that passes while it is stuck.
        store.shared.lock().lock_wait = Some(Duration::from_millis(200));
        let second = {
            let store = store.clone();
            std::thread::spawn(move || EmbeddedStore::put(&store, &record("second")))
        };
        match second.join().unwrap() {
            Err(
                error @ StoreError::Backend {
                    transient: true, ..
                },
            ) => assert!(error.to_string().contains("queued before"), "{error}"),
            other => panic!("expected a timeout in the queue, got {other:?}"),
        }
        assert!(store.shared.lock().queued.is_empty(), "withdrawn");
        release.send(()).unwrap();
        holder.join().unwrap().unwrap();
        first.join().unwrap().unwrap();
        assert!(EmbeddedStore::get(&store, "first").unwrap().is_some());
        assert!(EmbeddedStore::get(&store, "second").unwrap().is_none());
    }

    /// A caller that read a write not yet durable does not answer with it before it is
    /// durable: when that durable commit fails, the read fails too, and so does the write.
    #[test]
    fn a_read_of_a_write_not_yet_durable_waits_for_it_and_fails_with_it() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c.redb");
        let store = Arc::new(EmbeddedStore::open(&path).unwrap());
        FAILING.lock().unwrap().push(path.clone());
        let reader = store.clone();
        let (read_tx, read_rx) = std::sync::mpsc::channel();
        let holder = inside_a_caller(&store, "unsynced", move || {
            read_tx
                .send(EmbeddedStore::get(&reader, "unsynced"))
                .unwrap();
        });
        let read = read_rx.recv().unwrap();
        let written = holder.join().unwrap();
        FAILING.lock().unwrap().retain(|p| p != &path);
        assert!(read.is_err(), "answered {read:?} before it was durable");
        assert!(
            written.is_err(),
            "the write the failed commit carried failed"
        );
        // The broken opening was closed; the next caller opens the file afresh and works.
        let (opens_before, _) = store.activity();
        EmbeddedStore::put(&store, &record("after")).unwrap();
        assert_eq!(store.activity().0, opens_before + 1);
        assert!(EmbeddedStore::get(&store, "after").unwrap().is_some());
    }

    /// A write with no other caller to share a group commit with syncs its own commit:
    /// one write transaction, not a write and then an empty durable one (issue 20: a lone
    /// Create paid two commits per store write).
    #[test]
    fn a_lone_write_is_one_durable_commit() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        store.put(&record("warm")).unwrap();
        let before = {
            let state = store.shared.lock();
            (state.write_commits, state.durable_commits)
        };
        store.put(&record("a")).unwrap();
        let state = store.shared.lock();
        assert_eq!(
            (state.write_commits, state.durable_commits),
            (before.0 + 1, before.1 + 1),
            "one write transaction, committed durably"
        );
        assert!(state.synced >= state.issued, "nothing is left to sync");
    }

    /// A lone write whose synced commit fails fails, and breaks the opening like a failed
    /// group commit: the next caller opens the file afresh.
    #[test]
    fn a_lone_write_whose_sync_fails_fails_and_breaks_the_opening() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        FAILING.lock().unwrap().push(path.clone());
        let written = store.put(&record("lost"));
        FAILING.lock().unwrap().retain(|p| p != &path);
        assert!(written.is_err(), "answered {written:?}");
        let (opens_before, _) = store.activity();
        store.get("lost").unwrap();
        assert_eq!(store.activity().0, opens_before + 1, "opened afresh");
    }

    /// A caller that reads while nothing is waiting to be made durable pays no commit.
    #[test]
    fn a_read_with_nothing_unsynced_makes_no_commit() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        store.put(&record("a")).unwrap();
        let (_, commits) = store.activity();
        assert!(store.get("a").unwrap().is_some());
        assert_eq!(store.list().unwrap().len(), 1);
        assert_eq!(store.activity().1, commits);
    }

    /// A process that keeps the file open (`serve`) serves the next caller without
    /// opening it again, and lets it go once idle: another process then gets the lock.
    #[test]
    fn a_file_kept_open_serves_the_next_caller_and_is_closed_when_idle() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c.redb");
        let store = EmbeddedStore::open(&path).unwrap();
        // Long enough that a paused test machine cannot close it between the two callers.
        {
            let mut state = store.shared.lock();
            state.linger = Duration::from_secs(600);
            state.share_span = Some(Duration::from_secs(600));
        }
        let (opens, _) = store.activity();
        store.put(&record("a")).unwrap();
        assert!(
            store.shared.lock().open.is_some(),
            "kept open after its caller"
        );
        store.put(&record("b")).unwrap();
        assert_eq!(
            store.activity().0,
            opens + 1,
            "the second caller found it open"
        );
        // Another process waits for the lock until the file has been idle long enough.
        store.shared.lock().linger = Duration::from_millis(100);
        store.shared.closer.notify_all();
        let other = crate::store::fsutil::lock_exclusive_within(
            &path.with_extension("lock"),
            Duration::from_secs(10),
        )
        .unwrap();
        assert!(store.shared.lock().open.is_none());
        drop(other);
        // And at the end of `serve`, a file kept open is closed at once.
        store.shared.lock().linger = Duration::from_secs(600);
        store.put(&record("c")).unwrap();
        close_idle_files();
        assert!(store.shared.lock().open.is_none());
        assert_eq!(store.list().unwrap().len(), 3);
    }

    /// The end of `serve` closes a file kept open once the caller still inside leaves,
    /// not after its whole wait: that caller's leaving wakes it even though the file is
    /// kept open (before, nothing did, and it gave up with the file left open for redb
    /// to repair at the next opening).
    #[test]
    fn closing_at_the_end_waits_for_the_caller_inside_then_closes() {
        let tmp = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap();
        {
            let mut state = store.shared.lock();
            state.linger = Duration::from_secs(600);
            state.share_span = Some(Duration::from_secs(600));
            // Far longer than the test waits for the closing below.
            state.lock_wait = Some(Duration::from_secs(600));
        }
        store.put(&record("a")).unwrap();
        let store = Arc::new(store);
        let (entered, inside) = std::sync::mpsc::channel();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let caller = {
            let store = store.clone();
            std::thread::spawn(move || {
                store
                    .with_db(|_| {
                        entered.send(()).unwrap();
                        let _ = held.recv_timeout(Duration::from_secs(60));
                        Ok(())
                    })
                    .unwrap();
            })
        };
        inside.recv().unwrap();
        let (closed, done) = std::sync::mpsc::channel();
        {
            let store = store.clone();
            std::thread::spawn(move || {
                store.shared.close_now();
                let _ = closed.send(());
            });
        }
        while store.shared.lock().opening_waiters == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        release.send(()).unwrap();
        caller.join().unwrap();
        // A hang check, not a speed one: unwoken, the closing waits out its 600 s.
        done.recv_timeout(Duration::from_secs(60))
            .expect("the caller's leaving woke the closing");
        assert!(
            store.shared.lock().open.is_none(),
            "closed once its last caller left"
        );
        assert_eq!(EmbeddedStore::list(&store).unwrap().len(), 1);
    }

    /// A caller that hangs inside a write (a disk that stopped answering) holds up the
    /// callers behind it only until their deadline: they get a timeout, not a hang.
    #[test]
    fn callers_behind_a_hung_writer_time_out_instead_of_hanging() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Arc::new(EmbeddedStore::open(&tmp.path().join("c.redb")).unwrap());
        {
            let mut state = store.shared.lock();
            state.share_span = Some(Duration::from_secs(600));
            state.lock_wait = Some(Duration::from_millis(200));
        }
        let (holder, release) = holding_the_writer(&store);
        let (answer_tx, answer) = std::sync::mpsc::channel();
        let behind = store.clone();
        std::thread::spawn(move || {
            answer_tx
                .send(EmbeddedStore::put(&behind, &record("behind")))
                .unwrap()
        });
        let outcome = answer.recv_timeout(Duration::from_secs(30));
        release.send(()).unwrap();
        holder.join().unwrap().unwrap();
        match outcome {
            Ok(Err(
                error @ StoreError::Backend {
                    transient: true, ..
                },
            )) => {
                assert!(
                    error.to_string().contains("write transaction before"),
                    "{error}"
                );
            }
            other => panic!("expected a timeout behind the hung writer, got {other:?}"),
        }
        assert!(EmbeddedStore::get(&store, "behind").unwrap().is_none());
    }
}
