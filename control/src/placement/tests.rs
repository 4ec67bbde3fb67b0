//! Static placement over many machines and model mixes.

use super::*;
use crate::gpu::p2p::{P2pHealth, P2pMatrix};

const GIB: u64 = 1 << 30;

fn need(name: &str, gpus: u32, memory: MemoryNeed) -> ModelNeeds {
    ModelNeeds {
        name: name.into(),
        gpus,
        memory,
        pinned_gpus: Vec::new(),
        exclusive: false,
    }
}

fn frac(name: &str, gpus: u32, f: f64) -> ModelNeeds {
    need(name, gpus, MemoryNeed::Fraction(f))
}

fn by_name<'a>(p: &'a [Placement], name: &str) -> &'a Placement {
    p.iter().find(|p| p.model == name).unwrap()
}

/// The seeds' box: three 80 GiB A800s whose PCIe P2P corrupts.
fn seeds_box(matrix: &[(u32, u32, P2pHealth)]) -> Machine {
    let mut m = Machine::uniform(3, 80 * GIB);
    for (a, b) in [(0, 1), (0, 2), (1, 2)] {
        m.links.insert((a, b), LinkKind::CrossCpu);
    }
    m.p2p = P2pMatrix::from_healths(matrix);
    m
}

use P2pHealth::{Corrupt, Hung, Ok as POk, Unsupported};

const AUG_17: &[(u32, u32, P2pHealth)] = &[
    (0, 1, Corrupt),
    (0, 2, Corrupt),
    (1, 0, Corrupt),
    (1, 2, Corrupt),
    (2, 0, POk),
    (2, 1, POk),
];

#[test]
fn seeds_box_text_on_0_1_with_p2p_off_ocr_and_embed_share_gpu_2() {
    for exclusive in [true, false] {
        let m = seeds_box(AUG_17);
        let mut text = frac("text", 2, 0.9);
        text.exclusive = exclusive;
        let models = vec![text, frac("ocr", 1, 0.4), frac("embed", 1, 0.3)];
        let p = place(&m, &models, &Policy::default()).unwrap();
        let text = by_name(&p, "text");
        assert_eq!(text.gpus, vec![0, 1], "{}", text.reason);
        assert!(text.p2p_disabled);
        assert_eq!(text.cuda_visible_devices(), "0,1");
        assert_eq!(
            text.engine_args(),
            [
                "--tensor-parallel-size",
                "2",
                "--gpu-memory-utilization",
                "0.9",
                "--disable-custom-all-reduce"
            ]
        );
        assert!(
            text.engine_env()
                .contains(&("NCCL_P2P_DISABLE".into(), "1".into()))
        );
        assert!(
            text.engine_env()
                .contains(&("CUDA_VISIBLE_DEVICES".into(), "0,1".into()))
        );
        assert!(
            text.reason.contains("P2P disabled: GPU 0→1 is corrupt"),
            "{}",
            text.reason
        );
        assert!(
            text.reason.contains("no set of that size has P2P ok"),
            "{}",
            text.reason
        );
        for name in ["ocr", "embed"] {
            let p = by_name(&p, name);
            assert_eq!(p.gpus, vec![2], "{name}: {}", p.reason);
            assert!(!p.p2p_disabled, "single-GPU models never issue P2P");
            assert_eq!(p.engine_args()[..2], ["--tensor-parallel-size", "1"]);
        }
        assert!(
            by_name(&p, "ocr")
                .reason
                .contains("shares with \"embed\" on GPU 2")
        );
        assert_eq!(
            p.iter().map(|p| p.model.as_str()).collect::<Vec<_>>(),
            ["text", "ocr", "embed"]
        );
    }
}

#[test]
fn seeds_box_aug_13_matrix_still_disables_p2p_for_the_tp_group() {
    let aug_13 = [
        (0, 1, Corrupt),
        (0, 2, Corrupt),
        (1, 0, POk),
        (1, 2, POk),
        (2, 0, Corrupt),
        (2, 1, Corrupt),
    ];
    let m = seeds_box(&aug_13);
    let p = place(&m, &[frac("text", 2, 0.9)], &Policy::default()).unwrap();
    assert_eq!(p[0].gpus, vec![0, 1]);
    assert!(p[0].p2p_disabled);
}

#[test]
fn prefers_a_set_whose_pairs_are_all_ok() {
    let mut m = Machine::uniform(4, 80 * GIB);
    m.p2p = P2pMatrix::from_healths(&[(0, 1, Corrupt), (1, 0, POk), (2, 3, POk), (3, 2, POk)]);
    let p = place(&m, &[frac("tp2", 2, 0.5)], &Policy::default()).unwrap();
    assert_eq!(p[0].gpus, vec![2, 3], "{}", p[0].reason);
    assert!(!p[0].p2p_disabled);
    assert!(p[0].reason.contains("P2P ok on every pair"));
    assert!(
        !p[0]
            .engine_args()
            .contains(&"--disable-custom-all-reduce".to_string())
    );
    assert!(
        !p[0]
            .engine_env()
            .iter()
            .any(|(k, _)| k == "NCCL_P2P_DISABLE")
    );
}

#[test]
fn unsupported_and_hung_pairs_disable_p2p_like_corrupt_ones() {
    for bad in [Unsupported, Hung, Corrupt, P2pHealth::Error] {
        let mut m = Machine::uniform(2, 80 * GIB);
        m.p2p = P2pMatrix::from_healths(&[(0, 1, POk), (1, 0, bad)]);
        let p = place(&m, &[frac("tp2", 2, 0.5)], &Policy::default()).unwrap();
        assert!(p[0].p2p_disabled, "{bad:?}");
        assert!(
            p[0].reason
                .contains(&format!("GPU 1→0 is {}", bad.as_str())),
            "{}",
            p[0].reason
        );
    }
}

#[test]
fn unprobed_pairs_disable_p2p_unless_policy_trusts_them() {
    let m = Machine::uniform(2, 80 * GIB);
    let p = place(&m, &[frac("tp2", 2, 0.5)], &Policy::default()).unwrap();
    assert!(p[0].p2p_disabled);
    assert!(p[0].reason.contains("not probed"), "{}", p[0].reason);
    let trust = Policy {
        trust_unprobed_p2p: true,
        ..Policy::default()
    };
    let p = place(&m, &[frac("tp2", 2, 0.5)], &trust).unwrap();
    assert!(!p[0].p2p_disabled);
}

#[test]
fn prefers_best_connected_among_healthy_sets() {
    let mut m = Machine::uniform(4, 80 * GIB);
    let all_ok: Vec<(u32, u32, P2pHealth)> = (0..4)
        .flat_map(|a| (0..4).filter(move |&b| b != a).map(move |b| (a, b, POk)))
        .collect();
    m.p2p = P2pMatrix::from_healths(&all_ok);
    for a in 0..4 {
        for b in a + 1..4 {
            m.links.insert((a, b), LinkKind::CrossCpu);
        }
    }
    m.links.insert((1, 3), LinkKind::SameCpu);
    m.links.insert((0, 2), LinkKind::SameSwitch);
    let p = place(&m, &[frac("tp2", 2, 0.5)], &Policy::default()).unwrap();
    assert_eq!(p[0].gpus, vec![0, 2]);
    m.links.insert((1, 3), LinkKind::NvLink);
    let p = place(&m, &[frac("tp2", 2, 0.5)], &Policy::default()).unwrap();
    assert_eq!(p[0].gpus, vec![1, 3]);
    assert!(p[0].reason.contains("linked by nvlink"), "{}", p[0].reason);
}

#[test]
fn p2p_health_outranks_link_speed() {
    let mut m = Machine::uniform(4, 80 * GIB);
    m.links.insert((2, 3), LinkKind::NvLink);
    m.links.insert((0, 1), LinkKind::SameCpu);
    m.p2p = P2pMatrix::from_healths(&[(2, 3, Corrupt), (3, 2, POk), (0, 1, POk), (1, 0, POk)]);
    let p = place(&m, &[frac("tp2", 2, 0.5)], &Policy::default()).unwrap();
    assert_eq!(p[0].gpus, vec![0, 1]);
    assert!(!p[0].p2p_disabled);
}

#[test]
fn healthier_set_without_room_is_explained() {
    let mut m = Machine::uniform(3, 80 * GIB);
    m.p2p = P2pMatrix::from_healths(&[(0, 1, POk), (1, 0, POk), (0, 2, Corrupt), (1, 2, Corrupt)]);
    let mut hog = frac("hog", 1, 0.5);
    hog.pinned_gpus = vec![1];
    hog.exclusive = true;
    let p = place(&m, &[hog, frac("tp2", 2, 0.5)], &Policy::default()).unwrap();
    let tp2 = by_name(&p, "tp2");
    assert_eq!(tp2.gpus, vec![0, 2]);
    assert!(tp2.p2p_disabled);
    assert!(
        tp2.reason.contains("no set with healthier P2P had room"),
        "{}",
        tp2.reason
    );
}

#[test]
fn a_model_larger_than_its_gpus_is_refused_with_the_arithmetic() {
    let m = Machine::uniform(2, 80 * GIB);
    let err = place(
        &m,
        &[need("big", 2, MemoryNeed::Bytes(90 * GIB))],
        &Policy::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "model \"big\": needs 2 × 90.0 GiB but GPU 0 has 80.0 GiB"
    );
}

#[test]
fn static_errors_name_the_model_and_the_numbers() {
    let m = Machine::uniform(2, 80 * GIB);
    let mut pinned = frac("pinned", 1, 0.5);
    pinned.pinned_gpus = vec![5];
    let mut two_on_one = frac("narrow", 2, 0.5);
    two_on_one.pinned_gpus = vec![1];
    let models = vec![
        frac("wide", 3, 0.5),
        frac("over", 1, 1.2),
        pinned,
        two_on_one,
        frac("ok", 1, 0.5),
    ];
    let err = place(&m, &models, &Policy::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("model \"wide\": needs 3 GPUs but the box has 2 (0, 1)"),
        "{text}"
    );
    assert!(
        text.contains("model \"over\": gpu_memory 1.2 is not a fraction in (0, 1]"),
        "{text}"
    );
    assert!(
        text.contains("model \"pinned\": pinned GPU 5 does not exist (GPUs: 0, 1)"),
        "{text}"
    );
    assert!(
        text.contains("model \"narrow\": needs 2 GPUs but it is pinned to 1 (1)"),
        "{text}"
    );
    assert_eq!(
        err.0.len(),
        4,
        "every bad model is reported, the good one is not: {text}"
    );
    let none = place(
        &Machine::default(),
        &[frac("x", 1, 0.5)],
        &Policy::default(),
    )
    .unwrap_err();
    assert!(none.to_string().contains("no GPUs are known"), "{none}");
}

#[test]
fn more_models_than_fit_awake_may_share_a_gpu_until_residuals_overflow() {
    let m = Machine::uniform(1, 80 * GIB);
    let two = [frac("a", 1, 0.9), frac("b", 1, 0.9)];
    let p = place(&m, &two, &Policy::default()).unwrap();
    assert!(p.iter().all(|p| p.gpus == [0]));
    let three = [frac("a", 1, 0.97), frac("b", 1, 0.97), frac("c", 1, 0.97)];
    let err = place(&m, &three, &Policy::default()).unwrap_err();
    assert_eq!(err.0.len(), 1);
    let text = err.to_string();
    assert!(
        text.starts_with("model \"c\": no set of 1 GPU(s) has room (GPU 0:"),
        "{text}"
    );
    assert!(text.contains("3.0 GiB = 80.6 GiB > 80.0 GiB"), "{text}");
    let tight = Policy {
        residual_bytes: GIB / 2,
        ..Policy::default()
    };
    assert!(place(&m, &three, &tight).is_ok());
}

#[test]
fn exclusive_models_get_their_gpus_alone() {
    let m = Machine::uniform(1, 80 * GIB);
    let mut solo = frac("solo", 1, 0.3);
    solo.exclusive = true;
    let err = place(
        &m,
        &[frac("other", 1, 0.1), solo.clone()],
        &Policy::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("exclusive to \"solo\""), "{err}");
    let m = Machine::uniform(2, 80 * GIB);
    let p = place(&m, &[frac("other", 1, 0.1), solo], &Policy::default()).unwrap();
    assert_ne!(by_name(&p, "solo").gpus, by_name(&p, "other").gpus);
    assert!(by_name(&p, "solo").exclusive);
}

#[test]
fn bytes_become_a_utilization_of_the_smallest_gpu() {
    let m = Machine::uniform(2, 80 * GIB);
    let p = place(
        &m,
        &[need("b", 2, MemoryNeed::Bytes(40 * GIB))],
        &Policy::default(),
    )
    .unwrap();
    assert_eq!(p[0].gpu_memory_utilization, 0.5);
    assert_eq!(p[0].awake_bytes, vec![40 * GIB, 40 * GIB]);
    // H200: 150,754,820,096 bytes; 8 GiB rounds up to 4 decimals.
    let h200 = Machine::uniform(1, 150_754_820_096);
    let p = place(
        &h200,
        &[need("b", 1, MemoryNeed::Bytes(8 * GIB))],
        &Policy::default(),
    )
    .unwrap();
    assert_eq!(p[0].gpu_memory_utilization, 0.057);
    assert!(p[0].awake_bytes[0] >= 8 * GIB);
    assert_eq!(p[0].to_proto().awake_bytes_per_gpu, p[0].awake_bytes[0]);
}

#[test]
fn pinned_gpus_are_honoured_and_spreading_fills_empty_gpus_first() {
    let m = Machine::uniform(2, 80 * GIB);
    let mut pinned = frac("pinned", 1, 0.2);
    pinned.pinned_gpus = vec![1];
    let p = place(
        &m,
        &[frac("a", 1, 0.5), pinned, frac("b", 1, 0.5)],
        &Policy::default(),
    )
    .unwrap();
    assert_eq!(by_name(&p, "pinned").gpus, vec![1]);
    assert!(by_name(&p, "pinned").reason.contains("pinned to 1"));
    assert_ne!(by_name(&p, "a").gpus, by_name(&p, "b").gpus);
}

#[test]
fn models_without_gpus_get_no_engine_flags() {
    let p = place(
        &Machine::default(),
        &[frac("cpu", 0, 0.5)],
        &Policy::default(),
    )
    .unwrap();
    assert!(p[0].gpus.is_empty());
    assert!(p[0].engine_args().is_empty() && p[0].engine_env().is_empty());
}

#[test]
fn combinations_enumerate_every_subset_once() {
    let c = assign::combinations_for_test(&[0, 1, 2, 3, 4], 2);
    assert_eq!(c.len(), 10);
    assert_eq!(c[0], vec![0, 1]);
    assert_eq!(c[9], vec![3, 4]);
    assert_eq!(
        assign::combinations_for_test(&[0, 1, 2], 3),
        vec![vec![0, 1, 2]]
    );
    assert!(assign::combinations_for_test(&[0], 2).is_empty());
}

/// Many generated mixes: every success respects memory, exclusivity, pins
/// and set sizes; every failure names its model.
#[test]
fn many_mixes_keep_the_invariants() {
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut rnd = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let policy = Policy::default();
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..400 {
        let gpus = 1 + rnd(8) as u32;
        let mut m = Machine::uniform(gpus, (24 + rnd(4) * 40) * GIB);
        let mut matrix = Vec::new();
        for a in 0..gpus {
            for b in 0..gpus {
                if a != b {
                    matrix.push((
                        a,
                        b,
                        [POk, POk, POk, Corrupt, Unsupported, Hung][rnd(6) as usize],
                    ));
                }
            }
        }
        m.p2p = P2pMatrix::from_healths(&matrix);
        let models: Vec<ModelNeeds> = (0..1 + rnd(6))
            .map(|i| {
                let mut n = if rnd(3) == 0 {
                    need(
                        &format!("m{i}"),
                        1 + rnd(2) as u32,
                        MemoryNeed::Bytes((1 + rnd(30)) * GIB),
                    )
                } else {
                    frac(
                        &format!("m{i}"),
                        [1, 1, 2, 4][rnd(4) as usize],
                        (1 + rnd(95)) as f64 / 100.0,
                    )
                };
                n.exclusive = rnd(5) == 0;
                if rnd(6) == 0 {
                    n.pinned_gpus = vec![rnd(u64::from(gpus)) as u32];
                    n.gpus = 1;
                }
                n
            })
            .collect();
        match place(&m, &models, &policy) {
            Ok(ps) => {
                ok += 1;
                check_invariants(&m, &models, &ps, &policy);
            }
            Err(e) => {
                failed += 1;
                assert!(
                    e.0.iter().all(|x| models.iter().any(|n| n.name == x.model)),
                    "{e}"
                );
            }
        }
    }
    assert!(
        ok > 50 && failed > 20,
        "mixes should both fit and not: {ok} ok, {failed} failed"
    );
}

fn check_invariants(m: &Machine, models: &[ModelNeeds], ps: &[Placement], policy: &Policy) {
    assert_eq!(ps.len(), models.len());
    for (n, p) in models.iter().zip(ps) {
        assert_eq!(n.name, p.model);
        assert_eq!(p.gpus.len(), n.gpus as usize);
        assert!(p.gpus.windows(2).all(|w| w[0] < w[1]));
        if !n.pinned_gpus.is_empty() {
            assert!(p.gpus.iter().all(|g| n.pinned_gpus.contains(g)));
        }
        let bad = m.p2p.first_not_ok(&p.gpus).is_some();
        assert_eq!(p.p2p_disabled, p.gpus.len() > 1 && bad, "{}", p.reason);
    }
    for g in &m.gpus {
        let on: Vec<&Placement> = ps.iter().filter(|p| p.gpus.contains(&g.index)).collect();
        if on.iter().any(|p| p.exclusive) {
            assert_eq!(on.len(), 1);
        }
        for p in &on {
            let others: u64 = on
                .iter()
                .filter(|o| o.model != p.model)
                .map(|o| o.awake_on(g.index).min(policy.residual_bytes))
                .sum();
            assert!(
                p.awake_on(g.index) + others <= g.total_bytes,
                "{} on GPU {}",
                p.model,
                g.index
            );
        }
    }
}
