//! A process engine on IPv6 loopback (`host = "::1"`): siesta starts it,
//! probes it at `http://[::1]:PORT`, publishes that URL, and the proxy
//! answers through it.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::spawn_proxy;
use std::time::Duration;

#[tokio::test]
async fn an_engine_on_ipv6_loopback_is_probed_and_answers_through_the_proxy() {
    let ctl = start(&config(&fake_model("v6", "awake", &[], "host = \"::1\""))).await;
    let mut c = ctl.client().await;
    let s = wait_state(&mut c, "v6", pb::ModelState::Awake, LONG).await;
    let url = endpoint(&s);
    assert!(url.starts_with("http://[::1]:"), "{url}");
    // On the first start: not after a start that timed out on a bad URL.
    assert_eq!(s.restarts, 1, "{s:#?}");
    let proxy = spawn_proxy(&[ctl.url()], &[]).await;
    proxy_ready(&proxy).await;
    try_chat(&proxy.url(), "v6", 4, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("through the proxy: {e}"));
}
