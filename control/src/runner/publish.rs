//! What a model task tells the Watch hub, and when.
//!
//! Every change of a model's status goes to the hub at once (and from it to
//! every `Watch` subscriber), except one whose only difference is the
//! transition's deadline. A sleep or a wake moves its deadline at each step
//! of its way (the drain, the call; the admission, the call), each a
//! millisecond after the last: three of the seven events of a sleep and
//! wake cycle said nothing else. Such a change waits up to
//! [`DEADLINE_COALESCE`] for the next change, which carries it; if none
//! comes, it is published alone then. The model's own status (`GetModel`,
//! the model task's watch channel) is always current.

use super::Runner;
use crate::status::{ModelStatus, State};
use std::time::Duration;
use tokio::time::Instant;

/// How long a change of the deadline alone waits for the next change.
pub(super) const DEADLINE_COALESCE: Duration = Duration::from_millis(50);

/// `after` differs from `before` in its deadline and in nothing else.
pub(super) fn only_deadline_moved(before: &ModelStatus, after: &ModelStatus) -> bool {
    before.deadline_unix_ms != after.deadline_unix_ms
        && ModelStatus {
            deadline_unix_ms: before.deadline_unix_ms,
            ..after.clone()
        } == *before
}

impl Runner {
    /// Publishes the model's status if it changed (see the module's note).
    pub(super) fn publish(&mut self, now: Instant) {
        let status = crate::status::model_status(
            &self.cfg,
            &self.facts,
            &self.state,
            &self.shared.clock,
            now,
        );
        let deadline_only = {
            let before = self.status_tx.borrow();
            if *before == status {
                return;
            }
            only_deadline_moved(&before, &status)
        };
        if status.state == State::Awake {
            self.awake_since_unix_ms = status.state_since_unix_ms;
        }
        if deadline_only {
            self.status_tx.send_replace(status);
            self.hub_due.get_or_insert(now + DEADLINE_COALESCE);
        } else {
            self.status_tx.send_replace(status.clone());
            self.hub_due = None;
            self.shared.hub.publish_model(status);
        }
    }

    /// Publishes a deadline change that waited [`DEADLINE_COALESCE`] alone.
    pub(super) fn publish_due(&mut self) {
        self.hub_due = None;
        let status = self.status_tx.borrow().clone();
        self.shared.hub.publish_model(status);
    }
}
