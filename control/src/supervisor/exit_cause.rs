//! Why an engine exited, in one line: read from the end of its stderr once it
//! is gone, so that `last_error` says `ValueError: Free memory on device
//! cuda:0 (2.0/79.1 GiB) on startup is less than desired GPU memory
//! utilization ...` instead of only `exit status: 1`.
//!
//! vLLM prints a Python traceback whose last line is the exception
//! (`ValueError: ...`, `torch.OutOfMemoryError: CUDA out of memory ...`),
//! prefixed in its logging format (`(EngineCore_DP0 pid=12) ERROR 12-02
//! 05:57:23 [core.py:708] ValueError: ...`); when the engine core fails, the
//! API server then ends with `RuntimeError: Engine core initialization
//! failed. See root cause above.` The root cause is the line wanted; the
//! wrapper is kept only when nothing else was printed. Warnings that quote an
//! exception (`... can cause fd limit errors like OSError: ...`) are skipped.
//! vLLM's logger writes to stdout and uncaught tracebacks go to stderr, so
//! both files are read: a root cause in either wins over a wrapper.
//! An engine that refuses its command line exits 2 after argparse's
//! `vllm serve: error: unrecognized arguments: --foo` (SGLang's the same
//! with its own program name): that line is the cause too.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// How much of the end of the file is read.
const TAIL: u64 = 64 * 1024;
/// Longest cause kept (in characters).
const MAX_CHARS: usize = 400;
/// Log levels of lines that only mention an exception.
const NOT_ERRORS: [&str; 4] = ["WARNING", "WARN", "INFO", "DEBUG"];

/// One exception line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Found {
    line: String,
    /// Only points at a cause printed before it ("See root cause above").
    wrapper: bool,
}

/// The cause read from the ends of `paths` (the engine's stderr, then its
/// stdout), if they name one: the first root cause, else the first
/// wrapper. Blocking.
pub fn read(paths: &[&Path]) -> Option<String> {
    let found: Vec<Found> = paths.iter().filter_map(|p| pick(&tail(p)?)).collect();
    found
        .iter()
        .find(|f| !f.wrapper)
        .or(found.first())
        .map(|f| f.line.clone())
}

fn tail(path: &Path) -> Option<String> {
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(TAIL))).ok()?;
    let mut buf = Vec::new();
    f.take(TAIL).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// The last exception line of `text` that is not a warning, preferring a
/// root cause to a wrapper that points at one.
fn pick(text: &str) -> Option<Found> {
    let mut wrapper = None;
    for line in text.lines().rev() {
        let Some(at) = exception_at(line) else {
            continue;
        };
        if line[..at]
            .split(|c: char| !c.is_ascii_alphabetic())
            .any(|w| NOT_ERRORS.contains(&w))
        {
            continue;
        }
        let found = Found {
            line: clip(line[at..].trim_end()),
            wrapper: line.contains("root cause"),
        };
        if !found.wrapper {
            return Some(found);
        }
        wrapper.get_or_insert(found);
    }
    wrapper
}

/// Where the first exception name followed by `: ` starts in `line`
/// (`ValueError: `, `torch.OutOfMemoryError: `, `CustomException: `), or 0
/// for argparse's refusal (`PROG: error: MESSAGE`, PROG a program name).
fn exception_at(line: &str) -> Option<usize> {
    if let Some(end) = line.find(": error: ")
        && end > 0
        && end <= 60
        && line[..end]
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || " _-./".contains(c))
    {
        return Some(0);
    }
    ["Error: ", "Exception: "]
        .iter()
        .filter_map(|suffix| {
            let end = line.find(suffix)?;
            let start = line[..end]
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
                .map_or(0, |p| p + 1);
            Some(start)
        })
        .min()
}

fn clip(s: &str) -> String {
    match s.char_indices().nth(MAX_CHARS) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(text: &str) -> Option<String> {
        pick(text).map(|f| f.line)
    }

    /// What vLLM 0.24 prints when the engine core cannot start for lack of
    /// GPU memory (abridged), after a warning that quotes an exception.
    const VLLM_NO_MEMORY: &str = "\
(APIServer pid=7591) WARNING 12-02 06:01:22 [system_utils.py:299] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`.
(EngineCore_DP0 pid=7908) ERROR 12-02 06:01:40 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=7908) ERROR 12-02 06:01:40 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=7908) ERROR 12-02 06:01:40 [core.py:708]   File \"/tmp/site/vllm/v1/worker/gpu_worker.py\", line 201, in init_device
(EngineCore_DP0 pid=7908) ERROR 12-02 06:01:40 [core.py:708] ValueError: Free memory on device cuda:0 (2.0/139.8 GiB) on startup is less than desired GPU memory utilization (0.5, 69.9 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.
Process EngineCore_DP0:
Traceback (most recent call last):
ValueError: Free memory on device cuda:0 (2.0/139.8 GiB) on startup is less than desired GPU memory utilization (0.5, 69.9 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.
(APIServer pid=7591) Traceback (most recent call last):
(APIServer pid=7591)   File \"/tmp/site/vllm/entrypoints/openai/api_server.py\", line 1900, in run_server
(APIServer pid=7591) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
/usr/lib/python3.12/multiprocessing/resource_tracker.py:279: UserWarning: resource_tracker: There appear to be 1 leaked shared_memory objects to clean up at shutdown
";

    #[test]
    fn the_root_cause_is_picked_not_the_wrapper_nor_a_warning() {
        assert_eq!(
            line(VLLM_NO_MEMORY).as_deref(),
            Some(
                "ValueError: Free memory on device cuda:0 (2.0/139.8 GiB) on startup is less \
                 than desired GPU memory utilization (0.5, 69.9 GiB). Decrease GPU memory \
                 utilization or reduce GPU memory used by other processes."
            )
        );
    }

    #[test]
    fn module_paths_and_tracing_prefixes_are_understood() {
        let text = "2026-12-02T06:01:40.1Z ERROR fake_vllm::server: torch.OutOfMemoryError: CUDA \
                    out of memory. Tried to allocate 2.00 GiB.\n";
        assert_eq!(
            line(text).as_deref(),
            Some("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
        );
    }

    /// A flag vLLM does not know: argparse's usage and refusal on stderr,
    /// exit status 2 (fake-vllm prints the same).
    #[test]
    fn a_refused_command_line_is_the_cause() {
        let text = "usage: vllm serve [model_tag] [options]\n\
                    vllm serve: error: unrecognized arguments: --no-such-flag\n";
        assert_eq!(
            line(text).as_deref(),
            Some("vllm serve: error: unrecognized arguments: --no-such-flag")
        );
        let sglang = "usage: launch_server.py [-h] --model-path MODEL_PATH\n\
                      launch_server.py: error: the following arguments are required: --model-path\n";
        assert_eq!(
            line(sglang).as_deref(),
            Some("launch_server.py: error: the following arguments are required: --model-path")
        );
        // Not a program's refusal: a log line that says "error: " later on.
        let log = "(APIServer pid=1) INFO 12-02 [api_server.py:1] request failed: error: x\n";
        assert_eq!(line(log), None);
    }

    #[test]
    fn a_wrapper_alone_is_kept_and_nothing_is_made_up() {
        let only_wrapper = "RuntimeError: Engine core initialization failed. See root cause \
                            above. Failed core proc(s): {}\n";
        assert_eq!(line(only_wrapper).as_deref(), Some(only_wrapper.trim_end()));
        assert_eq!(line("INFO: Shutting down\nexit\n"), None);
        assert_eq!(
            line("WARNING 12-02 [x.py:1] retrying after OSError: busy\n"),
            None
        );
        assert_eq!(line(""), None);
    }

    #[test]
    fn a_long_cause_is_clipped_and_the_file_is_read_from_its_end() {
        let long = format!("ValueError: {}\n", "é".repeat(1000));
        let got = line(&long).unwrap();
        assert_eq!(got.chars().count(), MAX_CHARS + 1);
        assert!(got.ends_with('…'));

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.stderr.log");
        let noise = "INFO: step\n".repeat(20_000); // more than TAIL
        std::fs::write(&path, format!("{noise}{VLLM_NO_MEMORY}")).unwrap();
        assert!(
            read(&[&path])
                .unwrap()
                .starts_with("ValueError: Free memory")
        );
        assert_eq!(read(&[&dir.path().join("missing.log")]), None);
    }

    /// vLLM logs to stdout and lets uncaught tracebacks go to stderr: the
    /// root cause wins wherever it is, a wrapper only when there is nothing
    /// else; fake-vllm's startup failure (its log on stdout) is read too.
    #[test]
    fn a_root_cause_in_either_file_wins_over_a_wrapper() {
        let dir = tempfile::tempdir().unwrap();
        let (err, out) = (dir.path().join("err"), dir.path().join("out"));
        std::fs::write(
            &err,
            "RuntimeError: Engine core initialization failed. See root cause above.\n",
        )
        .unwrap();
        std::fs::write(
            &out,
            "2026-12-02T06:07:02.064474Z ERROR ValueError: Free memory on device cuda:0 \
             (2.00/10.00 GiB) on startup is less than desired.\n\
             2026-12-02T06:07:02.069656Z ERROR fake-vllm failed error=Engine core \
             initialization failed. See root cause above. (ValueError: Free memory)\n",
        )
        .unwrap();
        assert_eq!(
            read(&[&err, &out]).as_deref(),
            Some(
                "ValueError: Free memory on device cuda:0 (2.00/10.00 GiB) on startup is less \
                 than desired."
            )
        );
        std::fs::write(&out, "INFO nothing\n").unwrap();
        assert!(
            read(&[&err, &out])
                .unwrap()
                .starts_with("RuntimeError: Engine core")
        );
    }
}
