//! Command line: vLLM's `serve` argv (the vLLM flags listed in [`crate::argv`] are accepted
//! and ignored, others refused like argparse), plus the simulation and fault-injection knobs,
//! each also read from `FAKE_VLLM_<FLAG>`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Args, Parser, Subcommand};

use crate::argv::{self, ArgvError};

/// `serve --help` epilogue: which defaults resemble real vLLM and how to get them.
const REALISTIC: &str = "\
Timing defaults are short so tests run fast. vLLM 0.24.0 on H200s measured (tiny model;
scripts/vllm-check, docs/vllm-check-output.txt, 2026-11-30):
  start-up 42-104 s (53-94 s there; 95 s at TP=2)   --startup-time 60s
  level-1 sleep 0.11-0.14 s                          --sleep-time 120ms
  level-1 wake 0.04-0.4 s (41-68 ms there)           --wake-time 60ms
  level-2 wake with reload 0.26-0.65 s               --wake-time 60ms --reload-time 200ms
  asleep residual 836 MiB at TP=1, 2,204 MiB per GPU at TP=2 (--asleep-residual-mib, the
  default already follows TP).
A simulated GPU (memory check at start-up, per-GPU accounting shared by engines) is on when
FAKE_VLLM_GPU_TOTAL_BYTES and FAKE_VLLM_GPU_DIR are set; GPUs come from CUDA_VISIBLE_DEVICES.";

/// `fake-vllm`: a stand-in for `vllm serve`.
#[derive(Debug, Parser)]
#[command(
    name = "fake-vllm",
    version,
    about = "A stand-in for `vllm serve`: same argv, endpoints, sleep mode and SSE, no GPU.",
    args_override_self = true
)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve a model over HTTP like `vllm serve`. Common vLLM flags not listed here are
    /// accepted and ignored; unknown ones exit with status 2 like vLLM's argparse.
    #[command(after_long_help = REALISTIC)]
    Serve(Box<ServeArgs>),
    /// Internal: the engine-core child process.
    #[command(hide = true, name = "engine-core")]
    EngineCore(EngineCoreArgs),
    /// Internal: a tensor-parallel worker (child of the engine core).
    #[command(hide = true, name = "worker")]
    Worker(WorkerArgs),
}

/// `serve` arguments.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The model (name or path), as in `vllm serve MODEL`.
    #[arg(value_name = "MODEL")]
    pub model_tag: Option<String>,
    /// The model, when not given as the positional argument.
    #[arg(long = "model", value_name = "MODEL")]
    pub model_flag: Option<String>,
    /// Host to bind.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    /// Port to bind (0: any free port; the chosen one is printed in the uvicorn line).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Names the model is served as (default: MODEL).
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub served_model_name: Vec<String>,
    /// Keys clients must send as `Authorization: Bearer KEY` on every path under `/v1`
    /// (else 401 `{"error": "Unauthorized"}`), as vLLM's `AuthenticationMiddleware`; other
    /// paths (`/health`, `/metrics`, the dev routes) stay open. `VLLM_API_KEY` when not given.
    #[arg(long, num_args = 1.., value_name = "KEY")]
    pub api_key: Vec<String>,
    /// Enable the sleep endpoints' engine support (/sleep, /wake_up need it).
    #[arg(long)]
    pub enable_sleep_mode: bool,
    /// Tensor-parallel size (`-tp` too): number of results of /collective_rpc.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: u32,
    /// API server processes, as vLLM's `--api-server-count` (several share the port and
    /// one engine core): modelled as one API server's serving threads (two) each, in this
    /// one process, so a benchmark can give the engine the front end a busy vLLM would run.
    /// 0, vLLM's headless engine (no HTTP server), is not modelled and is refused.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub api_server_count: u16,
    /// Context length reported by /v1/models.
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: u64,
    /// Fraction (0 < f <= 1) of each GPU's TOTAL memory this engine takes; start-up fails
    /// when less is free (only checked with a simulated GPU, see below).
    #[arg(long, default_value_t = 0.92, value_parser = parse_fraction)]
    pub gpu_memory_utilization: f64,
    /// `pooling` makes an embedding model (`/v1/embeddings` exists only then). The older
    /// `--task embed` is refused, as vLLM 0.24 and later refuse it.
    #[arg(long, value_parser = ["auto", "generate", "pooling", "draft"])]
    pub runner: Option<String>,
    /// Seconds a SIGTERM lets the requests in flight finish (vLLM 0.18+): 0 aborts them
    /// (`finish_reason: "abort"`); either way the listener closes at once and a request
    /// that still reaches the server gets 500 "cannot schedule new futures after shutdown"
    /// (vLLM 0.24 on the GPU machine). Past it, those still running fail as with a dead
    /// engine core.
    #[arg(long, default_value_t = 0)]
    pub shutdown_timeout: u64,
    /// No stats: every `vllm:` metric is gone from `/metrics` (running, waiting, sleep state).
    #[arg(long)]
    pub disable_log_stats: bool,
    /// Which server to imitate: `vllm`; `sglang` (`fake-vllm --personality sglang
    /// --model-path M ...` takes SGLang's argv, serves its routes and dies like it when
    /// something reaches released memory); `openai` (a plain OpenAI server: no dev routes,
    /// no `/metrics`). Given first, before `serve`.
    #[arg(long, default_value = "vllm", value_parser = ["vllm", "sglang", "openai"])]
    pub personality: String,
    /// SGLang's `--enable-memory-saver` (the sglang argv sets it).
    #[arg(long, hide = true)]
    pub sglang_memory_saver: bool,
    /// SGLang's `--enable-weights-cpu-backup` (the sglang argv sets it).
    #[arg(long, hide = true)]
    pub sglang_weights_cpu_backup: bool,
    /// SGLang's `--enable-metrics` (the sglang argv sets it).
    #[arg(long, hide = true)]
    pub sglang_metrics: bool,
    /// Simulation knobs.
    #[command(flatten)]
    pub sim: SimArgs,
    /// Fault injection.
    #[command(flatten)]
    pub faults: FaultArgs,
}

impl ServeArgs {
    /// The model path/name (`MODEL` or `--model`), default `fake-model`.
    pub fn model(&self) -> String {
        self.model_tag
            .clone()
            .or_else(|| self.model_flag.clone())
            .unwrap_or_else(|| "fake-model".to_string())
    }

    /// Whether this is a pooling (embedding) model: `--runner pooling`.
    pub fn pooling(&self) -> bool {
        self.runner.as_deref() == Some("pooling")
    }

    /// GPU memory held asleep, per GPU: `--asleep-residual-mib`, else vLLM's measured 836 MiB
    /// at TP=1 and 2,204 MiB per GPU at TP>1.
    pub fn asleep_residual_bytes(&self) -> u64 {
        let mib = self
            .sim
            .asleep_residual_mib
            .unwrap_or(if self.tensor_parallel_size > 1 {
                2204
            } else {
                836
            });
        mib << 20
    }

    /// `--personality sglang`.
    pub fn sglang(&self) -> bool {
        self.personality == "sglang"
    }

    /// `--personality openai`.
    pub fn plain_openai(&self) -> bool {
        self.personality == "openai"
    }

    /// The API keys in force: `--api-key`, else a non-empty `VLLM_API_KEY` (vLLM's
    /// `args.api_key or [envs.VLLM_API_KEY]`, empty keys dropped).
    pub fn api_keys(&self) -> Vec<String> {
        let keys = if self.api_key.is_empty() {
            std::env::var("VLLM_API_KEY").ok().into_iter().collect()
        } else {
            self.api_key.clone()
        };
        keys.into_iter().filter(|k| !k.is_empty()).collect()
    }

    /// The served names: `--served-model-name`, else the model.
    pub fn served_names(&self) -> Vec<String> {
        if self.served_model_name.is_empty() {
            vec![self.model()]
        } else {
            self.served_model_name.clone()
        }
    }
}

/// Simulation knobs (fake-vllm only).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Simulation (fake-vllm only)")]
pub struct SimArgs {
    /// Time from launch until HTTP is served. The port is bound at once but, as in vLLM, not
    /// listened on: connections are refused until then.
    #[arg(long, env = "FAKE_VLLM_STARTUP_TIME", default_value = "200ms", value_parser = parse_duration)]
    pub startup_time: Duration,
    /// Time a /sleep takes.
    #[arg(long, env = "FAKE_VLLM_SLEEP_TIME", default_value = "50ms", value_parser = parse_duration)]
    pub sleep_time: Duration,
    /// Time a /wake_up of the weights takes (a level-1 wake).
    #[arg(long, env = "FAKE_VLLM_WAKE_TIME", default_value = "100ms", value_parser = parse_duration)]
    pub wake_time: Duration,
    /// Time `collective_rpc reload_weights` takes (level-2 wake).
    #[arg(long, env = "FAKE_VLLM_RELOAD_TIME", default_value = "100ms", value_parser = parse_duration)]
    pub reload_time: Duration,
    /// Time each request's prefill takes before its first token, in 100 ms chunks as vLLM's
    /// chunked prefill steps: it counts as running and generates nothing (vLLM counts its
    /// prompt tokens only with the first token), while the KV-cache gauge grows at every
    /// chunk; a paused scheduler holds it between chunks. 0: none.
    #[arg(long, env = "FAKE_VLLM_PREFILL_TIME", default_value = "0ms", value_parser = parse_duration)]
    pub prefill_time: Duration,
    /// Generation pace per request; 0 means no pacing at all.
    #[arg(long, env = "FAKE_VLLM_TOKENS_PER_SECOND", default_value_t = 0.0)]
    pub tokens_per_second: f64,
    /// max_tokens when a request gives none.
    #[arg(long, env = "FAKE_VLLM_MAX_TOKENS_DEFAULT", default_value_t = 16)]
    pub max_tokens_default: u64,
    /// Real-GPU memory backend (feature `cuda`): bytes of device memory to hold (weights and
    /// KV cache) and move on sleep and wake. Without the feature it is ignored.
    #[arg(long, env = "FAKE_VLLM_GPU_MEMORY", value_name = "BYTES")]
    pub gpu_memory: Option<u64>,
    /// The vLLM version to imitate: `/version`, and the `/sleep` and `/wake_up` bodies (empty
    /// before 0.33, JSON from 0.33) and accepted sleep levels.
    #[arg(long, env = "FAKE_VLLM_IMITATE_VERSION", default_value = "0.33.0", value_parser = parse_version)]
    pub imitate_version: String,
    /// GPU memory (MiB per GPU) still held while asleep [default: 836 at TP=1, 2204 at TP>1].
    #[arg(long, env = "FAKE_VLLM_ASLEEP_RESIDUAL_MIB", value_name = "MIB")]
    pub asleep_residual_mib: Option<u64>,
    /// Simulated GPU: total bytes of each GPU. With --sim-gpu-dir, start-up needs
    /// `--gpu-memory-utilization` x this free on every GPU in CUDA_VISIBLE_DEVICES (default 0).
    #[arg(long, env = "FAKE_VLLM_GPU_TOTAL_BYTES", value_name = "BYTES")]
    pub sim_gpu_total_bytes: Option<u64>,
    /// Simulated GPU: directory where live fake engines record what they use of each GPU,
    /// shared by every engine on the "machine".
    #[arg(long, env = "FAKE_VLLM_GPU_DIR", value_name = "DIR")]
    pub sim_gpu_dir: Option<PathBuf>,
}

/// Fault injection (fake-vllm only).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Fault injection (fake-vllm only)")]
pub struct FaultArgs {
    /// Exit with status 1 when start-up would finish, never serving HTTP.
    #[arg(long, env = "FAKE_VLLM_EXIT_DURING_STARTUP", value_parser = BoolishValueParser::new())]
    pub exit_during_startup: bool,
    /// Crash (exit 1, engine core killed) when generation request N+1 arrives.
    #[arg(long, env = "FAKE_VLLM_CRASH_AFTER_REQUESTS", value_name = "N")]
    pub crash_after_requests: Option<u64>,
    /// /wake_up never returns and the engine stays asleep.
    #[arg(long, env = "FAKE_VLLM_HANG_ON_WAKE", value_parser = BoolishValueParser::new())]
    pub hang_on_wake: bool,
    /// Start-up never finishes: the port is bound, connections are refused forever.
    #[arg(long, env = "FAKE_VLLM_HANG_ON_STARTUP", value_parser = BoolishValueParser::new())]
    pub hang_on_startup: bool,
    /// This long after start-up, /health and /ping answer 503 and generation 500 (engine dead).
    #[arg(long, env = "FAKE_VLLM_FAIL_HEALTH_AFTER", value_parser = parse_duration, value_name = "DURATION")]
    pub fail_health_after: Option<Duration>,
    /// Kinder than vLLM: the engine core exits when its server is gone. By default it outlives
    /// a SIGKILLed server holding its GPU memory, like vLLM's does (vllm#55510).
    #[arg(long, env = "FAKE_VLLM_ENGINE_CORE_DIES_WITH_PARENT", value_parser = BoolishValueParser::new())]
    pub engine_core_dies_with_parent: bool,
    /// Old spelling of the default (the engine core outlives a SIGKILLed server).
    #[arg(long, hide = true, value_parser = BoolishValueParser::new())]
    pub orphan_engine_core: bool,
}

/// Arguments of the hidden engine-core child.
#[derive(Debug, Clone, Args)]
pub struct EngineCoreArgs {
    /// The server's pid.
    #[arg(long)]
    pub parent_pid: i32,
    /// Exit when the parent is gone (not vLLM's behaviour).
    #[arg(long)]
    pub dies_with_parent: bool,
    /// Worker processes to start (one per GPU when > 1).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: u32,
}

/// Arguments of the hidden worker.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Tensor-parallel rank.
    #[arg(long)]
    pub rank: u32,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        Ok(f) => Err(format!("{f} is not in (0, 1]")),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

fn parse_version(s: &str) -> Result<String, String> {
    crate::version::Imitated::parse(s).map(|_| s.trim().to_string())
}

/// Parses `1.5s`, `300ms`, `2m`, `100us`, `0`, a bare number of seconds, or humantime
/// forms such as `1m 30s`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if let Ok(n) = num.parse::<f64>() {
        let scale = match unit.trim() {
            "" | "s" | "sec" | "secs" => Some(1.0),
            "ms" => Some(1e-3),
            "us" | "µs" => Some(1e-6),
            "ns" => Some(1e-9),
            "m" | "min" => Some(60.0),
            "h" => Some(3600.0),
            _ => None,
        };
        if let Some(scale) = scale {
            return Duration::try_from_secs_f64(n * scale).map_err(|e| format!("{s:?}: {e}"));
        }
    }
    humantime::parse_duration(t).map_err(|e| format!("invalid duration {s:?}: {e}"))
}

/// Parses argv (including argv[0]) after [`argv::normalize`].
pub fn parse<I, T>(args: I) -> Result<Cli, ArgvError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    Ok(Cli::try_parse_from(argv::normalize(args)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(args: &[&str]) -> ServeArgs {
        let mut v = vec!["fake-vllm", "serve"];
        v.extend_from_slice(args);
        match parse(v).unwrap().command {
            Command::Serve(s) => *s,
            Command::EngineCore(_) | Command::Worker(_) => panic!("not serve"),
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("300ms").unwrap(), Duration::from_millis(300));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1m 30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn vllm_argv_with_unknown_flags() {
        let s = serve(&[
            "Qwen/Qwen3-0.6B",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--max-model-len",
            "4096",
            "--served-model-name",
            "a",
            "b",
            "--enable-sleep-mode",
            "--dtype",
            "bfloat16",
            "--disable-custom-all-reduce",
            "-tp",
            "2",
            "--gpu-memory-utilization",
            "0.4",
            "--seed",
            "-1",
            "--trust-remote-code",
            "--compilation-config={\"level\":3}",
            "--runner",
            "pooling",
            "--startup-time",
            "1.5s",
        ]);
        assert_eq!(s.model(), "Qwen/Qwen3-0.6B");
        assert_eq!((s.host.as_str(), s.port), ("127.0.0.1", 0));
        assert_eq!(s.served_names(), vec!["a", "b"]);
        assert!(s.enable_sleep_mode);
        assert_eq!(s.tensor_parallel_size, 2);
        assert_eq!(s.max_model_len, 4096);
        assert_eq!(s.gpu_memory_utilization, 0.4);
        assert!(s.pooling());
        assert_eq!(s.sim.startup_time, Duration::from_millis(1500));
    }

    #[test]
    fn defaults_are_quick_and_later_flags_win() {
        let s = serve(&["m", "--port", "1", "--port", "2", "--model", "ignored"]);
        assert_eq!(s.port, 2);
        assert_eq!(s.model(), "m");
        assert_eq!(s.served_names(), vec!["m"]);
        assert!(s.sim.startup_time < Duration::from_secs(1));
        assert!(s.sim.wake_time < Duration::from_secs(1));
        assert_eq!(s.sim.tokens_per_second, 0.0);
        assert!(!s.faults.hang_on_wake && s.faults.crash_after_requests.is_none());
        assert_eq!(s.gpu_memory_utilization, 0.92);
        assert_eq!(s.sim.imitate_version, "0.33.0");
        assert_eq!(s.asleep_residual_bytes(), 836 << 20);
        assert!(!s.pooling() && !s.faults.engine_core_dies_with_parent);
        let s = serve(&[
            "--model",
            "x",
            "--crash-after-requests",
            "3",
            "--fail-health-after",
            "2s",
        ]);
        assert_eq!(s.model(), "x");
        assert_eq!(s.faults.crash_after_requests, Some(3));
        assert_eq!(s.faults.fail_health_after, Some(Duration::from_secs(2)));
    }

    #[test]
    fn help_lists_every_knob() {
        use clap::CommandFactory;
        let help = Cli::command()
            .find_subcommand_mut("serve")
            .unwrap()
            .render_long_help()
            .to_string();
        for knob in [
            "--startup-time",
            "--sleep-time",
            "--wake-time",
            "--reload-time",
            "--tokens-per-second",
            "--max-tokens-default",
            "--exit-during-startup",
            "--crash-after-requests",
            "--hang-on-wake",
            "--hang-on-startup",
            "--fail-health-after",
            "FAKE_VLLM_WAKE_TIME",
            "--imitate-version",
            "--asleep-residual-mib",
            "FAKE_VLLM_GPU_TOTAL_BYTES",
            "FAKE_VLLM_GPU_DIR",
            "--engine-core-dies-with-parent",
            "42-104 s",
        ] {
            assert!(help.contains(knob), "{knob} missing from --help");
        }
    }
}
