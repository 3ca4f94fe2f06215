//! The apply pipeline: every matching rule, in order, within the latency budget.

use std::time::Instant;

use json_patch::Patch;
use serde_json::{Map, Value};

use crate::api::{FailurePolicy, MUTATED_BY_ANNOTATION};

use super::index::RuleIndex;
use super::rule::{RuleId, RuleResult, Subject};

/// What happened to an admitted object.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The object after every rule.
    pub object: Value,
    /// RFC 6902 patch from the original object to `object`.
    pub patch: Patch,
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
    /// Applies every matching rule to `object`, in order. `deadline` is the latency budget,
    /// checked between rules. Pure apart from reading the clock.
    pub fn evaluate(
        &self,
        subject: &Subject,
        object: &Value,
        deadline: Option<Instant>,
    ) -> Result<Outcome, Denial> {
        let namespace = if subject.gvk.group.is_empty() && subject.gvk.kind == "Namespace" {
            subject
                .name
                .filter(|n| !n.is_empty())
                .or_else(|| object.pointer("/metadata/name").and_then(Value::as_str))
        } else {
            subject.namespace.filter(|n| !n.is_empty())
        };
        let namespaced_object = subject.namespace.is_some_and(|n| !n.is_empty());
        let candidates = self.candidates(subject.gvk, namespace, namespaced_object);

        let mut outcome = Outcome {
            object: Value::Null,
            patch: Patch(Vec::new()),
            matched: Vec::new(),
            applied: Vec::new(),
            skipped: Vec::new(),
            warnings: Vec::new(),
            budget_exceeded: false,
        };
        // Rules see the object with the request's namespace and name filled in (at admission
        // they may still be empty); they are taken out again before the patch is computed.
        let mut working = object.clone();
        let filled = fill_identity(&mut working, subject);

        for rule in candidates {
            if !outcome.budget_exceeded && deadline.is_some_and(|d| Instant::now() >= d) {
                outcome.budget_exceeded = true;
            }
            if outcome.budget_exceeded {
                if !rule.matches(subject, &working) {
                    continue;
                }
                outcome.matched.push(rule.id.clone());
                let message = format!(
                    "{} skipped: the latency budget ran out before it could run",
                    rule.id.describe()
                );
                match rule.failure_policy {
                    FailurePolicy::Ignore => {
                        outcome.skipped.push(rule.id.clone());
                        outcome.warnings.push(message);
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
            match rule.run(subject, &working) {
                RuleResult::NotMatched => {}
                RuleResult::Unchanged => outcome.matched.push(rule.id.clone()),
                RuleResult::Changed(next) => {
                    outcome.matched.push(rule.id.clone());
                    outcome.applied.push(rule.id.clone());
                    working = next;
                }
                RuleResult::Failed(error) => {
                    outcome.matched.push(rule.id.clone());
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
                                budget_exceeded: false,
                            });
                        }
                    }
                }
            }
        }

        unfill_identity(&mut working, filled);
        if !outcome.applied.is_empty() {
            record_provenance(&mut working, &outcome.applied);
        }
        outcome.patch = json_patch::diff(object, &working);
        outcome.object = working;
        Ok(outcome)
    }
}

/// What `metadata.namespace` / `metadata.name` held before the request's values were filled in.
#[derive(Clone, Copy)]
enum Prior {
    Absent,
    Empty,
}

struct Filled {
    namespace: Option<Prior>,
    name: Option<Prior>,
}

fn fill_identity(object: &mut Value, subject: &Subject) -> Filled {
    let mut filled = Filled {
        namespace: None,
        name: None,
    };
    let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return filled;
    };
    let mut fill = |field: &str, value: Option<&str>| {
        let value = value.filter(|v| !v.is_empty())?;
        if meta
            .get(field)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
        {
            return None;
        }
        let previous = meta.insert(field.to_string(), Value::String(value.to_string()));
        Some(if previous.is_some() {
            Prior::Empty
        } else {
            Prior::Absent
        })
    };
    filled.namespace = fill("namespace", subject.namespace);
    filled.name = fill("name", subject.name);
    filled
}

fn unfill_identity(object: &mut Value, filled: Filled) {
    let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    for (field, prior) in [("namespace", filled.namespace), ("name", filled.name)] {
        match prior {
            None => {}
            Some(Prior::Absent) => {
                meta.remove(field);
            }
            Some(Prior::Empty) => {
                meta.insert(field.to_string(), Value::String(String::new()));
            }
        }
    }
}

/// Appends the rules that changed the object to `initium.dev/mutated-by`, keeping what earlier
/// passes (reinvocation, updates) recorded, so running the pipeline again changes nothing.
fn record_provenance(object: &mut Value, applied: &[RuleId]) {
    let Some(obj) = object.as_object_mut() else {
        return;
    };
    let meta = obj
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Some(meta) = meta.as_object_mut() else {
        return;
    };
    let annotations = meta
        .entry("annotations")
        .or_insert_with(|| Value::Object(Map::new()));
    if annotations.is_null() {
        *annotations = Value::Object(Map::new());
    }
    let Some(annotations) = annotations.as_object_mut() else {
        return;
    };
    let mut list: Vec<String> = annotations
        .get(MUTATED_BY_ANNOTATION)
        .and_then(Value::as_str)
        .map(|s| {
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    for id in applied {
        let id = id.to_string();
        if !list.contains(&id) {
            list.push(id);
        }
    }
    annotations.insert(
        MUTATED_BY_ANNOTATION.to_string(),
        Value::String(list.join(",")),
    );
}
