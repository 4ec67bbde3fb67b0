//! fake-vllm: a stand-in for `vllm serve`, faithful on every path siesta uses: the same
//! argv, the OpenAI endpoints and SSE chunk shapes, sleep mode at both levels behind
//! `VLLM_SERVER_DEV_MODE=1`, `/metrics`, an engine-core child process, and knobs for timing
//! and fault injection (see `fake-vllm serve --help`).
#![forbid(unsafe_code)]

pub mod argv;
pub mod cli;
mod conn;
mod dev;
pub mod engine;
mod engine_core;
mod http;
pub mod memory;
mod metrics;
mod openai;
pub mod server;
pub mod sglang;
pub mod sim_gpu;
pub mod version;

use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

/// Runs fake-vllm with `args` (argv including argv[0], e.g. `["fake-vllm", "serve", "m"]`);
/// builds its own tokio runtime. Used by the `fake-vllm` binary and `siesta fake-vllm`.
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let argv: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let argv = match personality(argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let cli = match cli::parse(argv.clone()) {
        Ok(c) => c,
        Err(e) => return ExitCode::from(e.report()),
    };
    match cli.command {
        cli::Command::EngineCore(a) => engine_core::run_child(&a),
        cli::Command::Worker(a) => engine_core::run_worker(&a),
        cli::Command::Serve(a) => {
            init_tracing();
            // Two serving threads per API server (`--api-server-count`).
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2 * usize::from(a.api_server_count))
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("fake-vllm: building the runtime: {e}");
                    return ExitCode::from(1);
                }
            };
            let code = rt.block_on(run(*a, &argv));
            // Do not wait for a hung operation (e.g. --hang-on-wake) on the way out.
            rt.shutdown_timeout(std::time::Duration::from_secs(1));
            code
        }
    }
}

/// `fake-vllm --personality P ...` (first): `sglang` takes SGLang's argv (see [`sglang`]);
/// `vllm` and `openai` take `serve ...` and the flag moves after `serve`.
fn personality(argv: Vec<OsString>) -> Result<Vec<OsString>, sglang::SglangArgvError> {
    let first = argv.get(1).map(|a| a.to_string_lossy().into_owned());
    let (p, rest_at) = match first.as_deref() {
        Some("--personality") => match argv.get(2) {
            Some(p) => (p.to_string_lossy().into_owned(), 3),
            None => return Ok(argv),
        },
        Some(f) if f.starts_with("--personality=") => (f["--personality=".len()..].to_string(), 2),
        _ => return Ok(argv),
    };
    let mut rest: Vec<OsString> = vec![argv[0].clone()];
    rest.extend(argv[rest_at..].iter().cloned());
    if p == "sglang" {
        return sglang::translate(&rest);
    }
    // `fake-vllm serve --personality P ...`.
    let mut out = Vec::with_capacity(rest.len() + 2);
    let serve_at = rest.iter().position(|a| a == "serve");
    for (i, a) in rest.into_iter().enumerate() {
        out.push(a);
        if Some(i) == serve_at {
            out.push("--personality".into());
            out.push(p.clone().into());
        }
    }
    if serve_at.is_none() {
        out.push("--personality".into());
        out.push(p.into());
    }
    Ok(out)
}

async fn run(args: cli::ServeArgs, argv: &[OsString]) -> ExitCode {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let signal = match siesta_signal::shutdown_signal() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fake-vllm: {e}");
            return ExitCode::from(1);
        }
    };
    // Like a process manager's stop timeout: whatever hangs, SIGTERM ends
    // the process 10 s after the drain's own bound.
    let bound = std::time::Duration::from_secs(args.shutdown_timeout.saturating_add(10));
    tokio::spawn(async move {
        let signal = signal.await;
        // The shutdown begins before anything is logged: a log line that
        // cannot be written must not keep the process up.
        token.cancel();
        std::thread::spawn(move || {
            std::thread::sleep(bound);
            let _ = writeln!(
                std::io::stderr(),
                "fake-vllm: shutdown took over {}s, exiting",
                bound.as_secs()
            );
            std::process::exit(1);
        });
        tracing::info!("received {signal}");
    });
    match server::serve(args, argv, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "fake-vllm failed");
            e.print_traceback();
            ExitCode::from(1)
        }
    }
}

/// Logs to stdout like vLLM; filter from `FAKE_VLLM_LOG` (default `info`), not `RUST_LOG`, so
/// a test's `RUST_LOG` does not flood engine logs.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FAKE_VLLM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LogOut)
        .with_ansi(false)
        .with_target(false)
        .try_init();
}

/// stdout for log lines, whose failed writes are dropped, as Python's `logging` drops them
/// (a closed pipe never stops vLLM). tracing-subscriber reports a failed write on stderr
/// with `eprintln!`, which panics when stderr is closed too: a SIGTERM's log line then
/// took down the task that was to shut the server down, and it never exited.
struct LogOut;

impl Write for LogOut {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stdout().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stdout().flush();
        Ok(())
    }
}
