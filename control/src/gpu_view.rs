//! The GPU side as the server publishes it: inventory (NVML or `[[gpu]]`),
//! P2P results and the placement of every model. Glue over `gpu` and
//! `placement`; it converts to `siesta.v1` messages for ListGpus,
//! GetPlacement, DiagP2p and the Watch stream.

use crate::config::{Config, ConfigError, P2pProbeConfig};
use crate::gpu::p2p::P2pMatrix;
use crate::gpu::{GpuSource, GpuSpec, Inventory, InventorySource};
use crate::placement::default_residual;
use crate::placement::{
    FailedEngine, Foreign, Machine, ModelRuntime, Placed, Placement, Planned, Policy, RunState,
    WakePlan, budgets, place_config, plan_wake, policy_of,
};
use crate::reconciler::Desired;
use crate::status::Residual;
use crate::status::{ModelStatus, State};
use crate::supervisor::procfs;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod foreign;
mod p2p;
mod reader;
mod report;
#[cfg(test)]
mod tests;

pub(crate) use reader::NVML_ANSWER_WAIT;
pub use report::{GpuList, ModelPlacement, P2pDiag, PlacementReport};

#[derive(Debug)]
struct ViewState {
    inventory: Inventory,
    /// When `inventory` was read (NVML inventories are re-read when stale).
    read_at: Instant,
    p2p: P2pMatrix,
    p2p_probed_unix_ms: i64,
    placements: Vec<Placement>,
    /// Why models have no placement: no GPU is known (they run on their
    /// pinned or first GPUs), or the configuration was refused.
    placement_note: Option<String>,
    /// The configuration can never fit: the daemon refuses to start.
    refusal: Option<ConfigError>,
    /// The last NVML read failed: `inventory` is an older snapshot, its
    /// processes maybe gone.
    read_failed: bool,
    /// NVML has not answered the read out now, begun this long ago (a hung
    /// driver): `inventory` is the last good snapshot.
    silent_for: Option<Duration>,
    /// NVML's pids are this process's PID namespace's (the host's): only
    /// then can a GPU process be told siesta's or someone else's.
    pids_here: bool,
}

/// Inventory, P2P and placement.
#[derive(Debug)]
pub struct GpuView {
    state: Mutex<ViewState>,
    reader: reader::Reader,
    policy: Policy,
    /// What each model holds per GPU while asleep: its default until an
    /// NVML measurement after a sleep replaces it.
    residuals: Mutex<BTreeMap<String, Residual>>,
    /// Where `p2p.json` lives.
    state_dir: PathBuf,
    probe: P2pProbeConfig,
    /// One probe at a time.
    probing: tokio::sync::Mutex<()>,
}

/// How old an NVML inventory may get before `ListGpus` reads it again.
pub(crate) const INVENTORY_MAX_AGE: Duration = Duration::from_secs(1);

/// NVML when any model needs a GPU (the config's `[[gpu]]` list where NVML
/// is absent), else only the config's list.
fn source_for(config: &Config) -> GpuSource {
    let specs: Vec<GpuSpec> = config
        .gpus
        .iter()
        .map(|g| GpuSpec {
            index: g.index,
            name: g.name.clone(),
            memory_bytes: g.memory_bytes,
        })
        .collect();
    if config.models.iter().any(|m| m.gpus > 0) {
        GpuSource::detect(&specs)
    } else {
        GpuSource::from_config(&specs)
    }
}

/// What a model holds per GPU asleep before any measurement.
fn default_residual_of(config: &Config, gpus: u32) -> Residual {
    Residual {
        bytes: config
            .control
            .asleep_residual
            .unwrap_or_else(|| default_residual(gpus)),
        ..Residual::default()
    }
}

/// Why models run unplaced when no GPU is known.
const NO_INVENTORY: &str =
    "no GPU known (no NVML, no [[gpu]] in the config): pinned or first GPUs used";

/// `siesta config check`: places `config` as the daemon would at start
/// (same inventory source, saved P2P verdicts from its state directory),
/// starting nothing. Blocking (NVML).
pub fn check(config: &Config) -> Result<Planned, ConfigError> {
    let inventory = source_for(config).snapshot();
    let p2p = p2p::saved(&config.control.state_dir, &inventory)
        .map(|(m, _)| m)
        .unwrap_or_default();
    let machine = Machine::from_inventory(&inventory, p2p);
    place_config(config, &machine, &BTreeMap::new())
}

fn run_state(m: &ModelStatus) -> RunState {
    match m.state {
        // A start or wake still waiting for room holds what its engine
        // holds now, nothing or its asleep residual (it was counted awake
        // in the placement report: an 80 GiB GPU read 96 GiB awake with a
        // model waiting beside a pinned one; admission also maps its own
        // queued asks so, before their status says it).
        State::Starting if m.awaiting_room => RunState::Stopped,
        State::Waking if m.awaiting_room => RunState::Asleep,
        State::Stopped => RunState::Stopped,
        State::Starting => RunState::Starting,
        State::Awake => RunState::Awake,
        State::Sleeping => RunState::Sleeping,
        State::Asleep => RunState::Asleep,
        State::Waking => RunState::Waking,
        State::Stopping => RunState::Stopping,
        State::Failed if !m.failed_holds_gpus => RunState::Failed(FailedEngine::Gone),
        State::Failed if m.launch == "attach" => RunState::Failed(FailedEngine::Attached),
        State::Failed => RunState::Failed(FailedEngine::Exiting),
        State::Suspending => RunState::Suspending,
        State::Suspended => RunState::Suspended,
    }
}

/// What placement needs to know of each model's run time.
pub(crate) fn runtime(models: &[ModelStatus]) -> BTreeMap<String, ModelRuntime> {
    models
        .iter()
        .map(|m| {
            let mut r = ModelRuntime::new(run_state(m));
            r.in_flight = m.in_flight;
            r.last_activity_ms = m.last_activity_unix_ms.unwrap_or(0);
            // An attached engine that cannot sleep cannot make room: never a victim.
            let immovable = m.launch == "attach" && m.engine.deepest_sleep().is_none();
            r.pinned_awake = m.pin.is_pinned() || immovable;
            r.stoppable = m.launch != "attach"
                && m.held == 0
                && !m.pin.is_pinned()
                && m.intent.desired != Desired::Awake;
            // What bringing it back costs: a level-1 sleep and wake, or a
            // whole start for an engine that cannot sleep (it is stopped).
            r.switch_cost_ms = if m.engine.deepest_sleep().is_some() {
                m.calibration.sleep[0].millis() + m.calibration.wake[0].millis()
            } else {
                m.calibration.start.millis()
            };
            (m.name.clone(), r)
        })
        .collect()
}

impl GpuView {
    /// Reads the inventory (NVML when any model needs a GPU, else only the
    /// config's list), loads the saved P2P results, runs the P2P probe when
    /// `[control] p2p_probe = "start"`, and places every model.
    ///
    /// `keep`: the GPUs engines left by the previous control plane were
    /// placed on (see [`crate::store::Store::engine_gpus`]). They are kept
    /// where the configuration still fits that way, as a reload keeps
    /// running models: a placement made afresh may differ (after a reload
    /// removed a model, say), change an engine's `CUDA_VISIBLE_DEVICES`,
    /// and make recovery stop an engine it should adopt.
    ///
    /// Blocking (NVML, and the probe up to its deadline): call it from
    /// `spawn_blocking` or outside any runtime, never from async code.
    pub fn detect(config: &Config, keep: &BTreeMap<String, Vec<u32>>) -> GpuView {
        let source = source_for(config);
        let inventory = source.snapshot();
        let view = GpuView {
            state: Mutex::new(ViewState {
                inventory,
                read_at: Instant::now(),
                p2p: P2pMatrix::default(),
                p2p_probed_unix_ms: 0,
                placements: Vec::new(),
                placement_note: None,
                refusal: None,
                read_failed: false,
                silent_for: None,
                pids_here: foreign::host_pid_namespace(),
            }),
            reader: reader::Reader::new(source),
            policy: policy_of(config),
            residuals: Mutex::new(
                config
                    .models
                    .iter()
                    .map(|m| (m.name.clone(), default_residual_of(config, m.gpus)))
                    .collect(),
            ),
            state_dir: config.control.state_dir.clone(),
            probe: config.control.p2p_probe,
            probing: tokio::sync::Mutex::new(()),
        };
        view.load_p2p();
        if view.probe.at_start {
            view.probe_at_start();
        }
        match view.plan(config, keep) {
            Ok(planned) => view.apply(config, planned),
            Err(e) => {
                tracing::error!(error = %e, "configuration refused: a model can never fit its GPUs");
                let mut st = view.state.lock().unwrap();
                st.placement_note = Some(format!("refused: {e}"));
                st.refusal = Some(e);
            }
        }
        view
    }

    /// Why the configuration given to [`Self::detect`] is refused (a model
    /// can never be placed); the daemon then does not start.
    pub fn refusal(&self) -> Option<ConfigError> {
        self.state.lock().unwrap().refusal.clone()
    }

    /// Places `config` on this view's inventory and P2P verdicts, keeping
    /// models on the GPUs in `keep` where everything still fits. Changes
    /// nothing: see [`Self::apply`].
    pub fn plan(
        &self,
        config: &Config,
        keep: &BTreeMap<String, Vec<u32>>,
    ) -> Result<Planned, ConfigError> {
        let st = self.state.lock().unwrap();
        let machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        place_config(config, &machine, keep)
    }

    /// The GPUs each placed model has now (what a reload tries to keep).
    pub fn current_gpus(&self) -> BTreeMap<String, Vec<u32>> {
        let st = self.state.lock().unwrap();
        st.placements
            .iter()
            .map(|p| (p.model.clone(), p.gpus.clone()))
            .collect()
    }

    /// Makes `planned` (for `config`) the placement admission and engine
    /// starts read; models new to the view get their default asleep
    /// residual, models gone from `config` lose theirs.
    pub fn apply(&self, config: &Config, planned: Planned) {
        {
            let mut residuals = self.residuals.lock().unwrap();
            residuals.retain(|name, _| config.models.iter().any(|m| &m.name == name));
            for m in &config.models {
                let r = default_residual_of(config, m.gpus);
                let e = residuals.entry(m.name.clone()).or_insert(r);
                if !e.measured {
                    *e = r;
                }
            }
        }
        let mut st = self.state.lock().unwrap();
        st.refusal = None;
        match planned {
            Planned::Placed(p) => {
                st.placements = p;
                st.placement_note = None;
            }
            Planned::NoInventory => {
                if config.models.iter().any(|m| m.gpus > 0) {
                    tracing::warn!(
                        "no GPU known (no NVML, no [[gpu]]): placement not checked; models run on their pinned or first GPUs"
                    );
                }
                st.placements = Vec::new();
                st.placement_note = Some(NO_INVENTORY.into());
            }
        }
    }

    /// Where each placed model runs.
    pub fn placed(&self) -> BTreeMap<String, Placed> {
        let st = self.state.lock().unwrap();
        st.placements
            .iter()
            .map(|p| (p.model.clone(), p.placed()))
            .collect()
    }

    /// The run-time policy: the base one with each model's residual.
    fn run_policy(&self) -> Policy {
        let mut p = self.policy.clone();
        p.residuals = self
            .residuals
            .lock()
            .unwrap()
            .iter()
            .map(|(m, r)| (m.clone(), r.bytes))
            .collect();
        p
    }

    /// What `model` holds per GPU while asleep, as placement counts it.
    pub fn residual_of(&self, model: &str) -> Residual {
        self.residuals
            .lock()
            .unwrap()
            .get(model)
            .copied()
            .unwrap_or(Residual {
                bytes: self.policy.residual_bytes,
                ..Residual::default()
            })
    }

    /// Measures what the engine whose process group is `pgid` holds on
    /// each GPU now (NVML per-process memory) and keeps the largest as the
    /// model's asleep residual. None where NVML is absent or shows none of
    /// the engine's processes. Blocking (NVML): call from `spawn_blocking`.
    pub fn measure_residual(&self, model: &str, pgid: u32) -> Option<Residual> {
        // Read NVML now, whatever the age of the last read; an older read
        // would show what the engine held awake.
        if !self.refresh_inventory_within(Duration::ZERO) {
            tracing::warn!(model, "asleep residual not measured: NVML does not answer");
            return None;
        }
        let (bytes, awake) = {
            let st = self.state.lock().unwrap();
            if st.inventory.source != InventorySource::Nvml {
                return None;
            }
            let awake = st
                .placements
                .iter()
                .find(|p| p.model == model)
                .and_then(|p| p.awake_bytes.iter().copied().max())
                .unwrap_or(0);
            (
                engine_bytes_per_gpu(&st.inventory, pgid, procfs::pgid),
                awake,
            )
        };
        let r = residual_from(bytes.values().copied().max().filter(|b| *b > 0)?, awake);
        self.residuals.lock().unwrap().insert(model.to_string(), r);
        if r.ineffective {
            tracing::warn!(model, bytes = r.bytes, awake, "{}", r.warning());
        } else {
            tracing::info!(model, bytes = r.bytes, "measured asleep residual per GPU");
        }
        Some(r)
    }

    /// The CUDA processes NVML lists within process group `pgid`, with the
    /// GPU memory each holds (summed over GPUs): what a suspend
    /// checkpoints. None without NVML, or when it does not answer. Blocking.
    pub fn engine_cuda_processes(&self, pgid: u32) -> Option<Vec<(u32, u64)>> {
        // Read NVML now, whatever the age of the last read.
        if !self.refresh_inventory_within(Duration::ZERO) {
            return None;
        }
        let st = self.state.lock().unwrap();
        if st.inventory.source != InventorySource::Nvml {
            return None;
        }
        let mut out: BTreeMap<u32, u64> = BTreeMap::new();
        for g in &st.inventory.gpus {
            for p in &g.processes {
                if p.pid == pgid || procfs::pgid(p.pid) == Some(pgid) {
                    *out.entry(p.pid).or_default() += p.used_bytes;
                }
            }
        }
        Some(out.into_iter().collect())
    }

    /// Replaces the inventory, as an NVML read would (tests: processes
    /// on the GPUs).
    #[cfg(test)]
    pub(crate) fn set_inventory(&self, inventory: Inventory) {
        let mut st = self.state.lock().unwrap();
        st.inventory = inventory;
        st.read_at = Instant::now();
        st.pids_here = true;
    }

    /// Makes the last read `by` older (tests).
    #[cfg(test)]
    pub(crate) fn age_reads(&self, by: Duration) {
        let mut st = self.state.lock().unwrap();
        st.read_at -= by;
    }

    /// Reads the GPUs from `gpus` from now on, as from NVML (tests).
    #[cfg(test)]
    pub(crate) fn script_nvml(&self, gpus: std::sync::Arc<Mutex<Vec<crate::gpu::GpuInfo>>>) {
        self.reader.script(gpus);
    }

    /// Every placement (empty when placement failed).
    #[cfg(test)]
    pub(crate) fn placements(&self) -> Vec<Placement> {
        self.state.lock().unwrap().placements.clone()
    }

    /// Whether models have no placement (refused, or no GPU known).
    #[cfg(test)]
    pub(crate) fn placement_failed(&self) -> bool {
        self.state.lock().unwrap().placement_note.is_some()
    }

    /// Where `model` runs now (None: not placed by this view, e.g. added by
    /// a reload). Read at every engine start, so a P2P verdict that changed
    /// since the last start applies.
    pub fn placed_one(&self, model: &str) -> Option<Placed> {
        let st = self.state.lock().unwrap();
        st.placements
            .iter()
            .find(|p| p.model == model)
            .map(Placement::placed)
    }

    /// Re-reads an NVML inventory older than [`INVENTORY_MAX_AGE`] (memory
    /// and processes move as engines sleep and wake).
    fn refresh_inventory(&self) {
        self.refresh_inventory_within(INVENTORY_MAX_AGE);
    }

    /// [`Self::refresh_inventory`] for a read at most `max_age` old. False
    /// when NVML did not answer within [`NVML_ANSWER_WAIT`] of the read's
    /// start: the inventory is then the last good one, marked so. Blocks up
    /// to that wait; on a multi-threaded runtime it tells tokio so.
    fn refresh_inventory_within(&self, max_age: Duration) -> bool {
        {
            let st = self.state.lock().unwrap();
            if st.read_at.elapsed() < max_age {
                return st.silent_for.is_none();
            }
        }
        let read = || self.reader.read(NVML_ANSWER_WAIT);
        let multi = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let fresh = if multi {
            tokio::task::block_in_place(read)
        } else {
            read()
        };
        let mut st = self.state.lock().unwrap();
        st.read_at = Instant::now();
        match fresh {
            reader::Read::Fresh(inv) if inv.gpus.is_empty() && !st.inventory.gpus.is_empty() => {
                // Keep the last good snapshot; say why it is old.
                st.inventory.note = inv.note;
                st.read_failed = true;
                st.silent_for = None;
            }
            reader::Read::Fresh(inv) => {
                if st.silent_for.take().is_some() {
                    tracing::info!("NVML answers again");
                }
                st.inventory = inv;
                st.read_failed = false;
            }
            reader::Read::Late(silent) => {
                if st.silent_for.is_none() {
                    tracing::error!(
                        silent_ms = silent.as_millis() as u64,
                        "NVML does not answer (a GPU off the bus, a driver in reset?): \
                         going on with the last good read; wakes and starts wait for a fresh one"
                    );
                }
                st.inventory.note = Some(silent_note(silent));
                st.read_failed = true;
                st.silent_for = Some(silent);
            }
            reader::Read::Listed => {}
        }
        st.silent_for.is_none()
    }

    /// How long NVML has not answered the read out now (None: it answers,
    /// or the GPUs are a fixed list).
    pub(crate) fn nvml_silent_for(&self) -> Option<Duration> {
        self.state.lock().unwrap().silent_for
    }

    pub fn list_gpus(&self, models: &[ModelStatus]) -> GpuList {
        self.refresh_inventory();
        let st = self.state.lock().unwrap();
        let inventory = st.inventory.clone();
        let p2p = st.p2p.results().cloned().collect();
        let p2p_probed_unix_ms = st.p2p_probed_unix_ms;
        // `/proc` is read without the lock (see `foreign`).
        drop(st);
        let marker = crate::supervisor::state_marker(&self.state_dir);
        let owners = foreign::owners(&inventory, models, &marker)
            .into_iter()
            .filter_map(|(pid, (_, m))| Some((pid, m?.to_owned())))
            .collect();
        GpuList {
            source: inventory.source,
            gpus: inventory.gpus,
            owners,
            p2p,
            p2p_probed_unix_ms,
            note: inventory.note,
        }
    }

    /// Whether `target` fits awake now (models without a placement or GPUs
    /// always do), given each model's run time as admission sees
    /// it; `yield_busy`: busy models whose turn is over may be victims;
    /// `foreign`: what processes siesta does not run hold ([`Self::foreign`]).
    pub(crate) fn plan_wake_in(
        &self,
        target: &str,
        runtime: &BTreeMap<String, ModelRuntime>,
        yield_busy: bool,
        foreign: &BTreeMap<u32, Foreign>,
    ) -> WakePlan {
        let st = self.state.lock().unwrap();
        if !st
            .placements
            .iter()
            .any(|p| p.model == target && !p.gpus.is_empty())
        {
            return WakePlan::Ready;
        }
        let mut machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        machine.foreign = foreign.clone();
        plan_wake(
            target,
            &machine,
            &st.placements,
            runtime,
            &self.run_policy(),
            yield_busy,
        )
    }

    /// Whether the inventory comes from NVML (it moves on its own).
    pub fn reads_nvml(&self) -> bool {
        self.state.lock().unwrap().inventory.source == InventorySource::Nvml
    }

    /// Every model's placement and every GPU's budget, memory held by
    /// processes siesta does not run included (NVML).
    pub fn placement(&self, models: &[ModelStatus]) -> PlacementReport {
        let foreign = self.foreign(models);
        self.report(models, foreign)
    }

    /// [`Self::placement`] for a few models' own placement (`GetModel`):
    /// no NVML read, the budgets count siesta's models only.
    pub fn placement_of(&self, models: &[ModelStatus]) -> PlacementReport {
        self.report(models, BTreeMap::new())
    }

    fn report(&self, models: &[ModelStatus], foreign: BTreeMap<u32, Foreign>) -> PlacementReport {
        let st = self.state.lock().unwrap();
        let mut machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        machine.foreign = foreign;
        let runtime = runtime(models);
        let mut placements: Vec<ModelPlacement> = st
            .placements
            .iter()
            .map(|p| ModelPlacement {
                model: p.model.clone(),
                gpus: p.gpus.clone(),
                awake_bytes_per_gpu: p.awake_bytes.iter().copied().max().unwrap_or(0),
                gpu_memory_utilization: p.gpu_memory_utilization,
                p2p_disabled: p.p2p_disabled,
                reason: p.reason.clone(),
                exclusive: p.exclusive,
                asleep_residual: self.residual_of(&p.model),
            })
            .collect();
        if let Some(note) = &st.placement_note {
            for m in models {
                placements.push(ModelPlacement {
                    model: m.name.clone(),
                    gpus: m.gpus.clone(),
                    reason: note.clone(),
                    ..Default::default()
                });
            }
        }
        PlacementReport {
            models: placements,
            gpus: budgets(&machine, &st.placements, &runtime, &self.run_policy()),
        }
    }
}

/// What the inventory's note says while NVML does not answer.
fn silent_note(silent: Duration) -> String {
    format!(
        "NVML has not answered for {:.1}s (a GPU off the bus, a driver in reset? \
         see nvidia-smi and the kernel log for Xid errors): the GPUs as last read; \
         wakes and starts wait for a fresh read",
        silent.as_secs_f64()
    )
}

/// A measured asleep residual against the model's awake share per GPU
/// (0: unknown): at least half of it still held means the engine does not
/// really sleep.
pub(crate) fn residual_from(bytes: u64, awake: u64) -> Residual {
    Residual {
        bytes,
        measured: true,
        ineffective: awake > 0 && bytes.saturating_mul(2) >= awake,
    }
}

/// Memory held on each GPU by the processes of process group `pgid`.
pub(crate) fn engine_bytes_per_gpu(
    inventory: &Inventory,
    pgid: u32,
    pgid_of: impl Fn(u32) -> Option<u32>,
) -> BTreeMap<u32, u64> {
    inventory
        .gpus
        .iter()
        .map(|g| {
            let sum = g
                .processes
                .iter()
                .filter(|p| p.pid == pgid || pgid_of(p.pid) == Some(pgid))
                .map(|p| p.used_bytes)
                .sum();
            (g.index, sum)
        })
        .collect()
}
