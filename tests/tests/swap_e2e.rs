//! Two models that cannot both be awake on one GPU take turns under many
//! requests at once (the deadlock of the first side-by-side run): from
//! every starting point, 20 concurrent requests split between them are all
//! answered, the two are never awake together, and no engine is killed or
//! replaced. (Busy models that take turns: `turns_e2e.rs`.)

use siesta_proto::v1 as pb;
use siesta_tests::ProxyProc;
use siesta_tests::ctl::*;
use siesta_tests::swap::*;

async fn ask(proxy: &str, model: &str) -> Result<(), String> {
    try_chat(proxy, model, 4, ANSWER_WITHIN).await.map(drop)
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
