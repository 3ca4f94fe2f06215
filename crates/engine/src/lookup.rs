//! Lookups (`spec.lookups`): objects whose content a rule's templates read, as
//! `{{ lookups.<name>.data.<key> }}`. This file is the pure half: compiling the lookups (names,
//! references, where a rule may look), the [`LookupStore`] the objects are read from, and
//! resolving a rule's lookups against it before its mutations run.
//!
//! The store is filled by watches in `initium serve` (`controller::lookups`, one watch per
//! [`LookupScope`] the Ready rules read from: a namespace, or every namespace) and from the
//! input files offline (`cli`). Nothing here waits: a lookup the store does not have is an
//! error of the rule, never a call.

use std::fmt;

use serde_json::Value;

use crate::api::{self, LOOKUP_KINDS, exactly_one_of_message};

use super::lookup_store::NotSynced;
pub use super::lookup_store::{LookupKind, LookupScope, LookupStore, LookupTarget, ScopeObjects};

use super::error::Errors;
use super::stop::Stop;
use super::subject::{RuleId, Subject};

/// Most lookups one rule may have (the CRD says the same).
pub const MAX_LOOKUPS: usize = 8;
/// Longest object name Kubernetes allows (a DNS subdomain).
const MAX_OBJECT_NAME: usize = 253;
/// Longest namespace name (a DNS label).
const MAX_NAMESPACE_NAME: usize = 63;
/// Longest lookup name.
const MAX_LOOKUP_NAME: usize = 63;

/// One lookup of a rule, compiled.
#[derive(Clone, Debug)]
pub(crate) struct CompiledLookup {
    name: String,
    target: LookupTarget,
    /// `target.scope()`, built once: reading the store on the request path allocates nothing.
    scope: LookupScope,
}

/// The lookups of a rule: the compiled ones, and the names templates may use (every name that
/// is valid, also of a lookup with another error, so that one mistake is reported once).
pub(crate) struct Compiled {
    pub lookups: Vec<CompiledLookup>,
    pub names: Vec<String>,
}

/// Compiles `spec.lookups`, every problem reported with its field path.
pub(crate) fn compile(id: &RuleId, specs: &[api::Lookup], errors: &mut Errors) -> Compiled {
    let mut compiled = Compiled {
        lookups: Vec::new(),
        names: Vec::new(),
    };
    if specs.len() > MAX_LOOKUPS {
        errors.push(
            "spec.lookups",
            format!(
                "the rule has {} lookups; at most {MAX_LOOKUPS} are allowed: split it into several rules",
                specs.len()
            ),
        );
    }
    for (i, spec) in specs.iter().enumerate() {
        let at = format!("spec.lookups[{i}]");
        let name_ok = if !is_lookup_name(&spec.name) {
            errors.push(
                format!("{at}.name"),
                format!(
                    "{:?} is not a lookup name: start with a lowercase letter and use only letters, digits and _ (at most {MAX_LOOKUP_NAME}), as templates write it: {{{{ lookups.<name>.data.<key> }}}}",
                    spec.name
                ),
            );
            false
        } else if let Some(first) = specs[..i].iter().position(|s| s.name == spec.name) {
            errors.push(
                format!("{at}.name"),
                format!(
                    "{:?} is the name of spec.lookups[{first}] already; lookup names must be unique within the rule",
                    spec.name
                ),
            );
            false
        } else {
            compiled.names.push(spec.name.clone());
            true
        };
        let kinds: Vec<_> = spec.kinds().collect();
        let [(field, reference)] = kinds[..] else {
            errors.push(
                at,
                format!(
                    "{} (found {})",
                    exactly_one_of_message(&LOOKUP_KINDS),
                    kinds.len()
                ),
            );
            continue;
        };
        let kind = match field {
            "configMap" => LookupKind::ConfigMap,
            _ => continue,
        };
        let at = format!("{at}.{field}");
        let mut ok = name_ok;
        if !is_object_name(&reference.name) {
            errors.push(
                format!("{at}.name"),
                format!(
                    "{:?} is not a {} name: lowercase letters, digits, '-' and '.', at most {MAX_OBJECT_NAME} characters",
                    reference.name,
                    kind.as_str()
                ),
            );
            ok = false;
        }
        let namespace = match (&reference.namespace, &id.namespace) {
            (Some(ns), _) if !is_namespace_name(ns) => {
                errors.push(
                    format!("{at}.namespace"),
                    format!(
                        "{ns:?} is not a namespace name: lowercase letters, digits and '-', at most {MAX_NAMESPACE_NAME} characters"
                    ),
                );
                ok = false;
                None
            }
            // DESIGN.md: a MutationRule sees only its own namespace.
            (Some(ns), Some(own)) if ns.as_str() != &**own => {
                errors.push(
                    format!("{at}.namespace"),
                    format!(
                        "a MutationRule may only look up {}s in its own namespace ({own}), not {ns:?}; leave namespace out, or use a ClusterMutationRule",
                        kind.as_str()
                    ),
                );
                ok = false;
                None
            }
            (Some(ns), _) => Some(ns.clone()),
            // A MutationRule admits objects of its own namespace only: the object's namespace
            // is the rule's, and one watch of that namespace serves it.
            (None, Some(own)) => Some(own.to_string()),
            (None, None) => None,
        };
        if ok {
            let target = LookupTarget {
                kind,
                namespace,
                name: reference.name.clone(),
            };
            compiled.lookups.push(CompiledLookup {
                name: spec.name.clone(),
                scope: target.scope(),
                target,
            });
        }
    }
    compiled
}

/// `[a-z][a-zA-Z0-9_]*`: a name that can follow `lookups.` in a template.
pub(crate) fn is_lookup_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= MAX_LOOKUP_NAME
        && chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A DNS subdomain (RFC 1123), as Kubernetes object names are. Checked here because the
/// name goes into a watch's field selector, where `,` or `=` would change its meaning.
fn is_object_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_OBJECT_NAME && name.split('.').all(is_dns_label)
}

fn is_namespace_name(name: &str) -> bool {
    name.len() <= MAX_NAMESPACE_NAME && is_dns_label(name)
}

fn is_dns_label(label: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !label.is_empty()
        && label.starts_with(alnum)
        && label.ends_with(alnum)
        && label.chars().all(|c| alnum(c) || c == '-')
}

impl CompiledLookup {
    pub fn target(&self) -> &LookupTarget {
        &self.target
    }
}

/// A lookup resolved for one object: what its templates read, and which object that is (for
/// messages).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Found<'a> {
    pub value: &'a Value,
    pub kind: LookupKind,
    pub namespace: &'a str,
    pub name: &'a str,
}

impl fmt::Display for Found<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.kind.as_str(), self.namespace, self.name)
    }
}

/// Reads every lookup of a rule for the object of `subject`, in order. Every lookup must be
/// found: the first that is not is the rule's error, with its field path.
pub(crate) fn resolve<'a>(
    lookups: &'a [CompiledLookup],
    subject: &Subject<'a>,
) -> Result<Vec<Found<'a>>, Stop> {
    let mut found = Vec::with_capacity(lookups.len());
    for (i, lookup) in lookups.iter().enumerate() {
        let at = || format!("spec.lookups[{i}]");
        let target = &lookup.target;
        let error = |problem: LookupProblem| LookupError {
            lookup: lookup.name.clone(),
            kind: target.kind,
            name: target.name.clone(),
            problem,
        };
        let Some(store) = subject.lookups else {
            return Err(Stop::from(error(LookupProblem::NoStore)).context(at));
        };
        let namespace = match (&target.namespace, subject.namespace) {
            (Some(ns), _) => ns.as_str(),
            (None, Some(ns)) if !ns.is_empty() => ns,
            (None, _) => {
                return Err(Stop::from(error(LookupProblem::NoNamespace)).context(at));
            }
        };
        let problem = match store.get(&lookup.scope, &target.name, namespace) {
            Ok(Some(value)) => {
                found.push(Found {
                    value,
                    kind: target.kind,
                    namespace,
                    name: &target.name,
                });
                continue;
            }
            Ok(None) => LookupProblem::Missing {
                namespace: namespace.to_string(),
            },
            Err(NotSynced) => LookupProblem::NotSynced {
                namespace: namespace.to_string(),
            },
        };
        return Err(Stop::from(error(problem)).context(at));
    }
    Ok(found)
}

/// A lookup of a rule that cannot be read for this object.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.sentence())]
pub struct LookupError {
    lookup: String,
    kind: LookupKind,
    name: String,
    problem: LookupProblem,
}

#[derive(Debug)]
enum LookupProblem {
    Missing { namespace: String },
    NotSynced { namespace: String },
    NoNamespace,
    NoStore,
}

impl LookupError {
    fn sentence(&self) -> String {
        let LookupError {
            lookup,
            kind,
            name,
            problem,
        } = self;
        let kind = kind.as_str();
        match problem {
            LookupProblem::Missing { namespace } => format!(
                "{kind} {namespace}/{name} (lookup {lookup:?}) does not exist: create it, or change the lookup"
            ),
            LookupProblem::NotSynced { namespace } => format!(
                "initium has not read {kind} {namespace}/{name} (lookup {lookup:?}) yet: its watch started moments ago, or cannot list {kind}s (see initium's log); try again in a few seconds"
            ),
            LookupProblem::NoNamespace => format!(
                "lookup {lookup:?} reads {kind} {name} in the namespace of the object, and this object has none (it is cluster-scoped): give the lookup a namespace, or exclude cluster-scoped objects from the rule"
            ),
            LookupProblem::NoStore => format!(
                "lookup {lookup:?} cannot be read here: this caller of the engine has no lookup store"
            ),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::collections::{BTreeSet, HashMap};
    use std::sync::Arc;

    use serde_json::json;

    use super::*;

    fn specs(value: Value) -> Vec<api::Lookup> {
        serde_json::from_value(value).unwrap()
    }

    fn errors_of(id: &RuleId, value: Value) -> Vec<String> {
        let mut errors = Errors::default();
        compile(id, &specs(value), &mut errors);
        errors.errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_mutation_rule_looks_only_in_its_own_namespace() {
        let own = RuleId::namespaced("team", "r");
        let mut errors = Errors::default();
        let compiled = compile(
            &own,
            &specs(json!([
                {"name": "a", "configMap": {"name": "x"}},
                {"name": "b", "configMap": {"name": "y", "namespace": "team"}},
            ])),
            &mut errors,
        );
        assert!(errors.errors.is_empty(), "{:?}", errors.errors);
        let namespaces: Vec<_> = compiled
            .lookups
            .iter()
            .map(|l| l.target().namespace.clone())
            .collect();
        assert_eq!(
            namespaces,
            [Some("team".to_string()), Some("team".to_string())]
        );
        assert_eq!(
            errors_of(
                &own,
                json!([{"name": "a", "configMap": {"name": "x", "namespace": "other"}}])
            ),
            [
                "spec.lookups[0].configMap.namespace: a MutationRule may only look up ConfigMaps in its own namespace (team), not \"other\"; leave namespace out, or use a ClusterMutationRule"
            ]
        );
        // A ClusterMutationRule may look anywhere, or in the object's namespace.
        let mut errors = Errors::default();
        let compiled = compile(
            &RuleId::cluster("c"),
            &specs(json!([
                {"name": "a", "configMap": {"name": "x"}},
                {"name": "b", "configMap": {"name": "x", "namespace": "other"}},
            ])),
            &mut errors,
        );
        assert!(errors.errors.is_empty());
        assert_eq!(compiled.lookups[0].target().namespace, None);
        assert_eq!(
            compiled.lookups[1].target().namespace.as_deref(),
            Some("other")
        );
    }

    #[test]
    fn names_and_references_are_checked_with_their_field() {
        let id = RuleId::cluster("c");
        assert_eq!(
            errors_of(
                &id,
                json!([
                    {"name": "Mirror", "configMap": {"name": "x"}},
                    {"name": "a", "configMap": {"name": "x"}},
                    {"name": "a", "configMap": {"name": "y"}},
                    {"name": "b"},
                    {"name": "c", "configMap": {"name": "a,b=c"}},
                    {"name": "d", "configMap": {"name": "x", "namespace": "Bad"}},
                ])
            ),
            [
                "spec.lookups[0].name: \"Mirror\" is not a lookup name: start with a lowercase letter and use only letters, digits and _ (at most 63), as templates write it: {{ lookups.<name>.data.<key> }}",
                "spec.lookups[2].name: \"a\" is the name of spec.lookups[1] already; lookup names must be unique within the rule",
                "spec.lookups[3]: set exactly one of configMap (found 0)",
                "spec.lookups[4].configMap.name: \"a,b=c\" is not a ConfigMap name: lowercase letters, digits, '-' and '.', at most 253 characters",
                "spec.lookups[5].configMap.namespace: \"Bad\" is not a namespace name: lowercase letters, digits and '-', at most 63 characters",
            ]
        );
        let nine: Vec<Value> = (0..9)
            .map(|i| json!({"name": format!("l{i}"), "configMap": {"name": "x"}}))
            .collect();
        assert_eq!(
            errors_of(&id, Value::Array(nine)),
            [
                "spec.lookups: the rule has 9 lookups; at most 8 are allowed: split it into several rules"
            ]
        );
        assert!(is_lookup_name("ca_bundle2"));
        assert!(!is_lookup_name("2ca") && !is_lookup_name("") && !is_lookup_name("a-b"));
    }

    fn target(namespace: Option<&str>, name: &str) -> LookupTarget {
        LookupTarget {
            kind: LookupKind::ConfigMap,
            namespace: namespace.map(String::from),
            name: name.into(),
        }
    }

    /// `store.get` for a target.
    fn get<'a>(
        store: &'a LookupStore,
        target: &LookupTarget,
        namespace: &str,
    ) -> Result<Option<&'a Value>, NotSynced> {
        store.get(&target.scope(), &target.name, namespace)
    }

    #[test]
    fn the_store_tells_found_missing_and_not_yet_known_apart() {
        let config_map =
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "mirror"}});
        let mut scopes = HashMap::new();
        scopes.insert(
            target(None, "mirror").scope(),
            Arc::new(ScopeObjects {
                listed: ["mirror".to_string()].into(),
                objects: [(
                    "mirror".to_string(),
                    [("a".to_string(), Arc::new(config_map.clone()))].into(),
                )]
                .into(),
            }),
        );
        // A namespace whose watch has listed `early` but not `late` (a rule began to read it
        // since).
        scopes.insert(
            target(Some("b"), "late").scope(),
            Arc::new(ScopeObjects {
                listed: ["early".to_string()].into(),
                objects: HashMap::new(),
            }),
        );
        let store = LookupStore::new(scopes);
        assert!(
            matches!(get(&store, &target(None, "mirror"), "a"), Ok(Some(v)) if *v == config_map)
        );
        assert!(matches!(
            get(&store, &target(None, "mirror"), "b"),
            Ok(None)
        ));
        assert!(matches!(
            get(&store, &target(Some("b"), "early"), "b"),
            Ok(None)
        ));
        assert!(get(&store, &target(Some("b"), "late"), "b").is_err());
        assert!(get(&store, &target(Some("c"), "unknown"), "c").is_err());
    }

    #[test]
    fn targets_of_one_namespace_share_a_scope_and_the_object_namespace_is_one_more() {
        let scopes: BTreeSet<LookupScope> = [
            target(Some("a"), "one"),
            target(Some("a"), "two"),
            target(Some("b"), "one"),
            target(None, "one"),
            target(None, "two"),
        ]
        .iter()
        .map(LookupTarget::scope)
        .collect();
        let shown: Vec<String> = scopes.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "ConfigMaps in every namespace",
                "ConfigMaps in namespace a",
                "ConfigMaps in namespace b"
            ]
        );
    }

    #[test]
    fn offline_the_inputs_are_the_cluster() {
        let a = json!({"kind": "ConfigMap", "metadata": {"name": "mirror", "namespace": "a"}});
        let b = json!({"kind": "ConfigMap", "metadata": {"name": "mirror", "namespace": "b"}});
        let other = json!({"kind": "ConfigMap", "metadata": {"name": "other"}});
        let objects = [
            (LookupKind::ConfigMap, "a", &a),
            (LookupKind::ConfigMap, "b", &b),
            (LookupKind::ConfigMap, "a", &other),
        ];
        let store = LookupStore::offline(
            [target(None, "mirror"), target(Some("b"), "mirror")],
            objects,
        );
        assert!(matches!(get(&store, &target(None, "mirror"), "a"), Ok(Some(v)) if *v == a));
        assert!(matches!(get(&store, &target(Some("b"), "mirror"), "b"), Ok(Some(v)) if *v == b));
        assert!(matches!(
            get(&store, &target(Some("b"), "mirror"), "a"),
            Ok(None)
        ));
        assert!(matches!(
            get(&store, &target(None, "mirror"), "c"),
            Ok(None)
        ));
    }

    // Whole rules: templates that read lookups, compiled and run.

    use crate::api::{Operation, RuleSpec};
    use crate::{Gvk, Limits, RuleIndex, compile as compile_rule};

    fn rule(id: RuleId, spec: Value) -> Result<crate::CompiledRule, Vec<String>> {
        let spec: RuleSpec = serde_json::from_value(spec).unwrap();
        compile_rule(id, &spec).map_err(|e| e.errors.iter().map(ToString::to_string).collect())
    }

    /// A MutationRule in `team` reading ConfigMap `registry` as `mirror`.
    fn mirror_rule(policy: &str, mutations: Value) -> crate::CompiledRule {
        rule(
            RuleId::namespaced("team", "mirror"),
            json!({
                "failurePolicy": policy,
                "match": {"kinds": ["Pod"]},
                "lookups": [{"name": "mirror", "configMap": {"name": "registry"}}],
                "mutations": mutations,
            }),
        )
        .unwrap()
    }

    fn registry(data: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "registry", "namespace": "team"}, "data": data})
    }

    fn store_of(rules: &[&crate::CompiledRule], objects: &[Value]) -> LookupStore {
        let targets: Vec<LookupTarget> = rules
            .iter()
            .flat_map(|r| r.lookup_targets().cloned())
            .collect();
        LookupStore::offline(
            targets,
            objects.iter().map(|o| {
                let ns = o.pointer("/metadata/namespace").and_then(Value::as_str);
                (LookupKind::ConfigMap, ns.unwrap_or("default"), o)
            }),
        )
    }

    fn pod() -> Value {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "web", "namespace": "team"},
               "spec": {"containers": [{"name": "app", "image": "app:1"}, {"name": "side", "image": "side:2"}]}})
    }

    fn run(
        rule: crate::CompiledRule,
        store: Option<&LookupStore>,
        object: Value,
        limits: &Limits,
    ) -> Result<crate::Outcome, crate::Denial> {
        let gvk = Gvk::from_api_version("v1", object["kind"].as_str().unwrap());
        let namespace = object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str);
        let subject = Subject {
            gvk: &gvk,
            operation: Operation::Create,
            namespace,
            name: Some("web"),
            namespace_labels: None,
            lookups: store,
            ran_before: crate::RanBefore::Unknown,
        };
        RuleIndex::new(vec![rule]).evaluate_with(&subject, object.clone(), None, limits)
    }

    #[test]
    fn templates_read_the_looked_up_object_with_a_json_path() {
        let r = mirror_rule(
            "Fail",
            json!([
                {"merge": {"metadata": {"annotations": {
                    "registry": "{{ lookups.mirror.data.registry }}",
                    "ca": "{{ lookups.mirror.data['ca.crt'] }}",
                    "from": "{{ lookups.mirror.metadata.namespace }}/{{ $.metadata.name }}",
                }},
                // An object is no annotation value (the rule would fail): it goes elsewhere.
                "spec": {"whole": "{{ lookups.mirror.data }}"}}},
                {"forEach": "$.spec.containers[*]", "mutations": [
                    {"merge": {"image": "{{ lookups.mirror.data.registry }}/{{ @.name }}"}},
                ]},
            ]),
        );
        let store = store_of(
            &[&r],
            &[registry(
                json!({"registry": "mirror.local", "ca.crt": "PEM"}),
            )],
        );
        let out = run(r, Some(&store), pod(), &Limits::default()).unwrap();
        let annotations = &out.object["metadata"]["annotations"];
        assert_eq!(annotations["registry"], "mirror.local");
        assert_eq!(annotations["ca"], "PEM");
        assert_eq!(
            out.object["spec"]["whole"],
            json!({"registry": "mirror.local", "ca.crt": "PEM"})
        );
        assert_eq!(annotations["from"], "team/web");
        let images: Vec<&Value> = out.object["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| &c["image"])
            .collect();
        assert_eq!(images, ["mirror.local/app", "mirror.local/side"]);
    }

    #[test]
    fn a_cluster_rule_without_a_namespace_reads_the_object_namespace() {
        let r = rule(
            RuleId::cluster("mirror"),
            json!({
                "match": {"kinds": ["Pod", "Namespace"]},
                "lookups": [{"name": "mirror", "configMap": {"name": "registry"}}],
                "mutations": [{"merge": {"metadata": {"labels": {"r": "{{ lookups.mirror.data.registry }}"}}}}],
            }),
        )
        .unwrap();
        let mut other = registry(json!({"registry": "other.local"}));
        other["metadata"]["namespace"] = json!("other");
        let store = store_of(&[&r], &[registry(json!({"registry": "team.local"})), other]);
        let out = run(r.clone(), Some(&store), pod(), &Limits::default()).unwrap();
        assert_eq!(out.object["metadata"]["labels"]["r"], "team.local");
        let mut elsewhere = pod();
        elsewhere["metadata"]["namespace"] = json!("other");
        let out = run(r.clone(), Some(&store), elsewhere, &Limits::default()).unwrap();
        assert_eq!(out.object["metadata"]["labels"]["r"], "other.local");
        // A Namespace object has no namespace to read from.
        let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "web"}});
        let out = run(r, Some(&store), ns, &Limits::default()).unwrap();
        assert_eq!(
            out.warnings,
            [
                "ClusterMutationRule mirror skipped: spec.lookups[0]: lookup \"mirror\" reads ConfigMap registry in the namespace of the object, and this object has none (it is cluster-scoped): give the lookup a namespace, or exclude cluster-scoped objects from the rule"
            ]
        );
    }

    #[test]
    fn a_missing_object_or_key_fails_the_rule_by_its_policy() {
        let label = json!([{"merge": {"metadata": {"labels": {"r": "{{ lookups.mirror.data.registry }}"}}}}]);
        // No ConfigMap: Fail denies with a sentence naming rule, lookup and object.
        let r = mirror_rule("Fail", label.clone());
        let store = store_of(&[&r], &[]);
        let denial = run(r, Some(&store), pod(), &Limits::default()).unwrap_err();
        assert_eq!(
            denial.message,
            "MutationRule team/mirror (failurePolicy Fail) failed: spec.lookups[0]: ConfigMap team/registry (lookup \"mirror\") does not exist: create it, or change the lookup"
        );
        // Ignore: the object passes unchanged, with a warning.
        let r = mirror_rule("Ignore", label.clone());
        let store = store_of(&[&r], &[]);
        let out = run(r, Some(&store), pod(), &Limits::default()).unwrap();
        assert_eq!(out.object, pod());
        assert!(out.ops.is_empty());
        assert_eq!(out.skipped.len(), 1);
        assert!(
            out.warnings[0].contains("does not exist"),
            "{:?}",
            out.warnings
        );
        // The ConfigMap without the key.
        let r = mirror_rule("Fail", label.clone());
        let store = store_of(&[&r], &[registry(json!({"other": "x"}))]);
        let denial = run(r, Some(&store), pod(), &Limits::default()).unwrap_err();
        assert_eq!(
            denial.message,
            "MutationRule team/mirror (failurePolicy Fail) failed: spec.mutations[0]: template {{ lookups.mirror.data.registry }} selected nothing in ConfigMap team/registry: add what it selects to ConfigMap team/registry, or change the template"
        );
        // A watch that has not listed yet: not a guess that the object is missing.
        let r = mirror_rule("Fail", label.clone());
        let target = r.lookup_targets().next().unwrap().clone();
        let store = LookupStore::new([(target.scope(), Arc::new(ScopeObjects::default()))].into());
        let denial = run(r, Some(&store), pod(), &Limits::default()).unwrap_err();
        assert!(
            denial.message.ends_with("spec.lookups[0]: initium has not read ConfigMap team/registry (lookup \"mirror\") yet: its watch started moments ago, or cannot list ConfigMaps (see initium's log); try again in a few seconds"),
            "{}",
            denial.message
        );
        // No store at all.
        let r = mirror_rule("Fail", label);
        let denial = run(r, None, pod(), &Limits::default()).unwrap_err();
        assert!(
            denial.message.contains("no lookup store"),
            "{}",
            denial.message
        );
    }

    #[test]
    fn looked_up_values_count_against_the_output_limit() {
        let r = mirror_rule(
            "Fail",
            json!([{"merge": {"metadata": {"annotations": {"big": "{{ lookups.mirror.data.big }}"}}}}]),
        );
        let store = store_of(&[&r], &[registry(json!({"big": "x".repeat(4096)}))]);
        let limits = Limits {
            rule_output_bytes: 1024,
            ..Limits::default()
        };
        let denial = run(r, Some(&store), pod(), &limits).unwrap_err();
        assert!(
            denial.message.contains("the per-rule output limit"),
            "{}",
            denial.message
        );
    }

    #[test]
    fn templates_may_only_name_the_rules_lookups() {
        let errors = rule(
            RuleId::namespaced("team", "r"),
            json!({
                "match": {"kinds": ["Pod"]},
                "lookups": [{"name": "mirror", "configMap": {"name": "registry"}},
                            {"name": "ca", "configMap": {"name": "ca", "namespace": "elsewhere"}}],
                "mutations": [
                    {"merge": {"metadata": {"labels": {"a": "{{ lookups.nope.data.x }}"}}}},
                    {"patch": [{"op": "add", "path": "/metadata/labels/b", "value": "{{ lookups }}"}]},
                    {"forEach": "$.spec.containers[*]", "mutations": [
                        {"merge": {"image": "{{ lookups.mirror-x }}"}},
                        {"merge": {"image": "{{ lookups.ca.data.x }}"}},
                    ]},
                ],
            }),
        )
        .unwrap_err();
        assert_eq!(
            errors,
            [
                "spec.lookups[1].configMap.namespace: a MutationRule may only look up ConfigMaps in its own namespace (team), not \"elsewhere\"; leave namespace out, or use a ClusterMutationRule",
                "spec.mutations[0].merge (at /metadata/labels/a): template {{ lookups.nope.data.x }}: the rule has no lookup named \"nope\" (spec.lookups has mirror, ca)",
                "spec.mutations[1].patch[0].value: template {{ lookups }}: name a lookup of the rule, as in {{ lookups.<name>.data.<key> }}",
                "spec.mutations[2].mutations[0].merge (at /image): template {{ lookups.mirror-x }}: name a lookup of the rule, as in {{ lookups.<name>.data.<key> }}",
            ]
        );
        let errors = rule(
            RuleId::cluster("r"),
            json!({
                "match": {"kinds": ["Pod"]},
                "mutations": [{"merge": {"metadata": {"labels": {"a": "{{ lookups.mirror.data.x }}"}}}}],
            }),
        )
        .unwrap_err();
        assert_eq!(
            errors,
            [
                "spec.mutations[0].merge (at /metadata/labels/a): template {{ lookups.mirror.data.x }}: the rule has no lookup named \"mirror\" (it has no spec.lookups)"
            ]
        );
    }
}
