//! The rule watch: both rule kinds, cluster-wide, compiled into the index the webhook reads.
//!
//! Every replica runs it. A rule is compiled when its spec changes; the index is rebuilt from
//! every Ready rule and swapped whole, so a request never sees half an update. A rule is
//! Ready when it compiles and every pattern in `match.kinds` matches a kind the API server
//! serves and initium may intercept; a rule that is not Ready is left out of the index (and
//! of the webhook configuration), so what `kubectl get` shows in READY is what runs. One bad
//! rule never stops the others.

use initium_engine::human_bytes;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Weak};

use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::jiff::Timestamp;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

use super::discovery::Served as Discovered;
use super::duty::{Context, Duty};
use super::vocabulary::{ControllerError, READY, Readiness, json_hash};
use super::webhooks::CompiledPolicy;
use super::webhooks::{Inputs, RuleNeeds};
use crate::admission::state::Shared;
use initium_engine::api::{ClusterMutationRule, MutationRule, RuleSpec, RuleStatus};
use initium_engine::policy::{self, PolicySettings, Serving};
use initium_engine::{
    CompiledRule, Dependency, Gvk, RuleErrors, RuleId, RuleIndex, cluster_scoped_message, compile,
};

/// Why a rule is (not) Ready; becomes its `Ready` condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Compiled, every kind is served: in the index and the webhook configuration.
    Ready,
    /// Does not compile; every error with its field path, one per line.
    Invalid(String),
    /// A pattern in `match.kinds` matches no kind the API server serves.
    KindNotServed(String),
    /// A pattern in `match.kinds` matches only kinds initium never intercepts (or, for a
    /// MutationRule, only cluster-scoped kinds), or a MutationRule's gate waits on an object
    /// of a cluster-scoped kind.
    KindNotAllowed(String),
    /// A MutationRule whose lookups would take its namespace over the quota of distinct
    /// ConfigMaps looked up (`--max-lookups-per-namespace`).
    LookupQuota(String),
    /// A MutationRule whose gate would take its namespace over the quota of distinct objects
    /// waited on (`--max-gate-objects-per-namespace`).
    GateObjectQuota(String),
    /// Would take its namespace past a quota (`--max-rules-per-namespace`,
    /// `--max-rule-bytes-per-namespace`): Ready once the namespace has room.
    QuotaExceeded(String),
    /// Would be Ready, but the API server refused the webhook configuration that sends its
    /// objects to initium (the message is the API server's). Only the `status` duty gives
    /// this verdict, never the rule table.
    WebhookRefused(String),
}

/// What the MutationRules of one namespace may make initium hold. A tenant who may create
/// MutationRules adds memory rule by rule; without a bound per namespace, one namespace owner
/// could create rules that no replica can hold under its memory limit, and no replica could
/// start again while they exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quotas {
    /// Ready MutationRules per namespace (`--max-rules-per-namespace`).
    pub rules_per_namespace: usize,
    /// Bytes the Ready MutationRules of one namespace hold, as each measured when compiled
    /// (`--max-rule-bytes-per-namespace`).
    pub rule_bytes_per_namespace: usize,
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas {
            rules_per_namespace: 1_000,
            rule_bytes_per_namespace: 64 << 20,
        }
    }
}

/// What one namespace's Ready MutationRules hold so far, while the quotas are applied.
#[derive(Clone, Copy, Debug, Default)]
struct Used {
    rules: usize,
    bytes: usize,
}

impl Quotas {
    /// Makes the Ready verdicts of MutationRules that would take their namespace past a quota
    /// `QuotaExceeded`, given each rule's measured size and creation time. The oldest rules
    /// come first (ties by name), so creating a rule never takes an older one's place, and
    /// every replica, seeing the same objects, decides the same.
    fn apply(&self, rules: &mut [(&RuleId, Option<usize>, Option<Timestamp>, &mut Verdict)]) {
        // No creation time (never, from the API server) comes last.
        rules.sort_by(|a, b| {
            (a.2.is_none(), a.2)
                .cmp(&(b.2.is_none(), b.2))
                .then_with(|| a.0.cmp(b.0))
        });
        let mut used: HashMap<&str, Used> = HashMap::new();
        for (id, held, _, verdict) in rules.iter_mut() {
            let (Some(namespace), Some(held), true) =
                (id.namespace.as_deref(), *held, verdict.is_ready())
            else {
                continue;
            };
            let used = used.entry(namespace).or_default();
            if used.rules >= self.rules_per_namespace {
                **verdict = Verdict::QuotaExceeded(format!(
                    "namespace {namespace} already has {} Ready MutationRules, its quota (--max-rules-per-namespace); delete a rule of the namespace or merge some, or ask the platform team for a higher quota",
                    self.rules_per_namespace
                ));
                continue;
            }
            let bytes = used.bytes.saturating_add(held);
            if bytes > self.rule_bytes_per_namespace {
                **verdict = Verdict::QuotaExceeded(format!(
                    "this rule holds {} once compiled, and the Ready MutationRules of namespace {namespace} may hold {} together (--max-rule-bytes-per-namespace), {} of it used; make the rule smaller (fewer or simpler regular expressions, shorter values) or delete another rule of the namespace",
                    human_bytes(held),
                    human_bytes(self.rule_bytes_per_namespace),
                    human_bytes(used.bytes)
                ));
                continue;
            }
            used.rules += 1;
            used.bytes = bytes;
        }
    }
}

impl Verdict {
    pub fn is_ready(&self) -> bool {
        matches!(self, Verdict::Ready)
    }
}

/// Decides whether a rule is Ready, given what the API server serves. `kinds` is
/// `spec.match.kinds` as written (for the messages).
pub fn verdict(
    id: &RuleId,
    kinds: &[String],
    compiled: &Result<Arc<CompiledRule>, RuleErrors>,
    served: &Discovered,
) -> Verdict {
    let rule = match compiled {
        Ok(rule) => rule,
        Err(errors) => {
            let lines: Vec<String> = errors.errors.iter().map(ToString::to_string).collect();
            return Verdict::Invalid(lines.join("\n"));
        }
    };
    let namespaced_only = id.namespace.is_some();
    let mut not_served = Vec::new();
    let mut not_allowed = Vec::new();
    for (i, pattern) in rule.kinds().iter().enumerate() {
        let text = kinds.get(i).cloned().unwrap_or_else(|| pattern.to_string());
        let field = format!("spec.match.kinds[{i}]");
        let matching: Vec<_> = served.matching(pattern).collect();
        if matching.is_empty() {
            let mut message = format!("{field}: {text} is not served by the API server");
            if let Some(kind) = pattern.kind.exact() {
                let versions = served.versions_of(pattern.group.exact(), kind);
                if !versions.is_empty() {
                    let list: Vec<String> =
                        versions.iter().map(|v| format!("{v}/{kind}")).collect();
                    message.push_str(&format!(" (served: {})", list.join(", ")));
                }
            }
            not_served.push(message);
            continue;
        }
        if matching
            .iter()
            .any(|r| r.never_intercepted().is_none() && (r.namespaced || !namespaced_only))
        {
            continue;
        }
        let message = match matching.iter().find_map(|r| {
            r.never_intercepted()
                .map(|why| format!("initium never intercepts {}: {why}", r.resource_name()))
        }) {
            Some(why) => format!("{field}: {why}"),
            None => format!(
                "{field}: {text} is cluster-scoped; a MutationRule applies only to namespaced \
                 objects of its namespace (use a ClusterMutationRule)"
            ),
        };
        not_allowed.push(message);
    }
    // A MutationRule may wait only on namespaced objects of its own namespace: the gate
    // controller would judge a cluster-scoped one with initium's permissions, for the tenant.
    // Well-known kinds are refused when the rule compiles; custom ones are found here.
    if let Some(namespace) = id.namespace.as_deref() {
        for (i, dependency) in rule
            .gate()
            .iter()
            .flat_map(|g| g.wait_for.iter())
            .enumerate()
        {
            if let Dependency::Object {
                api_version, kind, ..
            } = dependency
                && served.namespaced(&Gvk::from_api_version(api_version, kind)) == Some(false)
            {
                not_allowed.push(format!(
                    "spec.gate.waitFor[{i}].object.kind: {}",
                    cluster_scoped_message(api_version, kind, namespace)
                ));
            }
        }
    }
    if !not_served.is_empty() {
        not_served.extend(not_allowed);
        Verdict::KindNotServed(not_served.join("\n"))
    } else if !not_allowed.is_empty() {
        Verdict::KindNotAllowed(not_allowed.join("\n"))
    } else {
        Verdict::Ready
    }
}

/// One rule as the status writer sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleView {
    pub id: RuleId,
    /// The rule object's uid (what an Event about the rule refers to).
    pub uid: Option<String>,
    pub generation: Option<i64>,
    pub resource_version: Option<String>,
    /// The status as last seen on the API server (shared with the rule table).
    pub status: Option<Arc<RuleStatus>>,
    pub verdict: Verdict,
    /// How a Ready rule is served, when compiling rules to policies is on
    /// (`--compile-rules auto`); `None` when it is off or the rule is not Ready.
    pub serving: Option<Served>,
}

/// How a Ready rule is served (the rule's `ServedByAPIServer` condition).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Served {
    /// By the API server, through the MutatingAdmissionPolicy of this name.
    ApiServer(String),
    /// By initium's webhook, for this reason.
    Webhook(String),
}

/// Every rule, sorted by id; published after each batch of changes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub rules: Vec<Arc<RuleView>>,
}

/// A rule object of either kind, reduced to what the controller uses.
struct Observed {
    id: RuleId,
    uid: Option<String>,
    /// `metadata.creationTimestamp`: the older rules of a namespace get its lookup quota first.
    created: Option<Timestamp>,
    spec: RuleSpec,
    generation: Option<i64>,
    resource_version: Option<String>,
    status: Option<RuleStatus>,
}

impl From<ClusterMutationRule> for Observed {
    fn from(rule: ClusterMutationRule) -> Observed {
        Observed {
            id: RuleId::cluster(&rule.name_any()),
            uid: rule.metadata.uid,
            created: rule.metadata.creation_timestamp.map(|t| t.0),
            generation: rule.metadata.generation,
            resource_version: rule.metadata.resource_version,
            spec: rule.spec,
            status: rule.status,
        }
    }
}

impl From<MutationRule> for Observed {
    fn from(rule: MutationRule) -> Observed {
        Observed {
            id: RuleId::namespaced(
                rule.metadata.namespace.as_deref().unwrap_or_default(),
                rule.metadata.name.as_deref().unwrap_or_default(),
            ),
            uid: rule.metadata.uid,
            created: rule.metadata.creation_timestamp.map(|t| t.0),
            generation: rule.metadata.generation,
            resource_version: rule.metadata.resource_version,
            spec: rule.spec,
            status: rule.status,
        }
    }
}

/// What the table keeps of a rule. Not its spec: that is compiled once and dropped (a spec's
/// JSON values cost kilobytes; ten thousand rules must fit in tens of megabytes). Whether a
/// later event brings a new spec is told by `spec_key`.
struct Entry {
    spec_key: SpecKey,
    created: Option<Timestamp>,
    /// `spec.match.kinds` as written, for the Ready condition's messages.
    kinds: Vec<String>,
    compiled: Result<Arc<CompiledRule>, RuleErrors>,
    /// Whether `view.verdict` was worked out (by a publish after the spec was compiled), or
    /// is still the placeholder `Ready`.
    judged: bool,
    /// What the snapshot shows of the rule, shared with every snapshot that holds it: a
    /// status write of one rule among ten thousand publishes ten thousand pointers, not ten
    /// thousand copies.
    view: Arc<RuleView>,
    /// What the rule needs intercepted (if it compiled), worked out once per spec and shared
    /// with every published [`Inputs`].
    needs: Option<Arc<RuleNeeds>>,
    /// The verdict on the rule's kinds (before the namespace quotas), with the discovery it
    /// was worked out against: a publish judges again only rules that changed, or all of
    /// them when discovery changed.
    kind_verdict: Option<(Weak<Discovered>, Verdict)>,
    /// The spec, kept only while rules are compiled to policies (`--compile-rules auto`):
    /// the policy depends on discovery too, so it is generated when the table is published.
    spec: Option<Arc<RuleSpec>>,
}

/// Identifies a rule object's spec: a hash of its uid (a rule deleted and created again is a
/// new rule) and of the spec as JSON. Not the generation alone: a spec can read differently with
/// the same generation (new defaults after a CRD upgrade).
#[derive(Clone, Debug, PartialEq, Eq)]
struct SpecKey(u64);

impl SpecKey {
    fn of(observed: &Observed) -> SpecKey {
        SpecKey(json_hash(&observed.uid, &observed.spec))
    }
}

/// Which of the two watches an event came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Scope {
    Cluster,
    Namespaced,
}

impl Scope {
    fn of(id: &RuleId) -> Scope {
        if id.namespace.is_some() {
            Scope::Namespaced
        } else {
            Scope::Cluster
        }
    }
}

enum Input {
    Rule(Scope, Box<Result<watcher::Event<Observed>, watcher::Error>>),
    Served(Option<Arc<Discovered>>),
}

/// All rules, their compilation and readiness, and what has changed since the last publish.
#[derive(Default)]
struct RuleTable {
    entries: BTreeMap<RuleId, Entry>,
    served: Option<Arc<Discovered>>,
    /// `--compile-rules auto`: what the generated policies depend on besides the rules.
    compile: Option<Arc<PolicySettings>>,
    /// Rules listed so far by a watch that is (re)listing, already compiled: a list of ten
    /// thousand rules never holds ten thousand specs at once.
    relisting: BTreeMap<Scope, Vec<(RuleId, Entry, bool)>>,
    listed_cluster: bool,
    listed_namespaced: bool,
    /// The set of compiled rules or discovery changed: verdicts and the index are stale.
    index_stale: bool,
    /// Anything changed (status included): the snapshot is stale.
    snapshot_stale: bool,
    /// Every distinct status in the table, by a hash of its JSON: rules written in the same
    /// second carry the same status, so ten thousand rules share a few dozen.
    statuses: HashMap<u64, Arc<RuleStatus>>,
    quotas: Quotas,
    /// Distinct ConfigMaps the MutationRules of one namespace may look up.
    lookup_quota: LookupQuota,
    /// Distinct objects the gates of one namespace's MutationRules may wait on.
    gate_object_quota: GateObjectQuota,
}

/// Distinct ConfigMaps the MutationRules of one namespace may look up together
/// (`--max-lookups-per-namespace`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LookupQuota(pub usize);

/// Default `--max-lookups-per-namespace`. Every ConfigMap looked up is kept in memory (up to
/// 1 MiB each) and named in its namespace's watch filter; 64 is eight rules' worth of the
/// most lookups one rule may have (8), all distinct, far more than the handful (a registry
/// mirror, a proxy, a CA bundle, team data) a tenant's rules need, and it keeps one
/// namespace's ConfigMaps within a quarter of the Deployment's 256 MiB limit when they are of
/// the usual few kilobytes to a megabyte. Rules that read the same ConfigMap count it once.
pub const DEFAULT_MAX_LOOKUPS_PER_NAMESPACE: usize = 64;

impl Default for LookupQuota {
    fn default() -> LookupQuota {
        LookupQuota(DEFAULT_MAX_LOOKUPS_PER_NAMESPACE)
    }
}

/// Whether `entry`'s rule holds a place in its namespace's lookup quota already: its status
/// says this generation is Ready (so a restart, or another replica, decides as before), or it
/// was Ready at the last publish with the same compiled spec. A change to one rule then never
/// takes the quota from a rule that had it.
fn holds_quota(entry: &Entry) -> bool {
    let view = &entry.view;
    let status_ready = view.status.as_deref().is_some_and(|status| {
        status.observed_generation == view.generation
            && status
                .conditions
                .iter()
                .any(|c| c.type_ == READY && c.status == "True")
    });
    status_ready || (entry.judged && view.verdict.is_ready())
}

/// A rule with lookups waiting for its namespace's quota, sorted in the order it is served:
/// (holds no place yet, has no creation time, creation time, id, index in the table).
type InLine<'a> = (bool, bool, Option<Timestamp>, &'a RuleId, usize);

/// The distinct things a rule names, each as (key, how a person reads it).
type Targets<'r> = &'r dyn Fn(&CompiledRule) -> Vec<(String, String)>;

/// The verdict of a rule that would go over a quota: (namespace, max, how many the admitted
/// rules hold, what this one would add).
type Refuse<'r> = &'r dyn Fn(&str, usize, usize, &[&str]) -> Verdict;

/// Applies a per-namespace quota of distinct targets to the MutationRules that would otherwise
/// be Ready (`verdicts`, one per entry, in the table's order): per namespace, rules are
/// admitted in order (those holding a place first, then the oldest, then by name) while the
/// distinct targets they name together stay within the quota; a rule that would go over it is
/// not Ready, with a sentence naming the quota and the flag. A rule that names only what
/// admitted rules name already adds nothing. ClusterMutationRules are exempt: they are written
/// by cluster administrators, who also set the flags.
fn apply_distinct_quota(
    entries: &BTreeMap<RuleId, Entry>,
    verdicts: &mut [Verdict],
    max: usize,
    targets: Targets<'_>,
    refuse: Refuse<'_>,
) {
    let mut by_namespace: BTreeMap<&str, Vec<InLine<'_>>> = BTreeMap::new();
    let mut named: HashMap<usize, Vec<(String, String)>> = HashMap::new();
    for (i, ((id, entry), verdict)) in entries.iter().zip(verdicts.iter()).enumerate() {
        let (Some(namespace), Ok(rule), true) =
            (id.namespace.as_deref(), &entry.compiled, verdict.is_ready())
        else {
            continue;
        };
        let named_here = targets(rule);
        if named_here.is_empty() {
            continue;
        }
        named.insert(i, named_here);
        by_namespace.entry(namespace).or_default().push((
            !holds_quota(entry),
            entry.created.is_none(),
            entry.created,
            id,
            i,
        ));
    }
    for (namespace, mut rules) in by_namespace {
        rules.sort();
        let mut admitted: BTreeSet<&str> = BTreeSet::new();
        let mut refused = Vec::new();
        for (_, _, _, _, i) in rules {
            let Some(targets) = named.get(&i) else {
                continue;
            };
            let new: BTreeSet<&str> = targets
                .iter()
                .map(|(key, _)| key.as_str())
                .filter(|key| !admitted.contains(key))
                .collect();
            if admitted.len() + new.len() <= max {
                admitted.extend(new);
            } else {
                refused.push((i, targets));
            }
        }
        // Told against what the namespace's Ready rules name in the end.
        for (i, targets) in refused {
            let mut new: Vec<&str> = targets
                .iter()
                .filter(|(key, _)| !admitted.contains(key.as_str()))
                .map(|(_, shown)| shown.as_str())
                .collect();
            new.sort_unstable();
            new.dedup();
            let Some(verdict) = verdicts.get_mut(i) else {
                continue;
            };
            *verdict = refuse(namespace, max, admitted.len(), &new);
        }
    }
}

/// The lookup quota ([`LookupQuota`]).
fn apply_lookup_quota(
    entries: &BTreeMap<RuleId, Entry>,
    verdicts: &mut [Verdict],
    quota: LookupQuota,
) {
    let targets = |rule: &CompiledRule| -> Vec<(String, String)> {
        rule.lookup_targets()
            .map(|t| {
                (
                    t.name.clone(),
                    initium_engine::untrusted::quote(&t.name).into_owned(),
                )
            })
            .collect()
    };
    let refuse = |namespace: &str, max: usize, have: usize, new: &[&str]| {
        Verdict::LookupQuota(format!(
            "spec.lookups: the MutationRules of namespace {namespace} may look up at most {max} distinct ConfigMaps together (the lookup quota, initium serve --max-lookups-per-namespace={max}); its other Ready rules look up {have}, and this rule would add {add} more ({names}): read ConfigMaps those rules read already, put the values in fewer ConfigMaps, or delete rules that no longer need theirs, and the rule becomes Ready by itself; or ask a cluster administrator to raise --max-lookups-per-namespace",
            add = new.len(),
            names = new.join(", "),
        ))
    };
    apply_distinct_quota(entries, verdicts, quota.0, &targets, &refuse);
}

/// Distinct objects the gates of one namespace's MutationRules may wait on together
/// (`--max-gate-objects-per-namespace`): each is a watch (an API request held open) while
/// Pods wait on it, and what its conditions read is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateObjectQuota(pub usize);

/// Default `--max-gate-objects-per-namespace`: far more than the handful of objects (a
/// database, a certificate, a migration's ConfigMap) a namespace's Pods wait on.
pub const DEFAULT_MAX_GATE_OBJECTS_PER_NAMESPACE: usize = 32;

impl Default for GateObjectQuota {
    fn default() -> GateObjectQuota {
        GateObjectQuota(DEFAULT_MAX_GATE_OBJECTS_PER_NAMESPACE)
    }
}

/// The gate object quota ([`GateObjectQuota`]). Dependencies on one object that read
/// different parts of it have a watch each, so they count once per set of parts.
fn apply_gate_object_quota(
    entries: &BTreeMap<RuleId, Entry>,
    verdicts: &mut [Verdict],
    quota: GateObjectQuota,
) {
    let targets = |rule: &CompiledRule| -> Vec<(String, String)> {
        rule.gate()
            .iter()
            .flat_map(|g| g.wait_for.iter())
            .filter_map(|dependency| match dependency {
                Dependency::Object {
                    api_version,
                    kind,
                    target,
                    reads,
                    ..
                } => Some((
                    format!("{api_version}/{kind}/{}/{reads:?}", target.name),
                    format!("{kind} {}", initium_engine::untrusted::quote(&target.name)),
                )),
                _ => None,
            })
            .collect()
    };
    let refuse = |namespace: &str, max: usize, have: usize, new: &[&str]| {
        Verdict::GateObjectQuota(format!(
            "spec.gate.waitFor: the MutationRules of namespace {namespace} may wait on at most {max} distinct objects together (the gate object quota, initium serve --max-gate-objects-per-namespace={max}; the same object counts again when its conditions read other fields); its other Ready rules wait on {have}, and this rule would add {add} more ({names}): wait on objects those rules wait on already, or delete rules that no longer need theirs, and the rule becomes Ready by itself; or ask a cluster administrator to raise --max-gate-objects-per-namespace",
            add = new.len(),
            names = new.join(", "),
        ))
    };
    apply_distinct_quota(entries, verdicts, quota.0, &targets, &refuse);
}

/// The shared copy of `status`: an equal one already in `statuses`, or this one, added.
fn intern(
    statuses: &mut HashMap<u64, Arc<RuleStatus>>,
    status: Option<RuleStatus>,
) -> Option<Arc<RuleStatus>> {
    let status = status?;
    let key = json_hash(&None, &status);
    match statuses.get(&key) {
        Some(shared) if **shared == status => Some(Arc::clone(shared)),
        // New, or (never seen) a hash collision: keep its own copy.
        _ => {
            let status = Arc::new(status);
            statuses.insert(key, Arc::clone(&status));
            Some(status)
        }
    }
}

impl RuleTable {
    fn apply(&mut self, input: Input) {
        match input {
            Input::Served(served) => {
                if served.is_some() && served != self.served {
                    self.served = served;
                    self.index_stale = true;
                    self.snapshot_stale = true;
                }
            }
            Input::Rule(scope, event) => self.apply_rule(scope, *event),
        }
    }

    fn apply_rule(
        &mut self,
        scope: Scope,
        event: Result<watcher::Event<Observed>, watcher::Error>,
    ) {
        match event {
            // Logged and counted by the duty (`watch_failed`); the watch retries by itself.
            Err(_) => {}
            Ok(event) => match event {
                watcher::Event::Init => {
                    self.relisting.insert(scope, Vec::new());
                }
                watcher::Event::InitApply(mut rule) => {
                    let status = intern(&mut self.statuses, rule.status.take());
                    let keep_spec = self.compile.is_some();
                    let staged = entry_for(self.entries.get(&rule.id), rule, status, keep_spec);
                    self.relisting.entry(scope).or_default().push(staged);
                }
                watcher::Event::InitDone => {
                    let listed = self.relisting.remove(&scope).unwrap_or_default();
                    let keep: BTreeSet<&RuleId> = listed.iter().map(|(id, _, _)| id).collect();
                    let before = self.entries.len();
                    self.entries
                        .retain(|id, _| Scope::of(id) != scope || keep.contains(id));
                    if self.entries.len() != before {
                        self.index_stale = true;
                    }
                    self.snapshot_stale = true;
                    for (id, entry, compiled) in listed {
                        self.index_stale |= compiled;
                        self.entries.insert(id, entry);
                    }
                    match scope {
                        Scope::Cluster => self.listed_cluster = true,
                        Scope::Namespaced => self.listed_namespaced = true,
                    }
                }
                watcher::Event::Apply(rule) => self.upsert(rule),
                watcher::Event::Delete(rule) => {
                    if self.entries.remove(&rule.id).is_some() {
                        tracing::info!(rule = %rule.id.describe(), "rule deleted");
                        self.index_stale = true;
                        self.snapshot_stale = true;
                    }
                }
            },
        }
    }

    /// Adds or updates a rule; compiles it only when its spec changed (status updates come
    /// through here too).
    fn upsert(&mut self, mut observed: Observed) {
        self.snapshot_stale = true;
        let status = intern(&mut self.statuses, observed.status.take());
        let keep_spec = self.compile.is_some();
        let (id, entry, compiled) =
            entry_for(self.entries.get(&observed.id), observed, status, keep_spec);
        self.index_stale |= compiled;
        self.entries.insert(id, entry);
    }

    /// Swaps in a new index if anything it depends on changed, and publishes the snapshot
    /// and the webhook inputs. Nothing is published before both rule kinds have been listed
    /// completely and discovery has been read once: a leader that just started must not
    /// write a webhook configuration for the few rules it has seen so far.
    /// Returns whether it published anything.
    fn publish(
        &mut self,
        shared: &Shared,
        readiness: &Readiness,
        snapshot: &watch::Sender<Arc<Snapshot>>,
        needs: &watch::Sender<Arc<Inputs>>,
    ) -> bool {
        let Some(served) = self.served.clone() else {
            return false;
        };
        if !(self.listed_cluster && self.listed_namespaced) {
            return false;
        }
        let published = self.index_stale || self.snapshot_stale;
        if self.index_stale {
            self.index_stale = false;
            let mut ready = Vec::new();
            let mut rule_needs = Vec::new();
            let mut ready_ids: Vec<RuleId> = Vec::new();
            let mut verdicts: Vec<Verdict> = self
                .entries
                .iter_mut()
                .map(|(id, entry)| match &entry.kind_verdict {
                    Some((seen, verdict)) if std::ptr::eq(seen.as_ptr(), Arc::as_ptr(&served)) => {
                        verdict.clone()
                    }
                    _ => {
                        let judged = verdict(id, &entry.kinds, &entry.compiled, &served);
                        entry.kind_verdict = Some((Arc::downgrade(&served), judged.clone()));
                        judged
                    }
                })
                .collect();
            apply_lookup_quota(&self.entries, &mut verdicts, self.lookup_quota);
            apply_gate_object_quota(&self.entries, &mut verdicts, self.gate_object_quota);
            {
                let mut judged: Vec<_> = self
                    .entries
                    .iter()
                    .zip(verdicts.iter_mut())
                    .map(|((id, entry), verdict)| {
                        let held = entry.compiled.as_ref().ok().map(|r| r.held_bytes());
                        (id, held, entry.created, verdict)
                    })
                    .collect();
                self.quotas.apply(&mut judged);
            }
            for ((id, entry), verdict) in self.entries.iter_mut().zip(verdicts) {
                let changed = !entry.judged || entry.view.verdict != verdict;
                if changed
                    && let Verdict::KindNotServed(m)
                    | Verdict::KindNotAllowed(m)
                    | Verdict::QuotaExceeded(m)
                    | Verdict::LookupQuota(m)
                    | Verdict::GateObjectQuota(m) = &verdict
                {
                    tracing::warn!(rule = %id.describe(), reason = %m, "rule is not Ready");
                }
                if entry.view.verdict != verdict {
                    Arc::make_mut(&mut entry.view).verdict = verdict.clone();
                    self.snapshot_stale = true;
                }
                entry.judged = true;
                if let (Ok(rule), Some(needs), true) =
                    (&entry.compiled, &entry.needs, verdict.is_ready())
                {
                    ready.push(rule.clone());
                    rule_needs.push(needs.clone());
                    ready_ids.push(id.clone());
                }
            }
            // Every Ready rule stays in the index, compiled or not: the webhook skips a rule
            // its policy already applied (it is listed in initium.dev/mutated-by), and serves
            // it while its policy is not in effect yet.
            shared.swap_rules(RuleIndex::shared(ready));
            let (rule_needs, compiled) = self.plan(&served, &ready_ids, rule_needs);
            let inputs = Arc::new(Inputs {
                rules: rule_needs,
                served: Some(served.clone()),
                compiled,
                compiling: self.compile.is_some(),
            });
            needs.send_if_modified(|current| {
                if **current == *inputs {
                    return false;
                }
                *current = inputs;
                true
            });
        }
        if self.snapshot_stale {
            self.snapshot_stale = false;
            let rules = self
                .entries
                .values()
                .map(|entry| Arc::clone(&entry.view))
                .collect();
            snapshot.send_replace(Arc::new(Snapshot { rules }));
            // Statuses no rule (nor a snapshot) holds any more.
            self.statuses
                .retain(|_, status| Arc::strong_count(status) > 1);
        }
        for part in [
            Readiness::DISCOVERY,
            Readiness::CLUSTER_RULES,
            Readiness::RULES,
        ] {
            readiness.done(part);
        }
        published
    }

    /// With `--compile-rules auto`: which Ready rules the API server serves through a
    /// generated policy. Returns the needs of the rules the webhook serves, and the compiled
    /// ones (whose needs the webhook configuration keeps until their policy is in effect);
    /// records how each is served in its view.
    fn plan(
        &mut self,
        served: &Arc<Discovered>,
        ready: &[RuleId],
        needs: Vec<Arc<RuleNeeds>>,
    ) -> (Vec<Arc<RuleNeeds>>, Vec<CompiledPolicy>) {
        let Some(settings) = self.compile.clone() else {
            return (needs, Vec::new());
        };
        let specs: Vec<(RuleId, Arc<RuleSpec>)> = ready
            .iter()
            .filter_map(|id| {
                let spec = self.entries.get(id)?.spec.clone()?;
                Some((id.clone(), spec))
            })
            .collect();
        let servings: Vec<Serving> = if served.serves_mutating_policies() {
            let borrowed: Vec<(RuleId, &RuleSpec)> = specs
                .iter()
                .map(|(id, s)| (id.clone(), s.as_ref()))
                .collect();
            policy::plan(&borrowed, served.as_ref(), &settings)
        } else {
            specs
                .iter()
                .map(|_| {
                    Serving::Webhook(policy::NotCompiled::new(
                        "cluster",
                        "the API server does not serve admissionregistration.k8s.io/v1 MutatingAdmissionPolicy (Kubernetes 1.36 and later do)",
                    ))
                })
                .collect()
        };
        if specs.len() != needs.len() {
            return (needs, Vec::new());
        }
        let mut webhook = Vec::new();
        let mut compiled = Vec::new();
        for (((id, _), serving), need) in specs.iter().zip(servings).zip(needs) {
            let view_serving = match serving {
                Serving::ApiServer(generated) => {
                    let name = generated.name.clone();
                    compiled.push(CompiledPolicy {
                        rule: id.clone(),
                        generated: Arc::new(*generated),
                        needs: need,
                    });
                    Served::ApiServer(name)
                }
                Serving::Webhook(reason) => {
                    webhook.push(need);
                    Served::Webhook(reason.to_string())
                }
            };
            if let Some(entry) = self.entries.get_mut(id)
                && entry.view.serving.as_ref() != Some(&view_serving)
            {
                Arc::make_mut(&mut entry.view).serving = Some(view_serving);
                self.snapshot_stale = true;
            }
        }
        for entry in self.entries.values_mut() {
            if !entry.view.verdict.is_ready() && entry.view.serving.is_some() {
                Arc::make_mut(&mut entry.view).serving = None;
                self.snapshot_stale = true;
            }
        }
        (webhook, compiled)
    }

    /// Whether a publish would do anything.
    fn stale(&self) -> bool {
        self.index_stale || self.snapshot_stale
    }
}

/// The table entry for a rule object: `current`'s compiled rule and verdict when the spec is
/// the same, else the spec compiled anew (then `true`).
fn entry_for(
    current: Option<&Entry>,
    observed: Observed,
    status: Option<Arc<RuleStatus>>,
    keep_spec: bool,
) -> (RuleId, Entry, bool) {
    let spec_key = SpecKey::of(&observed);
    let view = |verdict: Option<&Verdict>| {
        Arc::new(RuleView {
            id: observed.id.clone(),
            uid: observed.uid.clone(),
            generation: observed.generation,
            resource_version: observed.resource_version.clone(),
            status,
            verdict: verdict.cloned().unwrap_or(Verdict::Ready),
            serving: None,
        })
    };
    if let Some(current) = current
        && current.spec_key == spec_key
    {
        let entry = Entry {
            spec_key,
            created: observed.created,
            kinds: current.kinds.clone(),
            compiled: current.compiled.clone(),
            judged: current.judged,
            view: {
                let mut fresh = view(current.judged.then_some(&current.view.verdict));
                Arc::make_mut(&mut fresh).serving = current.view.serving.clone();
                fresh
            },
            needs: current.needs.clone(),
            kind_verdict: current.kind_verdict.clone(),
            spec: current.spec.clone(),
        };
        return (observed.id, entry, false);
    }
    let view = view(None);
    let compiled = compile(observed.id.clone(), &observed.spec).map(Arc::new);
    match &compiled {
        Ok(_) => tracing::info!(rule = %observed.id.describe(), "rule compiled"),
        Err(errors) => {
            tracing::warn!(rule = %observed.id.describe(), errors = %errors, "rule is invalid")
        }
    }
    let needs = compiled
        .as_ref()
        .ok()
        .map(|rule| Arc::new(RuleNeeds::of(rule)));
    let spec = keep_spec.then(|| Arc::new(observed.spec.clone()));
    let entry = Entry {
        spec_key,
        created: observed.created,
        kinds: observed.spec.match_.kinds,
        compiled,
        judged: false,
        view,
        needs,
        kind_verdict: None,
        spec,
    };
    (observed.id, entry, true)
}

fn rule_events<K>(api: Api<K>, scope: Scope) -> impl Stream<Item = Input> + Send + 'static
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    Observed: From<K>,
{
    watcher(api, watcher::Config::default())
        .default_backoff()
        .map(move |event| Input::Rule(scope, Box::new(event.map(|e| map_event(e, Observed::from)))))
}

fn map_event<K, T>(event: watcher::Event<K>, f: impl Fn(K) -> T) -> watcher::Event<T> {
    match event {
        watcher::Event::Apply(k) => watcher::Event::Apply(f(k)),
        watcher::Event::Delete(k) => watcher::Event::Delete(f(k)),
        watcher::Event::InitApply(k) => watcher::Event::InitApply(f(k)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// A failed watch request: the watch retries it with its own backoff; the duty logs and
/// counts it.
fn watch_failed(context: &Context, input: &Input) {
    if let Input::Rule(scope, event) = input
        && let Err(e) = event.as_ref()
    {
        let what = match scope {
            Scope::Cluster => "watching ClusterMutationRules failed; retrying with backoff",
            Scope::Namespaced => "watching MutationRules failed; retrying with backoff",
        };
        context.watch_failed(what, e);
    }
}

/// The `rules` duty: watches both rule kinds and discovery; keeps `shared.rules` and the
/// metrics current and publishes what the status and webhook writers need.
pub(crate) struct Rules {
    client: Client,
    quotas: Quotas,
    shared: Arc<Shared>,
    readiness: Arc<Readiness>,
    served: watch::Receiver<Option<Arc<Discovered>>>,
    snapshot: watch::Sender<Arc<Snapshot>>,
    needs: watch::Sender<Arc<Inputs>>,
    lookup_quota: LookupQuota,
    gate_object_quota: GateObjectQuota,
    /// `--compile-rules auto`: the settings of the generated policies.
    compile: Option<Arc<PolicySettings>>,
}

/// The quotas of one namespace's MutationRules: Ready rules and what they hold ([`Quotas`]),
/// the ConfigMaps they look up ([`LookupQuota`]) and the objects their gates wait on
/// ([`GateObjectQuota`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct NamespaceQuotas {
    pub rules: Quotas,
    pub lookups: LookupQuota,
    pub gate_objects: GateObjectQuota,
    /// `--compile-rules auto`: the settings of the generated policies; `None`: off.
    pub compile: Option<Arc<PolicySettings>>,
}

impl Rules {
    pub(crate) fn new(
        client: Client,
        quotas: NamespaceQuotas,
        shared: Arc<Shared>,
        readiness: Arc<Readiness>,
        served: watch::Receiver<Option<Arc<Discovered>>>,
        snapshot: watch::Sender<Arc<Snapshot>>,
        needs: watch::Sender<Arc<Inputs>>,
    ) -> Rules {
        Rules {
            client,
            quotas: quotas.rules,
            lookup_quota: quotas.lookups,
            gate_object_quota: quotas.gate_objects,
            compile: quotas.compile,
            shared,
            readiness,
            served,
            snapshot,
            needs,
        }
    }
}

/// The shortest time between two publishes while changes keep coming. A change after a
/// quiet spell is published at once; a burst (a GitOps sync of a thousand rules, the status
/// writes that follow) is published at most this often, so rebuilding the index and the
/// snapshot costs O(rules) a few times a second, not once per event.
const PUBLISH_INTERVAL: Duration = Duration::from_millis(100);

/// When the table is published: at once after a quiet spell, then at most once per
/// [`PUBLISH_INTERVAL`] while changes keep coming.
#[derive(Debug, Default)]
struct Pacer {
    last: Option<Instant>,
    /// A publish is owed at this time.
    due: Option<Instant>,
}

impl Pacer {
    /// Something changed at `now`: whether to publish now. If not, a publish is due later
    /// (at [`Pacer::due`]), and changes until then are published with it.
    fn publish_now(&mut self, now: Instant) -> bool {
        if self.due.is_some() {
            return false;
        }
        match self.last {
            Some(last) if now < last + PUBLISH_INTERVAL => {
                self.due = Some(last + PUBLISH_INTERVAL);
                false
            }
            _ => true,
        }
    }

    /// A publish happened at `now` (the due one, or one at once).
    fn published(&mut self, now: Instant) {
        self.last = Some(now);
        self.due = None;
    }
}

/// After one of initium's CRDs changes, the rules are listed again after these delays: the
/// API server serves the new schema only once it has set up the new storage, shortly after.
const RELIST_AFTER_CRD_CHANGE: [Duration; 2] = [Duration::from_secs(2), Duration::from_secs(10)];

/// Runs `work` (judging every rule and building the index: milliseconds at ten thousand
/// rules) on a thread of its own: the runtime's workers hand their queued tasks, admission
/// requests among them, to another worker meanwhile instead of waiting behind it. On a
/// current-thread runtime (unit tests) it runs in place.
fn off_the_runtime<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// Sleeps until `at`, or forever when there is nothing to wait for.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The generations of initium's own CRDs, as last seen.
#[derive(Default)]
struct OwnCrds(HashMap<String, i64>);

impl OwnCrds {
    /// Whether `crd` is one of initium's CRDs and its generation changed since it was last
    /// seen (the first sighting is not a change: the watches started after it).
    fn changed(&mut self, crd: &PartialObjectMeta<CustomResourceDefinition>) -> bool {
        let name = crd.name_any();
        let group = initium_engine::api::GROUP;
        if name != format!("mutationrules.{group}")
            && name != format!("clustermutationrules.{group}")
        {
            return false;
        }
        let generation = crd.metadata.generation.unwrap_or_default();
        self.0
            .insert(name, generation)
            .is_some_and(|before| before != generation)
    }
}

impl Rules {
    /// The rule watches of both kinds and discovery's changes, from the start: a full list.
    fn inputs(&self) -> futures::stream::SelectAll<futures::stream::BoxStream<'static, Input>> {
        let mut served = self.served.clone();
        // A restarted duty starts from an empty table: it needs what discovery found already,
        // not only its next change.
        served.mark_changed();
        let served_changes = futures::stream::unfold(served, |mut rx| async move {
            rx.changed().await.ok()?;
            let value = rx.borrow_and_update().clone();
            Some((Input::Served(value), rx))
        });
        futures::stream::select_all([
            rule_events(
                Api::<ClusterMutationRule>::all(self.client.clone()),
                Scope::Cluster,
            )
            .boxed(),
            rule_events(
                Api::<MutationRule>::all(self.client.clone()),
                Scope::Namespaced,
            )
            .boxed(),
            served_changes.boxed(),
        ])
    }
}

impl Duty for Rules {
    const NAME: &'static str = "rules";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let mut inputs = self.inputs();
        let mut table = RuleTable {
            quotas: self.quotas,
            lookup_quota: self.lookup_quota,
            gate_object_quota: self.gate_object_quota,
            compile: self.compile.clone(),
            ..RuleTable::default()
        };
        // initium's own CRDs, by name: their generation, to tell when their schema changed.
        let crds = Api::<PartialObjectMeta<CustomResourceDefinition>>::all(self.client.clone());
        let mut crd_events = watcher(crds, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut own_crds = OwnCrds::default();
        let mut relists: Vec<Instant> = Vec::new();
        let mut pacer = Pacer::default();
        loop {
            let relist_due = relists.iter().copied().min();
            let input = tokio::select! {
                () = context.stop.wait() => return Ok(()),
                () = sleep_until_some(pacer.due) => {
                    pacer.due = None;
                    if off_the_runtime(|| table.publish(&self.shared, &self.readiness, &self.snapshot, &self.needs)) {
                        pacer.published(Instant::now());
                    }
                    continue;
                }
                input = inputs.next() => input,
                event = crd_events.next() => {
                    match event {
                        Some(Ok(watcher::Event::Apply(crd) | watcher::Event::InitApply(crd)))
                            if own_crds.changed(&crd) =>
                        {
                            let now = Instant::now();
                            relists.extend(RELIST_AFTER_CRD_CHANGE.iter().map(|d| now + *d));
                        }
                        Some(Err(e)) => context.watch_failed("watching CustomResourceDefinitions failed; retrying with backoff", &e),
                        _ => {}
                    }
                    continue;
                }
                () = sleep_until_some(relist_due) => {
                    let now = Instant::now();
                    relists.retain(|t| *t > now);
                    tracing::info!(
                        "initium's CustomResourceDefinitions changed: listing the rules again, \
                         so fields of the new schema are read"
                    );
                    // New watches: the old ones may be served by the API server's storage for
                    // the old schema, which drops the new fields from every rule it sends.
                    inputs = self.inputs();
                    continue;
                }
            };
            let Some(input) = input else {
                return Err(ControllerError::Task {
                    task: Self::NAME,
                    message: "the rule and discovery streams ended".into(),
                });
            };
            watch_failed(&context, &input);
            table.apply(input);
            // Take everything already waiting before rebuilding: a relist of a thousand rules
            // builds the index once, not a thousand times.
            while let Some(Some(more)) = inputs.next().now_or_never() {
                watch_failed(&context, &more);
                table.apply(more);
            }
            if table.stale()
                && pacer.publish_now(Instant::now())
                && off_the_runtime(|| {
                    table.publish(&self.shared, &self.readiness, &self.snapshot, &self.needs)
                })
            {
                pacer.published(Instant::now());
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::controller::discovery::tests::served;

    fn spec(kinds: &[&str]) -> RuleSpec {
        serde_json::from_value(serde_json::json!({
            "match": {"kinds": kinds},
            "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}],
        }))
        .unwrap()
    }

    #[test]
    fn a_new_generation_of_initiums_own_crds_is_a_change_and_the_first_sighting_is_not() {
        let crd = |name: &str, generation: i64| {
            let mut meta = PartialObjectMeta::<CustomResourceDefinition>::default();
            meta.metadata.name = Some(name.into());
            meta.metadata.generation = Some(generation);
            meta
        };
        let mut own = OwnCrds::default();
        assert!(!own.changed(&crd("mutationrules.initium.dev", 1)));
        assert!(
            !own.changed(&crd("mutationrules.initium.dev", 1)),
            "same generation"
        );
        assert!(own.changed(&crd("mutationrules.initium.dev", 2)));
        assert!(!own.changed(&crd("clustermutationrules.initium.dev", 5)));
        assert!(own.changed(&crd("clustermutationrules.initium.dev", 6)));
        assert!(!own.changed(&crd("widgets.example.com", 1)));
        assert!(
            !own.changed(&crd("widgets.example.com", 2)),
            "not initium's"
        );
    }

    fn verdict_of(id: RuleId, spec: &RuleSpec) -> Verdict {
        let compiled = compile(id.clone(), spec).map(Arc::new);
        verdict(&id, &spec.match_.kinds, &compiled, &served())
    }

    #[test]
    fn served_kinds_make_a_rule_ready() {
        let id = RuleId::cluster("r");
        assert_eq!(verdict_of(id.clone(), &spec(&["Pod"])), Verdict::Ready);
        assert_eq!(verdict_of(id.clone(), &spec(&["*"])), Verdict::Ready);
        assert_eq!(
            verdict_of(id, &spec(&["apps/*/Deployment", "Namespace"])),
            Verdict::Ready
        );
    }

    #[test]
    fn unserved_kinds_are_named_with_their_field() {
        let id = RuleId::cluster("r");
        assert_eq!(
            verdict_of(id.clone(), &spec(&["Pod", "example.com/v2/Widget"])),
            Verdict::KindNotServed(
                "spec.match.kinds[1]: example.com/v2/Widget is not served by the API server \
                 (served: example.com/v1/Widget)"
                    .into()
            )
        );
        assert_eq!(
            verdict_of(id, &spec(&["Deploymnet"])),
            Verdict::KindNotServed(
                "spec.match.kinds[0]: Deploymnet is not served by the API server".into()
            )
        );
    }

    #[test]
    fn never_intercepted_and_cluster_scoped_kinds_are_not_allowed() {
        let Verdict::KindNotAllowed(m) = verdict_of(
            RuleId::cluster("r"),
            &spec(&["coordination.k8s.io/v1/Lease"]),
        ) else {
            panic!("expected KindNotAllowed");
        };
        assert!(
            m.starts_with(
                "spec.match.kinds[0]: initium never intercepts leases.coordination.k8s.io: "
            ),
            "{m}"
        );
        let Verdict::KindNotAllowed(m) =
            verdict_of(RuleId::namespaced("ns", "r"), &spec(&["Namespace"]))
        else {
            panic!("expected KindNotAllowed");
        };
        assert!(m.contains("Namespace is cluster-scoped"), "{m}");
        // `*` in a MutationRule still has namespaced kinds to work on.
        assert_eq!(
            verdict_of(RuleId::namespaced("ns", "r"), &spec(&["*"])),
            Verdict::Ready
        );
    }

    #[test]
    fn a_mutation_rule_waiting_on_a_served_cluster_scoped_kind_is_not_allowed() {
        let gated = |object: serde_json::Value| -> RuleSpec {
            serde_json::from_value(serde_json::json!({
                "match": {"kinds": ["Pod"]},
                "gate": {"waitFor": [{"service": {"name": "db"}}, {"object": object}]},
            }))
            .unwrap()
        };
        // A custom resource (no well-known kind: only discovery knows it is cluster-scoped).
        let widget = gated(
            serde_json::json!({"apiVersion": "example.com/v1", "kind": "Widget", "name": "w"}),
        );
        let Verdict::KindNotAllowed(m) = verdict_of(RuleId::namespaced("ns", "r"), &widget) else {
            panic!("expected KindNotAllowed");
        };
        assert_eq!(
            m,
            "spec.gate.waitFor[1].object.kind: Widget (example.com/v1) is cluster-scoped, and a \
             MutationRule may only wait on namespaced objects of its own namespace (ns) because \
             initium reads them with its own permissions; wait on an object in ns, or use a \
             ClusterMutationRule (written by a cluster administrator)"
        );
        // The same gate in a ClusterMutationRule, and a namespaced kind in a MutationRule.
        assert_eq!(verdict_of(RuleId::cluster("r"), &widget), Verdict::Ready);
        let config =
            gated(serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "c"}));
        assert_eq!(
            verdict_of(RuleId::namespaced("ns", "r"), &config),
            Verdict::Ready
        );
    }

    #[test]
    fn compile_errors_keep_their_field_paths() {
        let mut bad = spec(&["Pod"]);
        bad.conditions = serde_json::from_value(
            serde_json::json!([{"path": "$.metadata.name", "matches": "("}]),
        )
        .unwrap();
        let Verdict::Invalid(m) = verdict_of(RuleId::cluster("r"), &bad) else {
            panic!("expected Invalid");
        };
        assert!(m.starts_with("spec.conditions[0].matches: "), "{m}");
    }

    fn observed(id: RuleId, kinds: &[&str]) -> Observed {
        Observed {
            id,
            uid: Some("8d4b2c6e-0000-4000-8000-000000000001".into()),
            created: None,
            spec: spec(kinds),
            generation: Some(1),
            resource_version: Some("1".into()),
            status: None,
        }
    }

    /// A rule created `created` seconds after the epoch that looks up `config_maps`.
    fn looking_up(id: RuleId, created: i64, config_maps: &[&str]) -> Observed {
        let mut rule = observed(id, &["Pod"]);
        rule.created = Some(Timestamp::from_second(created).unwrap());
        rule.spec.lookups = config_maps
            .iter()
            .enumerate()
            .map(|(i, name)| {
                serde_json::from_value(
                    serde_json::json!({"name": format!("l{i}"), "configMap": {"name": name}}),
                )
                .unwrap()
            })
            .collect();
        rule
    }

    fn waiting_on(id: RuleId, created: i64, objects: &[(&str, &str)]) -> Observed {
        let mut rule = observed(id, &["Pod"]);
        rule.created = Some(Timestamp::from_second(created).unwrap());
        let wait_for: Vec<_> = objects
            .iter()
            .map(|(name, path)| {
                serde_json::json!({"object": {"apiVersion": "v1", "kind": "ConfigMap",
                    "name": name, "conditions": [{"path": path, "exists": true}]}})
            })
            .collect();
        rule.spec.gate =
            Some(serde_json::from_value(serde_json::json!({"waitFor": wait_for})).unwrap());
        rule
    }

    #[test]
    fn a_namespace_beyond_its_gate_object_quota_keeps_its_older_rules_ready() {
        let mut table = RuleTable {
            gate_object_quota: GateObjectQuota(3),
            ..RuleTable::default()
        };
        let team = |name: &str| RuleId::namespaced("team", name);
        // a: 2 objects; z: the same ConfigMap `one` read elsewhere counts again (another
        // watch), 3 in all; b: one more, over; c: only what is waited on already.
        table.upsert(waiting_on(
            team("a"),
            10,
            &[("one", "$.data.x"), ("two", "$.data.x")],
        ));
        table.upsert(waiting_on(team("z"), 20, &[("one", "$.data.y")]));
        table.upsert(waiting_on(team("b"), 30, &[("three", "$.data.x")]));
        table.upsert(waiting_on(team("c"), 40, &[("two", "$.data.x")]));
        table.upsert(waiting_on(
            RuleId::cluster("platform"),
            50,
            &[("p1", "$.a"), ("p2", "$.a"), ("p3", "$.a"), ("p4", "$.a")],
        ));
        let verdicts = published(&mut table);
        assert_eq!(
            ready_ids(&verdicts),
            ["platform", "team/a", "team/c", "team/z"]
        );
        assert_eq!(
            verdicts["team/b"],
            Verdict::GateObjectQuota(
                "spec.gate.waitFor: the MutationRules of namespace team may wait on at most 3 \
                 distinct objects together (the gate object quota, initium serve \
                 --max-gate-objects-per-namespace=3; the same object counts again when its \
                 conditions read other fields); its other Ready rules wait on 3, and this rule \
                 would add 1 more (ConfigMap three): wait on objects those rules wait on \
                 already, or delete rules that no longer need theirs, and the rule becomes \
                 Ready by itself; or ask a cluster administrator to raise \
                 --max-gate-objects-per-namespace"
                    .into()
            )
        );
        // Room again (z now reads what a reads already): the rule becomes Ready by itself.
        table.upsert(waiting_on(team("z"), 20, &[("one", "$.data.x")]));
        let verdicts = published(&mut table);
        assert!(verdicts["team/b"].is_ready(), "{:?}", verdicts["team/b"]);
    }

    /// Publishes `table` and returns the verdict of each rule, by id.
    fn published(table: &mut RuleTable) -> BTreeMap<String, Verdict> {
        let shared = Shared::new(Default::default());
        let readiness = Readiness::new(shared.clone());
        let (snapshot_tx, snapshot_rx) = watch::channel(Arc::new(Snapshot::default()));
        let (needs_tx, _needs_rx) = watch::channel(Arc::new(Inputs::default()));
        table.apply(Input::Served(Some(Arc::new(served()))));
        table.listed_cluster = true;
        table.listed_namespaced = true;
        table.publish(&shared, &readiness, &snapshot_tx, &needs_tx);
        snapshot_rx
            .borrow()
            .rules
            .iter()
            .map(|r| (r.id.to_string(), r.verdict.clone()))
            .collect()
    }

    fn ready_ids(verdicts: &BTreeMap<String, Verdict>) -> Vec<&str> {
        verdicts
            .iter()
            .filter(|(_, v)| v.is_ready())
            .map(|(id, _)| id.as_str())
            .collect()
    }

    #[test]
    fn a_namespace_beyond_its_lookup_quota_keeps_its_older_rules_ready() {
        let mut table = RuleTable {
            lookup_quota: LookupQuota(4),
            ..RuleTable::default()
        };
        let team = |name: &str| RuleId::namespaced("team", name);
        // Oldest first: a (2 ConfigMaps), then z (2 more: 4, the quota), then b (1 more: over),
        // then c (only ConfigMaps read already: adds nothing), then d (1 more: over).
        table.upsert(looking_up(team("a"), 10, &["one", "two"]));
        table.upsert(looking_up(team("z"), 20, &["three", "four", "one"]));
        table.upsert(looking_up(team("b"), 30, &["five"]));
        table.upsert(looking_up(team("c"), 40, &["two", "three"]));
        table.upsert(looking_up(team("d"), 50, &["six", "one"]));
        // Another namespace has a quota of its own; a cluster rule is exempt.
        table.upsert(looking_up(
            RuleId::namespaced("other", "x"),
            60,
            &["a", "b", "c", "d"],
        ));
        table.upsert(looking_up(
            RuleId::cluster("platform"),
            70,
            &["p1", "p2", "p3", "p4", "p5", "p6"],
        ));
        let verdicts = published(&mut table);
        assert_eq!(
            ready_ids(&verdicts),
            ["other/x", "platform", "team/a", "team/c", "team/z"]
        );
        assert_eq!(
            verdicts["team/b"],
            Verdict::LookupQuota(
                "spec.lookups: the MutationRules of namespace team may look up at most 4 distinct \
                 ConfigMaps together (the lookup quota, initium serve \
                 --max-lookups-per-namespace=4); its other Ready rules look up 4, and this rule \
                 would add 1 more (five): read ConfigMaps those rules read already, put the \
                 values in fewer ConfigMaps, or delete rules that no longer need theirs, and the \
                 rule becomes Ready by itself; or ask a cluster administrator to raise \
                 --max-lookups-per-namespace"
                    .into()
            )
        );
        assert!(
            matches!(&verdicts["team/d"], Verdict::LookupQuota(m) if m.contains("would add 1 more (six)"))
        );

        // A rule that had its place keeps it when an older rule grows: the one that grows
        // is refused.
        table.upsert(looking_up(team("a"), 10, &["one", "two", "seven"]));
        let verdicts = published(&mut table);
        assert_eq!(
            ready_ids(&verdicts),
            ["other/x", "platform", "team/c", "team/z"]
        );
        assert!(
            matches!(&verdicts["team/a"], Verdict::LookupQuota(m) if m.contains("its other Ready rules look up 4, and this rule would add 1 more (seven)")),
            "{:?}",
            verdicts["team/a"]
        );

        // Deleting a rule gives its ConfigMaps back: the oldest rule waiting that fits (a, with
        // its new ConfigMap) becomes Ready; b would still go over.
        table.apply(Input::Rule(
            Scope::Namespaced,
            Box::new(Ok(watcher::Event::Delete(looking_up(team("z"), 20, &[])))),
        ));
        let verdicts = published(&mut table);
        assert_eq!(
            ready_ids(&verdicts),
            ["other/x", "platform", "team/a", "team/c"]
        );
        assert!(
            matches!(&verdicts["team/b"], Verdict::LookupQuota(m) if m.contains("look up 4, and this rule would add 1 more (five)"))
        );
    }

    #[test]
    fn the_lookup_quota_follows_the_ready_status_across_a_restart() {
        // Two rules each reading 2 ConfigMaps under a quota of 2: the younger one is Ready
        // according to its status (it was first, the older one grew since): after a restart
        // it keeps its place.
        let ready_status = Some(RuleStatus {
            observed_generation: Some(1),
            conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: "Compiled".into(),
                message: String::new(),
                observed_generation: Some(1),
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    Timestamp::UNIX_EPOCH,
                ),
            }],
        });
        let mut table = RuleTable {
            lookup_quota: LookupQuota(2),
            ..RuleTable::default()
        };
        let mut older = looking_up(RuleId::namespaced("team", "older"), 10, &["a", "b"]);
        older.generation = Some(2);
        older.status = ready_status.clone();
        let mut younger = looking_up(RuleId::namespaced("team", "younger"), 20, &["c", "d"]);
        younger.status = ready_status;
        table.upsert(older);
        table.upsert(younger);
        let verdicts = published(&mut table);
        assert_eq!(ready_ids(&verdicts), ["team/younger"]);
        assert!(matches!(verdicts["team/older"], Verdict::LookupQuota(_)));
        // A quota of 0: no MutationRule may look anything up.
        let mut table = RuleTable {
            lookup_quota: LookupQuota(0),
            ..RuleTable::default()
        };
        table.upsert(looking_up(RuleId::namespaced("team", "r"), 10, &["a"]));
        table.upsert(observed(RuleId::namespaced("team", "plain"), &["Pod"]));
        assert_eq!(ready_ids(&published(&mut table)), ["team/plain"]);
    }

    #[test]
    fn quotas_refuse_the_newest_rules_of_a_namespace_past_its_count_or_bytes() {
        let quotas = Quotas {
            rules_per_namespace: 2,
            rule_bytes_per_namespace: 1000,
        };
        let ids: Vec<RuleId> = ["a", "b", "c"]
            .iter()
            .map(|n| RuleId::namespaced("team", n))
            .chain([
                RuleId::namespaced("other", "z"),
                RuleId::cluster("platform"),
            ])
            .collect();
        let mut verdicts = vec![Verdict::Ready; ids.len()];
        // Created: c first, then a, then b; other/z and the cluster rule are never counted
        // against team.
        let created = [Some(20), Some(30), Some(10), Some(5), Some(1)];
        let mut rules: Vec<_> = ids
            .iter()
            .zip(verdicts.iter_mut())
            .zip(created)
            .map(|((id, verdict), created)| {
                let created = created.and_then(|s| Timestamp::from_second(s).ok());
                (id, Some(100), created, verdict)
            })
            .collect();
        quotas.apply(&mut rules);
        let by_name: HashMap<String, Verdict> = rules
            .iter()
            .map(|(id, _, _, v)| (id.to_string(), (**v).clone()))
            .collect();
        assert_eq!(by_name["team/c"], Verdict::Ready);
        assert_eq!(by_name["team/a"], Verdict::Ready);
        let Verdict::QuotaExceeded(m) = &by_name["team/b"] else {
            panic!("team/b should be over the quota: {by_name:?}");
        };
        assert!(
            m.contains("--max-rules-per-namespace") && m.contains("team"),
            "{m}"
        );
        assert_eq!(by_name["other/z"], Verdict::Ready);
        assert_eq!(by_name["platform"], Verdict::Ready);

        // Bytes: the oldest rule that fits stays; one that would pass the quota is refused,
        // and a smaller one after it still fits.
        let quotas = Quotas {
            rules_per_namespace: 10,
            rule_bytes_per_namespace: 1000,
        };
        let mut verdicts = [Verdict::Ready, Verdict::Ready, Verdict::Ready];
        let sizes = [600, 500, 300];
        let mut rules: Vec<_> = ids[..3]
            .iter()
            .zip(verdicts.iter_mut())
            .zip(sizes)
            .enumerate()
            .map(|(i, ((id, v), size))| (id, Some(size), Timestamp::from_second(i as i64).ok(), v))
            .collect();
        quotas.apply(&mut rules);
        assert_eq!(*rules[0].3, Verdict::Ready);
        let Verdict::QuotaExceeded(m) = &*rules[1].3 else {
            panic!("the 500-byte rule should be over the quota");
        };
        assert!(
            m.contains("500 bytes")
                && m.contains("--max-rule-bytes-per-namespace")
                && m.contains("600 bytes of it used"),
            "{m}"
        );
        assert_eq!(*rules[2].3, Verdict::Ready);
        // A rule that is not Ready anyway takes nothing.
        let mut invalid = Verdict::Invalid("spec: bad".into());
        let mut ready = Verdict::Ready;
        let mut rules = vec![
            (
                &ids[0],
                Some(2000),
                Timestamp::from_second(1).ok(),
                &mut invalid,
            ),
            (
                &ids[1],
                Some(900),
                Timestamp::from_second(2).ok(),
                &mut ready,
            ),
        ];
        quotas.apply(&mut rules);
        assert_eq!(*rules[1].3, Verdict::Ready);
    }

    #[test]
    fn compiled_rules_are_measured_by_what_they_hold() {
        let small = compile(RuleId::namespaced("t", "s"), &spec(&["Pod"])).unwrap();
        let mut big = spec(&["Pod"]);
        big.conditions = serde_json::from_value(serde_json::json!(
            (0..16).map(|_| serde_json::json!({"path": "$.spec.containers[*].image", "matches": "^(\\w+)/(\\w+):(\\w+)$"})).collect::<Vec<_>>()
        ))
        .unwrap();
        let big = compile(RuleId::namespaced("t", "b"), &big).unwrap();
        assert!(small.held_bytes() < 4 << 10, "{}", small.held_bytes());
        // Sixteen Unicode regexes: their automata and caches, megabytes.
        assert!(big.held_bytes() > 1 << 20, "{}", big.held_bytes());
    }

    #[test]
    fn a_relist_replaces_the_rules_of_its_kind_only() {
        let mut table = RuleTable::default();
        let rule = |scope, event| Input::Rule(scope, Box::new(Ok(event)));
        table.apply(rule(
            Scope::Cluster,
            watcher::Event::Apply(observed(RuleId::cluster("gone"), &["Pod"])),
        ));
        table.apply(rule(
            Scope::Namespaced,
            watcher::Event::Apply(observed(RuleId::namespaced("ns", "stays"), &["Pod"])),
        ));
        table.apply(rule(Scope::Cluster, watcher::Event::Init));
        table.apply(rule(
            Scope::Cluster,
            watcher::Event::InitApply(observed(RuleId::cluster("new"), &["Pod"])),
        ));
        table.apply(rule(Scope::Cluster, watcher::Event::InitDone));
        let ids: Vec<String> = table.entries.keys().map(ToString::to_string).collect();
        assert_eq!(ids, ["new", "ns/stays"]);
        assert!(table.listed_cluster && !table.listed_namespaced);
    }

    #[test]
    fn status_updates_do_not_recompile_or_rebuild_the_index() {
        let mut table = RuleTable::default();
        let id = RuleId::cluster("r");
        table.upsert(observed(id.clone(), &["Pod"]));
        table.index_stale = false;
        table.snapshot_stale = false;
        let mut again = observed(id, &["Pod"]);
        again.resource_version = Some("2".into());
        again.status = Some(RuleStatus::default());
        table.upsert(again);
        assert!(table.snapshot_stale);
        assert!(!table.index_stale);
    }

    #[test]
    fn a_new_spec_or_a_recreated_rule_is_compiled_again() {
        let mut table = RuleTable::default();
        let id = RuleId::cluster("r");
        table.upsert(observed(id.clone(), &["Pod"]));
        let compiled = |table: &RuleTable| match &table.entries[&id].compiled {
            Ok(rule) => Arc::clone(rule),
            Err(e) => panic!("{e}"),
        };
        let first = compiled(&table);

        table.index_stale = false;
        table.upsert(observed(id.clone(), &["Pod"]));
        assert!(!table.index_stale);
        assert!(Arc::ptr_eq(&first, &compiled(&table)), "same spec: kept");

        table.upsert(observed(id.clone(), &["Pod", "ConfigMap"]));
        assert!(table.index_stale, "a changed spec rebuilds the index");
        assert_eq!(compiled(&table).kinds().len(), 2);
        assert_eq!(table.entries[&id].kinds, ["Pod", "ConfigMap"]);

        table.index_stale = false;
        let second = compiled(&table);
        let mut recreated = observed(id.clone(), &["Pod", "ConfigMap"]);
        recreated.uid = Some("8d4b2c6e-0000-4000-8000-000000000002".into());
        table.upsert(recreated);
        assert!(
            table.index_stale,
            "a new object with the same name and spec"
        );
        assert!(!Arc::ptr_eq(&second, &compiled(&table)));
    }

    #[test]
    fn equal_statuses_are_shared_and_dropped_when_unused() {
        let status = |message: &str| {
            Some(RuleStatus {
                observed_generation: Some(1),
                conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    reason: "Compiled".into(),
                    message: message.into(),
                    observed_generation: Some(1),
                    last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                    ),
                }],
            })
        };
        let mut table = RuleTable::default();
        for (name, message) in [("a", "same"), ("b", "same"), ("c", "other")] {
            let mut rule = observed(RuleId::cluster(name), &["Pod"]);
            rule.status = status(message);
            table.upsert(rule);
        }
        let shared = |table: &RuleTable, a: &str, b: &str| {
            let get = |name: &str| table.entries[&RuleId::cluster(name)].view.status.clone();
            matches!((get(a), get(b)), (Some(x), Some(y)) if Arc::ptr_eq(&x, &y))
        };
        assert!(shared(&table, "a", "b"));
        assert!(!shared(&table, "a", "c"));
        assert_eq!(table.statuses.len(), 2);

        let mut changed = observed(RuleId::cluster("c"), &["Pod"]);
        changed.status = status("same");
        table.upsert(changed);
        assert!(shared(&table, "a", "c"));
        let shared_state = Shared::new(Default::default());
        let readiness = Readiness::new(shared_state.clone());
        let (snapshot_tx, _snapshot_rx) = watch::channel(Arc::new(Snapshot::default()));
        let (needs_tx, _needs_rx) = watch::channel(Arc::new(Inputs::default()));
        table.apply(Input::Served(Some(Arc::new(served()))));
        table.listed_cluster = true;
        table.listed_namespaced = true;
        table.publish(&shared_state, &readiness, &snapshot_tx, &needs_tx);
        assert_eq!(table.statuses.len(), 1, "the unused status is dropped");
    }

    #[test]
    fn a_burst_of_changes_is_published_at_most_once_per_interval() {
        let start = Instant::now();
        let mut pacer = Pacer::default();
        assert!(pacer.publish_now(start), "the first change: at once");
        pacer.published(start);
        let soon = start + Duration::from_millis(10);
        assert!(!pacer.publish_now(soon), "a change right after: later");
        assert_eq!(pacer.due, Some(start + PUBLISH_INTERVAL));
        assert!(
            !pacer.publish_now(soon + Duration::from_millis(1)),
            "more changes join the publish that is due"
        );
        assert_eq!(pacer.due, Some(start + PUBLISH_INTERVAL));
        let due = start + PUBLISH_INTERVAL;
        pacer.published(due);
        assert_eq!(pacer.due, None);
        let quiet = due + PUBLISH_INTERVAL * 3;
        assert!(
            pacer.publish_now(quiet),
            "after a quiet spell: at once again"
        );
    }

    #[test]
    fn a_status_write_shares_every_other_rule_with_the_previous_snapshot() {
        let shared = Shared::new(Default::default());
        let readiness = Readiness::new(shared.clone());
        let (snapshot_tx, snapshot_rx) = watch::channel(Arc::new(Snapshot::default()));
        let (needs_tx, _needs_rx) = watch::channel(Arc::new(Inputs::default()));
        let mut table = RuleTable::default();
        table.apply(Input::Served(Some(Arc::new(served()))));
        table.listed_cluster = true;
        table.listed_namespaced = true;
        for name in ["a", "b", "c"] {
            table.upsert(observed(RuleId::cluster(name), &["Pod"]));
        }
        assert!(table.publish(&shared, &readiness, &snapshot_tx, &needs_tx));
        let first = snapshot_rx.borrow().clone();
        let index = shared.rules.load_full();
        assert!(
            !table.publish(&shared, &readiness, &snapshot_tx, &needs_tx),
            "nothing new"
        );

        let mut written = observed(RuleId::cluster("b"), &["Pod"]);
        written.resource_version = Some("2".into());
        written.status = Some(RuleStatus::default());
        table.upsert(written);
        assert!(table.publish(&shared, &readiness, &snapshot_tx, &needs_tx));
        let second = snapshot_rx.borrow().clone();
        assert!(
            Arc::ptr_eq(&index, &shared.rules.load_full()),
            "the index is kept"
        );
        let same: Vec<bool> = first
            .rules
            .iter()
            .zip(&second.rules)
            .map(|(a, b)| Arc::ptr_eq(a, b))
            .collect();
        assert_eq!(same, [true, false, true]);
        assert_eq!(second.rules[1].resource_version.as_deref(), Some("2"));
        assert!(second.rules.iter().all(|r| r.verdict.is_ready()));
    }

    #[test]
    fn publishing_swaps_in_only_ready_rules() {
        let shared = Shared::new(Default::default());
        let readiness = Readiness::new(shared.clone());
        let (snapshot_tx, snapshot_rx) = watch::channel(Arc::new(Snapshot::default()));
        let (needs_tx, needs_rx) = watch::channel(Arc::new(Inputs::default()));
        let mut table = RuleTable::default();
        let rule = |scope, event| Input::Rule(scope, Box::new(Ok(event)));
        table.apply(rule(Scope::Cluster, watcher::Event::Init));
        for (name, kind) in [("pods", "Pod"), ("widgets", "example.com/v9/Widget")] {
            table.apply(rule(
                Scope::Cluster,
                watcher::Event::InitApply(observed(RuleId::cluster(name), &[kind])),
            ));
        }
        table.apply(rule(Scope::Cluster, watcher::Event::InitDone));
        table.publish(&shared, &readiness, &snapshot_tx, &needs_tx);
        assert!(shared.rules.load().is_empty(), "nothing before discovery");

        table.apply(Input::Served(Some(Arc::new(served()))));
        table.publish(&shared, &readiness, &snapshot_tx, &needs_tx);
        assert!(
            shared.rules.load().is_empty() && needs_rx.borrow().served.is_none(),
            "nothing before the MutationRules are listed too"
        );

        table.apply(rule(Scope::Namespaced, watcher::Event::Init));
        table.apply(rule(Scope::Namespaced, watcher::Event::InitDone));
        table.publish(&shared, &readiness, &snapshot_tx, &needs_tx);
        let index = shared.rules.load();
        let ids: Vec<String> = index.rules().iter().map(|r| r.id.to_string()).collect();
        assert_eq!(ids, ["pods"]);
        assert_eq!(needs_rx.borrow().rules.len(), 1);
        let verdicts: Vec<bool> = snapshot_rx
            .borrow()
            .rules
            .iter()
            .map(|r| r.verdict.is_ready())
            .collect();
        assert_eq!(verdicts, [true, false]);
        assert!(!shared.is_synced(), "Namespaces have not been listed yet");
        readiness.done(Readiness::NAMESPACES);
        assert!(
            !shared.is_synced(),
            "the gated Pods have not been listed yet"
        );
        readiness.done(Readiness::GATED_PODS);
        assert!(
            !shared.is_synced(),
            "the looked-up objects have not been listed yet"
        );
        readiness.done(Readiness::LOOKUPS);
        assert!(shared.is_synced());
    }
}
