//! Two models that cannot both be awake on one GPU: waking one puts the
//! other (idle) to sleep first. GPUs listed by hand; fake-vllm engines.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;

fn two_on_one_gpu() -> String {
    let model = |name: &str| {
        format!(
            r#"
[[model]]
name = "{name}"
model = "fake/{name}"
executable = "@FAKE_VLLM@"
gpus = 1
gpu_memory = 0.6
preload = "none"
env = {{ SIESTA_TEST_TAG = "@DIR@" }}
"#
        )
    };
    config(&format!(
        "[[gpu]]\nindex = 0\nname = \"test-gpu\"\nmemory = \"80GiB\"\n{}{}",
        model("a"),
        model("b")
    ))
}

#[tokio::test]
async fn waking_one_model_evicts_the_idle_other() {
    let ctl = start(&two_on_one_gpu()).await;
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
    let a = wake_awake(&mut c, "a").await;
    assert_eq!(a.gpus, vec![0]);
    // Waking b must first put a to sleep: never both awake.
    wake_awake(&mut c, "b").await;
    let a = status(&mut c, "a").await;
    assert_eq!(state(&a), pb::ModelState::Asleep);
    assert_eq!(a.intent.unwrap().reason, pb::IntentReason::Eviction as i32);
    // Budgets follow the states.
    let p = c
        .get_placement(pb::GetPlacementRequest {})
        .await
        .unwrap()
        .into_inner();
    let g0 = p.gpus.iter().find(|g| g.index == 0).unwrap();
    assert!(g0.awake_bytes > 0 && g0.asleep_bytes > 0, "{g0:?}");
    assert!(g0.awake_bytes + g0.asleep_bytes <= g0.total_bytes);
    // And back: demand for a evicts b.
    c.demand(pb::DemandRequest {
        model: "a".into(),
        proxy_id: "t".into(),
        queued: 1,
    })
    .await
    .unwrap();
    wait_state(&mut c, "a", pb::ModelState::Awake, LONG).await;
    assert_eq!(state(&status(&mut c, "b").await), pb::ModelState::Asleep);
}
