//! Every shipped example configuration passes the daemon's own validation.

use std::path::PathBuf;

use siesta_control::config::Config;

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

#[test]
fn every_example_config_is_valid() {
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(examples_dir()).expect("examples/ exists") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            if let Err(e) = Config::load(&path) {
                panic!("{} is invalid:\n{e}", path.display());
            }
            checked.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    checked.sort();
    assert_eq!(
        checked,
        [
            "demo.toml",
            "one-gpu-swap.toml",
            "seeds-kinds.toml",
            "seeds-three-gpu.toml"
        ]
    );
}

#[test]
fn seeds_example_matches_the_box() {
    let cfg = Config::load(&examples_dir().join("seeds-three-gpu.toml")).unwrap();
    let text = cfg.model("text").unwrap();
    assert_eq!((text.gpus, text.gpu_ids.as_slice()), (2, &[0, 1][..]));
    assert!(text.args.iter().any(|a| a == "--disable-custom-all-reduce"));
    assert_eq!(
        text.env.get("NCCL_P2P_DISABLE").map(String::as_str),
        Some("1")
    );
    for name in ["ocr", "embed"] {
        assert_eq!(cfg.model(name).unwrap().gpu_ids, [2], "{name}");
    }
    let embed = cfg.model("embed").unwrap();
    assert!(embed.args.windows(2).any(|w| w == ["--runner", "pooling"]));
    let tiers: Vec<u64> = embed.idle.iter().map(|t| t.after.as_secs()).collect();
    assert_eq!(tiers, [15 * 60, 3 * 3600]);
}

#[test]
fn kinds_example_runs_the_seeds_box_with_three_kinds() {
    use siesta_control::config::{EngineKind, IdleAction, Launch};
    let cfg = Config::load(&examples_dir().join("seeds-kinds.toml")).unwrap();
    let chat = cfg.model("chat").unwrap();
    assert_eq!(chat.engine, EngineKind::Vllm);
    assert_eq!((chat.gpus, chat.gpu_ids.as_slice()), (2, &[0, 1][..]));
    let ocr = cfg.model("ocr").unwrap();
    assert_eq!(ocr.engine, EngineKind::Openai);
    assert_eq!(ocr.gpu_ids, [2]);
    assert!(ocr.args.iter().any(|a| a == "{port}"));
    assert!(
        matches!(&ocr.launch, Launch::Process { command, .. } if command[0].ends_with("llama-server"))
    );
    assert_eq!(ocr.idle.len(), 2);
    assert_eq!(ocr.idle[0].action, IdleAction::Suspend);
    assert_eq!(ocr.idle[1].action, IdleAction::Stop);
    let embed = cfg.model("embed").unwrap();
    assert_eq!(
        (embed.engine, embed.gpu_ids.as_slice()),
        (EngineKind::Vllm, &[2][..])
    );
    assert!(embed.args.windows(2).any(|w| w == ["--runner", "pooling"]));
}

#[test]
fn demo_file_mirrors_the_built_in_demo() {
    let file = Config::load(&examples_dir().join("demo.toml")).unwrap();
    let builtin = Config::demo(vec!["fake-vllm".into()]);
    let names = |c: &Config| {
        c.models
            .iter()
            .map(|m| (m.name.clone(), m.aliases.clone(), m.args.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&file), names(&builtin));
    assert_eq!(file.defaults.idle, builtin.defaults.idle);
}

#[test]
fn kubernetes_configmap_holds_a_valid_config() {
    let yaml = std::fs::read_to_string(examples_dir().join("../deploy/kubernetes/configmap.yaml"))
        .unwrap();
    let (_, body) = yaml
        .split_once("siesta.toml: |\n")
        .expect("configmap has siesta.toml");
    // The block scalar: every line indented by four spaces (or empty).
    let toml: String = body
        .lines()
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or("")))
        .collect();
    // The container replaces __POD_IP__ with the pod's IP before starting.
    let toml = toml.replace("__POD_IP__", "10.0.0.7");
    let cfg = Config::parse(&toml, "configmap.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert!(!cfg.models.is_empty());
}
