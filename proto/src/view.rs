//! Serde views of the `siesta.v1` messages, for JSON: the CLI's `-o json`,
//! `siesta watch -o json` and the control plane's web listener (the prost
//! types do not derive serde). Enums become lower-case words; times stay
//! Unix epoch milliseconds and durations milliseconds, as in the proto, with
//! the same field names.

use crate::v1 as pb;
use serde::Serialize;

fn state_name(s: pb::ModelState) -> &'static str {
    s.label()
}

fn p2p_name(h: pb::P2pHealth) -> &'static str {
    match h {
        pb::P2pHealth::Unspecified => "unknown",
        pb::P2pHealth::Ok => "ok",
        pb::P2pHealth::Corrupt => "corrupt",
        pb::P2pHealth::Unsupported => "unsupported",
        pb::P2pHealth::Hung => "hung",
        pb::P2pHealth::Error => "error",
    }
}

#[derive(Debug, Serialize)]
pub struct ModelView {
    pub name: String,
    pub aliases: Vec<String>,
    pub model: String,
    pub launch: String,
    pub state: &'static str,
    pub sleep_level: u32,
    pub state_since_unix_ms: i64,
    pub deadline_unix_ms: i64,
    pub endpoints: Vec<EndpointView>,
    pub gpus: Vec<u32>,
    pub hold: Option<HoldView>,
    pub calibration: Option<CalibrationView>,
    pub last_activity_unix_ms: i64,
    pub in_flight: u32,
    pub held: u32,
    pub next_tier: Option<TierView>,
    pub next_tier_unix_ms: i64,
    pub intent: Option<IntentView>,
    pub pinned_until_unix_ms: i64,
    pub last_error: String,
    pub failures: u32,
    pub retry_at_unix_ms: i64,
    pub waiting_for: String,
    pub pid: u32,
    pub restarts: u32,
    pub p2p_disabled: bool,
    pub control_id: String,
    pub asleep_residual_bytes: u64,
    pub asleep_residual_measured: bool,
    pub warning: String,
    pub engine: String,
    pub capabilities: Option<CapabilitiesView>,
}

#[derive(Debug, Serialize)]
pub struct CapabilitiesView {
    pub sleep_levels: Vec<u32>,
    pub can_stop: bool,
    pub sleep_query: bool,
    pub activity_metric: String,
    pub health_path: String,
    pub can_suspend: bool,
}

impl From<&pb::EngineCapabilities> for CapabilitiesView {
    fn from(c: &pb::EngineCapabilities) -> Self {
        CapabilitiesView {
            sleep_levels: c.sleep_levels.clone(),
            can_stop: c.can_stop,
            sleep_query: c.sleep_query,
            activity_metric: c.activity_metric.clone(),
            health_path: c.health_path.clone(),
            can_suspend: c.can_suspend,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct EndpointView {
    pub url: String,
    pub served_model_name: String,
}

#[derive(Debug, Serialize)]
pub struct HoldView {
    pub max_queue: u32,
    pub max_hold_ms: u64,
}

#[derive(Debug, Serialize)]
pub struct CalibrationView {
    pub start_ms: u64,
    pub wake_l1_ms: u64,
    pub wake_l2_ms: u64,
    pub sleep_l1_ms: u64,
    pub sleep_l2_ms: u64,
    pub start_samples: u32,
    pub wake_l1_samples: u32,
    pub wake_l2_samples: u32,
    pub sleep_l1_samples: u32,
    pub sleep_l2_samples: u32,
    pub suspend_ms: u64,
    pub resume_ms: u64,
    pub suspend_samples: u32,
    pub resume_samples: u32,
}

#[derive(Debug, Serialize)]
pub struct TierView {
    pub after_ms: u64,
    pub action: &'static str,
    pub level: u32,
}

#[derive(Debug, Serialize)]
pub struct IntentView {
    pub desired: &'static str,
    pub level: u32,
    pub reason: &'static str,
    pub since_unix_ms: i64,
    pub until_unix_ms: i64,
}

impl From<&pb::ModelStatus> for ModelView {
    fn from(m: &pb::ModelStatus) -> Self {
        ModelView {
            name: m.name.clone(),
            aliases: m.aliases.clone(),
            model: m.model.clone(),
            launch: m.launch.clone(),
            state: state_name(m.state()),
            sleep_level: m.sleep_level,
            state_since_unix_ms: m.state_since_unix_ms,
            deadline_unix_ms: m.deadline_unix_ms,
            endpoints: m
                .endpoints
                .iter()
                .map(|e| EndpointView {
                    url: e.url.clone(),
                    served_model_name: e.served_model_name.clone(),
                })
                .collect(),
            gpus: m.gpus.clone(),
            hold: m.hold.as_ref().map(|h| HoldView {
                max_queue: h.max_queue,
                max_hold_ms: h.max_hold_ms,
            }),
            calibration: m.calibration.as_ref().map(|c| CalibrationView {
                start_ms: c.start_ms,
                wake_l1_ms: c.wake_l1_ms,
                wake_l2_ms: c.wake_l2_ms,
                sleep_l1_ms: c.sleep_l1_ms,
                sleep_l2_ms: c.sleep_l2_ms,
                start_samples: c.start_samples,
                wake_l1_samples: c.wake_l1_samples,
                wake_l2_samples: c.wake_l2_samples,
                sleep_l1_samples: c.sleep_l1_samples,
                sleep_l2_samples: c.sleep_l2_samples,
                suspend_ms: c.suspend_ms,
                resume_ms: c.resume_ms,
                suspend_samples: c.suspend_samples,
                resume_samples: c.resume_samples,
            }),
            last_activity_unix_ms: m.last_activity_unix_ms,
            in_flight: m.in_flight,
            held: m.held,
            next_tier: m.next_tier.as_ref().map(TierView::from),
            next_tier_unix_ms: m.next_tier_unix_ms,
            intent: m.intent.as_ref().map(IntentView::from),
            pinned_until_unix_ms: m.pinned_until_unix_ms,
            last_error: m.last_error.clone(),
            failures: m.failures,
            retry_at_unix_ms: m.retry_at_unix_ms,
            waiting_for: m.waiting_for.clone(),
            pid: m.pid,
            restarts: m.restarts,
            p2p_disabled: m.p2p_disabled,
            control_id: m.control_id.clone(),
            asleep_residual_bytes: m.asleep_residual_bytes,
            asleep_residual_measured: m.asleep_residual_measured,
            warning: m.warning.clone(),
            engine: m.engine.clone(),
            capabilities: m.capabilities.as_ref().map(CapabilitiesView::from),
        }
    }
}

impl From<&pb::IdleTier> for TierView {
    fn from(t: &pb::IdleTier) -> Self {
        let action = match t.action() {
            pb::IdleAction::Sleep => "sleep",
            pb::IdleAction::Stop => "stop",
            pb::IdleAction::Suspend => "suspend",
            pb::IdleAction::Unspecified => "unspecified",
        };
        TierView {
            after_ms: t.after_ms,
            action,
            level: t.level,
        }
    }
}

impl From<&pb::Intent> for IntentView {
    fn from(i: &pb::Intent) -> Self {
        let desired = match i.desired() {
            pb::DesiredState::Stopped => "stopped",
            pb::DesiredState::Awake => "awake",
            pb::DesiredState::Asleep => "asleep",
            pb::DesiredState::Suspended => "suspended",
            pb::DesiredState::Unspecified => "unspecified",
        };
        let reason = match i.reason() {
            pb::IntentReason::Config => "config",
            pb::IntentReason::Demand => "demand",
            pb::IntentReason::Operator => "operator",
            pb::IntentReason::Pin => "pin",
            pb::IntentReason::IdleTier => "idle_tier",
            pb::IntentReason::Eviction => "eviction",
            pb::IntentReason::Unspecified => "unspecified",
        };
        IntentView {
            desired,
            level: i.level,
            reason,
            since_unix_ms: i.since_unix_ms,
            until_unix_ms: i.until_unix_ms,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct GpusView {
    pub source: String,
    pub gpus: Vec<GpuView>,
    pub p2p: Vec<P2pView>,
    pub p2p_probed_unix_ms: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub note: String,
}

#[derive(Debug, Serialize)]
pub struct GpuView {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total_bytes: u64,
    pub memory_used_bytes: u64,
    pub pci_bus_id: String,
    pub iommu_mode: String,
    pub nvlinks_active: u32,
    pub processes: Vec<GpuProcessView>,
    pub links: Vec<GpuLinkView>,
}

#[derive(Debug, Serialize)]
pub struct GpuProcessView {
    pub pid: u32,
    pub used_bytes: u64,
    pub model: String,
}

#[derive(Debug, Serialize)]
pub struct GpuLinkView {
    pub peer: u32,
    pub kind: String,
    pub driver_p2p: String,
}

#[derive(Debug, Serialize)]
pub struct P2pView {
    pub src: u32,
    pub dst: u32,
    pub health: &'static str,
    pub elements: u64,
    pub corrupt_elements: u64,
    pub bandwidth_gbps: f64,
    pub driver_says: String,
    pub detail: String,
}

impl From<&pb::ListGpusResponse> for GpusView {
    fn from(r: &pb::ListGpusResponse) -> Self {
        GpusView {
            source: r.source.clone(),
            gpus: r.gpus.iter().map(GpuView::from).collect(),
            p2p: r.p2p.iter().map(P2pView::from).collect(),
            p2p_probed_unix_ms: r.p2p_probed_unix_ms,
            note: r.note.clone(),
        }
    }
}

impl From<&pb::Gpu> for GpuView {
    fn from(g: &pb::Gpu) -> Self {
        GpuView {
            index: g.index,
            uuid: g.uuid.clone(),
            name: g.name.clone(),
            memory_total_bytes: g.memory_total_bytes,
            memory_used_bytes: g.memory_used_bytes,
            pci_bus_id: g.pci_bus_id.clone(),
            iommu_mode: g.iommu_mode.clone(),
            nvlinks_active: g.nvlinks_active,
            processes: g
                .processes
                .iter()
                .map(|p| GpuProcessView {
                    pid: p.pid,
                    used_bytes: p.used_bytes,
                    model: p.model.clone(),
                })
                .collect(),
            links: g
                .links
                .iter()
                .map(|l| GpuLinkView {
                    peer: l.peer,
                    kind: l.kind.clone(),
                    driver_p2p: l.driver_p2p.clone(),
                })
                .collect(),
        }
    }
}

impl From<&pb::P2pResult> for P2pView {
    fn from(p: &pb::P2pResult) -> Self {
        P2pView {
            src: p.src,
            dst: p.dst,
            health: p2p_name(p.health()),
            elements: p.elements,
            corrupt_elements: p.corrupt_elements,
            bandwidth_gbps: p.bandwidth_gbps,
            driver_says: p.driver_says.clone(),
            detail: p.detail.clone(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct PlacementView {
    pub models: Vec<ModelPlacementView>,
    pub gpus: Vec<GpuBudgetView>,
}

#[derive(Debug, Serialize)]
pub struct ModelPlacementView {
    pub model: String,
    pub gpus: Vec<u32>,
    pub awake_bytes_per_gpu: u64,
    pub gpu_memory_utilization: f64,
    pub p2p_disabled: bool,
    pub reason: String,
    pub exclusive: bool,
    pub asleep_residual_bytes: u64,
    pub asleep_residual_measured: bool,
}

#[derive(Debug, Serialize)]
pub struct GpuBudgetView {
    pub index: u32,
    pub total_bytes: u64,
    pub awake_bytes: u64,
    pub asleep_bytes: u64,
    /// Held by processes siesta does not run.
    pub foreign_bytes: u64,
    pub free_bytes: u64,
    pub models: Vec<String>,
}

impl From<&pb::GetPlacementResponse> for PlacementView {
    fn from(r: &pb::GetPlacementResponse) -> Self {
        PlacementView {
            models: r.models.iter().map(ModelPlacementView::from).collect(),
            gpus: r
                .gpus
                .iter()
                .map(|g| GpuBudgetView {
                    index: g.index,
                    total_bytes: g.total_bytes,
                    awake_bytes: g.awake_bytes,
                    asleep_bytes: g.asleep_bytes,
                    foreign_bytes: g.foreign_bytes,
                    free_bytes: g.free_bytes,
                    models: g.models.clone(),
                })
                .collect(),
        }
    }
}

impl From<&pb::ModelPlacement> for ModelPlacementView {
    fn from(p: &pb::ModelPlacement) -> Self {
        ModelPlacementView {
            model: p.model.clone(),
            gpus: p.gpus.clone(),
            awake_bytes_per_gpu: p.awake_bytes_per_gpu,
            gpu_memory_utilization: p.gpu_memory_utilization,
            p2p_disabled: p.p2p_disabled,
            reason: p.reason.clone(),
            exclusive: p.exclusive,
            asleep_residual_bytes: p.asleep_residual_bytes,
            asleep_residual_measured: p.asleep_residual_measured,
        }
    }
}

/// One Watch event, exactly as `siesta watch -o json` prints it: `type`
/// says which payload field is set (`snapshot` sets `models`, `resync` and
/// the `gpus` and `placement` it has).
#[derive(Debug, Serialize)]
pub struct EventView {
    pub revision: u64,
    pub at_unix_ms: i64,
    pub control_id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<ModelView>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resync: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_removed: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpus: Option<GpusView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementView>,
}

impl From<&pb::WatchEvent> for EventView {
    fn from(ev: &pb::WatchEvent) -> Self {
        use pb::watch_event::Kind;
        let mut v = EventView {
            revision: ev.revision,
            at_unix_ms: ev.at_unix_ms,
            control_id: ev.control_id.clone(),
            kind: "unknown",
            models: None,
            resync: None,
            model: None,
            model_removed: None,
            gpus: None,
            placement: None,
        };
        match &ev.kind {
            Some(Kind::Snapshot(s)) => {
                v.kind = "snapshot";
                v.models = Some(s.models.iter().map(ModelView::from).collect());
                v.resync = Some(s.resync);
                v.gpus = s.gpus.as_ref().map(GpusView::from);
                v.placement = s.placement.as_ref().map(PlacementView::from);
            }
            Some(Kind::Model(m)) => {
                v.kind = "model";
                v.model = Some(ModelView::from(m));
            }
            Some(Kind::ModelRemoved(name)) => {
                v.kind = "model_removed";
                v.model_removed = Some(name.clone());
            }
            Some(Kind::Gpus(g)) => {
                v.kind = "gpus";
                v.gpus = Some(GpusView::from(g));
            }
            Some(Kind::Placement(p)) => {
                v.kind = "placement";
                v.placement = Some(PlacementView::from(p));
            }
            Some(Kind::Heartbeat(_)) => v.kind = "heartbeat",
            None => {}
        }
        v
    }
}

/// `OperationResponse`.
#[derive(Debug, Serialize)]
pub struct OperationView {
    pub model: Option<ModelView>,
    pub message: String,
    /// Applied, but not durable yet (empty: nothing to warn of).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub warning: String,
}

impl From<&pb::OperationResponse> for OperationView {
    fn from(r: &pb::OperationResponse) -> Self {
        OperationView {
            model: r.model.as_ref().map(ModelView::from),
            message: r.message.clone(),
            warning: r.warning.clone(),
        }
    }
}
