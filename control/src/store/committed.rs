//! A queued write's handle: who must not go on before the write is
//! durable waits on it ([`Committed::wait`]), asynchronously from a task.

use futures::channel::oneshot;
use std::time::Duration;

/// A queued write: durable once [`Committed::wait`] says true.
#[derive(Debug)]
#[must_use = "a write not waited for may not be durable yet; drop it to not wait"]
pub struct Committed(pub(super) Option<oneshot::Receiver<bool>>);

impl Committed {
    /// Nothing was queued (the record was already there): durable.
    pub(super) fn already() -> Committed {
        Committed(None)
    }

    /// A write that could not be queued (its record not encodable).
    pub(super) fn failed() -> Committed {
        let (_, rx) = oneshot::channel();
        Committed(Some(rx))
    }

    #[cfg(test)]
    pub(super) fn is_already(&self) -> bool {
        self.0.is_none()
    }

    /// True once durable; false when the commit failed (logged), or did not
    /// end within [`COMMIT_WAIT`]. On a
    /// current-thread runtime the thread blocks for it instead (a
    /// millisecond, as every write did before): the wait is on another
    /// thread, which such a runtime takes for idleness, and under paused
    /// time (the model tasks' tests) its clock would jump to the next timer
    /// while the write is under way.
    pub async fn wait(self) -> bool {
        self.wait_within(COMMIT_WAIT).await
    }

    /// [`Self::wait`], giving up (false) after `limit` on a multi-threaded
    /// runtime: the write stays queued and lands when the disk answers.
    pub(super) async fn wait_within(self, limit: Duration) -> bool {
        let Some(rx) = self.0 else {
            return true;
        };
        let current_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
        if current_thread {
            return futures::executor::block_on(rx).unwrap_or(false);
        }
        match tokio::time::timeout(limit, rx).await {
            Ok(done) => done.unwrap_or(false),
            Err(_) => {
                tracing::error!(
                    waited = ?limit,
                    "state store: a write not committed in time (does state_dir's disk answer?); \
                     going on without waiting for it (it stays queued)"
                );
                false
            }
        }
    }

    /// The same, blocking the thread (outside a task, or rare writes: on a
    /// multi-threaded runtime the worker's place is handed on meanwhile).
    #[cfg(test)]
    pub fn wait_blocking(self) -> bool {
        let Some(rx) = self.0 else {
            return true;
        };
        let wait = || futures::executor::block_on(rx).unwrap_or(false);
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(wait)
            }
            _ => wait(),
        }
    }
}

/// How long a task waits for its write's commit: a disk that stops answering
/// (a hung network mount) would stop a model's task for as long, deadlines
/// and all; after this it goes on as after a failed write, saying so.
pub const COMMIT_WAIT: Duration = Duration::from_secs(30);
