//! Headless Chromium (Debian's `/usr/bin/chromium`) driven over the Chrome
//! DevTools Protocol: a page is opened at a URL, then JavaScript is
//! evaluated in it and screenshots are taken.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::{Child, DEADLINE, POLL};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A headless Chromium with one page, attached over CDP.
#[derive(Debug)]
pub struct Browser {
    ws: Ws,
    next_id: u64,
    /// The process (its group is killed on drop).
    pub child: Child,
    _profile: TempDir,
}

/// The Chromium binary: `SIESTA_CHROMIUM`, else `chromium` or
/// `chromium-browser` on the `PATH`.
pub fn chromium_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SIESTA_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| [d.join("chromium"), d.join("chromium-browser")])
        .find(|p| p.is_file())
}

impl Browser {
    /// Starts Chromium on `url`. `None`, with a message on stderr, when it is
    /// not installed and `CI` is unset; in CI a missing Chromium panics.
    pub async fn launch(url: &str) -> Option<Browser> {
        let Some(bin) = chromium_path() else {
            assert!(
                std::env::var_os("CI").is_none(),
                "chromium is not installed (CI is set, so the browser tests must run): apt-get install -y chromium"
            );
            eprintln!(
                "SKIPPED: chromium is not installed (apt-get install -y chromium); set CI to make this a failure"
            );
            return None;
        };
        let profile = tempfile::Builder::new()
            .prefix("siesta-chromium-")
            .tempdir()
            .expect("tempdir");
        let mut cmd = Command::new(&bin);
        cmd.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-dev-shm-usage",
            "--window-size=1400,900",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(url);
        let mut child = Child::spawn("chromium", cmd);
        // Chromium writes the port it picked to DevToolsActivePort.
        let port_file = profile.path().join("DevToolsActivePort");
        let start = Instant::now();
        let port: u16 = loop {
            if let Some(p) = std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|t| t.lines().next().and_then(|l| l.trim().parse().ok()))
            {
                break p;
            }
            if let Some(status) = child.try_exit() {
                panic!(
                    "chromium exited ({status}) at start:\n{}",
                    child.output().text()
                );
            }
            assert!(
                start.elapsed() < DEADLINE,
                "chromium wrote no DevToolsActivePort within {DEADLINE:?}:\n{}",
                child.output().text()
            );
            tokio::time::sleep(POLL).await;
        };
        let list = format!("http://127.0.0.1:{port}/json/list");
        let ws_url = loop {
            let pages: Vec<Value> = match reqwest::get(&list).await {
                Ok(r) => r.json().await.unwrap_or_default(),
                Err(_) => Vec::new(),
            };
            if let Some(u) = pages
                .iter()
                .find(|p| p["type"] == "page")
                .and_then(|p| p["webSocketDebuggerUrl"].as_str())
            {
                break u.to_string();
            }
            assert!(
                start.elapsed() < DEADLINE,
                "chromium shows no page at {list}"
            );
            tokio::time::sleep(POLL).await;
        };
        let (ws, _) = tokio_tungstenite::connect_async(&ws_url)
            .await
            .unwrap_or_else(|e| panic!("CDP connect {ws_url}: {e}"));
        Some(Browser {
            ws,
            next_id: 0,
            child,
            _profile: profile,
        })
    }

    /// Sends a CDP command and returns its `result` (panics on an error).
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let msg = json!({"id": id, "method": method, "params": params});
        self.ws
            .send(Message::text(msg.to_string()))
            .await
            .unwrap_or_else(|e| panic!("CDP send {method}: {e}"));
        let reply = tokio::time::timeout(DEADLINE, async {
            while let Some(m) = self.ws.next().await {
                let m = m.unwrap_or_else(|e| panic!("CDP read: {e}"));
                let Message::Text(t) = m else { continue };
                let v: Value = serde_json::from_str(&t).expect("CDP JSON");
                if v["id"] == id {
                    return v;
                }
            }
            panic!("CDP connection closed during {method}");
        })
        .await
        .unwrap_or_else(|_| panic!("CDP {method}: no reply within {DEADLINE:?}"));
        if let Some(e) = reply.get("error") {
            panic!("CDP {method}: {e}");
        }
        reply["result"].clone()
    }

    /// Evaluates `expr` in the page (promises awaited) and returns its value.
    pub async fn eval(&mut self, expr: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        if let Some(e) = r.get("exceptionDetails") {
            panic!("JavaScript {expr}: {e}");
        }
        r["result"]["value"].clone()
    }

    /// Waits until `expr` is truthy in the page; panics naming `what`.
    pub async fn wait_js(&mut self, what: &str, deadline: Duration, expr: &str) {
        let start = Instant::now();
        loop {
            let v = self.eval(expr).await;
            if v.as_bool() == Some(true) {
                return;
            }
            if start.elapsed() > deadline {
                let body = self
                    .eval("document.body ? document.body.innerText : ''")
                    .await;
                panic!("timed out after {deadline:?} waiting for {what}; the page shows:\n{body}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Loads `url` in the page.
    pub async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
    }

    /// A PNG screenshot of the page.
    pub async fn screenshot(&mut self) -> Vec<u8> {
        let r = self
            .call("Page.captureScreenshot", json!({"format": "png"}))
            .await;
        let data = r["data"].as_str().expect("screenshot data");
        base64_decode(data)
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for v in s.bytes().filter_map(val) {
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64() {
        assert_eq!(super::base64_decode("aGVsbG8="), b"hello");
        assert_eq!(super::base64_decode("aGk="), b"hi");
    }
}
