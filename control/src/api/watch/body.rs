//! A `Watch` response without tonic's encoder: the body hands each item's
//! bytes (already a gRPC message frame, made once by the hub's encoder) to
//! HTTP/2 as they are, one frame per item, then the `grpc-status: 0`
//! trailer when the hub ends the subscription.
//!
//! Why: with tonic's `EncodeBody` every delivery to every subscriber
//! copied the event into a fresh buffer (an allocation and a free per
//! event per subscriber) behind a stream adapter; here a delivery is a
//! reference count on the shared bytes. The request (a `WatchRequest` in
//! one gRPC frame) is read here too; errors are answered as gRPC statuses.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use prost::Message;
use siesta_proto::v1 as pb;
use tonic::Status;
use tonic::codegen::{Body as HttpBody, StdError, http};

use super::{WatchSvc, encode};
use crate::api::wire::GRPC_PREFIX;
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

/// The `WatchRequest` in the request's body.
async fn read_request<B>(req: http::Request<B>) -> Result<pb::WatchRequest, Status>
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let body = http_body_util::Limited::new(req.into_body(), MAX_REQUEST)
        .collect()
        .await
        .map_err(|e| Status::invalid_argument(format!("reading the WatchRequest: {e}")))?
        .to_bytes();
    decode_request(body)
}

/// One uncompressed gRPC message frame holding a `WatchRequest`.
fn decode_request(mut body: Bytes) -> Result<pb::WatchRequest, Status> {
    if body.len() < GRPC_PREFIX {
        return Err(Status::internal("Missing request message."));
    }
    let compressed = body.get_u8();
    let len = body.get_u32() as usize;
    if compressed != 0 {
        return Err(Status::unimplemented(
            "a compressed WatchRequest: this server accepts no grpc-encoding",
        ));
    }
    if body.len() != len {
        return Err(Status::internal(format!(
            "WatchRequest frame says {len} bytes, {} came",
            body.len()
        )));
    }
    pb::WatchRequest::decode(body)
        .map_err(|e| Status::internal(format!("siesta.v1.WatchRequest: {e}")))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(flag: u8, msg: &[u8]) -> Bytes {
        let mut b = vec![flag];
        b.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        b.extend_from_slice(msg);
        b.into()
    }

    #[test]
    fn a_request_frame_is_decoded_and_bad_ones_are_refused_with_a_status() {
        let r = pb::WatchRequest {
            since_revision: 7,
            client_id: "p".into(),
        };
        let ok = decode_request(frame(0, &r.encode_to_vec())).unwrap();
        assert_eq!(ok, r);
        let empty = decode_request(Bytes::new()).unwrap_err();
        assert_eq!(empty.code(), tonic::Code::Internal);
        let gz = decode_request(frame(1, &r.encode_to_vec())).unwrap_err();
        assert_eq!(gz.code(), tonic::Code::Unimplemented, "{gz:?}");
        let mut short = frame(0, &r.encode_to_vec()).to_vec();
        short.pop();
        let short = decode_request(short.into()).unwrap_err();
        assert!(short.message().contains("frame says"), "{short:?}");
        let junk = decode_request(frame(0, &[0xff, 0xff, 0xff])).unwrap_err();
        assert!(junk.message().contains("WatchRequest"), "{junk:?}");
    }
}
