//! Controller records are not blindly trusted: every record the bridge writes carries an
//! HMAC-SHA256, keyed by a secret only the bridge holds, over the fields Destroy and the
//! abandoned-create sweep act on. A record edited by hand (a CubeVolume pointed at another
//! CSI handle, another driver, another deletion secret) no longer verifies, and the bridge
//! refuses to send DeleteVolume for it.
//!
//! The key lives beside the embedded store (`state.dir/record.key`, mode 0600) or, with
//! CubeVolume records, in a Kubernetes Secret that every controller replica reads (k8s/).
//! It is made on first use. Records written before records carried a MAC are signed once,
//! when the key is made (trust on first use); after that an unsigned record is refused
//! like a forged one, unless `controller.sign_unsigned_records` asks for a re-sign.

use std::fmt;

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::BridgeError;
use super::records::VolumeRecord;

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

    /// A fresh key from the kernel's random source.
    pub fn generate() -> std::io::Result<Self> {
        use std::io::Read;
        let mut key = [0u8; KEY_LEN];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
        Ok(Self(key))
    }

    fn mac(&self, driver: &str, record: &VolumeRecord) -> Hmac<Sha256> {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(&mac_input(driver, record));
        mac
    }

    /// The MAC of `record` as the bridge of Cube driver `driver` writes it.
    pub fn sign(&self, driver: &str, record: &VolumeRecord) -> String {
        let tag = self.mac(driver, record).finalize().into_bytes();
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        format!("{MAC_PREFIX}{hex}")
    }

    /// Whether `record` carries a MAC this key made for exactly these fields (compared in
    /// constant time).
    pub fn verify(&self, driver: &str, record: &VolumeRecord) -> Verdict {
        let Some(stored) = &record.integrity else {
            return Verdict::Unsigned;
        };
        let Some(tag) = stored.strip_prefix(MAC_PREFIX).and_then(decode_hex) else {
            return Verdict::Mismatch;
        };
        match self.mac(driver, record).verify_slice(&tag) {
            Ok(()) => Verdict::Valid,
            Err(_) => Verdict::Mismatch,
        }
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
/// how, each length-prefixed so that no two records share an input. `updated_at` (a
/// timing hint) and `volume_context` (never used to delete) are left out; `revision` is
/// the store's own.
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

/// A key as loaded, and whether this load made it (then records written before keys
/// existed are signed once).
#[derive(Debug, Clone)]
pub struct LoadedKey {
    pub key: RecordKey,
    pub created: bool,
}

/// Where the record key is kept.
#[async_trait]
pub trait RecordKeySource: Send + Sync + fmt::Debug {
    /// Reads the key, making it first if there is none yet (exactly one of several
    /// concurrent first loads makes it; the others read it).
    async fn load(&self) -> Result<LoadedKey, BridgeError>;
    /// Where the key is, for messages.
    fn describe(&self) -> String;
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
        }
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
        let edits: [Edit; 8] = [
            |r| r.csi_volume_id = Some("server#share#other".into()),
            |r| r.csi_volume_id = None,
            |r| r.volume_id = "v2".into(),
            |r| r.csi_name = "cube-v2".into(),
            |r| r.csi_driver = Some("evil.csi".into()),
            |r| r.state = VolumeState::Creating,
            |r| r.deletion.as_mut().unwrap().secret.as_mut().unwrap().name = "admin".into(),
            |r| r.deletion.as_mut().unwrap().retain = true,
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
}
