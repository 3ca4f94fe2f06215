//! `initium serve --compile-rules auto` on a real kube-apiserver (1.36+ serves
//! MutatingAdmissionPolicy v1): Ready rules a policy does exactly are served by the API server
//! itself, the webhook configuration covers only what is left (none at all when nothing is),
//! Pods are mutated as before while initium is stopped, a namespace's rule acts in that
//! namespace only, and a rule goes back to the webhook (its policy deleted) when an earlier
//! rule may meet its objects. The field-for-field proof that a compiled policy does what the
//! webhook does is tests/compiled.rs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};

use support::cluster::{create_rules, rule_resource};
use support::process::{Initium, InitiumOptions};
use support::{Plane, eventually, serial, unique};

const TIMEOUT: Duration = Duration::from_secs(60);

fn policies(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "admissionregistration.k8s.io/v1".into(),
            kind: "MutatingAdmissionPolicy".into(),
            plural: "mutatingadmissionpolicies".into(),
        },
    )
}

fn bindings(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "admissionregistration.k8s.io/v1".into(),
            kind: "MutatingAdmissionPolicyBinding".into(),
            plural: "mutatingadmissionpolicybindings".into(),
        },
    )
}

/// The generated policies of installation `owner`, by name.
async fn generated(client: &kube::Client, owner: &str) -> Vec<String> {
    let params = ListParams::default().labels(&format!("initium.dev/compiled-by={owner}"));
    let mut names: Vec<String> = policies(client)
        .list_metadata(&params)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    names.sort();
    names
}

/// A rule's `ServedByAPIServer` condition: (status, message).
async fn served(
    client: &kube::Client,
    kind: &str,
    namespace: Option<&str>,
    name: &str,
) -> Option<(String, String)> {
    let resource = rule_resource(kind).unwrap();
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let rule = api.get(name).await.ok()?;
    rule.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "ServedByAPIServer")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_string(),
                c["message"].as_str().unwrap_or_default().to_string(),
            )
        })
}

async fn wait_served(
    client: &kube::Client,
    kind: &str,
    namespace: Option<&str>,
    name: &str,
    want: &str,
) -> String {
    eventually(
        &format!("{kind} {name} to have ServedByAPIServer={want}"),
        TIMEOUT,
        || async {
            match served(client, kind, namespace, name).await {
                Some((status, message)) if status == want => Ok(message),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
}

/// Whether the API server serves MutatingAdmissionPolicy v1 (Kubernetes 1.36 and later).
async fn serves_policies(client: &kube::Client) -> bool {
    client
        .list_api_group_resources("admissionregistration.k8s.io/v1")
        .await
        .is_ok_and(|list| {
            list.resources
                .iter()
                .any(|r| r.name == "mutatingadmissionpolicies")
        })
}

fn pod(name: &str, annotations: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]},
    }))
    .unwrap()
}

fn labels_rule(namespace: &str, priority: i32) -> Value {
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": "team", "namespace": namespace},
        "spec": {
            "priority": priority,
            "match": {"kinds": ["Pod"]},
            "mutations": [
                {"merge": {"metadata": {"labels": {"team": "{{ $.metadata.namespace }}"}}}},
                {"upsert": {"path": "/spec/volumes", "key": "name",
                            "value": {"name": "team-ca", "secret": {"secretName": "team-ca", "defaultMode": 420}}}},
            ],
        },
    })
}

/// Deletes what a test made: its namespaces (and so their rules), its cluster rules, the policies generated for them, its
/// webhook configuration.
async fn clean(client: &kube::Client, owner: &str, cluster_rules: &[&str], namespaces: &[&str]) {
    let namespace_api = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone());
    for ns in namespaces {
        let _ = namespace_api.delete(ns, &DeleteParams::default()).await;
    }
    let resource = rule_resource("ClusterMutationRule").unwrap();
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    for name in cluster_rules {
        let _ = api.delete(name, &DeleteParams::default()).await;
    }
    let params = ListParams::default().labels(&format!("initium.dev/compiled-by={owner}"));
    let _ = bindings(client)
        .delete_collection(&DeleteParams::default(), &params)
        .await;
    let _ = policies(client)
        .delete_collection(&DeleteParams::default(), &params)
        .await;
    let _ = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .delete(owner, &DeleteParams::default())
        .await;
    // Its rule validation webhook (failurePolicy Fail) would refuse every rule once initium
    // is gone.
    let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .delete(owner, &DeleteParams::default())
        .await;
}

#[tokio::test]
async fn with_only_compilable_rules_initium_can_stop_and_pods_are_still_mutated() {
    let _serial = serial().await;
    let plane = Plane::shared();
    plane.install_crds().unwrap();
    let client = plane.client().await.unwrap();
    let owner = unique("compiled");
    let (a, b, c) = (unique("tenant-a"), unique("tenant-b"), unique("tenant-c"));
    plane.ensure_namespace(&c, &[]).unwrap();
    let sidecar = unique("sidecar-deployments");
    let rules = vec![
        labels_rule(&a, 100),
        labels_rule(&b, 100),
        json!({
            "apiVersion": "initium.dev/v1alpha1",
            "kind": "ClusterMutationRule",
            "metadata": {"name": sidecar},
            "spec": {
                "priority": 50,
                "match": {"kinds": ["apps/v1/Deployment"], "annotations": {"sidecar.initium.dev/inject": "envoy"}},
                "mutations": [{"merge": {"spec": {"template": {"metadata": {"annotations": {"sidecar.initium.dev/inject": "envoy"}}}}}}],
            },
        }),
    ];
    create_rules(&client, &rules, 4).await.unwrap();
    let log = std::env::temp_dir().join(format!("{owner}.log"));
    let mut initium = Initium::start(
        plane,
        InitiumOptions {
            namespace: unique("initium"),
            extra: vec![
                "--compile-rules".into(),
                "auto".into(),
                "--webhook-name".into(),
                owner.clone(),
            ],
            cpus: None,
            log: log.clone(),
        },
    )
    .unwrap();

    if !serves_policies(&client).await {
        // Before Kubernetes 1.36 (scripts/matrix runs this on every release): every rule stays
        // on the webhook, and says why.
        let message = wait_served(&client, "MutationRule", Some(&a), "team", "False").await;
        assert!(message.contains("Kubernetes 1.36"), "{message}");
        clean(&client, &owner, &[&sidecar], &[&a, &b, &c]).await;
        return;
    }
    for ns in [&a, &b] {
        let message = wait_served(&client, "MutationRule", Some(ns), "team", "True").await;
        assert!(
            message.contains(&format!("{owner}.mr.{ns}.team")),
            "{message}"
        );
    }
    wait_served(&client, "ClusterMutationRule", None, &sidecar, "True").await;
    let want = [
        format!("{owner}.cmr.{sidecar}"),
        format!("{owner}.mr.{a}.team"),
        format!("{owner}.mr.{b}.team"),
    ];
    // ServedByAPIServer=True says the policy is in effect: it exists already.
    let have = generated(&client, &owner).await;
    assert!(want.iter().all(|w| have.contains(w)), "{have:?}");
    let webhooks = Api::<MutatingWebhookConfiguration>::all(client.clone());
    eventually(
        "no MutatingWebhookConfiguration while every rule compiles",
        TIMEOUT,
        || async {
            match webhooks.get_opt(&owner).await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(c) => Err(format!(
                    "{:?}",
                    c.webhooks
                        .unwrap_or_default()
                        .iter()
                        .map(|w| &w.name)
                        .collect::<Vec<_>>()
                )),
            }
        },
    )
    .await;

    initium.kill();
    assert!(!initium.running(), "initium serve is stopped");

    // Stored (not dry-run) Pods: mutated by the API server alone.
    for ns in [&a, &b] {
        let pods = Api::<Pod>::namespaced(client.clone(), ns);
        let stored = pods
            .create(&PostParams::default(), &pod("web", json!({})))
            .await
            .unwrap();
        let meta = &stored.metadata;
        assert_eq!(
            meta.labels.as_ref().unwrap()["team"],
            ns.as_str(),
            "{meta:?}"
        );
        assert_eq!(
            meta.annotations.as_ref().unwrap()["initium.dev/mutated-by"],
            format!("{ns}/team")
        );
        let volumes = stored.spec.unwrap().volumes.unwrap();
        assert_eq!(volumes.len(), 1);
        assert_eq!(volumes[0].name, "team-ca");
        // Created again with the volume already there (as the API server defaults it, which
        // is what both initium and the policy compare with): nothing to change, nothing
        // recorded.
        let mut again = pod("again", json!({}));
        again.spec.as_mut().unwrap().volumes = Some(volumes.clone());
        again.metadata.labels = Some([("team".to_string(), ns.to_string())].into());
        let stored = pods.create(&PostParams::default(), &again).await.unwrap();
        assert!(
            stored
                .metadata
                .annotations
                .as_ref()
                .is_none_or(|a| !a.contains_key("initium.dev/mutated-by")),
            "an unchanged object is not recorded: {:?}",
            stored.metadata.annotations
        );
    }
    // Isolation: the tenants' rules do not act in another namespace.
    let elsewhere = Api::<Pod>::namespaced(client.clone(), &c)
        .create(&PostParams::default(), &pod("web", json!({})))
        .await
        .unwrap();
    assert!(
        elsewhere.metadata.labels.is_none(),
        "{:?}",
        elsewhere.metadata
    );
    assert!(
        elsewhere
            .spec
            .unwrap()
            .volumes
            .is_none_or(|v| v.iter().all(|v| v.name != "team-ca"))
    );
    let deployment: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "checkout", "annotations": {"sidecar.initium.dev/inject": "envoy"}},
        "spec": {"selector": {"matchLabels": {"app": "checkout"}},
                 "template": {"metadata": {"labels": {"app": "checkout"}},
                              "spec": {"containers": [{"name": "checkout", "image": "registry.example.com/checkout:1"}]}}},
    }))
    .unwrap();
    let stored = Api::<Deployment>::namespaced(client.clone(), &c)
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
    let template_annotations = stored
        .spec
        .unwrap()
        .template
        .metadata
        .unwrap()
        .annotations
        .unwrap();
    assert_eq!(template_annotations["sidecar.initium.dev/inject"], "envoy");
    assert!(webhooks.get_opt(&owner).await.unwrap().is_none());

    // A tenant cannot reach the generated objects.
    for verb in ["create", "delete", "patch"] {
        assert!(
            !support::commands::can_i(&[
                verb,
                "mutatingadmissionpolicies",
                &format!("--as=system:serviceaccount:{a}:default")
            ]),
            "a tenant's service account may {verb} policies"
        );
    }
    clean(&client, &owner, &[&sidecar], &[&a, &b, &c]).await;
}

#[tokio::test]
async fn a_rule_goes_back_to_the_webhook_when_an_earlier_rule_may_meet_its_objects() {
    let _serial = serial().await;
    let plane = Plane::shared();
    plane.install_crds().unwrap();
    let client = plane.client().await.unwrap();
    let owner = unique("compiled");
    let a = unique("tenant-a");
    create_rules(&client, &[labels_rule(&a, 100)], 2)
        .await
        .unwrap();
    let log = std::env::temp_dir().join(format!("{owner}.log"));
    let _initium = Initium::start(
        plane,
        InitiumOptions {
            namespace: unique("initium"),
            extra: vec![
                "--compile-rules".into(),
                "auto".into(),
                "--webhook-name".into(),
                owner.clone(),
            ],
            cpus: None,
            log,
        },
    )
    .unwrap();
    if !serves_policies(&client).await {
        eprintln!(
            "the API server serves no MutatingAdmissionPolicy v1 (before 1.36): nothing to compile"
        );
        clean(&client, &owner, &[], &[&a]).await;
        return;
    }
    wait_served(&client, "MutationRule", Some(&a), "team", "True").await;

    // An earlier rule for every Pod that the API server cannot serve (a regex rewrite).
    let first = unique("mirror");
    create_rules(
        &client,
        &[json!({
            "apiVersion": "initium.dev/v1alpha1",
            "kind": "ClusterMutationRule",
            "metadata": {"name": first},
            "spec": {
                "priority": 10,
                "match": {"kinds": ["Pod"]},
                "mutations": [{"forEach": "$.spec.containers[*]", "mutations": [
                    {"rewrite": {"path": "/image", "regex": "^registry\\.example\\.com/(.*)$", "replacement": "mirror.local/$1"}}]}],
            },
        })],
        1,
    )
    .await
    .unwrap();
    let message = wait_served(&client, "MutationRule", Some(&a), "team", "False").await;
    assert!(
        message.contains(&format!("ClusterMutationRule {first} comes before it")),
        "{message}"
    );
    eventually("the tenant's policy to be deleted", TIMEOUT, || async {
        let left = generated(&client, &owner).await;
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    })
    .await;
    // Both rules now run on the webhook, in their order.
    let stored = eventually("a Pod mutated by both rules", TIMEOUT, || async {
        let p = pod(&unique("web"), json!({}));
        let stored = Api::<Pod>::namespaced(client.clone(), &a)
            .create(
                &PostParams {
                    dry_run: true,
                    ..Default::default()
                },
                &p,
            )
            .await
            .map_err(|e| e.to_string())?;
        let by = stored
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("initium.dev/mutated-by").cloned())
            .unwrap_or_default();
        if by == format!("{first},{a}/team") {
            Ok(stored)
        } else {
            Err(by)
        }
    })
    .await;
    assert_eq!(
        stored.spec.unwrap().containers[0].image.as_deref(),
        Some("mirror.local/app:1")
    );

    // The earlier rule gone: compiled again, and no webhook left.
    let resource = rule_resource("ClusterMutationRule").unwrap();
    Api::<DynamicObject>::all_with(client.clone(), &resource)
        .delete(&first, &DeleteParams::default())
        .await
        .unwrap();
    wait_served(&client, "MutationRule", Some(&a), "team", "True").await;
    let webhooks = Api::<MutatingWebhookConfiguration>::all(client.clone());
    eventually(
        "the MutatingWebhookConfiguration to be deleted",
        TIMEOUT,
        || async {
            match webhooks.get_opt(&owner).await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(_) => Err("still there".into()),
            }
        },
    )
    .await;
    clean(&client, &owner, &[], &[&a]).await;
}
