//! What `/sleep` and `/wake_up` answer. vLLM up to 0.2x answers an empty
//! 200; 0.33 answers `{"status":"sleeping","level":N}` and
//! `{"status":"awake"|"sleeping","tags":[...]}` (`tags_woken` in some
//! builds). Only a positive sign of trouble fails a call: bodies of other
//! shapes are accepted, so a newer vLLM does not break siesta.

use serde_json::Value;

/// What a `/wake_up` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WakeReply {
    /// Every tag is awake (or the engine did not say: empty body).
    Awake,
    /// A tag is still asleep; the tags this call woke, as the engine listed them.
    StillAsleep { tags: Vec<String> },
}

fn json(body: &[u8]) -> Option<Value> {
    let text = std::str::from_utf8(body).ok()?.trim();
    if text.is_empty() {
        return None;
    }
    serde_json::from_str(text).ok()
}

/// Reads a `/wake_up` body.
pub fn wake_reply(body: &[u8]) -> WakeReply {
    let Some(v) = json(body) else {
        return WakeReply::Awake;
    };
    if v.get("status").and_then(Value::as_str) != Some("sleeping") {
        return WakeReply::Awake;
    }
    let tags = v
        .get("tags")
        .or_else(|| v.get("tags_woken"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|t| t.as_str().map_or_else(|| t.to_string(), str::to_string))
                .collect()
        })
        .unwrap_or_default();
    WakeReply::StillAsleep { tags }
}

/// Checks a `/sleep?level=N` body: an engine that says it sleeps at another
/// level, or says it is awake, did not do what was asked.
pub fn check_sleep_reply(body: &[u8], level: u8) -> Result<(), String> {
    let Some(v) = json(body) else {
        return Ok(());
    };
    match v.get("status").and_then(Value::as_str) {
        None | Some("sleeping") => {}
        Some(other) => {
            return Err(format!(
                "engine answered status {other:?} instead of \"sleeping\""
            ));
        }
    }
    match v.get("level").and_then(Value::as_u64) {
        Some(l) if l != u64::from(level) => Err(format!(
            "engine says it sleeps at level {l}, level {level} was asked"
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wake_bodies_of_both_versions() {
        // vLLM 0.2x: empty 200.
        assert_eq!(wake_reply(b""), WakeReply::Awake);
        assert_eq!(wake_reply(b"null"), WakeReply::Awake);
        assert_eq!(
            wake_reply(br#"{"status":"awake","tags":null}"#),
            WakeReply::Awake
        );
        assert_eq!(
            wake_reply(br#"{"status":"sleeping","tags":["weights"]}"#),
            WakeReply::StillAsleep {
                tags: vec!["weights".into()]
            }
        );
        assert_eq!(
            wake_reply(br#"{"status":"sleeping","tags_woken":["kv_cache"]}"#),
            WakeReply::StillAsleep {
                tags: vec!["kv_cache".into()]
            }
        );
        assert_eq!(
            wake_reply(br#"{"status":"sleeping","tags":null}"#),
            WakeReply::StillAsleep { tags: vec![] }
        );
        // Not JSON: nothing to go on, the 200 stands.
        assert_eq!(wake_reply(b"ok"), WakeReply::Awake);
    }

    #[test]
    fn sleep_bodies() {
        assert!(check_sleep_reply(b"", 2).is_ok());
        assert!(check_sleep_reply(br#"{"status":"sleeping","level":2}"#, 2).is_ok());
        let e = check_sleep_reply(br#"{"status":"sleeping","level":1}"#, 2).unwrap_err();
        assert!(e.contains("level 1, level 2 was asked"), "{e}");
        let e = check_sleep_reply(br#"{"status":"awake"}"#, 1).unwrap_err();
        assert!(e.contains("\"awake\""), "{e}");
    }
}
