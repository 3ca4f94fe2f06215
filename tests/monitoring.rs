//! deploy/monitoring: the Grafana dashboard and the PrometheusRule alerts use only metrics a
//! running `initium serve` exports, their PromQL parses with Prometheus's own parser, the
//! rule file loads as Prometheus loads it, and every alert has its runbook in
//! docs/operations.md.
//!
//! prometheus-client prints nothing at all (not even `# TYPE`) for a family with no series
//! yet: a fresh process has no `initium_gate_releases_total`, `initium_rule_errors_total` ...
//! So the live check first makes the process record one of everything (a rule that changes a
//! Pod, one that fails, a gate that times out) and then reads `/metrics`; names are compared
//! with the sample names printed there, so a histogram is used through its `_bucket`,
//! `_sum` and `_count` samples and a counter through `_total`, as Prometheus stores them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::commands::ops_check;
use support::plane::{Plane, root};
use support::serving::Serving;
use support::{eventually_blocking, install_crds, serial_blocking, unique};

const DASHBOARD: &str = "deploy/monitoring/grafana-dashboard.json";
const RULES: &str = "deploy/monitoring/prometheus-rules.yaml";

/// Where a query comes from (`dashboard panel "Leader"`, `alert InitiumNoLeader`) and its text.
#[derive(Clone, Debug)]
struct Query {
    origin: String,
    expr: String,
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD))
        .unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"))
}

fn prometheus_rule() -> Value {
    serde_saphyr::from_str(&read(RULES)).unwrap_or_else(|e| panic!("{RULES} is not YAML: {e}"))
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        all.push(panel);
        all.extend(panel["panels"].as_array().into_iter().flatten());
    }
    all
}

/// The PromQL of every panel target.
fn dashboard_queries(dashboard: &Value) -> Vec<Query> {
    panels(dashboard)
        .into_iter()
        .flat_map(|panel| {
            panel["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| Query {
                    origin: format!("dashboard panel {}", panel["title"]),
                    expr: t["expr"]
                        .as_str()
                        .expect("a target with an expr")
                        .to_owned(),
                })
        })
        .collect()
}

/// The metric of every `label_values(METRIC, label)` variable query (Grafana's syntax, not PromQL).
fn variable_metrics(dashboard: &Value) -> Vec<Query> {
    dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            let query = v["query"]["query"]
                .as_str()
                .or(v["query"].as_str())
                .expect("a query");
            let inner = query
                .strip_prefix("label_values(")
                .and_then(|q| q.split(',').next())
                .unwrap_or_else(|| {
                    panic!(
                        "variable {}: not label_values(METRIC, LABEL): {query}",
                        v["name"]
                    )
                });
            Query {
                origin: format!("dashboard variable {}", v["name"]),
                expr: inner.trim().to_owned(),
            }
        })
        .collect()
}

fn alert_queries(rule: &Value) -> Vec<Query> {
    rule["spec"]["groups"]
        .as_array()
        .expect("spec.groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .map(|r| Query {
            origin: format!(
                "alert {}",
                r["alert"].as_str().or(r["record"].as_str()).unwrap_or("?")
            ),
            expr: r["expr"].as_str().expect("an expr").to_owned(),
        })
        .collect()
}

/// Grafana's variables replaced so that Prometheus can parse the query: intervals by `5m`,
/// other variables (only used in label matchers) by `.*`.
fn without_variables(expr: &str) -> String {
    let mut out = expr
        .replace("$__rate_interval", "5m")
        .replace("$__interval", "5m")
        .replace("$__range", "5m");
    while let Some(at) = out.find('$') {
        let rest = &out[at + 1..];
        let len = if rest.starts_with('{') {
            rest.find('}').map_or(rest.len(), |e| e + 1)
        } else {
            rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len())
        };
        out.replace_range(at..at + 1 + len, ".*");
    }
    out
}

/// PromQL words that are never metric names: aggregations, keywords, binary operators and the
/// `@` modifier's functions (all lowercase, as PromQL spells them).
const KEYWORDS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "atan2",
    "inf",
    "nan",
    "start",
    "end",
];
/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names a PromQL expression selects, by a tokeniser: identifiers outside strings,
/// label matchers (`{...}`) and ranges (`[...]`) that are not followed by `(` (a function or an
/// aggregation), are not keywords and are not in a `by (...)`-like label list.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    // Skips from an opening bracket to just after its closing one, strings included.
    let skip_to_close = |mut i: usize, close: char| -> usize {
        while i < chars.len() && chars[i] != close {
            if matches!(chars[i], '"' | '\'' | '`') {
                let quote = chars[i];
                i += 1;
                while i < chars.len() && chars[i] != quote {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            i += 1;
        }
        i + 1
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '{' {
            i = skip_to_close(i + 1, '}');
        } else if c == '[' {
            i = skip_to_close(i + 1, ']');
        } else if matches!(c, '"' | '\'' | '`') {
            i = skip_to_close(i + 1, c);
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            // A number or a duration: 0.99, 1e3, 7, 86400, 5m.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let before_paren = chars.get(next) == Some(&'(');
            if LABEL_LISTS.contains(&word.as_str()) && before_paren {
                i = skip_to_close(next + 1, ')');
            } else if !before_paren && !KEYWORDS.contains(&word.as_str()) {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The samples printed in an exposition, by name, with the type of their family.
fn exposed_samples(exposition: &str) -> BTreeMap<String, String> {
    let mut types: BTreeMap<&str, &str> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    for line in exposition.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                types.insert(name, kind);
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            // The family: the longest typed name the sample name starts with.
            let family = types
                .iter()
                .filter(|(f, _)| name.starts_with(**f))
                .max_by_key(|(f, _)| f.len())
                .map_or("untyped", |(_, kind)| *kind);
            samples.insert(name.to_owned(), family.to_owned());
        }
    }
    samples
}

/// Every use of a metric name that `exposition` does not print, as `origin: name`.
/// The kubelet's cAdvisor metrics, which the Resources panels use: not initium's to export;
/// tests/real_node.rs checks them against a real kubelet.
const KUBELET_PREFIX: &str = "container_";

fn unknown_metrics(queries: &[Query], exposition: &str) -> Vec<String> {
    let samples = exposed_samples(exposition);
    let mut unknown = Vec::new();
    for query in queries {
        for name in metric_names(&query.expr)
            .into_iter()
            .filter(|name| !name.starts_with(KUBELET_PREFIX))
        {
            if !samples.contains_key(&name) {
                let hint = ["_bucket", "_sum", "_count", "_total"]
                    .iter()
                    .map(|s| format!("{name}{s}"))
                    .filter(|s| samples.contains_key(s))
                    .collect::<Vec<_>>();
                unknown.push(format!(
                    "{}: {name} is not exported{}",
                    query.origin,
                    if hint.is_empty() {
                        String::new()
                    } else {
                        format!(" (did you mean {}?)", hint.join(", "))
                    }
                ));
            }
        }
    }
    unknown
}

fn all_promql() -> Vec<Query> {
    let mut queries = dashboard_queries(&dashboard());
    queries.extend(alert_queries(&prometheus_rule()));
    queries
}

#[test]
fn the_dashboard_is_a_grafana_dashboard_with_a_query_in_every_panel() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "initium");
    let mut ids = BTreeSet::new();
    let panels = panels(&dashboard);
    for panel in &panels {
        assert!(
            ids.insert(panel["id"].as_u64().expect("a numeric id")),
            "duplicate id: {panel}"
        );
        if panel["type"] == "row" {
            continue;
        }
        let title = &panel["title"];
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "panel {title}");
        assert!(
            panel["description"].as_str().is_some_and(|d| d.len() > 20),
            "panel {title} says what it shows"
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title} has a query");
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            // The kubelet's own metrics (cAdvisor: the Resources panels) come from the
            // kubelet's job: they pick initium's containers by name instead.
            let kubelets = metric_names(expr)
                .iter()
                .all(|m| m.starts_with(KUBELET_PREFIX));
            assert!(
                expr.contains(r#"job=~"$job""#)
                    || (kubelets && expr.contains(r#"container="initium""#)),
                "panel {title} follows the job variable: {expr}"
            );
        }
    }
    assert!(panels.len() > 15, "{} panels", panels.len());
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(variables, ["datasource", "job"]);
}

#[test]
fn the_prometheus_rule_loads_as_prometheus_loads_it_and_every_alert_has_a_runbook() {
    let rule = prometheus_rule();
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["kind"], "PrometheusRule");
    // The spec is a Prometheus rule file: what `promtool check rules` checks, templates included.
    let errors = ops_check(&["rules"], &rule["spec"].to_string());
    assert_eq!(errors, serde_json::json!([]), "{RULES}");
    let docs = read("docs/operations.md");
    let groups = rule["spec"]["groups"].as_array().unwrap();
    let alerts: Vec<&Value> = groups
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    assert!(alerts.len() >= 10, "{} alerts", alerts.len());
    for alert in alerts {
        let name = alert["alert"].as_str().expect("only alerts");
        assert!(
            ["info", "warning", "critical"]
                .contains(&alert["labels"]["severity"].as_str().unwrap_or_default()),
            "{name}: severity"
        );
        let annotations = &alert["annotations"];
        for key in ["summary", "description"] {
            assert!(
                annotations[key].as_str().is_some_and(|s| s.len() > 20),
                "{name}: {key}"
            );
        }
        let anchor = format!("docs/operations.md#{}", name.to_lowercase());
        assert_eq!(annotations["runbook"], anchor.as_str(), "{name}");
        assert!(
            docs.contains(&format!("\n#### {name}\n")),
            "{name}: docs/operations.md has no runbook heading `#### {name}`"
        );
    }
}

#[test]
fn every_query_parses_and_the_tokeniser_finds_what_the_parser_finds() {
    let queries = all_promql();
    let texts: Vec<String> = queries.iter().map(|q| without_variables(&q.expr)).collect();
    let parsed = ops_check(&["promql"], &serde_json::to_string(&texts).unwrap());
    let parsed = parsed.as_array().unwrap();
    assert_eq!(parsed.len(), queries.len());
    for (query, result) in queries.iter().zip(parsed) {
        assert!(
            result.get("error").is_none(),
            "{}: {} does not parse: {}",
            query.origin,
            result["expr"],
            result["error"]
        );
        let by_parser: BTreeSet<String> = result["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            metric_names(&query.expr),
            by_parser,
            "{}: {}",
            query.origin,
            query.expr
        );
        assert!(!by_parser.is_empty(), "{}: selects no metric", query.origin);
    }
    // The parser reports what is wrong, so the check above can fail.
    let broken = ops_check(&["promql"], r#"["sum(rate(initium_leader[5m])"]"#);
    assert!(
        broken[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("parse error")),
        "{broken}"
    );
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_use_is_exported_by_initium_serve() {
    let _serial = serial_blocking();
    install_crds();
    let plane = Plane::shared();
    let serving = Serving::start_on(plane, &[]);
    let initium = &serving.initium;
    let (_, fresh) = initium.get("/metrics").unwrap();

    // One of everything: a rule that changes Pods, one that fails (Ignore: skipped), and a gate
    // that times out at once (released with reason timeout).
    let ns = unique("monitoring");
    plane.ensure_namespace(&ns, &[]).unwrap();
    let rule = |name: &str, spec: &str| {
        format!(
            "apiVersion: initium.dev/v1alpha1\nkind: MutationRule\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n---\n"
        )
    };
    let rules = [
        rule("label", r#"{match: {kinds: [Pod]}, mutations: [{merge: {metadata: {labels: {seen: "yes"}}}}]}"#),
        rule("broken", r#"{match: {kinds: [Pod]}, mutations: [{patch: [{op: remove, path: /spec/notThere}]}]}"#),
        rule("gate", r#"{match: {kinds: [Pod]}, gate: {waitFor: [{service: {name: missing}}], timeout: 1s}}"#),
        rule("audited", r#"{mode: Audit, match: {kinds: [Pod]}, mutations: [{merge: {metadata: {labels: {audited: "yes"}}}}]}"#),
        rule("audited-broken", r#"{mode: Audit, match: {kinds: [Pod]}, mutations: [{patch: [{op: remove, path: /spec/notThere}]}]}"#),
    ]
    .concat();
    plane.apply(&rules).unwrap();
    eventually_blocking(
        "the five rules Ready in initium",
        Duration::from_secs(60),
        || {
            let ready = initium
                .metric(r#"initium_rules{state="ready""#)
                .map_err(|e| e.to_string())?;
            if ready >= 5.0 {
                Ok(())
            } else {
                Err(format!("{ready} Ready"))
            }
        },
    );
    eventually_blocking(
        "a Pod admitted through the webhook",
        Duration::from_secs(30),
        || {
            let pod = format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: {ns}}}\nspec: {{containers: [{{name: c, image: busybox}}]}}\n"
            );
            plane.apply(&pod).map_err(|e| e.to_string())?;
            let labels = support::plane::run(plane.kubectl().args([
                "get",
                "pod",
                "p",
                "-n",
                &ns,
                "-o",
                "jsonpath={.metadata.labels.seen}",
            ]))
            .map_err(|e| e.to_string())?;
            if labels == "yes" {
                Ok(())
            } else {
                // Created before the webhook configuration covered Pods: try again.
                let _ = support::plane::run(plane.kubectl().args([
                    "delete",
                    "pod",
                    "p",
                    "-n",
                    &ns,
                    "--wait=false",
                ]));
                Err("the Pod was not mutated".into())
            }
        },
    );
    let exposition = eventually_blocking(
        "the gate's timeout counted",
        Duration::from_secs(30),
        || {
            let (_, body) = initium.get("/metrics").map_err(|e| e.to_string())?;
            if body.contains(r#"initium_gate_releases_total{reason="timeout"}"#) {
                Ok(body)
            } else {
                Err(body)
            }
        },
    );

    let mut queries = all_promql();
    queries.extend(variable_metrics(&dashboard()));
    let unknown = unknown_metrics(&queries, &exposition);
    assert!(
        unknown.is_empty(),
        "{}\n--- /metrics\n{exposition}",
        unknown.join("\n")
    );

    // What a fresh process did not print yet (families with no series), for the record.
    let missing_when_fresh: BTreeSet<String> = unknown_metrics(&queries, &fresh)
        .into_iter()
        .filter_map(|u| {
            u.split(": ")
                .nth(1)
                .map(|n| n.split(' ').next().unwrap_or_default().to_owned())
        })
        .collect();
    eprintln!("not printed by a fresh process: {missing_when_fresh:?}");
    assert!(
        missing_when_fresh.contains("initium_gate_releases_total"),
        "prometheus-client prints a family only once it has a series: {fresh}"
    );

    // The check fails for a name initium does not export.
    let mut broken = queries[0].clone();
    broken.expr = broken.expr.replace(
        "initium_admission_duration_seconds_count",
        "initium_admission_requests_total",
    );
    assert_eq!(
        unknown_metrics(&[broken], &exposition),
        [format!(
            "{}: initium_admission_requests_total is not exported",
            queries[0].origin
        )]
    );
    let _ = support::plane::run(
        plane
            .kubectl()
            .args(["delete", "namespace", &ns, "--wait=false"]),
    );
}

#[test]
fn the_tokeniser_skips_functions_labels_and_durations() {
    let expr = r#"histogram_quantile(0.99, sum by (le, kind) (rate(a_bucket{job=~"x|y", le="0.1"}[5m] offset 1h))) / on (job) group_left (kind) b:rule_total * 7 * 86400 and absent(c)"#;
    assert_eq!(
        metric_names(expr),
        ["a_bucket", "b:rule_total", "c"].map(String::from).into()
    );
    assert_eq!(
        without_variables(r#"rate(x{job=~"$job", a="${b}"}[$__rate_interval])"#),
        r#"rate(x{job=~".*", a=".*"}[5m])"#
    );
}

#[test]
fn the_kustomization_installs_the_pod_monitor_the_rules_and_the_dashboard() {
    let bin_dir = support::plane::run(Command::new(support::control_plane_script()).arg("bin-dir"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let kubectl = std::path::Path::new(bin_dir.trim()).join("kubectl");
    let out = support::plane::run(
        Command::new(kubectl)
            .arg("kustomize")
            .arg(root().join("deploy/monitoring")),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let objects: Vec<Value> = out
        .split("\n---\n")
        .map(|doc| serde_saphyr::from_str(doc).unwrap_or_else(|e| panic!("{e}: {doc}")))
        .collect();
    let kinds: Vec<(&str, &str, &str)> = objects
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap(),
                o["metadata"]["name"].as_str().unwrap(),
                o["metadata"]["namespace"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("ConfigMap", "initium-grafana-dashboard", "initium-system"),
            ("PodMonitor", "initium", "initium-system"),
            ("PrometheusRule", "initium", "initium-system"),
        ]
    );
    let dashboard_cm = &objects[0];
    assert_eq!(dashboard_cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let embedded: Value =
        serde_json::from_str(dashboard_cm["data"]["initium.json"].as_str().unwrap()).unwrap();
    assert_eq!(embedded, dashboard());
    // The PodMonitor scrapes the port deploy/deployment.yaml serves /metrics on.
    let endpoint = &objects[1]["spec"]["podMetricsEndpoints"][0];
    assert_eq!(
        (endpoint["port"].as_str(), endpoint["path"].as_str()),
        (Some("ops"), Some("/metrics"))
    );
    assert!(read("deploy/deployment.yaml").contains("{name: ops, containerPort: 8080"));
}
