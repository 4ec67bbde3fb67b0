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
    controls: Vec<String>,
    extra_args: Vec<String>,
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

    /// SIGKILLs the proxy's process group.
    pub fn kill9(&mut self) {
        self.child.kill9();
    }

    /// Kills (SIGKILL, if still running) and starts it again with the same arguments,
    /// listening on the same addresses.
    pub async fn restart(&mut self) {
        self.kill9();
        let (child, http, admin) = launch(
            &self.dir,
            &self.controls,
            (&self.http.to_string(), &self.admin.to_string()),
            &self.extra_args,
        )
        .await;
        self.child = child;
        self.http = http;
        self.admin = admin;
    }
}

async fn launch(
    dir: &TempDir,
    controls: &[String],
    (listen, admin_listen): (&str, &str),
    extra_args: &[String],
) -> (Child, SocketAddr, SocketAddr) {
    let addr_file = dir.path().join("proxy.addr");
    let _ = std::fs::remove_file(&addr_file);
    let mut cmd = Command::new(bin_path("siesta-proxy"));
    for c in controls {
        cmd.arg("--control").arg(c);
    }
    cmd.args(["--listen", listen, "--admin-listen", admin_listen])
        .arg("--addr-file")
        .arg(&addr_file)
        .args(extra_args);
    let mut child = Child::spawn("siesta-proxy", cmd);
    let addrs = wait_addr_file(&mut child, &addr_file, &["http", "admin"], DEADLINE).await;
    (child, addrs[0], addrs[1])
}

/// Runs `siesta-proxy --control URL... --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0
/// --addr-file DIR/proxy.addr EXTRA...` and waits for its address file.
pub async fn spawn_proxy(controls: &[String], extra_args: &[&str]) -> ProxyProc {
    spawn_proxy_at(controls, "127.0.0.1:0", extra_args).await
}

/// As [`spawn_proxy`], with the client listener on `listen`.
pub async fn spawn_proxy_at(controls: &[String], listen: &str, extra_args: &[&str]) -> ProxyProc {
    let dir = tempfile::Builder::new()
        .prefix("siesta-proxy-")
        .tempdir()
        .expect("tempdir");
    let controls = controls.to_vec();
    let extra_args: Vec<String> = extra_args.iter().map(|s| s.to_string()).collect();
    let (child, http, admin) = launch(&dir, &controls, (listen, "127.0.0.1:0"), &extra_args).await;
    ProxyProc {
        http,
        admin,
        child,
        dir,
        controls,
        extra_args,
    }
}
