//! One `[[model]]` table → [`ModelConfig`], with `[defaults]` applied.

mod checks;
mod launch;

use super::read::{Problems, Reader, describe, display_key, size_value};
use super::validate::{read_backoff, read_tiers, read_timeouts};
use super::*;
use checks::{check_args, check_env, check_tiers, default_tiers};
use launch::{LaunchRead, read_launch};
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
    let LaunchRead {
        launch,
        kind: launch_kind,
        port,
        command_has_port,
    } = read_launch(p, &mut r, t, engine, &name);
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
    let (max_queue, max_hold) = read_hold(p, &mut r, d.max_queue, d.max_hold);
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

/// `max_queue` and `max_hold`, or the defaults given. Zero is refused: the
/// proxy reads 0 as "not sent" and holds by its own defaults (128, 60 s),
/// so a 0 shown by `siesta get` was not what was enforced.
pub(super) fn read_hold(
    p: &mut Problems,
    r: &mut Reader,
    max_queue: u32,
    max_hold: Duration,
) -> (u32, Duration) {
    let queue = match r.uint(p, "max_queue", u32::MAX as u64) {
        Some(0) => {
            p.push(
                r.key("max_queue"),
                "must be more than 0 (to hold nothing for a model, keep it awake: preload = \"awake\" and no idle tiers)",
            );
            max_queue
        }
        Some(n) => n as u32,
        None => max_queue,
    };
    let hold = match r.duration(p, "max_hold") {
        // Travels in whole milliseconds, where 0 means "not sent".
        Some(d) if d.as_millis() == 0 => {
            p.push(r.key("max_hold"), "must be at least 1ms");
            max_hold
        }
        Some(d) => d,
        None => max_hold,
    };
    (queue, hold)
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/".contains(c))
}
