//! Run until SIGINT or SIGTERM, reload on SIGHUP: the one place every
//! siesta binary (and fake-vllm) installs signal handlers.
//!
//! [`shutdown_signal`] installs both handlers at once, so a binary that
//! cannot install them fails at start-up with a clear error instead of
//! running without a way to stop it cleanly, and returns a future that
//! resolves with the first of the two signals to arrive.
//! [`reload_signal`] does the same for SIGHUP, which siesta-control takes
//! as "re-read the configuration file".
#![forbid(unsafe_code)]

use std::fmt;
use std::future::Future;

use tokio::signal::unix::{Signal, SignalKind, signal};

/// The signal that asked for the shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM (a process manager's stop).
    Terminate,
}

impl Shutdown {
    /// The signal's name, `SIGINT` or `SIGTERM`.
    pub fn name(self) -> &'static str {
        match self {
            Shutdown::Interrupt => "SIGINT",
            Shutdown::Terminate => "SIGTERM",
        }
    }
}

impl fmt::Display for Shutdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A signal handler could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("cannot install the {signal} handler: {source}")]
pub struct SignalError {
    /// `SIGINT`, `SIGTERM` or `SIGHUP`.
    pub signal: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// Installs the SIGINT and SIGTERM handlers now and returns a future that
/// resolves with the first of them to arrive.
///
/// Must be called inside a Tokio runtime (with signal and I/O drivers
/// enabled); an error (no runtime driver, the OS refusing) is returned at
/// once rather than leaving the process without handlers.
pub fn shutdown_signal() -> Result<impl Future<Output = Shutdown> + Send + 'static, SignalError> {
    let mut int = install(SignalKind::interrupt(), "SIGINT")?;
    let mut term = install(SignalKind::terminate(), "SIGTERM")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => Shutdown::Interrupt,
            _ = term.recv() => Shutdown::Terminate,
        }
    })
}

/// Every SIGHUP from now on, for "re-read the configuration".
#[derive(Debug)]
pub struct ReloadSignal(Signal);

impl ReloadSignal {
    /// The next SIGHUP (several arriving together count as one).
    pub async fn recv(&mut self) {
        // `None` only once the runtime shuts down: then nothing comes.
        if self.0.recv().await.is_none() {
            std::future::pending::<()>().await;
        }
    }
}

/// Installs the SIGHUP handler now (so a SIGHUP no longer ends the
/// process); same rules and errors as [`shutdown_signal`].
pub fn reload_signal() -> Result<ReloadSignal, SignalError> {
    install(SignalKind::hangup(), "SIGHUP").map(ReloadSignal)
}

fn install(kind: SignalKind, name: &'static str) -> Result<Signal, SignalError> {
    // tokio panics outside a runtime; report it as an error instead.
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(SignalError {
            signal: name,
            source: std::io::Error::other("no Tokio runtime is running"),
        });
    }
    signal(kind).map_err(|source| SignalError {
        signal: name,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::{Signal, raise};
    use std::time::Duration;

    #[test]
    fn outside_a_runtime_it_is_an_error_not_a_panic() {
        let err = shutdown_signal().err().expect("no runtime: an error");
        assert_eq!(err.signal, "SIGINT");
        assert_eq!(
            err.to_string(),
            "cannot install the SIGINT handler: no Tokio runtime is running"
        );
    }

    #[test]
    fn reload_outside_a_runtime_is_an_error() {
        let err = reload_signal().expect_err("no runtime: an error");
        assert_eq!(err.signal, "SIGHUP");
    }

    #[tokio::test]
    async fn reload_signal_sees_each_sighup() {
        let mut hup = reload_signal().expect("handler installed");
        for _ in 0..2 {
            assert!(
                tokio::time::timeout(Duration::from_millis(50), hup.recv())
                    .await
                    .is_err(),
                "nothing arrived yet"
            );
            raise(Signal::SIGHUP).expect("raise");
            tokio::time::timeout(Duration::from_secs(30), hup.recv())
                .await
                .expect("seen after the signal");
        }
    }

    // Both signals in one test: the handlers are process-wide, and a second
    // test raising SIGTERM concurrently could resolve this one's future.
    #[tokio::test]
    async fn resolves_with_the_signal_that_arrived() {
        for (sig, want) in [
            (Signal::SIGTERM, Shutdown::Terminate),
            (Signal::SIGINT, Shutdown::Interrupt),
        ] {
            let fut = shutdown_signal().expect("handlers installed");
            tokio::pin!(fut);
            // Nothing arrived yet: still pending.
            assert!(
                tokio::time::timeout(Duration::from_millis(50), &mut fut)
                    .await
                    .is_err()
            );
            raise(sig).expect("raise");
            let got = tokio::time::timeout(Duration::from_secs(30), fut)
                .await
                .expect("resolved after the signal");
            assert_eq!(got, want);
            assert_eq!(got.to_string(), want.name());
        }
    }
}
