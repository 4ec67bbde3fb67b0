//! Which model a request is for: the `model` its body names (a JSON field,
//! or a form field for audio), looked up among the models served; a body
//! that names none goes to the one model served, as vLLM answers it with
//! its one model. Used by the handler and by the waiting room alike.

use std::sync::Arc;

use crate::errors::ApiError;
use crate::form_field::find_form_model;
use crate::model_field::{ModelField, find_model};
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
    find_model(body).or_else(
        |e| match content_type.and_then(|ct| find_form_model(body, ct)) {
            Some(form) => form,
            None => Err(e),
        },
    )
}

/// The route for `name`; an empty name (the body names no model) is the one
/// model served, and a 400 listing the models when there are several.
pub fn route_for<'v>(view: &'v View, name: &str) -> Result<&'v Arc<ModelRoute>, ApiError> {
    if !name.is_empty() {
        return view
            .by_name
            .get(name)
            .ok_or_else(|| ApiError::UnknownModel(name.to_owned()));
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
