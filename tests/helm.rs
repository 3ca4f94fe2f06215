//! `deploy/helm/initium`, the Helm chart, rendered by a real helm (built from Go modules like
//! the control plane): it passes `helm lint --strict`; with default values it renders the
//! objects of the kustomize base `deploy/`, field for field; every value in values.yaml
//! changes what it says it changes; bad values fail with a sentence; and the real API server
//! accepts what it renders, in a server-side dry run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::commands::{can_i, kubectl_ok};
use support::wait::within;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/helm/initium");
const CUSTOM_VALUES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/helm/custom-values.yaml"
);

/// `helm ARGS`: (succeeded, stdout, stderr).
fn helm(args: &[&str]) -> (bool, String, String) {
    let out = support::helm().args(args).output().expect("helm runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `helm template initium <chart> --namespace initium-system ARGS`, as text.
fn template_text(args: &[&str]) -> String {
    let mut full = vec![
        "template",
        "initium",
        CHART,
        "--namespace",
        "initium-system",
    ];
    full.extend_from_slice(args);
    let (ok, out, err) = helm(&full);
    assert!(ok, "helm {}\nstderr:\n{err}", full.join(" "));
    out
}

/// The objects of a multi-document YAML stream (empty documents left out).
fn objects(yaml: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(yaml)
        .expect("helm and kustomize print YAML")
        .into_iter()
        .filter(|o| !o.is_null())
        .collect()
}

/// `helm template` with ARGS, as objects.
fn render(args: &[&str]) -> Vec<Value> {
    objects(&template_text(args))
}

/// `helm template` with ARGS must fail: its stderr.
fn render_fails(args: &[&str]) -> String {
    let mut full = vec![
        "template",
        "initium",
        CHART,
        "--namespace",
        "initium-system",
    ];
    full.extend_from_slice(args);
    let (ok, out, err) = helm(&full);
    assert!(!ok, "helm {} rendered:\n{out}", full.join(" "));
    err
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            panic!(
                "no {kind} {name} among {:?}",
                objects.iter().map(key).collect::<Vec<_>>()
            )
        })
}

fn has(objects: &[Value], kind: &str, name: &str) -> bool {
    objects
        .iter()
        .any(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

fn key(object: &Value) -> String {
    format!(
        "{}/{}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// The initium container of the Deployment `name`.
fn container<'a>(objects: &'a [Value], name: &str) -> &'a Value {
    &find(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
}

/// The container's args.
fn args(objects: &[Value], name: &str) -> Vec<String> {
    container(objects, name)["args"]
        .as_array()
        .expect("the container has args")
        .iter()
        .map(|a| a.as_str().expect("an arg is a string").to_owned())
        .collect()
}

/// The labels Helm adds and the kustomize base does not have.
const HELM_LABELS: [&str; 4] = [
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
];

/// An object as the comparison sees it: without Helm's labels (wherever they are: labels,
/// selectors, the anti-affinity's label selector), and a cluster-scoped object without the
/// `namespace` kustomize stamps on kinds it does not know.
fn normalized(object: &Value) -> Value {
    fn strip(value: &Value) -> Value {
        match value {
            Value::Object(map) => Value::Object(
                map.iter()
                    .filter(|(k, _)| !HELM_LABELS.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), strip(v)))
                    .collect(),
            ),
            Value::Array(items) => Value::Array(items.iter().map(strip).collect()),
            other => other.clone(),
        }
    }
    let mut object = strip(object);
    let cluster_scoped = [
        "Namespace",
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    if cluster_scoped.contains(&object["kind"].as_str().unwrap_or_default())
        && let Some(metadata) = object["metadata"].as_object_mut()
    {
        metadata.remove("namespace");
    }
    object
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).expect("JSON prints")
}

#[test]
fn the_chart_passes_helm_lint_strict() {
    for values in [None, Some(CUSTOM_VALUES)] {
        let mut args = vec!["lint", "--strict", CHART];
        if let Some(file) = values {
            args.extend(["--values", file]);
        }
        let (ok, out, err) = helm(&args);
        assert!(
            ok && out.contains("1 chart(s) linted, 0 chart(s) failed"),
            "helm {}\nstdout:\n{out}\nstderr:\n{err}",
            args.join(" ")
        );
        assert!(!out.contains("[WARNING]"), "lint warnings:\n{out}");
    }
    // Lint checks the values too: a TLS mode the chart does not know fails it.
    let (ok, out, _) = helm(&["lint", "--strict", CHART, "--set", "tls.mode=files"]);
    assert!(!ok, "lint passed an unknown TLS mode:\n{out}");
    assert!(out.contains("/tls/mode"), "{out}");
}

/// `helm install initium deploy/helm/initium -n initium-system` with default values installs
/// what `kubectl apply -k deploy/` does: the same objects, equal in every field once Helm's
/// own labels are set aside (args, RBAC rules, probes, security contexts, the gate policy's
/// CEL, the image). Only the Namespace differs: the release's namespace exists already unless
/// `namespace.create` is set, and then it is the kustomize base's.
#[test]
fn default_values_render_the_kustomize_base() {
    let kustomized = support::kubectl()
        .args(["kustomize", concat!(env!("CARGO_MANIFEST_DIR"), "/deploy")])
        .output()
        .expect("kubectl runs");
    assert!(
        kustomized.status.success(),
        "kubectl kustomize deploy/: {}",
        String::from_utf8_lossy(&kustomized.stderr)
    );
    let kustomized = objects(&String::from_utf8_lossy(&kustomized.stdout));
    let helm = render(&["--include-crds", "--set", "namespace.create=true"]);

    let mut kustomize_keys: Vec<_> = kustomized.iter().map(key).collect();
    let mut helm_keys: Vec<_> = helm.iter().map(key).collect();
    kustomize_keys.sort();
    helm_keys.sort();
    assert_eq!(
        helm_keys, kustomize_keys,
        "the chart and the kustomize base install different objects"
    );
    for object in &kustomized {
        let rendered = find(&helm, object["kind"].as_str().unwrap(), {
            object["metadata"]["name"].as_str().unwrap()
        });
        let (chart, base) = (pretty(&normalized(rendered)), pretty(&normalized(object)));
        assert!(
            chart == base,
            "{} differs between kubectl kustomize deploy/ (-) and helm template (+):\n{}",
            key(object),
            similar::TextDiff::from_lines(&base, &chart)
                .unified_diff()
                .context_radius(4)
        );
    }
    // The comparison is not vacuous: the objects that matter are there, with what matters.
    assert_eq!(
        args(&helm, "initium"),
        [
            "serve",
            "--listen=0.0.0.0:8443",
            "--ops-listen=0.0.0.0:8080",
            "--service=initium"
        ]
    );
    assert_eq!(
        container(&helm, "initium")["image"],
        "ghcr.io/initium-dev/initium:v0.1.0"
    );
    assert!(
        find(&helm, "ClusterRole", "initium")["rules"]
            .as_array()
            .unwrap()
            .len()
            > 10
    );

    // Without namespace.create the release's namespace is left alone; nothing else changes.
    let plain = render(&[]);
    assert!(!has(&plain, "Namespace", "initium-system"));
    assert_eq!(plain.len() + 3, helm.len(), "{plain:?}"); // the Namespace and the two CRDs
}

/// The chart installs the CRDs of the generated crds/ (which a test keeps equal to
/// `initium crd`), through a symlink: a copy could drift.
#[test]
fn the_chart_crds_are_the_generated_crds() {
    let link = std::fs::read_link(format!("{CHART}/crds"))
        .expect("deploy/helm/initium/crds must be a symlink to the generated crds/");
    assert_eq!(link, std::path::Path::new("../../../crds"));
    let helm = render(&["--include-crds"]);
    for file in [
        "mutationrules.initium.dev.yaml",
        "clustermutationrules.initium.dev.yaml",
    ] {
        let path = format!("{}/crds/{file}", env!("CARGO_MANIFEST_DIR"));
        let generated = objects(&std::fs::read_to_string(&path).expect("crds/ is readable"));
        let name = generated[0]["metadata"]["name"].as_str().unwrap();
        assert_eq!(
            find(&helm, "CustomResourceDefinition", name),
            &generated[0],
            "{file}"
        );
    }
}

#[test]
fn the_chart_version_is_the_crate_version() {
    let (ok, out, err) = helm(&["show", "chart", CHART]);
    assert!(ok, "{err}");
    let chart: Value = serde_saphyr::from_str(&out).expect("Chart.yaml is YAML");
    assert_eq!(
        chart["appVersion"],
        format!("v{}", env!("CARGO_PKG_VERSION")),
        "Chart.yaml's appVersion (the image tag by default) is not this crate's version"
    );
}

/// The leaves of values.yaml (a free-form map such as `resources` counts as one), by path.
fn value_paths(value: &Value, prefix: &str, paths: &mut Vec<String>) {
    const FREE_FORM: [&str; 1] = ["resources"];
    match value {
        Value::Object(map) if !map.is_empty() && !FREE_FORM.contains(&prefix) => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                value_paths(v, &path, paths);
            }
        }
        _ => paths.push(prefix.to_owned()),
    }
}

/// Every value of values.yaml, set to something else, changes the rendered manifest as
/// values.yaml says. `tested` lists what this test checks; a value added to values.yaml
/// without a check here fails it.
#[test]
fn every_value_changes_the_rendered_manifest() {
    let mut tested: Vec<&str> = Vec::new();
    let defaults = render(&[]);
    let custom = render(&["--namespace", "team", "--values", CUSTOM_VALUES]);
    let name = "webhooks";

    tested.extend(["nameOverride", "fullnameOverride"]);
    let labels = &find(&custom, "Deployment", name)["metadata"]["labels"];
    assert_eq!(labels["app.kubernetes.io/name"], "init");
    assert!(!has(&custom, "Deployment", "initium"));
    // A release named after the chart is the objects' name; otherwise "<release>-<name>".
    let overridden = render(&["--set", "nameOverride=hooks"]);
    assert!(has(&overridden, "Deployment", "initium-hooks"));
    assert!(has(
        &render(&["--set", "nameOverride=init"]),
        "Deployment",
        "initium"
    ));
    // Another name than initium's defaults: its own webhook configurations, Lease, Secret.
    let a = args(&custom, name);
    for arg in [
        "--service=webhooks",
        "--webhook-name=webhooks",
        "--lease-name=webhooks",
    ] {
        assert!(a.iter().any(|x| x == arg), "{arg} missing from {a:?}");
    }
    assert_eq!(
        find(&custom, "ClusterRole", name)["rules"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()["resourceNames"],
        json!(["webhooks"])
    );
    let renamed = render(&["--set", "fullnameOverride=webhooks"]);
    assert!(
        args(&renamed, name).contains(&"--tls-secret=webhooks-tls".to_owned()),
        "{:?}",
        args(&renamed, name)
    );
    let username =
        find(&renamed, "ValidatingAdmissionPolicy", "webhooks-gates")["spec"]["variables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "isInitium")
            .unwrap()["expression"]
            .as_str()
            .unwrap()
            .to_owned();
    assert!(
        username.contains("'system:serviceaccount:initium-system:webhooks'"),
        "{username}"
    );
    // The release namespace goes everywhere a namespace is named.
    let binding = find(&custom, "ClusterRoleBinding", name);
    assert_eq!(binding["subjects"][0]["namespace"], "team");
    assert_eq!(
        find(&custom, "Deployment", name)["metadata"]["namespace"],
        "team"
    );

    tested.push("namespace.create");
    assert!(has(&custom, "Namespace", "team"));
    assert!(!has(&defaults, "Namespace", "initium-system"));

    tested.extend([
        "image.repository",
        "image.tag",
        "image.digest",
        "image.pullPolicy",
    ]);
    let c = container(&custom, name);
    assert_eq!(
        c["image"],
        "registry.example.com/mirror/initium@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    );
    assert_eq!(c["imagePullPolicy"], "Always");
    assert!(
        container(&defaults, "initium")
            .get("imagePullPolicy")
            .is_none()
    );
    let tagged = render(&[
        "--set",
        "image.repository=registry.example.com/initium,image.tag=v9",
    ]);
    assert_eq!(
        container(&tagged, "initium")["image"],
        "registry.example.com/initium:v9"
    );

    tested.push("imagePullSecrets");
    let pod = &find(&custom, "Deployment", name)["spec"]["template"];
    assert_eq!(
        pod["spec"]["imagePullSecrets"],
        json!([{"name": "regcred"}])
    );

    tested.push("replicas");
    assert_eq!(find(&custom, "Deployment", name)["spec"]["replicas"], 3);

    tested.extend([
        "budget",
        "excludedNamespaces",
        "extraArgs",
        "compileRules",
        "maxCompiledRules",
    ]);
    assert!(
        !template_text(&[]).contains("--compile-rules=auto"),
        "compiling rules is off unless asked for"
    );
    for arg in [
        "--compile-rules=auto",
        "--max-compiled-rules=40",
        "--budget=750ms",
        "--exclude-namespace=kube-system",
        "--exclude-namespace=monitoring",
        "--max-body-bytes=16Mi",
        "--gate-release-concurrency=16",
    ] {
        assert!(a.iter().any(|x| x == arg), "{arg} missing from {a:?}");
    }

    tested.extend(["tls.mode", "tls.secretName", "tls.caKey"]);
    for arg in [
        "--tls-cert-file=/etc/initium/tls/tls.crt",
        "--tls-key-file=/etc/initium/tls/tls.key",
        "--ca-file=/etc/initium/tls/ca.pem",
    ] {
        assert!(a.iter().any(|x| x == arg), "{arg} missing from {a:?}");
    }
    assert!(!a.iter().any(|x| x.starts_with("--tls-secret")), "{a:?}");
    assert_eq!(
        pod["spec"]["volumes"],
        json!([{"name": "tls", "secret": {"secretName": "webhooks-cert"}}])
    );
    assert_eq!(
        c["volumeMounts"],
        json!([{"name": "tls", "mountPath": "/etc/initium/tls", "readOnly": true}])
    );
    // The certificate comes from a file: initium needs no Secrets.
    let role = &find(&custom, "Role", name)["rules"];
    assert!(
        !role.to_string().contains("secrets"),
        "the Role grants Secrets without a self-managed certificate: {role}"
    );
    assert!(
        find(&defaults, "Role", "initium")["rules"]
            .to_string()
            .contains("secrets")
    );
    let no_ca = render(&["--set", "tls.mode=secret,tls.secretName=cert,tls.caKey="]);
    assert!(
        !args(&no_ca, "initium")
            .iter()
            .any(|x| x.starts_with("--ca-file")),
        "{:?}",
        args(&no_ca, "initium")
    );

    tested.push("tls.selfManagedSecret");
    let own = render(&["--set", "tls.selfManagedSecret=my-ca"]);
    assert!(args(&own, "initium").contains(&"--tls-secret=my-ca".to_owned()));

    tested.extend([
        "metrics.port",
        "metrics.service.enabled",
        "metrics.service.annotations",
    ]);
    assert!(a.contains(&"--ops-listen=0.0.0.0:9090".to_owned()), "{a:?}");
    assert_eq!(
        c["ports"][1],
        json!({"name": "ops", "containerPort": 9090, "protocol": "TCP"})
    );
    let metrics = find(&custom, "Service", "webhooks-metrics");
    assert_eq!(
        metrics["spec"]["ports"],
        json!([{"name": "ops", "port": 9090, "targetPort": "ops", "protocol": "TCP"}])
    );
    assert_eq!(
        metrics["metadata"]["annotations"],
        json!({"prometheus.io/scrape": "true"})
    );
    assert!(!has(&defaults, "Service", "initium-metrics"));

    tested.push("logLevel");
    let rust_log = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "RUST_LOG")
        .unwrap();
    assert_eq!(rust_log["value"], "initium=debug,kube=info");

    tested.push("resources");
    assert_eq!(
        c["resources"],
        json!({"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}})
    );

    tested.extend([
        "podDisruptionBudget.enabled",
        "podDisruptionBudget.minAvailable",
    ]);
    assert_eq!(
        find(&custom, "PodDisruptionBudget", name)["spec"]["minAvailable"],
        2
    );
    let no_pdb = render(&["--set", "podDisruptionBudget.enabled=false"]);
    assert!(!has(&no_pdb, "PodDisruptionBudget", "initium"));
    assert!(has(&defaults, "PodDisruptionBudget", "initium"));

    tested.extend([
        "priorityClassName",
        "podAnnotations",
        "podLabels",
        "nodeSelector",
        "tolerations",
        "affinity",
    ]);
    assert!(pod["spec"].get("priorityClassName").is_none());
    assert_eq!(
        pod["metadata"]["annotations"],
        json!({"example.com/owner": "platform"})
    );
    assert_eq!(pod["metadata"]["labels"]["team"], "platform");
    // Extra Pod labels stay out of the selector, which cannot change after install.
    assert!(
        find(&custom, "Deployment", name)["spec"]["selector"]["matchLabels"]
            .get("team")
            .is_none()
    );
    assert_eq!(
        pod["spec"]["nodeSelector"],
        json!({"kubernetes.io/os": "linux"})
    );
    assert_eq!(pod["spec"]["tolerations"][0]["key"], "dedicated");
    assert!(pod["spec"]["affinity"].get("podAntiAffinity").is_none());
    assert!(pod["spec"]["affinity"]["nodeAffinity"].is_object());

    tested.push("gatePolicy.enabled");
    assert!(!has(&custom, "ValidatingAdmissionPolicy", "webhooks-gates"));
    assert!(!has(
        &custom,
        "ValidatingAdmissionPolicyBinding",
        "webhooks-gates"
    ));
    assert!(has(&defaults, "ValidatingAdmissionPolicy", "initium-gates"));

    // Every value is covered, and the custom values file sets every one.
    let values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(format!("{CHART}/values.yaml")).expect("values.yaml"),
    )
    .expect("values.yaml is YAML");
    let mut documented = Vec::new();
    value_paths(&values, "", &mut documented);
    let mut covered: Vec<String> = tested.iter().map(|s| (*s).to_owned()).collect();
    documented.sort();
    covered.sort();
    assert_eq!(
        documented, covered,
        "values.yaml and what this test checks differ: check the new value here"
    );
    let custom_values: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(CUSTOM_VALUES).expect("the custom values"))
            .expect("the custom values are YAML");
    for path in &documented {
        let set = path
            .split('.')
            .try_fold(&custom_values, |value, key| value.get(key));
        assert!(set.is_some(), "{CUSTOM_VALUES} must set {path}");
    }
}

/// Values the chart cannot install fail `helm template` (and so `helm install`) with a
/// message that says which value and what to do.
#[test]
fn bad_values_fail_with_a_sentence() {
    for (set, expected) in [
        (
            "tls.mode=files",
            &["at '/tls/mode'", "'selfManaged', 'secret'"][..],
        ),
        (
            "tls.mode=secret",
            &[
                "tls.mode is secret but tls.secretName is empty: name the Secret holding tls.crt and tls.key",
            ],
        ),
        (
            "tls.mode=secret,tls.secretName=cert,tls.selfManagedSecret=mine",
            &["tls.selfManagedSecret is only for tls.mode=selfManaged"],
        ),
        ("budget=fast", &["at '/budget'"]),
        ("budget=1.5s", &["at '/budget'"]),
        (
            "replica=3",
            &["additional properties 'replica' not allowed"],
        ),
        (
            "metrics.port=8443",
            &["metrics.port is 8443, the webhook's port"],
        ),
        (
            "excludedNamespaces={Monitoring}",
            &["at '/excludedNamespaces/0'"],
        ),
        ("extraArgs={budget=1s}", &["at '/extraArgs/0'"]),
        ("image.pullPolicy=Sometimes", &["at '/image/pullPolicy'"]),
    ] {
        let err = render_fails(&["--set", set]);
        for text in expected {
            assert!(err.contains(text), "--set {set}: {text:?} not in:\n{err}");
        }
    }
}

/// `helm template ... | kubectl apply --dry-run=server -f -` on the real API server, with
/// default values and with the custom values: the API server's own validation (schemas,
/// RBAC, the gate policy's CEL) accepts every object.
#[test]
fn rendered_manifests_pass_a_server_side_dry_run() {
    for (values, objects) in [
        (
            None,
            &[
                "customresourcedefinition.apiextensions.k8s.io/mutationrules.initium.dev",
                "customresourcedefinition.apiextensions.k8s.io/clustermutationrules.initium.dev",
                "namespace/NS",
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
            ][..],
        ),
        (
            Some(CUSTOM_VALUES),
            &[
                "namespace/NS",
                "serviceaccount/webhooks",
                "clusterrole.rbac.authorization.k8s.io/webhooks",
                "role.rbac.authorization.k8s.io/webhooks",
                "service/webhooks",
                "service/webhooks-metrics",
                "deployment.apps/webhooks",
                "poddisruptionbudget.policy/webhooks",
            ],
        ),
    ] {
        // A dry run does not create the Namespace, so the namespaced objects need it to exist.
        let namespace = support::unique("helm");
        let created = support::kubectl()
            .args(["create", "namespace", &namespace])
            .output()
            .expect("kubectl runs");
        assert!(
            created.status.success(),
            "{}",
            String::from_utf8_lossy(&created.stderr)
        );
        let mut args = vec![
            "template",
            "initium",
            CHART,
            "--namespace",
            &namespace,
            "--include-crds",
            "--set",
            "namespace.create=true",
        ];
        if let Some(file) = values {
            args.extend(["--values", file]);
        }
        let (ok, manifest, err) = helm(&args);
        assert!(ok, "helm {}: {err}", args.join(" "));
        let out = support::Plane::shared()
            .kubectl_stdin(&["apply", "--dry-run=server", "-f", "-"], &manifest)
            .expect("kubectl runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the API server refused the chart's objects ({values:?}):\n{}\n--- manifest\n{manifest}",
            String::from_utf8_lossy(&out.stderr)
        );
        for object in objects {
            let object = object.replace("NS", &namespace);
            assert!(
                stdout.contains(&object),
                "{object} missing from the dry run:\n{stdout}"
            );
        }
        assert!(stdout.contains("(server dry run)"), "{stdout}");
        let _ = support::kubectl()
            .args(["delete", "namespace", &namespace, "--wait=false"])
            .output();
    }
}

/// What docs/operations.md tells people to run, on the real API server: `helm install` with
/// `--create-namespace` (the CRDs come with the first install), the ServiceAccount may do
/// what initium does in the release's namespace, `helm upgrade` changes the Deployment,
/// the CRDs are applied again before it as the docs say, and `helm uninstall` removes the
/// release but leaves the CRDs (and so the rules).
#[test]
fn helm_installs_upgrades_and_uninstalls_on_the_api_server() {
    let kubeconfig = support::kubeconfig_path();
    let kubeconfig = kubeconfig.to_str().expect("a UTF-8 path");
    let namespace = support::unique("helm-release");
    let release = |args: &[&str]| {
        let mut full = args.to_vec();
        full.extend(["--kubeconfig", kubeconfig, "--namespace", &namespace]);
        let (ok, out, err) = helm(&full);
        assert!(
            ok,
            "helm {}\nstdout:\n{out}\nstderr:\n{err}",
            full.join(" ")
        );
        out
    };
    let out = release(&["install", "initium", CHART, "--create-namespace"]);
    assert!(out.contains("STATUS: deployed"), "{out}");
    kubectl_ok(&["get", "crd", "mutationrules.initium.dev"]);
    let deployment = || -> Value {
        serde_json::from_str(&kubectl_ok(&[
            "get",
            "deployment",
            "initium",
            "-n",
            &namespace,
            "-o",
            "json",
        ]))
        .expect("a Deployment as JSON")
    };
    let installed = deployment();
    assert_eq!(installed["spec"]["replicas"], 2);

    // The RBAC authorizer sees new bindings through its informers, a moment later.
    let sa = format!("--as=system:serviceaccount:{namespace}:initium");
    let can = |args: &[&str]| {
        let mut full = vec![sa.as_str()];
        full.extend_from_slice(args);
        can_i(&full)
    };
    within(Duration::from_secs(30), Duration::from_millis(100), || {
        can(&["update", "leases.coordination.k8s.io", "-n", &namespace])
    });
    assert!(can(&[
        "update",
        "leases.coordination.k8s.io",
        "-n",
        &namespace
    ]));
    assert!(can(&["create", "secrets", "-n", &namespace]));
    assert!(can(&["watch", "pods", "--all-namespaces"]));
    assert!(!can(&["get", "secrets", "-n", "kube-system"]));

    // Upgrade as docs/operations.md says: the CRDs first (Helm does not upgrade them).
    kubectl_ok(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        &format!("{CHART}/crds/"),
    ]);
    let out = release(&[
        "upgrade",
        "initium",
        CHART,
        "--set",
        "budget=500ms,replicas=1",
    ]);
    assert!(out.contains("REVISION: 2"), "{out}");
    let upgraded = deployment();
    assert_eq!(upgraded["spec"]["replicas"], 1);
    let args = upgraded["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(args.contains("--budget=500ms"), "{args}");

    let out = release(&["uninstall", "initium"]);
    assert!(out.contains("uninstalled"), "{out}");
    let gone = support::kubectl()
        .args(["get", "deployment", "initium", "-n", &namespace])
        .output()
        .expect("kubectl runs");
    assert!(
        !gone.status.success(),
        "the Deployment outlived the release"
    );
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("NotFound"),
        "{}",
        String::from_utf8_lossy(&gone.stderr)
    );
    let gone = support::kubectl()
        .args(["get", "clusterrole", "initium"])
        .output()
        .expect("kubectl runs");
    assert!(
        !gone.status.success(),
        "the ClusterRole outlived the release"
    );
    // The CRDs stay: deleting them would delete every rule.
    kubectl_ok(&["get", "crd", "mutationrules.initium.dev"]);
    let _ = support::kubectl()
        .args(["delete", "namespace", &namespace, "--wait=false"])
        .output();
}
