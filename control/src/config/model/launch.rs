//! A `[[model]]`'s launch: the engine siesta runs (`executable` or
//! `command`, `host`, `port`) or the one it attaches to (`url`,
//! `served_model_name`).

use super::super::read::{Problems, Reader};
use super::super::*;

/// What a `[[model]]` says of how its engine is reached.
pub(super) struct LaunchRead {
    /// None: a problem was pushed.
    pub launch: Option<Launch>,
    /// `launch`, as written (`process` when not).
    pub kind: String,
    pub port: Option<u16>,
    /// `command` has `{port}` in it.
    pub command_has_port: bool,
}

pub(super) fn read_launch(
    p: &mut Problems,
    r: &mut Reader<'_>,
    t: &toml::Table,
    engine: EngineKind,
    name: &Option<String>,
) -> LaunchRead {
    let launch_kind = r.string(p, "launch").unwrap_or_else(|| "process".into());
    let executable = r.string(p, "executable");
    let command = r.strings(p, "command");
    let command_has_port = command
        .as_ref()
        .is_some_and(|c| c.iter().any(|a| a.contains("{port}")));
    let url = r.string(p, "url");
    let host = r.string(p, "host");
    if let Some(h) = host.as_deref().filter(|h| h.starts_with('['))
        && launch_kind == "process"
    {
        let bare = h.trim_start_matches('[').trim_end_matches(']');
        p.push(
            r.key("host"),
            format!("{h:?} is in brackets: write the address alone ({bare:?})"),
        );
    }
    let port = r.uint(p, "port", 65535).map(|n| n as u16);
    if port == Some(0) {
        // The engine would bind any free port while siesta probes port 0.
        p.push(
            r.key("port"),
            "0 is not a port an engine can be reached on: leave `port` out and siesta picks a \
             free one",
        );
    }
    let served = r.string(p, "served_model_name");
    let launch = match launch_kind.as_str() {
        "process" => {
            if url.is_some() {
                p.push(r.key("url"), "only applies to launch = \"attach\"");
            }
            if served.is_some() {
                p.push(
                    r.key("served_model_name"),
                    "only applies to launch = \"attach\" (process engines serve under `name`)",
                );
            }
            let command = match (executable, command) {
                (Some(_), Some(_)) => {
                    p.push(
                        r.key("command"),
                        "set either `executable` or `command`, not both",
                    );
                    None
                }
                (Some(e), None) if e.is_empty() => {
                    p.push(r.key("executable"), "is empty");
                    None
                }
                (Some(e), None) => Some(vec![e]),
                (None, Some(c)) if c.is_empty() => {
                    p.push(r.key("command"), "is empty");
                    None
                }
                (None, Some(c)) => Some(c),
                (None, None) => match engine.default_command() {
                    Some(c) => Some(c),
                    None => {
                        p.push(
                            r.key("command"),
                            "is required with engine = \"openai\" (`executable` + `args`, or `command`: \
                             the server to run; siesta adds no arguments of its own, `{port}` and \
                             `{host}` in them are replaced)",
                        );
                        None
                    }
                },
            };
            command.map(|command| Launch::Process {
                command,
                host: host.unwrap_or_else(|| "127.0.0.1".into()),
                port,
            })
        }
        "attach" => {
            for (k, set) in [
                ("executable", executable.is_some()),
                ("command", command.is_some()),
                ("host", host.is_some()),
                ("port", port.is_some()),
            ] {
                if set {
                    p.push(
                        r.key(k),
                        "does not apply to launch = \"attach\" (use `url`)",
                    );
                }
            }
            // Given, they were dropped without a word.
            for k in ["args", "env"].into_iter().filter(|k| t.contains_key(*k)) {
                p.push(
                    r.key(k),
                    "does not apply to launch = \"attach\": siesta does not start the engine",
                );
            }
            match url {
                // Not https://: neither the daemon's engine client nor the
                // proxy speaks TLS to engines, so such a model could only fail.
                Some(u) if u.starts_with("http://") => Some(Launch::Attach {
                    url: u.trim_end_matches('/').to_string(),
                    served_model_name: served.clone().or_else(|| name.clone()).unwrap_or_default(),
                }),
                Some(u) => {
                    p.push(
                        r.key("url"),
                        format!(
                            "{u:?} is not an http:// URL (engines are reached in plain HTTP; \
                             https:// is not supported)"
                        ),
                    );
                    None
                }
                None => {
                    p.push(r.key("url"), "is required with launch = \"attach\"");
                    None
                }
            }
        }
        other => {
            p.push(
                r.key("launch"),
                format!("{other:?} is not \"process\" or \"attach\""),
            );
            None
        }
    };
    LaunchRead {
        launch,
        kind: launch_kind,
        port,
        command_has_port,
    }
}
