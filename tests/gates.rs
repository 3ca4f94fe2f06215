//! Gate mode on a whole cluster (`scripts/control-plane up --nodes 3`: controller manager,
//! scheduler, kwok nodes): Pods held by initium's scheduling gate until their dependencies
//! are ready — a Service with a ready endpoint, a Job that succeeded, a Ready Pod, any object
//! whose condition holds, a DaemonSet's node — then released by the gate controller,
//! scheduled and Running; and what happens on timeouts, foreign gates, rule deletion and a
//! leader that dies in the middle of a wave.
//!
//! `initium serve` runs as a process beside the cluster; rules and webhook configurations are
//! cluster-wide and one test kills a replica, so the tests run one at a time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use support::serving::{Serving, apply_rule};
use support::workloads::{self, cluster};
use support::{eventually, serial};

/// Generous on a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(120);
const GATED_LABEL: &str = "initium.dev/gated";

/// A MutationRule `name` in `namespace` holding the Pods labelled `wait=<name>` until
/// `wait_for` (YAML flow list) holds.
fn gate_rule(namespace: &str, name: &str, wait_for: &str, more: &str) -> String {
    format!(
        r#"apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  match:
    kinds: [Pod]
    labels: {{matchLabels: {{wait: {name}}}}}
  gate:
    waitFor: {wait_for}
{more}"#
    )
}

fn gate_of(namespace: &str, rule: &str) -> String {
    format!("initium.dev/{namespace}.{rule}")
}

fn gates(pod: &Pod) -> Vec<String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .into_iter()
        .flatten()
        .map(|g| g.name.clone())
        .collect()
}

fn name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

fn node(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.node_name.clone())
}

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

/// A bare Pod labelled `wait=<wait>` (and `labels`), created under a generated name.
async fn create_pod(client: &kube::Client, ns: &str, wait: &str, extra: Value) -> Pod {
    let mut pod = json!({
        "metadata": {"generateName": format!("{wait}-"), "labels": {"wait": wait}},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]}
    });
    merge(&mut pod, extra);
    let pod: Pod = serde_json::from_value(pod).unwrap();
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("create a Pod in {ns}: {e}"))
}

fn merge(target: &mut Value, patch: Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                merge(t.entry(k).or_insert(Value::Null), v);
            }
        }
        (t, p) => *t = p,
    }
}

/// Waits until `count` Pods match `selector` and each carries `gate` and is not scheduled.
async fn pods_held(
    client: &kube::Client,
    ns: &str,
    selector: &str,
    count: usize,
    gate: &str,
) -> Vec<Pod> {
    let held = |p: &Pod| gates(p).iter().any(|g| g == gate) && node(p).is_none();
    pods_all(
        client,
        ns,
        selector,
        count,
        &format!("held by {gate}"),
        held,
    )
    .await
}

/// Waits until `count` Pods match `selector` and none carries an `initium.dev/` gate any
/// more; returns them.
async fn pods_released(client: &kube::Client, ns: &str, selector: &str, count: usize) -> Vec<Pod> {
    let released = |p: &Pod| !gates(p).iter().any(|g| g.starts_with("initium.dev/"));
    pods_all(client, ns, selector, count, "released", released).await
}

/// Waits until exactly `count` Pods match `selector`, every one of them `what`.
async fn pods_all(
    client: &kube::Client,
    ns: &str,
    selector: &str,
    count: usize,
    what: &str,
    test: impl Fn(&Pod) -> bool,
) -> Vec<Pod> {
    eventually(
        &format!("{count} Pods {selector} in {ns} {what}"),
        WAIT,
        || async {
            let pods = workloads::pods(client, ns, selector)
                .await
                .map_err(|e| e.to_string())?;
            let passing = pods.iter().filter(|p| test(p)).count();
            if pods.len() == count && passing == count {
                Ok(pods)
            } else {
                Err(format!("{} Pods, {passing} {what}", pods.len()))
            }
        },
    )
    .await
}

/// Asserts that for `hold` the Pods of `selector` stay held (a dependency not ready must not
/// release anything).
async fn still_held_after(client: &kube::Client, ns: &str, selector: &str, hold: Duration) {
    tokio::time::sleep(hold).await;
    let pods = workloads::pods(client, ns, selector).await.unwrap();
    assert!(!pods.is_empty(), "no Pods {selector} in {ns}");
    for pod in &pods {
        assert!(
            gates(pod).iter().any(|g| g.starts_with("initium.dev/")),
            "Pod {ns}/{} was released while its dependency was not ready: gates {:?}",
            name(pod),
            gates(pod)
        );
        assert_eq!(node(pod), None, "a held Pod was scheduled");
    }
}

/// The events.k8s.io Events about Pod `pod` with `reason`.
async fn events(client: &kube::Client, ns: &str, pod: &str, reason: &str) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default().fields(&format!("regarding.name={pod}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

/// Waits until every Pod in `pods` has an Event `reason`; returns each Pod's count of them
/// (a repeated Event counts its series).
async fn events_for_all(
    client: &kube::Client,
    ns: &str,
    pods: &[String],
    reason: &str,
) -> BTreeMap<String, i32> {
    eventually(
        &format!("an Event {reason} for each of {} Pods", pods.len()),
        Duration::from_secs(60),
        || async {
            let mut counts = BTreeMap::new();
            for pod in pods {
                let n: i32 = events(client, ns, pod, reason)
                    .await
                    .iter()
                    .map(|e| e.series.as_ref().map_or(1, |s| s.count.max(1)))
                    .sum();
                counts.insert(pod.clone(), n);
            }
            let missing = counts.values().filter(|n| **n == 0).count();
            if missing == 0 {
                Ok(counts)
            } else {
                Err(format!("{missing} Pods without one"))
            }
        },
    )
    .await
}

/// `kubectl apply -f -` of `yaml`: whether it succeeded, and what kubectl printed on stderr
/// (errors, and the warnings of admission webhooks).
fn kubectl_apply(yaml: &str) -> (bool, String) {
    let output = cluster()
        .kubectl_stdin(&["apply", "-f", "-"], yaml)
        .unwrap_or_else(|e| panic!("{e:#}"));
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Pods of every namespace that still carry an initium scheduling gate.
async fn gated_pods_in_cluster(client: &kube::Client) -> usize {
    let pods: Api<Pod> = Api::all(client.clone());
    let list = pods
        .list(&ListParams::default().labels(&format!("{GATED_LABEL}=true")))
        .await
        .expect("list gated Pods");
    list.items
        .iter()
        .filter(|pod| {
            pod.metadata.deletion_timestamp.is_none()
                && pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.scheduling_gates.as_ref())
                    .is_some_and(|gates| gates.iter().any(|g| g.name.starts_with("initium.dev/")))
        })
        .count()
}

fn metric(serving: &Serving, name: &str) -> f64 {
    serving
        .initium
        .metric(name)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

async fn create_deployment(client: &kube::Client, ns: &str, name: &str, replicas: i32, wait: &str) {
    let mut d = workloads::deployment(name, replicas);
    let template = &mut d.spec.as_mut().unwrap().template;
    template
        .metadata
        .get_or_insert_with(Default::default)
        .labels
        .get_or_insert_with(Default::default)
        .insert("wait".into(), wait.into());
    Api::<Deployment>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
}

/// One test at a time, on the whole cluster with the CRDs: the guard and a client.
async fn start() -> (tokio::sync::MutexGuard<'static, ()>, kube::Client) {
    let guard = serial().await;
    cluster().install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    (guard, workloads::client().await)
}

/// Applies the gate rule `rule` (YAML), creates one Pod labelled `wait=<rule>` and waits
/// until the rule's gate holds it.
async fn hold_one_pod(client: &kube::Client, ns: &str, rule: &str, yaml: &str) {
    apply_rule(client, ns, rule, yaml).await;
    create_pod(client, ns, rule, json!({})).await;
    pods_held(client, ns, &format!("wait={rule}"), 1, &gate_of(ns, rule)).await;
}

/// The MutationRule `web` holding the Pods labelled `wait=web` until the Service `backend`
/// has a ready endpoint, and that Service (with no Pod behind it yet).
async fn web_waits_for_backend(client: &kube::Client, ns: &str) {
    let rule = gate_rule(ns, "web", "[{service: {name: backend}}]", "");
    apply_rule(client, ns, "web", &rule).await;
    Api::<Service>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &workloads::service("backend", "backend"),
        )
        .await
        .unwrap();
}

/// A one-replica Deployment `backend` (label `app=backend`), the Pods behind the Service.
async fn start_backend(client: &kube::Client, ns: &str) {
    Api::<Deployment>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &workloads::deployment("backend", 1))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_deployment_waits_for_a_service_then_all_its_pods_are_released_and_run() {
    let (_serial, client) = start().await;
    let serving = Serving::start();
    let ns = workloads::namespace(&client, "gate-svc").await;
    // The Service exists but has no endpoint yet: that is not ready.
    web_waits_for_backend(&client, &ns).await;
    create_deployment(&client, &ns, "web", 20, "web").await;
    let gate = gate_of(&ns, "web");
    let held = pods_held(&client, &ns, "app=web", 20, &gate).await;
    for pod in &held {
        assert_eq!(label(pod, GATED_LABEL), Some("true"), "{}", name(pod));
        let scheduled = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .find(|c| c.type_ == "PodScheduled");
        assert_eq!(
            scheduled.and_then(|c| c.reason.as_deref()),
            Some("SchedulingGated"),
            "kubectl shows SchedulingGated for {}",
            name(pod)
        );
    }
    still_held_after(&client, &ns, "app=web", Duration::from_secs(3)).await;
    // The gauge counts every Pod held by an initium gate in the cluster: these 20, and any a
    // test before this one left behind (a Hold timeout keeps its Pod) that is not gone yet.
    let held_anywhere = gated_pods_in_cluster(&client).await;
    assert!(
        held_anywhere >= 20,
        "{held_anywhere} Pods held in the cluster"
    );
    assert_eq!(metric(&serving, "initium_gated_pods"), held_anywhere as f64);

    // The backing Deployment (not held: the rule matches wait=web only) becomes Available.
    let started = Instant::now();
    start_backend(&client, &ns).await;
    workloads::ready_endpoints(&client, &ns, "backend", 1, WAIT).await;
    let released = pods_released(&client, &ns, "app=web", 20).await;
    eprintln!(
        "20 Pods released {:?} after the backend was created",
        started.elapsed()
    );
    for pod in &released {
        assert_eq!(label(pod, GATED_LABEL), None, "{}", name(pod));
    }
    workloads::deployment_available(&client, &ns, "web", WAIT).await;
    let running =
        workloads::pods_running_and_ready(&client, &ns, "app=web", 20, Duration::from_secs(60))
            .await;
    assert!(running.iter().all(|p| node(p).is_some()));
    let names: Vec<String> = running.iter().map(name).collect();
    let counts = events_for_all(&client, &ns, &names, "GateReleased").await;
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    // All 20 released: the gauge is back to what tests before this one left held.
    let held_elsewhere = gated_pods_in_cluster(&client).await;
    assert_eq!(
        metric(&serving, "initium_gated_pods"),
        held_elsewhere as f64
    );
    assert!(metric(&serving, "initium_gate_releases_total") >= 20.0);
}

#[tokio::test]
async fn job_pods_and_object_dependencies_release_when_they_hold() {
    let (_serial, client) = start().await;
    let _serving = Serving::start();
    let ns = workloads::namespace(&client, "gate-deps").await;
    // A custom resource whose status.phase flips, as kubernetes-entrypoint's custom-resource
    // dependency waits for.
    let crd = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: databases.gates.example.com}
spec:
  group: gates.example.com
  scope: Namespaced
  names: {plural: databases, singular: database, kind: Database}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
"#;
    cluster().apply(crd).unwrap_or_else(|e| panic!("{e:#}"));
    cluster()
        .wait_condition("crd", "databases.gates.example.com", "Established", WAIT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let db = format!(
        "apiVersion: gates.example.com/v1\nkind: Database\nmetadata: {{name: main, namespace: {ns}}}\nstatus: {{phase: Pending}}\n"
    );
    cluster().apply(&db).unwrap_or_else(|e| panic!("{e:#}"));

    for (rule, wait_for) in [
        ("job", "[{job: {name: migrate}}]"),
        ("pods", "[{pods: {selector: {matchLabels: {app: cache}}}}]"),
        (
            "object",
            "[{object: {apiVersion: gates.example.com/v1, kind: Database, name: main, conditions: [{path: '$.status.phase', equals: Ready}]}}]",
        ),
    ] {
        // The cache's own Pods must not be held by the rule that waits for them.
        let exclude = "  exclude: {labels: {matchLabels: {app: cache}}}\n";
        hold_one_pod(&client, &ns, rule, &gate_rule(&ns, rule, wait_for, exclude)).await;
    }
    still_held_after(&client, &ns, "wait", Duration::from_secs(3)).await;

    // The Job succeeds (kwok completes its Pod): only the Job's Pod is released.
    Api::<Job>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &workloads::job("migrate", 1))
        .await
        .unwrap();
    workloads::job_succeeded(&client, &ns, "migrate", WAIT).await;
    pods_released(&client, &ns, "wait=job", 1).await;
    still_held_after(
        &client,
        &ns,
        "wait in (pods,object)",
        Duration::from_secs(1),
    )
    .await;

    // A Ready Pod labelled app=cache.
    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &workloads::deployment("cache", 1))
        .await
        .unwrap();
    workloads::pods_running_and_ready(&client, &ns, "app=cache", 1, WAIT).await;
    pods_released(&client, &ns, "wait=pods", 1).await;
    still_held_after(&client, &ns, "wait=object", Duration::from_secs(1)).await;

    // The custom resource's phase flips.
    cluster()
        .apply(&db.replace("Pending", "Ready"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    pods_released(&client, &ns, "wait", 3).await;
    workloads::pods_running_and_ready(&client, &ns, "wait", 3, WAIT).await;

    // The Job is deleted (as its TTL would): a Pod created afterwards is not held by it.
    Api::<Job>::namespaced(client.clone(), &ns)
        .delete("migrate", &DeleteParams::background())
        .await
        .unwrap();
    eventually("the Job to be gone", WAIT, || async {
        match Api::<Job>::namespaced(client.clone(), &ns)
            .get_opt("migrate")
            .await
        {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let late = create_pod(&client, &ns, "job", json!({})).await;
    let gated_at_creation = gates(&late).iter().any(|g| g.starts_with("initium.dev/"));
    assert!(
        gated_at_creation,
        "the rule still holds new Pods at creation"
    );
    pods_released(&client, &ns, "wait=job", 2).await;
}

#[tokio::test]
async fn a_daemonset_dependency_narrows_node_affinity_to_its_ready_nodes() {
    let (_serial, client) = start().await;
    let _serving = Serving::start();
    let ns = workloads::namespace(&client, "gate-ds").await;
    apply_rule(
        &client,
        &ns,
        "agent",
        &gate_rule(&ns, "agent", "[{daemonSet: {name: agent}}]", ""),
    )
    .await;
    // One Pod with no affinity, one with a required term of its own (kept, narrowed).
    create_pod(&client, &ns, "agent", json!({})).await;
    create_pod(
        &client,
        &ns,
        "agent",
        json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "type", "operator": "In", "values": ["kwok"]}]}]
        }}}}}),
    )
    .await;
    pods_held(&client, &ns, "wait=agent", 2, &gate_of(&ns, "agent")).await;

    // The agent runs on one node only.
    let target = "kwok-node-1";
    let ds = json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "agent", "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": "agent"}},
            "template": {
                "metadata": {"labels": {"app": "agent"}},
                "spec": {
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [target]}]}]
                    }}},
                    "containers": [{"name": "agent", "image": "registry.example.com/agent:1"}]
                }
            }
        }
    });
    cluster()
        .apply(&serde_json::to_string(&ds).unwrap())
        .unwrap_or_else(|e| panic!("{e:#}"));
    let released = pods_released(&client, &ns, "wait=agent", 2).await;
    for pod in &released {
        let terms = pod
            .spec
            .as_ref()
            .and_then(|s| s.affinity.as_ref())
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|n| {
                n.required_during_scheduling_ignored_during_execution
                    .as_ref()
            })
            .map(|r| r.node_selector_terms.clone())
            .unwrap_or_default();
        assert_eq!(terms.len(), 1, "Pod {}: {terms:?}", name(pod));
        let fields = terms[0].match_fields.clone().unwrap_or_default();
        assert!(
            fields.iter().any(|f| f.key == "metadata.name"
                && f.operator == "In"
                && f.values.as_deref() == Some(&[target.to_string()][..])),
            "Pod {}: {terms:?}",
            name(pod)
        );
    }
    let with_own_term = released
        .iter()
        .filter(|p| {
            serde_json::to_string(&p.spec)
                .unwrap()
                .contains("\"key\":\"type\"")
        })
        .count();
    assert_eq!(with_own_term, 1, "the Pod's own requirement is kept");
    let running = workloads::pods_running_and_ready(&client, &ns, "wait=agent", 2, WAIT).await;
    for pod in &running {
        assert_eq!(node(pod).as_deref(), Some(target), "Pod {}", name(pod));
    }
}

#[tokio::test]
async fn another_controllers_gate_survives_the_release() {
    let (_serial, client) = start().await;
    let _serving = Serving::start();
    let ns = workloads::namespace(&client, "gate-foreign").await;
    web_waits_for_backend(&client, &ns).await;
    let pod = create_pod(
        &client,
        &ns,
        "web",
        json!({"spec": {"schedulingGates": [{"name": "example.com/quota"}]}}),
    )
    .await;
    let pod_name = name(&pod);
    assert_eq!(
        gates(&pod),
        ["example.com/quota".to_string(), gate_of(&ns, "web")]
    );
    start_backend(&client, &ns).await;
    let released = pods_released(&client, &ns, "wait=web", 1).await;
    assert_eq!(gates(&released[0]), ["example.com/quota".to_string()]);
    still_held_after_foreign(&client, &ns, &pod_name).await;
    // The other controller lifts its gate: the Pod is scheduled.
    Api::<Pod>::namespaced(client.clone(), &ns)
        .patch(
            &pod_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schedulingGates": null}})),
        )
        .await
        .unwrap();
    workloads::pods_running_and_ready(&client, &ns, "wait=web", 1, WAIT).await;
}

async fn still_held_after_foreign(client: &kube::Client, ns: &str, pod: &str) {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pod = Api::<Pod>::namespaced(client.clone(), ns)
        .get(pod)
        .await
        .unwrap();
    assert_eq!(node(&pod), None, "the foreign gate still holds the Pod");
}

#[tokio::test]
async fn timeouts_release_or_hold_and_a_deleted_rule_releases_its_pods() {
    let (_serial, client) = start().await;
    let serving = Serving::start();
    let ns = workloads::namespace(&client, "gate-timeout").await;
    let never = "[{service: {name: never}}]";
    for (rule, more) in [
        ("release", "    timeout: 6s\n    onTimeout: Release\n"),
        ("hold", "    timeout: 6s\n    onTimeout: Hold\n"),
        ("deleted", ""),
    ] {
        hold_one_pod(&client, &ns, rule, &gate_rule(&ns, rule, never, more)).await;
    }
    let released = pods_released(&client, &ns, "wait=release", 1).await;
    // Events are posted after the release they tell of, so wait for them rather than
    // expecting them the moment the gate is gone.
    let released_pod = name(&released[0]);
    let counts = events_for_all(
        &client,
        &ns,
        std::slice::from_ref(&released_pod),
        "GateTimedOut",
    )
    .await;
    assert_eq!(
        counts[&released_pod], 1,
        "one GateTimedOut Event: {counts:?}"
    );
    let timed_out = events(&client, &ns, &released_pod, "GateTimedOut").await;
    assert_eq!(timed_out[0].type_.as_deref(), Some("Warning"));
    workloads::pods_running_and_ready(&client, &ns, "wait=release", 1, WAIT).await;

    // Hold: the Pod keeps its gate past the timeout, with a Warning saying so.
    let held = workloads::pods(&client, &ns, "wait=hold").await.unwrap();
    events_for_all(&client, &ns, &[name(&held[0])], "GateTimedOut").await;
    still_held_after(&client, &ns, "wait=hold", Duration::from_secs(3)).await;
    assert!(metric(&serving, "initium_gate_timeouts_total") >= 2.0);

    // Deleting a rule releases the Pods it holds.
    cluster()
        .kubectl()
        .args(["delete", "mutationrule", "deleted", "-n", &ns])
        .output()
        .unwrap();
    let released = pods_released(&client, &ns, "wait=deleted", 1).await;
    let released_pod = name(&released[0]);
    let counts = events_for_all(
        &client,
        &ns,
        std::slice::from_ref(&released_pod),
        "GateRuleGone",
    )
    .await;
    assert_eq!(
        counts[&released_pod], 1,
        "one GateRuleGone Event: {counts:?}"
    );
    still_held_after(&client, &ns, "wait=hold", Duration::from_secs(1)).await;
}

#[tokio::test]
async fn a_leader_killed_mid_wave_loses_no_release_and_writes_no_pod_twice() {
    let (_serial, client) = start().await;
    // Two releases at a time, so the wave of 100 lasts long enough to die in the middle of.
    let slow = ["--gate-release-concurrency", "2"];
    let mut first = Serving::start_with(&["--identity", "replica-a", slow[0], slow[1]]);
    let mut second = first.replica(&["--identity", "replica-b", slow[0], slow[1]]);
    let ns = workloads::namespace(&client, "gate-leader").await;
    web_waits_for_backend(&client, &ns).await;
    create_deployment(&client, &ns, "web", 100, "web").await;
    pods_held(&client, &ns, "app=web", 100, &gate_of(&ns, "web")).await;
    let lease = first.name.clone();
    let holder = eventually("a Lease holder", WAIT, || async {
        let output = cluster()
            .kubectl()
            .args(["get", "lease", &lease, "-n", &lease])
            .args(["-o", "jsonpath={.spec.holderIdentity}"])
            .output()
            .map_err(|e| e.to_string())?;
        match String::from_utf8_lossy(&output.stdout).trim() {
            h @ ("replica-a" | "replica-b") => Ok(h.to_string()),
            other => Err(format!("holder {other:?}")),
        }
    })
    .await;
    eprintln!("Lease held by {holder}");

    // The dependency becomes ready, and the Lease holder dies as the wave starts.
    start_backend(&client, &ns).await;
    workloads::ready_endpoints(&client, &ns, "backend", 1, WAIT).await;
    let started = Instant::now();
    eventually("the first release of the wave", WAIT, || async {
        let pods = workloads::pods(&client, &ns, "app=web")
            .await
            .map_err(|e| e.to_string())?;
        let released = pods
            .iter()
            .filter(|p| !gates(p).iter().any(|g| g.starts_with("initium.dev/")))
            .count();
        if released > 0 {
            Ok(())
        } else {
            Err("none released".into())
        }
    })
    .await;
    if holder == "replica-a" {
        first.kill();
    } else {
        second.kill();
    }
    let at_kill: BTreeSet<String> = workloads::pods(&client, &ns, "app=web")
        .await
        .unwrap()
        .iter()
        .filter(|p| !gates(p).iter().any(|g| g.starts_with("initium.dev/")))
        .map(name)
        .collect();
    eprintln!(
        "killed a replica {:?} into the wave, {} of 100 released by then",
        started.elapsed(),
        at_kill.len()
    );
    let released = pods_released(&client, &ns, "app=web", 100).await;
    eprintln!("all 100 released {:?} after the kill", started.elapsed());
    let survivor = if holder == "replica-a" {
        &second
    } else {
        &first.initium
    };
    let survivor_id = if holder == "replica-a" {
        "replica-b"
    } else {
        "replica-a"
    };
    // Every release's Event names the replica that wrote it. The survivor's all arrive (the
    // killed replica's last ones may have died with it; Events are posted after the writes
    // they tell of, so wait for them): no Pod may have Events from both, or two from one, and
    // the survivor wrote exactly the Pods it reported.
    let (by_survivor, by_killed, written) = eventually(
        "a GateReleased Event from the survivor for each release it counted",
        WAIT,
        || async {
            let written = survivor.metric("initium_gate_releases_total").unwrap() as usize;
            let mut by_survivor = 0;
            let mut by_killed = 0;
            for pod in released.iter().map(name) {
                let found = events(&client, &ns, &pod, "GateReleased").await;
                assert!(
                    found.len() <= 1,
                    "Pod {pod} released more than once: {found:?}"
                );
                let mine = found
                    .iter()
                    .filter(|e| e.reporting_instance.as_deref() == Some(survivor_id))
                    .count();
                by_survivor += mine;
                by_killed += found.len() - mine;
            }
            if by_survivor >= written {
                Ok((by_survivor, by_killed, written))
            } else {
                Err(format!("{by_survivor} of {written} so far"))
            }
        },
    )
    .await;
    eprintln!(
        "GateReleased Events: {by_killed} from the killed replica, {by_survivor} from the survivor, which counted {written} releases and {} write conflicts",
        survivor
            .metric("initium_gate_write_conflicts_total")
            .unwrap()
    );
    assert!(by_survivor >= 1, "the survivor finished the wave");
    assert_eq!(written, by_survivor, "the survivor wrote what it reported");
    assert!(
        by_survivor + at_kill.len() <= 100,
        "the survivor released Pods the killed replica had already released: {by_survivor} + {}",
        at_kill.len()
    );
    workloads::deployment_available(&client, &ns, "web", WAIT).await;
}

#[tokio::test]
async fn a_mutation_rule_cannot_wait_on_another_namespace() {
    let (_serial, client) = start().await;
    let _serving = Serving::start();
    let ns = workloads::namespace(&client, "gate-isolation").await;
    let rule = gate_rule(
        &ns,
        "reach",
        "[{service: {name: db, namespace: kube-system}}]",
        "",
    );
    let (applied, stderr) = kubectl_apply(&rule);
    assert!(!applied, "applied: {stderr}");
    assert!(
        stderr.contains("spec.gate.waitFor[0].service.namespace")
            && stderr.contains("may only wait on objects in its own namespace"),
        "{stderr}"
    );
    // A rule whose Pods would wait on themselves is refused too.
    let self_wait = gate_rule(
        &ns,
        "self",
        "[{pods: {selector: {matchLabels: {wait: self}}}}]",
        "",
    );
    let (applied, stderr) = kubectl_apply(&self_wait);
    assert!(
        !applied && stderr.contains("would wait on themselves"),
        "{stderr}"
    );
    // A long timeout is accepted with a warning about Deployment progress deadlines.
    let long = gate_rule(&ns, "long", "[{service: {name: db}}]", "    timeout: 15m\n");
    let (applied, stderr) = kubectl_apply(&long);
    assert!(applied, "{stderr}");
    assert!(stderr.contains("progress deadline"), "{stderr}");
}

/// The `Ready` condition of MutationRule `ns/name` once its status says it is not Ready:
/// its reason and message.
async fn not_ready(client: &kube::Client, ns: &str, name: &str) -> (String, String) {
    let rules: Api<initium::api::MutationRule> = Api::namespaced(client.clone(), ns);
    eventually(
        &format!("MutationRule {ns}/{name} to be judged not Ready"),
        WAIT,
        || async {
            let rule = rules.get(name).await.map_err(|e| e.to_string())?;
            let status = serde_json::to_value(&rule.status).map_err(|e| e.to_string())?;
            status["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "Ready" && c["status"] == "False")
                .map(|c| {
                    (
                        c["reason"].as_str().unwrap_or_default().to_owned(),
                        c["message"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .ok_or_else(|| format!("status {status}"))
        },
    )
    .await
}

/// Issue 30, finding 4: a tenant's MutationRule gated on a cluster-scoped object (a Namespace
/// with a label, a ClusterMutationRule, a cluster-scoped custom resource) would learn, from
/// whether its Pod is released, what initium reads there with its own permissions.
#[tokio::test]
async fn a_mutation_rule_cannot_wait_on_a_cluster_scoped_object() {
    let (_serial, client) = start().await;
    let ns = workloads::namespace(&client, "gate-oracle").await;
    let victim = workloads::namespace(&client, "gate-victim").await;
    let labelled = cluster()
        .kubectl()
        .args(["label", "namespace", &victim, "secret=a"])
        .output()
        .unwrap();
    assert!(labelled.status.success(), "{labelled:?}");
    // A cluster-scoped custom resource: a kind only discovery knows to be cluster-scoped.
    let crd = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: vaults.gates.example.com}
spec:
  group: gates.example.com
  scope: Cluster
  names: {plural: vaults, singular: vault, kind: Vault}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
"#;
    cluster().apply(crd).unwrap_or_else(|e| panic!("{e:#}"));
    cluster()
        .wait_condition("crd", "vaults.gates.example.com", "Established", WAIT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    cluster()
        .apply("apiVersion: gates.example.com/v1\nkind: Vault\nmetadata: {name: main}\nstatus: {phase: Ready}\n")
        .unwrap_or_else(|e| panic!("{e:#}"));
    let waits = [
        (
            "peek-ns",
            format!(
                "[{{object: {{apiVersion: v1, kind: Namespace, name: {victim}, conditions: [{{path: '$.metadata.labels.secret', equals: a}}]}}}}]"
            ),
            "Namespace (v1) is cluster-scoped",
        ),
        (
            "peek-cmr",
            "[{object: {apiVersion: initium.dev/v1alpha1, kind: ClusterMutationRule, name: anything}}]".to_owned(),
            "ClusterMutationRule (initium.dev/v1alpha1) is cluster-scoped",
        ),
        (
            "peek-vault",
            "[{object: {apiVersion: gates.example.com/v1, kind: Vault, name: main, conditions: [{path: '$.status.phase', equals: Ready}]}}]".to_owned(),
            "Vault (gates.example.com/v1) is cluster-scoped",
        ),
    ];
    // Created while initium is not validating (no webhook configuration yet): stored as is.
    for (name, wait_for, _) in &waits {
        cluster()
            .apply(&gate_rule(&ns, name, wait_for, ""))
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
    let _serving = Serving::start();
    // With initium validating, the well-known kinds are refused at `kubectl apply`, naming
    // the field; the custom kind only discovery knows is accepted (and judged below).
    for (name, wait_for, says) in &waits {
        let (applied, stderr) = kubectl_apply(&gate_rule(&ns, &format!("{name}-2"), wait_for, ""));
        if *name == "peek-vault" {
            assert!(applied, "{stderr}");
            continue;
        }
        assert!(!applied, "{name} applied: {stderr}");
        assert!(
            stderr.contains("spec.gate.waitFor[0].object.kind")
                && stderr.contains(says)
                && stderr.contains("use a ClusterMutationRule"),
            "{stderr}"
        );
    }
    // Every such rule is not Ready, its status naming the field; so it holds no Pod, and no
    // Pod's release can tell what the object says.
    for (name, _, says) in &waits {
        for rule in [name.to_string(), format!("{name}-2")] {
            if rule.ends_with("-2") && *name != "peek-vault" {
                continue;
            }
            let (reason, message) = not_ready(&client, &ns, &rule).await;
            assert!(
                message.contains("spec.gate.waitFor[0].object.kind") && message.contains(says),
                "{rule}: {reason}: {message}"
            );
            let pod = create_pod(&client, &ns, &rule, json!({})).await;
            assert!(
                !gates(&pod).iter().any(|g| g.starts_with("initium.dev/")),
                "{rule} gated a Pod: {:?}",
                gates(&pod)
            );
        }
    }
}

/// Issue 30, finding 5: an `object` dependency on one ConfigMap made initium list, watch and
/// keep every ConfigMap of the cluster.
#[tokio::test]
async fn an_object_dependency_keeps_only_the_object_it_names() {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use support::measure::mib;

    let (_serial, client) = start().await;
    let serving = Serving::start();
    let ns = workloads::namespace(&client, "gate-scope").await;
    let other = workloads::namespace(&client, "gate-scope-other").await;
    // Another tenant's ConfigMaps: 200 of 50 KiB.
    let filler = "x".repeat(50 * 1024);
    let others: Api<ConfigMap> = Api::namespaced(client.clone(), &other);
    let created: Vec<_> = futures::stream::iter(0..200)
        .map(|i| {
            let others = others.clone();
            let config: ConfigMap = serde_json::from_value(json!({
                "metadata": {"name": format!("other-{i}")},
                "data": {"filler": filler},
            }))
            .unwrap();
            async move { others.create(&PostParams::default(), &config).await }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(
        created.iter().all(Result::is_ok),
        "creating ConfigMaps failed"
    );
    let settings: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    // The named ConfigMap carries 512 KiB its conditions never read.
    let config: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "settings"}, "data": {"ready": "no", "blob": "y".repeat(512 << 10)},
    }))
    .unwrap();
    settings
        .create(&PostParams::default(), &config)
        .await
        .unwrap();
    let before = serving.initium.memory().unwrap();
    assert_eq!(metric(&serving, "initium_gate_dependency_objects"), 0.0);

    let rule = gate_rule(
        &ns,
        "settings",
        "[{object: {apiVersion: v1, kind: ConfigMap, name: settings, conditions: [{path: '$.data.ready', equals: 'yes'}]}}]",
        "",
    );
    hold_one_pod(&client, &ns, "settings", &rule).await;
    eventually(
        "initium to keep the ConfigMap the gate names",
        WAIT,
        || async {
            let kept = metric(&serving, "initium_gate_dependency_objects");
            if kept >= 1.0 {
                Ok(())
            } else {
                Err(format!("{kept} objects kept"))
            }
        },
    )
    .await;
    // Whatever a cluster-wide list would bring has come by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let kept = metric(&serving, "initium_gate_dependency_objects");
    let kept_bytes = metric(&serving, "initium_gate_dependency_object_bytes");
    let after = serving.initium.memory().unwrap();
    eprintln!(
        "gates: an object dependency on one 512 KiB ConfigMap beside 200 x 50 KiB others: {kept} objects kept, {kept_bytes} bytes; initium RSS {:.1} -> {:.1} MiB, peak {:.1} MiB",
        mib(before.rss_kib),
        mib(after.rss_kib),
        mib(after.peak_kib)
    );
    assert_eq!(kept, 1.0, "initium keeps objects the gate does not name");
    // Only what the condition reads, `$.data.ready`, is kept of the object it names.
    assert_eq!(
        kept_bytes,
        r#"{"data":{"ready":"no"}}"#.len() as f64,
        "initium keeps more of the object than its conditions read"
    );
    still_held_after(&client, &ns, "wait=settings", Duration::from_secs(1)).await;

    // The named ConfigMap becomes ready: the Pod is released and nothing is kept any more.
    settings
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"ready": "yes"}})),
        )
        .await
        .unwrap();
    pods_released(&client, &ns, "wait=settings", 1).await;
    eventually("no object kept once no Pod waits", WAIT, || async {
        let kept = metric(&serving, "initium_gate_dependency_objects");
        if kept == 0.0 {
            Ok(())
        } else {
            Err(format!("{kept} objects kept"))
        }
    })
    .await;
}

/// Issue 30, finding 6, at scale: one tenant's many Pods wait on an object whose conditions
/// are slow regular expressions, and the tenant keeps changing that object. The loop that
/// releases every namespace's Pods judges the object once per change, not once per waiting
/// Pod, so another namespace's Pod is released about as fast as with no such tenant.
#[tokio::test]
async fn a_tenants_slow_gate_conditions_over_many_pods_do_not_delay_other_namespaces() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::wait::await_condition;

    const WAITING: usize = 100;
    let (_serial, client) = start().await;
    let _serving = Serving::start();
    let slow = workloads::namespace(&client, "gate-slow").await;
    let calm = workloads::namespace(&client, "gate-calm").await;

    // Aperiodic a/b text on which `a[ab]{100}c` makes the lazy DFA build a state at almost
    // every byte: each search is just within what one search may cost (about 14 ms in a
    // release build), and 16 of them on one object take far longer than the judgement's own
    // budget.
    let mut texts = 0x2545_f491_4f6c_dd1d_u64;
    let mut blob = || -> String {
        texts += 1;
        support::fixtures::thrashing_text(24_000, texts)
    };
    let conditions = (0..16)
        .map(|_| "{path: '$.data.blob', matches: 'a[ab]{100}c'}")
        .collect::<Vec<_>>()
        .join(", ");
    let slow_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &slow);
    let map = |blob: String| -> ConfigMap {
        serde_json::from_value(json!({"metadata": {"name": "blob"}, "data": {"blob": blob}}))
            .unwrap()
    };
    slow_maps
        .create(&PostParams::default(), &map(blob()))
        .await
        .unwrap();
    let rule = gate_rule(
        &slow,
        "slow",
        &format!(
            "[{{object: {{apiVersion: v1, kind: ConfigMap, name: blob, conditions: [{conditions}]}}}}]"
        ),
        "",
    );
    apply_rule(&client, &slow, "slow", &rule).await;
    for _ in 0..WAITING {
        create_pod(&client, &slow, "slow", json!({})).await;
    }
    pods_held(
        &client,
        &slow,
        "wait=slow",
        WAITING,
        &gate_of(&slow, "slow"),
    )
    .await;

    // The other namespace: a Pod waiting on a ConfigMap that turns ready.
    let calm_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &calm);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &calm);
    // Released this long after its dependency turned ready.
    let release = |round: usize| {
        let calm_maps = calm_maps.clone();
        let pods = pods.clone();
        let client = client.clone();
        let calm = calm.clone();
        async move {
            let map_name = format!("go-{round}");
            let config: ConfigMap = serde_json::from_value(
                json!({"metadata": {"name": map_name}, "data": {"ready": "no"}}),
            )
            .unwrap();
            calm_maps
                .create(&PostParams::default(), &config)
                .await
                .unwrap();
            let rule = gate_rule(
                &calm,
                &format!("calm-{round}"),
                &format!(
                    "[{{object: {{apiVersion: v1, kind: ConfigMap, name: {name}, conditions: [{{path: '$.data.ready', equals: 'yes'}}]}}}}]",
                    name = map_name
                ),
                "",
            );
            apply_rule(&client, &calm, &format!("calm-{round}"), &rule).await;
            let pod = create_pod(&client, &calm, &format!("calm-{round}"), json!({})).await;
            let pod_name = name(&pod);
            pods_held(
                &client,
                &calm,
                &format!("wait=calm-{round}"),
                1,
                &gate_of(&calm, &format!("calm-{round}")),
            )
            .await;
            let started = Instant::now();
            calm_maps
                .patch(
                    &map_name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"data": {"ready": "yes"}})),
                )
                .await
                .unwrap();
            tokio::time::timeout(
                WAIT,
                await_condition(pods, &pod_name, |p: Option<&Pod>| {
                    p.is_some_and(|p| !gates(p).iter().any(|g| g.starts_with("initium.dev/")))
                }),
            )
            .await
            .expect("the other namespace's Pod released")
            .unwrap();
            started.elapsed()
        }
    };
    // Baseline, in the same run: the slow tenant's object does not change.
    let quiet = release(0).await;
    // The slow tenant changes its object (what the conditions read) every 100 ms: each change
    // makes the controller judge the 100 waiting Pods again.
    let changes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let churn = {
        let slow_maps = slow_maps.clone();
        let changes = changes.clone();
        let mut texts: Vec<String> = (0..40).map(|_| blob()).collect();
        tokio::spawn(async move {
            for text in texts.drain(..) {
                let patched = slow_maps
                    .patch(
                        "blob",
                        &PatchParams::default(),
                        &Patch::Merge(json!({"data": {"blob": text}})),
                    )
                    .await;
                if patched.is_ok() {
                    changes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let busy = release(1).await;
    churn.abort();
    let changed = changes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        changed >= 5,
        "the slow tenant's object changed only {changed} times"
    );
    eprintln!(
        "gates: another namespace's Pod released {busy:?} after its dependency turned ready while a tenant changed the object {WAITING} Pods wait on (16 slow conditions) every 100 ms ({changed} changes so far); {quiet:?} with that tenant quiet"
    );
    assert!(
        busy < quiet + Duration::from_secs(3),
        "the slow tenant delayed another namespace's release: {busy:?} (quiet: {quiet:?})"
    );
    pods_held(
        &client,
        &slow,
        "wait=slow",
        WAITING,
        &gate_of(&slow, "slow"),
    )
    .await;
    // The held Pods go, so that later tests start with no Pod waiting.
    Api::<Pod>::namespaced(client.clone(), &slow)
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default().labels("wait=slow"),
        )
        .await
        .unwrap();
    eventually("the slow tenant's Pods deleted", WAIT, || async {
        let left = workloads::pods(&client, &slow, "wait=slow")
            .await
            .map_err(|e| e.to_string())?
            .len();
        if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} left"))
        }
    })
    .await;
}

/// Issue 30, finding 4, at run time: a MutationRule waits on a custom kind not served yet
/// (nothing can tell its scope), and the kind is then installed cluster-scoped with an object
/// that satisfies the gate. The held Pod must not be released on that object: the rule turns
/// not Ready (released as `GateRuleGone`), never `GateReleased`.
#[tokio::test]
async fn a_kind_installed_cluster_scoped_while_pods_wait_never_releases_them_on_it() {
    let (_serial, client) = start().await;
    let _serving = Serving::start();
    let ns = workloads::namespace(&client, "gate-late-kind").await;
    let rule = gate_rule(
        &ns,
        "late",
        "[{object: {apiVersion: gates.example.com/v1, kind: Safe, name: main, conditions: [{path: '$.status.phase', equals: Ready}]}}]",
        "",
    );
    hold_one_pod(&client, &ns, "late", &rule).await;
    let pod = name(&workloads::pods(&client, &ns, "wait=late").await.unwrap()[0]);
    let crd = r#"apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: safes.gates.example.com}
spec:
  group: gates.example.com
  scope: Cluster
  names: {plural: safes, singular: safe, kind: Safe}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
"#;
    cluster().apply(crd).unwrap_or_else(|e| panic!("{e:#}"));
    cluster()
        .wait_condition("crd", "safes.gates.example.com", "Established", WAIT)
        .unwrap_or_else(|e| panic!("{e:#}"));
    cluster()
        .apply("apiVersion: gates.example.com/v1\nkind: Safe\nmetadata: {name: main}\nstatus: {phase: Ready}\n")
        .unwrap_or_else(|e| panic!("{e:#}"));
    pods_released(&client, &ns, "wait=late", 1).await;
    // Why it was released: the Event that comes with the release.
    let released = eventually("the release's Event", WAIT, || async {
        let released = events(&client, &ns, &pod, "GateReleased").await;
        let gone = events(&client, &ns, &pod, "GateRuleGone").await;
        if released.is_empty() && gone.is_empty() {
            Err("none yet".to_owned())
        } else {
            Ok(released)
        }
    })
    .await;
    assert!(
        released.is_empty(),
        "released on the cluster-scoped object: {:?}",
        released.iter().map(|e| e.note.clone()).collect::<Vec<_>>()
    );
    let (reason, message) = not_ready(&client, &ns, "late").await;
    assert!(
        reason == "KindNotAllowed"
            && message.contains(
                "spec.gate.waitFor[0].object.kind: Safe (gates.example.com/v1) is cluster-scoped"
            ),
        "{reason}: {message}"
    );
    let gone = eventually("the GateRuleGone Event", WAIT, || async {
        let gone = events(&client, &ns, &pod, "GateRuleGone").await;
        if gone.is_empty() {
            Err("none yet".to_owned())
        } else {
            Ok(gone.len())
        }
    })
    .await;
    assert!(
        events(&client, &ns, &pod, "GateReleased").await.is_empty(),
        "released on the cluster-scoped object"
    );
    eprintln!("gates: a kind installed cluster-scoped: {gone} GateRuleGone, 0 GateReleased");
}
