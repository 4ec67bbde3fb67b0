//! Prometheus metrics served on the admin listener's `/metrics`.

use std::sync::Arc;
use std::sync::atomic::AtomicI64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub model: Arc<str>,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShedLabels {
    pub model: Arc<str>,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchLostLabels {
    /// The control plane address (`http://IP:PORT`).
    pub control: Arc<str>,
    /// `ended`, `silent` or `error` (see [`Metrics::watch_lost`]).
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ThreadLabels {
    pub thread: usize,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~4.6 min
    Histogram::new(exponential_buckets(0.0005, 2.5, 15))
}

/// All metrics of one proxy.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub held: Family<ModelLabels, Gauge<i64, AtomicI64>>,
    pub hold_wait: Family<ModelLabels, Histogram, fn() -> Histogram>,
    pub shed: Family<ShedLabels, Counter>,
    pub upstream_duration: Family<ModelLabels, Histogram, fn() -> Histogram>,
    pub upstream_ttfb: Family<ModelLabels, Histogram, fn() -> Histogram>,
    pub upstream_failures: Family<ModelLabels, Counter>,
    pub connections: Family<ThreadLabels, Counter>,
    /// Client connections the proxy's own HTTP/1.1 server handed to hyper's.
    pub to_hyper: Counter,
    /// Watch streams lost (each followed by a reconnect), by control plane
    /// address and why: `ended` (the control plane closed it), `silent`
    /// (no answer, first event or heartbeat within its deadline: a control
    /// plane up but wedged), `error` (unreachable, or refused).
    pub watch_lost: Family<WatchLostLabels, Counter>,
}

/// Label for requests that name no known model.
pub fn no_model() -> Arc<str> {
    static NONE: std::sync::OnceLock<Arc<str>> = std::sync::OnceLock::new();
    NONE.get_or_init(|| Arc::from("")).clone()
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("siesta_proxy");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests answered, by model and HTTP status",
            requests.clone(),
        );
        let held = Family::<ModelLabels, Gauge<i64, AtomicI64>>::default();
        registry.register(
            "held_requests",
            "Requests held now while their model wakes",
            held.clone(),
        );
        let hold_wait: Family<ModelLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register_with_unit(
            "hold_wait",
            "Time requests spent held",
            Unit::Seconds,
            hold_wait.clone(),
        );
        let shed = Family::<ShedLabels, Counter>::default();
        registry.register("shed", "Requests shed with 503, by reason", shed.clone());
        let upstream_duration: Family<ModelLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register_with_unit(
            "upstream_duration",
            "Time from sending a request to an engine to the end of its response",
            Unit::Seconds,
            upstream_duration.clone(),
        );
        let upstream_ttfb: Family<ModelLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register_with_unit(
            "upstream_ttfb",
            "Time from sending a request to an engine to its response headers",
            Unit::Seconds,
            upstream_ttfb.clone(),
        );
        let upstream_failures = Family::<ModelLabels, Counter>::default();
        registry.register(
            "upstream_connect_failures",
            "Engines that refused a connection while believed awake",
            upstream_failures.clone(),
        );
        let connections = Family::<ThreadLabels, Counter>::default();
        registry.register(
            "connections",
            "Client connections accepted, by serving thread",
            connections.clone(),
        );
        let to_hyper = Counter::default();
        registry.register(
            "hyper_connections",
            "Client connections served by hyper's server from some request on: HTTP/2, HTTP/1.0, \
             or a request other than a plain POST of a whole body to a /v1 path (the rest are \
             served by the proxy's own HTTP/1.1 server)",
            to_hyper.clone(),
        );
        let watch_lost = Family::<WatchLostLabels, Counter>::default();
        registry.register(
            "watch_lost",
            "Watch streams of control planes lost, each called again after a backoff, by address \
             and why: ended (closed by the control plane), silent (no answer, first event or \
             heartbeat within its deadline), error (unreachable or refused)",
            watch_lost.clone(),
        );
        Metrics {
            registry,
            watch_lost,
            connections,
            to_hyper,
            requests,
            held,
            hold_wait,
            shed,
            upstream_duration,
            upstream_ttfb,
            upstream_failures,
        }
    }

    pub fn request(&self, model: &Arc<str>, status: http::StatusCode) {
        self.requests
            .get_or_create(&RequestLabels {
                model: model.clone(),
                status: status.as_u16(),
            })
            .inc();
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(4096);
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
