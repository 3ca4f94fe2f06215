//! The `lookups` duty: keeps `shared.lookups`, the objects the Ready rules look up
//! (`spec.lookups`), current through watches, so the webhook reads them from memory.
//!
//! One watch per distinct target of the rules in the index, started when the first Ready rule
//! names it and stopped when the last one stops naming it: a ConfigMap name in one namespace
//! (field selector `metadata.name=<name>`), or in every namespace when a ClusterMutationRule
//! reads the ConfigMap of the admitted object's namespace. So what initium holds is bounded by
//! what the rules reference, never every ConfigMap of the cluster. Each watch runs as its own
//! task and sends its events to the duty, which applies them ([`Objects`], pure and tested)
//! and swaps the store whole. Updates from a watch stopped meanwhile are recognised by their
//! generation and dropped.
//!
//! `/readyz` waits until the watches needed by the first complete rule index have listed once:
//! a replica that has just started does not fail `Fail` rules for want of a ConfigMap it has
//! not read yet. Later, a new target is "not read yet" until its watch lists: the rule fails
//! by its `failurePolicy` with a message saying so, for the moment that takes.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use super::duty::{Context, Duty};
use super::rules::Snapshot;
use super::{ControllerError, Readiness};
use crate::admission::state::Shared;
use crate::engine::{LookupKind, LookupStore, LookupTarget, RuleIndex, TargetObjects};

/// One object as a watch saw it: its namespace, and the object as JSON.
type Seen = (String, Arc<Value>);

/// What a target's watch sends.
#[derive(Debug)]
struct Update {
    target: LookupTarget,
    generation: u64,
    event: watcher::Event<Seen>,
}

/// One watched target: the objects as last listed and changed since, and a relist under way.
#[derive(Debug, Default)]
struct Watched {
    current: Arc<TargetObjects>,
    relisting: Option<HashMap<String, Arc<Value>>>,
}

/// The objects of every watched target, fed by watch events; says when the store must be
/// swapped.
#[derive(Debug, Default)]
struct Objects {
    targets: HashMap<LookupTarget, Watched>,
}

impl Objects {
    /// Watches exactly `needed`: new targets start empty and not synced, targets no rule
    /// reads any more are forgotten. True when the set changed.
    fn retain(&mut self, needed: &BTreeSet<LookupTarget>) -> bool {
        let before = self.targets.len();
        self.targets.retain(|target, _| needed.contains(target));
        let mut changed = self.targets.len() != before;
        for target in needed {
            if !self.targets.contains_key(target) {
                self.targets.insert(target.clone(), Watched::default());
                changed = true;
            }
        }
        changed
    }

    /// Applies one watch event of `target`; true when the objects changed.
    fn apply(&mut self, target: &LookupTarget, event: watcher::Event<Seen>) -> bool {
        let Some(watched) = self.targets.get_mut(target) else {
            return false;
        };
        match event {
            watcher::Event::Init => {
                watched.relisting = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply((namespace, object)) => {
                watched
                    .relisting
                    .get_or_insert_default()
                    .insert(namespace, object);
                false
            }
            watcher::Event::InitDone => {
                let listed = TargetObjects {
                    synced: true,
                    objects: watched.relisting.take().unwrap_or_default(),
                };
                let changed = *watched.current != listed;
                watched.current = Arc::new(listed);
                changed
            }
            watcher::Event::Apply((namespace, object)) => {
                if watched.current.objects.get(&namespace) == Some(&object) {
                    return false;
                }
                Arc::make_mut(&mut watched.current)
                    .objects
                    .insert(namespace, object);
                true
            }
            watcher::Event::Delete((namespace, _)) => {
                if !watched.current.objects.contains_key(&namespace) {
                    return false;
                }
                Arc::make_mut(&mut watched.current)
                    .objects
                    .remove(&namespace);
                true
            }
        }
    }

    /// Whether every target has been listed once.
    fn synced(&self) -> bool {
        self.targets.values().all(|w| w.current.synced)
    }

    /// The store the webhook reads: the objects of each target, shared, not copied.
    fn store(&self) -> LookupStore {
        LookupStore::new(
            self.targets
                .iter()
                .map(|(target, watched)| (target.clone(), Arc::clone(&watched.current)))
                .collect(),
        )
    }
}

/// What the rules of `index` look up, each target once.
fn targets_of(index: &RuleIndex) -> BTreeSet<LookupTarget> {
    index
        .rules()
        .iter()
        .flat_map(|rule| rule.lookup_targets().cloned())
        .collect()
}

/// The running watches, one task each, aborted when no longer needed (or dropped).
struct Watches {
    client: Client,
    tx: mpsc::UnboundedSender<Update>,
    context: Context,
    running: HashMap<LookupTarget, (u64, AbortHandle)>,
    next_generation: u64,
}

impl Watches {
    /// Starts the watches of `needed` that do not run, stops the others.
    fn sync(&mut self, needed: &BTreeSet<LookupTarget>) {
        self.running.retain(|target, (_, handle)| {
            let keep = needed.contains(target);
            if !keep {
                handle.abort();
                tracing::info!(duty = Lookups::NAME, %target, "no Ready rule looks it up any more: its watch stopped");
            }
            keep
        });
        for target in needed {
            if self.running.contains_key(target) {
                continue;
            }
            self.next_generation += 1;
            let generation = self.next_generation;
            let task = tokio::spawn(watch_target(
                self.client.clone(),
                target.clone(),
                generation,
                self.tx.clone(),
                self.context.clone(),
            ));
            tracing::info!(duty = Lookups::NAME, %target, "a Ready rule looks it up: watching it");
            self.running
                .insert(target.clone(), (generation, task.abort_handle()));
        }
    }

    /// Whether `update` comes from a watch that still runs.
    fn is_current(&self, update: &Update) -> bool {
        self.running
            .get(&update.target)
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

/// Watches one target until aborted, sending its events to the duty. Failures are logged
/// and counted; the watch retries with its own backoff.
async fn watch_target(
    client: Client,
    target: LookupTarget,
    generation: u64,
    tx: mpsc::UnboundedSender<Update>,
    context: Context,
) {
    let api: Api<ConfigMap> = match (&target.kind, &target.namespace) {
        (LookupKind::ConfigMap, Some(namespace)) => Api::namespaced(client, namespace),
        (LookupKind::ConfigMap, None) => Api::all(client),
    };
    // The name was checked when the rule compiled (a DNS subdomain): nothing in it can change
    // the selector's meaning.
    let config = watcher::Config::default().fields(&format!("metadata.name={}", target.name));
    let mut events = std::pin::pin!(watcher(api, config).default_backoff());
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => map_event(event),
            Err(e) => {
                let what = format!(
                    "watching {target} for a lookup failed (if it is Forbidden, grant initium get, list and watch on configmaps); rules that read it keep the last value seen, or fail until it is read; retrying with backoff"
                );
                context.watch_failed(&what, &e);
                continue;
            }
        };
        let update = Update {
            target: target.clone(),
            generation,
            event,
        };
        if tx.send(update).is_err() {
            // The duty is gone: this task is about to be aborted.
            return;
        }
    }
}

fn map_event(event: watcher::Event<ConfigMap>) -> watcher::Event<Seen> {
    match event {
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
        watcher::Event::InitApply(c) => watcher::Event::InitApply(seen(c)),
        watcher::Event::Apply(c) => watcher::Event::Apply(seen(c)),
        watcher::Event::Delete(c) => watcher::Event::Delete(seen(c)),
    }
}

/// A ConfigMap as templates see it: JSON, with `apiVersion` and `kind`, without
/// `managedFields` (bookkeeping of no use to a rule, often larger than the data).
fn seen(mut config_map: ConfigMap) -> Seen {
    config_map.metadata.managed_fields = None;
    let namespace = config_map.metadata.namespace.clone().unwrap_or_default();
    let mut value = serde_json::to_value(&config_map).unwrap_or(Value::Null);
    if let Some(object) = value.as_object_mut() {
        object.insert("apiVersion".into(), Value::String("v1".into()));
        object.insert("kind".into(), Value::String("ConfigMap".into()));
    }
    (namespace, Arc::new(value))
}

/// The `lookups` duty (see the module documentation).
pub(crate) struct Lookups {
    client: Client,
    shared: Arc<Shared>,
    readiness: Arc<Readiness>,
    snapshot: watch::Receiver<Arc<Snapshot>>,
    /// A complete rule index has been published (survives a restart of the duty).
    index_seen: bool,
}

impl Lookups {
    pub(crate) fn new(
        client: Client,
        shared: Arc<Shared>,
        readiness: Arc<Readiness>,
        snapshot: watch::Receiver<Arc<Snapshot>>,
    ) -> Lookups {
        Lookups {
            client,
            shared,
            readiness,
            snapshot,
            index_seen: false,
        }
    }
}

impl Duty for Lookups {
    const NAME: &'static str = "lookups";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let (tx, mut updates) = mpsc::unbounded_channel();
        let mut watches = Watches {
            client: self.client.clone(),
            tx,
            context: context.clone(),
            running: HashMap::new(),
            next_generation: 0,
        };
        let mut objects = Objects::default();
        let mut index: Option<Arc<RuleIndex>> = None;
        // The rules duty publishes its snapshot once the index is complete. A restarted duty
        // starts from nothing: it needs the index published already, not only its next change.
        if self.index_seen {
            self.snapshot.mark_changed();
        }
        loop {
            let mut batch = Vec::new();
            let mut rules_changed = false;
            tokio::select! {
                () = context.stop.wait() => return Ok(()),
                changed = self.snapshot.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    rules_changed = true;
                }
                Some(update) = updates.recv() => batch.push(update),
            }
            // Coalesce what is already waiting: a relist swaps the store once.
            while let Ok(update) = updates.try_recv() {
                batch.push(update);
            }
            let mut changed = false;
            if rules_changed {
                self.index_seen = true;
                let current = self.shared.rules.load_full();
                // Status writes change the snapshot too; the index only when rules change.
                if index.as_ref().is_none_or(|i| !Arc::ptr_eq(i, &current)) {
                    let needed = targets_of(&current);
                    watches.sync(&needed);
                    changed |= objects.retain(&needed);
                    index = Some(current);
                }
            }
            for update in batch {
                if watches.is_current(&update) {
                    changed |= objects.apply(&update.target, update.event);
                }
            }
            if changed {
                self.shared.lookups.store(Arc::new(objects.store()));
            }
            if self.index_seen && objects.synced() {
                self.readiness.done(Readiness::LOOKUPS);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use serde_json::json;

    use super::*;

    fn target(namespace: Option<&str>, name: &str) -> LookupTarget {
        LookupTarget {
            kind: LookupKind::ConfigMap,
            namespace: namespace.map(String::from),
            name: name.into(),
        }
    }

    fn config_map(namespace: &str, value: &str) -> Seen {
        (
            namespace.to_string(),
            Arc::new(
                json!({"metadata": {"name": "mirror", "namespace": namespace}, "data": {"registry": value}}),
            ),
        )
    }

    fn value_in(objects: &Objects, target: &LookupTarget, namespace: &str) -> Option<Value> {
        let store = objects.targets.get(target)?;
        store
            .current
            .objects
            .get(namespace)
            .map(|v| v["data"]["registry"].clone())
    }

    #[test]
    fn the_objects_follow_the_watch_and_tell_when_listed() {
        let all = target(None, "mirror");
        let mut objects = Objects::default();
        assert!(objects.retain(&[all.clone()].into()));
        assert!(!objects.synced(), "a new target is not listed yet");
        assert!(!objects.apply(&all, watcher::Event::Init));
        assert!(!objects.apply(&all, watcher::Event::InitApply(config_map("a", "one"))));
        assert!(objects.apply(&all, watcher::Event::InitDone));
        assert!(objects.synced());
        assert_eq!(value_in(&objects, &all, "a"), Some(json!("one")));

        assert!(objects.apply(&all, watcher::Event::Apply(config_map("a", "two"))));
        assert!(
            !objects.apply(&all, watcher::Event::Apply(config_map("a", "two"))),
            "the same object: no swap"
        );
        assert!(objects.apply(&all, watcher::Event::Apply(config_map("b", "three"))));
        assert!(objects.apply(&all, watcher::Event::Delete(config_map("a", ""))));
        assert!(!objects.apply(&all, watcher::Event::Delete(config_map("a", ""))));
        assert_eq!(value_in(&objects, &all, "a"), None);
        assert_eq!(value_in(&objects, &all, "b"), Some(json!("three")));

        // A relist drops what is gone.
        objects.apply(&all, watcher::Event::Init);
        objects.apply(&all, watcher::Event::InitApply(config_map("c", "four")));
        assert!(objects.apply(&all, watcher::Event::InitDone));
        assert_eq!(value_in(&objects, &all, "b"), None);
        assert_eq!(value_in(&objects, &all, "c"), Some(json!("four")));
    }

    #[test]
    fn targets_come_and_go_with_the_rules() {
        let a = target(Some("a"), "mirror");
        let b = target(None, "mirror");
        let mut objects = Objects::default();
        objects.retain(&[a.clone()].into());
        objects.apply(&a, watcher::Event::Init);
        objects.apply(&a, watcher::Event::InitDone);
        assert!(objects.synced());
        assert!(objects.retain(&[a.clone(), b.clone()].into()));
        assert!(!objects.synced(), "the new target is not listed yet");
        assert!(!objects.retain(&[a.clone(), b.clone()].into()));
        assert!(objects.retain(&[b.clone()].into()));
        assert!(
            !objects.apply(&a, watcher::Event::Apply(config_map("a", "x"))),
            "an event of a forgotten target is dropped"
        );
        assert_eq!(objects.store().len(), 1);
    }

    #[test]
    fn a_swapped_store_shares_the_objects_it_did_not_change() {
        let a = target(Some("a"), "one");
        let b = target(Some("b"), "two");
        let mut objects = Objects::default();
        objects.retain(&[a.clone(), b.clone()].into());
        let before = Arc::clone(&objects.targets[&a].current);
        objects.apply(&b, watcher::Event::Apply(config_map("b", "x")));
        assert!(Arc::ptr_eq(&before, &objects.targets[&a].current));
    }

    #[test]
    fn a_config_map_is_seen_with_its_kind_and_without_managed_fields() {
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": "mirror", "namespace": "a",
                         "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
            "data": {"registry": "mirror.local"},
        }))
        .unwrap();
        let (namespace, value) = seen(cm);
        assert_eq!(namespace, "a");
        assert_eq!(
            *value,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "mirror", "namespace": "a"},
                   "data": {"registry": "mirror.local"}})
        );
    }
}
