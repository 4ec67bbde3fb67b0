//! The engine client against a small scripted HTTP/1.1 server on port 0.

use super::test_server::{Act, engine, engine_at};
use super::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

const T: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_wake_that_leaves_a_tag_asleep_fails_on_its_last_call_only() {
    let e = engine(|_, _, line| {
        if line.contains("/wake_up") {
            Act::Ok(r#"{"status":"sleeping","tags":["kv_cache"]}"#)
        } else {
            Act::Ok("")
        }
    })
    .await;
    let c = EngineClient::new(&e.url);
    // After the weights alone, the engine still sleeps: that is the plan.
    c.wake(WakeCall::WakeWeights, T).await.unwrap();
    for call in [WakeCall::WakeUp, WakeCall::WakeKvCache] {
        let err = c.wake(call, T).await.unwrap_err();
        assert!(
            err.contains("engine still asleep after /wake_up: tags [\"kv_cache\"]"),
            "{err}"
        );
    }
    // vLLM 0.2x answers an empty 200: a success.
    let old = engine(|_, _, _| Act::Ok("")).await;
    let c = EngineClient::new(&old.url);
    c.wake(WakeCall::WakeUp, T).await.unwrap();
    c.wake(WakeCall::WakeKvCache, T).await.unwrap();
    let new = engine(|_, _, _| Act::Ok(r#"{"status":"awake","tags":null}"#)).await;
    EngineClient::new(&new.url)
        .wake(WakeCall::WakeUp, T)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_sleep_answer_at_another_level_fails() {
    let e = engine(|_, _, _| Act::Ok(r#"{"status":"sleeping","level":1}"#)).await;
    let c = EngineClient::new(&e.url);
    c.sleep(1, T).await.unwrap();
    let err = c.sleep(2, T).await.unwrap_err();
    assert!(err.contains("level 1, level 2 was asked"), "{err}");
}

#[tokio::test]
async fn a_pooled_connection_the_engine_closed_is_retried_on_a_fresh_one() {
    // Each connection answers one request and closes on the next, as
    // uvicorn does when its keep-alive ends just as a request goes out.
    let e = engine(|_, n, _| if n == 0 { Act::Ok("") } else { Act::Close }).await;
    let c = EngineClient::with_idle_timeout(&e.url, Duration::from_secs(60));
    c.health(T).await.unwrap();
    c.health(T).await.unwrap();
    c.sleep(1, T).await.unwrap();
    assert_eq!(e.connections.load(Ordering::SeqCst), 3);
    // Still one retry only: an engine that always closes is an error.
    let dead = engine(|_, _, _| Act::Close).await;
    let err = EngineClient::new(&dead.url).health(T).await.unwrap_err();
    assert!(err.contains("tried twice"), "{err}");
    assert_eq!(dead.requests.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn idle_connections_are_dropped_before_the_engines_keep_alive() {
    let e = engine(|_, _, _| Act::Ok("")).await;
    let c = EngineClient::with_idle_timeout(&e.url, Duration::from_millis(100));
    c.health(T).await.unwrap();
    c.health(T).await.unwrap();
    // Back to back: the pooled connection is reused.
    assert_eq!(e.connections.load(Ordering::SeqCst), 1);
    // Idle longer than the idle timeout: a new connection.
    tokio::time::sleep(Duration::from_millis(400)).await;
    c.health(T).await.unwrap();
    assert_eq!(e.connections.load(Ordering::SeqCst), 2);
    assert!(DEFAULT_IDLE_TIMEOUT < Duration::from_secs(5));
}

#[tokio::test]
async fn a_probe_says_whether_the_engine_was_only_slow() {
    let short = Duration::from_millis(200);
    let hang = engine(|_, _, _| Act::Hang).await;
    let slow = EngineClient::new(&hang.url);
    assert!(slow.probe(short).await.unwrap_err().timed_out);
    assert!(slow.metrics_probe(short).await.unwrap_err().timed_out);
    // A closed connection is a fault, not load, for /health and /metrics.
    let close = engine(|_, _, _| Act::Close).await;
    let closed = EngineClient::new(&close.url);
    assert!(!closed.probe(T).await.unwrap_err().timed_out);
    assert!(!closed.metrics_probe(T).await.unwrap_err().timed_out);
}

#[tokio::test]
async fn is_sleeping_tells_no_answer_from_an_answer() {
    let busy = engine(|_, _, _| Act::Hang).await;
    let c = EngineClient::new(&busy.url);
    assert_eq!(
        c.is_sleeping_within(Duration::from_millis(200))
            .await
            .unwrap(),
        None
    );
    assert!(c.is_sleeping(Duration::from_millis(200)).await.is_err());
    // A timeout is not retried: one request only.
    assert_eq!(busy.requests.lock().unwrap().len(), 2);
    let awake = engine(|_, _, _| Act::Ok(r#"{"is_sleeping":false}"#)).await;
    let c = EngineClient::new(&awake.url);
    assert_eq!(c.is_sleeping_within(T).await.unwrap(), Some(false));
}

#[test]
fn metrics_parse() {
    let text = "# HELP x\nvllm:num_requests_running{model_name=\"a\",engine=\"0\"} 2.0\n\
        vllm:num_requests_running{model_name=\"a\",engine=\"1\"} 1.0\n\
        vllm:engine_sleep_state{sleep_state=\"awake\"} 0.0\n\
        vllm:engine_sleep_state{sleep_state=\"discard_all\"} 1.0\n";
    let m = parse_metrics(text);
    assert_eq!(m.running, 3);
    assert_eq!(m.sleep_level, Some(2));
    assert!(m.has_vllm_metrics);
}

#[test]
fn a_model_named_like_a_sleep_state_does_not_change_the_level() {
    let text = "vllm:engine_sleep_state{engine=\"0\",model_name=\"discard_all-7b\",sleep_state=\"awake\"} 1.0\n\
        vllm:engine_sleep_state{engine=\"0\",model_name=\"discard_all-7b\",sleep_state=\"weights_offloaded\"} 0.0\n\
        vllm:engine_sleep_state{engine=\"0\",model_name=\"discard_all-7b\",sleep_state=\"discard_all\"} 0.0\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"discard_all-7b\"} NaN\n";
    let m = parse_metrics(text);
    assert_eq!(m.sleep_level, Some(0));
    assert_eq!(m.running, 0);
    // Without vLLM's metrics (--disable-log-stats) nothing is known.
    let m = parse_metrics("process_cpu_seconds_total 1.0\n");
    assert_eq!(m, EngineMetrics::default());
}

#[test]
fn an_ipv6_host_is_bracketed_in_the_base_url() {
    assert_eq!(base_url("127.0.0.1", 8000), "http://127.0.0.1:8000");
    assert_eq!(base_url("localhost", 8000), "http://localhost:8000");
    assert_eq!(base_url("::1", 8000), "http://[::1]:8000");
    assert_eq!(base_url("[::1]", 8000), "http://[::1]:8000");
}

#[tokio::test]
async fn an_engine_on_ipv6_loopback_is_reached_through_its_base_url() {
    let e = engine_at("[::1]:0", |_, _, _| Act::Ok("")).await;
    let port: u16 = e.url.rsplit(':').next().unwrap().parse().unwrap();
    let c = EngineClient::new(&base_url("::1", port));
    c.health(T).await.unwrap();
    assert_eq!(e.requests.lock().unwrap().len(), 1);
}

/// An engine asleep by `/is_sleeping` whose `/metrics` answers `poll(i)` at
/// its `i`th poll: how many polls [`EngineClient::wait_for_drain`] made
/// before it returned (it must return `running`, 1 here).
async fn polls_of_a_drain(poll: impl Fn(usize) -> Act + Send + Sync + 'static) -> usize {
    let polls = Arc::new(AtomicUsize::new(0));
    let seen = polls.clone();
    let e = engine(move |_, _, line| {
        if line.contains("/is_sleeping") {
            return Act::Ok(r#"{"is_sleeping":true}"#);
        }
        poll(seen.fetch_add(1, Ordering::SeqCst))
    })
    .await;
    let c = EngineClient::new(&e.url);
    assert_eq!(c.wait_for_drain(Duration::from_secs(120)).await, 1);
    polls.load(Ordering::SeqCst)
}

/// Scripted `/metrics` for [`wait_for_drain`](EngineClient::wait_for_drain):
/// awake by the metric, `running` requests, `tokens` generated so far, the
/// KV cache `kv` used.
fn drain_metrics(running: u32, tokens: usize, kv: f64) -> Act {
    Act::Ok(Box::leak(
        format!(
            "vllm:engine_sleep_state{{engine=\"0\",sleep_state=\"awake\"}} 1\n\
             vllm:num_requests_running{{engine=\"0\"}} {running}\n\
             vllm:generation_tokens_total{{engine=\"0\"}} {tokens}\n\
             vllm:kv_cache_usage_perc{{engine=\"0\"}} {kv}\n"
        )
        .into_boxed_str(),
    ))
}

/// A wake waits while a sleep drains (`/is_sleeping` true, the metric
/// still awake, its requests making progress), and not for requests held
/// by a paused scheduler (`mode=keep`), which generate nothing and which
/// only the wake lets go: it waited half the wake timeout for them.
#[tokio::test]
async fn a_wake_waits_for_a_drain_but_not_for_requests_a_pause_holds() {
    let sleeping = |line: &str| line.contains("/is_sleeping");
    let paused = engine(move |_, _, line| {
        if sleeping(line) {
            Act::Ok(r#"{"is_sleeping":true}"#)
        } else {
            drain_metrics(1, 40, 0.05)
        }
    })
    .await;
    let t0 = std::time::Instant::now();
    let c = EngineClient::new(&paused.url);
    assert_eq!(c.wait_for_drain(Duration::from_secs(120)).await, 1);
    let took = t0.elapsed();
    assert!(took >= DRAIN_STALL, "{took:?}");
    assert!(
        took < Duration::from_secs(60),
        "waited for paused requests: {took:?}"
    );

    // Progress on every poll, for 30 of them, then done.
    let polls = polls_of_a_drain(|i| drain_metrics(u32::from(i < 30), 40 + i, 0.05)).await;
    assert_eq!(polls, 31, "left before the drain ended");
}

/// A drain whose request is in a long prefill generates nothing for far
/// longer than [`DRAIN_STALL`], but its KV cache grows chunk by chunk: it is
/// waited for to its end. Before, it was taken for requests a pause holds,
/// and the wake went out under the drain (which kills vLLM).
#[tokio::test]
async fn a_drain_in_a_long_prefill_is_waited_for() {
    // No token for 40 polls (4 s), the cache growing, then done.
    let polls =
        polls_of_a_drain(|i| drain_metrics(u32::from(i < 40), 7, 0.01 + 0.0002 * i as f64)).await;
    assert_eq!(polls, 41, "left before the drain ended");
}

/// A probe that times out mid-drain (a loaded box) says nothing either way:
/// the wait goes on to the drain's end. Before, the first slow `/metrics`
/// ended the wait, the wake went out under the drain, and the drain then
/// slept the memory the wake had just woken.
#[tokio::test]
async fn a_slow_probe_neither_starts_nor_ends_the_wait_for_a_drain() {
    let polls = polls_of_a_drain(|i| match i {
        // The first look, and two in the middle, are never answered.
        0 | 4 | 5 => Act::Hang,
        _ => drain_metrics(u32::from(i < 10), 40 + i, 0.05),
    })
    .await;
    assert_eq!(polls, 11, "left before the drain ended");
}

/// An engine whose probes never answer delays a wake by
/// [`DRAIN_UNKNOWN`], not by the whole wait it was given.
#[tokio::test(start_paused = true)]
async fn probes_that_never_answer_end_the_wait_for_a_drain_after_a_bound() {
    let e = engine(|_, _, _| Act::Hang).await;
    let c = EngineClient::new(&e.url);
    let t0 = tokio::time::Instant::now();
    assert_eq!(c.wait_for_drain(Duration::from_secs(600)).await, 0);
    let took = t0.elapsed();
    assert!(took >= DRAIN_UNKNOWN, "{took:?}");
    assert!(took < DRAIN_UNKNOWN + Duration::from_secs(5), "{took:?}");
}
