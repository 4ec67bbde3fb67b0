//! A control plane with its web listener on, fake-vllm models and a proxy,
//! shared by the web_*, grafana_* and top_* tests.

use crate::ctl::{Ctl, LONG, config, start};
use crate::{ProxyProc, read_addr_file, spawn_proxy, wait_until};
use std::time::Duration;

#[derive(Debug)]
pub struct Stack {
    pub ctl: Ctl,
    pub proxy: ProxyProc,
    /// `http://IP:PORT` of the control plane's web listener.
    pub web: String,
}

/// `models` (`[[model]]` tables) under a control plane whose `[control]`
/// also holds `control_extra` (e.g. `web_listen = ...`, `token = ...`).
pub async fn stack_with(models: &str, control_extra: &str, proxy_args: &[&str]) -> Stack {
    let cfg = config(models).replace("[control]\n", &format!("[control]\n{control_extra}\n"));
    let ctl = start(&cfg).await;
    let addrs = read_addr_file(&ctl.dir.path().join("control.addr")).expect("control.addr");
    let web = addrs
        .iter()
        .find(|(k, _)| k == "web")
        .map(|(_, a)| *a)
        .unwrap_or_else(|| panic!("control.addr has no web= line: {addrs:?}"));
    // A wildcard listener is reached through loopback.
    let web = if web.ip().is_unspecified() {
        std::net::SocketAddr::from(([127, 0, 0, 1], web.port()))
    } else {
        web
    };
    let proxy = spawn_proxy(&[ctl.url()], proxy_args).await;
    let ready = format!("{}/readyz", proxy.admin_url());
    wait_until("proxy ready", LONG, || async {
        matches!(reqwest::get(&ready).await, Ok(r) if r.status() == 200)
    })
    .await;
    Stack {
        ctl,
        proxy,
        web: format!("http://{web}"),
    }
}

/// `models` with the web listener on a loopback port.
pub async fn stack(models: &str) -> Stack {
    stack_with(models, r#"web_listen = "127.0.0.1:0""#, &[]).await
}

impl Stack {
    /// One chat completion through the proxy; panics unless 200.
    pub async fn ask(&self, model: &str) {
        if let Err(e) =
            crate::ctl::try_chat(&self.proxy.url(), model, 4, Duration::from_secs(60)).await
        {
            panic!("{e}");
        }
    }

    /// GET a path of the web listener as text (panics unless 200).
    pub async fn get(&self, path: &str) -> String {
        let resp = reqwest::get(format!("{}{path}", self.web))
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        assert_eq!(status, 200, "GET {path}: {text}");
        text
    }
}
