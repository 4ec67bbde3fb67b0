//! `siesta top` in a pseudo-terminal against a running control plane, a
//! proxy and fake-vllm: the screen (parsed with vt100) shows a model woken
//! by a request through the proxy as `waking`, then `awake`, each within a
//! second of the Watch event; `q` restores the terminal.

#[path = "control/util.rs"]
mod util;

use nix::pty::{Winsize, openpty};
use nix::sys::termios::{LocalFlags, tcgetattr};
use siesta_proto::v1 as pb;
use siesta_tests::{bin_path, spawn_proxy, wait_until};
use std::io::{Read, Write};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use util::{LONG, config, fake_model, start, state, wait_state};

/// Events reach the screen within this long (the bound).
const LIVE_WITHIN: Duration = Duration::from_secs(1);

/// The model's row of the table: its state cell, if on screen.
fn row_state(screen: &str, model: &str) -> Option<String> {
    screen.lines().find_map(|l| {
        let cells = l.trim_start_matches(['│', ' ']);
        let rest = cells.strip_prefix(model)?.strip_prefix(' ')?;
        let rest = rest.trim_start();
        let rest = rest.strip_prefix("[pin]").unwrap_or(rest);
        Some(rest.split_whitespace().next()?.to_string())
    })
}

/// What the pty has shown: the parsed screen, all bytes, and when each
/// state of `model` first appeared in its row.
struct Screen {
    parser: vt100::Parser,
    raw: Vec<u8>,
    first_seen: Vec<(String, Instant)>,
}

#[tokio::test]
async fn top_shows_a_wake_through_the_proxy_live_and_q_restores_the_terminal() {
    let models = fake_model("alpha", "asleep", &["--wake-time", "1s"], "")
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

    let size = Winsize {
        ws_row: 40,
        ws_col: 160,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = openpty(Some(&size), None).expect("openpty");
    let slave = pty.slave;
    // `setsid -c`: a session of its own whose controlling terminal is the pty.
    let mut child = tokio::process::Command::new("setsid")
        .arg("-c")
        .arg(bin_path("siesta"))
        .args(["--control", &ctl.url(), "top"])
        .env("TERM", "xterm-256color")
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave.try_clone().unwrap()))
        .kill_on_drop(true)
        .spawn()
        .expect("spawning setsid -c siesta top");
    let mut master_w = std::fs::File::from(pty.master);
    let mut master_r = master_w.try_clone().unwrap();
    let screen = Arc::new(Mutex::new(Screen {
        parser: vt100::Parser::new(40.try_into().unwrap(), 160.try_into().unwrap(), 0),
        raw: Vec::new(),
        first_seen: Vec::new(),
    }));
    let reader = screen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 65536];
        while let Ok(n) = master_r.read(&mut buf) {
            if n == 0 {
                return;
            }
            let mut s = reader.lock().unwrap();
            s.parser.process(&buf[..n]);
            s.raw.extend_from_slice(&buf[..n]);
            let text = s.parser.screen().contents();
            if let Some(st) = row_state(&text, "alpha")
                && !s.first_seen.iter().any(|(x, _)| *x == st)
            {
                s.first_seen.push((st, Instant::now()));
            }
        }
    });
    let text = || screen.lock().unwrap().parser.screen().contents();
    wait_until("top shows both models, live", LONG, || async {
        let t = text();
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
        })
        .await
        .expect("Watch")
        .into_inner();
    let ask = {
        let url = format!("{}/v1/chat/completions", proxy.url());
        tokio::spawn(async move {
            let body = serde_json::json!({"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
            reqwest::Client::new().post(url).json(&body).send().await.map(|r| r.status())
        })
    };
    let mut at = std::collections::BTreeMap::new();
    tokio::time::timeout(LONG, async {
        while let Some(Ok(ev)) = events.next().await {
            if let Some(pb::watch_event::Kind::Model(m)) = ev.kind
                && m.name == "alpha"
            {
                at.entry(state(&m)).or_insert_with(Instant::now);
                if state(&m) == pb::ModelState::Awake {
                    return;
                }
            }
        }
    })
    .await
    .expect("alpha awake on Watch");
    assert_eq!(ask.await.unwrap().expect("request through the proxy"), 200);
    for (want, st) in [("waking", pb::ModelState::Waking), ("awake", pb::ModelState::Awake)] {
        let event = *at.get(&st).unwrap_or_else(|| panic!("no {want} event"));
        wait_until(&format!("alpha {want} on the screen"), LONG, || async {
            screen.lock().unwrap().first_seen.iter().any(|(s, _)| s == want)
        })
        .await;
        let seen = screen
            .lock()
            .unwrap()
            .first_seen
            .iter()
            .find(|(s, _)| s == want)
            .map(|(_, t)| *t)
            .unwrap();
        let late = seen.saturating_duration_since(event);
        assert!(
            late < LIVE_WITHIN,
            "alpha {want} on screen {late:?} after the event; screen:\n{}",
            text()
        );
    }
    let order: Vec<String> = screen.lock().unwrap().first_seen.iter().map(|(s, _)| s.clone()).collect();
    let w = order.iter().position(|s| s == "waking").unwrap();
    let a = order.iter().position(|s| s == "awake").unwrap();
    assert!(w < a, "waking shown after awake: {order:?}");

    // `q` quits and restores the terminal.
    master_w.write_all(b"q").unwrap();
    let status = tokio::time::timeout(LONG, child.wait())
        .await
        .expect("siesta top exits on q")
        .unwrap();
    assert!(status.success(), "siesta top: {status}");
    let s = screen.lock().unwrap();
    assert!(!s.parser.screen().alternate_screen(), "still on the alternate screen");
    assert!(!s.parser.screen().hide_cursor(), "cursor still hidden");
    let raw = String::from_utf8_lossy(&s.raw);
    assert!(raw.contains("\x1b[?1049l"), "never left the alternate screen");
    let t = tcgetattr(&slave).expect("tcgetattr");
    assert!(
        t.local_flags.contains(LocalFlags::ICANON | LocalFlags::ECHO),
        "raw mode not undone: {:?}",
        t.local_flags
    );
}

#[test]
fn rows_are_found_on_screen() {
    let screen = "│MODEL   STATE\n│alpha [pin]  waking 3s ago\n15:00:00  alpha: asleep → waking\n";
    assert_eq!(row_state(screen, "alpha").as_deref(), Some("waking"));
    assert_eq!(row_state(screen, "alph"), None);
}
