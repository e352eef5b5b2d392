//! The dependency check of Cargo.lock (scripts/check-deps.sh: cargo-deny's licences, bans and
//! sources checks against deny.toml) passes as configured, and fails when the policy and the
//! graph disagree: a licence in use that is not allowed, an allowed licence nobody uses, a
//! banned crate in the graph.
//!
//! Needs `CUBE_CSI_BRIDGE_OPS_BIN`, the directory holding cargo-deny
//! (scripts/install-ops-tools.sh prints it). Without it the tests skip loudly, or fail when
//! `CI` is set.

use std::path::{Path, PathBuf};
use std::process::Command;

const OPS_BIN_ENV: &str = "CUBE_CSI_BRIDGE_OPS_BIN";
const REPO: &str = env!("CARGO_MANIFEST_DIR");

fn cargo_deny_dir() -> Option<PathBuf> {
    let Some(dir) = std::env::var_os(OPS_BIN_ENV).filter(|v| !v.is_empty()) else {
        if std::env::var_os("CI").is_some() {
            panic!("{OPS_BIN_ENV} is not set, and CI is: the dependency check must run in CI");
        }
        eprintln!(
            "\n*** SKIPPED: {OPS_BIN_ENV} is not set, so the dependency check was NOT tested. \
             Set it to the directory scripts/install-ops-tools.sh prints. ***\n"
        );
        return None;
    };
    let dir = PathBuf::from(dir);
    assert!(
        dir.join("cargo-deny").is_file(),
        "{OPS_BIN_ENV}={} has no cargo-deny",
        dir.display()
    );
    Some(dir)
}

/// Runs scripts/check-deps.sh with `config`: (success, everything it printed).
fn check(bin: &Path, config: &Path) -> (bool, String) {
    let out = Command::new("bash")
        .arg(Path::new(REPO).join("scripts/check-deps.sh"))
        .arg(bin)
        .arg(config)
        .output()
        .expect("bash runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn policy() -> String {
    std::fs::read_to_string(Path::new(REPO).join("deny.toml")).unwrap()
}

#[test]
fn cargo_lock_meets_the_policy() {
    let Some(bin) = cargo_deny_dir() else {
        return;
    };
    let (ok, text) = check(&bin, &Path::new(REPO).join("deny.toml"));
    assert!(ok, "the dependency check fails:\n{text}");
    assert!(
        text.contains("bans ok, licenses ok, sources ok"),
        "all three checks ran: {text}"
    );
}

#[test]
fn the_check_fails_when_policy_and_graph_disagree() {
    let Some(bin) = cargo_deny_dir() else {
        return;
    };
    let allowed_zlib = "    \"Zlib\",\n";
    let ban_list = "deny = [\n";
    // (what, the policy changed, text the failure must contain)
    let cases = [
        (
            "a licence in use that is not allowed",
            policy().replacen(allowed_zlib, "", 1),
            "foldhash",
        ),
        (
            "an allowed licence nobody uses",
            policy().replacen(allowed_zlib, "    \"Zlib\",\n    \"MPL-2.0\",\n", 1),
            "license-not-encountered",
        ),
        (
            "a banned crate in the graph",
            policy().replacen(
                ban_list,
                "deny = [\n    { crate = \"tonic\", reason = \"test\" },\n",
                1,
            ),
            "explicitly banned",
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (what, changed, expected) in cases {
        assert_ne!(changed, policy(), "{what}: the change applies");
        let config = dir.path().join("deny.toml");
        std::fs::write(&config, changed).unwrap();
        let (ok, text) = check(&bin, &config);
        assert!(!ok, "{what} passed:\n{text}");
        assert!(
            text.contains(expected),
            "{what}: no {expected:?} in\n{text}"
        );
    }
}
