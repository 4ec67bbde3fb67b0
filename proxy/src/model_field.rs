//! Finds the `model` field of a JSON request body without building a DOM, and
//! rewrites it in place (a splice of the raw bytes) when the engine serves
//! the model under another name.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::errors::ApiError;

/// The top-level `model` of an object. A key given twice counts the last
/// time, as vLLM's server (Python's `json.loads`) reads it: the engine
/// answers for that one, so the proxy routes and rewrites by it.
struct Probe<'a> {
    model: Option<&'a RawValue>,
}

impl<'de> Deserialize<'de> for Probe<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = Probe<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Probe<'de>, A::Error> {
                let mut model = None;
                while let Some(IsModel(is)) = map.next_key()? {
                    if is {
                        model = map.next_value::<Option<&'de RawValue>>()?;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Probe { model })
            }
        }
        d.deserialize_map(Fields)
    }
}

/// Whether an object key (unescaped, not copied) is `model`.
struct IsModel(bool);

impl<'de> Deserialize<'de> for IsModel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Key;
        impl Visitor<'_> for Key {
            type Value = IsModel;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, key: &str) -> Result<IsModel, E> {
                Ok(IsModel(key == "model"))
            }
        }
        d.deserialize_identifier(Key)
    }
}

/// A JSON string, borrowed where it has no escapes.
#[derive(Deserialize)]
struct Name<'a>(#[serde(borrow)] Cow<'a, str>);

/// The `model` field found in a body.
#[derive(Debug)]
pub struct ModelField<'a> {
    /// The model name, unescaped; empty when the body names none.
    pub name: Cow<'a, str>,
    /// Byte range of the JSON string (quotes included) in the body; of the
    /// field's value, when a form field; empty when the body names none.
    pub span: Range<usize>,
    pub kind: FieldKind,
    /// The request said its body is JSON (`Content-Type: application/json`
    /// as vLLM reads it; set by [`crate::request_model::find_request_model`]).
    pub json_media: bool,
}

/// Where a request's model name is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// A JSON string.
    Json,
    /// A `multipart/form-data` field ([`crate::form_field`]).
    Form,
    /// Nowhere: the body has no `model`, or `null`, or `""`, which vLLM
    /// answers with its one model (the first served name).
    Unnamed,
}

impl ModelField<'_> {
    /// A body that names no model.
    pub fn unnamed() -> Self {
        ModelField {
            name: Cow::Borrowed(""),
            span: 0..0,
            kind: FieldKind::Unnamed,
            json_media: false,
        }
    }

    /// The name as written in the body (escapes and all).
    pub fn raw<'b>(&self, body: &'b [u8]) -> &'b [u8] {
        match self.kind {
            FieldKind::Form => &body[self.span.clone()],
            FieldKind::Json => &body[self.span.start + 1..self.span.end - 1],
            FieldKind::Unnamed => &[],
        }
    }
}

/// The UTF-8 byte order mark. vLLM's server parses a body with Python's
/// `json.loads` on its bytes, which skips one at the start (Windows tools,
/// PowerShell 5's `-Encoding UTF8` among them, write files with it).
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// Validates the body as one JSON object and finds its top-level `model`.
/// A body may start with a UTF-8 byte order mark, as vLLM accepts; the span
/// is an offset into `body`, so the mark is forwarded as it came. An object
/// whose `model` is absent, `null` or `""` names none
/// ([`FieldKind::Unnamed`]), as vLLM reads it.
pub fn find_model(body: &[u8]) -> Result<ModelField<'_>, ApiError> {
    let json = body.strip_prefix(UTF8_BOM).unwrap_or(body);
    // serde would accept a struct from an array too; only an object will do.
    if json.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(
            match serde_json::from_slice::<serde::de::IgnoredAny>(json) {
                Ok(_) => ApiError::MissingModel,
                Err(e) => ApiError::MalformedJson(e.to_string()),
            },
        );
    }
    let probe: Probe<'_> = serde_json::from_slice(json).map_err(|e| {
        if e.is_data() {
            // Valid JSON but not an object.
            ApiError::MissingModel
        } else {
            ApiError::MalformedJson(e.to_string())
        }
    })?;
    let Some(raw) = probe.model else {
        return Ok(ModelField::unnamed());
    };
    let text = raw.get();
    // Borrowed from the body unless it has escapes (a bare `Cow<str>` is
    // always copied into a String).
    let Name(name) = serde_json::from_str(text).map_err(|_| ApiError::InvalidModel)?;
    if name.is_empty() {
        return Ok(ModelField::unnamed());
    }
    // `text` borrows from `body`: its offset is the distance between them.
    let start = text.as_ptr() as usize - body.as_ptr() as usize;
    Ok(ModelField {
        name,
        span: start..start + text.len(),
        kind: FieldKind::Json,
        json_media: false,
    })
}

/// The body with the model string at `span` replaced by `served` (JSON-encoded).
pub fn rewrite_model(body: &Bytes, span: Range<usize>, served: &str) -> Bytes {
    let mut out = Vec::with_capacity(body.len() - span.len() + served.len() + 8);
    out.extend_from_slice(&body[..span.start]);
    // Writing a &str to a Vec cannot fail.
    serde_json::to_writer(&mut out, served).expect("serialize str");
    out.extend_from_slice(&body[span.end..]);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_model_among_other_fields() {
        let body = br#"{"messages":[{"role":"user","content":"hi \"model\""}], "model" : "qwen", "stream":true}"#;
        let f = find_model(body).unwrap();
        assert_eq!(f.name, "qwen");
        assert_eq!(&body[f.span.clone()], br#""qwen""#);
    }

    #[test]
    fn unescapes_and_rewrites() {
        let body = Bytes::from_static(br#"{"model":"a\u0062c","x":1}"#);
        let f = find_model(&body).unwrap();
        assert_eq!(f.name, "abc");
        let out = rewrite_model(&body, f.span, "served/\"name\"");
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["model"], "served/\"name\"");
        assert_eq!(v["x"], 1);
    }

    #[test]
    fn a_plain_name_is_borrowed_an_escaped_one_unescaped() {
        let body = br#"{"model":"qwen/7b","x":"\\"}"#;
        assert!(matches!(
            find_model(body).unwrap().name,
            Cow::Borrowed("qwen/7b")
        ));
        let body = br#"{"model":"a\\b\"c\u00e9"}"#;
        assert_eq!(find_model(body).unwrap().name, "a\\b\"c\u{e9}");
        assert!(matches!(
            find_model(br#"{"model":"a\u0000"}"#).unwrap().name,
            Cow::Owned(_)
        ));
    }

    #[test]
    fn errors_are_classified() {
        assert!(matches!(
            find_model(b"{\"model\":"),
            Err(ApiError::MalformedJson(_))
        ));
        assert!(matches!(
            find_model(b"not json"),
            Err(ApiError::MalformedJson(_))
        ));
        assert!(matches!(find_model(b"[1,2]"), Err(ApiError::MissingModel)));
        assert!(matches!(
            find_model(br#"{"model":3}"#),
            Err(ApiError::InvalidModel)
        ));
    }

    #[test]
    fn a_body_naming_no_model_is_unnamed_as_vllm_reads_it() {
        for body in [
            &br#"{}"#[..],
            br#"{"prompt":"x"}"#,
            br#"{"model":null}"#,
            br#"{"model":""}"#,
            br#"{"model":"a","model":null}"#,
        ] {
            let f = find_model(body).unwrap();
            assert_eq!(f.kind, FieldKind::Unnamed, "{body:?}");
            assert_eq!(f.name, "");
            assert_eq!(f.raw(body), b"");
        }
    }

    #[test]
    fn a_body_with_a_utf8_bom_is_read_as_vllm_reads_it() {
        // Python's json.loads(bytes), which vLLM's server uses, skips it.
        let body = Bytes::from_static(b"\xEF\xBB\xBF {\"model\":\"m\",\"x\":1}");
        let f = find_model(&body).unwrap();
        assert_eq!(f.name, "m");
        assert_eq!(&body[f.span.clone()], br#""m""#);
        let out = rewrite_model(&body, f.span, "served");
        assert_eq!(&out[..], b"\xEF\xBB\xBF {\"model\":\"served\",\"x\":1}");
        assert!(matches!(
            find_model(b"\xEF\xBB\xBF[1]"),
            Err(ApiError::MissingModel)
        ));
        assert!(matches!(
            find_model(b"\xEF\xBB\xBF"),
            Err(ApiError::MalformedJson(_))
        ));
        assert!(matches!(
            find_model(b"\xEF\xBB\xBF\xEF\xBB\xBF{\"model\":\"m\"}"),
            Err(ApiError::MalformedJson(_))
        ));
    }

    #[test]
    fn a_repeated_model_key_counts_the_last_time_as_vllm_reads_it() {
        // Python's json keeps the last value of a repeated key: the engine
        // answers for that one, so the proxy routes (and rewrites) by it.
        let body = br#"{"model":"a","x":{"model":"c"},"model" : "b","y":2}"#;
        let f = find_model(body).unwrap();
        assert_eq!(f.name, "b");
        assert_eq!(&body[f.span.clone()], br#""b""#);
        let f = find_model(br#"{"model":"a","mod\u0065l":"b"}"#).unwrap();
        assert_eq!(f.name, "b");
        assert!(matches!(
            find_model(br#"{"model":"a","model":3}"#),
            Err(ApiError::InvalidModel)
        ));
    }
}
