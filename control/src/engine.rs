//! HTTP client for one engine's admin and probe endpoints (vLLM's API
//! server, SGLang's, any OpenAI server, or fake-vllm): health, sleep, wake,
//! metrics. What each kind has is in `config/kind.rs`; SGLang's routes are in
//! `docs/SGLANG-NOTES.md`.
//!
//! Written against vLLM 0.2x–0.33 (see the README's design notes):
//! - pooled connections idle at most [`DEFAULT_IDLE_TIMEOUT`] (uvicorn
//!   closes them after 5 s), and every call, all idempotent for vLLM, is
//!   tried once more on a fresh connection after a transport error (a
//!   pooled connection the engine closed as the request went out);
//! - `/sleep` and `/wake_up` bodies are read ([`replies`]): a wake whose
//!   last call leaves a tag asleep fails;
//! - `/metrics` is parsed as Prometheus text ([`prom`]).

mod prom;
mod replies;
#[cfg(test)]
pub(crate) mod test_server;
#[cfg(test)]
mod tests;

pub use crate::config::EngineKind;
pub use replies::WakeReply;

use crate::reconciler::WakeCall;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;
use tokio::time::Instant;

/// The base URL of a process engine listening on `host`:`port`, with an
/// IPv6 address in brackets (`http://[::1]:8000`): `http://::1:8000` is no
/// URL, and every probe of it would fail.
pub fn base_url(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("http://[{host}]:{port}")
    } else {
        format!("http://{host}:{port}")
    }
}

/// Why a call failed, as one line.
pub type EngineError = String;

/// How long a connection to an engine may sit idle in the pool: below
/// uvicorn's 5 s keep-alive, so siesta never sends on a connection the
/// engine is closing. `[control] engine_idle_timeout` overrides it.
#[cfg(test)]
pub use crate::config::DEFAULT_ENGINE_IDLE_TIMEOUT as DEFAULT_IDLE_TIMEOUT;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One engine's base URL with a shared connection pool.
#[derive(Debug, Clone)]
pub struct EngineClient {
    base: String,
    kind: EngineKind,
    /// Where `health` probes (`health_path` of an `openai` engine).
    health_path: String,
    pooled: HttpClient,
    /// Keeps no idle connection: every call opens a fresh one (retries).
    fresh: HttpClient,
}

/// What `/metrics` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineMetrics {
    /// Sum of `vllm:num_requests_running` (SGLang: `sglang:num_running_reqs`).
    pub running: u32,
    /// Sum of `vllm:num_requests_waiting` (SGLang: `sglang:num_queue_reqs`):
    /// requests the engine has taken and not scheduled yet.
    pub waiting: u32,
    /// From `vllm:engine_sleep_state`: 0 awake, 1 weights offloaded, 2 all
    /// discarded (the deepest when several engines report). Never enough on
    /// its own to call an engine awake: vLLM 0.24 records awake after
    /// `wake_up?tags=weights` while `/is_sleeping` is still true, and a
    /// `/sleep?mode=wait` records its level only once its requests are done.
    pub sleep_level: Option<u8>,
    /// `/is_sleeping`, asked by the periodic probe of an awake engine when
    /// the metric does not say asleep (None: not asked, or no answer in time).
    pub is_sleeping: Option<bool>,
    /// `vllm:generation_tokens_total`: tokens generated so far (a drain's
    /// requests make progress; requests held by a paused scheduler do not).
    pub generation_tokens: u64,
    /// `vllm:kv_cache_usage_perc`, in billionths (summed over engines): a
    /// prefill makes progress here only (chunk by chunk, its cache grows;
    /// its prompt tokens are counted with its first token), and so does a
    /// decode (a block every few tokens, freed at its end).
    pub kv_cache_used: u64,
    /// Whether any `vllm:` metric was served (none with `--disable-log-stats`).
    pub has_vllm_metrics: bool,
}

/// How a call failed.
#[derive(Debug)]
enum Failure {
    /// No answer within the deadline (the engine may be busy: not retried).
    Timeout(String),
    /// Connection closed or reset; body cut short.
    Transport(String),
    /// Connection refused: nothing listens on the engine's port (vLLM
    /// closes its listener at SIGTERM).
    Refused(String),
    /// The engine answered, but not what was wanted.
    Answer(String),
}

/// A failed probe: what went wrong, and whether the engine was only slow
/// (no answer within the deadline) rather than refusing or erring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeError {
    pub message: String,
    pub timed_out: bool,
    /// The connection was refused (see [`Failure::Refused`]).
    pub refused: bool,
}

impl From<Failure> for ProbeError {
    fn from(f: Failure) -> Self {
        let timed_out = matches!(f, Failure::Timeout(_));
        let refused = matches!(f, Failure::Refused(_));
        ProbeError {
            message: f.into_message(),
            timed_out,
            refused,
        }
    }
}

impl Failure {
    /// A connection that failed: refused, or closed, reset or cut short.
    fn connection(message: String, refused: bool) -> Failure {
        if refused {
            Failure::Refused(message)
        } else {
            Failure::Transport(message)
        }
    }

    fn into_message(self) -> String {
        match self {
            Failure::Timeout(m)
            | Failure::Transport(m)
            | Failure::Refused(m)
            | Failure::Answer(m) => m,
        }
    }
}

fn client(idle: Duration, max_idle: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(idle)
        .pool_max_idle_per_host(max_idle)
        .build(connector)
}

/// Whether `e` or an error under it is a refused connection.
fn is_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        cur = c.source();
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

impl EngineClient {
    #[cfg(test)]
    pub fn new(base: &str) -> Self {
        Self::with_idle_timeout(base, DEFAULT_IDLE_TIMEOUT)
    }

    /// A client whose pooled connections idle at most `idle`.
    pub fn with_idle_timeout(base: &str, idle: Duration) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
            kind: EngineKind::Vllm,
            health_path: "/health".into(),
            pooled: client(idle, usize::MAX),
            fresh: client(idle, 0),
        }
    }

    /// The same client for an engine of `kind`, probed on `health_path`.
    pub fn for_kind(mut self, kind: EngineKind, health_path: &str) -> Self {
        self.kind = kind;
        self.health_path = health_path.to_string();
        self
    }

    /// A client for the model's engine at `base`.
    pub fn for_model(base: &str, idle: Duration, cfg: &crate::config::ModelConfig) -> Self {
        Self::with_idle_timeout(base, idle).for_kind(cfg.engine, &cfg.health_path)
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    async fn send(
        &self,
        http: &HttpClient,
        method: &hyper::Method,
        path: &str,
        body: Option<&str>,
        deadline: Instant,
    ) -> Result<(hyper::StatusCode, Bytes), Failure> {
        let what = format!("{method} {path}");
        let uri = format!("{}{path}", self.base);
        let mut req = hyper::Request::builder().method(method.clone()).uri(&uri);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or("").to_string())))
            .map_err(|e| Failure::Answer(format!("{what}: {e}")))?;
        let fut = async {
            let resp = http.request(req).await.map_err(|e| {
                Failure::connection(format!("{what}: {}", error_chain(&e)), is_refused(&e))
            })?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| {
                    Failure::Transport(format!("{what}: reading the answer: {}", error_chain(&e)))
                })?
                .to_bytes();
            Ok((status, bytes))
        };
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(Failure::Timeout(format!("{what}: no answer in time"))),
        }
    }

    /// One call within `timeout`; a transport error is tried once more on
    /// a fresh connection (every admin call siesta makes is idempotent).
    async fn call(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<&str>,
        timeout: Duration,
    ) -> Result<(hyper::StatusCode, Bytes), Failure> {
        let deadline = Instant::now() + timeout;
        let first = match self.send(&self.pooled, &method, path, body, deadline).await {
            Err(Failure::Transport(e) | Failure::Refused(e)) => e,
            Err(Failure::Timeout(_)) => {
                return Err(Failure::Timeout(format!(
                    "{method} {path}: no answer within {timeout:?}"
                )));
            }
            r => return r,
        };
        tracing::debug!(engine = %self.base, error = %first, "engine call failed; trying once more on a fresh connection");
        match self.send(&self.fresh, &method, path, body, deadline).await {
            Err(f @ (Failure::Transport(_) | Failure::Refused(_))) => {
                let refused = matches!(f, Failure::Refused(_));
                Err(Failure::connection(
                    format!("{} (tried twice; first attempt: {first})", f.into_message()),
                    refused,
                ))
            }
            Err(Failure::Timeout(_)) => Err(Failure::Timeout(format!(
                "{method} {path}: no answer within {timeout:?} (after a first attempt failed: {first})"
            ))),
            r => r,
        }
    }

    async fn expect_ok(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<&str>,
        timeout: Duration,
    ) -> Result<Bytes, Failure> {
        let (status, bytes) = self.call(method.clone(), path, body, timeout).await?;
        if status.is_success() {
            Ok(bytes)
        } else {
            let text = replies::error_text(&bytes);
            Err(Failure::Answer(format!(
                "{method} {path}: HTTP {status}: {text}"
            )))
        }
    }

    /// `GET /health` (an `openai` engine's `health_path`) answers 200
    /// within `timeout` (engines accept the connection but say nothing
    /// until ready, so keep it short). SGLang's `/health` generates a token:
    /// only for an engine known to hold its memory (see [`Self::alive`]).
    pub async fn health(&self, timeout: Duration) -> Result<(), EngineError> {
        self.expect_ok(hyper::Method::GET, &self.health_path, None, timeout)
            .await
            .map(|_| ())
            .map_err(Failure::into_message)
    }

    /// A probe that never reaches the GPU, for an engine that may have
    /// released its memory: SGLang's `GET /get_model_info` (its `/health`
    /// runs a generation, which must not reach released memory); `health`
    /// for the others.
    pub async fn alive(&self, timeout: Duration) -> Result<(), EngineError> {
        self.probe(timeout).await.map_err(|e| e.message)
    }

    /// [`Self::alive`], saying whether a failure was only slowness.
    pub async fn probe(&self, timeout: Duration) -> Result<(), ProbeError> {
        let path = match self.kind {
            EngineKind::Sglang => "/get_model_info",
            EngineKind::Vllm | EngineKind::Openai => self.health_path.as_str(),
        };
        self.expect_ok(hyper::Method::GET, path, None, timeout)
            .await
            .map(|_| ())
            .map_err(ProbeError::from)
    }

    /// `GET /is_sleeping`.
    #[cfg(test)]
    pub async fn is_sleeping(&self, timeout: Duration) -> Result<bool, EngineError> {
        match self.is_sleeping_within(timeout).await? {
            Some(b) => Ok(b),
            None => Err(format!("GET /is_sleeping: no answer within {timeout:?}")),
        }
    }

    /// `GET /is_sleeping`, telling "no answer yet" (`Ok(None)`) from an
    /// answer: vLLM queues it behind a running wake or `reload_weights`.
    pub async fn is_sleeping_within(&self, timeout: Duration) -> Result<Option<bool>, EngineError> {
        let bytes = match self
            .expect_ok(hyper::Method::GET, "/is_sleeping", None, timeout)
            .await
        {
            Ok(b) => b,
            Err(Failure::Timeout(_)) => return Ok(None),
            Err(e) => return Err(e.into_message()),
        };
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| format!("GET /is_sleeping: bad JSON: {e}"))?;
        v.get("is_sleeping")
            .and_then(|b| b.as_bool())
            .map(Some)
            .ok_or_else(|| "GET /is_sleeping: no is_sleeping field".to_string())
    }

    /// `POST /sleep?level=N&mode=wait`; its body, when there is one, must
    /// say the engine sleeps at that level.
    pub async fn sleep(&self, level: u8, timeout: Duration) -> Result<(), EngineError> {
        match self.kind {
            EngineKind::Vllm => {}
            EngineKind::Sglang => {
                // Every tag (weights, KV cache, CUDA graphs); an answer other
                // than 2xx is SGLang's error body.
                let path = "/release_memory_occupation";
                return self
                    .expect_ok(hyper::Method::POST, path, Some("{}"), timeout)
                    .await
                    .map(|_| ())
                    .map_err(Failure::into_message);
            }
            EngineKind::Openai => {
                return Err(format!(
                    "engine = \"openai\" cannot sleep (level {level} asked)"
                ));
            }
        }
        let path = format!("/sleep?level={level}&mode=wait");
        let body = self
            .expect_ok(hyper::Method::POST, &path, None, timeout)
            .await
            .map_err(Failure::into_message)?;
        replies::check_sleep_reply(&body, level).map_err(|e| format!("POST {path}: {e}"))
    }

    /// One call of a wake sequence. The last `/wake_up` of a sequence (all
    /// tags, or `kv_cache` after the weights) must leave the engine awake;
    /// after `tags=weights` alone it is expected to still sleep.
    pub async fn wake(&self, call: WakeCall, timeout: Duration) -> Result<(), EngineError> {
        let (path, body) = match call {
            WakeCall::WakeUp => ("/wake_up", None),
            WakeCall::WakeWeights => ("/wake_up?tags=weights", None),
            WakeCall::ReloadWeights => ("/collective_rpc", Some(r#"{"method":"reload_weights"}"#)),
            WakeCall::WakeKvCache => ("/wake_up?tags=kv_cache", None),
            WakeCall::ResetPrefixCache => ("/reset_prefix_cache", None),
            WakeCall::ResumeMemory => ("/resume_memory_occupation", Some("{}")),
        };
        let reply = self
            .expect_ok(hyper::Method::POST, path, body, timeout)
            .await
            .map_err(Failure::into_message)?;
        let last = matches!(call, WakeCall::WakeUp | WakeCall::WakeKvCache);
        if last && let WakeReply::StillAsleep { tags } = replies::wake_reply(&reply) {
            return Err(format!(
                "POST {path}: engine still asleep after /wake_up: tags {tags:?}"
            ));
        }
        Ok(())
    }

    /// Waits, up to `within`, while a draining sleep is under way: vLLM's
    /// `/sleep?mode=wait` pauses the scheduler at once (`/is_sleeping` true)
    /// but frees the memory, and records its level in the metric, only once
    /// the requests in flight are done. A `/wake_up` before that finds the
    /// memory awake, resumes the scheduler and answers "awake", and the
    /// memory is freed after it all the same, under a running scheduler: the
    /// next request reaches freed memory. A drain makes progress: tokens
    /// generated, or its KV cache growing or shrinking (a long prompt's
    /// prefill generates nothing for seconds; taken for a pause, the wake
    /// went out under the drain). Requests that show neither for
    /// [`DRAIN_STALL`] are held by a paused scheduler (`mode=keep`), which
    /// only the wake lets go, and are not waited for. A probe too slow to answer (a loaded box) says nothing
    /// either way: it neither ends the wait nor counts as a stall, and the
    /// probes go on, for at most [`DRAIN_UNKNOWN`] in a row (an engine whose
    /// `/metrics` never answers in time delays its wakes by that, not by
    /// half the wake timeout). Returns how many requests were running
    /// when the wait began (0: nothing to wait for, or no way to tell: no
    /// metrics, an error).
    pub async fn wait_for_drain(&self, within: Duration) -> u32 {
        const EVERY: Duration = Duration::from_millis(100);
        if self.kind != EngineKind::Vllm {
            return 0;
        }
        let until = tokio::time::Instant::now() + within;
        let mut first = None;
        let mut progress = (0, 0);
        let mut progressed = tokio::time::Instant::now();
        let mut unknown_since = None;
        loop {
            let seen = self.drain_probe().await;
            let now = tokio::time::Instant::now();
            if !matches!(seen, Drain::Unknown) {
                unknown_since = None;
            }
            match (seen, first) {
                (Drain::Over, _) => break,
                (Drain::Unknown, _) => {
                    progressed = now;
                    if now - *unknown_since.get_or_insert(now) >= DRAIN_UNKNOWN {
                        tracing::warn!(engine = %self.base, "could not tell for {DRAIN_UNKNOWN:?} whether a sleep still drains: waking");
                        break;
                    }
                }
                (
                    Drain::Running {
                        running,
                        progress: p,
                    },
                    None,
                ) => {
                    (first, progress, progressed) = (Some(running), p, now);
                }
                (Drain::Running { progress: p, .. }, Some(first)) => {
                    if p != progress {
                        (progress, progressed) = (p, now);
                    } else if now - progressed >= DRAIN_STALL {
                        tracing::info!(running = first, "requests paused, not draining: waking");
                        break;
                    }
                }
            }
            if now + EVERY >= until {
                break;
            }
            tokio::time::sleep(EVERY).await;
        }
        first.unwrap_or(0)
    }

    /// One look at a possible drain for [`Self::wait_for_drain`].
    async fn drain_probe(&self) -> Drain {
        const PROBE: Duration = Duration::from_secs(1);
        let m = match self.metrics_probe(PROBE).await {
            Ok(m) => m,
            Err(e) if e.timed_out => return Drain::Unknown,
            Err(_) => return Drain::Over,
        };
        if m.sleep_level != Some(0) || m.running == 0 {
            return Drain::Over;
        }
        match self.is_sleeping_within(PROBE).await {
            Ok(Some(true)) => Drain::Running {
                running: m.running,
                progress: (m.generation_tokens, m.kv_cache_used),
            },
            Ok(None) => Drain::Unknown,
            Ok(Some(false)) | Err(_) => Drain::Over,
        }
    }

    /// `GET /metrics`, parsed (an engine kind without an activity gauge is
    /// not asked: nothing running as far as siesta can tell).
    pub async fn metrics(&self, timeout: Duration) -> Result<EngineMetrics, EngineError> {
        self.metrics_probe(timeout).await.map_err(|e| e.message)
    }

    /// [`Self::metrics`], saying whether a failure was only slowness.
    pub async fn metrics_probe(&self, timeout: Duration) -> Result<EngineMetrics, ProbeError> {
        if self.kind.capabilities().activity_metric.is_none() {
            return Ok(EngineMetrics::default());
        }
        let bytes = self
            .expect_ok(hyper::Method::GET, "/metrics", None, timeout)
            .await
            .map_err(ProbeError::from)?;
        Ok(parse_metrics(&String::from_utf8_lossy(&bytes)))
    }
}

/// What one probe saw of a sleep that may still drain.
#[derive(Debug, Clone, Copy)]
enum Drain {
    /// Asleep by `/is_sleeping`, awake by the metric, requests running.
    Running { running: u32, progress: (u64, u64) },
    /// Nothing drains (or the engine cannot tell: no metrics, an error).
    Over,
    /// A probe timed out.
    Unknown,
}

/// How long probes may time out in a row before a wake stops waiting to
/// tell whether a sleep still drains (see [`EngineClient::wait_for_drain`]).
pub const DRAIN_UNKNOWN: Duration = Duration::from_secs(10);

/// How long requests under a paused scheduler may generate nothing before
/// they are taken for held (`mode=keep`), not draining (see
/// [`EngineClient::wait_for_drain`]).
pub const DRAIN_STALL: Duration = Duration::from_secs(2);

/// Reads the gauges siesta uses from Prometheus text.
pub fn parse_metrics(text: &str) -> EngineMetrics {
    let mut m = EngineMetrics::default();
    let (mut running, mut waiting) = (0f64, 0f64);
    let (samples, _bad) = prom::samples(text);
    for s in samples {
        m.has_vllm_metrics |= s.name.starts_with("vllm:");
        if !s.value.is_finite() {
            continue;
        }
        match s.name.as_str() {
            // SGLang's gauge (`--enable-metrics`), one sample per DP rank.
            "vllm:num_requests_running" | "sglang:num_running_reqs" => running += s.value,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => waiting += s.value,
            "vllm:generation_tokens_total" if s.value >= 0.0 => {
                m.generation_tokens += s.value as u64;
            }
            "vllm:kv_cache_usage_perc" if s.value >= 0.0 => {
                m.kv_cache_used += (s.value * 1e9).round() as u64;
            }
            "vllm:engine_sleep_state" if s.value >= 1.0 => {
                let level = match s.label("sleep_state") {
                    Some("awake") => 0,
                    Some("weights_offloaded") => 1,
                    Some("discard_all") => 2,
                    _ => continue,
                };
                m.sleep_level = Some(m.sleep_level.map_or(level, |l| l.max(level)));
            }
            _ => {}
        }
    }
    m.running = running.max(0.0).round() as u32;
    m.waiting = waiting.max(0.0).round() as u32;
    m
}
