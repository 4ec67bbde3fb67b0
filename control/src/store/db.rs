//! The open store file, and reopening it after a failed write.

// redb's own error type is large; it only travels inside this module.
#![allow(clippy::result_large_err)]

use super::open::{Opened, try_open};
use super::writer::Table;
use super::{CALIBRATION, ENGINES, INTENTS, StoreError};
use redb::{Database, ReadableTable, TableHandle, WriteTransaction};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

/// Every record of the tables read by key, by table name then key.
type Snapshot = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

enum File {
    Open(Database),
    /// Closed by a reopen that failed: reads are answered from what the
    /// file held when it was closed (a read taken for "no record" would
    /// start a model from its preload, dropping an operator's stop or pin),
    /// if it could be read then.
    Closed(Option<Snapshot>),
}

/// The open store file. After an I/O error (a disk full for a moment)
/// redb refuses every later write until the file is reopened ("Previous
/// I/O error occurred"): the writer reopens it ([`Db::reopen`]), and reads
/// go on meanwhile from what is open, or, while a reopen fails, from what
/// the file held when it was closed.
pub(super) struct Db {
    path: PathBuf,
    file: RwLock<File>,
}

impl Db {
    pub(super) fn new(path: PathBuf, db: Database) -> Db {
        Db {
            path,
            file: RwLock::new(File::Open(db)),
        }
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    pub(super) fn begin_write(&self) -> Result<WriteTransaction, redb::Error> {
        match &*self.read_lock() {
            File::Open(db) => Ok(db.begin_write()?),
            File::Closed(_) => Err(closed()),
        }
    }

    /// What the file holds at `table`/`key`.
    pub(super) fn get(&self, table: Table, key: &str) -> Result<Option<Vec<u8>>, redb::Error> {
        match &*self.read_lock() {
            File::Open(db) => {
                let tx = db.begin_read()?;
                let t = tx.open_table(table)?;
                Ok(t.get(key)?.map(|v| v.value().to_vec()))
            }
            File::Closed(Some(held)) => {
                Ok(held.get(table.name()).and_then(|t| t.get(key)).cloned())
            }
            File::Closed(None) => Err(closed()),
        }
    }

    /// Every record the file holds in `table`.
    pub(super) fn all(&self, table: Table) -> Result<BTreeMap<String, Vec<u8>>, redb::Error> {
        match &*self.read_lock() {
            File::Open(db) => read_table(db, table),
            File::Closed(Some(held)) => Ok(held.get(table.name()).cloned().unwrap_or_default()),
            File::Closed(None) => Err(closed()),
        }
    }

    fn read_lock(&self) -> std::sync::RwLockReadGuard<'_, File> {
        self.file
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Closes the file and opens it again (redb repairs what a failed
    /// commit left); false, and closed until the next try, when it cannot.
    /// Only the writer calls it.
    pub(super) fn reopen(&self) -> bool {
        let mut file = self
            .file
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Closed first: the file is locked while open, and while a read
        // begun before is still under way (for microseconds). What it
        // holds is kept for the reads while it is closed.
        let held = match std::mem::replace(&mut *file, File::Closed(None)) {
            File::Open(db) => snapshot(&db)
                .inspect_err(|e| {
                    tracing::error!(path = %self.path.display(), error = %e,
                        "state store could not be read before it was reopened: reads fail until it is")
                })
                .ok(),
            File::Closed(held) => held,
        };
        let mut tries = 0;
        let opened = loop {
            match try_open(&self.path) {
                Err(StoreError::InUse(_)) if tries < 100 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                r => break r,
            }
        };
        match opened {
            Ok(Opened::Ok(db)) => {
                tracing::warn!(path = %self.path.display(), "state store reopened after a failed write");
                *file = File::Open(db);
                return true;
            }
            Ok(Opened::Reject { detail, .. }) => {
                tracing::error!(path = %self.path.display(), %detail,
                    "state store cannot be reopened after a failed write (tried again every second)");
            }
            Err(e) => {
                tracing::error!(error = %e,
                    "state store cannot be reopened after a failed write (tried again every second)");
            }
        }
        *file = File::Closed(held);
        false
    }

    /// Whether the file is open (not after a reopen that failed).
    pub(super) fn is_open(&self) -> bool {
        matches!(&*self.read_lock(), File::Open(_))
    }
}

fn read_table(db: &Database, table: Table) -> Result<BTreeMap<String, Vec<u8>>, redb::Error> {
    let tx = db.begin_read()?;
    let t = tx.open_table(table)?;
    let mut out = BTreeMap::new();
    for entry in t.iter()? {
        let (k, v) = entry?;
        out.insert(k.value().to_string(), v.value().to_vec());
    }
    Ok(out)
}

fn snapshot(db: &Database) -> Result<Snapshot, redb::Error> {
    [INTENTS, ENGINES, CALIBRATION]
        .into_iter()
        .map(|t| Ok((t.name().to_string(), read_table(db, t)?)))
        .collect()
}

fn closed() -> redb::Error {
    redb::Error::Io(std::io::Error::other(
        "closed after a failed write, and unreadable then; reopened every second",
    ))
}
