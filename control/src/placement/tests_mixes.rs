//! Static placement: errors with arithmetic, memory, pins, and many generated mixes.

use super::*;
use crate::gpu::p2p::{P2pHealth, P2pMatrix};
use P2pHealth::{Corrupt, Hung, Ok as POk, Unsupported};

use super::tests::{GIB, by_name, frac, need};

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
    assert!(p[0].placed().engine_args().is_empty() && p[0].placed().engine_env().is_empty());
}

#[test]
fn combinations_enumerate_every_subset_once() {
    let c = candidates::combinations(&[0, 1, 2, 3, 4], 2);
    assert_eq!(c.len(), 10);
    assert_eq!(c[0], vec![0, 1]);
    assert_eq!(c[9], vec![3, 4]);
    assert_eq!(candidates::combinations(&[0, 1, 2], 3), vec![vec![0, 1, 2]]);
    assert!(candidates::combinations(&[0], 2).is_empty());
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
