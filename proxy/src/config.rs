//! The proxy's configuration, filled by `main.rs` from flags or by the CLI.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

/// Default control plane URL.
pub const DEFAULT_CONTROL: &str = "http://127.0.0.1:50051";
/// Default time a write to a client may wait for it to read: nginx's.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(60);
/// Default body limit: 32 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// Everything `Proxy::bind` needs. Construct with `..Default::default()`.
#[derive(Clone)]
pub struct ProxyConfig {
    /// Control plane URLs (`http://host:port`); a host name may resolve to
    /// several addresses, each watched. Empty means [`DEFAULT_CONTROL`].
    pub controls: Vec<String>,
    /// The OpenAI-compatible listener (port 0: any free port).
    pub listen: SocketAddr,
    /// Bind `listen` with `SO_REUSEPORT`, so several proxy replicas on one
    /// host share the address and the kernel spreads connections over them.
    pub reuse_port: bool,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz`).
    pub admin_listen: SocketAddr,
    /// Serving threads. 1: serve on the caller's runtime only. N > 1: the
    /// caller's runtime and N - 1 more threads, each with its own
    /// single-threaded runtime, accept from the one listener; a connection
    /// stays on the thread that accepted it (see `threads.rs`).
    pub threads: usize,
    /// Bearer token sent to control planes.
    pub token: Option<String>,
    /// API keys clients must present (`Authorization: Bearer KEY`); empty: no auth.
    pub api_keys: Vec<String>,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Largest request head (request line and headers) accepted.
    pub max_header_bytes: usize,
    /// Time allowed to receive a request's headers.
    pub header_timeout: Duration,
    /// Longest wait for more of a request's body (between reads, nginx's
    /// `client_body_timeout`; not a deadline on the whole body): 408 after
    /// a stall this long. A body taking longer than this must also average
    /// `handler::checks::MIN_BODY_RATE` (1 KiB/s).
    pub body_timeout: Duration,
    /// How long a write to a client may wait for the client to read
    /// (nginx's `send_timeout`): a client that stops reading a streamed
    /// answer, its connection still open, is cut after this, so its request
    /// ends at the engine and counts no longer (it kept the model awake).
    /// Over HTTP/2 (no socket write blocks: only the stream's flow-control
    /// window shuts) each engine answer's stream is timed on its own.
    pub send_timeout: Duration,
    /// How long a request waits for the first snapshot from a control plane
    /// (a proxy just started knows no model yet); then 503 `proxy_not_ready`.
    pub first_snapshot_wait: Duration,
    /// How often control plane host names are re-resolved.
    pub resolve_interval: Duration,
    /// How long in-flight requests may take to finish on shutdown.
    pub drain_timeout: Duration,
    /// On shutdown, answer held requests at once (503 `proxy_shutting_down`)
    /// instead of near the end of the drain: for a proxy whose control plane
    /// stops with it (`siesta up`), where no wake will come for them.
    pub shed_held_on_shutdown: bool,
    /// Identity sent to control planes ("proxy@host:port"); derived if `None`.
    pub proxy_id: Option<String>,
    /// How long an idle connection to an engine is kept; below the engines'
    /// keep-alive (vLLM's uvicorn: 5 s).
    pub upstream_idle_timeout: Duration,
    /// Requests at one engine at once; more wait for a slot, up to their
    /// model's hold limit.
    pub engine_concurrency: usize,
    /// How long an engine may send nothing on a request (its response
    /// head, or its body between reads) before the request is ended.
    pub upstream_timeout: Duration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            controls: vec![DEFAULT_CONTROL.to_owned()],
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 8080)),
            admin_listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 9090)),
            reuse_port: false,
            threads: 1,
            token: None,
            api_keys: Vec::new(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_header_bytes: 64 * 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            send_timeout: DEFAULT_SEND_TIMEOUT,
            first_snapshot_wait: Duration::from_secs(10),
            resolve_interval: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(30),
            shed_held_on_shutdown: false,
            proxy_id: None,
            upstream_idle_timeout: crate::forward::DEFAULT_UPSTREAM_IDLE_TIMEOUT,
            engine_concurrency: crate::forward::DEFAULT_ENGINE_CONCURRENCY,
            upstream_timeout: crate::forward::DEFAULT_UPSTREAM_TIMEOUT,
        }
    }
}

impl std::fmt::Debug for ProxyConfig {
    // Hand-written so secrets never reach logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyConfig")
            .field("controls", &self.controls)
            .field("listen", &self.listen)
            .field("reuse_port", &self.reuse_port)
            .field("admin_listen", &self.admin_listen)
            .field("threads", &self.threads)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("api_keys", &self.api_keys.len())
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_header_bytes", &self.max_header_bytes)
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("send_timeout", &self.send_timeout)
            .field("first_snapshot_wait", &self.first_snapshot_wait)
            .field("resolve_interval", &self.resolve_interval)
            .field("drain_timeout", &self.drain_timeout)
            .field("shed_held_on_shutdown", &self.shed_held_on_shutdown)
            .field("proxy_id", &self.proxy_id)
            .field("upstream_idle_timeout", &self.upstream_idle_timeout)
            .field("engine_concurrency", &self.engine_concurrency)
            .field("upstream_timeout", &self.upstream_timeout)
            .finish()
    }
}
