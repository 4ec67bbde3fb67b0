//! Watching control planes: one task per `--control` value, which resolves a
//! host name to its addresses (re-resolved periodically) and keeps one Watch
//! stream per address, reconnecting with jittered, capped backoff and
//! resuming from the last revision seen.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use siesta_proto::v1::control_client::ControlClient;
use siesta_proto::v1::{GetInfoRequest, WatchRequest};
use tokio_util::sync::CancellationToken;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::Error;
use crate::route_table::{RouteTable, SourceId};

/// A control plane client carrying the bearer token, if any.
pub type Client = ControlClient<InterceptedService<Channel, Auth>>;

/// Adds `authorization: Bearer TOKEN` to every call.
#[derive(Clone, Debug)]
pub struct Auth(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// Clients of every watched control plane address, for Demand and activity.
#[derive(Debug)]
pub struct Controls {
    auth: Auth,
    clients: Mutex<HashMap<SourceId, Client>>,
}

impl Controls {
    pub fn new(token: Option<&str>) -> Result<Self, Error> {
        let auth = match token {
            Some(t) => Some(
                format!("Bearer {t}")
                    .parse::<MetadataValue<Ascii>>()
                    .map_err(|_| Error::Config("token is not valid header text".into()))?,
            ),
            None => None,
        };
        Ok(Controls {
            auth: Auth(auth),
            clients: Mutex::new(HashMap::new()),
        })
    }

    pub fn client(&self, source: &SourceId) -> Option<Client> {
        self.clients.lock().unwrap().get(source).cloned()
    }

    /// Every control plane address with a client.
    pub fn sources(&self) -> Vec<SourceId> {
        self.clients.lock().unwrap().keys().cloned().collect()
    }

    pub(crate) fn connect(&self, source: &SourceId) -> Result<Client, Error> {
        let ep = Endpoint::from_shared(source.to_string())
            .map_err(|e| Error::ControlUrl {
                url: source.to_string(),
                reason: e.to_string(),
            })?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        let client = ControlClient::with_interceptor(ep.connect_lazy(), self.auth.clone());
        self.clients
            .lock()
            .unwrap()
            .insert(source.clone(), client.clone());
        Ok(client)
    }

    fn forget(&self, source: &SourceId) {
        self.clients.lock().unwrap().remove(source);
    }
}

/// A parsed `--control` value.
#[derive(Debug, Clone)]
pub struct ControlUrl {
    pub url: String,
    pub host: String,
    pub port: u16,
}

impl ControlUrl {
    pub fn parse(url: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::ControlUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let with_scheme = if url.contains("://") {
            url.to_owned()
        } else {
            format!("http://{url}")
        };
        let uri: http::Uri = with_scheme.parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("only http:// is supported"));
        }
        let host = uri.host().ok_or_else(|| bad("no host"))?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Ok(ControlUrl {
            url: url.to_owned(),
            host,
            port: uri.port_u16().unwrap_or(50051),
        })
    }

    fn source_for(&self, addr: SocketAddr) -> SourceId {
        Arc::from(format!("http://{addr}"))
    }
}

/// Shared pieces every watch task needs.
#[derive(Debug, Clone)]
pub struct WatchCtx {
    pub table: Arc<RouteTable>,
    pub controls: Arc<Controls>,
    pub proxy_id: String,
    pub resolve_interval: Duration,
}

/// Watches one `--control` value until `shutdown`.
pub async fn run_control(ctx: WatchCtx, url: ControlUrl, shutdown: CancellationToken) {
    if let Ok(ip) = url.host.parse::<IpAddr>() {
        let addr = SocketAddr::new(ip, url.port);
        watch_source(ctx, url.url.clone(), url.source_for(addr), shutdown).await;
        return;
    }
    let mut running: BTreeMap<SocketAddr, (SourceId, CancellationToken)> = BTreeMap::new();
    let mut failures = 0u32;
    loop {
        let wait = match tokio::net::lookup_host((url.host.as_str(), url.port)).await {
            Ok(addrs) => {
                failures = 0;
                let addrs: std::collections::BTreeSet<SocketAddr> = addrs.collect();
                for (addr, (source, token)) in std::mem::take(&mut running) {
                    if addrs.contains(&addr) {
                        running.insert(addr, (source, token));
                    } else {
                        tracing::info!(control = %url.url, %addr, "control plane address gone");
                        token.cancel();
                        ctx.table.remove_source(&source);
                        ctx.controls.forget(&source);
                    }
                }
                for addr in addrs {
                    running.entry(addr).or_insert_with(|| {
                        let source = url.source_for(addr);
                        tracing::info!(control = %url.url, %addr, "watching control plane address");
                        let token = shutdown.child_token();
                        tokio::spawn(watch_source(
                            ctx.clone(),
                            url.url.clone(),
                            source.clone(),
                            token.clone(),
                        ));
                        (source, token)
                    });
                }
                ctx.resolve_interval
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(control = %url.url, error = %e, "cannot resolve control plane");
                backoff(failures).min(ctx.resolve_interval)
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// Jittered exponential backoff: 100 ms doubling to 5 s, times 0.5–1.0.
pub fn backoff(attempt: u32) -> Duration {
    let base = 100u64.saturating_mul(1u64 << attempt.min(6)).min(5_000);
    let jitter: f64 = rand::Rng::random_range(&mut rand::rng(), 0.5..=1.0);
    Duration::from_millis((base as f64 * jitter) as u64)
}

async fn watch_source(ctx: WatchCtx, group: String, source: SourceId, shutdown: CancellationToken) {
    let mut client = match ctx.controls.connect(&source) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(control = %source, error = %e, "cannot watch control plane");
            return;
        }
    };
    let mut attempt = 0u32;
    let mut incarnation: Option<(String, i64)> = None;
    loop {
        let session = watch_once(
            &ctx,
            &group,
            &source,
            &mut client,
            &mut incarnation,
            &mut attempt,
        );
        let res = tokio::select! {
            r = session => r,
            _ = shutdown.cancelled() => break,
        };
        match res {
            Ok(()) => tracing::warn!(control = %source, "watch stream ended; reconnecting"),
            Err(status) if status.code() == tonic::Code::Unauthenticated => tracing::error!(
                control = %source, error = %status.message(),
                "control plane refused this proxy's token: pass the control plane's token with --token or SIESTA_TOKEN"
            ),
            Err(status) => tracing::warn!(
                control = %source, code = ?status.code(), error = %status.message(),
                "control plane unreachable; serving from the last table"
            ),
        }
        attempt = attempt.saturating_add(1);
        tokio::select! {
            _ = tokio::time::sleep(backoff(attempt)) => {}
            _ = shutdown.cancelled() => break,
        }
    }
    ctx.controls.forget(&source);
}

async fn watch_once(
    ctx: &WatchCtx,
    group: &str,
    source: &SourceId,
    client: &mut Client,
    incarnation: &mut Option<(String, i64)>,
    attempt: &mut u32,
) -> Result<(), tonic::Status> {
    let mut since = ctx.table.revision(source);
    // A restarted control plane starts a new revision history: resync.
    match tokio::time::timeout(Duration::from_secs(5), client.get_info(GetInfoRequest {})).await {
        Ok(Ok(info)) => {
            let info = info.into_inner();
            let now = (info.control_id.clone(), info.started_unix_ms);
            if incarnation.as_ref() != Some(&now) || info.revision < since {
                since = 0;
            }
            ctx.table
                .set_identity(source, (group.to_owned(), now.0.clone(), now.1));
            *incarnation = Some(now);
        }
        Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {}
        Ok(Err(s)) => return Err(s),
        Err(_) => return Err(tonic::Status::deadline_exceeded("GetInfo timed out")),
    }
    let req = WatchRequest {
        since_revision: since,
        client_id: ctx.proxy_id.clone(),
    };
    let mut stream = client.watch(req).await?.into_inner();
    let mut first = true;
    while let Some(ev) = stream.message().await? {
        if first {
            first = false;
            *attempt = 0;
            tracing::info!(control = %source, since_revision = since, "watching control plane");
        }
        ctx.table.apply(source, ev);
    }
    Ok(())
}
