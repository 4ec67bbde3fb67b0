//! The set of model tasks and the operations on them by name or alias: what
//! the gRPC layer calls. Answers in domain types; refusals are [`OpError`].

use crate::OpError;
use crate::config::{Config, ModelConfig};
use crate::fence::FenceReport;
use crate::placement::{Placed, default_placement};
use crate::reconciler::Event;
use crate::recovery::Adopted;
use crate::runner::{ModelHandle, Shared, spawn_model_adopting};
use crate::status::ModelStatus;
use crate::supervisor::LogRing;
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use tokio_util::sync::CancellationToken;

/// A proxy's activity for one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activity {
    pub model: String,
    pub started: u32,
    pub finished: u32,
    pub in_flight: u32,
    pub held: u32,
    pub last_finished_unix_ms: i64,
    /// See `ModelActivity.fenced_since_unix_ms`.
    pub fenced_since_unix_ms: i64,
}

#[derive(Debug, Default)]
struct Registry {
    models: BTreeMap<String, Arc<ModelHandle>>,
    /// Each model's configuration now (a reload may replace the settings
    /// that need no new engine).
    configs: BTreeMap<String, Arc<ModelConfig>>,
    /// Name or alias → name.
    names: BTreeMap<String, String>,
}

/// Every model of this control plane.
#[derive(Debug)]
pub struct Models {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    registry: RwLock<Registry>,
    /// The configuration the daemon started with: its `[control]` and
    /// `[[gpu]]` settings stay in force until a restart.
    started_with: Config,
}

impl Models {
    /// Starts a task per model, taking over the engines in `adopted`
    /// (found running by [`crate::recovery::recover`]).
    pub fn start(
        config: &Config,
        placements: &BTreeMap<String, Placed>,
        mut adopted: BTreeMap<String, Adopted>,
        shared: Arc<Shared>,
        cancel: CancellationToken,
    ) -> std::io::Result<Models> {
        let models = Models {
            shared,
            cancel,
            registry: RwLock::new(Registry::default()),
            started_with: config.clone(),
        };
        models.shared.ports.configure(&config.models);
        for m in &config.models {
            let found = adopted.remove(&m.name);
            models.add(m.clone(), placements.get(&m.name).cloned(), found, false)?;
        }
        models.shared.stop_bound.set(&config.models);
        // Every model's first state (adopted engines as found) is in the
        // hub: admission may plan over it now, not before.
        models.shared.admission.start_planning();
        Ok(models)
    }

    /// `carried_over`: the new engine of a changed model (see
    /// [`Models::remove`]).
    fn add(
        &self,
        cfg: ModelConfig,
        placed: Option<Placed>,
        adopted: Option<Adopted>,
        carried_over: bool,
    ) -> std::io::Result<()> {
        let placed = placed.unwrap_or_else(|| default_placement(&cfg));
        let handle = spawn_model_adopting(
            cfg.clone(),
            placed,
            adopted,
            carried_over,
            self.shared.clone(),
            self.cancel.child_token(),
        )?;
        let handle = Arc::new(handle);
        let weak = Arc::downgrade(&handle);
        self.shared.admission.metrics().known(&cfg.name);
        self.shared.admission.registry().insert(
            &cfg.name,
            Arc::new(move |how| {
                if let Some(h) = weak.upgrade() {
                    h.notify(how);
                }
            }),
        );
        let mut reg = self.registry.write().unwrap();
        // A changed model's old names go with its old task.
        reg.names.retain(|_, n| n != &cfg.name);
        for alias in &cfg.aliases {
            reg.names.insert(alias.clone(), cfg.name.clone());
        }
        reg.names.insert(cfg.name.clone(), cfg.name.clone());
        reg.models.insert(cfg.name.clone(), handle);
        reg.configs.insert(cfg.name.clone(), Arc::new(cfg));
        Ok(())
    }

    /// Takes `name` out of the registry (its names and aliases too);
    /// returns its task's handle.
    fn forget(&self, name: &str) -> Option<Arc<ModelHandle>> {
        let mut reg = self.registry.write().unwrap();
        reg.names.retain(|_, n| n != name);
        reg.configs.remove(name);
        reg.models.remove(name)
    }

    /// The admission task every model asks for GPU room.
    pub fn admission(&self) -> &crate::admission::Admission {
        &self.shared.admission
    }

    /// Waits for every model task to end.
    pub async fn join(&self) {
        let handles: Vec<_> = self
            .registry
            .read()
            .unwrap()
            .models
            .values()
            .cloned()
            .collect();
        for h in handles {
            h.join().await;
        }
    }

    /// A model by name or alias.
    pub fn resolve(&self, name: &str) -> Result<Arc<ModelHandle>, OpError> {
        let reg = self.registry.read().unwrap();
        reg.names
            .get(name)
            .and_then(|n| reg.models.get(n))
            .cloned()
            .ok_or_else(|| OpError::NotFound(name.to_string()))
    }

    /// Every model's current status.
    pub fn list(&self) -> Vec<ModelStatus> {
        let reg = self.registry.read().unwrap();
        reg.models
            .values()
            .map(|h| h.status.borrow().clone())
            .collect()
    }

    pub fn status(&self, name: &str) -> Result<ModelStatus, OpError> {
        Ok(self.resolve(name)?.status.borrow().clone())
    }

    pub fn logs(&self, name: &str) -> Result<Arc<LogRing>, OpError> {
        Ok(self.resolve(name)?.logs.clone())
    }

    async fn send(&self, h: &ModelHandle, event: Event) -> Result<ModelStatus, OpError> {
        match h.send(event).await {
            Some(status) => Ok(status),
            None => Err(self.task_ended(&h.cfg().name)),
        }
    }

    /// Why a model's task ended under a call: the control plane stops, or a
    /// reload replaced or removed the model meanwhile (an attached model
    /// changed by a reload said "the control plane is shutting down").
    fn task_ended(&self, name: &str) -> OpError {
        if self.cancel.is_cancelled() {
            OpError::ShuttingDown
        } else {
            OpError::Refused(format!(
                "model {name:?} was replaced or removed by a reload meanwhile: ask again"
            ))
        }
    }

    /// Sends an operator's command or pin; refused if the model is leaving
    /// with a reload (its task no longer applies them: the old engine is
    /// draining, and a new one goes on from what it wanted before).
    async fn applied(
        &self,
        h: &ModelHandle,
        event: Event,
    ) -> Result<crate::runner::Applied, OpError> {
        let Some(applied) = h.send_applied(event).await else {
            return Err(self.task_ended(&h.cfg().name));
        };
        let after = &applied.status;
        if after.retiring {
            return Err(OpError::Refused(format!(
                "{} is leaving with a reload (removed, or its engine is being replaced): \
                 nothing was applied; once the reload has answered, send it again \
                 (`siesta get {}` shows the model as it is then)",
                after.name, after.name
            )));
        }
        Ok(applied)
    }

    /// Activity reports from a proxy (unknown models are skipped).
    pub fn activity(&self, proxy: &str, reports: &[Activity]) {
        let fences: Vec<FenceReport> = reports
            .iter()
            .map(|r| FenceReport {
                model: &r.model,
                fenced_since_unix_ms: r.fenced_since_unix_ms,
                in_flight: r.in_flight,
            })
            .collect();
        self.shared.fences.report(proxy, &fences);
        for r in reports {
            let Ok(h) = self.resolve(&r.model) else {
                continue;
            };
            h.notify_activity(
                Event::Activity {
                    proxy: proxy.to_string(),
                    in_flight: r.in_flight,
                    held: r.held,
                    active: r.started > 0 || r.finished > 0,
                    last_finished: (r.last_finished_unix_ms > 0)
                        .then(|| self.shared.clock.instant(r.last_finished_unix_ms)),
                },
                r.fenced_since_unix_ms,
            );
        }
    }

    /// A proxy's report of an engine that refused a connection while taken
    /// as awake: its model probes it at once (see `runner/suspect.rs`).
    pub fn endpoint_refused(&self, proxy: &str, model: &str, url: &str, error: &str) {
        if let Ok(h) = self.resolve(model) {
            h.endpoint_refused(crate::runner::Refused {
                proxy: proxy.to_string(),
                url: url.to_string(),
                error: error.to_string(),
            });
        }
    }
}

mod commands;
pub use commands::Answer;
mod reload;

#[cfg(test)]
mod tests;
