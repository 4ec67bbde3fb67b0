//! The `siesta.v1.Control` gRPC service: converts messages and calls
//! [`Models`], the [`Hub`] and the [`GpuView`]; no logic of its own.

pub mod auth;
pub mod convert;
mod errors;
pub mod watch;
pub mod wire;

use crate::OpError;
use crate::gpu_view::GpuView;
use crate::hub::Hub;
use crate::models::{Activity, Models};
use crate::reconciler::Command;
use crate::status::Clock;
use futures::Stream;
use siesta_proto::v1 as pb;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

type Stream_<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The service implementation.
#[derive(Debug, Clone)]
pub struct ControlService {
    pub models: Arc<Models>,
    pub hub: Arc<Hub>,
    pub gpus: Arc<GpuView>,
    pub clock: Clock,
    pub control_id: String,
    pub started_unix_ms: i64,
    pub config_path: Option<PathBuf>,
    /// Ends streams at shutdown.
    pub cancel: CancellationToken,
    /// Serialises reloads.
    pub reload_lock: Arc<Mutex<()>>,
}

fn op(a: crate::models::Answer) -> Response<pb::OperationResponse> {
    Response::new(pb::OperationResponse {
        model: Some(convert::model_status(&a.status)),
        message: a.message,
        warning: a.warning.unwrap_or_default(),
    })
}

#[tonic::async_trait]
impl pb::control_server::Control for ControlService {
    async fn get_info(
        &self,
        _: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::ControlInfo>, Status> {
        Ok(Response::new(pb::ControlInfo {
            control_id: self.control_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_unix_ms: self.started_unix_ms,
            config_path: self
                .config_path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            revision: self.hub.revision(),
        }))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let (models, revision) = self.hub.models();
        Ok(Response::new(pb::ListModelsResponse {
            models: models.iter().map(convert::model_status).collect(),
            revision,
        }))
    }

    async fn get_model(
        &self,
        req: Request<pb::GetModelRequest>,
    ) -> Result<Response<pb::GetModelResponse>, Status> {
        let status = self.models.status(&req.get_ref().name)?;
        let placement = self
            .gpus
            .placement_of(std::slice::from_ref(&status))
            .models
            .into_iter()
            .find(|p| p.model == status.name)
            .map(|p| convert::model_placement(&p))
            .unwrap_or_else(|| pb::ModelPlacement {
                model: status.name.clone(),
                gpus: status.gpus.clone(),
                reason: if status.gpus.is_empty() {
                    "needs no GPU".into()
                } else {
                    "pinned or first GPUs".into()
                },
                ..Default::default()
            });
        Ok(Response::new(pb::GetModelResponse {
            model: Some(convert::model_status(&status)),
            placement: Some(placement),
        }))
    }

    async fn list_gpus(
        &self,
        _: Request<pb::ListGpusRequest>,
    ) -> Result<Response<pb::ListGpusResponse>, Status> {
        let list = self.gpus.list_gpus(&self.models.list());
        Ok(Response::new(convert::gpu_list(&list)))
    }

    async fn get_placement(
        &self,
        _: Request<pb::GetPlacementRequest>,
    ) -> Result<Response<pb::GetPlacementResponse>, Status> {
        let report = self.gpus.placement(&self.models.list());
        Ok(Response::new(convert::placement(&report)))
    }

    async fn wake(
        &self,
        req: Request<pb::WakeRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        let r = req.into_inner();
        let timeout = (r.timeout_ms > 0).then(|| Duration::from_millis(r.timeout_ms));
        let a = self.models.wake(&r.name, r.wait, timeout).await?;
        Ok(op(a))
    }

    async fn sleep(
        &self,
        req: Request<pb::SleepRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        let r = req.into_inner();
        let level = convert::sleep_level(r.level)?;
        let a = self.models.command(&r.name, Command::Sleep(level)).await?;
        Ok(op(a))
    }

    async fn suspend(
        &self,
        req: Request<pb::ModelRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        let a = self
            .models
            .command(&req.get_ref().name, Command::Suspend)
            .await?;
        Ok(op(a))
    }

    async fn start(
        &self,
        req: Request<pb::ModelRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        let a = self
            .models
            .command(&req.get_ref().name, Command::Start)
            .await?;
        Ok(op(a))
    }

    async fn stop(
        &self,
        req: Request<pb::ModelRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        let a = self
            .models
            .command(&req.get_ref().name, Command::Stop)
            .await?;
        Ok(op(a))
    }

    async fn restart(
        &self,
        req: Request<pb::ModelRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        let a = self
            .models
            .command(&req.get_ref().name, Command::Restart)
            .await?;
        Ok(op(a))
    }

    async fn pin(
        &self,
        req: Request<pb::PinRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        let r = req.into_inner();
        let a = match r.for_ms {
            0 => self.models.pin(&r.name, r.until_unix_ms).await?,
            ms => {
                self.models
                    .pin_for(&r.name, Duration::from_millis(ms))
                    .await?
            }
        };
        Ok(op(a))
    }

    async fn unpin(
        &self,
        req: Request<pb::ModelRequest>,
    ) -> Result<Response<pb::OperationResponse>, Status> {
        let a = self.models.unpin(&req.get_ref().name).await?;
        Ok(op(a))
    }

    type WatchStream = Stream_<pb::WatchEvent>;

    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let r = req.into_inner();
        let sub = watch::subscribe(&self.hub, &r, self.started_unix_ms)?;
        let control_id = self.control_id.clone();
        let cancel = self.cancel.clone();
        let stream = futures::stream::unfold((sub, cancel), move |(mut sub, cancel)| {
            let control_id = control_id.clone();
            async move {
                let item = tokio::select! {
                    _ = cancel.cancelled() => None,
                    item = sub.next() => item,
                }?;
                Some((Ok(convert::watch_event(&item, &control_id)), (sub, cancel)))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn demand(
        &self,
        req: Request<pb::DemandRequest>,
    ) -> Result<Response<pb::DemandResponse>, Status> {
        let r = req.into_inner();
        let (s, accepted, message) = self.models.demand(&r.model).await?;
        tracing::debug!(model = %r.model, proxy = %r.proxy_id, queued = r.queued, accepted, "demand");
        Ok(Response::new(pb::DemandResponse {
            model: Some(convert::model_status(&s)),
            accepted,
            message,
        }))
    }

    async fn report_activity(
        &self,
        req: Request<pb::ReportActivityRequest>,
    ) -> Result<Response<pb::ReportActivityResponse>, Status> {
        let r = req.into_inner();
        let reports: Vec<Activity> = r
            .models
            .iter()
            .map(|a| Activity {
                model: a.model.clone(),
                started: a.started,
                finished: a.finished,
                in_flight: a.in_flight,
                held: a.held,
                last_finished_unix_ms: a.last_finished_unix_ms,
                fenced_since_unix_ms: a.fenced_since_unix_ms,
            })
            .collect();
        self.models.activity(&r.proxy_id, &reports);
        for f in &r.failures {
            tracing::warn!(proxy = %r.proxy_id, model = %f.model, url = %f.url, error = %f.error, "proxy reports an endpoint failure");
            self.models
                .endpoint_refused(&r.proxy_id, &f.model, &f.url, &f.error);
        }
        Ok(Response::new(pb::ReportActivityResponse {}))
    }

    type LogsStream = Stream_<pb::LogLine>;

    async fn logs(
        &self,
        req: Request<pb::LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let r = req.into_inner();
        let ring = self.models.logs(&r.name)?;
        let (lines, feed) = ring.tail(r.tail.map(|n| n as usize));
        let first = futures::stream::iter(lines.into_iter().map(|l| Ok(convert::log_line(&l))));
        if !r.follow {
            return Ok(Response::new(Box::pin(first)));
        }
        // A follow ends with an error saying why, never as if done: the
        // client's `logs -f` exited 0 when the daemon stopped or a reload
        // replaced the engine, and a script could not tell.
        let state = (feed, self.cancel.clone(), r.name);
        let rest = futures::stream::unfold(Some(state), |state| async move {
            let (mut feed, cancel, name) = state?;
            loop {
                let next = tokio::select! {
                    _ = cancel.cancelled() => return Some((Err(OpError::ShuttingDown.into()), None)),
                    n = feed.recv() => n,
                };
                match next {
                    Ok(l) => return Some((Ok(convert::log_line(&l)), Some((feed, cancel, name)))),
                    // Dropped lines show as gaps in `seq`.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        let why = format!(
                            "the log of \"{name}\" ended: a reload replaced or removed its engine \
                             (follow it again)"
                        );
                        return Some((Err(OpError::Refused(why).into()), None));
                    }
                }
            }
        });
        use futures::StreamExt;
        Ok(Response::new(Box::pin(first.chain(rest))))
    }

    async fn diag_p2p(
        &self,
        req: Request<pb::DiagP2pRequest>,
    ) -> Result<Response<pb::DiagP2pResponse>, Status> {
        let r = req.into_inner();
        // One probe runs at a time: one with a deadline of days would hold
        // every later one (and the start-up probe of a restart) that long.
        let max = crate::config::PROBE_TIMEOUT_MAX;
        if r.timeout_ms > max.as_millis() as u64 {
            return Err(OpError::invalid(
                "timeout_ms",
                format!(
                    "{} ms is more than the probe's longest deadline, {} (0: the configured `p2p_probe_timeout`)",
                    r.timeout_ms,
                    humantime::format_duration(max)
                ),
            )
            .into());
        }
        let resp = self
            .gpus
            .diag_p2p(
                r.bytes,
                Duration::from_millis(r.timeout_ms),
                self.clock.now_ms(),
            )
            .await;
        if resp.message.is_empty() {
            let models = self.models.list();
            self.hub.set_gpus(self.gpus.list_gpus(&models));
            self.hub.set_placement(self.gpus.placement(&models));
        }
        Ok(Response::new(convert::p2p_diag(&resp)))
    }

    async fn reload(
        &self,
        _: Request<pb::ReloadRequest>,
    ) -> Result<Response<pb::ReloadResponse>, Status> {
        let Some(path) = self.config_path.clone() else {
            return Err(OpError::Refused(
                "running the built-in configuration: there is no file to reload".into(),
            )
            .into());
        };
        // Its own task: a client that goes away (Ctrl-C, its deadline)
        // drops this future, and a reload cut short between stopping the
        // removed models and starting the added ones would leave both
        // undone, with nothing to say so.
        let (models, lock) = (self.models.clone(), self.reload_lock.clone());
        let s = tokio::spawn(async move {
            let _guard = lock.lock().await;
            models.reload_file(&path).await
        })
        .await
        .map_err(|e| OpError::Internal(format!("the reload task ended: {e}")))??;
        Ok(Response::new(pb::ReloadResponse {
            added: s.added,
            removed: s.removed,
            // Reconfigured models (engine kept) changed too.
            changed: [s.changed.clone(), s.reconfigured.clone()].concat(),
            unchanged: s.unchanged,
            not_applied: s.not_applied,
            restarted: s.changed,
            updated_in_place: s.reconfigured,
        }))
    }
}
