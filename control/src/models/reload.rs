//! Reloading the configuration as one diff: which models are added,
//! removed, restarted on a new engine or updated in place, and how a
//! leaving model hands its state on to the engine that follows it.

use super::Models;
use crate::OpError;
use crate::config::{Config, ModelConfig};
use crate::placement::{Placed, Planned, default_placement};
use crate::status::{ModelStatus, State};
use crate::supervisor::{command_hash, spawn_spec};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// What a reload changed, by model name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadSummary {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Restarted: their engine's command line, environment, launch, port,
    /// GPU needs or placement changed (see [`needs_new_engine`]).
    pub changed: Vec<String>,
    /// Updated in place, engine kept: only siesta's own settings for them
    /// changed (timeouts, backoff, idle tiers, preload, hold policy,
    /// aliases, health path).
    pub reconfigured: Vec<String>,
    pub unchanged: Vec<String>,
    /// `[control]` and `[[gpu]]` keys the file changes that are read at
    /// start-up only (e.g. `control.token`): in force after a restart.
    pub not_applied: Vec<String>,
}

impl Models {
    /// Reads `path` and applies it; an invalid file, or one with a model
    /// that can never fit its GPUs, changes nothing and is refused with its
    /// errors (`FILE: KEY: what is wrong`).
    pub async fn reload_file(&self, path: &std::path::Path) -> Result<ReloadSummary, OpError> {
        let config = Config::load(path)?;
        let s = self.reload(&config).await.map_err(|e| match e {
            OpError::Io { what, source } => {
                OpError::io(format!("reload of {}: {what}", path.display()), source)
            }
            other => other,
        })?;
        if s.not_applied.is_empty() {
            tracing::info!(added = ?s.added, removed = ?s.removed, restarted = ?s.changed, updated_in_place = ?s.reconfigured, "configuration reloaded");
        } else {
            tracing::warn!(
                added = ?s.added, removed = ?s.removed, restarted = ?s.changed, updated_in_place = ?s.reconfigured,
                "configuration reloaded; not applied until restart: {}",
                s.not_applied.join(", ")
            );
        }
        Ok(s)
    }

    /// Applies a new configuration as one diff. It is placed first (on the
    /// live inventory and P2P verdicts, keeping running models on their
    /// GPUs where it fits); a refusal changes nothing. Then removed models
    /// are stopped, models that need a new engine ([`needs_new_engine`])
    /// are restarted on their new placement, models whose only changes are
    /// siesta's own settings (timeouts, backoff, idle tiers, preload, hold
    /// policy, aliases) keep their engine and take the new settings in
    /// place, and added models start on their placement. `[control]`
    /// and `[[gpu]]` settings are read at start-up only: the ones `config`
    /// changes are named in the summary's `not_applied`.
    pub async fn reload(&self, config: &Config) -> Result<ReloadSummary, OpError> {
        let current: BTreeMap<String, Arc<ModelConfig>> =
            self.registry.read().unwrap().configs.clone();
        let view = self.shared.admission.gpus().cloned();
        let planned = match &view {
            Some(v) => Some(v.plan(config, &v.current_gpus())?),
            None => None,
        };
        let old_placed = view.as_ref().map(|v| v.placed()).unwrap_or_default();
        let new_placed: BTreeMap<String, Placed> = match &planned {
            Some(Planned::Placed(p)) => p.iter().map(|p| (p.model.clone(), p.placed())).collect(),
            _ => BTreeMap::new(),
        };
        let moved = |name: &str| {
            let (a, b) = (old_placed.get(name), new_placed.get(name));
            a.map(|p| (&p.gpus, p.gpu_memory_utilization))
                != b.map(|p| (&p.gpus, p.gpu_memory_utilization))
        };
        let mut s = ReloadSummary {
            removed: current
                .keys()
                .filter(|n| !config.models.iter().any(|m| &m.name == *n))
                .cloned()
                .collect(),
            not_applied: self.started_with.restart_only_changes(config),
            ..ReloadSummary::default()
        };
        let placed_now = |name: &str, m: &ModelConfig, map: &BTreeMap<String, Placed>| {
            map.get(name)
                .cloned()
                .unwrap_or_else(|| default_placement(m))
        };
        for m in &config.models {
            let list = match current.get(&m.name) {
                None => &mut s.added,
                Some(old)
                    if moved(&m.name)
                        || needs_new_engine(
                            old,
                            &placed_now(&m.name, old, &old_placed),
                            m,
                            &placed_now(&m.name, m, &new_placed),
                        ) =>
                {
                    &mut s.changed
                }
                Some(old) if **old == *m => &mut s.unchanged,
                Some(_) => &mut s.reconfigured,
            };
            list.push(m.name.clone());
        }
        // A new engine that could not get a port (its `host` is no address
        // of this machine) refuses the reload before anything is stopped.
        let new = |m: &ModelConfig| s.added.contains(&m.name) || s.changed.contains(&m.name);
        if let Err(e) = crate::supervisor::check_hosts(config, new) {
            let p = &e.problems[0];
            return Err(OpError::invalid(
                format!("{}: {}", config.origin, p.key),
                format!("{}; nothing was reloaded", p.message),
            ));
        }
        // The old engines leave their GPUs before the new placement counts;
        // answers under way on them finish first (all drain at once: a
        // reload takes one stop grace, not one per model).
        let leaving = s.removed.iter().map(|n| (n, Leaving::Removed)).chain(
            config
                .models
                .iter()
                .filter(|m| s.changed.contains(&m.name))
                .map(|m| {
                    let same_launch = current.get(&m.name).is_some_and(|old| same_launch(old, m));
                    (&m.name, Leaving::Changed { same_launch })
                }),
        );
        let held = futures::future::join_all(leaving.map(|(n, leaving)| async move {
            let held = self.remove(n, leaving).await;
            (n.clone(), leaving != Leaving::Removed && held > 0)
        }))
        .await;
        let wanted: Vec<String> = held
            .into_iter()
            .filter(|(_, w)| *w)
            .map(|(n, _)| n)
            .collect();
        if let (Some(v), Some(p)) = (&view, planned) {
            v.apply(config, p);
        }
        self.shared.ports.configure(&config.models);
        let placed_of = |m: &ModelConfig| {
            view.as_ref()
                .and_then(|v| v.placed_one(&m.name))
                .unwrap_or_else(|| default_placement(m))
        };
        for m in config.models.iter() {
            if s.added.contains(&m.name) || s.changed.contains(&m.name) {
                let carried_over = s.changed.contains(&m.name);
                // Nothing new is started once the daemon shuts down (its
                // model tasks are joined after the reload ends).
                let added = if self.cancel.is_cancelled() {
                    Err(OpError::ShuttingDown)
                } else {
                    self.add(m.clone(), Some(placed_of(m)), None, carried_over)
                        .map_err(|e| OpError::io(format!("reload: starting {}", m.name), e))
                };
                if let Err(e) = added {
                    // A changed model's old task is gone: not listed as if
                    // it still ran.
                    self.forget(&m.name);
                    return Err(e);
                }
            } else if s.reconfigured.contains(&m.name) {
                self.reconfigure(m);
            }
        }
        // Requests held for a changed model while its old engine drained
        // are the new engine's demand.
        for name in &wanted {
            let _ = self.demand(name).await;
        }
        if let Some(v) = &view {
            self.shared.hub.set_placement(v.placement(&self.list()));
        }
        self.shared.stop_bound.set(&config.models);
        Ok(s)
    }

    /// New settings of siesta's own (timeouts, backoff, idle tiers,
    /// preload, hold policy, aliases, health path) for a running model.
    fn reconfigure(&self, m: &ModelConfig) {
        let cfg = Arc::new(m.clone());
        let mut reg = self.registry.write().unwrap();
        reg.names.retain(|_, n| n != &m.name);
        for alias in &m.aliases {
            reg.names.insert(alias.clone(), m.name.clone());
        }
        reg.names.insert(m.name.clone(), m.name.clone());
        reg.configs.insert(m.name.clone(), cfg.clone());
        if let Some(h) = reg.models.get(&m.name) {
            h.reconfigure(cfg);
        }
    }

    /// Stops `name` for good (answers under way finish first, as for an
    /// operator's stop) and forgets it, or, for a changed model whose new
    /// engine is added next under the same name, hands its state on:
    /// proxies see its new state, not a removal (their held requests stay
    /// held for it), and the new engine goes on from what the model wanted
    /// before this reload (an operator's stop stays a stop, a demand, wake
    /// or pin is awake again), its pin, restart count and last activity:
    /// written to the state store, where a restart finds them too. Its
    /// calibration goes on only with the same engine command and GPU needs:
    /// the times are of one engine (new `args` can change its CUDA graphs,
    /// its KV cache, its model), and a proxy sheds requests on a calibrated
    /// estimate, never on an uncalibrated one; the first start measures it.
    /// Returns how many requests the proxies held for it at the end.
    async fn remove(&self, name: &str, leaving: Leaving) -> u32 {
        let mut held = 0;
        let mut before = self.resolve(name).ok().map(|h| h.status.borrow().clone());
        if let Ok(h) = self.resolve(name)
            && !h.cfg().is_attach()
            && let Some(last) = h.retire().await
        {
            // From just before the retirement, which records the model
            // stopped for good: a command that came first is in it, one
            // that came after is refused (`Models::applied`).
            before = Some(last);
            let limit = h.cfg().timeouts.stop_grace * 2 + Duration::from_secs(10);
            let mut rx = h.status.clone();
            let _ = tokio::time::timeout(
                limit,
                rx.wait_for(|s| matches!(s.state, State::Stopped | State::Failed)),
            )
            .await;
            held = h.status.borrow().held;
        } else if let Ok(h) = self.resolve(name)
            && leaving == Leaving::Removed
            && h.retire().await.is_some()
        {
            // An attached engine siesta cannot stop is put to sleep, or left
            // asleep: its task ending next would cut the sleep, and nothing
            // else would ever put it to sleep again. It takes no new
            // requests (proxies hold them) and its answers under way finish
            // first, up to one stop grace; then its sleep, up to the sleep
            // timeout.
            let t = h.cfg().timeouts;
            let mut rx = h.status.clone();
            let settled =
                |s: &ModelStatus| matches!(s.state, State::Asleep | State::Stopped | State::Failed);
            let _ = tokio::time::timeout(
                t.stop_grace + t.sleep + Duration::from_secs(5),
                rx.wait_for(|s| settled(s)),
            )
            .await;
            let s = h.status.borrow().clone();
            if !settled(&s) {
                tracing::warn!(model = %name, in_flight = s.in_flight, "removed attached engine left awake: its requests did not finish within its stop grace, or its sleep did not; it holds GPU memory siesta no longer counts (put it to sleep or stop it by hand)");
            }
        }
        // A changed model stays listed and found by name (retiring: its
        // commands are refused as leaving, then as replaced) until its new
        // engine's task takes its place: while other models of the reload
        // drain, an operator's call for it is not told it does not exist.
        let handle = match leaving {
            Leaving::Removed => self.forget(name),
            Leaving::Changed { .. } => self.registry.read().unwrap().models.get(name).cloned(),
        };
        self.shared.admission.registry().remove(name);
        // The history as it ended (the drain may have moved it).
        let mut after = None;
        if let Some(h) = handle {
            h.shutdown(true).await;
            after = Some(h.status.borrow().clone());
        }
        if leaving == Leaving::Removed {
            self.shared.hub.remove_model(name);
        }
        let store = &self.shared.store;
        if let (Leaving::Changed { same_launch }, Some(before)) = (leaving, before) {
            let end = after.as_ref().unwrap_or(&before);
            let mut rec = crate::store::IntentRecord::from_status(&before);
            rec.restarts = rec.restarts.max(end.restarts);
            rec.last_activity_unix_ms = rec
                .last_activity_unix_ms
                .max(end.last_activity_unix_ms.unwrap_or(0));
            // One transaction: a crash between forgetting the old records
            // and writing the intent lost the operator's stop or pin.
            store.replace(name, &rec).wait().await;
            if same_launch {
                store.set_calibration(name, &(&end.calibration).into());
            }
        } else {
            store.remove(name).wait().await;
        }
        held
    }
}

/// How a model leaves in a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leaving {
    Removed,
    /// Its engine command or placement changed: a new engine follows.
    /// `same_launch`: same engine command and GPU needs (see [`same_launch`]).
    Changed {
        same_launch: bool,
    },
}

/// Whether two configurations of a model launch the same engine command
/// with the same GPU needs: its measured start, sleep and wake times still
/// hold (its GPUs, timeouts or preload may differ).
fn same_launch(old: &ModelConfig, new: &ModelConfig) -> bool {
    (
        &old.model,
        old.engine,
        &old.launch,
        &old.args,
        &old.env,
        old.gpus,
        &old.gpu_memory,
    ) == (
        &new.model,
        new.engine,
        &new.launch,
        &new.args,
        &new.env,
        new.gpus,
        &new.gpu_memory,
    )
}

/// Whether a reload from `old` (placed at `old_at`) to `new` (placed at
/// `new_at`) needs a new engine: the command line or environment siesta
/// would spawn it with differs ([`spawn_spec`]'s [`command_hash`], which
/// covers `model`, `args`, `env` and what idle tiers add to it, e.g. a
/// suspend tier's switches), or its engine kind, launch (executable or
/// command, host, port, attach URL), or GPU needs (`gpus`, `gpu_memory`,
/// `gpu_ids`, `exclusive`). Everything else is siesta's own and is taken
/// in place by the running task: timeouts, backoff, idle tiers, preload,
/// hold policy, aliases, health path. A key added to [`ModelConfig`] later
/// restarts the engine until it is listed here.
fn needs_new_engine(
    old: &ModelConfig,
    old_at: &Placed,
    new: &ModelConfig,
    new_at: &Placed,
) -> bool {
    let mut n = new.clone();
    n.aliases.clone_from(&old.aliases);
    n.health_path.clone_from(&old.health_path);
    n.idle.clone_from(&old.idle);
    n.preload = old.preload;
    n.max_queue = old.max_queue;
    n.max_hold = old.max_hold;
    n.timeouts = old.timeouts;
    n.backoff = old.backoff;
    // The port is the configured one (`launch`) or the one the running
    // engine was given: the same in both.
    n != *old
        || command_hash(&spawn_spec(old, 0, old_at)) != command_hash(&spawn_spec(new, 0, new_at))
}
