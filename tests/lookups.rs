//! Lookups (`spec.lookups`) on a real API server: `initium serve` runs out of cluster, watches
//! the ConfigMaps its Ready rules name, and the API server's admission of Pods shows what the
//! rules read: the value of a ConfigMap created after the rule, its new value after an
//! update, and once it is deleted a denial (`failurePolicy: Fail`) or an unmutated Pod with a
//! warning (`Ignore`). A ClusterMutationRule without a namespace reads the ConfigMap of each
//! Pod's own namespace.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use support::serving::Serving;
use support::{Plane, eventually, install_crds, namespace, serial, unique};

/// Generous on a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(60);

/// `kubectl <args> -f -` with `yaml`: (succeeded, stdout, stderr).
fn kubectl_with(args: &[&str], yaml: &str) -> (bool, String, String) {
    let args: Vec<&str> = args.iter().copied().chain(["-f", "-"]).collect();
    let out = Plane::shared()
        .kubectl_stdin(&args, yaml)
        .unwrap_or_else(|e| panic!("{e:#}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Applies a rule of either kind and waits until its status says this generation is Ready.
async fn apply_rule(rule: Value) {
    let (ok, _, err) = kubectl_with(&["apply", "--server-side"], &rule.to_string());
    assert!(ok, "apply {rule}: {err}");
    let kind = rule["kind"].as_str().unwrap().to_lowercase();
    let name = rule["metadata"]["name"].as_str().unwrap();
    let mut args = vec!["get", &kind, name, "-o", "json"];
    if let Some(ns) = rule["metadata"]["namespace"].as_str() {
        args.extend(["-n", ns]);
    }
    eventually(&format!("{kind} {name} to be Ready"), WAIT, || async {
        let out = support::kubectl()
            .args(&args)
            .output()
            .map_err(|e| e.to_string())?;
        let rule: Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
        let status = &rule["status"];
        let ready = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        if ready && status["observedGeneration"] == rule["metadata"]["generation"] {
            Ok(())
        } else {
            Err(format!("status {status}"))
        }
    })
    .await;
}

/// Creates Pods labelled `policy=<policy>` until one is denied with a message containing
/// `want`; returns the message.
async fn wait_denied(pods: &Api<Pod>, policy: &str, want: &str) -> String {
    eventually(&format!("a {policy} Pod to be denied"), WAIT, || async {
        match pods.create(&PostParams::default(), &pod(policy)).await {
            Ok(created) => Err(format!(
                "admitted with registry {:?}",
                annotation(&created, "registry")
            )),
            Err(e) if e.to_string().contains(want) => Ok(e.to_string()),
            Err(e) => Err(format!("denied otherwise: {e}")),
        }
    })
    .await
}

/// A MutationRule reading ConfigMap `registry` as `mirror` into the annotation `registry` of
/// the Pods labelled `policy=<policy>`.
fn mirror_rule(namespace: &str, name: &str, policy: &str) -> Value {
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "failurePolicy": policy,
            "match": {"kinds": ["Pod"], "labels": {"matchLabels": {"policy": policy}}},
            "lookups": [{"name": "mirror", "configMap": {"name": "registry"}}],
            "mutations": [{"merge": {"metadata": {"annotations": {
                "registry": "{{ lookups.mirror.data.registry }}",
            }}}}],
        },
    })
}

fn pod(policy: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"generateName": format!("{}-", policy.to_lowercase()),
                     "labels": {"policy": policy}},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]},
    }))
    .unwrap()
}

fn annotation(pod: &Pod, key: &str) -> Option<String> {
    pod.metadata.annotations.as_ref()?.get(key).cloned()
}

/// Creates Pods labelled `policy=<policy>` until one comes out with annotation `registry`
/// equal to `want`: the watch reaches initium a moment after the API server has the change.
async fn wait_registry(pods: &Api<Pod>, policy: &str, want: &str) {
    eventually(
        &format!("a {policy} Pod with registry {want}"),
        WAIT,
        || async {
            let created = pods
                .create(&PostParams::default(), &pod(policy))
                .await
                .map_err(|e| format!("denied: {e}"))?;
            match annotation(&created, "registry") {
                Some(value) if value == want => Ok(()),
                other => Err(format!("registry {other:?}")),
            }
        },
    )
    .await;
}

fn config_map(value: &str) -> ConfigMap {
    serde_json::from_value(json!({
        "metadata": {"name": "registry"},
        "data": {"registry": value},
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_get_the_value_of_the_config_map_as_it_is_now() {
    let _serial = serial().await;
    install_crds();
    let client = support::client().await;
    let ns = namespace(&client, "lookups").await;
    let serving = Serving::start_on(Plane::shared(), &[]);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);

    // The rules first: the ConfigMap does not exist yet, so a Fail Pod is denied.
    apply_rule(mirror_rule(&ns, "fail-rule", "Fail")).await;
    apply_rule(mirror_rule(&ns, "ignore-rule", "Ignore")).await;
    let missing = format!(
        "MutationRule {ns}/fail-rule (failurePolicy Fail) failed: spec.lookups[0]: ConfigMap {ns}/registry (lookup \"mirror\") does not exist: create it, or change the lookup"
    );
    wait_denied(&pods, "Fail", &missing).await;

    // Created: the next Pods get its value.
    config_maps
        .create(&PostParams::default(), &config_map("mirror.one.example"))
        .await
        .unwrap();
    wait_registry(&pods, "Fail", "mirror.one.example").await;
    wait_registry(&pods, "Ignore", "mirror.one.example").await;

    // Updated: the next Pods get the new value.
    config_maps
        .patch(
            "registry",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"registry": "mirror.two.example"}})),
        )
        .await
        .unwrap();
    wait_registry(&pods, "Fail", "mirror.two.example").await;

    // Deleted: Fail denies with the sentence; Ignore lets the Pod through unmutated.
    config_maps
        .delete("registry", &DeleteParams::default())
        .await
        .unwrap();
    wait_denied(&pods, "Fail", &missing).await;
    let ignore_pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "ignored", "namespace": ns, "labels": {"policy": "Ignore"}},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]},
    });
    let (ok, out, warnings) = kubectl_with(&["create", "-o", "json"], &ignore_pod.to_string());
    assert!(ok, "the Ignore Pod is admitted: {warnings}");
    let stored: Pod = serde_json::from_str(&out).unwrap();
    assert_eq!(annotation(&stored, "registry"), None, "unmutated");
    assert_eq!(annotation(&stored, "initium.dev/mutated-by"), None);
    assert!(
        warnings.contains(&format!(
            "MutationRule {ns}/ignore-rule skipped: spec.lookups[0]: ConfigMap {ns}/registry (lookup \"mirror\") does not exist"
        )),
        "the client is told: {warnings}"
    );
    drop(serving);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_rule_reads_the_config_map_of_each_pods_namespace() {
    let _serial = serial().await;
    install_crds();
    let client = support::client().await;
    let a = namespace(&client, "lookups-a").await;
    let b = namespace(&client, "lookups-b").await;
    let serving = Serving::start_on(Plane::shared(), &[]);
    for (ns, team) in [(&a, "alpha"), (&b, "beta")] {
        let info: ConfigMap = serde_json::from_value(json!({
            "metadata": {"name": "team-info"}, "data": {"team": team},
        }))
        .unwrap();
        Api::<ConfigMap>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &info)
            .await
            .unwrap();
    }
    let rule_name = unique("team-label");
    apply_rule(json!({
            "apiVersion": "initium.dev/v1alpha1",
            "kind": "ClusterMutationRule",
            "metadata": {"name": rule_name},
            "spec": {
                "failurePolicy": "Fail",
                "match": {"kinds": ["Pod"], "namespaces": [a, b]},
                "lookups": [{"name": "info", "configMap": {"name": "team-info"}}],
                "mutations": [{"merge": {"metadata": {"labels": {"team": "{{ lookups.info.data.team }}"}}}}],
            },
    }))
    .await;
    for (ns, team) in [(&a, "alpha"), (&b, "beta")] {
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        let label = eventually(&format!("a Pod in {ns} labelled"), WAIT, || async {
            let created = pods
                .create(&PostParams::default(), &pod("any"))
                .await
                .map_err(|e| format!("denied: {e}"))?;
            Ok::<_, String>(
                created
                    .metadata
                    .labels
                    .unwrap_or_default()
                    .get("team")
                    .cloned(),
            )
        })
        .await;
        assert_eq!(label.as_deref(), Some(team), "in {ns}");
    }
    let _ = support::kubectl()
        .args(["delete", "cmr", &rule_name, "--ignore-not-found"])
        .output();
    drop(serving);
}
