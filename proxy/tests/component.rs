//! Component tests: the proxy in-process against a scripted control plane
//! (a real tonic server) and tiny in-process engines.

#[path = "component/control.rs"]
mod control;
#[path = "component/engine.rs"]
mod engine;
#[path = "component/support.rs"]
mod support;

#[path = "component/drain_test.rs"]
mod drain_test;
#[path = "component/errors_test.rs"]
mod errors_test;
#[path = "component/forward_test.rs"]
mod forward_test;
#[path = "component/hold_test.rs"]
mod hold_test;
#[path = "component/http1_test.rs"]
mod http1_test;
#[path = "component/slow_clients_test.rs"]
mod slow_clients_test;
#[path = "component/threads_test.rs"]
mod threads_test;
#[path = "component/upstream_conn_test.rs"]
mod upstream_conn_test;
#[path = "component/upstream_http_test.rs"]
mod upstream_http_test;
#[path = "component/upstream_pool_test.rs"]
mod upstream_pool_test;
#[path = "component/watch_test.rs"]
mod watch_test;
