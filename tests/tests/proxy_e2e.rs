//! siesta-proxy end to end: the real `siesta-control`, `siesta-proxy` and
//! `fake-vllm` binaries (`cargo build --workspace --bins` first).

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use siesta_proto::v1::{ListModelsRequest, ModelRequest};
use siesta_tests::ctl::{json_taken, refused_types};
use siesta_tests::{ControlProc, DEADLINE, ProxyProc, spawn_control_with, spawn_proxy, wait_until};

/// One model entry for the config; `args` are fake-vllm flags.
fn model_toml(name: &str, preload: &str, extra: &str, args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "[[model]]\nname = {name:?}\nmodel = \"org/{name}\"\nexecutable = \"@FAKE_VLLM@\"\n\
         preload = {preload:?}\nargs = [{}]\n{extra}\n",
        args.join(", ")
    )
}

fn config(models: &[String]) -> String {
    format!(
        "[control]\nlisten = \"127.0.0.1:0\"\nstate_dir = \"@DIR@/state\"\n\n\
         [defaults]\nmax_queue = 8\nmax_hold = \"60s\"\n\n{}",
        models.join("\n")
    )
}

/// A control plane and the proxies in front of it; engines are stopped at the end.
struct Stack {
    control: ControlProc,
    proxies: Vec<ProxyProc>,
    engine_pids: Vec<i32>,
}

impl Stack {
    async fn start(models: &[String], proxy_args: &[&str]) -> Stack {
        let control = spawn_control_with(&config(models), &["--stop-engines-on-exit"]).await;
        let proxy = spawn_proxy(&[control.url()], proxy_args).await;
        let s = Stack {
            control,
            proxies: vec![proxy],
            engine_pids: Vec::new(),
        };
        let url = s.url("/readyz");
        wait_until("proxy ready", DEADLINE, || async {
            matches!(http().get(&url).send().await, Ok(r) if r.status() == 200)
        })
        .await;
        s
    }

    /// One model, `sleepy`, asleep (its wake takes 1.5 s).
    async fn sleepy() -> Stack {
        let models = [model_toml(
            "sleepy",
            "asleep",
            "",
            &["--startup-time", "100ms", "--wake-time", "1500ms"],
        )];
        let mut s = Stack::start(&models, &[]).await;
        s.wait_state("sleepy", "asleep").await;
        s.track_engines().await;
        s
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.proxies[0].url())
    }

    /// Remembers engine pids so a failing test still kills them.
    async fn track_engines(&mut self) {
        let mut c = self.control.client().await;
        if let Ok(r) = c.list_models(ListModelsRequest {}).await {
            for m in r.into_inner().models {
                if m.pid != 0 && !self.engine_pids.contains(&(m.pid as i32)) {
                    self.engine_pids.push(m.pid as i32);
                }
            }
        }
    }

    async fn wait_state(&self, model: &str, state: &str) {
        let url = self.url(&format!("/v1/models/{model}"));
        wait_until(&format!("{model} {state}"), DEADLINE, || async {
            match http().get(&url).send().await {
                Ok(r) if r.status() == 200 => {
                    r.json::<Value>().await.unwrap()["siesta_state"] == state
                }
                _ => false,
            }
        })
        .await;
    }

    async fn held(&self, model: &str) -> f64 {
        let text = http()
            .get(format!("{}/metrics", self.proxies[0].admin_url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let prefix = format!("siesta_proxy_held_requests{{model=\"{model}\"}}");
        text.lines()
            .find(|l| l.starts_with(&prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    }

    async fn stop(mut self) {
        self.track_engines().await;
        self.control.terminate().await;
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        for pid in &self.engine_pids {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

struct Reply {
    status: u16,
    retry_after: Option<u64>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

async fn post(url: &str, body: &Value) -> Reply {
    post_raw(url, body.to_string()).await
}

async fn post_raw(url: &str, body: String) -> Reply {
    let r = http()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    Reply {
        status,
        retry_after,
        body: r.text().await.unwrap(),
    }
}

fn chat(model: &str) -> Value {
    json!({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
}

fn chat_stream(model: &str) -> Value {
    json!({"model": model, "max_tokens": 4, "stream": true, "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn awake_model_forwarded_and_errors_answered_by_the_proxy() {
    let models = [format!(
        "{}aliases = [\"gpt-x\"]\n",
        model_toml("chat", "awake", "", &["--startup-time", "100ms"])
    )];
    let mut s = Stack::start(&models, &["--max-body", "4096"]).await;
    s.wait_state("chat", "awake").await;
    s.track_engines().await;
    let url = s.url("/v1/chat/completions");

    let r = post(&url, &chat("gpt-x")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["model"],
        "chat",
        "alias rewritten to the served name"
    );
    // The proxy's activity report reaches the control plane.
    let client = s.control.client().await;
    wait_until("activity reported", DEADLINE, || {
        let mut client = client.clone();
        async move {
            let models = client
                .list_models(ListModelsRequest {})
                .await
                .unwrap()
                .into_inner()
                .models;
            models
                .iter()
                .any(|m| m.name == "chat" && m.last_activity_unix_ms > 0)
        }
    })
    .await;

    let r = post(&url, &chat("nope")).await;
    assert_eq!(r.status, 404);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("nope")
    );
    let r = post_raw(&url, "{\"model\": ".into()).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = post_raw(
        &url,
        json!({"model": "chat", "pad": "x".repeat(8192)}).to_string(),
    )
    .await;
    assert_eq!(r.status, 413);
    for path in [
        "/sleep?level=1",
        "/wake_up",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/is_sleeping",
        "/metrics",
        "/v1/../sleep",
    ] {
        let r = post(
            &s.url(path),
            &json!({"model": "chat", "method": "reload_weights"}),
        )
        .await;
        assert_eq!(r.status, 404, "{path}");
        let r = http().get(s.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 404, "GET {path}");
    }
    let models: Value = http()
        .get(s.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["chat", "gpt-x"]);
    s.stop().await;
}

#[tokio::test]
async fn sleeping_model_held_during_wake_then_answered() {
    let s = Stack::sleepy().await;
    let url = s.url("/v1/chat/completions");
    let t0 = Instant::now();
    let (c1, c2) = (chat("sleepy"), chat_stream("sleepy"));
    let (whole, streamed) = tokio::join!(post(&url, &c1), post(&url, &c2));
    assert!(
        t0.elapsed() >= Duration::from_millis(1000),
        "held during the wake"
    );
    assert_eq!(whole.status, 200, "{}", whole.body);
    assert_eq!(whole.json()["object"], "chat.completion");
    assert_eq!(streamed.status, 200);
    assert!(
        streamed.body.contains("chat.completion.chunk"),
        "{}",
        streamed.body
    );
    assert!(
        streamed.body.trim_end().ends_with("data: [DONE]"),
        "{}",
        streamed.body
    );
    s.stop().await;
}

#[tokio::test]
async fn queue_overflow_and_max_hold_shed_with_retry_after() {
    let slow = ["--startup-time", "100ms", "--wake-time", "30s"];
    let models = [
        model_toml("one", "asleep", "max_queue = 1", &slow),
        model_toml("six", "asleep", "max_queue = 6", &slow),
        model_toml("brief", "asleep", "max_hold = \"1s\"", &slow),
    ];
    let mut s = Stack::start(&models, &[]).await;
    for m in ["one", "six", "brief"] {
        s.wait_state(m, "asleep").await;
    }
    s.track_engines().await;
    let url = s.url("/v1/chat/completions");
    let mut held = Vec::new();
    for (m, n) in [("one", 1), ("six", 6)] {
        for _ in 0..n {
            let url = url.clone();
            held.push(tokio::spawn(async move { post(&url, &chat(m)).await }));
        }
    }
    wait_until("queues full", DEADLINE, || async {
        s.held("one").await == 1.0 && s.held("six").await == 6.0
    })
    .await;
    let r1 = post(&url, &chat("one")).await;
    let r6 = post(&url, &chat("six")).await;
    assert_eq!((r1.status, r6.status), (503, 503));
    assert_eq!(r1.json()["error"]["code"], "queue_full");
    let (a, b) = (r1.retry_after.unwrap(), r6.retry_after.unwrap());
    assert!(
        b > a,
        "Retry-After grows with depth: {a} (1 ahead) vs {b} (6 ahead)"
    );

    let t0 = Instant::now();
    let r = post(&url, &chat("brief")).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "hold_timeout");
    assert!(r.retry_after.unwrap() >= 1);
    assert!(t0.elapsed() >= Duration::from_millis(900));
    for t in held {
        t.abort();
    }
    s.stop().await;
}

/// Requests held for a waking model that an operator then stops are
/// answered at once (503 `model_unavailable`, naming the stop, no
/// Retry-After: retrying will not help until an operator acts), not left
/// waiting until `max_hold`; a request that comes after is refused alike.
#[tokio::test]
async fn held_requests_answered_when_an_operator_stops_the_model() {
    let models = [model_toml(
        "slow",
        "asleep",
        "",
        &["--startup-time", "100ms", "--wake-time", "60s"],
    )];
    let mut s = Stack::start(&models, &[]).await;
    s.wait_state("slow", "asleep").await;
    s.track_engines().await;
    let url = s.url("/v1/chat/completions");
    let held: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, &chat("slow")).await })
        })
        .collect();
    wait_until("3 held", DEADLINE, || async { s.held("slow").await == 3.0 }).await;
    s.wait_state("slow", "waking").await;
    let t0 = Instant::now();
    s.control
        .client()
        .await
        .stop(ModelRequest {
            name: "slow".into(),
        })
        .await
        .expect("Stop");
    for h in held {
        let r = h.await.unwrap();
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "model_unavailable", "{}", r.body);
        assert!(r.body.contains("stopped by an operator"), "{}", r.body);
        assert_eq!(r.retry_after, None);
    }
    assert!(
        t0.elapsed() < Duration::from_secs(45),
        "answered at the stop, not at max_hold (60 s): {:?}",
        t0.elapsed()
    );
    let r = post(&url, &chat("slow")).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "model_unavailable", "{}", r.body);
    assert!(
        r.body.contains("`siesta start slow`"),
        "says what to do: {}",
        r.body
    );
    assert_eq!(s.held("slow").await, 0.0);
    s.stop().await;
}

/// Starts a streamed completion of `tokens` tokens and reads its first
/// event; the caller reads the rest.
async fn stream_started(url: &str, model: &str, tokens: u32) -> reqwest::Response {
    let mut body = chat_stream(model);
    body["max_tokens"] = json!(tokens);
    let r = http().post(url).json(&body).send().await.expect("stream");
    assert_eq!(r.status(), 200);
    r
}

/// The rest of a stream: it must end with `data: [DONE]`, not be cut.
async fn finish_stream(mut r: reqwest::Response, what: &str) {
    let mut text = Vec::new();
    while let Some(c) = r
        .chunk()
        .await
        .unwrap_or_else(|e| panic!("{what}: cut: {e}"))
    {
        text.extend_from_slice(&c);
    }
    let text = String::from_utf8_lossy(&text);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{what}: {text}");
}

/// An operator's stop or restart of a model answering a stream: the
/// stream finishes (the engine gets SIGTERM only once the proxy has
/// nothing in flight to it), meanwhile the model is `stopping` and new
/// requests are refused (stop) or held and served after (restart).
#[tokio::test]
async fn operator_stop_and_restart_let_streams_finish() {
    // 20 tokens at 10 a second: about 2 s of stream after the command.
    let steady = ["--startup-time", "100ms", "--tokens-per-second", "10"];
    let models = [
        model_toml("halt", "awake", "", &steady),
        model_toml("again", "awake", "", &steady),
    ];
    let mut s = Stack::start(&models, &[]).await;
    s.wait_state("halt", "awake").await;
    s.wait_state("again", "awake").await;
    s.track_engines().await;
    let url = s.url("/v1/chat/completions");
    let mut c = s.control.client().await;
    let lister = c.clone();
    let pid_of = |m: &str| {
        let (mut c, m) = (lister.clone(), m.to_string());
        async move {
            let r = c
                .list_models(ListModelsRequest {})
                .await
                .unwrap()
                .into_inner();
            r.models.into_iter().find(|x| x.name == m).unwrap().pid
        }
    };

    // Stop.
    let mut stream = stream_started(&url, "halt", 20).await;
    let first = stream.chunk().await.unwrap().expect("first event");
    assert!(!first.is_empty());
    c.stop(ModelRequest {
        name: "halt".into(),
    })
    .await
    .expect("Stop");
    s.wait_state("halt", "stopping").await;
    let r = post(&url, &chat("halt")).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "model_unavailable", "{}", r.body);
    finish_stream(stream, "stream during a stop").await;
    s.wait_state("halt", "stopped").await;

    // Restart.
    let before = pid_of("again").await;
    let mut stream = stream_started(&url, "again", 20).await;
    stream.chunk().await.unwrap().expect("first event");
    c.restart(ModelRequest {
        name: "again".into(),
    })
    .await
    .expect("Restart");
    s.wait_state("again", "stopping").await;
    let held = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, &chat("again")).await })
    };
    finish_stream(stream, "stream during a restart").await;
    let r = held.await.unwrap();
    assert_eq!(r.status, 200, "held through the restart: {}", r.body);
    s.track_engines().await;
    let after = pid_of("again").await;
    assert!(
        after != 0 && after != before,
        "restarted: pid {before} → {after}"
    );
    s.stop().await;
}

/// A reload (SIGHUP) that changes one model's engine and removes another
/// while each answers a stream: both streams finish (the old engines drain
/// like an operator's stop); a request made while the changed model's old
/// engine drains is held and answered by the new one; the removed model is
/// unknown afterwards.
#[tokio::test]
async fn reload_lets_streams_finish_and_hands_held_requests_to_the_new_engine() {
    let steady = ["--startup-time", "100ms", "--tokens-per-second", "10"];
    let (changed, removed) = (
        model_toml("changed", "awake", "", &steady),
        model_toml("removed", "awake", "", &steady),
    );
    let mut s = Stack::start(&[changed.clone(), removed], &[]).await;
    s.wait_state("changed", "awake").await;
    s.wait_state("removed", "awake").await;
    s.track_engines().await;
    let url = s.url("/v1/chat/completions");
    let mut c = s.control.client().await;
    let pid = |r: &siesta_proto::v1::ListModelsResponse, m: &str| {
        r.models.iter().find(|x| x.name == m).map(|x| x.pid)
    };
    let before = c
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    let mut streams = Vec::new();
    for m in ["changed", "removed"] {
        let mut r = stream_started(&url, m, 20).await;
        r.chunk().await.unwrap().expect("first event");
        streams.push((m, r));
    }
    let new = config(&[model_toml(
        "changed",
        "awake",
        "",
        &["--startup-time", "100ms", "--max-model-len", "4096"],
    )]);
    let new = new
        .replace("@DIR@", &s.control.dir.path().to_string_lossy())
        .replace("@FAKE_VLLM@", &siesta_tests::fake_vllm_command());
    std::fs::write(&s.control.config_path, new).unwrap();
    s.control.child.signal(nix::sys::signal::Signal::SIGHUP);
    s.wait_state("changed", "stopping").await;
    let held = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, &chat("changed")).await })
    };
    for (m, r) in streams {
        finish_stream(r, &format!("{m} during the reload")).await;
    }
    let r = held.await.unwrap();
    assert_eq!(r.status, 200, "held across the change: {}", r.body);
    let after = c
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    s.track_engines().await;
    assert!(
        pid(&after, "changed").is_some_and(|p| p != 0 && Some(p) != pid(&before, "changed")),
        "a new engine: {before:?} → {after:?}"
    );
    assert_eq!(pid(&after, "removed"), None, "removed: {after:?}");
    let r = post(&url, &chat("removed")).await;
    assert_eq!(r.status, 404, "{}", r.body);
    s.stop().await;
}

#[tokio::test]
async fn client_disconnect_while_held_frees_its_slot() {
    let models = [model_toml(
        "one",
        "asleep",
        "max_queue = 1",
        &["--startup-time", "100ms", "--wake-time", "4s"],
    )];
    let mut s = Stack::start(&models, &[]).await;
    s.wait_state("one", "asleep").await;
    s.track_engines().await;
    let url = s.url("/v1/chat/completions");
    let u = url.clone();
    let first = tokio::spawn(async move { post(&u, &chat("one")).await });
    wait_until("first held", DEADLINE, || async {
        s.held("one").await == 1.0
    })
    .await;
    first.abort();
    wait_until("slot freed", DEADLINE, || async {
        s.held("one").await == 0.0
    })
    .await;
    // The freed slot takes the next request, which is answered after the wake.
    let r = post(&url, &chat("one")).await;
    assert_eq!(r.status, 200, "{}", r.body);
    s.stop().await;
}

#[tokio::test]
async fn control_killed_then_restarted() {
    let models = [
        model_toml("awake", "awake", "", &["--startup-time", "100ms"]),
        model_toml(
            "sleepy",
            "asleep",
            "max_hold = \"2s\"",
            &["--startup-time", "100ms", "--wake-time", "500ms"],
        ),
    ];
    let mut s = Stack::start(&models, &[]).await;
    s.wait_state("awake", "awake").await;
    s.wait_state("sleepy", "asleep").await;
    s.track_engines().await;
    let url = s.url("/v1/chat/completions");
    s.control.kill9();
    for _ in 0..3 {
        assert_eq!(post(&url, &chat("awake")).await.status, 200);
    }
    let t0 = Instant::now();
    let r = post(&url, &chat("sleepy")).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        t0.elapsed() >= Duration::from_millis(1900),
        "held until max_hold"
    );

    s.control.restart().await;
    // The proxy resyncs and the sleeping model is woken on demand again.
    wait_until("served after resync", DEADLINE, || async {
        post(&url, &chat("sleepy")).await.status == 200
    })
    .await;
    assert_eq!(post(&url, &chat("awake")).await.status, 200);
    s.stop().await;
}

#[tokio::test]
async fn two_proxies_against_one_control() {
    let models = [model_toml(
        "sleepy",
        "asleep",
        "",
        &["--startup-time", "100ms", "--wake-time", "1s"],
    )];
    let mut s = Stack::start(&models, &[]).await;
    let second = spawn_proxy(&[s.control.url()], &[]).await;
    s.proxies.push(second);
    s.wait_state("sleepy", "asleep").await;
    s.track_engines().await;
    let a = s.url("/v1/chat/completions");
    let b = format!("{}/v1/chat/completions", s.proxies[1].url());
    let (c1, c2) = (chat("sleepy"), chat_stream("sleepy"));
    let (ra, rb) = tokio::join!(post(&a, &c1), post(&b, &c2));
    assert_eq!(ra.status, 200, "{}", ra.body);
    assert_eq!(rb.status, 200, "{}", rb.body);
    assert!(rb.body.contains("[DONE]"));
    s.stop().await;
}

#[tokio::test]
async fn openai_client_chat_streaming_and_embeddings() {
    use async_openai::config::OpenAIConfig;
    use async_openai::types::{
        ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs,
        CreateEmbeddingRequestArgs,
    };
    use futures::StreamExt;

    let models = [
        model_toml(
            "chat",
            "asleep",
            "",
            &["--startup-time", "100ms", "--wake-time", "300ms"],
        ),
        // vLLM serves /v1/embeddings only for a pooling model.
        model_toml(
            "embed",
            "awake",
            "",
            &["--runner", "pooling", "--startup-time", "100ms"],
        ),
    ];
    let mut s = Stack::start(&models, &[]).await;
    s.wait_state("chat", "asleep").await;
    s.wait_state("embed", "awake").await;
    s.track_engines().await;
    let client = async_openai::Client::with_config(
        OpenAIConfig::new()
            .with_api_base(s.url("/v1"))
            .with_api_key("unused"),
    );
    let msg = ChatCompletionRequestUserMessageArgs::default()
        .content("hello")
        .build()
        .unwrap();
    let req = CreateChatCompletionRequestArgs::default()
        .model("chat")
        .max_tokens(8u32)
        .messages([msg.clone().into()])
        .build()
        .unwrap();
    let resp = client.chat().create(req.clone()).await.unwrap();
    assert_eq!(resp.model, "chat");
    assert!(
        !resp.choices[0]
            .message
            .content
            .as_deref()
            .unwrap_or("")
            .is_empty()
    );

    let mut stream = client.chat().create_stream(req).await.unwrap();
    let mut text = String::new();
    let mut chunks = 0;
    while let Some(chunk) = tokio::time::timeout(DEADLINE, stream.next()).await.unwrap() {
        let chunk = chunk.unwrap();
        chunks += 1;
        for c in chunk.choices {
            text.push_str(c.delta.content.as_deref().unwrap_or(""));
        }
    }
    assert!(chunks > 1 && !text.is_empty(), "{chunks} chunks: {text:?}");

    let req = CreateEmbeddingRequestArgs::default()
        .model("embed")
        .input(["one", "two"])
        .build()
        .unwrap();
    let emb = client.embeddings().create(req).await.unwrap();
    assert_eq!(emb.data.len(), 2);
    assert!(!emb.data[0].embedding.is_empty());
    s.stop().await;
}

/// An engine that crashes (`--crash-after-requests 1`: its second request
/// kills it) is restarted after its backoff. A request that comes while it
/// is down after a first crash is held through the restart and served; once
/// it crashed twice in a row (it keeps failing), requests are answered at
/// once, 503 `model_failed` with the time to its next try, and served again
/// after it.
#[tokio::test]
async fn engine_crash_then_served_again() {
    let models = [model_toml(
        "chat",
        "awake",
        "",
        &["--startup-time", "100ms", "--crash-after-requests", "1"],
    )];
    let cfg = config(&models).replace(
        "[defaults]\n",
        "[defaults]\nbackoff_initial = \"2s\"\nbackoff_max = \"30s\"\n",
    );
    let control = spawn_control_with(&cfg, &["--stop-engines-on-exit"]).await;
    let proxy = spawn_proxy(&[control.url()], &[]).await;
    let mut s = Stack {
        control,
        proxies: vec![proxy],
        engine_pids: Vec::new(),
    };
    s.wait_state("chat", "awake").await;
    s.track_engines().await;
    let url = s.url("/v1/chat/completions");
    assert_eq!(post(&url, &chat("chat")).await.status, 200);
    // Each engine serves one request; the next kills it. Until the model
    // has failed twice in a row every request is answered 200 (held
    // through the first restart) or, the one that reached a dying engine,
    // 502; then 503 `model_failed`.
    let start = Instant::now();
    let mut served_after_a_crash = 0;
    let failed = loop {
        let r = post(&url, &chat("chat")).await;
        match r.status {
            200 => served_after_a_crash += 1,
            502 => {}
            503 => break r,
            other => panic!("{other} {}", r.body),
        }
        assert!(start.elapsed() < DEADLINE, "never failed twice");
    };
    assert!(
        served_after_a_crash >= 1,
        "no request held through a first crash"
    );
    assert_eq!(
        failed.json()["error"]["code"],
        "model_failed",
        "{}",
        failed.body
    );
    let msg = failed.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(msg.contains("failed 2 times in a row"), "{msg}");
    let wait = failed.retry_after.expect("Retry-After");
    assert!((1..=4).contains(&wait), "retry in {wait}s");
    // After the next try it serves again.
    loop {
        let r = post(&url, &chat("chat")).await;
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "model_failed");
        assert!(start.elapsed() < DEADLINE, "never served again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.track_engines().await;
    s.stop().await;
}

/// A request vLLM refuses before reading it (its `Content-Type` is not
/// `application/json`: `curl -d` sends a form type, some clients none) is
/// answered 400 by the proxy in vLLM's words, and its model is not woken
/// for it: before, it was held, the model woken, and vLLM's 400 came after
/// the wake. A JSON request after it is served as ever.
#[tokio::test]
async fn a_request_vllm_would_refuse_for_its_content_type_wakes_nothing() {
    let s = Stack::sleepy().await;
    let url = s.url("/v1/chat/completions");
    let body = chat("sleepy").to_string();
    for v in refused_types(&url, &body).await {
        assert_eq!(v["error"]["code"], "unsupported_media_type", "{v}");
    }
    let mut c = s.control.client().await;
    let m = c
        .get_model(siesta_proto::v1::GetModelRequest {
            name: "sleepy".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .model
        .unwrap();
    assert_eq!(
        m.state,
        siesta_proto::v1::ModelState::Asleep as i32,
        "woken for requests it refuses: {m:?}"
    );
    json_taken(&url, &body).await;
    s.stop().await;
}
