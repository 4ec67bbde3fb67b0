//! `GET /events`: the Watch stream as server-sent events. Each event is
//! `id: INCARNATION-REVISION`, `event: snapshot|model|model_removed|gpus|placement`,
//! `data: JSON` (one line, exactly what `siesta watch -o json` prints).
//! A client resumes with `Last-Event-ID` (what `EventSource` sends on
//! reconnect) or `?since=ID`: it gets the events after it, or a fresh
//! snapshot with `resync: true` when they are no longer kept.
//!
//! INCARNATION is the control plane's start time (`started_unix_ms`, as
//! `GetInfo` reports it). Revisions restart at 1 in a new process, so a bare
//! revision from a browser that was following the previous process would
//! name the wrong point of the new one's history: the client would get the
//! events after it and never the first state of each model. An id of another
//! incarnation, a bare revision (the ids before this change, or a number read
//! from the JSON: we cannot tell which process it came from) or anything
//! unparsable therefore gets a snapshot with `resync: true`, never an error:
//! a browser stuck with an id we cannot read must still recover.

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

/// Where a client asks to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resume {
    /// No resume point: a snapshot.
    Fresh,
    /// After this revision of this incarnation.
    After(u64),
    /// A resume point we cannot place in this process's history: a
    /// snapshot marked `resync`.
    Resync,
}

/// The SSE id of `revision` in this incarnation.
fn event_id(incarnation: i64, revision: u64) -> String {
    format!("{incarnation}-{revision}")
}

/// Where to resume: `Last-Event-ID`, else `?since=`, else a snapshot.
fn resume<B>(req: &Request<B>, incarnation: i64) -> Resume {
    let header = req
        .headers()
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string());
    let given = header.or_else(|| query_param(req.uri(), "since"));
    match given.as_deref().map(str::trim) {
        None | Some("") | Some("0") => Resume::Fresh,
        Some(id) => parse_id(id, incarnation),
    }
}

/// `INCARNATION-REVISION` of this incarnation resumes; anything else
/// (another incarnation, a bare revision, garbage) resyncs.
fn parse_id(id: &str, incarnation: i64) -> Resume {
    let Some((inc, rev)) = id.split_once('-') else {
        return Resume::Resync;
    };
    match (inc.parse::<i64>(), rev.parse::<u64>()) {
        (Ok(inc), Ok(0)) if inc == incarnation => Resume::Fresh,
        (Ok(inc), Ok(rev)) if inc == incarnation => Resume::After(rev),
        _ => Resume::Resync,
    }
}

/// One SSE frame.
pub fn frame(ev: &EventView, incarnation: i64) -> String {
    let data = serde_json::to_string(ev).unwrap_or_else(|_| "{}".into());
    format!(
        "id: {}\nevent: {}\ndata: {data}\n\n",
        event_id(incarnation, ev.revision),
        ev.kind
    )
}

pub fn events<B>(web: &Web, req: &Request<B>, cancel: CancellationToken) -> Response<Body> {
    let incarnation = web.service.started_unix_ms;
    let from = resume(req, incarnation);
    let hub = &web.service.hub;
    let sub = match from {
        Resume::Fresh => hub.subscribe(0),
        Resume::After(rev) => hub.subscribe(rev),
        Resume::Resync => hub.subscribe_resync(false),
    };
    let Some(sub) = sub else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the control plane is shutting down",
        );
    };
    tracing::debug!(?from, "web: events stream opened");
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
            let text = frame(&EventView::from(&ev), incarnation);
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

    const INC: i64 = 1_700_000_000_123;

    fn r(uri: &str, last: Option<&str>) -> Resume {
        resume(&req(uri, last), INC)
    }

    #[test]
    fn resume_point() {
        assert_eq!(r("/events", None), Resume::Fresh);
        assert_eq!(r("/events?since=", None), Resume::Fresh);
        assert_eq!(r("/events?since=0", None), Resume::Fresh);
        let this = format!("/events?since={INC}-7");
        assert_eq!(r(&this, None), Resume::After(7));
        let header = format!("{INC}-9");
        assert_eq!(r(&this, Some(&header)), Resume::After(9), "the header wins");
        assert_eq!(r("/events", Some(&format!("{INC}-0"))), Resume::Fresh);
    }

    /// Revisions restart at 1 in a new process: an id of the last one, or a
    /// bare revision that could be, gets a snapshot, as does an id we
    /// cannot read (a browser must never be stuck on it).
    #[test]
    fn ids_we_cannot_place_resync() {
        let old = format!("{}-7", INC - 60_000);
        assert_eq!(r("/events", Some(&old)), Resume::Resync);
        assert_eq!(r(&format!("/events?since={old}"), None), Resume::Resync);
        assert_eq!(r("/events?since=7", None), Resume::Resync);
        assert_eq!(r("/events", Some("7")), Resume::Resync);
        assert_eq!(r("/events?since=x", None), Resume::Resync);
        assert_eq!(r(&format!("/events?since={INC}-x"), None), Resume::Resync);
        assert_eq!(r(&format!("/events?since=-{INC}-7"), None), Resume::Resync);
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
        let f = frame(&EventView::from(&ev), INC);
        assert!(
            f.starts_with(&format!("id: {INC}-42\nevent: model_removed\ndata: {{")),
            "{f}"
        );
        assert!(f.contains("\"model_removed\":\"m\""), "{f}");
        assert!(f.ends_with("\n\n"));
        assert_eq!(parse_id(&format!("{INC}-42"), INC), Resume::After(42));
    }
}
