//! What the proxy answers itself: 404, 400, 413, 401, /v1/models, health.

use bytes::Bytes;
use http::Method;
use siesta_proto::v1::ModelState;

use crate::control::{ScriptedControl, model};
use crate::engine::Engine;
use crate::support::*;

#[tokio::test]
async fn readyz_waits_for_the_first_snapshot() {
    // No control plane listening yet: not ready, but alive.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}");
    let p = start_proxy(vec![url.clone()], |_| {}).await;
    assert_eq!(get(&p.url("/readyz")).await.status, 503);
    assert_eq!(get(&p.url("/healthz")).await.status, 200);
    assert_eq!(get(&p.admin_url("/readyz")).await.status, 503);
    let _c = ScriptedControl::start_on(url.trim_start_matches("http://").parse().unwrap(), vec![]);
    wait_until("ready", || async {
        get(&p.url("/readyz")).await.status == 200
    })
    .await;
}

#[tokio::test]
async fn errors_are_openai_shaped_and_admin_paths_unreachable() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| cfg.max_body_bytes = 1024).await;

    let r = post(&p.url("/v1/chat/completions"), &chat("nope")).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("nope")
    );

    let r = post(&p.url("/v1/chat/completions"), "{\"model\": \"m\",").await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    // Not an object (one naming no model goes to the one model served).
    let r = post(&p.url("/v1/chat/completions"), "[{\"model\": \"m\"}]").await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "missing_model");
    let r = post(&p.url("/v1/chat/completions"), "{\"model\": 7}").await;
    assert_eq!(r.status, 400);

    let big = format!("{{\"model\":\"m\",\"pad\":\"{}\"}}", "x".repeat(2048));
    let r = post(&p.url("/v1/chat/completions"), &big).await;
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["code"], "request_too_large");

    for path in [
        "/sleep?level=1",
        "/wake_up",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/is_sleeping",
        "/metrics",
        "/health",
    ] {
        let r = post(&p.url(path), &chat("m")).await;
        assert_eq!(r.status, 404, "POST {path}");
        let r = get(&p.url(path)).await;
        assert_eq!(r.status, 404, "GET {path}");
    }
    let r = get(&p.url("/v1/chat/completions")).await;
    assert_eq!(r.status, 405);
    assert_eq!(
        e.count(),
        0,
        "nothing reached the engine: {:?}",
        e.received()
    );

    let m = p.metrics().await;
    assert!(
        m.contains("siesta_proxy_requests_total{model=\"\",status=\"404\"}"),
        "{m}"
    );
}

#[tokio::test]
async fn models_list_has_aliases_and_state() {
    let mut m1 = model("m1", ModelState::Awake, &["http://127.0.0.1:1"]);
    m1.aliases = vec!["alias-1".into()];
    let c = ScriptedControl::start(vec![m1, model("m2", ModelState::Asleep, &[])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let r = get(&p.url("/v1/models")).await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "list");
    let ids: Vec<(&str, &str)> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["id"].as_str().unwrap(),
                d["siesta_state"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ids,
        [("m1", "awake"), ("alias-1", "awake"), ("m2", "asleep")]
    );
    let r = get(&p.url("/v1/models/alias-1")).await;
    assert_eq!(r.json()["siesta_alias_of"], "m1");
    assert_eq!(get(&p.url("/v1/models/zzz")).await.status, 404);
}

/// A browser's CORS preflight (`OPTIONS` with `Access-Control-Request-Method`)
/// is answered as vLLM's server answers it by default (any origin, any
/// method, the headers asked for; no API key, which a preflight never
/// carries), and what the proxy answers itself to a request with an
/// `Origin` may be read by the page. Before, the preflight got 404 and the
/// browser never sent the request.
#[tokio::test]
async fn browser_cors_preflights_are_answered_as_vllm_answers_them() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| cfg.api_keys = vec!["k".into()]).await;
    let origin = ("origin", "https://app.example");
    for path in ["/v1/chat/completions", "/v1/models"] {
        let r = reply(
            send(
                Method::OPTIONS,
                &p.url(path),
                &[
                    origin,
                    ("access-control-request-method", "POST"),
                    (
                        "access-control-request-headers",
                        "authorization,content-type",
                    ),
                ],
                Bytes::new(),
            )
            .await,
        )
        .await;
        assert_eq!(r.status, 200, "{path}: {:?}", r.body);
        assert_eq!(r.headers["access-control-allow-origin"], "*", "{path}");
        assert_eq!(
            r.headers["access-control-allow-headers"], "authorization,content-type",
            "{path}"
        );
        let methods = r.headers["access-control-allow-methods"].to_str().unwrap();
        assert!(
            methods.contains("POST") && methods.contains("GET"),
            "{methods}"
        );
        assert_eq!(r.headers["access-control-max-age"], "600", "{path}");
    }
    // Not a preflight: a method the path does not take, as vLLM's router
    // answers it.
    let r = reply(
        send(
            Method::OPTIONS,
            &p.url("/v1/chat/completions"),
            &[origin],
            Bytes::new(),
        )
        .await,
    )
    .await;
    assert_eq!(r.status, 405);
    assert_eq!(r.headers["allow"], "POST");
    // The proxy's own answers to a page: readable by it.
    let key = ("authorization", "Bearer k");
    let r = reply(
        send(
            Method::GET,
            &p.url("/v1/models"),
            &[origin, key],
            Bytes::new(),
        )
        .await,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["access-control-allow-origin"], "*");
    let r = post_with(
        &p.url("/v1/chat/completions"),
        &[origin, key],
        &chat("nope"),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.headers["access-control-allow-origin"], "*");
    let r = post_with(&p.url("/v1/chat/completions"), &[origin], &chat("m")).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.headers["access-control-allow-origin"], "*");
    // An engine's answer carries the engine's own CORS headers, untouched.
    let r = post_with(&p.url("/v1/chat/completions"), &[origin, key], &chat("m")).await;
    assert_eq!(r.status, 200);
    assert!(r.headers.get("access-control-allow-origin").is_none());
    // Without an Origin (not a page): nothing added.
    let r = post_with(&p.url("/v1/chat/completions"), &[key], &chat("nope")).await;
    assert!(r.headers.get("access-control-allow-origin").is_none());
    assert_eq!(e.count(), 1, "{:?}", e.received());
}

#[tokio::test]
async fn api_keys_are_required_when_configured() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.api_keys = vec!["k1".into(), "k2".into()]
    })
    .await;
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = post_with(
        &p.url("/v1/chat/completions"),
        &[("authorization", "Bearer k3")],
        &chat("m"),
    )
    .await;
    assert_eq!(r.status, 401);
    assert_eq!(get(&p.url("/v1/models")).await.status, 401);
    let r = post_with(
        &p.url("/v1/chat/completions"),
        &[("authorization", "Bearer k2")],
        &chat("m"),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(get(&p.url("/healthz")).await.status, 200);
}

#[tokio::test]
async fn metrics_follow_prometheus_conventions() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    assert_eq!(
        post(&p.url("/v1/chat/completions"), &chat("m"))
            .await
            .status,
        200
    );
    let m = p.metrics().await;
    for name in [
        "siesta_proxy_requests_total{model=\"m\",status=\"200\"} 1",
        "siesta_proxy_upstream_duration_seconds_count{model=\"m\"} 1",
        "siesta_proxy_upstream_ttfb_seconds_count{model=\"m\"} 1",
    ] {
        assert!(m.contains(name), "{name} missing from:\n{m}");
    }
    assert_eq!(
        get(&p.url("/metrics")).await.status,
        404,
        "metrics only on the admin listener"
    );
}

/// An answer given before the request's body was read (too large by its
/// length, no API key) ends the connection: the unread body would be read
/// as the next request. The answer says so with `Connection: close`, as
/// nginx's does, so a keep-alive client does not send its next request
/// into a closing connection (and see it reset).
#[tokio::test]
async fn an_answer_before_the_body_is_read_says_the_connection_closes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |cfg| {
        cfg.max_body_bytes = 1024;
        cfg.api_keys = vec!["k".into()];
    })
    .await;
    for (target, auth, status) in [
        (
            "POST /v1/chat/completions",
            "authorization: Bearer k\r\n",
            "413",
        ),
        ("POST /v1/chat/completions", "", "401"),
        ("POST /nowhere", "authorization: Bearer k\r\n", "404"),
    ] {
        let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
        let head = format!(
            "{target} HTTP/1.1\r\nhost: x\r\n{auth}\
             content-type: application/json\r\ncontent-length: 100000\r\n\r\n{{\"model\":"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(DEADLINE, s.read_to_end(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("{status}: the connection stayed open"))
            .unwrap();
        let answer = String::from_utf8_lossy(&answer).to_lowercase();
        assert!(
            answer.starts_with(&format!("http/1.1 {status}")),
            "{answer}"
        );
        let head = answer.split("\r\n\r\n").next().unwrap();
        assert!(
            head.lines().any(|l| l == "connection: close"),
            "{status} without connection: close:\n{head}"
        );
    }
    assert_eq!(e.count(), 0);
}

/// `HEAD` is answered as `GET` without the body (load balancers probe with
/// it), and a path served here asked with a method it does not take (a
/// plain `OPTIONS` too) is a 405 naming the methods it takes, as vLLM's
/// router answers it (it was a 404 "no route", as for a path that does not
/// exist).
#[tokio::test]
async fn methods_a_path_does_not_take_are_405_and_head_is_get() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let head = reply(send(Method::HEAD, &p.url("/v1/models"), &[], Bytes::new()).await).await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty(), "{:?}", head.body);
    assert_eq!(head.headers["content-type"], "application/json");
    let ready = reply(send(Method::HEAD, &p.url("/readyz"), &[], Bytes::new()).await).await;
    assert_eq!(ready.status, 200);
    let options = reply(send(Method::OPTIONS, &p.url("/v1/models"), &[], Bytes::new()).await).await;
    assert_eq!(options.status, 405);
    assert_eq!(options.headers["allow"], "GET, HEAD");
    let get_chat = get(&p.url("/v1/chat/completions")).await;
    assert_eq!(get_chat.status, 405);
    assert_eq!(get_chat.headers["allow"], "POST");
    assert_eq!(get_chat.json()["error"]["code"], "method_not_allowed");
    let delete = reply(send(Method::DELETE, &p.url("/v1/models"), &[], Bytes::new()).await).await;
    assert_eq!(delete.status, 405);
    assert_eq!(delete.headers["allow"], "GET, HEAD");
    assert_eq!(get(&p.url("/nowhere")).await.status, 404);
    assert_eq!(e.count(), 0, "nothing reached the engine");
}

/// The admin listener answers `HEAD` as `GET` without the body (same
/// status and headers, `Content-Length` included: load balancers probe
/// `/healthz` and `/readyz` with it), and a method its paths do not take
/// is a 405 with `Allow`, as on the main listener. Before, both were 404
/// `no route for HEAD ...`: a HEAD probe saw a healthy proxy as missing.
#[tokio::test]
async fn the_admin_listener_answers_head_as_get_and_other_methods_405() {
    // No control plane: /readyz is 503 until one answers.
    let unready = start_proxy(vec!["http://127.0.0.1:1".into()], |_| {}).await;
    let c = ScriptedControl::start(vec![]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let admin = |p: &TestProxy, path: &str, method: Method| {
        let url = p.admin_url(path);
        async move { reply(send(method, &url, &[], Bytes::new()).await).await }
    };
    for (p, path, status) in [
        (&p, "/healthz", 200),
        (&p, "/readyz", 200),
        (&unready, "/readyz", 503),
        (&p, "/metrics", 200),
    ] {
        let get = admin(p, path, Method::GET).await;
        let head = admin(p, path, Method::HEAD).await;
        assert_eq!(
            (get.status.as_u16(), head.status.as_u16()),
            (status, status),
            "{path}"
        );
        assert!(head.body.is_empty(), "{path}: {:?}", head.body);
        assert_eq!(head.headers["content-type"], get.headers["content-type"]);
        let length = head.headers["content-length"].to_str().unwrap();
        if path == "/metrics" {
            // The metrics may move between the two requests.
            assert!(length.parse::<usize>().unwrap() > 100, "{length}");
        } else {
            assert_eq!(length, get.body.len().to_string(), "{path}");
        }
        for method in [Method::POST, Method::DELETE] {
            let r = admin(p, path, method.clone()).await;
            assert_eq!(r.status, 405, "{method} {path}");
            assert_eq!(r.headers["allow"], "GET, HEAD", "{method} {path}");
            assert_eq!(r.json()["error"]["code"], "method_not_allowed");
        }
    }
    assert_eq!(admin(&p, "/nowhere", Method::HEAD).await.status, 404);
    let r = admin(&p, "/v1/models", Method::GET).await;
    assert_eq!(r.status, 404);
    // It says where model requests go (it named routes that 404 here).
    let said = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(said.contains("the main listener (--listen)"), "{said}");
}
