//! A real Kubernetes API for the Kubernetes-store figures: etcd + kube-apiserver started
//! by tests/k8s-peers/start-apiserver.sh, the chart's CubeVolume CRD posted to it, and
//! CubeVolume objects written straight to the API (in parallel) to fill the store.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use cube_csi_bridge::k8s::volumes::object_name;
use cube_csi_bridge::k8s::{CRD_GROUP, CRD_KIND, CRD_PLURAL, CRD_VERSION};
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::{ApiResource, GroupVersionKind};

const PEERS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/k8s-peers");
const CRD_FILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/charts/cube-csi-bridge/crds/cubevolumes.csibridge.cubesandbox.io.yaml"
);
/// Where the CubeVolume objects live.
pub const NAMESPACE: &str = "default";

/// A running API server, stopped on drop.
pub struct ApiServer {
    dir: PathBuf,
    pub kubeconfig: PathBuf,
}

impl ApiServer {
    pub fn start(bin: &Path, dir: &Path) -> anyhow::Result<ApiServer> {
        let out = Command::new("bash")
            .arg(Path::new(PEERS_DIR).join("start-apiserver.sh"))
            .arg(dir)
            .arg(bin)
            .output()?;
        if !out.status.success() {
            bail!(
                "start-apiserver.sh failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let kubeconfig = PathBuf::from(stdout.lines().last().context("no kubeconfig")?.trim());
        let server = ApiServer {
            dir: dir.to_path_buf(),
            kubeconfig,
        };
        server.install_crd()?;
        Ok(server)
    }

    /// Posts the chart's CRD as it is (the API server takes YAML) and waits until the
    /// CubeVolume collection is served.
    fn install_crd(&self) -> anyhow::Result<()> {
        let env = std::fs::read_to_string(self.dir.join("env"))?;
        let var = |key: &str| {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("{key}=")))
                .map(str::to_string)
                .with_context(|| format!("{key} missing from the API server's env file"))
        };
        let (url, ca) = (var("KUBE_APISERVER_URL")?, var("KUBE_CA_FILE")?);
        let token_file = self.dir.join("token");
        let auth_header = format!(
            "Authorization: Bearer {}",
            std::fs::read_to_string(&token_file)?.trim()
        );
        // The header goes through a file so that the token never shows in a process list.
        let header_file = self.dir.join("auth-header");
        {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&header_file)?;
            file.write_all(auth_header.as_bytes())?;
        }
        // `quiet`: a failure is expected (polling) and says nothing on stderr.
        let curl = |args: &[&str], quiet: bool| -> anyhow::Result<bool> {
            let stderr = if quiet {
                std::process::Stdio::null()
            } else {
                std::process::Stdio::inherit()
            };
            let status = Command::new("curl")
                .args(["-fsS", "--max-time", "10", "--cacert", &ca, "-H"])
                .arg(format!("@{}", header_file.display()))
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(stderr)
                .status()?;
            Ok(status.success())
        };
        if !curl(
            &[
                "-H",
                "Content-Type: application/yaml",
                "--data-binary",
                &format!("@{CRD_FILE}"),
                &format!("{url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions"),
            ],
            false,
        )? {
            bail!("posting the CubeVolume CRD failed");
        }
        let collection =
            format!("{url}/apis/{CRD_GROUP}/{CRD_VERSION}/namespaces/{NAMESPACE}/{CRD_PLURAL}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !curl(&[&collection], true)? {
            if Instant::now() > deadline {
                bail!("the CubeVolume CRD was not served within 30 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        let config = kube::Config::from_custom_kubeconfig(
            Kubeconfig::read_from(&self.kubeconfig)?,
            &KubeConfigOptions::default(),
        )
        .await?;
        Ok(kube::Client::try_from(config)?)
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(Path::new(PEERS_DIR).join("stop-apiserver.sh"))
            .arg(&self.dir)
            .output();
    }
}

fn cube_volumes(client: kube::Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(CRD_GROUP, CRD_VERSION, CRD_KIND);
    let resource = ApiResource::from_gvk_with_plural(&gvk, CRD_PLURAL);
    Api::namespaced_with(client, NAMESPACE, &resource)
}

/// Writes CubeVolume objects for `ids` as the bridge would have recorded them after a
/// Create (state Created, a CSI handle), `parallel` requests at a time.
pub async fn fill(
    client: &kube::Client,
    driver: &str,
    csi_driver: &str,
    ids: Vec<String>,
    parallel: usize,
) -> anyhow::Result<()> {
    let api = cube_volumes(client.clone());
    let ids = Arc::new(ids);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..parallel {
        let (api, ids, next) = (api.clone(), ids.clone(), next.clone());
        let (driver, csi_driver) = (driver.to_string(), csi_driver.to_string());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(id) = ids.get(i) else { break };
                let object: DynamicObject = serde_json::from_value(serde_json::json!({
                    "apiVersion": format!("{CRD_GROUP}/{CRD_VERSION}"),
                    "kind": CRD_KIND,
                    "metadata": {
                        "name": object_name(&driver, id),
                        "labels": { "csibridge.cubesandbox.io/driver": driver },
                    },
                    "spec": {
                        "driver": driver,
                        "volumeId": id,
                        "csiDriver": csi_driver,
                        "csiName": format!("cube-{id}"),
                        "state": "Created",
                        "csiVolumeId": format!("cube-{id}"),
                        "capacityBytes": 0,
                        "updatedAt": 1,
                    },
                }))?;
                api.create(&PostParams::default(), &object)
                    .await
                    .with_context(|| format!("creating CubeVolume of {id}"))?;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(())
}

/// The CubeVolume writes of `ids.len()` Creates made straight to the API at once, as the
/// bridge makes them for each Create of a new volume: the object created in state
/// Creating (no read first: a create of an existing one is refused), then replaced in
/// state Created (the CSI handle added). The wall time of all.
pub async fn create_storm(
    client: &kube::Client,
    driver: &str,
    csi_driver: &str,
    ids: &[String],
) -> anyhow::Result<Duration> {
    let api = cube_volumes(client.clone());
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for id in ids {
        let (api, id) = (api.clone(), id.clone());
        let (driver, csi_driver) = (driver.to_string(), csi_driver.to_string());
        tasks.spawn(async move {
            let name = object_name(&driver, &id);
            let object = |state: &str, handle: Option<String>, version: Option<String>| {
                serde_json::from_value::<DynamicObject>(serde_json::json!({
                    "apiVersion": format!("{CRD_GROUP}/{CRD_VERSION}"),
                    "kind": CRD_KIND,
                    "metadata": {
                        "name": name,
                        "labels": { "csibridge.cubesandbox.io/driver": driver },
                        "resourceVersion": version,
                    },
                    "spec": {
                        "driver": driver,
                        "volumeId": id,
                        "csiDriver": csi_driver,
                        "csiName": format!("cube-{id}"),
                        "state": state,
                        "csiVolumeId": handle,
                        "capacityBytes": 0,
                        "updatedAt": 1,
                    },
                }))
            };
            let created = api
                .create(&PostParams::default(), &object("Creating", None, None)?)
                .await
                .with_context(|| format!("creating CubeVolume of {id}"))?;
            let version = created.metadata.resource_version.clone();
            api.replace(
                &name,
                &PostParams::default(),
                &object("Created", Some(format!("cube-{id}")), version)?,
            )
            .await
            .with_context(|| format!("updating CubeVolume of {id}"))?;
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(started.elapsed())
}

/// How many CubeVolume objects the namespace holds.
pub async fn count(client: &kube::Client) -> anyhow::Result<usize> {
    let list = cube_volumes(client.clone())
        .list_metadata(&ListParams::default())
        .await?;
    let mut n = list.items.len();
    let mut token = list.metadata.continue_;
    while let Some(t) = token.filter(|t| !t.is_empty()) {
        let page = cube_volumes(client.clone())
            .list_metadata(&ListParams::default().continue_token(&t))
            .await?;
        n += page.items.len();
        token = page.metadata.continue_;
    }
    Ok(n)
}
