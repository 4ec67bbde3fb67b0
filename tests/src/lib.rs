//! Shared helpers for siesta's end-to-end tests.
#![forbid(unsafe_code)]
