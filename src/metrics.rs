//! Prometheus metrics (served on `/metrics` of the operations port).
//!
//! Every label value comes from a bounded set, whatever clients send: a kind only when a Ready
//! rule names it (else `other`), a rule only while it is in the index, an operation only from
//! the four Kubernetes knows. A client cannot grow `/metrics`, nor initium's memory with it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of `initium_admission_duration_seconds`. Only the kind can be a name a rule wrote;
/// the others are fixed words, so labelling a request allocates at most the kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// A kind a Ready rule names, `other`, or `unknown` (the review could not be read).
    pub kind: Cow<'static, str>,
    /// `CREATE`, `UPDATE`, `DELETE`, `CONNECT` or `unknown`.
    pub operation: &'static str,
    /// `mutated`, `unchanged`, `denied` or `error`.
    pub result: &'static str,
}

/// A counter per rule (`rule` label: `namespace/name` for a MutationRule, `name` for a
/// ClusterMutationRule). Unlike a `Family`, series can be dropped by a predicate: the series
/// of rules that left the index are dropped, so deleted rules do not pile up.
#[derive(Clone, Debug, Default)]
pub struct RuleCounters {
    series: Arc<RwLock<HashMap<String, Counter>>>,
}

impl RuleCounters {
    /// Adds one to `rule`'s counter.
    pub fn inc(&self, rule: &str) {
        if let Some(counter) = self
            .series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(rule)
        {
            counter.inc();
            return;
        }
        self.series
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(rule.to_string())
            .or_default()
            .inc();
    }

    /// The counter of `rule`, if it has a series.
    pub fn get(&self, rule: &str) -> Option<u64> {
        self.series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(rule)
            .map(Counter::get)
    }

    /// Number of series.
    pub fn len(&self) -> usize {
        self.series
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps only the series of rules for which `keep` holds.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut series = self.series.write().unwrap_or_else(PoisonError::into_inner);
        if series.keys().any(|rule| !keep(rule)) {
            series.retain(|rule, _| keep(rule));
        }
    }
}

impl EncodeMetric for RuleCounters {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let series = self.series.read().unwrap_or_else(PoisonError::into_inner);
        let mut rules: Vec<(&String, &Counter)> = series.iter().collect();
        rules.sort_by(|a, b| a.0.cmp(b.0));
        for (rule, counter) in rules {
            counter.encode(encoder.encode_family(&[("rule", rule.as_str())])?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }

    fn is_empty(&self) -> bool {
        RuleCounters::is_empty(self)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// `ready`, `invalid` or `refused`.
    pub state: String,
}

/// Bucket bounds of `initium_admission_duration_seconds`: 25 µs to 10 s in 1-2.5-5 steps. The
/// engine's work sits at the low end (an SLO such as "p99 under 250 µs" reads straight off the
/// `le="0.00025"` bucket), the budget and webhook timeouts at the high end.
pub const ADMISSION_BUCKETS: [f64; 18] = [
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

fn admission_histogram() -> Histogram {
    Histogram::new(ADMISSION_BUCKETS)
}

/// Bucket bounds of `initium_gate_release_latency_seconds` (the last dependency became ready →
/// the release written): 1 ms to 60 s, finely.
pub const GATE_RELEASE_BUCKETS: [f64; 17] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0,
    60.0,
];

/// Bucket bounds of `initium_gate_wait_seconds` (Pod created → gate removed): 100 ms to an
/// hour.
pub const GATE_WAIT_BUCKETS: [f64; 14] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// The `on_timeout` label of `initium_gate_timeouts_total`: `Release` or `Hold`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OnTimeoutLabels {
    pub on_timeout: &'static str,
}

/// The `reason` label of `initium_gate_releases_total`: `ready`, `timeout` or `rule_gone`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReleaseLabels {
    pub reason: &'static str,
}

/// Every metric initium exports.
pub struct Metrics {
    registry: Registry,
    /// Time from the request's arrival to the response, by kind, operation and result.
    pub admission_duration: Family<AdmissionLabels, Histogram, fn() -> Histogram>,
    /// Times a rule changed an object.
    pub rule_applied: RuleCounters,
    /// Times a rule failed (skipped with `Ignore`, or denied with `Fail`).
    pub rule_errors: RuleCounters,
    /// Objects a `mode: Audit` rule would have changed.
    pub rule_audit_changes: RuleCounters,
    /// Objects on which a `mode: Audit` rule would have failed.
    pub rule_audit_errors: RuleCounters,
    /// Requests whose latency budget ran out before every rule had run.
    pub budget_overruns: Counter,
    /// Rules by state.
    pub rules: Family<StateLabels, Gauge>,
    /// 1 while this replica holds the writer Lease.
    pub leader: Gauge,
    // Controller duties and the serving certificate.
    /// Failures of a controller duty (a failed write, watch or read, or the duty itself).
    pub duty_failures: Family<DutyLabels, Counter>,
    /// Times the supervisor started a controller duty again after it failed.
    pub duty_restarts: Family<DutyLabels, Counter>,
    /// When the serving certificate expires (its notAfter), in seconds since the Unix epoch.
    pub certificate_expiry: Gauge,
    // The gate controller.
    /// Pods waiting on an initium gate now (every replica counts them).
    pub gated_pods: Gauge,
    /// Objects kept in memory for the `object` dependencies of waiting Pods.
    pub gate_objects: Gauge,
    /// Bytes (as JSON) of those objects, reduced to what their conditions read.
    pub gate_object_bytes: Gauge,
    /// Pod created → its gates removed (one observation per release write).
    pub gate_wait: Histogram,
    /// The watch event that made the last dependency ready → the release written.
    pub gate_release_latency: Histogram,
    /// Gates that timed out, by `on_timeout`.
    pub gate_timeouts: Family<OnTimeoutLabels, Counter>,
    /// Release writes that met a 409 (a stale view of the Pod).
    pub gate_write_conflicts: Counter,
    /// Gates removed, by reason.
    pub gate_releases: Family<ReleaseLabels, Counter>,
    // Lookups.
    /// Watches the lookups of Ready rules hold open (one per namespace looked up in, and one
    /// for lookups in every namespace).
    pub lookup_watches: Gauge,
    /// ConfigMaps kept in memory for the lookups of Ready rules.
    pub lookup_objects: Gauge,
    // The webhook configuration.
    /// Writes of the MutatingWebhookConfiguration, by result (`applied`, `refused`: the API
    /// server answered that it will not store it, `failed`: any other error).
    pub webhook_configuration_writes: Family<ResultLabels, Counter>,
    /// 1 while the API server refuses the MutatingWebhookConfiguration initium last wrote
    /// (the rules it was for are not Ready).
    pub webhook_configuration_refused: Gauge,
    /// Bytes of the MutatingWebhookConfiguration initium last applied (as JSON).
    pub webhook_configuration_bytes: Gauge,
    /// Writes of the `fail-rules.initium.dev/<configuration>` label on Namespaces, by result (`added`,
    /// `removed`, `failed`).
    pub namespace_label_writes: Family<ResultLabels, Counter>,
}

/// The `result` label of a write counter: one of a few fixed words.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

/// The `duty` label: the name of a controller duty (a fixed set, see `controller::duty`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DutyLabels {
    pub duty: String,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("initium");
        let admission_duration =
            Family::<AdmissionLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                admission_histogram as fn() -> Histogram,
            );
        let rule_applied = RuleCounters::default();
        let rule_errors = RuleCounters::default();
        let rule_audit_changes = RuleCounters::default();
        let rule_audit_errors = RuleCounters::default();
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
            "rule_audit_changes",
            "Objects a rule in mode Audit would have changed (nothing was changed)",
            rule_audit_changes.clone(),
        );
        registry.register(
            "rule_audit_errors",
            "Objects on which a rule in mode Audit would have failed (nothing was rejected)",
            rule_audit_errors.clone(),
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
        // Controller duties and the serving certificate.
        let duty_failures = Family::<DutyLabels, Counter>::default();
        let duty_restarts = Family::<DutyLabels, Counter>::default();
        let certificate_expiry = Gauge::default();
        registry.register(
            "duty_failures",
            "Failures of a controller duty (retried, or restarted by the supervisor)",
            duty_failures.clone(),
        );
        registry.register(
            "duty_restarts",
            "Restarts of a controller duty after it failed",
            duty_restarts.clone(),
        );
        registry.register(
            "certificate_expiry_timestamp_seconds",
            "When the serving certificate expires (notAfter), in seconds since the Unix epoch",
            certificate_expiry.clone(),
        );
        // The gate controller.
        let gated_pods = Gauge::default();
        let gate_objects = Gauge::default();
        let gate_object_bytes = Gauge::default();
        let gate_wait = Histogram::new(GATE_WAIT_BUCKETS);
        let gate_release_latency = Histogram::new(GATE_RELEASE_BUCKETS);
        let gate_timeouts = Family::<OnTimeoutLabels, Counter>::default();
        let gate_write_conflicts = Counter::default();
        let gate_releases = Family::<ReleaseLabels, Counter>::default();
        registry.register(
            "gated_pods",
            "Pods waiting on an initium scheduling gate now",
            gated_pods.clone(),
        );
        registry.register(
            "gate_dependency_objects",
            "Objects kept in memory for the object dependencies of waiting Pods",
            gate_objects.clone(),
        );
        registry.register(
            "gate_dependency_object_bytes",
            "Bytes (as JSON) of the objects kept for object dependencies, reduced to what their conditions read",
            gate_object_bytes.clone(),
        );
        registry.register(
            "gate_wait_seconds",
            "Time from a gated Pod's creation to the removal of its gates",
            gate_wait.clone(),
        );
        registry.register(
            "gate_release_latency_seconds",
            "Time from the watch event that made a gate's last dependency ready to the release written",
            gate_release_latency.clone(),
        );
        registry.register(
            "gate_timeouts",
            "Gates that timed out, by onTimeout (Release or Hold)",
            gate_timeouts.clone(),
        );
        registry.register(
            "gate_write_conflicts",
            "Release writes that met a conflict (409) and read the Pod again",
            gate_write_conflicts.clone(),
        );
        registry.register(
            "gate_releases",
            "Scheduling gates removed, by reason (ready, timeout, rule_gone)",
            gate_releases.clone(),
        );
        // Lookups.
        let lookup_watches = Gauge::default();
        let lookup_objects = Gauge::default();
        registry.register(
            "lookup_watches",
            "Watches open for the lookups of Ready rules (one per namespace looked up in, one for lookups in every namespace)",
            lookup_watches.clone(),
        );
        registry.register(
            "lookup_objects",
            "ConfigMaps kept in memory for the lookups of Ready rules",
            lookup_objects.clone(),
        );
        // The webhook configuration.
        let webhook_configuration_writes = Family::<ResultLabels, Counter>::default();
        let webhook_configuration_refused = Gauge::default();
        let webhook_configuration_bytes = Gauge::default();
        let namespace_label_writes = Family::<ResultLabels, Counter>::default();
        registry.register(
            "webhook_configuration_writes",
            "Writes of the MutatingWebhookConfiguration, by result (applied, refused, failed)",
            webhook_configuration_writes.clone(),
        );
        registry.register(
            "webhook_configuration_refused",
            "1 while the API server refuses the MutatingWebhookConfiguration initium wrote last",
            webhook_configuration_refused.clone(),
        );
        registry.register(
            "webhook_configuration_bytes",
            "Bytes (as JSON) of the MutatingWebhookConfiguration initium applied last",
            webhook_configuration_bytes.clone(),
        );
        registry.register(
            "namespace_label_writes",
            "Writes of the fail-rules.initium.dev/<configuration> label on Namespaces, by result (added, removed, failed)",
            namespace_label_writes.clone(),
        );
        Metrics {
            webhook_configuration_writes,
            webhook_configuration_refused,
            webhook_configuration_bytes,
            namespace_label_writes,
            registry,
            admission_duration,
            rule_applied,
            rule_errors,
            rule_audit_changes,
            rule_audit_errors,
            budget_overruns,
            rules,
            leader,
            duty_failures,
            duty_restarts,
            certificate_expiry,
            gated_pods,
            gate_objects,
            gate_object_bytes,
            gate_wait,
            gate_release_latency,
            gate_timeouts,
            gate_write_conflicts,
            gate_releases,
            lookup_watches,
            lookup_objects,
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

    /// The failure counter of `duty` (a handle: it counts in the registry).
    pub fn duty_failures(&self, duty: &str) -> Counter {
        self.duty_failures
            .get_or_create(&DutyLabels { duty: duty.into() })
            .clone()
    }

    /// The restart counter of `duty` (a handle: it counts in the registry).
    pub fn duty_restarts(&self, duty: &str) -> Counter {
        self.duty_restarts
            .get_or_create(&DutyLabels { duty: duty.into() })
            .clone()
    }

    /// Counts one gate removed for `reason` (`ready`, `timeout`, `rule_gone`).
    pub fn gate_released(&self, reason: &'static str) {
        self.gate_releases
            .get_or_create(&ReleaseLabels { reason })
            .inc();
    }

    /// Counts one gate timed out (`on_timeout`: `Release` or `Hold`).
    pub fn gate_timed_out(&self, on_timeout: &'static str) {
        self.gate_timeouts
            .get_or_create(&OnTimeoutLabels { on_timeout })
            .inc();
    }

    /// Rules by state: `ready` (in effect), `invalid` (not Ready for a reason of their own),
    /// `refused` (would be Ready, but the API server refused the webhook configuration that
    /// sends their objects to initium).
    pub fn set_rule_counts(&self, ready: i64, invalid: i64, refused: i64) {
        for (state, count) in [("ready", ready), ("invalid", invalid), ("refused", refused)] {
            self.rules
                .get_or_create(&StateLabels {
                    state: state.into(),
                })
                .set(count);
        }
    }
}
