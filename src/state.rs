//! What the admission server reads and the controllers write, shared across tasks.
//!
//! Readers never wait: the rule index and the namespace labels are swapped whole
//! (`ArcSwap`), so a request sees one consistent index from start to end.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::engine::RuleIndex;
use crate::metrics::Metrics;

/// Labels of every Namespace, by name (for `namespaceSelector`).
pub type NamespaceLabels = HashMap<String, BTreeMap<String, String>>;

/// Settings of a running `initium serve` that the admission path needs.
#[derive(Clone, Debug)]
pub struct AdmissionConfig {
    /// Latency budget per admission request, from its arrival.
    pub budget: Duration,
    /// Requests with bodies larger than this are evaluated on the blocking pool rather
    /// than inline on the async runtime.
    pub inline_body_limit: usize,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            budget: Duration::from_millis(DEFAULT_BUDGET_MS),
            inline_body_limit: 64 * 1024,
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
    /// Set once the rules (and namespaces) have been listed completely: `/readyz`.
    synced: AtomicBool,
    pub metrics: Metrics,
    pub config: AdmissionConfig,
}

impl Shared {
    pub fn new(config: AdmissionConfig) -> Arc<Shared> {
        Arc::new(Shared {
            rules: ArcSwap::from_pointee(RuleIndex::default()),
            namespaces: ArcSwap::from_pointee(NamespaceLabels::new()),
            synced: AtomicBool::new(false),
            metrics: Metrics::default(),
            config,
        })
    }

    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    pub fn mark_synced(&self) {
        self.synced.store(true, Ordering::Release);
    }
}
