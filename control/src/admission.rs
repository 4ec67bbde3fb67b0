//! The gate before a model takes its GPUs awake (start or wake): placement
//! says whether it fits; if not, idle unpinned models sharing its GPUs are
//! put to sleep first (least recently used first), or it waits.

use crate::gpu_view::GpuView;
use crate::models::Models;
use crate::placement::WakePlan;
use crate::reconciler::Event;
use crate::status::State;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

const RECHECK: Duration = Duration::from_millis(250);
/// How long to wait for evicted models to be asleep before planning again.
const EVICTION_WAIT: Duration = Duration::from_secs(120);

/// Shared by every model task.
#[derive(Debug)]
pub struct Admission {
    gpus: Option<Arc<GpuView>>,
    models: OnceLock<Weak<Models>>,
}

impl Admission {
    pub fn new(gpus: Option<Arc<GpuView>>) -> Self {
        Self {
            gpus,
            models: OnceLock::new(),
        }
    }

    /// Lets everything through (tests, no GPUs).
    pub fn open() -> Self {
        Self::new(None)
    }

    pub fn set_models(&self, models: Weak<Models>) {
        let _ = self.models.set(models);
    }

    /// Whether `model`, running on `gpus`, must start with NCCL P2P off, as
    /// placement decides now (a P2P probe may have changed it since the last
    /// start). None: placement does not know the model on these GPUs (e.g.
    /// it was changed by a reload): keep what it has.
    pub fn p2p_disabled(&self, model: &str, gpus: &[u32]) -> Option<bool> {
        self.gpus
            .as_ref()?
            .placed_one(model)
            .filter(|p| p.gpus == gpus)
            .map(|p| p.p2p_disabled)
    }

    /// Returns once `model` fits on its GPUs, evicting idle models as
    /// needed. `waiting` is told what it waits for (None once it fits).
    /// The caller's deadline bounds the wait (drop the future to stop).
    pub async fn wait_for_room(&self, model: &str, waiting: impl Fn(Option<String>)) {
        let Some(gpus) = &self.gpus else {
            return;
        };
        loop {
            let Some(models) = self.models.get().and_then(Weak::upgrade) else {
                return;
            };
            match gpus.plan_wake(model, &models.list()) {
                WakePlan::Ready => {
                    waiting(None);
                    return;
                }
                WakePlan::Evict(victims) => {
                    tracing::info!(model, ?victims, "evicting idle models to make room");
                    waiting(Some(format!(
                        "room on its GPUs: putting {} to sleep",
                        victims.join(", ")
                    )));
                    let mut pending = Vec::new();
                    for v in &victims {
                        if let Ok(h) = models.resolve(v) {
                            h.notify(Event::Evict);
                            pending.push(h.status.clone());
                        }
                    }
                    drop(models);
                    for mut rx in pending {
                        let gone = |s: &crate::status::ModelStatus| {
                            !matches!(s.state, State::Awake | State::Sleeping)
                        };
                        let _ = tokio::time::timeout(EVICTION_WAIT, rx.wait_for(gone)).await;
                    }
                }
                WakePlan::Wait(reason) => {
                    drop(models);
                    waiting(Some(reason));
                    tokio::time::sleep(RECHECK).await;
                }
            }
        }
    }
}
