//! Carrying out the reconciler's effects: each I/O runs in its own task and
//! reports back as an event tagged with the epoch (or process generation).

use super::probe::{PROBE_TIMEOUT, sleep_level};
use super::suspend::METRICS_TIMEOUT;
use super::turns::{hold_off_sleeps, hold_off_starts, sleep_turns, to_the_end};
use super::{Msg, Runner};
use crate::admission::NotAdmitted;
use crate::config::Launch;
use crate::reconciler::{Effect, Event};
use crate::store::EngineRecord;
use crate::supervisor::{self, spawn_spec};
use nix::sys::signal::Signal as NixSignal;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

const PROBE_EVERY: Duration = Duration::from_millis(200);
/// Extra time HTTP calls get beyond the transition deadline (the deadline
/// itself is enforced by the state machine).
const CALL_SLACK: Duration = Duration::from_secs(5);

impl Runner {
    pub(super) fn event_sender(&self) -> impl Fn(Event) + Send + 'static {
        let tx = self.tx.clone();
        move |e| {
            let _ = tx.send(Msg::Event(e, None));
        }
    }

    pub(super) fn op<F>(&mut self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.ops.push(tokio::spawn(fut).abort_handle());
    }

    pub(super) fn perform(&mut self, effect: Effect) {
        match effect {
            Effect::Spawn {
                proc_gen,
                fresh_port,
            } => self.spawn_engine(proc_gen, fresh_port),
            Effect::KeepSpawned { proc_gen } => {
                if let Some(h) = self.landed.take() {
                    debug_assert_eq!(h.proc_gen, proc_gen);
                    self.proc = Some(h);
                }
            }
            Effect::KillStray { proc_gen } => {
                if let Some(h) = self.landed.take() {
                    debug_assert_eq!(h.proc_gen, proc_gen);
                    h.signal(NixSignal::SIGKILL);
                }
            }
            Effect::PersistCalibration => self.persist_calibration(),
            Effect::PersistHistory => self.persist_history(),
            Effect::RecordSleepLevel(level) => self.record_sleep_level(level),
            Effect::MeasureResidual => {
                if let Some(pid) = self.state.pid {
                    self.measure_residual(pid);
                }
            }
            Effect::ProbeHealth { epoch, check_sleep } => {
                let client = self.client.clone();
                let send = self.event_sender();
                // An engine that does not say its level is asleep at the
                // level siesta last recorded (the engine record of a process
                // engine, the stored intent of an attach one), else 2: a
                // level-1 wake of a level-2 engine serves garbage, a level-2
                // wake is right for any state.
                let recorded = if self.cfg.is_attach() {
                    match self.state.intent.desired {
                        crate::reconciler::Desired::Asleep(l) => Some(l),
                        _ => None,
                    }
                } else {
                    self.shared
                        .store
                        .engine(&self.cfg.name)
                        .map(|r| r.sleep_level)
                        .filter(|l| *l > 0)
                };
                let known = recorded.unwrap_or(2);
                let (name, wake_timeout) = (self.cfg.name.clone(), self.cfg.timeouts.wake);
                let kind = self.cfg.engine;
                self.op(async move {
                    // An engine that cannot say whether it sleeps is asleep
                    // when siesta recorded it so, and is then only probed
                    // where nothing reaches its GPU.
                    let recorded_asleep = check_sleep && !kind.capabilities().sleep_query;
                    let recorded_asleep = recorded_asleep
                        .then(|| recorded.and_then(|l| kind.deepest_sleep().map(|d| l.min(d))))
                        .flatten();
                    loop {
                        let probe = if recorded_asleep.is_some() {
                            client.alive(PROBE_TIMEOUT).await
                        } else {
                            client.health(PROBE_TIMEOUT).await
                        };
                        if probe.is_ok() {
                            let asleep = if !check_sleep {
                                None
                            } else if kind.capabilities().sleep_query {
                                sleep_level(&client, &name, known, wake_timeout).await
                            } else {
                                recorded_asleep
                            };
                            send(Event::HealthOk { epoch, asleep });
                            return;
                        }
                        tokio::time::sleep(PROBE_EVERY).await;
                    }
                });
            }
            Effect::Sleep { epoch, level } => {
                let client = self.client.clone();
                let send = self.event_sender();
                let timeout = self.cfg.timeouts.sleep + CALL_SLACK;
                let (shared, name, tx) =
                    (self.shared.clone(), self.cfg.name.clone(), self.tx.clone());
                let gpus = self.placed.gpus.clone();
                self.op(async move {
                    // Not while an engine starts on its GPUs (freed memory
                    // would fail its start), nor while a neighbour wakes
                    // there (its allocation would fail this sleep).
                    let turns = sleep_turns(&shared, &name, &gpus, &tx).await;
                    // A request forwarded just before the proxies saw the
                    // sleep begin (or sent to the engine directly) would be
                    // drained under the sleep's timeout, and one longer than
                    // that had the engine killed: look once more.
                    if let Ok(m) = client.metrics(METRICS_TIMEOUT).await
                        && m.running + m.waiting > 0
                    {
                        let running = m.running + m.waiting;
                        send(Event::SleepCalledOff { epoch, running });
                        return;
                    }
                    send(Event::FreeBegan { epoch });
                    let slept =
                        to_the_end(turns, async move { client.sleep(level, timeout).await }).await;
                    send(match slept {
                        Ok(()) => Event::SleepDone { epoch },
                        Err(error) => Event::SleepFailed { epoch, error },
                    });
                });
            }
            Effect::Wake { epoch, step, call } => {
                let client = self.client.clone();
                let send = self.event_sender();
                let timeout = self.cfg.timeouts.wake + CALL_SLACK;
                let (shared, name, tx) =
                    (self.shared.clone(), self.cfg.name.clone(), self.tx.clone());
                let gpus = self.placed.gpus.clone();
                self.op(async move {
                    if step == 0 {
                        let waiting_tx = tx.clone();
                        let waiting = Box::new(move |w: Option<String>| {
                            let _ = waiting_tx.send(Msg::WaitingFor(w));
                        });
                        match shared.admission.admit(&name, waiting).await {
                            Ok(()) => {}
                            // No engine call: the daemon is going.
                            Err(NotAdmitted::ShuttingDown) => return,
                            Err(gone) => {
                                send(Event::WakeFailed {
                                    epoch,
                                    error: gone.to_string(),
                                });
                                return;
                            }
                        }
                        hand_over_admission(&tx, epoch).await;
                        // A sleep still draining (one sent to the engine
                        // directly, or siesta's own before a restart) would
                        // free the memory after this wake: let it end first.
                        let running = client.wait_for_drain(timeout / 2).await;
                        if running > 0 {
                            tracing::info!(model = %name, running, "waited for a draining sleep to finish before waking");
                        }
                    }
                    // Not while a neighbour sleeps on its GPUs: this
                    // wake's allocation would fail that sleep.
                    let guards = hold_off_sleeps(&shared, &name, &gpus, &tx).await;
                    send(Event::WakeBegan { epoch, step });
                    let woken =
                        to_the_end(guards, async move { client.wake(call, timeout).await }).await;
                    send(match woken {
                        Ok(()) => Event::WakeStepDone { epoch, step },
                        Err(error) => Event::WakeFailed { epoch, error },
                    });
                });
            }
            Effect::Terminate { epoch } => self.terminate(epoch),
            Effect::Kill => {
                if let Some(p) = &self.proc {
                    tracing::info!(model = %self.cfg.name, pid = p.pid, "SIGKILL to the process group");
                    p.signal(NixSignal::SIGKILL);
                }
            }
            Effect::ReleaseStartLock => self.release_start_lock(),
            Effect::Drain { epoch } => self.drain(epoch),
            Effect::Suspend { epoch } => self.suspend(epoch),
            Effect::Resume { epoch } => self.resume(epoch),
            Effect::RecordSuspended { under } => self.record_suspended(under),
            Effect::Timer(t) => self.timer = t,
            Effect::Log(line) => {
                tracing::info!(model = %self.cfg.name, "{line}");
                self.logs.push("siesta", line);
            }
            // Done first, in `apply`.
            Effect::Persist => {}
        }
    }

    /// Kills what is left of the previous process, takes the GPUs' start
    /// lock, spawns; the lock is held until `ReleaseStartLock`.
    fn spawn_engine(&mut self, proc_gen: u64, fresh_port: bool) {
        if let Launch::Process {
            host, port: None, ..
        } = &self.cfg.launch
            && (fresh_port || !supervisor::port_is_free(host, self.port))
            && let Ok(p) = self.shared.ports.pick(&self.cfg.name, host)
        {
            // A fresh port after a failure, or when the one picked earlier
            // (when the model was set up, maybe long ago) is taken now.
            self.port = p;
            self.facts.endpoint.url = crate::engine::base_url(host, p);
            self.client = crate::engine::EngineClient::for_model(
                &self.facts.endpoint.url,
                self.shared.engine_idle_timeout,
                &self.cfg,
            );
        }
        // A P2P probe since the last start may have changed the NCCL switches.
        let admission = &self.shared.admission;
        if let Some(off) = admission.p2p_disabled(&self.cfg.name, &self.placed.gpus) {
            (self.placed.p2p_disabled, self.facts.p2p_disabled) = (off, off);
        }
        let spec = spawn_spec(&self.cfg, self.port, &self.placed);
        let record = EngineRecord {
            pid: 0,
            pgid: 0,
            port: self.port,
            start_time: 0,
            command_hash: supervisor::command_hash(&spec),
            tag: format!(
                "{}/{}/{proc_gen}/{:016x}",
                self.shared.control_id,
                self.cfg.name,
                rand::random::<u64>()
            ),
            proc_gen,
            sleep_level: 0,
            suspended: false,
            suspended_pids: Vec::new(),
            spawned_unix_ms: self.shared.clock.now_ms(),
            gpus: self.placed.gpus.clone(),
        };
        let old = self.proc.take();
        let hold = supervisor::StartHold::default();
        self.start_hold = Some(hold.clone());
        // A spawn still on its way (a restart before it landed) must not
        // launch a second engine.
        self.spawn_cancel.cancel();
        self.spawn_cancel = CancellationToken::new();
        let cancel = self.spawn_cancel.clone();
        let shared = self.shared.clone();
        let name = self.cfg.name.clone();
        let gpus = self.placed.gpus.clone();
        let logs = self.logs.clone();
        let tx = self.tx.clone();
        // The Starting phase this spawn is for (its wait for room ends with
        // `Admitted`).
        let epoch = self.state.epoch;
        // A configured port is checked before the start: vLLM 0.24 binds
        // with SO_REUSEPORT, so beside another vLLM holding it (one left
        // from an earlier run) its start succeeds and the kernel shares the
        // port's connections between the two.
        let fixed_port = match &self.cfg.launch {
            Launch::Process {
                host,
                port: Some(p),
                ..
            } => Some((host.clone(), *p)),
            _ => None,
        };
        self.spawning.retain(|t| !t.is_finished());
        self.spawning.push(tokio::spawn(async move {
            if let Some(old) = old {
                old.kill_and_wait().await;
            }
            let waiting_tx = tx.clone();
            let waiting = Box::new(move |w: Option<String>| {
                let _ = waiting_tx.send(Msg::WaitingFor(w));
            });
            tokio::select! {
                admitted = shared.admission.admit(&name, waiting) => match admitted {
                    Ok(()) => {}
                    Err(NotAdmitted::ShuttingDown) => return,
                    Err(gone) => {
                        let error = gone.to_string();
                        let _ = tx.send(Msg::Event(Event::SpawnFailed { proc_gen, error }, None));
                        return;
                    }
                },
                _ = cancel.cancelled() => return,
            }
            tokio::select! {
                _ = hand_over_admission(&tx, epoch) => {}
                _ = cancel.cancelled() => return,
            }
            let guards = tokio::select! {
                g = shared.locks.acquire(&gpus) => g,
                _ = cancel.cancelled() => return,
            };
            if cancel.is_cancelled() {
                return;
            }
            if let Some((host, port)) = fixed_port
                && !supervisor::port_is_free(&host, port)
            {
                let error = format!(
                    "port {port} on {host} (the model's `port`) is in use by another process \
                     (`ss -ltnp 'sport = :{port}'` names it): not started there, as vLLM 0.24 \
                     would bind beside it and share its connections; stop it or change `port` \
                     (the start is tried again after the backoff)"
                );
                let _ = tx.send(Msg::Event(Event::SpawnFailed { proc_gen, error }, None));
                return;
            }
            // Recorded (durably) before the spawn: a siesta killed right
            // after it finds the engine by its tag.
            if !shared.store.set_engine_soon(&name, &record).wait().await {
                let error = "cannot record the engine in the state store".to_string();
                let _ = tx.send(Msg::Event(Event::SpawnFailed { proc_gen, error }, None));
                return;
            }
            // Called off while the record was written: no needless start.
            if cancel.is_cancelled() {
                shared.store.remove_engine(&name, &record.tag);
                return;
            }
            let exit_tx = tx.clone();
            let store = shared.store.clone();
            let (exit_name, exit_tag) = (name.clone(), record.tag.clone());
            let on_exit = move |exit: crate::supervisor::Exit| {
                store.remove_engine(&exit_name, &exit_tag);
                let _ = exit_tx.send(Msg::Event(Event::ChildExited {
                proc_gen,
                status: exit.status,
                cause: exit.cause,
            }, None));
            };
            logs.push(
                "siesta",
                format!("spawning: {} {}", spec.program, spec.args.join(" ")),
            );
            let spawned = supervisor::spawn(
                &name,
                &spec,
                &record.tag,
                &shared.log_dir,
                proc_gen,
                logs,
                on_exit,
            );
            match spawned {
                Ok(handle) => {
                    let mut record = record;
                    record.pid = handle.pid;
                    record.pgid = handle.pid;
                    record.start_time = supervisor::procfs::start_time(handle.pid).unwrap_or(0);
                    if !handle.has_exited() {
                        // Its pid too: a control killed from here on adopts
                        // the process, not only its tag.
                        let _ = shared.store.set_engine_soon(&name, &record).wait().await;
                    }
                    // The model task may have ended (shutdown) while this
                    // spawn landed: nobody would own the engine, so kill it.
                    if let Err(tokio::sync::mpsc::error::SendError(Msg::Spawned(handle))) =
                        tx.send(Msg::Spawned(handle))
                    {
                        tracing::info!(model = %name, pid = handle.pid, "model task gone; killing the engine it was starting");
                        handle.signal(NixSignal::SIGKILL);
                    }
                }
                Err(e) => {
                    shared.store.remove_engine(&name, &record.tag);
                    let error = e.to_string();
                    let _ = tx.send(Msg::Event(Event::SpawnFailed { proc_gen, error }, None));
                    return;
                }
            }
            // The GPUs' start lock is held until start-up is over.
            hold.keep(guards);
        }));
    }

    /// Ends the hold of a start of this model on its GPUs' start locks.
    pub(super) fn release_start_lock(&mut self) {
        if let Some(hold) = self.start_hold.take() {
            hold.release();
        }
    }

    /// SIGTERM to the engine once no engine starts on its GPUs (its exit
    /// frees their memory), then `FreeBegan`; starts there wait until it
    /// is gone (the op ends with the Stopping phase).
    fn terminate(&mut self, epoch: u64) {
        let send = self.event_sender();
        // The engine's own start, under way, holds its GPUs' start locks: no
        // other start is under way there, so SIGTERM goes at once, and the
        // hold is kept until the engine has exited (`ReleaseStartLock` was
        // not asked for). A hold still waiting for the locks ends now.
        let own_start = match self.start_hold.take() {
            Some(hold) if hold.is_held() => Some(supervisor::ReleasedOnDrop(hold)),
            Some(hold) => {
                hold.release();
                None
            }
            None => None,
        };
        let Some(p) = &self.proc else {
            // Nothing to signal (as before a spawn landed): the stop grace
            // counts from now.
            send(Event::FreeBegan { epoch });
            return;
        };
        let p = p.clone();
        let (shared, name, tx) = (self.shared.clone(), self.cfg.name.clone(), self.tx.clone());
        let gpus = self.placed.gpus.clone();
        // SIGTERM, the grace, SIGKILL and the exit of what it killed.
        let exit_bound = self.cfg.timeouts.stop_grace + crate::reconciler::ROOM_WAIT;
        self.op(async move {
            let guards = match own_start {
                Some(own) => futures::future::Either::Left(own),
                None => futures::future::Either::Right(
                    hold_off_starts(&shared, &name, "stop", &gpus, &tx).await,
                ),
            };
            if !p.has_exited() {
                tracing::info!(model = %name, pid = p.pid, "SIGTERM to the process group");
                p.signal(NixSignal::SIGTERM);
            }
            send(Event::FreeBegan { epoch });
            let mut exited = p.exited.clone();
            let _ = to_the_end(guards, async move {
                let gone = exited.wait_for(|gone| *gone);
                let _ = tokio::time::timeout(exit_bound, gone).await;
                Ok(())
            })
            .await;
        });
    }
}

/// Tells the model's task that admission let it in, and waits until the
/// task has taken that in, before anything is done with the room: a wake
/// (or start, or resume) deadline the task handled first gives the wait for
/// room up and ends the operation (its op aborted, its spawn cancelled), so
/// no engine is woken, started or restored that siesta records asleep or
/// stopped and placement does not count. (The task's select takes ready
/// messages and timers in any order: the answer sent alone could be read
/// after the deadline, while the engine call had already gone.)
pub(super) async fn hand_over_admission(tx: &mpsc::UnboundedSender<Msg>, epoch: u64) {
    let (ack, taken) = oneshot::channel();
    if tx
        .send(Msg::Event(Event::Admitted { epoch }, Some(ack)))
        .is_ok()
    {
        let _ = taken.await;
    }
}
