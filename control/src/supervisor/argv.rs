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
/// Every kind gets the placement's `CUDA_VISIBLE_DEVICES` and the model's env.
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
    env.extend(cfg.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    SpawnSpec {
        program: command[0].clone(),
        args,
        env,
    }
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
