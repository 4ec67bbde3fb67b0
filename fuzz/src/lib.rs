//! The proxy's pure request-parsing code, compiled into the fuzz crate
//! straight from its source files (`siesta-proxy` keeps these modules
//! private), plus small stand-ins for the crate items those files name
//! (`crate::errors::ApiError`, `crate::handler::Shared`).
//!
//! The included modules must sit at this crate's root so that their
//! `crate::...` paths resolve here as they do in `siesta-proxy`.
#![allow(dead_code)]

/// Stand-in for `siesta_proxy::errors`: the variants the included files build.
pub mod errors {
    /// Same variant names as the proxy's `ApiError`.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum ApiError {
        MissingModel,
        InvalidModel,
        MalformedJson(String),
        MalformedForm(&'static str),
        BodyTooLarge { limit: usize },
        BodyTimeout(String),
        BodyRead(String),
    }
}

/// `proxy/src/model_field.rs`: find the `model` field, splice the served name.
#[path = "../../proxy/src/model_field.rs"]
pub mod model_field;

/// `proxy/src/form_field.rs`: the `model` field of a multipart form.
#[path = "../../proxy/src/form_field.rs"]
pub mod form_field;

/// Stand-in for `siesta_proxy::handler` around the real `handler/checks.rs`.
pub mod handler;
