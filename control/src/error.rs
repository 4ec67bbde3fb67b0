//! Errors of the library: start-up failures ([`Error`]) and refused
//! operations ([`OpError`], mapped to gRPC status codes in `api`).

use std::net::SocketAddr;

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "refusing to listen on non-loopback address {0} without a token: set [control] token or SIESTA_TOKEN"
    )]
    TokenRequired(SocketAddr),
    #[error("state directory {path}: {source}")]
    StateDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Store(#[from] crate::store::StoreError),
    /// Anything else that stops start-up (a model task, GPU detection).
    #[error("cannot start: {0}")]
    Startup(std::io::Error),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Why an operation on a model was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    #[error("no model named {0:?} (`siesta status` lists the models and their aliases)")]
    NotFound(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unimplemented(String),
    #[error("{0}")]
    Unavailable(String),
}
