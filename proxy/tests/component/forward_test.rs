//! Forwarding to awake models: rewrite, streaming, headers, balancing,
//! cancellation, refused connections, activity.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use http_body_util::BodyExt;
use siesta_proto::v1::{Endpoint, ModelState};

use crate::control::{ScriptedControl, model};
use crate::engine::Engine;
use crate::support::*;

#[tokio::test]
async fn forwards_and_rewrites_alias_to_served_name() {
    let e = Engine::start("e1").await;
    let mut m = model("m", ModelState::Awake, &[&e.url]);
    m.aliases = vec!["short".into()];
    m.endpoints[0].served_model_name = "org/served".into();
    let c = ScriptedControl::start(vec![m]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;

    let body = r#"{"messages":[{"role":"user","content":"hi"}],"model":"short","max_tokens":3}"#;
    let r = post(&p.url("/v1/chat/completions?x=1"), body).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.json()["model"], "org/served");
    assert_eq!(r.headers["x-engine"], "e1");
    assert!(
        !r.headers.contains_key("x-hop"),
        "hop-by-hop header named in Connection leaked"
    );
    let (path, got) = e.received().pop().unwrap();
    assert_eq!(path, "/v1/chat/completions");
    assert_eq!(got["model"], "org/served");
    assert_eq!(got["max_tokens"], 3);

    let r = post(&p.url("/v1/embeddings"), r#"{"model":"m","input":"x"}"#).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["embedding"][1], 0.2);
}

/// Bodies that vLLM's server (Python's `json.loads` on the bytes) reads:
/// a UTF-8 byte order mark first, the `model` key twice (the last counts).
#[tokio::test]
async fn bodies_vllm_reads_are_routed_by_the_model_it_reads() {
    let e = Engine::start("e1").await;
    let mut m = model("m", ModelState::Awake, &[&e.url]);
    m.aliases = vec!["short".into()];
    m.endpoints[0].served_model_name = "org/served".into();
    let c = ScriptedControl::start(vec![m]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    for body in [
        "\u{feff}{\"model\":\"short\",\"max_tokens\":3}",
        "\u{feff}{\"model\":\"m\",\"max_tokens\":3}",
        r#"{"model":"nope","max_tokens":3,"model":"short"}"#,
    ] {
        let r = post(&p.url("/v1/chat/completions"), body).await;
        assert_eq!(r.status, 200, "{body:?}: {:?}", r.body);
        let (_, got) = e.received().pop().unwrap();
        assert_eq!(got["model"], "org/served", "{body:?}");
        assert_eq!(got["max_tokens"], 3, "{body:?}");
    }
    // The engine would answer for the last one, which is not served here.
    let r = post(
        &p.url("/v1/chat/completions"),
        r#"{"model":"short","model":"nope"}"#,
    )
    .await;
    assert_eq!(r.status, 404, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
}

#[tokio::test]
async fn streams_without_buffering() {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    e.set_gate(false);
    let resp = send(
        Method::POST,
        &p.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        Bytes::from(chat_stream("m")),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    // The first chunk arrives while the engine still holds the rest.
    let first = tokio::time::timeout(DEADLINE, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let first = first.into_data().unwrap();
    assert!(std::str::from_utf8(&first).unwrap().contains("tok1"));
    e.set_gate(true);
    let rest = body.collect().await.unwrap().to_bytes();
    let rest = std::str::from_utf8(&rest).unwrap();
    assert!(
        rest.contains("tok2") && rest.ends_with("data: [DONE]\n\n"),
        "{rest}"
    );
}

#[tokio::test]
async fn client_disconnect_cancels_upstream() {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    e.set_gate(false);
    // A streaming request, dropped after the first chunk.
    let resp = send_chat_stream(&p.url("/v1/chat/completions"), "m").await;
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    wait_until("stream cancelled at the engine", || async {
        e.state.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    // A whole request, dropped while the engine works on it.
    let url = p.url("/v1/chat/completions");
    let req = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("request at the engine", || async {
        e.state.in_flight.load(Ordering::SeqCst) == 1
    })
    .await;
    req.abort();
    wait_until("request cancelled at the engine", || async {
        e.state.cancelled.load(Ordering::SeqCst) == 2
    })
    .await;
}

#[tokio::test]
async fn least_outstanding_requests_wins() {
    let slow = Engine::start("slow").await;
    let fast = Engine::start("fast").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&slow.url, &fast.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    slow.set_gate(false);
    fast.set_gate(false);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let url = p.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move { post(&url, &chat("m")).await }));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    wait_until("4 requests at the engines", || async {
        slow.state.in_flight.load(Ordering::SeqCst) + fast.state.in_flight.load(Ordering::SeqCst)
            == 4
    })
    .await;
    assert_eq!(slow.state.in_flight.load(Ordering::SeqCst), 2);
    assert_eq!(fast.state.in_flight.load(Ordering::SeqCst), 2);
    fast.set_gate(true);
    wait_until("fast ones done", || async {
        fast.state.in_flight.load(Ordering::SeqCst) == 0
    })
    .await;
    // Now the fast engine has fewer outstanding: it gets the next ones.
    for _ in 0..3 {
        let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
        assert_eq!(r.headers["x-engine"], "fast");
    }
    slow.set_gate(true);
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
}

#[tokio::test]
async fn refused_connection_goes_elsewhere_and_is_reported() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let e = Engine::start("live").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&dead, &e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    for _ in 0..4 {
        let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.headers["x-engine"], "live");
    }
    wait_until("failure reported", || async {
        c.reports()
            .iter()
            .any(|r| r.failures.iter().any(|f| f.url == dead && f.model == "m"))
    })
    .await;
    wait_until("activity reported", || async {
        let started: u32 = c
            .reports()
            .iter()
            .flat_map(|r| &r.models)
            .filter(|m| m.model == "m")
            .map(|m| m.started)
            .sum();
        let finished: u32 = c
            .reports()
            .iter()
            .flat_map(|r| &r.models)
            .filter(|m| m.model == "m")
            .map(|m| m.finished)
            .sum();
        started >= 4 && finished >= 4
    })
    .await;
    assert!(c.reports().iter().all(|r| r.proxy_id.starts_with("proxy@")));
}

#[tokio::test]
async fn refused_connection_everywhere_holds_until_a_new_endpoint() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&dead])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let url = p.url("/v1/chat/completions");
    let req = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("failure reported", || async {
        c.reports().iter().any(|r| !r.failures.is_empty())
    })
    .await;
    let e = Engine::start("new").await;
    let mut m = model("m", ModelState::Awake, &[]);
    m.endpoints = vec![Endpoint {
        url: e.url.clone(),
        served_model_name: "m".into(),
    }];
    c.set(m);
    let r = req.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-engine"], "new");
}

#[tokio::test]
async fn http2_clients_are_served() {
    use http_body_util::Full;
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    for body in [chat("m"), chat_stream("m")] {
        let req = http::Request::post(p.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_2);
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(!body.is_empty());
    }
}

/// An engine that sends nothing on a request for `--upstream-timeout` (a
/// hung engine core behind a server that still answers its health probe)
/// has the request ended: a whole request gets 504 `upstream_timeout`, a
/// stream that stalls ends with an error event, and the engine sees both
/// end (they counted in flight for ever, and kept the model awake).
#[tokio::test]
async fn an_engine_that_sends_nothing_for_the_upstream_timeout_has_the_request_ended() {
    let e = Engine::start("e1").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.upstream_timeout = Duration::from_millis(500)
    })
    .await;
    e.set_gate(false);
    let asked = std::time::Instant::now();
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 504, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "upstream_timeout");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("sent nothing for 500ms")),
        "{:?}",
        r.body
    );
    assert!(asked.elapsed() >= Duration::from_millis(500));
    wait_until("the whole request ended at the engine", || async {
        e.state.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    // A stream: its first chunk comes, then nothing.
    let resp = send_chat_stream(&p.url("/v1/chat/completions"), "m").await;
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let text = std::str::from_utf8(&body).unwrap();
    assert!(text.contains("tok1"), "{text}");
    assert!(!text.contains("tok2"), "{text}");
    assert!(
        text.contains("--upstream-timeout"),
        "an error event: {text}"
    );
    wait_until("the stream ended at the engine", || async {
        e.state.cancelled.load(Ordering::SeqCst) == 2
    })
    .await;
    // A slow engine within the limit is waited for.
    e.set_gate(true);
    assert_eq!(
        post(&p.url("/v1/chat/completions"), &chat("m"))
            .await
            .status,
        200
    );
}
