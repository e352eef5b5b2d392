//! Which bridge a state dir belongs to: the first bridge that keeps records there writes
//! its driver name and lock dir into `<state.dir>/owner`, and any other one is refused.
//!
//! Two bridges (separate config files) that named one `state.dir` would read each other's
//! journal records with separate locks and separate CSI drivers: one's scan would tear down
//! the other's in-flight Attach through the wrong driver, and one's Create sweep would
//! delete the other's volumes. The drivers of one config file are kept apart when it is
//! loaded; across files only the state dir itself can tell.

use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The file in the state dir naming its owner.
pub const OWNER_FILE: &str = "owner";

/// Which records a claimer keeps in the dir, and so which CSI endpoint its claim names:
/// a node side's journal is of the volumes of `csi.endpoint`, an embedded controller
/// store's of `csi.controller_endpoint`'s. Each has a file of its own beside `owner`, so
/// that a node-only and a controller-only bridge of one driver may share the dir, and so
/// that `owner` keeps the form every earlier version wrote and checks byte for byte: a
/// binary of an earlier version (a rollback, a forked hook still running through an
/// upgrade) still finds the dir its own, and ignores these files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keeper {
    Node,
    Controller,
}

impl Keeper {
    /// The file naming the CSI endpoint of this keeper's records.
    pub fn endpoint_file(self) -> &'static str {
        match self {
            Keeper::Node => "owner.node_csi_endpoint",
            Keeper::Controller => "owner.controller_csi_endpoint",
        }
    }
}

/// What a state dir's owner files say: the driver served, the lock dir that serializes
/// its hooks, and the CSI driver it calls. The same driver with another lock dir is another
/// owner: its hooks would not exclude this one's. So is one calling another CSI driver
/// (a copied config whose endpoint was changed but not its driver name): its scans would
/// tear this one's volumes down through the wrong driver, whose NOT_FOUND counts as done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner<'a> {
    pub driver: &'a str,
    pub lock_dir: &'a Path,
    /// Whose records, and so which endpoint.
    pub keeper: Keeper,
    /// The endpoint of the CSI driver whose volumes the keeper records, as parsed (so
    /// both spellings of one socket agree).
    pub csi_endpoint: &'a str,
}

impl Owner<'_> {
    /// The owner file's exact bytes. Quoted, so that no name or path can forge a line.
    fn render(&self) -> String {
        format!(
            "driver {:?}\nlock_dir {:?}\n",
            self.driver,
            self.lock_dir.display().to_string()
        )
    }

    /// The endpoint file's exact bytes.
    fn render_endpoint(&self) -> String {
        format!("csi_endpoint {:?}\n", self.csi_endpoint)
    }
}

/// Makes `dir` (0700) if it is missing and claims it for `owner`, or checks that `owner`
/// already has it. Refuses a dir another owner claimed, naming both, with the fix; writes
/// nothing then. Each file of the claim is made whole or not at all (a synced file
/// hard-linked into place, then read back), so two bridges starting at once cannot both
/// win. A dir claimed before claims named the endpoint gets its endpoint file from the
/// first bridge of this version to start.
pub fn claim(dir: &Path, owner: &Owner<'_>) -> io::Result<()> {
    crate::mount::ops::ensure_dir(dir, 0o700)?;
    // Checked again now that it exists, whatever it holds: the caller judged a missing
    // dir by the ones above it, and in a sticky directory such as /tmp another user could
    // make it first, with an owner file saying just what this bridge would write.
    super::fsutil::check_private_dir(dir, "state.dir", STATE_DIR_RISK)?;
    claim_file(dir, OWNER_FILE, &owner.render())?;
    claim_file(dir, owner.keeper.endpoint_file(), &owner.render_endpoint())
}

/// The file in a state dir naming the installation (`state.instance`) that claimed it.
pub const INSTANCE_FILE: &str = "owner.instance";

/// Claims `dir` for installation `instance`, or checks that it is already (a dir claimed
/// before instances were named is claimed by the first one that starts with a name).
/// Two Helm releases of one driver name render the same paths, driver, lock dir and
/// in-container CSI endpoint: only this tells them apart, and one's start-up scan would
/// tear the other's volumes down through its own CSI driver.
pub fn claim_instance(dir: &Path, instance: &str) -> io::Result<()> {
    crate::mount::ops::ensure_dir(dir, 0o700)?;
    super::fsutil::check_private_dir(dir, "state.dir", STATE_DIR_RISK)?;
    claim_file(dir, INSTANCE_FILE, &instance_claim(instance))
}

/// Checks, writing nothing, that no other instance claimed `dir` (a dir not claimed yet
/// passes): run before anything is claimed, so that a refused bridge leaves no claim of
/// its own behind.
pub fn check_instance(dir: &Path, instance: &str) -> io::Result<()> {
    let wanted = instance_claim(instance);
    match other_claim(&dir.join(INSTANCE_FILE), &wanted)? {
        Some(found) => Err(foreign(dir, INSTANCE_FILE, &found, &wanted)),
        None => Ok(()),
    }
}

/// The instance file's exact bytes.
fn instance_claim(instance: &str) -> String {
    format!("instance {instance:?}\n")
}

/// The file in a lock dir naming the state dir of driver `driver`'s bridge, whose hooks
/// it serializes. One per driver: drivers of separate config files may share a lock dir
/// (each volume's lock is its own), one driver's two bridges may not.
fn lock_dir_claim_file(driver: &str) -> String {
    format!("state_dir.{driver}")
}

/// What the lock dir's claim says of `state_dir`: as the kernel would name the dir, not as
/// written (a trailing `/`, a doubled `/` are one dir).
fn lock_dir_claim(state_dir: &Path) -> io::Result<String> {
    let normal: std::path::PathBuf = std::path::absolute(state_dir)?.components().collect();
    Ok(format!("state_dir {normal:?}\n"))
}

/// Claims `lock_dir` for driver `driver`'s bridge whose records are in `state_dir`, or
/// checks that it is already: the state dir's owner file names its lock dir, and this
/// names the other way. Two bridges of one driver (a second config file, for the forked
/// hook or after a switch between rpc and binary) with separate state dirs would
/// otherwise share the lock dir and the volumes' paths under Cube's base dir: a Detach
/// reaching the one that did not Attach tears the mount down from Cube's metadata, while
/// the other one's journal still holds the volume and mounts it again at its next start,
/// for nobody. The default lock dir is on a tmpfs: the claim is made again at each boot,
/// by whichever of two such bridges starts first (the other is refused as loudly).
pub fn claim_lock_dir(lock_dir: &Path, driver: &str, state_dir: &Path) -> io::Result<()> {
    let name = lock_dir_claim_file(driver);
    let wanted = lock_dir_claim(state_dir)?;
    claim_file(lock_dir, &name, &wanted).map_err(|e| {
        if e.kind() != io::ErrorKind::AlreadyExists {
            return e;
        }
        let found = read_claim(&lock_dir.join(&name))
            .ok()
            .flatten()
            .unwrap_or_default();
        lock_dir_refusal(lock_dir, driver, &name, &wanted, &found)
    })
}

/// Checks, writing nothing, that `lock_dir` is not claimed for another state dir of
/// `driver` (a lock dir not made or not claimed yet passes): run before anything is
/// claimed, so that a refused bridge leaves no claim of its own behind.
pub fn check_lock_dir(lock_dir: &Path, driver: &str, state_dir: &Path) -> io::Result<()> {
    // Whose dir it is, before anything in it is read (`FileLocks::new` checks it again
    // once it is made): another user's could hold anything under the claim's name.
    super::fsutil::check_private_dir(lock_dir, "state.lock_dir", super::locks::LOCK_DIR_RISK)?;
    let name = lock_dir_claim_file(driver);
    let wanted = lock_dir_claim(state_dir)?;
    match other_claim(&lock_dir.join(&name), &wanted)? {
        Some(found) => Err(lock_dir_refusal(lock_dir, driver, &name, &wanted, &found)),
        None => Ok(()),
    }
}

/// Why `lock_dir` is refused: its claim `name` says `found`, not `wanted`.
fn lock_dir_refusal(
    lock_dir: &Path,
    driver: &str,
    name: &str,
    wanted: &str,
    found: &[u8],
) -> io::Error {
    let path = lock_dir.join(name);
    io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!(
            "lock dir {} serializes the hooks of another bridge of driver {driver:?} ({} says \
             {}; this one's is {}): two bridges of one driver with separate state dirs would \
             each tear down the volumes the other attached, and mount them again for nobody. \
             Point both configs (the daemon's and the forked hook's) at one state.dir, or \
             give each its own state.lock_dir; if the state dir moved on purpose, stop every \
             bridge of this driver and remove {}",
            lock_dir.display(),
            path.display(),
            String::from_utf8_lossy(found).trim_end(),
            wanted.trim_end(),
            path.display(),
        ),
    )
}

/// Checks, writing nothing, that no other owner claimed `dir` (a dir not claimed yet
/// passes): what a command that only reads the state checks.
pub fn check_claimed(dir: &Path, owner: &Owner<'_>) -> io::Result<()> {
    for (name, wanted) in [
        (OWNER_FILE, owner.render()),
        (owner.keeper.endpoint_file(), owner.render_endpoint()),
    ] {
        if let Some(found) = other_claim(&dir.join(name), &wanted)? {
            return Err(foreign(dir, name, &found, &wanted));
        }
    }
    Ok(())
}

/// Checks that `dir/name` says `wanted`, or, when there is no such file, places one that
/// does (refusing one another bridge placed meanwhile).
fn claim_file(dir: &Path, name: &str, wanted: &str) -> io::Result<()> {
    let path = dir.join(name);
    match read_claim(&path)? {
        Some(found) if found == wanted.as_bytes() => return Ok(()),
        Some(found) => return Err(foreign(dir, name, &found, wanted)),
        None => {}
    }
    match place_claim(dir, name, wanted) {
        Ok(()) => confirm_claim(dir, name, wanted),
        // Another bridge claimed it between the read and the link: whose is it?
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => match read_claim(&path)? {
            Some(found) if found == wanted.as_bytes() => Ok(()),
            Some(found) => Err(foreign(dir, name, &found, wanted)),
            None => Err(e),
        },
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("claiming state.dir {}: {e}", dir.display()),
        )),
    }
}

/// Writes `wanted` to a synced file made afresh (`O_EXCL`) under a name no other claimer
/// uses and hard-links it at `dir/name` (`AlreadyExists` when one is there); the temporary
/// name is gone afterwards.
fn place_claim(dir: &Path, name: &str, wanted: &str) -> io::Result<()> {
    let (tmp, mut file) = fresh_tmp(dir)?;
    let placed = (|| {
        file.write_all(wanted.as_bytes())?;
        file.sync_data()?;
        std::fs::hard_link(&tmp, dir.join(name))
    })();
    let _ = std::fs::remove_file(&tmp);
    placed
}

/// A temporary file made afresh in `dir` under a name no other claimer uses (pid, time,
/// a count; another name if one is taken): with the pid alone, two claimers of one pid
/// number (each the PID 1 of its container) opened one file, and the one that wrote last
/// had its text linked as the other's claim.
fn fresh_tmp(dir: &Path) -> io::Result<(std::path::PathBuf, std::fs::File)> {
    static CLAIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut tries = 0;
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let tmp = dir.join(format!(
            ".{OWNER_FILE}.{}.{nanos}.{}.tmp",
            std::process::id(),
            CLAIMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&tmp);
        match opened {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 8 => tries += 1,
            // Not the claim's AlreadyExists: no one else's temporary is removed.
            Err(e) => {
                return Err(io::Error::other(format!(
                    "making a temporary file in state.dir {}: {e}",
                    dir.display()
                )));
            }
        }
    }
}

/// What was placed is what is there now: read back, not assumed.
fn confirm_claim(dir: &Path, name: &str, wanted: &str) -> io::Result<()> {
    match read_claim(&dir.join(name))? {
        Some(now) if now == wanted.as_bytes() => Ok(()),
        Some(now) => Err(foreign(dir, name, &now, wanted)),
        None => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("claiming state.dir {}: {name} vanished", dir.display()),
        )),
    }
}

/// What another user who could write `state.dir` could do: the risk `check_private_dir`
/// names when it refuses one.
pub const STATE_DIR_RISK: &str = "rewrite the records the bridge acts on as root (what it \
     unmounts, removes and deletes) or plant a file there for it to open";

/// What the claim at `path` says when it is there and says other than `wanted`.
fn other_claim(path: &Path, wanted: &str) -> io::Result<Option<Vec<u8>>> {
    Ok(read_claim(path)?.filter(|found| found != wanted.as_bytes()))
}

/// The owner file's bytes (at most 4 KiB), `None` when there is none yet. Never through a
/// symlink.
fn read_claim(path: &Path) -> io::Result<Option<Vec<u8>>> {
    // Non-blocking: a FIFO at the name would hold the open until someone writes it.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path);
    let file = match file {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("reading {}: {e}", path.display()),
            ));
        }
    };
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is not a plain file: no bridge made it; remove it",
                path.display()
            ),
        ));
    }
    let mut found = Vec::new();
    file.take(4096).read_to_end(&mut found)?;
    Ok(Some(found))
}

fn foreign(dir: &Path, name: &str, found: &[u8], wanted: &str) -> io::Error {
    let says = |text: &str| text.trim_end().replace('\n', ", ");
    io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!(
            "state.dir {} belongs to another bridge ({} says {}; this one is {}): two \
             bridges sharing a state dir would act on each other's volumes through the \
             wrong driver and locks. Give each driver its own state.dir (the default is \
             /var/lib/cube-csi-bridge/<driver>), and a config copied for another CSI driver \
             its own driver name; if this is the same bridge with its driver, state.lock_dir \
             or CSI endpoint changed on purpose, stop every bridge using the dir and remove \
             {}",
            dir.display(),
            dir.join(name).display(),
            says(&String::from_utf8_lossy(found)),
            says(wanted),
            dir.join(name).display(),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner<'a>(driver: &'a str, lock_dir: &'a Path) -> Owner<'a> {
        Owner {
            driver,
            lock_dir,
            keeper: Keeper::Node,
            csi_endpoint: "unix:///csi/csi.sock",
        }
    }

    #[test]
    fn the_first_bridge_claims_the_dir_and_another_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let locks = tmp.path().join("locks");
        claim(&dir, &owner("nfs", &locks)).unwrap();
        claim(&dir, &owner("nfs", &locks)).unwrap();
        let claimed = std::fs::read(dir.join(OWNER_FILE)).unwrap();

        for (driver, lock_dir) in [("local", locks.clone()), ("nfs", tmp.path().join("other"))] {
            let err = claim(&dir, &owner(driver, &lock_dir)).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
            let text = err.to_string();
            assert!(
                text.contains("belongs to another bridge")
                    && text.contains("driver \"nfs\"")
                    && text.contains(&format!("driver {driver:?}"))
                    && text.contains("own state.dir"),
                "{text}"
            );
            assert_eq!(std::fs::read(dir.join(OWNER_FILE)).unwrap(), claimed);
        }
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 2, "a temporary file was left: {left:?}");
    }

    /// A config copied for another CSI driver whose driver name was left as it was
    /// (same driver, same lock dir, another `csi.endpoint`) is another owner, refused with
    /// the fix; before, the claim matched and both shared one journal. A dir claimed
    /// before claims named the endpoint (an `owner` file alone) is this bridge's, and gets
    /// its endpoint file; `owner` keeps the form an earlier version reads back byte for
    /// byte, so a rollback still starts.
    #[test]
    fn another_csi_endpoint_is_another_owner_and_an_older_claim_is_completed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let locks = tmp.path().join("locks");
        let ours = owner("local", &locks);
        // What every earlier version wrote, and reads back.
        let earlier = format!(
            "driver {:?}\nlock_dir {:?}\n",
            "local",
            locks.display().to_string()
        );
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(OWNER_FILE), &earlier).unwrap();
        claim(&dir, &ours).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join(OWNER_FILE)).unwrap(),
            earlier
        );
        assert_eq!(
            std::fs::read_to_string(dir.join(Keeper::Node.endpoint_file())).unwrap(),
            "csi_endpoint \"unix:///csi/csi.sock\"\n"
        );
        let copied = Owner {
            csi_endpoint: "unix:///nfs/csi.sock",
            ..ours.clone()
        };
        let err = claim(&dir, &copied).unwrap_err().to_string();
        assert!(
            err.contains("belongs to another bridge")
                && err.contains("/nfs/csi.sock")
                && err.contains(Keeper::Node.endpoint_file()),
            "{err}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join(Keeper::Node.endpoint_file())).unwrap(),
            ours.render_endpoint()
        );
        claim(&dir, &ours).unwrap();
        // A controller-only bridge of the same driver, whose records are of another
        // endpoint's volumes (its controller's), shares the dir: its claim is its own.
        let controller = Owner {
            keeper: Keeper::Controller,
            csi_endpoint: "unix:///csi/controller.sock",
            ..ours.clone()
        };
        claim(&dir, &controller).unwrap();
        claim(&dir, &ours).unwrap();
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 3, "a temporary file was left: {left:?}");
    }

    /// Two bridges claiming a fresh dir at once (threads of one process: one pid, as two
    /// containers' PID 1s have): never both win, and the one that wins is what the file
    /// says.
    #[test]
    fn two_claims_at_once_never_both_win() {
        let tmp = tempfile::tempdir().unwrap();
        for round in 0..300 {
            let dir = tmp.path().join(format!("state-{round}"));
            let (short, long) = (tmp.path().join("l"), tmp.path().join("much-longer-locks"));
            let start = std::sync::Barrier::new(2);
            let (a, b) = std::thread::scope(|s| {
                let a = s.spawn(|| {
                    start.wait();
                    claim(&dir, &owner("nfs", &short)).is_ok()
                });
                let b = s.spawn(|| {
                    start.wait();
                    claim(&dir, &owner("nfs", &long)).is_ok()
                });
                (a.join().unwrap(), b.join().unwrap())
            });
            assert!(!(a && b), "round {round}: both claims won");
            let file = std::fs::read_to_string(dir.join(OWNER_FILE)).unwrap();
            let winner = if a { &short } else { &long };
            assert!(
                !(a || b) || file.contains(&format!("{:?}", winner.display().to_string())),
                "round {round}: the winner is not what the file says: {file}"
            );
        }
    }

    #[test]
    fn a_name_cannot_forge_a_line_of_the_claim() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let locks = tmp.path().join("locks");
        let forged = format!("x\"\nlock_dir {:?}", locks.display().to_string());
        claim(&dir, &owner(&forged, tmp.path())).unwrap();
        assert!(claim(&dir, &owner("x", &locks)).is_err());
    }

    /// Another user who made the state dir between the bridge's check (when it did not
    /// exist yet) and its creation gets nothing written into it. Needs root.
    #[test]
    fn a_state_dir_another_user_made_first_is_refused() {
        if !crate::testing::as_root("give a directory to another user") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(1000), Some(1000)).unwrap();
        let err = claim(&dir, &owner("nfs", tmp.path())).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("uid 1000"), "{err}");
        assert!(
            std::fs::read_dir(&dir).unwrap().next().is_none(),
            "written into it"
        );
    }

    #[test]
    fn a_state_dir_another_user_made_with_a_matching_claim_is_refused() {
        if !crate::testing::as_root("give a directory to another user") {
            return;
        }
        // The claim's bytes are predictable (driver and lock dir): one another user wrote
        // into a dir of theirs must not make it this bridge's.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        let owner = owner("nfs", tmp.path());
        std::fs::write(dir.join(OWNER_FILE), owner.render()).unwrap();
        std::fs::write(
            dir.join(owner.keeper.endpoint_file()),
            owner.render_endpoint(),
        )
        .unwrap();
        std::os::unix::fs::chown(&dir, Some(1000), Some(1000)).unwrap();
        let err = claim(&dir, &owner).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        assert!(err.to_string().contains("uid 1000"), "{err}");
    }

    #[test]
    fn a_symlink_at_the_owner_file_is_refused_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, dir.join(OWNER_FILE)).unwrap();
        assert!(claim(&dir, &owner("nfs", tmp.path())).is_err());
        assert!(!elsewhere.exists(), "a file was made through the link");
    }

    /// A FIFO at a claim's name (planted in a lock dir another user made first) was
    /// opened blocking: every start and every forked hook hung in `open`. A claim that is
    /// not a plain file is refused, and a lock dir another user owns is refused before
    /// anything in it is read.
    #[test]
    fn a_claim_that_is_not_a_plain_file_is_refused_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let locks = tmp.path().join("locks");
        std::fs::create_dir(&locks).unwrap();
        nix::unistd::mkfifo(
            &locks.join("state_dir.fk"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        let state = tmp.path().join("state");
        std::thread::spawn(move || {
            let _ = done.send(check_lock_dir(&locks, "fk", &state));
        });
        let checked = finished
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the check hung on a FIFO");
        let error = checked.unwrap_err().to_string();
        assert!(error.contains("not a plain file"), "{error}");
    }
}
