//! Every error the proxy answers itself, and the ONE place they become HTTP
//! responses: OpenAI-shaped `{"error": {"message", "type", "code"}}` bodies.

use http::{HeaderValue, Response, StatusCode, header};

use crate::body::ProxyBody;

/// Why a request for a model is shed with 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// The model's hold queue is full.
    QueueFull,
    /// The expected wake or start time exceeds the hold limit.
    WaitTooLong,
    /// Held for the whole hold limit.
    HoldTimeout,
    /// The model failed and backs off until its next retry.
    Failed,
    /// The control plane will not wake the model (stopped by an operator).
    Refused,
    /// The proxy is shutting down.
    ShuttingDown,
    /// The proxy has not heard from any control plane yet.
    NotReady,
    /// Every one of the engine's slots (`--engine-concurrency`) stayed
    /// taken for the model's hold limit.
    EngineBusy,
}

impl ShedReason {
    pub fn code(self) -> &'static str {
        match self {
            ShedReason::QueueFull => "queue_full",
            ShedReason::WaitTooLong => "wait_too_long",
            ShedReason::HoldTimeout => "hold_timeout",
            ShedReason::Failed => "model_failed",
            ShedReason::Refused => "model_unavailable",
            ShedReason::ShuttingDown => "proxy_shutting_down",
            ShedReason::NotReady => "proxy_not_ready",
            ShedReason::EngineBusy => "engine_busy",
        }
    }
}

/// The longest piece of a client's input an error repeats.
const SHOWN: usize = 256;

/// `input` as an error repeats it: whole when short, else its first
/// [`SHOWN`] bytes (on a character boundary) and how long it was. A 100 KB
/// `model` was sent back whole in the 404.
pub fn shown(input: &str) -> String {
    if input.len() <= SHOWN {
        return input.to_owned();
    }
    let mut end = SHOWN;
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &input[..end], input.len())
}

/// An error answered by the proxy itself.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error(
        "no route for {0}: this proxy serves POST /v1/... requests with a `model` field and GET /v1/models"
    )]
    NoRoute(String),
    /// The admin listener's: its own paths, and where model requests go
    /// (it said "this proxy serves POST /v1/...", which 404 there).
    #[error(
        "no route for {0} on the admin listener: it serves GET or HEAD /healthz, /readyz and \
         /metrics; model requests go to the main listener (--listen)"
    )]
    NoAdminRoute(String),
    /// A path served here, asked with a method it does not take.
    #[error("{method} is not allowed on {path}: it takes {allow}")]
    MethodNotAllowed {
        method: String,
        path: String,
        allow: &'static str,
    },
    #[error(
        "The model `{0}` does not exist. GET /v1/models lists the models and aliases served here."
    )]
    UnknownModel(String),
    #[error(
        "the request body must be a JSON object with a string `model` field (or a multipart/form-data body with a `model` field)"
    )]
    MissingModel,
    /// The body names no model and more than one is served (the list).
    #[error(
        "the request names no `model` and this proxy serves {0}: name one in the `model` field"
    )]
    ModelRequired(String),
    #[error("the `model` field must be a non-empty string")]
    InvalidModel,
    #[error("malformed JSON body: {0}")]
    MalformedJson(String),
    /// vLLM's words, and the model's: the request did not say
    /// `Content-Type: application/json`.
    #[error(
        "Unsupported Media Type: Only 'application/json' is allowed (model `{0}`'s engine, vLLM, reads no other; send `Content-Type: application/json`)"
    )]
    UnsupportedMediaType(String),
    #[error("malformed multipart/form-data body: {0}")]
    MalformedForm(&'static str),
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("request headers exceed the limit of {limit} bytes (the proxy's --max-header-bytes)")]
    HeadersTooLarge { limit: usize },
    /// The body stalled for the body timeout, or came too slowly.
    #[error("{0}")]
    BodyTimeout(String),
    #[error("error reading the request body: {0}")]
    BodyRead(String),
    #[error("missing or invalid API key: send it as `Authorization: Bearer KEY`")]
    Unauthorized,
    #[error("{message}")]
    Shed {
        reason: ShedReason,
        retry_after_s: Option<u64>,
        message: String,
    },
    #[error("the model's engine failed while answering (retrying may help): {0}")]
    Upstream(String),
    #[error("the model's engine did not answer: {0}")]
    UpstreamTimeout(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::NoRoute(_) | ApiError::NoAdminRoute(_) | ApiError::UnknownModel(_) => {
                StatusCode::NOT_FOUND
            }
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::MissingModel
            | ApiError::ModelRequired(_)
            | ApiError::InvalidModel
            | ApiError::MalformedJson(_)
            | ApiError::UnsupportedMediaType(_)
            | ApiError::MalformedForm(_)
            | ApiError::BodyRead(_) => StatusCode::BAD_REQUEST,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Shed { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ApiError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    fn kind_and_code(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::NoRoute(_) | ApiError::NoAdminRoute(_) => {
                ("invalid_request_error", "not_found")
            }
            ApiError::MethodNotAllowed { .. } => ("invalid_request_error", "method_not_allowed"),
            ApiError::UnknownModel(_) => ("invalid_request_error", "model_not_found"),
            ApiError::MissingModel | ApiError::ModelRequired(_) => {
                ("invalid_request_error", "missing_model")
            }
            ApiError::InvalidModel => ("invalid_request_error", "invalid_model"),
            ApiError::MalformedJson(_) => ("invalid_request_error", "invalid_json"),
            ApiError::UnsupportedMediaType(_) => {
                ("invalid_request_error", "unsupported_media_type")
            }
            ApiError::MalformedForm(_) => ("invalid_request_error", "invalid_form"),
            ApiError::BodyTooLarge { .. } => ("invalid_request_error", "request_too_large"),
            ApiError::HeadersTooLarge { .. } => ("invalid_request_error", "headers_too_large"),
            ApiError::BodyTimeout(_) => ("invalid_request_error", "request_timeout"),
            ApiError::BodyRead(_) => ("invalid_request_error", "invalid_body"),
            ApiError::Unauthorized => ("invalid_request_error", "invalid_api_key"),
            ApiError::Shed { reason, .. } => ("server_error", reason.code()),
            ApiError::Upstream(_) => ("server_error", "upstream_error"),
            ApiError::UpstreamTimeout(_) => ("server_error", "upstream_timeout"),
        }
    }

    /// The response for this error.
    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.status();
        let (kind, code) = self.kind_and_code();
        let body = serde_json::json!({
            "error": { "message": self.to_string(), "type": kind, "code": code }
        });
        let mut resp = Response::new(ProxyBody::full(body.to_string()));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let ApiError::Shed {
            retry_after_s: Some(s),
            ..
        } = self
        {
            h.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if status == StatusCode::UNAUTHORIZED {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let ApiError::MethodNotAllowed { allow, .. } = self {
            h.insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        resp
    }
}

/// A small JSON response written by the proxy.
pub fn json_response(status: StatusCode, body: impl Into<bytes::Bytes>) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shed_carries_retry_after_and_openai_shape() {
        let resp = ApiError::Shed {
            reason: ShedReason::QueueFull,
            retry_after_s: Some(7),
            message: "queue full".into(),
        }
        .into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "7");
        let ProxyBody::Full(Some(b)) = resp.into_body() else {
            panic!("full body expected")
        };
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], "queue_full");
        assert_eq!(v["error"]["type"], "server_error");
        assert_eq!(v["error"]["message"], "queue full");
    }

    #[test]
    fn unknown_model_names_it() {
        let e = ApiError::UnknownModel(shown("llama-9"));
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        assert!(e.to_string().contains("`llama-9`"));
    }

    /// A long name is repeated in part, with its length; never cut inside
    /// a character.
    #[test]
    fn a_long_input_is_shown_in_part() {
        let long = "é".repeat(50_000);
        let s = shown(&long);
        assert!(s.len() < 300, "{}", s.len());
        assert!(s.ends_with("… (100000 bytes)"), "{s}");
        assert_eq!(shown("m"), "m");
    }
}
