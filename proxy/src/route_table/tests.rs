use super::*;
use siesta_proto::v1::{Endpoint, Snapshot};

/// A model's status as a control plane sends it (also for other modules' tests).
pub(crate) fn status(name: &str, state: ModelState, urls: &[&str]) -> ModelStatus {
    ModelStatus {
        name: name.into(),
        state: state as i32,
        endpoints: urls
            .iter()
            .map(|u| Endpoint {
                url: (*u).into(),
                served_model_name: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

pub(crate) fn snapshot(rev: u64, models: Vec<ModelStatus>) -> WatchEvent {
    WatchEvent {
        revision: rev,
        kind: Some(watch_event::Kind::Snapshot(Snapshot {
            models,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(crate) fn event(rev: u64, m: ModelStatus) -> WatchEvent {
    WatchEvent {
        revision: rev,
        kind: Some(watch_event::Kind::Model(m)),
        ..Default::default()
    }
}

fn table() -> RouteTable {
    RouteTable::new(Arc::new(Activity::default()))
}

#[test]
fn snapshot_replaces_and_events_update_in_order() {
    let t = table();
    let a: SourceId = Arc::from("http://a");
    assert!(!t.view().ready);
    t.apply(&a, snapshot(5, vec![status("m", ModelState::Asleep, &[])]));
    let v = t.view();
    assert!(v.ready);
    assert!(!v.by_name["m"].is_awake());
    // An old event is ignored; a newer one applies.
    assert!(!t.apply(
        &a,
        event(5, status("m", ModelState::Awake, &["http://e:1"]))
    ));
    assert!(t.apply(
        &a,
        event(6, status("m", ModelState::Awake, &["http://e:1"]))
    ));
    let v = t.view();
    assert!(v.by_name["m"].is_awake());
    assert_eq!(v.by_name["m"].endpoints[0].served_name, "m");
    assert_eq!(t.revision(&a), 6);
    // A snapshot replaces everything from that source.
    t.apply(&a, snapshot(7, vec![status("n", ModelState::Stopped, &[])]));
    let v = t.view();
    assert!(!v.by_name.contains_key("m"));
    assert_eq!(v.models.len(), 1);
}

#[test]
fn union_over_control_planes_with_aliases_and_stable_upstreams() {
    let t = table();
    let (a, b): (SourceId, SourceId) = (Arc::from("http://a"), Arc::from("http://b"));
    let mut m = status("m", ModelState::Awake, &["http://e:1"]);
    m.aliases = vec!["alias".into()];
    t.apply(&a, snapshot(1, vec![m]));
    t.apply(
        &b,
        snapshot(
            1,
            vec![
                status("m", ModelState::Awake, &["http://e:2"]),
                status("only-b", ModelState::Asleep, &[]),
                // Awake without endpoints is not routable.
                status("empty", ModelState::Awake, &[]),
            ],
        ),
    );
    let v = t.view();
    let r = &v.by_name["alias"];
    assert_eq!(&*r.name, "m");
    assert_eq!(r.endpoints.len(), 2);
    assert_eq!(&*v.by_name["only-b"].sources[0], "http://b");
    assert!(!v.by_name["empty"].is_awake());
    // Outstanding counts survive a rebuild.
    r.endpoints[0].outstanding.store(3, Ordering::Relaxed);
    t.apply(&b, event(2, status("only-b", ModelState::Waking, &[])));
    let v2 = t.view();
    assert_eq!(
        v2.by_name["m"].endpoints[0]
            .outstanding
            .load(Ordering::Relaxed),
        3
    );
    // The other endpoint has fewer outstanding requests.
    assert_eq!(v2.by_name["m"].pick().unwrap().url, "http://e:2");
    t.remove_source(&b);
    assert_eq!(t.view().by_name["m"].endpoints.len(), 1);
}

/// A control plane address forgotten (it left DNS) takes its activity
/// counters with it: kept, a set per model piled up for every address a
/// control plane pod ever had, each walked ten times a second.
#[test]
fn a_forgotten_address_takes_its_activity_counters_with_it() {
    let activity = Arc::new(Activity::default());
    let t = RouteTable::new(activity.clone());
    let (a, b): (SourceId, SourceId) = (Arc::from("http://a"), Arc::from("http://b"));
    let models = |n: usize| {
        (0..n)
            .map(|i| status(&format!("m{i}"), ModelState::Asleep, &[]))
            .collect()
    };
    t.apply(&a, snapshot(1, models(3)));
    t.apply(&b, snapshot(1, models(2)));
    assert_eq!(activity.counter_sets(), 5);
    t.remove_source(&a);
    assert_eq!(activity.counter_sets(), 2, "a's counters were kept");
    assert_eq!(*t.view().by_name["m0"].sources, [b]);
}

#[test]
fn best_source_leads_and_same_process_counts_once() {
    let t = table();
    let (a, b): (SourceId, SourceId) = (Arc::from("http://a"), Arc::from("http://b"));
    let mut asleep2 = status("m", ModelState::Asleep, &[]);
    asleep2.sleep_level = 2;
    t.apply(&a, snapshot(1, vec![asleep2]));
    let mut asleep1 = status("m", ModelState::Asleep, &[]);
    asleep1.sleep_level = 1;
    t.apply(&b, snapshot(1, vec![asleep1]));
    assert_eq!(
        &*t.view().by_name["m"].sources[0],
        "http://b",
        "L1 wakes sooner"
    );
    // Two addresses of one name reaching one process: counted once.
    let ident = ("ctl".to_owned(), "box".to_owned(), 42);
    t.set_identity(&a, ident.clone());
    t.set_identity(&b, ident);
    t.apply(
        &a,
        event(2, status("m", ModelState::Awake, &["http://e:1"])),
    );
    t.apply(
        &b,
        event(2, status("m", ModelState::Awake, &["http://e:1"])),
    );
    assert_eq!(t.view().by_name["m"].endpoints.len(), 1);
}

/// Two addresses of one control plane process, the first one's watch broken
/// (its last snapshot kept): the other's events count. Before, the first
/// address in order always did, frozen: the model, asleep since, was still
/// routed to as awake (vLLM holds such requests until a wake).
#[test]
fn of_two_addresses_of_one_process_the_one_further_along_counts() {
    let t = table();
    let (a, b): (SourceId, SourceId) = (Arc::from("http://a"), Arc::from("http://b"));
    let ident = ("ctl".to_owned(), "box".to_owned(), 42);
    for s in [&a, &b] {
        t.set_identity(s, ident.clone());
        t.apply(
            s,
            snapshot(3, vec![status("m", ModelState::Awake, &["http://e:1"])]),
        );
    }
    assert!(t.view().by_name["m"].is_awake());
    // `a`'s watch is down; `b` sees the model go to sleep.
    t.apply(&b, event(4, status("m", ModelState::Asleep, &[])));
    let v = t.view();
    assert!(!v.by_name["m"].is_awake(), "{:?}", v.by_name["m"]);
    assert_eq!(&*v.by_name["m"].sources, std::slice::from_ref(&b));
    // `a` back, caught up and beyond: it counts again.
    t.apply(
        &a,
        event(5, status("m", ModelState::Awake, &["http://e:1"])),
    );
    assert_eq!(*t.view().by_name["m"].sources, [a]);
}

/// Two addresses of one control plane process: a request in flight
/// counted while `a` counted, then `b`'s stream applies the model's
/// suspend first (`b` now counts). The request's upstream is fenced, and
/// no report says "fenced, none in flight" while it is at the engine: the
/// two addresses keep one set of counters, reported through the address
/// that counts. Before, each address kept its own: `b`'s said fenced with
/// none in flight, `a`'s upstream stayed unfenced, and the process (one
/// proxy id, the last report winning) confirmed the suspend under it.
#[test]
fn two_addresses_of_one_process_keep_one_fence_and_one_in_flight_count() {
    let activity = Arc::new(Activity::default());
    let t = RouteTable::new(activity.clone());
    let (a, b): (SourceId, SourceId) = (Arc::from("http://a"), Arc::from("http://b"));
    let ident = ("ctl".to_owned(), "box".to_owned(), 42);
    for s in [&a, &b] {
        t.set_identity(s, ident.clone());
        t.apply(
            s,
            snapshot(3, vec![status("m", ModelState::Awake, &["http://e:1"])]),
        );
    }
    let up = t.view().by_name["m"].endpoints[0].clone();
    assert_eq!(up.source, a, "a counts on a tie");
    // What InFlightGuard::new does for a request sent to the engine.
    up.activity.start();
    let _ = activity.drain();
    let mut suspending = status("m", ModelState::Suspending, &[]);
    suspending.state_since_unix_ms = 1234;
    t.apply(&b, event(4, suspending));
    assert!(!t.view().by_name["m"].is_awake());
    assert!(
        up.activity.fenced(),
        "the upstream in use is not fenced although the view stopped serving"
    );
    let reports = activity.drain();
    assert_eq!(reports.len(), 1, "one report for the process: {reports:?}");
    let m = &reports[&a].models[0];
    assert_eq!((m.fenced_since_unix_ms, m.in_flight), (1234, 1), "{m:?}");
    // Sent through `b`, the address whose watch is furthest along.
    assert_eq!(activity.groups().via(&a), b);
    up.activity.finish();
    let m = &activity.drain()[&a].models[0];
    assert_eq!((m.fenced_since_unix_ms, m.in_flight), (1234, 0), "{m:?}");
}

/// An address that synced and counted alone, then found to reach the same
/// process as one synced later: its upstream is made again with the
/// group's counters, so a request through it is fenced and counted with
/// the other's. Kept, it held counters the fence no longer reached.
#[test]
fn an_address_that_counted_alone_shares_its_twins_counters_once_grouped() {
    let activity = Arc::new(Activity::default());
    let t = RouteTable::new(activity.clone());
    let (a, b): (SourceId, SourceId) = (Arc::from("http://a"), Arc::from("http://b"));
    let ident = ("ctl".to_owned(), "box".to_owned(), 42);
    let awake = || status("m", ModelState::Awake, &["http://e:1"]);
    t.set_identity(&b, ident.clone());
    t.apply(&b, snapshot(4, vec![awake()]));
    let alone = t.view().by_name["m"].endpoints[0].clone();
    assert_eq!(alone.source, b);
    // `a` syncs behind `b`: `b` keeps counting, through the same endpoint.
    t.set_identity(&a, ident);
    t.apply(&a, snapshot(3, vec![awake()]));
    let up = t.view().by_name["m"].endpoints[0].clone();
    assert_eq!(up.source, b, "b is furthest along");
    let model: Arc<str> = Arc::from("m");
    assert!(Arc::ptr_eq(&up.activity, &activity.counters(&a, &model)));
    up.activity.start();
    let mut suspending = status("m", ModelState::Suspending, &[]);
    suspending.state_since_unix_ms = 77;
    t.apply(&a, event(5, suspending));
    assert!(up.activity.fenced());
    let m = &activity.drain()[&a].models[0];
    assert_eq!((m.fenced_since_unix_ms, m.in_flight), (77, 1), "{m:?}");
}

#[test]
fn suspect_endpoints_are_skipped() {
    let t = table();
    let a: SourceId = Arc::from("http://a");
    t.apply(
        &a,
        snapshot(
            1,
            vec![status(
                "m",
                ModelState::Awake,
                &["http://e:1", "http://e:2"],
            )],
        ),
    );
    let v = t.view();
    let r = &v.by_name["m"];
    r.endpoints[0].mark_suspect(60_000);
    for _ in 0..4 {
        assert_eq!(r.pick().unwrap().url, "http://e:2");
    }
    r.endpoints[1].mark_suspect(60_000);
    assert!(r.pick().is_none());
}

/// A suspect endpoint is avoided for the given time only (tokio's clock).
#[tokio::test(start_paused = true)]
async fn suspicion_expires() {
    let t = table();
    let a: SourceId = Arc::from("http://a");
    t.apply(
        &a,
        snapshot(1, vec![status("m", ModelState::Awake, &["http://e:1"])]),
    );
    let v = t.view();
    let r = &v.by_name["m"];
    r.endpoints[0].mark_suspect(1_000);
    assert!(r.pick().is_none());
    tokio::time::advance(std::time::Duration::from_millis(999)).await;
    assert!(r.pick().is_none());
    tokio::time::advance(std::time::Duration::from_millis(2)).await;
    assert_eq!(r.pick().unwrap().url, "http://e:1");
}
