//! HTTP client for one engine's admin and probe endpoints (vLLM's API
//! server or fake-vllm): health, sleep, wake, metrics.

use crate::reconciler::WakeCall;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// Why a call failed, as one line.
pub type EngineError = String;

/// One engine's base URL with a shared connection pool.
#[derive(Debug, Clone)]
pub struct EngineClient {
    base: String,
    http: Client<HttpConnector, Full<Bytes>>,
}

/// What `/metrics` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineMetrics {
    /// Sum of `vllm:num_requests_running`.
    pub running: u32,
    /// From `vllm:engine_sleep_state`: 0 awake, 1 weights offloaded, 2 all discarded.
    pub sleep_level: Option<u8>,
}

impl EngineClient {
    pub fn new(base: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        connector.set_nodelay(true);
        Self {
            base: base.trim_end_matches('/').to_string(),
            http: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .build(connector),
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    async fn call(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<&str>,
        timeout: Duration,
    ) -> Result<(hyper::StatusCode, Bytes), EngineError> {
        let uri = format!("{}{path}", self.base);
        let mut req = hyper::Request::builder().method(method.clone()).uri(&uri);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or("").to_string())))
            .map_err(|e| format!("{method} {path}: {e}"))?;
        let fut = async {
            let resp = self.http.request(req).await.map_err(|e| {
                let mut msg = e.to_string();
                if let Some(src) = std::error::Error::source(&e) {
                    msg = format!("{msg}: {src}");
                }
                msg
            })?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>((status, bytes))
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(format!("{method} {path}: {e}")),
            Err(_) => Err(format!("{method} {path}: no answer within {timeout:?}")),
        }
    }

    async fn expect_ok(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<&str>,
        timeout: Duration,
    ) -> Result<Bytes, EngineError> {
        let (status, bytes) = self.call(method.clone(), path, body, timeout).await?;
        if status.is_success() {
            Ok(bytes)
        } else {
            let text = String::from_utf8_lossy(&bytes);
            let text: String = text.chars().take(200).collect();
            Err(format!("{method} {path}: HTTP {status}: {text}"))
        }
    }

    /// `GET /health` answers 200 within `timeout` (engines accept the
    /// connection but say nothing until ready, so keep it short).
    pub async fn health(&self, timeout: Duration) -> Result<(), EngineError> {
        self.expect_ok(hyper::Method::GET, "/health", None, timeout)
            .await
            .map(|_| ())
    }

    /// `GET /is_sleeping`.
    pub async fn is_sleeping(&self, timeout: Duration) -> Result<bool, EngineError> {
        let bytes = self
            .expect_ok(hyper::Method::GET, "/is_sleeping", None, timeout)
            .await?;
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| format!("GET /is_sleeping: bad JSON: {e}"))?;
        v.get("is_sleeping")
            .and_then(|b| b.as_bool())
            .ok_or_else(|| "GET /is_sleeping: no is_sleeping field".to_string())
    }

    /// `POST /sleep?level=N&mode=wait`.
    pub async fn sleep(&self, level: u8, timeout: Duration) -> Result<(), EngineError> {
        let path = format!("/sleep?level={level}&mode=wait");
        self.expect_ok(hyper::Method::POST, &path, None, timeout)
            .await
            .map(|_| ())
    }

    /// One call of a wake sequence.
    pub async fn wake(&self, call: WakeCall, timeout: Duration) -> Result<(), EngineError> {
        let (path, body) = match call {
            WakeCall::WakeUp => ("/wake_up", None),
            WakeCall::WakeWeights => ("/wake_up?tags=weights", None),
            WakeCall::ReloadWeights => ("/collective_rpc", Some(r#"{"method":"reload_weights"}"#)),
            WakeCall::WakeKvCache => ("/wake_up?tags=kv_cache", None),
            WakeCall::ResetPrefixCache => ("/reset_prefix_cache", None),
        };
        self.expect_ok(hyper::Method::POST, path, body, timeout)
            .await
            .map(|_| ())
    }

    /// `GET /metrics`, parsed.
    pub async fn metrics(&self, timeout: Duration) -> Result<EngineMetrics, EngineError> {
        let bytes = self
            .expect_ok(hyper::Method::GET, "/metrics", None, timeout)
            .await?;
        Ok(parse_metrics(&String::from_utf8_lossy(&bytes)))
    }
}

/// Reads the gauges siesta uses from Prometheus text.
pub fn parse_metrics(text: &str) -> EngineMetrics {
    let mut m = EngineMetrics::default();
    let mut running = 0f64;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((name_labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let name = name_labels.split('{').next().unwrap_or("");
        match name {
            "vllm:num_requests_running" => running += value,
            "vllm:engine_sleep_state" if value >= 1.0 => {
                if name_labels.contains("discard_all") {
                    m.sleep_level = Some(2);
                } else if name_labels.contains("weights_offloaded") {
                    m.sleep_level = Some(1);
                } else if name_labels.contains("awake") {
                    m.sleep_level = Some(0);
                }
            }
            _ => {}
        }
    }
    m.running = running.max(0.0).round() as u32;
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_parse() {
        let text = "# HELP x\nvllm:num_requests_running{model_name=\"a\",engine=\"0\"} 2.0\n\
            vllm:num_requests_running{model_name=\"a\",engine=\"1\"} 1.0\n\
            vllm:engine_sleep_state{sleep_state=\"awake\"} 0.0\n\
            vllm:engine_sleep_state{sleep_state=\"discard_all\"} 1.0\n";
        let m = parse_metrics(text);
        assert_eq!(m.running, 3);
        assert_eq!(m.sleep_level, Some(2));
    }
}
