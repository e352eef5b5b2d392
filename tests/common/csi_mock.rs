//! csi-test's mock driver (`cmd/mock-driver` of csi-test v4.2.0, unmodified, built by
//! scripts/install-test-peers.sh as `csi-mock`): a CSI implementation someone else wrote,
//! served from a package registry. It mounts nothing (NodePublishVolume only makes the
//! target directory), keeps its volumes in memory, and logs every call it receives as
//! JSON, secrets included, which is what the tests read. See tests/peers/README.md.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::cube_peers::{PEERS_BIN_ENV, peer_dir};
use super::fake_driver::MUTATING;

/// The mock's CSI name; also its node id (NodeGetInfo), which ControllerPublishVolume
/// must be given.
pub const MOCK_NAME: &str = "mock.csi.test";

/// The directory holding csi-mock (and cubeclient), from `CUBE_CSI_BRIDGE_PEERS_BIN`.
pub fn mock_bin() -> Option<PathBuf> {
    peer_dir(
        PEERS_BIN_ENV,
        &["csi-mock"],
        "scripts/install-test-peers.sh",
    )
}

/// Skips the test unless csi-mock is built (in CI a missing one fails instead); yields
/// the directory holding it.
#[macro_export]
macro_rules! require_csi_mock {
    () => {{
        match common::csi_mock::mock_bin() {
            Some(bin) => bin,
            None => return,
        }
    }};
}

/// How csi-mock is started.
#[derive(Debug, Clone, Default)]
pub struct MockOptions {
    /// `-disable-attach`: no PUBLISH_UNPUBLISH_VOLUME.
    pub disable_attach: bool,
    /// `CSI_ENABLE_CREDS=true`.
    pub enable_creds: bool,
    /// `-hooks-file`: this YAML (JavaScript hooks that may fail a call).
    pub hooks: Option<String>,
    /// `-enable-topology`: VOLUME_ACCESSIBILITY_CONSTRAINTS; NodeGetInfo and every volume
    /// report the one topology [`MOCK_TOPOLOGY_KEY`] = [`MOCK_TOPOLOGY_NODE`].
    pub enable_topology: bool,
    /// More flags, e.g. `-node-expand-required`, `-disable-online-expansion`.
    pub flags: Vec<&'static str>,
}

/// The mock's topology key and its node's segment (fixed in csi-test, whatever `-name`).
pub const MOCK_TOPOLOGY_KEY: &str = "io.kubernetes.storage.mock/node";
pub const MOCK_TOPOLOGY_NODE: &str = "some-mock-node";

/// One running csi-mock; killed on drop.
pub struct MockDriver {
    child: std::process::Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

/// One call as csi-mock logged it.
#[derive(Debug, Clone)]
pub struct MockCall {
    /// The method's last path element, e.g. "CreateVolume".
    pub method: String,
    pub request: serde_json::Value,
    /// The gRPC error text; empty on success.
    pub error: String,
}

impl MockDriver {
    pub fn start(bin: &Path, dir: &Path, options: &MockOptions) -> MockDriver {
        let socket = dir.join("mock.sock");
        let log = dir.join("mock.log");
        let mut command = std::process::Command::new(bin.join("csi-mock"));
        command.args([&format!("-name={MOCK_NAME}"), "-v=5", "-skip_headers"]);
        if options.disable_attach {
            command.arg("-disable-attach");
        }
        if options.enable_topology {
            command.arg("-enable-topology");
        }
        if let Some(hooks) = &options.hooks {
            let file = dir.join("mock-hooks.yaml");
            std::fs::write(&file, hooks).unwrap();
            command.arg(format!("-hooks-file={}", file.display()));
        }
        if options.enable_creds {
            command.env("CSI_ENABLE_CREDS", "true");
        }
        command.args(&options.flags);
        let mut child = command
            .env("CSI_ENDPOINT", &socket)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                return MockDriver { child, socket, log };
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "csi-mock exited with {status}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "csi-mock did not listen: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// Every call logged so far, in order.
    pub fn calls(&self) -> Vec<MockCall> {
        std::fs::read_to_string(&self.log)
            .unwrap()
            .lines()
            .filter_map(|line| line.split_once("gRPCCall: ").map(|(_, json)| json))
            .filter_map(|json| serde_json::from_str::<serde_json::Value>(json).ok())
            .map(|call| MockCall {
                method: call["Method"]
                    .as_str()
                    .and_then(|m| m.rsplit('/').next())
                    .unwrap_or_default()
                    .to_string(),
                request: call["Request"].clone(),
                error: call["Error"].as_str().unwrap_or_default().to_string(),
            })
            .collect()
    }

    /// The requests of every successful call to `method` (e.g. "CreateVolume").
    pub fn requests(&self, method: &str) -> Vec<serde_json::Value> {
        self.calls()
            .into_iter()
            .filter(|c| c.method == method)
            .map(|c| {
                assert_eq!(c.error, "", "{method} failed in the mock: {c:?}");
                c.request
            })
            .collect()
    }

    /// The methods of the successful state-changing calls, in order.
    pub fn mutating(&self) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter(|c| c.error.is_empty() && MUTATING.contains(&c.method.as_str()))
            .map(|c| c.method)
            .collect()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for MockDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
