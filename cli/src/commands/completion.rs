//! `siesta completion SHELL`: a completion script on stdout.

use clap::CommandFactory;
use clap_complete::Shell;

use crate::args::Cli;
use crate::failure::Failure;

pub fn run(shell: Shell) -> Result<(), Failure> {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "siesta", &mut std::io::stdout());
    Ok(())
}
