//! A real Kubernetes API for tests: etcd + kube-apiserver on loopback, started by
//! tests/k8s-peers/start-apiserver.sh from the binaries scripts/install-k8s-peers.sh
//! builds (their directory is `$CUBE_CSI_BRIDGE_K8S_BIN`), plus helm from the same place.

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

pub const K8S_BIN_ENV: &str = "CUBE_CSI_BRIDGE_K8S_BIN";
const PEERS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/k8s-peers");
pub const CHART_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/cube-csi-bridge");

/// The directory holding kube-apiserver, etcd and helm, or `None` (test skipped).
pub fn k8s_bin() -> Option<PathBuf> {
    let dir = std::env::var_os(K8S_BIN_ENV).filter(|v| !v.is_empty())?;
    let dir = PathBuf::from(dir);
    for tool in ["kube-apiserver", "etcd", "helm"] {
        assert!(
            dir.join(tool).is_file(),
            "{K8S_BIN_ENV}={} has no {tool}: run scripts/install-k8s-peers.sh",
            dir.display()
        );
    }
    Some(dir)
}

/// Skips the test unless the Kubernetes peers are built (fails it in CI); yields their bin
/// dir.
#[macro_export]
macro_rules! require_k8s_peers {
    () => {
        match common::k8s::k8s_bin() {
            Some(dir) => dir,
            None => {
                common::skip(&format!(
                    "{} is not set (the dir holding kube-apiserver, etcd and helm; see \
                     scripts/install-k8s-peers.sh)",
                    common::k8s::K8S_BIN_ENV
                ));
                return;
            }
        }
    };
}

/// A running API server; stopped (and its data removed) on drop.
pub struct ApiServer {
    pub dir: tempfile::TempDir,
    pub bin: PathBuf,
    /// Admin kubeconfig (group system:masters).
    pub kubeconfig: PathBuf,
}

impl ApiServer {
    pub fn start(bin: &Path) -> ApiServer {
        let dir = tempfile::Builder::new()
            .prefix("ccb-k8s-")
            .tempdir()
            .unwrap();
        // The script picks free loopback ports and lets them go before etcd and
        // kube-apiserver bind them; another test may take one meanwhile. Such a start is
        // tried again (the script stops what a failed start left, in the same dir).
        let mut attempt = 0;
        let out = loop {
            attempt += 1;
            let out = Command::new("bash")
                .arg(Path::new(PEERS_DIR).join("start-apiserver.sh"))
                .arg(dir.path())
                .arg(bin)
                .output()
                .unwrap();
            let lost_a_port =
                String::from_utf8_lossy(&out.stderr).contains("address already in use");
            if out.status.success() || !lost_a_port || attempt == 3 {
                break out;
            }
            eprintln!("start-apiserver.sh lost a port to another process; starting again");
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "start-apiserver.sh failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let kubeconfig = PathBuf::from(stdout.lines().last().expect("kubeconfig path").trim());
        ApiServer {
            dir,
            bin: bin.to_path_buf(),
            kubeconfig,
        }
    }

    /// An admin client.
    pub async fn admin(&self) -> kube::Client {
        client_from(&self.kubeconfig).await
    }

    /// Runs helm against this server; returns (success, stdout+stderr).
    pub fn helm(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(self.bin.join("helm"))
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("HELM_CACHE_HOME", self.dir.path().join("helm/cache"))
            .env("HELM_CONFIG_HOME", self.dir.path().join("helm/config"))
            .env("HELM_DATA_HOME", self.dir.path().join("helm/data"))
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// A kubeconfig that authenticates as a ServiceAccount (a token from the
    /// TokenRequest API), so the bridge runs with exactly the RBAC the chart grants.
    pub async fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> PathBuf {
        let api: Api<ServiceAccount> = Api::namespaced(self.admin().await, namespace);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        let issued = api
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .expect("TokenRequest for the chart's ServiceAccount");
        let token = issued.status.expect("token status").token;
        let admin = Kubeconfig::read_from(&self.kubeconfig).unwrap();
        let cluster = admin.clusters[0].cluster.clone().expect("cluster entry");
        let text = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {
                "server": cluster.server,
                "certificate-authority-data": cluster.certificate_authority_data,
                "certificate-authority": cluster.certificate_authority,
            }}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": name, "namespace": namespace}}],
            "current-context": "test",
        });
        let path = self
            .dir
            .path()
            .join(format!("sa-{namespace}-{name}.kubeconfig"));
        // JSON is YAML, and kubeconfig readers take it. Private, whatever the umask: it
        // holds a token, and the bridge refuses a kubeconfig others could change.
        {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .and_then(|mut file| file.write_all(&serde_json::to_vec_pretty(&text).unwrap()))
                .unwrap();
        }
        path
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(Path::new(PEERS_DIR).join("stop-apiserver.sh"))
            .arg(self.dir.path())
            .output();
    }
}

pub async fn client_from(kubeconfig: &Path) -> kube::Client {
    let config = kube::Config::from_custom_kubeconfig(
        Kubeconfig::read_from(kubeconfig).unwrap(),
        &KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    kube::Client::try_from(config).unwrap()
}
