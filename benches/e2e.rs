//! End-to-end benchmark: Pod CREATE latency through a real kube-apiserver, with the same
//! mutation done by nobody, by the in-tree MutatingAdmissionPolicy, by initium, and by initium
//! among 1,000 rules that do not match (and, with `--kyverno`, by Kyverno).
//!
//! Every configuration lives in its own namespace of one control plane, all set up before the
//! first measurement, so switching between them costs nothing and they can alternate: each
//! round creates `--batch` Pods in every configuration's namespace, in an order that rotates
//! every round, `--concurrency` creates in flight. Machine noise (another process, a GC in the
//! API server, etcd's fsync) then lands on all of them alike.
//!
//! | config | namespace | what mutates its Pods |
//! |---|---|---|
//! | none | bench-none | nothing (initium's webhook excludes the namespace) |
//! | map | bench-map | a MutatingAdmissionPolicy (ApplyConfiguration) bound by namespace label: `admissionregistration.k8s.io/v1` where the API server serves it (1.36 on), v1beta1 behind its feature gate before (1.34, 1.35; scripts/control-plane turns it on); the report says which |
//! | initium | bench-initium | an initium MutationRule |
//! | initium-1000 | bench-initium-1000 | the same MutationRule, and 1,000 MutationRules for Pods in that namespace that do not match (labels, names, JSONPath conditions) |
//! | kyverno | bench-kyverno | a Kyverno ClusterPolicy (`--kyverno`; see scripts/bench.d/kyverno) |
//! | none-2 | bench-none-2 (second plane) | nothing: the baseline of the two below |
//! | map-same | bench-map-same (second plane) | a hand-written MutatingAdmissionPolicy doing what initium-compiled's rule does |
//! | initium-compiled | bench-initium-compiled (second plane) | a compilable MutationRule, served by the API server through the policy `initium serve --compile-rules auto` generated (no webhook) |
//!
//! The mutation (what examples/test-ca does): a `test-ca` Secret volume, its mount in every
//! container, and an annotation with the Pod's namespace. A rule that mounts the volume in
//! every container needs a forEach, which is not compiled: initium-compiled and map-same do
//! the rest (the volume and the annotation). They run on a second control plane, with a second
//! initium, so that neither initium sees the other's rules ([`compiled`] says why); their
//! ratio is (initium-compiled − none-2) / (map-same − none-2). `--no-compiled` leaves them out.
//! Before measuring, one Pod per configuration is checked: mutated exactly where it should be
//! (and nothing of the mutation on a baseline's).
//!
//!     scripts/bench e2e --pods 500 --concurrency 4
//!     cargo bench --bench e2e -- --pods 500 --concurrency 4
//!
//! With `--compiled-scale 10,100,1000`, instead: N compilable rules, one per namespace, served
//! by the API server on one plane and by initium's webhook on another, for each N (see
//! [`compiled`]).
//!
//!     scripts/bench e2e --compiled-scale 10,100,1000 --pods 1000 --runs 3
//!
//! With `--rollout`, the same configurations on a whole cluster (controller manager,
//! scheduler, simulated nodes) time Deployments rolling out instead: see [`rollout`].
//!
//! With `--in-cluster`, initium is not a process beside the plane but what users run: its
//! image (scripts/image) installed by the Helm chart on a real node (`up --real-node`), two
//! replicas, called by the API server through its Service. The measured Pods carry a
//! scheduling gate, so none is started: the node's work does not land on the measurement.
//!
//!     scripts/bench e2e --in-cluster --pods 300 --runs 3
//!
//!     scripts/bench e2e --rollout --replicas 100 --rounds 3
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "../tests/support/mod.rs"]
mod support;

// Not benches/rollout.rs, which cargo would take for a benchmark of its own.
#[path = "e2e/rollout.rs"]
mod rollout;

#[path = "e2e/apiserver.rs"]
mod apiserver;

#[path = "e2e/compiled.rs"]
mod compiled;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use support::cluster::{create_rules, ready_rules};
use support::measure::{Percentiles, machine, memory, mib, round};
use support::plane::{Plane, root};
use support::process::{GRACE, Initium, InitiumOptions, free_port, terminate};
use support::wait::poll;
use support::workloads::NODES;

/// Pod CREATE latency through the API server (or, with --rollout, Deployment rollouts on a
/// whole cluster): no mutation, MutatingAdmissionPolicy, initium.
#[derive(Parser, Debug)]
struct Args {
    /// Measured Pods per configuration.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=20_000))]
    pods: u32,
    /// Creates in flight at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    concurrency: u32,
    /// Pods per configuration per round.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    batch: u32,
    /// Unmeasured Pods per configuration first.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    warmup: u32,
    /// Non-matching rules beside the rule in the `initium-1000` configuration.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(0..=20_000))]
    other_rules: u32,
    /// Measurements of `--pods` Pods per configuration on the same control plane; the
    /// summary gives each and the median of the added times and ratios over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    runs: u32,
    /// Add the `kyverno` configuration (builds Kyverno from Go modules on first use).
    #[arg(long)]
    kyverno: bool,
    /// Time Deployments rolling out on a whole cluster (3 simulated nodes) instead of Pod
    /// CREATEs.
    #[arg(long)]
    rollout: bool,
    /// With --rollout: replicas of each measured Deployment.
    #[arg(long, default_value_t = 100, requires = "rollout",
          value_parser = clap::value_parser!(u32).range(1..=2_000))]
    replicas: u32,
    /// With --rollout: rollouts per configuration, configurations alternating.
    #[arg(long, default_value_t = 3, requires = "rollout",
          value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// initium from its image, installed by the Helm chart on a real node (root only).
    #[arg(long, conflicts_with_all = ["rollout", "kyverno"])]
    in_cluster: bool,
    /// Leave out the compiled configurations (`none-2`, `map-same`, `initium-compiled`) and
    /// their second control plane.
    #[arg(long)]
    no_compiled: bool,
    /// Instead of the configurations: for each N of the list (e.g. `10,100,1000`), N
    /// compilable MutationRules, one per namespace, served by the API server
    /// (`--compile-rules auto`) on one control plane and by initium's webhook on another; Pod
    /// CREATE latency in one of those namespaces. `--pods`, `--runs` etc. apply to each N.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["rollout", "in_cluster", "kyverno"],
          value_parser = clap::value_parser!(u32).range(1..=5_000))]
    compiled_scale: Vec<u32>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// `--in-cluster`: the measured Pods carry a scheduling gate (nothing starts on the node).
static HOLD_PODS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("e2e benchmark failed: {e:#}");
        std::process::exit(1);
    }
}

/// One configuration: a name and the namespace its Pods are created in.
#[derive(Clone, Debug)]
struct Config {
    name: &'static str,
    namespace: &'static str,
    /// Whether its Pods must come out mutated.
    mutates: bool,
    /// Which mutation, when they must.
    mutation: Mutation,
    /// The control plane its namespace is on: 0, the benchmark's first; 1, the second (the
    /// compiled configurations, or the webhook's in `--compiled-scale`).
    plane: usize,
    /// The configuration whose latency its added latency is over: `none` on its plane.
    none: &'static str,
}

/// What a mutated Pod carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    /// examples/test-ca: the volume, its mount in every container, the annotation.
    TestCa,
    /// What a rule served by the API server can do of it: the volume and the annotation, no
    /// mount (mounting in every container takes a forEach, which does not compile).
    Same,
}

const NONE: Config = Config {
    name: "none",
    namespace: "bench-none",
    mutates: false,
    mutation: Mutation::TestCa,
    plane: 0,
    none: "none",
};
const MAP: Config = Config {
    name: "map",
    namespace: "bench-map",
    mutates: true,
    mutation: Mutation::TestCa,
    plane: 0,
    none: "none",
};
const INITIUM: Config = Config {
    name: "initium",
    namespace: "bench-initium",
    mutates: true,
    mutation: Mutation::TestCa,
    plane: 0,
    none: "none",
};
const INITIUM_1000: Config = Config {
    name: "initium-1000",
    namespace: "bench-initium-1000",
    mutates: true,
    mutation: Mutation::TestCa,
    plane: 0,
    none: "none",
};
const KYVERNO: Config = Config {
    name: "kyverno",
    namespace: "bench-kyverno",
    mutates: true,
    mutation: Mutation::TestCa,
    plane: 0,
    none: "none",
};

/// The second control plane's baseline: nothing mutates its Pods (initium excludes it).
const NONE_2: Config = Config {
    name: "none-2",
    namespace: "bench-none-2",
    mutates: false,
    mutation: Mutation::Same,
    plane: 1,
    none: "none-2",
};
/// A hand-written MutatingAdmissionPolicy doing what `initium-compiled`'s rule does.
const MAP_SAME: Config = Config {
    name: "map-same",
    namespace: "bench-map-same",
    mutates: true,
    mutation: Mutation::Same,
    plane: 1,
    none: "none-2",
};
/// An initium MutationRule served by the API server, through the policy initium generated.
const INITIUM_COMPILED: Config = Config {
    name: "initium-compiled",
    namespace: "bench-initium-compiled",
    mutates: true,
    mutation: Mutation::Same,
    plane: 1,
    none: "none-2",
};

/// The MutatingAdmissionPolicy doing what the initium rule does, bound to `bench-map` by label;
/// `API_VERSION` becomes the version of `admissionregistration.k8s.io` the server serves it in.
const MAP_POLICY: &str = r#"
apiVersion: admissionregistration.k8s.io/API_VERSION
kind: MutatingAdmissionPolicy
metadata:
  name: bench-test-ca
spec:
  failurePolicy: Ignore
  reinvocationPolicy: Never
  matchConstraints:
    resourceRules:
    - apiGroups: [""]
      apiVersions: ["v1"]
      operations: ["CREATE"]
      resources: ["pods"]
  mutations:
  - patchType: ApplyConfiguration
    applyConfiguration:
      expression: >
        Object{
          metadata: Object.metadata{
            annotations: {"certs.example.com/namespace": request.namespace}
          },
          spec: Object.spec{
            volumes: [Object.spec.volumes{name: "test-ca", secret: Object.spec.volumes.secret{secretName: "test-ca"}}],
            containers: object.spec.containers.map(c, Object.spec.containers{
              name: c.name,
              volumeMounts: [Object.spec.containers.volumeMounts{name: "test-ca", mountPath: "/etc/ssl/test", readOnly: true}]
            })
          }
        }
---
apiVersion: admissionregistration.k8s.io/API_VERSION
kind: MutatingAdmissionPolicyBinding
metadata:
  name: bench-test-ca
spec:
  policyName: bench-test-ca
  matchResources:
    namespaceSelector:
      matchLabels:
        initium-bench: map
"#;

/// The initium rule: examples/test-ca's mutation.
fn test_ca_rule(namespace: &str) -> Value {
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": "test-ca", "namespace": namespace},
        "spec": {
            "match": {"kinds": ["Pod"]},
            "mutations": [
                {"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "test-ca", "secret": {"secretName": "test-ca"}}}},
                {"forEach": "$.spec.containers[*]", "mutations": [
                    {"upsert": {"path": "/volumeMounts", "key": "name", "value": {"name": "test-ca", "mountPath": "/etc/ssl/test", "readOnly": true}}}
                ]},
                {"patch": [{"op": "add", "path": "/metadata/annotations/certs.example.com~1namespace", "value": "{{ $.metadata.namespace }}"}]}
            ]
        }
    })
}

/// `count` MutationRules for Pods in `namespace` that never match the benchmark's Pods, so
/// initium has to look at each of them: a third fail on labels, a third on names, a third on
/// a JSONPath condition over the images.
fn other_rules(namespace: &str, count: u32) -> Vec<Value> {
    (0..count)
        .map(|i| {
            let matching = match i % 3 {
                0 => json!({"match": {"kinds": ["Pod"], "labels": {"matchLabels": {"app": format!("other-{i}")}}}}),
                1 => json!({"match": {"kinds": ["Pod"], "names": [format!("batch-{i}-*")]}}),
                _ => json!({"match": {"kinds": ["Pod"]}, "conditions": [
                    {"path": "$.spec.containers[*].image", "matches": format!("^registry\\.other/team-{i}/")}
                ]}),
            };
            let mut spec = matching;
            spec["mutations"] = json!([{"merge": {"metadata": {"labels": {format!("other-{i}"): "x"}}}}]);
            json!({
                "apiVersion": "initium.dev/v1alpha1",
                "kind": "MutationRule",
                "metadata": {"name": format!("other-{i}"), "namespace": namespace},
                "spec": spec,
            })
        })
        .collect()
}

/// The benchmark Pod's spec: two containers, as a Pod with a sidecar.
fn pod_spec() -> Value {
    json!({
        "containers": [
            {"name": "app", "image": "registry.example.com/shop/web:1.4.2",
             "ports": [{"containerPort": 8080}],
             "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
            {"name": "proxy", "image": "registry.example.com/proxy:2.1",
             "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}}}
        ]
    })
}

fn pod(name: &str) -> Result<Pod> {
    // Labels as a Deployment would leave them.
    let value = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "web", "pod-template-hash": "5d8f7c9b6"}},
        "spec": pod_spec(),
    });
    let mut value = value;
    if HOLD_PODS.load(std::sync::atomic::Ordering::Relaxed) {
        value["spec"]["schedulingGates"] = json!([{"name": "bench.initium.dev/never"}]);
    }
    serde_json::from_value(value).context("the benchmark's Pod")
}

/// What of the mutation a stored Pod carries.
struct Parts {
    /// The `test-ca` Secret volume.
    volume: bool,
    /// Its mount in every container.
    mounts: bool,
    /// Its mount in some container.
    any_mount: bool,
    /// The annotation with the Pod's namespace.
    annotation: bool,
}

impl Parts {
    fn of(pod: &Pod, namespace: &str) -> Parts {
        let Some(spec) = &pod.spec else {
            return Parts {
                volume: false,
                mounts: false,
                any_mount: false,
                annotation: false,
            };
        };
        let volume = spec.volumes.iter().flatten().any(|v| {
            v.name == "test-ca"
                && v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("test-ca")
        });
        let mounted = |c: &k8s_openapi::api::core::v1::Container| {
            c.volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == "test-ca" && m.mount_path == "/etc/ssl/test")
        };
        let annotation = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("certs.example.com/namespace"))
            .map(String::as_str)
            == Some(namespace);
        Parts {
            volume,
            mounts: spec.containers.iter().all(mounted),
            any_mount: spec.containers.iter().any(mounted),
            annotation,
        }
    }
}

/// Whether a stored Pod carries the mutation (volume, mounts in every container, annotation).
fn is_mutated(pod: &Pod, namespace: &str) -> bool {
    let parts = Parts::of(pod, namespace);
    parts.volume && parts.mounts && parts.annotation
}

/// Whether a stored Pod is mutated exactly as its configuration says: nothing of the mutation
/// on a baseline's Pods; all of examples/test-ca's; or, for [`Mutation::Same`], the volume
/// and the annotation and no mount.
fn as_wanted(pod: &Pod, config: &Config) -> bool {
    let parts = Parts::of(pod, config.namespace);
    match (config.mutates, config.mutation) {
        (false, _) => !parts.volume && !parts.any_mount && !parts.annotation,
        (true, Mutation::TestCa) => parts.volume && parts.mounts && parts.annotation,
        (true, Mutation::Same) => parts.volume && !parts.any_mount && parts.annotation,
    }
}

fn run(args: &Args) -> Result<()> {
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if !args.compiled_scale.is_empty() {
        return compiled::scale(args, &runtime);
    }
    let mut configs = vec![NONE, MAP, INITIUM, INITIUM_1000];
    if args.kyverno {
        configs.push(KYVERNO);
    }
    // The compiled configurations: Pod CREATEs with initium beside the plane only.
    let with_compiled = !args.rollout && !args.in_cluster && !args.no_compiled;

    let kyverno_script = root().join("scripts/bench.d/kyverno");
    if args.kyverno {
        // The first build takes minutes; its progress goes to stderr.
        let status = std::process::Command::new(&kyverno_script)
            .arg("build")
            .status()
            .context("cannot run scripts/bench.d/kyverno build")?;
        if !status.success() {
            bail!("scripts/bench.d/kyverno build failed ({status})");
        }
    }

    let plane = if args.rollout {
        Plane::up_cluster("e2e-rollout", NODES)?
    } else if args.in_cluster {
        HOLD_PODS.store(true, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "initium-bench-e2e-in-cluster-{}",
            std::process::id()
        ));
        eprintln!(
            "bench: starting a cluster with a real node in {}",
            dir.display()
        );
        Plane::start_real_node(dir)?
    } else {
        Plane::up("e2e")?
    };
    plane.install_crds()?;
    let client = runtime.block_on(plane.client())?;
    for config in &configs {
        let labels: &[(&str, &str)] = match config.name {
            "map" => &[("initium-bench", "map")],
            "kyverno" => &[("initium-bench", "kyverno")],
            _ => &[],
        };
        plane.ensure_namespace(config.namespace, labels)?;
    }
    let served = Served::of(&plane)?;
    eprintln!("bench: {}", served.line());
    plane.apply(&MAP_POLICY.replace("API_VERSION", served.map_api))?;
    let _ = SERVED.set(served);

    let mut rules = vec![
        test_ca_rule(INITIUM.namespace),
        test_ca_rule(INITIUM_1000.namespace),
    ];
    rules.extend(other_rules(INITIUM_1000.namespace, args.other_rules));
    let started = Instant::now();
    runtime.block_on(create_rules(&client, &rules, 16))?;
    eprintln!(
        "bench: created {} rules in {:.1}s",
        rules.len(),
        started.elapsed().as_secs_f64()
    );

    let log = std::env::temp_dir().join(format!("initium-bench-e2e-{}.log", std::process::id()));
    let mut extra = vec!["--exclude-namespace".to_string(), "kube-system".to_string()];
    // Every rule of initium-1000 Ready: it has `--other-rules` + 1 (past the default quota of
    // 1,000 per namespace), and initium counts each of the third with a regular expression at
    // about 1 MiB against --max-rule-bytes-per-namespace (64 MiB by default), which would
    // leave some 270 of them QuotaExceeded.
    extra.extend([
        "--max-rules-per-namespace".into(),
        (args.other_rules + 1).max(1000).to_string(),
        "--max-rule-bytes-per-namespace".into(),
        "32Gi".into(),
    ]);
    for config in &configs {
        if !config.name.starts_with("initium") {
            extra.push("--exclude-namespace".into());
            extra.push(config.namespace.into());
        }
    }
    let initium = if args.in_cluster {
        Server::Pods(install_in_cluster(&plane, &configs)?)
    } else {
        let initium = Initium::start(
            &plane,
            InitiumOptions {
                namespace: "initium-bench".into(),
                extra,
                cpus: None,
                log: log.clone(),
            },
        )?;
        eprintln!(
            "bench: initium serving (pid {}), log {}",
            initium.pid(),
            log.display()
        );
        Server::Process(initium)
    };
    let kyverno = if args.kyverno {
        Some(Kyverno::start(&plane, &kyverno_script)?)
    } else {
        None
    };
    let want = rules.len();
    poll(
        "every rule's Ready status",
        Duration::from_secs(600),
        Duration::from_secs(1),
        || {
            let ready = runtime.block_on(ready_rules(&client))?;
            Ok((ready >= want)
                .then_some(())
                .ok_or_else(|| format!("{ready} of {want} rules Ready")))
        },
    )?;
    // The compiled configurations on a control plane of their own (see the module doc).
    let second = if with_compiled {
        Some(compiled::Second::start(&runtime)?)
    } else {
        None
    };
    let mut clients = vec![client.clone()];
    let mut measured_configs = configs.clone();
    if let Some(second) = &second {
        clients.push(second.client.clone());
        measured_configs.extend([NONE_2, MAP_SAME, INITIUM_COMPILED]);
    }

    if args.rollout {
        // With nodes, the ServiceAccount admission plugin rejects Pods until the namespace's
        // `default` ServiceAccount exists.
        rollout::service_accounts(&runtime, &client, &configs)?;
    }
    // Each configuration in effect: a dry-run Pod comes back mutated exactly where it should.
    for config in &measured_configs {
        dry_run_as_wanted(&runtime, &clients[config.plane], config)?;
    }
    eprintln!("bench: every configuration is in effect");

    let measured = if args.rollout {
        let before = apiserver::Snapshot::read(&plane)?;
        let rollouts = runtime.block_on(rollout::measure(args, &client, &configs))?;
        let after = apiserver::Snapshot::read(&plane)?;
        // The Pods of the measured rollouts and of the one-replica check before them (the
        // ReplicaSet controller creates each once).
        let pods = u64::from(args.rounds * args.replicas + 1);
        let admission = apiserver::Admission::between(&before, &after, 2 * pods, pods);
        Measured::Rollouts(rollouts, admission)
    } else {
        let mut runs = Vec::new();
        for run in 0..args.runs {
            let started = Instant::now();
            let before = apiserver::Snapshot::read(&plane)?;
            let before_2 = second
                .as_ref()
                .map(|s| compiled::Metrics::read(&s.plane))
                .transpose()?;
            let latencies = runtime.block_on(measure(args, &clients, &measured_configs, run))?;
            let after = apiserver::Snapshot::read(&plane)?;
            let after_2 = second
                .as_ref()
                .map(|s| compiled::Metrics::read(&s.plane))
                .transpose()?;
            // Every Pod created in a configuration's namespace, warm-up included.
            let created = |name: &str| {
                latencies
                    .get(name)
                    .map_or(0, |samples| samples.len() as u64)
                    + u64::from(args.warmup.div_ceil(args.batch) * args.batch)
            };
            let admission = apiserver::Admission::between(
                &before,
                &after,
                created(INITIUM.name) + created(INITIUM_1000.name),
                created(MAP.name),
            );
            let second_view = match (&second, before_2, after_2) {
                (Some(second), Some(before), Some(after)) => Some(compiled::SecondView::between(
                    &before,
                    &after,
                    created(MAP_SAME.name),
                    created(INITIUM_COMPILED.name),
                    &second.policy,
                )),
                _ => None,
            };
            let seconds = started.elapsed().as_secs_f64();
            if args.runs > 1 {
                eprintln!(
                    "bench: run {} of {} measured in {seconds:.0}s",
                    run + 1,
                    args.runs
                );
            }
            runs.push(CreateRun {
                latencies,
                admission,
                second: second_view,
                seconds,
            });
        }
        Measured::Creates(runs)
    };
    let memory = Memory {
        initium_peak_kib: initium.peak_kib()?,
        kyverno_peak_kib: match &kyverno {
            Some(k) => Some(memory(k.child.id())?.peak_kib),
            None => None,
        },
        initium_compiled_peak_kib: match &second {
            Some(s) => Some(s.initium.memory()?.peak_kib),
            None => None,
        },
    };
    let policy = second.as_ref().map(|s| s.policy.clone());
    drop(second);
    drop(kyverno);
    drop(initium);
    drop(plane);
    match measured {
        Measured::Creates(runs) => report(args, &measured_configs, runs, memory, policy),
        Measured::Rollouts(seconds, admission) => {
            rollout::report(args, &configs, &seconds, &memory, &admission)
        }
    }
}

/// Waits until a dry-run Pod in the configuration's namespace comes back mutated exactly as
/// the configuration says (its rule or policy in effect).
fn dry_run_as_wanted(
    runtime: &tokio::runtime::Runtime,
    client: &kube::Client,
    config: &Config,
) -> Result<()> {
    poll(
        &format!("the {} configuration to take effect", config.name),
        Duration::from_secs(120),
        Duration::from_millis(500),
        || {
            let api: Api<Pod> = Api::namespaced(client.clone(), config.namespace);
            let created = runtime.block_on(api.create(
                &PostParams {
                    dry_run: true,
                    ..PostParams::default()
                },
                &pod("dry-run")?,
            ))?;
            Ok(as_wanted(&created, config).then_some(()).ok_or_else(|| {
                format!(
                    "a dry-run Pod came back as {:?}, volumes {:?}",
                    created.metadata,
                    created.spec.as_ref().map(|s| &s.volumes)
                )
            }))
        },
    )
}

/// initium as the benchmark runs it: a process beside the plane, or the Pods of the chart.
enum Server {
    Process(Initium),
    /// The host pids of the initium processes in the real node's Pods.
    Pods(Vec<u32>),
}

impl Server {
    /// Peak resident memory (VmHWM), of the largest replica in the cluster.
    fn peak_kib(&self) -> Result<u64> {
        match self {
            Server::Process(initium) => Ok(initium.memory()?.peak_kib),
            Server::Pods(pids) => {
                let mut peak = 0;
                for &pid in pids {
                    peak = peak.max(memory(pid)?.peak_kib);
                }
                Ok(peak)
            }
        }
    }
}

/// `--in-cluster`: scripts/image imports initium:dev into the real node, the chart installs
/// it (two replicas) with the configurations that initium must not see excluded; returns the
/// host pids of its processes once both replicas are Ready.
fn install_in_cluster(plane: &Plane, configs: &[Config]) -> Result<Vec<u32>> {
    let dir = plane.dir().context("the benchmark's own plane")?;
    let status = std::process::Command::new(root().join("scripts/image"))
        .arg("--dir")
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .status()
        .context("cannot run scripts/image")?;
    if !status.success() {
        bail!("scripts/image failed ({status})");
    }
    let mut args: Vec<String> = [
        "upgrade",
        "--install",
        "initium",
        "--namespace",
        "initium-system",
        "--create-namespace",
        "--wait",
        "--timeout",
        "300s",
        "--set",
        "image.repository=initium",
        "--set",
        "image.tag=dev",
        "--set",
        "image.pullPolicy=Never",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.insert(3, root().join("deploy/helm/initium").display().to_string());
    let excluded: Vec<&str> = configs
        .iter()
        .filter(|c| !c.name.starts_with("initium"))
        .map(|c| c.namespace)
        .collect();
    args.push("--set".into());
    args.push(format!("excludedNamespaces={{{}}}", excluded.join(",")));
    let output = support::plane::helm()
        .arg("--kubeconfig")
        .arg(&plane.kubeconfig)
        .args(&args)
        .output()
        .context("cannot run helm")?;
    if !output.status.success() {
        bail!(
            "helm {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let mut pids = Vec::new();
    poll(
        "two initium processes on the real node",
        Duration::from_secs(120),
        Duration::from_millis(500),
        || {
            pids = initium_pids();
            Ok((pids.len() == 2)
                .then_some(())
                .ok_or_else(|| format!("{} running", pids.len())))
        },
    )?;
    eprintln!("bench: initium installed by Helm on the real node (pids {pids:?})");
    Ok(pids)
}

/// The pids (as this machine sees them) of `/initium serve` processes: the image's binary.
fn initium_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"/initium\0serve\0"))
        })
        .collect()
}

/// What a run measured: Pod CREATE latencies (one set per `--runs`, with the API server's
/// view of each), or Deployment rollout times (`--rollout`).
enum Measured {
    Creates(Vec<CreateRun>),
    Rollouts(rollout::Rollouts, apiserver::Admission),
}

/// One of `--runs` measurements of Pod CREATEs.
struct CreateRun {
    latencies: Latencies,
    /// The first plane's API server's view.
    admission: apiserver::Admission,
    /// The second plane's (the compiled configurations'), if any.
    second: Option<compiled::SecondView>,
    /// Its wall-clock time.
    seconds: f64,
}

/// Peak resident memory of the webhook servers over the run (VmHWM).
struct Memory {
    initium_peak_kib: u64,
    kyverno_peak_kib: Option<u64>,
    /// The second `initium serve` (`--compile-rules auto`), if any.
    initium_compiled_peak_kib: Option<u64>,
}

impl Memory {
    /// Prints the summary's peak-memory line; returns the peaks in MiB for the JSON line.
    fn print_peaks(&self) -> (f64, Option<f64>) {
        let initium_mib = mib(self.initium_peak_kib);
        let kyverno_mib = self.kyverno_peak_kib.map(mib);
        match kyverno_mib {
            Some(k) => {
                println!("  peak memory (VmHWM): initium {initium_mib:.1} MiB, kyverno {k:.1} MiB")
            }
            None => println!("  peak memory (VmHWM): initium {initium_mib:.1} MiB"),
        }
        (initium_mib, kyverno_mib)
    }
}

/// Kyverno's admission controller, run out of cluster by `scripts/bench.d/kyverno run`, with
/// the policy of scripts/bench.d/kyverno-policy.yaml; its webhooks see only namespaces
/// labelled `initium-bench=kyverno`. Stopped when dropped, its webhook configurations deleted.
struct Kyverno {
    child: std::process::Child,
    cleanup: std::process::Command,
}

impl Kyverno {
    fn start(plane: &Plane, script: &std::path::Path) -> Result<Kyverno> {
        let port = free_port()?;
        let log =
            std::env::temp_dir().join(format!("kyverno-bench-e2e-{}.log", std::process::id()));
        let child = std::process::Command::new(script)
            .arg("run")
            .arg("--kubeconfig")
            .arg(&plane.kubeconfig)
            .args(["--namespace", "kyverno", "--port", &port.to_string()])
            .arg("--log")
            .arg(&log)
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("cannot start scripts/bench.d/kyverno run")?;
        let mut cleanup = std::process::Command::new(script);
        cleanup
            .arg("cleanup")
            .arg("--kubeconfig")
            .arg(&plane.kubeconfig)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let mut kyverno = Kyverno { child, cleanup };
        eprintln!(
            "bench: kyverno starting (pid {}), log {}",
            kyverno.child.id(),
            log.display()
        );
        let url = format!("https://127.0.0.1:{port}/health/readiness");
        poll(
            "kyverno's readiness",
            Duration::from_secs(180),
            Duration::from_millis(200),
            || {
                if let Ok(Some(status)) = kyverno.child.try_wait() {
                    bail!("kyverno exited ({status}); see {}", log.display());
                }
                let ready = std::process::Command::new("curl")
                    .args(["-fsk", "--max-time", "2", "-o", "/dev/null", &url])
                    .status()
                    .is_ok_and(|s| s.success());
                Ok(ready
                    .then_some(())
                    .ok_or_else(|| format!("{url} is not ready")))
            },
        )?;
        let policy = std::fs::read_to_string(root().join("scripts/bench.d/kyverno-policy.yaml"))?;
        // Kyverno's own webhook validates policies: it may take a moment to be registered.
        poll(
            "kyverno to accept the policy",
            Duration::from_secs(60),
            Duration::from_millis(500),
            || Ok(plane.apply(&policy).map_err(|e| format!("{e:#}"))),
        )?;
        plane.wait_condition(
            "clusterpolicy",
            "initium-bench-test-ca",
            "Ready",
            Duration::from_secs(120),
        )?;
        Ok(kyverno)
    }
}

impl Drop for Kyverno {
    fn drop(&mut self) {
        // `run` execs kyverno, so this is kyverno's pid.
        terminate(&mut self.child, GRACE);
        // It leaves its webhook configurations behind.
        let _ = self.cleanup.status();
    }
}

/// Latencies in microseconds, by configuration name.
type Latencies = BTreeMap<&'static str, Vec<u32>>;

/// One run; `run` keeps Pod names of different runs apart (Pods are not deleted).
async fn measure(
    args: &Args,
    clients: &[kube::Client],
    configs: &[Config],
    run: u32,
) -> Result<Latencies> {
    let mut measured: Latencies = configs.iter().map(|c| (c.name, Vec::new())).collect();
    let warmup_rounds = args.warmup.div_ceil(args.batch);
    let rounds = args.pods.div_ceil(args.batch);
    let mut serial = u64::from(run) * 1_000_000;
    for round in 0..warmup_rounds + rounds {
        let first = round as usize % configs.len();
        for i in 0..configs.len() {
            let config = &configs[(first + i) % configs.len()];
            let api: Api<Pod> = Api::namespaced(clients[config.plane].clone(), config.namespace);
            let names: Vec<String> = (0..args.batch)
                .map(|_| {
                    serial += 1;
                    format!("p-{serial}")
                })
                .collect();
            let results: Vec<Result<(u32, Pod)>> =
                futures::stream::iter(names.iter().map(|name| {
                    let api = api.clone();
                    async move {
                        let pod = pod(name)?;
                        let started = Instant::now();
                        let created = api
                            .create(&PostParams::default(), &pod)
                            .await
                            .with_context(|| format!("create Pod {}/{name}", config.namespace))?;
                        let micros =
                            u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX);
                        Ok((micros, created))
                    }
                }))
                .buffer_unordered(args.concurrency as usize)
                .collect()
                .await;
            for result in results {
                let (micros, created) = result?;
                if !as_wanted(&created, config) {
                    bail!(
                        "Pod {}/{} was not mutated as the {} configuration does: {:?}",
                        config.namespace,
                        created.metadata.name.clone().unwrap_or_default(),
                        config.name,
                        created.metadata.annotations
                    );
                }
                if round >= warmup_rounds
                    && let Some(samples) = measured.get_mut(config.name)
                {
                    samples.push(micros);
                }
            }
        }
        if round + 1 == warmup_rounds {
            eprintln!("bench: warm-up done, measuring");
        }
    }
    Ok(measured)
}

/// One run's figures: per configuration its percentiles, and what it adds over its `none`.
struct RunFigures {
    stats: BTreeMap<&'static str, Percentiles>,
    /// Configuration → the configuration its added time is over.
    nones: BTreeMap<&'static str, &'static str>,
}

/// A figure of a configuration's latencies, in ms.
type Figure = dyn Fn(&Percentiles) -> f64;

fn p50(s: &Percentiles) -> f64 {
    s.ms(0.5)
}

fn mean(s: &Percentiles) -> f64 {
    s.mean_ms()
}

impl RunFigures {
    fn new(measured: Latencies, configs: &[Config]) -> RunFigures {
        let stats = measured
            .into_iter()
            .map(|(name, samples)| (name, Percentiles::new(samples)))
            .collect();
        let nones = configs.iter().map(|c| (c.name, c.none)).collect();
        RunFigures { stats, nones }
    }

    /// What `name` adds over its `none` (NaN if either is missing).
    fn added(&self, name: &str, f: &Figure) -> f64 {
        let none = self.nones.get(name).and_then(|n| self.stats.get(n));
        match (self.stats.get(name), none) {
            (Some(s), Some(none)) => f(s) - f(none),
            _ => f64::NAN,
        }
    }

    /// (a − its none) / (b − its none), p50 and mean.
    fn ratio(&self, a: &str, b: &str) -> (f64, f64) {
        (
            self.added(a, &p50) / self.added(b, &p50),
            self.added(a, &mean) / self.added(b, &mean),
        )
    }
}

/// The median of some figures (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The API server measured: its release, and the version of `admissionregistration.k8s.io`
/// that serves MutatingAdmissionPolicy there.
struct Served {
    version: String,
    map_api: &'static str,
}

static SERVED: std::sync::OnceLock<Served> = std::sync::OnceLock::new();

impl Served {
    /// Asks the API server (discovery), rather than guessing from its version.
    fn of(plane: &Plane) -> Result<Served> {
        let raw = |path: &str| -> Option<Value> {
            let output = plane.kubectl().args(["get", "--raw", path]).output().ok()?;
            if !output.status.success() {
                return None;
            }
            serde_json::from_slice(&output.stdout).ok()
        };
        let version = raw("/version")
            .and_then(|v| v["gitVersion"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "of an unknown version".to_owned());
        let serves = |api: &str| {
            raw(&format!("/apis/admissionregistration.k8s.io/{api}")).is_some_and(|list| {
                list["resources"].as_array().is_some_and(|resources| {
                    resources
                        .iter()
                        .any(|r| r["name"] == "mutatingadmissionpolicies")
                })
            })
        };
        let map_api = if serves("v1") {
            "v1"
        } else if serves("v1beta1") {
            "v1beta1"
        } else {
            anyhow::bail!(
                "the API server (Kubernetes {version}) serves MutatingAdmissionPolicy in neither admissionregistration.k8s.io/v1 nor v1beta1; before 1.36 it needs --feature-gates=MutatingAdmissionPolicy=true and --runtime-config=admissionregistration.k8s.io/v1beta1=true (scripts/control-plane up sets both)"
            );
        };
        Ok(Served { version, map_api })
    }

    fn line(&self) -> String {
        format!(
            "Kubernetes {}; MutatingAdmissionPolicy through admissionregistration.k8s.io/{}",
            self.version, self.map_api
        )
    }
}

/// What the reports say about the API server measured.
fn served_line() -> String {
    SERVED.get().map_or_else(
        || "Kubernetes of an unknown version".to_owned(),
        Served::line,
    )
}

fn report(
    args: &Args,
    configs: &[Config],
    runs: Vec<CreateRun>,
    memory: Memory,
    policy: Option<String>,
) -> Result<()> {
    println!("e2e benchmark: {}", machine());
    println!("  {}", served_line());
    println!(
        "  Pod CREATE through kube-apiserver: {} Pods per configuration in rounds of {}, {} in flight, {} run(s)",
        args.pods, args.batch, args.concurrency, args.runs
    );
    if args.in_cluster {
        println!(
            "  initium in cluster: its image, installed by the Helm chart on a real node, 2 replicas called through their Service"
        );
    }
    let compiled = configs.iter().any(|c| c.name == INITIUM_COMPILED.name);
    if let Some(policy) = policy.as_ref().filter(|_| compiled) {
        println!(
            "  on a second control plane: initium-compiled, its MutationRule served by the API server through the MutatingAdmissionPolicy {policy} initium generated (--compile-rules auto; no webhook configuration); map-same, a hand-written policy doing the same (the test-ca volume, the annotation); none-2, their baseline"
        );
    }
    let mut figures = Vec::new();
    let mut runs_json = Vec::new();
    let mut compiled_webhook_calls = 0.0;
    for (n, run) in runs.into_iter().enumerate() {
        let figure = RunFigures::new(run.latencies, configs);
        if args.runs > 1 {
            println!("  run {} ({:.0} s):", n + 1, run.seconds);
        }
        let mut configs_json = serde_json::Map::new();
        for config in configs {
            let s = figure
                .stats
                .get(config.name)
                .context("missing configuration")?;
            println!(
                "  {:<16} mean {:6.3} ms  p50 {:6.3} ms  p90 {:6.3} ms  p99 {:6.3} ms  (+{:.3} ms p50, +{:.3} ms mean over {})",
                config.name,
                s.mean_ms(),
                s.ms(0.5),
                s.ms(0.9),
                s.ms(0.99),
                figure.added(config.name, &p50),
                figure.added(config.name, &mean),
                config.none,
            );
            configs_json.insert(
                config.name.to_string(),
                json!({
                    "mean_ms": round(s.mean_ms(), 3),
                    "p50_ms": round(s.ms(0.5), 3),
                    "p90_ms": round(s.ms(0.9), 3),
                    "p99_ms": round(s.ms(0.99), 3),
                    "n": s.len(),
                }),
            );
        }
        let ratio_map = figure.ratio(INITIUM.name, MAP.name);
        let ratio_1000 = figure.ratio(INITIUM_1000.name, INITIUM.name);
        println!(
            "  overhead ratio (initium - none) / (map - none): p50 {:.2}, mean {:.2}",
            ratio_map.0, ratio_map.1
        );
        println!(
            "  overhead ratio (initium-1000 - none) / (initium - none): p50 {:.2}, mean {:.2}",
            ratio_1000.0, ratio_1000.1
        );
        let ratio_compiled = compiled.then(|| figure.ratio(INITIUM_COMPILED.name, MAP_SAME.name));
        if let Some((p, m)) = ratio_compiled {
            println!(
                "  overhead ratio (initium-compiled - none-2) / (map-same - none-2): p50 {p:.2}, mean {m:.2}"
            );
        }
        run.admission.print();
        if let Some(second) = &run.second {
            second.print();
            compiled_webhook_calls += second.webhook_calls;
        }
        let mut run_json = json!({
            "seconds": round(run.seconds, 1),
            "configs": configs_json,
            "overhead_ratio_p50": round(ratio_map.0, 2),
            "overhead_ratio_mean": round(ratio_map.1, 2),
            "overhead_ratio_1000_p50": round(ratio_1000.0, 2),
            "overhead_ratio_1000_mean": round(ratio_1000.1, 2),
            "apiserver": run.admission.json(),
        });
        if let Some((p, m)) = ratio_compiled {
            run_json["overhead_ratio_compiled_p50"] = json!(round(p, 2));
            run_json["overhead_ratio_compiled_mean"] = json!(round(m, 2));
        }
        if let Some(second) = &run.second {
            run_json["apiserver_2"] = second.json();
        }
        runs_json.push(run_json);
        figures.push(figure);
    }
    let med = |f: &dyn Fn(&RunFigures) -> f64| median(figures.iter().map(f).collect());
    let ratio_p50 = med(&|r| r.ratio(INITIUM.name, MAP.name).0);
    let ratio_mean = med(&|r| r.ratio(INITIUM.name, MAP.name).1);
    let ratio_1000_p50 = med(&|r| r.ratio(INITIUM_1000.name, INITIUM.name).0);
    let ratio_1000_mean = med(&|r| r.ratio(INITIUM_1000.name, INITIUM.name).1);
    let mut added = serde_json::Map::new();
    println!(
        "  median over {} run(s), added over none (none-2 on the second plane):",
        figures.len()
    );
    for config in configs.iter().filter(|c| c.name != c.none) {
        let p50 = med(&|r| r.added(config.name, &p50));
        let mean = med(&|r| r.added(config.name, &mean));
        println!(
            "    {:<16} +{p50:.3} ms p50  +{mean:.3} ms mean",
            config.name
        );
        added.insert(
            config.name.to_string(),
            json!({"p50_ms": round(p50, 3), "mean_ms": round(mean, 3)}),
        );
    }
    println!(
        "  overhead ratio (initium - none) / (map - none): median p50 {ratio_p50:.2}, mean {ratio_mean:.2} (goals <= 1.5, issue 12: <= 1.2)"
    );
    println!(
        "  overhead ratio (initium-1000 - none) / (initium - none): median p50 {ratio_1000_p50:.2}, mean {ratio_1000_mean:.2} (goal <= 1.2)"
    );
    let ratio_compiled = compiled.then(|| {
        (
            med(&|r| r.ratio(INITIUM_COMPILED.name, MAP_SAME.name).0),
            med(&|r| r.ratio(INITIUM_COMPILED.name, MAP_SAME.name).1),
        )
    });
    if let Some((p, m)) = ratio_compiled {
        println!(
            "  overhead ratio (initium-compiled - none-2) / (map-same - none-2): median p50 {p:.2}, mean {m:.2} (goal <= 1.05); initium's webhook called {compiled_webhook_calls:.0} times on the second plane"
        );
    }
    let (initium_mib, kyverno_mib) = memory.print_peaks();
    let compiled_mib = memory.initium_compiled_peak_kib.map(mib);
    if let Some(m) = compiled_mib {
        println!("  peak memory (VmHWM): initium --compile-rules auto (second plane) {m:.1} MiB");
    }
    let mut line = json!({
        "bench": "e2e",
        "in_cluster": args.in_cluster,
        "pods": args.pods,
        "concurrency": args.concurrency,
        "batch": args.batch,
        "other_rules": args.other_rules,
        "runs": runs_json,
        "median_added_over_none": added,
        "overhead_ratio_p50": round(ratio_p50, 2),
        "overhead_ratio_mean": round(ratio_mean, 2),
        "overhead_ratio_1000_p50": round(ratio_1000_p50, 2),
        "overhead_ratio_1000_mean": round(ratio_1000_mean, 2),
        "goal_met": ratio_p50 <= 1.5 && ratio_mean <= 1.5,
        "goal_1_2_met": ratio_p50 <= 1.2 && ratio_mean <= 1.2,
        "goal_1000_met": ratio_1000_p50 <= 1.2 && ratio_1000_mean <= 1.2,
        "initium_peak_rss_mib": round(initium_mib, 1),
        "kyverno_peak_rss_mib": kyverno_mib.map(|k| round(k, 1)),
    });
    if let Some((p, m)) = ratio_compiled {
        line["compiled_policy"] = json!(policy);
        line["overhead_ratio_compiled_p50"] = json!(round(p, 2));
        line["overhead_ratio_compiled_mean"] = json!(round(m, 2));
        line["goal_compiled_met"] = json!(p <= 1.05 && m <= 1.05);
        line["compiled_webhook_calls"] = json!(compiled_webhook_calls);
        line["initium_compiled_peak_rss_mib"] = json!(compiled_mib.map(|m| round(m, 1)));
    }
    println!("{line}");
    Ok(())
}
