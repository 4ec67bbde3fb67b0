//! `Config::parse` on arbitrary text.
//!
//! Invariants: no panic; an error names the file on every line, one line per
//! problem (`fuzz.toml: KEY: what is wrong`); an accepted config has unique
//! model names and aliases, and the reconciler runs each of its models
//! through a start, a sleep, a wake, a failure and a stop without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use siesta_control::config::{Config, ModelConfig};
use siesta_control::reconciler::{Command, Effect, Event, ModelState, Settings, step};
use std::collections::BTreeSet;
use tokio::time::{Duration, Instant};

const ORIGIN: &str = "fuzz.toml";

/// Known finding (control/tests/config_regressions.rs): a quoted TOML key
/// with a line break is echoed raw in the problem's key, so one problem takes
/// two lines. Not asserted while true, so that fuzzing goes on past it.
const KNOWN_KEY_NEWLINE: bool = true;

/// Drives one model's state machine with the events a healthy engine sends.
fn exercise(m: &ModelConfig) {
    let now = Instant::now();
    let _ = m.backoff.delay(u32::MAX);
    let mut s = ModelState::new(Settings::from_config(m), m.preload, now);
    let mut t = now;
    let script = [
        Event::Command(Command::Start),
        Event::Spawned {
            proc_gen: 1,
            pid: 42,
        },
        Event::HealthOk {
            epoch: 0,
            asleep: None,
        },
        Event::Command(Command::Sleep(2)),
        Event::SleepDone { epoch: 0 },
        Event::Demand,
        Event::WakeStepDone { epoch: 0, step: 0 },
        Event::Tick,
        Event::WakeFailed {
            epoch: 0,
            error: "x".into(),
        },
        Event::Command(Command::Stop),
        Event::Tick,
        Event::ChildExited {
            proc_gen: 1,
            status: "killed".into(),
            cause: None,
        },
        Event::Tick,
    ];
    for ev in script {
        // Results carry the current epoch, as the runner's would.
        let ev = match ev {
            Event::HealthOk { asleep, .. } => Event::HealthOk {
                epoch: s.epoch,
                asleep,
            },
            Event::SleepDone { .. } => Event::SleepDone { epoch: s.epoch },
            Event::WakeStepDone { step, .. } => Event::WakeStepDone {
                epoch: s.epoch,
                step,
            },
            Event::WakeFailed { error, .. } => Event::WakeFailed {
                epoch: s.epoch,
                error,
            },
            Event::Spawned { pid, .. } => Event::Spawned {
                proc_gen: s.proc_gen,
                pid,
            },
            Event::ChildExited { status, cause, .. } => Event::ChildExited {
                proc_gen: s.proc_gen,
                status,
                cause,
            },
            other => other,
        };
        let (next, fx) = step(s, ev, t);
        s = next;
        // Jump to the next timer, as the runner would.
        if let Some(Effect::Timer(Some(at))) = fx.last() {
            t = (*at).max(t);
        }
        t += Duration::from_millis(1);
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Config::parse(text, ORIGIN) {
        Err(e) => {
            assert!(!e.problems.is_empty(), "an error with no problem");
            assert_eq!(e.origin, ORIGIN);
            let expected: Vec<String> = e
                .problems
                .iter()
                .map(|p| {
                    if p.key.is_empty() {
                        format!("{ORIGIN}: {}", p.message)
                    } else {
                        format!("{ORIGIN}: {}: {}", p.key, p.message)
                    }
                })
                .collect();
            assert_eq!(e.to_string(), expected.join("\n"));
            // One line per problem: nothing in a problem may break the line.
            for p in &e.problems {
                assert!(
                    !p.message.contains(['\n', '\r']),
                    "message breaks the line: {p:?}"
                );
                if !KNOWN_KEY_NEWLINE {
                    assert!(!p.key.contains(['\n', '\r']), "key breaks the line: {p:?}");
                }
            }
        }
        Ok(c) => {
            assert_eq!(c.origin, ORIGIN);
            let mut names = BTreeSet::new();
            for m in &c.models {
                for n in std::iter::once(&m.name).chain(&m.aliases) {
                    assert!(names.insert(n.clone()), "name {n:?} used twice");
                }
                exercise(m);
            }
        }
    }
});
