//! The proxy's model extraction and served-name splice on arbitrary bodies.
//!
//! Invariants: no panic; a found span covers exactly the JSON string of the
//! top-level `model` and decodes to the name; when the body is valid JSON (an
//! object whose single top-level `model` is a non-empty string) the model is
//! found, and the spliced body is valid JSON with the served name in `model`
//! and every other field unchanged.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use siesta_fuzz::errors::ApiError;
use siesta_fuzz::model_field::{FieldKind, find_model, rewrite_model};

/// Served names to splice in, picked by the body's length: escapes, quotes,
/// control characters, non-ASCII, empty and long.
const SERVED: &[&str] = &[
    "served",
    "a\"b\\c",
    "line\nbreak\u{0}\u{1f}",
    "ünï/cödé 🦀",
    "",
    "\u{2028}\u{2029}",
    "x-very-long-served-name-x-very-long-served-name-x-very-long-served-name",
];

/// How many top-level `model` keys the object has (None: not an object).
fn model_keys(body: &[u8]) -> Option<usize> {
    struct Count;
    impl<'de> Visitor<'de> for Count {
        type Value = usize;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
            let mut n = 0;
            while let Some(k) = map.next_key::<String>()? {
                n += usize::from(k == "model");
                map.next_value::<IgnoredAny>()?;
            }
            Ok(n)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let n = (&mut de).deserialize_map(Count).ok()?;
    de.end().ok()?;
    Some(n)
}

fuzz_target!(|data: &[u8]| {
    let body = Bytes::copy_from_slice(data);
    let found = find_model(&body);
    let parsed: Option<serde_json::Value> = serde_json::from_slice(data).ok();

    if let Ok(f) = &found
        && f.kind == FieldKind::Json
    {
        // The span is the quoted JSON string, and it decodes to the name.
        assert!(f.span.start + 2 <= f.span.end && f.span.end <= body.len());
        assert_eq!(body[f.span.start], b'"');
        assert_eq!(body[f.span.end - 1], b'"');
        let decoded: String = serde_json::from_slice(&body[f.span.clone()]).unwrap();
        assert_eq!(decoded, f.name);
        assert!(!f.name.is_empty());
    }

    let Some(value) = parsed else { return };
    let obj_model = value.as_object().and_then(|o| o.get("model"));
    let expect_found = matches!(obj_model, Some(serde_json::Value::String(s)) if !s.is_empty())
        && model_keys(data) == Some(1);
    // No `model`, `null` or `""`: names none, as vLLM reads it.
    let expect_unnamed = value.is_object()
        && matches!(obj_model, None | Some(serde_json::Value::Null))
        || matches!(obj_model, Some(serde_json::Value::String(s)) if s.is_empty());
    match &found {
        Ok(f) if f.kind == FieldKind::Unnamed => {
            assert!(expect_unnamed, "named model called unnamed: {obj_model:?}");
            assert_eq!(f.name, "");
        }
        Ok(f) => assert_eq!(obj_model.and_then(|m| m.as_str()), Some(&*f.name)),
        Err(e) if expect_found || expect_unnamed && model_keys(data) == Some(1) => {
            panic!("valid body refused: {e:?}")
        }
        Err(ApiError::MalformedJson(e)) => panic!("valid JSON called malformed: {e}"),
        Err(_) => {}
    }
    let Ok(f) = found else { return };
    if f.kind == FieldKind::Unnamed {
        return;
    }

    let served = SERVED[data.len() % SERVED.len()];
    let out = rewrite_model(&body, f.span.clone(), served);
    let spliced: serde_json::Value = serde_json::from_slice(&out).unwrap_or_else(|e| {
        panic!(
            "spliced body is not JSON: {e}: {:?}",
            String::from_utf8_lossy(&out)
        )
    });
    let mut expected = value;
    expected["model"] = serde_json::Value::from(served);
    assert_eq!(spliced, expected);
    // And the proxy finds the served name in what it forwards.
    if !served.is_empty() {
        assert_eq!(
            find_model(&out).map(|g| g.name.into_owned()),
            Ok(served.to_owned())
        );
    }
});
