//! siesta-control: owns every engine on one GPU box.
#![forbid(unsafe_code)]
