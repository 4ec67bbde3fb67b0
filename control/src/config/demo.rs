//! The built-in demo: fake-vllm engines with second-scale timings.

use super::*;

fn fake(
    command: &[String],
    name: &str,
    aliases: &[&str],
    model: &str,
    preload: Preload,
    args: &[&str],
    d: &Defaults,
) -> ModelConfig {
    ModelConfig {
        name: name.to_string(),
        aliases: aliases.iter().map(|s| s.to_string()).collect(),
        model: model.to_string(),
        engine: EngineKind::Vllm,
        health_path: "/health".into(),
        launch: Launch::Process {
            command: command.to_vec(),
            host: "127.0.0.1".into(),
            port: None,
        },
        args: args.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::new(),
        gpus: 0,
        gpu_memory: None,
        gpu_ids: Vec::new(),
        exclusive: false,
        idle: d.idle.clone(),
        preload,
        max_queue: d.max_queue,
        max_hold: d.max_hold,
        timeouts: d.timeouts,
        backoff: d.backoff,
    }
}

pub(super) fn demo(command_prefix: Vec<String>) -> Config {
    let defaults = Defaults {
        idle: vec![
            IdleTier {
                after: Duration::from_secs(30),
                action: IdleAction::Sleep(1),
            },
            IdleTier {
                after: Duration::from_secs(120),
                action: IdleAction::Sleep(2),
            },
        ],
        max_queue: 64,
        max_hold: Duration::from_secs(120),
        timeouts: Timeouts {
            start: Duration::from_secs(60),
            wake: Duration::from_secs(30),
            sleep: Duration::from_secs(30),
            stop_grace: Duration::from_secs(10),
        },
        backoff: Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
        },
    };
    let uid = nix::unistd::Uid::effective();
    let models = vec![
        fake(
            &command_prefix,
            "chat",
            &["gpt-4o-mini"],
            "Qwen/Qwen3-8B",
            Preload::Asleep,
            &[
                "--startup-time",
                "2s",
                "--sleep-time",
                "300ms",
                "--wake-time",
                "1s",
                "--reload-time",
                "1s",
            ],
            &defaults,
        ),
        fake(
            &command_prefix,
            "coder",
            &["qwen-coder"],
            "Qwen/Qwen3-Coder-30B-A3B-Instruct",
            Preload::None,
            &[
                "--startup-time",
                "3s",
                "--sleep-time",
                "500ms",
                "--wake-time",
                "2s",
                "--reload-time",
                "2s",
            ],
            &defaults,
        ),
        fake(
            &command_prefix,
            "embed",
            &["text-embedding-3-small"],
            "Qwen/Qwen3-Embedding-0.6B",
            Preload::None,
            &[
                "--runner",
                "pooling",
                "--startup-time",
                "1s",
                "--sleep-time",
                "200ms",
                "--wake-time",
                "500ms",
                "--reload-time",
                "500ms",
            ],
            &defaults,
        ),
    ];
    Config {
        origin: "<demo>".into(),
        path: None,
        control: ControlConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            state_dir: std::env::temp_dir().join(format!("siesta-demo-{uid}")),
            token: None,
            control_id: validate::host_name(),
            p2p_probe: P2pProbeConfig::default(),
            gpu_detect_timeout: super::DEFAULT_GPU_DETECT_TIMEOUT,
            asleep_residual: None,
            min_awake: super::DEFAULT_MIN_AWAKE,
            yield_after: Some(super::DEFAULT_YIELD_AFTER),
            engine_idle_timeout: super::DEFAULT_ENGINE_IDLE_TIMEOUT,
            web_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            cuda_checkpoint: None,
        },
        defaults,
        gpus: Vec::new(),
        models,
    }
}
