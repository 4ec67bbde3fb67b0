//! The Watch hub: a revision counter, the current picture, a bounded
//! history of changes, and subscribers that each get a bounded channel. A
//! subscriber that falls behind is cut off and resynced with a snapshot, so
//! it never blocks the publisher or other subscribers.
//!
//! With an encoder set ([`Hub::set_encoder`]), every published item is
//! encoded once, as it is published, and every gRPC subscriber sends those
//! same shared bytes ([`WatchItem::wire`]) instead of encoding it again.
//! The hub also keeps each model's status, the GPU list and the placement
//! encoded, so a snapshot or a `ListModels` answer at 1,000 models is a
//! concatenation of kept bytes, not 1,000 conversions ([`Hub::models_wire`]).

use crate::gpu_view::{GpuList, PlacementReport};
use crate::status::{Clock, ModelStatus};
use bytes::Bytes;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::mpsc;

/// What changed.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    Snapshot(Snapshot),
    Model(Box<ModelStatus>),
    ModelRemoved(String),
    Gpus(Arc<GpuList>),
    Placement(Arc<PlacementReport>),
    /// Nothing changed; the next message comes within this long. Only to
    /// subscribers that asked ([`Hub::subscribe_with_heartbeats`]), never
    /// kept in the history.
    Heartbeat(std::time::Duration),
}

/// How long a stream that asked for heartbeats may go without a message:
/// after this long with nothing published, the fan-out task sends each
/// such subscriber a heartbeat. Far inside the proxy's patience (three
/// of these), far above what a few hundred subscribers cost per beat.
pub const HEARTBEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// The whole picture at a revision.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub models: Vec<Arc<ModelStatus>>,
    pub gpus: Option<Arc<GpuList>>,
    pub placement: Option<Arc<PlacementReport>>,
    pub resync: bool,
    /// The same parts already encoded (with an encoder set).
    pub wire: Option<SnapshotWire>,
}

/// A snapshot's parts in their wire form, kept by the hub as they were
/// published: each model (in the order of [`Snapshot::models`]), the GPU
/// list and the placement.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotWire {
    pub models: Vec<Bytes>,
    pub gpus: Option<Bytes>,
    pub placement: Option<Bytes>,
}

/// One Watch message.
#[derive(Debug, Clone)]
pub struct WatchItem {
    pub revision: u64,
    pub at_unix_ms: i64,
    pub body: Body,
    /// The encoded wire form (as a `Watch` stream sends it), made once (at
    /// publish, or by the first subscriber for a snapshot) and shared by
    /// every subscriber.
    wire: OnceLock<Bytes>,
}

/// Equal when the message is: the cached encoding is not part of it.
impl PartialEq for WatchItem {
    fn eq(&self, other: &Self) -> bool {
        self.revision == other.revision
            && self.at_unix_ms == other.at_unix_ms
            && self.body == other.body
    }
}

impl WatchItem {
    pub fn new(revision: u64, at_unix_ms: i64, body: Body) -> WatchItem {
        WatchItem {
            revision,
            at_unix_ms,
            body,
            wire: OnceLock::new(),
        }
    }
}

/// The wire form of the hub's values (the daemon's gRPC encoding).
pub trait Wire: Send + Sync {
    /// A whole message, as a `Watch` stream sends it (the daemon's: one
    /// gRPC message frame). `part` is the body already encoded by [`Wire::model`],
    /// [`Wire::gpus`] or [`Wire::placement`] for such an event; a snapshot
    /// carries its parts in [`Snapshot::wire`].
    fn item(&self, item: &WatchItem, part: Option<&Bytes>) -> Bytes;
    fn model(&self, status: &ModelStatus) -> Bytes;
    fn gpus(&self, gpus: &GpuList) -> Bytes;
    fn placement(&self, placement: &PlacementReport) -> Bytes;
}

struct Encoder(Box<dyn Wire>);

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Encoder")
    }
}

#[derive(Debug)]
struct Inner {
    revision: u64,
    history: VecDeque<Arc<WatchItem>>,
    models: BTreeMap<String, Arc<ModelStatus>>,
    gpus: Option<Arc<GpuList>>,
    placement: Option<Arc<PlacementReport>>,
    /// With an encoder: every model's status, the GPUs and the placement
    /// encoded, as last published.
    models_wire: BTreeMap<String, Bytes>,
    gpus_wire: Option<Bytes>,
    placement_wire: Option<Bytes>,
    subscribers: Vec<Sub>,
    /// The last revision handed to the subscribers (see fan_out.rs).
    fanned: u64,
    closed: bool,
    /// Subscriptions ended: by [`Hub::end_subscriptions`] (publishing goes
    /// on) or by [`Hub::close`].
    unsubscribed: bool,
}

/// A subscriber's channel and the first revision it still needs.
#[derive(Debug)]
struct Sub {
    tx: mpsc::Sender<Arc<WatchItem>>,
    next: u64,
    /// Asked for heartbeats.
    heartbeat: bool,
}

/// Shared by every model task and every Watch stream.
#[derive(Debug)]
pub struct Hub {
    inner: Mutex<Inner>,
    history_cap: usize,
    channel_cap: usize,
    clock: Clock,
    encoder: OnceLock<Encoder>,
    /// Set by [`Hub::spawn_fan_out`]: `publish` only wakes the fan-out task.
    fan_out: OnceLock<Arc<tokio::sync::Notify>>,
    /// When the fan-out task last finished a round (it makes one at least
    /// every [`HEARTBEAT_EVERY`]); kept outside `inner`, so it can be read
    /// while that lock is held for ever.
    fanned_at: Mutex<Option<tokio::time::Instant>>,
}

impl Hub {
    pub fn new(clock: Clock, history_cap: usize, channel_cap: usize) -> Arc<Hub> {
        Arc::new(Hub {
            inner: Mutex::new(Inner {
                revision: 0,
                history: VecDeque::new(),
                models: BTreeMap::new(),
                gpus: None,
                placement: None,
                models_wire: BTreeMap::new(),
                gpus_wire: None,
                placement_wire: None,
                subscribers: Vec::new(),
                fanned: 0,
                closed: false,
                unsubscribed: false,
            }),
            history_cap: history_cap.max(1),
            channel_cap: channel_cap.max(1),
            clock,
            encoder: OnceLock::new(),
            fan_out: OnceLock::new(),
            fanned_at: Mutex::new(None),
        })
    }

    /// Sets how values are encoded for the wire (once, before anything is
    /// published; later calls are ignored). From then on every published
    /// item is encoded at publish.
    pub fn set_encoder(&self, wire: impl Wire + 'static) {
        let _ = self.encoder.set(Encoder(Box::new(wire)));
    }

    fn enc(&self) -> Option<&dyn Wire> {
        self.encoder.get().map(|e| &*e.0)
    }

    /// The item's wire form: the bytes made at publish, shared by every
    /// subscriber (a snapshot, made per subscriber, is encoded on first
    /// use, from the parts the hub keeps encoded). `None` when no encoder
    /// is set.
    pub fn wire(&self, item: &WatchItem) -> Option<Bytes> {
        let enc = self.enc()?;
        Some(item.wire.get_or_init(|| enc.item(item, None)).clone())
    }

    /// Every model's encoded status (by name) and the revision they are
    /// consistent with; `None` when no encoder is set (or it was set after
    /// models were published).
    pub fn models_wire(&self) -> Option<(Vec<Bytes>, u64)> {
        let inner = self.inner.lock().unwrap();
        self.enc()?;
        (inner.models_wire.len() == inner.models.len()).then(|| {
            (
                inner.models_wire.values().cloned().collect(),
                inner.revision,
            )
        })
    }

    /// A heartbeat at `revision`, encoded once for every subscriber.
    fn heartbeat(&self, revision: u64) -> WatchItem {
        let item = WatchItem::new(
            revision,
            self.clock.now_ms(),
            Body::Heartbeat(HEARTBEAT_EVERY),
        );
        if let Some(enc) = self.enc() {
            let _ = item.wire.set(enc.item(&item, None));
        }
        item
    }

    fn publish(&self, inner: &mut Inner, body: Body, part: Option<&Bytes>) -> u64 {
        inner.revision += 1;
        let item = WatchItem::new(inner.revision, self.clock.now_ms(), body);
        if let Some(enc) = self.enc() {
            let _ = item.wire.set(enc.item(&item, part));
        }
        let item = Arc::new(item);
        if inner.history.len() == self.history_cap {
            inner.history.pop_front();
        }
        inner.history.push_back(item.clone());
        match self.fan_out.get() {
            // The fan-out task hands it to every subscriber.
            Some(wake) => wake.notify_one(),
            None => {
                inner.fanned = inner.revision;
                send(&mut inner.subscribers, std::slice::from_ref(&item));
            }
        }
        inner.revision
    }

    /// Publishes a model's status if it differs from the last one.
    pub fn publish_model(&self, status: ModelStatus) {
        let mut inner = self.inner.lock().unwrap();
        if inner.closed || inner.models.get(&status.name).map(|s| &**s) == Some(&status) {
            return;
        }
        let part = self.enc().map(|enc| enc.model(&status));
        if let Some(part) = &part {
            inner.models_wire.insert(status.name.clone(), part.clone());
        }
        inner
            .models
            .insert(status.name.clone(), Arc::new(status.clone()));
        self.publish(&mut inner, Body::Model(Box::new(status)), part.as_ref());
    }

    pub fn remove_model(&self, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        if inner.models.remove(name).is_some() {
            inner.models_wire.remove(name);
            self.publish(&mut inner, Body::ModelRemoved(name.to_string()), None);
        }
    }

    pub fn set_gpus(&self, gpus: GpuList) {
        let mut inner = self.inner.lock().unwrap();
        if inner.gpus.as_deref() != Some(&gpus) {
            inner.gpus_wire = self.enc().map(|enc| enc.gpus(&gpus));
            let part = inner.gpus_wire.clone();
            let gpus = Arc::new(gpus);
            inner.gpus = Some(gpus.clone());
            self.publish(&mut inner, Body::Gpus(gpus), part.as_ref());
        }
    }

    pub fn set_placement(&self, placement: PlacementReport) {
        let mut inner = self.inner.lock().unwrap();
        if inner.placement.as_deref() != Some(&placement) {
            inner.placement_wire = self.enc().map(|enc| enc.placement(&placement));
            let part = inner.placement_wire.clone();
            let p = Arc::new(placement);
            inner.placement = Some(p.clone());
            self.publish(&mut inner, Body::Placement(p), part.as_ref());
        }
    }

    /// Current statuses and the revision they are consistent with.
    pub fn models(&self) -> (Vec<ModelStatus>, u64) {
        let inner = self.inner.lock().unwrap();
        (
            inner.models.values().map(|s| (**s).clone()).collect(),
            inner.revision,
        )
    }

    pub fn revision(&self) -> u64 {
        self.inner.lock().unwrap().revision
    }

    /// Ends every subscription and refuses new ones; publishing goes on
    /// (at shutdown the streams end first, the models' last states are
    /// still recorded). Streams need no wait of their own for shutdown.
    pub fn end_subscriptions(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.unsubscribed = true;
        inner.subscribers.clear();
    }

    /// Ends every subscription, and publishing.
    pub fn close(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.closed = true;
        inner.unsubscribed = true;
        inner.subscribers.clear();
        if let Some(wake) = self.fan_out.get() {
            wake.notify_one();
        }
    }
}

mod fan_out;
mod subscription;
use fan_out::send;
pub use subscription::Subscription;

#[cfg(test)]
mod tests;
