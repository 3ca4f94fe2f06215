//! Autogen (`spec.autogen`): a Pod rule applied to the Pod templates of the built-in
//! controllers, in the pure engine: which controllers, where their templates are, what the
//! rule sees, provenance, at-most-once on the Pods the templates make, and what is refused.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

use initium::api::Operation;
use initium::engine::{
    Gvk, Outcome, RanBefore, RuleIndex, RuleSource, Subject, compile_all, parse_rule,
};
use serde_json::{Value, json};

fn cmr(name: &str, spec: Value) -> RuleSource {
    parse_rule(
        &json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule",
                "metadata": {"name": name}, "spec": spec}),
        "default",
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn index(rules: Vec<RuleSource>) -> RuleIndex {
    let (compiled, errors) = compile_all(&rules);
    assert!(errors.is_empty(), "{errors:?}");
    RuleIndex::new(compiled)
}

fn admit_as(index: &RuleIndex, object: &Value, ran_before: RanBefore) -> Outcome {
    let gvk = Gvk::from_api_version(
        object["apiVersion"].as_str().unwrap(),
        object["kind"].as_str().unwrap(),
    );
    let subject = Subject {
        gvk: &gvk,
        operation: Operation::Create,
        namespace: object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str),
        name: object.pointer("/metadata/name").and_then(Value::as_str),
        namespace_labels: None,
        ran_before,
        lookups: None,
    };
    let out = index
        .evaluate(&subject, object.clone(), None)
        .unwrap_or_else(|d| panic!("denied: {d}"));
    // The patch the webhook answers with takes the object to the outcome.
    let mut patched = object.clone();
    json_patch::patch(&mut patched, &out.patch()).unwrap();
    assert_eq!(patched, out.object);
    out
}

fn admit(index: &RuleIndex, object: &Value) -> Outcome {
    admit_as(index, object, RanBefore::Unknown)
}

fn pod_spec() -> Value {
    json!({"containers": [{"name": "app", "image": "docker.io/library/nginx"}]})
}

/// A Pod template with the labels `app: web`.
fn template() -> Value {
    json!({"metadata": {"labels": {"app": "web"}}, "spec": pod_spec()})
}

/// One object of each controller kind, each with the same Pod template.
fn controllers() -> Vec<(&'static str, Value, &'static str)> {
    let meta = json!({"name": "web", "namespace": "shop"});
    vec![
        (
            "Deployment",
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": template()}}),
            "/spec/template",
        ),
        (
            "StatefulSet",
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta,
            "spec": {"serviceName": "web", "selector": {"matchLabels": {"app": "web"}}, "template": template()}}),
            "/spec/template",
        ),
        (
            "DaemonSet",
            json!({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta,
            "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": template()}}),
            "/spec/template",
        ),
        (
            "ReplicaSet",
            json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": meta,
            "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": template()}}),
            "/spec/template",
        ),
        (
            "Job",
            json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"template": template()}}),
            "/spec/template",
        ),
        (
            "CronJob",
            json!({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": meta,
            "spec": {"schedule": "0 * * * *", "jobTemplate": {"spec": {"template": template()}}}}),
            "/spec/jobTemplate/spec/template",
        ),
    ]
}

/// A Pod rule that mirrors images, labels the Pod with its namespace, and tolerates a taint
/// with an append (not idempotent: a second run would add a second toleration).
fn pod_rule(autogen: Option<Value>) -> Value {
    let mut spec = json!({
        "match": {"kinds": ["Pod"], "labels": {"matchLabels": {"app": "web"}}},
        "mutations": [
            {"forEach": "$.spec.containers[*]", "mutations": [
                {"rewrite": {"path": "/image", "regex": "^docker\\.io/(.*)$", "replacement": "mirror.local/$1"}}]},
            {"merge": {"metadata": {"labels": {"ns": "{{ $.metadata.namespace }}"}}}},
            {"patch": [{"op": "add", "path": "/spec/tolerations/-",
                        "value": {"key": "spot", "operator": "Exists"}}]}
        ]
    });
    if let Some(autogen) = autogen {
        spec["autogen"] = autogen;
    }
    spec
}

#[test]
fn with_autogen_the_rule_changes_each_controllers_template_as_it_would_change_the_pod() {
    let idx = index(vec![cmr(
        "mirror",
        pod_rule(Some(json!({"controllers": [
            "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"]}))),
    )]);
    for (kind, object, at) in controllers() {
        let out = admit(&idx, &object);
        assert_eq!(out.applied.len(), 1, "{kind}");
        let template = out.object.pointer(at).unwrap();
        assert_eq!(
            template["spec"]["containers"][0]["image"], "mirror.local/library/nginx",
            "{kind}"
        );
        assert_eq!(
            template["spec"]["tolerations"],
            json!([{"key": "spot", "operator": "Exists"}]),
            "{kind}"
        );
        // `$.metadata.namespace` is the namespace the Pods will be made in.
        assert_eq!(
            template["metadata"]["labels"],
            json!({"app": "web", "ns": "shop"}),
            "{kind}"
        );
        // The template records the rule, so its Pods are not mutated a second time, and
        // nothing filled in for the rule (namespace, generateName) is left in it.
        assert_eq!(
            template["metadata"],
            json!({"labels": {"app": "web", "ns": "shop"},
                   "annotations": {"initium.dev/mutated-by": "mirror"}}),
            "{kind}"
        );
        assert_eq!(
            out.object["metadata"]["annotations"]["initium.dev/mutated-by"], "mirror",
            "{kind}"
        );
        // Nothing outside the template and the provenance changed.
        let mut rest = out.object.clone();
        let mut before = object.clone();
        *rest.pointer_mut(at).unwrap() = Value::Null;
        *before.pointer_mut(at).unwrap() = Value::Null;
        rest["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("annotations");
        assert_eq!(rest, before, "{kind}");
    }
}

#[test]
fn without_autogen_controllers_are_left_as_written() {
    let idx = index(vec![cmr("mirror", pod_rule(None))]);
    for (kind, object, _) in controllers() {
        let out = admit(&idx, &object);
        assert!(out.matched.is_empty(), "{kind}");
        assert_eq!(out.object, object, "{kind}");
        assert!(out.ops.is_empty(), "{kind}");
    }
}

#[test]
fn autogen_with_no_list_covers_the_five_controllers_kyverno_covers() {
    let idx = index(vec![cmr("mirror", pod_rule(Some(json!({}))))]);
    for (kind, object, _) in controllers() {
        let changed = !admit(&idx, &object).applied.is_empty();
        assert_eq!(changed, kind != "ReplicaSet", "{kind}");
    }
    let only_jobs = index(vec![cmr(
        "mirror",
        pod_rule(Some(json!({"controllers": ["Job"]}))),
    )]);
    for (kind, object, _) in controllers() {
        let changed = !admit(&only_jobs, &object).applied.is_empty();
        assert_eq!(changed, kind == "Job", "{kind}");
    }
}

#[test]
fn the_pods_a_mutated_template_makes_are_not_mutated_again() {
    let idx = index(vec![cmr("mirror", pod_rule(Some(json!({}))))]);
    let (_, deployment, at) = controllers().remove(0);
    let out = admit(&idx, &deployment);
    let template = out.object.pointer(at).unwrap().clone();
    // The ReplicaSet controller makes a Pod from the template; at its admission initium
    // skips the rules its provenance already lists.
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "web-7d9f-", "namespace": "shop",
                     "labels": template["metadata"]["labels"],
                     "annotations": template["metadata"]["annotations"]},
        "spec": template["spec"]});
    let again = admit_as(
        &idx,
        &pod,
        RanBefore::Listed {
            stored: None,
            stored_template: None,
        },
    );
    assert!(again.applied.is_empty());
    assert_eq!(again.object, pod);
    assert_eq!(
        again.object["spec"]["tolerations"].as_array().map(Vec::len),
        Some(1)
    );
    // A Pod from a template the rule did not change (autogen off) is mutated at creation.
    let plain = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "web-7d9f-", "namespace": "shop", "labels": {"app": "web"}},
        "spec": pod_spec()});
    let created = admit_as(
        &idx,
        &plain,
        RanBefore::Listed {
            stored: None,
            stored_template: None,
        },
    );
    assert_eq!(created.applied.len(), 1);
    assert_eq!(
        created.object["spec"]["containers"][0]["image"],
        "mirror.local/library/nginx"
    );
}

#[test]
fn the_rule_matches_the_template_not_the_controller() {
    let idx = index(vec![cmr("mirror", pod_rule(Some(json!({}))))]);
    let (_, mut deployment, _) = controllers().remove(0);
    // The Deployment's own labels do not matter; the template's do.
    deployment["metadata"]["labels"] = json!({"app": "web"});
    deployment["spec"]["template"]["metadata"]["labels"] = json!({"app": "api"});
    assert!(admit(&idx, &deployment).matched.is_empty());
    // Names match as the Pods' are made: after the controller.
    let named = index(vec![cmr(
        "named",
        json!({"match": {"kinds": ["Pod"], "names": ["web-*"]}, "autogen": {},
               "mutations": [{"merge": {"metadata": {"labels": {"named": "yes"}}}}]}),
    )]);
    let out = admit(&named, &deployment);
    assert_eq!(
        out.object["spec"]["template"]["metadata"]["labels"]["named"],
        "yes"
    );
    let (_, mut other, _) = controllers().remove(0);
    other["metadata"]["name"] = json!("api");
    assert!(admit(&named, &other).matched.is_empty());
    // A Deployment without a template has nothing to mutate.
    let bare = json!({"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": "web", "namespace": "shop"}, "spec": {}});
    let out = admit(&named, &bare);
    assert!(out.applied.is_empty());
    assert_eq!(out.object, bare);
}

#[test]
fn a_rule_that_writes_what_a_template_lacks_fails_named_and_changes_nothing() {
    let idx = index(vec![cmr(
        "status",
        json!({"match": {"kinds": ["Pod"]}, "autogen": {},
               "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}, "status": {"phase": "x"}}}]}),
    )]);
    let (_, deployment, _) = controllers().remove(0);
    let out = admit(&idx, &deployment);
    assert_eq!(out.skipped.len(), 1);
    assert_eq!(out.object, deployment);
    assert!(
        out.warnings[0]
            .contains("spec.template: the rule writes status, which a Pod template does not have"),
        "{:?}",
        out.warnings
    );
}

#[test]
fn audit_mode_reports_the_template_change_and_keeps_none_of_it() {
    let mut spec = pod_rule(Some(json!({})));
    spec["mode"] = json!("Audit");
    let idx = index(vec![cmr("mirror", spec)]);
    let (_, deployment, _) = controllers().remove(0);
    let out = admit(&idx, &deployment);
    assert_eq!(out.object, deployment);
    assert_eq!(out.audited.len(), 1);
    let summary = out.audited[0].summary();
    assert!(
        summary.contains("/spec/template/spec/containers/0/image"),
        "{summary}"
    );
}

#[test]
fn autogen_is_refused_on_rules_that_are_not_pod_rules_or_hold_a_gate() {
    let refused = |spec: Value| {
        let (compiled, errors) = compile_all(&[cmr("r", spec)]);
        assert!(compiled.is_empty());
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let errors = refused(
        json!({"match": {"kinds": ["Pod", "ConfigMap"]}, "autogen": {},
        "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}]}),
    );
    assert!(
        errors.contains("spec.autogen: autogen applies a Pod rule to Pod templates: match.kinds must be only Pod"),
        "{errors}"
    );
    let errors = refused(json!({"match": {"kinds": ["Pod"]}, "autogen": {},
        "gate": {"waitFor": [{"service": {"name": "db", "namespace": "shop"}}]}}));
    assert!(
        errors.contains("spec.autogen: a gate holds each Pod when it is created"),
        "{errors}"
    );
    let unknown = parse_rule(
        &json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule",
                "metadata": {"name": "r"}, "spec": {"match": {"kinds": ["Pod"]},
                "autogen": {"controllers": ["Rollout"]},
                "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}]}}),
        "default",
    );
    let message = unknown.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(message.contains("Rollout"), "{message}");
}

#[test]
fn explain_shows_the_template_change_and_agrees_with_apply() {
    let idx = index(vec![cmr("mirror", pod_rule(Some(json!({}))))]);
    for (kind, object, at) in controllers() {
        let gvk = Gvk::from_api_version(
            object["apiVersion"].as_str().unwrap(),
            object["kind"].as_str().unwrap(),
        );
        let subject = Subject {
            gvk: &gvk,
            operation: Operation::Create,
            namespace: Some("shop"),
            name: Some("web"),
            namespace_labels: None,
            ran_before: RanBefore::Unknown,
            lookups: None,
        };
        let (steps, explained) = idx.explain(
            &subject,
            object.clone(),
            &initium::engine::Limits::default(),
        );
        let applied = admit(&idx, &object).object;
        if kind == "ReplicaSet" {
            assert!(
                matches!(&steps[0].what, initium::engine::StepResult::NotMatched(f) if f == "spec.match.kinds"),
                "{kind}: {:?}",
                steps[0].what
            );
            assert_eq!(explained, object);
            continue;
        }
        let initium::engine::StepResult::Changed(ops) = &steps[0].what else {
            panic!("{kind}: {:?}", steps[0].what);
        };
        let image = format!("{at}/spec/containers/0/image");
        assert!(
            ops.iter()
                .any(|op| serde_json::to_value(op).unwrap()["path"] == image.as_str()),
            "{kind}: {ops:?}"
        );
        // explain records provenance after all rules as apply does; compare templates.
        assert_eq!(explained.pointer(at), applied.pointer(at), "{kind}");
    }
}

fn admit_op(
    index: &RuleIndex,
    object: &Value,
    operation: Operation,
    ran_before: RanBefore,
) -> Outcome {
    let gvk = Gvk::from_api_version(
        object["apiVersion"].as_str().unwrap(),
        object["kind"].as_str().unwrap(),
    );
    let subject = Subject {
        gvk: &gvk,
        operation,
        namespace: Some("shop"),
        name: object.pointer("/metadata/name").and_then(Value::as_str),
        namespace_labels: None,
        ran_before,
        lookups: None,
    };
    index
        .evaluate(&subject, object.clone(), None)
        .unwrap_or_else(|d| panic!("denied: {d}"))
}

#[test]
fn a_template_copied_from_one_the_rule_changed_is_not_changed_again() {
    let idx = index(vec![cmr("mirror", pod_rule(Some(json!({}))))]);
    let (_, cronjob, at) = controllers().pop().unwrap();
    let admitted = admit(&idx, &cronjob).object;
    let template = admitted.pointer(at).unwrap().clone();
    // `kubectl create job --from=cronjob/web` (and the CronJob controller) copy the job
    // template into a new Job.
    let job = json!({"apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "web-manual", "namespace": "shop",
                     "annotations": {"cronjob.kubernetes.io/instantiate": "manual"}},
        "spec": {"template": template}});
    let out = admit_op(
        &idx,
        &job,
        Operation::Create,
        RanBefore::Listed {
            stored: None,
            stored_template: None,
        },
    );
    assert!(out.applied.is_empty());
    assert_eq!(out.object, job);
    // Offline (`initium apply`), every matching rule runs, as for any object.
    let offline = admit(&idx, &job);
    assert_eq!(offline.applied.len(), 1);
}

#[test]
fn at_update_the_rule_runs_again_only_on_a_changed_template() {
    let idx = index(vec![cmr("mirror", pod_rule(Some(json!({}))))]);
    let (_, deployment, _) = controllers().remove(0);
    let created = admit(&idx, &deployment).object;
    let stored = created.clone();
    let listed = |stored: &Value| -> Option<String> {
        stored["metadata"]["annotations"]["initium.dev/mutated-by"]
            .as_str()
            .map(str::to_string)
    };
    let stored_list = listed(&stored);
    // The Deployment controller writes the Deployment (its revision annotation): the template
    // is the stored one, and the rule leaves it alone, so a rule that appends cannot start
    // a rollout loop.
    let mut revision = created.clone();
    revision["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = json!("1");
    let out = admit_op(
        &idx,
        &revision,
        Operation::Update,
        RanBefore::Listed {
            stored: stored_list.as_deref(),
            stored_template: stored.pointer("/spec/template"),
        },
    );
    assert!(out.applied.is_empty());
    assert_eq!(out.object, revision);
    // Git bumps the image: the template's provenance is kept by the merge, but its content
    // changed, and the rule runs on it again (else the Pods it makes would list the rule
    // and escape it).
    let mut bumped = created.clone();
    bumped["spec"]["template"]["spec"]["containers"][0]["image"] =
        json!("docker.io/library/nginx:1.27");
    let out = admit_op(
        &idx,
        &bumped,
        Operation::Update,
        RanBefore::Listed {
            stored: stored_list.as_deref(),
            stored_template: stored.pointer("/spec/template"),
        },
    );
    assert_eq!(out.applied.len(), 1);
    assert_eq!(
        out.object["spec"]["template"]["spec"]["containers"][0]["image"],
        "mirror.local/library/nginx:1.27"
    );
    // A rule that appends appends again on a changed template: autogen rules should be
    // idempotent (`initium test` reports those that are not).
    assert_eq!(
        out.object["spec"]["template"]["spec"]["tolerations"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
}

#[test]
fn autogen_needs_a_rule_for_pod_creation() {
    let mut spec = pod_rule(Some(json!({})));
    spec["match"]["operations"] = json!(["UPDATE"]);
    let (compiled, errors) = compile_all(&[cmr("r", spec)]);
    assert!(compiled.is_empty());
    let text = errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        text.contains("spec.autogen: a Pod template describes Pods to be created: match.operations must include CREATE"),
        "{text}"
    );
}

/// Found by the fuzz campaign (seed 1795931107888468499): a template with `metadata: null`,
/// on which the rule changes nothing, came back without its metadata, and the patch did not
/// say so. It now comes back exactly as it was.
#[test]
fn a_template_the_rule_leaves_alone_comes_back_exactly_as_it_was() {
    let idx = index(vec![cmr(
        "nothing",
        json!({"match": {"kinds": ["Pod"]}, "autogen": {},
               "mutations": [{"forEach": "$.spec.none[*]", "mutations": [{"defaults": {"a": "b"}}]}]}),
    )]);
    for template in [
        json!({"metadata": null}),
        json!({"metadata": null, "spec": {}}),
        json!({"spec": {"containers": []}}),
    ] {
        let job = json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "j", "namespace": "shop"}, "spec": {"template": template}});
        let out = admit(&idx, &job);
        assert_eq!(out.object, job);
        assert!(out.ops.is_empty(), "{:?}", out.ops);
    }
}
