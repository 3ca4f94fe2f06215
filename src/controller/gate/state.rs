//! The gate controller's pure half: what it knows about the waiting Pods and about their
//! dependencies, and what follows from it. No client, no clock of its own (the caller passes
//! `now`), no I/O: everything here is unit-tested.
//!
//! - [`GatedPod`]: the slim facts kept per gated Pod (from the gated-Pods watch).
//! - [`World`]: the slim facts of the dependency kinds being watched, and the memory of Jobs
//!   seen succeeded.
//! - [`Gates`]: the Ready rules that have a gate, by gate name (from the rule index).
//! - [`judge`]: for one Pod, which of its initium gates to release and why, how to narrow its
//!   node affinity, its next deadline, and what it waits on.
//! - [`Waiting`]: every gated Pod with what it waits on, the reverse index (dependency →
//!   Pods) and the deadlines.
//! - [`release_patch`]: the one merge patch that releases gates on a Pod.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod,
};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{Value, json};

use crate::api::{GATE_PREFIX, GATED_LABEL, OnTimeout};
use crate::engine::Reads;
use crate::engine::{CompiledGate, Dependency, RuleId, RuleIndex, Target};

/// A Pod, by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the controller keeps of a gated Pod: enough to judge it and to write its release.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GatedPod {
    pub key: PodKey,
    pub uid: String,
    pub resource_version: String,
    pub created: Option<Timestamp>,
    /// Every scheduling gate, in order (other controllers' too: a release keeps them).
    pub gates: Vec<String>,
    /// Whether the Pod carries `initium.dev/gated`.
    pub labeled: bool,
    /// `spec.affinity.nodeAffinity`, for narrowing to a DaemonSet's nodes.
    pub node_affinity: Option<NodeAffinity>,
}

impl GatedPod {
    /// The slim facts of `pod`; `None` without a name or namespace.
    pub(crate) fn of(pod: &Pod) -> Option<GatedPod> {
        let meta = &pod.metadata;
        let spec = pod.spec.as_ref();
        Some(GatedPod {
            key: PodKey {
                namespace: meta.namespace.clone()?,
                name: meta.name.clone()?,
            },
            uid: meta.uid.clone().unwrap_or_default(),
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            created: meta.creation_timestamp.as_ref().map(|t| t.0),
            gates: spec
                .and_then(|s| s.scheduling_gates.as_ref())
                .map(|gates| gates.iter().map(|g| g.name.clone()).collect())
                .unwrap_or_default(),
            labeled: meta
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(GATED_LABEL)),
            node_affinity: spec
                .and_then(|s| s.affinity.as_ref())
                .and_then(|a| a.node_affinity.clone()),
        })
    }

    /// initium's gates on the Pod.
    pub(crate) fn initium_gates(&self) -> impl Iterator<Item = &str> {
        self.gates
            .iter()
            .map(String::as_str)
            .filter(|g| g.starts_with(GATE_PREFIX))
    }
}

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

/// A Ready rule with a gate.
#[derive(Clone, Debug)]
pub(crate) struct GateRule {
    pub rule: RuleId,
    pub gate: Arc<CompiledGate>,
}

/// The Ready rules that have a gate, by gate name.
#[derive(Clone, Debug, Default)]
pub(crate) struct Gates(HashMap<String, GateRule>);

impl Gates {
    pub(crate) fn of(index: &RuleIndex) -> Gates {
        Gates(
            index
                .rules()
                .iter()
                .filter_map(|rule| {
                    rule.gate().map(|gate| {
                        (
                            gate.name.clone(),
                            GateRule {
                                rule: rule.id.clone(),
                                gate: gate.clone(),
                            },
                        )
                    })
                })
                .collect(),
        )
    }

    pub(crate) fn get(&self, gate: &str) -> Option<&GateRule> {
        self.0.get(gate)
    }
}

/// Why a gate is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// Every dependency holds.
    Ready,
    /// The timeout passed and the rule says `onTimeout: Release`.
    Timeout,
    /// No Ready rule has this gate any more.
    RuleGone,
}

impl Reason {
    /// The `reason` label of `initium_gate_releases_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Reason::Ready => "ready",
            Reason::Timeout => "timeout",
            Reason::RuleGone => "rule_gone",
        }
    }
}

/// One gate to remove, and what to tell about it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Release {
    pub gate: String,
    pub reason: Reason,
    /// The rule, when it still has the gate.
    pub rule: Option<RuleId>,
    /// Ready: the dependencies (all ready). Timeout: the ones still not ready.
    pub dependencies: Vec<String>,
    /// The timeout, for the event of a timeout.
    pub timeout: Option<std::time::Duration>,
}

/// A gate whose timeout passed with `onTimeout: Hold`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Held {
    pub gate: String,
    pub rule: RuleId,
    pub pending: Vec<String>,
    pub timeout: std::time::Duration,
}

/// What follows for one Pod from the rules and the facts.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Verdict {
    /// Gates to remove now, in the Pod's order.
    pub release: Vec<Release>,
    /// Narrow the Pod to these nodes in the same write (the DaemonSets of the released gates
    /// are Ready there).
    pub nodes: Option<BTreeSet<String>>,
    /// The earliest timeout of a gate still timed.
    pub deadline: Option<Timestamp>,
    /// Gates that timed out just now with `onTimeout: Hold` (not in `held` before).
    pub newly_held: Vec<Held>,
    /// What the Pod waits on (for the reverse index).
    pub keys: BTreeSet<DepKey>,
}

impl Verdict {
    pub(crate) fn is_release(&self) -> bool {
        !self.release.is_empty()
    }
}

/// When a gate of `gate` on a Pod created at `created` times out.
fn deadline(created: Option<Timestamp>, gate: &CompiledGate) -> Option<Timestamp> {
    let timeout = SignedDuration::try_from(gate.timeout).ok()?;
    created?.checked_add(timeout).ok()
}

/// Judges one Pod: for each of its initium gates, the rule that has it and whether its
/// dependencies hold (by the rule's current spec). `held` are the Pod's gates that already
/// timed out with `Hold` (they wait on, untimed).
pub(crate) fn judge(
    pod: &GatedPod,
    gates: &Gates,
    world: &World,
    held: &BTreeSet<String>,
    now: Timestamp,
) -> Verdict {
    let ns = pod.key.namespace.as_str();
    let mut verdict = Verdict::default();
    // Gates ready by their dependencies, with the nodes their DaemonSets allow.
    let mut ready: Vec<(Release, Option<BTreeSet<String>>)> = Vec::new();
    for name in pod.initium_gates() {
        let Some(GateRule { rule, gate }) = gates.get(name) else {
            verdict.release.push(Release {
                gate: name.to_string(),
                reason: Reason::RuleGone,
                rule: None,
                dependencies: Vec::new(),
                timeout: None,
            });
            continue;
        };
        let mut pending = Vec::new();
        let mut nodes: Option<BTreeSet<String>> = None;
        for dep in &gate.wait_for {
            let key = DepKey::of(dep, ns, rule);
            if let DepKey::Object(object) = &key
                && world.refused(object)
            {
                pending.push(format!(
                    "{} (never judged: it is cluster-scoped, and a MutationRule may only wait on \
                     namespaced objects of its own namespace; wait on an object in {ns}, or use \
                     a ClusterMutationRule)",
                    dep.describe(ns)
                ));
                verdict.keys.insert(key);
                continue;
            }
            verdict.keys.insert(key);
            if !world.holds(dep, ns, rule) {
                pending.push(dep.describe(ns));
                continue;
            }
            if let Dependency::DaemonSet(t) = dep {
                let here = world.daemon_set_nodes(dep.namespace(ns), &t.name);
                nodes = Some(match nodes {
                    None => here,
                    Some(n) => n.intersection(&here).cloned().collect(),
                });
            }
        }
        // Two DaemonSets Ready on no common node: not ready (the Pod could not run there).
        if pending.is_empty() && nodes.as_ref().is_none_or(|n| !n.is_empty()) {
            let release = Release {
                gate: name.to_string(),
                reason: Reason::Ready,
                rule: Some(rule.clone()),
                dependencies: gate.wait_for.iter().map(|d| d.describe(ns)).collect(),
                timeout: None,
            };
            ready.push((release, nodes));
            continue;
        }
        if pending.is_empty() {
            pending.push("DaemonSets Ready on a common node".into());
        }
        if held.contains(name) {
            continue;
        }
        let due = deadline(pod.created, gate);
        match due {
            Some(due) if due <= now => match gate.on_timeout {
                OnTimeout::Release => verdict.release.push(Release {
                    gate: name.to_string(),
                    reason: Reason::Timeout,
                    rule: Some(rule.clone()),
                    dependencies: pending,
                    timeout: Some(gate.timeout),
                }),
                OnTimeout::Hold => verdict.newly_held.push(Held {
                    gate: name.to_string(),
                    rule: rule.clone(),
                    pending,
                    timeout: gate.timeout,
                }),
            },
            Some(due) => {
                verdict.deadline = Some(verdict.deadline.map_or(due, |d| d.min(due)));
            }
            None => {}
        }
    }
    // All ready gates go in the same write, narrowed to the nodes every one of them allows;
    // if their DaemonSets have no node in common, the ones that narrow wait.
    let mut nodes: Option<BTreeSet<String>> = None;
    for (_, n) in &ready {
        if let Some(n) = n {
            nodes = Some(match nodes {
                None => n.clone(),
                Some(all) => all.intersection(n).cloned().collect(),
            });
        }
    }
    let disjoint = nodes.as_ref().is_some_and(BTreeSet::is_empty);
    for (release, n) in ready {
        if disjoint && n.is_some() {
            continue;
        }
        verdict.release.push(release);
    }
    if !disjoint {
        verdict.nodes = nodes;
    }
    // In the Pod's order.
    let order: HashMap<&str, usize> = pod
        .gates
        .iter()
        .enumerate()
        .map(|(i, g)| (g.as_str(), i))
        .collect();
    verdict
        .release
        .sort_by_key(|r| order.get(r.gate.as_str()).copied());
    verdict
}

/// The merge patch that removes `remove` from the Pod as `pod` shows it, or `None` when
/// none of them is on it any more (someone released them already). It carries the
/// resourceVersion (a stale view gets 409), keeps every other gate in order, drops the
/// `initium.dev/gated` label once no initium gate remains, and narrows the required node
/// affinity to `nodes` (see [`narrow`]).
pub(crate) fn release_patch(
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
pub(crate) fn unlabel_patch(pod: &GatedPod) -> Option<Value> {
    (pod.labeled && pod.initium_gates().next().is_none()).then(|| {
        json!({"metadata": {"resourceVersion": pod.resource_version, "labels": {GATED_LABEL: null}}})
    })
}

/// `affinity` with its required terms narrowed to `nodes`: one term
/// `matchFields: metadata.name In nodes` when there is none, else that requirement added to
/// every term (terms are ORed, so each must carry it). Everything else is kept; for a gated
/// Pod the API server allows exactly such additions.
pub(crate) fn narrow(affinity: Option<NodeAffinity>, nodes: &BTreeSet<String>) -> NodeAffinity {
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

/// What the controller keeps per gated Pod.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub pod: GatedPod,
    /// What it waits on (as last judged).
    pub keys: BTreeSet<DepKey>,
    pub deadline: Option<Timestamp>,
    /// Gates that timed out with `Hold`; `true` once their event is out.
    pub held: BTreeMap<String, bool>,
    /// The resourceVersion a release was written over: not written again until the watch
    /// shows a newer version.
    pub written: Option<String>,
}

impl Entry {
    pub(crate) fn held_gates(&self) -> BTreeSet<String> {
        self.held.keys().cloned().collect()
    }
}

/// Every gated Pod, the reverse index and the deadlines.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    pods: HashMap<PodKey, Entry>,
    reverse: HashMap<DepKey, HashSet<PodKey>>,
    deadlines: BTreeSet<(Timestamp, PodKey)>,
    relisting: Option<Vec<GatedPod>>,
}

/// An event of the gated-Pods watch, with the Pod's slim facts.
#[derive(Clone, Debug)]
pub(crate) enum PodEvent {
    Init,
    InitApply(GatedPod),
    InitDone,
    Apply(GatedPod),
    Delete(PodKey),
}

impl Waiting {
    /// Applies one event of the gated-Pods watch; returns the Pods to judge again.
    pub(crate) fn apply(&mut self, event: PodEvent) -> Vec<PodKey> {
        match event {
            PodEvent::Init => {
                self.relisting = Some(Vec::new());
                Vec::new()
            }
            PodEvent::InitApply(pod) => {
                self.relisting.get_or_insert_default().push(pod);
                Vec::new()
            }
            PodEvent::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                let keep: HashSet<PodKey> = listed.iter().map(|p| p.key.clone()).collect();
                let gone: Vec<PodKey> = self
                    .pods
                    .keys()
                    .filter(|k| !keep.contains(*k))
                    .cloned()
                    .collect();
                for key in gone {
                    self.remove(&key);
                }
                listed
                    .into_iter()
                    .filter_map(|pod| self.upsert(pod))
                    .collect()
            }
            PodEvent::Apply(pod) => self.upsert(pod).into_iter().collect(),
            PodEvent::Delete(key) => {
                self.remove(&key);
                Vec::new()
            }
        }
    }

    /// Adds or updates a Pod; `Some` when it must be judged (new, or changed).
    fn upsert(&mut self, pod: GatedPod) -> Option<PodKey> {
        let key = pod.key.clone();
        match self.pods.get_mut(&key) {
            Some(entry) if entry.pod == pod => None,
            Some(entry) => {
                if entry.pod.uid != pod.uid {
                    // Same name, another Pod: nothing carries over.
                    entry.held.clear();
                    entry.written = None;
                }
                entry.pod = pod;
                Some(key)
            }
            None => {
                self.pods.insert(
                    key.clone(),
                    Entry {
                        pod,
                        keys: BTreeSet::new(),
                        deadline: None,
                        held: BTreeMap::new(),
                        written: None,
                    },
                );
                Some(key)
            }
        }
    }

    fn remove(&mut self, key: &PodKey) {
        self.set_keys(key, BTreeSet::new());
        self.set_deadline(key, None);
        self.pods.remove(key);
    }

    pub(crate) fn get(&self, key: &PodKey) -> Option<&Entry> {
        self.pods.get(key)
    }

    pub(crate) fn get_mut(&mut self, key: &PodKey) -> Option<&mut Entry> {
        self.pods.get_mut(key)
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &PodKey> {
        self.pods.keys()
    }

    /// Pods with at least one initium gate (the `initium_gated_pods` gauge).
    pub(crate) fn waiting(&self) -> usize {
        self.pods
            .values()
            .filter(|e| e.pod.initium_gates().next().is_some())
            .count()
    }

    /// Records what a Pod waits on (its verdict's keys) in the reverse index.
    pub(crate) fn set_keys(&mut self, key: &PodKey, keys: BTreeSet<DepKey>) {
        let Some(entry) = self.pods.get_mut(key) else {
            return;
        };
        for old in entry.keys.difference(&keys) {
            if let Some(pods) = self.reverse.get_mut(old) {
                pods.remove(key);
                if pods.is_empty() {
                    self.reverse.remove(old);
                }
            }
        }
        for new in keys.difference(&entry.keys) {
            self.reverse
                .entry(new.clone())
                .or_default()
                .insert(key.clone());
        }
        entry.keys = keys;
    }

    /// Records a Pod's next deadline.
    pub(crate) fn set_deadline(&mut self, key: &PodKey, deadline: Option<Timestamp>) {
        let Some(entry) = self.pods.get_mut(key) else {
            return;
        };
        if entry.deadline == deadline {
            return;
        }
        if let Some(old) = entry.deadline.take() {
            self.deadlines.remove(&(old, key.clone()));
        }
        if let Some(new) = deadline {
            self.deadlines.insert((new, key.clone()));
        }
        entry.deadline = deadline;
    }

    /// The earliest deadline of any Pod.
    pub(crate) fn next_deadline(&self) -> Option<Timestamp> {
        self.deadlines.first().map(|(t, _)| *t)
    }

    /// Pods whose deadline is at or before `now`.
    pub(crate) fn due(&self, now: Timestamp) -> Vec<PodKey> {
        self.deadlines
            .iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, k)| k.clone())
            .collect()
    }

    /// The Pods waiting on any of `keys`.
    pub(crate) fn affected<'a>(&self, keys: impl IntoIterator<Item = &'a DepKey>) -> Vec<PodKey> {
        let mut pods: BTreeSet<PodKey> = BTreeSet::new();
        for key in keys {
            if let Some(waiting) = self.reverse.get(key) {
                pods.extend(waiting.iter().cloned());
            }
        }
        pods.into_iter().collect()
    }

    /// The kinds some waiting Pod needs watched.
    pub(crate) fn needed_kinds(&self) -> BTreeSet<WatchKind> {
        self.reverse.keys().flat_map(DepKey::kinds).collect()
    }

    /// Number of reverse-index keys (for tests and logs).
    #[cfg(test)]
    fn reverse_len(&self) -> usize {
        self.reverse.len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
