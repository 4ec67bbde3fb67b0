//! Idle tiers: which one is due, which one is next.

use super::{Desired, ModelState, Phase, Settings};
use crate::config::{IdleAction, IdleTier};
use tokio::time::Instant;

/// What a tier asks for, within what the engine can do: attach engines
/// cannot be stopped (their deepest sleep instead); a tier the kind cannot
/// do (config refuses them, this is the last guard) asks for nothing.
pub fn tier_desired(tier: &IdleTier, s: &Settings) -> Option<Desired> {
    match tier.action {
        IdleAction::Sleep(l) => s.kind.can_sleep(l).then_some(Desired::Asleep(l)),
        IdleAction::Stop if s.attach => s.kind.deepest_sleep().map(Desired::Asleep),
        IdleAction::Stop => Some(Desired::Stopped),
        IdleAction::Suspend => s
            .kind
            .can(IdleAction::Suspend, s.attach)
            .then_some(Desired::Suspended),
    }
}

/// How deep a tier goes (0: it asks for nothing).
fn tier_depth(tier: &IdleTier, s: &Settings) -> u8 {
    tier_desired(tier, s).map_or(0, Desired::depth)
}

/// Whether tiers may fire at all now: a stable serving state, not pinned,
/// nothing in flight or held, no demand waiting to be served, and not
/// leaving with a reload (its retirement is the last word: an attached
/// engine retired asleep was put to a deeper sleep by its old tier).
///
/// A failed engine spawned by siesta, retried with backoff, is idle too
/// while nothing waits for it: its stop tier ends the retries. A model
/// that crashed over and over (out of memory on each start) was restarted
/// every few minutes for ever, each start asking for room on its GPUs.
/// For it, a demand not yet served is no longer waiting once the proxies
/// hold nothing (they answer a failed model's requests 503 with
/// Retry-After until its retry is due): the idle clock counts from the
/// last demand, so its stop tier ends the retries once requests stop
/// coming. Before, a demand that woke it kept it retried without end.
fn idle_eligible(m: &ModelState, now: Instant) -> bool {
    let serving = matches!(
        m.phase,
        Phase::Awake | Phase::Asleep { .. } | Phase::Suspended { .. }
    );
    !m.retiring
        && (serving || failed_idle(m))
        && !m.pinned(now)
        && m.in_flight() == 0
        && m.held() == 0
        && (m.demand_since.is_none() || failed_idle(m))
}

fn failed_idle(m: &ModelState) -> bool {
    matches!(m.phase, Phase::Failed { .. }) && !m.settings.attach
}

/// Whether `tier` may fire in the model's phase: only a stop for a failed
/// model (it has no engine to put to sleep).
fn fits_phase(m: &ModelState, tier: &IdleTier) -> bool {
    !failed_idle(m) || tier_desired(tier, &m.settings) == Some(Desired::Stopped)
}

/// Whether `tier` needs the engine woken first: a sleep (or suspend) from
/// asleep; a stop does not.
fn needs_wake(m: &ModelState, tier: &IdleTier) -> bool {
    matches!(m.phase, Phase::Asleep { .. })
        && tier_desired(tier, &m.settings).is_some_and(|d| d != Desired::Stopped)
}

/// When `tier` may fire at the earliest, after `tiers_after` and, for one
/// that needs a wake, `deepen_after`.
fn earliest(m: &ModelState, tier: &IdleTier) -> Instant {
    let at = m.idle_start() + tier.after;
    let at = m.tiers_after.map_or(at, |after| at.max(after));
    match m.deepen_after {
        Some(after) if needs_wake(m, tier) => at.max(after),
        _ => at,
    }
}

/// The deepest tier that is due now and deeper than the current intent.
pub fn due_tier(m: &ModelState, now: Instant) -> Option<IdleTier> {
    if !idle_eligible(m, now) {
        return None;
    }
    let depth = m.intent.desired.depth();
    m.settings
        .tiers
        .iter()
        .filter(|t| tier_depth(t, &m.settings) > depth && fits_phase(m, t))
        .filter(|t| earliest(m, t) <= now)
        .max_by_key(|t| t.after)
        .copied()
}

/// The next tier that would fire, and when (None: pinned, busy, none left).
pub fn next_tier(m: &ModelState, now: Instant) -> Option<(IdleTier, Instant)> {
    if !idle_eligible(m, now) {
        return None;
    }
    let depth = m.intent.desired.depth();
    m.settings
        .tiers
        .iter()
        .filter(|t| tier_depth(t, &m.settings) > depth && fits_phase(m, t))
        .map(|t| (*t, earliest(m, t)))
        .min_by_key(|(_, at)| *at)
}
