//! `GET /events`: the Watch stream as server-sent events. Each event is
//! `id: REVISION`, `event: snapshot|model|model_removed|gpus|placement`,
//! `data: JSON` (one line, exactly what `siesta watch -o json` prints).
//! A client resumes with `Last-Event-ID` (what `EventSource` sends on
//! reconnect) or `?since=REVISION`: it gets the events after it, or a fresh
//! snapshot with `resync: true` when they are no longer kept.

use super::view::EventView;
use super::{Body, Web, error, query_param};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode};
use std::convert::Infallible;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A comment line this often keeps proxies and browsers from timing out.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// Where to resume: `Last-Event-ID`, else `?since=`, else 0 (a snapshot).
fn since<B>(req: &Request<B>) -> Result<u64, String> {
    let header = req
        .headers()
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(|s| ("Last-Event-ID", s.trim().to_string()));
    let query = query_param(req.uri(), "since").map(|s| ("since", s));
    match header.or(query) {
        None => Ok(0),
        Some((_, v)) if v.is_empty() => Ok(0),
        Some((what, v)) => v
            .parse()
            .map_err(|_| format!("{what} {v:?} is not a revision (a whole number)")),
    }
}

/// One SSE frame.
pub fn frame(ev: &EventView) -> String {
    let data = serde_json::to_string(ev).unwrap_or_else(|_| "{}".into());
    format!("id: {}\nevent: {}\ndata: {data}\n\n", ev.revision, ev.kind)
}

pub fn events<B>(web: &Web, req: &Request<B>, cancel: CancellationToken) -> Response<Body> {
    let since = match since(req) {
        Ok(s) => s,
        Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
    };
    let Some(sub) = web.service.hub.subscribe(since) else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the control plane is shutting down",
        );
    };
    tracing::debug!(since, "web: events stream opened");
    let control_id = web.service.control_id.clone();
    let first = futures::stream::once(async { Ok(Frame::data(Bytes::from("retry: 1000\n\n"))) });
    let rest = futures::stream::unfold((sub, cancel), move |(mut sub, cancel)| {
        let control_id = control_id.clone();
        async move {
            let item = tokio::select! {
                _ = cancel.cancelled() => return None,
                item = sub.next() => item,
                _ = tokio::time::sleep(KEEPALIVE) => {
                    return Some((Ok(Frame::data(Bytes::from(": keep-alive\n\n"))), (sub, cancel)));
                }
            }?;
            let ev = crate::api::convert::watch_event(&item, &control_id);
            let text = frame(&EventView::from(&ev));
            Some((
                Ok::<_, Infallible>(Frame::data(Bytes::from(text))),
                (sub, cancel),
            ))
        }
    });
    let body = BodyExt::boxed(StreamBody::new(first.chain(rest)));
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        "text/event-stream".parse().unwrap(),
    );
    h.insert(hyper::header::CACHE_CONTROL, "no-cache".parse().unwrap());
    h.insert("x-accel-buffering", "no".parse().unwrap());
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(uri: &str, last: Option<&str>) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        if let Some(l) = last {
            b = b.header("last-event-id", l);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn resume_point() {
        assert_eq!(since(&req("/events", None)), Ok(0));
        assert_eq!(since(&req("/events?since=7", None)), Ok(7));
        assert_eq!(since(&req("/events?since=7", Some("9"))), Ok(9));
        let err = since(&req("/events?since=x", None)).unwrap_err();
        assert!(err.contains("since \"x\""), "{err}");
    }

    #[test]
    fn frame_has_id_event_and_data() {
        let ev = siesta_proto::v1::WatchEvent {
            revision: 42,
            at_unix_ms: 1,
            control_id: "box".into(),
            kind: Some(siesta_proto::v1::watch_event::Kind::ModelRemoved(
                "m".into(),
            )),
        };
        let f = frame(&EventView::from(&ev));
        assert!(
            f.starts_with("id: 42\nevent: model_removed\ndata: {"),
            "{f}"
        );
        assert!(f.contains("\"model_removed\":\"m\""), "{f}");
        assert!(f.ends_with("\n\n"));
    }
}
