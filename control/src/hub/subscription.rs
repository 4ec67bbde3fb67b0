//! Subscribing to the hub: a snapshot (or the kept events after a
//! revision), then the live channel, resynced with a fresh snapshot when
//! the subscriber fell behind; with heartbeats for those that ask.

use super::{Body, Hub, Snapshot, SnapshotWire, Sub, WatchItem};
use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use tokio::sync::mpsc;

/// One subscriber: catch-up items first, then the live channel; resynced
/// with a fresh snapshot when the hub cut it off.
#[derive(Debug)]
pub struct Subscription {
    hub: Arc<Hub>,
    pending: VecDeque<Arc<WatchItem>>,
    rx: mpsc::Receiver<Arc<WatchItem>>,
    heartbeat: bool,
}

impl Subscription {
    /// The next item; `None` once the hub is closed.
    pub async fn next(&mut self) -> Option<Arc<WatchItem>> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// [`Subscription::next`] as a poll (for a response body that is
    /// polled, not awaited).
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Arc<WatchItem>>> {
        if let Some(item) = self.pending.pop_front() {
            return Poll::Ready(Some(item));
        }
        match ready!(self.rx.poll_recv(cx)) {
            Some(item) => Poll::Ready(Some(item)),
            None => {
                // Cut off (fell behind) or closed.
                let Some(fresh) = self.hub.subscribe_inner(None, true, self.heartbeat) else {
                    return Poll::Ready(None);
                };
                *self = fresh;
                Poll::Ready(self.pending.pop_front())
            }
        }
    }
}

impl Hub {
    /// Subscribes: `since_revision` 0 starts with a snapshot; otherwise the
    /// events after it, or a resync snapshot when they are gone.
    pub fn subscribe(self: &Arc<Self>, since_revision: u64) -> Option<Subscription> {
        self.subscribe_inner((since_revision > 0).then_some(since_revision), false, false)
    }

    /// [`Hub::subscribe`], with a heartbeat after the snapshot or the
    /// catch-up items, and whenever nothing was published for
    /// [`HEARTBEAT_EVERY`] (with the fan-out task: [`Hub::spawn_fan_out`]).
    /// A client can then tell a live event path from a wedged one whose
    /// connection still answers pings.
    pub fn subscribe_with_heartbeats(
        self: &Arc<Self>,
        since_revision: u64,
    ) -> Option<Subscription> {
        self.subscribe_inner((since_revision > 0).then_some(since_revision), false, true)
    }

    /// Subscribes with a snapshot marked `resync`: for a client whose
    /// resume point cannot be placed in this process's history (the web
    /// listener's ids of an earlier incarnation), so it replaces what it
    /// holds rather than applying the events after a revision that means
    /// something else here.
    pub fn subscribe_resync(self: &Arc<Self>, heartbeat: bool) -> Option<Subscription> {
        self.subscribe_inner(None, true, heartbeat)
    }

    fn subscribe_inner(
        self: &Arc<Self>,
        since: Option<u64>,
        resync: bool,
        heartbeat: bool,
    ) -> Option<Subscription> {
        let mut inner = self.inner.lock().unwrap();
        if inner.unsubscribed {
            return None;
        }
        let oldest = inner
            .history
            .front()
            .map_or(inner.revision + 1, |i| i.revision);
        let mut pending: VecDeque<Arc<WatchItem>> = match since {
            Some(s) if s <= inner.revision && s + 1 >= oldest => inner
                .history
                .iter()
                .filter(|i| i.revision > s)
                .cloned()
                .collect(),
            _ => {
                let resync = resync || since.is_some();
                // The parts as kept, when every one is (an encoder set
                // after models were published leaves some out).
                let wire = (self.enc().is_some()
                    && inner.models_wire.len() == inner.models.len()
                    && inner.gpus_wire.is_some() == inner.gpus.is_some()
                    && inner.placement_wire.is_some() == inner.placement.is_some())
                .then(|| SnapshotWire {
                    models: inner.models_wire.values().cloned().collect(),
                    gpus: inner.gpus_wire.clone(),
                    placement: inner.placement_wire.clone(),
                });
                VecDeque::from([Arc::new(WatchItem::new(
                    inner.revision,
                    self.clock.now_ms(),
                    Body::Snapshot(Snapshot {
                        models: inner.models.values().cloned().collect(),
                        gpus: inner.gpus.clone(),
                        placement: inner.placement.clone(),
                        resync,
                        wire,
                    }),
                ))])
            }
        };
        if heartbeat {
            pending.push_back(Arc::new(self.heartbeat(inner.revision)));
        }
        let (tx, rx) = mpsc::channel(self.channel_cap);
        // Everything up to now is in the snapshot or in `pending`.
        let next = inner.revision + 1;
        inner.subscribers.push(Sub {
            tx,
            next,
            heartbeat,
        });
        Some(Subscription {
            hub: self.clone(),
            pending,
            rx,
            heartbeat,
        })
    }
}
