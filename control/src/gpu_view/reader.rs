//! NVML read on a thread of its own, waited for with a deadline.
//!
//! An NVML call can block for ever: a GPU that fell off the bus (`Xid 79`)
//! or a driver stuck in a reset leaves `nvmlDeviceGetComputeRunningProcesses`
//! waiting in the kernel. Read on the caller's thread, behind the view's
//! lock, one such call stopped admission (every wake and start), `ListGpus`,
//! `GetPlacement` and the status page for as long as NVML did. Here each
//! read runs on a `siesta-nvml` thread; a caller waits for its answer up to
//! [`NVML_ANSWER_WAIT`] from when that read began, then goes on with the
//! last good snapshot, told how long NVML has been silent. One read at a
//! time: while one is out, callers wait for that one (a hung read is not
//! joined by a second thread), and once it is past its deadline they do not
//! wait at all.

use crate::gpu::{GpuSource, Inventory};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a caller waits for NVML's answer, counted from when the read
/// began. NVML answers in milliseconds; two seconds is a hang.
pub(crate) const NVML_ANSWER_WAIT: Duration = Duration::from_secs(2);

/// What a read gave.
#[derive(Debug)]
pub(super) enum Read {
    /// The source is the config's `[[gpu]]` list: nothing to read.
    Listed,
    /// NVML answered.
    Fresh(Inventory),
    /// NVML has not answered this read, begun this long ago.
    Late(Duration),
}

/// One read in flight, and its answer once there.
#[derive(Debug)]
struct Pending {
    since: Instant,
    answer: Mutex<Option<Inventory>>,
    done: Condvar,
}

/// The GPU source, read one read at a time on a thread of its own.
#[derive(Debug)]
pub(super) struct Reader {
    source: Arc<Mutex<GpuSource>>,
    /// Whether `source` reads the GPUs now (kept here: asking the source
    /// would wait behind a hung read).
    live: AtomicBool,
    pending: Arc<Mutex<Option<Arc<Pending>>>>,
}

impl Reader {
    pub(super) fn new(source: GpuSource) -> Self {
        Self {
            live: AtomicBool::new(source.reads_live()),
            source: Arc::new(Mutex::new(source)),
            pending: Arc::default(),
        }
    }

    /// Whether a read asks NVML (the inventory moves on its own).
    pub(super) fn reads_live(&self) -> bool {
        self.live.load(Ordering::Relaxed)
    }

    /// Reads the GPUs, waiting for the answer up to `wait` from when the
    /// read began (a read already out is joined, not doubled). Blocking.
    pub(super) fn read(&self, wait: Duration) -> Read {
        if !self.reads_live() {
            return Read::Listed;
        }
        let pending = self.pending_or_start();
        let left = (pending.since + wait).saturating_duration_since(Instant::now());
        let answer = pending.answer.lock().unwrap();
        let (answer, _) = pending
            .done
            .wait_timeout_while(answer, left, |a| a.is_none())
            .unwrap();
        match answer.as_ref() {
            Some(inv) => Read::Fresh(inv.clone()),
            None => Read::Late(pending.since.elapsed()),
        }
    }

    /// The read in flight, or a new one begun on a `siesta-nvml` thread.
    fn pending_or_start(&self) -> Arc<Pending> {
        let mut slot = self.pending.lock().unwrap();
        if let Some(p) = slot.as_ref() {
            return p.clone();
        }
        let p = Arc::new(Pending {
            since: Instant::now(),
            answer: Mutex::new(None),
            done: Condvar::new(),
        });
        let (source, mine, slot_of) = (self.source.clone(), p.clone(), self.pending.clone());
        let spawned = std::thread::Builder::new()
            .name("siesta-nvml".into())
            .spawn(move || {
                let inv = source.lock().unwrap().snapshot();
                // The next caller starts a new read; this one's waiters
                // take its answer.
                *slot_of.lock().unwrap() = None;
                *mine.answer.lock().unwrap() = Some(inv);
                mine.done.notify_all();
            });
        match spawned {
            Ok(_) => *slot = Some(p.clone()),
            Err(e) => {
                // No thread (out of them): read here, as before.
                tracing::warn!(error = %e, "no thread for an NVML read: reading on the caller's");
                *p.answer.lock().unwrap() = Some(self.source.lock().unwrap().snapshot());
            }
        }
        p
    }

    /// Reads from `gpus` from now on, as from NVML (tests).
    #[cfg(test)]
    pub(super) fn script(&self, gpus: Arc<Mutex<Vec<crate::gpu::GpuInfo>>>) {
        *self.source.lock().unwrap() = GpuSource::Scripted(gpus);
        self.live.store(true, Ordering::Relaxed);
    }
}
