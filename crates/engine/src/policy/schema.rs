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

    /// Whether the kind has the field (or list element) `steps` leads to; `Err` says where it
    /// stops, as a sentence fragment (`has no field spec.extra`).
    pub(super) fn check(&self, steps: &[Step<'_>]) -> Result<(), String> {
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
        Ok(())
    }

    /// [`KindSchema::check`] for a path of fields.
    #[cfg(test)]
    pub(super) fn check_path(&self, path: &Path) -> Result<(), String> {
        let steps: Vec<Step<'_>> = path.0.iter().map(|s| Step::Field(s)).collect();
        self.check(&steps)
    }
}

fn join(walked: &str, name: &str) -> String {
    if walked.is_empty() {
        name.to_string()
    } else {
        format!("{walked}.{name}")
    }
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
        assert_eq!(
            pod().check(&[
                Step::Field("spec"),
                Step::Field("volumes"),
                Step::Element,
                Step::Field("secret"),
                Step::Field("secretName"),
            ]),
            Ok(())
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
            pod().check(&[Step::Field("spec"), Step::Field("hostname"), Step::Element]),
            Err("spec.hostname is not a list".into())
        );
        let deployment = of(&Gvk::new("apps", "v1", "Deployment")).unwrap();
        assert_eq!(
            deployment.check_path(&path("spec.template.spec.containers")),
            Ok(())
        );
        assert!(deployment.check_path(&path("spec.containers")).is_err());
    }
}
