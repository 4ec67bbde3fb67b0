//! The store's one writer: a thread (`siesta-store`) that commits every
//! write queued since its last commit as one durable transaction (a group
//! commit), then tells each writer that its write is durable.
//!
//! Why: redb takes one write transaction at a time, and each durable
//! commit waits for the disk (an fsync, a millisecond or more). Before,
//! each model task wrote its record itself, in `block_in_place`: at the
//! start of a daemon with 1,000 models, 1,000 tasks each waited in turn
//! for the lock and a commit of their own, and every one of them waiting
//! handed its runtime worker's place to a new thread (514 threads in the
//! first second, their stacks and allocator arenas 30 MB of the daemon's
//! memory, seconds of commits one after another). Now a write is queued
//! in microseconds; those who must not go on before it is durable wait
//! for it (asynchronously from a task, [`Committed::wait`]), and the rest
//! do not wait at all.
//!
//! Reads see queued writes (`latest`): a record written and then read is
//! the one written, committed or not. The writes of one round succeed or
//! fail together (redb's errors are the disk's or the file's, not one
//! record's); every waiter of a failed round is told false.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::Db;
use futures::channel::oneshot;
use redb::{TableDefinition, TableHandle};

pub(super) type Table = TableDefinition<'static, &'static str, &'static [u8]>;

/// How often a store closed by a failed reopen is tried again while
/// nothing is written.
const REOPEN_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// One change to one key.
#[derive(Clone)]
pub(super) enum Op {
    Put {
        table: Table,
        key: String,
        value: Vec<u8>,
    },
    Delete {
        tables: Vec<Table>,
        key: String,
    },
}

impl Op {
    /// What this change leaves at `table`/`key`: `Some(None)` deleted,
    /// `Some(Some(bytes))` written, `None` untouched.
    fn leaves(&self, table: Table, key: &str) -> Option<Option<&[u8]>> {
        match self {
            Op::Put {
                table: t,
                key: k,
                value,
            } if t.name() == table.name() && k == key => Some(Some(value)),
            Op::Delete { tables, key: k }
                if k == key && tables.iter().any(|t| t.name() == table.name()) =>
            {
                Some(None)
            }
            _ => None,
        }
    }

    fn describe(&self) -> String {
        match self {
            Op::Put { table, key, .. } => format!("{}/{key}", table.name()),
            Op::Delete { tables, key } => {
                let names: Vec<&str> = tables.iter().map(|t| t.name()).collect();
                format!("delete {}/{key}", names.join("+"))
            }
        }
    }
}

#[derive(Default)]
struct Queue {
    /// Queued since the writer last took them, in order.
    ops: Vec<Op>,
    /// Being committed now (still what reads see, until committed).
    committing: Arc<Vec<Op>>,
    /// Told when the queued writes are durable (or failed).
    waiters: Vec<oneshot::Sender<bool>>,
    /// Rounds ended (committed or failed): what the file holds may have
    /// changed when this has.
    rounds: u64,
    closed: bool,
}

/// The queue, shared by the store's handles and its writer thread.
#[derive(Default)]
pub(super) struct Writes {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Transactions committed (or tried), for the tests.
    #[cfg(test)]
    commits: std::sync::atomic::AtomicU64,
    /// Held by a test: the writer takes nothing from the queue meanwhile.
    #[cfg(test)]
    paused: Mutex<()>,
}

/// A queued write: durable once [`Committed::wait`] says true.
#[derive(Debug)]
#[must_use = "a write not waited for may not be durable yet; drop it to not wait"]
pub struct Committed(Option<oneshot::Receiver<bool>>);

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

/// How many times [`Writes::submit_if`] reads the file outside the queue's
/// lock before it reads it under the lock.
pub(super) const READS_OUTSIDE: u32 = 3;

impl Writes {
    /// Queues `ops` (in order, after every write queued before).
    pub(super) fn submit(&self, ops: Vec<Op>) -> Committed {
        let q = self.queue.lock().unwrap();
        self.push(q, ops)
    }

    /// Queues `op` only if `keep` holds of what `at` (table, key) holds
    /// now: the latest queued or committing write's, or else `committed()`
    /// (the file's). The look and the queueing happen under one hold of
    /// the queue's lock, so no write comes between them. The file is read
    /// outside it (a read waits while the writer reopens the file, and
    /// every writer would wait with it); that read stands if, under the
    /// lock again, nothing of `at` is queued or committing and no round
    /// has ended since: the file is then as read. Otherwise it is read
    /// again, at most [`READS_OUTSIDE`] times; after that (rounds ending
    /// during every read, as when many engines exit at once) under the
    /// lock, so that it ends. `None` when not queued.
    pub(super) fn submit_if(
        &self,
        at: (Table, &str),
        keep: impl FnOnce(Option<&[u8]>) -> bool,
        committed: impl Fn() -> Option<Vec<u8>>,
        op: Op,
    ) -> Option<Committed> {
        let mut read: Option<(u64, Option<Vec<u8>>)> = None;
        let mut reads = 0;
        loop {
            let q = self.queue.lock().unwrap();
            let now = match (latest_in(&q, at.0, at.1), read.take()) {
                (Some(queued), _) => queued.map(<[u8]>::to_vec),
                (None, Some((rounds, file))) if rounds == q.rounds => file,
                (None, _) if reads == READS_OUTSIDE => committed(),
                (None, _) => {
                    reads += 1;
                    let rounds = q.rounds;
                    drop(q);
                    read = Some((rounds, committed()));
                    continue;
                }
            };
            return keep(now.as_deref()).then(|| self.push(q, vec![op]));
        }
    }

    fn push(&self, mut q: std::sync::MutexGuard<'_, Queue>, ops: Vec<Op>) -> Committed {
        let (tx, rx) = oneshot::channel();
        if q.closed {
            return Committed(Some(rx));
        }
        q.ops.extend(ops);
        q.waiters.push(tx);
        drop(q);
        self.wake.notify_one();
        Committed(Some(rx))
    }

    /// What the latest queued or committing write left at `table`/`key`:
    /// `None` when none touches it (the database has the latest).
    pub(super) fn latest(&self, table: Table, key: &str) -> Option<Option<Vec<u8>>> {
        let q = self.queue.lock().unwrap();
        latest_in(&q, table, key).map(|v| v.map(<[u8]>::to_vec))
    }

    /// Keeps the writer from taking anything queued until dropped.
    #[cfg(test)]
    pub(super) fn pause(&self) -> std::sync::MutexGuard<'_, ()> {
        self.paused.lock().unwrap()
    }

    #[cfg(test)]
    pub(super) fn commits(&self) -> u64 {
        self.commits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Ends the writer once what is queued is committed.
    pub(super) fn close(&self) {
        self.queue.lock().unwrap().closed = true;
        self.wake.notify_one();
    }

    /// The writer thread's loop: every round commits all that was queued
    /// since the last one in one transaction.
    pub(super) fn run(&self, db: &Db) {
        // However the writer ends (a panic in redb included), the queue
        // closes and whoever waits, or writes later, is told false: no
        // model task waits for ever on a writer that is gone.
        let _closes = CloseOnExit(self);
        loop {
            let (ops, waiters) = {
                let mut q = self.queue.lock().unwrap();
                while q.waiters.is_empty() && !q.closed {
                    if db.is_open() {
                        q = self.wake.wait(q).unwrap();
                        continue;
                    }
                    // Closed by a reopen that failed (the disk still full):
                    // reads fail meanwhile, so it is tried again unasked.
                    q = self.wake.wait_timeout(q, REOPEN_EVERY).unwrap().0;
                    if q.waiters.is_empty() && !q.closed {
                        drop(q);
                        db.reopen();
                        q = self.queue.lock().unwrap();
                    }
                }
                #[cfg(test)]
                {
                    drop(q);
                    drop(self.pause());
                    q = self.queue.lock().unwrap();
                }
                if q.waiters.is_empty() {
                    return;
                }
                let ops = Arc::new(std::mem::take(&mut q.ops));
                q.committing = ops.clone();
                (ops, std::mem::take(&mut q.waiters))
            };
            let ok = if ops.is_empty() {
                // A flush: nothing to write, but reads want the file open.
                if !db.is_open() {
                    db.reopen();
                }
                true
            } else {
                #[cfg(test)]
                self.commits
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                commit_or_reopen(db, &ops)
            };
            {
                let mut q = self.queue.lock().unwrap();
                q.committing = Arc::default();
                q.rounds += 1;
            }
            for w in waiters {
                let _ = w.send(ok);
            }
        }
    }
}

fn latest_in<'q>(q: &'q Queue, table: Table, key: &str) -> Option<Option<&'q [u8]>> {
    q.ops
        .iter()
        .rev()
        .chain(q.committing.iter().rev())
        .find_map(|op| op.leaves(table, key))
}

struct CloseOnExit<'a>(&'a Writes);

impl Drop for CloseOnExit<'_> {
    fn drop(&mut self) {
        let mut q = self
            .0
            .queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        q.closed = true;
        q.ops.clear();
        q.committing = Arc::default();
        q.rounds += 1;
        q.waiters.clear();
    }
}

/// Commits `ops`; after a failure reopens the file and tries once more (a
/// disk full for a moment loses nothing; one still full fails this round,
/// and the next round tries again on a reopened file).
fn commit_or_reopen(db: &Db, ops: &[Op]) -> bool {
    if db.is_open() && commit(db, ops) {
        return true;
    }
    db.reopen() && commit(db, ops)
}

/// One durable transaction applying `ops` in order.
fn commit(db: &Db, ops: &[Op]) -> bool {
    let path = db.path();
    let run = || -> Result<(), redb::Error> {
        let tx = db.begin_write()?;
        for op in ops {
            match op {
                Op::Put { table, key, value } => {
                    tx.open_table(*table)?
                        .insert(key.as_str(), value.as_slice())?;
                }
                Op::Delete { tables, key } => {
                    for t in tables {
                        tx.open_table(*t)?.remove(key.as_str())?;
                    }
                }
            }
        }
        tx.commit()?;
        Ok(())
    };
    match run() {
        Ok(()) => true,
        Err(e) => {
            let what: Vec<String> = ops.iter().take(8).map(Op::describe).collect();
            tracing::error!(path = %path.display(), writes = ops.len(), first = %what.join(", "),
                error = %e, "state store write failed");
            false
        }
    }
}
