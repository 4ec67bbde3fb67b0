//! One ordered pair: enable peer access both ways, fill the destination with
//! a sentinel, copy a known pattern GPU→GPU, check every element.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, DriverError};
use siesta_control::gpu::p2p::{P2pHealth, P2pResult};

use crate::ffi::{self, DeviceBuffer};

/// What never appears in a pattern's place by accident.
pub const SENTINEL: u32 = 0xDEAD_BEEF;

/// A non-trivial pattern: a hash of the element index, seeded per source GPU.
pub fn pattern(seed: u32, i: u64) -> u32 {
    let mut z = i ^ (u64::from(seed).wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let v = (z ^ (z >> 31)) as u32;
    if v == SENTINEL { v ^ 1 } else { v }
}

/// One GPU's context and buffers (plain cuMemAlloc memory, see ffi).
#[derive(Debug)]
pub struct Device {
    pub index: u32,
    pub ctx: Arc<CudaContext>,
    /// Holds `pattern(index, i)`.
    pub src: DeviceBuffer,
    /// Receives copies.
    pub dst: DeviceBuffer,
}

impl Device {
    pub fn new(index: u32, elements: usize) -> Result<Self, DriverError> {
        let ctx = CudaContext::new(index as usize)?;
        let host: Vec<u32> = (0..elements as u64).map(|i| pattern(index, i)).collect();
        let mut src = DeviceBuffer::alloc(&ctx, elements)?;
        src.write(&host)?;
        let dst = DeviceBuffer::alloc(&ctx, elements)?;
        Ok(Self {
            index,
            ctx,
            src,
            dst,
        })
    }
}

fn err(r: &mut P2pResult, what: &str, e: DriverError) {
    r.health = P2pHealth::Error;
    r.detail = format!("{what}: {e:?}");
}

/// Probe `src`→`dst` `repeat` times; the verdict is the worst repetition,
/// the bandwidth the best.
pub fn probe_pair(src: &Device, dst: &mut Device, repeat: u32) -> P2pResult {
    let elements = src.src.len() as u64;
    let mut r = P2pResult::missing(src.index, dst.index, P2pHealth::Ok, "");
    r.elements = elements;
    match ffi::can_access_peer(&src.ctx, &dst.ctx) {
        Ok(true) => r.driver_says = "can-access-peer".into(),
        Ok(false) => r.driver_says = "cannot-access-peer".into(),
        Err(e) => r.driver_says = format!("error: {e:?}"),
    }
    for (a, b) in [(&src.ctx, &dst.ctx), (&dst.ctx, &src.ctx)] {
        if let Err(e) = ffi::enable_peer_access(a, b) {
            r.health = if ffi::is_unsupported(&e) {
                P2pHealth::Unsupported
            } else {
                P2pHealth::Error
            };
            r.detail = format!(
                "cuCtxEnablePeerAccess(GPU {} → GPU {}): {e:?}",
                a.ordinal(),
                b.ordinal()
            );
            return r;
        }
    }
    let sentinel = vec![SENTINEL; elements as usize];
    for _ in 0..repeat.max(1) {
        if let Err(e) = dst.dst.write(&sentinel) {
            err(&mut r, "sentinel fill", e);
            return r;
        }
        let t = Instant::now();
        if let Err(e) = dst.dst.copy_from_peer(&src.src) {
            err(&mut r, "peer copy (cuMemcpyPeer)", e);
            return r;
        }
        let secs = t.elapsed().as_secs_f64();
        let gbps = (elements * 4) as f64 / secs / 1e9;
        r.bandwidth_gbps = r.bandwidth_gbps.max((gbps * 10.0).round() / 10.0);
        let back = match dst.dst.read() {
            Ok(v) => v,
            Err(e) => {
                err(&mut r, "copy back to host", e);
                return r;
            }
        };
        let mut wrong = 0u64;
        let mut untouched = 0u64;
        let mut first = None;
        for (i, &v) in back.iter().enumerate() {
            if v != pattern(src.index, i as u64) {
                wrong += 1;
                untouched += u64::from(v == SENTINEL);
                first.get_or_insert(i);
            }
        }
        if wrong > r.corrupt_elements {
            r.health = P2pHealth::Corrupt;
            r.corrupt_elements = wrong;
            r.detail = format!(
                "{wrong} of {elements} elements wrong ({untouched} still the sentinel); first at index {}",
                first.unwrap_or(0)
            );
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_non_trivial_per_source_and_never_the_sentinel() {
        let a: Vec<u32> = (0..4096).map(|i| pattern(0, i)).collect();
        let b: Vec<u32> = (0..4096).map(|i| pattern(1, i)).collect();
        assert!(a.iter().all(|&v| v != SENTINEL));
        assert_ne!(a, b, "a copy from the wrong GPU must not pass");
        let distinct: std::collections::HashSet<u32> = a.iter().copied().collect();
        assert!(distinct.len() > 4000, "an index hash, not a constant");
        assert_eq!(pattern(3, 17), pattern(3, 17));
    }
}
