//! gRPC health follows the Watch event path.
//!
//! The daemon's runtime can answer TCP, HTTP/2 pings and gRPC calls while
//! its events have stopped: the hub's fan-out task died (a panic under the
//! hub's lock) or waits on that lock for ever. Watch clients see that as
//! missing heartbeats; this task lets a supervisor see it too. The fan-out
//! task makes a round at least every [`HEARTBEAT_EVERY`]; when none has
//! finished for [`STUCK_AFTER`], gRPC health (`grpc.health.v1`, for the
//! whole server and for `siesta.v1.Control`) says `NOT_SERVING`, and a
//! liveness probe (`deploy/kubernetes`: a gRPC probe) restarts the daemon,
//! which adopts its engines. Back to `SERVING` if the rounds come back.
//! Under systemd with `WatchdogSec=` the same verdict feeds the watchdog:
//! `WATCHDOG=1` is sent on each check while serving, none once stuck, so
//! systemd restarts the daemon (`deploy/systemd`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::hub::{HEARTBEAT_EVERY, Hub};

/// How long the fan-out may make no round before the daemon says it is
/// not serving: three heartbeats, as long as a Watch client waits.
pub const STUCK_AFTER: Duration = Duration::from_secs(HEARTBEAT_EVERY.as_secs() * 3);

/// How often the fan-out's last round is looked at.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// The health a fan-out silent for `silent_for` gives.
fn status(silent_for: Option<Duration>) -> ServingStatus {
    match silent_for {
        Some(d) if d > STUCK_AFTER => ServingStatus::NotServing,
        _ => ServingStatus::Serving,
    }
}

/// Tells systemd the daemon is alive (`WATCHDOG=1`), when it runs with a
/// watchdog (`WatchdogSec=`); nothing otherwise. A notify socket that
/// stops answering is warned of once, not on every check, and its return
/// is logged.
pub(super) fn systemd_alive() -> impl Fn() {
    let failing = AtomicBool::new(false);
    move || {
        notice(
            &failing,
            sd_notify::notify(&[sd_notify::NotifyState::Watchdog]),
        );
    }
}

/// What a check's notify result is worth saying, given whether the last
/// one failed.
#[derive(Debug, PartialEq, Eq)]
enum Notice {
    Quiet,
    Unreachable,
    Reachable,
}

fn notice(failing: &AtomicBool, sent: std::io::Result<()>) -> Notice {
    match sent {
        Err(e) if !failing.swap(true, Ordering::Relaxed) => {
            tracing::warn!(
                error = %e,
                "cannot reach systemd's notify socket (NOTIFY_SOCKET); its watchdog will \
                 restart the daemon if it has one. Said once until the socket answers again"
            );
            Notice::Unreachable
        }
        Ok(()) if failing.swap(false, Ordering::Relaxed) => {
            tracing::info!("systemd's notify socket answers again");
            Notice::Reachable
        }
        _ => Notice::Quiet,
    }
}

/// Keeps `services`' health (`""` is the whole server) in step with the
/// hub's fan-out until `cancel`, and calls `alive` on every check that
/// finds it serving (systemd's watchdog: [`systemd_alive`]).
pub(super) async fn follow(
    hub: Arc<Hub>,
    health: HealthReporter,
    services: Vec<&'static str>,
    alive: impl Fn(),
    cancel: CancellationToken,
) {
    let mut now = ServingStatus::Serving;
    // The first look a check's length after start-up (systemd hears
    // `READY=1` first).
    let mut every =
        tokio::time::interval_at(tokio::time::Instant::now() + CHECK_EVERY, CHECK_EVERY);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = cancel.cancelled() => return,
        }
        let silent = hub.fan_out_silent_for();
        let next = status(silent);
        if next == ServingStatus::Serving {
            alive();
        }
        if next == now {
            continue;
        }
        match next {
            ServingStatus::NotServing => tracing::error!(
                silent_for = ?silent.unwrap_or_default(),
                "the Watch event path made no round (events, heartbeats) for longer than {STUCK_AFTER:?}: \
                 gRPC health now says NOT_SERVING, so a liveness probe restarts the daemon"
            ),
            _ => {
                tracing::info!("the Watch event path makes rounds again: gRPC health says SERVING")
            }
        }
        for s in &services {
            health.set_service_status(s, next).await;
        }
        now = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Clock;
    use tonic_health::pb::health_server::Health;
    use tonic_health::pb::{HealthCheckRequest, health_check_response};

    async fn check(svc: &impl Health, service: &str) -> health_check_response::ServingStatus {
        let r = svc
            .check(tonic::Request::new(HealthCheckRequest {
                service: service.into(),
            }))
            .await
            .unwrap()
            .into_inner();
        r.status()
    }

    #[test]
    fn a_fan_out_silent_past_three_heartbeats_is_not_serving() {
        assert_eq!(status(None), ServingStatus::Serving);
        assert_eq!(status(Some(HEARTBEAT_EVERY)), ServingStatus::Serving);
        assert_eq!(status(Some(STUCK_AFTER)), ServingStatus::Serving);
        assert_eq!(
            status(Some(STUCK_AFTER + Duration::from_millis(1))),
            ServingStatus::NotServing
        );
    }

    #[test]
    fn an_unreachable_notify_socket_is_warned_of_once_until_it_answers() {
        let failing = AtomicBool::new(false);
        let err = || Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(notice(&failing, Ok(())), Notice::Quiet);
        assert_eq!(notice(&failing, err()), Notice::Unreachable);
        assert_eq!(notice(&failing, err()), Notice::Quiet);
        assert_eq!(notice(&failing, err()), Notice::Quiet);
        assert_eq!(notice(&failing, Ok(())), Notice::Reachable);
        assert_eq!(notice(&failing, Ok(())), Notice::Quiet);
        assert_eq!(notice(&failing, err()), Notice::Unreachable);
    }

    /// A fan-out task that dies (here: the hub's lock poisoned by a panic,
    /// as a bug under it would) stops its rounds; gRPC health then says
    /// NOT_SERVING for the server and for `siesta.v1.Control`. While the
    /// task lives, quiet or not, it says SERVING.
    #[tokio::test(start_paused = true)]
    async fn health_says_not_serving_once_the_event_path_stops() {
        let hub = Hub::new(Clock::new(), 16, 16);
        hub.spawn_fan_out(&tokio::runtime::Handle::current());
        let health = HealthReporter::new();
        let svc = tonic_health::server::HealthService::from_health_reporter(health.clone());
        let services = vec!["", "siesta.v1.Control"];
        for s in &services {
            health.set_service_status(s, ServingStatus::Serving).await;
        }
        let cancel = CancellationToken::new();
        let beats = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = beats.clone();
        let alive = move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        tokio::spawn(follow(
            hub.clone(),
            health,
            services.clone(),
            alive,
            cancel.clone(),
        ));
        let beats_now = || beats.load(std::sync::atomic::Ordering::Relaxed);
        // Quiet for a minute: heartbeat rounds keep it alive.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(hub.fan_out_silent_for().unwrap() <= HEARTBEAT_EVERY);
        for s in &services {
            assert_eq!(
                check(&svc, s).await,
                health_check_response::ServingStatus::Serving
            );
        }
        assert!(beats_now() >= 11, "alive on each check: {}", beats_now());
        hub.poison();
        tokio::time::sleep(STUCK_AFTER + HEARTBEAT_EVERY + CHECK_EVERY * 2).await;
        assert!(hub.fan_out_silent_for().unwrap() > STUCK_AFTER);
        // No more `alive` (systemd's watchdog then restarts the daemon).
        let stuck = beats_now();
        tokio::time::sleep(CHECK_EVERY * 4).await;
        assert_eq!(beats_now(), stuck, "alive while stuck");
        for s in &services {
            assert_eq!(
                check(&svc, s).await,
                health_check_response::ServingStatus::NotServing,
                "{s:?}"
            );
        }
        cancel.cancel();
    }
}
