//! Absent values are `None` in the domain status and proto3 zero values
//! (or `i64::MAX` for a pin without end) only on the wire.

use super::*;
use crate::api::convert;
use crate::config::Config;
use crate::reconciler::{ModelState, Phase, Pin, Settings};
use std::time::Duration;

fn facts() -> EngineFacts {
    EngineFacts {
        endpoint: Endpoint {
            url: "http://127.0.0.1:1".into(),
            served_model_name: "m".into(),
        },
        gpus: vec![],
        p2p_disabled: false,
        control_id: "t".into(),
        waiting_for: String::new(),
        asleep_residual: Residual::default(),
    }
}

fn status_of(f: impl FnOnce(&mut ModelState, Instant)) -> (ModelStatus, Clock) {
    let cfg = Config::demo(vec!["fake-vllm".into()]).models.remove(0);
    let clock = Clock::new();
    let now = Instant::now();
    let mut m = ModelState::new(Settings::from_config(&cfg), cfg.preload, now);
    f(&mut m, now);
    (model_status(&cfg, &facts(), &m, &clock, now), clock)
}

#[tokio::test]
async fn a_fresh_model_has_nothing_set() {
    let (s, _) = status_of(|_, _| {});
    assert_eq!(s.pid, None);
    assert_eq!(s.pin, PinView::None);
    assert_eq!(s.deadline_unix_ms, None);
    assert_eq!(s.retry_at_unix_ms, None);
    assert_eq!(s.last_activity_unix_ms, None);
    assert_eq!(s.intent.until_unix_ms, None);
    assert_eq!(s.last_error, None);
    assert_eq!(s.waiting_for, None);
    let w = convert::model_status(&s);
    assert_eq!(
        (
            w.pid,
            w.pinned_until_unix_ms,
            w.deadline_unix_ms,
            w.retry_at_unix_ms,
            w.last_activity_unix_ms,
            w.last_error.as_str(),
            w.waiting_for.as_str()
        ),
        (0, 0, 0, 0, 0, "", "")
    );
    assert_eq!(w.intent.unwrap().until_unix_ms, 0);
}

#[tokio::test]
async fn set_values_are_kept_and_sent() {
    let (s, clock) = status_of(|m, now| {
        m.pid = Some(4242);
        m.pin = Pin::Until(now + Duration::from_secs(60));
        m.phase = Phase::Failed {
            retry_at: Some(now + Duration::from_secs(5)),
            process_gone: true,
        };
        m.last_activity = Some(now);
        m.last_error = Some("start timed out".into());
    });
    let now_ms = clock.now_ms();
    assert_eq!(s.pid, Some(4242));
    let PinView::Until(pin_at) = s.pin else {
        panic!("{:?}", s.pin)
    };
    assert!(
        (pin_at - now_ms - 60_000).abs() < 1_000,
        "{pin_at} vs {now_ms}"
    );
    let retry = s.retry_at_unix_ms.expect("retry time");
    assert!(
        (retry - now_ms - 5_000).abs() < 1_000,
        "{retry} vs {now_ms}"
    );
    assert!(s.last_activity_unix_ms.is_some());
    let w = convert::model_status(&s);
    assert_eq!(w.pid, 4242);
    assert_eq!(w.pinned_until_unix_ms, pin_at);
    assert_eq!(w.retry_at_unix_ms, retry);
    assert_eq!(w.last_error, "start timed out");
}

#[tokio::test]
async fn a_pin_without_end_is_forever_and_max_on_the_wire() {
    let (s, _) = status_of(|m, _| m.pin = Pin::Forever);
    assert_eq!(s.pin, PinView::Forever);
    assert!(s.pin.is_pinned());
    assert_eq!(convert::model_status(&s).pinned_until_unix_ms, i64::MAX);
}

#[tokio::test]
async fn a_transition_has_a_deadline() {
    let (s, clock) = status_of(|m, now| {
        m.phase = Phase::Starting {
            deadline: now + Duration::from_secs(20),
            spawned: false,
            admitted: true,
        };
    });
    let d = s.deadline_unix_ms.expect("deadline");
    assert!((d - clock.now_ms() - 20_000).abs() < 1_000);
    assert_eq!(
        s.waiting_for.as_deref(),
        Some("the engine process to be spawned")
    );
}

/// A yielding model is published as going to sleep (proxies hold its new
/// requests), says why, and carries the yields it gave up (admission
/// lengthens its turn by them).
#[tokio::test]
async fn a_yielding_model_is_published_as_sleeping_with_why() {
    let (s, _) = status_of(|m, now| {
        m.phase = Phase::Yielding {
            level: 1,
            deadline: now + Duration::from_secs(30),
            drained: false,
        };
        m.engine_running = 2;
        m.yields_given_up = 3;
    });
    assert_eq!((s.state, s.sleep_level), (State::Sleeping, 1));
    assert!(s.deadline_unix_ms.is_some());
    let why = s.waiting_for.unwrap_or_default();
    assert!(
        why.contains("yielding its GPUs: 2 request(s) in flight to finish"),
        "{why}"
    );
    assert_eq!(s.yields_given_up, 3);
}

/// A waking model says the level it wakes from: the proxies estimate its
/// wait by it (shedding a request whose level-2 wake outlasts its hold),
/// and the CLI and web page time its progress by it. It was 0, so every
/// waking model was timed as a level-1 wake.
#[tokio::test]
async fn a_waking_model_says_the_level_it_wakes_from() {
    for level in [1, 2] {
        let (s, _) = status_of(|m, now| {
            m.phase = Phase::Waking {
                from_level: level,
                step: 0,
                deadline: now + Duration::from_secs(30),
                admitted: true,
                left: None,
                budget: Duration::from_secs(30),
            };
        });
        assert_eq!((s.state, s.sleep_level), (State::Waking, level));
    }
}
