//! The gRPC connection to siesta-control: address normalisation, the bearer
//! token, and errors mapped to [`Failure`].

use std::future::Future;
use std::time::Duration;

use siesta_proto::v1::control_client::ControlClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::failure::Failure;

/// How long to try to connect before saying the control plane is unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a call (or the opening of a stream) may take to be answered.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(30);
/// HTTP/2 pings on the connection this often: a long call or stream
/// (`wake --wait`, `watch`, `logs -f`, `top`) to a control plane that stops
/// answering (its host frozen, a network cut that leaves the connection
/// open) ends instead of waiting for ever.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);
/// A ping unanswered this long: the control plane is unreachable.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Adds `authorization: Bearer <token>` to every call when a token is set.
#[derive(Debug, Clone)]
pub struct Auth(Option<MetadataValue<Ascii>>);

impl Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// The typed client every command uses.
pub type Client = ControlClient<InterceptedService<Channel, Auth>>;

/// A connected client and the URL it talks to (for error messages).
#[derive(Debug, Clone)]
pub struct Conn {
    pub url: String,
    pub client: Client,
}

impl Conn {
    /// Connects now, so an unreachable control plane is reported before any
    /// command starts.
    pub async fn connect(url: &str, token: Option<&str>) -> Result<Conn, Failure> {
        let url = normalise_url(url);
        plain_http(&url)?;
        let auth = match token.filter(|t| !t.is_empty()) {
            Some(t) => Some(MetadataValue::try_from(format!("Bearer {t}")).map_err(|_| {
                Failure::Usage("the token holds characters not allowed in a header".into())
            })?),
            None => None,
        };
        let endpoint = Endpoint::from_shared(url.clone())
            .map_err(|e| Failure::Usage(format!("invalid control plane address {url:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE_EVERY)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| Failure::connect(&url, &e))?;
        let client = ControlClient::with_interceptor(channel, Auth(auth))
            .max_decoding_message_size(64 * 1024 * 1024);
        Ok(Conn { url, client })
    }

    /// Makes one call with [`RPC_TIMEOUT`]; a control plane that accepts the
    /// connection but never answers counts as unreachable.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, Failure>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.call_within(RPC_TIMEOUT, f).await
    }

    /// Like [`Conn::call`] with its own deadline.
    pub async fn call_within<T, F, Fut>(&self, deadline: Duration, f: F) -> Result<T, Failure>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(deadline, f(self.client.clone())).await {
            Ok(Ok(resp)) => Ok(resp.into_inner()),
            Ok(Err(status)) => Err(self.err(status)),
            Err(_) => Err(Failure::Unreachable {
                url: self.url.clone(),
                reason: format!("no answer within {}s", deadline.as_secs()),
            }),
        }
    }

    /// Maps an RPC error from this control plane.
    pub fn err(&self, status: tonic::Status) -> Failure {
        Failure::status(&self.url, &status)
    }
}

/// `host:port` is taken as `http://host:port`.
pub fn normalise_url(url: &str) -> String {
    let url = url.trim().trim_end_matches('/');
    if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    }
}

/// The control plane speaks plain HTTP/2 only (as the proxy's `--control`
/// says too). An `https://` address is refused: tonic built without TLS
/// would talk plaintext to it, bearer token and all, to an operator who
/// believed it encrypted.
fn plain_http(url: &str) -> Result<(), Failure> {
    match url.split_once("://") {
        Some((scheme, _)) if !scheme.eq_ignore_ascii_case("http") => Err(Failure::Usage(format!(
            "invalid control plane address {url:?}: only http:// is supported (siesta-control \
             serves plain gRPC; for TLS put a terminating proxy in front and reach it from the \
             same host)"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `https://` is refused before anything is sent: the channel has no
    /// TLS and would have sent the token in plaintext.
    #[tokio::test]
    async fn an_https_address_is_refused_not_spoken_to_in_plaintext() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let err = Conn::connect(&url, Some("secret")).await.unwrap_err();
        assert!(matches!(err, Failure::Usage(_)), "{err:?}");
        assert!(
            err.to_string().contains("only http:// is supported"),
            "{err}"
        );
        // Nothing connected.
        let accepted =
            tokio::time::timeout(std::time::Duration::from_millis(200), listener.accept()).await;
        assert!(
            accepted.is_err(),
            "the CLI connected to an https:// address"
        );
        assert!(plain_http("http://h:1").is_ok());
        assert!(plain_http("HTTP://h:1").is_ok());
    }

    #[test]
    fn bare_addresses_get_a_scheme() {
        assert_eq!(normalise_url("127.0.0.1:50051"), "http://127.0.0.1:50051");
        assert_eq!(normalise_url("https://h:1/"), "https://h:1");
    }

    #[tokio::test]
    async fn refused_connection_is_unreachable() {
        // Bind then drop a listener so the port is (almost certainly) closed.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let err = Conn::connect(&addr.to_string(), None).await.unwrap_err();
        assert_eq!(err.exit_code(), 3);
        assert_eq!(
            err.to_string(),
            format!(
                "cannot reach siesta-control at http://{addr}: connection refused — is it running?"
            )
        );
    }

    #[test]
    fn interceptor_sets_bearer() {
        let mut auth = Auth(Some(MetadataValue::try_from("Bearer s3cret").unwrap()));
        let req = auth.call(tonic::Request::new(())).unwrap();
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer s3cret"
        );
    }
}
