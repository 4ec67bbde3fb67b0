//! `siesta logs MODEL [-f]`: an engine's recent output, then new lines.

use serde::Serialize;
use siesta_proto::v1 as pb;
use tokio_stream::StreamExt;

use super::print_json_line;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;

#[derive(Debug, Serialize)]
struct LogLineView<'a> {
    seq: u64,
    at_unix_ms: i64,
    stream: &'a str,
    line: &'a str,
}

pub async fn run(
    conn: Conn,
    name: &str,
    follow: bool,
    tail: Option<u32>,
    format: Format,
) -> Result<(), Failure> {
    let mut lines = conn
        .call(|mut c| async move {
            c.logs(pb::LogsRequest {
                name: name.to_owned(),
                tail,
                follow,
            })
            .await
        })
        .await?;
    let mut last_seq: Option<u64> = None;
    while let Some(item) = lines.next().await {
        let l = item.map_err(|s| conn.err(s))?;
        match format {
            Format::Json => print_json_line(&LogLineView {
                seq: l.seq,
                at_unix_ms: l.at_unix_ms,
                stream: &l.stream,
                line: &l.line,
            })?,
            Format::Text => {
                if let Some(prev) = last_seq
                    && l.seq > prev + 1
                {
                    println!("[siesta] … {} lines dropped …", l.seq - prev - 1);
                }
                println!("{}", text_line(&l));
            }
        }
        last_seq = Some(l.seq);
    }
    Ok(())
}

/// The engine's own lines as they were; siesta's lines marked as such.
fn text_line(l: &pb::LogLine) -> String {
    match l.stream.as_str() {
        "siesta" => format!("[siesta] {}", l.line),
        _ => l.line.clone(),
    }
}
