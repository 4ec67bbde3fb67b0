//! The library's server in-process: token rules, bearer auth, health and
//! reflection, clean shutdown.

use siesta_control::{Config, Error, ServeOptions, Server};
use siesta_proto::v1 as pb;
use std::net::SocketAddr;
use tokio_util::sync::CancellationToken;

fn config(dir: &std::path::Path, extra: &str) -> Config {
    let text = format!(
        "[control]\nstate_dir = \"{}\"\n{extra}\n[[model]]\nname = \"ext\"\nlaunch = \"attach\"\nurl = \"http://127.0.0.1:9\"\ngpus = 0\n",
        dir.display()
    );
    Config::parse(&text, "test.toml").unwrap()
}

#[tokio::test]
async fn non_loopback_listen_needs_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let any: SocketAddr = "0.0.0.0:0".parse().unwrap();
    let opts = ServeOptions {
        listen: Some(any),
        ..Default::default()
    };
    if std::env::var_os("SIESTA_TOKEN").is_none() {
        let err = Server::bind(config(dir.path(), ""), opts.clone())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::TokenRequired(_)), "{err}");
    }
    let server = Server::bind(config(dir.path(), "token = \"s3cret\""), opts)
        .await
        .unwrap();
    assert!(server.local_addr().port() > 0);
}

#[tokio::test]
async fn bearer_token_is_required_when_configured() {
    let dir = tempfile::tempdir().unwrap();
    let opts = ServeOptions {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    let server = Server::bind(config(dir.path(), "token = \"s3cret\""), opts)
        .await
        .unwrap();
    let url = format!("http://{}", server.local_addr());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(server.run(shutdown.clone()));

    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect_lazy();
    let mut anon = pb::control_client::ControlClient::new(channel.clone());
    let err = loop {
        match anon.get_info(pb::GetInfoRequest {}).await {
            Err(e) if e.code() == tonic::Code::Unavailable => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await
            }
            other => break other.unwrap_err(),
        }
    };
    assert_eq!(err.code(), tonic::Code::Unauthenticated);

    let mut authed = pb::control_client::ControlClient::with_interceptor(
        channel.clone(),
        |mut req: tonic::Request<()>| {
            req.metadata_mut()
                .insert("authorization", "Bearer s3cret".parse().unwrap());
            Ok(req)
        },
    );
    let info = authed
        .get_info(pb::GetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
    let models = authed
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(models.models[0].launch, "attach");
    let gpus = authed
        .list_gpus(pb::ListGpusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gpus.source, "none");

    // Without the token, as a liveness probe asks: the whole server ("",
    // what a Kubernetes gRPC probe checks) and the Control service.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in ["", "siesta.v1.Control"] {
        let h = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            h.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service:?}"
        );
    }

    shutdown.cancel();
    tokio::time::timeout(std::time::Duration::from_secs(10), running)
        .await
        .expect("server stops")
        .unwrap()
        .unwrap();
}
