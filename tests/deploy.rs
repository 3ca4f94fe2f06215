//! `deploy/` is a working installation: the real API server accepts every object of
//! `kubectl apply -k deploy/` in a server-side dry run.

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
