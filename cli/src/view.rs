//! The JSON views of `-o json` (shared with the control plane's web
//! listener: `siesta_proto::view`).

pub use siesta_proto::view::*;
