//! The record key of the CubeVolume store: a Secret in the bridge's namespace, so that
//! every controller replica, on any host, signs and verifies with one key. The first
//! replica to need it makes it (an immutable Secret with 32 random bytes); a replica
//! that loses that race reads the winner's. Only the controller ServiceAccount may read
//! it (the chart's Role names it).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

use super::{Kube, KubeError};
use crate::bridge::BridgeError;
use crate::bridge::integrity::{LoadedKey, RecordKey, RecordKeySource};
use crate::bridge::ports::StoreError;

/// The data key of the Secret.
pub const KEY_FIELD: &str = "key";

/// The Secret holding the key.
#[derive(Debug)]
pub struct SecretKeySource {
    kube: Arc<Kube>,
    name: String,
}

impl SecretKeySource {
    pub fn new(kube: Arc<Kube>, name: &str) -> Self {
        Self {
            kube,
            name: name.to_string(),
        }
    }

    /// An API failure, transient when the server was unreachable (the daemon then starts
    /// anyway and retries on first use).
    fn failed(&self, action: &str, error: KubeError) -> BridgeError {
        BridgeError::Store(StoreError::Backend {
            store: format!("record key Secret {}", self.name),
            action: format!(
                "{action} (the controller side reads and, the first time, creates this \
                 Secret; see the chart's Role)"
            ),
            transient: error.is_transient(),
            source: Box::new(error),
        })
    }

    fn key_of(&self, secret: &Secret) -> Result<RecordKey, BridgeError> {
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(KEY_FIELD))
            .map(|b| b.0.as_slice())
            .unwrap_or_default();
        RecordKey::from_bytes(bytes).map_err(|e| {
            BridgeError::Precondition(format!(
                "record key Secret {} has no usable {KEY_FIELD:?} ({e}); restore it from a \
                 backup (records signed with the lost key no longer verify)",
                self.name
            ))
        })
    }
}

#[async_trait]
impl RecordKeySource for SecretKeySource {
    async fn load(&self) -> Result<LoadedKey, BridgeError> {
        let (client, namespace) = self
            .kube
            .client()
            .await
            .map_err(|e| self.failed("connecting", e))?;
        let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
        match api.get_opt(&self.name).await {
            Ok(Some(secret)) => {
                return Ok(LoadedKey {
                    key: self.key_of(&secret)?,
                    created: false,
                });
            }
            Ok(None) => {}
            Err(e) => return Err(self.failed("reading", KubeError::api("get", e))),
        }
        let key =
            RecordKey::generate().map_err(|e| BridgeError::io("generating a record key", e))?;
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/part-of".to_string(),
                    "cube-csi-bridge".to_string(),
                )])),
                annotations: Some(BTreeMap::from([(
                    "csibridge.cubesandbox.io/purpose".to_string(),
                    "HMAC key of the CubeVolume records; losing it makes every record \
                     unverifiable, so back it up with them"
                        .to_string(),
                )])),
                ..Default::default()
            },
            immutable: Some(true),
            type_: Some("Opaque".into()),
            data: Some(BTreeMap::from([(
                KEY_FIELD.to_string(),
                ByteString(key.as_bytes().to_vec()),
            )])),
            ..Default::default()
        };
        match api.create(&PostParams::default(), &secret).await {
            Ok(_) => Ok(LoadedKey { key, created: true }),
            // Another replica made it first: use its key.
            Err(kube::Error::Api(s)) if s.is_already_exists() => {
                let secret = api
                    .get(&self.name)
                    .await
                    .map_err(|e| self.failed("reading", KubeError::api("get", e)))?;
                Ok(LoadedKey {
                    key: self.key_of(&secret)?,
                    created: false,
                })
            }
            Err(e) => Err(self.failed("creating", KubeError::api("create", e))),
        }
    }

    fn describe(&self) -> String {
        match self.kube.namespace_hint() {
            Some(ns) => format!("Secret {ns}/{}", self.name),
            None => format!("Secret {}", self.name),
        }
    }
}
