//! Controller records are not blindly trusted: every record the bridge writes carries an
//! HMAC-SHA256, keyed by a secret only the bridge holds, over the fields Destroy and the
//! abandoned-create sweep act on. A record edited by hand (a CubeVolume pointed at another
//! CSI handle, another driver, another deletion secret) no longer verifies, and the bridge
//! refuses to send DeleteVolume for it.
//!
//! The key lives beside the embedded store (`state.dir/record.key`, mode 0600) or, with
//! CubeVolume records, in a Kubernetes Secret that every controller replica reads (k8s/).
//! It is made on first use, and never while signed records exist (a lost key is restored,
//! not replaced). Records written before records carried a MAC are signed once, when the
//! key is made, only where making it proves no key existed before (the embedded store's
//! root-only directory; trust on first use). Otherwise an unsigned record is refused like
//! a forged one until the operator names it in `controller.sign_unsigned_records`: a
//! blanket re-sign would launder records forged after someone removed the key.

use std::fmt;

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::BridgeError;
use super::records::{ContentSource, SnapshotRecord, VolumeRecord, VolumeState};

/// Bytes of a record key.
pub const KEY_LEN: usize = 32;
/// How a MAC is written in a record: `hmac-sha256-v1:<64 hex digits>`. The version names
/// the set of fields covered (see `mac_input`).
const MAC_PREFIX: &str = "hmac-sha256-v1:";

/// The secret records are signed with. Debug never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct RecordKey([u8; KEY_LEN]);

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RecordKey(<redacted>)")
    }
}

impl RecordKey {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        <[u8; KEY_LEN]>::try_from(bytes)
            .map(Self)
            .map_err(|_| format!("a record key is {KEY_LEN} bytes, not {}", bytes.len()))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The key's SHA-256 in hex, which names it without revealing it (the key is 32
    /// random bytes): what `kubernetes.record_key_sha256` pins, and what
    /// `base64 -d | sha256sum` of the Secret's `key` prints.
    pub fn fingerprint(&self) -> String {
        use sha2::Digest;
        Sha256::digest(self.0)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// A fresh key from the kernel's random source.
    pub fn generate() -> std::io::Result<Self> {
        use std::io::Read;
        let mut key = [0u8; KEY_LEN];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
        Ok(Self(key))
    }

    fn mac(&self, input: &[u8]) -> Hmac<Sha256> {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(input);
        mac
    }

    fn sign_input(&self, input: &[u8]) -> String {
        let tag = self.mac(input).finalize().into_bytes();
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        format!("{MAC_PREFIX}{hex}")
    }

    fn verify_input(&self, stored: Option<&String>, input: &[u8]) -> Verdict {
        let Some(stored) = stored else {
            return Verdict::Unsigned;
        };
        let Some(tag) = stored.strip_prefix(MAC_PREFIX).and_then(decode_hex) else {
            return Verdict::Mismatch;
        };
        match self.mac(input).verify_slice(&tag) {
            Ok(()) => Verdict::Valid,
            Err(_) => Verdict::Mismatch,
        }
    }

    /// The MAC of `record` as the bridge of Cube driver `driver` writes it.
    pub fn sign(&self, driver: &str, record: &VolumeRecord) -> String {
        self.sign_input(&mac_input(driver, record))
    }

    /// Whether `record` carries a MAC this key made for exactly these fields (compared in
    /// constant time).
    pub fn verify(&self, driver: &str, record: &VolumeRecord) -> Verdict {
        self.verify_input(record.integrity.as_ref(), &mac_input(driver, record))
    }

    /// The MAC of a snapshot record (its own domain: no volume record's MAC fits it).
    pub fn sign_snapshot(&self, driver: &str, record: &SnapshotRecord) -> String {
        self.sign_input(&snapshot_mac_input(driver, record))
    }

    /// Whether a snapshot record carries a MAC this key made for exactly these fields.
    pub fn verify_snapshot(&self, driver: &str, record: &SnapshotRecord) -> Verdict {
        self.verify_input(
            record.integrity.as_ref(),
            &snapshot_mac_input(driver, record),
        )
    }
}

/// What a record's MAC says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Valid,
    /// No MAC: written before records carried one, or stripped.
    Unsigned,
    /// A MAC that this key did not make for these fields.
    Mismatch,
}

/// The bytes a MAC covers: every field that decides what Destroy or the sweep deletes and
/// how, each length-prefixed so that no two records share an input, and the volume's
/// accessible topology (what `list` tells an operator about where it may be attached),
/// appended only when there is one so that records without it keep their MACs.
/// `updated_at` (a timing hint) and `volume_context` (never used to delete) are left out;
/// `revision` is the store's own.
fn mac_input(driver: &str, r: &VolumeRecord) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    let mut field = |bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        out.extend_from_slice(bytes);
    };
    fn optional(value: Option<&str>) -> Vec<u8> {
        match value {
            None => vec![0],
            Some(v) => [&[1u8][..], v.as_bytes()].concat(),
        }
    }
    field(b"cube-csi-bridge controller record v1");
    field(driver.as_bytes());
    field(r.volume_id.as_bytes());
    field(r.csi_name.as_bytes());
    field(&optional(r.csi_driver.as_deref()));
    field(r.state.as_str().as_bytes());
    field(&optional(r.csi_volume_id.as_deref()));
    match &r.deletion {
        None => field(b"deletion:none"),
        Some(d) => {
            field(if d.retain {
                b"deletion:retain"
            } else {
                b"deletion:delete"
            });
            let secret = d.secret.as_ref();
            field(&optional(secret.map(|s| s.namespace.as_str())));
            field(&optional(secret.map(|s| s.name.as_str())));
        }
    }
    if !r.accessible_topology.is_empty() {
        field(b"accessible_topology");
        field(&(r.accessible_topology.len() as u64).to_be_bytes());
        for segments in &r.accessible_topology {
            field(&(segments.len() as u64).to_be_bytes());
            for (key, value) in segments {
                field(key.as_bytes());
                field(value.as_bytes());
            }
        }
    }
    // Only present when set, so that the MACs of records from before content sources
    // existed still verify: the sweep repeats CreateVolume with it.
    match &r.content_source {
        None => {}
        Some(ContentSource::Snapshot {
            snapshot_id,
            csi_snapshot_id,
        }) => {
            field(b"content:snapshot");
            field(snapshot_id.as_bytes());
            field(csi_snapshot_id.as_bytes());
        }
        Some(ContentSource::Volume {
            volume_id,
            csi_volume_id,
        }) => {
            field(b"content:volume");
            field(volume_id.as_bytes());
            field(csi_volume_id.as_bytes());
        }
    }
    // The size an intent asks CreateVolume for, which a repeated Create and the sweep ask
    // for again; only when there is one, so that intents from before it was recorded (0)
    // keep their MACs. A finished record's size is the driver's answer, not covered.
    if r.state == VolumeState::Creating && r.capacity_bytes > 0 {
        field(b"asked_bytes");
        field(&r.capacity_bytes.to_be_bytes());
    }
    out
}

/// The bytes a snapshot record's MAC covers: every field `snapshot delete`, `restore` and
/// the sweep act on (the CSI snapshot they delete or hand to CreateVolume, the names that
/// find it again, the driver it belongs to), length-prefixed like `mac_input`.
fn snapshot_mac_input(driver: &str, r: &SnapshotRecord) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    let mut field = |bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        out.extend_from_slice(bytes);
    };
    field(b"cube-csi-bridge snapshot record v1");
    field(driver.as_bytes());
    field(r.snapshot_id.as_bytes());
    field(r.csi_name.as_bytes());
    field(r.csi_driver.as_bytes());
    field(r.source_volume_id.as_bytes());
    field(r.source_csi_volume_id.as_bytes());
    field(r.state.as_str().as_bytes());
    match &r.csi_snapshot_id {
        None => field(&[0]),
        Some(id) => field(&[&[1u8][..], id.as_bytes()].concat()),
    }
    out
}

pub fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

/// A key as made, and whether this call made it (false: another process made it first).
#[derive(Debug, Clone)]
pub struct LoadedKey {
    pub key: RecordKey,
    pub created: bool,
}

/// Where the record key is kept.
#[async_trait]
pub trait RecordKeySource: Send + Sync + fmt::Debug {
    /// The key, or None when none has been made. An error when the key there is not one
    /// the bridge may trust (not made by the bridge, not the one the operator pinned), or
    /// when none is there but one must be (pinned).
    async fn read(&self) -> Result<Option<RecordKey>, BridgeError>;
    /// Makes the key (exactly one of several concurrent calls makes it; the others read
    /// it, with the same checks as `read`).
    async fn create(&self) -> Result<LoadedKey, BridgeError>;
    /// Whether a key this source makes proves that no key existed before: only someone
    /// the bridge trusts (root, for a file in its state dir) could have removed an earlier
    /// one. Then records without a MAC predate keys and are signed when the key is made.
    /// A Secret does not prove it: whoever may delete Secrets can remove the key.
    fn making_proves_first_key(&self) -> bool;
    /// Where the key is, for messages.
    fn describe(&self) -> String;
}

/// What a store's signed records say about a key (see `KeyFit::check`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeyFit {
    /// Records whose MAC this key made.
    pub valid: usize,
    /// Records without a MAC.
    pub unsigned: usize,
    /// Records carrying a MAC this key did not make: where each is (up to 5).
    pub mismatched: Vec<String>,
    pub mismatched_count: usize,
}

impl KeyFit {
    /// Tallies volume `records` (each with where it is) against `key`.
    pub fn tally<'a>(
        key: &RecordKey,
        driver: &str,
        records: impl IntoIterator<Item = (&'a VolumeRecord, String)>,
    ) -> Self {
        Self::of(
            records
                .into_iter()
                .map(|(record, place)| (key.verify(driver, record), place)),
        )
    }

    /// Tallies snapshot `records` (each with where it is) against `key`.
    pub fn tally_snapshots<'a>(
        key: &RecordKey,
        driver: &str,
        records: impl IntoIterator<Item = (&'a SnapshotRecord, String)>,
    ) -> Self {
        Self::of(
            records
                .into_iter()
                .map(|(record, place)| (key.verify_snapshot(driver, record), place)),
        )
    }

    fn of(verdicts: impl IntoIterator<Item = (Verdict, String)>) -> Self {
        let mut fit = Self::default();
        for (verdict, place) in verdicts {
            match verdict {
                Verdict::Valid => fit.valid += 1,
                Verdict::Unsigned => fit.unsigned += 1,
                Verdict::Mismatch => {
                    fit.mismatched_count += 1;
                    if fit.mismatched.len() < 5 {
                        fit.mismatched.push(place);
                    }
                }
            }
        }
        fit
    }

    /// Both tallies as one: a key judged by every record it should have signed.
    pub fn and(mut self, other: &Self) -> Self {
        self.valid += other.valid;
        self.unsigned += other.unsigned;
        self.mismatched_count += other.mismatched_count;
        for place in &other.mismatched {
            if self.mismatched.len() < 5 {
                self.mismatched.push(place.clone());
            }
        }
        self
    }

    /// Signed records exist and the key made none of their MACs: it is not the key they
    /// were signed with (the key was replaced), and using it would refuse them all while
    /// trusting whatever the replacement's maker signs.
    pub fn is_foreign_key(&self) -> bool {
        self.valid == 0 && self.mismatched_count > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::records::{DeletionPolicy, SecretRef, VolumeState};

    fn record() -> VolumeRecord {
        VolumeRecord {
            volume_id: "v1".into(),
            csi_name: "cube-v1".into(),
            csi_driver: Some("nfs.csi.k8s.io".into()),
            state: VolumeState::Created,
            csi_volume_id: Some("server#share#v1".into()),
            volume_context: Default::default(),
            capacity_bytes: 0,
            updated_at: 5,
            deletion: Some(DeletionPolicy {
                retain: false,
                secret: Some(SecretRef {
                    namespace: "default".into(),
                    name: "creds".into(),
                }),
            }),
            revision: None,
            integrity: None,
            content_source: None,
            node_expansion_required: false,
            answering_creates: Vec::new(),
            accessible_topology: Vec::new(),
        }
    }

    /// The accessible topology is covered once a record has one; a record without it signs
    /// as it did before topology was recorded (its MAC is the one already stored).
    #[test]
    fn the_accessible_topology_is_covered_and_records_without_one_keep_their_mac() {
        let key = RecordKey::from_bytes(&[7; KEY_LEN]).unwrap();
        let plain = record();
        // What the MAC of this record was before topology was recorded (the same HMAC over
        // the same length-prefixed fields, computed apart from this code).
        assert_eq!(
            key.sign("nfs", &plain),
            "hmac-sha256-v1:5dbce546c5162f45045987d8379310592642e758a4d1529f4a38342f60cc3341"
        );
        let zone =
            |z: &str| crate::bridge::ports::Segments::from([("example.com/zone".into(), z.into())]);
        let mut placed = record();
        placed.accessible_topology = vec![zone("a")];
        placed.integrity = Some(key.sign("nfs", &placed));
        assert_eq!(key.verify("nfs", &placed), Verdict::Valid);
        type Edit = fn(&mut VolumeRecord);
        let edits: [Edit; 4] = [
            |r| r.accessible_topology.clear(),
            |r| r.accessible_topology[0] = Default::default(),
            |r| {
                r.accessible_topology[0].insert("example.com/zone".into(), "b".into());
            },
            |r| r.accessible_topology.push(Default::default()),
        ];
        for edit in edits {
            let mut forged = placed.clone();
            edit(&mut forged);
            assert_eq!(key.verify("nfs", &forged), Verdict::Mismatch, "{forged:?}");
        }
    }

    /// The size an intent asks CreateVolume for is covered (the sweep and a repeated
    /// Create ask for it again); an intent that records none (from before) keeps its MAC,
    /// and a finished record's size (the driver's answer) is not covered.
    #[test]
    fn an_intents_asked_size_is_covered() {
        let key = RecordKey::from_bytes(&[7; KEY_LEN]).unwrap();
        let mut intent = record();
        intent.state = VolumeState::Creating;
        intent.capacity_bytes = 0;
        let unsized_mac = key.sign("nfs", &intent);
        intent.capacity_bytes = 1 << 30;
        intent.integrity = Some(key.sign("nfs", &intent));
        assert_eq!(key.verify("nfs", &intent), Verdict::Valid);
        assert_ne!(intent.integrity.as_deref(), Some(unsized_mac.as_str()));
        let mut forged = intent.clone();
        forged.capacity_bytes = 1 << 50;
        assert_eq!(key.verify("nfs", &forged), Verdict::Mismatch);
        let mut finished = record();
        finished.integrity = Some(key.sign("nfs", &finished));
        finished.capacity_bytes += 1;
        assert_eq!(key.verify("nfs", &finished), Verdict::Valid);
    }

    #[test]
    fn every_field_destroy_acts_on_is_covered() {
        let key = RecordKey::from_bytes(&[7; KEY_LEN]).unwrap();
        let mut signed = record();
        signed.integrity = Some(key.sign("nfs", &signed));
        assert_eq!(key.verify("nfs", &signed), Verdict::Valid);
        // Timing and bookkeeping may change without a new MAC.
        let mut touched = signed.clone();
        touched.updated_at = 99;
        touched.revision = Some("12".into());
        touched.volume_context.insert("k".into(), "v".into());
        assert_eq!(key.verify("nfs", &touched), Verdict::Valid);
        type Edit = fn(&mut VolumeRecord);
        let edits: [Edit; 10] = [
            |r| r.csi_volume_id = Some("server#share#other".into()),
            |r| r.csi_volume_id = None,
            |r| r.volume_id = "v2".into(),
            |r| r.csi_name = "cube-v2".into(),
            |r| r.csi_driver = Some("evil.csi".into()),
            |r| r.state = VolumeState::Creating,
            |r| r.deletion.as_mut().unwrap().secret.as_mut().unwrap().name = "admin".into(),
            |r| r.deletion.as_mut().unwrap().retain = true,
            |r| {
                r.content_source = Some(ContentSource::Snapshot {
                    snapshot_id: "s".into(),
                    csi_snapshot_id: "snap-1".into(),
                })
            },
            |r| {
                r.content_source = Some(ContentSource::Volume {
                    volume_id: "v0".into(),
                    csi_volume_id: "server#share#v0".into(),
                })
            },
        ];
        for edit in edits {
            let mut forged = signed.clone();
            edit(&mut forged);
            assert_eq!(key.verify("nfs", &forged), Verdict::Mismatch, "{forged:?}");
        }
        // Another bridge instance (driver name) or key does not verify it either.
        assert_eq!(key.verify("cephfs", &signed), Verdict::Mismatch);
        let other = RecordKey::from_bytes(&[8; KEY_LEN]).unwrap();
        assert_eq!(other.verify("nfs", &signed), Verdict::Mismatch);
        for junk in ["", "hmac-sha256-v1:zz", "hmac-sha256-v1:00", "md5:abc"] {
            let mut bad = signed.clone();
            bad.integrity = Some(junk.into());
            assert_eq!(key.verify("nfs", &bad), Verdict::Mismatch, "{junk}");
        }
        assert_eq!(key.verify("nfs", &record()), Verdict::Unsigned);
        assert!(!format!("{key:?}").contains("07"));
    }

    #[test]
    fn every_field_a_snapshot_delete_acts_on_is_covered_and_volume_macs_do_not_fit() {
        let key = RecordKey::from_bytes(&[7; KEY_LEN]).unwrap();
        let mut signed = SnapshotRecord {
            snapshot_id: "s1".into(),
            csi_name: "cube-snap-s1".into(),
            csi_driver: "nfs.csi.k8s.io".into(),
            source_volume_id: "v1".into(),
            source_csi_volume_id: "server#share#v1".into(),
            state: VolumeState::Created,
            csi_snapshot_id: Some("snap-9".into()),
            size_bytes: 5,
            creation_time: 6,
            ready_to_use: true,
            updated_at: 7,
            revision: None,
            integrity: None,
        };
        assert_eq!(key.verify_snapshot("nfs", &signed), Verdict::Unsigned);
        signed.integrity = Some(key.sign_snapshot("nfs", &signed));
        assert_eq!(key.verify_snapshot("nfs", &signed), Verdict::Valid);
        let mut touched = signed.clone();
        (touched.updated_at, touched.ready_to_use, touched.size_bytes) = (99, false, 1);
        assert_eq!(key.verify_snapshot("nfs", &touched), Verdict::Valid);
        type Edit = fn(&mut SnapshotRecord);
        let edits: [Edit; 8] = [
            |r| r.csi_snapshot_id = Some("snap-other".into()),
            |r| r.csi_snapshot_id = None,
            |r| r.snapshot_id = "s2".into(),
            |r| r.csi_name = "cube-snap-s2".into(),
            |r| r.csi_driver = "evil.csi".into(),
            |r| r.source_volume_id = "v2".into(),
            |r| r.source_csi_volume_id = "server#share#v2".into(),
            |r| r.state = VolumeState::Creating,
        ];
        for edit in edits {
            let mut forged = signed.clone();
            edit(&mut forged);
            assert_eq!(key.verify_snapshot("nfs", &forged), Verdict::Mismatch);
        }
        assert_eq!(key.verify_snapshot("cephfs", &signed), Verdict::Mismatch);
        // A volume record's MAC never passes for a snapshot record's, nor the reverse.
        let mut volume = record();
        volume.integrity = signed.integrity.clone();
        assert_eq!(key.verify("nfs", &volume), Verdict::Mismatch);
    }

    #[test]
    fn the_fingerprint_is_the_sha256_of_the_key_bytes() {
        let key = RecordKey::from_bytes(&[0; KEY_LEN]).unwrap();
        // printf '\0%.0s' $(seq 32) | sha256sum
        assert_eq!(
            key.fingerprint(),
            "66687aadf862bd776c8fc18b8e9f8e20089714856ee233b3902a591d0d5f2925"
        );
    }

    #[test]
    fn a_key_that_made_none_of_the_signed_records_is_foreign() {
        let key = RecordKey::from_bytes(&[7; KEY_LEN]).unwrap();
        let other = RecordKey::from_bytes(&[8; KEY_LEN]).unwrap();
        let signed_by = |k: &RecordKey, id: &str| {
            let mut r = record();
            r.volume_id = id.into();
            r.integrity = Some(k.sign("nfs", &r));
            r
        };
        let tally = |records: &[VolumeRecord]| {
            KeyFit::tally(
                &key,
                "nfs",
                records
                    .iter()
                    .map(|r| (r, format!("record {}", r.volume_id))),
            )
        };
        // Nothing signed yet (a fresh store, or one from before MACs): nothing to judge.
        assert!(!tally(&[]).is_foreign_key());
        assert!(!tally(&[record()]).is_foreign_key());
        // One edited record among good ones is that record's problem, not the key's.
        let fit = tally(&[signed_by(&key, "a"), signed_by(&other, "b"), record()]);
        assert_eq!((fit.valid, fit.unsigned, fit.mismatched_count), (1, 1, 1));
        assert_eq!(fit.mismatched, ["record b"]);
        assert!(!fit.is_foreign_key());
        // Every signed record was signed with another key: this key replaced theirs.
        let fit = tally(&[signed_by(&other, "a"), signed_by(&other, "b"), record()]);
        assert!(fit.is_foreign_key());
    }
}
