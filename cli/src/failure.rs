//! How a command fails, and the exit code each failure maps to.

use std::error::Error as StdError;
use std::fmt;
use std::io;

use tonic::Code;

/// Exit code: the operation failed, or siesta-control answered with an
/// error (its message is printed).
pub const EXIT_FAILED: u8 = 1;
/// Exit code: usage error (also what clap uses).
pub const EXIT_USAGE: u8 = 2;
/// Exit code: siesta-control could not be reached: the connection failed
/// or broke, or nothing answered within the deadline. Never an answer.
pub const EXIT_UNREACHABLE: u8 = 3;
/// Exit code: stopped by a second Ctrl-C, without waiting (128 + SIGINT).
pub const EXIT_INTERRUPTED: u8 = 130;

/// Why a command did not succeed.
#[derive(Debug)]
pub enum Failure {
    /// The control plane did not answer at all (no connection, or none
    /// left, or no answer in time).
    Unreachable { url: String, reason: String },
    /// The operation was refused or failed; the message says why.
    Failed(String),
    /// The command line was wrong in a way clap could not see.
    Usage(String),
    /// Failed, and the command already printed why.
    Reported,
    /// A second Ctrl-C ended the command without waiting.
    Interrupted,
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Unreachable { .. } => EXIT_UNREACHABLE,
            Failure::Failed(_) | Failure::Reported => EXIT_FAILED,
            Failure::Usage(_) => EXIT_USAGE,
            Failure::Interrupted => EXIT_INTERRUPTED,
        }
    }

    /// A transport error while connecting to `url`.
    pub fn connect(url: &str, err: &tonic::transport::Error) -> Self {
        Failure::Unreachable {
            url: url.to_owned(),
            reason: transport_reason(err),
        }
    }

    /// An RPC's error status, from the control plane at `url`.
    ///
    /// A status tonic made on this side, because no answer came (the
    /// connection failed or broke), carries that transport error as its
    /// source; one the control plane answered carries none, whatever its
    /// code: that is a failed operation, never "unreachable".
    pub fn status(url: &str, status: &tonic::Status) -> Self {
        if let Some(src) = status.source() {
            return Failure::Unreachable {
                url: url.to_owned(),
                reason: transport_reason(src),
            };
        }
        match status.code() {
            Code::Unauthenticated => Failure::Failed(format!(
                "siesta-control at {url} refused the call: {} (pass --token or set SIESTA_TOKEN)",
                status.message()
            )),
            _ if status.message().is_empty() => {
                Failure::Failed(format!("{:?}", status.code()).to_lowercase())
            }
            _ => Failure::Failed(status.message().to_owned()),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // A port that takes the connection and then says nothing is a
            // daemon stopped (SIGSTOP) or stuck, not one that is down.
            Failure::Unreachable { url, reason }
                if reason.contains("timed out") || reason.starts_with("no answer") =>
            {
                write!(
                    f,
                    "cannot reach siesta-control at {url}: {reason} — is it running, and \
                     answering? (one stopped with SIGSTOP, or stuck, takes connections and \
                     answers nothing)"
                )
            }
            Failure::Unreachable { url, reason } => {
                write!(
                    f,
                    "cannot reach siesta-control at {url}: {reason} — is it running?"
                )
            }
            Failure::Failed(msg) | Failure::Usage(msg) => f.write_str(msg),
            Failure::Reported => Ok(()),
            Failure::Interrupted => f.write_str("interrupted"),
        }
    }
}

impl From<io::Error> for Failure {
    fn from(err: io::Error) -> Self {
        Failure::Failed(err.to_string())
    }
}

impl From<serde_json::Error> for Failure {
    fn from(err: serde_json::Error) -> Self {
        Failure::Failed(err.to_string())
    }
}

/// The most telling words for a transport error: the innermost I/O error's
/// kind ("connection refused") where there is one.
fn transport_reason(err: &(dyn StdError + 'static)) -> String {
    let mut innermost = err.to_string();
    let mut cur: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            return io_reason(io);
        }
        let text = e.to_string();
        if !text.is_empty() {
            innermost = text;
        }
        cur = e.source();
    }
    innermost
}

fn io_reason(err: &io::Error) -> String {
    match err.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".into(),
        io::ErrorKind::ConnectionReset => "connection reset".into(),
        io::ErrorKind::TimedOut => "timed out".into(),
        io::ErrorKind::AddrNotAvailable => "address not available".into(),
        _ => err.to_string(),
    }
}

/// Nothing answered `what` in time: a status [`Failure::status`] reports
/// as unreachable (like a transport error), for streams that wait on their
/// own deadline.
pub fn no_answer(what: &str) -> tonic::Status {
    #[derive(Debug)]
    struct NoAnswer(String);
    impl fmt::Display for NoAnswer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&self.0)
        }
    }
    impl StdError for NoAnswer {}
    tonic::Status::from_error(Box::new(NoAnswer(format!("no answer to {what}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreachable_message_is_one_clear_line() {
        let f = Failure::Unreachable {
            url: "http://127.0.0.1:50051".into(),
            reason: "connection refused".into(),
        };
        assert_eq!(
            f.to_string(),
            "cannot reach siesta-control at http://127.0.0.1:50051: connection refused — is it running?"
        );
        assert_eq!(f.exit_code(), 3);
    }

    #[test]
    fn answered_statuses_are_exit_1_whatever_their_code() {
        let url = "http://x:1";
        // The control plane answered "unavailable" (e.g. shutting down, or
        // a reload it could not apply): it is up, the operation failed.
        let down = Failure::status(url, &tonic::Status::unavailable("shutting down"));
        assert_eq!(
            (down.exit_code(), down.to_string().as_str()),
            (1, "shutting down")
        );
        let internal = Failure::status(url, &tonic::Status::internal("reload of f: boom"));
        assert_eq!(internal.exit_code(), 1);
        assert_eq!(internal.to_string(), "reload of f: boom");
        let nf = Failure::status(url, &tonic::Status::not_found("no model named \"x\""));
        assert_eq!(nf.exit_code(), 1);
        assert_eq!(nf.to_string(), "no model named \"x\"");
        let auth = Failure::status(url, &tonic::Status::unauthenticated("bad token"));
        assert!(auth.to_string().contains("SIESTA_TOKEN"), "{auth}");
    }

    #[test]
    fn transport_statuses_are_unreachable() {
        let url = "http://x:1";
        let refused =
            tonic::Status::from_error(Box::new(io::Error::from(io::ErrorKind::ConnectionRefused)));
        let f = Failure::status(url, &refused);
        assert_eq!(f.exit_code(), 3);
        assert_eq!(
            f.to_string(),
            "cannot reach siesta-control at http://x:1: connection refused — is it running?"
        );
        let slow = Failure::status(url, &no_answer("Watch"));
        assert_eq!(slow.exit_code(), 3);
        assert!(slow.to_string().contains("no answer to Watch"), "{slow}");
        assert!(slow.to_string().contains("stopped with SIGSTOP"), "{slow}");
        let timed_out =
            tonic::Status::from_error(Box::new(io::Error::from(io::ErrorKind::TimedOut)));
        let f = Failure::status(url, &timed_out);
        assert_eq!(
            f.to_string(),
            "cannot reach siesta-control at http://x:1: timed out — is it running, and \
             answering? (one stopped with SIGSTOP, or stuck, takes connections and answers \
             nothing)"
        );
    }

    #[test]
    fn io_errors_name_their_kind() {
        let e = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(transport_reason(&e), "connection refused");
    }
}
