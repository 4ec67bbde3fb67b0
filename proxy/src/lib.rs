//! siesta-proxy: the OpenAI-compatible front door.
//!
//! Routes requests by the `model` field of their JSON body to the engines that
//! `siesta-control` publishes on `Watch`; holds requests for models that are
//! not awake (sending one `Demand` per wait episode) and sheds with `503` and
//! `Retry-After` when the wait would be too long. See DESIGN.md, data plane.
#![forbid(unsafe_code)]

mod activity;
mod body;
mod config;
mod errors;
mod form_field;
mod forward;
mod handler;
mod hold;
mod metrics;
mod model_field;
mod request_model;
mod route_table;
mod self_wake;
mod server;
mod threads;
mod waiting_room;
mod watch_client;

pub use config::{DEFAULT_CONTROL, DEFAULT_MAX_BODY_BYTES, ProxyConfig};
pub use forward::{DEFAULT_ENGINE_CONCURRENCY, DEFAULT_UPSTREAM_IDLE_TIMEOUT};
pub use server::Proxy;
pub use threads::default_count as default_serving_threads;

/// Errors that stop the proxy from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    /// The client or admin address is taken by another socket.
    #[error(
        "cannot listen on {addr}: the address is already in use{}",
        addr_in_use_hint(.reuse_port)
    )]
    AddrInUse {
        addr: std::net::SocketAddr,
        reuse_port: bool,
    },
    /// A `--control` value is not a usable URL.
    #[error("invalid control plane URL {url:?}: {reason}")]
    ControlUrl { url: String, reason: String },
    /// The configuration is inconsistent.
    #[error("invalid proxy configuration: {0}")]
    Config(String),
    /// An I/O error while serving.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

fn addr_in_use_hint(reuse_port: &bool) -> &'static str {
    if *reuse_port {
        " by a socket without SO_REUSEPORT (every proxy replica sharing it must use --reuse-port)"
    } else {
        " (to run several proxy replicas on one address, start each with --reuse-port)"
    }
}
