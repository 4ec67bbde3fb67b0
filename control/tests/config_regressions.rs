//! Inputs the config fuzz target (fuzz/fuzz_targets/config_parse.rs) found,
//! fed to `Config::parse` as plain tests.

use siesta_control::config::Config;

/// `ConfigError`'s Display is one line per problem, `FILE: KEY: what is
/// wrong`. A quoted TOML key may hold a line break, and an unknown key is
/// echoed raw in the problem's key, so one problem took two lines (and the
/// second line did not name the file).
#[test]
fn a_key_with_a_line_break_stays_on_one_line() {
    let text = "[[model]]\nname = \"x\"\nlaunch = \"attach\"\nurl = \"http://127.0.0.1:1/\"\n\"a\\nb\" = 1\n";
    let e = Config::parse(text, "fuzz.toml").unwrap_err();
    let shown = e.to_string();
    assert_eq!(shown.lines().count(), e.problems.len(), "{shown}");
    for line in shown.lines() {
        assert!(line.starts_with("fuzz.toml: "), "{line:?}");
    }
    assert!(shown.contains("model[0]"), "{shown}");
}

/// The same with a carriage return and a key that looks like another problem.
#[test]
fn a_key_cannot_forge_a_problem_line() {
    let text = "[control]\n\"x\\r\\nother.toml: control.listen: fine\" = 1\n";
    let e = Config::parse(text, "fuzz.toml").unwrap_err();
    let shown = e.to_string();
    assert_eq!(shown.lines().count(), e.problems.len(), "{shown}");
    assert!(!shown.contains("\nother.toml"), "{shown}");
}
