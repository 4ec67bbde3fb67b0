//! Property tests for the reconciler's pure `step(state, event, now)`.
//!
//! A small model of the world (the runner and the engine processes) turns
//! abstract actions into the events a real runner could deliver, in any
//! order and at any time: results of effects still outstanding (also after
//! their epoch has passed), process exits, spawn outcomes, proxy reports,
//! operator commands, timers. After every step the invariants are checked:
//!
//! - one engine process per model: no `Spawn` while a process of the model
//!   may still run un-killed (and, its own test, while an earlier spawn may
//!   still land);
//! - no `Sleep` or `Suspend` effect while requests are in flight, no
//!   `Sleep` while requests are held except a yield's (a busy model making
//!   room for another: its held requests wait for its next turn), and no
//!   probe, sleep or wake call while the engine is suspending, suspended or
//!   resuming (a request reaching a checkpointed engine kills it);
//! - every transitional phase has a deadline, and the timer fires by then;
//!   a `Tick` past a deadline leaves that deadline behind;
//! - a failed model that should run has a retry time, and the retry backoff
//!   never exceeds `backoff_max`; it counts its engine gone exactly when no
//!   process of its generation is left;
//! - requests held for a model at rest (asleep, stopped, suspended) are a
//!   demand: unless an operator stopped it, it is wanted awake, and no idle
//!   tier fires while any are held;
//! - (strict, its own test) a stop only waits for a process that exists.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use siesta_control::config::{Backoff, EngineKind, IdleAction, IdleTier, Preload, Timeouts};
use siesta_control::reconciler::{
    Command, Desired, Effect, Event, ModelState, Phase, ROOM_WAIT, Reason, SUSPEND_TIMEOUT,
    Settings, step, wake_calls,
};
use std::collections::{BTreeMap, BTreeSet};
use tokio::time::{Duration, Instant};

/// Grace the reconciler gives a SIGKILLed process to be reaped (drive.rs).
const KILL_GRACE: Duration = Duration::from_secs(10);

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn settings() -> impl Strategy<Value = Settings> {
    let tiers = proptest::collection::btree_map(
        1u64..300,
        prop_oneof![
            Just(IdleAction::Sleep(1)),
            Just(IdleAction::Sleep(2)),
            Just(IdleAction::Stop),
            Just(IdleAction::Suspend)
        ],
        0..4,
    )
    .prop_map(|m| {
        m.into_iter()
            .map(|(after, action)| IdleTier {
                after: secs(after),
                action,
            })
            .collect::<Vec<_>>()
    });
    let kind = prop_oneof![
        3 => Just(EngineKind::Vllm),
        1 => Just(EngineKind::Sglang),
        1 => Just(EngineKind::Openai),
    ];
    (
        prop::bool::weighted(0.2),
        tiers,
        [1u64..120, 1..60, 1..60, 1..30],
        (1u64..10, 0u64..300),
        kind,
    )
        .prop_map(
            |(attach, tiers, [start, wake, sleep, grace], (init, extra), kind)| Settings {
                attach,
                kind,
                tiers,
                timeouts: Timeouts {
                    start: secs(start),
                    wake: secs(wake),
                    sleep: secs(sleep),
                    stop_grace: secs(grace),
                },
                backoff: Backoff {
                    initial: secs(init),
                    max: secs(init + extra),
                },
            },
        )
}

/// What happens next, abstractly; `sel` picks among what is outstanding.
#[derive(Debug, Clone)]
enum Action {
    Cmd(Command),
    /// A reload removes or changes the model (only 0 of 0..8: once
    /// retired a model stays so, and most histories should not be).
    Retire(u8),
    Demand,
    Evict,
    /// Admission asks a busy model to yield its GPUs.
    Yield,
    /// Admission found room without that yield.
    CallOffYield,
    /// A probe finds the engine asleep at this level (the current epoch).
    FoundAsleep(u8),
    Pin(Option<u64>),
    Unpin,
    Activity {
        proxy: u8,
        in_flight: u32,
        held: u32,
        active: bool,
    },
    EngineMetrics(u32),
    SpawnOk(usize),
    SpawnFailed(usize),
    Exit(usize),
    Health {
        sel: usize,
        ok: bool,
        asleep: Option<u8>,
    },
    /// A periodic probe failed; `refused`: nothing listened.
    PollFailed(bool),
    Sleep {
        sel: usize,
        ok: bool,
    },
    Wake {
        sel: usize,
        ok: bool,
    },
    Admitted(usize),
    /// A sleep's, stop's or suspend's wait for starts on its GPUs ends.
    FreeBegan(usize),
    Suspend {
        sel: usize,
        ok: bool,
    },
    Resume {
        sel: usize,
        ok: bool,
    },
    Drained {
        sel: usize,
        ok: bool,
    },
    Tick,
}

fn action() -> impl Strategy<Value = Action> {
    let cmd = prop_oneof![
        Just(Command::Wake),
        (1u8..=2).prop_map(Command::Sleep),
        Just(Command::Start),
        Just(Command::Stop),
        Just(Command::Restart),
        Just(Command::Suspend),
    ];
    let sel = any::<usize>();
    prop_oneof![
        2 => cmd.prop_map(Action::Cmd),
        1 => (0u8..8).prop_map(Action::Retire),
        2 => Just(Action::Demand),
        1 => Just(Action::Evict),
        1 => Just(Action::Yield),
        1 => Just(Action::CallOffYield),
        1 => (1u8..=2).prop_map(Action::FoundAsleep),
        1 => proptest::option::of(0u64..120).prop_map(Action::Pin),
        1 => Just(Action::Unpin),
        3 => (0u8..3, 0u32..3, prop_oneof![6 => Just(0u32), 1 => 1u32..3], any::<bool>())
            .prop_map(|(proxy, in_flight, held, active)| Action::Activity {
                proxy,
                in_flight,
                held,
                active,
            }),
        1 => (0u32..3).prop_map(Action::EngineMetrics),
        3 => sel.prop_map(Action::SpawnOk),
        1 => sel.prop_map(Action::SpawnFailed),
        1 => sel.prop_map(Action::Exit),
        3 => (sel, prop::bool::weighted(0.8), proptest::option::of(1u8..=2))
            .prop_map(|(sel, ok, asleep)| Action::Health { sel, ok, asleep }),
        1 => any::<bool>().prop_map(Action::PollFailed),
        3 => (sel, prop::bool::weighted(0.8)).prop_map(|(sel, ok)| Action::Sleep { sel, ok }),
        3 => (sel, prop::bool::weighted(0.8)).prop_map(|(sel, ok)| Action::Wake { sel, ok }),
        1 => sel.prop_map(Action::Admitted),
        1 => sel.prop_map(Action::FreeBegan),
        2 => (sel, prop::bool::weighted(0.8)).prop_map(|(sel, ok)| Action::Suspend { sel, ok }),
        2 => (sel, prop::bool::weighted(0.8)).prop_map(|(sel, ok)| Action::Resume { sel, ok }),
        2 => (sel, prop::bool::weighted(0.8)).prop_map(|(sel, ok)| Action::Drained { sel, ok }),
        3 => Just(Action::Tick),
    ]
}

/// How far the clock moves before an action.
#[derive(Debug, Clone, Copy)]
enum Advance {
    Ms(u64),
    /// To the time of the last `Timer` effect (if later).
    ToTimer,
}

fn advance() -> impl Strategy<Value = Advance> {
    prop_oneof![
        3 => Just(Advance::Ms(0)),
        3 => (1u64..2_000).prop_map(Advance::Ms),
        1 => (2_000u64..400_000).prop_map(Advance::Ms),
        3 => Just(Advance::ToTimer),
    ]
}

/// A spawn the runner was asked for and has not answered yet.
#[derive(Debug, Clone, Copy)]
struct PendingSpawn {
    proc_gen: u64,
    /// The Starting phase it is for (its wait for room ends with `Admitted`).
    epoch: u64,
    /// The runner cancels a spawn when the phase leaves `Starting`; if the
    /// process appears anyway, the runner SIGKILLs it at once.
    cancelled: bool,
}

/// The runner and the processes, as far as the invariants need them.
#[derive(Debug)]
struct World {
    now: Instant,
    m: ModelState,
    timer: Option<Instant>,
    spawns: Vec<PendingSpawn>,
    /// Live engine processes by generation: SIGKILL sent?
    procs: BTreeMap<u64, bool>,
    probes: Vec<u64>,
    sleeps: Vec<u64>,
    /// Epochs of sleeps, stops and suspends whose wait for starts on the
    /// GPUs may end (`FreeBegan`).
    frees: Vec<u64>,
    wakes: Vec<(u64, usize)>,
    suspends: Vec<u64>,
    resumes: Vec<u64>,
    drains: Vec<u64>,
    strict: Strict,
    /// Phases entered (for the generator's own test).
    seen: BTreeSet<&'static str>,
}

/// Checks beyond the main ones, each in its own test.
#[derive(Debug, Clone, Copy, Default)]
struct Strict {
    /// A stop only ever waits for a process that exists.
    stop_needs_process: bool,
}

fn take<T: Copy>(v: &mut Vec<T>, sel: usize) -> Option<T> {
    (!v.is_empty()).then(|| v.remove(sel % v.len()))
}

impl World {
    fn new(settings: Settings, preload: Preload, strict: Strict) -> Self {
        let now = Instant::now();
        let mut w = World {
            now,
            m: ModelState::new(settings, preload, now),
            timer: None,
            spawns: vec![],
            procs: BTreeMap::new(),
            probes: vec![],
            sleeps: vec![],
            frees: vec![],
            wakes: vec![],
            suspends: vec![],
            resumes: vec![],
            drains: vec![],
            strict,
            seen: BTreeSet::new(),
        };
        w.apply(Event::Tick).unwrap();
        w
    }

    /// The event a runner would deliver for `a` now (None: nothing happens).
    fn event(&mut self, a: Action) -> Option<Event> {
        let epoch = self.m.epoch;
        Some(match a {
            Action::Cmd(c) => Event::Command(c),
            Action::Retire(0) => Event::Retire,
            Action::Retire(_) => return None,
            Action::Demand => Event::Demand,
            Action::Evict => Event::Evict,
            Action::Yield => Event::Yield { to: "other".into() },
            Action::CallOffYield => Event::CallOffYield {
                to: "other".into(),
                why: "found room without it",
            },
            Action::FoundAsleep(level) => Event::FoundAsleep { epoch, level },
            Action::Pin(s) => Event::Pin(s.map(|s| self.now + secs(s))),
            Action::Unpin => Event::Unpin,
            Action::Activity {
                proxy,
                in_flight,
                held,
                active,
            } => Event::Activity {
                proxy: format!("proxy-{proxy}"),
                in_flight,
                held,
                active,
                last_finished: active.then_some(self.now),
            },
            Action::EngineMetrics(running) => Event::EngineMetrics { running },
            Action::SpawnOk(sel) => {
                let s = take(&mut self.spawns, sel)?;
                // A cancelled spawn's process is killed by the runner at
                // once; `step` decides about the others (KeepSpawned or
                // KillStray).
                self.procs.insert(s.proc_gen, s.cancelled);
                Event::Spawned {
                    proc_gen: s.proc_gen,
                    pid: 1000 + s.proc_gen as u32,
                }
            }
            Action::SpawnFailed(sel) => {
                let s = take(&mut self.spawns, sel)?;
                Event::SpawnFailed {
                    proc_gen: s.proc_gen,
                    error: "no such file".into(),
                }
            }
            Action::Exit(sel) => {
                let gens: Vec<u64> = self.procs.keys().copied().collect();
                let g = *gens.get(sel % gens.len().max(1))?;
                self.procs.remove(&g);
                Event::ChildExited {
                    proc_gen: g,
                    status: "signal: 9".into(),
                    cause: None,
                }
            }
            Action::Health { sel, ok, asleep } => {
                if ok {
                    let epoch = take(&mut self.probes, sel)?;
                    let asleep = if self.m.settings.attach { asleep } else { None };
                    Event::HealthOk { epoch, asleep }
                } else {
                    // A probe never ends in failure: the runner's probe polls
                    // until the engine answers (runner/effects.rs,
                    // `ProbeHealth`). A failure is a periodic poll's, seen
                    // while the probe still runs.
                    let epoch = *self.probes.get(sel % self.probes.len().max(1))?;
                    Event::HealthFailed {
                        epoch,
                        error: "refused".into(),
                        timed_out: false,
                        refused: true,
                    }
                }
            }
            Action::PollFailed(refused) => Event::HealthFailed {
                epoch,
                error: "poll: refused".into(),
                timed_out: false,
                refused,
            },
            Action::Sleep { sel, ok } => {
                let epoch = take(&mut self.sleeps, sel)?;
                if ok {
                    Event::SleepDone { epoch }
                } else {
                    Event::SleepFailed {
                        epoch,
                        error: "500".into(),
                    }
                }
            }
            Action::Wake { sel, ok } => {
                let (epoch, step) = take(&mut self.wakes, sel)?;
                if ok {
                    Event::WakeStepDone { epoch, step }
                } else {
                    Event::WakeFailed {
                        epoch,
                        error: "500".into(),
                    }
                }
            }
            Action::Suspend { sel, ok } => {
                let epoch = take(&mut self.suspends, sel)?;
                if ok {
                    Event::SuspendDone { epoch }
                } else if sel % 2 == 1 {
                    // A demand held while proxies confirmed.
                    Event::SuspendCalledOff { epoch }
                } else {
                    Event::SuspendFailed {
                        epoch,
                        error: "driver has no cuCheckpointProcessLock".into(),
                    }
                }
            }
            Action::Resume { sel, ok } => {
                let epoch = take(&mut self.resumes, sel)?;
                if ok {
                    Event::ResumeDone { epoch }
                } else {
                    Event::ResumeFailed {
                        epoch,
                        error: "CUDA_ERROR_OPERATING_SYSTEM".into(),
                    }
                }
            }
            Action::Drained { sel, ok } => {
                let epoch = take(&mut self.drains, sel)?;
                let error = (!ok).then(|| "proxy p has 1 request(s) in flight".to_string());
                Event::Drained { epoch, error }
            }
            Action::Admitted(sel) => {
                let steps0: Vec<u64> = self
                    .wakes
                    .iter()
                    .filter(|(_, s)| *s == 0)
                    .map(|(e, _)| *e)
                    .chain(self.resumes.iter().copied())
                    .chain(self.spawns.iter().map(|s| s.epoch))
                    .collect();
                let epoch = *steps0.get(sel % steps0.len().max(1))?;
                Event::Admitted { epoch }
            }
            Action::FreeBegan(sel) => Event::FreeBegan {
                epoch: take(&mut self.frees, sel)?,
            },
            Action::Tick => Event::Tick,
        })
    }

    /// One step, its effects carried out on the world, invariants checked.
    fn apply(&mut self, event: Event) -> Result<(), TestCaseError> {
        let now = self.now;
        let prev = self.m.clone();
        let is_tick = event == Event::Tick;
        let (m, fx) = step(prev.clone(), event.clone(), now);
        self.m = m;
        let m = &self.m;
        self.seen.insert(phase_name(&m.phase));
        let ctx = || {
            format!(
                "at +{:?}: {prev:?}\n  --{event:?}-->\n  {m:?}\n  effects {fx:?}",
                now
            )
        };

        for e in &fx {
            match *e {
                Effect::KillStray { proc_gen } => {
                    prop_assert!(
                        proc_gen != m.proc_gen || !matches!(m.phase, Phase::Starting { .. }),
                        "the wanted spawn was killed\n{}",
                        ctx()
                    );
                    if let Some(k) = self.procs.get_mut(&proc_gen) {
                        *k = true;
                    }
                }
                Effect::KeepSpawned { proc_gen } => {
                    prop_assert_eq!(proc_gen, m.proc_gen, "kept a stale spawn\n{}", ctx());
                }
                Effect::Spawn { proc_gen, .. } => {
                    prop_assert!(!m.settings.attach, "spawn for an attach engine\n{}", ctx());
                    let alive: Vec<_> = self.procs.iter().filter(|(_, k)| !**k).collect();
                    prop_assert!(
                        alive.is_empty(),
                        "spawn while {alive:?} runs un-killed\n{}",
                        ctx()
                    );
                    // The runner cancels a spawn still on its way before it
                    // carries out a new one (runner/effects.rs `spawn_engine`).
                    self.spawns.iter_mut().for_each(|s| s.cancelled = true);
                    prop_assert_eq!(proc_gen, m.proc_gen);
                    let starting = matches!(m.phase, Phase::Starting { spawned: false, .. });
                    prop_assert!(starting, "spawn outside Starting\n{}", ctx());
                    self.spawns.push(PendingSpawn {
                        proc_gen,
                        epoch: m.epoch,
                        cancelled: false,
                    });
                }
                Effect::Terminate { epoch } => {
                    prop_assert!(!m.settings.attach, "signal to an attach engine\n{}", ctx());
                    prop_assert!(
                        matches!(m.phase, Phase::Stopping { killed: false, .. }),
                        "SIGTERM outside Stopping\n{}",
                        ctx()
                    );
                    self.frees.push(epoch);
                }
                Effect::Kill => {
                    prop_assert!(!m.settings.attach, "signal to an attach engine\n{}", ctx());
                    self.procs.values_mut().for_each(|k| *k = true);
                }
                Effect::ProbeHealth { epoch, .. } => self.probes.push(epoch),
                Effect::Sleep { epoch, level } => {
                    prop_assert_eq!(m.in_flight(), 0, "sleep with requests in flight\n{}", ctx());
                    // Only a yield sleeps with requests held: they wait for
                    // its next turn, the model asks for its GPUs again.
                    // (The `Drained` that ends a yield may start its sleep
                    // in the same step.)
                    if !matches!(prev.phase, Phase::Yielding { .. }) {
                        prop_assert_eq!(m.held(), 0, "sleep with requests held\n{}", ctx());
                    }
                    prop_assert!((1..=2).contains(&level));
                    // Only what the engine kind can do is ever planned.
                    prop_assert!(
                        m.settings.kind.can_sleep(level),
                        "sleep at level {} of an engine = {}\n{}",
                        level,
                        m.settings.kind,
                        ctx()
                    );
                    prop_assert_eq!(
                        m.phase,
                        Phase::Sleeping {
                            level,
                            deadline: m.phase.deadline().unwrap()
                        }
                    );
                    self.sleeps.push(epoch);
                    self.frees.push(epoch);
                }
                Effect::Wake { epoch, step, call } => {
                    let Phase::Waking { from_level, .. } = m.phase else {
                        return Err(TestCaseError::fail(format!(
                            "wake call outside Waking\n{}",
                            ctx()
                        )));
                    };
                    prop_assert_eq!(call, wake_calls(m.settings.kind, from_level)[step]);
                    self.wakes.push((epoch, step));
                }
                Effect::Suspend { epoch } => {
                    prop_assert_eq!(
                        m.in_flight(),
                        0,
                        "suspend with requests in flight\n{}",
                        ctx()
                    );
                    prop_assert!(
                        !m.settings.attach,
                        "suspend of an attached engine\n{}",
                        ctx()
                    );
                    prop_assert!(
                        matches!(m.phase, Phase::Suspending { .. }),
                        "suspend outside Suspending\n{}",
                        ctx()
                    );
                    self.suspends.push(epoch);
                    self.frees.push(epoch);
                }
                Effect::Resume { epoch } => {
                    prop_assert!(
                        matches!(m.phase, Phase::Resuming { .. }),
                        "resume outside Resuming\n{}",
                        ctx()
                    );
                    self.resumes.push(epoch);
                }
                Effect::Drain { epoch } => {
                    // An attached engine is never stopped, but it may yield.
                    let yielding = matches!(m.phase, Phase::Yielding { drained: false, .. });
                    prop_assert!(
                        !m.settings.attach || yielding,
                        "drain of an attached engine\n{}",
                        ctx()
                    );
                    prop_assert!(
                        matches!(m.phase, Phase::Draining { .. }) || yielding,
                        "drain outside Draining or Yielding\n{}",
                        ctx()
                    );
                    self.drains.push(epoch);
                }
                Effect::Timer(t) => self.timer = t,
                Effect::RecordSuspended { .. } => {}
                Effect::ReleaseStartLock
                | Effect::Log(_)
                | Effect::Persist
                | Effect::PersistHistory
                | Effect::PersistCalibration
                | Effect::RecordSleepLevel(_)
                | Effect::MeasureResidual => {}
            }
        }
        // Nothing reaches an engine whose CUDA state is (being) checkpointed.
        if m.phase.untouchable() {
            let touches = fx.iter().any(|f| {
                matches!(
                    f,
                    Effect::ProbeHealth { .. } | Effect::Sleep { .. } | Effect::Wake { .. }
                )
            });
            prop_assert!(!touches, "a call planned to a suspended engine\n{}", ctx());
        }
        // The runner cancels a pending spawn once the phase leaves Starting.
        if m.epoch != prev.epoch && !matches!(m.phase, Phase::Starting { .. }) {
            self.spawns.iter_mut().for_each(|s| s.cancelled = true);
        }

        prop_assert!(
            matches!(fx.last(), Some(Effect::Timer(_))),
            "step must end with its timer\n{}",
            ctx()
        );
        let t = &m.settings.timeouts;
        let longest = t.start * 2
            + t.wake
            + t.sleep
            + t.stop_grace
            + KILL_GRACE
            + ROOM_WAIT
            + SUSPEND_TIMEOUT;
        if let Some(deadline) = m.phase.deadline() {
            prop_assert!(
                self.timer.is_some_and(|at| at <= deadline),
                "timer after the deadline\n{}",
                ctx()
            );
            prop_assert!(deadline <= now + longest, "deadline too far\n{}", ctx());
        }
        if is_tick
            && let Some(old) = prev.phase.deadline()
            && old <= now
        {
            prop_assert!(
                m.phase.deadline().is_none_or(|d| d > now),
                "a tick past the deadline left it in force\n{}",
                ctx()
            );
        }
        if let Phase::Failed {
            retry_at,
            process_gone,
        } = m.phase
        {
            // Gone exactly when no process of its generation is left: not
            // before (its GPU memory would count as free while SIGKILLed
            // processes still hold it), and never waiting for one that
            // does not exist (its exit, which ends the wait, never comes:
            // the GPUs would count as taken for ever).
            if !m.settings.attach {
                let alive = self.procs.contains_key(&m.proc_gen);
                prop_assert_eq!(
                    process_gone,
                    !alive,
                    "failed, process_gone {} with generation {} {}\n{}",
                    process_gone,
                    m.proc_gen,
                    if alive { "alive" } else { "gone" },
                    ctx()
                );
            }
            // A retry waits for the exit, which wakes it: no timer (one
            // for a retry already due would fire for ever).
            let exiting = !process_gone && !m.settings.attach;
            match retry_at {
                None => prop_assert!(
                    m.intent.desired == Desired::Stopped,
                    "failed with no retry though wanted\n{}",
                    ctx()
                ),
                Some(at) => {
                    prop_assert!(
                        at <= now + m.settings.backoff.max,
                        "backoff over the cap\n{}",
                        ctx()
                    );
                    prop_assert!(
                        exiting || self.timer.is_some_and(|t| t <= at),
                        "no timer for the retry\n{}",
                        ctx()
                    );
                }
            }
        }
        prop_assert!(m.backoff() <= m.settings.backoff.max);
        let at_rest = matches!(
            m.phase,
            Phase::Asleep { .. } | Phase::Stopped | Phase::Suspended { .. }
        );
        let operator_stop =
            m.intent.desired == Desired::Stopped && m.intent.reason == Reason::Operator;
        if m.held() > 0 && at_rest && !operator_stop && !m.retiring {
            prop_assert_eq!(
                m.intent.desired,
                Desired::Awake,
                "requests held for a model at rest that is not wanted awake\n{}",
                ctx()
            );
        }
        if m.held() > 0 {
            prop_assert!(
                m.intent.reason != Reason::IdleTier || prev.intent.reason == Reason::IdleTier,
                "an idle tier fired with requests held\n{}",
                ctx()
            );
        }
        if self.strict.stop_needs_process {
            let entered_stopping = matches!(m.phase, Phase::Stopping { .. })
                && !matches!(prev.phase, Phase::Stopping { .. });
            prop_assert!(
                !entered_stopping || self.procs.contains_key(&m.proc_gen),
                "stopping waits for generation {} which has no process (pid {:?})\n{}",
                m.proc_gen,
                m.pid,
                ctx()
            );
        }
        Ok(())
    }

    fn run(&mut self, steps: Vec<(Advance, Action)>) -> Result<(), TestCaseError> {
        for (adv, a) in steps {
            match adv {
                Advance::Ms(ms) => self.now += Duration::from_millis(ms),
                Advance::ToTimer => {
                    if let Some(t) = self.timer {
                        self.now = self.now.max(t);
                    }
                }
            }
            if let Some(ev) = self.event(a) {
                self.apply(ev)?;
            }
        }
        Ok(())
    }
}

fn phase_name(p: &Phase) -> &'static str {
    match p {
        Phase::Stopped => "Stopped",
        Phase::Starting { spawned: false, .. } => "Starting(waiting)",
        Phase::Starting { spawned: true, .. } => "Starting(spawned)",
        Phase::Awake => "Awake",
        Phase::Sleeping { .. } => "Sleeping",
        Phase::Asleep { level: 1 } => "Asleep(1)",
        Phase::Asleep { .. } => "Asleep(2)",
        Phase::Waking { step: 0, .. } => "Waking(0)",
        Phase::Waking { .. } => "Waking(n)",
        Phase::Draining { .. } => "Draining",
        Phase::Yielding { drained: false, .. } => "Yielding",
        Phase::Yielding { drained: true, .. } => "Yielding(drained)",
        Phase::Stopping { killed: false, .. } => "Stopping",
        Phase::Stopping { killed: true, .. } => "Stopping(killed)",
        Phase::Failed { .. } => "Failed",
        Phase::Suspending { .. } => "Suspending",
        Phase::Suspended { .. } => "Suspended",
        Phase::Resuming { .. } => "Resuming",
    }
}

/// The properties are only as good as the states they reach: the generator
/// must drive the machine through every phase.
#[test]
fn the_generator_reaches_every_phase() {
    let mut runner = TestRunner::deterministic();
    let case = (
        settings(),
        preload(),
        proptest::collection::vec((advance(), action()), 1..80),
    );
    let mut seen = BTreeSet::new();
    for _ in 0..1200 {
        let (settings, preload, steps) = case.new_tree(&mut runner).unwrap().current();
        let mut w = World::new(settings, preload, Strict::default());
        w.run(steps).unwrap();
        seen.extend(w.seen);
    }
    for p in [
        "Stopped",
        "Starting(waiting)",
        "Starting(spawned)",
        "Awake",
        "Sleeping",
        "Asleep(1)",
        "Asleep(2)",
        "Waking(0)",
        "Waking(n)",
        "Draining",
        "Yielding",
        "Yielding(drained)",
        "Stopping",
        "Stopping(killed)",
        "Failed",
        "Suspending",
        "Suspended",
        "Resuming",
    ] {
        assert!(seen.contains(p), "never reached {p}; reached {seen:?}");
    }
}

fn preload() -> impl Strategy<Value = Preload> {
    prop_oneof![
        Just(Preload::None),
        Just(Preload::Asleep),
        Just(Preload::Awake)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_for_any_event_sequence(
        settings in settings(),
        preload in preload(),
        steps in proptest::collection::vec((advance(), action()), 1..80),
    ) {
        World::new(settings, preload, Strict::default()).run(steps)?;
    }

    /// `Stopping` ends when the current generation's process exits; entering
    /// it with no such process can only end in a timeout and a failure.
    ///
    /// Found by this test: `start` kept the previous generation's `pid`, so
    /// a Stop before the new spawn landed waited for a process long gone and
    /// counted a failure. `start` now clears it.
    #[test]
    fn stop_waits_only_for_a_live_process(
        settings in settings(),
        preload in preload(),
        steps in proptest::collection::vec((advance(), action()), 1..80),
    ) {
        let strict = Strict { stop_needs_process: true };
        World::new(settings, preload, strict).run(steps)?;
    }

    #[test]
    fn backoff_grows_and_is_capped(init in 0u64..100_000, extra in 0u64..10_000_000, f in 0u32..100) {
        let b = Backoff { initial: Duration::from_millis(init), max: Duration::from_millis(init + extra) };
        prop_assert!(b.delay(f) <= b.max);
        prop_assert!(b.delay(f) <= b.delay(f.saturating_add(1)));
        prop_assert!(b.delay(u32::MAX) <= b.max);
    }
}

// The crate root is this file, so its submodule needs the path.
#[path = "reconciler_props/demand.rs"]
mod demand;
