//! Two models that cannot both be awake on one GPU take turns under many
//! requests at once (the deadlock of the first side-by-side run): from
//! every starting point, 20 concurrent requests split between them are all
//! answered, the two are never awake together, and no engine is killed or
//! replaced.

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

#[tokio::test]
async fn two_models_on_one_gpu_take_turns_under_concurrent_requests() {
    let ctl = start(&swap_config(1, &[("a", 1, 0.85), ("b", 1, 0.85)])).await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    let mut pids = BTreeMap::new();
    for m in ["a", "b"] {
        let s = wait_state(&mut c, m, pb::ModelState::Asleep, LONG).await;
        pids.insert(m, s.pid);
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
        for m in ["a", "b"] {
            let s = status(&mut c, m).await;
            assert_eq!(
                s.pid, pids[m],
                "round {round}: {m}'s engine was replaced: {s:#?}"
            );
            assert_eq!(s.restarts, 1, "round {round}: {m} restarted: {s:#?}");
        }
    }
}

/// Three models on two GPUs, one of them tensor-parallel over both: woken
/// all at once by concurrent requests, each is answered, and no GPU ever
/// holds two awake models that do not fit together.
#[tokio::test]
async fn three_models_on_two_gpus_with_a_tp2_model_all_woken_at_once() {
    let ctl = start(&swap_config(
        2,
        &[("tp", 2, 0.6), ("a", 1, 0.6), ("b", 1, 0.6)],
    ))
    .await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    let mut pids = BTreeMap::new();
    for m in ["tp", "a", "b"] {
        let s = wait_state(&mut c, m, pb::ModelState::Asleep, LONG).await;
        pids.insert(m, s.pid);
    }
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
    for m in ["tp", "a", "b"] {
        let s = status(&mut c, m).await;
        assert_eq!(s.pid, pids[m], "{m}'s engine was replaced: {s:#?}");
        assert_eq!(s.restarts, 1, "{m} restarted: {s:#?}");
    }
}
