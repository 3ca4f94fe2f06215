//! The controller (`initium::controller::run`) in-process against a real kube-apiserver (see
//! docs/control-plane.md): rules reach the index and get their status, the webhook
//! configurations follow the Ready rules, Namespace labels reach the shared state, one replica
//! writes while another waits for the Lease, the API server trusts the self-managed
//! certificate, and a lost certificate Secret is recreated with the caBundle following.
//!
//! Rules and webhook configurations are cluster-wide and every controller watches every rule,
//! so the tests run one at a time (`serial`) and delete what they created. Each test uses its
//! own namespace for initium and unique names for the configurations and the Lease.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::routing::post;
use axum_server::tls_rustls::RustlsConfig;
use initium::admission::state::{AdmissionConfig, Shared};
use initium::api::{ClusterMutationRule, FailurePolicy, MutationRule};
use initium::controller::webhooks::{self, RuleNeeds};
use initium::controller::{self, ControllerConfig, ControllerError, WebhookEndpoint, discovery};
use initium::engine::{RuleId, compile};
use initium::tls;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long to wait for what should take a moment (watch events, writes).
const TIMEOUT: Duration = Duration::from_secs(20);
/// Nothing listens here: the API server's calls fail at once (and, with `Ignore`, are
/// skipped), which is all these tests need from the webhook itself.
const NOWHERE: &str = "https://127.0.0.1:9";
/// A short Lease so the takeover test does not wait long.
const LEASE: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------------------------
// Helpers

use support::cluster::{Cleanup, lease_holder};
use support::{eventually, install_crds, serial, unique};

/// A controller configuration for a test: its own namespace, configuration and Lease names,
/// a short Lease, quick resyncs, and rule validation that tolerates the absent webhook.
fn test_config(namespace: &str, name: &str) -> ControllerConfig {
    let mut config = ControllerConfig::new(namespace, WebhookEndpoint::Url(NOWHERE.into()));
    config.webhook_configuration = name.into();
    config.lease.name = name.into();
    config.lease.duration = LEASE;
    config.lease.grace = Duration::from_secs(1);
    config.rule_validation_policy = FailurePolicy::Ignore;
    config.resync_interval = Duration::from_secs(2);
    config
}

/// The controller's logs, filtered by `RUST_LOG` (e.g. `RUST_LOG=initium=debug`; errors
/// only by default), shown for failing tests.
fn log() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// One controller running in this process.
struct Running {
    shared: Arc<Shared>,
    config: ControllerConfig,
    ca_bundle: Option<Vec<u8>>,
    rustls: RustlsConfig,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ControllerError>>,
}

impl Running {
    async fn start(client: &kube::Client, config: ControllerConfig) -> Running {
        log();
        let tls = config
            .load_tls(client)
            .await
            .unwrap_or_else(|e| panic!("tls::load: {e}"));
        Running::start_with(client, config, tls)
    }

    fn start_with(client: &kube::Client, config: ControllerConfig, tls: tls::Tls) -> Running {
        let shared = Shared::new(AdmissionConfig::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let ca_bundle = tls.ca_bundle();
        let rustls = tls.rustls_config();
        let task = tokio::spawn(controller::run(
            client.clone(),
            shared.clone(),
            config.clone(),
            tls,
            async move {
                let _ = stopped.await;
            },
        ));
        Running {
            shared,
            config,
            ca_bundle,
            rustls,
            stop: Some(stop),
            task,
        }
    }

    async fn synced(&self) {
        let shared = self.shared.clone();
        eventually("the controller to be synced", TIMEOUT, || {
            let shared = shared.clone();
            async move {
                shared
                    .is_synced()
                    .then_some(())
                    .ok_or_else(|| "not synced".into())
            }
        })
        .await;
    }

    fn indexed(&self) -> Vec<String> {
        self.shared
            .rules
            .load()
            .rules()
            .iter()
            .map(|r| r.id.to_string())
            .collect()
    }

    /// Shuts the controller down as `initium serve` does on SIGTERM.
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let task = &mut self.task;
        let result = tokio::time::timeout(TIMEOUT, task)
            .await
            .expect("the controller stops within the timeout")
            .expect("the controller task does not panic");
        assert!(result.is_ok(), "the controller ended with {result:?}");
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A Fail rule for Deployments and Pods, on CREATE and UPDATE.
fn deployments_spec() -> Value {
    let mut spec = rule_spec(&["apps/v1/Deployment", "Pod"]);
    spec["failurePolicy"] = json!("Fail");
    spec["match"]["operations"] = json!(["CREATE", "UPDATE"]);
    spec
}

fn rule_spec(kinds: &[&str]) -> Value {
    json!({
        "match": {"kinds": kinds},
        "mutations": [{"merge": {"metadata": {"labels": {"initialized": "true"}}}}],
    })
}

async fn create_rule(
    client: &kube::Client,
    cleanup: &mut Cleanup,
    namespace: &str,
    name: &str,
    spec: Value,
) -> MutationRule {
    let rule: MutationRule = serde_json::from_value(json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }))
    .expect("a MutationRule");
    cleanup.rules.push(RuleId::namespaced(namespace, name));
    Api::<MutationRule>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &rule)
        .await
        .unwrap_or_else(|e| panic!("create MutationRule {namespace}/{name}: {e}"))
}

async fn create_cluster_rule(
    client: &kube::Client,
    cleanup: &mut Cleanup,
    name: &str,
    spec: Value,
) -> ClusterMutationRule {
    let rule: ClusterMutationRule = serde_json::from_value(json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "ClusterMutationRule",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("a ClusterMutationRule");
    cleanup.rules.push(RuleId::cluster(name));
    Api::<ClusterMutationRule>::all(client.clone())
        .create(&PostParams::default(), &rule)
        .await
        .unwrap_or_else(|e| panic!("create ClusterMutationRule {name}: {e}"))
}

/// The `Ready` condition and `status.observedGeneration` of a rule, with its generation.
async fn ready_of(
    client: &kube::Client,
    id: &RuleId,
) -> Result<(Condition, Option<i64>, Option<i64>), String> {
    let (status, generation) = match &id.namespace {
        Some(ns) => {
            let rule = Api::<MutationRule>::namespaced(client.clone(), ns)
                .get(&id.name)
                .await
                .map_err(|e| e.to_string())?;
            (rule.status, rule.metadata.generation)
        }
        None => {
            let rule = Api::<ClusterMutationRule>::all(client.clone())
                .get(&id.name)
                .await
                .map_err(|e| e.to_string())?;
            (rule.status, rule.metadata.generation)
        }
    };
    let status = status.ok_or("no status yet")?;
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .cloned()
        .ok_or_else(|| format!("no Ready condition: {status:?}"))?;
    Ok((ready, status.observed_generation, generation))
}

/// Waits until the rule's Ready condition has `status` and `reason` for its current
/// generation; returns the condition.
async fn wait_ready(client: &kube::Client, id: &RuleId, status: &str, reason: &str) -> Condition {
    eventually(
        &format!("{} to be Ready={status} ({reason})", id.describe()),
        TIMEOUT,
        || async {
            let (ready, observed, generation) = ready_of(client, id).await?;
            if ready.status == status
                && ready.reason == reason
                && observed == generation
                && ready.observed_generation == generation
            {
                Ok(ready)
            } else {
                Err(format!(
                    "{ready:?}, status.observedGeneration {observed:?}, generation {generation:?}"
                ))
            }
        },
    )
    .await
}

/// `name: group/version resources [operations]` for every rule of every webhook.
fn summary(configuration: &MutatingWebhookConfiguration) -> Vec<String> {
    let mut lines = Vec::new();
    for webhook in configuration.webhooks.iter().flatten() {
        for rule in webhook.rules.iter().flatten() {
            lines.push(format!(
                "{}: {}/{} {} [{}]",
                webhook.name,
                rule.api_groups.as_deref().unwrap_or_default().join(","),
                rule.api_versions.as_deref().unwrap_or_default().join(","),
                rule.resources.as_deref().unwrap_or_default().join(","),
                rule.operations.as_deref().unwrap_or_default().join(","),
            ));
        }
    }
    lines
}

/// Waits until the MutatingWebhookConfiguration `name` summarizes to `expected`.
async fn wait_mutating(
    client: &kube::Client,
    name: &str,
    expected: &[&str],
) -> MutatingWebhookConfiguration {
    let api = Api::<MutatingWebhookConfiguration>::all(client.clone());
    eventually(
        &format!("MutatingWebhookConfiguration {name} to be {expected:?}"),
        TIMEOUT,
        || async {
            let configuration = api
                .get_opt(name)
                .await
                .map_err(|e| e.to_string())?
                .ok_or("not there")?;
            let have = summary(&configuration);
            if have == expected {
                Ok(configuration)
            } else {
                Err(format!("{have:?}"))
            }
        },
    )
    .await
}

fn excluded_namespaces(configuration: &MutatingWebhookConfiguration) -> Vec<Vec<String>> {
    configuration
        .webhooks
        .iter()
        .flatten()
        .map(|w| {
            let selector = w.namespace_selector.clone().unwrap_or_default();
            let requirement = selector
                .match_expressions
                .unwrap_or_default()
                .into_iter()
                .find(|r| r.key == "kubernetes.io/metadata.name" && r.operator == "NotIn")
                .expect("a NotIn requirement on kubernetes.io/metadata.name");
            requirement.values.unwrap_or_default()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Rules: index and status

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_rule_is_indexed_at_once_and_gets_ready() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("ready");
    cleanup.configurations.push(name.clone());
    let running = Running::start(&client, test_config(&home, &name)).await;
    running.synced().await;

    let team = support::namespace(&client, "team").await;
    let created = create_rule(
        &client,
        &mut cleanup,
        &team,
        "label-pods",
        rule_spec(&["Pod"]),
    )
    .await;
    let started = Instant::now();
    let id = RuleId::namespaced(&team, "label-pods");
    eventually(
        "the rule to be in the index",
        Duration::from_secs(2),
        || async {
            let indexed = running.indexed();
            if indexed.contains(&id.to_string()) {
                Ok(())
            } else {
                Err(format!("{indexed:?}"))
            }
        },
    )
    .await;
    eprintln!("indexed {:?} after creation", started.elapsed());

    let ready = wait_ready(&client, &id, "True", "Compiled").await;
    assert_eq!(ready.observed_generation, created.metadata.generation);
    eprintln!("Ready after {:?}", started.elapsed());
    // Ready means in effect: by the time the status says so, the stored webhook
    // configuration already sends Pods to initium (read once, not waited for).
    let configuration = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get(&name)
        .await
        .expect("read the MutatingWebhookConfiguration");
    assert_eq!(
        summary(&configuration),
        ["ignore.initium.dev: /v1 pods [CREATE]"],
        "the rule was Ready before the webhook configuration covered it"
    );

    // A new generation is compiled and acknowledged; the transition time stays (still True).
    Api::<MutationRule>::namespaced(client.clone(), &team)
        .patch(
            "label-pods",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"priority": 5}})),
        )
        .await
        .expect("patch the rule");
    let updated = wait_ready(&client, &id, "True", "Compiled").await;
    assert_eq!(updated.observed_generation, Some(2));
    assert_eq!(updated.last_transition_time, ready.last_transition_time);
    eventually("the index to have priority 5", TIMEOUT, || async {
        let index = running.shared.rules.load();
        match index.rules().iter().find(|r| r.id == id) {
            Some(rule) if rule.priority == 5 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // Deleting the rule takes it out of the index.
    Api::<MutationRule>::namespaced(client.clone(), &team)
        .delete("label-pods", &DeleteParams::default())
        .await
        .expect("delete the rule");
    eventually(
        "the rule to leave the index",
        Duration::from_secs(2),
        || async {
            let indexed = running.indexed();
            if indexed.is_empty() {
                Ok(())
            } else {
                Err(format!("{indexed:?}"))
            }
        },
    )
    .await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_rule_is_not_ready_and_does_not_stop_the_others() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("invalid");
    cleanup.configurations.push(name.clone());
    let running = Running::start(&client, test_config(&home, &name)).await;
    running.synced().await;

    let team = support::namespace(&client, "team").await;
    // Valid for the schema (and CEL), not for the engine: the regex does not compile.
    let mut bad = rule_spec(&["Pod"]);
    bad["conditions"] = json!([{"path": "$.metadata.name", "matches": "web-(["}]);
    create_rule(&client, &mut cleanup, &team, "bad-regex", bad).await;
    create_rule(&client, &mut cleanup, &team, "good", rule_spec(&["Pod"])).await;

    let bad_id = RuleId::namespaced(&team, "bad-regex");
    let good_id = RuleId::namespaced(&team, "good");
    let condition = wait_ready(&client, &bad_id, "False", "InvalidRule").await;
    assert!(
        condition
            .message
            .starts_with("spec.conditions[0].matches: "),
        "the message names the field: {}",
        condition.message
    );
    wait_ready(&client, &good_id, "True", "Compiled").await;
    assert_eq!(running.indexed(), [good_id.to_string()]);
    let metrics = running.shared.metrics.encode();
    assert!(
        metrics.contains(r#"initium_rules{state="ready"} 1"#)
            && metrics.contains(r#"initium_rules{state="invalid"} 1"#),
        "{metrics}"
    );
    running.stop().await;
}

/// One namespace owner cannot make initium hold more than its quota: its rules past
/// `--max-rules-per-namespace` (the newest) are not Ready, with the flag named, and nothing
/// of them is indexed; another namespace and the ClusterMutationRules are not counted; a rule
/// deleted makes room for the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_past_a_namespaces_quota_are_not_ready_and_others_are_untouched() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("quota");
    cleanup.configurations.push(name.clone());
    let mut config = test_config(&home, &name);
    config.quotas.rules_per_namespace = 2;
    let running = Running::start(&client, config).await;
    running.synced().await;

    let team = support::namespace(&client, "team").await;
    let other = support::namespace(&client, "other").await;
    for rule in ["r1", "r2", "r3"] {
        create_rule(&client, &mut cleanup, &team, rule, rule_spec(&["Pod"])).await;
    }
    for rule in ["o1", "o2"] {
        create_rule(&client, &mut cleanup, &other, rule, rule_spec(&["Pod"])).await;
    }
    let platform = unique("platform");
    create_cluster_rule(&client, &mut cleanup, &platform, rule_spec(&["Pod"])).await;

    let id = |ns: &str, n: &str| RuleId::namespaced(ns, n);
    // Created in the same second: the order of their names decides.
    let over = wait_ready(&client, &id(&team, "r3"), "False", "QuotaExceeded").await;
    assert!(
        over.message.contains(&format!(
            "namespace {team} already has 2 Ready MutationRules, its quota (--max-rules-per-namespace)"
        )),
        "{}",
        over.message
    );
    for (ns, rule) in [(&team, "r1"), (&team, "r2"), (&other, "o1"), (&other, "o2")] {
        wait_ready(&client, &id(ns, rule), "True", "Compiled").await;
    }
    wait_ready(&client, &RuleId::cluster(&platform), "True", "Compiled").await;
    let indexed = running.indexed();
    assert!(
        !indexed.contains(&id(&team, "r3").to_string()),
        "{indexed:?}"
    );
    assert!(
        indexed.contains(&id(&other, "o2").to_string()),
        "{indexed:?}"
    );

    // Room again: r3 takes r1's place.
    Api::<MutationRule>::namespaced(client.clone(), &team)
        .delete("r1", &Default::default())
        .await
        .expect("delete r1");
    wait_ready(&client, &id(&team, "r3"), "True", "Compiled").await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_for_a_kind_that_is_not_served_waits_for_its_crd() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("unserved");
    cleanup.configurations.push(name.clone());
    let running = Running::start(&client, test_config(&home, &name)).await;
    running.synced().await;

    let group = format!("{}.example.com", unique("w"));
    let kind = format!("{group}/v1/Widget");
    let rule = unique("widgets");
    create_cluster_rule(&client, &mut cleanup, &rule, rule_spec(&[&kind])).await;
    let id = RuleId::cluster(&rule);
    let condition = wait_ready(&client, &id, "False", "KindNotServed").await;
    assert_eq!(
        condition.message,
        format!("spec.match.kinds[0]: {kind} is not served by the API server")
    );
    assert!(running.indexed().is_empty());

    // Installing the CRD makes the kind served: the rule turns Ready without being touched.
    let crd_name = format!("widgets.{group}");
    cleanup.crds.push(crd_name.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": crd_name},
        "spec": {
            "group": group,
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            }],
        },
    }))
    .expect("a CRD");
    let started = Instant::now();
    Api::<CustomResourceDefinition>::all(client.clone())
        .create(&PostParams::default(), &crd)
        .await
        .expect("create the Widget CRD");
    wait_ready(&client, &id, "True", "Compiled").await;
    eprintln!("Ready {:?} after the CRD was created", started.elapsed());
    wait_mutating(
        &client,
        &name,
        &[&format!("ignore.initium.dev: {group}/v1 widgets [CREATE]")],
    )
    .await;
    assert_eq!(running.indexed(), [rule]);
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Webhook configurations

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_configuration_covers_exactly_what_ready_rules_need() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("webhooks");
    cleanup.configurations.push(name.clone());
    let mut config = test_config(&home, &name);
    config.excluded_namespaces = vec!["kube-system".into(), "audit".into()];
    let running = Running::start(&client, config).await;
    running.synced().await;

    // No rules: the configuration exists and intercepts nothing.
    let empty = wait_mutating(&client, &name, &[]).await;
    assert_eq!(empty.webhooks.as_deref().unwrap_or_default().len(), 0);
    let validating = eventually("the ValidatingWebhookConfiguration", TIMEOUT, || async {
        Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .get_opt(&name)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "not there".to_string())
    })
    .await;
    let rules_webhook = &validating.webhooks.as_deref().unwrap_or_default()[0];
    assert_eq!(rules_webhook.name, "rules.initium.dev");
    assert_eq!(
        rules_webhook.client_config.url.as_deref(),
        Some(&*format!("{NOWHERE}/validate"))
    );

    let team = support::namespace(&client, "team").await;
    create_rule(&client, &mut cleanup, &team, "pods", rule_spec(&["Pod"])).await;
    let pods = wait_mutating(&client, &name, &["ignore.initium.dev: /v1 pods [CREATE]"]).await;
    let webhook = &pods.webhooks.as_deref().unwrap_or_default()[0];
    assert_eq!(webhook.failure_policy.as_deref(), Some("Ignore"));
    assert_eq!(webhook.side_effects, "None");
    assert_eq!(webhook.admission_review_versions, ["v1"]);
    assert_eq!(webhook.match_policy.as_deref(), Some("Equivalent"));
    assert_eq!(webhook.reinvocation_policy.as_deref(), Some("IfNeeded"));
    assert_eq!(
        webhook.timeout_seconds,
        Some(1),
        "twice the 200ms budget, at least 1s"
    );
    assert_eq!(
        webhook.client_config.url.as_deref(),
        Some(&*format!("{NOWHERE}/mutate"))
    );
    assert_eq!(
        webhook
            .client_config
            .ca_bundle
            .as_ref()
            .map(|b| b.0.clone()),
        running.ca_bundle,
        "the caBundle is the self-managed CA"
    );
    let mut expected_excluded = vec!["audit".to_string(), home.clone(), "kube-system".into()];
    expected_excluded.sort();
    assert_eq!(excluded_namespaces(&pods), [expected_excluded]);

    // A Fail rule for Deployments (and Pods, on UPDATE too).
    create_cluster_rule(&client, &mut cleanup, "deployments", deployments_spec()).await;
    wait_mutating(
        &client,
        &name,
        &[
            "fail.initium.dev: /v1 pods [CREATE,UPDATE]",
            "fail.initium.dev: apps/v1 deployments [CREATE,UPDATE]",
        ],
    )
    .await;

    // Rules that are not Ready add nothing.
    let mut bad = rule_spec(&["ConfigMap"]);
    bad["conditions"] = json!([{"path": "$.x", "matches": "("}]);
    create_rule(&client, &mut cleanup, &team, "bad", bad).await;
    wait_ready(
        &client,
        &RuleId::namespaced(&team, "bad"),
        "False",
        "InvalidRule",
    )
    .await;
    let unchanged = wait_mutating(
        &client,
        &name,
        &[
            "fail.initium.dev: /v1 pods [CREATE,UPDATE]",
            "fail.initium.dev: apps/v1 deployments [CREATE,UPDATE]",
        ],
    )
    .await;

    // What the API server stores compares equal to what the controller wants, so resyncs
    // find nothing to write (a stored default missing from the desired configuration would
    // make every resync write).
    let served = discovery::discover(&client).await.expect("discovery");
    let needs: Vec<std::sync::Arc<RuleNeeds>> = [
        (RuleId::namespaced(&team, "pods"), rule_spec(&["Pod"])),
        (RuleId::cluster("deployments"), deployments_spec()),
    ]
    .into_iter()
    .map(|(id, spec)| {
        let spec = serde_json::from_value(spec).expect("a rule spec");
        std::sync::Arc::new(RuleNeeds::of(
            &compile(id, &spec).expect("the rule compiles"),
        ))
    })
    .collect();
    let desired = webhooks::desired_mutating(
        &running.config.webhook_settings(),
        running.shared.config.budget,
        running.ca_bundle.as_deref(),
        &needs,
        &served,
    );
    assert!(
        webhooks::up_to_date(&unchanged, &desired),
        "stored:\n{unchanged:#?}\ndesired:\n{desired:#?}"
    );
    let stored_validating = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .get(&name)
        .await
        .expect("get the ValidatingWebhookConfiguration");
    let desired_validating = webhooks::desired_validating(
        &running.config.webhook_settings(),
        running.ca_bundle.as_deref(),
    );
    assert!(
        webhooks::up_to_date(&stored_validating, &desired_validating),
        "stored:\n{stored_validating:#?}\ndesired:\n{desired_validating:#?}"
    );

    // Shrinks as rules go away; with none left it intercepts nothing again.
    for rule in cleanup.rules.clone() {
        match &rule.namespace {
            Some(ns) => Api::<MutationRule>::namespaced(client.clone(), ns)
                .delete(&rule.name, &DeleteParams::default())
                .await
                .map(|_| ()),
            None => Api::<ClusterMutationRule>::all(client.clone())
                .delete(&rule.name, &DeleteParams::default())
                .await
                .map(|_| ()),
        }
        .unwrap_or_else(|e| panic!("delete {}: {e}", rule.describe()));
        if rule.namespace.as_deref() == Some(team.as_str()) && &*rule.name == "pods" {
            wait_mutating(
                &client,
                &name,
                &[
                    "fail.initium.dev: /v1 pods [CREATE,UPDATE]",
                    "fail.initium.dev: apps/v1 deployments [CREATE,UPDATE]",
                ],
            )
            .await;
        }
    }
    wait_mutating(&client, &name, &[]).await;

    // A manual deletion is repaired at the next resync.
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .delete(&name, &DeleteParams::default())
        .await
        .expect("delete the configuration");
    wait_mutating(&client, &name, &[]).await;
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Namespaces

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_labels_reach_the_shared_state() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("namespaces");
    cleanup.configurations.push(name.clone());
    let running = Running::start(&client, test_config(&home, &name)).await;
    running.synced().await;

    let labels = |ns: &str| {
        running
            .shared
            .namespaces
            .load()
            .get(ns)
            .map(|l| l.get("team").cloned())
    };
    let team = support::namespace(&client, "labels").await;
    eventually("the new namespace", Duration::from_secs(2), || async {
        match labels(&team) {
            Some(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    Api::<Namespace>::all(client.clone())
        .patch(
            &team,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "payments"}}})),
        )
        .await
        .expect("label the namespace");
    eventually("the new label", Duration::from_secs(2), || async {
        match labels(&team) {
            Some(Some(team)) if team == "payments" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Leader election and the shared certificate

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_writes_and_another_takes_over_when_it_stops() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("leader");
    cleanup.configurations.push(name.clone());
    // Two replicas that would write different namespace exclusions: what the configuration
    // says shows which one wrote it.
    let replica = |identity: &str, excluded: &str| {
        let mut config = test_config(&home, &name);
        config.lease.identity = Some(identity.into());
        config.excluded_namespaces = vec![excluded.into()];
        config.resync_interval = Duration::from_secs(1);
        config
    };
    let (config_a, config_b) = (
        replica("replica-a", "only-a"),
        replica("replica-b", "only-b"),
    );

    // Both start at the same moment: the Secret is created once, and both serve its CA.
    let (tls_a, tls_b) = tokio::join!(config_a.load_tls(&client), config_b.load_tls(&client));
    let (tls_a, tls_b) = (tls_a.expect("tls for a"), tls_b.expect("tls for b"));
    assert!(tls_a.ca_bundle().is_some());
    assert_eq!(
        tls_a.ca_bundle(),
        tls_b.ca_bundle(),
        "one CA for both replicas"
    );
    let secrets = Api::<Secret>::namespaced(client.clone(), &home)
        .list(&ListParams::default())
        .await
        .expect("list secrets");
    let names: Vec<_> = secrets
        .items
        .iter()
        .filter_map(|s| s.metadata.name.clone())
        .collect();
    assert_eq!(names, ["initium-tls"]);

    let a = Running::start_with(&client, config_a, tls_a);
    eventually("replica-a to hold the Lease", TIMEOUT, || async {
        match lease_holder(&client, &home, &name).await {
            Some(holder) if holder == "replica-a" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let b = Running::start_with(&client, config_b, tls_b);
    a.synced().await;
    b.synced().await;

    let team = support::namespace(&client, "team").await;
    create_rule(&client, &mut cleanup, &team, "pods", rule_spec(&["Pod"])).await;
    let configuration =
        wait_mutating(&client, &name, &["ignore.initium.dev: /v1 pods [CREATE]"]).await;
    assert_eq!(
        excluded_namespaces(&configuration),
        [[home.clone(), "only-a".into()]]
    );
    // Both replicas index the rule (each from its own watch: the follower's may come a
    // moment after the leader's write); only the leader writes. The follower resyncs every
    // second: over a few seconds it would have overwritten the exclusions.
    eventually("the follower to index the rule", TIMEOUT, || async {
        let indexed = b.indexed();
        if indexed == [format!("{team}/pods")] {
            Ok(())
        } else {
            Err(format!("{indexed:?}"))
        }
    })
    .await;
    let watch_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < watch_until {
        let current = Api::<MutatingWebhookConfiguration>::all(client.clone())
            .get(&name)
            .await
            .expect("get the configuration");
        assert_eq!(
            excluded_namespaces(&current),
            [[home.clone(), "only-a".into()]],
            "the follower wrote"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // The leader stops (and releases the Lease): the other one takes over within the Lease
    // duration and writes its own view.
    a.stop().await;
    let stopped = Instant::now();
    eventually("replica-b to hold the Lease", LEASE * 3, || async {
        match lease_holder(&client, &home, &name).await {
            Some(holder) if holder == "replica-b" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let takeover = stopped.elapsed();
    eprintln!("replica-b took over {takeover:?} after replica-a stopped");
    assert!(
        takeover <= LEASE + Duration::from_secs(1),
        "took {takeover:?}, the Lease lasts {LEASE:?}"
    );
    let configuration =
        wait_mutating(&client, &name, &["ignore.initium.dev: /v1 pods [CREATE]"]).await;
    eventually("replica-b's exclusions", TIMEOUT, || async {
        let current = Api::<MutatingWebhookConfiguration>::all(client.clone())
            .get(&name)
            .await
            .map_err(|e| e.to_string())?;
        let excluded = excluded_namespaces(&current);
        if excluded == [[home.clone(), "only-b".into()]] {
            Ok(())
        } else {
            Err(format!("{excluded:?}"))
        }
    })
    .await;
    assert_eq!(
        configuration.webhooks.as_deref().unwrap_or_default()[0]
            .client_config
            .ca_bundle
            .as_ref()
            .map(|b| b.0.clone()),
        b.ca_bundle
    );
    b.stop().await;
}

/// A stand-in for initium's webhook: allows everything, except rules annotated
/// `test.initium.dev/deny`, which it denies with a message the test looks for.
async fn review(Json(review): Json<Value>) -> Json<Value> {
    let request = &review["request"];
    let deny = request["object"]["metadata"]["annotations"]["test.initium.dev/deny"].is_string();
    let mut response = json!({"uid": request["uid"], "allowed": !deny});
    if deny {
        response["status"] = json!({"code": 403, "message": "denied by the test webhook"});
    }
    Json(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_trusts_the_self_managed_certificate() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("trust");

    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let port = listener.local_addr().expect("local address").port();
    let mut config = test_config(&home, &name);
    config.endpoint = WebhookEndpoint::Url(format!("https://127.0.0.1:{port}"));
    // Rule validation must reach the webhook: a TLS failure would reject every rule.
    config.rule_validation_policy = FailurePolicy::Fail;
    let running = Running::start(&client, config).await;
    let handle = axum_server::Handle::new();
    let router = axum::Router::new()
        .route("/validate", post(review))
        .route("/mutate", post(review));
    let server = tokio::spawn(
        axum_server::from_tcp_rustls(listener, running.rustls.clone())
            .expect("serve TLS")
            .handle(handle.clone())
            .serve(router.into_make_service()),
    );
    cleanup.configurations.push(name.clone());
    running.synced().await;
    eventually("the ValidatingWebhookConfiguration", TIMEOUT, || async {
        Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .get_opt(&name)
            .await
            .map_err(|e| e.to_string())?
            .map(|_| ())
            .ok_or_else(|| "not there".to_string())
    })
    .await;

    let team = support::namespace(&client, "team").await;
    let rules = Api::<MutationRule>::namespaced(client.clone(), &team);
    let denied: MutationRule = serde_json::from_value(json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": "denied", "annotations": {"test.initium.dev/deny": "yes"}},
        "spec": rule_spec(&["Pod"]),
    }))
    .expect("a MutationRule");
    cleanup.rules.push(RuleId::namespaced(&team, "denied"));
    // The API server may take a moment to pick up the new configuration.
    let error = eventually("the API server to call the webhook", TIMEOUT, || async {
        match rules.create(&PostParams::default(), &denied).await {
            Ok(_) => {
                let _ = rules.delete("denied", &DeleteParams::default()).await;
                Err("created: the webhook was not called yet".to_string())
            }
            Err(e) if e.to_string().contains("denied by the test webhook") => Ok(e),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    eprintln!("{error}");
    create_rule(&client, &mut cleanup, &team, "allowed", rule_spec(&["Pod"])).await;

    running.stop().await;
    cleanup.run();
    handle.shutdown();
    let _ = server.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_tls_secret_is_written_again_with_the_same_ca() {
    let _serial = serial().await;
    let client = support::client().await;
    install_crds();
    let mut cleanup = Cleanup::new();
    let home = support::namespace(&client, "initium").await;
    let name = unique("renew");
    cleanup.configurations.push(name.clone());
    let mut config = test_config(&home, &name);
    config.tls = tls::TlsSource::SelfManaged {
        secret: "initium-tls".into(),
        refresh_interval: Duration::from_secs(1),
    };
    let running = Running::start(&client, config).await;
    running.synced().await;
    let first_ca = running.ca_bundle.clone().expect("a self-managed caBundle");
    let served_before = running.rustls.get_inner();
    let ca_bundle_of = |configuration: &MutatingWebhookConfiguration| {
        configuration
            .webhooks
            .iter()
            .flatten()
            .map(|w| w.client_config.ca_bundle.as_ref().map(|b| b.0.clone()))
            .collect::<Vec<_>>()
    };
    let team = support::namespace(&client, "team").await;
    create_rule(&client, &mut cleanup, &team, "pods", rule_spec(&["Pod"])).await;
    let configuration =
        wait_mutating(&client, &name, &["ignore.initium.dev: /v1 pods [CREATE]"]).await;
    assert_eq!(ca_bundle_of(&configuration), [Some(first_ca.clone())]);

    let secrets = Api::<Secret>::namespaced(client.clone(), &home);
    secrets
        .delete("initium-tls", &DeleteParams::default())
        .await
        .expect("delete the TLS Secret");
    // The leader writes it again from the certificates it serves: the same CA, so nothing
    // is reloaded and the caBundle stays.
    eventually("the TLS Secret again", TIMEOUT, || async {
        let secret = secrets
            .get_opt("initium-tls")
            .await
            .map_err(|e| e.to_string())?
            .ok_or("not yet")?;
        let ca = secret
            .data
            .unwrap_or_default()
            .get("ca.crt")
            .map(|b| b.0.clone())
            .ok_or("no ca.crt")?;
        if ca == first_ca {
            Ok(())
        } else {
            Err("a different CA".to_string())
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        Arc::ptr_eq(&served_before, &running.rustls.get_inner()),
        "the serving certificate is unchanged: nothing reloaded"
    );
    let configuration = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get(&name)
        .await
        .expect("the configuration");
    assert_eq!(ca_bundle_of(&configuration), [Some(first_ca.clone())]);
    running.stop().await;
}
