use super::*;

const KEYS: &[Vec<u8>] = &[];

fn rules(keys: &[Vec<u8>]) -> Rules<'_> {
    Rules {
        max_header_bytes: 1024,
        max_body_bytes: 100,
        api_keys: keys,
        body_timeout: std::time::Duration::from_secs(1),
    }
}

fn post(path: &str, headers: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: proxy\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn whole(r: &Rules<'_>, buf: &mut BytesMut) -> Request {
    match take(r, buf) {
        Parsed::Whole(req) => req,
        Parsed::Need(n) => panic!("needs {n} bytes, has {}", buf.len()),
        Parsed::Body { head, length, .. } => {
            panic!("needs {} bytes, has {}", head + length, buf.len())
        }
        Parsed::Other | Parsed::TooLarge => {
            panic!("not plain: {:?}", String::from_utf8_lossy(buf))
        }
    }
}

fn lines(req: &Request) -> String {
    String::from_utf8(req.lines.clone()).unwrap()
}

#[test]
fn a_plain_request_is_taken_whole_with_the_headers_the_engine_gets() {
    let body = r#"{"model":"m"}"#;
    let bytes = post(
        "/v1/chat/completions?x=1",
        "Content-Type: application/json\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n\
         Keep-Alive: timeout=5\r\nTE: trailers\r\nX-Request-Id: abc\r\nAuthorization: Bearer k\r\n\
         Origin: http://page\r\n",
        body,
    );
    let mut buf = BytesMut::from(&bytes[..]);
    buf.extend_from_slice(b"POST /v1/next");
    let req = whole(&rules(KEYS), &mut buf);
    assert_eq!(&req.body[..], body.as_bytes());
    assert_eq!(
        &buf[..],
        b"POST /v1/next",
        "the rest stays for the next read"
    );
    assert_eq!(req.client().target, "/v1/chat/completions?x=1");
    assert_eq!(
        &req.head[req.content_type.clone().unwrap()],
        b"application/json"
    );
    assert!(req.origin && !req.close);
    // Host, Content-Length and the hop-by-hop ones (X-Hop is named in
    // Connection) stop here; with no keys configured, Authorization is the
    // client's own and goes on.
    assert_eq!(
        lines(&req),
        "\r\nContent-Type: application/json\r\nX-Request-Id: abc\r\nAuthorization: Bearer k\r\nOrigin: http://page"
    );
}

#[test]
fn with_api_keys_only_a_request_carrying_one_is_plain_and_its_key_stops_here() {
    let keys = vec![b"secret".to_vec()];
    let r = rules(&keys);
    let mut ok = BytesMut::from(&post("/v1/x", "authorization: bearer secret\r\n", "{}")[..]);
    let req = whole(&r, &mut ok);
    assert!(!lines(&req).to_lowercase().contains("authorization"));
    for auth in ["", "Authorization: Bearer wrong\r\n"] {
        let mut bad = BytesMut::from(&post("/v1/x", auth, "{}")[..]);
        assert!(matches!(take(&r, &mut bad), Parsed::Other), "{auth:?}");
    }
}

#[test]
fn a_request_arriving_byte_by_byte_is_taken_once_whole_and_the_same() {
    let bytes = post(
        "/v1/embeddings",
        "Connection: close\r\n",
        r#"{"model":"m","input":"x"}"#,
    );
    let head_len = bytes.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let r = rules(KEYS);
    let mut buf = BytesMut::new();
    for (i, b) in bytes.iter().enumerate() {
        match take(&r, &mut buf) {
            Parsed::Need(n) if i < head_len => assert_eq!(n, r.max_header_bytes),
            Parsed::Body { head, length, .. } if i >= head_len => {
                assert_eq!((head, head + length), (head_len, bytes.len()))
            }
            other => panic!("at byte {i}: {}", matches!(other, Parsed::Other)),
        }
        buf.extend_from_slice(&[*b]);
    }
    let req = whole(&r, &mut buf);
    assert!(buf.is_empty());
    assert!(req.close);
    assert_eq!(req.head.len(), head_len);
    assert_eq!(&req.body[..], &bytes[head_len..]);
}

#[test]
fn anything_but_a_plain_request_is_left_to_hyper() {
    let r = rules(KEYS);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "GET",
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        ),
        (
            "HTTP/1.0",
            b"POST /v1/x HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
        ),
        (
            "chunked",
            post("/v1/x", "Transfer-Encoding: chunked\r\n", ""),
        ),
        ("expect", post("/v1/x", "Expect: 100-continue\r\n", "{}")),
        ("upgrade", post("/v1/x", "Upgrade: h2c\r\n", "{}")),
        ("two lengths", post("/v1/x", "Content-Length: 2\r\n", "{}")),
        (
            "signed length",
            b"POST /v1/x HTTP/1.1\r\nContent-Length: +2\r\n\r\n{}".to_vec(),
        ),
        (
            "no length",
            b"POST /v1/x HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        ),
        ("over the body limit", post("/v1/x", "", &"x".repeat(101))),
        ("admin path", post("/sleep", "", "{}")),
        ("escape", post("/v1/../sleep", "", "{}")),
        ("absolute form", post("http://x/v1/x", "", "{}")),
        ("h2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec()),
        ("not http", b"hello there\r\n\r\n".to_vec()),
        (
            "space before colon",
            b"POST /v1/x HTTP/1.1\r\nContent-Length : 2\r\n\r\n{}".to_vec(),
        ),
        (
            "folded header",
            b"POST /v1/x HTTP/1.1\r\nX-A: 1\r\n 2\r\nContent-Length: 2\r\n\r\n{}".to_vec(),
        ),
        (
            "two authorizations",
            post(
                "/v1/x",
                "Authorization: Bearer a\r\nAuthorization: Bearer b\r\n",
                "{}",
            ),
        ),
        (
            "two content types",
            post("/v1/x", "Content-Type: a/b\r\nContent-Type: c/d\r\n", "{}"),
        ),
        ("query hyper refuses", post("/v1/x?a=<b>", "", "{}")),
        ("fragment", post("/v1/x?a=1#f", "", "{}")),
    ];
    for (what, bytes) in cases {
        let mut buf = BytesMut::from(&bytes[..]);
        assert!(
            matches!(take(&r, &mut buf), Parsed::Other),
            "{what} was taken as plain"
        );
        assert_eq!(&buf[..], &bytes[..], "{what}: bytes were taken out");
    }
}

/// A head over the limit, whole or still coming, is refused as too large
/// (answered 431 here), not handed on.
#[test]
fn a_head_over_the_limit_is_too_large_whole_or_not() {
    let r = rules(KEYS);
    let pad = format!("x-pad: {}\r\n", "a".repeat(r.max_header_bytes));
    let mut whole_head = BytesMut::from(&post("/v1/chat/completions", &pad, "{}")[..]);
    assert!(matches!(take(&r, &mut whole_head), Parsed::TooLarge));
    let mut part = BytesMut::from(&post("/v1/chat/completions", &pad, "{}")[..r.max_header_bytes]);
    assert!(matches!(take(&r, &mut part), Parsed::TooLarge));
    let mut short = BytesMut::from(&post("/v1/chat/completions", "", "{}")[..20]);
    assert!(matches!(take(&r, &mut short), Parsed::Need(_)));
    // Any path: the limit is the connection's, not the plain path's.
    for bytes in [
        post("/v1/x", &format!("X-Long: {}\r\n", "a".repeat(1100)), "{}"),
        {
            let mut b = b"POST /v1/x HTTP/1.1\r\nX-Long: ".to_vec();
            b.extend(std::iter::repeat_n(b'a', 1100));
            b
        },
    ] {
        let mut buf = BytesMut::from(&bytes[..]);
        assert!(matches!(take(&r, &mut buf), Parsed::TooLarge));
        assert_eq!(&buf[..], &bytes[..], "bytes were taken out");
    }
}
