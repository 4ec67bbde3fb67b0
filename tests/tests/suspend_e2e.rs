//! The CUDA-suspend tier end to end, on `fake-cuda-checkpoint`: a stand-in for the
//! checkpoint helper that is as unkind as the driver (it SIGSTOPs every process of the
//! engine, so anything reaching a "checkpointed" engine hangs, as a real engine core dies).
//! A model with a suspend tier reaches `suspended`, no probe or request reaches it (the
//! kernel's queues on its port stay empty), a request through the proxy is held, resumes it
//! and is answered 200; `siesta suspend` then `siesta wake`; a control restarted while the
//! engine is suspended adopts it suspended; a failed restore restarts the engine and says
//! why; a failed suspend leaves it serving.

use siesta_proto::v1 as pb;
use siesta_tests::cli::at;
use siesta_tests::ctl::*;
use siesta_tests::{bin_path, proc_stat, spawn_proxy};
use std::time::Duration;

/// Long enough for several of control's 1 s probe rounds.
const SEVERAL_PROBE_ROUNDS: Duration = Duration::from_secs(3);

fn suspend_config(idle: &str) -> String {
    let model = format!(
        r#"
[[model]]
name = "m"
model = "fake/m"
executable = "@FAKE_VLLM@"
gpus = 0
preload = "awake"
env = {{ SIESTA_TEST_TAG = "@DIR@", FAKE_CUDA_CHECKPOINT_FAULTS = "@DIR@/ckpt-faults" }}
{idle}
"#
    );
    config(&model).replace(
        "state_dir = \"@DIR@/state\"",
        &format!(
            "state_dir = \"@DIR@/state\"\ncuda_checkpoint = {:?}",
            bin_path("fake-cuda-checkpoint").display().to_string()
        ),
    )
}

/// Every process of the engine's process group (pgid = its pid).
fn group(pgid: u32) -> Vec<(i32, char)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(proc_stat)
        .filter(|s| s.pgrp == pgid as i32)
        .map(|s| (s.pid, s.state))
        .collect()
}

/// Bytes (or, on the listening socket, connections) queued by the kernel for the engine's
/// port that nobody has read: something reached a frozen engine. Columns of
/// `/proc/net/tcp`: local address, state (`08`: CLOSE_WAIT), `tx_queue:rx_queue`.
fn queued_at(port: u16) -> u64 {
    let mut total = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port != Some(port) {
                continue;
            }
            let rx = f[4]
                .split(':')
                .nth(1)
                .and_then(|q| u64::from_str_radix(q, 16).ok());
            // A peer's FIN (a control that died) takes one sequence number: no data.
            let fin = u64::from(f[3] == "08");
            total += rx.unwrap_or(0).saturating_sub(fin);
        }
    }
    total
}

fn port_of(s: &pb::ModelStatus) -> u16 {
    endpoint(s).rsplit(':').next().unwrap().parse().unwrap()
}

async fn suspended(c: &mut Client) -> pb::ModelStatus {
    let s = wait_state(c, "m", pb::ModelState::Suspended, LONG).await;
    let procs = group(s.pid);
    assert!(!procs.is_empty(), "no process in group {}", s.pid);
    assert!(
        procs.iter().all(|(_, st)| *st == 'T'),
        "every process of the engine is frozen: {procs:?}"
    );
    s
}

fn engine_requests(stats: &serde_json::Value) -> u64 {
    stats["requests_arrived"].as_u64().unwrap()
}

async fn stats(s: &pb::ModelStatus) -> serde_json::Value {
    reqwest::get(format!("{}/fake/stats", endpoint(s)))
        .await
        .expect("fake stats")
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_suspended_engine_is_never_reached_and_a_held_request_resumes_it() {
    let ctl = start(&suspend_config(
        r#"idle = [ { after = "1s", action = "suspend" } ]"#,
    ))
    .await;
    let mut c = ctl.client().await;
    let awake = wait_state(&mut c, "m", pb::ModelState::Awake, LONG).await;
    let (pid, port) = (awake.pid, port_of(&awake));
    let caps = awake.capabilities.clone().expect("capabilities");
    assert!(caps.can_suspend);

    let s = suspended(&mut c).await;
    assert_eq!(s.pid, pid);
    assert_eq!(
        s.intent.as_ref().map(|i| i.reason),
        Some(pb::IntentReason::IdleTier as i32)
    );
    // Control keeps probing awake engines every second; a suspended one it leaves alone.
    tokio::time::sleep(SEVERAL_PROBE_ROUNDS).await;
    assert_eq!(
        queued_at(port),
        0,
        "a probe or request reached the frozen engine"
    );
    let s = status(&mut c, "m").await;
    assert_eq!(state(&s), pb::ModelState::Suspended, "{s:#?}");
    assert!(s.last_error.is_empty(), "{s:#?}");

    // A request through the proxy is held, resumes the engine (a restore that takes a
    // second here), and is answered.
    std::fs::write(ctl.dir.path().join("ckpt-faults"), "slow\n").unwrap();
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    let url = proxy.url();
    let asked = tokio::spawn(async move { try_chat(&url, "m", 4, LONG).await });
    wait_status(
        &mut c,
        "m",
        "the request held while it resumes",
        LONG,
        |s| s.held > 0 && state(s) == pb::ModelState::Waking,
    )
    .await;
    asked.await.unwrap().expect("answered 200 after the resume");
    let s = status(&mut c, "m").await;
    assert_eq!(
        (state(&s), s.pid, s.restarts),
        (pb::ModelState::Awake, pid, 1)
    );
    assert!(group(pid).iter().all(|(_, st)| *st != 'T'));
    let st = stats(&s).await;
    assert_eq!(engine_requests(&st), 1, "{st}");
    let cal = s.calibration.expect("calibration");
    assert!(
        cal.suspend_samples >= 1 && cal.resume_samples >= 1,
        "{cal:?}"
    );
}

#[tokio::test]
async fn siesta_suspend_then_wake_and_a_restarted_control_adopts_it_suspended() {
    // The stand-in freezes the engine with SIGSTOP; when control dies the engine's group
    // would become an orphaned process group with stopped members, which the kernel sends
    // SIGHUP (killing it). The real driver stops no process, so nothing like that happens
    // there: this test process adopts the orphans (same session, another group) instead.
    nix::sys::prctl::set_child_subreaper(true).expect("PR_SET_CHILD_SUBREAPER");
    let mut ctl = start(&suspend_config("")).await;
    let mut c = ctl.client().await;
    let awake = wait_state(&mut c, "m", pb::ModelState::Awake, LONG).await;
    let (pid, port) = (awake.pid, port_of(&awake));

    at(&ctl, &["suspend", "m"]).await.ok();
    suspended(&mut c).await;
    at(&ctl, &["wake", "m", "--wait"]).await.ok();
    let s = status(&mut c, "m").await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Awake, pid));
    chat(&endpoint(&s), "m").await;

    // Suspended, then control dies and comes back: it adopts the engine as suspended and
    // sends it nothing.
    at(&ctl, &["suspend", "m"]).await.ok();
    suspended(&mut c).await;
    ctl.restart().await;
    let mut c = ctl.client().await;
    let s = suspended(&mut c).await;
    assert_eq!(s.pid, pid);
    tokio::time::sleep(SEVERAL_PROBE_ROUNDS).await;
    assert_eq!(
        queued_at(port),
        0,
        "the adopting control reached the frozen engine"
    );
    let s = wake_awake(&mut c, "m").await;
    assert_eq!((s.pid, s.restarts), (pid, 1), "resumed, not restarted");
    chat(&endpoint(&s), "m").await;
}

#[tokio::test]
async fn a_failed_restore_restarts_the_engine_and_a_failed_suspend_leaves_it_serving() {
    let ctl = start(&suspend_config("")).await;
    let faults = ctl.dir.path().join("ckpt-faults");
    let mut c = ctl.client().await;
    let awake = wait_state(&mut c, "m", pb::ModelState::Awake, LONG).await;

    // The driver refuses: the engine keeps serving, and the status says why.
    std::fs::write(&faults, "suspend\n").unwrap();
    at(&ctl, &["suspend", "m"]).await.ok();
    let s = wait_status(&mut c, "m", "the suspend refused", LONG, |s| {
        s.last_error.contains("needs r570+")
    })
    .await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Awake, awake.pid));
    assert!(
        s.last_error
            .contains("suspend failed, the engine keeps running"),
        "{s:#?}"
    );
    chat(&endpoint(&s), "m").await;

    // A restore fails: the engine is restarted and the status says why.
    std::fs::write(&faults, "resume\n").unwrap();
    at(&ctl, &["suspend", "m"]).await.ok();
    suspended(&mut c).await;
    wake(&mut c, "m", false).await;
    let s = wait_status(&mut c, "m", "the failed restore", LONG, |s| {
        s.last_error.contains("resume failed")
    })
    .await;
    assert!(
        s.last_error.contains("CUDA_ERROR_OPERATING_SYSTEM"),
        "{s:#?}"
    );
    let s = wait_status(&mut c, "m", "a new engine", LONG, |s| {
        state(s) == pb::ModelState::Awake && s.pid != awake.pid
    })
    .await;
    assert_eq!(s.restarts, 2);
    chat(&endpoint(&s), "m").await;
}

/// `/proc/PID/environ` and `/proc/PID/cmdline` as one string each.
fn proc_text(pid: u32, what: &str) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/{what}")).unwrap_or_default();
    String::from_utf8_lossy(&raw).replace('\0', " ")
}

#[tokio::test]
async fn a_tensor_parallel_engine_is_suspended_only_when_started_sharing_no_gpu_memory() {
    // Real vLLM TP=2 on two H200s: an engine whose processes share device memory (CUDA IPC
    // through NCCL P2P/cuMem and the custom all-reduce) is checkpointed but never restored
    // (CUDA_ERROR_NOT_SUPPORTED). A suspend tier makes siesta start it without sharing; a
    // suspend asked of one started with sharing is refused before anything is frozen.
    let model = |name: &str, idle: &str| {
        format!(
            r#"
[[model]]
name = "{name}"
model = "fake/{name}"
executable = "@FAKE_VLLM@"
gpus = 2
gpu_memory = 0.2
preload = "awake"
env = {{ SIESTA_TEST_TAG = "@DIR@" }}
{idle}
"#
        )
    };
    let gpus = "[[gpu]]\nindex = 0\nname = \"test-gpu\"\nmemory = \"80GiB\"\n\
                [[gpu]]\nindex = 1\nname = \"test-gpu\"\nmemory = \"80GiB\"\n";
    let cfg = suspend_config("").replace(
        "[[model]]",
        &format!(
            "{gpus}{}{}\n[[model]]",
            model("shared", ""),
            model(
                "split",
                r#"idle = [ { after = "1h", action = "suspend" } ]"#
            )
        ),
    );
    let ctl = start(&cfg).await;
    let mut c = ctl.client().await;
    let shared = wait_state(&mut c, "shared", pb::ModelState::Awake, LONG).await;
    let split = wait_state(&mut c, "split", pb::ModelState::Awake, LONG).await;

    let env = proc_text(split.pid, "environ");
    let argv = proc_text(split.pid, "cmdline");
    for var in [
        "NCCL_P2P_DISABLE=1",
        "NCCL_CUMEM_ENABLE=0",
        "VLLM_ALLREDUCE_USE_SYMM_MEM=0",
    ] {
        assert!(
            env.contains(var),
            "{var} missing from split's environment: {env}"
        );
    }
    assert!(argv.contains("--tensor-parallel-size 2 "), "{argv}");
    assert!(argv.contains("--disable-custom-all-reduce"), "{argv}");
    let env = proc_text(shared.pid, "environ");
    assert!(!env.contains("NCCL_CUMEM_ENABLE"), "{env}");

    let refused = at(&ctl, &["suspend", "shared"]).await;
    assert_ne!(refused.code, 0, "{refused:#?}");
    assert!(
        refused.stderr.contains("sharing GPU memory")
            && refused.stderr.contains("action = \"suspend\""),
        "{refused:#?}"
    );
    let s = status(&mut c, "shared").await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Awake, shared.pid));
    assert!(
        group(s.pid).iter().all(|(_, st)| *st != 'T'),
        "nothing frozen"
    );

    // The one started without sharing: every process (API server, engine core, both
    // workers) is checkpointed, then restored.
    at(&ctl, &["suspend", "split"]).await.ok();
    let s = wait_state(&mut c, "split", pb::ModelState::Suspended, LONG).await;
    let procs = group(s.pid);
    assert!(
        procs.len() >= 4,
        "API server, engine core, 2 workers: {procs:?}"
    );
    assert!(procs.iter().all(|(_, st)| *st == 'T'), "{procs:?}");
    at(&ctl, &["wake", "split", "--wait"]).await.ok();
    let s = status(&mut c, "split").await;
    assert_eq!((state(&s), s.pid), (pb::ModelState::Awake, split.pid));
    chat(&endpoint(&s), "split").await;
}

#[tokio::test]
async fn suspends_amid_a_stream_of_requests_never_reach_the_frozen_engine() {
    // The stand-in kills an engine that anything reached while it was frozen and fails
    // its restore (as a real engine core dies), so one request slipping past the proxy's
    // fence shows as a restart. Two clients send requests one after another (with a
    // short pause, so the engine has idle moments to be suspended in) while the operator
    // suspends the model four times (each is checkpointed and resumed, or called off by a
    // request held while proxies confirm); every request must be answered.
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let ctl = start(&suspend_config("")).await;
    let mut c = ctl.client().await;
    let awake = wait_state(&mut c, "m", pb::ModelState::Awake, LONG).await;
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..2)
        .map(|_| {
            let (url, stop) = (proxy.url(), stop.clone());
            tokio::spawn(async move {
                let mut answered = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    try_chat(&url, "m", 4, LONG)
                        .await
                        .expect("every request answered");
                    answered += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                answered
            })
        })
        .collect();
    let samples = |s: &pb::ModelStatus| s.calibration.as_ref().map_or(0, |k| k.suspend_samples);
    for round in 0..4 {
        let before = status(&mut c, "m").await;
        at(&ctl, &["suspend", "m"]).await;
        // Suspended and resumed by the next request, or called off by a request that
        // arrived while the proxy's fence was being confirmed: awake again either way.
        let s = wait_status(&mut c, "m", "awake after the suspend", LONG, |s| {
            state(s) == pb::ModelState::Awake && s.state_since_unix_ms > before.state_since_unix_ms
        })
        .await;
        assert_eq!(
            (s.pid, s.restarts),
            (awake.pid, 1),
            "round {round}: the engine was restarted: {s:#?}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let mut answered = 0;
    for client in clients {
        answered += client.await.expect("client task");
    }
    let s = status(&mut c, "m").await;
    eprintln!(
        "{} of 4 suspends checkpointed, the others called off",
        samples(&s)
    );
    assert!(answered > 8, "{answered} requests answered");
    assert_eq!((s.pid, s.restarts), (awake.pid, 1), "{s:#?}");
}

#[tokio::test]
async fn a_suspend_waits_until_every_proxy_has_stopped_forwarding() {
    // A proxy that has not applied the suspending state could still forward a request to
    // the engine once it is checkpointed. Freeze the proxy (SIGSTOP) so it cannot: the
    // engine must stay un-checkpointed, `suspending`, until the proxy is back and says so.
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let ctl = start(&suspend_config("")).await;
    let mut c = ctl.client().await;
    let awake = wait_state(&mut c, "m", pb::ModelState::Awake, LONG).await;
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    try_chat(&proxy.url(), "m", 4, LONG).await.expect("served");
    // Control has heard from this proxy (its activity report).
    wait_status(&mut c, "m", "the proxy's report", LONG, |s| {
        s.last_activity_unix_ms > 0
    })
    .await;

    let proxy_pid = Pid::from_raw(proxy.child.pid() as i32);
    kill(proxy_pid, Signal::SIGSTOP).expect("SIGSTOP the proxy");
    c.suspend(pb::ModelRequest { name: "m".into() })
        .await
        .expect("suspend accepted");
    wait_state(&mut c, "m", pb::ModelState::Suspending, LONG).await;
    // Absence can only be sampled (deliberate): a second with the proxy frozen, and the
    // engine is still running, not checkpointed.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s = status(&mut c, "m").await;
    let frozen_engine = group(awake.pid).iter().any(|(_, st)| *st == 'T');
    kill(proxy_pid, Signal::SIGCONT).expect("SIGCONT the proxy");
    assert_eq!(state(&s), pb::ModelState::Suspending, "{s:#?}");
    assert!(
        !frozen_engine,
        "checkpointed while a proxy had not confirmed"
    );

    // The proxy is back, confirms, and the suspend goes through; a request resumes it.
    suspended(&mut c).await;
    try_chat(&proxy.url(), "m", 4, LONG)
        .await
        .expect("answered after the resume");
    let s = status(&mut c, "m").await;
    assert_eq!((s.pid, s.restarts), (awake.pid, 1), "{s:#?}");
}

#[tokio::test]
async fn a_request_while_a_suspend_waits_for_the_proxies_calls_it_off() {
    // Proxy `a` is frozen, so the suspend waits for it; a request through proxy `b` is
    // held meanwhile and calls the suspend off before anything is checkpointed (cheaper
    // than a checkpoint and a restore), with no error in the status.
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let ctl = start(&suspend_config("")).await;
    let mut c = ctl.client().await;
    let awake = wait_state(&mut c, "m", pb::ModelState::Awake, LONG).await;
    let a = spawn_proxy(&[ctl.url()], &[]).await;
    let b = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&a).await;
    proxy_ready(&b).await;
    try_chat(&a.url(), "m", 4, LONG).await.expect("served");
    wait_status(&mut c, "m", "proxy a's report", LONG, |s| {
        s.last_activity_unix_ms > 0
    })
    .await;

    let a_pid = Pid::from_raw(a.child.pid() as i32);
    kill(a_pid, Signal::SIGSTOP).expect("SIGSTOP proxy a");
    c.suspend(pb::ModelRequest { name: "m".into() })
        .await
        .expect("suspend accepted");
    wait_state(&mut c, "m", pb::ModelState::Suspending, LONG).await;
    // Sent once `b` has the event too: before it, `b` still routes to the
    // awake engine (and the suspend waits for that request to end).
    proxy_sees(&b, "m", "suspending").await;
    let answered = try_chat(&b.url(), "m", 4, LONG).await;
    let s = status(&mut c, "m").await;
    let frozen_engine = group(awake.pid).iter().any(|(_, st)| *st == 'T');
    kill(a_pid, Signal::SIGCONT).expect("SIGCONT proxy a");
    answered.expect("the held request answered");
    assert_eq!(
        (state(&s), s.pid, s.restarts),
        (pb::ModelState::Awake, awake.pid, 1),
        "{s:#?}"
    );
    assert!(!frozen_engine);
    assert!(s.last_error.is_empty(), "{s:#?}");
    let cal = s.calibration.expect("calibration");
    assert_eq!(cal.suspend_samples, 0, "no checkpoint was made: {cal:?}");
}

#[tokio::test]
async fn an_operators_wake_while_a_suspend_waits_for_the_proxies_calls_it_off() {
    // As a held request does (above), `siesta wake` while the suspend waits for a frozen
    // proxy's fence calls the suspend off before anything is checkpointed. Before, the
    // suspend went on (a checkpoint once the proxy was back, then a restore) for an
    // engine that was still awake.
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let ctl = start(&suspend_config("")).await;
    let mut c = ctl.client().await;
    let awake = wait_state(&mut c, "m", pb::ModelState::Awake, LONG).await;
    let a = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&a).await;
    try_chat(&a.url(), "m", 4, LONG).await.expect("served");
    wait_status(&mut c, "m", "the proxy's report", LONG, |s| {
        s.last_activity_unix_ms > 0
    })
    .await;

    let a_pid = Pid::from_raw(a.child.pid() as i32);
    kill(a_pid, Signal::SIGSTOP).expect("SIGSTOP the proxy");
    c.suspend(pb::ModelRequest { name: "m".into() })
        .await
        .expect("suspend accepted");
    wait_state(&mut c, "m", pb::ModelState::Suspending, LONG).await;
    c.wake(pb::WakeRequest {
        name: "m".into(),
        wait: false,
        timeout_ms: 0,
    })
    .await
    .expect("wake accepted");
    let s = wait_state(&mut c, "m", pb::ModelState::Awake, LONG).await;
    let frozen_engine = group(awake.pid).iter().any(|(_, st)| *st == 'T');
    kill(a_pid, Signal::SIGCONT).expect("SIGCONT the proxy");
    assert_eq!((s.pid, s.restarts), (awake.pid, 1), "{s:#?}");
    assert!(!frozen_engine);
    // Not a suspend that failed on the fence's timeout: one called off.
    assert!(s.last_error.is_empty(), "{s:#?}");
    let cal = s.calibration.expect("calibration");
    assert_eq!(cal.suspend_samples, 0, "no checkpoint was made: {cal:?}");
    // And it stays awake once the proxy is back (no suspend resumed behind it).
    try_chat(&a.url(), "m", 4, LONG).await.expect("served");
    let s = status(&mut c, "m").await;
    assert_eq!(
        (state(&s), s.pid, s.restarts),
        (pb::ModelState::Awake, awake.pid, 1),
        "{s:#?}"
    );
}
