use super::*;
use std::convert::Infallible;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioExecutor;
use tonic::codegen::BoxFuture;
use tonic::server::NamedService;

/// A path [`Where`] answers with a body that never ends.
const ENDLESS_PATH: &str = "/siesta.v1.Control/Endless";

/// Records the name of the thread that runs each request's future, by path.
#[derive(Debug, Clone, Default)]
struct Where(Arc<Mutex<Vec<(String, String)>>>);

impl NamedService for Where {
    const NAME: &'static str = "siesta.v1.Control";
}

impl<B: Send + 'static> tonic::codegen::Service<http::Request<B>> for Where {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let seen = self.0.clone();
        let path = req.uri().path().to_string();
        Box::pin(async move {
            let thread = std::thread::current().name().unwrap_or("").to_string();
            let endless = path == ENDLESS_PATH;
            seen.lock().unwrap().push((path, thread));
            if endless {
                // As a Watch whose client stopped reading never gets its
                // end out.
                let never = futures::stream::pending::<
                    Result<hyper::body::Frame<bytes::Bytes>, Infallible>,
                >();
                let body = tonic::body::Body::new(http_body_util::StreamBody::new(never));
                return Ok(http::Response::new(body));
            }
            Ok(http::Response::new(tonic::body::Body::empty()))
        })
    }
}

async fn request(addr: std::net::SocketAddr, path: &str) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200, "{path}");
    resp.into_body().collect().await.unwrap();
}

/// `serve` on a loopback port: its address, its shutdown, its task.
async fn serving(
    routes: Where,
    exec: Exec,
) -> (
    std::net::SocketAddr,
    CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let served = tokio::spawn(serve(listener, Routes::new(routes), exec, stop.clone()));
    (addr, stop, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_and_list_models_run_on_the_watch_runtime_and_the_rest_do_not() {
    let rt = WatchRuntime::start(1).unwrap();
    let exec = Exec::new(Some(rt.handle()));
    let seen = Where::default();
    let (addr, stop, served) = serving(seen.clone(), exec.clone()).await;
    request(addr, WATCH_PATH).await;
    request(addr, "/siesta.v1.Control/GetModel").await;
    request(addr, LIST_MODELS_PATH).await;
    request(addr, "/siesta.v1.Control/Sleep").await;
    request(addr, WATCH_PATH).await;
    let seen = seen.0.lock().unwrap().clone();
    assert_eq!(seen.len(), 5, "{seen:?}");
    for (path, thread) in &seen {
        let on_watch = thread == "siesta-watch";
        let want = path == WATCH_PATH || path == LIST_MODELS_PATH;
        assert_eq!(on_watch, want, "{path} ran on thread {thread:?}");
    }
    assert_eq!(exec.watch_streams(), 3);
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("serve ends after shutdown")
        .unwrap();
}

#[tokio::test]
async fn shutdown_ends_serving_with_a_connection_open() {
    let rt = WatchRuntime::start(1).unwrap();
    let (addr, stop, served) = serving(Where::default(), Exec::new(Some(rt.handle()))).await;
    // An idle HTTP/2 connection, as a client between calls holds one.
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (_send, conn) = hyper::client::conn::http2::handshake::<_, _, Empty<bytes::Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let client = tokio::spawn(conn);
    request(addr, "/siesta.v1.Control/GetModel").await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("serve ends after shutdown")
        .unwrap();
    // The server said GOAWAY and closed: the client's connection ends.
    tokio::time::timeout(Duration::from_secs(30), client)
        .await
        .expect("the client connection ends")
        .unwrap()
        .ok();
}

/// A call that cannot end holds the shutdown up [`CONNECTION_DRAIN`] at
/// most; then its connection is closed and serving ends. Before, the daemon
/// never exited after SIGTERM while a Watch client had stopped reading.
#[tokio::test]
async fn shutdown_ends_serving_though_a_call_never_ends() {
    let (addr, stop, served) = serving(Where::default(), Exec::new(None)).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!("http://{addr}{ENDLESS_PATH}"))
        .header("content-type", "application/grpc")
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let began = std::time::Instant::now();
    stop.cancel();
    tokio::time::timeout(CONNECTION_DRAIN * 3, served)
        .await
        .expect("serve ends after shutdown")
        .unwrap();
    assert!(began.elapsed() >= CONNECTION_DRAIN, "{:?}", began.elapsed());
    drop(resp);
}

/// A socket that counts the writes made to it.
#[derive(Debug)]
struct Counting<T>(T, Arc<AtomicU64>);

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counting<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Counting<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.0).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(_))) {
            self.1.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.0).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(_))) {
            self.1.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[tokio::test]
async fn small_frames_of_many_streams_leave_in_a_few_writes() {
    const STREAMS: usize = 100;
    let (go, rx) = tokio::sync::watch::channel(false);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let writes = Arc::new(AtomicU64::new(0));
    // One server connection, set up as `serve` sets up each, over a
    // socket that counts writes.
    let counted = writes.clone();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        // Every request: one 400-byte DATA frame (a Watch event's size),
        // sent once `go` turns true.
        let svc = hyper::service::service_fn(move |_req| {
            let mut go = rx.clone();
            let frame = futures::stream::once(async move {
                let _ = go.wait_for(|g| *g).await;
                Ok::<_, Infallible>(hyper::body::Frame::data(bytes::Bytes::from(vec![7u8; 400])))
            });
            let body = http_body_util::StreamBody::new(frame);
            async move { Ok::<_, Infallible>(http::Response::new(body)) }
        });
        let _ = http2(Exec::new(None))
            .serve_connection(conn_io(Counting(tcp, counted)), svc)
            .await;
    });
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake::<_, _, Empty<bytes::Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    // Every stream open, its head received, its body waiting.
    let mut bodies = Vec::new();
    for _ in 0..STREAMS {
        let mut send = send.clone();
        let req = http::Request::post(format!("http://{addr}{WATCH_PATH}"))
            .header("content-type", "application/grpc")
            .body(Empty::<bytes::Bytes>::new())
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(30), send.send_request(req))
            .await
            .expect("response head")
            .unwrap();
        bodies.push(resp.into_body());
    }
    let before = writes.load(Ordering::Relaxed);
    go.send(true).unwrap();
    for body in bodies {
        let got = tokio::time::timeout(Duration::from_secs(30), body.collect())
            .await
            .expect("body")
            .unwrap()
            .to_bytes();
        assert_eq!(got.len(), 400);
    }
    let writes = writes.load(Ordering::Relaxed) - before;
    // 100 frames of 409 bytes and 100 stream ends: a few 16 KiB writes,
    // not one write per frame.
    assert!(
        writes <= (STREAMS / 5) as u64,
        "{writes} writes for {STREAMS} small frames"
    );
}

/// A client that connects and sends nothing, or half a preface, is closed
/// after [`preface::PREFACE_WAIT`]. Before, hyper waited for the preface
/// without end (its keep-alive pings begin after it): each such client
/// held a task and a file descriptor for the daemon's life.
#[tokio::test(start_paused = true)]
async fn a_client_that_sends_no_preface_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, stop, served) = serving(Where::default(), Exec::new(None)).await;
    let silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
    half.write_all(b"PRI * HTTP/2.0").await.unwrap();
    let began = tokio::time::Instant::now();
    for (what, mut c) in [("silent", silent), ("half a preface", half)] {
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(3600), c.read_to_end(&mut got))
            .await
            .unwrap_or_else(|_| panic!("{what}: never closed ({} bytes read)", got.len()))
            .ok();
    }
    assert!(
        began.elapsed() >= preface::PREFACE_WAIT,
        "{:?}",
        began.elapsed()
    );
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("serve ends after shutdown")
        .unwrap();
}
