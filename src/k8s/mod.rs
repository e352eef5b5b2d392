//! The Kubernetes API side: one lazily connected client, StorageClass and Secret reuse
//! (the core's `VolumeSettings` port), and the CubeVolume objects (a `ControllerStore`).
//!
//! Nothing here contacts the API server until a hook (or `check`) needs it, so a bridge
//! whose config names no Kubernetes feature never loads a kubeconfig.

mod cache;
mod kubeconfig;
pub mod names;
pub mod record_key;
pub mod snapshots;
pub mod storage_class;
pub mod volumes;

use std::time::Duration;

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
                message: kubeconfig::describe_client_error(&other),
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
            Some(path) => (kubeconfig::load(path).await?, path.display().to_string()),
            None => {
                kubeconfig::check_inferred()?;
                let config = kube::Config::infer()
                    .await
                    .map_err(|e| KubeError::Configure {
                        source_desc: "$KUBECONFIG, ~/.kube/config or the pod's service account"
                            .into(),
                        message: kubeconfig::describe_config_error(&e),
                    })?;
                (config, "the inferred configuration".to_string())
            }
        };
        kubeconfig::pin_programs(&mut config).map_err(|message| KubeError::Configure {
            source_desc: source_desc.clone(),
            message,
        })?;
        // A proxy left is the environment's (`HTTPS_PROXY`: a forked hook inherits
        // Cubelet's, set for image pulls; a kubeconfig's own `proxy-url` was refused). The
        // client is built without proxy support and would fail naming the URL, credentials
        // included, and ignoring `NO_PROXY`: the API server is reached directly.
        if config.proxy_url.take().is_some() {
            tracing::debug!("ignoring the proxy of the environment for the Kubernetes API");
        }
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        config.read_timeout = Some(READ_TIMEOUT);
        config.write_timeout = Some(READ_TIMEOUT);
        let namespace = self
            .settings
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        // Building the client runs the kubeconfig's `exec` command, if any.
        let client = kube::Client::try_from(config).map_err(|e| KubeError::Configure {
            source_desc,
            message: kubeconfig::describe_client_error(&e),
        })?;
        tracing::debug!(%namespace, "Kubernetes API client configured");
        Ok((client, namespace))
    }
}

/// The top-level fields of `sent` that `stored` does not hold as sent: what an API server
/// serving an older CRD pruned from a written object's `spec`.
pub(crate) fn spec_fields_changed<S: serde::Serialize>(sent: &S, stored: &S) -> Vec<String> {
    let (Ok(serde_json::Value::Object(sent)), Ok(serde_json::Value::Object(stored))) =
        (serde_json::to_value(sent), serde_json::to_value(stored))
    else {
        return Vec::new();
    };
    sent.iter()
        .filter(|(field, value)| stored.get(*field) != Some(*value))
        .map(|(field, _)| field.clone())
        .collect()
}
