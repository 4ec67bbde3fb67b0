//! `Watch` served from the hub's shared encoded events: each event is
//! prost-encoded once, in its gRPC message frame, when it is published
//! ([`Hub::set_encoder`]), and every subscriber's stream sends those same
//! bytes (`body.rs`). Clients see the same `siesta.v1.WatchEvent` messages
//! as before; only the server skips the per-subscriber conversion,
//! encoding and copy.
//!
//! [`WatchRoute`] wraps the generated `ControlServer` and answers two paths
//! itself: `/siesta.v1.Control/Watch`, and `/siesta.v1.Control/ListModels`
//! from each model's status as the hub keeps it encoded (at 1,000 models,
//! a concatenation instead of 1,000 conversions); every other path goes
//! to the generated service unchanged.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes};
use futures::FutureExt;
use prost::Message;
use siesta_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{Body as HttpBody, BoxFuture, Service, StdError, http};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use super::convert;
use super::wire::DaemonWire;
use crate::OpError;
use crate::hub::{Hub, Subscription, WatchItem};

/// The method's path.
pub const WATCH_PATH: &str = "/siesta.v1.Control/Watch";
/// `ListModels`, answered from the hub's encoded statuses.
pub const LIST_MODELS_PATH: &str = "/siesta.v1.Control/ListModels";

/// Encodes a hub item as the `WatchEvent` clients receive, in its gRPC
/// message frame (when the hub has no encoder).
pub fn encode(item: &WatchItem, control_id: &str) -> Bytes {
    super::wire::grpc_frame(&convert::watch_event(item, control_id).encode_to_vec())
}

/// Sets the hub's encoder to the daemon's wire form.
pub fn install_encoder(hub: &Hub, control_id: String) {
    hub.set_encoder(DaemonWire { control_id });
}

/// Decodes the request `R`; encodes already-encoded response bytes by
/// copying them into the frame.
#[derive(Debug, Clone, Copy)]
pub struct WireCodec<R>(PhantomData<fn() -> R>);

impl<R> Default for WireCodec<R> {
    fn default() -> Self {
        WireCodec(PhantomData)
    }
}

/// `ListModels` (the one method answered through this codec; `Watch` has a
/// body of its own) copies its answer into a buffer that starts small and
/// grows to the answer's size.
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

#[derive(Debug, Clone, Copy)]
pub struct RequestDecoder<R>(PhantomData<fn() -> R>);

impl<R> Default for RequestDecoder<R> {
    fn default() -> Self {
        RequestDecoder(PhantomData)
    }
}

impl<R: Message + Default> Decoder for RequestDecoder<R> {
    type Item = R;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<R>, Status> {
        let len = src.remaining();
        R::decode(src.copy_to_bytes(len))
            .map(Some)
            .map_err(|e| Status::internal(format!("{}: {e}", std::any::type_name::<R>())))
    }
}

impl<R: Message + Default + Send + 'static> Codec for WireCodec<R> {
    type Encode = Bytes;
    type Decode = R;
    type Encoder = WireEncoder;
    type Decoder = RequestDecoder<R>;

    fn encoder(&mut self) -> WireEncoder {
        WireEncoder
    }

    fn decoder(&mut self) -> RequestDecoder<R> {
        RequestDecoder(PhantomData)
    }
}

/// The stream of one subscriber: the hub's shared bytes of each item
/// (see `body.rs`).
#[derive(Debug, Clone)]
pub struct WatchSvc {
    hub: Arc<Hub>,
    control_id: Arc<str>,
    /// This run's `started_unix_ms`: a resume point of another run resyncs.
    started_unix_ms: i64,
}

impl WatchSvc {
    /// Serves `hub`'s items; when `cancel` fires (shutdown) the hub ends
    /// every subscription, so each stream ends after what it already has,
    /// with no wait for cancellation of its own to poll on every event.
    pub fn new(
        hub: Arc<Hub>,
        control_id: &str,
        started_unix_ms: i64,
        cancel: CancellationToken,
    ) -> WatchSvc {
        let ends = hub.clone();
        tokio::spawn(async move {
            cancel.cancelled().await;
            ends.end_subscriptions();
        });
        WatchSvc {
            hub,
            control_id: control_id.into(),
            started_unix_ms,
        }
    }

    /// Subscribes as the `Watch` RPC asks.
    fn subscribe(&self, r: &pb::WatchRequest) -> Result<Subscription, Status> {
        subscribe(&self.hub, r, self.started_unix_ms)
    }
}

/// Subscribes as a `WatchRequest` asks: after `since_revision`, unless it
/// is of another run of the control plane (`incarnation` set and not
/// `started_unix_ms`), whose revisions mean something else here: that gets
/// a snapshot marked `resync`.
pub(super) fn subscribe(
    hub: &Arc<Hub>,
    r: &pb::WatchRequest,
    started_unix_ms: i64,
) -> Result<Subscription, Status> {
    let other_run = r.incarnation != 0 && r.incarnation != started_unix_ms;
    let sub = if other_run {
        hub.subscribe_resync(r.heartbeat)
    } else if r.heartbeat {
        hub.subscribe_with_heartbeats(r.since_revision)
    } else {
        hub.subscribe(r.since_revision)
    };
    tracing::debug!(client = %r.client_id, since = r.since_revision, other_run, heartbeat = r.heartbeat, "watch");
    Ok(sub.ok_or(OpError::ShuttingDown)?)
}

/// `ListModels` from the hub's encoded statuses (converted when the hub
/// keeps none: no encoder set).
#[derive(Debug, Clone)]
pub struct ListModelsSvc {
    pub hub: Arc<Hub>,
}

impl ListModelsSvc {
    pub fn answer(&self) -> Bytes {
        match self.hub.models_wire() {
            Some((models, revision)) => super::wire::list_models(&models, revision),
            None => {
                let (models, revision) = self.hub.models();
                Bytes::from(
                    pb::ListModelsResponse {
                        models: models.iter().map(convert::model_status).collect(),
                        revision,
                    }
                    .encode_to_vec(),
                )
            }
        }
    }
}

impl tonic::server::UnaryService<pb::ListModelsRequest> for ListModelsSvc {
    type Response = Bytes;
    type Future = std::future::Ready<Result<Response<Bytes>, Status>>;

    fn call(&mut self, _: Request<pb::ListModelsRequest>) -> Self::Future {
        std::future::ready(Ok(Response::new(self.answer())))
    }
}

/// The generated service with `Watch` and `ListModels` answered from
/// shared bytes.
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
        match req.uri().path() {
            WATCH_PATH => Box::pin(body::respond(self.watch.clone(), req).map(Ok)),
            LIST_MODELS_PATH => {
                let svc = ListModelsSvc {
                    hub: self.watch.hub.clone(),
                };
                Box::pin(async move {
                    let mut grpc =
                        tonic::server::Grpc::new(WireCodec::<pb::ListModelsRequest>::default());
                    Ok(grpc.unary(svc, req).await)
                })
            }
            _ => Box::pin(self.inner.call(req)),
        }
    }
}

mod body;

#[cfg(test)]
mod tests;
