//! Everything the CLI prints on stdout goes through here: main.rs shadows
//! `print!` and `println!` with macros that call [`write`]. A reader that
//! went away (`siesta status | head -1`) ends the command quietly, exit 0,
//! where std's macros panic ("failed printing to stdout: Broken pipe",
//! exit 101) and a stream (`watch`, `logs -f`) would run on unread.

use std::fmt;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::failure::EXIT_FAILED;

/// Set by `siesta up`: its output is a courtesy, its engines are not.
static KEEP_SERVING: AtomicBool = AtomicBool::new(false);

/// From now on a stdout that cannot be written drops the lines and the
/// process goes on (`siesta up`: exiting would leave its engines running
/// unmanaged).
pub fn keep_serving() {
    KEEP_SERVING.store(true, Ordering::Relaxed);
}

/// Writes to stdout (line-buffered: a line is written when it ends).
pub fn write(args: fmt::Arguments<'_>) {
    if let Err(e) = io::stdout().lock().write_fmt(args) {
        failed(&e);
    }
}

/// Writes to stderr; a line that cannot be written is dropped (see
/// `eprintln!` in main.rs).
pub fn note(args: fmt::Arguments<'_>) {
    let _ = io::stderr().lock().write_fmt(args);
}

/// Stdout cannot be written: a closed pipe ends the command, exit 0; any
/// other error exits 1 saying so.
fn failed(e: &io::Error) {
    if KEEP_SERVING.load(Ordering::Relaxed) {
        return;
    }
    if e.kind() == io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: cannot write to stdout: {e}");
    std::process::exit(i32::from(EXIT_FAILED));
}
