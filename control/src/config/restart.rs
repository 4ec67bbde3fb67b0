//! What a reload cannot apply: `[control]` and `[[gpu]]` settings read once,
//! at start-up. Models (with `[defaults]` applied to them) and the asleep
//! residual placement counts are applied by a reload.

use super::{Config, ControlConfig, GpuConfig};

impl Config {
    /// The keys whose value in `new` differs from this (running)
    /// configuration and that a reload leaves as they are until the
    /// daemon restarts, e.g. `control.token`, `gpu[0].memory`. Only keys:
    /// a value (a token) is never named.
    pub fn restart_only_changes(&self, new: &Config) -> Vec<String> {
        let mut keys = control_changes(&self.control, &new.control);
        keys.extend(gpu_changes(&self.gpus, &new.gpus));
        keys
    }
}

fn control_changes(old: &ControlConfig, new: &ControlConfig) -> Vec<String> {
    // Every field named, so a new one must be sorted here: applied by a
    // reload, or listed.
    let ControlConfig {
        listen,
        state_dir,
        token,
        control_id,
        p2p_probe,
        gpu_detect_timeout,
        asleep_residual: _, // placement reads it on each reload
        min_awake,
        yield_after,
        engine_idle_timeout,
        web_listen,
        cuda_checkpoint,
    } = old;
    [
        ("listen", *listen != new.listen),
        ("state_dir", *state_dir != new.state_dir),
        ("token", *token != new.token),
        ("control_id", *control_id != new.control_id),
        ("p2p_probe", p2p_probe.at_start != new.p2p_probe.at_start),
        ("p2p_probe_bytes", p2p_probe.bytes != new.p2p_probe.bytes),
        (
            "p2p_probe_timeout",
            p2p_probe.timeout != new.p2p_probe.timeout,
        ),
        (
            "gpu_detect_timeout",
            *gpu_detect_timeout != new.gpu_detect_timeout,
        ),
        ("min_awake", *min_awake != new.min_awake),
        ("yield_after", *yield_after != new.yield_after),
        (
            "engine_idle_timeout",
            *engine_idle_timeout != new.engine_idle_timeout,
        ),
        ("web_listen", *web_listen != new.web_listen),
        ("cuda_checkpoint", *cuda_checkpoint != new.cuda_checkpoint),
    ]
    .into_iter()
    .filter(|(_, changed)| *changed)
    .map(|(k, _)| format!("control.{k}"))
    .collect()
}

/// The GPU list is read once (NVML, or `[[gpu]]` where NVML is absent).
fn gpu_changes(old: &[GpuConfig], new: &[GpuConfig]) -> Vec<String> {
    let mut keys = Vec::new();
    for i in 0..old.len().max(new.len()) {
        match (old.get(i), new.get(i)) {
            (Some(a), Some(b)) => {
                for (k, changed) in [
                    ("index", a.index != b.index),
                    ("name", a.name != b.name),
                    ("memory", a.memory_bytes != b.memory_bytes),
                ] {
                    if changed {
                        keys.push(format!("gpu[{i}].{k}"));
                    }
                }
            }
            _ => keys.push(format!("gpu[{i}]")),
        }
    }
    keys
}
