//! `initium serve` end to end on the real API server: the binary runs out of cluster
//! (`--webhook-url https://127.0.0.1:PORT`), the API server calls it for real, and the
//! tests look at what `kubectl` stores and prints.
//!
//! Webhook configurations and rules are cluster-wide, so the tests of this binary run one
//! at a time and each cleans up before it starts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn kubectl(args: &[&str]) -> Output {
    support::kubectl()
        .args(args)
        .output()
        .expect("kubectl runs")
}

fn kubectl_stdin(args: &[&str], input: &str) -> Output {
    support::Plane::shared()
        .kubectl_stdin(args, input)
        .expect("kubectl runs")
}

fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn apply(yaml: &str) {
    ok(
        kubectl_stdin(
            &["apply", "--server-side", "--force-conflicts", "-f", "-"],
            yaml,
        ),
        &format!("apply\n{yaml}"),
    );
}

fn json(out: String) -> Value {
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// GET on a plain-HTTP port of 127.0.0.1: (status, body); status 0 if nothing answers.
fn http_get(port: u16, path: &str) -> (u16, String) {
    support::process::http_get(([127, 0, 0, 1], port).into(), path).unwrap_or((0, String::new()))
}

fn free_port() -> u16 {
    support::process::free_port().expect("a free port")
}

use support::wait::is;
use support::{eventually_blocking, install_crds, serial_blocking, unique};

fn namespace(prefix: &str) -> String {
    let name = unique(prefix);
    ok(kubectl(&["create", "namespace", &name]), "create namespace");
    name
}

/// Deletes every rule and the webhook configurations a previous test may have left.
fn clean_cluster() {
    ok(
        kubectl(&["delete", "cmr", "--all", "--wait=true"]),
        "delete cluster rules",
    );
    ok(
        kubectl(&["delete", "mr", "--all", "--all-namespaces", "--wait=true"]),
        "delete rules",
    );
}

/// One `initium serve` process.
struct Initium {
    child: Option<Child>,
    webhook_port: u16,
    ops_port: u16,
    webhook_name: String,
    namespace: String,
}

impl Initium {
    fn start(webhook_name: &str, namespace: &str, extra: &[&str]) -> Initium {
        let webhook_port = free_port();
        let ops_port = free_port();
        let listen = format!("127.0.0.1:{webhook_port}");
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--listen".into(),
            listen.clone(),
            "--webhook-url".into(),
            format!("https://{listen}"),
            "--ops-listen".into(),
            format!("127.0.0.1:{ops_port}"),
            "--namespace".into(),
            namespace.into(),
            // Stopped on purpose and waited for: no drain time behind a Service.
            "--shutdown-delay=0s".into(),
            "--webhook-name".into(),
            webhook_name.into(),
            "--lease-name".into(),
            webhook_name.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = std::fs::File::create(
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("{webhook_name}-{webhook_port}.log")),
        )
        .expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_initium"))
            .args(&args)
            .env("KUBECONFIG", support::kubeconfig_path())
            .env("RUST_LOG", "info,initium=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("initium serve starts");
        let initium = Initium {
            child: Some(child),
            webhook_port,
            ops_port,
            webhook_name: webhook_name.into(),
            namespace: namespace.into(),
        };
        eventually_blocking("initium /readyz", Duration::from_secs(30), || {
            is(initium.ops("/readyz").0, 200)
        });
        initium
    }

    /// Where `start` writes serve's log.
    fn log_path(&self) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{}-{}.log", self.webhook_name, self.webhook_port))
    }

    /// GET on the operations port: (status, body).
    fn ops(&self, path: &str) -> (u16, String) {
        http_get(self.ops_port, path)
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGTERM first: initium shuts down gracefully.
            support::process::terminate(&mut child, Duration::from_secs(15));
        }
    }

    fn webhook_configuration(&self) -> Option<Value> {
        let out = kubectl(&[
            "get",
            "mutatingwebhookconfiguration",
            &self.webhook_name,
            "-o",
            "json",
        ]);
        out.status
            .success()
            .then(|| json(String::from_utf8_lossy(&out.stdout).into_owned()))
    }

    /// The resources the mutating webhooks intercept, e.g. `["pods"]`.
    fn intercepted(&self) -> Vec<String> {
        let Some(config) = self.webhook_configuration() else {
            return Vec::new();
        };
        let mut resources: Vec<String> = config["webhooks"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|w| w["rules"].as_array().cloned().unwrap_or_default())
            .flat_map(|r| r["resources"].as_array().cloned().unwrap_or_default())
            .filter_map(|r| r.as_str().map(String::from))
            .collect();
        resources.sort();
        resources.dedup();
        resources
    }
}

impl Drop for Initium {
    fn drop(&mut self) {
        self.stop();
        let _ = kubectl(&[
            "delete",
            "mutatingwebhookconfiguration",
            &self.webhook_name,
            "--ignore-not-found",
        ]);
        let _ = kubectl(&[
            "delete",
            "validatingwebhookconfiguration",
            &self.webhook_name,
            "--ignore-not-found",
        ]);
        let _ = kubectl(&[
            "delete",
            "namespace",
            &self.namespace,
            "--wait=false",
            "--ignore-not-found",
        ]);
    }
}

fn ready_status(kind: &str, namespace: Option<&str>, name: &str) -> Option<String> {
    let mut args = vec![
        "get",
        kind,
        name,
        "-o",
        "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
    ];
    if let Some(ns) = namespace {
        args.extend(["-n", ns]);
    }
    let out = kubectl(&args);
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn pod_yaml(namespace: &str, name: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n  containers:\n  - {{name: app, image: registry.example.com/app:1}}\n  - {{name: side, image: registry.example.com/side:1}}\n"
    )
}

/// Creates the object for real, returns what the API server stored.
fn create(yaml: &str) -> Value {
    json(ok(
        kubectl_stdin(&["create", "-f", "-", "-o", "json"], yaml),
        &format!("create\n{yaml}"),
    ))
}

/// A server-side dry-run create: the object as it would be stored (mutated by webhooks).
fn dry_run(yaml: &str) -> Value {
    json(ok(
        kubectl_stdin(
            &["create", "--dry-run=server", "-f", "-", "-o", "json"],
            yaml,
        ),
        &format!("dry-run create\n{yaml}"),
    ))
}

fn test_ca_rule(namespace: &str, mount_path: &str) -> String {
    format!(
        r#"apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: test-certs, namespace: {namespace}}}
spec:
  match: {{kinds: [Pod]}}
  mutations:
    - upsert: {{path: /spec/volumes, key: name, value: {{name: test-ca, secret: {{secretName: test-ca}}}}}}
    - forEach: "$.spec.containers[*]"
      mutations:
        - upsert: {{path: /volumeMounts, key: name, value: {{name: test-ca, mountPath: {mount_path}, readOnly: true}}}}
"#
    )
}

fn mounts(pod: &Value) -> Vec<String> {
    pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            c["volumeMounts"]
                .as_array()
                .and_then(|m| m.iter().find(|m| m["name"] == "test-ca"))
                .map_or(String::new(), |m| {
                    m["mountPath"].as_str().unwrap_or("").to_string()
                })
        })
        .collect()
}

/// Runs `initium serve` with `kubeconfig` (the out-of-cluster command of
/// docs/operations.md) and expects it to stop at once: its exit status and standard error.
fn serve_fails(kubeconfig: &std::path::Path, namespace: &str) -> String {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_initium"))
        .args([
            "serve",
            "--listen",
            &listen,
            "--webhook-url",
            &format!("https://{listen}"),
            "--ops-listen",
            &format!("127.0.0.1:{}", free_port()),
            "--namespace",
            namespace,
            "--log-format",
            "text",
        ])
        .env("KUBECONFIG", kubeconfig)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("initium serve starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("initium serve kept running with a kubeconfig it cannot use");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("stderr");
    assert!(!out.status.success(), "initium serve exited with success");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let last = stderr.lines().last().unwrap_or_default().to_string();
    assert!(last.starts_with("error: "), "{stderr}");
    for dump in ["Status {", "ApiError", "Some(", "ListMeta"] {
        assert!(!last.contains(dump), "a Debug dump in: {last}");
    }
    last
}

/// The kubeconfig of the shared plane, edited by `edit` (one YAML line after another).
fn kubeconfig_variant(name: &str, edit: impl Fn(&str) -> String) -> std::path::PathBuf {
    let text = std::fs::read_to_string(support::kubeconfig_path()).expect("kubeconfig");
    let edited: Vec<String> = text.lines().map(edit).collect();
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}.kubeconfig", unique(name)));
    std::fs::write(&path, edited.join("\n") + "\n").expect("write kubeconfig");
    path
}

#[test]
fn the_documented_first_run_creates_initiums_namespace_and_becomes_ready() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    // docs/operations.md: apply the CRDs, then `initium serve ... --namespace initium-dev`
    // on a cluster where that namespace does not exist.
    let own = unique("initium-dev");
    assert!(
        !kubectl(&["get", "namespace", &own]).status.success(),
        "the namespace must not exist before the first run"
    );
    let initium = Initium::start(&unique("first-run"), &own, &["--log-format", "text"]);
    assert_eq!(initium.ops("/readyz").0, 200);
    let created = json(ok(
        kubectl(&["get", "namespace", &own, "-o", "json"]),
        "get namespace",
    ));
    assert_eq!(
        created["metadata"]["labels"]["app.kubernetes.io/created-by"], "initium",
        "{created}"
    );
    // What the namespace is for: the TLS Secret and the Lease.
    ok(
        kubectl(&["get", "secret", "initium-tls", "-n", &own]),
        "the TLS Secret in the new namespace",
    );
    eventually_blocking(
        "the Lease in the new namespace",
        Duration::from_secs(30),
        || {
            is(
                kubectl(&["get", "lease", &initium.webhook_name, "-n", &own])
                    .status
                    .success(),
                true,
            )
        },
    );
}

#[test]
fn a_kubeconfig_that_cannot_work_stops_serve_with_a_sentence_that_says_what_to_do() {
    let _serial = serial_blocking();
    install_crds();
    let missing = std::env::temp_dir()
        .join(unique("no-such"))
        .join("kubeconfig");
    let line = serve_fails(&missing, "initium-dev");
    assert!(line.contains("KUBECONFIG names"), "{line}");
    assert!(line.contains("does not exist"), "{line}");

    // An API server that is not there: port 1 of 127.0.0.1 refuses connections.
    let dead = kubeconfig_variant("dead", |l| {
        if l.trim_start().starts_with("server:") {
            "    server: https://127.0.0.1:1".into()
        } else {
            l.into()
        }
    });
    let line = serve_fails(&dead, "initium-dev");
    assert!(line.contains("cannot reach the API server"), "{line}");
    assert!(line.contains("points at it"), "{line}");

    // A user who may read Namespaces but not create one (impersonated service account), and
    // a namespace that does not exist: the sentence gives the kubectl command to run.
    let home = namespace("first-run-rbac");
    ok(
        kubectl(&["create", "serviceaccount", "reader", "-n", &home]),
        "create serviceaccount",
    );
    let role = unique("namespace-reader");
    ok(
        kubectl(&[
            "create",
            "clusterrole",
            &role,
            "--verb=get,list,watch",
            "--resource=namespaces",
        ]),
        "create clusterrole",
    );
    ok(
        kubectl(&[
            "create",
            "clusterrolebinding",
            &role,
            &format!("--clusterrole={role}"),
            &format!("--serviceaccount={home}:reader"),
        ]),
        "create clusterrolebinding",
    );
    let reader = kubeconfig_variant("reader", |l| {
        if l.trim_start().starts_with("client-key-data:") {
            format!("{l}\n    as: system:serviceaccount:{home}:reader")
        } else {
            l.into()
        }
    });
    let absent = unique("initium-absent");
    let line = serve_fails(&reader, &absent);
    assert!(
        line.contains(&format!("kubectl create namespace {absent}")),
        "{line}"
    );
    assert!(line.contains("may not create it"), "{line}");
    let _ = kubectl(&["delete", "clusterrolebinding,clusterrole", &role]);
    let _ = kubectl(&["delete", "namespace", &home, "--wait=false"]);
}

#[test]
fn a_namespace_rule_mutates_its_pods_and_follows_updates_and_deletion() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let initium = Initium::start(&unique("initium-e2e"), &own, &[]);
    let payments = namespace("payments");
    let shop = namespace("shop");
    assert!(
        initium.intercepted().is_empty(),
        "with no rules the configuration intercepts nothing: {:?}",
        initium.webhook_configuration()
    );

    let applied = Instant::now();
    apply(&test_ca_rule(&payments, "/etc/ssl/test"));
    eventually_blocking(
        "the rule to be Ready within 2 s",
        Duration::from_secs(2),
        || {
            is(
                ready_status("mr", Some(&payments), "test-certs").as_deref(),
                Some("True"),
            )
        },
    );
    let ready_after = applied.elapsed();
    eventually_blocking(
        "the webhook configuration to cover pods",
        Duration::from_secs(5),
        || is(initium.intercepted(), ["pods"]),
    );
    // The API server picks up a changed webhook configuration within about a second.
    eventually_blocking("dry-run Pods to be mutated", Duration::from_secs(5), || {
        is(
            mounts(&dry_run(&pod_yaml(&payments, "probe")))[0].as_str(),
            "/etc/ssl/test",
        )
    });

    let pod = create(&pod_yaml(&payments, "web"));
    assert_eq!(
        mounts(&pod),
        ["/etc/ssl/test", "/etc/ssl/test"],
        "every container gets the mount: {pod}"
    );
    assert!(
        pod["spec"]["volumes"]
            .as_array()
            .is_some_and(|v| v.iter().any(|v| v["name"] == "test-ca")),
        "{pod}"
    );
    assert_eq!(
        pod["metadata"]["annotations"]["initium.dev/mutated-by"],
        format!("{payments}/test-certs")
    );
    let other = create(&pod_yaml(&shop, "web"));
    assert_eq!(
        mounts(&other),
        ["", ""],
        "a Pod in another namespace is untouched: {other}"
    );
    assert!(
        other["metadata"]["annotations"]
            .get("initium.dev/mutated-by")
            .is_none()
    );
    eprintln!("rule Ready {ready_after:?} after kubectl apply");

    // An update changes what new Pods get within 2 s.
    apply(&test_ca_rule(&payments, "/etc/ssl/updated"));
    eventually_blocking(
        "new Pods to get the updated mount",
        Duration::from_secs(2),
        || {
            is(
                mounts(&dry_run(&pod_yaml(&payments, "probe")))[0].as_str(),
                "/etc/ssl/updated",
            )
        },
    );

    // Deleting the rule stops the mutation and shrinks the webhook configuration.
    ok(
        kubectl(&["delete", "mr", "test-certs", "-n", &payments]),
        "delete rule",
    );
    eventually_blocking(
        "the configuration to intercept nothing",
        Duration::from_secs(5),
        || is(initium.intercepted(), [] as [&str; 0]),
    );
    let after = create(&pod_yaml(&payments, "after"));
    assert_eq!(mounts(&after), ["", ""], "{after}");
}

#[test]
fn deployments_and_namespace_selectors() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let initium = Initium::start(&unique("initium-e2e"), &own, &[]);
    let team = namespace("team");
    apply(
        r#"apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: deployment-owner}
spec:
  match: {kinds: [apps/v1/Deployment]}
  mutations: [{merge: {metadata: {labels: {owner: platform}}}}]
---
apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: prod-pods}
spec:
  match:
    kinds: [Pod]
    namespaceSelector: {matchLabels: {env: prod}}
  mutations: [{merge: {metadata: {labels: {tier: prod}}}}]
"#,
    );
    eventually_blocking("both resources intercepted", Duration::from_secs(5), || {
        is(initium.intercepted(), ["deployments", "pods"])
    });
    let deployment = format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: web, namespace: {team}}}\nspec:\n  selector: {{matchLabels: {{app: web}}}}\n  template:\n    metadata: {{labels: {{app: web}}}}\n    spec: {{containers: [{{name: web, image: registry.example.com/web:1}}]}}\n"
    );
    eventually_blocking("Deployments to be mutated", Duration::from_secs(5), || {
        is(
            &dry_run(&deployment)["metadata"]["labels"]["owner"],
            "platform",
        )
    });
    let pod = pod_yaml(&team, "p");
    assert!(
        dry_run(&pod)["metadata"]["labels"].get("tier").is_none(),
        "the namespace is not prod yet"
    );
    ok(
        kubectl(&["label", "namespace", &team, "env=prod"]),
        "label namespace",
    );
    eventually_blocking(
        "the namespace label change to be followed",
        Duration::from_secs(3),
        || is(&dry_run(&pod)["metadata"]["labels"]["tier"], "prod"),
    );
}

#[test]
fn invalid_rules_are_rejected_at_apply_with_the_field_path() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let _initium = Initium::start(&unique("initium-e2e"), &own, &[]);
    let rule = r#"apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: bad-regex}
spec:
  match: {kinds: [Pod]}
  mutations: [{rewrite: {path: /spec/containers/0/image, regex: "(unclosed", replacement: x}}]
"#;
    let out = eventually_blocking(
        "the validating webhook to reject the rule",
        Duration::from_secs(5),
        || {
            let out = kubectl_stdin(&["apply", "-f", "-"], rule);
            if out.status.success() {
                let _ = kubectl(&["delete", "cmr", "bad-regex", "--ignore-not-found"]);
                return Err("the rule was accepted".into());
            }
            Ok(out)
        },
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("spec.mutations[0].rewrite.regex"),
        "{stderr}"
    );
    assert!(stderr.contains("unclosed group"), "{stderr}");
    // Server-side dry run (what GitOps tools use to preview) sees the same error.
    let out = kubectl_stdin(&["apply", "--dry-run=server", "-f", "-"], rule);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("spec.mutations[0].rewrite.regex"));
}

/// Issue 30, finding 10 (d): the API server takes a rule nested 150 levels deep; initium
/// could not read it and answered 400, which kubectl printed as "the server rejected our
/// request for an unknown reason". Now the rule is refused with a sentence naming it, the
/// field and the limits.
#[test]
fn a_rule_nested_deeper_than_initium_reads_is_refused_with_a_sentence() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let _initium = Initium::start(&unique("initium-deep"), &own, &[]);
    let mut deep = String::from("x");
    for _ in 0..150 {
        deep = format!("{{\"a\": {deep}}}").replace("{\"a\": x}", "{\"a\": \"x\"}");
    }
    let rule = format!(
        "{{\"apiVersion\": \"initium.dev/v1alpha1\", \"kind\": \"ClusterMutationRule\", \
         \"metadata\": {{\"name\": \"too-deep\"}}, \"spec\": {{\"match\": {{\"kinds\": \
         [\"Pod\"]}}, \"mutations\": [{{\"merge\": {deep}}}]}}}}"
    );
    let out = eventually_blocking(
        "the validating webhook to refuse the rule",
        Duration::from_secs(5),
        || {
            let out = kubectl_stdin(&["apply", "-f", "-"], &rule);
            if out.status.success() {
                let _ = kubectl(&["delete", "cmr", "too-deep", "--ignore-not-found"]);
                return Err("the rule was accepted".into());
            }
            Ok(out)
        },
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("unknown reason"), "{stderr}");
    assert!(
        stderr.contains("spec.mutations[0].merge.a.a.a.a...")
            && stderr.contains("The ClusterMutationRule \"too-deep\" is invalid")
            && stderr.contains("(the depth limit)"),
        "{stderr}"
    );
}

#[test]
fn a_rule_matching_everything_never_touches_initiums_namespace_or_kube_system() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let initium = Initium::start(&unique("initium-e2e"), &own, &[]);
    let team = namespace("team");
    apply(
        r#"apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {name: everything}
spec:
  match: {kinds: ["*"]}
  mutations: [{merge: {metadata: {labels: {touched: "yes"}}}}]
"#,
    );
    let config_map = |ns: &str| {
        format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: cm, namespace: {ns}}}\ndata: {{a: b}}\n"
        )
    };
    eventually_blocking(
        "ConfigMaps in a team namespace to be mutated",
        Duration::from_secs(5),
        || {
            is(
                &dry_run(&config_map(&team))["metadata"]["labels"]["touched"],
                "yes",
            )
        },
    );
    for ns in [own.as_str(), "kube-system"] {
        let stored = dry_run(&config_map(ns));
        assert!(
            stored["metadata"]["labels"].get("touched").is_none(),
            "{ns} must never be intercepted: {stored}"
        );
    }
    let config = initium.webhook_configuration().expect("configuration");
    let selector =
        serde_json::to_string(&config["webhooks"][0]["namespaceSelector"]).unwrap_or_default();
    assert!(
        selector.contains("kube-system") && selector.contains(&own),
        "{selector}"
    );
    // A review sent straight to the port, around the webhook configuration, claiming an
    // excluded namespace: allowed, no patch. The same review for the team namespace is patched.
    let patched = support::post_review(
        format!("127.0.0.1:{}", initium.webhook_port),
        &pod_review(&team),
    );
    assert!(patched["response"]["patch"].is_string(), "{patched}");
    for ns in [own.as_str(), "kube-system"] {
        let answer = support::post_review(
            format!("127.0.0.1:{}", initium.webhook_port),
            &pod_review(ns),
        );
        assert_eq!(answer["response"]["allowed"], true, "{ns}: {answer}");
        assert!(answer["response"].get("patch").is_none(), "{ns}: {answer}");
    }
}

/// An `Ignore` rule in `soft` and a `Fail` rule in `strict`, each adding a label to Pods.
fn optional_and_required_rules(soft: &str, strict: &str) -> String {
    format!(
        r#"apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: optional, namespace: {soft}}}
spec:
  match: {{kinds: [Pod]}}
  mutations: [{{merge: {{metadata: {{labels: {{soft: "yes"}}}}}}}}]
---
apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: required, namespace: {strict}}}
spec:
  failurePolicy: Fail
  match: {{kinds: [Pod]}}
  mutations: [{{merge: {{metadata: {{labels: {{strict: "yes"}}}}}}}}]
"#
    )
}

#[test]
fn with_initium_stopped_ignore_rules_let_pods_through_and_fail_rules_reject_them() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let mut initium = Initium::start(&unique("initium-e2e"), &own, &[]);
    let soft = namespace("soft");
    let strict = namespace("strict");
    apply(&optional_and_required_rules(&soft, &strict));
    eventually_blocking("both rules in effect", Duration::from_secs(5), || {
        is(
            [
                dry_run(&pod_yaml(&soft, "p"))["metadata"]["labels"]["soft"].clone(),
                dry_run(&pod_yaml(&strict, "p"))["metadata"]["labels"]["strict"].clone(),
            ],
            ["yes", "yes"],
        )
    });
    initium.stop();
    let started = Instant::now();
    let pod = create(&pod_yaml(&soft, "while-down"));
    let took = started.elapsed();
    assert!(
        pod["metadata"]["labels"].get("soft").is_none(),
        "created unmutated: {pod}"
    );
    let timeout = initium
        .webhook_configuration()
        .and_then(|c| c["webhooks"][0]["timeoutSeconds"].as_u64())
        .unwrap_or(10);
    assert!(
        took < Duration::from_secs(timeout + 2),
        "no hang past the webhook timeout ({timeout} s): took {took:?}"
    );
    let out = kubectl_stdin(&["create", "-f", "-"], &pod_yaml(&strict, "while-down"));
    assert!(
        !out.status.success(),
        "a Pod matching a Fail rule is rejected while initium is down"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("failed calling webhook"), "{stderr}");
}

/// How many times the API server has called each mutating webhook (its own
/// `apiserver_admission_webhook_request_total`, reinvocations included): (Fail, Ignore).
fn initium_webhook_calls() -> (f64, f64) {
    let metrics = ok(kubectl(&["get", "--raw", "/metrics"]), "get /metrics");
    let calls = |webhook: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with("apiserver_admission_webhook_request_total{"))
            .filter(|l| l.contains(&format!("name=\"{webhook}\"")) && l.contains("type=\"admit\""))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    // A tenant's Fail rule is taken by fail-labeled.initium.dev in its (labeled) namespace.
    (
        calls("fail.initium.dev") + calls("fail-labeled.initium.dev"),
        calls("ignore.initium.dev") + calls("ignore-labeled.initium.dev"),
    )
}

#[test]
fn each_pod_is_sent_to_initium_once_even_where_fail_and_ignore_rules_both_apply() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let _initium = Initium::start(&unique("initium-e2e"), &own, &[]);
    let soft = namespace("soft");
    let strict = namespace("strict");
    // An Ignore rule for Pods in every namespace beside the Fail rule in `strict`: both
    // webhooks cover Pod creation, and a Pod in `strict` matches rules of both kinds.
    apply(&optional_and_required_rules(&soft, &strict));
    apply(&format!(
        r#"apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {{name: everywhere-{soft}}}
spec:
  match: {{kinds: [Pod], namespaces: ["{soft}", "{strict}"]}}
  mutations: [{{merge: {{metadata: {{labels: {{everywhere: "yes"}}}}}}}}]
"#
    ));
    eventually_blocking("all three rules in effect", Duration::from_secs(10), || {
        let strict_pod = dry_run(&pod_yaml(&strict, "p"));
        is(
            [
                dry_run(&pod_yaml(&soft, "p"))["metadata"]["labels"]["soft"].clone(),
                strict_pod["metadata"]["labels"]["strict"].clone(),
                strict_pod["metadata"]["labels"]["everywhere"].clone(),
            ],
            ["yes", "yes", "yes"],
        )
    });
    let (fail_before, ignore_before) = initium_webhook_calls();
    let pod = create(&pod_yaml(&strict, "both-kinds"));
    let (fail_after, ignore_after) = initium_webhook_calls();
    assert_eq!(
        (fail_after - fail_before, ignore_after - ignore_before),
        (1.0, 0.0),
        "a Pod in {strict} goes to a Fail webhook once and never to an Ignore one"
    );
    assert_eq!(
        [
            &pod["metadata"]["labels"]["strict"],
            &pod["metadata"]["labels"]["everywhere"]
        ],
        ["yes", "yes"],
        "the one call applied the Fail rule and the Ignore rule: {pod}"
    );
    let pod = create(&pod_yaml(&soft, "ignore-only"));
    let (fail_last, ignore_last) = initium_webhook_calls();
    assert_eq!(
        (fail_last - fail_after, ignore_last - ignore_after),
        (0.0, 1.0),
        "a Pod in {soft} goes to an Ignore webhook once"
    );
    assert_eq!(pod["metadata"]["labels"]["soft"], "yes", "{pod}");
}

#[test]
fn a_tiny_budget_warns_for_ignore_rules_and_denies_for_fail_rules() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let _initium = Initium::start(&unique("initium-e2e"), &own, &["--budget", "0ms"]);
    let soft = namespace("soft");
    let strict = namespace("strict");
    apply(&optional_and_required_rules(&soft, &strict));
    let out = eventually_blocking("the budget warning", Duration::from_secs(5), || {
        let out = kubectl_stdin(
            &["create", "--dry-run=server", "-f", "-", "-o", "json"],
            &pod_yaml(&soft, "p"),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("latency budget") {
            Ok(out)
        } else {
            Err(format!("stderr: {stderr}"))
        }
    });
    assert!(out.status.success(), "an Ignore rule never stops the Pod");
    let stored = json(String::from_utf8_lossy(&out.stdout).into_owned());
    assert!(
        stored["metadata"]["labels"].get("soft").is_none(),
        "{stored}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Warning:")
            && stderr.contains(&format!("MutationRule {soft}/optional skipped")),
        "{stderr}"
    );
    let out = eventually_blocking("the budget denial", Duration::from_secs(5), || {
        let out = kubectl_stdin(
            &["create", "--dry-run=server", "-f", "-"],
            &pod_yaml(&strict, "p"),
        );
        if out.status.success() {
            Err("the Pod was admitted".into())
        } else {
            Ok(out)
        }
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("MutationRule {strict}/required (failurePolicy Fail) could not run: the latency budget ran out")), "{stderr}");
}

fn pod_review(namespace: &str) -> Value {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0d7c7b4e-6a4a-4f3e-9a55-1f3c2d1e0b9a",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "test"},
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "p-", "namespace": namespace},
                       "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]}},
            "dryRun": false
        }
    })
}

#[test]
fn two_replicas_both_serve_and_only_the_lease_holder_writes() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let name = unique("initium-e2e");
    let mut replicas = [
        Initium::start(&name, &own, &["--identity", "replica-a"]),
        Initium::start(&name, &own, &["--identity", "replica-b"]),
    ];
    let holder = || {
        let out = kubectl(&[
            "get",
            "lease",
            &name,
            "-n",
            &own,
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ]);
        let id = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && !id.is_empty() {
            Ok(id)
        } else {
            Err(format!(
                "no holder: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    };
    let leader = eventually_blocking("a lease holder", Duration::from_secs(20), holder);
    let leading = match leader.as_str() {
        "replica-a" => 0,
        "replica-b" => 1,
        other => panic!("unexpected lease holder {other}"),
    };
    for (i, replica) in replicas.iter().enumerate() {
        let (status, body) = replica.ops("/metrics");
        assert_eq!(status, 200);
        let leads = body
            .lines()
            .any(|l| l.starts_with("initium_leader ") && l.trim_end().ends_with(" 1"));
        assert_eq!(
            leads,
            i == leading,
            "initium_leader of replica {i}:\n{body}"
        );
    }
    // Only the leader writes the webhook configuration: it points at the leader's URL.
    let url = |replicas: &[Initium]| {
        replicas[0].webhook_configuration().and_then(|c| {
            c["webhooks"][0]["clientConfig"]["url"]
                .as_str()
                .map(String::from)
        })
    };
    let team = namespace("team");
    apply(&test_ca_rule(&team, "/etc/ssl/test"));
    eventually_blocking("the rule to be Ready", Duration::from_secs(5), || {
        is(
            ready_status("mr", Some(&team), "test-certs").as_deref(),
            Some("True"),
        )
    });
    let expected_url = format!(
        "https://127.0.0.1:{}/mutate",
        replicas[leading].webhook_port
    );
    eventually_blocking("the leader's webhook URL", Duration::from_secs(5), || {
        is(url(&replicas).as_deref(), Some(expected_url.as_str()))
    });
    // Both replicas serve admission with the same rules.
    for replica in &replicas {
        let response = eventually_blocking("a mutating answer", Duration::from_secs(5), || {
            let r = support::post_review(
                format!("127.0.0.1:{}", replica.webhook_port),
                &pod_review(&team),
            );
            if r["response"]["patch"].is_string() {
                Ok(r)
            } else {
                Err(r.to_string())
            }
        });
        assert_eq!(response["response"]["allowed"], true, "{response}");
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        url(&replicas).as_deref(),
        Some(expected_url.as_str()),
        "the other replica never rewrote the configuration"
    );

    // The leader stops: the other takes the lease and keeps writing status.
    replicas[leading].stop();
    let survivor = if leading == 0 {
        "replica-b"
    } else {
        "replica-a"
    };
    eventually_blocking(
        "the other replica to take the lease",
        Duration::from_secs(30),
        || is(holder()?, survivor),
    );
    apply(&format!(
        "apiVersion: initium.dev/v1alpha1\nkind: MutationRule\nmetadata: {{name: later, namespace: {team}}}\nspec:\n  match: {{kinds: [Pod]}}\n  mutations: [{{merge: {{metadata: {{labels: {{later: \"yes\"}}}}}}}}]\n"
    ));
    eventually_blocking(
        "the new leader to write status",
        Duration::from_secs(10),
        || {
            is(
                ready_status("mr", Some(&team), "later").as_deref(),
                Some("True"),
            )
        },
    );
}

/// What `initium serve` did with one of its ports taken by another process.
struct TakenPort {
    exited: Option<std::process::ExitStatus>,
    stderr: String,
    /// Whether `/readyz` ever answered 200 meanwhile.
    was_ready: bool,
}

/// Runs `initium serve` with `flag`'s port taken (the other one free) for at most 15 s.
fn serve_with_port_taken(flag: &str, own: &str, name: &str) -> (TakenPort, String) {
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").expect("a port to take");
    let taken = squatter.local_addr().expect("address").port();
    let (webhook_port, ops_port) = match flag {
        "--listen" => (taken, free_port()),
        _ => (free_port(), taken),
    };
    let listen = format!("127.0.0.1:{webhook_port}");
    let stderr_path =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{taken}.stderr"));
    let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
    let mut child = Command::new(env!("CARGO_BIN_EXE_initium"))
        .args(["serve", "--listen", &listen, "--webhook-url"])
        .arg(format!("https://{listen}"))
        .args(["--ops-listen", &format!("127.0.0.1:{ops_port}")])
        .args([
            "--namespace",
            own,
            "--webhook-name",
            name,
            "--lease-name",
            name,
        ])
        .env("KUBECONFIG", support::kubeconfig_path())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("initium serve starts");
    let started = Instant::now();
    let mut was_ready = false;
    let exited = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break Some(status);
        }
        if started.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        // With the webhook port taken, the ops port is initium's own: ask it.
        if flag == "--listen" && http_get(ops_port, "/readyz").0 == 200 {
            was_ready = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    drop(squatter);
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let _ = std::fs::remove_file(&stderr_path);
    let address = format!("127.0.0.1:{taken}");
    (
        TakenPort {
            exited,
            stderr,
            was_ready,
        },
        address,
    )
}

/// The objects serve would have written, by `kubectl get` argument, that exist.
fn installed(own: &str, name: &str) -> Vec<String> {
    [
        vec!["mutatingwebhookconfiguration", name],
        vec!["validatingwebhookconfiguration", name],
        vec!["secret", "initium-tls", "-n", own],
        vec!["lease", name, "-n", own],
    ]
    .into_iter()
    .filter(|args| {
        kubectl(&[&["get"], args.as_slice()].concat())
            .status
            .success()
    })
    .map(|args| args.join(" "))
    .collect()
}

#[test]
fn a_taken_port_stops_serve_at_once_and_nothing_is_installed() {
    let _serial = serial_blocking();
    install_crds();
    let own = namespace("initium-own");
    for flag in ["--listen", "--ops-listen"] {
        let name = unique("initium-taken");
        let started = Instant::now();
        let (run, address) = serve_with_port_taken(flag, &own, &name);
        let took = started.elapsed();
        let installed = installed(&own, &name);
        let _ = kubectl(&[
            "delete",
            "mutatingwebhookconfiguration",
            &name,
            "--ignore-not-found",
        ]);
        let _ = kubectl(&[
            "delete",
            "validatingwebhookconfiguration",
            &name,
            "--ignore-not-found",
        ]);
        let status = run.exited.unwrap_or_else(|| {
            panic!(
                "{flag} taken: serve kept running for 15 s (/readyz answered 200: {}; installed: \
                 {installed:?})\n{}",
                run.was_ready, run.stderr
            )
        });
        assert!(
            !status.success(),
            "{flag} taken: exit {status}\n{}",
            run.stderr
        );
        assert!(
            took < Duration::from_secs(5),
            "{flag} taken: exited after {took:?}"
        );
        let last = run.stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: cannot listen on")
                && last.contains(&address)
                && last.contains(flag)
                && last.contains("another process uses this port"),
            "{flag} taken: the last line names the flag and the address: {last:?}\n{}",
            run.stderr
        );
        assert!(!run.was_ready, "{flag} taken: /readyz answered 200");
        assert!(
            installed.is_empty(),
            "{flag} taken: installed {installed:?}"
        );
    }
    let _ = kubectl(&["delete", "namespace", &own, "--wait=false"]);
}

#[test]
fn an_audit_rule_changes_no_pod_and_reports_to_the_client_the_metrics_and_events() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let initium = Initium::start(&unique("audit"), &own, &["--audit-report-interval", "1s"]);
    let shop = namespace("shop");
    apply(&format!(
        "apiVersion: initium.dev/v1alpha1\nkind: MutationRule\nmetadata: {{name: audited, namespace: {shop}}}\nspec:\n  mode: Audit\n  match: {{kinds: [Pod]}}\n  mutations:\n  - merge: {{metadata: {{labels: {{team: shop}}}}}}\n  - upsert: {{path: /spec/volumes, key: name, value: {{name: ca, emptyDir: {{}}}}}}\n"
    ));
    eventually_blocking(
        "the Audit rule to be Ready",
        Duration::from_secs(10),
        || {
            is(
                ready_status("mr", Some(&shop), "audited").as_deref(),
                Some("True"),
            )
        },
    );
    let listed = ok(kubectl(&["get", "mr", "audited", "-n", &shop]), "get mr");
    assert!(
        listed.contains("MODE") && listed.contains("Audit"),
        "{listed}"
    );

    // The client is told what the rule would do; the Pod is stored as written.
    let out = kubectl_stdin(
        &["create", "-f", "-", "-o", "json"],
        &pod_yaml(&shop, "web"),
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let pod = json(ok(out, "create Pod"));
    assert!(
        stderr.contains(&format!(
            "audit: MutationRule {shop}/audited would change the object: add /metadata/labels, add /spec/volumes"
        )),
        "kubectl's warnings: {stderr}"
    );
    assert!(pod["metadata"].get("labels").is_none(), "{pod}");
    assert!(pod["spec"].get("volumes").is_none(), "{pod}");
    assert!(
        pod["metadata"]
            .get("annotations")
            .and_then(|a| a.get("initium.dev/mutated-by"))
            .is_none(),
        "{pod}"
    );

    // A dry run is told too, but not counted: the metric counts real requests.
    let dry = kubectl_stdin(
        &["create", "--dry-run=server", "-f", "-", "-o", "json"],
        &pod_yaml(&shop, "dry"),
    );
    assert!(
        String::from_utf8_lossy(&dry.stderr).contains("would change the object"),
        "{}",
        String::from_utf8_lossy(&dry.stderr)
    );
    let series = format!("initium_rule_audit_changes_total{{rule=\"{shop}/audited\"}} 1");
    eventually_blocking("the audit metric", Duration::from_secs(10), || {
        let (_, metrics) = initium.ops("/metrics");
        if metrics.contains(&series) {
            Ok(())
        } else {
            Err(metrics
                .lines()
                .filter(|l| l.contains("audit"))
                .collect::<Vec<_>>()
                .join("\n"))
        }
    });

    // Within the report interval, one Event on the rule sums it up.
    eventually_blocking(
        "an AuditWouldChange Event on the rule",
        Duration::from_secs(20),
        || {
            let events = json(ok(
                kubectl(&[
                    "get",
                    "events.events.k8s.io",
                    "-n",
                    &shop,
                    "--field-selector",
                    "reason=AuditWouldChange",
                    "-o",
                    "json",
                ]),
                "get events",
            ));
            let found = events["items"].as_array().into_iter().flatten().find(|e| {
                e["regarding"]["kind"] == "MutationRule" && e["regarding"]["name"] == "audited"
            });
            match found {
                Some(e) => {
                    let note = e["note"].as_str().unwrap_or_default();
                    assert!(
                        note.contains("would have changed 1 object(s)")
                            && note.contains(&format!("Pod {shop}/web")),
                        "{note}"
                    );
                    assert!(
                        e["regarding"]["uid"]
                            .as_str()
                            .is_some_and(|u| !u.is_empty()),
                        "{e}"
                    );
                    Ok(())
                }
                None => Err(format!("{events}")),
            }
        },
    );
}

/// Issue 30, finding 10 (c): Audit Events were bounded per rule, so many Audit rules in one
/// namespace wrote as many Events there each interval. With 12 Audit rules and
/// `--max-audit-events-per-namespace 4`, one Pod gives the namespace 4 Events: 3 rules' and
/// one that sums up the other 9.
#[test]
fn audit_events_are_bounded_per_namespace_on_a_real_api_server() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let _initium = Initium::start(
        &unique("audit-bound"),
        &own,
        &[
            "--audit-report-interval",
            "1s",
            "--max-audit-events-per-namespace",
            "4",
        ],
    );
    let shop = namespace("shop");
    for i in 0..12 {
        apply(&format!(
            "apiVersion: initium.dev/v1alpha1\nkind: MutationRule\nmetadata: {{name: audit-{i:02}, namespace: {shop}}}\nspec:\n  mode: Audit\n  match: {{kinds: [Pod]}}\n  mutations:\n  - merge: {{metadata: {{labels: {{rule{i}: x}}}}}}\n"
        ));
    }
    eventually_blocking(
        "the 12 Audit rules to be Ready",
        Duration::from_secs(20),
        || {
            let ready = (0..12)
                .filter(|i| {
                    ready_status("mr", Some(&shop), &format!("audit-{i:02}")).as_deref()
                        == Some("True")
                })
                .count();
            if ready == 12 {
                Ok(())
            } else {
                Err(format!("{ready} of 12 Ready"))
            }
        },
    );
    ok(
        kubectl_stdin(&["create", "-f", "-"], &pod_yaml(&shop, "web")),
        "create Pod",
    );
    let events = || {
        let events = json(ok(
            kubectl(&["get", "events.events.k8s.io", "-n", &shop, "-o", "json"]),
            "get events",
        ));
        events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["regarding"]["kind"] == "MutationRule")
            .cloned()
            .collect::<Vec<Value>>()
    };
    eventually_blocking("the summary Event", Duration::from_secs(20), || {
        let found = events();
        if found.iter().any(|e| e["reason"] == "AuditEventsSummarized") {
            Ok(())
        } else {
            Err(format!("{found:?}"))
        }
    });
    // Another interval passes: no more Events come (nothing new was admitted).
    std::thread::sleep(Duration::from_secs(3));
    let found = events();
    let reasons: Vec<&str> = found.iter().filter_map(|e| e["reason"].as_str()).collect();
    assert_eq!(found.len(), 4, "{reasons:?}");
    assert_eq!(
        reasons.iter().filter(|r| **r == "AuditWouldChange").count(),
        3,
        "{reasons:?}"
    );
    let summary = found
        .iter()
        .find(|e| e["reason"] == "AuditEventsSummarized")
        .and_then(|e| e["note"].as_str())
        .unwrap_or_default();
    assert!(
        summary.contains(&format!("9 more Audit rule(s) of namespace {shop}"))
            && summary.contains("--max-audit-events-per-namespace"),
        "{summary}"
    );
}

/// Issue 30, findings 8 and 9, on a real API server: a tenant's text reaches people through
/// initium's log, Audit Events and `kubectl describe` escaped and capped. Twenty rules call
/// `image()` on a 60 KB annotation full of terminal escapes (before: 48 MB of log from five
/// creates, Debug-escaped whole); a Pod named with an escape sequence and a bidirectional
/// override is seen at mutating admission (the API server validates the name after it) by a
/// platform Audit rule, whose Event and `describe` would otherwise carry it raw.
#[test]
fn a_tenants_text_reaches_logs_events_and_describe_escaped_and_capped() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let initium = Initium::start(&unique("text"), &own, &["--audit-report-interval", "1s"]);
    let shop = namespace("shop");
    let watcher = unique("watch-shop");
    let mut rules = String::new();
    for i in 0..20 {
        rules.push_str(&format!(
            "apiVersion: initium.dev/v1alpha1\nkind: MutationRule\nmetadata: {{name: img-{i}, namespace: {shop}}}\nspec:\n  match: {{kinds: [Pod]}}\n  mutations:\n  - patch: [{{op: add, path: /metadata/labels/tag, value: '{{{{ image($.metadata.annotations.blob).tag }}}}'}}]\n---\n"
        ));
    }
    rules.push_str(&format!(
        "apiVersion: initium.dev/v1alpha1\nkind: ClusterMutationRule\nmetadata: {{name: {watcher}}}\nspec:\n  mode: Audit\n  match: {{kinds: [Pod], namespaces: [{shop}]}}\n  mutations:\n  - merge: {{metadata: {{labels: {{seen: 'yes'}}}}}}\n"
    ));
    apply(&rules);
    eventually_blocking("the rules to be Ready", Duration::from_secs(30), || {
        let mut not_ready: Vec<String> = (0..20)
            .map(|i| format!("img-{i}"))
            .filter(|r| ready_status("mr", Some(&shop), r).as_deref() != Some("True"))
            .collect();
        if ready_status("cmr", None, &watcher).as_deref() != Some("True") {
            not_ready.push(watcher.clone());
        }
        if not_ready.is_empty() {
            Ok(())
        } else {
            Err(format!("not Ready: {not_ready:?}"))
        }
    });

    // Five creates of a Pod whose 60 KB annotation image() cannot read.
    let blob = format!("\u{1b}[31m\u{202e}{}", "A".repeat(60_000));
    let log = initium.log_path();
    let before = std::fs::metadata(&log).map_or(0, |m| m.len());
    for n in 0..5 {
        let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("blob-{n}"), "namespace": shop,
                         "annotations": {"blob": blob}},
            "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]}});
        ok(
            kubectl_stdin(&["create", "-f", "-"], &pod.to_string()),
            "create a Pod with a 60 KB annotation",
        );
    }
    // A name no Pod may have, seen at mutating admission before the API server refuses it; in
    // an audit interval of its own, so that the rule's Event names it first.
    std::thread::sleep(Duration::from_secs(3));
    let evil = "evil\u{1b}[2J\u{202e}x";
    let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": evil, "namespace": shop},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]}});
    let refused = kubectl_stdin(&["create", "-f", "-"], &pod.to_string());
    assert!(
        !refused.status.success(),
        "the API server took the name {evil:?}"
    );

    // The Audit Event names the object, escaped.
    let note = {
        let mut found = String::new();
        eventually_blocking(
            "the Audit Event of the bad name",
            Duration::from_secs(30),
            || {
                let events = json(ok(
                    kubectl(&[
                        "get",
                        "events.events.k8s.io",
                        "-A",
                        "--field-selector",
                        "reason=AuditWouldChange",
                        "-o",
                        "json",
                    ]),
                    "get events",
                ));
                let notes: Vec<String> = events["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|e| e["regarding"]["name"] == watcher.as_str())
                    .filter_map(|e| e["note"].as_str().map(String::from))
                    .collect();
                match notes.iter().find(|n| n.contains("evil")) {
                    Some(n) => {
                        found = n.clone();
                        Ok(())
                    }
                    None => Err(format!("notes: {notes:?}")),
                }
            },
        );
        found
    };
    assert!(note.contains("evil\\u{1b}[2J\\u{202e}x"), "{note}");
    let described = ok(kubectl(&["describe", "cmr", &watcher]), "describe cmr");
    for (what, text) in [
        ("the Event", note.as_str()),
        ("kubectl describe", described.as_str()),
    ] {
        assert!(
            !text.contains(['\u{1b}', '\u{202e}']),
            "{what} carries the tenant's escapes raw: {text:?}"
        );
    }

    let text = std::fs::read(&log).expect("serve's log");
    let grown = text.len() as u64 - before;
    eprintln!(
        "serve: 20 image() rules x 5 creates of a 60 KB annotation, and one bad name: {grown} bytes of log; the Event: {note}"
    );
    assert!(
        grown < 1 << 20,
        "{grown} bytes of log from five creates (before: 48 MB)"
    );
    let raw = String::from_utf8_lossy(&text);
    assert!(
        !raw.contains(['\u{1b}', '\u{202e}']),
        "serve's log carries a tenant's escapes raw"
    );
    let _ = kubectl(&["delete", "cmr", &watcher, "--wait=false"]);
    let _ = kubectl(&["delete", "namespace", &shop, &own, "--wait=false"]);
}

#[test]
fn explain_cluster_reads_the_rules_and_namespace_labels_of_the_cluster() {
    let _serial = serial_blocking();
    install_crds();
    clean_cluster();
    let own = namespace("initium-own");
    let _initium = Initium::start(&unique("explain"), &own, &[]);
    let team = namespace("team");
    ok(
        kubectl(&["label", "namespace", &team, "env=prod"]),
        "label namespace",
    );
    apply(
        "apiVersion: initium.dev/v1alpha1\nkind: ClusterMutationRule\nmetadata: {name: prod-only}\nspec:\n  match: {kinds: [Pod], namespaceSelector: {matchLabels: {env: prod}}}\n  mutations: [{merge: {metadata: {labels: {tier: prod}}}}]\n---\napiVersion: initium.dev/v1alpha1\nkind: ClusterMutationRule\nmetadata: {name: staging-only}\nspec:\n  match: {kinds: [Pod], namespaceSelector: {matchLabels: {env: staging}}}\n  mutations: [{merge: {metadata: {labels: {tier: staging}}}}]\n---\napiVersion: initium.dev/v1alpha1\nkind: ClusterMutationRule\nmetadata: {name: unserved}\nspec:\n  match: {kinds: [example.com/v1/Widget]}\n  mutations: [{merge: {metadata: {labels: {a: b}}}}]\n",
    );
    eventually_blocking("the rules' status", Duration::from_secs(20), || {
        is(
            (
                ready_status("cmr", None, "prod-only").as_deref(),
                ready_status("cmr", None, "unserved").as_deref(),
            ),
            (Some("True"), Some("False")),
        )
    });
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{}.yaml", unique("explain-pod")));
    std::fs::write(&file, pod_yaml(&team, "web")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_initium"))
        .args(["explain", "--cluster", "-f"])
        .arg(&file)
        .env("KUBECONFIG", support::kubeconfig_path())
        .output()
        .expect("initium explain runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Only the cluster knows the namespace's labels: the selector decides with them.
    assert!(
        stdout.contains("ClusterMutationRule prod-only (priority 100): changed the object:"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "ClusterMutationRule staging-only (priority 100): not matched: spec.match.namespaceSelector does not hold"
        ),
        "{stdout}"
    );
    assert!(
        stderr.contains("note: ClusterMutationRule unserved is not Ready in the cluster"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(&file);
    let _ = kubectl(&["delete", "cmr", "prod-only", "staging-only", "unserved"]);
}
