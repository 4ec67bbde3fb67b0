//! vLLM's `serve` argv rules before clap sees it: the real vLLM flags fake-vllm accepts and
//! ignores, underscores spelled as dashes (`--max_model_len`), and argparse's answer to
//! anything else: `vllm serve: error: unrecognized arguments: --foo`, exit status 2.

use std::ffi::OsString;

use clap::CommandFactory;

use crate::cli::Cli;

/// Real vLLM flags that take a value and that fake-vllm accepts without modelling them.
/// Every flag siesta's supervisor, the examples and the tests pass must be here or modelled.
pub const IGNORED_VALUE_FLAGS: &[&str] = &[
    "allowed-headers",
    "allowed-methods",
    "allowed-origins",
    "block-size",
    "chat-template",
    "chat-template-content-format",
    "code-revision",
    "compilation-config",
    "config",
    "convert",
    "cpu-offload-gb",
    "data-parallel-address",
    "data-parallel-rpc-port",
    "data-parallel-size",
    "data-parallel-size-local",
    "data-parallel-start-rank",
    "distributed-executor-backend",
    "download-dir",
    "dtype",
    "generation-config",
    "hf-config-path",
    "hf-overrides",
    "kv-cache-dtype",
    "kv-cache-memory-bytes",
    "kv-transfer-config",
    "limit-mm-per-prompt",
    "load-format",
    "logprobs-mode",
    "lora-modules",
    "max-cpu-loras",
    "max-log-len",
    "max-logprobs",
    "max-lora-rank",
    "max-loras",
    "max-num-batched-tokens",
    "max-num-seqs",
    "middleware",
    "mm-processor-kwargs",
    "model-impl",
    "override-generation-config",
    "pipeline-parallel-size",
    "quantization",
    "reasoning-parser",
    "response-role",
    "revision",
    "root-path",
    "scheduling-policy",
    "seed",
    "speculative-config",
    "ssl-certfile",
    "ssl-keyfile",
    "tokenizer",
    "tokenizer-mode",
    "tokenizer-revision",
    "tool-call-parser",
    "uvicorn-log-level",
];

/// Real vLLM flags that take no value (also accepted as `--no-FLAG`), accepted and ignored.
pub const IGNORED_BOOL_FLAGS: &[&str] = &[
    "async-scheduling",
    "disable-custom-all-reduce",
    "disable-fastapi-docs",
    "disable-uvicorn-access-log",
    "enable-auto-tool-choice",
    "enable-chunked-prefill",
    "enable-expert-parallel",
    "enable-log-requests",
    "enable-lora",
    "enable-prefix-caching",
    "enable-prompt-tokens-details",
    "enable-request-id-headers",
    "enable-server-load-tracking",
    "enforce-eager",
    "headless",
    "skip-tokenizer-init",
    "trust-remote-code",
];

/// Short vLLM flags and the long flag each stands for.
const SHORT_FLAGS: &[(&str, &str)] = &[
    ("-tp", "tensor-parallel-size"),
    ("-pp", "pipeline-parallel-size"),
    ("-dp", "data-parallel-size"),
    ("-q", "quantization"),
    ("-O", "compilation-config"),
];

/// Why the command line was refused.
#[derive(Debug, thiserror::Error)]
pub enum ArgvError {
    /// clap refused it (or it asked for `--help`/`--version`).
    #[error(transparent)]
    Clap(#[from] clap::Error),
    /// Flags neither vLLM (as far as fake-vllm knows) nor fake-vllm has.
    #[error(
        "usage: vllm serve [model_tag] [options]\nvllm serve: error: unrecognized arguments: {}",
        .0.join(" ")
    )]
    Unrecognized(Vec<String>),
}

impl ArgvError {
    /// Prints the error like argparse (or clap) and returns the exit status: 2 for errors, 0
    /// for `--help`.
    pub fn report(&self) -> u8 {
        match self {
            ArgvError::Clap(e) => {
                let _ = e.print();
                if e.use_stderr() { 2 } else { 0 }
            }
            ArgvError::Unrecognized(_) => {
                eprintln!("{self}");
                2
            }
        }
    }
}

/// The long flags clap knows for `serve` (fake-vllm's own and the modelled vLLM ones).
fn modelled_flags() -> Vec<String> {
    let cmd = Cli::command();
    let serve = cmd.find_subcommand("serve").expect("serve subcommand");
    let mut known: Vec<String> = vec!["help".into()];
    for a in serve.get_arguments() {
        known.extend(a.get_long().map(str::to_string));
        known.extend(
            a.get_all_aliases()
                .unwrap_or_default()
                .into_iter()
                .map(str::to_string),
        );
    }
    known
}

fn is_number(s: &str) -> bool {
    s.parse::<f64>().is_ok()
}

fn is_flag(s: &str) -> bool {
    s.starts_with('-') && s != "-" && !is_number(s)
}

/// Rewrites the arguments after `serve`: short forms and `_` spellings become clap's long
/// flags, ignored vLLM flags (and their values) are dropped, and anything unknown is an
/// [`ArgvError::Unrecognized`].
pub fn normalize(args: Vec<OsString>) -> Result<Vec<OsString>, ArgvError> {
    let Some(serve_at) = args.iter().position(|a| a == "serve") else {
        return Ok(args);
    };
    let known = modelled_flags();
    let mut out: Vec<OsString> = args[..=serve_at].to_vec();
    let mut unknown = Vec::new();
    let mut rest = args[serve_at + 1..].iter().peekable();
    while let Some(arg) = rest.next() {
        let s = arg.to_string_lossy().into_owned();
        if s == "--" {
            out.push(arg.clone());
            out.extend(rest.by_ref().cloned());
            break;
        }
        if !is_flag(&s) || s == "-h" {
            out.push(arg.clone());
            continue;
        }
        let (flag, value) = match s.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (s.clone(), None),
        };
        let name = match SHORT_FLAGS.iter().find(|(short, _)| *short == flag) {
            Some((_, long)) => (*long).to_string(),
            None if flag.starts_with("--") => flag[2..].replace('_', "-"),
            None => {
                unknown.push(s);
                continue;
            }
        };
        if known.contains(&name) {
            out.push(match &value {
                Some(v) => format!("--{name}={v}").into(),
                None => format!("--{name}").into(),
            });
        } else if IGNORED_VALUE_FLAGS.contains(&name.as_str()) {
            if value.is_none() && rest.peek().is_some_and(|n| !is_flag(&n.to_string_lossy())) {
                rest.next();
            }
            tracing::debug!(flag = %s, "ignoring a vLLM flag fake-vllm does not model");
        } else if IGNORED_BOOL_FLAGS.contains(&name.as_str())
            || name
                .strip_prefix("no-")
                .is_some_and(|n| IGNORED_BOOL_FLAGS.contains(&n) || known.iter().any(|k| k == n))
        {
            if value.is_some() {
                unknown.push(s);
            }
        } else {
            unknown.push(s);
        }
    }
    if unknown.is_empty() {
        Ok(out)
    } else {
        Err(ArgvError::Unrecognized(unknown))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(args: &[&str]) -> Result<Vec<String>, ArgvError> {
        let mut v = vec!["fake-vllm", "serve"];
        v.extend_from_slice(args);
        normalize(v.into_iter().map(OsString::from).collect()).map(|v| {
            v.into_iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        })
    }

    #[test]
    fn ignored_flags_and_their_values_are_dropped() {
        let out = norm(&[
            "m",
            "--dtype",
            "bfloat16",
            "--seed",
            "-1",
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--max_model_len",
            "4096",
            "-tp",
            "2",
            "--compilation-config={\"level\":3}",
        ])
        .unwrap();
        assert_eq!(
            out,
            [
                "fake-vllm",
                "serve",
                "m",
                "--max-model-len",
                "4096",
                "--tensor-parallel-size",
                "2"
            ]
        );
    }

    #[test]
    fn unknown_and_mistyped_flags_are_refused_like_argparse() {
        let e = norm(&["m", "--foo", "--gpu-memory-utilisation", "0.5"]).unwrap_err();
        assert!(
            matches!(&e, ArgvError::Unrecognized(u) if u == &["--foo", "--gpu-memory-utilisation"])
        );
        assert!(
            e.to_string().ends_with(
                "vllm serve: error: unrecognized arguments: --foo --gpu-memory-utilisation"
            ),
            "{e}"
        );
        assert!(norm(&["m", "--enforce-eager=1"]).is_err());
    }

    #[test]
    fn every_listed_flag_is_real_and_not_modelled_twice() {
        let known = modelled_flags();
        for f in IGNORED_VALUE_FLAGS.iter().chain(IGNORED_BOOL_FLAGS) {
            assert!(
                !known.iter().any(|k| k == f),
                "--{f} is both modelled and ignored"
            );
        }
    }
}
