//! One module per command; [`run`] dispatches a parsed command line.

mod completion;
mod config;
mod diag;
mod get;
mod gpus;
mod lifecycle;
mod logs;
mod pin;
mod placement;
mod reload;
mod sleep;
mod status;
mod top;
mod up;
mod wake;
mod watch;

use serde::Serialize;
use siesta_proto::v1 as pb;

use crate::args::{Cli, Command, ConfigCommand, DiagCommand, Format};
use crate::client::Conn;
use crate::failure::Failure;
use crate::render;
use crate::view::OperationView;

/// Runs one command to completion.
pub async fn run(cli: Cli) -> Result<(), Failure> {
    let token = cli.token.as_deref();
    // Commands that need no control plane.
    match &cli.command {
        Command::Config {
            command: ConfigCommand::Check { path },
        } => return config::check(path),
        Command::Up(args) => return up::run(args, token).await,
        Command::Completion { shell } => return completion::run(*shell),
        Command::FakeVllm { .. } => {
            return Err(Failure::Usage(
                "`siesta fake-vllm` must be the first argument".into(),
            ));
        }
        _ => {}
    }
    let conn = Conn::connect(&cli.control, token).await?;
    match cli.command {
        Command::Status(o) => status::run(conn, o.format).await,
        Command::Get { model, out } => get::run(conn, &model, out.format).await,
        Command::Wake {
            model,
            wait,
            timeout,
            out,
        } => wake::run(conn, &model, wait, timeout, out.format).await,
        Command::Sleep {
            model,
            level,
            wait,
            timeout,
            out,
        } => {
            let wait = wait.then_some(timeout);
            sleep::run(conn, &model, level, wait, out.format).await
        }
        Command::Suspend(m) => {
            lifecycle::run(conn, lifecycle::Op::Suspend, &m.model, m.out.format).await
        }
        Command::Start(m) => {
            lifecycle::run(conn, lifecycle::Op::Start, &m.model, m.out.format).await
        }
        Command::Stop(m) => lifecycle::run(conn, lifecycle::Op::Stop, &m.model, m.out.format).await,
        Command::Restart(m) => {
            lifecycle::run(conn, lifecycle::Op::Restart, &m.model, m.out.format).await
        }
        Command::Pin {
            model,
            duration,
            out,
        } => pin::pin(conn, &model, duration.map(Into::into), out.format).await,
        Command::Unpin(m) => pin::unpin(conn, &m.model, m.out.format).await,
        Command::Gpus(o) => gpus::run(conn, o.format).await,
        Command::Placement(o) => placement::run(conn, o.format).await,
        Command::Diag {
            command:
                DiagCommand::P2p {
                    bytes,
                    timeout,
                    out,
                },
        } => diag::p2p(conn, bytes, timeout, out.format).await,
        Command::Logs {
            model,
            follow,
            tail,
            out,
        } => logs::run(conn, &model, follow, tail, out.format).await,
        Command::Watch(o) => watch::run(conn, o.format).await,
        Command::Top => top::run(conn).await,
        Command::Reload(o) => reload::run(conn, o.format).await,
        Command::Config { .. }
        | Command::Completion { .. }
        | Command::Up(_)
        | Command::FakeVllm { .. } => {
            unreachable!("handled above")
        }
    }
}

/// Prints a value as pretty JSON on stdout.
fn print_json<T: Serialize>(value: &T) -> Result<(), Failure> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints a value as one line of JSON on stdout (written at once: stdout
/// is line-buffered), for streams.
fn print_json_line<T: Serialize>(value: &T) -> Result<(), Failure> {
    println!("{}", serde_json::to_string(value)?);
    Ok(())
}

/// Prints an operation's answer: `chat: waking (state: waking)`.
fn print_operation(
    name: &str,
    resp: &pb::OperationResponse,
    format: Format,
) -> Result<(), Failure> {
    match format {
        Format::Json => print_json(&OperationView::from(resp)),
        Format::Text => {
            if !resp.warning.is_empty() {
                eprintln!("warning: {}", resp.warning);
            }
            let name = resp.model.as_ref().map_or(name, |m| m.name.as_str());
            let state = resp.model.as_ref().map(render::state_label);
            match (resp.message.is_empty(), state) {
                // "sleeping" with state "sleeping(l2)": say it once.
                (false, Some(s)) if s.starts_with(resp.message.as_str()) => println!("{name}: {s}"),
                (false, Some(s)) => println!("{name}: {} (now {s})", resp.message),
                (true, Some(s)) => println!("{name}: {s}"),
                (false, None) => println!("{name}: {}", resp.message),
                (true, None) => println!("{name}: ok"),
            }
            Ok(())
        }
    }
}
