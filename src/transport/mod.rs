//! North side, the transports Cube's hooks arrive by: the gRPC daemon (`serve`: server,
//! its listeners, the Cube services, the health service, and the HTTP/2 `:authority`
//! filter that lets every gRPC client dial the Unix socket) and the forked binary hook
//! (its front process and the worker that finishes after answering). Both hand requests
//! to `cube::hooks`.

pub mod authority_filter;
pub mod forked;
pub mod front;
pub mod health;
pub mod listener;
pub mod live;
pub mod server;
pub mod service;
pub mod worker;
