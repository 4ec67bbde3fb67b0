//! GPUs end to end: the real siesta-control and fake-vllm on a `[[gpu]]`
//! inventory. A model with a request in flight is never evicted: a wake
//! that needs its room waits (and says so), then proceeds once the request
//! ends. A tensor-parallel group over a pair whose saved P2P verdict is
//! `corrupt` starts with NCCL P2P off. (Waking B puts idle A to sleep is
//! control_placement.rs.) An asleep model is stopped for what it keeps
//! when nothing else frees the room a wake needs.
//!
//! Where NVML is present the inventory is the real one, not the config:
//! these tests then skip.

use futures::StreamExt;
use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use std::time::Duration;

/// `[control]` with the P2P probe off (deterministic), quick defaults,
/// `gpus` GPUs of 80 GiB, and `models`.
fn gpu_config(state_dir: &str, gpus: u32, models: &str) -> String {
    let inventory: String = (0..gpus)
        .map(|i| format!("[[gpu]]\nindex = {i}\nname = \"test-gpu\"\nmemory = \"80GiB\"\n"))
        .collect();
    let base = config(models).replace(
        "state_dir = \"@DIR@/state\"",
        &format!("state_dir = \"{state_dir}\"\np2p_probe = \"off\""),
    );
    format!("{base}\n{inventory}")
}

/// A fake-vllm model on GPUs.
fn gpu_model(name: &str, extra: &str) -> String {
    format!(
        r#"
[[model]]
name = "{name}"
model = "fake/{name}"
executable = "@FAKE_VLLM@"
preload = "none"
env = {{ SIESTA_TEST_TAG = "@DIR@" }}
args = ["--tokens-per-second", "20"]
{extra}
"#
    )
}

#[tokio::test]
async fn a_model_with_a_request_in_flight_is_not_evicted_and_the_wake_waits() {
    let ctl = start(&gpu_config(
        "@DIR@/state",
        1,
        &format!(
            "{}{}",
            gpu_model("a", "gpus = 1\ngpu_memory = 0.6"),
            gpu_model("b", "gpus = 1\ngpu_memory = 0.6")
        ),
    ))
    .await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let r = wake(&mut c, "a", true).await;
    let a = r.model.unwrap();
    assert_eq!(state(&a), pb::ModelState::Awake, "{}", r.message);

    // A long streaming request to a (20 tokens/s, 10000 tokens), held open.
    let body = serde_json::json!({
        "model": "a", "prompt": "x", "max_tokens": 10000, "stream": true, "ignore_eos": true,
    });
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", endpoint(&a)))
        .json(&body)
        .send()
        .await
        .expect("streaming request");
    assert!(resp.status().is_success(), "HTTP {}", resp.status());
    let mut stream = resp.bytes_stream();
    assert!(stream.next().await.is_some(), "first chunk");
    wait_status(&mut c, "a", "a request in flight", LONG, |s| {
        s.in_flight > 0
    })
    .await;

    // b needs a's room; a is busy: b waits and says for what.
    wake(&mut c, "b", false).await;
    let b = wait_status(&mut c, "b", "waiting_for", LONG, |s| {
        s.waiting_for.contains("in flight")
    })
    .await;
    assert!(
        b.waiting_for.contains("\"a\"") && b.waiting_for.contains("GPU 0"),
        "{}",
        b.waiting_for
    );
    assert_ne!(state(&b), pb::ModelState::Awake);
    // Still serving: a keeps streaming while b waits.
    for _ in 0..3 {
        assert!(
            stream.next().await.is_some_and(|c| c.is_ok()),
            "a streams on"
        );
    }
    let a = status(&mut c, "a").await;
    assert_eq!(state(&a), pb::ModelState::Awake, "a is not evicted");
    let b = status(&mut c, "b").await;
    assert!(!b.waiting_for.is_empty(), "b still waits: {b:#?}");

    // The request ends (the client goes away): b proceeds, a goes to sleep.
    drop(stream);
    let b = wait_state(&mut c, "b", pb::ModelState::Awake, LONG).await;
    assert!(b.waiting_for.is_empty(), "{}", b.waiting_for);
    let a = status(&mut c, "a").await;
    assert_eq!(state(&a), pb::ModelState::Asleep);
    assert_eq!(a.intent.unwrap().reason, pb::IntentReason::Eviction as i32);
}

/// A streamed completion to `model`'s engine, held open once its first
/// chunk came (10,000 tokens at 20 tokens/s).
async fn hold_a_stream(
    c: &mut siesta_tests::ctl::Client,
    model: &str,
) -> impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + use<> {
    let s = status(c, model).await;
    let body = serde_json::json!({
        "model": model, "prompt": "x", "max_tokens": 10000, "stream": true, "ignore_eos": true,
    });
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", endpoint(&s)))
        .json(&body)
        .send()
        .await
        .expect("streaming request");
    assert!(resp.status().is_success(), "HTTP {}", resp.status());
    let mut stream = Box::pin(resp.bytes_stream());
    assert!(stream.next().await.is_some(), "first chunk of {model}");
    wait_status(c, model, "a request in flight", LONG, |s| s.in_flight > 0).await;
    stream
}

/// What asleep models keep adds up (here 10 GiB each, as vLLM can keep
/// when measured): with two models busy, the room a third needs is held by
/// an asleep model. It is stopped (its engine gone, its intent "eviction"),
/// the third wakes, and the busy ones keep streaming. Before, the wake
/// waited until the asleep model's idle tier stopped it, hours later.
#[tokio::test]
async fn an_asleep_model_is_stopped_for_what_it_keeps_so_a_wake_finds_room() {
    let models: String = ["a", "b", "c", "d"]
        .iter()
        .map(|n| gpu_model(n, "gpus = 1\ngpu_memory = 0.3"))
        .collect();
    let cfg = gpu_config("@DIR@/state", 1, &models).replace(
        "p2p_probe = \"off\"",
        "p2p_probe = \"off\"\nasleep_residual = \"10GiB\"",
    );
    let ctl = start(&cfg).await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    // c started, then put to sleep by its operator.
    wake_awake(&mut c, "c").await;
    c.sleep(pb::SleepRequest {
        name: "c".into(),
        level: 1,
    })
    .await
    .unwrap();
    let asleep = wait_state(&mut c, "c", pb::ModelState::Asleep, LONG).await;
    let c_pid = asleep.pid;
    // a and b awake and busy: 24 + 24 + c's 10 = 58 GiB of 80.
    wake_awake(&mut c, "a").await;
    let mut a_stream = hold_a_stream(&mut c, "a").await;
    wake_awake(&mut c, "b").await;
    let mut b_stream = hold_a_stream(&mut c, "b").await;

    // d needs 24: 82 > 80 with c asleep.
    let r = wake(&mut c, "d", true).await;
    let d = r.model.unwrap();
    assert_eq!(state(&d), pb::ModelState::Awake, "{}", r.message);
    let c_now = wait_state(&mut c, "c", pb::ModelState::Stopped, LONG).await;
    assert_eq!(
        c_now.intent.unwrap().reason,
        pb::IntentReason::Eviction as i32
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{c_pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{c_pid}/stat"))
                .is_ok_and(|s| s.contains(") Z ")),
        "c's engine (pid {c_pid}) is gone"
    );
    for (name, stream) in [("a", &mut a_stream), ("b", &mut b_stream)] {
        assert!(
            stream.next().await.is_some_and(|c| c.is_ok()),
            "{name} streams on"
        );
        assert_eq!(state(&status(&mut c, name).await), pb::ModelState::Awake);
    }
    // A request for c starts it again once there is room: a's stream ends.
    drop(a_stream);
    let r = wake(&mut c, "c", true).await;
    assert_eq!(
        state(&r.model.unwrap()),
        pb::ModelState::Awake,
        "{}",
        r.message
    );
}

/// Waits until `model`'s log has a line containing `needle`.
async fn log_has(c: &mut siesta_tests::ctl::Client, model: &str, needle: &str) {
    let mut lines = c
        .logs(pb::LogsRequest {
            name: model.into(),
            tail: None,
            follow: true,
        })
        .await
        .expect("logs")
        .into_inner();
    tokio::time::timeout(LONG, async {
        while let Some(l) = lines.next().await {
            if l.expect("log line").line.contains(needle) {
                return;
            }
        }
        panic!("{model}'s log ended without {needle:?}");
    })
    .await
    .unwrap_or_else(|_| panic!("no {needle:?} in {model}'s log within {LONG:?}"));
}

/// How b frees GPU memory while a starts.
#[derive(Clone, Copy)]
enum Free {
    Sleep,
    Stop,
}

/// Starts a and, once a's engine has taken its memory snapshot, asks b
/// (as it is: awake or asleep) to sleep or stop: b waits for a's start,
/// saying so.
async fn free_b_while_a_starts(c: &mut siesta_tests::ctl::Client, how: Free) -> pb::ModelStatus {
    wake(c, "a", false).await;
    log_has(c, "a", "Starting to load model").await;
    let b = || pb::ModelRequest { name: "b".into() };
    let what = match how {
        Free::Sleep => {
            let level = 1;
            c.sleep(pb::SleepRequest {
                name: "b".into(),
                level,
            })
            .await
            .unwrap();
            "the sleep waits"
        }
        Free::Stop => {
            c.stop(b()).await.unwrap();
            "the stop waits"
        }
    };
    wait_status(c, "b", "waiting for a's start", LONG, |s| {
        s.waiting_for.contains("an engine starting on GPU 0") && s.waiting_for.contains(what)
    })
    .await
}

/// A model of `share` of one GPU on fake-vllm's simulated 80 GiB GPU (its
/// engines see each other's memory), with `args` (a TOML `args = [...]`).
fn sim_model(name: &str, share: &str, args: &str) -> String {
    let sim = r#"env = { SIESTA_TEST_TAG = "@DIR@", FAKE_VLLM_GPU_TOTAL_BYTES = "85899345920", FAKE_VLLM_GPU_DIR = "@DIR@/simgpu" }"#;
    gpu_model(name, &format!("gpus = 1\ngpu_memory = {share}"))
        .replace(r#"env = { SIESTA_TEST_TAG = "@DIR@" }"#, sim)
        .replace(r#"args = ["--tokens-per-second", "20"]"#, args)
}

/// `models` on one GPU; None where NVML shows the real inventory.
async fn on_one_gpu(models: &str) -> Option<(Ctl, siesta_tests::ctl::Client)> {
    let ctl = start(&gpu_config("@DIR@/state", 1, models)).await;
    let mut c = ctl.client().await;
    gpus_from_config(&mut c).await.then_some((ctl, c))
}

/// a (starting in 4 s) and b (keeping 1 GiB asleep) on one simulated GPU.
async fn neighbours() -> Option<(Ctl, siesta_tests::ctl::Client)> {
    on_one_gpu(&format!(
        "{}{}",
        sim_model("a", "0.4", r#"args = ["--startup-time", "4s"]"#),
        sim_model("b", "0.4", r#"args = ["--asleep-residual-mib", "1024"]"#)
    ))
    .await
}

/// `name` goes to sleep and is asleep, its sleep never failed.
async fn asleep_unharmed(c: &mut siesta_tests::ctl::Client, name: &str) {
    let s = wait_status(c, name, "asleep or failed", LONG, |s| {
        matches!(state(s), pb::ModelState::Asleep | pb::ModelState::Failed)
    })
    .await;
    assert_eq!(
        (state(&s), s.failures, s.restarts),
        (pb::ModelState::Asleep, 0, 1),
        "{name}'s sleep failed: {}",
        s.last_error
    );
}

/// For the next round: a stopped, b awake.
async fn stop_a_wake_b(c: &mut siesta_tests::ctl::Client) {
    c.stop(pb::ModelRequest { name: "a".into() }).await.unwrap();
    wait_state(c, "a", pb::ModelState::Stopped, LONG).await;
    wake_awake(c, "b").await;
}

/// a's start succeeded the first time (its `restarts` counts starts).
async fn a_started(c: &mut siesta_tests::ctl::Client, starts: u32) {
    let a = wait_state(c, "a", pb::ModelState::Awake, LONG).await;
    assert_eq!((a.failures, a.restarts), (0, starts), "a's start failed");
}

/// vLLM fails a start whose GPU frees memory while it profiles (fake-vllm
/// too, on its simulated GPU). An operator's sleep of a neighbour during
/// the start waits for it (and says so), then sleeps; the start succeeds
/// the first time. A wake of the neighbour meanwhile is served once its
/// sleep is done.
#[tokio::test]
async fn a_neighbours_sleep_waits_for_an_engine_starting_on_its_gpu() {
    let Some((_ctl, mut c)) = neighbours().await else {
        return;
    };
    wake_awake(&mut c, "b").await;
    let b = free_b_while_a_starts(&mut c, Free::Sleep).await;
    assert_eq!(state(&b), pb::ModelState::Sleeping);
    a_started(&mut c, 1).await;
    wait_state(&mut c, "b", pb::ModelState::Asleep, LONG).await;

    // Again, and an operator's wake of b while its sleep waits: served
    // after the sleep, a's start unharmed.
    stop_a_wake_b(&mut c).await;
    free_b_while_a_starts(&mut c, Free::Sleep).await;
    let r = wake(&mut c, "b", true).await;
    assert_eq!(
        state(&r.model.unwrap()),
        pb::ModelState::Awake,
        "{}",
        r.message
    );
    a_started(&mut c, 2).await;
}

/// A neighbour's stop frees its memory as a sleep does (all of it awake,
/// what it keeps asleep): during a start it waits too, awake or asleep,
/// then stops; the start succeeds the first time.
#[tokio::test]
async fn a_neighbours_stop_waits_for_an_engine_starting_on_its_gpu() {
    let Some((_ctl, mut c)) = neighbours().await else {
        return;
    };
    wake_awake(&mut c, "b").await;
    let b = free_b_while_a_starts(&mut c, Free::Stop).await;
    assert_eq!(state(&b), pb::ModelState::Stopping);
    a_started(&mut c, 1).await;
    wait_state(&mut c, "b", pb::ModelState::Stopped, LONG).await;

    // b asleep, keeping 1 GiB.
    stop_a_wake_b(&mut c).await;
    let level = 1;
    c.sleep(pb::SleepRequest {
        name: "b".into(),
        level,
    })
    .await
    .unwrap();
    wait_state(&mut c, "b", pb::ModelState::Asleep, LONG).await;
    let b = free_b_while_a_starts(&mut c, Free::Stop).await;
    assert_eq!(state(&b), pb::ModelState::Stopping);
    a_started(&mut c, 2).await;
    wait_state(&mut c, "b", pb::ModelState::Stopped, LONG).await;
}

/// The NUL-separated entries of /proc/PID/{cmdline,environ}.
fn proc_list(pid: u32, what: &str) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/{what}")).unwrap_or_default();
    raw.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

fn saved_p2p(corrupt: (u32, u32)) -> String {
    let mut results = Vec::new();
    for s in 0..3u32 {
        for d in 0..3u32 {
            if s != d {
                let health = if (s, d) == corrupt { "corrupt" } else { "ok" };
                results.push(serde_json::json!({
                    "src": s, "dst": d, "health": health,
                    "elements": 1024, "corrupt_elements": if health == "ok" { 0 } else { 1000 },
                }));
            }
        }
    }
    serde_json::json!({"probed_unix_ms": 1_700_000_000_000_i64, "results": results}).to_string()
}

#[tokio::test]
async fn a_tp_group_over_a_corrupt_pair_starts_with_p2p_off() {
    // The daemon loads STATE_DIR/p2p.json at start: 0→1 corrupt, the rest ok.
    let state_dir = tempfile::tempdir().unwrap();
    std::fs::write(state_dir.path().join("p2p.json"), saved_p2p((0, 1))).unwrap();
    let tp = |ids: &str| format!("gpus = 2\ngpu_ids = {ids}\ngpu_memory = 0.4");
    let ctl = start(&gpu_config(
        &state_dir.path().to_string_lossy(),
        3,
        &format!(
            "{}{}",
            gpu_model("tp01", &tp("[0, 1]")),
            gpu_model("tp12", &tp("[1, 2]"))
        ),
    ))
    .await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let gpus = c
        .list_gpus(pb::ListGpusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gpus.p2p.len(), 6, "{gpus:#?}");
    assert_eq!(gpus.p2p_probed_unix_ms, 1_700_000_000_000);
    let bad = gpus.p2p.iter().find(|r| (r.src, r.dst) == (0, 1)).unwrap();
    assert_eq!(bad.health(), pb::P2pHealth::Corrupt);
    assert_eq!(bad.corrupt_elements, 1000);
    // Published on Watch too (the snapshot's GPUs).
    let first = c
        .watch(pb::WatchRequest {
            since_revision: 0,
            client_id: "gpu_eviction".into(),
            incarnation: 0,
            heartbeat: false,
        })
        .await
        .unwrap()
        .into_inner()
        .next()
        .await
        .unwrap()
        .unwrap();
    let Some(pb::watch_event::Kind::Snapshot(snap)) = first.kind else {
        panic!("first Watch event is not a snapshot: {first:?}");
    };
    assert_eq!(snap.gpus.unwrap().p2p.len(), 6);

    for (name, off) in [("tp01", true), ("tp12", false)] {
        let r = wake(&mut c, name, true).await;
        let s = r.model.unwrap();
        assert_eq!(state(&s), pb::ModelState::Awake, "{name}: {}", r.message);
        assert_eq!(s.p2p_disabled, off, "{name}: {s:#?}");
        assert!(s.pid > 0);
        let argv = proc_list(s.pid, "cmdline");
        let env = proc_list(s.pid, "environ");
        let tp2 = argv
            .windows(2)
            .any(|w| w[0] == "--tensor-parallel-size" && w[1] == "2");
        assert!(tp2, "{name}: {argv:?}");
        assert_eq!(
            argv.iter().any(|a| a == "--disable-custom-all-reduce"),
            off,
            "{name}: {argv:?}"
        );
        assert_eq!(
            env.iter().any(|e| e == "NCCL_P2P_DISABLE=1"),
            off,
            "{name}: NCCL_P2P_DISABLE"
        );
        let visible = if off { "0,1" } else { "1,2" };
        assert!(
            env.iter()
                .any(|e| *e == format!("CUDA_VISIBLE_DEVICES={visible}")),
            "{name}: CUDA_VISIBLE_DEVICES"
        );
    }
    let p = c
        .get_placement(pb::GetPlacementRequest {})
        .await
        .unwrap()
        .into_inner();
    let tp01 = p.models.iter().find(|m| m.model == "tp01").unwrap();
    assert!(tp01.p2p_disabled);
    assert!(
        tp01.reason.contains("GPU 0→1 is corrupt"),
        "{}",
        tp01.reason
    );

    // A deadline past an hour is refused, naming the field (the CLI
    // refuses it as a usage error; other clients get this).
    let refused = c
        .diag_p2p(pb::DiagP2pRequest {
            bytes: 0,
            timeout_ms: 7_200_000,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused
            .message()
            .contains("timeout_ms: 7200000 ms is more than the probe's longest deadline, 1h"),
        "{refused:?}"
    );

    // No CUDA driver here: the probe says so, promptly, and the saved
    // verdicts stay. (On a CUDA box it runs; then every pair is reported.)
    let started = std::time::Instant::now();
    let r = c
        .diag_p2p(pb::DiagP2pRequest {
            bytes: 1 << 20,
            timeout_ms: 20_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(started.elapsed() < Duration::from_secs(30));
    if r.message.is_empty() {
        assert_eq!(r.results.len(), 6, "{r:#?}");
    } else {
        assert!(r.message.contains("P2P not probed"), "{}", r.message);
        assert!(r.failed, "two GPUs and no probe run: failed");
        let gpus = c
            .list_gpus(pb::ListGpusRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(gpus.p2p_probed_unix_ms, 1_700_000_000_000);
        assert!(status(&mut c, "tp01").await.p2p_disabled);
    }
}

#[tokio::test]
async fn the_probe_at_start_without_cuda_neither_fails_nor_hangs_start_up() {
    // p2p_probe = "start" (the default) on a two-GPU inventory.
    let text = gpu_config(
        "@DIR@/state",
        2,
        &gpu_model("tp", "gpus = 2\ngpu_memory = 0.5"),
    )
    .replace("p2p_probe = \"off\"", "p2p_probe_timeout = \"20s\"");
    let ctl = start(&text).await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let gpus = c
        .list_gpus(pb::ListGpusRequest {})
        .await
        .unwrap()
        .into_inner();
    if gpus.p2p.is_empty() {
        // Not probed (no CUDA driver): unprobed pairs are not trusted.
        assert_eq!(gpus.p2p_probed_unix_ms, 0);
        let r = wake(&mut c, "tp", true).await;
        let s = r.model.unwrap();
        assert_eq!(state(&s), pb::ModelState::Awake, "{}", r.message);
        assert!(s.p2p_disabled);
    } else {
        assert_eq!(gpus.p2p.len(), 2, "{gpus:#?}");
    }
}

/// vLLM fails a sleep whose GPU's memory use grows while it frees ("Memory
/// usage increased after sleeping", a 500; seen on an H200 when a
/// neighbour woke during a level-2 sleep, and siesta then killed and
/// restarted the sleeping engine). fake-vllm does too, on its simulated
/// GPU. Here `b` goes to sleep (4 s) while `a`, which needs more than `b`
/// frees, is woken beside it: the wake waits for the sleep (or the other
/// way round), and both succeed, `b` never failed. `a`'s wake timeout (2 s)
/// is shorter than `b`'s sleep: the wait is not the wake's time (it was,
/// and `a` was killed for a wake that had not begun).
#[tokio::test]
async fn a_sleep_and_a_neighbours_wake_on_one_gpu_take_turns() {
    let Some((_ctl, mut c)) = on_one_gpu(&format!(
        "{}{}",
        sim_model(
            "a",
            "0.5",
            "args = [\"--asleep-residual-mib\", \"1024\", \"--wake-time\", \"1s\"]\n\
             wake_timeout = \"2s\""
        ),
        sim_model(
            "b",
            "0.3",
            r#"args = ["--asleep-residual-mib", "1024", "--sleep-time", "4s"]"#
        )
    ))
    .await
    else {
        return;
    };
    wake_awake(&mut c, "a").await;
    let sleep = |name: &str| pb::SleepRequest {
        name: name.into(),
        level: 1,
    };
    c.sleep(sleep("a")).await.unwrap();
    wait_state(&mut c, "a", pb::ModelState::Asleep, LONG).await;
    wake_awake(&mut c, "b").await;
    // b frees 23 GiB over 3 s; a's wake takes 39 GiB meanwhile.
    c.sleep(sleep("b")).await.unwrap();
    wait_state(&mut c, "b", pb::ModelState::Sleeping, LONG).await;
    let r = wake(&mut c, "a", true).await;
    let a = r.model.unwrap();
    assert_eq!(
        (state(&a), a.failures, a.restarts),
        (pb::ModelState::Awake, 0, 1),
        "{}: {}",
        r.message,
        a.last_error
    );
    asleep_unharmed(&mut c, "b").await;
}

/// A CUDA restore allocates as a wake does: fake-cuda-checkpoint frees an engine's memory
/// on the simulated GPU at the suspend and takes it again at the resume, as the driver
/// does. `a`'s restore while `b` goes to sleep (4 s) beside it waits for that sleep, which
/// then does not fail; `a`'s wake timeout (2 s) does not count the wait.
#[tokio::test]
async fn a_restore_waits_for_a_neighbours_sleep_on_its_gpu() {
    let models = format!(
        "{}{}",
        sim_model("a", "0.5", "wake_timeout = \"2s\""),
        sim_model(
            "b",
            "0.3",
            r#"args = ["--asleep-residual-mib", "1024", "--sleep-time", "4s"]"#
        )
    );
    let config = gpu_config("@DIR@/state", 1, &models).replace(
        "p2p_probe = \"off\"",
        &format!(
            "p2p_probe = \"off\"\ncuda_checkpoint = {:?}",
            siesta_tests::bin_path("fake-cuda-checkpoint")
                .display()
                .to_string()
        ),
    );
    let ctl = start(&config).await;
    let mut c = ctl.client().await;
    if !gpus_from_config(&mut c).await {
        return;
    }
    let awake = wake_awake(&mut c, "a").await;
    c.suspend(pb::ModelRequest { name: "a".into() })
        .await
        .unwrap();
    wait_state(&mut c, "a", pb::ModelState::Suspended, LONG).await;
    wake_awake(&mut c, "b").await;
    // b frees 23 GiB over 4 s; a's restore takes 40 GiB meanwhile.
    c.sleep(pb::SleepRequest {
        name: "b".into(),
        level: 1,
    })
    .await
    .unwrap();
    wait_state(&mut c, "b", pb::ModelState::Sleeping, LONG).await;
    let r = wake(&mut c, "a", true).await;
    let a = r.model.unwrap();
    assert_eq!(
        (state(&a), a.pid, a.failures, a.restarts),
        (pb::ModelState::Awake, awake.pid, 0, 1),
        "{}: {}",
        r.message,
        a.last_error
    );
    asleep_unharmed(&mut c, "b").await;
}

/// A sleep called off by a stop (an operator's, mid-sleep) goes on in the engine: vLLM
/// frees the memory when its sleep ends, whoever stopped waiting for the answer. So the
/// GPU's turns the sleep held are kept until the engine has answered: `b`'s start, asked
/// for right after the stop, waits for `a`'s sleep to end instead of profiling while `a`
/// frees 35 GiB beside it (fake-vllm fails that start as vLLM does: "Error in memory
/// profiling"; found by `scripts/chaos --ops lifecycle` on a simulated GPU).
#[tokio::test]
async fn a_sleep_called_off_by_a_stop_keeps_its_turn_until_the_engine_answers() {
    let Some((_ctl, mut c)) = on_one_gpu(&format!(
        "{}{}",
        sim_model(
            "a",
            "0.45",
            r#"args = ["--asleep-residual-mib", "1024", "--sleep-time", "3s"]"#
        ),
        sim_model("b", "0.45", r#"args = ["--startup-time", "4s"]"#)
    ))
    .await
    else {
        return;
    };
    wake_awake(&mut c, "a").await;
    c.sleep(pb::SleepRequest {
        name: "a".into(),
        level: 1,
    })
    .await
    .unwrap();
    wait_state(&mut c, "a", pb::ModelState::Sleeping, LONG).await;
    // b's start waits for a's sleep; then a is stopped, which calls the sleep off.
    wake(&mut c, "b", false).await;
    wait_status(&mut c, "b", "waiting for a's sleep", LONG, |s| {
        state(s) == pb::ModelState::Starting && !s.waiting_for.is_empty()
    })
    .await;
    c.stop(pb::ModelRequest { name: "a".into() }).await.unwrap();
    let b = wait_status(&mut c, "b", "awake or failed", LONG, |s| {
        matches!(state(s), pb::ModelState::Awake | pb::ModelState::Failed)
    })
    .await;
    assert_eq!(
        (state(&b), b.failures),
        (pb::ModelState::Awake, 0),
        "b's start failed: {}",
        b.last_error
    );
    wait_state(&mut c, "a", pb::ModelState::Stopped, LONG).await;
}

/// vLLM fails a start whose GPU's free memory grows while it profiles; a neighbour that
/// crashes meanwhile frees its memory (siesta can hold back its own sleeps and stops, not a
/// crash, nor a process it does not run). The start is made again at once, the model still
/// `starting` (held requests stay held), not failed and retried after backoff: here `a`
/// crashes (`kill -9` of its process group) while `b` starts beside it, and `b`'s waited
/// wake answers awake with no failure, its second engine serving.
#[tokio::test]
async fn a_start_failed_by_a_neighbours_crash_is_made_again_at_once() {
    let Some((_ctl, mut c)) = on_one_gpu(&format!(
        "{}{}",
        sim_model("a", "0.45", r#"args = ["--asleep-residual-mib", "1024"]"#),
        sim_model("b", "0.45", r#"args = ["--startup-time", "3s"]"#)
    ))
    .await
    else {
        return;
    };
    let a = wake_awake(&mut c, "a").await;
    let mut waiter = c.clone();
    let woken = tokio::spawn(async move { wake(&mut waiter, "b", true).await });
    wait_status(&mut c, "b", "b's engine starting", LONG, |s| {
        state(s) == pb::ModelState::Starting && s.pid != 0
    })
    .await;
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(a.pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let r = woken.await.unwrap();
    let b = r.model.unwrap();
    assert_eq!(
        (state(&b), b.failures, b.restarts),
        (pb::ModelState::Awake, 0, 2),
        "{}: {}",
        r.message,
        b.last_error
    );
    log_has(
        &mut c,
        "b",
        "memory was freed on its GPUs while vLLM profiled",
    )
    .await;
}
