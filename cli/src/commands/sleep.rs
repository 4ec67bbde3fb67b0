//! `siesta sleep MODEL [--level 1|2]`.

use siesta_proto::v1 as pb;

use super::print_operation;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;

pub async fn run(conn: Conn, name: &str, level: u32, format: Format) -> Result<(), Failure> {
    let resp = conn
        .call(|mut c| async move {
            c.sleep(pb::SleepRequest {
                name: name.to_owned(),
                level,
            })
            .await
        })
        .await?;
    print_operation(name, &resp, format)
}
