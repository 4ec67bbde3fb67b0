//! An engine a proxy reports refusing connections while it is taken as
//! awake (vLLM closes its listener the moment it gets SIGTERM, whoever sent
//! it, and serves only the answers under way until it exits): the model's
//! task probes it at once and, while the probes fail, again every
//! [`QUICK_PROBE`] instead of every poll period, so the usual strikes (see
//! [`crate::reconciler::HEALTH_STRIKES`]) fail and restart it within about
//! a second rather than after three poll periods. A report of another URL
//! (an engine already replaced) or one that comes while the model is not
//! serving is noted and changes nothing; a probe that succeeds ends it.

use std::time::Duration;

use tokio::time::Instant;

use super::Runner;
use crate::reconciler::{Effect, Phase};

/// Between probes of an engine a proxy reported, while they fail.
pub const QUICK_PROBE: Duration = Duration::from_millis(200);
/// How long a report keeps the probes quick.
pub const SUSPECT_FOR: Duration = Duration::from_secs(5);

/// A proxy's report of an engine that refused a connection.
#[derive(Debug, Clone)]
pub struct Refused {
    /// The proxy.
    pub proxy: String,
    /// The engine's URL as the proxy had it from `Watch`.
    pub url: String,
    /// What the proxy saw.
    pub error: String,
}

impl Runner {
    /// A proxy's report: probe now if it is about the serving engine.
    pub(super) fn on_refused(&mut self, r: Refused) {
        let serving = matches!(self.state.phase, Phase::Awake | Phase::Yielding { .. });
        let same = r.url.trim_end_matches('/') == self.client.base().trim_end_matches('/');
        if !serving || !same {
            tracing::debug!(model = %self.cfg.name, proxy = %r.proxy, url = %r.url, serving, same, "endpoint failure report not about the serving engine");
            return;
        }
        let now = Instant::now();
        if self.suspect.is_none() {
            self.perform(Effect::Log(format!(
                "proxy {} reports the engine refused a connection ({}): probing it now, then \
                 every {} ms while it fails",
                r.proxy,
                r.error,
                QUICK_PROBE.as_millis()
            )));
        }
        let since = self.suspect.map_or(now, |(since, _)| since);
        self.suspect = Some((since, now + SUSPECT_FOR));
        if self.polling {
            // The probe under way may have begun before the refusal: its
            // answer does not clear the engine (see `after_probe`).
            return;
        }
        self.probe_soon = None;
        self.poll();
    }

    /// After a probe's result (`started`: when it began): the next one soon
    /// if it failed while the engine is suspect, at once if it began before
    /// the report; a success of one begun after it ends the suspicion.
    pub(super) fn after_probe(&mut self, ok: bool, started: Instant) {
        let now = Instant::now();
        let Some((since, until)) = self.suspect else {
            return;
        };
        if started < since && now < until {
            self.probe_soon = Some(now);
        } else if !ok && now < until {
            self.probe_soon = Some(now + QUICK_PROBE);
        } else {
            self.suspect = None;
            self.probe_soon = None;
        }
    }
}
