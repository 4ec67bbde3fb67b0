//! `Watch` served from the hub's shared encoded events: each event is
//! prost-encoded once, when it is published ([`Hub::set_encoder`]), and
//! every subscriber's stream sends those same bytes through a pass-through
//! codec. Clients see the same `siesta.v1.WatchEvent` messages as before;
//! only the server skips the per-subscriber conversion and encoding.
//!
//! [`WatchRoute`] wraps the generated `ControlServer` and answers the one
//! path `/siesta.v1.Control/Watch` itself; every other path goes to the
//! generated service unchanged.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes};
use futures::Stream;
use prost::Message;
use siesta_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{Body as HttpBody, BoxFuture, Service, StdError, http};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use super::convert;
use crate::OpError;
use crate::hub::{Hub, WatchItem};

/// The method's path.
pub const WATCH_PATH: &str = "/siesta.v1.Control/Watch";

/// Encodes a hub item as the `WatchEvent` clients receive.
pub fn encode(item: &WatchItem, control_id: &str) -> Bytes {
    Bytes::from(convert::watch_event(item, control_id).encode_to_vec())
}

/// Sets the hub's encoder to the daemon's wire form.
pub fn install_encoder(hub: &Hub, control_id: String) {
    hub.set_encoder(move |item| encode(item, &control_id));
}

/// Decodes `WatchRequest`; encodes already-encoded `WatchEvent` bytes by
/// copying them into the frame.
#[derive(Debug, Clone, Copy, Default)]
pub struct WireCodec;

/// A Watch stream holds a small buffer: events are a few hundred bytes and
/// it grows for a large snapshot (the default 8 KB, times 10,000
/// subscribers, is 80 MB).
const BUFFER_SIZE: usize = 512;
const YIELD_THRESHOLD: usize = 32 * 1024;

#[derive(Debug, Clone, Copy, Default)]
pub struct WireEncoder;

impl Encoder for WireEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.reserve(item.len());
        dst.put_slice(&item);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct RequestDecoder;

impl Decoder for RequestDecoder {
    type Item = pb::WatchRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<pb::WatchRequest>, Status> {
        let len = src.remaining();
        pb::WatchRequest::decode(src.copy_to_bytes(len))
            .map(Some)
            .map_err(|e| Status::internal(format!("WatchRequest: {e}")))
    }
}

impl Codec for WireCodec {
    type Encode = Bytes;
    type Decode = pb::WatchRequest;
    type Encoder = WireEncoder;
    type Decoder = RequestDecoder;

    fn encoder(&mut self) -> WireEncoder {
        WireEncoder
    }

    fn decoder(&mut self) -> RequestDecoder {
        RequestDecoder
    }
}

type ByteStream = std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, Status>> + Send>>;

/// The stream of one subscriber: the hub's shared bytes of each item.
#[derive(Debug, Clone)]
pub struct WatchSvc {
    pub hub: Arc<Hub>,
    pub control_id: String,
    /// Ends streams at shutdown.
    pub cancel: CancellationToken,
}

impl WatchSvc {
    /// Subscribes as the `Watch` RPC asks; the items in their wire form.
    pub fn open(&self, r: &pb::WatchRequest) -> Result<ByteStream, Status> {
        let sub = self
            .hub
            .subscribe(r.since_revision)
            .ok_or(OpError::ShuttingDown)?;
        tracing::debug!(client = %r.client_id, since = r.since_revision, "watch");
        let hub = self.hub.clone();
        let control_id = self.control_id.clone();
        let cancel = self.cancel.clone();
        let stream = futures::stream::unfold((sub, cancel), move |(mut sub, cancel)| {
            let hub = hub.clone();
            let control_id = control_id.clone();
            async move {
                let item = tokio::select! {
                    _ = cancel.cancelled() => None,
                    item = sub.next() => item,
                }?;
                let bytes = hub
                    .wire(&item)
                    .unwrap_or_else(|| encode(&item, &control_id));
                Some((Ok(bytes), (sub, cancel)))
            }
        });
        Ok(Box::pin(stream))
    }
}

impl tonic::server::ServerStreamingService<pb::WatchRequest> for WatchSvc {
    type Response = Bytes;
    type ResponseStream = ByteStream;
    type Future = std::future::Ready<Result<Response<ByteStream>, Status>>;

    fn call(&mut self, req: Request<pb::WatchRequest>) -> Self::Future {
        std::future::ready(self.open(req.get_ref()).map(Response::new))
    }
}

/// The generated service with `Watch` answered from shared bytes.
#[derive(Debug, Clone)]
pub struct WatchRoute<S> {
    inner: S,
    watch: WatchSvc,
}

impl<S> WatchRoute<S> {
    pub fn new(inner: S, watch: WatchSvc) -> Self {
        WatchRoute { inner, watch }
    }
}

impl<S: NamedService> NamedService for WatchRoute<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for WatchRoute<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>, Error = Infallible>,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != WATCH_PATH {
            return Box::pin(self.inner.call(req));
        }
        let svc = self.watch.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(WireCodec);
            Ok(grpc.server_streaming(svc, req).await)
        })
    }
}

#[cfg(test)]
mod tests;
