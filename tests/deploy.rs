//! `deploy/` is a working installation: the real API server accepts every object of
//! `kubectl apply -k deploy/` in a server-side dry run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use support::commands::{can_i, kubectl_ok, kubectl_try};
use support::wait::{poll, within};

#[test]
fn kustomize_base_passes_a_server_side_dry_run() {
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy");
    // A dry run does not create the Namespace, so the namespaced objects need it to exist.
    let namespace = kubectl_ok(&[
        "create",
        "namespace",
        "initium-system",
        "--dry-run=client",
        "-o",
        "yaml",
    ]);
    let mut apply = support::kubectl()
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl runs");
    use std::io::Write;
    apply
        .stdin
        .take()
        .expect("stdin")
        .write_all(namespace.as_bytes())
        .expect("write");
    assert!(apply.wait().expect("kubectl finishes").success());

    let out = kubectl_ok(&["apply", "--dry-run=server", "-k", deploy]);
    for object in [
        "customresourcedefinition.apiextensions.k8s.io/mutationrules.initium.dev",
        "customresourcedefinition.apiextensions.k8s.io/clustermutationrules.initium.dev",
        "serviceaccount/initium",
        "clusterrole.rbac.authorization.k8s.io/initium",
        "clusterrolebinding.rbac.authorization.k8s.io/initium",
        "role.rbac.authorization.k8s.io/initium",
        "rolebinding.rbac.authorization.k8s.io/initium",
        "service/initium",
        "deployment.apps/initium",
        "poddisruptionbudget.policy/initium",
        "validatingadmissionpolicy.admissionregistration.k8s.io/initium-gates",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io/initium-gates",
    ] {
        assert!(
            out.contains(object),
            "{object} missing from the dry run:\n{out}"
        );
    }
    assert!(out.contains("(server dry run)"), "{out}");
}

#[test]
fn the_service_account_may_do_what_initium_does_and_nothing_more() {
    let rbac = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rbac.yaml");
    let _ = support::kubectl()
        .args(["create", "namespace", "initium-system"])
        .output();
    kubectl_ok(&["apply", "-n", "initium-system", "-f", rbac]);
    // kubectl resolves resource names through discovery, so the CRDs must be there.
    kubectl_ok(&[
        "apply",
        "--server-side",
        "-f",
        concat!(env!("CARGO_MANIFEST_DIR"), "/crds"),
    ]);
    let sa = "--as=system:serviceaccount:initium-system:initium";
    // A fresh discovery cache for every question: kubectl's cache may predate the CRDs.
    let cache = tempfile::tempdir().expect("a temporary directory");
    let cache_dir = format!("--cache-dir={}", cache.path().display());
    let can = |args: &[&str]| {
        let _ = std::fs::remove_dir_all(cache.path());
        let mut full = vec![sa, &cache_dir];
        full.extend_from_slice(args);
        can_i(&full)
    };
    // The RBAC authorizer sees new bindings through its informers, a moment later.
    within(Duration::from_secs(10), Duration::from_millis(100), || {
        can(&["list", "clustermutationrules.initium.dev"])
    });
    for allowed in [
        &["watch", "mutationrules.initium.dev", "--all-namespaces"][..],
        &["list", "clustermutationrules.initium.dev"],
        &[
            "patch",
            "mutationrules.initium.dev",
            "--subresource=status",
            "-n",
            "team",
        ],
        &[
            "patch",
            "clustermutationrules.initium.dev",
            "--subresource=status",
        ],
        &["watch", "namespaces"],
        // The fail-rules.initium.dev/initium label.
        &["patch", "namespaces/team"],
        &["watch", "customresourcedefinitions.apiextensions.k8s.io"],
        &[
            "create",
            "mutatingwebhookconfigurations.admissionregistration.k8s.io",
        ],
        &[
            "patch",
            "mutatingwebhookconfigurations.admissionregistration.k8s.io/initium",
        ],
        &[
            "patch",
            "validatingwebhookconfigurations.admissionregistration.k8s.io/initium",
        ],
        &[
            "update",
            "leases.coordination.k8s.io",
            "-n",
            "initium-system",
        ],
        &["create", "secrets", "-n", "initium-system"],
        // Gates.
        &["watch", "pods", "--all-namespaces"],
        &["patch", "pods", "-n", "team"],
        &["get", "pods", "-n", "team"],
        &[
            "watch",
            "endpointslices.discovery.k8s.io",
            "--all-namespaces",
        ],
        &["watch", "jobs.batch", "--all-namespaces"],
        &["watch", "daemonsets.apps", "--all-namespaces"],
        &["create", "events.events.k8s.io", "-n", "team"],
        &["patch", "events.events.k8s.io", "-n", "team"],
        // Lookups.
        &["watch", "configmaps", "--all-namespaces"],
        &["list", "configmaps", "-n", "team"],
    ] {
        assert!(
            can(allowed),
            "the ServiceAccount needs: {}",
            allowed.join(" ")
        );
    }
    for denied in [
        &["create", "pods", "-n", "team"][..],
        &["get", "secrets", "-n", "kube-system"],
        &[
            "patch",
            "mutatingwebhookconfigurations.admissionregistration.k8s.io/someone-else",
        ],
        &["update", "mutationrules.initium.dev", "-n", "team"],
        &["delete", "namespaces"],
        &["create", "namespaces"],
        &["update", "namespaces/team"],
        &["delete", "pods", "-n", "team"],
        &["update", "pods", "-n", "team"],
        &["patch", "jobs.batch", "-n", "team"],
        &["patch", "daemonsets.apps", "-n", "team"],
        &["update", "configmaps", "-n", "team"],
        &["list", "secrets", "--all-namespaces"],
    ] {
        assert!(
            !can(denied),
            "least privilege: the ServiceAccount must not: {}",
            denied.join(" ")
        );
    }
}

/// What the policy's message starts with.
const GATE_DENIAL: &str = "only initium removes initium.dev/ scheduling gates";
const INITIUM_SA: &str = "system:serviceaccount:initium-system:initium";

/// The names of the Pod's scheduling gates, in order.
fn gates(namespace: &str, pod: &str) -> Vec<String> {
    let json = kubectl_ok(&["get", "pod", "-n", namespace, pod, "-o", "json"]);
    let pod: serde_json::Value = serde_json::from_str(&json).expect("a Pod as JSON");
    pod["spec"]["schedulingGates"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| g["name"].as_str().expect("a gate name").to_owned())
        .collect()
}

/// A JSON merge patch of the Pod's scheduling gates to `names` (`None`: no gates at all), as
/// `as_user` (`None`: the test's admin) — the one write initium's gate controller does.
fn set_gates(
    namespace: &str,
    pod: &str,
    names: Option<&[&str]>,
    as_user: Option<&str>,
    dry_run: bool,
) -> (bool, String, String) {
    let gates = match names {
        Some(names) => serde_json::Value::from(
            names
                .iter()
                .map(|n| serde_json::json!({"name": n}))
                .collect::<Vec<_>>(),
        ),
        None => serde_json::Value::Null,
    };
    let patch = serde_json::json!({"spec": {"schedulingGates": gates}}).to_string();
    let mut args = vec![
        "patch",
        "pod",
        "-n",
        namespace,
        pod,
        "--type=merge",
        "-p",
        &patch,
    ];
    let as_flag = as_user.map(|u| format!("--as={u}"));
    if let Some(flag) = &as_flag {
        args.extend([flag.as_str(), "--as-group=system:serviceaccounts"]);
    }
    if dry_run {
        args.push("--dry-run=server");
    }
    kubectl_try(&args, None)
}

/// deploy/gate-policy.yaml on the real API server: nobody but initium's ServiceAccount removes
/// an `initium.dev/` scheduling gate; other gates, other updates and deleting the Pod stay
/// allowed.
#[test]
fn only_initium_removes_initium_gates() {
    let policy = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/gate-policy.yaml");
    kubectl_ok(&["apply", "-f", policy]);

    // (The policy's type-checking warnings land in its status, written by the controller
    // manager, which this plane does not run; what follows exercises every expression.)

    let ns = support::unique("gate-policy");
    kubectl_ok(&["create", "namespace", &ns]);
    let pod = |name: &str, gates: &[&str]| {
        let gates: Vec<_> = gates
            .iter()
            .map(|g| serde_json::json!({"name": g}))
            .collect();
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "schedulingGates": gates,
                "containers": [{"name": "app", "image": "registry.example.com/app:1"}],
            },
        })
        .to_string()
    };
    // No scheduler and no nodes here: the Pods stay Pending with their gates.
    let (ok, _, err) = kubectl_try(
        &["create", "-f", "-"],
        Some(&pod("web", &["initium.dev/x.y", "example.com/other"])),
    );
    assert!(ok, "create the gated Pod: {err}");

    // The API server loads policies asynchronously: a dry run (which changes nothing if the
    // policy is not in force yet) until the denial is seen.
    poll(
        "the policy to be in force",
        Duration::from_secs(60),
        Duration::from_millis(250),
        || {
            let (ok, _, err) = set_gates(&ns, "web", Some(&["example.com/other"]), None, true);
            Ok(if !ok && err.contains(GATE_DENIAL) {
                Ok(())
            } else {
                Err(format!("ok={ok}, {err}"))
            })
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}"));

    // (a) The admin may not remove initium's gate: not alone, not with the other, not the
    // whole list.
    for (what, names) in [
        ("the initium gate", Some(&["example.com/other"][..])),
        ("both gates", Some(&[][..])),
        ("the whole list", None),
    ] {
        let (ok, out, err) = set_gates(&ns, "web", names, None, false);
        assert!(!ok, "removing {what} as the admin was allowed: {out}");
        assert!(
            err.contains(GATE_DENIAL)
                && err.contains("initium.dev/x.y")
                && err.contains("delete the rule"),
            "removing {what}: not the policy's denial: {err}"
        );
        assert!(
            err.contains("ValidatingAdmissionPolicy 'initium-gates'"),
            "removing {what}: the denial does not name the policy: {err}"
        );
    }
    assert_eq!(gates(&ns, "web"), ["initium.dev/x.y", "example.com/other"]);

    // (b) Other owners' gates, and other updates of a gated Pod, are none of its business.
    let (ok, _, err) = set_gates(&ns, "web", Some(&["initium.dev/x.y"]), None, false);
    assert!(ok, "removing only the foreign gate was denied: {err}");
    assert_eq!(gates(&ns, "web"), ["initium.dev/x.y"]);
    kubectl_ok(&["label", "pod", "-n", &ns, "web", "touched=1"]);

    // (c) initium's ServiceAccount may (given RBAC to patch Pods, which the gate controller's
    // role grants; here a Role in the test's namespace), and only it: another ServiceAccount
    // with the same Role may not.
    let other_sa = format!("system:serviceaccount:{ns}:other");
    kubectl_ok(&[
        "create",
        "role",
        "patch-pods",
        "-n",
        &ns,
        "--verb=get,patch",
        "--resource=pods",
    ]);
    kubectl_ok(&[
        "create",
        "rolebinding",
        "patch-pods",
        "-n",
        &ns,
        "--role=patch-pods",
        "--serviceaccount=initium-system:initium",
        &format!("--serviceaccount={ns}:other"),
    ]);
    // The RBAC authorizer sees new bindings through its informers, a moment later.
    for user in [INITIUM_SA, other_sa.as_str()] {
        let as_user = format!("--as={user}");
        assert!(
            within(Duration::from_secs(30), Duration::from_millis(100), || {
                can_i(&["patch", "pods", "-n", &ns, &as_user])
            }),
            "{user} may not patch Pods 30 s after the RoleBinding"
        );
    }
    let (ok, out, err) = set_gates(&ns, "web", None, Some(&other_sa), false);
    assert!(!ok, "another ServiceAccount removed initium's gate: {out}");
    assert!(err.contains(GATE_DENIAL), "not the policy's denial: {err}");
    let (ok, _, err) = set_gates(&ns, "web", None, Some(INITIUM_SA), false);
    assert!(
        ok,
        "initium's ServiceAccount could not remove its gate: {err}"
    );
    assert!(gates(&ns, "web").is_empty());
    // A Pod without gates (no `spec.schedulingGates`) updates as before.
    kubectl_ok(&["label", "pod", "-n", &ns, "web", "touched=2", "--overwrite"]);

    // (d) Deleting a gated Pod is always allowed.
    let (ok, _, err) = kubectl_try(
        &["create", "-f", "-"],
        Some(&pod("held", &["initium.dev/x.y"])),
    );
    assert!(ok, "create the second gated Pod: {err}");
    kubectl_ok(&[
        "delete",
        "pod",
        "-n",
        &ns,
        "held",
        "--wait=true",
        "--timeout=30s",
    ]);

    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
}
