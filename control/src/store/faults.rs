//! Test-only: a store file whose writes fail on demand, as on a disk that
//! is full (ENOSPC) for a while. The real file backend underneath; only
//! writes, growth and syncs are refused while armed.

use redb::StorageBackend;
use redb::backends::FileBackend;
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

/// Per store file (tests run in parallel, each in its own directory).
/// Writes still to fail: 0 none, below 0 every one.
static ARMED: Mutex<BTreeMap<PathBuf, Arc<AtomicI64>>> = Mutex::new(BTreeMap::new());

fn switch(path: &Path) -> Arc<AtomicI64> {
    ARMED
        .lock()
        .unwrap()
        .entry(path.to_path_buf())
        .or_default()
        .clone()
}

/// From now on, until disarmed, every write to the store file at `path`
/// fails with "no space left on device".
pub(crate) fn disk_full(path: &Path, full: bool) {
    switch(path).store(if full { -1 } else { 0 }, Ordering::SeqCst);
}

/// The next write to the store file at `path` fails, and only that one (a
/// disk full for a moment).
pub(crate) fn fail_next_write(path: &Path) {
    switch(path).store(1, Ordering::SeqCst);
}

/// The store file at `path` (its `FileBackend`), made to fail on demand.
pub(super) fn faulty(path: &Path, inner: FileBackend) -> impl StorageBackend {
    Faulty {
        inner,
        full: switch(path),
    }
}

#[derive(Debug)]
struct Faulty {
    inner: FileBackend,
    full: Arc<AtomicI64>,
}

impl Faulty {
    fn check(&self) -> io::Result<()> {
        let left = self
            .full
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n > 0).then(|| n - 1)
            })
            .unwrap_or_else(|n| n);
        if left != 0 {
            // ENOSPC
            Err(io::Error::from_raw_os_error(28))
        } else {
            Ok(())
        }
    }
}

impl StorageBackend for Faulty {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        self.inner.read(offset, len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.check()?;
        self.inner.set_len(len)
    }

    fn sync_data(&self, eventual: bool) -> io::Result<()> {
        self.check()?;
        self.inner.sync_data(eventual)
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }
}
