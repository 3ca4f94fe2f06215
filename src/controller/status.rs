//! Rule status: the `Ready` condition and `observedGeneration` of every rule.
//!
//! | Ready | reason           | when                                                         |
//! |-------|------------------|--------------------------------------------------------------|
//! | True  | `Compiled`       | compiled, every kind served: in the index, and the stored webhook configuration sends its objects to initium |
//! | False | `InvalidRule`    | does not compile; the message lists every error by field path |
//! | False | `KindNotServed`  | a pattern in `match.kinds` matches no served kind            |
//! | False | `KindNotAllowed` | a pattern matches only kinds initium never intercepts, or a MutationRule's gate waits on a cluster-scoped object |
//! | False | `QuotaExceeded` | a MutationRule would take its namespace past `--max-rules-per-namespace` or `--max-rule-bytes-per-namespace` (Ready once the namespace has room) |
//! | False | `LookupQuotaExceeded` | a MutationRule's lookups would take its namespace over `--max-lookups-per-namespace` distinct ConfigMaps |
//! | False | `GateObjectQuotaExceeded` | a MutationRule's gate would take its namespace over `--max-gate-objects-per-namespace` distinct objects waited on |
//! | False | `WebhookConfigurationRefused` | the rule would be Ready, but the API server refused the MutatingWebhookConfiguration that sends its objects to initium; the message is the API server's (initium retries with backoff) |
//!
//! A rule that cannot become Ready until its spec changes (`InvalidRule`, `KindNotAllowed`)
//! also gets `Stalled=True` with the same reason and message: kstatus (Flux's health checks,
//! `kubectl wait`-like tools) reads `Ready=False` alone as "in progress" and would wait for
//! its timeout, but `Stalled=True` as "failed". A rule waiting for its kind to be served is
//! in progress, not stalled. initium removes `Stalled` once the rule is no longer stalled.
//!
//! Only the Lease holder writes, through the status subresource, and only when the condition
//! (type, status, reason, message, observedGeneration) or `status.observedGeneration` differs
//! from what is there; `lastTransitionTime` changes only when the status flips. Other
//! conditions on the rule are kept.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::watch;

use super::duty::{Context, Duty};
use super::rules::{RuleView, Snapshot, Verdict};
use super::vocabulary::{ControllerError, FIELD_MANAGER, Leader, READY, json_hash};
use super::webhooks::{Inputs, Refusal};
use crate::admission::state::Shared;
use crate::report::report;
use initium_engine::RuleId;
use initium_engine::api::{ClusterMutationRule, MutationRule, RuleStatus};

/// The condition kstatus reads as "failed": written beside `Ready=False` while the rule cannot
/// become Ready without a change to its spec, removed otherwise.
pub const STALLED: &str = "Stalled";
/// Longest condition message written (the rest is cut, marked with `…`).
const MESSAGE_MAX_CHARS: usize = 32 * 1024;
/// Status patches in flight at once (a thousand rules at start-up should not take minutes).
const CONCURRENT_WRITES: usize = 8;
/// First retry after writes failed; the wait doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(32);

/// The `Ready` condition for a verdict (`lastTransitionTime`: `now`).
fn ready_condition(verdict: &Verdict, generation: Option<i64>, now: &Time) -> Condition {
    let (status, reason, message) = match verdict {
        Verdict::Ready => (
            "True",
            "Compiled",
            "the rule is compiled and applied to matching objects",
        ),
        Verdict::Invalid(m) => ("False", "InvalidRule", m.as_str()),
        Verdict::KindNotServed(m) => ("False", "KindNotServed", m.as_str()),
        Verdict::KindNotAllowed(m) => ("False", "KindNotAllowed", m.as_str()),
        Verdict::QuotaExceeded(m) => ("False", "QuotaExceeded", m.as_str()),
        Verdict::LookupQuota(m) => ("False", "LookupQuotaExceeded", m.as_str()),
        Verdict::GateObjectQuota(m) => ("False", "GateObjectQuotaExceeded", m.as_str()),
        Verdict::WebhookRefused(m) => ("False", "WebhookConfigurationRefused", m.as_str()),
    };
    Condition {
        type_: READY.into(),
        status: status.into(),
        reason: reason.into(),
        message: truncate(message),
        observed_generation: generation,
        last_transition_time: now.clone(),
    }
}

/// The `Stalled` condition for a verdict that only a change to the rule can clear, with the
/// reason and message of its `Ready` condition; `None` for the others.
fn stalled_condition(verdict: &Verdict, ready: &Condition) -> Option<Condition> {
    match verdict {
        Verdict::Invalid(_) | Verdict::KindNotAllowed(_) => Some(Condition {
            type_: STALLED.into(),
            status: "True".into(),
            ..ready.clone()
        }),
        // Other rules of the namespace can give a quota back: in progress, not stalled.
        Verdict::Ready
        | Verdict::KindNotServed(_)
        | Verdict::QuotaExceeded(_)
        | Verdict::LookupQuota(_)
        | Verdict::GateObjectQuota(_)
        | Verdict::WebhookRefused(_) => None,
    }
}

/// The condition that says how a Ready rule is served when rules are compiled
/// (`--compile-rules auto`): `True` by the API server (the message names the policy), once
/// the policy is in effect; `False` by the webhook (the message is the first reason), or
/// `False` with reason `Compiling` while the policy is written but not yet in effect (the
/// webhook still serves the rule then).
pub const SERVED_BY_API_SERVER: &str = "ServedByAPIServer";

/// The generated policies in effect (written, and given time to take effect), by name: what
/// the policies duty publishes.
pub type PoliciesInEffect = BTreeSet<String>;

fn served_condition(view: &RuleView, policies: &PoliciesInEffect, now: &Time) -> Option<Condition> {
    let (status, reason, message) = match view.serving.as_ref()? {
        super::rules::Served::ApiServer(name) if !policies.contains(name) => (
            "False",
            "Compiling",
            format!(
                "the rule compiles to the MutatingAdmissionPolicy {name}, which is not in effect yet; initium's webhook serves the rule until it is"
            ),
        ),
        super::rules::Served::ApiServer(name) => (
            "True",
            "Compiled",
            format!(
                "the API server applies the rule through the MutatingAdmissionPolicy {name}; it keeps working while initium is down"
            ),
        ),
        super::rules::Served::Webhook(reason) => (
            "False",
            "WebhookOnly",
            format!("initium's webhook serves the rule: {reason}"),
        ),
    };
    Some(Condition {
        type_: SERVED_BY_API_SERVER.into(),
        status: status.into(),
        reason: reason.into(),
        message: truncate(&message),
        observed_generation: view.generation,
        last_transition_time: now.clone(),
    })
}

fn truncate(message: &str) -> String {
    match message.char_indices().nth(MESSAGE_MAX_CHARS) {
        Some((at, _)) => format!("{}…", &message[..at]),
        None => message.to_string(),
    }
}

/// Puts `wanted` in the place of the condition of its type (or at the end), keeping that
/// condition's `lastTransitionTime` when its status does not change.
fn put(conditions: &mut Vec<Condition>, mut wanted: Condition) {
    match conditions.iter_mut().find(|c| c.type_ == wanted.type_) {
        Some(slot) => {
            if slot.status == wanted.status {
                wanted.last_transition_time = slot.last_transition_time.clone();
            }
            *slot = wanted;
        }
        None => conditions.push(wanted),
    }
}

/// The status a rule should have, or `None` when what it has already says so. `now` becomes
/// `lastTransitionTime` when `Ready` flips (or appears), and when `Stalled` appears.
/// `policies`: the generated policies in effect (empty when rules are not compiled).
pub fn desired_status(
    view: &RuleView,
    policies: &PoliciesInEffect,
    now: &Time,
) -> Option<RuleStatus> {
    let current = view.status.as_deref().cloned().unwrap_or_default();
    let ready = ready_condition(&view.verdict, view.generation, now);
    let stalled = stalled_condition(&view.verdict, &ready);
    let mut conditions = current.conditions.clone();
    put(&mut conditions, ready);
    match served_condition(view, policies, now) {
        Some(served) => put(&mut conditions, served),
        None => conditions.retain(|c| c.type_ != SERVED_BY_API_SERVER),
    }
    match stalled {
        Some(stalled) => put(&mut conditions, stalled),
        None => conditions.retain(|c| c.type_ != STALLED),
    }
    if conditions == current.conditions && current.observed_generation == view.generation {
        return None;
    }
    Some(RuleStatus {
        observed_generation: view.generation,
        conditions,
    })
}

/// Writes one rule's status with a merge patch on the status subresource. The
/// `resourceVersion` makes it conditional: if the rule changed since it was seen, the API
/// server answers 409 and the next snapshot decides again.
async fn write(client: &Client, view: &RuleView, status: &RuleStatus) -> Result<(), kube::Error> {
    let patch = json!({
        "metadata": {"resourceVersion": view.resource_version},
        "status": status,
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let RuleId { namespace, name } = &view.id;
    match namespace {
        Some(ns) => {
            Api::<MutationRule>::namespaced(client.clone(), ns)
                .patch_status(name, &params, &Patch::Merge(&patch))
                .await?;
        }
        None => {
            Api::<ClusterMutationRule>::all(client.clone())
                .patch_status(name, &params, &Patch::Merge(&patch))
                .await?;
        }
    }
    Ok(())
}

/// A status written over a resourceVersion, hashed.
fn fingerprint(view: &RuleView, status: &RuleStatus) -> u64 {
    json_hash(&view.resource_version, status)
}

/// The `status` duty: while this replica holds the Lease, brings every rule's status in line
/// with its verdict, after every snapshot and on gaining the Lease; failed writes are retried
/// with backoff.
///
/// `Ready=True` means the rule is in effect: besides being in the index, the stored
/// MutatingWebhookConfiguration must send its objects to initium. So a Ready verdict is
/// written only once the `webhooks` duty has applied the webhook inputs published with it
/// (`applied` equals `needs`); until then the rule keeps the status it has, and the duty
/// looks again when `applied` changes. Verdicts that are not Ready are written at once.
pub(crate) struct Status {
    client: Client,
    snapshot: watch::Receiver<Arc<Snapshot>>,
    needs: watch::Receiver<Arc<Inputs>>,
    effect: Effect,
    leader: Leader,
    shared: Arc<Shared>,
}

/// What the `webhooks` duty publishes: the inputs the stored configuration reflects, and the
/// configuration the API server refused.
pub(crate) struct Effect {
    pub applied: watch::Receiver<Option<Arc<Inputs>>>,
    pub refused: watch::Receiver<Option<Arc<Refusal>>>,
    /// The generated policies in effect (the policies duty).
    pub policies: watch::Receiver<Arc<PoliciesInEffect>>,
}

impl Status {
    pub(crate) fn new(
        client: Client,
        snapshot: watch::Receiver<Arc<Snapshot>>,
        needs: watch::Receiver<Arc<Inputs>>,
        effect: Effect,
        leader: Leader,
        shared: Arc<Shared>,
    ) -> Status {
        Status {
            client,
            snapshot,
            needs,
            effect,
            leader,
            shared,
        }
    }
}

/// Whether the status the rule has says Ready for its current generation.
fn shows_ready(view: &RuleView) -> bool {
    view.status.as_deref().is_some_and(|status| {
        status.conditions.iter().any(|c| {
            c.type_ == READY && c.status == "True" && c.observed_generation == view.generation
        })
    })
}

/// The verdict to write for a rule while the API server refuses the configuration its
/// objects need: a Ready verdict of a rule not already Ready (new, or changed) becomes
/// `WebhookRefused` with the API server's message; rules already Ready stay in effect under
/// the configuration stored before.
fn refused_view(view: &Arc<RuleView>, refusal: &Refusal) -> Option<RuleView> {
    if !view.verdict.is_ready() || shows_ready(view) {
        return None;
    }
    let mut refused = RuleView::clone(view);
    refused.verdict = Verdict::WebhookRefused(format!(
        "the API server refused the MutatingWebhookConfiguration {} that sends this rule's objects to initium: {} (initium retries; see its log and initium_webhook_configuration_refused)",
        refusal.configuration, refusal.message
    ));
    Some(refused)
}

/// Whether the webhook configuration `applied` (what the `webhooks` duty last stored) covers
/// what `needs` (the inputs published with the current index) asks for: only then are the
/// index's Ready rules in effect.
fn webhooks_in_effect(needs: &Arc<Inputs>, applied: Option<&Arc<Inputs>>) -> bool {
    applied.is_some_and(|applied| Arc::ptr_eq(applied, needs) || **applied == **needs)
}

/// Whether two refusals are the same one.
fn same_refusal(a: Option<&Arc<Refusal>>, b: Option<&Arc<Refusal>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

/// Positions in `current` (sorted by id, as `previous`) of the rules that are new or whose
/// view is not the one `previous` held: the rule table shares unchanged views between
/// snapshots.
fn changed_since(previous: &Snapshot, current: &Snapshot) -> Vec<usize> {
    let mut changed = Vec::new();
    let mut old = previous.rules.iter().peekable();
    for (i, view) in current.rules.iter().enumerate() {
        while old.next_if(|o| o.id < view.id).is_some() {}
        match old.peek() {
            Some(o) if o.id == view.id && Arc::ptr_eq(o, view) => {}
            _ => changed.push(i),
        }
    }
    changed
}

/// Whether a rule's status may be written now: a Ready verdict waits until its objects are
/// sent to initium (`in_effect`), any other verdict does not wait.
fn may_write(view: &RuleView, in_effect: bool) -> bool {
    in_effect || !view.verdict.is_ready()
}

/// What a pass of the status duty looked at: the snapshot, whether the webhook configuration
/// was in effect, the refusal, the policies in effect.
type Pass = (
    Arc<Snapshot>,
    bool,
    Option<Arc<Refusal>>,
    Arc<PoliciesInEffect>,
);

impl Duty for Status {
    const NAME: &'static str = "status";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let Status {
            client,
            snapshot,
            needs,
            effect:
                Effect {
                    applied,
                    refused,
                    policies,
                },
            leader,
            shared,
        } = self;
        // What was written last per rule, with the resourceVersion it was written over (a
        // hash of both: ten thousand rules' statuses are not kept twice): until the watch
        // brings the new version, the same status is not written again.
        let mut written: HashMap<RuleId, u64> = HashMap::new();
        // A restarted duty looks at once: the snapshot it missed will not be sent again.
        let mut retry: Option<Duration> = Some(Duration::ZERO);
        // What the last pass looked at: while nothing but some rules changed, the next pass
        // looks only at those (a rule patched ten times a second among ten thousand costs
        // ten rules' work, not a hundred thousand).
        let mut last: Option<Pass> = None;
        let mut backoff = context.backoff(RETRY_FIRST, RETRY_MAX);
        loop {
            let retry_due = async {
                match retry {
                    Some(after) => tokio::time::sleep(after).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = context.stop.wait() => return Ok(()),
                changed = snapshot.changed() => if changed.is_err() { return Ok(()) },
                Ok(()) = applied.changed() => {}
                Ok(()) = refused.changed() => {}
                Ok(()) = policies.changed() => {}
                () = leader.changed() => {}
                () = retry_due => { last = None; }
            }
            retry = None;
            let current = snapshot.borrow_and_update().clone();
            // Read after the snapshot: the rules duty publishes the inputs first, so these are
            // at least as new as the snapshot's verdicts.
            let needs_now = needs.borrow().clone();
            let policies_now = policies.borrow_and_update().clone();
            let in_effect = webhooks_in_effect(&needs_now, applied.borrow_and_update().as_ref());
            // A refusal counts only for the inputs it was for: newer rules get a new try.
            let refusal = refused.borrow_and_update().clone().filter(|r| {
                leader.is_leader() && !in_effect && webhooks_in_effect(&needs_now, Some(&r.inputs))
            });
            let refused_views: HashMap<RuleId, RuleView> = refusal
                .as_deref()
                .map(|refusal| {
                    current
                        .rules
                        .iter()
                        .filter_map(|view| refused_view(view, refusal))
                        .map(|view| (view.id.clone(), view))
                        .collect()
                })
                .unwrap_or_default();
            let ready = current
                .rules
                .iter()
                .filter(|v| v.verdict.is_ready())
                .count();
            shared.metrics.set_rule_counts(
                (ready - refused_views.len()) as i64,
                (current.rules.len() - ready) as i64,
                refused_views.len() as i64,
            );
            if !leader.is_leader() {
                written.clear();
                last = None;
                continue;
            }
            // Every rule after a retry, a change of what is in effect, or a new Lease;
            // otherwise only the rules whose view changed since the last pass.
            let only: Option<Vec<usize>> = match &last {
                Some((previous, was_in_effect, was_refused, was_policies))
                    if *was_in_effect == in_effect
                        && same_refusal(was_refused.as_ref(), refusal.as_ref())
                        && Arc::ptr_eq(was_policies, &policies_now) =>
                {
                    Some(changed_since(previous, &current))
                }
                _ => None,
            };
            last = Some((
                current.clone(),
                in_effect,
                refusal.clone(),
                policies_now.clone(),
            ));
            // The snapshot is sorted by id.
            if only.is_none() {
                written.retain(|id, _| current.rules.binary_search_by(|r| r.id.cmp(id)).is_ok());
            }
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            // Statuses are worked out as the writes go, CONCURRENT_WRITES at a time: at start-up
            // every rule needs one, and ten thousand of them at once cost ten megabytes.
            // Items are indices into the snapshot, not references: the futures must be 'static
            // enough for the spawned task.
            let already = &written;
            let rules = current.clone();
            let refused_views = &refused_views;
            let positions: Box<dyn Iterator<Item = usize> + Send> = match only {
                Some(positions) => Box::new(positions.into_iter()),
                None => Box::new(0..current.rules.len()),
            };
            let work = positions.filter_map(move |i| {
                let view = &rules.rules[i];
                let view = refused_views.get(&view.id).unwrap_or(&**view);
                if !may_write(view, in_effect) {
                    return None;
                }
                let status = desired_status(view, &policies_now, &now)?;
                let fingerprint = fingerprint(view, &status);
                (already.get(&view.id) != Some(&fingerprint)).then_some((i, status, fingerprint))
            });
            // Each result is handled as it comes, not collected: at start-up ten thousand of
            // them (a `kube::Error` is large) would be held at once.
            let mut results = futures::stream::iter(work)
                .map(|(i, status, fingerprint)| {
                    let client = client.clone();
                    let rules = current.clone();
                    async move {
                        let result = write(&client, &rules.rules[i], &status).await;
                        (i, fingerprint, result)
                    }
                })
                .buffer_unordered(CONCURRENT_WRITES);
            let mut attempted = 0usize;
            let mut failed = 0usize;
            // Positions and fingerprints (16 bytes each), recorded in `written` once the work
            // list, which reads it, is done.
            let mut done: Vec<(usize, u64)> = Vec::new();
            while let Some((i, fingerprint, result)) = results.next().await {
                attempted += 1;
                let view = &current.rules[i];
                match result {
                    Ok(()) => {
                        tracing::debug!(rule = %view.id.describe(), ready = view.verdict.is_ready(), "status written");
                        done.push((i, fingerprint));
                    }
                    // Changed or deleted since seen: the watch brings the news, then we decide again.
                    Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => {
                        retry = Some(Duration::from_secs(1));
                    }
                    Err(e) => {
                        failed += 1;
                        tracing::warn!(rule = %view.id.describe(), error = %report(&e), "writing the rule status failed");
                    }
                }
            }
            drop(results);
            for (i, fingerprint) in done {
                written.insert(current.rules[i].id.clone(), fingerprint);
            }
            if failed > 0 {
                retry = Some(backoff.failed(
                    "writing rule statuses failed; retrying",
                    &format_args!("{failed} of {attempted} writes failed"),
                ));
            } else {
                backoff.succeeded();
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    /// [`super::desired_status`] with no policies in effect (rules not compiled).
    fn desired_status(view: &RuleView, now: &Time) -> Option<RuleStatus> {
        super::desired_status(view, &PoliciesInEffect::new(), now)
    }

    fn time(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap())
    }

    fn view(verdict: Verdict, generation: i64, status: Option<RuleStatus>) -> RuleView {
        RuleView {
            id: RuleId::cluster("r"),
            uid: None,
            generation: Some(generation),
            resource_version: Some("1".into()),
            status: status.map(Arc::new),
            verdict,
            serving: None,
        }
    }

    #[test]
    fn served_by_the_api_server_only_once_the_policy_is_in_effect() {
        let mut compiled = view(Verdict::Ready, 1, None);
        compiled.serving = Some(crate::controller::rules::Served::ApiServer(
            "initium.cmr.r".into(),
        ));
        let served = |policies: &[&str], view: &RuleView| {
            let policies: PoliciesInEffect = policies.iter().map(|p| p.to_string()).collect();
            let status = super::desired_status(view, &policies, &time(100)).unwrap();
            let c = status
                .conditions
                .into_iter()
                .find(|c| c.type_ == SERVED_BY_API_SERVER)
                .unwrap();
            (c.status, c.reason)
        };
        assert_eq!(
            served(&[], &compiled),
            ("False".to_string(), "Compiling".to_string())
        );
        assert_eq!(
            served(&["initium.cmr.other"], &compiled),
            ("False".to_string(), "Compiling".to_string())
        );
        assert_eq!(
            served(&["initium.cmr.r"], &compiled),
            ("True".to_string(), "Compiled".to_string())
        );
        let mut webhook = view(Verdict::Ready, 1, None);
        webhook.serving = Some(crate::controller::rules::Served::Webhook(
            "spec.mutations[0].rewrite: no CEL equivalent".into(),
        ));
        assert_eq!(
            served(&["initium.cmr.r"], &webhook),
            ("False".to_string(), "WebhookOnly".to_string())
        );
    }

    fn named(name: &str) -> Arc<RuleView> {
        let mut v = view(Verdict::Ready, 1, None);
        v.id = RuleId::cluster(name);
        Arc::new(v)
    }

    #[test]
    fn only_new_and_changed_views_are_looked_at_again() {
        let (a, b, c) = (named("a"), named("b"), named("c"));
        let previous = Snapshot {
            rules: vec![a.clone(), b.clone(), c.clone()],
        };
        // b changed (a new view), c deleted, d new; a shared.
        let current = Snapshot {
            rules: vec![a, named("b"), named("d")],
        };
        assert_eq!(changed_since(&previous, &current), [1, 2]);
        assert_eq!(changed_since(&current, &current), Vec::<usize>::new());
        assert_eq!(
            changed_since(&Snapshot::default(), &current),
            [0, 1, 2],
            "everything is new"
        );
    }

    #[test]
    fn a_refusal_marks_only_rules_not_already_ready() {
        let refusal = Refusal {
            inputs: Arc::new(Inputs::default()),
            message: "denied by policy".into(),
            configuration: "initium".into(),
        };
        let now = time(1);
        let pending = Arc::new(view(Verdict::Ready, 2, None));
        let refused = refused_view(&pending, &refusal).expect("a new rule is refused");
        let status = desired_status(&refused, &now).unwrap();
        let ready = &status.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "WebhookConfigurationRefused")
        );
        assert!(ready.message.contains("denied by policy") && ready.message.contains("initium"));
        // Already Ready at this generation: stays Ready under the stored configuration.
        let in_effect = view(Verdict::Ready, 2, None);
        let ready_status = desired_status(&in_effect, &now).unwrap();
        let already = Arc::new(view(Verdict::Ready, 2, Some(ready_status)));
        assert_eq!(refused_view(&already, &refusal), None);
        // Not Ready for a reason of its own: that reason stays.
        let invalid = Arc::new(view(Verdict::Invalid("bad".into()), 2, None));
        assert_eq!(refused_view(&invalid, &refusal), None);
    }

    #[test]
    fn a_ready_verdict_waits_for_the_webhook_configuration_and_others_do_not() {
        let needs = Arc::new(Inputs {
            rules: Vec::new(),
            served: Some(Arc::new(crate::controller::discovery::tests::served())),
            ..Inputs::default()
        });
        // Nothing applied yet (or not the leader): not in effect.
        assert!(!webhooks_in_effect(&needs, None));
        // What was applied before discovery was read: not what the index needs.
        let older = Arc::new(Inputs::default());
        assert!(!webhooks_in_effect(&needs, Some(&older)));
        // The same inputs, or equal ones published anew: in effect.
        assert!(webhooks_in_effect(&needs, Some(&needs)));
        let equal = Arc::new((*needs).clone());
        assert!(webhooks_in_effect(&needs, Some(&equal)));

        let ready = view(Verdict::Ready, 1, None);
        assert!(!may_write(&ready, false), "Ready waits");
        assert!(may_write(&ready, true));
        for verdict in [
            Verdict::Invalid("spec.x: bad".into()),
            Verdict::KindNotServed("spec.y".into()),
            Verdict::KindNotAllowed("spec.z".into()),
        ] {
            assert!(
                may_write(&view(verdict, 1, None), false),
                "not Ready: at once"
            );
        }
    }

    #[test]
    fn a_new_rule_gets_ready_with_its_generation() {
        let status = desired_status(&view(Verdict::Ready, 3, None), &time(100)).unwrap();
        assert_eq!(status.observed_generation, Some(3));
        let [ready] = status.conditions.as_slice() else {
            panic!("one condition expected: {status:?}");
        };
        assert_eq!(
            (
                ready.type_.as_str(),
                ready.status.as_str(),
                ready.reason.as_str()
            ),
            ("Ready", "True", "Compiled")
        );
        assert_eq!(ready.observed_generation, Some(3));
        assert_eq!(ready.last_transition_time, time(100));
    }

    #[test]
    fn an_unchanged_status_is_not_written_again() {
        let first = desired_status(&view(Verdict::Ready, 3, None), &time(100));
        assert_eq!(
            desired_status(&view(Verdict::Ready, 3, first), &time(200)),
            None
        );
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let ready = desired_status(&view(Verdict::Ready, 1, None), &time(100));
        // New generation, still Ready: rewritten, same transition time.
        let again = desired_status(&view(Verdict::Ready, 2, ready.clone()), &time(200)).unwrap();
        assert_eq!(again.conditions[0].last_transition_time, time(100));
        assert_eq!(again.observed_generation, Some(2));
        // Broken: flips to False now.
        let broken = desired_status(
            &view(Verdict::Invalid("spec.x: bad".into()), 2, ready),
            &time(300),
        )
        .unwrap();
        let condition = &broken.conditions[0];
        assert_eq!(
            (
                condition.status.as_str(),
                condition.reason.as_str(),
                condition.message.as_str()
            ),
            ("False", "InvalidRule", "spec.x: bad")
        );
        assert_eq!(condition.last_transition_time, time(300));
        // Another error message, still False: rewritten, same transition time.
        let other = desired_status(
            &view(
                Verdict::KindNotServed("spec.y: gone".into()),
                2,
                Some(broken),
            ),
            &time(400),
        )
        .unwrap();
        assert_eq!(other.conditions[0].reason, "KindNotServed");
        assert_eq!(other.conditions[0].last_transition_time, time(300));
    }

    #[test]
    fn other_conditions_are_kept() {
        let mut status = desired_status(&view(Verdict::Ready, 1, None), &time(100)).unwrap();
        status.conditions.insert(
            0,
            Condition {
                type_: "Gated".into(),
                status: "True".into(),
                reason: "Waiting".into(),
                message: String::new(),
                observed_generation: Some(1),
                last_transition_time: time(50),
            },
        );
        let next = desired_status(&view(Verdict::Ready, 2, Some(status)), &time(200)).unwrap();
        let types: Vec<&str> = next.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Gated", "Ready"]);
    }

    #[test]
    fn a_missing_status_generation_is_filled_in() {
        let mut status = desired_status(&view(Verdict::Ready, 1, None), &time(100)).unwrap();
        status.observed_generation = None;
        assert!(desired_status(&view(Verdict::Ready, 1, Some(status)), &time(200)).is_some());
    }

    /// (type, status, reason, message) of every condition.
    fn summary(status: &RuleStatus) -> Vec<(&str, &str, &str, &str)> {
        status
            .conditions
            .iter()
            .map(|c| {
                (
                    c.type_.as_str(),
                    c.status.as_str(),
                    c.reason.as_str(),
                    c.message.as_str(),
                )
            })
            .collect()
    }

    #[test]
    fn a_rule_that_needs_a_change_is_stalled_with_the_reason_and_message_of_ready() {
        for (verdict, reason) in [
            (Verdict::Invalid("spec.x: bad".into()), "InvalidRule"),
            (
                Verdict::KindNotAllowed("spec.x: bad".into()),
                "KindNotAllowed",
            ),
        ] {
            let status = desired_status(&view(verdict, 2, None), &time(100)).unwrap();
            assert_eq!(
                summary(&status),
                [
                    ("Ready", "False", reason, "spec.x: bad"),
                    ("Stalled", "True", reason, "spec.x: bad"),
                ]
            );
            assert_eq!(status.conditions[1].observed_generation, Some(2));
            assert_eq!(status.conditions[1].last_transition_time, time(100));
        }
    }

    #[test]
    fn a_rule_waiting_for_its_kind_is_not_stalled() {
        let status = desired_status(
            &view(Verdict::KindNotServed("spec.y: not served".into()), 1, None),
            &time(100),
        )
        .unwrap();
        assert_eq!(
            summary(&status),
            [("Ready", "False", "KindNotServed", "spec.y: not served")]
        );
    }

    #[test]
    fn a_rule_over_the_lookup_quota_is_not_ready_and_not_stalled() {
        // Other rules of the namespace can give the quota back: no change to this rule needed.
        let status = desired_status(
            &view(Verdict::LookupQuota("spec.lookups: over".into()), 1, None),
            &time(100),
        )
        .unwrap();
        assert_eq!(
            summary(&status),
            [(
                "Ready",
                "False",
                "LookupQuotaExceeded",
                "spec.lookups: over"
            )]
        );
    }

    #[test]
    fn stalled_goes_when_the_rule_is_fixed_and_stays_put_while_it_is_not() {
        let broken = desired_status(
            &view(Verdict::Invalid("spec.x: bad".into()), 1, None),
            &time(100),
        );
        // Unchanged: nothing to write.
        assert_eq!(
            desired_status(
                &view(Verdict::Invalid("spec.x: bad".into()), 1, broken.clone()),
                &time(150)
            ),
            None
        );
        // Another error: the message follows, the transition time stays.
        let other = desired_status(
            &view(Verdict::Invalid("spec.z: worse".into()), 2, broken),
            &time(200),
        )
        .unwrap();
        assert_eq!(other.conditions[1].message, "spec.z: worse");
        assert_eq!(other.conditions[1].last_transition_time, time(100));
        // Fixed: Ready, and no Stalled condition left behind.
        let fixed = desired_status(&view(Verdict::Ready, 3, Some(other)), &time(300)).unwrap();
        assert_eq!(
            summary(&fixed),
            [(
                "Ready",
                "True",
                "Compiled",
                "the rule is compiled and applied to matching objects"
            )]
        );
        assert_eq!(fixed.conditions[0].last_transition_time, time(300));
    }

    #[test]
    fn long_messages_are_cut() {
        let long = "é".repeat(MESSAGE_MAX_CHARS + 10);
        let status = desired_status(&view(Verdict::Invalid(long), 1, None), &time(1)).unwrap();
        let message = &status.conditions[0].message;
        assert_eq!(message.chars().count(), MESSAGE_MAX_CHARS + 1);
        assert!(message.ends_with('…'));
    }
}
