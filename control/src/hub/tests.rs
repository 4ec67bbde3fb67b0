use super::*;
use std::task::{Context, Poll};
use std::time::Duration;

fn status(name: &str, restarts: u32) -> ModelStatus {
    crate::status::test_status(name, restarts)
}

fn revision_of_model(item: &WatchItem) -> Option<u32> {
    match &item.body {
        Body::Model(s) => Some(s.restarts),
        _ => None,
    }
}

#[tokio::test]
async fn snapshot_first_then_events() {
    let hub = Hub::new(Clock::new(), 100, 16);
    hub.publish_model(status("a", 0));
    let mut sub = hub.subscribe(0).unwrap();
    let first = sub.next().await.unwrap();
    assert_eq!(first.revision, 1);
    let Body::Snapshot(s) = &first.body else {
        panic!()
    };
    assert_eq!(s.models.len(), 1);
    assert!(!s.resync);
    // The same status twice (two `status()` calls could differ in their
    // wall-clock timestamps): the second is unchanged, so not published.
    let one = status("a", 1);
    hub.publish_model(one.clone());
    hub.publish_model(one);
    hub.publish_model(status("a", 2));
    assert_eq!(sub.next().await.unwrap().revision, 2);
    assert_eq!(sub.next().await.unwrap().revision, 3);
    assert_eq!(hub.revision(), 3);
}

#[tokio::test]
async fn since_revision_resumes_or_resyncs() {
    let hub = Hub::new(Clock::new(), 4, 16);
    for i in 0..6 {
        hub.publish_model(status("a", i));
    }
    // Kept: revisions 3..=6. Resume after 4: 5 and 6.
    let mut sub = hub.subscribe(4).unwrap();
    assert_eq!(sub.next().await.unwrap().revision, 5);
    assert_eq!(sub.next().await.unwrap().revision, 6);
    // Up to date: nothing pending, next live event follows.
    let mut current = hub.subscribe(6).unwrap();
    hub.publish_model(status("a", 99));
    assert_eq!(current.next().await.unwrap().revision, 7);
    // Gone (or from a previous life): a resync snapshot.
    for since in [1, 100] {
        let mut old = hub.subscribe(since).unwrap();
        let item = old.next().await.unwrap();
        let Body::Snapshot(s) = &item.body else {
            panic!()
        };
        assert!(s.resync);
        assert_eq!(item.revision, 7);
    }
}

/// A resume point from another process (its revisions, which restarted
/// at 1, may well be kept here): a snapshot marked resync, then live.
#[tokio::test]
async fn subscribe_resync_starts_with_a_resync_snapshot_even_when_kept() {
    let hub = Hub::new(Clock::new(), 100, 16);
    for i in 0..3 {
        hub.publish_model(status("a", i));
    }
    let mut sub = hub.subscribe_resync(false).unwrap();
    let item = sub.next().await.unwrap();
    let Body::Snapshot(s) = &item.body else {
        panic!("a snapshot first")
    };
    assert!(s.resync);
    assert_eq!(item.revision, 3);
    assert_eq!(s.models.len(), 1);
    hub.publish_model(status("a", 9));
    assert_eq!(sub.next().await.unwrap().revision, 4);
}

#[tokio::test]
async fn slow_subscriber_is_resynced_and_blocks_nobody() {
    let hub = Hub::new(Clock::new(), 1000, 4);
    let mut slow = hub.subscribe(0).unwrap();
    let mut fast = hub.subscribe(0).unwrap();
    fast.next().await.unwrap();
    let mut last = 0;
    for i in 0..50 {
        hub.publish_model(status("a", i));
        let item = fast.next().await.unwrap();
        assert!(item.revision > last);
        last = item.revision;
    }
    // The slow one gets its snapshot, what fit in its channel, then a resync.
    let mut revs = vec![];
    loop {
        let item = slow.next().await.unwrap();
        revs.push(item.revision);
        if let Body::Snapshot(s) = &item.body
            && s.resync
        {
            assert_eq!(item.revision, 50);
            break;
        }
    }
    assert!(revs.windows(2).all(|w| w[0] < w[1]), "{revs:?}");
}

#[tokio::test]
async fn hundred_subscribers_see_every_event_in_order() {
    let hub = Hub::new(Clock::new(), 1000, 256);
    let subs: Vec<_> = (0..100).map(|_| hub.subscribe(0).unwrap()).collect();
    let readers: Vec<_> = subs
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                let mut got = vec![];
                while got.len() < 200 {
                    let item = s.next().await.unwrap();
                    if let Some(r) = revision_of_model(&item) {
                        got.push(r);
                    }
                }
                got
            })
        })
        .collect();
    for i in 0..200 {
        hub.publish_model(status("a", i));
        if i % 50 == 0 {
            tokio::task::yield_now().await;
        }
    }
    for r in readers {
        assert_eq!(r.await.unwrap(), (0..200).collect::<Vec<_>>());
    }
}

#[tokio::test]
async fn close_ends_subscriptions() {
    let hub = Hub::new(Clock::new(), 10, 4);
    let mut sub = hub.subscribe(0).unwrap();
    sub.next().await.unwrap();
    hub.close();
    assert!(sub.next().await.is_none());
    assert!(hub.subscribe(0).is_none());
}

#[tokio::test]
async fn each_event_is_encoded_once_and_shared() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let hub = Hub::new(Clock::new(), 100, 16);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    /// Counts whole-message encodings.
    struct Counting(Arc<AtomicUsize>);
    impl Wire for Counting {
        fn item(&self, item: &WatchItem, _: Option<&Bytes>) -> Bytes {
            self.0.fetch_add(1, Ordering::SeqCst);
            Bytes::from(format!("rev {}", item.revision))
        }
        fn model(&self, s: &ModelStatus) -> Bytes {
            Bytes::from(s.name.clone())
        }
        fn gpus(&self, _: &GpuList) -> Bytes {
            Bytes::new()
        }
        fn placement(&self, _: &PlacementReport) -> Bytes {
            Bytes::new()
        }
    }
    hub.set_encoder(Counting(counted));
    let mut subs: Vec<_> = (0..5).map(|_| hub.subscribe(0).unwrap()).collect();
    let snapshots =
        Vec::from_iter(futures::future::join_all(subs.iter_mut().map(|s| s.next())).await);
    hub.publish_model(status("a", 1));
    hub.publish_model(status("a", 2));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "one encoding per published event"
    );
    let mut wires = Vec::new();
    for s in &mut subs {
        for rev in [1, 2] {
            let item = s.next().await.unwrap();
            assert_eq!(item.revision, rev);
            wires.push(hub.wire(&item).unwrap());
        }
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "subscribers reuse the bytes"
    );
    for pair in wires.chunks(2) {
        assert_eq!(pair[0], Bytes::from("rev 1"));
        assert_eq!(
            pair[1].as_ptr(),
            wires[1].as_ptr(),
            "the same allocation for everyone"
        );
    }
    // Each snapshot is its subscriber's own: encoded once, on first use.
    for snap in snapshots {
        let snap = snap.unwrap();
        assert_eq!(hub.wire(&snap).unwrap(), hub.wire(&snap).unwrap());
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2 + 5);
}

/// A hub whose items reach the subscribers through the fan-out task.
fn deferred(history: usize, channel: usize) -> Arc<Hub> {
    let hub = Hub::new(Clock::new(), history, channel);
    hub.spawn_fan_out(&tokio::runtime::Handle::current());
    hub
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_task_gives_every_subscriber_every_event_in_order_across_bursts() {
    // Channels that hold every event: none is cut off and resynced.
    let hub = deferred(1000, 1024);
    let mut subs: Vec<_> = (0..100).map(|_| hub.subscribe(0).unwrap()).collect();
    // Late subscribers, after some events, resume from where they are.
    let mut publish = 0..300u32;
    for i in publish.by_ref().take(20) {
        hub.publish_model(status("a", i));
    }
    subs.extend((0..20).map(|_| hub.subscribe(hub.revision()).unwrap()));
    let readers: Vec<_> = subs
        .into_iter()
        .enumerate()
        .map(|(n, mut s)| {
            tokio::spawn(async move {
                let mut got = vec![];
                while got.last() != Some(&299) {
                    let item = tokio::time::timeout(Duration::from_secs(30), s.next())
                        .await
                        .unwrap_or_else(|_| panic!("subscriber {n} waits after {got:?}"))
                        .unwrap();
                    match &item.body {
                        Body::Snapshot(s) => assert!(!s.resync, "subscriber {n} resynced"),
                        _ => got.extend(revision_of_model(&item)),
                    }
                }
                (n, got)
            })
        })
        .collect();
    // Bursts of 40 with no await between them: one round takes each.
    for (k, i) in publish.enumerate() {
        hub.publish_model(status("a", i));
        if k % 40 == 39 {
            tokio::task::yield_now().await;
        }
    }
    for r in readers {
        let (n, got) = r.await.unwrap();
        let from = if n < 100 { 0 } else { 20 };
        assert_eq!(got, (from..300).collect::<Vec<_>>(), "subscriber {n}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_task_resyncs_a_slow_subscriber_and_blocks_nobody() {
    let hub = deferred(1000, 4);
    let mut slow = hub.subscribe(0).unwrap();
    let mut fast = hub.subscribe(0).unwrap();
    fast.next().await.unwrap();
    for i in 0..50 {
        hub.publish_model(status("a", i));
        let item = fast.next().await.unwrap();
        assert_eq!(revision_of_model(&item), Some(i));
    }
    // Its channel holds 4: the snapshot, up to 4 events, then a resync.
    let mut revs = vec![];
    loop {
        let item = slow.next().await.unwrap();
        revs.push(item.revision);
        if let Body::Snapshot(s) = &item.body
            && s.resync
        {
            assert_eq!(item.revision, 50);
            break;
        }
    }
    assert!(revs.len() <= 6, "{revs:?}");
    assert!(revs.windows(2).all(|w| w[0] < w[1]), "{revs:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn fan_out_task_resyncs_when_the_history_overran_before_its_round() {
    // One thread: the task cannot run until this test awaits, so ten
    // events are published while the history keeps four.
    let hub = deferred(4, 1000);
    let mut sub = hub.subscribe(0).unwrap();
    let Body::Snapshot(_) = sub.next().await.unwrap().body else {
        panic!("want the snapshot first")
    };
    for i in 0..10 {
        hub.publish_model(status("a", i));
    }
    // Revisions 1..=6 are gone: no gap, a resync snapshot at 10.
    let item = sub.next().await.unwrap();
    let Body::Snapshot(s) = &item.body else {
        panic!("want a resync, got revision {}", item.revision)
    };
    assert!(s.resync);
    assert_eq!(item.revision, 10);
    hub.publish_model(status("a", 10));
    assert_eq!(sub.next().await.unwrap().revision, 11);
}

#[tokio::test]
async fn fan_out_task_ends_with_the_hub() {
    let hub = deferred(10, 4);
    let mut sub = hub.subscribe(0).unwrap();
    sub.next().await.unwrap();
    hub.close();
    assert!(sub.next().await.is_none());
    assert!(hub.subscribe(0).is_none());
}

#[tokio::test]
async fn ended_subscriptions_stay_ended_while_publishing_goes_on() {
    let hub = deferred(10, 4);
    let mut sub = hub.subscribe(0).unwrap();
    sub.next().await.unwrap();
    hub.publish_model(status("a", 1));
    assert_eq!(sub.next().await.unwrap().revision, 1);
    hub.end_subscriptions();
    // A round of the fan-out after the end does not bring it back.
    hub.publish_model(status("a", 2));
    assert!(sub.next().await.is_none(), "the stream ends");
    assert!(hub.subscribe(0).is_none(), "no new subscription");
    assert!(hub.subscribe(1).is_none(), "no resumed one either");
    // The models' states are still recorded.
    hub.publish_model(status("a", 3));
    let (models, revision) = hub.models();
    assert_eq!(revision, 3);
    assert_eq!(models[0].restarts, 3);
}

/// What a subscriber has been handed so far, without waiting.
fn ready(sub: &mut Subscription) -> Vec<Arc<WatchItem>> {
    let waker = std::task::Waker::noop();
    let mut cx = Context::from_waker(waker);
    let mut got = Vec::new();
    while let Poll::Ready(Some(item)) = sub.poll_next(&mut cx) {
        got.push(item);
    }
    got
}

fn heartbeats(items: &[Arc<WatchItem>]) -> Vec<u64> {
    items
        .iter()
        .filter(|i| matches!(i.body, Body::Heartbeat(every) if every == HEARTBEAT_EVERY))
        .map(|i| i.revision)
        .collect()
}

/// A subscriber that asked for heartbeats gets one after its snapshot (or
/// its catch-up items), then one whenever nothing was published for
/// `HEARTBEAT_EVERY`, at the latest revision, through the fan-out task;
/// none while events come more often; a subscriber that did not ask gets
/// none, and no heartbeat takes a revision or a place in the history.
#[tokio::test(start_paused = true)]
async fn heartbeats_come_to_those_who_asked_when_nothing_else_does() {
    let hub = deferred(100, 64);
    hub.publish_model(status("a", 0));
    let mut alive = hub.subscribe_with_heartbeats(0).unwrap();
    let mut plain = hub.subscribe(0).unwrap();
    let mut resumed = hub.subscribe_with_heartbeats(0).unwrap();
    let first = ready(&mut alive);
    assert!(matches!(first[0].body, Body::Snapshot(_)), "{first:?}");
    assert_eq!(heartbeats(&first), [1], "one right after the snapshot");
    assert_eq!(heartbeats(&ready(&mut plain)), Vec::<u64>::new());
    ready(&mut resumed);
    // Events every 6 s (less than HEARTBEAT_EVERY): no heartbeat between.
    for i in 1..=4 {
        tokio::time::sleep(HEARTBEAT_EVERY * 6 / 10).await;
        hub.publish_model(status("a", i));
    }
    tokio::task::yield_now().await;
    let got = ready(&mut alive);
    assert_eq!(got.len(), 4, "{got:?}");
    assert_eq!(heartbeats(&got), Vec::<u64>::new(), "{got:?}");
    // Quiet: a heartbeat at the latest revision, and again.
    tokio::time::sleep(HEARTBEAT_EVERY + Duration::from_millis(1)).await;
    assert_eq!(heartbeats(&ready(&mut alive)), [5]);
    tokio::time::sleep(HEARTBEAT_EVERY).await;
    assert_eq!(heartbeats(&ready(&mut alive)), [5]);
    let plain_got = ready(&mut plain);
    assert_eq!(plain_got.len(), 4, "{plain_got:?}");
    assert_eq!(heartbeats(&plain_got), Vec::<u64>::new());
    assert_eq!(hub.revision(), 5, "a heartbeat takes no revision");
    // Resuming after revision 3: items 4 and 5, then a heartbeat at 5.
    let mut later = hub.subscribe_with_heartbeats(3).unwrap();
    let got = ready(&mut later);
    let revisions: Vec<u64> = got.iter().map(|i| i.revision).collect();
    assert_eq!(revisions, [4, 5, 5], "{got:?}");
    assert_eq!(heartbeats(&got), [5]);
    // Kept in no history: a resume point before it replays events only.
    let mut replay = hub.subscribe(3).unwrap();
    assert_eq!(heartbeats(&ready(&mut replay)), Vec::<u64>::new());
    drop(resumed);
}

/// A heartbeat subscriber cut off (it fell behind) resyncs from a snapshot
/// and still gets heartbeats: the request's wish survives the resync.
#[tokio::test(start_paused = true)]
async fn a_resynced_subscriber_keeps_its_heartbeats() {
    let hub = deferred(100, 2);
    let mut sub = hub.subscribe_with_heartbeats(0).unwrap();
    ready(&mut sub);
    for i in 0..10 {
        hub.publish_model(status("a", i));
    }
    tokio::task::yield_now().await;
    let got = ready(&mut sub);
    assert!(
        got.iter()
            .any(|i| matches!(&i.body, Body::Snapshot(s) if s.resync)),
        "{got:?}"
    );
    assert_eq!(heartbeats(&got).last(), Some(&10), "{got:?}");
    tokio::time::sleep(HEARTBEAT_EVERY + Duration::from_millis(1)).await;
    assert_eq!(heartbeats(&ready(&mut sub)), [10]);
}
