//! Engine kinds and what each can do: the one place that says which sleep
//! levels an engine has, whether it answers "do you sleep?", and which
//! gauge tells its activity. Config validation, the reconciler's pure step
//! and the status all ask here.
//!
//! Adding a capability (as the CUDA-suspend tier did: `suspend`) means a
//! field here, the kinds that have it, and the places that ask.

use super::IdleAction;

/// Which server runs the model (`engine` in a `[[model]]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum EngineKind {
    /// `vllm serve`: sleep levels 1 and 2 through its dev endpoints.
    #[default]
    Vllm,
    /// `python -m sglang.launch_server`: releases its GPU memory through
    /// `/release_memory_occupation` (see `docs/SGLANG-NOTES.md`).
    Sglang,
    /// Any OpenAI-compatible server (llama-server, TEI, an OCR service):
    /// started, probed on its health path, stopped; no sleep of its own.
    Openai,
}

/// What an engine kind can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Sleep levels it has (empty: it cannot sleep).
    pub sleep_levels: &'static [u8],
    /// It answers whether it sleeps (vLLM's `/is_sleeping`); without it
    /// siesta records the state itself before each transition.
    pub sleep_query: bool,
    /// The Prometheus gauge of its running requests, if it has one.
    pub activity_metric: Option<&'static str>,
    /// Its processes can be CUDA-checkpointed (idle action `suspend`): every
    /// kind siesta runs is a CUDA process (a CPU-only server is refused by
    /// the checkpoint helper at the first suspend, with the reason in the
    /// status). An attached engine never: siesta does not own its
    /// processes, cannot find them by process group, and cannot restart
    /// them when a restore fails.
    pub suspend: bool,
}

impl EngineKind {
    pub const ALL: [EngineKind; 3] = [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Openai];

    /// The config and wire name.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Openai => "openai",
        }
    }

    pub fn parse(s: &str) -> Option<EngineKind> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }

    pub fn capabilities(self) -> Capabilities {
        match self {
            EngineKind::Vllm => Capabilities {
                sleep_levels: &[1, 2],
                sleep_query: true,
                activity_metric: Some("vllm:num_requests_running"),
                suspend: true,
            },
            EngineKind::Sglang => Capabilities {
                sleep_levels: &[1],
                sleep_query: false,
                activity_metric: Some("sglang:num_running_reqs"),
                suspend: true,
            },
            EngineKind::Openai => Capabilities {
                sleep_levels: &[],
                sleep_query: false,
                activity_metric: None,
                suspend: true,
            },
        }
    }

    pub fn can_sleep(self, level: u8) -> bool {
        self.capabilities().sleep_levels.contains(&level)
    }

    /// Its deepest sleep level, if it sleeps at all.
    pub fn deepest_sleep(self) -> Option<u8> {
        self.capabilities().sleep_levels.iter().copied().max()
    }

    /// Whether it can do an idle tier's action (`attach`: siesta does not
    /// run the engine, so it cannot stop it).
    pub fn can(self, action: IdleAction, attach: bool) -> bool {
        match action {
            IdleAction::Sleep(l) => self.can_sleep(l),
            IdleAction::Stop => !attach || self.deepest_sleep().is_some(),
            IdleAction::Suspend => self.capabilities().suspend && !attach,
        }
    }

    /// The idle actions it has, for messages: `"sleep (level 1), stop"`.
    pub fn actions(self, attach: bool) -> String {
        let mut out: Vec<String> = self
            .capabilities()
            .sleep_levels
            .iter()
            .map(|l| format!("sleep (level {l})"))
            .collect();
        if !attach && self.capabilities().suspend {
            out.push("suspend".into());
        }
        if !attach {
            out.push("stop".into());
        }
        if out.is_empty() {
            "none (siesta neither runs nor can put to sleep an attached openai engine)".into()
        } else {
            out.join(", ")
        }
    }

    /// What siesta runs when the model gives no `executable`/`command`.
    /// `None`: the kind has no default (an `openai` server must be named).
    pub fn default_command(self) -> Option<Vec<String>> {
        match self {
            EngineKind::Vllm => Some(vec!["vllm".into()]),
            EngineKind::Sglang => Some(
                ["python", "-m", "sglang.launch_server"]
                    .map(String::from)
                    .to_vec(),
            ),
            EngineKind::Openai => None,
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_capabilities_differ() {
        for k in EngineKind::ALL {
            assert_eq!(EngineKind::parse(k.name()), Some(k));
        }
        assert_eq!(EngineKind::parse("tgi"), None);
        assert!(EngineKind::Vllm.can_sleep(2));
        assert!(EngineKind::Sglang.can_sleep(1) && !EngineKind::Sglang.can_sleep(2));
        assert_eq!(EngineKind::Openai.deepest_sleep(), None);
        assert!(EngineKind::Openai.can(IdleAction::Stop, false));
        assert!(!EngineKind::Openai.can(IdleAction::Stop, true));
        assert!(EngineKind::Sglang.can(IdleAction::Stop, true));
        assert_eq!(
            EngineKind::Sglang.actions(false),
            "sleep (level 1), suspend, stop"
        );
        for k in EngineKind::ALL {
            assert!(k.can(IdleAction::Suspend, false), "{k} suspends");
            assert!(!k.can(IdleAction::Suspend, true), "attached {k} never");
        }
    }
}
