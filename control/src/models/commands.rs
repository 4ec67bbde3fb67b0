//! Operators' commands and proxies' demand on one model, and the short
//! account each answer carries.

use super::Models;
use crate::OpError;
use crate::config::IdleAction;
use crate::reconciler::{Command, Desired, Event, Reason};
use crate::runner::ModelHandle;
use crate::status::{ModelStatus, State};
use std::time::Duration;

/// What an operator's command on one model answers.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The model's status once the command was applied (or, for a waited
    /// wake, when the wait ended).
    pub status: ModelStatus,
    /// A short account ("already awake", "waking", ...).
    pub message: String,
    /// What the operator must know though the command was applied: its
    /// intent is not durable yet ([`NOT_DURABLE`]).
    pub warning: Option<String>,
}

/// The warning of a command whose intent the state store could not write.
pub(crate) const NOT_DURABLE: &str = "applied, but not durable yet: the state store could not \
    write it (is state_dir full or read-only? siesta-control's log says why); it tries \
    again every second, and a restart of siesta-control before the write lands goes on \
    from the intent before this command";

impl Answer {
    fn new(applied: crate::runner::Applied, message: String) -> Answer {
        Answer {
            status: applied.status,
            message,
            warning: (!applied.durable).then(|| NOT_DURABLE.to_string()),
        }
    }
}

impl Models {
    /// Operator command; returns the status once accepted and a short account.
    pub async fn command(&self, name: &str, cmd: Command) -> Result<Answer, OpError> {
        let h = self.resolve(name)?;
        let before = h.status.borrow().clone();
        let attach = h.cfg().is_attach();
        match cmd {
            Command::Sleep(level @ (0 | 3..)) => {
                return Err(OpError::invalid(
                    "level",
                    format!("{level} is not a sleep level (1 or 2)"),
                ));
            }
            Command::Sleep(level) if !h.cfg().engine.can_sleep(level) => {
                return Err(OpError::Refused(format!(
                    "{} runs engine = \"{}\", which cannot sleep at level {level}; what it can do when idle: {}",
                    before.name,
                    h.cfg().engine,
                    h.cfg().engine.actions(attach)
                )));
            }
            Command::Suspend if !h.cfg().engine.can(IdleAction::Suspend, attach) => {
                return Err(OpError::Refused(format!(
                    "{} runs {}engine = \"{}\", which siesta cannot suspend (it does not own an attached engine's processes); what it can do when idle: {}",
                    before.name,
                    if attach { "an attached " } else { "" },
                    h.cfg().engine,
                    h.cfg().engine.actions(attach)
                )));
            }
            Command::Suspend if h.cfg().gpus > 1 && !h.cfg().checkpointable_multi_gpu() => {
                return Err(OpError::Refused(format!(
                    "{} runs on {} GPUs and was started sharing GPU memory between its processes \
                     (NCCL P2P, custom all-reduce): the CUDA driver cannot restore such a process \
                     (CUDA_ERROR_NOT_SUPPORTED). Give it an idle tier with action = \"suspend\" \
                     (siesta then starts it without sharing) and suspend it after its restart",
                    before.name,
                    h.cfg().gpus
                )));
            }
            Command::Sleep(_) | Command::Suspend if before.state == State::Stopped => {
                return Err(OpError::Refused(format!(
                    "{} is stopped: start it first",
                    before.name
                )));
            }
            // Stopping for good (not for a restart): refused as once
            // stopped. Accepted, it started the engine again (a cold start,
            // its GPU memory taken back) to put it to sleep.
            Command::Sleep(_) | Command::Suspend
                if before.state == State::Stopping
                    && before.intent.desired == Desired::Stopped
                    && !before.retiring =>
            {
                return Err(OpError::Refused(format!(
                    "{} is stopping, to stay stopped: start it first",
                    before.name
                )));
            }
            Command::Stop | Command::Restart if attach => {
                return Err(OpError::Refused(format!(
                    "{} is an attach engine run by someone else: siesta can only sleep and wake it",
                    before.name
                )));
            }
            _ => {}
        }
        let mut applied = self.applied(&h, Event::Command(cmd)).await?;
        if matches!(cmd, Command::Sleep(_) | Command::Suspend)
            && holds_for_requests(&applied.status)
        {
            applied.status = self.fresh_in_flight(&h).await;
        }
        let msg = account(&before, &applied.status, cmd);
        Ok(Answer::new(applied, msg))
    }

    /// The status once the in-flight count is fresh: proxies report every
    /// 100 ms and the engine's gauge is read every poll, so a request that
    /// just finished may still be counted. Waits up to one poll (plus a
    /// margin) for the sleep to begin; what is still counted after that is
    /// really in flight.
    async fn fresh_in_flight(&self, h: &ModelHandle) -> ModelStatus {
        let mut rx = h.status.clone();
        let within = self.shared.poll_every + Duration::from_millis(300);
        let _ = tokio::time::timeout(within, rx.wait_for(|s| !holds_for_requests(s))).await;
        h.status.borrow().clone()
    }

    /// Wake, optionally waiting until awake or failed (or `timeout`), or
    /// until the wake is called off: the intent is no longer awake (an
    /// operator's stop or sleep, a wake that found no room and gave up).
    pub async fn wake(
        &self,
        name: &str,
        wait: bool,
        timeout: Option<Duration>,
    ) -> Result<Answer, OpError> {
        let answer = self.command(name, Command::Wake).await?;
        if !wait || answer.status.state == State::Awake {
            return Ok(answer);
        }
        let h = self.resolve(name)?;
        let timeout = timeout.unwrap_or(h.cfg().timeouts.start + h.cfg().timeouts.wake);
        let mut rx = h.status.clone();
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|s| {
                matches!(s.state, State::Awake | State::Failed)
                    || s.intent.desired != Desired::Awake
            }),
        )
        .await;
        if let Ok(Err(_)) = waited {
            // The model's task ended (the control plane stops, or a reload
            // replaced the model): its last status says nothing about the
            // wake.
            return Err(self.task_ended(name));
        }
        // Read after the wait, whether it ran out or not: a model that got
        // there at the deadline is told as it is, not as still waking.
        let status = h.status.borrow().clone();
        let message = waited_wake_says(&status, timeout);
        Ok(Answer {
            status,
            message,
            ..answer
        })
    }

    /// Pins for `d` from now, on this control plane's clock.
    pub async fn pin_for(&self, name: &str, d: Duration) -> Result<Answer, OpError> {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        self.pin(name, self.shared.clock.now_ms().saturating_add(ms))
            .await
    }

    pub async fn pin(&self, name: &str, until_unix_ms: i64) -> Result<Answer, OpError> {
        let h = self.resolve(name)?;
        let now = self.shared.clock.now_ms();
        let until = match until_unix_ms {
            0 => None,
            t if t <= now => {
                return Err(OpError::invalid(
                    "until_unix_ms",
                    format!("pin until {t} is in the past (now {now})"),
                ));
            }
            t => Some(self.shared.clock.instant(t)),
        };
        let applied = self.applied(&h, Event::Pin(until)).await?;
        let msg = match until {
            None => "pinned awake until unpinned".to_string(),
            // In whole seconds, as a person reads it: `2h`, not `7200s`.
            Some(_) => format!(
                "pinned awake for {}",
                humantime::format_duration(Duration::from_secs(
                    // Rounded up: `--for 2h` read a millisecond later is 2h.
                    u64::try_from((until_unix_ms - now + 999) / 1000).unwrap_or(0)
                ))
            ),
        };
        Ok(Answer::new(applied, msg))
    }

    pub async fn unpin(&self, name: &str) -> Result<Answer, OpError> {
        let h = self.resolve(name)?;
        let applied = self.applied(&h, Event::Unpin).await?;
        let msg = "unpinned; idle tiers count from the last activity".to_string();
        Ok(Answer::new(applied, msg))
    }

    /// A proxy's demand: (status, accepted, message).
    pub async fn demand(&self, name: &str) -> Result<(ModelStatus, bool, String), OpError> {
        let h = self.resolve(name)?;
        let status = self.send(&h, Event::Demand).await?;
        if status.intent.desired == Desired::Stopped && status.intent.reason == Reason::Operator {
            let msg = format!(
                "{} was stopped by an operator; Start or Wake it first",
                status.name
            );
            return Ok((status, false, msg));
        }
        let msg = match status.state {
            State::Awake => "awake".to_string(),
            State::Failed => match status.retry_at_unix_ms {
                Some(at) => format!("failed; retrying at {at}"),
                None => "failed; no retry scheduled".to_string(),
            },
            s => format!("{s:?}").to_lowercase(),
        };
        Ok((status, true, msg))
    }
}

/// Awake, asked to go elsewhere, and held by requests in flight.
fn holds_for_requests(s: &ModelStatus) -> bool {
    s.state == State::Awake && s.in_flight > 0 && s.intent.desired != Desired::Awake
}

pub(super) fn account(before: &ModelStatus, after: &ModelStatus, cmd: Command) -> String {
    let state = format!("{:?}", after.state).to_lowercase();
    match (cmd, before.state) {
        (Command::Wake | Command::Start, State::Awake) => "already awake".into(),
        (Command::Stop, State::Stopped) => "already stopped".into(),
        (Command::Sleep(l), State::Asleep) if before.sleep_level >= l => {
            format!("already asleep at level {}", before.sleep_level)
        }
        // Deeper: vLLM sleeps only from awake, so it is woken first.
        (Command::Sleep(l), State::Asleep) if after.state == State::Waking => format!(
            "asleep at level {}: waking it to sleep again at level {l}",
            before.sleep_level
        ),
        (Command::Suspend, State::Suspended) => "already suspended".into(),
        // It read "stopping", as if the model were being stopped for good.
        (Command::Restart, _) => "restarting".into(),
        (Command::Suspend, _) if after.in_flight > 0 && after.state == State::Awake => {
            format!(
                "will suspend once {} request(s) in flight finish",
                after.in_flight
            )
        }
        (Command::Sleep(_), _) if after.in_flight > 0 && after.state == State::Awake => {
            format!(
                "will sleep once {} request(s) in flight finish",
                after.in_flight
            )
        }
        _ => state,
    }
}

/// What a waited wake says of the model as it is when the wait ends: awake,
/// failed (and why), called off (the intent now, and why), or still on its
/// way after `timeout` ([`still_waking`]).
pub(super) fn waited_wake_says(status: &ModelStatus, timeout: Duration) -> String {
    match status.state {
        State::Awake => "awake".to_string(),
        State::Failed => format!(
            "failed: {}",
            status.last_error.as_deref().unwrap_or("no reason given")
        ),
        _ if status.intent.desired != Desired::Awake => {
            let i = &status.intent;
            let why = status
                .last_error
                .as_deref()
                .map_or(String::new(), |e| format!(": {e}"));
            let intent = format!("{:?} ({:?})", i.desired, i.reason).to_lowercase();
            format!("the wake was called off: the intent is now {intent}{why}")
        }
        _ => still_waking(status, timeout),
    }
}

/// A waited wake that ran out of time: the state, and what the model waits
/// for if anything (room held by other models or by processes siesta does
/// not run, a neighbour's turn on its GPUs).
pub(super) fn still_waking(status: &ModelStatus, timeout: Duration) -> String {
    let state = format!("{:?}", status.state).to_lowercase();
    match status.waiting_for.as_deref().filter(|w| !w.is_empty()) {
        Some(w) => format!("still {state} after {timeout:?}, waiting for {w}; the wake goes on"),
        None => format!("still {state} after {timeout:?}; the wake goes on"),
    }
}
