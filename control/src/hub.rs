//! The Watch hub: a revision counter, the current picture, a bounded
//! history of changes, and subscribers that each get a bounded channel. A
//! subscriber that falls behind is cut off and resynced with a snapshot, so
//! it never blocks the publisher or other subscribers.
//!
//! With an encoder set ([`Hub::set_encoder`]), every published item is
//! encoded once, as it is published, and every gRPC subscriber sends those
//! same shared bytes ([`WatchItem::wire`]) instead of encoding it again.

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
}

/// The whole picture at a revision.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub models: Vec<ModelStatus>,
    pub gpus: Option<Arc<GpuList>>,
    pub placement: Option<Arc<PlacementReport>>,
    pub resync: bool,
}

/// One Watch message.
#[derive(Debug, Clone)]
pub struct WatchItem {
    pub revision: u64,
    pub at_unix_ms: i64,
    pub body: Body,
    /// The encoded wire form, made once (at publish, or by the first
    /// subscriber for a snapshot) and shared by every subscriber.
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

/// Turns an item into its wire form (the daemon's gRPC encoding).
pub struct Encoder(Box<dyn Fn(&WatchItem) -> Bytes + Send + Sync>);

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Encoder")
    }
}

#[derive(Debug)]
struct Inner {
    revision: u64,
    history: VecDeque<Arc<WatchItem>>,
    models: BTreeMap<String, ModelStatus>,
    gpus: Option<Arc<GpuList>>,
    placement: Option<Arc<PlacementReport>>,
    subscribers: Vec<mpsc::Sender<Arc<WatchItem>>>,
    closed: bool,
}

/// Shared by every model task and every Watch stream.
#[derive(Debug)]
pub struct Hub {
    inner: Mutex<Inner>,
    history_cap: usize,
    channel_cap: usize,
    clock: Clock,
    encoder: OnceLock<Encoder>,
}

/// One subscriber: catch-up items first, then the live channel; resynced
/// with a fresh snapshot when the hub cut it off.
#[derive(Debug)]
pub struct Subscription {
    hub: Arc<Hub>,
    pending: VecDeque<Arc<WatchItem>>,
    rx: mpsc::Receiver<Arc<WatchItem>>,
}

impl Subscription {
    /// The next item; `None` once the hub is closed.
    pub async fn next(&mut self) -> Option<Arc<WatchItem>> {
        if let Some(item) = self.pending.pop_front() {
            return Some(item);
        }
        match self.rx.recv().await {
            Some(item) => Some(item),
            None => {
                // Cut off (fell behind) or closed.
                let fresh = self.hub.subscribe_inner(None, true)?;
                *self = fresh;
                self.pending.pop_front()
            }
        }
    }
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
                subscribers: Vec::new(),
                closed: false,
            }),
            history_cap: history_cap.max(1),
            channel_cap: channel_cap.max(1),
            clock,
            encoder: OnceLock::new(),
        })
    }

    /// Sets how items are encoded for the wire (once; later calls are
    /// ignored). From then on every published item is encoded at publish.
    pub fn set_encoder(&self, f: impl Fn(&WatchItem) -> Bytes + Send + Sync + 'static) {
        let _ = self.encoder.set(Encoder(Box::new(f)));
    }

    /// The item's wire form: the bytes made at publish, shared by every
    /// subscriber (a snapshot, made per subscriber, is encoded on first
    /// use). `None` when no encoder is set.
    pub fn wire(&self, item: &WatchItem) -> Option<Bytes> {
        let enc = self.encoder.get()?;
        Some(item.wire.get_or_init(|| (enc.0)(item)).clone())
    }

    fn publish(&self, inner: &mut Inner, body: Body) -> u64 {
        inner.revision += 1;
        let item = WatchItem::new(inner.revision, self.clock.now_ms(), body);
        if let Some(enc) = self.encoder.get() {
            let _ = item.wire.set((enc.0)(&item));
        }
        let item = Arc::new(item);
        if inner.history.len() == self.history_cap {
            inner.history.pop_front();
        }
        inner.history.push_back(item.clone());
        // A full or closed channel drops the subscriber; a full one then
        // resyncs from a snapshot when it has drained what it holds.
        inner
            .subscribers
            .retain(|tx| tx.try_send(item.clone()).is_ok());
        inner.revision
    }

    /// Publishes a model's status if it differs from the last one.
    pub fn publish_model(&self, status: ModelStatus) {
        let mut inner = self.inner.lock().unwrap();
        if inner.closed || inner.models.get(&status.name) == Some(&status) {
            return;
        }
        inner.models.insert(status.name.clone(), status.clone());
        self.publish(&mut inner, Body::Model(Box::new(status)));
    }

    pub fn remove_model(&self, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        if inner.models.remove(name).is_some() {
            self.publish(&mut inner, Body::ModelRemoved(name.to_string()));
        }
    }

    pub fn set_gpus(&self, gpus: GpuList) {
        let mut inner = self.inner.lock().unwrap();
        if inner.gpus.as_deref() != Some(&gpus) {
            let gpus = Arc::new(gpus);
            inner.gpus = Some(gpus.clone());
            self.publish(&mut inner, Body::Gpus(gpus));
        }
    }

    pub fn set_placement(&self, placement: PlacementReport) {
        let mut inner = self.inner.lock().unwrap();
        if inner.placement.as_deref() != Some(&placement) {
            let p = Arc::new(placement);
            inner.placement = Some(p.clone());
            self.publish(&mut inner, Body::Placement(p));
        }
    }

    /// Current statuses and the revision they are consistent with.
    pub fn models(&self) -> (Vec<ModelStatus>, u64) {
        let inner = self.inner.lock().unwrap();
        (inner.models.values().cloned().collect(), inner.revision)
    }

    pub fn revision(&self) -> u64 {
        self.inner.lock().unwrap().revision
    }

    /// Ends every subscription.
    pub fn close(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.closed = true;
        inner.subscribers.clear();
    }

    /// Subscribes: `since_revision` 0 starts with a snapshot; otherwise the
    /// events after it, or a resync snapshot when they are gone.
    pub fn subscribe(self: &Arc<Self>, since_revision: u64) -> Option<Subscription> {
        self.subscribe_inner((since_revision > 0).then_some(since_revision), false)
    }

    fn subscribe_inner(self: &Arc<Self>, since: Option<u64>, resync: bool) -> Option<Subscription> {
        let mut inner = self.inner.lock().unwrap();
        if inner.closed {
            return None;
        }
        let oldest = inner
            .history
            .front()
            .map_or(inner.revision + 1, |i| i.revision);
        let pending: VecDeque<Arc<WatchItem>> = match since {
            Some(s) if s <= inner.revision && s + 1 >= oldest => inner
                .history
                .iter()
                .filter(|i| i.revision > s)
                .cloned()
                .collect(),
            _ => {
                let resync = resync || since.is_some();
                VecDeque::from([Arc::new(WatchItem::new(
                    inner.revision,
                    self.clock.now_ms(),
                    Body::Snapshot(Snapshot {
                        models: inner.models.values().cloned().collect(),
                        gpus: inner.gpus.clone(),
                        placement: inner.placement.clone(),
                        resync,
                    }),
                ))])
            }
        };
        let (tx, rx) = mpsc::channel(self.channel_cap);
        inner.subscribers.push(tx);
        Some(Subscription {
            hub: self.clone(),
            pending,
            rx,
        })
    }
}

#[cfg(test)]
mod tests;
