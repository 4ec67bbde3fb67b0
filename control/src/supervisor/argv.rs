//! The argv and environment siesta runs each engine kind with.

use super::SpawnSpec;
use crate::config::{EngineKind, Launch, ModelConfig};
use crate::placement::Placed;

/// What siesta runs for a model, by engine kind:
/// - vLLM: `<command...> serve MODEL --host H --port P --served-model-name
///   NAME --enable-sleep-mode [GPU flags] <args...>`, `VLLM_SERVER_DEV_MODE=1`;
/// - SGLang: `<command...> --model-path MODEL --host H --port P
///   --served-model-name NAME --enable-memory-saver
///   --enable-weights-cpu-backup --enable-metrics [GPU flags] <args...>`
///   (`docs/SGLANG-NOTES.md` says why each);
/// - openai: `<command...> <args...>` and nothing of siesta's, with
///   `{port}`, `{host}`, `{model}` and `{name}` replaced in every argument.
///
/// Every kind gets the placement's `CUDA_VISIBLE_DEVICES` and the model's
/// env, less the variables siesta sets itself (siesta's value stands).
pub fn spawn_spec(cfg: &ModelConfig, port: u16, placed: &Placed) -> SpawnSpec {
    let (command, host) = match &cfg.launch {
        Launch::Process { command, host, .. } => (command.clone(), host.clone()),
        Launch::Attach { .. } => (vec!["true".into()], "127.0.0.1".into()),
    };
    let mut args: Vec<String> = command[1..].to_vec();
    let mut env = Vec::new();
    let port_s = port.to_string();
    match cfg.engine {
        EngineKind::Vllm => {
            args.extend(
                [
                    "serve",
                    &cfg.model,
                    "--host",
                    &host,
                    "--port",
                    &port_s,
                    "--served-model-name",
                    &cfg.name,
                    "--enable-sleep-mode",
                ]
                .map(String::from),
            );
            // The GPU part comes from the placement alone (one builder).
            args.extend(placed.engine_args());
            args.extend(cfg.args.iter().cloned());
            env.push(("VLLM_SERVER_DEV_MODE".to_string(), "1".to_string()));
        }
        EngineKind::Sglang => {
            args.extend(
                [
                    "--model-path",
                    &cfg.model,
                    "--host",
                    &host,
                    "--port",
                    &port_s,
                    "--served-model-name",
                    &cfg.name,
                    "--enable-memory-saver",
                    "--enable-weights-cpu-backup",
                    "--enable-metrics",
                ]
                .map(String::from),
            );
            args.extend(sglang_gpu_args(placed));
            args.extend(cfg.args.iter().cloned());
        }
        EngineKind::Openai => {
            let fill = |a: &String| {
                a.replace("{port}", &port_s)
                    .replace("{host}", &host)
                    .replace("{model}", &cfg.model)
                    .replace("{name}", &cfg.name)
            };
            args = args.iter().chain(&cfg.args).map(fill).collect();
        }
    }
    env.extend(placed.engine_env());
    if cfg.checkpointable_multi_gpu() {
        let (more_args, more_env) = no_shared_gpu_memory(cfg.engine, placed);
        args.extend(more_args);
        env.extend(more_env);
    }
    // What siesta sets wins over the model's `env`: `NCCL_P2P_DISABLE = "0"`
    // must not turn P2P back on across a pair the probe found corrupting
    // data, nor `VLLM_SERVER_DEV_MODE = "0"` take away the sleep endpoints.
    let theirs: Vec<(String, String)> = cfg
        .env
        .iter()
        .filter(|(k, _)| !env.iter().any(|(set, _)| set == *k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    env.extend(theirs);
    SpawnSpec {
        program: command[0].clone(),
        args,
        env,
    }
}

/// What makes a multi-GPU engine checkpointable
/// ([`ModelConfig::checkpointable_multi_gpu`]): no device memory shared
/// between its processes. NCCL: no P2P transport and no cuMem (its shared
/// memory transport then uses plain host memory); vLLM: no custom
/// all-reduce (CUDA IPC buffers) and no symmetric-memory all-reduce. An
/// `openai` engine gets the environment only: its own flags are the
/// operator's (README: "Suspend").
fn no_shared_gpu_memory(kind: EngineKind, placed: &Placed) -> (Vec<String>, Vec<(String, String)>) {
    let mut args = Vec::new();
    if matches!(kind, EngineKind::Vllm | EngineKind::Sglang) && !placed.p2p_disabled {
        args.push("--disable-custom-all-reduce".to_string());
    }
    let mut env: Vec<(String, String)> = [
        ("NCCL_CUMEM_ENABLE", "0"),
        ("VLLM_ALLREDUCE_USE_SYMM_MEM", "0"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .to_vec();
    if !placed.p2p_disabled {
        env.push(("NCCL_P2P_DISABLE".to_string(), "1".to_string()));
    }
    (args, env)
}

/// `sglang.launch_server` flags for the placement: `--tp-size` (above 1),
/// `--mem-fraction-static`, `--disable-custom-all-reduce`.
fn sglang_gpu_args(placed: &Placed) -> Vec<String> {
    let mut args = Vec::new();
    if placed.gpus.len() > 1 {
        args.extend(["--tp-size".to_string(), placed.gpus.len().to_string()]);
    }
    if !placed.gpus.is_empty() && placed.gpu_memory_utilization > 0.0 {
        args.extend([
            "--mem-fraction-static".to_string(),
            format!("{}", placed.gpu_memory_utilization),
        ]);
    }
    if placed.p2p_disabled {
        args.push("--disable-custom-all-reduce".to_string());
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn placed() -> Placed {
        Placed {
            gpus: vec![2, 3],
            gpu_memory_utilization: 0.45,
            p2p_disabled: true,
        }
    }

    #[test]
    fn the_models_env_cannot_undo_what_siesta_sets() {
        let cfg = Config::demo(vec!["fake-vllm".into()]);
        let mut m = cfg.models[0].clone();
        m.env = [
            ("NCCL_P2P_DISABLE", "0"),
            ("VLLM_SERVER_DEV_MODE", "0"),
            ("HF_HOME", "/models"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .into();
        let values = |spec: &SpawnSpec, key: &str| -> Vec<String> {
            let set = spec.env.iter().filter(|(k, _)| k == key);
            set.map(|(_, v)| v.clone()).collect()
        };
        // A pair found corrupting data: P2P stays off.
        let spec = spawn_spec(&m, 8000, &placed());
        assert_eq!(values(&spec, "NCCL_P2P_DISABLE"), ["1"]);
        assert_eq!(values(&spec, "VLLM_SERVER_DEV_MODE"), ["1"]);
        assert_eq!(values(&spec, "HF_HOME"), ["/models"]);
        // A healthy pair: siesta sets nothing, the operator's choice stands.
        let mut healthy = placed();
        healthy.p2p_disabled = false;
        let spec = spawn_spec(&m, 8000, &healthy);
        assert_eq!(values(&spec, "NCCL_P2P_DISABLE"), ["0"]);
    }

    #[test]
    fn sglang_gets_its_own_flags_and_no_vllm_ones() {
        let cfg = Config::demo(vec!["fake-vllm".into()]);
        let mut m = cfg.models[0].clone();
        m.engine = EngineKind::Sglang;
        m.launch = Launch::Process {
            command: ["python", "-m", "sglang.launch_server"]
                .map(String::from)
                .to_vec(),
            host: "127.0.0.1".into(),
            port: None,
        };
        m.args = vec!["--trust-remote-code".into()];
        let spec = spawn_spec(&m, 8101, &placed());
        assert_eq!(spec.program, "python");
        assert_eq!(
            spec.args.join(" "),
            "-m sglang.launch_server --model-path Qwen/Qwen3-8B --host 127.0.0.1 --port 8101 \
             --served-model-name chat --enable-memory-saver --enable-weights-cpu-backup \
             --enable-metrics --tp-size 2 --mem-fraction-static 0.45 --disable-custom-all-reduce \
             --trust-remote-code"
        );
        assert!(
            spec.env
                .contains(&("CUDA_VISIBLE_DEVICES".into(), "2,3".into()))
        );
        assert!(!spec.env.iter().any(|(k, _)| k == "VLLM_SERVER_DEV_MODE"));
    }

    #[test]
    fn an_openai_server_runs_exactly_its_command_with_the_address_filled_in() {
        let cfg = Config::demo(vec!["fake-vllm".into()]);
        let mut m = cfg.models[0].clone();
        m.engine = EngineKind::Openai;
        m.name = "ocr".into();
        m.launch = Launch::Process {
            command: vec!["llama-server".into(), "--alias".into(), "{name}".into()],
            host: "127.0.0.1".into(),
            port: None,
        };
        m.args = ["--host", "{host}", "--port", "{port}", "-m", "{model}"]
            .map(String::from)
            .to_vec();
        let spec = spawn_spec(&m, 9000, &placed());
        assert_eq!(spec.program, "llama-server");
        assert_eq!(
            spec.args.join(" "),
            "--alias ocr --host 127.0.0.1 --port 9000 -m Qwen/Qwen3-8B"
        );
        assert!(
            spec.env
                .contains(&("CUDA_VISIBLE_DEVICES".into(), "2,3".into()))
        );
        assert!(!spec.env.iter().any(|(k, _)| k == "VLLM_SERVER_DEV_MODE"));
    }
}

#[cfg(test)]
mod suspend_tests {
    use super::*;
    use crate::config::{Config, IdleAction, IdleTier};
    use std::time::Duration;

    fn two_gpus() -> Placed {
        Placed {
            gpus: vec![0, 1],
            gpu_memory_utilization: 0.3,
            p2p_disabled: false,
        }
    }

    fn model(kind: EngineKind, gpus: u32, suspend: bool) -> ModelConfig {
        let cfg = Config::demo(vec!["fake-vllm".into()]);
        let mut m = cfg.models[0].clone();
        m.engine = kind;
        m.gpus = gpus;
        m.idle = vec![IdleTier {
            after: Duration::from_secs(600),
            action: if suspend {
                IdleAction::Suspend
            } else {
                IdleAction::Stop
            },
        }];
        m
    }

    fn has_env(spec: &SpawnSpec, k: &str, v: &str) -> bool {
        spec.env.contains(&(k.into(), v.into()))
    }

    #[test]
    fn a_multi_gpu_engine_with_a_suspend_tier_shares_no_gpu_memory() {
        let spec = spawn_spec(&model(EngineKind::Vllm, 2, true), 8000, &two_gpus());
        let args = spec.args.join(" ");
        assert!(args.contains("--tensor-parallel-size 2"), "{args}");
        assert_eq!(args.matches("--disable-custom-all-reduce").count(), 1);
        assert!(has_env(&spec, "NCCL_P2P_DISABLE", "1"));
        assert!(has_env(&spec, "NCCL_CUMEM_ENABLE", "0"));
        assert!(has_env(&spec, "VLLM_ALLREDUCE_USE_SYMM_MEM", "0"));

        // P2P already off (a bad pair): the flag and variable once each.
        let mut placed = two_gpus();
        placed.p2p_disabled = true;
        let spec = spawn_spec(&model(EngineKind::Vllm, 2, true), 8000, &placed);
        assert_eq!(
            spec.args
                .join(" ")
                .matches("--disable-custom-all-reduce")
                .count(),
            1
        );
        assert_eq!(
            spec.env
                .iter()
                .filter(|(k, _)| k == "NCCL_P2P_DISABLE")
                .count(),
            1
        );
    }

    #[test]
    fn without_a_suspend_tier_or_on_one_gpu_nothing_changes() {
        for (gpus, suspend) in [(2, false), (1, true)] {
            let spec = spawn_spec(&model(EngineKind::Vllm, gpus, suspend), 8000, &two_gpus());
            assert!(!spec.args.iter().any(|a| a == "--disable-custom-all-reduce"));
            assert!(
                !spec.env.iter().any(|(k, _)| k.starts_with("NCCL_")),
                "{:?}",
                spec.env
            );
        }
    }

    #[test]
    fn an_openai_engine_gets_the_environment_but_never_a_flag() {
        let mut m = model(EngineKind::Openai, 2, true);
        m.args = vec!["--port".into(), "{port}".into()];
        let spec = spawn_spec(&m, 8000, &two_gpus());
        assert!(
            !spec.args.iter().any(|a| a.starts_with("--disable")),
            "{:?}",
            spec.args
        );
        assert!(has_env(&spec, "NCCL_CUMEM_ENABLE", "0"));
        assert!(has_env(&spec, "NCCL_P2P_DISABLE", "1"));
    }
}
