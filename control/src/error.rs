//! Errors of the library: start-up failures ([`Error`]) and refused
//! operations ([`OpError`], by meaning; mapped to gRPC status codes in
//! `api/errors.rs`).

use std::net::SocketAddr;

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    /// `key`: the setting that named the address. The cause is in the
    /// message, not a `source` (it was printed twice: "Caused by: Address
    /// already in use").
    #[error(
        "cannot listen on {addr} ({key}): {error}{}",
        if error.kind() == std::io::ErrorKind::AddrInUse {
            " (another siesta-control, or another program, holds it; pick another address, \
             port 0 for any free one)"
        } else {
            ""
        }
    )]
    Bind {
        addr: SocketAddr,
        key: &'static str,
        error: std::io::Error,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A listen address in use names the setting and what to do, once:
    /// the cause is not a `source` as well (printed twice before, as
    /// "Caused by: Address already in use", naming no setting).
    #[test]
    fn an_address_in_use_names_the_setting_once() {
        let e = Error::Bind {
            addr: "127.0.0.1:50051".parse().unwrap(),
            key: "[control] listen, or --listen",
            error: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        };
        let said = e.to_string();
        assert!(
            said.starts_with("cannot listen on 127.0.0.1:50051 ([control] listen, or --listen): "),
            "{said}"
        );
        assert!(said.contains("another siesta-control"), "{said}");
        assert!(std::error::Error::source(&e).is_none());
    }
}
