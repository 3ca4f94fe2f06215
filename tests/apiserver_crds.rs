//! The CRDs and rules on a real kube-apiserver (see docs/control-plane.md): `crds/` is
//! accepted, the examples apply, `kubectl get` and `kubectl explain` show what crates/engine/src/api.rs
//! promises, bad rules are rejected with readable messages, status is written only through the
//! status subresource, and `null` in merge patches survives a round trip (RFC 7396 deletes with
//! it).
//!
//! All tests share one control plane (per test binary) and install the CRDs once; each test
//! uses its own namespace or unique names.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use initium::api::{ClusterMutationRule, MutationRule, RuleStatus};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

/// How long to wait for the API server to catch up (CRD establishment, discovery, OpenAPI).
const TIMEOUT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// kubectl helpers

/// One finished kubectl run; `Display` shows the command and everything it printed.
struct Run {
    args: Vec<String>,
    output: Output,
}

impl Run {
    fn ok(&self) -> bool {
        self.output.status.success()
    }
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }
    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }
}

impl fmt::Display for Run {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`kubectl {}` ({})\n--- stdout\n{}\n--- stderr\n{}",
            self.args.join(" "),
            self.output.status,
            self.stdout(),
            self.stderr()
        )
    }
}

fn kubectl(args: &[&str]) -> Run {
    kubectl_with_stdin(args, None)
}

/// Runs kubectl with `stdin` as its standard input (for `-f -`).
fn kubectl_with_stdin(args: &[&str], stdin: Option<&str>) -> Run {
    let output = support::Plane::shared()
        .kubectl_stdin(args, stdin.unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e:#}"));
    Run {
        args: args.iter().map(|a| a.to_string()).collect(),
        output,
    }
}

/// Runs kubectl and panics with its output unless it succeeds; returns stdout.
fn kubectl_ok(args: &[&str]) -> String {
    let run = kubectl(args);
    assert!(run.ok(), "{run}");
    run.stdout()
}

use support::{eventually_blocking, install_crds, unique};

/// Collapses all whitespace to single spaces (kubectl wraps long text).
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

// ---------------------------------------------------------------------------------------------
// 1. CRDs

#[tokio::test]
async fn crds_are_accepted_and_established() {
    // Every structural-schema and CEL problem shows up here, with the API server's message.
    install_crds();

    let client = support::client().await;
    let api = Api::<CustomResourceDefinition>::all(client);
    for (name, short_name, scope) in [
        ("mutationrules.initium.dev", "mr", "Namespaced"),
        ("clustermutationrules.initium.dev", "cmr", "Cluster"),
    ] {
        let crd = api
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("get CRD {name}: {e}"));
        let status = crd.status.as_ref().expect("CRD has a status");
        let conditions = status.conditions.as_deref().unwrap_or_default();
        for wanted in ["Established", "NamesAccepted"] {
            assert!(
                conditions
                    .iter()
                    .any(|c| c.type_ == wanted && c.status == "True"),
                "CRD {name}: condition {wanted} is not True: {conditions:#?}"
            );
        }
        let accepted = status.accepted_names.as_ref().expect("accepted names");
        assert_eq!(
            accepted.short_names.as_deref(),
            Some(&[short_name.to_string()][..]),
            "CRD {name}: short names"
        );
        assert_eq!(
            accepted.categories.as_deref(),
            Some(&["initium".to_string()][..]),
            "CRD {name}: categories"
        );
        assert_eq!(crd.spec.scope, scope, "CRD {name}: scope");
    }

    // What a user sees: both kinds are served, with their short names and scopes.
    let expected_rows = [
        [
            "clustermutationrules",
            "cmr",
            "initium.dev/v1alpha1",
            "false",
            "ClusterMutationRule",
        ],
        [
            "mutationrules",
            "mr",
            "initium.dev/v1alpha1",
            "true",
            "MutationRule",
        ],
    ];
    eventually_blocking("discovery to list initium.dev", TIMEOUT, || {
        let run = kubectl(&["api-resources", "--api-group=initium.dev", "--no-headers"]);
        let rows: Vec<Vec<String>> = run
            .stdout()
            .lines()
            .map(|l| l.split_whitespace().map(str::to_owned).collect())
            .collect();
        if run.ok() && rows == expected_rows {
            Ok(())
        } else {
            Err(format!("expected rows {expected_rows:?}\n{run}"))
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 2. Examples

/// A table printed by `kubectl get`, cells cut at the header's column offsets (cells may be
/// empty, e.g. NAMESPACE of a cluster-scoped object or READY before any status).
#[derive(Debug)]
struct Table {
    header: Vec<String>,
    rows: Vec<BTreeMap<String, String>>,
}

/// Parses `kubectl get` output; several resource types give several tables separated by an
/// empty line.
fn parse_tables(text: &str) -> Vec<Table> {
    let mut tables = Vec::new();
    let mut columns: Vec<(usize, String)> = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            columns.clear();
            continue;
        }
        if columns.is_empty() {
            let mut start = None;
            for (i, c) in line.char_indices().chain([(line.len(), ' ')]) {
                match (c == ' ', start) {
                    (false, None) => start = Some(i),
                    (true, Some(s)) => {
                        columns.push((s, line[s..i].to_string()));
                        start = None;
                    }
                    _ => {}
                }
            }
            tables.push(Table {
                header: columns.iter().map(|(_, name)| name.clone()).collect(),
                rows: Vec::new(),
            });
            continue;
        }
        let row = columns
            .iter()
            .enumerate()
            .map(|(i, (start, name))| {
                let end = columns.get(i + 1).map_or(line.len(), |(next, _)| *next);
                let cell = line.get(*start..end.min(line.len())).unwrap_or("");
                (name.clone(), cell.trim().to_string())
            })
            .collect();
        tables.last_mut().expect("a header").rows.push(row);
    }
    tables
}

/// One rule from an example file, as `kubectl get` should show it.
#[derive(Debug)]
struct ExampleRule {
    /// `mutationrule.initium.dev/<name>` or `clustermutationrule.initium.dev/<name>`.
    resource_name: String,
    name: String,
    namespace: String,
    priority: String,
    kinds: String,
    /// `Enforce` (the default the schema fills in) or `Audit`.
    mode: String,
}

fn example_rule_files() -> Vec<PathBuf> {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&examples)
        .expect("read examples/")
        .map(|entry| entry.expect("examples/ entry").path().join("rules.yaml"))
        .filter(|path| path.exists())
        .collect();
    files.sort();
    files
}

fn example_rules(file: &Path) -> Vec<ExampleRule> {
    let text = std::fs::read_to_string(file).expect("read example rules");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
        .unwrap_or_else(|e| panic!("{} is not YAML: {e}", file.display()));
    docs.iter()
        .filter(|doc| !doc.is_null())
        .map(|doc| {
            let kind = doc["kind"].as_str().expect("kind");
            let name = doc["metadata"]["name"].as_str().expect("metadata.name");
            ExampleRule {
                resource_name: format!("{}.initium.dev/{name}", kind.to_ascii_lowercase()),
                name: name.to_string(),
                namespace: doc["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                priority: doc["spec"]["priority"].as_i64().unwrap_or(100).to_string(),
                kinds: serde_json::to_string(&doc["spec"]["match"]["kinds"]).unwrap(),
                mode: doc["spec"]["mode"]
                    .as_str()
                    .unwrap_or("Enforce")
                    .to_string(),
            }
        })
        .collect()
}

/// Deletes what the given files created, even when the test fails.
struct DeleteOnDrop(Vec<PathBuf>);

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        for file in &self.0 {
            let run = kubectl(&[
                "delete",
                "--ignore-not-found",
                "--wait=false",
                "-f",
                file.to_str().expect("UTF-8 path"),
            ]);
            if !run.ok() {
                eprintln!("cleanup failed: {run}");
            }
        }
    }
}

#[test]
fn example_rules_apply_and_kubectl_get_shows_them_with_printer_columns() {
    install_crds();
    let files = example_rule_files();
    assert!(!files.is_empty(), "no examples/*/rules.yaml found");
    let _cleanup = DeleteOnDrop(files.clone());

    let mut rules = Vec::new();
    for file in &files {
        let file_rules = example_rules(file);
        // MutationRules carry their namespace (e.g. `payments`): make sure it exists.
        for namespace in file_rules.iter().map(|r| &r.namespace) {
            if !namespace.is_empty() {
                let manifest =
                    format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n");
                let run = kubectl_with_stdin(&["apply", "-f", "-"], Some(&manifest));
                assert!(run.ok(), "create namespace {namespace}: {run}");
            }
        }
        let apply = kubectl(&["apply", "-f", file.to_str().expect("UTF-8 path")]);
        assert!(apply.ok(), "{} does not apply: {apply}", file.display());
        rules.extend(file_rules);
    }
    assert!(
        rules
            .iter()
            .any(|r| r.resource_name.starts_with("mutationrule."))
            && rules
                .iter()
                .any(|r| r.resource_name.starts_with("clustermutationrule.")),
        "the examples should hold both kinds of rule: {rules:#?}"
    );

    // `kubectl get mr,cmr -A`: one table per kind, both with the printer columns.
    let all = kubectl_ok(&["get", "mr,cmr", "-A"]);
    let tables = parse_tables(&all);
    assert_eq!(tables.len(), 2, "one table per kind:\n{all}");
    for table in &tables {
        assert_eq!(
            table.header,
            [
                "NAMESPACE",
                "NAME",
                "PRIORITY",
                "KINDS",
                "MODE",
                "READY",
                "AGE"
            ],
            "header of `kubectl get mr,cmr -A`:\n{all}"
        );
    }
    for rule in &rules {
        let row = tables
            .iter()
            .flat_map(|t| &t.rows)
            .find(|row| row["NAME"] == rule.resource_name)
            .unwrap_or_else(|| panic!("{} is not listed:\n{all}", rule.resource_name));
        assert_eq!(row["NAMESPACE"], rule.namespace, "{rule:?}\n{all}");
        assert_eq!(row["PRIORITY"], rule.priority, "{rule:?}\n{all}");
        assert_eq!(row["KINDS"], rule.kinds, "{rule:?}\n{all}");
        assert_eq!(row["MODE"], rule.mode, "{rule:?}\n{all}");
    }

    // `-o name` lists every rule.
    let names = kubectl_ok(&["get", "mr,cmr", "-A", "-o", "name"]);
    for rule in &rules {
        assert!(
            names.lines().any(|l| l == rule.resource_name),
            "{} missing from `kubectl get mr,cmr -A -o name`:\n{names}",
            rule.resource_name
        );
    }

    // `kubectl get cmr` (cluster-scoped: no NAMESPACE column) lists the ClusterMutationRules.
    let cmr = kubectl_ok(&["get", "cmr"]);
    let tables = parse_tables(&cmr);
    assert_eq!(tables.len(), 1, "{cmr}");
    assert_eq!(
        tables[0].header,
        ["NAME", "PRIORITY", "KINDS", "MODE", "READY", "AGE"],
        "header of `kubectl get cmr`:\n{cmr}"
    );
    for rule in rules.iter().filter(|r| r.namespace.is_empty()) {
        assert!(
            tables[0].rows.iter().any(|row| row["NAME"] == rule.name),
            "{} missing from `kubectl get cmr`:\n{cmr}",
            rule.name
        );
    }

    // The `initium` category finds both kinds.
    let category = kubectl_ok(&["get", "initium", "-A", "-o", "name"]);
    for rule in &rules {
        assert!(
            category.lines().any(|l| l == rule.resource_name),
            "{} missing from `kubectl get initium -A -o name`:\n{category}",
            rule.resource_name
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 3. kubectl explain

#[test]
fn kubectl_explain_shows_the_field_documentation() {
    install_crds();
    // Phrases from the doc comments in crates/engine/src/api.rs.
    let cases = [
        (
            "mutationrule",
            "MutationRule mutates matching objects of its own namespace while the API server admits them; namespace owners manage it with RBAC.",
        ),
        (
            "mutationrule.spec.mutations",
            "The mutations, applied in order; each sees the result of the previous one. Each sets one kind: `merge`, `patch`, `upsert`, `rewrite`, `defaults`, `remove`, or `forEach` (with `mutations`). A rule is atomic: if one mutation fails, none of the rule's changes are kept. May be empty only when the rule has a `gate`.",
        ),
        (
            "mutationrule.spec.mutations.merge",
            "RFC 7396 JSON merge patch applied to the object (in a `forEach`, to the element). `null` removes a field.",
        ),
        (
            "clustermutationrule.spec.match.kinds",
            "Kinds: `Kind`, `version/Kind` (core group, like `apiVersion: v1`) or `group/version/Kind`; any segment may be `*`. Required in `match`.",
        ),
        (
            "clustermutationrule.spec.failurePolicy",
            "`Ignore` (default) skips the rule with a warning to the client; `Fail` rejects the object.",
        ),
        (
            "cmr.spec.match.namespaces",
            "Globs on the object's namespace. ClusterMutationRule only.",
        ),
        (
            "mr.spec.conditions",
            "Conditions on the object's content (RFC 9535 JSONPath). All must hold.",
        ),
    ];
    for (field, phrase) in cases {
        // The OpenAPI document behind `explain` is published shortly after the CRD is
        // Established: wait for it.
        eventually_blocking(&format!("`kubectl explain {field}`"), TIMEOUT, || {
            let run = kubectl(&["explain", field]);
            if run.ok() && one_line(&run.stdout()).contains(phrase) {
                Ok(())
            } else {
                Err(format!("expected the phrase {phrase:?}\n{run}"))
            }
        });
    }
    // What `kubectl explain` prints of `spec.mutations` names every kind of mutation, and
    // lists each as a field.
    let run = kubectl(&["explain", "mutationrule.spec.mutations"]);
    let (description, fields) = run
        .stdout()
        .split_once("FIELDS:")
        .map(|(d, f)| (d.to_string(), f.to_string()))
        .unwrap_or_else(|| panic!("no FIELDS in {run}"));
    for kind in initium::api::MUTATION_KINDS {
        assert!(
            description.contains(&format!("`{kind}`")),
            "the description of spec.mutations does not name {kind}:\n{run}"
        );
        assert!(
            fields
                .lines()
                .any(|line| line.trim_start().starts_with(&format!("{kind}\t"))
                    || line.trim_start().starts_with(&format!("{kind} "))),
            "spec.mutations has no field {kind}:\n{run}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Rejected rules

/// A rule the API server must refuse: `manifest` (with `NAME` and `NAMESPACE` placeholders),
/// and phrases the error must contain.
struct Invalid {
    what: &'static str,
    manifest: &'static str,
    errors: &'static [&'static str],
}

const INVALID_RULES: &[Invalid] = &[
    Invalid {
        what: "MutationRule with match.namespaces",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {kinds: [Pod], namespaces: [team-a]}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &[
            "a MutationRule applies only to its own namespace: match.namespaces and match.namespaceSelector are for ClusterMutationRule",
        ],
    },
    Invalid {
        what: "MutationRule with match.namespaceSelector",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {kinds: [Pod], namespaceSelector: {matchLabels: {env: prod}}}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &[
            "a MutationRule applies only to its own namespace: match.namespaces and match.namespaceSelector are for ClusterMutationRule",
        ],
    },
    Invalid {
        what: "MutationRule with exclude.namespaces",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {kinds: [Pod]}
  exclude: {namespaces: [kube-system]}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &[
            "a MutationRule applies only to its own namespace: exclude.namespaces and exclude.namespaceSelector are for ClusterMutationRule",
        ],
    },
    Invalid {
        what: "mutation with both merge and patch",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {kinds: [Pod]}
  mutations:
    - merge: {metadata: {labels: {a: b}}}
    - merge: {metadata: {labels: {c: d}}}
      patch: [{op: remove, path: /metadata/labels/a}]",
        errors: &[
            "spec.mutations[1]",
            "set exactly one of merge, patch, upsert, rewrite, defaults, remove, forEach",
        ],
    },
    Invalid {
        what: "empty mutation",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: [Pod]}
  mutations: [{}]",
        errors: &[
            "spec.mutations[0]",
            "set exactly one of merge, patch, upsert, rewrite, defaults, remove, forEach",
        ],
    },
    Invalid {
        what: "forEach element mutation with both merge and rewrite",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: [Pod]}
  mutations:
    - forEach: '$.spec.containers[*]'
      mutations:
        - merge: {env: null}
          rewrite: {path: /image, regex: a, replacement: b}",
        errors: &[
            "spec.mutations[0].mutations[0]",
            "set exactly one of merge, patch, upsert, rewrite",
        ],
    },
    Invalid {
        what: "forEach without mutations",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: [Pod]}
  mutations: [{forEach: '$.spec.containers[*]'}]",
        errors: &["spec.mutations[0]", "forEach and mutations go together"],
    },
    Invalid {
        what: "condition with both matches and exists",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: [Pod]}
  conditions: [{path: '$.metadata.name', matches: '^web', exists: true}]
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        // CEL cannot see `equals` (free-form JSON), so the CRD counts properties instead.
        errors: &["spec.conditions[0]", "must have at most 2 items"],
    },
    Invalid {
        what: "empty match.kinds",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: []}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &["match.kinds must list at least one kind"],
    },
    Invalid {
        what: "match without kinds",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {names: ['web-*']}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &["match.kinds must list at least one kind"],
    },
    Invalid {
        what: "unknown failurePolicy",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  failurePolicy: Retry
  match: {kinds: [Pod]}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &[
            r#"spec.failurePolicy: Unsupported value: "Retry": supported values: "Ignore", "Fail""#,
        ],
    },
    Invalid {
        what: "unknown operation",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: [Pod], operations: [DELETE]}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &[
            r#"spec.match.operations[0]: Unsupported value: "DELETE": supported values: "CREATE", "UPDATE""#,
        ],
    },
    Invalid {
        what: "missing mutations",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {kinds: [Pod]}",
        errors: &["a rule needs at least one mutation, or a gate"],
    },
    Invalid {
        what: "empty mutations",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: [Pod]}
  mutations: []",
        errors: &["a rule needs at least one mutation, or a gate"],
    },
    Invalid {
        what: "misspelt field",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: [Pod]}
  mutation: [{merge: {metadata: {labels: {a: b}}}}]
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &[r#"unknown field "spec.mutation""#],
    },
    Invalid {
        what: "gate dependency with both service and job",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {kinds: [Pod]}
  mutations: [{merge: {metadata: {labels: {a: b}}}}]
  gate:
    waitFor: [{service: {name: db}, job: {name: db-init}}]",
        errors: &[
            "spec.gate.waitFor[0]",
            "set exactly one of service, job, pods, object, daemonSet",
        ],
    },
    Invalid {
        what: "two lookups of the same name",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {kinds: [Pod]}
  lookups: [{name: mirror, configMap: {name: a}}, {name: mirror, configMap: {name: b}}]
  mutations: [{merge: {metadata: {labels: {a: '{{ lookups.mirror.data.x }}'}}}}]",
        errors: &["lookup names must be unique within the rule"],
    },
    Invalid {
        what: "a lookup name templates cannot write, and a lookup of nothing",
        manifest: "
kind: ClusterMutationRule
metadata: {name: NAME}
spec:
  match: {kinds: [Pod]}
  lookups: [{name: my-mirror, configMap: {name: a}}, {name: b}]
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &[
            "spec.lookups[0].name",
            "should match '^[a-z][a-zA-Z0-9_]*$'",
            "spec.lookups[1]",
            "set exactly one of configMap",
        ],
    },
];

/// `kubectl apply --dry-run=server` and `kubectl apply` of `rule` both fail with its errors,
/// and nothing is stored. Returns a description of every way that did not hold.
fn check_rejected(rule: &Invalid, namespace: &str, name: &str) -> Vec<String> {
    let manifest = format!("apiVersion: initium.dev/v1alpha1{}\n", rule.manifest)
        .replace("NAMESPACE", namespace)
        .replace("NAME", name);
    let mut problems = Vec::new();
    for dry_run in [true, false] {
        let mut args = vec!["apply", "-f", "-"];
        if dry_run {
            args.push("--dry-run=server");
        }
        let run = kubectl_with_stdin(&args, Some(&manifest));
        let stderr = one_line(&run.stderr());
        let missing: Vec<_> = rule
            .errors
            .iter()
            .filter(|e| !stderr.contains(**e))
            .collect();
        if run.ok() || !missing.is_empty() {
            problems.push(format!(
                "{}: expected a rejection mentioning {missing:?}\n--- manifest\n{manifest}{run}",
                rule.what
            ));
        }
    }
    let resource = if manifest.contains("kind: MutationRule") {
        "mutationrule"
    } else {
        "clustermutationrule"
    };
    let get = kubectl(&[
        "get",
        resource,
        name,
        "-n",
        namespace,
        "--ignore-not-found",
        "-o",
        "name",
    ]);
    if !get.ok() || !get.stdout().trim().is_empty() {
        problems.push(format!("{}: the rule was stored: {get}", rule.what));
    }
    problems
}

#[tokio::test]
async fn invalid_rules_are_rejected_with_readable_messages() {
    install_crds();
    let namespace = support::namespace(&support::client().await, "invalid-rules").await;
    let problems: Vec<String> = INVALID_RULES
        .iter()
        .flat_map(|rule| check_rejected(rule, &namespace, &unique("invalid")))
        .collect();
    assert!(
        problems.is_empty(),
        "{} problem(s):\n\n{}",
        problems.len(),
        problems.join("\n\n")
    );
}

#[tokio::test]
async fn condition_without_matches_equals_or_exists_is_rejected() {
    install_crds();
    let namespace = support::namespace(&support::client().await, "invalid-condition").await;
    let name = unique("no-predicate");
    let rule = Invalid {
        what: "condition with none of matches, equals, exists",
        manifest: "
kind: MutationRule
metadata: {name: NAME, namespace: NAMESPACE}
spec:
  match: {kinds: [Pod]}
  conditions: [{path: '$.metadata.name'}]
  mutations: [{merge: {metadata: {labels: {a: b}}}}]",
        errors: &["spec.conditions[0]", "should have at least 2 properties"],
    };
    let problems = check_rejected(&rule, &namespace, &name);
    kubectl(&[
        "delete",
        "mutationrule",
        &name,
        "-n",
        &namespace,
        "--ignore-not-found",
    ]);
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

// ---------------------------------------------------------------------------------------------
// 5. Status subresource

fn ready_status(generation: i64, status: &str, message: &str) -> RuleStatus {
    serde_json::from_value(json!({
        "observedGeneration": generation,
        "conditions": [{
            "type": "Ready",
            "status": status,
            "reason": "Compiled",
            "message": message,
            "lastTransitionTime": "2025-06-01T12:00:00Z",
        }],
    }))
    .expect("a RuleStatus")
}

#[tokio::test]
async fn status_is_written_only_through_the_status_subresource() {
    install_crds();
    let client = support::client().await;
    let namespace = support::namespace(&client, "status").await;
    let api = Api::<MutationRule>::namespaced(client, &namespace);
    let name = "test-certs";
    let rule: MutationRule = serde_json::from_value(json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "match": {"kinds": ["Pod"]},
            "mutations": [{"merge": {"metadata": {"labels": {"certs": "injected"}}}}],
        },
    }))
    .expect("a MutationRule");
    let created = api
        .create(&PostParams::default(), &rule)
        .await
        .unwrap_or_else(|e| panic!("create MutationRule {name}: {e}"));
    assert_eq!(created.metadata.generation, Some(1));
    assert_eq!(created.status, None, "a new rule has no status");

    // Write status through /status, as initium's status writer does.
    let ready = ready_status(1, "True", "compiled 1 mutation");
    let patched = api
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": ready })),
        )
        .await
        .unwrap_or_else(|e| panic!("patch /status of {name}: {e}"));
    assert_eq!(patched.status.as_ref(), Some(&ready));
    let read = api.get(name).await.expect("get the rule");
    assert_eq!(read.status.as_ref(), Some(&ready), "status read back");
    assert_eq!(
        read.metadata.generation,
        Some(1),
        "a status write does not bump the generation"
    );

    // `kubectl get mr` shows it in the READY column.
    let shown = kubectl_ok(&["get", "mr", name, "-n", &namespace]);
    let tables = parse_tables(&shown);
    assert_eq!(tables.len(), 1, "{shown}");
    assert_eq!(
        tables[0].header,
        ["NAME", "PRIORITY", "KINDS", "MODE", "READY", "AGE"],
        "{shown}"
    );
    let row = &tables[0].rows[0];
    assert_eq!(row["NAME"], name, "{shown}");
    assert_eq!(row["PRIORITY"], "100", "{shown}");
    assert_eq!(row["KINDS"], r#"["Pod"]"#, "{shown}");
    assert_eq!(row["MODE"], "Enforce", "the schema's default: {shown}");
    assert_eq!(row["READY"], "True", "{shown}");

    // Through the main resource, status is ignored (spec and metadata changes still apply)...
    let not_ready = ready_status(7, "False", "written through the main resource");
    let patched = api
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"labels": {"touched": "yes"}},
                "spec": {"priority": 5},
                "status": not_ready,
            })),
        )
        .await
        .unwrap_or_else(|e| panic!("patch {name}: {e}"));
    assert_eq!(patched.spec.priority, 5, "the spec change applies");
    assert_eq!(
        patched.metadata.generation,
        Some(2),
        "a spec change bumps the generation"
    );
    assert_eq!(
        patched.status.as_ref(),
        Some(&ready),
        "a merge patch of the main resource must not change status"
    );
    let mut replacement = patched.clone();
    replacement.status = Some(not_ready.clone());
    let replaced = api
        .replace(name, &PostParams::default(), &replacement)
        .await
        .unwrap_or_else(|e| panic!("replace {name}: {e}"));
    assert_eq!(
        replaced.status.as_ref(),
        Some(&ready),
        "a PUT of the main resource must not change status"
    );

    // ...and through /status, spec is ignored.
    let patched = api
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"priority": 1}, "status": {"observedGeneration": 2}})),
        )
        .await
        .unwrap_or_else(|e| panic!("patch /status of {name}: {e}"));
    assert_eq!(patched.spec.priority, 5, "/status must not change the spec");
    assert_eq!(
        patched.status.as_ref().and_then(|s| s.observed_generation),
        Some(2)
    );
    assert_eq!(
        api.get(name).await.expect("get the rule").status,
        patched.status,
        "status read back"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. null in merge patches

/// A ClusterMutationRule whose merge patches (and other free-form JSON) contain `null`.
fn rule_with_nulls(name: &str) -> Value {
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "ClusterMutationRule",
        "metadata": {"name": name},
        "spec": {
            "match": {"kinds": ["Pod"]},
            "conditions": [
                {"path": "$.metadata.annotations", "equals": {"a": null, "b": [null, 1]}},
            ],
            "mutations": [
                {"merge": {"metadata": {"labels": {"x": null}}}},
                {"forEach": "$.spec.containers[*]", "mutations": [{"merge": {"env": null}}]},
                {"upsert": {"path": "/spec/volumes", "key": "name",
                            "value": {"name": "certs", "secret": null}}},
                {"patch": [{"op": "add", "path": "/metadata/annotations",
                            "value": {"a": null}}]},
            ],
        },
    })
}

fn cmr_resource() -> ApiResource {
    ApiResource::erase::<ClusterMutationRule>(&())
}

/// `spec.conditions` and `spec.mutations` of a stored rule, from `kubectl get -o json`.
fn stored_by_kubectl(name: &str) -> Value {
    let json = kubectl_ok(&["get", "clustermutationrule", name, "-o", "json"]);
    let stored: Value = serde_json::from_str(&json).expect("kubectl prints JSON");
    json!({"conditions": stored["spec"]["conditions"], "mutations": stored["spec"]["mutations"]})
}

fn sent(rule: &Value) -> Value {
    json!({"conditions": rule["spec"]["conditions"], "mutations": rule["spec"]["mutations"]})
}

#[tokio::test]
async fn nulls_in_merge_patches_survive_the_api_server() {
    install_crds();
    let client = support::client().await;
    let api = Api::<DynamicObject>::all_with(client.clone(), &cmr_resource());

    // POST (kube client, like `kubectl create`).
    let name = unique("nulls-post");
    let rule = rule_with_nulls(&name);
    let object: DynamicObject = serde_json::from_value(rule.clone()).expect("a DynamicObject");
    api.create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
    let stored = api.get(&name).await.expect("get the rule");
    let stored = json!({"conditions": stored.data["spec"]["conditions"],
                        "mutations": stored.data["spec"]["mutations"]});
    assert_eq!(stored, sent(&rule), "null lost in a POST round trip");

    // The typed API (what initium's watch deserializes) keeps them too.
    let typed = Api::<ClusterMutationRule>::all(client.clone())
        .get(&name)
        .await
        .expect("get the typed rule");
    assert_eq!(
        typed.spec.mutations[0].merge,
        Some(json!({"metadata": {"labels": {"x": null}}}))
    );
    assert_eq!(
        typed.spec.mutations[1]
            .mutations
            .as_ref()
            .expect("forEach mutations")[0]
            .merge,
        Some(json!({"env": null}))
    );

    // Server-side apply (kube client).
    let name = unique("nulls-ssa");
    let rule = rule_with_nulls(&name);
    api.patch(
        &name,
        &PatchParams::apply("initium-tests"),
        &Patch::Apply(&rule),
    )
    .await
    .unwrap_or_else(|e| panic!("server-side apply {name}: {e}"));
    assert_eq!(
        stored_by_kubectl(&name),
        sent(&rule),
        "null lost in server-side apply"
    );

    // `kubectl create -f`, `kubectl replace -f` and `kubectl apply --server-side -f`.
    let name = unique("nulls-kubectl-create");
    let rule = rule_with_nulls(&name);
    let manifest = rule.to_string();
    for args in [&["create", "-f", "-"][..], &["replace", "-f", "-"][..]] {
        let run = kubectl_with_stdin(args, Some(&manifest));
        assert!(run.ok(), "{run}");
        assert_eq!(
            stored_by_kubectl(&name),
            sent(&rule),
            "null lost by `kubectl {}`",
            args.join(" ")
        );
    }
    let name = unique("nulls-kubectl-ssa");
    let rule = rule_with_nulls(&name);
    let run = kubectl_with_stdin(
        &["apply", "--server-side", "-f", "-"],
        Some(&rule.to_string()),
    );
    assert!(run.ok(), "{run}");
    assert_eq!(
        stored_by_kubectl(&name),
        sent(&rule),
        "null lost by `kubectl apply --server-side`"
    );
}

/// Observed behaviour of kubectl (not of the API server): client-side `kubectl apply` removes
/// nulls from maps before it creates an object (kubernetes/kubernetes#125646, kubectl >= 1.31),
/// and when it updates an object whose `mutations` list changed, its JSON merge patch replaces
/// the list and the nulls inside are lost. A rule written `merge: {env: null}` and applied
/// without `--server-side` is stored as `merge: {}`: a rule that does nothing.
#[test]
fn client_side_kubectl_apply_drops_nulls_from_merge_patches() {
    install_crds();
    let stripped = json!({
        "conditions": [{"path": "$.metadata.annotations", "equals": {"b": [null, 1]}}],
        "mutations": [
            {"merge": {"metadata": {"labels": {}}}},
            {"forEach": "$.spec.containers[*]", "mutations": [{"merge": {}}]},
            {"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "certs"}}},
            {"patch": [{"op": "add", "path": "/metadata/annotations", "value": {}}]},
        ],
    });

    // Create with `kubectl apply`.
    let name = unique("nulls-csa-create");
    let rule = rule_with_nulls(&name);
    let run = kubectl_with_stdin(&["apply", "-f", "-"], Some(&rule.to_string()));
    assert!(run.ok(), "{run}");
    assert_eq!(
        stored_by_kubectl(&name),
        stripped,
        "client-side `kubectl apply` (create) was expected to drop the nulls"
    );

    // Edit a rule that was created with its nulls, and `kubectl apply` it: the JSON merge
    // patch replaces the edited `mutations` list, and the nulls inside it are removed.
    let name = unique("nulls-csa-update");
    let rule = rule_with_nulls(&name);
    let run = kubectl_with_stdin(&["create", "-f", "-"], Some(&rule.to_string()));
    assert!(run.ok(), "{run}");
    assert_eq!(
        stored_by_kubectl(&name),
        sent(&rule),
        "created with its nulls"
    );
    let mut edited = rule.clone();
    edited["spec"]["mutations"][0]["merge"]["metadata"]["labels"]["edited"] = json!("yes");
    let run = kubectl_with_stdin(&["apply", "-f", "-"], Some(&edited.to_string()));
    assert!(run.ok(), "{run}");
    let mut stripped_edited = stripped.clone();
    stripped_edited["mutations"][0]["merge"]["metadata"]["labels"] = json!({"edited": "yes"});
    stripped_edited["conditions"] = sent(&rule)["conditions"].clone();
    assert_eq!(
        stored_by_kubectl(&name),
        stripped_edited,
        "client-side `kubectl apply` of an edited `mutations` list was expected to drop its nulls"
    );
}

/// The API server prunes a `null` in a declared field unless the field is `nullable`;
/// `equals: null` and a patch operation's `value: null` mean something, so both are
/// `nullable` and must survive storage.
#[tokio::test]
async fn api_server_keeps_null_equals_and_patch_values() {
    install_crds();
    let client = support::client().await;
    let api = Api::<DynamicObject>::all_with(client, &cmr_resource());
    let name = unique("null-equals");
    let rule = json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "ClusterMutationRule",
        "metadata": {"name": name},
        "spec": {
            "match": {"kinds": ["Pod"]},
            "conditions": [{"path": "$.metadata.annotations.team", "equals": null}],
            "mutations": [{"patch": [{"op": "replace", "path": "/spec/nodeName", "value": null}]}],
        },
    });
    let object: DynamicObject = serde_json::from_value(rule).expect("a DynamicObject");
    let created = api
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
    assert_eq!(
        created.data["spec"]["conditions"],
        json!([{"path": "$.metadata.annotations.team", "equals": null}]),
        "`equals: null` must be stored"
    );
    assert_eq!(
        created.data["spec"]["mutations"],
        json!([{"patch": [{"op": "replace", "path": "/spec/nodeName", "value": null}]}]),
        "a patch `value: null` must be stored"
    );
    let typed: initium::api::ClusterMutationRule =
        serde_json::from_value(serde_json::to_value(&created).expect("serializable"))
            .expect("a ClusterMutationRule");
    assert_eq!(
        typed.spec.conditions[0].equals,
        Some(serde_json::Value::Null),
        "initium reads equals: null as present"
    );
}
