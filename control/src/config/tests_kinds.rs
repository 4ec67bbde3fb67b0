//! `engine` kinds in the configuration: defaults, and tiers or preloads a
//! kind cannot do refused with the tiers it has.

use super::*;

const HEAD: &str = r#"
[defaults]
idle = [ { after = "15m", action = "sleep", level = 1 },
         { after = "3h",  action = "sleep", level = 2 } ]
"#;

fn parse(models: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!("{HEAD}{models}"), "box.toml")
}

fn refused(models: &str) -> String {
    parse(models).unwrap_err().to_string()
}

#[test]
fn engine_defaults_to_vllm_and_each_kind_has_its_launcher() {
    let c = parse(
        r#"
[[model]]
name = "chat"
model = "m"

[[model]]
name = "sg"
engine = "sglang"
model = "Qwen/Qwen3-8B"

[[model]]
name = "ocr"
engine = "openai"
executable = "/opt/ocr/serve"
args = ["--listen", "{host}:{port}"]
health_path = "/ready"
"#,
    )
    .unwrap();
    let [chat, sg, ocr] = &c.models[..] else {
        panic!("three models")
    };
    assert_eq!(chat.engine, EngineKind::Vllm);
    assert!(matches!(&chat.launch, Launch::Process { command, .. } if command == &["vllm"]));
    assert_eq!(sg.engine, EngineKind::Sglang);
    assert!(
        matches!(&sg.launch, Launch::Process { command, .. } if command == &["python", "-m", "sglang.launch_server"])
    );
    assert_eq!(ocr.engine, EngineKind::Openai);
    assert_eq!(ocr.health_path, "/ready");
    assert_eq!(chat.health_path, "/health");
    // [defaults] tiers fit each kind: SGLang has level 1 only, an openai
    // server is stopped where the others would sleep.
    assert_eq!(chat.idle.len(), 2);
    assert_eq!(sg.idle.len(), 1);
    assert_eq!(sg.idle[0].action, IdleAction::Sleep(1));
    assert_eq!(ocr.idle.len(), 1);
    assert_eq!(ocr.idle[0].action, IdleAction::Stop);
    assert_eq!(ocr.idle[0].after, Duration::from_secs(15 * 60));
}

#[test]
fn a_sleep_tier_of_an_openai_engine_is_refused_with_the_tiers_it_has() {
    let e = refused(
        r#"
[[model]]
name = "ocr"
engine = "openai"
executable = "ocr-server"
args = ["--port", "{port}"]
idle = [ { after = "5m", action = "sleep", level = 1 } ]
"#,
    );
    assert_eq!(
        e,
        "box.toml: model[0].idle[0].action: an engine = \"openai\" cannot sleep at level 1; \
         its idle tiers can be: suspend, stop"
    );
}

#[test]
fn sglang_has_no_level_two_and_an_attached_openai_engine_no_tier_at_all() {
    let e = refused(
        r#"
[[model]]
name = "sg"
engine = "sglang"
model = "m"
idle = [ { after = "5m", action = "sleep", level = 1 }, { after = "1h", action = "sleep", level = 2 } ]

[[model]]
name = "tei"
engine = "openai"
launch = "attach"
url = "http://127.0.0.1:8080"
idle = [ { after = "5m", action = "stop" } ]
"#,
    );
    assert!(
        e.contains(
            "model[0].idle[1].action: an engine = \"sglang\" cannot sleep at level 2; \
             its idle tiers can be: sleep (level 1), suspend, stop"
        ),
        "{e}"
    );
    assert!(
        e.contains("model[1].idle[0].action: an attached engine = \"openai\" cannot stop"),
        "{e}"
    );
    // Attached and unable to sleep: [defaults] give it no tier.
    let c = parse(
        r#"
[[model]]
name = "tei"
engine = "openai"
launch = "attach"
url = "http://127.0.0.1:8080"
"#,
    )
    .unwrap();
    assert!(c.models[0].idle.is_empty());
}

#[test]
fn openai_engines_need_a_command_a_port_and_no_asleep_preload() {
    let e = refused(
        r#"
[[model]]
name = "a"
engine = "openai"
preload = "asleep"
executable = "srv"
args = ["--port", "{port}"]

[[model]]
name = "b"
engine = "openai"

[[model]]
name = "c"
engine = "openai"
executable = "srv"

[[model]]
name = "d"
engine = "vllm"
model = "m"
health_path = "/ready"

[[model]]
name = "e"
engine = "tgi"
model = "m"
"#,
    );
    for want in [
        "model[0].preload: \"asleep\" is not possible: engine = \"openai\" cannot sleep",
        "model[1].command: is required with engine = \"openai\"",
        "model[2].args: an engine = \"openai\" gets no --port from siesta",
        "model[3].health_path: only applies to engine = \"openai\"",
        "model[4].engine: \"tgi\" is not \"vllm\", \"sglang\" or \"openai\"",
    ] {
        assert!(e.contains(want), "missing {want:?} in:\n{e}");
    }
    // A fixed port is fine without `{port}`.
    parse(
        r#"
[[model]]
name = "c"
engine = "openai"
executable = "srv"
port = 9000
"#,
    )
    .unwrap();
}
