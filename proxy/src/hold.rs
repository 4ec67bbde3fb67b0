//! Holding requests for models that are not awake: one bounded FIFO queue per
//! model, one `Demand` per wait episode (the queue going from empty to
//! non-empty), release on the `awake` event, and the Retry-After estimates
//! used when shedding.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use siesta_proto::v1::{DemandRequest, DemandResponse, DesiredState, ModelState};
use tokio::sync::{Notify, Semaphore, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::activity::{Activity, ActivityCounters, now_unix_ms};
use crate::errors::{ApiError, ShedReason};
use crate::metrics::{Metrics, ModelLabels};
use crate::route_table::{ModelRoute, RouteTable, SourceId, View};
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

/// While requests are held, whether their Demand should go elsewhere is
/// checked this often, and at once when the view changes: it is sent again
/// when the control plane that took it has lost its Watch stream (died,
/// its model frozen in its last view) or another has become the best
/// placed to serve the model (the one asked failed to wake it), to the
/// best placed one whose stream is up. Never again to the one that took
/// it while it is up and best placed: an operator's sleep or stop given
/// since would be overridden by the repeat.
pub const DEMAND_REFRESH: Duration = Duration::from_secs(2);

/// Where `route`'s Demand goes on `attempt` (0 first): the control planes
/// whose Watch stream is up, best placed first, in turn; all of them when
/// none is.
fn demand_target(route: &ModelRoute, view: &View, attempt: u32) -> SourceId {
    let up: Vec<&SourceId> = route
        .sources
        .iter()
        .filter(|s| !view.lost.contains(*s))
        .collect();
    if up.is_empty() {
        route.sources[attempt as usize % route.sources.len()].clone()
    } else {
        up[attempt as usize % up.len()].clone()
    }
}

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

/// One held request: where its release goes, and when its hold ends.
#[derive(Debug)]
struct Waiter {
    tx: oneshot::Sender<Release>,
    deadline: Instant,
}

#[derive(Debug, Default)]
struct QueueInner {
    /// By arrival (ids grow): in order to release, and a leaver is removed
    /// in O(log n) (100,000 clients may hang up at once).
    waiters: BTreeMap<u64, Waiter>,
    next_id: u64,
    /// The wait episode under way (its Demand was or is being sent), if any.
    episode: Option<u64>,
    episodes: u64,
    /// When a request shed as `wait_too_long` last asked for the wake.
    shed_demand_at: Option<Instant>,
    /// The control plane that took the wait episode's latest Demand.
    asked: Option<SourceId>,
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
    /// Wakes the episode's Demand task before [`DEMAND_REFRESH`]: the
    /// best placed control plane is no longer the one that took it.
    ask_again: Notify,
}

impl HoldQueue {
    fn release_all(&self, mut f: impl FnMut() -> Release) -> usize {
        let mut q = self.inner.lock().unwrap();
        q.episode = None;
        q.asked = None;
        let n = q.waiters.len();
        for (_, w) in std::mem::take(&mut q.waiters) {
            let _ = w.tx.send(f());
        }
        self.report_held(0);
        n
    }

    /// The model failed and waits for its next try: answers now each held
    /// request [`failed_answer`] does not hold through it (all of them once
    /// it failed twice in a row), and keeps the others. Returns how many
    /// were answered.
    fn answer_failed(&self, route: &ModelRoute, now_ms: i64) -> usize {
        let mut q = self.inner.lock().unwrap();
        let now = Instant::now();
        let answered: Vec<(u64, ApiError)> = q
            .waiters
            .iter()
            .filter_map(|(id, w)| {
                failed_answer(route, now_ms, hold_left_ms(w.deadline, now)).map(|e| (*id, e))
            })
            .collect();
        let n = answered.len();
        for (id, e) in answered {
            if let Some(w) = q.waiters.remove(&id) {
                let _ = w.tx.send(Release::Fail(e));
            }
        }
        if q.waiters.is_empty() {
            q.episode = None;
            q.asked = None;
        }
        self.report_held(q.waiters.len());
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
            ask_again: Notify::new(),
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
            q.asked = None;
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

/// Failures in a row that held requests wait through: an engine that
/// crashed, or a start that failed, once is tried again after its backoff,
/// and a request whose hold covers that and a start waits for it; a model
/// that failed again (it keeps failing) has its requests answered at once,
/// with the time to its next try, not held a whole `max_hold` each.
const HELD_THROUGH_FAILURES: u32 = 1;

/// Milliseconds from `now` until `deadline` (0 once past).
fn hold_left_ms(deadline: Instant, now: Instant) -> u64 {
    deadline.saturating_duration_since(now).as_millis() as u64
}

/// The answer now for a request to `route`, with `hold_left_ms` of its hold
/// left, if the model failed and waits for its next try and the request is
/// not held through it ([`HELD_THROUGH_FAILURES`]; its next try and a start
/// must fit in what is left of the hold). `None`: held as for any model not
/// awake.
fn failed_answer(route: &ModelRoute, now_ms: i64, hold_left_ms: u64) -> Option<ApiError> {
    let status = &route.status;
    if route.state != ModelState::Failed || status.retry_at_unix_ms <= now_ms {
        return None;
    }
    let wait = (status.retry_at_unix_ms - now_ms) as u64;
    let est = estimate(route, now_ms).ms;
    let fits = est <= hold_left_ms;
    if status.failures <= HELD_THROUGH_FAILURES && fits {
        return None;
    }
    let (name, error) = (&route.name, &status.last_error);
    let message = if fits {
        format!(
            "model `{name}` failed {} times in a row ({error}); next attempt in {wait} ms",
            status.failures
        )
    } else {
        format!(
            "model `{name}` failed ({error}); its next attempt in {wait} ms and a start \
             (about {est} ms together) outlast this request's hold \
             ({hold_left_ms} ms left of max_hold {} ms)",
            route.max_hold_ms
        )
    };
    Some(shed(
        ShedReason::Failed,
        Some(wait.div_ceil(1000).max(1)),
        message,
    ))
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
        let deadline = held_since + Duration::from_millis(route.max_hold_ms);
        let hold_left = hold_left_ms(deadline, Instant::now());
        if let Some(e) = failed_answer(route, now_ms, hold_left) {
            return Err(e);
        }
        let est = estimate(route, now_ms);
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
        q.waiters.insert(id, Waiter { tx, deadline });
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

    /// One Demand RPC for `model` (None: the model is gone) to
    /// [`demand_target`], unless that is `skip` (it took the Demand
    /// already: `Some((target, None))`). A later `attempt` goes to another
    /// control plane that has the model, for when the best one cannot be
    /// reached.
    async fn send_demand(
        &self,
        model: &str,
        attempt: u32,
        queued: u32,
        skip: Option<&SourceId>,
    ) -> Option<(SourceId, Option<Result<DemandResponse, tonic::Status>>)> {
        let view = self.table.view();
        let route = view.by_name.get(model)?;
        let source = demand_target(route, &view, attempt);
        if skip == Some(&source) {
            return Some((source, None));
        }
        let res = match self.controls.client(&source) {
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
        };
        Some((source, Some(res)))
    }

    /// The Demand of a request shed as `wait_too_long`: one attempt (the
    /// next such request tries again).
    async fn demand_for_shed(self: Arc<Self>, model: Arc<str>) {
        match self
            .send_demand(&model, 0, 0, None)
            .await
            .and_then(|(_, r)| r)
        {
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

    /// Sends a wait episode's Demand, again every [`DEMAND_REFRESH`] and
    /// when another control plane becomes the best placed, while requests
    /// are still waiting; one that cannot be reached is retried with backoff
    /// on the next control plane that has the model.
    async fn demand_episode(self: Arc<Self>, queue: Arc<HoldQueue>, episode: u64) {
        let mut attempt = 0u32;
        let mut taken = false;
        loop {
            let (queued, asked) = {
                let q = queue.inner.lock().unwrap();
                if q.episode != Some(episode) || q.waiters.is_empty() {
                    return;
                }
                (q.waiters.len() as u32, q.asked.clone())
            };
            let sent = self
                .send_demand(&queue.model, attempt, queued, asked.as_ref())
                .await;
            let Some((source, res)) = sent else {
                return;
            };
            let next = match res {
                // It took it and is still the one to ask.
                None => DEMAND_REFRESH,
                Some(Ok(resp)) if resp.accepted => {
                    if !taken {
                        tracing::info!(model = %queue.model, queued, control = %source, "requests held; demand accepted");
                    }
                    taken = true;
                    attempt = 0;
                    let mut q = queue.inner.lock().unwrap();
                    if q.episode != Some(episode) {
                        return;
                    }
                    q.asked = Some(source);
                    DEMAND_REFRESH
                }
                Some(Ok(resp)) => {
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
                Some(Err(status)) => {
                    attempt += 1;
                    tracing::debug!(model = %queue.model, error = %status, attempt, "demand failed; retrying");
                    backoff(attempt)
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(next) => {}
                _ = queue.ask_again.notified() => {}
                _ = self.shutdown.cancelled() => return,
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
                    let n = q.answer_failed(r, now_ms);
                    tracing::info!(model = %q.model, answered = n, failures = r.status.failures, "model failed; held requests that cannot wait for its next try answered");
                }
                Some(r) => {
                    let asked = q.inner.lock().unwrap().asked.clone();
                    let target = demand_target(r, view, 0);
                    if asked.is_some_and(|a| a != target) {
                        tracing::info!(model = %q.model, control = %target, "the control plane that took held requests' demand is gone or no longer best placed; asking another");
                        q.ask_again.notify_one();
                    }
                }
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

    /// `m` failed `failures` times in a row, its next try in `retry_in_ms`,
    /// a start measured at 10 s, and a hold limit of 60 s.
    fn failed(failures: u32, retry_in_ms: i64) -> siesta_proto::v1::ModelStatus {
        let mut s = status("m", ModelState::Failed, &[]);
        s.failures = failures;
        s.retry_at_unix_ms = now_unix_ms() + retry_in_ms;
        s.last_error = "engine exited (signal 9)".into();
        s.calibration = Some(siesta_proto::v1::Calibration {
            start_ms: 10_000,
            start_samples: 1,
            ..Default::default()
        });
        s.hold = Some(HoldPolicy {
            max_hold_ms: 60_000,
            ..Default::default()
        });
        s
    }

    fn route(s: siesta_proto::v1::ModelStatus) -> Arc<ModelRoute> {
        let table = RouteTable::new(Arc::new(Activity::default()));
        table.apply(&Arc::from("http://c"), snapshot(1, vec![s]));
        table.view().by_name["m"].clone()
    }

    /// A first failure is waited through when its next try and a start fit
    /// in the hold left; a second in a row, or a wait that outlasts the
    /// hold, is answered at once with the time to the next try.
    #[test]
    fn a_first_failure_is_held_through_and_a_second_answered() {
        let first = route(failed(1, 2_000));
        // After the routes are made: their next tries are 2 s away or less.
        let now = now_unix_ms() + 1;
        assert!(failed_answer(&first, now, 60_000).is_none());
        // Its next try (2 s) and a start (10 s) do not fit in 11 s.
        let Some(ApiError::Shed {
            reason,
            retry_after_s,
            message,
        }) = failed_answer(&first, now, 11_000)
        else {
            panic!("a wait past the hold was held");
        };
        assert_eq!((reason, retry_after_s), (ShedReason::Failed, Some(2)));
        assert!(
            message.contains("outlast this request's hold (11000 ms left"),
            "{message}"
        );
        let again = route(failed(2, 4_000));
        let now = now_unix_ms() + 1;
        let Some(ApiError::Shed {
            retry_after_s,
            message,
            ..
        }) = failed_answer(&again, now, 60_000)
        else {
            panic!("a model failing again was held");
        };
        assert_eq!(retry_after_s, Some(4));
        assert!(
            message.contains("failed 2 times in a row (engine exited (signal 9))"),
            "{message}"
        );
        // A try under way (its time come) is waited for as any start.
        assert!(failed_answer(&route(failed(5, -1)), now, 60_000).is_none());
        assert!(failed_answer(&route(status("m", ModelState::Asleep, &[])), now, 0).is_none());
    }

    /// Requests held when the model fails once stay held (its retry comes
    /// within their hold); when it fails again they are answered at once,
    /// 503 with the time to its next try, not at `max_hold`.
    #[tokio::test]
    async fn held_requests_wait_through_a_first_failure_and_not_a_second() {
        let (holds, _) = stale_route(|table, src| {
            let mut s = failed(0, 0);
            s.state = ModelState::Asleep as i32;
            table.apply(src, snapshot(2, vec![s]));
        });
        let table = holds.table.clone();
        let src: SourceId = Arc::from("http://c");
        let asleep = table.view().by_name["m"].clone();
        let mut tickets: Vec<Ticket> = (0..3)
            .map(|_| holds.admit(&asleep, Instant::now()).unwrap())
            .collect();
        assert!(table.apply(&src, event(3, failed(1, 2_000))));
        holds.on_view(&table.view());
        assert_eq!(
            holds.depth("m"),
            3,
            "a first failure answered held requests"
        );
        assert!(table.apply(&src, event(4, failed(2, 4_000))));
        holds.on_view(&table.view());
        assert_eq!(holds.depth("m"), 0);
        for t in &mut tickets {
            let waited = t.wait(Instant::now() + Duration::from_secs(5), None).await;
            let Wait::Released(Release::Fail(ApiError::Shed {
                reason,
                retry_after_s,
                ..
            })) = waited
            else {
                panic!("{waited:?}");
            };
            assert_eq!((reason, retry_after_s), (ShedReason::Failed, Some(4)));
        }
    }
}
