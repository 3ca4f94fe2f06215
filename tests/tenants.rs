//! Many tenants on a real API server: the webhook configuration does not grow with them, a
//! tenant's `failurePolicy: Fail` rule fails closed only in namespaces with Fail rules while
//! initium is down, far past the ~1,490 tenants (63-character names) where the configuration
//! that listed namespace names was refused, and a configuration the API server refuses
//! surfaces on the rules it was for.
//!
//! `initium serve` runs beside a bare API server of this test binary's own
//! ([`Plane::shared`]); the tests share it and run one at a time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use support::cluster::{create_rules, ready_for, rule_resource};
use support::plane::Plane;
use support::process::metric_sum;
use support::serving::Serving;
use support::{eventually, serial, unique};

/// Tenants in the isolation test: past the 1,490 at which the configuration that listed
/// their names was refused. `INITIUM_TEST_TENANTS` changes it (e.g. 10000 by hand).
fn tenants() -> usize {
    std::env::var("INITIUM_TEST_TENANTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000)
}

/// A 63-character namespace name (the longest Kubernetes allows), unique per run.
fn tenant_name(run: &str, i: usize) -> String {
    let name = format!("{run}-{i:05}-");
    format!("{name}{}", "t".repeat(63 - name.len()))
}

/// A MutationRule in `namespace` that labels every Pod, with `failurePolicy: Fail`.
fn fail_rule(namespace: &str) -> Value {
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": "stamp", "namespace": namespace},
        "spec": {
            "failurePolicy": "Fail",
            "match": {"kinds": ["Pod"]},
            "mutations": [{"merge": {"metadata": {"labels": {"example.com/tenant": "yes"}}}}],
        },
    })
}

fn probe() -> Pod {
    serde_json::from_value(json!({
        "metadata": {"generateName": "probe-"},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]}
    }))
    .unwrap()
}

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}

fn mutation_rules() -> kube::api::ApiResource {
    rule_resource("MutationRule").unwrap_or_else(|e| panic!("{e:#}"))
}

/// MutationRules in namespaces whose names start with `prefix` whose status says their
/// current generation is Ready.
async fn ready_count_in(client: &kube::Client, prefix: &str) -> usize {
    let api: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &mutation_rules());
    api.list(&ListParams::default())
        .await
        .map(|list| {
            list.items
                .iter()
                .filter(|r| {
                    r.metadata
                        .namespace
                        .as_deref()
                        .is_some_and(|ns| ns.starts_with(prefix))
                })
                .filter(|r| ready_for(&r.data["status"], r.metadata.generation).is_ok())
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn fail_rules_of_thousands_of_tenants_fail_closed_only_in_their_namespaces_while_initium_is_down()
 {
    let _serial = serial().await;
    let plane = Plane::shared();
    plane.install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    let client = plane.client().await.unwrap_or_else(|e| panic!("{e:#}"));
    let mut serving = Serving::start_on(plane, &[]);
    let label = format!("fail-rules.initium.dev/{}", serving.name);

    let n = tenants();
    let run = unique("t").chars().take(20).collect::<String>();
    let names: Vec<String> = (0..n).map(|i| tenant_name(&run, i)).collect();
    let rules: Vec<Value> = names.iter().map(|ns| fail_rule(ns)).collect();
    let bystander = unique("bystander");
    plane
        .ensure_namespace(&bystander, &[])
        .unwrap_or_else(|e| panic!("{e:#}"));

    // A burst of rules that each change the configuration: at most one write a second.
    let burst = unique("burst");
    let kinds = [
        "ConfigMap",
        "Service",
        "ServiceAccount",
        "PersistentVolumeClaim",
        "apps/v1/Deployment",
        "apps/v1/StatefulSet",
        "apps/v1/DaemonSet",
        "batch/v1/Job",
        "batch/v1/CronJob",
        "policy/v1/PodDisruptionBudget",
    ];
    let operations: [&[&str]; 3] = [&["CREATE"], &["UPDATE"], &["CREATE", "UPDATE"]];
    let burst_rules: Vec<Value> = kinds
        .iter()
        .enumerate()
        .flat_map(|(k, kind)| {
            let burst = burst.clone();
            operations.iter().enumerate().map(move |(o, ops)| {
                json!({
                    "apiVersion": "initium.dev/v1alpha1",
                    "kind": "MutationRule",
                    "metadata": {"name": format!("r{k}-{o}"), "namespace": burst},
                    "spec": {
                        "match": {"kinds": [kind], "operations": ops},
                        "mutations": [{"merge": {"metadata": {"labels": {"example.com/burst": "yes"}}}}],
                    },
                })
            })
        })
        .collect();
    let applied = |metrics: &str| {
        metric_sum(
            metrics,
            "initium_webhook_configuration_writes_total{result=\"applied\"",
        )
    };
    let (_, metrics) = serving.initium.get("/metrics").expect("/metrics");
    let writes_before = applied(&metrics);
    let started = Instant::now();
    create_rules(&client, &burst_rules, 8)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    eventually(
        "the burst's rules to be Ready",
        Duration::from_secs(120),
        || async {
            let ready = ready_count_in(&client, &burst).await;
            if ready >= burst_rules.len() {
                Ok(())
            } else {
                Err(format!("{ready} of {} Ready", burst_rules.len()))
            }
        },
    )
    .await;
    let took = started.elapsed();
    let (_, metrics) = serving.initium.get("/metrics").expect("/metrics");
    let burst_writes = applied(&metrics) - writes_before;
    eprintln!(
        "{} rules that each change the configuration: {burst_writes} writes in {took:?}",
        burst_rules.len()
    );
    assert!(
        burst_writes >= 1.0 && burst_writes <= took.as_secs_f64().ceil() + 1.0,
        "{burst_writes} configuration writes in {took:?}: at most one a second"
    );
    let _ = plane
        .kubectl()
        .args(["delete", "namespace", &burst, "--wait=false"])
        .output();

    let (_, metrics) = serving.initium.get("/metrics").expect("/metrics");
    let writes_before = applied(&metrics);
    let started = Instant::now();
    create_rules(&client, &rules, 32)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let created = started.elapsed();
    eventually(
        &format!("all {n} tenants' Fail rules to be Ready"),
        Duration::from_secs(600),
        || async {
            let ready = ready_count_in(&client, &run).await;
            if ready >= n {
                Ok(())
            } else {
                Err(format!("{ready} of {n} Ready"))
            }
        },
    )
    .await;
    let all_ready = started.elapsed();
    eprintln!(
        "{n} tenants: created in {:.1} s, all Ready {:.1} s after the first create",
        created.as_secs_f64(),
        all_ready.as_secs_f64()
    );

    // Ready means in effect: every tenant namespace carries the label.
    let labeled = Api::<Namespace>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{label}=true")))
        .await
        .expect("list namespaces")
        .items
        .len();
    assert_eq!(labeled, n, "every tenant namespace carries {label}");

    // The configuration is as large as for one tenant.
    let configuration = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get(&serving.name)
        .await
        .expect("the MutatingWebhookConfiguration");
    let bytes = serde_json::to_vec(&configuration.webhooks).unwrap().len();
    let names_in_it: Vec<&str> = configuration
        .webhooks
        .iter()
        .flatten()
        .map(|w| w.name.as_str())
        .collect();
    // Tenants' Pods go to the Fail webhook in labeled namespaces; elsewhere (a namespace
    // whose label is missing for a moment) to the Ignore one. Other tests' rules may add
    // ignore-labeled.initium.dev.
    for webhook in ["fail-labeled.initium.dev", "ignore.initium.dev"] {
        assert!(names_in_it.contains(&webhook), "{names_in_it:?}");
    }
    assert!(
        !names_in_it.contains(&"fail.initium.dev"),
        "{names_in_it:?}"
    );
    assert!(
        bytes < 16 * 1024,
        "{bytes} bytes of webhooks for {n} tenants"
    );
    assert!(
        !String::from_utf8_lossy(&serde_json::to_vec(&configuration).unwrap()).contains(&run),
        "no tenant is named in the configuration"
    );
    // One label write per tenant, and a bounded number of configuration writes however many
    // rules came in.
    let (_, metrics) = serving.initium.get("/metrics").expect("/metrics");
    let label_writes = metric_sum(
        &metrics,
        "initium_namespace_label_writes_total{result=\"added\"",
    );
    assert_eq!(label_writes as usize, n, "{metrics}");
    let writes = applied(&metrics) - writes_before;
    assert!(
        writes <= all_ready.as_secs_f64() + 2.0,
        "{writes} configuration writes in {all_ready:?}: at most one a second"
    );

    // initium up: a tenant's Pods are mutated.
    let first = Api::<Pod>::namespaced(client.clone(), &names[0]);
    let pod = first.create(&dry_run(), &probe()).await.expect("a Pod");
    assert_eq!(
        pod.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("example.com/tenant"))
            .map(String::as_str),
        Some("yes")
    );

    // initium down: the tenants that asked for Fail are refused, everyone else is not.
    serving.kill();
    let last = Api::<Pod>::namespaced(client.clone(), &names[n - 1]);
    let refused = last
        .create(&dry_run(), &probe())
        .await
        .expect_err("a tenant with a Fail rule is refused while initium is down");
    assert!(
        refused.to_string().contains("fail-labeled.initium.dev"),
        "{refused}"
    );
    let other = Api::<Pod>::namespaced(client.clone(), &bystander);
    other
        .create(&dry_run(), &probe())
        .await
        .expect("a namespace without Fail rules is not affected while initium is down");

    // A label removed by hand comes back once initium runs.
    serving.restart();
    plane
        .kubectl()
        .args(["label", "namespace", &names[0], &format!("{label}-")])
        .output()
        .expect("kubectl label");
    let namespaces = Api::<Namespace>::all(client.clone());
    eventually(
        "the removed label to be put back",
        Duration::from_secs(30),
        || async {
            let ns = namespaces.get(&names[0]).await.map_err(|e| e.to_string())?;
            let labels = ns.metadata.labels.unwrap_or_default();
            match labels.get(&label).map(String::as_str) {
                Some("true") => Ok(()),
                other => Err(format!("{label}={other:?}")),
            }
        },
    )
    .await;

    // Deleting the rules takes the labels away.
    plane
        .kubectl()
        .args([
            "delete",
            "mutationrules.initium.dev",
            "--all-namespaces",
            "--all",
            "--wait=false",
        ])
        .output()
        .expect("kubectl delete");
    eventually(
        "the labels to go with the rules",
        Duration::from_secs(300),
        || async {
            let left = namespaces
                .list(&ListParams::default().labels(&label))
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            if left == 0 {
                Ok(())
            } else {
                Err(format!("{left} namespaces still labeled"))
            }
        },
    )
    .await;
}

/// A ValidatingAdmissionPolicy that refuses a MutatingWebhookConfiguration `name`
/// intercepting ConfigMaps (as a cluster's own guard rails might), and its binding.
fn refusing_policy(name: &str) -> String {
    format!(
        r#"apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {{name: {name}}}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
      - apiGroups: [admissionregistration.k8s.io]
        apiVersions: [v1]
        operations: [CREATE, UPDATE]
        resources: [mutatingwebhookconfigurations]
        resourceNames: [{name}]
  validations:
    - expression: "!has(object.webhooks) || !object.webhooks.exists(w, has(w.rules) && w.rules.exists(r, has(r.resources) && 'configmaps' in r.resources))"
      message: "webhooks on ConfigMaps are not allowed in this cluster (test policy)"
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {{name: {name}}}
spec:
  policyName: {name}
  validationActions: [Deny]
"#
    )
}

#[tokio::test]
async fn a_configuration_the_api_server_refuses_leaves_its_rules_not_ready_with_the_reason() {
    let _serial = serial().await;
    let plane = Plane::shared();
    plane.install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    let client = plane.client().await.unwrap_or_else(|e| panic!("{e:#}"));
    let serving = Serving::start_on(plane, &[]);
    let team = unique("refused");
    plane
        .ensure_namespace(&team, &[])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let rule = |name: &str, kind: &str| {
        json!({
            "apiVersion": "initium.dev/v1alpha1",
            "kind": "MutationRule",
            "metadata": {"name": name, "namespace": team},
            "spec": {
                "match": {"kinds": [kind]},
                "mutations": [{"merge": {"metadata": {"labels": {"example.com/seen": "yes"}}}}],
            },
        })
    };
    let rules: Api<kube::api::DynamicObject> =
        Api::namespaced_with(client.clone(), &team, &mutation_rules());
    let ready_condition = |name: &'static str| {
        let rules = rules.clone();
        async move {
            let rule = rules.get(name).await.map_err(|e| e.to_string())?;
            rule.data["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "Ready")
                .cloned()
                .ok_or_else(|| format!("no Ready condition: {}", rule.data["status"]))
        }
    };
    let until_ready = async |name: &'static str, timeout: Duration| {
        eventually(&format!("the rule {name} to be Ready"), timeout, || async {
            let c = ready_condition(name).await?;
            (c["status"] == "True").then_some(()).ok_or(c.to_string())
        })
        .await
    };
    create_rules(&client, &[rule("pods", "Pod")], 1)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    until_ready("pods", Duration::from_secs(60)).await;

    // The cluster's policy: no webhooks on ConfigMaps for this configuration.
    let policy = serving.name.clone();
    plane
        .apply(&refusing_policy(&policy))
        .unwrap_or_else(|e| panic!("{e:#}"));
    // The API server enforces a new policy once its informers have it.
    eventually(
        "the policy to be enforced",
        Duration::from_secs(30),
        || async {
            let out = plane
                .kubectl()
                .args([
                    "patch",
                    "mutatingwebhookconfiguration",
                    &serving.name,
                    "--dry-run=server",
                    "--type=json",
                    "-p",
                    r#"[{"op":"add","path":"/webhooks/0/rules/0/resources/-","value":"configmaps"}]"#,
                ])
                .output()
                .map_err(|e| e.to_string())?;
            let stderr = String::from_utf8_lossy(&out.stderr).to_string();
            if !out.status.success() && stderr.contains("not allowed in this cluster") {
                Ok(())
            } else {
                Err(format!("not refused yet: {stderr}"))
            }
        },
    )
    .await;

    create_rules(&client, &[rule("configmaps", "ConfigMap")], 1)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let condition = eventually(
        "the ConfigMap rule to say the configuration was refused",
        Duration::from_secs(60),
        || async {
            let c = ready_condition("configmaps").await?;
            if c["reason"] == "WebhookConfigurationRefused" {
                Ok(c)
            } else {
                Err(c.to_string())
            }
        },
    )
    .await;
    assert_eq!(condition["status"], "False");
    let message = condition["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("webhooks on ConfigMaps are not allowed in this cluster (test policy)")
            && message.contains(&serving.name),
        "{message}"
    );
    // The rule already in effect stays Ready.
    let pods = ready_condition("pods").await.expect("the Pod rule");
    assert_eq!(pods["status"], "True", "{pods}");
    // The metrics say so.
    let (_, metrics) = serving.initium.get("/metrics").expect("/metrics");
    assert_eq!(
        metric_sum(&metrics, "initium_webhook_configuration_refused"),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "initium_rules{state=\"refused\""),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "initium_rules{state=\"ready\""),
        1.0,
        "only the Pod rule counts as ready: {metrics}"
    );
    assert!(
        metric_sum(
            &metrics,
            "initium_webhook_configuration_writes_total{result=\"refused\""
        ) >= 1.0
    );
    // Log lines stay short, however long the API server's answer.
    let log = std::fs::read_to_string(&serving.initium.log).expect("the log");
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("updating the webhook configurations failed"))
        .collect();
    assert!(!refusals.is_empty(), "the refusal is logged");
    for line in refusals {
        assert!(line.len() < 4096, "a {} byte log line", line.len());
    }

    // The policy gone, the rule gets Ready (at the next retry: at most 32 s of backoff).
    for kind in [
        "validatingadmissionpolicybinding",
        "validatingadmissionpolicy",
    ] {
        plane
            .kubectl()
            .args(["delete", kind, &policy])
            .output()
            .expect("kubectl delete");
    }
    until_ready("configmaps", Duration::from_secs(90)).await;
    let (_, metrics) = serving.initium.get("/metrics").expect("/metrics");
    assert_eq!(
        metric_sum(&metrics, "initium_webhook_configuration_refused"),
        0.0
    );
    assert_eq!(metric_sum(&metrics, "initium_rules{state=\"refused\""), 0.0);
    let _ = plane
        .kubectl()
        .args(["delete", "namespace", &team, "--wait=false"])
        .output();
}
