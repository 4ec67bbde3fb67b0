//! The route table from Watch: resync after a control plane restart, serving
//! from the last table while it is gone, several control planes, DNS names.

use std::time::Duration;

use siesta_proto::v1::ModelState;

use crate::control::{ScriptedControl, model};
use crate::engine::Engine;
use crate::support::*;

#[tokio::test]
async fn control_killed_then_restarted() {
    let e = Engine::start("e").await;
    let mut asleep = model("sleepy", ModelState::Asleep, &[]);
    asleep.hold = Some(siesta_proto::v1::HoldPolicy {
        max_queue: 4,
        max_hold_ms: 500,
    });
    let mut c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url]), asleep]);
    let p = ready_proxy(vec![c.url()], |cfg| cfg.token = Some("s3cret".into())).await;
    assert_eq!(
        c.state.lock().unwrap().bearer[0].as_deref(),
        Some("Bearer s3cret")
    );
    c.kill();
    // Awake models are still served from the last table; sleeping ones are
    // held, then shed at max_hold.
    for _ in 0..3 {
        assert_eq!(
            post(&p.url("/v1/chat/completions"), &chat("m"))
                .await
                .status,
            200
        );
    }
    let r = post(&p.url("/v1/chat/completions"), &chat("sleepy")).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "hold_timeout");
    assert_eq!(get(&p.url("/readyz")).await.status, 200);

    // Changed while the proxy could not see it; the restart is a new process.
    c.set_quietly(model("sleepy", ModelState::Awake, &[&e.url]));
    c.restart();
    wait_until("resynced", || async {
        post(&p.url("/v1/chat/completions"), &chat("sleepy"))
            .await
            .status
            == 200
    })
    .await;
    let reqs = c.state.lock().unwrap().watch_requests.clone();
    assert!(reqs.len() >= 2);
    assert_eq!(
        reqs.last().unwrap().since_revision,
        0,
        "new incarnation: fresh snapshot"
    );
    assert!(reqs[0].client_id.starts_with("proxy@"));
}

#[tokio::test]
async fn reconnect_resumes_from_last_revision() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Asleep, &[])]);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    c.set(model("m", ModelState::Awake, &[&e.url]));
    wait_until("awake", || async {
        post(&p.url("/v1/chat/completions"), &chat("m"))
            .await
            .status
            == 200
    })
    .await;
    let rev = c.state.lock().unwrap().revision;
    // End the stream (not the process): the proxy resumes where it was.
    c.state.lock().unwrap().watchers.clear();
    wait_until("rewatch", || async {
        c.state.lock().unwrap().watch_requests.len() == 2
    })
    .await;
    assert_eq!(
        c.state.lock().unwrap().watch_requests[1].since_revision,
        rev
    );
    let metrics = p.metrics().await;
    let ended = format!(
        "siesta_proxy_watch_lost_total{{control=\"{}\",reason=\"ended\"}} 1",
        c.url()
    );
    assert!(metrics.contains(&ended), "{ended} in {metrics}");
}

/// A control plane whose event path is wedged (its connection still
/// answers HTTP/2 pings, tonic's runtime is fine) but that promised a
/// heartbeat every 300 ms: after three intervals of nothing the proxy
/// calls Watch again, resuming from its revision, and keeps serving from
/// its table meanwhile. Heartbeats that keep coming keep the stream.
#[tokio::test]
async fn a_stream_silent_past_its_heartbeats_is_called_again() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    c.state.lock().unwrap().heartbeat_ms = Some(1_000);
    let p = ready_proxy(vec![c.url()], |_| {}).await;
    let first = c.state.lock().unwrap().watch_requests[0].clone();
    assert!(first.heartbeat, "the proxy asks for heartbeats");
    // Beats every 200 ms for 4 s (the proxy's patience: 3 s): one stream.
    for _ in 0..20 {
        c.beat();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(c.state.lock().unwrap().watch_requests.len(), 1);
    // Wedged from a shorter promise on: called again, resumed.
    c.state.lock().unwrap().heartbeat_ms = Some(300);
    c.beat();
    c.set(model("m", ModelState::Awake, &[&e.url]));
    let rev = c.state.lock().unwrap().revision;
    wait_until("called again", || async {
        c.state.lock().unwrap().watch_requests.len() >= 2
    })
    .await;
    let again = c.state.lock().unwrap().watch_requests[1].clone();
    assert_eq!(again.since_revision, rev, "resumed, not resynced");
    assert!(again.heartbeat);
    let lost = format!(
        "siesta_proxy_watch_lost_total{{control=\"{}\",reason=\"silent\"}} 1",
        c.url()
    );
    let metrics = p.metrics().await;
    assert!(metrics.contains(&lost), "{lost} in {metrics}");
    assert_eq!(
        post(&p.url("/v1/chat/completions"), &chat("m"))
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn union_of_control_planes() {
    let e1 = Engine::start("box1").await;
    let e2 = Engine::start("box2").await;
    let c1 = ScriptedControl::start(vec![
        model("shared", ModelState::Awake, &[&e1.url]),
        model("only1", ModelState::Awake, &[&e1.url]),
    ]);
    let c2 = ScriptedControl::start(vec![
        model("shared", ModelState::Awake, &[&e2.url]),
        model("only2", ModelState::Asleep, &[]),
    ]);
    let p = start_proxy(vec![c1.url(), c2.url()], |_| {}).await;
    wait_until("both tables", || async {
        let v = get(&p.url("/v1/models")).await.json();
        v["data"].as_array().is_some_and(|d| d.len() == 3)
    })
    .await;
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let r = post(&p.url("/v1/chat/completions"), &chat("shared")).await;
        seen.insert(r.headers["x-engine"].to_str().unwrap().to_owned());
    }
    assert_eq!(seen.len(), 2, "both boxes serve `shared`: {seen:?}");
    assert_eq!(
        post(&p.url("/v1/chat/completions"), &chat("only1"))
            .await
            .status,
        200
    );
    // Demand for a model only box 2 has goes to box 2.
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("only2")).await });
    wait_until("demand at box 2", || async { c2.demands().len() == 1 }).await;
    assert!(c1.demands().is_empty());
    c2.set(model("only2", ModelState::Awake, &[&e2.url]));
    assert_eq!(t.await.unwrap().status, 200);
}

#[tokio::test]
async fn dns_name_is_resolved_and_watched() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let url = format!("http://localhost:{}", c.addr.port());
    let p = ready_proxy(vec![url], |cfg| {
        cfg.resolve_interval = Duration::from_millis(200)
    })
    .await;
    assert_eq!(
        post(&p.url("/v1/chat/completions"), &chat("m"))
            .await
            .status,
        200
    );
    // Re-resolution does not disturb the table.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        post(&p.url("/v1/chat/completions"), &chat("m"))
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn shutdown_drains_in_flight_requests() {
    let e = Engine::start("e").await;
    let c = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&e.url])]);
    let mut p = ready_proxy(vec![c.url()], |_| {}).await;
    e.set_gate(false);
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("in flight", || async {
        e.state.in_flight.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    p.shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(100)).await;
    e.set_gate(true);
    assert_eq!(t.await.unwrap().status, 200);
    let stopped = tokio::time::timeout(DEADLINE, &mut p.task).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
}

/// A proxy started before its control plane (a replica just started, or
/// restarted, that `--reuse-port` already gives connections) knows no model
/// yet: a request waits for the first snapshot and is served, and without
/// one it gets 503 + Retry-After, never 404 "does not exist".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_the_first_snapshot_requests_wait_for_it_instead_of_404() {
    let e = Engine::start("e").await;
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    };

    // A request that reaches the proxy before its control plane is up is
    // answered once the snapshot arrives.
    let addr = free();
    let p = start_proxy(vec![format!("http://{addr}")], |_| {}).await;
    let url = p.url("/v1/chat/completions");
    let waiting = tokio::spawn(async move { post(&url, &chat("m")).await });
    wait_until("the request's connection accepted", || async {
        accepted(&p).await >= 1.0
    })
    .await;
    let _c = ScriptedControl::start_on(addr, vec![model("m", ModelState::Awake, &[&e.url])]);
    let r = waiting.await.unwrap();
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(e.count(), 1);

    // No control plane at all: after the wait, a retryable 503.
    let p = start_proxy(vec![format!("http://{}", free())], |cfg| {
        cfg.first_snapshot_wait = Duration::from_millis(500);
    })
    .await;
    let r = get(&p.url("/v1/no-such-path")).await;
    assert_eq!(
        r.status, 404,
        "a path no snapshot can make valid is answered at once"
    );
    let r = post(&p.url("/v1/chat/completions"), &chat("m")).await;
    assert_eq!(r.status, 503, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "proxy_not_ready");
    let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("--control"), "{msg}");
    assert_eq!(r.retry_after(), Some(1));
    let r = get(&p.url("/v1/models")).await;
    assert_eq!(r.status, 503, "an empty list would say no model exists");
}

/// With `--control A,B`, a request for a model only B has, sent after A's
/// snapshot made the proxy ready and before B's came (B not up yet), waits
/// for B's snapshot and is served: before, it was answered 404 "does not
/// exist".
#[tokio::test]
async fn a_model_of_a_control_plane_not_synced_yet_is_not_a_404_at_start() {
    let e = Engine::start("b").await;
    let a = ScriptedControl::start(vec![model("only_a", ModelState::Awake, &[&e.url])]);
    // B's address, with nothing serving there yet.
    let mut b = ScriptedControl::start(vec![model("only_b", ModelState::Awake, &[&e.url])]);
    b.kill();
    let p = ready_proxy(vec![a.url(), b.url()], |cfg| {
        cfg.first_snapshot_wait = Duration::from_secs(60)
    })
    .await;
    let before = accepted(&p).await;
    let url = p.url("/v1/chat/completions");
    let t = tokio::spawn(async move { post(&url, &chat("only_b")).await });
    wait_until("the request taken", || async {
        accepted(&p).await > before
    })
    .await;
    b.restart();
    let r = t.await.unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}
