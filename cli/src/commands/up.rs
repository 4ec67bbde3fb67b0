//! `siesta up`: control plane and proxy in one process until Ctrl-C. They
//! still talk gRPC over loopback, so the split stays real.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use siesta_control::config::Config;
use siesta_control::{ServeOptions, Server, StopBound};
use siesta_proto::v1 as pb;
use siesta_proxy::{Proxy, ProxyConfig};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::watch::{self, TextWatch};
use crate::args::{DEFAULT_CONTROL, UpArgs};
use crate::client::Conn;
use crate::failure::Failure;
use crate::render;

/// How long each half gets to finish after Ctrl-C: first the proxy (held
/// requests answered at once, those in flight finish on running engines),
/// then the control plane (engines stop), which gets at least its own
/// bound: each engine is SIGKILLed after its `stop_grace`, and `up` must
/// not exit before (an engine that ignores SIGTERM would keep its GPUs).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Beyond the control plane's bound: its gRPC server and tasks ending.
const CONTROL_MARGIN: Duration = Duration::from_secs(5);

/// How long requests in flight may take to finish after Ctrl-C.
const PROXY_DRAIN: Duration = Duration::from_secs(10);

/// `--token` (or SIESTA_TOKEN) is the token the control plane `up` runs
/// requires, where its configuration sets none; one that differs from the
/// file's `[control] token` is refused (neither could be the one meant).
/// It was taken only as the token to send: the control plane required
/// none, whatever `--token` said.
fn with_token(
    mut config: Config,
    token: Option<&str>,
    path: Option<&std::path::Path>,
) -> Result<Config, Failure> {
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return Ok(config);
    };
    match config.control.token.as_deref() {
        None => config.control.token = Some(token.to_owned()),
        Some(set) if set == token => {}
        Some(_) => {
            let file = path.map_or("the configuration".into(), |p| p.display().to_string());
            return Err(Failure::Usage(format!(
                "--token (or SIESTA_TOKEN) differs from [control] token in {file}: give one of them"
            )));
        }
    }
    Ok(config)
}

pub async fn run(args: &UpArgs, token: Option<&str>) -> Result<(), Failure> {
    // Serving does not depend on anyone reading what it prints.
    crate::out::keep_serving();
    // Ctrl-C or SIGTERM from the very start, not only once everything runs.
    let signal = siesta_signal::shutdown_signal().map_err(|e| Failure::Failed(e.to_string()))?;
    // The demo has no file to reload: a SIGHUP is its terminal gone (an SSH
    // session dropped), and it stops as at Ctrl-C. It went on serving,
    // unseen, holding its ports and engines. With `--config` a SIGHUP
    // reloads the file, as it does the daemon.
    let mut hangup = match &args.config {
        None => Some(siesta_signal::reload_signal().map_err(|e| Failure::Failed(e.to_string()))?),
        Some(_) => None,
    };
    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        let hung_up = async {
            match &mut hangup {
                Some(h) => h.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            signal = signal => tracing::info!(%signal, "shutting down"),
            () = hung_up => tracing::info!("SIGHUP (the terminal hung up): shutting down"),
        }
        on_signal.cancel();
    });
    let (config, config_path) = match &args.config {
        Some(path) => {
            let config = Config::load(path).map_err(|e| Failure::Failed(e.to_string()))?;
            (config, Some(path.clone()))
        }
        None => {
            let exe = std::env::current_exe()?;
            (
                Config::demo(vec![exe.to_string_lossy().into_owned(), "fake-vllm".into()]),
                None,
            )
        }
    };
    let config = with_token(config, token, args.config.as_deref())?;
    let state_dir = config.control.state_dir.clone();
    let opts = ServeOptions {
        listen: args.control_listen,
        stop_engines_on_exit: !args.keep_engines,
        config_path,
    };
    let server = Server::bind(config, opts)
        .await
        .map_err(|e| Failure::Failed(format!("siesta-control: {e}")))?;
    let grpc = server.local_addr();
    let web = server.web_addr();
    let stop_bound = server.stop_bound();
    // The token the control plane requires (the config's `[control] token`,
    // else `--token`, else SIESTA_TOKEN) is what its own proxy and clients
    // send.
    let token = server.token().map(str::to_owned);
    let token = token.as_deref();
    let control_url = format!("http://{}", loopback_for(grpc));
    let proxy = Proxy::bind(ProxyConfig {
        controls: vec![control_url.clone()],
        listen: args.listen,
        admin_listen: args.admin_listen,
        token: token.map(str::to_owned),
        // No wake will come for requests held at Ctrl-C: the control plane
        // stops right after the proxy.
        drain_timeout: PROXY_DRAIN,
        shed_held_on_shutdown: true,
        ..Default::default()
    })
    .map_err(|e| match e {
        // The proxy's own hint names its --reuse-port, which `up` has not.
        siesta_proxy::Error::AddrInUse { addr, .. } => Failure::Failed(format!(
            "siesta-proxy: cannot listen on {addr}: the address is already in use \
             (another siesta up or server holds it; pick another with --listen ADDR or \
             --admin-listen ADDR, port 0 for any free one)"
        )),
        e => Failure::Failed(format!("siesta-proxy: {e}")),
    })?;
    let (http, admin) = (proxy.local_addr(), proxy.admin_addr());

    let halves = Halves {
        stop_proxy: CancellationToken::new(),
        stop_control: CancellationToken::new(),
        stop_bound,
    };
    // Cancelled when the control plane's run ends, however it ends.
    let control_ended = CancellationToken::new();
    let mut control_task = tokio::spawn({
        let run = server.run(halves.stop_control.clone());
        let ended = control_ended.clone().drop_guard();
        async move {
            let _ended = ended;
            run.await
        }
    });
    let mut proxy_task = tokio::spawn(proxy.run(halves.stop_proxy.clone()));

    if let Some(path) = &args.addr_file
        && let Err(e) = write_addr_file(path, http, admin, grpc)
    {
        // Both halves are running: stop them (and the engines) before failing.
        shutdown.cancel();
        halves.stop(&mut proxy_task, &mut control_task).await;
        return Err(e);
    }
    match first_listing(&control_url, token, &control_ended, &shutdown).await {
        Listing::Ending => {}
        Listing::Models(models) => {
            print!(
                "{}",
                banner(
                    http,
                    admin,
                    web,
                    &control_url,
                    models.as_deref(),
                    args.config.as_deref()
                )
            );
            // What happens next, one line per change, so a model is seen waking.
            tokio::spawn(print_events(
                control_url.clone(),
                token.map(str::to_owned),
                models.is_some(),
                shutdown.child_token(),
            ));
        }
    }

    let outcome = tokio::select! {
        biased;
        _ = shutdown.cancelled() => Ok(()),
        r = &mut control_task => ended("siesta-control", r, &shutdown),
        r = &mut proxy_task => ended("siesta-proxy", r, &shutdown),
    };
    // A second Ctrl-C does not wait for the engines' stop grace.
    let again = siesta_signal::shutdown_signal().map_err(|e| Failure::Failed(e.to_string()))?;
    eprintln!(
        "siesta: shutting down{}",
        if args.keep_engines {
            " (engines left running; Ctrl-C again to exit now)"
        } else {
            " and stopping engines (Ctrl-C again to kill them now)"
        }
    );
    shutdown.cancel();
    tokio::select! {
        () = halves.stop(&mut proxy_task, &mut control_task) => outcome,
        _ = again => {
            if !args.keep_engines {
                kill_engines(&state_dir).await;
            }
            Err(Failure::Interrupted)
        }
    }
}

/// The second Ctrl-C: every engine this `up` started is SIGKILLed now.
async fn kill_engines(state_dir: &Path) {
    let (groups, left) = siesta_control::kill_engines_now(state_dir).await;
    if left.is_empty() {
        eprintln!("siesta: killed {groups} engine process group(s)");
    } else {
        eprintln!(
            "siesta: killed {groups} engine process group(s); pids {left:?} still there {} s after SIGKILL, holding their GPU memory until they go (a process stuck in the kernel: see `ps -o pid,stat,cmd -p PID` and nvidia-smi)",
            siesta_control::KILL_SWEEP_DEADLINE.as_secs()
        );
    }
}

/// Stops the two halves in order: the proxy first, so that requests in
/// flight finish on engines still running and held ones are answered; then
/// the control plane, which stops the engines.
struct Halves {
    stop_proxy: CancellationToken,
    stop_control: CancellationToken,
    /// The control plane's own bound on its end (reloads included).
    stop_bound: StopBound,
}

impl Halves {
    async fn stop<P, C>(&self, proxy: &mut JoinHandle<P>, control: &mut JoinHandle<C>) {
        self.stop_proxy.cancel();
        finish("siesta-proxy", proxy, SHUTDOWN_GRACE).await;
        self.stop_control.cancel();
        let grace = control_grace(self.stop_bound.get());
        finish("siesta-control", control, grace).await;
    }
}

/// What the control plane gets to stop: its bound (with a margin), at
/// least [`SHUTDOWN_GRACE`].
fn control_grace(bound: Duration) -> Duration {
    SHUTDOWN_GRACE.max(bound + CONTROL_MARGIN)
}

/// Waits (within `grace`) for a half that was told to stop.
async fn finish<T>(what: &str, task: &mut JoinHandle<T>, grace: Duration) {
    // A half that ended early was already awaited: never poll it again.
    if task.is_finished() {
        return;
    }
    if tokio::time::timeout(grace, task).await.is_err() {
        eprintln!(
            "siesta: {what} took longer than {} to stop; going on",
            render::duration(grace.as_millis() as u64)
        );
    }
}

/// The models, for the banner (none if the control plane is slow to answer).
/// What the banner can say about the models.
enum Listing {
    /// Listed, or `None`: the control plane does not serve yet.
    Models(Option<Vec<pb::ModelStatus>>),
    /// Ctrl-C came first, or the control plane already ended (it refused
    /// its configuration, say): no banner, the reason comes next.
    Ending,
}

/// The models as the control plane lists them, unless it ends or Ctrl-C
/// comes first. A failed listing waits up to [`ENDING_GRACE`] for the
/// control plane's end: the call fails at once when its listener closes,
/// a moment before its task has finished.
async fn first_listing(
    control_url: &str,
    token: Option<&str>,
    control_ended: &CancellationToken,
    shutdown: &CancellationToken,
) -> Listing {
    let models = tokio::select! {
        m = list_models(control_url, token) => m,
        _ = shutdown.cancelled() => return Listing::Ending,
        _ = control_ended.cancelled() => return Listing::Ending,
    };
    if models.is_none() {
        tokio::select! {
            _ = shutdown.cancelled() => return Listing::Ending,
            _ = control_ended.cancelled() => return Listing::Ending,
            _ = tokio::time::sleep(ENDING_GRACE) => {}
        }
    }
    Listing::Models(models)
}

/// How long a failed first listing waits to see whether the control plane
/// is ending (see [`first_listing`]).
const ENDING_GRACE: Duration = Duration::from_millis(500);

async fn list_models(control_url: &str, token: Option<&str>) -> Option<Vec<pb::ModelStatus>> {
    let conn = Conn::connect(control_url, token).await.ok()?;
    conn.call_within(Duration::from_secs(5), |mut c| async move {
        c.list_models(pb::ListModelsRequest {}).await
    })
    .await
    .map(|r| r.models)
    .ok()
}

/// Prints model changes as `siesta watch` does, until shutdown.
///
/// The control plane may take a while before it serves (GPU detection, a
/// P2P probe of many GPUs, recovering the last run's engines): the Watch
/// is kept patiently ([`watch::follow`]). `listed`: the banner listed the
/// models, so the first snapshot is not printed (a later one, after a
/// break that lost history, is).
async fn print_events(
    control_url: String,
    token: Option<String>,
    mut listed: bool,
    shutdown: CancellationToken,
) {
    let conn = match Conn::connect(&control_url, token.as_deref()).await {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("siesta: model changes will not be shown: {e}");
            return;
        }
    };
    let mut text = TextWatch::changes_only();
    let how = watch::Follow {
        client_id: "siesta up",
        patient: true,
        say: false,
    };
    let followed = watch::follow(&conn, how, |ev| {
        let lines = text.lines(&ev);
        let print = match ev.kind {
            Some(pb::watch_event::Kind::Model(_) | pb::watch_event::Kind::ModelRemoved(_)) => true,
            Some(pb::watch_event::Kind::Snapshot(_)) => !std::mem::replace(&mut listed, false),
            _ => false,
        };
        if print {
            for line in lines {
                println!("{line}");
            }
        }
        Ok(())
    });
    tokio::select! {
        _ = shutdown.cancelled() => {}
        r = followed => {
            if let Err(e) = r {
                eprintln!("siesta: model changes will not be shown: {e}");
            }
        }
    }
}

/// One half ended before Ctrl-C: that is a failure unless shutdown had begun.
fn ended<E: std::fmt::Display>(
    what: &str,
    r: Result<Result<(), E>, tokio::task::JoinError>,
    shutdown: &CancellationToken,
) -> Result<(), Failure> {
    let why = match r {
        Ok(Ok(())) if shutdown.is_cancelled() => return Ok(()),
        Ok(Ok(())) => "finished early".to_owned(),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    Err(Failure::Failed(format!("{what} stopped: {why}")))
}

/// A wildcard listen address is reached on loopback.
fn loopback_for(addr: SocketAddr) -> SocketAddr {
    let mut a = addr;
    if a.ip().is_unspecified() {
        a.set_ip(if a.is_ipv4() {
            [127, 0, 0, 1].into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    }
    a
}

/// `http=IP:PORT\nadmin=IP:PORT\ngrpc=IP:PORT\n`, written to PATH.tmp then renamed.
fn write_addr_file(
    path: &Path,
    http: SocketAddr,
    admin: SocketAddr,
    grpc: SocketAddr,
) -> Result<(), Failure> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let failed = |e: std::io::Error| {
        Failure::Failed(format!(
            "cannot write the address file {}: {e} (check that its directory exists and is writable)",
            path.display()
        ))
    };
    std::fs::write(&tmp, format!("http={http}\nadmin={admin}\ngrpc={grpc}\n")).map_err(failed)?;
    std::fs::rename(&tmp, path).map_err(failed)?;
    Ok(())
}

/// What `siesta up` prints once both halves listen.
pub fn banner(
    http: SocketAddr,
    admin: SocketAddr,
    web: Option<SocketAddr>,
    control_url: &str,
    models: Option<&[pb::ModelStatus]>,
    config: Option<&Path>,
) -> String {
    let http = loopback_for(http);
    let source = match config {
        Some(p) => format!("config {}", p.display()),
        None => "built-in demo: fake-vllm engines, no GPU needed".into(),
    };
    let mut o = format!("siesta is up ({source})\n\n");
    o += &format!("  OpenAI API   http://{http}/v1\n");
    o += &format!("  metrics      http://{}/metrics\n", loopback_for(admin));
    o += &format!("  control      {control_url} (gRPC)\n");
    if let Some(web) = web {
        o += &format!("  status page  http://{}/\n", loopback_for(web));
    }
    match models {
        Some([]) => {}
        Some(models) => {
            let list: Vec<String> = models
                .iter()
                .map(|m| format!("{} ({})", m.name, render::state_label(m)))
                .collect();
            o += &format!("  models       {}\n", list.join(", "));
        }
        None => {
            o += "  models       listed below once siesta-control serves (it is still starting: \
               detecting GPUs, probing P2P, or adopting the last run's engines)\n";
        }
    }
    let model = models
        .and_then(<[_]>::first)
        .map_or("MODEL", |m| m.name.as_str());
    let flag = if control_url == DEFAULT_CONTROL {
        String::new()
    } else {
        format!(" --control {control_url}")
    };
    o += "\nTry, in another terminal:\n";
    o += &format!(
        "  curl -s http://{http}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n"
    );
    o += &format!(
        "  siesta{flag} status\n  siesta{flag} watch\n  siesta{flag} top\n\nCtrl-C stops everything.\n"
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn banner_has_api_curl_and_status() {
        let m = pb::ModelStatus {
            name: "chat".into(),
            state: pb::ModelState::Asleep as i32,
            sleep_level: 1,
            ..Default::default()
        };
        let b = banner(
            "0.0.0.0:8080".parse().unwrap(),
            "127.0.0.1:9090".parse().unwrap(),
            Some("0.0.0.0:8081".parse().unwrap()),
            "http://127.0.0.1:50051",
            Some(&[m]),
            None,
        );
        assert!(b.contains("OpenAI API   http://127.0.0.1:8080/v1"), "{b}");
        assert!(b.contains("chat (asleep(l1))"), "{b}");
        assert!(b.contains("\"model\": \"chat\""), "{b}");
        assert!(b.contains("  siesta status\n"), "{b}");
        assert!(b.contains("status page  http://127.0.0.1:8081/\n"), "{b}");
        assert!(b.contains("  siesta top\n"), "{b}");
        let b = banner(
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
            None,
            "http://127.0.0.1:3",
            None,
            None,
        );
        assert!(
            b.contains("siesta --control http://127.0.0.1:3 status"),
            "{b}"
        );
        // A control plane still starting: its models come later.
        assert!(b.contains("listed below once siesta-control serves"), "{b}");
        assert!(b.contains("\"model\": \"MODEL\""), "{b}");
    }
}
