//! Small helpers for scripts/bench, so that the script needs neither curl
//! nor python on the machine it runs on.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::http::{Conn, socket_addr};

#[derive(Debug, clap::Args)]
pub struct WaitArgs {
    /// Full URL, e.g. http://127.0.0.1:8080/readyz.
    url: String,
    /// POST this JSON body instead of a GET.
    #[arg(long)]
    post: Option<String>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

/// Polls the URL every 50 ms until it answers 200.
pub async fn wait_http(a: WaitArgs) -> Result<()> {
    let uri: hyper::Uri = a.url.parse()?;
    let base = format!(
        "http://{}",
        uri.authority().map(|x| x.as_str()).unwrap_or("")
    );
    let path = uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    let addr = socket_addr(&base)?;
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < Duration::from_secs(a.timeout) {
        let attempt = async {
            let mut c = Conn::connect(addr).await?;
            let method = if a.post.is_some() { "POST" } else { "GET" };
            c.request(method, &path, a.post.as_deref()).await
        };
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(t)) if t.status == 200 => return Ok(()),
            Ok(Ok(t)) => {
                last = format!("status {}: {}", t.status, String::from_utf8_lossy(&t.body))
            }
            Ok(Err(e)) => last = format!("{e:#}"),
            Err(_) => last = "timed out".into(),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{} not ready after {}s: {last}", a.url, a.timeout)
}

/// Prints a TCP port on 127.0.0.1 that is free now.
pub fn free_port() -> Result<()> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    println!("{}", l.local_addr()?.port());
    Ok(())
}
