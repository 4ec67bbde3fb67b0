//! How long a `Watch` client waits for its stream's next message.
//!
//! A client that asks for heartbeats (`WatchRequest.heartbeat`) gets one
//! after its snapshot or catch-up and whenever nothing changed for the
//! heartbeat's `interval_ms`. Once it has seen one, a stream silent for
//! [`HEARTBEATS_MISSED`] intervals is a control plane whose event path is
//! wedged (its connection may still answer HTTP/2 pings): the client calls
//! `Watch` again. A control plane older than heartbeats sends none, and is
//! waited for without end after its first message (the connection's
//! pings still catch a dead one). The proxy, `siesta watch` and `siesta
//! top` hold their streams to this.

use std::future::Future;
use std::time::Duration;

use crate::v1::WatchEvent;
use crate::v1::watch_event::Kind;

/// How long the first message (a snapshot or catch-up events:
/// milliseconds even at 1,000 models) may take.
pub const FIRST_EVENT_WAIT: Duration = Duration::from_secs(10);

/// How many heartbeat intervals a stream may stay silent.
pub const HEARTBEATS_MISSED: u32 = 3;

/// The shortest heartbeat interval held to (a zero would make every wait
/// instant).
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// What one stream has sent so far, as far as its deadlines go.
#[derive(Debug, Clone)]
pub struct Patience {
    first: bool,
    interval: Option<Duration>,
}

impl Default for Patience {
    fn default() -> Self {
        Patience {
            first: true,
            interval: None,
        }
    }
}

impl Patience {
    /// How long the next message may take; `None`: without end.
    pub fn wait(&self) -> Option<Duration> {
        match self.interval {
            Some(every) => Some(every * HEARTBEATS_MISSED),
            None if self.first => Some(FIRST_EVENT_WAIT),
            None => None,
        }
    }

    /// Whether no message has come yet.
    pub fn first(&self) -> bool {
        self.first
    }

    /// Notes a message; `true` for a heartbeat (nothing to apply or show).
    pub fn heard(&mut self, ev: &WatchEvent) -> bool {
        self.first = false;
        match &ev.kind {
            Some(Kind::Heartbeat(h)) => {
                let every = Duration::from_millis(u64::from(h.interval_ms)).max(MIN_INTERVAL);
                self.interval = Some(every);
                true
            }
            _ => false,
        }
    }

    /// `next` (the stream's next message) within [`Patience::wait`], or
    /// why the stream counts as silent.
    pub async fn within<T>(&self, next: impl Future<Output = T>) -> Result<T, String> {
        match self.wait() {
            Some(wait) => tokio::time::timeout(wait, next)
                .await
                .map_err(|_| self.silent(wait)),
            None => Ok(next.await),
        }
    }

    fn silent(&self, waited: Duration) -> String {
        match self.interval {
            Some(every) => format!(
                "no event or heartbeat for {waited:?} (the control plane promised one every {every:?}): its event path looks wedged"
            ),
            None => format!("no first event within {waited:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Heartbeat, Snapshot};

    fn event(kind: Kind) -> WatchEvent {
        WatchEvent {
            kind: Some(kind),
            ..Default::default()
        }
    }

    /// How long each next message may take: the first, 10 s; then, from a
    /// control plane that sends no heartbeats (older ones), without end;
    /// from one that does, three of its intervals, the latest heartbeat's.
    #[test]
    fn patience_follows_the_heartbeats_the_control_plane_sends() {
        let beat = |ms| event(Kind::Heartbeat(Heartbeat { interval_ms: ms }));
        let snapshot = event(Kind::Snapshot(Snapshot::default()));
        let mut old = Patience::default();
        assert_eq!(old.wait(), Some(FIRST_EVENT_WAIT));
        assert!(!old.heard(&snapshot));
        assert_eq!(old.wait(), None, "no heartbeat yet: no deadline");
        assert!(!old.heard(&event(Kind::ModelRemoved("m".into()))));
        assert_eq!(old.wait(), None);

        let mut new = Patience::default();
        assert!(new.first());
        assert!(!new.heard(&snapshot));
        assert!(!new.first());
        assert!(new.heard(&beat(10_000)), "a heartbeat is not applied");
        assert_eq!(new.wait(), Some(Duration::from_secs(30)));
        assert!(!new.heard(&event(Kind::ModelRemoved("m".into()))));
        assert_eq!(new.wait(), Some(Duration::from_secs(30)), "kept");
        new.heard(&beat(2_000));
        assert_eq!(new.wait(), Some(Duration::from_secs(6)));
        new.heard(&beat(0));
        assert_eq!(new.wait(), Some(MIN_INTERVAL * HEARTBEATS_MISSED));
    }

    /// A stream silent past its deadline is told as such, naming what it
    /// waited for; one that answers in time is not.
    #[tokio::test(start_paused = true)]
    async fn within_gives_up_past_the_deadline_and_says_why() {
        let mut p = Patience::default();
        let why = p.within(std::future::pending::<()>()).await.unwrap_err();
        assert_eq!(why, "no first event within 10s");
        p.heard(&event(Kind::Heartbeat(Heartbeat {
            interval_ms: 10_000,
        })));
        let why = p.within(std::future::pending::<()>()).await.unwrap_err();
        assert!(
            why.starts_with(
                "no event or heartbeat for 30s (the control plane promised one every 10s)"
            ),
            "{why}"
        );
        assert_eq!(p.within(std::future::ready(7)).await, Ok(7));
    }
}
