//! The config parser, in both forms (one driver, or a `[[drivers]]` list): any text is a
//! config or an error naming the file, never a panic, and an error never quotes a secret (a
//! `[secrets]` value or a mount flag) that the file holds only there.
#![no_main]

use std::path::Path;

use cube_csi_bridge::config::Config;
use libfuzzer_sys::fuzz_target;

/// The values at secret-bearing places of a TOML table, and of each `[[drivers]]` entry.
fn secret_values(table: &toml::Table) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(toml::Value::Array(drivers)) = table.get("drivers") {
        for entry in drivers {
            if let toml::Value::Table(entry) = entry {
                out.extend(secret_values(entry));
            }
        }
    }
    if let Some(toml::Value::Table(secrets)) = table.get("secrets") {
        for family in secrets.values() {
            if let toml::Value::Table(family) = family {
                out.extend(
                    family
                        .values()
                        .filter_map(|v| v.as_str().map(str::to_string)),
                );
            }
        }
    }
    if let Some(flags) = table
        .get("volume")
        .and_then(|v| v.get("mount_flags"))
        .and_then(|f| f.as_array())
    {
        out.extend(flags.iter().filter_map(|v| v.as_str().map(str::to_string)));
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Err(error) = Config::parse_all(text, Path::new("/fuzz.toml")) else {
        return;
    };
    let message = error.to_string();
    assert!(message.contains("/fuzz.toml"), "{message}");
    if let Ok(table) = text.parse::<toml::Table>() {
        for secret in secret_values(&table) {
            // Without the quote characters the parser's messages put around a name they
            // quote: a key the file also holds, quoted as `key`, must not pass for a
            // secret that is that key plus a backtick (a seed in the corpus is one).
            let core = secret.trim_matches(|c| matches!(c, '`' | '"' | '\''));
            // Long enough not to be a word of the message, and nowhere else in the file
            // (other fields' values and unknown keys may be quoted).
            if core.len() >= 12 && text.matches(core).count() == 1 {
                assert!(!message.contains(core), "{message}");
            }
        }
    }
});
