//! Command line: vLLM's `serve` argv (unknown vLLM flags are accepted and ignored), plus the
//! simulation and fault-injection knobs, each also read from `FAKE_VLLM_<FLAG>`.

use std::ffi::OsString;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Args, CommandFactory, Parser, Subcommand};

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
    /// Serve a model over HTTP like `vllm serve`. vLLM flags not listed here are accepted and
    /// ignored.
    Serve(Box<ServeArgs>),
    /// Internal: the engine-core child process (waits until its parent is gone).
    #[command(hide = true, name = "engine-core")]
    EngineCore(EngineCoreArgs),
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
    /// Enable the sleep endpoints' engine support (/sleep, /wake_up need it).
    #[arg(long)]
    pub enable_sleep_mode: bool,
    /// Tensor-parallel size (`-tp` too): number of results of /collective_rpc.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: u32,
    /// Context length reported by /v1/models.
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: u64,
    /// Accepted like vLLM's flag; not modelled.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
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
    /// The engine-core child outlives a SIGKILLed server, like vLLM's does (vllm#55510).
    #[arg(long, env = "FAKE_VLLM_ORPHAN_ENGINE_CORE", value_parser = BoolishValueParser::new())]
    pub orphan_engine_core: bool,
}

/// Arguments of the hidden engine-core child.
#[derive(Debug, Clone, Args)]
pub struct EngineCoreArgs {
    /// The server's pid; the child exits when its parent is no longer this.
    #[arg(long)]
    pub parent_pid: i32,
    /// Keep running after the parent is gone.
    #[arg(long)]
    pub orphan: bool,
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

/// vLLM flags that take no value (so a following word is not eaten as theirs).
const VLLM_BOOL_FLAGS: &[&str] = &[
    "trust-remote-code",
    "enforce-eager",
    "async-scheduling",
    "skip-tokenizer-init",
    "headless",
];

/// Drops the vLLM flags that `serve` does not model (and their value), so clap accepts any
/// vLLM command line. Only arguments after `serve` are filtered.
pub fn filter_argv(args: Vec<OsString>) -> Vec<OsString> {
    let Some(serve_at) = args.iter().position(|a| a == "serve") else {
        return args;
    };
    let cmd = Cli::command();
    let serve = cmd.find_subcommand("serve").expect("serve subcommand");
    let mut known: Vec<String> = vec!["help".into()];
    for a in serve.get_arguments() {
        known.extend(a.get_long().map(str::to_string));
        known.extend(
            a.get_all_aliases()
                .unwrap_or_default()
                .into_iter()
                .map(str::to_string),
        );
    }
    let mut out: Vec<OsString> = args[..=serve_at].to_vec();
    let mut rest = args[serve_at + 1..].iter().peekable();
    while let Some(arg) = rest.next() {
        let s = arg.to_string_lossy();
        if s == "-tp" {
            out.push("--tensor-parallel-size".into());
            continue;
        }
        if s == "--" || !s.starts_with('-') || s == "-h" || is_number(&s) {
            out.push(arg.clone());
            continue;
        }
        let name = s.trim_start_matches('-');
        let (name, has_value) = match name.split_once('=') {
            Some((n, _)) => (n, true),
            None => (name, false),
        };
        if s.starts_with("--") && known.iter().any(|k| k == name) {
            out.push(arg.clone());
            continue;
        }
        tracing::debug!(flag = %s, "ignoring a vLLM flag fake-vllm does not model");
        let takes_value = !has_value
            && !VLLM_BOOL_FLAGS.contains(&name)
            && !name.starts_with("enable-")
            && !name.starts_with("disable-")
            && !name.starts_with("no-");
        if takes_value
            && rest.peek().is_some_and(|n| {
                !n.to_string_lossy().starts_with('-') || is_number(&n.to_string_lossy())
            })
        {
            rest.next();
        }
    }
    out
}

fn is_number(s: &str) -> bool {
    s.parse::<f64>().is_ok()
}

/// Parses argv (including argv[0]) after [`filter_argv`].
pub fn parse<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    Cli::try_parse_from(filter_argv(args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(args: &[&str]) -> ServeArgs {
        let mut v = vec!["fake-vllm", "serve"];
        v.extend_from_slice(args);
        match parse(v).unwrap().command {
            Command::Serve(s) => *s,
            Command::EngineCore(_) => panic!("not serve"),
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
            "--startup-time",
            "1.5s",
        ]);
        assert_eq!(s.model(), "Qwen/Qwen3-0.6B");
        assert_eq!((s.host.as_str(), s.port), ("127.0.0.1", 0));
        assert_eq!(s.served_names(), vec!["a", "b"]);
        assert!(s.enable_sleep_mode);
        assert_eq!(s.tensor_parallel_size, 2);
        assert_eq!(s.max_model_len, 4096);
        assert_eq!(s.gpu_memory_utilization, Some(0.4));
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
        ] {
            assert!(help.contains(knob), "{knob} missing from --help");
        }
    }
}
