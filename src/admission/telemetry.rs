//! What one admission request leaves behind: one span that every log line of the request sits
//! in, and one sample in `/metrics`, written when the request ends, whichever way it ends.
//!
//! The handler opens both when the request arrives. The span is named by the webhook path until
//! the review is parsed, then by the request ([`describe`]); the [`Record`] starts out as an
//! error of unknown kind (what every request that ends before its review is read counts as) and
//! the handlers fill it in. [`Record::commit`] is the only place admission touches the metrics.

use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, Instant};

use tracing::Span;
use tracing::field::{Empty, Value};

use crate::engine::RuleId;
use crate::metrics::{AdmissionLabels, Metrics};

use super::review::AdmissionRequest;

/// The span of one request to `webhook` (a path, `/mutate`). Opened at INFO so that the
/// warnings and denials logged at the default level carry it; its other fields are filled in by
/// [`describe`] once the review is parsed.
pub(super) fn span(webhook: &'static str) -> Span {
    tracing::info_span!(
        "admission",
        webhook,
        request_uid = Empty,
        kind = Empty,
        operation = Empty,
        namespace = Empty,
        name = Empty,
    )
}

/// Names the request in the current span (the request's, inline or on the blocking pool): its
/// uid, kind, operation, namespace and name (or `generateName*`).
pub(super) fn describe(request: &AdmissionRequest) {
    let span = Span::current();
    let Some(metadata) = span.metadata() else {
        return;
    };
    let fields = metadata.fields();
    let (Some(uid), Some(kind), Some(operation), Some(namespace), Some(name)) = (
        fields.field("request_uid"),
        fields.field("kind"),
        fields.field("operation"),
        fields.field("namespace"),
        fields.field("name"),
    ) else {
        // Another span is current: nothing of ours to fill in.
        return;
    };
    let kind_value = tracing::field::display(&request.kind);
    let name_value = tracing::field::display(Name(request));
    let namespace_value = request.namespace();
    // All fields in one record: the JSON log formats a span's fields again on every record, so
    // five records would cost microseconds on a path that takes twenty. (`Span::record` itself
    // is `record_all` of a one-field `value_set`.)
    span.record_all(&fields.value_set(&[
        (&uid, Some(&request.uid.as_str() as &dyn Value)),
        (&kind, Some(&kind_value as &dyn Value)),
        (&operation, Some(&request.operation.as_str() as &dyn Value)),
        (
            &namespace,
            namespace_value.as_ref().map(|ns| ns as &dyn Value),
        ),
        (
            &name,
            Name(request).is_some().then_some(&name_value as &dyn Value),
        ),
    ]));
}

/// The request's name, or `generateName*` before the API server has picked one; written
/// straight into the log, without a `String` of its own.
struct Name<'a>(&'a AdmissionRequest);

impl Name<'_> {
    fn is_some(&self) -> bool {
        self.0.name().is_some() || self.0.generate_name().is_some()
    }
}

impl fmt::Display for Name<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.0.name(), self.0.generate_name()) {
            (Some(name), _) => f.write_str(name),
            (None, Some(prefix)) => write!(f, "{prefix}*"),
            (None, None) => Ok(()),
        }
    }
}

/// What became of a request: the `result` label of `initium_admission_duration_seconds`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Allowed with a patch.
    Mutated,
    /// Allowed as it was.
    Unchanged,
    /// Rejected by a rule (`/mutate`) or as an invalid rule (`/validate`).
    Denied,
    /// Not answered with a verdict: a limit, a body that is not a review, a failure.
    Error,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Mutated => "mutated",
            Verdict::Unchanged => "unchanged",
            Verdict::Denied => "denied",
            Verdict::Error => "error",
        }
    }
}

/// What happened to one request, for `/metrics`: filled in while it is answered, written once
/// by [`Record::commit`].
#[derive(Debug)]
pub(crate) struct Record {
    arrival: Instant,
    /// `unknown` until the review is read; then the kind if a Ready rule names it, else `other`.
    kind: Cow<'static, str>,
    operation: &'static str,
    verdict: Verdict,
    /// Rules that changed the object.
    applied: Vec<RuleId>,
    /// Rules that failed and were skipped (`failurePolicy: Ignore`).
    skipped: Vec<RuleId>,
    /// The rule that failed and rejected the object (`failurePolicy: Fail`).
    denied_by: Option<RuleId>,
    budget_exceeded: bool,
}

impl Record {
    /// A request that arrived at `arrival` and has not been read yet.
    pub(super) fn new(arrival: Instant) -> Record {
        Record {
            arrival,
            kind: Cow::Borrowed("unknown"),
            operation: "unknown",
            verdict: Verdict::Error,
            applied: Vec::new(),
            skipped: Vec::new(),
            denied_by: None,
            budget_exceeded: false,
        }
    }

    pub(super) fn arrival(&self) -> Instant {
        self.arrival
    }

    /// Time since the request arrived.
    pub(super) fn elapsed(&self) -> Duration {
        self.arrival.elapsed()
    }

    /// The review is read: its kind label (bounded by the caller) and operation.
    pub(super) fn identify(&mut self, kind: Cow<'static, str>, operation: &str) {
        self.kind = kind;
        self.operation = operation_label(operation);
    }

    pub(super) fn verdict(&mut self, verdict: Verdict) {
        self.verdict = verdict;
    }

    /// What the rules did: taken (not copied) from the engine's outcome once the answer is
    /// written.
    pub(super) fn rules_ran(
        &mut self,
        applied: Vec<RuleId>,
        skipped: Vec<RuleId>,
        budget_exceeded: bool,
    ) {
        self.applied = applied;
        self.skipped = skipped;
        self.budget_exceeded = budget_exceeded;
    }

    /// A `failurePolicy: Fail` rule could not run and rejected the object.
    pub(super) fn denied_by(&mut self, rule: RuleId, budget_exceeded: bool) {
        self.denied_by = Some(rule);
        self.budget_exceeded = budget_exceeded;
    }

    /// Writes the request to the metrics (its duration, from its arrival to now) and returns
    /// that duration. Called once per request, where the handler answers.
    pub(super) fn commit(self, metrics: &Metrics) -> Duration {
        let elapsed = self.arrival.elapsed();
        for rule in &self.applied {
            metrics.rule_applied.inc(&rule.to_string());
        }
        for rule in self.skipped.iter().chain(&self.denied_by) {
            metrics.rule_errors.inc(&rule.to_string());
        }
        if self.budget_exceeded {
            metrics.budget_overruns.inc();
        }
        metrics
            .admission_duration
            .get_or_create(&AdmissionLabels {
                kind: self.kind,
                operation: self.operation,
                result: self.verdict.label(),
            })
            .observe(elapsed.as_secs_f64());
        elapsed
    }
}

/// Metric label for an operation: one of the four Kubernetes knows, so a client cannot grow the
/// label set.
fn operation_label(operation: &str) -> &'static str {
    match operation {
        "CREATE" => "CREATE",
        "UPDATE" => "UPDATE",
        "DELETE" => "DELETE",
        "CONNECT" => "CONNECT",
        _ => "unknown",
    }
}
