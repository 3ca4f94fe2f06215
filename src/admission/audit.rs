//! What `mode: Audit` rules would have done, tallied per rule between two reports.
//!
//! The admission path adds each request's audit verdicts here (a short lock, taken only when an
//! Audit rule matched); the controller's `audit` duty takes the tally every
//! `--audit-report-interval` and publishes one Event per rule and verdict, so a busy cluster
//! costs at most one Event per Audit rule and interval, whatever the traffic. The map holds one
//! entry per Audit rule of the index, with at most two bounded examples each.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use initium_engine::{Audited, RuleId, Verdict};

/// Longest example kept per rule and verdict (characters); an Event's note is at most 1 KiB.
const EXAMPLE_MAX: usize = 600;

/// The counts of one Audit rule since the last report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Objects the rule would have changed.
    pub would_change: u64,
    /// Objects on which the rule would have failed.
    pub would_fail: u64,
    /// The first object it would have changed, and how (`Pod shop/web: add /spec/volumes`).
    pub change_example: Option<String>,
    /// The first object it would have failed on, and why.
    pub failure_example: Option<String>,
}

/// Per-rule tallies, shared by the admission path and the `audit` duty.
#[derive(Debug, Default)]
pub struct AuditTally {
    rules: Mutex<HashMap<RuleId, Tally>>,
}

impl AuditTally {
    /// Adds one request's verdicts; `object` names the object (`Pod shop/web`).
    pub fn add(&self, audited: &[Audited], object: &str) {
        if audited
            .iter()
            .all(|a| matches!(a.verdict, Verdict::Unchanged))
        {
            return;
        }
        let mut rules = self.rules.lock().unwrap_or_else(PoisonError::into_inner);
        for a in audited {
            if matches!(a.verdict, Verdict::Unchanged) {
                continue;
            }
            let tally = rules.entry(a.rule.clone()).or_default();
            let (count, first) = match &a.verdict {
                Verdict::WouldFail { .. } => (&mut tally.would_fail, &mut tally.failure_example),
                _ => (&mut tally.would_change, &mut tally.change_example),
            };
            *count += 1;
            first.get_or_insert_with(|| example(object, a));
        }
    }

    /// Everything tallied since the last call, sorted by rule; the tally starts again empty.
    pub fn take(&self) -> Vec<(RuleId, Tally)> {
        let taken = std::mem::take(&mut *self.rules.lock().unwrap_or_else(PoisonError::into_inner));
        let mut taken: Vec<(RuleId, Tally)> = taken.into_iter().collect();
        taken.sort_by_key(|(rule, _)| rule.to_string());
        taken
    }
}

/// `Pod shop/web: add /metadata/labels, ...`: the object and what the rule would do, without the
/// rule's name (the Event is on the rule).
fn example(object: &str, audited: &Audited) -> String {
    let summary = audited.summary();
    let rule = audited.rule.describe();
    let what = summary
        .strip_prefix(&format!("audit: {rule} "))
        .unwrap_or(&summary);
    let mut text = format!("{object}: {what}");
    if let Some((at, _)) = text.char_indices().nth(EXAMPLE_MAX) {
        text.truncate(at);
        text.push('…');
    }
    text
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn audited(rule: &str, verdict: Verdict) -> Audited {
        Audited {
            rule: RuleId::namespaced("shop", rule),
            verdict,
        }
    }

    #[test]
    fn verdicts_are_counted_per_rule_with_the_first_example_and_taken_once() {
        let tally = AuditTally::default();
        let change = || {
            Verdict::WouldChange(vec![json_patch::PatchOperation::Add(
                json_patch::AddOperation {
                    path: json_patch::jsonptr::PointerBuf::parse("/metadata/labels").unwrap(),
                    value: serde_json::json!({"a": "b"}),
                },
            )])
        };
        tally.add(&[audited("label", change())], "Pod shop/web");
        tally.add(
            &[
                audited("label", change()),
                audited("quiet", Verdict::Unchanged),
                audited(
                    "broken",
                    Verdict::WouldFail {
                        error: "boom".into(),
                        rejects: true,
                    },
                ),
            ],
            "Pod shop/api",
        );
        let taken = tally.take();
        assert_eq!(
            taken
                .iter()
                .map(|(r, t)| (r.to_string(), t.would_change, t.would_fail))
                .collect::<Vec<_>>(),
            [
                ("shop/broken".to_string(), 0, 1),
                ("shop/label".to_string(), 2, 0)
            ],
            "a rule that would change nothing is not tallied"
        );
        assert_eq!(
            taken[1].1.change_example.as_deref(),
            Some("Pod shop/web: would change the object: add /metadata/labels")
        );
        assert_eq!(
            taken[0].1.failure_example.as_deref(),
            Some(
                "Pod shop/api: would fail, and the object would be rejected (failurePolicy Fail): boom"
            )
        );
        assert!(tally.take().is_empty(), "taking empties the tally");
    }
}
