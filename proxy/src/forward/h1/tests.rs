use super::*;

fn head<'a>(method: &'a Method, strip: bool) -> RequestHead<'a> {
    RequestHead {
        method,
        target: "/v1/chat/completions?x=1",
        host: b"127.0.0.1:8001",
        content_length: 17,
        strip_authorization: strip,
    }
}

fn encoded(headers: &HeaderMap, strip: bool) -> String {
    let mut out = Vec::new();
    encode_request(
        &mut out,
        &head(&Method::POST, strip),
        ClientHeaders::Map(headers),
    );
    String::from_utf8(out).unwrap()
}

#[test]
fn the_request_head_keeps_end_to_end_headers_and_drops_hop_by_hop_ones() {
    let mut h = HeaderMap::new();
    h.insert(header::HOST, HeaderValue::from_static("proxy:8000"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("999"));
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::CONNECTION,
        HeaderValue::from_static("keep-alive, X-Secret"),
    );
    // A second Connection line names one more.
    h.append(header::CONNECTION, HeaderValue::from_static("x-other"));
    h.insert("x-other", HeaderValue::from_static("2"));
    h.insert("x-secret", HeaderValue::from_static("1"));
    h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
    h.insert(
        header::TRANSFER_ENCODING,
        HeaderValue::from_static("chunked"),
    );
    h.insert(header::TE, HeaderValue::from_static("trailers"));
    h.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
    h.insert(header::EXPECT, HeaderValue::from_static("100-continue"));
    h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
    h.append("x-many", HeaderValue::from_static("a"));
    h.append("x-many", HeaderValue::from_static("b"));
    let s = encoded(&h, false);
    assert_eq!(
        s,
        "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:8001\r\n\
         content-type: application/json\r\nauthorization: Bearer k\r\n\
         x-many: a\r\nx-many: b\r\ncontent-length: 17\r\n\r\n"
    );
    let s = encoded(&h, true);
    assert!(!s.contains("authorization"), "{s}");
    // What httparse reads back is what was meant.
    let mut raw = [httparse::EMPTY_HEADER; 16];
    let mut req = httparse::Request::new(&mut raw);
    assert_eq!(
        req.parse(s.as_bytes()).unwrap(),
        httparse::Status::Complete(s.len())
    );
    assert_eq!(req.method, Some("POST"));
    assert_eq!(req.path, Some("/v1/chat/completions?x=1"));
}

fn parse(bytes: &[u8]) -> (Result<Option<ResponseHead>, UpstreamError>, BytesMut) {
    let mut buf = BytesMut::from(bytes);
    let r = parse_response(&mut buf, &Method::POST, None);
    (r, buf)
}

#[test]
fn a_response_head_is_parsed_once_whole_and_its_bytes_taken_out() {
    let full = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive, x-hop\r\nx-hop: 1\r\nx-request-id: abc\r\n\r\n5\r\nhello";
    let cut = full.len() - 12;
    for end in 1..cut {
        let (r, buf) = parse(&full[..end]);
        assert!(r.unwrap().is_none(), "parsed from {end} bytes");
        assert_eq!(buf.len(), end, "nothing taken before the head is whole");
    }
    let (r, buf) = parse(full);
    let h = r.unwrap().unwrap();
    assert_eq!(&buf[..], b"5\r\nhello");
    assert_eq!(h.parts.status, StatusCode::OK);
    assert_eq!(h.body, BodyKind::Chunked);
    assert!(h.keep_alive);
    let names: Vec<_> = h.parts.headers.keys().map(|k| k.as_str()).collect();
    assert_eq!(names, ["content-type", "x-request-id"]);
}

#[test]
fn framing_and_keep_alive_follow_the_head() {
    let cases: [(&[u8], BodyKind, bool); 11] = [
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n",
            BodyKind::Length(12),
            true,
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            BodyKind::Empty,
            true,
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", BodyKind::Empty, true),
        (
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\n",
            BodyKind::Length(3),
            false,
        ),
        (b"HTTP/1.1 200 OK\r\n\r\n", BodyKind::UntilClose, false),
        (
            b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\n",
            BodyKind::Length(3),
            false,
        ),
        (
            b"HTTP/1.0 200 OK\r\nconnection: Keep-Alive\r\ncontent-length: 3\r\n\r\n",
            BodyKind::Length(3),
            true,
        ),
        // Both framings: chunked wins, the connection closes after it.
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 9\r\n\r\n",
            BodyKind::Chunked,
            false,
        ),
        // A Connection list split over two lines.
        (
            b"HTTP/1.1 200 OK\r\nconnection: close\r\nconnection: x-a\r\nx-a: 1\r\ncontent-length: 3\r\n\r\n",
            BodyKind::Length(3),
            false,
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\n\r\n",
            BodyKind::Length(3),
            true,
        ),
        (
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n",
            BodyKind::Chunked,
            false,
        ),
    ];
    for (bytes, body, keep_alive) in cases {
        let h = parse(bytes).0.unwrap().unwrap();
        let text = String::from_utf8_lossy(bytes);
        assert_eq!(h.body, body, "{text}");
        assert_eq!(h.keep_alive, keep_alive, "{text}");
        assert!(h.parts.headers.get("x-a").is_none(), "{text}");
        if body == BodyKind::Chunked {
            assert!(
                h.parts.headers.get(header::CONTENT_LENGTH).is_none(),
                "{text}"
            );
        }
    }
    let mut buf = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"[..]);
    let h = parse_response(&mut buf, &Method::HEAD, None)
        .unwrap()
        .unwrap();
    assert_eq!(h.body, BodyKind::Empty, "a HEAD response has no body");
    assert_eq!(h.parts.headers[header::CONTENT_LENGTH], "5");
}

#[test]
fn interim_responses_are_skipped() {
    let (r, buf) =
        parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok");
    assert_eq!(r.unwrap().unwrap().parts.status, StatusCode::CREATED);
    assert_eq!(&buf[..], b"ok");
}

#[test]
fn a_bad_head_is_an_error_naming_what_is_wrong() {
    let bad: [(&[u8], &str); 6] = [
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            "two different content-lengths",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            "not a number",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n",
            "not a number",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 5, 6\r\n\r\n",
            "not a number",
        ),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "response head"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "101"),
    ];
    for (bytes, says) in bad {
        let e = parse(bytes).0.unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
        assert!(e.starts_with("invalid response from the engine"), "{e}");
    }
    let mut long = b"HTTP/1.1 200 OK\r\nx: ".to_vec();
    long.resize(MAX_HEAD + 10, b'a');
    assert!(
        parse(&long)
            .0
            .unwrap_err()
            .to_string()
            .contains("longer than")
    );
}

#[test]
fn a_head_of_up_to_a_hundred_headers_is_kept_whole_and_more_is_an_error() {
    let head = |n: usize| {
        let mut h = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..n - 1 {
            h.extend_from_slice(format!("x-h{i}: {i}\r\n").as_bytes());
        }
        h.extend_from_slice(b"content-length: 2\r\n\r\nok");
        h
    };
    let (r, buf) = parse(&head(100));
    let h = r.unwrap().unwrap();
    assert_eq!(h.parts.headers.len(), 100);
    assert_eq!(h.parts.headers["x-h98"], "98");
    assert_eq!(h.body, BodyKind::Length(2));
    assert_eq!(&buf[..], b"ok");
    let e = parse(&head(101)).0.unwrap_err().to_string();
    assert!(e.contains("too many headers"), "{e}");
}

/// Decodes `wire` fed in pieces of `step` bytes; returns the data pieces.
fn decode_in_steps(kind: BodyKind, wire: &[u8], step: usize) -> (Vec<Bytes>, Decoder, BytesMut) {
    let mut d = Decoder::new(kind);
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for piece in wire.chunks(step) {
        buf.extend_from_slice(piece);
        while let Decoded::Data(b) = d.decode(&mut buf).unwrap() {
            assert!(!b.is_empty(), "an empty data piece");
            out.push(b);
        }
    }
    (out, d, buf)
}

#[test]
fn a_chunked_body_is_decoded_whatever_the_reads_cut() {
    let events = [
        "data: {\"a\":1}\n\n",
        "data: {\"b\":22}\n\n",
        "data: [DONE]\n\n",
    ];
    let mut wire = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if i == 1 {
            write!(wire, "{:X};ext=1\r\n{e}\r\n", e.len()).unwrap();
        } else {
            write!(wire, "{:x}\r\n{e}\r\n", e.len()).unwrap();
        }
    }
    wire.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\nNEXT");
    for step in 1..=wire.len() {
        let (out, d, buf) = decode_in_steps(BodyKind::Chunked, &wire, step);
        let joined: Vec<u8> = out.iter().flat_map(|b| b.to_vec()).collect();
        assert_eq!(joined, events.concat().as_bytes(), "step {step}");
        assert!(d.is_done(), "step {step}");
        assert_eq!(
            &buf[..],
            b"NEXT",
            "the next response's bytes stay, step {step}"
        );
        if step == wire.len() {
            // All at once: one piece per chunk (event boundaries kept).
            assert_eq!(out.len(), events.len());
        }
    }
}

#[test]
fn a_sized_body_ends_at_its_length_and_leaves_what_follows() {
    for step in 1..=14 {
        let (out, d, buf) = decode_in_steps(BodyKind::Length(10), b"0123456789HTTP", step);
        assert_eq!(out.concat(), b"0123456789");
        assert!(d.is_done());
        assert_eq!(&buf[..], b"HTTP");
    }
}

#[test]
fn bad_chunks_and_early_closes_are_errors() {
    // Not hex; a size line without digits; data longer than its size.
    for wire in [&b"zz\r\n"[..], b"\r\n", b"3\r\nabcX\r\n"] {
        let mut d = Decoder::new(BodyKind::Chunked);
        let mut buf = BytesMut::from(wire);
        let mut err = None;
        for _ in 0..4 {
            match d.decode(&mut buf) {
                Ok(Decoded::Data(_)) => continue,
                Ok(_) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        assert!(matches!(err, Some(UpstreamError::Invalid(_))), "{wire:?}");
    }
    let mut d = Decoder::new(BodyKind::Length(5));
    assert!(matches!(d.eof(), Err(UpstreamError::ClosedInBody)));
    let mut d = Decoder::new(BodyKind::Chunked);
    assert!(matches!(d.eof(), Err(UpstreamError::ClosedInBody)));
    let mut d = Decoder::new(BodyKind::UntilClose);
    let mut buf = BytesMut::from(&b"abc"[..]);
    assert_eq!(
        d.decode(&mut buf).unwrap(),
        Decoded::Data(Bytes::from_static(b"abc"))
    );
    d.eof().unwrap();
    assert!(
        d.is_done(),
        "a body without length ends when the engine closes"
    );
}

#[test]
fn only_a_close_before_any_answer_may_be_sent_again() {
    use std::io::{Error, ErrorKind};
    assert!(UpstreamError::ClosedBeforeHead.closed_before_answer());
    assert!(UpstreamError::Io(Error::from(ErrorKind::ConnectionReset)).closed_before_answer());
    assert!(!UpstreamError::Io(Error::from(ErrorKind::TimedOut)).closed_before_answer());
    assert!(!UpstreamError::ClosedInBody.closed_before_answer());
    assert!(!UpstreamError::Invalid("x".into()).closed_before_answer());
}

/// For the proxy's own HTTP/1.1 server the engine's headers are kept as
/// lines: the same headers the `HeaderMap` gets, in the engine's order.
#[test]
fn raw_response_headers_are_the_map_headers_as_lines() {
    let chunked = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\nConnection: keep-alive, x-hop\r\nx-hop: 1\r\nDate: Thu, 03 Dec 2026 18:00:00 GMT\r\nx-request-id: abc\r\n\r\n";
    let sized = b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\nkeep-alive: timeout=5\r\n\r\n{}";
    for (bytes, lines, has_length, has_date, sse) in [
        (
            &chunked[..],
            "Content-Type: text/event-stream\r\nDate: Thu, 03 Dec 2026 18:00:00 GMT\r\nx-request-id: abc\r\n",
            false,
            true,
            true,
        ),
        (
            &sized[..],
            "content-type: application/json\r\ncontent-length: 2\r\n",
            true,
            false,
            false,
        ),
    ] {
        let mut a = BytesMut::from(bytes);
        let map = parse_response(&mut a, &Method::POST, None)
            .unwrap()
            .unwrap();
        let mut raw = RawHead::default();
        let mut b = BytesMut::from(bytes);
        let head = parse_response(&mut b, &Method::POST, Some(&mut raw))
            .unwrap()
            .unwrap();
        assert_eq!(a, b, "both took the same bytes");
        assert!(head.parts.headers.is_empty());
        assert_eq!(head.parts.status, map.parts.status);
        assert_eq!((head.body, head.keep_alive), (map.body, map.keep_alive));
        assert_eq!((head.sse, map.sse), (sse, sse));
        assert_eq!(String::from_utf8(raw.lines.clone()).unwrap(), lines);
        assert_eq!((raw.has_length, raw.has_date), (has_length, has_date));
        assert_eq!(raw.to_map(), map.parts.headers);
    }
}

/// The client headers the proxy's own server passes on are those the
/// `HeaderMap` path passes on.
#[test]
fn the_headers_that_stop_here_are_the_same_in_any_case() {
    for (name, strip, stops) in [
        ("Connection", false, true),
        ("TE", false, true),
        ("Keep-Alive", false, true),
        ("Proxy-Connection", false, true),
        ("HOST", false, true),
        ("Content-Length", false, true),
        ("Expect", false, true),
        ("Authorization", false, false),
        ("Authorization", true, true),
        ("X-Request-Id", false, false),
        ("Content-Type", false, false),
    ] {
        assert_eq!(stops_here(name.as_bytes(), strip), stops, "{name} {strip}");
        let mut headers = HeaderMap::new();
        headers.insert(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_static("v"),
        );
        let passed = encoded(&headers, strip).contains(&format!("\r\n{}: v", name.to_lowercase()));
        assert_eq!(passed, !stops, "{name} {strip}");
    }
}
