//! The JSON views of the web listener: the same as the CLI's `-o json`
//! (`siesta_proto::view`).

pub use siesta_proto::view::*;
