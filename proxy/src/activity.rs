//! Activity reports to control planes: requests started and finished per
//! model, in batches (one `ReportActivity` per control plane per tick, so at
//! most about one RPC per model per 100 ms), plus endpoints that refused
//! connections while believed awake.
//!
//! Fences: when the route table applies a non-serving state of a model, its
//! counters are fenced with that state's `state_since`; the next report
//! carries it with the in-flight count, and every forward checks the fence
//! after counting itself in flight (both sequentially consistent), so a
//! report that says "fenced, 0 in flight" is exact: nothing more reaches
//! the engine from this proxy. Every control plane hears from the proxy at
//! least every second (an empty report is a heartbeat), so control knows
//! which proxies to wait for before a CUDA suspend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use siesta_proto::v1::{EndpointFailure, ModelActivity, ReportActivityRequest};
use tokio_util::sync::CancellationToken;

use crate::route_table::SourceId;
use crate::watch_client::Controls;

mod outbox;
use outbox::Outboxes;

/// How often batches are sent.
pub const TICK: Duration = Duration::from_millis(100);
/// A control plane hears from the proxy at least this often.
const HEARTBEAT_TICKS: u32 = 10;
/// A model with requests in flight or held but none started or finished is
/// still reported this often, so long streams count as activity and the
/// control plane's held count does not go stale.
const IN_FLIGHT_EVERY_TICKS: u32 = 10;

/// Counters of one model as served through one control plane.
#[derive(Debug)]
pub struct ActivityCounters {
    source: SourceId,
    model: Arc<str>,
    started: AtomicU32,
    finished: AtomicU32,
    in_flight: AtomicU32,
    last_finished_unix_ms: AtomicI64,
    quiet_ticks: AtomicU32,
    /// Requests held for the model now, and what the last report said.
    held: AtomicU32,
    held_reported: AtomicU32,
    /// `state_since` of the non-serving state applied (0: serving), and
    /// what the last report said.
    fenced_since: AtomicI64,
    fence_reported: AtomicI64,
}

impl ActivityCounters {
    fn new(source: SourceId, model: Arc<str>) -> Self {
        ActivityCounters {
            source,
            model,
            started: AtomicU32::new(0),
            finished: AtomicU32::new(0),
            in_flight: AtomicU32::new(0),
            last_finished_unix_ms: AtomicI64::new(0),
            quiet_ticks: AtomicU32::new(0),
            held: AtomicU32::new(0),
            held_reported: AtomicU32::new(0),
            fenced_since: AtomicI64::new(0),
            fence_reported: AtomicI64::new(0),
        }
    }

    pub fn start(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::SeqCst);
    }

    /// Fences the model at the non-serving state applied since
    /// `since_unix_ms` (0: it serves again).
    pub fn set_fence(&self, since_unix_ms: i64) {
        self.fenced_since.store(since_unix_ms, Ordering::SeqCst);
    }

    /// Whether the model is fenced: a request counted in flight after this
    /// says true must not be sent.
    pub fn fenced(&self) -> bool {
        self.fenced_since.load(Ordering::SeqCst) != 0
    }

    pub fn finish(&self) {
        self.finished.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.last_finished_unix_ms
            .store(now_unix_ms(), Ordering::Relaxed);
    }

    /// How many requests are held for the model now.
    pub fn set_held(&self, n: u32) {
        self.held.store(n, Ordering::Relaxed);
    }

    /// The held count set last.
    #[cfg(test)]
    pub(crate) fn held(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    /// Takes what accumulated since the last report, if worth reporting.
    fn take(&self) -> Option<ModelActivity> {
        // The fence before the in-flight count (see the module note).
        let fenced_since = self.fenced_since.load(Ordering::SeqCst);
        let started = self.started.swap(0, Ordering::Relaxed);
        let finished = self.finished.swap(0, Ordering::Relaxed);
        let in_flight = self.in_flight.load(Ordering::SeqCst);
        let last = self.last_finished_unix_ms.swap(0, Ordering::Relaxed);
        let held = self.held.load(Ordering::Relaxed);
        let held_changed = self.held_reported.swap(held, Ordering::Relaxed) != held;
        let fence_changed =
            self.fence_reported.swap(fenced_since, Ordering::Relaxed) != fenced_since;
        if started == 0 && finished == 0 && !held_changed && !fence_changed {
            if in_flight == 0 && held == 0 {
                return None;
            }
            let q = self.quiet_ticks.fetch_add(1, Ordering::Relaxed) + 1;
            if q < IN_FLIGHT_EVERY_TICKS {
                return None;
            }
        }
        self.quiet_ticks.store(0, Ordering::Relaxed);
        Some(ModelActivity {
            model: self.model.to_string(),
            started,
            finished,
            in_flight,
            last_finished_unix_ms: last,
            held,
            fenced_since_unix_ms: fenced_since,
        })
    }
}

pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// (control plane, model).
type CounterKey = (SourceId, Arc<str>);

/// All counters and pending failure reports.
#[derive(Debug, Default)]
pub struct Activity {
    counters: Mutex<HashMap<CounterKey, Arc<ActivityCounters>>>,
    failures: Mutex<Vec<(SourceId, EndpointFailure)>>,
    groups: Arc<Groups>,
    /// Control plane addresses forgotten since the last round: their
    /// senders are ended ([`Activity::run`]).
    forgotten: Mutex<Vec<SourceId>>,
}

/// Addresses that reach one control plane process (a dual-stack name:
/// the route table knows them by the identity each answers with). Their
/// counters are one set, kept under the group's first address, and its
/// reports go through the address whose watch is furthest along. Kept per
/// address, the fence was set only on the address that counted, and the
/// process heard both addresses' reports under one proxy id, the last one
/// winning: "fenced, none in flight" through one while a request was in
/// flight through the other confirmed a CUDA suspend under it.
#[derive(Debug, Default)]
pub struct Groups {
    map: Mutex<HashMap<SourceId, Group>>,
}

#[derive(Debug, Clone)]
struct Group {
    first: SourceId,
    via: SourceId,
}

impl Groups {
    /// The address `source`'s counters are kept under.
    pub fn first(&self, source: &SourceId) -> SourceId {
        self.map
            .lock()
            .unwrap()
            .get(source)
            .map_or_else(|| source.clone(), |g| g.first.clone())
    }

    /// The address reports kept under `first` go through.
    pub fn via(&self, first: &SourceId) -> SourceId {
        self.map
            .lock()
            .unwrap()
            .get(first)
            .map_or_else(|| first.clone(), |g| g.via.clone())
    }
}

impl Activity {
    /// The counters for `model` served through `source` (created once; one
    /// set for every address of a control plane process: [`Groups`]).
    pub fn counters(&self, source: &SourceId, model: &Arc<str>) -> Arc<ActivityCounters> {
        let source = self.groups.first(source);
        let mut map = self.counters.lock().unwrap();
        map.entry((source.clone(), model.clone()))
            .or_insert_with(|| Arc::new(ActivityCounters::new(source, model.clone())))
            .clone()
    }

    /// Sets the groups of addresses that reach one control plane process:
    /// each group's addresses (the first keeps the counters) and the one
    /// its reports go through. Counters kept under an address that is now
    /// not its group's first are dropped (made before its identity was
    /// known; the next look-up finds the group's).
    pub fn set_groups(&self, groups: Vec<(Vec<SourceId>, SourceId)>) {
        let mut map = HashMap::new();
        for (members, via) in groups {
            let Some(first) = members.iter().min().cloned() else {
                continue;
            };
            for m in members {
                map.insert(
                    m,
                    Group {
                        first: first.clone(),
                        via: via.clone(),
                    },
                );
            }
        }
        let mut held = self.groups.map.lock().unwrap();
        let unchanged = held.len() == map.len()
            && map.iter().all(|(k, g)| {
                held.get(k)
                    .is_some_and(|h| h.first == g.first && h.via == g.via)
            });
        if unchanged {
            return;
        }
        self.counters
            .lock()
            .unwrap()
            .retain(|(src, _), _| map.get(src).is_none_or(|g| &g.first == src));
        *held = map;
    }

    /// Forgets a control plane address (it left DNS, its models served
    /// elsewhere or given up): its counters and its report sender. Kept,
    /// they grew by a set per model for every address a control plane pod
    /// ever had, and every round walked them all.
    pub fn forget(&self, source: &SourceId) {
        self.counters
            .lock()
            .unwrap()
            .retain(|(src, _), _| src != source);
        self.failures
            .lock()
            .unwrap()
            .retain(|(src, _)| src != source);
        self.forgotten.lock().unwrap().push(source.clone());
    }

    /// How many sets of counters are kept (for tests).
    #[cfg(test)]
    pub(crate) fn counter_sets(&self) -> usize {
        self.counters.lock().unwrap().len()
    }

    /// The groups of addresses of one control plane process.
    #[cfg(test)]
    pub(crate) fn groups(&self) -> &Groups {
        &self.groups
    }

    /// Records an endpoint that refused a connection while believed awake.
    pub fn endpoint_failed(&self, source: &SourceId, model: &str, url: &str, error: String) {
        let source = self.groups.first(source);
        let mut f = self.failures.lock().unwrap();
        if f.len() < 1024 {
            f.push((
                source,
                EndpointFailure {
                    model: model.to_owned(),
                    url: url.to_owned(),
                    error,
                },
            ));
        }
    }

    /// One batch per control plane with something to say.
    pub fn drain(&self) -> HashMap<SourceId, ReportActivityRequest> {
        let mut out: HashMap<SourceId, ReportActivityRequest> = HashMap::new();
        {
            let map = self.counters.lock().unwrap();
            for c in map.values() {
                if let Some(m) = c.take() {
                    out.entry(c.source.clone()).or_default().models.push(m);
                }
            }
        }
        for (src, f) in self.failures.lock().unwrap().drain(..) {
            out.entry(src).or_default().failures.push(f);
        }
        out
    }

    /// Sends batches every [`TICK`] until `shutdown`, then a last one.
    pub async fn run(
        self: Arc<Self>,
        controls: Arc<Controls>,
        proxy_id: String,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ticks: u32 = 0;
        let mut outboxes = Outboxes::through(self.groups.clone());
        loop {
            let last = tokio::select! {
                _ = tick.tick() => false,
                _ = shutdown.cancelled() => true,
            };
            let mut batches = self.drain();
            ticks = ticks.wrapping_add(1);
            if ticks.is_multiple_of(HEARTBEAT_TICKS) {
                for src in controls.sources() {
                    batches.entry(self.groups.first(&src)).or_default();
                }
            }
            for (src, mut req) in batches {
                req.proxy_id = proxy_id.clone();
                outboxes.post(&controls, src, req);
            }
            for src in std::mem::take(&mut *self.forgotten.lock().unwrap()) {
                outboxes.end(&src);
            }
            if last {
                outboxes.close().await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(a: &Activity) -> Option<ModelActivity> {
        let mut out = a.drain();
        assert!(out.len() <= 1);
        out.drain().next().map(|(_, mut r)| r.models.remove(0))
    }

    /// A held count is reported when it changes (zero included), then
    /// about once a second while it is not zero, and not at all at rest.
    #[test]
    fn held_counts_are_reported_on_change_and_kept_fresh() {
        let a = Activity::default();
        let c = a.counters(&SourceId::from("http://control"), &Arc::from("m"));
        assert!(one(&a).is_none());
        c.set_held(4);
        assert_eq!(one(&a).map(|m| (m.held, m.in_flight)), Some((4, 0)));
        // Unchanged: quiet, then refreshed before the control plane forgets.
        let repeats = (0..IN_FLIGHT_EVERY_TICKS)
            .filter(|_| one(&a).is_some())
            .count();
        assert_eq!(repeats, 1);
        c.set_held(0);
        assert_eq!(one(&a).map(|m| m.held), Some(0));
        assert!((0..2 * IN_FLIGHT_EVERY_TICKS).all(|_| one(&a).is_none()));
    }

    /// A fence is news: reported at once with what is still in flight, and
    /// again as that drains, so control knows when nothing can reach the
    /// engine from this proxy.
    #[test]
    fn a_fence_is_reported_with_the_requests_still_in_flight() {
        let a = Activity::default();
        let c = a.counters(&SourceId::from("http://control"), &Arc::from("m"));
        c.start();
        assert_eq!(
            one(&a).map(|m| (m.fenced_since_unix_ms, m.in_flight)),
            Some((0, 1))
        );
        c.set_fence(1234);
        assert!(c.fenced());
        let m = one(&a).expect("the fence is reported");
        assert_eq!((m.fenced_since_unix_ms, m.in_flight), (1234, 1));
        c.finish();
        let m = one(&a).expect("the drain is reported");
        assert_eq!((m.fenced_since_unix_ms, m.in_flight), (1234, 0));
        assert!(one(&a).is_none(), "then quiet");
        c.set_fence(0);
        assert!(!c.fenced());
        assert_eq!(one(&a).map(|m| m.fenced_since_unix_ms), Some(0));
    }
}
