//! Gates: a rule's `spec.gate`, compiled. At admission the rule adds its scheduling gate
//! (`initium.dev/<rule>`) to a new Pod; the gate controller (`controller::gate`) removes it
//! once every dependency holds. This file is the pure half: the gate's name, its
//! dependencies with their namespaces resolved, the tests on a dependency's state, and the
//! compile-time checks (own namespace, Pods that would wait on themselves).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::Value;

use crate::api::{self, DEPENDENCY_KINDS, GATE_PREFIX, OnTimeout, exactly_one_of_message};

use super::duration::parse_duration;
use super::error::Errors;
use super::glob::Glob;
use super::matching::{Conditions, Selector};
use super::subject::RuleId;

/// Longest name part of a qualified name (`prefix/name`), as Kubernetes allows.
const MAX_NAME_PART: usize = 63;

/// The default `gate.timeout`.
pub const DEFAULT_GATE_TIMEOUT: Duration = Duration::from_secs(600);

/// A Deployment's default `progressDeadlineSeconds`: a gate that holds Pods longer makes the
/// Deployment report `ProgressDeadlineExceeded` (it still rolls out once released).
pub const DEPLOYMENT_PROGRESS_DEADLINE: Duration = Duration::from_secs(600);

/// The gate of a rule, compiled: what the gate controller acts on.
#[derive(Clone, Debug)]
pub struct CompiledGate {
    /// The scheduling gate's name, `initium.dev/…` (see [`gate_name`]).
    pub name: String,
    pub wait_for: Vec<Dependency>,
    pub timeout: Duration,
    pub on_timeout: OnTimeout,
}

/// How long the conditions of one `object` dependency may take to judge one object.
pub const OBJECT_JUDGE_BUDGET: std::time::Duration = std::time::Duration::from_millis(10);

/// What of an object the conditions of an `object` dependency read: the gate controller keeps
/// only that of the object it watches (a ConfigMap's megabyte of data is not kept for a
/// condition on one label).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reads {
    /// Some condition may read anything (`$..x`, or `$` inside a filter).
    All,
    /// Only these subtrees, each the names from the root to it (none: the conditions only
    /// ask that the object exists). No path is under another.
    Under(Vec<Vec<String>>),
}

impl Reads {
    pub(crate) fn of(conditions: &Conditions) -> Reads {
        let Some(mut paths) = conditions.reads() else {
            return Reads::All;
        };
        // Sorted, a path comes right before the paths under it.
        paths.sort();
        let mut kept: Vec<Vec<String>> = Vec::new();
        for path in paths {
            if !kept.iter().any(|k| path.starts_with(k)) {
                kept.push(path);
            }
        }
        if kept.iter().any(Vec::is_empty) {
            return Reads::All;
        }
        Reads::Under(kept)
    }

    /// Drops from `object` what the conditions do not read. The conditions hold on what is
    /// left exactly when they hold on the whole: every value they select, and everything a
    /// filter under it looks at, is under one of the paths (a path that meets a value that is
    /// not an object keeps that value whole).
    pub fn keep(&self, object: &mut Value) {
        if let Reads::Under(paths) = self {
            let paths: Vec<&[String]> = paths.iter().map(Vec::as_slice).collect();
            trim(object, &paths);
        }
    }
}

fn trim(value: &mut Value, paths: &[&[String]]) {
    if paths.iter().any(|p| p.is_empty()) {
        return;
    }
    let Value::Object(map) = value else {
        return;
    };
    map.retain(|key, _| paths.iter().any(|p| p.first() == Some(key)));
    for (key, child) in map.iter_mut() {
        let under: Vec<&[String]> = paths
            .iter()
            .filter_map(|p| p.split_first())
            .filter(|(first, _)| *first == key)
            .map(|(_, rest)| rest)
            .collect();
        trim(child, &under);
    }
}

thread_local! {
    /// How many times [`Dependency::object_holds`] ran on this thread: tests count the
    /// judgements of the gate controller with it (one increment per judgement, which is
    /// memoized per object change).
    pub static JUDGED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A named object; `namespace: None` is the waiting Pod's own namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub namespace: Option<String>,
    pub name: String,
}

impl Target {
    fn of(r: &api::NamedRef) -> Target {
        Target {
            namespace: r.namespace.clone(),
            name: r.name.clone(),
        }
    }

    /// The namespace, the Pod's own when the rule named none.
    pub fn namespace<'a>(&'a self, pod_namespace: &'a str) -> &'a str {
        self.namespace.as_deref().unwrap_or(pod_namespace)
    }
}

/// One dependency of a gate.
#[derive(Clone, Debug)]
pub enum Dependency {
    /// At least one ready endpoint in the Service's EndpointSlices.
    Service(Target),
    /// The Job has succeeded (and stays satisfied once seen so).
    Job(Target),
    /// At least one Ready Pod matching `selector`.
    Pods {
        namespace: Option<String>,
        selector: Selector,
        /// The selector as written, for messages and events.
        text: String,
    },
    /// Any object whose conditions hold.
    Object {
        api_version: String,
        kind: String,
        target: Target,
        conditions: Conditions,
        /// What of the object the conditions read: all the gate controller keeps of it.
        reads: Reads,
        /// The conditions as written (canonical JSON): two dependencies with the same text
        /// judge an object the same way, so one judgement serves every Pod that waits.
        text: std::sync::Arc<str>,
    },
    /// At least one Ready Pod of the DaemonSet; on release the Pod is narrowed to those nodes.
    DaemonSet(Target),
}

impl Dependency {
    /// An `object` dependency; `text` is its conditions as written.
    pub fn object(
        api_version: &str,
        kind: &str,
        target: Target,
        conditions: Conditions,
        text: &str,
    ) -> Dependency {
        Dependency::Object {
            api_version: api_version.to_string(),
            kind: kind.to_string(),
            target,
            reads: Reads::of(&conditions),
            conditions,
            text: text.into(),
        }
    }

    /// The dependency's namespace for a Pod in `pod_namespace`.
    pub fn namespace<'a>(&'a self, pod_namespace: &'a str) -> &'a str {
        match self {
            Dependency::Service(t) | Dependency::Job(t) | Dependency::DaemonSet(t) => {
                t.namespace(pod_namespace)
            }
            Dependency::Pods { namespace, .. } => namespace.as_deref().unwrap_or(pod_namespace),
            Dependency::Object { target, .. } => target.namespace(pod_namespace),
        }
    }

    /// `Service payments/mariadb`, for events and logs, for a Pod in `pod_namespace`.
    pub fn describe(&self, pod_namespace: &str) -> String {
        let ns = self.namespace(pod_namespace);
        match self {
            Dependency::Service(t) => format!("Service {ns}/{}", t.name),
            Dependency::Job(t) => format!("Job {ns}/{}", t.name),
            Dependency::DaemonSet(t) => format!("DaemonSet {ns}/{}", t.name),
            Dependency::Pods { text, .. } => format!("Pods in {ns} matching {text}"),
            // A namespace the rule named; otherwise the kind may be cluster-scoped (discovery
            // tells the controller), so none is made up here.
            Dependency::Object { kind, target, .. } => match &target.namespace {
                Some(ns) => format!("{kind} {ns}/{}", target.name),
                None => format!("{kind} {}", target.name),
            },
        }
    }

    /// For `object`: whether its conditions hold on `object` (no conditions: it exists).
    /// The gate controller judges every waiting Pod's dependencies in one loop, so a tenant's
    /// slow conditions (each search is bounded, see `limits::REGEX_SEARCH_WORK`) must not hold
    /// up the releases of other namespaces: the clock is read before every condition, and
    /// conditions still unjudged after [`OBJECT_JUDGE_BUDGET`] do not hold (the Pod waits, and
    /// its gate's timeout decides).
    pub fn object_holds(&self, object: &Value) -> bool {
        JUDGED.with(|n| n.set(n.get() + 1));
        match self {
            // A condition whose query fails on this object does not hold.
            Dependency::Object { conditions, .. } => conditions
                .hold_until(
                    object,
                    Some(std::time::Instant::now() + OBJECT_JUDGE_BUDGET),
                )
                .unwrap_or(false),
            _ => false,
        }
    }

    /// For `pods`: whether a Pod with these labels is selected.
    pub fn selects(&self, labels: &std::collections::BTreeMap<String, String>) -> bool {
        match self {
            Dependency::Pods { selector, .. } => selector.matches_map(labels),
            _ => false,
        }
    }
}

/// The scheduling gate of a rule: `initium.dev/<namespace>.<name>` for a MutationRule,
/// `initium.dev/cluster.<name>` for a ClusterMutationRule (a namespace has no dots, so the two
/// never meet). When that is longer than a qualified name allows, or has characters a gate
/// name may not, the name part is shortened and ends with a hash of the whole, so it stays
/// unique and stable.
pub fn gate_name(id: &RuleId) -> String {
    let full = match &id.namespace {
        Some(ns) => format!("{ns}.{}", id.name),
        None => format!("cluster.{}", id.name),
    };
    let valid = full.len() <= MAX_NAME_PART
        && full
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        return format!("{GATE_PREFIX}{full}");
    }
    let hash = format!("{:016x}", fnv1a(full.as_bytes()));
    let keep: String = full
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(MAX_NAME_PART - hash.len() - 1)
        .collect();
    format!("{GATE_PREFIX}{keep}-{hash}")
}

/// FNV-1a, 64 bits: stable across builds and platforms (unlike `DefaultHasher`).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// What the rule's own matching says about which Pods it gates, for the self-wait check.
pub(crate) struct OwnPods<'a> {
    /// `spec.match.labels`.
    pub labels: Option<&'a LabelSelector>,
    /// `spec.match.namespaces` (ClusterMutationRule).
    pub namespaces: &'a [String],
    /// `spec.exclude`, when it has only `labels`.
    pub exclude_labels: Option<&'a LabelSelector>,
}

/// Compiles `spec.gate`; every problem is pushed to `errors` with its field path.
pub(crate) fn compile(
    id: &RuleId,
    gate: &api::Gate,
    own: &OwnPods,
    regex_limit: usize,
    errors: &mut Errors,
) -> Option<CompiledGate> {
    let timeout = match gate.timeout.as_deref() {
        None => Some(DEFAULT_GATE_TIMEOUT),
        Some(t) => match parse_duration(t) {
            Ok(d) if d.is_zero() => {
                errors.push("spec.gate.timeout", "the timeout must be more than zero");
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                errors.push("spec.gate.timeout", e);
                None
            }
        },
    };
    if gate.wait_for.is_empty() {
        errors.push("spec.gate.waitFor", "list at least one dependency");
    }
    let mut wait_for = Vec::new();
    for (i, d) in gate.wait_for.iter().enumerate() {
        let at = format!("spec.gate.waitFor[{i}]");
        let set = [
            d.service.is_some(),
            d.job.is_some(),
            d.pods.is_some(),
            d.object.is_some(),
            d.daemon_set.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if set != 1 {
            errors.push(
                &at,
                format!(
                    "{} (found {set})",
                    exactly_one_of_message(&DEPENDENCY_KINDS)
                ),
            );
            continue;
        }
        // DESIGN.md: a MutationRule may only wait on objects in its own namespace.
        let namespace = [
            (
                "service",
                d.service.as_ref().and_then(|r| r.namespace.as_deref()),
            ),
            ("job", d.job.as_ref().and_then(|r| r.namespace.as_deref())),
            ("pods", d.pods.as_ref().and_then(|r| r.namespace.as_deref())),
            (
                "object",
                d.object.as_ref().and_then(|r| r.namespace.as_deref()),
            ),
            (
                "daemonSet",
                d.daemon_set.as_ref().and_then(|r| r.namespace.as_deref()),
            ),
        ]
        .into_iter()
        .find_map(|(field, ns)| ns.map(|ns| (field, ns)));
        if let (Some(own_ns), Some((field, ns))) = (id.namespace.as_deref(), namespace)
            && ns != own_ns
        {
            errors.push(
                format!("{at}.{field}.namespace"),
                format!("a MutationRule may only wait on objects in its own namespace ({own_ns}), not {ns:?}; leave it out, or use a ClusterMutationRule"),
            );
            continue;
        }
        for (field, name) in [
            ("service", d.service.as_ref().map(|r| r.name.as_str())),
            ("job", d.job.as_ref().map(|r| r.name.as_str())),
            ("object", d.object.as_ref().map(|r| r.name.as_str())),
            ("daemonSet", d.daemon_set.as_ref().map(|r| r.name.as_str())),
        ] {
            if name.is_some_and(str::is_empty) {
                errors.push(format!("{at}.{field}.name"), "give the object's name");
            }
        }
        let dependency = if let Some(r) = &d.service {
            Dependency::Service(Target::of(r))
        } else if let Some(r) = &d.job {
            Dependency::Job(Target::of(r))
        } else if let Some(r) = &d.daemon_set {
            Dependency::DaemonSet(Target::of(r))
        } else if let Some(p) = &d.pods {
            let field = format!("{at}.pods.selector");
            let before = errors.errors.len();
            let selector = Selector::compile(&p.selector, &field, errors);
            if errors.errors.len() == before {
                check_self_wait(p, own, &field, errors);
            }
            Dependency::Pods {
                namespace: p.namespace.clone(),
                selector,
                text: describe_selector(&p.selector),
            }
        } else if let Some(o) = &d.object {
            if o.api_version.is_empty() || o.kind.is_empty() {
                errors.push(
                    format!("{at}.object"),
                    "give the object's apiVersion and kind",
                );
            }
            if let Some(own_ns) = id.namespace.as_deref()
                && is_cluster_scoped(&o.api_version, &o.kind)
            {
                errors.push(
                    format!("{at}.object.kind"),
                    cluster_scoped_message(&o.api_version, &o.kind, own_ns),
                );
            }
            let conditions = Conditions::compile_at(
                &o.conditions,
                &format!("{at}.object.conditions"),
                regex_limit,
                errors,
            );
            Dependency::object(
                &o.api_version,
                &o.kind,
                Target {
                    namespace: o.namespace.clone(),
                    name: o.name.clone(),
                },
                conditions,
                &serde_json::to_string(&o.conditions).unwrap_or_default(),
            )
        } else {
            continue;
        };
        wait_for.push(dependency);
    }
    Some(CompiledGate {
        name: gate_name(id),
        wait_for,
        timeout: timeout?,
        on_timeout: gate.on_timeout,
    })
}

/// Kinds every Kubernetes cluster (and initium) serves cluster-scoped, by API group: a
/// MutationRule's `object` dependency may not name them. A MutationRule is written by a
/// namespace's owner, and the gate controller reads with initium's own permissions: a gate on
/// an object outside the namespace would tell its owner, one release at a time, what the
/// object says. Kinds not listed here (custom resources) are checked through discovery when
/// the rule is judged, and by the gate controller before it watches them.
pub const CLUSTER_SCOPED_KINDS: &[(&str, &[&str])] = &[
    (
        "",
        &["Namespace", "Node", "PersistentVolume", "ComponentStatus"],
    ),
    (
        "admissionregistration.k8s.io",
        &[
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "MutatingAdmissionPolicy",
            "MutatingAdmissionPolicyBinding",
        ],
    ),
    ("apiextensions.k8s.io", &["CustomResourceDefinition"]),
    ("apiregistration.k8s.io", &["APIService"]),
    (
        "certificates.k8s.io",
        &["CertificateSigningRequest", "ClusterTrustBundle"],
    ),
    (
        "flowcontrol.apiserver.k8s.io",
        &["FlowSchema", "PriorityLevelConfiguration"],
    ),
    (api::GROUP, &["ClusterMutationRule"]),
    ("internal.apiserver.k8s.io", &["StorageVersion"]),
    (
        "networking.k8s.io",
        &["IngressClass", "IPAddress", "ServiceCIDR"],
    ),
    ("node.k8s.io", &["RuntimeClass"]),
    (
        "rbac.authorization.k8s.io",
        &["ClusterRole", "ClusterRoleBinding"],
    ),
    ("resource.k8s.io", &["DeviceClass", "ResourceSlice"]),
    ("scheduling.k8s.io", &["PriorityClass"]),
    (
        "storage.k8s.io",
        &[
            "StorageClass",
            "CSIDriver",
            "CSINode",
            "VolumeAttachment",
            "VolumeAttributesClass",
        ],
    ),
];

/// Whether `apiVersion`/`kind` is one of the [`CLUSTER_SCOPED_KINDS`].
pub fn is_cluster_scoped(api_version: &str, kind: &str) -> bool {
    let group = api_version.split_once('/').map_or("", |(group, _)| group);
    CLUSTER_SCOPED_KINDS
        .iter()
        .any(|(g, kinds)| *g == group && kinds.contains(&kind))
}

/// Why a MutationRule in `namespace` may not wait on the cluster-scoped `api_version`/`kind`,
/// and what to do instead (the rule's field path goes before it).
pub fn cluster_scoped_message(api_version: &str, kind: &str, namespace: &str) -> String {
    format!(
        "{kind} ({api_version}) is cluster-scoped, and a MutationRule may only wait on \
         namespaced objects of its own namespace ({namespace}) because initium reads them with \
         its own permissions; wait on an object in {namespace}, or use a ClusterMutationRule \
         (written by a cluster administrator)"
    )
}

/// A rule whose own Pods satisfy a `pods` dependency would hold them until the timeout: they
/// are never Ready while gated. Refused unless the rule's matching provably keeps the
/// selected Pods out (a label the selector requires that `match.labels` forbids, a namespace
/// outside `match.namespaces`, or an `exclude.labels` the selector implies).
fn check_self_wait(dep: &api::PodsRef, own: &OwnPods, field: &str, errors: &mut Errors) {
    if let Some(ns) = dep.namespace.as_deref()
        && !own.namespaces.is_empty()
        && !own.namespaces.iter().any(|g| Glob::new(g).matches(ns))
    {
        return;
    }
    if own
        .labels
        .is_some_and(|m| selectors_disjoint(m, &dep.selector))
    {
        return;
    }
    if own
        .exclude_labels
        .is_some_and(|e| selector_implies(&dep.selector, e))
    {
        return;
    }
    errors.push(
        field,
        "this rule could hold the very Pods it waits for, and gated Pods never become Ready, so they would wait on themselves until the timeout; keep them out of the rule with `exclude: {labels: <the same selector>}`, or narrow `match.labels` so it cannot select them",
    );
}

/// Equalities a selector requires: `matchLabels` and single-value `In`.
fn required_values(s: &LabelSelector) -> Vec<(&str, &str)> {
    let mut out: Vec<(&str, &str)> = s
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    for e in s.match_expressions.iter().flatten() {
        if e.operator == "In"
            && let Some([v]) = e.values.as_deref()
        {
            out.push((e.key.as_str(), v.as_str()));
        }
    }
    out
}

/// True when no label set can satisfy both selectors.
fn selectors_disjoint(a: &LabelSelector, b: &LabelSelector) -> bool {
    let contradicts = |req: &[(&str, &str)], other: &LabelSelector| {
        req.iter().any(|(k, v)| {
            let label_conflict = other
                .match_labels
                .iter()
                .flatten()
                .any(|(ok, ov)| ok == k && ov != v);
            let expr_conflict = other.match_expressions.iter().flatten().any(|e| {
                e.key == *k
                    && match e.operator.as_str() {
                        "In" => e.values.iter().flatten().all(|x| x != v),
                        "NotIn" => e.values.iter().flatten().any(|x| x == v),
                        "DoesNotExist" => true,
                        _ => false,
                    }
            });
            label_conflict || expr_conflict
        })
    };
    contradicts(&required_values(a), b) || contradicts(&required_values(b), a)
}

/// True when every label set `a` selects is selected by `b` too (checked syntactically: each
/// of `b`'s requirements appears in `a`).
fn selector_implies(a: &LabelSelector, b: &LabelSelector) -> bool {
    let a_values = required_values(a);
    let labels_ok = b
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| a_values.contains(&(k.as_str(), v.as_str())));
    let exprs_ok = b.match_expressions.iter().flatten().all(|e| {
        a.match_expressions.iter().flatten().any(|x| x == e)
            || (e.operator == "Exists" && a_values.iter().any(|(k, _)| *k == e.key))
            || (e.operator == "In"
                && a_values
                    .iter()
                    .any(|(k, v)| *k == e.key && e.values.iter().flatten().any(|x| x == v)))
    });
    let b_empty = b.match_labels.as_ref().is_none_or(|m| m.is_empty())
        && b.match_expressions.as_ref().is_none_or(|m| m.is_empty());
    !b_empty && labels_ok && exprs_ok
}

/// `{app=db,tier in (a,b)}`, for messages.
fn describe_selector(s: &LabelSelector) -> String {
    let mut parts: Vec<String> = s
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in s.match_expressions.iter().flatten() {
        let values = e.values.as_deref().unwrap_or_default().join(",");
        parts.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "Exists" => e.key.clone(),
            "DoesNotExist" => format!("!{}", e.key),
            other => format!("{} {other}", e.key),
        });
    }
    format!("{{{}}}", parts.join(","))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn slow_object_conditions_are_judged_within_their_budget() {
        // 30 searches of 24 KB on which the lazy DFA thrashes, the match at the end of each:
        // judged in full they take far longer than the loop that releases every Pod can wait.
        let specs: Vec<api::Condition> = serde_json::from_value(serde_json::json!(
            (0..30)
                .map(|_| serde_json::json!({"path": "$.data.blob", "matches": "a[ab]{100}c"}))
                .collect::<Vec<_>>()
        ))
        .unwrap_or_default();
        let mut errors = Errors::default();
        let conditions = Conditions::compile_at(&specs, "c", 1 << 20, &mut errors);
        assert!(errors.errors.is_empty());
        let dependency = Dependency::object("v1", "ConfigMap", cm(), conditions, "slow");
        // Aperiodic a/b text with a `c` every 97 bytes (a candidate end the search must try):
        // each new position is a new state of the lazy DFA.
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut blob: String = (0..24_000)
            .map(|i| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                if i % 97 == 96 {
                    'c'
                } else if seed.is_multiple_of(2) {
                    'a'
                } else {
                    'b'
                }
            })
            .collect();
        blob.push('a');
        blob.push_str(&"b".repeat(100));
        blob.push('c');
        let object = serde_json::json!({"data": {"blob": blob}});
        let started = std::time::Instant::now();
        assert!(!dependency.object_holds(&object));
        // One condition may run past the budget (a search cannot be interrupted), not 30.
        assert!(
            started.elapsed() < OBJECT_JUDGE_BUDGET * 8,
            "{:?}",
            started.elapsed()
        );
        // Quick conditions are judged as before.
        let quick: Vec<api::Condition> =
            serde_json::from_value(serde_json::json!([{"path": "$.data.blob", "exists": true}]))
                .unwrap_or_default();
        let mut errors = Errors::default();
        let quick = Dependency::object(
            "v1",
            "ConfigMap",
            cm(),
            Conditions::compile_at(&quick, "c", 1 << 20, &mut errors),
            "quick",
        );
        assert!(quick.object_holds(&object));
    }

    fn cm() -> Target {
        Target {
            namespace: None,
            name: "cm".into(),
        }
    }

    fn reads_of(conditions: serde_json::Value) -> (Dependency, Reads) {
        let specs: Vec<api::Condition> = serde_json::from_value(conditions).unwrap();
        let mut errors = Errors::default();
        let compiled = Conditions::compile_at(&specs, "c", 1 << 20, &mut errors);
        assert!(errors.errors.is_empty(), "{:?}", errors.errors);
        let dependency = Dependency::object("v1", "ConfigMap", cm(), compiled, "t");
        let Dependency::Object { reads, .. } = &dependency else {
            unreachable!()
        };
        let reads = reads.clone();
        (dependency, reads)
    }

    #[test]
    fn an_object_is_kept_only_where_its_conditions_read_and_judged_the_same() {
        let object = serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "cm", "labels": {"ready": "yes", "team": "a"},
                         "annotations": {"big": "x".repeat(10_000)}},
            "data": {"blob": "y".repeat(100_000), "mode": "on"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        });
        let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cases = [
            (
                serde_json::json!([{"path": "$.metadata.labels.ready", "equals": "yes"}]),
                Reads::Under(vec![path(&["metadata", "labels", "ready"])]),
                true,
            ),
            (
                serde_json::json!([
                    {"path": "$.status.conditions[?@.type == 'Ready'].status", "equals": "True"},
                    {"path": "$.data['mode']", "equals": "on"},
                    {"path": "$.data.mode", "exists": true},
                    {"path": "$.status", "exists": true},
                    {"path": "$.metadata.labels.team", "in": "$.metadata.labels.*"}
                ]),
                Reads::Under(vec![
                    path(&["data", "mode"]),
                    path(&["metadata", "labels"]),
                    path(&["status"]),
                ]),
                true,
            ),
            (
                serde_json::json!([{"path": "$.data.mode", "equals": "off"}]),
                Reads::Under(vec![path(&["data", "mode"])]),
                false,
            ),
            // No conditions: the object only has to exist.
            (serde_json::json!([]), Reads::Under(vec![]), true),
            // Descendants and the root inside a filter may read anything.
            (
                serde_json::json!([{"path": "$..mode", "equals": "on"}]),
                Reads::All,
                true,
            ),
            (
                serde_json::json!([{"path": "$.data[?@ == $.data.mode]", "exists": true}]),
                Reads::All,
                true,
            ),
        ];
        for (conditions, want, holds) in cases {
            let (dependency, reads) = reads_of(conditions.clone());
            assert_eq!(reads, want, "{conditions}");
            let mut kept = object.clone();
            reads.keep(&mut kept);
            assert_eq!(dependency.object_holds(&object), holds, "{conditions}");
            assert_eq!(
                dependency.object_holds(&kept),
                holds,
                "{conditions} on {kept}"
            );
            if reads != Reads::All {
                let size = serde_json::to_string(&kept).unwrap().len();
                assert!(size < 200, "{conditions} kept {size} bytes: {kept}");
            }
        }
    }

    fn selector(labels: &[(&str, &str)]) -> LabelSelector {
        LabelSelector {
            match_labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            match_expressions: None,
        }
    }

    #[test]
    fn gate_names_are_qualified_unique_and_stable() {
        let a = gate_name(&RuleId::namespaced("payments", "wait-db"));
        assert_eq!(a, "initium.dev/payments.wait-db");
        let c = gate_name(&RuleId::cluster("wait-db"));
        assert_eq!(c, "initium.dev/cluster.wait-db");
        let long = "x".repeat(200);
        let l1 = gate_name(&RuleId::namespaced("payments", &long));
        let l2 = gate_name(&RuleId::namespaced("payment", &format!("s.{long}")));
        assert_ne!(l1, l2, "a shortened name keeps a hash of the whole");
        for name in [&l1, &l2] {
            let part = name.strip_prefix(GATE_PREFIX).unwrap();
            assert!(part.len() <= 63, "{name}");
            assert!(part.chars().last().unwrap().is_ascii_alphanumeric());
        }
        assert_eq!(l1, gate_name(&RuleId::namespaced("payments", &long)));
    }

    /// The errors of compiling a rule `id` whose gate waits on `object`, one per line.
    fn object_errors(id: RuleId, object: serde_json::Value) -> String {
        let spec: api::RuleSpec = serde_json::from_value(serde_json::json!({
            "match": {"kinds": ["Pod"]},
            "gate": {"waitFor": [{"service": {"name": "db"}}, {"object": object}]},
        }))
        .unwrap();
        match super::super::compile(id, &spec) {
            Ok(_) => String::new(),
            Err(e) => e
                .errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    #[test]
    fn a_mutation_rule_may_not_wait_on_a_well_known_cluster_scoped_kind() {
        for (group, kinds) in CLUSTER_SCOPED_KINDS {
            for kind in *kinds {
                let api_version = if group.is_empty() {
                    "v1".to_string()
                } else {
                    format!("{group}/v1")
                };
                let object =
                    serde_json::json!({"apiVersion": api_version, "kind": kind, "name": "x"});
                let error = object_errors(RuleId::namespaced("team", "peek"), object.clone());
                assert_eq!(
                    error,
                    format!(
                        "spec.gate.waitFor[1].object.kind: {kind} ({api_version}) is cluster-scoped, \
                         and a MutationRule may only wait on namespaced objects of its own namespace \
                         (team) because initium reads them with its own permissions; wait on an \
                         object in team, or use a ClusterMutationRule (written by a cluster \
                         administrator)"
                    )
                );
                // Naming its own namespace does not make it namespaced.
                let mut in_own = object.clone();
                in_own["namespace"] = "team".into();
                let error = object_errors(RuleId::namespaced("team", "peek"), in_own);
                assert!(error.contains(".object.kind: "), "{error}");
                // A ClusterMutationRule may (its author can read the cluster).
                assert_eq!(object_errors(RuleId::cluster("peek"), object), "");
            }
        }
    }

    #[test]
    fn the_cluster_scoped_kinds_the_findings_named_are_refused() {
        for (api_version, kind) in [
            ("v1", "Namespace"),
            ("initium.dev/v1alpha1", "ClusterMutationRule"),
            ("rbac.authorization.k8s.io/v1", "ClusterRole"),
            (
                "admissionregistration.k8s.io/v1",
                "ValidatingAdmissionPolicyBinding",
            ),
        ] {
            assert!(is_cluster_scoped(api_version, kind), "{api_version} {kind}");
        }
        // Namespaced kinds, and the same name in another group, are left to discovery.
        for (api_version, kind) in [
            ("v1", "ConfigMap"),
            ("apps/v1", "Deployment"),
            ("example.com/v1", "Namespace"),
            ("rbac.authorization.k8s.io/v1", "Role"),
        ] {
            assert!(
                !is_cluster_scoped(api_version, kind),
                "{api_version} {kind}"
            );
        }
        let own = object_errors(
            RuleId::namespaced("team", "own"),
            serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "name": "settings"}),
        );
        assert_eq!(own, "");
    }

    #[test]
    fn disjoint_and_implied_selectors() {
        let app_web = selector(&[("app", "web")]);
        let app_db = selector(&[("app", "db")]);
        let tier = selector(&[("tier", "x")]);
        assert!(selectors_disjoint(&app_web, &app_db));
        assert!(!selectors_disjoint(&app_web, &tier));
        assert!(selector_implies(
            &selector(&[("app", "db"), ("x", "y")]),
            &app_db
        ));
        assert!(!selector_implies(&tier, &app_db));
        assert!(!selector_implies(&tier, &selector(&[])));
    }
}
