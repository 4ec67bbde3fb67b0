//! fake-vllm: a stand-in for `vllm serve`.
#![forbid(unsafe_code)]
