//! `siesta`: the operator's command line for siesta-control.
#![forbid(unsafe_code)]

// Every `print!` and `println!` of the crate is one of these (defined
// before the modules, they shadow std's): stdout goes through `out`, where
// a closed pipe ends the command quietly instead of panicking.
macro_rules! print {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}

macro_rules! println {
    () => {
        $crate::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

// And `eprintln!`: a stderr that is gone (`siesta up 2>&1 | tee log` after
// Ctrl-C, a dropped SSH session) drops the line. std's panics, and a panic
// in `siesta up`'s shutdown would leave its engines running unmanaged.
macro_rules! eprintln {
    ($($arg:tt)*) => {
        $crate::out::note(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod args;
mod client;
mod commands;
mod failure;
mod out;
mod render;
mod view;

use std::ffi::OsString;
use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};
use crate::failure::Failure;

fn main() -> ExitCode {
    // `siesta fake-vllm ...` hands its argv over untouched (the demo's engines).
    let argv: Vec<OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "fake-vllm") {
        return fake_vllm(argv.into_iter().skip(2).collect());
    }
    let cli = Cli::parse(); // usage errors exit 2
    let serving = matches!(cli.command, Command::Up(_));
    if let Command::FakeVllm { args } = cli.command {
        return fake_vllm(args);
    }
    // `up` prints its banner and model changes itself; RUST_LOG=info shows more.
    init_tracing("warn");
    let runtime = if serving {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    let result = match runtime {
        Ok(rt) => rt.block_on(commands::run(cli)),
        Err(e) => Err(Failure::Failed(format!(
            "cannot start the async runtime: {e}"
        ))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            match &failure {
                Failure::Reported | Failure::Interrupted => {}
                Failure::Unreachable { .. } => eprintln!("{failure}"),
                _ => eprintln!("error: {failure}"),
            }
            ExitCode::from(failure.exit_code())
        }
    }
}

fn fake_vllm(args: Vec<OsString>) -> ExitCode {
    fake_vllm::main_with_args(std::iter::once(OsString::from("fake-vllm")).chain(args))
}

/// Logs to stderr; `RUST_LOG` overrides the default level.
fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour())
        .try_init();
}

/// Colour in the log only on a terminal, and never with `NO_COLOR` set.
fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
