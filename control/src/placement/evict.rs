//! Run time: GPU budgets from models' states, and what must sleep before a
//! model can wake.

use std::collections::BTreeMap;

use super::{Machine, Placement, Policy, gib};

/// A model's lifecycle state as far as GPU memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    Stopped,
    Starting,
    Awake,
    /// Going to sleep: still holds its memory until confirmed.
    Sleeping,
    Asleep,
    Waking,
    /// Exiting: holds its memory until the process group is gone.
    Stopping,
    /// Failed: what it holds depends on what is left of its engine.
    Failed(FailedEngine),
    /// Being checkpointed: holds its memory until the copy is done.
    Suspending,
    /// Checkpointed to host memory: holds ~0 GPU memory.
    Suspended,
}

/// What is left of a failed model's engine, as far as GPU memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailedEngine {
    /// Its processes are gone (their exit was seen), or it never spawned
    /// one: it holds nothing.
    Gone,
    /// SIGKILLed, its processes not yet seen gone: it holds its memory
    /// until they are, as a stopping model does. (A process stuck in the
    /// kernel, in a hung driver say, may never go: it then really holds it.)
    Exiting,
    /// Attached: siesta can neither stop it nor see it end, and it may well
    /// still run: it holds its memory.
    Attached,
}

impl RunState {
    fn as_str(self) -> &'static str {
        match self {
            Self::Stopped => "stopped",
            Self::Starting => "starting",
            Self::Awake => "awake",
            Self::Sleeping => "going to sleep",
            Self::Asleep => "asleep",
            Self::Waking => "waking",
            Self::Stopping => "stopping",
            Self::Failed(_) => "failed",
            Self::Suspending => "suspending",
            Self::Suspended => "suspended",
        }
    }
}

/// What the reconciler knows of a model right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelRuntime {
    pub state: RunState,
    /// Requests in flight (proxies' count and the engine's own gauge).
    pub in_flight: u32,
    /// End of the last request, unix ms (smaller: idle longer).
    pub last_activity_ms: i64,
    /// Pinned awake by an operator: never evicted.
    pub pinned_awake: bool,
    /// Woken too recently to be evicted yet (`[control] min_awake`): ms left.
    pub min_awake_left_ms: u64,
    /// Nothing in flight, but it answered a request less than `min_awake`
    /// ago: its traffic only paused. Until this is 0 (ms) it counts as busy,
    /// not idle: a victim only once its turn is over (`yield_in_ms`).
    pub active_left_ms: u64,
    /// What putting it to sleep costs when it is wanted again: its
    /// calibrated level-1 sleep and wake, ms.
    pub switch_cost_ms: u64,
    /// Busy (requests in flight), it may be asked to yield its GPUs to a
    /// model that has waited `[control] yield_after` once this is 0: ms
    /// left of its turn. None: it never yields (it cannot sleep, or
    /// `yield_after` is off).
    pub yield_in_ms: Option<u64>,
    /// Asleep, it may be stopped to free what it still keeps on its GPUs
    /// for a model that finds no room otherwise: siesta runs its engine
    /// (not attached), nothing is held for it, it is not pinned and not
    /// itself waiting to wake.
    pub stoppable: bool,
}

impl ModelRuntime {
    pub fn new(state: RunState) -> Self {
        Self {
            state,
            in_flight: 0,
            last_activity_ms: 0,
            pinned_awake: false,
            min_awake_left_ms: 0,
            active_left_ms: 0,
            switch_cost_ms: 0,
            yield_in_ms: None,
            stoppable: false,
        }
    }
}

/// What must happen before a model may wake (or start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WakePlan {
    /// It fits now.
    Ready,
    /// Make room first (least recently used first): the awake ones are put
    /// to sleep, the asleep ones stopped; then it fits.
    Evict(Vec<String>),
    /// It fits once these, going to sleep or stopping now, are done.
    Going(Vec<String>),
    /// Nothing can be evicted now; the reason says what it waits for.
    Wait(String),
}

/// One GPU's memory as placement sees it (for GetPlacement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuBudget {
    pub index: u32,
    pub total_bytes: u64,
    pub awake_bytes: u64,
    pub asleep_bytes: u64,
    /// Held by processes siesta does not run (NVML).
    pub foreign_bytes: u64,
    pub free_bytes: u64,
    pub models: Vec<String>,
}

/// (awake-class bytes, residual bytes) a model holds on `gpu` in `state`.
fn usage(p: &Placement, gpu: u32, state: RunState, residual: u64) -> (u64, u64) {
    let awake = p.awake_on(gpu);
    match state {
        RunState::Starting
        | RunState::Awake
        | RunState::Sleeping
        | RunState::Waking
        | RunState::Stopping
        | RunState::Suspending
        | RunState::Failed(FailedEngine::Exiting | FailedEngine::Attached) => (awake, 0),
        RunState::Asleep => (0, awake.min(residual)),
        RunState::Stopped | RunState::Failed(FailedEngine::Gone) | RunState::Suspended => (0, 0),
    }
}

fn state_of(runtime: &BTreeMap<String, ModelRuntime>, name: &str) -> ModelRuntime {
    runtime
        .get(name)
        .copied()
        .unwrap_or(ModelRuntime::new(RunState::Stopped))
}

/// Every GPU's budget given the models' states (missing models: stopped).
pub fn budgets(
    machine: &Machine,
    placements: &[Placement],
    runtime: &BTreeMap<String, ModelRuntime>,
    policy: &Policy,
) -> Vec<GpuBudget> {
    machine
        .gpus
        .iter()
        .map(|g| {
            let mut b = GpuBudget {
                index: g.index,
                total_bytes: g.total_bytes,
                awake_bytes: 0,
                asleep_bytes: 0,
                foreign_bytes: machine.foreign_on(g.index),
                free_bytes: 0,
                models: Vec::new(),
            };
            for p in placements.iter().filter(|p| p.gpus.contains(&g.index)) {
                let (a, r) = usage(
                    p,
                    g.index,
                    state_of(runtime, &p.model).state,
                    policy.residual_of(&p.model),
                );
                b.awake_bytes += a;
                b.asleep_bytes += r;
                b.models.push(p.model.clone());
            }
            b.free_bytes = g
                .total_bytes
                .saturating_sub(b.awake_bytes + b.asleep_bytes + b.foreign_bytes);
            b
        })
        .collect()
}

/// Can `target` wake now, after evicting some idle models, or must it wait?
///
/// Victims: awake, no requests in flight, not pinned, sharing a GPU with
/// the target; least recently active first, and only as many as needed.
/// `yield_busy` (the target has waited `[control] yield_after`): a busy
/// model whose turn is over may be a victim too, after every idle one
/// (it yields: it finishes what is in flight, then sleeps). Last, asleep
/// models that may be stopped ([`ModelRuntime::stoppable`]) are, for what
/// they keep on the GPU asleep.
pub fn plan_wake(
    target: &str,
    machine: &Machine,
    placements: &[Placement],
    runtime: &BTreeMap<String, ModelRuntime>,
    policy: &Policy,
    yield_busy: bool,
) -> WakePlan {
    let Some(me) = placements.iter().find(|p| p.model == target) else {
        return WakePlan::Wait(format!("\"{target}\" has no placement"));
    };
    let res = |m: &str| policy.residual_of(m);
    // Deficit per GPU of the target: held by others (siesta's models and
    // processes it does not run) + its awake share − total.
    let mut deficit: BTreeMap<u32, i128> = BTreeMap::new();
    for &g in &me.gpus {
        let total = machine.gpu(g).map_or(0, |c| c.total_bytes);
        let held: u64 = placements
            .iter()
            .filter(|p| p.model != target && p.gpus.contains(&g))
            .map(|p| {
                let (a, r) = usage(p, g, state_of(runtime, &p.model).state, res(&p.model));
                a + r
            })
            .sum();
        let held = held + machine.foreign_on(g);
        deficit.insert(
            g,
            i128::from(held) + i128::from(me.awake_on(g)) - i128::from(total),
        );
    }
    let fits = |d: &BTreeMap<u32, i128>| d.values().all(|&x| x <= 0);
    if fits(&deficit) {
        return WakePlan::Ready;
    }

    let freed = |p: &Placement, g: u32| {
        i128::from(p.awake_on(g)) - i128::from(p.awake_on(g).min(res(&p.model)))
    };
    // Models already on their way out of their share free it soon: going
    // to sleep (put to sleep or yielding for this model a moment ago, or
    // an operator's sleep) frees all but its residual; stopping, being
    // checkpointed or failed with its killed processes still exiting
    // frees all. What they free is not asked of anyone else:
    // counting them full, each plan until a sleep was confirmed put one
    // more model to sleep.
    let going: Vec<(&Placement, bool)> = placements
        .iter()
        .filter(|p| p.model != target && p.gpus.iter().any(|g| me.gpus.contains(g)))
        .filter_map(|p| match state_of(runtime, &p.model).state {
            RunState::Sleeping => Some((p, false)),
            RunState::Stopping | RunState::Suspending | RunState::Failed(FailedEngine::Exiting) => {
                Some((p, true))
            }
            _ => None,
        })
        .collect();
    for (p, all) in &going {
        for &g in me.gpus.iter().filter(|g| p.gpus.contains(g)) {
            let frees = if *all {
                i128::from(p.awake_on(g))
            } else {
                freed(p, g)
            };
            *deficit.get_mut(&g).unwrap() -= frees;
        }
    }
    if fits(&deficit) {
        return WakePlan::Going(going.iter().map(|(p, _)| p.model.clone()).collect());
    }
    let mut candidates: Vec<(&Placement, ModelRuntime)> = placements
        .iter()
        .filter(|p| p.model != target && p.gpus.iter().any(|g| me.gpus.contains(g)))
        .map(|p| (p, state_of(runtime, &p.model)))
        .filter(|(_, s)| {
            s.state == RunState::Awake
                && ((s.in_flight == 0 && s.active_left_ms == 0)
                    || (yield_busy && s.yield_in_ms == Some(0)))
                && !s.pinned_awake
                && s.min_awake_left_ms == 0
        })
        .collect();
    // Idle ones before busy ones; then least recently used first, with what
    // each costs to bring back added to its last activity: of two models
    // idle about as long, the one that is cheaper to switch goes; one idle
    // far longer goes whatever its cost.
    let key = |r: &ModelRuntime| {
        let used = r
            .last_activity_ms
            .saturating_add(i64::try_from(r.switch_cost_ms).unwrap_or(i64::MAX));
        (r.in_flight > 0 || r.active_left_ms > 0, used)
    };
    candidates.sort_by(|a, b| key(&a.1).cmp(&key(&b.1)).then(a.0.model.cmp(&b.0.model)));

    // Last, asleep models siesta may stop, least recently used first: what
    // they keep asleep (vLLM: 1–7 GiB per GPU, more than the static check
    // assumed when measured larger) adds up, and nothing else would ever
    // free it before their idle tiers stop them, hours later. Stopping one
    // costs it a start when it is next wanted; putting an idle awake model
    // to sleep costs a wake, so those go first.
    let mut asleep: Vec<(&Placement, ModelRuntime)> = placements
        .iter()
        .filter(|p| p.model != target && p.gpus.iter().any(|g| me.gpus.contains(g)))
        .map(|p| (p, state_of(runtime, &p.model)))
        .filter(|(_, s)| s.state == RunState::Asleep && s.stoppable && s.in_flight == 0)
        .collect();
    asleep.sort_by(|a, b| {
        (a.1.last_activity_ms, &a.0.model).cmp(&(b.1.last_activity_ms, &b.0.model))
    });
    // What each victim frees on `g`: an awake one all but its residual, an
    // asleep one its residual.
    let frees = |p: &Placement, g: u32| {
        if state_of(runtime, &p.model).state == RunState::Asleep {
            i128::from(p.awake_on(g).min(res(&p.model)))
        } else {
            freed(p, g)
        }
    };

    let mut victims: Vec<&Placement> = Vec::new();
    let mut d = deficit.clone();
    for (p, _) in candidates.iter().chain(&asleep) {
        if fits(&d) {
            break;
        }
        let helps = me.gpus.iter().any(|&g| d[&g] > 0 && p.gpus.contains(&g));
        if helps {
            for &g in me.gpus.iter().filter(|g| p.gpus.contains(g)) {
                *d.get_mut(&g).unwrap() -= frees(p, g);
            }
            victims.push(p);
        }
    }
    if fits(&d) {
        // Drop victims that turned out unnecessary, most recent first.
        for i in (0..victims.len()).rev() {
            let v = victims[i];
            let mut without = d.clone();
            for &g in me.gpus.iter().filter(|g| v.gpus.contains(g)) {
                *without.get_mut(&g).unwrap() += frees(v, g);
            }
            if fits(&without) {
                d = without;
                victims.remove(i);
            }
        }
        return WakePlan::Evict(victims.iter().map(|p| p.model.clone()).collect());
    }

    // Say what holds the memory on the first GPU still short.
    let (&g, &short) = d.iter().find(|(_, x)| **x > 0).unwrap();
    let total = machine.gpu(g).map_or(0, |c| c.total_bytes);
    let free_after = i128::from(me.awake_on(g)) - short;
    let mut holders: Vec<String> = placements
        .iter()
        .filter(|p| p.model != target && p.gpus.contains(&g))
        .filter_map(|p| {
            let s = state_of(runtime, &p.model);
            let why = match s.state {
                RunState::Awake if s.pinned_awake => "pinned awake".to_string(),
                RunState::Awake if s.in_flight > 0 => match s.yield_in_ms {
                    Some(ms) if ms > 0 => format!(
                        "{} request(s) in flight; its turn ends in {:.1} s",
                        s.in_flight,
                        ms as f64 / 1e3
                    ),
                    _ => format!("{} request(s) in flight", s.in_flight),
                },
                RunState::Awake if s.active_left_ms > 0 => format!(
                    "served a request a moment ago; idle in {:.1} s unless another comes",
                    s.active_left_ms as f64 / 1e3
                ),
                RunState::Awake if s.min_awake_left_ms > 0 => format!(
                    "woken recently, stays awake {} ms more",
                    s.min_awake_left_ms
                ),
                RunState::Failed(FailedEngine::Exiting) => {
                    "failed, its killed engine's processes not yet gone".to_string()
                }
                RunState::Failed(FailedEngine::Attached) => {
                    "failed, attached: its engine may still hold its memory".to_string()
                }
                RunState::Awake
                | RunState::Asleep
                | RunState::Stopped
                | RunState::Failed(FailedEngine::Gone)
                | RunState::Suspended => {
                    return None;
                }
                other => other.as_str().to_string(),
            };
            Some(format!("\"{}\" ({why})", p.model))
        })
        .collect();
    if let Some(f) = machine.foreign.get(&g).filter(|f| f.bytes > 0) {
        holders.push(format!(
            "{} by processes siesta does not run: {}",
            gib(f.bytes),
            f.describe()
        ));
    }
    WakePlan::Wait(format!(
        "room on GPU {g}: needs {} of {}, {} free even after sleeping idle models; held by {}",
        gib(me.awake_on(g)),
        gib(total),
        gib(free_after.max(0) as u64),
        if holders.is_empty() {
            "asleep residuals".to_string()
        } else {
            holders.join(", ")
        }
    ))
}
