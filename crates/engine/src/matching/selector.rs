//! Kubernetes label selectors (`matchLabels` + `matchExpressions`), validated at compile time.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::error::Errors;

use super::LabelNeed;

#[derive(Clone, Debug, PartialEq)]
enum Requirement {
    Equals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A compiled label selector. The empty selector matches everything.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    pub(crate) fn compile(selector: &LabelSelector, field: &str, errors: &mut Errors) -> Selector {
        let mut requirements = Vec::new();
        for (key, value) in selector.match_labels.iter().flatten() {
            check_key(key, &format!("{field}.matchLabels"), errors);
            requirements.push(Requirement::Equals(key.clone(), value.clone()));
        }
        for (i, expr) in selector.match_expressions.iter().flatten().enumerate() {
            let at = format!("{field}.matchExpressions[{i}]");
            check_key(&expr.key, &format!("{at}.key"), errors);
            let values = expr.values.clone().unwrap_or_default();
            let key = expr.key.clone();
            let requirement = match expr.operator.as_str() {
                "In" | "NotIn" if values.is_empty() => {
                    errors.push(
                        format!("{at}.values"),
                        format!("operator {} needs at least one value", expr.operator),
                    );
                    continue;
                }
                "Exists" | "DoesNotExist" if !values.is_empty() => {
                    errors.push(
                        format!("{at}.values"),
                        format!("operator {} takes no values", expr.operator),
                    );
                    continue;
                }
                "In" => Requirement::In(key, values),
                "NotIn" => Requirement::NotIn(key, values),
                "Exists" => Requirement::Exists(key),
                "DoesNotExist" => Requirement::DoesNotExist(key),
                other => {
                    errors.push(
                        format!("{at}.operator"),
                        format!(
                            "unknown operator {other:?}: use In, NotIn, Exists or DoesNotExist"
                        ),
                    );
                    continue;
                }
            };
            requirements.push(requirement);
        }
        Selector { requirements }
    }

    /// A requirement without which the selector cannot match, for the index's prefilter: the
    /// first `matchLabels` pair, else the first `In`, else the first `Exists` (`NotIn` and
    /// `DoesNotExist` hold for an object without labels, so they need nothing).
    pub(crate) fn label_need(&self) -> Option<LabelNeed<'_>> {
        let mut need = None;
        for r in &self.requirements {
            match r {
                Requirement::Equals(k, v) => {
                    return Some(LabelNeed::Value(k, std::slice::from_ref(v)));
                }
                Requirement::In(k, vs) if !matches!(need, Some(LabelNeed::Value(..))) => {
                    need = Some(LabelNeed::Value(k, vs));
                }
                Requirement::Exists(k) if need.is_none() => need = Some(LabelNeed::Key(k)),
                _ => {}
            }
        }
        need
    }

    /// Matches the object's own labels (`metadata.labels`).
    pub fn matches(&self, labels: Option<&serde_json::Map<String, serde_json::Value>>) -> bool {
        self.matches_with(|key| labels.and_then(|l| l.get(key)).and_then(|v| v.as_str()))
    }

    /// Matches a plain label map (namespace labels kept by the caller).
    pub fn matches_map(&self, labels: &BTreeMap<String, String>) -> bool {
        self.matches_with(|key| labels.get(key).map(String::as_str))
    }

    fn matches_with<'a>(&self, get: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.requirements.iter().all(|r| match r {
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::DoesNotExist(k) => get(k).is_none(),
        })
    }
}

fn check_key(key: &str, field: &str, errors: &mut Errors) {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'))
    });
    if !name_ok || !prefix_ok {
        errors.push(field, format!("invalid label key {key:?}"));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use serde_json::json;

    fn selector(v: serde_json::Value) -> (Selector, Vec<String>) {
        let ls: LabelSelector = serde_json::from_value(v).unwrap();
        let mut errors = Errors::default();
        let s = Selector::compile(&ls, "spec.match.labels", &mut errors);
        (s, errors.errors.iter().map(|e| e.to_string()).collect())
    }

    #[test]
    fn match_labels_and_expressions() {
        let (s, errs) = selector(json!({
            "matchLabels": {"app": "web"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "legacy", "operator": "DoesNotExist"},
                {"key": "env", "operator": "NotIn", "values": ["dev"]},
                {"key": "team", "operator": "Exists"}
            ]
        }));
        assert!(errs.is_empty(), "{errs:?}");
        let labels = |v: serde_json::Value| v.as_object().cloned().unwrap();
        assert!(s.matches(Some(&labels(
            json!({"app": "web", "tier": "a", "team": "x"})
        ))));
        assert!(s.matches(Some(&labels(
            json!({"app": "web", "tier": "b", "team": "x", "env": "prod"})
        ))));
        assert!(!s.matches(Some(&labels(
            json!({"app": "web", "tier": "c", "team": "x"})
        ))));
        assert!(!s.matches(Some(&labels(
            json!({"app": "web", "tier": "a", "team": "x", "legacy": "1"})
        ))));
        assert!(!s.matches(Some(&labels(
            json!({"app": "web", "tier": "a", "team": "x", "env": "dev"})
        ))));
        assert!(!s.matches(Some(&labels(json!({"app": "web", "tier": "a"})))));
        assert!(!s.matches(None));
        assert!(Selector::default().matches(None));
    }

    #[test]
    fn bad_operators_and_values_name_the_field() {
        let (_, errs) = selector(json!({"matchExpressions": [
            {"key": "a", "operator": "Has"},
            {"key": "b", "operator": "In"},
            {"key": "c", "operator": "Exists", "values": ["x"]},
            {"key": "-bad", "operator": "Exists"}
        ]}));
        assert_eq!(
            errs,
            vec![
                "spec.match.labels.matchExpressions[0].operator: unknown operator \"Has\": use In, NotIn, Exists or DoesNotExist",
                "spec.match.labels.matchExpressions[1].values: operator In needs at least one value",
                "spec.match.labels.matchExpressions[2].values: operator Exists takes no values",
                "spec.match.labels.matchExpressions[3].key: invalid label key \"-bad\"",
            ]
        );
    }
}
