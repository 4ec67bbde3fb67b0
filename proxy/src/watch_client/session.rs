//! One Watch stream of one control plane address: called, read until it
//! ends or falls silent, called again after a backoff, resuming from the
//! last revision seen.
//!
//! Silent means past its deadline: the first message within
//! [`FIRST_EVENT_WAIT`]; then, once the control plane has sent a
//! heartbeat (the proxy asks for them; older control planes send none and
//! are waited for without end, their connection's pings catching a dead
//! one), [`HEARTBEATS_MISSED`] of its intervals. A control plane whose
//! runtime answers HTTP/2 pings but whose event path is wedged (its
//! fan-out task gone, its hub's lock held) is so told from a quiet one.

use std::time::Duration;

use siesta_proto::v1::{GetInfoRequest, WatchRequest};
use tokio_util::sync::CancellationToken;

use super::{Client, WatchCtx, backoff};
use crate::route_table::SourceId;

pub(super) async fn watch_source(
    ctx: WatchCtx,
    group: String,
    source: SourceId,
    shutdown: CancellationToken,
) {
    let mut client = match ctx.controls.connect(&source) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(control = %source, error = %e, "cannot watch control plane");
            return;
        }
    };
    let mut attempt = 0u32;
    let mut incarnation: Option<(String, i64)> = None;
    loop {
        let session = watch_once(
            &ctx,
            &group,
            &source,
            &mut client,
            &mut incarnation,
            &mut attempt,
        );
        let res = tokio::select! {
            r = session => r,
            _ = shutdown.cancelled() => break,
        };
        match res {
            Ok(()) => tracing::warn!(control = %source, "watch stream ended; reconnecting"),
            Err(status) if status.code() == tonic::Code::Unauthenticated => tracing::error!(
                control = %source, error = %status.message(),
                "control plane refused this proxy's token: pass the control plane's token with --token or SIESTA_TOKEN"
            ),
            Err(status) => tracing::warn!(
                control = %source, code = ?status.code(), error = %status.message(),
                "control plane unreachable; serving from the last table"
            ),
        }
        attempt = attempt.saturating_add(1);
        tokio::select! {
            _ = tokio::time::sleep(backoff(attempt)) => {}
            _ = shutdown.cancelled() => break,
        }
    }
    ctx.controls.forget(&source);
}

async fn watch_once(
    ctx: &WatchCtx,
    group: &str,
    source: &SourceId,
    client: &mut Client,
    incarnation: &mut Option<(String, i64)>,
    attempt: &mut u32,
) -> Result<(), tonic::Status> {
    let mut since = ctx.table.revision(source);
    // A restarted control plane starts a new revision history: resync.
    match tokio::time::timeout(Duration::from_secs(5), client.get_info(GetInfoRequest {})).await {
        Ok(Ok(info)) => {
            let info = info.into_inner();
            let now = (info.control_id.clone(), info.started_unix_ms);
            if incarnation.as_ref() != Some(&now) || info.revision < since {
                since = 0;
            }
            ctx.table
                .set_identity(source, (group.to_owned(), now.0.clone(), now.1));
            *incarnation = Some(now);
        }
        Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {}
        Ok(Err(s)) => return Err(s),
        Err(_) => return Err(tonic::Status::deadline_exceeded("GetInfo timed out")),
    }
    // The run `since` is from: a control plane that restarted after
    // GetInfo answered resyncs rather than resuming after a revision of
    // its earlier run.
    let req = WatchRequest {
        since_revision: since,
        client_id: ctx.proxy_id.clone(),
        incarnation: incarnation.as_ref().map_or(0, |i| i.1),
        heartbeat: true,
    };
    let mut stream = match tokio::time::timeout(FIRST_EVENT_WAIT, client.watch(req)).await {
        Ok(stream) => stream?.into_inner(),
        Err(_) => return Err(silent(FIRST_EVENT_WAIT, None)),
    };
    let mut patience = Patience::default();
    loop {
        let ev = match patience.wait() {
            Some(wait) => match tokio::time::timeout(wait, stream.message()).await {
                Ok(ev) => ev?,
                Err(_) => return Err(silent(wait, patience.interval)),
            },
            None => stream.message().await?,
        };
        let Some(ev) = ev else { return Ok(()) };
        if patience.first {
            *attempt = 0;
            tracing::info!(control = %source, since_revision = since, "watching control plane");
        }
        if !patience.heard(&ev) {
            ctx.table.apply(source, ev);
        }
    }
}

/// How long a Watch call may take to answer with its first message (a
/// snapshot or catch-up events: milliseconds even at 1,000 models). A
/// control plane that accepts the connection but never answers (still
/// starting, or wedged) is given up on and called again after a backoff.
pub const FIRST_EVENT_WAIT: Duration = Duration::from_secs(10);

/// How many heartbeat intervals a stream may stay silent: past this the
/// control plane's event path is taken as wedged (its connection may
/// still answer HTTP/2 pings) and the stream is called again, resuming
/// from the last revision.
pub const HEARTBEATS_MISSED: u32 = 3;

/// How long the next message may take, from what the stream has sent.
#[derive(Debug)]
struct Patience {
    /// No message yet.
    first: bool,
    /// The interval of the last heartbeat: set once the control plane has
    /// sent one (an older one, which sends none, is waited for without end:
    /// its pings still catch a dead connection).
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
    fn wait(&self) -> Option<Duration> {
        match self.interval {
            Some(every) => Some(every * HEARTBEATS_MISSED),
            None if self.first => Some(FIRST_EVENT_WAIT),
            None => None,
        }
    }

    /// Notes a message; `true` for a heartbeat (nothing to apply).
    fn heard(&mut self, ev: &siesta_proto::v1::WatchEvent) -> bool {
        use siesta_proto::v1::watch_event::Kind;
        self.first = false;
        match &ev.kind {
            Some(Kind::Heartbeat(h)) => {
                // A zero would make every wait instant.
                let every = Duration::from_millis(u64::from(h.interval_ms)).max(MIN_INTERVAL);
                self.interval = Some(every);
                true
            }
            _ => false,
        }
    }
}

/// The shortest heartbeat interval held to.
const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// The error a silent stream ends with (logged by the caller, which calls
/// again after a backoff).
fn silent(waited: Duration, every: Option<Duration>) -> tonic::Status {
    let why = match every {
        Some(every) => format!(
            "no event or heartbeat for {waited:?} (the control plane promised one every {every:?}): its event path looks wedged; calling Watch again"
        ),
        None => format!("no answer to Watch in {waited:?}"),
    };
    tonic::Status::deadline_exceeded(why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use siesta_proto::v1::WatchEvent;

    fn snapshot() -> WatchEvent {
        crate::route_table::tests::snapshot(1, vec![])
    }

    fn event(kind: siesta_proto::v1::watch_event::Kind) -> WatchEvent {
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
        use siesta_proto::v1::Heartbeat;
        use siesta_proto::v1::watch_event::Kind;
        let beat = |ms| event(Kind::Heartbeat(Heartbeat { interval_ms: ms }));
        let mut old = Patience::default();
        assert_eq!(old.wait(), Some(FIRST_EVENT_WAIT));
        assert!(!old.heard(&snapshot()));
        assert_eq!(old.wait(), None, "no heartbeat yet: no deadline");
        assert!(!old.heard(&event(Kind::ModelRemoved("m".into()))));
        assert_eq!(old.wait(), None);

        let mut new = Patience::default();
        assert!(!new.heard(&snapshot()));
        assert!(new.heard(&beat(10_000)), "a heartbeat is not applied");
        assert_eq!(new.wait(), Some(Duration::from_secs(30)));
        assert!(!new.heard(&event(Kind::ModelRemoved("m".into()))));
        assert_eq!(new.wait(), Some(Duration::from_secs(30)), "kept");
        new.heard(&beat(2_000));
        assert_eq!(new.wait(), Some(Duration::from_secs(6)));
        new.heard(&beat(0));
        assert_eq!(new.wait(), Some(MIN_INTERVAL * HEARTBEATS_MISSED));
    }
}
