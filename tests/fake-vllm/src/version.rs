//! The vLLM version fake-vllm imitates (`--imitate-version`): what `/version` says and which
//! dev-endpoint behaviour it copies.

/// A parsed `MAJOR.MINOR[.PATCH]` version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Imitated {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch (0 when absent).
    pub patch: u32,
}

impl Imitated {
    /// The first version whose `/sleep` and `/wake_up` answer JSON and that refuses level 3.
    pub const JSON_SLEEP: Imitated = Imitated {
        major: 0,
        minor: 33,
        patch: 0,
    };

    /// The first release read (0.32.0; 0.24.0 does neither, releases between were not read)
    /// whose `AsyncLLM.wake_up` records `vllm:engine_sleep_state` awake only after a full wake
    /// (0.24 records it after every wake, `tags=weights` alone too, while `/is_sleeping` stays
    /// true), and whose executor sleeps again when only its KV cache is asleep (0.24: "already
    /// sleeping" while any tag is).
    pub const SLEEP_REWORK: Imitated = Imitated {
        major: 0,
        minor: 32,
        patch: 0,
    };

    /// The oldest release read whose `/sleep` without `--enable-sleep-mode` sleeps (its worker's
    /// allocator pool is empty: nothing is freed) and answers 200 (`v1/worker/gpu_worker.py`
    /// `sleep` has no check in 0.24.0). Older ones imitated fail it as vLLM's V0 engine did
    /// ("Sleep mode is not enabled in the model config"); releases before 0.24 were not read.
    pub const SLEEP_WITHOUT_FLAG: Imitated = Imitated {
        major: 0,
        minor: 24,
        patch: 0,
    };

    /// The first release read (0.33.0) whose API server binds without `SO_REUSEPORT` unless
    /// it runs several (`--api-server-count` > 1, `entrypoints/cli/serve.py`). 0.24.0 always
    /// sets it (`entrypoints/openai/api_server.py` `create_server_socket`): a second 0.24
    /// engine on a port a 0.24 engine holds binds, and the kernel shares the connections.
    pub const PORT_NOT_SHARED: Imitated = Imitated {
        major: 0,
        minor: 33,
        patch: 0,
    };

    /// Parses `0.33.0`, `0.24` (a suffix like `0.33.0rc1` or `+cu128` is ignored).
    pub fn parse(s: &str) -> Result<Imitated, String> {
        let core = s
            .trim()
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .next()
            .unwrap_or("");
        let mut parts = core.split('.').filter(|p| !p.is_empty());
        let mut next = |what: &str, required: bool| match parts.next() {
            Some(p) => p
                .parse::<u32>()
                .map_err(|e| format!("vLLM version {s:?}: {what}: {e}")),
            None if required => Err(format!(
                "vLLM version {s:?}: expected MAJOR.MINOR[.PATCH], e.g. 0.33.0"
            )),
            None => Ok(0),
        };
        Ok(Imitated {
            major: next("major", true)?,
            minor: next("minor", true)?,
            patch: next("patch", false)?,
        })
    }

    /// `/sleep` answers `{"status":"sleeping","level":N}` and `/wake_up` its status and tags
    /// (0.33 and later); before, both answer an empty 200.
    pub fn json_sleep_bodies(self) -> bool {
        self >= Self::JSON_SLEEP
    }

    /// See [`Imitated::SLEEP_WITHOUT_FLAG`].
    pub fn sleeps_without_flag(self) -> bool {
        self >= Self::SLEEP_WITHOUT_FLAG
    }

    /// See [`Imitated::SLEEP_REWORK`].
    pub fn sleep_rework(self) -> bool {
        self >= Self::SLEEP_REWORK
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_orders() {
        let v = Imitated::parse("0.24.0").unwrap();
        assert!(!v.json_sleep_bodies());
        assert!(Imitated::parse("0.33").unwrap().json_sleep_bodies());
        assert!(
            Imitated::parse("0.33.1rc1+cu128")
                .unwrap()
                .json_sleep_bodies()
        );
        assert!(Imitated::parse("1.0.0").unwrap().json_sleep_bodies());
        assert!(Imitated::parse("latest").is_err());
        assert!(Imitated::parse("1").is_err());
    }
}
