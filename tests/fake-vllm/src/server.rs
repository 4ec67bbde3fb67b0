//! The HTTP server: binds at once but listens only once start-up is done (like vLLM:
//! connections are refused until then), then routes requests; stops on the shutdown token,
//! taking the engine core down with it, or a few seconds after the engine core died.

use std::ffi::OsString;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cli::ServeArgs;
use crate::engine::{Engine, unix_ns};
use crate::engine_core::EngineCore;
use crate::http::{ApiError, Resp, detail, empty, json};
use crate::memory::{self, MemoryError};
use crate::sim_gpu::{SimGpu, SimGpuError};
use crate::{conn, dev, metrics, openai};

/// How long the server lives on after its engine core died (/health answers 503 meanwhile).
const EXIT_AFTER_ENGINE_DEATH: Duration = Duration::from_secs(2);

/// Why serving stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The socket could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// `host:port` as given.
        addr: String,
        /// The cause.
        source: std::io::Error,
    },
    /// `--exit-during-startup`.
    #[error(
        "Engine core initialization failed. See root cause above. (fault: --exit-during-startup)"
    )]
    StartupFailed,
    /// The memory backend could not be set up.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The simulated GPU has too little free memory.
    #[error("Engine core initialization failed. See root cause above. ({0})")]
    Gpu(#[from] SimGpuError),
    /// `VLLM_HTTP_TIMEOUT_KEEP_ALIVE` is not an integer (vLLM's `int()` raises when the
    /// server reads it).
    #[error("ValueError: invalid literal for int() with base 10: {0:?}")]
    KeepAlive(String),
    /// The engine core process died.
    #[error("Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.")]
    EngineDied,
}

impl ServeError {
    /// What vLLM leaves on stderr when its engine fails to start (its
    /// logger writes to stdout): the engine core's uncaught exception, then
    /// the API server's, whose last line only points above.
    pub fn print_traceback(&self) {
        let pid = std::process::id();
        // Python's `sock.bind` raising, as vLLM's API server ends on it.
        if let Self::Bind { source, .. } = self {
            let errno = source.raw_os_error().unwrap_or(0);
            let text = source.to_string();
            let text = text.split(" (os error").next().unwrap_or(&text);
            eprintln!("(APIServer pid={pid}) Traceback (most recent call last):");
            eprintln!("(APIServer pid={pid}) OSError: [Errno {errno}] {text}");
        }
        if let Self::Gpu(cause) = self {
            eprintln!("(EngineCore_DP0 pid={pid}) Traceback (most recent call last):");
            eprintln!("(EngineCore_DP0 pid={pid}) {cause}");
        }
        if matches!(self, Self::Gpu(_) | Self::StartupFailed) {
            eprintln!("(APIServer pid={pid}) Traceback (most recent call last):");
            eprintln!(
                "(APIServer pid={pid}) RuntimeError: Engine core initialization failed. See root \
                 cause above. Failed core proc(s): {{}}"
            );
        }
    }
}

/// State shared by every connection.
#[derive(Debug)]
pub struct App {
    /// The engine.
    pub engine: Engine,
    /// The engine-core child, if it could be spawned.
    pub core: Option<EngineCore>,
    /// `VLLM_SERVER_DEV_MODE`.
    pub dev_mode: bool,
    /// Start time (unix seconds) for `/v1/models`.
    pub created: u64,
    /// `--personality sglang`: memory tags offloaded (`/release_memory_occupation`).
    pub sglang_released: std::sync::atomic::AtomicBool,
    /// `--api-key` / `VLLM_API_KEY` (vLLM personality only): none, no check.
    pub api_keys: Vec<String>,
}

impl App {
    /// Counts a generation request; crashes on `--crash-after-requests`; refuses when the
    /// engine is "dead" (`--fail-health-after`).
    pub fn arrive(&self) -> Result<(), ApiError> {
        if crate::sglang::released(self) {
            crate::sglang::die(
                self,
                "CUDA error: an illegal memory access was encountered (a request while the memory is released)",
            );
        }
        self.engine
            .last_request_arrived_ns
            // Serving threads race (`--api-server-count`): keep the latest.
            .fetch_max(crate::engine::unix_ns(), Ordering::SeqCst);
        let n = self.engine.arrived.fetch_add(1, Ordering::SeqCst) + 1;
        if self
            .engine
            .args
            .faults
            .crash_after_requests
            .is_some_and(|limit| n > limit)
        {
            self.crash(n);
        }
        if !self.engine.healthy() {
            return Err(engine_dead());
        }
        if self.engine.shutting_down() {
            return Err(refused_in_shutdown());
        }
        Ok(())
    }

    /// A request is about to run: where a sleep freed the executor's memory under a running
    /// scheduler ([`crate::engine::Engine::executor_freed`]), the engine core dies of the CUDA
    /// error and the server with it, as for `--crash-after-requests`.
    pub fn run_request(&self) {
        if self.engine.executor_freed() {
            tracing::error!(
                "EngineCore encountered a fatal error: CUDA error: an illegal memory access \
                 was encountered (a request scheduled while the executor sleeps)"
            );
            if let Some(core) = &self.core {
                core.stop(Duration::ZERO);
            }
            std::process::exit(1);
        }
    }

    fn crash(&self, n: u64) -> ! {
        tracing::error!(
            request = n,
            "EngineCore encountered a fatal error (fault: --crash-after-requests)"
        );
        if let Some(core) = &self.core {
            core.stop(Duration::ZERO);
        }
        std::process::exit(1);
    }
}

/// What vLLM answers a request once its engine core is dead (`EngineDeadError`), new or
/// in flight when it died.
pub fn engine_dead() -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        kind: "EngineDeadError",
        message: "EngineCore encountered an issue. See stack trace (above) for the root cause."
            .into(),
        param: None,
    }
}

/// What vLLM 0.24 answered a generation request that reached it after its
/// SIGTERM (observed, `vllm-check sigterm`): the API server's thread pool,
/// which renders the prompt, is already shut down.
pub fn refused_in_shutdown() -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        kind: "InternalServerError",
        message: "cannot schedule new futures after shutdown".into(),
        param: None,
    }
}

/// Runs the server until `shutdown` is cancelled.
pub async fn serve(
    args: ServeArgs,
    argv: &[OsString],
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let keep_alive = keep_alive_from_env()?;
    let imitated = crate::version::Imitated::parse(&args.sim.imitate_version)
        .unwrap_or(crate::version::Imitated::PORT_NOT_SHARED);
    let reuse_port =
        imitated < crate::version::Imitated::PORT_NOT_SHARED || args.api_server_count > 1;
    let socket = bind_socket(&args.host, args.port, reuse_port)
        .await
        .map_err(|e| ServeError::Bind {
            addr: format!("{}:{}", args.host, args.port),
            source: e,
        })?;
    let port = socket.local_addr().map(|a| a.port()).unwrap_or(args.port);
    let version = args.sim.imitate_version.clone();
    tracing::info!(model = %args.model(), "vLLM API server version {version}");
    tracing::info!("Starting vLLM API server 0 on http://{}:{port}", args.host);
    let core = match EngineCore::spawn(
        argv,
        args.faults.engine_core_dies_with_parent,
        args.tensor_parallel_size,
    ) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(error = %e, "could not start the engine core process");
            None
        }
    };
    let memory = memory::from_settings(args.sim.gpu_memory)?;
    let host = args.host.clone();
    let api_keys = if args.personality == "vllm" {
        args.api_keys()
    } else {
        Vec::new()
    };
    let gpu = SimGpu::from_args(&args);
    let engine = Engine::new(args, memory, gpu);
    if let Some(pid) = core.as_ref().and_then(EngineCore::pid) {
        engine.gpu_holder.store(pid, Ordering::SeqCst);
    }
    let app = Arc::new(App {
        engine,
        core,
        dev_mode: dev::dev_mode_from_env(),
        created: unix_ns() / 1_000_000_000,
        sglang_released: std::sync::atomic::AtomicBool::new(false),
        api_keys,
    });
    let died = CancellationToken::new();
    tokio::spawn(watch_engine_core(
        app.clone(),
        died.clone(),
        shutdown.clone(),
    ));
    let started = tokio::select! {
        () = shutdown.cancelled() => Ok(false),
        () = died.cancelled() => Ok(false),
        r = startup(&app) => r.map(|()| true),
    };
    let started = match started {
        Ok(s) => s,
        Err(e) => {
            if let Some(core) = &app.core {
                core.stop(Duration::from_secs(2));
            }
            return Err(e);
        }
    };
    if started {
        let listener = socket.listen(2048).map_err(|e| ServeError::Bind {
            addr: format!("{host}:{port}"),
            source: e,
        })?;
        banner(&host, port);
        app.engine.set_ready();
        serve_until_shut_down(&app, listener, keep_alive, &shutdown, &died).await;
    }
    tracing::info!("Shutting down FastAPI HTTP server.");
    if let Some(core) = &app.core {
        core.stop(Duration::from_secs(2));
    }
    if died.is_cancelled() {
        return Err(ServeError::EngineDied);
    }
    app.engine.release_gpu();
    Ok(())
}

/// uvicorn's keep-alive: an idle connection is closed after `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`
/// seconds (vLLM's `envs.py`: `int(os.environ.get(.., "5"))`); `vllm serve` has no flag for
/// it. Python's `int()` takes surrounding blanks, a sign and `_` between digits; 0 or less
/// closes a connection after each response.
pub fn keep_alive_from_env() -> Result<Duration, ServeError> {
    let Ok(raw) = std::env::var("VLLM_HTTP_TIMEOUT_KEEP_ALIVE") else {
        return Ok(Duration::from_secs(5));
    };
    let t = raw.trim();
    let (neg, digits) = match t.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let well_formed = !digits.is_empty()
        && !digits.starts_with('_')
        && !digits.ends_with('_')
        && !digits.contains("__")
        && digits.chars().all(|c| c.is_ascii_digit() || c == '_');
    if !well_formed {
        return Err(ServeError::KeepAlive(raw));
    }
    let secs: u64 = digits.replace('_', "").parse().unwrap_or(u64::MAX);
    Ok(if neg {
        Duration::ZERO
    } else {
        Duration::from_secs(secs)
    })
}

/// Watches the engine core: once it is gone, /health answers 503 and, a moment later, the
/// server exits with an error, as vLLM's does.
async fn watch_engine_core(app: Arc<App>, died: CancellationToken, shutdown: CancellationToken) {
    let Some(core) = &app.core else { return };
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if shutdown.is_cancelled() {
            return;
        }
        if core.exited() {
            // A group-wide SIGTERM reaches the engine core and the server together.
            tokio::time::sleep(Duration::from_millis(200)).await;
            if shutdown.is_cancelled() {
                return;
            }
            break;
        }
    }
    app.engine.dead.store(true, Ordering::SeqCst);
    tracing::error!("Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.");
    died.cancel();
    tokio::time::sleep(EXIT_AFTER_ENGINE_DEATH).await;
    shutdown.cancel();
}

/// Binds like vLLM's `create_server_socket`: SO_REUSEADDR, SO_REUSEPORT as the imitated
/// version sets it (`reuse_port`: 0.24 always, 0.33 with several API servers; without it a
/// second engine on a taken port fails with "Address already in use", with it a second
/// engine that sets it too binds beside the first), and no `listen()` yet, so connections
/// are refused until start-up is done.
async fn bind_socket(
    host: &str,
    port: u16,
    reuse_port: bool,
) -> std::io::Result<tokio::net::TcpSocket> {
    let addr = tokio::net::lookup_host((host, port))
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(reuse_port)?;
    socket.bind(addr)?;
    Ok(socket)
}

async fn startup(app: &App) -> Result<(), ServeError> {
    let f = &app.engine.args.faults;
    if f.hang_on_startup {
        tracing::warn!("fault: --hang-on-startup, start-up never finishes");
        std::future::pending::<()>().await;
    }
    let gpu_bytes = app
        .engine
        .check_gpu()
        .inspect_err(|e| tracing::error!("{e}"))?;
    let others = app
        .engine
        .gpu_others()
        .inspect_err(|e| tracing::error!("{e}"))?;
    // vLLM's model runner says so after `init_device` took its memory snapshot.
    tracing::info!("Starting to load model {}...", app.engine.args.model());
    tokio::time::sleep(app.engine.args.sim.startup_time).await;
    if f.exit_during_startup {
        return Err(ServeError::StartupFailed);
    }
    // vLLM profiles its memory within start-up: memory another process freed meanwhile
    // fails its assertion.
    app.engine
        .profiled(&others)
        .inspect_err(|e| tracing::error!("{e}"))?;
    app.engine
        .take_gpu(gpu_bytes)
        .inspect_err(|e| tracing::error!("{e}"))?;
    Ok(())
}

fn banner(host: &str, port: u16) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "INFO:     Started server process [{}]",
        std::process::id()
    );
    let _ = writeln!(out, "INFO:     Waiting for application startup.");
    let _ = writeln!(out, "INFO:     Application startup complete.");
    let _ = writeln!(
        out,
        "INFO:     Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)"
    );
    let _ = out.flush();
}

/// How long connections get to finish their answers once the engine core
/// is gone (uvicorn's own shutdown waits for them without a bound).
const CONNECTIONS_CLOSE: Duration = Duration::from_secs(5);

/// Serves until SIGTERM (`shutdown`), then as vLLM 0.24 did (`vllm-check
/// sigterm`): the listener closes at once (new connections are refused),
/// idle connections close, each busy one ends after the answer it is
/// sending, while the engine core shuts down (see `engine/shutdown.rs`):
/// with `--shutdown-timeout 0` those answers are aborted, else they run on
/// for up to that long.
async fn serve_until_shut_down(
    app: &Arc<App>,
    listener: tokio::net::TcpListener,
    keep_alive: Duration,
    shutdown: &CancellationToken,
    died: &CancellationToken,
) {
    let (stop, conns) = (CancellationToken::new(), TaskTracker::new());
    let acceptor = tokio::spawn(accept(
        app.clone(),
        listener,
        keep_alive,
        stop.clone(),
        conns.clone(),
    ));
    shutdown.cancelled().await;
    // New requests are refused before the listener closes: a request whose
    // body completes once connections are refused must not start (CI saw
    // one slip between the two).
    if !died.is_cancelled() {
        app.engine.begin_shutdown(false);
    }
    stop.cancel();
    let _ = acceptor.await;
    if !died.is_cancelled() {
        let secs = app.engine.args.shutdown_timeout;
        tracing::info!(
            shutdown_timeout = secs,
            "Shutdown requested: draining in-flight requests"
        );
        if app.engine.shut_down(secs).await == crate::engine::Drained::TimedOut {
            tracing::warn!("Shutdown timeout reached: aborting requests still in flight");
        }
    }
    conns.close();
    if tokio::time::timeout(CONNECTIONS_CLOSE, conns.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after {CONNECTIONS_CLOSE:?}: closing them");
    }
}

async fn accept(
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    keep_alive: Duration,
    shutdown: CancellationToken,
    conns: TaskTracker,
) {
    loop {
        let (stream, peer) = tokio::select! {
            () = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        // vLLM (uvicorn) sets TCP_NODELAY; without it small responses wait
        // for the peer's delayed ACK.
        let _ = stream.set_nodelay(true);
        conns.spawn(conn::serve(
            app.clone(),
            stream,
            peer,
            keep_alive,
            shutdown.clone(),
        ));
    }
}

/// Whether the request says its body is JSON as vLLM's OpenAI routes require
/// (`validate_json_request`: lowercased, up to the first `;`, exactly
/// `application/json`: parameters after it, no space before them).
fn json_body(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.eq_ignore_ascii_case("application/json"))
}

/// vLLM's `AuthenticationMiddleware` (`--api-key`): with keys set, a request whose path starts
/// with `/v1` (`/v1models` too: a plain prefix) needs `Authorization: <scheme> <key>`, the
/// scheme `bearer` in any case and the key exactly one of them (what follows the first space,
/// spaces included). OPTIONS and every other path pass: `/health`, `/metrics`, `/version`
/// and the dev routes (`/sleep`, `/wake_up`, ...) need no key.
pub(crate) fn authorized(
    keys: &[String],
    method: &Method,
    path: &str,
    headers: &http::HeaderMap,
) -> bool {
    if keys.is_empty() || method == Method::OPTIONS || !path.starts_with("/v1") {
        return true;
    }
    let Some(value) = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    else {
        return false;
    };
    let (scheme, param) = value.split_once(' ').unwrap_or((value.as_str(), ""));
    scheme.eq_ignore_ascii_case("bearer") && keys.iter().any(|k| k == param)
}

/// Routes one request (and writes uvicorn's access-log line).
pub(crate) async fn handle(app: Arc<App>, req: Request<Incoming>, peer: SocketAddr) -> Resp {
    let (parts, body) = req.into_parts();
    let (method, uri) = (parts.method, parts.uri);
    let health = || {
        if app.engine.healthy() {
            empty(StatusCode::OK)
        } else {
            empty(StatusCode::SERVICE_UNAVAILABLE)
        }
    };
    let args = &app.engine.args;
    let body = if args.sglang() {
        // SGLang's own routes first; the vLLM-only ones are not SGLang's.
        match crate::sglang::route(app.clone(), &method, uri.path(), body).await {
            Ok(resp) => return access_log(resp, &method, &uri, peer),
            Err(body) => body,
        }
    } else {
        body
    };
    if !authorized(&app.api_keys, &method, uri.path(), &parts.headers) {
        // vLLM's `AuthenticationMiddleware`, before any route (and its JSON check) runs.
        let resp = json(StatusCode::UNAUTHORIZED, &json!({"error": "Unauthorized"}));
        return access_log(resp, &method, &uri, peer);
    }
    let vllm_only = matches!(uri.path(), "/version" | "/metrics")
        || (args.plain_openai() && uri.path() == "/ping");
    let generation = matches!(
        uri.path(),
        "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings"
    );
    if !(args.plain_openai() || args.sglang())
        && method == Method::POST
        && generation
        && !json_body(&parts.headers)
    {
        // vLLM's `validate_json_request` dependency, before the body is read.
        let resp = crate::http::error(
            StatusCode::BAD_REQUEST,
            "Bad Request",
            "Unsupported Media Type: Only 'application/json' is allowed",
            None,
        );
        return access_log(resp, &method, &uri, peer);
    }
    if (args.plain_openai() || args.sglang()) && vllm_only {
        let resp = detail(StatusCode::NOT_FOUND, "Not Found");
        return access_log(resp, &method, &uri, peer);
    }
    let resp = match (&method, uri.path()) {
        (&Method::GET, "/health") | (&Method::GET | &Method::POST, "/ping") => health(),
        (&Method::GET, "/version") => json(
            StatusCode::OK,
            &json!({"version": app.engine.args.sim.imitate_version}),
        ),
        (&Method::GET, "/v1/models") => openai::models(&app),
        (&Method::POST, "/v1/chat/completions") => openai::chat(app.clone(), body).await,
        (&Method::POST, "/v1/completions") => openai::completions(app.clone(), body).await,
        // Only pooling models (`--runner pooling`) have the route.
        (&Method::POST, "/v1/embeddings") if app.engine.args.pooling() => {
            openai::embeddings(app.clone(), body).await
        }
        (&Method::GET, "/metrics") => metrics::metrics(&app),
        (&Method::GET, "/fake/stats") => metrics::stats(&app),
        (&Method::GET, "/fake/verify") => metrics::verify(&app),
        (
            _,
            "/health"
            | "/ping"
            | "/version"
            | "/v1/models"
            | "/v1/chat/completions"
            | "/v1/completions"
            | "/metrics"
            | "/fake/stats",
        ) => detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed"),
        (_, "/v1/embeddings") if app.engine.args.pooling() => {
            detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed")
        }
        _ if app.dev_mode && args.personality == "vllm" => {
            match dev::route(app.clone(), &method, &uri, body).await {
                Some(r) => r,
                None => detail(StatusCode::NOT_FOUND, "Not Found"),
            }
        }
        _ => detail(StatusCode::NOT_FOUND, "Not Found"),
    };
    access_log(resp, &method, &uri, peer)
}

/// Writes uvicorn's access-log line for `resp` and returns it.
fn access_log(resp: Resp, method: &Method, uri: &http::Uri, peer: SocketAddr) -> Resp {
    let status = resp.status();
    // uvicorn's access log; a closed stdout must not take the request down.
    let _ = writeln!(
        std::io::stdout(),
        "INFO:     {peer} - \"{method} {uri} HTTP/1.1\" {} {}",
        status.as_u16(),
        status.canonical_reason().unwrap_or("")
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: Option<&str>) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        if let Some(a) = auth {
            h.insert(http::header::AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    /// `AuthenticationMiddleware`: only `/v1...` needs the key; the scheme is any case of
    /// `bearer`; the key must match exactly.
    #[test]
    fn api_keys_guard_v1_paths_only() {
        let keys = vec!["k1".to_string(), "k 2".to_string()];
        let post = Method::POST;
        for (path, auth, ok) in [
            ("/v1/completions", None, false),
            ("/v1/completions", Some("Bearer k1"), true),
            ("/v1/completions", Some("bearer k1"), true),
            ("/v1/completions", Some("BEARER k 2"), true),
            ("/v1/completions", Some("Bearer k1 "), false),
            ("/v1/completions", Some("Basic k1"), false),
            ("/v1/completions", Some("k1"), false),
            ("/v1/models", Some("Bearer nope"), false),
            ("/v1models", None, false),
            ("/health", None, true),
            ("/metrics", None, true),
            ("/sleep", None, true),
            ("/wake_up", None, true),
        ] {
            assert_eq!(
                authorized(&keys, &post, path, &headers(auth)),
                ok,
                "{path} {auth:?}"
            );
        }
        assert!(authorized(
            &keys,
            &Method::OPTIONS,
            "/v1/completions",
            &headers(None)
        ));
        assert!(authorized(&[], &post, "/v1/completions", &headers(None)));
    }
}
