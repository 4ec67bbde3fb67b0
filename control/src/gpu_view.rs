//! The GPU side as the server publishes it: inventory (NVML or `[[gpu]]`),
//! P2P results and the placement of every model. Glue over `gpu` and
//! `placement`; it converts to `siesta.v1` messages for ListGpus,
//! GetPlacement, DiagP2p and the Watch stream.

use crate::config::{Config, GpuMemory, ModelConfig};
use crate::gpu::convert::{gpu_to_proto, p2p_to_proto};
use crate::gpu::p2p::{P2pMatrix, ProbeOptions, default_probe_bin, run_probe};
use crate::gpu::{GpuSource, GpuSpec, Inventory, InventorySource};
use crate::placement::{
    Machine, MemoryNeed, ModelNeeds, ModelRuntime, Placement, Policy, RunState, WakePlan, budgets,
    place, plan_wake,
};
use crate::runner::Placed;
use crate::status::{ModelStatus, State};
use siesta_proto::v1 as pb;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Debug)]
struct ViewState {
    inventory: Inventory,
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
    policy: Policy,
    needs: Vec<ModelNeeds>,
}

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

fn runtime(models: &[ModelStatus]) -> BTreeMap<String, ModelRuntime> {
    models
        .iter()
        .map(|m| {
            let mut r = ModelRuntime::new(run_state(m.state));
            r.in_flight = m.in_flight;
            r.last_activity_ms = m.last_activity_unix_ms;
            r.pinned_awake = m.pinned_until_unix_ms > 0;
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
    /// config's list) and places every model. Blocking (NVML).
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
        let policy = Policy::default();
        let needs: Vec<ModelNeeds> = config.models.iter().map(needs).collect();
        let view = GpuView {
            state: Mutex::new(ViewState {
                inventory,
                p2p: P2pMatrix::default(),
                p2p_probed_unix_ms: 0,
                placements: Vec::new(),
                placement_error: None,
            }),
            policy,
            needs,
        };
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
            .map(|p| {
                (
                    p.model.clone(),
                    Placed {
                        gpus: p.gpus.clone(),
                        p2p_disabled: p.p2p_disabled,
                        gpu_memory_utilization: p.gpu_memory_utilization,
                    },
                )
            })
            .collect()
    }

    pub fn list_gpus(&self, models: &[ModelStatus]) -> pb::ListGpusResponse {
        let st = self.state.lock().unwrap();
        let owners: BTreeMap<u32, String> = models
            .iter()
            .filter(|m| m.pid > 0)
            .map(|m| (m.pid, m.name.clone()))
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
            &runtime(models),
            &self.policy,
        )
    }

    pub fn placement(&self, models: &[ModelStatus]) -> pb::GetPlacementResponse {
        let st = self.state.lock().unwrap();
        let machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        let runtime = runtime(models);
        let mut placements: Vec<pb::ModelPlacement> =
            st.placements.iter().map(Placement::to_proto).collect();
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
            gpus: budgets(&machine, &st.placements, &runtime, &self.policy)
                .iter()
                .map(|b| b.to_proto())
                .collect(),
        }
    }

    /// Runs the P2P probe over every GPU and keeps its results.
    pub async fn diag_p2p(
        &self,
        bytes: u64,
        timeout: Duration,
        now_ms: i64,
    ) -> pb::DiagP2pResponse {
        let gpus: Vec<u32> = self
            .state
            .lock()
            .unwrap()
            .inventory
            .gpus
            .iter()
            .map(|g| g.index)
            .collect();
        if gpus.len() < 2 {
            return pb::DiagP2pResponse {
                message: format!("P2P needs at least two GPUs; this box has {}", gpus.len()),
                ..Default::default()
            };
        }
        let Some(bin) = default_probe_bin() else {
            return pb::DiagP2pResponse {
                message: "siesta-p2p-probe not found next to siesta-control".into(),
                ..Default::default()
            };
        };
        let mut opts = ProbeOptions::new(bin, gpus);
        if bytes > 0 {
            opts.bytes = bytes;
        }
        if !timeout.is_zero() {
            opts.deadline = timeout;
        }
        match run_probe(&opts).await {
            Ok(results) => {
                let out: Vec<pb::P2pResult> = results.iter().map(p2p_to_proto).collect();
                {
                    let mut st = self.state.lock().unwrap();
                    st.p2p = P2pMatrix::new(results);
                    st.p2p_probed_unix_ms = now_ms;
                }
                self.replace_placement();
                pb::DiagP2pResponse {
                    results: out,
                    probed_unix_ms: now_ms,
                    message: String::new(),
                }
            }
            Err(e) => pb::DiagP2pResponse {
                message: e.to_string(),
                ..Default::default()
            },
        }
    }
}
