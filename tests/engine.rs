//! Behaviour of the pure engine: matching, order, atomicity, failure policies, the budget,
//! provenance and determinism.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use initium::api::Operation;
use initium::engine::{
    Gvk, Outcome, RanBefore, RuleIndex, RuleSource, Subject, compile_all, parse_rule,
};
use serde_json::{Value, json};

fn rule(doc: Value) -> RuleSource {
    parse_rule(&doc, "default").unwrap_or_else(|e| panic!("{e}"))
}

fn cmr(name: &str, spec: Value) -> RuleSource {
    rule(
        json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule", "metadata": {"name": name}, "spec": spec}),
    )
}

fn mr(ns: &str, name: &str, spec: Value) -> RuleSource {
    rule(
        json!({"apiVersion": "initium.dev/v1alpha1", "kind": "MutationRule", "metadata": {"name": name, "namespace": ns}, "spec": spec}),
    )
}

fn index(rules: Vec<RuleSource>) -> RuleIndex {
    let (compiled, errors) = compile_all(&rules);
    assert!(errors.is_empty(), "{errors:?}");
    RuleIndex::new(compiled)
}

fn pod(ns: &str, name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
           "spec": {"containers": [{"name": "app", "image": "nginx"}, {"name": "side", "image": "busybox"}]}})
}

const POD: (&str, &str, &str) = ("", "v1", "Pod");

fn admit(index: &RuleIndex, object: &Value, ns: Option<&str>) -> Outcome {
    try_admit(index, object, ns, Operation::Create, None).unwrap_or_else(|d| panic!("denied: {d}"))
}

fn try_admit(
    index: &RuleIndex,
    object: &Value,
    ns: Option<&str>,
    op: Operation,
    deadline: Option<Instant>,
) -> Result<Outcome, initium::engine::Denial> {
    let gvk = Gvk::from_api_version(
        object["apiVersion"].as_str().unwrap_or("v1"),
        object["kind"].as_str().unwrap_or("Pod"),
    );
    let subject = Subject {
        gvk: &gvk,
        operation: op,
        namespace: ns,
        name: object.pointer("/metadata/name").and_then(Value::as_str),
        namespace_labels: None,
        ran_before: RanBefore::Unknown,
        lookups: None,
    };
    index.evaluate(&subject, object.clone(), deadline)
}

/// The outcome's RFC 6902 patch turns `original` into the outcome's object.
fn assert_patch_reproduces(original: &Value, out: &Outcome) {
    let mut patched = original.clone();
    json_patch::patch(&mut patched, &out.patch()).unwrap();
    assert_eq!(&patched, &out.object);
}

fn label(name: &str, value: &str) -> Value {
    json!({"merge": {"metadata": {"labels": {name: value}}}})
}

fn annotations(o: &Outcome) -> &Value {
    &o.object["metadata"]["annotations"]
}

#[test]
fn rules_run_in_the_total_order_and_provenance_lists_them() {
    // Each rule appends its name to a label, so the final value shows the order.
    let append = |who: &str| json!({"patch": [{"op": "add", "path": format!("/metadata/labels/{who}"), "value": "x"}]});
    let idx = index(vec![
        mr(
            "shop",
            "b-ns",
            json!({"priority": 10, "match": {"kinds": ["Pod"]}, "mutations": [append("b-ns")]}),
        ),
        cmr(
            "z-late",
            json!({"priority": 200, "match": {"kinds": ["Pod"]}, "mutations": [append("z-late")]}),
        ),
        mr(
            "alpha",
            "a-other-ns",
            json!({"priority": 10, "match": {"kinds": ["Pod"]}, "mutations": [append("a")]}),
        ),
        cmr(
            "c-cluster",
            json!({"priority": 10, "match": {"kinds": ["Pod"]}, "mutations": [append("c-cluster")]}),
        ),
        mr(
            "shop",
            "a-ns",
            json!({"priority": 10, "match": {"kinds": ["Pod"]}, "mutations": [append("a-ns")]}),
        ),
        cmr(
            "first",
            json!({"priority": -5, "match": {"kinds": ["*"]}, "mutations": [append("first")]}),
        ),
    ]);
    let out = admit(&idx, &pod("shop", "web"), Some("shop"));
    let applied: Vec<String> = out.applied.iter().map(ToString::to_string).collect();
    assert_eq!(
        applied,
        ["first", "c-cluster", "shop/a-ns", "shop/b-ns", "z-late"]
    );
    assert_eq!(
        annotations(&out)["initium.dev/mutated-by"],
        "first,c-cluster,shop/a-ns,shop/b-ns,z-late"
    );
}

#[test]
fn a_rule_that_fails_halfway_leaves_no_change_and_ignore_warns() {
    let idx = index(vec![
        cmr(
            "half",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [
                label("half", "yes"),
                {"patch": [{"op": "test", "path": "/metadata/name", "value": "someone-else"}]}
            ]}),
        ),
        cmr(
            "after",
            json!({"priority": 101, "match": {"kinds": ["Pod"]}, "mutations": [label("after", "yes")]}),
        ),
    ]);
    let out = admit(&idx, &pod("shop", "web"), Some("shop"));
    assert_eq!(
        out.object["metadata"]["labels"],
        json!({"after": "yes"}),
        "no partial change from `half`"
    );
    assert_eq!(out.skipped.len(), 1);
    assert_eq!(out.warnings.len(), 1);
    let w = &out.warnings[0];
    assert!(
        w.starts_with(
            "ClusterMutationRule half skipped: spec.mutations[1]: patch[0] test /metadata/name"
        ),
        "{w}"
    );
    assert_eq!(annotations(&out)["initium.dev/mutated-by"], "after");
}

#[test]
fn a_failing_fail_rule_denies_with_the_rule_and_field() {
    let idx = index(vec![cmr(
        "strict",
        json!({"failurePolicy": "Fail", "match": {"kinds": ["Pod"]}, "mutations": [
            {"rewrite": {"path": "/spec", "regex": "x", "replacement": "y"}}
        ]}),
    )]);
    let denial = try_admit(
        &idx,
        &pod("shop", "web"),
        Some("shop"),
        Operation::Create,
        None,
    )
    .unwrap_err();
    assert_eq!(denial.rule.to_string(), "strict");
    assert_eq!(
        denial.message,
        "ClusterMutationRule strict (failurePolicy Fail) failed: spec.mutations[0]: rewrite /spec: the field is an object, not a string"
    );
}

#[test]
fn an_overrun_budget_skips_ignore_rules_and_denies_for_fail_rules() {
    let ignore = cmr(
        "soft",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [label("soft", "1")]}),
    );
    let fail = cmr(
        "hard",
        json!({"priority": 200, "failurePolicy": "Fail", "match": {"kinds": ["Pod"]}, "mutations": [label("hard", "1")]}),
    );
    let expired = Some(Instant::now() - Duration::from_millis(1));
    let out = try_admit(
        &index(vec![ignore.clone()]),
        &pod("a", "b"),
        Some("a"),
        Operation::Create,
        expired,
    )
    .unwrap();
    assert!(out.budget_exceeded);
    assert!(out.applied.is_empty());
    assert_eq!(
        out.warnings,
        ["ClusterMutationRule soft skipped: the latency budget ran out before it could run"]
    );
    assert!(out.ops.is_empty());
    let denial = try_admit(
        &index(vec![ignore.clone(), fail]),
        &pod("a", "b"),
        Some("a"),
        Operation::Create,
        expired,
    )
    .unwrap_err();
    assert!(denial.budget_exceeded);
    assert_eq!(
        denial.message,
        "ClusterMutationRule hard (failurePolicy Fail) could not run: the latency budget ran out"
    );
    // A generous budget changes nothing about the result.
    let later = Some(Instant::now() + Duration::from_secs(60));
    let out = try_admit(
        &index(vec![ignore]),
        &pod("a", "b"),
        Some("a"),
        Operation::Create,
        later,
    )
    .unwrap();
    assert!(!out.budget_exceeded);
    assert_eq!(out.object["metadata"]["labels"]["soft"], "1");
}

#[test]
fn namespace_and_name_come_from_the_request_when_the_object_lacks_them() {
    let idx = index(vec![mr(
        "payments",
        "ca",
        json!({"match": {"kinds": ["Pod"], "names": ["worker-*"]}, "mutations": [
            {"merge": {"metadata": {"annotations": {"ns": "{{ $.metadata.namespace }}"}}}}
        ]}),
    )]);
    let object = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "worker-"}, "spec": {"containers": []}});
    let gvk = Gvk::new("", "v1", "Pod");
    let subject = Subject {
        gvk: &gvk,
        operation: Operation::Create,
        namespace: Some("payments"),
        name: None,
        namespace_labels: None,
        ran_before: RanBefore::Unknown,
        lookups: None,
    };
    let out = idx.evaluate(&subject, object.clone(), None).unwrap();
    assert_eq!(annotations(&out)["ns"], "payments");
    assert!(
        out.object["metadata"].get("namespace").is_none(),
        "the filled-in namespace is not written back"
    );
    let paths: Vec<&str> = out.ops.iter().map(|op| op.path()).collect();
    assert_eq!(paths, ["/metadata/annotations"]);
}

#[test]
fn namespace_selectors_use_namespace_labels_and_skip_other_cluster_scoped_objects() {
    let idx = index(vec![cmr(
        "prod",
        json!({"match": {"kinds": ["*"], "namespaceSelector": {"matchLabels": {"env": "prod"}}}, "mutations": [label("prod", "yes")]}),
    )]);
    let prod: BTreeMap<String, String> = [("env".to_string(), "prod".to_string())].into();
    let gvk = Gvk::new("", "v1", "Pod");
    let run =
        |ns: Option<&str>, labels: Option<&BTreeMap<String, String>>, gvk: &Gvk, object: &Value| {
            let subject = Subject {
                gvk,
                operation: Operation::Create,
                namespace: ns,
                name: None,
                namespace_labels: labels,
                ran_before: RanBefore::Unknown,
                lookups: None,
            };
            !idx.evaluate(&subject, object.clone(), None)
                .unwrap()
                .applied
                .is_empty()
        };
    assert!(run(Some("shop"), Some(&prod), &gvk, &pod("shop", "a")));
    // Unknown labels are not guessed: the rule fails and its failurePolicy (Ignore) decides.
    let subject = Subject {
        gvk: &gvk,
        operation: Operation::Create,
        namespace: Some("shop"),
        name: None,
        namespace_labels: None,
        ran_before: RanBefore::Unknown,
        lookups: None,
    };
    let out = idx.evaluate(&subject, pod("shop", "a"), None).unwrap();
    assert!(out.applied.is_empty());
    assert_eq!(
        out.warnings,
        [
            "ClusterMutationRule prod skipped: the labels of namespace shop are not known yet (needed by namespaceSelector)"
        ]
    );
    let empty = BTreeMap::new();
    assert!(
        !run(Some("shop"), Some(&empty), &gvk, &pod("shop", "a")),
        "known and without the label"
    );
    let ns_gvk = Gvk::new("", "v1", "Namespace");
    let ns_obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop", "labels": {"env": "prod"}}});
    assert!(
        run(None, None, &ns_gvk, &ns_obj),
        "a Namespace is matched by its own labels"
    );
    let cr_gvk = Gvk::new("rbac.authorization.k8s.io", "v1", "ClusterRole");
    let cr = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "x"}});
    assert!(
        !run(None, Some(&prod), &cr_gvk, &cr),
        "other cluster-scoped objects never match a namespace-restricted rule"
    );
}

#[test]
fn a_mutation_rule_only_touches_its_own_namespace() {
    let idx = index(vec![mr(
        "payments",
        "local",
        json!({"match": {"kinds": ["*"]}, "mutations": [label("local", "yes")]}),
    )]);
    assert_eq!(
        admit(&idx, &pod("payments", "a"), Some("payments"))
            .applied
            .len(),
        1
    );
    assert!(
        admit(&idx, &pod("shop", "a"), Some("shop"))
            .applied
            .is_empty()
    );
    let ns_obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "payments"}});
    assert!(
        admit(&idx, &ns_obj, None).applied.is_empty(),
        "not even its own Namespace object"
    );
}

#[test]
fn match_fields_and_exclude() {
    let idx = index(vec![cmr(
        "sel",
        json!({
            "match": {
                "kinds": ["v1/Pod"],
                "operations": ["CREATE", "UPDATE"],
                "names": ["web-*", "api"],
                "namespaces": ["team-*"],
                "labels": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["front", "back"]}]},
                "annotations": {"inject": "*", "mode": "full*"}
            },
            "exclude": {"labels": {"matchLabels": {"skip": "true"}}},
            "mutations": [label("hit", "yes")]
        }),
    )]);
    let base = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "web-1", "namespace": "team-a", "labels": {"tier": "front"}, "annotations": {"inject": "", "mode": "fully"}}});
    let hit = |edit: &dyn Fn(&mut Value), ns: &str, op: Operation| {
        let mut o = base.clone();
        edit(&mut o);
        !try_admit(&idx, &o, Some(ns), op, None)
            .unwrap()
            .applied
            .is_empty()
    };
    assert!(hit(&|_| {}, "team-a", Operation::Create));
    assert!(hit(&|_| {}, "team-a", Operation::Update));
    assert!(!hit(&|_| {}, "other", Operation::Create), "namespace glob");
    assert!(
        !hit(
            &|o| o["metadata"]["name"] = json!("db-1"),
            "team-a",
            Operation::Create
        ),
        "name glob"
    );
    assert!(hit(
        &|o| o["metadata"]["name"] = json!("api"),
        "team-a",
        Operation::Create
    ));
    assert!(
        !hit(
            &|o| o["metadata"]["labels"]["tier"] = json!("db"),
            "team-a",
            Operation::Create
        ),
        "matchExpressions"
    );
    assert!(
        !hit(
            &|o| o["metadata"]["annotations"] = json!({"mode": "full"}),
            "team-a",
            Operation::Create
        ),
        "annotation presence"
    );
    assert!(
        !hit(
            &|o| o["metadata"]["annotations"]["mode"] = json!("partial"),
            "team-a",
            Operation::Create
        ),
        "annotation glob"
    );
    assert!(
        !hit(
            &|o| o["metadata"]["labels"]["skip"] = json!("true"),
            "team-a",
            Operation::Create
        ),
        "exclude"
    );
    assert!(
        !hit(
            &|o| o["apiVersion"] = json!("v2"),
            "team-a",
            Operation::Create
        ),
        "kind version"
    );
}

#[test]
fn operations_default_to_create() {
    let idx = index(vec![cmr(
        "c",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [label("c", "1")]}),
    )]);
    assert!(
        try_admit(&idx, &pod("a", "b"), Some("a"), Operation::Update, None)
            .unwrap()
            .applied
            .is_empty()
    );
    assert_eq!(
        try_admit(&idx, &pod("a", "b"), Some("a"), Operation::Create, None)
            .unwrap()
            .applied
            .len(),
        1
    );
}

#[test]
fn conditions_matches_equals_exists() {
    let run = |cond: Value| {
        let idx = index(vec![cmr(
            "c",
            json!({"match": {"kinds": ["Pod"]}, "conditions": [cond], "mutations": [label("c", "1")]}),
        )]);
        !admit(&idx, &pod("a", "b"), Some("a")).applied.is_empty()
    };
    assert!(
        run(json!({"path": "$.spec.containers[*].image", "matches": "^busy"})),
        "any selected value"
    );
    assert!(!run(
        json!({"path": "$.spec.containers[*].image", "matches": "^redis"})
    ));
    assert!(run(
        json!({"path": "$.spec.containers[0].name", "equals": "app"})
    ));
    assert!(run(
        json!({"path": "$.spec.containers", "equals": [{"name": "app", "image": "nginx"}, {"name": "side", "image": "busybox"}]})
    ));
    assert!(!run(
        json!({"path": "$.spec.containers[0].name", "equals": "side"})
    ));
    assert!(run(
        json!({"path": "$.spec.containers[?@.name == 'side']", "exists": true})
    ));
    assert!(run(json!({"path": "$.spec.hostNetwork", "exists": false})));
    assert!(!run(json!({"path": "$.metadata.name", "exists": false})));
    assert!(run(
        json!({"path": "$.spec.containers[*].name", "notEquals": "istio-proxy"})
    ));
    assert!(!run(
        json!({"path": "$.spec.containers[*].name", "notEquals": "side"})
    ));
    assert!(
        run(json!({"path": "$.spec.nothing", "notEquals": 1})),
        "nothing selected is never equal"
    );
}

#[test]
fn numbers_and_quantities_compare_by_value() {
    let idx = |cond: Value| {
        index(vec![cmr(
            "c",
            json!({"match": {"kinds": ["Deployment"]}, "conditions": [cond], "mutations": [label("c", "1")]}),
        )])
    };
    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "a"},
        "spec": {"replicas": 3, "template": {"spec": {"terminationGracePeriodSeconds": 60.0,
            "containers": [{"name": "app", "resources": {"limits": {"memory": "1Gi", "cpu": "250m"}}}]}}}});
    let holds = |cond: Value| !admit(&idx(cond), &deployment, Some("a")).applied.is_empty();
    assert!(holds(json!({"path": "$.spec.replicas", "greaterThan": 2})));
    assert!(!holds(json!({"path": "$.spec.replicas", "greaterThan": 3})));
    assert!(holds(json!({"path": "$.spec.replicas", "lessThan": "3.5"})));
    assert!(holds(
        json!({"path": "$.spec.template.spec.terminationGracePeriodSeconds", "equals": 60})
    ));
    assert!(holds(
        json!({"path": "$.spec.template.spec.containers[*].resources.limits.memory", "greaterThan": "512Mi"})
    ));
    assert!(!holds(
        json!({"path": "$.spec.template.spec.containers[*].resources.limits.cpu", "greaterThan": "0.5"})
    ));
    assert!(holds(
        json!({"path": "$.spec.template.spec.containers[*].resources.limits.cpu", "lessThan": 1})
    ));
    let (_, errors) = compile_all(&[cmr(
        "bad",
        json!({"match": {"kinds": ["Pod"]}, "conditions": [{"path": "$.a", "greaterThan": "lots"}],
               "mutations": [label("c", "1")]}),
    )]);
    assert!(
        errors[0].to_string().contains(
            "spec.conditions[0].greaterThan: \"lots\" is not a number or a Kubernetes quantity"
        ),
        "{}",
        errors[0]
    );
}

#[test]
fn mutations_patch_upsert_foreach_rewrite_and_templates() {
    let idx = index(vec![cmr(
        "all",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"patch": [
                {"op": "add", "path": "/metadata/annotations/team", "value": "{{ $.metadata.namespace }}"},
                {"op": "add", "path": "/spec/tolerations", "value": [{"key": "k", "operator": "Exists"}]},
                {"op": "copy", "from": "/metadata/name", "path": "/metadata/labels/app"},
                {"op": "remove", "path": "/spec/containers/1"}
            ]},
            {"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "v", "emptyDir": {}}}},
            {"forEach": "$.spec.containers[*]", "mutations": [
                {"upsert": {"path": "/env", "key": "name", "value": {"name": "CONTAINER", "value": "{{ @.name }}"}}},
                {"rewrite": {"path": "/image", "regex": "^nginx$", "replacement": "mirror/nginx"}},
                {"merge": {"securityContext": {"runAsNonRoot": true}}}
            ]}
        ]}),
    )]);
    let out = admit(&idx, &pod("shop", "web"), Some("shop"));
    assert_eq!(out.object["metadata"]["annotations"]["team"], "shop");
    assert_eq!(out.object["metadata"]["labels"]["app"], "web");
    assert_eq!(
        out.object["spec"]["tolerations"],
        json!([{"key": "k", "operator": "Exists"}])
    );
    assert_eq!(
        out.object["spec"]["volumes"],
        json!([{"name": "v", "emptyDir": {}}])
    );
    assert_eq!(
        out.object["spec"]["containers"],
        json!([{"name": "app", "image": "mirror/nginx", "env": [{"name": "CONTAINER", "value": "app"}], "securityContext": {"runAsNonRoot": true}}])
    );
    // The patch turns the original into the result.
    assert_patch_reproduces(&pod("shop", "web"), &out);
}

#[test]
fn an_add_into_an_object_is_the_rfc_6902_add() {
    // The engine sets an object's member itself (it does not hand the add to json_patch):
    // the result must be json_patch's, on new and existing members, escaped keys, a value of
    // another type, and inside a forEach element.
    let ops = json!([
        {"op": "add", "path": "/metadata/labels/team", "value": "a"},
        {"op": "add", "path": "/metadata/labels/team", "value": "b"},
        {"op": "add", "path": "/spec/priority", "value": 6},
        {"op": "add", "path": "/spec/priority", "value": {"now": ["an", "object"]}},
        {"op": "add", "path": "/metadata/annotations/example.com~1a~0b", "value": "c"},
        {"op": "add", "path": "/spec/priority", "value": 7}
    ]);
    let idx = index(vec![cmr(
        "adds",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"patch": ops},
            {"forEach": "$.spec.containers[*]", "mutations": [{"patch": [
                {"op": "add", "path": "/securityContext/runAsNonRoot", "value": true},
                {"op": "add", "path": "/image", "value": "mirror/{{ @.image }}"}
            ]}]}
        ]}),
    )]);
    let original = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web", "namespace": "shop", "labels": {}, "annotations": {}},
        "spec": {"containers": [{"name": "app", "image": "nginx", "securityContext": {}},
                                {"name": "side", "image": "busybox", "securityContext": {}}]}});
    let out = admit(&idx, &original, Some("shop"));

    // The same operations by json_patch, where every parent exists.
    let mut expected = original.clone();
    let mut all: Vec<Value> = ops.as_array().cloned().unwrap();
    for (i, image) in ["nginx", "busybox"].iter().enumerate() {
        all.push(json!({"op": "add", "path": format!("/spec/containers/{i}/securityContext/runAsNonRoot"), "value": true}));
        all.push(json!({"op": "add", "path": format!("/spec/containers/{i}/image"), "value": format!("mirror/{image}")}));
    }
    let patch: json_patch::Patch = serde_json::from_value(Value::Array(all)).unwrap();
    json_patch::patch(&mut expected, &patch).unwrap();
    let mut object = out.object.clone();
    let provenance = object["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove("initium.dev/mutated-by");
    assert!(provenance.is_some(), "{:#}", out.object);
    assert_eq!(object, expected);
    assert_patch_reproduces(&original, &out);

    // Where the parent is not an object or a list, the add fails as json_patch's does.
    let idx = index(vec![cmr(
        "into-a-string",
        json!({"match": {"kinds": ["Pod"]}, "failurePolicy": "Fail", "mutations": [{"patch": [
            {"op": "add", "path": "/metadata/name/x", "value": 1}
        ]}]}),
    )]);
    let denial = try_admit(&idx, &original, Some("shop"), Operation::Create, None)
        .expect_err("an add under a string is refused");
    assert!(
        denial.message.contains("patch[0] add /metadata/name/x"),
        "{}",
        denial.message
    );
}

#[test]
fn an_add_into_a_missing_list_creates_the_list() {
    // `-` or an index after a missing parent makes the parent a list (it used to become an
    // object `{"-": ...}`, which the API server rejects).
    let idx = index(vec![cmr(
        "lists",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"patch": [
            {"op": "add", "path": "/spec/tolerations/-", "value": {"key": "k", "operator": "Exists"}},
            {"op": "add", "path": "/spec/initContainers/0", "value": {"name": "init", "image": "busybox"}},
            {"op": "add", "path": "/spec/initContainers/-", "value": {"name": "second", "image": "busybox"}},
            {"op": "add", "path": "/metadata/labels/team", "value": "a"}
        ]}]}),
    )]);
    let out = admit(&idx, &pod("shop", "web"), Some("shop"));
    assert_eq!(
        out.object["spec"]["tolerations"],
        json!([{"key": "k", "operator": "Exists"}])
    );
    assert_eq!(
        out.object["spec"]["initContainers"],
        json!([{"name": "init", "image": "busybox"}, {"name": "second", "image": "busybox"}])
    );
    assert_eq!(out.object["metadata"]["labels"], json!({"team": "a"}));
    assert_patch_reproduces(&pod("shop", "web"), &out);

    // An index past the end of a list just created is still an error of the rule.
    let idx = index(vec![cmr(
        "past",
        json!({"match": {"kinds": ["Pod"]}, "failurePolicy": "Fail", "mutations": [{"patch": [
            {"op": "add", "path": "/spec/tolerations/1", "value": {"key": "k"}}
        ]}]}),
    )]);
    let denial = try_admit(
        &idx,
        &pod("shop", "web"),
        Some("shop"),
        Operation::Create,
        None,
    )
    .expect_err("index 1 of a new list");
    assert!(denial.to_string().contains("spec.mutations[0]"), "{denial}");
}

#[test]
fn defaults_fill_only_what_is_missing_in_one_mutation() {
    // Kyverno's default security context: four rules with `exists: false` before, one now.
    let idx = index(vec![cmr(
        "secure",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"defaults": {"spec": {"securityContext": {"runAsNonRoot": true, "runAsUser": 1000,
                                                       "seccompProfile": {"type": "RuntimeDefault"}}}}},
            {"forEach": "$.spec.containers[*]", "mutations": [
                {"defaults": {"imagePullPolicy": "IfNotPresent",
                              "securityContext": {"allowPrivilegeEscalation": false}}}
            ]}
        ]}),
    )]);
    let mut object = pod("a", "b");
    object["spec"]["securityContext"] = json!({"runAsUser": 0});
    object["spec"]["containers"][1]["imagePullPolicy"] = json!("Always");
    let out = admit(&idx, &object, Some("a"));
    assert_eq!(
        out.object["spec"]["securityContext"],
        json!({"runAsUser": 0, "runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}}),
        "what the Pod set stays"
    );
    assert_eq!(
        out.object["spec"]["containers"][0]["imagePullPolicy"],
        "IfNotPresent"
    );
    assert_eq!(
        out.object["spec"]["containers"][1]["imagePullPolicy"],
        "Always"
    );
    assert_eq!(
        out.object["spec"]["containers"][1]["securityContext"],
        json!({"allowPrivilegeEscalation": false})
    );
    assert_patch_reproduces(&object, &out);
    let again = admit(&idx, &out.object, Some("a"));
    assert!(
        again.applied.is_empty(),
        "defaults applied twice change nothing"
    );
}

#[test]
fn remove_takes_hostpath_volumes_and_their_mounts_in_one_rule() {
    let idx = index(vec![cmr(
        "no-hostpath",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"forEach": "$.spec['containers','initContainers'][*]", "mutations": [
                {"remove": {"path": "/volumeMounts",
                            "where": [{"path": "@.name", "in": "$.spec.volumes[?@.hostPath].name"}]}}
            ]},
            {"remove": {"path": "/spec/volumes", "where": [{"path": "@.hostPath", "exists": true}]}}
        ]}),
    )]);
    let mut object = pod("a", "b");
    object["spec"]["volumes"] = json!([
        {"name": "host", "hostPath": {"path": "/var/run"}},
        {"name": "data", "emptyDir": {}},
        {"name": "docker", "hostPath": {"path": "/var/lib/docker"}}
    ]);
    object["spec"]["containers"][0]["volumeMounts"] = json!([
        {"name": "host", "mountPath": "/h"}, {"name": "data", "mountPath": "/d"}, {"name": "docker", "mountPath": "/x"}
    ]);
    object["spec"]["initContainers"] = json!([{"name": "i", "image": "busybox",
        "volumeMounts": [{"name": "docker", "mountPath": "/x"}]}]);
    let out = admit(&idx, &object, Some("a"));
    assert_eq!(
        out.object["spec"]["volumes"],
        json!([{"name": "data", "emptyDir": {}}])
    );
    assert_eq!(
        out.object["spec"]["containers"][0]["volumeMounts"],
        json!([{"name": "data", "mountPath": "/d"}])
    );
    assert_eq!(
        out.object["spec"]["initContainers"][0]["volumeMounts"],
        json!([])
    );
    assert!(
        out.object["spec"]["containers"][1]
            .get("volumeMounts")
            .is_none(),
        "a missing list stays missing"
    );
    assert_patch_reproduces(&object, &out);
    assert!(admit(&idx, &out.object, Some("a")).applied.is_empty());

    // A where that is not a list is an error naming the mutation.
    let idx = index(vec![cmr(
        "not-a-list",
        json!({"match": {"kinds": ["Pod"]}, "failurePolicy": "Fail", "mutations": [
            {"remove": {"path": "/spec/containers/0/name", "where": [{"path": "@.x", "exists": true}]}}
        ]}),
    )]);
    let denial = try_admit(&idx, &pod("a", "b"), Some("a"), Operation::Create, None)
        .expect_err("a string is not a list");
    assert!(
        denial
            .to_string()
            .contains("remove /spec/containers/0/name: the field is a string, not a list"),
        "{denial}"
    );
}

#[test]
fn upsert_prepends_new_elements_and_leaves_replaced_ones_in_place() {
    let idx = index(vec![cmr(
        "first",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"upsert": {"path": "/spec/containers", "key": "name", "position": "Prepend",
                        "value": {"name": "proxy", "image": "envoy"}}},
            {"upsert": {"path": "/spec/containers", "key": "name", "position": "Prepend",
                        "value": {"name": "side", "image": "busybox:2"}}}
        ]}),
    )]);
    let out = admit(&idx, &pod("a", "b"), Some("a"));
    let names: Vec<&str> = out.object["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["proxy", "app", "side"]);
    assert_eq!(out.object["spec"]["containers"][2]["image"], "busybox:2");
    assert_patch_reproduces(&pod("a", "b"), &out);
    assert!(admit(&idx, &out.object, Some("a")).applied.is_empty());
}

#[test]
fn a_rule_runs_at_most_once_per_admission_request() {
    // Two webhook calls (or a reinvocation) for one request: the second sees the first's
    // output. A non-idempotent patch must not add its toleration twice.
    let idx = index(vec![
        cmr(
            "tolerate",
            json!({"match": {"kinds": ["Pod"], "operations": ["CREATE", "UPDATE"]}, "mutations": [{"patch": [
                {"op": "add", "path": "/spec/tolerations/-", "value": {"key": "k", "operator": "Exists"}}
            ]}]}),
        ),
        cmr(
            "late",
            json!({"match": {"kinds": ["Pod"], "operations": ["CREATE", "UPDATE"]},
                   "conditions": [{"path": "$.metadata.labels.late", "exists": true}],
                   "mutations": [label("seen", "yes")]}),
        ),
    ]);
    let run = |object: &Value, op: Operation, ran_before: RanBefore| {
        let gvk = Gvk::from_api_version("v1", "Pod");
        let subject = Subject {
            gvk: &gvk,
            operation: op,
            namespace: Some("a"),
            name: Some("b"),
            namespace_labels: None,
            lookups: None,
            ran_before,
        };
        idx.evaluate(&subject, object.clone(), None).unwrap()
    };
    let first = run(
        &pod("a", "b"),
        Operation::Create,
        RanBefore::Listed {
            stored: None,
            stored_template: None,
        },
    );
    assert_eq!(first.applied.len(), 1);
    // Another webhook adds a label between the calls: the rule whose condition now holds runs,
    // the one that already ran does not.
    let mut between = first.object.clone();
    between["metadata"]["labels"] = json!({"late": "1"});
    let second = run(
        &between,
        Operation::Create,
        RanBefore::Listed {
            stored: None,
            stored_template: None,
        },
    );
    assert_eq!(
        second.object["spec"]["tolerations"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(second.object["metadata"]["labels"]["seen"], "yes");
    assert_eq!(
        second.object["metadata"]["annotations"]["initium.dev/mutated-by"],
        "tolerate,late"
    );
    // An UPDATE of the stored object: rules it already listed ran at an earlier write, and
    // run again; a rule added to the list during this request does not.
    let stored = "tolerate";
    let update = run(
        &between,
        Operation::Update,
        RanBefore::Listed {
            stored: Some(stored),
            stored_template: None,
        },
    );
    assert_eq!(
        update.object["spec"]["tolerations"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    // Offline (Unknown), every rule runs: what idempotence checks need.
    let offline = run(&second.object, Operation::Create, RanBefore::Unknown);
    assert_eq!(
        offline.object["spec"]["tolerations"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

#[test]
fn a_key_over_several_values_writes_one_entry_per_value() {
    // Kyverno's AppArmor policy: an annotation per container, in one rule.
    let idx = index(vec![cmr(
        "apparmor",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"defaults": {"metadata": {"annotations": {
            "container.apparmor.security.beta.kubernetes.io/{{ $.spec['containers','initContainers'][*].name }}": "runtime/default",
            "none.example.com/{{ $.spec.ephemeralContainers[*].name }}": "x"
        }}}}]}),
    )]);
    let mut object = pod("a", "b");
    object["metadata"]["annotations"] =
        json!({"container.apparmor.security.beta.kubernetes.io/side": "unconfined"});
    let out = admit(&idx, &object, Some("a"));
    assert_eq!(
        out.object["metadata"]["annotations"],
        json!({
            "container.apparmor.security.beta.kubernetes.io/app": "runtime/default",
            "container.apparmor.security.beta.kubernetes.io/side": "unconfined",
            "initium.dev/mutated-by": "apparmor"
        }),
        "one key per container, what the Pod set kept, and no key where nothing was selected"
    );
    assert_patch_reproduces(&object, &out);
}

#[test]
fn upsert_replaces_by_key_and_is_idempotent() {
    let idx = index(vec![cmr(
        "u",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"upsert": {"path": "/spec/containers", "key": "name", "value": {"name": "side", "image": "busybox:1.36"}}}
        ]}),
    )]);
    let out = admit(&idx, &pod("a", "b"), Some("a"));
    assert_eq!(
        out.object["spec"]["containers"][1],
        json!({"name": "side", "image": "busybox:1.36"})
    );
    assert_eq!(
        out.object["spec"]["containers"].as_array().unwrap().len(),
        2
    );
    let again = admit(&idx, &out.object, Some("a"));
    assert!(again.applied.is_empty());
    assert_eq!(again.object, out.object);
    assert!(again.ops.is_empty());
}

#[test]
fn no_change_means_no_annotation_and_an_empty_patch() {
    let idx = index(vec![cmr(
        "noop",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"spec": {"containers": [{"name": "app", "image": "nginx"}, {"name": "side", "image": "busybox"}]}}}]}),
    )]);
    let out = admit(&idx, &pod("a", "b"), Some("a"));
    assert_eq!(out.matched.len(), 1);
    assert!(out.applied.is_empty());
    assert!(out.object["metadata"].get("annotations").is_none());
    assert!(out.ops.is_empty());
}

#[test]
fn output_is_deterministic_whatever_the_rule_order() {
    let rules = vec![
        cmr(
            "a",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [label("x", "a")]}),
        ),
        cmr(
            "b",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [label("x", "b"), {"merge": {"metadata": {"annotations": {"z": "1", "a": "2"}}}}]}),
        ),
        mr(
            "n",
            "c",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [label("y", "c")]}),
        ),
    ];
    let mut reversed = rules.clone();
    reversed.reverse();
    let first =
        serde_json::to_string(&admit(&index(rules), &pod("n", "p"), Some("n")).object).unwrap();
    let second =
        serde_json::to_string(&admit(&index(reversed), &pod("n", "p"), Some("n")).object).unwrap();
    assert_eq!(first, second);
    assert!(
        first.contains(r#""x":"b""#),
        "b runs after a (same priority, name order)"
    );
}

#[test]
fn the_index_only_offers_rules_for_the_kind_and_namespace() {
    let mut rules = vec![
        cmr(
            "pods",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [label("a", "1")]}),
        ),
        cmr(
            "any",
            json!({"match": {"kinds": ["*/*/*"]}, "mutations": [label("a", "1")]}),
        ),
        cmr(
            "team-a-only",
            json!({"match": {"kinds": ["Pod"], "namespaces": ["team-a"]}, "mutations": [label("a", "1")]}),
        ),
        mr(
            "team-a",
            "local",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [label("a", "1")]}),
        ),
    ];
    for i in 0..500 {
        rules.push(cmr(
            &format!("kind-{i}"),
            json!({"match": {"kinds": [format!("Kind{i}")]}, "mutations": [label("a", "1")]}),
        ));
        rules.push(mr(
            &format!("ns-{i}"),
            "r",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [label("a", "1")]}),
        ));
    }
    let idx = index(rules);
    let names = |ns: Option<&str>, namespaced: bool| -> Vec<String> {
        idx.candidates(&Gvk::new(POD.0, POD.1, POD.2), ns, namespaced)
            .iter()
            .map(|r| r.id.to_string())
            .collect()
    };
    assert_eq!(
        names(Some("team-a"), true),
        ["any", "pods", "team-a-only", "team-a/local"]
    );
    assert_eq!(names(Some("team-b"), true), ["any", "pods"]);
    assert_eq!(names(None, false), ["any", "pods"]);
}

#[test]
fn templates_build_keys_and_call_functions() {
    // Keys from the object ($) and from each forEach element (@, in maps below the element),
    // and labels, env and annotations built with functions.
    let idx = index(vec![cmr(
        "functions",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"forEach": "$.spec.containers[*]", "mutations": [
                {"merge": {"resources": {"limits": {"example.com/{{ @.name }}-slots": 1}}}},
                {"upsert": {"path": "/env", "key": "name", "value": {
                    "name": "IMAGE_{{ upper(@.name) }}",
                    "value": "{{ image(@.image).registry }}/{{ image(@.image).repository }}:{{ image(@.image).tag }}"}}}
            ]},
            {"merge": {"metadata": {
                "annotations": {"owner.example.com/{{ $.metadata.namespace }}": "{{ $.metadata.name }}"},
                "labels": {
                    "tier": "{{ default($.metadata.labels.tier, 'web') }}",
                    "containers": "{{ join('.', $.spec.containers[*].name) }}",
                    "name-hash": "{{ replace(sha256($.metadata.name), '^(.{8}).*$', '$1') }}"}}}},
            {"patch": [{"op": "add", "path": "/metadata/annotations/images",
                        "value": "{{ toJson(split(join(',', $.spec.containers[*].image), ',')) }}"}]}
        ]}),
    )]);
    let out = admit(&idx, &pod("shop", "web"), Some("shop"));
    assert_eq!(
        annotations(&out),
        &json!({
            "owner.example.com/shop": "web",
            "images": "[\"nginx\",\"busybox\"]",
            "initium.dev/mutated-by": "functions"
        })
    );
    assert_eq!(
        out.object["metadata"]["labels"],
        json!({"tier": "web", "containers": "app.side", "name-hash": "4b5e57f6"})
    );
    assert_eq!(
        out.object["spec"]["containers"][1],
        json!({"name": "side", "image": "busybox",
               "resources": {"limits": {"example.com/side-slots": 1}},
               "env": [{"name": "IMAGE_SIDE", "value": "docker.io/library/busybox:latest"}]})
    );
    // Applied again, nothing changes.
    let again = admit(&idx, &out.object, Some("shop"));
    assert_eq!(again.object, out.object);
}

#[test]
fn a_function_that_cannot_run_fails_the_rule_with_its_field_and_function() {
    let idx = index(vec![cmr(
        "decode",
        json!({"failurePolicy": "Fail", "match": {"kinds": ["Pod"]}, "mutations": [
            {"merge": {"metadata": {"labels": {"a": "b"}}}},
            {"forEach": "$.spec.containers[*]", "mutations": [
                {"merge": {"metadata": {"annotations": {"{{ @.image }}": "{{ base64Decode(@.name) }}"}}}}
            ]}
        ]}),
    )]);
    let denial = try_admit(
        &idx,
        &pod("shop", "web"),
        Some("shop"),
        Operation::Create,
        None,
    )
    .unwrap_err();
    assert_eq!(
        denial.message,
        "ClusterMutationRule decode (failurePolicy Fail) failed: spec.mutations[1]: forEach element /spec/containers/0: template {{ base64Decode(@.name) }}: base64Decode(): its argument is not valid base64 (Invalid last symbol 112, offset 2.)"
    );
    // Two containers with the same image would give one annotation key twice.
    let same = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "shop"},
        "spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "x"}]}});
    let idx = index(vec![cmr(
        "keys",
        json!({"failurePolicy": "Fail", "match": {"kinds": ["Pod"]}, "mutations": [
            {"merge": {"metadata": {"annotations": {
                "{{ $.spec.containers[0].image }}": "1", "{{ $.spec.containers[1].image }}": "2"}}}}
        ]}),
    )]);
    let denial = try_admit(&idx, &same, Some("shop"), Operation::Create, None).unwrap_err();
    assert_eq!(
        denial.message,
        "ClusterMutationRule keys (failurePolicy Fail) failed: spec.mutations[0]: the key \"{{ $.spec.containers[1].image }}\" renders to \"x\", which another key of the same object has too; keys must render to different strings"
    );
}

// ---- mode: Audit

#[test]
fn an_audit_rule_reports_what_it_would_change_and_changes_nothing() {
    let idx = index(vec![
        cmr(
            "audited",
            json!({"mode": "Audit", "priority": 10, "match": {"kinds": ["Pod"]},
                   "mutations": [label("team", "payments"),
                                 {"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "ca", "emptyDir": {}}}}]}),
        ),
        // Runs after it, and reads what the audit rule would have written: it must not see it.
        cmr(
            "enforced",
            json!({"priority": 20, "match": {"kinds": ["Pod"]},
                   "conditions": [{"path": "$.metadata.labels.team", "exists": false}],
                   "mutations": [label("seen", "no-team")]}),
        ),
    ]);
    let original = pod("shop", "web");
    let out = admit(&idx, &original, Some("shop"));
    assert_eq!(out.object["metadata"]["labels"], json!({"seen": "no-team"}));
    assert!(
        out.object["spec"].get("volumes").is_none(),
        "{}",
        out.object
    );
    assert_eq!(
        out.object["metadata"]["annotations"]["initium.dev/mutated-by"], "enforced",
        "provenance names only the rules that changed the object"
    );
    assert_eq!(
        out.applied
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>(),
        ["enforced"]
    );
    assert!(out.skipped.is_empty() && out.warnings.is_empty());
    assert_patch_reproduces(&original, &out);
    assert_eq!(out.audited.len(), 1);
    let audited = &out.audited[0];
    assert_eq!(audited.rule.to_string(), "audited");
    let initium::engine::Verdict::WouldChange(ops) = &audited.verdict else {
        panic!("{audited:?}");
    };
    // The audit's own patch turns the object it saw into what it would have made.
    let mut would = original.clone();
    json_patch::patch(&mut would, ops).unwrap();
    assert_eq!(would["metadata"]["labels"], json!({"team": "payments"}));
    assert_eq!(
        would["spec"]["volumes"],
        json!([{"name": "ca", "emptyDir": {}}])
    );
    assert_eq!(
        audited.summary(),
        "audit: ClusterMutationRule audited would change the object: add /metadata/labels, add /spec/volumes"
    );
}

#[test]
fn a_failing_audit_rule_never_rejects_and_says_what_enforcing_it_would_do() {
    let failing = |name: &str, policy: &str| {
        cmr(
            name,
            json!({"mode": "Audit", "failurePolicy": policy, "match": {"kinds": ["Pod"]},
                   "mutations": [{"patch": [{"op": "replace", "path": "/spec/missing", "value": 1}]}]}),
        )
    };
    let idx = index(vec![
        failing("strict", "Fail"),
        failing("lenient", "Ignore"),
        cmr(
            "unchanged",
            json!({"mode": "Audit", "match": {"kinds": ["Pod"]},
                   "mutations": [{"defaults": {"metadata": {"name": "other"}}}]}),
        ),
    ]);
    let original = pod("shop", "web");
    let out = admit(&idx, &original, Some("shop"));
    assert_eq!(out.object, original, "nothing changes");
    assert!(out.ops.is_empty() && out.skipped.is_empty() && out.warnings.is_empty());
    let summaries: Vec<String> = out.audited.iter().map(|a| a.summary()).collect();
    assert_eq!(summaries.len(), 3, "{summaries:?}");
    assert!(
        summaries[0].starts_with(
            "audit: ClusterMutationRule lenient would fail, and the rule would be skipped (failurePolicy Ignore): "
        ),
        "{summaries:?}"
    );
    assert!(
        summaries[1].starts_with(
            "audit: ClusterMutationRule strict would fail, and the object would be rejected (failurePolicy Fail): "
        ),
        "{summaries:?}"
    );
    assert_eq!(
        summaries[2],
        "audit: ClusterMutationRule unchanged matched and would change nothing"
    );
}

#[test]
fn an_audit_rule_out_of_budget_is_reported_not_enforced() {
    let idx = index(vec![cmr(
        "late",
        json!({"mode": "Audit", "failurePolicy": "Fail", "match": {"kinds": ["Pod"]},
               "mutations": [label("a", "b")]}),
    )]);
    let past = Instant::now() - Duration::from_millis(1);
    let out = try_admit(
        &idx,
        &pod("shop", "web"),
        Some("shop"),
        Operation::Create,
        Some(past),
    )
    .unwrap_or_else(|d| panic!("an Audit rule must never deny: {d}"));
    assert!(out.budget_exceeded);
    assert!(out.ops.is_empty());
    assert!(
        out.audited[0].summary().contains("latency budget"),
        "{:?}",
        out.audited
    );
}

/// Found by the fuzz campaign (seed 1795931107888468499): a merge of `null` onto a member
/// that holds `null` removes it, and that removal is a change the patch carries (it was
/// made but not recorded, so the patch did not take the object to the output).
#[test]
fn a_merged_null_removes_a_null_member_and_the_patch_says_so() {
    let idx = index(vec![cmr(
        "drop",
        json!({"match": {"kinds": ["*"]},
        "mutations": [{"merge": {"data": null}}]}),
    )]);
    let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "x", "namespace": "d"}, "data": null});
    let out = admit(&idx, &object, Some("d"));
    assert!(out.object.get("data").is_none());
    assert_eq!(out.applied.len(), 1);
    assert_patch_reproduces(&object, &out);
}
