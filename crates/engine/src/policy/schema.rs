//! The fields of the kinds a compiled rule may write, from k8s-openapi's schemas.
//!
//! Why: the API server decodes what a MutatingAdmissionPolicy's patch produced strictly, so a
//! field the kind does not have makes the request fail (500, whatever the failure policy),
//! while the object a webhook's patch produced is decoded leniently and the field is dropped.
//! A rule that writes such a field does different things on the two paths, so it is not
//! compiled. Only built-in kinds have schemas here (those of Kubernetes 1.34, the version the
//! crate's types are generated from): a field of a GA API version is never removed, so a field
//! known here is known to every later API server; a field added later is unknown here and the
//! rule stays on the webhook, which is the safe side.

use std::sync::LazyLock;

use serde_json::{Map, Value};

use crate::kind::Gvk;

#[cfg(test)]
use super::cel::Path;

/// A kind's JSON schema: the root and the definitions its `$ref`s name.
pub(super) struct KindSchema {
    pub(super) gvk: Gvk,
    root: Value,
    defs: Map<String, Value>,
}

fn schema_of<T: schemars::JsonSchema>(group: &str, version: &str, kind: &str) -> KindSchema {
    let schema = schemars::schema_for!(T);
    let mut root = schema.to_value();
    let defs = match root.as_object_mut().and_then(|o| o.remove("$defs")) {
        Some(Value::Object(defs)) => defs,
        _ => Map::new(),
    };
    KindSchema {
        gvk: Gvk::new(group, version, kind),
        root,
        defs,
    }
}

static SCHEMAS: LazyLock<Vec<KindSchema>> = LazyLock::new(|| {
    use k8s_openapi::api::{apps, batch, core, networking};
    vec![
        schema_of::<core::v1::Pod>("", "v1", "Pod"),
        schema_of::<core::v1::ConfigMap>("", "v1", "ConfigMap"),
        schema_of::<core::v1::Secret>("", "v1", "Secret"),
        schema_of::<core::v1::Service>("", "v1", "Service"),
        schema_of::<core::v1::ServiceAccount>("", "v1", "ServiceAccount"),
        schema_of::<core::v1::PersistentVolumeClaim>("", "v1", "PersistentVolumeClaim"),
        schema_of::<apps::v1::Deployment>("apps", "v1", "Deployment"),
        schema_of::<apps::v1::StatefulSet>("apps", "v1", "StatefulSet"),
        schema_of::<apps::v1::DaemonSet>("apps", "v1", "DaemonSet"),
        schema_of::<apps::v1::ReplicaSet>("apps", "v1", "ReplicaSet"),
        schema_of::<batch::v1::Job>("batch", "v1", "Job"),
        schema_of::<batch::v1::CronJob>("batch", "v1", "CronJob"),
        schema_of::<networking::v1::Ingress>("networking.k8s.io", "v1", "Ingress"),
    ]
});

/// The schema of a built-in kind, `None` for any other.
pub(super) fn of(gvk: &Gvk) -> Option<&'static KindSchema> {
    SCHEMAS.iter().find(|s| &s.gvk == gvk)
}

/// A step into a value: a field (or map key), or the elements of a list.
#[derive(Clone, Copy)]
pub(super) enum Step<'a> {
    Field(&'a str),
    Element,
}

/// How deep `$ref`s may chain before the schema is taken as unknown (they never chain in
/// k8s-openapi's schemas; this only bounds a loop).
const MAX_REFS: usize = 8;

impl KindSchema {
    fn resolve<'s>(&'s self, mut schema: &'s Value) -> Option<&'s Value> {
        for _ in 0..MAX_REFS {
            match schema.get("$ref").and_then(Value::as_str) {
                Some(reference) => {
                    let name = reference.strip_prefix("#/$defs/")?;
                    schema = self.defs.get(name)?;
                }
                None => return Some(schema),
            }
        }
        None
    }

    /// Whether the kind has the field (or list element) `steps` leads to, and that field takes
    /// `value` (a scalar, an empty object or list, or null); `Err` says why not, as a sentence
    /// fragment (`has no field spec.extra`).
    pub(super) fn accepts(&self, steps: &[Step<'_>], value: &Value) -> Result<(), String> {
        let schema = self.check(steps)?;
        let field = shown_steps(steps);
        // Quantities are written as strings or numbers (`cpu: 1`).
        let quantity = schema
            .get("$ref")
            .and_then(Value::as_str)
            .is_some_and(|r| r.ends_with(".api.resource.Quantity"));
        let schema = self
            .resolve(schema)
            .ok_or_else(|| format!("has a schema initium cannot read at {field}"))?;
        let int_or_string = schema
            .get("x-kubernetes-int-or-string")
            .and_then(Value::as_bool)
            == Some(true);
        let kind = schema.get("type").and_then(Value::as_str);
        let fits = match value {
            Value::Null => true,
            Value::Bool(_) => kind == Some("boolean"),
            Value::Number(n) => {
                quantity
                    || kind == Some("number")
                    || ((kind == Some("integer") || int_or_string) && n.is_i64())
            }
            Value::String(_) => quantity || int_or_string || kind == Some("string"),
            Value::Array(_) => kind == Some("array"),
            Value::Object(_) => {
                kind == Some("object")
                    || (kind.is_none()
                        && (schema.get("properties").is_some()
                            || schema.get("additionalProperties").is_some()))
            }
        };
        if fits {
            Ok(())
        } else {
            let wanted = if quantity {
                "a quantity"
            } else if int_or_string {
                "an integer or a string"
            } else {
                match kind {
                    Some("boolean") => "a boolean",
                    Some("integer") => "an integer",
                    Some("number") => "a number",
                    Some("string") => "a string",
                    Some("array") => "a list",
                    Some("object") => "an object",
                    _ => "a value initium does not know the type of",
                }
            };
            Err(format!("takes {wanted} at {field}, not {value}"))
        }
    }

    /// Whether the kind has the field (or list element) `steps` leads to: its schema, or `Err`
    /// saying where the path stops, as a sentence fragment (`has no field spec.extra`).
    pub(super) fn check(&self, steps: &[Step<'_>]) -> Result<&Value, String> {
        let mut schema = &self.root;
        let mut walked = String::new();
        for step in steps {
            let here = self
                .resolve(schema)
                .ok_or_else(|| format!("has a schema initium cannot read at {}", shown(&walked)))?;
            let kind = here.get("type").and_then(Value::as_str);
            let next = match step {
                Step::Field(name) => {
                    let field = here
                        .get("properties")
                        .and_then(Value::as_object)
                        .and_then(|p| p.get(*name));
                    let map = here.get("additionalProperties").filter(|v| v.is_object());
                    match (field, map) {
                        (Some(field), _) => field,
                        (None, Some(values)) => values,
                        (None, None)
                            if kind == Some("object") || here.get("properties").is_some() =>
                        {
                            return Err(format!("has no field {}", shown(&join(&walked, name))));
                        }
                        (None, None) => {
                            return Err(format!(
                                "has no fields under {} ({})",
                                shown(&walked),
                                kind.unwrap_or("a value initium does not know the fields of")
                            ));
                        }
                    }
                }
                Step::Element => match here.get("items") {
                    Some(items) if kind == Some("array") => items,
                    _ => {
                        return Err(format!("{} is not a list", shown(&walked)));
                    }
                },
            };
            walked = match step {
                Step::Field(name) => join(&walked, name),
                Step::Element => format!("{walked}[]"),
            };
            schema = next;
        }
        Ok(schema)
    }

    /// [`KindSchema::check`] for a path of fields.
    #[cfg(test)]
    pub(super) fn check_path(&self, path: &Path) -> Result<(), String> {
        let steps: Vec<Step<'_>> = path.0.iter().map(|s| Step::Field(s)).collect();
        self.check(&steps).map(|_| ())
    }
}

fn join(walked: &str, name: &str) -> String {
    if walked.is_empty() {
        name.to_string()
    } else {
        format!("{walked}.{name}")
    }
}

fn shown_steps(steps: &[Step<'_>]) -> String {
    let mut walked = String::new();
    for step in steps {
        walked = match step {
            Step::Field(name) => join(&walked, name),
            Step::Element => format!("{walked}[]"),
        };
    }
    shown(&walked).to_string()
}

fn shown(walked: &str) -> &str {
    if walked.is_empty() {
        "the root"
    } else {
        walked
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> &'static KindSchema {
        of(&Gvk::new("", "v1", "Pod")).unwrap()
    }

    fn path(text: &str) -> Path {
        Path(text.split('.').map(String::from).collect())
    }

    #[test]
    fn every_builtin_kind_has_a_schema() {
        for (g, v, k, _) in super::super::BUILTIN {
            assert!(of(&Gvk::new(g, v, k)).is_some(), "{k}");
        }
        assert!(of(&Gvk::new("example.com", "v1", "Widget")).is_none());
    }

    #[test]
    fn known_fields_and_map_keys_pass() {
        assert_eq!(pod().check_path(&path("spec.nodeSelector.disk")), Ok(()));
        assert_eq!(pod().check_path(&path("metadata.labels.team")), Ok(()));
        assert!(
            pod()
                .check(&[
                    Step::Field("spec"),
                    Step::Field("volumes"),
                    Step::Element,
                    Step::Field("secret"),
                    Step::Field("secretName"),
                ])
                .is_ok()
        );
    }

    #[test]
    fn unknown_fields_are_named() {
        assert_eq!(
            pod().check_path(&path("spec.extra")),
            Err("has no field spec.extra".into())
        );
        assert_eq!(
            pod().check_path(&path("spec.hostname.x")),
            Err("has no fields under spec.hostname (string)".into())
        );
        assert_eq!(
            pod()
                .check(&[Step::Field("spec"), Step::Field("hostname"), Step::Element])
                .map(|_| ()),
            Err("spec.hostname is not a list".into())
        );
        let deployment = of(&Gvk::new("apps", "v1", "Deployment")).unwrap();
        assert_eq!(
            deployment.check_path(&path("spec.template.spec.containers")),
            Ok(())
        );
        assert!(deployment.check_path(&path("spec.containers")).is_err());
    }

    #[test]
    fn values_must_have_the_fields_type() {
        let steps = |text: &'static str| -> Vec<Step<'static>> {
            text.split('.')
                .map(|s| {
                    if s == "[]" {
                        Step::Element
                    } else {
                        Step::Field(s)
                    }
                })
                .collect()
        };
        let pod = pod();
        let ok = [
            ("spec.hostname", json!("a")),
            ("spec.priority", json!(3)),
            ("spec.hostNetwork", json!(true)),
            ("spec.nodeSelector", json!({})),
            ("spec.tolerations", json!([])),
            ("spec.hostname", Value::Null),
            ("spec.containers.[].resources.requests.cpu", json!(1)),
            ("spec.containers.[].resources.requests.cpu", json!("50m")),
            ("spec.containers.[].ports.[].containerPort", json!(8080)),
            (
                "spec.containers.[].livenessProbe.httpGet.port",
                json!("http"),
            ),
        ];
        for (at, value) in ok {
            assert_eq!(pod.accepts(&steps(at), &value), Ok(()), "{at} {value}");
        }
        let refused = [
            (
                "spec.hostname",
                json!(1),
                "takes a string at spec.hostname, not 1",
            ),
            (
                "spec.priority",
                json!("3"),
                "takes an integer at spec.priority, not \"3\"",
            ),
            (
                "spec.hostNetwork",
                json!("yes"),
                "takes a boolean at spec.hostNetwork, not \"yes\"",
            ),
            (
                "spec.nodeSelector",
                json!([]),
                "takes an object at spec.nodeSelector, not []",
            ),
            (
                "spec.containers.[].livenessProbe.httpGet.port",
                json!(true),
                "takes an integer or a string at spec.containers[].livenessProbe.httpGet.port, not true",
            ),
        ];
        for (at, value, why) in refused {
            assert_eq!(
                pod.accepts(&steps(at), &value),
                Err(why.to_string()),
                "{at}"
            );
        }
    }
}
