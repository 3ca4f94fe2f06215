//! `POST /validate`: the validating webhook for MutationRule and ClusterMutationRule, so a bad
//! rule is rejected at `kubectl apply` time with every problem and its field path (the CRD
//! schema cannot say "this regex does not compile" or "this pointer is malformed").

use std::borrow::Cow;

use serde_json::Value;

use super::state::Shared;
use initium_engine::api::{GROUP, Operation};
use initium_engine::{DEPLOYMENT_PROGRESS_DEADLINE, RuleErrors, compile_document};

use super::review::{self, AdmissionResponse, StatusCause, StatusDetails};
use super::telemetry::{self, Record, Verdict};
use super::{Reply, answer};

/// Parses the review and compiles the rule in it; what happened goes in `record`. The answer
/// does not depend on `dryRun`: `kubectl apply --dry-run=server` shows the same errors as a
/// real apply.
pub(super) fn review_rule(_shared: &Shared, body: &[u8], record: &mut Record) -> Reply {
    let mut request = match review::parse(body) {
        Ok(request) => request,
        // The API server takes objects nested far deeper than initium reads: a 400 would
        // reach the user as "the server rejected our request for an unknown reason".
        Err(message) => {
            if let Some(deep) = review::too_deep(body) {
                return too_deep(deep, record);
            }
            tracing::warn!(error = %message, "rejected a malformed admission request");
            return Reply::BadRequest(message);
        }
    };
    let span = telemetry::request_span(&request);
    let _entered = span.enter();
    // Metric label: only the two rule kinds, whatever a client sends.
    let kind_label = match (request.kind.group.as_str(), request.kind.kind.as_str()) {
        (GROUP, "MutationRule") => "MutationRule",
        (GROUP, "ClusterMutationRule") => "ClusterMutationRule",
        _ => "other",
    };
    let is_rule = kind_label != "other";
    record.identify(Cow::Borrowed(kind_label), &request.operation);
    // Every answer but an invalid rule's is "allowed, unchanged".
    record.verdict(Verdict::Unchanged);
    let object = request.object.take();
    let object = match (request.operation(), request.subresource(), object) {
        (Some(_), None, Some(object)) if is_rule => object,
        (_, subresource, _) => {
            if !is_rule {
                // A webhook configuration that sends other kinds here is a mistake; rejecting
                // them would block the cluster, so they pass and the log says so.
                tracing::warn!(
                    "the validating webhook received an object that is not a rule; allowed"
                );
            } else {
                tracing::debug!(
                    subresource = subresource.unwrap_or(""),
                    "rule request allowed without compiling (DELETE, subresource or no object)",
                );
            }
            return answer(&AdmissionResponse::allow(&request.uid));
        }
    };

    // Ratcheting, as Kubernetes does for its own fields: a rule that was stored before it could
    // be checked (webhook not yet installed, older initium) must still take label, finalizer
    // and other metadata changes, and must be deletable.
    if request.operation() == Some(Operation::Update) {
        let unchanged = if object.pointer("/metadata/deletionTimestamp").is_some() {
            Some("the rule is being deleted")
        } else if review::old_spec(body).as_ref() == object.get("spec") {
            Some("spec unchanged")
        } else {
            None
        };
        if let Some(why) = unchanged {
            tracing::debug!("rule update allowed without compiling: {why}");
            return answer(&AdmissionResponse::allow(&request.uid));
        }
    }

    // A MutationRule written without a namespace is created in the request's namespace.
    let namespace = request.namespace().unwrap_or("default");
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .or(request.name())
        .unwrap_or("")
        .to_string();
    match compile_document(&object, namespace) {
        Ok(rule) => {
            tracing::debug!(
                rule = %rule.id.describe(),
                dry_run = request.is_dry_run(),
                "rule is valid",
            );
            let mut response = AdmissionResponse::allow(&request.uid);
            response.warnings = review::client_warnings(&advice(&rule));
            answer(&response)
        }
        Err(errors) => {
            record.verdict(Verdict::Denied);
            tracing::info!(
                dry_run = request.is_dry_run(),
                errors = errors.errors.len(),
                reason = %errors,
                "rejected an invalid rule",
            );
            answer(&invalid(&request.uid, &request.kind.kind, name, &errors))
        }
    }
}

/// The answer for a rule nested deeper than initium reads: denied (`422 Invalid`) with a
/// sentence naming the rule, the field and the limits.
fn too_deep(deep: review::TooDeep, record: &mut Record) -> Reply {
    let Some(uid) = deep.uid else {
        return Reply::BadRequest(format!(
            "not an AdmissionReview that initium can read: it nests more than {} levels deep \
             and has no request.uid",
            review::READ_DEPTH
        ));
    };
    tracing::Span::current().record("request_uid", uid.as_str());
    let kind = deep.kind.unwrap_or_else(|| "MutationRule".to_string());
    let name = deep.name.unwrap_or_default();
    let kind_label = match kind.as_str() {
        "MutationRule" => "MutationRule",
        "ClusterMutationRule" => "ClusterMutationRule",
        _ => "other",
    };
    record.identify(Cow::Borrowed(kind_label), "unknown");
    record.verdict(Verdict::Denied);
    let rule = match (kind.as_str(), deep.namespace.as_deref()) {
        ("MutationRule", Some(namespace)) => format!("{kind} {namespace}/{name}"),
        _ => format!("{kind} {name}"),
    };
    let errors = RuleErrors {
        rule,
        errors: vec![initium_engine::FieldError {
            field: deep.field,
            message: format!(
                "the rule nests {} levels deep; initium reads a rule nested at most {} levels \
                 deep, and a rule may write values at most {} levels below the object's root \
                 (the depth limit): make the value shallower",
                deep.depth,
                review::READ_DEPTH - 2,
                initium_engine::MAX_DEPTH,
            ),
        }],
    };
    tracing::info!(reason = %errors, "rejected a rule nested too deep to read");
    answer(&invalid(&uid, &kind, name, &errors))
}

/// Warnings for a valid rule that will likely surprise its author.
fn advice(rule: &initium_engine::CompiledRule) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(gate) = rule.gate()
        && gate.timeout > DEPLOYMENT_PROGRESS_DEADLINE
    {
        out.push(format!(
            "{}: spec.gate.timeout is {}s, longer than a Deployment's default progress deadline \
             ({}s): a Deployment whose Pods wait that long reports ProgressDeadlineExceeded \
             (it still rolls out once they are released); shorten the timeout or raise the \
             Deployment's progressDeadlineSeconds",
            rule.id.describe(),
            gate.timeout.as_secs(),
            DEPLOYMENT_PROGRESS_DEADLINE.as_secs(),
        ));
    }
    out
}

/// The answer when every turn to compile was taken for the whole latency budget
/// (`--max-concurrent-validations`): the rule is denied with `429` and a sentence that says to
/// retry; kubectl prints it. Reading the uid alone skips the object without building it.
pub(super) fn busy(shared: &Shared, body: &[u8], record: &mut Record) -> Reply {
    let Some(uid) = review::uid(body) else {
        return Reply::BadRequest("not an AdmissionReview with a request.uid".to_string());
    };
    tracing::Span::current().record("request_uid", uid.as_str());
    // The kind is not read: counted as `other`, an error (the rule was not checked).
    record.identify(Cow::Borrowed("other"), "unknown");
    let limit = shared.config.limits.max_concurrent_validations;
    let message = format!(
        "initium is busy checking other rules ({limit} at a time, --max-concurrent-validations); \
         the rule was not checked: retry in a moment"
    );
    tracing::warn!("{message}");
    answer(&AdmissionResponse::too_many_requests(&uid, message))
}

/// `422 Invalid` with one cause per field: kubectl prints
/// `The MutationRule "x" is invalid:` and a `* <field>: <message>` line for each; other clients
/// show `message`, which lists the same errors, each line naming the rule and the field.
fn invalid(uid: &str, kind: &str, name: String, errors: &RuleErrors) -> AdmissionResponse {
    let causes = errors
        .errors
        .iter()
        .map(|e| StatusCause {
            reason: "FieldValueInvalid",
            message: e.message.clone(),
            field: e.field.clone(),
        })
        .collect();
    AdmissionResponse::invalid(
        uid,
        errors.to_string(),
        StatusDetails {
            name,
            group: GROUP.to_string(),
            kind: kind.to_string(),
            causes,
        },
    )
}
