//! What a reload cannot apply: `[control]` and `[[gpu]]` settings read once
//! at start-up, named key by key.

use super::*;

const BASE: &str = r#"
[control]
listen = "127.0.0.1:50051"
state_dir = "/tmp/s"
token = "old"

[defaults]
max_queue = 8

[[gpu]]
index = 0
name = "H200"
memory = "141GiB"

[[model]]
name = "a"
model = "m"
"#;

fn changes(new: &str) -> Vec<String> {
    let running = Config::parse(BASE, "r.toml").unwrap();
    let new = Config::parse(new, "r.toml").unwrap();
    running.restart_only_changes(&new)
}

#[test]
fn the_same_file_and_model_or_defaults_changes_need_no_restart() {
    assert_eq!(changes(BASE), Vec::<String>::new());
    let more = BASE
        .replace("max_queue = 8", "max_queue = 9\nmax_hold = \"1m\"")
        .replace("model = \"m\"", "model = \"m\"\nmax_queue = 3");
    assert_eq!(changes(&more), Vec::<String>::new());
    // Placement reads the asleep residual of each reload.
    let residual = BASE.replace(
        "token = \"old\"",
        "token = \"old\"\nasleep_residual = \"3GiB\"",
    );
    assert_eq!(changes(&residual), Vec::<String>::new());
}

#[test]
fn each_control_and_gpu_key_read_at_start_up_is_named() {
    let new = BASE
        .replace(
            "token = \"old\"",
            "token = \"new\"\nmin_awake = \"5s\"\nweb_listen = \"127.0.0.1:9091\"",
        )
        .replace("memory = \"141GiB\"", "memory = \"80GiB\"");
    assert_eq!(
        changes(&new),
        [
            "control.token",
            "control.min_awake",
            "control.web_listen",
            "gpu[0].memory"
        ]
    );
}

#[test]
fn a_token_removed_and_a_gpu_added_or_removed_count() {
    let new = BASE.replace("token = \"old\"\n", "")
        + "\n[[gpu]]\nindex = 1\nname = \"H200\"\nmemory = \"141GiB\"\n";
    assert_eq!(changes(&new), ["control.token", "gpu[1]"]);
    let none = BASE.replace(
        "[[gpu]]\nindex = 0\nname = \"H200\"\nmemory = \"141GiB\"\n",
        "",
    );
    assert_eq!(changes(&none), ["gpu[0]"]);
}
