//! One sender per control plane, so activity reports arrive in the order
//! they were taken. Sent concurrently, a report of 10 held requests could
//! land after the next one's 0 and stay: the count is re-sent only when it
//! changes, so control kept 10 until the proxy went stale (30 s), and took
//! them for a demand. A report taken while the previous one is under way
//! is merged into the one waiting (counts added, the latest levels kept),
//! so a slow or unreachable control plane costs one report's memory, not
//! a queue.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use siesta_proto::v1::{ModelActivity, ReportActivityRequest};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::Groups;
use crate::route_table::SourceId;
use crate::watch_client::Controls;

/// Deadline of one `ReportActivity` call.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Failures kept in one waiting report.
const MAX_FAILURES: usize = 1024;

/// What waits to be sent to one control plane.
#[derive(Debug, Default)]
struct Slot {
    pending: Option<ReportActivityRequest>,
    /// Send what is pending, then end.
    closing: bool,
}

#[derive(Debug, Default)]
struct Outbox {
    slot: Mutex<Slot>,
    notify: Notify,
}

/// The senders, one per control plane that had something to say.
#[derive(Debug, Default)]
pub struct Outboxes {
    boxes: HashMap<SourceId, (Arc<Outbox>, JoinHandle<()>)>,
    /// Where a group's reports go (none: each to its own address).
    groups: Option<Arc<Groups>>,
}

impl Outboxes {
    /// Senders whose reports for a group of addresses of one control plane
    /// process go through the one [`Groups::via`] names when sent (one
    /// sender per group, so still in order).
    pub fn through(groups: Arc<Groups>) -> Self {
        Outboxes {
            boxes: HashMap::new(),
            groups: Some(groups),
        }
    }

    /// Queues `req` for `src`: merged into what waits there, sent after the
    /// report under way.
    pub fn post(&mut self, controls: &Arc<Controls>, src: SourceId, req: ReportActivityRequest) {
        let (outbox, _) = self.boxes.entry(src.clone()).or_insert_with(|| {
            let outbox = Arc::new(Outbox::default());
            let task = tokio::spawn(send_in_order(
                outbox.clone(),
                controls.clone(),
                src,
                self.groups.clone(),
            ));
            (outbox, task)
        });
        {
            let mut slot = outbox.slot.lock().unwrap();
            match &mut slot.pending {
                Some(waiting) => merge(waiting, req),
                None => slot.pending = Some(req),
            }
        }
        outbox.notify.notify_one();
    }

    /// Ends `src`'s sender once what waits there is sent (or cannot be:
    /// a forgotten address has no client), and forgets it.
    pub fn end(&mut self, src: &SourceId) {
        if let Some((outbox, _)) = self.boxes.remove(src) {
            outbox.slot.lock().unwrap().closing = true;
            outbox.notify.notify_one();
        }
    }

    /// How many senders there are (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.boxes.len()
    }

    /// Sends what waits, in order, and ends the senders.
    pub async fn close(self) {
        for (outbox, _) in self.boxes.values() {
            outbox.slot.lock().unwrap().closing = true;
            outbox.notify.notify_one();
        }
        for (_, (_, task)) in self.boxes {
            let _ = task.await;
        }
    }
}

async fn send_in_order(
    outbox: Arc<Outbox>,
    controls: Arc<Controls>,
    src: SourceId,
    groups: Option<Arc<Groups>>,
) {
    loop {
        outbox.notify.notified().await;
        loop {
            let (req, closing) = {
                let mut slot = outbox.slot.lock().unwrap();
                (slot.pending.take(), slot.closing)
            };
            let Some(req) = req else {
                if closing {
                    return;
                }
                break;
            };
            let to = groups.as_ref().map_or_else(|| src.clone(), |g| g.via(&src));
            let Some(mut client) = controls.client(&to) else {
                continue;
            };
            // Kept until answered: levels (held, in flight, a fence) are
            // re-sent only when they change, so a lost report would leave
            // control with the old ones (a fence never confirmed, a held
            // count that never falls).
            let error =
                match tokio::time::timeout(SEND_TIMEOUT, client.report_activity(req.clone())).await
                {
                    Ok(Ok(_)) => continue,
                    Ok(Err(status)) => status.to_string(),
                    Err(_) => "timed out".to_owned(),
                };
            tracing::debug!(control = %src, %error, "activity report failed; sent again with the next");
            let mut slot = outbox.slot.lock().unwrap();
            // Older than whatever was posted meanwhile: that is merged in.
            let mut again = req;
            let newer = slot.pending.take();
            let had_newer = newer.is_some();
            if let Some(newer) = newer {
                merge(&mut again, newer);
            }
            if slot.closing {
                // Closing: what was posted meanwhile (the last levels) goes
                // once more, with the failed report; nothing more after that.
                if had_newer {
                    slot.pending = Some(again);
                    continue;
                }
                return;
            }
            slot.pending = Some(again);
            // Sent with the next report or heartbeat ([`super::TICK`]s), not
            // in a loop against a control plane that is down.
            break;
        }
    }
}

/// Folds `newer` into `older`: started and finished add up, in-flight and
/// held counts and fences are the newer ones, failures are appended.
fn merge(older: &mut ReportActivityRequest, newer: ReportActivityRequest) {
    older.proxy_id = newer.proxy_id;
    for m in newer.models {
        match older.models.iter_mut().find(|o| o.model == m.model) {
            Some(o) => merge_model(o, m),
            None => older.models.push(m),
        }
    }
    let room = MAX_FAILURES.saturating_sub(older.failures.len());
    older.failures.extend(newer.failures.into_iter().take(room));
}

fn merge_model(o: &mut ModelActivity, n: ModelActivity) {
    o.started = o.started.saturating_add(n.started);
    o.finished = o.finished.saturating_add(n.finished);
    o.in_flight = n.in_flight;
    o.last_finished_unix_ms = o.last_finished_unix_ms.max(n.last_finished_unix_ms);
    o.held = n.held;
    o.fenced_since_unix_ms = n.fenced_since_unix_ms;
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::{Frame, Incoming};
    use prost::Message;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// What a slow control plane saw: the held counts in arrival order,
    /// and the most `ReportActivity` calls it had under way at once.
    #[derive(Default)]
    struct Seen {
        held: Mutex<Vec<u32>>,
        active: AtomicU32,
        most: AtomicU32,
    }

    /// A `ReportActivity` stand-in over HTTP/2 that answers each call after
    /// 150 ms.
    async fn slow_control() -> (SourceId, Arc<Seen>) {
        control_stub(Duration::from_millis(150), 0).await
    }

    /// A `ReportActivity` stand-in over HTTP/2 that answers each call after
    /// `delay`, the first `failing` with `unavailable`.
    async fn control_stub(delay: Duration, failing: u32) -> (SourceId, Arc<Seen>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: SourceId = format!("http://{}", listener.local_addr().unwrap()).into();
        let seen = Arc::new(Seen::default());
        let s = seen.clone();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let s = s.clone();
                async move {
                    let now = s.active.fetch_add(1, Ordering::SeqCst) + 1;
                    s.most.fetch_max(now, Ordering::SeqCst);
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let r = ReportActivityRequest::decode(&body[5..]).unwrap();
                    let fail = {
                        let mut held = s.held.lock().unwrap();
                        held.extend(r.models.first().map(|m| m.held));
                        (held.len() as u32) <= failing
                    };
                    tokio::time::sleep(delay).await;
                    s.active.fetch_sub(1, Ordering::SeqCst);
                    let mut trailers = http::HeaderMap::new();
                    let code = if fail { "14" } else { "0" };
                    trailers.insert("grpc-status", code.parse().unwrap());
                    let frames = [
                        Ok::<_, Infallible>(Frame::data(Bytes::from_static(&[0; 5]))),
                        Ok(Frame::trailers(trailers)),
                    ];
                    let body = StreamBody::new(futures::stream::iter(frames));
                    Ok::<_, Infallible>(
                        hyper::Response::builder()
                            .header("content-type", "application/grpc")
                            .body(body)
                            .unwrap(),
                    )
                }
            });
            let io = hyper_util::rt::TokioIo::new(tcp);
            let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .serve_connection(io, svc)
                .await;
        });
        (url, seen)
    }

    fn report(held: u32) -> ReportActivityRequest {
        ReportActivityRequest {
            proxy_id: "p".into(),
            models: vec![activity(1, 0, held, 0)],
            failures: vec![],
        }
    }

    /// Reports taken while one is under way wait for it, merged: the
    /// control plane sees one call at a time and the held counts in the
    /// order they were taken, ending with the latest.
    #[tokio::test]
    async fn reports_reach_a_slow_control_plane_one_at_a_time_and_in_order() {
        let (url, seen) = slow_control().await;
        let controls = Arc::new(Controls::new(None).unwrap());
        controls.connect(&url).unwrap();
        let mut out = Outboxes::default();
        out.post(&controls, url.clone(), report(10));
        // Once the first call is under way (answered in 150 ms), the next
        // three are posted without a yield between them: they wait, merged.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while seen.held.lock().unwrap().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "no call arrived");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for held in [7, 3, 0] {
            out.post(&controls, url.clone(), report(held));
        }
        out.close().await;
        assert_eq!(*seen.held.lock().unwrap(), [10, 0]);
        assert_eq!(seen.most.load(Ordering::SeqCst), 1);
    }

    /// A forgotten control plane's sender is ended and let go once what
    /// waited there is sent: one sender (and task) per address ever seen
    /// piled up before.
    #[tokio::test]
    async fn an_ended_sender_sends_what_waits_and_is_let_go() {
        let (url, seen) = slow_control().await;
        let controls = Arc::new(Controls::new(None).unwrap());
        controls.connect(&url).unwrap();
        let mut out = Outboxes::default();
        out.post(&controls, url.clone(), report(4));
        let (_, task) = out.boxes.get(&url).unwrap();
        let task = task.abort_handle();
        out.end(&url);
        assert_eq!(out.len(), 0);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !task.is_finished() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the sender never ended"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(*seen.held.lock().unwrap(), [4]);
    }

    /// A report the control plane did not take goes again, merged into
    /// the next one (here a heartbeat with nothing new): its levels are
    /// not lost until they change.
    #[tokio::test]
    async fn a_report_that_failed_is_sent_again_with_the_next() {
        let (url, seen) = control_stub(Duration::ZERO, 1).await;
        let controls = Arc::new(Controls::new(None).unwrap());
        controls.connect(&url).unwrap();
        let mut out = Outboxes::default();
        out.post(&controls, url.clone(), report(10));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while seen.held.lock().unwrap().is_empty() || seen.active.load(Ordering::SeqCst) > 0 {
            assert!(tokio::time::Instant::now() < deadline, "no call arrived");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Whether the heartbeat comes before or after the sender saw the
        // failure, the failed report is merged with it.
        let heartbeat = ReportActivityRequest {
            proxy_id: "p".into(),
            ..Default::default()
        };
        out.post(&controls, url.clone(), heartbeat);
        out.close().await;
        assert_eq!(*seen.held.lock().unwrap(), [10, 10]);
    }

    fn activity(started: u32, in_flight: u32, held: u32, last: i64) -> ModelActivity {
        ModelActivity {
            model: "m".into(),
            started,
            finished: started,
            in_flight,
            last_finished_unix_ms: last,
            held,
            fenced_since_unix_ms: i64::from(held),
        }
    }

    #[test]
    fn a_waiting_report_takes_the_newer_levels_and_adds_the_counts() {
        let mut older = ReportActivityRequest {
            proxy_id: "p".into(),
            models: vec![activity(2, 3, 10, 500)],
            failures: vec![],
        };
        let mut other = activity(1, 0, 0, 0);
        other.model = "other".into();
        merge(
            &mut older,
            ReportActivityRequest {
                proxy_id: "p".into(),
                models: vec![activity(1, 0, 0, 400), other],
                failures: vec![Default::default()],
            },
        );
        let m = &older.models[0];
        assert_eq!((m.started, m.finished), (3, 3));
        assert_eq!((m.in_flight, m.held, m.fenced_since_unix_ms), (0, 0, 0));
        assert_eq!(m.last_finished_unix_ms, 500);
        assert_eq!(older.models[1].model, "other");
        assert_eq!(older.failures.len(), 1);
    }
}
