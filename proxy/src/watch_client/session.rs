//! One Watch stream of one control plane address: called, read until it
//! ends or falls silent, called again after a backoff, resuming from the
//! last revision seen.
//!
//! Silent means past its deadline ([`Patience`]): the first message
//! within 10 s; then, once the control plane has sent a heartbeat (the
//! proxy asks for them; older control planes send none and are waited for
//! without end, their connection's pings catching a dead one), three of
//! its intervals. A control plane whose runtime answers HTTP/2 pings but
//! whose event path is wedged (its fan-out task gone, its hub's lock held)
//! is so told from a quiet one.

use std::time::Duration;

use siesta_proto::patience::Patience;
use siesta_proto::v1::{GetInfoRequest, WatchRequest};
use tokio_util::sync::CancellationToken;

use super::{Client, WatchCtx, backoff};
use crate::metrics::WatchLostLabels;
use crate::route_table::SourceId;

pub(super) async fn watch_source(
    ctx: WatchCtx,
    group: String,
    source: SourceId,
    shutdown: CancellationToken,
) {
    let mut client = match ctx.controls.connect(&source) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(control = %source, error = %e, "cannot watch control plane");
            return;
        }
    };
    // Until its first snapshot, a model only it has is not a 404 yet.
    ctx.table.expect(&source);
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
        ctx.table.set_lost(&source, true);
        let reason = match &res {
            Ok(()) => "ended",
            Err(s) if s.code() == tonic::Code::DeadlineExceeded => "silent",
            Err(_) => "error",
        };
        ctx.metrics
            .watch_lost
            .get_or_create(&WatchLostLabels {
                control: source.clone(),
                reason,
            })
            .inc();
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
    // The run `since` is from: a control plane that restarted after
    // GetInfo answered resyncs rather than resuming after a revision of
    // its earlier run.
    let req = WatchRequest {
        since_revision: since,
        client_id: ctx.proxy_id.clone(),
        incarnation: incarnation.as_ref().map_or(0, |i| i.1),
        heartbeat: true,
    };
    let mut patience = Patience::default();
    let mut stream = match patience.within(client.watch(req)).await {
        Ok(stream) => stream?.into_inner(),
        Err(why) => return Err(silent(why)),
    };
    loop {
        let ev = match patience.within(stream.message()).await {
            Ok(ev) => ev?,
            Err(why) => return Err(silent(why)),
        };
        let Some(ev) = ev else { return Ok(()) };
        if patience.first() {
            *attempt = 0;
            ctx.table.set_lost(source, false);
            tracing::info!(control = %source, since_revision = since, "watching control plane");
        }
        if !patience.heard(&ev) {
            ctx.table.apply(source, ev);
        }
    }
}

/// The error a silent stream ends with (logged by the caller, which calls
/// Watch again after a backoff, resuming from the last revision).
fn silent(why: String) -> tonic::Status {
    tonic::Status::deadline_exceeded(format!("{why}; calling Watch again"))
}
