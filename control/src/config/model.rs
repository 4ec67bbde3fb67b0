//! One `[[model]]` table → [`ModelConfig`], with `[defaults]` applied.

use super::read::{Problems, Reader, describe, display_key, size_value};
use super::validate::{read_backoff, read_tiers, read_timeouts};
use super::*;
use toml::Value;

/// A byte-sized `gpu_memory` below this is a slip (no engine loads in 1 MiB).
const MIN_GPU_MEMORY_BYTES: i64 = 1 << 20;

pub(super) fn read_model(
    p: &mut Problems,
    d: &Defaults,
    gpus: &[GpuConfig],
    path: String,
    t: &toml::Table,
) -> Option<ModelConfig> {
    let before = p.0.len();
    let mut r = Reader::new(path, t);
    let name = r.string(p, "name");
    match &name {
        None if t.get("name").is_none() => p.push(r.key("name"), "is missing"),
        Some(n) if !valid_name(n) => p.push(
            r.key("name"),
            format!("{n:?} must be non-empty and use only letters, digits and -_.:/"),
        ),
        _ => {}
    }
    let aliases = r.strings(p, "aliases").unwrap_or_default();
    for a in aliases.iter().filter(|a| !valid_name(a)) {
        p.push(
            r.key("aliases"),
            format!("{a:?} must be non-empty and use only letters, digits and -_.:/"),
        );
    }
    let engine = match r.string(p, "engine").as_deref() {
        None => EngineKind::Vllm,
        Some(e) => EngineKind::parse(e).unwrap_or_else(|| {
            p.push(
                r.key("engine"),
                format!("{e:?} is not \"vllm\", \"sglang\" or \"openai\""),
            );
            EngineKind::Vllm
        }),
    };
    let health_path = match r.string(p, "health_path") {
        Some(h) if engine != EngineKind::Openai => {
            p.push(
                r.key("health_path"),
                format!(
                    "only applies to engine = \"openai\" (engine = \"{engine}\" is probed on its own health route)"
                ),
            );
            h
        }
        Some(h) if !h.starts_with('/') => {
            p.push(
                r.key("health_path"),
                format!("{h:?} must be a path starting with \"/\""),
            );
            h
        }
        Some(h) => h,
        None => "/health".to_string(),
    };
    let model = r.string(p, "model");
    let launch_kind = r.string(p, "launch").unwrap_or_else(|| "process".into());
    let executable = r.string(p, "executable");
    let command = r.strings(p, "command");
    let command_has_port = command
        .as_ref()
        .is_some_and(|c| c.iter().any(|a| a.contains("{port}")));
    let url = r.string(p, "url");
    let host = r.string(p, "host");
    if let Some(h) = host.as_deref().filter(|h| h.starts_with('['))
        && launch_kind == "process"
    {
        let bare = h.trim_start_matches('[').trim_end_matches(']');
        p.push(
            r.key("host"),
            format!("{h:?} is in brackets: write the address alone ({bare:?})"),
        );
    }
    let port = r.uint(p, "port", 65535).map(|n| n as u16);
    if port == Some(0) {
        // The engine would bind any free port while siesta probes port 0.
        p.push(
            r.key("port"),
            "0 is not a port an engine can be reached on: leave `port` out and siesta picks a \
             free one",
        );
    }
    let served = r.string(p, "served_model_name");
    let launch = match launch_kind.as_str() {
        "process" => {
            if url.is_some() {
                p.push(r.key("url"), "only applies to launch = \"attach\"");
            }
            if served.is_some() {
                p.push(
                    r.key("served_model_name"),
                    "only applies to launch = \"attach\" (process engines serve under `name`)",
                );
            }
            let command = match (executable, command) {
                (Some(_), Some(_)) => {
                    p.push(
                        r.key("command"),
                        "set either `executable` or `command`, not both",
                    );
                    None
                }
                (Some(e), None) if e.is_empty() => {
                    p.push(r.key("executable"), "is empty");
                    None
                }
                (Some(e), None) => Some(vec![e]),
                (None, Some(c)) if c.is_empty() => {
                    p.push(r.key("command"), "is empty");
                    None
                }
                (None, Some(c)) => Some(c),
                (None, None) => match engine.default_command() {
                    Some(c) => Some(c),
                    None => {
                        p.push(
                            r.key("command"),
                            "is required with engine = \"openai\" (`executable` + `args`, or `command`: \
                             the server to run; siesta adds no arguments of its own, `{port}` and \
                             `{host}` in them are replaced)",
                        );
                        None
                    }
                },
            };
            command.map(|command| Launch::Process {
                command,
                host: host.unwrap_or_else(|| "127.0.0.1".into()),
                port,
            })
        }
        "attach" => {
            for (k, set) in [
                ("executable", executable.is_some()),
                ("command", command.is_some()),
                ("host", host.is_some()),
                ("port", port.is_some()),
            ] {
                if set {
                    p.push(
                        r.key(k),
                        "does not apply to launch = \"attach\" (use `url`)",
                    );
                }
            }
            // Given, they were dropped without a word.
            for k in ["args", "env"].into_iter().filter(|k| t.contains_key(*k)) {
                p.push(
                    r.key(k),
                    "does not apply to launch = \"attach\": siesta does not start the engine",
                );
            }
            match url {
                Some(u) if u.starts_with("http://") || u.starts_with("https://") => {
                    Some(Launch::Attach {
                        url: u.trim_end_matches('/').to_string(),
                        served_model_name: served
                            .clone()
                            .or_else(|| name.clone())
                            .unwrap_or_default(),
                    })
                }
                Some(u) => {
                    p.push(r.key("url"), format!("{u:?} is not an http:// URL"));
                    None
                }
                None => {
                    p.push(r.key("url"), "is required with launch = \"attach\"");
                    None
                }
            }
        }
        other => {
            p.push(
                r.key("launch"),
                format!("{other:?} is not \"process\" or \"attach\""),
            );
            None
        }
    };
    let args = r.strings(p, "args").unwrap_or_default();
    if launch_kind == "process" {
        check_args(p, &r.key("args"), engine, &args);
    }
    if launch_kind == "process"
        && engine == EngineKind::Openai
        && port.is_none()
        && !command_has_port
        && !args.iter().any(|a| a.contains("{port}"))
    {
        p.push(
            r.key("args"),
            "an engine = \"openai\" gets no --port from siesta: pass the port siesta picks \
             with \"{port}\" in `args`, or set `port` to the one the server listens on",
        );
    }
    let env = match r.table(p, "env") {
        None => BTreeMap::new(),
        Some(t) => t
            .iter()
            .filter_map(|(k, v)| match v {
                Value::String(s) => Some((k.clone(), s.clone())),
                v => {
                    p.push(
                        format!("{}.{}", r.key("env"), display_key(k)),
                        format!("expected a string, found {}", describe(v)),
                    );
                    None
                }
            })
            .collect(),
    };
    if engine == EngineKind::Vllm
        && env
            .get("PYTORCH_CUDA_ALLOC_CONF")
            .is_some_and(|v| v.contains("expandable_segments:True"))
    {
        p.push(
            format!("{}.PYTORCH_CUDA_ALLOC_CONF", r.key("env")),
            "expandable_segments:True makes vLLM's sleep free no GPU memory; remove it",
        );
    }
    let gpu_ids = r.uints(p, "gpu_ids").unwrap_or_default();
    let gpus_n = r.uint(p, "gpus", 64).map(|n| n as u32);
    let gpu_count = gpus_n.unwrap_or(if gpu_ids.is_empty() {
        1
    } else {
        gpu_ids.len() as u32
    });
    if launch_kind == "process" {
        check_env(p, &r.key("env"), engine, gpu_count, &env);
    }
    if !gpu_ids.is_empty() && gpu_ids.len() as u32 != gpu_count {
        p.push(
            r.key("gpu_ids"),
            format!("lists {} GPUs but gpus = {gpu_count}", gpu_ids.len()),
        );
    }
    if !gpus.is_empty() {
        for (i, id) in gpu_ids.iter().enumerate() {
            if !gpus.iter().any(|g| g.index == *id) {
                p.push(
                    format!("{}[{i}]", r.key("gpu_ids")),
                    format!("GPU {id} is not in [[gpu]]"),
                );
            }
        }
    }
    let gpu_memory = r.raw("gpu_memory").and_then(|v| match v {
        Value::Float(f) if *f > 0.0 && *f <= 1.0 => Some(GpuMemory::Fraction(*f)),
        Value::Float(f) => {
            p.push(
                r.key("gpu_memory"),
                format!("{f} is not a fraction in (0, 1]"),
            );
            None
        }
        Value::Integer(n @ 0..=1) => {
            // `gpu_memory = 1` meant the whole GPU, not one byte.
            p.push(
                r.key("gpu_memory"),
                format!(
                    "{n} would be {n} byte(s): write a fraction such as {n}.0, or a size such \
                     as \"40GiB\""
                ),
            );
            None
        }
        Value::Integer(n) if *n < MIN_GPU_MEMORY_BYTES => {
            p.push(
                r.key("gpu_memory"),
                format!(
                    "{n} bytes is too little for any engine (under 1 MiB): write a fraction \
                     such as 0.5, or a size such as \"40GiB\""
                ),
            );
            None
        }
        other => size_value(p, &r.key("gpu_memory"), other).map(GpuMemory::Bytes),
    });
    let exclusive = r.boolean(p, "exclusive").unwrap_or(false);
    let attach = launch_kind == "attach";
    let idle = match read_tiers(p, &mut r) {
        Some(tiers) => {
            check_tiers(p, &r.key("idle"), engine, attach, &tiers);
            tiers
        }
        None => default_tiers(engine, attach, &d.idle),
    };
    let preload = match r.string(p, "preload").as_deref() {
        None | Some("none") => Preload::None,
        Some("asleep") if engine.deepest_sleep().is_none() => {
            p.push(
                r.key("preload"),
                format!(
                    "\"asleep\" is not possible: engine = \"{engine}\" cannot sleep (preload can be \"none\" or \"awake\")"
                ),
            );
            Preload::None
        }
        Some("asleep") => Preload::Asleep,
        Some("awake") => Preload::Awake,
        Some(o) => {
            p.push(
                r.key("preload"),
                format!("{o:?} is not \"none\", \"asleep\" or \"awake\""),
            );
            Preload::None
        }
    };
    let max_queue = r
        .uint(p, "max_queue", u32::MAX as u64)
        .map_or(d.max_queue, |n| n as u32);
    let max_hold = r.duration(p, "max_hold").unwrap_or(d.max_hold);
    let timeouts = read_timeouts(p, &mut r, d.timeouts);
    let backoff = read_backoff(p, &mut r, d.backoff);
    if model.is_none()
        && t.get("model").is_none()
        && launch_kind == "process"
        && engine != EngineKind::Openai
    {
        let what = match engine {
            EngineKind::Sglang => "what `sglang.launch_server --model-path` loads",
            _ => "what `vllm serve` loads",
        };
        p.push(r.key("model"), format!("is missing ({what})"));
    }
    r.finish(p);
    if p.0.len() > before {
        return None;
    }
    let name = name?;
    Some(ModelConfig {
        model: model.unwrap_or_else(|| name.clone()),
        name,
        aliases,
        engine,
        health_path,
        launch: launch?,
        args,
        env,
        gpus: gpu_count,
        gpu_memory,
        gpu_ids,
        exclusive,
        idle,
        preload,
        max_queue,
        max_hold,
        timeouts,
        backoff,
    })
}

/// Refuses a tier the engine kind cannot do, naming the ones it has.
fn check_tiers(p: &mut Problems, key: &str, engine: EngineKind, attach: bool, tiers: &[IdleTier]) {
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
fn default_tiers(engine: EngineKind, attach: bool, tiers: &[IdleTier]) -> Vec<IdleTier> {
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
fn check_args(p: &mut Problems, key: &str, engine: EngineKind, args: &[String]) {
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
            _ => {}
        }
    }
}

/// Environment siesta sets for a process engine itself: placement's GPUs
/// (when it has any), and vLLM's dev mode (its sleep routes).
fn check_env(
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
    if engine == EngineKind::Vllm && env.get("VLLM_SERVER_DEV_MODE").is_some_and(|v| v != "1") {
        p.push(
            format!("{key}.VLLM_SERVER_DEV_MODE"),
            "siesta sets it to 1: without it vLLM has no sleep routes; remove it",
        );
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/".contains(c))
}
