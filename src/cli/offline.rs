//! The offline admission run shared by `apply` and `test`: load rules, then put each object
//! through the engine as the API server would.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use serde_json::Value;

use crate::{Error, Result};
use initium_engine::api::Operation;
use initium_engine::{
    Denial, FieldError, Gvk, Limits, LookupKind, LookupStore, Outcome, RanBefore, RuleErrors,
    RuleIndex, Step, Subject, compile, is_rule_document, parse_rule,
};

use super::input::{Document, read_documents};

/// Built-in kinds that are cluster-scoped; any other object without `metadata.namespace`
/// is taken to be in the default namespace, as `kubectl apply` would.
const CLUSTER_SCOPED: &[&str] = &[
    "Namespace",
    "Node",
    "PersistentVolume",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "StorageClass",
    "PriorityClass",
    "RuntimeClass",
    "IngressClass",
    "CSIDriver",
    "CSINode",
    "VolumeAttachment",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "MutatingAdmissionPolicy",
    "MutatingAdmissionPolicyBinding",
    "APIService",
    "CertificateSigningRequest",
    "FlowSchema",
    "PriorityLevelConfiguration",
    "ClusterMutationRule",
];

static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

/// Loaded rules: the index and how many non-rule documents were passed over.
pub struct LoadedRules {
    pub index: RuleIndex,
    pub ignored_documents: usize,
    /// The valid rules as written, in input order (what `check --compile` compiles to
    /// policies).
    pub sources: Vec<initium_engine::RuleSource>,
}

/// Reads and compiles rules; any invalid rule is an error listing every problem of every rule,
/// in document order, each with the document it came from.
pub fn load_rules(inputs: &[PathBuf], default_namespace: &str) -> Result<LoadedRules> {
    let docs = read_documents(inputs)?;
    let (loaded, errors) = compile_documents(&docs, default_namespace);
    if !errors.is_empty() {
        return Err(Error::InvalidRules(errors));
    }
    Ok(loaded)
}

/// Compiles the rule documents among `docs`: the index of the valid ones, and the errors of
/// the others (each with the document it came from).
pub fn compile_documents(
    docs: &[Document],
    default_namespace: &str,
) -> (LoadedRules, Vec<RuleErrors>) {
    let mut compiled = Vec::new();
    let mut sources = Vec::new();
    let mut errors = Vec::new();
    let mut ignored_documents = 0;
    let mut seen = HashSet::new();
    for doc in docs {
        if !is_rule_document(&doc.value) {
            ignored_documents += 1;
            continue;
        }
        let result = parse_rule(&doc.value, default_namespace).and_then(|source| {
            if !seen.insert(source.id.clone()) {
                return Err(RuleErrors {
                    rule: source.id.describe(),
                    errors: vec![FieldError::new("metadata.name", "defined twice")],
                });
            }
            let rule = compile(source.id.clone(), &source.spec)?;
            Ok((rule, source))
        });
        match result {
            Ok((rule, source)) => {
                compiled.push(rule);
                sources.push(source);
            }
            Err(mut e) => {
                e.rule = format!("{} ({})", e.rule, doc.origin);
                errors.push(e);
            }
        }
    }
    (
        LoadedRules {
            index: RuleIndex::new(compiled),
            ignored_documents,
            sources,
        },
        errors,
    )
}

/// Labels of the Namespace objects among the inputs, for `namespaceSelector`.
pub fn namespace_labels(docs: &[Document]) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for doc in docs {
        let v = &doc.value;
        if v.get("kind").and_then(Value::as_str) != Some("Namespace") {
            continue;
        }
        let Some(name) = v.pointer("/metadata/name").and_then(Value::as_str) else {
            continue;
        };
        let labels = v
            .pointer("/metadata/labels")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        out.insert(name.to_string(), labels);
    }
    out
}

/// What the rules' lookups read offline: the ConfigMaps among `docs` (one without
/// `metadata.namespace` is in `default_namespace`), as they are in the files.
pub fn lookup_store(index: &RuleIndex, docs: &[Document], default_namespace: &str) -> LookupStore {
    let targets = index
        .rules()
        .iter()
        .flat_map(|rule| rule.lookup_targets().cloned());
    let objects = docs.iter().filter_map(|doc| {
        let v = &doc.value;
        let kind = match (
            v.get("apiVersion").and_then(Value::as_str),
            v.get("kind").and_then(Value::as_str),
        ) {
            (Some("v1"), Some("ConfigMap")) => LookupKind::ConfigMap,
            _ => return None,
        };
        let namespace = v
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .filter(|ns| !ns.is_empty())
            .unwrap_or(default_namespace);
        Some((kind, namespace, v))
    });
    LookupStore::offline(targets, objects)
}

/// The result for one input object.
pub enum Admitted {
    Ok(Outcome),
    Denied(Denial),
}

/// Puts one object through the engine the way the API server would present it; `lookups` is
/// what [`lookup_store`] made of the inputs.
pub fn admit(
    index: &RuleIndex,
    doc: &Document,
    operation: Operation,
    default_namespace: &str,
    namespaces: &BTreeMap<String, BTreeMap<String, String>>,
    lookups: &LookupStore,
) -> Result<Admitted> {
    with_subject(
        doc,
        operation,
        default_namespace,
        namespaces,
        lookups,
        |subject| match index.evaluate(subject, doc.value.clone(), None) {
            Ok(outcome) => Admitted::Ok(outcome),
            Err(denial) => Admitted::Denied(denial),
        },
    )
}

/// Every rule's part in the admission of one object (`initium explain`), and the object
/// after all of them; the object is presented as [`admit`] presents it.
pub fn explain(
    index: &RuleIndex,
    doc: &Document,
    operation: Operation,
    default_namespace: &str,
    namespaces: &BTreeMap<String, BTreeMap<String, String>>,
    lookups: &LookupStore,
) -> Result<(Vec<Step>, Value)> {
    with_subject(
        doc,
        operation,
        default_namespace,
        namespaces,
        lookups,
        |subject| index.explain(subject, doc.value.clone(), &Limits::default()),
    )
}

/// Runs `f` with the object of `doc` as the API server would present it for admission.
fn with_subject<T>(
    doc: &Document,
    operation: Operation,
    default_namespace: &str,
    namespaces: &BTreeMap<String, BTreeMap<String, String>>,
    lookups: &LookupStore,
    f: impl FnOnce(&Subject) -> T,
) -> Result<T> {
    let object = &doc.value;
    let bad = |message: String| Error::input(doc.origin.clone(), message);
    let api_version = object
        .get("apiVersion")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("missing apiVersion".into()))?;
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("missing kind".into()))?;
    if object.get("metadata").is_some_and(|m| !m.is_object()) {
        return Err(bad("metadata must be an object".into()));
    }
    let gvk = Gvk::from_api_version(api_version, kind);
    let meta_str = |f: &str| {
        object
            .pointer(&format!("/metadata/{f}"))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    let namespace = match meta_str("namespace") {
        Some(ns) => Some(ns),
        None if CLUSTER_SCOPED.contains(&kind) => None,
        None => Some(default_namespace),
    };
    let subject = Subject {
        gvk: &gvk,
        operation,
        namespace,
        name: meta_str("name"),
        // Offline, a namespace without a Namespace object among the inputs has no labels.
        namespace_labels: namespace.map(|ns| namespaces.get(ns).unwrap_or(&NO_LABELS)),
        ran_before: RanBefore::Unknown,
        lookups: Some(lookups),
    };
    Ok(f(&subject))
}

/// `Pod payments/web` for messages.
pub fn describe_object(object: &Value) -> String {
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("object");
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .or_else(|| {
            object
                .pointer("/metadata/generateName")
                .and_then(Value::as_str)
        })
        .unwrap_or("(unnamed)");
    match object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
    {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}
