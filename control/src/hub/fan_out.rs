//! Handing published items to the subscribers.
//!
//! Without a fan-out task the publisher does it, under the hub's lock: one
//! `try_send` (and one task wake-up) per subscriber per item, on the
//! publishing reconciler's own thread — with 1,000 subscribers, 1,000
//! wake-ups inside every state transition. With [`Hub::spawn_fan_out`] the
//! publisher only appends to the history and wakes one task; that task,
//! on the runtime it was spawned on (the daemon puts it with the `Watch`
//! streams), takes the subscriber list out of the lock, sends every item
//! published since its last round to each subscriber (so a burst costs one
//! round), and puts the list back. Order per subscriber is the revision
//! order; a subscriber whose channel is full, or that missed items the
//! bounded history no longer holds, is dropped and resyncs from a snapshot.
//!
//! The same task sends the heartbeats: after [`HEARTBEAT_EVERY`] with
//! nothing published, a round hands each subscriber that asked for them
//! one heartbeat (encoded once), through the same lock, list and channels
//! as the events. So a heartbeat says the event path works, not only the
//! connection: a fan-out task that died (a panic under the hub's lock) or
//! a lock held for ever stops both. The daemon watches the same rounds
//! ([`Hub::fan_out_silent_for`]) and reports itself not serving on gRPC
//! health when they stop (`server/liveness.rs`).

use super::{HEARTBEAT_EVERY, Hub, Sub, WatchItem};
use std::sync::Arc;
use tokio::runtime::Handle;
use tokio::sync::Notify;

/// Sends `items` (in revision order) to every subscriber that still needs
/// them; drops the subscribers that cannot take them (full or closed).
pub(super) fn send(subs: &mut Vec<Sub>, items: &[Arc<WatchItem>]) {
    subs.retain_mut(|s| {
        let from = s.next;
        for item in items.iter().filter(|i| i.revision >= from) {
            if s.tx.try_send(item.clone()).is_err() {
                return false;
            }
            s.next = item.revision + 1;
        }
        true
    });
}

impl Hub {
    /// From now on items reach the subscribers through a task spawned on
    /// `rt`, off the publisher's path. Once; later calls do nothing.
    pub fn spawn_fan_out(self: &Arc<Self>, rt: &Handle) {
        let wake = Arc::new(Notify::new());
        if self.fan_out.set(wake.clone()).is_err() {
            return;
        }
        let hub = self.clone();
        let woken = wake.clone();
        *self.fanned_at.lock().unwrap() = Some(tokio::time::Instant::now());
        rt.spawn(async move {
            loop {
                // Quiet since the last round: the next one beats.
                let quiet = tokio::time::sleep(HEARTBEAT_EVERY);
                let beat = tokio::select! {
                    _ = woken.notified() => false,
                    _ = quiet => true,
                };
                if !hub.fan_out_round(beat) {
                    return;
                }
            }
        });
        // Items published before the task existed.
        wake.notify_one();
    }

    /// One round: every item after the last round to every subscriber,
    /// and with `beat` a heartbeat after them to those that asked. `false`
    /// once the hub is closed.
    fn fan_out_round(&self, beat: bool) -> bool {
        let (items, mut subs, oldest, heartbeat) = {
            let mut inner = self.inner.lock().unwrap();
            if inner.closed {
                return false;
            }
            let fanned = inner.fanned;
            let items: Vec<Arc<WatchItem>> = inner
                .history
                .iter()
                .filter(|i| i.revision > fanned)
                .cloned()
                .collect();
            let oldest = inner.history.front().map_or(u64::MAX, |i| i.revision);
            inner.fanned = inner.revision;
            let heartbeat = beat.then(|| Arc::new(self.heartbeat(inner.revision)));
            (
                items,
                std::mem::take(&mut inner.subscribers),
                oldest,
                heartbeat,
            )
        };
        if !items.is_empty() {
            // More was published since the last round than the history
            // keeps: whoever still needed the lost items resyncs.
            subs.retain(|s| s.next >= oldest);
            send(&mut subs, &items);
        }
        if let Some(heartbeat) = heartbeat {
            // A subscriber whose channel is full (a reader far behind) is
            // dropped and resyncs, as for an event.
            subs.retain(|s| !s.heartbeat || s.tx.try_send(heartbeat.clone()).is_ok());
        }
        let mut inner = self.inner.lock().unwrap();
        if inner.closed {
            return false;
        }
        // Those who subscribed during the round come after, as they would
        // have without it (their `next` skips what they already have).
        // Subscriptions ended during the round stay ended.
        if !inner.unsubscribed {
            subs.append(&mut inner.subscribers);
            inner.subscribers = subs;
        }
        drop(inner);
        *self.fanned_at.lock().unwrap() = Some(tokio::time::Instant::now());
        true
    }

    /// Poisons the hub's lock, as a panic under it would: every later
    /// round (and publish) panics.
    #[cfg(test)]
    pub(crate) fn poison(self: &Arc<Self>) {
        let hub = self.clone();
        let _ = std::thread::spawn(move || {
            let _held = hub.inner.lock().unwrap();
            panic!("a bug under the hub's lock (a test)");
        })
        .join();
    }

    /// How long since the fan-out task last finished a round; `None`
    /// without one. It makes a round at least every [`HEARTBEAT_EVERY`]
    /// (a heartbeat round when nothing is published), so far longer means
    /// the event path is stuck: the task died (a panic under the hub's
    /// lock) or waits on that lock for ever. Read without that lock.
    pub fn fan_out_silent_for(&self) -> Option<std::time::Duration> {
        self.fanned_at.lock().unwrap().map(|at| at.elapsed())
    }
}
