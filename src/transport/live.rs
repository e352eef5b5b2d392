//! The daemon's bridge, whose roles that could not open at start are tried again: a state
//! dir that was full or failing when the daemon started (a node rebooted with its disk
//! full, a store file left to repair) serves once it is fixed, without a restart. The
//! other role serves meanwhile, so nothing else would ever restart the daemon.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::app::Reopen;
use crate::bridge::{Bridge, Deadline};
use crate::config::Roles;

/// What a role that could not open says, by role (`Bridge::down_roles`).
pub type DownRoles = Vec<(&'static str, String)>;

/// Told of each side opened after start: a bridge with that side alone, to start its
/// housekeeping.
pub type OnOpened = Box<dyn Fn(Arc<Bridge>) + Send + Sync>;

/// How long a side's driver check may take when it opens late.
const CHECK_BUDGET: Duration = Duration::from_secs(10);

pub struct LiveBridge {
    current: RwLock<Arc<Bridge>>,
    roles: Roles,
    /// None: the bridge stays as it is (tests, a bridge opened elsewhere).
    reopen: Option<Reopen>,
    /// When the last attempt began; held while one runs.
    attempt: tokio::sync::Mutex<Option<Instant>>,
    /// Why each role that is down is down, as last logged (a failure is logged when it
    /// changes, not at each attempt).
    down: tokio::sync::watch::Sender<DownRoles>,
    on_opened: OnOpened,
}

impl LiveBridge {
    pub fn new(bridge: Arc<Bridge>, roles: Roles, reopen: Reopen, on_opened: OnOpened) -> Self {
        let (down, _) = tokio::sync::watch::channel(bridge.down_roles(roles));
        Self {
            current: RwLock::new(bridge),
            roles,
            reopen: Some(reopen),
            attempt: tokio::sync::Mutex::new(None),
            down,
            on_opened,
        }
    }

    /// A bridge that stays as it is.
    pub fn fixed(bridge: Arc<Bridge>) -> Self {
        let (down, _) = tokio::sync::watch::channel(Vec::new());
        Self {
            current: RwLock::new(bridge),
            roles: Roles::BOTH,
            reopen: None,
            attempt: tokio::sync::Mutex::new(None),
            down,
            on_opened: Box::new(|_| {}),
        }
    }

    /// The bridge as it is now.
    pub fn current(&self) -> Arc<Bridge> {
        self.current.read().expect("bridge poisoned").clone()
    }

    /// The roles that are down, with why, as they change.
    pub fn down_roles(&self) -> tokio::sync::watch::Receiver<DownRoles> {
        self.down.subscribe()
    }

    /// Tries again to open each role that is down, unless an attempt began less than
    /// `spacing` ago or one is under way (the caller goes on with the bridge as it is). A
    /// side that opens and whose driver check passes replaces its error in the bridge.
    pub async fn reopen_if_due(&self, spacing: Duration) {
        let Some(reopen) = &self.reopen else {
            return;
        };
        let Ok(mut last) = self.attempt.try_lock() else {
            return;
        };
        if last.is_some_and(|at| at.elapsed() < spacing) {
            return;
        }
        *last = Some(Instant::now());
        let current = self.current();
        let down = current.down_roles(self.roles);
        if down.is_empty() {
            return;
        }
        let deadline = Deadline::after(CHECK_BUDGET);
        let mut controller = current.controller.clone();
        let mut node = current.node.clone();
        let mut opened = Vec::new();
        let mut still_down = Vec::new();
        for (role, before) in down {
            let result: Result<(), crate::bridge::BridgeError> = match role {
                "controller" => match reopen.controller() {
                    Ok(side) => match side.check(&deadline).await {
                        Ok(()) => {
                            controller = Ok(side.clone());
                            opened.push(Bridge {
                                controller: Ok(side),
                                node: Err(crate::bridge::Unserved::not_a_role("node")),
                            });
                            Ok(())
                        }
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                },
                _ => match reopen.node() {
                    Ok(side) => match side.check(&deadline).await {
                        Ok(()) => {
                            node = Ok(side.clone());
                            opened.push(Bridge {
                                controller: Err(crate::bridge::Unserved::not_a_role("controller")),
                                node: Ok(side),
                            });
                            Ok(())
                        }
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                },
            };
            match result {
                Ok(()) => tracing::info!(
                    role,
                    "this role, which could not open at start, opened now: serving its hooks"
                ),
                Err(error) => {
                    let why = error.to_string();
                    if why != before {
                        tracing::warn!(role, reason = %why, "this role still cannot serve; tried again");
                    }
                    // Its hooks answer with why it is down now.
                    let unserved = crate::bridge::Unserved(why.clone());
                    match role {
                        "controller" => controller = Err(unserved),
                        _ => node = Err(unserved),
                    }
                    still_down.push((role, why));
                }
            }
        }
        *self.current.write().expect("bridge poisoned") = Arc::new(Bridge { controller, node });
        self.down.send_replace(still_down);
        for side in opened {
            (self.on_opened)(Arc::new(side));
        }
    }
}

impl std::fmt::Debug for LiveBridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveBridge")
            .field("down", &*self.down.borrow())
            .finish_non_exhaustive()
    }
}
