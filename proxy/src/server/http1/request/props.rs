//! Properties of [`take`] over generated requests (what a fuzzer would
//! look for, run in the test suite): requests built from pieces that are
//! plain and pieces that are not (other methods, versions and paths,
//! duplicate or odd lengths, `Transfer-Encoding`, bare LFs, bytes that are
//! not HTTP), and bytes of no form at all.
//!
//! - nothing panics;
//! - a request not taken leaves the buffer exactly as it was (hyper gets
//!   every byte);
//! - a request taken is its head and exactly `Content-Length` bytes of
//!   body, and what follows stays for the next request;
//! - a request taken whole is never taken, nor given to hyper, from a
//!   prefix of itself (it arrives in any pieces);
//! - the lines the engine gets are one header each, never a hop-by-hop
//!   one, `Host` or `Content-Length`;
//! - only a POST over HTTP/1.1 with one length and no other framing is
//!   taken;
//! - [`head_is_whole`] says a head is whole exactly from its last byte on.

use super::*;
use proptest::prelude::*;

fn rules() -> Rules<'static> {
    Rules {
        max_header_bytes: 512,
        max_body_bytes: 64,
        api_keys: &[],
        body_timeout: std::time::Duration::from_secs(1),
    }
}

fn method() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        6 => Just("POST"),
        1 => Just("GET"),
        1 => Just("post"),
        1 => Just("POST "),
    ]
}

fn target() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        4 => Just("/v1/chat/completions"),
        2 => Just("/v1/completions?stream=true"),
        1 => Just("/v1/../sleep"),
        1 => Just("/sleep"),
        1 => Just("/v1/x?a=<b>"),
        1 => Just("*"),
        1 => Just("http://host/v1/models"),
    ]
}

fn version() -> impl Strategy<Value = &'static str> {
    prop_oneof![6 => Just("HTTP/1.1"), 1 => Just("HTTP/1.0"), 1 => Just("HTTP/2.0")]
}

/// One header line (without its line end), `{n}` standing for the body's
/// length.
fn header() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => Just("Content-Length: {n}".to_string()),
        4 => Just("content-type: application/json".to_string()),
        1 => Just("Content-Length: +{n}".to_string()),
        1 => Just("Transfer-Encoding: chunked".to_string()),
        1 => Just("Connection: keep-alive, X-Hop".to_string()),
        3 => Just("X-Hop: 1".to_string()),
        1 => Just("Connection: close".to_string()),
        1 => Just("Expect: 100-continue".to_string()),
        1 => Just("Host: proxy".to_string()),
        1 => Just("Keep-Alive: timeout=5".to_string()),
        1 => Just("Authorization: Bearer k".to_string()),
        1 => Just(" folded".to_string()),
        1 => Just("Bad Name: x".to_string()),
        8 => "[a-zA-Z-]{1,12}: [ -~]{0,20}".prop_map(|s| s),
    ]
}

/// The body's length, as the request says it (mostly once, plainly).
fn length() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        12 => Just("Content-Length: {n}"),
        1 => Just("content-length:  {n} "),
        1 => Just("Content-Length: {n}, {n}"),
        1 => Just("Content-Length: 99999999999999999999"),
        1 => Just(""),
    ]
}

prop_compose! {
    /// A request, the length its body says it has, and what follows it.
    fn request()(
        method in method(),
        target in target(),
        version in version(),
        headers in prop::collection::vec(header(), 0..5),
        length in length(),
        at in 0usize..5,
        lf in prop::sample::select(vec!["\r\n", "\r\n", "\r\n", "\n"]),
        body in prop::collection::vec(any::<u8>(), 0..80),
        extra in prop::collection::vec(any::<u8>(), 0..16),
    ) -> (Vec<u8>, Vec<u8>) {
        let n = body.len().to_string();
        let mut bytes = format!("{method} {target} {version}{lf}").into_bytes();
        let mut headers = headers;
        if !length.is_empty() {
            headers.insert(at.min(headers.len()), length.to_string());
        }
        for h in headers {
            bytes.extend_from_slice(h.replace("{n}", &n).as_bytes());
            bytes.extend_from_slice(lf.as_bytes());
        }
        bytes.extend_from_slice(lf.as_bytes());
        bytes.extend_from_slice(&body);
        (bytes, extra)
    }
}

/// Checks the properties on `bytes` followed by `extra` (`bytes` being one
/// request exactly when `exact`).
fn check(bytes: &[u8], extra: &[u8], exact: bool) -> Result<(), TestCaseError> {
    let r = rules();
    let mut all = bytes.to_vec();
    all.extend_from_slice(extra);
    let mut buf = BytesMut::from(&all[..]);
    match take(&r, &mut buf) {
        Parsed::Other | Parsed::TooLarge | Parsed::Need(_) | Parsed::Body { .. } => {
            prop_assert_eq!(&buf[..], &all[..], "a request not taken changed the buffer");
        }
        Parsed::Whole(req) => {
            let taken = req.head.len() + req.body.len();
            if exact {
                prop_assert_eq!(taken, bytes.len(), "not the request's own length");
            }
            prop_assert_eq!(&all[..req.head.len()], &req.head[..]);
            prop_assert_eq!(&all[req.head.len()..taken], &req.body[..]);
            prop_assert_eq!(&buf[..], &all[taken..], "what follows was touched");
            let lines = String::from_utf8_lossy(&req.lines).into_owned();
            let head = String::from_utf8_lossy(&req.head).to_ascii_lowercase();
            let hop = head.contains("connection: keep-alive, x-hop");
            // Only a plain request is taken: a POST over HTTP/1.1 with one
            // length and no other framing (a request smuggled past hyper's
            // rules would be read here otherwise).
            prop_assert!(
                head.starts_with("post /v1/") && head.contains(" http/1.1"),
                "{head:?}"
            );
            for refused in ["\ntransfer-encoding:", "\nexpect:", "\nupgrade:"] {
                prop_assert!(!head.contains(refused), "{refused} taken: {head:?}");
            }
            prop_assert_eq!(head.matches("\ncontent-length:").count(), 1, "{:?}", head);
            for line in lines.split("\r\n").skip(1) {
                let name = line.split(':').next().unwrap_or("").to_ascii_lowercase();
                prop_assert!(!line.contains('\n') && !line.contains('\r'), "{line:?}");
                let stops = matches!(
                    name.as_str(),
                    "host"
                        | "content-length"
                        | "connection"
                        | "keep-alive"
                        | "transfer-encoding"
                        | "te"
                        | "upgrade"
                ) || (hop && name == "x-hop");
                prop_assert!(!stops, "{name} passed on: {lines:?}");
            }
            // Taken whole from the bytes: never from a prefix of them.
            for k in 0..taken {
                // What the header timeout looks at to close or hand over.
                prop_assert_eq!(head_is_whole(&all[..k]), k >= req.head.len(), "at {}", k);
                let mut part = BytesMut::from(&all[..k]);
                match take(&r, &mut part) {
                    Parsed::Need(n) => {
                        prop_assert!(k < req.head.len(), "head whole at {k}: needs {n}");
                        prop_assert!(n > k, "needs {n} with {k} of {taken}");
                    }
                    Parsed::Body { head, length, .. } => {
                        prop_assert_eq!(head, req.head.len(), "at {}", k);
                        prop_assert!(head + length > k, "needs {head} + {length} with {k}");
                    }
                    Parsed::Whole(_) => prop_assert!(false, "taken from {k} of {taken} bytes"),
                    Parsed::Other | Parsed::TooLarge => {
                        prop_assert!(false, "given up at {k} of {taken} bytes")
                    }
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn generated_requests(req in request()) {
        check(&req.0, &req.1, true)?;
    }

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        check(&bytes, b"", false)?;
    }
}

/// The generator reaches both outcomes (a property that only ever saw
/// requests given to hyper would prove little).
#[test]
fn the_generator_makes_plain_requests_and_others() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut whole, mut other) = (0, 0);
    for _ in 0..500 {
        let (bytes, _) = request().new_tree(&mut runner).unwrap().current();
        match take(&rules(), &mut BytesMut::from(&bytes[..])) {
            Parsed::Whole(_) => whole += 1,
            _ => other += 1,
        }
    }
    assert!(whole >= 25 && other >= 25, "whole {whole}, other {other}");
}
