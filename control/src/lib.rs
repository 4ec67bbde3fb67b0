//! siesta-control: owns every engine on one GPU box.
#![forbid(unsafe_code)]

pub mod admission;
pub mod api;
pub mod config;
pub mod engine;
mod error;
pub mod gpu;
pub mod gpu_view;
pub mod hub;
pub mod models;
pub mod placement;
pub mod reconciler;
pub mod recovery;
pub mod runner;
pub mod server;
pub mod status;
pub mod store;
pub mod supervisor;
pub mod web;

pub use config::Config;
pub use error::{Error, OpError};
pub use server::{ServeOptions, Server};
