//! Many requests held at once by the real siesta-proxy, each on its own
//! connection (so each waits in the proxy's waiting room, not in a hyper
//! connection), while a sleeping model wakes: every one is answered 200,
//! none is lost, and the engine receives each exactly once
//! (`cargo build --workspace --bins` first).

use std::time::Duration;

use serde_json::{Value, json};
use siesta_proto::v1::{GetModelRequest, ModelState};
use siesta_tests::{DEADLINE, spawn_control_with, spawn_proxy, wait_until};

/// Requests held at once (fewer if this process may not open that many
/// connections).
const HELD: usize = 2000;

/// Takes the hard open-files limit; returns the soft limit now.
fn raise_fd_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return hard;
    }
    soft
}

async fn held_gauge(admin: &str) -> f64 {
    let Ok(r) = reqwest::get(format!("{admin}/metrics")).await else {
        return -1.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("siesta_proxy_held_requests{model=\"sleepy\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A proxy watching `control`, once it knows `model`.
async fn proxy_knowing(
    control: &siesta_tests::ControlProc,
    model: &str,
) -> siesta_tests::ProxyProc {
    let proxy = spawn_proxy(&[control.url()], &[]).await;
    wait_until(&format!("proxy knows {model}"), DEADLINE, || async {
        matches!(reqwest::get(format!("{}/v1/models/{model}", proxy.url())).await,
            Ok(r) if r.status() == 200)
    })
    .await;
    proxy
}

/// POSTs `body` (JSON) to `url` in a task: its status and body text.
fn post_json(
    http: &reqwest::Client,
    url: &str,
    body: String,
) -> tokio::task::JoinHandle<Result<(u16, String), reqwest::Error>> {
    let (http, url) = (http.clone(), url.to_owned());
    tokio::spawn(async move {
        let r = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await?;
        let status = r.status().as_u16();
        Ok((status, r.text().await?))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_held_requests_are_all_answered_once() {
    let n = HELD.min(raise_fd_limit().saturating_sub(300) as usize);
    assert!(n >= 500, "the open-files limit allows only {n} connections");
    let config = format!(
        "[control]\nlisten = \"127.0.0.1:0\"\nstate_dir = \"@DIR@/state\"\n\n\
         [defaults]\nmax_queue = {}\nmax_hold = \"120s\"\n\n\
         [[model]]\nname = \"sleepy\"\nmodel = \"org/sleepy\"\nexecutable = \"@FAKE_VLLM@\"\n\
         preload = \"asleep\"\nargs = [\"--startup-time\", \"100ms\", \"--wake-time\", \"10s\"]\n",
        n + 100
    );
    let mut control = spawn_control_with(&config, &["--stop-engines-on-exit"]).await;
    let c = control.client().await;
    let status = || {
        let mut c = c.clone();
        async move {
            c.get_model(GetModelRequest {
                name: "sleepy".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .model
            .unwrap()
        }
    };
    wait_until("sleepy asleep", DEADLINE, || async {
        status().await.state() == ModelState::Asleep
    })
    .await;
    let proxy = proxy_knowing(&control, "sleepy").await;
    let (url, admin) = (
        format!("{}/v1/chat/completions", proxy.url()),
        proxy.admin_url(),
    );

    // Every request on its own connection, all held during the 10 s wake.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let body = json!({"model": "sleepy", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    // In batches of 100 (the listen backlog is finite): each batch is held
    // before the next is sent.
    let mut tasks = Vec::with_capacity(n);
    while tasks.len() < n {
        for _ in 0..100.min(n - tasks.len()) {
            tasks.push(post_json(&http, &url, body.clone()));
        }
        let sent = tasks.len() as f64;
        wait_until(&format!("{sent} held"), DEADLINE, || async {
            held_gauge(&admin).await == sent
        })
        .await;
    }
    assert_ne!(
        status().await.state(),
        ModelState::Awake,
        "all {n} were held before the wake ended"
    );
    let mut ok = 0;
    for t in tasks {
        let (status, text) = t.await.unwrap().expect("answered, not lost");
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["object"], "chat.completion", "{text}");
        ok += 1;
    }
    assert_eq!(ok, n);
    assert_eq!(held_gauge(&admin).await, 0.0, "none left in the queue");
    // The engine saw each request once: nothing lost, nothing sent twice.
    let engine = status().await.endpoints[0].url.clone();
    let stats: Value = reqwest::get(format!("{engine}/fake/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["requests_arrived"], json!(n), "{stats}");
    control.terminate().await;
}

/// The fake engine's `/fake/stats` for `model` (its first endpoint).
async fn engine_stats(c: &siesta_tests::ctl::Client, model: &str) -> Value {
    let m = c
        .clone()
        .get_model(GetModelRequest { name: model.into() })
        .await
        .unwrap()
        .into_inner()
        .model
        .unwrap();
    let Some(e) = m.endpoints.first() else {
        return Value::Null;
    };
    match reqwest::get(format!("{}/fake/stats", e.url)).await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

/// Held requests released after a wake are paced on their way to the
/// engine, but a released request gives its place back when it reaches the
/// engine, not when it is answered: long generations of one model neither
/// cap how many of its held requests run nor keep another model's released
/// requests out (before, 256 places for every model were held until each
/// answer's head, so 300 minute-long completions ran 256 at a time and a
/// request for any other model waited for the first of them to end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_generations_do_not_hold_back_other_released_requests() {
    const SLOW: usize = 300;
    let n = SLOW.min(raise_fd_limit().saturating_sub(200) as usize);
    assert!(n > 256, "the open-files limit allows only {n} connections");
    let config = "[control]\nlisten = \"127.0.0.1:0\"\nstate_dir = \"@DIR@/state\"\n\n\
         [defaults]\nmax_queue = 1000\nmax_hold = \"300s\"\n\n\
         [[model]]\nname = \"slow\"\nmodel = \"org/slow\"\nexecutable = \"@FAKE_VLLM@\"\n\
         preload = \"asleep\"\nargs = [\"--startup-time\", \"100ms\", \"--wake-time\", \"1s\", \
         \"--tokens-per-second\", \"5\"]\n\n\
         [[model]]\nname = \"quick\"\nmodel = \"org/quick\"\nexecutable = \"@FAKE_VLLM@\"\n\
         preload = \"asleep\"\nargs = [\"--startup-time\", \"100ms\", \"--wake-time\", \"1s\"]\n";
    let mut control = spawn_control_with(config, &["--stop-engines-on-exit"]).await;
    let c = control.client().await;
    for m in ["slow", "quick"] {
        wait_until(&format!("{m} asleep"), DEADLINE, || async {
            engine_stats(&c, m).await["is_sleeping"] == json!(true)
        })
        .await;
    }
    let proxy = proxy_knowing(&control, "quick").await;
    let url = format!("{}/v1/chat/completions", proxy.url());
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let ask = |model: &str, tokens: u32| {
        let body = json!({"model": model, "max_tokens": tokens, "ignore_eos": true,
            "messages": [{"role": "user", "content": "hi"}]});
        post_json(&http, &url, body.to_string())
    };
    // Each `slow` answer takes 10 minutes (3,000 tokens at 5 a second): none
    // ends during the test.
    let slow: Vec<_> = (0..n).map(|_| ask("slow", 3000)).collect();
    wait_until(
        &format!("all {n} slow requests running"),
        DEADLINE,
        || async { engine_stats(&c, "slow").await["running"] == json!(n) },
    )
    .await;
    let quick = ask("quick", 4);
    let (status, text) = tokio::time::timeout(DEADLINE, quick)
        .await
        .expect("the quick model's request is answered while slow generates")
        .unwrap()
        .unwrap();
    assert_eq!(status, 200, "{text}");
    let stats = engine_stats(&c, "slow").await;
    assert_eq!(stats["requests_served"], json!(0), "{stats}");
    assert_eq!(stats["running"], json!(n), "{stats}");
    for t in slow {
        t.abort();
    }
    control.terminate().await;
}
