//! Reload as a diff on a `[[gpu]]` inventory, with the real binaries: an
//! added model gets its real placement (its pinned GPU and memory
//! fraction), a model whose only change is idle tiers or aliases keeps its
//! engine, and a reload that fails (a bad key, a model that can never fit)
//! changes nothing and names the file and key. Where NVML is present the
//! inventory is the real one and these tests skip.

use nix::sys::signal::Signal;
use siesta_proto::v1 as pb;
use siesta_tests::DEADLINE;
use siesta_tests::ctl::*;

/// Two GPUs of 80 GiB, the P2P probe off, and `models`.
fn gpu_config(models: &str) -> String {
    let base = config(models).replace(
        "state_dir = \"@DIR@/state\"",
        "state_dir = \"@DIR@/state\"\np2p_probe = \"off\"",
    );
    let gpus: String = (0..2)
        .map(|i| format!("[[gpu]]\nindex = {i}\nname = \"test-gpu\"\nmemory = \"80GiB\"\n"))
        .collect();
    format!("{base}\n{gpus}")
}

fn gpu_model(name: &str, extra: &str) -> String {
    format!(
        r#"
[[model]]
name = "{name}"
model = "fake/{name}"
executable = "@FAKE_VLLM@"
preload = "awake"
env = {{ SIESTA_TEST_TAG = "@DIR@" }}
{extra}
"#
    )
}

/// The NUL-separated entries of /proc/PID/{cmdline,environ}.
fn proc_list(pid: u32, what: &str) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/{what}")).unwrap_or_default();
    raw.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

fn write_config(ctl: &Ctl, text: &str) {
    let text = text
        .replace("@DIR@", &ctl.dir.path().display().to_string())
        .replace("@FAKE_VLLM@", &siesta_tests::fake_vllm_command());
    std::fs::write(&ctl.config_path, text).unwrap();
}

async fn names(c: &mut Client) -> Vec<String> {
    let mut v: Vec<String> = c
        .list_models(pb::ListModelsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .models
        .into_iter()
        .map(|m| m.name)
        .collect();
    v.sort();
    v
}

async fn pids(c: &mut Client, models: &[&str]) -> Vec<u32> {
    let mut v = Vec::new();
    for m in models {
        v.push(status(c, m).await.pid);
    }
    v
}

#[tokio::test]
async fn reload_places_added_models_keeps_engines_on_settings_changes_and_refuses_atomically() {
    let a = gpu_model("a", "gpus = 1\ngpu_ids = [0]\ngpu_memory = 0.5");
    let ctl = start(&gpu_config(&a)).await;
    let mut c = ctl.client().await;
    let gpus = c
        .list_gpus(pb::ListGpusRequest {})
        .await
        .unwrap()
        .into_inner();
    if gpus.source != "config" {
        eprintln!(
            "skipped: GPUs come from {} here, not the config",
            gpus.source
        );
        return;
    }
    let a_pid = wait_state(&mut c, "a", pb::ModelState::Awake, LONG)
        .await
        .pid;

    // Added, pinned to GPU 1, 24 GiB of 80: its engine runs on GPU 1 with
    // --gpu-memory-utilization 0.3 (placement's answer, not GPU 0 and not
    // vLLM's default).
    let b = gpu_model("b", "gpus = 1\ngpu_ids = [1]\ngpu_memory = \"24GiB\"");
    write_config(&ctl, &gpu_config(&format!("{a}{b}")));
    let r = c.reload(pb::ReloadRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (r.added, r.unchanged),
        (vec!["b".to_string()], vec!["a".to_string()])
    );
    let s = wait_state(&mut c, "b", pb::ModelState::Awake, LONG).await;
    assert_eq!(s.gpus, vec![1]);
    let env = proc_list(s.pid, "environ");
    assert!(
        env.contains(&"CUDA_VISIBLE_DEVICES=1".to_string()),
        "{env:?}"
    );
    let argv = proc_list(s.pid, "cmdline");
    let at = argv
        .iter()
        .position(|a| a == "--gpu-memory-utilization")
        .unwrap_or_else(|| panic!("no --gpu-memory-utilization: {argv:?}"));
    assert_eq!(argv[at + 1], "0.3", "{argv:?}");
    let p = c
        .get_placement(pb::GetPlacementRequest {})
        .await
        .unwrap()
        .into_inner();
    let pb_ = p.models.iter().find(|m| m.model == "b").expect("b placed");
    assert_eq!(
        (pb_.gpus.clone(), pb_.gpu_memory_utilization),
        (vec![1], 0.3)
    );
    assert_eq!(status(&mut c, "a").await.pid, a_pid, "a disturbed");

    // Only idle tiers (a) and aliases (b) change: both keep their engines.
    let a2 = format!("{a}idle = [{{ after = \"1h\", action = \"sleep\", level = 1 }}]\n");
    let b2 = format!("{b}aliases = [\"bee\"]\n");
    let good = gpu_config(&format!("{a2}{b2}"));
    write_config(&ctl, &good);
    let before = pids(&mut c, &["a", "b"]).await;
    let r = c.reload(pb::ReloadRequest {}).await.unwrap().into_inner();
    let mut changed = r.changed.clone();
    changed.sort();
    assert_eq!(changed, ["a", "b"], "{r:?}");
    let bee = wait_status(&mut c, "bee", "alias bee resolves", LONG, |s| s.name == "b").await;
    assert_eq!(
        (bee.pid, bee.aliases.clone()),
        (before[1], vec!["bee".to_string()])
    );
    let s = wait_status(&mut c, "a", "a's new tier", LONG, |s| {
        s.next_tier
            .as_ref()
            .is_some_and(|t| t.after_ms == 3_600_000)
    })
    .await;
    assert_eq!(state(&s), pb::ModelState::Awake);
    assert_eq!(
        pids(&mut c, &["a", "b"]).await,
        before,
        "an engine was restarted"
    );

    // Reloads that fail change nothing, and say which file and key.
    let file = ctl.config_path.display().to_string();
    let refused = [
        (
            format!("{a2}colour = \"red\"\n{b2}"),
            format!("{file}: model[0].colour"),
        ),
        (
            format!(
                "{a2}{b2}{}",
                gpu_model("huge", "gpus = 1\ngpu_memory = \"100GiB\"")
            ),
            format!(
                "{file}: model[2].gpu_memory: model \"huge\": needs 1 × 100.0 GiB but GPU 0 has 80.0 GiB"
            ),
        ),
    ];
    for (models, want) in &refused {
        write_config(&ctl, &gpu_config(models));
        let e = c.reload(pb::ReloadRequest {}).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(
            e.message().contains(want.as_str()),
            "{want}\nnot in: {}",
            e.message()
        );
        // The same refusal by SIGHUP, in the daemon's log.
        ctl.child.signal(Signal::SIGHUP);
        ctl.child.output().wait_for(want, DEADLINE).await;
        assert_eq!(names(&mut c).await, ["a", "b"]);
        assert_eq!(pids(&mut c, &["a", "b"]).await, before);
    }
    let p = c
        .get_placement(pb::GetPlacementRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(p.models.iter().all(|m| m.model != "huge"), "{p:?}");
}
