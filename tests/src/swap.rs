//! Models that share GPUs they cannot all be awake on, driven through a
//! proxy in end-to-end tests (`swap_e2e`, `turns_e2e`): the stand, the
//! watch that catches two awake together, and clients that keep a model
//! busy.

use crate::ctl::*;
use crate::{ProxyProc, spawn_proxy};
use siesta_proto::v1 as pb;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long one request may take to be answered.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(90);

/// `models` as (name, GPUs, memory fraction), all preloaded asleep, on
/// `gpus` configured GPUs of 80 GiB.
pub fn swap_config(gpus: u32, models: &[(&str, u32, f64)]) -> String {
    swap_config_with(gpus, models, &[])
}

/// [`swap_config`] with fake-vllm flags for some models (name, flags).
pub fn swap_config_with(
    gpus: u32,
    models: &[(&str, u32, f64)],
    flags: &[(&str, &[&str])],
) -> String {
    let models: String = models
        .iter()
        .map(|&(name, n, f)| {
            let flags = flags
                .iter()
                .find(|(m, _)| *m == name)
                .map_or(&[][..], |(_, f)| *f);
            fake_model_on(name, "asleep", n, flags, &format!("gpu_memory = {f}"))
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

/// Records it if the awake models ever match `forbidden` (a set of models
/// that cannot be awake together).
pub fn watch_never_awake_together(
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
                incarnation: 0,
                heartbeat: false,
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

/// The control plane on `cfg` with a proxy in front, once every model of
/// `models` is preloaded asleep: its client, the proxy and each model's
/// preloaded status. None where NVML gives the real GPUs (the test skips).
pub async fn stand(
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
pub async fn same_engines(
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

/// A request's outcome and when it ended.
pub type Answered = (Result<String, String>, Instant);

/// One chat completion that takes `tokens` / 20 s on a model paced at 20
/// tokens/s (`ignore_eos`: every token is generated); returns its
/// `finish_reason`.
pub async fn paced_chat(proxy: &str, model: &str, tokens: u32) -> Result<String, String> {
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

/// `n` clients that each send `model` one paced request of `tokens`
/// after another (staggered by 170 ms) until stopped; every outcome is kept.
#[derive(Debug)]
pub struct Busy {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pub answered: Arc<Mutex<Vec<Answered>>>,
}

impl Busy {
    pub fn start(proxy: &ProxyProc, model: &'static str, n: u64, tokens: u32) -> Busy {
        let stop = Arc::new(AtomicBool::new(false));
        let answered: Arc<Mutex<Vec<Answered>>> = Arc::default();
        let tasks = (0..n)
            .map(|i| {
                let (url, stop, answered) = (proxy.url(), stop.clone(), answered.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(170 * i)).await;
                    let deadline = Instant::now() + Duration::from_secs(150);
                    while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                        let r = paced_chat(&url, model, tokens).await;
                        answered.lock().unwrap().push((r, Instant::now()));
                    }
                })
            })
            .collect();
        Busy {
            stop,
            tasks,
            answered,
        }
    }

    /// Requests answered whole since `since`.
    pub fn answered_since(&self, since: Instant) -> usize {
        self.answered
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, at)| r.is_ok() && *at > since)
            .count()
    }

    /// Stops the clients once their requests under way end; every outcome.
    pub async fn stop(self) -> Vec<Answered> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            t.await.unwrap();
        }
        std::mem::take(&mut *self.answered.lock().unwrap())
    }
}

/// The lines siesta itself wrote to `model`'s log.
pub async fn siesta_log(c: &mut Client, model: &str) -> Vec<String> {
    let mut lines = c
        .logs(pb::LogsRequest {
            name: model.into(),
            tail: None,
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
    log
}
