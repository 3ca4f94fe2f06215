//! `deploy/` is a working installation: the real API server accepts every object of
//! `kubectl apply -k deploy/` in a server-side dry run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

fn kubectl_ok(args: &[&str]) -> String {
    let out = support::kubectl()
        .args(args)
        .output()
        .expect("kubectl runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kubectl {}\nstdout:\n{stdout}\nstderr:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

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
        let mut full = vec!["auth", "can-i", sa, &cache_dir];
        full.extend_from_slice(args);
        let out = support::kubectl()
            .args(&full)
            .output()
            .expect("kubectl runs");
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    };
    // The RBAC authorizer sees new bindings through its informers, a moment later.
    let started = std::time::Instant::now();
    while !can(&["list", "clustermutationrules.initium.dev"])
        && started.elapsed() < std::time::Duration::from_secs(10)
    {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
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
        &["delete", "pods", "-n", "team"],
        &["update", "pods", "-n", "team"],
        &["patch", "jobs.batch", "-n", "team"],
        &["patch", "daemonsets.apps", "-n", "team"],
    ] {
        assert!(
            !can(denied),
            "least privilege: the ServiceAccount must not: {}",
            denied.join(" ")
        );
    }
}
