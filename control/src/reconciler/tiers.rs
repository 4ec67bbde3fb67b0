//! Idle tiers: which one is due, which one is next.

use super::{Desired, ModelState, Phase};
use crate::config::{IdleAction, IdleTier};
use tokio::time::Instant;

/// What a tier asks for (attach engines cannot be stopped: deepest sleep).
pub fn tier_desired(tier: &IdleTier, attach: bool) -> Desired {
    match tier.action {
        IdleAction::Sleep(l) => Desired::Asleep(l),
        IdleAction::Stop if attach => Desired::Asleep(2),
        IdleAction::Stop => Desired::Stopped,
    }
}

/// Whether tiers may fire at all now: a stable serving state, not pinned,
/// nothing in flight, no demand waiting to be served.
fn idle_eligible(m: &ModelState, now: Instant) -> bool {
    matches!(m.phase, Phase::Awake | Phase::Asleep { .. })
        && !m.pinned(now)
        && m.in_flight() == 0
        && m.demand_since.is_none()
}

/// The deepest tier that is due now and deeper than the current intent.
pub fn due_tier(m: &ModelState, now: Instant) -> Option<IdleTier> {
    if !idle_eligible(m, now) {
        return None;
    }
    let idle = now.saturating_duration_since(m.idle_start());
    let depth = m.intent.desired.depth();
    m.settings
        .tiers
        .iter()
        .filter(|t| t.after <= idle)
        .filter(|t| tier_desired(t, m.settings.attach).depth() > depth)
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
        .find(|t| tier_desired(t, m.settings.attach).depth() > depth)
        .map(|t| (*t, m.idle_start() + t.after))
}
