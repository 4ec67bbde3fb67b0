//! The set of model tasks and the operations on them by name or alias: what
//! the gRPC layer calls. Answers in domain types; refusals are [`OpError`].

use crate::OpError;
use crate::config::{Config, IdleAction, ModelConfig};
use crate::fence::FenceReport;
use crate::placement::{Placed, Planned, default_placement};
use crate::reconciler::{Command, Desired, Event, Reason};
use crate::recovery::Adopted;
use crate::runner::{ModelHandle, Shared, spawn_model_adopting};
use crate::status::{ModelStatus, State};
use crate::supervisor::{LogRing, command_hash, spawn_spec};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
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
        for alias in &cfg.aliases {
            reg.names.insert(alias.clone(), cfg.name.clone());
        }
        reg.names.insert(cfg.name.clone(), cfg.name.clone());
        reg.models.insert(cfg.name.clone(), handle);
        reg.configs.insert(cfg.name.clone(), Arc::new(cfg));
        Ok(())
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
        let handle = {
            let mut reg = self.registry.write().unwrap();
            reg.names.retain(|_, n| n != name);
            reg.configs.remove(name);
            reg.models.remove(name)
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
        store.remove(name).wait().await;
        if let (Leaving::Changed { same_launch }, Some(before)) = (leaving, before) {
            let end = after.as_ref().unwrap_or(&before);
            let mut rec = crate::store::IntentRecord::from_status(&before);
            rec.restarts = rec.restarts.max(end.restarts);
            rec.last_activity_unix_ms = rec
                .last_activity_unix_ms
                .max(end.last_activity_unix_ms.unwrap_or(0));
            store.set_soon(name, rec).wait().await;
            if same_launch {
                store.set_calibration(name, &(&end.calibration).into());
            }
        }
        held
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
        h.send(event).await.ok_or(OpError::ShuttingDown)
    }

    /// Sends an operator's command or pin; refused if the model is leaving
    /// with a reload (its task no longer applies them: the old engine is
    /// draining, and a new one goes on from what it wanted before).
    async fn applied(&self, h: &ModelHandle, event: Event) -> Result<ModelStatus, OpError> {
        let after = self.send(h, event).await?;
        if after.retiring {
            return Err(OpError::Refused(format!(
                "{} is leaving with a reload (removed, or its engine is being replaced): \
                 nothing was applied; once the reload has answered, send it again \
                 (`siesta status {}` shows the model as it is then)",
                after.name, after.name
            )));
        }
        Ok(after)
    }

    /// Operator command; returns the status once accepted and a short account.
    pub async fn command(
        &self,
        name: &str,
        cmd: Command,
    ) -> Result<(ModelStatus, String), OpError> {
        let h = self.resolve(name)?;
        let before = h.status.borrow().clone();
        let attach = h.cfg().is_attach();
        match cmd {
            Command::Sleep(level @ (0 | 3..)) => {
                return Err(OpError::invalid(
                    "level",
                    format!("{level} is not a sleep level (1 or 2)"),
                ));
            }
            Command::Sleep(level) if !h.cfg().engine.can_sleep(level) => {
                return Err(OpError::Refused(format!(
                    "{} runs engine = \"{}\", which cannot sleep at level {level}; what it can do when idle: {}",
                    before.name,
                    h.cfg().engine,
                    h.cfg().engine.actions(attach)
                )));
            }
            Command::Suspend if !h.cfg().engine.can(IdleAction::Suspend, attach) => {
                return Err(OpError::Refused(format!(
                    "{} runs {}engine = \"{}\", which siesta cannot suspend (it does not own an attached engine's processes); what it can do when idle: {}",
                    before.name,
                    if attach { "an attached " } else { "" },
                    h.cfg().engine,
                    h.cfg().engine.actions(attach)
                )));
            }
            Command::Suspend if h.cfg().gpus > 1 && !h.cfg().checkpointable_multi_gpu() => {
                return Err(OpError::Refused(format!(
                    "{} runs on {} GPUs and was started sharing GPU memory between its processes \
                     (NCCL P2P, custom all-reduce): the CUDA driver cannot restore such a process \
                     (CUDA_ERROR_NOT_SUPPORTED). Give it an idle tier with action = \"suspend\" \
                     (siesta then starts it without sharing) and suspend it after its restart",
                    before.name,
                    h.cfg().gpus
                )));
            }
            Command::Sleep(_) | Command::Suspend if before.state == State::Stopped => {
                return Err(OpError::Refused(format!(
                    "{} is stopped: start it first",
                    before.name
                )));
            }
            Command::Stop | Command::Restart if attach => {
                return Err(OpError::Refused(format!(
                    "{} is an attach engine run by someone else: siesta can only sleep and wake it",
                    before.name
                )));
            }
            _ => {}
        }
        let mut after = self.applied(&h, Event::Command(cmd)).await?;
        if matches!(cmd, Command::Sleep(_) | Command::Suspend) && holds_for_requests(&after) {
            after = self.fresh_in_flight(&h).await;
        }
        let msg = account(&before, &after, cmd);
        Ok((after, msg))
    }

    /// The status once the in-flight count is fresh: proxies report every
    /// 100 ms and the engine's gauge is read every poll, so a request that
    /// just finished may still be counted. Waits up to one poll (plus a
    /// margin) for the sleep to begin; what is still counted after that is
    /// really in flight.
    async fn fresh_in_flight(&self, h: &ModelHandle) -> ModelStatus {
        let mut rx = h.status.clone();
        let within = self.shared.poll_every + Duration::from_millis(300);
        let _ = tokio::time::timeout(within, rx.wait_for(|s| !holds_for_requests(s))).await;
        h.status.borrow().clone()
    }

    /// Wake, optionally waiting until awake or failed (or `timeout`), or
    /// until the wake is called off: the intent is no longer awake (an
    /// operator's stop or sleep, a wake that found no room and gave up).
    pub async fn wake(
        &self,
        name: &str,
        wait: bool,
        timeout: Option<Duration>,
    ) -> Result<(ModelStatus, String), OpError> {
        let (status, msg) = self.command(name, Command::Wake).await?;
        if !wait || status.state == State::Awake {
            return Ok((status, msg));
        }
        let h = self.resolve(name)?;
        let timeout = timeout.unwrap_or(h.cfg().timeouts.start + h.cfg().timeouts.wake);
        let mut rx = h.status.clone();
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|s| {
                matches!(s.state, State::Awake | State::Failed)
                    || s.intent.desired != Desired::Awake
            }),
        )
        .await;
        if let Ok(Err(_)) = waited {
            // The model's task ended: the control plane is stopping. Its
            // last status says nothing about the wake.
            return Err(OpError::ShuttingDown);
        }
        // Read after the wait, whether it ran out or not: a model that got
        // there at the deadline is told as it is, not as still waking.
        let status = h.status.borrow().clone();
        let msg = waited_wake_says(&status, timeout);
        Ok((status, msg))
    }

    /// Pins for `d` from now, on this control plane's clock.
    pub async fn pin_for(&self, name: &str, d: Duration) -> Result<(ModelStatus, String), OpError> {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        self.pin(name, self.shared.clock.now_ms().saturating_add(ms))
            .await
    }

    pub async fn pin(
        &self,
        name: &str,
        until_unix_ms: i64,
    ) -> Result<(ModelStatus, String), OpError> {
        let h = self.resolve(name)?;
        let now = self.shared.clock.now_ms();
        let until = match until_unix_ms {
            0 => None,
            t if t <= now => {
                return Err(OpError::invalid(
                    "until_unix_ms",
                    format!("pin until {t} is in the past (now {now})"),
                ));
            }
            t => Some(self.shared.clock.instant(t)),
        };
        let status = self.applied(&h, Event::Pin(until)).await?;
        let msg = match until {
            None => "pinned awake until unpinned".to_string(),
            Some(_) => format!("pinned awake for {}s", (until_unix_ms - now) / 1000),
        };
        Ok((status, msg))
    }

    pub async fn unpin(&self, name: &str) -> Result<(ModelStatus, String), OpError> {
        let h = self.resolve(name)?;
        let status = self.applied(&h, Event::Unpin).await?;
        Ok((
            status,
            "unpinned; idle tiers count from the last activity".into(),
        ))
    }

    /// A proxy's demand: (status, accepted, message).
    pub async fn demand(&self, name: &str) -> Result<(ModelStatus, bool, String), OpError> {
        let h = self.resolve(name)?;
        let status = self.send(&h, Event::Demand).await?;
        if status.intent.desired == Desired::Stopped && status.intent.reason == Reason::Operator {
            let msg = format!(
                "{} was stopped by an operator; Start or Wake it first",
                status.name
            );
            return Ok((status, false, msg));
        }
        let msg = match status.state {
            State::Awake => "awake".to_string(),
            State::Failed => match status.retry_at_unix_ms {
                Some(at) => format!("failed; retrying at {at}"),
                None => "failed; no retry scheduled".to_string(),
            },
            s => format!("{s:?}").to_lowercase(),
        };
        Ok((status, true, msg))
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
        for (i, m) in config.models.iter().enumerate() {
            if !(s.added.contains(&m.name) || s.changed.contains(&m.name)) {
                continue;
            }
            if let crate::config::Launch::Process {
                host, port: None, ..
            } = &m.launch
                && let Err(e) = crate::supervisor::free_port(host)
            {
                return Err(OpError::invalid(
                    format!("{}: model[{i}].host", config.origin),
                    format!("model {:?}: {e}; nothing was reloaded", m.name),
                ));
            }
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
        let placed_of = |m: &ModelConfig| {
            view.as_ref()
                .and_then(|v| v.placed_one(&m.name))
                .unwrap_or_else(|| default_placement(m))
        };
        for m in config.models.iter() {
            if s.added.contains(&m.name) || s.changed.contains(&m.name) {
                let carried_over = s.changed.contains(&m.name);
                self.add(m.clone(), Some(placed_of(m)), None, carried_over)
                    .map_err(|e| OpError::io(format!("reload: starting {}", m.name), e))?;
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

/// Awake, asked to go elsewhere, and held by requests in flight.
fn holds_for_requests(s: &ModelStatus) -> bool {
    s.state == State::Awake && s.in_flight > 0 && s.intent.desired != Desired::Awake
}

fn account(before: &ModelStatus, after: &ModelStatus, cmd: Command) -> String {
    let state = format!("{:?}", after.state).to_lowercase();
    match (cmd, before.state) {
        (Command::Wake | Command::Start, State::Awake) => "already awake".into(),
        (Command::Stop, State::Stopped) => "already stopped".into(),
        (Command::Sleep(l), State::Asleep) if before.sleep_level >= l => {
            format!("already asleep at level {}", before.sleep_level)
        }
        // Deeper: vLLM sleeps only from awake, so it is woken first.
        (Command::Sleep(l), State::Asleep) if after.state == State::Waking => format!(
            "asleep at level {}: waking it to sleep again at level {l}",
            before.sleep_level
        ),
        (Command::Suspend, State::Suspended) => "already suspended".into(),
        (Command::Suspend, _) if after.in_flight > 0 && after.state == State::Awake => {
            format!(
                "will suspend once {} request(s) in flight finish",
                after.in_flight
            )
        }
        (Command::Sleep(_), _) if after.in_flight > 0 && after.state == State::Awake => {
            format!(
                "will sleep once {} request(s) in flight finish",
                after.in_flight
            )
        }
        _ => state,
    }
}

/// What a waited wake that ran out of time says: the state, and what the
/// model waits for if anything (room held by other models or by processes
/// siesta does not run, a neighbour's turn on its GPUs).
/// What a waited wake says of the model as it is when the wait ends (the
/// model awake, failed, no longer wanted awake, or still on its way after
/// `timeout`).
fn waited_wake_says(status: &ModelStatus, timeout: Duration) -> String {
    match status.state {
        State::Awake => "awake".to_string(),
        State::Failed => format!(
            "failed: {}",
            status.last_error.as_deref().unwrap_or("no reason given")
        ),
        _ if status.intent.desired != Desired::Awake => {
            let i = &status.intent;
            let why = status
                .last_error
                .as_deref()
                .map_or(String::new(), |e| format!(": {e}"));
            let intent = format!("{:?} ({:?})", i.desired, i.reason).to_lowercase();
            format!("the wake was called off: the intent is now {intent}{why}")
        }
        _ => still_waking(status, timeout),
    }
}

fn still_waking(status: &ModelStatus, timeout: Duration) -> String {
    let state = format!("{:?}", status.state).to_lowercase();
    match status.waiting_for.as_deref().filter(|w| !w.is_empty()) {
        Some(w) => format!("still {state} after {timeout:?}, waiting for {w}; the wake goes on"),
        None => format!("still {state} after {timeout:?}; the wake goes on"),
    }
}

#[cfg(test)]
mod tests;
