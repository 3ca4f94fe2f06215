use super::*;
use serde_json::json;

fn spec(value: Value) -> RuleSpec {
    serde_json::from_value(value).unwrap()
}

fn settings() -> PolicySettings {
    PolicySettings {
        owner: "initium".into(),
        excluded_namespaces: vec!["initium-system".into(), "kube-system".into()],
        max_compiled: DEFAULT_MAX_COMPILED,
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
    // One expression: the record and the mutation.
    assert_eq!(
        generated.policy["spec"]["mutations"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn what_has_no_exact_equivalent_names_the_field() {
    let id = RuleId::cluster("r");
    let cases = [
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}, {"merge": {"metadata": {"labels": {"c": "d"}}}}, {"forEach": "$.spec.containers[*]", "mutations": [{"rewrite": {"path": "/image", "regex": "(a)", "replacement": "$1"}}]}]}),
            "spec.mutations[2].mutations[0].rewrite",
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
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"spec": {"hostname": "a"}}}, {"defaults": {"spec": {"hostname": "b"}}}]}),
            "spec.mutations[1]",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "conditions": [{"path": "$.spec.containers[*].image", "exists": true}], "mutations": [{"merge": {"spec": {"hostname": "a"}}}]}),
            "spec.conditions[0].path",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"spec": {"priority": 1.5}}}]}),
            "spec.mutations[0].merge.spec.priority",
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
    let record = generated.policy["spec"]["variables"][0]["expression"]
        .as_str()
        .unwrap();
    let patch = generated.policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
        .as_str()
        .unwrap();
    assert!(patch.contains("(variables.changed ? "), "{patch}");
    assert!(
        record.contains(r#"object.metadata.labels.team == request.namespace"#),
        "{record}"
    );
    assert!(patch.contains(r#"+ ["labels"]"#), "{patch}");
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

#[test]
fn a_field_the_kind_lacks_is_not_compiled() {
    let id = RuleId::cluster("r");
    let cases = [
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"defaults": {"spec": {"extra": {"a": 1}}}}]}),
            "spec.mutations[0].defaults.spec.extra.a",
            "Pod has no field spec.extra",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"spec": {"nodeSelector": {"disk": "ssd"}, "hostname": {"x": "y"}}}}]}),
            "spec.mutations[0].merge.spec.hostname.x",
            "Pod has no fields under spec.hostname (string)",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "ca", "secrett": {"secretName": "ca"}}}}]}),
            "spec.mutations[0].upsert.path",
            "Pod has no field spec.volumes[].secrett",
        ),
        (
            json!({"match": {"kinds": ["Pod", "apps/v1/Deployment"]}, "mutations": [{"merge": {"spec": {"template": {"metadata": {"labels": {"a": "b"}}}}}}]}),
            "spec.mutations[0].merge.spec.template.metadata.labels.a",
            "Pod has no field spec.template",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"spec": {"hostNetwork": "yes"}}}]}),
            "spec.mutations[0].merge.spec.hostNetwork",
            "Pod takes a boolean at spec.hostNetwork, not \"yes\"",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"defaults": {"spec": {"containers": [{"name": "a", "imagee": "x"}]}}}]}),
            "spec.mutations[0].defaults.spec.containers",
            "Pod has no field spec.containers[].imagee",
        ),
    ];
    for (rule, field, reason) in cases {
        let error = compile(&id, rule.clone()).unwrap_err();
        assert_eq!(error.field, field, "{rule}: {error}");
        assert!(error.reason.starts_with(reason), "{rule}: {error}");
    }
    // The same writes on fields the kinds have compile.
    for rule in [
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"defaults": {"spec": {"nodeSelector": {"a": "1"}}}}]}),
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "ca", "secret": {"secretName": "ca"}}}}]}),
        json!({"match": {"kinds": ["apps/v1/Deployment", "apps/v1/StatefulSet"]}, "mutations": [{"merge": {"spec": {"template": {"metadata": {"labels": {"a": "b"}}}}}}]}),
    ] {
        assert!(compile(&id, rule.clone()).is_ok(), "{rule}");
    }
}

#[test]
fn a_rule_is_one_expression_and_later_mutations_see_what_earlier_ones_create() {
    let id = RuleId::cluster("ca");
    let generated = compile(
        &id,
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "ca", "secret": {"secretName": "ca"}}}},
            {"merge": {"metadata": {"annotations": {"ca": "{{ $.metadata.namespace }}"}}}},
            {"defaults": {"spec": {"nodeSelector": {"disk": "ssd"}}}}
        ]}),
    )
    .unwrap();
    let mutations = generated.policy["spec"]["mutations"].as_array().unwrap();
    assert_eq!(mutations.len(), 1);
    let expression = mutations[0]["jsonPatch"]["expression"].as_str().unwrap();
    // The record comes first and adds metadata.annotations when the rule changes the object:
    // the annotation mutation then adds its key to it rather than a new map.
    let record_at = expression.find("initium.dev/mutated-by").unwrap();
    let annotation_at = expression.find(r#""/metadata/annotations/ca""#).unwrap();
    assert!(record_at < annotation_at, "{expression}");
    assert!(
        expression.contains(
            "((has(object.metadata) && has(object.metadata.annotations)) || variables.changed)"
        ),
        "{expression}"
    );
    // The upsert leaves spec present: the defaults do not test it again.
    assert_eq!(
        expression.matches("(has(object.spec) ?").count(),
        1,
        "{expression}"
    );
}

#[test]
fn for_each_over_lists_by_name_compiles_with_the_element_index_in_each_pointer() {
    let id = RuleId::cluster("sc");
    let generated = compile(
        &id,
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"forEach": "$.spec['containers','initContainers'][*]", "mutations": [
                {"defaults": {"securityContext": {"allowPrivilegeEscalation": false}}},
                {"upsert": {"path": "/env", "key": "name", "value": {"name": "NS", "value": "{{ $.metadata.namespace }}"}}}
            ]}
        ]}),
    )
    .unwrap();
    let expression = generated.policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
        .as_str()
        .unwrap();
    assert!(
        expression.contains("object.spec.containers.transformList(ix, el, "),
        "{expression}"
    );
    assert!(
        expression.contains("object.spec.initContainers.transformList(ix, el, "),
        "{expression}"
    );
    assert!(
        expression.contains(r#""/spec/containers" + "/" + string(ix) + "/securityContext""#),
        "{expression}"
    );
    let changed = generated.policy["spec"]["variables"][0]["expression"]
        .as_str()
        .unwrap();
    assert!(
        changed.contains("object.spec.containers.exists(el, "),
        "{changed}"
    );

    let refused = [
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"forEach": "$.spec.containers[?@.name == 'app']", "mutations": [{"merge": {"workingDir": "/w"}}]}]}),
            "spec.mutations[0].forEach",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"forEach": "$.spec.containers[*]", "mutations": [{"merge": {"workDir": "/w"}}]}]}),
            "spec.mutations[0].mutations[0].merge.workDir",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"forEach": "$.spec.hostname[*]", "mutations": [{"merge": {"a": "b"}}]}]}),
            "spec.mutations[0].forEach",
        ),
        (
            // The forEach writes under the list the upsert replaces elements of.
            json!({"match": {"kinds": ["Pod"]}, "mutations": [
                {"upsert": {"path": "/spec/containers", "key": "name", "value": {"name": "a", "image": "x"}}},
                {"forEach": "$.spec.containers[*]", "mutations": [{"merge": {"workingDir": "/w"}}]}
            ]}),
            "spec.mutations[1]",
        ),
    ];
    for (rule, field) in refused {
        let error = compile(&id, rule.clone()).unwrap_err();
        assert_eq!(error.field, field, "{rule}: {error}");
    }
}

#[test]
fn past_the_cap_rules_stay_on_the_webhook_in_order() {
    let rule = spec(
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"merge": {"metadata": {"labels": {"x": "y"}}}}]}),
    );
    let rules: Vec<(RuleId, &RuleSpec)> = ["a", "b", "c", "d"]
        .iter()
        .map(|ns| (RuleId::namespaced(ns, "r"), &rule))
        .collect();
    let mut capped = settings();
    capped.max_compiled = 2;
    let served = plan(&rules, &BuiltinResources, &capped);
    assert!(served[0].generated().is_some());
    assert!(served[1].generated().is_some());
    for s in &served[2..] {
        let Serving::Webhook(reason) = s else {
            panic!("{s:?}")
        };
        assert_eq!(reason.field, "spec");
        assert!(reason.reason.contains("--max-compiled-rules"), "{reason}");
    }
    capped.max_compiled = 0;
    assert!(
        plan(&rules, &BuiltinResources, &capped)
            .iter()
            .all(|s| s.generated().is_none())
    );
}

#[test]
fn a_patch_of_scalar_adds_to_fields_compiles_as_the_merge_that_does_the_same() {
    let id = RuleId::namespaced("payments", "ns-annotation");
    let generated = compile(
        &id,
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"patch": [
            {"op": "add", "path": "/metadata/annotations/certs.example.com~1namespace", "value": "{{ $.metadata.namespace }}"}
        ]}]}),
    )
    .unwrap();
    let expression = generated.policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
        .as_str()
        .unwrap();
    assert!(
        expression.contains(
            r#"JSONPatch{op: "add", path: "/metadata/annotations/certs.example.com~1namespace", value: request.namespace}"#
        ),
        "{expression}"
    );
    let id = RuleId::cluster("r");
    for (rule, field) in [
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"patch": [{"op": "remove", "path": "/metadata/labels/a"}]}]}),
            "spec.mutations[0].patch[0].op",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"patch": [{"op": "add", "path": "/spec/nodeSelector", "value": {"a": "b"}}]}]}),
            "spec.mutations[0].patch[0].value",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"patch": [{"op": "add", "path": "/spec/tolerations/-", "value": "x"}]}]}),
            "spec.mutations[0].patch.spec.tolerations.-",
        ),
        (
            json!({"match": {"kinds": ["Pod"]}, "mutations": [{"patch": [
                {"op": "add", "path": "/metadata/labels/a", "value": "1"},
                {"op": "add", "path": "/metadata/labels/a", "value": "2"}
            ]}]}),
            "spec.mutations[0].patch[1].path",
        ),
    ] {
        let error = compile(&id, rule.clone()).unwrap_err();
        assert_eq!(error.field, field, "{rule}: {error}");
    }
}
