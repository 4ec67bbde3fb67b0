//! `siesta start|stop|restart|suspend MODEL`.

use siesta_proto::v1 as pb;

use super::print_operation;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;

/// Which lifecycle operation.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    Start,
    Stop,
    Restart,
    Suspend,
}

pub async fn run(conn: Conn, op: Op, name: &str, format: Format) -> Result<(), Failure> {
    let req = pb::ModelRequest {
        name: name.to_owned(),
    };
    let resp = conn
        .call(|mut c| async move {
            match op {
                Op::Start => c.start(req).await,
                Op::Stop => c.stop(req).await,
                Op::Restart => c.restart(req).await,
                Op::Suspend => c.suspend(req).await,
            }
        })
        .await?;
    print_operation(name, &resp, format)
}
