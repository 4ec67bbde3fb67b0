//! A scripted in-process control plane: a real tonic `Control` server whose
//! models the test sets, recording every Demand and activity report. It runs
//! on its own runtime thread so `kill()` closes every socket like a crash.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use siesta_proto::v1::control_server::{Control, ControlServer};
use siesta_proto::v1::*;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

type Res<T> = Result<Response<T>, Status>;

/// What the test can see and change; survives kill and restart.
#[derive(Debug, Default)]
pub struct State {
    pub models: BTreeMap<String, ModelStatus>,
    pub revision: u64,
    pub started_unix_ms: i64,
    pub watchers: Vec<mpsc::Sender<Result<WatchEvent, Status>>>,
    pub watch_requests: Vec<WatchRequest>,
    pub demands: Vec<DemandRequest>,
    pub reports: Vec<ReportActivityRequest>,
    pub bearer: Vec<Option<String>>,
    /// Answer demands with accepted = false and this message.
    pub refuse_demands: Option<String>,
    /// To a Watch that asks for heartbeats: one after the snapshot with
    /// this interval, then only what [`ScriptedControl::beat`] sends (a
    /// wedged event path never sends another). `None`: none, as a control
    /// plane older than heartbeats.
    pub heartbeat_ms: Option<u32>,
}

#[derive(Clone, Debug)]
struct Svc(Arc<Mutex<State>>);

fn unimpl<T>() -> Res<T> {
    Err(Status::unimplemented("not scripted"))
}

#[tonic::async_trait]
impl Control for Svc {
    async fn get_info(&self, _: Request<GetInfoRequest>) -> Res<ControlInfo> {
        let s = self.0.lock().unwrap();
        Ok(Response::new(ControlInfo {
            control_id: "scripted".into(),
            version: "test".into(),
            started_unix_ms: s.started_unix_ms,
            config_path: String::new(),
            revision: s.revision,
        }))
    }
    async fn list_models(&self, _: Request<ListModelsRequest>) -> Res<ListModelsResponse> {
        unimpl()
    }
    async fn get_model(&self, _: Request<GetModelRequest>) -> Res<GetModelResponse> {
        unimpl()
    }
    async fn list_gpus(&self, _: Request<ListGpusRequest>) -> Res<ListGpusResponse> {
        unimpl()
    }
    async fn get_placement(&self, _: Request<GetPlacementRequest>) -> Res<GetPlacementResponse> {
        unimpl()
    }
    async fn wake(&self, _: Request<WakeRequest>) -> Res<OperationResponse> {
        unimpl()
    }
    async fn sleep(&self, _: Request<SleepRequest>) -> Res<OperationResponse> {
        unimpl()
    }
    async fn suspend(&self, _: Request<ModelRequest>) -> Res<OperationResponse> {
        unimpl()
    }
    async fn start(&self, _: Request<ModelRequest>) -> Res<OperationResponse> {
        unimpl()
    }
    async fn stop(&self, _: Request<ModelRequest>) -> Res<OperationResponse> {
        unimpl()
    }
    async fn restart(&self, _: Request<ModelRequest>) -> Res<OperationResponse> {
        unimpl()
    }
    async fn pin(&self, _: Request<PinRequest>) -> Res<OperationResponse> {
        unimpl()
    }
    async fn unpin(&self, _: Request<ModelRequest>) -> Res<OperationResponse> {
        unimpl()
    }

    type WatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<WatchEvent, Status>> + Send + 'static>>;

    async fn watch(&self, req: Request<WatchRequest>) -> Res<Self::WatchStream> {
        let bearer = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let (tx, rx) = mpsc::channel(1024);
        let mut s = self.0.lock().unwrap();
        s.bearer.push(bearer);
        s.watch_requests.push(req.into_inner());
        let snap = WatchEvent {
            revision: s.revision,
            at_unix_ms: 0,
            control_id: "scripted".into(),
            kind: Some(watch_event::Kind::Snapshot(Snapshot {
                models: s.models.values().cloned().collect(),
                ..Default::default()
            })),
        };
        tx.try_send(Ok(snap)).unwrap();
        if let Some(interval_ms) = s
            .heartbeat_ms
            .filter(|_| s.watch_requests.last().unwrap().heartbeat)
        {
            tx.try_send(Ok(heartbeat(s.revision, interval_ms))).unwrap();
        }
        s.watchers.push(tx);
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn demand(&self, req: Request<DemandRequest>) -> Res<DemandResponse> {
        let mut s = self.0.lock().unwrap();
        let r = req.into_inner();
        let model = s.models.get(&r.model).cloned();
        s.demands.push(r);
        Ok(Response::new(DemandResponse {
            model,
            accepted: s.refuse_demands.is_none(),
            message: s.refuse_demands.clone().unwrap_or_default(),
        }))
    }

    async fn report_activity(
        &self,
        req: Request<ReportActivityRequest>,
    ) -> Res<ReportActivityResponse> {
        self.0.lock().unwrap().reports.push(req.into_inner());
        Ok(Response::new(ReportActivityResponse {}))
    }

    type LogsStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<LogLine, Status>> + Send + 'static>>;

    async fn logs(&self, _: Request<LogsRequest>) -> Res<Self::LogsStream> {
        unimpl()
    }
    async fn diag_p2p(&self, _: Request<DiagP2pRequest>) -> Res<DiagP2pResponse> {
        unimpl()
    }
    async fn reload(&self, _: Request<ReloadRequest>) -> Res<ReloadResponse> {
        unimpl()
    }
}

/// A running (or killed) scripted control plane.
#[derive(Debug)]
pub struct ScriptedControl {
    pub state: Arc<Mutex<State>>,
    pub addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl ScriptedControl {
    pub fn start(models: Vec<ModelStatus>) -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap(), models)
    }

    pub fn start_on(addr: SocketAddr, models: Vec<ModelStatus>) -> Self {
        let state = Arc::new(Mutex::new(State {
            models: models.into_iter().map(|m| (m.name.clone(), m)).collect(),
            revision: 1,
            ..Default::default()
        }));
        let mut c = ScriptedControl {
            state,
            addr,
            runtime: None,
        };
        c.serve();
        c
    }

    fn serve(&mut self) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        // The old port may linger briefly after a kill.
        let mut tries = 0;
        let listener = loop {
            match std::net::TcpListener::bind(self.addr) {
                Ok(l) => break l,
                Err(_) if tries < 250 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => panic!("bind {}: {e}", self.addr),
            }
        };
        listener.set_nonblocking(true).unwrap();
        self.addr = listener.local_addr().unwrap();
        self.state.lock().unwrap().started_unix_ms = now_ms();
        let svc = Svc(self.state.clone());
        rt.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            tonic::transport::Server::builder()
                .add_service(ControlServer::new(svc))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        self.runtime = Some(rt);
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Drops every connection and the listener at once, like a crash.
    pub fn kill(&mut self) {
        let mut s = self.state.lock().unwrap();
        s.watchers.clear();
        drop(s);
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }

    /// Serves again on the same address, as a new process.
    pub fn restart(&mut self) {
        self.kill();
        self.serve();
    }

    /// Changes (or adds) a model and publishes the event.
    pub fn set(&self, m: ModelStatus) {
        let mut s = self.state.lock().unwrap();
        s.revision += 1;
        let ev = WatchEvent {
            revision: s.revision,
            at_unix_ms: now_ms(),
            control_id: "scripted".into(),
            kind: Some(watch_event::Kind::Model(m.clone())),
        };
        s.models.insert(m.name.clone(), m);
        s.watchers.retain(|w| w.try_send(Ok(ev.clone())).is_ok());
    }

    /// Sends every watcher a heartbeat (at the interval set in
    /// `heartbeat_ms`).
    pub fn beat(&self) {
        let mut s = self.state.lock().unwrap();
        let ev = heartbeat(s.revision, s.heartbeat_ms.expect("heartbeat_ms set"));
        s.watchers.retain(|w| w.try_send(Ok(ev.clone())).is_ok());
    }

    /// Changes a model without telling watchers (as if the event was missed).
    pub fn set_quietly(&self, m: ModelStatus) {
        let mut s = self.state.lock().unwrap();
        s.revision += 1;
        s.models.insert(m.name.clone(), m);
    }

    pub fn demands(&self) -> Vec<DemandRequest> {
        self.state.lock().unwrap().demands.clone()
    }

    pub fn reports(&self) -> Vec<ReportActivityRequest> {
        self.state.lock().unwrap().reports.clone()
    }
}

impl Drop for ScriptedControl {
    fn drop(&mut self) {
        self.kill();
    }
}

fn heartbeat(revision: u64, interval_ms: u32) -> WatchEvent {
    WatchEvent {
        revision,
        at_unix_ms: now_ms(),
        control_id: "scripted".into(),
        kind: Some(watch_event::Kind::Heartbeat(Heartbeat { interval_ms })),
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A model status with the fields the proxy reads.
pub fn model(name: &str, state: ModelState, endpoints: &[&str]) -> ModelStatus {
    ModelStatus {
        name: name.into(),
        model: format!("org/{name}"),
        state: state as i32,
        state_since_unix_ms: now_ms(),
        endpoints: endpoints
            .iter()
            .map(|u| Endpoint {
                url: (*u).into(),
                served_model_name: name.into(),
            })
            .collect(),
        hold: Some(HoldPolicy {
            max_queue: 8,
            max_hold_ms: 20_000,
        }),
        sleep_level: if state == ModelState::Asleep { 1 } else { 0 },
        ..Default::default()
    }
}
