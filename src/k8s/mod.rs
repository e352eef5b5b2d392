//! The Kubernetes API side: one lazily connected client, StorageClass and Secret reuse
//! (the core's `VolumeSettings` port), and the CubeVolume objects (a `ControllerStore`).
//!
//! Nothing here contacts the API server until a hook (or `check`) needs it, so a bridge
//! whose config names no Kubernetes feature never loads a kubeconfig.

mod cache;
pub mod names;
pub mod record_key;
pub mod snapshots;
pub mod storage_class;
pub mod volumes;

use std::path::PathBuf;
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::config::KubernetesSettings;

pub use snapshots::CubeSnapshotStore;
pub use storage_class::{ResolvedClass, StorageClassSource};
pub use volumes::{CRD_GROUP, CRD_KIND, CRD_PLURAL, CRD_VERSION, CubeVolumeStore};

/// A Kubernetes API failure, naming what was being read or written.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// No usable client configuration (kubeconfig, service account).
    #[error("Kubernetes API: cannot configure a client from {source_desc}: {message}")]
    Configure {
        source_desc: String,
        message: String,
    },
    /// The API server answered with an error status, or could not be reached.
    #[error("Kubernetes API: {action}: {message}")]
    Api {
        action: String,
        /// The HTTP status when the server answered.
        code: Option<u16>,
        message: String,
    },
    /// An object was read but cannot be used as it is (the message says how to fix it).
    #[error("{0}")]
    Unusable(String),
}

impl KubeError {
    /// Wraps a client error with what was being done.
    pub fn api(action: impl Into<String>, error: kube::Error) -> Self {
        let action = action.into();
        match error {
            kube::Error::Api(status) => {
                let hint = match status.code {
                    401 => " (the credentials were refused)",
                    403 => {
                        " (the bridge's RBAC does not allow this; see the chart's Role and ClusterRole)"
                    }
                    _ => "",
                };
                KubeError::Api {
                    action,
                    code: Some(status.code),
                    message: format!("{} {}{hint}", status.code, status.message),
                }
            }
            other => KubeError::Api {
                action,
                code: None,
                message: other.to_string(),
            },
        }
    }

    /// Whether retrying later could help (the server was unreachable or overloaded).
    pub fn is_transient(&self) -> bool {
        match self {
            KubeError::Api { code: None, .. } => true,
            KubeError::Api { code: Some(c), .. } => matches!(c, 429 | 500 | 502 | 503 | 504),
            _ => false,
        }
    }
}

/// How long one API request may take before it counts as unreachable.
const READ_TIMEOUT: Duration = Duration::from_secs(20);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The bridge's connection to the API server, made on first use and then shared.
pub struct Kube {
    settings: KubernetesSettings,
    connected: tokio::sync::OnceCell<(kube::Client, String)>,
}

impl std::fmt::Debug for Kube {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kube")
            .field("kubeconfig", &self.settings.kubeconfig)
            .field("namespace", &self.settings.namespace)
            .finish_non_exhaustive()
    }
}

impl Kube {
    pub fn new(settings: &KubernetesSettings) -> Self {
        Self {
            settings: settings.clone(),
            connected: tokio::sync::OnceCell::new(),
        }
    }

    /// The namespace of the bridge's own objects, when known without connecting (the
    /// config's, or the one an earlier connection found).
    pub fn namespace_hint(&self) -> Option<&str> {
        self.settings
            .namespace
            .as_deref()
            .or_else(|| self.connected.get().map(|(_, ns)| ns.as_str()))
    }

    /// The client and the namespace of the bridge's own objects.
    pub async fn client(&self) -> Result<&(kube::Client, String), KubeError> {
        self.connected.get_or_try_init(|| self.connect()).await
    }

    async fn connect(&self) -> Result<(kube::Client, String), KubeError> {
        let (mut config, source_desc) = match &self.settings.kubeconfig {
            Some(path) => (load_kubeconfig(path).await?, path.display().to_string()),
            None => {
                check_inferred_kubeconfigs()?;
                let config = kube::Config::infer()
                    .await
                    .map_err(|e| KubeError::Configure {
                        source_desc: "$KUBECONFIG, ~/.kube/config or the pod's service account"
                            .into(),
                        message: e.to_string(),
                    })?;
                (config, "the inferred configuration".to_string())
            }
        };
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        config.read_timeout = Some(READ_TIMEOUT);
        config.write_timeout = Some(READ_TIMEOUT);
        let namespace = self
            .settings
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = kube::Client::try_from(config).map_err(|e| KubeError::Configure {
            source_desc,
            message: e.to_string(),
        })?;
        tracing::debug!(%namespace, "Kubernetes API client configured");
        Ok((client, namespace))
    }
}

/// The kubeconfig files `kube::Config::infer` would read (`$KUBECONFIG`'s, else
/// `~/.kube/config`), held to the config file's rule as an explicit one is: a forked hook
/// inherits Cubelet's environment and home. The files they name (a token file, a CA) and
/// the program an `exec` entry names are not checked here.
fn check_inferred_kubeconfigs() -> Result<(), KubeError> {
    let candidates: Vec<PathBuf> = match std::env::var_os("KUBECONFIG") {
        Some(list) => std::env::split_paths(&list)
            .filter(|p| !p.as_os_str().is_empty())
            .collect(),
        None => std::env::var_os("HOME")
            .map(|home| PathBuf::from(home).join(".kube/config"))
            .into_iter()
            .collect(),
    };
    for path in candidates.iter().filter(|p| p.exists()) {
        crate::config::check_trusted_file(path).map_err(|message| KubeError::Configure {
            source_desc: path.display().to_string(),
            message,
        })?;
    }
    Ok(())
}

async fn load_kubeconfig(path: &PathBuf) -> Result<kube::Config, KubeError> {
    let configure = |e: &dyn std::fmt::Display| KubeError::Configure {
        source_desc: path.display().to_string(),
        message: e.to_string(),
    };
    // A kubeconfig says which API server to believe and may name a command to run for
    // credentials (`exec`): one that another user could change or replace is theirs to
    // run as root, as the config file would be.
    crate::config::check_trusted_file(path).map_err(|e| configure(&e))?;
    let kubeconfig = Kubeconfig::read_from(path).map_err(|e| configure(&e))?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| configure(&e))
}

#[cfg(test)]
mod kubeconfig_tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A kubeconfig another user could change (here: writable by others) is refused
    /// before it is read: its `exec` command would run as root. The bridge's own loads.
    #[tokio::test]
    async fn a_kubeconfig_another_user_could_change_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let error = load_kubeconfig(&path).await.unwrap_err().to_string();
        assert!(
            error.contains("writable by its group or by others"),
            "{error}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        load_kubeconfig(&path).await.unwrap();
        // Inferred from $KUBECONFIG (as a forked hook inherits it): the same rule.
        // SAFETY (set_var): no other test of this binary reads KUBECONFIG or HOME.
        let other = tmp.path().join("other");
        std::fs::copy(&path, &other).unwrap();
        std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o666)).unwrap();
        let list = std::env::join_paths([&path, &other]).unwrap();
        unsafe { std::env::set_var("KUBECONFIG", &list) };
        let inferred = check_inferred_kubeconfigs();
        unsafe { std::env::remove_var("KUBECONFIG") };
        let error = inferred.unwrap_err().to_string();
        assert!(
            error.contains("other") && error.contains("writable"),
            "{error}"
        );
    }
}
