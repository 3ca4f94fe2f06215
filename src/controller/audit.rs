//! The `audit` duty: every `--audit-report-interval`, one Event per `mode: Audit` rule and
//! verdict, summing up what the rule would have done to the objects this replica admitted.
//!
//! Every replica reports what it saw itself (it needs no Lease: an Event names its reporting
//! instance). An Event per admission would be a write per object on a busy cluster; a summary
//! per interval is at most one write per Audit rule and interval, whatever the traffic.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::watch;

use crate::admission::audit::Tally;
use crate::admission::state::Shared;
use crate::report::report;
use initium_engine::RuleId;
use initium_engine::api::API_VERSION;

use super::duty::{Context, Duty};
use super::rules::Snapshot;
use super::vocabulary::{ControllerError, FIELD_MANAGER};

/// Default `--audit-report-interval`.
pub const DEFAULT_AUDIT_REPORT_INTERVAL: Duration = Duration::from_secs(60);

/// Longest Event note the API server takes (1 KiB).
const NOTE_MAX: usize = 1000;

/// Default `--max-audit-events-per-namespace`.
pub const DEFAULT_MAX_AUDIT_EVENTS_PER_NAMESPACE: u32 = 20;

pub(crate) struct Audit {
    client: kube::Client,
    shared: Arc<Shared>,
    snapshot: watch::Receiver<Arc<Snapshot>>,
    identity: String,
    interval: Duration,
    /// At most this many Events per namespace and interval (`--max-audit-events-per-namespace`).
    per_namespace: usize,
}

impl Audit {
    pub(crate) fn new(
        client: kube::Client,
        shared: Arc<Shared>,
        snapshot: watch::Receiver<Arc<Snapshot>>,
        identity: String,
        interval: Duration,
        per_namespace: usize,
    ) -> Audit {
        Audit {
            client,
            shared,
            snapshot,
            identity,
            interval,
            per_namespace,
        }
    }
}

impl Duty for Audit {
    const NAME: &'static str = "audit";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(self.identity.clone()),
            },
        );
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            let stopping = tokio::select! {
                () = context.stop.wait() => true,
                _ = tick.tick() => false,
            };
            let tallies = self.shared.audit.take();
            if !tallies.is_empty() {
                let snapshot = self.snapshot.borrow().clone();
                // A rule deleted since has nothing to hold the Event.
                let uid = |rule: &RuleId| {
                    snapshot
                        .rules
                        .iter()
                        .find(|v| v.id == *rule)
                        .map(|v| v.uid.clone())
                };
                let tallies = tallies
                    .into_iter()
                    .filter(|(rule, _)| uid(rule).is_some())
                    .collect();
                for (rule, event, note) in plan(tallies, self.interval, self.per_namespace) {
                    let uid = uid(&rule).flatten();
                    publish(&recorder, &rule, uid, event, note, &context).await;
                }
            }
            if stopping {
                return Ok(());
            }
        }
    }
}

/// The namespace an Event on `rule` is stored in: the rule's, or `default` for a
/// ClusterMutationRule (where Kubernetes keeps Events about cluster-scoped objects).
fn event_namespace(rule: &RuleId) -> &str {
    rule.namespace.as_deref().unwrap_or("default")
}

/// The Events of one interval, at most `per_namespace` in each namespace. Where a namespace
/// has more, the first `per_namespace - 1` by importance are published (would-fail before
/// would-change, then the larger counts, then by rule) and one `AuditEventsSummarized` Event,
/// on the most important rule left out, sums up the rest: a thousand Audit rules in one
/// namespace cost it `per_namespace` Events a minute, not a thousand. Every rule's counts are
/// in the metrics whatever is published.
pub(crate) fn plan(
    tallies: Vec<(RuleId, Tally)>,
    interval: Duration,
    per_namespace: usize,
) -> Vec<(RuleId, Event, String)> {
    let per_namespace = per_namespace.max(1);
    let mut by_namespace: std::collections::BTreeMap<String, Vec<(RuleId, Tally)>> =
        std::collections::BTreeMap::new();
    for (rule, tally) in tallies {
        by_namespace
            .entry(event_namespace(&rule).to_string())
            .or_default()
            .push((rule, tally));
    }
    let mut out = Vec::new();
    for (namespace, tallies) in by_namespace {
        let mut all: Vec<(RuleId, Event, String, u64)> = Vec::new();
        for (rule, tally) in &tallies {
            for (event, note) in events(rule, tally, interval) {
                let count = if event.type_ == EventType::Warning {
                    tally.would_fail
                } else {
                    tally.would_change
                };
                all.push((rule.clone(), event, note, count));
            }
        }
        if all.len() <= per_namespace {
            out.extend(all.into_iter().map(|(r, e, n, _)| (r, e, n)));
            continue;
        }
        // Most important first; a stable sort keeps the rules' order among equals.
        let mut order: Vec<usize> = (0..all.len()).collect();
        order.sort_by_key(|&i| {
            let (_, event, _, count) = &all[i];
            (event.type_ != EventType::Warning, std::cmp::Reverse(*count))
        });
        let mut published = vec![false; all.len()];
        for &i in order.iter().take(per_namespace - 1) {
            published[i] = true;
        }
        let left_out: Vec<usize> = order.iter().copied().skip(per_namespace - 1).collect();
        let summary = summary(
            &namespace,
            &all,
            &left_out,
            &tallies,
            interval,
            per_namespace,
        );
        out.extend(
            all.into_iter()
                .zip(published)
                .filter(|(_, published)| *published)
                .map(|((r, e, n, _), _)| (r, e, n)),
        );
        out.extend(summary);
    }
    out
}

/// The `AuditEventsSummarized` Event for the Events of `namespace` left out (indices into
/// `all`, most important first), on the first of their rules.
fn summary(
    namespace: &str,
    all: &[(RuleId, Event, String, u64)],
    left_out: &[usize],
    tallies: &[(RuleId, Tally)],
    interval: Duration,
    per_namespace: usize,
) -> Option<(RuleId, Event, String)> {
    let first = all.get(*left_out.first()?)?.0.clone();
    let mut rules: Vec<&RuleId> = Vec::new();
    for &i in left_out {
        if let Some((rule, ..)) = all.get(i)
            && !rules.contains(&rule)
        {
            rules.push(rule);
        }
    }
    let fails = left_out.iter().any(|&i| {
        all.get(i)
            .is_some_and(|(_, e, ..)| e.type_ == EventType::Warning)
    });
    let mut listed = String::new();
    let mut shown = 0;
    for rule in &rules {
        let Some((_, tally)) = tallies.iter().find(|(r, _)| r == *rule) else {
            continue;
        };
        let mut what = Vec::new();
        if tally.would_fail > 0 {
            what.push(format!("would fail on {}", tally.would_fail));
        }
        if tally.would_change > 0 {
            what.push(format!("would change {}", tally.would_change));
        }
        let item = format!("{} {}", rule.name, what.join(" and "));
        // Room for the sentence around the list, within the 1 KiB note.
        if listed.len() + item.len() > 560 {
            break;
        }
        if !listed.is_empty() {
            listed.push_str("; ");
        }
        listed.push_str(&item);
        shown += 1;
    }
    if shown < rules.len() {
        listed.push_str(&format!("; and {} more rule(s)", rules.len() - shown));
    }
    let where_ = if first.namespace.is_some() {
        format!("namespace {namespace}")
    } else {
        "ClusterMutationRules".to_string()
    };
    Some((
        first,
        Event {
            type_: if fails {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: "AuditEventsSummarized".into(),
            note: None,
            action: "Audit".into(),
            secondary: None,
        },
        format!(
            "in the last {}s, {} more Audit rule(s) of {where_} would have changed or failed on \
             objects, summed up in this one Event (at most {per_namespace} audit Events per \
             namespace and interval, --max-audit-events-per-namespace): {listed}. Nothing was \
             changed or rejected; each rule's counts are in initium_rule_audit_changes_total and \
             initium_rule_audit_errors_total.",
            interval.as_secs().max(1),
            rules.len(),
        ),
    ))
}

/// The Events for one rule's tally: `AuditWouldChange` (Normal) and `AuditWouldFail`
/// (Warning), each with its count and first example.
pub(crate) fn events(rule: &RuleId, tally: &Tally, interval: Duration) -> Vec<(Event, String)> {
    let secs = interval.as_secs().max(1);
    let mut out = Vec::new();
    if tally.would_change > 0 {
        out.push((
            Event {
                type_: EventType::Normal,
                reason: "AuditWouldChange".into(),
                note: None,
                action: "Audit".into(),
                secondary: None,
            },
            format!(
                "in the last {secs}s this {} (mode Audit) would have changed {} object(s); \
                 nothing was changed. First: {}. Set spec.mode to Enforce to apply it.",
                rule.describe(),
                tally.would_change,
                tally.change_example.as_deref().unwrap_or("-"),
            ),
        ));
    }
    if tally.would_fail > 0 {
        out.push((
            Event {
                type_: EventType::Warning,
                reason: "AuditWouldFail".into(),
                note: None,
                action: "Audit".into(),
                secondary: None,
            },
            format!(
                "in the last {secs}s this {} (mode Audit) would have failed on {} object(s); \
                 nothing was rejected. First: {}. Fix the rule before enforcing it.",
                rule.describe(),
                tally.would_fail,
                tally.failure_example.as_deref().unwrap_or("-"),
            ),
        ));
    }
    out
}

/// The Event's action, `Audit/<hash of the note>`. kube's `Recorder` counts an Event whose
/// type, action, reason, reporter and object were published in the last 6 minutes as one
/// more of that series, and keeps the series' first note: with one action for every
/// interval, a rule reporting every minute showed its first interval's note ever after (seen
/// on a real API server: five creates and a sixth in a later interval, one Event naming the
/// first Pod). A note of its own is an Event of its own; the same note again is a series.
fn action_for(note: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    note.hash(&mut hasher);
    format!("Audit/{:016x}", hasher.finish())
}

async fn publish(
    recorder: &Recorder,
    rule: &RuleId,
    uid: Option<String>,
    mut event: Event,
    note: String,
    context: &Context,
) {
    // What a note quotes of an object is escaped where it is taken; escaping the whole note
    // here, before it is cut to what the API server takes, guarantees it for every Event.
    let mut note = initium_engine::untrusted::escape(&note).into_owned();
    if let Some((at, _)) = note.char_indices().nth(NOTE_MAX) {
        note.truncate(at);
        note.push('…');
    }
    event.action = action_for(&note);
    event.note = Some(note);
    let reference = ObjectReference {
        api_version: Some(API_VERSION.into()),
        kind: Some(
            if rule.namespace.is_some() {
                "MutationRule"
            } else {
                "ClusterMutationRule"
            }
            .into(),
        ),
        namespace: rule.namespace.as_deref().map(str::to_string),
        name: Some(rule.name.to_string()),
        uid,
        ..ObjectReference::default()
    };
    if let Err(error) = recorder.publish(&event, &reference).await {
        context.failed(
            "publishing an audit Event on the rule failed; the counts are in the metrics",
            &format!("{}: {}", rule.describe(), report(&error)),
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_becomes_one_event_per_verdict_with_its_count_and_example() {
        let tally = Tally {
            would_change: 37,
            would_fail: 2,
            change_example: Some("Pod shop/web: would change the object: add /spec/volumes".into()),
            failure_example: Some("Pod shop/api: would fail, and ...: boom".into()),
        };
        let events = events(
            &RuleId::namespaced("shop", "ca"),
            &tally,
            Duration::from_secs(60),
        );
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].0.reason, "AuditWouldChange");
        assert_eq!(events[0].0.type_, EventType::Normal);
        assert_eq!(
            events[0].1,
            "in the last 60s this MutationRule shop/ca (mode Audit) would have changed 37 \
             object(s); nothing was changed. First: Pod shop/web: would change the object: add \
             /spec/volumes. Set spec.mode to Enforce to apply it."
        );
        assert_eq!(events[1].0.reason, "AuditWouldFail");
        assert_eq!(events[1].0.type_, EventType::Warning);
        assert!(events[1].1.contains("would have failed on 2 object(s)"));
        let quiet = Tally::default();
        assert!(super::events(&RuleId::cluster("x"), &quiet, Duration::from_secs(60)).is_empty());
    }

    /// Issue 30, finding 10 (c): 1,000 Audit rules in one namespace published 1,000 Events
    /// a minute there. Now at most `per_namespace`, the last summing up the rest; other
    /// namespaces keep their own bound.
    #[test]
    fn audit_events_are_bounded_per_namespace_and_the_rest_summed_up_in_one() {
        let change = |n: u64| Tally {
            would_change: n,
            change_example: Some("Pod shop/web: would change the object".into()),
            ..Tally::default()
        };
        let mut tallies: Vec<(RuleId, Tally)> = (0..1_000)
            .map(|i| {
                (
                    RuleId::namespaced("shop", &format!("r{i:04}")),
                    change(1 + i % 7),
                )
            })
            .collect();
        tallies.push((
            RuleId::namespaced("shop", "broken"),
            Tally {
                would_fail: 2,
                failure_example: Some("Pod shop/web: boom".into()),
                ..Tally::default()
            },
        ));
        tallies.push((RuleId::namespaced("other", "one"), change(3)));
        tallies.push((RuleId::cluster("everywhere"), change(4)));
        let planned = plan(tallies, Duration::from_secs(60), 20);
        let in_shop: Vec<_> = planned
            .iter()
            .filter(|(rule, ..)| rule.namespace.as_deref() == Some("shop"))
            .collect();
        assert_eq!(in_shop.len(), 20, "at most 20 Events in shop");
        assert_eq!(
            in_shop
                .iter()
                .filter(|(_, e, _)| e.reason == "AuditWouldFail")
                .count(),
            1,
            "the would-fail Event is among those published"
        );
        // The published would-change Events are those of the largest counts (6 and 7).
        assert!(
            in_shop
                .iter()
                .filter(|(_, e, _)| e.reason == "AuditWouldChange")
                .all(|(_, _, note)| note.contains("would have changed 7 object(s)")),
            "{:?}",
            in_shop.iter().map(|(_, _, note)| note).collect::<Vec<_>>()
        );
        let summaries: Vec<_> = in_shop
            .iter()
            .filter(|(_, e, _)| e.reason == "AuditEventsSummarized")
            .collect();
        assert_eq!(summaries.len(), 1);
        let (_, event, note) = summaries[0];
        assert_eq!(
            event.type_,
            EventType::Normal,
            "no left-out rule would fail"
        );
        assert!(
            note.starts_with("in the last 60s, 982 more Audit rule(s) of namespace shop would")
                && note.contains("--max-audit-events-per-namespace")
                && note.contains("more rule(s)")
                && note.contains("initium_rule_audit_changes_total"),
            "{note}"
        );
        assert!(note.chars().count() <= NOTE_MAX, "{}", note.len());
        // The other namespaces, and the cluster rules (in default), are not held back.
        assert!(planned.iter().any(|(r, ..)| r.to_string() == "other/one"));
        assert!(planned.iter().any(|(r, ..)| r.namespace.is_none()));
        assert_eq!(planned.len(), 22);
        // Within the bound nothing changes: one Event per rule and verdict, in rule order.
        let few = vec![
            (RuleId::namespaced("shop", "a"), change(1)),
            (RuleId::namespaced("shop", "b"), change(2)),
        ];
        let planned = plan(few, Duration::from_secs(60), 2);
        assert_eq!(
            planned
                .iter()
                .map(|(r, e, _)| (r.to_string(), e.reason.clone()))
                .collect::<Vec<_>>(),
            [
                ("shop/a".to_string(), "AuditWouldChange".to_string()),
                ("shop/b".to_string(), "AuditWouldChange".to_string())
            ]
        );
    }

    #[test]
    fn each_note_is_an_event_of_its_own_and_the_same_note_a_series() {
        let a = action_for("would have changed 1 object(s). First: Pod shop/a");
        let b = action_for("would have changed 1 object(s). First: Pod shop/b");
        assert_ne!(a, b);
        assert_eq!(
            a,
            action_for("would have changed 1 object(s). First: Pod shop/a")
        );
        assert!(a.starts_with("Audit/") && a.len() <= 128, "{a}");
    }
}
