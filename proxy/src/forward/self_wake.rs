//! A waker that keeps wakes a task gives itself inside one poll from
//! reaching the scheduler.
//!
//! Driving an upstream connection in the request's task means that task is
//! both ends of hyper's internal channels: polling the connection future
//! hands a body chunk (or the response head) to a receiver this same task
//! polls, which wakes the task while it runs. tokio treats a wake of a
//! running task like a yield: the task goes to the back of the run queue and
//! an idle worker thread is woken (a futex wake, and often the task moves to
//! that thread). The poll already loops until neither side can go on, so
//! such wakes are noted here instead ([`SelfWake::end`] says whether one
//! came) and only wakes from outside the poll (the socket became readable)
//! reach the task.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Wake, Waker};

use futures::task::AtomicWaker;

const IDLE: u8 = 0;
const POLLING: u8 = 1;
const WOKEN: u8 = 2;

#[derive(Debug, Default)]
struct Inner {
    state: AtomicU8,
    task: AtomicWaker,
}

impl Wake for Inner {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        match self
            .state
            .compare_exchange(POLLING, WOKEN, Ordering::AcqRel, Ordering::Acquire)
        {
            // Inside the poll: it will look again.
            Ok(_) => {}
            Err(WOKEN) => {}
            Err(_) => self.task.wake(),
        }
    }
}

/// One per upstream connection: the waker its futures are polled with.
#[derive(Debug)]
pub struct SelfWake {
    inner: Arc<Inner>,
    waker: Waker,
}

impl Default for SelfWake {
    fn default() -> Self {
        let inner = Arc::new(Inner::default());
        let waker = Waker::from(inner.clone());
        SelfWake { inner, waker }
    }
}

impl SelfWake {
    /// Starts one round of polling on behalf of the task polling with `cx`;
    /// poll with [`SelfWake::waker`] until [`SelfWake::end`].
    pub fn begin(&self, cx: &Context<'_>) {
        self.inner.task.register(cx.waker());
        self.inner.state.store(POLLING, Ordering::Release);
    }

    /// The waker to poll with between `begin` and `end`.
    pub fn waker(&self) -> &Waker {
        &self.waker
    }

    /// Ends the round: true when something woke the task meanwhile (poll
    /// again: there may be progress to make).
    pub fn end(&self) -> bool {
        self.inner.state.swap(IDLE, Ordering::AcqRel) == WOKEN
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn wakes_inside_a_round_are_noted_and_others_reach_the_task() {
        let count = Arc::new(Count::default());
        let task = Waker::from(count.clone());
        let cx = Context::from_waker(&task);
        let sw = SelfWake::default();
        sw.begin(&cx);
        sw.waker().wake_by_ref();
        sw.waker().wake_by_ref();
        assert!(sw.end(), "the wake inside the round is reported");
        assert_eq!(count.0.load(Ordering::SeqCst), 0, "and kept from the task");
        sw.begin(&cx);
        assert!(!sw.end());
        sw.waker().wake_by_ref();
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "outside a round: the task"
        );
    }
}
