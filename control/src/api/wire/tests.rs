//! The bytes put together from kept parts are the bytes prost writes for
//! the converted message, for every kind of item and for `ListModels`.

use super::*;
use crate::gpu::InventorySource;
use crate::gpu_view::{GpuList, ModelPlacement, PlacementReport};
use crate::hub::Hub;
use crate::status::Clock;
use siesta_proto::v1 as pb;
use std::collections::BTreeMap;
use std::sync::Arc;

fn status(name: &str, restarts: u32) -> ModelStatus {
    crate::status::test_status(name, restarts)
}

fn gpus() -> GpuList {
    GpuList {
        gpus: vec![],
        owners: BTreeMap::from([(7, "a".to_string())]),
        source: InventorySource::Config,
        p2p: vec![],
        p2p_probed_unix_ms: 12,
        note: Some("NVML has not answered for 3.0s".into()),
    }
}

fn placement(models: &[&str]) -> PlacementReport {
    PlacementReport {
        models: models
            .iter()
            .map(|m| ModelPlacement {
                model: m.to_string(),
                gpus: vec![0],
                awake_bytes_per_gpu: 1 << 30,
                gpu_memory_utilization: 0.5,
                p2p_disabled: false,
                reason: "fits".into(),
                exclusive: false,
                asleep_residual: Default::default(),
            })
            .collect(),
        gpus: vec![],
    }
}

fn hub() -> Arc<Hub> {
    let hub = Hub::new(Clock::new(), 100, 16);
    crate::api::watch::install_encoder(&hub, "ctl".into());
    hub
}

/// The wire bytes are one gRPC message frame of prost's bytes of the
/// converted event, and decode to it.
fn assert_same(hub: &Hub, item: &WatchItem) {
    let want = convert::watch_event(item, "ctl");
    let framed = hub.wire(item).unwrap();
    assert_eq!(framed[0], 0, "not compressed");
    let len = u32::from_be_bytes(framed[1..GRPC_PREFIX].try_into().unwrap()) as usize;
    assert_eq!(len, framed.len() - GRPC_PREFIX, "the length prefix");
    let got = framed.slice(GRPC_PREFIX..);
    assert_eq!(
        pb::WatchEvent::decode(got.clone()).unwrap(),
        want,
        "revision {}",
        item.revision
    );
    assert_eq!(
        got,
        Bytes::from(want.encode_to_vec()),
        "revision {}",
        item.revision
    );
}

#[tokio::test]
async fn every_kind_of_event_and_the_snapshot_encode_as_the_converted_message() {
    let hub = hub();
    let mut sub = hub.subscribe(0).unwrap();
    let first = sub.next().await.unwrap();
    assert_same(&hub, &first); // empty snapshot
    hub.publish_model(status("a", 0));
    hub.publish_model(status("b", 3));
    hub.set_gpus(gpus());
    hub.set_placement(placement(&["a", "b"]));
    hub.publish_model(status("a", 1));
    hub.remove_model("b");
    for _ in 0..6 {
        let item = sub.next().await.unwrap();
        assert_same(&hub, &item);
    }
    // Snapshots from kept parts: fresh, and a resync (a revision from a
    // previous life).
    for since in [0, 100] {
        let mut s = hub.subscribe(since).unwrap();
        let snap = s.next().await.unwrap();
        let crate::hub::Body::Snapshot(body) = &snap.body else {
            panic!("want a snapshot first")
        };
        assert!(body.wire.is_some(), "the parts are kept");
        assert_eq!(body.resync, since != 0);
        assert_same(&hub, &snap);
    }
    // A heartbeat (after the snapshot, for a subscriber that asked).
    let mut s = hub.subscribe_with_heartbeats(0).unwrap();
    s.next().await.unwrap();
    let beat = s.next().await.unwrap();
    assert!(
        matches!(beat.body, crate::hub::Body::Heartbeat(_)),
        "{beat:?}"
    );
    assert_same(&hub, &beat);
}

#[tokio::test]
async fn list_models_is_the_converted_response() {
    let hub = hub();
    for (i, name) in ["c", "a", "b"].into_iter().enumerate() {
        hub.publish_model(status(name, i as u32));
    }
    hub.remove_model("c");
    let (models, revision) = hub.models();
    let want = pb::ListModelsResponse {
        models: models.iter().map(convert::model_status).collect(),
        revision,
    };
    let (wire, rev) = hub.models_wire().unwrap();
    assert_eq!(rev, revision);
    let got = list_models(&wire, rev);
    assert_eq!(pb::ListModelsResponse::decode(got.clone()).unwrap(), want);
    assert_eq!(got, Bytes::from(want.encode_to_vec()));
    assert_eq!(list_models(&[], 0), Bytes::new());
}

#[tokio::test]
async fn without_kept_parts_the_snapshot_is_converted_whole() {
    // The encoder set after models were published: nothing kept for them.
    let hub = Hub::new(Clock::new(), 100, 16);
    hub.publish_model(status("a", 0));
    crate::api::watch::install_encoder(&hub, "ctl".into());
    assert!(hub.models_wire().is_none());
    let mut s = hub.subscribe(0).unwrap();
    let snap = s.next().await.unwrap();
    let crate::hub::Body::Snapshot(body) = &snap.body else {
        panic!("want a snapshot first")
    };
    assert!(body.wire.is_none());
    assert_same(&hub, &snap);
}
