//! The API server's own view of admission during a measurement, from its `/metrics`: how
//! many times each webhook was called, how long the API server waited for each call, and how
//! long the admission plugins took in all (the webhook plugin includes encoding the
//! AdmissionReview, the call, and applying the returned patch; the policy plugin is the
//! in-process MutatingAdmissionPolicy). Read before and after, and the difference taken, so
//! the set-up's dry runs do not count.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use super::support::measure::round;
use super::support::plane::Plane;

/// `(metric name, labels)` → value, for the `apiserver_admission_` families.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    series: Vec<(String, BTreeMap<String, String>, f64)>,
}

impl Snapshot {
    /// Reads the API server's metrics now.
    pub fn read(plane: &Plane) -> Result<Snapshot> {
        let output = plane
            .kubectl()
            .args(["get", "--raw", "/metrics"])
            .output()
            .context("cannot run kubectl get --raw /metrics")?;
        anyhow::ensure!(
            output.status.success(),
            "kubectl get --raw /metrics failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(Snapshot::parse(&String::from_utf8_lossy(&output.stdout)))
    }

    /// The `apiserver_admission_*` samples of a Prometheus text exposition.
    pub fn parse(text: &str) -> Snapshot {
        let series = text
            .lines()
            .filter(|line| line.starts_with("apiserver_admission_"))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let value: f64 = value.parse().ok()?;
                let (name, labels) = match series.split_once('{') {
                    Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}')?)),
                    None => (series, BTreeMap::new()),
                };
                Some((name.to_string(), labels, value))
            })
            .collect();
        Snapshot { series }
    }

    /// The sum of `name`'s samples whose labels include every pair of `want`.
    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.series
            .iter()
            .filter(|(n, labels, _)| {
                n == name
                    && want
                        .iter()
                        .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|(_, _, value)| value)
            .sum()
    }

    /// The webhook names that were called at all.
    fn webhooks(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .series
            .iter()
            .filter(|(n, _, _)| n == "apiserver_admission_webhook_request_total")
            .filter_map(|(_, labels, _)| labels.get("name").cloned())
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

/// `a="b",c="d"` → map (values with `\"` and `\\` unescaped).
fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, escaped)) = chars.next() {
                        value.push(if escaped == 'n' { '\n' } else { escaped });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.insert(key.trim_start_matches(',').trim().to_string(), value);
        rest = &after[end..];
    }
    labels
}

/// What the API server did between two snapshots, for `initium_pods` Pods created in
/// initium's namespaces and `map_pods` in the MutatingAdmissionPolicy's. The plugins' time
/// is their whole time over every CREATE (of any resource) divided by those Pods: the
/// other CREATEs cost them a namespace or binding check and little more.
pub struct Admission {
    lines: Vec<String>,
    json: Value,
}

impl Admission {
    pub fn between(before: &Snapshot, after: &Snapshot, initium_pods: u64, map_pods: u64) -> Self {
        let delta =
            |name: &str, want: &[(&str, &str)]| after.sum(name, want) - before.sum(name, want);
        let mut lines = Vec::new();
        let mut webhooks = serde_json::Map::new();
        let mut initium_calls = 0.0;
        for webhook in after.webhooks() {
            let admit = [("name", webhook.as_str()), ("type", "admit")];
            let calls = delta("apiserver_admission_webhook_request_total", &admit);
            if calls <= 0.0 {
                continue;
            }
            let seconds = delta(
                "apiserver_admission_webhook_admission_duration_seconds_sum",
                &admit,
            );
            let rejected = delta(
                "apiserver_admission_webhook_rejection_count",
                &[("name", webhook.as_str())],
            );
            let per_pod = if webhook.ends_with(".initium.dev") && initium_pods > 0 {
                initium_calls += calls;
                Some(calls / initium_pods as f64)
            } else {
                None
            };
            lines.push(format!(
                "    webhook {webhook}: {calls:.0} calls{}, API server's wait per call mean {:.3} ms, {rejected:.0} rejected or failed",
                per_pod.map(|p| format!(" ({p:.3} per initium Pod)")).unwrap_or_default(),
                1000.0 * seconds / calls,
            ));
            webhooks.insert(
                webhook.clone(),
                json!({
                    "calls": calls,
                    "calls_per_initium_pod": per_pod.map(|p| round(p, 3)),
                    "mean_wait_ms": round(1000.0 * seconds / calls, 3),
                }),
            );
        }
        let plugin = |name: &str| {
            let want = [("name", name), ("operation", "CREATE"), ("type", "admit")];
            (
                delta(
                    "apiserver_admission_controller_admission_duration_seconds_sum",
                    &want,
                ),
                delta(
                    "apiserver_admission_controller_admission_duration_seconds_count",
                    &want,
                ),
            )
        };
        let (webhook_seconds, webhook_count) = plugin("MutatingAdmissionWebhook");
        let (policy_seconds, policy_count) = plugin("MutatingAdmissionPolicy");
        let per = |seconds: f64, pods: u64| {
            if pods == 0 {
                0.0
            } else {
                1000.0 * seconds / pods as f64
            }
        };
        let webhook_ms = per(webhook_seconds, initium_pods);
        let policy_ms = per(policy_seconds, map_pods);
        lines.push(format!(
            "    plugin MutatingAdmissionWebhook: {webhook_ms:.3} ms per initium Pod ({webhook_count:.0} CREATEs of any resource passed through it)"
        ));
        lines.push(format!(
            "    plugin MutatingAdmissionPolicy: {policy_ms:.3} ms per map Pod ({policy_count:.0} CREATEs of any resource passed through it)"
        ));
        let calls_per_pod = if initium_pods > 0 {
            initium_calls / initium_pods as f64
        } else {
            0.0
        };
        lines.insert(
            0,
            format!(
                "  the API server's view ({initium_pods} Pods created in initium's namespaces, {map_pods} in map's; its /metrics):"
            ),
        );
        lines.insert(
            1,
            format!(
                "    initium webhook calls per initium Pod: {calls_per_pod:.3} (goal 1: one webhook, never reinvoked)"
            ),
        );
        Admission {
            lines,
            json: json!({
                "initium_pods": initium_pods,
                "map_pods": map_pods,
                "initium_calls_per_pod": round(calls_per_pod, 3),
                "webhooks": webhooks,
                "webhook_plugin_ms_per_initium_pod": round(webhook_ms, 3),
                "policy_plugin_ms_per_map_pod": round(policy_ms, 3),
            }),
        }
    }

    pub fn print(&self) {
        for line in &self.lines {
            println!("{line}");
        }
    }

    pub fn json(&self) -> Value {
        self.json.clone()
    }
}
