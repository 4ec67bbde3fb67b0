//! Stand-in for `siesta_proxy::handler` around the real `handler/checks.rs`.

/// The fields of the proxy's `Shared` that `checks.rs` reads.
#[derive(Debug)]
pub struct Shared {
    pub api_keys: Vec<Vec<u8>>,
    pub max_body_bytes: usize,
    pub body_timeout: std::time::Duration,
}

/// `proxy/src/handler/checks.rs`: path allow-listing, API key, body read.
#[path = "../../proxy/src/handler/checks.rs"]
pub mod checks;
