//! The proxy's `model` field of a multipart form, on arbitrary bodies and
//! boundaries.
//!
//! Invariants: no panic; a found field's span lies in the body and holds
//! exactly the name; the body with the served name spliced in is read
//! again as naming the served name; a form that names no model is not
//! given one by a splice.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use siesta_fuzz::form_field::{find_form_model, rewrite_form_model};
use siesta_fuzz::model_field::FieldKind;

/// Content types to read the body under, picked by its last byte: the
/// usual boundary, a quoted one, odd spacing and case, none, too long.
const TYPES: &[&[u8]] = &[
    b"multipart/form-data; boundary=XyZ",
    b"multipart/form-data; boundary=\"XyZ\"",
    b"Multipart/Form-Data ;  BOUNDARY = XyZ ; charset=utf-8",
    b"multipart/form-data; boundary=-",
    b"multipart/form-data",
    b"multipart/form-data; boundary=",
    b"multipart/form-data; boundary=xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    b"application/json",
];

fuzz_target!(|data: &[u8]| {
    let ct = TYPES[data.last().map_or(0, |b| *b as usize) % TYPES.len()];
    let body = Bytes::copy_from_slice(data);
    let Some(found) = find_form_model(&body, ct) else {
        assert!(!ct.starts_with(b"multipart") && !ct.starts_with(b"Multipart"));
        return;
    };
    let Ok(field) = found else { return };
    match field.kind {
        FieldKind::Form => {
            let span = field.span.clone();
            assert!(span.start < span.end && span.end <= body.len());
            assert_eq!(field.name.as_bytes(), &body[span.clone()]);
            let spliced = rewrite_form_model(&body, span, "served");
            let again = find_form_model(&spliced, ct)
                .expect("still a form")
                .expect("still well formed");
            assert_eq!(again.kind, FieldKind::Form);
            assert_eq!(again.name, "served");
        }
        FieldKind::Unnamed => assert!(field.name.is_empty()),
        FieldKind::Json => panic!("a form read as JSON"),
    }
});
