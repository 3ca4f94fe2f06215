//! A rule compiled for evaluation: matchers, conditions and mutations, all validated.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use regex::Regex;
use serde_json::Value;

use crate::api::{FailurePolicy, MatchResources, Operation, RuleSpec};

use super::error::{Errors, RuleErrors};
use super::glob::Glob;
use super::journal::Journal;
use super::kind::{Gvk, KindPattern};
use super::limits::{MAX_RULE_REGEXES, Meter, Stop};
use super::mutation::{self, Mutation, compile_regex, regex_share};
use super::path::{Pointer, Query, type_name as describe_value};
use super::selector::Selector;

/// Which rule: a ClusterMutationRule `name`, or a MutationRule `namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RuleId {
    /// `Some` for a MutationRule.
    pub namespace: Option<Arc<str>>,
    pub name: Arc<str>,
}

impl RuleId {
    pub fn cluster(name: &str) -> RuleId {
        RuleId {
            namespace: None,
            name: name.into(),
        }
    }

    pub fn namespaced(namespace: &str, name: &str) -> RuleId {
        RuleId {
            namespace: Some(namespace.into()),
            name: name.into(),
        }
    }

    pub fn kind(&self) -> &'static str {
        if self.namespace.is_some() {
            "MutationRule"
        } else {
            "ClusterMutationRule"
        }
    }

    /// `MutationRule payments/test-certs`.
    pub fn describe(&self) -> String {
        format!("{} {}", self.kind(), self)
    }
}

impl fmt::Display for RuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// The total order of DESIGN.md §1: priority, ClusterMutationRule before MutationRule,
/// namespace, name.
impl Ord for RuleId {
    fn cmp(&self, other: &RuleId) -> Ordering {
        (self.namespace.is_some(), &self.namespace, &self.name).cmp(&(
            other.namespace.is_some(),
            &other.namespace,
            &other.name,
        ))
    }
}

impl PartialOrd for RuleId {
    fn partial_cmp(&self, other: &RuleId) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// What the engine knows about the object under admission besides its content: at admission,
/// `metadata.namespace` and `metadata.name` of the object may still be empty.
#[derive(Clone, Debug)]
pub struct Subject<'a> {
    pub gvk: &'a Gvk,
    pub operation: Operation,
    /// The request's namespace; `None` for cluster-scoped objects.
    pub namespace: Option<&'a str>,
    /// The request's name, when known.
    pub name: Option<&'a str>,
    /// Labels of the object's Namespace (for `namespaceSelector`). `None` means unknown:
    /// a rule that needs them then fails (and its `failurePolicy` decides) rather than
    /// guess; offline callers pass an empty map for namespaces they have no object for.
    pub namespace_labels: Option<&'a BTreeMap<String, String>>,
}

impl Subject<'_> {
    fn is_namespace_object(&self) -> bool {
        self.gvk.group.is_empty() && self.gvk.kind == "Namespace"
    }
}

#[derive(Clone, Debug)]
struct Matcher {
    kinds: Vec<KindPattern>,
    operations: Option<Vec<Operation>>,
    names: Vec<Glob>,
    namespaces: Vec<Glob>,
    namespace_selector: Option<Selector>,
    labels: Option<Selector>,
    annotations: Vec<(String, Glob)>,
}

impl Matcher {
    fn compile(m: &MatchResources, at: &str, is_exclude: bool, errors: &mut Errors) -> Matcher {
        let mut kinds = Vec::new();
        for (i, k) in m.kinds.iter().enumerate() {
            match KindPattern::parse(k) {
                Ok(p) => kinds.push(p),
                Err(e) => errors.push(format!("{at}.kinds[{i}]"), e),
            }
        }
        if !is_exclude && m.kinds.is_empty() {
            errors.push(
                format!("{at}.kinds"),
                "list at least one kind, e.g. [Pod] (use [\"*\"] for every kind)",
            );
        }
        if let Some(ops) = &m.operations
            && ops.is_empty()
        {
            errors.push(
                format!("{at}.operations"),
                "list at least one operation (CREATE, UPDATE) or leave it out",
            );
        }
        let operations = match &m.operations {
            Some(ops) => Some(ops.clone()),
            None if is_exclude => None,
            None => Some(vec![Operation::Create]),
        };
        let names_ok = |list: &[String], field: &str, errors: &mut Errors| {
            for (i, n) in list.iter().enumerate() {
                if n.is_empty() {
                    errors.push(
                        format!("{at}.{field}[{i}]"),
                        "empty pattern matches nothing; use \"*\" for any",
                    );
                }
            }
        };
        names_ok(&m.names, "names", errors);
        names_ok(&m.namespaces, "namespaces", errors);
        let namespace_selector = m
            .namespace_selector
            .as_ref()
            .map(|s| Selector::compile(s, &format!("{at}.namespaceSelector"), errors));
        let labels = m
            .labels
            .as_ref()
            .map(|s| Selector::compile(s, &format!("{at}.labels"), errors));
        Matcher {
            kinds,
            operations,
            names: m.names.iter().map(|n| Glob::new(n)).collect(),
            namespaces: m.namespaces.iter().map(|n| Glob::new(n)).collect(),
            namespace_selector,
            labels,
            annotations: m
                .annotations
                .iter()
                .map(|(k, v)| (k.clone(), Glob::new(v)))
                .collect(),
        }
    }

    fn is_empty(&self) -> bool {
        self.kinds.is_empty()
            && self.operations.is_none()
            && self.names.is_empty()
            && self.namespaces.is_empty()
            && self.namespace_selector.is_none()
            && self.labels.is_none()
            && self.annotations.is_empty()
    }

    /// Whether the object matches. An error when it cannot be told: the labels of the
    /// object's Namespace are needed but not known (yet).
    fn matches(&self, subject: &Subject, object: &Value) -> Result<bool, String> {
        if !self.kinds.is_empty() && !self.kinds.iter().any(|k| k.matches(subject.gvk)) {
            return Ok(false);
        }
        if let Some(ops) = &self.operations
            && !ops.contains(&subject.operation)
        {
            return Ok(false);
        }
        let metadata = object.get("metadata");
        let meta_str = |field: &str| {
            metadata
                .and_then(|m| m.get(field))
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        };
        if !self.names.is_empty() {
            let name = subject
                .name
                .filter(|n| !n.is_empty())
                .or_else(|| meta_str("name"))
                .or_else(|| meta_str("generateName"))
                .unwrap_or("");
            if !self.names.iter().any(|g| g.matches(name)) {
                return Ok(false);
            }
        }
        // A rule restricted by namespace applies to namespaced objects, and to Namespace
        // objects by their own name and labels; never to other cluster-scoped objects.
        let namespace = if subject.is_namespace_object() {
            subject
                .name
                .filter(|n| !n.is_empty())
                .or_else(|| meta_str("name"))
        } else {
            subject.namespace.filter(|n| !n.is_empty())
        };
        if !self.namespaces.is_empty() {
            match namespace {
                Some(ns) if self.namespaces.iter().any(|g| g.matches(ns)) => {}
                _ => return Ok(false),
            }
        }
        if let Some(selector) = &self.namespace_selector {
            let holds = if subject.is_namespace_object() {
                selector.matches(
                    metadata
                        .and_then(|m| m.get("labels"))
                        .and_then(Value::as_object),
                )
            } else if namespace.is_some() {
                match (subject.namespace_labels, namespace) {
                    (Some(labels), _) => selector.matches_map(labels),
                    // Guessing "no labels" could match a NotIn/DoesNotExist selector wrongly.
                    (None, ns) => {
                        return Err(format!(
                            "the labels of namespace {} are not known yet (needed by namespaceSelector)",
                            ns.unwrap_or_default()
                        ));
                    }
                }
            } else {
                false
            };
            if !holds {
                return Ok(false);
            }
        }
        if let Some(selector) = &self.labels
            && !selector.matches(
                metadata
                    .and_then(|m| m.get("labels"))
                    .and_then(Value::as_object),
            )
        {
            return Ok(false);
        }
        if !self.annotations.is_empty() {
            let annotations = metadata
                .and_then(|m| m.get("annotations"))
                .and_then(Value::as_object);
            for (key, glob) in &self.annotations {
                match annotations.and_then(|a| a.get(key)).and_then(Value::as_str) {
                    Some(v) if glob.matches(v) => {}
                    _ => return Ok(false),
                }
            }
        }
        Ok(true)
    }
}

#[derive(Clone, Debug)]
enum Test {
    Matches(Regex),
    Equals(Value),
    Exists(bool),
}

#[derive(Clone, Debug)]
struct Condition {
    query: Query,
    test: Test,
}

impl Condition {
    fn holds(&self, object: &Value) -> Result<bool, String> {
        let found = self.query.select(object)?;
        Ok(match &self.test {
            Test::Matches(re) => found
                .iter()
                .any(|v| v.as_str().is_some_and(|s| re.is_match(s))),
            Test::Equals(want) => found.contains(&want),
            Test::Exists(want) => found.is_empty() != *want,
        })
    }
}

/// The gate of a rule, compiled (acted on by the gate controller).
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledGate {
    pub timeout: Duration,
}

/// A rule ready for the index.
#[derive(Clone, Debug)]
pub struct CompiledRule {
    pub id: RuleId,
    pub priority: i32,
    pub failure_policy: FailurePolicy,
    matcher: Matcher,
    /// Boxed: most rules have none, and every rule of a cluster is kept compiled.
    exclude: Option<Box<Matcher>>,
    conditions: Vec<Condition>,
    mutations: Vec<Mutation>,
    pub gate: Option<CompiledGate>,
}

/// The outcome of running one rule on an object.
pub(crate) enum RuleResult {
    NotMatched,
    Unchanged,
    Changed(Journal),
    /// The rule failed and its changes were undone.
    Failed(Stop),
    /// The rule failed and its changes could not be undone (an internal error while undoing
    /// them): the object is not fit to be admitted.
    Corrupted(String),
}

impl CompiledRule {
    pub fn kinds(&self) -> &[KindPattern] {
        &self.matcher.kinds
    }

    /// The operations the rule can act on (for the webhook configuration).
    pub fn operations(&self) -> &[Operation] {
        self.matcher.operations.as_deref().unwrap_or(&[])
    }

    /// Namespace names the rule is limited to when they are all literal (for the index).
    pub(crate) fn literal_namespaces(&self) -> Option<Vec<String>> {
        if self.matcher.namespaces.is_empty() {
            return None;
        }
        self.matcher.namespaces.iter().map(Glob::literal).collect()
    }

    pub(crate) fn order(&self, other: &CompiledRule) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then_with(|| self.id.cmp(&other.id))
    }

    /// Whether the rule applies to the object; an error when that cannot be told (see
    /// `Subject::namespace_labels`), which the rule's failure policy then handles.
    pub(crate) fn matches(&self, subject: &Subject, object: &Value) -> Result<bool, String> {
        if !self.matcher.matches(subject, object)? {
            return Ok(false);
        }
        if let Some(exclude) = &self.exclude
            && exclude.matches(subject, object)?
        {
            return Ok(false);
        }
        for (i, c) in self.conditions.iter().enumerate() {
            if !c
                .holds(object)
                .map_err(|e| format!("spec.conditions[{i}].path: {e}"))?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// `matches`, with anything unexpected inside (a bug, here or in a library) turned into
    /// an error of this rule instead of taking the process down.
    pub(crate) fn matches_guarded(
        &self,
        subject: &Subject,
        object: &Value,
    ) -> Result<bool, String> {
        catch_unwind(AssertUnwindSafe(|| self.matches(subject, object)))
            .unwrap_or_else(|panic| Err(internal_error(&panic)))
    }

    /// Runs the rule on `doc` in place. The rule is atomic: when a mutation fails (or goes
    /// over a limit of `meter`), the journal puts back everything the rule had changed. This is
    /// the last line of defence at the rule boundary: whatever happens inside, even a panic,
    /// becomes this rule's failure, and the process and the other rules go on.
    pub(crate) fn run(&self, subject: &Subject, doc: &mut Value, meter: &mut Meter) -> RuleResult {
        match self.matches_guarded(subject, doc) {
            Ok(true) => {}
            Ok(false) => return RuleResult::NotMatched,
            Err(e) => return RuleResult::Failed(Stop::Error(e)),
        }
        meter.start_rule();
        let mut journal = Journal::default();
        let result = catch_unwind(AssertUnwindSafe(|| {
            self.mutate(doc, &mut journal, meter)?;
            check_identity(&journal, doc)
        }))
        .unwrap_or_else(|panic| Err(Stop::Error(internal_error(&panic))));
        match result {
            Ok(()) if journal.changed(doc) => RuleResult::Changed(journal),
            Ok(()) => RuleResult::Unchanged,
            Err(stop) => match catch_unwind(AssertUnwindSafe(|| journal.rollback(doc))) {
                Ok(()) => {
                    meter.undo_rule();
                    RuleResult::Failed(stop)
                }
                Err(panic) => RuleResult::Corrupted(format!(
                    "{stop}; then undoing its changes failed: {}",
                    internal_error(&panic)
                )),
            },
        }
    }

    fn mutate(
        &self,
        doc: &mut Value,
        journal: &mut Journal,
        meter: &mut Meter,
    ) -> Result<(), Stop> {
        let root = Pointer::root();
        for (i, m) in self.mutations.iter().enumerate() {
            m.apply(doc, &root, journal, meter)
                .map_err(|e| e.context(|e| format!("spec.mutations[{i}]: {e}")))?;
        }
        Ok(())
    }
}

/// The fields that say which object this is. A rule that changed them would move the object
/// to another name, namespace or type, which the API server refuses with a message that does
/// not name the rule: the rule fails instead, named.
fn check_identity(journal: &Journal, doc: &Value) -> Result<(), Stop> {
    static IDENTITY: LazyLock<[(Pointer, &str); 4]> = LazyLock::new(|| {
        [
            (Pointer::from_tokens(["apiVersion"]), "apiVersion"),
            (Pointer::from_tokens(["kind"]), "kind"),
            (Pointer::from_tokens(["metadata", "name"]), "metadata.name"),
            (
                Pointer::from_tokens(["metadata", "namespace"]),
                "metadata.namespace",
            ),
        ]
    });
    for (pointer, field) in IDENTITY.iter() {
        if let Some(before) = journal.changed_at(doc, pointer) {
            let show = |v: Option<&Value>| match v {
                None => "nothing".to_string(),
                Some(Value::String(s)) => format!("{s:?}"),
                Some(other) => describe_value(other).to_string(),
            };
            return Err(Stop::Error(format!(
                "the rule would change {field} from {} to {}; a rule may not change an object's apiVersion, kind, name or namespace",
                show(before.as_ref()),
                show(pointer.get(doc))
            )));
        }
    }
    Ok(())
}

/// A sentence for a panic caught at the rule boundary.
fn internal_error(panic: &Box<dyn std::any::Any + Send>) -> String {
    let detail = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no detail".to_string());
    format!(
        "initium hit an internal error while running the rule ({}); the rule was skipped — please report this with the rule",
        crate::engine::sanitize(&detail)
    )
}

/// Compiles a rule, or lists every problem in it with its field path.
pub fn compile(id: RuleId, spec: &RuleSpec) -> Result<CompiledRule, RuleErrors> {
    let mut errors = Errors::default();
    let matcher = Matcher::compile(&spec.match_, "spec.match", false, &mut errors);
    let exclude = spec
        .exclude
        .as_ref()
        .map(|e| Box::new(Matcher::compile(e, "spec.exclude", true, &mut errors)));
    if exclude.as_ref().is_some_and(|m| m.is_empty()) {
        errors.push(
            "spec.exclude",
            "an empty exclude would skip every object; give at least one field or remove it",
        );
    }
    if id.namespace.is_some() {
        for (field, m) in [
            ("spec.match", Some(&spec.match_)),
            ("spec.exclude", spec.exclude.as_ref()),
        ] {
            let Some(m) = m else { continue };
            if !m.namespaces.is_empty() {
                errors.push(
                    format!("{field}.namespaces"),
                    "a MutationRule applies only to its own namespace; use a ClusterMutationRule",
                );
            }
            if m.namespace_selector.is_some() {
                errors.push(
                    format!("{field}.namespaceSelector"),
                    "a MutationRule applies only to its own namespace; use a ClusterMutationRule",
                );
            }
        }
    }
    let regexes = count_regexes(spec);
    if regexes > MAX_RULE_REGEXES {
        errors.push(
            "spec",
            format!("the rule has {regexes} regular expressions (conditions' matches and rewrites); at most {MAX_RULE_REGEXES} are allowed: split it into several rules"),
        );
    }
    let regex_limit = regex_share(regexes);
    let mut conditions = Vec::new();
    for (i, c) in spec.conditions.iter().enumerate() {
        let at = format!("spec.conditions[{i}]");
        let query = Query::parse(&c.path)
            .map_err(|e| errors.push(format!("{at}.path"), e))
            .ok();
        let set = [c.matches.is_some(), c.equals.is_some(), c.exists.is_some()]
            .iter()
            .filter(|x| **x)
            .count();
        let test = match (&c.matches, &c.equals, c.exists) {
            _ if set != 1 => {
                errors.push(
                    &at,
                    format!("set exactly one of matches, equals, exists (found {set})"),
                );
                None
            }
            (Some(re), _, _) => compile_regex(re, regex_limit)
                .map(Test::Matches)
                .map_err(|e| errors.push(format!("{at}.matches"), e))
                .ok(),
            (_, Some(v), _) => Some(Test::Equals(v.clone())),
            (_, _, Some(b)) => Some(Test::Exists(b)),
            _ => None,
        };
        if let (Some(query), Some(test)) = (query, test) {
            conditions.push(Condition { query, test });
        }
    }
    if spec.mutations.is_empty() {
        errors.push("spec.mutations", "a rule needs at least one mutation");
    }
    let mutations: Vec<Mutation> = spec
        .mutations
        .iter()
        .enumerate()
        .filter_map(|(i, m)| {
            mutation::compile(m, &format!("spec.mutations[{i}]"), regex_limit, &mut errors)
        })
        .collect();
    let gate = spec.gate.as_ref().and_then(|g| {
        let only_pods = !matcher.kinds.is_empty()
            && matcher.kinds.iter().all(|k| {
                k.kind.exact() == Some("Pod") && k.group.exact().is_none_or(str::is_empty)
            });
        if !only_pods {
            errors.push(
                "spec.gate",
                "a gate holds Pods through scheduling gates: match.kinds must be only Pod",
            );
        }
        let timeout = match g.timeout.as_deref() {
            None => Some(Duration::from_secs(600)),
            Some(t) => parse_duration(t)
                .map_err(|e| errors.push("spec.gate.timeout", e))
                .ok(),
        };
        if g.wait_for.is_empty() {
            errors.push("spec.gate.waitFor", "list at least one dependency");
        }
        for (i, d) in g.wait_for.iter().enumerate() {
            let set = [
                d.service.is_some(),
                d.job.is_some(),
                d.pods.is_some(),
                d.object.is_some(),
            ]
            .iter()
            .filter(|x| **x)
            .count();
            if set != 1 {
                errors.push(
                    format!("spec.gate.waitFor[{i}]"),
                    format!("set exactly one of service, job, pods, object (found {set})"),
                );
            }
            // DESIGN.md: a MutationRule may only wait on objects in its own namespace.
            if let Some(own) = id.namespace.as_deref() {
                let namespaces = [
                    ("service", d.service.as_ref().and_then(|r| r.namespace.as_deref())),
                    ("job", d.job.as_ref().and_then(|r| r.namespace.as_deref())),
                    ("pods", d.pods.as_ref().and_then(|r| r.namespace.as_deref())),
                    ("object", d.object.as_ref().and_then(|r| r.namespace.as_deref())),
                ];
                for (field, namespace) in namespaces {
                    if let Some(namespace) = namespace.filter(|ns| *ns != own) {
                        errors.push(
                            format!("spec.gate.waitFor[{i}].{field}.namespace"),
                            format!("a MutationRule may only wait on objects in its own namespace ({own}), not {namespace:?}; leave it out, or use a ClusterMutationRule"),
                        );
                    }
                }
            }
            if let Some(o) = &d.object {
                for (j, c) in o.conditions.iter().enumerate() {
                    if let Err(e) = Query::parse(&c.path) {
                        errors.push(
                            format!("spec.gate.waitFor[{i}].object.conditions[{j}].path"),
                            e,
                        );
                    }
                }
            }
        }
        timeout.map(|timeout| CompiledGate { timeout })
    });
    if !errors.errors.is_empty() {
        return Err(RuleErrors {
            rule: id.describe(),
            errors: errors.errors,
        });
    }
    Ok(CompiledRule {
        id,
        priority: spec.priority,
        failure_policy: spec.failure_policy,
        matcher,
        exclude,
        conditions,
        mutations,
        gate,
    })
}

/// The regular expressions of a rule: conditions' `matches` and rewrites, also in `forEach`.
fn count_regexes(spec: &RuleSpec) -> usize {
    let conditions = spec
        .conditions
        .iter()
        .filter(|c| c.matches.is_some())
        .count();
    let rewrites: usize = spec
        .mutations
        .iter()
        .map(|m| {
            usize::from(m.rewrite.is_some())
                + m.mutations
                    .iter()
                    .flatten()
                    .filter(|n| n.rewrite.is_some())
                    .count()
        })
        .sum();
    conditions + rewrites
}

/// `30s`, `10m`, `1h`, `1h30m`, `500ms`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad =
        || format!("invalid duration {text:?}: use a number with a unit, like 30s, 10m or 1h30m");
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            _ => return Err(bad()),
        };
        total = total.saturating_add(unit);
        rest = &rest[unit_len..];
    }
    Ok(total)
}
