//! A waker that keeps wakes a task gives itself inside one poll from
//! reaching the scheduler.
//!
//! A client connection's task is both ends of hyper's internal channel that
//! hands the request body to the handler (the upstream connection is read
//! and written in the same task, with no channel). Each hand-over wakes the
//! task while it runs.
//! tokio treats a wake of a running task like a yield: the task goes to the
//! back of the run queue and an idle worker thread is woken (a futex wake
//! per hand-over; the woken thread spins looking for work and may take the
//! task to another core). Here such wakes are noted instead
//! ([`SelfWake::end`] says whether one came) and the poll simply goes round
//! again ([`Absorbing`]); only wakes from outside the poll (a socket became
//! readable, a held request released) reach the task.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, Wake, Waker};

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

/// Rounds of polling in one poll of the task while its parts keep waking
/// each other; after that the task yields to the scheduler (tokio's
/// cooperative budget, once spent, wakes the task to make it yield).
pub const ROUNDS: usize = 4;

/// A future polled again at once, up to [`ROUNDS`] times, when it woke its
/// own task while being polled.
#[derive(Debug)]
pub struct Absorbing<F> {
    inner: Pin<Box<F>>,
    wake: SelfWake,
}

impl<F: Future> Absorbing<F> {
    pub fn new(inner: F) -> Self {
        Absorbing {
            inner: Box::pin(inner),
            wake: SelfWake::default(),
        }
    }
}

impl<F: Future> Future for Absorbing<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        for _ in 0..ROUNDS {
            this.wake.begin(cx);
            let mut own = Context::from_waker(this.wake.waker());
            let res = this.inner.as_mut().poll(&mut own);
            let woken = this.wake.end();
            if res.is_ready() || !woken {
                return res;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
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

    #[test]
    fn an_absorbing_future_goes_round_again_when_it_woke_itself() {
        // Wakes itself twice (as a channel hand-over inside one task does),
        // then is ready: one poll from outside suffices.
        let mut polls = 0;
        let fut = std::future::poll_fn(move |cx| {
            polls += 1;
            if polls < 3 {
                cx.waker().wake_by_ref();
                Poll::Pending
            } else {
                Poll::Ready(polls)
            }
        });
        let count = Arc::new(Count::default());
        let task = Waker::from(count.clone());
        let mut cx = Context::from_waker(&task);
        let mut f = std::pin::pin!(Absorbing::new(fut));
        assert_eq!(f.as_mut().poll(&mut cx), Poll::Ready(3));
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        // One that never stops waking itself yields after ROUNDS.
        let mut spin = std::pin::pin!(Absorbing::new(std::future::poll_fn(|cx| {
            cx.waker().wake_by_ref();
            Poll::<()>::Pending
        })));
        assert!(spin.as_mut().poll(&mut cx).is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken to yield");
    }
}
