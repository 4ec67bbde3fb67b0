//! `args` and `env` may not override what siesta sets on the engine's
//! command line and environment itself.

use super::*;

fn model(engine: &str, extra: &str) -> String {
    let head = match engine {
        "openai" => "engine = \"openai\"\nexecutable = \"srv\"\nport = 9000\n",
        e => &format!("engine = \"{e}\"\nmodel = \"m\"\n"),
    };
    format!("[[model]]\nname = \"chat\"\n{head}{extra}\n")
}

fn problems(engine: &str, extra: &str) -> String {
    match Config::parse(&model(engine, extra), "a.toml") {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn vllm_flags_siesta_sets_are_refused_in_every_spelling_naming_the_key() {
    for (args, flag, key) in [
        (r#"["--port", "8001"]"#, "--port", "port"),
        (r#"["--port=8001"]"#, "--port", "port"),
        (r#"["--host", "0.0.0.0"]"#, "--host", "host"),
        (
            r#"["--served-model-name", "x"]"#,
            "--served-model-name",
            "name",
        ),
        (
            r#"["--served_model_name=x"]"#,
            "--served_model_name",
            "name",
        ),
        (r#"["--model", "other"]"#, "--model", "model"),
        (
            r#"["--gpu-memory-utilization", "0.9"]"#,
            "--gpu-memory-utilization",
            "gpu_memory",
        ),
        (
            r#"["--gpu_memory_utilization=0.9"]"#,
            "--gpu_memory_utilization",
            "gpu_memory",
        ),
        (
            r#"["--tensor-parallel-size", "2"]"#,
            "--tensor-parallel-size",
            "gpus",
        ),
        (
            r#"["--tensor_parallel_size", "2"]"#,
            "--tensor_parallel_size",
            "gpus",
        ),
        (r#"["-tp", "2"]"#, "-tp", "gpus"),
        (r#"["-tp=2"]"#, "-tp", "gpus"),
    ] {
        let err = problems("vllm", &format!("args = {args}"));
        let want = format!("a.toml: model[0].args: {flag} is set by siesta from `{key}`");
        assert!(err.contains(&want), "{args}: want {want:?} in:\n{err}");
        assert!(err.contains(&format!("set `{key}` instead")), "{err}");
    }
    let err = problems("vllm", r#"args = ["--no-enable-sleep-mode"]"#);
    assert!(
        err.contains("model[0].args: --no-enable-sleep-mode turns off the sleep mode siesta"),
        "{err}"
    );
}

/// Pipeline, data or prefill-context parallel needs more GPUs than `gpus`,
/// all of them visible: refused in every spelling, for both engines.
#[test]
fn flags_that_spread_an_engine_over_more_gpus_are_refused() {
    for (engine, args, flag) in [
        ("vllm", r#"["-pp", "2"]"#, "-pp"),
        (
            "vllm",
            r#"["--pipeline_parallel_size=2"]"#,
            "--pipeline_parallel_size",
        ),
        ("vllm", r#"["-dp", "2"]"#, "-dp"),
        (
            "vllm",
            r#"["--data-parallel-size", "2"]"#,
            "--data-parallel-size",
        ),
        ("vllm", r#"["-dpl=2"]"#, "-dpl"),
        ("vllm", r#"["-pcp", "2"]"#, "-pcp"),
        ("sglang", r#"["--pp-size", "2"]"#, "--pp-size"),
        ("sglang", r#"["--dp-size=2"]"#, "--dp-size"),
    ] {
        let err = problems(engine, &format!("args = {args}"));
        let want = format!(
            "a.toml: model[0].args: {flag} spreads the engine over more GPUs than `gpus` places"
        );
        assert!(
            err.contains(&want),
            "{engine} {args}: want {want:?} in:\n{err}"
        );
    }
    assert_eq!(problems("openai", r#"args = ["-pp", "2"]"#), "");
}

#[test]
fn other_vllm_flags_and_values_that_look_like_flags_are_fine() {
    for args in [
        r#"["--max-model-len", "8192", "--enforce-eager"]"#,
        r#"["--port-range-ignored-by-prefix-match"]"#,
        r#"["--disable-custom-all-reduce", "--enable-sleep-mode"]"#,
        r#"["--hf-overrides", "{\"port\": 1}"]"#,
    ] {
        assert_eq!(problems("vllm", &format!("args = {args}")), "", "{args}");
    }
}

#[test]
fn sglang_flags_siesta_sets_are_refused() {
    for (args, flag, key) in [
        (r#"["--port", "1"]"#, "--port", "port"),
        (r#"["--model-path", "x"]"#, "--model-path", "model"),
        (r#"["--tp-size", "2"]"#, "--tp-size", "gpus"),
        (
            r#"["--tensor-parallel-size=2"]"#,
            "--tensor-parallel-size",
            "gpus",
        ),
        (
            r#"["--mem-fraction-static", "0.8"]"#,
            "--mem-fraction-static",
            "gpu_memory",
        ),
    ] {
        let err = problems("sglang", &format!("args = {args}"));
        let want = format!("a.toml: model[0].args: {flag} is set by siesta from `{key}`");
        assert!(err.contains(&want), "{args}: want {want:?} in:\n{err}");
    }
}

#[test]
fn an_openai_engine_gets_no_flags_from_siesta_so_any_may_be_passed() {
    let args = r#"args = ["--port", "9000", "--host", "{host}", "-tp", "2"]"#;
    assert_eq!(problems("openai", args), "");
}

#[test]
fn env_may_not_override_the_gpus_placement_picks() {
    for engine in ["vllm", "sglang", "openai"] {
        let err = problems(engine, "env = { CUDA_VISIBLE_DEVICES = \"1\" }");
        assert!(
            err.contains("a.toml: model[0].env.CUDA_VISIBLE_DEVICES: is set by placement"),
            "{engine}: {err}"
        );
        assert!(err.contains("`gpu_ids`"), "{err}");
        let err = problems(engine, "env = { CUDA_DEVICE_ORDER = \"FASTEST_FIRST\" }");
        assert!(
            err.contains("model[0].env.CUDA_DEVICE_ORDER: is set by placement"),
            "{engine}: {err}"
        );
    }
    // A model with no GPU gets neither from placement.
    assert_eq!(
        problems("vllm", "gpus = 0\nenv = { CUDA_VISIBLE_DEVICES = \"\" }"),
        ""
    );
}

#[test]
fn vllm_dev_mode_may_not_be_turned_off() {
    let err = problems("vllm", "env = { VLLM_SERVER_DEV_MODE = \"0\" }");
    assert!(
        err.contains("model[0].env.VLLM_SERVER_DEV_MODE: siesta sets it to 1"),
        "{err}"
    );
    assert_eq!(
        problems("vllm", "env = { VLLM_SERVER_DEV_MODE = \"1\" }"),
        ""
    );
}
