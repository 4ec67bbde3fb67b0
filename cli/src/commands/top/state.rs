//! What `siesta top` shows, kept from the Watch stream and `ListGpus`, and
//! what its keys ask for. No I/O: the loop in `top.rs` feeds it.

use std::collections::{BTreeMap, VecDeque};

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use siesta_proto::v1 as pb;
use siesta_proto::v1::watch_event::Kind;

use crate::render;

/// Event-log lines kept.
const LOG_KEPT: usize = 500;

/// The connection to the control plane, as the header shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    Connecting,
    Live,
    Reconnecting(String),
}

/// What a key asks the loop to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Quit,
    Wake(String),
    Sleep(String, u32),
    Pin(String),
    Unpin(String),
    Stop(String),
    Logs(String),
}

/// Everything on screen.
#[derive(Debug)]
pub struct Top {
    pub url: String,
    pub models: BTreeMap<String, pb::ModelStatus>,
    pub gpus: Option<pb::ListGpusResponse>,
    pub revision: u64,
    pub link: Link,
    pub log: VecDeque<String>,
    pub selected: usize,
    /// The answer to the last operation.
    pub message: String,
    /// The engine log panel: model and its last lines.
    pub engine_log: Option<(String, Vec<String>)>,
}

/// `HH:MM:SS` (UTC) of a Unix time in milliseconds.
pub fn clock(ms: i64) -> String {
    let s = ms.div_euclid(1000).rem_euclid(86_400);
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

impl Top {
    pub fn new(url: &str) -> Top {
        Top {
            url: url.to_string(),
            models: BTreeMap::new(),
            gpus: None,
            revision: 0,
            link: Link::Connecting,
            log: VecDeque::new(),
            selected: 0,
            message: String::new(),
            engine_log: None,
        }
    }

    pub fn note(&mut self, at_ms: i64, line: impl AsRef<str>) {
        if self.log.len() == LOG_KEPT {
            self.log.pop_front();
        }
        self.log
            .push_back(format!("{}  {}", clock(at_ms), line.as_ref()));
    }

    /// Applies one Watch event.
    pub fn apply(&mut self, ev: &pb::WatchEvent) {
        self.revision = ev.revision;
        let selected = self.selected_name().map(str::to_string);
        match &ev.kind {
            Some(Kind::Snapshot(s)) => {
                self.models = s
                    .models
                    .iter()
                    .map(|m| (m.name.clone(), m.clone()))
                    .collect();
                if let Some(g) = &s.gpus {
                    self.gpus = Some(g.clone());
                }
                let what = if s.resync { "resynced" } else { "snapshot" };
                self.note(ev.at_unix_ms, format!("{what}: {} models", s.models.len()));
            }
            Some(Kind::Model(m)) => {
                let new = render::state_label(m);
                let old = self.models.get(&m.name).map(render::state_label);
                if old.as_deref() != Some(new.as_str()) {
                    let err = if m.last_error.is_empty() {
                        String::new()
                    } else {
                        format!("  ({})", m.last_error)
                    };
                    let from = old.map(|o| format!("{o} → ")).unwrap_or_default();
                    self.note(ev.at_unix_ms, format!("{}: {from}{new}{err}", m.name));
                }
                self.models.insert(m.name.clone(), m.clone());
            }
            Some(Kind::ModelRemoved(name)) => {
                self.models.remove(name);
                self.note(ev.at_unix_ms, format!("{name}: removed"));
            }
            Some(Kind::Gpus(g)) => self.gpus = Some(g.clone()),
            Some(Kind::Placement(_)) | Some(Kind::Heartbeat(_)) | None => {}
        }
        // The selection stays on its model when others come or go before
        // it in the list (a key then acted on the model that took its row:
        // `s` stopped another one).
        if let Some(i) = selected.and_then(|n| self.models.keys().position(|k| *k == n)) {
            self.selected = i;
        }
        self.selected = self.selected.min(self.models.len().saturating_sub(1));
    }

    pub fn selected_name(&self) -> Option<&str> {
        self.models.keys().nth(self.selected).map(String::as_str)
    }

    /// GPU memory held by a model's engine processes, and the total of its GPUs.
    pub fn engine_memory(&self, name: &str, gpu_ids: &[u32]) -> (u64, u64) {
        let Some(g) = &self.gpus else { return (0, 0) };
        let used = g
            .gpus
            .iter()
            .flat_map(|g| &g.processes)
            .filter(|p| p.model == name)
            .map(|p| p.used_bytes)
            .sum();
        let total = g
            .gpus
            .iter()
            .filter(|g| gpu_ids.contains(&g.index))
            .map(|g| g.memory_total_bytes)
            .sum();
        (used, total)
    }

    /// A key press; `Some` when the loop must act.
    pub fn key(&mut self, k: KeyEvent) -> Option<Action> {
        if k.modifiers.contains(KeyModifiers::CONTROL) && k.code == KeyCode::Char('c') {
            return Some(Action::Quit);
        }
        let name = self.selected_name().map(str::to_string);
        let on = |f: fn(String) -> Action| name.clone().map(f);
        match k.code {
            KeyCode::Char('q') => Some(Action::Quit),
            KeyCode::Esc => {
                self.engine_log = None;
                None
            }
            KeyCode::Up | KeyCode::Char('k') => {
                self.selected = self.selected.saturating_sub(1);
                None
            }
            KeyCode::Down | KeyCode::Char('j') => {
                self.selected = (self.selected + 1).min(self.models.len().saturating_sub(1));
                None
            }
            KeyCode::Char('w') => on(Action::Wake),
            KeyCode::Char('1') => name.map(|n| Action::Sleep(n, 1)),
            KeyCode::Char('2') => name.map(|n| Action::Sleep(n, 2)),
            KeyCode::Char('p') => {
                let pinned = name
                    .as_ref()
                    .and_then(|n| self.models.get(n))
                    .is_some_and(|m| m.pinned_until_unix_ms != 0);
                if pinned {
                    on(Action::Unpin)
                } else {
                    on(Action::Pin)
                }
            }
            KeyCode::Char('s') => on(Action::Stop),
            KeyCode::Char('l') if self.engine_log.is_some() => {
                self.engine_log = None;
                None
            }
            KeyCode::Char('l') => on(Action::Logs),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str, state: pb::ModelState) -> pb::ModelStatus {
        pb::ModelStatus {
            name: name.into(),
            state: state as i32,
            ..Default::default()
        }
    }

    fn ev(revision: u64, kind: Kind) -> pb::WatchEvent {
        pb::WatchEvent {
            revision,
            at_unix_ms: 3_723_000,
            control_id: "box".into(),
            kind: Some(kind),
        }
    }

    #[test]
    fn events_update_models_and_log_state_changes() {
        let mut t = Top::new("http://x");
        t.apply(&ev(
            1,
            Kind::Snapshot(pb::Snapshot {
                models: vec![
                    model("a", pb::ModelState::Asleep),
                    model("b", pb::ModelState::Stopped),
                ],
                ..Default::default()
            }),
        ));
        t.apply(&ev(2, Kind::Model(model("a", pb::ModelState::Waking))));
        t.apply(&ev(3, Kind::Model(model("a", pb::ModelState::Waking))));
        assert_eq!(t.revision, 3);
        assert_eq!(t.models["a"].state(), pb::ModelState::Waking);
        let log: Vec<&String> = t.log.iter().collect();
        assert_eq!(log.len(), 2, "{log:?}");
        assert_eq!(log[1], "01:02:03  a: asleep → waking");
        t.apply(&ev(4, Kind::ModelRemoved("b".into())));
        assert_eq!(t.models.len(), 1);
    }

    #[test]
    fn keys_act_on_the_selected_model() {
        let mut t = Top::new("http://x");
        t.apply(&ev(
            1,
            Kind::Snapshot(pb::Snapshot {
                models: vec![
                    model("a", pb::ModelState::Awake),
                    model("b", pb::ModelState::Awake),
                ],
                ..Default::default()
            }),
        ));
        let key = |c| KeyEvent::from(c);
        assert_eq!(
            t.key(key(KeyCode::Char('w'))),
            Some(Action::Wake("a".into()))
        );
        assert_eq!(t.key(key(KeyCode::Down)), None);
        assert_eq!(
            t.key(key(KeyCode::Char('2'))),
            Some(Action::Sleep("b".into(), 2))
        );
        assert_eq!(t.key(key(KeyCode::Down)), None);
        assert_eq!(t.selected_name(), Some("b"));
        assert_eq!(
            t.key(key(KeyCode::Char('p'))),
            Some(Action::Pin("b".into()))
        );
        assert_eq!(
            t.key(key(KeyCode::Char('s'))),
            Some(Action::Stop("b".into()))
        );
        assert_eq!(
            t.key(key(KeyCode::Char('l'))),
            Some(Action::Logs("b".into()))
        );
        // A model added before it, then one removed: still "b".
        t.apply(&ev(2, Kind::Model(model("0", pb::ModelState::Asleep))));
        assert_eq!(t.selected_name(), Some("b"));
        t.apply(&ev(3, Kind::ModelRemoved("a".into())));
        assert_eq!(
            t.key(key(KeyCode::Char('s'))),
            Some(Action::Stop("b".into()))
        );
        // Its own removal: the row it had.
        t.apply(&ev(4, Kind::ModelRemoved("b".into())));
        assert_eq!(t.selected_name(), Some("0"));
        assert_eq!(t.key(key(KeyCode::Char('q'))), Some(Action::Quit));
        let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
        assert_eq!(t.key(ctrl_c), Some(Action::Quit));
    }
}
