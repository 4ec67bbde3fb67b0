//! Opening the redb file: what is fatal (an unusable directory, a store in
//! use), what is moved aside (corrupt, incompatible), what is initialised.

// redb's own error type is large; it only travels inside this module.
#![allow(clippy::result_large_err)]

use super::{CALIBRATION, ENGINES, INTENTS, META, SCHEMA_VERSION, StoreError};
use redb::{Database, ReadableTableMetadata};
use std::path::Path;

pub(super) enum Opened {
    Ok(Database),
    /// Unreadable or incompatible: move aside (`why` names the suffix).
    Reject {
        why: &'static str,
        detail: String,
    },
}

pub(super) fn io(path: &Path, source: std::io::Error) -> StoreError {
    StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(super) fn try_open(path: &Path) -> Result<Opened, StoreError> {
    use redb::{DatabaseError, StorageError};
    let db = match Database::create(path) {
        Ok(db) => db,
        Err(DatabaseError::DatabaseAlreadyOpen) => return Err(StoreError::InUse(path.into())),
        Err(DatabaseError::UpgradeRequired(v)) => {
            return Ok(Opened::Reject {
                why: "incompatible",
                detail: format!("file format {v} needs an upgrade"),
            });
        }
        Err(DatabaseError::Storage(StorageError::Io(e)))
            if !matches!(
                e.kind(),
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            return Err(io(path, e));
        }
        Err(e) => {
            return Ok(Opened::Reject {
                why: "corrupt",
                detail: e.to_string(),
            });
        }
    };
    let db_err = |e: redb::Error| StoreError::Db {
        path: path.into(),
        message: e.to_string(),
    };
    let version = {
        let tx = db.begin_read().map_err(|e| db_err(e.into()))?;
        match tx.open_table(META) {
            Ok(t) => t
                .get("schema_version")
                .map_err(|e| db_err(e.into()))?
                .map(|v| v.value()),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => {
                return Ok(Opened::Reject {
                    why: "corrupt",
                    detail: e.to_string(),
                });
            }
        }
    };
    match version {
        Some(SCHEMA_VERSION) => Ok(Opened::Ok(db)),
        Some(v) => Ok(Opened::Reject {
            why: "incompatible",
            detail: format!("schema version {v}, this siesta-control reads {SCHEMA_VERSION}"),
        }),
        None => {
            // New (or never initialised): create every table and the version.
            let tx = db.begin_write().map_err(|e| db_err(e.into()))?;
            {
                let mut meta = tx.open_table(META).map_err(|e| db_err(e.into()))?;
                if meta.len().map_err(|e| db_err(e.into()))? > 0 {
                    return Ok(Opened::Reject {
                        why: "incompatible",
                        detail: "no schema version".into(),
                    });
                }
                meta.insert("schema_version", SCHEMA_VERSION)
                    .map_err(|e| db_err(e.into()))?;
                for t in [INTENTS, ENGINES, CALIBRATION] {
                    tx.open_table(t).map_err(|e| db_err(e.into()))?;
                }
            }
            tx.commit().map_err(|e| db_err(e.into()))?;
            Ok(Opened::Ok(db))
        }
    }
}

pub(super) fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
