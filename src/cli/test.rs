//! `initium test`: declarative test cases for rules (the format is in docs/testing.md).
//!
//! A case passes when every object comes out as expected (or is denied as expected), the
//! expected warnings appear, and applying the rules to the expected objects changes nothing
//! (idempotence).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::{Error, Result};
use initium_engine::api::Operation;
use initium_engine::untrusted::escape;

use super::input::{Document, parse_documents, read_documents};
use super::offline::{
    Admitted, admit, describe_object, load_rules, lookup_store, namespace_labels,
};
use super::output::yaml;

/// File names that `initium test DIR` picks up.
pub fn is_test_file(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == "initium-test.yaml" || n.ends_with(".initium-test.yaml"))
}

#[derive(Deserialize, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TestFile {
    api_version: String,
    kind: String,
    #[serde(default)]
    metadata: Option<Value>,
    /// Rule files or directories, relative to the test file.
    rules: Vec<String>,
    /// Namespace for objects and MutationRules without one (default `default`).
    #[serde(default)]
    namespace: Option<String>,
    cases: Vec<Case>,
}

#[derive(Deserialize, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Case {
    name: String,
    #[serde(default)]
    operation: Option<Operation>,
    /// Input objects: file paths (relative to the test file) or inline objects.
    objects: Vec<Source>,
    /// Expected output objects, in the same order as the inputs.
    #[serde(default)]
    expected: Vec<Source>,
    /// When set, the case expects the objects to be denied with a message containing this.
    #[serde(default)]
    expect_denied: Option<String>,
    /// Substrings that must each appear in some warning.
    #[serde(default)]
    expect_warnings: Vec<String>,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum Source {
    File(String),
    Inline(Value),
}

/// Runs every test file found under `paths`, prints a report, fails if any case fails.
pub fn run(paths: &[PathBuf], out: &mut dyn Write) -> Result<()> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            find_tests(path, &mut files)?;
        } else if path.exists() {
            files.push(path.clone());
        } else {
            return Err(Error::input(
                path.display().to_string(),
                "no such file or directory",
            ));
        }
    }
    if files.is_empty() {
        let origin = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        return Err(Error::input(
            origin,
            "no test files (named initium-test.yaml or *.initium-test.yaml) found",
        ));
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    let mut report = String::new();
    // Names, paths and messages come from the test files: escaped before they reach a terminal.
    let clean = |text: &dyn std::fmt::Display| escape(&text.to_string()).into_owned();
    for file in &files {
        match run_file(file) {
            Err(e) => {
                failed += 1;
                report.push_str(&format!(
                    "FAIL {}: {}\n",
                    clean(&file.display()),
                    clean(&crate::report(&e))
                ));
            }
            Ok(results) => {
                for (name, problems) in results {
                    if problems.is_empty() {
                        passed += 1;
                        report.push_str(&format!(
                            "PASS {}: {}\n",
                            clean(&file.display()),
                            clean(&name)
                        ));
                    } else {
                        failed += 1;
                        report.push_str(&format!(
                            "FAIL {}: {}\n",
                            clean(&file.display()),
                            clean(&name)
                        ));
                        for p in problems {
                            for line in p.lines() {
                                report.push_str(&format!("    {}\n", clean(&line)));
                            }
                        }
                    }
                }
            }
        }
    }
    report.push_str(&format!("{passed} passed, {failed} failed\n"));
    out.write_all(report.as_bytes())
        .map_err(|e| Error::output("the test report", e))?;
    if failed > 0 {
        return Err(Error::TestsFailed {
            failed,
            total: passed + failed,
        });
    }
    Ok(())
}

fn find_tests(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    for file in super::input::expand(&[dir.to_path_buf()])? {
        if is_test_file(&file) {
            files.push(file);
        }
    }
    Ok(())
}

type CaseResults = Vec<(String, Vec<String>)>;

fn run_file(file: &Path) -> Result<CaseResults> {
    let origin = file.display().to_string();
    let text = std::fs::read_to_string(file)
        .map_err(|e| Error::input_from(origin.clone(), "cannot read", e))?;
    let value: Value = serde_saphyr::from_str(&text)
        .map_err(|e| Error::input_from(origin.clone(), "invalid YAML", e))?;
    let test: TestFile = serde_path_to_error::deserialize(&value).map_err(|e| {
        let at = e.path().to_string();
        Error::input_from(origin.clone(), at, e.into_inner())
    })?;
    if test.api_version != initium_engine::api::API_VERSION || test.kind != "RuleTest" {
        return Err(Error::input(
            origin,
            format!(
                "expected apiVersion {} and kind RuleTest",
                initium_engine::api::API_VERSION
            ),
        ));
    }
    let _ = test.metadata;
    let base = file.parent().unwrap_or(Path::new("."));
    let namespace = test.namespace.as_deref().unwrap_or("default");
    let rule_paths: Vec<PathBuf> = test.rules.iter().map(|r| base.join(r)).collect();
    let rules = load_rules(&rule_paths, namespace)?;
    let mut results = Vec::new();
    for case in &test.cases {
        let problems = run_case(case, base, &origin, namespace, &rules.index)?;
        results.push((case.name.clone(), problems));
    }
    Ok(results)
}

fn load_sources(sources: &[Source], base: &Path, origin: &str) -> Result<Vec<Document>> {
    let mut docs = Vec::new();
    for (i, source) in sources.iter().enumerate() {
        match source {
            Source::File(path) => docs.extend(read_documents(&[base.join(path)])?),
            Source::Inline(value) => {
                let text = serde_json::to_string(value)
                    .map_err(|e| Error::output("a test value as JSON", e))?;
                docs.extend(parse_documents(
                    &format!("{origin} inline object {i}"),
                    &text,
                )?);
            }
        }
    }
    Ok(docs)
}

fn run_case(
    case: &Case,
    base: &Path,
    origin: &str,
    namespace: &str,
    index: &initium_engine::RuleIndex,
) -> Result<Vec<String>> {
    let operation = case.operation.unwrap_or(Operation::Create);
    let inputs = load_sources(&case.objects, base, origin)?;
    let expected = load_sources(&case.expected, base, origin)?;
    let mut namespaces: BTreeMap<String, BTreeMap<String, String>> = namespace_labels(&inputs);
    namespaces.extend(namespace_labels(&expected));
    // Lookups read the ConfigMaps among the case's objects, as they are written there.
    let lookups = lookup_store(index, &inputs, namespace);
    let mut problems = Vec::new();
    let mut outputs = Vec::new();
    let mut warnings = Vec::new();
    let mut denials = Vec::new();
    for doc in &inputs {
        match admit(index, doc, operation, namespace, &namespaces, &lookups)? {
            Admitted::Ok(outcome) => {
                warnings.extend(outcome.warnings.clone());
                // As at admission: what an Audit rule would do is a warning, so a case can
                // expect it (`expectWarnings: ["audit: ... would change the object"]`).
                warnings.extend(
                    outcome
                        .audited
                        .iter()
                        .filter(|a| !matches!(a.verdict, initium_engine::Verdict::Unchanged))
                        .map(|a| a.summary()),
                );
                outputs.push(outcome.object);
            }
            Admitted::Denied(d) => denials.push(format!("{}: {d}", describe_object(&doc.value))),
        }
    }
    match &case.expect_denied {
        Some(want) => {
            if !denials.iter().any(|d| d.contains(want.as_str())) {
                problems.push(format!(
                    "expected a denial containing {want:?}, got {}",
                    if denials.is_empty() {
                        "none".to_string()
                    } else {
                        denials.join("; ")
                    }
                ));
            }
        }
        None => problems.extend(denials.iter().map(|d| format!("unexpected denial: {d}"))),
    }
    for want in &case.expect_warnings {
        if !warnings.iter().any(|w| w.contains(want.as_str())) {
            problems.push(format!(
                "expected a warning containing {want:?}; warnings: {warnings:?}"
            ));
        }
    }
    if case.expect_denied.is_some() {
        return Ok(problems);
    }
    if expected.len() != outputs.len() {
        let mut unmatched: Vec<String> =
            expected.iter().map(|e| describe_object(&e.value)).collect();
        let mut missing = Vec::new();
        for actual in &outputs {
            let name = describe_object(actual);
            match unmatched.iter().position(|e| *e == name) {
                Some(at) => {
                    unmatched.remove(at);
                }
                None => missing.push(name),
            }
        }
        let mut problem = format!(
            "{} input object(s) but {} expected object(s)",
            outputs.len(),
            expected.len()
        );
        if !missing.is_empty() {
            problem.push_str(&format!("; no expected object for {}", missing.join(", ")));
        }
        if !unmatched.is_empty() {
            problem.push_str(&format!("; no input object for {}", unmatched.join(", ")));
        }
        problem.push_str(
            ": list every input object under expected (the ConfigMaps and Namespaces the rules read too), each as the rules leave it",
        );
        problems.push(problem);
        return Ok(problems);
    }
    for (actual, want) in outputs.iter().zip(&expected) {
        if *actual != want.value {
            problems.push(format!(
                "{} differs from {}:\n{}",
                describe_object(actual),
                want.origin,
                diff(&want.value, actual)?
            ));
        }
    }
    // Idempotence: the rules must leave their own expected output alone.
    for want in &expected {
        if let Admitted::Ok(again) =
            admit(index, want, operation, namespace, &namespaces, &lookups)?
            && again.object != want.value
        {
            problems.push(format!(
                "not idempotent: applying the rules to {} changes it again ({}):\n{}",
                want.origin,
                again
                    .applied
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                diff(&want.value, &again.object)?
            ));
        }
    }
    Ok(problems)
}

/// A unified diff of the YAML renderings, expected first, in time linear in their size
/// (see [`super::diff`]).
pub fn diff(expected: &Value, actual: &Value) -> Result<String> {
    let (a, b) = (yaml(expected)?, yaml(actual)?);
    Ok(super::diff::unified(&a, &b, "expected", "actual"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    /// Issue 30, finding 10 (a): a case whose Pod has 20,000 containers, each missing the
    /// `env` a rule adds. With `similar`'s Myers diff this took over two minutes (debug
    /// build); the report's diff is now linear in the object's size.
    #[test]
    fn a_case_of_twenty_thousand_differing_containers_is_diffed_quickly() {
        let containers = |env: bool| -> Vec<Value> {
            (0..20_000)
                .map(|i| {
                    let mut c = serde_json::json!({"name": format!("c{i}"), "image": "nginx"});
                    if env {
                        c["env"] = serde_json::json!([{"name": "A", "value": "b"}]);
                    }
                    c
                })
                .collect()
        };
        let pod = |env: bool| {
            serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "default"},
                "spec": {"containers": containers(env)},
            })
        };
        let started = std::time::Instant::now();
        let shown = diff(&pod(false), &pod(true)).unwrap();
        let took = started.elapsed();
        assert!(
            shown.starts_with("--- expected\n+++ actual\n@@ "),
            "{}",
            &shown[..200]
        );
        // Every container's added env is shown: `+  - env:` or `+    env:` and its entry.
        assert_eq!(
            shown
                .lines()
                .filter(|l| l.trim_start_matches('+').trim() == "value: b")
                .count(),
            20_000
        );
        assert!(
            took < std::time::Duration::from_secs(15),
            "diffing 20,000 differing containers took {took:?}"
        );
    }
}
