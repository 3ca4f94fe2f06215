//! "Why (not)": every rule of the index, in order, with what it did to one object or what
//! ruled it out. The same matching and the same runs as [`RuleIndex::evaluate_with`], with the
//! reason kept at each step; for `initium explain`, never on the admission path.

use json_patch::PatchOperation;
use serde_json::Value;

use crate::api::{FailurePolicy, Mode};

use super::evaluate::{Verdict, audit, fill_identity, rules_namespace, unfill_object};
use super::index::RuleIndex;
use super::limits::{Limits, Meter};
use super::rule::RuleResult;
use super::subject::{RuleId, Subject};
use crate::untrusted::escape;

/// One rule's part in the admission of one object.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub rule: RuleId,
    pub priority: i32,
    pub mode: Mode,
    pub failure_policy: FailurePolicy,
    pub what: StepResult,
}

/// What a rule did, or why it did nothing.
#[derive(Clone, Debug, PartialEq)]
pub enum StepResult {
    /// A MutationRule of another namespace: it applies only to objects of its own.
    OtherNamespace,
    /// The field of the rule that rules the object out (`spec.match.labels`,
    /// `spec.exclude`, `spec.conditions[1]`).
    NotMatched(String),
    /// It matched and changed the object with these operations (on the object as the rules
    /// before it left it).
    Changed(Vec<PatchOperation>),
    /// It matched and changed nothing.
    Unchanged,
    /// It failed: skipped (`failurePolicy: Ignore`), or the object is rejected (`Fail`).
    Failed(String),
    /// A `mode: Audit` rule: what it would have done (its changes are not kept).
    Audited(Verdict),
    /// A rule before it rejected the object: this one did not run.
    NotRun,
}

impl RuleIndex {
    /// Every rule of the index, in order, and what it did to `object` or why it did not
    /// apply; and the object after all of them. No deadline: time is not part of the answer.
    pub fn explain(&self, subject: &Subject, object: Value, limits: &Limits) -> (Vec<Step>, Value) {
        let namespace = rules_namespace(subject, &object).map(str::to_string);
        let namespaced_object = subject.namespace.is_some_and(|n| !n.is_empty());
        let mut doc = object;
        // As in admission: rules see the object with the request's namespace and name filled
        // in, so `explain` and `apply` agree on an object that names no namespace.
        let filled = fill_identity(&mut doc, subject);
        let mut meter = Meter::new(limits, None);
        let mut rejected = false;
        let mut steps = Vec::with_capacity(self.rules().len());
        for rule in self.rules() {
            let what = if rejected {
                StepResult::NotRun
            } else if let Some(own) = &rule.id.namespace
                && (!namespaced_object || namespace.as_deref() != Some(&**own))
            {
                StepResult::OtherNamespace
            } else {
                match rule.why_not(subject, &doc) {
                    Ok(Some(field)) => StepResult::NotMatched(field),
                    Err(e) => failed(
                        escape(&e.to_string()).into_owned(),
                        rule.mode,
                        rule.failure_policy,
                        &mut rejected,
                    ),
                    Ok(None) => {
                        let result = rule.run(subject, &mut doc, &mut meter);
                        if rule.mode == Mode::Audit {
                            match audit(
                                rule.id.clone(),
                                rule.failure_policy,
                                result,
                                &mut doc,
                                &mut meter,
                            ) {
                                Ok(Some((audited, _))) => StepResult::Audited(audited.verdict),
                                Ok(None) => StepResult::Unchanged,
                                Err(_) => {
                                    rejected = true;
                                    StepResult::Failed(
                                        "undoing the Audit rule's changes failed".into(),
                                    )
                                }
                            }
                        } else {
                            match result {
                                RuleResult::NotMatched => StepResult::NotMatched("spec".into()),
                                RuleResult::Unchanged => StepResult::Unchanged,
                                RuleResult::Changed(journal) => {
                                    StepResult::Changed(journal.preview(&doc))
                                }
                                RuleResult::Failed(error) => failed(
                                    escape(&error.to_string()).into_owned(),
                                    rule.mode,
                                    rule.failure_policy,
                                    &mut rejected,
                                ),
                                RuleResult::Corrupted(error) => {
                                    rejected = true;
                                    StepResult::Failed(escape(&error.to_string()).into_owned())
                                }
                            }
                        }
                    }
                }
            };
            steps.push(Step {
                rule: rule.id.clone(),
                priority: rule.priority,
                mode: rule.mode,
                failure_policy: rule.failure_policy,
                what,
            });
        }
        unfill_object(&mut doc, &filled);
        (steps, doc)
    }
}

fn failed(error: String, mode: Mode, policy: FailurePolicy, rejected: &mut bool) -> StepResult {
    if mode == Mode::Audit {
        return StepResult::Audited(Verdict::WouldFail {
            error,
            rejects: policy == FailurePolicy::Fail,
        });
    }
    if policy == FailurePolicy::Fail {
        *rejected = true;
    }
    StepResult::Failed(error)
}

impl Step {
    /// One line for a person: `changed: add /metadata/labels/team`, `not matched:
    /// spec.match.labels does not hold`, ...
    pub fn describe(&self) -> String {
        let ops = describe_ops;
        match &self.what {
            StepResult::OtherNamespace => format!(
                "not a candidate: a MutationRule applies only to namespaced objects of its own \
                 namespace ({})",
                self.rule.namespace.as_deref().unwrap_or_default()
            ),
            StepResult::NotMatched(field) if field == "spec.exclude" => {
                "not matched: the object is excluded by spec.exclude".into()
            }
            StepResult::NotMatched(field) => format!("not matched: {field} does not hold"),
            StepResult::Changed(changes) => {
                format!(
                    "changed the object:\n      {}",
                    ops(changes).join("\n      ")
                )
            }
            StepResult::Unchanged => "matched, changed nothing".into(),
            StepResult::Failed(error) => match self.failure_policy {
                FailurePolicy::Ignore => {
                    format!("failed and was skipped (failurePolicy Ignore): {error}")
                }
                FailurePolicy::Fail => {
                    format!("failed and rejects the object (failurePolicy Fail): {error}")
                }
            },
            StepResult::Audited(Verdict::WouldChange(changes)) => format!(
                "mode Audit, would change the object (not kept):\n      {}",
                ops(changes).join("\n      ")
            ),
            StepResult::Audited(Verdict::Unchanged) => {
                "mode Audit, matched, would change nothing".into()
            }
            StepResult::Audited(Verdict::WouldFail { error, rejects }) => format!(
                "mode Audit, would fail and {} if enforced: {error}",
                if *rejects {
                    "reject the object"
                } else {
                    "be skipped"
                }
            ),
            StepResult::NotRun => "not run: a rule before it rejected the object".into(),
        }
    }
}

/// The operations one per line, as JSON, but the elements taken out of one list together:
/// `removed elements 0 and 2 of /spec/tolerations`.
fn describe_ops(ops: &[PatchOperation]) -> Vec<String> {
    let list_element = |op: &PatchOperation| match op {
        PatchOperation::Remove(r) => {
            let path = r.path.to_string();
            let (list, index) = path.rsplit_once('/')?;
            let index: usize = index.parse().ok()?;
            Some((list.to_string(), index))
        }
        _ => None,
    };
    let mut lines = Vec::new();
    let mut i = 0;
    while i < ops.len() {
        if let Some((list, index)) = list_element(&ops[i]) {
            let mut indexes = vec![index];
            let mut j = i + 1;
            while let Some((next, index)) = ops.get(j).and_then(list_element)
                && next == list
            {
                indexes.push(index);
                j += 1;
            }
            indexes.sort_unstable();
            let listed: Vec<String> = indexes.iter().map(usize::to_string).collect();
            let listed = match listed.split_last() {
                Some((last, [])) => format!("element {last}"),
                Some((last, rest)) => format!("elements {} and {last}", rest.join(", ")),
                None => String::new(),
            };
            lines.push(format!("removed {listed} of {list}"));
            i = j;
        } else {
            lines.push(serde_json::to_string(&ops[i]).unwrap_or_default());
            i += 1;
        }
    }
    lines
}
