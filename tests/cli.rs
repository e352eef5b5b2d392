//! The executable's command line: help text, and the binary hook's answers to a bad argv
//! or a missing config (always exactly one JSON object on stdout).

use std::process::{Command, Output};

const BRIDGE: &str = env!("CARGO_BIN_EXE_cube-csi-bridge");

fn run(args: &[&str], config: Option<&str>) -> Output {
    let mut cmd = Command::new(BRIDGE);
    cmd.args(args).env_remove("RUST_LOG");
    match config {
        Some(c) => cmd.env("CUBE_CSI_BRIDGE_CONFIG", c),
        None => cmd.env_remove("CUBE_CSI_BRIDGE_CONFIG"),
    };
    cmd.output().unwrap()
}

fn one_json_object(out: &Output) -> serde_json::Map<String, serde_json::Value> {
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(stdout.trim_end().lines().count(), 1, "{stdout:?}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout:?}"))
}

#[test]
fn help_describes_every_subcommand_and_hook_flag() {
    let out = run(&["--help"], None);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for sub in ["serve", "hook", "demo", "check", "register", "list"] {
        assert!(text.contains(sub), "{sub} missing from --help");
    }
    let out = run(&["hook", "--help"], None);
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--op",
        "--volume-id",
        "--name",
        "--sandbox-id",
        "--namespace",
        "--ref-count",
        "--volume-base-dir",
        "--private-data",
        "--metadata",
        "--config",
    ] {
        assert!(text.contains(flag), "{flag} missing from hook --help");
    }
}

#[test]
fn bad_argv_answers_with_one_json_error() {
    // Cube's form: no `hook` word, flags first.
    let out = run(
        &["--op", "attach", "--volume-id", "v"],
        Some("/nonexistent.toml"),
    );
    assert_eq!(out.status.code(), Some(64));
    let json = one_json_object(&out);
    assert!(json["error"].as_str().unwrap().contains("--sandbox-id"));
    let out = run(&["--op", "explode"], None);
    assert_ne!(out.status.code(), Some(0));
    assert!(!one_json_object(&out)["error"].as_str().unwrap().is_empty());
}

#[test]
fn missing_config_is_named_in_the_json_error() {
    let out = run(
        &["--op", "destroy", "--volume-id", "v"],
        Some("/nonexistent/bridge.toml"),
    );
    assert_eq!(out.status.code(), Some(78));
    let json = one_json_object(&out);
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/bridge.toml")
    );
    // The message also ends stderr, which is what Cube shows for a non-zero exit.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.trim(),
        json["error"].as_str().unwrap(),
        "only the message by default"
    );
}

#[test]
fn register_prints_both_cube_configs() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        "driver = \"nfs\"\n[csi]\nendpoint = \"/run/csi/nfs.sock\"\n",
    )
    .unwrap();
    let out = run(&["register", "--config", config.to_str().unwrap()], None);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("socket_path: /run/cube-csi-bridge/nfs.sock"));
    assert!(text.contains("[[plugins.\"io.cubelet.internal.v1.storage\".volume_plugins]]"));
    assert!(text.contains("type = \"binary\""));
}

/// The README's first command is `cargo run --release -- demo`: with the hook front as a
/// second executable, cargo runs neither unless the manifest names which.
#[test]
fn cargo_run_runs_the_bridge() {
    let manifest: toml::Table = include_str!("../Cargo.toml").parse().unwrap();
    let bins = manifest["bin"].as_array().map_or(0, Vec::len);
    if bins > 1 {
        assert_eq!(
            manifest["package"]
                .get("default-run")
                .and_then(|v| v.as_str()),
            Some("cube-csi-bridge"),
            "several [[bin]] targets: `cargo run` needs package.default-run"
        );
    }
}
