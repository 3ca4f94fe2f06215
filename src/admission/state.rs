//! What the admission server reads and the controllers write, shared across tasks.
//!
//! Readers never wait: the rule index, the namespace labels and the lookup store are swapped
//! whole (`ArcSwap`), so a request sees one consistent index from start to end.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::Semaphore;

use super::Limits;
use super::limits::InflightBytes;
use crate::metrics::Metrics;
use initium_engine::{Limits as RuleLimits, LookupStore, RuleId, RuleIndex};

/// Labels of every Namespace, by name (for `namespaceSelector`).
/// Each Namespace's labels, shared between the duty's working copy and the published one
/// (a cluster's thousands of Namespaces are not kept twice).
pub type NamespaceLabels = HashMap<String, Arc<BTreeMap<String, String>>>;

/// Settings of a running `initium serve` that the admission path needs.
#[derive(Clone, Debug)]
pub struct AdmissionConfig {
    /// Latency budget per admission request, from its arrival.
    pub budget: Duration,
    /// Requests with bodies larger than this are evaluated on the blocking pool rather
    /// than inline on the async runtime.
    pub inline_body_limit: usize,
    /// Namespaces whose objects are never mutated, whatever a review says: initium's own
    /// namespace and `--exclude-namespace`. The webhook configuration keeps them out too; this
    /// holds for reviews sent straight to the port.
    pub excluded_namespaces: Vec<String>,
    /// Limits of the webhook server (connections, timeouts, bytes, blocking work).
    pub limits: Limits,
    /// What one admission's rules may do (output bytes, forEach steps).
    pub rule_limits: RuleLimits,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            budget: Duration::from_millis(DEFAULT_BUDGET_MS),
            inline_body_limit: 64 * 1024,
            excluded_namespaces: vec!["kube-system".into()],
            limits: Limits::default(),
            rule_limits: RuleLimits::default(),
        }
    }
}

/// Default `--budget`: far above what the engine needs (tens of microseconds for a Pod and
/// ten rules) and far below the smallest webhook timeout (1 s).
pub const DEFAULT_BUDGET_MS: u64 = 200;

/// The state shared by the webhook handlers, the watches and the operations endpoints.
pub struct Shared {
    pub rules: ArcSwap<RuleIndex>,
    pub namespaces: ArcSwap<NamespaceLabels>,
    /// The objects the Ready rules look up (`spec.lookups`), kept by the `lookups` duty.
    pub lookups: ArcSwap<LookupStore>,
    /// Set once the rules (and namespaces) have been listed completely: `/readyz`.
    synced: AtomicBool,
    /// Set while the webhook server accepts connections: `/readyz`.
    webhook_serving: AtomicBool,
    pub metrics: Metrics,
    pub config: AdmissionConfig,
    /// Bytes of request bodies in flight, across all connections.
    pub(crate) inflight: Arc<InflightBytes>,
    /// Turns to compile a rule on `/validate`.
    pub(crate) validations: Arc<Semaphore>,
    /// Turns to evaluate a review on the blocking pool (large, or out of its inline slice),
    /// handed out round-robin across namespaces.
    pub(crate) blocking_reviews: Arc<super::fair::FairTurns>,
    /// Which label values the metrics may use, for the index it was built from.
    labels: ArcSwap<LabelView>,
    /// What `mode: Audit` rules would have done since the `audit` duty last reported it.
    pub audit: super::audit::AuditTally,
}

/// The label values an index allows: the exact kinds its rules name, and its rules.
#[derive(Debug, Default)]
pub(crate) struct LabelView {
    index: Weak<RuleIndex>,
    kinds: HashSet<String>,
    /// The rules, by id (cheap clones of the index's `Arc<str>`s, hashed with foldhash: built
    /// on every rule change, for ten thousand rules, so no id is formatted).
    rules: foldhash::HashSet<RuleId>,
}

impl LabelView {
    fn of(index: &Arc<RuleIndex>) -> LabelView {
        let mut kinds = HashSet::new();
        let mut rules = foldhash::HashSet::default();
        rules.reserve(index.len());
        for rule in index.rules() {
            rules.insert(rule.id.clone());
            for pattern in rule.kinds().iter().chain(rule.template_kinds()) {
                if let Some(kind) = pattern.kind.exact()
                    && !kinds.contains(kind)
                {
                    kinds.insert(kind.to_string());
                }
            }
        }
        LabelView {
            index: Arc::downgrade(index),
            kinds,
            rules,
        }
    }

    /// Whether the rule a metric series names (`namespace/name` or `name`) is in the index.
    fn has_rule(&self, series: &str) -> bool {
        let id = match series.split_once('/') {
            Some((namespace, name)) => RuleId::namespaced(namespace, name),
            None => RuleId::cluster(series),
        };
        self.rules.contains(&id)
    }

    /// Whether it was built from `index`. The view holds a `Weak` to it, so the address cannot
    /// be reused by another index while the view lives.
    fn is_for(&self, index: &Arc<RuleIndex>) -> bool {
        std::ptr::eq(self.index.as_ptr(), Arc::as_ptr(index))
    }

    /// The metric label of `kind`: itself if a Ready rule names it exactly, else `other`.
    pub(crate) fn kind(&self, kind: &str) -> Cow<'static, str> {
        if self.kinds.contains(kind) {
            Cow::Owned(kind.to_string())
        } else {
            Cow::Borrowed("other")
        }
    }
}

impl Shared {
    pub fn new(config: AdmissionConfig) -> Arc<Shared> {
        let limits = &config.limits;
        Arc::new(Shared {
            rules: ArcSwap::from_pointee(RuleIndex::default()),
            namespaces: ArcSwap::from_pointee(NamespaceLabels::new()),
            lookups: ArcSwap::from_pointee(LookupStore::default()),
            synced: AtomicBool::new(false),
            webhook_serving: AtomicBool::new(false),
            metrics: Metrics::default(),
            inflight: InflightBytes::new(limits.max_inflight_bytes),
            validations: Arc::new(Semaphore::new(limits.max_concurrent_validations)),
            blocking_reviews: super::fair::FairTurns::new(
                limits.max_blocking_reviews,
                limits.max_review_memory,
            ),
            labels: ArcSwap::from_pointee(LabelView::default()),
            audit: super::audit::AuditTally::default(),
            config,
        })
    }

    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    pub fn mark_synced(&self) {
        self.synced.store(true, Ordering::Release);
    }

    /// Whether the webhook server accepts connections now.
    pub fn is_webhook_serving(&self) -> bool {
        self.webhook_serving.load(Ordering::Acquire)
    }

    pub fn set_webhook_serving(&self, serving: bool) {
        self.webhook_serving.store(serving, Ordering::Release);
    }

    /// Whether objects in `namespace` are never mutated.
    pub fn is_excluded_namespace(&self, namespace: &str) -> bool {
        self.config
            .excluded_namespaces
            .iter()
            .any(|excluded| excluded == namespace)
    }

    /// Swaps in a new rule index, with the metric label values it allows worked out here (by
    /// the controller), not by the first request that meets the new index: a rule change
    /// costs admission nothing. The series of rules no longer in the index are dropped.
    pub fn swap_rules(&self, index: RuleIndex) {
        let index = Arc::new(index);
        let view = Arc::new(LabelView::of(&index));
        self.labels.store(view.clone());
        self.rules.store(index);
        self.prune_rule_series(&view);
    }

    /// The metric label values `index` allows: the view [`Shared::swap_rules`] built with it,
    /// or (an index stored some other way, or a request that loaded an index just before a
    /// swap) one built now.
    pub(crate) fn labels(&self, index: &Arc<RuleIndex>) -> Arc<LabelView> {
        let view = self.labels.load_full();
        if view.is_for(index) {
            return view;
        }
        let view = Arc::new(LabelView::of(index));
        // A request that loaded the index just before a swap must not roll the view back.
        if Arc::ptr_eq(&self.rules.load(), index) {
            self.labels.store(view.clone());
            self.prune_rule_series(&view);
        }
        view
    }

    /// Drops the rule series of rules that are no longer in the index. Also run before every
    /// scrape, which catches a series a request still working on an older index re-created.
    pub fn prune_metrics(&self) {
        let index = self.rules.load_full();
        let view = self.labels(&index);
        self.prune_rule_series(&view);
    }

    fn prune_rule_series(&self, view: &LabelView) {
        let keep = |rule: &str| view.has_rule(rule);
        self.metrics.rule_applied.retain(keep);
        self.metrics.rule_errors.retain(keep);
        self.metrics.rule_audit_changes.retain(keep);
        self.metrics.rule_audit_errors.retain(keep);
    }
}
