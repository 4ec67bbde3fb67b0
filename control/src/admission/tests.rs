//! The admission queue over random inventories and random sequences of
//! demands, finished requests and engine steps: a GPU is never promised
//! twice, a model with requests in flight is never evicted, and once
//! traffic stops every waiting model is admitted (no deadlock).

use super::queue::{Ask, Core};
use super::*;
use crate::config::Config;
use crate::reconciler::{Desired, ModelState, Reason, Settings};
use crate::status::{Endpoint, EngineFacts, ModelStatus, State, model_status};
use proptest::prelude::*;
use std::sync::Mutex;

const GIB: u64 = 1 << 30;

fn config(gpus: usize, models: &[(u32, f64)]) -> Config {
    let mut text = String::from("[control]\nstate_dir = \"/nonexistent\"\np2p_probe = \"off\"\n");
    for i in 0..gpus {
        text += &format!("[[gpu]]\nindex = {i}\nmemory = \"80GiB\"\n");
    }
    for (i, (n, f)) in models.iter().enumerate() {
        text += &format!(
            "[[model]]\nname = \"m{i}\"\nmodel = \"x\"\nexecutable = \"vllm\"\ngpus = {n}\ngpu_memory = {f}\n"
        );
    }
    Config::parse(&text, "t.toml").unwrap()
}

/// A model as the world runs it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Run {
    Asleep,
    /// Asked for room; `true` once answered.
    Waking(bool),
    Awake,
    /// Asked to yield while busy: takes no new request, sleeps once those
    /// in flight are done.
    Yielding,
    Sleeping,
}

struct World {
    core: Core,
    view: Arc<GpuView>,
    clock: Clock,
    names: Vec<String>,
    /// What each engine does (the truth, for the memory check).
    run: Vec<Run>,
    /// What the hub shows of each (state, since): it lags `run` when `lag`.
    published: Vec<(Run, i64)>,
    lag: bool,
    publishes: i64,
    in_flight: Vec<u32>,
    answers: Vec<Option<oneshot::Receiver<()>>>,
    /// Who was asked to make room, and how.
    evicted: Arc<Mutex<Vec<(String, Event)>>>,
    /// Requests held for a yielding model (its next turn's demand).
    held: Vec<bool>,
    /// Each model's last activity, unix ms (None: the base status's).
    last_activity: Vec<Option<i64>>,
    /// What each waiting model was last told it waits for.
    told: Arc<Mutex<Vec<Option<String>>>>,
    /// Models whose yield was called off, in order.
    called_off: Vec<String>,
    metrics: Arc<AdmissionMetrics>,
    /// Busy models may be asked to yield (`yield_after` = 0).
    yielding: bool,
    /// The requests a waiting model was asked for still wait (false: they
    /// were answered elsewhere or gave up; the wake goes on).
    requests_wait: Vec<bool>,
    /// Pinned awake by an operator.
    pinned: Vec<bool>,
    base: ModelStatus,
}

impl World {
    fn new(cfg: &Config) -> Option<World> {
        let view = Arc::new(GpuView::detect(cfg, &Default::default()));
        if view.placement_failed() {
            return None;
        }
        let registry = Registry::default();
        let evicted = Arc::new(Mutex::new(Vec::new()));
        let names: Vec<String> = cfg.models.iter().map(|m| m.name.clone()).collect();
        for n in &names {
            let (ev, n2) = (evicted.clone(), n.clone());
            registry.insert(
                n,
                Arc::new(move |how| ev.lock().unwrap().push((n2.clone(), how))),
            );
        }
        let clock = Clock::new();
        let policy = AdmissionPolicy {
            min_awake: Duration::ZERO,
            yield_after: None,
        };
        let m = &cfg.models[0];
        let facts = EngineFacts {
            endpoint: Endpoint {
                url: "http://x".into(),
                served_model_name: "x".into(),
            },
            gpus: vec![],
            p2p_disabled: false,
            control_id: "t".into(),
            waiting_for: String::new(),
            asleep_residual: Default::default(),
        };
        let now = tokio::time::Instant::now();
        let st = ModelState::new(Settings::from_config(m), m.preload, now);
        let base = model_status(m, &facts, &st, &clock, now);
        let n = names.len();
        let metrics = Arc::new(AdmissionMetrics::default());
        Some(World {
            core: Core::new(view.clone(), registry, clock, policy).with_metrics(metrics.clone()),
            metrics,
            view,
            clock,
            names,
            run: vec![Run::Asleep; n],
            published: vec![(Run::Asleep, 0); n],
            lag: false,
            publishes: 0,
            in_flight: vec![0; n],
            answers: (0..n).map(|_| None).collect(),
            evicted,
            held: vec![false; n],
            last_activity: vec![None; n],
            told: Arc::new(Mutex::new(vec![None; n])),
            called_off: Vec::new(),
            yielding: false,
            requests_wait: vec![true; n],
            pinned: vec![false; n],
            base,
        })
    }

    /// Busy models yield at once to a waiting model (`yield_after` = 0).
    fn with_yield(mut self) -> Self {
        let policy = AdmissionPolicy {
            min_awake: Duration::ZERO,
            yield_after: Some(Duration::ZERO),
        };
        self.core = Core::new(self.view.clone(), self.core_registry(), self.clock, policy)
            .with_metrics(self.metrics.clone());
        self.yielding = true;
        self
    }

    fn core_registry(&self) -> Registry {
        let registry = Registry::default();
        for n in &self.names {
            let (ev, n2) = (self.evicted.clone(), n.clone());
            registry.insert(
                n,
                Arc::new(move |how| ev.lock().unwrap().push((n2.clone(), how))),
            );
        }
        registry
    }

    fn statuses(&self) -> Vec<ModelStatus> {
        (0..self.names.len())
            .map(|i| {
                let mut s = self.base.clone();
                s.name = self.names[i].clone();
                let (run, since) = self.published[i];
                s.state = match run {
                    Run::Asleep => State::Asleep,
                    Run::Waking(_) => State::Waking,
                    Run::Awake => State::Awake,
                    // A yielding model is published as going to sleep.
                    Run::Sleeping | Run::Yielding => State::Sleeping,
                };
                s.in_flight = self.in_flight[i];
                // A model waiting for room waits for the requests that
                // asked for it (the proxies report them held).
                s.held = u32::from(
                    (matches!(run, Run::Waking(false)) && self.requests_wait[i]) || self.held[i],
                );
                // Woken for requests, or (nothing waits for it) by a tier
                // to sleep deeper.
                (s.intent.desired, s.intent.reason) =
                    if matches!(run, Run::Waking(false)) && !self.requests_wait[i] {
                        (Desired::Asleep(2), Reason::IdleTier)
                    } else {
                        (Desired::Awake, Reason::Demand)
                    };
                if self.pinned[i] {
                    s.pin = crate::status::PinView::Forever;
                    (s.intent.desired, s.intent.reason) = (Desired::Awake, Reason::Pin);
                }
                s.state_since_unix_ms = since;
                if let Some(t) = self.last_activity[i] {
                    s.last_activity_unix_ms = Some(t);
                }
                s
            })
            .collect()
    }

    /// Model `i`'s task publishes what its engine does now.
    fn publish(&mut self, i: usize) {
        if self.published[i].0 != self.run[i] {
            self.publishes += 1;
            // A distinct time per change, in the past (min_awake counts
            // from it).
            let since = self.clock.now_ms() - 1_000_000 + self.publishes;
            self.published[i] = (self.run[i], since);
        }
    }

    fn demand(&mut self, i: usize) {
        if self.run[i] == Run::Awake {
            self.in_flight[i] += 1;
        } else if matches!(self.run[i], Run::Yielding | Run::Sleeping) {
            // Held by the proxies; the model asks again once asleep.
            self.held[i] = true;
        } else if self.run[i] == Run::Asleep {
            self.held[i] = false;
            let (reply, rx) = oneshot::channel();
            self.core.push(Ask {
                id: i as u64,
                model: self.names[i].clone(),
                waiting: {
                    let told = self.told.clone();
                    Box::new(move |what| told.lock().unwrap()[i] = what)
                },
                reply,
                told: None,
                asked_at: tokio::time::Instant::now(),
                evicted: Default::default(),
                yields: Default::default(),
            });
            self.answers[i] = Some(rx);
            self.run[i] = Run::Waking(false);
        }
    }

    /// Plans, then checks what planning promised and whom it evicted.
    fn plan(&mut self) -> Result<(), TestCaseError> {
        if !self.lag {
            (0..self.names.len()).for_each(|i| self.publish(i));
        }
        let statuses = self.statuses();
        self.core.plan(&statuses);
        for i in 0..self.names.len() {
            if let Some(rx) = &mut self.answers[i]
                && rx.try_recv().is_ok()
            {
                self.answers[i] = None;
                self.run[i] = Run::Waking(true);
            }
        }
        let evicted: Vec<(String, Event)> = self.evicted.lock().unwrap().drain(..).collect();
        for (v, how) in evicted {
            let i = self.names.iter().position(|n| *n == v).unwrap();
            if let Event::CallOffYield { to, .. } = &how {
                prop_assert!(
                    self.yielding,
                    "{} called off a yield to {} with yield off",
                    v,
                    to
                );
                // Its reconciler: still finishing its requests, it serves
                // again; once its sleep began, nothing changes.
                if self.run[i] == Run::Yielding {
                    self.run[i] = Run::Awake;
                }
                self.called_off.push(v);
                continue;
            }
            prop_assert_eq!(
                self.published[i].0,
                Run::Awake,
                "evicted {} while {:?}",
                v,
                self.published[i].0
            );
            match how {
                Event::Evict => {
                    prop_assert_eq!(
                        self.in_flight[i],
                        0,
                        "evicted {} with requests in flight",
                        v
                    );
                    // The model's own reconciler sleeps it if it is awake
                    // and idle (the hub may show it awake a moment after
                    // it was not).
                    if self.run[i] == Run::Awake {
                        self.run[i] = Run::Sleeping;
                    }
                }
                Event::Yield { to } => {
                    prop_assert!(
                        self.yielding,
                        "{} asked to yield to {} with yield off",
                        v,
                        to
                    );
                    prop_assert!(
                        self.in_flight[i] > 0,
                        "{} asked to yield though idle (an idle model is evicted)",
                        v
                    );
                    if self.run[i] == Run::Awake {
                        self.run[i] = if self.in_flight[i] > 0 {
                            Run::Yielding
                        } else {
                            Run::Sleeping
                        };
                    }
                }
                other => prop_assert!(false, "{} was sent {:?}", v, other),
            }
        }
        self.check_memory()
    }

    /// No GPU holds more than it has: full shares of what is admitted,
    /// awake or going to sleep, residuals of the rest.
    fn check_memory(&self) -> Result<(), TestCaseError> {
        let placements = self.view.placements();
        for g in 0..8u32 {
            let mut used = 0;
            for p in placements.iter().filter(|p| p.gpus.contains(&g)) {
                let i = self.names.iter().position(|n| *n == p.model).unwrap();
                used += match self.run[i] {
                    Run::Waking(true) | Run::Awake | Run::Yielding | Run::Sleeping => p.awake_on(g),
                    _ => p.awake_on(g).min(crate::placement::DEFAULT_RESIDUAL_BYTES),
                };
            }
            prop_assert!(used <= 80 * GIB, "GPU {} over-committed: {:?}", g, self.run);
        }
        Ok(())
    }

    /// One random action of the property tests.
    fn act(&mut self, a: Action) -> Result<(), TestCaseError> {
        let n = self.names.len();
        match a {
            Action::Demand(i) => self.demand(i % n),
            Action::Finish(i) => {
                let i = i % n;
                self.in_flight[i] = self.in_flight[i].saturating_sub(1);
            }
            Action::Step => self.engines_step(),
            Action::Plan => self.plan()?,
            Action::Publish(i) => self.publish(i % n),
        }
        Ok(())
    }

    /// Engines finish what they were doing; a yielding one sleeps once
    /// nothing is in flight; an asleep one with requests held asks again.
    fn engines_step(&mut self) {
        for i in 0..self.run.len() {
            self.run[i] = match self.run[i] {
                Run::Waking(true) => Run::Awake,
                Run::Sleeping => Run::Asleep,
                Run::Yielding if self.in_flight[i] == 0 => Run::Sleeping,
                other => other,
            };
            if self.run[i] == Run::Asleep && self.held[i] {
                self.demand(i);
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Action {
    Demand(usize),
    Finish(usize),
    Step,
    Plan,
    Publish(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (0usize..8).prop_map(Action::Demand),
        2 => (0usize..8).prop_map(Action::Finish),
        2 => Just(Action::Step),
        3 => Just(Action::Plan),
        3 => (0usize..8).prop_map(Action::Publish),
    ]
}

fn setup() -> impl Strategy<Value = (usize, Vec<(u32, f64)>)> {
    (1usize..=3).prop_flat_map(|gpus| {
        let model = (
            1u32..=gpus as u32,
            prop_oneof![Just(0.3), Just(0.45), Just(0.6), Just(0.85)],
        );
        (Just(gpus), proptest::collection::vec(model, 2..=5))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn admission_never_overcommits_never_evicts_busy_models_and_never_deadlocks(
        (gpus, models) in setup(),
        actions in proptest::collection::vec(action(), 1..120),
        lag in any::<bool>(),
    ) {
        let Some(mut w) = World::new(&config(gpus, &models)) else {
            return Ok(());
        };
        let n = w.names.len();
        // Models publish their states late, as their tasks get to it.
        w.lag = lag;
        for a in actions {
            w.act(a)?;
        }
        // Traffic stops: every waiting model gets its turn.
        w.in_flight.iter_mut().for_each(|f| *f = 0);
        for _ in 0..(4 * n + 4) {
            (0..n).for_each(|i| w.publish(i));
            w.plan()?;
            w.engines_step();
        }
        let waiting: Vec<_> = (0..n)
            .filter(|&i| w.run[i] == Run::Waking(false))
            .map(|i| &w.names[i])
            .collect();
        prop_assert!(waiting.is_empty(), "still waiting: {:?} ({:?})", waiting, w.run);
    }

    /// With `yield_after`, traffic that never stops does not starve a
    /// model: every model waiting for room is admitted while the awake
    /// ones stay busy (each gets a new request every round; only a
    /// yielding one's requests finish), and still no GPU is over-committed
    /// and no idle model is asked to yield.
    #[test]
    fn with_yield_after_busy_models_take_turns_and_none_starves(
        (gpus, models) in setup(),
        actions in proptest::collection::vec(action(), 1..60),
    ) {
        let Some(w) = World::new(&config(gpus, &models)) else {
            return Ok(());
        };
        let mut w = w.with_yield();
        let n = w.names.len();
        for a in actions {
            w.act(a)?;
        }
        let waiting: Vec<usize> = (0..n).filter(|&i| w.run[i] == Run::Waking(false)).collect();
        let mut admitted = vec![false; n];
        for _ in 0..(6 * n + 6) {
            for i in 0..n {
                match w.run[i] {
                    Run::Awake => w.in_flight[i] += 1,
                    Run::Yielding => w.in_flight[i] = 0,
                    _ => {}
                }
            }
            (0..n).for_each(|i| w.publish(i));
            w.plan()?;
            for (run, admitted) in w.run.iter().zip(admitted.iter_mut()) {
                *admitted |= *run == Run::Waking(true);
            }
            w.engines_step();
        }
        let starved: Vec<&String> = waiting.iter().filter(|&&i| !admitted[i]).map(|&i| &w.names[i]).collect();
        prop_assert!(starved.is_empty(), "never admitted under busy traffic: {:?} ({:?})", starved, w.run);
    }
}

/// Turns double with each yield given up, within half the wait for room.
#[test]
fn turns_double_after_yields_given_up_within_half_the_wait_for_room() {
    use super::queue::longer_turn;
    let s = Duration::from_secs;
    let turns = [0, 1, 2, 3, 4, 9].map(|n| longer_turn(s(10), n));
    assert_eq!(turns, [s(10), s(20), s(40), s(80), s(150), s(150)]);
    assert_eq!(
        longer_turn(s(200), 3),
        s(200),
        "never shorter than the turn"
    );
}

/// A busy model yields only to a model someone waits for: requests held
/// for it, or an operator's wake. A wake whose requests went away (they
/// gave up at `max_hold`) takes only idle models' room.
#[test]
fn a_busy_model_yields_only_to_a_model_someone_waits_for() {
    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)]))
        .unwrap()
        .with_yield();
    w.run[0] = Run::Awake;
    w.in_flight[0] = 2;
    w.demand(1);
    w.requests_wait[1] = false;
    w.plan().unwrap();
    assert_eq!(
        w.run,
        [Run::Awake, Run::Waking(false)],
        "nobody waits for m1"
    );
    // An operator wakes it: that is someone.
    let mut st = w.statuses();
    st[1].intent.desired = crate::reconciler::Desired::Awake;
    st[1].intent.reason = crate::reconciler::Reason::Operator;
    // (An operator's sleep, deeper, is no reason to make it yield.)
    let mut deeper = st.clone();
    deeper[1].intent.desired = crate::reconciler::Desired::Asleep(2);
    w.core.plan(&deeper);
    assert!(w.evicted.lock().unwrap().is_empty());
    w.core.plan(&st);
    let asked: Vec<_> = w.evicted.lock().unwrap().drain(..).collect();
    assert!(
        matches!(asked.as_slice(), [(m, Event::Yield { to })] if m == "m0" && to == "m1"),
        "{asked:?}"
    );
}

/// A wake only to sleep deeper (a level-2 tier firing on a model asleep at
/// level 1: vLLM must wake first) asks for room nobody waits for. Asked
/// first, on a GPU a busy model holds, it waited (nobody yields to it), and
/// a later wake with requests held for it waited behind it on that GPU: no
/// yield for it either, until the first gave up 5 minutes later, its
/// requests shed by then. The wake someone waits for goes first.
#[test]
fn a_wake_to_sleep_deeper_does_not_hold_up_one_someone_waits_for() {
    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.45), (1, 0.45)]))
        .unwrap()
        .with_yield();
    w.run[0] = Run::Awake;
    w.in_flight[0] = 2;
    // m1's level-2 tier: a wake, then a sleep at level 2; nothing held.
    w.demand(1);
    w.requests_wait[1] = false;
    // Then requests for m2, held.
    w.demand(2);
    (0..3).for_each(|i| w.publish(i));
    let mut st = w.statuses();
    st[1].intent.desired = crate::reconciler::Desired::Asleep(2);
    st[1].intent.reason = crate::reconciler::Reason::IdleTier;
    st[2].intent.desired = crate::reconciler::Desired::Awake;
    st[2].intent.reason = crate::reconciler::Reason::Demand;
    w.core.plan(&st);
    let asked: Vec<_> = w.evicted.lock().unwrap().drain(..).collect();
    assert!(
        matches!(asked.as_slice(), [(m, Event::Yield { to })] if m == "m0" && to == "m2"),
        "{asked:?}; told {:?}",
        w.told.lock().unwrap()
    );
}

/// A wake only to sleep deeper takes free room only: it puts no idle model
/// to sleep (whose next request would pay a sleep and a wake so that the
/// deepening model frees a residual); it waits for room, and then fits.
#[test]
fn a_wake_to_sleep_deeper_puts_no_other_model_to_sleep() {
    let mut w = World::new(&config(1, &[(1, 0.6), (1, 0.6)])).unwrap();
    w.run[0] = Run::Awake;
    w.demand(1);
    w.requests_wait[1] = false;
    (0..2).for_each(|i| w.publish(i));
    let mut st = w.statuses();
    st[1].intent.desired = crate::reconciler::Desired::Asleep(2);
    st[1].intent.reason = crate::reconciler::Reason::IdleTier;
    w.core.plan(&st);
    let asked: Vec<_> = w.evicted.lock().unwrap().drain(..).collect();
    assert!(asked.is_empty(), "{asked:?}");
    let told = w.told.lock().unwrap()[1].clone().unwrap_or_default();
    assert!(told.contains("free room"), "{told}");
    // Wanted awake (a request came), the same ask may put m0 to sleep.
    st[1].intent.desired = crate::reconciler::Desired::Awake;
    st[1].intent.reason = crate::reconciler::Reason::Demand;
    w.core.plan(&st);
    let asked: Vec<_> = w.evicted.lock().unwrap().drain(..).collect();
    assert!(
        matches!(asked.as_slice(), [(m, Event::Evict)] if m == "m0"),
        "{asked:?}"
    );
}

/// A model whose last yields were given up (its answers outlasted the
/// grace) gets longer turns: 2× after one, 4× after two.
#[test]
fn yields_given_up_lengthen_the_turn() {
    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)])).unwrap();
    let turn = Duration::from_secs(10);
    w.core = Core::new(
        w.view.clone(),
        w.core_registry(),
        w.clock,
        AdmissionPolicy {
            min_awake: Duration::ZERO,
            yield_after: Some(turn),
        },
    );
    w.run[0] = Run::Awake;
    w.in_flight[0] = 1;
    w.demand(1);
    // The ask has waited its turn; m0 has been awake 25 s.
    w.core.age_asks(turn);
    let since = w.clock.now_ms() - 25_000;
    let statuses = |given_up: u32| {
        let mut s = w.statuses();
        s[0].state = State::Awake;
        s[0].state_since_unix_ms = since;
        s[0].yields_given_up = given_up;
        s[1].held = 1;
        s
    };
    let cases = [(2, false, statuses(2)), (1, true, statuses(1))];
    for (given_up, yields, st) in cases {
        w.core.plan(&st);
        let asked: Vec<_> = w.evicted.lock().unwrap().drain(..).collect();
        assert_eq!(!asked.is_empty(), yields, "{given_up} given up: {asked:?}");
    }
}

/// A model busy without pause keeps the GPU only for its turn: the other
/// one, waiting, gets it once the busy one has yielded (what was in flight
/// finished first); then the first one waits its turn in the same way.
/// With `yield_after` off the busy model keeps the GPU.
#[test]
fn a_busy_model_yields_to_a_waiting_one_and_gets_its_turn_back() {
    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)])).unwrap();
    w.run[0] = Run::Awake;
    w.in_flight[0] = 3;
    w.demand(1);
    for _ in 0..3 {
        w.plan().unwrap();
        w.engines_step();
    }
    assert_eq!(
        w.run,
        [Run::Awake, Run::Waking(false)],
        "yield off: m0 keeps it"
    );

    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)]))
        .unwrap()
        .with_yield();
    w.run[0] = Run::Awake;
    w.in_flight[0] = 3;
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Yielding, Run::Waking(false)]);
    // New requests for m0 are held; those in flight finish; m0 sleeps.
    w.demand(0);
    assert_eq!(w.in_flight[0], 3);
    w.engines_step();
    w.plan().unwrap();
    assert_eq!(
        w.run,
        [Run::Yielding, Run::Waking(false)],
        "in flight first"
    );
    w.in_flight[0] = 0;
    w.engines_step();
    w.engines_step();
    w.plan().unwrap();
    // m1 is admitted; m0, asleep with requests held, asks again.
    assert_eq!(w.run, [Run::Waking(false), Run::Waking(true)]);
    w.engines_step();
    w.in_flight[1] = 5; // m1 busy too
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Waking(false), Run::Yielding], "m1 yields back");
}

/// Room already being freed is not asked of another model: three models
/// of 0.45 on a GPU that holds two, two of them awake and a third asking.
/// One is put to sleep (or yields, when busy); the plans made while it
/// goes to sleep wait for it instead of putting the other to sleep too,
/// both once the hub shows it going to sleep (before, each plan until the
/// sleep was confirmed took one more) and before it does (`lag`: the
/// model's task has not published yet).
#[test]
fn a_model_going_to_sleep_for_an_ask_is_the_only_one() {
    for (busy, lag) in [(false, false), (true, false), (false, true), (true, true)] {
        let case = format!("busy={busy} lag={lag}");
        let w = World::new(&config(1, &[(1, 0.45), (1, 0.45), (1, 0.45)])).unwrap();
        let mut w = if busy { w.with_yield() } else { w };
        w.run[0] = Run::Awake;
        w.run[1] = Run::Awake;
        if busy {
            w.in_flight[0] = 2;
            w.in_flight[1] = 2;
        }
        w.demand(2);
        w.plan().unwrap();
        w.lag = lag;
        let going = if busy { Run::Yielding } else { Run::Sleeping };
        let first: Vec<usize> = (0..2).filter(|&i| w.run[i] == going).collect();
        assert_eq!(first.len(), 1, "{case}: {:?}", w.run);
        let (v, other) = (first[0], 1 - first[0]);
        // The one put to sleep was used last now: were it awake, the other
        // would go first.
        w.last_activity[v] = Some(w.clock.now_ms());
        for _ in 0..3 {
            w.plan().unwrap();
            assert_eq!(w.run[other], Run::Awake, "{case}: {:?}", w.run);
            assert_eq!(w.run[2], Run::Waking(false), "{case}");
            // It is still told what it asked of v (a yield: why it takes
            // a while).
            let told = w.told.lock().unwrap()[2].clone().unwrap_or_default();
            assert!(
                told.starts_with(&format!("room on its GPUs: putting \"m{v}\" to sleep")),
                "{case}: {told}"
            );
            assert_eq!(told.contains("its turn is over"), busy, "{case}: {told}");
        }
        w.in_flight[v] = 0;
        w.engines_step();
        w.engines_step();
        (0..3).for_each(|i| w.publish(i));
        w.plan().unwrap();
        assert_eq!(w.run[v], Run::Asleep, "{case}");
        assert_eq!(w.run[other], Run::Awake, "{case}");
        assert_eq!(w.run[2], Run::Waking(true), "{case}: admitted");
    }
}

/// Three models of 0.45 on a GPU that holds two: two busy (2 requests
/// each) and the third asked for; busy models yield at once. One of the
/// two yields: the world, and which one.
fn one_of_two_busy_yields() -> (World, usize) {
    let mut w = World::new(&config(1, &[(1, 0.45), (1, 0.45), (1, 0.45)]))
        .unwrap()
        .with_yield();
    w.run[0] = Run::Awake;
    w.run[1] = Run::Awake;
    w.in_flight[0] = 2;
    w.in_flight[1] = 2;
    w.demand(2);
    w.plan().unwrap();
    let v = (0..2).find(|&i| w.run[i] == Run::Yielding).unwrap();
    (w, v)
}

/// A busy model yields for a wake that then leaves the queue (it gave up
/// for room, an operator stopped it, its model was removed, or its waiter
/// is gone): the yield is called off, so the yielder serves again instead
/// of holding its own new requests and sleeping for nobody.
#[test]
fn a_yield_is_called_off_when_the_ask_it_was_for_leaves() {
    for gone in ["cancelled", "waiter gone"] {
        let (mut w, v) = one_of_two_busy_yields();
        match gone {
            "cancelled" => w.core.cancel(2),
            _ => w.answers[2] = None,
        }
        w.plan().unwrap();
        assert_eq!(w.called_off, [w.names[v].clone()], "{gone}");
        assert_eq!(w.run[v], Run::Awake, "{gone}");
    }
}

/// A busy model yields for an ask that is then admitted without it (the
/// other busy model was put to sleep by its operator meanwhile): the yield
/// is called off at the admission, and the yielder serves on.
#[test]
fn a_yield_is_called_off_when_its_ask_is_admitted_without_it() {
    let (mut w, v) = one_of_two_busy_yields();
    let other = 1 - v;
    w.plan().unwrap();
    assert!(w.called_off.is_empty(), "{:?}", w.called_off);
    w.in_flight[other] = 0;
    w.run[other] = Run::Asleep;
    w.plan().unwrap();
    assert_eq!(w.run[2], Run::Waking(true), "admitted");
    assert_eq!(w.called_off, [w.names[v].clone()]);
    assert_eq!(w.run[v], Run::Awake);
}

/// Two busy models and a third that waited its turn: one of the busy
/// ones yields, and while it still finishes its requests the other falls
/// idle. The idle one makes the room; the yield is called off, so the
/// yielding model serves on without a sleep (before, the ask waited for
/// the yield, as long as its longest answer). Once its sleep began, or
/// with the hub still showing it awake and its requests done, it goes on.
#[test]
fn a_yield_is_called_off_when_another_model_falls_idle() {
    for lag in [false, true] {
        let (mut w, v) = one_of_two_busy_yields();
        let other = 1 - v;
        w.lag = lag;
        w.plan().unwrap();
        assert!(w.called_off.is_empty(), "lag={lag}: {:?}", w.called_off);
        // The other one's requests end; v still has its own.
        w.in_flight[other] = 0;
        w.plan().unwrap();
        assert_eq!(w.called_off, [w.names[v].clone()], "lag={lag}");
        let mut text = String::new();
        w.metrics.encode(&mut text);
        assert!(
            text.contains(&format!(
                "siesta_control_admission_yields_called_off_total{{model=\"m{v}\"}} 1\n"
            )),
            "lag={lag}: {text}"
        );
        assert_eq!(w.run[v], Run::Awake, "lag={lag}");
        assert_eq!(w.run[other], Run::Sleeping, "lag={lag}");
        let told = w.told.lock().unwrap()[2].clone().unwrap_or_default();
        assert_eq!(
            told,
            format!("room on its GPUs: putting \"m{other}\" to sleep"),
            "lag={lag}"
        );
        // Plans while the hub still shows v yielding change nothing.
        for _ in 0..3 {
            w.plan().unwrap();
        }
        assert_eq!(w.called_off.len(), 1, "lag={lag}");
        assert_eq!(w.run[v], Run::Awake, "lag={lag}");
        w.engines_step();
        w.lag = false;
        w.plan().unwrap();
        assert_eq!(
            w.run,
            [
                if v == 0 { Run::Awake } else { Run::Asleep },
                if v == 1 { Run::Awake } else { Run::Asleep },
                Run::Waking(true)
            ],
            "lag={lag}: admitted, v never slept"
        );
        assert_eq!(w.in_flight[v], 2, "lag={lag}: v's requests were not cut");
    }

    // Its requests done and its sleep begun: nothing is called off.
    let (mut w, v) = one_of_two_busy_yields();
    w.in_flight[v] = 0;
    w.engines_step();
    assert_eq!(w.run[v], Run::Sleeping);
    w.in_flight[1 - v] = 0;
    for _ in 0..3 {
        w.plan().unwrap();
    }
    assert!(w.called_off.is_empty(), "{:?}", w.called_off);
    assert_eq!(w.run[1 - v], Run::Awake, "{:?}", w.run);
}

/// A model asked to sleep that never acts on it (it became busy before its
/// task saw the ask) counts as going to sleep only for a moment (2 s on
/// tokio's clock); then the ask plans again and takes the other's room.
#[tokio::test(start_paused = true)]
async fn a_model_that_ignored_the_ask_to_sleep_is_planned_for_again() {
    let mut w = World::new(&config(1, &[(1, 0.45), (1, 0.45), (1, 0.45)])).unwrap();
    w.run[0] = Run::Awake;
    w.run[1] = Run::Awake;
    w.demand(2);
    w.plan().unwrap();
    let v = (0..2).find(|&i| w.run[i] == Run::Sleeping).unwrap();
    let other = 1 - v;
    // Busy before it saw the ask: it stays awake, its state unmoved.
    w.run[v] = Run::Awake;
    w.in_flight[v] = 1;
    tokio::time::advance(Duration::from_millis(1500)).await;
    w.plan().unwrap();
    assert_eq!(w.run[other], Run::Awake, "still counted as going to sleep");
    tokio::time::advance(Duration::from_secs(1)).await;
    w.plan().unwrap();
    assert_eq!(w.run[other], Run::Sleeping, "{:?}", w.run);
    assert_eq!(w.run[v], Run::Awake);
}

/// The deadlock of the first real run: two models of 0.85 on one GPU
/// woken at the same moment. One is admitted at once, the other once the
/// first is idle and asleep.
#[test]
fn two_wakes_on_one_gpu_at_once_take_turns() {
    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)])).unwrap();
    w.demand(0);
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Waking(true), Run::Waking(false)]);
    w.engines_step();
    w.demand(0); // a request in flight on m0
    w.plan().unwrap();
    assert_eq!(w.run[1], Run::Waking(false), "m0 is busy: m1 waits");
    w.in_flight[0] = 0;
    w.plan().unwrap();
    assert_eq!(w.run[0], Run::Sleeping, "idle m0 is put to sleep");
    w.engines_step();
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Asleep, Run::Waking(true)]);
}

/// The flake of the first CI run of the swap test: two asleep models of
/// 0.85 on one GPU asked for room a millisecond apart, the first answered
/// before its task published Waking. The second must wait: the hub still
/// shows the first asleep, but it was promised its full share.
#[test]
fn an_answer_counts_before_the_model_publishes_it() {
    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)])).unwrap();
    w.lag = true;
    w.demand(0);
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Waking(true), Run::Asleep]);
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Waking(true), Run::Waking(false)]);
    // The first publishes, wakes and publishes again: still no room.
    w.publish(0);
    w.plan().unwrap();
    w.engines_step();
    w.publish(0);
    w.in_flight[0] = 1;
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Awake, Run::Waking(false)]);
    // Idle: put to sleep, then the second gets its turn.
    w.in_flight[0] = 0;
    w.plan().unwrap();
    assert_eq!(w.run[0], Run::Sleeping);
    w.engines_step();
    w.publish(0);
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Asleep, Run::Waking(true)]);
}

/// `min_awake`: a model woken a moment ago is not evicted yet.
#[test]
fn a_model_woken_recently_is_not_evicted() {
    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)])).unwrap();
    w.core = Core::new(
        w.view.clone(),
        Registry::default(),
        w.clock,
        AdmissionPolicy {
            min_awake: Duration::from_secs(3600),
            yield_after: Some(Duration::ZERO),
        },
    );
    w.run[0] = Run::Awake;
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Awake, Run::Waking(false)]);
}

/// Prometheus sees each admission with its wait, and each eviction once.
#[test]
fn admissions_and_evictions_are_counted() {
    let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)])).unwrap();
    let metrics = Arc::new(AdmissionMetrics::default());
    let registry = Registry::default();
    let evicted = w.evicted.clone();
    for n in &w.names {
        let (ev, n2) = (evicted.clone(), n.clone());
        registry.insert(
            n,
            Arc::new(move |how| ev.lock().unwrap().push((n2.clone(), how))),
        );
    }
    w.core = Core::new(
        w.view.clone(),
        registry,
        w.clock,
        AdmissionPolicy {
            min_awake: Duration::ZERO,
            yield_after: None,
        },
    )
    .with_metrics(metrics.clone());
    w.demand(0);
    w.plan().unwrap();
    w.engines_step();
    w.demand(1);
    w.plan().unwrap();
    w.plan().unwrap(); // asked again: still one eviction
    w.engines_step();
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Asleep, Run::Waking(true)]);
    let mut text = String::new();
    metrics.encode(&mut text);
    assert!(
        text.contains("siesta_control_admission_evictions_total{model=\"m0\"} 1\n"),
        "{text}"
    );
    for m in ["m0", "m1"] {
        assert!(
            text.contains(&format!(
                "siesta_control_admission_admitted_total{{model=\"{m}\"}} 1\n"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "siesta_control_admission_wait_seconds_count{{model=\"{m}\"}} 1\n"
            )),
            "{text}"
        );
    }
}

/// The admission task over `w`'s GPUs, planning on `hub`, no `min_awake`
/// and no turns.
fn started(w: &World, hub: &Arc<crate::hub::Hub>, cancel: CancellationToken) -> Admission {
    Admission::start(
        w.view.clone(),
        hub.clone(),
        w.clock,
        AdmissionPolicy {
            min_awake: Duration::ZERO,
            yield_after: None,
        },
        cancel,
    )
}

/// Model `i` as found after a restart, in `state` for ten minutes; m0
/// wanted awake by a request.
fn adopted(w: &World, i: usize, state: State) -> ModelStatus {
    let mut s = w.base.clone();
    s.name = w.names[i].clone();
    s.state = state;
    s.state_since_unix_ms = w.clock.now_ms() - 600_000;
    if i == 0 {
        (s.intent.desired, s.intent.reason) = (Desired::Awake, Reason::Demand);
    }
    s
}

/// The overcommit of a chaos run (control killed with two models awake and
/// a third's wake wanted, then restarted): the third's task asked for room
/// before the adopted engines' states were published, saw a free GPU and
/// was admitted: three awake on a GPU that holds two. Nothing is admitted
/// before every model's first state is known (`start_planning`); then the
/// ask finds the GPU full and asks the idle awake models to make room.
#[tokio::test(start_paused = true)]
async fn nothing_is_admitted_before_every_adopted_engine_is_known() {
    let w = World::new(&config(1, &[(1, 0.45), (1, 0.45), (1, 0.45)])).unwrap();
    let hub = crate::hub::Hub::new(w.clock, 16, 16);
    let admission = started(&w, &hub, CancellationToken::new());
    let evicted = Arc::new(Mutex::new(Vec::<String>::new()));
    for n in &w.names {
        let (ev, n2) = (evicted.clone(), n.clone());
        admission
            .registry()
            .insert(n, Arc::new(move |_| ev.lock().unwrap().push(n2.clone())));
    }
    let status = |i: usize, state: State| adopted(&w, i, state);
    // m0 is adopted asleep with a wake wanted, and asks at once.
    hub.publish_model(status(0, State::Asleep));
    let a = admission.clone();
    let mut ask = tokio::spawn(async move { a.admit("m0", Box::new(|_| {})).await });
    let early = tokio::time::timeout(Duration::from_secs(5), &mut ask).await;
    assert!(
        early.is_err(),
        "admitted before the other engines were known"
    );
    // m1 and m2 are adopted awake (idle): the GPU is full.
    hub.publish_model(status(1, State::Awake));
    hub.publish_model(status(2, State::Awake));
    admission.start_planning();
    let later = tokio::time::timeout(Duration::from_secs(5), &mut ask).await;
    assert!(later.is_err(), "admitted onto a full GPU");
    let asked = evicted.lock().unwrap().clone();
    assert!(!asked.is_empty(), "no idle model asked to make room");
    // One of them asleep: room for m0.
    hub.publish_model(status(1, State::Asleep));
    tokio::time::timeout(Duration::from_secs(5), &mut ask)
        .await
        .expect("admitted once there is room")
        .unwrap()
        .expect("admitted, not refused");
}

/// Asleep models keep memory (measured per model; here the whole config's
/// `asleep_residual`, 10 GiB): with two busy models awake, a third model's
/// wake finds no room until an asleep model siesta may stop is stopped. It
/// is sent `Evict` (its reconciler stops it), counted as stopping until it
/// publishes, and the wake is admitted once it is stopped. A model asleep
/// with requests held for it (wanted awake) is never the one stopped, nor
/// one on a GPU where an engine is starting.
#[test]
fn an_asleep_model_is_stopped_for_what_it_keeps_when_nothing_else_frees_room() {
    let mut text = String::from(
        "[control]\nstate_dir = \"/nonexistent\"\np2p_probe = \"off\"\n\
         asleep_residual = \"10GiB\"\n[[gpu]]\nindex = 0\nmemory = \"80GiB\"\n",
    );
    for i in 0..4 {
        text += &format!(
            "[[model]]\nname = \"m{i}\"\nmodel = \"x\"\nexecutable = \"vllm\"\ngpu_memory = 0.3\n"
        );
    }
    let cfg = Config::parse(&text, "t.toml").unwrap();
    let mut w = World::new(&cfg).unwrap();
    // m0 and m1 busy (48 GiB), m2 asleep (10), m3 asks (24): 82 > 80.
    for i in 0..2 {
        w.run[i] = Run::Awake;
        w.in_flight[i] = 1;
    }
    w.demand(3);
    (0..4).for_each(|i| w.publish(i));
    let mut st = w.statuses();
    // m2 is asleep for its idle tier, nothing held for it: it may be stopped.
    st[2].intent.desired = Desired::Asleep(1);
    st[2].intent.reason = Reason::IdleTier;
    // First as if requests were held for it: not stopped, m3 waits.
    st[2].held = 1;
    w.core.plan(&st);
    let asked: Vec<_> = w.evicted.lock().unwrap().drain(..).collect();
    assert!(asked.is_empty(), "{asked:?}");
    assert!(w.answers[3].as_mut().unwrap().try_recv().is_err());
    st[2].held = 0;
    // Nor while an engine starts on the GPU (m0, admitted): vLLM fails a
    // start whose GPU frees memory while it profiles.
    st[0].state = State::Starting;
    w.core.plan(&st);
    let asked: Vec<_> = w.evicted.lock().unwrap().drain(..).collect();
    assert!(asked.is_empty(), "{asked:?}");
    st[0].state = State::Awake;
    w.core.plan(&st);
    let asked: Vec<_> = w.evicted.lock().unwrap().drain(..).collect();
    assert!(
        matches!(asked.as_slice(), [(m, Event::Evict)] if m == "m2"),
        "{asked:?}"
    );
    let told = w.told.lock().unwrap()[3].clone().unwrap_or_default();
    assert!(told.contains("stopping \"m2\""), "{told}");
    let mut metrics = String::new();
    w.metrics.encode(&mut metrics);
    assert!(
        metrics.contains("siesta_control_admission_evictions_total{model=\"m2\"} 1\n"),
        "{metrics}"
    );
    // Not yet published: counted stopping (nothing more asked, not admitted).
    w.core.plan(&st);
    assert!(w.evicted.lock().unwrap().is_empty());
    assert!(w.answers[3].as_mut().unwrap().try_recv().is_err());
    st[2].state = State::Stopping;
    st[2].state_since_unix_ms += 1;
    w.core.plan(&st);
    assert!(w.answers[3].as_mut().unwrap().try_recv().is_err());
    st[2].state = State::Stopped;
    st[2].state_since_unix_ms += 1;
    w.core.plan(&st);
    assert!(w.answers[3].as_mut().unwrap().try_recv().is_ok());
}

/// An ask that waits on what no model's requests will change (here a
/// model pinned awake) holds up no later ask on its GPU: one that fits
/// beside the pinned model is admitted (it waited "in line" behind the
/// stuck one until that gave up, 5 minutes). One that waits on a busy
/// model still keeps its place: the room that model frees is its first.
#[test]
fn an_ask_waiting_on_a_pin_does_not_hold_up_one_that_fits() {
    let mut w = World::new(&config(1, &[(1, 0.6), (1, 0.5), (1, 0.3)])).unwrap();
    // m0 awake and busy; m1 cannot fit beside it, m2 could.
    w.run[0] = Run::Awake;
    w.in_flight[0] = 1;
    w.demand(1);
    w.demand(2);
    w.plan().unwrap();
    assert_eq!(
        w.run,
        [Run::Awake, Run::Waking(false), Run::Waking(false)],
        "m1 waits for busy m0, and m2 waits in line behind m1"
    );
    let told = w.told.lock().unwrap()[2].clone().unwrap_or_default();
    assert!(told.contains("in line behind \"m1\""), "{told}");
    // Pinned, m0 will never make room: m2, which fits beside it, goes.
    w.pinned[0] = true;
    w.plan().unwrap();
    assert_eq!(
        w.run,
        [Run::Awake, Run::Waking(false), Run::Waking(true)],
        "m2 admitted beside the pinned model"
    );
    let told = w.told.lock().unwrap()[1].clone().unwrap_or_default();
    assert!(told.contains("pinned awake"), "{told}");
}

/// A pause in a model's traffic is not idleness: with nothing in flight
/// but a request answered a moment ago (less than `min_awake`), it is not
/// put to sleep for a waiting model until it has been idle that long, or
/// its turn is over (`yield_after`). Before, it was put to sleep in the
/// first gap between two of its requests, and two models with steady
/// traffic on one GPU swapped every `min_awake`, each swap a wake.
#[test]
fn a_pause_between_requests_is_not_idleness() {
    let policy = |yield_after| AdmissionPolicy {
        min_awake: Duration::from_secs(10),
        yield_after,
    };
    for yield_after in [None, Some(Duration::ZERO)] {
        let mut w = World::new(&config(1, &[(1, 0.85), (1, 0.85)])).unwrap();
        w.core = Core::new(
            w.view.clone(),
            w.core_registry(),
            w.clock,
            policy(yield_after),
        );
        w.yielding = yield_after.is_some();
        w.run[0] = Run::Awake;
        w.last_activity[0] = Some(w.clock.now_ms() - 500);
        w.demand(1);
        w.plan().unwrap();
        if yield_after.is_none() {
            assert_eq!(
                w.run,
                [Run::Awake, Run::Waking(false)],
                "evicted in a pause"
            );
            let told = w.told.lock().unwrap()[1].clone().unwrap_or_default();
            assert!(told.contains("served a request a moment ago"), "{told}");
            // Idle for longer than min_awake: it makes room.
            w.last_activity[0] = Some(w.clock.now_ms() - 20_000);
            w.plan().unwrap();
        }
        // (With yield_after, its turn is over at once: it makes room.)
        assert_eq!(w.run[0], Run::Sleeping, "yield_after {yield_after:?}");
    }
}

/// The world's one GPU as NVML shows it, with this test's own process (a
/// process siesta does not run) holding `gib` GiB of it.
fn another_process_holds(w: &World, gib: u64) {
    use crate::gpu::{Inventory, InventorySource};
    w.view.set_inventory(Inventory {
        source: InventorySource::Nvml,
        gpus: vec![held_gpu(gib)],
        note: None,
    });
}

/// GPU 0 of 80 GiB as NVML shows it, with this test's process holding
/// `gib` GiB there (none for 0).
fn held_gpu(gib: u64) -> crate::gpu::GpuInfo {
    use crate::gpu::{GpuInfo, GpuProcessInfo, GpuSpec};
    let mut g = GpuInfo::from_spec(&GpuSpec {
        index: 0,
        name: "g".into(),
        memory_bytes: 80 * GIB,
    });
    if gib > 0 {
        g.processes = vec![GpuProcessInfo {
            pid: std::process::id(),
            used_bytes: gib * GIB,
        }];
    }
    g
}

/// A process that took its memory a moment ago is in no read up to a
/// second old, which admission otherwise plans on (it re-plans every
/// 250 ms): before a wake goes, NVML is read afresh. On an H200, a wake
/// 46 ms after a torch process took 120 GiB was let go on the older read
/// and vLLM failed it ("CUDA Error: out of memory"), and siesta stopped
/// the engine.
#[test]
fn a_wake_goes_only_on_a_fresh_read_of_what_others_hold() {
    let mut w = World::new(&config(1, &[(1, 0.45), (1, 0.45)])).unwrap();
    let gpu = held_gpu;
    // The last read (a moment ago) saw nobody else; NVML now shows 50 GiB.
    another_process_holds(&w, 0);
    let nvml = std::sync::Arc::new(std::sync::Mutex::new(vec![gpu(50)]));
    w.view.script_nvml(nvml.clone());
    // Older than a fresh read may be (50 ms), younger than the second the
    // plan otherwise reads again after.
    w.view.age_reads(std::time::Duration::from_millis(60));
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(w.run[1], Run::Waking(false), "admitted on a stale read");
    let told = w.told.lock().unwrap()[1].clone().unwrap_or_default();
    assert!(told.contains("by processes siesta does not run"), "{told}");
    // The holder gone: the same ask goes at the next read (a waiting ask
    // is planned on reads up to a second old).
    *nvml.lock().unwrap() = vec![gpu(0)];
    w.view.age_reads(crate::gpu_view::INVENTORY_MAX_AGE);
    w.plan().unwrap();
    assert_eq!(w.run[1], Run::Waking(true));
}

/// NVML that stops answering (a GPU off the bus) leaves what others hold
/// unknown: a wake waits, told why, instead of going on the last good read
/// (or holding up admission for as long as NVML does), and goes once NVML
/// answers again.
#[test]
fn a_wake_waits_while_nvml_does_not_answer() {
    let mut w = World::new(&config(1, &[(1, 0.45), (1, 0.45)])).unwrap();
    another_process_holds(&w, 0);
    let nvml = std::sync::Arc::new(std::sync::Mutex::new(vec![held_gpu(0)]));
    w.view.script_nvml(nvml.clone());
    let hang = nvml.lock().unwrap();
    w.view.age_reads(std::time::Duration::from_millis(60));
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(
        w.run[1],
        Run::Waking(false),
        "admitted on a read NVML never gave"
    );
    let told = w.told.lock().unwrap()[1].clone().unwrap_or_default();
    assert!(
        told.contains("a fresh read of the GPUs: NVML has not answered for"),
        "{told}"
    );
    drop(hang);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while w.run[1] != Run::Waking(true) {
        assert!(std::time::Instant::now() < deadline, "never admitted");
        std::thread::sleep(std::time::Duration::from_millis(20));
        w.view.age_reads(crate::gpu_view::INVENTORY_MAX_AGE);
        w.plan().unwrap();
    }
}

/// Memory held by a process siesta does not run counts: two models of
/// 0.45 fit one 80 GiB GPU together, but not beside 20 GiB of someone
/// else's, so the idle one is put to sleep first; beside 50 GiB even that
/// is not enough, and the ask waits, told whose memory it waits for, until
/// that process is gone. Before, both were admitted and vLLM failed the
/// second (start: "Free memory on device ... is less than desired"; wake:
/// out of memory).
#[test]
fn memory_held_by_processes_siesta_does_not_run_is_planned_around() {
    let mut w = World::new(&config(1, &[(1, 0.45), (1, 0.45)])).unwrap();
    another_process_holds(&w, 0);
    w.run[0] = Run::Awake;
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Awake, Run::Waking(true)], "72 of 80 GiB fit");
    w.engines_step();

    let mut w = World::new(&config(1, &[(1, 0.45), (1, 0.45)])).unwrap();
    another_process_holds(&w, 20);
    w.run[0] = Run::Awake;
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(w.run[0], Run::Sleeping, "idle m0 makes room");
    assert_eq!(w.run[1], Run::Waking(false));
    w.engines_step();
    w.plan().unwrap();
    assert_eq!(w.run, [Run::Asleep, Run::Waking(true)]);

    let mut w = World::new(&config(1, &[(1, 0.45), (1, 0.45)])).unwrap();
    another_process_holds(&w, 50);
    w.demand(1);
    w.plan().unwrap();
    assert_eq!(w.run[1], Run::Waking(false));
    let told = w.told.lock().unwrap()[1].clone().unwrap_or_default();
    let pid = std::process::id();
    assert!(
        told.contains(&format!(
            "50.0 GiB by processes siesta does not run: pid {pid} (50.0 GiB)"
        )),
        "{told}"
    );
    // It ends: the ask is admitted.
    another_process_holds(&w, 0);
    w.plan().unwrap();
    assert_eq!(w.run[1], Run::Waking(true));
}

/// Three models of 0.45 on one GPU, adopted after a restart: m0 asleep,
/// m1 and m2 awake (the GPU full), planning started; asked to make room,
/// each calls `evict`.
fn full_gpu(evict: fn()) -> (World, Arc<crate::hub::Hub>, Admission, CancellationToken) {
    let w = World::new(&config(1, &[(1, 0.45), (1, 0.45), (1, 0.45)])).unwrap();
    let hub = crate::hub::Hub::new(w.clock, 16, 16);
    let shutdown = CancellationToken::new();
    let admission = started(&w, &hub, shutdown.clone());
    for n in &w.names {
        admission.registry().insert(n, Arc::new(move |_| evict()));
    }
    hub.publish_model(adopted(&w, 0, State::Asleep));
    hub.publish_model(adopted(&w, 1, State::Awake));
    hub.publish_model(adopted(&w, 2, State::Awake));
    admission.start_planning();
    (w, hub, admission, shutdown)
}

/// The admission task used to answer "admitted" to every ask once it had
/// died (its reply channels dropped): a model then took GPUs no one
/// accounted for. A task killed by a panic (here: in an evictor it calls)
/// now refuses the ask that waited on it and every later one, until the
/// daemon is restarted; at shutdown an ask is told so.
#[tokio::test(start_paused = true)]
async fn an_ask_is_refused_once_the_admission_task_has_died() {
    let (w, hub, admission, shutdown) = full_gpu(|| panic!("an evictor that panics"));
    let status = |i: usize, state: State| adopted(&w, i, state);
    // The GPU is full: the ask makes the task evict, and the task dies.
    let a = admission.clone();
    let ask = tokio::spawn(async move { a.admit("m0", Box::new(|_| {})).await });
    let answer = tokio::time::timeout(Duration::from_secs(5), ask)
        .await
        .expect("the ask is answered when the task dies")
        .unwrap();
    assert_eq!(
        answer,
        Err(AdmissionGone.into()),
        "admitted onto a full GPU"
    );
    // Later asks too, even where there would be room.
    hub.publish_model(status(1, State::Asleep));
    let later = tokio::time::timeout(
        Duration::from_secs(5),
        admission.admit("m1", Box::new(|_| {})),
    )
    .await
    .expect("a later ask is answered at once");
    assert_eq!(later, Err(AdmissionGone.into()));
    // Shutting down: nothing is started any more, and the ask says so.
    shutdown.cancel();
    let during_shutdown = tokio::time::timeout(
        Duration::from_secs(5),
        admission.admit("m1", Box::new(|_| {})),
    )
    .await
    .expect("answered during shutdown");
    assert_eq!(during_shutdown, Err(NotAdmitted::ShuttingDown));
}

/// A wake waiting for room when the daemon shuts down is not let through
/// (its engine woken beside the neighbours it waited for, out of memory,
/// and the next daemon adopting both awake on one GPU): it is told the
/// daemon is shutting down. Before, the ended task's dropped answer read
/// as room.
#[tokio::test(start_paused = true)]
async fn a_wake_waiting_for_room_is_not_let_through_at_shutdown() {
    // Asked to make room, they never do.
    let (_w, _hub, admission, shutdown) = full_gpu(|| {});
    let a = admission.clone();
    let mut ask = tokio::spawn(async move { a.admit("m0", Box::new(|_| {})).await });
    let waiting = tokio::time::timeout(Duration::from_secs(5), &mut ask).await;
    assert!(waiting.is_err(), "admitted onto a full GPU");
    shutdown.cancel();
    let answer = tokio::time::timeout(Duration::from_secs(5), ask)
        .await
        .expect("answered at shutdown")
        .unwrap();
    assert_eq!(answer, Err(NotAdmitted::ShuttingDown));
}
