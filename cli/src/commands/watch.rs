//! `siesta watch`: live events; `-o json` prints one JSON object per line.
//! Survives control-plane restarts: reconnects and resumes.

use std::collections::HashMap;
use std::time::Duration;

use siesta_proto::patience::Patience;
use siesta_proto::v1 as pb;
use siesta_proto::v1::watch_event::Kind;
use tokio_stream::StreamExt;

use super::print_json_line;
use crate::args::Format;
use crate::client::{Conn, RPC_TIMEOUT};
use crate::failure::{Failure, no_answer};
use crate::render;
pub use crate::view::EventView;

/// First wait before reconnecting a watch that ended.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
/// Longest wait between reconnection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Which run of which control plane: revisions only compare within one.
pub(super) type Incarnation = (String, i64);

/// Prints events until interrupted (see [`follow`]).
pub async fn run(conn: Conn, format: Format) -> Result<(), Failure> {
    let mut text = TextWatch::default();
    let how = Follow {
        client_id: "siesta watch",
        patient: false,
        say: true,
    };
    follow(&conn, how, |ev| print(&ev, format, &mut text)).await
}

/// How [`follow`] keeps its Watch.
pub(super) struct Follow<'a> {
    pub client_id: &'a str,
    /// Keep trying before the control plane first answers too (`up`: it
    /// may take minutes to serve); else that is an error at once.
    pub patient: bool,
    /// Say on stderr when the stream is lost, found again, or resynced.
    pub say: bool,
}

/// Hands every event to `each` until `each` fails or the control plane
/// refuses (a token, an unknown method). When the stream ends or breaks
/// (the control plane restarted, the network went away) it reconnects with
/// capped backoff and resumes after the last revision seen; a restarted
/// control plane (new revisions) or lost history gives a fresh snapshot,
/// marked as a resync.
pub(super) async fn follow(
    conn: &Conn,
    how: Follow<'_>,
    mut each: impl FnMut(pb::WatchEvent) -> Result<(), Failure>,
) -> Result<(), Failure> {
    let mut incarnation: Option<Incarnation> = None;
    let mut since = 0;
    let mut resynced = false;
    let mut backoff = BACKOFF_MIN;
    let mut connected_once = false;
    // A failure before the control plane ever answered ends it, unless patient.
    let give_up = |status: &tonic::Status, connected_once: bool| {
        !retryable(status) || (!how.patient && !connected_once)
    };
    loop {
        let now = match incarnation_now(conn).await {
            Ok(now) => now,
            Err(status) if give_up(&status, connected_once) => return Err(conn.err(status)),
            Err(_) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        if let Some(was) = &incarnation
            && (*was != now.0 || now.1 < since)
        {
            // Another run of the control plane: its revisions are not ours.
            if how.say {
                eprintln!(
                    "siesta watch: siesta-control at {} restarted; resyncing from a fresh snapshot",
                    conn.url
                );
            }
            since = 0;
            resynced = true;
        }
        let of = incarnation.insert(now.0);
        let why = match open(conn, since, of, how.client_id).await {
            Ok(mut events) => {
                // Open again: the next break starts from the shortest wait.
                backoff = BACKOFF_MIN;
                if connected_once && how.say {
                    eprintln!("siesta watch: reconnected to {}", conn.url);
                }
                connected_once = true;
                let mut patience = Patience::default();
                loop {
                    let next = match patience.within(events.next()).await {
                        Ok(next) => next,
                        Err(why) => break why,
                    };
                    match next {
                        // Asked for, to tell a wedged control plane: not shown.
                        Some(Ok(ev)) if patience.heard(&ev) => {}
                        Some(Ok(mut ev)) => {
                            if let Some(Kind::Snapshot(s)) = &mut ev.kind {
                                // A restart's snapshot replaces what was printed.
                                s.resync |= std::mem::take(&mut resynced);
                            }
                            since = ev.revision;
                            each(ev)?;
                        }
                        Some(Err(status)) => break status.message().to_owned(),
                        None => break "the control plane ended the stream".to_owned(),
                    }
                }
            }
            Err(status) if give_up(&status, connected_once) => return Err(conn.err(status)),
            Err(status) => status.message().to_owned(),
        };
        if how.say {
            eprintln!("siesta watch: lost {} ({why}); reconnecting…", conn.url);
        }
        // Until it answers again, retry with doubling waits.
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

fn print(ev: &pb::WatchEvent, format: Format, text: &mut TextWatch) -> Result<(), Failure> {
    match format {
        Format::Json => print_json_line(&EventView::from(ev))?,
        Format::Text => {
            for line in text.lines(ev) {
                println!("{line}");
            }
        }
    }
    Ok(())
}

/// Opens Watch after revision `since` of the run `of` (its start time; a
/// control plane restarted since answers with a resync snapshot).
pub(super) async fn open(
    conn: &Conn,
    since: u64,
    of: &Incarnation,
    client_id: &str,
) -> Result<tonic::Streaming<pb::WatchEvent>, tonic::Status> {
    let mut client = conn.client.clone();
    let req = pb::WatchRequest {
        since_revision: since,
        client_id: client_id.into(),
        incarnation: of.1,
        heartbeat: true,
    };
    match tokio::time::timeout(RPC_TIMEOUT, client.watch(req)).await {
        Ok(r) => r.map(tonic::Response::into_inner),
        Err(_) => Err(no_answer("Watch")),
    }
}

/// The control plane's identity and start time, and its current revision.
pub(super) async fn incarnation_now(conn: &Conn) -> Result<(Incarnation, u64), tonic::Status> {
    let mut client = conn.client.clone();
    let info = match tokio::time::timeout(RPC_TIMEOUT, client.get_info(pb::GetInfoRequest {})).await
    {
        Ok(r) => r?.into_inner(),
        Err(_) => return Err(no_answer("GetInfo")),
    };
    Ok(((info.control_id, info.started_unix_ms), info.revision))
}

/// Errors that another attempt can cure (the control plane away or
/// restarting); not a refused token or an unknown method.
fn retryable(status: &tonic::Status) -> bool {
    !matches!(
        status.code(),
        tonic::Code::Unauthenticated
            | tonic::Code::PermissionDenied
            | tonic::Code::InvalidArgument
            | tonic::Code::Unimplemented
    )
}

/// Human-readable event lines; remembers each model's last state to show
/// transitions as `asleep(l1) → waking`.
#[derive(Debug, Default)]
pub struct TextWatch {
    states: HashMap<String, String>,
    /// Only state changes (no activity-only updates).
    changes_only: bool,
    /// The last placement printed (without its time and revision).
    placement: Option<String>,
}

impl TextWatch {
    /// Lines for state changes only (what `siesta up` prints).
    pub fn changes_only() -> Self {
        TextWatch {
            changes_only: true,
            ..Default::default()
        }
    }

    pub fn lines(&mut self, ev: &pb::WatchEvent) -> Vec<String> {
        let at = clock(ev.at_unix_ms);
        let rev = ev.revision;
        match &ev.kind {
            Some(Kind::Snapshot(s)) => {
                self.states.clear();
                let mut out = vec![format!(
                    "{at} #{rev} snapshot{}: {} models",
                    if s.resync { " (resync)" } else { "" },
                    s.models.len()
                )];
                for m in &s.models {
                    let state = render::state_label(m);
                    out.push(format!("{at} #{rev}   {}: {state}{}", m.name, details(m)));
                    self.states.insert(m.name.clone(), state);
                }
                out
            }
            Some(Kind::Model(m)) => {
                let state = render::state_label(m);
                let change = match self.states.insert(m.name.clone(), state.clone()) {
                    Some(prev) if prev != state => format!("{prev} → {state}"),
                    Some(_) if self.changes_only => return Vec::new(),
                    _ => state,
                };
                vec![format!("{at} #{rev} {}: {change}{}", m.name, details(m))]
            }
            Some(Kind::ModelRemoved(name)) => {
                self.states.remove(name);
                vec![format!(
                    "{at} #{rev} {name}: removed from the configuration"
                )]
            }
            Some(Kind::Gpus(g)) => vec![format!(
                "{at} #{rev} gpus: {} GPUs, {} P2P results",
                g.gpus.len(),
                g.p2p.len()
            )],
            Some(Kind::Placement(p)) => {
                let mut parts: Vec<String> = p
                    .models
                    .iter()
                    .map(|m| format!("{} on {}", m.model, render::gpus(&m.gpus)))
                    .collect();
                parts.extend(p.gpus.iter().filter(|g| g.foreign_bytes > 0).map(|g| {
                    format!(
                        "others hold {} on {}",
                        render::bytes(g.foreign_bytes),
                        g.index
                    )
                }));
                let line = parts.join(", ");
                // Republished every few seconds with NVML: only a change is news.
                if self.placement.as_ref() == Some(&line) {
                    return Vec::new();
                }
                self.placement = Some(line.clone());
                vec![format!("{at} #{rev} placement: {line}")]
            }
            // `follow` keeps them from here; nothing changed anyway.
            Some(Kind::Heartbeat(_)) => Vec::new(),
            None => vec![format!("{at} #{rev} (unknown event)")],
        }
    }
}

/// The extra facts worth a glance: in flight, pins, errors, waits.
fn details(m: &pb::ModelStatus) -> String {
    let mut d = Vec::new();
    if m.in_flight > 0 {
        d.push(format!("{} in flight", m.in_flight));
    }
    if m.held > 0 {
        d.push(format!("{} held", m.held));
    }
    if m.pinned_until_unix_ms > 0 {
        d.push("pinned".to_owned());
    }
    if !m.waiting_for.is_empty() {
        d.push(format!("waiting for {}", m.waiting_for));
    }
    if !m.last_error.is_empty() {
        d.push(format!(
            "error: {}",
            m.last_error.lines().next().unwrap_or("")
        ));
    }
    if d.is_empty() {
        String::new()
    } else {
        format!(" ({})", d.join("; "))
    }
}

/// `HH:MM:SS.mmm` (UTC) of a Unix time in milliseconds.
pub fn clock(unix_ms: i64) -> String {
    let ms = unix_ms.rem_euclid(86_400_000);
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_event(rev: u64, name: &str, state: pb::ModelState) -> pb::WatchEvent {
        pb::WatchEvent {
            revision: rev,
            at_unix_ms: 3_723_004,
            kind: Some(Kind::Model(pb::ModelStatus {
                name: name.into(),
                state: state as i32,
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn text_shows_transitions() {
        let mut w = TextWatch::default();
        assert_eq!(
            w.lines(&model_event(1, "chat", pb::ModelState::Asleep)),
            ["01:02:03.004 #1 chat: asleep"]
        );
        assert_eq!(
            w.lines(&model_event(2, "chat", pb::ModelState::Waking)),
            ["01:02:03.004 #2 chat: asleep → waking"]
        );
    }

    #[test]
    fn changes_only_skips_activity_updates() {
        let mut w = TextWatch::changes_only();
        assert_eq!(
            w.lines(&model_event(1, "chat", pb::ModelState::Awake))
                .len(),
            1
        );
        assert!(
            w.lines(&model_event(2, "chat", pb::ModelState::Awake))
                .is_empty()
        );
        assert_eq!(
            w.lines(&model_event(3, "chat", pb::ModelState::Sleeping))
                .len(),
            1
        );
    }

    /// Placement is republished every few seconds with NVML (others'
    /// memory moves): a line only when what it shows changed.
    #[test]
    fn placement_prints_only_what_changed_with_others_memory() {
        let placement = |rev: u64, gpus: Vec<u32>, foreign_gib: u64| pb::WatchEvent {
            revision: rev,
            at_unix_ms: 3_723_004,
            kind: Some(Kind::Placement(pb::GetPlacementResponse {
                models: vec![pb::ModelPlacement {
                    model: "chat".into(),
                    gpus,
                    ..Default::default()
                }],
                gpus: vec![pb::GpuBudget {
                    index: 0,
                    foreign_bytes: foreign_gib << 30,
                    ..Default::default()
                }],
            })),
            ..Default::default()
        };
        let mut w = TextWatch::default();
        assert_eq!(
            w.lines(&placement(1, vec![0], 0)),
            ["01:02:03.004 #1 placement: chat on 0"]
        );
        assert!(w.lines(&placement(2, vec![0], 0)).is_empty());
        assert_eq!(
            w.lines(&placement(3, vec![0], 21)),
            ["01:02:03.004 #3 placement: chat on 0, others hold 21.0 GiB on 0"]
        );
        assert!(w.lines(&placement(4, vec![0], 21)).is_empty());
        assert_eq!(
            w.lines(&placement(5, vec![1], 21)),
            ["01:02:03.004 #5 placement: chat on 1, others hold 21.0 GiB on 0"]
        );
    }

    #[test]
    fn json_view_names_its_type() {
        let v = serde_json::to_value(EventView::from(&model_event(
            7,
            "chat",
            pb::ModelState::Awake,
        )))
        .unwrap();
        assert_eq!(v["type"], "model");
        assert_eq!(v["revision"], 7);
        assert_eq!(v["model"]["state"], "awake");
        assert!(v.get("gpus").is_none());
    }
}
