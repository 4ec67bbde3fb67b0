//! `siesta top` in a pseudo-terminal against a running control plane, a
//! proxy and fake-vllm: the screen (parsed with vt100) shows a model woken
//! by a request through the proxy as `waking`, then `awake`, each within a
//! second of the Watch event; keys act on the selected model; `q` restores
//! the terminal; a control-plane restart shows "reconnecting…", not a crash.

#[path = "top/pty.rs"]
mod pty;
use siesta_tests::ctl as util;

use nix::sys::termios::{LocalFlags, tcgetattr};
use pty::{TopPty, row_state};
use siesta_proto::v1 as pb;
use siesta_tests::{spawn_proxy, wait_until};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use util::{LONG, config, fake_model, start, state, wait_state};

/// Events reach the screen within this long (the bound).
const LIVE_WITHIN: Duration = Duration::from_secs(1);

#[tokio::test]
async fn top_shows_a_wake_through_the_proxy_live_and_q_restores_the_terminal() {
    // A wake long enough for the held requests to be reported and shown.
    let models = fake_model("alpha", "asleep", &["--wake-time", "3s"], "")
        + &fake_model("beta", "none", &[], "");
    let ctl = start(&config(&models)).await;
    let mut c = ctl.client().await;
    wait_state(&mut c, "alpha", pb::ModelState::Asleep, LONG).await;
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    let ready = format!("{}/readyz", proxy.admin_url());
    wait_until("proxy ready", LONG, || async {
        matches!(reqwest::get(&ready).await, Ok(r) if r.status() == 200)
    })
    .await;

    let mut top = TopPty::spawn(&ctl.url(), "alpha");
    wait_until("top shows both models, live", LONG, || async {
        let t = top.text();
        row_state(&t, "alpha").as_deref() == Some("asleep(l1)")
            && row_state(&t, "beta").as_deref() == Some("stopped")
            && t.contains(" live ")
    })
    .await;

    // Watch alongside top, to time the events.
    let since = c
        .list_models(pb::ListModelsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .revision;
    let mut events = c
        .watch(pb::WatchRequest {
            since_revision: since,
            client_id: "top test".into(),
            incarnation: 0,
            heartbeat: false,
        })
        .await
        .expect("Watch")
        .into_inner();
    // Three requests at once: held while alpha wakes.
    const HELD: u32 = 3;
    let asks: Vec<_> = (0..HELD)
        .map(|_| {
            let url = format!("{}/v1/chat/completions", proxy.url());
            tokio::spawn(async move {
                let body = serde_json::json!({"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
                reqwest::Client::new()
                    .post(url)
                    .json(&body)
                    .send()
                    .await
                    .map(|r| r.status())
            })
        })
        .collect();
    let mut at = BTreeMap::new();
    let mut held_before_awake = 0;
    tokio::time::timeout(LONG, async {
        while let Some(Ok(ev)) = events.next().await {
            if let Some(pb::watch_event::Kind::Model(m)) = ev.kind
                && m.name == "alpha"
            {
                at.entry(state(&m)).or_insert_with(Instant::now);
                if state(&m) == pb::ModelState::Awake {
                    return;
                }
                held_before_awake = held_before_awake.max(m.held);
            }
        }
    })
    .await
    .expect("alpha awake on Watch");
    for ask in asks {
        assert_eq!(ask.await.unwrap().expect("request through the proxy"), 200);
    }
    // The proxy reported what it held, control published it, top showed it.
    assert_eq!(
        held_before_awake, HELD,
        "held requests on Watch before awake"
    );
    wait_until(&format!("top showed {HELD} held"), LONG, || async {
        top.held_seen().contains(&HELD.to_string())
    })
    .await;
    // Served: the count goes back to zero everywhere.
    wait_until("alpha's held count back to 0", LONG, || {
        let mut c = c.clone();
        async move { util::status(&mut c, "alpha").await.held == 0 }
    })
    .await;
    wait_until("top shows 0 held", LONG, || async {
        pty::cell(&top.text(), "alpha", "HELD").as_deref() == Some("0")
    })
    .await;
    for (want, st) in [
        ("waking", pb::ModelState::Waking),
        ("awake", pb::ModelState::Awake),
    ] {
        let event = *at.get(&st).unwrap_or_else(|| panic!("no {want} event"));
        wait_until(&format!("alpha {want} on the screen"), LONG, || async {
            top.first_seen(want).is_some()
        })
        .await;
        let late = top
            .first_seen(want)
            .unwrap()
            .saturating_duration_since(event);
        eprintln!("top: alpha {want} on screen {late:?} after the Watch event reached the test");
        assert!(
            late < LIVE_WITHIN,
            "alpha {want} on screen {late:?} after the event; screen:\n{}",
            top.text()
        );
    }
    let order = top.order();
    let w = order.iter().position(|s| s == "waking").unwrap();
    let a = order.iter().position(|s| s == "awake").unwrap();
    assert!(w < a, "waking shown after awake: {order:?}");

    if let Some(path) = std::env::var_os("SIESTA_TOP_CAPTURE") {
        std::fs::write(&path, top.text()).expect("writing SIESTA_TOP_CAPTURE");
    }

    // Keys act on the selected model: `1` puts alpha (first row) to sleep.
    top.keys(b"1");
    let m = wait_state(&mut c, "alpha", pb::ModelState::Asleep, LONG).await;
    assert_eq!(m.sleep_level, 1);
    wait_until("alpha asleep on the screen", LONG, || async {
        row_state(&top.text(), "alpha").as_deref() == Some("asleep(l1)")
    })
    .await;

    // `q` quits and restores the terminal.
    top.keys(b"q");
    let status = tokio::time::timeout(LONG, top.child.wait())
        .await
        .expect("siesta top exits on q")
        .unwrap();
    assert!(status.success(), "siesta top: {status}");
    // Its last output may still be on its way through the pty.
    wait_until("the main screen and the cursor back", LONG, || async {
        top.restored()
    })
    .await;
    let s = top.screen.lock().unwrap();
    assert!(
        String::from_utf8_lossy(&s.raw).contains("\x1b[?1049l"),
        "never left the alternate screen"
    );
    let t = tcgetattr(&top.slave).expect("tcgetattr");
    assert!(
        t.local_flags
            .contains(LocalFlags::ICANON | LocalFlags::ECHO),
        "raw mode not undone: {:?}",
        t.local_flags
    );
}

#[tokio::test]
async fn top_survives_a_control_plane_restart_and_sigterm_restores_the_terminal() {
    let mut ctl = start(&config(&fake_model("gamma", "none", &[], ""))).await;
    let mut top = TopPty::spawn(&ctl.url(), "gamma");
    wait_until("top live", LONG, || async {
        let t = top.text();
        row_state(&t, "gamma").as_deref() == Some("stopped") && t.contains(" live ")
    })
    .await;
    ctl.kill9();
    wait_until("reconnecting… in the header", LONG, || async {
        top.text().contains("reconnecting…")
    })
    .await;
    assert!(top.child.try_wait().unwrap().is_none(), "siesta top exited");
    ctl.restart().await;
    let mut c = ctl.client().await;
    c.wake(pb::WakeRequest {
        name: "gamma".into(),
        wait: false,
        timeout_ms: 0,
    })
    .await
    .expect("Wake");
    wait_until("live again, with gamma woken", LONG, || async {
        let t = top.text();
        t.contains(" live ") && row_state(&t, "gamma").as_deref() == Some("awake")
    })
    .await;
    let pid = nix::unistd::Pid::from_raw(top.child.id().expect("pid") as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    tokio::time::timeout(LONG, top.child.wait())
        .await
        .expect("siesta top exits on SIGTERM")
        .unwrap();
    wait_until("the main screen and the cursor back", LONG, || async {
        top.restored()
    })
    .await;
    let t = tcgetattr(&top.slave).expect("tcgetattr");
    assert!(
        t.local_flags
            .contains(LocalFlags::ICANON | LocalFlags::ECHO)
    );
}
