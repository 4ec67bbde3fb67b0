//! Watching control planes: one task per `--control` value, which resolves a
//! host name to its addresses (re-resolved periodically) and keeps one Watch
//! stream per address, reconnecting with jittered, capped backoff and
//! resuming from the last revision seen.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use siesta_proto::v1::control_client::ControlClient;
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
    /// Counts the Watch streams lost (`watch_lost`).
    pub metrics: Arc<crate::metrics::Metrics>,
}

/// How long the models of a control plane address that left DNS stay
/// routable while no other address of the same `--control` has synced: a
/// control plane pod restarted with a new address is not "every model
/// removed" (held requests would get 404 and new ones too, for engines
/// that still serve).
pub const GONE_GRACE: Duration = Duration::from_secs(30);

/// While an address that left DNS is kept, how often to check whether
/// another address has synced.
const GONE_CHECK: Duration = Duration::from_millis(250);

/// While an address that left DNS is kept, how often to look the name up
/// (at most; `resolve_interval` if shorter): its control plane back at a
/// new address must be found, and synced, within [`GONE_GRACE`]. At the
/// usual `resolve_interval` (30 s, the grace itself) the new address was
/// found only as the grace ran out, and the models went (404) until it
/// synced.
const GONE_LOOKUP: Duration = Duration::from_secs(1);

/// The watches of one `--control` host name: one per address it resolves to,
/// and the addresses gone whose models are still routed.
#[derive(Debug, Default)]
struct Addresses {
    running: BTreeMap<SocketAddr, (SourceId, CancellationToken)>,
    /// Left DNS: watch stopped, models kept a while.
    gone: Vec<Gone>,
}

/// An address that left DNS.
#[derive(Debug)]
struct Gone {
    source: SourceId,
    since: tokio::time::Instant,
}

impl Addresses {
    /// Watches the addresses new in `addrs`, stops those not in it.
    fn resolved(
        &mut self,
        ctx: &WatchCtx,
        url: &ControlUrl,
        addrs: std::collections::BTreeSet<SocketAddr>,
        shutdown: &CancellationToken,
    ) {
        for (addr, (source, token)) in std::mem::take(&mut self.running) {
            if addrs.contains(&addr) {
                self.running.insert(addr, (source, token));
            } else {
                tracing::info!(control = %url.url, %addr, "control plane address gone; its models stay routed until a new address syncs");
                token.cancel();
                ctx.controls.forget(&source);
                self.gone.push(Gone {
                    source,
                    since: tokio::time::Instant::now(),
                });
            }
        }
        for addr in addrs {
            self.running.entry(addr).or_insert_with(|| {
                let source = url.source_for(addr);
                tracing::info!(control = %url.url, %addr, "watching control plane address");
                // An address back in DNS is watched afresh.
                self.gone.retain(|g| g.source != source);
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
    }

    /// Forgets a gone address once every model it had is served by
    /// another synced source (its control plane back at a new address,
    /// synced), or after [`GONE_GRACE`]. Other boxes behind the same name
    /// (a headless Service over a DaemonSet), synced before or new, serve
    /// other models: they are no replacement for it.
    fn settle(&mut self, table: &RouteTable) {
        if self.gone.is_empty() {
            return;
        }
        let view = table.view();
        self.gone.retain(|g| {
            let replaced = view
                .by_name
                .values()
                .filter(|r| r.sources.contains(&g.source))
                .all(|r| r.sources.iter().any(|s| *s != g.source && table.synced(s)));
            let keep = !replaced && g.since.elapsed() < GONE_GRACE;
            if !keep {
                table.remove_source(&g.source);
            }
            keep
        });
    }
}

/// Watches one `--control` value until `shutdown`.
pub async fn run_control(ctx: WatchCtx, url: ControlUrl, shutdown: CancellationToken) {
    let lookup = |host: String, port: u16| async move {
        tokio::net::lookup_host((host.as_str(), port))
            .await
            .map(Iterator::collect)
    };
    run_resolving(ctx, url, shutdown, lookup).await;
}

/// [`run_control`], its host name looked up by `lookup`.
async fn run_resolving<F, Fut>(
    ctx: WatchCtx,
    url: ControlUrl,
    shutdown: CancellationToken,
    mut lookup: F,
) where
    F: FnMut(String, u16) -> Fut,
    Fut: std::future::Future<Output = std::io::Result<std::collections::BTreeSet<SocketAddr>>>,
{
    if let Ok(ip) = url.host.parse::<IpAddr>() {
        let addr = SocketAddr::new(ip, url.port);
        watch_source(ctx, url.url.clone(), url.source_for(addr), shutdown).await;
        return;
    }
    let mut addresses = Addresses::default();
    let mut failures = 0u32;
    let mut next_lookup = tokio::time::Instant::now();
    loop {
        if tokio::time::Instant::now() >= next_lookup {
            let wait = match lookup(url.host.clone(), url.port).await {
                Ok(addrs) => {
                    failures = 0;
                    addresses.resolved(&ctx, &url, addrs, &shutdown);
                    ctx.resolve_interval
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(control = %url.url, error = %e, "cannot resolve control plane");
                    backoff(failures).min(ctx.resolve_interval)
                }
            };
            next_lookup = tokio::time::Instant::now() + wait;
        }
        addresses.settle(&ctx.table);
        let now = tokio::time::Instant::now();
        let until = if addresses.gone.is_empty() {
            next_lookup
        } else {
            next_lookup = next_lookup.min(now + GONE_LOOKUP);
            next_lookup.min(now + GONE_CHECK)
        };
        tokio::select! {
            _ = tokio::time::sleep_until(until) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// Longest wait before a control plane is called again (before jitter).
/// Held requests wait for the `awake` event, which only a Watch stream
/// brings: with 5 s, a proxy reconnected up to 5 s after a restarted
/// control plane was serving again (its held requests 3.5 s later than
/// the other replica's, in a test of two). One call a second per proxy is
/// nothing to a control plane.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Jittered exponential backoff: 100 ms doubling to [`BACKOFF_MAX`], times
/// 0.5–1.0.
pub fn backoff(attempt: u32) -> Duration {
    let base = 100u64
        .saturating_mul(1u64 << attempt.min(6))
        .min(BACKOFF_MAX.as_millis() as u64);
    let jitter: f64 = rand::Rng::random_range(&mut rand::rng(), 0.5..=1.0);
    Duration::from_millis((base as f64 * jitter) as u64)
}

mod session;
use session::watch_source;

#[cfg(test)]
mod tests {

    /// The backoff grows from 50–100 ms and never waits past a second.
    #[test]
    fn backoff_grows_and_is_capped_at_a_second() {
        for _ in 0..100 {
            let first = backoff(0);
            assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
            for attempt in [4, 10, 1000, u32::MAX] {
                let b = backoff(attempt);
                assert!(b >= BACKOFF_MAX / 2 && b <= BACKOFF_MAX, "{attempt}: {b:?}");
            }
        }
    }
    use siesta_proto::v1::{ModelState, WatchEvent};

    use super::*;
    use crate::activity::Activity;
    use crate::route_table::tests::status;

    fn snapshot() -> WatchEvent {
        crate::route_table::tests::snapshot(1, vec![status("m", ModelState::Asleep, &[])])
    }

    fn setup() -> (WatchCtx, ControlUrl, Addresses, SourceId) {
        let ctx = WatchCtx {
            table: Arc::new(RouteTable::new(Arc::new(Activity::default()))),
            controls: Arc::new(Controls::new(None).unwrap()),
            proxy_id: "p".into(),
            resolve_interval: Duration::from_secs(30),
            metrics: Default::default(),
        };
        let url = ControlUrl::parse("http://control.example:50051").unwrap();
        let old: SocketAddr = "127.0.0.1:50051".parse().unwrap();
        let source = url.source_for(old);
        ctx.table.apply(&source, snapshot());
        let mut addresses = Addresses::default();
        addresses
            .running
            .insert(old, (source.clone(), CancellationToken::new()));
        (ctx, url, addresses, source)
    }

    /// A control plane restarted at a new address (a pod's new IP): its
    /// models stay routed (held requests keep waiting, engines keep being
    /// served) until the new address has synced, not 404 in between.
    #[tokio::test]
    async fn a_gone_address_keeps_its_models_until_another_address_syncs() {
        let (ctx, url, mut addresses, old) = setup();
        let shutdown = CancellationToken::new();
        // Nothing listens there: its watch retries in the background.
        let new: SocketAddr = "127.0.0.2:9".parse().unwrap();
        addresses.resolved(&ctx, &url, [new].into(), &shutdown);
        addresses.settle(&ctx.table);
        assert!(ctx.table.view().by_name.contains_key("m"));
        assert_eq!(addresses.gone.len(), 1);
        ctx.table.apply(&url.source_for(new), snapshot());
        addresses.settle(&ctx.table);
        assert!(addresses.gone.is_empty());
        assert!(!ctx.table.synced(&old), "the old address is forgotten");
        let view = ctx.table.view();
        assert_eq!(*view.by_name["m"].sources, [url.source_for(new)]);
        shutdown.cancel();
    }

    /// One `--control` name for several boxes (a headless Service over a
    /// DaemonSet): a box whose control plane leaves DNS (its pod
    /// restarting) keeps its models routed; another box that was synced
    /// all along is no replacement for it (its models got 404 at once,
    /// held requests too). A new address that then syncs is.
    #[tokio::test(start_paused = true)]
    async fn a_gone_address_is_not_replaced_by_another_box_synced_before() {
        let (ctx, url, mut addresses, old) = setup();
        let shutdown = CancellationToken::new();
        let other: SocketAddr = "127.0.0.3:9".parse().unwrap();
        let other_source = url.source_for(other);
        ctx.table.apply(
            &other_source,
            crate::route_table::tests::snapshot(1, vec![status("n", ModelState::Asleep, &[])]),
        );
        addresses
            .running
            .insert(other, (other_source, CancellationToken::new()));
        addresses.resolved(&ctx, &url, [other].into(), &shutdown);
        addresses.settle(&ctx.table);
        assert!(ctx.table.view().by_name.contains_key("m"), "m kept");
        assert_eq!(addresses.gone.len(), 1);
        // A new box (scaled out, or another's pod rolled) is none either.
        let more: SocketAddr = "127.0.0.4:9".parse().unwrap();
        addresses.resolved(&ctx, &url, [other, more].into(), &shutdown);
        ctx.table.apply(
            &url.source_for(more),
            crate::route_table::tests::snapshot(1, vec![status("o", ModelState::Asleep, &[])]),
        );
        addresses.settle(&ctx.table);
        assert!(ctx.table.view().by_name.contains_key("m"), "m kept");
        assert_eq!(addresses.gone.len(), 1);
        // Its pod back at a new address, synced: that replaces it.
        let new: SocketAddr = "127.0.0.2:9".parse().unwrap();
        addresses.resolved(&ctx, &url, [other, more, new].into(), &shutdown);
        ctx.table.apply(&url.source_for(new), snapshot());
        addresses.settle(&ctx.table);
        assert!(addresses.gone.is_empty());
        assert!(!ctx.table.synced(&old));
        let view = ctx.table.view();
        assert_eq!(*view.by_name["m"].sources, [url.source_for(new)]);
        assert!(view.by_name.contains_key("n"));
        shutdown.cancel();
    }

    /// A control plane pod restarted at a new address, the proxy looking
    /// the name up every 30 s (the default), as long as the grace: once the
    /// old address has left DNS, the name is looked up every second, so
    /// the new address is watched (and can sync) well within the grace;
    /// before, it was found only as the grace ran out, and its models got
    /// 404 until it synced. Once nothing is kept, every 30 s again.
    #[tokio::test(start_paused = true)]
    async fn a_name_is_looked_up_often_while_an_address_that_left_it_is_kept() {
        let (mut ctx, _, _, _) = setup();
        ctx.table = Arc::new(RouteTable::new(Arc::new(Activity::default())));
        // Port 9: nothing listens, the watches retry in the background.
        let url = ControlUrl::parse("http://control.example:9").unwrap();
        let (old, new): (SocketAddr, SocketAddr) = (
            "127.0.0.1:9".parse().unwrap(),
            "127.0.0.2:9".parse().unwrap(),
        );
        let began = tokio::time::Instant::now();
        let lookups = Arc::new(Mutex::new(Vec::new()));
        let lookup = {
            let lookups = lookups.clone();
            move |_: String, _: u16| {
                let mut at = lookups.lock().unwrap();
                at.push(began.elapsed());
                // The pod's old address, then none (restarting), then its new one.
                let addrs = match at.len() {
                    1 => vec![old],
                    2 | 3 => vec![],
                    _ => vec![new],
                };
                std::future::ready(Ok(addrs.into_iter().collect()))
            }
        };
        let shutdown = CancellationToken::new();
        let table = ctx.table.clone();
        let run = tokio::spawn(run_resolving(ctx, url.clone(), shutdown.clone(), lookup));
        // The old address syncs; the new one does once it is watched.
        tokio::time::sleep(Duration::from_secs(1)).await;
        table.apply(&url.source_for(old), snapshot());
        while lookups.lock().unwrap().len() < 4 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(table.view().by_name.contains_key("m"), "kept meanwhile");
        table.apply(&url.source_for(new), snapshot());
        tokio::time::sleep(GONE_GRACE * 3).await;
        shutdown.cancel();
        run.await.unwrap();
        let at = lookups.lock().unwrap().clone();
        let secs = |i: usize| at[i].as_secs_f64().round() as u64;
        assert_eq!(
            (secs(0), secs(1), secs(2), secs(3)),
            (0, 30, 31, 32),
            "{at:?}"
        );
        // Replaced (a lookup already planned a second on may come): back
        // to the usual interval.
        let n = at.len();
        assert_eq!(secs(n - 1) - secs(n - 2), 30, "{at:?}");
        let view = table.view();
        assert_eq!(*view.by_name["m"].sources, [url.source_for(new)]);
    }

    /// With no other address, the gone one's models go after the grace.
    #[tokio::test(start_paused = true)]
    async fn a_gone_address_with_no_other_is_forgotten_after_the_grace() {
        let (ctx, url, mut addresses, _) = setup();
        addresses.resolved(&ctx, &url, [].into(), &CancellationToken::new());
        addresses.settle(&ctx.table);
        assert!(ctx.table.view().by_name.contains_key("m"));
        tokio::time::advance(GONE_GRACE).await;
        addresses.settle(&ctx.table);
        assert!(!ctx.table.view().by_name.contains_key("m"));
        assert!(addresses.gone.is_empty());
    }
}
