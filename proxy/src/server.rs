//! The proxy process: listeners, connections, background tasks, draining.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::activity::Activity;
use crate::config::{DEFAULT_CONTROL, ProxyConfig};
use crate::forward::Forwarder;
use crate::handler::{self, Shared};
use crate::hold::Holds;
use crate::metrics::Metrics;
use crate::route_table::RouteTable;
use crate::self_wake::Absorbing;
use crate::waiting_room::{self, Rewind};
use crate::watch_client::{ControlUrl, Controls, WatchCtx, run_control};

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
        let listener = TcpListener::from_std(self.listener)?;
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
            ),
            metrics: metrics.clone(),
            activity: activity.clone(),
            api_keys: cfg.api_keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
            max_body_bytes: cfg.max_body_bytes,
            body_timeout: cfg.body_timeout,
            leaving: Arc::new(tokio::sync::Semaphore::new(waiting_room::LEAVING_AT_ONCE)),
        });

        let ctx = WatchCtx {
            table: table.clone(),
            controls: controls.clone(),
            proxy_id: proxy_id.clone(),
            resolve_interval: cfg.resolve_interval,
        };
        for url in self.controls {
            tokio::spawn(run_control(ctx.clone(), url, background.child_token()));
        }
        tokio::spawn(
            holds
                .clone()
                .run(table.subscribe(), background.child_token()),
        );
        let reporter = tokio::spawn(activity.clone().run(
            controls.clone(),
            proxy_id.clone(),
            background.child_token(),
        ));

        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(cfg.header_timeout)
            .max_buf_size(cfg.max_header_bytes.max(8192))
            .keep_alive(true);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_header_list_size(cfg.max_header_bytes.min(u32::MAX as usize) as u32)
            .keep_alive_interval(Duration::from_secs(30));
        let builder = Arc::new(builder);
        let graceful = GracefulShutdown::new();
        // Connections still open after the drain timeout are aborted with it.
        let mut conns = tokio::task::JoinSet::new();
        tracing::info!(
            listen = %self.local_addr, admin = %self.admin_addr, %proxy_id,
            "siesta-proxy serving"
        );

        loop {
            let (stream, admin_conn) = tokio::select! {
                r = listener.accept() => (r, false),
                r = admin.accept() => (r, true),
                Some(_) = conns.join_next(), if !conns.is_empty() => continue,
                _ = shutdown.cancelled() => break,
            };
            let stream = match stream {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let shared = shared.clone();
            let builder = builder.clone();
            let watcher = graceful.watcher();
            let (max_header_bytes, header_timeout) = (cfg.max_header_bytes, cfg.header_timeout);
            let stopping = shutdown.clone();
            // Absorbing: the hand-overs inside the connection's task (request
            // body to handler, upstream response to client) do not go
            // through the scheduler.
            conns.spawn(Absorbing::new(async move {
                let res = if admin_conn {
                    let svc = service_fn(move |req| {
                        let s = shared.clone();
                        async move { Ok::<_, Infallible>(handler::handle_admin(s, req).await) }
                    });
                    let io = TokioIo::new(stream);
                    Box::pin(watcher.watch(builder.serve_connection(io, svc))).await
                } else {
                    // A request for a sleeping model waits here, cheaply,
                    // before hyper's connection state exists.
                    let entry = waiting_room::enter(
                        &shared,
                        &stream,
                        max_header_bytes,
                        header_timeout,
                        &stopping,
                    )
                    .await;
                    if entry.closed {
                        return;
                    }
                    let first = std::sync::Mutex::new(Some((entry.held_since, entry.gate)));
                    let svc = service_fn(move |req| {
                        let s = shared.clone();
                        let (held_since, gate) = first.lock().unwrap().take().unwrap_or_default();
                        async move {
                            let resp = handler::handle_main(s, req, held_since).await;
                            // Answered: the next waiting request may leave.
                            drop(gate);
                            Ok::<_, Infallible>(resp)
                        }
                    });
                    let io = TokioIo::new(Rewind::new(entry.prefix, stream));
                    if entry.held_since.is_some() && stopping.is_cancelled() {
                        // Draining: the watcher would close this connection
                        // before hyper read the request that waited. Serve
                        // that one request, then close; holding the watcher
                        // keeps the drain waiting for it.
                        let _drain_waits = watcher;
                        let mut once = hyper::server::conn::http1::Builder::new();
                        once.timer(TokioTimer::new()).keep_alive(false);
                        Box::pin(once.serve_connection(io, svc))
                            .await
                            .map_err(Into::into)
                    } else {
                        // Boxed: the waiting connection's task stays small.
                        Box::pin(watcher.watch(builder.serve_connection(io, svc))).await
                    }
                };
                if let Err(e) = res {
                    tracing::debug!(error = %e, "connection ended with error");
                }
            }));
        }

        drop(listener);
        drop(admin);
        tracing::info!(connections = graceful.count(), "draining");
        // Requests still held near the end of the drain get a 503 with
        // Retry-After rather than a cut connection.
        let margin = (cfg.drain_timeout / 10).min(Duration::from_secs(1));
        holds.shed_held_at(tokio::time::Instant::now() + cfg.drain_timeout.saturating_sub(margin));
        if tokio::time::timeout(cfg.drain_timeout, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("drain timeout passed; closing remaining connections");
        }
        conns.abort_all();
        background.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(3), reporter).await;
        tracing::info!("siesta-proxy stopped");
        Ok(())
    }
}
