//! The changes queued to the store's writer, and what they leave.

use redb::{TableDefinition, TableHandle};
use std::collections::BTreeMap;

pub(super) type Table = TableDefinition<'static, &'static str, &'static [u8]>;

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
    pub(super) fn leaves(&self, table: Table, key: &str) -> Option<Option<&[u8]>> {
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

    /// Applies this change to `all`, the records of `table`.
    pub(super) fn apply(&self, table: Table, all: &mut BTreeMap<String, Vec<u8>>) {
        match self {
            Op::Put {
                table: t,
                key,
                value,
            } if t.name() == table.name() => {
                all.insert(key.clone(), value.clone());
            }
            Op::Delete { tables, key } if tables.iter().any(|t| t.name() == table.name()) => {
                all.remove(key);
            }
            _ => {}
        }
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Op::Put { table, key, .. } => format!("{}/{key}", table.name()),
            Op::Delete { tables, key } => {
                let names: Vec<&str> = tables.iter().map(|t| t.name()).collect();
                format!("delete {}/{key}", names.join("+"))
            }
        }
    }
}

/// `ops` with only the last change of every table and key left, in order:
/// what applying them all leaves, for the writes a failed round keeps
/// (during a long full disk every model's activity would pile up).
pub(super) fn newest_per_key(ops: Vec<Op>) -> Vec<Op> {
    let mut seen = std::collections::HashSet::new();
    let mut kept: Vec<Op> = ops
        .into_iter()
        .rev()
        .filter_map(|op| match op {
            Op::Put { table, key, value } => seen
                .insert((table.name().to_string(), key.clone()))
                .then_some(Op::Put { table, key, value }),
            Op::Delete { tables, key } => {
                let tables: Vec<Table> = tables
                    .into_iter()
                    .filter(|t| seen.insert((t.name().to_string(), key.clone())))
                    .collect();
                (!tables.is_empty()).then_some(Op::Delete { tables, key })
            }
        })
        .collect();
    kept.reverse();
    kept
}
