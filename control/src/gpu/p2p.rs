//! Peer-to-peer health: the verdicts, the matrix placement reads, and the
//! parent side of the probe (a child process, `siesta-p2p-probe`, run with a
//! deadline because a broken P2P path can hang rather than fail).
//!
//! Protocol: the child prints one JSON object per line on stdout, flushed as
//! it goes ([`ProbeLine`]): `start`, then one `pair` per ordered pair, then
//! `done`. Pairs it finished survive a hang; the rest are marked `hung`.

pub mod persist;
mod run;

pub use run::{ProbeError, ProbeOptions, default_probe_bin, run_probe};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The probe's verdict for one ordered pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum P2pHealth {
    /// The pattern arrived intact.
    Ok,
    /// Copies completed but elements arrived wrong.
    Corrupt,
    /// Peer access cannot be enabled between the pair.
    Unsupported,
    /// The copy did not finish before the deadline.
    Hung,
    /// The probe failed for another reason (see detail).
    Error,
}

impl P2pHealth {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Corrupt => "corrupt",
            Self::Unsupported => "unsupported",
            Self::Hung => "hung",
            Self::Error => "error",
        }
    }
}

/// One ordered pair's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct P2pResult {
    pub src: u32,
    pub dst: u32,
    pub health: P2pHealth,
    /// Elements (u32) checked, and how many arrived wrong.
    #[serde(default)]
    pub elements: u64,
    #[serde(default)]
    pub corrupt_elements: u64,
    /// Measured copy bandwidth in GB/s (0: not measured).
    #[serde(default)]
    pub bandwidth_gbps: f64,
    /// The driver's own answer (cuDeviceCanAccessPeer), never trusted alone.
    #[serde(default)]
    pub driver_says: String,
    #[serde(default)]
    pub detail: String,
}

impl P2pResult {
    /// A pair the probe never reported on.
    pub fn missing(src: u32, dst: u32, health: P2pHealth, detail: impl Into<String>) -> Self {
        Self {
            src,
            dst,
            health,
            elements: 0,
            corrupt_elements: 0,
            bandwidth_gbps: 0.0,
            driver_says: String::new(),
            detail: detail.into(),
        }
    }
}

/// One line of the probe's stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum ProbeLine {
    /// The probe initialised CUDA and found `devices` GPUs.
    Start { devices: u32, bytes: u64 },
    /// A finished pair.
    Pair(P2pResult),
    /// All pairs are done.
    Done,
    /// The probe could not run at all (no libcuda, cuInit failed).
    Fatal { detail: String },
}

/// The P2P verdicts of a box, by ordered pair.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct P2pMatrix {
    results: BTreeMap<(u32, u32), P2pResult>,
}

impl P2pMatrix {
    pub fn new(results: impl IntoIterator<Item = P2pResult>) -> Self {
        Self {
            results: results.into_iter().map(|r| ((r.src, r.dst), r)).collect(),
        }
    }

    /// A matrix of only these healths (tests, injected faults).
    pub fn from_healths(entries: &[(u32, u32, P2pHealth)]) -> Self {
        Self::new(
            entries
                .iter()
                .map(|&(s, d, h)| P2pResult::missing(s, d, h, "")),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.results.is_empty()
    }

    pub fn get(&self, src: u32, dst: u32) -> Option<&P2pResult> {
        self.results.get(&(src, dst))
    }

    pub fn results(&self) -> impl Iterator<Item = &P2pResult> {
        self.results.values()
    }

    /// The verdict on an unordered pair: both directions must be `ok`.
    /// `None` if either direction was never probed.
    pub fn pair(&self, a: u32, b: u32) -> PairVerdict {
        let one = self.get(a, b).map(|r| r.health);
        let two = self.get(b, a).map(|r| r.health);
        match (one, two) {
            (Some(P2pHealth::Ok), Some(P2pHealth::Ok)) => PairVerdict::Ok,
            (Some(h), _) if h != P2pHealth::Ok => PairVerdict::Bad(a, b, h),
            (_, Some(h)) if h != P2pHealth::Ok => PairVerdict::Bad(b, a, h),
            _ => PairVerdict::Unknown,
        }
    }

    /// The first pair of `gpus` that is not known to be `ok`, if any.
    pub fn first_not_ok(&self, gpus: &[u32]) -> Option<PairVerdict> {
        for (i, &a) in gpus.iter().enumerate() {
            for &b in &gpus[i + 1..] {
                let v = self.pair(a, b);
                if v != PairVerdict::Ok {
                    return Some(v);
                }
            }
        }
        None
    }
}

/// What is known of an unordered GPU pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairVerdict {
    /// Both directions arrived intact.
    Ok,
    /// This direction (src, dst) is not ok.
    Bad(u32, u32, P2pHealth),
    /// Not probed (or only partly).
    Unknown,
}

impl std::fmt::Display for PairVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ok => write!(f, "ok"),
            Self::Bad(s, d, h) => write!(f, "GPU {s}→{d} is {}", h.as_str()),
            Self::Unknown => write!(f, "not probed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use P2pHealth::*;

    #[test]
    fn probe_lines_round_trip() {
        let line = r#"{"kind":"pair","src":0,"dst":1,"health":"corrupt","elements":10,"corrupt_elements":9,"bandwidth_gbps":20.5,"driver_says":"can-access-peer","detail":""}"#;
        let parsed: ProbeLine = serde_json::from_str(line).unwrap();
        let ProbeLine::Pair(r) = &parsed else {
            panic!("{parsed:?}")
        };
        assert_eq!(
            (r.src, r.dst, r.health, r.corrupt_elements),
            (0, 1, Corrupt, 9)
        );
        let again: ProbeLine =
            serde_json::from_str(&serde_json::to_string(&parsed).unwrap()).unwrap();
        assert_eq!(again, parsed);
        let start: ProbeLine =
            serde_json::from_str(r#"{"kind":"start","devices":2,"bytes":5}"#).unwrap();
        assert_eq!(
            start,
            ProbeLine::Start {
                devices: 2,
                bytes: 5
            }
        );
    }

    #[test]
    fn a_pair_is_ok_only_if_both_directions_are() {
        // The seeds' box on 2026-08-17: only GPU2-sourced copies are clean.
        let m = P2pMatrix::from_healths(&[
            (0, 1, Corrupt),
            (0, 2, Corrupt),
            (1, 0, Corrupt),
            (1, 2, Corrupt),
            (2, 0, Ok),
            (2, 1, Ok),
        ]);
        assert_eq!(m.pair(0, 1), PairVerdict::Bad(0, 1, Corrupt));
        assert_eq!(m.pair(2, 0), PairVerdict::Bad(0, 2, Corrupt));
        assert_eq!(m.pair(2, 1).to_string(), "GPU 1→2 is corrupt");
        assert!(m.first_not_ok(&[2]).is_none());
        assert!(m.first_not_ok(&[0, 1, 2]).is_some());
    }

    #[test]
    fn unprobed_and_partial_pairs_are_unknown() {
        let m = P2pMatrix::from_healths(&[(0, 1, Ok)]);
        assert_eq!(m.pair(0, 1), PairVerdict::Unknown);
        assert_eq!(m.pair(0, 2), PairVerdict::Unknown);
        let m = P2pMatrix::from_healths(&[(0, 1, Ok), (1, 0, Hung)]);
        assert_eq!(m.pair(0, 1), PairVerdict::Bad(1, 0, Hung));
        let m = P2pMatrix::from_healths(&[(0, 1, Ok), (1, 0, Unsupported)]);
        assert_eq!(
            m.first_not_ok(&[0, 1]),
            Some(PairVerdict::Bad(1, 0, Unsupported))
        );
        let m = P2pMatrix::from_healths(&[(0, 1, Ok), (1, 0, Ok)]);
        assert_eq!(m.first_not_ok(&[0, 1]), None);
    }
}
