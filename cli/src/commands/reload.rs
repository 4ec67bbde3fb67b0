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
    /// Restarted and updated in place.
    changed: Vec<String>,
    /// Of `changed`: on a new engine.
    restarted: Vec<String>,
    /// Of `changed`: engine kept, siesta's own settings updated.
    updated_in_place: Vec<String>,
    unchanged: Vec<String>,
    /// Settings read at start-up only: in force after a restart.
    not_applied: Vec<String>,
}

/// A reload waits for removed and changed models' engines to drain (up to
/// their `stop_grace`) and stop (up to another): longer than one RPC's
/// usual deadline.
const RELOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

pub async fn run(conn: Conn, format: Format) -> Result<(), Failure> {
    // The daemon carries a reload out whole whether or not this waits for
    // it: running out of time here is not an unreachable daemon.
    let call = conn.call_within(RELOAD_TIMEOUT + RELOAD_TIMEOUT, |mut c| async move {
        c.reload(pb::ReloadRequest {}).await
    });
    let r = tokio::time::timeout(RELOAD_TIMEOUT, call)
        .await
        .map_err(|_| Failure::Failed(no_answer(RELOAD_TIMEOUT)))??;
    match format {
        Format::Json => print_json(&ReloadView {
            added: r.added,
            removed: r.removed,
            changed: r.changed,
            restarted: r.restarted,
            updated_in_place: r.updated_in_place,
            unchanged: r.unchanged,
            not_applied: r.not_applied,
        }),
        Format::Text => {
            if r.not_applied.is_empty() {
                println!("configuration reloaded");
            } else {
                println!(
                    "configuration reloaded; not applied until restart: {}",
                    r.not_applied.join(", ")
                );
            }
            // A control plane from before `restarted` and
            // `updated_in_place` says only `changed`.
            let split = !r.restarted.is_empty() || !r.updated_in_place.is_empty();
            let none = Vec::new();
            let changed = if split { &none } else { &r.changed };
            for (what, names) in [
                ("added", &r.added),
                ("removed", &r.removed),
                ("restarted", &r.restarted),
                ("in place", &r.updated_in_place),
                ("changed", changed),
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

/// What a reload not answered in time says.
fn no_answer(waited: std::time::Duration) -> String {
    format!(
        "no answer within {}s: the reload goes on in siesta-control (its log says \
         `configuration reloaded` when it is done; `siesta status` shows the models)",
        waited.as_secs()
    )
}

#[cfg(test)]
mod tests {
    /// The message's line break in the source left 18 spaces in it.
    #[test]
    fn the_no_answer_message_reads_as_one_sentence() {
        let m = super::no_answer(std::time::Duration::from_secs(30));
        assert!(!m.contains("  "), "{m}");
        assert!(m.contains("its log says `configuration reloaded`"), "{m}");
    }
}
