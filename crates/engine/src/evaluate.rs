//! The apply pipeline: every matching rule, in order, within the latency budget.

use std::sync::LazyLock;
use std::time::Instant;

use json_patch::{Patch, PatchOperation};
use serde_json::Value;

use crate::api::{FailurePolicy, Mode};

use super::index::RuleIndex;
use super::journal::{Changes, Journal, PatchOp, write_patch};
use super::limits::{Limits, Meter};
use super::path::Pointer;
use super::provenance::{listed, provenance_pointer, record_provenance};
use super::rule::RuleResult;
use super::stop::Stop;
use super::subject::{RanBefore, RuleId, Subject};
use crate::untrusted::escape;

/// What happened to an admitted object.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The object after every rule.
    pub object: Value,
    /// RFC 6902 operations from the original object to `object` (see `patch()` and
    /// `write_patch()`).
    pub ops: Vec<PatchOp>,
    /// Rules that matched, in order (changed the object or not).
    pub matched: Vec<RuleId>,
    /// Rules that changed the object, in order.
    pub applied: Vec<RuleId>,
    /// Rules skipped because they failed or the budget ran out (`failurePolicy: Ignore`).
    pub skipped: Vec<RuleId>,
    /// Messages for the client, one per skipped rule.
    pub warnings: Vec<String>,
    /// True when the latency budget ran out before every rule had run.
    pub budget_exceeded: bool,
    /// What each matching `mode: Audit` rule would have done, in order. None of it is in
    /// `object`, and none of these rules is in `applied` or `skipped`.
    pub audited: Vec<Audited>,
    /// `ops` as RFC 6902 JSON, written while they were computed (`None` if that failed:
    /// `write_patch` then writes them from `object`).
    written: Option<Vec<u8>>,
}

/// What a `mode: Audit` rule would have done to the object.
#[derive(Clone, Debug, PartialEq)]
pub struct Audited {
    pub rule: RuleId,
    pub verdict: Verdict,
}

/// The verdict of an Audit rule on one object.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// It matched and would change nothing.
    Unchanged,
    /// It would make these changes: RFC 6902 operations on the object as the rules before
    /// it left it.
    WouldChange(Vec<PatchOperation>),
    /// It would fail: enforced, its failurePolicy would skip it (`rejects: false`) or reject
    /// the object (`rejects: true`).
    WouldFail { error: String, rejects: bool },
}

/// Operations a summary names before it says how many more there are.
const SUMMARY_OPS: usize = 4;

impl Audited {
    /// One line for a person: the rule and what it would do, e.g. `audit: ClusterMutationRule
    /// ca would change the object: add /spec/volumes/0, add /metadata/labels/ca`.
    pub fn summary(&self) -> String {
        let rule = self.rule.describe();
        match &self.verdict {
            Verdict::Unchanged => format!("audit: {rule} matched and would change nothing"),
            Verdict::WouldChange(ops) => {
                let mut named: Vec<String> = ops
                    .iter()
                    .take(SUMMARY_OPS)
                    .map(|op| {
                        let (verb, path) = match op {
                            PatchOperation::Add(o) => ("add", o.path.as_str()),
                            PatchOperation::Remove(o) => ("remove", o.path.as_str()),
                            PatchOperation::Replace(o) => ("replace", o.path.as_str()),
                            PatchOperation::Move(o) => ("move", o.path.as_str()),
                            PatchOperation::Copy(o) => ("copy", o.path.as_str()),
                            PatchOperation::Test(o) => ("test", o.path.as_str()),
                        };
                        format!("{verb} {}", if path.is_empty() { "/" } else { path })
                    })
                    .collect();
                if ops.len() > SUMMARY_OPS {
                    named.push(format!("and {} more", ops.len() - SUMMARY_OPS));
                }
                format!(
                    "audit: {rule} would change the object: {}",
                    named.join(", ")
                )
            }
            Verdict::WouldFail { error, rejects } => {
                let consequence = if *rejects {
                    "the object would be rejected (failurePolicy Fail)"
                } else {
                    "the rule would be skipped (failurePolicy Ignore)"
                };
                format!("audit: {rule} would fail, and {consequence}: {error}")
            }
        }
    }
}

impl Outcome {
    /// The RFC 6902 patch from the original object to `object`.
    pub fn patch(&self) -> Patch {
        Patch(
            self.ops
                .iter()
                .map(|op| op.to_operation(&self.object))
                .collect(),
        )
    }

    /// The patch as JSON, as the rules left the object (the JSON is written when the
    /// operations are computed, from the values the diff holds).
    pub fn write_patch(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        match &self.written {
            Some(written) => {
                out.extend_from_slice(written);
                Ok(())
            }
            None => write_patch(&self.ops, &self.object, out),
        }
    }
}

/// A `failurePolicy: Fail` rule failed (or could not run within the budget): the object is
/// rejected.
#[derive(Clone, Debug, PartialEq)]
pub struct Denial {
    pub rule: RuleId,
    pub message: String,
    pub budget_exceeded: bool,
}

impl std::fmt::Display for Denial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Denial {}

impl RuleIndex {
    /// [`RuleIndex::evaluate_with`] with the default [`Limits`].
    pub fn evaluate(
        &self,
        subject: &Subject,
        object: Value,
        deadline: Option<Instant>,
    ) -> Result<Outcome, Denial> {
        self.evaluate_with(subject, object, deadline, &Limits::default())
    }

    /// Applies every matching rule to `object`, in order. `deadline` is the latency budget,
    /// checked between rules and inside them; `limits` bound what each rule may write. A rule
    /// that runs out of either fails by its `failurePolicy`, its changes undone. Pure apart
    /// from reading the clock. The object is changed in place: rules record what they touch,
    /// so nothing is copied whole.
    pub fn evaluate_with(
        &self,
        subject: &Subject,
        object: Value,
        deadline: Option<Instant>,
        limits: &Limits,
    ) -> Result<Outcome, Denial> {
        self.evaluate_candidates(subject, object, deadline, limits, true)
    }

    /// [`RuleIndex::evaluate_with`]; without `prefiltered`, every candidate is matched in
    /// full (what the prefilters must not change: tests compare the two).
    pub(crate) fn evaluate_candidates(
        &self,
        subject: &Subject,
        object: Value,
        deadline: Option<Instant>,
        limits: &Limits,
        prefiltered: bool,
    ) -> Result<Outcome, Denial> {
        let namespace = rules_namespace(subject, &object);
        let namespaced_object = subject.namespace.is_some_and(|n| !n.is_empty());
        let mut candidates = self.candidate_cursor(subject.gvk, namespace, namespaced_object);
        let spare = if candidates.is_empty() { 0 } else { 8 };

        let mut outcome = Outcome {
            object: Value::Null,
            ops: Vec::new(),
            // Room for a few rules where there are candidates (most objects have none).
            matched: Vec::with_capacity(spare),
            applied: Vec::with_capacity(spare),
            skipped: Vec::new(),
            warnings: Vec::new(),
            budget_exceeded: false,
            audited: Vec::new(),
            written: None,
        };
        let mut doc = object;
        // Rules see the object with the request's namespace and name filled in (at admission
        // they may still be empty); they are taken out again before the patch is computed.
        let filled = fill_identity(&mut doc, subject);
        let mut changes = Changes::default();
        let mut meter = Meter::new(limits, deadline);
        let ran_before = ran_in_this_request(&doc, subject.ran_before);
        if prefiltered {
            candidates.prefilter(subject, &doc);
        }

        let mut seen = 0;
        let mut out_of_time_grace = None;
        while let Some(rule) = candidates.next_rule() {
            let i = seen;
            seen += 1;
            if ran_before.iter().any(|listed| rule.id.is_written(listed)) {
                continue;
            }
            // The clock is read before every DEADLINE_STRIDE-th candidate the prefilters leave:
            // reading it costs more than ruling out a candidate that does not match (a profile of 1,000 candidates
            // per request put 7% of the time in clock_gettime).
            if !outcome.budget_exceeded
                && i % DEADLINE_STRIDE == 0
                && deadline.is_some_and(crate::pace::passed)
            {
                outcome.budget_exceeded = true;
            }
            if outcome.budget_exceeded {
                // Whether a rule that cannot run would have matched: its match fields, and its
                // conditions while a short grace lasts (one grace for all the rules left, so
                // a tenant's many slow conditions cannot stretch it); a rule whose conditions
                // are not tested in time counts as matching, as a rule that could not run.
                let grace = *out_of_time_grace.get_or_insert_with(|| Instant::now() + GRACE);
                if matches!(
                    rule.matches_guarded_until(subject, &doc, Some(grace)),
                    Ok(false)
                ) {
                    continue;
                }
                outcome.matched.push(rule.id.clone());
                if rule.mode == Mode::Audit {
                    outcome.audited.push(Audited {
                        rule: rule.id.clone(),
                        verdict: Verdict::WouldFail {
                            error: "the latency budget ran out before it could run".into(),
                            rejects: rule.failure_policy == FailurePolicy::Fail,
                        },
                    });
                    continue;
                }
                match rule.failure_policy {
                    FailurePolicy::Ignore => {
                        outcome.skipped.push(rule.id.clone());
                        outcome.warnings.push(format!(
                            "{} skipped: the latency budget ran out before it could run",
                            rule.id.describe()
                        ));
                        continue;
                    }
                    FailurePolicy::Fail => {
                        return Err(Denial {
                            rule: rule.id.clone(),
                            message: format!(
                                "{} (failurePolicy Fail) could not run: the latency budget ran out",
                                rule.id.describe()
                            ),
                            budget_exceeded: true,
                        });
                    }
                }
            }
            let result = rule.run(subject, &mut doc, &mut meter);
            let result = if rule.mode == Mode::Audit {
                match audit(
                    rule.id.clone(),
                    rule.failure_policy,
                    result,
                    &mut doc,
                    &mut meter,
                ) {
                    Ok(Some((audited, out_of_time))) => {
                        outcome.matched.push(rule.id.clone());
                        // The rules after it have no time left either.
                        outcome.budget_exceeded |= out_of_time;
                        outcome.audited.push(audited);
                        continue;
                    }
                    Ok(None) => continue,
                    // Undoing the audit rule's changes failed: handled like any corruption.
                    Err(corrupted) => corrupted,
                }
            } else {
                result
            };
            match result {
                RuleResult::NotMatched => {}
                RuleResult::Unchanged => outcome.matched.push(rule.id.clone()),
                RuleResult::Changed(journal) => {
                    outcome.matched.push(rule.id.clone());
                    outcome.applied.push(rule.id.clone());
                    if prefiltered {
                        candidates.object_changed(subject, &doc, journal.touched());
                    }
                    changes.absorb(journal);
                }
                RuleResult::Corrupted(error) => {
                    // Fail closed: the object may be half changed and cannot be admitted.
                    return Err(Denial {
                        rule: rule.id.clone(),
                        message: format!(
                            "{} failed: {}",
                            rule.id.describe(),
                            escape(&error.to_string())
                        ),
                        budget_exceeded: false,
                    });
                }
                RuleResult::Failed(error) => {
                    outcome.matched.push(rule.id.clone());
                    if matches!(error, Stop::Budget) {
                        // The rules after it have no time left either.
                        outcome.budget_exceeded = true;
                    }
                    let error = escape(&error.to_string()).into_owned();
                    match rule.failure_policy {
                        FailurePolicy::Ignore => {
                            outcome.skipped.push(rule.id.clone());
                            outcome
                                .warnings
                                .push(format!("{} skipped: {error}", rule.id.describe()));
                        }
                        FailurePolicy::Fail => {
                            return Err(Denial {
                                rule: rule.id.clone(),
                                message: format!(
                                    "{} (failurePolicy Fail) failed: {error}",
                                    rule.id.describe()
                                ),
                                budget_exceeded: outcome.budget_exceeded,
                            });
                        }
                    }
                }
            }
        }

        if !outcome.applied.is_empty() {
            let mut journal = Journal::default();
            journal.touch(&doc, provenance_pointer());
            record_provenance(&mut doc, &outcome.applied);
            changes.absorb(journal);
        }
        unfill_identity(&mut doc, &mut changes, &filled);
        // The webhook answers with the patch's JSON: written now, while the diff holds each
        // value, rather than looked up again from the root for every operation.
        let mut written = Vec::with_capacity(if changes.is_empty() { 2 } else { 1024 });
        match changes.patch_written(&doc, &mut written) {
            Ok(ops) => {
                outcome.ops = ops;
                outcome.written = Some(written);
            }
            Err(_) => outcome.ops = changes.patch(&doc),
        }
        outcome.object = doc;
        Ok(outcome)
    }
}

/// The verdict of an Audit rule from what running it gave, its changes undone (`Ok(None)`:
/// it did not match), and whether the latency budget ran out in it. `Err` carries a result the pipeline must handle as for any rule: the
/// object could not be put back.
/// How long, once the latency budget has run out, the conditions of the rules left may still
/// be tested to tell whether they would have matched.
const GRACE: std::time::Duration = std::time::Duration::from_millis(2);

pub(super) fn audit(
    rule: RuleId,
    policy: FailurePolicy,
    result: RuleResult,
    doc: &mut Value,
    meter: &mut Meter,
) -> Result<Option<(Audited, bool)>, RuleResult> {
    let mut out_of_time = false;
    let verdict = match result {
        RuleResult::NotMatched => return Ok(None),
        RuleResult::Unchanged => Verdict::Unchanged,
        RuleResult::Changed(journal) => {
            let ops = journal.preview(doc);
            let undone = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                journal.rollback(doc);
            }));
            if let Err(panic) = undone {
                return Err(RuleResult::Corrupted(super::rule::UndoFailed::audit(
                    &*panic,
                )));
            }
            // What it wrote is gone: it does not count against what the rules may write.
            meter.undo_rule();
            Verdict::WouldChange(ops)
        }
        RuleResult::Failed(error) => {
            out_of_time = matches!(error, Stop::Budget);
            Verdict::WouldFail {
                error: escape(&error.to_string()).into_owned(),
                rejects: policy == FailurePolicy::Fail,
            }
        }
        corrupted @ RuleResult::Corrupted(_) => return Err(corrupted),
    };
    Ok(Some((Audited { rule, verdict }, out_of_time)))
}

/// The namespace whose MutationRules apply to the object: its own, or for a Namespace object
/// its name (at admission it may be only in the object).
pub(super) fn rules_namespace<'a>(subject: &Subject<'a>, object: &'a Value) -> Option<&'a str> {
    if subject.gvk.group.is_empty() && subject.gvk.kind == "Namespace" {
        subject
            .name
            .filter(|n| !n.is_empty())
            .or_else(|| object.pointer("/metadata/name").and_then(Value::as_str))
    } else {
        subject.namespace.filter(|n| !n.is_empty())
    }
}

/// How many candidate rules run between two looks at the clock.
const DEADLINE_STRIDE: usize = 8;

fn identity_pointer(field: &str) -> &'static Pointer {
    static NAMESPACE: LazyLock<Pointer> =
        LazyLock::new(|| Pointer::from_tokens(["metadata", "namespace"]));
    static NAME: LazyLock<Pointer> = LazyLock::new(|| Pointer::from_tokens(["metadata", "name"]));
    if field == "namespace" {
        &NAMESPACE
    } else {
        &NAME
    }
}

/// What `metadata.namespace` / `metadata.name` held before the request's values were filled in.
#[derive(Clone, Copy)]
pub(super) enum Prior {
    Absent,
    Empty,
}

impl Prior {
    fn value(self) -> Option<Value> {
        match self {
            Prior::Absent => None,
            Prior::Empty => Some(Value::String(String::new())),
        }
    }
}

/// The fields filled in from the request: (field, value filled in, what was there).
pub(super) type Filled = Vec<(&'static str, String, Prior)>;

pub(super) fn fill_identity(object: &mut Value, subject: &Subject) -> Filled {
    let mut filled = Vec::new();
    let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return filled;
    };
    for (field, value) in [("namespace", subject.namespace), ("name", subject.name)] {
        let Some(value) = value.filter(|v| !v.is_empty()) else {
            continue;
        };
        if meta
            .get(field)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
        {
            continue;
        }
        let previous = meta.insert(field.to_string(), Value::String(value.to_string()));
        filled.push((
            field,
            value.to_string(),
            if previous.is_some() {
                Prior::Empty
            } else {
                Prior::Absent
            },
        ));
    }
    filled
}

/// Takes the filled-in fields out of the object, unless a rule set them to something else.
pub(super) fn unfill_object(object: &mut Value, filled: &Filled) {
    for (field, value, prior) in filled {
        let pointer = identity_pointer(field);
        if pointer.get(object).and_then(Value::as_str) == Some(value.as_str()) {
            pointer.set(object, prior.value());
        }
    }
}

/// Takes the filled-in fields out of the object (unless a rule set them to something else)
/// and out of the recorded originals.
fn unfill_identity(object: &mut Value, changes: &mut Changes, filled: &Filled) {
    for (field, value, prior) in filled {
        let pointer = identity_pointer(field);
        if pointer.get(object).and_then(Value::as_str) == Some(value.as_str()) {
            pointer.set(object, prior.value());
        }
        changes.set_original(pointer, prior.value());
    }
}

/// The rules that changed the object earlier in this admission request ([`RanBefore`]), as
/// the annotation names them; empty in the common case (the first call for an object).
fn ran_in_this_request(object: &Value, ran_before: RanBefore) -> Vec<String> {
    let RanBefore::Listed { stored, .. } = ran_before else {
        return Vec::new();
    };
    let Some(now) = provenance_pointer().get(object).and_then(Value::as_str) else {
        return Vec::new();
    };
    let stored: Vec<&str> = stored.map(|s| listed(s).collect()).unwrap_or_default();
    listed(now)
        .filter(|rule| !stored.contains(rule))
        .map(String::from)
        .collect()
}
