//! Measured transition durations: exponentially weighted moving averages.

use std::time::Duration;

/// A moving average of durations.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Average {
    pub ms: f64,
    pub samples: u32,
}

impl Average {
    /// Weight of a new sample.
    const ALPHA: f64 = 0.3;

    pub fn add(&mut self, d: Duration) {
        let v = d.as_secs_f64() * 1000.0;
        self.ms = if self.samples == 0 {
            v
        } else {
            self.ms * (1.0 - Self::ALPHA) + v * Self::ALPHA
        };
        self.samples = self.samples.saturating_add(1);
    }

    /// Rounded milliseconds, 0 when never measured.
    pub fn millis(&self) -> u64 {
        if self.samples == 0 {
            0
        } else {
            self.ms.round().max(1.0) as u64
        }
    }
}

/// Start, sleep and wake durations per level.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Calibration {
    pub start: Average,
    pub sleep: [Average; 2],
    pub wake: [Average; 2],
    /// CUDA checkpoint (suspend) and restore (resume) of the whole engine.
    pub suspend: Average,
    pub resume: Average,
}

impl Calibration {
    pub fn sleep_mut(&mut self, level: u8) -> &mut Average {
        &mut self.sleep[usize::from(level.clamp(1, 2) - 1)]
    }

    pub fn wake_mut(&mut self, level: u8) -> &mut Average {
        &mut self.wake[usize::from(level.clamp(1, 2) - 1)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn average_moves_towards_new_samples() {
        let mut a = Average::default();
        assert_eq!(a.millis(), 0);
        a.add(Duration::from_millis(1000));
        assert_eq!(a.millis(), 1000);
        a.add(Duration::from_millis(2000));
        assert_eq!(a.millis(), 1300);
        assert_eq!(a.samples, 2);
    }
}
