//! The command line: every subcommand and flag of `siesta` (clap derive).

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// The default control plane address (also `SIESTA_CONTROL`).
pub const DEFAULT_CONTROL: &str = "http://127.0.0.1:50051";

/// siesta: keep many vLLM models on a few GPUs as if each were always there.
///
/// Exit codes: 0 ok, 1 the operation failed, 2 usage error, 3 the control
/// plane could not be reached.
#[derive(Debug, Parser)]
#[command(
    name = "siesta",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub struct Cli {
    /// siesta-control's gRPC address.
    #[arg(long, global = true, env = "SIESTA_CONTROL", default_value = DEFAULT_CONTROL)]
    pub control: String,

    /// Bearer token for the control plane (needed when it listens beyond loopback).
    #[arg(long, global = true, env = "SIESTA_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

/// How results are printed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// For people: tables and sentences.
    #[default]
    #[value(alias = "table")]
    Text,
    /// For scripts: JSON (one object per line for streams).
    Json,
}

/// `-o/--output`, shared by every command that prints data.
#[derive(Debug, Clone, Copy, Args)]
pub struct OutputArg {
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Every model: state, GPUs, endpoint, idleness, next idle tier, last error.
    Status(OutputArg),
    /// Everything about one model, including placement and calibration.
    Get {
        /// Model name or alias.
        model: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Wake a model (start it if stopped).
    Wake {
        /// Model name or alias.
        model: String,
        /// Wait until it is awake (or failed), showing progress.
        #[arg(long)]
        wait: bool,
        /// With --wait: stop waiting after this long (the wake goes on). Default: the model's deadline.
        #[arg(long, requires = "wait", value_parser = wait_limit)]
        timeout: Option<Duration>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Put a model to sleep.
    Sleep {
        /// Model name or alias.
        model: String,
        /// 1: weights offloaded to CPU RAM (fast wake); 2: weights discarded.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=2))]
        level: u32,
        /// Wait until it is asleep at that level (requests in flight finish
        /// first), failed, or wanted otherwise; exit 1 unless asleep.
        #[arg(long)]
        wait: bool,
        /// With --wait: stop waiting after this long (the sleep goes on). Default: 5m.
        #[arg(long, requires = "wait", value_parser = wait_limit)]
        timeout: Option<Duration>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Suspend a model: checkpoint its GPU state to host memory through
    /// the CUDA driver (about 0 GPU memory left); `wake` resumes it.
    Suspend(ModelArg),
    /// Start a stopped or failed model.
    Start(ModelArg),
    /// Stop a model's engine; demand will not start it again until `start` or `wake`.
    Stop(ModelArg),
    /// Stop then start a model's engine.
    Restart(ModelArg),
    /// Keep a model awake (idle tiers do not fire meanwhile).
    Pin {
        /// Model name or alias.
        model: String,
        /// For how long, e.g. `2h` or `90m`. Default: until `unpin`.
        #[arg(long = "for", value_name = "DURATION")]
        duration: Option<humantime::Duration>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Remove a pin; idle tiers count again from the last activity.
    Unpin(ModelArg),
    /// The GPU inventory: memory, processes, topology and P2P health.
    Gpus(OutputArg),
    /// Which GPUs each model is placed on, and why.
    Placement(OutputArg),
    /// Diagnostics.
    Diag {
        #[command(subcommand)]
        command: DiagCommand,
    },
    /// A model's engine log (stdout and stderr).
    Logs {
        /// Model name or alias.
        model: String,
        /// Keep following new lines.
        #[arg(short, long)]
        follow: bool,
        /// Only the last N lines first (default: all that are kept; 0: none,
        /// with --follow only new lines).
        #[arg(long, value_name = "N")]
        tail: Option<u32>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Live events from the control plane (`-o json`: one object per line).
    Watch(OutputArg),
    /// Full-screen live view: models, GPU memory per engine, wakes, events.
    /// Keys: ↑/↓ select, w wake, 1/2 sleep, p pin/unpin, s stop, l engine
    /// log, q quit.
    Top,
    /// Work with configuration files.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Make the control plane re-read its configuration file.
    Reload(OutputArg),
    /// Print a shell completion script.
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Run control plane and proxy in one process until Ctrl-C (the quickstart).
    Up(UpArgs),
    /// Run the built-in fake vLLM server (what the demo's engines run).
    #[command(hide = true, disable_help_flag = true)]
    FakeVllm {
        /// Arguments as for `fake-vllm`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

/// A command that takes one model and prints its resulting status.
#[derive(Debug, Args)]
pub struct ModelArg {
    /// Model name or alias.
    pub model: String,
    #[command(flatten)]
    pub out: OutputArg,
}

#[derive(Debug, Subcommand)]
pub enum DiagCommand {
    /// Run the GPU peer-to-peer probe now (copies a pattern between every GPU pair).
    P2p {
        /// Bytes to copy per pair (default: the control plane's).
        #[arg(long)]
        bytes: Option<u64>,
        /// Deadline for the whole probe, at most 1h (default: the control plane's `p2p_probe_timeout`).
        #[arg(long, value_parser = probe_limit)]
        timeout: Option<Duration>,
        #[command(flatten)]
        out: OutputArg,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a configuration file without starting anything (exit 1 if invalid).
    Check {
        /// The TOML file.
        path: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Configuration file (default: the built-in demo of fake-vllm models).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Where the proxy serves the OpenAI API.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Where the proxy serves /metrics, /healthz and /readyz.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub admin_listen: SocketAddr,
    /// Where the control plane serves gRPC (default: the config's `[control] listen`,
    /// 127.0.0.1:50051 for the demo).
    #[arg(long)]
    pub control_listen: Option<SocketAddr>,
    /// Leave the engines running on exit (for the next start to adopt).
    #[arg(long)]
    pub keep_engines: bool,
    /// After binding, write `http=`, `admin=` and `grpc=` addresses to this file.
    #[arg(long, value_name = "PATH")]
    pub addr_file: Option<PathBuf>,
}

/// The longest probe deadline the control plane takes (its
/// `PROBE_TIMEOUT_MAX`, the most `p2p_probe_timeout` may be).
pub const PROBE_TIMEOUT_MAX: Duration = Duration::from_secs(3600);

/// A wait given on the command line: at least 1 ms (a zero, or less than a
/// millisecond, would travel as 0: "the default", minutes).
fn wait_limit(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(1) {
        return Err("must be at least 1ms (leave the flag out for the default)".into());
    }
    Ok(d)
}

/// A probe deadline: as [`wait_limit`], and at most [`PROBE_TIMEOUT_MAX`].
fn probe_limit(s: &str) -> Result<Duration, String> {
    let d = wait_limit(s)?;
    if d > PROBE_TIMEOUT_MAX {
        return Err(format!(
            "must be at most {} (the probe's longest deadline)",
            humantime::format_duration(PROBE_TIMEOUT_MAX)
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// A zero wait would travel as "the default" (the model's deadline,
    /// 20 minutes); a probe deadline over 1h was refused by the daemon as
    /// `timeout_ms`, exit 1. Both are usage errors, naming the flag.
    #[test]
    fn a_zero_wait_and_a_probe_deadline_over_an_hour_are_usage_errors() {
        for args in [
            &["siesta", "wake", "m", "--wait", "--timeout", "0s"][..],
            &["siesta", "wake", "m", "--wait", "--timeout", "500us"],
            &["siesta", "sleep", "m", "--wait", "--timeout", "0s"],
            &["siesta", "diag", "p2p", "--timeout", "2h"],
            &["siesta", "diag", "p2p", "--timeout", "0s"],
        ] {
            let err = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{args:?}");
            assert!(err.to_string().contains("--timeout"), "{args:?}: {err}");
        }
        let ok = Cli::try_parse_from(["siesta", "diag", "p2p", "--timeout", "1h"]).unwrap();
        match ok.command {
            Command::Diag {
                command: DiagCommand::P2p { timeout, .. },
            } => assert_eq!(timeout, Some(PROBE_TIMEOUT_MAX)),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sleep_level_out_of_range_is_a_usage_error() {
        let err = Cli::try_parse_from(["siesta", "sleep", "chat", "--level", "3"]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
    }

    #[test]
    fn pin_for_parses_humantime() {
        let cli = Cli::try_parse_from(["siesta", "pin", "chat", "--for", "1h30m"]).unwrap();
        match cli.command {
            Command::Pin { duration, .. } => {
                assert_eq!(duration.unwrap().as_secs(), 5400);
            }
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn fake_vllm_takes_everything_after_it() {
        let cli =
            Cli::try_parse_from(["siesta", "fake-vllm", "serve", "m", "--port", "0"]).unwrap();
        match cli.command {
            Command::FakeVllm { args } => assert_eq!(args, ["serve", "m", "--port", "0"]),
            other => panic!("parsed as {other:?}"),
        }
    }
}
