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
use crate::api::API_VERSION;
use crate::engine::RuleId;

use super::ControllerError;
use super::duty::{Context, Duty};
use super::rules::Snapshot;

/// Default `--audit-report-interval`.
pub const DEFAULT_AUDIT_REPORT_INTERVAL: Duration = Duration::from_secs(60);

/// Longest Event note the API server takes (1 KiB).
const NOTE_MAX: usize = 1000;

pub(crate) struct Audit {
    client: kube::Client,
    shared: Arc<Shared>,
    snapshot: watch::Receiver<Arc<Snapshot>>,
    identity: String,
    interval: Duration,
}

impl Audit {
    pub(crate) fn new(
        client: kube::Client,
        shared: Arc<Shared>,
        snapshot: watch::Receiver<Arc<Snapshot>>,
        identity: String,
        interval: Duration,
    ) -> Audit {
        Audit {
            client,
            shared,
            snapshot,
            identity,
            interval,
        }
    }
}

impl Duty for Audit {
    const NAME: &'static str = "audit";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: super::FIELD_MANAGER.into(),
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
                for (rule, tally) in tallies {
                    // A rule deleted since has nothing to hold the Event.
                    let Some(view) = snapshot.rules.iter().find(|v| v.id == rule) else {
                        continue;
                    };
                    for (event, note) in events(&rule, &tally, self.interval) {
                        publish(&recorder, &rule, view.uid.clone(), event, note, &context).await;
                    }
                }
            }
            if stopping {
                return Ok(());
            }
        }
    }
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

async fn publish(
    recorder: &Recorder,
    rule: &RuleId,
    uid: Option<String>,
    mut event: Event,
    mut note: String,
    context: &Context,
) {
    if let Some((at, _)) = note.char_indices().nth(NOTE_MAX) {
        note.truncate(at);
        note.push('…');
    }
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
            &format!("{}: {}", rule.describe(), crate::report(&error)),
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
}
