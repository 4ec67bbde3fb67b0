//! The end of a draining sleep (`/sleep?mode=wait`), as vLLM's engine core
//! has it: the pause's future completes in the busy loop's turn that found
//! the scheduler without work, and its callback sleeps the executor there
//! and then (`EngineCore.sleep`, `pause_complete`). No call queued behind
//! the last step (a `/wake_up` sent the moment the gauge read 0) runs in
//! between: it finds the executor asleep, or its sleep under way.
//!
//! Here the request that ends last hands the engine core's operation lock
//! straight to the waiting sleep, before the gauge reads 0. Before, the
//! sleep polled the gauge every 5 ms and then queued for the lock: a wake
//! sent in that gap (a long one on a loaded box) ran first, resumed the
//! scheduler, and the sleep then freed the memory the wake had left awake.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::{OwnedMutexGuard, oneshot};

use super::Engine;

/// The engine core's operation lock, held.
pub(crate) type Op = OwnedMutexGuard<()>;

/// Sleeps waiting for the requests in flight to end.
pub(crate) type Drains = Vec<oneshot::Sender<Option<Op>>>;

impl Engine {
    /// Takes the engine core's operation lock (one sleep, wake, RPC or
    /// `/is_sleeping` at a time).
    pub(crate) async fn op(&self) -> Op {
        Arc::clone(&self.ops).lock_owned().await
    }

    /// A request starts producing tokens (`vllm:num_requests_running`).
    pub fn request_started(&self) {
        self.running.fetch_add(1, Ordering::SeqCst);
    }

    /// A request stops producing tokens. The last one hands the operation
    /// lock to the sleeps waiting for it, before the gauge reads 0.
    pub fn request_ended(&self) {
        let mut drains = self.drains.lock().unwrap();
        if self.running.load(Ordering::SeqCst) == 1 && !drains.is_empty() {
            // Held by a call already running (none can be, in vLLM's single
            // busy loop): the sleep queues for it as before.
            let mut op = Arc::clone(&self.ops).try_lock_owned().ok();
            for sleep in drains.drain(..) {
                let _ = sleep.send(op.take());
            }
        }
        self.running.fetch_sub(1, Ordering::SeqCst);
    }

    /// Waits until no request runs; the operation lock, taken at that
    /// instant (or at once, when none runs).
    pub(crate) async fn drained(&self) -> Op {
        let handed = {
            let mut drains = self.drains.lock().unwrap();
            if self.running.load(Ordering::SeqCst) == 0 {
                None
            } else {
                let (tx, rx) = oneshot::channel();
                drains.push(tx);
                Some(rx)
            }
        };
        match handed {
            Some(rx) => match rx.await {
                Ok(Some(op)) => op,
                _ => self.op().await,
            },
            None => self.op().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use crate::engine::SleepMode;
    use crate::memory::HostMemory;
    use clap::Parser;
    use std::time::Duration;

    fn engine() -> Arc<Engine> {
        let cli = Cli::try_parse_from(["fake-vllm", "serve", "m", "--enable-sleep-mode"]).unwrap();
        let Command::Serve(args) = cli.command else {
            unreachable!()
        };
        Arc::new(Engine::new(*args, Box::new(HostMemory::new(1 << 16)), None))
    }

    /// A wake sent the moment the last request of a drain ends runs after
    /// the sleep, as in vLLM's single busy loop: it wakes the executor and
    /// resumes the scheduler. It never runs first, leaving the sleep to free
    /// the memory under a running scheduler.
    #[tokio::test]
    async fn a_wake_sent_as_a_drain_ends_runs_after_the_sleep() {
        let e = engine();
        e.request_started();
        let sleep = tokio::spawn({
            let e = e.clone();
            async move { e.sleep(1, SleepMode::Wait).await }
        });
        tokio::time::timeout(Duration::from_secs(30), async {
            while e.drains.lock().unwrap().is_empty() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the sleep to wait for the drain");
        assert!(e.sleep_state().is_sleeping(), "paused at once");
        e.request_ended();
        let woken = e.wake(None).await.unwrap();
        sleep.await.unwrap().unwrap();
        assert!(woken.fully_awake);
        assert!(
            !e.executor_freed(),
            "the sleep freed the memory after the wake"
        );
        assert!(!e.sleep_state().is_sleeping());
        assert_eq!(
            e.wakes.load(Ordering::SeqCst),
            1,
            "the wake found it asleep"
        );
    }
}
