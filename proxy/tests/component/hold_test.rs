//! Holding requests for models that are not awake, and shedding.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use http_body_util::BodyExt;
use siesta_proto::v1::{Calibration, HoldPolicy, ModelState};

use crate::control::{ScriptedControl, model, now_ms};
use crate::engine::Engine;
use crate::support::*;

fn held(m: &str, max_queue: u32, max_hold_ms: u64) -> siesta_proto::v1::ModelStatus {
    let mut s = model(m, ModelState::Asleep, &[]);
    s.hold = Some(HoldPolicy {
        max_queue,
        max_hold_ms,
    });
    s
}

async fn held_now(p: &TestProxy, m: &str) -> f64 {
    metric(
        &p.metrics().await,
        &format!("siesta_proxy_held_requests{{model=\"{m}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn held_during_wake_then_answered_with_one_demand() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![held("m", 8, 20_000)]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let mut tasks = Vec::new();
    for i in 0..3 {
        let url = p.url("/v1/chat/completions");
        let body = if i == 0 { chat_stream("m") } else { chat("m") };
        tasks.push(tokio::spawn(async move { post(&url, &body).await }));
    }
    wait_until("3 held", || async { held_now(&p, "m").await == 3.0 }).await;
    wait_until("demand", || async { !c.demands().is_empty() }).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(c.demands().len(), 1, "one Demand per wait episode");
    assert_eq!(c.demands()[0].model, "m");
    assert!(c.demands()[0].proxy_id.starts_with("proxy@"));
    assert_eq!(e.count(), 0);
    c.set(model("m", ModelState::Waking, &[&e.url]));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(e.count(), 0, "nothing forwarded before awake");
    c.set(model("m", ModelState::Awake, &[&e.url]));
    let mut bodies = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        bodies.push(String::from_utf8(r.body.to_vec()).unwrap());
    }
    assert!(bodies[0].contains("[DONE]"), "streamed: {}", bodies[0]);
    assert!(bodies[1].contains("chat.completion"));
    assert_eq!(held_now(&p, "m").await, 0.0);
    let m = p.metrics().await;
    assert!(
        m.contains("siesta_proxy_hold_wait_seconds_count{model=\"m\"} 3"),
        "{m}"
    );
    // A new episode gets a new Demand.
    c.set(held("m", 8, 20_000));
    wait_state(&p, "m", "asleep").await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("second demand", || async { c.demands().len() == 2 }).await;
    c.set(model("m", ModelState::Awake, &[&e.url]));
    assert_eq!(t.await.unwrap().status, 200);
}

#[tokio::test]
async fn queue_overflow_sheds_with_retry_after_growing_with_depth() {
    let mut small = held("small", 1, 20_000);
    let mut deep = held("deep", 6, 20_000);
    for s in [&mut small, &mut deep] {
        s.calibration = Some(Calibration {
            wake_l1_ms: 2_000,
            wake_l1_samples: 3,
            ..Default::default()
        });
    }
    let c = ScriptedControl::start(vec![small, deep]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let mut tasks = Vec::new();
    for (m, n) in [("small", 1), ("deep", 6)] {
        for _ in 0..n {
            let url = p.url("/v1/chat/completions");
            tasks.push(tokio::spawn(async move { post(&url, &chat(m)).await }));
        }
    }
    wait_until("queues full", || async {
        held_now(&p, "small").await == 1.0 && held_now(&p, "deep").await == 6.0
    })
    .await;
    let r1 = post(&p.url("/v1/chat/completions"), &chat("small")).await;
    assert_eq!(r1.status, 503);
    assert_eq!(r1.json()["error"]["code"], "queue_full");
    let r6 = post(&p.url("/v1/chat/completions"), &chat("deep")).await;
    assert_eq!(r6.status, 503);
    let (a, b) = (r1.retry_after().unwrap(), r6.retry_after().unwrap());
    assert!(
        a >= 2 && b > a,
        "Retry-After {a} (depth 1) vs {b} (depth 6)"
    );
    assert!(
        p.metrics()
            .await
            .contains("siesta_proxy_shed_total{model=\"deep\",reason=\"queue_full\"} 1")
    );
    for t in tasks {
        t.abort();
    }
}

/// Past its `max_hold`, a 503 `hold_timeout` that says what the model
/// waits for, as its control plane says (it said nothing of why).
#[tokio::test]
async fn held_past_max_hold_gets_503() {
    let mut m = held("m", 8, 300);
    m.waiting_for = "room on GPU 0: held by a (pinned)".into();
    let c = ScriptedControl::start(vec![m]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let t0 = Instant::now();
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "hold_timeout");
    assert!(r.retry_after().unwrap() >= 1);
    let said = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert_eq!(
        said,
        "model `m` did not become ready within 300 ms; it waits for room on GPU 0: held by a (pinned)"
    );
}

/// A request held on a fresh connection waits in the waiting room; past
/// its hold it is a `hold_timeout`, as on a reused connection: not
/// admitted again at its deadline (it was shed as `wait_too_long`, "needs
/// about 100 ms, longer than its hold limit", for a calibrated model, and
/// sent a second demand for an uncalibrated one).
#[tokio::test]
async fn a_first_request_held_past_max_hold_is_a_hold_timeout() {
    for calibrated in [true, false] {
        let mut m = held("m", 8, 300);
        if calibrated {
            m.calibration = Some(Calibration {
                wake_l1_ms: 100,
                wake_l1_samples: 1,
                ..Default::default()
            });
        }
        let c = ScriptedControl::start(vec![m]);
        let p = ready_proxy(vec![c.url()], |_| {}).await;
        let body = chat("m");
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        let t0 = Instant::now();
        let line = raw(p.addr, req.as_bytes()).await;
        assert!(t0.elapsed() >= Duration::from_millis(300));
        assert!(line.contains(" 503 "), "{line}");
        let m = p.metrics().await;
        let shed = |code: &str| {
            metric(
                &m,
                &format!("siesta_proxy_shed_total{{model=\"m\",reason=\"{code}\"}}"),
            )
            .unwrap_or(0.0)
        };
        assert_eq!(
            (shed("hold_timeout"), shed("wait_too_long")),
            (1.0, 0.0),
            "calibrated: {calibrated}\n{m}"
        );
        assert_eq!(c.demands().len(), 1, "calibrated: {calibrated}");
    }
}

/// A first request that is not valid HTTP (a signed `Content-Length`, which
/// hyper refuses) is refused at once: not held for its model first (and the
/// model woken for it), to be refused only after the wake.
#[tokio::test]
async fn a_request_that_is_not_valid_http_is_refused_at_once_not_held() {
    let c = ScriptedControl::start(vec![held("m", 8, 120_000)]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let body = chat("m");
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: +{}\r\n\r\n{body}",
        body.len()
    );
    let line = raw(p.addr, req.as_bytes()).await;
    assert!(line.contains(" 400 "), "{line}");
    assert!(c.demands().is_empty(), "a refused request woke its model");
    assert_eq!(held_now(&p, "m").await, 0.0);
}

#[tokio::test]
async fn wait_longer_than_max_hold_is_shed_at_once() {
    let mut m = held("m", 8, 1_000);
    m.calibration = Some(Calibration {
        wake_l1_ms: 10_000,
        wake_l1_samples: 1,
        ..Default::default()
    });
    let c = ScriptedControl::start(vec![m]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "wait_too_long");
    assert_eq!(r.retry_after(), Some(10));
}

/// A model that failed twice in a row (it keeps failing) answers at once,
/// with the time to its next try, and is not woken for it.
#[tokio::test]
async fn failed_model_backing_off_gets_retry_after() {
    let mut m = held("m", 8, 300_000);
    m.state = ModelState::Failed as i32;
    m.retry_at_unix_ms = now_ms() + 7_500;
    m.failures = 2;
    m.last_error = "engine exited".into();
    let c = ScriptedControl::start(vec![m]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "model_failed");
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        msg.contains("failed 2 times in a row (engine exited)"),
        "{msg}"
    );
    let ra = r.retry_after().unwrap();
    assert!((7..=8).contains(&ra), "Retry-After {ra}");
    assert!(c.demands().is_empty());
}

/// An engine that crashed once is tried again after its backoff: a request
/// that comes meanwhile is held through the retry and served, where it was
/// answered 503 `model_failed` before (and its client had to come back).
#[tokio::test]
async fn a_request_to_a_model_that_failed_once_is_held_through_its_retry() {
    let e = Engine::start("e").await;
    let mut m = held("m", 8, 60_000);
    m.state = ModelState::Failed as i32;
    m.failures = 1;
    m.retry_at_unix_ms = now_ms() + 2_000;
    m.last_error = "engine exited (signal 9)".into();
    m.calibration = Some(Calibration {
        start_ms: 1_000,
        start_samples: 1,
        ..Default::default()
    });
    let c = ScriptedControl::start(vec![m]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("held", || async { held_now(&p, "m").await == 1.0 }).await;
    wait_until("demand", || async { !c.demands().is_empty() }).await;
    c.set(model("m", ModelState::Starting, &[]));
    c.set(model("m", ModelState::Awake, &[&e.url]));
    let r = t.await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(e.count(), 1);
    assert_eq!(held_now(&p, "m").await, 0.0);
}

#[tokio::test]
async fn disconnect_while_held_frees_the_slot() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![held("m", 1, 20_000)]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let url = p.url("/v1/chat/completions");
    let first = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("held", || async { held_now(&p, "m").await == 1.0 }).await;
    first.abort();
    wait_until("slot freed", || async { held_now(&p, "m").await == 0.0 }).await;
    // Its wait counts, as one that hung up on a reused connection does
    // (the waiting room's were missing: the waits clients gave up on).
    let waits = |m: String| metric(&m, "siesta_proxy_hold_wait_seconds_count{model=\"m\"}");
    assert_eq!(waits(p.metrics().await), Some(1.0));
    let url = p.url("/v1/chat/completions");
    let second = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("second held", || async { held_now(&p, "m").await == 1.0 }).await;
    c.set(model("m", ModelState::Awake, &[&e.url]));
    assert_eq!(second.await.unwrap().status, 200);
    assert_eq!(
        e.count(),
        1,
        "the abandoned request never reached the engine"
    );
}

#[tokio::test]
async fn refused_demand_sheds_held_requests() {
    let c = ScriptedControl::start(vec![model("m", ModelState::Stopped, &[])]);
    c.state.lock().unwrap().refuse_demands = Some("stopped by an operator".into());
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 503);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("stopped by an operator")
    );
}

#[tokio::test]
async fn model_removed_while_held_is_404() {
    let c = ScriptedControl::start(vec![held("m", 8, 20_000), held("other", 8, 20_000)]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("held", || async { held_now(&p, "m").await == 1.0 }).await;
    {
        let mut s = c.state.lock().unwrap();
        s.revision += 1;
        let ev = siesta_proto::v1::WatchEvent {
            revision: s.revision,
            kind: Some(siesta_proto::v1::watch_event::Kind::ModelRemoved(
                "m".into(),
            )),
            ..Default::default()
        };
        s.models.remove("m");
        s.watchers.retain(|w| w.try_send(Ok(ev.clone())).is_ok());
    }
    let r = t.await.unwrap();
    assert_eq!(r.status, 404);
}

#[tokio::test]
async fn held_streaming_request_streams_after_wake() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![held("m", 8, 20_000)]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    e.set_gate(false);
    let url = p.url("/v1/chat/completions");
    let t =
        tokio::spawn(
            async move { send(Method::POST, &url, &[], Bytes::from(chat_stream("m"))).await },
        );
    wait_until("held", || async { held_now(&p, "m").await == 1.0 }).await;
    c.set(model("m", ModelState::Awake, &[&e.url]));
    let resp = t.await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(std::str::from_utf8(&first).unwrap().contains("tok1"));
    e.set_gate(true);
    let rest = body.collect().await.unwrap().to_bytes();
    assert!(std::str::from_utf8(&rest).unwrap().contains("[DONE]"));
}

#[tokio::test]
async fn held_requests_are_shed_not_cut_when_the_drain_ends() {
    // Nobody wakes the model; the hold limit is far away.
    let c = ScriptedControl::start(vec![held("m", 8, 600_000)]);
    let mut p = ready_proxy(vec![c.url()], |cfg| {
        cfg.drain_timeout = Duration::from_secs(2);
    })
    .await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("held", || async { held_now(&p, "m").await == 1.0 }).await;
    p.shutdown.cancel();
    let r = tokio::time::timeout(DEADLINE, t)
        .await
        .expect("answered before the deadline")
        .unwrap();
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["code"], "proxy_shutting_down");
    assert_eq!(r.retry_after(), Some(1));
    let stopped = tokio::time::timeout(DEADLINE, &mut p.task).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
}

/// A wake that comes while the proxy drains releases what it holds: the
/// drain is for answering, and a replica replaced in a rolling restart
/// still has its Watch.
#[tokio::test]
async fn a_wake_during_the_drain_releases_held_requests() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![held("m", 8, 600_000)]);
    let mut p = ready_proxy(vec![c.url()], |cfg| {
        cfg.drain_timeout = Duration::from_secs(20);
    })
    .await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("held", || async { held_now(&p, "m").await == 1.0 }).await;
    p.shutdown.cancel();
    c.set(model("m", ModelState::Awake, &[&e.url]));
    let r = tokio::time::timeout(Duration::from_secs(10), t)
        .await
        .expect("released by the wake, long before the drain ends")
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let stopped = tokio::time::timeout(DEADLINE, &mut p.task).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
}

/// The last activity report of a proxy that stops says nothing is held
/// or in flight any more. It was dropped (the Watch tasks, stopped first,
/// took the control plane's client with them): control kept the old
/// counts for 30 s, so a model looked busy (no eviction for others) and
/// wanted (woken for requests no one held) after every rolling restart.
#[tokio::test]
async fn the_last_report_of_a_stopping_proxy_clears_what_it_held() {
    let c = ScriptedControl::start(vec![held("m", 8, 600_000)]);
    let mut p = ready_proxy(vec![c.url()], |cfg| {
        cfg.drain_timeout = Duration::from_secs(1);
    })
    .await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    let reported_held = |c: &ScriptedControl| {
        c.reports()
            .iter()
            .flat_map(|r| r.models.iter())
            .rfind(|m| m.model == "m")
            .map(|m| (m.held, m.in_flight))
    };
    wait_until("held reported", || async {
        reported_held(&c) == Some((1, 0))
    })
    .await;
    p.shutdown.cancel();
    assert_eq!(t.await.unwrap().status, 503);
    let stopped = tokio::time::timeout(DEADLINE, &mut p.task).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
    assert_eq!(reported_held(&c), Some((0, 0)), "{:#?}", c.reports());
}

/// `m` asleep at `level` on a control plane, held up to a minute.
fn asleep_at(level: u32) -> siesta_proto::v1::ModelStatus {
    let mut m = held("m", 8, 60_000);
    m.sleep_level = level;
    m
}

/// Two control planes have `m` asleep; the Demand goes to the best placed
/// (level 1). When that one fails to wake it, the held requests' Demand
/// goes to the other at once, which serves them. Before, a wait episode
/// asked one control plane once, and under steady traffic never another.
#[tokio::test]
async fn a_held_wait_asks_another_control_plane_when_the_one_asked_fails() {
    let e = Engine::start("b").await;
    let a = ScriptedControl::start(vec![asleep_at(1)]);
    let b = ScriptedControl::start(vec![asleep_at(2)]);
    let p = ready_proxy(vec![a.url(), b.url()], |_| {}).await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("demand at a", || async { a.demands().len() == 1 }).await;
    assert!(b.demands().is_empty(), "b is not the best placed yet");
    let mut failed = asleep_at(1);
    failed.state = ModelState::Failed as i32;
    failed.failures = 3;
    failed.retry_at_unix_ms = now_ms() + 60_000;
    a.set(failed);
    wait_until("demand at b", || async { !b.demands().is_empty() }).await;
    b.set(model("m", ModelState::Awake, &[&e.url]));
    let r = t.await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// The same when the control plane asked dies with the model asleep in
/// its last view (its state frozen there, still the best placed): the
/// Demand sent again finds it gone and goes to the other.
#[tokio::test]
async fn a_held_wait_asks_another_control_plane_when_the_one_asked_dies() {
    let e = Engine::start("b").await;
    let mut a = ScriptedControl::start(vec![asleep_at(1)]);
    let b = ScriptedControl::start(vec![asleep_at(2)]);
    let p = ready_proxy(vec![a.url(), b.url()], |_| {}).await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("demand at a", || async { a.demands().len() == 1 }).await;
    a.kill();
    wait_until("demand at b", || async { !b.demands().is_empty() }).await;
    b.set(model("m", ModelState::Awake, &[&e.url]));
    let r = t.await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}
