//! The `lookups` duty: keeps `shared.lookups`, the objects the Ready rules look up
//! (`spec.lookups`), current through watches, so the webhook reads them from memory.
//!
//! One watch per [`LookupScope`] of the rules in the index: per namespace rules look up in,
//! and one across every namespace for the lookups of ClusterMutationRules that read the
//! admitted object's own namespace. Not one per ConfigMap name: each watch is a request the
//! API server keeps open, and initium's client speaks HTTP/1.1 to it (kube's connector
//! offers no HTTP/2), so each watch is also a TCP and TLS connection of its own; 750 rules
//! of 8 lookups held 6,021 of them (issue 30, finding 7). A watch of a scope receives every
//! ConfigMap of it and keeps only those whose names rules read, dropping the others as they
//! arrive (with a single name, the API server selects it: `metadata.name=<name>`), and lists
//! in pages of [`LIST_PAGE_SIZE`]. So what initium holds is bounded by what the rules
//! reference, never every ConfigMap of a namespace or of the cluster, and the number of
//! watches by the namespaces looked up in, plus one.
//!
//! A watch starts when the first Ready rule reads its scope and stops when the last one no
//! longer does. When rules start to read a name its watch does not keep, the watch is started
//! again (one list of the scope); until the new one has listed, the names read before keep
//! their objects and the new name is "not read yet". Each watch runs as its own task and
//! sends its events to the duty, which applies them ([`Objects`], pure and tested) and swaps
//! the store whole. Updates from a watch stopped meanwhile are recognised by their generation
//! and dropped.
//!
//! `/readyz` waits until the watches needed by the first complete rule index have listed once:
//! a replica that has just started does not fail `Fail` rules for want of a ConfigMap it has
//! not read yet. Later, a new name is "not read yet" until its watch lists: the rule fails
//! by its `failurePolicy` with a message saying so, for the moment that takes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
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
use super::vocabulary::{ControllerError, Readiness};
use crate::admission::state::Shared;
use initium_engine::{LookupKind, LookupScope, LookupStore, RuleIndex, ScopeObjects};

/// Objects per page when a watch lists its scope. A ConfigMap may hold up to 1 MiB, and a
/// page is read whole before the names rules do not read are dropped: 50 keeps a list of
/// the largest ConfigMaps to about 50 MiB at a time (client-go's default, 500, could take
/// half a gigabyte), at the price of one request per 50 ConfigMaps when a watch starts.
pub const LIST_PAGE_SIZE: u32 = 50;

/// One object as a watch saw it: its name, its namespace, and the object as JSON.
type Seen = (String, String, Arc<Value>);

/// The objects of one scope by name, then namespace.
type ByName = HashMap<String, HashMap<String, Arc<Value>>>;

/// What a scope's watch sends.
#[derive(Debug)]
struct Update {
    scope: LookupScope,
    generation: u64,
    event: watcher::Event<Seen>,
}

/// One watched scope: the names rules read there, the objects as last listed and changed
/// since, and a relist under way.
#[derive(Debug, Default)]
struct Watched {
    wanted: BTreeSet<String>,
    current: Arc<ScopeObjects>,
    relisting: Option<ByName>,
}

/// The objects of every watched scope, fed by watch events; says when the store must be
/// swapped.
#[derive(Debug, Default)]
struct Objects {
    scopes: HashMap<LookupScope, Watched>,
}

impl Objects {
    /// Keeps exactly the names of `needed`: new scopes start empty and not listed, scopes no
    /// rule reads any more are forgotten, and so are the objects of names no rule reads any
    /// more. True when the store changed.
    fn retain(&mut self, needed: &BTreeMap<LookupScope, BTreeSet<String>>) -> bool {
        let before = self.scopes.len();
        self.scopes.retain(|scope, _| needed.contains_key(scope));
        let mut changed = self.scopes.len() != before;
        for (scope, names) in needed {
            let watched = self.scopes.entry(scope.clone()).or_insert_with(|| {
                changed = true;
                Watched::default()
            });
            if watched.wanted == *names {
                continue;
            }
            watched.wanted = names.clone();
            let current = &watched.current;
            let stale = current.listed.iter().any(|n| !names.contains(n))
                || current.objects.keys().any(|n| !names.contains(n));
            if stale {
                let current = Arc::make_mut(&mut watched.current);
                current.listed.retain(|n| names.contains(n));
                current.objects.retain(|n, _| names.contains(n));
                changed = true;
            }
        }
        changed
    }

    /// Applies one event of the watch of `scope`, which keeps `watching` (the names it was
    /// started for that rules still read); true when the store changed.
    fn apply(
        &mut self,
        scope: &LookupScope,
        watching: &BTreeSet<String>,
        event: watcher::Event<Seen>,
    ) -> bool {
        let Some(watched) = self.scopes.get_mut(scope) else {
            return false;
        };
        match event {
            watcher::Event::Init => {
                watched.relisting = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply((name, namespace, object)) => {
                if watched.wanted.contains(&name) {
                    watched
                        .relisting
                        .get_or_insert_default()
                        .entry(name)
                        .or_default()
                        .insert(namespace, object);
                }
                false
            }
            watcher::Event::InitDone => {
                let mut objects = watched.relisting.take().unwrap_or_default();
                objects.retain(|name, _| watched.wanted.contains(name));
                let listed = ScopeObjects {
                    listed: watching.intersection(&watched.wanted).cloned().collect(),
                    objects,
                };
                let changed = *watched.current != listed;
                watched.current = Arc::new(listed);
                changed
            }
            watcher::Event::Apply((name, namespace, object)) => {
                if !watched.current.listed.contains(&name) {
                    return false;
                }
                let same = watched
                    .current
                    .objects
                    .get(&name)
                    .and_then(|by_namespace| by_namespace.get(&namespace))
                    == Some(&object);
                if same {
                    return false;
                }
                Arc::make_mut(&mut watched.current)
                    .objects
                    .entry(name)
                    .or_default()
                    .insert(namespace, object);
                true
            }
            watcher::Event::Delete((name, namespace, _)) => {
                let present = watched
                    .current
                    .objects
                    .get(&name)
                    .is_some_and(|by_namespace| by_namespace.contains_key(&namespace));
                if !present {
                    return false;
                }
                let objects = &mut Arc::make_mut(&mut watched.current).objects;
                if let Some(by_namespace) = objects.get_mut(&name) {
                    by_namespace.remove(&namespace);
                    if by_namespace.is_empty() {
                        objects.remove(&name);
                    }
                }
                true
            }
        }
    }

    /// Whether every name rules read has been listed by its scope's watch.
    fn synced(&self) -> bool {
        self.scopes
            .values()
            .all(|w| w.wanted.is_subset(&w.current.listed))
    }

    /// How many objects are kept.
    fn count(&self) -> usize {
        self.scopes.values().map(|w| w.current.count()).sum()
    }

    /// The store the webhook reads: the objects of each scope, shared, not copied.
    fn store(&self) -> LookupStore {
        LookupStore::new(
            self.scopes
                .iter()
                .map(|(scope, watched)| (scope.clone(), Arc::clone(&watched.current)))
                .collect(),
        )
    }
}

/// What the rules of `index` look up: the names read in each scope.
fn needed_by(index: &RuleIndex) -> BTreeMap<LookupScope, BTreeSet<String>> {
    let mut needed: BTreeMap<LookupScope, BTreeSet<String>> = BTreeMap::new();
    for target in index.rules().iter().flat_map(|rule| rule.lookup_targets()) {
        needed
            .entry(target.scope())
            .or_default()
            .insert(target.name.clone());
    }
    needed
}

/// A running watch: its generation, the names it keeps that rules still read, its task.
struct Running {
    generation: u64,
    names: BTreeSet<String>,
    handle: AbortHandle,
}

/// What [`Watches::plan`] decides for one scope.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    /// Running, and it keeps every name rules read there.
    Keep,
    /// Not running yet: start it.
    Start,
    /// Running, but without a name rules read now: start it again with them all.
    Restart,
}

/// The running watches, one task each, aborted when no longer needed (or dropped).
struct Watches {
    client: Client,
    tx: mpsc::UnboundedSender<Update>,
    context: Context,
    running: HashMap<LookupScope, Running>,
    next_generation: u64,
}

impl Watches {
    /// What to do for `scope`, whose rules read `names`.
    fn plan(running: Option<&BTreeSet<String>>, names: &BTreeSet<String>) -> Plan {
        match running {
            None => Plan::Start,
            Some(running) if names.is_subset(running) => Plan::Keep,
            Some(_) => Plan::Restart,
        }
    }

    /// Starts the watches of `needed` that do not run or miss a name, stops the others.
    fn sync(&mut self, needed: &BTreeMap<LookupScope, BTreeSet<String>>) {
        self.running.retain(|scope, running| {
            let keep = needed.contains_key(scope);
            if !keep {
                running.handle.abort();
                tracing::info!(duty = Lookups::NAME, %scope, "no Ready rule looks up there any more: its watch stopped");
            }
            keep
        });
        for (scope, names) in needed {
            let plan = Self::plan(self.running.get(scope).map(|r| &r.names), names);
            if plan == Plan::Keep {
                // A name no rule reads any more is forgotten here too: if rules read it
                // again, the watch lists again.
                if let Some(running) = self.running.get_mut(scope) {
                    running.names = names.clone();
                }
                continue;
            }
            if let Some(old) = self.running.remove(scope) {
                old.handle.abort();
            }
            self.next_generation += 1;
            let generation = self.next_generation;
            let task = tokio::spawn(watch_scope(
                self.client.clone(),
                scope.clone(),
                names.clone(),
                generation,
                self.tx.clone(),
                self.context.clone(),
            ));
            tracing::info!(duty = Lookups::NAME, %scope, names = names.len(), restarted = (plan == Plan::Restart), "Ready rules look up there: watching");
            self.running.insert(
                scope.clone(),
                Running {
                    generation,
                    names: names.clone(),
                    handle: task.abort_handle(),
                },
            );
        }
    }

    /// The names the watch that sent `update` keeps, if it still runs.
    fn watching(&self, update: &Update) -> Option<&BTreeSet<String>> {
        self.running
            .get(&update.scope)
            .filter(|running| running.generation == update.generation)
            .map(|running| &running.names)
    }
}

impl Drop for Watches {
    fn drop(&mut self) {
        for running in self.running.values() {
            running.handle.abort();
        }
    }
}

/// How a scope's watch asks the API server: the whole scope in pages, or the one name.
fn watch_config(names: &BTreeSet<String>) -> watcher::Config {
    let config = watcher::Config::default().page_size(LIST_PAGE_SIZE);
    match names.first() {
        // The name was checked when the rule compiled (a DNS subdomain): nothing in it can
        // change the selector's meaning.
        Some(name) if names.len() == 1 => config.fields(&format!("metadata.name={name}")),
        _ => config,
    }
}

/// Watches one scope until aborted, sending the events of the objects named `names` to the
/// duty and dropping the others. Failures are logged and counted; the watch retries with its
/// own backoff.
async fn watch_scope(
    client: Client,
    scope: LookupScope,
    names: BTreeSet<String>,
    generation: u64,
    tx: mpsc::UnboundedSender<Update>,
    context: Context,
) {
    let api: Api<ConfigMap> = match (&scope.kind, &scope.namespace) {
        (LookupKind::ConfigMap, Some(namespace)) => Api::namespaced(client, namespace),
        (LookupKind::ConfigMap, None) => Api::all(client),
    };
    let mut events = std::pin::pin!(watcher(api, watch_config(&names)).default_backoff());
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                let what = format!(
                    "watching {scope} for lookups failed (if it is Forbidden, grant initium get, list and watch on configmaps); rules that read them keep the last values seen, or fail until they are read; retrying with backoff"
                );
                context.watch_failed(&what, &e);
                continue;
            }
        };
        let Some(event) = kept(event, &names) else {
            continue;
        };
        let update = Update {
            scope: scope.clone(),
            generation,
            event,
        };
        if tx.send(update).is_err() {
            // The duty is gone: this task is about to be aborted.
            return;
        }
    }
}

/// The event as the duty sees it, or `None` for an object whose name no rule reads (dropped
/// here, before it is turned into JSON).
fn kept(
    event: watcher::Event<ConfigMap>,
    names: &BTreeSet<String>,
) -> Option<watcher::Event<Seen>> {
    let wanted = |c: &ConfigMap| c.metadata.name.as_ref().is_some_and(|n| names.contains(n));
    Some(match event {
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
        watcher::Event::InitApply(c) if wanted(&c) => watcher::Event::InitApply(seen(c)),
        watcher::Event::Apply(c) if wanted(&c) => watcher::Event::Apply(seen(c)),
        watcher::Event::Delete(c) if wanted(&c) => watcher::Event::Delete(seen(c)),
        _ => return None,
    })
}

/// A ConfigMap as templates see it: JSON, with `apiVersion` and `kind`, without
/// `managedFields` (bookkeeping of no use to a rule, often larger than the data).
fn seen(mut config_map: ConfigMap) -> Seen {
    config_map.metadata.managed_fields = None;
    let name = config_map.metadata.name.clone().unwrap_or_default();
    let namespace = config_map.metadata.namespace.clone().unwrap_or_default();
    let mut value = serde_json::to_value(&config_map).unwrap_or(Value::Null);
    if let Some(object) = value.as_object_mut() {
        object.insert("apiVersion".into(), Value::String("v1".into()));
        object.insert("kind".into(), Value::String("ConfigMap".into()));
    }
    (name, namespace, Arc::new(value))
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
        let shared = Arc::clone(&self.shared);
        let metrics = &shared.metrics;
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
                    let needed = needed_by(&current);
                    watches.sync(&needed);
                    changed |= objects.retain(&needed);
                    index = Some(current);
                    metrics.lookup_watches.set(watches.running.len() as i64);
                }
            }
            for update in batch {
                if let Some(watching) = watches.watching(&update) {
                    changed |= objects.apply(&update.scope, watching, update.event);
                }
            }
            if changed {
                self.shared.lookups.store(Arc::new(objects.store()));
                metrics.lookup_objects.set(objects.count() as i64);
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
    use initium_engine::api::RuleSpec;
    use initium_engine::{RuleId, compile};

    fn scope(namespace: Option<&str>) -> LookupScope {
        LookupScope {
            kind: LookupKind::ConfigMap,
            namespace: namespace.map(String::from),
        }
    }

    fn names(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn needed(scopes: &[(Option<&str>, &[&str])]) -> BTreeMap<LookupScope, BTreeSet<String>> {
        scopes
            .iter()
            .map(|(ns, n)| (scope(*ns), names(n)))
            .collect()
    }

    fn config_map(name: &str, namespace: &str, value: &str) -> Seen {
        (
            name.to_string(),
            namespace.to_string(),
            Arc::new(
                json!({"metadata": {"name": name, "namespace": namespace}, "data": {"registry": value}}),
            ),
        )
    }

    fn value_in(
        objects: &Objects,
        scope: &LookupScope,
        name: &str,
        namespace: &str,
    ) -> Option<Value> {
        let watched = objects.scopes.get(scope)?;
        watched
            .current
            .objects
            .get(name)?
            .get(namespace)
            .map(|v| v["data"]["registry"].clone())
    }

    /// A rule compiled from `lookups` (`(ConfigMap name, namespace)`), in `namespace` (a
    /// MutationRule) or cluster-wide.
    fn rule(
        namespace: Option<&str>,
        name: &str,
        lookups: &[(&str, Option<&str>)],
    ) -> initium_engine::CompiledRule {
        let lookups: Vec<Value> = lookups
            .iter()
            .enumerate()
            .map(|(i, (cm, ns))| {
                let mut reference = json!({"name": cm});
                if let Some(ns) = ns {
                    reference["namespace"] = json!(ns);
                }
                json!({"name": format!("l{i}"), "configMap": reference})
            })
            .collect();
        let spec: RuleSpec = serde_json::from_value(json!({
            "match": {"kinds": ["Pod"]},
            "lookups": lookups,
            "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}],
        }))
        .unwrap();
        let id = match namespace {
            Some(ns) => RuleId::namespaced(ns, name),
            None => RuleId::cluster(name),
        };
        compile(id, &spec).unwrap()
    }

    #[test]
    fn many_rules_and_names_in_a_namespace_need_one_watch() {
        // 100 rules of 8 lookups each in one namespace, 2 namespaces more, and cluster rules
        // reading names in every namespace and in a named one.
        let mut rules = Vec::new();
        for r in 0..100 {
            let lookups: Vec<(String, Option<&str>)> = (0..8)
                .map(|l| (format!("cm-{}", (r * 8 + l) % 300), None))
                .collect();
            let lookups: Vec<(&str, Option<&str>)> =
                lookups.iter().map(|(n, ns)| (n.as_str(), *ns)).collect();
            rules.push(rule(Some("team"), &format!("r{r}"), &lookups));
        }
        rules.push(rule(Some("a"), "one", &[("x", None), ("y", Some("a"))]));
        rules.push(rule(Some("b"), "one", &[("x", None)]));
        rules.push(rule(
            None,
            "c1",
            &[("info", None), ("ca", None), ("x", Some("a"))],
        ));
        rules.push(rule(
            None,
            "c2",
            &[("info", None), ("proxy", Some("platform"))],
        ));
        let needed = needed_by(&RuleIndex::new(rules));
        let summary: Vec<(Option<String>, usize)> = needed
            .iter()
            .map(|(scope, names)| (scope.namespace.clone(), names.len()))
            .collect();
        assert_eq!(
            summary,
            [
                (None, 2),
                (Some("a".into()), 2),
                (Some("b".into()), 1),
                (Some("platform".into()), 1),
                (Some("team".into()), 300),
            ],
            "one watch per namespace looked up in, and one for every namespace: 5, not 306"
        );
    }

    #[test]
    fn a_watch_starts_again_only_for_a_name_it_does_not_keep() {
        let running = names;
        assert_eq!(Watches::plan(None, &names(&["a"])), Plan::Start);
        assert_eq!(
            Watches::plan(Some(&running(&["a", "b"])), &names(&["a"])),
            Plan::Keep,
            "fewer names: the same watch, the objects of the other dropped"
        );
        assert_eq!(
            Watches::plan(Some(&running(&["a", "b"])), &names(&["b", "a"])),
            Plan::Keep
        );
        assert_eq!(
            Watches::plan(Some(&running(&["a"])), &names(&["a", "c"])),
            Plan::Restart
        );
    }

    #[test]
    fn one_name_is_selected_by_the_api_server_and_several_are_filtered_on_receipt() {
        let one = watch_config(&names(&["mirror"]));
        assert_eq!(one.field_selector.as_deref(), Some("metadata.name=mirror"));
        assert_eq!(one.page_size, Some(LIST_PAGE_SIZE));
        let two = watch_config(&names(&["mirror", "ca"]));
        assert_eq!(two.field_selector, None);
        assert_eq!(two.page_size, Some(LIST_PAGE_SIZE));

        let wanted = names(&["mirror", "ca"]);
        let cm = |name: &str| -> ConfigMap {
            serde_json::from_value(
                json!({"metadata": {"name": name, "namespace": "a"}, "data": {"k": "v"}}),
            )
            .unwrap()
        };
        let kept_name = |event: Option<watcher::Event<Seen>>| match event {
            Some(watcher::Event::Apply((name, _, _)))
            | Some(watcher::Event::InitApply((name, _, _))) => Some(name),
            _ => None,
        };
        assert_eq!(
            kept_name(kept(watcher::Event::Apply(cm("ca")), &wanted)).as_deref(),
            Some("ca")
        );
        assert_eq!(
            kept_name(kept(watcher::Event::InitApply(cm("mirror")), &wanted)).as_deref(),
            Some("mirror")
        );
        assert!(kept(watcher::Event::Apply(cm("kube-root-ca.crt")), &wanted).is_none());
        assert!(kept(watcher::Event::InitApply(cm("other")), &wanted).is_none());
        assert!(kept(watcher::Event::Delete(cm("other")), &wanted).is_none());
        assert!(matches!(
            kept(watcher::Event::Init, &wanted),
            Some(watcher::Event::Init)
        ));
        assert!(matches!(
            kept(watcher::Event::InitDone, &wanted),
            Some(watcher::Event::InitDone)
        ));
    }

    #[test]
    fn the_objects_follow_the_watch_and_tell_when_listed() {
        let all = scope(None);
        let watching = names(&["mirror"]);
        let mut objects = Objects::default();
        assert!(objects.retain(&needed(&[(None, &["mirror"])])));
        assert!(!objects.synced(), "a new scope is not listed yet");
        assert!(!objects.apply(&all, &watching, watcher::Event::Init));
        assert!(!objects.apply(
            &all,
            &watching,
            watcher::Event::InitApply(config_map("mirror", "a", "one"))
        ));
        assert!(!objects.apply(
            &all,
            &watching,
            watcher::Event::InitApply(config_map("other", "a", "x"))
        ));
        assert!(objects.apply(&all, &watching, watcher::Event::InitDone));
        assert!(objects.synced());
        assert_eq!(value_in(&objects, &all, "mirror", "a"), Some(json!("one")));
        assert_eq!(objects.count(), 1, "only what rules name is kept");

        assert!(objects.apply(
            &all,
            &watching,
            watcher::Event::Apply(config_map("mirror", "a", "two"))
        ));
        assert!(
            !objects.apply(
                &all,
                &watching,
                watcher::Event::Apply(config_map("mirror", "a", "two"))
            ),
            "the same object: no swap"
        );
        assert!(objects.apply(
            &all,
            &watching,
            watcher::Event::Apply(config_map("mirror", "b", "three"))
        ));
        assert!(objects.apply(
            &all,
            &watching,
            watcher::Event::Delete(config_map("mirror", "a", ""))
        ));
        assert!(!objects.apply(
            &all,
            &watching,
            watcher::Event::Delete(config_map("mirror", "a", ""))
        ));
        assert_eq!(value_in(&objects, &all, "mirror", "a"), None);
        assert_eq!(
            value_in(&objects, &all, "mirror", "b"),
            Some(json!("three"))
        );

        // A relist drops what is gone.
        objects.apply(&all, &watching, watcher::Event::Init);
        objects.apply(
            &all,
            &watching,
            watcher::Event::InitApply(config_map("mirror", "c", "four")),
        );
        assert!(objects.apply(&all, &watching, watcher::Event::InitDone));
        assert_eq!(value_in(&objects, &all, "mirror", "b"), None);
        assert_eq!(value_in(&objects, &all, "mirror", "c"), Some(json!("four")));
    }

    #[test]
    fn a_new_name_is_not_read_until_the_watch_lists_again_and_the_others_stay_readable() {
        let team = scope(Some("team"));
        let mut objects = Objects::default();
        objects.retain(&needed(&[(Some("team"), &["a"])]));
        let first = names(&["a"]);
        objects.apply(&team, &first, watcher::Event::Init);
        objects.apply(
            &team,
            &first,
            watcher::Event::InitApply(config_map("a", "team", "1")),
        );
        objects.apply(&team, &first, watcher::Event::InitDone);
        assert!(objects.synced());

        // A rule starts to read `b`: the watch restarts with both names.
        assert!(!objects.retain(&needed(&[(Some("team"), &["a", "b"])])));
        assert!(!objects.synced(), "b has not been read");
        assert_eq!(
            objects.scopes[&team].current.listed,
            names(&["a"]),
            "a is still read while the watch lists again"
        );
        let both = names(&["a", "b"]);
        objects.apply(&team, &both, watcher::Event::Init);
        objects.apply(
            &team,
            &both,
            watcher::Event::InitApply(config_map("a", "team", "1")),
        );
        objects.apply(
            &team,
            &both,
            watcher::Event::InitApply(config_map("b", "team", "2")),
        );
        assert_eq!(value_in(&objects, &team, "a", "team"), Some(json!("1")));
        assert!(objects.apply(&team, &both, watcher::Event::InitDone));
        assert!(objects.synced());
        assert_eq!(value_in(&objects, &team, "b", "team"), Some(json!("2")));

        // No rule reads `a` any more: dropped at once, without a new watch.
        assert!(objects.retain(&needed(&[(Some("team"), &["b"])])));
        assert_eq!(value_in(&objects, &team, "a", "team"), None);
        assert!(
            !objects.apply(
                &team,
                &names(&["b"]),
                watcher::Event::Apply(config_map("a", "team", "3"))
            ),
            "an event of a name no rule reads is dropped"
        );
        assert_eq!(objects.count(), 1);
    }

    #[test]
    fn scopes_come_and_go_with_the_rules() {
        let a = scope(Some("a"));
        let mut objects = Objects::default();
        objects.retain(&needed(&[(Some("a"), &["mirror"])]));
        objects.apply(&a, &names(&["mirror"]), watcher::Event::Init);
        objects.apply(&a, &names(&["mirror"]), watcher::Event::InitDone);
        assert!(objects.synced());
        assert!(objects.retain(&needed(&[(Some("a"), &["mirror"]), (None, &["mirror"])])));
        assert!(!objects.synced(), "the new scope is not listed yet");
        assert!(!objects.retain(&needed(&[(Some("a"), &["mirror"]), (None, &["mirror"])])));
        assert!(objects.retain(&needed(&[(None, &["mirror"])])));
        assert!(
            !objects.apply(
                &a,
                &names(&["mirror"]),
                watcher::Event::Apply(config_map("mirror", "a", "x"))
            ),
            "an event of a forgotten scope is dropped"
        );
        assert_eq!(objects.store().len(), 1);
    }

    #[test]
    fn a_swapped_store_shares_the_objects_it_did_not_change() {
        let a = scope(Some("a"));
        let b = scope(Some("b"));
        let mut objects = Objects::default();
        objects.retain(&needed(&[(Some("a"), &["one"]), (Some("b"), &["two"])]));
        let listed = names(&["two"]);
        objects.apply(&b, &listed, watcher::Event::Init);
        objects.apply(&b, &listed, watcher::Event::InitDone);
        let before = Arc::clone(&objects.scopes[&a].current);
        assert!(objects.apply(
            &b,
            &listed,
            watcher::Event::Apply(config_map("two", "b", "x"))
        ));
        assert!(Arc::ptr_eq(&before, &objects.scopes[&a].current));
    }

    #[test]
    fn a_config_map_is_seen_with_its_kind_and_without_managed_fields() {
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": "mirror", "namespace": "a",
                         "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
            "data": {"registry": "mirror.local"},
        }))
        .unwrap();
        let (name, namespace, value) = seen(cm);
        assert_eq!((name.as_str(), namespace.as_str()), ("mirror", "a"));
        assert_eq!(
            *value,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "mirror", "namespace": "a"},
                   "data": {"registry": "mirror.local"}})
        );
    }
}
