//! `GET /metrics`: the control plane's Prometheus metrics. Gauges are read
//! at scrape time from the hub and the GPU inventory (NVML per process);
//! counters and histograms come from the [`Tracker`].

use super::track::Tracker;
use crate::api::convert::model_status;
use crate::gpu_view::GpuView;
use crate::hub::Hub;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use siesta_proto::v1 as pb;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    model: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CalLabels {
    model: String,
    from: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EngineLabels {
    model: String,
    gpu: String,
}

/// Every state a model can be in, so each gets a 0/1 series (a state left
/// out here exports 0 everywhere while a model is in it; the test below
/// checks this list against every `ModelState`).
const STATES: [pb::ModelState; 10] = [
    pb::ModelState::Stopped,
    pb::ModelState::Starting,
    pb::ModelState::Awake,
    pb::ModelState::Sleeping,
    pb::ModelState::Asleep,
    pb::ModelState::Waking,
    pb::ModelState::Stopping,
    pb::ModelState::Failed,
    pb::ModelState::Suspending,
    pb::ModelState::Suspended,
];

type G = Gauge<i64>;

/// One 0/1 `model_state` series per state for `model`: 1 for `now`.
fn set_states(family: &Family<StateLabels, G>, model: &str, now: pb::ModelState) {
    for st in STATES {
        family
            .get_or_create(&StateLabels {
                model: model.to_string(),
                state: st.label(),
            })
            .set(i64::from(st == now));
    }
}
type GBytes = Gauge<u64, AtomicU64>;

/// The text exposition of every control-plane metric.
pub fn encode(
    hub: &Hub,
    gpus: &GpuView,
    tracker: &Tracker,
    admission: &crate::admission::AdmissionMetrics,
) -> String {
    let (models, _) = hub.models();
    let list = gpus.list_gpus(&models);
    let budgets = gpus.placement(&models).gpus;
    let models: Vec<pb::ModelStatus> = models.iter().map(model_status).collect();
    let mut reg = Registry::with_prefix("siesta_control");
    let state = Family::<StateLabels, G>::default();
    reg.register(
        "model_state",
        "1 for the state each model is in now, 0 for the others",
        state.clone(),
    );
    let level = Family::<ModelLabels, G>::default();
    reg.register(
        "model_sleep_level",
        "Sleep level of each model: asleep or sleeping at it, or waking from it (0 otherwise)",
        level.clone(),
    );
    let in_flight = Family::<ModelLabels, G>::default();
    reg.register(
        "model_in_flight",
        "Requests in flight per model, as the proxies report them",
        in_flight.clone(),
    );
    let failures = Family::<ModelLabels, G>::default();
    reg.register(
        "model_failures",
        "Consecutive failures of each model",
        failures.clone(),
    );
    let calibrated = Family::<CalLabels, GBytes>::default();
    reg.register_with_unit(
        "calibrated_wake",
        "Calibrated wake (from l1, l2) and start (from stopped) time per model",
        Unit::Other("milliseconds".into()),
        calibrated.clone(),
    );
    for m in &models {
        set_states(&state, &m.name, m.state());
        let ml = ModelLabels {
            model: m.name.clone(),
        };
        level.get_or_create(&ml).set(i64::from(m.sleep_level));
        in_flight.get_or_create(&ml).set(i64::from(m.in_flight));
        failures.get_or_create(&ml).set(i64::from(m.failures));
        let cal = m.calibration.unwrap_or_default();
        for (from, ms) in [
            ("l1", cal.wake_l1_ms),
            ("l2", cal.wake_l2_ms),
            ("stopped", cal.start_ms),
        ] {
            calibrated
                .get_or_create(&CalLabels {
                    model: m.name.clone(),
                    from,
                })
                .set(ms);
        }
    }
    let total = Family::<GpuLabels, GBytes>::default();
    reg.register_with_unit(
        "gpu_memory_total",
        "Memory of each GPU",
        Unit::Bytes,
        total.clone(),
    );
    let used = Family::<GpuLabels, GBytes>::default();
    reg.register_with_unit(
        "gpu_memory_used",
        "Memory used on each GPU (all processes)",
        Unit::Bytes,
        used.clone(),
    );
    let others = Family::<GpuLabels, GBytes>::default();
    reg.register_with_unit(
        "gpu_memory_others",
        "GPU memory held by processes siesta does not run, as admission counts it (NVML; 0 without it)",
        Unit::Bytes,
        others.clone(),
    );
    for b in &budgets {
        others
            .get_or_create(&GpuLabels {
                gpu: b.index.to_string(),
            })
            .set(b.foreign_bytes);
    }
    let engine = Family::<EngineLabels, GBytes>::default();
    reg.register_with_unit(
        "engine_gpu_memory",
        "GPU memory held by each model's engine (NVML per process; 0 on its GPUs while it holds none)",
        Unit::Bytes,
        engine.clone(),
    );
    // A placed model has a series per GPU even while its engine holds none.
    for m in &models {
        for g in &m.gpus {
            engine
                .get_or_create(&EngineLabels {
                    model: m.name.clone(),
                    gpu: g.to_string(),
                })
                .set(0);
        }
    }
    for g in &list.gpus {
        let gl = GpuLabels {
            gpu: g.index.to_string(),
        };
        total.get_or_create(&gl).set(g.memory_total_bytes);
        used.get_or_create(&gl).set(g.memory_used_bytes);
        for p in &g.processes {
            let Some(model) = list.owners.get(&p.pid) else {
                continue;
            };
            let e = engine.get_or_create(&EngineLabels {
                model: model.clone(),
                gpu: g.index.to_string(),
            });
            e.set(e.get() + p.used_bytes);
        }
    }
    let mut out = String::with_capacity(8192);
    let _ = prometheus_client::encoding::text::encode_registry(&mut out, &reg);
    tracker.encode(&mut out);
    admission.encode(&mut out);
    let _ = prometheus_client::encoding::text::encode_eof(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{State, test_status};

    /// A suspended model's status, as the hub holds it, in the exposition.
    #[test]
    fn a_suspended_model_exports_its_state() {
        let mut s = test_status("m", 0);
        s.state = State::Suspended;
        let family = Family::<StateLabels, G>::default();
        let mut reg = Registry::with_prefix("siesta_control");
        reg.register("model_state", "state", family.clone());
        set_states(&family, "m", model_status(&s).state());
        let mut out = String::new();
        prometheus_client::encoding::text::encode_registry(&mut out, &reg).unwrap();
        assert!(
            out.contains("siesta_control_model_state{model=\"m\",state=\"suspended\"} 1"),
            "{out}"
        );
        assert!(
            out.contains("siesta_control_model_state{model=\"m\",state=\"suspending\"} 0"),
            "{out}"
        );
        assert!(out.contains("state=\"stopped\"} 0"), "{out}");
    }

    /// Memory another process holds on a GPU (NVML) is exported per GPU,
    /// as admission counts it; a GPU with none exports 0.
    #[test]
    fn memory_others_hold_is_exported_per_gpu() {
        use crate::gpu::{GpuInfo, GpuProcessInfo, GpuSpec, Inventory, InventorySource};
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "[control]\nstate_dir = \"{}\"\np2p_probe = \"off\"\n\
             [[gpu]]\nindex = 0\nmemory = \"80GiB\"\n[[gpu]]\nindex = 1\nmemory = \"80GiB\"\n\
             [[model]]\nname = \"a\"\nmodel = \"m\"\ngpu_memory = 0.5\n",
            dir.path().display()
        );
        let cfg = crate::config::Config::parse(&text, "test.toml").unwrap();
        let gpus = GpuView::detect(&cfg, &Default::default());
        let gpu = |index: u32, held: u64| {
            let mut g = GpuInfo::from_spec(&GpuSpec {
                index,
                name: "g".into(),
                memory_bytes: 80 << 30,
            });
            if held > 0 {
                // This test's own process: none of siesta's engines.
                g.processes = vec![GpuProcessInfo {
                    pid: std::process::id(),
                    used_bytes: held,
                }];
            }
            g
        };
        gpus.set_inventory(Inventory {
            source: InventorySource::Nvml,
            gpus: vec![gpu(0, 0), gpu(1, 21 << 30)],
            note: None,
        });
        let hub = crate::hub::Hub::new(crate::status::Clock::new(), 16, 16);
        let out = encode(
            &hub,
            &gpus,
            &crate::web::track::Tracker::new(),
            &Default::default(),
        );
        assert!(
            out.contains("siesta_control_gpu_memory_others_bytes{gpu=\"1\"} 22548578304"),
            "{out}"
        );
        assert!(
            out.contains("siesta_control_gpu_memory_others_bytes{gpu=\"0\"} 0"),
            "{out}"
        );
    }

    /// Every state but `unknown` has a series, so none exports all zeros.
    #[test]
    fn every_state_has_a_series() {
        let all: Vec<pb::ModelState> = (0..64)
            .filter_map(|i| pb::ModelState::try_from(i).ok())
            .filter(|s| *s != pb::ModelState::Unspecified)
            .collect();
        assert_eq!(all.len(), STATES.len(), "{all:?}");
        for s in all {
            assert!(STATES.contains(&s), "{s:?} has no model_state series");
        }
    }
}
