//! Typed reads from a TOML table that record every problem with its key path
//! and reject keys nobody asked for.

use super::Problem;
use super::units::{parse_duration, parse_size};
use std::collections::BTreeSet;
use std::time::Duration;
use toml::{Table, Value};

/// Collected problems.
#[derive(Debug, Default)]
pub(super) struct Problems(pub Vec<Problem>);

impl Problems {
    pub fn push(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            key: key.into(),
            message: message.into(),
        });
    }
}

/// A table being read; `finish` reports keys that were not read.
#[derive(Debug)]
pub(super) struct Reader<'a> {
    pub path: String,
    table: &'a Table,
    seen: BTreeSet<String>,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "a boolean",
        Value::Datetime(_) => "a datetime",
        Value::Array(_) => "an array",
        Value::Table(_) => "a table",
    }
}

/// A key as TOML would spell it: bare when it can be, quoted and escaped
/// otherwise, so a key holding a newline cannot split or forge a problem line.
pub(super) fn display_key(k: &str) -> String {
    let bare = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        k.to_string()
    } else {
        format!("{k:?}")
    }
}

pub(super) fn describe(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

impl<'a> Reader<'a> {
    pub fn new(path: impl Into<String>, table: &'a Table) -> Self {
        Self {
            path: path.into(),
            table,
            seen: BTreeSet::new(),
        }
    }

    pub fn key(&self, k: &str) -> String {
        let k = display_key(k);
        if self.path.is_empty() {
            k
        } else {
            format!("{}.{k}", self.path)
        }
    }

    pub fn raw(&mut self, k: &str) -> Option<&'a Value> {
        self.seen.insert(k.to_string());
        self.table.get(k)
    }

    fn wrong(&self, p: &mut Problems, k: &str, expected: &str, v: &Value) {
        p.push(
            self.key(k),
            format!("expected {expected}, found {}", type_name(v)),
        );
    }

    pub fn string(&mut self, p: &mut Problems, k: &str) -> Option<String> {
        match self.raw(k)? {
            Value::String(s) => Some(s.clone()),
            v => {
                self.wrong(p, k, "a string", v);
                None
            }
        }
    }

    pub fn boolean(&mut self, p: &mut Problems, k: &str) -> Option<bool> {
        match self.raw(k)? {
            Value::Boolean(b) => Some(*b),
            v => {
                self.wrong(p, k, "a boolean", v);
                None
            }
        }
    }

    pub fn uint(&mut self, p: &mut Problems, k: &str, max: u64) -> Option<u64> {
        match self.raw(k)? {
            Value::Integer(i) if *i >= 0 && (*i as u64) <= max => Some(*i as u64),
            Value::Integer(i) => {
                p.push(self.key(k), format!("{i} is out of range 0..={max}"));
                None
            }
            v => {
                self.wrong(p, k, "an integer", v);
                None
            }
        }
    }

    pub fn duration(&mut self, p: &mut Problems, k: &str) -> Option<Duration> {
        let key = self.key(k);
        duration_value(p, &key, self.raw(k)?)
    }

    pub fn strings(&mut self, p: &mut Problems, k: &str) -> Option<Vec<String>> {
        let key = self.key(k);
        match self.raw(k)? {
            Value::Array(items) => {
                let mut out = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Value::String(s) => out.push(s.clone()),
                        v => p.push(
                            format!("{key}[{i}]"),
                            format!("expected a string, found {}", type_name(v)),
                        ),
                    }
                }
                Some(out)
            }
            v => {
                self.wrong(p, k, "an array of strings", v);
                None
            }
        }
    }

    pub fn uints(&mut self, p: &mut Problems, k: &str) -> Option<Vec<u32>> {
        let key = self.key(k);
        match self.raw(k)? {
            Value::Array(items) => {
                let mut out = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Value::Integer(n) if *n >= 0 && *n <= u32::MAX as i64 => {
                            out.push(*n as u32)
                        }
                        v => p.push(
                            format!("{key}[{i}]"),
                            format!("expected a GPU index, found {}", describe(v)),
                        ),
                    }
                }
                Some(out)
            }
            v => {
                self.wrong(p, k, "an array of integers", v);
                None
            }
        }
    }

    pub fn table(&mut self, p: &mut Problems, k: &str) -> Option<&'a Table> {
        match self.raw(k)? {
            Value::Table(t) => Some(t),
            v => {
                self.wrong(p, k, "a table", v);
                None
            }
        }
    }

    /// An array of tables (`[[model]]`, inline `[{...}, ...]`).
    pub fn tables(&mut self, p: &mut Problems, k: &str) -> Vec<(String, &'a Table)> {
        let key = self.key(k);
        match self.raw(k) {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| match item {
                    Value::Table(t) => Some((format!("{key}[{i}]"), t)),
                    v => {
                        p.push(
                            format!("{key}[{i}]"),
                            format!("expected a table, found {}", type_name(v)),
                        );
                        None
                    }
                })
                .collect(),
            Some(v) => {
                self.wrong(p, k, "an array of tables", v);
                Vec::new()
            }
        }
    }

    /// Reports every key that was not read.
    pub fn finish(self, p: &mut Problems) {
        for k in self.table.keys() {
            if !self.seen.contains(k) {
                let mut known: Vec<&str> = self.seen.iter().map(String::as_str).collect();
                known.sort_unstable();
                p.push(
                    self.key(k),
                    format!("unknown key (known here: {})", known.join(", ")),
                );
            }
        }
    }
}

pub(super) fn duration_value(p: &mut Problems, key: &str, v: &Value) -> Option<Duration> {
    match v {
        Value::String(s) => match parse_duration(s) {
            Some(d) => Some(d),
            None => {
                p.push(
                    key,
                    format!("{s:?} is not a duration (like \"1.5s\", \"15m\", \"3h\")"),
                );
                None
            }
        },
        v => {
            p.push(
                key,
                format!(
                    "expected a duration string like \"15m\", found {}",
                    describe(v)
                ),
            );
            None
        }
    }
}

pub(super) fn size_value(p: &mut Problems, key: &str, v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) if *i > 0 => Some(*i as u64),
        Value::String(s) => match parse_size(s) {
            Some(n) if n > 0 => Some(n),
            _ => {
                p.push(key, format!("{s:?} is not a size (like \"20GiB\")"));
                None
            }
        },
        v => {
            p.push(
                key,
                format!("expected a size like \"20GiB\", found {}", describe(v)),
            );
            None
        }
    }
}
