//! Engines that someone operates behind siesta's back (an operator's
//! `/sleep` and `/wake_up` sent to the engine directly), as vLLM answers
//! them: siesta must neither route requests into an engine that holds them
//! nor wake one whose sleep is still under way (end to end, through the
//! proxy).

use serde_json::{Value, json};
use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::{ProxyProc, spawn_proxy, wait_until};
use std::time::Duration;

/// Wake or start time of fake-vllm plus a margin for a loaded 2-core CI box.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

struct Stack {
    ctl: Ctl,
    proxy: ProxyProc,
    c: Client,
}

async fn stack(models: &str) -> Stack {
    let ctl = start(&config(models)).await;
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    let c = ctl.client().await;
    Stack { ctl, proxy, c }
}

impl Stack {
    async fn ask(&self, model: &str) {
        if let Err(e) = try_chat(&self.proxy.url(), model, 4, ANSWER_WITHIN).await {
            panic!("{e}");
        }
    }
}

async fn post(url: String) -> reqwest::Response {
    reqwest::Client::new()
        .post(&url)
        .timeout(LONG)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"))
}

async fn fake_stats(engine: &str) -> Value {
    reqwest::get(format!("{engine}/fake/stats"))
        .await
        .expect("GET /fake/stats")
        .json()
        .await
        .expect("stats JSON")
}

/// An operator sleeps the engine and wakes only its weights
/// (`wake_up?tags=weights`): `/is_sleeping` stays true and the scheduler
/// paused, so whatever reaches it waits. vLLM 0.33 keeps
/// `vllm:engine_sleep_state` asleep; 0.24 records it awake after that
/// partial wake. Either way siesta takes the engine as asleep and finishes
/// the wake (its intent is awake), and the next request is answered (held
/// by the engine if it came first) without a restart. Before, with 0.24,
/// siesta trusted the metric and the engine was never woken: the request
/// hung.
#[tokio::test]
async fn an_engine_woken_only_in_part_behind_siestas_back_is_woken_for_the_next_request() {
    for version in ["0.33.0", "0.24.0"] {
        let mut s = stack(&fake_model(
            "tiny",
            "awake",
            &["--imitate-version", version],
            "",
        ))
        .await;
        let st = wait_state(&mut s.c, "tiny", pb::ModelState::Awake, LONG).await;
        let engine = endpoint(&st);
        assert!(
            post(format!("{engine}/sleep?level=1"))
                .await
                .status()
                .is_success()
        );
        assert!(
            post(format!("{engine}/wake_up?tags=weights"))
                .await
                .status()
                .is_success()
        );
        s.ask("tiny").await;
        // Held by the engine, the request may be answered before siesta
        // heard back from its own wake.
        let st = wait_state(&mut s.c, "tiny", pb::ModelState::Awake, LONG).await;
        assert_eq!(st.restarts, 1, "{version}: woken, not restarted: {st:#?}");
        let stats = fake_stats(&engine).await;
        assert_eq!(stats["is_sleeping"], false, "{version}: {stats}");
        drop(s);
    }
}

/// A `/sleep?mode=wait` sent while a request runs (here by an operator,
/// straight to the engine) pauses the scheduler at once but sleeps the
/// memory only when the request is done. A control plane restarted in
/// between finds `/is_sleeping` true and wakes the engine for its preload:
/// vLLM's `/wake_up` then finds the memory awake, resumes the scheduler and
/// answers "awake", and the drained sleep still frees the memory after it,
/// under a running scheduler: the next request reached freed memory and
/// killed the engine. siesta now waits for such a drain before waking.
#[tokio::test]
async fn a_control_restarted_during_a_draining_sleep_wakes_the_engine_after_it() {
    // A request straight to the engine: 25 tokens, 5 s.
    restarted_during_a_draining_sleep(&["--tokens-per-second", "5"], "", 25).await;
}

/// The same with the drained request in a long prefill (6 s, as a long
/// prompt on a large model): it generates no token, only its KV cache grows.
/// The restarted control plane's wake waits for the drain to its end (at
/// most half its wake timeout, 30 s here). Before, no token for 2 s read as
/// requests a paused scheduler holds: the wake went out under the drain, and
/// the engine died at the next request.
#[tokio::test]
async fn a_draining_sleep_in_a_long_prefill_is_waited_for() {
    let flags = ["--prefill-time", "6s", "--tokens-per-second", "20"];
    restarted_during_a_draining_sleep(&flags, "wake_timeout = \"30s\"", 4).await;
}

/// `tiny` (fake-vllm with `flags`, model settings `extra`) runs a request of
/// `max_tokens` sent straight to its engine; an operator's `/sleep?mode=wait`
/// drains it; the control plane restarts meanwhile. Then a request through
/// the proxy is answered by the same engine, woken whole.
async fn restarted_during_a_draining_sleep(flags: &[&str], extra: &str, max_tokens: u32) {
    let mut s = stack(&fake_model("tiny", "awake", flags, extra)).await;
    let st = wait_state(&mut s.c, "tiny", pb::ModelState::Awake, LONG).await;
    let engine = endpoint(&st);
    let url = format!("{engine}/v1/completions");
    let direct = tokio::spawn(async move {
        let body = json!({"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": true});
        reqwest::Client::new()
            .post(url)
            .json(&body)
            .timeout(LONG)
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    wait_until("the direct request to run", LONG, || async {
        fake_stats(&engine).await["running"] == 1
    })
    .await;
    let url = format!("{engine}/sleep?level=1&mode=wait");
    let sleep = tokio::spawn(post(url));
    wait_until("the drain to begin", LONG, || async {
        fake_stats(&engine).await["is_sleeping"] == true
    })
    .await;

    s.ctl.restart().await;
    s.c = s.ctl.client().await;
    assert_eq!(direct.await.unwrap().ok(), Some(200));
    assert!(sleep.await.unwrap().status().is_success());
    s.ask("tiny").await;
    let st = wait_state(&mut s.c, "tiny", pb::ModelState::Awake, LONG).await;
    assert_eq!(st.restarts, 1, "woken, not restarted: {st:#?}");
    let stats = fake_stats(&engine).await;
    assert_eq!(stats["is_sleeping"], false, "{stats}");
    assert_eq!(stats["weights_intact"], true, "{stats}");
}
