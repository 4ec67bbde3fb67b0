//! The control plane's configuration: one TOML file, validated in one place
//! (shared by the daemon and `siesta config check`).

mod demo;
mod kind;
mod model;
mod read;
mod restart;
pub mod units;
mod validate;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use kind::{Capabilities, EngineKind};
pub use validate::log_file_stem;

/// The whole configuration, with `[defaults]` already applied to each model.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Where the configuration came from (a file path, or `"<demo>"`).
    pub origin: String,
    /// The file it was read from (`None` for the built-in demo).
    pub path: Option<PathBuf>,
    pub control: ControlConfig,
    pub defaults: Defaults,
    /// GPUs listed by hand (`[[gpu]]`), for machines without NVML.
    pub gpus: Vec<GpuConfig>,
    pub models: Vec<ModelConfig>,
}

/// `[control]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlConfig {
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    /// Bearer token required from clients (`SIESTA_TOKEN` also works).
    pub token: Option<String>,
    /// Identity of this control plane (host name unless configured).
    pub control_id: String,
    /// The GPU peer-to-peer probe (`p2p_probe`, `p2p_probe_bytes`, `p2p_probe_timeout`).
    pub p2p_probe: P2pProbeConfig,
    /// How long start-up waits for NVML to load and answer its first read
    /// (`gpu_detect_timeout`, default 2m; the P2P probe's own deadline
    /// comes on top). A GPU off the bus or a driver stuck in a reset can
    /// hang `nvmlInit` for ever; past this the daemon exits with an error
    /// rather than never serving.
    pub gpu_detect_timeout: Duration,
    /// GPU memory placement counts for each asleep model per GPU
    /// (`asleep_residual`; unset: 1 GiB at TP=1, 2.5 GiB per GPU above,
    /// until measured; vLLM leaves 1–7 GiB asleep).
    pub asleep_residual: Option<u64>,
    /// A woken model stays awake at least this long before admission may
    /// put it to sleep for another (`min_awake`, default 2s).
    pub min_awake: Duration,
    /// A model busy with requests keeps GPUs another model waits for at
    /// most this long (`yield_after`, default 10s; `"off"`: until it is
    /// idle). Past it, once that model has waited as long and the busy one
    /// has been awake as long, the busy one yields: new requests for it are
    /// held, those in flight finish, it sleeps, and its held requests are
    /// served on its next turn.
    pub yield_after: Option<Duration>,
    /// How long a connection to an engine may idle in control's pool
    /// (`engine_idle_timeout`, default 4s: below uvicorn's 5 s keep-alive).
    pub engine_idle_timeout: Duration,
    /// The web status page, SSE `/events` and `/metrics` (`web_listen`; off
    /// when unset). A non-loopback address requires the token.
    pub web_listen: Option<SocketAddr>,
    /// The CUDA checkpoint helper a suspend runs (`cuda_checkpoint`;
    /// default: `siesta-cuda-checkpoint` next to the siesta-control binary).
    pub cuda_checkpoint: Option<PathBuf>,
}

/// Default `[control] engine_idle_timeout`: below uvicorn's 5 s keep-alive,
/// so control never sends on a connection vLLM is closing.
pub const DEFAULT_ENGINE_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Default `[control] gpu_detect_timeout`: NVML loads and reads in
/// seconds, even on eight GPUs without the persistence daemon.
pub const DEFAULT_GPU_DETECT_TIMEOUT: Duration = Duration::from_secs(120);

/// Default `[control] min_awake`.
pub const DEFAULT_MIN_AWAKE: Duration = Duration::from_secs(2);

/// How long a wake may wait for room on its GPUs (other models to finish
/// their requests and be put to sleep). A wake that gives up leaves its
/// engine asleep, unharmed, and says why in the model's status; the next
/// demand tries again. As long as the proxy's default `max_hold`.
/// `yield_after` must be shorter, or no busy model would ever yield.
pub const ROOM_WAIT: Duration = Duration::from_secs(300);

/// How the error of a start, wake or restore that found no room within
/// [`ROOM_WAIT`] begins (the runner adds what admission last said it waited
/// for).
pub const NO_ROOM: &str = "no room on its GPUs within";

/// Default `[control] yield_after`.
pub const DEFAULT_YIELD_AFTER: Duration = Duration::from_secs(10);

/// The longest deadline a P2P probe may have (`p2p_probe_timeout`, or a
/// `DiagP2p` call's): probes run one at a time, and a hung one holds every
/// later one until its deadline.
pub const PROBE_TIMEOUT_MAX: Duration = Duration::from_secs(3600);

/// When and how the GPU peer-to-peer probe runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pProbeConfig {
    /// `p2p_probe = "start"` (default): probe before engines start, when the
    /// box has two GPUs or more and none is in use; `"off"`: only on
    /// `siesta diag p2p`. Results persist in `STATE_DIR/p2p.json` either way.
    pub at_start: bool,
    /// Bytes copied per pair (`p2p_probe_bytes`, default 256 MiB).
    pub bytes: u64,
    /// Deadline of the whole probe (`p2p_probe_timeout`, default 120s).
    pub timeout: Duration,
}

impl Default for P2pProbeConfig {
    fn default() -> Self {
        Self {
            at_start: true,
            bytes: 256 << 20,
            timeout: Duration::from_secs(120),
        }
    }
}

/// `[defaults]`: what each model gets unless it says otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct Defaults {
    pub idle: Vec<IdleTier>,
    pub max_queue: u32,
    pub max_hold: Duration,
    pub timeouts: Timeouts,
    pub backoff: Backoff,
}

/// Deadlines of each transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Spawn until `/health` answers 200 (`start_timeout`).
    pub start: Duration,
    /// All wake calls (`wake_timeout`).
    pub wake: Duration,
    /// `POST /sleep` (`sleep_timeout`).
    pub sleep: Duration,
    /// SIGTERM until SIGKILL (`stop_grace`).
    pub stop_grace: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            start: Duration::from_secs(900),
            wake: Duration::from_secs(300),
            sleep: Duration::from_secs(120),
            stop_grace: Duration::from_secs(30),
        }
    }
}

/// Retry delays after a failure: doubling from `initial`, capped at `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(2),
            max: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// Delay before retry number `failures` (1-based).
    pub fn delay(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(30);
        self.initial
            .checked_mul(1u32 << shift)
            .unwrap_or(self.max)
            .min(self.max)
    }
}

/// `[[gpu]]`: a GPU listed by hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuConfig {
    pub index: u32,
    pub name: String,
    pub memory_bytes: u64,
}

/// What an idle tier does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleAction {
    Sleep(u8),
    Stop,
    /// Checkpoint the engine's GPU state to host memory (CUDA driver r570+).
    Suspend,
}

/// After `after` without activity, do `action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleTier {
    pub after: Duration,
    pub action: IdleAction,
}

/// What a model is at boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preload {
    #[default]
    None,
    Asleep,
    Awake,
}

/// How much of each GPU a model takes when awake.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GpuMemory {
    Fraction(f64),
    Bytes(u64),
}

/// How the engine is run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launch {
    /// siesta spawns `command... serve MODEL --host HOST --port PORT ...`
    /// (vLLM; see `supervisor::spawn_spec` for the other kinds).
    Process {
        command: Vec<String>,
        host: String,
        port: Option<u16>,
    },
    /// Someone else runs it at `url`; siesta only probes, sleeps and wakes it.
    Attach {
        url: String,
        served_model_name: String,
    },
}

/// `[[model]]` with defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub name: String,
    pub aliases: Vec<String>,
    pub model: String,
    /// `engine`: which server runs it (default vLLM).
    pub engine: EngineKind,
    /// `health_path`: what `openai` engines are probed on (default `/health`).
    pub health_path: String,
    pub launch: Launch,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub gpus: u32,
    pub gpu_memory: Option<GpuMemory>,
    pub gpu_ids: Vec<u32>,
    pub exclusive: bool,
    pub idle: Vec<IdleTier>,
    pub preload: Preload,
    pub max_queue: u32,
    pub max_hold: Duration,
    pub timeouts: Timeouts,
    pub backoff: Backoff,
}

impl ModelConfig {
    pub fn is_attach(&self) -> bool {
        matches!(self.launch, Launch::Attach { .. })
    }

    /// A multi-GPU engine with a `suspend` idle tier: siesta starts it with
    /// no GPU memory shared between its processes (no CUDA IPC: NCCL P2P
    /// and cuMem off, no custom or symmetric-memory all-reduce), because
    /// the CUDA driver cannot restore a checkpointed process that shares
    /// device memory with another (`CUDA_ERROR_NOT_SUPPORTED`, measured on
    /// two H200s with vLLM 0.24 TP=2). Only such an engine may be suspended.
    pub fn checkpointable_multi_gpu(&self) -> bool {
        self.gpus > 1 && self.idle.iter().any(|t| t.action == IdleAction::Suspend)
    }

    /// "process" or "attach".
    pub fn launch_kind(&self) -> &'static str {
        if self.is_attach() {
            "attach"
        } else {
            "process"
        }
    }
}

/// One problem in a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path, e.g. `model[1].idle[0].after`.
    pub key: String,
    pub message: String,
}

/// Every problem found in a configuration file. Display: one line per
/// problem, `FILE: KEY: what is wrong`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub origin: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            if p.key.is_empty() {
                write!(f, "{}: {}", self.origin, p.message)?;
            } else {
                write!(f, "{}: {}: {}", self.origin, p.key, p.message)?;
            }
        }
        Ok(())
    }
}

/// Whether listening on `addr` with `token` is refused: an address beyond
/// loopback needs a token. The one rule for siesta-control's gRPC and web
/// listeners and for `siesta config check`.
pub fn needs_token(addr: SocketAddr, token: Option<&str>) -> bool {
    !addr.ip().is_loopback() && token.is_none()
}

impl Config {
    /// The bearer token clients must send: `[control] token`, else
    /// `SIESTA_TOKEN` (an empty one is none).
    pub fn token(&self) -> Option<String> {
        self.control
            .token
            .clone()
            .or_else(|| std::env::var("SIESTA_TOKEN").ok())
            .filter(|t| !t.is_empty())
    }

    /// What siesta-control refuses to start with: `[control] listen` or
    /// `web_listen` beyond loopback with no token ([`Config::token`]), one
    /// problem per key. The daemon checks the addresses it binds (`--listen`
    /// overrides `listen`); `siesta config check` the file's.
    pub fn check_tokens(&self) -> Result<(), ConfigError> {
        let token = self.token();
        let mut problems: Vec<Problem> = [
            Some(("control.listen", self.control.listen)),
            self.control.web_listen.map(|a| ("control.web_listen", a)),
        ]
        .into_iter()
        .flatten()
        .filter(|(_, addr)| needs_token(*addr, token.as_deref()))
        .map(|(key, addr)| Problem {
            key: key.into(),
            message: format!(
                "{addr} is beyond loopback and no token is set: siesta-control refuses to start (set [control] token or SIESTA_TOKEN)"
            ),
        })
        .collect();
        problems.extend(self.unsendable_token());
        if problems.is_empty() {
            return Ok(());
        }
        Err(ConfigError {
            origin: self.origin.clone(),
            problems,
        })
    }

    /// A token travels as `authorization: Bearer TOKEN`: one that holds a
    /// space, a control character or non-ASCII cannot, and every gRPC
    /// client would be refused. The token itself is not shown (a secret).
    pub fn unsendable_token(&self) -> Option<Problem> {
        let token = self.token()?;
        if token.bytes().all(|b| (0x21..0x7f).contains(&b)) {
            return None;
        }
        let key = if self.control.token.is_some() {
            "control.token"
        } else {
            "SIESTA_TOKEN"
        };
        Some(Problem {
            key: key.into(),
            message: "holds characters a request header cannot carry (a space, a control \
                      character or non-ASCII): every client would be refused; use visible \
                      ASCII only"
                .into(),
        })
    }

    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            origin: origin.clone(),
            problems: vec![Problem {
                key: String::new(),
                message: format!("cannot read: {e}"),
            }],
        })?;
        let mut cfg = Self::parse(&text, &origin)?;
        cfg.path = Some(path.to_path_buf());
        Ok(cfg)
    }

    /// Validates configuration text; `origin` names the file in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        validate::parse(text, origin)
    }

    /// The built-in demo: fake-vllm engines run as `command_prefix... serve ...`.
    pub fn demo(command_prefix: Vec<String>) -> Config {
        demo::demo(command_prefix)
    }

    /// A model by name or alias.
    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models
            .iter()
            .find(|m| m.name == name || m.aliases.iter().any(|a| a == name))
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_args;
#[cfg(test)]
mod tests_kinds;
#[cfg(test)]
mod tests_ports;
#[cfg(test)]
mod tests_restart;
