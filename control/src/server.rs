//! The daemon: binds the gRPC listener, starts the model tasks, serves
//! `siesta.v1.Control`, gRPC health and reflection, and shuts down cleanly.

use crate::admission::{Admission, AdmissionPolicy};
use crate::api::ControlService;
use crate::api::auth::BearerAuth;
use crate::api::watch::{WatchRoute, WatchSvc};
use crate::gpu_view::GpuView;
use crate::hub::{Body, Hub};
use crate::models::Models;
use crate::runner::{Shared, StopBound};
use crate::status::Clock;
use crate::store::Store;
use crate::supervisor::GpuLocks;
use crate::{Config, Error};
use siesta_proto::v1 as pb;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;

mod grpc;
mod liveness;
use grpc::WatchRuntime;

/// What names the gRPC address, for a bind that fails.
const LISTEN_KEY: &str = "[control] listen, or --listen";

/// How to serve, besides the configuration.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Overrides `[control] listen`.
    pub listen: Option<SocketAddr>,
    /// Stop every engine when the server shuts down (default: leave them).
    pub stop_engines_on_exit: bool,
    /// The configuration file (for `Reload` and `GetInfo`).
    pub config_path: Option<PathBuf>,
}

/// A bound, not yet running control plane.
#[derive(Debug)]
pub struct Server {
    config: Config,
    opts: ServeOptions,
    listener: TcpListener,
    local_addr: SocketAddr,
    token: Option<String>,
    store: Arc<Store>,
    /// `[control] web_listen`, bound.
    web: Option<TcpListener>,
    stop_bound: StopBound,
    /// Installed first thing in [`Server::bind`]: a SIGHUP during start-up
    /// (`systemctl reload` right after the start, or a harness that sends
    /// one once the address file is there) is a reload once serving, not
    /// the default action, which ends the process.
    hup: siesta_signal::ReloadSignal,
}

impl Server {
    /// Opens the state store and binds the listener (port 0 picks a free
    /// port). A non-loopback address without a token is refused.
    pub async fn bind(config: Config, opts: ServeOptions) -> Result<Server, Error> {
        let hup = siesta_signal::reload_signal()?;
        let addr = opts.listen.unwrap_or(config.control.listen);
        let token = config.token();
        if crate::config::needs_token(addr, token.as_deref()) {
            return Err(Error::TokenRequired(addr));
        }
        if let Some(problem) = config.unsendable_token() {
            return Err(crate::config::ConfigError {
                origin: config.origin.clone(),
                problems: vec![problem],
            }
            .into());
        }
        // A `host` no port can be picked on, named by file and key (as
        // `siesta config check` names it) before anything is opened.
        crate::supervisor::check_hosts(&config, |_| true)?;
        let state_dir = config.control.state_dir.clone();
        let store = tokio::task::spawn_blocking(move || Store::open(&state_dir))
            .await
            .map_err(|e| Error::StateDir {
                path: config.control.state_dir.clone(),
                source: std::io::Error::other(e),
            })??;
        let bind_error = |error| Error::Bind {
            addr,
            key: LISTEN_KEY,
            error,
        };
        let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let web = match config.control.web_listen {
            Some(a) => Some(crate::web::bind(a, token.as_deref()).await?),
            None => None,
        };
        let stop_bound = StopBound::for_models(&config.models);
        Ok(Server {
            config,
            opts,
            listener,
            local_addr,
            token,
            store,
            web,
            stop_bound,
            hup,
        })
    }

    /// The web listener's address, when `[control] web_listen` is set.
    pub fn web_addr(&self) -> Option<SocketAddr> {
        self.web.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The bearer token clients must send (`[control] token`, else
    /// `SIESTA_TOKEN`), if any: what an embedding process (`siesta up`)
    /// gives its own proxy and clients.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// How long [`Server::run`] may take to end once told to, stopping
    /// engines if asked (SIGKILL after each one's `stop_grace`): up to the
    /// longest model's end, as configured now (reloads included).
    pub fn stop_bound(&self) -> StopBound {
        self.stop_bound.clone()
    }

    /// Serves until `shutdown` is cancelled; then ends streams, and stops
    /// engines only with `stop_engines_on_exit`.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let Server {
            config,
            opts,
            listener,
            local_addr,
            token,
            store,
            web,
            stop_bound,
            hup,
        } = self;
        // Watch streams on threads of their own (see grpc.rs).
        let watch_rt = WatchRuntime::from_env()?;
        let state_dir = config.control.state_dir.clone();
        let clock = Clock::new();
        let hub = Hub::new(clock, 4096, 1024);
        // Items reach the subscribers through one task, next to the Watch
        // streams, not from inside each publishing reconciler.
        hub.spawn_fan_out(
            &watch_rt
                .as_ref()
                .map_or_else(tokio::runtime::Handle::current, WatchRuntime::handle),
        );
        // Every Watch event is encoded once, as it is published.
        crate::api::watch::install_encoder(&hub, config.control.control_id.clone());
        let cfg = config.clone();
        let recorded = recorded_gpus(&store);
        let limit = detect_limit(&config);
        let detect = tokio::time::timeout(
            limit,
            tokio::task::spawn_blocking(move || GpuView::detect(&cfg, &recorded)),
        );
        let Some(detected) = unless_shut_down(&shutdown, "GPU detection", detect).await else {
            return Ok(());
        };
        let gpus = Arc::new(
            detected
                .map_err(|_| Error::Startup(std::io::Error::other(detect_hung(&config, limit))))?
                .map_err(|e| {
                    Error::Startup(std::io::Error::other(format!("GPU detection: {e}")))
                })?,
        );
        // A model that can never fit its GPUs: refuse to start, as
        // `siesta config check` refuses the file, with the same message.
        if let Some(refusal) = gpus.refusal() {
            return Err(Error::Config(refusal));
        }
        hub.set_gpus(gpus.list_gpus(&[]));
        let shared = Arc::new(Shared {
            hub: hub.clone(),
            clock,
            locks: GpuLocks::default(),
            store: store.clone(),
            log_dir: state_dir.join("logs"),
            control_id: config.control.control_id.clone(),
            poll_every: Duration::from_secs(1),
            cuda_checkpoint: config
                .control
                .cuda_checkpoint
                .clone()
                .unwrap_or_else(crate::checkpoint::default_tool),
            stop_engines_on_exit: opts.stop_engines_on_exit,
            admission: Admission::start(
                gpus.clone(),
                hub.clone(),
                clock,
                AdmissionPolicy {
                    min_awake: config.control.min_awake,
                    yield_after: config.control.yield_after,
                },
                shutdown.child_token(),
            ),
            engine_idle_timeout: config.control.engine_idle_timeout,
            fences: Default::default(),
            stop_bound,
            ports: Default::default(),
        });
        let tasks = shutdown.child_token();
        let placed = gpus.placed();
        let recovery = crate::recovery::recover(&config, &placed, &store);
        let Some(adopted) = unless_shut_down(&shutdown, "recovery", recovery).await else {
            return Ok(());
        };
        let models = Arc::new(
            Models::start(&config, &placed, adopted, shared.clone(), tasks.clone())
                .map_err(Error::Startup)?,
        );
        hub.set_placement(gpus.placement(&models.list()));
        let service = ControlService {
            models: models.clone(),
            hub: hub.clone(),
            gpus,
            clock,
            control_id: config.control.control_id.clone(),
            started_unix_ms: clock.now_ms(),
            config_path: opts.config_path.clone().or(config.path.clone()),
            cancel: tasks.clone(),
            reload_lock: Default::default(),
        };
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<pb::control_server::ControlServer<ControlService>>()
            .await;
        // Health follows the Watch event path (a liveness probe's answer).
        tokio::spawn(liveness::follow(
            hub.clone(),
            health,
            vec![
                "",
                <pb::control_server::ControlServer<ControlService> as tonic::server::NamedService>::NAME,
            ],
            liveness::systemd_alive(),
            tasks.clone(),
        ));
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(|e| Error::Startup(std::io::Error::other(format!("gRPC reflection: {e}"))))?;
        tokio::spawn(publish_placement_changes(
            hub.clone(),
            service.gpus.clone(),
            models.clone(),
            tasks.clone(),
        ));
        let reload_lock = service.reload_lock.clone();
        tokio::spawn(reload_on_sighup(
            hup,
            models.clone(),
            reload_lock.clone(),
            service.config_path.clone(),
            tasks.clone(),
        ));
        if let Some(web) = web {
            crate::web::spawn(web, service.clone(), token.clone(), tasks.clone());
        }
        let auth = BearerAuth::new(token);
        let watch = WatchSvc::new(
            hub.clone(),
            &service.control_id,
            service.started_unix_ms,
            service.cancel.clone(),
        );
        let control = InterceptedService::new(
            WatchRoute::new(pb::control_server::ControlServer::new(service), watch),
            move |req| auth.check(req),
        );
        let routes = tonic::service::Routes::new(health_service)
            .add_service(reflection)
            .add_service(control);
        tracing::info!(addr = %local_addr, models = config.models.len(), origin = %config.origin, "serving");
        // Under systemd (`Type=notify`): started. Nothing without it.
        if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
            tracing::warn!(error = %e, "cannot tell systemd the daemon is ready");
        }
        grpc::serve(
            listener,
            routes,
            grpc::Exec::new(watch_rt.as_ref().map(WatchRuntime::handle)),
            tasks.clone(),
        )
        .await;
        tasks.cancel();
        hub.close();
        // A reload under way ends first (it starts nothing once cancelled):
        // a model task it added after the join's list would be left out,
        // and its engine with it.
        let reloaded = reload_lock.lock().await;
        models.join().await;
        drop(reloaded);
        // The models' last calibration records are not waited for when
        // written: durable before the process ends.
        store.flush().await;
        drop(watch_rt);
        tracing::info!("stopped");
        Ok(())
    }
}

/// A start-up step (GPU detection and the P2P probe, recovery waiting on
/// adopted engines' answers and on stops) ends early on shutdown: a SIGTERM
/// then is not kept waiting. Nothing has been started yet; a recovery cut
/// short runs again at the next start.
async fn unless_shut_down<T>(
    shutdown: &CancellationToken,
    step: &'static str,
    run: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => {
            tracing::info!(step, "shutting down during start-up: {step} abandoned");
            None
        }
        done = run => Some(done),
    }
}

/// How long GPU detection may take at start-up: NVML's load and first read
/// (`gpu_detect_timeout`), and the P2P probe's own deadline where it runs.
fn detect_limit(config: &Config) -> Duration {
    let probe = &config.control.p2p_probe;
    let probing = probe.at_start && config.models.iter().any(|m| m.gpus > 0);
    let probing = if probing {
        probe.timeout
    } else {
        Duration::ZERO
    };
    config.control.gpu_detect_timeout + probing
}

/// Why the daemon gives up when GPU detection does not finish: the call
/// left hanging is NVML's (a GPU off the bus, a driver stuck in a reset),
/// whose thread cannot be stopped, only left behind by the exit.
fn detect_hung(config: &Config, limit: Duration) -> String {
    format!(
        "GPU detection (loading NVML, reading the GPUs{}) did not finish within {}: \
         NVML or a GPU is hung; see nvidia-smi and the kernel log for Xid errors \
         ([control] gpu_detect_timeout is {})",
        if limit > config.control.gpu_detect_timeout {
            ", the P2P probe"
        } else {
            ""
        },
        humantime::format_duration(limit),
        humantime::format_duration(config.control.gpu_detect_timeout),
    )
}

/// Where the engines a previous control plane left were placed: start-up
/// placement keeps them there where it still fits, so recovery finds their
/// command unchanged and adopts them (placed afresh, a model may land on
/// other GPUs than its running engine's, and that engine would be stopped).
fn recorded_gpus(store: &Store) -> BTreeMap<String, Vec<u32>> {
    let recorded = store.engine_gpus();
    if !recorded.is_empty() {
        tracing::info!(engines = ?recorded, "placing recorded engines on their GPUs where they still fit");
    }
    recorded
}

/// SIGHUP re-reads the configuration file, as the `Reload` RPC does.
async fn reload_on_sighup(
    mut hup: siesta_signal::ReloadSignal,
    models: Arc<Models>,
    lock: Arc<tokio::sync::Mutex<()>>,
    path: Option<PathBuf>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = hup.recv() => {}
        }
        let Some(path) = &path else {
            tracing::warn!(
                "SIGHUP: running the built-in configuration: there is no file to reload"
            );
            continue;
        };
        let _guard = lock.lock().await;
        if let Err(e) = models.reload_file(path).await {
            tracing::error!(path = %path.display(), error = %e, "SIGHUP: configuration refused; the running one stays in force");
        }
    }
}

/// How often the placement is republished with no model change, for the
/// memory processes siesta does not run hold (NVML), which comes and goes
/// on its own.
const OTHERS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Placement budgets follow the models' states: republish them (the hub
/// drops unchanged ones) whenever a model's status changes, and with NVML
/// every [`OTHERS_EVERY`].
async fn publish_placement_changes(
    hub: Arc<Hub>,
    gpus: Arc<GpuView>,
    models: Arc<Models>,
    cancel: CancellationToken,
) {
    let Some(mut sub) = hub.subscribe(hub.revision()) else {
        return;
    };
    let mut others = tokio::time::interval(OTHERS_EVERY);
    others.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let nvml = gpus.reads_nvml();
    loop {
        let item = tokio::select! {
            _ = cancel.cancelled() => return,
            item = sub.next() => item,
            _ = others.tick(), if nvml => {
                hub.set_placement(gpus.placement(&models.list()));
                continue;
            }
        };
        // A resync snapshot (this task fell behind and was cut off) stands for
        // changes it never saw: republish as for a model's change.
        let changed = |b: &Body| {
            matches!(
                b,
                Body::Model(_) | Body::ModelRemoved(_) | Body::Snapshot(_)
            )
        };
        match item.map(|i| changed(&i.body)) {
            None => return,
            Some(true) => {
                // GPU memory per engine moves with sleep and wake too.
                let list = models.list();
                hub.set_gpus(gpus.list_gpus(&list));
                hub.set_placement(gpus.placement(&list));
            }
            Some(false) => {}
        }
    }
}
