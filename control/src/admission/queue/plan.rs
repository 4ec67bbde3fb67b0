//! Planning admission: every ask that fits goes, the rest ask idle (or,
//! past their turn, busy) models on their GPUs to make room, or are told
//! what they wait for.

use super::*;

/// How long an answered ask counts at full share while the model's
/// published state has not moved since the answer. The model publishes
/// within milliseconds; this bounds what a model that never does costs.
const GRANT_UNSEEN_MAX: Duration = Duration::from_secs(30);

/// How long a model asked to sleep (evicted, or yielding) counts as going
/// to sleep while its published state has not moved since. Its task
/// publishes within milliseconds; one that ignored the ask (it became busy
/// meanwhile) is planned for again after this.
const ASKED_UNSEEN_MAX: Duration = Duration::from_secs(2);
/// How old an NVML read may be when admission lets a start or wake go.
const FRESH_READ: Duration = Duration::from_millis(50);

/// Whether a model waiting for room is wanted by someone a busy model
/// should yield to: requests held for it, or an operator's wake or pin. A
/// wake whose held requests were all answered elsewhere or gave up (a
/// demand alone) takes only idle models' room.
fn wanted_by_someone(m: &ModelStatus) -> bool {
    m.held > 0
        || (m.intent.desired == Desired::Awake
            && matches!(m.intent.reason, Reason::Operator | Reason::Pin))
}

/// Of `yields`, the models still finishing their requests before they
/// sleep (published awake or going to sleep, with requests in flight: a
/// model sleeps only with none).
fn draining(yields: &BTreeSet<String>, models: &[ModelStatus]) -> Vec<String> {
    yields
        .iter()
        .filter(|n| {
            models.iter().any(|m| {
                m.name == **n
                    && m.in_flight > 0
                    && matches!(m.state, State::Awake | State::Sleeping)
            })
        })
        .cloned()
        .collect()
}

/// Whether `a`'s model is wanted awake (not only woken to sleep deeper, or
/// started to preload asleep).
fn wanted_awake(models: &[ModelStatus], a: &Ask) -> bool {
    models
        .iter()
        .any(|m| m.name == a.model && m.intent.desired == Desired::Awake)
}

/// Whether `model` would find no room even with every other model idle and
/// free to go but the pinned ones (and attached engines that cannot
/// sleep): its wait is on what admission cannot change (a pin, what
/// attached engines keep, a GPU too small for it beside them). Before, such
/// an ask held up every later ask on its GPUs, one that fitted beside the
/// pinned model included, until it gave up (5 minutes).
fn stuck(
    gpus: &GpuView,
    model: &str,
    models: &[ModelStatus],
    foreign: &BTreeMap<u32, Foreign>,
) -> bool {
    let mut best = runtime(models);
    for m in models.iter().filter(|m| m.name != model) {
        let Some(r) = best.get_mut(&m.name) else {
            continue;
        };
        match r.state {
            RunState::Awake | RunState::Starting | RunState::Waking => {
                r.state = RunState::Awake;
                r.in_flight = 0;
                r.min_awake_left_ms = 0;
                r.yield_in_ms = Some(0);
            }
            RunState::Asleep => r.stoppable = m.launch != "attach" && !m.pin.is_pinned(),
            _ => {}
        }
    }
    matches!(
        gpus.plan_wake_in(model, &best, true, foreign),
        WakePlan::Wait(_)
    )
}

impl Core {
    /// Answers every ask that fits now, in arrival order; asks evictions
    /// for those that need room; tells the rest what they wait for. An ask
    /// waits behind an earlier one that shares a GPU with it.
    pub fn plan(&mut self, models: &[ModelStatus]) {
        // Waiters gone (their model task moved on) leave the queue.
        while let Some(i) = self.queue.iter().position(|a| a.reply.is_closed()) {
            let ask = self.queue.remove(i).expect("index in range");
            self.call_off_yields(&ask);
        }
        // A wake only to sleep deeper (a level-2 tier on a model asleep at
        // level 1), or a start to preload asleep, asks for room nobody
        // waits for: asks of models wanted awake go first (each kind in
        // arrival order), so such an ask, waiting on a GPU a busy model
        // holds, does not hold them up behind it until it gives up.
        self.queue
            .make_contiguous()
            .sort_by_key(|a| !wanted_awake(models, a));
        self.granted
            .retain(|n, _| models.iter().any(|m| m.name == *n));
        self.asked_to_sleep.retain(|n, g| {
            models
                .iter()
                .any(|m| m.name == *n && g.unmoved(m, ASKED_UNSEEN_MAX))
        });
        // NVML, read again when over a second old (afresh before an ask
        // goes: see below).
        self.foreign = self.gpus.foreign(models);
        let mut fresh = !self.gpus.reads_nvml();
        let mut rt = self.runtime_now(models);
        let mut blocked: BTreeSet<u32> = BTreeSet::new();
        let mut i = 0;
        while i < self.queue.len() {
            let model = self.queue[i].model.clone();
            let gpus = self
                .gpus
                .placed_one(&model)
                .map(|p| p.gpus)
                .unwrap_or_default();
            if let Some(g) = gpus.iter().find(|g| blocked.contains(g)) {
                let ahead = self.queue.iter().take(i).find(|a| {
                    self.gpus
                        .placed_one(&a.model)
                        .is_some_and(|p| p.gpus.contains(g))
                });
                let who = ahead.map_or(String::new(), |a| format!(" behind \"{}\"", a.model));
                self.queue[i].tell(format!("room on GPU {g}: in line{who}"));
                i += 1;
                continue;
            }
            // Waited its share, for someone: a busy model whose turn is
            // over yields (not for a wake whose held requests are gone).
            let yield_busy = self
                .policy
                .yield_after
                .is_some_and(|y| self.queue[i].asked_at.elapsed() >= y)
                && models
                    .iter()
                    .find(|m| m.name == model)
                    .is_some_and(wanted_by_someone);
            let mut plan = self
                .gpus
                .plan_wake_in(&model, &rt, yield_busy, &self.foreign);
            // About to let it go, to move others for it, or to call off a
            // busy model's yield for it (room found without it), on a read
            // up to a second old: a process that took its memory since is
            // in none. Read NVML now and plan this ask again. (Not for a
            // model without GPUs, nor one only waiting on others' sleeps.)
            let acts = match &plan {
                WakePlan::Ready | WakePlan::Evict(_) => !gpus.is_empty(),
                WakePlan::Going(_) => !self.queue[i].yields.is_empty(),
                WakePlan::Wait(_) => false,
            };
            if !fresh && acts {
                self.foreign = self.gpus.foreign_within(models, FRESH_READ);
                fresh = true;
                continue;
            }
            // NVML did not answer that read (a hung driver): what others
            // hold now is unknown, so nothing goes on the last good read.
            if acts && let Some(silent) = self.gpus.nvml_silent_for() {
                plan = WakePlan::Wait(format!(
                    "a fresh read of the GPUs: NVML has not answered for {:.1}s \
                     (see `siesta gpus`, nvidia-smi and the kernel log for Xid errors)",
                    silent.as_secs_f64()
                ));
            }
            if let WakePlan::Going(going) = &plan
                && let Some((without, not_needed)) =
                    self.without_yields(&self.queue[i], going, &rt, models)
            {
                for y in &not_needed {
                    tracing::info!(model = %model, yielder = %y, "room found without a busy model's yield: calling it off");
                    self.call_off(y, &model, "found room without it");
                    self.queue[i].yields.remove(y);
                    self.queue[i].evicted.remove(y);
                    if let Some(r) = rt.get_mut(y) {
                        r.state = RunState::Awake;
                    }
                }
                plan = without;
            }
            // A wake no request waits for (to sleep deeper, a preload to
            // asleep) takes free room only: putting an idle model to sleep
            // for it would cost that model's next request a wake.
            if matches!(plan, WakePlan::Evict(_)) && !wanted_awake(models, &self.queue[i]) {
                plan = WakePlan::Wait(
                    "free room on its GPUs (a wake no request waits for, to sleep deeper or \
                     for a preload, puts no other model to sleep)"
                        .into(),
                );
            }
            match plan {
                WakePlan::Ready => self.admit(i, &model, models, &mut rt),
                WakePlan::Evict(victims) => {
                    self.ask_room(i, &model, victims, models, &mut rt);
                    blocked.extend(&gpus);
                    i += 1;
                }
                WakePlan::Going(names) => {
                    // Those it asked to make room keep being named as it
                    // told them (a yield says why it takes a while).
                    if !names.iter().all(|n| self.queue[i].evicted.contains(n)) {
                        let names: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
                        self.queue[i].tell(format!(
                            "room on its GPUs: waiting for {} to finish going to sleep or stopping",
                            names.join(", ")
                        ));
                    }
                    blocked.extend(&gpus);
                    i += 1;
                }
                WakePlan::Wait(reason) => {
                    self.queue[i].tell(reason);
                    // Waiting on what no model's requests will change, it
                    // holds up no later ask on its GPUs: one that fits
                    // beside what it waits on goes ahead. Else, in line:
                    // the room busy models free is its first.
                    if !stuck(&self.gpus, &model, models, &self.foreign) {
                        blocked.extend(&gpus);
                    }
                    i += 1;
                }
            }
        }
    }

    /// What each model runs and may be moved for this plan: as published,
    /// but asks queued hold what their engines hold now, answers and asks
    /// to sleep not yet published count as under way, and an asleep model
    /// on a GPU where an engine starts is not stopped.
    fn runtime_now(&mut self, models: &[ModelStatus]) -> BTreeMap<String, ModelRuntime> {
        let now_ms = self.clock.now_ms();
        let mut rt = runtime(models);
        let queued: BTreeSet<&str> = self.queue.iter().map(|a| a.model.as_str()).collect();
        for m in models {
            let Some(r) = rt.get_mut(&m.name) else {
                continue;
            };
            if queued.contains(m.name.as_str()) {
                // Waiting to wake itself: never stopped for another.
                r.stoppable = false;
                // Not admitted yet: it holds what its engine holds now.
                r.state = match m.state {
                    State::Waking => RunState::Asleep,
                    State::Starting => RunState::Stopped,
                    _ => r.state,
                };
            }
            if let Some(g) = self.granted.get(&m.name) {
                if g.unmoved(m, GRANT_UNSEEN_MAX) {
                    // Answered, not yet published: it takes its full share.
                    if matches!(r.state, RunState::Asleep | RunState::Stopped) {
                        r.state = RunState::Waking;
                    }
                } else {
                    // Its state moved since: the hub tells the truth now.
                    self.granted.remove(&m.name);
                }
            }
            if self.asked_to_sleep.contains_key(&m.name) {
                // Asked to make room a moment ago, not published yet: it is
                // going to sleep (its state has not moved since), or, asleep,
                // stopping.
                r.state = if r.state == RunState::Asleep {
                    RunState::Stopping
                } else {
                    RunState::Sleeping
                };
            }
            if m.state == State::Awake {
                let awake_for = now_ms - m.state_since_unix_ms;
                r.min_awake_left_ms = ms_left(self.policy.min_awake, awake_for);
                // A pause between requests is not idleness: a model put
                // to sleep in every gap of its traffic swapped with the one
                // waiting every `min_awake`, each paying a wake. It is
                // idle once nothing came for `min_awake`; before that it
                // takes turns like a busy one.
                if m.in_flight == 0
                    && let Some(last) = m.last_activity_unix_ms
                {
                    r.active_left_ms = ms_left(self.policy.min_awake, now_ms - last);
                }
                // A busy model's turn: it may yield once it has been awake
                // `yield_after` (one that cannot sleep never yields), longer
                // after yields it gave up (its answers outlasted the grace).
                r.yield_in_ms = self
                    .policy
                    .yield_after
                    .filter(|_| m.engine.deepest_sleep().is_some())
                    .map(|turn| ms_left(longer_turn(turn, m.yields_given_up), awake_for));
            }
        }
        // GPUs where an engine starts (admitted, not yet awake): vLLM fails
        // a start whose GPU frees memory while it profiles. Sleeps wait for
        // it on their own (the start locks); an asleep model is not stopped
        // there meanwhile.
        // (A start answered a moment ago and not yet published counts.)
        let starting: BTreeSet<u32> = models
            .iter()
            .filter(|m| !queued.contains(m.name.as_str()))
            .filter(|m| {
                m.state == State::Starting
                    || (m.state == State::Stopped && self.granted.contains_key(&m.name))
            })
            .filter_map(|m| self.gpus.placed_one(&m.name))
            .flat_map(|p| p.gpus)
            .collect();
        if !starting.is_empty() {
            for (n, r) in rt.iter_mut() {
                if r.state == RunState::Asleep
                    && self
                        .gpus
                        .placed_one(n)
                        .is_some_and(|p| p.gpus.iter().any(|g| starting.contains(g)))
                {
                    r.stoppable = false;
                }
            }
        }
        rt
    }

    /// Lets the `i`th ask (of `model`) go: it fits now.
    fn admit(
        &mut self,
        i: usize,
        model: &str,
        models: &[ModelStatus],
        rt: &mut BTreeMap<String, ModelRuntime>,
    ) {
        let ask = self.queue.remove(i).expect("index in range");
        tracing::info!(model = %ask.model, "admitted");
        // Room came some other way (a model slept or stopped on
        // its own): the busy models still finishing their turn
        // for this ask serve on.
        for y in draining(&ask.yields, models) {
            tracing::info!(model = %ask.model, yielder = %y, "admitted without a busy model's yield: calling it off");
            self.call_off(&y, &ask.model, "found room without it");
            if let Some(r) = rt.get_mut(&y) {
                r.state = RunState::Awake;
            }
        }
        if ask.told.is_some() {
            (ask.waiting)(None);
        }
        self.metrics.admitted(&ask.model, ask.asked_at.elapsed());
        let _ = ask.reply.send(());
        if let Some(m) = models.iter().find(|m| m.name == ask.model) {
            self.granted.insert(ask.model.clone(), Grant::of(m));
        }
        // From now on it takes its full share.
        if let Some(r) = rt.get_mut(model) {
            r.state = RunState::Waking;
        }
    }

    /// Asks `victims` to make room on their GPUs for the `i`th ask (of
    /// `model`): idle ones sleep (asleep ones stop), busy ones past their
    /// turn yield; the ask is told so.
    fn ask_room(
        &mut self,
        i: usize,
        model: &str,
        victims: Vec<String>,
        models: &[ModelStatus],
        rt: &mut BTreeMap<String, ModelRuntime>,
    ) {
        let mut busy = Vec::new();
        let mut stopped = Vec::new();
        for v in &victims {
            let asleep = rt.get(v).is_some_and(|r| r.state == RunState::Asleep);
            if asleep {
                stopped.push(v.clone());
            }
            let how = if rt.get(v).is_some_and(|r| r.in_flight > 0) {
                busy.push(v.clone());
                Event::Yield {
                    to: model.to_owned(),
                }
            } else {
                Event::Evict
            };
            if self.queue[i].evicted.insert(v.clone()) {
                match how {
                    Event::Yield { .. } => self.metrics.yielded(v),
                    _ => self.metrics.evicted(v),
                }
            }
            if matches!(how, Event::Yield { .. }) {
                self.queue[i].yields.insert(v.clone());
            }
            self.registry.evict(v, how);
            if let Some(m) = models.iter().find(|m| m.name == *v) {
                self.asked_to_sleep.insert(v.clone(), Grant::of(m));
            }
            // Going to sleep: still full until it is asleep,
            // and no later ask counts on it again (an asleep
            // one is stopping: what it keeps is freed).
            if let Some(r) = rt.get_mut(v) {
                r.state = if asleep {
                    RunState::Stopping
                } else {
                    RunState::Sleeping
                };
            }
        }
        let quoted = |names: &mut dyn Iterator<Item = &String>| {
            names
                .map(|v| format!("\"{v}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let sleeping = quoted(&mut victims.iter().filter(|v| !stopped.contains(v)));
        let what = match (sleeping.is_empty(), stopped.is_empty()) {
            (false, true) => format!("room on its GPUs: putting {sleeping} to sleep"),
            (true, _) => format!(
                "room on its GPUs: stopping {} (asleep: what it keeps on the GPU is \
                 needed)",
                quoted(&mut stopped.iter())
            ),
            (false, false) => format!(
                "room on its GPUs: putting {sleeping} to sleep, stopping {} (asleep: \
                 what it keeps on the GPU is needed)",
                quoted(&mut stopped.iter())
            ),
        };
        let what = if busy.is_empty() {
            what
        } else {
            format!(
                "{what} (its turn is over: requests in flight finish first, new \
                 ones are held for its next turn)"
            )
        };
        if self.queue[i].told.as_deref() != Some(&what) {
            if !stopped.is_empty() {
                tracing::info!(model = %model, ?victims, ?stopped, "stopping asleep models to free what they keep on the GPU");
            } else if busy.is_empty() {
                tracing::info!(model = %model, ?victims, "evicting idle models to make room");
            } else {
                tracing::info!(model = %model, ?victims, ?busy, "busy models yield their GPUs: their turn is over");
            }
        }
        self.queue[i].tell(what);
    }

    /// The busy models `ask` asked to yield that are still finishing their
    /// requests (published going to sleep, or not yet, with requests in
    /// flight: a model sleeps only with none), if the ask fits without
    /// them: by idle models' room, by models already going, or by room
    /// freed meanwhile. Then the plan without them, and their names. (A
    /// yield, drained for as long as its longest answer, is no longer
    /// needed once another model falls idle; before, the ask waited for it.)
    fn without_yields(
        &self,
        ask: &Ask,
        going: &[String],
        rt: &BTreeMap<String, ModelRuntime>,
        models: &[ModelStatus],
    ) -> Option<(WakePlan, Vec<String>)> {
        let draining: Vec<String> = draining(&ask.yields, models)
            .into_iter()
            .filter(|n| going.contains(n))
            .collect();
        if draining.is_empty() {
            return None;
        }
        let mut without = rt.clone();
        for n in &draining {
            if let Some(r) = without.get_mut(n) {
                r.state = RunState::Awake;
            }
        }
        // Idle models only: busy ones keep their turn.
        match self
            .gpus
            .plan_wake_in(&ask.model, &without, false, &self.foreign)
        {
            WakePlan::Wait(_) => None,
            plan => Some((plan, draining)),
        }
    }
}
