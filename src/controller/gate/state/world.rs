//! The facts of the dependency kinds being watched, reduced to what a dependency needs, and
//! the memory of Jobs seen succeeded; [`DepKey`] names what a dependency is about, for the
//! reverse index.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::Value;

use initium_engine::Reads;
use initium_engine::{Dependency, RuleId, Target};

/// A kind the controller watches while some waiting Pod needs it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum WatchKind {
    EndpointSlices,
    Jobs,
    Pods,
    DaemonSets,
    /// The one object an `object` dependency names.
    Object(ObjectRef),
}

impl std::fmt::Display for WatchKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WatchKind::EndpointSlices => f.write_str("EndpointSlices"),
            WatchKind::Jobs => f.write_str("Jobs"),
            WatchKind::Pods => f.write_str("Pods"),
            WatchKind::DaemonSets => f.write_str("DaemonSets"),
            WatchKind::Object(r) => write!(f, "{r}"),
        }
    }
}

/// `apiVersion` and `kind` of an `object` dependency.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ObjectKind {
    pub api_version: String,
    pub kind: String,
}

/// The object an `object` dependency names, as the watch that feeds it sees it: the watch
/// lists this one object (field selector `metadata.name`), in `namespace` when the kind is
/// namespaced, so what initium keeps is what the rules name, whatever else the cluster holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ObjectRef {
    pub kind: ObjectKind,
    /// The dependency's namespace (the waiting Pod's when the rule names none); not used when
    /// discovery finds the kind cluster-scoped.
    pub namespace: String,
    pub name: String,
    /// Named by a MutationRule: only a namespaced object of `namespace` may satisfy it. A
    /// cluster-scoped kind is then never watched nor judged (initium would read it with its
    /// own permissions for the namespace's owner).
    pub own_namespace: bool,
    /// What the dependency's conditions read: all the watch keeps of the object. Dependencies
    /// on the same object that read different parts of it are fed by different watches.
    pub reads: Reads,
}

impl ObjectRef {
    /// The object `dep` names for a Pod in `pod_namespace`, by a gate of `rule`; `None` for
    /// the other kinds of dependency.
    pub(crate) fn of(dep: &Dependency, pod_namespace: &str, rule: &RuleId) -> Option<ObjectRef> {
        match dep {
            Dependency::Object {
                api_version,
                kind,
                target,
                reads,
                ..
            } => Some(ObjectRef::new(
                api_version,
                kind,
                target,
                reads,
                pod_namespace,
                rule,
            )),
            _ => None,
        }
    }

    fn new(
        api_version: &str,
        kind: &str,
        target: &Target,
        reads: &Reads,
        pod_namespace: &str,
        rule: &RuleId,
    ) -> ObjectRef {
        ObjectRef {
            kind: ObjectKind {
                api_version: api_version.to_string(),
                kind: kind.to_string(),
            },
            namespace: target.namespace(pod_namespace).to_string(),
            name: target.name.clone(),
            own_namespace: rule.namespace.is_some(),
            reads: reads.clone(),
        }
    }
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} (namespace {}, if namespaced)",
            self.kind.api_version, self.kind.kind, self.name, self.namespace
        )
    }
}

/// What a dependency is about, for the reverse index: a change of the facts under one key
/// re-judges only the Pods waiting on it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum DepKey {
    Service {
        namespace: String,
        name: String,
    },
    Job {
        namespace: String,
        name: String,
    },
    /// Ready Pods in a namespace (any selector).
    Pods {
        namespace: String,
    },
    DaemonSet {
        namespace: String,
        name: String,
    },
    /// The one object an `object` dependency names.
    Object(ObjectRef),
}

impl DepKey {
    /// What `dep` of a gate of `rule` is about, for a Pod in `pod_namespace`.
    pub(crate) fn of(dep: &Dependency, pod_namespace: &str, rule: &RuleId) -> DepKey {
        let namespace = dep.namespace(pod_namespace).to_string();
        match dep {
            Dependency::Service(t) => DepKey::Service {
                namespace,
                name: t.name.clone(),
            },
            Dependency::Job(t) => DepKey::Job {
                namespace,
                name: t.name.clone(),
            },
            Dependency::Pods { .. } => DepKey::Pods { namespace },
            Dependency::DaemonSet(t) => DepKey::DaemonSet {
                namespace,
                name: t.name.clone(),
            },
            Dependency::Object {
                api_version,
                kind,
                target,
                reads,
                ..
            } => DepKey::Object(ObjectRef::new(
                api_version,
                kind,
                target,
                reads,
                pod_namespace,
                rule,
            )),
        }
    }

    /// The watches that feed the facts under this key.
    pub(crate) fn kinds(&self) -> Vec<WatchKind> {
        match self {
            DepKey::Service { .. } => vec![WatchKind::EndpointSlices],
            DepKey::Job { .. } => vec![WatchKind::Jobs],
            DepKey::Pods { .. } => vec![WatchKind::Pods],
            DepKey::DaemonSet { .. } => vec![WatchKind::DaemonSets, WatchKind::Pods],
            DepKey::Object(object) => vec![WatchKind::Object(object.clone())],
        }
    }
}

/// One object of a watched kind, reduced to what a dependency needs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Fact {
    /// An EndpointSlice: its Service (label `kubernetes.io/service-name`) and how many of
    /// its endpoints are ready (`conditions.ready` not false).
    Slice {
        namespace: String,
        name: String,
        service: Option<String>,
        ready: usize,
    },
    Job {
        namespace: String,
        name: String,
        uid: String,
        succeeded: bool,
    },
    /// A Pod; only Ready Pods are kept.
    Pod {
        namespace: String,
        name: String,
        ready: bool,
        labels: BTreeMap<String, String>,
        node: Option<String>,
        /// The uid of the DaemonSet that owns it, with the DaemonSet's name.
        daemon_set: Option<(String, String)>,
    },
    DaemonSet {
        namespace: String,
        name: String,
        uid: String,
    },
    Object {
        namespace: Option<String>,
        name: String,
        value: Arc<Value>,
    },
}

/// What a watch of a dependency kind reports, in the order of `kube::runtime::watcher`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Update {
    /// A (re)list begins.
    Init,
    InitApply(Fact),
    /// The (re)list is complete: what it did not list is gone.
    InitDone,
    Apply(Fact),
    Delete(Fact),
}

/// A Pod that counts for `pods` and `daemonSet` dependencies.
#[derive(Clone, Debug, PartialEq)]
struct ReadyPod {
    labels: BTreeMap<String, String>,
    node: Option<String>,
    daemon_set_uid: Option<String>,
}

type Named = (String, String);

/// The facts of every dependency kind being watched.
#[derive(Debug, Default)]
pub(crate) struct World {
    /// Ready endpoints per Service, per slice.
    slices: HashMap<Named, BTreeMap<String, usize>>,
    /// Which Service each slice belongs to (a slice's label could change).
    slice_service: HashMap<Named, String>,
    /// Jobs now: uid and whether succeeded.
    jobs: HashMap<Named, (String, bool)>,
    /// The last uid seen succeeded per Job name. Kept when the Job is deleted (TTL) and when
    /// the Job watch stops; lost only when the process ends.
    jobs_succeeded: HashMap<Named, String>,
    /// Ready Pods per namespace, by name.
    pods: HashMap<String, HashMap<String, ReadyPod>>,
    daemon_sets: HashMap<Named, String>,
    /// The object each `object` watch lists (at most one: it selects by name).
    objects: HashMap<ObjectRef, ObjectStore>,
    /// Facts of a relist in progress, per kind.
    relisting: HashMap<WatchKind, Vec<Fact>>,
}

#[derive(Debug, Default)]
struct ObjectStore {
    /// Whether discovery found the kind namespaced (`None`: not resolved yet).
    namespaced: Option<bool>,
    /// The object, reduced to what the conditions read.
    object: Option<Kept>,
}

/// An object kept for `object` dependencies, with what was judged of it.
#[derive(Debug)]
struct Kept {
    value: Arc<Value>,
    /// Bytes of `value` as JSON.
    bytes: usize,
    /// Whether the conditions of each text hold on this object: judged once, for every Pod
    /// that waits on it, until the object changes. A tenant's slow conditions (each judgement
    /// bounded by `OBJECT_JUDGE_BUDGET`) then cost once per change of the object, not once
    /// per waiting Pod, in the loop that releases everyone's Pods.
    judged: RefCell<HashMap<Arc<str>, bool>>,
}

impl World {
    /// Applies one update of the watch of `kind`; returns the keys whose facts changed.
    pub(crate) fn apply(&mut self, kind: &WatchKind, update: Update) -> Vec<DepKey> {
        match update {
            Update::Init => {
                self.relisting.insert(kind.clone(), Vec::new());
                Vec::new()
            }
            Update::InitApply(fact) => {
                self.relisting.entry(kind.clone()).or_default().push(fact);
                Vec::new()
            }
            Update::InitDone => {
                let listed = self.relisting.remove(kind).unwrap_or_default();
                let mut dirty = self.clear(kind);
                for fact in listed {
                    dirty.extend(self.insert(kind, fact));
                }
                dirty.sort();
                dirty.dedup();
                dirty
            }
            Update::Apply(fact) => self.insert(kind, fact),
            Update::Delete(fact) => self.remove(kind, &fact),
        }
    }

    /// Starts over (a restarted duty has no watches yet); the memory of succeeded Jobs stays.
    pub(crate) fn restart(&mut self) {
        let memory = std::mem::take(&mut self.jobs_succeeded);
        *self = World::default();
        self.jobs_succeeded = memory;
    }

    /// How many objects are kept for `object` dependencies.
    pub(crate) fn objects(&self) -> usize {
        self.objects
            .values()
            .filter(|store| store.object.is_some())
            .count()
    }

    /// Bytes (as JSON) of the objects kept for `object` dependencies.
    pub(crate) fn object_bytes(&self) -> usize {
        self.objects
            .values()
            .filter_map(|store| store.object.as_ref())
            .map(|kept| kept.bytes)
            .sum()
    }

    /// Records whether the kind of `object` is namespaced (from discovery); returns the key
    /// to judge again.
    pub(crate) fn set_namespaced(&mut self, object: &ObjectRef, namespaced: bool) -> DepKey {
        self.objects.entry(object.clone()).or_default().namespaced = Some(namespaced);
        DepKey::Object(object.clone())
    }

    /// Whether discovery found that `object`, named by a MutationRule, is of a cluster-scoped
    /// kind: it is never judged.
    pub(crate) fn refused(&self, object: &ObjectRef) -> bool {
        object.own_namespace
            && self
                .objects
                .get(object)
                .is_some_and(|store| store.namespaced == Some(false))
    }

    /// Forgets the facts of a kind whose watch stopped (the memory of succeeded Jobs stays).
    pub(crate) fn forget(&mut self, kind: &WatchKind) {
        self.clear(kind);
        self.relisting.remove(kind);
        if let WatchKind::Object(object) = kind {
            self.objects.remove(object);
        }
    }

    /// Drops every fact of `kind`; returns their keys.
    fn clear(&mut self, kind: &WatchKind) -> Vec<DepKey> {
        match kind {
            WatchKind::EndpointSlices => {
                self.slice_service.clear();
                self.slices
                    .drain()
                    .map(|((namespace, name), _)| DepKey::Service { namespace, name })
                    .collect()
            }
            WatchKind::Jobs => self
                .jobs
                .drain()
                .map(|((namespace, name), _)| DepKey::Job { namespace, name })
                .collect(),
            WatchKind::Pods => {
                let mut dirty = Vec::new();
                for (namespace, pods) in self.pods.drain() {
                    for pod in pods.values() {
                        if let Some(ds) = daemon_set_key(&namespace, pod, &self.daemon_sets) {
                            dirty.push(ds);
                        }
                    }
                    dirty.push(DepKey::Pods { namespace });
                }
                dirty
            }
            WatchKind::DaemonSets => self
                .daemon_sets
                .drain()
                .map(|((namespace, name), _)| DepKey::DaemonSet { namespace, name })
                .collect(),
            WatchKind::Object(object) => {
                match self.objects.get_mut(object).and_then(|s| s.object.take()) {
                    Some(_) => vec![DepKey::Object(object.clone())],
                    None => Vec::new(),
                }
            }
        }
    }

    fn insert(&mut self, kind: &WatchKind, fact: Fact) -> Vec<DepKey> {
        match (kind, fact) {
            (
                WatchKind::EndpointSlices,
                Fact::Slice {
                    namespace,
                    name,
                    service,
                    ready,
                },
            ) => {
                let slice = (namespace.clone(), name.clone());
                let mut dirty = self.remove_slice(&slice);
                if let Some(service) = service {
                    self.slice_service.insert(slice, service.clone());
                    self.slices
                        .entry((namespace.clone(), service.clone()))
                        .or_default()
                        .insert(name, ready);
                    dirty.push(DepKey::Service {
                        namespace,
                        name: service,
                    });
                }
                dirty.dedup();
                dirty
            }
            (
                WatchKind::Jobs,
                Fact::Job {
                    namespace,
                    name,
                    uid,
                    succeeded,
                },
            ) => {
                let key = (namespace.clone(), name.clone());
                if succeeded {
                    self.jobs_succeeded.insert(key.clone(), uid.clone());
                }
                let new = (uid, succeeded);
                if self.jobs.get(&key) == Some(&new) {
                    return Vec::new();
                }
                self.jobs.insert(key, new);
                vec![DepKey::Job { namespace, name }]
            }
            (
                WatchKind::Pods,
                Fact::Pod {
                    namespace,
                    name,
                    ready,
                    labels,
                    node,
                    daemon_set,
                },
            ) => {
                if !ready {
                    return self.remove_pod(&namespace, &name);
                }
                let (ds_name, daemon_set_uid) = match daemon_set {
                    Some((n, u)) => (Some(n), Some(u)),
                    None => (None, None),
                };
                let pod = ReadyPod {
                    labels,
                    node,
                    daemon_set_uid,
                };
                let pods = self.pods.entry(namespace.clone()).or_default();
                if pods.get(&name) == Some(&pod) {
                    return Vec::new();
                }
                let mut dirty = Vec::new();
                if let Some(old) = pods.insert(name, pod)
                    && let Some(key) = daemon_set_key(&namespace, &old, &self.daemon_sets)
                {
                    dirty.push(key);
                }
                if let Some(ds_name) = ds_name {
                    dirty.push(DepKey::DaemonSet {
                        namespace: namespace.clone(),
                        name: ds_name,
                    });
                }
                dirty.push(DepKey::Pods { namespace });
                dirty
            }
            (
                WatchKind::DaemonSets,
                Fact::DaemonSet {
                    namespace,
                    name,
                    uid,
                },
            ) => {
                let key = (namespace.clone(), name.clone());
                if self.daemon_sets.get(&key) == Some(&uid) {
                    return Vec::new();
                }
                self.daemon_sets.insert(key, uid);
                vec![DepKey::DaemonSet { namespace, name }]
            }
            (
                WatchKind::Object(object),
                Fact::Object {
                    namespace,
                    name,
                    value,
                },
            ) => {
                if !is_the_object(object, namespace.as_deref(), &name) {
                    return Vec::new();
                }
                let store = self.objects.entry(object.clone()).or_default();
                // A change outside what the conditions read changes nothing to judge.
                if store
                    .object
                    .as_ref()
                    .is_some_and(|kept| kept.value == value)
                {
                    return Vec::new();
                }
                store.object = Some(Kept {
                    bytes: serde_json::to_vec(&*value).map_or(0, |json| json.len()),
                    value,
                    judged: RefCell::default(),
                });
                vec![DepKey::Object(object.clone())]
            }
            // A fact from another kind's watch: never sent.
            _ => Vec::new(),
        }
    }

    fn remove(&mut self, kind: &WatchKind, fact: &Fact) -> Vec<DepKey> {
        match (kind, fact) {
            (
                WatchKind::EndpointSlices,
                Fact::Slice {
                    namespace, name, ..
                },
            ) => self.remove_slice(&(namespace.clone(), name.clone())),
            (
                WatchKind::Jobs,
                Fact::Job {
                    namespace, name, ..
                },
            ) => {
                // The memory of a success stays (a Job with a TTL is deleted once done).
                match self.jobs.remove(&(namespace.clone(), name.clone())) {
                    Some(_) => vec![DepKey::Job {
                        namespace: namespace.clone(),
                        name: name.clone(),
                    }],
                    None => Vec::new(),
                }
            }
            (
                WatchKind::Pods,
                Fact::Pod {
                    namespace, name, ..
                },
            ) => self.remove_pod(namespace, name),
            (
                WatchKind::DaemonSets,
                Fact::DaemonSet {
                    namespace, name, ..
                },
            ) => match self.daemon_sets.remove(&(namespace.clone(), name.clone())) {
                Some(_) => vec![DepKey::DaemonSet {
                    namespace: namespace.clone(),
                    name: name.clone(),
                }],
                None => Vec::new(),
            },
            (
                WatchKind::Object(object),
                Fact::Object {
                    namespace, name, ..
                },
            ) if is_the_object(object, namespace.as_deref(), name) => {
                match self.objects.get_mut(object).and_then(|s| s.object.take()) {
                    Some(_) => vec![DepKey::Object(object.clone())],
                    None => Vec::new(),
                }
            }
            _ => Vec::new(),
        }
    }

    fn remove_slice(&mut self, slice: &Named) -> Vec<DepKey> {
        let Some(service) = self.slice_service.remove(slice) else {
            return Vec::new();
        };
        let key = (slice.0.clone(), service.clone());
        if let Some(slices) = self.slices.get_mut(&key) {
            slices.remove(&slice.1);
            if slices.is_empty() {
                self.slices.remove(&key);
            }
        }
        vec![DepKey::Service {
            namespace: slice.0.clone(),
            name: service,
        }]
    }

    fn remove_pod(&mut self, namespace: &str, name: &str) -> Vec<DepKey> {
        let Some(pods) = self.pods.get_mut(namespace) else {
            return Vec::new();
        };
        let Some(old) = pods.remove(name) else {
            return Vec::new();
        };
        if pods.is_empty() {
            self.pods.remove(namespace);
        }
        let mut dirty = vec![DepKey::Pods {
            namespace: namespace.to_string(),
        }];
        dirty.extend(daemon_set_key(namespace, &old, &self.daemon_sets));
        dirty
    }

    /// Whether `dep` of a gate of `rule` holds for a Pod in `pod_namespace`.
    pub(crate) fn holds(&self, dep: &Dependency, pod_namespace: &str, rule: &RuleId) -> bool {
        let ns = dep.namespace(pod_namespace);
        match dep {
            Dependency::Service(t) => self
                .slices
                .get(&(ns.to_string(), t.name.clone()))
                .is_some_and(|slices| slices.values().any(|ready| *ready > 0)),
            Dependency::Job(t) => {
                let key = (ns.to_string(), t.name.clone());
                match self.jobs.get(&key) {
                    Some((uid, succeeded)) => {
                        *succeeded || self.jobs_succeeded.get(&key) == Some(uid)
                    }
                    None => self.jobs_succeeded.contains_key(&key),
                }
            }
            Dependency::Pods { .. } => self
                .pods
                .get(ns)
                .is_some_and(|pods| pods.values().any(|p| dep.selects(&p.labels))),
            Dependency::DaemonSet(t) => !self.daemon_set_nodes(ns, &t.name).is_empty(),
            Dependency::Object { .. } => {
                let Some(object) = ObjectRef::of(dep, pod_namespace, rule) else {
                    return false;
                };
                let Some(store) = self.objects.get(&object) else {
                    return false;
                };
                // A MutationRule's dependency holds only on a namespaced object of its own
                // namespace: never on what discovery did not confirm namespaced.
                if object.own_namespace && store.namespaced != Some(true) {
                    return false;
                }
                let (Some(kept), Dependency::Object { text, .. }) = (&store.object, dep) else {
                    return false;
                };
                if let Some(holds) = kept.judged.borrow().get(text) {
                    return *holds;
                }
                let holds = dep.object_holds(&kept.value);
                kept.judged.borrow_mut().insert(text.clone(), holds);
                holds
            }
        }
    }

    /// The nodes where the DaemonSet `namespace/name` has a Ready Pod.
    pub(crate) fn daemon_set_nodes(&self, namespace: &str, name: &str) -> BTreeSet<String> {
        let Some(uid) = self
            .daemon_sets
            .get(&(namespace.to_string(), name.to_string()))
        else {
            return BTreeSet::new();
        };
        self.pods
            .get(namespace)
            .into_iter()
            .flat_map(HashMap::values)
            .filter(|p| p.daemon_set_uid.as_ref() == Some(uid))
            .filter_map(|p| p.node.clone())
            .collect()
    }
}

/// Whether a fact of the watch of `object` is that object: its name, and its namespace when
/// the kind is namespaced (a cluster-scoped object has none, and a MutationRule's dependency
/// never takes one).
fn is_the_object(object: &ObjectRef, namespace: Option<&str>, name: &str) -> bool {
    name == object.name
        && match namespace {
            Some(namespace) => namespace == object.namespace,
            None => !object.own_namespace,
        }
}

/// The DaemonSet key a Ready Pod counts for, by its owner's uid.
fn daemon_set_key(
    namespace: &str,
    pod: &ReadyPod,
    daemon_sets: &HashMap<Named, String>,
) -> Option<DepKey> {
    let uid = pod.daemon_set_uid.as_ref()?;
    daemon_sets
        .iter()
        .find(|((ns, _), u)| ns == namespace && *u == uid)
        .map(|((namespace, name), _)| DepKey::DaemonSet {
            namespace: namespace.clone(),
            name: name.clone(),
        })
}
