//! initium on a whole cluster (`scripts/control-plane up --nodes 3`: kube-controller-manager,
//! kube-scheduler, nodes simulated by kwok): Pods created by real controllers, scheduled and
//! Running; what a user sees after admission (a Deployment rolling out, a Job finishing, a
//! Service with ready endpoints); and what happens to a retrying controller while initium is
//! down.
//!
//! `initium serve` runs as a process beside the cluster (`--webhook-url
//! https://127.0.0.1:PORT`). Rules and webhook configurations are seen cluster-wide, and
//! one test stops initium on purpose, so the tests run one at a time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Pod, Service};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use support::serving::{Serving, apply_rule};
use support::workloads::{self, cluster};
use support::{eventually, serial};

/// The label every test rule sets on the Pods it matches.
const STAMP: &str = "example.com/stamp";
/// The annotation every test rule sets on the Pods it matches.
const INITIALIZED: &str = "example.com/initialized";
/// Where initium records which rules changed an object.
const MUTATED_BY: &str = "initium.dev/mutated-by";

/// Generous on a loaded 2-core machine: a 10-Pod rollout takes a few seconds when idle.
const ROLLOUT: Duration = Duration::from_secs(120);

/// A MutationRule `name` in `namespace` that sets the label [`STAMP`] to `value` and the
/// annotation [`INITIALIZED`] on every Pod.
fn stamp_rule(namespace: &str, name: &str, failure_policy: &str, value: &str) -> String {
    format!(
        r#"apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  failurePolicy: {failure_policy}
  match: {{kinds: [Pod]}}
  mutations:
    - merge: {{metadata: {{labels: {{{STAMP}: "{value}"}}, annotations: {{{INITIALIZED}: "true"}}}}}}
"#
    )
}

/// Waits until a Pod created in `namespace` (a server-side dry run) carries the stamp
/// `value`: the rule is in initium's index and the API server calls initium for it.
async fn wait_for_stamp(client: &kube::Client, namespace: &str, value: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let probe: Pod = serde_json::from_value(json!({
        "metadata": {"generateName": "probe-"},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]}
    }))
    .unwrap();
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    eventually(
        &format!("a Pod created in {namespace} to be stamped {value:?}"),
        Duration::from_secs(30),
        || async {
            let pod = pods
                .create(&dry_run, &probe)
                .await
                .map_err(|e| e.to_string())?;
            match stamp(&pod) {
                Some(v) if v == value => Ok(()),
                other => Err(format!("stamp {other:?}")),
            }
        },
    )
    .await;
}

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

fn stamp(pod: &Pod) -> Option<&str> {
    label(pod, STAMP)
}

fn name(pod: &Pod) -> &str {
    pod.metadata.name.as_deref().unwrap_or_default()
}

/// Asserts the Pod carries the stamp `value`, the annotation, and initium's provenance
/// naming the rule `namespace/rule`.
fn assert_mutated(pod: &Pod, value: &str, rule: &str) {
    assert_eq!(stamp(pod), Some(value), "Pod {} is not stamped", name(pod));
    assert_eq!(
        annotation(pod, INITIALIZED),
        Some("true"),
        "Pod {} lacks {INITIALIZED}",
        name(pod)
    );
    let mutated_by = annotation(pod, MUTATED_BY).unwrap_or_default();
    assert!(
        mutated_by.split(',').any(|r| r == rule),
        "Pod {}: {MUTATED_BY} is {mutated_by:?}, not naming {rule}",
        name(pod)
    );
}

/// Asserts a Pod was created by a controller under a generated name and bound to a
/// simulated node; returns the node.
fn assert_controller_created_and_scheduled(pod: &Pod) -> String {
    let generate_name = pod.metadata.generate_name.as_deref().unwrap_or_default();
    assert!(
        !generate_name.is_empty() && name(pod).starts_with(generate_name),
        "Pod {} was not created with generateName ({generate_name:?})",
        name(pod)
    );
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    assert!(
        node.starts_with("kwok-node-"),
        "Pod {} is not scheduled onto a simulated node: nodeName {node:?}",
        name(pod)
    );
    node
}

#[tokio::test]
async fn controller_created_pods_are_mutated_scheduled_and_follow_a_changed_rule() {
    let _serial = serial().await;
    cluster().install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    let client = workloads::client().await;
    let _initium = Serving::start();
    let ns = workloads::namespace(&client, "rollout").await;
    let rule = format!("{ns}/stamp");

    apply_rule(
        &client,
        &ns,
        "stamp",
        &stamp_rule(&ns, "stamp", "Ignore", "blue"),
    )
    .await;
    wait_for_stamp(&client, &ns, "blue").await;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let started = Instant::now();
    deployments
        .create(&PostParams::default(), &workloads::deployment("web", 10))
        .await
        .unwrap();
    workloads::deployment_available(&client, &ns, "web", ROLLOUT).await;
    eprintln!(
        "10-replica Deployment Available {:?} after its creation",
        started.elapsed()
    );
    let pods =
        workloads::pods_running_and_ready(&client, &ns, "app=web", 10, Duration::from_secs(30))
            .await;
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for pod in &pods {
        assert_mutated(pod, "blue", &rule);
        *per_node
            .entry(assert_controller_created_and_scheduled(pod))
            .or_default() += 1;
    }
    eprintln!("Pods per node: {per_node:?}");

    // Another label value; the rollout restart is what `kubectl rollout restart` patches.
    apply_rule(
        &client,
        &ns,
        "stamp",
        &stamp_rule(&ns, "stamp", "Ignore", "green"),
    )
    .await;
    wait_for_stamp(&client, &ns, "green").await;
    let started = Instant::now();
    let restart = json!({"spec": {"template": {"metadata": {"annotations": {
        "kubectl.kubernetes.io/restartedAt": format!("{:?}", std::time::SystemTime::now())
    }}}}});
    deployments
        .patch("web", &PatchParams::default(), &Patch::Merge(&restart))
        .await
        .unwrap();
    workloads::deployment_available(&client, &ns, "web", ROLLOUT).await;
    let pods = eventually(
        "every Pod of the restarted rollout to be stamped green",
        Duration::from_secs(60),
        || async {
            let pods = workloads::pods(&client, &ns, "app=web")
                .await
                .map_err(|e| e.to_string())?;
            let stamps: Vec<Option<&str>> = pods.iter().map(stamp).collect();
            if pods.len() == 10 && stamps.iter().all(|s| *s == Some("green")) {
                Ok(pods)
            } else {
                Err(format!("{} Pods stamped {stamps:?}", pods.len()))
            }
        },
    )
    .await;
    eprintln!(
        "rollout restart done {:?} after the patch",
        started.elapsed()
    );
    for pod in &pods {
        assert_mutated(pod, "green", &rule);
        assert!(
            workloads::running_and_ready(pod),
            "Pod {} is not Running and Ready",
            name(pod)
        );
        assert_controller_created_and_scheduled(pod);
    }
}

/// How many Pod creations the API server has rejected because the webhook `webhook` could
/// not be called (`apiserver_admission_webhook_rejection_count`, summed over its labels).
fn webhook_rejections(webhook: &str) -> f64 {
    let output = cluster()
        .kubectl()
        .args(["get", "--raw", "/metrics"])
        .output()
        .expect("kubectl runs");
    assert!(
        output.status.success(),
        "kubectl get --raw /metrics failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let name = format!("name=\"{webhook}\"");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.starts_with("apiserver_admission_webhook_rejection_count{"))
        .filter(|l| l.contains(&name) && l.contains("operation=\"CREATE\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The Job controller's attempts to create Pods that were rejected, as its `FailedCreate`
/// Events on the Job count them (an Event repeated is one object with a count).
async fn failed_creates(client: &kube::Client, namespace: &str, job: &str) -> i32 {
    let events: Api<Event> = Api::namespaced(client.clone(), namespace);
    let selector = format!("involvedObject.name={job},reason=FailedCreate");
    events
        .list(&ListParams::default().fields(&selector))
        .await
        .unwrap()
        .items
        .iter()
        .map(|e| {
            let series = e.series.as_ref().and_then(|s| s.count).unwrap_or(0);
            e.count.unwrap_or(1).max(series)
        })
        .sum()
}

/// How long initium stays down while the Job controller retries.
const DOWN_FOR: Duration = Duration::from_secs(60);

#[tokio::test]
async fn while_initium_is_down_a_fail_rule_holds_a_job_back_with_bounded_retries_and_an_ignore_rule_lets_it_run_unmutated()
 {
    let _serial = serial().await;
    cluster().install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    let client = workloads::client().await;
    let mut initium = Serving::start();
    let held = workloads::namespace(&client, "fail").await;
    let open = workloads::namespace(&client, "ignore").await;
    apply_rule(
        &client,
        &held,
        "stamp",
        &stamp_rule(&held, "stamp", "Fail", "held"),
    )
    .await;
    apply_rule(
        &client,
        &open,
        "stamp",
        &stamp_rule(&open, "stamp", "Ignore", "open"),
    )
    .await;
    wait_for_stamp(&client, &held, "held").await;
    wait_for_stamp(&client, &open, "open").await;

    initium.kill();
    let rejected_before = webhook_rejections("fail-labeled.initium.dev");
    let down = Instant::now();
    for ns in [&held, &open] {
        Api::<Job>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &workloads::job("batch", 3))
            .await
            .unwrap();
    }

    // For DOWN_FOR, nothing is stored in the Fail rule's namespace: every create is rejected.
    let all_pods = |ns: String| {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        async move { pods.list(&ListParams::default()).await.unwrap().items }
    };
    while down.elapsed() < DOWN_FOR {
        let stored = all_pods(held.clone()).await;
        assert!(
            stored.is_empty(),
            "{:?} after initium stopped, Pods were stored in {held} despite its Fail rule: {:?}",
            down.elapsed(),
            stored.iter().map(name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let rejected = webhook_rejections("fail-labeled.initium.dev") - rejected_before;
    let events = failed_creates(&client, &held, "batch").await;
    eprintln!(
        "initium down {:?}: the Job controller tried to create a Pod {rejected} times \
         (API server rejections by fail-labeled.initium.dev), {events} FailedCreate Events on the Job",
        down.elapsed()
    );
    // The Job controller backs off exponentially (1 s, 2 s, 4 s ... up to 60 s) between
    // syncs that fail to create Pods: about 7 attempts in a minute, not one a second.
    assert!(
        (2.0..=15.0).contains(&rejected),
        "expected a few rejected creations backing off, not {rejected}"
    );
    assert!(events >= 2, "only {events} FailedCreate Events on the Job");

    // The Ignore rule's namespace went on without initium: the API server admitted the Pods
    // unchanged, and the Job succeeded with no Pod initialized.
    let job = workloads::job_succeeded(&client, &open, "batch", Duration::from_secs(30)).await;
    let unmutated = workloads::pods(&client, &open, "app=batch").await.unwrap();
    assert_eq!(
        unmutated.len(),
        3,
        "the Ignore namespace's Job ran {} Pods",
        unmutated.len()
    );
    for pod in &unmutated {
        assert_eq!(stamp(pod), None, "Pod {} was stamped", name(pod));
        assert_eq!(
            annotation(pod, MUTATED_BY),
            None,
            "Pod {} was mutated",
            name(pod)
        );
    }
    eprintln!(
        "Ignore rule: Job {open}/batch succeeded ({:?} Pods) while initium was down, its Pods unmutated",
        job.status.and_then(|s| s.succeeded)
    );

    // initium back: the Job controller's next attempt (at most 60 s later, its backoff cap)
    // creates the Pods, and every one carries the mutation.
    initium.restart();
    let back = Instant::now();
    workloads::job_succeeded(&client, &held, "batch", Duration::from_secs(150)).await;
    eprintln!(
        "Fail rule: Job {held}/batch succeeded {:?} after initium was ready again",
        back.elapsed()
    );
    let pods = workloads::pods(&client, &held, "app=batch").await.unwrap();
    assert_eq!(pods.len(), 3, "the held Job ran {} Pods", pods.len());
    for pod in &pods {
        assert_mutated(pod, "held", &format!("{held}/stamp"));
    }
}

#[tokio::test]
async fn a_service_gets_ready_endpoints_and_a_job_succeeds_with_initialized_pods() {
    let _serial = serial().await;
    cluster().install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    let client = workloads::client().await;
    // initium running, with a rule matching every Pod of the namespace: initialization does
    // not get in the way of what the controllers do next.
    let _initium = Serving::start();
    let ns = workloads::namespace(&client, "service").await;
    let rule = format!("{ns}/stamp");
    apply_rule(
        &client,
        &ns,
        "stamp",
        &stamp_rule(&ns, "stamp", "Ignore", "on"),
    )
    .await;
    wait_for_stamp(&client, &ns, "on").await;

    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &workloads::deployment("web", 3))
        .await
        .unwrap();
    Api::<Service>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &workloads::service("web", "web"))
        .await
        .unwrap();
    Api::<Job>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &workloads::job("batch", 2))
        .await
        .unwrap();

    let slices = workloads::ready_endpoints(&client, &ns, "web", 3, ROLLOUT).await;
    let pods = workloads::pods(&client, &ns, "app=web").await.unwrap();
    let mut backing: Vec<&str> = slices
        .iter()
        .flat_map(|s| &s.endpoints)
        .filter_map(|e| e.target_ref.as_ref()?.name.as_deref())
        .collect();
    let mut web: Vec<&str> = pods.iter().map(name).collect();
    backing.sort_unstable();
    web.sort_unstable();
    assert_eq!(backing, web, "the endpoints are not the Deployment's Pods");
    for pod in &pods {
        assert_mutated(pod, "on", &rule);
    }

    workloads::job_succeeded(&client, &ns, "batch", ROLLOUT).await;
    let job_pods = workloads::pods(&client, &ns, "app=batch").await.unwrap();
    assert_eq!(job_pods.len(), 2, "the Job ran {} Pods", job_pods.len());
    for pod in &job_pods {
        assert_mutated(pod, "on", &rule);
        assert_eq!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded"),
            "Job Pod {} did not succeed",
            name(pod)
        );
    }
}

/// The constructs a Kyverno user reaches for (issue 14), in one MutationRule, on the Pods of
/// a Deployment: what the rule writes is what the API server stores and kwok runs. An add to
/// `/spec/hostAliases/-` where the Pod has no list used to create an object the API server
/// rejected.
#[tokio::test]
async fn one_rule_with_list_adds_defaults_removals_and_a_prepended_container_gives_running_pods() {
    let _serial = serial().await;
    cluster().install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    let client = workloads::client().await;
    let _initium = Serving::start();
    let ns = workloads::namespace(&client, "kyverno-like").await;
    let rule = format!(
        r#"apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: harden, namespace: {ns}}}
spec:
  match: {{kinds: [Pod]}}
  failurePolicy: Fail
  mutations:
    - patch:
        - {{op: add, path: /spec/hostAliases/-, value: {{ip: 10.0.0.10, hostnames: [db.internal]}}}}
        - {{op: add, path: /spec/imagePullSecrets/0, value: {{name: mirror-pull}}}}
    - defaults: {{spec: {{securityContext: {{runAsNonRoot: true, runAsUser: 1000}}}}}}
    - forEach: "$.spec.containers[*]"
      mutations:
        - remove: {{path: /volumeMounts, where: [{{path: "@.name", in: "$.spec.volumes[?@.hostPath].name"}}]}}
        - defaults: {{securityContext: {{allowPrivilegeEscalation: false}}}}
    - remove: {{path: /spec/volumes, where: [{{path: "@.hostPath", exists: true}}]}}
    - upsert: {{path: /spec/containers, key: name, position: Prepend, value: {{name: proxy, image: registry.example.com/proxy:1}}}}
"#
    );
    apply_rule(&client, &ns, "harden", &rule).await;

    let mut deployment = serde_json::to_value(workloads::deployment("web", 3)).unwrap();
    let spec = &mut deployment["spec"]["template"]["spec"];
    spec["securityContext"] = json!({"runAsUser": 2000});
    spec["containers"][0]["volumeMounts"] = json!([{"name": "docker", "mountPath": "/var/run"}, {"name": "scratch", "mountPath": "/tmp"}]);
    spec["volumes"] = json!([
        {"name": "docker", "hostPath": {"path": "/var/run"}},
        {"name": "scratch", "emptyDir": {}}
    ]);
    let deployment: Deployment = serde_json::from_value(deployment).unwrap();
    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
    workloads::deployment_available(&client, &ns, "web", ROLLOUT).await;
    let pods =
        workloads::pods_running_and_ready(&client, &ns, "app=web", 3, Duration::from_secs(30))
            .await;
    for pod in &pods {
        let pod = serde_json::to_value(pod).unwrap();
        let spec = &pod["spec"];
        let at = pod["metadata"]["name"].clone();
        assert_eq!(
            spec["hostAliases"],
            json!([{"ip": "10.0.0.10", "hostnames": ["db.internal"]}]),
            "{at}"
        );
        assert_eq!(
            spec["imagePullSecrets"],
            json!([{"name": "mirror-pull"}]),
            "{at}"
        );
        assert_eq!(
            spec["securityContext"],
            json!({"runAsNonRoot": true, "runAsUser": 2000}),
            "{at}: the Pod's own runAsUser stays"
        );
        assert_eq!(spec["containers"][0]["name"], "proxy", "{at}");
        assert_eq!(
            spec["containers"][1]["securityContext"]["allowPrivilegeEscalation"], false,
            "{at}"
        );
        let mounts: Vec<&str> = spec["containers"][1]["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["name"].as_str())
            .filter(|n| !n.starts_with("kube-api-access"))
            .collect();
        assert_eq!(mounts, ["scratch"], "{at}");
        assert!(
            !spec["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v.get("hostPath").is_some()),
            "{at}: no hostPath volume is left"
        );
        assert_eq!(
            pod["metadata"]["annotations"][MUTATED_BY],
            format!("{ns}/harden")
        );
    }
}

/// A MutationRule that stamps every Pod and appends a toleration (not idempotent: a second
/// run on a Pod would add a second one); with `autogen`, also to the Pod templates of the
/// five controllers `autogen: {}` covers.
fn template_rule(namespace: &str, autogen: bool) -> String {
    format!(
        r#"apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: tolerate, namespace: {namespace}}}
spec:
  match: {{kinds: [Pod]}}
{autogen}  mutations:
    - merge: {{metadata: {{labels: {{{STAMP}: templated}}, annotations: {{{INITIALIZED}: "true"}}}}}}
    - patch: [{{op: add, path: /spec/tolerations/-, value: {{key: example.com/spot, operator: Exists}}}}]
"#,
        autogen = if autogen { "  autogen: {}\n" } else { "" },
    )
}

/// The five controllers `autogen: {}` covers, each with a Pod template labelled
/// `app: <name>`.
fn controllers_yaml(namespace: &str) -> String {
    let template = |app: &str, restart: &str| {
        format!(
            "metadata: {{labels: {{app: {app}}}}}\n      spec: {{restartPolicy: {restart}, containers: [{{name: app, image: registry.example.com/app:1}}]}}"
        )
    };
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: {namespace}}}
spec:
  replicas: 2
  selector: {{matchLabels: {{app: web}}}}
  template:
      {web}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: db, namespace: {namespace}}}
spec:
  serviceName: db
  replicas: 1
  selector: {{matchLabels: {{app: db}}}}
  template:
      {db}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {{name: agent, namespace: {namespace}}}
spec:
  selector: {{matchLabels: {{app: agent}}}}
  template:
      {agent}
---
apiVersion: batch/v1
kind: Job
metadata: {{name: batch, namespace: {namespace}}}
spec:
  template:
      {batch}
---
apiVersion: batch/v1
kind: CronJob
metadata: {{name: nightly, namespace: {namespace}}}
spec:
  schedule: "0 0 1 1 *"
  suspend: true
  jobTemplate:
    spec:
      template:
          {nightly}
"#,
        web = template("web", "Always"),
        db = template("db", "Always"),
        agent = template("agent", "Always"),
        batch = template("batch", "Never"),
        nightly = template("nightly", "Never").replace("\n      ", "\n          "),
    )
}

/// The tolerations of ours in a Pod spec (the API server adds its own).
fn ours(spec: &serde_json::Value) -> usize {
    spec["tolerations"].as_array().map_or(0, |t| {
        t.iter().filter(|t| t["key"] == "example.com/spot").count()
    })
}

/// `kubectl get <resource> <name> -o json`, as a user sees it.
fn get_json(namespace: &str, resource: &str, name: &str) -> serde_json::Value {
    let output = cluster()
        .kubectl()
        .args(["get", resource, name, "-n", namespace, "-o", "json"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "kubectl get {resource} {name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Autogen on the whole cluster: with `spec.autogen` the Deployment, StatefulSet, DaemonSet,
/// Job and CronJob (and a Job made from the CronJob) carry the mutation in their Pod templates
/// as `kubectl get -o json` shows them; without it they are as written. Either way, every Pod
/// the real controllers make carries it exactly once: made from a mutated template, it
/// lists the rule and is not mutated again; made from an unmutated one, it is mutated when
/// it is created.
#[tokio::test]
async fn autogen_puts_a_pod_rule_in_the_controllers_templates_only_when_asked_and_each_pod_gets_it_once()
 {
    let _serial = serial().await;
    cluster().install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    let client = workloads::client().await;
    let initium = Serving::start();
    for autogen in [true, false] {
        let ns =
            workloads::namespace(&client, if autogen { "autogen-on" } else { "autogen-off" }).await;
        let rule = format!("{ns}/tolerate");
        apply_rule(&client, &ns, "tolerate", &template_rule(&ns, autogen)).await;
        wait_for_stamp(&client, &ns, "templated").await;
        if autogen {
            // The webhook configuration covers the controllers once the rule is Ready.
            eventually(
                "the webhook configuration to cover Deployments",
                Duration::from_secs(30),
                || async {
                    let config = get_json("", "mutatingwebhookconfiguration", &initium.name);
                    if config.to_string().contains("\"deployments\"") {
                        Ok(())
                    } else {
                        Err("no deployments in it".to_string())
                    }
                },
            )
            .await;
        }
        cluster()
            .apply(&controllers_yaml(&ns))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let made = cluster()
            .kubectl()
            .args([
                "create",
                "job",
                "nightly-manual",
                "--from=cronjob/nightly",
                "-n",
                &ns,
            ])
            .output()
            .unwrap();
        assert!(
            made.status.success(),
            "kubectl create job --from: {}",
            String::from_utf8_lossy(&made.stderr)
        );

        for (resource, name, at) in [
            ("deployment", "web", "/spec/template"),
            ("statefulset", "db", "/spec/template"),
            ("daemonset", "agent", "/spec/template"),
            ("job", "batch", "/spec/template"),
            ("cronjob", "nightly", "/spec/jobTemplate/spec/template"),
            ("job", "nightly-manual", "/spec/template"),
        ] {
            let object = get_json(&ns, resource, name);
            let template = object
                .pointer(at)
                .unwrap_or_else(|| panic!("{resource} {name}"));
            let what = format!("{resource} {name} (autogen {autogen})");
            if autogen {
                assert_eq!(template["metadata"]["labels"][STAMP], "templated", "{what}");
                assert_eq!(ours(&template["spec"]), 1, "{what}: {template}");
                assert_eq!(
                    template["metadata"]["annotations"][MUTATED_BY],
                    rule.as_str(),
                    "{what}"
                );
            } else {
                assert!(
                    template["metadata"]["labels"].get(STAMP).is_none(),
                    "{what}"
                );
                assert_eq!(ours(&template["spec"]), 0, "{what}");
                assert!(
                    template["metadata"].get("annotations").is_none(),
                    "{what}: {template}"
                );
            }
        }

        for (selector, count) in [
            ("app=web", 2),
            ("app=db", 1),
            ("app=agent", workloads::NODES as usize),
            ("job-name=batch", 1),
            ("job-name=nightly-manual", 1),
        ] {
            let pods = eventually(
                &format!("{count} Pods {selector} in {ns}"),
                ROLLOUT,
                || async {
                    let pods = workloads::pods(&client, &ns, selector)
                        .await
                        .map_err(|e| e.to_string())?;
                    if pods.len() >= count {
                        Ok(pods)
                    } else {
                        Err(format!("{} Pods", pods.len()))
                    }
                },
            )
            .await;
            for pod in &pods {
                assert_mutated(pod, "templated", &rule);
                let value = serde_json::to_value(pod).unwrap();
                assert_eq!(
                    ours(&value["spec"]),
                    1,
                    "Pod {} ({selector}, autogen {autogen}): the rule ran on it more than once or not at all: {}",
                    name(pod),
                    value["spec"]["tolerations"]
                );
                assert_eq!(
                    annotation(pod, MUTATED_BY),
                    Some(rule.as_str()),
                    "Pod {}",
                    name(pod)
                );
            }
        }
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
        if autogen {
            // A write that leaves the template as stored (`kubectl annotate`, a GitOps tool's
            // label) does not run the rule on it again: the rule appends, and a second run
            // would change the template and roll the Deployment out again.
            let annotate = json!({"metadata": {"annotations": {"example.com/owner": "shop"}}});
            deployments
                .patch("web", &PatchParams::default(), &Patch::Merge(&annotate))
                .await
                .unwrap();
            let web = get_json(&ns, "deployment", "web");
            assert_eq!(web["metadata"]["annotations"]["example.com/owner"], "shop");
            assert_eq!(ours(&web["spec"]["template"]["spec"]), 1, "{web}");
            // A user's write that changes the template (here: the stamp taken out, as a
            // GitOps sync of the manifest without it would) is an UPDATE of another
            // template: the rule runs on it again.
            let replace = json!({"spec": {"template": {"metadata": {"labels": {STAMP: null}}}}});
            deployments
                .patch("web", &PatchParams::default(), &Patch::Merge(&replace))
                .await
                .unwrap();
            let web = get_json(&ns, "deployment", "web");
            assert_eq!(
                web["spec"]["template"]["metadata"]["labels"],
                json!({"app": "web", STAMP: "templated"}),
                "{web}"
            );
        }
        eprintln!("autogen {autogen}: 6 controllers' templates and their Pods checked in {ns}");
    }
}
