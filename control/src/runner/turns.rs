//! Taking turns on a GPU with the neighbours: vLLM fails a start whose GPU
//! frees memory while it profiles, and a sleep whose GPU's memory use
//! grows meanwhile, so a model's sleep, stop or suspend holds off starts
//! there, its sleep holds off wakes, and its wake holds off sleeps (see
//! `GpuLocks`). An engine call made holding a turn keeps it until the
//! engine has answered, even when the op that made it was called off.

use super::Msg;
use crate::engine::EngineError;
use tokio::sync::mpsc;

/// Runs `call`, an engine call (or a wait for an engine's exit) made holding
/// `turns` (the GPU locks it needs), to its end even when the op awaiting
/// it is aborted by a newer epoch: the engine goes on freeing or allocating
/// whoever waits for its answer (vLLM does not call off a sleep or wake
/// whose client went away), so the turns are held until it has answered.
/// The call's own timeout bounds that (a stop's wait for the exit: its
/// grace and 5 minutes). Before, a stop during a sleep let a
/// neighbour's start begin while the sleep still freed memory, and vLLM
/// failed that start ("Error in memory profiling").
pub(super) async fn to_the_end<G, T>(
    turns: G,
    call: impl std::future::Future<Output = Result<T, EngineError>> + Send + 'static,
) -> Result<T, EngineError>
where
    G: Send + 'static,
    T: Send + 'static,
{
    tokio::spawn(async move {
        let answer = call.await;
        drop(turns);
        answer
    })
    .await
    .unwrap_or_else(|e| Err(format!("the engine call ended without an answer: {e}")))
}

/// Holds off starts on `gpus` while `model` frees memory there (`what`:
/// its sleep, stop or suspend): vLLM fails a start whose GPU frees memory
/// while it profiles (see `GpuLocks`).
pub(super) async fn hold_off_starts(
    shared: &super::Shared,
    model: &str,
    what: &str,
    gpus: &[u32],
    tx: &mpsc::UnboundedSender<Msg>,
) -> crate::supervisor::FreeGuards {
    let turn = Turn {
        what,
        of: "an engine starting",
        because: "vLLM fails a start whose GPU frees memory while it profiles",
    };
    let locks = &shared.locks;
    turn.wait(model, gpus, locks.try_free(gpus), locks.free(gpus), tx)
        .await
}

/// Holds off wakes on `gpus` while `model` sleeps there: vLLM fails a sleep
/// whose GPU's memory use grows meanwhile ("Memory usage increased after
/// sleeping"; see `GpuLocks`).
pub(super) async fn hold_off_wakes(
    shared: &super::Shared,
    model: &str,
    gpus: &[u32],
    tx: &mpsc::UnboundedSender<Msg>,
) -> crate::supervisor::SleepGuards {
    let turn = Turn {
        what: "sleep",
        of: "a neighbour waking",
        because: SLEEP_FAILS,
    };
    let locks = &shared.locks;
    turn.wait(model, gpus, locks.try_sleep(gpus), locks.sleep(gpus), tx)
        .await
}

/// Holds off sleeps on `gpus` while `model`'s wake (or CUDA restore)
/// allocates there.
pub(super) async fn hold_off_sleeps(
    shared: &super::Shared,
    model: &str,
    gpus: &[u32],
    tx: &mpsc::UnboundedSender<Msg>,
) -> crate::supervisor::WakeGuards {
    let turn = Turn {
        what: "wake",
        of: "a neighbour going to sleep",
        because: SLEEP_FAILS,
    };
    let locks = &shared.locks;
    turn.wait(model, gpus, locks.try_wake(gpus), locks.wake(gpus), tx)
        .await
}

const SLEEP_FAILS: &str = "vLLM fails a sleep whose GPU's memory use grows meanwhile";

/// `what` a model does on its GPUs waits for `of` there, `because`.
struct Turn<'a> {
    what: &'a str,
    of: &'a str,
    because: &'a str,
}

impl Turn<'_> {
    /// The guards `now` holds, else those `take` waits for (the model's
    /// status says what for meanwhile), at most
    /// [`crate::reconciler::ROOM_WAIT`]: after that it goes on without
    /// (what it waits for is stuck, and the model's own deadline would
    /// run out).
    async fn wait<G>(
        &self,
        model: &str,
        gpus: &[u32],
        now: Option<Vec<G>>,
        take: impl std::future::Future<Output = Vec<G>>,
        tx: &mpsc::UnboundedSender<Msg>,
    ) -> Vec<G> {
        if let Some(g) = now {
            return g;
        }
        let Turn { what, of, because } = self;
        let on: Vec<String> = gpus.iter().map(u32::to_string).collect();
        let waiting = format!(
            "{of} on GPU {} ({because}): the {what} waits for it",
            on.join(", ")
        );
        tracing::info!(model = %model, gpus = ?gpus, "{what} waits for {of} on its GPUs");
        let _ = tx.send(Msg::WaitingFor(Some(waiting)));
        let held = tokio::time::timeout(crate::reconciler::ROOM_WAIT, take).await;
        let _ = tx.send(Msg::WaitingFor(None));
        held.unwrap_or_else(|_| {
            tracing::warn!(model = %model, "{of} on its GPUs for {:?}: the {what} goes on anyway", crate::reconciler::ROOM_WAIT);
            Vec::new()
        })
    }
}
