//! The e2e harness itself: spawning control and proxy on port 0, connecting, restarting,
//! and cleaning up process groups. Uses fake-vllm as the engine.

use siesta_proto::v1::ListModelsRequest;
use siesta_tests::{DEADLINE, any_alive, spawn_control, spawn_proxy, wait_until};

const CONFIG: &str = r#"
[control]
state_dir = "@DIR@/state"

[[model]]
name = "m"
model = "org/m"
executable = "@FAKE_VLLM@"
gpus = 0
preload = "none"
args = ["--startup-time", "50ms"]
"#;

#[tokio::test]
async fn control_and_proxy_start_on_port_0_and_restart() {
    let mut control = spawn_control(CONFIG).await;
    assert_ne!(control.addr.port(), 0);
    assert!(control.config_path.starts_with(control.dir.path()));
    let models = control
        .client()
        .await
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(format!("{models:?}").contains("\"m\""), "{models:?}");

    let proxy = spawn_proxy(&[control.url()], &[]).await;
    assert_ne!(proxy.http.port(), 0);
    assert_ne!(proxy.admin.port(), 0);
    assert_ne!(proxy.http, proxy.admin);

    let old_pid = control.child.pid() as i32;
    let addr = control.addr;
    control.restart().await;
    assert_eq!(
        control.addr, addr,
        "restart keeps the address so clients reconnect"
    );
    wait_until("the old control process to be gone", DEADLINE, || async {
        any_alive(&[old_pid]).is_empty()
    })
    .await;
    control
        .client()
        .await
        .list_models(ListModelsRequest {})
        .await
        .unwrap();
}

#[tokio::test]
async fn dropping_control_kills_the_engines_it_started_even_after_a_kill9() {
    let config = CONFIG.replace(r#"preload = "none""#, r#"preload = "awake""#);
    let mut control = spawn_control(&config).await;
    let control_pid = control.child.pid() as i32;
    let engines = || {
        let mut pids = control.owned_pids();
        pids.retain(|p| *p != control_pid);
        pids
    };
    wait_until(
        "an engine (and its engine core) to run",
        DEADLINE,
        || async { engines().len() >= 2 },
    )
    .await;
    let started = engines();
    control.kill9();
    assert_eq!(
        any_alive(&started),
        started,
        "engines outlive their control plane"
    );
    drop(control);
    wait_until("the engines to be gone", DEADLINE, || async {
        any_alive(&started).is_empty()
    })
    .await;
}
