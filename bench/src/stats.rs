//! Percentiles over samples, and the markdown rows every scenario prints.
//!
//! A scenario repeats its measurement; each repeat yields one value per
//! metric. A row shows the median over repeats and the spread (min–max), and,
//! where the issue sets a target, whether the median meets it.

use std::fmt::Write as _;

/// Nearest-rank percentile of `samples` (any order). `p` in 0..=100.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median of `values` (any order).
pub fn median(values: &[f64]) -> f64 {
    percentile(values, 50.0)
}

/// A target a metric is judged against.
#[derive(Debug, Clone, Copy)]
pub enum Target {
    /// The value must be at most this.
    AtMost(f64),
    /// The value must be at least this.
    AtLeast(f64),
}

impl Target {
    fn met(self, v: f64) -> bool {
        match self {
            Target::AtMost(t) => v <= t,
            Target::AtLeast(t) => v >= t,
        }
    }

    fn describe(self) -> String {
        match self {
            Target::AtMost(t) => format!("≤ {}", num(t)),
            Target::AtLeast(t) => format!("≥ {}", num(t)),
        }
    }
}

/// One metric measured once per repeat.
#[derive(Debug, Clone)]
pub struct Row {
    pub scenario: String,
    pub metric: String,
    pub unit: &'static str,
    pub values: Vec<f64>,
    pub target: Option<Target>,
}

impl Row {
    pub fn new(scenario: &str, metric: impl Into<String>, unit: &'static str) -> Row {
        Row {
            scenario: scenario.to_string(),
            metric: metric.into(),
            unit,
            values: Vec::new(),
            target: None,
        }
    }

    pub fn target(mut self, t: Target) -> Row {
        self.target = Some(t);
        self
    }

    pub fn push(&mut self, v: f64) {
        self.values.push(v);
    }

    /// `| scenario | metric | median | spread | target | verdict |`
    pub fn markdown(&self) -> String {
        let finite: Vec<f64> = self
            .values
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .collect();
        let med = median(&finite);
        let (lo, hi) = finite
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        let spread = if finite.is_empty() {
            "—".to_string()
        } else {
            format!("{}–{} (n={})", num(lo), num(hi), finite.len())
        };
        let (target, verdict) = match self.target {
            None => ("".to_string(), "".to_string()),
            Some(_) if finite.is_empty() => ("".to_string(), "not measured".to_string()),
            Some(t) => {
                let verdict = if t.met(med) {
                    "met".to_string()
                } else {
                    let goal = match t {
                        Target::AtMost(g) | Target::AtLeast(g) => g,
                    };
                    let by = (med - goal).abs();
                    if goal != 0.0 {
                        format!(
                            "**MISSED** by {} ({:.0} %)",
                            num(by),
                            by / goal.abs() * 100.0
                        )
                    } else {
                        format!("**MISSED** by {}", num(by))
                    }
                };
                (t.describe(), verdict)
            }
        };
        let unit = if self.unit.is_empty() {
            String::new()
        } else {
            format!(" ({})", self.unit)
        };
        format!(
            "| {} | {}{} | {} | {} | {} | {} |",
            self.scenario,
            self.metric,
            unit,
            num(med),
            spread,
            target,
            verdict
        )
    }
}

/// Prints the table header and every row to stdout, flushed.
pub fn print_table(title: &str, rows: &[Row]) {
    let mut out = String::new();
    let _ = writeln!(out, "\n### {title}\n");
    let _ = writeln!(
        out,
        "| scenario | metric | median | spread over repeats | target | verdict |"
    );
    let _ = writeln!(out, "|---|---|---:|---|---|---|");
    for row in rows {
        let _ = writeln!(out, "{}", row.markdown());
    }
    print!("{out}");
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
}

/// A number with sensible precision for a table.
pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return "—".to_string();
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
    }

    #[test]
    fn verdicts() {
        let mut r = Row::new("x", "y", "µs").target(Target::AtMost(5.0));
        r.push(4.0);
        r.push(6.0);
        r.push(4.5);
        assert!(r.markdown().contains("| met |"));
        let mut r = Row::new("x", "y", "").target(Target::AtLeast(5.0));
        r.push(4.0);
        assert!(r.markdown().contains("MISSED"));
    }
}
