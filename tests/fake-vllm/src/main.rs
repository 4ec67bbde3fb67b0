//! `fake-vllm serve MODEL ...`: see the library.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    fake_vllm::main_with_args(std::env::args_os())
}
