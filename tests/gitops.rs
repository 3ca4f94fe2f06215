//! What Flux and Argo CD make of a rule's health, read with their own code (kstatus, and Argo
//! CD's Lua runtime running deploy/gitops/argocd-health.lua; `scripts/ops-check health`) from
//! the status a real `initium serve` writes on a real API server:
//!
//! | the rule                                  | kstatus (Flux) | Argo CD     |
//! |-------------------------------------------|----------------|-------------|
//! | created while no initium runs (no status) | Current        | Progressing |
//! | valid, status written                     | Current        | Healthy     |
//! | invalid (does not compile)                | Failed         | Degraded    |
//! | spec changed, not read yet                | InProgress     | Progressing |
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use serde_json::Value;
use support::commands::ops_check;
use support::plane::{Plane, root, run};
use support::serving::Serving;
use support::{eventually_blocking, install_crds, serial_blocking, unique};

const LUA: &str = "deploy/gitops/argocd-health.lua";

/// (kstatus status, kstatus message, Argo CD status, Argo CD message) of a rule as it is stored now.
fn health(plane: &Plane, ns: &str, name: &str) -> (String, String, String, String) {
    let object = run(plane
        .kubectl()
        .args(["get", "mutationrule", name, "-n", ns, "-o", "json"]))
    .unwrap_or_else(|e| panic!("{e:#}"));
    let report = ops_check_health(&object);
    let field = |tool: &str, key: &str| report[tool][key].as_str().unwrap_or_default().to_owned();
    (
        field("kstatus", "status"),
        field("kstatus", "message"),
        field("argocd", "status"),
        field("argocd", "message"),
    )
}

/// `scripts/ops-check health` of `object` (JSON): what kstatus and Argo CD make of it.
fn ops_check_health(object: &str) -> Value {
    let lua = root().join(LUA);
    ops_check(&["health", lua.to_str().expect("a UTF-8 path")], object)
}

/// Waits until both tools read `name` as `kstatus` and `argo`; returns the messages.
fn wait_health(plane: &Plane, ns: &str, name: &str, kstatus: &str, argo: &str) -> (String, String) {
    eventually_blocking(
        &format!("{ns}/{name} to read {kstatus} (kstatus) and {argo} (Argo CD)"),
        Duration::from_secs(60),
        || {
            let (k, k_message, a, a_message) = health(plane, ns, name);
            if k == kstatus && a == argo {
                Ok((k_message, a_message))
            } else {
                Err(format!(
                    "kstatus {k} ({k_message}), Argo CD {a} ({a_message})"
                ))
            }
        },
    )
}

fn rule(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "apiVersion: initium.dev/v1alpha1\nkind: MutationRule\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n"
    )
}

#[test]
fn a_rules_health_reads_correctly_in_flux_and_argo_cd() {
    let _serial = serial_blocking();
    install_crds();
    let plane = Plane::shared();
    let ns = unique("gitops");
    plane.ensure_namespace(&ns, &[]).unwrap();

    // Valid for the schema, not for the engine: the regex does not compile. Created before
    // initium runs, so that the validating webhook does not refuse it (as after an upgrade
    // that made a rule invalid, or with the webhook's failure policy Ignore).
    plane
        .apply(&rule(
            &ns,
            "bad-regex",
            r#"{match: {kinds: [Pod]}, conditions: [{path: "$.metadata.name", matches: "web-(["}], mutations: [{merge: {metadata: {labels: {a: b}}}}]}"#,
        ))
        .unwrap();
    // No status yet: kstatus has nothing to go by and says Current; the Argo CD check waits.
    let (_, argo) = wait_health(plane, &ns, "bad-regex", "Current", "Progressing");
    assert_eq!(argo, "Waiting for initium to read the rule");

    let mut serving = Serving::start_on(plane, &[]);
    let good = r#"{match: {kinds: [Pod]}, mutations: [{merge: {metadata: {labels: {a: b}}}}]}"#;
    plane.apply(&rule(&ns, "good", good)).unwrap();

    let (kstatus, argo) = wait_health(plane, &ns, "good", "Current", "Healthy");
    assert_eq!(kstatus, "Resource is Ready");
    assert_eq!(
        argo,
        "Compiled: the rule is compiled and applied to matching objects"
    );

    let (kstatus, argo) = wait_health(plane, &ns, "bad-regex", "Failed", "Degraded");
    assert!(
        kstatus.starts_with("spec.conditions[0].matches: "),
        "{kstatus}"
    );
    assert_eq!(argo, format!("InvalidRule: {kstatus}"));

    // A new generation initium has not read: initium down (its validating webhook removed, or
    // the change would be refused), the spec changed.
    serving.kill();
    run(plane
        .kubectl()
        .args(["delete", "validatingwebhookconfiguration", &serving.name]))
    .unwrap();
    plane
        .apply(&rule(&ns, "good", &good.replace("{a: b}", "{a: c}")))
        .unwrap();
    let (kstatus, argo) = wait_health(plane, &ns, "good", "InProgress", "Progressing");
    assert_eq!(
        kstatus,
        "MutationRule generation is 2, but latest observed generation is 1"
    );
    assert_eq!(argo, "Waiting for initium to read generation 2");

    // initium back: the new generation is Ready.
    serving.restart();
    wait_health(plane, &ns, "good", "Current", "Healthy");
    drop(serving);
    let _ = run(plane
        .kubectl()
        .args(["delete", "namespace", &ns, "--wait=false"]));
}

#[test]
fn the_argocd_cm_snippet_carries_the_health_script_for_both_kinds() {
    let lua = std::fs::read_to_string(root().join(LUA)).unwrap();
    let text = std::fs::read_to_string(root().join("deploy/gitops/argocd-cm.yaml")).unwrap();
    let cm: Value = serde_saphyr::from_str(&text).unwrap();
    assert_eq!(
        (cm["kind"].as_str(), cm["metadata"]["name"].as_str()),
        (Some("ConfigMap"), Some("argocd-cm"))
    );
    let keys: Vec<&String> = cm["data"].as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        [
            "resource.customizations.health.initium.dev_ClusterMutationRule",
            "resource.customizations.health.initium.dev_MutationRule"
        ]
    );
    for key in keys {
        assert_eq!(
            cm["data"][key].as_str(),
            Some(lua.as_str()),
            "{key} is {LUA}"
        );
    }
}

/// Every status initium's writer produces (`desired_status`, for each verdict), as a ClusterMutationRule,
/// read by both tools: no cluster needed, and the verdicts the cluster test cannot easily
/// reach (a kind not served, a kind not allowed) are covered.
#[test]
fn every_status_initium_writes_reads_as_documented() {
    use initium::controller::rules::{RuleView, Verdict};
    use initium::controller::status::desired_status;
    use initium::engine::RuleId;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    let now = Time(k8s_openapi::jiff::Timestamp::now());
    for (verdict, kstatus, argo) in [
        (Verdict::Ready, "Current", "Healthy"),
        (Verdict::Invalid("spec.x: bad".into()), "Failed", "Degraded"),
        (
            Verdict::KindNotAllowed("spec.match.kinds[0]: never intercepted".into()),
            "Failed",
            "Degraded",
        ),
        (
            Verdict::KindNotServed("spec.match.kinds[0]: not served".into()),
            "InProgress",
            "Progressing",
        ),
        (
            Verdict::LookupQuota("spec.lookups: over the namespace's lookup quota".into()),
            "InProgress",
            "Progressing",
        ),
    ] {
        let view = RuleView {
            id: RuleId::cluster("r"),
            uid: None,
            generation: Some(4),
            resource_version: Some("1".into()),
            status: None,
            verdict: verdict.clone(),
            serving: None,
        };
        let status =
            desired_status(&view, &Default::default(), &now).expect("a new rule gets a status");
        let object = serde_json::json!({
            "apiVersion": "initium.dev/v1alpha1",
            "kind": "ClusterMutationRule",
            "metadata": {"name": "r", "generation": 4},
            "spec": {"match": {"kinds": ["Pod"]}},
            "status": status,
        });
        let report = ops_check_health(&object.to_string());
        assert_eq!(
            (
                report["kstatus"]["status"].as_str(),
                report["argocd"]["status"].as_str()
            ),
            (Some(kstatus), Some(argo)),
            "{verdict:?}: {report}"
        );
    }
}
