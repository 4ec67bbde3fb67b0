//! The effects that wait on proxy fences (`fence.rs`): the drain before an
//! operator's stop, and the suspend tier's CUDA checkpoint helper run on the
//! engine's CUDA processes once no probe is on its way to it and every
//! proxy has confirmed it forwards nothing more to it; and the restore
//! after admission finds room on its GPUs.

use super::{Msg, Runner};
use crate::admission::NotAdmitted;
use crate::checkpoint::{self, Op};
use crate::fence::FENCE_TIMEOUT;
use crate::reconciler::{Event, SUSPEND_TIMEOUT};
use std::time::Duration;

pub(super) const METRICS_TIMEOUT: Duration = Duration::from_secs(2);

impl Runner {
    /// The engine's process group (its leader's pid).
    fn pgid(&self) -> Option<u32> {
        self.proc.as_ref().map(|p| p.pid).or(self.state.pid)
    }

    /// Before an operator's stop or restart, or a yield's sleep: waits
    /// until every live proxy has applied the draining (or yielding) state
    /// (it forwards nothing more) and has nothing in flight to the engine,
    /// until the phase's deadline (one stop grace).
    pub(super) fn drain(&mut self, epoch: u64) {
        let send = self.event_sender();
        let (fences, name) = (self.shared.fences.clone(), self.cfg.name.clone());
        let since_ms = self.shared.clock.unix_ms(self.state.since);
        let grace = self
            .state
            .phase
            .deadline()
            .map_or(self.cfg.timeouts.stop_grace, |d| {
                d.saturating_duration_since(tokio::time::Instant::now())
            });
        self.op(async move {
            let error = fences.wait_fenced(&name, since_ms, grace).await.err();
            send(Event::Drained { epoch, error });
        });
    }

    pub(super) fn suspend(&mut self, epoch: u64) {
        let send = self.event_sender();
        let Some(pgid) = self.pgid() else {
            send(Event::SuspendFailed {
                epoch,
                error: "no engine process to suspend".into(),
            });
            return;
        };
        let (gate, admission) = (self.probe_gate.clone(), self.shared.admission.clone());
        let (shared, tx, gpus) = (
            self.shared.clone(),
            self.tx.clone(),
            self.placed.gpus.clone(),
        );
        let (store, tool) = (
            self.shared.store.clone(),
            self.shared.cuda_checkpoint.clone(),
        );
        let (name, client, logs) = (
            self.cfg.name.clone(),
            self.client.clone(),
            self.logs.clone(),
        );
        let has_metric = self.cfg.engine.capabilities().activity_metric.is_some();
        let proc_gen = self.state.proc_gen;
        // The suspending state as published: proxies echo it once applied.
        let since_ms = self.shared.clock.unix_ms(self.state.since);
        let fences = self.shared.fences.clone();
        self.suspend_cancel = tokio_util::sync::CancellationToken::new();
        let cancel = self.suspend_cancel.clone();
        self.op(async move {
            // A periodic probe on its way finishes first; none starts after.
            drop(gate.lock().await);
            // Every live proxy has applied the suspending state (it holds
            // new requests) and has nothing in flight to the engine. A
            // request held meanwhile calls the suspend off: cheaper than a
            // checkpoint and a restore.
            let fenced = tokio::select! {
                r = fences.wait_fenced(&name, since_ms, FENCE_TIMEOUT) => r,
                () = cancel.cancelled() => Err(String::new()),
            };
            if cancel.is_cancelled() {
                send(Event::SuspendCalledOff { epoch });
                return;
            }
            if let Err(error) = fenced {
                let error = format!("{error}; the tier tries again after another idle period");
                send(Event::SuspendFailed { epoch, error });
                return;
            }
            // Not while an engine starts on its GPUs: the memory the
            // checkpoint frees would fail that start (see `GpuLocks`). A
            // request held meanwhile calls the suspend off.
            let guards = tokio::select! {
                g = super::turns::hold_off_starts(&shared, &name, "suspend", &gpus, &tx) => g,
                () = cancel.cancelled() => {
                    send(Event::SuspendCalledOff { epoch });
                    return;
                }
            };
            send(Event::FreeBegan { epoch });
            // A request forwarded just before the proxies saw the change
            // would reach a checkpointed engine: look once more (the
            // engine is not locked yet, asking is safe).
            if has_metric
                && let Ok(m) = client.metrics(METRICS_TIMEOUT).await
                && m.running + m.waiting > 0
            {
                let error = format!(
                    "{} request(s) reached the engine as the suspend began",
                    m.running + m.waiting
                );
                send(Event::SuspendFailed { epoch, error });
                return;
            }
            let nvml = tokio::task::spawn_blocking(move || admission.engine_cuda_processes(pgid))
                .await
                .ok()
                .flatten();
            let (pids, bytes) = checkpoint::targets(pgid, nvml);
            if pids.is_empty() {
                let error = checkpoint::CheckpointError::NoProcess(pgid).to_string();
                send(Event::SuspendFailed { epoch, error });
                return;
            }
            if let (Some(need), Some(available)) = (bytes, checkpoint::mem_available())
                && let Err(error) = checkpoint::check_host_room(need, available)
            {
                send(Event::SuspendFailed { epoch, error });
                return;
            }
            // Suspended, and which pids, durably, before the helper touches
            // them: else a control restarted meanwhile would not know.
            let recorded = match store.engine(&name) {
                Some(mut rec) if rec.proc_gen == proc_gen => {
                    rec.suspended = true;
                    rec.suspended_pids.clone_from(&pids);
                    store.set_engine_soon(&name, &rec).wait().await
                }
                _ => false,
            };
            if !recorded {
                let error = super::persist::SUSPEND_NOT_RECORDED.to_string();
                send(Event::SuspendFailed { epoch, error });
                return;
            }
            tracing::info!(model = %name, ?pids, gpu_bytes = bytes, "suspending: CUDA checkpoint");
            match run_holding(guards, tool, Op::Suspend, pids, SUSPEND_TIMEOUT).await {
                Ok(reports) => {
                    logs.push("siesta", times_line("suspend", &reports));
                    send(Event::SuspendDone { epoch });
                }
                Err(error) => send(Event::SuspendFailed { epoch, error }),
            }
        });
    }

    pub(super) fn resume(&mut self, epoch: u64) {
        let send = self.event_sender();
        let Some(pgid) = self.pgid() else {
            send(Event::ResumeFailed {
                epoch,
                error: "no engine process to resume".into(),
            });
            return;
        };
        let (shared, name, tx) = (self.shared.clone(), self.cfg.name.clone(), self.tx.clone());
        let logs = self.logs.clone();
        let timeout = self.cfg.timeouts.wake;
        let gpus = self.placed.gpus.clone();
        self.op(async move {
            let waiting_tx = tx.clone();
            let waiting = Box::new(move |w: Option<String>| {
                let _ = waiting_tx.send(Msg::WaitingFor(w));
            });
            match shared.admission.admit(&name, waiting).await {
                Ok(()) => {}
                // No restore: the daemon is going.
                Err(NotAdmitted::ShuttingDown) => return,
                Err(gone) => {
                    send(Event::ResumeFailed {
                        epoch,
                        error: gone.to_string(),
                    });
                    return;
                }
            }
            super::effects::hand_over_admission(&tx, epoch).await;
            let pids = shared
                .store
                .engine(&name)
                .map(|r| r.suspended_pids)
                .filter(|p| !p.is_empty())
                .unwrap_or_else(|| checkpoint::group_pids(pgid));
            // A restore allocates as a wake does: not while a neighbour
            // sleeps on its GPUs (vLLM would fail that sleep).
            let guards = super::turns::hold_off_sleeps(&shared, &name, &gpus, &tx).await;
            send(Event::WakeBegan { epoch, step: 0 });
            tracing::info!(model = %name, ?pids, "resuming: CUDA restore");
            let tool = shared.cuda_checkpoint.clone();
            match run_holding(guards, tool, Op::Resume, pids, timeout).await {
                Ok(reports) => {
                    logs.push("siesta", times_line("resume", &reports));
                    send(Event::ResumeDone { epoch });
                }
                Err(error) => send(Event::ResumeFailed { epoch, error }),
            }
        });
    }
}

/// Runs the checkpoint helper's `op` on `pids` to its end holding `turns`,
/// the GPU locks it needs, even if the op awaiting it is aborted (see
/// `to_the_end`): the driver goes on freeing or allocating, and a helper
/// killed mid-way would leave the engine half checkpointed.
async fn run_holding<G: Send + 'static>(
    turns: G,
    tool: std::path::PathBuf,
    op: Op,
    pids: Vec<u32>,
    deadline: Duration,
) -> Result<Vec<checkpoint::PidReport>, String> {
    super::turns::to_the_end(turns, async move {
        checkpoint::run(&tool, op, &pids, deadline)
            .await
            .map_err(|e| e.to_string())
    })
    .await
}

/// `suspend: pid 12 lock 3 ms checkpoint 2301 ms; ...` for the model's log.
fn times_line(op: &str, reports: &[checkpoint::PidReport]) -> String {
    let each: Vec<String> = reports
        .iter()
        .map(|r| {
            let mut s = format!("pid {}", r.pid);
            for (what, ms) in [
                ("lock", r.lock_ms),
                ("checkpoint", r.checkpoint_ms),
                ("restore", r.restore_ms),
            ] {
                if let Some(ms) = ms {
                    s.push_str(&format!(" {what} {ms} ms"));
                }
            }
            s
        })
        .collect();
    format!("{op}: {}", each.join("; "))
}
