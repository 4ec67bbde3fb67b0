//! Holding requests for models that are not awake: one bounded FIFO queue per
//! model, one `Demand` per wait episode (the queue going from empty to
//! non-empty), release on the `awake` event, and the Retry-After estimates
//! used when shedding.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use siesta_proto::v1::{DemandRequest, DemandResponse, DesiredState, ModelState};
use tokio::sync::{Semaphore, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::activity::{Activity, ActivityCounters, now_unix_ms};
use crate::errors::{ApiError, ShedReason};
use crate::metrics::{Metrics, ModelLabels};
use crate::route_table::{ModelRoute, RouteTable, View};
use crate::watch_client::{Controls, backoff};

mod estimate;
pub use estimate::{estimate, retry_after_s};

/// A model's released requests that may be on their way from the waiting
/// room to an answer at once: each is a full hyper connection with its
/// body read (and an engine connection), so a released queue of 100,000
/// becomes connections this many at a time, in order, at the engine's
/// pace. Each model has its own places, and a request gives its place back
/// at its answer's head or after [`GATE_HOLD_MAX`] at the engine: a long
/// generation holds an engine slot (`forward::pool`), never another
/// request's way out.
pub const LEAVING_AT_ONCE: usize = 256;

/// How long a released request keeps its place once the engine has it.
pub const GATE_HOLD_MAX: Duration = Duration::from_secs(1);

/// A request waits for its way out of the waiting room, then for one of
/// the engine's slots, until its hold limit (counted from its first wait)
/// and at least this long each: one released at the end of its hold is
/// not shed for a slot that frees a moment later.
pub const SLOT_WAIT_MIN: Duration = Duration::from_secs(5);

/// How often requests shed as `wait_too_long` may ask for a model's wake.
const SHED_DEMAND_EVERY: Duration = Duration::from_secs(1);

/// What ends a hold.
#[derive(Debug)]
pub enum Release {
    /// The model is awake: route again.
    Go,
    /// The model was removed.
    Gone,
    /// Give up with this error.
    Fail(ApiError),
}

/// How a wait ended.
#[derive(Debug)]
pub enum Wait {
    Released(Release),
    /// The hold limit passed.
    Timeout,
    /// The poll interval passed (re-check the route).
    Poll,
    /// The proxy is shutting down and its drain time is nearly over.
    Draining,
}

#[derive(Debug, Default)]
struct QueueInner {
    /// By arrival (ids grow): in order to release, and a leaver is removed
    /// in O(log n) (100,000 clients may hang up at once).
    waiters: BTreeMap<u64, oneshot::Sender<Release>>,
    next_id: u64,
    /// The wait episode under way (its Demand was or is being sent), if any.
    episode: Option<u64>,
    episodes: u64,
    /// When a request shed as `wait_too_long` last asked for the wake.
    shed_demand_at: Option<Instant>,
    /// Let go from the map (its model left the view while it was empty):
    /// a waiter put in it would never be seen by a view again.
    removed: bool,
}

#[derive(Debug)]
struct HoldQueue {
    model: Arc<str>,
    inner: Mutex<QueueInner>,
    /// Where the held count is reported: the control plane the demand
    /// goes to first.
    report: Mutex<Option<Arc<ActivityCounters>>>,
    /// Places for this model's released requests between the waiting room
    /// and an engine slot ([`LEAVING_AT_ONCE`]).
    leaving: Arc<Semaphore>,
}

impl HoldQueue {
    fn release_all(&self, mut f: impl FnMut() -> Release) -> usize {
        let mut q = self.inner.lock().unwrap();
        q.episode = None;
        let n = q.waiters.len();
        for (_, tx) in std::mem::take(&mut q.waiters) {
            let _ = tx.send(f());
        }
        self.report_held(0);
        n
    }

    /// Tells the control plane's activity report how many wait now.
    fn report_held(&self, n: usize) {
        if let Some(c) = &*self.report.lock().unwrap() {
            c.set_held(n as u32);
        }
    }

    /// An empty queue for `model`.
    fn new(model: Arc<str>) -> Arc<Self> {
        Arc::new(HoldQueue {
            model,
            inner: Mutex::new(QueueInner::default()),
            report: Mutex::new(None),
            leaving: Arc::new(Semaphore::new(LEAVING_AT_ONCE)),
        })
    }

    /// Reports to `to` from now on (the best control plane may change).
    fn report_to(&self, to: Arc<ActivityCounters>, held: usize) {
        let mut r = self.report.lock().unwrap();
        if r.as_ref().is_some_and(|old| Arc::ptr_eq(old, &to)) {
            return;
        }
        if let Some(old) = r.take() {
            old.set_held(0);
        }
        // What waits now, told to the new control plane at once: a request
        // shed (the queue full) changes no count, and the new one took the
        // queue for empty until one joined or left.
        to.set_held(held as u32);
        *r = Some(to);
    }
}

/// All hold queues.
#[derive(Debug)]
pub struct Holds {
    queues: Mutex<HashMap<Arc<str>, Arc<HoldQueue>>>,
    table: Arc<RouteTable>,
    controls: Arc<Controls>,
    metrics: Arc<Metrics>,
    activity: Arc<Activity>,
    proxy_id: String,
    /// Ends demand retries when the proxy stops.
    shutdown: CancellationToken,
    /// When held requests are shed because the proxy is shutting down.
    shed_at: watch::Sender<Option<Instant>>,
}

/// A place in a model's queue; leaving (drop) frees it at once.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<HoldQueue>,
    id: u64,
    rx: oneshot::Receiver<Release>,
    metrics: Arc<Metrics>,
    shed_at: watch::Receiver<Option<Instant>>,
}

impl Ticket {
    /// The model's places for released requests on their way to an engine
    /// (taken by the waiting room: [`LEAVING_AT_ONCE`]).
    pub fn leaving(&self) -> Arc<Semaphore> {
        self.queue.leaving.clone()
    }

    pub async fn wait(&mut self, deadline: Instant, poll: Option<Duration>) -> Wait {
        let poll = tokio::time::sleep(poll.unwrap_or(Duration::MAX / 4));
        tokio::pin!(poll);
        loop {
            let shed_at = *self.shed_at.borrow_and_update();
            let (until, on_time) = match shed_at {
                Some(s) if s < deadline => (s, Wait::Draining),
                _ => (deadline, Wait::Timeout),
            };
            tokio::select! {
                r = &mut self.rx => return Wait::Released(r.unwrap_or(Release::Gone)),
                _ = tokio::time::sleep_until(until) => return on_time,
                _ = &mut poll => return Wait::Poll,
                changed = self.shed_at.changed() => {
                    if changed.is_err() {
                        // The proxy is gone; the hold limit still applies.
                        tokio::time::sleep_until(deadline).await;
                        return Wait::Timeout;
                    }
                }
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut q = self.queue.inner.lock().unwrap();
        q.waiters.remove(&self.id);
        if q.waiters.is_empty() {
            q.episode = None;
        }
        // Under the queue's lock, so reports follow the queue's order.
        self.queue.report_held(q.waiters.len());
        drop(q);
        self.metrics
            .held
            .get_or_create(&ModelLabels {
                model: self.queue.model.clone(),
            })
            .dec();
    }
}

/// A model an operator stopped: demand will not wake it, and retrying
/// cannot help until someone starts it (no Retry-After).
fn operator_stopped(route: &ModelRoute) -> ApiError {
    shed(
        ShedReason::Refused,
        None,
        format!(
            "model `{}` will not be woken: it was stopped by an operator; \
             `siesta start {}` or `siesta wake {}` first",
            route.name, route.name, route.name
        ),
    )
}

fn shed(reason: ShedReason, retry_after_s: Option<u64>, message: String) -> ApiError {
    ApiError::Shed {
        reason,
        retry_after_s,
        message,
    }
}

impl Holds {
    pub fn new(
        table: Arc<RouteTable>,
        controls: Arc<Controls>,
        metrics: Arc<Metrics>,
        activity: Arc<Activity>,
        proxy_id: String,
        shutdown: CancellationToken,
    ) -> Self {
        Holds {
            queues: Mutex::new(HashMap::new()),
            table,
            controls,
            metrics,
            activity,
            proxy_id,
            shutdown,
            shed_at: watch::Sender::new(None),
        }
    }

    /// The proxy is draining: requests still held at `at` get 503 with a
    /// short Retry-After (another replica can take them), not a cut
    /// connection when the drain time ends.
    pub fn shed_held_at(&self, at: Instant) {
        self.shed_at.send_replace(Some(at));
    }

    /// Queue depth now (for tests and Retry-After).
    pub fn depth(&self, model: &str) -> usize {
        let map = self.queues.lock().unwrap();
        map.get(model)
            .map_or(0, |q| q.inner.lock().unwrap().waiters.len())
    }

    /// Admits a request into `route`'s queue, or sheds it. `held_since` is when
    /// the request started waiting (the hold limit counts from there).
    pub fn admit(
        self: &Arc<Self>,
        route: &ModelRoute,
        held_since: Instant,
    ) -> Result<Ticket, ApiError> {
        if route.stopped_by_operator() {
            return Err(operator_stopped(route));
        }
        let now_ms = now_unix_ms();
        let status = &route.status;
        if route.state == ModelState::Failed && status.retry_at_unix_ms > now_ms {
            let wait = (status.retry_at_unix_ms - now_ms) as u64;
            return Err(shed(
                ShedReason::Failed,
                Some(wait.div_ceil(1000).max(1)),
                format!(
                    "model `{}` failed ({}); next attempt in {} ms",
                    route.name, status.last_error, wait
                ),
            ));
        }
        let est = estimate(route, now_ms);
        let hold_left = Duration::from_millis(route.max_hold_ms)
            .saturating_sub(held_since.elapsed())
            .as_millis() as u64;
        let queue = self
            .queues
            .lock()
            .unwrap()
            .entry(route.name.clone())
            .or_insert_with(|| HoldQueue::new(route.name.clone()))
            .clone();
        let mut q = queue.inner.lock().unwrap();
        if q.removed {
            // A view without the model let it go since: the map's now.
            drop(q);
            return self.admit(route, held_since);
        }
        if let Some(source) = route.sources.first() {
            queue.report_to(self.activity.counters(source, &route.name), q.waiters.len());
        }
        let depth = q.waiters.len();
        if est.calibrated && est.ms > hold_left {
            // Shed, but still ask for the wake: a model whose start outlasts
            // `max_hold` would otherwise never start, and every retry would
            // be shed the same way. At most one Demand a second per model,
            // and none while one is wanted awake already.
            let wanted = route
                .status
                .intent
                .as_ref()
                .is_some_and(|i| i.desired() == DesiredState::Awake);
            let now = Instant::now();
            if !wanted
                && q.episode.is_none()
                && q.shed_demand_at
                    .is_none_or(|at| now.duration_since(at) >= SHED_DEMAND_EVERY)
            {
                q.shed_demand_at = Some(now);
                tokio::spawn(self.clone().demand_for_shed(queue.model.clone()));
            }
            return Err(shed(
                ShedReason::WaitTooLong,
                Some(retry_after_s(est.ms, depth)),
                format!(
                    "model `{}` is {}; it needs about {} ms, longer than its hold limit \
                     (max_hold {} ms); it is being woken: retry after Retry-After",
                    route.name,
                    state_name(route.state),
                    est.ms,
                    route.max_hold_ms
                ),
            ));
        }
        if depth >= route.max_queue as usize {
            return Err(shed(
                ShedReason::QueueFull,
                Some(retry_after_s(est.ms, depth)),
                format!(
                    "model `{}` is {} and {} requests are already waiting",
                    route.name,
                    state_name(route.state),
                    depth
                ),
            ));
        }
        let id = q.next_id;
        q.next_id += 1;
        let (tx, rx) = oneshot::channel();
        q.waiters.insert(id, tx);
        queue.report_held(q.waiters.len());
        let new_episode = q.episode.is_none().then(|| {
            q.episodes += 1;
            q.episode = Some(q.episodes);
            q.episodes
        });
        drop(q);
        self.metrics
            .held
            .get_or_create(&ModelLabels {
                model: route.name.clone(),
            })
            .inc();
        // `route` was read before this waiter was queued: if the model woke
        // in between, the release for it may have found the queue empty and
        // gone, and no later view would release this one. The view now is
        // published before its release runs, so reading it after queueing
        // leaves no gap.
        // So for a model removed in between (`on_view` found no waiter).
        let now = self.table.view().by_name.get(&*route.name).cloned();
        if now.is_none() {
            queue.release_all(|| Release::Gone);
        } else if !route.is_awake() && now.is_some_and(|r| r.is_awake()) {
            queue.release_all(|| Release::Go);
        } else if let Some(episode) = new_episode {
            tokio::spawn(self.clone().demand_episode(queue.clone(), episode));
        }
        Ok(Ticket {
            queue,
            id,
            rx,
            metrics: self.metrics.clone(),
            shed_at: self.shed_at.subscribe(),
        })
    }

    /// One Demand RPC for `model` (None: the model is gone). A later
    /// `attempt` goes to another control plane that has the model, for
    /// when the best one cannot be reached.
    async fn send_demand(
        &self,
        model: &str,
        attempt: u32,
        queued: u32,
    ) -> Option<Result<DemandResponse, tonic::Status>> {
        let view = self.table.view();
        let route = view.by_name.get(model)?;
        let source = &route.sources[attempt as usize % route.sources.len()];
        Some(match self.controls.client(source) {
            Some(mut client) => {
                let req = DemandRequest {
                    model: route.name.to_string(),
                    proxy_id: self.proxy_id.clone(),
                    queued,
                };
                match tokio::time::timeout(Duration::from_secs(5), client.demand(req)).await {
                    Ok(r) => r.map(|r| r.into_inner()),
                    Err(_) => Err(tonic::Status::deadline_exceeded("Demand timed out")),
                }
            }
            None => Err(tonic::Status::unavailable("no client for control plane")),
        })
    }

    /// The Demand of a request shed as `wait_too_long`: one attempt (the
    /// next such request tries again).
    async fn demand_for_shed(self: Arc<Self>, model: Arc<str>) {
        match self.send_demand(&model, 0, 0).await {
            Some(Ok(resp)) if resp.accepted => {
                tracing::info!(model = %model, "request shed (the wait outlasts max_hold); wake asked for");
            }
            Some(Ok(resp)) => {
                tracing::info!(model = %model, message = %resp.message, "demand refused");
            }
            Some(Err(status)) => {
                tracing::debug!(model = %model, error = %status, "demand failed");
            }
            None => {}
        }
    }

    /// Sends one Demand for a wait episode, retrying only while the control
    /// plane cannot be reached and requests are still waiting.
    async fn demand_episode(self: Arc<Self>, queue: Arc<HoldQueue>, episode: u64) {
        let mut attempt = 0u32;
        loop {
            let queued = {
                let q = queue.inner.lock().unwrap();
                if q.episode != Some(episode) || q.waiters.is_empty() {
                    return;
                }
                q.waiters.len() as u32
            };
            let Some(res) = self.send_demand(&queue.model, attempt, queued).await else {
                return;
            };
            match res {
                Ok(resp) if resp.accepted => {
                    tracing::info!(model = %queue.model, queued, "requests held; demand accepted");
                    return;
                }
                Ok(resp) => {
                    tracing::info!(model = %queue.model, message = %resp.message, "demand refused");
                    let msg = format!(
                        "model `{}` will not be woken: {}",
                        queue.model, resp.message
                    );
                    if queue.inner.lock().unwrap().episode == Some(episode) {
                        queue.release_all(|| {
                            Release::Fail(shed(ShedReason::Refused, None, msg.clone()))
                        });
                    }
                    return;
                }
                Err(status) => {
                    attempt += 1;
                    tracing::debug!(model = %queue.model, error = %status, attempt, "demand failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff(attempt)) => {}
                        _ = self.shutdown.cancelled() => return,
                    }
                }
            }
        }
    }

    /// Releases or sheds held requests as the table changes, until `shutdown`.
    pub async fn run(
        self: Arc<Self>,
        mut rx: watch::Receiver<Arc<View>>,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                _ = shutdown.cancelled() => return,
            }
            let view = rx.borrow_and_update().clone();
            self.on_view(&view);
        }
    }

    fn on_view(&self, view: &View) {
        let queues: Vec<Arc<HoldQueue>> = {
            let mut map = self.queues.lock().unwrap();
            map.retain(|name, q| {
                let mut inner = q.inner.lock().unwrap();
                let keep = view.by_name.contains_key(&**name) || !inner.waiters.is_empty();
                inner.removed = !keep;
                keep
            });
            map.values().cloned().collect()
        };
        let now_ms = now_unix_ms();
        for q in queues {
            if q.inner.lock().unwrap().waiters.is_empty() {
                continue;
            }
            match view.by_name.get(&*q.model) {
                None => {
                    q.release_all(|| Release::Gone);
                }
                Some(r) if r.is_awake() => {
                    let n = q.release_all(|| Release::Go);
                    tracing::debug!(model = %q.model, released = n, "model awake; releasing held requests");
                }
                Some(r) if r.stopped_by_operator() => {
                    // Demand will not wake it: answer now, not at max_hold.
                    let n = q.release_all(|| Release::Fail(operator_stopped(r)));
                    tracing::info!(model = %q.model, answered = n, "stopped by an operator; held requests answered");
                }
                Some(r) if r.state == ModelState::Failed && r.status.retry_at_unix_ms > now_ms => {
                    let wait = (r.status.retry_at_unix_ms - now_ms) as u64;
                    let msg = format!(
                        "model `{}` failed ({}); next attempt in {} ms",
                        r.name, r.status.last_error, wait
                    );
                    q.release_all(|| {
                        Release::Fail(shed(
                            ShedReason::Failed,
                            Some(wait.div_ceil(1000).max(1)),
                            msg.clone(),
                        ))
                    });
                }
                Some(_) => {}
            }
        }
    }
}

/// The lower-case state name used in messages and `/v1/models`.
pub fn state_name(s: ModelState) -> &'static str {
    s.label()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route_table::SourceId;
    use crate::route_table::tests::{event, snapshot, status};
    use siesta_proto::v1::HoldPolicy;

    /// Holds over a table whose model `m`, read asleep (the route
    /// returned), then changed by `change` before any release ran.
    fn stale_route(
        change: impl FnOnce(&RouteTable, &crate::route_table::SourceId),
    ) -> (Arc<Holds>, Arc<ModelRoute>) {
        let activity = Arc::new(Activity::default());
        let table = Arc::new(RouteTable::new(activity.clone()));
        let src: crate::route_table::SourceId = Arc::from("http://c");
        table.apply(
            &src,
            snapshot(1, vec![status("m", ModelState::Asleep, &[])]),
        );
        let stale = table.view().by_name["m"].clone();
        change(&table, &src);
        let holds = Arc::new(Holds::new(
            table,
            Arc::new(Controls::new(None).unwrap()),
            Arc::new(Metrics::new()),
            activity,
            "p".into(),
            CancellationToken::new(),
        ));
        (holds, stale)
    }

    /// A request that read the route while the model was asleep and queued
    /// itself just after the model woke (its release came and went with the
    /// queue empty) is released at once, not left until the hold limit.
    #[tokio::test]
    async fn a_request_queued_just_after_the_wake_is_released() {
        let (holds, stale) = stale_route(|table, src| {
            let awake = status("m", ModelState::Awake, &["http://127.0.0.1:9"]);
            assert!(table.apply(src, event(2, awake)));
        });
        // No release task runs: the awake view's release has come and gone.
        let mut ticket = holds.admit(&stale, Instant::now()).unwrap();
        let waited = ticket
            .wait(Instant::now() + Duration::from_secs(5), None)
            .await;
        assert!(matches!(waited, Wait::Released(Release::Go)), "{waited:?}");
        assert_eq!(holds.depth("m"), 0);
    }

    /// The control plane leading for a model changes while requests are held
    /// and the queue is full: the new one is told what waits at once (its
    /// held count is demand), the old one that nothing does. Before, the
    /// shed request changed no count, and both said 0 until one joined or
    /// left.
    #[tokio::test]
    async fn a_new_leading_control_plane_is_told_what_is_held_at_once() {
        let asleep = |level| {
            let mut s = status("m", ModelState::Asleep, &[]);
            s.sleep_level = level;
            s.hold = Some(HoldPolicy {
                max_queue: 1,
                ..Default::default()
            });
            s
        };
        let (a, b): (SourceId, SourceId) = (Arc::from("http://a"), Arc::from("http://b"));
        let (holds, _) = stale_route(|table, src| {
            table.apply(src, snapshot(2, vec![asleep(2)]));
        });
        let table = holds.table.clone();
        table.apply(&a, snapshot(1, vec![asleep(1)]));
        table.apply(&b, snapshot(1, vec![asleep(2)]));
        let route = table.view().by_name["m"].clone();
        assert_eq!(route.sources[0], a);
        let held = |s: &SourceId| holds.activity.counters(s, &route.name).held();
        let _ticket = holds.admit(&route, Instant::now()).unwrap();
        assert_eq!((held(&a), held(&b)), (1, 0));
        // `b` leads now (it wakes sooner); the queue is full.
        table.apply(&a, event(2, asleep(2)));
        table.apply(&b, event(2, asleep(1)));
        let route = table.view().by_name["m"].clone();
        assert_eq!(route.sources[0], b);
        let shed = holds.admit(&route, Instant::now());
        assert!(shed.is_err(), "the queue holds one");
        assert_eq!((held(&a), held(&b)), (0, 1));
    }

    /// The same for a model removed meanwhile: the view without it found
    /// no waiter to answer; the request gets its 404 at once, not a 503
    /// at `max_hold`.
    #[tokio::test]
    async fn a_request_queued_just_after_its_model_was_removed_is_answered() {
        let (holds, stale) = stale_route(|table, src| {
            table.apply(src, snapshot(2, vec![status("n", ModelState::Asleep, &[])]));
        });
        let mut ticket = holds.admit(&stale, Instant::now()).unwrap();
        let waited = ticket
            .wait(Instant::now() + Duration::from_secs(5), None)
            .await;
        assert!(
            matches!(waited, Wait::Released(Release::Gone)),
            "{waited:?}"
        );
        assert_eq!(holds.depth("m"), 0);
    }
}
