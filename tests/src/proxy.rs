//! Spawning `siesta-proxy` on port 0.

use std::net::SocketAddr;
use std::process::Command;

use tempfile::TempDir;

use crate::{Child, DEADLINE, bin_path, wait_addr_file};

/// A running `siesta-proxy`.
#[derive(Debug)]
pub struct ProxyProc {
    /// The client-facing (OpenAI API) address.
    pub http: SocketAddr,
    /// The admin address (health, readiness, metrics).
    pub admin: SocketAddr,
    /// The process (its group is killed on drop).
    pub child: Child,
    /// The temp dir holding the addr file.
    pub dir: TempDir,
}

impl ProxyProc {
    /// `http://` + the client-facing address.
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// `http://` + the admin address.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }
}

/// Runs `siesta-proxy --control URL... --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0
/// --addr-file DIR/proxy.addr EXTRA...` and waits for its address file.
pub async fn spawn_proxy(controls: &[String], extra_args: &[&str]) -> ProxyProc {
    let dir = tempfile::Builder::new()
        .prefix("siesta-proxy-")
        .tempdir()
        .expect("tempdir");
    let addr_file = dir.path().join("proxy.addr");
    let mut cmd = Command::new(bin_path("siesta-proxy"));
    for c in controls {
        cmd.arg("--control").arg(c);
    }
    cmd.args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .arg("--addr-file")
        .arg(&addr_file)
        .args(extra_args);
    let mut child = Child::spawn("siesta-proxy", cmd);
    let addrs = wait_addr_file(&mut child, &addr_file, &["http", "admin"], DEADLINE).await;
    ProxyProc {
        http: addrs[0],
        admin: addrs[1],
        child,
        dir,
    }
}
