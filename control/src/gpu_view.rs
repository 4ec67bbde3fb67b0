//! The GPU side as the server publishes it: inventory (NVML or `[[gpu]]`),
//! P2P results and the placement of every model. Glue over `gpu` and
//! `placement`; it converts to `siesta.v1` messages for ListGpus,
//! GetPlacement, DiagP2p and the Watch stream.

use crate::config::{Config, GpuMemory, ModelConfig, P2pProbeConfig};
use crate::gpu::convert::{gpu_to_proto, p2p_to_proto};
use crate::gpu::p2p::P2pMatrix;
use crate::gpu::{GpuSource, GpuSpec, Inventory, InventorySource};
use crate::placement::default_residual;
use crate::placement::{
    Machine, MemoryNeed, ModelNeeds, ModelRuntime, Placement, Policy, RunState, WakePlan, budgets,
    place, plan_wake,
};
use crate::runner::Placed;
use crate::status::Residual;
use crate::status::{ModelStatus, State};
use siesta_proto::v1 as pb;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod p2p;
#[cfg(test)]
mod tests;

#[derive(Debug)]
struct ViewState {
    inventory: Inventory,
    /// When `inventory` was read (NVML inventories are re-read when stale).
    read_at: Instant,
    p2p: P2pMatrix,
    p2p_probed_unix_ms: i64,
    placements: Vec<Placement>,
    /// Why placement failed (models then run on their pinned or first GPUs).
    placement_error: Option<String>,
}

/// Inventory, P2P and placement.
#[derive(Debug)]
pub struct GpuView {
    state: Mutex<ViewState>,
    source: Mutex<GpuSource>,
    policy: Policy,
    /// What each model holds per GPU while asleep: its default until an
    /// NVML measurement after a sleep replaces it.
    residuals: Mutex<BTreeMap<String, Residual>>,
    needs: Vec<ModelNeeds>,
    /// Where `p2p.json` lives.
    state_dir: PathBuf,
    probe: P2pProbeConfig,
    /// One probe at a time.
    probing: tokio::sync::Mutex<()>,
}

/// How old an NVML inventory may get before `ListGpus` reads it again.
const INVENTORY_MAX_AGE: Duration = Duration::from_secs(1);

fn needs(m: &ModelConfig) -> ModelNeeds {
    ModelNeeds {
        name: m.name.clone(),
        gpus: m.gpus,
        memory: match m.gpu_memory {
            Some(GpuMemory::Fraction(f)) => MemoryNeed::Fraction(f),
            Some(GpuMemory::Bytes(b)) => MemoryNeed::Bytes(b),
            // vLLM's own default --gpu-memory-utilization.
            None => MemoryNeed::Fraction(0.9),
        },
        pinned_gpus: m.gpu_ids.clone(),
        exclusive: m.exclusive,
    }
}

fn run_state(s: State) -> RunState {
    match s {
        State::Stopped => RunState::Stopped,
        State::Starting => RunState::Starting,
        State::Awake => RunState::Awake,
        State::Sleeping => RunState::Sleeping,
        State::Asleep => RunState::Asleep,
        State::Waking => RunState::Waking,
        State::Stopping => RunState::Stopping,
        State::Failed => RunState::Failed,
    }
}

/// What placement needs to know of each model's run time.
pub(crate) fn runtime(models: &[ModelStatus]) -> BTreeMap<String, ModelRuntime> {
    models
        .iter()
        .map(|m| {
            let mut r = ModelRuntime::new(run_state(m.state));
            r.in_flight = m.in_flight;
            r.last_activity_ms = m.last_activity_unix_ms.unwrap_or(0);
            r.pinned_awake = m.pin.is_pinned();
            (m.name.clone(), r)
        })
        .collect()
}

/// The process group of a pid (from /proc), to tell whose a GPU process is.
fn pgid_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(2)?.parse().ok()
}

impl GpuView {
    /// Reads the inventory (NVML when any model needs a GPU, else only the
    /// config's list), loads the saved P2P results, runs the P2P probe when
    /// `[control] p2p_probe = "start"`, and places every model.
    ///
    /// Blocking (NVML, and the probe up to its deadline): call it from
    /// `spawn_blocking` or outside any runtime, never from async code.
    pub fn detect(config: &Config) -> GpuView {
        let specs: Vec<GpuSpec> = config
            .gpus
            .iter()
            .map(|g| GpuSpec {
                index: g.index,
                name: g.name.clone(),
                memory_bytes: g.memory_bytes,
            })
            .collect();
        let source = if config.models.iter().any(|m| m.gpus > 0) {
            GpuSource::detect(&specs)
        } else {
            GpuSource::from_config(&specs)
        };
        let inventory = source.snapshot();
        let view = GpuView {
            state: Mutex::new(ViewState {
                inventory,
                read_at: Instant::now(),
                p2p: P2pMatrix::default(),
                p2p_probed_unix_ms: 0,
                placements: Vec::new(),
                placement_error: None,
            }),
            source: Mutex::new(source),
            policy: Policy {
                residual_bytes: config
                    .control
                    .asleep_residual
                    .unwrap_or(crate::placement::DEFAULT_RESIDUAL_BYTES),
                ..Policy::default()
            },
            residuals: Mutex::new(
                config
                    .models
                    .iter()
                    .map(|m| {
                        let bytes = config
                            .control
                            .asleep_residual
                            .unwrap_or_else(|| default_residual(m.gpus));
                        let r = Residual {
                            bytes,
                            measured: false,
                        };
                        (m.name.clone(), r)
                    })
                    .collect(),
            ),
            needs: config.models.iter().map(needs).collect(),
            state_dir: config.control.state_dir.clone(),
            probe: config.control.p2p_probe,
            probing: tokio::sync::Mutex::new(()),
        };
        view.load_p2p();
        if view.probe.at_start {
            view.probe_at_start();
        }
        view.replace_placement();
        view
    }

    fn replace_placement(&self) {
        let mut st = self.state.lock().unwrap();
        let machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        match place(&machine, &self.needs, &self.policy) {
            Ok(p) => {
                st.placements = p;
                st.placement_error = None;
            }
            Err(e) => {
                tracing::error!(error = %e, "placement failed; models run on their pinned or first GPUs");
                st.placements = Vec::new();
                st.placement_error = Some(e.to_string());
            }
        }
    }

    /// Where each placed model runs.
    pub fn placed(&self) -> BTreeMap<String, Placed> {
        let st = self.state.lock().unwrap();
        st.placements
            .iter()
            .map(|p| (p.model.clone(), placed_of(p)))
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
                measured: false,
            })
    }

    /// Measures what the engine whose process group is `pgid` holds on
    /// each GPU now (NVML per-process memory) and keeps the largest as the
    /// model's asleep residual. None where NVML is absent or shows none of
    /// the engine's processes. Blocking (NVML): call from `spawn_blocking`.
    pub fn measure_residual(&self, model: &str, pgid: u32) -> Option<Residual> {
        {
            let mut st = self.state.lock().unwrap();
            // Read NVML now, whatever the age of the last read.
            st.read_at = Instant::now() - INVENTORY_MAX_AGE;
        }
        self.refresh_inventory();
        let bytes = {
            let st = self.state.lock().unwrap();
            if st.inventory.source != InventorySource::Nvml {
                return None;
            }
            engine_bytes_per_gpu(&st.inventory, pgid, pgid_of)
        };
        let r = Residual {
            bytes: bytes.values().copied().max().filter(|b| *b > 0)?,
            measured: true,
        };
        self.residuals.lock().unwrap().insert(model.to_string(), r);
        tracing::info!(model, bytes = r.bytes, "measured asleep residual per GPU");
        Some(r)
    }

    /// Every placement (empty when placement failed).
    #[cfg(test)]
    pub(crate) fn placements(&self) -> Vec<Placement> {
        self.state.lock().unwrap().placements.clone()
    }

    /// Whether placement failed for this config.
    #[cfg(test)]
    pub(crate) fn placement_failed(&self) -> bool {
        self.state.lock().unwrap().placement_error.is_some()
    }

    /// Where `model` runs now (None: not placed by this view, e.g. added by
    /// a reload). Read at every engine start, so a P2P verdict that changed
    /// since the last start applies.
    pub fn placed_one(&self, model: &str) -> Option<Placed> {
        let st = self.state.lock().unwrap();
        st.placements
            .iter()
            .find(|p| p.model == model)
            .map(placed_of)
    }

    /// Re-reads an NVML inventory older than [`INVENTORY_MAX_AGE`] (memory
    /// and processes move as engines sleep and wake). Blocks for NVML's
    /// milliseconds; on a multi-threaded runtime it tells tokio so.
    fn refresh_inventory(&self) {
        {
            let st = self.state.lock().unwrap();
            if st.read_at.elapsed() < INVENTORY_MAX_AGE {
                return;
            }
        }
        let read = || {
            let source = self.source.lock().unwrap();
            matches!(*source, GpuSource::Nvml(_)).then(|| source.snapshot())
        };
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
            Some(inv) if inv.gpus.is_empty() && !st.inventory.gpus.is_empty() => {
                // Keep the last good snapshot; say why it is old.
                st.inventory.note = inv.note;
            }
            Some(inv) => st.inventory = inv,
            None => {}
        }
    }

    pub fn list_gpus(&self, models: &[ModelStatus]) -> pb::ListGpusResponse {
        self.refresh_inventory();
        let st = self.state.lock().unwrap();
        let owners: BTreeMap<u32, String> = models
            .iter()
            .filter_map(|m| Some((m.pid?, m.name.clone())))
            .collect();
        let model_of = |pid: u32| {
            owners
                .get(&pid)
                .or_else(|| pgid_of(pid).and_then(|g| owners.get(&g)))
                .cloned()
        };
        pb::ListGpusResponse {
            gpus: st
                .inventory
                .gpus
                .iter()
                .map(|g| gpu_to_proto(g, model_of))
                .collect(),
            source: match st.inventory.source {
                InventorySource::Nvml => "nvml",
                InventorySource::Config => "config",
                InventorySource::None => "none",
            }
            .into(),
            p2p: st.p2p.results().map(p2p_to_proto).collect(),
            p2p_probed_unix_ms: st.p2p_probed_unix_ms,
        }
    }

    /// Whether `target` fits awake now (models without a placement or GPUs
    /// always do).
    pub fn plan_wake(&self, target: &str, models: &[ModelStatus]) -> WakePlan {
        self.plan_wake_in(target, &runtime(models))
    }

    /// [`Self::plan_wake`] given each model's run time as admission sees it.
    pub(crate) fn plan_wake_in(
        &self,
        target: &str,
        runtime: &BTreeMap<String, ModelRuntime>,
    ) -> WakePlan {
        let st = self.state.lock().unwrap();
        if !st
            .placements
            .iter()
            .any(|p| p.model == target && !p.gpus.is_empty())
        {
            return WakePlan::Ready;
        }
        let machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        plan_wake(
            target,
            &machine,
            &st.placements,
            runtime,
            &self.run_policy(),
        )
    }

    pub fn placement(&self, models: &[ModelStatus]) -> pb::GetPlacementResponse {
        let st = self.state.lock().unwrap();
        let machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        let runtime = runtime(models);
        let mut placements: Vec<pb::ModelPlacement> = st
            .placements
            .iter()
            .map(|p| {
                let r = self.residual_of(&p.model);
                pb::ModelPlacement {
                    asleep_residual_bytes: r.bytes,
                    asleep_residual_measured: r.measured,
                    ..p.to_proto()
                }
            })
            .collect();
        if let Some(err) = &st.placement_error {
            for m in models {
                placements.push(pb::ModelPlacement {
                    model: m.name.clone(),
                    gpus: m.gpus.clone(),
                    reason: format!("placement failed ({err}); pinned or first GPUs used"),
                    ..Default::default()
                });
            }
        }
        pb::GetPlacementResponse {
            models: placements,
            gpus: budgets(&machine, &st.placements, &runtime, &self.run_policy())
                .iter()
                .map(|b| b.to_proto())
                .collect(),
        }
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

fn placed_of(p: &Placement) -> Placed {
    Placed {
        gpus: p.gpus.clone(),
        p2p_disabled: p.p2p_disabled,
        gpu_memory_utilization: p.gpu_memory_utilization,
    }
}
