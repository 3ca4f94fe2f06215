//! "Why (not)": every rule of the index, in order, with what it did to one object or what
//! ruled it out. The same matching and the same runs as [`RuleIndex::evaluate_with`], with the
//! reason kept at each step; for `initium explain`, never on the admission path.

use json_patch::PatchOperation;
use serde_json::Value;

use crate::api::{FailurePolicy, Mode};

use super::evaluate::{Verdict, audit, rules_namespace};
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
        let ops = |ops: &[PatchOperation]| {
            ops.iter()
                .map(|op| serde_json::to_string(op).unwrap_or_default())
                .collect::<Vec<_>>()
        };
        match &self.what {
            StepResult::OtherNamespace => format!(
                "not a candidate: a MutationRule applies only to namespaced objects of its own \
                 namespace ({})",
                self.rule.namespace.as_deref().unwrap_or_default()
            ),
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
