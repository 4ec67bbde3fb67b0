//! The daemon's wire form of the hub's values ([`crate::hub::Wire`]): each
//! model's status, the GPU list and the placement are prost-encoded once,
//! when published; a `WatchEvent`, a snapshot and a `ListModelsResponse`
//! are then put together from those bytes (protobuf's length-delimited
//! fields concatenate), not converted and encoded again per reader. The
//! bytes decode to exactly the messages [`convert::watch_event`] builds
//! (tests compare them).

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};

use super::convert;
use crate::gpu_view::{GpuList, PlacementReport};
use crate::hub::{Body, WatchItem, Wire};
use crate::status::ModelStatus;

// Field numbers of siesta.v1.WatchEvent, Snapshot and ListModelsResponse.
const EV_REVISION: u32 = 1;
const EV_AT_UNIX_MS: u32 = 2;
const EV_CONTROL_ID: u32 = 3;
const EV_SNAPSHOT: u32 = 10;
const EV_MODEL: u32 = 11;
const EV_MODEL_REMOVED: u32 = 12;
const EV_GPUS: u32 = 13;
const EV_PLACEMENT: u32 = 14;
const EV_HEARTBEAT: u32 = 15;
const HEARTBEAT_INTERVAL_MS: u32 = 1;
const SNAP_MODELS: u32 = 1;
const SNAP_GPUS: u32 = 2;
const SNAP_PLACEMENT: u32 = 3;
const SNAP_RESYNC: u32 = 4;
const LIST_MODELS: u32 = 1;
const LIST_REVISION: u32 = 2;

/// The daemon's encoder: `control_id` goes in every `WatchEvent`.
#[derive(Debug, Clone)]
pub struct DaemonWire {
    pub control_id: String,
}

fn put_varint_field(buf: &mut BytesMut, field: u32, v: u64) {
    // proto3: a zero scalar is not written (as prost does).
    if v != 0 {
        encode_key(field, WireType::Varint, buf);
        encode_varint(v, buf);
    }
}

fn put_bytes_field(buf: &mut BytesMut, field: u32, b: &[u8]) {
    encode_key(field, WireType::LengthDelimited, buf);
    encode_varint(b.len() as u64, buf);
    buf.put_slice(b);
}

/// Length of a length-delimited field holding `len` bytes (key ≤ 2 bytes).
fn field_len(len: usize) -> usize {
    2 + prost::length_delimiter_len(len) + len
}

/// `ListModelsResponse { models, revision }` from each model's encoded status.
pub fn list_models(models: &[Bytes], revision: u64) -> Bytes {
    let mut buf =
        BytesMut::with_capacity(models.iter().map(|m| field_len(m.len())).sum::<usize>() + 11);
    for m in models {
        put_bytes_field(&mut buf, LIST_MODELS, m);
    }
    put_varint_field(&mut buf, LIST_REVISION, revision);
    buf.freeze()
}

impl DaemonWire {
    /// The encoded body of the item's `kind` and its field number; `None`
    /// for a snapshot whose parts the hub did not keep.
    fn kind(&self, item: &WatchItem, part: Option<&Bytes>) -> Option<(u32, Bytes)> {
        Some(match &item.body {
            Body::Snapshot(s) => {
                let w = s.wire.as_ref()?;
                let len = w.models.iter().map(|m| field_len(m.len())).sum::<usize>()
                    + w.gpus.as_ref().map_or(0, |g| field_len(g.len()))
                    + w.placement.as_ref().map_or(0, |p| field_len(p.len()))
                    + 2;
                let mut buf = BytesMut::with_capacity(len);
                for m in &w.models {
                    put_bytes_field(&mut buf, SNAP_MODELS, m);
                }
                if let Some(g) = &w.gpus {
                    put_bytes_field(&mut buf, SNAP_GPUS, g);
                }
                if let Some(p) = &w.placement {
                    put_bytes_field(&mut buf, SNAP_PLACEMENT, p);
                }
                put_varint_field(&mut buf, SNAP_RESYNC, u64::from(s.resync));
                (EV_SNAPSHOT, buf.freeze())
            }
            Body::Model(m) => (EV_MODEL, part.cloned().unwrap_or_else(|| self.model(m))),
            Body::ModelRemoved(name) => (EV_MODEL_REMOVED, Bytes::copy_from_slice(name.as_bytes())),
            Body::Gpus(g) => (EV_GPUS, part.cloned().unwrap_or_else(|| self.gpus(g))),
            Body::Placement(p) => (
                EV_PLACEMENT,
                part.cloned().unwrap_or_else(|| self.placement(p)),
            ),
            Body::Heartbeat(every) => {
                let mut buf = BytesMut::with_capacity(6);
                let ms = u32::try_from(every.as_millis()).unwrap_or(u32::MAX);
                put_varint_field(&mut buf, HEARTBEAT_INTERVAL_MS, u64::from(ms));
                (EV_HEARTBEAT, buf.freeze())
            }
        })
    }
}

/// gRPC's message prefix: a compressed flag (0) and the length (u32, big
/// endian).
const GRPC_PREFIX: usize = 5;

/// `msg` as one uncompressed gRPC message frame.
pub fn grpc_frame(msg: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(GRPC_PREFIX + msg.len());
    buf.put_u8(0);
    buf.put_u32(msg.len() as u32);
    buf.put_slice(msg);
    buf.freeze()
}

/// A `WatchEvent` as a `Watch` stream sends it: one gRPC message frame, so
/// that every subscriber's stream sends these same bytes as they are.
impl Wire for DaemonWire {
    fn item(&self, item: &WatchItem, part: Option<&Bytes>) -> Bytes {
        let Some((field, body)) = self.kind(item, part) else {
            // A snapshot without its parts: converted and encoded whole.
            return grpc_frame(&convert::watch_event(item, &self.control_id).encode_to_vec());
        };
        let mut buf = BytesMut::with_capacity(
            GRPC_PREFIX + field_len(body.len()) + field_len(self.control_id.len()) + 22,
        );
        // The prefix, its length filled in below.
        buf.put_bytes(0, GRPC_PREFIX);
        put_varint_field(&mut buf, EV_REVISION, item.revision);
        // int64 on the wire: the two's complement as a varint (as prost).
        put_varint_field(&mut buf, EV_AT_UNIX_MS, item.at_unix_ms as u64);
        if !self.control_id.is_empty() {
            put_bytes_field(&mut buf, EV_CONTROL_ID, self.control_id.as_bytes());
        }
        // A oneof member is written even when empty.
        put_bytes_field(&mut buf, field, &body);
        let len = (buf.len() - GRPC_PREFIX) as u32;
        buf[1..GRPC_PREFIX].copy_from_slice(&len.to_be_bytes());
        buf.freeze()
    }

    fn model(&self, status: &ModelStatus) -> Bytes {
        Bytes::from(convert::model_status(status).encode_to_vec())
    }

    fn gpus(&self, gpus: &GpuList) -> Bytes {
        Bytes::from(convert::gpu_list(gpus).encode_to_vec())
    }

    fn placement(&self, placement: &PlacementReport) -> Bytes {
        Bytes::from(convert::placement(placement).encode_to_vec())
    }
}

#[cfg(test)]
mod tests;
