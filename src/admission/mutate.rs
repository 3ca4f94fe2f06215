//! `POST /mutate`: the pending slot of DESIGN.md §1. Every matching rule runs on the object
//! and the answer is one JSON patch; a `failurePolicy: Fail` rule that cannot run rejects it.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use serde_json::Value;

use super::state::Shared;
use initium_engine::{Denial, Gvk, Outcome, RanBefore, RuleId, Subject, Verdict as AuditVerdict};

use super::review::{self, AdmissionRequest, AdmissionResponse, OldObject};
use super::telemetry::{self, Record, Verdict};
use super::{Reply, answer};

/// What [`admit`] did.
pub(super) enum Admitted {
    Answered(Reply),
    /// The rules did not finish within the inline slice: nothing was recorded or answered;
    /// the review is to be evaluated again on the blocking pool, in `namespace`'s turn.
    OutOfSlice {
        namespace: String,
    },
}

/// [`admit`] on the blocking pool, with the whole latency budget.
pub(super) fn admit_blocking(shared: &Shared, body: &[u8], record: &mut Record) -> Reply {
    match admit(shared, body, record, None) {
        Admitted::Answered(reply) => reply,
        // Without a slice the budget is the only deadline: this is not reached.
        Admitted::OutOfSlice { .. } => Reply::Internal(
            "initium could not finish this request within its latency budget; the API server applies the webhook's failure policy".into(),
        ),
    }
}

/// Parses the review, runs the engine and writes the answer; what happened goes in `record`.
/// Pure CPU work: the caller decides whether it runs on the async runtime or on the blocking
/// pool, in the request's span either way. With `slice` (on the async runtime), rules that
/// are still running then stop, nothing is recorded, and the review goes to the blocking pool
/// ([`Admitted::OutOfSlice`]): a slow tenant rule cannot hold an async worker, and with it the
/// health endpoints and every other request, for its whole budget.
pub(super) fn admit(
    shared: &Shared,
    body: &[u8],
    record: &mut Record,
    slice: Option<std::time::Instant>,
) -> Admitted {
    Admitted::Answered(match admit_within(shared, body, record, slice) {
        Ok(reply) => reply,
        Err(namespace) => return Admitted::OutOfSlice { namespace },
    })
}

fn admit_within(
    shared: &Shared,
    body: &[u8],
    record: &mut Record,
    slice: Option<std::time::Instant>,
) -> Result<Reply, String> {
    let mut request = match review::parse(body) {
        Ok(request) => request,
        Err(message) => {
            tracing::warn!(error = %message, "rejected a malformed admission request");
            return Ok(Reply::BadRequest(message));
        }
    };
    let span = telemetry::request_span(&request);
    let _entered = span.enter();
    let index = shared.rules.load_full();
    let labels = shared.labels(&index);
    record.identify(labels.kind(&request.kind.kind), &request.operation);
    if let Some(namespace) = excluded_namespace(shared, &request) {
        tracing::debug!(
            excluded_namespace = namespace,
            "admitted without running rules: the namespace is excluded",
        );
        return Ok(pass(&request, record));
    }
    let operation = match (request.operation(), request.subresource(), &request.object) {
        (Some(operation), None, Some(_)) => operation,
        (operation, subresource, _) => {
            tracing::debug!(
                resource = %request.resource.resource,
                subresource = subresource.unwrap_or(""),
                "admitted without running rules: {}",
                match (operation, subresource) {
                    (None, _) => "not a CREATE or UPDATE",
                    (_, Some(_)) => "a subresource request",
                    _ => "the request has no object",
                },
            );
            return Ok(pass(&request, record));
        }
    };
    let object = request.object.take().unwrap_or_default();

    let gvk = Gvk::new(
        &request.kind.group,
        &request.kind.version,
        &request.kind.kind,
    );
    let namespaces = shared.namespaces.load();
    let lookups = shared.lookups.load();
    let subject = Subject {
        gvk: &gvk,
        operation,
        namespace: request.namespace(),
        name: request.name(),
        namespace_labels: request
            .namespace()
            .and_then(|ns| namespaces.get(ns))
            .map(|l| &**l),
        // One object can reach initium several times in one request (one call per webhook,
        // reinvocation): a rule runs at most once.
        ran_before: RanBefore::Listed {
            stored: request.old_object.as_ref().and_then(OldObject::mutated_by),
            stored_template: request.old_object.as_ref().and_then(OldObject::template),
        },
        lookups: Some(&lookups),
    };
    let budget = record.arrival().checked_add(shared.config.budget);
    // The slice, when it comes before the budget, is the deadline of this attempt.
    let sliced = slice.filter(|s| budget.is_none_or(|b| *s < b));
    let deadline = sliced.or(budget);
    let evaluated = index.evaluate_with(&subject, object, deadline, &shared.config.rule_limits);
    let out_of_time = match &evaluated {
        Ok(outcome) => outcome.budget_exceeded,
        Err(denial) => denial.budget_exceeded,
    };
    if sliced.is_some() && out_of_time {
        return Err(request.namespace().unwrap_or_default().to_string());
    }
    Ok(match evaluated {
        Ok(outcome) => {
            // Audit verdicts of real requests are tallied for the rules' Events and counted;
            // a dry run (`kubectl apply --dry-run=server`) only gets the warnings.
            if !outcome.audited.is_empty() && !request.is_dry_run() {
                shared
                    .audit
                    .add(&outcome.audited, &describe(&request, &outcome.object));
                record.audited(
                    outcome
                        .audited
                        .iter()
                        .filter_map(|a| match a.verdict {
                            AuditVerdict::Unchanged => None,
                            AuditVerdict::WouldChange(_) => Some((a.rule.clone(), false)),
                            AuditVerdict::WouldFail { .. } => Some((a.rule.clone(), true)),
                        })
                        .collect(),
                );
            }
            mutated(&request, outcome, record)
        }
        Err(denial) => denied(&request, denial, record),
    })
}

/// `Pod shop/web` (or `Pod shop/web-*` for a name the API server has yet to generate): the
/// object an audit example names. The name is escaped and capped (`untrusted::quote`): it is
/// seen here before the API server validates it, and it goes into an Event on a rule that may
/// be a platform team's.
fn describe(request: &AdmissionRequest, object: &Value) -> String {
    let name = request
        .name()
        .filter(|n| !n.is_empty())
        .map(|n| initium_engine::untrusted::quote(n).into_owned())
        .or_else(|| {
            object
                .pointer("/metadata/generateName")
                .and_then(Value::as_str)
                .map(|g| format!("{}*", initium_engine::untrusted::quote(g)))
        })
        .unwrap_or_else(|| "(no name)".into());
    match request.namespace().filter(|n| !n.is_empty()) {
        Some(ns) => format!("{} {ns}/{name}", request.kind.kind),
        None => format!("{} {name}", request.kind.kind),
    }
}

/// Allows the request unchanged without running rules.
fn pass(request: &AdmissionRequest, record: &mut Record) -> Reply {
    record.verdict(Verdict::Unchanged);
    answer(&AdmissionResponse::allow(&request.uid))
}

/// Allows the request with the rules' patch (if they changed anything) and their warnings.
fn mutated(request: &AdmissionRequest, mut outcome: Outcome, record: &mut Record) -> Reply {
    let reply = allow(request, &outcome, record);
    // Taken, not copied: the answer is written.
    record.rules_ran(
        std::mem::take(&mut outcome.applied),
        std::mem::take(&mut outcome.skipped),
        outcome.budget_exceeded,
    );
    reply
}

fn allow(request: &AdmissionRequest, outcome: &Outcome, record: &mut Record) -> Reply {
    let mut response = AdmissionResponse::allow(&request.uid);
    if !outcome.ops.is_empty() {
        let mut patch = Vec::new();
        if let Err(e) = outcome.write_patch(&mut patch) {
            let message = format!("cannot write the JSON patch: {e}");
            tracing::error!(error = %message, "admission failed");
            record.verdict(Verdict::Error);
            return Reply::Internal(message);
        }
        response.patch_type = Some("JSONPatch");
        response.patch = Some(STANDARD.encode(&patch));
    }
    response.warnings = if outcome.audited.is_empty() {
        review::client_warnings(&outcome.warnings)
    } else {
        let mut warnings = outcome.warnings.clone();
        warnings.extend(
            outcome
                .audited
                .iter()
                .filter(|a| !matches!(a.verdict, AuditVerdict::Unchanged))
                .map(|a| a.summary()),
        );
        review::client_warnings(&warnings)
    };
    record.verdict(if response.patch.is_some() {
        Verdict::Mutated
    } else {
        Verdict::Unchanged
    });

    if !outcome.skipped.is_empty() {
        tracing::warn!(
            skipped = %join(&outcome.skipped),
            budget_exceeded = outcome.budget_exceeded,
            warnings = ?outcome.warnings,
            "rules skipped (failurePolicy Ignore)",
        );
    }
    tracing::debug!(
        dry_run = request.is_dry_run(),
        applied = %join(&outcome.applied),
        patch_ops = outcome.ops.len(),
        duration_us = record.elapsed().as_micros() as u64,
        "admitted",
    );
    answer(&response)
}

/// Rejects the request: a `failurePolicy: Fail` rule could not run.
fn denied(request: &AdmissionRequest, denial: Denial, record: &mut Record) -> Reply {
    record.verdict(Verdict::Denied);
    tracing::info!(
        dry_run = request.is_dry_run(),
        rule = %denial.rule,
        budget_exceeded = denial.budget_exceeded,
        duration_us = record.elapsed().as_micros() as u64,
        reason = %denial.message,
        "denied",
    );
    let reply = answer(&AdmissionResponse::forbid(&request.uid, denial.message));
    record.denied_by(denial.rule, denial.budget_exceeded);
    reply
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
