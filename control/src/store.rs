//! Durable intents: what each model should be, why, until when. A JSON file
//! in the state directory, written atomically (tmp, fsync, rename). The seam
//! for a fuller embedded store later.

use crate::reconciler::{Desired, Intent, ModelState, Pin, Reason};
use crate::status::Clock;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// One model's persisted intent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntentRecord {
    /// "stopped", "awake" or "asleep".
    pub desired: String,
    #[serde(default)]
    pub level: u8,
    /// "config", "demand", "operator", "pin" or "idle_tier".
    pub reason: String,
    pub since_unix_ms: i64,
    #[serde(default)]
    pub until_unix_ms: i64,
    /// 0: not pinned; i64::MAX: until Unpin.
    #[serde(default)]
    pub pinned_until_unix_ms: i64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct File {
    version: u32,
    intents: BTreeMap<String, IntentRecord>,
}

/// The intent store.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    records: Mutex<BTreeMap<String, IntentRecord>>,
    dirty: Notify,
}

fn reason_name(r: Reason) -> &'static str {
    match r {
        Reason::Config => "config",
        Reason::Demand => "demand",
        Reason::Operator => "operator",
        Reason::Pin => "pin",
        Reason::IdleTier => "idle_tier",
        Reason::Eviction => "eviction",
    }
}

impl IntentRecord {
    pub fn from_state(m: &ModelState, clock: &Clock) -> Self {
        let (desired, level) = match m.intent.desired {
            Desired::Stopped => ("stopped", 0),
            Desired::Awake => ("awake", 0),
            Desired::Asleep(l) => ("asleep", l),
        };
        Self {
            desired: desired.into(),
            level,
            reason: reason_name(m.intent.reason).into(),
            since_unix_ms: clock.unix_ms(m.intent.since),
            until_unix_ms: m.intent.until.map_or(0, |t| clock.unix_ms(t)),
            pinned_until_unix_ms: match m.pin {
                Pin::None => 0,
                Pin::Forever => i64::MAX,
                Pin::Until(t) => clock.unix_ms(t),
            },
        }
    }

    /// Puts the recorded intent (and pin) into a fresh state. Intents that
    /// came from the configuration are not restored: the file in force wins.
    pub fn restore(&self, m: &mut ModelState, clock: &Clock) {
        let desired = match (self.desired.as_str(), self.level) {
            ("stopped", _) => Desired::Stopped,
            ("awake", _) => Desired::Awake,
            ("asleep", l @ (1 | 2)) => Desired::Asleep(l),
            _ => return,
        };
        let reason = match self.reason.as_str() {
            "demand" => Reason::Demand,
            "operator" => Reason::Operator,
            "pin" => Reason::Pin,
            "idle_tier" => Reason::IdleTier,
            "eviction" => Reason::Eviction,
            _ => return,
        };
        let now_ms = clock.now_ms();
        m.pin = match self.pinned_until_unix_ms {
            0 => Pin::None,
            i64::MAX => Pin::Forever,
            t if t > now_ms => Pin::Until(clock.instant(t)),
            _ => Pin::None,
        };
        m.intent = Intent {
            desired,
            reason,
            since: clock.instant(self.since_unix_ms),
            until: (self.until_unix_ms > 0).then(|| clock.instant(self.until_unix_ms)),
        };
    }
}

impl Store {
    /// Opens (creating the directory) and reads `intents.json` if present;
    /// an unreadable file is logged and replaced.
    pub fn open(state_dir: &Path) -> std::io::Result<Arc<Store>> {
        std::fs::create_dir_all(state_dir)?;
        let path = state_dir.join("intents.json");
        let records = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<File>(&bytes) {
                Ok(f) => f.intents,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable intent file");
                    BTreeMap::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(e),
        };
        Ok(Arc::new(Store {
            path,
            records: Mutex::new(records),
            dirty: Notify::new(),
        }))
    }

    pub fn get(&self, name: &str) -> Option<IntentRecord> {
        self.records.lock().unwrap().get(name).cloned()
    }

    pub fn set(&self, name: &str, record: IntentRecord) {
        let mut records = self.records.lock().unwrap();
        if records.get(name) != Some(&record) {
            records.insert(name.to_string(), record);
            self.dirty.notify_one();
        }
    }

    pub fn remove(&self, name: &str) {
        if self.records.lock().unwrap().remove(name).is_some() {
            self.dirty.notify_one();
        }
    }

    /// Writes the file now: tmp, fsync, rename, fsync the directory.
    pub fn write_now(&self) -> std::io::Result<()> {
        let file = File {
            version: 1,
            intents: self.records.lock().unwrap().clone(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
        let tmp = self.path.with_extension("json.tmp");
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent()
            && let Ok(d) = std::fs::File::open(dir)
        {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Writes whenever something changed, and once more at shutdown.
    pub async fn run_writer(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            let stop = tokio::select! {
                _ = self.dirty.notified() => false,
                _ = cancel.cancelled() => true,
            };
            let me = self.clone();
            match tokio::task::spawn_blocking(move || me.write_now()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::error!(path = %self.path.display(), error = %e, "cannot write intents")
                }
                Err(e) => tracing::error!(error = %e, "intent writer panicked"),
            }
            if stop {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::reconciler::Settings;
    use tokio::time::Instant;

    #[test]
    fn intents_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Clock::new();
        let cfg = Config::demo(vec!["x".into()]);
        let settings = Settings::from_config(&cfg.models[0]);
        let mut m = ModelState::new(settings.clone(), cfg.models[0].preload, Instant::now());
        m.intent.desired = Desired::Asleep(2);
        m.intent.reason = Reason::Operator;
        m.pin = Pin::Forever;
        let store = Store::open(dir.path()).unwrap();
        store.set("chat", IntentRecord::from_state(&m, &clock));
        store.write_now().unwrap();
        let again = Store::open(dir.path()).unwrap();
        let rec = again.get("chat").unwrap();
        let mut fresh = ModelState::new(settings, cfg.models[0].preload, Instant::now());
        rec.restore(&mut fresh, &clock);
        assert_eq!(fresh.intent.desired, Desired::Asleep(2));
        assert_eq!(fresh.intent.reason, Reason::Operator);
        assert_eq!(fresh.pin, Pin::Forever);
    }
}
