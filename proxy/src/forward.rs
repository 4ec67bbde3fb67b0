//! Forwarding to engines over pooled HTTP/1.1 connections the proxy drives
//! itself: the request body is already buffered (the model was inside it);
//! the response streams through.
//!
//! Each upstream connection is driven by the task of the request using it
//! (the client connection's task): while waiting for the response head and,
//! through [`ProxyBody`], while the body streams. Its HTTP/1.1 is the
//! proxy's own ([`h1`]): the request head is written from the client's
//! request in one pass, the response head parsed in place. When the body has ended
//! and the connection can carry another request it goes back to its
//! engine's idle pool ([`pool`]); a response the client gave up on drops
//! its connection. No task per connection, so no cross-task wake per chunk.
//!
//! Idle pooled connections are dropped after the upstream idle timeout
//! (default 4 s, below the 5 s after which vLLM's uvicorn closes them), and
//! one the engine closed while idle is noticed at checkout and not used. A
//! request that fails because the engine closed a reused pooled connection
//! as the request went out (closed or reset before any answer, within
//! [`RETRY_WINDOW`]) is sent once more on a fresh connection.

mod conn;
mod h1;
mod pool;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Response;
use http::header::HeaderValue;
use http::uri::Authority;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::OwnedSemaphorePermit;

use crate::body::ProxyBody;
use crate::metrics::{Metrics, ModelLabels};
use crate::route_table::Upstream;
pub use conn::UpstreamConn;
use h1::RequestHead;
pub use h1::{ClientHeaders, RawHead, UpstreamError, named_in, stops_here};
pub use pool::{DEFAULT_ENGINE_CONCURRENCY, DEFAULT_UPSTREAM_TIMEOUT};
use pool::{EngineLimits, EnginePool};

/// Default time an idle upstream connection is kept: below uvicorn's 5 s.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// A reused connection closed with no byte of answer this soon after the
/// request was sent is the engine closing it as idle as the request went
/// out, not an engine dying mid-request (a dead engine is found by the
/// fresh connection, which then fails, so nothing runs twice). Seconds,
/// not one: a busy engine's event loop can run its idle timer late, with
/// the request already in its socket, unread (seen on a loaded 2-core box:
/// with a window of 1 s, 10 of 2,000 requests released at once got 502).
pub const RETRY_WINDOW: Duration = Duration::from_secs(10);

/// Why a forward failed.
#[derive(Debug)]
pub enum ForwardError {
    /// The engine could not be connected to: the request was not sent, so it
    /// may go elsewhere.
    Connect(String),
    /// The model stopped serving before the request was sent (a fence:
    /// `activity.rs`): route it again (it is held).
    Fenced,
    /// Every one of the engine's slots (`--engine-concurrency`) stayed
    /// taken until the deadline: the request was not sent.
    Busy { slots: usize, waited: Duration },
    /// The engine sent no response head for `--upstream-timeout`.
    Quiet(String),
    /// Anything after the request may have reached the engine.
    Other(String),
}

/// How long a request may wait for one of its engine's slots: its hold
/// limit from its first wait (`since`; None: it has not waited), and
/// [`crate::hold::SLOT_WAIT_MIN`] at least. Worked out only when no slot
/// is free, off the common path.
#[derive(Debug, Clone, Copy)]
pub struct SlotWait {
    pub since: Option<tokio::time::Instant>,
    pub hold: Duration,
}

impl SlotWait {
    fn deadline(&self, now: tokio::time::Instant) -> tokio::time::Instant {
        (self.since.unwrap_or(now) + self.hold).max(now + crate::hold::SLOT_WAIT_MIN)
    }
}

/// The client's request, as forwarding needs it (the body aside).
#[derive(Debug, Clone, Copy)]
pub struct ClientRequest<'a> {
    pub method: &'a http::Method,
    /// Origin form: path and query.
    pub target: &'a str,
    pub version: http::Version,
    pub headers: ClientHeaders<'a>,
}

impl<'a> ClientRequest<'a> {
    /// A request hyper parsed.
    pub fn of(parts: &'a http::request::Parts) -> Self {
        ClientRequest {
            method: &parts.method,
            target: parts.uri.path_and_query().map_or("/", |pq| pq.as_str()),
            version: parts.version,
            headers: ClientHeaders::Map(&parts.headers),
        }
    }
}

/// What forwarding to one [`Upstream`] needs, resolved on its first request
/// and kept with it: the engine's pool and slots, the model's metrics and
/// the Host header.
#[derive(Debug)]
pub struct UpstreamHandles {
    pool: Arc<EnginePool>,
    ttfb: Histogram,
    duration: Histogram,
    host: HeaderValue,
}

/// Forwards requests to engines over per-engine pools of connections.
#[derive(Debug, Clone)]
pub struct Forwarder {
    metrics: Arc<Metrics>,
    /// Drop the client's Authorization header (it carries the proxy's API key).
    strip_authorization: bool,
    /// Idle time, slots and quiet time of every engine.
    limits: EngineLimits,
    /// Serving threads (each keeps its own idle connections).
    threads: usize,
    /// The runtime the pools' reapers run on: the one that made this
    /// forwarder (thread 0's), which outlives the other serving threads.
    reaper: tokio::runtime::Handle,
    /// Per engine (`host:port`): idle connections and slots, for as long
    /// as an upstream (an awake route or a request in flight) holds them:
    /// an engine that is gone (restarted on another port, asleep, removed)
    /// takes its pool, its idle connections and its reaper with it.
    engines: Arc<Mutex<HashMap<Authority, Weak<EnginePool>>>>,
}

/// Tracks one request at an engine: outstanding count, activity, metrics,
/// and its slot among the engine's concurrent requests.
/// Completion is recorded once, when the response body ends or is dropped.
#[derive(Debug)]
pub struct InFlightGuard {
    up: Arc<Upstream>,
    started: Instant,
    done: bool,
    _slot: OwnedSemaphorePermit,
}

impl InFlightGuard {
    fn new(up: Arc<Upstream>, slot: OwnedSemaphorePermit) -> Self {
        up.outstanding.fetch_add(1, Ordering::Relaxed);
        up.activity.start();
        InFlightGuard {
            up,
            started: Instant::now(),
            done: false,
            _slot: slot,
        }
    }

    /// Records the end of the exchange (`complete`: the body ended normally).
    pub fn finish(mut self, complete: bool) {
        self.record(complete);
    }

    fn record(&mut self, complete: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        self.up.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.up.activity.finish();
        if complete && let Some(h) = self.up.handles.get() {
            h.duration.observe(self.started.elapsed().as_secs_f64());
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.record(false);
    }
}

impl Forwarder {
    /// `idle`: how long an idle upstream connection is kept (keep it below
    /// the engines' keep-alive; [`DEFAULT_UPSTREAM_IDLE_TIMEOUT`]); `threads`:
    /// the serving threads ([`crate::threads`]). Call it on the runtime
    /// that outlives the serving threads (it panics outside a runtime).
    pub fn new(
        metrics: Arc<Metrics>,
        strip_authorization: bool,
        idle: Duration,
        threads: usize,
    ) -> Self {
        Forwarder {
            metrics,
            strip_authorization,
            limits: EngineLimits {
                idle_timeout: idle,
                concurrency: DEFAULT_ENGINE_CONCURRENCY,
                quiet: DEFAULT_UPSTREAM_TIMEOUT,
            },
            threads,
            reaper: tokio::runtime::Handle::current(),
            engines: Default::default(),
        }
    }

    /// At most `n` requests at one engine at once (at least 1).
    pub fn with_engine_concurrency(mut self, n: usize) -> Self {
        self.limits.concurrency = n.max(1);
        self
    }

    /// An engine that sends nothing on a request for `quiet` (no byte of
    /// its response head, or of its body while it is read) ends it.
    pub fn with_upstream_timeout(mut self, quiet: Duration) -> Self {
        self.limits.quiet = quiet;
        self
    }

    /// `up`'s pool, metrics and Host header; looked up once per upstream.
    fn handles<'a>(&self, up: &'a Upstream) -> &'a UpstreamHandles {
        up.handles.get_or_init(|| {
            let pool = self.pool_for(&up.authority);
            let labels = ModelLabels {
                model: up.model.clone(),
            };
            UpstreamHandles {
                pool,
                ttfb: self.metrics.upstream_ttfb.get_or_create(&labels).clone(),
                duration: self
                    .metrics
                    .upstream_duration
                    .get_or_create(&labels)
                    .clone(),
                host: HeaderValue::from_str(up.authority.as_str())
                    .unwrap_or_else(|_| HeaderValue::from_static("localhost")),
            }
        })
    }

    /// Closes every idle upstream connection now: at the end of a drain
    /// nothing will use them, and the engines need not wait for the idle
    /// timeout to see them go.
    pub fn close_idle(&self) {
        let pools: Vec<Arc<EnginePool>> = self
            .engines
            .lock()
            .unwrap()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for pool in pools {
            pool.close_idle();
        }
    }

    /// `authority`'s pool: the one upstreams of it hold now, or a new one.
    fn pool_for(&self, authority: &Authority) -> Arc<EnginePool> {
        let mut engines = self.engines.lock().unwrap();
        if let Some(pool) = engines.get(authority).and_then(Weak::upgrade) {
            return pool;
        }
        // Rare (a new engine address): forget the engines no one uses.
        engines.retain(|_, p| p.strong_count() > 0);
        let pool = EnginePool::new(authority, self.limits, self.threads, &self.reaper);
        engines.insert(authority.clone(), Arc::downgrade(&pool));
        pool
    }

    /// Sends the request to `up` and returns its response, body streaming.
    /// `gate` (a released held request's place on its way out of the
    /// waiting room) is given back at the answer's head, or once the engine
    /// has had the request for [`crate::hold::GATE_HOLD_MAX`].
    pub async fn forward(
        &self,
        up: &Arc<Upstream>,
        req: &ClientRequest<'_>,
        body: Bytes,
        gate: Option<OwnedSemaphorePermit>,
        slot_wait: SlotWait,
    ) -> Result<Response<ProxyBody>, ForwardError> {
        if up.scheme != http::uri::Scheme::HTTP {
            // As hyper's HTTP connector said before: only plain HTTP.
            return Err(ForwardError::Connect(format!(
                "{}: only http:// engine URLs are supported",
                up.url
            )));
        }
        let h = self.handles(up);
        let head = RequestHead {
            method: req.method,
            target: req.target,
            host: h.host.as_bytes(),
            content_length: body.len(),
            strip_authorization: self.strip_authorization,
        };
        let slots = &h.pool.slots;
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            // Boxed: the timer stays out of every other request's future.
            Err(_) => {
                let now = tokio::time::Instant::now();
                let by = slot_wait.deadline(now);
                match Box::pin(tokio::time::timeout_at(by, slots.clone().acquire_owned())).await {
                    Ok(slot) => slot.expect("the semaphore is never closed"),
                    Err(_) => {
                        return Err(ForwardError::Busy {
                            slots: self.limits.concurrency,
                            waited: by - slot_wait.since.unwrap_or(now),
                        });
                    }
                }
            }
        };
        let guard = InFlightGuard::new(up.clone(), slot);
        if up.activity.fenced() {
            // The model stopped serving between the route lookup and now;
            // counted in flight first, so a fence report never misses it.
            guard.finish(false);
            return Err(ForwardError::Fenced);
        }
        let mut conn = match h.pool.checkout() {
            Some(c) => c,
            None => match UpstreamConn::connect(&h.pool).await {
                Ok(c) => c,
                Err(e) => {
                    guard.finish(false);
                    return Err(ForwardError::Connect(e));
                }
            },
        };
        let sent = Instant::now();
        let mut result = match gate {
            None => conn.send(&head, req.headers, &body).await,
            // Boxed: the timer stays out of every other request's future.
            Some(gate) => Box::pin(send_gated(&mut conn, &head, req.headers, &body, gate)).await,
        };
        let mut first_error = None;
        if let Err(e) = &result
            && conn.reused
            && !conn.answered()
            && sent.elapsed() < RETRY_WINDOW
            && e.closed_before_answer()
        {
            let error = e.to_string();
            tracing::info!(model = %up.model, url = %up.url, %error,
                "engine closed a reused connection as the request went out; sending it again on a fresh one");
            conn = match UpstreamConn::connect(&h.pool).await {
                Ok(c) => c,
                // The engine is gone, not closing an idle connection: the
                // first attempt may have reached it, so it goes nowhere else.
                Err(e) => {
                    return Err(ForwardError::Other(format!(
                        "{error} (sent again on a fresh connection: {e})"
                    )));
                }
            };
            // Like a one-off client: the retry's connection is not kept.
            conn.poolable = false;
            first_error = Some(error);
            result = conn.send(&head, req.headers, &body).await;
        }
        if let Err(e) = &result
            && !conn.answered()
            && !conn.reused
            && e.reset_unread()
        {
            // A fresh connection (or the retry's): the engine never read the
            // request, so it may go elsewhere, or wait for the engine's return.
            guard.finish(false);
            let before = first_error
                .map(|f| format!(" (after: {f})"))
                .unwrap_or_default();
            return Err(ForwardError::Connect(format!(
                "the engine reset a new connection with the request unread (it is going away): {e}{before}"
            )));
        }
        match result {
            Ok(conn::Answer { mut parts, sse }) => {
                h.ttfb.observe(guard.started.elapsed().as_secs_f64());
                if conn.body_done()
                    && let Some(raw) = conn.raw_head()
                {
                    // The body is over before it is relayed: the connection
                    // goes back now, its raw headers with it.
                    parts.headers = raw.to_map();
                }
                Ok(Response::from_parts(
                    parts,
                    ProxyBody::upstream(conn, guard, sse),
                ))
            }
            Err(e) => match first_error {
                Some(first) => Err(ForwardError::Other(format!(
                    "{first} (sent again on a fresh connection: {e})"
                ))),
                None if conn.reused && !conn.answered() && e.closed_before_answer() => {
                    Err(ForwardError::Other(format!(
                        "{e} ({:.1} s after it was sent on a reused connection: too late to be \
                         the engine closing an idle one, so not sent again)",
                        sent.elapsed().as_secs_f64()
                    )))
                }
                None if matches!(e, UpstreamError::Quiet(_)) => {
                    Err(ForwardError::Quiet(e.to_string()))
                }
                None => Err(ForwardError::Other(e.to_string())),
            },
        }
    }
}

/// Sends a released held request, giving its way-out place (`gate`) back
/// at the answer's head (a released queue leaves at the engine's pace, not
/// all at once) or after [`crate::hold::GATE_HOLD_MAX`] (a long generation
/// holds no other request back), whichever comes first.
async fn send_gated(
    conn: &mut UpstreamConn,
    head: &RequestHead<'_>,
    headers: ClientHeaders<'_>,
    body: &Bytes,
    gate: OwnedSemaphorePermit,
) -> Result<conn::Answer, UpstreamError> {
    let send = conn.send(head, headers, body);
    tokio::pin!(send);
    tokio::select! {
        r = &mut send => r,
        () = tokio::time::sleep(crate::hold::GATE_HOLD_MAX) => {
            drop(gate);
            send.await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pool_made_on_a_serving_thread_is_reaped_after_that_thread_ends() {
        let engine = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a: Authority = engine.local_addr().unwrap().to_string().parse().unwrap();
        let f = Forwarder::new(
            Arc::new(Metrics::new()),
            false,
            Duration::from_millis(50),
            2,
        );
        let on_thread = f.clone();
        let t = crate::threads::spawn(1, move || async move {
            let pool = on_thread.pool_for(&a);
            let conn = conn::UpstreamConn::connect(&pool).await.unwrap();
            conn.release();
            assert_eq!(pool.idle_count(), 1);
        })
        .unwrap();
        let (mut engine_side, _) = engine.accept().await.unwrap();
        t.done.await.unwrap();
        // Thread 1 and its runtime are gone; the idle connection it left is
        // still closed after the idle timeout (the reaper runs here).
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::io::AsyncReadExt::read(&mut engine_side, &mut b),
        )
        .await
        .expect("the idle connection of an ended thread was never closed")
        .unwrap();
        assert_eq!(n, 0);
    }

    /// A listener standing for an engine, and a connection to it whose
    /// `--upstream-timeout` is `quiet`.
    async fn engine_and_conn(
        quiet: Duration,
    ) -> (tokio::net::TcpListener, Box<conn::UpstreamConn>) {
        let engine = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a: Authority = engine.local_addr().unwrap().to_string().parse().unwrap();
        let limits = pool::EngineLimits {
            idle_timeout: Duration::from_secs(4),
            concurrency: 4,
            quiet,
        };
        let pool = EnginePool::new(&a, limits, 1, &tokio::runtime::Handle::current());
        let conn = conn::UpstreamConn::connect(&pool).await.unwrap();
        (engine, conn)
    }

    /// The head of an upload of `len` bytes.
    fn upload(len: usize) -> RequestHead<'static> {
        RequestHead {
            method: &http::Method::POST,
            target: "/v1/audio/transcriptions",
            host: b"e",
            content_length: len,
            strip_authorization: false,
        }
    }

    /// `--upstream-timeout` while a large body (over 16 KiB: written while
    /// the answer is read) goes out: an engine that accepts but neither
    /// reads nor answers (its API server's event loop stuck, a stopped
    /// process) has the request ended, as one that sends no head does.
    /// Before, the write waited for as long as the client did, holding the
    /// model's in-flight count.
    #[tokio::test]
    async fn an_engine_that_never_reads_a_large_body_has_the_request_ended() {
        let (engine, mut conn) = engine_and_conn(Duration::from_millis(300)).await;
        let (_engine_side, _) = engine.accept().await.unwrap(); // never read
        let body = Bytes::from(vec![b'x'; 32 * 1024 * 1024]);
        let head = upload(body.len());
        let r = tokio::time::timeout(
            Duration::from_secs(60),
            conn.send(&head, ClientHeaders::Lines(b""), &body),
        )
        .await;
        match r {
            Ok(Err(UpstreamError::Quiet(d))) => assert_eq!(d, Duration::from_millis(300)),
            Ok(other) => panic!("{other:?}"),
            Err(_) => panic!("still writing the body 60 s on, with --upstream-timeout at 300 ms"),
        }
    }

    /// A large body the engine reads slowly, each pause shorter than
    /// `--upstream-timeout` but all of them together far longer, goes out
    /// whole: the timeout is for an engine that takes nothing, not a limit
    /// on the whole upload. (The proxy sees the engine take bytes when the
    /// kernel lets it write again, once about half its send buffer, a few
    /// MB on loopback, has gone: the engine here takes ~10 MB/s.)
    #[tokio::test]
    async fn a_large_body_read_slowly_is_not_timed_out() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let quiet = Duration::from_secs(1);
        let (engine, mut conn) = engine_and_conn(quiet).await;
        let body = Bytes::from(vec![b'x'; 40 * 1024 * 1024]);
        let total = body.len();
        let reader = tokio::spawn(async move {
            let (mut s, _) = engine.accept().await.unwrap();
            let mut buf = vec![0; 1024 * 1024];
            let mut got = 0usize;
            let started = std::time::Instant::now();
            // Until the whole head and body are in: the head is a few
            // hundred bytes, the rest is the body.
            while got < total {
                let n = s.read(&mut buf).await.unwrap();
                assert_ne!(n, 0, "the proxy closed after {got} bytes");
                got += n;
                tokio::time::sleep(quiet / 10).await;
            }
            let slow = started.elapsed();
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            slow
        });
        let head = upload(body.len());
        let answer = tokio::time::timeout(
            Duration::from_secs(120),
            conn.send(&head, ClientHeaders::Lines(b""), &body),
        )
        .await
        .expect("no answer in 120 s")
        .expect("the slow upload was ended");
        assert_eq!(answer.parts.status, 200);
        let slow = reader.await.unwrap();
        assert!(
            slow > quiet * 3,
            "the engine read the body in {slow:?}, not much longer than the timeout: the test shows nothing"
        );
    }

    #[tokio::test]
    async fn an_engine_no_upstream_uses_is_forgotten_with_its_pool() {
        let f = Forwarder::new(Arc::new(Metrics::new()), false, Duration::from_secs(4), 1);
        let a: Authority = "127.0.0.1:20001".parse().unwrap();
        let b: Authority = "127.0.0.1:20002".parse().unwrap();
        let one = f.pool_for(&a);
        let two = f.pool_for(&a);
        assert!(
            Arc::ptr_eq(&one, &two),
            "two upstreams of one engine share its pool"
        );
        let weak = Arc::downgrade(&one);
        drop((one, two));
        assert!(weak.upgrade().is_none(), "the pool outlived its upstreams");
        let _other = f.pool_for(&b);
        let engines = f.engines.lock().unwrap();
        assert_eq!(engines.len(), 1, "a gone engine is still listed");
        assert!(engines.contains_key(&b));
    }
}
