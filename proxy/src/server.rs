//! The proxy process: listeners, connections, background tasks, draining.

pub mod http1;
mod serve;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::activity::Activity;
use crate::config::{DEFAULT_CONTROL, ProxyConfig};
use crate::forward::Forwarder;
use crate::handler::Shared;
use crate::hold::Holds;
use crate::metrics::Metrics;
use crate::route_table::RouteTable;
use crate::threads;
use crate::watch_client::{ControlUrl, Controls, WatchCtx, run_control};
use serve::Serve;

/// A bound proxy, ready to [`run`](Proxy::run).
#[derive(Debug)]
pub struct Proxy {
    cfg: ProxyConfig,
    controls: Vec<ControlUrl>,
    listener: std::net::TcpListener,
    admin: std::net::TcpListener,
    local_addr: SocketAddr,
    admin_addr: SocketAddr,
}

/// `client`: the client listener, whose "in use" error suggests --reuse-port.
fn bind_std(addr: SocketAddr, client: bool) -> Result<std::net::TcpListener, Error> {
    let l = std::net::TcpListener::bind(addr).map_err(|source| match client {
        true => bind_error(addr, source, false),
        false => Error::Bind { addr, source },
    })?;
    l.set_nonblocking(true)
        .map_err(|source| Error::Bind { addr, source })?;
    Ok(l)
}

/// The client listener with `SO_REUSEPORT`: every replica that binds the
/// same address with it gets its own accept queue and the kernel spreads new
/// connections over them.
fn bind_reuse_port(addr: SocketAddr) -> Result<std::net::TcpListener, Error> {
    use socket2::{Domain, Protocol, Socket, Type};
    let err = |source| Error::Bind { addr, source };
    let s =
        Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)).map_err(err)?;
    s.set_reuse_address(true).map_err(err)?;
    s.set_reuse_port(true).map_err(err)?;
    s.bind(&addr.into())
        .map_err(|source| bind_error(addr, source, true))?;
    s.listen(LISTEN_BACKLOG).map_err(err)?;
    s.set_nonblocking(true).map_err(err)?;
    Ok(s.into())
}

/// Listen backlog of a `--reuse-port` listener (the kernel caps it at
/// `net.core.somaxconn`).
const LISTEN_BACKLOG: i32 = 4096;

fn bind_error(addr: SocketAddr, source: std::io::Error, reuse_port: bool) -> Error {
    if source.kind() == std::io::ErrorKind::AddrInUse {
        Error::AddrInUse { addr, reuse_port }
    } else {
        Error::Bind { addr, source }
    }
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_else(|| "localhost".to_owned())
}

impl Proxy {
    /// Validates the configuration and binds both listeners (port 0: any).
    /// Needs no runtime; [`run`](Proxy::run) does the rest.
    pub fn bind(cfg: ProxyConfig) -> Result<Proxy, Error> {
        let urls: Vec<String> = if cfg.controls.is_empty() {
            vec![DEFAULT_CONTROL.to_owned()]
        } else {
            cfg.controls.clone()
        };
        let controls = urls
            .iter()
            .map(|u| ControlUrl::parse(u))
            .collect::<Result<Vec<_>, _>>()?;
        Controls::new(cfg.token.as_deref())?;
        if cfg.max_body_bytes == 0 {
            return Err(Error::Config("max_body_bytes must be positive".into()));
        }
        let listener = if cfg.reuse_port {
            bind_reuse_port(cfg.listen)?
        } else {
            bind_std(cfg.listen, true)?
        };
        let admin = bind_std(cfg.admin_listen, false)?;
        let local_addr = listener.local_addr()?;
        let admin_addr = admin.local_addr()?;
        Ok(Proxy {
            cfg,
            controls,
            listener,
            admin,
            local_addr,
            admin_addr,
        })
    }

    /// The OpenAI-compatible listener's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The admin listener's address (`/metrics`, `/healthz`, `/readyz`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Serves until `shutdown`, then stops accepting, lets in-flight requests
    /// finish (up to the drain timeout) and sends the last activity report.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let cfg = self.cfg;
        // Replicas sharing a port (--reuse-port) are told apart by pid.
        let proxy_id = cfg.proxy_id.clone().unwrap_or_else(|| {
            let id = format!("proxy@{}:{}", hostname(), self.local_addr.port());
            if cfg.reuse_port {
                format!("{id}/{}", std::process::id())
            } else {
                id
            }
        });
        let admin = TcpListener::from_std(self.admin)?;

        let metrics = Arc::new(Metrics::new());
        let activity = Arc::new(Activity::default());
        let table = Arc::new(RouteTable::new(activity.clone()));
        let controls = Arc::new(Controls::new(cfg.token.as_deref())?);
        // Background work outlives the listeners so held requests can still
        // be released while draining.
        let background = CancellationToken::new();
        let _stop_background = background.clone().drop_guard();
        let holds = Arc::new(Holds::new(
            table.clone(),
            controls.clone(),
            metrics.clone(),
            activity.clone(),
            proxy_id.clone(),
            background.child_token(),
        ));
        let shared = Arc::new(Shared {
            table: table.clone(),
            holds: holds.clone(),
            forwarder: Forwarder::new(
                metrics.clone(),
                !cfg.api_keys.is_empty(),
                cfg.upstream_idle_timeout,
                cfg.threads.max(1),
            )
            .with_engine_concurrency(cfg.engine_concurrency)
            .with_upstream_timeout(cfg.upstream_timeout),
            metrics: metrics.clone(),
            activity: activity.clone(),
            api_keys: cfg.api_keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
            max_body_bytes: cfg.max_body_bytes,
            body_timeout: cfg.body_timeout,
            send_timeout: cfg.send_timeout,
            first_snapshot_wait: cfg.first_snapshot_wait,
        });

        let ctx = WatchCtx {
            table: table.clone(),
            controls: controls.clone(),
            proxy_id: proxy_id.clone(),
            resolve_interval: cfg.resolve_interval,
            metrics: metrics.clone(),
        };
        for url in self.controls {
            tokio::spawn(run_control(ctx.clone(), url, background.child_token()));
        }
        tokio::spawn(
            holds
                .clone()
                .run(table.subscribe(), background.child_token()),
        );
        // Stopped before the rest: its last report (nothing in flight,
        // nothing held) needs the control planes' clients, which the Watch
        // tasks drop when they stop.
        let reporting = background.child_token();
        let reporter = tokio::spawn(activity.clone().run(
            controls.clone(),
            proxy_id.clone(),
            reporting.clone(),
        ));

        // Every duplicate of the listening socket, and thread 0's
        // registration, before any thread serves: nothing fails after.
        let dups = (1..cfg.threads.max(1))
            .map(|_| self.listener.try_clone())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                Error::Config(format!(
                    "cannot give {} serving threads the listening socket: {e} \
                     (lower --threads or raise the open-files limit)",
                    cfg.threads
                ))
            })?;
        let listener = TcpListener::from_std(self.listener)?;
        let stop_serving = shutdown.child_token();
        let serve = Arc::new(Serve::new(shared, &cfg, stop_serving.clone()));
        // Threads 1.. accept from the duplicates.
        let mut others = Vec::new();
        for (index, l) in (1..).zip(dups) {
            let serve = serve.clone();
            let started = threads::spawn(index, move || async move {
                match TcpListener::from_std(l) {
                    Ok(l) => serve.accept_loop(index, l, None).await,
                    Err(error) => {
                        tracing::error!(thread = index, %error, "cannot listen on this thread")
                    }
                }
            });
            match started {
                Ok(t) => others.push(t),
                Err(e) => {
                    // The threads already started stop, and are waited for.
                    stop_serving.cancel();
                    for t in others {
                        let _ = t.done.await;
                    }
                    return Err(e);
                }
            }
        }
        tracing::info!(
            listen = %self.local_addr, admin = %self.admin_addr, %proxy_id,
            threads = cfg.threads.max(1), "siesta-proxy serving"
        );
        // Requests still held near the end of the drain (or at once, if
        // configured so) get a 503 with Retry-After rather than a cut
        // connection.
        let shed_held = async {
            shutdown.cancelled().await;
            let margin = (cfg.drain_timeout / 10).min(Duration::from_secs(1));
            let hold_on = if cfg.shed_held_on_shutdown {
                Duration::ZERO
            } else {
                cfg.drain_timeout.saturating_sub(margin)
            };
            holds.shed_held_at(tokio::time::Instant::now() + hold_on);
        };
        tokio::join!(
            serve.clone().accept_loop(0, listener, Some(admin)),
            shed_held
        );
        for thread in others {
            if thread.done.await.is_err() {
                tracing::warn!(thread = thread.index, "a serving thread ended abnormally");
            }
        }
        // Every request is answered: the engines see their idle connections
        // close now, not after the idle timeout.
        serve.shared.forwarder.close_idle();
        reporting.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(3), reporter).await;
        background.cancel();
        tracing::info!("siesta-proxy stopped");
        Ok(())
    }
}
