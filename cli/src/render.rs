//! Text rendering shared by the commands: tables, durations, times, bytes
//! and state labels.

use std::time::{SystemTime, UNIX_EPOCH};

use siesta_proto::v1::{IdleAction, IdleTier, ModelState, ModelStatus, P2pHealth};

/// Now, in Unix epoch milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A duration in the two most significant units: `850ms`, `4.2s`, `3m12s`, `2h5m`, `3d4h`.
pub fn duration(ms: u64) -> String {
    const S: u64 = 1000;
    const M: u64 = 60 * S;
    const H: u64 = 60 * M;
    const D: u64 = 24 * H;
    match ms {
        0..S => format!("{ms}ms"),
        S..10_000 => format!("{:.1}s", ms as f64 / 1000.0),
        10_000..M => format!("{}s", ms / S),
        M..H => two(ms / M, "m", ms % M / S, "s"),
        H..D => two(ms / H, "h", ms % H / M, "m"),
        _ => two(ms / D, "d", ms % D / H, "h"),
    }
}

fn two(a: u64, ua: &str, b: u64, ub: &str) -> String {
    if b == 0 {
        format!("{a}{ua}")
    } else {
        format!("{a}{ua}{b}{ub}")
    }
}

/// How long ago `t` was (`-` for 0, "never").
pub fn ago(now: i64, t: i64) -> String {
    if t <= 0 {
        "-".into()
    } else {
        duration(now.saturating_sub(t).max(0) as u64)
    }
}

/// How long until `t` (`-` for 0; `now` if past).
pub fn until(now: i64, t: i64) -> String {
    match t {
        ..=0 => "-".into(),
        i64::MAX => "forever".into(),
        t if t <= now => "now".into(),
        t => format!("in {}", duration((t - now) as u64)),
    }
}

/// Bytes in binary units: `512 B`, `1.5 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Lower-case name of a state: `awake`, `asleep`, ...
pub fn state_name(s: ModelState) -> &'static str {
    s.label()
}

/// State with its sleep level where it has one: `asleep(l2)`.
pub fn state_label(m: &ModelStatus) -> String {
    let s = m.state();
    match s {
        ModelState::Asleep | ModelState::Sleeping if m.sleep_level > 0 => {
            format!("{}(l{})", state_name(s), m.sleep_level)
        }
        _ => state_name(s).into(),
    }
}

/// An idle tier in words: `sleep l1`, `sleep l2`, `stop`.
pub fn tier_label(t: &IdleTier) -> String {
    match t.action() {
        IdleAction::Sleep => format!("sleep l{}", t.level.max(1)),
        IdleAction::Stop => "stop".into(),
        IdleAction::Suspend => "suspend".into(),
        IdleAction::Unspecified => "-".into(),
    }
}

/// The next idle tier and when: `sleep l1 in 14m`.
pub fn next_tier(now: i64, m: &ModelStatus) -> String {
    match (&m.next_tier, m.next_tier_unix_ms) {
        (Some(t), at) if at > 0 => format!("{} {}", tier_label(t), until(now, at)),
        _ => "-".into(),
    }
}

pub fn p2p_name(h: P2pHealth) -> &'static str {
    match h {
        P2pHealth::Unspecified => "unknown",
        P2pHealth::Ok => "ok",
        P2pHealth::Corrupt => "corrupt",
        P2pHealth::Unsupported => "unsupported",
        P2pHealth::Hung => "hung",
        P2pHealth::Error => "error",
    }
}

/// GPU indices: `0,1` or `-`.
pub fn gpus(list: &[u32]) -> String {
    if list.is_empty() {
        "-".into()
    } else {
        list.iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `-` for an empty string.
pub fn or_dash(s: &str) -> String {
    if s.is_empty() { "-".into() } else { s.into() }
}

/// A plain text table with left-aligned columns separated by two spaces.
#[derive(Debug)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<const N: usize>(header: [&str; N]) -> Self {
        Table {
            rows: vec![header.iter().map(|h| h.to_uppercase()).collect()],
        }
    }

    /// A table without a header row.
    pub fn bare() -> Self {
        Table { rows: Vec::new() }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                line.push_str(cell);
                if c + 1 < row.len() {
                    let pad = widths[c] - cell.chars().count() + 2;
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// An asleep residual per GPU, and whether it was measured.
pub fn residual(bytes: u64, measured: bool) -> String {
    if bytes == 0 {
        return "-".into();
    }
    let how = if measured { "measured" } else { "default" };
    format!("{} ({how})", self::bytes(bytes))
}

/// What an engine kind can do, one line: `sleep (levels 1, 2), suspend, stop;
/// activity from vllm:num_requests_running; health /health`.
pub fn capabilities(c: &siesta_proto::v1::EngineCapabilities) -> String {
    let mut can: Vec<String> = Vec::new();
    if !c.sleep_levels.is_empty() {
        let levels: Vec<String> = c.sleep_levels.iter().map(u32::to_string).collect();
        let word = if levels.len() > 1 { "levels" } else { "level" };
        can.push(format!("sleep ({word} {})", levels.join(", ")));
    }
    if c.can_suspend {
        can.push("suspend".into());
    }
    if c.can_stop {
        can.push("stop".into());
    }
    let mut s = if can.is_empty() {
        "nothing (always awake)".to_string()
    } else {
        can.join(", ")
    };
    if !c.sleep_query && !c.sleep_levels.is_empty() {
        s += "; sleep state recorded by siesta";
    }
    match c.activity_metric.as_str() {
        "" => s += "; activity from the proxy only",
        m => s += &format!("; activity from {m}"),
    }
    if !c.health_path.is_empty() {
        s += &format!("; health {}", c.health_path);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(850), "850ms");
        assert_eq!(duration(4200), "4.2s");
        assert_eq!(duration(42_000), "42s");
        assert_eq!(duration(192_000), "3m12s");
        assert_eq!(duration(15 * 60_000), "15m");
        assert_eq!(duration(2 * 3_600_000 + 5 * 60_000), "2h5m");
        assert_eq!(duration(3 * 86_400_000 + 4 * 3_600_000), "3d4h");
    }

    #[test]
    fn times_relative_to_now() {
        assert_eq!(ago(10_000, 0), "-");
        assert_eq!(ago(10_000, 7_000), "3.0s");
        assert_eq!(until(10_000, 70_000), "in 1m");
        assert_eq!(until(10_000, 5_000), "now");
        assert_eq!(until(10_000, i64::MAX), "forever");
    }

    #[test]
    fn bytes_in_binary_units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 * 1024 * 1024 * 1024 / 2), "1.5 GiB");
    }

    #[test]
    fn state_label_has_level_when_asleep() {
        let m = ModelStatus {
            state: ModelState::Asleep as i32,
            sleep_level: 2,
            ..Default::default()
        };
        assert_eq!(state_label(&m), "asleep(l2)");
        let m = ModelStatus {
            state: ModelState::Awake as i32,
            ..Default::default()
        };
        assert_eq!(state_label(&m), "awake");
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(["name", "state"]);
        t.row(vec!["chat".into(), "awake".into()]);
        t.row(vec!["embeddings".into(), "asleep(l1)".into()]);
        assert_eq!(
            t.render(),
            "NAME        STATE\nchat        awake\nembeddings  asleep(l1)\n"
        );
    }
}
