//! Static placement over many machines and model mixes.

use super::*;
use crate::gpu::p2p::{P2pHealth, P2pMatrix};

pub(super) const GIB: u64 = 1 << 30;

pub(super) fn need(name: &str, gpus: u32, memory: MemoryNeed) -> ModelNeeds {
    ModelNeeds {
        name: name.into(),
        gpus,
        memory,
        pinned_gpus: Vec::new(),
        exclusive: false,
    }
}

pub(super) fn frac(name: &str, gpus: u32, f: f64) -> ModelNeeds {
    need(name, gpus, MemoryNeed::Fraction(f))
}

pub(super) fn by_name<'a>(p: &'a [Placement], name: &str) -> &'a Placement {
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
            text.placed().engine_args(),
            [
                "--tensor-parallel-size",
                "2",
                "--gpu-memory-utilization",
                "0.9",
                "--disable-custom-all-reduce"
            ]
        );
        assert!(
            text.placed()
                .engine_env()
                .contains(&("NCCL_P2P_DISABLE".into(), "1".into()))
        );
        assert!(
            text.placed()
                .engine_env()
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
            // vLLM's default tensor-parallel size is 1: not passed.
            assert_eq!(p.placed().engine_args()[..1], ["--gpu-memory-utilization"]);
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
            .placed()
            .engine_args()
            .contains(&"--disable-custom-all-reduce".to_string())
    );
    assert!(
        !p[0]
            .placed()
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
fn a_new_probe_flips_p2p_without_moving_anyone() {
    let all_ok: Vec<(u32, u32, P2pHealth)> = [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)]
        .iter()
        .map(|&(a, b)| (a, b, POk))
        .collect();
    let mut m = seeds_box(&all_ok);
    let models = vec![frac("text", 2, 0.9), frac("ocr", 1, 0.4)];
    let mut p = place(&m, &models, &Policy::default()).unwrap();
    let before: Vec<Vec<u32>> = p.iter().map(|p| p.gpus.clone()).collect();
    let gpus = by_name(&p, "text").gpus.clone();
    assert!(!by_name(&p, "text").p2p_disabled);
    // The probe now finds one direction of the text pair corrupt.
    m.p2p = P2pMatrix::from_healths(
        &all_ok
            .iter()
            .map(|&(a, b, h)| {
                if (a, b) == (gpus[0], gpus[1]) {
                    (a, b, Corrupt)
                } else {
                    (a, b, h)
                }
            })
            .collect::<Vec<_>>(),
    );
    let changed = refresh_p2p(&m, &mut p, &Policy::default());
    assert_eq!(changed, vec!["text".to_string()]);
    let after: Vec<Vec<u32>> = p.iter().map(|p| p.gpus.clone()).collect();
    assert_eq!(before, after, "nobody moves");
    let text = by_name(&p, "text");
    assert!(text.p2p_disabled);
    assert!(
        text.placed()
            .engine_args()
            .contains(&"--disable-custom-all-reduce".to_string())
    );
    assert!(text.reason.contains("is corrupt"), "{}", text.reason);
    assert!(!text.reason.contains("P2P ok"), "{}", text.reason);
    // Healthy again: back on, and nothing changes a second time.
    m.p2p = P2pMatrix::from_healths(&all_ok);
    assert_eq!(
        refresh_p2p(&m, &mut p, &Policy::default()),
        vec!["text".to_string()]
    );
    assert!(!by_name(&p, "text").p2p_disabled);
    assert!(refresh_p2p(&m, &mut p, &Policy::default()).is_empty());
    assert!(by_name(&p, "text").reason.contains("P2P ok on every pair"));
}
