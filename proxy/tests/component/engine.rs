//! A tiny in-process engine: answers OpenAI paths (whole or SSE), records what
//! it received, can hold responses behind a gate, and counts requests whose
//! client went away before the end.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::{mpsc, watch};

#[derive(Debug)]
pub struct EngineState {
    pub name: String,
    pub received: Mutex<Vec<(String, serde_json::Value)>>,
    pub in_flight: AtomicUsize,
    pub cancelled: AtomicUsize,
    gate: watch::Sender<bool>,
}

#[derive(Debug)]
pub struct Engine {
    pub url: String,
    pub state: Arc<EngineState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Counts the request as cancelled if dropped before `done`.
struct Track(Arc<EngineState>, bool);

impl Track {
    fn done(&mut self) {
        self.1 = true;
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !self.1 {
            self.0.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

type Body = Either<
    Full<Bytes>,
    StreamBody<tokio_stream::wrappers::ReceiverStream<Result<Frame<Bytes>, Infallible>>>,
>;

impl Engine {
    pub async fn start(name: &str) -> Engine {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let (gate, _) = watch::channel(true);
        let state = Arc::new(EngineState {
            name: name.into(),
            received: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            cancelled: AtomicUsize::new(0),
            gate,
        });
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((s, _)) = listener.accept().await else {
                    return;
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(st.clone(), req));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        Engine {
            url: format!("http://{addr}"),
            state,
            task,
        }
    }

    /// While closed, responses (and the second SSE chunk) wait.
    pub fn set_gate(&self, open: bool) {
        self.state.gate.send_replace(open);
    }

    pub fn received(&self) -> Vec<(String, serde_json::Value)> {
        self.state.received.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.state.received.lock().unwrap().len()
    }
}

async fn wait_gate(st: &EngineState) {
    let mut rx = st.gate.subscribe();
    let _ = rx.wait_for(|open| *open).await;
}

async fn handle(
    st: Arc<EngineState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_owned();
    let body = req.into_body().collect().await.unwrap().to_bytes();
    // As vLLM's server reads it (Python's json.loads on the bytes): a UTF-8
    // byte order mark is skipped.
    let json_bytes = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&body);
    let json: serde_json::Value =
        serde_json::from_slice(json_bytes).unwrap_or(serde_json::Value::Null);
    st.received
        .lock()
        .unwrap()
        .push((path.clone(), json.clone()));
    if !path.starts_with("/v1/") {
        return Ok(Response::new(Either::Left(Full::new(Bytes::from_static(
            b"engine admin path",
        )))));
    }
    st.in_flight.fetch_add(1, Ordering::SeqCst);
    let mut track = Track(st.clone(), false);
    let model = json["model"].as_str().unwrap_or("").to_owned();
    let builder = Response::builder()
        .header("x-engine", st.name.as_str())
        .header("connection", "x-hop")
        .header("x-hop", "1");
    if json["stream"].as_bool() == Some(true) {
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let chunk = |i: u32| {
                Ok(Frame::data(Bytes::from(format!(
                    "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}},\"finish_reason\":null}}]}}\n\n"
                ))))
            };
            if tx.send(chunk(1)).await.is_err() {
                return;
            }
            let st = track.0.clone();
            tokio::select! {
                _ = wait_gate(&st) => {}
                _ = tx.closed() => return,
            }
            if tx.send(chunk(2)).await.is_err() {
                return;
            }
            if tx
                .send(Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))))
                .await
                .is_ok()
            {
                track.done();
            }
        });
        let resp = builder
            .header("content-type", "text/event-stream")
            .body(Either::Right(StreamBody::new(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            )))
            .unwrap();
        return Ok(resp);
    }
    wait_gate(&st).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    let out = if path.ends_with("/embeddings") {
        serde_json::json!({
            "object": "list", "model": model,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
            "usage": {"prompt_tokens": 1, "total_tokens": 1}
        })
    } else {
        serde_json::json!({
            "id": "x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        })
    };
    track.done();
    Ok(builder
        .header("content-type", "application/json")
        .body(Either::Left(Full::new(Bytes::from(out.to_string()))))
        .unwrap())
}
