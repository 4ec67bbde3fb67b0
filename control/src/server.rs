//! The daemon: binds the gRPC listener, runs the model tasks, shuts down.

use crate::{Config, Error};
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How to serve, besides the configuration.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Overrides `[control] listen`.
    pub listen: Option<SocketAddr>,
    /// Stop every engine when the server shuts down (default: leave them).
    pub stop_engines_on_exit: bool,
    /// The configuration file (for `Reload` and `GetInfo`).
    pub config_path: Option<PathBuf>,
}

/// A bound, not yet running control plane.
#[derive(Debug)]
pub struct Server {
    config: Config,
    opts: ServeOptions,
    listener: TcpListener,
    local_addr: SocketAddr,
}

impl Server {
    /// Binds the listener (port 0 picks a free port).
    pub async fn bind(config: Config, opts: ServeOptions) -> Result<Server, Error> {
        let addr = opts.listen.unwrap_or(config.control.listen);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Bind { addr, source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| Error::Bind { addr, source })?;
        Ok(Server {
            config,
            opts,
            listener,
            local_addr,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let _ = (&self.config, &self.opts, &self.listener);
        shutdown.cancelled().await;
        Ok(())
    }
}
