//! Hostile and careless rules: whatever a rule within the CRD's limits does, the process
//! survives, the rule fails by its failurePolicy with a sentence that names the field and the
//! limit, its changes are undone, and the other rules still run.
//!
//! Each shape here once crashed (stack overflow), exhausted memory or stalled the engine for
//! seconds (see docs/reliability.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

use std::time::{Duration, Instant};

use initium::api::Operation;
use initium::engine::{
    Denial, Gvk, Limits, MAX_DEPTH, Outcome, RanBefore, RuleIndex, RuleSource, Subject,
    compile_all, parse_rule,
};
use serde_json::{Value, json};

fn mr(ns: &str, name: &str, spec: Value) -> RuleSource {
    parse_rule(
        &json!({"apiVersion": "initium.dev/v1alpha1", "kind": "MutationRule",
                "metadata": {"name": name, "namespace": ns}, "spec": spec}),
        "default",
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn index(rules: Vec<RuleSource>) -> RuleIndex {
    let (compiled, errors) = compile_all(&rules);
    assert!(errors.is_empty(), "{errors:?}");
    RuleIndex::new(compiled)
}

fn compile_error(spec: Value) -> String {
    let (_, errors) = compile_all(&[mr("team", "hostile", spec)]);
    assert_eq!(errors.len(), 1, "the rule should not compile");
    errors[0].to_string()
}

fn pod(containers: usize) -> Value {
    let containers: Vec<Value> = (0..containers)
        .map(|i| json!({"name": format!("c{i}"), "image": "nginx"}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team"},
           "spec": {"containers": containers}})
}

fn admit_with(
    index: &RuleIndex,
    object: &Value,
    deadline: Option<Instant>,
    limits: &Limits,
) -> Result<Outcome, Denial> {
    let gvk = Gvk::new("", "v1", "Pod");
    let subject = Subject {
        gvk: &gvk,
        operation: Operation::Create,
        namespace: Some("team"),
        name: Some("p"),
        namespace_labels: None,
        ran_before: RanBefore::Unknown,
        lookups: None,
    };
    index.evaluate_with(&subject, object.clone(), deadline, limits)
}

fn admit(index: &RuleIndex, object: &Value) -> Result<Outcome, Denial> {
    admit_with(index, object, None, &Limits::default())
}

/// A well-behaved rule that sorts after the hostile ones (same priority, later name).
fn good_rule() -> RuleSource {
    mr(
        "team",
        "zz-good",
        json!({"match": {"kinds": ["Pod"]},
               "mutations": [{"merge": {"metadata": {"labels": {"good": "yes"}}}}]}),
    )
}

/// The hostile rule was skipped with a warning containing `expect`, changed nothing, and the
/// good rule still ran.
fn assert_contained(outcome: &Outcome, original: &Value, expect: &str) {
    assert_eq!(outcome.skipped.len(), 1, "{:?}", outcome.warnings);
    assert!(
        outcome.warnings[0].contains("MutationRule team/hostile skipped")
            && outcome.warnings[0].contains(expect),
        "warning {:?} should name the rule and say {expect:?}",
        outcome.warnings[0]
    );
    assert_eq!(outcome.applied.len(), 1, "only the good rule applies");
    let mut expected = original.clone();
    expected["metadata"]["labels"] = json!({"good": "yes"});
    expected["metadata"]["annotations"] = json!({"initium.dev/mutated-by": "team/zz-good"});
    assert_eq!(
        outcome.object, expected,
        "the hostile rule's changes are undone"
    );
}

/// Runs `spec` as team/hostile beside the good rule on a Pod with `containers` containers:
/// the hostile rule is contained, with `expect` in its warning.
fn assert_hostile_contained(spec: Value, containers: usize, expect: &str) {
    let idx = index(vec![mr("team", "hostile", spec), good_rule()]);
    let original = pod(containers);
    let outcome = admit(&idx, &original).expect("Ignore rules do not deny");
    assert_contained(&outcome, &original, expect);
}

#[test]
fn chained_foreach_that_nests_the_object_deeper_stops_at_the_depth_limit() {
    // Every step wraps every value of the object in two more levels: the object doubles
    // in depth and in size each time. This overflowed the stack.
    let step =
        json!({"forEach": "$..[?@.name]", "mutations": [{"merge": {"w": {"w": "{{ @ }}"}}}]});
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": vec![step; 8]}),
        2,
        "more than 100 levels deep (the depth limit)",
    );
}

#[test]
fn a_foreach_element_replaced_by_an_earlier_step_is_named() {
    // `$..*` selects a list and then its elements; merging into the list replaces it with an
    // object, so its elements are gone when their turn comes.
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"forEach": "$..*", "mutations": [{"merge": {"w": "{{ @ }}"}}]}]}),
        1,
        "the forEach element no longer exists: an earlier step of this forEach removed or replaced it",
    );
}

#[test]
fn a_rule_that_copies_the_object_into_itself_stops_at_the_output_limit() {
    // 22 merges of the whole object into itself: 2^22 times the Pod (5.75 GB before).
    let step = json!({"merge": {"metadata": {"annotations": {"copy": "{{ $.spec }}"}}, "spec": {"copy": "{{ $ }}"}}});
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": vec![step; 22]}),
        2,
        "--max-rule-output",
    );
}

#[test]
fn doubling_rewrites_stop_at_the_output_limit_before_building_the_string() {
    // 28 rewrites of every character to itself twice: 2^28 times the image name. The text
    // reaches the longest a regex may search (about 31 KB for `.`) before the output limit.
    let step = json!({"rewrite": {"path": "/spec/containers/0/image", "regex": ".", "replacement": "$0$0"}});
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": vec![step.clone(); 28]}),
        1,
        "may search at most",
    );
    // With a few more bytes per match than the search bound grows, the output limit stops it.
    let step = json!({"rewrite": {"path": "/spec/containers/0/image", "regex": "^.*$", "replacement": "$0".repeat(64)}});
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": vec![step; 8]}),
        1,
        "more than 1 MiB",
    );
}

#[test]
fn a_single_rewrite_whose_replacement_repeats_the_whole_match_is_refused_up_front() {
    // One match of the whole string expanded 300 times: checked before it is built.
    let replacement = "$0".repeat(300);
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"merge": {"metadata": {"annotations": {"big": "x".repeat(100_000)}}}},
            {"rewrite": {"path": "/metadata/annotations/big", "regex": "^.*$", "replacement": replacement}}]}),
        1,
        "spec.mutations[1]",
    );
}

#[test]
fn a_deep_path_is_refused_at_the_depth_limit() {
    let path = "/spec".to_string() + &"/x".repeat(MAX_DEPTH + 5);
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"patch": [{"op": "add", "path": path, "value": 1}]}]}),
        1,
        "more than 100 levels deep",
    );
}

#[test]
fn a_fail_rule_over_a_limit_denies_with_a_sentence_naming_rule_field_and_limit() {
    let step = json!({"merge": {"metadata": {"annotations": {"copy": "{{ $.spec }}"}}, "spec": {"copy": "{{ $ }}"}}});
    let hostile = mr(
        "team",
        "hostile",
        json!({"match": {"kinds": ["Pod"]}, "failurePolicy": "Fail", "mutations": vec![step; 30]}),
    );
    let idx = index(vec![hostile]);
    let denial = admit(&idx, &pod(3)).expect_err("a Fail rule over a limit denies");
    assert!(
        denial
            .message
            .starts_with("MutationRule team/hostile (failurePolicy Fail) failed: spec.mutations[")
            && denial
                .message
                .contains("(the per-rule output limit, --max-rule-output)"),
        "{}",
        denial.message
    );
}

#[test]
fn the_output_limit_is_shared_by_the_rules_of_one_object() {
    // Each rule writes 300 KB, under the per-rule limit; together they pass the per-object one.
    let rules: Vec<RuleSource> = (0..20)
        .map(|i| {
            mr(
                "team",
                &format!("writer-{i:02}"),
                json!({"match": {"kinds": ["Pod"]}, "mutations": [
                    {"merge": {"metadata": {"annotations": {format!("a{i}"): "y".repeat(300_000)}}}}]}),
            )
        })
        .collect();
    let idx = index(rules);
    let outcome = admit(&idx, &pod(1)).expect("Ignore rules do not deny");
    // 4 MiB / 300 KB: the first 13 fit, the rest are skipped.
    assert_eq!(outcome.applied.len(), 13, "{:?}", outcome.warnings);
    assert_eq!(outcome.skipped.len(), 7);
    assert!(
        outcome.warnings[0].contains("--max-admission-output"),
        "{}",
        outcome.warnings[0]
    );
}

#[test]
fn foreach_over_many_elements_is_bounded_in_steps() {
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"forEach": "$.spec.containers[*]",
               "mutations": vec![json!({"merge": {"env": [{"name": "A", "value": "b"}]}}); 20]}]}),
        6_000,
        "forEach would take more than 100000 element × mutation steps (the limit, --max-foreach-steps): 6000 elements × 20 mutations",
    );
}

#[test]
fn in_sets_rebuilt_at_every_foreach_element_count_against_its_steps() {
    // Found by the fuzzer (a 10-second hang of `initium test`, which has no latency budget):
    // `in: $..*` sees the forEach's own elements, so its set is built again at each of them,
    // elements × object. Each value a rebuild selects is now a step of the rule's budget.
    let started = Instant::now();
    let removes = vec![
        json!({"forEach": "$.spec.containers[*]", "mutations": [
        {"remove": {"path": "/env", "where": [{"path": "@.name", "in": "$..*"}]}}]});
        4
    ];
    let idx = index(vec![mr(
        "team",
        "hostile",
        json!({"match": {"kinds": ["Pod"]}, "mutations": removes}),
    )]);
    let mut object = pod(2_000);
    for c in object["spec"]["containers"].as_array_mut().unwrap() {
        c["env"] = json!([{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]);
    }
    // No deadline, as offline: the steps alone must stop it.
    let outcome = admit(&idx, &object).expect("Ignore rules do not deny");
    assert_eq!(outcome.skipped.len(), 1, "{:?}", outcome.warnings);
    assert!(
        outcome.warnings[0].contains("--max-foreach-steps"),
        "{:?}",
        outcome.warnings
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn foreach_over_twenty_thousand_containers_is_applied_completely() {
    // Recording 20,000 changes used to compare each with all before it (quadratic: 46 s for
    // 40,000 containers); it is linear now. The time is measured in BENCHMARKS.md, not here.
    let rule = mr(
        "team",
        "mounts",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [{"forEach": "$.spec.containers[*]",
               "mutations": [{"upsert": {"path": "/volumeMounts", "key": "name",
                                          "value": {"name": "ca", "mountPath": "/etc/ca"}}}]}]}),
    );
    let idx = index(vec![rule]);
    let outcome = admit(&idx, &pod(20_000)).expect("allowed");
    assert_eq!(outcome.applied.len(), 1);
    // One add per container plus the provenance annotation.
    assert_eq!(outcome.ops.len(), 20_001);
    assert_eq!(
        outcome.object["spec"]["containers"][19_999]["volumeMounts"],
        json!([{"name": "ca", "mountPath": "/etc/ca"}])
    );
}

#[test]
fn the_deadline_is_checked_inside_a_long_rule() {
    let rule = mr(
        "team",
        "hostile",
        json!({"match": {"kinds": ["Pod"]}, "failurePolicy": "Fail", "mutations": [{"forEach": "$.spec.containers[*]",
               "mutations": [{"upsert": {"path": "/volumeMounts", "key": "name",
                                          "value": {"name": "ca", "mountPath": "/etc/ca"}}}]}]}),
    );
    let idx = index(vec![rule]);
    // A deadline already passed: between rules it would have been noticed only before the
    // rule; inside the rule it is noticed after at most a few elements.
    let deadline = Instant::now() + Duration::from_micros(1);
    std::thread::sleep(Duration::from_millis(2));
    let denial = admit_with(&idx, &pod(10_000), Some(deadline), &Limits::default())
        .expect_err("out of time");
    assert!(denial.budget_exceeded, "{denial:?}");
    assert!(
        denial.message.contains("latency budget"),
        "{}",
        denial.message
    );
}

#[test]
fn a_rule_may_not_change_what_identifies_the_object() {
    for (mutation, field) in [
        (
            json!({"patch": [{"op": "replace", "path": "/metadata/name", "value": "other"}]}),
            "metadata.name from \"p\" to \"other\"",
        ),
        (
            json!({"merge": {"metadata": {"namespace": "kube-system"}}}),
            "metadata.namespace from \"team\" to \"kube-system\"",
        ),
        (
            json!({"merge": {"apiVersion": {"x": 1}}}),
            "apiVersion from \"v1\" to an object",
        ),
        (
            json!({"patch": [{"op": "remove", "path": "/kind"}]}),
            "kind from \"Pod\" to nothing",
        ),
        (
            json!({"merge": {"metadata": null}}),
            "metadata.name from \"p\" to nothing",
        ),
    ] {
        let hostile = mr(
            "team",
            "hostile",
            json!({"match": {"kinds": ["Pod"]}, "mutations": [mutation]}),
        );
        let idx = index(vec![hostile, good_rule()]);
        let original = pod(1);
        let outcome = admit(&idx, &original).expect("Ignore rules do not deny");
        assert_contained(
            &outcome,
            &original,
            &format!("the rule would change {field}"),
        );
    }
}

#[test]
fn compile_time_limits_name_the_field() {
    let many = compile_error(json!({
        "match": {"kinds": ["Pod"]},
        "conditions": (0..40).map(|_| json!({"path": "$.metadata.name", "matches": "\\w{20}"})).collect::<Vec<_>>(),
        "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}]}));
    assert!(
        many.contains("MutationRule team/hostile: spec: the rule has 40 regular expressions"),
        "{many}"
    );
    let big = compile_error(json!({
        "match": {"kinds": ["Pod"]},
        "conditions": [{"path": "$.metadata.name", "matches": "\\w{20}\\w{20}\\w{20}"}],
        "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}]}));
    assert!(
        big.contains("spec.conditions[0].matches: regular expression")
            && big.contains("is too large once compiled"),
        "{big}"
    );
    let descendants = compile_error(json!({
        "match": {"kinds": ["Pod"]},
        "mutations": [{"forEach": "$..*..*..*", "mutations": [{"merge": {"a": "b"}}]}]}));
    assert!(
        descendants.contains("spec.mutations[0].forEach: invalid JSONPath")
            && descendants.contains("3 descendant segments"),
        "{descendants}"
    );
    let nested = compile_error(json!({
        "match": {"kinds": ["Pod"]},
        "conditions": [{"path": format!("$[?{}@.a{}]", "(".repeat(40), ")".repeat(40)), "exists": true}],
        "mutations": [{"merge": {"a": "b"}}]}));
    assert!(
        nested.contains("spec.conditions[0].path") && nested.contains("nest 41 deep"),
        "{nested}"
    );
}

#[test]
fn a_thousand_regexes_are_refused_quickly() {
    // 1,000 `\w{20}` regexes took 6.7 s and 1.37 GB to compile; the count is refused first.
    let started = Instant::now();
    let error = compile_error(json!({
        "match": {"kinds": ["Pod"]},
        "conditions": (0..1000).map(|_| json!({"path": "$.metadata.name", "matches": "\\w{20}"})).collect::<Vec<_>>(),
        "mutations": [{"merge": {"metadata": {"labels": {"a": "b"}}}}]}));
    assert!(error.contains("1000 regular expressions"), "{error}");
    // Generous: the point is seconds versus a fraction of one (the figure is in the docs).
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn descendant_queries_on_huge_objects_fail_instead_of_stalling() {
    let hostile = mr(
        "team",
        "hostile",
        json!({"match": {"kinds": ["Pod"]},
               "conditions": [{"path": "$..*..image", "exists": true}],
               "mutations": [{"merge": {"metadata": {"labels": {"x": "y"}}}}]}),
    );
    let idx = index(vec![hostile, good_rule()]);
    let original = pod(20_000);
    let outcome = admit(&idx, &original).expect("Ignore rules do not deny");
    assert_eq!(outcome.skipped.len(), 1, "{:?}", outcome.warnings);
    assert!(
        outcome.warnings[0].contains("spec.conditions[0].path")
            && outcome.warnings[0].contains("query work limit"),
        "{}",
        outcome.warnings[0]
    );
}

#[test]
fn names_with_terminal_escapes_are_escaped_in_messages() {
    let hostile = mr(
        "team",
        "hostile",
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"patch": [{"op": "replace", "path": "/metadata/name", "value": "\u{1b}[31mred"}]}]}),
    );
    let idx = index(vec![hostile, good_rule()]);
    let outcome = admit(&idx, &pod(1)).expect("Ignore rules do not deny");
    assert!(
        !outcome.warnings[0].contains('\u{1b}'),
        "{:?}",
        outcome.warnings[0]
    );
    assert!(
        outcome.warnings[0].contains("\\u{1b}[31mred"),
        "{:?}",
        outcome.warnings[0]
    );
}

#[test]
fn the_cli_survives_every_bundled_hostile_rule_and_still_applies_the_good_one() {
    // tests/data/hostile holds the shapes that once took initium down, each beside a good rule;
    // the same files are created through the API server in the fault tests.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hostile");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/data/hostile")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n != "pod.yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    for file in files {
        let name = file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_initium"))
            .args(["apply", "-o", "json", "-r"])
            .arg(&file)
            .arg("-f")
            .arg(dir.join("pod.yaml"))
            .output()
            .expect("run initium");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{name}: {stderr}");
        assert!(
            stderr.contains(&format!("warning: MutationRule team/{name} skipped: ")),
            "{name}: {stderr}"
        );
        let out: Value = serde_json::from_slice(&output.stdout).expect("JSON output");
        assert_eq!(
            out["items"][0]["metadata"]["labels"]["good"], "yes",
            "{name}"
        );
        assert_eq!(out["items"][0]["metadata"]["name"], "p", "{name}");
    }
}

#[test]
fn regex_functions_in_jsonpath_are_bounded() {
    // The JSONPath library compiles a match()/search() pattern at every node it tests: a
    // pattern from the object is refused, and the work of a literal one is counted.
    let from_object = compile_error(json!({
        "match": {"kinds": ["Pod"]},
        "conditions": [{"path": "$..[?search(@.image, @.name)]", "exists": true}],
        "mutations": [{"merge": {"a": "b"}}]}));
    assert!(
        from_object.contains("spec.conditions[0].path")
            && from_object.contains("must be a string literal"),
        "{from_object}"
    );
    let hostile = mr(
        "team",
        "hostile",
        json!({"match": {"kinds": ["Pod"]},
               "conditions": [{"path": "$..[?search(@, '\\\\w')]", "exists": true}],
               "mutations": [{"merge": {"metadata": {"labels": {"x": "y"}}}}]}),
    );
    let idx = index(vec![hostile, good_rule()]);
    let original = pod(2_000);
    let started = Instant::now();
    let outcome = admit(&idx, &original).expect("Ignore rules do not deny");
    assert!(
        outcome
            .warnings
            .first()
            .is_some_and(|w| w.contains("query work limit")),
        "{:?} after {:?}",
        outcome.warnings,
        started.elapsed()
    );
}

#[test]
fn a_mutation_rule_may_only_wait_on_its_own_namespace() {
    let gate = |namespace: &str| {
        json!({"match": {"kinds": ["Pod"]},
               "mutations": [{"merge": {"metadata": {"labels": {"gated": "yes"}}}}],
               "gate": {"waitFor": [{"service": {"name": "db", "namespace": namespace}}]}})
    };
    let error = compile_error(gate("kube-system"));
    assert!(
        error.contains("spec.gate.waitFor[0].service.namespace: a MutationRule may only wait on objects in its own namespace (team), not \"kube-system\""),
        "{error}"
    );
    let (_, errors) = compile_all(&[mr("team", "own", gate("team"))]);
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn hostile_template_functions_stop_at_the_output_limit_before_building() {
    // Each step doubles (or more) what the previous wrote, through a function: the rule
    // stops at the per-rule output limit with its field, the good rule still runs.
    let grow = |value: &str| json!({"merge": {"metadata": {"annotations": {"x": value}}}});
    let seed = json!({"merge": {"metadata": {"annotations": {"x": "ab"}}}});
    for (template, steps) in [
        // toJson escapes the quotes of the text it wraps: more than doubles each time.
        (
            "{{ toJson(split(join($.metadata.annotations.x, split($.metadata.annotations.x, '')), '')) }}",
            0,
        ),
        (
            "{{ join($.metadata.annotations.x, split($.metadata.annotations.x, 'a')) }}",
            30,
        ),
        ("{{ replace($.metadata.annotations.x, '.', '$0$0') }}", 30),
        (
            "{{ base64Encode(base64Encode($.metadata.annotations.x)) }}",
            30,
        ),
        ("{{ toJson(toJson($.metadata.annotations)) }}", 30),
    ] {
        if steps == 0 {
            // split() with an empty separator is the rule's error, not a million pieces.
            assert_hostile_contained(
                json!({"match": {"kinds": ["Pod"]}, "mutations": [seed.clone(), grow(template)]}),
                1,
                "split(): the separator is empty",
            );
            continue;
        }
        let mut mutations = vec![seed.clone()];
        mutations.extend(std::iter::repeat_n(grow(template), steps));
        // replace() searches its text first: the search bound (about 31 KB for `.`) comes
        // before the output limit.
        let expect = if template.contains("replace(") {
            "may search at most"
        } else {
            "(the per-rule output limit, --max-rule-output)"
        };
        assert_hostile_contained(
            json!({"match": {"kinds": ["Pod"]}, "mutations": mutations}),
            1,
            expect,
        );
    }
    // One step that would build megabytes from a large string is refused before building it.
    let big = "a".repeat(600_000);
    for template in [
        "{{ split($.metadata.annotations.big, 'a') }}",
        "{{ fromJson(toJson($.metadata.annotations.big)) }}",
        "{{ base64Decode(base64Encode($.metadata.annotations.big)) }}",
    ] {
        assert_hostile_contained(
            json!({"match": {"kinds": ["Pod"]}, "mutations": [
                {"merge": {"metadata": {"annotations": {"big": big}}}},
                {"merge": {"spec": {"copy": template}}}]}),
            1,
            "spec.mutations[1]: the rule would write more than 1 MiB",
        );
    }
}

#[test]
fn hostile_template_shapes_are_refused_when_the_rule_is_compiled() {
    let nested = format!("{{{{ {}$.a{} }}}}", "trim(".repeat(50), ")".repeat(50));
    let error = compile_error(json!({"match": {"kinds": ["Pod"]},
        "mutations": [{"merge": {"a": nested}}]}));
    assert!(
        error.contains("spec.mutations[0].merge (at /a): template {{ trim(trim(")
            && error.contains("function calls nest more than 8 deep (the limit)"),
        "{error}"
    );
    // replace() patterns count with the rule's other regular expressions.
    let many: Vec<Value> = (0..40)
        .map(|i| json!({"merge": {"metadata": {"labels": {format!("l{i}"): "{{ replace($.metadata.name, '\\w{20}', 'x') }}"}}}}))
        .collect();
    let error = compile_error(json!({"match": {"kinds": ["Pod"]}, "mutations": many}));
    assert!(
        error.contains("spec: the rule has 40 regular expressions (conditions' matches, rewrites and replace() in templates)"),
        "{error}"
    );
    // fromJson of deeply nested text stops at the depth limit, whatever serde_json accepts.
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"merge": {"spec": {"deep": format!("{{{{ fromJson('{deep}') }}}}")}}}]}),
        1,
        "fromJson(): its argument is not JSON (recursion limit exceeded",
    );
    let deep = format!("{}{}", "[".repeat(102), "]".repeat(102));
    assert_hostile_contained(
        json!({"match": {"kinds": ["Pod"]}, "mutations": [
            {"merge": {"spec": {"deep": format!("{{{{ fromJson('{deep}') }}}}")}}}]}),
        1,
        "the JSON nests more than 100 levels deep (the depth limit)",
    );
}

#[test]
fn a_key_expanded_per_container_counts_every_copy_of_its_value() {
    // 20,000 containers × a 100-byte value: 2 MB of annotations, over the 1 MiB per-rule
    // output limit; each copy is counted before it is made.
    let rule = mr(
        "team",
        "per-container",
        json!({"match": {"kinds": ["Pod"]}, "failurePolicy": "Fail", "mutations": [{"merge": {"metadata": {"annotations": {
            "x.example.com/{{ $.spec.containers[*].name }}": "v".repeat(100)
        }}}}]}),
    );
    let idx = index(vec![rule]);
    let denial = admit(&idx, &pod(20_000)).expect_err("over the output limit");
    assert!(
        denial.message.contains("MutationRule team/per-container")
            && denial.message.contains("per-rule output limit"),
        "{}",
        denial.message
    );
}

#[test]
fn a_rule_with_thousands_of_problems_reports_the_first_few() {
    // 1,000 bad regexes: 3,001 errors (994 KB) were printed after the count refusal.
    let conditions: Vec<Value> = (0..1000)
        .map(|_| json!({"path": "$.metadata.name", "matches": "a(b"}))
        .collect();
    let error = compile_error(
        json!({"match": {"kinds": ["Pod"]}, "conditions": conditions,
        "mutations": [{"merge": {"a": "b"}}]}),
    );
    assert_eq!(error.lines().count(), 21, "{error}");
    assert!(
        error.ends_with("spec: and 981 more problems like these; fix these first"),
        "{error}"
    );
    assert!(error.len() < 8 << 10, "{} bytes", error.len());
}

#[test]
fn long_template_queries_are_refused_before_they_are_parsed() {
    // One 1.4 MB MutationRule with a single 700,000-segment template query took 782 MB to
    // compile and kept 165 MB: four of them kept every replica from starting. A query is now
    // refused by its length before the parser sees it, and a rule's queries share a bound.
    let started = Instant::now();
    let long = format!("{{{{ ${} }}}}", ".a".repeat(700_000));
    let error = compile_error(json!({"match": {"kinds": ["Pod"]},
        "mutations": [{"merge": {"metadata": {"labels": {"x": long}}}}]}));
    assert!(
        error.contains("spec.mutations[0].merge (at /metadata/labels/x)")
            && error.contains("a JSONPath of 1400001 bytes is too long: at most 1024 are allowed"),
        "{error}"
    );
    assert!(
        error.len() < 4096,
        "the error quotes the whole query: {} bytes",
        error.len()
    );
    // Many queries each under the bound add up against the rule's bound instead.
    let many: Vec<Value> = (0..40)
        .map(|i| json!({"merge": {"metadata": {"labels": {format!("l{i}"): format!("{{{{ ${} }}}}", ".a".repeat(450))}}}}))
        .collect();
    let error = compile_error(json!({"match": {"kinds": ["Pod"]}, "mutations": many}));
    assert!(
        error.contains("the rule's JSONPath queries come to more than 16 KiB together (the limit of one rule); split the rule into several"),
        "{error}"
    );
    // Each of those rules alone is fine: the bound is per rule.
    let few: Vec<Value> = (0..30)
        .map(|i| json!({"merge": {"metadata": {"labels": {format!("l{i}"): format!("{{{{ ${} }}}}", ".a".repeat(200))}}}}))
        .collect();
    let (_, errors) = compile_all(&[mr(
        "team",
        "fine",
        json!({"match": {"kinds": ["Pod"]}, "mutations": few}),
    )]);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}
