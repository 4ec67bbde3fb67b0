//! `siesta reload`: the control plane re-reads its configuration file.

use serde::Serialize;
use siesta_proto::v1 as pb;

use super::print_json;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;

#[derive(Debug, Serialize)]
struct ReloadView {
    added: Vec<String>,
    removed: Vec<String>,
    changed: Vec<String>,
    unchanged: Vec<String>,
}

pub async fn run(conn: Conn, format: Format) -> Result<(), Failure> {
    let r = conn
        .call(|mut c| async move { c.reload(pb::ReloadRequest {}).await })
        .await?;
    match format {
        Format::Json => print_json(&ReloadView {
            added: r.added,
            removed: r.removed,
            changed: r.changed,
            unchanged: r.unchanged,
        }),
        Format::Text => {
            println!("configuration reloaded");
            for (what, names) in [
                ("added", &r.added),
                ("removed", &r.removed),
                ("changed", &r.changed),
                ("unchanged", &r.unchanged),
            ] {
                if !names.is_empty() {
                    println!("  {what:<10} {}", names.join(", "));
                }
            }
            Ok(())
        }
    }
}
