//! A SIGTERM, as vLLM 0.24 did it on the GPU machine (`scripts/vllm-check
//! sigterm`, docs/vllm-sigterm-output.txt; `EngineCore._handle_shutdown`):
//! the HTTP server stops accepting at once (see `server.rs`); a generation
//! request that still reaches it is answered 500 "cannot schedule new
//! futures after shutdown"; with `--shutdown-timeout 0` (the default) the
//! requests in flight and held are aborted (what they produced so far is
//! sent, `finish_reason: "abort"`), else they run on for up to that many
//! seconds, after which the engine core is killed and they fail as with a
//! dead one. `/health` answers 200 on a connection still open. A second
//! SIGTERM changes nothing.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Engine;

/// How long aborted requests get to send their last event.
const ABORT_FLUSH: Duration = Duration::from_secs(2);

/// How a shutdown's drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Nothing left running or held.
    Empty,
    /// The timeout passed with requests still running (they fail).
    TimedOut,
}

impl Engine {
    /// Starts the engine core's shutdown: new requests are refused; with
    /// `abort`, those in flight and held are aborted.
    pub fn begin_shutdown(&self, abort: bool) {
        self.gate.send_modify(|g| {
            g.closed = true;
            if abort {
                g.epoch += 1;
            }
        });
    }

    /// SIGTERM came: new requests are refused.
    pub fn shutting_down(&self) -> bool {
        self.gate.borrow().closed
    }

    /// Requests generating or waiting to be scheduled.
    pub fn busy(&self) -> bool {
        self.running.load(Ordering::SeqCst) > 0 || self.held.load(Ordering::SeqCst) > 0
    }

    /// The SIGTERM's shutdown with `--shutdown-timeout` `secs`: begins it,
    /// waits for the requests to end (aborted ones to send their end), and
    /// marks the engine core gone (requests still running fail; later ones
    /// get vLLM's engine-dead error).
    pub async fn shut_down(&self, secs: u64) -> Drained {
        self.begin_shutdown(secs == 0);
        let limit = if secs == 0 {
            ABORT_FLUSH
        } else {
            Duration::from_secs(secs)
        };
        let deadline = tokio::time::Instant::now() + limit;
        let mut drained = Drained::Empty;
        while self.busy() {
            if tokio::time::Instant::now() >= deadline {
                drained = Drained::TimedOut;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.dead.store(true, Ordering::SeqCst);
        drained
    }
}
