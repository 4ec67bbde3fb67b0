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
//! record's); every waiter of a failed round is told false, and its writes
//! stay queued (read back, the newest per key) until a later round commits
//! them, one tried every second unasked: the file ends at the latest record
//! of every key once the disk has room, without another write.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
#[cfg(test)]
use std::time::Duration;

use super::Db;
pub use super::committed::Committed;
use futures::channel::oneshot;

use super::ops::newest_per_key;
pub(super) use super::ops::{Op, Table};

/// How often a store closed by a failed reopen, or the writes a failed
/// round left, are tried again while nothing is written.
const REOPEN_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Default)]
struct Queue {
    /// Queued since the writer last took them, in order; at their front,
    /// what failed rounds left (the newest per key), until a round commits.
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
    /// Told at the end of every round, for the tests.
    #[cfg(test)]
    round_ended: Condvar,
}

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
    /// since the last one in one transaction. A round that fails leaves
    /// its writes queued, ahead of those queued since and the newest per
    /// key ([`newest_per_key`]): they are read back, tried again with the
    /// next write or every [`REOPEN_EVERY`] unasked, and once before the
    /// writer ends. (They were dropped before: after a full disk the file
    /// kept the record from before until the model wrote again.)
    pub(super) fn run(&self, db: &Db) {
        // However the writer ends (a panic in redb included), the queue
        // closes and whoever waits, or writes later, is told false: no
        // model task waits for ever on a writer that is gone.
        let _closes = CloseOnExit(self);
        let mut tried_at_close = false;
        // A round failed since the last commit: the next one that commits
        // says so (the errors stopping is no sign an operator can read).
        let mut failing = false;
        loop {
            let (ops, waiters) = {
                let mut q = self.queue.lock().unwrap();
                loop {
                    if !q.waiters.is_empty() {
                        break;
                    }
                    if q.closed {
                        if q.ops.is_empty() || tried_at_close {
                            return;
                        }
                        tried_at_close = true;
                        break;
                    }
                    if db.is_open() && q.ops.is_empty() {
                        q = self.wake.wait(q).unwrap();
                        continue;
                    }
                    // Writes of a failed round left, or closed by a reopen
                    // that failed (the disk still full): tried again unasked.
                    let (next, waited) = self.wake.wait_timeout(q, REOPEN_EVERY).unwrap();
                    q = next;
                    if !waited.timed_out() || !q.waiters.is_empty() || q.closed {
                        continue;
                    }
                    if !q.ops.is_empty() {
                        break;
                    }
                    drop(q);
                    db.reopen();
                    q = self.queue.lock().unwrap();
                }
                #[cfg(test)]
                {
                    drop(q);
                    drop(self.pause());
                    q = self.queue.lock().unwrap();
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
            if !ok {
                failing = true;
            } else if failing && !ops.is_empty() {
                failing = false;
                tracing::info!(path = %db.path().display(), writes = ops.len(),
                    "state store writes that had failed are written now (durable)");
            }
            {
                let mut q = self.queue.lock().unwrap();
                q.committing = Arc::default();
                q.rounds += 1;
                if !ok {
                    // Under the same hold of the lock: no read sees them gone.
                    let mut kept = Arc::unwrap_or_clone(ops);
                    kept.append(&mut q.ops);
                    q.ops = newest_per_key(kept);
                }
                #[cfg(test)]
                self.round_ended.notify_all();
            }
            for w in waiters {
                let _ = w.send(ok);
            }
        }
    }

    /// What `table` holds: `file()` (what the file holds), with what is
    /// committing and queued applied over it. The file is read outside the
    /// queue's lock and stands if no round ended meanwhile (one that did
    /// may have taken writes off the queue that the read did not see):
    /// read again otherwise, at most [`READS_OUTSIDE`] times, then under
    /// the lock, as in [`Writes::submit_if`].
    pub(super) fn overlaid<E>(
        &self,
        table: Table,
        file: impl Fn() -> Result<BTreeMap<String, Vec<u8>>, E>,
    ) -> Result<BTreeMap<String, Vec<u8>>, E> {
        let mut reads = 0;
        loop {
            let rounds = self.queue.lock().unwrap().rounds;
            let (q, mut all) = if reads == READS_OUTSIDE {
                let q = self.queue.lock().unwrap();
                let all = file()?;
                (q, all)
            } else {
                reads += 1;
                let all = file()?;
                let q = self.queue.lock().unwrap();
                if q.rounds != rounds {
                    continue;
                }
                (q, all)
            };
            for op in q.committing.iter().chain(&q.ops) {
                op.apply(table, &mut all);
            }
            return Ok(all);
        }
    }

    /// Waits until nothing is queued or committing (false after `limit`).
    #[cfg(test)]
    pub(super) fn wait_until_written(&self, limit: Duration) -> bool {
        let q = self.queue.lock().unwrap();
        let (_q, waited) = self
            .round_ended
            .wait_timeout_while(q, limit, |q| !q.ops.is_empty() || !q.committing.is_empty())
            .unwrap();
        !waited.timed_out()
    }

    /// How many writes are queued (failed ones kept included).
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.queue.lock().unwrap().ops.len()
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
        if !q.ops.is_empty() {
            let what: Vec<String> = q.ops.iter().take(8).map(Op::describe).collect();
            tracing::error!(writes = q.ops.len(), first = %what.join(", "),
                "state store: writes that failed could not be written before the writer ended (lost)");
        }
        q.ops.clear();
        q.committing = Arc::default();
        q.rounds += 1;
        q.waiters.clear();
    }
}

/// Commits `ops`; after a failure reopens the file and tries once more (a
/// disk full for a moment loses nothing; one still full fails this round,
/// its writes stay queued, and the next round tries again on a reopened
/// file).
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
