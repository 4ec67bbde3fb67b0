//! The `siesta.v1` gRPC contract: generated prost messages and tonic
//! client/server for the `Control` service. The `.proto` files under
//! `siesta/v1/` are the documentation.

#![forbid(unsafe_code)]

/// Generated code for package `siesta.v1`.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations
)]
pub mod v1 {
    tonic::include_proto!("siesta.v1");

    /// The encoded file descriptor set, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/siesta_v1_descriptor.bin"));
}

pub use v1::*;

pub mod patience;
pub mod view;

impl v1::ModelState {
    /// The lower-case name operators and clients see: `awake`, `asleep`, ...
    pub fn label(self) -> &'static str {
        use v1::ModelState as S;
        match self {
            S::Unspecified => "unknown",
            S::Stopped => "stopped",
            S::Starting => "starting",
            S::Awake => "awake",
            S::Sleeping => "sleeping",
            S::Asleep => "asleep",
            S::Waking => "waking",
            S::Stopping => "stopping",
            S::Failed => "failed",
            S::Suspending => "suspending",
            S::Suspended => "suspended",
        }
    }
}
