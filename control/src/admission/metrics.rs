//! What admission does, for Prometheus: asks admitted and how long each
//! waited for room, models put to sleep for another, busy models asked to
//! yield and yields called off.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use std::time::Duration;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ModelLabel {
    pub model: String,
}

fn wait_histogram() -> Histogram {
    // 1 ms .. ~9 min
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

/// Counters and histograms of the admission task.
#[derive(Debug)]
pub struct AdmissionMetrics {
    registry: Registry,
    admitted: Family<ModelLabel, Counter>,
    wait: Family<ModelLabel, Histogram, fn() -> Histogram>,
    evictions: Family<ModelLabel, Counter>,
    yields: Family<ModelLabel, Counter>,
    called_off: Family<ModelLabel, Counter>,
}

impl Default for AdmissionMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("siesta_control_admission");
        let admitted = Family::<ModelLabel, Counter>::default();
        registry.register(
            "admitted",
            "Starts and wakes given room on their GPUs, by model",
            admitted.clone(),
        );
        let wait: Family<ModelLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(wait_histogram);
        registry.register_with_unit(
            "wait",
            "Time a start or wake waited for room on its GPUs before it was admitted",
            Unit::Seconds,
            wait.clone(),
        );
        let evictions = Family::<ModelLabel, Counter>::default();
        registry.register(
            "evictions",
            "Times a model was asked to sleep to make room for another, by the model put to sleep",
            evictions.clone(),
        );
        let yields = Family::<ModelLabel, Counter>::default();
        registry.register(
            "yields",
            "Times a busy model was asked to yield its GPUs (finish what is in flight, hold new \
             requests, sleep) to a model that waited yield_after, by the model asked",
            yields.clone(),
        );
        let called_off = Family::<ModelLabel, Counter>::default();
        registry.register(
            "yields_called_off",
            "Yields called off before the sleep, the model they were for having found room \
             without them (another model fell idle), by the model that yielded",
            called_off.clone(),
        );
        Self {
            registry,
            admitted,
            wait,
            evictions,
            yields,
            called_off,
        }
    }
}

impl AdmissionMetrics {
    pub(crate) fn admitted(&self, model: &str, waited: Duration) {
        let l = ModelLabel {
            model: model.to_string(),
        };
        self.admitted.get_or_create(&l).inc();
        self.wait.get_or_create(&l).observe(waited.as_secs_f64());
    }

    /// Gives `model` its series at zero, so a model never admitted or put
    /// to sleep still shows (a missing series is not a zero in queries).
    pub fn known(&self, model: &str) {
        let l = ModelLabel {
            model: model.to_string(),
        };
        let _ = self.admitted.get_or_create(&l).get();
        let _ = self.evictions.get_or_create(&l).get();
        let _ = self.yields.get_or_create(&l).get();
        let _ = self.called_off.get_or_create(&l).get();
    }

    pub(crate) fn evicted(&self, model: &str) {
        self.evictions
            .get_or_create(&ModelLabel {
                model: model.to_string(),
            })
            .inc();
    }

    pub(crate) fn yielded(&self, model: &str) {
        self.yields
            .get_or_create(&ModelLabel {
                model: model.to_string(),
            })
            .inc();
    }

    pub(crate) fn yield_called_off(&self, model: &str) {
        self.called_off
            .get_or_create(&ModelLabel {
                model: model.to_string(),
            })
            .inc();
    }

    /// The text exposition of these metrics (no `# EOF`).
    pub fn encode(&self, out: &mut String) {
        let _ = prometheus_client::encoding::text::encode_registry(out, &self.registry);
    }
}
