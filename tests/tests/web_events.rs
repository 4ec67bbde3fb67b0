//! `/events`, the Watch stream as server-sent events, for tools other than
//! the page: a snapshot first, one event per change with `id:` =
//! `INCARNATION-REVISION`, resume with `Last-Event-ID` or `?since=` (an id
//! of another incarnation or unreadable: a resync snapshot); and the `/api`
//! operations.

use siesta_tests::ctl as util;
use siesta_tests::web as stack;

use futures::StreamExt;
use serde_json::Value;
use util::{LONG, fake_model};

/// Reads server-sent events from a response.
struct Events {
    body: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buf: String,
}

/// One event: (id, event name, data as JSON).
type Event = (String, String, Value);

/// A wake through the API: the same call as the Wake RPC, sent as the
/// page's own fetch is (its Origin is the listener's); asserts 200.
async fn wake_from_the_page(web: &str, model: &str) -> reqwest::Response {
    let r = reqwest::Client::new()
        .post(format!("{web}/api/models/{model}/wake"))
        .header("origin", web)
        .header("sec-fetch-site", "same-origin")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r
}

/// The revision an id names (`INCARNATION-REVISION`).
fn rev(id: &str) -> u64 {
    let (_, r) = id.split_once('-').expect("INCARNATION-REVISION");
    r.parse().expect("a revision")
}

impl Events {
    async fn open(url: &str, last_event_id: Option<&str>) -> Events {
        let mut req = reqwest::Client::new().get(url);
        if let Some(id) = last_event_id {
            req = req.header("last-event-id", id);
        }
        let resp = req.send().await.expect("GET /events");
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        Events {
            body: Box::pin(resp.bytes_stream()),
            buf: String::new(),
        }
    }

    async fn next(&mut self) -> Event {
        tokio::time::timeout(LONG, async {
            loop {
                if let Some(end) = self.buf.find("\n\n") {
                    let block: String = self.buf.drain(..end + 2).collect();
                    let (mut id, mut name, mut data) = (None, String::new(), None);
                    for line in block.lines() {
                        if let Some(v) = line.strip_prefix("id: ") {
                            id = Some(v.to_string());
                        } else if let Some(v) = line.strip_prefix("event: ") {
                            name = v.to_string();
                        } else if let Some(v) = line.strip_prefix("data: ") {
                            data = Some(serde_json::from_str(v).expect("data is JSON"));
                        }
                    }
                    if let (Some(id), Some(data)) = (id, data) {
                        return (id, name, data);
                    }
                    continue;
                }
                let chunk = self.body.next().await.expect("stream open").expect("read");
                self.buf
                    .push_str(std::str::from_utf8(&chunk).expect("UTF-8"));
            }
        })
        .await
        .expect("an event within the deadline")
    }

    /// Events until a `model` event for `name` in `state`.
    async fn until(&mut self, name: &str, state: &str) -> Vec<Event> {
        let mut seen = Vec::new();
        loop {
            let ev = self.next().await;
            let hit =
                ev.1 == "model" && ev.2["model"]["name"] == name && ev.2["model"]["state"] == state;
            seen.push(ev);
            if hit {
                return seen;
            }
        }
    }
}

#[tokio::test]
async fn events_carry_revisions_and_resume_after_the_last_one() {
    let s = stack::stack(&fake_model("alpha", "none", &[], "")).await;
    let url = format!("{}/events", s.web);
    let mut ev = Events::open(&url, None).await;
    let (id0, name, snap) = ev.next().await;
    let rev0 = rev(&id0);
    assert_eq!(name, "snapshot");
    assert_eq!(snap["type"], "snapshot");
    assert_eq!(snap["revision"], rev0);
    assert_eq!(snap["models"][0]["name"], "alpha");
    assert_eq!(snap["models"][0]["state"], "stopped");

    // A wake through the API: the same call as the Wake RPC, sent as the
    // page's own fetch is (its Origin is the listener's).
    let r = wake_from_the_page(&s.web, "alpha").await;
    let op: Value = r.json().await.unwrap();
    assert_eq!(op["model"]["name"], "alpha");
    let seen = ev.until("alpha", "awake").await;
    let ids: Vec<u64> = seen.iter().map(|e| rev(&e.0)).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids increase: {ids:?}");
    assert!(ids[0] > rev0, "{ids:?} after {rev0}");
    let states: Vec<&str> = seen
        .iter()
        .filter(|e| e.1 == "model")
        .filter_map(|e| e.2["model"]["state"].as_str())
        .collect();
    assert!(states.contains(&"starting"), "{states:?}");

    // Resuming after the first of them (an id of this incarnation)
    // replays the rest, in order.
    let first = seen[0].0.clone();
    let mut again = Events::open(&url, Some(&first)).await;
    let replay = again.until("alpha", "awake").await;
    let replay_ids: Vec<u64> = replay.iter().map(|e| rev(&e.0)).collect();
    assert_eq!(replay_ids, ids[1..], "Last-Event-ID {first}");
    let mut q = Events::open(&format!("{url}?since={first}"), None).await;
    assert_eq!(rev(&q.next().await.0), ids[1], "?since={first}");

    // An id of another incarnation (revisions restart at 1 in a new
    // process), a bare revision or an unreadable one: a resync snapshot
    // first, never the events after a revision that means something else.
    let (incarnation, _) = first.split_once('-').unwrap();
    let earlier = incarnation.parse::<i64>().unwrap() - 60_000;
    let other = format!("{earlier}-{}", ids[0]);
    let bare = ids[0].to_string();
    for (last, query) in [
        (Some(other.as_str()), ""),
        (None, &*format!("?since={other}")),
        (Some(bare.as_str()), ""),
        (None, "?since=abc"),
    ] {
        let mut r = Events::open(&format!("{url}{query}"), last).await;
        let (_, name, snap) = r.next().await;
        assert_eq!(name, "snapshot", "{last:?} {query}");
        assert_eq!(snap["resync"], true, "{last:?} {query}");
        assert_eq!(snap["models"][0]["state"], "awake", "{last:?} {query}");
    }

    // Another web site's page cannot operate (no token on loopback: a
    // POST is a CORS simple request): 403 naming why, and nothing stops.
    for (header, value) in [
        ("origin", "http://evil.example"),
        ("sec-fetch-site", "cross-site"),
    ] {
        let r = reqwest::Client::new()
            .post(format!("{}/api/models/alpha/stop", s.web))
            .header(header, value)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{header}: {value}");
        let body: Value = r.json().await.unwrap();
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("cross-origin"), "{msg}");
    }
    // A DNS-rebinding page names the listener by its own name.
    let r = reqwest::Client::new()
        .post(format!("{}/api/models/alpha/stop", s.web))
        .header("host", "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "Host evil.example");

    // Operations answer as the RPC does: unknown models are 404.
    let r = reqwest::Client::new()
        .post(format!("{}/api/models/nope/sleep?level=1", s.web))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // An explicit level 0 is no level (it used to sleep at level 1).
    let r = reqwest::Client::new()
        .post(format!("{}/api/models/alpha/sleep?level=0", s.web))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("0 is not a sleep level"), "{msg}");
    let r = reqwest::Client::new()
        .post(format!("{}/api/models/alpha/dance", s.web))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let models: Value = reqwest::get(format!("{}/api/models", s.web))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        models["models"][0]["state"], "awake",
        "not stopped by the refused POSTs"
    );
    let history = format!("{}/api/history", s.web);
    siesta_tests::wait_until("the start in /api/history", LONG, || async {
        let h: Value = reqwest::get(&history).await.unwrap().json().await.unwrap();
        h["wakes"][0]["model"] == "alpha" && h["wakes"][0]["from"] == "stopped"
    })
    .await;
}

/// A client that connects to the web listener and does not finish its
/// request head is closed after the header timeout (10 s): it held a task
/// and a file for ever, before its token was even checked. An `/events`
/// stream open all that while is a response, not cut by it.
#[tokio::test]
async fn a_client_that_sends_no_whole_head_is_closed_and_events_go_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = stack::stack(&fake_model("alpha", "none", &[], "")).await;
    let mut ev = Events::open(&format!("{}/events", s.web), None).await;
    assert_eq!(ev.next().await.1, "snapshot");
    let addr = s.web.trim_start_matches("http://");
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /api/models HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let opened = std::time::Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(LONG, slow.read_to_end(&mut buf))
        .await
        .expect("a connection with half a head was kept open");
    assert!(
        read.is_ok() && opened.elapsed() >= std::time::Duration::from_secs(5),
        "{read:?} after {:?}",
        opened.elapsed()
    );
    // The events stream, open longer than the timeout, still delivers.
    wake_from_the_page(&s.web, "alpha").await;
    ev.until("alpha", "awake").await;
}
