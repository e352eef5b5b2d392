//! The systemd units in packaging/systemd, checked with `systemd-analyze verify` (which needs
//! no running systemd): every unit must load with no diagnostic at all. verify also checks
//! that each ExecStart binary exists and is executable, so the test copies the units with the
//! install paths (/usr/local/bin/...) pointed at real binaries: the bridge cargo just built,
//! and, for csi-nfs.service (an example unit for a driver the operator installs; the tests
//! never run that driver), an executable stand-in, since verify only checks that the file
//! is executable. Beyond verify: the units' paths agree with the bridge's defaults, and the
//! bridge unit holds no setting that gives the daemon a mount namespace of its own.
//!
//! Needs `systemd-analyze` on PATH (scripts/install-ops-tools.sh installs Debian's systemd
//! package when it is missing). Without it the tests skip loudly, or fail when `CI` is set.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use cube_csi_bridge::config::Config;

const UNITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/systemd");
const BRIDGE: &str = env!("CARGO_BIN_EXE_cube-csi-bridge");

/// The shipped unit files and the install path each one's ExecStart runs.
const SHIPPED: [(&str, Option<&str>); 3] = [
    (
        "cube-csi-bridge@.service",
        Some("/usr/local/bin/cube-csi-bridge"),
    ),
    ("cube-csi-bridge@.socket", None),
    ("csi-nfs.service", Some("/usr/local/bin/nfsplugin")),
];

/// The instance the template units are verified as (and the example driver's name).
const INSTANCE: &str = "nfs";

/// Settings that make systemd give a service a private mount namespace. The bridge must
/// have none: it checks mounts as the host sees them and creates directories on the host's
/// propagating base dir.
const MOUNT_NAMESPACE_SETTINGS: &[&str] = &[
    "PrivateMounts",
    "PrivateTmp",
    "PrivateDevices",
    "PrivateIPC",
    "PrivateNetwork",
    "ProtectSystem",
    "ProtectHome",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectProc",
    "ProcSubset",
    "ReadOnlyPaths",
    "ReadWritePaths",
    "InaccessiblePaths",
    "ExecPaths",
    "NoExecPaths",
    "BindPaths",
    "BindReadOnlyPaths",
    "TemporaryFileSystem",
    "MountFlags",
    "RootDirectory",
    "RootImage",
    "MountImages",
    "ExtensionImages",
    "ExtensionDirectories",
    "LogNamespace",
    "DynamicUser",
];

/// systemd-analyze, or `None` (test skipped) when it is missing outside CI.
fn systemd_analyze() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("systemd-analyze"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!(
                "systemd-analyze is not on PATH, and CI is set: the systemd units must be \
                 verified in CI (scripts/install-ops-tools.sh installs it)"
            );
        }
        eprintln!(
            "\n*** SKIPPED: systemd-analyze is not on PATH, so the systemd units were NOT \
             verified. Run scripts/install-ops-tools.sh (Debian package systemd). ***\n"
        );
    }
    found
}

/// The key/value lines of a unit file (comments and section headers dropped), in order.
fn settings(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

fn shipped(name: &str) -> String {
    let path = Path::new(UNITS).join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Writes an executable stand-in for a binary that is not on this machine.
fn stand_in(dir: &Path, name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Copies the shipped units into `dir`, each install path replaced by `binaries[path]`.
/// Every replaced path must occur in its unit, exactly as the first word of ExecStart.
fn copy_units(dir: &Path, binaries: &BTreeMap<&str, PathBuf>) {
    for (name, exec) in SHIPPED {
        let mut text = shipped(name);
        if let Some(install_path) = exec {
            let exec_starts: Vec<String> = settings(&text)
                .into_iter()
                .filter(|(k, _)| k == "ExecStart")
                .map(|(_, v)| v)
                .collect();
            assert_eq!(exec_starts.len(), 1, "{name}: one ExecStart");
            assert!(
                exec_starts[0].starts_with(&format!("{install_path} ")),
                "{name}: ExecStart runs {install_path}: {}",
                exec_starts[0]
            );
            let real = binaries[install_path].display().to_string();
            text = text.replace(install_path, &real);
        }
        std::fs::write(dir.join(name), text).unwrap();
    }
}

/// Runs `systemd-analyze verify` on `units` (paths) and returns (success, every line it
/// printed that concerns these units, everything it printed).
fn verify(analyze: &Path, dir: &Path, units: &[String]) -> (bool, Vec<String>, String) {
    let out = Command::new(analyze)
        .arg("verify")
        .args(units.iter().map(|u| dir.join(u)))
        // Plain diagnostics, whatever the terminal.
        .env("SYSTEMD_COLORS", "0")
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", analyze.display()));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Diagnostics about the host's own units (it loads multi-user.target and friends from
    // the host) are not ours to judge; any line naming one of these units or files is.
    let ours = |line: &str| {
        line.contains(&dir.display().to_string())
            || units.iter().any(|u| line.contains(u.as_str()))
            || SHIPPED.iter().any(|(name, _)| line.contains(name))
    };
    let concerns = all.lines().filter(|l| ours(l)).map(String::from).collect();
    (out.status.success(), concerns, all)
}

fn instance_names() -> Vec<String> {
    SHIPPED
        .iter()
        .map(|(name, _)| name.replace("@.", &format!("@{INSTANCE}.")))
        .collect()
}

#[test]
fn every_shipped_unit_verifies_cleanly() {
    let Some(analyze) = systemd_analyze() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let nfsplugin = stand_in(dir.path(), "nfsplugin");
    let binaries = BTreeMap::from([
        ("/usr/local/bin/cube-csi-bridge", PathBuf::from(BRIDGE)),
        ("/usr/local/bin/nfsplugin", nfsplugin),
    ]);
    copy_units(dir.path(), &binaries);

    // The templates as instances (how systemd loads them), and as the files themselves.
    for units in [
        instance_names(),
        SHIPPED.iter().map(|(n, _)| n.to_string()).collect(),
    ] {
        let (success, concerns, all) = verify(&analyze, dir.path(), &units);
        assert!(
            success && concerns.is_empty(),
            "systemd-analyze verify {units:?} found problems:\n{}\n(full output:\n{all})",
            concerns.join("\n")
        );
        eprintln!("systemd-analyze verify {units:?}: clean");
    }

    // Exposure as systemd rates it, for the record (a figure, not a pass mark).
    let out = Command::new(&analyze)
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(
            dir.path()
                .join(format!("cube-csi-bridge@{INSTANCE}.service")),
        )
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    if let Some(line) = report
        .lines()
        .find(|l| l.contains("Overall exposure level"))
    {
        eprintln!(
            "systemd-analyze security: {}",
            line.trim_start_matches('→').trim()
        );
    }
}

#[test]
fn a_broken_unit_fails_verification() {
    // The check above must be able to fail: the same verify, on units broken three ways.
    let Some(analyze) = systemd_analyze() else {
        return;
    };
    type Mutation = fn(String) -> String;
    let cases: [(&str, Mutation, &str); 3] = [
        (
            "a misspelt setting",
            |t| t.replace("RestartSec=", "RestartSecs="),
            "Unknown key",
        ),
        (
            "a binary that is not there",
            |t| t.replace(BRIDGE, "/nonexistent/cube-csi-bridge"),
            "is not executable",
        ),
        (
            "a bad value",
            |t| t.replace("Type=exec", "Type=sometimes"),
            "Failed to parse",
        ),
    ];
    for (what, break_it, expected) in cases {
        let dir = tempfile::tempdir().unwrap();
        let binaries = BTreeMap::from([
            ("/usr/local/bin/cube-csi-bridge", PathBuf::from(BRIDGE)),
            (
                "/usr/local/bin/nfsplugin",
                stand_in(dir.path(), "nfsplugin"),
            ),
        ]);
        copy_units(dir.path(), &binaries);
        let service = dir.path().join("cube-csi-bridge@.service");
        let text = std::fs::read_to_string(&service).unwrap();
        let broken = break_it(text.clone());
        assert_ne!(broken, text, "{what}: the mutation applies");
        std::fs::write(&service, broken).unwrap();
        let (success, concerns, all) = verify(&analyze, dir.path(), &instance_names());
        assert!(
            !(success && concerns.is_empty()),
            "{what} passed verification:\n{all}"
        );
        assert!(
            concerns.iter().any(|l| l.contains(expected)),
            "{what}: no line says {expected:?}:\n{all}"
        );
    }
}

#[test]
fn the_bridge_unit_gives_the_daemon_no_mount_namespace() {
    let text = shipped("cube-csi-bridge@.service");
    let offending: Vec<String> = settings(&text)
        .into_iter()
        .filter(|(k, v)| {
            MOUNT_NAMESPACE_SETTINGS.contains(&k.as_str())
                && !matches!(v.as_str(), "no" | "false" | "" | "shared")
        })
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    assert!(
        offending.is_empty(),
        "cube-csi-bridge@.service would get a mount namespace of its own: {offending:?}"
    );
}

/// Every socket family the daemon opens is one the unit lets it open: a family left out
/// fails at run time with EAFNOSUPPORT and an error that points elsewhere (before, the
/// sock_diag lookup behind `serve.tcp` + `serve.allowed_uids` was refused and the daemon
/// asked the operator to load tcp_diag).
#[test]
fn the_bridge_unit_allows_every_socket_family_the_daemon_opens() {
    let service = settings(&shipped("cube-csi-bridge@.service"));
    let allowed: Vec<String> = service
        .iter()
        .filter(|(k, _)| k == "RestrictAddressFamilies")
        .flat_map(|(_, v)| v.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .collect();
    let source = |path: &str| {
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
    };
    let opened = [
        (
            "AF_NETLINK",
            "src/transport/listener/sock_diag.rs",
            "AddressFamily::Netlink",
        ),
        ("AF_UNIX", "src/transport/listener.rs", "UnixListener"),
    ];
    for (family, file, sign) in opened {
        assert!(
            source(file).contains(sign),
            "{file} no longer opens {family}"
        );
        assert!(
            allowed.iter().any(|a| a == family),
            "{file} opens {family}, which cube-csi-bridge@.service does not allow: {allowed:?}"
        );
    }
}

#[test]
fn the_units_agree_with_the_bridge_defaults() {
    let service = settings(&shipped("cube-csi-bridge@.service"));
    let get = |key: &str| -> Vec<&str> {
        service
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    };
    assert_eq!(
        get("ExecStart"),
        ["/usr/local/bin/cube-csi-bridge serve --config /etc/cube-csi-bridge/%i.toml"]
    );
    assert_eq!(get("Requires"), ["cube-csi-bridge@%i.socket"]);

    // The socket the unit listens on is the one a config with `driver = "<instance>"` and no
    // serve.socket serves, and the one `register` tells Cube to dial.
    let socket = settings(&shipped("cube-csi-bridge@.socket"));
    let listen: Vec<&str> = socket
        .iter()
        .filter(|(k, _)| k == "ListenStream")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(listen.len(), 1, "one ListenStream");
    let config = Config::parse(
        &format!(
            "driver = \"{INSTANCE}\"\n[csi]\nendpoint = \"unix:///run/csi/{INSTANCE}.sock\"\n"
        ),
        Path::new("nfs.toml"),
    )
    .unwrap();
    assert_eq!(
        Path::new(&listen[0].replace("%i", INSTANCE)),
        config.socket_path(),
        "ListenStream is the config's default socket"
    );
    assert!(
        socket.contains(&("SocketMode".into(), "0660".into())),
        "socket mode 0660, as serve sets it"
    );

    // The example driver listens where the example config (README) points the bridge.
    let driver = settings(&shipped("csi-nfs.service"));
    let exec = &driver.iter().find(|(k, _)| k == "ExecStart").unwrap().1;
    assert!(
        exec.contains(&format!("--endpoint unix:///run/csi/{INSTANCE}.sock")),
        "{exec}"
    );
    assert!(
        service.contains(&("After".into(), "csi-%i.service".into())),
        "the bridge is ordered after csi-<driver>.service"
    );
}

#[test]
fn one_template_instance_serves_every_driver_of_a_file_with_the_printed_drop_in() {
    let Some(analyze) = systemd_analyze() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let nfsplugin = stand_in(dir.path(), "nfsplugin");
    let binaries = BTreeMap::from([
        ("/usr/local/bin/cube-csi-bridge", PathBuf::from(BRIDGE)),
        ("/usr/local/bin/nfsplugin", nfsplugin),
    ]);
    copy_units(dir.path(), &binaries);
    // A file listing two drivers, as /etc/cube-csi-bridge/config.toml would.
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        "[[drivers]]\ndriver = \"nfs\"\n[drivers.csi]\nendpoint = \"unix:///run/csi/nfs.sock\"\n\
         [[drivers]]\ndriver = \"local\"\n[drivers.csi]\nendpoint = \"unix:///run/csi/local.sock\"\n",
    )
    .unwrap();
    let out = Command::new(BRIDGE)
        .args(["register", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{printed}");
    let drop_in_at = printed
        .find("cube-csi-bridge@config.socket.d/drivers.conf:")
        .unwrap_or_else(|| panic!("register prints the socket drop-in:\n{printed}"));
    let drop_in: String = printed[drop_in_at..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    let listen: Vec<(String, String)> = settings(&drop_in)
        .into_iter()
        .filter(|(k, _)| k == "ListenStream")
        .collect();
    let expected: Vec<(String, String)> = [
        "",
        "/run/cube-csi-bridge/nfs.sock",
        "/run/cube-csi-bridge/local.sock",
    ]
    .iter()
    .map(|v| ("ListenStream".to_string(), v.to_string()))
    .collect();
    assert_eq!(
        listen, expected,
        "reset, then one socket per driver:\n{drop_in}"
    );
    let drop_in_dir = dir.path().join("cube-csi-bridge@config.socket.d");
    std::fs::create_dir(&drop_in_dir).unwrap();
    std::fs::write(drop_in_dir.join("drivers.conf"), &drop_in).unwrap();
    let units = [
        "cube-csi-bridge@config.service".to_string(),
        "cube-csi-bridge@config.socket".to_string(),
    ];
    let (success, concerns, all) = verify(&analyze, dir.path(), &units);
    assert!(
        success && concerns.is_empty(),
        "systemd-analyze verify {units:?} found problems:\n{}\n(full output:\n{all})",
        concerns.join("\n")
    );
}
