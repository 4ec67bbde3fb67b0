//! Proxy fences: before an engine is CUDA-checkpointed, every live proxy
//! must have confirmed that it forwards nothing more to the model and has
//! nothing in flight to it (a request reaching a checkpointed vLLM engine
//! core killed it on an H200).
//!
//! Each proxy reports, per model, the `state_since` of the non-serving state
//! it has applied (`ModelActivity.fenced_since_unix_ms`) with its in-flight
//! count, and reports at least every second (a heartbeat), so control knows
//! which proxies are alive. A suspend waits until every proxy heard from in
//! the last [`PROXY_LIVE`] has fenced the model at or after the suspend's
//! own state and has nothing in flight to it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// A proxy not heard from for this long is gone (it reports every second).
pub const PROXY_LIVE: Duration = Duration::from_secs(5);
/// How long a suspend waits for every proxy's confirmation.
pub const FENCE_TIMEOUT: Duration = Duration::from_secs(10);
/// A daemon just started has not heard every proxy's heartbeat yet.
pub const STARTUP_GRACE: Duration = Duration::from_secs(2);

/// What one proxy last said of one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Seen {
    /// `state_since` of the non-serving state it applied (0: it forwards).
    fenced_since_unix_ms: i64,
    in_flight: u32,
}

#[derive(Debug, Default)]
struct Proxy {
    at: Option<Instant>,
    models: HashMap<String, Seen>,
}

/// One model's line of a proxy's report.
#[derive(Debug, Clone)]
pub struct FenceReport<'a> {
    pub model: &'a str,
    pub fenced_since_unix_ms: i64,
    pub in_flight: u32,
}

/// Every proxy's latest fences.
#[derive(Debug)]
pub struct Fences {
    proxies: Mutex<HashMap<String, Proxy>>,
    changed: Notify,
    started: Instant,
}

impl Default for Fences {
    fn default() -> Self {
        Fences {
            proxies: Mutex::default(),
            changed: Notify::new(),
            started: Instant::now(),
        }
    }
}

impl Fences {
    /// Records one report of `proxy` (an empty one is a heartbeat).
    pub fn report(&self, proxy: &str, models: &[FenceReport<'_>]) {
        let now = Instant::now();
        let mut all = self.proxies.lock().unwrap();
        all.retain(|_, p| p.at.is_some_and(|at| now - at < PROXY_LIVE * 4));
        let p = all.entry(proxy.to_string()).or_default();
        p.at = Some(now);
        for m in models {
            let seen = Seen {
                fenced_since_unix_ms: m.fenced_since_unix_ms,
                in_flight: m.in_flight,
            };
            match p.models.get_mut(m.model) {
                Some(s) => *s = seen,
                None => {
                    p.models.insert(m.model.to_string(), seen);
                }
            }
        }
        drop(all);
        self.changed.notify_waiters();
    }

    /// The live proxies that have not yet confirmed `model` fenced since
    /// `since_unix_ms` with nothing in flight: `(proxy, why)`.
    pub fn unconfirmed(&self, model: &str, since_unix_ms: i64) -> Vec<(String, String)> {
        let now = Instant::now();
        if now - self.started < STARTUP_GRACE {
            let why = "not heard yet: control started less than 2 s ago".to_string();
            return vec![("(every proxy)".to_string(), why)];
        }
        let all = self.proxies.lock().unwrap();
        let mut out: Vec<(String, String)> = all
            .iter()
            .filter(|(_, p)| p.at.is_some_and(|at| now - at < PROXY_LIVE))
            .filter_map(|(id, p)| {
                let seen = p.models.get(model).copied().unwrap_or_default();
                let why = if seen.fenced_since_unix_ms < since_unix_ms {
                    "has not confirmed it stopped forwarding".to_string()
                } else if seen.in_flight > 0 {
                    format!("has {} request(s) in flight", seen.in_flight)
                } else {
                    return None;
                };
                Some((id.clone(), why))
            })
            .collect();
        out.sort();
        out
    }

    /// Waits until every live proxy has fenced `model` (see the module
    /// note); the error names the proxies that did not within `timeout`.
    pub async fn wait_fenced(
        &self,
        model: &str,
        since_unix_ms: i64,
        timeout: Duration,
    ) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            let changed = self.changed.notified();
            let pending = self.unconfirmed(model, since_unix_ms);
            if pending.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let who: Vec<String> = pending
                    .iter()
                    .map(|(id, why)| format!("proxy {id} {why}"))
                    .collect();
                return Err(format!(
                    "not every proxy stopped forwarding to {model} within {} s: {} \
                     (a proxy older than this control plane never confirms: upgrade it; \
                     a stuck one: restart it)",
                    timeout.as_secs(),
                    who.join("; ")
                ));
            }
            // A report, or a proxy going quiet (re-checked every 250 ms).
            let _ = tokio::time::timeout_at(
                deadline.min(Instant::now() + Duration::from_millis(250)),
                changed,
            )
            .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence(model: &str, since: i64, in_flight: u32) -> FenceReport<'_> {
        FenceReport {
            model,
            fenced_since_unix_ms: since,
            in_flight,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn waits_for_every_live_proxy_and_forgets_silent_ones() {
        let f = Fences::default();
        // Just started: proxies have not had the time to say they exist.
        assert_eq!(f.unconfirmed("m", 1000).len(), 1);
        tokio::time::advance(STARTUP_GRACE).await;
        // No proxy: nothing can forward, nothing to wait for.
        assert_eq!(
            f.wait_fenced("m", 1000, Duration::from_secs(1)).await,
            Ok(())
        );

        f.report("a", &[fence("m", 0, 0)]);
        f.report("b", &[]);
        let pending = f.unconfirmed("m", 1000);
        assert_eq!(pending.len(), 2, "{pending:?}");
        // A fence of an earlier state does not count.
        f.report("a", &[fence("m", 999, 0)]);
        assert_eq!(f.unconfirmed("m", 1000).len(), 2);
        // Fenced but a request still in flight.
        f.report("a", &[fence("m", 1000, 1)]);
        f.report("b", &[fence("m", 1200, 0)]);
        let pending = f.unconfirmed("m", 1000);
        assert_eq!(pending.len(), 1);
        assert!(pending[0].1.contains("1 request(s) in flight"));
        let err = f
            .wait_fenced("m", 1000, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(err.contains("proxy a has 1 request(s) in flight"), "{err}");

        // The request ends while a suspend waits.
        let waiter = f.wait_fenced("m", 1000, Duration::from_secs(5));
        let report = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            f.report("a", &[fence("m", 1000, 0)]);
        };
        let (r, ()) = tokio::join!(waiter, report);
        assert_eq!(r, Ok(()));

        // A proxy that stopped reporting is not waited for.
        f.report("b", &[fence("m", 0, 0)]);
        assert_eq!(f.unconfirmed("m", 1000).len(), 1);
        tokio::time::advance(PROXY_LIVE).await;
        f.report("a", &[]);
        assert!(f.unconfirmed("m", 1000).is_empty());
    }
}
