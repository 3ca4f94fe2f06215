//! What one admission request leaves behind: one span that every log line of the request sits
//! in, and one sample in `/metrics`, written when the request ends, whichever way it ends.
//!
//! The handler opens both when the request arrives. The span names the webhook path; once the
//! review is parsed, a span of the request inside it ([`request_span`]) names the object; the
//! [`Record`] starts out as an
//! error of unknown kind (what every request that ends before its review is read counts as) and
//! the handlers fill it in. [`Record::commit`] is the only place admission touches the metrics.

use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, Instant};

use tracing::Span;

use crate::metrics::{AdmissionLabels, Metrics};
use initium_engine::RuleId;

use super::review::AdmissionRequest;

/// The span of one request to `webhook` (a path, `/mutate`), opened when it arrives: what is
/// logged before its review is parsed (a body too large, too slow, not JSON) carries the path.
/// Opened at INFO so that the warnings and denials logged at the default level carry it.
pub(super) fn span(webhook: &'static str) -> Span {
    tracing::info_span!("admission", webhook)
}

/// The span of the parsed review, inside [`span`]: its uid, kind, operation, namespace and name
/// (or `generateName*`). Every line the engine's work logs is in it, inline or on the blocking
/// pool. A span of its own rather than fields recorded later into [`span`]: the JSON log
/// writes a span's fields again on every record, and all fields at creation cost one write.
pub(super) fn request_span(request: &AdmissionRequest) -> Span {
    let name = Name(request);
    let name = name.is_some().then(|| tracing::field::display(name));
    tracing::info_span!(
        "request",
        request_uid = request.uid.as_str(),
        kind = %request.kind,
        operation = request.operation.as_str(),
        namespace = request.namespace(),
        name,
    )
}

/// The request's name, or `generateName*` before the API server has picked one, escaped and
/// capped (`untrusted::quote`: the API server validates the name only after mutating
/// admission, so it may hold terminal escapes or a bidirectional override).
struct Name<'a>(&'a AdmissionRequest);

impl Name<'_> {
    fn is_some(&self) -> bool {
        self.0.name().is_some() || self.0.generate_name().is_some()
    }
}

impl fmt::Display for Name<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.0.name(), self.0.generate_name()) {
            (Some(name), _) => f.write_str(&initium_engine::untrusted::quote(name)),
            (None, Some(prefix)) => write!(f, "{}*", initium_engine::untrusted::quote(prefix)),
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
    /// `mode: Audit` rules that would have changed the object (`false`) or failed (`true`).
    audited: Vec<(RuleId, bool)>,
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
            audited: Vec::new(),
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

    /// What the `mode: Audit` rules would have done: (rule, would change, would fail).
    pub(super) fn audited(&mut self, audited: Vec<(RuleId, bool)>) {
        self.audited = audited;
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
        for (rule, failed) in &self.audited {
            if *failed {
                metrics.rule_audit_errors.inc(&rule.to_string());
            } else {
                metrics.rule_audit_changes.inc(&rule.to_string());
            }
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use axum::body::{Body, Bytes};
    use axum::http::{Request, StatusCode, header};
    use futures::StreamExt as _;
    use serde_json::{Value, json};
    use tower::ServiceExt as _;
    use tracing::dispatcher::{self, DefaultGuard, Dispatch};

    use crate::admission::state::{AdmissionConfig, Shared};
    use crate::admission::{Limits, router};
    use initium_engine::{RuleIndex, compile_document};

    const POD_REVIEW: &str = include_str!("../../tests/data/admission/pod-create.json");
    const RULE_REVIEW: &str =
        include_str!("../../tests/data/admission/mutationrule-create-valid.json");
    const INVALID_RULE_REVIEW: &str =
        include_str!("../../tests/data/admission/mutationrule-create-invalid.json");

    /// A ClusterMutationRule for `kind`: one that annotates it, or one whose only mutation
    /// fails on every object (there is nothing to remove) with `failure_policy`.
    fn rule(name: &str, kind: &str, failure_policy: Option<&str>) -> Value {
        let (policy, patch) = match failure_policy {
            Some(policy) => (policy, json!({"op": "remove", "path": "/spec/notThere"})),
            None => (
                "Ignore",
                json!({"op": "add", "path": "/metadata/annotations", "value": {"seen": "yes"}}),
            ),
        };
        json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule",
               "metadata": {"name": name},
               "spec": {"failurePolicy": policy, "match": {"kinds": [kind]},
                        "mutations": [{"patch": [patch]}]}})
    }

    fn shared_with(config: AdmissionConfig, rules: &[Value]) -> Arc<Shared> {
        let shared = Shared::new(config);
        let compiled = rules
            .iter()
            .map(|doc| compile_document(doc, "default").unwrap_or_else(|e| panic!("{e}")))
            .collect();
        shared.rules.store(Arc::new(RuleIndex::new(compiled)));
        shared
    }

    /// The Pod review of tests/data with another uid, kind, operation or namespace.
    fn review(uid: &str, kind: &str, operation: &str, namespace: &str) -> Value {
        let mut review: Value = serde_json::from_str(POD_REVIEW).expect("JSON");
        let request = &mut review["request"];
        request["uid"] = uid.into();
        request["kind"]["kind"] = kind.into();
        request["operation"] = operation.into();
        request["namespace"] = namespace.into();
        request["object"]["kind"] = kind.into();
        review
    }

    /// Above the inline limit, so evaluated on the blocking pool; padding keeps it a review.
    fn large(mut review: Value) -> Vec<u8> {
        review["padding"] = Value::String("x".repeat(100 * 1024));
        serde_json::to_vec(&review).expect("JSON")
    }

    fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
        Request::post(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.into())
            .expect("request")
    }

    async fn send(shared: &Arc<Shared>, request: Request<Body>) -> (StatusCode, String) {
        let response = router(shared.clone())
            .oneshot(request)
            .await
            .expect("infallible");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// `initium_admission_duration_seconds_count` by label set: requests answered so far.
    fn answered(shared: &Shared) -> HashMap<String, u64> {
        shared
            .metrics
            .encode()
            .lines()
            .filter_map(|line| line.strip_prefix("initium_admission_duration_seconds_count"))
            .filter_map(|rest| {
                let (labels, count) = rest.rsplit_once(' ')?;
                Some((labels.to_string(), count.parse().ok()?))
            })
            .collect()
    }

    /// Sends `request`, expects `status`, and checks that the request was counted exactly once,
    /// under `labels`.
    async fn counted_once(
        shared: &Arc<Shared>,
        request: Request<Body>,
        status: StatusCode,
        labels: &str,
    ) {
        let before = answered(shared);
        let (got, text) = send(shared, request).await;
        assert_eq!(got, status, "{labels}: {text}");
        let after = answered(shared);
        let total = |counts: &HashMap<String, u64>| counts.values().sum::<u64>();
        assert_eq!(
            total(&after) - total(&before),
            1,
            "{labels}: one request, one count: {after:?}"
        );
        let under = |counts: &HashMap<String, u64>| counts.get(labels).copied().unwrap_or(0);
        assert_eq!(
            under(&after) - under(&before),
            1,
            "{labels}: counted elsewhere: {after:?}"
        );
    }

    #[tokio::test]
    async fn every_way_a_request_ends_is_counted_exactly_once() {
        let config = AdmissionConfig {
            budget: Duration::from_millis(50),
            limits: Limits {
                body_read_timeout: Duration::from_millis(200),
                max_json_values: 10_000,
                ..Limits::default()
            },
            ..AdmissionConfig::default()
        };
        let rules = [
            rule("annotate-pods", "Pod", None),
            rule("skip-secrets", "Secret", Some("Ignore")),
            rule("deny-config-maps", "ConfigMap", Some("Fail")),
        ];
        let shared = shared_with(config, &rules);
        let ok = StatusCode::OK;
        let mutate = |review: Value| post("/mutate", serde_json::to_vec(&review).expect("JSON"));

        // Answers of the mutating webhook, inline.
        let pod = review("u1", "Pod", "CREATE", "payments");
        let series = r#"{kind="Pod",operation="CREATE",result="mutated"}"#;
        counted_once(&shared, mutate(pod.clone()), ok, series).await;
        let service = review("u2", "Service", "CREATE", "payments");
        let series = r#"{kind="other",operation="CREATE",result="unchanged"}"#;
        counted_once(&shared, mutate(service), ok, series).await;
        let secret = review("u3", "Secret", "CREATE", "payments");
        let series = r#"{kind="Secret",operation="CREATE",result="unchanged"}"#;
        counted_once(&shared, mutate(secret), ok, series).await;
        assert_eq!(shared.metrics.rule_errors.get("skip-secrets"), Some(1));
        let config_map = review("u4", "ConfigMap", "CREATE", "payments");
        let series = r#"{kind="ConfigMap",operation="CREATE",result="denied"}"#;
        counted_once(&shared, mutate(config_map), ok, series).await;
        assert_eq!(shared.metrics.rule_errors.get("deny-config-maps"), Some(1));
        let excluded = review("u5", "Pod", "CREATE", "kube-system");
        let series = r#"{kind="Pod",operation="CREATE",result="unchanged"}"#;
        counted_once(&shared, mutate(excluded), ok, series).await;
        let delete = review("u6", "Pod", "DELETE", "payments");
        let series = r#"{kind="Pod",operation="DELETE",result="unchanged"}"#;
        counted_once(&shared, mutate(delete), ok, series).await;
        assert_eq!(shared.metrics.rule_applied.get("annotate-pods"), Some(1));

        // Every way a request ends before its review is read counts as an error of unknown
        // kind.
        let unknown = r#"{kind="unknown",operation="unknown",result="error"}"#;
        let bad = StatusCode::BAD_REQUEST;
        counted_once(&shared, post("/mutate", "{}"), bad, unknown).await;
        let declared_too_large = Request::post("/mutate")
            .header(header::CONTENT_LENGTH, 9 * 1024 * 1024)
            .body(Body::empty())
            .expect("request");
        let too_large = StatusCode::PAYLOAD_TOO_LARGE;
        counted_once(&shared, declared_too_large, too_large, unknown).await;
        let stalled = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("{"))])
            .chain(futures::stream::pending());
        let timed_out = StatusCode::REQUEST_TIMEOUT;
        counted_once(
            &shared,
            post("/mutate", Body::from_stream(stalled)),
            timed_out,
            unknown,
        )
        .await;
        let broken = futures::stream::iter([Err::<Bytes, _>(std::io::Error::other("reset"))]);
        counted_once(
            &shared,
            post("/mutate", Body::from_stream(broken)),
            bad,
            unknown,
        )
        .await;
        let mut held = crate::admission::limits::Reservation::new(shared.inflight.clone());
        assert!(held.grow_to(shared.inflight.limit()));
        let busy = StatusCode::SERVICE_UNAVAILABLE;
        counted_once(&shared, post("/mutate", POD_REVIEW), busy, unknown).await;
        drop(held);

        // On the blocking pool.
        let series = r#"{kind="Pod",operation="CREATE",result="mutated"}"#;
        counted_once(&shared, post("/mutate", large(pod.clone())), ok, series).await;
        let not_a_review = large(json!({}));
        counted_once(&shared, post("/mutate", not_a_review), bad, unknown).await;
        let values = format!("[{}0]", "0,".repeat(40_000));
        counted_once(&shared, post("/mutate", values), too_large, unknown).await;
        let later = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut taken = Vec::new();
        for _ in 0..shared.config.limits.max_blocking_reviews {
            taken.push(shared.blocking_reviews.turn("held", 0, later).await);
        }
        counted_once(&shared, post("/mutate", large(pod)), busy, unknown).await;
        drop(taken);

        // The validating webhook.
        let series = r#"{kind="MutationRule",operation="CREATE",result="unchanged"}"#;
        counted_once(&shared, post("/validate", RULE_REVIEW), ok, series).await;
        let series = r#"{kind="MutationRule",operation="CREATE",result="denied"}"#;
        counted_once(&shared, post("/validate", INVALID_RULE_REVIEW), ok, series).await;
        let series = r#"{kind="other",operation="CREATE",result="unchanged"}"#;
        counted_once(&shared, post("/validate", POD_REVIEW), ok, series).await;
        counted_once(&shared, post("/validate", "[]"), bad, unknown).await;
        let turns = shared.config.limits.max_concurrent_validations as u32;
        let taken = shared.validations.clone().acquire_many_owned(turns).await;
        let series = r#"{kind="other",operation="unknown",result="error"}"#;
        counted_once(&shared, post("/validate", RULE_REVIEW), ok, series).await;
        counted_once(&shared, post("/validate", "[]"), bad, unknown).await;
        drop(taken);
    }

    /// Writes the log into a buffer the test reads.
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<u8>>>);

    impl Log {
        fn text(&self) -> String {
            let bytes = self.0.lock().map(|b| b.clone()).unwrap_or_default();
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }

    impl std::io::Write for Log {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut log) = self.0.lock() {
                log.extend_from_slice(buf);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    thread_local! {
        /// This thread's log while the test's runtime runs it.
        static LOGGING: RefCell<Option<DefaultGuard>> = const { RefCell::new(None) };
    }

    #[test]
    fn a_line_logged_on_the_blocking_pool_carries_the_request_span() {
        let log = Log::default();
        let writer = log.clone();
        let dispatch = Dispatch::new(
            tracing_subscriber::fmt()
                .with_ansi(false)
                .with_thread_names(true)
                .with_writer(move || writer.clone())
                .finish(),
        );
        // The log of this test only, on every thread of its runtime (no global subscriber: other
        // tests run in this process too).
        let on_start = dispatch.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("blocking-pool")
            .on_thread_start(move || {
                let guard = dispatcher::set_default(&on_start);
                LOGGING.with(|logging| *logging.borrow_mut() = Some(guard));
            })
            .on_thread_stop(|| LOGGING.with(|logging| drop(logging.borrow_mut().take())))
            .build()
            .expect("runtime");

        // A rule that fails on every Pod is skipped, and the warning is logged where the review
        // is evaluated: on the blocking pool, as no review is small enough to run inline.
        let shared = shared_with(
            AdmissionConfig {
                inline_body_limit: 0,
                ..AdmissionConfig::default()
            },
            &[rule("skip-pods", "Pod", Some("Ignore"))],
        );
        let uid = "5b0a5f7e-span-on-the-blocking-pool";
        let body = serde_json::to_vec(&review(uid, "Pod", "CREATE", "payments")).expect("JSON");
        // tracing caches, per callsite, whether anyone listens. With one scoped subscriber in
        // the process it asks only the thread that first hits the callsite, and other tests hit
        // the same callsites on threads that have none. A second subscriber makes it ask every
        // live one; the rebuild corrects what was cached before.
        let _second = Dispatch::new(tracing::subscriber::NoSubscriber::default());
        tracing::callsite::rebuild_interest_cache();
        let (status, text) = dispatcher::with_default(&dispatch, || {
            runtime.block_on(send(&shared, post("/mutate", body)))
        });
        assert_eq!(status, StatusCode::OK, "{text}");

        let log = log.text();
        let skipped = log
            .lines()
            .find(|line| line.contains("rules skipped"))
            .unwrap_or_else(|| panic!("no warning for the skipped rule in:\n{log}"));
        assert!(
            skipped.contains(" blocking-pool "),
            "logged on the blocking pool: {skipped}"
        );
        assert!(
            skipped.contains(&format!(r#"request_uid="{uid}""#))
                && skipped.contains("kind=v1/Pod")
                && skipped.contains(r#"webhook="/mutate""#),
            "the request's span names it: {skipped}"
        );
    }
}
