//! Cube's hooks from wire request to wire reply, shared by the gRPC services and the
//! binary hook, in two steps: `check` (validate, before anything else happens) and `run`
//! (call the bridge, shape the reply). A request that fails the check changes nothing: no
//! state directory, no lock, no CSI call, no record.
//!
//! **The hook table.** Each hook is one type implementing [`Hook`] (its wire types, its
//! argv, its check, its core call, its JSON), listed once in `hook_table!` at the end of
//! this file, which makes the per-hook enums and their dispatch. Adding a hook is an impl
//! here, its validator in `validate.rs` and its method on the core (plus, for rpc, the
//! method the proto's generated service trait then asks for in `transport/service.rs`).

use std::future::Future;

use serde_json::json;

use crate::bridge::{
    AttachVolume, Bridge, BridgeError, Caller, CreateVolume, DestroyVolume, DetachVolume,
    HookError, HookKind,
};
use crate::config::Config;
use crate::proto::cube::v1 as pb;

use super::validate;

/// The binary hook's argv values as Cube passes them (flag, then value), before parsing.
#[derive(Debug, Clone, Default)]
pub struct HookArgv {
    pub volume_id: Option<String>,
    pub name: Option<String>,
    pub sandbox_id: Option<String>,
    pub namespace: Option<String>,
    pub ref_count: Option<String>,
    pub volume_base_dir: Option<String>,
    pub private_data: Option<String>,
    pub metadata: Option<String>,
}

impl HookArgv {
    /// A value `op` cannot do without, or the error naming its flag.
    fn need(value: &Option<String>, flag: &str, op: HookKind) -> Result<String, String> {
        value
            .clone()
            .ok_or_else(|| format!("--op {op} needs {flag}"))
    }

    fn volume_id(&self, op: HookKind) -> Result<String, String> {
        Self::need(&self.volume_id, "--volume-id", op)
    }

    fn ref_count(&self, op: HookKind) -> Result<i64, String> {
        let text = Self::need(&self.ref_count, "--ref-count", op)?;
        match text.parse::<i64>() {
            Ok(n) if n >= 0 => Ok(n),
            Ok(n) => Err(format!("--ref-count {n} is negative; it counts holders")),
            Err(_) => Err(format!(
                "--ref-count {} is not an integer",
                crate::bridge::naming::quote_bounded(&text)
            )),
        }
    }
}

/// One Cube hook, everything both transports need of it.
pub trait Hook {
    const KIND: HookKind;
    /// Cube's request and reply messages.
    type Request: Clone + std::fmt::Debug + Send + 'static;
    type Reply: Clone + std::fmt::Debug + Send + 'static;
    /// The request in the core's types, once checked.
    type Checked: Clone + std::fmt::Debug + Send + 'static;

    fn volume_id(request: &Self::Request) -> &str;
    /// The request from the binary hook's argv, naming the first missing or malformed
    /// argument.
    fn from_argv(argv: &HookArgv) -> Result<Self::Request, String>;
    /// Validation (`validate.rs`): nothing may happen before it passes.
    fn check(request: Self::Request, config: &Config) -> Result<Self::Checked, String>;
    /// The core's work.
    fn run(
        bridge: &Bridge,
        checked: Self::Checked,
        caller: &Caller,
    ) -> impl Future<Output = Result<Self::Reply, HookError>> + Send;
    /// The core's hot path, where the hook has one (`None`: not hot, run it in full).
    fn run_if_hot(
        bridge: &Bridge,
        checked: &Self::Checked,
    ) -> impl Future<Output = Option<Result<Self::Reply, HookError>>> + Send {
        let _ = (bridge, checked);
        async { None }
    }
    /// The JSON object a successful binary hook prints.
    fn json(reply: &Self::Reply) -> serde_json::Value;
}

/// CubeMaster's Create: make the CSI volume, answer its handle as private_data.
pub struct Create;

impl Hook for Create {
    const KIND: HookKind = HookKind::Create;
    type Request = pb::CreateRequest;
    type Reply = pb::CreateResponse;
    type Checked = CreateVolume;

    fn volume_id(request: &Self::Request) -> &str {
        &request.volume_id
    }

    fn from_argv(argv: &HookArgv) -> Result<Self::Request, String> {
        Ok(pb::CreateRequest {
            volume_id: argv.volume_id(Self::KIND)?,
            name: HookArgv::need(&argv.name, "--name", Self::KIND)?,
        })
    }

    fn check(request: Self::Request, _config: &Config) -> Result<Self::Checked, String> {
        validate::create(request)
    }

    async fn run(
        bridge: &Bridge,
        checked: Self::Checked,
        caller: &Caller,
    ) -> Result<Self::Reply, HookError> {
        let created = bridge.create(checked, caller).await?;
        Ok(pb::CreateResponse {
            token: created.token,
            private_data: created.private_data,
        })
    }

    fn json(reply: &Self::Reply) -> serde_json::Value {
        json!({ "token": reply.token, "private_data": reply.private_data })
    }
}

/// CubeMaster's Destroy: delete the CSI volume and its record.
pub struct Destroy;

impl Hook for Destroy {
    const KIND: HookKind = HookKind::Destroy;
    type Request = pb::DestroyRequest;
    type Reply = pb::DestroyResponse;
    type Checked = DestroyVolume;

    fn volume_id(request: &Self::Request) -> &str {
        &request.volume_id
    }

    fn from_argv(argv: &HookArgv) -> Result<Self::Request, String> {
        Ok(pb::DestroyRequest {
            volume_id: argv.volume_id(Self::KIND)?,
        })
    }

    fn check(request: Self::Request, _config: &Config) -> Result<Self::Checked, String> {
        validate::destroy(request)
    }

    async fn run(
        bridge: &Bridge,
        checked: Self::Checked,
        caller: &Caller,
    ) -> Result<Self::Reply, HookError> {
        bridge.destroy(checked, caller).await?;
        Ok(pb::DestroyResponse {})
    }

    fn json(_reply: &Self::Reply) -> serde_json::Value {
        json!({})
    }
}

/// Cubelet's Attach: make the volume available at a host_path for one more sandbox.
pub struct Attach;

impl Hook for Attach {
    const KIND: HookKind = HookKind::Attach;
    type Request = pb::AttachRequest;
    type Reply = pb::AttachResponse;
    type Checked = AttachVolume;

    fn volume_id(request: &Self::Request) -> &str {
        &request.volume_id
    }

    fn from_argv(argv: &HookArgv) -> Result<Self::Request, String> {
        let op = Self::KIND;
        let volume_id = argv.volume_id(op)?;
        Ok(pb::AttachRequest {
            sandbox_id: HookArgv::need(&argv.sandbox_id, "--sandbox-id", op)?,
            namespace: HookArgv::need(&argv.namespace, "--namespace", op)?,
            volume_id,
            ref_count: argv.ref_count(op)?,
            volume_base_dir: HookArgv::need(&argv.volume_base_dir, "--volume-base-dir", op)?,
            // Cube omits it when Create returned none.
            private_data: argv.private_data.clone().unwrap_or_default(),
        })
    }

    fn check(request: Self::Request, config: &Config) -> Result<Self::Checked, String> {
        validate::attach(request, config)
    }

    async fn run(
        bridge: &Bridge,
        checked: Self::Checked,
        caller: &Caller,
    ) -> Result<Self::Reply, HookError> {
        bridge.attach(checked, caller).await.map(attach_reply)
    }

    async fn run_if_hot(
        bridge: &Bridge,
        checked: &Self::Checked,
    ) -> Option<Result<Self::Reply, HookError>> {
        Some(bridge.attach_if_hot(checked).await?.map(attach_reply))
    }

    fn json(reply: &Self::Reply) -> serde_json::Value {
        json!({ "host_path": reply.host_path, "metadata": reply.metadata })
    }
}

/// The JSON a binary hook prints for an answer the core hands over before it returns
/// (`bridge::Caller::deliver`).
pub fn answer_json(answer: &crate::bridge::Answer) -> serde_json::Value {
    match answer {
        crate::bridge::Answer::Attached(attached) => Attach::json(&attach_reply(attached.clone())),
        crate::bridge::Answer::Created(created) => Create::json(&pb::CreateResponse {
            token: created.token.clone(),
            private_data: created.private_data.clone(),
        }),
    }
}

/// The reply an rpc handler returns for a delivered answer.
pub fn answer_reply(answer: &crate::bridge::Answer) -> HookReply {
    match answer {
        crate::bridge::Answer::Attached(attached) => {
            HookReply::Attach(attach_reply(attached.clone()))
        }
        crate::bridge::Answer::Created(created) => HookReply::Create(pb::CreateResponse {
            token: created.token.clone(),
            private_data: created.private_data.clone(),
        }),
    }
}

pub fn attach_reply(attached: crate::bridge::Attached) -> pb::AttachResponse {
    pb::AttachResponse {
        host_path: attached.host_path.to_string_lossy().into_owned(),
        metadata: attached.metadata,
    }
}

/// Cubelet's Detach: one sandbox fewer; the last one's Detach takes the volume down.
pub struct Detach;

impl Hook for Detach {
    const KIND: HookKind = HookKind::Detach;
    type Request = pb::DetachRequest;
    type Reply = pb::DetachResponse;
    type Checked = DetachVolume;

    fn volume_id(request: &Self::Request) -> &str {
        &request.volume_id
    }

    fn from_argv(argv: &HookArgv) -> Result<Self::Request, String> {
        let op = Self::KIND;
        let volume_id = argv.volume_id(op)?;
        Ok(pb::DetachRequest {
            sandbox_id: HookArgv::need(&argv.sandbox_id, "--sandbox-id", op)?,
            namespace: HookArgv::need(&argv.namespace, "--namespace", op)?,
            volume_id,
            ref_count: argv.ref_count(op)?,
            metadata: validate::metadata_json(&HookArgv::need(&argv.metadata, "--metadata", op)?)?,
        })
    }

    fn check(request: Self::Request, config: &Config) -> Result<Self::Checked, String> {
        validate::detach(request, config)
    }

    async fn run(
        bridge: &Bridge,
        checked: Self::Checked,
        caller: &Caller,
    ) -> Result<Self::Reply, HookError> {
        bridge.detach(checked, caller).await?;
        Ok(pb::DetachResponse {})
    }

    async fn run_if_hot(
        bridge: &Bridge,
        checked: &Self::Checked,
    ) -> Option<Result<Self::Reply, HookError>> {
        Some(
            bridge
                .detach_if_hot(checked)
                .await?
                .map(|()| pb::DetachResponse {}),
        )
    }

    fn json(_reply: &Self::Reply) -> serde_json::Value {
        json!({})
    }
}

/// Makes, from the list of hooks, the enums that carry any hook (`HookRequest`, `Checked`,
/// `HookReply`) and their dispatch to each hook's [`Hook`] items.
macro_rules! hook_table {
    ($($hook:ident),+ $(,)?) => {
        /// One hook's request as Cube sent it, over either transport.
        #[derive(Debug, Clone)]
        pub enum HookRequest {
            $($hook(<$hook as Hook>::Request),)+
        }

        /// A request that passed the check, in the core's types.
        #[derive(Debug, Clone)]
        pub enum Checked {
            $($hook(<$hook as Hook>::Checked),)+
        }

        /// A hook's reply, for either transport.
        #[derive(Debug, Clone)]
        pub enum HookReply {
            $($hook(<$hook as Hook>::Reply),)+
        }

        impl HookRequest {
            pub fn kind(&self) -> HookKind {
                match self {
                    $(HookRequest::$hook(_) => <$hook as Hook>::KIND,)+
                }
            }

            pub fn volume_id(&self) -> &str {
                match self {
                    $(HookRequest::$hook(r) => <$hook as Hook>::volume_id(r),)+
                }
            }

            /// The request of hook `op` from the binary hook's argv.
            pub fn from_argv(op: HookKind, argv: &HookArgv) -> Result<Self, String> {
                $(if op == <$hook as Hook>::KIND {
                    return <$hook as Hook>::from_argv(argv).map(HookRequest::$hook);
                })+
                Err(format!("--op {op} is not a hook"))
            }
        }

        impl HookReply {
            /// The JSON object a successful binary hook prints.
            pub fn json(&self) -> serde_json::Value {
                match self {
                    $(HookReply::$hook(r) => <$hook as Hook>::json(r),)+
                }
            }
        }

        $(
            impl Listed for $hook {
                fn request(request: Self::Request) -> HookRequest {
                    HookRequest::$hook(request)
                }

                fn reply(reply: HookReply) -> Option<Self::Reply> {
                    match reply {
                        HookReply::$hook(r) => Some(r),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    }
                }
            }
        )+

        fn check_listed(request: HookRequest, config: &Config) -> Result<Checked, String> {
            match request {
                $(HookRequest::$hook(r) => <$hook as Hook>::check(r, config).map(Checked::$hook),)+
            }
        }

        /// Runs a checked request.
        pub async fn run(
            bridge: &Bridge,
            request: Checked,
            caller: &Caller,
        ) -> Result<HookReply, HookError> {
            match request {
                $(Checked::$hook(r) => <$hook as Hook>::run(bridge, r, caller).await.map(HookReply::$hook),)+
            }
        }

        /// Runs a checked request only if it is on its hook's hot path; `None` otherwise.
        pub async fn run_if_hot(
            bridge: &Bridge,
            request: &Checked,
        ) -> Option<Result<HookReply, HookError>> {
            match request {
                $(Checked::$hook(r) => Some(<$hook as Hook>::run_if_hot(bridge, r).await?.map(HookReply::$hook)),)+
            }
        }
    };
}

/// A hook of the table: how its request and reply travel in the table's enums.
pub trait Listed: Hook {
    fn request(request: Self::Request) -> HookRequest;
    fn reply(reply: HookReply) -> Option<Self::Reply>;
}

hook_table!(Create, Destroy, Attach, Detach);

/// Validates `request` against `config`.
pub fn check(request: HookRequest, config: &Config) -> Result<Checked, HookError> {
    let (hook, volume_id) = (request.kind(), request.volume_id().to_string());
    check_listed(request, config).map_err(|message| {
        let shown = crate::bridge::naming::short_volume_id(&volume_id);
        // Debug-quoted: a rejected id may hold a newline, which would forge a log line.
        tracing::warn!(op = hook.as_str(), volume_id = ?shown, %message, "rejected an invalid request");
        crate::metrics::hook(
            &crate::metrics::DriverLabel::of(config),
            hook.as_str(),
            "invalid_request",
            std::time::Duration::ZERO,
        );
        HookError {
            hook,
            volume_id,
            error: BridgeError::InvalidRequest(message),
        }
    })
}

#[cfg(test)]
mod tests {
    /// A --ref-count that is no number is quoted bounded (before: whole, 120 KiB of it).
    #[test]
    fn a_bad_ref_count_is_quoted_bounded() {
        let argv = super::HookArgv {
            ref_count: Some(format!("{}\nx", "9".repeat(120 << 10))),
            ..Default::default()
        };
        let message = argv.ref_count(super::HookKind::Attach).unwrap_err();
        assert!(message.len() < 2048, "{} bytes", message.len());
        assert!(!message.contains('\n'), "{message}");
    }

    use std::path::Path;

    use super::*;

    /// A volume_id refused for its length is quoted in part, with its length.
    #[test]
    fn a_huge_volume_id_is_quoted_in_part() {
        let config = Config::parse(
            "driver = \"nfs\"\n[csi]\nendpoint = \"/run/x.sock\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        let request = HookRequest::Destroy(pb::DestroyRequest {
            volume_id: "x".repeat(1_000_000),
        });
        let message = check(request, &config).unwrap_err().to_string();
        assert!(message.len() < 512, "{} bytes", message.len());
        assert!(
            message.starts_with(&format!(
                "destroy of volume \"{}\"… (1000000 bytes)",
                "x".repeat(128)
            )),
            "{message}"
        );
        assert!(message.contains("1000000 bytes long"), "{message}");
    }
}
