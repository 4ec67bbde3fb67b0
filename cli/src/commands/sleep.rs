//! `siesta sleep MODEL [--level 1|2] [--wait [--timeout D]]`: with `--wait`,
//! follows the model on Watch until it is asleep at that level, failed, or
//! wanted otherwise (a demand woke it), and says which.

use std::time::{Duration, Instant};

use siesta_proto::v1 as pb;
use siesta_proto::v1::watch_event::Kind;
use tokio_stream::StreamExt;

use super::{OperationView, print_json, print_operation};
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;
use crate::render;
use crate::view::{IntentView, ModelView};

/// How long `--wait` waits without `--timeout` (requests in flight are
/// waited for, and may be long).
const DEFAULT_WAIT: Duration = Duration::from_secs(300);

pub async fn run(
    conn: Conn,
    name: &str,
    level: u32,
    wait: Option<Option<Duration>>,
    format: Format,
) -> Result<(), Failure> {
    let resp = conn
        .call(|mut c| async move {
            c.sleep(pb::SleepRequest {
                name: name.to_owned(),
                level,
            })
            .await
        })
        .await?;
    let Some(timeout) = wait else {
        return print_operation(name, &resp, format);
    };
    if !resp.warning.is_empty() && format == Format::Text {
        eprintln!("warning: {}", resp.warning);
    }
    let started = Instant::now();
    let mut model = resp.model.clone().unwrap_or_default();
    if model.name.is_empty() {
        model.name = name.to_owned();
    }
    let timeout = timeout.unwrap_or(DEFAULT_WAIT);
    let mut events: Option<tonic::Streaming<pb::WatchEvent>> = None;
    let outcome = loop {
        if let Some(outcome) = outcome(&model, level) {
            break outcome;
        }
        let events = match &mut events {
            Some(e) => e,
            None => events.insert(
                conn.call(|mut c| async move {
                    c.watch(pb::WatchRequest {
                        since_revision: 0,
                        client_id: "siesta sleep --wait".into(),
                        incarnation: 0,
                        heartbeat: false,
                    })
                    .await
                })
                .await?,
            ),
        };
        let left = timeout.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, next_status(events, &model.name)).await {
            Ok(Ok(m)) => model = m,
            Ok(Err(status)) => return Err(conn.err(status)),
            Err(_) => {
                let held = match model.waiting_for.as_str() {
                    "" => String::new(),
                    w => format!(", waiting for {w}"),
                };
                break Err(format!(
                    "still {} after {}{held}; the sleep goes on",
                    render::state_label(&model),
                    render::duration(started.elapsed().as_millis() as u64),
                ));
            }
        }
    };
    let elapsed = render::duration(started.elapsed().as_millis() as u64);
    let message = match &outcome {
        Ok(()) => format!("asleep at level {} after {elapsed}", model.sleep_level),
        Err(why) => why.clone(),
    };
    match format {
        Format::Json => print_json(&OperationView {
            message: message.clone(),
            model: Some(ModelView::from(&model)),
            warning: resp.warning.clone(),
        })?,
        Format::Text if outcome.is_ok() => println!("{}: {message}", model.name),
        Format::Text => {}
    }
    match outcome {
        Ok(()) => Ok(()),
        Err(why) => Err(Failure::Failed(format!(
            "{}: not asleep: {why}",
            model.name
        ))),
    }
}

/// Done (asleep deep enough), or why it will not get there; None: wait on.
fn outcome(m: &pb::ModelStatus, level: u32) -> Option<Result<(), String>> {
    match m.state() {
        pb::ModelState::Asleep if m.sleep_level >= level => return Some(Ok(())),
        pb::ModelState::Failed => {
            let why = m.last_error.lines().next().unwrap_or("no reason given");
            return Some(Err(format!("failed: {why}")));
        }
        _ => {}
    }
    let intent = m.intent.unwrap_or_default();
    if intent.desired() != pb::DesiredState::Asleep {
        let i = IntentView::from(&intent);
        return Some(Err(format!(
            "the intent changed to {} ({}); now {}",
            i.desired,
            i.reason,
            render::state_label(m)
        )));
    }
    None
}

/// The next status of model `name` on the stream (from a snapshot or an
/// event).
async fn next_status(
    events: &mut tonic::Streaming<pb::WatchEvent>,
    name: &str,
) -> Result<pb::ModelStatus, tonic::Status> {
    loop {
        let ev = events
            .next()
            .await
            .ok_or_else(|| tonic::Status::unavailable("the watch stream ended"))??;
        let found = match ev.kind {
            Some(Kind::Model(m)) if m.name == name => Some(m),
            Some(Kind::Snapshot(s)) => s.models.into_iter().find(|m| m.name == name),
            Some(Kind::ModelRemoved(n)) if n == name => {
                return Err(tonic::Status::not_found(format!(
                    "{name} was removed from the configuration"
                )));
            }
            _ => None,
        };
        if let Some(m) = found {
            return Ok(m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: pb::ModelState, level: u32, desired: pb::DesiredState) -> pb::ModelStatus {
        pb::ModelStatus {
            name: "chat".into(),
            state: state as i32,
            sleep_level: level,
            intent: Some(pb::Intent {
                desired: desired as i32,
                level,
                reason: pb::IntentReason::Demand as i32,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn outcome_waits_until_asleep_deep_enough() {
        use pb::{DesiredState as D, ModelState as S};
        assert_eq!(outcome(&status(S::Awake, 0, D::Asleep), 1), None);
        assert_eq!(outcome(&status(S::Sleeping, 2, D::Asleep), 2), None);
        assert_eq!(outcome(&status(S::Asleep, 1, D::Asleep), 2), None);
        assert_eq!(outcome(&status(S::Asleep, 2, D::Asleep), 1), Some(Ok(())));
        let woken = outcome(&status(S::Waking, 0, D::Awake), 1)
            .unwrap()
            .unwrap_err();
        assert_eq!(woken, "the intent changed to awake (demand); now waking");
        let mut failed = status(S::Failed, 0, D::Asleep);
        failed.last_error = "sleep timed out\nmore".into();
        assert_eq!(
            outcome(&failed, 1),
            Some(Err("failed: sleep timed out".into()))
        );
    }
}
