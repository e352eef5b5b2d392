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
        // Each value also without its surrounding whitespace: a Secret's value often ends
        // in a newline (`echo pw | base64`, `--from-file`), which drivers trim before they
        // use it, and echo trimmed.
        let mut hidden: Vec<String> = secrets
            .values()
            .flat_map(|value| [value.to_string(), value.trim().to_string()])
            .collect();
        for flag in capability.iter().flat_map(|c| c.mount_flags.iter()) {
            hidden.push(flag.clone());
            for option in flag.split(',') {
                if let Some((key, value)) = option.split_once('=') {
                    hidden.push(option.to_string());
                    if !is_plain_number(value) || names_a_credential(key) {
                        hidden.push(value.to_string());
                    }
                }
            }
        }
        hidden.retain(|s| s.len() >= MIN_SECRET_LEN);
        // Drivers echo requests as Go's encoding/json or %q does, or base64-encoded: each
        // escaped or encoded form of a value is hidden too.
        let forms: Vec<String> = hidden.iter().flat_map(|s| encoded_forms(s)).collect();
        hidden.extend(forms);
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

/// The forms a driver may echo `value` in besides the plain one: JSON-escaped (as Rust and
/// Go's %q write printable text), Go's encoding/json (which also writes `<`, `>`, `&` as
/// `\u003c`, `\u003e`, `\u0026`), every character as `\uXXXX`, each of those escaped
/// once more (a JSON document quoted inside a message), and base64 (standard and URL-safe,
/// at each of the three alignments it can have inside a longer encoded text).
fn encoded_forms(value: &str) -> Vec<String> {
    let json = |text: &str| {
        let quoted = serde_json::to_string(text).expect("a string serializes");
        quoted[1..quoted.len() - 1].to_string()
    };
    let go_json = |text: &str| {
        json(text)
            .replace('<', "\\u003c")
            .replace('>', "\\u003e")
            .replace('&', "\\u0026")
    };
    let all_unicode: String = value
        .encode_utf16()
        .map(|unit| format!("\\u{unit:04x}"))
        .collect();
    let mut forms = vec![json(value), go_json(value), all_unicode.clone()];
    for form in forms.clone() {
        forms.push(json(&form));
    }
    forms.push(all_unicode.to_uppercase().replace("\\U", "\\u"));
    forms.extend(base64_forms(value.as_bytes()));
    forms.retain(|form| form != value);
    forms
}

/// The part of the base64 encoding of `bytes` that every encoding of a text containing
/// them shares, at each of the three alignments, in both alphabets.
fn base64_forms(bytes: &[u8]) -> Vec<String> {
    const STANDARD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut forms = Vec::new();
    for offset in 0..3 {
        let mut data = vec![0u8; offset];
        data.extend_from_slice(bytes);
        let bits = data.len() * 8;
        let mut chars = String::new();
        for index in 0..bits / 6 {
            let mut sextet = 0u8;
            for bit in 0..6 {
                let at = index * 6 + bit;
                let set = data[at / 8] & (0x80 >> (at % 8)) != 0;
                sextet = (sextet << 1) | u8::from(set);
            }
            chars.push(STANDARD[usize::from(sextet)] as char);
        }
        // Characters that mix in the filler before the value are not shared.
        let skip = (offset * 8).div_ceil(6);
        let core = &chars[skip.min(chars.len())..];
        if core.len() >= 4 {
            forms.push(core.to_string());
            forms.push(core.replace('+', "-").replace('/', "_"));
        }
    }
    forms
}

/// Versions and sizes (`nfsvers=4.1`, `rsize=1048576`) are not secrets, and hiding them
/// everywhere in a message would hide its meaning.
fn is_plain_number(value: &str) -> bool {
    !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

/// A mount option whose value is a credential however it looks (`password=83920183`): its
/// value is hidden even when it is a plain number, which other options' are not.
fn names_a_credential(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["pass", "secret", "token", "key", "cred", "auth", "pin"]
        .iter()
        .any(|word| key.contains(word))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AccessMode;
    use std::collections::BTreeMap;

    /// A Secret's value ending in a newline, echoed trimmed by the driver (as Go drivers
    /// trim credentials before use): before, only the value with its newline was hidden.
    #[test]
    fn a_secret_echoed_without_its_newline_is_hidden() {
        let secrets = Secrets(BTreeMap::from([(
            "username".into(),
            "alice-SECRET\n".into(),
        )]));
        let r = Redactions::of(&secrets, None);
        let scrubbed = r.apply("mount error: -o username=alice-SECRET,<masked> refused");
        assert!(!scrubbed.contains("alice-SECRET"), "{scrubbed}");
        assert!(scrubbed.contains("refused"), "{scrubbed}");
    }

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
        // A credential that is a plain number is hidden on its own too (before, only the
        // whole option was); other plain numbers stay readable.
        let cap = Capability {
            mount_flags: vec!["password=83920183,rsize=1048576".into()],
            ..cap
        };
        let r = Redactions::of(&Secrets::default(), Some(&cap));
        let scrubbed = r.apply("login with 83920183 refused (rsize 1048576)");
        assert!(!scrubbed.contains("83920183"), "{scrubbed}");
        assert!(scrubbed.contains("1048576"), "{scrubbed}");
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

    #[test]
    fn escaped_and_encoded_echoes_are_hidden_too() {
        let secrets = Secrets(BTreeMap::from([(
            "key".into(),
            "ak\"PROVSECRET\"42".into(),
        )]));
        let cap = Capability {
            access_mode: AccessMode::MultiNodeMultiWriter,
            fs_type: String::new(),
            mount_flags: vec!["Fl<g>SECRET".into()],
        };
        let r = Redactions::of(&secrets, Some(&cap));
        let b64 = |text: &str| {
            let mut forms = base64_forms(text.as_bytes());
            forms.truncate(1);
            forms.remove(0)
        };
        for echo in [
            // Go's encoding/json and %q of the request.
            r#"{"secrets":{"key":"ak\"PROVSECRET\"42"}}"#.to_string(),
            r#"mount -o Fl\u003cg\u003eSECRET failed"#.to_string(),
            // \uXXXX for every character, and a JSON document quoted in a message.
            "\\u0046\\u006c\\u003c\\u0067\\u003e\\u0053\\u0045\\u0043\\u0052\\u0045\\u0054"
                .to_string(),
            format!(
                "error: {}",
                serde_json::to_string(
                    &serde_json::json!({"key": "ak\"PROVSECRET\"42"}).to_string()
                )
                .unwrap()
            ),
            // base64 of the whole request, the secret at any alignment.
            format!("request={}", b64("{\"key\":\"ak\"PROVSECRET\"42\"}")),
            format!("request={}", b64("x{\"key\":\"ak\"PROVSECRET\"42\"}")),
            format!("request={}", b64("xy{\"key\":\"ak\"PROVSECRET\"42\"}")),
        ] {
            let scrubbed = r.apply(&echo);
            assert!(
                !scrubbed.contains("PROVSECRET") && !scrubbed.contains("SECRET"),
                "{echo} -> {scrubbed}"
            );
            let plain_b64 = base64_forms(b"PROVSECRET");
            for form in &plain_b64 {
                assert!(!scrubbed.contains(form.as_str()), "{echo} -> {scrubbed}");
            }
        }
    }
}
