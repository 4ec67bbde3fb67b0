//! The host backend: a weight pattern in ordinary memory that sleep moves or drops.

use std::sync::Mutex;

use super::{Level, Memory, MemoryError, Tags};

/// Size of the simulated weights.
pub const DEFAULT_WEIGHT_BYTES: usize = 64 * 1024;

/// KV cache bytes reported while it is resident.
const KV_BYTES: u64 = 256 * 1024;

#[derive(Debug)]
struct Inner {
    /// Resident ("device") weights, `None` while asleep.
    weights: Option<Vec<u8>>,
    /// The level-1 host copy.
    offloaded: Option<Vec<u8>>,
    kv_cache: bool,
    /// Whether the resident weights hold the pattern: kept as they change, since every
    /// request asks (comparing 64 KiB per request, under the lock, was half of fake-vllm's
    /// CPU under load and capped it at ~8,700 requests/s however many threads served).
    intact: bool,
}

/// Weights kept in process memory; see the module docs.
#[derive(Debug)]
pub struct HostMemory {
    size: usize,
    inner: Mutex<Inner>,
}

fn pattern(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i % 251) as u8).collect()
}

impl HostMemory {
    /// Resident, intact weights of `size` bytes and a resident KV cache.
    pub fn new(size: usize) -> HostMemory {
        HostMemory {
            size,
            inner: Mutex::new(Inner {
                weights: Some(pattern(size)),
                offloaded: None,
                kv_cache: true,
                intact: true,
            }),
        }
    }
}

impl Memory for HostMemory {
    fn sleep(&self, level: Level) -> Result<(), MemoryError> {
        let mut m = self.inner.lock().unwrap();
        let weights = m.weights.take();
        if level == Level::One && weights.is_some() {
            m.offloaded = weights;
        } else {
            m.intact = false;
        }
        m.kv_cache = false;
        Ok(())
    }

    fn wake(&self, tags: Tags) -> Result<(), MemoryError> {
        let mut m = self.inner.lock().unwrap();
        if tags.weights && m.weights.is_none() {
            // After level 2 there is no copy: fresh allocations hold whatever was there.
            let restored = m.offloaded.take().unwrap_or_else(|| vec![0; self.size]);
            m.intact = restored == pattern(self.size);
            m.weights = Some(restored);
        }
        if tags.kv_cache {
            m.kv_cache = true;
        }
        Ok(())
    }

    fn reload_weights(&self) -> Result<(), MemoryError> {
        let mut guard = self.inner.lock().unwrap();
        let m = &mut *guard;
        match m.weights.as_mut() {
            Some(w) => {
                *w = pattern(self.size);
                m.intact = true;
                Ok(())
            }
            None => Err(MemoryError::WeightsAsleep),
        }
    }

    fn weights_intact(&self) -> bool {
        let m = self.inner.lock().unwrap();
        m.weights.is_some() && m.intact
    }

    fn verify_all(&self) -> Result<bool, MemoryError> {
        let m = self.inner.lock().unwrap();
        Ok(m.weights.as_ref().is_some_and(|w| *w == pattern(self.size)))
    }

    fn device_bytes(&self) -> u64 {
        let m = self.inner.lock().unwrap();
        m.weights.as_ref().map_or(0, |w| w.len() as u64) + if m.kv_cache { KV_BYTES } else { 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_one_round_trip_keeps_weights() {
        let m = HostMemory::new(1000);
        m.sleep(Level::One).unwrap();
        assert_eq!(m.device_bytes(), 0);
        assert!(!m.weights_intact());
        m.wake(Tags::ALL).unwrap();
        assert!(m.weights_intact());
    }

    #[test]
    fn level_two_needs_reload() {
        let m = HostMemory::new(1000);
        m.sleep(Level::Two).unwrap();
        assert!(matches!(
            m.reload_weights(),
            Err(MemoryError::WeightsAsleep)
        ));
        m.wake(Tags {
            weights: true,
            kv_cache: false,
        })
        .unwrap();
        assert!(!m.weights_intact());
        assert!(
            !m.verify_all().unwrap(),
            "the bytes are not the pattern either"
        );
        m.reload_weights().unwrap();
        assert!(m.verify_all().unwrap());
        m.wake(Tags {
            weights: false,
            kv_cache: true,
        })
        .unwrap();
        assert!(m.weights_intact());
        assert!(m.device_bytes() > 1000);
    }
}
