//! The per-model state machine: a pure `step(state, event, now)` returning
//! the new state and the effects to carry out. No I/O here.

mod adopt;
mod calibration;
mod drive;
mod step;
#[cfg(test)]
mod tests;
mod tiers;

pub use adopt::{Observed, adopt};
pub use calibration::{Average, Calibration};
pub use step::step;
pub use tiers::{due_tier, next_tier};

use crate::config::{Backoff, EngineKind, IdleTier, ModelConfig, Preload, Timeouts};
use std::collections::BTreeMap;
use tokio::time::{Duration, Instant};

/// A proxy with requests in flight or held re-reports them every second;
/// one silent this long is gone (killed) and its counts no longer count.
/// Ten missed reports: a loaded control plane is not mistaken for a gone
/// proxy, and a killed one keeps a model from sleeping (or wanted awake)
/// 10 s at most (it was 30 s).
pub const PROXY_STALE: Duration = Duration::from_secs(10);

/// The longest a proxy's report of a finished request is taken to lag
/// behind it (reports go out every 100 ms): an earlier `last_finished` is
/// the proxy's clock running behind, not an idle engine.
pub const REPORT_LAG: Duration = Duration::from_secs(2);

/// What one proxy last reported of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyLoad {
    pub in_flight: u32,
    pub held: u32,
    /// When it was reported (dropped after [`PROXY_STALE`]).
    pub at: Instant,
}

/// How long a wake may wait for room on its GPUs (see the constant in
/// `config`, which bounds `yield_after` by it).
pub use crate::config::{NO_ROOM, ROOM_WAIT};

/// How long the checkpoint helper may take to suspend an engine: it copies
/// the whole GPU allocation to host memory (about 2 GB/s measured on an
/// H200: 43.5 GB in 20 s), so a full 141 GB GPU takes some 70 s.
pub const SUSPEND_TIMEOUT: Duration = Duration::from_secs(600);

/// Failed periodic probes in a row that fail an engine (one slow answer or
/// a connection the engine just closed is not a fault).
pub const HEALTH_STRIKES: u8 = 3;
/// How long probes that time out while the engine has requests in flight
/// are taken for load, not a fault (an engine tokenizing a burst of 10,000
/// held requests can be slow to answer `/health`); after that they count.
pub const BUSY_PROBE_GRACE: Duration = Duration::from_secs(60);

/// How long an engine must stay up after it became ready before its
/// failures are forgotten (the next one backs off from the shortest delay
/// again): one that dies soon after (out of memory on its first request)
/// keeps backing off instead of restarting every start time.
pub const STABLE_AFTER: Duration = Duration::from_secs(60);

/// What the reconciler works towards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Desired {
    Stopped,
    Awake,
    Asleep(u8),
    /// GPU state checkpointed to host memory by the CUDA driver.
    Suspended,
}

impl Desired {
    /// What the configuration's `preload` asks for (an attached engine is
    /// always there: `none` is awake).
    pub fn from_preload(preload: Preload, attach: bool) -> Desired {
        match (preload, attach) {
            (Preload::Awake, _) | (Preload::None, true) => Desired::Awake,
            (Preload::Asleep, _) => Desired::Asleep(1),
            (Preload::None, false) => Desired::Stopped,
        }
    }
}

impl Desired {
    /// In words, for logs: `awake`, `asleep at level 1`, `suspended`,
    /// `stopped` (the Rust form, `Asleep(1)`, was logged before).
    pub fn describe(self) -> String {
        match self {
            Desired::Awake => "awake".into(),
            Desired::Asleep(l) => format!("asleep at level {l}"),
            Desired::Suspended => "suspended".into(),
            Desired::Stopped => "stopped".into(),
        }
    }

    /// How far from serving: awake 0, asleep 1 or 2, suspended 3, stopped 4.
    pub fn depth(self) -> u8 {
        match self {
            Desired::Awake => 0,
            Desired::Asleep(l) => l,
            Desired::Suspended => 3,
            Desired::Stopped => 4,
        }
    }
}

/// Why the intent holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Config,
    Demand,
    Operator,
    Pin,
    IdleTier,
    /// Put to sleep to make room on its GPUs for another model.
    Eviction,
}

/// The intent: desired state, why, since when, until when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Intent {
    pub desired: Desired,
    pub reason: Reason,
    pub since: Instant,
    pub until: Option<Instant>,
}

/// Observed lifecycle state, with the data each state needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Stopped,
    /// Until `admitted`, the start waits for room on its GPUs (at most
    /// [`ROOM_WAIT`], like a wake); then for the per-GPU start lock (up to
    /// twice the start timeout); `spawned`: the engine process is launched
    /// (the deadline is the start timeout from there).
    Starting {
        deadline: Instant,
        spawned: bool,
        admitted: bool,
    },
    Awake,
    /// The engine is asked once no engine starts on its GPUs (vLLM fails a
    /// start whose GPU frees memory while it profiles): until `FreeBegan`
    /// the deadline allows [`ROOM_WAIT`] more, then it counts from there.
    Sleeping {
        level: u8,
        deadline: Instant,
    },
    Asleep {
        level: u8,
    },
    /// `step` indexes [`wake_calls`]`(kind, from_level)`. Until `admitted`, the
    /// wake waits for room on its GPUs (at most [`ROOM_WAIT`]). Then each
    /// step's call may wait for a neighbour's sleep on its GPUs (vLLM fails
    /// a sleep whose GPU's memory grows meanwhile): while `left` is set the
    /// step has not been called, and the deadline allows [`ROOM_WAIT`]
    /// ([`first_call_wait`] for the first) more than the `left` wake time;
    /// `WakeBegan` makes it `left` from then.
    /// The wake timeout counts only while calls run.
    Waking {
        from_level: u8,
        step: usize,
        deadline: Instant,
        admitted: bool,
        left: Option<Duration>,
        /// The wake timeout its deadlines count from once admitted (the
        /// settings' then: a reload may change them mid-wake).
        budget: Duration,
    },
    /// The checkpoint helper runs on the engine's CUDA processes. `under`:
    /// the sleep level the engine was at (0: awake), where a resume lands.
    Suspending {
        under: u8,
        deadline: Instant,
    },
    /// Checkpointed: nothing may reach the engine (no request, no probe).
    Suspended {
        under: u8,
    },
    /// Restore + unlock. Until `admitted`, waits for room on its GPUs (at
    /// most [`ROOM_WAIT`]), like a wake; then, like a wake's call, for a
    /// neighbour's sleep there: the wake timeout counts from `WakeBegan`.
    Resuming {
        under: u8,
        deadline: Instant,
        admitted: bool,
    },
    /// A stop or restart of an awake engine (an operator's, a tier's, an
    /// eviction's), before SIGTERM:
    /// published as stopping, so proxies forward nothing more to it; the
    /// SIGTERM waits until every live proxy has confirmed it has nothing in
    /// flight to it (`Drained`), or `deadline` (one stop grace).
    Draining {
        deadline: Instant,
    },
    /// A busy engine yields its GPUs to a model that waited for them
    /// (`[control] yield_after`): published as sleeping, so proxies hold
    /// new requests; once every live proxy has confirmed it has nothing in
    /// flight to it (`drained`) and nothing else is (the engine's gauge),
    /// it sleeps at `level`. Not drained by `deadline` (one stop grace):
    /// it serves again, nothing cut.
    Yielding {
        level: u8,
        deadline: Instant,
        drained: bool,
    },
    /// SIGTERM goes to the engine once no engine starts on its GPUs (its
    /// exit frees their memory, which fails such a start, as a sleep
    /// would): until `FreeBegan` the deadline allows [`ROOM_WAIT`] more,
    /// then it is one stop grace from there. `killed`: SIGKILL already sent.
    Stopping {
        deadline: Instant,
        killed: bool,
    },
    /// `retry_at`: when it starts again (None: not wanted running).
    /// `process_gone`: no process of its engine's current generation is
    /// left: it was never spawned, or its exit (leader reaped, process
    /// group swept: `ChildExited`) has been seen. Until then the SIGKILLed
    /// processes may still hold its GPU memory: placement counts its share,
    /// and it neither restarts nor counts as stopped. An attached engine's
    /// is never gone (siesta can neither stop it nor see it end).
    Failed {
        retry_at: Option<Instant>,
        process_gone: bool,
    },
}

impl Phase {
    pub fn deadline(&self) -> Option<Instant> {
        match *self {
            Phase::Starting { deadline, .. }
            | Phase::Sleeping { deadline, .. }
            | Phase::Waking { deadline, .. }
            | Phase::Suspending { deadline, .. }
            | Phase::Resuming { deadline, .. }
            | Phase::Draining { deadline }
            | Phase::Yielding { deadline, .. }
            | Phase::Stopping { deadline, .. } => Some(deadline),
            _ => None,
        }
    }

    /// Suspending, suspended or resuming: the engine's CUDA state is (or
    /// is being) checkpointed, and nothing but the checkpoint helper may
    /// touch it (a request or probe reaching it can kill it).
    pub fn untouchable(&self) -> bool {
        matches!(
            self,
            Phase::Suspending { .. } | Phase::Suspended { .. } | Phase::Resuming { .. }
        )
    }
}

/// One call of a wake sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeCall {
    /// `POST /wake_up` (all tags).
    WakeUp,
    /// `POST /wake_up?tags=weights`.
    WakeWeights,
    /// `POST /collective_rpc {"method":"reload_weights"}`.
    ReloadWeights,
    /// `POST /wake_up?tags=kv_cache`.
    WakeKvCache,
    /// `POST /reset_prefix_cache`.
    ResetPrefixCache,
    /// SGLang: `POST /resume_memory_occupation {}` (every tag).
    ResumeMemory,
}

/// The calls that wake an engine of `kind` asleep at `level`.
pub fn wake_calls(kind: EngineKind, level: u8) -> &'static [WakeCall] {
    if kind == EngineKind::Sglang {
        &[WakeCall::ResumeMemory]
    } else if level >= 2 {
        &[
            WakeCall::WakeWeights,
            WakeCall::ReloadWeights,
            WakeCall::WakeKvCache,
            WakeCall::ResetPrefixCache,
        ]
    } else {
        &[WakeCall::WakeUp]
    }
}

/// Operator commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Wake,
    Sleep(u8),
    /// Checkpoint the engine's GPU state to host memory.
    Suspend,
    Start,
    Stop,
    Restart,
}

/// Everything that can happen to a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Command(Command),
    /// A proxy holds requests for the model.
    Demand,
    /// A reload removes or changes the model: stop it for good, letting
    /// answers under way finish (as an operator's stop); demand is ignored
    /// from now on (a changed model's new engine takes it).
    Retire,
    /// Sleep (level 1) to make room for another model, if idle and unpinned.
    Evict,
    /// Busy past its turn: finish what is in flight, hold new requests,
    /// then sleep, to make room for `to` (if awake and unpinned).
    Yield {
        to: String,
    },
    /// `to` needs this model's yield no more (an idle model made room, or
    /// its wake left the queue): if it is still finishing its requests to
    /// yield, it serves again.
    CallOffYield {
        to: String,
        /// Why, after `to`'s name: "found room without it".
        why: &'static str,
    },
    /// Keep awake until (None: until Unpin).
    Pin(Option<Instant>),
    Unpin,
    /// A proxy's report: its requests in flight now and whether any
    /// started or finished since its last report.
    Activity {
        proxy: String,
        in_flight: u32,
        /// Requests it holds for the model (shown, not acted on: the
        /// proxy's `Demand` is what wakes the model).
        held: u32,
        active: bool,
        last_finished: Option<Instant>,
    },
    /// The engine's own `vllm:num_requests_running`.
    EngineMetrics {
        running: u32,
    },
    Spawned {
        proc_gen: u64,
        pid: u32,
    },
    SpawnFailed {
        proc_gen: u64,
        error: String,
    },
    ChildExited {
        proc_gen: u64,
        status: String,
        /// The exception its output ended with, if any.
        cause: Option<String>,
    },
    /// `/health` answered 200 (`asleep`: the engine says it sleeps, at that level).
    HealthOk {
        epoch: u64,
        asleep: Option<u8>,
    },
    /// A periodic probe of an awake or asleep engine failed (one strike;
    /// [`HEALTH_STRIKES`] in a row fail the engine).
    HealthFailed {
        epoch: u64,
        error: String,
        /// No answer within the probe's deadline (not a refusal or an
        /// error answer): forgiven for a while when the engine is busy.
        timed_out: bool,
        /// The connection was refused: nothing listens on the engine's
        /// port (vLLM closes its listener at SIGTERM, then finishes or
        /// aborts what it runs and exits).
        refused: bool,
    },
    /// A periodic probe answered: the strikes start again from zero.
    ProbeOk {
        epoch: u64,
    },
    /// A periodic probe of an engine taken as awake found it asleep at
    /// `level` (its `vllm:engine_sleep_state`): a sleep siesta did not see
    /// finish (a control restart while it ran) or one sent to the engine
    /// directly. Requests reaching it would wait in its queue until a wake.
    FoundAsleep {
        epoch: u64,
        level: u8,
    },
    /// The wait of a sleep, stop or suspend for starts on its GPUs is over:
    /// the engine is asked to sleep, signalled, or checkpointed now.
    FreeBegan {
        epoch: u64,
    },
    SleepDone {
        epoch: u64,
    },
    SleepFailed {
        epoch: u64,
        error: String,
    },
    /// Requests reached the engine as its sleep began (its gauges, read
    /// just before `/sleep`: forwarded before a proxy saw the sleep, or
    /// sent to the engine directly): nothing was asked of the engine, it
    /// serves them, and sleeps once they are done. (Asked, vLLM's
    /// `mode=wait` drained them under the sleep's timeout, and a request
    /// longer than that had the healthy engine killed.)
    SleepCalledOff {
        epoch: u64,
        running: u32,
    },
    /// A wake step's call (`step`), or a restore (step 0), begins now: its
    /// wait for a neighbour's sleep on its GPUs is over.
    WakeBegan {
        epoch: u64,
        step: usize,
    },
    WakeStepDone {
        epoch: u64,
        step: usize,
    },
    /// A wake, resume or start waited for room on its GPUs and has it now:
    /// its deadline (and a wake's calibration) counts from here.
    Admitted {
        epoch: u64,
    },
    WakeFailed {
        epoch: u64,
        error: String,
    },
    /// Every CUDA process of the engine is checkpointed.
    SuspendDone {
        epoch: u64,
    },
    /// The helper (or the host-memory check before it) refused or failed;
    /// it put back what it did, the engine runs as before.
    SuspendFailed {
        epoch: u64,
        error: String,
    },
    /// A request arrived before the helper started: nothing was done, the
    /// engine serves as before.
    SuspendCalledOff {
        epoch: u64,
    },
    /// Every live proxy confirmed it has nothing in flight to the draining
    /// engine, or the wait for that ended (`error` says why).
    Drained {
        epoch: u64,
        error: Option<String>,
    },
    /// Every CUDA process of the engine is restored and unlocked.
    ResumeDone {
        epoch: u64,
    },
    /// A restore failed: the engine cannot be trusted and is restarted.
    ResumeFailed {
        epoch: u64,
        error: String,
    },
    /// A timer fired (deadlines, retries, tiers, pin expiry are checked).
    Tick,
}

/// What the model's task must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Take the start lock of the model's GPUs, make sure no old process is
    /// left, spawn; answer `Spawned` or `SpawnFailed`. `fresh_port`: pick a
    /// new free port first (after a failure, the old one may be taken).
    Spawn {
        proc_gen: u64,
        fresh_port: bool,
    },
    /// The engine of `proc_gen` that was just spawned is wanted: supervise it.
    KeepSpawned {
        proc_gen: u64,
    },
    /// The engine of `proc_gen` that was just spawned is no longer wanted
    /// (a stop or restart came first): SIGKILL its process group.
    KillStray {
        proc_gen: u64,
    },
    /// Probe `/health` until it answers 200; answer `HealthOk` (tagged
    /// `epoch`). `check_sleep`: the engine may be asleep (attached, or
    /// adopted after a restart of siesta): ask `/is_sleeping` too, never
    /// taking "no answer" for awake.
    ProbeHealth {
        epoch: u64,
        check_sleep: bool,
    },
    Sleep {
        epoch: u64,
        level: u8,
    },
    /// Check host memory, then run the checkpoint helper's `suspend` on
    /// every CUDA process of the engine's process group; answer
    /// `SuspendDone` or `SuspendFailed`. Sent only when nothing is in
    /// flight, after [`Effect::RecordSuspended`].
    Suspend {
        epoch: u64,
    },
    /// Wait (until the phase's deadline: one stop grace) until every live
    /// proxy has applied the draining or yielding state and has nothing in
    /// flight to the engine; answer `Drained`.
    Drain {
        epoch: u64,
    },
    /// Wait for room on the GPUs (answer `Admitted`), then run the
    /// helper's `resume`; answer `ResumeDone` or `ResumeFailed`.
    Resume {
        epoch: u64,
    },
    Wake {
        epoch: u64,
        step: usize,
        call: WakeCall,
    },
    /// SIGTERM to the engine's process group once no engine starts on its
    /// GPUs (waiting at most [`ROOM_WAIT`]); answer `FreeBegan` as it is
    /// sent. The GPUs stay held off for starts until the engine is gone.
    Terminate {
        epoch: u64,
    },
    /// SIGKILL to the engine's process group, at once.
    Kill,
    /// Drop the per-GPU start lock if held.
    ReleaseStartLock,
    /// Wake the task at this time (None: no timer needed).
    Timer(Option<Instant>),
    /// A line for the model's log ("siesta" stream).
    Log(String),
    /// The intent changed: persist it.
    Persist,
    /// The restart count, the last activity or the idle floor changed:
    /// persist them (the runner may batch a busy model's activity).
    PersistHistory,
    /// The calibration changed: persist it.
    PersistCalibration,
    /// The engine is now awake (0) or asleep at this level: record it for
    /// recovery.
    RecordSleepLevel(u8),
    /// A suspend is about to start (recorded before the helper runs, so a
    /// restarted control adopts the engine as suspended, never probing it).
    RecordSuspended {
        under: u8,
    },
    /// The engine is asleep now: measure what it still holds on its GPUs.
    MeasureResidual,
}

/// Pin state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    None,
    Until(Instant),
    Forever,
}

/// Per-model settings the state machine needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub attach: bool,
    /// What the engine can do: the step plans nothing else.
    pub kind: EngineKind,
    pub tiers: Vec<IdleTier>,
    pub timeouts: Timeouts,
    pub backoff: Backoff,
}

impl Settings {
    pub fn from_config(m: &ModelConfig) -> Self {
        Self {
            attach: m.is_attach(),
            kind: m.engine,
            tiers: m.idle.clone(),
            timeouts: m.timeouts,
            backoff: m.backoff,
        }
    }
}

/// A model's whole state as the reconciler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelState {
    pub settings: Settings,
    pub phase: Phase,
    /// When `phase` was entered.
    pub since: Instant,
    /// Incremented on every phase change; results of older effects are ignored.
    pub epoch: u64,
    /// Incremented on every spawn; exits of older processes are ignored.
    pub proc_gen: u64,
    pub intent: Intent,
    pub pin: Pin,
    /// End of the last request seen.
    pub last_activity: Option<Instant>,
    /// Idle time never counts from before this: the engine becoming ready
    /// or awake, the end of a preload, a demand, an operator wake.
    pub idle_floor: Instant,
    /// An attached engine's idle floor as recorded before this daemon
    /// started: found serving by its first probe, it was ready before, so
    /// its idle clock goes on from there instead of starting over (a
    /// failure first, and the floor is its readiness again).
    pub recorded_floor: Option<Instant>,
    /// A proxy's demand not yet served (the model was not awake when it
    /// came): no idle tier fires until the model is awake, and only an
    /// operator's intent overrides it.
    pub demand_since: Option<Instant>,
    /// Requests in flight per proxy, and when that proxy last said so.
    pub proxies: BTreeMap<String, ProxyLoad>,
    /// The engine's own running-requests gauge.
    pub engine_running: u32,
    pub failures: u32,
    /// When `failures` are forgotten if the engine is still up then
    /// ([`STABLE_AFTER`] after it became ready following failures); a
    /// failure, an exit or a new start before that cancels it.
    pub stable_at: Option<Instant>,
    /// Failed periodic probes in a row (see [`HEALTH_STRIKES`]).
    pub health_strikes: u8,
    /// Since when probes have been timing out while requests were in
    /// flight (see [`BUSY_PROBE_GRACE`]); cleared by an answer.
    pub busy_timeouts_since: Option<Instant>,
    pub last_error: Option<String>,
    pub pid: Option<u32>,
    /// The last generation whose exit (`ChildExited`) was seen: a process
    /// that exits at once may have its exit seen before its `Spawned`.
    pub exited_gen: Option<u64>,
    pub restarts: u32,
    /// When the transition under way started (for calibration).
    pub transition_start: Instant,
    /// The start under way is an engine adopted before it served: when it
    /// was spawned is not known, so its start time is not a sample.
    pub start_time_unknown: bool,
    pub calibration: Calibration,
    /// Removed or changed by a reload: stopping for good (answers under
    /// way finish first); demand no longer wakes it.
    pub retiring: bool,
    /// Yields given up in a row (its requests in flight outlasted the stop
    /// grace): admission gives it a turn twice as long for each, so a
    /// model whose answers are long is not held up again every turn.
    pub yields_given_up: u32,
    /// No idle tier fires before this: an engine adopted after a restart
    /// of siesta goes on with its recorded idle clock, but its requests in
    /// flight are known only once the proxies (every second while they
    /// have any) and its own gauge have reported.
    pub tiers_after: Option<Instant>,
    /// No tier that needs a wake first (a deeper sleep from asleep) fires
    /// before this: one found no room on its GPUs. Tiers that need none (a
    /// stop) go on with the idle clock.
    pub deepen_after: Option<Instant>,
    /// When an operator last asked for a restart of a running engine:
    /// persisted with the intent, so a control plane restarted before the
    /// old engine stopped (its drain takes up to a stop grace) does not
    /// adopt an engine spawned before this, and the restart is not lost.
    pub restart_asked: Option<Instant>,
    /// Starts in a row that vLLM failed because memory was freed on their
    /// GPUs while it profiled (`PROFILE_RETRIES` at most are started
    /// again at once, held requests still held); reset when an engine
    /// comes up and when the model fails (its next start, after backoff,
    /// may be made anew again).
    pub profile_races: u32,
}

/// Starts failed by memory freed on their GPUs while vLLM profiled ("Error
/// in memory profiling": a neighbour that crashed, or a process siesta does
/// not run) that are started again at once, not failed: the cause is gone
/// once the memory is free, and a failed model's held requests would be
/// answered 503.
pub const PROFILE_RETRIES: u32 = 3;

/// How long a wake's first call may wait before it is made, beyond admission:
/// for a sleep still draining on the engine (the runner gives it half the
/// wake timeout, and its probes) and for a neighbour's sleep on its GPUs
/// (at most [`ROOM_WAIT`]). Past that (and the wake time), the wake fails.
pub fn first_call_wait(wake: Duration) -> Duration {
    ROOM_WAIT + wake / 2 + Duration::from_secs(10)
}

/// Whether an engine's exit cause is vLLM's memory-profiling assertion.
pub fn profiling_race(cause: &str) -> bool {
    cause.contains("Error in memory profiling")
}

impl ModelState {
    /// The state at boot: stopped, with the configured preload as intent.
    pub fn new(settings: Settings, preload: Preload, now: Instant) -> Self {
        let desired = Desired::from_preload(preload, settings.attach);
        Self {
            settings,
            phase: Phase::Stopped,
            since: now,
            epoch: 0,
            proc_gen: 0,
            intent: Intent {
                desired,
                reason: Reason::Config,
                since: now,
                until: None,
            },
            pin: Pin::None,
            last_activity: None,
            idle_floor: now,
            recorded_floor: None,
            demand_since: None,
            proxies: BTreeMap::new(),
            engine_running: 0,
            failures: 0,
            stable_at: None,
            health_strikes: 0,
            busy_timeouts_since: None,
            last_error: None,
            pid: None,
            exited_gen: None,
            restarts: 0,
            transition_start: now,
            start_time_unknown: false,
            calibration: Calibration::default(),
            retiring: false,
            yields_given_up: 0,
            tiers_after: None,
            deepen_after: None,
            restart_asked: None,
            profile_races: 0,
        }
    }

    /// Requests in flight: the larger of what the proxies count and the
    /// engine's gauge. A request forwarded by a proxy is in both (their
    /// sum, shown before, was twice the real load); the gauge alone sees
    /// requests sent to the engine directly, the proxies alone those on
    /// their way to it. Zero exactly when both are.
    pub fn in_flight(&self) -> u32 {
        self.proxies_in_flight().max(self.engine_running)
    }

    /// Requests in flight through the proxies (saturating).
    pub fn proxies_in_flight(&self) -> u32 {
        self.proxies
            .values()
            .fold(0, |n, p| n.saturating_add(p.in_flight))
    }

    /// Requests the proxies hold for the model now (saturating).
    pub fn held(&self) -> u32 {
        self.proxies
            .values()
            .fold(0, |n, p| n.saturating_add(p.held))
    }

    pub fn pinned(&self, now: Instant) -> bool {
        match self.pin {
            Pin::None => false,
            Pin::Forever => true,
            Pin::Until(t) => t > now,
        }
    }

    /// When idle time starts counting.
    pub fn idle_start(&self) -> Instant {
        self.last_activity
            .map_or(self.idle_floor, |a| a.max(self.idle_floor))
    }

    /// Retry delay after `failures` failures.
    pub fn backoff(&self) -> Duration {
        self.settings.backoff.delay(self.failures)
    }
}
