//! How long a model will take to be awake, from its state and calibration,
//! and the Retry-After derived from it and the queue ahead.

use siesta_proto::v1::{ModelState, ModelStatus};

use crate::route_table::ModelRoute;

/// Used when a transition was never measured.
const DEFAULT_WAKE_MS: u64 = 5_000;
const DEFAULT_START_MS: u64 = 60_000;
/// Each request already waiting adds this much to Retry-After.
pub const PER_QUEUED_MS: u64 = 500;

/// Expected time until the model is awake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    pub ms: u64,
    /// From measured calibration (or an awake model); only calibrated
    /// estimates shed requests at admission.
    pub calibrated: bool,
}

/// A measured duration (0: not measured yet, so `default`, uncalibrated).
fn measured(ms: u64, default: u64) -> (u64, bool) {
    if ms > 0 { (ms, true) } else { (default, false) }
}

/// Expected time until `route` is awake, as of `now_ms` (Unix ms).
pub fn estimate(route: &ModelRoute, now_ms: i64) -> Estimate {
    if route.is_awake() {
        return Estimate {
            ms: 0,
            calibrated: true,
        };
    }
    estimate_status(route.state, &route.status, now_ms)
}

fn estimate_status(state: ModelState, s: &ModelStatus, now_ms: i64) -> Estimate {
    let c = s.calibration.unwrap_or_default();
    let wake = |level: u32| {
        if level >= 2 {
            measured(c.wake_l2_ms, DEFAULT_WAKE_MS)
        } else {
            measured(c.wake_l1_ms, DEFAULT_WAKE_MS)
        }
    };
    let start = measured(c.start_ms, DEFAULT_START_MS);
    let elapsed = if s.state_since_unix_ms > 0 {
        (now_ms - s.state_since_unix_ms).max(0) as u64
    } else {
        0
    };
    let remaining = |(ms, cal): (u64, bool)| (ms.saturating_sub(elapsed), cal);
    let (ms, calibrated) = match state {
        ModelState::Awake => (0, true),
        // By the level it wakes from (0: not said, by an older control plane).
        ModelState::Waking if s.sleep_level > 0 => remaining(wake(s.sleep_level)),
        ModelState::Waking => {
            let l1 = wake(1);
            remaining(if l1.1 { l1 } else { wake(2) })
        }
        ModelState::Asleep => wake(s.sleep_level),
        ModelState::Sleeping => {
            let (w, wc) = wake(s.sleep_level);
            let sl = if s.sleep_level >= 2 {
                c.sleep_l2_ms
            } else {
                c.sleep_l1_ms
            };
            (sl.saturating_sub(elapsed) + w, wc)
        }
        // Held like an asleep model; a demand resumes it (CUDA restore).
        ModelState::Suspended => measured(c.resume_ms, DEFAULT_WAKE_MS),
        ModelState::Suspending => {
            let (r, rc) = measured(c.resume_ms, DEFAULT_WAKE_MS);
            (c.suspend_ms.saturating_sub(elapsed) + r, rc)
        }
        ModelState::Starting => remaining(start),
        ModelState::Failed => {
            let until = (s.retry_at_unix_ms - now_ms).max(0) as u64;
            (until + start.0, start.1)
        }
        ModelState::Stopped | ModelState::Stopping | ModelState::Unspecified => start,
    };
    Estimate { ms, calibrated }
}

/// Retry-After in whole seconds (at least 1) for a client shed with `depth`
/// requests ahead of it: deeper queue, longer wait.
pub fn retry_after_s(estimate_ms: u64, depth: usize) -> u64 {
    let ms = estimate_ms.saturating_add((depth as u64).saturating_mul(PER_QUEUED_MS));
    ms.div_ceil(1000).clamp(1, 3600)
}

#[cfg(test)]
mod tests {
    use super::*;

    use siesta_proto::v1::Calibration;

    fn st(state: ModelState, level: u32, since: i64) -> ModelStatus {
        ModelStatus {
            state: state as i32,
            sleep_level: level,
            state_since_unix_ms: since,
            calibration: Some(Calibration {
                start_ms: 20_000,
                wake_l1_ms: 1_000,
                wake_l2_ms: 3_000,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn estimates_follow_state_and_calibration() {
        let now = 1_000_000;
        let e = |s: ModelStatus| estimate_status(s.state(), &s, now);
        assert_eq!(e(st(ModelState::Asleep, 1, now)).ms, 1_000);
        assert_eq!(e(st(ModelState::Asleep, 2, now)).ms, 3_000);
        assert_eq!(e(st(ModelState::Waking, 0, now - 400)).ms, 600);
        // A level-2 wake is timed as one (it was timed as level 1: held
        // past its hold rather than shed with the Retry-After it needs).
        assert_eq!(e(st(ModelState::Waking, 2, now - 1_000)).ms, 2_000);
        assert_eq!(e(st(ModelState::Waking, 1, now - 400)).ms, 600);
        assert_eq!(e(st(ModelState::Starting, 0, now - 5_000)).ms, 15_000);
        assert_eq!(e(st(ModelState::Stopped, 0, now)).ms, 20_000);
        let mut f = st(ModelState::Failed, 0, now);
        f.retry_at_unix_ms = now + 4_000;
        assert_eq!(e(f).ms, 24_000);
        let mut unknown = st(ModelState::Asleep, 1, now);
        unknown.calibration = None;
        let u = e(unknown);
        assert!(!u.calibrated && u.ms > 0);
        assert!(e(st(ModelState::Asleep, 1, now)).calibrated);
    }

    #[test]
    fn retry_after_grows_with_depth() {
        assert_eq!(retry_after_s(0, 0), 1);
        assert_eq!(retry_after_s(2_000, 0), 2);
        assert!(retry_after_s(2_000, 4) > retry_after_s(2_000, 1));
        assert!(retry_after_s(2_000, 10) > retry_after_s(2_000, 4));
        assert_eq!(retry_after_s(u64::MAX, usize::MAX), 3600);
    }
}
