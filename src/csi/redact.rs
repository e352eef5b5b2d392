//! Keeps what a request carried in confidence out of what the driver answers.
//!
//! Drivers echo their requests in error messages (mount options in a failed mount
//! command, a secret in a parameter error). Every message from a call that carried
//! secrets or mount flags is scrubbed of them before it becomes an error, a log line, a
//! gRPC status or a binary hook's JSON.

use crate::bridge::ports::{Capability, Secrets};

/// What to hide, longest first (so a flag is hidden before its value).
#[derive(Debug, Clone, Default)]
pub struct Redactions(Vec<String>);

/// Shorter values are not hidden: they would shred the message, and are no secret.
const MIN_SECRET_LEN: usize = 3;
pub const REDACTED: &str = "<redacted>";

impl Redactions {
    pub const NONE: Redactions = Redactions(Vec::new());

    /// The secret values and the mount flags (each whole, each comma-joined `key=value`
    /// option, and each such value) of one request: a driver may echo the
    /// options of `vers=3,username=u,password=S` one by one, in any order.
    pub fn of(secrets: &Secrets, capability: Option<&Capability>) -> Self {
        let mut hidden: Vec<String> = secrets.values().map(str::to_string).collect();
        for flag in capability.iter().flat_map(|c| c.mount_flags.iter()) {
            hidden.push(flag.clone());
            for option in flag.split(',') {
                if let Some((_, value)) = option.split_once('=') {
                    hidden.push(option.to_string());
                    if !is_plain_number(value) {
                        hidden.push(value.to_string());
                    }
                }
            }
        }
        hidden.retain(|s| s.len() >= MIN_SECRET_LEN);
        hidden.sort_by_key(|s| std::cmp::Reverse(s.len()));
        hidden.dedup();
        Redactions(hidden)
    }

    pub fn apply(&self, text: &str) -> String {
        let mut out = text.to_string();
        for secret in &self.0 {
            if out.contains(secret.as_str()) {
                out = out.replace(secret.as_str(), REDACTED);
            }
        }
        out
    }
}

/// Versions and sizes (`nfsvers=4.1`, `rsize=1048576`) are not secrets, and hiding them
/// everywhere in a message would hide its meaning.
fn is_plain_number(value: &str) -> bool {
    !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AccessMode;
    use std::collections::BTreeMap;

    #[test]
    fn secrets_and_credential_flags_are_hidden() {
        let secrets = Secrets(BTreeMap::from([
            ("password".into(), "hunter2-SECRET".into()),
            ("tiny".into(), "x".into()),
        ]));
        let cap = Capability {
            access_mode: AccessMode::MultiNodeMultiWriter,
            fs_type: String::new(),
            mount_flags: vec!["nfsvers=4.1".into(), "pass=s3cr3t-flag".into()],
        };
        let r = Redactions::of(&secrets, Some(&cap));
        let message = "mount -o nfsvers=4.1,pass=s3cr3t-flag failed; auth hunter2-SECRET refused; s3cr3t-flag";
        let scrubbed = r.apply(message);
        for leak in ["hunter2", "s3cr3t"] {
            assert!(!scrubbed.contains(leak), "{scrubbed}");
        }
        assert!(scrubbed.contains("refused"), "{scrubbed}");
        assert_eq!(Redactions::NONE.apply("as is"), "as is");
    }

    #[test]
    fn each_option_of_a_comma_joined_flag_is_hidden_wherever_it_is_echoed() {
        let cap = Capability {
            access_mode: AccessMode::MultiNodeMultiWriter,
            fs_type: String::new(),
            mount_flags: vec!["vers=3,username=alice,password=s3cr3t-pw".into()],
        };
        let r = Redactions::of(&Secrets::default(), Some(&cap));
        let scrubbed = r.apply("mount error: password=s3cr3t-pw,vers=3 rejected (s3cr3t-pw)");
        assert!(!scrubbed.contains("s3cr3t"), "{scrubbed}");
        assert!(scrubbed.contains("rejected"), "{scrubbed}");
    }
}
