//! Which model a request is for: the `model` its body names (a JSON field,
//! or a form field for audio), looked up among the models served; a body
//! that names none goes to the one model served, as vLLM answers it with
//! its one model. Used by the handler and by the waiting room alike.

use std::sync::Arc;

use crate::errors::ApiError;
use crate::form_field::find_form_model;
use crate::model_field::{FieldKind, ModelField, find_model};
use crate::route_table::{ModelRoute, View};

/// Models named in the error for a request that names none (more are
/// counted, not listed).
const LISTED_AT_MOST: usize = 20;

/// The model field of a body sent with `content_type`: JSON, else a
/// `multipart/form-data` form (only a body JSON refused is looked at as a
/// form, so JSON requests pay nothing for it).
pub fn find_request_model<'a>(
    body: &'a [u8],
    content_type: Option<&[u8]>,
) -> Result<ModelField<'a>, ApiError> {
    let mut field = find_model(body).or_else(|e| {
        match content_type.and_then(|ct| find_form_model(body, ct)) {
            Some(form) => form,
            None => Err(e),
        }
    })?;
    field.json_media = content_type.is_some_and(json_media);
    Ok(field)
}

/// Whether a `Content-Type` is JSON as vLLM's `validate_json_request`
/// reads it: lowercased, up to the first `;`, exactly `application/json`
/// (no space before the `;`).
fn json_media(content_type: &[u8]) -> bool {
    let media = content_type
        .split(|b| *b == b';')
        .next()
        .unwrap_or_default();
    media.eq_ignore_ascii_case(b"application/json")
}

/// vLLM's routes among those a proxy forwards that take only
/// `Content-Type: application/json` (0.24's `validate_json_request`,
/// checked before the body is read): another type, or none, is a 400.
const VLLM_JSON_ONLY: &[&str] = &[
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/chat/completions/render",
    "/v1/chat/completions/derender",
    "/v1/completions",
    "/v1/completions/render",
    "/v1/completions/derender",
    "/v1/embeddings",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/rerank",
    "/v1/responses",
    "/v1/score",
];

/// Whether `path` is one of the model routes vLLM serves (by POST): asked
/// with another method, it is a 405, as vLLM's router answers it.
pub fn known_post_route(path: &str) -> bool {
    VLLM_JSON_ONLY.contains(&path)
        || matches!(path, "/v1/audio/transcriptions" | "/v1/audio/translations")
}

/// The 400 a vLLM engine would answer `field`'s request to `target` with
/// for its `Content-Type`: answered here, so a model is not woken (or
/// started) for a request it refuses before reading it. Other engine kinds
/// read the body whatever its type.
pub fn refused_media(route: &ModelRoute, target: &str, field: &ModelField<'_>) -> Option<ApiError> {
    if field.json_media || field.kind == FieldKind::Form || route.status.engine != "vllm" {
        return None;
    }
    let path = target.split('?').next().unwrap_or(target);
    VLLM_JSON_ONLY
        .contains(&path)
        .then(|| ApiError::UnsupportedMediaType(route.name.to_string()))
}

/// The route for `name`; an empty name (the body names no model) is the one
/// model served, and a 400 listing the models when there are several.
pub fn route_for<'v>(view: &'v View, name: &str) -> Result<&'v Arc<ModelRoute>, ApiError> {
    if !name.is_empty() {
        return view
            .by_name
            .get(name)
            .ok_or_else(|| ApiError::UnknownModel(crate::errors::shown(name)));
    }
    match &view.models[..] {
        [one] => Ok(one),
        models => Err(ApiError::ModelRequired(served_list(models))),
    }
}

/// "3 models: `a`, `b`, `c`" (the first [`LISTED_AT_MOST`] by name).
fn served_list(models: &[Arc<ModelRoute>]) -> String {
    let mut out = match models.len() {
        0 => return "no model".to_owned(),
        n => format!("{n} models:"),
    };
    for (i, m) in models.iter().take(LISTED_AT_MOST).enumerate() {
        out.push_str(if i == 0 { " `" } else { ", `" });
        out.push_str(&m.name);
        out.push('`');
    }
    if models.len() > LISTED_AT_MOST {
        out.push_str(", ... (GET /v1/models lists them all)");
    }
    out
}
