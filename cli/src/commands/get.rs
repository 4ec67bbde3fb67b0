//! `siesta get MODEL`: everything about one model.

use std::fmt::Write as _;

use serde::Serialize;
use siesta_proto::v1 as pb;

use super::print_json;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;
use crate::render;
use crate::view::{IntentView, ModelPlacementView, ModelView};

#[derive(Debug, Serialize)]
struct GetView {
    model: Option<ModelView>,
    placement: Option<ModelPlacementView>,
}

pub async fn run(conn: Conn, name: &str, format: Format) -> Result<(), Failure> {
    let resp = conn
        .call(|mut c| async move {
            c.get_model(pb::GetModelRequest {
                name: name.to_owned(),
            })
            .await
        })
        .await?;
    match format {
        Format::Json => print_json(&GetView {
            model: resp.model.as_ref().map(ModelView::from),
            placement: resp.placement.as_ref().map(ModelPlacementView::from),
        }),
        Format::Text => {
            let model = resp
                .model
                .ok_or_else(|| Failure::Failed(format!("no status for {name:?}")))?;
            print!(
                "{}",
                describe(render::now_ms(), &model, resp.placement.as_ref())
            );
            Ok(())
        }
    }
}

/// `key: value` lines, grouped like `kubectl describe`.
pub fn describe(now: i64, m: &pb::ModelStatus, placement: Option<&pb::ModelPlacement>) -> String {
    let mut o = String::new();
    let kv = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "{:<18}{v}", format!("{k}:"));
    };
    kv(&mut o, "Name", m.name.clone());
    if !m.aliases.is_empty() {
        kv(&mut o, "Aliases", m.aliases.join(", "));
    }
    kv(&mut o, "Model", m.model.clone());
    kv(&mut o, "Launch", m.launch.clone());
    if !m.engine.is_empty() {
        kv(&mut o, "Engine", m.engine.clone());
    }
    if let Some(c) = &m.capabilities {
        kv(&mut o, "Can", render::capabilities(c));
    }
    if !m.control_id.is_empty() {
        kv(&mut o, "Control", m.control_id.clone());
    }
    let state = match m.state_since_unix_ms {
        0 => render::state_label(m),
        since => format!("{} for {}", render::state_label(m), render::ago(now, since)),
    };
    kv(&mut o, "State", state);
    if m.deadline_unix_ms > 0 {
        kv(&mut o, "Deadline", render::until(now, m.deadline_unix_ms));
    }
    if let Some(i) = &m.intent {
        let v = IntentView::from(i);
        let mut s = v.desired.to_string();
        if v.desired == "asleep" && v.level > 0 {
            s += &format!(" (level {})", v.level);
        }
        s += &format!(
            ", by {}, since {} ago",
            v.reason,
            render::ago(now, v.since_unix_ms)
        );
        if v.until_unix_ms > 0 {
            s += &format!(", until {}", render::until(now, v.until_unix_ms));
        }
        kv(&mut o, "Intent", s);
    }
    if !m.waiting_for.is_empty() {
        kv(&mut o, "Waiting for", m.waiting_for.clone());
    }
    for (i, e) in m.endpoints.iter().enumerate() {
        let k = if i == 0 { "Endpoints" } else { "" };
        kv(
            &mut o,
            k,
            format!("{} (model {:?})", e.url, e.served_model_name),
        );
    }
    kv(&mut o, "GPUs", render::gpus(&m.gpus));
    if m.pid > 0 {
        kv(&mut o, "PID", m.pid.to_string());
    }
    kv(&mut o, "Restarts", m.restarts.to_string());
    if !m.warning.is_empty() {
        kv(&mut o, "Warning", m.warning.clone());
    }
    if !m.gpus.is_empty() {
        kv(
            &mut o,
            "Asleep holds",
            format!(
                "{} per GPU",
                render::residual(m.asleep_residual_bytes, m.asleep_residual_measured)
            ),
        );
    }
    if m.p2p_disabled {
        kv(
            &mut o,
            "P2P",
            "disabled (NCCL_P2P_DISABLE=1, --disable-custom-all-reduce)".into(),
        );
    }
    kv(&mut o, "In flight", m.in_flight.to_string());
    kv(&mut o, "Held", m.held.to_string());
    kv(
        &mut o,
        "Last activity",
        ago_words(now, m.last_activity_unix_ms),
    );
    kv(&mut o, "Next tier", render::next_tier(now, m));
    if m.pinned_until_unix_ms > 0 {
        kv(
            &mut o,
            "Pinned",
            render::until(now, m.pinned_until_unix_ms).replace("in ", "for "),
        );
    }
    if let Some(h) = &m.hold {
        kv(
            &mut o,
            "Hold",
            format!(
                "queue {} requests, at most {}",
                h.max_queue,
                render::duration(h.max_hold_ms)
            ),
        );
    }
    kv(&mut o, "Last error", render::or_dash(&m.last_error));
    if m.failures > 0 {
        kv(&mut o, "Failures", m.failures.to_string());
    }
    if m.retry_at_unix_ms > 0 {
        kv(&mut o, "Retry", render::until(now, m.retry_at_unix_ms));
    }
    o.push_str("Calibration:\n");
    let c = m.calibration.unwrap_or_default();
    for (k, ms, n) in [
        ("start", c.start_ms, c.start_samples),
        ("wake level 1", c.wake_l1_ms, c.wake_l1_samples),
        ("wake level 2", c.wake_l2_ms, c.wake_l2_samples),
        ("sleep level 1", c.sleep_l1_ms, c.sleep_l1_samples),
        ("sleep level 2", c.sleep_l2_ms, c.sleep_l2_samples),
    ] {
        let v = if ms == 0 {
            "not measured yet".into()
        } else {
            format!(
                "{} ({n} sample{})",
                render::duration(ms),
                if n == 1 { "" } else { "s" }
            )
        };
        kv(&mut o, &format!("  {k}"), v);
    }
    if let Some(p) = placement {
        o.push_str("Placement:\n");
        kv(&mut o, "  GPUs", render::gpus(&p.gpus));
        if p.awake_bytes_per_gpu > 0 {
            kv(
                &mut o,
                "  Awake",
                format!("{} per GPU", render::bytes(p.awake_bytes_per_gpu)),
            );
        }
        if p.gpu_memory_utilization > 0.0 {
            kv(
                &mut o,
                "  Utilization",
                format!("{:.2}", p.gpu_memory_utilization),
            );
        }
        kv(&mut o, "  Exclusive", yes_no(p.exclusive));
        kv(&mut o, "  P2P disabled", yes_no(p.p2p_disabled));
        kv(&mut o, "  Reason", render::or_dash(&p.reason));
    }
    o
}

fn ago_words(now: i64, t: i64) -> String {
    if t <= 0 {
        "never".into()
    } else {
        format!("{} ago", render::ago(now, t))
    }
}

fn yes_no(b: bool) -> String {
    if b { "yes".into() } else { "no".into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_includes_calibration_and_placement() {
        let m = pb::ModelStatus {
            name: "chat".into(),
            state: pb::ModelState::Awake as i32,
            calibration: Some(pb::Calibration {
                wake_l1_ms: 1500,
                wake_l1_samples: 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        let p = pb::ModelPlacement {
            gpus: vec![0, 1],
            p2p_disabled: true,
            reason: "TP=2".into(),
            ..Default::default()
        };
        let out = describe(10_000, &m, Some(&p));
        let line = |k: &str| {
            out.lines()
                .find(|l| l.trim_start().starts_with(k))
                .unwrap_or("")
                .to_owned()
        };
        assert!(
            line("wake level 1:").ends_with(" 1.5s (3 samples)"),
            "{out}"
        );
        assert!(line("start:").ends_with(" not measured yet"), "{out}");
        assert!(
            line("sleep level 2:").ends_with(" not measured yet"),
            "{out}"
        );
        assert!(line("P2P disabled:").ends_with(" yes"), "{out}");
        assert!(line("Reason:").ends_with(" TP=2"), "{out}");
        assert_eq!(line("State:"), "State:            awake");
    }
}
