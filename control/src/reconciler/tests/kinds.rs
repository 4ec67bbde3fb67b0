//! The step plans only what the engine kind can do: an `openai` server never sleeps (its
//! sleep tiers and an eviction stop it, an attached one is left alone), SGLang sleeps at
//! level 1 only and wakes with one resume, and records its state before releasing.

use super::*;
use crate::config::EngineKind;

fn sim(kind: EngineKind, attach: bool, preload: Preload) -> Sim {
    let now = Instant::now();
    let settings = Settings {
        kind,
        ..settings(attach)
    };
    let mut s = Sim {
        m: ModelState::new(settings, preload, now),
        now,
        fx: vec![],
    };
    s.ev(Event::Tick);
    s
}

fn sleeps(fx: &[Effect]) -> bool {
    fx.iter().any(|f| matches!(f, Effect::Sleep { .. }))
}

/// Lets every timer up to `until` fire, collecting the effects.
fn run_until(s: &mut Sim, until: Instant) -> Vec<Effect> {
    let mut all = Vec::new();
    let mut steps = 0;
    while let Some(t) = s.timer().filter(|t| *t <= until) {
        steps += 1;
        assert!(steps < 1000, "the timer keeps firing: {:?}", s.fx);
        s.now = t;
        s.ev(Event::Tick);
        all.extend(s.fx.iter().cloned());
    }
    all
}

#[test]
fn an_openai_server_skips_sleep_tiers_and_its_stop_tier_stops_it() {
    // Tiers: sleep 1 at 10 s, sleep 2 at 20 s, stop at 30 s.
    let mut s = sim(EngineKind::Openai, false, Preload::Awake);
    s.boot();
    let start = s.now;
    let fx = run_until(&mut s, start + secs(29));
    assert!(!sleeps(&fx), "an openai server was put to sleep: {fx:?}");
    assert_eq!(s.m.phase, Phase::Awake);
    let fx = run_until(&mut s, start + secs(31));
    assert!(
        fx.iter().any(|f| matches!(f, Effect::Drain { .. })),
        "{fx:?}"
    );
    assert!(matches!(s.m.phase, Phase::Draining { .. }));
    assert_eq!(s.m.intent.desired, Desired::Stopped);
    let epoch = s.m.epoch;
    s.ev(Event::Drained { epoch, error: None });
    s.term_sent();
}

#[test]
fn an_evicted_openai_server_is_stopped_and_an_attached_one_left_awake() {
    let mut s = sim(EngineKind::Openai, false, Preload::Awake);
    s.boot();
    s.ev(Event::Evict);
    assert!(!sleeps(&s.fx), "{:?}", s.fx);
    assert!(matches!(s.m.phase, Phase::Draining { .. }));
    assert_eq!(
        (s.m.intent.desired, s.m.intent.reason),
        (Desired::Stopped, Reason::Eviction)
    );

    let mut s = sim(EngineKind::Openai, true, Preload::Awake);
    // Attached: probed, never spawned.
    assert!(s.has(|f| matches!(f, Effect::ProbeHealth { .. })));
    s.ev(Event::HealthOk {
        epoch: s.m.epoch,
        asleep: None,
    });
    assert_eq!(s.m.phase, Phase::Awake);
    s.ev(Event::Evict);
    assert!(!sleeps(&s.fx), "{:?}", s.fx);
    assert_eq!(s.m.phase, Phase::Awake);
    assert_eq!(s.m.intent.desired, Desired::Awake);
    // Its tiers ask for nothing either (stop becomes "deepest sleep": none).
    let start = s.now;
    let fx = run_until(&mut s, start + secs(60));
    assert!(!sleeps(&fx), "{fx:?}");
    assert_eq!(s.m.phase, Phase::Awake);
}

#[test]
fn an_operator_sleep_an_openai_server_cannot_do_is_not_planned() {
    let mut s = sim(EngineKind::Openai, false, Preload::Awake);
    s.boot();
    s.ev(Event::Command(Command::Sleep(1)));
    assert!(!sleeps(&s.fx), "{:?}", s.fx);
    assert_eq!(s.m.phase, Phase::Awake);
    // An intent it cannot do (restored from before a config change) becomes a stop.
    s.m.intent.desired = Desired::Asleep(1);
    s.ev(Event::Tick);
    assert!(!sleeps(&s.fx), "{:?}", s.fx);
    assert_eq!(s.m.intent.desired, Desired::Stopped);
}

#[test]
fn sglang_sleeps_at_level_one_only_wakes_with_a_resume_and_records_first() {
    let mut s = sim(EngineKind::Sglang, false, Preload::Awake);
    s.boot();
    let start = s.now;
    let fx = run_until(&mut s, start + secs(10));
    assert!(
        fx.iter()
            .any(|f| matches!(f, Effect::Sleep { level: 1, .. })),
        "{fx:?}"
    );
    // Recorded asleep before the release is done: SGLang cannot be asked later.
    assert!(fx.contains(&Effect::RecordSleepLevel(1)), "{fx:?}");
    s.ev(Event::SleepDone { epoch: s.m.epoch });
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    // The level-2 tier asks for nothing SGLang has: no wake to sleep deeper.
    let fx = run_until(&mut s, start + secs(29));
    assert!(
        !fx.iter()
            .any(|f| matches!(f, Effect::Wake { .. } | Effect::Sleep { .. })),
        "{fx:?}"
    );
    assert_eq!(s.m.phase, Phase::Asleep { level: 1 });
    // A demand wakes it with one resume.
    s.ev(Event::Demand);
    let wake: Vec<WakeCall> =
        s.fx.iter()
            .filter_map(|f| match f {
                Effect::Wake { call, .. } => Some(*call),
                _ => None,
            })
            .collect();
    assert_eq!(wake, [WakeCall::ResumeMemory]);
    s.ev(Event::Admitted { epoch: s.m.epoch });
    s.wake_all();
    assert_eq!(s.m.phase, Phase::Awake);
    // A level SGLang lacks (an operator's, or a restored intent) is its level 1.
    s.m.intent.desired = Desired::Asleep(2);
    s.ev(Event::Tick);
    assert!(
        s.fx.iter()
            .any(|f| matches!(f, Effect::Sleep { level: 1, .. })),
        "{:?}",
        s.fx
    );
}

#[test]
fn a_vllm_engine_still_sleeps_at_both_levels() {
    let mut s = sim(EngineKind::Vllm, false, Preload::Awake);
    s.boot();
    let start = s.now;
    let fx = run_until(&mut s, start + secs(10));
    assert!(
        fx.iter()
            .any(|f| matches!(f, Effect::Sleep { level: 1, .. }))
    );
    // vLLM answers /is_sleeping: nothing recorded until it is asleep.
    assert!(!fx.contains(&Effect::RecordSleepLevel(1)), "{fx:?}");
}
