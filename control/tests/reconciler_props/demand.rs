//! A demand always wins: from any reachable state and history (tiers
//! overdue or not, operator intents, failures, results still outstanding),
//! a demand followed by no operator intent reaches Awake within the
//! deadlines when the engine does what it is asked, and no idle tier fires
//! while the demand waits, with one exception by design (`tiers.rs`,
//! `idle_eligible`): a failed engine no proxy holds a request for is idle,
//! its idle clock counting from the demand, so its stop tier may end the
//! retries the demand asked for (a model that crashed on each start was
//! otherwise retried for ever).

use super::*;

impl World {
    /// Delivers one outstanding result the way a working engine and runner
    /// would; false when nothing is outstanding.
    fn cooperate(&mut self) -> Result<bool, TestCaseError> {
        let ev = if let Some(s) = self.spawns.pop() {
            self.procs.insert(s.proc_gen, s.cancelled);
            Event::Spawned {
                proc_gen: s.proc_gen,
                pid: 1000 + s.proc_gen as u32,
            }
        } else if let Some((&g, _)) = self.procs.iter().find(|(g, killed)| {
            **killed || (**g == self.m.proc_gen && matches!(self.m.phase, Phase::Stopping { .. }))
        }) {
            // Killed processes die; a SIGTERMed engine exits.
            self.procs.remove(&g);
            Event::ChildExited {
                proc_gen: g,
                status: "exit 0".into(),
                cause: None,
            }
        } else if let Some(epoch) = self.probes.pop() {
            Event::HealthOk {
                epoch,
                asleep: None,
            }
        } else if let Some(epoch) = self.sleeps.pop() {
            Event::SleepDone { epoch }
        } else if let Some((epoch, step)) = self.wakes.pop() {
            Event::WakeStepDone { epoch, step }
        } else if let Some(epoch) = self.suspends.pop() {
            Event::SuspendDone { epoch }
        } else if let Some(epoch) = self.resumes.pop() {
            Event::ResumeDone { epoch }
        } else {
            return Ok(false);
        };
        self.apply(ev)?;
        Ok(true)
    }

    /// Demand, then let the world cooperate until the model is awake.
    fn demand_is_served(&mut self) -> Result<(), TestCaseError> {
        let operator_stop = self.m.intent.desired == Desired::Stopped
            && self.m.intent.reason == siesta_control::reconciler::Reason::Operator;
        let intent_before = self.m.intent;
        self.apply(Event::Demand)?;
        if operator_stop {
            // Only an operator's stop overrides a demand.
            prop_assert_eq!(self.m.intent.desired, Desired::Stopped);
            return Ok(());
        }
        if self.m.retiring {
            // A model a reload retires stops for good (an attached engine
            // sleeps, or is left as it is); its held requests go to the new
            // one, and a demand changes nothing.
            prop_assert_eq!(self.m.intent, intent_before);
            return Ok(());
        }
        let start = self.now;
        let t = self.m.settings.timeouts;
        let bound = (t.start * 2 + t.wake + t.sleep + t.stop_grace + KILL_GRACE) * 2
            + self.m.settings.backoff.max;
        // The model was failed with nothing held before the last event.
        let mut failed_idle = false;
        for _ in 0..1000 {
            if failed_idle
                && self.m.intent.desired == Desired::Stopped
                && self.m.intent.reason == siesta_control::reconciler::Reason::IdleTier
            {
                // The exception above: its stop tier ended the retries.
                prop_assert!(
                    self.m
                        .settings
                        .tiers
                        .iter()
                        .any(|t| t.action == IdleAction::Stop),
                    "stopped by a tier that does not stop: {:?}",
                    self.m
                );
                return Ok(());
            }
            prop_assert_eq!(
                self.m.intent.desired,
                Desired::Awake,
                "the demand was overridden: {:?}",
                self.m
            );
            failed_idle = matches!(self.m.phase, Phase::Failed { .. })
                && !self.m.settings.attach
                && self.m.held() == 0;
            if self.m.phase == Phase::Awake {
                prop_assert_eq!(self.m.demand_since, None);
                return Ok(());
            }
            prop_assert!(
                self.now <= start + bound,
                "not awake {:?} after the demand: {:?}",
                self.now - start,
                self.m
            );
            if !self.cooperate()? {
                let Some(t) = self.timer else {
                    return Err(TestCaseError::fail(format!(
                        "stuck with nothing to wait for: {:?}",
                        self.m
                    )));
                };
                self.now = self.now.max(t);
                self.apply(Event::Tick)?;
            }
        }
        Err(TestCaseError::fail(format!("no end: {:?}", self.m)))
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn a_demand_wins_from_any_state(
        settings in settings(),
        preload in preload(),
        steps in proptest::collection::vec((advance(), action()), 0..80),
        idle_ms in prop_oneof![Just(0u64), 0u64..1_000_000],
    ) {
        let mut w = World::new(settings, preload, Strict::default());
        w.run(steps)?;
        // Long idle: every tier may be overdue.
        w.now += Duration::from_millis(idle_ms);
        w.demand_is_served()?;
    }
}
