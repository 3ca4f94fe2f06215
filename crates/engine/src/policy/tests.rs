use super::*;
use serde_json::json;

fn spec(value: Value) -> RuleSpec {
    serde_json::from_value(value).unwrap()
}

fn settings() -> PolicySettings {
    PolicySettings {
        owner: "initium".into(),
        excluded_namespaces: vec!["initium-system".into(), "kube-system".into()],
    }
}

fn compile(id: &RuleId, value: Value) -> Result<Generated, NotCompiled> {
    compile_policy(id, &spec(value), &BuiltinResources, &settings())
}

#[test]
fn a_namespaced_rule_is_bound_to_its_namespace_twice() {
    let id = RuleId::namespaced("shop", "team");
    let generated = compile(
        &id,
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"metadata": {"labels": {"team": "shop"}}}}]}),
    )
    .unwrap();
    assert_eq!(generated.name, "initium.mr.shop.team");
    assert_eq!(
        generated.binding["spec"]["matchResources"]["namespaceSelector"],
        json!({"matchLabels": {"kubernetes.io/metadata.name": "shop"}})
    );
    let conditions = generated.policy["spec"]["matchConditions"]
        .as_array()
        .unwrap();
    assert_eq!(conditions[0]["expression"], "request.namespace == \"shop\"");
    assert_eq!(generated.policy["spec"]["reinvocationPolicy"], "Never");
    assert_eq!(
        generated.policy["spec"]["matchConstraints"]["namespaceSelector"]["matchExpressions"][0]["values"],
        json!(["initium-system", "kube-system"])
    );
    assert_eq!(
        generated.policy["metadata"]["labels"][RULE_NAMESPACE_LABEL],
        "shop"
    );
    // One record and one patch per mutation.
    assert_eq!(
        generated.policy["spec"]["mutations"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

#[test]
fn what_has_no_exact_equivalent_names_the_field() {
    let id = RuleId::cluster("r");
    let cases = [
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}, {"merge": {"metadata": {"labels": {"c": "d"}}}}, {"forEach": "$.spec.containers[*]", "mutations": [{"rewrite": {"path": "/image", "regex": "(a)", "replacement": "$1"}}]}]}),
            "spec.mutations[2].forEach",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"rewrite": {"path": "/x", "regex": "(a)", "replacement": "$1"}}]}),
            "spec.mutations[0].rewrite",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mode": "Audit", "mutations": [{"merge": {"a": 1}}]}),
            "spec.mode",
        ),
        (
            json!({"match": {"kinds": ["Node"]}, "mutations": [{"merge": {"a": 1}}]}),
            "spec.match.kinds[0]",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"metadata": {"labels": {"a": "{{ $.metadata.name }}"}}}}]}),
            "spec.mutations[0].merge.metadata.labels.a",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"metadata": {"annotations": {"initium.dev/mutated-by": "x"}}}}]}),
            "spec.mutations[0].merge.metadata.annotations.initium.dev/mutated-by",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"spec": {"x": 1}}}, {"defaults": {"spec": {"x": 2}}}]}),
            "spec.mutations[1]",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "conditions": [{"path": "$.spec.containers[*].image", "exists": true}], "mutations": [{"merge": {"spec": {"x": 1}}}]}),
            "spec.conditions[0].path",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"spec": {"x": 1.5}}}]}),
            "spec.mutations[0].merge.spec.x",
        ),
    ];
    for (rule, field) in cases {
        let error = compile(&id, rule.clone()).unwrap_err();
        assert_eq!(error.field, field, "{rule}: {error}");
        assert!(!error.reason.is_empty());
    }
}

#[test]
fn merge_adds_missing_parents_whole_and_records_only_a_change() {
    let id = RuleId::cluster("labels");
    let generated = compile(
        &id,
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"metadata": {"labels": {"team": "{{ $.metadata.namespace }}", "old": null}}}}]}),
    )
    .unwrap();
    let mutations = &generated.policy["spec"]["mutations"];
    let record = mutations[0]["jsonPatch"]["expression"].as_str().unwrap();
    let patch = mutations[1]["jsonPatch"]["expression"].as_str().unwrap();
    assert!(
        record.contains(r#"object.metadata.labels.team == request.namespace"#),
        "{record}"
    );
    assert!(record.contains(r#"+ ["labels"]"#), "{record}");
    assert!(
        patch.contains(
            r#"JSONPatch{op: "add", path: "/metadata/labels", value: {"team": dyn(request.namespace)}}"#
        ),
        "{patch}"
    );
    assert!(
        patch.contains(r#"JSONPatch{op: "remove", path: "/metadata/labels/old"}"#),
        "{patch}"
    );
}

#[test]
fn a_rule_compiles_only_when_no_earlier_rule_may_meet_the_same_objects() {
    let pods = |extra: Value| {
        let mut rule = json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"metadata": {"labels": {"x": "y"}}}}]});
        if let Value::Object(extra) = extra {
            for (k, v) in extra {
                rule[k] = v;
            }
        }
        spec(rule)
    };
    let platform = pods(json!({"priority": 10, "mode": "Audit"}));
    let shop = pods(json!({}));
    let bank = pods(json!({}));
    let deployments = spec(
        json!({"priority": 1, "match": {"kinds": ["apps/v1/Deployment"]}, "mutations": [{"merge": {"metadata": {"labels": {"x": "y"}}}}]}),
    );
    let rules = vec![
        (RuleId::namespaced("shop", "a"), &shop),
        (RuleId::namespaced("bank", "a"), &bank),
        (RuleId::cluster("deployments"), &deployments),
    ];
    let served = plan(&rules, &BuiltinResources, &settings());
    assert!(served.iter().all(|s| s.generated().is_some()), "{served:?}");

    let mut with_platform = rules.clone();
    with_platform.push((RuleId::cluster("platform"), &platform));
    let served = plan(&with_platform, &BuiltinResources, &settings());
    for s in &served[..2] {
        let Serving::Webhook(reason) = s else {
            panic!("{s:?}")
        };
        assert!(
            reason.reason.contains("ClusterMutationRule platform"),
            "{reason}"
        );
    }
    assert!(
        served[2].generated().is_some(),
        "Deployments are apart from Pods"
    );
    assert!(matches!(&served[3], Serving::Webhook(r) if r.field == "spec.mode"));
}

#[test]
fn disjoint_selectors_keep_rules_apart() {
    let a = spec(
        json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"tier": "web"}}}, "mutations": [{"merge": {"a": 1}}]}),
    );
    let b = spec(
        json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"tier": "db"}}}, "mutations": [{"merge": {"a": 1}}]}),
    );
    let c = spec(
        json!({"match": {"kinds": ["Pod"], "annotations": {"x": "1"}}, "mutations": [{"merge": {"a": 1}}]}),
    );
    let ida = RuleId::cluster("a");
    let idb = RuleId::cluster("b");
    assert!(!may_overlap((&ida, &a), (&idb, &b)));
    assert!(may_overlap((&ida, &a), (&idb, &c)));
    let nsa = spec(
        json!({"match": {"kinds": ["Pod"], "namespaces": ["shop"]}, "mutations": [{"merge": {"a": 1}}]}),
    );
    assert!(!may_overlap(
        (&RuleId::namespaced("bank", "r"), &a),
        (&ida, &nsa)
    ));
    assert!(may_overlap(
        (&RuleId::namespaced("shop", "r"), &a),
        (&ida, &nsa)
    ));
}

#[test]
fn long_names_are_shortened_with_a_hash() {
    let long = "a".repeat(253);
    let name = policy_name("initium", &RuleId::namespaced("ns", &long));
    assert!(name.len() <= 253, "{}", name.len());
    assert_ne!(
        name,
        policy_name("initium", &RuleId::namespaced("nt", &long))
    );
}

#[test]
fn simple_paths_parse_and_others_do_not() {
    assert_eq!(
        simple_path("$.metadata.labels.team").unwrap().0,
        ["metadata", "labels", "team"]
    );
    assert_eq!(
        simple_path("$.metadata.labels['a.b/c']").unwrap().0,
        ["metadata", "labels", "a.b/c"]
    );
    assert!(simple_path("$.spec.containers[*]").is_none());
    assert!(simple_path("$..x").is_none());
    assert!(simple_path("$").is_none());
}
