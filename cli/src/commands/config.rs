//! `siesta config check PATH`: the daemon's own validation and placement,
//! nothing started. A file the daemon would refuse is refused here with the
//! same message.

use std::path::Path;

use siesta_control::config::Config;
use siesta_control::placement::Planned;

use crate::failure::Failure;

pub fn check(path: &Path) -> Result<(), Failure> {
    let refused = |err: &dyn std::fmt::Display| {
        // One problem per line: `FILE: KEY: what is wrong`.
        for line in err.to_string().lines().filter(|l| !l.trim().is_empty()) {
            eprintln!("{line}");
        }
        Failure::Reported
    };
    let config = Config::load(path).map_err(|e| refused(&e))?;
    // A listener beyond loopback with no token: the daemon would not start.
    config.check_tokens().map_err(|e| refused(&e))?;
    // A `host` that is no address of this machine (where the check runs):
    // the daemon could pick no port there.
    siesta_control::check_hosts(&config, |_| true).map_err(|e| refused(&e))?;
    // The same inventory as the daemon (NVML, else `[[gpu]]`) and the same
    // placement function: what cannot fit is refused with its arithmetic.
    match siesta_control::gpu_view::check(&config).map_err(|e| refused(&e))? {
        Planned::Placed(p) => {
            let on_gpus = p.iter().filter(|p| !p.gpus.is_empty()).count();
            println!(
                "{}: ok ({on_gpus} model(s) placed on the GPUs)",
                path.display()
            );
        }
        Planned::NoInventory => println!(
            "{}: ok (no GPU known here, no NVML and no [[gpu]]: placement not checked)",
            path.display()
        ),
    }
    Ok(())
}
