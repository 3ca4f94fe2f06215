//! Rules served by the API server itself: a Ready rule compiled to a
//! MutatingAdmissionPolicy and its binding (`admissionregistration.k8s.io/v1`), when, and only
//! when, the policy does exactly what the rule does.
//!
//! [`compile_policy`] decides for one rule: every part of the rule must have an exact CEL or
//! match-constraint equivalent, or the first part that has none is the reason
//! ([`NotCompiled`]), shown in the rule's status. [`plan`] decides for all the Ready rules at
//! once, because of order: the API server runs every MutatingAdmissionPolicy before any
//! mutating webhook and in no defined order among themselves (docs/research/
//! mutating-admission-policy-order.md). So a rule is served by the API server only when no
//! rule before it in initium's order may act on the same objects: then running it first, in
//! any order against the other compiled rules, is running it in its place.

mod cel;
mod mutate;
mod schema;

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::{Value, json};

use crate::api::{Condition, FailurePolicy, MatchResources, Mode, Operation, RuleSpec};
use crate::kind::{Gvk, KindPattern, Segment};
use crate::subject::RuleId;
use cel::{Path, any_glob, quote, selector};

/// The API version of the generated objects.
pub const POLICY_API_VERSION: &str = "admissionregistration.k8s.io/v1";
/// Label on every generated policy and binding: which initium installation (its webhook
/// configuration name) owns it.
pub const OWNER_LABEL: &str = "initium.dev/compiled-by";
/// Label: the namespace of the MutationRule a policy was compiled from (absent for a
/// ClusterMutationRule).
pub const RULE_NAMESPACE_LABEL: &str = "initium.dev/rule-namespace";
/// Annotation: the rule a policy was compiled from, as `initium.dev/mutated-by` names it.
pub const RULE_ANNOTATION: &str = "initium.dev/rule";
/// Annotation: the rule's kind.
pub const RULE_KIND_ANNOTATION: &str = "initium.dev/rule-kind";

/// Why a rule is not served by the API server: the first field without an exact equivalent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotCompiled {
    pub field: String,
    pub reason: String,
}

impl NotCompiled {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> NotCompiled {
        NotCompiled {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for NotCompiled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

/// A resource the API server serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    pub gvk: Gvk,
    pub plural: String,
    pub namespaced: bool,
}

/// Which served resources a kind pattern names (discovery in the cluster, a fixed table
/// offline).
pub trait Resources {
    fn matching(&self, pattern: &KindPattern) -> Vec<Resource>;
}

/// The built-in namespaced kinds rules name most, for offline use (`initium check
/// --compile`, `initium explain`); in the cluster, discovery decides.
pub struct BuiltinResources;

const BUILTIN: &[(&str, &str, &str, &str)] = &[
    ("", "v1", "Pod", "pods"),
    ("", "v1", "ConfigMap", "configmaps"),
    ("", "v1", "Secret", "secrets"),
    ("", "v1", "Service", "services"),
    ("", "v1", "ServiceAccount", "serviceaccounts"),
    ("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
    ("apps", "v1", "Deployment", "deployments"),
    ("apps", "v1", "StatefulSet", "statefulsets"),
    ("apps", "v1", "DaemonSet", "daemonsets"),
    ("apps", "v1", "ReplicaSet", "replicasets"),
    ("batch", "v1", "Job", "jobs"),
    ("batch", "v1", "CronJob", "cronjobs"),
    ("networking.k8s.io", "v1", "Ingress", "ingresses"),
];

impl Resources for BuiltinResources {
    fn matching(&self, pattern: &KindPattern) -> Vec<Resource> {
        BUILTIN
            .iter()
            .map(|(g, v, k, plural)| Resource {
                gvk: Gvk::new(g, v, k),
                plural: (*plural).to_string(),
                namespaced: true,
            })
            .filter(|r| pattern.matches(&r.gvk))
            .collect()
    }
}

/// What the generated objects depend on besides the rule.
#[derive(Clone, Debug)]
pub struct PolicySettings {
    /// The initium installation (its webhook configuration name): prefixes the policies'
    /// names and is the value of [`OWNER_LABEL`].
    pub owner: String,
    /// Namespaces initium never intercepts (its own and `--exclude-namespace`): the policies
    /// leave them out too.
    pub excluded_namespaces: Vec<String>,
    /// At most this many rules are compiled (`--max-compiled-rules`), the first in initium's
    /// order: the API server checks every policy on every request it admits, so past a few
    /// dozen the policies cost each request more than one webhook call (BENCHMARKS.md,
    /// "Compiled rules").
    pub max_compiled: usize,
}

/// The default of [`PolicySettings::max_compiled`]: measured where compiled rules stop
/// costing less than initium's webhook (BENCHMARKS.md, "Compiled rules").
pub const DEFAULT_MAX_COMPILED: usize = 25;

/// A compiled rule: the policy and its binding, as JSON objects to apply.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    pub name: String,
    pub policy: Value,
    pub binding: Value,
}

/// How a Ready rule is served.
#[derive(Clone, Debug, PartialEq)]
pub enum Serving {
    /// By the API server, through the generated policy.
    ApiServer(Box<Generated>),
    /// By initium's webhook, for this reason.
    Webhook(NotCompiled),
}

impl Serving {
    pub fn generated(&self) -> Option<&Generated> {
        match self {
            Serving::ApiServer(g) => Some(g),
            Serving::Webhook(_) => None,
        }
    }
}

const NAME_LABEL: &str = "kubernetes.io/metadata.name";
const MAX_NAME: usize = 253;

/// The policy's (and binding's) name: `<owner>.cmr.<name>` or `<owner>.mr.<ns>.<name>`
/// (namespaces have no dots, so names never collide), shortened with a hash when too long.
pub fn policy_name(owner: &str, id: &RuleId) -> String {
    let full = match &id.namespace {
        Some(ns) => format!("{owner}.mr.{ns}.{}", id.name),
        None => format!("{owner}.cmr.{}", id.name),
    };
    if full.len() <= MAX_NAME {
        return full;
    }
    let hash = fnv(full.as_bytes());
    let keep: String = full.chars().take(MAX_NAME - 18).collect();
    format!("{}.{hash:016x}", keep.trim_end_matches(['.', '-']))
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Compiles one rule, or says why it cannot be compiled exactly.
pub fn compile_policy(
    id: &RuleId,
    spec: &RuleSpec,
    resources: &dyn Resources,
    settings: &PolicySettings,
) -> Result<Generated, NotCompiled> {
    if spec.mode == Mode::Audit {
        return Err(NotCompiled::new(
            "spec.mode",
            "Audit rules report through the webhook; only Enforce rules are compiled",
        ));
    }
    if spec.gate.is_some() {
        return Err(NotCompiled::new(
            "spec.gate",
            "gates are released by initium's gate controller",
        ));
    }
    if spec.autogen.is_some() {
        return Err(NotCompiled::new(
            "spec.autogen",
            "rules that also mutate Pod templates are served by the webhook, which lends each template to the rule as a Pod",
        ));
    }
    if !spec.lookups.is_empty() {
        return Err(NotCompiled::new(
            "spec.lookups[0]",
            "looked-up objects live in initium's memory, not in the API server's admission",
        ));
    }
    if spec.mutations.is_empty() {
        return Err(NotCompiled::new("spec.mutations", "there are no mutations"));
    }

    // Where: resources and operations.
    let operations = spec
        .match_
        .operations
        .clone()
        .unwrap_or_else(|| vec![Operation::Create]);
    let mut resource_rules: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut kinds: Vec<&'static schema::KindSchema> = Vec::new();
    for (i, kind) in spec.match_.kinds.iter().enumerate() {
        let field = format!("spec.match.kinds[{i}]");
        let pattern =
            KindPattern::parse(kind).map_err(|e| NotCompiled::new(&field, e.to_string()))?;
        let found = resources.matching(&pattern);
        if found.is_empty() {
            return Err(NotCompiled::new(
                field,
                "names no resource initium knows the API server serves",
            ));
        }
        for resource in found {
            if !resource.namespaced {
                return Err(NotCompiled::new(
                    field,
                    format!(
                        "{} is cluster-scoped; only namespaced kinds are compiled",
                        resource.gvk
                    ),
                ));
            }
            let Some(kind_schema) = schema::of(&resource.gvk) else {
                return Err(NotCompiled::new(
                    field,
                    format!(
                        "initium knows the fields of the built-in kinds only ({}), and {} is not one of them",
                        BUILTIN
                            .iter()
                            .map(|(_, _, kind, _)| *kind)
                            .collect::<Vec<_>>()
                            .join(", "),
                        resource.gvk
                    ),
                ));
            };
            if !kinds.iter().any(|k| std::ptr::eq(*k, kind_schema)) {
                kinds.push(kind_schema);
            }
            let plurals = resource_rules
                .entry((resource.gvk.group.clone(), resource.gvk.version.clone()))
                .or_default();
            if !plurals.contains(&resource.plural) {
                plurals.push(resource.plural);
            }
        }
    }
    let ops: Vec<&str> = operations.iter().map(|o| o.as_str()).collect();
    let resource_rules: Vec<Value> = resource_rules
        .into_iter()
        .map(|((group, version), plurals)| {
            json!({
                "apiGroups": [group],
                "apiVersions": [version],
                "operations": ops,
                "resources": plurals,
                "scope": "Namespaced",
            })
        })
        .collect();

    // Which objects: match conditions.
    let mut conditions: Vec<(String, String)> = Vec::new();
    let mut namespace_selector = LabelSelector::default();
    let excluded: Vec<String> = settings.excluded_namespaces.clone();
    namespace_selector.match_expressions = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
            key: NAME_LABEL.into(),
            operator: "NotIn".into(),
            values: Some(excluded),
        },
    ]);
    if let Some(ns) = &id.namespace {
        conditions.push((
            "rule-namespace".into(),
            format!("request.namespace == {}", quote(ns)),
        ));
    }
    let m = &spec.match_;
    if let Some(selector) = &m.namespace_selector {
        let mut selector = selector.clone();
        selector
            .match_expressions
            .get_or_insert_with(Vec::new)
            .extend(
                namespace_selector
                    .match_expressions
                    .take()
                    .unwrap_or_default(),
            );
        namespace_selector = selector;
    }
    if let Some(test) = match_test(m, "spec.match", false)? {
        conditions.push(("match".into(), test));
    }
    if let Some(exclude) = &spec.exclude {
        if exclude.namespace_selector.is_some() {
            return Err(NotCompiled::new(
                "spec.exclude.namespaceSelector",
                "a match constraint cannot exclude by namespace labels; not compiled",
            ));
        }
        let mut parts = Vec::new();
        if !exclude.kinds.is_empty() {
            let mut kinds = Vec::new();
            for (i, kind) in exclude.kinds.iter().enumerate() {
                let pattern = KindPattern::parse(kind).map_err(|e| {
                    NotCompiled::new(format!("spec.exclude.kinds[{i}]"), e.to_string())
                })?;
                kinds.push(kind_test(&pattern));
            }
            parts.push(format!("({})", kinds.join(" || ")));
        }
        if let Some(ops) = &exclude.operations {
            let list: Vec<String> = ops.iter().map(|o| quote(o.as_str())).collect();
            parts.push(format!("request.operation in [{}]", list.join(", ")));
        }
        if let Some(test) = match_test(exclude, "spec.exclude", true)? {
            parts.push(test);
        }
        if parts.is_empty() {
            return Err(NotCompiled::new("spec.exclude", "is empty"));
        }
        conditions.push(("exclude".into(), format!("!({})", parts.join(" && "))));
    }
    for (i, condition) in spec.conditions.iter().enumerate() {
        let field = format!("spec.conditions[{i}]");
        conditions.push((format!("condition-{i}"), condition_test(condition, &field)?));
    }

    // As initium's webhook: a rule the object's initium.dev/mutated-by lists, and the stored
    // object did not (on UPDATE; on CREATE there is none), already ran in this request.
    let written = id.written();
    let listed = |root: &str| {
        let record = Path(vec![
            "metadata".into(),
            "annotations".into(),
            crate::api::MUTATED_BY_ANNOTATION.into(),
        ]);
        format!(
            "(({}) && {}.split(\",\").exists(s, s.trim() == {}))",
            record.present_from(root),
            record.access_from(root),
            quote(&written)
        )
    };
    conditions.push((
        "not-run-in-this-request".into(),
        format!(
            "!({} && !(oldObject != null && {}))",
            listed("object"),
            listed("oldObject")
        ),
    ));

    // What: one JSONPatch expression, the record and every mutation.
    let expression = mutate::rule(&spec.mutations, &written, &kinds)?;
    let variables = vec![json!({"name": mutate::CHANGED, "expression": expression.changed})];
    let mutations = vec![json!({
        "patchType": "JSONPatch",
        "jsonPatch": {"expression": expression.patch},
    })];

    let name = policy_name(&settings.owner, id);
    let mut labels = serde_json::Map::new();
    labels.insert(OWNER_LABEL.into(), json!(settings.owner));
    labels.insert("app.kubernetes.io/managed-by".into(), json!("initium"));
    if let Some(ns) = &id.namespace {
        labels.insert(RULE_NAMESPACE_LABEL.into(), json!(ns.as_ref()));
    }
    let annotations = json!({RULE_ANNOTATION: written, RULE_KIND_ANNOTATION: id.kind()});
    let metadata = json!({"name": name, "labels": labels, "annotations": annotations});
    let failure_policy = match spec.failure_policy {
        FailurePolicy::Ignore => "Ignore",
        FailurePolicy::Fail => "Fail",
    };
    let match_conditions: Vec<Value> = conditions
        .into_iter()
        .map(|(name, expression)| json!({"name": name, "expression": expression}))
        .collect();
    let policy = json!({
        "apiVersion": POLICY_API_VERSION,
        "kind": "MutatingAdmissionPolicy",
        "metadata": metadata,
        "spec": {
            "failurePolicy": failure_policy,
            "reinvocationPolicy": "Never",
            "matchConstraints": {
                "matchPolicy": "Equivalent",
                "namespaceSelector": namespace_selector,
                "resourceRules": resource_rules,
            },
            "matchConditions": match_conditions,
            "variables": variables,
            "mutations": mutations,
        }
    });
    let mut binding_spec = json!({"policyName": name});
    if let Some(ns) = &id.namespace {
        // A MutationRule acts in its own namespace only: the binding says so to the API
        // server, besides the policy's own test of request.namespace.
        binding_spec["matchResources"] = json!({
            "namespaceSelector": {"matchLabels": {NAME_LABEL: ns.as_ref()}}
        });
    }
    let binding = json!({
        "apiVersion": POLICY_API_VERSION,
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": metadata,
        "spec": binding_spec,
    });
    Ok(Generated {
        name,
        policy,
        binding,
    })
}

/// CEL true when the request's kind matches the pattern.
fn kind_test(pattern: &KindPattern) -> String {
    let mut tests = Vec::new();
    for (segment, field) in [
        (&pattern.group, "group"),
        (&pattern.version, "version"),
        (&pattern.kind, "kind"),
    ] {
        if let Segment::Exact(value) = segment {
            tests.push(format!("request.kind.{field} == {}", quote(value)));
        }
    }
    if tests.is_empty() {
        "true".into()
    } else {
        format!("({})", tests.join(" && "))
    }
}

/// The CEL name initium's `names` globs match: the request's name, else the object's, else its
/// generateName.
const GLOB_NAME: &str = "((has(request.name) && request.name != \"\") ? request.name : ((has(object.metadata.name) && object.metadata.name != \"\") ? object.metadata.name : (has(object.metadata.generateName) ? object.metadata.generateName : \"\")))";

/// The parts of `match`/`exclude` that become CEL (names, namespaces, labels, annotations).
fn match_test(m: &MatchResources, at: &str, exclude: bool) -> Result<Option<String>, NotCompiled> {
    let mut tests = Vec::new();
    if !m.names.is_empty() {
        tests.push(any_glob(&m.names, GLOB_NAME));
    }
    if !m.namespaces.is_empty() {
        tests.push(any_glob(&m.namespaces, "request.namespace"));
    }
    if exclude && m.namespace_selector.is_some() {
        return Err(NotCompiled::new(
            format!("{at}.namespaceSelector"),
            "not compiled in exclude",
        ));
    }
    if let Some(labels) = &m.labels {
        let path = Path(vec!["metadata".into(), "labels".into()]);
        tests.push(format!(
            "({})",
            selector(labels, &path, &format!("{at}.labels"))?
        ));
    }
    if !m.annotations.is_empty() {
        let path = Path(vec!["metadata".into(), "annotations".into()]);
        for (key, pattern) in &m.annotations {
            let value = path.child(key);
            let glob = cel::glob(pattern, &value.access());
            tests.push(format!("({} && {glob})", value.present()));
        }
    }
    let tests: Vec<String> = tests.into_iter().filter(|t| t != "true").collect();
    Ok(if tests.is_empty() {
        None
    } else {
        Some(tests.join(" && "))
    })
}

/// A condition as CEL: `exists` on a path of plain field names (`$.a.b`, `$['a.b']`); the
/// other tests and other JSONPaths are not compiled.
fn condition_test(condition: &Condition, field: &str) -> Result<String, NotCompiled> {
    let Some(exists) = condition.exists else {
        return Err(NotCompiled::new(
            field,
            "only `exists` conditions are compiled; the other tests compare JSON values, which CEL types differently",
        ));
    };
    let path = simple_path(&condition.path).ok_or_else(|| {
        NotCompiled::new(
            format!("{field}.path"),
            "only a path of field names ($.a.b or $['a.b']) has a CEL equivalent",
        )
    })?;
    path.check()
        .map_err(|reason| NotCompiled::new(format!("{field}.path"), reason))?;
    if path.0.first().map(String::as_str) == Some("metadata")
        && !matches!(
            path.0.get(1).map(String::as_str),
            Some("labels" | "annotations")
        )
    {
        return Err(NotCompiled::new(
            format!("{field}.path"),
            "metadata fields other than labels and annotations are filled in during admission; not compiled",
        ));
    }
    let present = path.present();
    Ok(if exists {
        format!("({present})")
    } else {
        format!("!({present})")
    })
}

/// `$.a.b`, `$['a']`, `$["a"].b` as field names; `None` for anything else.
fn simple_path(text: &str) -> Option<Path> {
    let mut rest = text.trim().strip_prefix('$')?;
    let mut segments = Vec::new();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('.') {
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
                .unwrap_or(after.len());
            if end == 0 {
                return None;
            }
            segments.push(after[..end].to_string());
            rest = &after[end..];
        } else if let Some(after) = rest.strip_prefix('[') {
            let quote = after.chars().next().filter(|c| *c == '\'' || *c == '"')?;
            let inner = &after[1..];
            let end = inner.find(quote)?;
            let key = &inner[..end];
            if key.contains('\\') {
                return None;
            }
            segments.push(key.to_string());
            rest = inner[end + 1..].strip_prefix(']')?;
        } else {
            return None;
        }
    }
    if segments.is_empty() {
        None
    } else {
        Some(Path(segments))
    }
}

/// Whether two rules may both act on one object: `false` only when that is certain (their
/// kinds, operations, namespaces, labels or annotations cannot all hold together).
pub fn may_overlap(a: (&RuleId, &RuleSpec), b: (&RuleId, &RuleSpec)) -> bool {
    let (ida, sa) = a;
    let (idb, sb) = b;
    let kinds = |s: &RuleSpec| -> Vec<KindPattern> {
        s.match_
            .kinds
            .iter()
            .filter_map(|k| KindPattern::parse(k).ok())
            .collect()
    };
    let (ka, kb) = (kinds(sa), kinds(sb));
    if ka.len() == sa.match_.kinds.len()
        && kb.len() == sb.match_.kinds.len()
        && !ka.iter().any(|x| kb.iter().any(|y| patterns_meet(x, y)))
    {
        return false;
    }
    let ops = |s: &RuleSpec| {
        s.match_
            .operations
            .clone()
            .unwrap_or_else(|| vec![Operation::Create])
    };
    let (oa, ob) = (ops(sa), ops(sb));
    if !oa.iter().any(|o| ob.contains(o)) {
        return false;
    }
    if namespaces_apart(ida, sa, idb, sb) || namespaces_apart(idb, sb, ida, sa) {
        return false;
    }
    if labels_apart(sa.match_.labels.as_ref(), sb.match_.labels.as_ref()) {
        return false;
    }
    for (key, va) in &sa.match_.annotations {
        if let Some(vb) = sb.match_.annotations.get(key)
            && !va.contains(['*', '?'])
            && !vb.contains(['*', '?'])
            && va != vb
        {
            return false;
        }
    }
    true
}

fn patterns_meet(a: &KindPattern, b: &KindPattern) -> bool {
    let meet = |x: &Segment, y: &Segment| match (x, y) {
        (Segment::Exact(x), Segment::Exact(y)) => x == y,
        _ => true,
    };
    meet(&a.group, &b.group) && meet(&a.version, &b.version) && meet(&a.kind, &b.kind)
}

/// True when rule `a`'s namespace (a MutationRule's own) is certainly outside rule `b`'s.
fn namespaces_apart(ida: &RuleId, _sa: &RuleSpec, idb: &RuleId, sb: &RuleSpec) -> bool {
    let Some(ns) = &ida.namespace else {
        return false;
    };
    match &idb.namespace {
        Some(other) => ns != other,
        None => {
            !sb.match_.namespaces.is_empty()
                && sb
                    .match_
                    .namespaces
                    .iter()
                    .all(|p| !p.contains(['*', '?']) && p != ns.as_ref())
        }
    }
}

/// The labels a selector requires to have one value, or to exist, or to be absent.
fn label_demands(selector: Option<&LabelSelector>) -> Vec<(String, Demand)> {
    let mut out = Vec::new();
    let Some(selector) = selector else {
        return out;
    };
    for (k, v) in selector.match_labels.iter().flatten() {
        out.push((k.clone(), Demand::OneOf(vec![v.clone()])));
    }
    for e in selector.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default();
        match e.operator.as_str() {
            "In" => out.push((e.key.clone(), Demand::OneOf(values))),
            "Exists" => out.push((e.key.clone(), Demand::Present)),
            "DoesNotExist" => out.push((e.key.clone(), Demand::Absent)),
            _ => {}
        }
    }
    out
}

enum Demand {
    OneOf(Vec<String>),
    Present,
    Absent,
}

fn labels_apart(a: Option<&LabelSelector>, b: Option<&LabelSelector>) -> bool {
    let (da, db) = (label_demands(a), label_demands(b));
    da.iter().any(|(ka, x)| {
        db.iter().any(|(kb, y)| {
            ka == kb
                && match (x, y) {
                    (Demand::OneOf(x), Demand::OneOf(y)) => !x.iter().any(|v| y.contains(v)),
                    (Demand::Absent, Demand::OneOf(_) | Demand::Present)
                    | (Demand::OneOf(_) | Demand::Present, Demand::Absent) => true,
                    _ => false,
                }
        })
    })
}

/// How each Ready rule is served. `rules` in any order; the answer is in the same order. A
/// rule is compiled when [`compile_policy`] accepts it and no rule before it in initium's
/// order (priority, then scope, namespace, name) may act on the same objects.
pub fn plan(
    rules: &[(RuleId, &RuleSpec)],
    resources: &dyn Resources,
    settings: &PolicySettings,
) -> Vec<Serving> {
    let mut order: Vec<usize> = (0..rules.len()).collect();
    order.sort_by(|&a, &b| {
        rules[a]
            .1
            .priority
            .cmp(&rules[b].1.priority)
            .then_with(|| rules[a].0.cmp(&rules[b].0))
    });
    // Rules that may precede each rule: the ClusterMutationRules, and the MutationRules of
    // its own namespace (those of other namespaces never act on the same objects).
    let mut by_namespace: BTreeMap<Option<&str>, Vec<usize>> = BTreeMap::new();
    let mut out: Vec<Option<Serving>> = vec![None; rules.len()];
    let mut compiled = 0;
    for &i in &order {
        let (id, spec) = (&rules[i].0, rules[i].1);
        let serving = match compile_policy(id, spec, resources, settings) {
            Err(reason) => Serving::Webhook(reason),
            Ok(generated) => {
                let cluster = by_namespace.get(&None).map(Vec::as_slice).unwrap_or(&[]);
                let own = match &id.namespace {
                    Some(ns) => by_namespace
                        .get(&Some(ns.as_ref()))
                        .map(Vec::as_slice)
                        .unwrap_or(&[]),
                    None => &[],
                };
                let earlier = cluster
                    .iter()
                    .chain(own)
                    .copied()
                    .find(|&j| may_overlap((&rules[j].0, rules[j].1), (id, spec)));
                // A ClusterMutationRule may meet any earlier MutationRule too.
                let earlier = earlier.or_else(|| {
                    if id.namespace.is_some() {
                        return None;
                    }
                    by_namespace
                        .iter()
                        .filter(|(ns, _)| ns.is_some())
                        .flat_map(|(_, list)| list.iter().copied())
                        .find(|&j| may_overlap((&rules[j].0, rules[j].1), (id, spec)))
                });
                match earlier {
                    Some(j) => Serving::Webhook(NotCompiled::new(
                        "spec.priority",
                        format!(
                            "{} comes before it and may act on the same objects; the API server would run this rule first",
                            rules[j].0.describe()
                        ),
                    )),
                    // Past the cap the rule stays on the webhook; the rules after it are still
                    // checked against it above, so the order rule does not depend on the cap.
                    None if compiled >= settings.max_compiled => {
                        Serving::Webhook(NotCompiled::new(
                            "spec",
                            format!(
                                "{} rules before it are compiled already, the most initium compiles (--max-compiled-rules): the API server checks every policy on every request it admits, so each more would cost every request",
                                settings.max_compiled
                            ),
                        ))
                    }
                    None => {
                        compiled += 1;
                        Serving::ApiServer(Box::new(generated))
                    }
                }
            }
        };
        out[i] = Some(serving);
        by_namespace
            .entry(id.namespace.as_deref())
            .or_default()
            .push(i);
    }
    out.into_iter()
        .map(|s| s.unwrap_or_else(|| Serving::Webhook(NotCompiled::new("spec", "not planned"))))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
