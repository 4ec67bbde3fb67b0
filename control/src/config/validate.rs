//! TOML text → [`Config`], collecting every problem.

use super::read::{Problems, Reader, describe, size_value};
use super::*;
use std::collections::BTreeSet;
use toml::Value;

pub(super) fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let mut p = Problems::default();
    let root: toml::Table = match toml::from_str(text) {
        Ok(t) => t,
        Err(e) => {
            let at = e
                .span()
                .map(|s| {
                    let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
                    format!("line {line}")
                })
                .unwrap_or_default();
            p.push(at, e.message().replace('\n', " "));
            return Err(ConfigError {
                origin: origin.to_string(),
                problems: p.0,
            });
        }
    };
    let mut r = Reader::new("", &root);
    let control = r
        .table(&mut p, "control")
        .map(|t| read_control(&mut p, t))
        .unwrap_or_else(|| read_control(&mut p, &toml::Table::new()));
    let defaults = r
        .table(&mut p, "defaults")
        .map(|t| read_defaults(&mut p, t))
        .unwrap_or_else(|| read_defaults(&mut p, &toml::Table::new()));
    let gpus: Vec<GpuConfig> = r
        .tables(&mut p, "gpu")
        .into_iter()
        .filter_map(|(path, t)| read_gpu(&mut p, path, t))
        .collect();
    let models: Vec<ModelConfig> = r
        .tables(&mut p, "model")
        .into_iter()
        .filter_map(|(path, t)| read_model(&mut p, &defaults, &gpus, path, t))
        .collect();
    r.finish(&mut p);
    check_names(&mut p, &models);
    let mut seen = BTreeSet::new();
    for (i, g) in gpus.iter().enumerate() {
        if !seen.insert(g.index) {
            p.push(
                format!("gpu[{i}].index"),
                format!("GPU {} is listed twice", g.index),
            );
        }
    }
    if p.0.is_empty() {
        Ok(Config {
            origin: origin.to_string(),
            path: None,
            control,
            defaults,
            gpus,
            models,
        })
    } else {
        Err(ConfigError {
            origin: origin.to_string(),
            problems: p.0,
        })
    }
}

fn default_state_dir() -> PathBuf {
    if nix::unistd::Uid::effective().is_root() {
        return PathBuf::from("/var/lib/siesta");
    }
    match std::env::var_os("XDG_STATE_HOME").or_else(|| std::env::var_os("HOME")) {
        Some(base) if std::env::var_os("XDG_STATE_HOME").is_some() => {
            PathBuf::from(base).join("siesta")
        }
        Some(home) => PathBuf::from(home).join(".local/state/siesta"),
        None => PathBuf::from("/var/lib/siesta"),
    }
}

/// The host name (for `control_id`).
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "siesta".to_string())
}

fn read_control(p: &mut Problems, t: &toml::Table) -> ControlConfig {
    let mut r = Reader::new("control", t);
    let listen = r.string(p, "listen").and_then(|s| match s.parse() {
        Ok(a) => Some(a),
        Err(_) => {
            p.push(
                "control.listen",
                format!("{s:?} is not an address like \"127.0.0.1:50051\""),
            );
            None
        }
    });
    let state_dir = r.string(p, "state_dir").map(PathBuf::from);
    let token = r.string(p, "token").filter(|t| !t.is_empty());
    let control_id = r.string(p, "control_id").filter(|s| !s.is_empty());
    r.finish(p);
    ControlConfig {
        listen: listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 50051))),
        state_dir: state_dir.unwrap_or_else(default_state_dir),
        token,
        control_id: control_id.unwrap_or_else(host_name),
    }
}

fn read_timeouts(p: &mut Problems, r: &mut Reader<'_>, base: Timeouts) -> Timeouts {
    let mut t = base;
    for (key, slot) in [
        ("start_timeout", &mut t.start),
        ("wake_timeout", &mut t.wake),
        ("sleep_timeout", &mut t.sleep),
        ("stop_grace", &mut t.stop_grace),
    ] {
        if let Some(d) = r.duration(p, key) {
            if d.is_zero() {
                p.push(r.key(key), "must be more than 0");
            } else {
                *slot = d;
            }
        }
    }
    t
}

fn read_backoff(p: &mut Problems, r: &mut Reader<'_>, base: Backoff) -> Backoff {
    let mut b = base;
    if let Some(d) = r.duration(p, "backoff_initial") {
        b.initial = d.max(Duration::from_millis(10));
    }
    if let Some(d) = r.duration(p, "backoff_max") {
        b.max = d;
    }
    if b.max < b.initial {
        p.push(r.key("backoff_max"), "is less than backoff_initial");
    }
    b
}

fn read_defaults(p: &mut Problems, t: &toml::Table) -> Defaults {
    let mut r = Reader::new("defaults", t);
    let idle = read_tiers(p, &mut r).unwrap_or_else(|| {
        vec![
            IdleTier {
                after: Duration::from_secs(15 * 60),
                action: IdleAction::Sleep(1),
            },
            IdleTier {
                after: Duration::from_secs(3 * 3600),
                action: IdleAction::Sleep(2),
            },
        ]
    });
    let max_queue = r.uint(p, "max_queue", u32::MAX as u64).unwrap_or(64) as u32;
    let max_hold = r
        .duration(p, "max_hold")
        .unwrap_or(Duration::from_secs(300));
    let timeouts = read_timeouts(p, &mut r, Timeouts::default());
    let backoff = read_backoff(p, &mut r, Backoff::default());
    r.finish(p);
    Defaults {
        idle,
        max_queue,
        max_hold,
        timeouts,
        backoff,
    }
}

fn read_tiers(p: &mut Problems, r: &mut Reader<'_>) -> Option<Vec<IdleTier>> {
    r.raw("idle")?;
    let mut tiers = Vec::new();
    for (path, t) in r.tables(p, "idle") {
        let mut tr = Reader::new(path.clone(), t);
        let after = tr.duration(p, "after");
        if after.is_none() && t.get("after").is_none() {
            p.push(tr.key("after"), "is missing");
        }
        let level = tr.uint(p, "level", 255);
        let action = match tr.string(p, "action").as_deref() {
            Some("sleep") => match level.unwrap_or(1) {
                l @ (1 | 2) => Some(IdleAction::Sleep(l as u8)),
                l => {
                    p.push(
                        tr.key("level"),
                        format!("{l} is not a sleep level (1 or 2)"),
                    );
                    None
                }
            },
            Some("stop") => {
                if level.is_some() {
                    p.push(tr.key("level"), "only applies to action = \"sleep\"");
                }
                Some(IdleAction::Stop)
            }
            Some(other) => {
                p.push(
                    tr.key("action"),
                    format!("{other:?} is not \"sleep\" or \"stop\""),
                );
                None
            }
            None => {
                if t.get("action").is_none() {
                    p.push(tr.key("action"), "is missing (\"sleep\" or \"stop\")");
                }
                None
            }
        };
        tr.finish(p);
        if let (Some(after), Some(action)) = (after, action) {
            if let Some(prev) = tiers.last().map(|t: &IdleTier| t.after)
                && after <= prev
            {
                p.push(
                    format!("{path}.after"),
                    "tiers must be in increasing order of `after`",
                );
            }
            tiers.push(IdleTier { after, action });
        }
    }
    Some(tiers)
}

fn read_gpu(p: &mut Problems, path: String, t: &toml::Table) -> Option<GpuConfig> {
    let mut r = Reader::new(path, t);
    let index = r.uint(p, "index", u32::MAX as u64);
    if index.is_none() && t.get("index").is_none() {
        p.push(r.key("index"), "is missing");
    }
    let name = r.string(p, "name").unwrap_or_default();
    let key = r.key("memory");
    let memory = match r.raw("memory") {
        Some(v) => size_value(p, &key, v),
        None => {
            p.push(key, "is missing (bytes, or a size like \"80GiB\")");
            None
        }
    };
    r.finish(p);
    Some(GpuConfig {
        index: index? as u32,
        name,
        memory_bytes: memory?,
    })
}

fn read_model(
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
    let model = r.string(p, "model");
    let launch_kind = r.string(p, "launch").unwrap_or_else(|| "process".into());
    let executable = r.string(p, "executable");
    let command = r.strings(p, "command");
    let url = r.string(p, "url");
    let host = r.string(p, "host");
    let port = r.uint(p, "port", 65535).map(|n| n as u16);
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
                (None, None) => Some(vec!["vllm".to_string()]),
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
    let env = match r.table(p, "env") {
        None => BTreeMap::new(),
        Some(t) => t
            .iter()
            .filter_map(|(k, v)| match v {
                Value::String(s) => Some((k.clone(), s.clone())),
                v => {
                    p.push(
                        format!("{}.{k}", r.key("env")),
                        format!("expected a string, found {}", describe(v)),
                    );
                    None
                }
            })
            .collect(),
    };
    let gpu_ids = r.uints(p, "gpu_ids").unwrap_or_default();
    let gpus_n = r.uint(p, "gpus", 64).map(|n| n as u32);
    let gpu_count = gpus_n.unwrap_or(if gpu_ids.is_empty() {
        1
    } else {
        gpu_ids.len() as u32
    });
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
        other => size_value(p, &r.key("gpu_memory"), other).map(GpuMemory::Bytes),
    });
    let exclusive = r.boolean(p, "exclusive").unwrap_or(false);
    let idle = read_tiers(p, &mut r).unwrap_or_else(|| d.idle.clone());
    let preload = match r.string(p, "preload").as_deref() {
        None | Some("none") => Preload::None,
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
    if model.is_none() && t.get("model").is_none() && launch_kind == "process" {
        p.push(r.key("model"), "is missing (what `vllm serve` loads)");
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

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/".contains(c))
}

fn check_names(p: &mut Problems, models: &[ModelConfig]) {
    let mut owner: BTreeMap<&str, String> = BTreeMap::new();
    for (i, m) in models.iter().enumerate() {
        let names = std::iter::once((format!("model[{i}].name"), m.name.as_str())).chain(
            m.aliases
                .iter()
                .enumerate()
                .map(move |(j, a)| (format!("model[{i}].aliases[{j}]"), a.as_str())),
        );
        for (key, n) in names {
            if let Some(prev) = owner.get(n) {
                p.push(key, format!("{n:?} is already used by {prev}"));
            } else {
                owner.insert(n, key);
            }
        }
    }
}
