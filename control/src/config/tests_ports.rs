//! Ports: two process engines, or an engine and the control plane, on one
//! address cannot both be reached.

use super::*;

fn refused(text: &str) -> String {
    Config::parse(text, "p.toml").unwrap_err().to_string()
}

const TWO_ON_8000: &str = r#"
[[model]]
name = "a"
model = "m"
port = 8000
[[model]]
name = "b"
model = "m"
port = 8000
"#;

#[test]
fn two_models_on_one_port_are_refused() {
    assert_eq!(
        refused(TWO_ON_8000),
        "p.toml: model[1].port: 8000 is already used by model[0] (a)"
    );
}

#[test]
fn one_port_on_different_addresses_is_fine_but_a_wildcard_overlaps_all() {
    let apart = TWO_ON_8000.replacen("port = 8000", "host = \"127.0.0.2\"\nport = 8000", 1);
    assert!(Config::parse(&apart, "p.toml").is_ok());
    let wildcard = TWO_ON_8000.replacen("port = 8000", "host = \"0.0.0.0\"\nport = 8000", 1);
    assert!(
        refused(&wildcard).contains("model[1].port: 8000 is already used by model[0] (a)"),
        "{}",
        refused(&wildcard)
    );
    let v6 = TWO_ON_8000.replacen("port = 8000", "host = \"::\"\nport = 8000", 1);
    assert!(refused(&v6).contains("model[1].port: 8000"));
}

#[test]
fn a_model_on_the_control_planes_own_port_is_refused() {
    let text = r#"
[control]
listen = "127.0.0.1:50051"
web_listen = "0.0.0.0:9091"
[[model]]
name = "a"
model = "m"
port = 50051
[[model]]
name = "b"
model = "m"
port = 9091
"#;
    let err = refused(text);
    for want in [
        "p.toml: model[0].port: 50051 is already used by control.listen (127.0.0.1:50051)",
        "p.toml: model[1].port: 9091 is already used by control.web_listen (0.0.0.0:9091)",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
}

#[test]
fn the_default_listen_port_counts_and_attached_models_have_no_port() {
    let text = "[[model]]\nname = \"a\"\nmodel = \"m\"\nport = 50051\n";
    assert!(refused(text).contains("model[0].port: 50051 is already used by control.listen"));
    let text = r#"
[[model]]
name = "a"
model = "m"
port = 8001
[[model]]
name = "b"
launch = "attach"
url = "http://127.0.0.1:8001"
"#;
    assert!(Config::parse(text, "p.toml").is_ok());
}

#[test]
fn an_ipv6_host_is_written_without_brackets() {
    let text = "[[model]]\nname = \"a\"\nmodel = \"m\"\nhost = \"::1\"\n";
    assert!(Config::parse(text, "p.toml").is_ok());
    let err = refused(&text.replace("::1", "[::1]"));
    assert_eq!(
        err,
        "p.toml: model[0].host: \"[::1]\" is in brackets: write the address alone (\"::1\")"
    );
}

/// The gRPC and the web listener on one address: the daemon could not bind
/// the second and said only "cannot listen on ..."; the file check said ok.
#[test]
fn the_control_planes_two_listeners_on_one_address_are_refused() {
    let text = "[control]\nlisten = \"127.0.0.1:50051\"\nweb_listen = \"0.0.0.0:50051\"\n";
    assert_eq!(
        refused(text),
        "p.toml: control.web_listen: 50051 is already used by control.listen (127.0.0.1:50051)"
    );
    let apart = "[control]\nlisten = \"127.0.0.1:50051\"\nweb_listen = \"127.0.0.1:8081\"\n";
    assert!(Config::parse(apart, "p.toml").is_ok());
}
