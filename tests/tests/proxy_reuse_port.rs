//! `siesta-proxy --reuse-port`: two replicas share one client address and
//! the kernel spreads connections over both; without the flag the second
//! one refuses to start with a message naming the address and the flag
//! (`cargo build --workspace --bins` first).

use std::process::Command;
use std::time::Duration;

use serde_json::json;
use siesta_tests::{
    Child, DEADLINE, bin_path, spawn_control_with, spawn_proxy, spawn_proxy_at, wait_until,
};

fn config() -> String {
    "[control]\nlisten = \"127.0.0.1:0\"\nstate_dir = \"@DIR@/state\"\n\n\
     [[model]]\nname = \"m\"\nmodel = \"org/m\"\nexecutable = \"@FAKE_VLLM@\"\n\
     preload = \"awake\"\nargs = [\"--startup-time\", \"100ms\"]\n"
        .to_owned()
}

/// Sum of `siesta_proxy_requests_total` over its labels (-1: no answer).
async fn requests_total(admin: &str) -> f64 {
    let Ok(r) = reqwest::get(format!("{admin}/metrics")).await else {
        return -1.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("siesta_proxy_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_port_and_both_serve() {
    let control = spawn_control_with(&config(), &["--stop-engines-on-exit"]).await;
    let a = spawn_proxy(&[control.url()], &["--reuse-port"]).await;
    let b = spawn_proxy_at(&[control.url()], &a.http.to_string(), &["--reuse-port"]).await;
    assert_eq!(a.http, b.http, "both replicas listen on one address");
    assert_ne!(a.admin, b.admin, "each replica has its own admin address");
    for p in [&a, &b] {
        let url = format!("{}/v1/models/m", p.url());
        let admin = format!("{}/readyz", p.admin_url());
        wait_until("replica ready and awake model known", DEADLINE, || async {
            matches!(reqwest::get(&admin).await, Ok(r) if r.status() == 200)
                && matches!(reqwest::get(&url).await, Ok(r) if r.status() == 200)
        })
        .await;
    }
    let (before_a, before_b) = (
        requests_total(&a.admin_url()).await,
        requests_total(&b.admin_url()).await,
    );
    // A new connection per request: the kernel picks a replica for each.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let body =
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let mut sent = 0;
    loop {
        for _ in 0..20 {
            let r = http
                .post(format!("{}/v1/chat/completions", a.url()))
                .json(&body)
                .send()
                .await
                .expect("request through the shared port");
            assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
            sent += 1;
        }
        let (na, nb) = (
            requests_total(&a.admin_url()).await - before_a,
            requests_total(&b.admin_url()).await - before_b,
        );
        if na > 0.0 && nb > 0.0 {
            assert_eq!(na + nb, sent as f64, "every request counted by one replica");
            break;
        }
        assert!(
            sent < 400,
            "{sent} connections all went to one replica (a: {na}, b: {nb})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_proxy_without_reuse_port_is_refused_clearly() {
    // No control plane needed: binding fails before anything else.
    let control = "http://127.0.0.1:1".to_owned();
    let a = spawn_proxy(std::slice::from_ref(&control), &[]).await;
    for extra in [&[][..], &["--reuse-port"][..]] {
        let mut cmd = Command::new(bin_path("siesta-proxy"));
        cmd.args(["--control", &control, "--listen", &a.http.to_string()])
            .args(["--admin-listen", "127.0.0.1:0"])
            .args(extra);
        let mut second = Child::spawn("siesta-proxy (second)", cmd);
        let status = second.wait_exit(DEADLINE).await;
        assert!(!status.success(), "second proxy {extra:?} must fail");
        let text = second.output().text();
        assert!(
            text.contains(&format!("cannot listen on {}", a.http))
                && text.contains("already in use")
                && text.contains("--reuse-port"),
            "unclear error for {extra:?}:\n{text}"
        );
    }
}
