//! siesta-proxy: the OpenAI-compatible front door.
#![forbid(unsafe_code)]
