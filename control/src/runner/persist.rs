//! What a model task keeps across restarts of siesta-control: it writes its
//! intent (before acting on it), restart count and last activity,
//! calibration and engine's last sleep level to the state store, and takes
//! over an engine found running at start-up.

use super::{Msg, Runner, Shared};
use crate::reconciler::{Effect, Event, ModelState, Phase, adopt};
use crate::recovery::Adopted;
use crate::store::{CalibrationRecord, IntentRecord};
use crate::supervisor::{LogRing, ProcHandle};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// While requests are in flight, the last activity is recorded at most this
/// often (every proxy report moves it).
const HISTORY_EVERY_MS: i64 = 1000;
/// What a model's log says when its record could not be written (the
/// daemon's log names the file and redb's error; the store keeps the
/// record queued and writes it once it can, tried every second).
const STORE_FAILED: &str = "state store write failed (is state_dir full, read-only or not \
     answering? the daemon's log names the file): this intent and history are not durable yet; \
     siesta writes them once state_dir can be written again, and a restart before that would \
     lose them";
/// The same, of a suspend.
pub(super) const SUSPEND_NOT_RECORDED: &str = "cannot record the suspend in the state store \
     (is state_dir full, read-only or not answering? the daemon's log names the file): a \
     restarted control would not know the engine is suspended";
/// The same, of the engine record's sleep level.
const SLEEP_LEVEL_FAILED: &str = "state store write failed (is state_dir full, read-only or not \
     answering? the daemon's log names the file): a restarted control would not know the \
     engine's sleep level";

/// Supervises the adopted engine `a` of model `name` and puts `state` on
/// it; returns the handle and the effects to carry out first.
pub(super) fn take_over(
    name: &str,
    a: &Adopted,
    state: &mut ModelState,
    shared: &Arc<Shared>,
    tx: &mpsc::UnboundedSender<Msg>,
    logs: &Arc<LogRing>,
    now: Instant,
) -> (ProcHandle, Vec<Effect>) {
    if let Some(rec) = shared.store.get(name) {
        rec.restore_history(state, &shared.clock);
    }
    let fx = adopt(state, a.proc_gen, a.pid, a.observed, now);
    let exit_tx = tx.clone();
    let proc_gen = a.proc_gen;
    let (store, model, tag) = (shared.store.clone(), name.to_string(), a.tag.clone());
    let on_exit = move |exit: crate::supervisor::Exit| {
        store.remove_engine(&model, &tag);
        let _ = exit_tx.send(Msg::Event(
            Event::ChildExited {
                proc_gen,
                status: exit.status,
                cause: exit.cause,
            },
            None,
        ));
    };
    let handle = crate::supervisor::adopt(
        name,
        crate::supervisor::Leader {
            pid: a.pid,
            start_time: a.start_time,
            tag: &a.tag,
        },
        &shared.log_dir,
        a.proc_gen,
        logs.clone(),
        on_exit,
    );
    (handle, fx)
}

impl Runner {
    /// Keeps the engine record's sleep level current (a hint for recovery:
    /// a control restarted while an engine that cannot say its level
    /// releases its memory resumes it). Durable before the new state is
    /// shown.
    pub(super) fn record_sleep_level(&mut self, level: u8) {
        if self.cfg.is_attach() {
            return;
        }
        if let Some(mut rec) = self.shared.store.engine(&self.cfg.name)
            && rec.proc_gen == self.state.proc_gen
            && (rec.sleep_level != level || rec.suspended)
        {
            rec.sleep_level = level;
            rec.suspended = false;
            rec.suspended_pids.clear();
            let committed = self.shared.store.set_engine_soon(&self.cfg.name, &rec);
            self.unshown.push((committed, SLEEP_LEVEL_FAILED));
        }
    }

    /// Records that the engine is being suspended, durably before the
    /// state is shown: a control restarted from here on adopts it as
    /// suspended. (The suspend task records it again with the pids, and
    /// waits for that before the helper runs; it gives up if it cannot.)
    pub(super) fn record_suspended(&mut self, under: u8) {
        if let Some(mut rec) = self.shared.store.engine(&self.cfg.name)
            && rec.proc_gen == self.state.proc_gen
        {
            rec.sleep_level = under;
            rec.suspended = true;
            let committed = self.shared.store.set_engine_soon(&self.cfg.name, &rec);
            self.unshown.push((committed, SUSPEND_NOT_RECORDED));
        }
    }

    /// Records a changed restart count, last activity or idle floor, so an
    /// adopting daemon goes on with them. A busy model's activity is
    /// written at most about once a second; the end of a burst (nothing in
    /// flight) at once. What is written is durable before the status that
    /// shows it goes out: a restart count, an idle floor and the end of a
    /// burst that a client saw survive a `kill -9` (the activity of a busy
    /// model shown may be up to a second newer than the one recorded).
    pub(super) fn persist_history(&mut self) {
        let rec = IntentRecord::from_state(&self.state, &self.shared.clock);
        // Requests held count as busy too: their reports move the idle
        // clock every 100 ms, and each write is a commit the status waits for.
        let busy = self.state.in_flight() > 0 || self.state.held() > 0;
        let due = self
            .shared
            .store
            .get(&self.cfg.name)
            .is_none_or(|old| history_due(&old, &rec, busy));
        if due && !self.state.retiring {
            let committed = self.shared.store.set_soon(&self.cfg.name, rec);
            self.unshown.push((committed, STORE_FAILED));
        }
    }

    /// Writes the intent record. Not while retiring: a reload's
    /// retirement is no intent of the operator's; the record keeps what the
    /// model wanted before it, so a restart of siesta during the drain goes
    /// on from that (`Models::remove` writes the record the new engine
    /// takes over, or removes it).
    /// Durable on return (awaited: the task waits, no thread does).
    pub(super) async fn persist(&mut self) {
        if self.state.retiring {
            return;
        }
        let rec = IntentRecord::from_state(&self.state, &self.shared.clock);
        if !self.shared.store.set_soon(&self.cfg.name, rec).wait().await {
            // Logged by the store too; the operator sees it in the model's
            // log, and in the answer to the command that changed it.
            self.logs.push("siesta", STORE_FAILED);
            self.intent_not_durable = true;
        }
    }

    /// An adopted engine still starting holds its GPUs' start lock, as a
    /// spawned one does, until start-up is over.
    pub(super) fn hold_start_lock_if_starting(&mut self) {
        if !matches!(self.state.phase, Phase::Starting { spawned: true, .. })
            || self.placed.gpus.is_empty()
        {
            return;
        }
        let hold = crate::supervisor::StartHold::default();
        self.start_hold = Some(hold.clone());
        let (shared, gpus) = (self.shared.clone(), self.placed.gpus.clone());
        tokio::spawn(async move {
            hold.keep(shared.locks.acquire(&gpus).await);
        });
    }

    pub(super) fn persist_calibration(&self) {
        let rec = CalibrationRecord::from(&self.state.calibration);
        self.shared.store.set_calibration(&self.cfg.name, &rec);
    }
}

/// Whether `rec`'s history must be written over `old`'s: a new restart
/// count or idle floor at once; a newer last activity at once when the
/// model is not `busy` (the end of a burst), else once it is
/// [`HISTORY_EVERY_MS`] newer.
fn history_due(old: &IntentRecord, rec: &IntentRecord, busy: bool) -> bool {
    old.restarts != rec.restarts
        || old.idle_floor_unix_ms != rec.idle_floor_unix_ms
        || (old.last_activity_unix_ms != rec.last_activity_unix_ms
            && (!busy || rec.last_activity_unix_ms - old.last_activity_unix_ms >= HISTORY_EVERY_MS))
}

#[cfg(test)]
mod history_tests {
    use super::*;

    /// Held requests move the idle clock at every report (every 100 ms):
    /// a model with requests held wrote its history, a store commit the
    /// status waited for, at each one.
    #[test]
    fn a_busy_models_activity_is_written_about_once_a_second() {
        let at = |ms| IntentRecord {
            desired: "awake".into(),
            level: 0,
            reason: "demand".into(),
            since_unix_ms: 1,
            until_unix_ms: 0,
            pinned_until_unix_ms: 0,
            restarts: 0,
            last_activity_unix_ms: ms,
            idle_floor_unix_ms: 1,
            restart_asked_unix_ms: 0,
        };
        let old = at(10_000);
        assert!(!history_due(&old, &at(10_100), true));
        assert!(history_due(&old, &at(11_000), true));
        assert!(history_due(&old, &at(10_100), false), "the end of a burst");
        let mut restarted = at(10_000);
        restarted.restarts = 1;
        assert!(history_due(&old, &restarted, true));
    }
}
