//! `siesta status`: every model in one table.

use serde::Serialize;
use siesta_proto::v1 as pb;

use super::print_json;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;
use crate::render::{self, Table};
use crate::view::ModelView;

/// Longest last-error text shown in the table (the full text is in `get`).
const ERROR_WIDTH: usize = 60;

#[derive(Debug, Serialize)]
struct StatusView {
    revision: u64,
    models: Vec<ModelView>,
}

pub async fn run(conn: Conn, format: Format) -> Result<(), Failure> {
    let resp = conn
        .call(|mut c| async move { c.list_models(pb::ListModelsRequest {}).await })
        .await?;
    match format {
        Format::Json => print_json(&StatusView {
            revision: resp.revision,
            models: resp.models.iter().map(ModelView::from).collect(),
        }),
        Format::Text => {
            print!("{}", table(render::now_ms(), &resp.models));
            Ok(())
        }
    }
}

/// The status table at time `now`.
pub fn table(now: i64, models: &[pb::ModelStatus]) -> String {
    if models.is_empty() {
        return "no models configured\n".into();
    }
    let mut t = Table::new([
        "model",
        "state",
        "gpus",
        "endpoint",
        "idle",
        "in flight",
        "held",
        "next tier",
        "last error",
    ]);
    for m in models {
        t.row(vec![
            m.name.clone(),
            state_cell(now, m),
            render::gpus(&m.gpus),
            endpoint(m),
            idle(now, m),
            m.in_flight.to_string(),
            m.held.to_string(),
            tier_cell(now, m),
            error_cell(now, m),
        ]);
    }
    t.render()
}

/// State with how long it has held: `asleep(l1) 5m`.
fn state_cell(now: i64, m: &pb::ModelStatus) -> String {
    let label = render::state_label(m);
    match m.state_since_unix_ms {
        0 => label,
        since => format!("{label} {}", render::ago(now, since)),
    }
}

fn endpoint(m: &pb::ModelStatus) -> String {
    match m.endpoints.as_slice() {
        [] => "-".into(),
        [one] => one.url.clone(),
        [first, rest @ ..] => format!("{} (+{})", first.url, rest.len()),
    }
}

fn idle(now: i64, m: &pb::ModelStatus) -> String {
    if m.in_flight > 0 {
        "busy".into()
    } else {
        render::ago(now, m.last_activity_unix_ms)
    }
}

fn tier_cell(now: i64, m: &pb::ModelStatus) -> String {
    match m.pinned_until_unix_ms {
        0 => render::next_tier(now, m),
        i64::MAX => "pinned".into(),
        until => format!("pinned, ends {}", render::until(now, until)),
    }
}

/// What holds the model up now, else its last error: a model waiting for
/// room showed an error from minutes before (kept until a start succeeds)
/// instead of what it waited for.
fn error_cell(now: i64, m: &pb::ModelStatus) -> String {
    let mut text: String = if m.waiting_for.is_empty() {
        m.last_error.lines().next().unwrap_or("").to_owned()
    } else {
        format!("waiting for {}", m.waiting_for)
    };
    if text.chars().count() > ERROR_WIDTH {
        text = text.chars().take(ERROR_WIDTH - 1).collect::<String>() + "…";
    }
    if m.retry_at_unix_ms > 0 {
        text = format!("{text} (retry {})", render::until(now, m.retry_at_unix_ms));
    }
    render::or_dash(text.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_model_waits_for_shows_before_an_old_error() {
        let mut m = pb::ModelStatus {
            last_error: "wake from level 1 timed out".into(),
            waiting_for: "room on GPU 0".into(),
            ..Default::default()
        };
        assert_eq!(error_cell(0, &m), "waiting for room on GPU 0");
        m.waiting_for.clear();
        assert_eq!(error_cell(0, &m), "wake from level 1 timed out");
    }

    #[test]
    fn table_shows_state_tier_and_error() {
        let now = 1_000_000;
        let models = vec![
            pb::ModelStatus {
                name: "chat".into(),
                state: pb::ModelState::Asleep as i32,
                sleep_level: 1,
                state_since_unix_ms: now - 60_000,
                endpoints: vec![pb::Endpoint {
                    url: "http://127.0.0.1:8101".into(),
                    served_model_name: "chat".into(),
                }],
                gpus: vec![0, 1],
                last_activity_unix_ms: now - 120_000,
                next_tier: Some(pb::IdleTier {
                    after_ms: 0,
                    action: pb::IdleAction::Sleep as i32,
                    level: 2,
                }),
                next_tier_unix_ms: now + 600_000,
                ..Default::default()
            },
            pb::ModelStatus {
                name: "ocr".into(),
                state: pb::ModelState::Failed as i32,
                last_error: "engine exited with status 1".into(),
                retry_at_unix_ms: now + 5_000,
                ..Default::default()
            },
        ];
        let out = table(now, &models);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("MODEL"), "{out}");
        assert!(lines[1].contains("asleep(l1) 1m"), "{out}");
        assert!(lines[1].contains("0,1"), "{out}");
        assert!(lines[1].contains("http://127.0.0.1:8101"), "{out}");
        assert!(lines[1].contains("sleep l2 in 10m"), "{out}");
        assert!(
            lines[2].contains("engine exited with status 1 (retry in 5.0s)"),
            "{out}"
        );
    }
}
