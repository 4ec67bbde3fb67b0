//! Bearer-token check (constant time) for non-loopback listeners.

use subtle::ConstantTimeEq;
use tonic::{Request, Status};

/// A tonic interceptor: every call must carry `authorization: Bearer TOKEN`.
#[derive(Debug, Clone)]
pub struct BearerAuth {
    token: Option<String>,
}

impl BearerAuth {
    /// `None`: no check (loopback without a token).
    pub fn new(token: Option<String>) -> Self {
        Self { token }
    }

    pub fn check<T>(&self, req: Request<T>) -> Result<Request<T>, Status> {
        let Some(token) = &self.token else {
            return Ok(req);
        };
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .unwrap_or("");
        if bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
            Ok(req)
        } else {
            Err(Status::unauthenticated(
                "missing or wrong bearer token (expected `authorization: Bearer TOKEN` with the control plane's [control] token or SIESTA_TOKEN)",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_checked() {
        let auth = BearerAuth::new(Some("s3cret".into()));
        let mut ok = Request::new(());
        ok.metadata_mut()
            .insert("authorization", "Bearer s3cret".parse().unwrap());
        assert!(auth.check(ok).is_ok());
        let mut bad = Request::new(());
        bad.metadata_mut()
            .insert("authorization", "Bearer s3cre".parse().unwrap());
        assert_eq!(
            auth.check(bad).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(auth.check(Request::new(())).is_err());
        assert!(BearerAuth::new(None).check(Request::new(())).is_ok());
    }
}
