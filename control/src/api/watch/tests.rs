//! `Watch` through its own response body (`body.rs`), over real gRPC:
//! every subscriber gets exactly the messages the per-subscriber encoding
//! gave (snapshot, then every event in order), and resume / resync are
//! unchanged.

use super::*;
use crate::status::{Clock, ModelStatus};
use futures::future::join_all;
use pb::control_client::ControlClient;
use pb::watch_event::Kind;
use std::time::Duration;
use tonic::transport::Channel;

/// Every path but Watch: unimplemented (the route must not reach it).
#[derive(Debug, Clone)]
struct Nothing;

impl NamedService for Nothing {
    const NAME: &'static str = "siesta.v1.Control";
}

impl<B: Send + 'static> Service<http::Request<B>> for Nothing {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<B>) -> Self::Future {
        std::future::ready(Ok(Status::unimplemented("not in this test").into_http()))
    }
}

fn status(name: &str, restarts: u32) -> ModelStatus {
    crate::status::test_status(name, restarts)
}

const LONG: Duration = Duration::from_secs(30);

/// The served run's `started_unix_ms`.
const STARTED: i64 = 1_700_000_000_000;

/// A hub with the daemon's encoder, served on a free port.
async fn serve(history: usize) -> (Arc<Hub>, String, CancellationToken) {
    let hub = Hub::new(Clock::new(), history, 1024);
    install_encoder(&hub, "ctl".into());
    let cancel = CancellationToken::new();
    let watch = WatchSvc::new(hub.clone(), "ctl", STARTED, cancel.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let stop = cancel.clone();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WatchRoute::new(Nothing, watch))
            .serve_with_incoming_shutdown(incoming, async move { stop.cancelled().await }),
    );
    (hub, url, cancel)
}

async fn client(url: &str) -> ControlClient<Channel> {
    ControlClient::connect(url.to_string()).await.unwrap()
}

async fn watch(c: &mut ControlClient<Channel>, since: u64) -> tonic::Streaming<pb::WatchEvent> {
    watch_of(c, since, 0).await
}

async fn watch_of(
    c: &mut ControlClient<Channel>,
    since: u64,
    incarnation: i64,
) -> tonic::Streaming<pb::WatchEvent> {
    watch_with(c, since, incarnation, false).await
}

async fn watch_with(
    c: &mut ControlClient<Channel>,
    since: u64,
    incarnation: i64,
    heartbeat: bool,
) -> tonic::Streaming<pb::WatchEvent> {
    c.watch(pb::WatchRequest {
        since_revision: since,
        client_id: "t".into(),
        incarnation,
        heartbeat,
    })
    .await
    .unwrap()
    .into_inner()
}

async fn next(s: &mut tonic::Streaming<pb::WatchEvent>) -> pb::WatchEvent {
    tokio::time::timeout(LONG, s.message())
        .await
        .expect("event in time")
        .unwrap()
        .expect("stream open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_subscribers_get_every_event_in_order() {
    let (hub, url, cancel) = serve(4096).await;
    hub.publish_model(status("a", 0));
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(client(&url).await);
    }
    let mut streams = Vec::new();
    let n = clients.len();
    for i in 0..200 {
        streams.push(watch(&mut clients[i % n], 0).await);
    }
    // Everyone has its snapshot (so is subscribed) before the events.
    for s in &mut streams {
        let first = next(s).await;
        let Some(Kind::Snapshot(snap)) = first.kind else {
            panic!("first message is not a snapshot: {first:?}")
        };
        assert_eq!(first.revision, 1);
        assert_eq!(snap.models.len(), 1);
        assert!(!snap.resync);
    }
    // What the per-subscriber encoding sent: convert each hub item.
    let mut reference = hub.subscribe(hub.revision()).unwrap();
    for i in 1..=40 {
        hub.publish_model(status(if i % 2 == 0 { "a" } else { "b" }, i));
    }
    let mut expected = Vec::new();
    for _ in 0..40 {
        expected.push(convert::watch_event(
            &reference.next().await.unwrap(),
            "ctl",
        ));
    }
    let got = join_all(streams.iter_mut().map(|s| async move {
        let mut v = Vec::new();
        for _ in 0..40 {
            v.push(next(s).await);
        }
        v
    }))
    .await;
    for (i, events) in got.iter().enumerate() {
        assert_eq!(events, &expected, "subscriber {i}");
    }
    let revisions: Vec<u64> = expected.iter().map(|e| e.revision).collect();
    assert_eq!(revisions, (2..=41).collect::<Vec<_>>());
    cancel.cancel();
}

#[tokio::test]
async fn resume_and_resync_are_unchanged() {
    let (hub, url, cancel) = serve(4).await;
    for i in 0..10 {
        hub.publish_model(status("a", i));
    }
    let mut c = client(&url).await;
    // Within the history: the events after it, no snapshot.
    let mut s = watch(&mut c, 8).await;
    for rev in [9, 10] {
        let e = next(&mut s).await;
        assert_eq!(e.revision, rev);
        assert_eq!(e.control_id, "ctl");
        assert!(matches!(e.kind, Some(Kind::Model(ref m)) if m.restarts == rev as u32 - 1));
    }
    // Older than the history: a resync snapshot at the current revision.
    let mut s = watch(&mut c, 2).await;
    let e = next(&mut s).await;
    assert_eq!(e.revision, 10);
    let Some(Kind::Snapshot(snap)) = e.kind else {
        panic!("want a snapshot: {e:?}")
    };
    assert!(snap.resync);
    // A revision within the history, but of another run of the control
    // plane (restarted, revisions started over): a resync snapshot, not
    // the events after a revision that meant something else. Of this run:
    // resumed.
    let mut other = watch_of(&mut c, 8, STARTED - 60_000).await;
    let e = next(&mut other).await;
    assert_eq!(e.revision, 10);
    assert!(
        matches!(e.kind, Some(Kind::Snapshot(ref snap)) if snap.resync),
        "{e:?}"
    );
    let mut same = watch_of(&mut c, 8, STARTED).await;
    assert_eq!(next(&mut same).await.revision, 9);
    // Asking for heartbeats: one after the catch-up, at the latest
    // revision, with the interval the stream keeps; after a resync
    // snapshot the same.
    for (since, incarnation, first) in [(8, STARTED, 9), (8, STARTED - 60_000, 10)] {
        let mut alive = watch_with(&mut c, since, incarnation, true).await;
        let mut revisions = vec![];
        let beat = loop {
            let e = next(&mut alive).await;
            match e.kind {
                Some(Kind::Heartbeat(beat)) => break (e.revision, beat),
                _ => revisions.push(e.revision),
            }
        };
        assert_eq!(revisions.first(), Some(&first));
        assert_eq!(revisions.last(), Some(&10));
        assert_eq!(
            beat,
            (
                10,
                pb::Heartbeat {
                    interval_ms: 10_000
                }
            )
        );
    }
    // Shutdown ends the streams.
    cancel.cancel();
    let end = tokio::time::timeout(LONG, s.message())
        .await
        .expect("ended in time");
    assert!(
        !matches!(end, Ok(Some(_))),
        "no message after shutdown: {end:?}"
    );
}

#[tokio::test]
async fn list_models_is_answered_from_the_kept_bytes_over_grpc() {
    let (hub, url, cancel) = serve(100).await;
    for (i, name) in ["b", "a", "c"].into_iter().enumerate() {
        hub.publish_model(status(name, i as u32));
    }
    hub.remove_model("c");
    let mut client = client(&url).await;
    let got = tokio::time::timeout(LONG, client.list_models(pb::ListModelsRequest {}))
        .await
        .unwrap()
        .unwrap()
        .into_inner();
    let (models, revision) = hub.models();
    assert_eq!(
        got,
        pb::ListModelsResponse {
            models: models.iter().map(convert::model_status).collect(),
            revision,
        }
    );
    assert_eq!(
        got.models
            .iter()
            .map(|m| m.name.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
    cancel.cancel();
}

/// Sends `body` as the request of a `Watch` call over plain HTTP/2; returns
/// the `grpc-status` the server answered (from the head or the trailers).
async fn raw_watch(url: &str, body: Vec<u8>) -> String {
    use http_body_util::{BodyExt, Full};
    let addr = url.trim_start_matches("http://");
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!("{url}{WATCH_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = tokio::time::timeout(LONG, send.send_request(req))
        .await
        .expect("an answer in time")
        .unwrap();
    if let Some(s) = resp.headers().get("grpc-status") {
        return s.to_str().unwrap().to_string();
    }
    let all = tokio::time::timeout(LONG, resp.into_body().collect())
        .await
        .expect("the body ends in time")
        .unwrap();
    let trailers = all.trailers().expect("trailers");
    trailers["grpc-status"].to_str().unwrap().to_string()
}

#[tokio::test]
async fn a_bad_watch_request_is_answered_with_a_grpc_status_not_a_stream() {
    let (_hub, url, cancel) = serve(16).await;
    // No message at all: Internal (as tonic answered).
    assert_eq!(raw_watch(&url, vec![]).await, "13");
    // A compressed message: this server takes no grpc-encoding.
    let msg = pb::WatchRequest::default().encode_to_vec();
    let mut gz = vec![1u8];
    gz.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    gz.extend_from_slice(&msg);
    assert_eq!(raw_watch(&url, gz).await, "13");
    // A frame longer than what came.
    assert_eq!(raw_watch(&url, vec![0, 0, 0, 0, 9, 8]).await, "13");
    cancel.cancel();
}
