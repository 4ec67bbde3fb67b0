//! The proxy's own HTTP/1.1 client to engines, end to end against a raw
//! engine that answers each request with scripted bytes: every framing an
//! HTTP/1.1 server may use reaches the client whole, hop-by-hop headers
//! stop at the proxy both ways, a connection the engine closes is not
//! reused, and a reply that is not HTTP is a 502 that says so.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use siesta_proto::v1::ModelState;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::control::{ScriptedControl, model};
use crate::support::*;

/// The engine's side: scripted answers (bytes, then close or not), the
/// request heads it read, the connections it accepted.
#[derive(Default)]
pub(crate) struct Script {
    answers: Mutex<VecDeque<(Vec<u8>, bool)>>,
    pub(crate) requests: Mutex<Vec<String>>,
    pub(crate) connections: AtomicUsize,
}

pub(crate) async fn engine(answers: Vec<(&str, bool)>) -> (String, Arc<Script>) {
    let script = Arc::new(Script::default());
    script
        .answers
        .lock()
        .unwrap()
        .extend(answers.into_iter().map(|(a, c)| (a.as_bytes().to_vec(), c)));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let s = script.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            s.connections.fetch_add(1, Ordering::SeqCst);
            let s = s.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(req) = read_request(&mut conn, &mut buf).await {
                    s.requests.lock().unwrap().push(req);
                    let next = s.answers.lock().unwrap().pop_front();
                    let Some((answer, close)) = next else { return };
                    if conn.write_all(&answer).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    (url, script)
}

async fn proxy_to(url: &str) -> (ScriptedControl, TestProxy) {
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    (c, p)
}

#[tokio::test]
async fn every_framing_reaches_the_client_whole_and_hop_by_hop_headers_stop_here() {
    let (url, script) = engine(vec![
        // Sized, and the engine closes after it.
        (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: 11\r\n\r\n{\"a\":\"one\"}",
            true,
        ),
        // HTTP/1.0, no length: the body ends when the engine closes.
        (
            "HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{\"b\":\"two\"}",
            true,
        ),
        // An interim 100 first; chunked with an extension and trailers;
        // hop-by-hop headers, one named by Connection.
        (
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
             transfer-encoding: chunked\r\nconnection: keep-alive, x-internal\r\nx-internal: secret\r\n\
             keep-alive: timeout=5\r\nx-request-id: r3\r\n\r\n\
             4;ext=1\r\n{\"c\"\r\n8\r\n:\"three\"\r\n1\r\n}\r\n0\r\nx-checksum: 1\r\n\r\n",
            false,
        ),
        // On the same connection as the one before.
        (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            false,
        ),
    ])
    .await;
    let (_c, p) = proxy_to(&url).await;
    let hop = [("connection", "x-hop"), ("x-hop", "1"), ("x-end", "2")];
    let bodies = [r#"{"a":"one"}"#, r#"{"b":"two"}"#, r#"{"c":"three"}"#, "{}"];
    for (i, want) in bodies.iter().enumerate() {
        let r = post_with(&p.url("/v1/chat/completions"), &hop, &chat("m")).await;
        assert_eq!(r.status, 200, "answer {i}: {:?}", r.body);
        assert_eq!(r.body, want.as_bytes(), "answer {i}");
        if i == 2 {
            assert_eq!(r.headers["x-request-id"], "r3");
            for h in ["x-internal", "keep-alive", "x-checksum"] {
                assert!(r.headers.get(h).is_none(), "{h} reached the client");
            }
        }
    }
    assert_eq!(
        script.connections.load(Ordering::SeqCst),
        3,
        "the two connections the engine closed were not reused; the third carried two"
    );
    let engine_host = url.trim_start_matches("http://");
    for req in script.requests.lock().unwrap().iter() {
        assert!(req.contains(&format!("host: {engine_host}\r\n")), "{req}");
        assert!(
            req.contains("x-end: 2\r\n"),
            "an end-to-end header was lost: {req}"
        );
        assert!(
            !req.contains("x-hop"),
            "a header the client's Connection named went on: {req}"
        );
        let body = &req[req.find("\r\n\r\n").unwrap() + 4..];
        assert!(
            req.contains(&format!("content-length: {}\r\n", body.len())),
            "{req}"
        );
    }
}

#[tokio::test]
async fn a_reply_that_is_not_http_is_a_502_that_says_so() {
    let (url, _script) = engine(vec![("SSH-2.0-OpenSSH_9.2\r\n\r\n", true)]).await;
    let (_c, p) = proxy_to(&url).await;
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("invalid response from the engine"), "{msg}");
}

#[tokio::test]
async fn a_sized_body_the_engine_cuts_short_is_not_passed_off_as_whole() {
    let (url, script) = engine(vec![
        (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 50\r\n\r\n{\"cut\":",
            true,
        ),
        (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            false,
        ),
    ])
    .await;
    let (_c, p) = proxy_to(&url).await;
    // The client sees a failed exchange (the head may or may not have been
    // flushed before the cut), never a complete 200.
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::post(p.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(chat("m"))))
        .unwrap();
    let whole = match tokio::time::timeout(DEADLINE, client.request(req)).await {
        Err(_) => panic!("the request hung"),
        Ok(Err(_)) => false,
        Ok(Ok(resp)) => {
            let body = http_body_util::BodyExt::collect(resp.into_body());
            matches!(tokio::time::timeout(DEADLINE, body).await, Ok(Ok(_)))
        }
    };
    assert!(!whole, "a body cut at 7 of 50 bytes was delivered as whole");
    // The next request goes on a new connection and is answered.
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "{}".as_bytes());
    assert_eq!(script.connections.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_request_the_engine_began_to_answer_is_not_sent_again() {
    let (url, script) = engine(vec![
        (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            false,
        ),
        // On the reused connection: part of a head, then the close.
        ("HTTP/1.1 200 OK\r\ncontent-ty", true),
        // What a second attempt would get.
        (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            false,
        ),
    ])
    .await;
    let (_c, p) = proxy_to(&url).await;
    assert_eq!(
        post(&p.url("/v1/chat/completions"), &chat("m"))
            .await
            .status,
        200
    );
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    assert_eq!(
        script.requests.lock().unwrap().len(),
        2,
        "a request with part of its answer received was sent again"
    );
}

/// An engine that answers as soon as it has a request's head, without
/// reading its body, then closes the connection or keeps it open without
/// reading more; the heads it read.
async fn early_answering_engine(answer: &'static str, close: bool) -> (String, Arc<Script>) {
    let script = Arc::new(Script::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let s = script.clone();
    tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((mut conn, _)) = listener.accept().await {
            s.connections.fetch_add(1, Ordering::SeqCst);
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let mut byte = [0u8; 1];
                match tokio::io::AsyncReadExt::read(&mut conn, &mut byte).await {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            s.requests
                .lock()
                .unwrap()
                .push(String::from_utf8_lossy(&head).into_owned());
            let _ = conn.write_all(answer.as_bytes()).await;
            if !close {
                open.push(conn);
            }
        }
    });
    (url, script)
}

#[tokio::test]
async fn an_engine_that_answers_before_reading_a_large_body_is_heard() {
    // Far more than the socket buffers hold: the proxy cannot finish
    // writing it to an engine that stops reading.
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(24 * 1024 * 1024)
    );
    let answer = "HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n\
                  content-length: 21\r\n\r\n{\"error\":\"too large\"}";
    for close in [true, false] {
        let (url, script) = early_answering_engine(answer, close).await;
        let (_c, p) = proxy_to(&url).await;
        for round in 0..2 {
            let r = tokio::time::timeout(DEADLINE, post(&p.url("/v1/chat/completions"), &big))
                .await
                .unwrap_or_else(|_| panic!("hung (engine closes: {close}, round {round})"));
            assert_eq!(
                r.status, 413,
                "engine closes: {close}, round {round}: {:?}",
                r.body
            );
            assert_eq!(r.body, br#"{"error":"too large"}"#.as_slice());
        }
        assert_eq!(
            script.connections.load(Ordering::SeqCst),
            2,
            "a connection with part of a request on it was reused (engine closes: {close})"
        );
    }
}

async fn form_post(url: &str, content_type: &str, body: String) -> Reply {
    let h = [("content-type", content_type)];
    reply(send(http::Method::POST, url, &h, body.into()).await).await
}

/// `POST /v1/audio/transcriptions` (and `/translations`) is
/// `multipart/form-data`, the model one of its fields (the OpenAI SDKs and
/// `curl -F` send it so; vLLM serves it for Whisper models): routed by that
/// field, an alias rewritten to the served name, every other byte as sent.
#[tokio::test]
async fn a_multipart_form_request_is_routed_by_its_model_field() {
    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{\"text\":\"\"}\n";
    let (url, script) = engine(vec![(ok, false), (ok, false)]).await;
    let mut m = model("m", ModelState::Awake, &[&url]);
    m.aliases = vec!["whisper".into()];
    m.endpoints[0].served_model_name = "org/whisper-v3".into();
    let c = ScriptedControl::start(vec![m]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    // Audio bytes that hold CRLFs, dashes and a near miss of the boundary.
    let audio = "RIFF\r\n--b0undary\r\n\r\n--\0\u{1}\r\n";
    let form = |b: &str, model: &str, model_last: bool| {
        let model_part =
            format!("--{b}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n");
        let file_part = format!(
            "--{b}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
             content-type: audio/wav\r\n\r\n{audio}\r\n"
        );
        let (first, second) = match model_last {
            false => (model_part, file_part),
            true => (file_part, model_part),
        };
        format!(
            "{first}{second}--{b}\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nen\r\n--{b}--\r\n"
        )
    };
    for (ct, b, name, model_last) in [
        // httpx (the OpenAI Python SDK): model before the file.
        (
            "multipart/form-data; boundary=b0undary1",
            "b0undary1",
            "whisper",
            false,
        ),
        // curl -F, quoted boundary, model after the file.
        (
            "Multipart/Form-Data; charset=utf-8; boundary=\"------------------------3f1a\"",
            "------------------------3f1a",
            "m",
            true,
        ),
    ] {
        let body = form(b, name, model_last);
        let r = form_post(&p.url("/v1/audio/transcriptions"), ct, body).await;
        assert_eq!(r.status, 200, "{ct}: {:?}", r.body);
        let got = script.requests.lock().unwrap().pop().unwrap();
        let sent = &got[got.find("\r\n\r\n").unwrap() + 4..];
        assert_eq!(sent, form(b, "org/whisper-v3", model_last), "{ct}");
        assert!(got.contains(&format!("content-type: {ct}\r\n")), "{got}");
    }
}

/// vLLM answers a request that names no model (no `model`, `null` or `""`)
/// with its one model; so does a proxy that serves one model, forwarding
/// the body as it came. With two models served it is a 400 that names them.
#[tokio::test]
async fn a_request_naming_no_model_goes_to_the_one_model_served() {
    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let (url, script) = engine(vec![(ok, false); 4]).await;
    let (c, p) = proxy_to(&url).await;
    let form = "--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--x--\r\n";
    let json = [
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
        r#"{"model":null,"prompt":"hi"}"#,
        r#"{"model":"","prompt":"hi"}"#,
    ];
    for body in json {
        let r = post(&p.url("/v1/chat/completions"), body).await;
        assert_eq!(r.status, 200, "{body}: {:?}", r.body);
        let got = script.requests.lock().unwrap().pop().unwrap();
        assert!(got.ends_with(&format!("\r\n\r\n{body}")), "{got}");
    }
    let ct = "multipart/form-data; boundary=x";
    let r = form_post(&p.url("/v1/audio/transcriptions"), ct, form.into()).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert!(
        script
            .requests
            .lock()
            .unwrap()
            .pop()
            .unwrap()
            .ends_with(form)
    );

    // Not an object: no model can be meant.
    let r = post(&p.url("/v1/chat/completions"), "[1,2]").await;
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "missing_model");

    c.set(model("n", ModelState::Awake, &[&url]));
    wait_until("the second model listed", || async {
        get(&p.url("/v1/models")).await.json()["data"]
            .as_array()
            .is_some_and(|d| d.len() == 2)
    })
    .await;
    for (path, ct, body) in [
        ("/v1/chat/completions", "application/json", json[0]),
        ("/v1/completions", "application/json", json[2]),
        ("/v1/audio/transcriptions", ct, form),
    ] {
        let r = form_post(&p.url(path), ct, body.into()).await;
        assert_eq!(r.status, 400, "{body}: {:?}", r.body);
        assert_eq!(r.json()["error"]["code"], "missing_model");
        let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains("`m`") && msg.contains("`n`"), "{msg}");
    }
    assert_eq!(
        script.requests.lock().unwrap().len(),
        0,
        "nothing forwarded"
    );
}

/// An engine's answer keeps the engine's CORS headers, an empty one too
/// (the proxy adds its own only to what it answers itself).
#[tokio::test]
async fn an_engine_answer_to_a_page_gets_no_cors_headers_from_the_proxy() {
    let (url, _script) = engine(vec![
        ("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false),
        ("HTTP/1.1 204 No Content\r\n\r\n", false),
    ])
    .await;
    let (_c, p) = proxy_to(&url).await;
    for _ in 0..2 {
        let r = post_with(
            &p.url("/v1/chat/completions"),
            &[("origin", "https://app.example")],
            &chat("m"),
        )
        .await;
        assert!(r.status.is_success(), "{:?}", r.body);
        assert!(
            r.headers.get("access-control-allow-origin").is_none(),
            "{:?}",
            r.headers
        );
    }
}
