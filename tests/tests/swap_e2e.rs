//! Two models that cannot both be awake on one GPU take turns under many
//! requests at once (the deadlock of the first side-by-side run): from
//! every starting point, 20 concurrent requests split between them are all
//! answered, the two are never awake together, and no engine is killed or
//! replaced. A model kept busy without a pause yields the GPU to one that
//! waits, and gets it back.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::{ProxyProc, spawn_proxy};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const ANSWER_WITHIN: Duration = Duration::from_secs(90);

/// `models` as (name, GPUs, memory fraction), all preloaded asleep, on
/// `gpus` configured GPUs of 80 GiB.
fn swap_config(gpus: u32, models: &[(&str, u32, f64)]) -> String {
    let models: String = models
        .iter()
        .map(|(name, n, f)| {
            format!(
                r#"
[[model]]
name = "{name}"
model = "fake/{name}"
executable = "@FAKE_VLLM@"
preload = "asleep"
gpus = {n}
gpu_memory = {f}
env = {{ SIESTA_TEST_TAG = "@DIR@" }}
"#
            )
        })
        .collect();
    let base = config(&models)
        .replace(
            "state_dir = \"@DIR@/state\"",
            "state_dir = \"@DIR@/state\"\np2p_probe = \"off\"",
        )
        .replace("max_hold = \"30s\"", "max_hold = \"120s\"");
    let inventory: String = (0..gpus)
        .map(|i| format!("[[gpu]]\nindex = {i}\nname = \"test-gpu\"\nmemory = \"80GiB\"\n"))
        .collect();
    format!("{base}\n{inventory}")
}

async fn ask(proxy: &str, model: &str) -> Result<(), String> {
    try_chat(proxy, model, 4, ANSWER_WITHIN).await.map(drop)
}

/// Records it if the awake models ever match `forbidden` (a set of models
/// that cannot be awake together).
fn watch_never_awake_together(
    mut c: Client,
    forbidden: Vec<Vec<&'static str>>,
) -> Arc<Mutex<Option<String>>> {
    let broken = Arc::new(Mutex::new(None));
    let b = broken.clone();
    tokio::spawn(async move {
        let mut stream = c
            .watch(pb::WatchRequest {
                since_revision: 0,
                client_id: "swap-test".into(),
            })
            .await
            .unwrap()
            .into_inner();
        let mut states: BTreeMap<String, i32> = BTreeMap::new();
        // The last events, to say how it happened.
        let mut seen: std::collections::VecDeque<String> = Default::default();
        while let Ok(Some(ev)) = stream.message().await {
            match ev.kind {
                Some(pb::watch_event::Kind::Snapshot(s)) => {
                    for m in s.models {
                        states.insert(m.name, m.state);
                    }
                }
                Some(pb::watch_event::Kind::Model(m)) => {
                    seen.push_back(format!(
                        "{} {} {:?} l{} in_flight={} waiting_for={:?}",
                        ev.revision,
                        m.name,
                        pb::ModelState::try_from(m.state),
                        m.sleep_level,
                        m.in_flight,
                        m.waiting_for
                    ));
                    if seen.len() > 16 {
                        seen.pop_front();
                    }
                    states.insert(m.name, m.state);
                }
                _ => {}
            }
            let awake = |m: &str| states.get(m) == Some(&(pb::ModelState::Awake as i32));
            for set in &forbidden {
                if set.iter().all(|m| awake(m)) {
                    *b.lock().unwrap() = Some(format!(
                        "{set:?} awake together at revision {}; last events:\n{}",
                        ev.revision,
                        Vec::from(seen.clone()).join("\n")
                    ));
                }
            }
        }
    });
    broken
}

/// `n` concurrent requests, spread over `models` in turn.
async fn fire(proxy: &ProxyProc, models: &[&'static str], n: usize) -> Vec<String> {
    let url = proxy.url();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let url = url.clone();
            let model = models[i % models.len()];
            tokio::spawn(async move { ask(&url, model).await })
        })
        .collect();
    let mut errors = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            errors.push(e);
        }
    }
    errors
}

/// The control plane on `cfg` with a proxy in front, once every model of
/// `models` is preloaded asleep: its client, the proxy and each model's
/// preloaded status. None where NVML gives the real GPUs (the test skips).
async fn stand(
    cfg: &str,
    models: &[&'static str],
) -> Option<(
    Ctl,
    Client,
    ProxyProc,
    BTreeMap<&'static str, pb::ModelStatus>,
)> {
    let ctl = start(cfg).await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return None;
    }
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    let mut preloaded = BTreeMap::new();
    for &m in models {
        preloaded.insert(m, wait_state(&mut c, m, pb::ModelState::Asleep, LONG).await);
    }
    Some((ctl, c, proxy, preloaded))
}

/// Each model's engine is the one preloaded: same pid, started once.
async fn same_engines(
    c: &mut Client,
    preloaded: &BTreeMap<&'static str, pb::ModelStatus>,
    when: &str,
) {
    for (m, p) in preloaded {
        let s = status(c, m).await;
        assert_eq!(s.pid, p.pid, "{when}{m}'s engine was replaced: {s:#?}");
        assert_eq!(s.restarts, 1, "{when}{m} restarted: {s:#?}");
    }
}

#[tokio::test]
async fn two_models_on_one_gpu_take_turns_under_concurrent_requests() {
    let cfg = swap_config(1, &[("a", 1, 0.85), ("b", 1, 0.85)]);
    let Some((ctl, mut c, proxy, preloaded)) = stand(&cfg, &["a", "b"]).await else {
        return;
    };
    for s in preloaded.values() {
        // No NVML here: the default for TP=1 until measured.
        assert_eq!(
            (s.asleep_residual_bytes, s.asleep_residual_measured),
            (1 << 30, false)
        );
    }
    let placement = c
        .get_placement(pb::GetPlacementRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        placement
            .models
            .iter()
            .all(|p| p.asleep_residual_bytes == 1 << 30),
        "{placement:#?}"
    );
    let broken = watch_never_awake_together(ctl.client().await, vec![vec!["a", "b"]]);
    for round in 0..10 {
        match round % 3 {
            // Both asleep.
            0 => {
                for m in ["a", "b"] {
                    c.sleep(pb::SleepRequest {
                        name: m.into(),
                        level: 1,
                    })
                    .await
                    .unwrap();
                    wait_state(&mut c, m, pb::ModelState::Asleep, LONG).await;
                }
            }
            // One awake.
            1 => {
                wake_awake(&mut c, "a").await;
            }
            // One waking.
            _ => {
                wake(&mut c, "b", false).await;
            }
        }
        let errors = fire(&proxy, &["a", "b"], 20).await;
        assert!(errors.is_empty(), "round {round}: {errors:#?}");
        if let Some(b) = broken.lock().unwrap().clone() {
            panic!("round {round}: {b}");
        }
        same_engines(&mut c, &preloaded, &format!("round {round}: ")).await;
    }
}

/// Three models on two GPUs, one of them tensor-parallel over both: woken
/// all at once by concurrent requests, each is answered, and no GPU ever
/// holds two awake models that do not fit together.
#[tokio::test]
async fn three_models_on_two_gpus_with_a_tp2_model_all_woken_at_once() {
    let cfg = swap_config(2, &[("tp", 2, 0.6), ("a", 1, 0.6), ("b", 1, 0.6)]);
    let Some((ctl, mut c, proxy, preloaded)) = stand(&cfg, &["tp", "a", "b"]).await else {
        return;
    };
    // tp spans both GPUs: it cannot be awake with a (GPU 0) or b (GPU 1).
    let broken =
        watch_never_awake_together(ctl.client().await, vec![vec!["tp", "a"], vec!["tp", "b"]]);
    for round in 0..3 {
        let errors = fire(&proxy, &["tp", "a", "b"], 15).await;
        assert!(errors.is_empty(), "round {round}: {errors:#?}");
        if let Some(b) = broken.lock().unwrap().clone() {
            panic!("round {round}: {b}");
        }
    }
    same_engines(&mut c, &preloaded, "").await;
}

/// A request's outcome and when it ended.
type Answered = (Result<String, String>, std::time::Instant);

/// One chat completion that takes `tokens` / 20 s on a model paced at 20
/// tokens/s (`ignore_eos`: every token is generated); returns its
/// `finish_reason`.
async fn paced_chat(proxy: &str, model: &str, tokens: u32) -> Result<String, String> {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": tokens,
        "ignore_eos": true,
    });
    let v = try_chat_json(proxy, &body, ANSWER_WITHIN).await?;
    let finish = v["choices"][0]["finish_reason"]
        .as_str()
        .unwrap_or_default();
    let done = v["usage"]["completion_tokens"].as_u64() == Some(u64::from(tokens));
    if finish != "length" || !done {
        return Err(format!("{model}: cut short: {v}"));
    }
    Ok(finish.to_string())
}

/// A model kept busy without a pause does not keep the GPU from a model
/// that waits for it (`[control] yield_after`, 2 s here): past its turn it
/// holds new requests, lets those in flight finish, and sleeps; the waiting
/// model is served; then the busy one gets the GPU back and what it held
/// is answered. No request is cut or refused, the two are never awake
/// together, and no engine is replaced. (Before, the waiting model's
/// requests waited until the busy one was idle: here, never.)
#[tokio::test]
async fn a_busy_model_yields_the_gpu_to_a_waiting_one_and_gets_it_back() {
    let cfg = swap_config(1, &[("a", 1, 0.85), ("b", 1, 0.85)])
        .replace(
            "p2p_probe = \"off\"",
            "p2p_probe = \"off\"\nyield_after = \"2s\"",
        )
        .replace(
            "name = \"a\"\n",
            "name = \"a\"\nargs = [\"--tokens-per-second\", \"20\"]\n",
        );
    let Some((ctl, mut c, proxy, preloaded)) = stand(&cfg, &["a", "b"]).await else {
        return;
    };
    wake_awake(&mut c, "a").await;
    let broken = watch_never_awake_together(ctl.client().await, vec![vec!["a", "b"]]);

    // Six clients keep a busy: 1 s requests, back to back, staggered.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answered: Arc<Mutex<Vec<Answered>>> = Arc::default();
    let mut clients = Vec::new();
    for i in 0..6u64 {
        let (url, stop, answered) = (proxy.url(), stop.clone(), answered.clone());
        clients.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(170 * i)).await;
            let deadline = std::time::Instant::now() + Duration::from_secs(150);
            while !stop.load(std::sync::atomic::Ordering::SeqCst)
                && std::time::Instant::now() < deadline
            {
                let r = paced_chat(&url, "a", 20).await;
                answered
                    .lock()
                    .unwrap()
                    .push((r, std::time::Instant::now()));
            }
        }));
    }
    wait_status(&mut c, "a", "a busy", LONG, |s| s.in_flight >= 4).await;

    // b waits for the GPU a holds: a yields once b waited 2 s.
    let asked = std::time::Instant::now();
    let b = try_chat(&proxy.url(), "b", 4, ANSWER_WITHIN).await;
    let b_took = asked.elapsed();
    let b_done = std::time::Instant::now();
    assert!(b.is_ok(), "b was not served while a was busy: {b:?}");
    // a gets the GPU back: its held and new requests are answered.
    siesta_tests::wait_until("a answering again after b", LONG, || async {
        answered
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, at)| r.is_ok() && *at > b_done)
            .count()
            >= 6
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for t in clients {
        t.await.unwrap();
    }
    let answered = std::mem::take(&mut *answered.lock().unwrap());
    let errors: Vec<&String> = answered
        .iter()
        .filter_map(|(r, _)| r.as_ref().err())
        .collect();
    assert!(errors.is_empty(), "a's requests failed: {errors:#?}");
    eprintln!(
        "b answered after {b_took:?} with a busy; a answered {} requests, none cut",
        answered.len()
    );
    if let Some(b) = broken.lock().unwrap().clone() {
        panic!("{b}");
    }
    // It was a yield (a never idle), said in a's log; none was given up.
    let mut lines = c
        .logs(pb::LogsRequest {
            name: "a".into(),
            tail: 0,
            follow: false,
        })
        .await
        .unwrap()
        .into_inner();
    let mut log = Vec::new();
    while let Some(l) = lines.message().await.unwrap() {
        if l.stream == "siesta" {
            log.push(l.line);
        }
    }
    assert!(
        log.iter()
            .any(|l| l.contains("yielding its GPUs to \"b\", which waited for them")),
        "{log:#?}"
    );
    assert!(
        !log.iter().any(|l| l.contains("yield given up")),
        "{log:#?}"
    );
    let a = status(&mut c, "a").await;
    assert!(a.last_error.is_empty(), "{a:#?}");
    same_engines(&mut c, &preloaded, "").await;
}
