//! initium as its users run it: its own image (scripts/image) on a node whose kubelet runs
//! real containers (`scripts/control-plane up --real-node`: containerd, runc, the CNI bridge),
//! installed by Helm and by `kubectl apply -k`, reached by the API server through its
//! Service. What a user's first hour proves, proven here:
//!
//! - both replicas Running and Ready (the probes pass), and a rule applied with kubectl
//!   mutates a Pod through the Service;
//! - the used-by scenario: a namespace's CA Secret mounted by a rule into every container of
//!   a Deployment, read by its init container and its main container;
//! - continuity: Pods created steadily under a `Fail` rule while `helm upgrade` rolls initium
//!   and its Pods are evicted one at a time: none refused, none stored unmutated; initium's
//!   memory and CPU from the kubelet's own stats meanwhile;
//! - no lock-out: every initium Pod deleted under a cluster-wide `Fail` rule, and initium
//!   scaled to 0;
//! - a gate released by a real backend Pod's readiness probe.
//!
//! The tests share one plane and one release and run one at a time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::cluster::unique;
use support::plane::{Plane, root};
use support::wait::within;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/helm/initium");
const NS: &str = "initium-system";
const SELECTOR: &str = "app.kubernetes.io/name=initium";

/// The plane with a real node, started once for this test binary (it stops by itself when
/// the binary exits), with initium:dev and toolbox:dev imported by scripts/image.
fn plane() -> &'static Plane {
    static PLANE: OnceLock<Plane> = OnceLock::new();
    PLANE.get_or_init(|| {
        let tmp = option_env!("CARGO_TARGET_TMPDIR").map_or_else(std::env::temp_dir, PathBuf::from);
        let dir = tmp.join(format!("realnode-{}", std::process::id()));
        let plane = Plane::start_real_node(dir).unwrap_or_else(|e| panic!("{e:#}"));
        let status = Command::new(root().join("scripts/image"))
            .arg("--dir")
            .arg(plane.dir().expect("a plane of our own"))
            .stdout(Stdio::null())
            .status()
            .expect("scripts/image runs");
        assert!(status.success(), "scripts/image failed ({status})");
        plane
    })
}

/// One test at a time: they share the release.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `kubectl ARGS` with `stdin`: (succeeded, stdout, stderr).
fn kubectl_with(args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    let output = match stdin {
        Some(input) => plane().kubectl_stdin(args, input).expect("kubectl runs"),
        None => plane().kubectl().args(args).output().expect("kubectl runs"),
    };
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `kubectl ARGS`, which must succeed: its stdout.
fn k(args: &[&str]) -> String {
    let (ok, out, err) = kubectl_with(args, None);
    assert!(ok, "kubectl {}: {err}", args.join(" "));
    out
}

fn json(args: &[&str]) -> Value {
    let mut full = args.to_vec();
    full.extend(["-o", "json"]);
    serde_json::from_str(&k(&full)).unwrap()
}

fn apply(yaml: &str) {
    plane().apply(yaml).unwrap_or_else(|e| panic!("{e:#}"));
}

/// `helm ARGS` against the plane: (succeeded, stdout + stderr).
fn helm(args: &[&str]) -> (bool, String) {
    let output = support::plane::helm()
        .arg("--kubeconfig")
        .arg(&plane().kubeconfig)
        .args(args)
        .output()
        .expect("helm runs");
    (
        output.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

/// The values every install here uses: the image scripts/image imported.
const IMAGE: [&str; 6] = [
    "--set",
    "image.repository=initium",
    "--set",
    "image.tag=dev",
    "--set",
    "image.pullPolicy=Never",
];

/// `helm upgrade --install` of the chart with the local image and `extra` values; returns
/// once the Deployment's replicas are all updated and Ready (`--wait`), and how long it took.
fn install(extra: &[&str]) -> Duration {
    let started = Instant::now();
    let mut args = vec![
        "upgrade",
        "--install",
        "initium",
        CHART,
        "--namespace",
        NS,
        "--create-namespace",
        "--wait",
        "--timeout",
        "300s",
    ];
    args.extend(IMAGE);
    args.extend(extra);
    let (ok, out) = helm(&args);
    assert!(ok, "helm {}: {out}", args.join(" "));
    wait_replicas_ready(2);
    started.elapsed()
}

/// The Deployment has `n` updated, Ready replicas, and no other initium Pod exists.
fn wait_replicas_ready(n: usize) {
    let ready = within(Duration::from_secs(180), Duration::from_millis(500), || {
        let pods = json(&["get", "pods", "-n", NS, "-l", SELECTOR]);
        let items = pods["items"].as_array().cloned().unwrap_or_default();
        items.len() == n
            && items.iter().all(|pod| {
                pod["metadata"]["deletionTimestamp"].is_null()
                    && pod["status"]["conditions"].as_array().is_some_and(|c| {
                        c.iter()
                            .any(|c| c["type"] == "Ready" && c["status"] == "True")
                    })
            })
    });
    assert!(
        ready,
        "initium did not settle on {n} Ready Pods: {}",
        k(&["get", "pods", "-n", NS, "-o", "wide"])
    );
}

fn initium_pods() -> Vec<String> {
    k(&["get", "pods", "-n", NS, "-l", SELECTOR, "-o", "name"])
        .lines()
        .map(|l| l.trim_start_matches("pod/").to_owned())
        .collect()
}

fn namespace(prefix: &str) -> String {
    let ns = unique(prefix);
    k(&["create", "namespace", &ns]);
    ns
}

/// Waits until the rule is Ready (compiled, and the webhook configuration initium stored
/// sends its kinds to initium).
fn wait_rule_ready(kind: &str, name: &str, ns: Option<&str>) {
    let mut args = vec!["wait", "--for=condition=Ready", "--timeout=90s"];
    let object = format!("{kind}/{name}");
    args.push(&object);
    if let Some(ns) = ns {
        args.extend(["-n", ns]);
    }
    k(&args);
}

/// A Pod held by a scheduling gate nobody lifts: admitted (and mutated) like any Pod, never
/// started, so creating hundreds costs the node nothing.
fn held_pod(ns: &str, name: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  schedulingGates: [{{name: example.com/never}}]
  containers: [{{name: c, image: toolbox:dev, imagePullPolicy: Never, command: [sleep, '1']}}]
"
    )
}

#[test]
fn helm_install_gives_two_ready_replicas_and_a_running_container_reads_the_injected_ca() {
    let _serial = serial();
    let took = install(&[]);
    eprintln!("helm install (or upgrade) to 2 Ready replicas: {took:?}");
    // Both Pods run the image on the real node, with no restart: the probes pass.
    let pods = json(&["get", "pods", "-n", NS, "-l", SELECTOR]);
    for pod in pods["items"].as_array().unwrap() {
        assert_eq!(pod["spec"]["nodeName"], "initium-node");
        let status = &pod["status"]["containerStatuses"][0];
        assert_eq!(status["ready"], true, "{status}");
        assert_eq!(status["restartCount"], 0, "{status}");
        assert!(
            status["image"]
                .as_str()
                .unwrap_or_default()
                .ends_with("initium:dev"),
            "{status}"
        );
    }

    // The used-by scenario: examples/test-ca, as shipped, in a namespace of its own.
    let ns = namespace("payments");
    let ca = format!("-----BEGIN CERTIFICATE-----\ntest CA of {ns}\n-----END CERTIFICATE-----\n");
    apply(&format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: test-ca, namespace: {ns}}}\nstringData:\n  ca.crt: |\n{}",
        ca.lines().map(|l| format!("    {l}\n")).collect::<String>()
    ));
    let rules = std::fs::read_to_string(root().join("examples/test-ca/rules.yaml")).unwrap();
    apply(&rules.replace("namespace: payments", &format!("namespace: {ns}")));
    wait_rule_ready("mutationrule", "test-certs", Some(&ns));
    apply(&format!(
        "apiVersion: apps/v1
kind: Deployment
metadata: {{name: reader, namespace: {ns}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: reader}}}}
  template:
    metadata: {{labels: {{app: reader}}}}
    spec:
      initContainers:
        - {{name: init, image: toolbox:dev, imagePullPolicy: Never, command: [cat, /etc/ssl/test/ca.crt]}}
      containers:
        - {{name: main, image: toolbox:dev, imagePullPolicy: Never, command: [sh, -c, 'cat /etc/ssl/test/ca.crt; exec sleep 3600']}}
"
    ));
    let running = within(Duration::from_secs(120), Duration::from_millis(500), || {
        k(&[
            "get",
            "pods",
            "-n",
            &ns,
            "-l",
            "app=reader",
            "-o",
            "jsonpath={.items[*].status.phase}",
        ]) == "Running"
    });
    assert!(
        running,
        "the reader Pod did not run: {}",
        k(&["describe", "pods", "-n", &ns, "-l", "app=reader"])
    );
    let pod = json(&["get", "pods", "-n", &ns, "-l", "app=reader"])["items"][0].clone();
    let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
    assert_eq!(pod["metadata"]["labels"]["certs"], "injected", "{pod}");
    for container in ["init", "main"] {
        let logs = k(&["logs", "-n", &ns, &name, "-c", container]);
        assert_eq!(
            logs, ca,
            "what container {container} read from the mounted Secret"
        );
    }
    k(&["delete", "namespace", &ns, "--wait=false"]);
}

#[test]
fn kubectl_apply_k_with_the_image_set_runs_the_same() {
    let _serial = serial();
    let _ = plane();
    // The release goes first: the same objects, another owner.
    let (_, _) = helm(&["uninstall", "initium", "--namespace", NS, "--wait"]);
    wait_gone();
    let overlay = tempdir("kustomize");
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [{deploy}]
images:
  - {{name: ghcr.io/initium-dev/initium, newName: initium, newTag: dev}}
patches:
  - target: {{kind: Deployment, name: initium}}
    patch: '[{{\"op\": \"add\", \"path\": \"/spec/template/spec/containers/0/imagePullPolicy\", \"value\": \"Never\"}}]'
",
            deploy = relative(&overlay, &root().join("deploy"))
        ),
    )
    .unwrap();
    let overlay_arg = overlay.display().to_string();
    k(&["apply", "--server-side", "-k", &overlay_arg]);
    wait_replicas_ready(2);
    // A rule applied with kubectl mutates a Pod through the Service.
    let ns = namespace("kustomized");
    apply(&format!(
        "apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: label, namespace: {ns}}}
spec:
  failurePolicy: Fail
  match: {{kinds: [Pod], operations: [CREATE]}}
  mutations:
    - merge: {{metadata: {{labels: {{installed-by: kustomize}}}}}}
"
    ));
    wait_rule_ready("mutationrule", "label", Some(&ns));
    let (ok, _, err) = kubectl_with(&["apply", "-f", "-"], Some(&held_pod(&ns, "p")));
    assert!(ok, "{err}");
    assert_eq!(
        k(&[
            "get",
            "pod",
            "p",
            "-n",
            &ns,
            "-o",
            "jsonpath={.metadata.labels.installed-by}"
        ]),
        "kustomize"
    );
    k(&["delete", "namespace", &ns, "--wait=false"]);
    k(&[
        "delete",
        "-k",
        &overlay_arg,
        "--wait=true",
        "--ignore-not-found",
    ]);
    wait_gone();
    let _ = std::fs::remove_dir_all(&overlay);
}

/// TO as a path relative to FROM (kustomize refuses absolute paths to a base).
fn relative(from: &std::path::Path, to: &std::path::Path) -> String {
    let from: Vec<_> = from.components().collect();
    let to: Vec<_> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut parts: Vec<String> = vec!["..".to_owned(); from.len() - common];
    parts.extend(
        to[common..]
            .iter()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
    );
    parts.join("/")
}

/// No initium Pod and no webhook configuration left (initium writes its configurations; an
/// uninstall leaves them, and they would send requests to nobody).
fn wait_gone() {
    let gone = within(Duration::from_secs(120), Duration::from_millis(500), || {
        initium_pods().is_empty()
    });
    assert!(
        gone,
        "initium's Pods did not go: {}",
        k(&["get", "pods", "-n", NS])
    );
    for kind in [
        "mutatingwebhookconfiguration",
        "validatingwebhookconfiguration",
    ] {
        k(&["delete", kind, "initium", "--ignore-not-found"]);
    }
}

fn tempdir(name: &str) -> PathBuf {
    let tmp = option_env!("CARGO_TARGET_TMPDIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let dir = tmp.join(format!("{}-{}", unique(name), std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What the client saw of one create.
struct Create {
    name: String,
    ok: bool,
    took: Duration,
    error: String,
}

/// Creates held Pods one after another until `stop`, each by `kubectl create` (a new
/// connection each time, as a CI job's kubectl does).
fn steady_creates(
    ns: String,
    client: &'static str,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<Create>> {
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut i = 0;
        while !stop.load(Ordering::Relaxed) {
            i += 1;
            let name = format!("{client}-{i}");
            let started = Instant::now();
            let (ok, _, err) = kubectl_with(&["create", "-f", "-"], Some(&held_pod(&ns, &name)));
            seen.push(Create {
                name,
                ok,
                took: started.elapsed(),
                error: err,
            });
            std::thread::sleep(Duration::from_millis(50));
        }
        seen
    })
}

/// initium's containers' memory (working set, bytes) and CPU (nanocores) from the kubelet's
/// summary API, through the API server.
fn initium_usage() -> Vec<(u64, u64)> {
    let (ok, out, _) = kubectl_with(
        &[
            "get",
            "--raw",
            "/api/v1/nodes/initium-node/proxy/stats/summary",
        ],
        None,
    );
    if !ok {
        return Vec::new();
    }
    let summary: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
    summary["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|pod| pod["podRef"]["namespace"] == NS)
        .flat_map(|pod| pod["containers"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["name"] == "initium")
        .filter_map(|c| {
            Some((
                c["memory"]["workingSetBytes"].as_u64()?,
                c["cpu"]["usageNanoCores"].as_u64().unwrap_or(0),
            ))
        })
        .collect()
}

/// From the API server's own metrics: calls to `fail-labeled.initium.dev` (the tenant's Fail
/// rule, in its labeled namespace) that did not answer 200,
/// and admissions it rejected because calling the webhook failed.
fn webhook_failures() -> (f64, f64) {
    let metrics = k(&["get", "--raw", "/metrics"]);
    let sum = |prefix: &str, keep: &dyn Fn(&str) -> bool| -> f64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with(prefix) && l.contains(r#"name="fail-labeled.initium.dev""#) && keep(l)
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (
        sum("apiserver_admission_webhook_request_total{", &|l| {
            !l.contains(r#"code="200""#)
        }),
        sum("apiserver_admission_webhook_rejection_count{", &|l| {
            l.contains("calling_webhook_error")
        }),
    )
}

/// Evicts POD through the eviction API, retrying while the PodDisruptionBudget refuses (429).
fn evict(pod: &str) {
    let body = format!(
        r#"{{"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {{"name": "{pod}", "namespace": "{NS}"}}}}"#
    );
    let path = format!("/api/v1/namespaces/{NS}/pods/{pod}/eviction");
    let evicted = within(Duration::from_secs(120), Duration::from_secs(1), || {
        kubectl_with(&["create", "--raw", &path, "-f", "-"], Some(&body)).0
    });
    assert!(evicted, "the eviction of {pod} was refused for 2 minutes");
}

#[test]
fn pods_created_during_an_upgrade_and_evictions_are_all_admitted_and_mutated() {
    let _serial = serial();
    install(&[]);
    let ns = namespace("steady");
    apply(&format!(
        "apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: stamp, namespace: {ns}}}
spec:
  failurePolicy: Fail
  match: {{kinds: [Pod], operations: [CREATE]}}
  mutations:
    - merge: {{metadata: {{labels: {{stamped: 'yes'}}}}}}
"
    ));
    wait_rule_ready("mutationrule", "stamp", Some(&ns));

    let failures_before = webhook_failures();
    let stop = Arc::new(AtomicBool::new(false));
    // Two clients, each creating one Pod after another.
    let clients = [
        steady_creates(ns.clone(), "a", stop.clone()),
        steady_creates(ns.clone(), "b", stop.clone()),
    ];
    let usage = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                samples.extend(initium_usage());
                std::thread::sleep(Duration::from_secs(2));
            }
            samples
        })
    };
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(5));
    // A rolling update: a changed value changes the Pod template.
    let rolled = unique("roll");
    let took = install(&["--set", &format!("podAnnotations.rolled={rolled}")]);
    eprintln!("helm upgrade rolled initium in {took:?}");
    std::thread::sleep(Duration::from_secs(5));
    for pod in initium_pods() {
        let evicted_at = Instant::now();
        evict(&pod);
        let replaced = within(Duration::from_secs(120), Duration::from_millis(500), || {
            !initium_pods().contains(&pod)
        });
        assert!(replaced, "{pod} did not go after its eviction");
        wait_replicas_ready(2);
        eprintln!(
            "evicted {pod}; 2 Ready again after {:?}",
            evicted_at.elapsed()
        );
        std::thread::sleep(Duration::from_secs(3));
    }
    stop.store(true, Ordering::Relaxed);
    let creates: Vec<Create> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    let failures_after = webhook_failures();
    let failed_calls = failures_after.0 - failures_before.0;
    let rejections = failures_after.1 - failures_before.1;
    let samples = usage.join().unwrap();
    let window = started.elapsed();

    let refused: Vec<&Create> = creates.iter().filter(|c| !c.ok).collect();
    let stamped = k(&[
        "get",
        "pods",
        "-n",
        &ns,
        "-o",
        r#"jsonpath={range .items[*]}{.metadata.name}={.metadata.labels.stamped}{"\n"}{end}"#,
    ]);
    let unmutated: Vec<&str> = stamped
        .lines()
        .filter(|line| !line.ends_with("=yes"))
        .collect();
    let slowest = creates.iter().map(|c| c.took).max().unwrap_or_default();
    let max_memory = samples.iter().map(|s| s.0).max().unwrap_or(0);
    let max_cpu = samples.iter().map(|s| s.1).max().unwrap_or(0);
    eprintln!(
        "continuity over {window:?}: {} creates, {} refused, {} unmutated, slowest create {slowest:?}; the API server's calls to fail-labeled.initium.dev not answered 200: {failed_calls}, rejections for a failed call: {rejections}; initium container (kubelet summary, {} samples): memory working set max {:.1} MiB, CPU max {} millicores",
        creates.len(),
        refused.len(),
        unmutated.len(),
        samples.len(),
        max_memory as f64 / 1048576.0,
        max_cpu / 1_000_000,
    );
    assert!(
        creates.len() >= 30,
        "too few creates to tell: {}",
        creates.len()
    );
    assert!(
        refused.is_empty(),
        "creates refused during the upgrade and evictions: {}",
        refused
            .iter()
            .map(|c| format!("{}: {}", c.name, c.error.trim()))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        unmutated.is_empty(),
        "Pods stored without the rule's label: {unmutated:?}"
    );
    // The kubelet's own stats saw initium's container, below the chart's memory limit.
    assert!(
        !samples.is_empty(),
        "the kubelet's summary API showed no initium container"
    );
    let limit = 256 * 1024 * 1024;
    assert!(
        max_memory < limit,
        "initium's working set {max_memory} B reached the limit"
    );
    // The dashboard's Resources panels read the kubelet's cAdvisor metrics: this kubelet
    // exports each of them for initium's container.
    let dashboard =
        std::fs::read_to_string(root().join("deploy/monitoring/grafana-dashboard.json")).unwrap();
    let cadvisor = k(&[
        "get",
        "--raw",
        "/api/v1/nodes/initium-node/proxy/metrics/cadvisor",
    ]);
    let mut used: Vec<&str> = dashboard
        .match_indices("container_")
        .map(|(at, _)| {
            let rest = &dashboard[at..];
            &rest[..rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len())]
        })
        .collect();
    used.sort_unstable();
    used.dedup();
    assert!(used.len() >= 2, "the dashboard's kubelet metrics: {used:?}");
    for metric in used {
        assert!(
            cadvisor
                .lines()
                .any(|l| l.starts_with(&format!("{metric}{{"))
                    && l.contains(r#"container="initium""#)),
            "the kubelet exports no {metric} for initium's container"
        );
    }
    k(&["delete", "namespace", &ns, "--wait=false"]);
}

#[test]
fn no_lock_out_when_every_initium_pod_goes_or_initium_is_scaled_to_zero() {
    let _serial = serial();
    install(&[]);
    let rule = unique("everywhere");
    apply(&format!(
        "apiVersion: initium.dev/v1alpha1
kind: ClusterMutationRule
metadata: {{name: {rule}}}
spec:
  failurePolicy: Fail
  match: {{kinds: [Pod], operations: [CREATE]}}
  mutations:
    - merge: {{metadata: {{labels: {{seen-by: initium}}}}}}
"
    ));
    wait_rule_ready("clustermutationrule", &rule, None);
    let ns = namespace("elsewhere");

    // Every initium Pod at once: the Deployment's new Pods are admitted (initium's own
    // namespace is never sent to it), become Ready, and creates elsewhere work again.
    let deleted_at = Instant::now();
    k(&["delete", "pods", "-n", NS, "-l", SELECTOR, "--wait=false"]);
    wait_replicas_ready(2);
    let mut attempts = 0;
    let admitted = within(Duration::from_secs(60), Duration::from_millis(500), || {
        attempts += 1;
        kubectl_with(
            &["create", "-f", "-"],
            Some(&held_pod(&ns, &format!("after-{attempts}"))),
        )
        .0
    });
    assert!(
        admitted,
        "creates outside initium's namespace did not work again within 60s"
    );
    eprintln!(
        "all initium Pods deleted: 2 Ready and creates admitted again after {:?} ({attempts} attempts)",
        deleted_at.elapsed()
    );
    assert_eq!(
        k(&[
            "get",
            "pod",
            &format!("after-{attempts}"),
            "-n",
            &ns,
            "-o",
            "jsonpath={.metadata.labels.seen-by}"
        ]),
        "initium"
    );

    // Scaled to 0: kube-system and initium's namespace still create; elsewhere the Fail rule
    // denies, with the API server's message.
    k(&["scale", "deployment", "initium", "-n", NS, "--replicas=0"]);
    assert!(within(
        Duration::from_secs(120),
        Duration::from_millis(500),
        || initium_pods().is_empty()
    ));
    for (where_, name) in [("kube-system", unique("sys")), (NS, unique("own"))] {
        let (ok, _, err) = kubectl_with(&["create", "-f", "-"], Some(&held_pod(where_, &name)));
        assert!(
            ok,
            "a create in {where_} failed with initium at 0 replicas: {err}"
        );
        k(&["delete", "pod", &name, "-n", where_, "--wait=false"]);
    }
    let (ok, _, err) = kubectl_with(&["create", "-f", "-"], Some(&held_pod(&ns, "denied")));
    assert!(
        !ok,
        "a create elsewhere was admitted with no initium to run the Fail rule"
    );
    eprintln!(
        "with initium at 0 replicas, a create under a Fail rule: {}",
        err.trim()
    );
    assert!(
        err.contains("failed calling webhook \"fail.initium.dev\"")
            && err.contains("no endpoints available for service \"initium\""),
        "{err}"
    );
    k(&["scale", "deployment", "initium", "-n", NS, "--replicas=2"]);
    wait_replicas_ready(2);
    k(&["delete", "clustermutationrule", &rule]);
    k(&["delete", "namespace", &ns, "--wait=false"]);
}

#[test]
fn a_gate_holds_pods_until_a_real_backend_passes_its_readiness_probe() {
    let _serial = serial();
    install(&[]);
    let ns = namespace("shop");
    apply(&format!(
        "apiVersion: initium.dev/v1alpha1
kind: MutationRule
metadata: {{name: wait-for-backend, namespace: {ns}}}
spec:
  match:
    kinds: [Pod]
    labels: {{matchLabels: {{tier: web}}}}
  gate:
    waitFor:
      - service: {{name: backend}}
    timeout: 5m
    onTimeout: Release
---
apiVersion: v1
kind: Service
metadata: {{name: backend, namespace: {ns}}}
spec:
  selector: {{app: backend}}
  ports: [{{port: 80}}]
"
    ));
    wait_rule_ready("mutationrule", "wait-for-backend", Some(&ns));
    apply(&format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: web, namespace: {ns}, labels: {{tier: web}}}}
spec:
  containers: [{{name: web, image: toolbox:dev, imagePullPolicy: Never, command: [sh, -c, 'echo started; exec sleep 3600']}}]
"
    ));
    let gates = || {
        k(&[
            "get",
            "pod",
            "web",
            "-n",
            &ns,
            "-o",
            "jsonpath={.spec.schedulingGates[*].name}",
        ])
    };
    assert!(!gates().is_empty(), "the web Pod was not held");
    // The backend becomes Ready only when its probe finds the file, 10 s after it starts.
    apply(&format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: backend, namespace: {ns}, labels: {{app: backend}}}}
spec:
  containers:
    - name: backend
      image: toolbox:dev
      imagePullPolicy: Never
      command: [sh, -c, 'sleep 10; touch /tmp/ready; exec sleep 3600']
      readinessProbe: {{exec: {{command: [cat, /tmp/ready]}}, periodSeconds: 1}}
"
    ));
    let created = Instant::now();
    // Still held while the backend runs but is not Ready.
    let running = within(Duration::from_secs(60), Duration::from_millis(250), || {
        k(&[
            "get",
            "pod",
            "backend",
            "-n",
            &ns,
            "-o",
            "jsonpath={.status.phase}",
        ]) == "Running"
    });
    assert!(running, "the backend did not start");
    let ready_flag = k(&[
        "get",
        "pod",
        "backend",
        "-n",
        &ns,
        "-o",
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
    ]);
    if ready_flag != "True" {
        assert!(
            !gates().is_empty(),
            "the web Pod was released before the backend was Ready"
        );
    }
    let released = within(Duration::from_secs(90), Duration::from_millis(250), || {
        gates().is_empty()
    });
    assert!(
        released,
        "the web Pod was not released: {}",
        k(&["describe", "pod", "web", "-n", &ns])
    );
    assert!(
        created.elapsed() >= Duration::from_secs(9),
        "released after {:?}, before the backend's probe could pass",
        created.elapsed()
    );
    // Released, it is scheduled and its container runs.
    let started = within(Duration::from_secs(60), Duration::from_millis(500), || {
        kubectl_with(&["logs", "web", "-n", &ns], None).1 == "started\n"
    });
    assert!(
        started,
        "the released Pod's container did not run: {}",
        k(&["describe", "pod", "web", "-n", &ns])
    );
    k(&["delete", "namespace", &ns, "--wait=false"]);
}

/// The kernel settings the kubelet wants changed, and the machine's values of them.
const KERNEL_SETTINGS: [&str; 6] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

fn kernel_settings() -> Vec<String> {
    KERNEL_SETTINGS
        .iter()
        .map(|key| std::fs::read_to_string(format!("/proc/sys/{key}")).unwrap_or_default())
        .collect()
}

/// Everything of this machine's that real node INDEX could leave behind: its network
/// namespace, links, route, mounts, cgroups, and the processes of its directory DIR.
fn traces(index: &str, dir: &str) -> Vec<String> {
    let needles = [
        format!("initium-node-{index}"),
        format!("initium-h{index}"),
        format!("10.90.{index}."),
        dir.to_owned(),
    ];
    let mut found = Vec::new();
    let mut look = |what: &str, text: String| {
        for line in text.lines() {
            if let Some(needle) = needles.iter().find(|n| line.contains(n.as_str())) {
                found.push(format!("{what} ({needle}): {line}"));
            }
        }
    };
    let run = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    look("netns", run("ip", &["netns", "list"]));
    look("link", run("ip", &["-o", "link"]));
    look("route", run("ip", &["route"]));
    look(
        "mount",
        std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
    );
    for hierarchy in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        for entry in std::fs::read_dir(hierarchy.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("initium-node") {
                look("cgroup", format!("{} initium-node", entry.path().display()));
            }
        }
    }
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(dir) {
                look(
                    "process",
                    format!("{} {cmdline}", entry.file_name().to_string_lossy()),
                );
            }
        }
    }
    found
}

#[test]
fn down_leaves_no_trace_of_the_real_node_and_the_kernel_settings_unchanged() {
    let before = kernel_settings();
    let tmp = option_env!("CARGO_TARGET_TMPDIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let dir = tmp.join(format!("realnode-down-{}", std::process::id()));
    let dir_text = dir.display().to_string();
    let plane = Plane::start_real_node(dir.clone()).unwrap_or_else(|e| panic!("{e:#}"));
    let index = std::fs::read_to_string(dir.join("real-node"))
        .unwrap()
        .trim()
        .to_owned();
    // A Pod that runs: a sandbox, a container, a CNI address, a cgroup, volumes.
    let status = Command::new(root().join("scripts/image"))
        .args(["--dir", &dir_text])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "importing the images failed");
    let pod =
        held_pod("default", "runs").replace("  schedulingGates: [{name: example.com/never}]\n", "");
    let output = plane
        .kubectl_stdin(
            &["apply", "-f", "-"],
            &pod.replace("command: [sleep, '1']", "command: [sleep, '3600']"),
        )
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let running = within(Duration::from_secs(90), Duration::from_millis(500), || {
        let out = plane
            .kubectl()
            .args(["get", "pod", "runs", "-o", "jsonpath={.status.phase}"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout) == "Running"
    });
    assert!(running, "the Pod did not run");
    assert!(
        !traces(&index, &dir_text).is_empty(),
        "nothing seen of a running node: the check is blind"
    );
    assert_eq!(
        kernel_settings(),
        before,
        "the kernel settings changed while the node ran"
    );

    drop(plane);
    let left = traces(&index, &dir_text);
    assert!(
        left.is_empty(),
        "down left these behind:\n{}",
        left.join("\n")
    );
    assert!(!dir.exists(), "down left {}", dir.display());
    assert_eq!(kernel_settings(), before, "the kernel settings changed");
}
