//! Serving threads: every thread serves on its own, and all of them drain.

use std::sync::atomic::Ordering;

use siesta_proto::v1::ModelState;

use crate::control::{ScriptedControl, model};
use crate::engine::Engine;
use crate::support::*;

/// An engine and a ready proxy with `threads` serving threads. The engine,
/// and the clients, run on `side`; the proxy's first thread is `first`,
/// driven only inside `first.block_on`.
struct Stack {
    side: tokio::runtime::Runtime,
    first: tokio::runtime::Runtime,
    engine: Engine,
    _control: ScriptedControl,
    proxy: TestProxy,
}

fn stack(threads: usize) -> Stack {
    let side = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let engine = side.block_on(Engine::start("e1"));
    let control = ScriptedControl::start(vec![model("m", ModelState::Awake, &[&engine.url])]);
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let proxy = first.block_on(ready_proxy(vec![control.url()], |cfg| {
        cfg.threads = threads
    }));
    Stack {
        side,
        first,
        engine,
        _control: control,
        proxy,
    }
}

#[test]
fn the_other_threads_serve_while_the_first_is_not_running() {
    let Stack {
        side,
        first,
        engine: e,
        proxy: p,
        _control: _keep,
    } = stack(3);
    // `first` is not driven now: only threads 1 and 2 can accept and
    // forward. With one serving thread these requests would time out.
    let url = p.url("/v1/chat/completions");
    let statuses = side.block_on(async {
        let all: Vec<_> = (0..8)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { post(&url, &chat("m")).await.status })
            })
            .collect();
        let mut statuses = Vec::new();
        for r in all {
            statuses.push(r.await.unwrap().as_u16());
        }
        statuses
    });
    assert_eq!(statuses, vec![200; 8]);
    assert_eq!(e.count(), 8);
    let text = first.block_on(p.metrics());
    let on = |t: usize| {
        metric(
            &text,
            &format!("siesta_proxy_connections_total{{thread=\"{t}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(on(1) + on(2) >= 8.0, "{text}");
}

#[test]
fn a_request_in_flight_on_another_thread_is_finished_by_the_drain() {
    let Stack {
        side,
        first,
        engine: e,
        proxy: mut p,
        _control: _keep,
    } = stack(2);
    e.set_gate(false);
    let url = p.url("/v1/chat/completions");
    // Accepted by thread 1 (the first thread is not running).
    let req = side.spawn(async move { post(&url, &chat("m")).await });
    side.block_on(wait_until("the request at the engine", || async {
        e.state.in_flight.load(Ordering::SeqCst) == 1
    }));
    p.shutdown.cancel();
    let addr = p.addr;
    first.block_on(wait_until(
        "every thread stopped accepting",
        || async move { tokio::net::TcpStream::connect(addr).await.is_err() },
    ));
    // A one-second sample of an absence, the first thread running: run()
    // must not return while thread 1 drains (without the wait it returns in
    // milliseconds, after its last activity report).
    first.block_on(async { tokio::time::sleep(std::time::Duration::from_secs(1)).await });
    assert!(
        !p.task.is_finished(),
        "run() returned with a request in flight"
    );
    // Draining, not cut: still at the engine, the client still waiting.
    assert_eq!(e.state.in_flight.load(Ordering::SeqCst), 1);
    assert!(!req.is_finished());
    e.set_gate(true);
    let task = &mut p.task;
    let stopped = first.block_on(async move { tokio::time::timeout(DEADLINE, task).await });
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
    let r = side.block_on(async { tokio::time::timeout(DEADLINE, req).await });
    let r = r.expect("the request was not answered").unwrap();
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(e.count(), 1);
}
