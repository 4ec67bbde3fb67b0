//! The route table: what every control plane last said about its models,
//! merged into one immutable [`View`] that requests read without locking.
//! A snapshot replaces one control plane's part, events update it; a model
//! served by several control planes gets the endpoints of all of them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
// tokio's clock, so tests can drive the suspect window under paused time.
use tokio::time::Instant;

use http::uri::{Authority, Scheme};
use siesta_proto::v1::{
    DesiredState, HoldPolicy, IntentReason, ModelState, ModelStatus, WatchEvent, watch_event,
};
use tokio::sync::watch;

use crate::activity::{Activity, ActivityCounters};

/// Identity of one watched control plane address, e.g. "http://10.0.0.5:50051".
pub type SourceId = Arc<str>;

/// Hold policy used when a control plane sends none.
pub const DEFAULT_MAX_QUEUE: u32 = 128;
pub const DEFAULT_MAX_HOLD_MS: u64 = 60_000;

/// One engine endpoint requests can go to. Lives across table rebuilds so its
/// outstanding-request count stays right.
#[derive(Debug)]
pub struct Upstream {
    pub url: String,
    pub scheme: Scheme,
    pub authority: Authority,
    pub served_name: String,
    pub model: Arc<str>,
    pub source: SourceId,
    pub outstanding: AtomicU32,
    /// Monotonic ms (since `epoch()`) until which the endpoint is avoided
    /// after refusing a connection; 0: fine.
    suspect_until_ms: AtomicU64,
    pub activity: Arc<ActivityCounters>,
    /// The forwarder's pool, slots and metrics for this endpoint, resolved
    /// on its first request.
    pub handles: std::sync::OnceLock<crate::forward::UpstreamHandles>,
}

fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn mono_ms() -> u64 {
    epoch().elapsed().as_millis() as u64 + 1
}

impl Upstream {
    pub fn is_suspect(&self) -> bool {
        let until = self.suspect_until_ms.load(Ordering::Relaxed);
        until != 0 && mono_ms() < until
    }

    /// Avoid this endpoint for `ms` after a refused connection.
    pub fn mark_suspect(&self, ms: u64) {
        self.suspect_until_ms
            .store(mono_ms() + ms, Ordering::Relaxed);
    }
}

/// Everything the proxy knows about one model, merged over control planes.
#[derive(Debug)]
pub struct ModelRoute {
    pub name: Arc<str>,
    pub aliases: Vec<String>,
    /// AWAKE when any control plane has it awake with endpoints; otherwise
    /// the state of `status`.
    pub state: ModelState,
    /// Endpoints of the control planes that have the model awake.
    pub endpoints: Vec<Arc<Upstream>>,
    pub max_queue: u32,
    pub max_hold_ms: u64,
    /// The status of the control plane best placed to serve the model soon
    /// (awake, then waking, starting, asleep L1, ...): Demand goes there.
    pub status: ModelStatus,
    /// Every control plane that has the model, best first.
    pub sources: Vec<SourceId>,
    rr: AtomicUsize,
}

impl ModelRoute {
    pub fn is_awake(&self) -> bool {
        self.state == ModelState::Awake && !self.endpoints.is_empty()
    }

    /// An operator stopped it (and its control plane refuses demand until
    /// an operator starts or wakes it again). `status` is the best-placed
    /// control plane's: true only when none has the model in a better state.
    pub fn stopped_by_operator(&self) -> bool {
        self.status.intent.as_ref().is_some_and(|i| {
            i.desired() == DesiredState::Stopped && i.reason() == IntentReason::Operator
        })
    }

    /// The endpoint with the fewest outstanding requests, skipping suspects;
    /// ties go round-robin.
    pub fn pick(&self) -> Option<&Arc<Upstream>> {
        let n = self.endpoints.len();
        if n == 1 {
            let e = &self.endpoints[0];
            return (!e.is_suspect()).then_some(e);
        }
        let start = self.rr.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(&Arc<Upstream>, u32)> = None;
        for i in 0..n {
            let e = &self.endpoints[(start + i) % n];
            if e.is_suspect() {
                continue;
            }
            let o = e.outstanding.load(Ordering::Relaxed);
            if best.is_none_or(|(_, b)| o < b) {
                best = Some((e, o));
            }
        }
        best.map(|(e, _)| e)
    }
}

/// One immutable picture of all models; replaced on every change.
#[derive(Debug, Default)]
pub struct View {
    /// At least one snapshot has been applied.
    pub ready: bool,
    /// A watched control plane address has sent no snapshot yet: a model
    /// only it has is not in the view, though it exists.
    pub unsynced: bool,
    /// Control plane addresses whose Watch stream is down (their models
    /// are routed from their last table meanwhile).
    pub lost: std::collections::BTreeSet<SourceId>,
    /// Names and aliases to routes. Looked up twice per request with the
    /// client's model name: foldhash, not SipHash (the keys come from the
    /// control planes, so no client can crowd one bucket).
    pub by_name: HashMap<String, Arc<ModelRoute>, foldhash::fast::RandomState>,
    /// Every model once, sorted by name.
    pub models: Vec<Arc<ModelRoute>>,
}

#[derive(Debug, Default)]
struct SourceState {
    models: BTreeMap<String, ModelStatus>,
    revision: u64,
    synced: bool,
    /// Its Watch stream is down (it was up before).
    lost: bool,
    /// (`--control` value, control_id, started_unix_ms): two addresses of one
    /// name that reach the same process count once.
    identity: Option<(String, String, i64)>,
}

#[derive(Debug, Default)]
struct TableState {
    sources: BTreeMap<SourceId, SourceState>,
    upstreams: HashMap<(SourceId, String, String), Arc<Upstream>>,
}

/// The mutable side of the table; publishes [`View`]s on a watch channel.
#[derive(Debug)]
pub struct RouteTable {
    state: Mutex<TableState>,
    view: watch::Sender<Arc<View>>,
    activity: Arc<Activity>,
    /// When the proxy started (its first snapshots are due).
    created: tokio::time::Instant,
}

fn rank(s: &ModelStatus) -> u32 {
    match s.state() {
        ModelState::Awake if !s.endpoints.is_empty() => 0,
        ModelState::Waking => 1,
        ModelState::Starting => 2,
        ModelState::Asleep if s.sleep_level <= 1 => 3,
        ModelState::Asleep => 4,
        ModelState::Suspended => 5,
        ModelState::Sleeping => 6,
        ModelState::Suspending => 7,
        ModelState::Awake => 8,
        ModelState::Stopped => 9,
        ModelState::Stopping => 10,
        ModelState::Failed => 11,
        ModelState::Unspecified => 12,
    }
}

impl RouteTable {
    pub fn new(activity: Arc<Activity>) -> Self {
        let (view, _) = watch::channel(Arc::new(View::default()));
        RouteTable {
            state: Mutex::new(TableState::default()),
            view,
            activity,
            created: tokio::time::Instant::now(),
        }
    }

    /// When the table was made, at the proxy's start.
    pub fn created(&self) -> tokio::time::Instant {
        self.created
    }

    /// `source` is watched from now on: until its first snapshot the view
    /// says so ([`View::unsynced`]).
    pub fn expect(&self, source: &SourceId) {
        let mut st = self.state.lock().unwrap();
        if !st.sources.contains_key(source) {
            st.sources.insert(source.clone(), SourceState::default());
            self.rebuild(&mut st);
        }
    }

    /// The current view (cheap: one lock and one `Arc` clone).
    pub fn view(&self) -> Arc<View> {
        self.view.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<View>> {
        self.view.subscribe()
    }

    /// The last revision applied from `source` (0: none).
    pub fn revision(&self, source: &SourceId) -> u64 {
        let st = self.state.lock().unwrap();
        st.sources.get(source).map_or(0, |s| s.revision)
    }

    /// Applies one Watch message from `source`. Returns false for an event
    /// that is older than what was already applied (ignored).
    pub fn apply(&self, source: &SourceId, ev: WatchEvent) -> bool {
        let mut st = self.state.lock().unwrap();
        let src = st.sources.entry(source.clone()).or_default();
        match ev.kind {
            Some(watch_event::Kind::Snapshot(snap)) => {
                src.models = snap
                    .models
                    .into_iter()
                    .map(|m| (m.name.clone(), m))
                    .collect();
                src.synced = true;
                src.revision = ev.revision;
            }
            Some(kind) => {
                if !src.synced || ev.revision <= src.revision {
                    return false;
                }
                src.revision = ev.revision;
                match kind {
                    watch_event::Kind::Model(m) => {
                        src.models.insert(m.name.clone(), m);
                    }
                    watch_event::Kind::ModelRemoved(name) => {
                        src.models.remove(&name);
                    }
                    // GPU inventory and placement do not affect routing.
                    _ => return true,
                }
            }
            None => return true,
        }
        self.rebuild(&mut st);
        true
    }

    /// Records which control plane process answers at `source`.
    pub fn set_identity(&self, source: &SourceId, identity: (String, String, i64)) {
        let mut st = self.state.lock().unwrap();
        st.sources.entry(source.clone()).or_default().identity = Some(identity);
    }

    /// Whether `source`'s snapshot has been applied.
    pub fn synced(&self, source: &SourceId) -> bool {
        let st = self.state.lock().unwrap();
        st.sources.get(source).is_some_and(|s| s.synced)
    }

    /// Records whether `source`'s Watch stream is down (a source already
    /// forgotten stays forgotten).
    pub fn set_lost(&self, source: &SourceId, lost: bool) {
        let mut st = self.state.lock().unwrap();
        if let Some(src) = st.sources.get_mut(source)
            && src.lost != lost
        {
            src.lost = lost;
            self.rebuild(&mut st);
        }
    }

    /// Forgets a control plane (its address left DNS), its activity
    /// counters with it.
    pub fn remove_source(&self, source: &SourceId) {
        let mut st = self.state.lock().unwrap();
        if st.sources.remove(source).is_some() {
            self.rebuild(&mut st);
            self.activity.forget(source);
        }
    }

    fn rebuild(&self, st: &mut TableState) {
        let ready = st.sources.values().any(|s| s.synced);
        let unsynced = st.sources.values().any(|s| !s.synced);
        let lost = st
            .sources
            .iter()
            .filter(|(_, s)| s.lost)
            .map(|(id, _)| id.clone())
            .collect();
        // Group statuses by model name over all control planes.
        let mut grouped: BTreeMap<&str, Vec<(&SourceId, &ModelStatus)>> = BTreeMap::new();
        // Of the addresses that reach one control plane process, the one
        // furthest along counts: one whose watch broke keeps its last
        // snapshot, which the other's events leave behind (the first
        // address counted, frozen, and the live one's events were dropped).
        let mut furthest: HashMap<&(String, String, i64), (&SourceId, u64)> = HashMap::new();
        for (id, src) in &st.sources {
            if let Some(ident) = &src.identity
                && src.synced
            {
                let best = furthest.entry(ident).or_insert((id, src.revision));
                if src.revision > best.1 {
                    *best = (id, src.revision);
                }
            }
        }
        // One set of activity counters (fences, in-flight counts) per
        // process, reported through the address that counts (activity.rs).
        let mut members: HashMap<&(String, String, i64), Vec<SourceId>> = HashMap::new();
        for (id, src) in &st.sources {
            if let Some(ident) = &src.identity
                && src.synced
            {
                members.entry(ident).or_default().push(id.clone());
            }
        }
        self.activity.set_groups(
            members
                .into_iter()
                .filter(|(_, m)| m.len() > 1)
                .map(|(ident, m)| (m, furthest[ident].0.clone()))
                .collect(),
        );
        for (id, src) in &st.sources {
            if let Some(ident) = &src.identity
                && src.synced
                && furthest.get(ident).is_some_and(|(best, _)| *best != id)
            {
                continue; // another address of this control plane counts
            }
            for (name, m) in &src.models {
                grouped.entry(name.as_str()).or_default().push((id, m));
            }
        }
        let mut upstreams = HashMap::new();
        let mut by_name = HashMap::default();
        let mut models = Vec::with_capacity(grouped.len());
        for (name, mut statuses) in grouped {
            statuses.sort_by_key(|(id, s)| (rank(s), (*id).clone()));
            let name: Arc<str> = Arc::from(name);
            let mut endpoints = Vec::new();
            let mut aliases: Vec<String> = Vec::new();
            for (id, s) in &statuses {
                // Forwards are checked against this fence (activity.rs).
                let fence = if s.state() == ModelState::Awake {
                    0
                } else {
                    s.state_since_unix_ms.max(1)
                };
                let counters = self.activity.counters(id, &name);
                counters.set_fence(fence);
                for a in &s.aliases {
                    if !aliases.contains(a) {
                        aliases.push(a.clone());
                    }
                }
                if s.state() != ModelState::Awake {
                    continue;
                }
                for ep in &s.endpoints {
                    let served = if ep.served_model_name.is_empty() {
                        name.to_string()
                    } else {
                        ep.served_model_name.clone()
                    };
                    let key = ((*id).clone(), ep.url.clone(), served);
                    // Kept unless its counters are no longer the model's
                    // (its address joined a group of one process since).
                    let up = st
                        .upstreams
                        .get(&key)
                        .filter(|up| Arc::ptr_eq(&up.activity, &counters))
                        .cloned()
                        .or_else(|| new_upstream(&key, &name, &self.activity).map(Arc::new));
                    if let Some(up) = up {
                        upstreams.insert(key, up.clone());
                        endpoints.push(up);
                    }
                }
            }
            let best = statuses[0].1;
            let hold = best.hold.unwrap_or(HoldPolicy::default());
            let state = if !endpoints.is_empty() {
                ModelState::Awake
            } else if best.state() == ModelState::Awake {
                // Awake without endpoints: nothing to forward to yet.
                ModelState::Starting
            } else {
                best.state()
            };
            let route = Arc::new(ModelRoute {
                name: name.clone(),
                aliases,
                state,
                endpoints,
                max_queue: if hold.max_queue == 0 {
                    DEFAULT_MAX_QUEUE
                } else {
                    hold.max_queue
                },
                max_hold_ms: if hold.max_hold_ms == 0 {
                    DEFAULT_MAX_HOLD_MS
                } else {
                    hold.max_hold_ms
                },
                status: best.clone(),
                sources: statuses.iter().map(|(id, _)| (*id).clone()).collect(),
                rr: AtomicUsize::new(0),
            });
            for a in &route.aliases {
                by_name.entry(a.clone()).or_insert_with(|| route.clone());
            }
            by_name.insert(name.to_string(), route.clone());
            models.push(route);
        }
        st.upstreams = upstreams;
        self.view.send_replace(Arc::new(View {
            ready,
            unsynced,
            lost,
            by_name,
            models,
        }));
    }
}

fn new_upstream(
    key: &(SourceId, String, String),
    model: &Arc<str>,
    activity: &Activity,
) -> Option<Upstream> {
    let (source, url, served) = key;
    let uri: http::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => {
            tracing::warn!(%url, error = %e, "ignoring endpoint with invalid URL");
            return None;
        }
    };
    let parts = uri.into_parts();
    let (Some(scheme), Some(authority)) = (parts.scheme, parts.authority) else {
        tracing::warn!(%url, "ignoring endpoint URL without scheme and host");
        return None;
    };
    Some(Upstream {
        url: url.clone(),
        scheme,
        authority,
        served_name: served.clone(),
        model: model.clone(),
        source: source.clone(),
        outstanding: AtomicU32::new(0),
        suspect_until_ms: AtomicU64::new(0),
        activity: activity.counters(source, model),
        handles: Default::default(),
    })
}

#[cfg(test)]
pub(crate) mod tests;
