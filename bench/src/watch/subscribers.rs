//! The Watch subscribers of scenario 5, in one of two clients:
//!
//! - `full`: each subscriber is a task of its own with the generated
//!   client, decoding every `WatchEvent` whole (every model status, with
//!   its strings) — what a proxy's Watch loop does;
//! - `lean`: one task per HTTP/2 connection polls all of that connection's
//!   streams, and decodes of each event only its revision, time and kind
//!   (a model status is skipped as bytes) — a load generator's client, as
//!   `wrk` is for HTTP: it receives every event the daemon sends, the same
//!   bytes, and leaves the cores to the daemon.
//!
//! On the 2-core box the subscribers share the daemon's cores, and with the
//! `full` client most of the fan-out's CPU was theirs (run H: 1.7 µs per
//! delivery against the daemon's 1.2). Both are kept so one run can show
//! both.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use anyhow::{Context, Result};
use bytes::Bytes;
use futures::StreamExt;
use siesta_proto::v1::WatchRequest;
use siesta_proto::v1::control_client::ControlClient;
use siesta_proto::v1::watch_event::Kind;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use super::Seen;
use crate::http::unix_us;

/// Which client the subscribers use (see the module's note).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClientKind {
    Full,
    Lean,
}

/// What the subscribers share: the count of those with a snapshot, the
/// last revision each saw, and the stop signal.
#[derive(Clone)]
pub struct Shared {
    pub ready: Arc<AtomicUsize>,
    pub last: Arc<Vec<AtomicU64>>,
    pub stop: Arc<Notify>,
}

/// A `WatchEvent` read only for its revision, time and kind: the other
/// fields are skipped, the snapshot and the model status kept as the bytes
/// they arrived in (no allocation of their own).
#[derive(Clone, PartialEq, prost::Message)]
struct EventHead {
    #[prost(uint64, tag = "1")]
    revision: u64,
    #[prost(int64, tag = "2")]
    at_unix_ms: i64,
    #[prost(bytes = "bytes", optional, tag = "10")]
    snapshot: Option<Bytes>,
    #[prost(bytes = "bytes", optional, tag = "11")]
    model: Option<Bytes>,
}

/// One subscriber's record as its events arrive.
#[derive(Default)]
struct Record {
    events: Vec<(u64, i64, f64)>,
    snapshots: usize,
}

impl Record {
    /// Notes an event of subscriber `i`: a snapshot (the first makes it
    /// ready) or a model event.
    fn note(&mut self, s: &Shared, i: usize, revision: u64, at: i64, snapshot: bool, model: bool) {
        let now = unix_us();
        s.last[i].store(revision, Ordering::Relaxed);
        if snapshot {
            self.snapshots += 1;
            if self.snapshots == 1 {
                s.ready.fetch_add(1, Ordering::Relaxed);
            }
        } else if model {
            self.events.push((revision, at, now));
        }
    }

    fn seen(self) -> Seen {
        (self.events, self.snapshots)
    }
}

fn request(i: usize) -> WatchRequest {
    WatchRequest {
        since_revision: 0,
        client_id: format!("bench-{i}"),
        incarnation: 0,
        heartbeat: false,
    }
}

/// Opens subscribers `0..n` over `chans` (subscriber `i` on connection
/// `i % chans.len()`); each task returns what its subscribers saw.
pub fn spawn(
    kind: ClientKind,
    n: usize,
    chans: &[Channel],
    s: &Shared,
) -> Vec<JoinHandle<Result<Vec<Seen>>>> {
    match kind {
        ClientKind::Full => (0..n)
            .map(|i| {
                let (ch, s) = (chans[i % chans.len()].clone(), s.clone());
                tokio::spawn(async move { Ok(vec![full(ch, s, i).await?]) })
            })
            .collect(),
        ClientKind::Lean => (0..chans.len())
            .map(|c| {
                let ids: Vec<usize> = (c..n).step_by(chans.len()).collect();
                tokio::spawn(lean(chans[c].clone(), s.clone(), ids))
            })
            .collect(),
    }
}

/// A subscriber of its own, decoding each event whole.
async fn full(ch: Channel, s: Shared, i: usize) -> Result<Seen> {
    let mut c = ControlClient::new(ch).max_decoding_message_size(256 << 20);
    let mut stream = c.watch(request(i)).await?.into_inner();
    let mut rec = Record::default();
    let stopped = s.stop.notified();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            msg = stream.message() => {
                let Some(ev) = msg? else { break };
                let (snapshot, model) = match ev.kind {
                    Some(Kind::Snapshot(_)) => (true, false),
                    Some(Kind::Model(_)) => (false, true),
                    _ => (false, false),
                };
                rec.note(&s, i, ev.revision, ev.at_unix_ms, snapshot, model);
            }
        }
    }
    Ok(rec.seen())
}

/// The subscribers `ids` of one connection, polled by one task.
async fn lean(ch: Channel, s: Shared, ids: Vec<usize>) -> Result<Vec<Seen>> {
    let opens = ids.iter().map(|&i| {
        let ch = ch.clone();
        async move {
            let mut grpc = tonic::client::Grpc::new(ch).max_decoding_message_size(256 << 20);
            grpc.ready().await.context("Watch: connection not ready")?;
            let path =
                tonic::codegen::http::uri::PathAndQuery::from_static("/siesta.v1.Control/Watch");
            let codec = tonic_prost::ProstCodec::<WatchRequest, EventHead>::default();
            let stream = grpc
                .server_streaming(tonic::Request::new(request(i)), path, codec)
                .await?
                .into_inner();
            anyhow::Ok(stream)
        }
    });
    let streams = futures::future::try_join_all(opens).await?;
    let mut all = futures::stream::SelectAll::new();
    for (k, stream) in streams.into_iter().enumerate() {
        all.push(stream.map(move |m| (k, m)));
    }
    let mut recs: Vec<Record> = ids.iter().map(|_| Record::default()).collect();
    let stopped = s.stop.notified();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            next = all.next() => {
                let Some((k, msg)) = next else { break };
                let ev = msg?;
                recs[k].note(
                    &s,
                    ids[k],
                    ev.revision,
                    ev.at_unix_ms,
                    ev.snapshot.is_some(),
                    ev.model.is_some(),
                );
            }
        }
    }
    Ok(recs.into_iter().map(Record::seen).collect())
}
