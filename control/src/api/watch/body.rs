//! A `Watch` response without tonic's encoder: the body hands each item's
//! bytes (already a gRPC message frame, made once by the hub's encoder) to
//! HTTP/2 as they are, one frame per item, then the `grpc-status: 0`
//! trailer when the hub ends the subscription.
//!
//! Why: with tonic's `EncodeBody` every delivery to every subscriber
//! copied the event into a fresh buffer (an allocation and a free per
//! event per subscriber) behind a stream adapter; here a delivery is a
//! reference count on the shared bytes. The request is read with tonic's
//! decoder; a bad one is answered with a gRPC status.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use siesta_proto::v1 as pb;
use tonic::Status;
use tonic::codegen::{Body as HttpBody, StdError, http};

use super::{RequestDecoder, WatchSvc, encode};
use crate::hub::{Hub, Subscription};

/// A request larger than this is refused (a `WatchRequest` is a revision
/// and a client id).
const MAX_REQUEST: usize = 64 * 1024;

/// The response to one `Watch` call: a stream of frames, or the status
/// that refused it.
pub async fn respond<B>(svc: WatchSvc, req: http::Request<B>) -> http::Response<tonic::body::Body>
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let opened = match read_request(req).await {
        Ok(r) => svc.subscribe(&r),
        Err(status) => Err(status),
    };
    match opened {
        Ok(sub) => {
            let body = WatchBody {
                sub,
                hub: svc.hub.clone(),
                control_id: svc.control_id.clone(),
                ended: false,
            };
            let mut resp = http::Response::new(tonic::body::Body::new(body));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            resp
        }
        Err(status) => status.into_http(),
    }
}

/// The `WatchRequest` in the request's body, read by tonic's own decoder
/// (its framing, size limit and errors, as every other method has them).
async fn read_request<B>(req: http::Request<B>) -> Result<pb::WatchRequest, Status>
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let mut messages = tonic::codec::Streaming::new_request(
        RequestDecoder::<pb::WatchRequest>::default(),
        req.into_body(),
        None,
        Some(MAX_REQUEST),
    );
    messages
        .message()
        .await?
        .ok_or_else(|| Status::internal("Missing request message."))
}

/// One subscriber's stream of frames.
struct WatchBody {
    sub: Subscription,
    hub: Arc<Hub>,
    control_id: Arc<str>,
    ended: bool,
}

impl HttpBody for WatchBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        match ready!(this.sub.poll_next(cx)) {
            Some(item) => {
                let bytes = this
                    .hub
                    .wire(&item)
                    .unwrap_or_else(|| encode(&item, &this.control_id));
                Poll::Ready(Some(Ok(hyper::body::Frame::data(bytes))))
            }
            None => {
                // The hub ended the subscription (shutdown): a clean end.
                this.ended = true;
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                Poll::Ready(Some(Ok(hyper::body::Frame::trailers(trailers))))
            }
        }
    }
}
