//! Forwarding to engines over a pooled hyper client: the request body is
//! already buffered (the model was inside it); the response streams through.
//!
//! Idle pooled connections are dropped after the upstream idle timeout
//! (default 4 s, below the 5 s after which vLLM's uvicorn closes them). A
//! request that fails because the engine closed a reused pooled connection
//! as the request went out (closed or reset before any answer, within
//! [`RETRY_WINDOW`]) is sent once more on a fresh connection.

mod conn;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::Authority;
use http::{Request, Response, Uri, Version};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{HttpConnector, capture_connection};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::body::ProxyBody;
use crate::metrics::{Metrics, ModelLabels};
use crate::route_table::Upstream;
use conn::CountingConnector;

/// Default time an idle upstream connection is kept: below uvicorn's 5 s.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// A failure on a reused connection this soon after sending is the engine
/// closing it as the request went out, not an engine dying mid-request.
pub const RETRY_WINDOW: Duration = Duration::from_secs(1);

/// Why a forward failed.
#[derive(Debug)]
pub enum ForwardError {
    /// The engine could not be connected to: the request was not sent, so it
    /// may go elsewhere.
    Connect(String),
    /// The model stopped serving before the request was sent (a fence:
    /// `activity.rs`): route it again (it is held).
    Fenced,
    /// Anything after the request may have reached the engine.
    Other(String),
}

/// The pooled client to engines.
#[derive(Debug, Clone)]
pub struct Forwarder {
    client: Client<CountingConnector, Full<Bytes>>,
    /// Keeps no idle connection: a retry always goes out on a fresh one.
    fresh: Client<HttpConnector, Full<Bytes>>,
    metrics: Arc<Metrics>,
    /// Drop the client's Authorization header (it carries the proxy's API key).
    strip_authorization: bool,
    /// Per engine (`host:port`): slots for concurrent requests.
    slots: Arc<Mutex<HashMap<Authority, Arc<Semaphore>>>>,
}

static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Removes hop-by-hop headers, including those the Connection header names.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    if let Some(conn) = h.get(header::CONNECTION) {
        let named: Vec<HeaderName> = conn
            .to_str()
            .unwrap_or("")
            .split(',')
            .filter_map(|s| HeaderName::from_bytes(s.trim().as_bytes()).ok())
            .collect();
        for n in named {
            h.remove(n);
        }
    }
    for n in &HOP_BY_HOP {
        h.remove(n);
    }
    h.remove(header::UPGRADE);
}

/// Tracks one request at an engine: outstanding count, activity, metrics,
/// and its slot among the engine's concurrent requests.
/// Completion is recorded once, when the response body ends or is dropped.
#[derive(Debug)]
pub struct InFlightGuard {
    up: Arc<Upstream>,
    metrics: Arc<Metrics>,
    started: Instant,
    done: bool,
    _slot: OwnedSemaphorePermit,
}

impl InFlightGuard {
    fn new(up: Arc<Upstream>, metrics: Arc<Metrics>, slot: OwnedSemaphorePermit) -> Self {
        up.outstanding.fetch_add(1, Ordering::Relaxed);
        up.activity.start();
        InFlightGuard {
            up,
            metrics,
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
        if complete {
            self.metrics
                .upstream_duration
                .get_or_create(&ModelLabels {
                    model: self.up.model.clone(),
                })
                .observe(self.started.elapsed().as_secs_f64());
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.record(false);
    }
}

/// Idle upstream connections kept per engine.
const MAX_IDLE_PER_ENGINE: usize = 128;
/// Requests at one engine at once (so connections to it): more wait here,
/// in arrival order, for a slot. This paces the release of a whole hold
/// queue (10,000 requests do not open 10,000 connections at once) and is
/// no lower than what vLLM runs at once (`max_num_seqs`: 256 to 1024).
pub const MAX_CONCURRENT_PER_ENGINE: usize = 1024;

fn connector() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(Duration::from_secs(3)));
    http.set_keepalive(Some(Duration::from_secs(60)));
    http
}

impl Forwarder {
    /// `idle`: how long an idle upstream connection is kept (keep it below
    /// the engines' keep-alive; [`DEFAULT_UPSTREAM_IDLE_TIMEOUT`]).
    pub fn new(metrics: Arc<Metrics>, strip_authorization: bool, idle: Duration) -> Self {
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(idle)
            // A burst (a queue of held requests released at once) opens one
            // connection per request; keep only this many idle afterwards so
            // their buffers are given back.
            .pool_max_idle_per_host(MAX_IDLE_PER_ENGINE)
            .build(CountingConnector::new(connector()));
        let fresh = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector());
        Forwarder {
            client,
            fresh,
            metrics,
            strip_authorization,
            slots: Default::default(),
        }
    }

    /// A slot for one request at `up`'s engine; waits (in order) while
    /// [`MAX_CONCURRENT_PER_ENGINE`] are there.
    async fn slot(&self, up: &Upstream) -> OwnedSemaphorePermit {
        let sem = self
            .slots
            .lock()
            .unwrap()
            .entry(up.authority.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(MAX_CONCURRENT_PER_ENGINE)))
            .clone();
        sem.acquire_owned()
            .await
            .expect("the semaphore is never closed")
    }

    /// Sends the request to `up` and returns its response, body streaming.
    pub async fn forward(
        &self,
        up: &Arc<Upstream>,
        parts: &http::request::Parts,
        body: Bytes,
    ) -> Result<Response<ProxyBody>, ForwardError> {
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(up.scheme.clone());
        uri.authority = Some(up.authority.clone());
        uri.path_and_query = parts.uri.path_and_query().cloned();
        let uri = Uri::from_parts(uri).map_err(|e| ForwardError::Other(e.to_string()))?;

        let len = body.len();
        let mut headers = parts.headers.clone();
        strip_hop_by_hop(&mut headers);
        headers.remove(header::HOST);
        if self.strip_authorization {
            headers.remove(header::AUTHORIZATION);
        }
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        let build = || {
            let mut req = Request::new(Full::new(body.clone()));
            *req.method_mut() = parts.method.clone();
            *req.uri_mut() = uri.clone();
            *req.version_mut() = Version::HTTP_11;
            *req.headers_mut() = headers.clone();
            req
        };
        let mut req = build();

        let slot = self.slot(up).await;
        let guard = InFlightGuard::new(up.clone(), self.metrics.clone(), slot);
        if up.activity.fenced() {
            // The model stopped serving between the route lookup and now;
            // counted in flight first, so a fence report never misses it.
            guard.finish(false);
            return Err(ForwardError::Fenced);
        }
        let capture = capture_connection(&mut req);
        let sent = Instant::now();
        let mut result = self.client.request(req).await;
        let reused = conn::uses(&capture).is_some_and(|u| u.count());
        let mut first_error = None;
        if let Err(e) = &result
            && reused
            && sent.elapsed() < RETRY_WINDOW
            && closed_before_answer(e)
        {
            let error = error_chain(e);
            tracing::info!(model = %up.model, url = %up.url, %error,
                "engine closed a reused connection as the request went out; sending it again on a fresh one");
            first_error = Some(error);
            result = self.fresh.request(build()).await;
        }
        match result {
            Ok(resp) => {
                self.metrics
                    .upstream_ttfb
                    .get_or_create(&ModelLabels {
                        model: up.model.clone(),
                    })
                    .observe(guard.started.elapsed().as_secs_f64());
                let (mut head, inner) = resp.into_parts();
                strip_hop_by_hop(&mut head.headers);
                let sse = head
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.starts_with("text/event-stream"));
                Ok(Response::from_parts(
                    head,
                    ProxyBody::Upstream {
                        inner,
                        guard: Some(guard),
                        sse,
                    },
                ))
            }
            // The engine is gone, not closing an idle connection: the first
            // attempt may have reached it, so the request goes nowhere else.
            Err(e) if first_error.is_some() => Err(ForwardError::Other(format!(
                "{} (sent again on a fresh connection: {})",
                first_error.unwrap_or_default(),
                error_chain(&e)
            ))),
            Err(e) if e.is_connect() => {
                guard.finish(false);
                Err(ForwardError::Connect(error_chain(&e)))
            }
            Err(e) => Err(ForwardError::Other(error_chain(&e))),
        }
    }
}

/// The connection was closed or reset before any answer came: hyper's
/// "connection closed before message completed" or a reset/broken pipe.
fn closed_before_answer(e: &hyper_util::client::legacy::Error) -> bool {
    if e.is_connect() {
        return false;
    }
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        if let Some(h) = c.downcast_ref::<hyper::Error>()
            && (h.is_incomplete_message() || h.is_canceled())
        {
            return true;
        }
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            )
        {
            return true;
        }
        src = c.source();
    }
    false
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key(header::CONTENT_TYPE));
    }
}
