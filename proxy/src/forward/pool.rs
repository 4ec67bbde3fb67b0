//! Per-engine pool of idle upstream connections and the engine's slots for
//! concurrent requests.
//!
//! Checkout takes the most recently used idle connection (LIFO, so the rest
//! age out) and polls it first: one the engine has closed while it sat idle,
//! or one idle for longer than the idle timeout, is dropped, never used. A
//! light background task per engine drops connections idle past the
//! timeout, so their sockets and buffers are given back without traffic.
//!
//! Idle connections are kept per serving thread ([`crate::threads`]): a
//! connection is registered with the runtime of the thread that opened it and
//! is only ever used again there. The slots are the engine's, shared by all.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use http::uri::Authority;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::conn::UpstreamConn;

/// Idle upstream connections kept per engine.
pub const MAX_IDLE_PER_ENGINE: usize = 128;
/// Requests at one engine at once (so connections to it), by default
/// (`--engine-concurrency`): more wait here, in arrival order, for a slot,
/// up to their model's hold limit. This paces the release of a whole hold
/// queue (10,000 requests do not open 10,000 connections at once) and is
/// no lower than what vLLM runs at once (`max_num_seqs`: 256 to 1024).
pub const DEFAULT_ENGINE_CONCURRENCY: usize = 1024;

#[derive(Debug)]
struct Idle {
    conn: Box<UpstreamConn>,
    since: Instant,
}

/// The same for every engine: how long an idle connection is kept, how many
/// requests go to one engine at once, and how long an engine may send
/// nothing on a request it has.
#[derive(Debug, Clone, Copy)]
pub struct EngineLimits {
    pub idle_timeout: Duration,
    pub concurrency: usize,
    /// `--upstream-timeout`: no byte of a response's head, or of its body
    /// while it is read, for this long ends the request.
    pub quiet: Duration,
}

/// Default `--upstream-timeout`: as long as the OpenAI SDK waits.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);

/// One engine (`host:port`): its idle connections and its request slots.
#[derive(Debug)]
pub struct EnginePool {
    /// `host:port` to connect to (port 80 when the URL named none).
    addr: String,
    /// Per serving thread, the connections it opened and may reuse.
    idle: Box<[Mutex<Vec<Idle>>]>,
    idle_timeout: Duration,
    /// See [`EngineLimits::quiet`].
    pub quiet: Duration,
    /// Slots for concurrent requests ([`DEFAULT_ENGINE_CONCURRENCY`]).
    pub slots: Arc<Semaphore>,
}

impl EnginePool {
    /// A pool for `authority`'s engine, served by `threads` serving threads;
    /// starts, on `reaper` (a runtime that outlives the serving threads'),
    /// the task that drops expired idle connections (it ends when the pool
    /// is dropped). Idle connections hold their pool, so it is that task
    /// that lets an unused pool go.
    pub fn new(
        authority: &Authority,
        limits: EngineLimits,
        threads: usize,
        reaper: &tokio::runtime::Handle,
    ) -> Arc<EnginePool> {
        let EngineLimits {
            idle_timeout,
            concurrency,
            quiet,
        } = limits;
        let addr = match authority.port_u16() {
            Some(_) => authority.as_str().to_owned(),
            None => format!("{}:80", authority.host()),
        };
        let pool = Arc::new(EnginePool {
            addr,
            idle: (0..threads.max(1))
                .map(|_| Mutex::new(Vec::new()))
                .collect(),
            idle_timeout,
            quiet,
            slots: Arc::new(Semaphore::new(concurrency.max(1))),
        });
        reaper.spawn(reap(Arc::downgrade(&pool), idle_timeout));
        pool
    }

    /// The engine's `host:port`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This serving thread's share of the idle connections.
    pub fn shard_here(&self) -> usize {
        crate::threads::current() % self.idle.len()
    }

    /// An idle connection of this serving thread that can carry a request
    /// now, if there is one.
    pub fn checkout(&self) -> Option<Box<UpstreamConn>> {
        let shard = &self.idle[self.shard_here()];
        loop {
            let idle = shard.lock().unwrap().pop()?;
            if idle.since.elapsed() >= self.idle_timeout {
                // The newest is too old: so are all the others.
                let stale = std::mem::take(&mut *shard.lock().unwrap());
                drop(stale);
                return None;
            }
            let mut conn = idle.conn;
            if conn.is_usable() {
                return Some(conn);
            }
            tracing::debug!(engine = %self.addr, "dropping an idle connection the engine closed");
        }
    }

    /// Keeps `conn` for the next request on the thread that opened it (at
    /// most [`MAX_IDLE_PER_ENGINE`] per thread).
    pub fn put_back(&self, conn: Box<UpstreamConn>) {
        let mut idle = self.idle[conn.shard % self.idle.len()].lock().unwrap();
        if idle.len() < MAX_IDLE_PER_ENGINE {
            idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// Idle connections now.
    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.idle.iter().map(|s| s.lock().unwrap().len()).sum()
    }

    /// Closes every idle connection now.
    pub fn close_idle(&self) {
        for shard in &self.idle {
            let idle = std::mem::take(&mut *shard.lock().unwrap());
            drop(idle);
        }
    }

    /// Drops connections idle for the idle timeout or closed by the engine.
    fn prune(&self) {
        for shard in &self.idle {
            let expired: Vec<Idle> = {
                let mut idle = shard.lock().unwrap();
                let (keep, expired) = std::mem::take(&mut *idle)
                    .into_iter()
                    .partition(|i| i.since.elapsed() < self.idle_timeout);
                *idle = keep;
                expired
            };
            drop(expired);
        }
    }
}

async fn reap(pool: Weak<EnginePool>, idle_timeout: Duration) {
    let every = (idle_timeout / 4).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(every).await;
        match pool.upgrade() {
            Some(p) => p.prune(),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(30);

    /// A pool on this test's runtime.
    fn pool(authority: &Authority, idle: Duration, threads: usize) -> Arc<EnginePool> {
        let limits = EngineLimits {
            idle_timeout: idle,
            concurrency: DEFAULT_ENGINE_CONCURRENCY,
            quiet: DEFAULT_UPSTREAM_TIMEOUT,
        };
        EnginePool::new(
            authority,
            limits,
            threads,
            &tokio::runtime::Handle::current(),
        )
    }

    async fn engine() -> (tokio::net::TcpListener, Authority) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap().to_string().parse().unwrap();
        (l, a)
    }

    #[tokio::test]
    async fn checkout_drops_an_idle_connection_the_engine_closed() {
        let (listener, authority) = engine().await;
        let pool = pool(&authority, Duration::from_secs(60), 1);
        let conn = UpstreamConn::connect(&pool).await.unwrap();
        let (engine_side, _) = listener.accept().await.unwrap();
        conn.release();
        assert_eq!(pool.idle_count(), 1, "an open connection goes back");
        let conn = pool.checkout().expect("an open idle connection is used");
        assert!(conn.reused);
        conn.release();
        drop(engine_side);
        let start = Instant::now();
        while let Some(conn) = pool.checkout() {
            assert!(
                start.elapsed() < DEADLINE,
                "a closed connection still checked out"
            );
            conn.release();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn idle_connections_are_dropped_after_the_idle_timeout_without_traffic() {
        let (listener, authority) = engine().await;
        let pool = pool(&authority, Duration::from_millis(50), 1);
        let conn = UpstreamConn::connect(&pool).await.unwrap();
        let (mut engine_side, _) = listener.accept().await.unwrap();
        conn.release();
        assert_eq!(pool.idle_count(), 1);
        // The reaper closes it: the engine reads the end of the stream.
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(
            DEADLINE,
            tokio::io::AsyncReadExt::read(&mut engine_side, &mut b),
        )
        .await
        .expect("the idle connection was not closed")
        .unwrap();
        assert_eq!(n, 0);
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn a_connection_is_reused_only_by_the_serving_thread_that_opened_it() {
        let (listener, authority) = engine().await;
        let pool = pool(&authority, Duration::from_secs(60), 2);
        let accept = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            s
        });
        // Thread 1 opens a connection and puts it back.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let p1 = pool.clone();
        let (again_tx, again_rx) = tokio::sync::oneshot::channel::<()>();
        let (reused_tx, reused_rx) = tokio::sync::oneshot::channel();
        let t = crate::threads::spawn(1, move || async move {
            let conn = UpstreamConn::connect(&p1).await.unwrap();
            assert_eq!(conn.shard, 1);
            conn.release();
            let _ = tx.send(());
            let _ = again_rx.await;
            // Back on thread 1: its own idle connection is there.
            let _ = reused_tx.send(p1.checkout().map(|c| c.reused));
        })
        .unwrap();
        rx.await.unwrap();
        let _engine_side = tokio::time::timeout(DEADLINE, accept)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(pool.idle_count(), 1);
        assert!(
            pool.checkout().is_none(),
            "thread 0 took a connection registered with thread 1's runtime"
        );
        again_tx.send(()).unwrap();
        assert_eq!(reused_rx.await.unwrap(), Some(true));
        t.done.await.unwrap();
    }

    #[tokio::test]
    async fn a_connection_that_is_not_poolable_is_closed_on_release() {
        let (listener, authority) = engine().await;
        let pool = pool(&authority, Duration::from_secs(60), 1);
        let mut conn = UpstreamConn::connect(&pool).await.unwrap();
        let (_engine_side, _) = listener.accept().await.unwrap();
        conn.poolable = false;
        conn.release();
        assert_eq!(pool.idle_count(), 0);
        assert!(pool.checkout().is_none());
    }
}
