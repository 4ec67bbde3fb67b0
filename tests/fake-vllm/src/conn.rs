//! One HTTP/1 connection, closed like uvicorn's: after `VLLM_HTTP_TIMEOUT_KEEP_ALIVE` seconds
//! (5 by default) with no request in flight, the server closes it, so a client that reuses a pooled
//! connection later finds it gone.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::http::Body;
use crate::server::{App, handle};

/// Requests in flight on one connection and when the last one ended.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    idle_since: Mutex<Instant>,
}

/// Counts a request as in flight until dropped (with its response body, or when the client
/// went away before the answer).
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(a: &Arc<Activity>) -> InFlight {
        a.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(a.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap() = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request in flight until it is sent or dropped.
struct Tracked {
    inner: Body,
    _guard: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `stream` until the client closes it or it stays idle for `keep_alive`; after
/// `shutdown`, until the answer under way (if any) is sent.
pub async fn serve(
    app: Arc<App>,
    stream: TcpStream,
    peer: SocketAddr,
    keep_alive: Duration,
    shutdown: CancellationToken,
) {
    let activity = Arc::new(Activity {
        in_flight: AtomicUsize::new(0),
        idle_since: Mutex::new(Instant::now()),
    });
    let act = activity.clone();
    let svc = service_fn(move |req| {
        let app = app.clone();
        let guard = InFlight::new(&act);
        async move {
            let resp = handle(app, req, peer).await;
            Ok::<_, Infallible>(resp.map(|inner| Tracked {
                inner,
                _guard: guard,
            }))
        }
    });
    let conn = http1::Builder::new()
        .keep_alive(!keep_alive.is_zero())
        .serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let mut closing = false;
    loop {
        // Check again when the idle period could be over.
        let wait = if activity.in_flight.load(Ordering::SeqCst) > 0 || closing {
            keep_alive.max(Duration::from_millis(100))
        } else {
            keep_alive.saturating_sub(activity.idle_since.lock().unwrap().elapsed())
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, %peer, "connection ended");
                }
                return;
            }
            () = shutdown.cancelled(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            () = tokio::time::sleep(wait) => {
                let idle = activity.in_flight.load(Ordering::SeqCst) == 0
                    && activity.idle_since.lock().unwrap().elapsed() >= keep_alive;
                if idle && !closing {
                    tracing::debug!(%peer, "closing an idle keep-alive connection");
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}
