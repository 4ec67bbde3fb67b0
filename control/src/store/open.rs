//! Opening the redb file: what is fatal (an unusable directory, a store in
//! use), what is moved aside (corrupt, incompatible, truncated, emptied),
//! what is initialised.

// redb's own error type is large; it only travels inside this module.
#![allow(clippy::result_large_err)]

use super::{CALIBRATION, ENGINES, INTENTS, META, SCHEMA_VERSION, StoreError};
use redb::backends::FileBackend;
use redb::{Database, ReadableTableMetadata, StorageBackend};
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

/// A storage error that shows the file is damaged (then it is moved
/// aside), not that reading it failed this time.
fn storage_says_corrupt(e: &redb::StorageError) -> bool {
    use redb::StorageError;
    match e {
        StorageError::Corrupted(_) => true,
        StorageError::Io(e) => matches!(
            e.kind(),
            std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
        ),
        _ => false,
    }
}

/// [`open_checked`], a panic in it taken for damage: redb asserts on
/// some damaged files instead of returning an error (a file shorter than
/// its header says is checked for before, [`damage`]; this is for the
/// rest), and a panic here stopped the daemon at every start.
pub(super) fn try_open(path: &Path) -> Result<Opened, StoreError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| open_checked(path))).unwrap_or_else(
        |panic| {
            let what = panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("a panic");
            Ok(Opened::Reject {
                why: "corrupt",
                detail: format!("redb failed an assertion reading it: {what}"),
            })
        },
    )
}

fn open_checked(path: &Path) -> Result<Opened, StoreError> {
    use redb::{DatabaseError, StorageError};
    let db = match create(path) {
        Ok(Created::Db(db)) => db,
        Ok(Created::Damaged(detail)) => {
            return Ok(Opened::Reject {
                why: "corrupt",
                detail,
            });
        }
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
            // A read that failed (a disk error, a full or vanished mount)
            // says nothing of the file: refused, not moved aside with every
            // intent and engine record in it.
            Err(redb::TableError::Storage(e)) if !storage_says_corrupt(&e) => {
                return Err(StoreError::Db {
                    path: path.into(),
                    message: format!(
                        "reading it failed ({e}); it was left as it is, not taken for corrupt: \
                         check the disk and start again (or move the file aside to start with \
                         no recorded intents)"
                    ),
                });
            }
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

enum Created {
    Db(Database),
    /// Damaged in a way redb would not report: why.
    Damaged(String),
}

/// `Database::create`, the file first checked for damage ([`damage`]) once
/// it is locked (redb's backend takes the lock: the header of a store that
/// another process writes may be mid-commit). Under test, through a file
/// that can be made full.
fn create(path: &Path) -> Result<Created, redb::DatabaseError> {
    let existed = path.try_exists()?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    let backend = FileBackend::new(file)?;
    if let Some(why) = damage(&backend, existed)? {
        return Ok(Created::Damaged(why));
    }
    #[cfg(test)]
    let backend = super::faults::faulty(path, backend);
    Ok(Created::Db(
        redb::Builder::new().create_with_backend(backend)?,
    ))
}

/// redb's magic number, at the start of its file.
const MAGIC: [u8; 9] = *b"redb\x1a\x0a\xa9\x0d\x0a";
/// The part of redb's header read here: the magic number, a flags byte,
/// padding, then (little-endian u32s) the page size, and the pages of a
/// region's header and data, full regions and data pages of the trailing
/// region, which give the file's length.
const HEADER: usize = 32;

/// How the file is damaged, where redb would panic on it or take it for
/// a new store: shorter than its header says (truncated), which redb
/// asserts against; empty though it `existed` before this open, which redb
/// would initialise as a new store, every intent in it lost unsaid.
fn damage(file: &FileBackend, existed: bool) -> std::io::Result<Option<String>> {
    let len = file.len()?;
    if existed && len == 0 {
        return Ok(Some(
            "empty (0 bytes): what it held is lost (a file system that lost its data, a copy \
             or a first start cut short), not taken for a new store"
                .into(),
        ));
    }
    if len < HEADER as u64 {
        return Ok(None);
    }
    let header = file.read(0, HEADER)?;
    Ok(header_len(&header)
        .filter(|&says| len < says)
        .map(|says| format!("truncated: {len} bytes, its header says {says}")))
}

/// The file's length as its header says (redb 2's layout: one page of
/// header, then each region's header and data pages); `None` when it is
/// not redb's header (redb says what is wrong with it).
fn header_len(h: &[u8]) -> Option<u64> {
    if h.len() < HEADER || h[..MAGIC.len()] != MAGIC {
        return None;
    }
    let u = |at: usize| u64::from(u32::from_le_bytes(h[at..at + 4].try_into().unwrap()));
    let (page, region_header, region_data, full, trailing) = (u(12), u(16), u(20), u(24), u(28));
    let region = region_header.checked_add(region_data)?.checked_mul(page)?;
    let trailing = match trailing {
        0 => 0,
        n => region_header.checked_add(n)?.checked_mul(page)?,
    };
    page.checked_add(full.checked_mul(region)?)?
        .checked_add(trailing)
}

pub(super) fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a store shown damaged is moved aside (with every intent and
    /// engine record in it); a read that failed (EIO, a previous I/O
    /// error) refuses the start and says so, the file left as it is.
    #[test]
    fn only_damage_moves_a_store_aside_not_a_read_that_failed() {
        use redb::StorageError;
        assert!(storage_says_corrupt(&StorageError::Corrupted(
            "bad page".into()
        )));
        assert!(storage_says_corrupt(&StorageError::Io(
            std::io::ErrorKind::UnexpectedEof.into()
        )));
        assert!(!storage_says_corrupt(&StorageError::Io(
            std::io::Error::from_raw_os_error(5)
        )));
        assert!(!storage_says_corrupt(&StorageError::PreviousIo));
    }
}
