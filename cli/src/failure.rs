//! How a command fails, and the exit code each failure maps to.

use std::error::Error as StdError;
use std::fmt;
use std::io;

use tonic::Code;

/// Exit code: the operation failed.
pub const EXIT_FAILED: u8 = 1;
/// Exit code: usage error (also what clap uses).
pub const EXIT_USAGE: u8 = 2;
/// Exit code: the control plane could not be reached.
pub const EXIT_UNREACHABLE: u8 = 3;

/// Why a command did not succeed.
#[derive(Debug)]
pub enum Failure {
    /// The control plane did not answer at all.
    Unreachable { url: String, reason: String },
    /// The operation was refused or failed; the message says why.
    Failed(String),
    /// The command line was wrong in a way clap could not see.
    Usage(String),
    /// Failed, and the command already printed why.
    Reported,
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Unreachable { .. } => EXIT_UNREACHABLE,
            Failure::Failed(_) | Failure::Reported => EXIT_FAILED,
            Failure::Usage(_) => EXIT_USAGE,
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
    pub fn status(url: &str, status: &tonic::Status) -> Self {
        match status.code() {
            Code::Unavailable => Failure::Unreachable {
                url: url.to_owned(),
                reason: status_reason(status),
            },
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
            Failure::Unreachable { url, reason } => {
                write!(
                    f,
                    "cannot reach siesta-control at {url}: {reason} — is it running?"
                )
            }
            Failure::Failed(msg) | Failure::Usage(msg) => f.write_str(msg),
            Failure::Reported => Ok(()),
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

fn status_reason(status: &tonic::Status) -> String {
    match status.source() {
        Some(src) => transport_reason(src),
        None if status.message().is_empty() => "unavailable".into(),
        None => status.message().to_owned(),
    }
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
    fn status_codes_map_to_exit_codes() {
        let url = "http://x:1";
        assert_eq!(
            Failure::status(url, &tonic::Status::unavailable("down")).exit_code(),
            3
        );
        let nf = Failure::status(url, &tonic::Status::not_found("no model named \"x\""));
        assert_eq!(nf.exit_code(), 1);
        assert_eq!(nf.to_string(), "no model named \"x\"");
        let auth = Failure::status(url, &tonic::Status::unauthenticated("bad token"));
        assert!(auth.to_string().contains("SIESTA_TOKEN"), "{auth}");
    }

    #[test]
    fn io_errors_name_their_kind() {
        let e = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert_eq!(transport_reason(&e), "connection refused");
    }
}
