//! The proxy's path allow-list (`forwardable_path`) on arbitrary request
//! targets, as hyper would hand them over.
//!
//! Invariants: no panic; an allowed path is a `/v1/...` path that stays under
//! `/v1/` however an engine (or anything in between) normalises it: after
//! percent-decoding, backslash-as-slash and dot-segment removal it still
//! starts with `/v1/` and is none of the engine admin paths.
#![no_main]

use libfuzzer_sys::fuzz_target;
use siesta_fuzz::handler::checks::forwardable_path;

/// vLLM's admin and dev-mode endpoints.
const ADMIN: &[&str] = &[
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/health",
    "/metrics",
    "/server_info",
    "/scale_elastic_ep",
];

fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// RFC 3986 dot-segment removal, after decoding and `\` → `/`.
fn normalise(path: &str) -> String {
    let decoded = String::from_utf8_lossy(&percent_decode(path)).replace('\\', "/");
    let mut segs: Vec<&str> = Vec::new();
    for seg in decoded.split('/').skip(1) {
        match seg {
            "." | "" => {}
            ".." => {
                segs.pop();
            }
            s => segs.push(s),
        }
    }
    format!("/{}", segs.join("/"))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Straight, and as the path of a parsed request target.
    let mut paths = vec![text.to_owned()];
    if let Ok(uri) = text.parse::<http::Uri>() {
        paths.push(uri.path().to_owned());
    }
    for path in paths {
        if !forwardable_path(&path) {
            continue;
        }
        assert!(path.starts_with("/v1/") && path.len() > 4, "{path:?}");
        assert!(
            path.is_ascii() && !path.contains('%') && !path.contains('?'),
            "{path:?}"
        );
        let norm = normalise(&path);
        assert!(norm.starts_with("/v1/"), "{path:?} normalises to {norm:?}");
        assert!(!ADMIN.contains(&norm.as_str()), "{path:?} reaches {norm:?}");
    }
});
