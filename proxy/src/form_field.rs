//! The `model` field of a `multipart/form-data` body: how
//! `/v1/audio/transcriptions` and `/v1/audio/translations` are sent (the
//! OpenAI SDKs, `curl -F`), the model one form field beside the audio file.
//! Found without copying (a span of the field's value in the body) and
//! rewritten by a splice, like the JSON `model` ([`crate::model_field`]).
//! Only a body the JSON reading refused is looked at here, so JSON requests
//! pay nothing for it.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;

use crate::errors::ApiError;
use crate::model_field::{FieldKind, ModelField};

/// RFC 2046: a boundary is 1 to 70 characters.
const MAX_BOUNDARY: usize = 70;

/// The `model` field of `body` when `content_type` is `multipart/form-data`;
/// `None` for any other type. A field given twice counts the last time, as
/// vLLM's server (Starlette's form data) reads it; a part with a `filename`
/// is a file, not the field.
pub fn find_form_model<'a>(
    body: &'a [u8],
    content_type: &[u8],
) -> Option<Result<ModelField<'a>, ApiError>> {
    let mut params = content_type.split(|b| *b == b';');
    let kind = params.next()?.trim_ascii();
    if !kind.eq_ignore_ascii_case(b"multipart/form-data") {
        return None;
    }
    let boundary = params.find_map(|p| {
        let (name, value) = split_param(p)?;
        name.eq_ignore_ascii_case(b"boundary").then_some(value)
    });
    Some(match boundary {
        Some(b) if (1..=MAX_BOUNDARY).contains(&b.len()) => find_in(body, b),
        _ => Err(malformed("its Content-Type has no valid boundary")),
    })
}

/// The served name in place of the field's value at `span`.
pub fn rewrite_form_model(body: &Bytes, span: Range<usize>, served: &str) -> Bytes {
    let mut out = Vec::with_capacity(body.len() - span.len() + served.len());
    out.extend_from_slice(&body[..span.start]);
    out.extend_from_slice(served.as_bytes());
    out.extend_from_slice(&body[span.end..]);
    Bytes::from(out)
}

fn malformed(what: &'static str) -> ApiError {
    ApiError::MalformedForm(what)
}

fn find_in<'a>(body: &'a [u8], boundary: &[u8]) -> Result<ModelField<'a>, ApiError> {
    // Every delimiter is CRLF "--" boundary, but a first one at the very
    // start (anything before the first is a preamble, ignored).
    let mut delim = Vec::with_capacity(boundary.len() + 4);
    delim.extend_from_slice(b"\r\n--");
    delim.extend_from_slice(boundary);
    let mut at = if body.starts_with(&delim[2..]) && delimits(&body[delim.len() - 2..]) {
        delim.len() - 2
    } else {
        next_delimiter(body, &delim, 0).ok_or(malformed("its boundary is not in the body"))?
            + delim.len()
    };
    let mut model = None;
    loop {
        // After a delimiter: "--" ends the body, else (optional white space
        // and) CRLF, the part's headers, an empty line, its content.
        if body[at..].starts_with(b"--") {
            break;
        }
        let eol = find(body, b"\r\n", at).ok_or(malformed("a part has no headers"))?;
        let headers = eol + 2;
        let (head, content) = if body[headers..].starts_with(b"\r\n") {
            (&body[headers..headers], headers + 2)
        } else {
            let end =
                find(body, b"\r\n\r\n", headers).ok_or(malformed("a part's headers do not end"))?;
            (&body[headers..end], end + 4)
        };
        let end = next_delimiter(body, &delim, content)
            .ok_or(malformed("a part does not end with the boundary"))?;
        if is_model_field(head) {
            model = Some(content..end);
        }
        at = end + delim.len();
    }
    // No field, or an empty one, names no model (vLLM's form field is
    // optional, and Starlette reads an empty one as "").
    let Some(span) = model.filter(|s| !s.is_empty()) else {
        return Ok(ModelField::unnamed());
    };
    let name = std::str::from_utf8(&body[span.clone()]).map_err(|_| ApiError::InvalidModel)?;
    Ok(ModelField {
        name: Cow::Borrowed(name),
        span,
        kind: FieldKind::Form,
        json_media: false,
    })
}

/// A part's headers say `Content-Disposition: form-data; name="model"`,
/// without a `filename`.
fn is_model_field(head: &[u8]) -> bool {
    head.split(|b| *b == b'\n').any(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            return false;
        };
        if !line[..colon]
            .trim_ascii()
            .eq_ignore_ascii_case(b"content-disposition")
        {
            return false;
        }
        let mut params = line[colon + 1..].split(|b| *b == b';');
        let kind = params.next().unwrap_or_default().trim_ascii();
        let (mut named, mut file) = (false, false);
        for (name, value) in params.filter_map(split_param) {
            if name.eq_ignore_ascii_case(b"name") {
                named = value == b"model";
            } else if name.eq_ignore_ascii_case(b"filename")
                || name.eq_ignore_ascii_case(b"filename*")
            {
                file = true;
            }
        }
        kind.eq_ignore_ascii_case(b"form-data") && named && !file
    })
}

/// `name=value` or `name="value"`, white space around either trimmed.
fn split_param(p: &[u8]) -> Option<(&[u8], &[u8])> {
    let eq = p.iter().position(|b| *b == b'=')?;
    let value = p[eq + 1..].trim_ascii();
    let value = match value {
        [b'"', inner @ .., b'"'] => inner,
        v => v,
    };
    Some((p[..eq].trim_ascii(), value))
}

/// What follows a boundary makes it a delimiter: "--" (the last one), or
/// optional white space and CRLF. Anything else is content, as
/// python-multipart (vLLM's server) reads it.
fn delimits(after: &[u8]) -> bool {
    if after.starts_with(b"--") {
        return true;
    }
    let pad = after
        .iter()
        .take_while(|b| **b == b' ' || **b == b'\t')
        .count();
    after[pad..].starts_with(b"\r\n")
}

/// The next delimiter (`delim`: CRLF "--" boundary) in `body` from `from` on.
fn next_delimiter(body: &[u8], delim: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let at = find(body, delim, from)?;
        if delimits(&body[at + delim.len()..]) {
            return Some(at);
        }
        from = at + 1;
    }
}

/// Where `needle` (not empty) first is in `hay` from `from` on.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    let last = hay.len().checked_sub(needle.len())?;
    let mut i = from;
    while i <= last {
        i += hay[i..=last].iter().position(|b| *b == needle[0])?;
        if hay[i..].starts_with(needle) {
            return Some(i);
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const CT: &[u8] = b"multipart/form-data; boundary=XyZ";

    fn part(name: &str, extra: &str, value: &str) -> String {
        format!(
            "--XyZ\r\nContent-Disposition: form-data; name=\"{name}\"{extra}\r\n\r\n{value}\r\n"
        )
    }

    /// The model the form names; "" when it names none.
    fn model_of(body: &str, ct: &[u8]) -> Result<String, ApiError> {
        let f = find_form_model(body.as_bytes(), ct).expect("a form")?;
        match f.kind {
            FieldKind::Form => {
                assert_eq!(&body.as_bytes()[f.span.clone()], f.name.as_bytes())
            }
            kind => assert_eq!((kind, &*f.name), (FieldKind::Unnamed, "")),
        }
        Ok(f.name.into_owned())
    }

    #[test]
    fn only_multipart_form_data_is_a_form() {
        for ct in [
            &b"application/json"[..],
            b"multipart/mixed; boundary=x",
            b"text/plain",
            b"",
        ] {
            assert!(find_form_model(b"--x--", ct).is_none());
        }
        for ct in [
            &b"multipart/form-data"[..],
            b"multipart/form-data; boundary=",
            b"multipart/form-data; boundary=\"\"",
        ] {
            assert!(matches!(
                find_form_model(b"--x--", ct),
                Some(Err(ApiError::MalformedForm(_)))
            ));
        }
    }

    #[test]
    fn finds_the_model_field_wherever_it_is() {
        let file = part("file", "; filename=\"a.wav\"", "RIFF\r\n--XyZa\r\n\r\n--");
        let end = "--XyZ--\r\n";
        let m = part("model", "", "whisper");
        for body in [
            format!("{m}{file}{end}"),
            format!("{file}{m}{end}"),
            // A preamble, an epilogue, padding after a delimiter.
            format!(
                "preamble\r\n{file}--XyZ \t\r\nContent-Disposition: form-data; name=model\r\n\r\nwhisper\r\n{end}epilogue"
            ),
            // Given twice: the last counts, as Starlette reads it.
            format!("{}{file}{m}{end}", part("model", "", "other")),
        ] {
            assert_eq!(model_of(&body, CT).unwrap(), "whisper", "{body:?}");
        }
        let ct = b"Multipart/Form-Data; charset=utf-8; boundary=\"XyZ\"";
        assert_eq!(model_of(&format!("{m}{end}"), ct).unwrap(), "whisper");
    }

    #[test]
    fn errors_are_classified() {
        let end = "--XyZ--\r\n";
        // A file named "model" is not the field; an empty field names none.
        let file = part("model", "; filename=\"model\"", "whisper");
        assert_eq!(model_of(&format!("{file}{end}"), CT).unwrap(), "");
        assert_eq!(
            model_of(&format!("{}{end}", part("model", "", "")), CT).unwrap(),
            ""
        );
        for bad in [
            "no boundary here".to_owned(),
            part("model", "", "whisper"),
            "--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n".to_owned(),
            "--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--XyZjunk\r\n"
                .to_owned(),
        ] {
            assert!(
                matches!(model_of(&bad, CT), Err(ApiError::MalformedForm(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn rewrites_only_the_value() {
        let body = format!("{}--XyZ--\r\n", part("model", "", "short"));
        let body = Bytes::from(body);
        let f = find_form_model(&body, CT).unwrap().unwrap();
        let out = rewrite_form_model(&body, f.span, "org/served");
        assert_eq!(
            out,
            format!("{}--XyZ--\r\n", part("model", "", "org/served")).as_bytes()
        );
    }
}
