//! The one place an [`OpError`] becomes a `tonic::Status`: each kind of
//! failure has one gRPC code, and the message is the error's text.

use crate::OpError;
use tonic::Status;

impl From<OpError> for Status {
    fn from(e: OpError) -> Self {
        let msg = e.to_string();
        match e {
            OpError::NotFound(_) => Status::not_found(msg),
            OpError::Invalid { .. } => Status::invalid_argument(msg),
            // Reload takes no argument: the file on disk is the state that
            // is wrong, not the request.
            OpError::Refused(_) | OpError::Config(_) => Status::failed_precondition(msg),
            OpError::ShuttingDown => Status::unavailable(msg),
            OpError::Internal(_) | OpError::Io { .. } => Status::internal(msg),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConfigError, Problem};
    use tonic::Code;

    fn code(e: OpError) -> (Code, String) {
        let s = Status::from(e);
        (s.code(), s.message().to_string())
    }

    #[test]
    fn each_kind_has_its_code_and_message() {
        assert_eq!(
            code(OpError::NotFound("nope".into())),
            (
                Code::NotFound,
                "model \"nope\" not found (`siesta status` lists the models and their aliases)"
                    .into()
            )
        );
        assert_eq!(
            code(OpError::invalid("level", "3 is not a sleep level (1 or 2)")),
            (
                Code::InvalidArgument,
                "level: 3 is not a sleep level (1 or 2)".into()
            )
        );
        let cfg = ConfigError {
            origin: "/etc/siesta.toml".into(),
            problems: vec![Problem {
                key: "model[0].colour".into(),
                message: "unknown key".into(),
            }],
        };
        assert_eq!(
            code(OpError::Config(cfg)),
            (
                Code::FailedPrecondition,
                "/etc/siesta.toml: model[0].colour: unknown key".into()
            )
        );
        assert_eq!(
            code(OpError::Refused("chat is stopped: start it first".into())).0,
            Code::FailedPrecondition
        );
        assert_eq!(
            code(OpError::ShuttingDown),
            (
                Code::Unavailable,
                "the control plane is shutting down".into()
            )
        );
        assert_eq!(code(OpError::Internal("x".into())).0, Code::Internal);
        let io = OpError::io(
            "reload: starting chat",
            std::io::Error::from(std::io::ErrorKind::AddrInUse),
        );
        let (c, m) = code(io);
        assert_eq!(c, Code::Internal);
        assert!(m.starts_with("reload: starting chat: "), "{m}");
    }
}
