//! `siesta config check PATH`: the daemon's own validation, nothing started.

use std::path::Path;

use siesta_control::config::Config;

use crate::failure::Failure;

pub fn check(path: &Path) -> Result<(), Failure> {
    match Config::load(path) {
        Ok(_) => {
            println!("{}: ok", path.display());
            Ok(())
        }
        Err(err) => {
            // One problem per line: `FILE: KEY: what is wrong`.
            for line in err.to_string().lines().filter(|l| !l.trim().is_empty()) {
                eprintln!("{line}");
            }
            Err(Failure::Reported)
        }
    }
}
