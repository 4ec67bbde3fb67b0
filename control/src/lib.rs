//! siesta-control: owns every engine on one GPU box.
#![forbid(unsafe_code)]

pub(crate) mod admission;
pub(crate) mod api;
pub mod checkpoint;
pub mod config;
pub(crate) mod engine;
mod error;
pub(crate) mod fence;
pub mod gpu;
pub mod gpu_view;
pub(crate) mod hub;
pub(crate) mod models;
pub mod placement;
pub mod reconciler;
pub(crate) mod recovery;
pub(crate) mod runner;
pub(crate) mod server;
pub(crate) mod status;
pub(crate) mod store;
pub(crate) mod supervisor;
pub(crate) mod web;

pub use config::Config;
pub use error::{Error, OpError};
pub use runner::StopBound;
pub use server::{ServeOptions, Server};
pub use supervisor::{SWEEP_DEADLINE as KILL_SWEEP_DEADLINE, check_hosts, kill_engines_now};
