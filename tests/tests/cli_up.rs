//! `siesta up` with the built-in demo: one process, control plane and proxy
//! over loopback gRPC, fake-vllm engines run as `siesta fake-vllm`. A chat
//! completion for a sleeping model wakes it and is answered; Ctrl-C stops
//! everything, engines included.

use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use siesta_tests::ctl::kill_tagged;
use siesta_tests::{
    Child, DEADLINE, any_alive, bin_path, descendants, pids_with_env, wait_addr_file, wait_until,
};

/// `siesta --control URL status -o json`, parsed.
fn status(grpc: std::net::SocketAddr) -> Value {
    let out = Command::new(bin_path("siesta"))
        .args([
            "--control",
            &format!("http://{grpc}"),
            "status",
            "-o",
            "json",
        ])
        .env_remove("SIESTA_TOKEN")
        .output()
        .expect("running siesta status");
    assert!(out.status.success(), "siesta status: {out:?}");
    serde_json::from_slice(&out.stdout).expect("status JSON")
}

fn model<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("{name} in {status}"))
}

/// A running `siesta up` and the engines it started. Dropping it (a failed
/// or panicking test too) SIGKILLs `siesta up`, then every process carrying
/// its `SIESTA_TEST_TAG`: the engines inherit it, but run in process groups
/// of their own and outlive a killed `siesta up` (as they outlive a killed
/// siesta-control, to be adopted), so the [`Child`]'s group kill misses them.
struct Up {
    child: Child,
    tag: String,
}

impl std::ops::Deref for Up {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.child
    }
}

impl std::ops::DerefMut for Up {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        // `siesta up` first, so it cannot restart what is killed next.
        self.child.kill9();
        kill_tagged(&self.tag);
    }
}

/// `siesta up` with the built-in demo on port-0 listeners, its addresses
/// written to `addr_file`; the demo keeps its state under `TMPDIR`, made this
/// test's own, and its processes are tagged with it (see [`Up`]).
fn spawn_up(tmp: &std::path::Path, addr_file: &std::path::Path) -> Up {
    spawn_up_with(tmp, addr_file, &[])
}

/// [`spawn_up`] with more arguments (a `--config`).
fn spawn_up_with(tmp: &std::path::Path, addr_file: &std::path::Path, args: &[&str]) -> Up {
    spawn_up_of(&bin_path("siesta"), tmp, addr_file, args)
}

/// `siesta up --config FILE`, FILE being `[control]` with this test's state
/// directory and the `control` lines, then `rest` (`EXE`: fake-vllm's
/// path); with the address file it writes.
fn spawn_up_configured(
    dir: &std::path::Path,
    control: &str,
    rest: &str,
) -> (Up, std::path::PathBuf) {
    let config = dir.join("up.toml");
    let exe = format!("{:?}", bin_path("fake-vllm"));
    let text = format!(
        "[control]\nstate_dir = {:?}\n{control}\n\n{}",
        dir.join("state"),
        rest.replace("EXE", &exe)
    );
    std::fs::write(&config, text).unwrap();
    let addr_file = dir.join("up.addr");
    let up = spawn_up_with(dir, &addr_file, &["--config", config.to_str().unwrap()]);
    (up, addr_file)
}

/// [`spawn_up_with`] running the `siesta` binary at `siesta`.
fn spawn_up_of(
    siesta: &std::path::Path,
    tmp: &std::path::Path,
    addr_file: &std::path::Path,
    args: &[&str],
) -> Up {
    let mut cmd = Command::new(siesta);
    cmd.args([
        "up",
        "--listen",
        "127.0.0.1:0",
        "--control-listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .args(args)
    .arg("--addr-file")
    .arg(addr_file)
    .env("TMPDIR", tmp)
    .env("SIESTA_TEST_TAG", tmp)
    .env_remove("SIESTA_TOKEN");
    Up {
        child: Child::spawn("siesta-up", cmd),
        tag: format!("SIESTA_TEST_TAG={}", tmp.display()),
    }
}

/// `signal` to `up`: it exits 0 and every engine it ran is gone.
async fn stops_with_its_engines(up: &mut Up, signal: Signal) {
    let engines = descendants(up.pid() as i32);
    assert!(!engines.is_empty(), "engines run as children of siesta up");
    up.signal(signal);
    let status = up.wait_exit(Duration::from_secs(60)).await;
    assert!(
        status.success(),
        "siesta up exited with {status}: {}",
        up.output().text()
    );
    wait_until("engines gone", DEADLINE, || {
        let left = any_alive(&engines);
        async move { left.is_empty() }
    })
    .await;
}

#[tokio::test]
async fn up_with_the_demo_answers_a_sleeping_model() {
    let dir = tempfile::tempdir().unwrap();
    let addr_file = dir.path().join("up.addr");
    let mut up = spawn_up(dir.path(), &addr_file);
    let addrs = wait_addr_file(&mut up, &addr_file, &["http", "admin", "grpc"], DEADLINE).await;
    let (http, grpc) = (addrs[0], addrs[2]);

    // The banner tells where the API is and what to try.
    let banner = up.output().wait_for("OpenAI API", DEADLINE).await;
    assert!(banner.contains(&format!("http://{http}/v1")), "{banner}");
    up.output().wait_for("siesta --control", DEADLINE).await;

    // The demo's chat model is preloaded asleep.
    wait_until("chat asleep", Duration::from_secs(60), || async {
        model(&status(grpc), "chat")["state"] == "asleep"
    })
    .await;

    // A chat completion for the sleeping model is held, the model wakes, and it answers.
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8});
    let resp = reqwest::Client::new()
        .post(format!("http://{http}/v1/chat/completions"))
        .json(&body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("chat completion");
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.unwrap();
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty()),
        "{answer}"
    );
    let chat = model(&status(grpc), "chat").clone();
    assert_eq!(chat["state"], "awake", "{chat}");
    assert!(
        chat["calibration"]["wake_l1_ms"].as_u64().unwrap() > 0,
        "wake measured: {chat}"
    );

    // `siesta up` itself shows the model waking, one line per change.
    up.output()
        .wait_for("chat: asleep(l1) → waking", DEADLINE)
        .await;
    up.output().wait_for("chat: waking → awake", DEADLINE).await;

    // Ctrl-C: everything stops, engines included.
    stops_with_its_engines(&mut up, Signal::SIGINT).await;
}

/// The demo's terminal hangs up (an SSH session dropped): SIGHUP stops it as
/// Ctrl-C does, engines included. It went on serving, unseen, holding its
/// ports and engines, and the next `siesta up` could not listen.
#[tokio::test]
async fn a_hang_up_stops_the_demo() {
    let dir = tempfile::tempdir().unwrap();
    let addr_file = dir.path().join("up.addr");
    let mut up = spawn_up(dir.path(), &addr_file);
    let addrs = wait_addr_file(&mut up, &addr_file, &["http", "admin", "grpc"], DEADLINE).await;
    wait_until("chat asleep", Duration::from_secs(60), || async {
        model(&status(addrs[2]), "chat")["state"] == "asleep"
    })
    .await;
    stops_with_its_engines(&mut up, Signal::SIGHUP).await;
}

/// Ctrl-C while one request streams from an awake model and another is held
/// for a model still starting: the stream finishes (the proxy drains before
/// the control plane stops the engines); no wake will come for the held one,
/// so it is answered at once (503 `proxy_shutting_down`, Retry-After), not at
/// the end of the drain; `up` exits 0 and every engine is stopped.
#[tokio::test]
async fn ctrl_c_finishes_streams_and_answers_held_requests_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("slow.toml");
    std::fs::write(
        &config,
        format!(
            "[control]\nstate_dir = {:?}\n\n[[model]]\nname = \"slow\"\nmodel = \"org/slow\"\n\
             executable = {fake:?}\nargs = [\"--startup-time\", \"300s\"]\n\n\
             [[model]]\nname = \"steady\"\nmodel = \"org/steady\"\npreload = \"awake\"\n\
             executable = {fake:?}\nargs = [\"--startup-time\", \"0s\", \"--tokens-per-second\", \"10\"]\n",
            dir.path().join("state"),
            fake = bin_path("fake-vllm"),
        ),
    )
    .unwrap();
    let addr_file = dir.path().join("up.addr");
    let mut up = spawn_up_with(
        dir.path(),
        &addr_file,
        &["--config", config.to_str().unwrap()],
    );
    let addrs = wait_addr_file(&mut up, &addr_file, &["http", "admin", "grpc"], DEADLINE).await;
    let (http, admin) = (addrs[0], addrs[1]);
    let grpc = addrs[2];
    wait_until("steady awake", DEADLINE, || async {
        model(&status(grpc), "steady")["state"] == "awake"
    })
    .await;
    // 20 tokens at 10 a second: streaming for about 2 s after the signal.
    let mut stream = reqwest::Client::new()
        .post(format!("http://{http}/v1/chat/completions"))
        .json(&json!({"model": "steady", "max_tokens": 20, "stream": true,
            "messages": [{"role": "user", "content": "hi"}]}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("stream started");
    assert_eq!(stream.status(), 200);
    let first = stream.chunk().await.unwrap().expect("a first event");
    let held = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("http://{http}/v1/chat/completions"))
            .json(&json!({"model": "slow", "messages": [{"role": "user", "content": "hi"}]}))
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .expect("an answer, not a cut connection")
    });
    wait_until("the request held", DEADLINE, || async move {
        let Ok(r) = reqwest::get(format!("http://{admin}/metrics")).await else {
            return false;
        };
        r.text()
            .await
            .unwrap_or_default()
            .lines()
            .any(|l| l == "siesta_proxy_held_requests{model=\"slow\"} 1")
    })
    .await;
    let engines = descendants(up.pid() as i32);
    let t0 = std::time::Instant::now();
    up.signal(Signal::SIGINT);
    let r = held.await.unwrap();
    let waited = t0.elapsed();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "proxy_shutting_down", "{body}");
    // Held until near the end of the drain it would be answered after 9 s
    // (the drain of `up`'s proxy is 10 s): this is at the signal.
    assert!(waited < Duration::from_secs(8), "answered after {waited:?}");
    let mut streamed = first.to_vec();
    while let Some(c) = stream.chunk().await.expect("the stream is not cut") {
        streamed.extend_from_slice(&c);
    }
    let streamed = String::from_utf8_lossy(&streamed);
    assert!(streamed.trim_end().ends_with("data: [DONE]"), "{streamed}");
    let status = up.wait_exit(Duration::from_secs(60)).await;
    assert!(status.success(), "{status}: {}", up.output().text());
    wait_until("engines gone", DEADLINE, || {
        let left = any_alive(&engines);
        async move { left.is_empty() }
    })
    .await;
}

/// Ctrl-C with an engine that ignores SIGTERM (its `stop_grace` longer
/// than the 30 s `up` used to give the control plane): `up` waits for the
/// SIGKILL after the grace and the sweep of the engine's process group,
/// and exits with nothing left holding its GPUs.
#[tokio::test]
async fn ctrl_c_kills_an_engine_that_ignores_sigterm_after_its_stop_grace() {
    let (_dir, mut up, pgid) = up_with_a_stubborn_engine("32s").await;
    assert!(!siesta_tests::group_members(pgid).is_empty());
    up.signal(Signal::SIGINT);
    let status = up.wait_exit(Duration::from_secs(150)).await;
    let text = up.output().text();
    assert!(status.success(), "{status}: {text}");
    let group = || {
        let left = siesta_tests::group_members(pgid);
        async move { left.is_empty() }
    };
    let what = format!("stubborn's engine (process group {pgid}) gone");
    wait_until(&what, Duration::from_secs(5), group).await;
    assert!(!text.contains("took longer"), "{text}");
}

/// An address file that cannot be written ends `up` at once, exit 1, with a
/// message naming the file (after stopping what it had started).
#[tokio::test]
async fn up_fails_clearly_when_the_address_file_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let addr_file = dir.path().join("no-such-dir").join("up.addr");
    let mut up = spawn_up(dir.path(), &addr_file);
    let status = up.wait_exit(DEADLINE).await;
    let text = up.output().text();
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(
        text.contains("cannot write the address file") && text.contains("no-such-dir"),
        "{text}"
    );
    // Nothing it started outlives it: every engine (and engine core) that
    // carries this test's tag is gone.
    let tag = dir.path().to_string_lossy().into_owned();
    wait_until("no engine of the failed `up` left", DEADLINE, || {
        let left = pids_with_env("SIESTA_TEST_TAG", &tag);
        async move { left.is_empty() }
    })
    .await;
}

/// A configuration the control plane refuses once it sees the GPUs (a model
/// that can never fit): `up` prints no banner promising the models "once
/// siesta-control serves", only the reason, and exits 1.
#[tokio::test]
async fn up_whose_control_plane_refuses_its_gpus_prints_the_reason_and_no_banner() {
    let dir = tempfile::tempdir().unwrap();
    let (mut up, _) = spawn_up_configured(
        dir.path(),
        "",
        "[[gpu]]\nindex = 0\nmemory = \"80GiB\"\n\n[[model]]\nname = \"huge\"\n\
         model = \"org/huge\"\nexecutable = EXE\ngpus = 1\ngpu_memory = \"100GiB\"\n",
    );
    let status = up.wait_exit(DEADLINE).await;
    let text = up.output().text();
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(
        text.contains("siesta-control stopped")
            && text.contains("needs 1 × 100.0 GiB but GPU 0 has 80.0 GiB"),
        "{text}"
    );
    assert!(!text.contains("siesta is up"), "{text}");
}

/// A second Ctrl-C while `up` waits out an engine's long stop grace kills
/// the engine's whole process group at once and exits 130: an operator who
/// will not wait is never left with an engine holding its GPUs.
#[tokio::test]
async fn a_second_ctrl_c_kills_the_engines_now() {
    let (_dir, mut up, pgid) = up_with_a_stubborn_engine("300s").await;
    up.signal(Signal::SIGINT);
    up.output()
        .wait_for("Ctrl-C again to kill them now", DEADLINE)
        .await;
    // The group leader ignores the SIGTERM: up would wait 300 s.
    assert!(!siesta_tests::group_members(pgid).is_empty());
    up.signal(Signal::SIGINT);
    let status = up.wait_exit(DEADLINE).await;
    let text = up.output().text();
    assert_eq!(status.code(), Some(130), "{text}");
    assert!(text.contains("killed 1 engine process group"), "{text}");
    assert_eq!(siesta_tests::group_members(pgid), Vec::<i32>::new());
}

/// `siesta up` with one awake `openai` engine whose group leader ignores
/// SIGTERM (as do its `sleep`s; the server it runs does not, so the model
/// is awake until the signal), given `stop_grace`. Returns the test's
/// directory, `up` and the engine's process group (it leads its own).
async fn up_with_a_stubborn_engine(stop_grace: &str) -> (tempfile::TempDir, Up, i32) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("stubborn.toml");
    let script = "trap '' TERM; \"$0\" --personality openai serve stubborn \
                  --host \"$1\" --port \"$2\" & while :; do sleep 1; done";
    std::fs::write(
        &config,
        format!(
            "[control]\nstate_dir = {:?}\n\n[[model]]\nname = \"stubborn\"\n\
             model = \"org/stubborn\"\nengine = \"openai\"\npreload = \"awake\"\n\
             command = [\"sh\", \"-c\", {script:?}, {fake:?}]\n\
             args = [\"{{host}}\", \"{{port}}\"]\nstop_grace = {stop_grace:?}\n",
            dir.path().join("state"),
            fake = bin_path("fake-vllm"),
        ),
    )
    .unwrap();
    let addr_file = dir.path().join("up.addr");
    let mut up = spawn_up_with(
        dir.path(),
        &addr_file,
        &["--config", config.to_str().unwrap()],
    );
    let addrs = wait_addr_file(&mut up, &addr_file, &["http", "admin", "grpc"], DEADLINE).await;
    let grpc = addrs[2];
    wait_until("stubborn awake", DEADLINE, || async {
        model(&status(grpc), "stubborn")["state"] == "awake"
    })
    .await;
    let pgid = model(&status(grpc), "stubborn")["pid"].as_i64().unwrap() as i32;
    (dir, up, pgid)
}

/// `up --config` with `[control] token` and no `--token`/`SIESTA_TOKEN`:
/// the control plane requires the config's token, so `up`'s own proxy and
/// clients must send it. They used to send only the CLI's token (none): the
/// proxy's Watch was refused, and every request got 503 `proxy_not_ready`.
#[tokio::test]
async fn up_with_a_config_token_serves_without_one_in_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let (mut up, addr_file) = spawn_up_configured(
        dir.path(),
        "token = \"s3cret\"",
        "[[model]]\nname = \"chat\"\nmodel = \"org/chat\"\nexecutable = EXE\ngpus = 0\n\
         start_timeout = \"60s\"\n",
    );
    let addrs = wait_addr_file(&mut up, &addr_file, &["http", "admin", "grpc"], DEADLINE).await;
    let http = addrs[0];
    // A request for the stopped model starts it and is answered (the proxy
    // waits for its first Watch snapshot, which a refused Watch never gives).
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4});
    let resp = reqwest::Client::new()
        .post(format!("http://{http}/v1/chat/completions"))
        .json(&body)
        .timeout(Duration::from_secs(90))
        .send()
        .await
        .expect("chat completion");
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 200, "{text}\n{}", up.output().text());
    // The banner lists the models: `up`'s own client was let in.
    up.output()
        .wait_for("Ctrl-C stops everything", DEADLINE)
        .await;
    assert!(
        up.output().contains("models       chat ("),
        "{}",
        up.output().text()
    );
    up.signal(Signal::SIGINT);
    let exit = up.wait_exit(Duration::from_secs(60)).await;
    assert!(exit.success(), "{exit}: {}", up.output().text());
}

/// `siesta up 2>&1 | tee up.log`, then Ctrl-C: the SIGINT reaches the whole
/// pipeline, `tee` is gone first, and `up`'s "shutting down" meets a closed
/// pipe. The line is lost, the shutdown is not: `up` exits 0 and every
/// engine it started is stopped (std's `eprintln!` panicked here, exit 101,
/// and the engines ran on unmanaged).
#[tokio::test]
async fn ctrl_c_with_stderr_gone_still_stops_the_engines() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let addr_file = dir.path().join("up.addr");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut child = Command::new(bin_path("siesta"))
        .args([
            "up",
            "--listen",
            "127.0.0.1:0",
            "--control-listen",
            "127.0.0.1:0",
        ])
        .arg("--addr-file")
        .arg(&addr_file)
        .env("TMPDIR", dir.path())
        .env("SIESTA_TEST_TAG", dir.path())
        .env_remove("SIESTA_TOKEN")
        .process_group(0)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(writer)
        .spawn()
        .unwrap();
    let tag = dir.path().to_string_lossy().into_owned();
    let _cleanup = scopeguard(child.id(), format!("SIESTA_TEST_TAG={tag}"));
    let grpc = wait_until_some("up's addresses", DEADLINE, || {
        siesta_tests::read_addr_file(&addr_file)
            .and_then(|a| a.into_iter().find(|(k, _)| k == "grpc").map(|(_, v)| v))
    })
    .await;
    wait_until("chat's engine asleep", Duration::from_secs(60), || async {
        model(&status(grpc), "chat")["state"] == "asleep"
    })
    .await;
    let engines: Vec<i32> = pids_with_env("SIESTA_TEST_TAG", &tag)
        .into_iter()
        .filter(|p| *p != child.id() as i32)
        .collect();
    assert!(!engines.is_empty(), "the demo's engines run");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        Signal::SIGINT,
    )
    .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "up never exited");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "siesta up exited with {status}");
    wait_until("engines gone", DEADLINE, || {
        let left = any_alive(&engines);
        async move { left.is_empty() }
    })
    .await;
}

/// Polls `f` (every 50 ms, up to `deadline`) until it gives a value.
async fn wait_until_some<T>(what: &str, deadline: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// On drop (a failed test too): SIGKILL to `pid`, then to every process
/// carrying `tag` (its engines), as [`Up`] does.
fn scopeguard(pid: u32, tag: String) -> impl Drop {
    struct Guard(u32, String);
    impl Drop for Guard {
        fn drop(&mut self) {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0 as i32), Signal::SIGKILL);
            kill_tagged(&self.1);
        }
    }
    Guard(pid, tag)
}

/// A control plane that takes longer to serve than a call's 30 s deadline
/// (here a P2P probe at start that runs 40 s; on a real box: many GPUs to
/// probe, NVML slow to answer, engines of the last run to adopt): `up`'s
/// banner says the models come later, and once it serves, they and every
/// change after are printed. Before, `up` gave up its Watch after 30 s and
/// printed nothing more for its whole life.
#[tokio::test]
async fn up_prints_the_models_and_their_changes_once_a_slow_control_plane_serves() {
    let dir = tempfile::tempdir().unwrap();
    // The probe is looked for next to the running binary.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::copy(bin_path("siesta"), bin.join("siesta")).unwrap();
    let probe = bin.join("siesta-p2p-probe");
    std::fs::write(&probe, "#!/bin/sh\nsleep 40\nexit 1\n").unwrap();
    std::fs::set_permissions(&probe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let config = dir.path().join("slow-control.toml");
    std::fs::write(
        &config,
        format!(
            "[control]\nstate_dir = {:?}\np2p_probe_timeout = \"90s\"\n\n\
             [[gpu]]\nindex = 0\nname = \"test-gpu\"\nmemory = \"80GiB\"\n\n\
             [[gpu]]\nindex = 1\nname = \"test-gpu\"\nmemory = \"80GiB\"\n\n\
             [[model]]\nname = \"m\"\nmodel = \"org/m\"\nexecutable = {fake:?}\n\
             args = [\"--startup-time\", \"0s\"]\n",
            dir.path().join("state"),
            fake = bin_path("fake-vllm"),
        ),
    )
    .unwrap();
    let addr_file = dir.path().join("up.addr");
    let mut up = spawn_up_of(
        &bin.join("siesta"),
        dir.path(),
        &addr_file,
        &["--config", config.to_str().unwrap()],
    );
    let addrs = wait_addr_file(&mut up, &addr_file, &["http", "admin", "grpc"], DEADLINE).await;
    let http = addrs[0];
    let banner = up
        .output()
        .wait_for("listed below once siesta-control serves", DEADLINE)
        .await;
    assert!(!banner.contains("  models       m ("), "{banner}");
    // The probe ends after 40 s; the Watch opened at once gave up at 30 s.
    let slow = Duration::from_secs(120);
    up.output().wait_for("snapshot: 1 models", slow).await;
    up.output().wait_for("m: stopped", slow).await;
    let r = reqwest::Client::new()
        .post(format!("http://{http}/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .timeout(slow)
        .send()
        .await
        .expect("an answer");
    assert_eq!(r.status(), 200);
    up.output().wait_for("m: starting → awake", slow).await;
}

/// `siesta up --token T` makes the control plane it runs require `T`
/// (its own proxy and banner client send it): a client without it is
/// refused, one with it served. (`--token` was taken only as the token to
/// send, and the control plane required none.) One that differs from the
/// file's `[control] token` is refused before anything starts.
#[tokio::test]
async fn up_with_a_token_flag_requires_it_of_clients() {
    let tmp = tempfile::tempdir().unwrap();
    let addr_file = tmp.path().join("up.addr");
    let mut up = spawn_up_with(tmp.path(), &addr_file, &["--token", "t0ken"]);
    let addrs = wait_addr_file(&mut up, &addr_file, &["http", "admin", "grpc"], DEADLINE).await;
    let control = format!("http://{}", addrs[2]);
    let run = |token: Option<&str>| {
        let mut cmd = Command::new(bin_path("siesta"));
        cmd.args(["--control", &control, "status"])
            .env_remove("SIESTA_TOKEN");
        if let Some(t) = token {
            cmd.args(["--token", t]);
        }
        cmd.output().expect("running siesta status")
    };
    let without = run(None);
    assert!(!without.status.success(), "{without:?}");
    let said = String::from_utf8_lossy(&without.stderr);
    assert!(said.contains("token"), "{said}");
    let with = run(Some("t0ken"));
    assert!(with.status.success(), "{with:?}");
    assert!(
        String::from_utf8_lossy(&with.stdout).contains("chat"),
        "{with:?}"
    );
    // Its own proxy sends it: the banner's listing came through.
    up.output()
        .wait_for("Ctrl-C stops everything", DEADLINE)
        .await;
    assert!(
        up.output().contains("models       chat ("),
        "{}",
        up.output().text()
    );
    up.signal(Signal::SIGINT);
    let exit = up.wait_exit(Duration::from_secs(60)).await;
    assert!(exit.success(), "{exit}: {}", up.output().text());

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("up.toml");
    let text = format!(
        "[control]\nstate_dir = {:?}\ntoken = \"s3cret\"\n",
        dir.path().join("state")
    );
    std::fs::write(&config, text).unwrap();
    let mut clash = spawn_up_with(
        dir.path(),
        &dir.path().join("up.addr"),
        &["--config", config.to_str().unwrap(), "--token", "other"],
    );
    let exit = clash.wait_exit(DEADLINE).await;
    assert_eq!(exit.code(), Some(2), "{}", clash.output().text());
    assert!(
        clash
            .output()
            .contains("--token (or SIESTA_TOKEN) differs from [control] token in"),
        "{}",
        clash.output().text()
    );
}
