//! The P2P side of [`GpuView`]: results saved in `STATE_DIR/p2p.json` and
//! loaded at start, the probe at start (`[control] p2p_probe = "start"`) and
//! on `DiagP2p`, and what a new verdict changes in placement.

use super::{GpuView, P2pDiag};
use crate::gpu::Inventory;
use crate::gpu::p2p::persist::{self, SavedProbe};
use crate::gpu::p2p::{
    P2pMatrix, P2pResult, ProbeError, ProbeOptions, default_probe_bin, run_probe,
};
use crate::placement::{Machine, refresh_p2p};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What a probe that could not run says, for logs and `DiagP2pResponse.message`.
fn unavailable(e: &ProbeError) -> String {
    match e {
        ProbeError::Unavailable(detail) => format!("no CUDA driver: P2P not probed ({detail})"),
        other => format!("P2P not probed: {other}"),
    }
}

/// Why the probe did not run.
struct NotProbed {
    message: String,
    /// It should have (two GPUs or more) but could not.
    failed: bool,
}

impl NotProbed {
    fn failed(message: String) -> Self {
        NotProbed {
            message,
            failed: true,
        }
    }
}

/// The P2P verdicts saved in `state_dir` for the GPUs of `inventory`
/// (None: none saved, unreadable, or for other GPUs), and when probed.
pub(super) fn saved(state_dir: &Path, inventory: &Inventory) -> Option<(P2pMatrix, i64)> {
    let path = persist::path_in(state_dir);
    match persist::load(&path) {
        Ok(None) => None,
        Ok(Some(saved)) => {
            let mut gpus: Vec<_> = inventory.gpus.iter().collect();
            gpus.sort_by_key(|g| g.index);
            let uuids: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
            if let Some(why) = saved.mismatch(&uuids) {
                tracing::warn!(path = %path.display(), %why, "saved P2P results are for other GPUs; ignored");
                return None;
            }
            tracing::info!(path = %path.display(), pairs = saved.results.len(), probed_unix_ms = saved.probed_unix_ms, "loaded saved P2P results");
            Some((P2pMatrix::new(saved.results), saved.probed_unix_ms))
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read saved P2P results; ignored");
            None
        }
    }
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl GpuView {
    fn gpu_indices(&self) -> Vec<u32> {
        let st = self.state.lock().unwrap();
        st.inventory.gpus.iter().map(|g| g.index).collect()
    }

    fn gpu_uuids(&self) -> Vec<String> {
        let st = self.state.lock().unwrap();
        let mut gpus: Vec<_> = st.inventory.gpus.iter().collect();
        gpus.sort_by_key(|g| g.index);
        gpus.iter().map(|g| g.uuid.clone()).collect()
    }

    /// Loads `STATE_DIR/p2p.json` if it exists and is for these GPUs.
    pub(super) fn load_p2p(&self) {
        let inventory = self.state.lock().unwrap().inventory.clone();
        if let Some((matrix, probed_unix_ms)) = saved(&self.state_dir, &inventory) {
            let mut st = self.state.lock().unwrap();
            st.p2p = matrix;
            st.p2p_probed_unix_ms = probed_unix_ms;
        }
    }

    /// Runs the probe over every GPU; `Err` says why it did not run.
    async fn probe(&self, bytes: u64, deadline: Duration) -> Result<Vec<P2pResult>, NotProbed> {
        let gpus = self.gpu_indices();
        if gpus.len() < 2 {
            return Err(NotProbed {
                message: format!("P2P needs at least two GPUs; this box has {}", gpus.len()),
                failed: false,
            });
        }
        // One probe at a time, and a second is refused at once: waiting
        // for the first (up to its deadline, an hour at most) would add
        // to the second's, past what its caller waits for.
        let Ok(_one_at_a_time) = self.probing.try_lock() else {
            return Err(NotProbed::failed(
                "a P2P probe is already running (the start-up probe or another \
                 `siesta diag p2p`): run it again once that one has ended"
                    .into(),
            ));
        };
        let Some(bin) = default_probe_bin() else {
            return Err(NotProbed::failed(
                "P2P not probed: siesta-p2p-probe not found next to siesta-control".into(),
            ));
        };
        let mut opts = ProbeOptions::new(bin, gpus);
        opts.bytes = if bytes > 0 { bytes } else { self.probe.bytes };
        opts.deadline = if deadline.is_zero() {
            self.probe.timeout
        } else {
            deadline
        };
        run_probe(&opts)
            .await
            .map_err(|e| NotProbed::failed(unavailable(&e)))
    }

    /// Keeps and saves new results. `replace`: place every model again (at
    /// start, before any engine runs); else only re-decide P2P switches.
    pub(super) fn keep(&self, results: &[P2pResult], now_ms: i64, replace: bool) {
        let saved = SavedProbe {
            probed_unix_ms: now_ms,
            gpu_uuids: self.gpu_uuids(),
            results: results.to_vec(),
        };
        let path = persist::path_in(&self.state_dir);
        if let Err(e) = persist::save(&path, &saved) {
            tracing::warn!(error = %e, "cannot save P2P results; they hold until restart");
        }
        let mut st = self.state.lock().unwrap();
        st.p2p = P2pMatrix::new(results.iter().cloned());
        st.p2p_probed_unix_ms = now_ms;
        if replace {
            return;
        }
        let machine = Machine::from_inventory(&st.inventory, st.p2p.clone());
        let changed = refresh_p2p(&machine, &mut st.placements, &self.policy);
        if !changed.is_empty() {
            tracing::warn!(models = ?changed, "P2P verdicts changed; these models get the new NCCL switches at their next start");
        }
    }

    /// `[control] p2p_probe = "start"`: probe before any engine starts
    /// (blocking, bounded by `p2p_probe_timeout`). Never fails start-up.
    /// Skipped while compute processes hold the GPUs (engines adopted from
    /// an earlier run): the probe's buffers might not fit beside them, and
    /// a failed allocation is no verdict on the DMA path.
    pub(super) fn probe_at_start(&self) {
        if self.gpu_indices().len() < 2 {
            return;
        }
        let busy: usize = {
            let st = self.state.lock().unwrap();
            st.inventory.gpus.iter().map(|g| g.processes.len()).sum()
        };
        if busy > 0 {
            tracing::warn!(
                processes = busy,
                "GPUs in use: P2P probe at start skipped; saved results (if any) stay; run `siesta diag p2p` to probe"
            );
            return;
        }
        let (bytes, deadline) = (self.probe.bytes, self.probe.timeout);
        let result = match tokio::runtime::Handle::try_current() {
            Ok(h) => h.block_on(self.probe(bytes, deadline)),
            Err(_) => match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(self.probe(bytes, deadline)),
                Err(e) => Err(NotProbed::failed(format!(
                    "P2P not probed: no runtime: {e}"
                ))),
            },
        };
        match result {
            Ok(results) => {
                let bad = results
                    .iter()
                    .filter(|r| r.health != crate::gpu::p2p::P2pHealth::Ok)
                    .count();
                tracing::info!(
                    pairs = results.len(),
                    not_ok = bad,
                    "P2P probe at start done"
                );
                self.keep(&results, now_unix_ms(), true);
            }
            Err(NotProbed { message, .. }) => {
                tracing::warn!(%message, "P2P probe at start did not run; saved results (if any) stay")
            }
        }
    }

    /// `DiagP2p`: probe now (0 bytes or deadline: the configured ones), keep
    /// and save the results, and re-decide every model's P2P switches.
    pub async fn diag_p2p(&self, bytes: u64, timeout: Duration, now_ms: i64) -> P2pDiag {
        match self.probe(bytes, timeout).await {
            Ok(results) => {
                self.keep(&results, now_ms, false);
                P2pDiag {
                    results,
                    probed_unix_ms: now_ms,
                    message: String::new(),
                    failed: false,
                }
            }
            Err(NotProbed { message, failed }) => {
                tracing::warn!(%message, "DiagP2p: probe did not run");
                P2pDiag {
                    message,
                    failed,
                    ..Default::default()
                }
            }
        }
    }
}
