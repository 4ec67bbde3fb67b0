//! What operators and the placement ask of a model.

use super::*;
use crate::config::IdleAction;

/// Make room on its GPUs, if idle and unpinned: sleep (the kind's
/// shallowest level) or stop; asleep, stop.
pub(super) fn evict(m: &mut ModelState, now: Instant, fx: &mut Vec<Effect>) {
    if m.phase == Phase::Awake
        && m.intent.desired == Desired::Awake
        && m.in_flight() == 0
        && !m.pinned(now)
    {
        // The shallowest sleep the kind has; one that cannot sleep
        // is stopped (an attached one cannot make room at all).
        let kind = m.settings.kind;
        let desired = match kind.capabilities().sleep_levels.first() {
            Some(&l) => Some(Desired::Asleep(l)),
            None if m.settings.attach => None,
            None => Some(Desired::Stopped),
        };
        if let Some(desired) = desired {
            let how = if desired == Desired::Stopped {
                "stopping"
            } else {
                "sleeping"
            };
            fx.push(Effect::Log(format!(
                "evicted: {how} to make room on its GPUs"
            )));
            set_intent(m, desired, Reason::Eviction, now);
        }
    } else if matches!(m.phase, Phase::Asleep { .. })
        && matches!(m.intent.desired, Desired::Asleep(_))
        && m.in_flight() == 0
        && m.held() == 0
        && !m.settings.attach
        && !m.retiring
    {
        // Asleep, it still keeps memory another model needs.
        fx.push(Effect::Log(
            "evicted: stopping, asleep, to free what it keeps on its GPUs".into(),
        ));
        set_intent(m, Desired::Stopped, Reason::Eviction, now);
    }
}

pub(super) fn command(m: &mut ModelState, cmd: Command, now: Instant, fx: &mut Vec<Effect>) {
    match cmd {
        Command::Wake | Command::Start => {
            set_intent(m, Desired::Awake, Reason::Operator, now);
            m.intent.since = now;
            m.idle_floor = now;
            // A fresh attempt: a failure after it backs off from the start.
            m.failures = 0;
            retry_now(m, now);
            call_off_yield(m, "woken by an operator", now, fx);
        }
        Command::Sleep(level) if !m.settings.kind.can_sleep(level) => {
            // The API refuses it first; nothing is planned that the kind lacks.
            fx.push(Effect::Log(format!(
                "sleep at level {level} ignored: engine = \"{}\" cannot do it",
                m.settings.kind
            )));
        }
        Command::Sleep(level) => {
            m.pin = Pin::None;
            m.demand_since = None;
            set_intent(m, Desired::Asleep(level), Reason::Operator, now);
            // Deeper tiers count from the operator's choice: an overdue one
            // does not replace it at once.
            m.idle_floor = now;
            retry_now(m, now);
        }
        Command::Suspend if !m.settings.kind.can(IdleAction::Suspend, m.settings.attach) => {
            fx.push(Effect::Log(format!(
                "suspend ignored: an {}engine = \"{}\" cannot be suspended",
                if m.settings.attach { "attached " } else { "" },
                m.settings.kind
            )));
        }
        Command::Suspend => {
            m.pin = Pin::None;
            m.demand_since = None;
            set_intent(m, Desired::Suspended, Reason::Operator, now);
            m.idle_floor = now;
            retry_now(m, now);
        }
        Command::Stop => stop_for_good(m, Reason::Operator, now, fx),
        Command::Restart => {
            set_intent(m, Desired::Awake, Reason::Operator, now);
            m.idle_floor = now;
            m.failures = 0;
            retry_now(m, now);
            let running = matches!(
                m.phase,
                Phase::Starting { .. }
                    | Phase::Sleeping { .. }
                    | Phase::Asleep { .. }
                    | Phase::Waking { .. }
                    | Phase::Suspending { .. }
                    | Phase::Suspended { .. }
                    | Phase::Resuming { .. }
            );
            if matches!(m.phase, Phase::Awake | Phase::Yielding { .. }) && !m.settings.attach {
                // Answers under way finish first.
                m.restart_asked = Some(now);
                drain(m, now, fx);
            } else if running && !m.settings.attach {
                m.restart_asked = Some(now);
                terminate(m, now, fx);
            }
        }
    }
}
