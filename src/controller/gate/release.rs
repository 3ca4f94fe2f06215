//! The write: one JSON merge patch per Pod that removes the gates being released (and the
//! `initium.dev/gated` label with the last of them), narrows the node affinity for
//! `daemonSet` dependencies, and carries the resourceVersion the decision was made on. On 409
//! the Pod is read again and the patch worked out anew (a bounded number of times); then the
//! events are queued ([`Events`]).

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference, Pod,
};
use kube::api::{Patch, PatchParams, ValidationDirective};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::Instant;

use super::state::{GatedPod, Held, PodKey, Reason, Release};
use crate::controller::vocabulary::FIELD_MANAGER;
use crate::report::report;
use initium_engine::api::{GATE_PREFIX, GATED_LABEL};

/// Attempts per release: the first write and up to four after a 409.
pub(crate) const MAX_ATTEMPTS: u32 = 5;
/// Longest event note the API server takes (1 kB), with room to spare.
const NOTE_MAX: usize = 1000;

/// One Pod's release, as decided.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// The Pod as the decision saw it (its resourceVersion is the precondition).
    pub pod: GatedPod,
    /// The gates to remove; empty: only drop a left-over `initium.dev/gated` label.
    pub releases: Vec<Release>,
    /// Narrow the required node affinity to these nodes.
    pub nodes: Option<BTreeSet<String>>,
    /// When the watch event that made the last dependency ready arrived (or leadership was
    /// gained, if later): the start of `initium_gate_release_latency_seconds`.
    pub trigger: Option<Instant>,
}

impl Plan {
    /// The merge patch of this release over `pod` as last seen; `None`: nothing left to write.
    fn patch(&self, pod: &GatedPod) -> Option<Value> {
        if self.releases.is_empty() {
            return unlabel_patch(pod);
        }
        let remove: Vec<String> = self.releases.iter().map(|r| r.gate.clone()).collect();
        release_patch(pod, &remove, self.nodes.as_ref())
    }
}

/// The merge patch that removes `remove` from the Pod as `pod` shows it, or `None` when
/// none of them is on it any more (someone released them already). It carries the
/// resourceVersion (a stale view gets 409), keeps every other gate in order, drops the
/// `initium.dev/gated` label once no initium gate remains, and narrows the required node
/// affinity to `nodes` (see [`narrow`]).
fn release_patch(
    pod: &GatedPod,
    remove: &[String],
    nodes: Option<&BTreeSet<String>>,
) -> Option<Value> {
    if !pod.gates.iter().any(|g| remove.contains(g)) {
        return None;
    }
    let remaining: Vec<&String> = pod.gates.iter().filter(|g| !remove.contains(g)).collect();
    let mut metadata = json!({"resourceVersion": pod.resource_version});
    if pod.labeled && !remaining.iter().any(|g| g.starts_with(GATE_PREFIX)) {
        metadata["labels"] = json!({ GATED_LABEL: null });
    }
    let gates = if remaining.is_empty() {
        Value::Null
    } else {
        remaining.iter().map(|g| json!({"name": g})).collect()
    };
    let mut spec = json!({"schedulingGates": gates});
    if let Some(nodes) = nodes {
        let narrowed = narrow(pod.node_affinity.clone(), nodes);
        spec["affinity"] = json!({"nodeAffinity": narrowed});
    }
    Some(json!({"metadata": metadata, "spec": spec}))
}

/// A patch that only drops the `initium.dev/gated` label from a Pod that has no initium gate
/// left (someone else removed it), so it leaves the watch.
fn unlabel_patch(pod: &GatedPod) -> Option<Value> {
    (pod.labeled && pod.initium_gates().next().is_none()).then(|| {
        json!({"metadata": {"resourceVersion": pod.resource_version, "labels": {GATED_LABEL: null}}})
    })
}

/// `affinity` with its required terms narrowed to `nodes`: one term
/// `matchFields: metadata.name In nodes` when there is none, else that requirement added to
/// every term (terms are ORed, so each must carry it). Everything else is kept; for a gated
/// Pod the API server allows exactly such additions.
fn narrow(affinity: Option<NodeAffinity>, nodes: &BTreeSet<String>) -> NodeAffinity {
    let requirement = NodeSelectorRequirement {
        key: "metadata.name".into(),
        operator: "In".into(),
        values: Some(nodes.iter().cloned().collect()),
    };
    let mut affinity = affinity.unwrap_or_default();
    let required = affinity
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(NodeSelector::default);
    if required.node_selector_terms.is_empty() {
        required.node_selector_terms.push(NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(vec![requirement]),
        });
    } else {
        for term in &mut required.node_selector_terms {
            term.match_fields
                .get_or_insert_with(Vec::new)
                .push(requirement.clone());
        }
    }
    affinity
}

/// How a release ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Written over this resourceVersion.
    Released {
        over: String,
    },
    /// The Pod no longer has the gates (released by an earlier write, perhaps by another
    /// replica); seen at this resourceVersion.
    AlreadyReleased {
        at: String,
    },
    /// The Pod is gone (404, or another Pod under the same name).
    Gone,
    /// Every attempt met a 409.
    Conflicted,
    /// Not written: this replica lost the Lease while the release waited for a write slot.
    NotLeading,
    Failed(kube::Error),
}

/// What a release task gives back to the duty.
#[derive(Debug)]
pub(crate) struct Done {
    pub key: PodKey,
    pub plan: Plan,
    pub outcome: Outcome,
    /// 409s met on the way (`initium_gate_write_conflicts_total`).
    pub conflicts: u32,
}

/// Writes one release (see the module documentation); publishes its events once written.
pub(crate) async fn release(client: Client, events: Events, plan: Plan) -> Done {
    let key = plan.pod.key.clone();
    let api = Api::<Pod>::namespaced(client, &key.namespace);
    // initium writes only fields it knows (`fieldValidation=Ignore`: the API server does not
    // decode the patched Pod a second, strict time to look for unknown or duplicate fields),
    // and reads back only the metadata (`patch_metadata` sends the same patch, with
    // `Accept: ...;as=PartialObjectMetadata`): the API server encodes, and initium decodes,
    // a fraction of the Pod it would otherwise send back, on every release of a wave.
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        field_validation: Some(ValidationDirective::Ignore),
        ..PatchParams::default()
    };
    let mut view = plan.pod.clone();
    let mut outcome = Outcome::Conflicted;
    let mut conflicts = 0;
    for _ in 0..MAX_ATTEMPTS {
        let Some(patch) = plan.patch(&view) else {
            outcome = Outcome::AlreadyReleased {
                at: view.resource_version.clone(),
            };
            break;
        };
        match api
            .patch_metadata(&key.name, &params, &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                outcome = Outcome::Released {
                    over: view.resource_version.clone(),
                };
                break;
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {
                outcome = Outcome::Gone;
                break;
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                conflicts += 1;
                match api.get(&key.name).await {
                    Ok(pod) => match GatedPod::of(&pod) {
                        Some(fresh) if fresh.uid == plan.pod.uid => view = fresh,
                        _ => {
                            outcome = Outcome::Gone;
                            break;
                        }
                    },
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        outcome = Outcome::Gone;
                        break;
                    }
                    Err(e) => {
                        outcome = Outcome::Failed(e);
                        break;
                    }
                }
            }
            Err(e) => {
                outcome = Outcome::Failed(e);
                break;
            }
        }
    }
    if matches!(outcome, Outcome::Released { .. }) {
        events.released(&plan);
    }
    Done {
        key,
        plan,
        outcome,
        conflicts,
    }
}

/// Events go out after the writes, from a queue of their own, a few at a time and only while
/// no release write is in flight: a wave of releases does not share the API server with an
/// Event per Pod, and an Event that cannot be written is only logged. Events still queued
/// when the process dies are lost; the releases are not.
#[derive(Clone)]
pub(crate) struct Events {
    queue: mpsc::Sender<EventJob>,
}

/// Events queued at most; more are dropped (and logged) rather than held in memory.
const EVENT_QUEUE: usize = 10_000;
/// Events written at once.
const EVENTS_IN_FLIGHT: usize = 2;
/// How long no release write must have been in flight before Events are written: a wave's
/// writes start and end in bursts as its Pods' decisions arrive, and an Event between two
/// bursts takes the API server from the next.
const EVENTS_AFTER_QUIET: std::time::Duration = std::time::Duration::from_secs(1);
/// The longest an Event waits for a quiet moment: releases that never stop (or a release the
/// watch never shows) delay Events, never lose them.
const EVENTS_WAIT_AT_MOST: std::time::Duration = std::time::Duration::from_secs(10);

enum EventJob {
    Released {
        pod: GatedPod,
        type_: EventType,
        reason: &'static str,
        note: String,
    },
    Held {
        pod: GatedPod,
        held: Held,
    },
}

impl Events {
    /// Starts the publisher; it ends when the last handle is dropped.
    pub(crate) fn start(recorder: Recorder, mut writing: watch::Receiver<usize>) -> Events {
        let (queue, mut jobs) = mpsc::channel::<EventJob>(EVENT_QUEUE);
        tokio::spawn(async move {
            let slots = Arc::new(Semaphore::new(EVENTS_IN_FLIGHT));
            while let Some(job) = jobs.recv().await {
                // Releases first: while a release is being written or not yet seen by the
                // watch, wait until none has been for EVENTS_AFTER_QUIET, at most
                // EVENTS_WAIT_AT_MOST. The duty gone (sender dropped) ends the wait too.
                let quiet = async {
                    while *writing.borrow() != 0 {
                        if writing.wait_for(|writes| *writes == 0).await.is_err() {
                            break;
                        }
                        match tokio::time::timeout(
                            EVENTS_AFTER_QUIET,
                            writing.wait_for(|writes| *writes != 0),
                        )
                        .await
                        {
                            Ok(Ok(_)) => continue,
                            Ok(Err(_)) | Err(_) => break,
                        }
                    }
                };
                let _ = tokio::time::timeout(EVENTS_WAIT_AT_MOST, quiet).await;
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    break;
                };
                let recorder = recorder.clone();
                tokio::spawn(async move {
                    match job {
                        EventJob::Released {
                            pod,
                            type_,
                            reason,
                            note,
                        } => publish(&recorder, &pod, type_, reason, "ReleaseGate", note).await,
                        EventJob::Held { pod, held } => publish_held(&recorder, pod, held).await,
                    }
                    drop(slot);
                });
            }
        });
        Events { queue }
    }

    /// Queues the Events of a release that was written.
    fn released(&self, plan: &Plan) {
        for release in &plan.releases {
            let (type_, reason) = match release.reason {
                Reason::Ready => (EventType::Normal, "GateReleased"),
                Reason::Timeout => (EventType::Warning, "GateTimedOut"),
                Reason::RuleGone => (EventType::Normal, "GateRuleGone"),
            };
            let note = released_note(release, plan.nodes.as_ref());
            self.send(EventJob::Released {
                pod: plan.pod.clone(),
                type_,
                reason,
                note,
            });
        }
    }

    /// Queues the `GateTimedOut` Event of a gate held by `onTimeout: Hold`.
    pub(crate) fn held(&self, pod: GatedPod, held: Held) {
        self.send(EventJob::Held { pod, held });
    }

    fn send(&self, job: EventJob) {
        if let Err(error) = self.queue.try_send(job) {
            let pod = match error.into_inner() {
                EventJob::Released { pod, .. } | EventJob::Held { pod, .. } => pod.key,
            };
            tracing::warn!(
                duty = "gates",
                %pod,
                "an Event on the Pod was dropped: {EVENT_QUEUE} are waiting to be written already"
            );
        }
    }
}

/// Publishes the `GateTimedOut` event of a gate held by `onTimeout: Hold`.
async fn publish_held(recorder: &Recorder, pod: GatedPod, held: Held) {
    let note = format!(
        "the scheduling gate {} of {} timed out after {} still waiting for {}; the Pod stays \
         gated until they are ready (onTimeout: Hold)",
        held.gate,
        held.rule.describe(),
        seconds(held.timeout),
        held.pending.join(", "),
    );
    publish(
        recorder,
        &pod,
        EventType::Warning,
        "GateTimedOut",
        "HoldGate",
        note,
    )
    .await;
}

/// The note of a release's event.
pub(crate) fn released_note(release: &Release, nodes: Option<&BTreeSet<String>>) -> String {
    let rule = release
        .rule
        .as_ref()
        .map_or_else(String::new, |r| format!(" of {}", r.describe()));
    match release.reason {
        Reason::Ready => {
            let mut note = format!(
                "released the scheduling gate {}{rule}: ready: {}",
                release.gate,
                release.dependencies.join(", ")
            );
            if let Some(nodes) = nodes {
                let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
                note.push_str(&format!(
                    "; the Pod may run only on nodes where its DaemonSets are Ready: {}",
                    nodes.join(", ")
                ));
            }
            note
        }
        Reason::Timeout => format!(
            "the scheduling gate {}{rule} timed out after {} still waiting for {}; released \
             as the rule says (onTimeout: Release)",
            release.gate,
            release.timeout.map_or_else(String::new, seconds),
            release.dependencies.join(", ")
        ),
        Reason::RuleGone => format!(
            "released the scheduling gate {}: no Ready rule has it any more (its rule was \
             deleted, or is not Ready)",
            release.gate
        ),
    }
}

fn seconds(d: std::time::Duration) -> String {
    format!("{}s", d.as_secs())
}

/// Publishes an event on the Pod; a failure is logged, never fatal.
async fn publish(
    recorder: &Recorder,
    pod: &GatedPod,
    type_: EventType,
    reason: &str,
    action: &str,
    mut note: String,
) {
    if let Some((at, _)) = note.char_indices().nth(NOTE_MAX) {
        note.truncate(at);
        note.push('…');
    }
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(pod.key.namespace.clone()),
        name: Some(pod.key.name.clone()),
        uid: Some(pod.uid.clone()),
        ..ObjectReference::default()
    };
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: action.into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, &reference).await {
        tracing::warn!(
            duty = "gates",
            pod = %pod.key,
            reason,
            error = %report(&error),
            "publishing an event on the Pod failed; the gate itself is not affected"
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PreferredSchedulingTerm;

    fn pod(name: &str, gates: &[&str]) -> GatedPod {
        GatedPod {
            key: PodKey {
                namespace: "shop".into(),
                name: name.into(),
            },
            uid: format!("uid-{name}"),
            resource_version: "10".into(),
            created: None,
            gates: gates.iter().map(|g| g.to_string()).collect(),
            labeled: true,
            node_affinity: None,
        }
    }

    #[test]
    fn the_release_patch_keeps_foreign_gates_in_order_and_drops_the_label_with_the_last_gate() {
        let p = pod(
            "web-1",
            &[
                "example.com/a",
                "initium.dev/shop.x",
                "example.com/b",
                "initium.dev/cluster.y",
            ],
        );
        let one = release_patch(&p, &["initium.dev/shop.x".into()], None).unwrap();
        assert_eq!(
            one,
            json!({
                "metadata": {"resourceVersion": "10"},
                "spec": {"schedulingGates": [
                    {"name": "example.com/a"}, {"name": "example.com/b"}, {"name": "initium.dev/cluster.y"}
                ]},
            }),
            "an initium gate remains: the label stays"
        );
        let both = release_patch(
            &p,
            &["initium.dev/shop.x".into(), "initium.dev/cluster.y".into()],
            None,
        )
        .unwrap();
        assert_eq!(
            both,
            json!({
                "metadata": {"resourceVersion": "10", "labels": {GATED_LABEL: null}},
                "spec": {"schedulingGates": [{"name": "example.com/a"}, {"name": "example.com/b"}]},
            })
        );
        let only = pod("web-2", &["initium.dev/shop.x"]);
        assert_eq!(
            release_patch(&only, &["initium.dev/shop.x".into()], None).unwrap(),
            json!({
                "metadata": {"resourceVersion": "10", "labels": {GATED_LABEL: null}},
                "spec": {"schedulingGates": null},
            })
        );
        assert_eq!(
            release_patch(&p, &["initium.dev/shop.gone".into()], None),
            None,
            "already released: nothing to write"
        );
        assert_eq!(unlabel_patch(&p), None);
        assert_eq!(
            unlabel_patch(&pod("web-3", &["example.com/a"])),
            Some(json!({"metadata": {"resourceVersion": "10", "labels": {GATED_LABEL: null}}}))
        );
    }

    #[test]
    fn narrowing_adds_one_term_when_there_is_none_and_extends_every_term_otherwise() {
        let nodes = BTreeSet::from(["n1".to_string(), "n2".to_string()]);
        let mut p = pod("web-1", &["initium.dev/cluster.same-node"]);
        let patch = release_patch(&p, &p.gates.clone(), Some(&nodes)).unwrap();
        assert_eq!(
            patch["spec"]["affinity"],
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": ["n1", "n2"]}
                ]}]
            }}})
        );

        let affinity: NodeAffinity = serde_json::from_value(json!({
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}],
                 "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}]},
            ]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "ssd", "operator": "Exists"}]}}
            ],
        }))
        .unwrap();
        p.node_affinity = Some(affinity.clone());
        let patch = release_patch(&p, &p.gates.clone(), Some(&nodes)).unwrap();
        let narrowed: NodeAffinity =
            serde_json::from_value(patch["spec"]["affinity"]["nodeAffinity"].clone()).unwrap();
        let terms = &narrowed
            .required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap()
            .node_selector_terms;
        let original = &affinity
            .required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap()
            .node_selector_terms;
        assert_eq!(terms.len(), 2, "no term added");
        let wanted = NodeSelectorRequirement {
            key: "metadata.name".into(),
            operator: "In".into(),
            values: Some(vec!["n1".into(), "n2".into()]),
        };
        for (term, before) in terms.iter().zip(original) {
            assert_eq!(term.match_expressions, before.match_expressions);
            let fields = term.match_fields.as_deref().unwrap();
            assert_eq!(fields.last(), Some(&wanted), "added to every term");
            assert_eq!(
                &fields[..fields.len() - 1],
                before.match_fields.as_deref().unwrap_or_default(),
                "what was there stays, first"
            );
        }
        let preferred: Option<Vec<PreferredSchedulingTerm>> =
            narrowed.preferred_during_scheduling_ignored_during_execution;
        assert_eq!(
            preferred, affinity.preferred_during_scheduling_ignored_during_execution,
            "the whole nodeAffinity is sent (a merge patch replaces lists), so the rest is kept"
        );
    }
}
