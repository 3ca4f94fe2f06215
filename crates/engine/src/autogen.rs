//! Autogen: a Pod rule applied to the Pod template of a built-in controller (`spec.autogen`).
//!
//! The template is lent to the rule as the Pod it describes: `apiVersion: v1`, `kind: Pod`,
//! the template's `metadata` and `spec`, the controller's namespace filled in, and, when the
//! template names none, `generateName: <controller>-` (the Pods a controller makes are named
//! after it, so `match.names: [web-*]` selects the templates of `web`). The rule then matches
//! and runs exactly as on a Pod; what it left is given back to the template and the filled-in
//! fields are taken out again. The rule is recorded in the template's `initium.dev/mutated-by`,
//! so the Pods made from it are not mutated by it a second time (a rule runs at most once on
//! an object whose provenance lists it, see `RanBefore`).

use std::sync::LazyLock;

use serde_json::{Map, Value};

use crate::api::{Controller, Operation};

use crate::api::MUTATED_BY_ANNOTATION;

use super::kind::{Gvk, KindPattern, Segment};
use super::path::Pointer;
use super::provenance::listed;
use super::subject::{RanBefore, RuleId, Subject};

/// The Pod a template describes has only these fields; a rule that writes another one
/// (`status`) fails on the template rather than lose the change.
const POD_FIELDS: [&str; 4] = ["apiVersion", "kind", "metadata", "spec"];

static POD: LazyLock<Gvk> = LazyLock::new(|| Gvk::new("", "v1", "Pod"));

/// The controllers of a rule's `spec.autogen`, with where their templates are.
#[derive(Clone, Debug, Default)]
pub(crate) struct Templates {
    controllers: Vec<Controller>,
    /// `apps/*/Deployment`, ...: what the webhook configuration must cover for them.
    kinds: Vec<KindPattern>,
}

impl Templates {
    pub(crate) fn new(controllers: &[Controller]) -> Templates {
        let mut controllers = controllers.to_vec();
        controllers.sort();
        controllers.dedup();
        let kinds = controllers
            .iter()
            .map(|c| KindPattern {
                group: Segment::Exact(c.group().to_string()),
                version: Segment::Any,
                kind: Segment::Exact(c.kind().to_string()),
            })
            .collect();
        Templates { controllers, kinds }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.controllers.is_empty()
    }

    pub(crate) fn kinds(&self) -> &[KindPattern] {
        &self.kinds
    }

    pub(crate) fn controllers(&self) -> &[Controller] {
        &self.controllers
    }

    /// The controller an object of `gvk` is, when the rule covers its template.
    pub(crate) fn of(&self, gvk: &Gvk) -> Option<Controller> {
        self.controllers
            .iter()
            .copied()
            .find(|c| c.kind() == gvk.kind && c.group() == gvk.group)
    }
}

/// Whether the rule `id` already ran on the template at `pointer` of `doc` (see
/// [`RanBefore::Listed`]): at CREATE, the template's provenance lists it (it was copied from a
/// template the rule changed); at UPDATE, the template is the stored one.
pub(crate) fn ran_before(doc: &Value, pointer: &Pointer, subject: &Subject, id: &RuleId) -> bool {
    let RanBefore::Listed {
        stored_template, ..
    } = subject.ran_before
    else {
        return false;
    };
    let template = pointer.get(doc);
    match subject.operation {
        Operation::Create => template
            .and_then(|t| t.pointer("/metadata/annotations"))
            .and_then(|a| a.get(MUTATED_BY_ANNOTATION))
            .and_then(Value::as_str)
            .is_some_and(|list| listed(list).any(|rule| id.is_written(rule))),
        Operation::Update => stored_template.is_some() && stored_template == template,
    }
}

/// Where a controller's Pod template is.
pub(crate) fn template_pointer(controller: Controller) -> Pointer {
    Pointer::from_tokens(controller.template().iter().copied())
}

/// The template's path as a person reads it: `spec.jobTemplate.spec.template`.
pub(crate) fn template_field(controller: Controller) -> String {
    controller.template().join(".")
}

/// What was filled into the lent Pod, to take out again.
struct Lent {
    namespace: Option<String>,
    generate_name: Option<String>,
    had_metadata: bool,
}

/// A rule wrote a field of the Pod that a Pod template does not have.
#[derive(Debug, thiserror::Error)]
#[error(
    "the rule writes {field}, which a Pod template does not have: in a rule with spec.autogen, write only metadata and spec"
)]
pub struct NotInTemplate {
    field: String,
}

/// Runs `f` on the Pod that the controller's template in `doc` describes, and puts back what
/// it left. `None` when the object has no template (nothing to apply the rule to). `f` gets
/// the Pod's subject: the controller's namespace, operation, namespace labels and lookups.
/// Only the Pod's `metadata` and `spec` go back: `f` checks [`not_in_template`] first.
pub(crate) fn with_template<R>(
    doc: &mut Value,
    controller: Controller,
    subject: &Subject,
    f: impl FnOnce(&Subject, &mut Value) -> R,
) -> Option<R> {
    let pointer = template_pointer(controller);
    let owner = doc
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .or(subject.name)
        .map(str::to_string);
    let slot = pointer.get_mut(doc)?;
    let Value::Object(template) = std::mem::take(slot) else {
        return None;
    };
    let (mut pod, mut rest, lent) = lend(template, subject.namespace, owner.as_deref());
    // The template describes Pods to be created, whether the controller is created or
    // updated.
    let pod_subject = Subject {
        gvk: &POD,
        operation: Operation::Create,
        namespace: subject.namespace,
        name: None,
        namespace_labels: subject.namespace_labels,
        lookups: subject.lookups,
        ran_before: RanBefore::Unknown,
    };
    let result = f(&pod_subject, &mut pod);
    give_back(pod, &mut rest, &lent);
    if let Some(slot) = pointer.get_mut(doc) {
        *slot = Value::Object(rest);
    }
    Some(result)
}

/// The Pod a template describes, what else the template holds, and what was filled in.
fn lend(
    mut template: Map<String, Value>,
    namespace: Option<&str>,
    owner: Option<&str>,
) -> (Value, Map<String, Value>, Lent) {
    let metadata = template.remove("metadata");
    let had_metadata = metadata.is_some();
    let mut metadata = metadata.unwrap_or_else(|| Value::Object(Map::new()));
    let mut lent = Lent {
        namespace: None,
        generate_name: None,
        had_metadata,
    };
    if let Value::Object(meta) = &mut metadata {
        let empty = |meta: &Map<String, Value>, field: &str| {
            meta.get(field)
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
        };
        if let Some(ns) = namespace.filter(|n| !n.is_empty())
            && empty(meta, "namespace")
        {
            meta.insert("namespace".into(), Value::String(ns.to_string()));
            lent.namespace = Some(ns.to_string());
        }
        if let Some(owner) = owner
            && empty(meta, "name")
            && empty(meta, "generateName")
        {
            let generated = format!("{owner}-");
            meta.insert("generateName".into(), Value::String(generated.clone()));
            lent.generate_name = Some(generated);
        }
    }
    let mut pod = Map::new();
    pod.insert("apiVersion".into(), Value::String("v1".into()));
    pod.insert("kind".into(), Value::String("Pod".into()));
    pod.insert("metadata".into(), metadata);
    if let Some(spec) = template.remove("spec") {
        pod.insert("spec".into(), spec);
    }
    (Value::Object(pod), template, lent)
}

/// Puts the Pod's metadata and spec back into the template, without what was filled in.
fn give_back(pod: Value, template: &mut Map<String, Value>, lent: &Lent) {
    let Value::Object(mut pod) = pod else {
        return;
    };
    match pod.remove("metadata") {
        Some(Value::Object(mut meta)) => {
            for (field, filled) in [
                ("namespace", &lent.namespace),
                ("generateName", &lent.generate_name),
            ] {
                if let Some(filled) = filled
                    && meta.get(field).and_then(Value::as_str) == Some(filled.as_str())
                {
                    meta.remove(field);
                }
            }
            if lent.had_metadata || !meta.is_empty() {
                template.insert("metadata".into(), Value::Object(meta));
            }
        }
        // `metadata: null` (or another value) in the template: back as it was.
        Some(other) if lent.had_metadata => {
            template.insert("metadata".into(), other);
        }
        Some(_) | None => {}
    }
    if let Some(spec) = pod.remove("spec") {
        template.insert("spec".into(), spec);
    }
}

/// The first field of the lent Pod that a template cannot hold, as a person reads it.
pub(crate) fn not_in_template(pod: &Value) -> Option<NotInTemplate> {
    let field = pod
        .as_object()?
        .keys()
        .find(|k| !POD_FIELDS.contains(&k.as_str()))?;
    Some(NotInTemplate {
        field: field.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn subject<'a>(gvk: &'a Gvk) -> Subject<'a> {
        Subject {
            gvk,
            operation: Operation::Create,
            namespace: Some("shop"),
            name: None,
            namespace_labels: None,
            lookups: None,
            ran_before: RanBefore::Unknown,
        }
    }

    #[test]
    fn the_template_is_lent_as_the_pod_it_describes_and_given_back_without_what_was_filled_in() {
        let gvk = Gvk::new("apps", "v1", "Deployment");
        let mut doc = json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"replicas": 2, "template": {"metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "c", "image": "nginx"}]}}}});
        let before = doc.clone();
        let seen = with_template(
            &mut doc,
            Controller::Deployment,
            &subject(&gvk),
            |s, pod| {
                assert_eq!(s.gvk.kind, "Pod");
                let seen = pod.clone();
                pod["metadata"]["labels"]["team"] = json!("a");
                seen
            },
        );
        assert_eq!(
            seen,
            Some(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"labels": {"app": "web"}, "namespace": "shop", "generateName": "web-"},
                "spec": {"containers": [{"name": "c", "image": "nginx"}]}}))
        );
        let mut expected = before;
        expected["spec"]["template"]["metadata"]["labels"]["team"] = json!("a");
        assert_eq!(doc, expected);
    }

    #[test]
    fn a_cronjobs_template_is_under_its_job_template_and_a_missing_one_lends_nothing() {
        let gvk = Gvk::new("batch", "v1", "CronJob");
        let mut doc = json!({"metadata": {"name": "nightly"},
            "spec": {"jobTemplate": {"spec": {"template": {"spec": {"containers": []}}}}}});
        let ran = with_template(&mut doc, Controller::CronJob, &subject(&gvk), |_, pod| {
            pod["spec"]["restartPolicy"] = json!("Never");
        });
        assert_eq!(ran, Some(()));
        assert_eq!(
            doc,
            json!({"metadata": {"name": "nightly"},
                "spec": {"jobTemplate": {"spec": {"template": {"spec": {"containers": [],
                    "restartPolicy": "Never"}}}}}})
        );
        // A template whose metadata is null is lent and given back as it was.
        let mut null_meta = json!({"metadata": {"name": "web"},
            "spec": {"template": {"metadata": null, "spec": {}}}});
        let before = null_meta.clone();
        let dgvk = Gvk::new("apps", "v1", "Deployment");
        with_template(
            &mut null_meta,
            Controller::Deployment,
            &subject(&dgvk),
            |_, pod| {
                assert_eq!(pod["metadata"], Value::Null);
            },
        );
        assert_eq!(null_meta, before);
        let mut bare = json!({"metadata": {"name": "nightly"}, "spec": {}});
        assert_eq!(
            with_template(&mut bare, Controller::CronJob, &subject(&gvk), |_, _| ()),
            None
        );
        assert_eq!(bare, json!({"metadata": {"name": "nightly"}, "spec": {}}));
    }

    #[test]
    fn only_the_controllers_of_their_own_groups_are_covered() {
        let templates = Templates::new(&[Controller::Job, Controller::Deployment]);
        assert_eq!(
            templates.of(&Gvk::new("apps", "v1", "Deployment")),
            Some(Controller::Deployment)
        );
        assert_eq!(
            templates.of(&Gvk::new("batch", "v1", "Job")),
            Some(Controller::Job)
        );
        assert_eq!(
            templates.of(&Gvk::new("example.com", "v1", "Deployment")),
            None
        );
        assert_eq!(templates.of(&Gvk::new("apps", "v1", "StatefulSet")), None);
        let kinds: Vec<String> = templates.kinds().iter().map(ToString::to_string).collect();
        assert_eq!(kinds, ["apps/*/Deployment", "batch/*/Job"]);
    }

    #[test]
    fn a_field_a_template_lacks_is_named() {
        assert!(not_in_template(&json!({"apiVersion": "v1", "kind": "Pod", "spec": {}})).is_none());
        let found = not_in_template(&json!({"kind": "Pod", "status": {}}));
        assert_eq!(
            found.map(|e| e.to_string()),
            Some("the rule writes status, which a Pod template does not have: in a rule with spec.autogen, write only metadata and spec".into())
        );
    }
}
