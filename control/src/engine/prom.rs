//! A small parser for the Prometheus text exposition format (what vLLM's
//! `/metrics` serves): metric name, labels as key/value pairs with the
//! quoted-value escapes (`\\`, `\"`, `\n`), value (`NaN`, `±Inf` included),
//! optional timestamp. Comments (`# HELP`, `# TYPE`, `# EOF`) and blank lines
//! are skipped; an OpenMetrics exemplar (`# {...} v`) after the value is ignored.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Every sample of `text`; lines that are not valid samples are skipped
/// (the number skipped is returned alongside).
pub fn samples(text: &str) -> (Vec<Sample>, usize) {
    let mut out = Vec::new();
    let mut bad = 0;
    for line in text.lines() {
        match parse_line(line) {
            Ok(Some(s)) => out.push(s),
            Ok(None) => {}
            Err(_) => bad += 1,
        }
    }
    (out, bad)
}

/// One line: `Ok(None)` for a comment or blank line.
pub fn parse_line(line: &str) -> Result<Option<Sample>, String> {
    let line = line.trim_start_matches([' ', '\t']);
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(format!("no metric name in {line:?}"));
    }
    let mut rest = line[name_end..].trim_start_matches([' ', '\t']);
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let mut fields = rest.split_whitespace();
    let value = fields
        .next()
        .ok_or_else(|| format!("no value in {line:?}"))
        .and_then(parse_value)?;
    match fields.next() {
        None => {}
        // An exemplar follows directly.
        Some(f) if f.starts_with('#') => {}
        Some(ts) => {
            ts.parse::<f64>()
                .map_err(|_| format!("bad timestamp {ts:?} in {line:?}"))?;
            if let Some(f) = fields.next()
                && !f.starts_with('#')
            {
                return Err(format!("unexpected {f:?} after the timestamp in {line:?}"));
            }
        }
    }
    Ok(Some(Sample {
        name: name.to_string(),
        labels,
        value,
    }))
}

/// Parses `k="v",k2="v2"}` (the text after `{`); returns what follows `}`.
fn parse_labels<'a>(mut s: &'a str, out: &mut Vec<(String, String)>) -> Result<&'a str, String> {
    loop {
        s = s.trim_start_matches([' ', '\t']);
        if let Some(rest) = s.strip_prefix('}') {
            return Ok(rest.trim_start_matches([' ', '\t']));
        }
        let key_end = s
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .ok_or("unterminated label set")?;
        let key = &s[..key_end];
        if key.is_empty() {
            return Err(format!("expected a label name at {s:?}"));
        }
        s = s[key_end..].trim_start_matches([' ', '\t']);
        s = s
            .strip_prefix('=')
            .ok_or_else(|| format!("expected '=' after label {key:?}"))?
            .trim_start_matches([' ', '\t']);
        s = s
            .strip_prefix('"')
            .ok_or_else(|| format!("expected '\"' to open the value of label {key:?}"))?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(format!("unterminated value of label {key:?}")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    // Not a defined escape: kept as written.
                    Some((_, c)) => {
                        value.push('\\');
                        value.push(c);
                    }
                    None => return Err(format!("unterminated value of label {key:?}")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        out.push((key.to_string(), value));
        s = s[end + 1..].trim_start_matches([' ', '\t']);
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err(format!("expected ',' or '}}' after label {key:?}"));
        }
    }
}

fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "NaN" | "nan" => Ok(f64::NAN),
        "+Inf" | "Inf" | "inf" | "+inf" => Ok(f64::INFINITY),
        "-Inf" | "-inf" => Ok(f64::NEG_INFINITY),
        _ => v.parse().map_err(|_| format!("bad value {v:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(line: &str) -> Sample {
        parse_line(line).unwrap().unwrap()
    }

    #[test]
    fn plain_and_labelled_samples() {
        let s = one("vllm:num_requests_running 3");
        assert_eq!(
            (s.name.as_str(), s.value),
            ("vllm:num_requests_running", 3.0)
        );
        assert!(s.labels.is_empty());
        let s =
            one(r#"vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0"#);
        assert_eq!(s.label("sleep_state"), Some("awake"));
        assert_eq!(s.label("engine"), Some("0"));
        assert_eq!(s.value, 1.0);
    }

    #[test]
    fn quoted_values_keep_escapes_commas_and_braces() {
        let s = one(r#"m{model_name="a \"discard_all\", b\\c}\nd",x="y"} 2"#);
        assert_eq!(s.label("model_name"), Some("a \"discard_all\", b\\c}\nd"));
        assert_eq!(s.label("x"), Some("y"));
        // A trailing comma and spaces are allowed.
        let s = one(r#"m{ a = "1" , } 5"#);
        assert_eq!(s.labels, vec![("a".into(), "1".into())]);
    }

    #[test]
    fn special_values_timestamps_and_comments() {
        assert!(one("m NaN").value.is_nan());
        assert_eq!(one("m +Inf").value, f64::INFINITY);
        assert_eq!(one("m -Inf 1700000000000").value, f64::NEG_INFINITY);
        assert_eq!(one("m{a=\"b\"} 1.5e3 1700000000000").value, 1500.0);
        assert_eq!(one(r#"m 4 # {trace_id="x"} 1"#).value, 4.0);
        for line in ["# HELP m the help", "# TYPE m gauge", "# EOF", "", "   "] {
            assert_eq!(parse_line(line).unwrap(), None, "{line:?}");
        }
    }

    #[test]
    fn malformed_lines_are_errors() {
        for line in [
            "m",
            "m{a=\"1\" 2",
            "m{a=1} 2",
            "m{a=\"1\"} x",
            "m 1 2 3",
            "{a=\"1\"} 2",
            "m{a=\"unterminated} 2",
        ] {
            assert!(parse_line(line).is_err(), "{line:?} parsed");
        }
        let (s, bad) = samples("a 1\nbroken{\nb 2\n");
        assert_eq!((s.len(), bad), (2, 1));
    }
}
