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

/// Longest error text kept from an answer (characters).
const ERROR_CHARS: usize = 400;

/// What an error answer says, for `last_error`: the message of an OpenAI
/// error body (`{"error":{"message":...}}`, vLLM's and fake-vllm's), of an
/// older `{"message":...}` or of FastAPI's `{"detail":...}`, else the body
/// as text; at most [`ERROR_CHARS`] characters.
pub fn error_text(body: &[u8]) -> String {
    let v = json(body);
    let message = v.as_ref().and_then(|v| {
        [
            v.pointer("/error/message"),
            v.get("message"),
            v.get("detail"),
        ]
        .into_iter()
        .flatten()
        .find_map(Value::as_str)
    });
    let text = match message {
        Some(m) => m.to_string(),
        None => String::from_utf8_lossy(body).trim().to_string(),
    };
    match text.char_indices().nth(ERROR_CHARS) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wake that ran out of GPU memory says so, not a cut JSON body.
    #[test]
    fn error_bodies_give_their_message() {
        let oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.18 GiB. \
                   GPU 0 has a total capacity of 10.00 GiB of which 0.18 GiB is free.";
        let body = format!(
            r#"{{"error":{{"code":500,"message":"{oom}","param":null,"type":"InternalServerError"}}}}"#
        );
        assert_eq!(error_text(body.as_bytes()), oom);
        assert_eq!(
            error_text(br#"{"message":"bad level","code":400}"#),
            "bad level"
        );
        assert_eq!(error_text(br#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(
            error_text(b"Internal Server Error\n"),
            "Internal Server Error"
        );
        assert_eq!(
            error_text(br#"{"error":{"code":1}}"#),
            r#"{"error":{"code":1}}"#
        );
        let long = error_text("x".repeat(1000).as_bytes());
        assert_eq!(long.chars().count(), ERROR_CHARS + 1);
    }

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
