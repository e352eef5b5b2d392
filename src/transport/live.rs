//! The daemon's bridge, whose roles that could not open at start are tried again: a state
//! dir that was full or failing when the daemon started (a node rebooted with its disk
//! full, a store file left to repair) serves once it is fixed, without a restart. The
//! other role serves meanwhile, so nothing else would ever restart the daemon.

use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::app::Reopen;
use crate::bridge::{Bridge, BridgeError, Deadline, Unserved};
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
    reopen: Option<Arc<Reopen>>,
    attempts: Mutex<Attempts>,
    /// The roles that are down, with why (as last tried).
    down: tokio::sync::watch::Sender<DownRoles>,
    on_opened: OnOpened,
}

#[derive(Default)]
struct Attempts {
    under_way: bool,
    last: Option<Instant>,
}

impl LiveBridge {
    pub fn new(bridge: Arc<Bridge>, roles: Roles, reopen: Reopen, on_opened: OnOpened) -> Self {
        let (down, _) = tokio::sync::watch::channel(bridge.down_roles(roles));
        Self {
            current: RwLock::new(bridge),
            roles,
            reopen: Some(Arc::new(reopen)),
            attempts: Mutex::default(),
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
            attempts: Mutex::default(),
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

    /// Starts another attempt to open the roles that are down, unless one is under way or
    /// began less than `spacing` ago. The attempt runs in a task of its own: a hook that
    /// starts one is not held up by it (it answers with the bridge as it is), and a caller
    /// that leaves does not cut it short. The returned handle ends with it.
    pub fn reopen_if_due(
        self: &Arc<Self>,
        spacing: Duration,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let reopen = self.reopen.clone()?;
        {
            let mut attempts = self.attempts.lock().expect("poisoned");
            if attempts.under_way || attempts.last.is_some_and(|at| at.elapsed() < spacing) {
                return None;
            }
            attempts.under_way = true;
            attempts.last = Some(Instant::now());
        }
        // Reset however the attempt ends: done, panicked, or dropped unpolled (the runtime
        // shutting down).
        struct Done(Arc<LiveBridge>);
        impl Drop for Done {
            fn drop(&mut self) {
                self.0.attempts.lock().expect("poisoned").under_way = false;
            }
        }
        let done = Done(self.clone());
        Some(tokio::spawn(async move {
            done.0.attempt(reopen).await;
        }))
    }

    /// One attempt: each role that is down is opened (on a blocking thread: a store's file
    /// lock and a journal's recovery wait for the disk) and its driver checked; one that
    /// passes replaces its error in the bridge, one that fails keeps the new reason.
    async fn attempt(&self, reopen: Arc<Reopen>) {
        let current = self.current();
        let down = current.down_roles(self.roles);
        if down.is_empty() {
            return;
        }
        let deadline = Deadline::after(CHECK_BUDGET);
        let mut next = Bridge {
            controller: current.controller.clone(),
            node: current.node.clone(),
        };
        let mut opened = Vec::new();
        let mut still_down = Vec::new();
        for (role, before) in down {
            let side = Side::open(role, &reopen, &deadline).await;
            match side {
                Ok(side) => {
                    tracing::info!(
                        role,
                        "this role, which could not open at start, opened now: serving its hooks"
                    );
                    opened.push(side.alone());
                    side.place_in(&mut next);
                }
                Err(error) => {
                    let why = error.to_string();
                    if why != before {
                        tracing::warn!(role, reason = %why, "this role still cannot serve; tried again");
                    }
                    // Its hooks answer with why it is down now.
                    let unserved = Unserved(why.clone());
                    match role {
                        "controller" => next.controller = Err(unserved),
                        _ => next.node = Err(unserved),
                    }
                    still_down.push((role, why));
                }
            }
        }
        *self.current.write().expect("bridge poisoned") = Arc::new(next);
        self.down.send_replace(still_down);
        for side in opened {
            (self.on_opened)(Arc::new(side));
        }
    }
}

/// A side opened late.
enum Side {
    Controller(Arc<crate::bridge::ControllerSide>),
    Node(Arc<crate::bridge::NodeSide>),
}

impl Side {
    /// Opens `role`'s side (on a blocking thread) and checks its driver.
    async fn open(
        role: &'static str,
        reopen: &Arc<Reopen>,
        deadline: &Deadline,
    ) -> Result<Side, BridgeError> {
        let reopen = reopen.clone();
        let side = tokio::task::spawn_blocking(move || match role {
            "controller" => reopen.controller().map(Side::Controller),
            _ => reopen.node().map(Side::Node),
        })
        .await
        .map_err(|e| BridgeError::Unavailable(e.to_string()))??;
        match &side {
            Side::Controller(controller) => controller.check(deadline).await?,
            Side::Node(node) => node.check(deadline).await?,
        }
        Ok(side)
    }

    /// A bridge with this side alone.
    fn alone(&self) -> Bridge {
        match self {
            Side::Controller(side) => Bridge {
                controller: Ok(side.clone()),
                node: Err(Unserved::not_a_role("node")),
            },
            Side::Node(side) => Bridge {
                controller: Err(Unserved::not_a_role("controller")),
                node: Ok(side.clone()),
            },
        }
    }

    fn place_in(self, bridge: &mut Bridge) {
        match self {
            Side::Controller(side) => bridge.controller = Ok(side),
            Side::Node(side) => bridge.node = Ok(side),
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
