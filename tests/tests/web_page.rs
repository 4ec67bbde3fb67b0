//! The web status page in real headless Chromium against a running control
//! plane with fake-vllm engines and a proxy: it lists every model, follows a
//! wake through the proxy within a second of each event, its buttons send
//! the operations, and without the token a non-loopback listener refuses it.

use siesta_tests::ctl as util;
use siesta_tests::web as stack;

use siesta_proto::v1 as pb;
use siesta_tests::Browser;
use std::time::Duration;
use util::{LONG, fake_model, state, wait_state, wait_status};

/// Events reach the page within this long (the bound).
const LIVE_WITHIN_MS: i64 = 1000;

/// The `window.siesta.seen` entries of `model`: (state, event_at, seen_at).
async fn seen(b: &mut Browser, model: &str) -> Vec<(String, i64, i64)> {
    let v = b
        .eval(&format!(
            "window.siesta.seen.filter(s => s.model === {model:?}).map(s => [s.state, s.event_at, s.seen_at])"
        ))
        .await;
    v.as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e[0].as_str().unwrap_or_default().to_string(),
                e[1].as_i64().unwrap_or_default(),
                e[2].as_i64().unwrap_or_default(),
            )
        })
        .collect()
}

async fn click(b: &mut Browser, model: &str, op: &str) {
    let clicked = b
        .eval(&format!(
            "(() => {{ const e = document.querySelector('button[data-model={model:?}][data-op={op:?}]'); if (!e) return false; e.click(); return true; }})()"
        ))
        .await;
    assert_eq!(clicked, true, "no {op} button for {model}");
}

fn row_state(model: &str) -> String {
    format!("(document.getElementById('model-{model}') || {{}}).dataset?.state")
}

#[tokio::test]
async fn the_page_follows_a_wake_and_its_buttons_send_the_operations() {
    // A wake long enough for the held request to be reported and shown.
    let models = fake_model("alpha", "asleep", &["--wake-time", "1500ms"], "")
        // On a GPU, so that the inventory's source is looked for (NVML).
        + &util::fake_model_on("beta", "none", 1, &[], "");
    let s = stack::stack(&models).await;
    let mut c = s.ctl.client().await;
    wait_state(&mut c, "alpha", pb::ModelState::Asleep, LONG).await;
    let Some(mut b) = Browser::launch(&format!("{}/", s.web)).await else {
        return;
    };
    b.wait_js(
        "every model listed and the stream live",
        LONG,
        "!!document.getElementById('model-alpha') && !!document.getElementById('model-beta') && document.getElementById('conn').dataset.conn === 'live'",
    )
    .await;
    assert_eq!(b.eval(&row_state("alpha")).await, "asleep");
    assert_eq!(b.eval(&row_state("beta")).await, "stopped");
    // Why the GPUs are shown as they are (without NVML: "NVML not
    // available", no GPUs known) is on the page as ListGpus says it.
    let gpus = c
        .list_gpus(pb::ListGpusRequest::default())
        .await
        .expect("ListGpus")
        .into_inner();
    assert!(gpus.source == "nvml" || !gpus.note.is_empty(), "{gpus:?}");
    let shown = b
        .eval("(document.getElementById('gpu-note') || {}).textContent || ''")
        .await;
    assert_eq!(
        shown.as_str(),
        Some(gpus.note.as_str()),
        "the page's GPU note"
    );

    // A request through the proxy wakes alpha; the page follows each event.
    s.ask("alpha").await;
    b.wait_js(
        "alpha awake on the page",
        LONG,
        &format!("{} === 'awake'", row_state("alpha")),
    )
    .await;
    let alpha = seen(&mut b, "alpha").await;
    let states: Vec<&str> = alpha.iter().map(|(s, ..)| s.as_str()).collect();
    let waking = states.iter().position(|s| *s == "waking");
    let awake = states.iter().rposition(|s| *s == "awake");
    assert!(
        matches!((waking, awake), (Some(w), Some(a)) if w < a),
        "the page saw no waking then awake: {states:?}"
    );
    eprintln!(
        "page latency (ms after the event) per alpha state: {:?}",
        alpha
            .iter()
            .map(|(st, e, s)| (st.as_str(), s - e))
            .collect::<Vec<_>>()
    );
    for (st, event_at, seen_at) in &alpha {
        assert!(
            seen_at - event_at < LIVE_WITHIN_MS,
            "alpha {st}: on the page {} ms after the event",
            seen_at - event_at
        );
    }
    // The request was held while alpha woke: the row's held cell said so.
    let held = b
        .eval("window.siesta.seen.filter(s => s.model === 'alpha' && s.state === 'waking').map(s => s.held_shown)")
        .await;
    assert!(
        held.as_array()
            .is_some_and(|v| v.iter().any(|h| h.as_str() == Some("1"))),
        "the page never showed alpha's held request: {held}"
    );
    let shot = b.screenshot().await;
    assert!(shot.starts_with(b"\x89PNG"), "screenshot is not a PNG");
    if let Some(path) = std::env::var_os("SIESTA_SCREENSHOT") {
        std::fs::write(&path, &shot).expect("writing SIESTA_SCREENSHOT");
    }

    // The table is redrawn every second; its buttons stay the same nodes
    // (a button replaced between press and release lost the click).
    b.eval(
        "window.__wake = document.querySelector('button[data-model=\"beta\"][data-op=\"wake\"]'); \
         window.__renders = window.siesta.renders; true",
    )
    .await;
    b.wait_js(
        "two redraws of the table",
        LONG,
        "window.siesta.renders >= window.__renders + 2",
    )
    .await;
    let same = b
        .eval("window.__wake !== null && window.__wake === document.querySelector('button[data-model=\"beta\"][data-op=\"wake\"]')")
        .await;
    assert_eq!(same, true, "beta's wake button was replaced by a redraw");

    // Buttons send the operations.
    click(&mut b, "alpha", "sleep2").await;
    let m = wait_status(&mut c, "alpha", "asleep L2", LONG, |m| {
        state(m) == pb::ModelState::Asleep && m.sleep_level == 2
    })
    .await;
    assert_eq!(
        m.intent.map(|i| i.reason),
        Some(pb::IntentReason::Operator as i32),
        "sleep L2 came from the page"
    );
    b.wait_js(
        "alpha asleep on the page",
        LONG,
        &format!("{} === 'asleep'", row_state("alpha")),
    )
    .await;
    click(&mut b, "alpha", "wake").await;
    wait_state(&mut c, "alpha", pb::ModelState::Awake, LONG).await;
    click(&mut b, "beta", "pin").await;
    let m = wait_status(&mut c, "beta", "pinned", LONG, |m| {
        m.intent.as_ref().map(|i| i.reason) == Some(pb::IntentReason::Pin as i32)
    })
    .await;
    assert_ne!(m.pinned_until_unix_ms, 0, "beta pinned");
    b.wait_js(
        "the pin's answer shown",
        LONG,
        "document.getElementById('op-result').dataset.ok === 'true'",
    )
    .await;
    // A refused operation is shown, not swallowed.
    click(&mut b, "beta", "sleep1").await;
    b.wait_js(
        "the page shows every answer",
        Duration::from_secs(30),
        "document.getElementById('op-result').textContent.startsWith('sleep beta')",
    )
    .await;
}

#[tokio::test]
async fn a_non_loopback_listener_refuses_a_page_without_the_token() {
    let s = stack::stack_with(
        &fake_model("gamma", "none", &[], ""),
        "web_listen = \"0.0.0.0:0\"\ntoken = \"t0ken\"",
        &["--token", "t0ken"],
    )
    .await;
    let http = reqwest::Client::new();
    for path in ["/", "/events", "/metrics", "/api/models"] {
        let r = http.get(format!("{}{path}", s.web)).send().await.unwrap();
        assert_eq!(r.status(), 401, "GET {path} without the token");
        let r = http
            .get(format!("{}{path}?token=wrong", s.web))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "GET {path} with a wrong token");
    }
    let r = http
        .post(format!("{}/api/models/gamma/wake", s.web))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "POST wake without the token");
    let r = http
        .get(format!("{}/api/models", s.web))
        .bearer_auth("t0ken")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "GET /api/models with the token");
    // A call that exists, by another method: 405 naming the one it takes
    // (a GET of an operation read as "no such API call", 404).
    for (get, path, allow) in [
        (true, "/api/models/gamma/wake", "POST"),
        (false, "/api/models", "GET"),
        (false, "/api/history", "GET"),
    ] {
        let url = format!("{}{path}", s.web);
        let req = if get { http.get(url) } else { http.post(url) };
        let r = req.bearer_auth("t0ken").send().await.unwrap();
        assert_eq!(r.status(), 405, "{path}");
        assert_eq!(r.headers()["allow"], allow, "{path}");
    }
    let r = http
        .get(format!("{}/api/nothing", s.web))
        .bearer_auth("t0ken")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    let Some(mut b) = Browser::launch(&format!("{}/", s.web)).await else {
        return;
    };
    b.wait_js(
        "the refusal",
        LONG,
        "document.body && document.body.innerText.includes('missing or wrong token')",
    )
    .await;
    assert_eq!(b.eval("!!document.getElementById('models')").await, false);
    b.navigate(&format!("{}/?token=t0ken", s.web)).await;
    b.wait_js(
        "gamma listed with the token",
        LONG,
        "!!document.getElementById('model-gamma') && document.getElementById('conn').dataset.conn === 'live'",
    )
    .await;
    click(&mut b, "gamma", "wake").await;
    let models = format!("{}/api/models", s.web);
    siesta_tests::wait_until("gamma woken by the page's button", LONG, || async {
        let v: serde_json::Value = http
            .get(&models)
            .bearer_auth("t0ken")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["models"][0]["state"] == "awake"
    })
    .await;
}
