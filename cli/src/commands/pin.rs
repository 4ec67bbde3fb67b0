//! `siesta pin MODEL [--for DUR]` and `siesta unpin MODEL`.

use std::time::Duration;

use siesta_proto::v1 as pb;

use super::print_operation;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;

pub async fn pin(
    conn: Conn,
    name: &str,
    duration: Option<Duration>,
    format: Format,
) -> Result<(), Failure> {
    // The end is counted on the control plane's clock, not this host's.
    let for_ms = match duration {
        None => 0,
        Some(d) if d.is_zero() => {
            return Err(Failure::Usage("--for must be longer than zero".into()));
        }
        Some(d) => u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
    };
    let resp = conn
        .call(|mut c| async move {
            c.pin(pb::PinRequest {
                name: name.to_owned(),
                until_unix_ms: 0,
                for_ms,
            })
            .await
        })
        .await?;
    print_operation(name, &resp, format)
}

pub async fn unpin(conn: Conn, name: &str, format: Format) -> Result<(), Failure> {
    let resp = conn
        .call(|mut c| async move {
            c.unpin(pb::ModelRequest {
                name: name.to_owned(),
            })
            .await
        })
        .await?;
    print_operation(name, &resp, format)
}
