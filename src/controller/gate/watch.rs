//! The dependency watches: one per kind that some waiting Pod needs (and, for `object`
//! dependencies, one per object named: see [`ObjectRef`]), started when first needed and
//! stopped (aborted) when no waiting Pod needs it any more. Each runs as its own task and
//! sends slim [`Fact`]s to the duty; updates of a watch that was stopped meanwhile are
//! recognised by their generation and dropped.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ApiResource, DynamicObject};
use kube::core::{GroupVersionKind, PartialObjectMeta};
use kube::discovery::Scope;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::state::{Fact, ObjectKind, ObjectRef, Update, WatchKind};
use crate::controller::duty::Context;
use crate::report::report;
use initium_engine::Reads;

/// The label that ties an EndpointSlice to its Service.
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// First retry of discovery for an `object` kind the API server does not serve (yet).
const DISCOVERY_RETRY_FIRST: Duration = Duration::from_secs(5);
/// Longest wait between two discovery attempts for such a kind.
const DISCOVERY_RETRY_MAX: Duration = Duration::from_secs(300);

/// What a dependency watch sends.
#[derive(Debug)]
pub(crate) struct KindUpdate {
    pub kind: WatchKind,
    pub generation: u64,
    pub event: KindEvent,
}

#[derive(Debug)]
pub(crate) enum KindEvent {
    Update(Update),
    /// Discovery resolved an `object` dependency's kind: whether it is namespaced.
    Namespaced(bool),
}

/// The running dependency watches.
pub(crate) struct Watches {
    client: Client,
    tx: mpsc::UnboundedSender<KindUpdate>,
    context: Context,
    running: HashMap<WatchKind, (u64, AbortHandle)>,
    next_generation: u64,
}

impl Watches {
    pub(crate) fn new(
        client: Client,
        tx: mpsc::UnboundedSender<KindUpdate>,
        context: Context,
    ) -> Watches {
        Watches {
            client,
            tx,
            context,
            running: HashMap::new(),
            next_generation: 0,
        }
    }

    /// Starts the watches of `needed` that do not run, stops the ones no longer needed;
    /// returns the kinds stopped (their facts are to be forgotten).
    pub(crate) fn sync(&mut self, needed: &BTreeSet<WatchKind>) -> Vec<WatchKind> {
        let stopped: Vec<WatchKind> = self
            .running
            .keys()
            .filter(|k| !needed.contains(*k))
            .cloned()
            .collect();
        for kind in &stopped {
            if let Some((_, handle)) = self.running.remove(kind) {
                handle.abort();
                tracing::info!(duty = "gates", kind = %kind, "no waiting Pod needs this watch any more: stopped");
            }
        }
        for kind in needed {
            if self.running.contains_key(kind) {
                continue;
            }
            self.next_generation += 1;
            let generation = self.next_generation;
            let task = tokio::spawn(run(
                self.client.clone(),
                kind.clone(),
                generation,
                self.tx.clone(),
                self.context.clone(),
            ));
            tracing::info!(duty = "gates", kind = %kind, "a waiting Pod needs this watch: started");
            self.running
                .insert(kind.clone(), (generation, task.abort_handle()));
        }
        stopped
    }

    /// Whether `update` comes from a watch that still runs.
    pub(crate) fn is_current(&self, update: &KindUpdate) -> bool {
        self.running
            .get(&update.kind)
            .is_some_and(|(generation, _)| *generation == update.generation)
    }
}

impl Drop for Watches {
    fn drop(&mut self) {
        for (_, handle) in self.running.values() {
            handle.abort();
        }
    }
}

/// Runs the watch of one kind until aborted.
async fn run(
    client: Client,
    kind: WatchKind,
    generation: u64,
    tx: mpsc::UnboundedSender<KindUpdate>,
    context: Context,
) {
    let send = {
        let kind = kind.clone();
        let tx = tx.clone();
        move |event: KindEvent| {
            // The duty is gone when this fails: the task is about to be aborted.
            let _ = tx.send(KindUpdate {
                kind: kind.clone(),
                generation,
                event,
            });
        }
    };
    match &kind {
        WatchKind::EndpointSlices => {
            let api = Api::<EndpointSlice>::all(client);
            let config = watcher::Config::default().labels(SERVICE_NAME_LABEL);
            forward(watcher(api, config), &kind, send, &context, slice_fact).await;
        }
        WatchKind::Jobs => {
            let api = Api::<Job>::all(client);
            forward(
                watcher(api, watcher::Config::default()),
                &kind,
                send,
                &context,
                job_fact,
            )
            .await;
        }
        WatchKind::Pods => {
            let api = Api::<Pod>::all(client);
            forward(
                watcher(api, watcher::Config::default()),
                &kind,
                send,
                &context,
                pod_fact,
            )
            .await;
        }
        WatchKind::DaemonSets => {
            let api = Api::<PartialObjectMeta<DaemonSet>>::all(client);
            forward(
                watcher(api, watcher::Config::default()),
                &kind,
                send,
                &context,
                daemon_set_fact,
            )
            .await;
        }
        WatchKind::Object(object) => {
            let (resource, namespaced) = discover(&client, &object.kind, &context).await;
            send(KindEvent::Namespaced(namespaced));
            if object.own_namespace && !namespaced {
                tracing::warn!(
                    duty = "gates",
                    object = %object,
                    "{}",
                    refused_message(object)
                );
                // Parked until no Pod needs it: started again, it would only discover again.
                std::future::pending::<()>().await;
                return;
            }
            // Only the named object: in its namespace when the kind is namespaced.
            let api = if namespaced {
                Api::<DynamicObject>::namespaced_with(client, &object.namespace, &resource)
            } else {
                Api::<DynamicObject>::all_with(client, &resource)
            };
            let config = watcher::Config::default().fields(&name_selector(&object.name));
            let reads = object.reads.clone();
            forward(watcher(api, config), &kind, send, &context, |o| {
                object_fact(o, &reads)
            })
            .await;
        }
    }
}

/// Why a MutationRule's dependency on `object`, whose kind discovery found cluster-scoped, is
/// never watched nor judged, and what to do.
fn refused_message(object: &ObjectRef) -> String {
    format!(
        "a MutationRule's gate in namespace {ns} waits on {kind} {name}, but {api_version} {kind} \
         is cluster-scoped, and a MutationRule may only wait on namespaced objects of its own \
         namespace: initium does not read it and releases no Pod on it (the rule's status says \
         which rule); wait on an object in {ns}, or use a ClusterMutationRule",
        ns = object.namespace,
        kind = object.kind.kind,
        name = object.name,
        api_version = object.kind.api_version,
    )
}

/// The field selector of the object named `name`, with `\`, `,` and `=` escaped as the API
/// server's field selector syntax wants.
fn name_selector(name: &str) -> String {
    let mut selector = String::from("metadata.name=");
    for c in name.chars() {
        if matches!(c, '\\' | ',' | '=') {
            selector.push('\\');
        }
        selector.push(c);
    }
    selector
}

/// Resolves an `object` dependency's kind through discovery, retrying with backoff while the
/// API server does not serve it (a CRD not installed yet): Pods waiting on it keep waiting
/// until their timeout.
async fn discover(client: &Client, kind: &ObjectKind, context: &Context) -> (ApiResource, bool) {
    let (group, version) = match kind.api_version.split_once('/') {
        Some((group, version)) => (group, version),
        None => ("", kind.api_version.as_str()),
    };
    let gvk = GroupVersionKind::gvk(group, version, &kind.kind);
    let mut backoff = context.backoff(DISCOVERY_RETRY_FIRST, DISCOVERY_RETRY_MAX);
    loop {
        match kube::discovery::pinned_kind(client, &gvk).await {
            Ok((resource, capabilities)) => {
                return (resource, matches!(capabilities.scope, Scope::Namespaced));
            }
            Err(e) => {
                let what = format!(
                    "a gate waits on {} {}, which the API server does not serve (or initium may \
                     not discover); Pods waiting on it keep waiting until their timeout; \
                     retrying discovery with backoff",
                    kind.api_version, kind.kind
                );
                let wait = backoff.failed(&what, &report(&e));
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// Forwards a watch's events as facts; errors are logged and counted (the watch retries with
/// its own backoff, so a Forbidden watch does not stop the duty).
async fn forward<K, S>(
    stream: S,
    kind: &WatchKind,
    send: impl Fn(KindEvent),
    context: &Context,
    to_fact: impl Fn(&K) -> Option<Fact>,
) where
    K: Debug,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
{
    let mut events = std::pin::pin!(stream.default_backoff());
    while let Some(event) = events.next().await {
        let update = match event {
            Ok(watcher::Event::Init) => Update::Init,
            Ok(watcher::Event::InitDone) => Update::InitDone,
            Ok(watcher::Event::InitApply(object)) => match to_fact(&object) {
                Some(fact) => Update::InitApply(fact),
                None => continue,
            },
            Ok(watcher::Event::Apply(object)) => match to_fact(&object) {
                Some(fact) => Update::Apply(fact),
                None => continue,
            },
            Ok(watcher::Event::Delete(object)) => match to_fact(&object) {
                Some(fact) => Update::Delete(fact),
                None => continue,
            },
            Err(e) => {
                let what = format!(
                    "watching {kind} for gated Pods failed (if it is Forbidden, grant initium \
                     get, list and watch on it); Pods waiting on it keep waiting until their \
                     timeout; retrying with backoff"
                );
                context.watch_failed(&what, &e);
                continue;
            }
        };
        send(KindEvent::Update(update));
    }
}

fn named(meta: &kube::api::ObjectMeta) -> Option<(String, String)> {
    Some((meta.namespace.clone()?, meta.name.clone()?))
}

fn slice_fact(slice: &EndpointSlice) -> Option<Fact> {
    let (namespace, name) = named(&slice.metadata)?;
    let service = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .cloned();
    let ready = slice
        .endpoints
        .iter()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
        .count();
    Some(Fact::Slice {
        namespace,
        name,
        service,
        ready,
    })
}

fn job_fact(job: &Job) -> Option<Fact> {
    let (namespace, name) = named(&job.metadata)?;
    let status = job.status.as_ref();
    let succeeded = status.and_then(|s| s.succeeded).unwrap_or(0) >= 1
        || status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|conditions| {
                conditions.iter().any(|c| {
                    matches!(c.type_.as_str(), "Complete" | "SuccessCriteriaMet")
                        && c.status == "True"
                })
            });
    Some(Fact::Job {
        namespace,
        name,
        uid: job.metadata.uid.clone().unwrap_or_default(),
        succeeded,
    })
}

fn pod_fact(pod: &Pod) -> Option<Fact> {
    let (namespace, name) = named(&pod.metadata)?;
    let status = pod.status.as_ref();
    let ready = pod.metadata.deletion_timestamp.is_none()
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let daemon_set = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "DaemonSet" && o.controller == Some(true))
        .map(|o| (o.name.clone(), o.uid.clone()));
    Some(Fact::Pod {
        namespace,
        name,
        ready,
        // Only Ready Pods are kept: a Pod that is not costs nothing beyond this.
        labels: if ready {
            pod.metadata.labels.clone().unwrap_or_default()
        } else {
            Default::default()
        },
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        daemon_set,
    })
}

fn daemon_set_fact(ds: &PartialObjectMeta<DaemonSet>) -> Option<Fact> {
    let (namespace, name) = named(&ds.metadata)?;
    Some(Fact::DaemonSet {
        namespace,
        name,
        uid: ds.metadata.uid.clone().unwrap_or_default(),
    })
}

/// The object reduced to what the dependency's conditions read (and never its managedFields):
/// what initium keeps is what the rule's author asked about, however large the object.
fn object_fact(object: &DynamicObject, reads: &Reads) -> Option<Fact> {
    let mut value = serde_json::to_value(object).ok()?;
    if let Some(meta) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        meta.remove("managedFields");
    }
    reads.keep(&mut value);
    Some(Fact::Object {
        namespace: object.metadata.namespace.clone(),
        name: object.metadata.name.clone()?,
        value: Arc::new(value),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn an_object_watch_selects_its_name_escaped() {
        assert_eq!(name_selector("settings"), "metadata.name=settings");
        assert_eq!(name_selector(r"a,b=c\d"), r"metadata.name=a\,b\=c\\d");
    }

    #[test]
    fn a_slice_counts_endpoints_not_marked_unready() {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "db-abc", "namespace": "a", "labels": {SERVICE_NAME_LABEL: "db"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": false}},
                {"addresses": ["10.0.0.3"], "conditions": {}},
                {"addresses": ["10.0.0.4"]},
            ],
        }))
        .unwrap();
        assert_eq!(
            slice_fact(&slice),
            Some(Fact::Slice {
                namespace: "a".into(),
                name: "db-abc".into(),
                service: Some("db".into()),
                ready: 3
            })
        );
    }

    #[test]
    fn a_job_succeeded_by_count_or_condition() {
        let job = |status: serde_json::Value| -> Job {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "init", "namespace": "a", "uid": "u1"},
                "status": status,
            }))
            .unwrap()
        };
        let succeeded = |j: &Job| match job_fact(j) {
            Some(Fact::Job { succeeded, .. }) => succeeded,
            other => panic!("{other:?}"),
        };
        assert!(!succeeded(&job(serde_json::json!({"active": 1}))));
        assert!(succeeded(&job(serde_json::json!({"succeeded": 1}))));
        assert!(succeeded(&job(serde_json::json!({
            "conditions": [{"type": "SuccessCriteriaMet", "status": "True"}]
        }))));
        assert!(!succeeded(&job(serde_json::json!({
            "conditions": [{"type": "Complete", "status": "False"}]
        }))));
    }

    #[test]
    fn a_pod_fact_says_ready_node_and_daemon_set_owner() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "agent-x", "namespace": "infra", "labels": {"app": "agent"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent",
                    "uid": "ds-1", "controller": true}]},
            "spec": {"nodeName": "n1", "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap();
        let Some(Fact::Pod {
            ready,
            node,
            daemon_set,
            labels,
            ..
        }) = pod_fact(&pod)
        else {
            panic!("a fact")
        };
        assert!(ready);
        assert_eq!(node.as_deref(), Some("n1"));
        assert_eq!(daemon_set, Some(("agent".into(), "ds-1".into())));
        assert_eq!(labels.get("app").map(String::as_str), Some("agent"));
    }
}
