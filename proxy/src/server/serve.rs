//! One serving thread's accept loop: its connections, and their drain.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use prometheus_client::metrics::counter::Counter;
use tokio::net::TcpListener;
use tokio_io_timeout::TimeoutWriter;
use tokio_util::sync::CancellationToken;

use crate::config::ProxyConfig;
use crate::handler::{self, Shared};
use crate::metrics::ThreadLabels;
use crate::self_wake::Absorbing;
use crate::server::http1;
use crate::waiting_room::Rewind;

/// What every serving thread shares: the request state, the HTTP settings,
/// the shutdown signal.
pub struct Serve {
    pub shared: Arc<Shared>,
    builder: auto::Builder<TokioExecutor>,
    limits: http1::Limits,
    drain_timeout: Duration,
    pub shutdown: CancellationToken,
}

impl Serve {
    pub fn new(shared: Arc<Shared>, cfg: &ProxyConfig, shutdown: CancellationToken) -> Serve {
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
        Serve {
            shared,
            builder,
            limits: http1::Limits {
                max_header_bytes: cfg.max_header_bytes,
                header_timeout: cfg.header_timeout,
                send_timeout: cfg.send_timeout,
            },
            drain_timeout: cfg.drain_timeout,
            shutdown,
        }
    }

    /// Accepts on `listener` (and `admin`, on the thread that has it) until
    /// shutdown, then stops accepting and lets this thread's connections
    /// finish for up to the drain timeout; those still open are cut.
    pub async fn accept_loop(
        self: Arc<Self>,
        thread: usize,
        listener: TcpListener,
        admin: Option<TcpListener>,
    ) {
        let accepted: Counter = self
            .shared
            .metrics
            .connections
            .get_or_create(&ThreadLabels { thread })
            .clone();
        let graceful = GracefulShutdown::new();
        // Connections still open after the drain timeout are aborted with it.
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let (stream, admin_conn) = tokio::select! {
                r = listener.accept() => (r, false),
                r = accept_admin(admin.as_ref()) => (r, true),
                Some(_) = conns.join_next(), if !conns.is_empty() => continue,
                _ = self.shutdown.cancelled() => break,
            };
            let stream = match stream {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, thread, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            };
            if !admin_conn {
                accepted.inc();
            }
            self.start_connection(&mut conns, &graceful, stream, admin_conn);
        }
        // What the kernel already queued on this listener would be reset
        // when it closes (unless `net.ipv4.tcp_migrate_req = 1` moves it to
        // another `--reuse-port` replica): those clients are served too.
        // Asked of the socket itself: the runtime may not have seen them yet.
        if let Ok(listener) = listener.into_std() {
            while let Ok((stream, _)) = listener.accept() {
                let Ok(stream) = stream
                    .set_nonblocking(true)
                    .and_then(|()| tokio::net::TcpStream::from_std(stream))
                else {
                    continue;
                };
                accepted.inc();
                self.start_connection(&mut conns, &graceful, stream, false);
            }
        }
        drop(admin);
        tracing::info!(thread, connections = graceful.count(), "draining");
        if tokio::time::timeout(self.drain_timeout, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!(
                thread,
                "drain timeout passed; closing remaining connections"
            );
        }
        conns.abort_all();
    }

    /// Serves one accepted connection in a task of `conns`, watched by
    /// `graceful`.
    fn start_connection(
        self: &Arc<Self>,
        conns: &mut tokio::task::JoinSet<()>,
        graceful: &GracefulShutdown,
        stream: tokio::net::TcpStream,
        admin_conn: bool,
    ) {
        let _ = stream.set_nodelay(true);
        let watcher = graceful.watcher();
        let serve = self.clone();
        // Absorbing: the hand-overs inside the connection's task (request
        // body to handler, upstream response to client) do not go through
        // the scheduler.
        conns.spawn(Absorbing::new(async move {
            let res = if admin_conn {
                let shared = serve.shared.clone();
                let svc = service_fn(move |req| {
                    let s = shared.clone();
                    async move { Ok::<_, Infallible>(handler::handle_admin(s, req).await) }
                });
                let io = TokioIo::new(stream);
                Box::pin(watcher.watch(serve.builder.serve_connection(io, svc))).await
            } else {
                serve.client_connection(stream, watcher).await
            };
            if let Err(e) = res {
                tracing::debug!(error = %e, "connection ended with error");
            }
        }));
    }

    /// One client connection: the proxy's own HTTP/1.1 server first (plain
    /// requests, waiting in the waiting room when their model is not
    /// awake), then hyper, from the first request of another kind on.
    async fn client_connection(
        self: Arc<Self>,
        mut stream: tokio::net::TcpStream,
        watcher: hyper_util::server::graceful::Watcher,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let prefix =
            match http1::serve(&self.shared, &mut stream, &self.limits, &self.shutdown).await {
                http1::End::Closed => return Ok(()),
                http1::End::Hyper(prefix) => prefix,
            };
        self.shared.metrics.to_hyper.inc();
        let shared = self.shared.clone();
        let svc = service_fn(move |req| {
            let s = shared.clone();
            async move { Ok::<_, Infallible>(handler::handle_main(s, req).await) }
        });
        let draining = self.shutdown.is_cancelled();
        // HTTP/2 with prior knowledge: the HTTP/1 reader stops at its
        // preface's version.
        let http2 = prefix.starts_with(H2_PREFACE_START);
        // hyper's HTTP/1 has no write deadline: a client that stops reading
        // would keep its request (and the engine's) going for ever.
        let mut io = TimeoutWriter::new(Rewind::new(prefix, stream));
        io.set_timeout(Some(self.limits.send_timeout));
        let io = TokioIo::new(Box::pin(io));
        if draining && http2 {
            // Served as HTTP/2 from the start: the watcher's graceful
            // shutdown of a connection still telling HTTP/1 from HTTP/2
            // closes it unanswered; HTTP/2's own (a GOAWAY once the
            // handshake is done) lets the streams already sent finish.
            let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
            h2.timer(TokioTimer::new())
                .max_header_list_size(self.limits.max_header_bytes.min(u32::MAX as usize) as u32);
            Box::pin(watcher.watch(h2.serve_connection(io, svc)))
                .await
                .map_err(Into::into)
        } else if draining {
            // The watcher would close this connection before hyper read its
            // first request (one that waited, or one that came as the drain
            // began). Serve that request, then close; holding the watcher
            // keeps the drain waiting for it.
            let _drain_waits = watcher;
            let mut once = hyper::server::conn::http1::Builder::new();
            once.timer(TokioTimer::new()).keep_alive(false);
            Box::pin(once.serve_connection(io, svc))
                .await
                .map_err(Into::into)
        } else {
            // Boxed: the waiting connection's task stays small.
            Box::pin(watcher.watch(self.builder.serve_connection(io, svc))).await
        }
    }
}

/// How an HTTP/2 connection with prior knowledge begins (RFC 9113 §3.4:
/// `PRI * HTTP/2.0`...), as far as HTTP/1's parser reads it.
const H2_PREFACE_START: &[u8] = b"PRI * HTTP/2";

/// The admin listener's next connection; never, on threads without it.
async fn accept_admin(
    admin: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)> {
    match admin {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}
