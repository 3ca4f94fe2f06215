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

use support::cluster::wait_rule_ready;
use support::commands::kubectl_try;
use support::serving::Serving;
use support::{Plane, eventually, install_crds, namespace, serial, unique};

/// Generous on a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(60);

/// `kubectl <args> -f -` with `yaml`: (succeeded, stdout, stderr).
fn kubectl_with(args: &[&str], yaml: &str) -> (bool, String, String) {
    let args: Vec<&str> = args.iter().copied().chain(["-f", "-"]).collect();
    kubectl_try(&args, Some(yaml))
}

/// Applies a rule of either kind and waits until its status says this generation is Ready.
async fn apply_rule(rule: Value) {
    let (ok, _, err) = kubectl_with(&["apply", "--server-side"], &rule.to_string());
    assert!(ok, "apply {rule}: {err}");
    wait_rule_ready(
        &support::client().await,
        rule["kind"].as_str().unwrap(),
        rule["metadata"]["namespace"].as_str(),
        rule["metadata"]["name"].as_str().unwrap(),
        WAIT,
    )
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

/// The `Ready` condition of a rule whose status is for its current generation: (status,
/// reason, message).
fn ready_condition(
    kind: &str,
    namespace: Option<&str>,
    name: &str,
) -> Result<(String, String, String), String> {
    let mut args = vec!["get", kind, name, "-o", "json"];
    if let Some(ns) = namespace {
        args.extend(["-n", ns]);
    }
    let out = support::kubectl()
        .args(&args)
        .output()
        .map_err(|e| e.to_string())?;
    let rule: Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    let status = &rule["status"];
    if status["observedGeneration"] != rule["metadata"]["generation"] {
        return Err(format!("status not yet for this generation: {status}"));
    }
    let condition = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .ok_or_else(|| format!("no Ready condition: {status}"))?;
    let text = |key: &str| condition[key].as_str().unwrap_or_default().to_string();
    Ok((text("status"), text("reason"), text("message")))
}

/// A MutationRule labelled for Pods `policy=shared` that looks up `config_maps` (as `l0`,
/// `l1`, ...) and writes the key `v` of the first into the annotation `annotation`.
fn shared_rule(namespace: &str, name: &str, config_maps: &[String], annotation: &str) -> Value {
    let lookups: Vec<Value> = config_maps
        .iter()
        .enumerate()
        .map(|(i, cm)| json!({"name": format!("l{i}"), "configMap": {"name": cm}}))
        .collect();
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "failurePolicy": "Fail",
            "match": {"kinds": ["Pod"], "labels": {"matchLabels": {"policy": "shared"}}},
            "lookups": lookups,
            "mutations": [{"merge": {"metadata": {"annotations": {
                annotation: "{{ lookups.l0.data.v }}",
            }}}}],
        },
    })
}

fn data_config_map(name: &str, value: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"v": value}})).unwrap()
}

/// Creates Pods labelled `policy=shared` until one comes out with every annotation of
/// `annotations`.
async fn wait_annotations(pods: &Api<Pod>, annotations: &[(&str, String)]) {
    eventually("a Pod with the looked-up values", WAIT, || async {
        let created = pods
            .create(&PostParams::default(), &pod("shared"))
            .await
            .map_err(|e| format!("denied: {e}"))?;
        let seen: Vec<(&str, Option<String>)> = annotations
            .iter()
            .map(|(k, _)| (*k, annotation(&created, k)))
            .collect();
        if annotations
            .iter()
            .all(|(k, v)| annotation(&created, k).as_ref() == Some(v))
        {
            Ok(())
        } else {
            Err(format!("annotations {seen:?}"))
        }
    })
    .await;
}

/// Rules in one namespace that look up this many distinct ConfigMaps (within the default
/// quota, 64).
const SHARED_NAMES: usize = 60;
/// MutationRules of 8 lookups each over those names.
const SHARED_RULES: usize = 40;

/// 40 MutationRules of 8 lookups each over 60 ConfigMaps of one namespace (among 100 others
/// no rule names), and a ClusterMutationRule reading 8 names in each Pod's own namespace:
/// initium opens 2 watches for them (one for the namespace, one across namespaces), keeps the
/// 68 ConfigMaps named and none of the others, and a changed ConfigMap still reaches the next
/// Pod. The build before opened one watch, and so one TCP connection, per name: 68 more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_lookups_of_a_namespace_share_one_watch_and_still_follow_their_config_maps() {
    let _serial = serial().await;
    install_crds();
    let client = support::client().await;
    let plane = Plane::shared();
    let ns = namespace(&client, "lookups-shared").await;
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for j in 0..SHARED_NAMES {
        config_maps
            .create(
                &PostParams::default(),
                &data_config_map(&format!("cm-{j}"), &format!("value-{j}")),
            )
            .await
            .unwrap();
    }
    for k in 0..8 {
        config_maps
            .create(
                &PostParams::default(),
                &data_config_map(&format!("team-{k}"), &format!("team-value-{k}")),
            )
            .await
            .unwrap();
    }
    for j in 0..100 {
        config_maps
            .create(
                &PostParams::default(),
                &data_config_map(&format!("noise-{j}"), "x"),
            )
            .await
            .unwrap();
    }
    let serving = Serving::start_on(plane, &[]);
    let initium = &serving.initium;
    // What initium holds before these rules (rules of earlier tests may look things up too).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let connections_before = initium.api_server_connections(plane).unwrap();
    let watches_before = initium.metric("initium_lookup_watches").unwrap();
    let objects_before = initium.metric("initium_lookup_objects").unwrap();

    let mut rules: Vec<Value> = (0..SHARED_RULES)
        .map(|i| {
            let names: Vec<String> = (0..8)
                .map(|l| format!("cm-{}", (i * 8 + l) % SHARED_NAMES))
                .collect();
            shared_rule(&ns, &format!("r{i}"), &names, &format!("r{i}"))
        })
        .collect();
    let cluster_rule = unique("lookups-shared");
    let team_lookups: Vec<Value> = (0..8)
        .map(|k| json!({"name": format!("t{k}"), "configMap": {"name": format!("team-{k}")}}))
        .collect();
    rules.push(json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "ClusterMutationRule",
        "metadata": {"name": cluster_rule},
        "spec": {
            "failurePolicy": "Fail",
            "match": {"kinds": ["Pod"], "namespaces": [ns], "labels": {"matchLabels": {"policy": "shared"}}},
            "lookups": team_lookups,
            "mutations": [{"merge": {"metadata": {"annotations": {"team": "{{ lookups.t0.data.v }}"}}}}],
        },
    }));
    let list = json!({"apiVersion": "v1", "kind": "List", "items": rules});
    let (ok, _, err) = kubectl_with(&["apply", "--server-side"], &list.to_string());
    assert!(ok, "apply the rules: {err}");
    for i in 0..SHARED_RULES {
        let name = format!("r{i}");
        eventually(&format!("rule {name} to be Ready"), WAIT, || async {
            match ready_condition("mutationrule", Some(&ns), &name)? {
                (status, ..) if status == "True" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    }
    eventually("the cluster rule to be Ready", WAIT, || async {
        match ready_condition("clustermutationrule", None, &cluster_rule)? {
            (status, ..) if status == "True" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // Every rule reads what it names: a Pod gets the values.
    wait_annotations(
        &pods,
        &[
            ("r0", "value-0".into()),
            ("r39", format!("value-{}", (39 * 8) % SHARED_NAMES)),
            ("team", "team-value-0".into()),
        ],
    )
    .await;

    let connections = initium.api_server_connections(plane).unwrap();
    let watches = initium.metric("initium_lookup_watches").unwrap();
    let objects = initium.metric("initium_lookup_objects").unwrap();
    eprintln!(
        "connections to the API server: {connections_before} before the rules, {connections} after; \
         lookup watches {watches_before} -> {watches}; ConfigMaps kept {objects_before} -> {objects}"
    );
    // 68 names: the build before held 68 watches, each its own connection. Now 2 watches; the
    // rest of the margin is for idle connections the status writes leave in the pool.
    assert!(
        connections <= connections_before + 12,
        "{connections} connections to the API server, {connections_before} before the rules: \
         lookups hold one connection per name, not per namespace"
    );
    assert_eq!(
        watches - watches_before,
        2.0,
        "one watch for the namespace, one for every namespace"
    );
    assert_eq!(
        objects - objects_before,
        (SHARED_NAMES + 8) as f64,
        "only the ConfigMaps rules name are kept, not the 100 others"
    );

    // A change of a ConfigMap reaches the next Pod; cm-0 is the first lookup of r0, r15, r30.
    config_maps
        .patch(
            "cm-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"v": "changed"}})),
        )
        .await
        .unwrap();
    config_maps
        .patch(
            "team-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"v": "team-changed"}})),
        )
        .await
        .unwrap();
    wait_annotations(
        &pods,
        &[
            ("r0", "changed".into()),
            ("r15", "changed".into()),
            ("r1", "value-8".into()),
            ("team", "team-changed".into()),
        ],
    )
    .await;

    let _ = support::kubectl()
        .args(["delete", "cmr", &cluster_rule, "--ignore-not-found"])
        .output();
    let _ = support::kubectl()
        .args(["delete", "mr", "--all", "-n", &ns, "--wait=false"])
        .output();
    drop(serving);
}

/// `--max-lookups-per-namespace 3`: the first rule of a namespace takes 2 ConfigMaps, the
/// next would add 2 more and is not Ready with a sentence naming the quota and the flag, a
/// rule reading only ConfigMaps admitted already is Ready, and so is a ClusterMutationRule
/// reading 5 (exempt). Deleting the rules that read the first two makes the refused one
/// Ready. The build before has no such flag (and no quota).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_over_the_lookup_quota_of_their_namespace_are_not_ready_and_say_why() {
    let _serial = serial().await;
    install_crds();
    let client = support::client().await;
    let ns = namespace(&client, "lookups-quota").await;
    let serving = Serving::start_on(Plane::shared(), &["--max-lookups-per-namespace", "3"]);
    let names = |n: &[&str]| -> Vec<String> { n.iter().map(|s| s.to_string()).collect() };
    apply_rule(shared_rule(&ns, "first", &names(&["a", "b"]), "first")).await;
    let (ok, _, err) = kubectl_with(
        &["apply", "--server-side"],
        &shared_rule(&ns, "second", &names(&["c", "d"]), "second").to_string(),
    );
    assert!(ok, "{err}");
    let message = eventually("rule second to be refused", WAIT, || async {
        match ready_condition("mutationrule", Some(&ns), "second")? {
            (status, reason, message) if status == "False" && reason == "LookupQuotaExceeded" => {
                Ok(message)
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(
        message,
        format!(
            "spec.lookups: the MutationRules of namespace {ns} may look up at most 3 distinct ConfigMaps together (the lookup quota, initium serve --max-lookups-per-namespace=3); its other Ready rules look up 2, and this rule would add 2 more (c, d): read ConfigMaps those rules read already, put the values in fewer ConfigMaps, or delete rules that no longer need theirs, and the rule becomes Ready by itself; or ask a cluster administrator to raise --max-lookups-per-namespace"
        )
    );
    apply_rule(shared_rule(&ns, "third", &names(&["b", "a"]), "third")).await;
    let cluster_rule = unique("lookups-quota");
    let five: Vec<Value> = (0..5)
        .map(|k| json!({"name": format!("p{k}"), "configMap": {"name": format!("p-{k}"), "namespace": ns}}))
        .collect();
    apply_rule(json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "ClusterMutationRule",
        "metadata": {"name": cluster_rule},
        "spec": {
            "match": {"kinds": ["Pod"], "namespaces": [ns], "labels": {"matchLabels": {"policy": "none"}}},
            "lookups": five,
            "mutations": [{"merge": {"metadata": {"annotations": {"p": "{{ lookups.p0.data.v }}"}}}}],
        },
    }))
    .await;

    // Both rules reading a and b gone: second fits.
    for name in ["first", "third"] {
        let (ok, _, err) =
            kubectl_with(&["delete"], &shared_rule(&ns, name, &[], name).to_string());
        assert!(ok, "{err}");
    }
    eventually(
        "rule second to be Ready once first is gone",
        WAIT,
        || async {
            match ready_condition("mutationrule", Some(&ns), "second")? {
                (status, ..) if status == "True" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let _ = support::kubectl()
        .args(["delete", "cmr", &cluster_rule, "--ignore-not-found"])
        .output();
    drop(serving);
}

/// Issue 30, finding 7, at its scale (heavy, so run by hand: `cargo test --test lookups --
/// --ignored at_scale`): 750 MutationRules of 8 lookups each, every name distinct, in one
/// namespace, the quota raised out of the way. Prints initium's API server connections, its
/// RSS, the lookup watches and how long a new replica takes to be ready; asserts only that
/// the connections stay far below one per name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "heavy: 750 rules; run by hand for the figures in docs/reliability.md"]
async fn at_scale_750_rules_of_8_lookups_hold_a_handful_of_connections() {
    let _serial = serial().await;
    install_crds();
    let client = support::client().await;
    let plane = Plane::shared();
    let ns = namespace(&client, "lookups-scale").await;
    // The build before this change has no quota flag.
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_initium"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let extra: Vec<&str> =
        if String::from_utf8_lossy(&help.stdout).contains("--max-lookups-per-namespace") {
            vec!["--max-lookups-per-namespace", "100000"]
        } else {
            vec![]
        };
    // kube-apiserver's RSS, when this test runs the plane (its pid file is in its directory).
    let api_server_rss = || -> Option<u64> {
        let pid = std::fs::read_to_string(plane.dir()?.join("kube-apiserver.pid")).ok()?;
        Some(
            support::measure::memory(pid.trim().parse().ok()?)
                .ok()?
                .rss_kib,
        )
    };
    let mut serving = Serving::start_on(plane, &extra);
    let before = serving.initium.api_server_connections(plane).unwrap();
    let api_server_before = api_server_rss();
    let rules: Vec<Value> = (0..750)
        .map(|i| {
            let names: Vec<String> = (0..8).map(|l| format!("cm-{i}-{l}")).collect();
            shared_rule(&ns, &format!("r{i}"), &names, "x")
        })
        .collect();
    let ready_before = serving
        .initium
        .metric("initium_rules{state=\"ready\"")
        .unwrap();
    for chunk in rules.chunks(250) {
        let list = json!({"apiVersion": "v1", "kind": "List", "items": chunk});
        let (ok, _, err) = kubectl_with(&["apply", "--server-side"], &list.to_string());
        assert!(ok, "apply the rules: {err}");
    }
    let started = std::time::Instant::now();
    eventually(
        "750 rules in the index",
        Duration::from_secs(300),
        || async {
            let ready = serving
                .initium
                .metric("initium_rules{state=\"ready\"")
                .map_err(|e| e.to_string())?;
            if ready - ready_before >= 750.0 {
                Ok(())
            } else {
                Err(format!("{ready} ready"))
            }
        },
    )
    .await;
    // Let the watches open and list.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let connections = serving.initium.api_server_connections(plane).unwrap();
    let memory = serving.initium.memory().unwrap();
    let watches = serving.initium.metric("initium_lookup_watches").unwrap();
    eprintln!(
        "750 rules x 8 lookups: index after {:.1} s; connections {before} -> {connections}; \
         RSS {} KiB (peak {} KiB); lookup watches {watches}; kube-apiserver RSS {:?} -> {:?} KiB",
        started.elapsed().as_secs_f64(),
        memory.rss_kib,
        memory.peak_kib,
        api_server_before,
        api_server_rss(),
    );
    // A new replica, as after a restart: time until /readyz says ready.
    serving.kill();
    let started = std::time::Instant::now();
    let replica = serving.replica(&extra);
    let ready_after = started.elapsed();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let replica_connections = replica.api_server_connections(plane).unwrap();
    let replica_memory = replica.memory().unwrap();
    eprintln!(
        "a new replica: ready after {:.1} s, connections {replica_connections}, RSS {} KiB",
        ready_after.as_secs_f64(),
        replica_memory.rss_kib
    );
    drop(replica);
    let _ = support::kubectl()
        .args(["delete", "mr", "--all", "-n", &ns, "--wait=false"])
        .output();
    assert!(connections < before + 100, "{connections} connections");
    drop(serving);
}
