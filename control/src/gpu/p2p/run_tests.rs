//! The parent side against fake children (shell scripts run by /bin/sh, so
//! no freshly written executable is exec'd: no ETXTBSY races).

use std::time::{Duration, Instant};

use super::*;

const START3: &str = r#"{"kind":"start","devices":3,"bytes":1024}"#;

fn pair(src: u32, dst: u32, health: &str, corrupt: u64) -> String {
    format!(
        r#"{{"kind":"pair","src":{src},"dst":{dst},"health":"{health}","elements":256,"corrupt_elements":{corrupt},"bandwidth_gbps":12.5,"driver_says":"can-access-peer","detail":""}}"#
    )
}

/// Options running `script` (the body of a shell script) as the probe.
fn fake(dir: &tempfile::TempDir, script: &str, gpus: Vec<u32>, deadline: Duration) -> ProbeOptions {
    let path = dir.path().join("probe.sh");
    std::fs::write(&path, script).unwrap();
    ProbeOptions {
        bin: "/bin/sh".into(),
        args_prefix: vec![path.to_string_lossy().into_owned()],
        gpus,
        bytes: 1024,
        deadline,
    }
}

fn echo(lines: &[String]) -> String {
    lines.iter().map(|l| format!("echo '{l}'\n")).collect()
}

#[tokio::test]
async fn finished_pairs_survive_a_hang_and_the_rest_are_hung() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "{}exec sleep 600\n",
        echo(&[
            START3.into(),
            pair(0, 1, "ok", 0),
            pair(0, 2, "corrupt", 255)
        ])
    );
    let opts = fake(&dir, &script, vec![0, 1, 2], Duration::from_secs(5));
    let t = Instant::now();
    let res = run_probe(&opts).await.unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    let got: Vec<(u32, u32, P2pHealth)> = res.iter().map(|r| (r.src, r.dst, r.health)).collect();
    use P2pHealth::*;
    assert_eq!(
        got,
        vec![
            (0, 1, Ok),
            (0, 2, Corrupt),
            (1, 0, Hung),
            (1, 2, Hung),
            (2, 0, Hung),
            (2, 1, Hung)
        ]
    );
    assert_eq!(res[1].corrupt_elements, 255);
    assert!(res[2].detail.contains("probe killed"), "{}", res[2].detail);
}

#[tokio::test]
async fn a_child_that_dies_leaves_errors_with_its_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "{}echo 'CUDA_ERROR_ILLEGAL_ADDRESS in copy' >&2\nexit 3\n",
        echo(&[START3.into(), pair(0, 1, "unsupported", 0)])
    );
    let opts = fake(&dir, &script, vec![], Duration::from_secs(30));
    let res = run_probe(&opts).await.unwrap();
    assert_eq!(
        res.len(),
        6,
        "pairs come from the start line's device count"
    );
    assert_eq!(res[0].health, P2pHealth::Unsupported);
    for r in &res[1..] {
        assert_eq!(r.health, P2pHealth::Error);
        assert!(
            r.detail.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{}",
            r.detail
        );
        assert!(r.detail.contains("exit status: 3"), "{}", r.detail);
    }
}

#[tokio::test]
async fn a_complete_run_keeps_every_result() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = vec![r#"{"kind":"start","devices":2,"bytes":1024}"#.to_string()];
    lines.push(pair(0, 1, "ok", 0));
    lines.push("garbage that is not json".into());
    lines.push(pair(1, 0, "ok", 0));
    lines.push(r#"{"kind":"done"}"#.into());
    let opts = fake(&dir, &echo(&lines), vec![0, 1], Duration::from_secs(30));
    let res = run_probe(&opts).await.unwrap();
    assert_eq!(res.len(), 2);
    assert!(
        res.iter()
            .all(|r| r.health == P2pHealth::Ok && r.bandwidth_gbps == 12.5)
    );
}

#[tokio::test]
async fn no_cuda_is_unavailable_not_a_matrix() {
    let dir = tempfile::tempdir().unwrap();
    let script = echo(&[r#"{"kind":"fatal","detail":"libcuda not found"}"#.into()]);
    let opts = fake(&dir, &script, vec![0, 1], Duration::from_secs(30));
    match run_probe(&opts).await {
        Err(ProbeError::Unavailable(d)) => assert_eq!(d, "libcuda not found"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn silent_hang_with_known_gpus_marks_every_pair_hung() {
    let dir = tempfile::tempdir().unwrap();
    let opts = fake(
        &dir,
        "exec sleep 600\n",
        vec![0, 1],
        Duration::from_millis(500),
    );
    let res = run_probe(&opts).await.unwrap();
    assert_eq!(res.len(), 2);
    assert!(res.iter().all(|r| r.health == P2pHealth::Hung));
    let opts = fake(&dir, "exec sleep 600\n", vec![], Duration::from_millis(500));
    assert!(matches!(
        run_probe(&opts).await,
        Err(ProbeError::NoResults(_))
    ));
}

#[tokio::test]
async fn a_missing_binary_is_a_spawn_error() {
    let opts = ProbeOptions::new("/nonexistent/siesta-p2p-probe", vec![0, 1]);
    assert!(matches!(
        run_probe(&opts).await,
        Err(ProbeError::Spawn { .. })
    ));
}
