//! The write: one JSON merge patch per Pod that removes the gates being released (and the
//! `initium.dev/gated` label with the last of them), narrows the node affinity for
//! `daemonSet` dependencies, and carries the resourceVersion the decision was made on. On 409
//! the Pod is read again and the patch worked out anew (a bounded number of times); then the
//! events are queued ([`Events`]).

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::Instant;

use super::state::{GatedPod, Held, PodKey, Reason, Release, release_patch, unlabel_patch};
use crate::controller::vocabulary::FIELD_MANAGER;
use crate::report::report;

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
    fn patch(&self, pod: &GatedPod) -> Option<serde_json::Value> {
        if self.releases.is_empty() {
            return unlabel_patch(pod);
        }
        let remove: Vec<String> = self.releases.iter().map(|r| r.gate.clone()).collect();
        release_patch(pod, &remove, self.nodes.as_ref())
    }
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
    Failed(kube::Error),
}

/// What a release task gives back to the duty.
#[derive(Debug)]
pub(crate) struct Done {
    pub key: PodKey,
    pub plan: Plan,
    pub outcome: Outcome,
}

/// Writes one release (see the module documentation); publishes its events once written.
pub(crate) async fn release(
    client: Client,
    events: Events,
    conflicts: Counter,
    plan: Plan,
) -> Done {
    let key = plan.pod.key.clone();
    let api = Api::<Pod>::namespaced(client, &key.namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let mut view = plan.pod.clone();
    let mut outcome = Outcome::Conflicted;
    for _ in 0..MAX_ATTEMPTS {
        let Some(patch) = plan.patch(&view) else {
            outcome = Outcome::AlreadyReleased {
                at: view.resource_version.clone(),
            };
            break;
        };
        match api.patch(&key.name, &params, &Patch::Merge(&patch)).await {
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
                conflicts.inc();
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
    Done { key, plan, outcome }
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
const EVENTS_IN_FLIGHT: usize = 4;

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
                // Releases first. The duty gone (sender dropped) ends the wait too.
                let _ = writing.wait_for(|writes| *writes == 0).await;
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
