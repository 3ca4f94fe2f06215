//! Fuzzing on stable Rust (docs/fuzzing.md): AdmissionReviews through the webhook routers,
//! rule specs through the engine, and input files through the CLI, with a seeded generator,
//! structure-aware cases and byte-level mutation of the repository's own documents.
//!
//! `cargo test` runs a short fixed-seed run of each target; `scripts/fuzz` runs long campaigns
//! through the ignored `campaign` test. Cases run in worker processes (the ignored `worker`
//! test), so a crash names its input instead of taking the test binary down.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "fuzz/generate.rs"]
mod generate;
#[path = "fuzz/harness.rs"]
mod harness;
#[path = "fuzz/rng.rs"]
mod rng;
#[path = "fuzz/targets.rs"]
mod targets;

use std::time::Duration;

use serde_json::{Value, json};

/// Fixed seeds: CI runs the same cases every time, so a failure there is reproducible with the
/// command the assertion prints. Long campaigns take a fresh seed each run.
/// The case counts take about 5 s per target in a debug build on a 2-core machine.
const SHORT_SEED: u64 = 0x1_2025_0715;

#[test]
fn fuzz_reviews() {
    harness::short("reviews", SHORT_SEED, 800);
}

#[test]
fn fuzz_rules() {
    harness::short("rules", SHORT_SEED, 160);
}

#[test]
fn fuzz_cli() {
    harness::short("cli", SHORT_SEED, 200);
}

/// The harness itself: a panic, an oracle failure, a stack overflow and a slow case in the
/// worker are each reported with the right class, and a passing input passes.
#[test]
fn harness_reports_every_kind_of_failure() {
    let target = targets::target("selftest").expect("selftest");
    let mut settings = harness::Settings::from_env();
    settings.case_bound = Duration::from_millis(300);
    let hang = Duration::from_secs(5);
    let class = |input| harness::replay(target, &input, &settings, hang).map(|f| f.class);
    assert_eq!(class(json!({})), None);
    assert_eq!(class(json!({"do": "panic"})).as_deref(), Some("panic"));
    assert_eq!(class(json!({"do": "fail"})).as_deref(), Some("oracle"));
    assert_eq!(
        class(json!({"do": "overflow"})).as_deref(),
        Some("stack-overflow")
    );
    assert_eq!(
        class(json!({"do": "sleep", "ms": 600})).as_deref(),
        Some("slow")
    );
    settings.case_bound = Duration::from_secs(60);
    let hang = Duration::from_millis(500);
    let class = |input| harness::replay(target, &input, &settings, hang).map(|f| f.class);
    assert_eq!(
        class(json!({"do": "sleep", "ms": 3000})).as_deref(),
        Some("hang")
    );
}

#[test]
fn debug_output_in_messages_is_recognised() {
    assert!(targets::debug_marker("budget breached: Depth { depth: 65 }", "").is_some());
    assert!(targets::debug_marker("failed: Error { kind: Eof }", "").is_some());
    assert!(targets::debug_marker("value was Some(3)", "").is_some());
    assert!(targets::debug_marker("spec.mutations[0]: invalid JSON pointer \"x\"", "").is_none());
    // Text the input itself contains is the user's, not a Debug dump.
    assert!(
        targets::debug_marker("name \"Foo { bar: 1 }\" is invalid", "Foo { bar: 1 }").is_none()
    );
}

/// The `rules` target's oracle for objects the API server would refuse (issue 36): each kind
/// of bad output is reported, and what the rule literally wrote, or the input already held,
/// is not.
#[test]
fn refused_outputs_are_recognised() {
    let refused = |input: Value, output: Value, rules: Value| {
        let rules = rules.as_array().cloned().unwrap_or_default();
        targets::refused_by_api_server(&input, &output, &rules).err()
    };
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web",
                     "labels": {"app": "web"}}, "spec": {"containers": [{"name": "a"}]}});
    let with = |pointer: &str, value: Value| {
        let mut out = pod.clone();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        let mut cur = &mut out;
        for t in parent.split('/').skip(1) {
            if !cur.get(t).is_some_and(|v| v.is_object() || v.is_array()) {
                cur[t] = json!({});
            }
            cur = if let Some(i) = t.parse::<usize>().ok().filter(|_| cur.is_array()) {
                &mut cur[i]
            } else {
                &mut cur[t]
            };
        }
        cur[key] = value;
        out
    };
    let kyverno = json!([{"spec": {"mutations": [{"patch": [{"op": "add",
        "path": "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms/-1/matchExpressions/-",
        "value": {"key": "zone", "operator": "In", "values": ["a"]}}]}]}}]);

    // Good: new string labels, a list appended to, an annotation, a new element.
    let good = with("/metadata/labels/team", json!("payments"));
    assert_eq!(refused(pod.clone(), good, json!([])), None);
    let mut good = pod.clone();
    good["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "b"}));
    good["spec"]["tolerations"] = json!([{"key": "x"}]);
    assert_eq!(refused(pod.clone(), good, json!([])), None);

    // 1. A list token as a key of an object the engine made on the way.
    let terms = json!({"nodeSelectorTerms": {"-1": {"matchExpressions": [{"key": "zone"}]}}});
    let bad = with(
        "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution",
        terms,
    );
    let found = refused(pod.clone(), bad, kyverno.clone()).expect("-1 as a key");
    assert!(found.contains("list token \"-1\""), "{found}");
    let bad = with("/spec/tolerations", json!({"-": {"key": "x"}}));
    assert!(refused(pod.clone(), bad.clone(), json!([])).is_some());
    let bad_index = with("/spec/volumes", json!({"0": {"name": "x"}}));
    assert!(refused(pod.clone(), bad_index, json!([])).is_some());
    // ... unless a rule writes that key, or an object there, or the input had it.
    let merge = json!([{"spec": {"mutations": [{"merge": {"spec": {"tolerations": {"-": {"key": "x"}}}}}]}}]);
    assert_eq!(refused(pod.clone(), bad.clone(), merge), None);
    let object = json!([{"spec": {"mutations": [{"merge": {"spec": {"tolerations": {}}}},
        {"patch": [{"op": "add", "path": "/spec/tolerations/-", "value": {"key": "x"}}]}]}}]);
    assert_eq!(refused(pod.clone(), bad.clone(), object), None);
    let mut had = pod.clone();
    had["spec"]["tolerations"] = json!({});
    assert_eq!(refused(had, bad, json!([])), None);

    // 2. Label and annotation values that are not strings, here and in Pod templates.
    let bad = with("/metadata/labels/backup", json!(true));
    let found = refused(pod.clone(), bad, json!([])).expect("boolean label");
    assert!(
        found.contains("/metadata/labels/backup is a boolean"),
        "{found}"
    );
    let bad = with("/metadata/annotations/replicas", json!(3));
    assert!(refused(pod.clone(), bad, json!([])).is_some());
    let bad = with("/metadata/labels/app", json!(["web"]));
    assert!(refused(pod.clone(), bad, json!([])).is_some());
    let bad = with("/metadata/labels", json!(["web"]));
    let found = refused(pod.clone(), bad, json!([])).expect("labels as a list");
    assert!(found.contains("/metadata/labels is a list"), "{found}");
    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                            "spec": {"template": {"metadata": {"labels": {"app": "web"}}}}});
    let mut bad = deployment.clone();
    bad["spec"]["template"]["metadata"]["labels"]["tier"] = json!(1.5);
    assert!(refused(deployment.clone(), bad, json!([])).is_some());
    // ... but not a value that was not a string before the rules ran.
    let mut was = pod.clone();
    was["metadata"]["labels"]["n"] = json!(1);
    let mut still = was.clone();
    still["metadata"]["labels"]["n"] = json!(2);
    assert_eq!(refused(was, still, json!([])), None);

    // 3. Nulls written where the input had none.
    let bad = with("/spec/priority", Value::Null);
    let found = refused(pod.clone(), bad.clone(), json!([])).expect("a null written");
    assert!(
        found.contains("a null was written at /spec/priority"),
        "{found}"
    );
    let bad_label = with("/metadata/labels/team", Value::Null);
    assert!(refused(pod.clone(), bad_label, json!([])).is_some());
    // ... unless the rule writes one there, or it was there.
    let literal = json!([{"spec": {"mutations": [{"patch": [{"op": "add", "path": "/spec/priority", "value": null}]}]}}]);
    assert_eq!(refused(pod.clone(), bad.clone(), literal), None);
    assert_eq!(refused(bad.clone(), bad, json!([])), None);
}

/// Started by the supervisor in a child process; does nothing otherwise.
#[test]
#[ignore = "a fuzz worker process, started by the fuzz tests and scripts/fuzz"]
fn worker() {
    harness::worker_main();
}

/// `scripts/fuzz`: a long campaign (or `--replay FILE`), configured by environment variables.
#[test]
#[ignore = "long fuzz campaigns: run scripts/fuzz"]
fn campaign() {
    harness::campaign_main();
}
