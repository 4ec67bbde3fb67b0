//! fake-vllm's simulated GPU: `--gpu-memory-utilization` x total must be free at start-up,
//! sleep leaves vLLM's residual, a wake needs room, and an orphaned engine core keeps its
//! memory (all through `FAKE_VLLM_GPU_TOTAL_BYTES` + `FAKE_VLLM_GPU_DIR`).

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use siesta_tests::{DEADLINE, FakeVllm, spawn_fake_vllm_env, spawn_fake_vllm_nowait, wait_until};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

struct Gpu {
    dir: tempfile::TempDir,
    total: String,
}

impl Gpu {
    fn new(total_gib: u64) -> Gpu {
        Gpu {
            dir: tempfile::tempdir().unwrap(),
            total: (total_gib * GIB).to_string(),
        }
    }

    fn env<'a>(&'a self, devices: &'a str) -> [(&'a str, &'a str); 3] {
        [
            ("FAKE_VLLM_GPU_TOTAL_BYTES", self.total.as_str()),
            ("FAKE_VLLM_GPU_DIR", self.dir.path().to_str().unwrap()),
            ("CUDA_VISIBLE_DEVICES", devices),
        ]
    }

    async fn engine(&self, devices: &str, args: &[&str]) -> FakeVllm {
        spawn_fake_vllm_env(args, &self.env(devices)).await
    }

    /// Starts an engine that must fail its start-up; returns its output.
    async fn refused(&self, devices: &str, args: &[&str]) -> String {
        let mut child = spawn_fake_vllm_nowait(args, &self.env(devices));
        let status = child.wait_exit(DEADLINE).await;
        assert_eq!(status.code(), Some(1), "{}", child.output().text());
        child
            .output()
            .wait_for("less than desired GPU memory utilization", DEADLINE)
            .await;
        assert!(!child.output().contains("Uvicorn running"));
        child.output().text()
    }
}

async fn gpu_bytes(fv: &FakeVllm) -> u64 {
    fv.stats().await["gpu_bytes"].as_u64().unwrap()
}

#[tokio::test]
async fn startup_needs_free_memory_and_sleep_leaves_the_residual() {
    let gpu = Gpu::new(10);
    let a = gpu
        .engine(
            "0",
            &[
                "a",
                "--enable-sleep-mode",
                "--gpu-memory-utilization",
                "0.5",
            ],
        )
        .await;
    assert_eq!(gpu_bytes(&a).await, 5 * GIB);
    assert_eq!(a.stats().await["gpu_used_bytes"], json!({"0": 5 * GIB}));

    let out = gpu
        .refused("0", &["b", "--gpu-memory-utilization", "0.6"])
        .await;
    assert!(
        out.contains("Free memory on device cuda:0 (5.00/10.00 GiB)"),
        "{out}"
    );
    // As vLLM: the engine core's exception on stderr, then the API
    // server's, which only points above.
    assert!(
        out.contains(") ValueError: Free memory on device cuda:0")
            && out
                .contains("RuntimeError: Engine core initialization failed. See root cause above."),
        "{out}"
    );
    // Another GPU is free.
    let c = gpu
        .engine("1", &["c", "--gpu-memory-utilization", "0.6"])
        .await;
    assert_eq!(c.stats().await["gpu_used_bytes"], json!({"1": 6 * GIB}));

    // Asleep, `a` keeps vLLM's residual (836 MiB at TP=1) and `b` fits.
    let v: Value = a.post("/sleep?level=1").await.json().await.unwrap();
    assert_eq!(v["status"], "sleeping");
    assert_eq!(gpu_bytes(&a).await, 836 * MIB);
    let mut b = gpu
        .engine("0", &["b", "--gpu-memory-utilization", "0.6"])
        .await;

    // Now `a` cannot wake: the allocation fails and it stays asleep.
    let r = a.post("/wake_up").await;
    assert_eq!(r.status(), 500);
    let text = r.text().await.unwrap();
    // In vLLM 0.24's words (its cumem allocator's, not PyTorch's).
    assert!(
        text.contains(
            "Call to wake_up method failed: CUDA Error: out of memory at \
             /workspace/csrc/cumem_allocator.cpp:163"
        ),
        "{text}"
    );
    assert_eq!(a.stats().await["is_sleeping"], true);

    // Once `b` is gone (its whole group), its entry no longer counts.
    b.child.kill9();
    wait_until("a to wake", DEADLINE, || async {
        a.post("/wake_up").await.status() == 200
    })
    .await;
    assert_eq!(gpu_bytes(&a).await, 5 * GIB);
}

#[tokio::test]
async fn tensor_parallel_residual_is_per_gpu() {
    let gpu = Gpu::new(20);
    let fv = gpu
        .engine(
            "2,3",
            &[
                "m",
                "--enable-sleep-mode",
                "-tp",
                "2",
                "--gpu-memory-utilization",
                "0.3",
            ],
        )
        .await;
    assert_eq!(fv.post("/sleep?level=2").await.status(), 200);
    assert_eq!(
        fv.stats().await["gpu_used_bytes"],
        json!({"2": 2204 * MIB, "3": 2204 * MIB})
    );
    let fv = gpu
        .engine(
            "4",
            &["n", "--enable-sleep-mode", "--asleep-residual-mib", "1400"],
        )
        .await;
    assert_eq!(fv.post("/sleep").await.status(), 200);
    assert_eq!(gpu_bytes(&fv).await, 1400 * MIB);
}

#[tokio::test]
async fn an_orphaned_engine_core_keeps_its_gpu_memory() {
    let gpu = Gpu::new(10);
    let mut a = gpu
        .engine("0", &["a", "--gpu-memory-utilization", "0.5"])
        .await;
    let core = a.engine_core_pid().await;
    a.child.signal(Signal::SIGKILL);
    a.child.wait_exit(DEADLINE).await;
    // As vLLM#55510: the server is gone, its engine core holds the memory.
    gpu.refused("0", &["b", "--gpu-memory-utilization", "0.6"])
        .await;
    a.child.signal_group(Signal::SIGKILL);
    wait_until("the engine core to die", DEADLINE, || async {
        siesta_tests::any_alive(&[core]).is_empty()
    })
    .await;
    let b = gpu
        .engine("0", &["b", "--gpu-memory-utilization", "0.6"])
        .await;
    assert_eq!(b.get("/health").await.status(), 200);
}

#[tokio::test]
async fn engines_starting_together_miscount_and_one_runs_out_of_memory() {
    let gpu = Gpu::new(10);
    let env = gpu.env("0");
    // As vllm#55827: both check free memory before either has taken any.
    let mut engines = [("a", "0.5"), ("b", "0.6")].map(|(name, util)| {
        spawn_fake_vllm_nowait(
            &[
                name,
                "--gpu-memory-utilization",
                util,
                "--startup-time",
                "4s",
            ],
            &env,
        )
    });
    let failed = siesta_tests::wait_for("one engine to fail", DEADLINE, || {
        engines.iter_mut().position(|e| e.try_exit().is_some())
    })
    .await;
    let ok = 1 - failed;
    engines[ok]
        .output()
        .wait_for("Uvicorn running on", DEADLINE)
        .await;
    let loser = &mut engines[failed];
    assert_eq!(loser.try_exit().unwrap().code(), Some(1));
    loser
        .output()
        .wait_for("CUDA out of memory", DEADLINE)
        .await;
    for e in &engines {
        assert!(
            !e.output().contains("less than desired"),
            "the start-up check saw the other engine:\n{}",
            e.output().text()
        );
    }
}

/// vLLM compares the free memory after profiling with the free memory when
/// its start-up began, and fails the start when it grew: another engine on
/// the GPU that sleeps (or exits) meanwhile kills the start.
#[tokio::test]
async fn memory_freed_by_another_engine_during_start_up_fails_the_start() {
    let gpu = Gpu::new(10);
    let b = gpu
        .engine(
            "0",
            &[
                "b",
                "--gpu-memory-utilization",
                "0.4",
                "--enable-sleep-mode",
            ],
        )
        .await;
    let mut a = spawn_fake_vllm_nowait(
        &[
            "a",
            "--gpu-memory-utilization",
            "0.4",
            "--startup-time",
            "3s",
        ],
        &gpu.env("0"),
    );
    a.output()
        .wait_for("Starting to load model a...", DEADLINE)
        .await;
    assert_eq!(b.post("/sleep?level=1").await.status(), 200);
    let status = a.wait_exit(DEADLINE).await;
    assert_eq!(status.code(), Some(1), "{}", a.output().text());
    assert!(
        a.output()
            .contains("AssertionError: Error in memory profiling. Initial free memory 6.00 GiB"),
        "{}",
        a.output().text()
    );
}
