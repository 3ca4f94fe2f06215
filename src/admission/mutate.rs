//! `POST /mutate`: the pending slot of DESIGN.md §1. Every matching rule runs on the object
//! and the answer is one JSON patch; a `failurePolicy: Fail` rule that cannot run rejects it.

use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use serde_json::Value;

use crate::engine::{Denial, Gvk, Outcome, RuleId, Subject};
use crate::state::{LabelView, Shared};

use super::review::{self, AdmissionRequest, AdmissionResponse};
use super::{Reply, answer, observe};

/// Parses the review, runs the engine and writes the answer. Pure CPU work: the caller decides
/// whether it runs on the async runtime or on the blocking pool.
pub(super) fn admit(shared: &Shared, body: &[u8], arrival: Instant) -> Reply {
    let mut request = match review::parse(body) {
        Ok(request) => request,
        Err(message) => {
            tracing::warn!(webhook = "mutate", error = %message, "rejected a malformed admission request");
            observe(shared, "unknown", "unknown", "error", arrival);
            return Reply::BadRequest(message);
        }
    };
    let index = shared.rules.load_full();
    let labels = shared.labels(&index);
    let kind = request.kind.kind.as_str();
    if let Some(namespace) = excluded_namespace(shared, &request) {
        tracing::debug!(
            uid = %request.uid,
            kind,
            operation = %request.operation,
            namespace,
            name = %request.display_name(),
            "admitted without running rules: the namespace is excluded",
        );
        return pass(shared, labels.kind(kind), &request, arrival);
    }
    let operation = match (request.operation(), request.subresource(), &request.object) {
        (Some(operation), None, Some(_)) => operation,
        (operation, subresource, _) => {
            tracing::debug!(
                uid = %request.uid,
                kind,
                operation = %request.operation,
                resource = %request.resource.resource,
                subresource = subresource.unwrap_or(""),
                namespace = request.namespace().unwrap_or(""),
                name = %request.display_name(),
                "admitted without running rules: {}",
                match (operation, subresource) {
                    (None, _) => "not a CREATE or UPDATE",
                    (_, Some(_)) => "a subresource request",
                    _ => "the request has no object",
                },
            );
            return pass(shared, labels.kind(kind), &request, arrival);
        }
    };
    // Logs name the object even when the engine keeps it (on a denial) or the API server has
    // not picked its name yet.
    let name = request.display_name();
    let object = request.object.take().unwrap_or_default();

    let gvk = Gvk::new(
        &request.kind.group,
        &request.kind.version,
        &request.kind.kind,
    );
    let namespaces = shared.namespaces.load();
    let subject = Subject {
        gvk: &gvk,
        operation,
        namespace: request.namespace(),
        name: request.name(),
        namespace_labels: request.namespace().and_then(|ns| namespaces.get(ns)),
    };
    let deadline = arrival.checked_add(shared.config.budget);
    let result = index.evaluate_with(&subject, object, deadline, &shared.config.rule_limits);

    let admitted = Admitted {
        request: &request,
        gvk: &gvk,
        name: &name,
        arrival,
        labels: &labels,
    };
    match result {
        Ok(outcome) => admitted.mutated(shared, &outcome),
        Err(denial) => admitted.denied(shared, &denial),
    }
}

/// Allows the request unchanged without running rules, and records it.
fn pass(shared: &Shared, kind: &str, request: &AdmissionRequest, arrival: Instant) -> Reply {
    observe(shared, kind, &request.operation, "unchanged", arrival);
    answer(&AdmissionResponse::allow(&request.uid))
}

/// An evaluated request, for the answer, the metrics and the log.
struct Admitted<'a> {
    request: &'a AdmissionRequest,
    gvk: &'a Gvk,
    name: &'a str,
    arrival: Instant,
    labels: &'a LabelView,
}

impl Admitted<'_> {
    fn mutated(&self, shared: &Shared, outcome: &Outcome) -> Reply {
        let request = self.request;
        let metrics = &shared.metrics;
        for rule in &outcome.applied {
            metrics.rule_applied.inc(&rule.to_string());
        }
        for rule in &outcome.skipped {
            metrics.rule_errors.inc(&rule.to_string());
        }
        if outcome.budget_exceeded {
            metrics.budget_overruns.inc();
        }
        let mut response = AdmissionResponse::allow(&request.uid);
        if !outcome.ops.is_empty() {
            let mut patch = Vec::new();
            if let Err(e) = outcome.write_patch(&mut patch) {
                let message = format!("cannot write the JSON patch: {e}");
                tracing::error!(uid = %request.uid, kind = %self.gvk, name = self.name, error = %message, "admission failed");
                self.observe(shared, "error");
                return Reply::Internal(message);
            }
            response.patch_type = Some("JSONPatch");
            response.patch = Some(STANDARD.encode(&patch));
        }
        response.warnings = review::client_warnings(&outcome.warnings);

        let elapsed = self.observe(
            shared,
            if response.patch.is_some() {
                "mutated"
            } else {
                "unchanged"
            },
        );
        if !outcome.skipped.is_empty() {
            tracing::warn!(
                uid = %request.uid,
                kind = %self.gvk,
                namespace = request.namespace().unwrap_or(""),
                name = self.name,
                skipped = %join(&outcome.skipped),
                budget_exceeded = outcome.budget_exceeded,
                warnings = ?outcome.warnings,
                "rules skipped (failurePolicy Ignore)",
            );
        }
        tracing::debug!(
            uid = %request.uid,
            kind = %self.gvk,
            operation = %request.operation,
            namespace = request.namespace().unwrap_or(""),
            name = self.name,
            dry_run = request.is_dry_run(),
            applied = %join(&outcome.applied),
            patch_ops = outcome.ops.len(),
            duration_us = elapsed.as_micros() as u64,
            "admitted",
        );
        answer(&response)
    }

    fn denied(&self, shared: &Shared, denial: &Denial) -> Reply {
        let request = self.request;
        let metrics = &shared.metrics;
        metrics.rule_errors.inc(&denial.rule.to_string());
        if denial.budget_exceeded {
            metrics.budget_overruns.inc();
        }
        let elapsed = self.observe(shared, "denied");
        tracing::info!(
            uid = %request.uid,
            kind = %self.gvk,
            operation = %request.operation,
            namespace = request.namespace().unwrap_or(""),
            name = self.name,
            dry_run = request.is_dry_run(),
            rule = %denial.rule,
            budget_exceeded = denial.budget_exceeded,
            duration_us = elapsed.as_micros() as u64,
            reason = %denial.message,
            "denied",
        );
        answer(&AdmissionResponse::forbid(
            &request.uid,
            denial.message.clone(),
        ))
    }

    fn observe(&self, shared: &Shared, result: &'static str) -> Duration {
        observe(
            shared,
            self.labels.kind(&self.gvk.kind),
            &self.request.operation,
            result,
            self.arrival,
        )
    }
}

/// The excluded namespace the request is in, by any account: the review's namespace, the
/// object's `metadata.namespace`, or the name of a Namespace object. The webhook configuration
/// keeps these out; a review sent straight to the port (or a configuration edited by hand)
/// must not get around it.
fn excluded_namespace<'a>(shared: &Shared, request: &'a AdmissionRequest) -> Option<&'a str> {
    let metadata = |field: &str| {
        request
            .object
            .as_ref()
            .and_then(|o| o.get("metadata"))
            .and_then(|m| m.get(field))
            .and_then(Value::as_str)
    };
    let is_namespace = request.kind.group.is_empty() && request.kind.kind == "Namespace";
    let mut claimed = [request.namespace(), metadata("namespace"), None, None];
    if is_namespace {
        claimed[2] = request.name();
        claimed[3] = metadata("name");
    }
    claimed
        .into_iter()
        .flatten()
        .find(|namespace| shared.is_excluded_namespace(namespace))
}

fn join(rules: &[RuleId]) -> String {
    rules
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}
