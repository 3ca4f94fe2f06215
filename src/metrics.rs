//! Prometheus metrics (served on `/metrics` of the operations port).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    pub kind: String,
    pub operation: String,
    /// `mutated`, `unchanged`, `denied` or `error`.
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabels {
    /// `namespace/name` for a MutationRule, `name` for a ClusterMutationRule.
    pub rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// `ready` or `invalid`.
    pub state: String,
}

fn admission_histogram() -> Histogram {
    // 50 µs .. ~3.3 s: the engine's work sits at the low end, the budget at the high end.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.000_05, 2.0, 17,
    ))
}

/// Every metric initium exports.
pub struct Metrics {
    registry: Registry,
    /// Time from the request's arrival to the response, by kind, operation and result.
    pub admission_duration: Family<AdmissionLabels, Histogram, fn() -> Histogram>,
    /// Times a rule changed an object.
    pub rule_applied: Family<RuleLabels, Counter>,
    /// Times a rule failed (skipped with `Ignore`, or denied with `Fail`).
    pub rule_errors: Family<RuleLabels, Counter>,
    /// Requests whose latency budget ran out before every rule had run.
    pub budget_overruns: Counter,
    /// Rules by state.
    pub rules: Family<StateLabels, Gauge>,
    /// 1 while this replica holds the writer Lease.
    pub leader: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("initium");
        let admission_duration =
            Family::<AdmissionLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                admission_histogram as fn() -> Histogram,
            );
        let rule_applied = Family::<RuleLabels, Counter>::default();
        let rule_errors = Family::<RuleLabels, Counter>::default();
        let budget_overruns = Counter::default();
        let rules = Family::<StateLabels, Gauge>::default();
        let leader = Gauge::default();
        registry.register(
            "admission_duration_seconds",
            "Admission request duration",
            admission_duration.clone(),
        );
        registry.register(
            "rule_applied",
            "Objects changed by a rule",
            rule_applied.clone(),
        );
        registry.register(
            "rule_errors",
            "Failures of a rule (skipped or denied)",
            rule_errors.clone(),
        );
        registry.register(
            "budget_overruns",
            "Requests whose latency budget ran out",
            budget_overruns.clone(),
        );
        registry.register("rules", "Rules by state", rules.clone());
        registry.register(
            "leader",
            "1 while this replica holds the writer Lease",
            leader.clone(),
        );
        Metrics {
            registry,
            admission_duration,
            rule_applied,
            rule_errors,
            budget_overruns,
            rules,
            leader,
        }
    }
}

impl Metrics {
    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }

    pub fn set_rule_counts(&self, ready: i64, invalid: i64) {
        self.rules
            .get_or_create(&StateLabels {
                state: "ready".into(),
            })
            .set(ready);
        self.rules
            .get_or_create(&StateLabels {
                state: "invalid".into(),
            })
            .set(invalid);
    }
}
