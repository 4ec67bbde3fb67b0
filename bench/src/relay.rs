//! A byte relay: the least any proxy can add on this machine. Each client
//! connection gets a connection to the target and two threads, one per
//! direction, each a blocking `read` and `write_all` in a loop: no parsing,
//! no event loop, a woken thread returns from `read` with the bytes (one
//! system call where an event loop makes two). Scenarios 1 and 2 measure it
//! beside the proxies, so that "added latency over direct" and "time to
//! first byte over direct" have their floor measured on the same machine in
//! the same run.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;

use anyhow::{Context, Result};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Where to listen (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The target's `IP:PORT`.
    #[arg(long)]
    to: SocketAddr,
    /// Write the listening `IP:PORT` here once bound.
    #[arg(long)]
    addr_file: Option<PathBuf>,
}

/// Relays until killed.
pub fn run(a: Args) -> Result<()> {
    let listener = TcpListener::bind(a.listen).with_context(|| format!("bind {}", a.listen))?;
    let at = listener.local_addr()?;
    if let Some(path) = &a.addr_file {
        std::fs::write(path, format!("{at}\n")).with_context(|| format!("{}", path.display()))?;
    }
    eprintln!("relay: {at} → {}", a.to);
    for client in listener.incoming() {
        let client = match client {
            Ok(c) => c,
            Err(e) => {
                eprintln!("relay: accept: {e}");
                continue;
            }
        };
        if let Err(e) = pair(client, a.to) {
            eprintln!("relay: {e:#}");
        }
    }
    Ok(())
}

fn pair(client: TcpStream, to: SocketAddr) -> Result<()> {
    let target = TcpStream::connect(to).with_context(|| format!("connect {to}"))?;
    client.set_nodelay(true)?;
    target.set_nodelay(true)?;
    let (c2, t2) = (client.try_clone()?, target.try_clone()?);
    std::thread::spawn(move || pump(client, target));
    std::thread::spawn(move || pump(t2, c2));
    Ok(())
}

/// Copies `from` to `to` until `from` ends or either fails, then passes the
/// end on.
fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
