use super::*;

const FULL: &str = r#"
[control]
listen = "127.0.0.1:0"
state_dir = "/tmp/siesta-test"
control_id = "box1"

[defaults]
idle = [ { after = "15m", action = "sleep", level = 1 },
         { after = "3h",  action = "sleep", level = 2 } ]
max_queue = 64
max_hold = "5m"
start_timeout = "10m"
backoff_initial = "1s"
backoff_max = "1m"

[[gpu]]
index = 0
name = "H200"
memory = "141GiB"

[[model]]
name = "chat"
aliases = ["gpt-4o-mini"]
model = "Qwen/Qwen3-8B"
launch = "process"
executable = "vllm"
port = 8101
args = ["--max-model-len", "8192"]
env = { HF_HOME = "/models" }
gpus = 1
gpu_memory = 0.45
idle = [ { after = "10m", action = "sleep", level = 1 }, { after = "1h", action = "stop" } ]
preload = "asleep"
max_queue = 16
wake_timeout = "1.5s"

[[model]]
name = "ext"
launch = "attach"
url = "http://127.0.0.1:8001/"
served_model_name = "external"
gpu_memory = "20GiB"
gpu_ids = [0]
"#;

#[test]
fn full_example_parses() {
    let c = Config::parse(FULL, "full.toml").unwrap();
    assert_eq!(c.control.control_id, "box1");
    assert_eq!(c.gpus[0].memory_bytes, 141 << 30);
    let chat = &c.models[0];
    assert_eq!(chat.idle.len(), 2);
    assert_eq!(chat.idle[1].action, IdleAction::Stop);
    assert_eq!(chat.max_queue, 16);
    assert_eq!(chat.max_hold, Duration::from_secs(300));
    assert_eq!(chat.timeouts.wake, Duration::from_millis(1500));
    assert_eq!(chat.timeouts.start, Duration::from_secs(600));
    assert_eq!(chat.backoff.max, Duration::from_secs(60));
    assert_eq!(chat.preload, Preload::Asleep);
    assert_eq!(chat.gpu_memory, Some(GpuMemory::Fraction(0.45)));
    let ext = &c.models[1];
    assert_eq!(
        ext.launch,
        Launch::Attach {
            url: "http://127.0.0.1:8001".into(),
            served_model_name: "external".into()
        }
    );
    assert_eq!(ext.idle, c.defaults.idle);
    assert_eq!(ext.gpu_memory, Some(GpuMemory::Bytes(20 << 30)));
    assert_eq!(c.model("gpt-4o-mini").unwrap().name, "chat");
}

#[test]
fn every_problem_is_reported_with_file_and_key() {
    let text = r#"
[control]
listen = "nowhere"
colour = "blue"

[[model]]
name = "a"
model = "m"
idle = [ { after = "5x", action = "sleep" }, { after = "1m", action = "nap" } ]

[[model]]
name = "b"
model = "m"
aliases = ["a"]
launch = "attach"
port = 3
preload = "sometimes"
env = { PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True" }
"#;
    let err = Config::parse(text, "demo.toml").unwrap_err();
    let text = err.to_string();
    for want in [
        r#"demo.toml: control.listen: "nowhere" is not an address"#,
        "demo.toml: control.colour: unknown key",
        r#"demo.toml: model[0].idle[0].after: "5x" is not a duration"#,
        r#"demo.toml: model[0].idle[1].action: "nap" is not "sleep", "suspend" or "stop""#,
        "demo.toml: model[1].url: is required with launch = \"attach\"",
        "demo.toml: model[1].port: does not apply to launch = \"attach\"",
        r#"demo.toml: model[1].preload: "sometimes" is not"#,
        "demo.toml: model[1].env.PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True",
        "demo.toml: model[1].env: does not apply to launch = \"attach\"",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    assert!(err.problems.len() >= 7, "{text}");
}

/// `[defaults]`' backoff problem is told once, at its key, with the values;
/// it was told again for every model, at `model[i].backoff_max`, a key the
/// file did not have. An alias that is no name is refused.
#[test]
fn a_defaults_problem_is_told_once_and_an_alias_must_be_a_name() {
    let text = r#"
[defaults]
backoff_initial = "5s"
backoff_max = "1s"

[[model]]
name = "a"
model = "m"
aliases = ["", "ok-alias"]

[[model]]
name = "b"
model = "m"
"#;
    let err = Config::parse(text, "d.toml").unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("d.toml: defaults.backoff_max: 1s is less than backoff_initial (5s)"),
        "{text}"
    );
    assert!(!text.contains("model[0].backoff_max"), "{text}");
    assert!(!text.contains("model[1].backoff_max"), "{text}");
    assert!(
        text.contains(r#"d.toml: model[0].aliases: "" must be non-empty"#),
        "{text}"
    );
    assert_eq!(err.problems.len(), 2, "{text}");
}

#[test]
fn duplicate_names_and_aliases_are_refused() {
    let text = r#"
[[model]]
name = "a"
model = "m"
[[model]]
name = "b"
model = "m"
aliases = ["a"]
"#;
    let err = Config::parse(text, "x.toml").unwrap_err().to_string();
    assert!(
        err.contains("model[1].aliases[0]: \"a\" is already used by model[0].name"),
        "{err}"
    );
}

#[test]
fn names_that_share_log_files_are_refused() {
    let text = r#"
[[model]]
name = "qwen.8b"
model = "m"
[[model]]
name = "qwen_8b"
model = "m"
"#;
    let err = Config::parse(text, "x.toml").unwrap_err().to_string();
    assert!(
        err.contains(
            "x.toml: model[1].name: \"qwen_8b\" would share its engine log files \
             (qwen_8b.stdout.log) with model[0] (\"qwen.8b\"); rename one"
        ),
        "{err}"
    );
}

#[test]
fn syntax_errors_name_the_line() {
    let err = Config::parse("[control]\nlisten = \n", "bad.toml")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("bad.toml: line 2: "), "{err}");
}

#[test]
fn defaults_and_demo() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(c.control.listen.port(), 50051);
    assert!(
        c.control.listen.ip().is_loopback(),
        "gRPC listens on loopback by default"
    );
    assert!(c.models.is_empty());
    let d = Config::demo(vec!["siesta".into(), "fake-vllm".into()]);
    assert!(d.models.len() >= 2);
    assert!(d.models.iter().all(|m| m.gpus == 0));
    assert!(d.models.iter().any(|m| m.preload == Preload::Asleep));
}

#[test]
fn backoff_is_capped() {
    let b = Backoff {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(10),
    };
    let delays: Vec<u64> = (1..=6).map(|n| b.delay(n).as_secs()).collect();
    assert_eq!(delays, [1, 2, 4, 8, 10, 10]);
    assert_eq!(b.delay(1000), Duration::from_secs(10));
}

#[test]
fn asleep_residual_is_configurable() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(
        c.control.asleep_residual, None,
        "default: by TP size, then measured"
    );
    let c = Config::parse("[control]\nasleep_residual = \"4GiB\"\n", "r.toml").unwrap();
    assert_eq!(c.control.asleep_residual, Some(4 << 30));
    let err = Config::parse("[control]\nasleep_residual = \"lots\"\n", "r.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("r.toml: control.asleep_residual"), "{err}");
}

#[test]
fn disable_log_stats_is_refused_for_process_models() {
    let text = "[[model]]\nname = \"chat\"\nmodel = \"m\"\nargs = [\"--max-model-len\", \"4096\", \"--disable-log-stats\"]\n";
    let err = Config::parse(text, "m.toml").unwrap_err().to_string();
    assert_eq!(
        err,
        "m.toml: model[0].args: --disable-log-stats removes the vllm: metrics siesta needs for activity and sleep level; remove it"
    );
    let ok = "[[model]]\nname = \"chat\"\nmodel = \"m\"\nargs = [\"--max-model-len\", \"4096\"]\n";
    assert!(Config::parse(ok, "m.toml").is_ok());
}

/// A vLLM engine with an API key refused (401) every request the proxy
/// forwarded, while its health and sleep routes, which need no key, made it
/// look fine; one serving only HTTPS, or no HTTP at all, could never be
/// reached. Each is refused, naming the key.
#[test]
fn engine_flags_that_make_it_unreachable_for_siesta_are_refused() {
    for (args, env, key, says) in [
        (r#"["--api-key", "k"]"#, "", "model[0].args", "401"),
        (r#"["--api_key=k"]"#, "", "model[0].args", "401"),
        (
            "[]",
            "VLLM_API_KEY = \"k\"",
            "model[0].env.VLLM_API_KEY",
            "401",
        ),
        (
            r#"["--ssl-keyfile", "/k.pem"]"#,
            "",
            "model[0].args",
            "HTTPS",
        ),
        (r#"["--ssl-certfile=/c.pem"]"#, "", "model[0].args", "HTTPS"),
        (r#"["--headless"]"#, "", "model[0].args", "no HTTP"),
    ] {
        let text = format!(
            "[[model]]\nname = \"chat\"\nmodel = \"m\"\nargs = {args}\n[model.env]\n{env}\n"
        );
        let err = Config::parse(&text, "m.toml").unwrap_err().to_string();
        assert!(
            err.contains(&format!("m.toml: {key}: ")),
            "{args} {env}: {err}"
        );
        assert!(err.contains(says), "{args} {env}: {err}");
    }
}

#[test]
fn engine_idle_timeout_is_configurable() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(c.control.engine_idle_timeout, Duration::from_secs(4));
    let c = Config::parse("[control]\nengine_idle_timeout = \"2s\"\n", "i.toml").unwrap();
    assert_eq!(c.control.engine_idle_timeout, Duration::from_secs(2));
    let err = Config::parse("[control]\nengine_idle_timeout = \"0s\"\n", "i.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("i.toml: control.engine_idle_timeout: must be more than 0"),
        "{err}"
    );
}

#[test]
fn gpu_detect_timeout_is_configurable_and_named_by_a_reload() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(c.control.gpu_detect_timeout, Duration::from_secs(120));
    let n = Config::parse("[control]\ngpu_detect_timeout = \"5m\"\n", "g.toml").unwrap();
    assert_eq!(n.control.gpu_detect_timeout, Duration::from_secs(300));
    // Read at start-up only: a reload says so.
    assert_eq!(c.restart_only_changes(&n), ["control.gpu_detect_timeout"]);
    let err = Config::parse("[control]\ngpu_detect_timeout = \"0s\"\n", "g.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("g.toml: control.gpu_detect_timeout: must be more than 0"),
        "{err}"
    );
}

#[test]
fn yield_after_is_a_duration_or_off() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(c.control.yield_after, Some(Duration::from_secs(10)));
    let c = Config::parse("[control]\nyield_after = \"2.5s\"\n", "y.toml").unwrap();
    assert_eq!(c.control.yield_after, Some(Duration::from_millis(2500)));
    let c = Config::parse("[control]\nyield_after = \"off\"\n", "y.toml").unwrap();
    assert_eq!(c.control.yield_after, None);
    for (bad, says) in [
        ("\"0s\"", "must be more than 0"),
        ("\"5m\"", "must be less than 300 s"),
        ("\"soon\"", "is not a duration"),
        ("10", "expected a duration string"),
    ] {
        let err = Config::parse(&format!("[control]\nyield_after = {bad}\n"), "y.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("y.toml: control.yield_after: "), "{err}");
        assert!(err.contains(says), "{bad}: {err}");
    }
}

/// A `min_awake` that outlasts half of a wake's wait for room is refused:
/// every wake onto its model's GPUs would give up ("no room") after each
/// wake of it.
#[test]
fn min_awake_leaves_a_wake_room_to_come() {
    let c = Config::parse("[control]\nmin_awake = \"149s\"\n", "y.toml").unwrap();
    assert_eq!(c.control.min_awake, Duration::from_secs(149));
    for bad in ["\"150s\"", "\"6m\""] {
        let err = Config::parse(&format!("[control]\nmin_awake = {bad}\n"), "y.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("y.toml: control.min_awake: must be less than 150 s"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn web_listen_is_off_by_default_and_checked() {
    let c = Config::parse("", "empty.toml").unwrap();
    assert_eq!(c.control.web_listen, None);
    let c = Config::parse("[control]\nweb_listen = \"127.0.0.1:9091\"\n", "w.toml").unwrap();
    assert_eq!(
        c.control.web_listen,
        Some("127.0.0.1:9091".parse().unwrap())
    );
    let err = Config::parse("[control]\nweb_listen = \"localhost\"\n", "w.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("w.toml: control.web_listen: \"localhost\" is not an address"),
        "{err}"
    );
}

/// Slips that parse but could never run: an engine on port 0 (it binds any
/// free port while siesta probes 0) and `gpu_memory = 1` (one byte, not the
/// whole GPU: placed anywhere, then too small for vLLM's KV cache).
#[test]
fn port_zero_and_a_gpu_memory_of_a_few_bytes_are_refused() {
    let model = |extra: &str| format!("[[model]]\nname = \"chat\"\nmodel = \"m\"\n{extra}\n");
    let err = |extra: &str| match Config::parse(&model(extra), "a.toml") {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    };
    let e = err("port = 0");
    assert!(e.contains("a.toml: model[0].port: 0 is not a port"), "{e}");
    let e = err("gpu_memory = 1");
    assert!(
        e.contains(
            "a.toml: model[0].gpu_memory: 1 would be 1 byte(s): write a fraction such as 1.0"
        ),
        "{e}"
    );
    let e = err("gpu_memory = 4096");
    assert!(
        e.contains("model[0].gpu_memory: 4096 bytes is too little"),
        "{e}"
    );
    // What is right still parses.
    for ok in [
        "port = 8101",
        "gpu_memory = 1.0",
        "gpu_memory = 42949672960",
        "gpu_memory = \"40GiB\"",
    ] {
        assert_eq!(err(ok), "", "{ok}");
    }
}

/// A `backoff_initial` under 10 ms is refused, naming the key (it was
/// raised to 10 ms without a word), and so is a `p2p_probe_timeout` over
/// an hour (a hung probe holds every later one until its deadline).
#[test]
fn a_busy_loop_backoff_and_an_endless_probe_deadline_are_refused() {
    let text = r#"
[control]
p2p_probe_timeout = "2h"

[defaults]
backoff_initial = "0s"

[[model]]
name = "a"
model = "m"
backoff_initial = "5ms"
"#;
    let text = Config::parse(text, "b.toml").unwrap_err().to_string();
    for want in [
        "b.toml: defaults.backoff_initial: 0s is less than 10ms",
        "b.toml: model[0].backoff_initial: 5ms is less than 10ms",
        "b.toml: control.p2p_probe_timeout: 2h is more than 1h",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    let ok = "[control]\np2p_probe_timeout = \"1h\"\n[defaults]\nbackoff_initial = \"10ms\"\n";
    let c = Config::parse(ok, "ok.toml").unwrap();
    assert_eq!(c.defaults.backoff.initial, Duration::from_millis(10));
    assert_eq!(c.control.p2p_probe.timeout, Duration::from_secs(3600));
}

/// `max_queue = 0` and `max_hold = "0s"` are refused, in a model and in
/// `[defaults]`, naming the file and key. They were taken, shown as 0 by
/// `siesta get`, and the proxy (which reads 0 as "not sent") held by its
/// own defaults instead: 128 requests, 60 s.
#[test]
fn a_zero_hold_limit_is_refused_not_shown_and_ignored() {
    for (table, key, value) in [
        (
            "[[model]]\nname = \"m\"\nmodel = \"x\"\n",
            "model[0].max_queue",
            "max_queue = 0",
        ),
        (
            "[[model]]\nname = \"m\"\nmodel = \"x\"\n",
            "model[0].max_hold",
            "max_hold = \"0s\"",
        ),
        ("[defaults]\n", "defaults.max_queue", "max_queue = 0"),
        ("[defaults]\n", "defaults.max_hold", "max_hold = \"0s\""),
        // Under a millisecond: sent as 0, which the proxy reads as "not
        // sent" and holds for its own 60 s.
        ("[defaults]\n", "defaults.max_hold", "max_hold = \"0.5ms\""),
    ] {
        let err = Config::parse(&format!("{table}{value}\n"), "h.toml")
            .unwrap_err()
            .to_string();
        let want = if key.ends_with("max_hold") {
            "must be at least 1ms"
        } else {
            "must be more than 0"
        };
        assert!(
            err.contains(&format!("h.toml: {key}: {want}")),
            "{value} in {table:?}: {err}"
        );
    }
    let c = Config::parse(
        "[[model]]\nname = \"m\"\nmodel = \"x\"\nmax_queue = 1\nmax_hold = \"1s\"\n",
        "h.toml",
    )
    .unwrap();
    assert_eq!(
        (c.models[0].max_queue, c.models[0].max_hold),
        (1, Duration::from_secs(1))
    );
}

/// A TOML syntax error names the piece of the line it is about: toml's
/// own message for a key or table given twice is only "duplicate key".
#[test]
fn a_key_or_table_given_twice_is_named() {
    let err = Config::parse(
        "[[model]]\nname = \"a\"\nmodel = \"x\"\nname = \"b\"\n",
        "d.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("d.toml: line 4: duplicate key (`name`)"),
        "{err}"
    );
    let err = Config::parse("[control]\n[control]\n", "d.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("d.toml: line 2: "), "{err}");
    assert!(err.contains("control"), "{err}");
}

/// An attached engine at an https:// URL was accepted, and then every
/// probe failed (the daemon's engine client and the proxy speak plain
/// HTTP to engines): a model that could only fail, backing off forever.
#[test]
fn an_https_attach_url_is_refused_naming_the_key() {
    let text = "[[model]]\nname = \"a\"\nlaunch = \"attach\"\nurl = \"https://h:8000\"\n";
    let err = Config::parse(text, "h.toml").unwrap_err().to_string();
    assert!(
        err.contains("h.toml: model[0].url: \"https://h:8000\" is not an http:// URL"),
        "{err}"
    );
    let ok = "[[model]]\nname = \"a\"\nlaunch = \"attach\"\nurl = \"http://h:8000/\"\n";
    Config::parse(ok, "h.toml").unwrap();
}

/// An empty `state_dir` put the store and the engines' logs in the
/// daemon's working directory (`/` under systemd); a relative one, wherever
/// the daemon happened to be started.
#[test]
fn a_state_dir_must_be_an_absolute_path() {
    for dir in ["", "state", "./state"] {
        let text = format!("[control]\nstate_dir = {dir:?}\n");
        let err = Config::parse(&text, "h.toml").unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "h.toml: control.state_dir: {dir:?} is not an absolute path"
            )),
            "{dir:?}: {err}"
        );
    }
    let c = Config::parse("[control]\nstate_dir = \"/var/lib/s\"\n", "h.toml").unwrap();
    assert_eq!(c.control.state_dir, std::path::Path::new("/var/lib/s"));
}

/// A token a header cannot carry was accepted, and then every gRPC client
/// was refused as if its token were wrong. Refused by name, never shown.
#[test]
fn a_token_a_header_cannot_carry_is_refused_without_showing_it() {
    for token in ["pässwort", "two words", "tab\there"] {
        let text = format!("[control]\ntoken = {token:?}\n");
        let c = Config::parse(&text, "h.toml").unwrap();
        let err = c.check_tokens().unwrap_err().to_string();
        assert!(
            err.contains("h.toml: control.token: holds characters a request header cannot carry"),
            "{err}"
        );
        assert!(!err.contains(token), "the token shown: {err}");
    }
    let c = Config::parse("[control]\ntoken = \"s3cr3t-T0ken_~!\"\n", "h.toml").unwrap();
    c.check_tokens().unwrap();
}

/// Two models named alike, the second with a problem of its own: only that
/// problem was reported, and the clash only once it was fixed.
#[test]
fn a_name_clash_is_reported_with_the_other_problems_of_the_model() {
    let text = "[[model]]\nname = \"m1\"\nmodel = \"x\"\n\n\
                [[model]]\nname = \"m1\"\nmodel = \"y\"\ngpus = 1\n\
                [model.env]\nCUDA_VISIBLE_DEVICES = \"0\"\n";
    let err = Config::parse(text, "h.toml").unwrap_err().to_string();
    assert!(
        err.contains("h.toml: model[1].name: \"m1\" is already used by model[0].name"),
        "{err}"
    );
    assert!(
        err.contains("h.toml: model[1].env.CUDA_VISIBLE_DEVICES"),
        "{err}"
    );
}
