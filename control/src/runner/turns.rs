//! Taking turns on a GPU with the neighbours: vLLM fails a start whose GPU
//! frees memory while it profiles, and a sleep whose GPU's memory use
//! grows meanwhile, so a model's sleep, stop or suspend holds off starts
//! there, its sleep holds off wakes, and its wake holds off sleeps (see
//! `GpuLocks`). An engine call made holding a turn keeps it until the
//! engine has answered, even when the op that made it was called off.

use super::Msg;
use crate::engine::EngineError;
use crate::reconciler::ROOM_WAIT;
use crate::supervisor::{FreeGuards, SleepGuards, WakeGuards};
use tokio::sync::mpsc;
use tokio::time::Instant;

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
) -> FreeGuards {
    let turn = Turn {
        what,
        of: "an engine starting",
        because: "vLLM fails a start whose GPU frees memory while it profiles",
    };
    let locks = &shared.locks;
    let until = Instant::now() + ROOM_WAIT;
    turn.wait(
        model,
        gpus,
        locks.try_free(gpus),
        locks.free(gpus),
        tx,
        until,
    )
    .await
}

/// A sleep's turns on `gpus`: no start there (the memory it frees would
/// fail that start), then no wake (vLLM fails a sleep whose GPU's memory
/// use grows meanwhile: "Memory usage increased after sleeping"; see
/// `GpuLocks`). Both waits together end within [`ROOM_WAIT`], what the
/// sleep's deadline allows before its engine is asked: each had it whole,
/// so a neighbour's start of 4 minutes and then another's wake of 4 made
/// a sleep wait 8, its deadline ran out and a healthy engine was killed.
pub(super) async fn sleep_turns(
    shared: &super::Shared,
    model: &str,
    gpus: &[u32],
    tx: &mpsc::UnboundedSender<Msg>,
) -> (FreeGuards, SleepGuards) {
    let until = Instant::now() + ROOM_WAIT;
    let free = hold_off_starts(shared, model, "sleep", gpus, tx).await;
    let quiet = hold_off_wakes(shared, model, gpus, tx, until).await;
    (free, quiet)
}

/// Holds off wakes on `gpus` while `model` sleeps there, waiting until
/// `until` at most.
async fn hold_off_wakes(
    shared: &super::Shared,
    model: &str,
    gpus: &[u32],
    tx: &mpsc::UnboundedSender<Msg>,
    until: Instant,
) -> SleepGuards {
    let turn = Turn {
        what: "sleep",
        of: "a neighbour waking",
        because: SLEEP_FAILS,
    };
    let locks = &shared.locks;
    turn.wait(
        model,
        gpus,
        locks.try_sleep(gpus),
        locks.sleep(gpus),
        tx,
        until,
    )
    .await
}

/// Holds off sleeps on `gpus` while `model`'s wake (or CUDA restore)
/// allocates there.
pub(super) async fn hold_off_sleeps(
    shared: &super::Shared,
    model: &str,
    gpus: &[u32],
    tx: &mpsc::UnboundedSender<Msg>,
) -> WakeGuards {
    let turn = Turn {
        what: "wake",
        of: "a neighbour going to sleep",
        because: SLEEP_FAILS,
    };
    let locks = &shared.locks;
    let until = Instant::now() + ROOM_WAIT;
    turn.wait(
        model,
        gpus,
        locks.try_wake(gpus),
        locks.wake(gpus),
        tx,
        until,
    )
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
    /// status says what for meanwhile) until `until` at most
    /// ([`ROOM_WAIT`] from the op's start): after that it goes on without
    /// (what it waits for is stuck, and the model's own deadline would
    /// run out).
    async fn wait<G>(
        &self,
        model: &str,
        gpus: &[u32],
        now: Option<Vec<G>>,
        take: impl std::future::Future<Output = Vec<G>>,
        tx: &mpsc::UnboundedSender<Msg>,
        until: Instant,
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
        let began = Instant::now();
        let held = tokio::time::timeout_at(until, take).await;
        let _ = tx.send(Msg::WaitingFor(None));
        held.unwrap_or_else(|_| {
            tracing::warn!(model = %model, waited = ?began.elapsed(), "{of} on its GPUs past the {what}'s wait for room: it goes on anyway");
            Vec::new()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A sleep that waits for a neighbour's start (4 minutes), then for
    /// another's wake (4 more), asks its engine within [`ROOM_WAIT`] of its
    /// start, as its deadline allows: without the wake's turn once the
    /// time is out, never after 8 minutes.
    #[tokio::test(start_paused = true)]
    async fn a_sleeps_waits_for_a_start_then_a_wake_end_within_the_room_wait() {
        let dir = tempfile::tempdir().unwrap();
        let shared = crate::runner::tests::shared(dir.path());
        let start = shared.locks.acquire(&[0]).await;
        let wake = shared.locks.wake(&[0]).await;
        fn held_for<G: Send + 'static>(guards: G, secs: u64) {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(secs)).await;
                drop(guards);
            });
        }
        held_for(start, 240);
        held_for(wake, 480);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let began = Instant::now();
        let (free, quiet) = sleep_turns(&shared, "a", &[0], &tx).await;
        let waited = began.elapsed();
        assert!(
            waited >= Duration::from_secs(240) && waited <= ROOM_WAIT,
            "{waited:?}"
        );
        assert_eq!(free.len(), 1, "the start's end was waited for");
        assert!(
            quiet.is_empty(),
            "the wake's was not, once the time was out"
        );
        let said: Vec<String> = std::iter::from_fn(|| rx.try_recv().ok())
            .filter_map(|m| match m {
                Msg::WaitingFor(Some(w)) => Some(w),
                _ => None,
            })
            .collect();
        assert!(
            said[0].contains("an engine starting") && said[1].contains("a neighbour waking"),
            "{said:?}"
        );
    }
}
