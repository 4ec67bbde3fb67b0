//! `siesta completion SHELL`: a completion script on stdout.

use clap::CommandFactory;
use clap_complete::Shell;

use crate::args::Cli;
use crate::failure::Failure;

pub fn run(shell: Shell) -> Result<(), Failure> {
    let mut cmd = Cli::command();
    // Into memory first: clap_complete panics on a write error, and a
    // closed stdout is `out`'s to handle.
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "siesta", &mut script);
    print!("{}", String::from_utf8_lossy(&script));
    Ok(())
}
