//! Secrets stay secret: the control plane's token and the proxy's API keys
//! never appear in their logs (at debug level), wrong ones are refused, and
//! engines are bound to loopback.

use siesta_proto::v1 as pb;
use siesta_tests::ctl::*;
use siesta_tests::{Child, DEADLINE, bin_path, wait_addr_file, wait_until};
use std::process::Command;

const TOKEN: &str = "ctl-SECRET-7f3a9";
const WRONG_TOKEN: &str = "ctl-WRONG-0b1e2";
const API_KEY: &str = "pk-SECRET-c4d5e6";
const WRONG_KEY: &str = "pk-WRONG-998877";

/// Adds `authorization: Bearer TOKEN` to every call.
#[derive(Clone)]
struct Bearer(&'static str);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let v = format!("Bearer {}", self.0).parse().unwrap();
        req.metadata_mut().insert("authorization", v);
        Ok(req)
    }
}

type Authed = pb::control_client::ControlClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

fn authed(url: String, token: &'static str) -> Authed {
    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect_lazy();
    pb::control_client::ControlClient::with_interceptor(channel, Bearer(token))
}

/// Kills the engines of this test (they outlive a failed test's control plane).
struct KillTagged(String);

impl Drop for KillTagged {
    fn drop(&mut self) {
        kill_tagged(&self.0);
    }
}

#[tokio::test]
async fn token_and_api_keys_are_never_logged_and_engines_bind_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = KillTagged(format!("SIESTA_TEST_TAG={}", dir.path().display()));
    let cfg = config(&fake_model("chat", "awake", &[], ""))
        .replace("[control]\n", &format!("[control]\ntoken = \"{TOKEN}\"\n"))
        .replace("@DIR@", &dir.path().display().to_string())
        .replace("@FAKE_VLLM@", &siesta_tests::fake_vllm_command());
    let cfg_path = dir.path().join("siesta.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let addr_file = dir.path().join("control.addr");
    let mut cmd = Command::new(bin_path("siesta-control"));
    cmd.arg("--config")
        .arg(&cfg_path)
        .args(["--listen", "127.0.0.1:0", "--stop-engines-on-exit"])
        .arg("--addr-file")
        .arg(&addr_file)
        .env("RUST_LOG", "debug")
        .env_remove("SIESTA_TOKEN");
    let mut control = Child::spawn("siesta-control", cmd);
    let grpc = wait_addr_file(&mut control, &addr_file, &["grpc"], DEADLINE).await[0];
    let url = format!("http://{grpc}");

    // A wrong token is refused; the right one works.
    let mut wrong = authed(url.clone(), WRONG_TOKEN);
    let e = loop {
        match wrong.get_info(pb::GetInfoRequest {}).await {
            Err(e) if e.code() == tonic::Code::Unavailable => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await
            }
            other => break other.unwrap_err(),
        }
    };
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let mut c = authed(url.clone(), TOKEN);
    let s = loop {
        let s = c
            .get_model(pb::GetModelRequest {
                name: "chat".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .model
            .unwrap();
        if state(&s) == pb::ModelState::Awake {
            break s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };

    // The engine was told to bind loopback, and does.
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", s.pid)).unwrap();
    let argv: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let host = argv
        .iter()
        .position(|a| a == "--host")
        .map(|i| &argv[i + 1]);
    assert_eq!(host.map(String::as_str), Some("127.0.0.1"), "{argv:?}");
    assert!(endpoint(&s).starts_with("http://127.0.0.1:"));

    // A proxy that requires API keys, logging at debug level.
    let pdir = tempfile::tempdir().unwrap();
    let paddr = pdir.path().join("proxy.addr");
    let mut cmd = Command::new(bin_path("siesta-proxy"));
    cmd.args(["--control", &url, "--token", TOKEN, "--api-key", API_KEY])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .arg("--addr-file")
        .arg(&paddr)
        .env("RUST_LOG", "debug")
        .env_remove("SIESTA_API_KEYS");
    let mut proxy = Child::spawn("siesta-proxy", cmd);
    let http = wait_addr_file(&mut proxy, &paddr, &["http"], DEADLINE).await[0];
    let chat_url = format!("http://{http}/v1/chat/completions");
    let body = serde_json::json!({"model": "chat", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]});
    let client = reqwest::Client::new();
    wait_until("proxy serves with the right key", LONG, || async {
        client
            .post(&chat_url)
            .bearer_auth(API_KEY)
            .json(&body)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    for key in [Some(WRONG_KEY), None] {
        let mut req = client.post(&chat_url).json(&body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }

    // Let the last lines be written, then search every line of both.
    control.signal(nix::sys::signal::Signal::SIGTERM);
    control.wait_exit(DEADLINE).await;
    proxy.signal(nix::sys::signal::Signal::SIGTERM);
    proxy.wait_exit(DEADLINE).await;
    for (who, out) in [("control", control.output()), ("proxy", proxy.output())] {
        assert!(!out.lines().is_empty());
        for secret in [TOKEN, WRONG_TOKEN, API_KEY, WRONG_KEY] {
            assert!(
                !out.contains(secret),
                "{who} logged a secret: {:?}",
                out.find(secret)
            );
        }
    }
}
