//! Probing an engine: the periodic `/health` (and, awake, `/metrics`) of a
//! running model, and whether an attach engine sleeps, and how deeply.

use super::{Msg, Runner};
use crate::reconciler::Phase;
use std::time::Duration;

/// Per-probe timeout: engines accept the connection but answer nothing
/// until start-up is done.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether an attach engine sleeps, and at which level. `/is_sleeping`
/// decides (vLLM 0.24's metric alone reads awake after
/// `wake_up?tags=weights`); it waits behind a running wake, so "no answer"
/// is waited on up to the wake timeout and never taken for awake.
pub(super) async fn sleep_level(
    client: &crate::engine::EngineClient,
    name: &str,
    known: u8,
    wake_timeout: Duration,
) -> Option<u8> {
    let mut answer = client.is_sleeping_within(PROBE_TIMEOUT).await;
    if let Ok(None) = answer {
        answer = client.is_sleeping_within(wake_timeout).await;
    }
    match answer {
        Ok(Some(false)) => None,
        Ok(Some(true)) => {
            let m = client.metrics(PROBE_TIMEOUT).await.ok();
            if m.is_some_and(|m| !m.has_vllm_metrics) {
                tracing::warn!(model = %name, "engine serves no vllm: metrics (--disable-log-stats?): its sleep level and activity are unknown");
            }
            let level = m.and_then(|m| m.sleep_level).filter(|l| *l > 0);
            Some(level.unwrap_or(known).min(2))
        }
        Ok(None) => {
            tracing::warn!(model = %name, level = known, "/is_sleeping never answered; taking the engine as asleep");
            Some(known)
        }
        Err(error) => {
            tracing::warn!(model = %name, level = known, %error, "/is_sleeping failed; taking the engine as asleep");
            Some(known)
        }
    }
}

impl Runner {
    /// Periodic probe of an awake or asleep engine: `/health`, and while
    /// awake `/metrics` for its running requests.
    pub(super) fn poll(&mut self) {
        let awake = match self.state.phase {
            // Yielding: still serving what is in flight (the engine's own
            // gauge says when that is done too).
            Phase::Awake | Phase::Yielding { .. } => true,
            Phase::Asleep { .. } => false,
            _ => return,
        };
        if self.polling {
            return;
        }
        self.polling = true;
        self.poll_started = tokio::time::Instant::now();
        let client = self.client.clone();
        let tx = self.tx.clone();
        let epoch = self.state.epoch;
        let timeout = PROBE_TIMEOUT * 2;
        let has_metric = self.cfg.engine.capabilities().activity_metric.is_some();
        let sleep_query = self.cfg.engine.capabilities().sleep_query;
        let (gate, frozen) = (self.probe_gate.clone(), self.frozen.clone());
        tokio::spawn(async move {
            // Nothing may reach a suspended engine (a request reaching a
            // checkpointed engine core killed it on an H200).
            let _gate = gate.lock().await;
            if frozen.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = tx.send(Msg::Poll {
                    epoch,
                    result: Ok(None),
                });
                return;
            }
            let result = async {
                // Never SGLang's /health here (it generates a token): a
                // release may begin while this probe is on its way, and a
                // generation reaching released memory kills the engine.
                client.probe(timeout).await?;
                if awake && has_metric {
                    let mut m = client.metrics_probe(timeout).await?;
                    // The metric alone never says awake (vLLM 0.24 records
                    // awake after `wake_up?tags=weights`; a draining sleep
                    // records only at its end): `/is_sleeping` says whether
                    // the scheduler takes requests.
                    if sleep_query && m.sleep_level.is_none_or(|l| l == 0) {
                        m.is_sleeping = client
                            .is_sleeping_within(PROBE_TIMEOUT)
                            .await
                            .ok()
                            .flatten();
                    }
                    Ok(Some(m))
                } else {
                    Ok(None)
                }
            }
            .await;
            let _ = tx.send(Msg::Poll { epoch, result });
        });
    }
}
