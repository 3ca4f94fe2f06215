//! The admission webhooks and the operations port, in-process: recorded AdmissionReviews (as
//! the API server sends them, in tests/data/admission/) go through the routers, and the tests
//! check what a user would notice: the patched object, warnings, denials and their messages,
//! status codes, metrics. One test runs the real HTTPS server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use initium::admission::state::{AdmissionConfig, NamespaceLabels, Shared};
use initium::engine::{RuleIndex, compile_document};
use serde_json::{Value, json};
use support::root;
use tower::ServiceExt;

// ---------------------------------------------------------------------------------------------
// Fixtures

/// A recorded AdmissionReview from tests/data/admission/.
fn review(name: &str) -> Value {
    let path = root()
        .join("tests/data/admission")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// The rules of examples/<name>/rules.yaml.
fn example_rules(name: &str) -> Vec<Value> {
    let path = root().join("examples").join(name).join("rules.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

fn cluster_rule(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "initium.dev/v1alpha1", "kind": "ClusterMutationRule",
           "metadata": {"name": name}, "spec": spec})
}

/// A rule whose only mutation fails on every Pod (there is nothing to remove).
fn failing_rule(name: &str, failure_policy: &str) -> Value {
    cluster_rule(
        name,
        json!({"failurePolicy": failure_policy, "match": {"kinds": ["Pod"]},
               "mutations": [{"patch": [{"op": "remove", "path": "/spec/notThere"}]}]}),
    )
}

fn shared_with(rules: Vec<Value>, config: AdmissionConfig) -> Arc<Shared> {
    let compiled = rules
        .iter()
        .map(|doc| compile_document(doc, "default").unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let shared = Shared::new(config);
    shared.rules.store(Arc::new(RuleIndex::new(compiled)));
    shared
}

fn shared(rules: Vec<Value>) -> Arc<Shared> {
    shared_with(rules, AdmissionConfig::default())
}

// ---------------------------------------------------------------------------------------------
// Driving the routers

async fn send(router: Router, method: &str, path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .expect("request");
    let response = router.oneshot(request).await.expect("infallible");
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("response body");
    (status, body.to_vec())
}

/// Posts a review to a webhook; returns the whole AdmissionReview answer.
async fn post_review(shared: &Arc<Shared>, path: &str, review: &Value) -> Value {
    let body = serde_json::to_vec(review).expect("json");
    let (status, body) = send(
        initium::admission::router(shared.clone()),
        "POST",
        path,
        body,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let answer: Value = serde_json::from_slice(&body).expect("response is JSON");
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(
        answer["response"]["uid"], review["request"]["uid"],
        "the uid is echoed"
    );
    answer
}

async fn mutate(shared: &Arc<Shared>, review: &Value) -> Value {
    post_review(shared, "/mutate", review).await["response"].clone()
}

async fn validate(shared: &Arc<Shared>, review: &Value) -> Value {
    post_review(shared, "/validate", review).await["response"].clone()
}

/// The request's object with the response's patch applied, as the API server would store it.
fn patched(review: &Value, response: &Value) -> Value {
    assert_eq!(response["allowed"], true, "{response:#}");
    assert_eq!(response["patchType"], "JSONPatch");
    let bytes = STANDARD
        .decode(response["patch"].as_str().expect("patch is a string"))
        .expect("patch is base64");
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("patch is RFC 6902");
    let mut object = review["request"]["object"].clone();
    json_patch::patch(&mut object, &patch).expect("patch applies to the request's object");
    object
}

fn assert_unchanged(response: &Value) {
    assert_eq!(response["allowed"], true, "{response:#}");
    assert!(response.get("patch").is_none(), "{response:#}");
    assert!(response.get("patchType").is_none(), "{response:#}");
}

fn warnings(response: &Value) -> Vec<String> {
    response["warnings"]
        .as_array()
        .map(|w| {
            w.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

async fn metrics(shared: &Arc<Shared>) -> String {
    let (status, body) = send(
        initium::ops::router(shared.clone()),
        "GET",
        "/metrics",
        vec![],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    String::from_utf8(body).expect("metrics are text")
}

/// The value of one sample line (`name{labels} value`) in the exposition.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

fn by_name<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .and_then(|l| l.iter().find(|x| x["name"] == name))
        .unwrap_or_else(|| panic!("no {name:?} in {list:#}"))
}

// ---------------------------------------------------------------------------------------------
// /mutate

#[tokio::test]
async fn pod_create_gets_the_namespace_test_ca_in_every_container() {
    let shared = shared(example_rules("test-ca"));
    let review = review("pod-create");
    let response = mutate(&shared, &review).await;
    assert!(warnings(&response).is_empty(), "{response:#}");
    let pod = patched(&review, &response);

    let meta = &pod["metadata"];
    assert_eq!(
        meta["annotations"]["initium.dev/mutated-by"],
        "payments/test-certs"
    );
    assert_eq!(
        meta["annotations"]["certs.example.com/namespace"],
        "payments"
    );
    assert_eq!(meta["labels"]["certs"], "injected");
    assert_eq!(meta["labels"]["app"], "api", "existing labels are kept");
    assert_eq!(meta["generateName"], "api-");
    assert!(
        meta.get("name").is_none(),
        "the API server picks the name later: {meta:#}"
    );

    let volumes = &pod["spec"]["volumes"];
    assert_eq!(
        by_name(volumes, "test-ca")["secret"]["secretName"],
        "test-ca"
    );
    assert_eq!(
        volumes.as_array().map(Vec::len),
        Some(2),
        "data and test-ca"
    );
    for (list, name) in [
        ("containers", "api"),
        ("containers", "metrics"),
        ("initContainers", "migrate"),
    ] {
        let container = by_name(&pod["spec"][list], name);
        let mount = by_name(&container["volumeMounts"], "test-ca");
        assert_eq!(mount["mountPath"], "/etc/ssl/test", "{name}");
        assert_eq!(mount["readOnly"], true, "{name}");
        assert_eq!(
            by_name(&container["env"], "SSL_CERT_DIR")["value"],
            "/etc/ssl/test"
        );
    }
    let api = by_name(&pod["spec"]["containers"], "api");
    assert_eq!(
        by_name(&api["volumeMounts"], "data")["mountPath"],
        "/data",
        "existing mounts are kept"
    );

    let text = metrics(&shared).await;
    assert_eq!(
        sample(
            &text,
            r#"initium_rule_applied_total{rule="payments/test-certs"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"initium_admission_duration_seconds_count{kind="Pod",operation="CREATE",result="mutated"}"#
        ),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn an_object_without_namespace_is_matched_by_the_request_namespace() {
    // Since Kubernetes 1.22 the API server fills `metadata.namespace` before admission (the
    // recording has it); older servers and hand-made reviews may leave it out. Rules still see
    // the request's namespace, and the patch does not add it.
    let shared = shared(example_rules("test-ca"));
    let mut review = review("pod-create");
    if let Some(meta) = review["request"]["object"]["metadata"].as_object_mut() {
        meta.remove("namespace");
    }
    let pod = patched(&review, &mutate(&shared, &review).await);
    let meta = &pod["metadata"];
    assert_eq!(
        meta["annotations"]["certs.example.com/namespace"],
        "payments"
    );
    assert_eq!(
        meta["annotations"]["initium.dev/mutated-by"],
        "payments/test-certs"
    );
    assert!(meta.get("namespace").is_none(), "{meta:#}");
}

#[tokio::test]
async fn deployment_create_gets_defaults_and_carries_the_sidecar_opt_in_to_its_pods() {
    let mut rules = example_rules("sidecar");
    rules.extend(example_rules("default-labels"));
    let shared = shared(rules);
    let review = review("deployment-create");
    let deployment = patched(&review, &mutate(&shared, &review).await);

    assert_eq!(
        deployment["spec"]["template"]["metadata"]["annotations"]["sidecar.initium.dev/inject"],
        "envoy"
    );
    let meta = &deployment["metadata"];
    assert_eq!(meta["labels"]["team"], "shop");
    assert_eq!(
        meta["annotations"]["example.com/owner"],
        "team-shop@example.com"
    );
    assert_eq!(
        meta["annotations"]["initium.dev/mutated-by"],
        "default-team-label,provenance-annotations,envoy-sidecar-deployments",
        "rules in priority order"
    );
    // The Pod-only sidecar rule does not touch a Deployment.
    let containers = &deployment["spec"]["template"]["spec"]["containers"];
    assert_eq!(containers.as_array().map(Vec::len), Some(1));
}

#[tokio::test]
async fn pod_update_is_mirrored_and_provenance_is_appended() {
    let mut rules = example_rules("registry-mirror");
    rules.extend(example_rules("default-labels"));
    let shared = shared(rules);
    let mut review = review("pod-update");
    let pod = patched(&review, &mutate(&shared, &review).await);
    assert_eq!(
        pod["spec"]["containers"][0]["image"],
        "mirror.local/library/nginx:1.27"
    );
    assert_eq!(
        pod["metadata"]["annotations"]["initium.dev/mutated-by"], "docker-hub-mirror",
        "the Pod has a team label already, so only the mirror applies"
    );

    // A Pod initialized at CREATE keeps the rules listed then.
    review["request"]["object"]["metadata"]["annotations"] =
        json!({"initium.dev/mutated-by": "default-team-label"});
    let pod = patched(&review, &mutate(&shared, &review).await);
    assert_eq!(
        pod["metadata"]["annotations"]["initium.dev/mutated-by"],
        "default-team-label,docker-hub-mirror"
    );

    let text = metrics(&shared).await;
    assert_eq!(
        sample(
            &text,
            r#"initium_admission_duration_seconds_count{kind="Pod",operation="UPDATE",result="mutated"}"#
        ),
        Some(2.0),
        "{text}"
    );
}

#[tokio::test]
async fn status_updates_and_deletes_pass_untouched() {
    // The mirror rule matches UPDATEs of Pods with Docker Hub images, like this one.
    let shared = shared(example_rules("registry-mirror"));
    assert_unchanged(&mutate(&shared, &review("pod-status-update")).await);
    assert_unchanged(&mutate(&shared, &review("pod-delete")).await);
    let text = metrics(&shared).await;
    assert_eq!(
        sample(
            &text,
            r#"initium_rule_applied_total{rule="docker-hub-mirror"}"#
        ),
        None
    );
    for operation in ["UPDATE", "DELETE"] {
        let series = format!(
            r#"initium_admission_duration_seconds_count{{kind="Pod",operation="{operation}",result="unchanged"}}"#
        );
        assert_eq!(sample(&text, &series), Some(1.0), "{text}");
    }
}

#[tokio::test]
async fn no_patch_when_no_rule_matches() {
    // The payments MutationRule does not reach a Pod in another namespace; the sidecar rules
    // want an annotation this Pod does not have.
    let mut rules = example_rules("test-ca");
    rules.extend(example_rules("sidecar"));
    let shared = shared(rules);
    let mut review = review("pod-create");
    review["request"]["namespace"] = json!("shop");
    let response = mutate(&shared, &review).await;
    assert_unchanged(&response);
    assert!(response.get("warnings").is_none(), "{response:#}");
    assert!(response.get("status").is_none(), "{response:#}");
}

#[tokio::test]
async fn dry_run_gets_the_same_patch_as_a_real_create() {
    let shared = shared(example_rules("test-ca"));
    let dry = review("pod-create-dry-run");
    assert_eq!(dry["request"]["dryRun"], true);
    let mut real = dry.clone();
    real["request"]["dryRun"] = json!(false);
    let dry_response = mutate(&shared, &dry).await;
    let real_response = mutate(&shared, &real).await;
    assert_eq!(dry_response["patch"], real_response["patch"]);
    let pod = patched(&dry, &dry_response);
    assert_eq!(
        by_name(&pod["spec"]["containers"][0]["volumeMounts"], "test-ca")["mountPath"],
        "/etc/ssl/test"
    );
}

#[tokio::test]
async fn large_reviews_run_on_the_blocking_pool_with_the_same_answer() {
    let inline = shared(example_rules("test-ca"));
    let blocking = shared_with(
        example_rules("test-ca"),
        AdmissionConfig {
            inline_body_limit: 0,
            ..AdmissionConfig::default()
        },
    );
    let review = review("pod-create");
    assert_eq!(
        mutate(&inline, &review).await,
        mutate(&blocking, &review).await
    );
}

#[tokio::test]
async fn an_ignore_rule_that_fails_is_skipped_with_a_warning() {
    let mut rules = example_rules("test-ca");
    rules.push(failing_rule("strip-debug", "Ignore"));
    let shared = shared(rules);
    let review = review("pod-create");
    let response = mutate(&shared, &review).await;
    let warnings = warnings(&response);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with("ClusterMutationRule strip-debug skipped: spec.mutations[0]"),
        "{warnings:?}"
    );
    // The other rule still applies, and provenance lists only what changed the object.
    let pod = patched(&review, &response);
    assert_eq!(
        pod["metadata"]["annotations"]["initium.dev/mutated-by"],
        "payments/test-certs"
    );

    let text = metrics(&shared).await;
    assert_eq!(
        sample(&text, r#"initium_rule_errors_total{rule="strip-debug"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "initium_budget_overruns_total"),
        Some(0.0),
        "{text}"
    );
}

#[tokio::test]
async fn many_failing_rules_give_warnings_the_api_server_keeps_whole() {
    let long = "x".repeat(200);
    let rules = (0..40)
        .map(|i| failing_rule(&format!("rule-{i:02}-{long}"), "Ignore"))
        .collect();
    let shared = shared(rules);
    let response = mutate(&shared, &review("pod-create")).await;
    let warnings = warnings(&response);
    let total: usize = warnings.iter().map(|w| w.chars().count()).sum();
    assert!(total <= 4096, "{total}");
    assert!(
        warnings.iter().all(
            |w| w.chars().count() <= initium::admission::WARNING_MAX_CHARS && !w.contains('\n')
        )
    );
    assert!(
        warnings[0].starts_with("ClusterMutationRule rule-00-"),
        "{warnings:?}"
    );
    let last = warnings.last().map(String::as_str).unwrap_or_default();
    assert!(last.contains("more warning(s) left out"), "{last}");
}

#[tokio::test]
async fn a_fail_rule_that_fails_denies_the_object() {
    let mut rules = example_rules("test-ca");
    rules.push(failing_rule("must-strip", "Fail"));
    let shared = shared(rules);
    let response = mutate(&shared, &review("pod-create")).await;
    assert_eq!(response["allowed"], false, "{response:#}");
    assert!(response.get("patch").is_none());
    let status = &response["status"];
    assert_eq!(status["code"], 403);
    assert_eq!(status["reason"], "Forbidden");
    let message = status["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with(
            "ClusterMutationRule must-strip (failurePolicy Fail) failed: spec.mutations[0]"
        ),
        "{message}"
    );
    let text = metrics(&shared).await;
    assert_eq!(
        sample(&text, r#"initium_rule_errors_total{rule="must-strip"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"initium_admission_duration_seconds_count{kind="Pod",operation="CREATE",result="denied"}"#
        ),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn an_exhausted_budget_skips_ignore_rules_and_denies_for_fail_rules() {
    let no_time = AdmissionConfig {
        budget: Duration::ZERO,
        ..AdmissionConfig::default()
    };
    let review = review("pod-create");

    let ignore = shared_with(example_rules("test-ca"), no_time.clone());
    let response = mutate(&ignore, &review).await;
    assert_unchanged(&response);
    let warnings = warnings(&response);
    assert_eq!(
        warnings,
        [
            "MutationRule payments/test-certs skipped: the latency budget ran out before it could run"
        ]
    );
    let text = metrics(&ignore).await;
    assert_eq!(
        sample(&text, "initium_budget_overruns_total"),
        Some(1.0),
        "{text}"
    );

    let mut strict = example_rules("test-ca");
    strict[0]["spec"]["failurePolicy"] = json!("Fail");
    let fail = shared_with(strict, no_time);
    let response = mutate(&fail, &review).await;
    assert_eq!(response["allowed"], false, "{response:#}");
    assert_eq!(response["status"]["code"], 403);
    let message = response["status"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("latency budget ran out"), "{message}");
    let text = metrics(&fail).await;
    assert_eq!(
        sample(&text, "initium_budget_overruns_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"initium_rule_errors_total{rule="payments/test-certs"}"#
        ),
        Some(1.0),
        "{text}"
    );
}

#[tokio::test]
async fn namespace_selector_reads_the_namespace_labels() {
    let shared = shared(example_rules("podpreset"));
    let mut review = review("pod-create");
    review["request"]["object"]["metadata"]["labels"] = json!({"role": "frontend"});

    // Labels unknown (or not env=prod): no match.
    assert_unchanged(&mutate(&shared, &review).await);

    let mut namespaces = NamespaceLabels::new();
    namespaces.insert(
        "payments".into(),
        Arc::new(BTreeMap::from([("env".to_string(), "prod".to_string())])),
    );
    namespaces.insert("shop".into(), Arc::new(BTreeMap::new()));
    shared.namespaces.store(Arc::new(namespaces));
    let pod = patched(&review, &mutate(&shared, &review).await);
    assert_eq!(
        by_name(&pod["spec"]["volumes"], "db-credentials")["secret"]["secretName"],
        "db-credentials"
    );
    let api = by_name(&pod["spec"]["containers"], "api");
    assert_eq!(by_name(&api["env"], "DB_HOST")["value"], "db.payments.svc");

    review["request"]["namespace"] = json!("shop");
    assert_unchanged(&mutate(&shared, &review).await);
}

// ---------------------------------------------------------------------------------------------
// /validate

#[tokio::test]
async fn a_valid_rule_is_allowed_with_or_without_dry_run() {
    let shared = shared(vec![]);
    let mut review = review("mutationrule-create-valid");
    let response = validate(&shared, &review).await;
    assert_eq!(response["allowed"], true, "{response:#}");
    assert!(response.get("status").is_none());
    review["request"]["dryRun"] = json!(true);
    assert_eq!(validate(&shared, &review).await["allowed"], true);
}

#[tokio::test]
async fn an_invalid_rule_is_denied_with_every_field_path() {
    let shared = shared(vec![]);
    let review = review("mutationrule-create-invalid");
    let response = validate(&shared, &review).await;
    assert_eq!(response["allowed"], false, "{response:#}");
    let status = &response["status"];
    assert_eq!(status["code"], 422);
    assert_eq!(status["reason"], "Invalid");
    let message = status["message"].as_str().unwrap_or_default();
    let lines: Vec<&str> = message.lines().collect();
    assert_eq!(
        lines,
        [
            r#"MutationRule payments/broken-certs: spec.match.kinds[1]: invalid kind "pods": "pods" is not a Kind name (like Pod or Deployment) or *"#,
            r#"MutationRule payments/broken-certs: spec.conditions[0].matches: invalid regular expression "^(nginx": unclosed group"#,
            r#"MutationRule payments/broken-certs: spec.mutations[1].upsert.path: invalid JSON pointer "spec/volumes": it must be empty or start with '/'"#,
        ]
    );
    // kubectl prints `The MutationRule "broken-certs" is invalid:` and `* <field>: <message>`
    // for each cause.
    let details = &status["details"];
    assert_eq!(details["name"], "broken-certs");
    assert_eq!(details["kind"], "MutationRule");
    assert_eq!(details["group"], "initium.dev");
    let fields: Vec<&str> = details["causes"]
        .as_array()
        .map(|c| c.iter().filter_map(|c| c["field"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        fields,
        [
            "spec.match.kinds[1]",
            "spec.conditions[0].matches",
            "spec.mutations[1].upsert.path"
        ]
    );

    // Server-side dry run gets the same answer.
    let mut dry = review.clone();
    dry["request"]["dryRun"] = json!(true);
    assert_eq!(validate(&shared, &dry).await, response);

    // The namespace comes from the request when the object does not carry one.
    let mut no_namespace = review.clone();
    if let Some(meta) = no_namespace["request"]["object"]["metadata"].as_object_mut() {
        meta.remove("namespace");
    }
    assert_eq!(validate(&shared, &no_namespace).await, response);
}

#[tokio::test]
async fn an_invalid_cluster_rule_is_denied_as_a_cluster_rule() {
    let shared = shared(vec![]);
    let mut review = review("mutationrule-create-invalid");
    review["request"]["kind"]["kind"] = json!("ClusterMutationRule");
    review["request"]["resource"]["resource"] = json!("clustermutationrules");
    if let Some(request) = review["request"].as_object_mut() {
        request.remove("namespace");
    }
    let object = &mut review["request"]["object"];
    object["kind"] = json!("ClusterMutationRule");
    if let Some(meta) = object["metadata"].as_object_mut() {
        meta.remove("namespace");
    }
    let response = validate(&shared, &review).await;
    assert_eq!(response["allowed"], false, "{response:#}");
    assert_eq!(response["status"]["details"]["kind"], "ClusterMutationRule");
    let message = response["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("ClusterMutationRule broken-certs: spec.match.kinds[1]: "),
        "{message}"
    );
}

#[tokio::test]
async fn rule_deletes_metadata_updates_and_other_kinds_are_allowed() {
    let shared = shared(vec![]);
    let invalid = review("mutationrule-create-invalid");
    let mut delete = invalid.clone();
    delete["request"]["operation"] = json!("DELETE");
    delete["request"]["oldObject"] = delete["request"]["object"].take();
    assert_eq!(validate(&shared, &delete).await["allowed"], true);

    // A rule stored before it could be checked still takes metadata changes (labels,
    // finalizers) and can be deleted; a change to its spec is checked.
    let mut relabel = invalid.clone();
    relabel["request"]["operation"] = json!("UPDATE");
    relabel["request"]["oldObject"] = relabel["request"]["object"].clone();
    relabel["request"]["object"]["metadata"]["labels"] = json!({"team": "payments"});
    assert_eq!(validate(&shared, &relabel).await["allowed"], true);
    let mut changed = relabel.clone();
    changed["request"]["object"]["spec"]["priority"] = json!(5);
    assert_eq!(validate(&shared, &changed).await["allowed"], false);
    changed["request"]["object"]["metadata"]["deletionTimestamp"] = json!("2026-11-23T12:50:00Z");
    assert_eq!(validate(&shared, &changed).await["allowed"], true);

    // A webhook configuration that sends other kinds here must not block them.
    assert_eq!(
        validate(&shared, &review("pod-create")).await["allowed"],
        true
    );
}

// ---------------------------------------------------------------------------------------------
// Bad requests

#[tokio::test]
async fn bodies_that_are_not_admission_reviews_get_400_with_one_line() {
    let shared = shared(example_rules("test-ca"));
    let mut without_uid = review("pod-create");
    if let Some(request) = without_uid["request"].as_object_mut() {
        request.remove("uid");
    }
    let mut v1beta1 = review("pod-create");
    v1beta1["apiVersion"] = json!("admission.k8s.io/v1beta1");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"{\"apiVersion\": \"admission.k8s.io/v1\", \"kind\": ".to_vec(), "EOF"),
        (b"not json".to_vec(), "expected"),
        (br#"{"apiVersion":"v1","kind":"Pod"}"#.to_vec(), "found kind \"Pod\""),
        (
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(),
            "no request",
        ),
        (serde_json::to_vec(&without_uid).unwrap_or_default(), "missing field `uid`"),
        (serde_json::to_vec(&v1beta1).unwrap_or_default(), "v1beta1"),
        (
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","kind":{"kind":"Pod"},"operation":"CREATE","namespace":7}}"#.to_vec(),
            "request.namespace",
        ),
    ];
    for path in ["/mutate", "/validate"] {
        for (body, expect) in &cases {
            let (status, text) = send(
                initium::admission::router(shared.clone()),
                "POST",
                path,
                body.clone(),
            )
            .await;
            let text = String::from_utf8_lossy(&text);
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {text}");
            assert!(
                text.contains(expect),
                "{path}: {text:?} should mention {expect:?}"
            );
            assert!(
                !text.trim_end().contains('\n'),
                "{path}: one line: {text:?}"
            );
        }
    }
    let text = metrics(&shared).await;
    assert_eq!(
        sample(
            &text,
            r#"initium_admission_duration_seconds_count{kind="unknown",operation="unknown",result="error"}"#
        ),
        Some((cases.len() * 2) as f64),
        "{text}"
    );
}

#[tokio::test]
async fn bodies_over_8_mib_get_413() {
    let shared = shared(vec![]);
    let mut body =
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","padding":""#.to_vec();
    body.resize(initium::admission::MAX_BODY_BYTES + 1, b'x');
    for path in ["/mutate", "/validate"] {
        let (status, text) = send(
            initium::admission::router(shared.clone()),
            "POST",
            path,
            body.clone(),
        )
        .await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        assert!(
            String::from_utf8_lossy(&text).contains("larger than"),
            "{path}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Excluded namespaces and bounded metric labels (issue 15)

/// A rule that labels every object of every kind, in every namespace.
fn everything_rule() -> Value {
    cluster_rule(
        "everything",
        json!({"match": {"kinds": ["*"]},
               "mutations": [{"merge": {"metadata": {"labels": {"touched": "yes"}}}}]}),
    )
}

fn namespace_review(name: &str) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "5b0a5f7e-namespace", "operation": "CREATE", "name": name,
            "kind": {"group": "", "version": "v1", "kind": "Namespace"},
            "resource": {"group": "", "version": "v1", "resource": "namespaces"},
            "object": {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        }
    })
}

#[tokio::test]
async fn reviews_claiming_an_excluded_namespace_are_allowed_unchanged() {
    let config = AdmissionConfig {
        excluded_namespaces: vec!["initium-system".into(), "kube-system".into()],
        ..AdmissionConfig::default()
    };
    let shared = shared_with(vec![everything_rule()], config);

    // The control: a Pod elsewhere is mutated.
    let review_in = |namespace: &str, object_namespace: &str| {
        let mut review = review("pod-create");
        review["request"]["namespace"] = json!(namespace);
        review["request"]["object"]["metadata"]["namespace"] = json!(object_namespace);
        review
    };
    let control = review_in("payments", "payments");
    let pod = patched(&control, &mutate(&shared, &control).await);
    assert_eq!(pod["metadata"]["labels"]["touched"], "yes");

    for (namespace, object_namespace) in [
        ("kube-system", "kube-system"),
        ("initium-system", "initium-system"),
        // The review and the object disagree: either one in an excluded namespace is enough.
        ("payments", "kube-system"),
        ("kube-system", "payments"),
    ] {
        let review = review_in(namespace, object_namespace);
        let response = mutate(&shared, &review).await;
        assert_unchanged(&response);
        assert!(
            response.get("warnings").is_none(),
            "{namespace}/{object_namespace}: {response:#}"
        );
    }
    for name in ["kube-system", "initium-system"] {
        assert_unchanged(&mutate(&shared, &namespace_review(name)).await);
    }
    let other = namespace_review("team-a");
    let namespace = patched(&other, &mutate(&shared, &other).await);
    assert_eq!(namespace["metadata"]["labels"]["touched"], "yes");
}

/// A CREATE review of an object of the given kind (a kind no API server serves).
fn review_of_kind(kind: &str, i: usize) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": format!("uid-{i}"), "operation": "CREATE", "namespace": "payments",
            "kind": {"group": "example.com", "version": "v1", "kind": kind},
            "resource": {"group": "example.com", "version": "v1", "resource": "things"},
            "object": {"apiVersion": "example.com/v1", "kind": kind,
                       "metadata": {"name": format!("x{i}"), "namespace": "payments"}}
        }
    })
}

#[tokio::test]
async fn metric_kind_labels_are_only_kinds_that_ready_rules_name() {
    let shared = shared(example_rules("test-ca"));
    let pod = review("pod-create");
    mutate(&shared, &pod).await;
    let before = metrics(&shared).await.len();
    // What an attacker with access to the port sends: a new kind on every request.
    for i in 0..500 {
        mutate(&shared, &review_of_kind(&format!("Kind{i}"), i)).await;
        validate(&shared, &review_of_kind(&format!("Rule{i}"), i)).await;
    }
    let text = metrics(&shared).await;
    assert!(
        !text.contains("kind=\"Kind") && !text.contains("kind=\"Rule"),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"initium_admission_duration_seconds_count{kind="other",operation="CREATE",result="unchanged"}"#
        ),
        Some(1000.0),
        "{text}"
    );
    assert!(
        sample(
            &text,
            r#"initium_admission_duration_seconds_count{kind="Pod",operation="CREATE",result="mutated"}"#
        )
        .is_some(),
        "a kind a Ready rule names keeps its label: {text}"
    );
    // One series for all of them: the exposition grew by one histogram, not by 1,000.
    assert!(
        text.len() < before + 4096,
        "/metrics grew from {before} to {} bytes",
        text.len()
    );
}

#[tokio::test]
async fn rule_series_go_away_with_their_rule() {
    let shared = shared(example_rules("test-ca"));
    mutate(&shared, &review("pod-create")).await;
    let text = metrics(&shared).await;
    assert_eq!(
        sample(
            &text,
            r#"initium_rule_applied_total{rule="payments/test-certs"}"#
        ),
        Some(1.0),
        "{text}"
    );
    // The rule is deleted: the watch swaps in an index without it.
    let replacement = cluster_rule(
        "still-here",
        json!({"match": {"kinds": ["Pod"]},
               "mutations": [{"merge": {"metadata": {"labels": {"kept": "yes"}}}}]}),
    );
    let compiled = compile_document(&replacement, "default").unwrap_or_else(|e| panic!("{e}"));
    shared.rules.store(Arc::new(RuleIndex::new(vec![compiled])));
    let text = metrics(&shared).await;
    assert!(!text.contains("payments/test-certs"), "{text}");
    mutate(&shared, &review("pod-create")).await;
    let text = metrics(&shared).await;
    assert!(!text.contains("payments/test-certs"), "{text}");
    assert_eq!(
        sample(&text, r#"initium_rule_applied_total{rule="still-here"}"#),
        Some(1.0),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------------
// Operations port

#[tokio::test]
async fn readyz_waits_for_the_first_sync_and_healthz_does_not() {
    let shared = shared(vec![]);
    let ops = || initium::ops::router(shared.clone());
    let (status, body) = send(ops(), "GET", "/healthz", vec![]).await;
    assert_eq!((status, body.as_slice()), (StatusCode::OK, &b"ok"[..]));
    let (status, body) = send(ops(), "GET", "/readyz", vec![]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(String::from_utf8_lossy(&body).contains("not ready"));
    shared.set_webhook_serving(true);
    shared.mark_synced();
    let (status, body) = send(ops(), "GET", "/readyz", vec![]).await;
    assert_eq!((status, body.as_slice()), (StatusCode::OK, &b"ok"[..]));
}

#[tokio::test]
async fn readyz_is_not_ready_while_the_webhook_server_is_not_serving() {
    let shared = shared(vec![]);
    let ops = || initium::ops::router(shared.clone());
    shared.mark_synced();
    let (status, body) = send(ops(), "GET", "/readyz", vec![]).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "synced, but no webhook server"
    );
    assert!(
        String::from_utf8_lossy(&body)
            .contains("webhook server has not started, or is shutting down"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    shared.set_webhook_serving(true);
    assert_eq!(
        send(ops(), "GET", "/readyz", vec![]).await.0,
        StatusCode::OK
    );
    // Shutdown has begun, or the server stopped.
    shared.set_webhook_serving(false);
    assert_eq!(
        send(ops(), "GET", "/readyz", vec![]).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn metrics_are_openmetrics_text() {
    let shared = shared(vec![]);
    let response = initium::ops::router(shared.clone())
        .oneshot(
            Request::get("/metrics")
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    let text = metrics(&shared).await;
    assert_eq!(
        sample(&text, "initium_budget_overruns_total"),
        Some(0.0),
        "{text}"
    );
    assert!(text.trim_end().ends_with("# EOF"), "{text}");

    // Histograms appear with the first request.
    mutate(&shared, &review("pod-create")).await;
    let text = metrics(&shared).await;
    assert!(
        text.contains("# TYPE initium_admission_duration_seconds histogram"),
        "{text}"
    );
    // A bucket at 250 µs: the share of requests answered within it reads straight off it.
    // (No rule names Pod, so its kind label is `other`.) The one request is counted once, in
    // the `+Inf` bucket and the count; whether it also falls within 250 µs is the machine's
    // speed, so that bucket holds 0 or 1 of it, never more than the buckets above it.
    let series = |suffix: &str, le: Option<&str>| {
        let le = le.map(|le| format!(r#"le="{le}","#)).unwrap_or_default();
        let series = format!(
            r#"initium_admission_duration_seconds_{suffix}{{{le}kind="other",operation="CREATE",result="unchanged"}}"#
        );
        sample(&text, &series).unwrap_or_else(|| panic!("no {series} in {text}"))
    };
    assert_eq!(series("count", None), 1.0, "{text}");
    assert_eq!(series("bucket", Some("+Inf")), 1.0, "{text}");
    let within = series("bucket", Some("0.00025"));
    assert!(within == 0.0 || within == 1.0, "{text}");
    assert!(within <= series("bucket", Some("0.0005")), "{text}");
}

#[tokio::test]
async fn every_answer_carries_its_server_time() {
    let shared = shared(example_rules("test-ca"));
    let cases = [
        (
            "/mutate",
            serde_json::to_vec(&review("pod-create")).expect("json"),
        ),
        ("/mutate", b"not a review".to_vec()),
        (
            "/validate",
            serde_json::to_vec(&review("mutationrule-create-valid")).expect("json"),
        ),
    ];
    for (path, body) in cases {
        let request = Request::builder()
            .method("POST")
            .uri(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .expect("request");
        let started = std::time::Instant::now();
        let response = initium::admission::router(shared.clone())
            .oneshot(request)
            .await
            .expect("infallible");
        let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
        let timing = response
            .headers()
            .get("server-timing")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("{path}: no Server-Timing header"))
            .to_string();
        let ms: f64 = timing
            .strip_prefix("admission;dur=")
            .and_then(|ms| ms.parse().ok())
            .unwrap_or_else(|| panic!("{path}: Server-Timing is {timing:?}"));
        assert!(
            ms >= 0.0 && ms <= elapsed_ms,
            "{path}: server time {ms} ms, the whole call took {elapsed_ms} ms"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The real HTTPS server

mod https {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    use axum_server::Handle;
    use rustls::pki_types::CertificateDer;
    use serde_json::Value;

    use crate::support::https::{Tls, handshake, self_signed};

    use super::{example_rules, review, shared};

    fn connect(addr: SocketAddr, ca: &CertificateDer<'static>, alpn: &[&[u8]]) -> Tls {
        handshake(addr, ca, alpn, Duration::from_secs(10)).expect("TLS handshake")
    }

    fn head(body_len: usize) -> String {
        format!(
            "POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {body_len}\r\nConnection: close\r\n\r\n"
        )
    }

    /// Reads the response to EOF; returns the status line and the JSON body.
    fn read_response(tls: &mut Tls) -> (String, Value) {
        let mut raw = Vec::new();
        match tls.read_to_end(&mut raw) {
            Ok(_) => {}
            // A peer that closes without close_notify still sent everything we need.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
            Err(e) => panic!("reading the response: {e}"),
        }
        let text = String::from_utf8(raw).expect("UTF-8 response");
        let (head, body) = text.split_once("\r\n\r\n").expect("HTTP response");
        let status = head.lines().next().unwrap_or_default().to_string();
        (status, serde_json::from_str(body).expect("JSON body"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serves_https_and_finishes_requests_in_flight_on_graceful_shutdown() {
        let (tls, ca) = self_signed().await;

        let handle: Handle<SocketAddr> = Handle::new();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let server = tokio::spawn(initium::admission::serve(
            listener,
            tls,
            shared(example_rules("test-ca")),
            handle.clone(),
        ));
        let addr = handle.listening().await.expect("the server listens");
        let body = serde_json::to_vec(&review("pod-create")).expect("json");

        // HTTP/2 is offered through ALPN; TLS is 1.2 or newer.
        let ca2 = ca.clone();
        let (alpn, version) = tokio::task::spawn_blocking(move || {
            let tls = connect(addr, &ca2, &[b"h2", b"http/1.1"]);
            (
                tls.conn.alpn_protocol().map(<[u8]>::to_vec),
                tls.conn.protocol_version(),
            )
        })
        .await
        .expect("client");
        assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
        assert!(matches!(
            version,
            Some(rustls::ProtocolVersion::TLSv1_3 | rustls::ProtocolVersion::TLSv1_2)
        ));

        // A whole HTTP/1.1 request.
        let (ca2, body2) = (ca.clone(), body.clone());
        let (status, answer) = tokio::task::spawn_blocking(move || {
            let mut tls = connect(addr, &ca2, &[b"http/1.1"]);
            tls.write_all(head(body2.len()).as_bytes()).expect("write");
            tls.write_all(&body2).expect("write");
            read_response(&mut tls)
        })
        .await
        .expect("client");
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        assert_eq!(
            answer["response"]["uid"],
            "466e8dc9-5f7d-4fd8-8f5d-cca7895dd460"
        );
        assert_eq!(answer["response"]["patchType"], "JSONPatch");

        // A request in flight (headers and half the body sent) when shutdown begins finishes.
        let (ca2, body2) = (ca.clone(), body.clone());
        let half = body.len() / 2;
        let mut tls = tokio::task::spawn_blocking(move || {
            let mut tls = connect(addr, &ca2, &[b"http/1.1"]);
            tls.write_all(head(body2.len()).as_bytes()).expect("write");
            tls.write_all(&body2[..half]).expect("write");
            tls.flush().expect("flush");
            tls
        })
        .await
        .expect("client");
        tokio::time::sleep(Duration::from_millis(100)).await;
        handle.graceful_shutdown(Some(Duration::from_secs(10)));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, answer) = tokio::task::spawn_blocking(move || {
            tls.write_all(&body[half..]).expect("write the rest");
            read_response(&mut tls)
        })
        .await
        .expect("client");
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        assert_eq!(answer["response"]["allowed"], true);

        let ended = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the server stops after its last request");
        ended.expect("server task").expect("serve returns Ok");
        assert!(
            TcpStream::connect(addr).is_err(),
            "no longer accepting connections"
        );
    }
}

#[tokio::test]
async fn the_rule_limits_of_serve_reach_the_engine() {
    // A rule that writes 2 KB: within the default 1 MiB, over a 1 KiB --max-rule-output.
    let writer = cluster_rule(
        "big-annotation",
        json!({"match": {"kinds": ["Pod"]},
               "mutations": [{"merge": {"metadata": {"annotations": {"big": "x".repeat(2000)}}}}]}),
    );
    let review = review("pod-create");
    let shared = shared(vec![writer.clone()]);
    assert!(warnings(&mutate(&shared, &review).await).is_empty());
    let shared = shared_with(
        vec![writer],
        AdmissionConfig {
            rule_limits: initium::engine::Limits {
                rule_output_bytes: 1024,
                ..Default::default()
            },
            ..AdmissionConfig::default()
        },
    );
    let response = mutate(&shared, &review).await;
    assert_unchanged(&response);
    assert_eq!(
        warnings(&response),
        [
            "ClusterMutationRule big-annotation skipped: spec.mutations[0]: the rule would write more than 1 KiB into the object (the per-rule output limit, --max-rule-output)"
        ]
    );
}

/// The API server can send one object to initium more than once in a request (a call per
/// webhook whose rules cover it, a reinvocation after another webhook changed it): each call
/// sees the last one's output, and a rule that already changed the object does not run again,
/// so an `add` to `/spec/tolerations/-` adds one toleration, not two. An UPDATE runs the rules
/// the stored object lists again.
#[tokio::test]
async fn a_second_call_in_the_same_request_does_not_run_a_rule_again() {
    let shared = shared(vec![cluster_rule(
        "tolerate",
        json!({"match": {"kinds": ["Pod"], "operations": ["CREATE", "UPDATE"]}, "mutations": [{"patch": [
            {"op": "add", "path": "/spec/tolerations/-", "value": {"key": "dedicated", "operator": "Exists"}}
        ]}]}),
    )]);
    let mut review = review("pod-create");
    let first = patched(&review, &mutate(&shared, &review).await);
    let count = |pod: &Value| pod["spec"]["tolerations"].as_array().map_or(0, Vec::len);
    let before = count(&review["request"]["object"]);
    assert_eq!(count(&first), before + 1);
    review["request"]["object"] = first.clone();
    assert_unchanged(&mutate(&shared, &review).await);

    // The same Pod updated later: the stored object lists the rule, so it runs again.
    let mut update = review.clone();
    update["request"]["operation"] = json!("UPDATE");
    update["request"]["oldObject"] = first.clone();
    let again = patched(&update, &mutate(&shared, &update).await);
    assert_eq!(count(&again), before + 2);
}
