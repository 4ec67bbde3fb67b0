//! Serves the gRPC routes over HTTP/2 with hyper directly (in place of
//! tonic's `Server`) so that each stream's task can be placed: `Watch`
//! streams, and `ListModels` (also answered from the hub's kept bytes),
//! run on a runtime of their own (threads named `siesta-watch`), every
//! other request on the daemon's runtime.
//!
//! Why: hyper drives each HTTP/2 stream's response in its own task. With
//! 1,000 subscribers one event wakes 1,000 stream tasks; on the daemon's
//! runtime they queue in front of the reconcilers and the unary RPCs
//! (`Sleep`, `GetModel`, `Demand`), so every state transition waited for
//! the fan-out. On their own threads the operating system's scheduler
//! runs a waking reconciler or RPC next to (or before) the fan-out, not
//! after it. The other way round too: at 1,000 models the reconcilers'
//! once-a-second engine polls come in bursts, and a `ListModels` answered
//! on the daemon's runtime waited behind them. Messages, order and resync semantics are unchanged: only
//! where the stream tasks run.
//!
//! How a stream is placed: hyper calls the service ([`Place::call`]) and
//! then hands the stream's future to the executor ([`Exec::execute`]) on
//! the same thread, with nothing in between; the service marks a `Watch`
//! request in a thread-local flag that the executor takes.

use std::cell::Cell;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::runtime::{Handle, Runtime};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::codegen::http;
use tonic::service::Routes;

use crate::api::watch::{LIST_MODELS_PATH, WATCH_PATH};
use copied_writes::CopiedWrites;

mod copied_writes;
mod preface;

thread_local! {
    /// Set by [`Place::call`] for a `Watch` request, taken by the
    /// [`Exec::execute`] that follows it on this thread.
    static NEXT_IS_WATCH: Cell<bool> = const { Cell::new(false) };
}

/// The runtime that runs the `Watch` streams' tasks; shut down (without
/// waiting for its tasks) when dropped.
#[derive(Debug)]
pub struct WatchRuntime {
    rt: Option<Runtime>,
    handle: Handle,
}

/// `SIESTA_WATCH_THREADS`: the watch runtime's threads; `0` runs the
/// `Watch` streams on the daemon's runtime like every other request.
pub const THREADS_ENV: &str = "SIESTA_WATCH_THREADS";

impl WatchRuntime {
    /// Half the cores (at least one; the fan-out never takes every core
    /// from the reconcilers and the unary RPCs), or [`THREADS_ENV`].
    /// `None` when that is 0.
    pub fn from_env() -> Result<Option<WatchRuntime>, crate::Error> {
        let threads = match std::env::var(THREADS_ENV) {
            Ok(v) => v.trim().parse::<usize>().map_err(|e| {
                crate::Error::Startup(std::io::Error::other(format!(
                    "{THREADS_ENV}={v:?}: not a number of threads: {e}"
                )))
            })?,
            Err(_) => std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
        };
        if threads == 0 {
            return Ok(None);
        }
        WatchRuntime::start(threads)
            .map(Some)
            .map_err(crate::Error::Startup)
    }

    pub fn start(threads: usize) -> std::io::Result<WatchRuntime> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("siesta-watch")
            .enable_all()
            .build()?;
        tracing::debug!(threads, "watch runtime started");
        Ok(WatchRuntime {
            handle: rt.handle().clone(),
            rt: Some(rt),
        })
    }

    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }
}

impl Drop for WatchRuntime {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which an async context forbids.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// hyper's executor: `Watch` streams on the watch runtime, the rest on
/// the runtime of the connection (the daemon's).
#[derive(Debug, Clone)]
pub struct Exec {
    watch: Option<Handle>,
    watch_streams: Arc<AtomicU64>,
}

impl Exec {
    /// `None`: every stream on the connection's runtime.
    pub fn new(watch: Option<Handle>) -> Exec {
        Exec {
            watch,
            watch_streams: Arc::default(),
        }
    }

    /// How many streams were placed on the watch runtime so far.
    #[cfg(test)]
    pub fn watch_streams(&self) -> u64 {
        self.watch_streams.load(Ordering::Relaxed)
    }
}

impl<F> hyper::rt::Executor<F> for Exec
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let is_watch = NEXT_IS_WATCH.with(|w| w.replace(false));
        match &self.watch {
            Some(watch) if is_watch => {
                self.watch_streams.fetch_add(1, Ordering::Relaxed);
                watch.spawn(fut);
            }
            _ => {
                tokio::spawn(fut);
            }
        }
    }
}

/// Marks `Watch` requests for [`Exec`], then calls the routes.
#[derive(Debug, Clone)]
struct Place<S>(S);

impl<S> hyper::service::Service<http::Request<Incoming>> for Place<S>
where
    S: hyper::service::Service<http::Request<Incoming>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn call(&self, req: http::Request<Incoming>) -> S::Future {
        let path = req.uri().path();
        NEXT_IS_WATCH.with(|w| w.set(path == WATCH_PATH || path == LIST_MODELS_PATH));
        self.0.call(req)
    }
}

/// How long a connection may take to finish its calls after the shutdown's
/// GOAWAY: then it is closed. A call that cannot end (a Watch whose client
/// stopped reading: its response waits for window space and its end is
/// never sent) kept the daemon from exiting after SIGTERM until systemd
/// killed it, its store unflushed.
pub const CONNECTION_DRAIN: Duration = Duration::from_secs(10);

/// HTTP/2 pings to each client this often, and a connection whose client
/// does not answer one within [`KEEP_ALIVE`] is closed: a host that vanished
/// (its streams' windows full, nothing in flight) leaked its connection for
/// good.
const KEEP_ALIVE: Duration = Duration::from_secs(20);

/// Serves `routes` on `listener` (HTTP/2 only, `TCP_NODELAY`, no limit on
/// concurrent streams: the settings tonic's `Server` used) until
/// `shutdown`; then stops accepting, asks every connection to finish
/// (GOAWAY) and waits until they have, [`CONNECTION_DRAIN`] at most.
pub async fn serve(listener: TcpListener, routes: Routes, exec: Exec, shutdown: CancellationToken) {
    let builder = http2(exec);
    let conns = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: keep serving the
                // connections there are.
                tracing::warn!(error = %e, "gRPC accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "TCP_NODELAY");
        }
        let svc = Place(TowerToHyperService::new(routes.clone()));
        let (builder, stop) = (builder.clone(), shutdown.clone());
        conns.spawn(async move {
            let tcp = tokio::select! {
                r = preface::read(tcp, preface::PREFACE_WAIT) => r,
                _ = stop.cancelled() => return,
            };
            let tcp = match tcp {
                Ok(tcp) => tcp,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "gRPC connection closed before HTTP/2 began");
                    return;
                }
            };
            let conn = builder.serve_connection(conn_io(tcp), svc);
            let mut conn = std::pin::pin!(conn);
            let done = tokio::select! {
                r = conn.as_mut() => Some(r),
                _ = stop.cancelled() => None,
            };
            let r = match done {
                Some(r) => r,
                None => {
                    conn.as_mut().graceful_shutdown();
                    match tokio::time::timeout(CONNECTION_DRAIN, conn).await {
                        Ok(r) => r,
                        Err(_) => {
                            tracing::warn!(%peer, "a gRPC connection's calls did not end within {CONNECTION_DRAIN:?} of the shutdown: closing it");
                            return;
                        }
                    }
                }
            };
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "gRPC connection ended");
            }
        });
    }
    drop(listener);
    conns.close();
    conns.wait().await;
}

/// The HTTP/2 server settings.
fn http2(exec: Exec) -> hyper::server::conn::http2::Builder<Exec> {
    let mut builder = hyper::server::conn::http2::Builder::new(exec);
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEP_ALIVE)
        .keep_alive_timeout(KEEP_ALIVE)
        .max_concurrent_streams(None)
        .max_local_error_reset_streams(None);
    builder
}

/// A connection's socket as HTTP/2 writes to it: small frames copied into
/// one buffer (see `copied_writes.rs`).
fn conn_io<T>(io: T) -> TokioIo<CopiedWrites<T>> {
    TokioIo::new(CopiedWrites(io))
}

#[cfg(test)]
mod tests;
