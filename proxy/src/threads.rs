//! Serving threads: nginx's worker model in one process.
//!
//! With [`ProxyConfig::threads`](crate::ProxyConfig) above one, the proxy
//! serves on the caller's runtime (thread 0, which also runs the background
//! tasks and the admin listener) and on `threads - 1` more OS threads, each
//! running its own single-threaded tokio runtime. Every thread accepts from
//! the same listening socket (its own registration of a duplicate of it: the
//! kernel wakes them all, the first to call `accept` takes the connection,
//! so an idle thread takes new connections before a busy one). A connection
//! stays on the thread that accepted it, with everything it drives: its
//! request tasks, its upstream connections (each thread has its own share of
//! every engine's idle pool, see [`current`]). Nothing hands a request from
//! thread to thread, so there are no cross-thread wakes or work stealing on
//! the request path.

use std::cell::Cell;
use std::future::Future;

use tokio::sync::oneshot;

use crate::Error;

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

/// The serving thread this code runs on (0: the caller's runtime, which may
/// be a multi-threaded one: its tasks move between its workers, so they all
/// share index 0).
pub fn current() -> usize {
    INDEX.with(Cell::get)
}

/// The default number of serving threads for `cpus` CPUs: one per CPU up to
/// two, then half of them (at least two). The proxy shares its host with the
/// engines and their clients: on 16 cores, 16 threads each carrying a few
/// connections slept and woke more per request (28.8 and 31.4 µs of CPU per
/// forwarded request at c=64) than 8 (22.9 and 25.8 µs), and forwarded
/// 0.87× and 0.86× of nginx's requests against 0.98× and 0.90× (BENCHMARKS.md,
/// run Y).
pub fn default_count(cpus: usize) -> usize {
    if cpus <= 2 {
        cpus.max(1)
    } else {
        (cpus / 2).max(2)
    }
}

/// A serving thread started by [`spawn`]; `done` fires when its future has
/// finished (or the thread died).
#[derive(Debug)]
pub struct Serving {
    pub index: usize,
    pub done: oneshot::Receiver<()>,
}

/// Starts serving thread `index` (≥ 1): a new OS thread with a
/// single-threaded runtime that runs `serve` to completion.
pub fn spawn<F, Fut>(index: usize, serve: F) -> Result<Serving, Error>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let (tx, done) = oneshot::channel();
    std::thread::Builder::new()
        .name(format!("siesta-serve-{index}"))
        .spawn(move || {
            INDEX.with(|i| i.set(index));
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(error) => {
                    tracing::error!(thread = index, %error, "cannot start a serving thread's runtime");
                    return;
                }
            };
            rt.spawn(keep_a_timer_armed());
            rt.block_on(serve());
            // Tasks still on this runtime (aborted connections) go with it.
            drop(rt);
            let _ = tx.send(());
        })
        .map_err(|e| {
            Error::Config(format!(
                "cannot start serving thread {index}: {e} (lower --threads)"
            ))
        })?;
    Ok(Serving { index, done })
}

/// Keeps a timer pending on this thread's runtime, always. tokio's time
/// driver writes to its eventfd (waking its own thread's next `epoll_wait`
/// for nothing) whenever a timer is set while none was pending at the last
/// park; on a serving thread that is every keep-alive request (hyper sets
/// its header-read timer after each response, and nothing else here has a
/// timer). With a timer always due within a second, a 10 s header timer is
/// never the earliest and costs no syscall. (`strace`: 0.26 eventfd writes
/// per forwarded request before; BENCHMARKS.md run F.)
async fn keep_a_timer_armed() {
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_one_thread_per_cpu_up_to_two_then_half() {
        let got: Vec<usize> = [0, 1, 2, 3, 4, 5, 8, 16, 128]
            .into_iter()
            .map(default_count)
            .collect();
        assert_eq!(got, [1, 1, 2, 2, 2, 2, 4, 8, 64]);
    }

    #[tokio::test]
    async fn a_serving_thread_knows_its_index_and_reports_its_end() {
        assert_eq!(current(), 0);
        let (tx, rx) = oneshot::channel();
        let s = spawn(3, move || async move {
            // A timer works: the runtime has its drivers.
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            let _ = tx.send((current(), std::thread::current().name().map(str::to_owned)));
        })
        .unwrap();
        assert_eq!(s.index, 3);
        let (index, name) = rx.await.unwrap();
        assert_eq!(index, 3);
        assert_eq!(name.as_deref(), Some("siesta-serve-3"));
        s.done.await.expect("the thread reports its end");
        assert_eq!(current(), 0, "the caller's index is untouched");
    }
}
