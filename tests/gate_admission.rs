//! The admission half of gate mode, on the pure engine: a gate rule adds its scheduling gate
//! (and the label the gate controller watches) at CREATE only, after its mutations, keeps
//! other gates, and the compile-time checks on `spec.gate`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

use std::time::Duration;

use initium::api::Operation;
use initium::engine::{
    Dependency, Gvk, Outcome, RanBefore, RuleIndex, RuleSource, Subject, compile_all, gate_name,
    parse_rule,
};
use serde_json::{Value, json};

fn rule(doc: Value) -> RuleSource {
    parse_rule(&doc, "default").unwrap_or_else(|e| panic!("{e}"))
}

fn mr(ns: &str, name: &str, spec: Value) -> RuleSource {
    rule(
        json!({"apiVersion": "initium.dev/v1alpha1", "kind": "MutationRule", "metadata": {"name": name, "namespace": ns}, "spec": spec}),
    )
}

fn cmr(name: &str, spec: Value) -> RuleSource {
    rule(
        json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule", "metadata": {"name": name}, "spec": spec}),
    )
}

fn index(rules: Vec<RuleSource>) -> RuleIndex {
    let (compiled, errors) = compile_all(&rules);
    assert!(errors.is_empty(), "{errors:?}");
    RuleIndex::new(compiled)
}

/// Every error of compiling `rules`, as `field: message` lines.
fn errors(rules: Vec<RuleSource>) -> Vec<String> {
    let (_, errors) = compile_all(&rules);
    errors
        .iter()
        .flat_map(|e| {
            e.errors
                .iter()
                .map(|f| format!("{}: {}", f.field, f.message))
        })
        .collect()
}

fn pod(ns: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "web-", "namespace": ns, "labels": {"app": "web"}},
           "spec": {"containers": [{"name": "app", "image": "nginx"}]}})
}

fn admit(index: &RuleIndex, object: &Value, op: Operation) -> Outcome {
    let gvk = Gvk::from_api_version("v1", "Pod");
    let subject = Subject {
        gvk: &gvk,
        operation: op,
        namespace: object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str),
        name: None,
        namespace_labels: None,
        ran_before: RanBefore::Unknown,
        lookups: None,
    };
    index
        .evaluate(&subject, object.clone(), None)
        .unwrap_or_else(|d| panic!("denied: {d}"))
}

fn wait_for_db() -> Value {
    json!({"waitFor": [{"service": {"name": "db"}}]})
}

#[test]
fn a_gate_rule_holds_a_new_pod_with_its_own_gate_and_the_watch_label() {
    let idx = index(vec![mr(
        "shop",
        "wait-db",
        json!({"match": {"kinds": ["Pod"], "operations": ["CREATE", "UPDATE"]},
               "mutations": [{"merge": {"metadata": {"labels": {"checked": "yes"}}}}],
               "gate": wait_for_db()}),
    )]);
    let out = admit(&idx, &pod("shop"), Operation::Create);
    assert_eq!(
        out.object["spec"]["schedulingGates"],
        json!([{"name": "initium.dev/shop.wait-db"}])
    );
    assert_eq!(
        out.object["metadata"]["labels"]["initium.dev/gated"],
        "true"
    );
    assert_eq!(out.object["metadata"]["labels"]["checked"], "yes");
    assert_eq!(
        out.object["metadata"]["annotations"]["initium.dev/mutated-by"],
        "shop/wait-db"
    );
    // The patch the API server gets adds exactly that.
    let patch = serde_json::to_value(out.patch()).unwrap();
    assert!(
        patch.to_string().contains("initium.dev/shop.wait-db"),
        "{patch}"
    );

    // At UPDATE the API server refuses new gates: the rule's mutations run, the gate does not.
    let mut existing = pod("shop");
    existing["metadata"]["name"] = json!("web-1");
    let out = admit(&idx, &existing, Operation::Update);
    assert_eq!(out.object["spec"].get("schedulingGates"), None);
    assert_eq!(
        out.object["metadata"]["labels"].get("initium.dev/gated"),
        None
    );
    assert_eq!(out.object["metadata"]["labels"]["checked"], "yes");
}

#[test]
fn other_gates_are_kept_and_a_second_admission_adds_nothing() {
    let idx = index(vec![mr(
        "shop",
        "wait-db",
        json!({"match": {"kinds": ["Pod"]}, "gate": wait_for_db()}),
    )]);
    let mut p = pod("shop");
    p["spec"]["schedulingGates"] = json!([{"name": "example.com/quota"}]);
    let out = admit(&idx, &p, Operation::Create);
    assert_eq!(
        out.object["spec"]["schedulingGates"],
        json!([{"name": "example.com/quota"}, {"name": "initium.dev/shop.wait-db"}])
    );
    let again = admit(&idx, &out.object, Operation::Create);
    assert!(again.applied.is_empty(), "idempotent: {:?}", again.applied);
    assert_eq!(again.object, out.object);
}

#[test]
fn a_rule_may_have_a_gate_and_no_mutations_but_not_neither() {
    let idx = index(vec![cmr(
        "hold",
        json!({"match": {"kinds": ["Pod"]}, "gate": wait_for_db()}),
    )]);
    let out = admit(&idx, &pod("shop"), Operation::Create);
    assert_eq!(out.applied.len(), 1);
    assert_eq!(
        out.object["spec"]["schedulingGates"][0]["name"],
        "initium.dev/cluster.hold"
    );
    assert_eq!(
        errors(vec![cmr("nothing", json!({"match": {"kinds": ["Pod"]}}))]),
        ["spec.mutations: a rule needs at least one mutation (or a gate)"]
    );
}

#[test]
fn several_gate_rules_each_add_their_own_gate_in_rule_order() {
    let idx = index(vec![
        mr(
            "shop",
            "b",
            json!({"match": {"kinds": ["Pod"]}, "gate": wait_for_db()}),
        ),
        cmr(
            "a",
            json!({"match": {"kinds": ["Pod"]}, "gate": {"waitFor": [{"job": {"name": "migrate"}}]}}),
        ),
    ]);
    let out = admit(&idx, &pod("shop"), Operation::Create);
    assert_eq!(
        out.object["spec"]["schedulingGates"],
        json!([{"name": "initium.dev/cluster.a"}, {"name": "initium.dev/shop.b"}])
    );
}

#[test]
fn a_pod_already_bound_to_a_node_fails_the_rule_by_its_failure_policy() {
    let idx = index(vec![mr(
        "shop",
        "wait-db",
        json!({"match": {"kinds": ["Pod"]}, "gate": wait_for_db()}),
    )]);
    let mut bound = pod("shop");
    bound["spec"]["nodeName"] = json!("node-1");
    let out = admit(&idx, &bound, Operation::Create);
    assert_eq!(out.skipped.len(), 1);
    assert!(
        out.warnings[0].contains("spec.gate: the Pod is already bound to a node"),
        "{:?}",
        out.warnings
    );
    assert_eq!(out.object["spec"].get("schedulingGates"), None);
}

#[test]
fn the_compiled_gate_resolves_dependencies_and_defaults() {
    let (rules, errs) = compile_all(&[cmr(
        "deps",
        json!({"match": {"kinds": ["Pod"]}, "exclude": {"labels": {"matchLabels": {"app": "cache"}}},
               "gate": {"timeout": "90s", "onTimeout": "Hold", "waitFor": [
                   {"service": {"name": "db", "namespace": "data"}},
                   {"job": {"name": "migrate"}},
                   {"pods": {"selector": {"matchLabels": {"app": "cache"}}}},
                   {"daemonSet": {"name": "agent", "namespace": "infra"}},
                   {"object": {"apiVersion": "example.com/v1", "kind": "Foo", "name": "f",
                               "conditions": [{"path": "$.status.phase", "equals": "Ready"}]}}]}}),
    )]);
    assert!(errs.is_empty(), "{errs:?}");
    let gate = rules[0].gate().unwrap();
    assert_eq!(gate.name, gate_name(&rules[0].id));
    assert_eq!(gate.timeout, Duration::from_secs(90));
    assert_eq!(gate.on_timeout, initium::api::OnTimeout::Hold);
    let ns: Vec<&str> = gate.wait_for.iter().map(|d| d.namespace("web")).collect();
    assert_eq!(ns, ["data", "web", "web", "infra", "web"]);
    let cache = [("app".to_string(), "cache".to_string())].into();
    assert!(gate.wait_for[2].selects(&cache));
    assert!(!gate.wait_for[2].selects(&Default::default()));
    assert!(gate.wait_for[4].object_holds(&json!({"status": {"phase": "Ready"}})));
    assert!(!gate.wait_for[4].object_holds(&json!({"status": {"phase": "Pending"}})));
    assert!(matches!(gate.wait_for[3], Dependency::DaemonSet(_)));
    assert_eq!(
        gate.wait_for[0].describe("web"),
        "Service data/db",
        "events name the dependency"
    );

    let (rules, _) = compile_all(&[mr(
        "shop",
        "default-timeout",
        json!({"match": {"kinds": ["Pod"]}, "gate": wait_for_db()}),
    )]);
    assert_eq!(
        rules[0].gate().unwrap().timeout,
        Duration::from_secs(600),
        "default 10m"
    );
}

#[test]
fn gate_mistakes_are_errors_that_name_the_field() {
    let bad = errors(vec![
        mr(
            "shop",
            "other-ns",
            json!({"match": {"kinds": ["Pod"]}, "gate": {"waitFor": [{"daemonSet": {"name": "agent", "namespace": "infra"}}]}}),
        ),
        cmr(
            "zero",
            json!({"match": {"kinds": ["Pod"]}, "gate": {"timeout": "0s", "waitFor": [{"job": {"name": "j"}}]}}),
        ),
        cmr(
            "bad-condition",
            json!({"match": {"kinds": ["Pod"]}, "gate": {"waitFor": [{"object": {"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "conditions": [{"path": "$[", "exists": true}]}}]}}),
        ),
    ]);
    assert_eq!(bad.len(), 3, "{bad:#?}");
    assert!(
        bad[0].starts_with("spec.gate.waitFor[0].daemonSet.namespace: a MutationRule may only wait on objects in its own namespace (shop)"),
        "{bad:#?}"
    );
    assert_eq!(
        bad[1],
        "spec.gate.timeout: the timeout must be more than zero"
    );
    assert!(
        bad[2].starts_with("spec.gate.waitFor[0].object.conditions[0].path"),
        "{bad:#?}"
    );
}

#[test]
fn a_pods_dependency_the_rule_would_hold_itself_is_refused_unless_kept_out() {
    let waits_on_db = json!({"waitFor": [{"pods": {"selector": {"matchLabels": {"app": "db"}}}}]});
    // Every Pod of the namespace is held, the db Pods too: they would wait on themselves.
    let bad = errors(vec![mr(
        "shop",
        "self",
        json!({"match": {"kinds": ["Pod"]}, "gate": waits_on_db}),
    )]);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(
        bad[0].starts_with(
            "spec.gate.waitFor[0].pods.selector: this rule could hold the very Pods it waits for"
        ),
        "{bad:?}"
    );
    // Kept out by exclude, by a contradicting match.labels, or by namespace: accepted.
    let fine = errors(vec![
        mr(
            "shop",
            "excluded",
            json!({"match": {"kinds": ["Pod"]}, "exclude": {"labels": {"matchLabels": {"app": "db"}}}, "gate": waits_on_db}),
        ),
        mr(
            "shop",
            "narrowed",
            json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"app": "web"}}}, "gate": waits_on_db}),
        ),
        cmr(
            "elsewhere",
            json!({"match": {"kinds": ["Pod"], "namespaces": ["shop-*"]},
                   "gate": {"waitFor": [{"pods": {"namespace": "data", "selector": {"matchLabels": {"app": "db"}}}}]}}),
        ),
    ]);
    assert!(fine.is_empty(), "{fine:#?}");
}
