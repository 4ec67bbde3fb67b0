//! The view over a configured inventory: saved P2P results drive placement,
//! the `[control] p2p_probe*` keys, and a probe that cannot run.

use super::*;
use crate::gpu::p2p::P2pHealth;
use crate::gpu::p2p::persist;

/// Three 80 GiB GPUs by hand, a TP=2 model pinned to 0+1 and one to 1+2.
fn config(dir: &std::path::Path, control_extra: &str) -> Config {
    let text = format!(
        r#"
[control]
state_dir = "{}"
{control_extra}

[[gpu]]
index = 0
memory = "80GiB"
[[gpu]]
index = 1
memory = "80GiB"
[[gpu]]
index = 2
memory = "80GiB"

[[model]]
name = "tp01"
model = "m"
executable = "vllm"
gpus = 2
gpu_ids = [0, 1]
gpu_memory = 0.4

[[model]]
name = "tp12"
model = "m"
executable = "vllm"
gpus = 2
gpu_ids = [1, 2]
gpu_memory = 0.4
"#,
        dir.display()
    );
    Config::parse(&text, "test.toml").unwrap()
}

fn save(dir: &std::path::Path, bad: &[(u32, u32, P2pHealth)]) {
    let mut results = Vec::new();
    for s in 0..3 {
        for d in 0..3 {
            if s != d {
                let h = bad
                    .iter()
                    .find(|b| (b.0, b.1) == (s, d))
                    .map_or(P2pHealth::Ok, |b| b.2);
                results.push(crate::gpu::p2p::P2pResult::missing(s, d, h, ""));
            }
        }
    }
    let saved = persist::SavedProbe {
        probed_unix_ms: 1234,
        gpu_uuids: Vec::new(),
        results,
    };
    persist::save(&persist::path_in(dir), &saved).unwrap();
}

#[test]
fn p2p_probe_keys_parse_with_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), "");
    assert_eq!(c.control.p2p_probe, P2pProbeConfig::default());
    assert!(c.control.p2p_probe.at_start);
    assert_eq!(c.control.p2p_probe.bytes, 256 << 20);
    assert_eq!(c.control.p2p_probe.timeout, Duration::from_secs(120));
    let c = config(
        dir.path(),
        "p2p_probe = \"off\"\np2p_probe_bytes = \"64MiB\"\np2p_probe_timeout = \"30s\"",
    );
    assert!(!c.control.p2p_probe.at_start);
    assert_eq!(c.control.p2p_probe.bytes, 64 << 20);
    assert_eq!(c.control.p2p_probe.timeout, Duration::from_secs(30));
    let bad = "[control]\np2p_probe = \"sometimes\"\np2p_probe_timeout = \"0s\"\n";
    let e = Config::parse(bad, "bad.toml").unwrap_err().to_string();
    assert!(
        e.contains("bad.toml: control.p2p_probe: \"sometimes\" is not \"start\" or \"off\""),
        "{e}"
    );
    assert!(
        e.contains("control.p2p_probe_timeout: must be more than 0"),
        "{e}"
    );
}

#[test]
fn saved_results_decide_p2p_at_start() {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), &[(0, 1, P2pHealth::Corrupt)]);
    let view = GpuView::detect(&config(dir.path(), "p2p_probe = \"off\""), &BTreeMap::new());
    let placed = view.placed();
    assert!(placed["tp01"].p2p_disabled, "0→1 is corrupt");
    assert!(!placed["tp12"].p2p_disabled, "1↔2 is ok");
    let gpus = view.list_gpus(&[]);
    assert_eq!(gpus.source, InventorySource::Config);
    let wire = crate::api::convert::gpu_list(&gpus);
    assert_eq!((wire.source.as_str(), wire.p2p.len()), ("config", 6));
    assert_eq!(gpus.p2p.len(), 6);
    assert_eq!(gpus.p2p_probed_unix_ms, 1234);
    assert_eq!(
        view.placed_one("tp01").map(|p| p.gpus),
        Some(vec![0, 1]),
        "placed_one agrees with placed"
    );
    let p = crate::api::convert::placement(&view.placement(&[]));
    let tp01 = p.models.iter().find(|m| m.model == "tp01").unwrap();
    assert_eq!(
        (tp01.gpus.clone(), tp01.gpu_memory_utilization),
        (vec![0, 1], 0.4)
    );
    assert_eq!(
        tp01.awake_bytes_per_gpu,
        ((80u64 << 30) as f64 * 0.4) as u64
    );
    assert_eq!(tp01.asleep_residual_bytes, default_residual(2));
    assert!(
        tp01.reason.contains("GPU 0→1 is corrupt"),
        "{}",
        tp01.reason
    );
}

#[test]
fn without_results_tp_groups_run_with_p2p_off() {
    let dir = tempfile::tempdir().unwrap();
    let view = GpuView::detect(&config(dir.path(), "p2p_probe = \"off\""), &BTreeMap::new());
    assert!(view.placed().values().all(|p| p.p2p_disabled));
    assert_eq!(view.list_gpus(&[]).p2p_probed_unix_ms, 0);
}

#[test]
fn an_unreadable_file_or_a_failed_start_probe_is_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(persist::path_in(dir.path()), "{ not json").unwrap();
    let view = GpuView::detect(&config(dir.path(), "p2p_probe = \"off\""), &BTreeMap::new());
    assert!(view.list_gpus(&[]).p2p.is_empty());
    // p2p_probe = "start" where no probe can run (no binary next to the
    // test executable, or no CUDA): the saved results stay.
    save(dir.path(), &[(1, 2, P2pHealth::Hung)]);
    let view = GpuView::detect(
        &config(
            dir.path(),
            "p2p_probe = \"start\"\np2p_probe_timeout = \"20s\"",
        ),
        &BTreeMap::new(),
    );
    let placed = view.placed();
    assert!(!placed["tp01"].p2p_disabled);
    assert!(placed["tp12"].p2p_disabled);
    assert_eq!(view.list_gpus(&[]).p2p_probed_unix_ms, 1234);
}

/// Two GPUs whose saved verdict says 0→1 is corrupt, probed at 1234, with
/// no probe at start.
async fn probed_corrupt_0_1(dir: &std::path::Path) -> GpuView {
    save(dir, &[(0, 1, P2pHealth::Corrupt)]);
    let cfg = config(dir, "p2p_probe = \"off\"");
    tokio::task::spawn_blocking(move || GpuView::detect(&cfg, &BTreeMap::new()))
        .await
        .unwrap()
}

#[tokio::test]
async fn diag_p2p_without_a_probe_says_why_and_keeps_results() {
    let dir = tempfile::tempdir().unwrap();
    let view = probed_corrupt_0_1(dir.path()).await;
    let r = view.diag_p2p(0, Duration::from_secs(20), 99).await;
    assert!(r.message.contains("P2P not probed"), "{}", r.message);
    assert!(r.failed, "two GPUs and no probe run: failed");
    assert!(r.results.is_empty());
    assert_eq!(view.list_gpus(&[]).p2p_probed_unix_ms, 1234);
    assert!(view.placed()["tp01"].p2p_disabled);
}

/// A second probe used to wait for the first, up to its deadline, before
/// its own began: the CLI gave up first and called the daemon unreachable.
/// It is refused at once, saying why.
#[tokio::test]
async fn a_probe_asked_for_while_one_runs_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let view = probed_corrupt_0_1(dir.path()).await;
    let running = view.probing.lock().await;
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        view.diag_p2p(0, Duration::from_secs(600), 99),
    )
    .await
    .expect("refused at once, not after the running probe");
    assert!(r.failed);
    assert!(r.message.contains("already running"), "{}", r.message);
    assert_eq!(view.list_gpus(&[]).p2p_probed_unix_ms, 1234);
    drop(running);
    let r = view.diag_p2p(0, Duration::from_secs(20), 99).await;
    assert!(!r.message.contains("already running"), "{}", r.message);
}

#[test]
fn a_new_verdict_reaches_the_next_start_without_moving_models() {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), &[]);
    let view = GpuView::detect(&config(dir.path(), "p2p_probe = \"off\""), &BTreeMap::new());
    assert!(!view.placed()["tp01"].p2p_disabled);
    let mut results: Vec<_> = view.state.lock().unwrap().p2p.results().cloned().collect();
    results
        .iter_mut()
        .filter(|r| (r.src, r.dst) == (1, 0))
        .for_each(|r| r.health = P2pHealth::Unsupported);
    view.keep(&results, 5678, false);
    let placed = view.placed();
    assert!(placed["tp01"].p2p_disabled);
    assert_eq!(placed["tp01"].gpus, vec![0, 1]);
    assert!(!placed["tp12"].p2p_disabled);
    // Saved for the next start.
    let saved = persist::load(&persist::path_in(dir.path()))
        .unwrap()
        .unwrap();
    assert_eq!(saved.probed_unix_ms, 5678);
    let again = GpuView::detect(&config(dir.path(), "p2p_probe = \"off\""), &BTreeMap::new());
    assert!(again.placed()["tp01"].p2p_disabled);
}

#[tokio::test]
async fn admission_hands_the_current_p2p_switch_to_the_next_start() {
    use crate::admission::{Admission, AdmissionPolicy};
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), &[]);
    let view = std::sync::Arc::new(GpuView::detect(
        &config(dir.path(), "p2p_probe = \"off\""),
        &BTreeMap::new(),
    ));
    let admission = Admission::start(
        view.clone(),
        crate::hub::Hub::new(crate::status::Clock::new(), 16, 16),
        crate::status::Clock::new(),
        AdmissionPolicy {
            min_awake: std::time::Duration::ZERO,
            yield_after: None,
        },
        tokio_util::sync::CancellationToken::new(),
    );
    assert_eq!(admission.p2p_disabled("tp01", &[0, 1]), Some(false));
    let mut results: Vec<_> = view.state.lock().unwrap().p2p.results().cloned().collect();
    results[0].health = P2pHealth::Corrupt;
    view.keep(&results, 1, false);
    assert_eq!(admission.p2p_disabled("tp01", &[0, 1]), Some(true));
    // Not what placement knows (a reload moved it; an unknown model): keep.
    assert_eq!(admission.p2p_disabled("tp01", &[1, 2]), None);
    assert_eq!(admission.p2p_disabled("nope", &[0, 1]), None);
    assert_eq!(Admission::open().p2p_disabled("tp01", &[0, 1]), None);
}

#[test]
fn an_engines_residual_is_the_memory_of_its_process_group_per_gpu() {
    use crate::gpu::{Inventory, InventorySource};
    // TP=2: the workers (pids 11, 12) are in the engine's group 10; 20 is
    // another engine.
    let inv = Inventory {
        source: InventorySource::Nvml,
        gpus: vec![
            gpu(0, &[(11, 2204 << 20), (20, 5 << 30)]),
            gpu(1, &[(12, 2204 << 20)]),
        ],
        note: None,
    };
    let group = |pid: u32| Some(if pid == 20 { 20 } else { 10 });
    let per_gpu = engine_bytes_per_gpu(&inv, 10, group);
    assert_eq!(per_gpu[&0], 2204 << 20);
    assert_eq!(per_gpu[&1], 2204 << 20);
    assert_eq!(
        engine_bytes_per_gpu(&inv, 30, group).values().sum::<u64>(),
        0
    );
}

#[test]
fn residuals_default_by_tensor_parallel_size_until_measured() {
    let dir = tempfile::tempdir().unwrap();
    let view = GpuView::detect(&config(dir.path(), "p2p_probe = \"off\""), &BTreeMap::new());
    let r = view.residual_of("tp01");
    assert_eq!(
        (r.bytes, r.measured),
        (5 << 29, false),
        "TP=2: 2.5 GiB per GPU"
    );
    let view = GpuView::detect(
        &config(
            dir.path(),
            "p2p_probe = \"off\"\nasleep_residual = \"3GiB\"",
        ),
        &BTreeMap::new(),
    );
    assert_eq!(view.residual_of("tp01").bytes, 3 << 30, "configured");
    // No NVML here: nothing to measure.
    assert_eq!(view.measure_residual("tp01", std::process::id()), None);
}

#[test]
fn an_engine_that_keeps_half_its_memory_asleep_does_not_really_sleep() {
    let awake = 40 << 30;
    let slept = residual_from(836 << 20, awake);
    assert!(slept.measured && !slept.ineffective);
    assert!(slept.warning().is_empty());
    // vLLM without --enable-sleep-mode: /sleep answers 200, frees nothing.
    let not = residual_from(39 << 30, awake);
    assert!(not.ineffective);
    assert!(not.warning().contains("39.0 GiB"), "{}", not.warning());
    // No placement share known: never claimed ineffective.
    assert!(!residual_from(39 << 30, 0).ineffective);
}

/// A reload's placement replaces the view's: an added model is placed on
/// its pinned GPU with its fraction and gets its own asleep residual; a
/// removed one leaves the placement.
#[test]
fn apply_replaces_placements_and_residuals() {
    let dir = tempfile::tempdir().unwrap();
    let old = config(dir.path(), "p2p_probe = \"off\"");
    let view = GpuView::detect(&old, &BTreeMap::new());
    if view.placement_failed() {
        eprintln!("skipped: the inventory is not the config's here");
        return;
    }
    assert!(view.placed_one("new").is_none());
    let mut new = old.clone();
    new.models.remove(1);
    let mut added = new.models[0].clone();
    (added.name, added.gpus, added.gpu_ids) = ("new".into(), 1, vec![2]);
    added.gpu_memory = Some(crate::config::GpuMemory::Fraction(0.3));
    new.models.push(added);
    let planned = view.plan(&new, &view.current_gpus()).unwrap();
    view.apply(&new, planned);
    let p = view.placed_one("new").expect("the added model is placed");
    assert_eq!((p.gpus, p.gpu_memory_utilization), (vec![2], 0.3));
    assert!(
        view.placed_one("tp12").is_none(),
        "removed from the placement"
    );
    assert_eq!(view.residual_of("new").bytes, default_residual(1));
    assert_ne!(default_residual(1), view.policy.residual_bytes);
}

#[test]
fn admission_sees_what_each_kind_costs_and_never_evicts_an_attached_openai_server() {
    use crate::config::{EngineKind, Launch};
    use crate::reconciler::{ModelState, Settings};
    use crate::status::{Clock, Endpoint, EngineFacts, model_status};
    let cfg = Config::demo(vec!["fake-vllm".into()]);
    let facts = EngineFacts {
        endpoint: Endpoint {
            url: "http://x".into(),
            served_model_name: "m".into(),
        },
        gpus: vec![0],
        p2p_disabled: false,
        control_id: "t".into(),
        waiting_for: String::new(),
        asleep_residual: Default::default(),
    };
    let now = tokio::time::Instant::now();
    let status = |kind: EngineKind, attach: bool| {
        let mut m = cfg.models[0].clone();
        m.name = format!("{kind}-{attach}");
        m.engine = kind;
        if attach {
            m.launch = Launch::Attach {
                url: "http://x".into(),
                served_model_name: "m".into(),
            };
        }
        let mut st = ModelState::new(Settings::from_config(&m), m.preload, now);
        st.calibration.start.add(std::time::Duration::from_secs(60));
        st.calibration
            .sleep_mut(1)
            .add(std::time::Duration::from_millis(100));
        st.calibration
            .wake_mut(1)
            .add(std::time::Duration::from_millis(200));
        model_status(&m, &facts, &st, &Clock::new(), now)
    };
    let models = [
        status(EngineKind::Vllm, false),
        status(EngineKind::Openai, false),
        status(EngineKind::Openai, true),
        status(EngineKind::Sglang, true),
    ];
    let rt = runtime(&models);
    // Evicting an openai server costs a start; a sleeping kind its sleep and wake.
    assert_eq!(rt["vllm-false"].switch_cost_ms, 300);
    assert_eq!(rt["openai-false"].switch_cost_ms, 60_000);
    // An attached server that cannot sleep cannot make room: never a victim.
    assert!(rt["openai-true"].pinned_awake);
    assert!(!rt["sglang-true"].pinned_awake && !rt["openai-false"].pinned_awake);
}

/// What placement counts for a failed model comes from its status: its
/// share while its killed processes are not yet gone (the status says what
/// it waits for), nothing once they are, and always for an attached engine.
#[test]
fn a_failed_model_counts_until_its_engine_is_gone_and_attached_always() {
    use crate::config::Launch;
    use crate::reconciler::{ModelState, Phase, Settings};
    use crate::status::{Clock, Endpoint, EngineFacts, model_status};
    let cfg = Config::demo(vec!["fake-vllm".into()]);
    let facts = EngineFacts {
        endpoint: Endpoint {
            url: "http://x".into(),
            served_model_name: "m".into(),
        },
        gpus: vec![0],
        p2p_disabled: false,
        control_id: "t".into(),
        waiting_for: String::new(),
        asleep_residual: Default::default(),
    };
    let now = tokio::time::Instant::now();
    let status = |name: &str, attach: bool, process_gone: bool| {
        let mut m = cfg.models[0].clone();
        m.name = name.into();
        if attach {
            m.launch = Launch::Attach {
                url: "http://x".into(),
                served_model_name: "m".into(),
            };
        }
        let mut st = ModelState::new(Settings::from_config(&m), m.preload, now);
        st.phase = Phase::Failed {
            retry_at: None,
            process_gone,
        };
        model_status(&m, &facts, &st, &Clock::new(), now)
    };
    let models = [
        status("exiting", false, false),
        status("gone", false, true),
        status("attached", true, false),
    ];
    let rt = runtime(&models);
    assert_eq!(rt["exiting"].state, RunState::Failed(FailedEngine::Exiting));
    assert_eq!(rt["gone"].state, RunState::Failed(FailedEngine::Gone));
    assert_eq!(
        rt["attached"].state,
        RunState::Failed(FailedEngine::Attached)
    );
    let why = models[0].waiting_for.as_deref().unwrap_or_default();
    assert!(why.contains("processes to exit"), "{why}");
    assert_eq!(models[1].waiting_for, None);
}

/// Two 80 GiB GPUs by hand, with `models`.
fn two_gpus(dir: &std::path::Path, models: &str) -> Config {
    let text = format!(
        "[control]\nstate_dir = \"{}\"\np2p_probe = \"off\"\n\
         [[gpu]]\nindex = 0\nmemory = \"80GiB\"\n[[gpu]]\nindex = 1\nmemory = \"80GiB\"\n{models}",
        dir.display()
    );
    Config::parse(&text, "test.toml").unwrap()
}

/// A restart after a reload removed `z` (pinned to GPU 0, exclusive): the
/// engine of `a` runs on GPU 1, as recorded. Start-up placement keeps it
/// there (afresh it would take GPU 0, and recovery would stop the engine
/// for a changed `CUDA_VISIBLE_DEVICES`).
#[test]
fn start_up_places_recorded_engines_where_they_run() {
    let dir = tempfile::tempdir().unwrap();
    let v2 = two_gpus(
        dir.path(),
        "[[model]]\nname = \"a\"\nmodel = \"m\"\ngpu_memory = 0.5\n",
    );
    let fresh = GpuView::detect(&v2, &BTreeMap::new());
    if fresh.list_gpus(&[]).source != InventorySource::Config {
        eprintln!("skipped: the inventory is not the config's here (NVML)");
        return;
    }
    assert_eq!(fresh.placed_one("a").unwrap().gpus, [0]);
    let recorded = BTreeMap::from([("a".to_string(), vec![1])]);
    let view = GpuView::detect(&v2, &recorded);
    assert_eq!(view.placed_one("a").unwrap().gpus, [1]);
    assert_eq!(view.current_gpus(), recorded);
    // A recorded set that no longer fits the model (now TP=2) is ignored.
    let tp = two_gpus(
        dir.path(),
        "[[model]]\nname = \"a\"\nmodel = \"m\"\ngpus = 2\n",
    );
    assert_eq!(
        GpuView::detect(&tp, &recorded)
            .placed_one("a")
            .unwrap()
            .gpus,
        [0, 1]
    );
}

/// What counts as held by processes siesta does not run: only processes
/// `whose` says are someone else's (not an engine's, not in its group, not
/// carrying its state directory, seen in this PID namespace), less what an
/// attached engine (no pid known) holds on that GPU, which the message says.
#[test]
fn foreign_memory_is_what_no_engine_of_siesta_holds() {
    use super::foreign::{Whose, foreign_use};
    use crate::gpu::{Inventory, InventorySource};
    // 10 and 11 are siesta's (an engine and its worker); 20 and 21 are
    // someone else's; 30 is not seen here.
    let inv = Inventory {
        source: InventorySource::Nvml,
        gpus: vec![
            gpu(0, &[(10, 36 << 30), (20, 1 << 30), (21, 20 << 30)]),
            gpu(1, &[(11, 36 << 30), (30, 40 << 30)]),
            gpu(2, &[(20, 30 << 30)]),
        ],
        note: None,
    };
    let whose = |pid: u32| match pid {
        10 | 11 => Whose::Siesta,
        20 | 21 => Whose::Other,
        _ => Whose::Unseen,
    };
    let attached = [(2, 36u64 << 30)].into_iter().collect();
    let f = foreign_use(&inv, &attached, whose);
    assert_eq!(f[&0].bytes, 21 << 30);
    assert_eq!(f[&0].processes, [(21, 20 << 30), (20, 1 << 30)]);
    assert_eq!(f[&0].describe(), "pid 21 (20.0 GiB), pid 20 (1.0 GiB)");
    assert!(!f.contains_key(&1), "{f:?}");
    // 30 GiB of unknown processes beside an attached engine of 36 GiB:
    // taken for the attached engine's.
    assert!(!f.contains_key(&2), "{f:?}");
    let attached = [(2, 10u64 << 30)].into_iter().collect();
    let f = foreign_use(&inv, &attached, whose);
    assert_eq!(f[&2].bytes, 20 << 30);
    assert_eq!(
        f[&2].describe(),
        "pid 20 (30.0 GiB) (less 10.0 GiB taken for engines whose pids siesta does not know)"
    );
}

/// Through the view: an engine's worker that left its group (`setsid`)
/// but carries the state directory siesta spawned it for and its running
/// engine's tag is siesta's; this
/// test's own process is someone else's. After a failed NVML read, the last
/// good read's processes that still live count (a holder does not vanish
/// from the plan because one read failed); one gone since does not.
#[test]
fn a_worker_that_left_its_group_is_siesta_and_a_failed_read_counts_who_still_lives() {
    use crate::gpu::{Inventory, InventorySource};
    let dir = tempfile::tempdir().unwrap();
    let cfg = two_gpus(dir.path(), "");
    let view = GpuView::detect(&cfg, &Default::default());
    let marker = crate::supervisor::state_marker(dir.path());
    use std::os::unix::process::CommandExt;
    // The engine (its leader carries its tag) and its worker, which left
    // the engine's group with the state directory and the same tag.
    let tag = "ctl/m/1/00aa";
    let leader = scopeguard_kill(
        std::process::Command::new("sleep")
            .arg("30")
            .env(crate::supervisor::TAG_ENV, tag)
            .spawn()
            .unwrap(),
    );
    wait_for_env(leader.id(), crate::supervisor::TAG_ENV, tag);
    let mut m = crate::status::test_status("m", 1);
    m.pid = Some(leader.id());
    let models = [m];
    let mut worker = std::process::Command::new("sleep")
        .arg("30")
        .env(crate::supervisor::STATE_ENV, &marker)
        .env(crate::supervisor::TAG_ENV, tag)
        .process_group(0)
        .spawn()
        .unwrap();
    wait_for_marker(worker.id(), &marker);
    let me = std::process::id();
    let stranger = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let mut stranger = scopeguard_kill(stranger);
    view.set_inventory(Inventory {
        source: InventorySource::Nvml,
        gpus: vec![gpu(
            0,
            &[
                (worker.id(), 30 << 30),
                (me, 5 << 30),
                (stranger.id(), 7 << 30),
            ],
        )],
        note: None,
    });
    let f = view.foreign(&models);
    worker.kill().unwrap();
    worker.wait().unwrap();
    assert_eq!(
        f[&0].processes,
        [(stranger.id(), 7 << 30), (me, 5 << 30)],
        "{f:?}"
    );
    // A failed read: the last good one stands for those still alive.
    view.state.lock().unwrap().read_failed = true;
    stranger.kill().unwrap();
    stranger.wait().unwrap();
    let f = view.foreign(&models);
    assert_eq!(f[&0].processes, [(me, 5 << 30)], "{f:?}");
}

/// A worker that left its engine's group and outlived the engine (the
/// sweep's SIGKILL did not end it: stuck in the driver) is left over: its
/// model has no engine any more, so what it holds counts as others'
/// memory; while the model has an engine, the same worker is siesta's.
/// The tag names the model (`CONTROL_ID/MODEL/GEN/NONCE`), also one whose
/// name holds a `/`, and a model named by a prefix of it is not the one.
#[test]
fn a_worker_left_over_by_an_ended_engine_counts_as_others() {
    use crate::gpu::{Inventory, InventorySource};
    let dir = tempfile::tempdir().unwrap();
    let cfg = two_gpus(dir.path(), "");
    let view = GpuView::detect(&cfg, &Default::default());
    let marker = crate::supervisor::state_marker(dir.path());
    use std::os::unix::process::CommandExt;
    let worker = std::process::Command::new("sleep")
        .arg("30")
        .env(crate::supervisor::STATE_ENV, &marker)
        .env(crate::supervisor::TAG_ENV, "ctl/org/m/3/00ab")
        .process_group(0)
        .spawn()
        .unwrap();
    let worker = scopeguard_kill(worker);
    wait_for_marker(worker.id(), &marker);
    view.set_inventory(Inventory {
        source: InventorySource::Nvml,
        gpus: vec![gpu(0, &[(worker.id(), 30 << 30)])],
        note: None,
    });
    // The engine it was spawned for runs (its leader carries the tag).
    let leader = scopeguard_kill(
        std::process::Command::new("sleep")
            .arg("30")
            .env(crate::supervisor::TAG_ENV, "ctl/org/m/3/00ab")
            .spawn()
            .unwrap(),
    );
    wait_for_env(leader.id(), crate::supervisor::TAG_ENV, "ctl/org/m/3/00ab");
    let mut m = crate::status::test_status("org/m", 3);
    let prefix = crate::status::test_status("org", 0);
    m.pid = Some(leader.id());
    let models = [prefix, m];
    assert!(
        view.foreign(&models).is_empty(),
        "its model's engine runs: siesta's"
    );
    // `siesta gpus` names its model (not `org`, a prefix of it).
    let owners = view.list_gpus(&models).owners;
    assert_eq!(owners.get(&worker.id()).map(String::as_str), Some("org/m"));
    // The model runs a newer engine: this one's worker is left over.
    let [prefix, mut m] = models;
    m.pid = Some(std::process::id());
    let f = view.foreign(&[prefix.clone(), m.clone()]);
    assert_eq!(f[&0].processes, [(worker.id(), 30 << 30)], "{f:?}");
    // No engine, or no such model any more: left over too.
    m.pid = None;
    let f = view.foreign(&[prefix.clone(), m]);
    assert_eq!(f[&0].processes, [(worker.id(), 30 << 30)], "{f:?}");
    let f = view.foreign(&[prefix]);
    assert_eq!(f[&0].processes, [(worker.id(), 30 << 30)], "{f:?}");
}

/// Which model an engine tag (`CONTROL_ID/MODEL/GEN/NONCE`) names: model
/// names and control ids may hold `/`.
#[test]
fn an_engine_tag_names_its_model_exactly() {
    let status = |control: &str, name: &str| {
        let mut m = crate::status::test_status(name, 0);
        m.control_id = control.into();
        m
    };
    let of = |tag: &str, m: &crate::status::ModelStatus| super::foreign::tag_of(tag, m);
    assert!(of("ctl/org/m/3/00ab", &status("ctl", "org/m")));
    assert!(!of("ctl/org/m/3/00ab", &status("ctl", "org")));
    assert!(!of("ctl/org/m/3/00ab", &status("ctl", "m")));
    assert!(of("ctl/m/3/3/00ab", &status("ctl", "m/3")));
    assert!(!of("ctl/m/3/3/00ab", &status("ctl", "m")));
    // (Every model of one control plane has its control id: "a" + "b/m"
    // and "a/b" + "m" never meet.)
    assert!(of("a/b/m/1/ff", &status("a/b", "m")));
    assert!(!of("a/b/m/1/ff", &status("a/b", "b/m")));
    assert!(!of("other/m/1/ff", &status("ctl", "m")));
    assert!(!of("", &status("ctl", "m")));
}

/// A spawned engine awake on GPU 0 whose processes NVML lists under pids
/// that are not its own (an `executable` that runs it in a container):
/// what placement counts for it is taken off those unknown processes, not
/// counted a second time as others' memory. Once NVML lists one of its
/// processes, the rest are others' again.
#[test]
fn an_engine_whose_processes_nvml_shows_under_other_pids_is_not_counted_twice() {
    use crate::gpu::{Inventory, InventorySource};
    let dir = tempfile::tempdir().unwrap();
    let cfg = two_gpus(
        dir.path(),
        "[[model]]\nname = \"a\"\nmodel = \"m\"\ngpu_memory = 0.5\ngpu_ids = [0]\n",
    );
    let view = GpuView::detect(&cfg, &Default::default());
    let name = "a";
    let mut m = crate::status::test_status(name, 1);
    m.state = crate::status::State::Awake;
    let stranger = scopeguard_kill(
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap(),
    );
    // The engine's own pid: this test's process (alive, in its own group).
    let engine = std::process::id();
    m.pid = Some(engine + 1_000_000);
    view.set_inventory(Inventory {
        source: InventorySource::Nvml,
        gpus: vec![gpu(0, &[(stranger.id(), 70 << 30)]), gpu(1, &[])],
        note: None,
    });
    let f = view.foreign(std::slice::from_ref(&m));
    let budget = view.placement(std::slice::from_ref(&m)).gpus[0].awake_bytes;
    assert!(budget > 0, "{name} takes room on GPU 0");
    assert_eq!(f[&0].bytes, (70 << 30) - budget, "{f:?}");
    assert_eq!(f[&0].attached_bytes, budget);
    // Listed as its own: the stranger's memory is all others'.
    m.pid = Some(engine);
    view.set_inventory(Inventory {
        source: InventorySource::Nvml,
        gpus: vec![
            gpu(0, &[(stranger.id(), 70 << 30), (engine, 1 << 30)]),
            gpu(1, &[]),
        ],
        note: None,
    });
    let f = view.foreign(std::slice::from_ref(&m));
    assert_eq!(f[&0].bytes, 70 << 30, "{f:?}");
}

/// Waits (up to 10 s) until `pid`'s environment in `/proc` shows the state
/// directory marker: a child's shows a moment after its spawn returns.
fn wait_for_marker(pid: u32, marker: &str) {
    wait_for_env(pid, crate::supervisor::STATE_ENV, marker);
}

/// Waits (up to 10 s) until `pid`'s environment in `/proc` holds `key=value`.
fn wait_for_env(pid: u32, key: &str, value: &str) {
    let started = std::time::Instant::now();
    while crate::supervisor::procfs::carries_env(pid, key, value) != Some(true) {
        assert!(started.elapsed() < Duration::from_secs(10), "no {key}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Kills the child when dropped (a failed assertion too).
fn scopeguard_kill(
    child: std::process::Child,
) -> impl std::ops::DerefMut<Target = std::process::Child> {
    struct Guard(std::process::Child);
    impl std::ops::Deref for Guard {
        type Target = std::process::Child;
        fn deref(&self) -> &Self::Target {
            &self.0
        }
    }
    impl std::ops::DerefMut for Guard {
        fn deref_mut(&mut self) -> &mut Self::Target {
            &mut self.0
        }
    }
    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    Guard(child)
}

/// An 80 GiB GPU as NVML shows it, with (pid, bytes) processes on it.
fn gpu(index: u32, procs: &[(u32, u64)]) -> crate::gpu::GpuInfo {
    let mut g = crate::gpu::GpuInfo::from_spec(&crate::gpu::GpuSpec {
        index,
        name: "g".into(),
        memory_bytes: 80 << 30,
    });
    g.processes = procs
        .iter()
        .map(|&(pid, used_bytes)| crate::gpu::GpuProcessInfo { pid, used_bytes })
        .collect();
    g
}

/// An NVML call that never returns (a GPU off the bus) held up every
/// caller of the view behind it: admission, `ListGpus`, the status page.
/// Now the first caller waits [`NVML_ANSWER_WAIT`] and goes on with the
/// last good read, marked so; later ones do not wait at all while that
/// read is out; a residual is not measured on the old read; and once NVML
/// answers, the next read is fresh again.
#[test]
fn an_nvml_that_stops_answering_holds_up_no_caller() {
    use std::sync::mpsc;
    let dir = tempfile::tempdir().unwrap();
    let cfg = two_gpus(dir.path(), "");
    let view = std::sync::Arc::new(GpuView::detect(&cfg, &Default::default()));
    let me = std::process::id();
    let nvml = std::sync::Arc::new(Mutex::new(vec![gpu(0, &[(me, 5 << 30)])]));
    view.script_nvml(nvml.clone());
    view.age_reads(INVENTORY_MAX_AGE);
    let l = view.list_gpus(&[]);
    assert_eq!(l.gpus[0].processes.len(), 1, "{l:?}");
    assert_eq!(view.nvml_silent_for(), None);

    // NVML hangs: the scripted read blocks on the list's lock.
    let hang = nvml.lock().unwrap();
    view.age_reads(INVENTORY_MAX_AGE);
    let (tx, rx) = mpsc::channel();
    let v = view.clone();
    std::thread::spawn(move || {
        let t = Instant::now();
        let l = v.list_gpus(&[]);
        tx.send((t.elapsed(), l)).unwrap();
    });
    let (waited, l) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("ListGpus waited on a hung NVML read");
    assert!(waited >= NVML_ANSWER_WAIT, "{waited:?}");
    let note = l.note.clone().unwrap_or_default();
    assert!(note.contains("NVML has not answered for"), "{note}");
    assert_eq!(l.gpus[0].processes.len(), 1, "the last good read: {l:?}");
    assert!(view.nvml_silent_for().is_some());
    // The read is still out: no caller waits for it again.
    let t = Instant::now();
    assert_eq!(view.measure_residual("tp01", me), None);
    assert_eq!(view.engine_cuda_processes(me), None);
    view.age_reads(INVENTORY_MAX_AGE);
    let f = view.foreign(&[]);
    assert!(
        t.elapsed() < NVML_ANSWER_WAIT,
        "waited again: {:?}",
        t.elapsed()
    );
    // What others held at the last good read still counts.
    assert_eq!(f[&0].processes, [(me, 5 << 30)], "{f:?}");

    // NVML answers again: the next read is fresh.
    let mut hang = hang;
    *hang = vec![gpu(0, &[])];
    drop(hang);
    let deadline = Instant::now() + Duration::from_secs(60);
    while view.nvml_silent_for().is_some() {
        assert!(Instant::now() < deadline, "NVML's answer never taken");
        std::thread::sleep(Duration::from_millis(20));
        view.age_reads(INVENTORY_MAX_AGE);
        view.list_gpus(&[]);
    }
    let l = view.list_gpus(&[]);
    assert!(l.gpus[0].processes.is_empty(), "{l:?}");
    assert_eq!(l.note, None);
}

/// The placement report counts a model whose start or wake waits for room
/// as holding what its engine holds now (nothing, or its asleep residual),
/// as admission does, not its full share: an 80 GiB GPU read 96 GiB awake
/// with `b` (0.6, never admitted) waiting beside a pinned `a` (0.6).
#[test]
fn a_model_waiting_for_room_is_not_counted_awake_in_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = two_gpus(
        dir.path(),
        "[[model]]\nname = \"a\"\nmodel = \"m\"\ngpu_memory = 0.6\ngpu_ids = [0]\n\
         [[model]]\nname = \"b\"\nmodel = \"m\"\ngpu_memory = 0.6\ngpu_ids = [0]\n",
    );
    let view = GpuView::detect(&cfg, &Default::default());
    let mut a = crate::status::test_status("a", 1);
    a.state = State::Awake;
    let mut b = crate::status::test_status("b", 1);
    b.state = State::Starting;
    b.awaiting_room = true;
    let awake = |models: &[ModelStatus]| view.placement_of(models).gpus[0].awake_bytes;
    let a_alone = awake(std::slice::from_ref(&a));
    assert!(a_alone > 0 && a_alone <= 80 << 30, "{a_alone}");
    assert_eq!(awake(&[a.clone(), b.clone()]), a_alone, "b is not admitted");
    // Waking from asleep, not admitted: what it keeps asleep, not awake.
    b.state = State::Waking;
    let report = view.placement_of(&[a.clone(), b.clone()]);
    assert_eq!(report.gpus[0].awake_bytes, a_alone);
    assert!(report.gpus[0].asleep_bytes > 0, "{:?}", report.gpus[0]);
    // Admitted: its full share.
    b.awaiting_room = false;
    assert!(awake(&[a, b]) > a_alone);
}
