//! Follows the Watch hub for the web listener: the state timeline of each
//! model over the last hour, the recent wakes with their calibrated times,
//! and the counters and histograms of wakes and transitions that `/metrics`
//! exports.

use crate::hub::{Body, Hub};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use serde::Serialize;
use siesta_proto::v1 as pb;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// How far back the timeline reaches.
pub const HISTORY_MS: i64 = 60 * 60 * 1000;
/// Wakes kept for the chart.
const WAKES_KEPT: usize = 200;

/// A state a model entered, and when.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Span {
    pub at_unix_ms: i64,
    pub state: &'static str,
    pub sleep_level: u32,
}

/// One finished wake (or start) and what calibration predicted.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WakeSample {
    pub model: String,
    pub at_unix_ms: i64,
    /// `l1`, `l2` (woken from that sleep level) or `stopped` (a start).
    pub from: &'static str,
    pub duration_ms: u64,
    /// The calibrated time before this wake (0: none yet).
    pub calibrated_ms: u64,
}

/// `/api/history`.
#[derive(Debug, Clone, Serialize)]
pub struct History {
    pub since_unix_ms: i64,
    pub timelines: BTreeMap<String, Vec<Span>>,
    pub wakes: Vec<WakeSample>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WakeLabels {
    model: String,
    from: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransitionLabels {
    model: String,
    state: &'static str,
}

#[derive(Debug, Default)]
struct Inner {
    /// Last state, level and state-since per model.
    last: BTreeMap<String, (pb::ModelState, u32, i64, Option<pb::Calibration>)>,
    timelines: BTreeMap<String, VecDeque<Span>>,
    wakes: VecDeque<WakeSample>,
}

/// Shared by the follower task and the HTTP handlers.
#[derive(Debug)]
pub struct Tracker {
    inner: Mutex<Inner>,
    registry: Registry,
    wakes: Family<WakeLabels, Counter>,
    wake_duration: Family<WakeLabels, Histogram, fn() -> Histogram>,
    transitions: Family<TransitionLabels, Counter>,
}

fn wake_histogram() -> Histogram {
    // 50 ms .. ~7 min
    Histogram::new(exponential_buckets(0.05, 2.0, 14))
}

impl Tracker {
    pub fn new() -> Arc<Tracker> {
        let mut registry = Registry::with_prefix("siesta_control");
        let wakes = Family::<WakeLabels, Counter>::default();
        registry.register(
            "wakes",
            "Wakes and starts that reached awake, by model and what they woke from (l1, l2, stopped)",
            wakes.clone(),
        );
        let wake_duration: Family<WakeLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(wake_histogram);
        registry.register_with_unit(
            "wake_duration",
            "Time from waking (or starting) to awake",
            Unit::Seconds,
            wake_duration.clone(),
        );
        let transitions = Family::<TransitionLabels, Counter>::default();
        registry.register(
            "transitions",
            "State changes, by model and the state entered",
            transitions.clone(),
        );
        Arc::new(Tracker {
            inner: Mutex::default(),
            registry,
            wakes,
            wake_duration,
            transitions,
        })
    }

    /// Follows the hub until `cancel` or the hub closes.
    pub async fn run(self: Arc<Self>, hub: Arc<Hub>, cancel: CancellationToken) {
        let Some(mut sub) = hub.subscribe(0) else {
            return;
        };
        loop {
            let item = tokio::select! {
                _ = cancel.cancelled() => return,
                item = sub.next() => item,
            };
            let Some(item) = item else { return };
            self.apply(&item.body);
        }
    }

    /// Takes in one event of the hub.
    fn apply(&self, body: &Body) {
        match body {
            Body::Snapshot(s) => {
                // A resync: a model removed in the events it stands for is
                // in none of them (it was kept in the history for good).
                self.forget(|name| !s.models.iter().any(|m| m.name == name));
                for m in &s.models {
                    self.record(&crate::api::convert::model_status(m), false);
                }
            }
            Body::Model(m) => self.record(&crate::api::convert::model_status(m), true),
            Body::ModelRemoved(name) => self.forget(|n| n == name),
            Body::Gpus(_) | Body::Placement(_) | Body::Heartbeat(_) => {}
        }
    }

    /// Drops the models `gone` says are gone.
    fn forget(&self, gone: impl Fn(&str) -> bool) {
        let mut inner = self.inner.lock().unwrap();
        inner.last.retain(|n, _| !gone(n));
        inner.timelines.retain(|n, _| !gone(n));
    }

    /// Notes a model's status; `count`: a live change (not a snapshot).
    pub fn record(&self, m: &pb::ModelStatus, count: bool) {
        let state = m.state();
        let mut inner = self.inner.lock().unwrap();
        let prev = inner.last.insert(
            m.name.clone(),
            (state, m.sleep_level, m.state_since_unix_ms, m.calibration),
        );
        let changed = prev.is_none_or(|(s, l, since, _)| {
            s != state || l != m.sleep_level || since != m.state_since_unix_ms
        });
        if !changed {
            return;
        }
        let line = inner.timelines.entry(m.name.clone()).or_default();
        line.push_back(Span {
            at_unix_ms: m.state_since_unix_ms,
            state: state.label(),
            sleep_level: m.sleep_level,
        });
        // Keep the last span that began before the window: it says what the
        // model was at the window's start.
        let cutoff = m.state_since_unix_ms - HISTORY_MS;
        while line.len() > 1 && line[1].at_unix_ms <= cutoff {
            line.pop_front();
        }
        if !count || prev.is_some_and(|(s, ..)| s == state) {
            return;
        }
        self.transitions
            .get_or_create(&TransitionLabels {
                model: m.name.clone(),
                state: state.label(),
            })
            .inc();
        let Some((prev_state, prev_level, prev_since, cal)) = prev else {
            return;
        };
        if state != pb::ModelState::Awake {
            return;
        }
        let cal = cal.unwrap_or_default();
        let (from, calibrated_ms) = match (prev_state, prev_level) {
            (pb::ModelState::Waking, 2) => ("l2", cal.wake_l2_ms),
            (pb::ModelState::Waking, _) => ("l1", cal.wake_l1_ms),
            (pb::ModelState::Starting, _) => ("stopped", cal.start_ms),
            _ => return,
        };
        let duration_ms = (m.state_since_unix_ms - prev_since).max(0) as u64;
        let labels = WakeLabels {
            model: m.name.clone(),
            from,
        };
        self.wakes.get_or_create(&labels).inc();
        self.wake_duration
            .get_or_create(&labels)
            .observe(duration_ms as f64 / 1000.0);
        if inner.wakes.len() == WAKES_KEPT {
            inner.wakes.pop_front();
        }
        inner.wakes.push_back(WakeSample {
            model: m.name.clone(),
            at_unix_ms: m.state_since_unix_ms,
            from,
            duration_ms,
            calibrated_ms,
        });
        tracing::debug!(model = %m.name, from, duration_ms, calibrated_ms, "wake recorded");
    }

    /// The timelines and wakes of the last hour before `now_ms`.
    pub fn history(&self, now_ms: i64) -> History {
        let inner = self.inner.lock().unwrap();
        let since = now_ms - HISTORY_MS;
        History {
            since_unix_ms: since,
            timelines: inner
                .timelines
                .iter()
                .map(|(k, v)| (k.clone(), v.iter().cloned().collect()))
                .collect(),
            wakes: inner
                .wakes
                .iter()
                .filter(|w| w.at_unix_ms >= since)
                .cloned()
                .collect(),
        }
    }

    /// The counters and histograms, in the text exposition format.
    pub fn encode(&self, out: &mut String) {
        let _ = prometheus_client::encoding::text::encode_registry(out, &self.registry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: pb::ModelState, level: u32, since: i64) -> pb::ModelStatus {
        pb::ModelStatus {
            name: "m".into(),
            state: state as i32,
            sleep_level: level,
            state_since_unix_ms: since,
            calibration: Some(pb::Calibration {
                wake_l2_ms: 900,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_wake_is_timed_against_its_calibration() {
        let t = Tracker::new();
        t.record(&status(pb::ModelState::Asleep, 2, 1_000), false);
        t.record(&status(pb::ModelState::Waking, 2, 5_000), true);
        // An update that changes nothing is not a new span.
        t.record(&status(pb::ModelState::Waking, 2, 5_000), true);
        t.record(&status(pb::ModelState::Awake, 0, 6_200), true);
        let h = t.history(7_000);
        let states: Vec<&str> = h.timelines["m"].iter().map(|s| s.state).collect();
        assert_eq!(states, ["asleep", "waking", "awake"]);
        assert_eq!(
            h.wakes,
            [WakeSample {
                model: "m".into(),
                at_unix_ms: 6_200,
                from: "l2",
                duration_ms: 1_200,
                calibrated_ms: 900,
            }]
        );
        let mut text = String::new();
        t.encode(&mut text);
        assert!(
            text.contains("siesta_control_wakes_total{model=\"m\",from=\"l2\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("siesta_control_transitions_total{model=\"m\",state=\"awake\"} 1"),
            "{text}"
        );
    }

    /// A resync snapshot without a model (removed in events this tracker
    /// never saw) drops it from the history, as its removal would have.
    #[test]
    fn a_resync_forgets_a_model_it_no_longer_lists() {
        let t = Tracker::new();
        let snapshot = |names: &[&str]| {
            Body::Snapshot(crate::hub::Snapshot {
                models: names
                    .iter()
                    .map(|n| Arc::new(crate::status::test_status(n, 0)))
                    .collect(),
                gpus: None,
                placement: None,
                resync: true,
                wire: None,
            })
        };
        t.apply(&snapshot(&["a", "b"]));
        let listed = |t: &Tracker| {
            let h = t.history(0);
            let mut names: Vec<String> = h.timelines.keys().cloned().collect();
            names.sort();
            names
        };
        assert_eq!(listed(&t), ["a", "b"]);
        t.apply(&snapshot(&["a"]));
        assert_eq!(listed(&t), ["a"]);
    }

    #[test]
    fn the_timeline_keeps_one_hour() {
        let t = Tracker::new();
        t.record(&status(pb::ModelState::Awake, 0, 0), false);
        t.record(&status(pb::ModelState::Asleep, 1, 10_000), true);
        t.record(&status(pb::ModelState::Awake, 0, 20_000), true);
        t.record(
            &status(pb::ModelState::Asleep, 1, 20_000 + HISTORY_MS),
            true,
        );
        let h = t.history(20_000 + HISTORY_MS);
        // The span in force at the window's start stays; older ones go.
        let at: Vec<i64> = h.timelines["m"].iter().map(|s| s.at_unix_ms).collect();
        assert_eq!(at, [20_000, 20_000 + HISTORY_MS]);
    }
}
