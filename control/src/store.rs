//! The state store: an embedded transactional database (redb) in the state
//! directory, `siesta.redb`. Writes are queued to one writer thread, which
//! commits all queued since its last commit as one durable transaction
//! (`writer.rs`); a caller that acts on a write waits until it is durable
//! (the blocking setters, or [`Committed::wait`]); reads see queued writes.
//! After a failed write (a full disk) the writer reopens the file, which
//! redb requires before it writes again (`db.rs`, [`db::Db`]), and keeps
//! the failed writes (the newest per key) queued, read back and tried
//! again until they commit: the store ends at the latest record of every
//! key without another write.
//!
//! Tables (keys are model names unless said otherwise; values JSON):
//! - `meta`: `schema_version` → [`SCHEMA_VERSION`].
//! - `intents`: [`IntentRecord`] — desired state, why, since, until, pin.
//! - `engines`: [`EngineRecord`] — pid, process group, port, start time, command hash.
//! - `calibration`: [`CalibrationRecord`] — measured start/sleep/wake durations.
//! - `p2p`: free-form key → bytes, for the last GPU peer-to-peer probe results.
//!
//! A store that cannot be read (corrupt) or was written by an incompatible
//! version is reported and moved aside (`siesta.redb.corrupt-<unix secs>`),
//! never silently reset; an unusable state directory is an error naming it.
// redb's own error type is large; it only travels inside this module.
#![allow(clippy::result_large_err)]

mod committed;
#[cfg(test)]
mod damage_tests;
mod db;
#[cfg(test)]
pub(crate) mod faults;
#[cfg(test)]
mod full_disk_tests;
mod open;
mod ops;
mod records;
#[cfg(test)]
mod tests;
mod writer;

use db::Db;
use open::{Opened, io, try_open, unix_secs};
pub use records::{CalibrationRecord, EngineRecord, IntentRecord};
pub use writer::Committed;
use writer::{Op, Table, Writes};

use redb::TableDefinition;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Version of the tables' layout; a store with another one is moved aside.
pub const SCHEMA_VERSION: u64 = 1;
/// The store's file name inside the state directory.
pub const FILE_NAME: &str = "siesta.redb";

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const INTENTS: TableDefinition<&str, &[u8]> = TableDefinition::new("intents");
const ENGINES: TableDefinition<&str, &[u8]> = TableDefinition::new("engines");
const CALIBRATION: TableDefinition<&str, &[u8]> = TableDefinition::new("calibration");

/// Why the store cannot be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state directory {} ([control] state_dir): {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "state store {} is in use by another process (another siesta-control with the same state_dir?)",
        .0.display()
    )]
    InUse(PathBuf),
    #[error("state store {}: {message}", path.display())]
    Db { path: PathBuf, message: String },
}

/// The store.
pub struct Store {
    path: PathBuf,
    db: Arc<Db>,
    writes: Arc<Writes>,
    /// The writer thread, joined (what is queued committed) on drop.
    writer: Option<std::thread::JoinHandle<()>>,
    #[cfg_attr(not(test), allow(dead_code))]
    moved_aside: Option<PathBuf>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl Store {
    /// Opens `state_dir/siesta.redb`, creating the directory (and `logs/`)
    /// and the store. A corrupt or incompatible store is moved aside and a
    /// fresh one started; the move is logged as an error and kept in
    /// [`Store::moved_aside`].
    pub fn open(state_dir: &Path) -> Result<Arc<Store>, StoreError> {
        std::fs::create_dir_all(state_dir).map_err(|e| io(state_dir, e))?;
        let logs = state_dir.join("logs");
        std::fs::create_dir_all(&logs).map_err(|e| io(&logs, e))?;
        let path = state_dir.join(FILE_NAME);
        let mut moved_aside = None;
        let db = match try_open(&path)? {
            Opened::Ok(db) => db,
            Opened::Reject { why, detail } => {
                let aside = state_dir.join(format!("{FILE_NAME}.{why}-{}", unix_secs()));
                std::fs::rename(&path, &aside).map_err(|e| io(&path, e))?;
                tracing::error!(path = %path.display(), moved_to = %aside.display(), %detail,
                    "state store is {why}: moved aside, starting a new one (intents and engine records in it are not used)");
                moved_aside = Some(aside);
                match try_open(&path)? {
                    Opened::Ok(db) => db,
                    Opened::Reject { detail, .. } => {
                        return Err(StoreError::Db {
                            path,
                            message: detail,
                        });
                    }
                }
            }
        };
        let db = Arc::new(Db::new(path.clone(), db));
        let writes = Arc::new(Writes::default());
        let writer = std::thread::Builder::new()
            .name("siesta-store".into())
            .spawn({
                let (db, writes) = (db.clone(), writes.clone());
                move || writes.run(&db)
            })
            .map_err(|e| io(&path, e))?;
        let store = Store {
            path,
            db,
            writes,
            writer: Some(writer),
            moved_aside,
        };
        Ok(Arc::new(store))
    }

    /// Waits until every write queued before is durable.
    pub async fn flush(&self) -> bool {
        self.writes.submit(Vec::new()).wait().await
    }

    /// Keeps the writer from committing anything until dropped.
    #[cfg(test)]
    pub fn pause_writes(&self) -> std::sync::MutexGuard<'_, ()> {
        self.writes.pause()
    }

    /// Where a corrupt or incompatible store was moved at open, if it was.
    #[cfg(test)]
    pub fn moved_aside(&self) -> Option<&Path> {
        self.moved_aside.as_deref()
    }

    fn read<T: DeserializeOwned>(&self, table: Table, key: &str) -> Option<T> {
        let bytes = match self.writes.latest(table, key) {
            Some(queued) => queued,
            None => self.read_committed(table, key),
        };
        bytes.and_then(|v| serde_json::from_slice(&v).ok())
    }

    /// What the file holds at `table`/`key` (not what is queued).
    fn read_committed(&self, table: Table, key: &str) -> Option<Vec<u8>> {
        self.db.get(table, key).unwrap_or_else(|e| {
            tracing::error!(path = %self.path.display(), table = %table, key, error = %e, "state store read failed");
            None
        })
    }

    /// Every record of `table`: the file's, with what is queued over it.
    fn read_all<T: DeserializeOwned>(&self, table: Table) -> Vec<(String, T)> {
        match self.writes.overlaid(table, || self.db.all(table)) {
            Ok(all) => all
                .into_iter()
                .filter_map(|(k, v): (String, Vec<u8>)| match serde_json::from_slice(&v) {
                    Ok(rec) => Some((k, rec)),
                    Err(e) => {
                        tracing::error!(table = %table, key = k, error = %e, "unreadable record skipped");
                        None
                    }
                })
                .collect(),
            Err(e) => {
                tracing::error!(path = %self.path.display(), table = %table, error = %e, "state store read failed");
                Vec::new()
            }
        }
    }

    /// Queues `key`'s new value in `table`.
    fn put<T: Serialize>(&self, table: Table, key: &str, value: &T) -> Committed {
        match serde_json::to_vec(value) {
            Ok(value) => self.writes.submit(vec![Op::Put {
                table,
                key: key.to_string(),
                value,
            }]),
            Err(e) => {
                tracing::error!(table = %table, key, error = %e, "state store record not encodable");
                Committed::failed()
            }
        }
    }

    fn delete(&self, tables: &[Table], key: &str) -> Committed {
        self.writes.submit(vec![Op::Delete {
            tables: tables.to_vec(),
            key: key.to_string(),
        }])
    }

    /// A model's recorded intent.
    pub fn get(&self, name: &str) -> Option<IntentRecord> {
        self.read(INTENTS, name)
    }

    /// Records a model's intent (durable on return; unchanged ones are not
    /// rewritten); false when the write failed. The daemon itself waits
    /// asynchronously ([`Store::set_soon`]).
    #[cfg(test)]
    pub fn set(&self, name: &str, record: IntentRecord) -> bool {
        self.set_soon(name, record).wait_blocking()
    }

    /// Queues a model's intent (one already committed is not rewritten;
    /// one only queued is, as its commit may still fail): a model task
    /// awaits it before it acts on it, or drops it to not wait.
    pub fn set_soon(&self, name: &str, record: IntentRecord) -> Committed {
        if self.writes.latest(INTENTS, name).is_none() && self.get(name).as_ref() == Some(&record) {
            return Committed::already();
        }
        self.put(INTENTS, name, &record)
    }

    /// Forgets everything about a model (removed from the configuration):
    /// queued, durable once [`Committed::wait`] says so.
    pub fn remove(&self, name: &str) -> Committed {
        self.delete(&[INTENTS, ENGINES, CALIBRATION], name)
    }

    /// Forgets everything about a model and records `record` as its intent,
    /// in one transaction (a model changed by a reload): a crash leaves
    /// the old records or the new intent, never neither.
    pub fn replace(&self, name: &str, record: &IntentRecord) -> Committed {
        let value = match serde_json::to_vec(record) {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(table = %INTENTS, key = name, error = %e, "state store record not encodable");
                return Committed::failed();
            }
        };
        self.writes.submit(vec![
            Op::Delete {
                tables: vec![INTENTS, ENGINES, CALIBRATION],
                key: name.to_string(),
            },
            Op::Put {
                table: INTENTS,
                key: name.to_string(),
                value,
            },
        ])
    }

    /// Names of the models with a recorded intent.
    pub fn intent_names(&self) -> Vec<String> {
        self.read_all::<IntentRecord>(INTENTS)
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    }

    /// Forgets a model's intent and calibration (its engine record stays
    /// until its engine is gone): queued, durable once waited for.
    pub fn forget(&self, name: &str) -> Committed {
        self.delete(&[INTENTS, CALIBRATION], name)
    }

    /// A model's engine record.
    pub fn engine(&self, name: &str) -> Option<EngineRecord> {
        self.read(ENGINES, name)
    }

    /// Every engine record.
    pub fn engines(&self) -> Vec<(String, EngineRecord)> {
        self.read_all(ENGINES)
    }

    /// The GPUs each recorded engine was placed on: what start-up placement
    /// keeps, so engines left running are adopted where they run. Records
    /// without GPUs (from before they were recorded, or engines without
    /// any) are left out: those models are placed afresh.
    pub fn engine_gpus(&self) -> BTreeMap<String, Vec<u32>> {
        self.engines()
            .into_iter()
            .filter(|(_, r)| !r.gpus.is_empty())
            .map(|(name, r)| (name, r.gpus))
            .collect()
    }

    /// Records a model's engine (durable on return); false when the write
    /// failed. (The daemon's tasks await [`Store::set_engine_soon`].)
    #[cfg(test)]
    pub fn set_engine(&self, name: &str, record: &EngineRecord) -> bool {
        self.set_engine_soon(name, record).wait_blocking()
    }

    /// Queues a model's engine record: a task awaits it (no thread waits),
    /// or drops it to not wait.
    pub fn set_engine_soon(&self, name: &str, record: &EngineRecord) -> Committed {
        self.put(ENGINES, name, record)
    }

    /// Removes a model's engine record if it is the engine tagged `tag`.
    /// Not by process generation: generations count from 1 again in every
    /// daemon, so a late exit (or stop) of an engine from before would
    /// take the record of the new engine of the same generation, which
    /// the next restart would then kill as unrecorded. Not waited for (it
    /// runs as each engine exits, a thousand at a shutdown): a record not
    /// yet removed at a crash names an engine that is gone, which the next
    /// start finds gone and removes.
    /// The record is looked at and the removal queued under one hold of the
    /// queue's lock (the file read outside it, and read again if a commit
    /// ended meanwhile; the fourth time under the lock): a new engine's
    /// record queued or committed meanwhile is not taken.
    pub fn remove_engine(&self, name: &str, tag: &str) {
        let ours = |bytes: Option<&[u8]>| {
            bytes
                .and_then(|b| serde_json::from_slice::<EngineRecord>(b).ok())
                .is_some_and(|r| r.tag == tag)
        };
        let delete = Op::Delete {
            tables: vec![ENGINES],
            key: name.to_string(),
        };
        let committed = || self.read_committed(ENGINES, name);
        drop(
            self.writes
                .submit_if((ENGINES, name), ours, committed, delete),
        );
    }

    /// A model's calibration.
    pub fn calibration(&self, name: &str) -> Option<CalibrationRecord> {
        self.read(CALIBRATION, name)
    }

    /// Queues a model's calibration (not waited for: nothing is done on
    /// the strength of it being durable).
    pub fn set_calibration(&self, name: &str, record: &CalibrationRecord) {
        drop(self.put(CALIBRATION, name, record));
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.writes.close();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}
