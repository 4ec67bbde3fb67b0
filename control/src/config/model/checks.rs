//! Checks of a `[[model]]`'s idle tiers, `args` and `env` against its
//! engine kind, and the `[defaults]` tiers made to fit the kind.

use super::super::read::Problems;
use super::super::*;

/// Refuses a tier the engine kind cannot do, naming the ones it has.
pub(super) fn check_tiers(
    p: &mut Problems,
    key: &str,
    engine: EngineKind,
    attach: bool,
    tiers: &[IdleTier],
) {
    for (i, t) in tiers.iter().enumerate() {
        if engine.can(t.action, attach) {
            continue;
        }
        let asked = match t.action {
            IdleAction::Sleep(l) => format!("sleep at level {l}"),
            IdleAction::Stop => "stop (an attached engine is run by someone else)".to_string(),
            IdleAction::Suspend => {
                "suspend (siesta does not own an attached engine's processes)".to_string()
            }
        };
        let launch = if attach { "attached " } else { "" };
        p.push(
            format!("{key}[{i}].action"),
            format!(
                "an {launch}engine = \"{engine}\" cannot {asked}; its idle tiers can be: {}",
                engine.actions(attach)
            ),
        );
    }
}

/// `[defaults]` tiers made to fit the kind: a sleep level it lacks becomes
/// its deepest sleep (dropped when that tier is already there), or `stop`
/// for an engine that cannot sleep; nothing follows a `stop`. An attached
/// engine that can do nothing gets no tiers.
pub(super) fn default_tiers(engine: EngineKind, attach: bool, tiers: &[IdleTier]) -> Vec<IdleTier> {
    let mut out: Vec<IdleTier> = Vec::new();
    for t in tiers {
        let action = match t.action {
            a if engine.can(a, attach) => a,
            IdleAction::Sleep(_) => match engine.deepest_sleep() {
                Some(l) => IdleAction::Sleep(l),
                None if attach => continue,
                None => IdleAction::Stop,
            },
            IdleAction::Stop | IdleAction::Suspend => continue,
        };
        if out
            .iter()
            .any(|o| o.action == action || o.action == IdleAction::Stop)
        {
            continue;
        }
        out.push(IdleTier {
            after: t.after,
            action,
        });
    }
    out
}

/// Flags siesta puts on an engine's command line, by the key that sets
/// them: given again in `args` they would win (they come last) and the
/// engine would listen, serve or use GPUs other than siesta probes, routes
/// and places. vLLM also takes `_` for `-` in a flag's name.
const VLLM_FLAGS: &[(&[&str], &str, &str)] = &[
    (&["--host"], "host", ""),
    (&["--port"], "port", " (the port it probes and routes to)"),
    (
        &["--served-model-name"],
        "name",
        " (what the proxies ask for)",
    ),
    (&["--model"], "model", ""),
    (
        &["--tensor-parallel-size", "-tp"],
        "gpus",
        " (the GPUs placement counts)",
    ),
    (
        &["--gpu-memory-utilization"],
        "gpu_memory",
        " (the memory placement counts)",
    ),
];
const SGLANG_FLAGS: &[(&[&str], &str, &str)] = &[
    (&["--host"], "host", ""),
    (&["--port"], "port", " (the port it probes and routes to)"),
    (
        &["--served-model-name"],
        "name",
        " (what the proxies ask for)",
    ),
    (&["--model-path", "--model"], "model", ""),
    (
        &["--tp-size", "--tensor-parallel-size"],
        "gpus",
        " (the GPUs placement counts)",
    ),
    (
        &["--mem-fraction-static"],
        "gpu_memory",
        " (the memory placement counts)",
    ),
];

/// Flags that spread an engine over more GPUs than `gpus` (pipeline, data
/// or prefill-context parallel): siesta places `gpus` GPUs, makes only
/// those visible and runs tensor parallel over all of them, so the engine
/// would fail to start, or take GPUs placement gave another model. (A fake
/// engine ignored them, and such a model passed every test.)
const VLLM_MORE_GPUS: &[&str] = &[
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--data-parallel-size-local",
    "-dpl",
    "--prefill-context-parallel-size",
    "-pcp",
];
const SGLANG_MORE_GPUS: &[&str] = &[
    "--pp-size",
    "--pipeline-parallel-size",
    "--dp-size",
    "--data-parallel-size",
];

/// Engine flags in `args` that siesta sets itself or cannot work with.
pub(super) fn check_args(p: &mut Problems, key: &str, engine: EngineKind, args: &[String]) {
    let (owned, more_gpus) = match engine {
        EngineKind::Vllm => (VLLM_FLAGS, VLLM_MORE_GPUS),
        EngineKind::Sglang => (SGLANG_FLAGS, SGLANG_MORE_GPUS),
        EngineKind::Openai => return,
    };
    for a in args {
        let written = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
        let flag = match written.strip_prefix("--") {
            Some(name) if engine == EngineKind::Vllm => format!("--{}", name.replace('_', "-")),
            _ => written.to_string(),
        };
        if let Some((_, k, why)) = owned
            .iter()
            .find(|(flags, ..)| flags.contains(&flag.as_str()))
        {
            p.push(
                key,
                format!("{written} is set by siesta from `{k}`{why}: set `{k}` instead"),
            );
        }
        if more_gpus.contains(&flag.as_str()) {
            p.push(
                key,
                format!(
                    "{written} spreads the engine over more GPUs than `gpus` places (siesta runs \
                     it tensor parallel over exactly those GPUs): remove it, and set `gpus` to \
                     the GPUs it needs"
                ),
            );
        }
        if engine != EngineKind::Vllm {
            continue;
        }
        match flag.as_str() {
            "--disable-log-stats" => p.push(
                key,
                "--disable-log-stats removes the vllm: metrics siesta needs for activity and sleep level; remove it",
            ),
            "--no-enable-sleep-mode" => p.push(
                key,
                format!("{written} turns off the sleep mode siesta starts vLLM with; remove it"),
            ),
            "--api-key" => p.push(key, VLLM_API_KEY_REFUSED),
            // siesta probes, drives and forwards to engines in plain HTTP.
            "--ssl-keyfile" | "--ssl-certfile" => p.push(
                key,
                format!(
                    "{written} makes vLLM speak only HTTPS, and siesta reaches its engines in \
                     plain HTTP (on `host`); remove it"
                ),
            ),
            "--headless" => p.push(
                key,
                "--headless serves no HTTP at all: siesta could not probe, wake or forward to it; remove it",
            ),
            _ => {}
        }
    }
}

/// vLLM with an API key answers 401 on every `/v1` path without it, and
/// siesta-proxy forwards no key of its own (with its own `--api-key` it
/// takes the client's off): every request the proxy accepts would be
/// refused. (Its health, metrics and sleep routes stay open, so the model
/// looks healthy.)
const VLLM_API_KEY_REFUSED: &str = "an engine API key makes vLLM refuse (401) every request \
     siesta-proxy forwards, which carries no engine key: keep the engine on a private `host` \
     and give clients keys with siesta-proxy's --api-key instead; remove it";

/// Environment siesta sets for a process engine itself: placement's GPUs
/// (when it has any), and vLLM's dev mode (its sleep routes).
pub(super) fn check_env(
    p: &mut Problems,
    key: &str,
    engine: EngineKind,
    gpus: u32,
    env: &BTreeMap<String, String>,
) {
    if gpus > 0 {
        for var in ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"] {
            if env.contains_key(var) {
                p.push(
                    format!("{key}.{var}"),
                    "is set by placement (to the GPUs it picks; pin them with `gpu_ids`); remove it",
                );
            }
        }
    }
    if engine == EngineKind::Vllm && env.contains_key("VLLM_API_KEY") {
        p.push(format!("{key}.VLLM_API_KEY"), VLLM_API_KEY_REFUSED);
    }
    if engine == EngineKind::Vllm && env.get("VLLM_SERVER_DEV_MODE").is_some_and(|v| v != "1") {
        p.push(
            format!("{key}.VLLM_SERVER_DEV_MODE"),
            "siesta sets it to 1: without it vLLM has no sleep routes; remove it",
        );
    }
}
