//! Rule documents (YAML/JSON already parsed into values) to rule specs, with every unknown
//! field and type error reported by field path.

use serde_json::Value;

use crate::api::{API_VERSION, RuleSpec};

use super::error::{FieldError, RuleErrors};
use super::rule::{CompiledRule, compile};
use super::subject::RuleId;

/// A rule as written: its identity and spec.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleSource {
    pub id: RuleId,
    pub spec: RuleSpec,
}

/// Whether a document is a rule (by `kind`), so callers can sort documents.
pub fn is_rule_document(doc: &Value) -> bool {
    matches!(
        doc.get("kind").and_then(Value::as_str),
        Some("MutationRule" | "ClusterMutationRule")
    )
}

/// Reads a MutationRule or ClusterMutationRule document. A MutationRule without a namespace
/// gets `default_namespace` (as `kubectl apply` would).
pub fn parse_rule(doc: &Value, default_namespace: &str) -> Result<RuleSource, RuleErrors> {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
    let name = doc
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let namespace = doc
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    let describe = if name.is_empty() {
        format!("{kind} (unnamed)")
    } else {
        format!("{kind} {name}")
    };
    let fail = |field: &str, message: String| RuleErrors {
        rule: describe.clone(),
        errors: vec![FieldError::new(field, message)],
    };
    for field in ["name", "namespace"] {
        if let Some(value) = doc.pointer(&format!("/metadata/{field}"))
            && !value.is_string()
            && !value.is_null()
        {
            return Err(fail(
                &format!("metadata.{field}"),
                format!(
                    "must be a string, found {value} (in YAML, quote values such as y, no or 1)"
                ),
            ));
        }
    }
    let id = match kind {
        "MutationRule" => RuleId::namespaced(namespace.unwrap_or(default_namespace), name),
        "ClusterMutationRule" => {
            if let Some(ns) = namespace {
                return Err(fail(
                    "metadata.namespace",
                    format!("a ClusterMutationRule is cluster-scoped; remove namespace {ns:?}"),
                ));
            }
            RuleId::cluster(name)
        }
        other => {
            return Err(fail(
                "kind",
                format!("expected MutationRule or ClusterMutationRule, found {other:?}"),
            ));
        }
    };
    let api_version = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    if api_version != API_VERSION {
        return Err(fail(
            "apiVersion",
            format!("expected {API_VERSION}, found {api_version:?}"),
        ));
    }
    if !is_dns_subdomain(name) {
        return Err(fail(
            "metadata.name",
            format!(
                "{name:?} is not a valid name (lowercase letters, digits, '-' and '.', at most 253)"
            ),
        ));
    }
    let rule = id.describe();
    let Some(spec) = doc.get("spec") else {
        return Err(RuleErrors {
            rule,
            errors: vec![FieldError::new("spec", "missing")],
        });
    };
    let mut unknown = Vec::new();
    let mut on_unknown = |path: serde_ignored::Path| {
        unknown.push(FieldError::new(
            format!("spec.{}", dotted(&path.to_string())),
            "unknown field",
        ));
    };
    let parsed: Result<RuleSpec, _> =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(spec, &mut on_unknown));
    match parsed {
        Err(e) => {
            let path = e.path().to_string();
            let field = if path == "." {
                "spec".to_string()
            } else {
                format!("spec.{}", dotted(&path))
            };
            let mut message = e.into_inner().to_string();
            if field.starts_with("spec.conditions[")
                && field.ends_with("].in")
                && message.starts_with("invalid type: sequence")
            {
                // Kyverno's `operator: AnyIn` with a list of values.
                message = "`in` takes a JSONPath query whose selected values the path's value must be among, not a list; to test against fixed values write `matches: '^(a|b)$'`".into();
            }
            Err(RuleErrors {
                rule,
                errors: vec![FieldError::new(field, message)],
            })
        }
        Ok(_) if !unknown.is_empty() => Err(RuleErrors {
            rule,
            errors: unknown,
        }),
        Ok(spec) => Ok(RuleSource { id, spec }),
    }
}

/// Parses and compiles a rule document.
pub fn compile_document(doc: &Value, default_namespace: &str) -> Result<CompiledRule, RuleErrors> {
    let source = parse_rule(doc, default_namespace)?;
    compile(source.id, &source.spec)
}

/// serde paths read `mutations[2].upsert.path` already; serde_ignored writes `mutations.2.x`.
fn dotted(path: &str) -> String {
    let mut out = String::new();
    for (i, part) in path.split('.').filter(|p| *p != "?").enumerate() {
        if let Some(rest) = part.strip_prefix('[') {
            out.push('[');
            out.push_str(rest);
        } else if part.chars().all(|c| c.is_ascii_digit()) && !part.is_empty() {
            out.push_str(&format!("[{part}]"));
        } else {
            if i > 0 {
                out.push('.');
            }
            out.push_str(part);
        }
    }
    out
}

fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}
