//! Errors of the library: start-up failures ([`Error`]) and refused
//! operations ([`OpError`], by meaning; mapped to gRPC status codes in
//! `api/errors.rs`).

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
    #[error("{0}")]
    Signal(#[from] siesta_signal::SignalError),
}

/// Why an operation failed, by what went wrong; the api layer maps each
/// kind to one gRPC status code (`api/errors.rs`).
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// No model has this name or alias.
    #[error("model {0:?} not found (`siesta status` lists the models and their aliases)")]
    NotFound(String),
    /// A request field holds a value that cannot be used.
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// A configuration file holds problems; each names the file and key.
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    /// Valid, but not in the model's present state or kind; says why.
    #[error("{0}")]
    Refused(String),
    /// The control plane is stopping and takes no more operations.
    #[error("the control plane is shutting down")]
    ShuttingDown,
    /// A bug or a broken invariant inside the control plane.
    #[error("internal error: {0}")]
    Internal(String),
    /// An I/O operation of the control plane failed; `what` names it.
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl OpError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        OpError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        OpError::Io {
            what: what.into(),
            source,
        }
    }
}
