//! TOML text → [`Config`], collecting every problem.

use super::model::read_model;
use super::read::{Problems, Reader, size_value};
use super::*;
use std::collections::BTreeSet;
use std::net::IpAddr;

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
            // What the error is about, when it is a short piece of one line
            // (toml says only "duplicate key": this names it).
            let what = e
                .span()
                .and_then(|s| text.get(s))
                .map(str::trim)
                .filter(|w| !w.is_empty() && w.len() <= 80 && !w.contains('\n'))
                .map(|w| format!(" (`{w}`)"))
                .unwrap_or_default();
            p.push(
                at,
                format!("{}{what}", e.message().trim_end().replace('\n', " ")),
            );
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
    let model_tables = r.tables(&mut p, "model");
    let indexed: Vec<(usize, ModelConfig)> = model_tables
        .iter()
        .enumerate()
        .filter_map(|(i, (path, t))| {
            Some((i, read_model(&mut p, &defaults, &gpus, path.clone(), t)?))
        })
        .collect();
    r.finish(&mut p);
    // Every model's names, also those of a model with problems of its own
    // (as written): a clash was shown only once the rest was fixed.
    let names: Vec<Names> = model_tables
        .iter()
        .enumerate()
        .filter_map(|(i, (_, t))| match indexed.iter().find(|(j, _)| *j == i) {
            Some((_, m)) => Some((i, m.name.clone(), m.aliases.clone())),
            None => written_names(t).map(|(n, a)| (i, n, a)),
        })
        .collect();
    check_names(&mut p, &names);
    check_ports(&mut p, &control, &indexed);
    let models: Vec<ModelConfig> = indexed.into_iter().map(|(_, m)| m).collect();
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
    let web_listen = r.string(p, "web_listen").and_then(|s| match s.parse() {
        Ok(a) => Some(a),
        Err(_) => {
            p.push(
                "control.web_listen",
                format!("{s:?} is not an address like \"127.0.0.1:9091\""),
            );
            None
        }
    });
    // Relative, it would be wherever the daemon was started (`/` under
    // systemd), which `siesta config check` run elsewhere cannot see.
    let state_dir = match r.string(p, "state_dir").map(PathBuf::from) {
        Some(d) if !d.is_absolute() => {
            p.push(
                r.key("state_dir"),
                format!(
                    "{:?} is not an absolute path (a relative one would depend on the directory \
                     the daemon is started in)",
                    d.display().to_string()
                ),
            );
            None
        }
        d => d,
    };
    let cuda_checkpoint = match r.string(p, "cuda_checkpoint") {
        Some(s) if s.is_empty() => {
            p.push(
                r.key("cuda_checkpoint"),
                "is empty (a path to siesta-cuda-checkpoint)",
            );
            None
        }
        s => s.map(PathBuf::from),
    };
    let token = r.string(p, "token").filter(|t| !t.is_empty());
    let control_id = r.string(p, "control_id").filter(|s| !s.is_empty());
    let p2p_probe = read_p2p_probe(p, &mut r);
    let residual_key = r.key("asleep_residual");
    let asleep_residual = r
        .raw("asleep_residual")
        .and_then(|v| size_value(p, &residual_key, v));
    let min_awake = match r.duration(p, "min_awake") {
        // A wake waits at most ROOM_WAIT for room, and a model woken less
        // than `min_awake` ago is neither put to sleep nor made to yield
        // for it: half of that leaves the wake its chance.
        Some(d) if d >= super::ROOM_WAIT / 2 => {
            let key = r.key("min_awake");
            p.push(
                key,
                format!(
                    "must be less than {} s (a model woken that recently is never put to sleep \
                     for another, and a wake waits at most {} s for room: every wake onto its \
                     GPUs would give up)",
                    (super::ROOM_WAIT / 2).as_secs(),
                    super::ROOM_WAIT.as_secs()
                ),
            );
            super::DEFAULT_MIN_AWAKE
        }
        d => d.unwrap_or(super::DEFAULT_MIN_AWAKE),
    };
    let yield_after = read_yield_after(p, &mut r);
    let engine_idle_timeout = match r.duration(p, "engine_idle_timeout") {
        Some(d) if d.is_zero() => {
            p.push(r.key("engine_idle_timeout"), "must be more than 0");
            None
        }
        d => d,
    };
    let gpu_detect_timeout = match r.duration(p, "gpu_detect_timeout") {
        Some(d) if d.is_zero() => {
            p.push(r.key("gpu_detect_timeout"), "must be more than 0");
            None
        }
        d => d,
    };
    r.finish(p);
    ControlConfig {
        listen: listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 50051))),
        state_dir: state_dir.unwrap_or_else(default_state_dir),
        token,
        control_id: control_id.unwrap_or_else(host_name),
        p2p_probe,
        gpu_detect_timeout: gpu_detect_timeout.unwrap_or(super::DEFAULT_GPU_DETECT_TIMEOUT),
        asleep_residual,
        min_awake,
        yield_after,
        engine_idle_timeout: engine_idle_timeout.unwrap_or(super::DEFAULT_ENGINE_IDLE_TIMEOUT),
        web_listen,
        cuda_checkpoint,
    }
}

/// `yield_after`: a duration above 0, or `"off"`.
fn read_yield_after(p: &mut Problems, r: &mut Reader<'_>) -> Option<Duration> {
    let key = r.key("yield_after");
    match r.raw("yield_after") {
        None => Some(super::DEFAULT_YIELD_AFTER),
        Some(toml::Value::String(s)) if s == "off" => None,
        Some(v) => match super::read::duration_value(p, &key, v) {
            Some(d) if d.is_zero() => {
                p.push(
                    key,
                    "must be more than 0 (\"off\" lets a busy model keep its GPUs until it is idle)",
                );
                Some(super::DEFAULT_YIELD_AFTER)
            }
            Some(d) if d >= super::ROOM_WAIT => {
                p.push(
                    key,
                    format!(
                        "must be less than {} s (how long a wake waits for room: it would give \
                         up before any busy model yields)",
                        super::ROOM_WAIT.as_secs()
                    ),
                );
                Some(super::DEFAULT_YIELD_AFTER)
            }
            d => d.or(Some(super::DEFAULT_YIELD_AFTER)),
        },
    }
}

fn read_p2p_probe(p: &mut Problems, r: &mut Reader<'_>) -> P2pProbeConfig {
    let mut c = P2pProbeConfig::default();
    match r.string(p, "p2p_probe").as_deref() {
        None | Some("start") => {}
        Some("off") => c.at_start = false,
        Some(other) => p.push(
            r.key("p2p_probe"),
            format!("{other:?} is not \"start\" or \"off\""),
        ),
    }
    let key = r.key("p2p_probe_bytes");
    if let Some(b) = r
        .raw("p2p_probe_bytes")
        .and_then(|v| size_value(p, &key, v))
    {
        c.bytes = b;
    }
    match r.duration(p, "p2p_probe_timeout") {
        Some(d) if d.is_zero() => p.push(r.key("p2p_probe_timeout"), "must be more than 0"),
        Some(d) if d > super::PROBE_TIMEOUT_MAX => p.push(
            r.key("p2p_probe_timeout"),
            format!(
                "{} is more than {}: probes run one at a time, and a hung one holds the next until its deadline",
                humantime::format_duration(d),
                humantime::format_duration(super::PROBE_TIMEOUT_MAX)
            ),
        ),
        Some(d) => c.timeout = d,
        None => {}
    }
    c
}

pub(super) fn read_timeouts(p: &mut Problems, r: &mut Reader<'_>, base: Timeouts) -> Timeouts {
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

/// The shortest `backoff_initial`.
const BACKOFF_FLOOR: Duration = Duration::from_millis(10);

pub(super) fn read_backoff(p: &mut Problems, r: &mut Reader<'_>, base: Backoff) -> Backoff {
    let mut b = base;
    let initial = r.duration(p, "backoff_initial");
    match initial {
        // A failed start is retried this long after at the earliest: an
        // engine that dies at once would be respawned in a busy loop.
        Some(d) if d < BACKOFF_FLOOR => p.push(
            r.key("backoff_initial"),
            format!(
                "{} is less than {}: an engine that fails at once would be respawned in a busy loop",
                humantime::format_duration(d),
                humantime::format_duration(BACKOFF_FLOOR)
            ),
        ),
        Some(d) => b.initial = d,
        None => {}
    }
    let max = r.duration(p, "backoff_max");
    if let Some(d) = max {
        b.max = d;
    }
    // Only where this table sets one of them: inherited both, the table
    // they came from was told (every model repeated `[defaults]`' problem,
    // at a key it does not have).
    if b.max < b.initial && (initial.is_some() || max.is_some()) {
        p.push(
            r.key("backoff_max"),
            format!("{:?} is less than backoff_initial ({:?})", b.max, b.initial),
        );
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
    let (max_queue, max_hold) = super::model::read_hold(p, &mut r, 64, Duration::from_secs(300));
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

pub(super) fn read_tiers(p: &mut Problems, r: &mut Reader<'_>) -> Option<Vec<IdleTier>> {
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
            Some("suspend") => {
                if level.is_some() {
                    p.push(tr.key("level"), "only applies to action = \"sleep\"");
                }
                Some(IdleAction::Suspend)
            }
            Some(other) => {
                p.push(
                    tr.key("action"),
                    format!("{other:?} is not \"sleep\", \"suspend\" or \"stop\""),
                );
                None
            }
            None => {
                if t.get("action").is_none() {
                    p.push(
                        tr.key("action"),
                        "is missing (\"sleep\", \"suspend\" or \"stop\")",
                    );
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

/// A model's index, name and aliases.
type Names = (usize, String, Vec<String>);

/// The name and aliases written in a model's table, where they are strings.
fn written_names(t: &toml::Table) -> Option<(String, Vec<String>)> {
    let name = t.get("name")?.as_str()?.to_string();
    let aliases = t
        .get("aliases")
        .and_then(toml::Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    Some((name, aliases))
}

fn check_names(p: &mut Problems, models: &[Names]) {
    let mut owner: BTreeMap<&str, String> = BTreeMap::new();
    for (i, name, aliases) in models {
        let names = std::iter::once((format!("model[{i}].name"), name.as_str())).chain(
            aliases
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
    // Engine log files are named after the model with anything but
    // letters, digits and `-` folded to `_`: two such names would write
    // (and `siesta logs` read) one file.
    let mut files: BTreeMap<String, (usize, &str)> = BTreeMap::new();
    for (i, name, _) in models {
        let file = log_file_stem(name);
        match files.get(&file) {
            Some((j, other)) if *other != name.as_str() => p.push(
                format!("model[{i}].name"),
                format!(
                    "{name:?} would share its engine log files ({file}.stdout.log) with \
                     model[{j}] ({other:?}); rename one"
                ),
            ),
            Some(_) => {}
            None => {
                files.insert(file, (*i, name.as_str()));
            }
        }
    }
}

/// A model's engine log files are `NAME.stdout.log` and `NAME.stderr.log`
/// with anything in its name but letters, digits and `-` folded to `_`.
pub fn log_file_stem(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Two listeners on one port whose addresses overlap: the second engine
/// cannot bind, and siesta would probe (and the proxies route to) the
/// first. The control plane's own addresses count too.
fn check_ports(p: &mut Problems, control: &ControlConfig, models: &[(usize, ModelConfig)]) {
    let mut taken: Vec<(String, u16, String)> = [
        Some(("control.listen", control.listen)),
        control.web_listen.map(|a| ("control.web_listen", a)),
    ]
    .into_iter()
    .flatten()
    .filter(|(_, a)| a.port() != 0)
    .map(|(k, a)| (a.ip().to_string(), a.port(), format!("{k} ({a})")))
    .collect();
    if let [(h, port, by), (web_host, web_port, _)] = &taken[..]
        && port == web_port
        && addresses_overlap(h, web_host)
    {
        p.push(
            "control.web_listen",
            format!("{port} is already used by {by}"),
        );
    }
    for (i, m) in models {
        let Launch::Process {
            host,
            port: Some(port),
            ..
        } = &m.launch
        else {
            continue;
        };
        if let Some((_, _, by)) = taken
            .iter()
            .find(|(h, pt, _)| pt == port && addresses_overlap(h, host))
        {
            p.push(
                format!("model[{i}].port"),
                format!("{port} is already used by {by}"),
            );
        } else {
            taken.push((host.clone(), *port, format!("model[{i}] ({})", m.name)));
        }
    }
}

/// Whether listeners on `a` and `b` (same port) would collide: the same
/// address, a wildcard, or a name (it may resolve to either).
fn addresses_overlap(a: &str, b: &str) -> bool {
    match (a.parse::<IpAddr>(), b.parse::<IpAddr>()) {
        (Ok(x), Ok(y)) => x == y || x.is_unspecified() || y.is_unspecified(),
        _ => true,
    }
}
