//! The `serve` daemon's Unix socket answers every mainstream gRPC client, not only grpc-go:
//! a Python grpcio client (grpc-core) with default options, and grpcurl, each call all four
//! hooks and succeed. grpc-core sends the percent-encoded socket path as the HTTP/2
//! `:authority` (`tmp%2Fccb-test-…%2Fbridge.sock`), grpc-java the raw path; h2 alone
//! resets such streams with PROTOCOL_ERROR (src/transport/authority_filter.rs has the details and the
//! fix). grpcurl v1.9.4 sends `localhost`, so it also runs with `-authority` set to the
//! socket path, as grpc-java and older grpcurl releases send it.
//!
//! Needs root (the fake driver bind-mounts), `CUBE_CSI_BRIDGE_PYTHON_BIN` (the venv of
//! scripts/install-python-peers.sh) and `CUBE_CSI_BRIDGE_PEERS_BIN` (grpcurl, from
//! scripts/install-test-peers.sh); skips without them, except in CI (`CI=true`).

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use common::cube_peers::{PEERS_BIN_ENV, peer_dir};
use common::fake_driver::Caps;
use common::{Mode, World};
use serde_json::{Value, json};

const PYTHON_BIN_ENV: &str = "CUBE_CSI_BRIDGE_PYTHON_BIN";
const REPO: &str = env!("CARGO_MANIFEST_DIR");
const SERVICE: &str = "cubelet.services.volumeplugin.v1";

/// The four hooks of one volume's lifecycle, as Cube sends them.
fn create_request(volume_id: &str) -> Value {
    json!({"volume_id": volume_id, "name": volume_id})
}

fn attach_request(w: &World, volume_id: &str, private_data: &str) -> Value {
    json!({
        "sandbox_id": "sb-1",
        "namespace": "default",
        "volume_id": volume_id,
        "volume_base_dir": w.base_dir.display().to_string(),
        "ref_count": 0,
        "private_data": private_data,
    })
}

fn detach_request(volume_id: &str, metadata: &Value) -> Value {
    json!({
        "sandbox_id": "sb-1",
        "namespace": "default",
        "volume_id": volume_id,
        "ref_count": 0,
        "metadata": metadata,
    })
}

/// Asserts the fake driver saw exactly one whole lifecycle, and forgets it.
fn assert_one_lifecycle(w: &World, who: &str) {
    assert_eq!(
        w.driver.mutating_calls(),
        [
            "CreateVolume",
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "DeleteVolume",
        ],
        "{who}"
    );
    w.driver.clear_calls();
    assert_eq!(w.mounts(), Vec::<PathBuf>::new(), "{who}: nothing mounted");
    assert_eq!(w.journal_records(), 0, "{who}: no journal record");
}

/// tests/python/cube_hooks.py: one grpcio channel, one JSON call per line.
struct PythonClient {
    child: Child,
    /// Closed on drop: the script then ends and removes its stub directory.
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl PythonClient {
    fn start(python_bin: &Path, target: &str) -> PythonClient {
        let mut child = Command::new(python_bin.join("python"))
            .arg(Path::new(REPO).join("tests/python/cube_hooks.py"))
            .arg(target)
            .arg(Path::new(REPO).join("proto"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        PythonClient {
            child,
            stdin: Some(stdin),
            stdout,
        }
    }

    /// One hook; Ok(response) or Err((code name, details)).
    fn call(&mut self, method: &str, request: Value) -> Result<Value, (String, String)> {
        let line = json!({"method": method, "request": request}).to_string();
        let stdin = self.stdin.as_mut().expect("open until drop");
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let mut answer = String::new();
        self.stdout.read_line(&mut answer).unwrap();
        let answer: Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("cube_hooks.py answered {answer:?} to {method} ({e})"));
        if answer["ok"] == true {
            Ok(answer["response"].clone())
        } else {
            let text = |k: &str| answer[k].as_str().unwrap_or_default().to_string();
            Err((text("code"), text("details")))
        }
    }
}

impl Drop for PythonClient {
    fn drop(&mut self) {
        drop(self.stdin.take());
        for _ in 0..500 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn python_grpcio_with_default_options_calls_all_four_hooks() {
    require_root!();
    let Some(python) = peer_dir(
        PYTHON_BIN_ENV,
        &["python"],
        "scripts/install-python-peers.sh",
    ) else {
        return;
    };
    let w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let target = format!("unix://{}", w.socket().display());
    // The daemon runs the client on its own thread pool; the calls below block.
    let mut py = PythonClient::start(&python, &target);
    let w = tokio::task::spawn_blocking(move || {
        let created = py
            .call("Create", create_request("py-1"))
            .unwrap_or_else(|e| panic!("Create from grpcio: {e:?}"));
        let private_data = created["private_data"].as_str().expect("private_data");
        assert!(!private_data.is_empty());

        // A refused request comes back as the bridge's status, not a protocol error.
        let refused = py
            .call("Attach", attach_request(&w, "py-1", "not-a-handle"))
            .unwrap_err();
        assert_eq!(refused.0, "INVALID_ARGUMENT", "{refused:?}");
        assert!(refused.1.contains("private_data"), "{refused:?}");

        let attached = py
            .call("Attach", attach_request(&w, "py-1", private_data))
            .unwrap_or_else(|e| panic!("Attach from grpcio: {e:?}"));
        let host_path = PathBuf::from(attached["host_path"].as_str().expect("host_path"));
        assert_eq!(host_path, w.base_dir.join("fake+py-1"));
        assert!(w.mounts().contains(&host_path), "host_path is mounted");
        py.call("Detach", detach_request("py-1", &attached["metadata"]))
            .unwrap_or_else(|e| panic!("Detach from grpcio: {e:?}"));
        py.call("Destroy", json!({"volume_id": "py-1"}))
            .unwrap_or_else(|e| panic!("Destroy from grpcio: {e:?}"));
        w
    })
    .await
    .unwrap();
    assert_one_lifecycle(&w, "grpcio");
    // The client did send the socket path: the daemon rewrote it (debug log).
    assert!(
        w.logs().contains("rewriting an HTTP/2 :authority"),
        "grpcio's authority went through the rewrite: {}",
        w.logs()
    );
}

/// grpcurl against the daemon's socket; Ok(response JSON) or Err(grpcurl's output).
fn grpcurl(
    bin: &Path,
    socket: &Path,
    authority: Option<&str>,
    method: &str,
    request: &Value,
) -> Result<Value, String> {
    let mut cmd = Command::new(bin.join("grpcurl"));
    cmd.args(["-plaintext", "-unix", "-max-time", "60"]);
    if let Some(authority) = authority {
        cmd.args(["-authority", authority]);
    }
    let out = cmd
        .arg("-import-path")
        .arg(Path::new(REPO).join("proto"))
        .args(["-proto", "cube/v1/volumeplugin.proto", "-d"])
        .arg(request.to_string())
        .arg(socket)
        .arg(method)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "{}{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("grpcurl printed {stdout:?} ({e})")),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_calls_all_four_hooks() {
    require_root!();
    let Some(peers) = peer_dir(PEERS_BIN_ENV, &["grpcurl"], "scripts/install-test-peers.sh") else {
        return;
    };
    let w = World::start(Mode::Rpc, Caps::staging(), "").await;
    let socket = w.socket();
    let socket_text = socket.display().to_string();
    for authority in [None, Some(socket_text.as_str())] {
        let who = format!("grpcurl, authority {authority:?}");
        let call = |method: &str, request: Value| {
            grpcurl(&peers, &socket, authority, method, &request)
                .unwrap_or_else(|e| panic!("{who}: {method}: {e}"))
        };
        let created = call(
            &format!("{SERVICE}.VolumeControllerService/Create"),
            create_request("curl-1"),
        );
        // grpcurl prints proto3 JSON (lowerCamelCase names).
        let private_data = created["privateData"].as_str().expect("privateData");
        let attached = call(
            &format!("{SERVICE}.VolumePluginService/Attach"),
            attach_request(&w, "curl-1", private_data),
        );
        let host_path = PathBuf::from(attached["hostPath"].as_str().expect("hostPath"));
        assert!(w.mounts().contains(&host_path), "{who}: mounted");
        let metadata: HashMap<String, String> =
            serde_json::from_value(attached["metadata"].clone()).unwrap();
        assert!(!metadata.is_empty(), "{who}: metadata for Detach");
        call(
            &format!("{SERVICE}.VolumePluginService/Detach"),
            detach_request("curl-1", &attached["metadata"]),
        );
        call(
            &format!("{SERVICE}.VolumeControllerService/Destroy"),
            json!({"volume_id": "curl-1"}),
        );
        assert_one_lifecycle(&w, &who);
    }
}
