//! The offline commands as a user runs them: the `initium` binary on files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};
use support::commands::output_with_stdin;
use support::root;

fn initium(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_initium"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("initium runs")
}

fn initium_stdin(args: &[&str], input: &[u8]) -> Output {
    output_with_stdin(
        Command::new(env!("CARGO_BIN_EXE_initium"))
            .args(args)
            .current_dir(root()),
        input,
    )
    .expect("initium runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn examples() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn every_example_has_a_passing_test_case() {
    let names = examples();
    assert_eq!(
        names,
        [
            "audit-mode",
            "autogen",
            "default-labels",
            "from-kyverno",
            "podpreset",
            "proxy-env",
            "registry-mirror",
            "sidecar",
            "test-ca",
            "wait-for-db"
        ]
    );
    for name in &names {
        assert!(
            root()
                .join("examples")
                .join(name)
                .join("initium-test.yaml")
                .exists(),
            "{name} has no initium-test.yaml"
        );
    }
    let out = initium(&["test", "examples"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.ends_with("16 passed, 0 failed\n"), "{stdout}");
}

#[test]
fn apply_json_prints_every_object_in_input_order_mutated_or_not() {
    let out = initium(&[
        "apply",
        "-r",
        "examples/test-ca/rules.yaml",
        "-f",
        "examples/test-ca/objects.yaml",
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let list: Value = serde_json::from_slice(&out.stdout).expect("a JSON List");
    assert_eq!(list["kind"], "List");
    let items = list["items"].as_array().unwrap();
    let names: Vec<&str> = items
        .iter()
        .map(|i| {
            i["metadata"]["name"]
                .as_str()
                .or(i["metadata"]["generateName"].as_str())
                .unwrap()
        })
        .collect();
    assert_eq!(names, ["api", "worker-", "web"]);
    let expected: Vec<Value> = serde_saphyr::from_multiple(
        &std::fs::read_to_string(root().join("examples/test-ca/expected.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(items, &expected);
    assert_eq!(
        text(&out.stderr),
        "Pod payments/api: mutated by payments/test-certs\n"
    );
}

#[test]
fn apply_yaml_and_patch_outputs() {
    let out = initium(&[
        "apply",
        "-r",
        "examples/registry-mirror",
        "-f",
        "examples/registry-mirror/objects.yaml",
        "-o",
        "patch",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("note: 5 non-rule document(s) in the rule inputs were ignored"),
        "{}",
        text(&out.stderr)
    );
    let lines: Vec<Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["object"], "Pod default/mixed");
    assert!(lines[0]["patch"].as_array().unwrap().contains(&json!({"op": "replace", "path": "/spec/containers/0/image", "value": "mirror.local/library/nginx"})));
    assert_eq!(
        lines[1],
        json!({"object": "Pod default/private-only", "patch": []})
    );

    let out = initium(&[
        "apply",
        "-r",
        "examples/sidecar/rules.yaml",
        "-f",
        "examples/sidecar/objects.yaml",
    ]);
    assert!(out.status.success());
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text(&out.stdout)).unwrap();
    let expected: Vec<Value> = serde_saphyr::from_multiple(
        &std::fs::read_to_string(root().join("examples/sidecar/expected.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(docs, expected);
}

#[test]
fn applying_any_examples_rules_to_its_own_output_changes_nothing() {
    for name in examples() {
        let dir = format!("examples/{name}");
        let first = initium(&[
            "apply",
            "-r",
            &format!("{dir}/rules.yaml"),
            "-f",
            &format!("{dir}/objects.yaml"),
            "-o",
            "json",
        ]);
        assert!(first.status.success());
        let second = initium_stdin(
            &[
                "apply",
                "-r",
                &format!("{dir}/rules.yaml"),
                "-f",
                "-",
                "-o",
                "json",
            ],
            &first.stdout,
        );
        assert!(second.status.success(), "{}", text(&second.stderr));
        assert_eq!(
            text(&first.stdout),
            text(&second.stdout),
            "{name} is not idempotent"
        );
        // Only what Audit rules would do (they never change the output) may be reported.
        let reported: Vec<String> = text(&second.stderr)
            .lines()
            .filter(|l| !l.contains(": audit: "))
            .map(String::from)
            .collect();
        assert!(
            reported.is_empty(),
            "{name}: no rule changes its own output: {reported:?}"
        );
    }
}

#[test]
fn check_reports_every_invalid_rule_with_its_field_path() {
    let out = initium(&["check", "-r", "tests/data/invalid-rules.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let f = "(tests/data/invalid-rules.yaml";
    let want = [
        format!(
            "ClusterMutationRule bad-regex {f}#1): spec.conditions[0].matches: invalid regular expression \"(unclosed\": unclosed group"
        ),
        format!(
            "ClusterMutationRule bad-regex {f}#1): spec.mutations[0].rewrite.regex: invalid regular expression \"[z-a]\": invalid character class range, the start must be <= the end"
        ),
        format!(
            "ClusterMutationRule bad-jsonpath {f}#2): spec.conditions[0].path: invalid JSONPath \"$.spec.containers[\": expected selector"
        ),
        format!(
            "ClusterMutationRule bad-jsonpath {f}#2): spec.mutations[0].forEach: invalid JSONPath \"spec.containers[*]\": it must start with '$'"
        ),
        format!(
            "ClusterMutationRule bad-pointer {f}#3): spec.mutations[0].upsert.path: invalid JSON pointer \"spec/volumes\": it must be empty or start with '/'"
        ),
        format!(
            "ClusterMutationRule bad-pointer {f}#3): spec.mutations[1].patch[0].path: invalid JSON pointer \"/a~2b\": '~' must be followed by 0 or 1"
        ),
        format!(
            "ClusterMutationRule bad-template {f}#4): spec.mutations[0].merge (at /metadata/labels/ns): template in \"{{{{ $.metadata.namespace\" has no closing }}}}"
        ),
        format!(
            "ClusterMutationRule bad-template {f}#4): spec.mutations[1].merge (at /metadata/labels/el): template {{{{ @.name }}}}: @ (the current element) is only available inside forEach"
        ),
        format!(
            "ClusterMutationRule bad-kind {f}#5): spec.match.kinds[0]: invalid kind \"pod\": \"pod\" is not a Kind name (like Pod or Deployment) or *"
        ),
        format!(
            "ClusterMutationRule bad-kind {f}#5): spec.match.kinds[1]: invalid kind \"apps/v1/deploy/x\": use Kind, version/Kind or group/version/Kind"
        ),
        format!(
            "ClusterMutationRule bad-selector {f}#6): spec.match.labels.matchExpressions[0].operator: unknown operator \"Equals\": use In, NotIn, Exists or DoesNotExist"
        ),
        format!(
            "ClusterMutationRule no-mutations {f}#7): spec.mutations: a rule needs at least one mutation (or a gate)"
        ),
        format!("ClusterMutationRule unknown-fields {f}#8): spec.match.namspaces: unknown field"),
        format!(
            "ClusterMutationRule unknown-fields {f}#8): spec.mutations[0].upsert.pathh: unknown field"
        ),
        format!(
            "ClusterMutationRule wrong-type {f}#9): spec.priority: invalid type: string \"high\", expected i32"
        ),
        format!(
            "ClusterMutationRule two-kinds-of-mutation {f}#10): spec.mutations[0]: set exactly one of merge, patch, upsert, rewrite, defaults, remove, forEach (found 2)"
        ),
        format!(
            "MutationRule payments/ns-owner-overreach {f}#11): spec.match.namespaces: a MutationRule applies only to its own namespace; use a ClusterMutationRule"
        ),
        format!(
            "ClusterMutationRule bad-gate {f}#12): spec.gate: a gate holds Pods through scheduling gates: match.kinds must be only Pod"
        ),
        format!(
            "ClusterMutationRule bad-gate {f}#12): spec.gate.timeout: invalid duration \"10 minutes\": use a number with a unit, like 30s, 10m or 1h30m"
        ),
        format!(
            "ClusterMutationRule bad-gate {f}#12): spec.gate.waitFor[0]: set exactly one of service, job, pods, object, daemonSet (found 2)"
        ),
        format!(
            "MutationRule unquoted-namespace {f}#14): metadata.namespace: must be a string, found false (in YAML, quote values such as y, no or 1)"
        ),
    ];
    let lines: Vec<&str> = stderr.lines().skip(1).collect();
    assert_eq!(
        stderr.lines().next(),
        Some("error: 21 error(s) in 13 rule(s):")
    );
    assert_eq!(lines, want.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!stderr.contains(" good "), "the valid rule is not reported");
}

#[test]
fn check_accepts_the_examples() {
    let out = initium(&["check", "-r", "examples"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).ends_with("14 rule(s) valid\n"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn apply_reads_lookups_from_the_config_maps_among_the_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        r#"
apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {name: mirror, namespace: shop}
spec:
  failurePolicy: Fail
  match: {kinds: [Pod]}
  lookups: [{name: mirror, configMap: {name: registry}}]
  mutations:
    - merge: {metadata: {annotations: {registry: "{{ lookups.mirror.data.host }}"}}}
"#,
    )
    .unwrap();
    let objects = |host: Option<&str>| {
        let config_map = host.map_or(String::new(), |h| {
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: registry, namespace: shop}}\ndata: {{host: {h}}}\n---\n"
            )
        });
        format!(
            "{config_map}apiVersion: v1\nkind: Pod\nmetadata: {{name: web, namespace: shop}}\nspec: {{containers: []}}\n"
        )
    };
    let args = [
        "apply",
        "-r",
        rules.to_str().unwrap(),
        "-f",
        "-",
        "-o",
        "json",
    ];
    let out = initium_stdin(&args, objects(Some("mirror.local")).as_bytes());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["items"][0]["kind"], "ConfigMap", "printed as given");
    assert_eq!(
        list["items"][1]["metadata"]["annotations"]["registry"],
        "mirror.local"
    );
    // Another value in the inputs, another result: the rule reads the inputs, nothing else.
    let out = initium_stdin(&args, objects(Some("other.local")).as_bytes());
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        list["items"][1]["metadata"]["annotations"]["registry"],
        "other.local"
    );
    // Without it, the Fail rule denies, naming the ConfigMap.
    let out = initium_stdin(&args, objects(None).as_bytes());
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains(
            "Pod shop/web: denied: MutationRule shop/mirror (failurePolicy Fail) failed: spec.lookups[0]: ConfigMap shop/registry (lookup \"mirror\") does not exist: create it, or change the lookup"
        ),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_fail_rule_that_fails_makes_apply_exit_non_zero() {
    let rules = r#"
apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: strict}
spec:
  failurePolicy: Fail
  match: {kinds: [Pod]}
  mutations: [{patch: [{op: replace, path: /spec/nodeName, value: x}]}]
"#;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rules.yaml"), rules).unwrap();
    let rules_path = dir.path().join("rules.yaml");
    let out = initium(&[
        "apply",
        "-r",
        rules_path.to_str().unwrap(),
        "-f",
        "examples/registry-mirror/objects.yaml",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), "", "no partial output");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("Pod default/mixed: denied: ClusterMutationRule strict (failurePolicy Fail) failed: spec.mutations[0]: patch[0] replace /spec/nodeName:"),
        "{stderr}"
    );
    assert!(
        stderr.contains("Pod default/private-only: denied:"),
        "every denied object is listed: {stderr}"
    );
}

#[test]
fn bad_input_gets_a_clear_error_and_never_a_panic() {
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated yaml",
            b"apiVersion: v1\nkind: Pod\nmetadata: {name: [x".to_vec(),
            "invalid YAML",
        ),
        (
            "truncated json",
            br#"{"apiVersion": "v1", "kind": "Pod", "metadata": {"#.to_vec(),
            "invalid JSON",
        ),
        ("scalar document", b"42\n".to_vec(), "expected an object"),
        (
            "no kind",
            b"apiVersion: v1\nmetadata: {name: x}\n".to_vec(),
            "missing kind",
        ),
        (
            "metadata not an object",
            b"apiVersion: v1\nkind: Pod\nmetadata: 5\n".to_vec(),
            "metadata must be an object",
        ),
        ("not utf-8", vec![0xff, 0xfe, 0x00, 0x41], "not UTF-8"),
        (
            "deep yaml",
            format!("a: {}1{}\n", "[".repeat(5000), "]".repeat(5000)).into_bytes(),
            "<stdin>",
        ),
        (
            "deep json",
            format!("{{\"a\": {}1{}}}", "[".repeat(5000), "]".repeat(5000)).into_bytes(),
            "invalid JSON",
        ),
        (
            "nested past the limit",
            format!(
                "{{\"apiVersion\": \"v1\", \"kind\": \"Pod\", \"a\": {}1{}}}",
                "[".repeat(120),
                "]".repeat(120)
            )
            .into_bytes(),
            "nested deeper than 100 levels",
        ),
    ];
    for (what, input, want) in cases {
        let out = initium_stdin(
            &["apply", "-r", "examples/test-ca/rules.yaml", "-f", "-"],
            &input,
        );
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
        assert!(stderr.starts_with("error: <stdin>"), "{what}: {stderr}");
        assert!(stderr.contains(want), "{what}: {stderr}");
        assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    }
}

#[test]
fn wrong_types_in_rules_are_errors_with_paths() {
    let cases = [
        (
            "spec: 5",
            "spec: invalid type: integer `5`, expected struct RuleSpec",
        ),
        (
            "spec: {match: Pod, mutations: []}",
            "spec.match: invalid type: string \"Pod\", expected struct MatchResources",
        ),
        (
            "spec: {match: {kinds: [Pod]}, mutations: x}",
            "spec.mutations: invalid type: string \"x\", expected a sequence",
        ),
        (
            "spec: {match: {kinds: Pod}, mutations: [{merge: {}}]}",
            "spec.match.kinds: invalid type: string \"Pod\", expected a sequence",
        ),
        (
            "spec: {match: {kinds: [Pod]}, mutations: [{merge: 3}]}",
            "spec.mutations[0].merge: a merge patch must be an object, not a number",
        ),
        (
            "spec: {match: {kinds: [Pod]}, failurePolicy: Sometimes, mutations: [{merge: {}}]}",
            "spec.failurePolicy: unknown variant `Sometimes`, expected `Ignore` or `Fail`",
        ),
        (
            "spec: {match: {kinds: [Pod], operations: [DELETE]}, mutations: [{merge: {}}]}",
            "spec.match.operations[0]: unknown variant `DELETE`, expected `CREATE` or `UPDATE`",
        ),
        (
            "spec: {match: {kinds: [Pod]}, mutations: [{upsert: {path: /a, key: name, value: {nom: x}}}]}",
            "spec.mutations[0].upsert.value: has no key field \"name\"",
        ),
        (
            "spec: {match: {kinds: [Pod]}, exclude: {}, mutations: [{merge: {}}]}",
            "spec.exclude: an empty exclude would skip every object",
        ),
        (
            "spec: {match: {}, mutations: [{merge: {}}]}",
            "spec.match.kinds: list at least one kind",
        ),
        (
            "metadata: {name: x, namespace: other}\nspec: {match: {kinds: [Pod]}, mutations: [{merge: {}}]}",
            "metadata.namespace: a ClusterMutationRule is cluster-scoped",
        ),
        (
            "metadata: {name: Bad_Name}\nspec: {match: {kinds: [Pod]}, mutations: [{merge: {}}]}",
            "metadata.name: \"Bad_Name\" is not a valid name",
        ),
    ];
    for (body, want) in cases {
        let metadata = if body.starts_with("metadata") {
            ""
        } else {
            "metadata: {name: r}\n"
        };
        let doc = format!(
            "apiVersion: initium.dev/v1alpha1\nkind: ClusterMutationRule\n{metadata}{body}\n"
        );
        let out = initium_stdin(&["check", "-r", "-"], doc.as_bytes());
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{body}: {stderr}");
        assert!(stderr.contains(want), "{body}:\n{stderr}");
    }
}

#[test]
fn truncated_examples_never_panic() {
    // Every prefix of every example file (at a stride) either loads or gives an error.
    for name in examples() {
        for file in ["rules.yaml", "objects.yaml"] {
            let path = Path::new("examples").join(&name).join(file);
            let full = std::fs::read_to_string(root().join(&path)).unwrap();
            for cut in (0..full.len()).step_by(7) {
                let prefix = &full[..cut];
                if let Ok(docs) = initium::cli::input::parse_documents("t", prefix) {
                    for doc in docs {
                        let _ = initium::engine::compile_document(&doc.value, "default");
                    }
                }
            }
        }
    }
}

#[test]
fn huge_inputs_are_refused_before_reading_them_whole() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.yaml");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(initium::cli::input::MAX_INPUT_BYTES + 1).unwrap();
    let out = initium(&["check", "-r", big.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("larger than 64 MiB"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn crd_prints_both_crds() {
    let out = initium(&["crd"]);
    assert!(out.status.success());
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text(&out.stdout)).unwrap();
    let names: Vec<&str> = docs
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "mutationrules.initium.dev",
            "clustermutationrules.initium.dev"
        ]
    );
}

#[test]
fn every_examples_patch_turns_its_input_into_its_output() {
    use initium::cli::input::read_documents;
    use initium::cli::offline::{Admitted, admit, load_rules, lookup_store, namespace_labels};
    for name in examples() {
        let dir = root().join("examples").join(&name);
        let rules = load_rules(&[dir.join("rules.yaml")], "default").unwrap();
        let docs = read_documents(&[dir.join("objects.yaml")]).unwrap();
        let namespaces = namespace_labels(&docs);
        let lookups = lookup_store(&rules.index, &docs, "default");
        for doc in &docs {
            let Admitted::Ok(outcome) = admit(
                &rules.index,
                doc,
                initium::api::Operation::Create,
                "default",
                &namespaces,
                &lookups,
            )
            .unwrap() else {
                panic!("{name}: {} denied", doc.origin);
            };
            let mut patched = doc.value.clone();
            json_patch::patch(&mut patched, &outcome.patch())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(patched, outcome.object, "{name}: {}", doc.origin);
            let mut written = Vec::new();
            outcome.write_patch(&mut written).unwrap();
            let reparsed: json_patch::Patch = serde_json::from_slice(&written).unwrap();
            assert_eq!(
                reparsed,
                outcome.patch(),
                "{name}: the written patch is the patch"
            );
        }
    }
}

#[test]
fn check_refuses_templates_where_they_cannot_work_and_function_calls_that_cannot_run() {
    // `{{ }}` in a path, a key field or a forEach was once taken literally; whatever
    // `check` accepts must work.
    let out = initium(&["check", "-r", "tests/data/invalid-templates.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let f = "(tests/data/invalid-templates.yaml";
    let want = [
        format!(
            "ClusterMutationRule templated-paths {f}#1): spec.mutations[0].patch[0].path: templates are not allowed in patch[0].path: a path is fixed when the rule is compiled; to change places the object chooses, select them with forEach, and to name a key after a value, template a key of a merge or patch value"
        ),
        format!(
            "ClusterMutationRule templated-paths {f}#1): spec.mutations[0].patch[1].from: templates are not allowed in patch[1].from: a path is fixed when the rule is compiled; to change places the object chooses, select them with forEach, and to name a key after a value, template a key of a merge or patch value"
        ),
        format!(
            "ClusterMutationRule templated-paths {f}#1): spec.mutations[1].upsert.path: templates are not allowed in upsert.path: a path is fixed when the rule is compiled; to change places the object chooses, select them with forEach, and to name a key after a value, template a key of a merge or patch value"
        ),
        format!(
            "ClusterMutationRule templated-paths {f}#1): spec.mutations[1].upsert.key: templates are not allowed in upsert.key: the key field is fixed when the rule is compiled (its value in upsert.value may be a template)"
        ),
        format!(
            "ClusterMutationRule templated-paths {f}#1): spec.mutations[2].rewrite.path: templates are not allowed in rewrite.path: a path is fixed when the rule is compiled; to change places the object chooses, select them with forEach, and to name a key after a value, template a key of a merge or patch value"
        ),
        format!(
            "ClusterMutationRule templated-paths {f}#1): spec.mutations[3].forEach: templates are not allowed in forEach: the JSONPath is fixed when the rule is compiled; it can choose elements by their content with a filter, like $.spec.containers[?@.name == 'app']"
        ),
        format!(
            "ClusterMutationRule bad-calls {f}#2): spec.mutations[0].merge (at /metadata/labels/a): template {{{{ lowercase($.metadata.name) }}}}: there is no function lowercase(); the functions are base64Decode(s), base64Encode(s), default(value, fallback), fromJson(s), image(s), join(separator, list), lower(s), replace(s, 'regex', replacement), sha256(s), split(s, separator), toJson(value), trim(s), trimPrefix(s, prefix), trimSuffix(s, suffix), upper(s)"
        ),
        format!(
            "ClusterMutationRule bad-calls {f}#2): spec.mutations[1].mutations[0].merge (at /metadata/annotations/x~1{{{{ join(@.name) }}}}): template {{{{ join(@.name) }}}}: join() takes 2 arguments, as in join(separator, list); it was given 1"
        ),
        format!(
            "ClusterMutationRule bad-calls {f}#2): spec.mutations[1].mutations[1].patch[0].value: template {{{{ replace(@.image, @.name, 'x') }}}}: the regular expression of replace() must be a quoted string, replace(s, '^a(.*)$', 'b$1'), so that it is compiled once with the rule"
        ),
        format!(
            "ClusterMutationRule bad-calls {f}#2): spec.mutations[2].upsert.value (at /name): template {{{{ replace($.metadata.name, '\\w{{20}}\\w{{20}}\\w{{20}}\\w{{20}}', '') }}}}: replace(): regular expression \"\\\\w{{20}}\\\\w{{20}}\\\\w{{20}}\\\\w{{20}}\" is too large once compiled (over 1 MiB; a rule's regular expressions share 4 MiB): simplify it, for example [a-zA-Z0-9_] instead of \\w, which matches every Unicode letter and digit, or fewer repetitions"
        ),
    ];
    assert_eq!(
        stderr.lines().next(),
        Some("error: 10 error(s) in 2 rule(s):")
    );
    let lines: Vec<&str> = stderr.lines().skip(1).collect();
    assert_eq!(lines, want.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        !stderr.contains("good-calls"),
        "the valid rule is not reported"
    );
}

#[test]
fn explain_says_per_rule_what_it_did_or_which_field_ruled_the_object_out() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("initium-explain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = dir.join("rules.yaml");
    std::fs::write(
        &rules,
        r#"apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: web-only}
spec:
  priority: 10
  match: {kinds: [Pod], labels: {matchLabels: {app: web}}}
  mutations: [{merge: {metadata: {labels: {team: shop}}}}]
---
apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: nginx-only}
spec:
  match: {kinds: [Pod]}
  conditions: [{path: "$.spec.containers[*].image", matches: "^nginx"}]
  mutations: [{merge: {metadata: {labels: {web: nginx}}}}]
---
apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: everyone}
spec:
  match: {kinds: [Pod]}
  mutations: [{merge: {metadata: {labels: {seen: "yes"}}}}]
---
apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {name: theirs, namespace: payments}
spec:
  match: {kinds: [Pod]}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]
---
apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: deployments}
spec:
  match: {kinds: [Deployment]}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]
---
apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: strict}
spec:
  priority: 200
  failurePolicy: Fail
  match: {kinds: [Pod]}
  mutations: [{patch: [{op: replace, path: /spec/nothing, value: 1}]}]
---
apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: last}
spec:
  priority: 300
  match: {kinds: [Pod]}
  mutations: [{merge: {metadata: {labels: {last: "yes"}}}}]
"#,
    )
    .unwrap();
    let out = initium(&[
        "explain",
        "-r",
        rules.to_str().unwrap(),
        "examples/audit-mode/rules.yaml",
        "-f",
        "examples/audit-mode/objects.yaml",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let want = [
        "Pod shop/web (examples/audit-mode/objects.yaml)",
        "  ClusterMutationRule web-only (priority 10): not matched: spec.match.labels does not hold",
        "      spec.match.labels: {\"matchLabels\":{\"app\":\"web\"}}",
        "  ClusterMutationRule everyone (priority 100): changed the object:",
        "      {\"op\":\"add\",\"path\":\"/metadata/labels\",\"value\":{\"seen\":\"yes\"}}",
        "  ClusterMutationRule nginx-only (priority 100): not matched: spec.conditions[0] does not hold",
        "      spec.conditions[0]: {\"matches\":\"^nginx\",\"path\":\"$.spec.containers[*].image\"}",
        "  MutationRule payments/theirs (priority 100): not a candidate: a MutationRule applies only to namespaced objects of its own namespace (payments)",
        "  MutationRule shop/default-resources (priority 100): mode Audit, would change the object (not kept):",
        "      {\"op\":\"add\",\"path\":\"/spec/containers/0/resources\",\"value\":{\"requests\":{\"cpu\":\"100m\",\"memory\":\"128Mi\"}}}",
        "  ClusterMutationRule strict (priority 200): failed and rejects the object (failurePolicy Fail): spec.mutations[0]: patch[0] replace /spec/nothing: there is no member at the path to replace; `add` sets a member whether it is there or not",
        "  ClusterMutationRule last (priority 300): not run: a rule before it rejected the object",
        "  1 rule(s) for other kinds: ClusterMutationRule deployments (--all lists them)",
    ];
    assert_eq!(stdout.lines().collect::<Vec<_>>(), want, "{stdout}");

    let all = initium(&[
        "explain",
        "--all",
        "-r",
        rules.to_str().unwrap(),
        "-f",
        "examples/audit-mode/objects.yaml",
    ]);
    assert!(
        text(&all.stdout).contains(
            "  ClusterMutationRule deployments (priority 100): not matched: spec.match.kinds does not hold"
        ),
        "{}",
        text(&all.stdout)
    );
    // Without rules or --cluster there is nothing to explain against: clap says so.
    let none = initium(&["explain", "-f", "examples/audit-mode/objects.yaml"]);
    assert!(!none.status.success());
    assert!(
        text(&none.stderr).contains("--rules"),
        "{}",
        text(&none.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_compile_shows_how_each_rule_would_be_served_and_the_generated_policies() {
    let out = initium(&["check", "--compile", "-r", "examples/sidecar/rules.yaml"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("# ClusterMutationRule envoy-sidecar: served by the API server (MutatingAdmissionPolicy initium.cmr.envoy-sidecar)"),
        "{stdout}"
    );
    assert!(stdout.contains("# 2 of 2 rule(s) compile"), "{stdout}");
    // What follows the comments is YAML kubectl applies: two policies, two bindings.
    let docs: Vec<serde_json::Value> = stdout
        .split("\n---\n")
        .skip(1)
        .map(|d| serde_saphyr::from_str(d).unwrap())
        .collect();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "MutatingAdmissionPolicy",
            "MutatingAdmissionPolicyBinding",
            "MutatingAdmissionPolicy",
            "MutatingAdmissionPolicyBinding"
        ]
    );
    assert_eq!(docs[0]["spec"]["reinvocationPolicy"], "Never");

    let out = initium(&[
        "check",
        "--compile",
        "-r",
        "examples/registry-mirror/rules.yaml",
        "-r",
        "examples/test-ca/rules.yaml",
    ]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(
            "# ClusterMutationRule docker-hub-mirror: served by the webhook: spec.conditions[0]:"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "# MutationRule payments/test-certs: served by the webhook: spec.priority: ClusterMutationRule docker-hub-mirror comes before it"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("# 0 of 2 rule(s) compile"), "{stdout}");
    assert!(
        !stdout.contains("kind: MutatingAdmissionPolicy"),
        "{stdout}"
    );
}

#[test]
fn explain_compile_says_under_each_rule_how_it_would_be_served() {
    let out = initium(&[
        "explain",
        "--compile",
        "-r",
        "examples/default-labels/rules.yaml",
        "-r",
        "examples/sidecar/rules.yaml",
        "-f",
        "examples/sidecar/objects.yaml",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(
            "served by the API server: MutatingAdmissionPolicy initium.cmr.default-team-label"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("served by the webhook: spec.priority: ClusterMutationRule default-team-label comes before it and may act on the same objects"),
        "{stdout}"
    );
    assert!(
        stdout.contains("name: initium.cmr.default-team-label"),
        "{stdout}"
    );
}

/// Writes `files` (name, text) into a fresh directory of this test and returns it.
fn scratch(test: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("initium-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, content) in files {
        std::fs::write(dir.join(name), content).unwrap();
    }
    dir
}

const NAMESPACE_LABEL_RULE: &str = r#"apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: ns-label}
spec:
  match: {kinds: [ConfigMap]}
  mutations:
    - merge: {metadata: {labels: {ns: "{{ $.metadata.namespace }}"}}}
"#;

#[test]
fn explain_apply_and_test_agree_on_an_object_without_a_namespace() {
    let dir = scratch(
        "no-namespace",
        &[
            ("rules.yaml", NAMESPACE_LABEL_RULE),
            (
                "objects.yaml",
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n",
            ),
            (
                "expected.yaml",
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c, labels: {ns: team-a}, annotations: {initium.dev/mutated-by: ns-label}}\ndata: {a: b}\n",
            ),
            (
                "initium-test.yaml",
                "apiVersion: initium.dev/v1alpha1\nkind: RuleTest\nmetadata: {name: t}\nrules: [rules.yaml]\nnamespace: team-a\ncases:\n  - name: no namespace\n    objects: [objects.yaml]\n    expected: [expected.yaml]\n",
            ),
        ],
    );
    let rules = dir.join("rules.yaml");
    let objects = dir.join("objects.yaml");
    let (rules, objects) = (rules.to_str().unwrap(), objects.to_str().unwrap());
    let apply = initium(&[
        "apply", "-n", "team-a", "-r", rules, "-f", objects, "-o", "json",
    ]);
    assert!(apply.status.success(), "{}", text(&apply.stderr));
    assert!(
        text(&apply.stdout).contains("\"ns\": \"team-a\""),
        "{}",
        text(&apply.stdout)
    );
    let explain = initium(&["explain", "-n", "team-a", "-r", rules, "-f", objects]);
    assert!(explain.status.success(), "{}", text(&explain.stderr));
    assert_eq!(
        text(&explain.stdout),
        "ConfigMap c (".to_string()
            + objects
            + ")\n  ClusterMutationRule ns-label (priority 100): changed the object:\n      \
               {\"op\":\"add\",\"path\":\"/metadata/labels\",\"value\":{\"ns\":\"team-a\"}}\n"
    );
    let test = initium(&["test", dir.to_str().unwrap()]);
    assert!(
        test.status.success(),
        "{}{}",
        text(&test.stdout),
        text(&test.stderr)
    );
}

#[test]
fn explain_says_an_object_is_excluded_and_which_list_elements_were_removed() {
    let dir = scratch(
        "explain-wording",
        &[
            (
                "rules.yaml",
                r#"apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: drop-x}
spec:
  match: {kinds: [Pod]}
  exclude: {names: ["debug-*"]}
  mutations:
    - remove: {path: /spec/tolerations, where: [{path: "@.key", matches: "^x"}]}
"#,
            ),
            (
                "objects.yaml",
                r#"apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop}
spec:
  containers: [{name: a, image: nginx}]
  tolerations: [{key: x1}, {key: "y"}, {key: x2}, {key: z}]
---
apiVersion: v1
kind: Pod
metadata: {name: debug-1, namespace: shop}
spec:
  containers: [{name: a, image: nginx}]
"#,
            ),
        ],
    );
    let out = initium(&[
        "explain",
        "-r",
        dir.join("rules.yaml").to_str().unwrap(),
        "-f",
        dir.join("objects.yaml").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().skip(1).collect();
    assert_eq!(
        lines,
        [
            "  ClusterMutationRule drop-x (priority 100): changed the object:",
            "      removed elements 0 and 2 of /spec/tolerations",
            lines[2],
            "  ClusterMutationRule drop-x (priority 100): not matched: the object is excluded by spec.exclude",
            "      spec.exclude: {\"names\":[\"debug-*\"]}",
        ],
        "{stdout}"
    );
}

#[test]
fn check_refuses_what_the_api_server_or_the_engine_would_refuse_later_and_says_what_to_do() {
    let rule = |name: &str, rest: &str| {
        format!(
            "apiVersion: initium.dev/v1alpha1\nkind: ClusterMutationRule\nmetadata: {{name: {name}}}\nspec:\n  match: {{kinds: [Pod]}}\n{rest}"
        )
    };
    let cases = [
        (
            rule(
                "backup",
                "  mutations:\n    - merge: {metadata: {labels: {backup: yes}}}\n",
            ),
            "spec.mutations[0].merge.metadata.labels.backup: a label or annotation value must be a string, not a boolean (unquoted, YAML reads yes, no, on, off, true, false and numbers as such): quote it",
        ),
        (
            rule(
                "last",
                "  mutations:\n    - patch: [{op: add, path: /spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms/-1/matchExpressions/-, value: {key: a, operator: Exists}}]\n",
            ),
            "spec.mutations[0].patch[0].path: \"-1\" is not a list index: JSON pointers count list elements from 0 and have no negative indexes; write `-` to add at the end of a list, or the element's index (a key that looks like a negative number can be set with `merge`)",
        ),
        (
            rule(
                "any-in",
                "  conditions: [{path: $.metadata.name, in: [a, b]}]\n  mutations:\n    - merge: {metadata: {labels: {a: b}}}\n",
            ),
            "spec.conditions[0].in: `in` takes a JSONPath query whose selected values the path's value must be among, not a list; to test against fixed values write `matches: '^(a|b)$'`",
        ),
        (
            rule(
                "computed",
                "  lookups: [{name: d, configMap: {name: images}}]\n  mutations:\n    - merge: {metadata: {labels: {a: \"{{ lookups.d.data[@.image] }}\"}}}\n",
            ),
            "spec.mutations[0].merge (at /metadata/labels/a): template {{ lookups.d.data[@.image] }}: lookups.d.data[@.image] names a member by a computed key, which is not supported (expected selector): name the key, as in lookups.d.data.key",
        ),
    ];
    for (i, (rule, want)) in cases.iter().enumerate() {
        let dir = scratch(&format!("check-{i}"), &[("rule.yaml", rule)]);
        let out = initium(&["check", "-r", dir.join("rule.yaml").to_str().unwrap()]);
        assert!(!out.status.success(), "{rule}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains(want), "{want}\nnot in:\n{stderr}");
    }
}

#[test]
fn a_test_case_missing_expected_objects_names_them() {
    let dir = scratch(
        "test-missing",
        &[
            ("rules.yaml", NAMESPACE_LABEL_RULE),
            (
                "objects.yaml",
                "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c, namespace: shop}\n",
            ),
            (
                "expected.yaml",
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c, namespace: shop, labels: {ns: shop}, annotations: {initium.dev/mutated-by: ns-label}}\n",
            ),
            (
                "initium-test.yaml",
                "apiVersion: initium.dev/v1alpha1\nkind: RuleTest\nmetadata: {name: t}\nrules: [rules.yaml]\ncases:\n  - name: short\n    objects: [objects.yaml]\n    expected: [expected.yaml]\n",
            ),
        ],
    );
    let out = initium(&["test", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("2 input object(s) but 1 expected object(s); no expected object for Namespace shop: list every input object under expected (the ConfigMaps and Namespaces the rules read too), each as the rules leave it"),
        "{stdout}"
    );
}
