//! Rules served by the API server (`initium serve --compile-rules auto`): the compiled
//! configurations of the e2e benchmark, and `--compiled-scale`.
//!
//! # Why a second control plane
//!
//! Every `initium serve` watches every rule of its cluster. A second instance with
//! `--compile-rules auto` on the benchmark's plane would see the `test-ca` rules of `initium`
//! and `initium-1000` (forEach: not compiled) and keep a MutatingWebhookConfiguration for
//! them, whose `namespaceSelector` leaves out only its excluded namespaces: the compiled
//! configuration's Pods would still be sent to a webhook. It would also compile the 1,000
//! rules of `initium-1000` it can (policies that never match, as their namespace is excluded,
//! but that the API server looks at on every request, in every configuration's namespace);
//! and the two instances would write each rule's `ServedByAPIServer` condition, one adding it
//! and the other removing it, over and over. So the compiled configurations get a control
//! plane of their own, with their own baseline:
//!
//! | config | namespace (second plane) | what mutates its Pods |
//! |---|---|---|
//! | none-2 | bench-none-2 | nothing (excluded by initium) |
//! | map-same | bench-map-same | a hand-written MutatingAdmissionPolicy (ApplyConfiguration): the `test-ca` Secret volume and the annotation with the namespace |
//! | initium-compiled | bench-initium-compiled | a MutationRule doing the same (`upsert` of the volume, `merge` of the annotation from `{{ $.metadata.namespace }}`), served by the API server through the policy initium generated |
//!
//! Before measuring, the rule is `ServedByAPIServer=True`, its generated policy and binding
//! exist, the second plane has no MutatingWebhookConfiguration at all (initium deletes its own
//! once every rule it serves is compiled), and a dry-run Pod comes back mutated. The API
//! server's metrics then say how many times a webhook was called on the second plane while
//! measuring (it should be none).
//!
//! # `--compiled-scale 10,100,1000`
//!
//! For each N, N compilable MutationRules (the rule above), one per namespace
//! (`bench-tenant-0000` ...), on two planes: one served by the API server (`--compile-rules
//! auto`: N generated policies and bindings, no webhook), one by initium's webhook
//! (`--compile-rules off`). Pods are created in `bench-tenant-0000` and in `bench-none`
//! (excluded by initium) on both planes, alternating as in the main benchmark. The API server
//! matches every binding on every request, so the compiled plane's cost may grow with N, in
//! every namespace (`compiled-none`); initium's index looks at the rules of the Pod's
//! namespace only. The planes grow from one N to the next (the rules of the smaller N stay).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use serde_json::{Value, json};

use super::apiserver::Snapshot;
use super::support::cluster::{create_rules, ready_rules, rule_resource};
use super::support::measure::{Percentiles, machine, mib, round};
use super::support::plane::Plane;
use super::support::process::{Initium, InitiumOptions};
use super::support::wait::poll;
use super::{
    Args, Config, INITIUM_COMPILED, MAP_SAME, Mutation, NONE_2, RunFigures, SERVED, Served,
    dry_run_as_wanted, mean, measure, median, p50, served_line,
};

/// The `--webhook-name` of the second instance: the owner of the policies it generates.
const OWNER: &str = "initium-compiled";

/// The condition that says a rule is served by the API server.
const SERVED_BY_API_SERVER: &str = "ServedByAPIServer";

/// The compilable rule closest to examples/test-ca: its volume and its annotation (mounting
/// the volume in every container takes a forEach, which is not compiled).
pub fn compiled_rule(namespace: &str) -> Value {
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": "test-ca", "namespace": namespace},
        "spec": {
            "match": {"kinds": ["Pod"]},
            "mutations": [
                {"upsert": {"path": "/spec/volumes", "key": "name", "value": {"name": "test-ca", "secret": {"secretName": "test-ca"}}}},
                {"merge": {"metadata": {"annotations": {"certs.example.com/namespace": "{{ $.metadata.namespace }}"}}}}
            ]
        }
    })
}

/// `map-same`: what [`compiled_rule`] does, as a user would write the policy by hand, bound to
/// `bench-map-same` by label.
const MAP_SAME_POLICY: &str = r#"
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingAdmissionPolicy
metadata:
  name: bench-same
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
            volumes: [Object.spec.volumes{name: "test-ca", secret: Object.spec.volumes.secret{secretName: "test-ca"}}]
          }
        }
---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingAdmissionPolicyBinding
metadata:
  name: bench-same
spec:
  policyName: bench-same
  matchResources:
    namespaceSelector:
      matchLabels:
        initium-bench: map-same
"#;

fn admission_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Fails unless the plane serves MutatingAdmissionPolicy in v1, which initium compiles to.
fn require_v1(plane: &Plane) -> Result<Served> {
    let served = Served::of(plane)?;
    if served.map_api != "v1" {
        bail!(
            "initium compiles rules to admissionregistration.k8s.io/v1 MutatingAdmissionPolicies (Kubernetes 1.36 and later); this plane ({}) serves {} only: run without the compiled configurations (--no-compiled)",
            served.version,
            served.map_api
        );
    }
    Ok(served)
}

/// What a plane shows of the rules compiled by the initium named `owner`.
struct Compiled {
    rules: usize,
    ready: usize,
    served: usize,
    policies: Vec<String>,
    bindings: usize,
    webhooks: Vec<String>,
}

impl Compiled {
    async fn read(client: &kube::Client, owner: &str) -> Result<Compiled> {
        let rules: Api<DynamicObject> =
            Api::all_with(client.clone(), &rule_resource("MutationRule")?);
        let rules = rules.list(&ListParams::default()).await?.items;
        let has = |rule: &DynamicObject, type_: &str| {
            rule.data["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == type_ && c["status"] == "True")
        };
        let owned = ListParams::default().labels(&format!("initium.dev/compiled-by={owner}"));
        let policies: Api<DynamicObject> = Api::all_with(
            client.clone(),
            &admission_resource("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
        );
        let bindings: Api<DynamicObject> = Api::all_with(
            client.clone(),
            &admission_resource(
                "MutatingAdmissionPolicyBinding",
                "mutatingadmissionpolicybindings",
            ),
        );
        let webhooks: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        Ok(Compiled {
            rules: rules.len(),
            ready: rules.iter().filter(|r| has(r, "Ready")).count(),
            served: rules
                .iter()
                .filter(|r| has(r, SERVED_BY_API_SERVER))
                .count(),
            policies: policies
                .list(&owned)
                .await?
                .items
                .into_iter()
                .filter_map(|p| p.metadata.name)
                .collect(),
            bindings: bindings.list(&owned).await?.items.len(),
            webhooks: webhooks
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter_map(|w| w.metadata.name)
                .collect(),
        })
    }
}

/// Waits until the plane's `want` MutationRules are all Ready and served by the API server,
/// each with its generated policy and binding, and no MutatingWebhookConfiguration is left
/// on the plane (none of initium's, which it deletes when every rule it serves is compiled,
/// nor any other): no Pod of the plane is sent to a webhook. Returns the policies' names.
fn wait_compiled(
    runtime: &tokio::runtime::Runtime,
    client: &kube::Client,
    owner: &str,
    want: usize,
    timeout: Duration,
) -> Result<Vec<String>> {
    poll(
        &format!("{want} rules served by the API server and no webhook configuration"),
        timeout,
        Duration::from_secs(1),
        || {
            let seen = runtime.block_on(Compiled::read(client, owner))?;
            let done = seen.rules == want
                && seen.ready == want
                && seen.served == want
                && seen.policies.len() == want
                && seen.bindings == want
                && seen.webhooks.is_empty();
            Ok(if done {
                Ok(seen.policies)
            } else {
                Err(format!(
                    "{} rules, {} Ready, {} {SERVED_BY_API_SERVER}, {} policies and {} bindings of {owner}, webhook configurations {:?}",
                    seen.rules,
                    seen.ready,
                    seen.served,
                    seen.policies.len(),
                    seen.bindings,
                    seen.webhooks
                ))
            })
        },
    )
}

/// The second control plane of the main benchmark, with `none-2`, `map-same` and
/// `initium-compiled`, and the `initium serve --compile-rules auto` serving the latter.
/// Fields drop in order: initium stops before its plane.
pub struct Second {
    pub initium: Initium,
    pub client: kube::Client,
    /// The generated policy serving `initium-compiled`'s rule.
    pub policy: String,
    pub plane: Plane,
}

impl Second {
    pub fn start(runtime: &tokio::runtime::Runtime) -> Result<Second> {
        let plane = Plane::up("e2e-compiled")?;
        plane.install_crds()?;
        let client = runtime.block_on(plane.client())?;
        plane.ensure_namespace(NONE_2.namespace, &[])?;
        plane.ensure_namespace(MAP_SAME.namespace, &[("initium-bench", "map-same")])?;
        plane.ensure_namespace(INITIUM_COMPILED.namespace, &[])?;
        let served = require_v1(&plane)?;
        eprintln!("bench: second plane: {}", served.line());
        plane.apply(MAP_SAME_POLICY)?;
        runtime.block_on(create_rules(
            &client,
            &[compiled_rule(INITIUM_COMPILED.namespace)],
            1,
        ))?;
        let log = std::env::temp_dir().join(format!(
            "initium-bench-e2e-compiled-{}.log",
            std::process::id()
        ));
        let mut extra: Vec<String> = [
            "--compile-rules",
            "auto",
            "--webhook-name",
            OWNER,
            "--exclude-namespace",
            "kube-system",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        for config in [&NONE_2, &MAP_SAME] {
            extra.push("--exclude-namespace".into());
            extra.push(config.namespace.into());
        }
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
            "bench: second plane: initium --compile-rules auto serving (pid {}), log {}",
            initium.pid(),
            log.display()
        );
        let started = Instant::now();
        let policies = wait_compiled(runtime, &client, OWNER, 1, Duration::from_secs(300))?;
        let policy = policies.into_iter().next().context("no generated policy")?;
        eprintln!(
            "bench: second plane: the rule is served by the API server through {policy} ({:.1}s), no webhook configuration",
            started.elapsed().as_secs_f64()
        );
        Ok(Second {
            initium,
            client,
            policy,
            plane,
        })
    }
}

/// What an API server did between two snapshots, for Pods created on it.
struct PlaneView {
    /// Calls to mutating webhooks (any).
    webhook_calls: f64,
    /// Seconds in MutatingAdmissionPolicy checks, and how many (every policy).
    check_seconds: f64,
    checks: f64,
    /// Seconds in the MutatingAdmissionWebhook plugin, over every CREATE.
    webhook_seconds: f64,
    /// Seconds in the MutatingAdmissionPolicy plugin, over every CREATE.
    policy_seconds: f64,
}

impl PlaneView {
    fn between(before: &Metrics, after: &Metrics) -> PlaneView {
        let (check_seconds, checks) = after.checks_since(before, None);
        let (before, after) = (&before.snapshot, &after.snapshot);
        let delta =
            |name: &str, want: &[(&str, &str)]| after.sum(name, want) - before.sum(name, want);
        let plugin = |name: &str| {
            delta(
                "apiserver_admission_controller_admission_duration_seconds_sum",
                &[("name", name), ("operation", "CREATE"), ("type", "admit")],
            )
        };
        PlaneView {
            check_seconds,
            checks,
            webhook_calls: delta(
                "apiserver_admission_webhook_request_total",
                &[("type", "admit")],
            ),
            webhook_seconds: plugin("MutatingAdmissionWebhook"),
            policy_seconds: plugin("MutatingAdmissionPolicy"),
        }
    }
}

/// An API server's `/metrics`: the admission families [`Snapshot`] reads, and the time of
/// each MutatingAdmissionPolicy's checks (`apiserver_mutating_admission_policy_check_duration_seconds`,
/// by policy: its evaluation once its binding matched).
pub struct Metrics {
    snapshot: Snapshot,
    /// Policy → (seconds, checks).
    checks: BTreeMap<String, (f64, f64)>,
}

const CHECK: &str = "apiserver_mutating_admission_policy_check_duration_seconds";

impl Metrics {
    pub fn read(plane: &Plane) -> Result<Metrics> {
        let output = plane
            .kubectl()
            .args(["get", "--raw", "/metrics"])
            .output()
            .context("cannot run kubectl get --raw /metrics")?;
        anyhow::ensure!(
            output.status.success(),
            "kubectl get --raw /metrics failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let text = String::from_utf8_lossy(&output.stdout);
        let mut checks: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        for line in text.lines().filter(|l| l.starts_with(CHECK)) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let Some(policy) = ["{policy=\"", ",policy=\""]
                .iter()
                .find_map(|key| series.split_once(key))
                .and_then(|(_, rest)| rest.split_once('"'))
                .map(|(policy, _)| policy.to_owned())
            else {
                continue;
            };
            let entry = checks.entry(policy).or_default();
            if series.starts_with(&format!("{CHECK}_sum{{")) {
                entry.0 += value;
            } else if series.starts_with(&format!("{CHECK}_count{{")) {
                entry.1 += value;
            }
        }
        Ok(Metrics {
            snapshot: Snapshot::parse(&text),
            checks,
        })
    }

    /// (seconds, checks) of `policy`'s checks since `before` (every policy's: `None`).
    fn checks_since(&self, before: &Metrics, policy: Option<&str>) -> (f64, f64) {
        let total = |m: &Metrics| {
            m.checks
                .iter()
                .filter(|(name, _)| policy.is_none_or(|p| p == name.as_str()))
                .fold((0.0, 0.0), |(s, c), (_, (ds, dc))| (s + ds, c + dc))
        };
        let (after, before) = (total(self), total(before));
        (after.0 - before.0, after.1 - before.1)
    }
}

/// Milliseconds per Pod.
fn per_pod(seconds: f64, pods: u64) -> f64 {
    if pods == 0 {
        f64::NAN
    } else {
        1000.0 * seconds / pods as f64
    }
}

/// The second plane's API server during one run of the main benchmark.
pub struct SecondView {
    /// Mutating webhook calls on the second plane (should be none).
    pub webhook_calls: f64,
    /// MutatingAdmissionPolicy plugin time per Pod of `map-same` and `initium-compiled`.
    policy_ms: f64,
    policy_pods: u64,
    /// The checks of the hand-written policy and of the generated one: (ms per Pod of its
    /// configuration, checks per Pod). The API server counts one check per mutation.
    same: (f64, f64),
    generated: (f64, f64),
}

impl SecondView {
    /// `same_pods`, `generated_pods`: the Pods created in `map-same` and `initium-compiled`,
    /// warm-up included; `generated`: the generated policy's name.
    pub fn between(
        before: &Metrics,
        after: &Metrics,
        same_pods: u64,
        generated_pods: u64,
        generated: &str,
    ) -> SecondView {
        let view = PlaneView::between(before, after);
        let per = |policy: &str, pods: u64| {
            let (seconds, checks) = after.checks_since(before, Some(policy));
            (per_pod(seconds, pods), checks / pods as f64)
        };
        SecondView {
            webhook_calls: view.webhook_calls,
            policy_ms: per_pod(view.policy_seconds, same_pods + generated_pods),
            policy_pods: same_pods + generated_pods,
            same: per("bench-same", same_pods),
            generated: per(generated, generated_pods),
        }
    }

    pub fn print(&self) {
        println!(
            "  the second plane's API server: {:.0} mutating webhook calls (goal 0); plugin MutatingAdmissionPolicy {:.3} ms per Pod of map-same and initium-compiled ({} Pods); the policies' checks per Pod of their configuration: map-same {:.3} ms ({:.2} checks), initium-compiled's generated policy {:.3} ms ({:.2} checks)",
            self.webhook_calls,
            self.policy_ms,
            self.policy_pods,
            self.same.0,
            self.same.1,
            self.generated.0,
            self.generated.1
        );
    }

    pub fn json(&self) -> Value {
        json!({
            "webhook_calls": self.webhook_calls,
            "policy_plugin_ms_per_policy_pod": round(self.policy_ms, 3),
            "policy_pods": self.policy_pods,
            "map_same_check_ms_per_pod": round(self.same.0, 3),
            "map_same_checks_per_pod": round(self.same.1, 2),
            "generated_check_ms_per_pod": round(self.generated.0, 3),
            "generated_checks_per_pod": round(self.generated.1, 2),
        })
    }
}

/// `--compiled-scale`: the measured namespaces.
const TENANT: &str = "bench-tenant-0000";
const SCALE_NONE: &str = "bench-none";

/// `--compiled-scale`: plane 0 serves the rules by the API server, plane 1 by the webhook.
/// Added times are over `webhook-none`, the baseline that pays for no rule at all (on the
/// compiled plane every Pod, `compiled-none`'s too, passes the N bindings).
const SCALE_CONFIGS: [Config; 4] = [
    Config {
        name: "compiled-none",
        namespace: SCALE_NONE,
        mutates: false,
        mutation: Mutation::Same,
        plane: 0,
        none: "webhook-none",
    },
    Config {
        name: "compiled",
        namespace: TENANT,
        mutates: true,
        mutation: Mutation::Same,
        plane: 0,
        none: "webhook-none",
    },
    Config {
        name: "webhook-none",
        namespace: SCALE_NONE,
        mutates: false,
        mutation: Mutation::Same,
        plane: 1,
        none: "webhook-none",
    },
    Config {
        name: "webhook",
        namespace: TENANT,
        mutates: true,
        mutation: Mutation::Same,
        plane: 1,
        none: "webhook-none",
    },
];

fn tenant(i: u32) -> String {
    format!("bench-tenant-{i:04}")
}

/// One N of `--compiled-scale`.
struct Step {
    rules: u32,
    /// Creating the new rules until every one is served as it should be.
    setup_seconds: f64,
    runs: Vec<ScaleRun>,
}

struct ScaleRun {
    figures: RunFigures,
    compiled: PlaneView,
    webhook: PlaneView,
    /// Pods created per configuration, warm-up included.
    pods: u64,
    seconds: f64,
}

pub fn scale(args: &Args, runtime: &tokio::runtime::Runtime) -> Result<()> {
    let mut steps: Vec<u32> = args.compiled_scale.clone();
    steps.sort_unstable();
    steps.dedup();
    let planes = [
        Plane::up("e2e-scale-compiled")?,
        Plane::up("e2e-scale-webhook")?,
    ];
    let mut clients = Vec::new();
    for plane in &planes {
        plane.install_crds()?;
        plane.ensure_namespace(SCALE_NONE, &[])?;
        clients.push(runtime.block_on(plane.client())?);
    }
    let served = require_v1(&planes[0])?;
    eprintln!("bench: {}", served.line());
    let _ = SERVED.set(served);
    let mut initiums = Vec::new();
    for (plane, (label, compile)) in planes
        .iter()
        .zip([("compiled", "auto"), ("webhook", "off")])
    {
        let log = std::env::temp_dir().join(format!(
            "initium-bench-e2e-scale-{label}-{}.log",
            std::process::id()
        ));
        let extra: Vec<String> = [
            "--compile-rules",
            compile,
            // N compiled rules, whatever the default cap: the cap is what this measures.
            "--max-compiled-rules",
            "1000000",
            "--exclude-namespace",
            "kube-system",
            "--exclude-namespace",
            SCALE_NONE,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let initium = Initium::start(
            plane,
            InitiumOptions {
                namespace: "initium-bench".into(),
                extra,
                cpus: None,
                log: log.clone(),
            },
        )?;
        eprintln!(
            "bench: {label} plane: initium --compile-rules {compile} (pid {}), log {}",
            initium.pid(),
            log.display()
        );
        initiums.push(initium);
    }

    let mut done = Vec::new();
    let mut have = 0;
    for (step, &n) in steps.iter().enumerate() {
        let started = Instant::now();
        let rules: Vec<Value> = (have..n).map(|i| compiled_rule(&tenant(i))).collect();
        for client in &clients {
            runtime.block_on(create_rules(client, &rules, 16))?;
        }
        eprintln!(
            "bench: N = {n}: created {} rules on each plane in {:.1}s",
            rules.len(),
            started.elapsed().as_secs_f64()
        );
        let want = n as usize;
        wait_compiled(
            runtime,
            &clients[0],
            "initium",
            want,
            Duration::from_secs(1800),
        )?;
        eprintln!(
            "bench: N = {n}: compiled plane: {n} rules served by the API server, no webhook configuration ({:.1}s)",
            started.elapsed().as_secs_f64()
        );
        poll(
            "every rule Ready on the webhook plane",
            Duration::from_secs(1800),
            Duration::from_secs(1),
            || {
                let ready = runtime.block_on(ready_rules(&clients[1]))?;
                Ok((ready >= want)
                    .then_some(())
                    .ok_or_else(|| format!("{ready} of {want} rules Ready")))
            },
        )?;
        for config in &SCALE_CONFIGS {
            dry_run_as_wanted(runtime, &clients[config.plane], config)?;
        }
        let setup_seconds = started.elapsed().as_secs_f64();
        eprintln!("bench: N = {n}: every configuration in effect ({setup_seconds:.1}s)");
        let mut runs = Vec::new();
        for run in 0..args.runs {
            let started = Instant::now();
            let before = [Metrics::read(&planes[0])?, Metrics::read(&planes[1])?];
            let index = u32::try_from(step)? * args.runs + run;
            let latencies = runtime.block_on(measure(args, &clients, &SCALE_CONFIGS, index))?;
            let after = [Metrics::read(&planes[0])?, Metrics::read(&planes[1])?];
            let pods = u64::from(args.pods.div_ceil(args.batch) * args.batch)
                + u64::from(args.warmup.div_ceil(args.batch) * args.batch);
            let seconds = started.elapsed().as_secs_f64();
            eprintln!(
                "bench: N = {n}: run {} of {} measured in {seconds:.0}s",
                run + 1,
                args.runs
            );
            runs.push(ScaleRun {
                figures: RunFigures::new(latencies, &SCALE_CONFIGS),
                compiled: PlaneView::between(&before[0], &after[0]),
                webhook: PlaneView::between(&before[1], &after[1]),
                pods,
                seconds,
            });
        }
        done.push(Step {
            rules: n,
            setup_seconds,
            runs,
        });
        have = n;
    }
    let peaks: Vec<f64> = initiums
        .iter()
        .map(|i| i.memory().map(|m| mib(m.peak_kib)))
        .collect::<Result<_>>()?;
    drop(initiums);
    drop(planes);
    report(args, &done, &peaks);
    Ok(())
}

fn report(args: &Args, steps: &[Step], peaks: &[f64]) {
    println!("e2e benchmark, --compiled-scale: {}", machine());
    println!("  {}", served_line());
    println!(
        "  N MutationRules, one per namespace, served by the API server (compiled plane: N generated MutatingAdmissionPolicies and bindings, no webhook) or by initium's webhook (webhook plane); Pod CREATEs in one of those namespaces (compiled, webhook) and in a namespace without rules (compiled-none, webhook-none): {} Pods per configuration in rounds of {}, {} in flight, {} run(s) per N; added over webhook-none",
        args.pods, args.batch, args.concurrency, args.runs
    );
    let mut steps_json = Vec::new();
    let mut table = Vec::new();
    for step in steps {
        println!(
            "  N = {} (set up in {:.0} s; runs {}):",
            step.rules,
            step.setup_seconds,
            step.runs
                .iter()
                .map(|r| format!("{:.0} s", r.seconds))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let med = |f: &dyn Fn(&ScaleRun) -> f64| median(step.runs.iter().map(f).collect());
        let stat = |run: &ScaleRun, name: &str, f: &dyn Fn(&Percentiles) -> f64| {
            run.figures.stats.get(name).map_or(f64::NAN, f)
        };
        let mut configs_json = serde_json::Map::new();
        for config in &SCALE_CONFIGS {
            let p = med(&|r| stat(r, config.name, &p50));
            let m = med(&|r| stat(r, config.name, &mean));
            let p90 = med(&|r| stat(r, config.name, &|s| s.ms(0.9)));
            let p99 = med(&|r| stat(r, config.name, &|s| s.ms(0.99)));
            let added_p = med(&|r| r.figures.added(config.name, &p50));
            let added_m = med(&|r| r.figures.added(config.name, &mean));
            println!(
                "    {:<14} mean {m:6.3} ms  p50 {p:6.3} ms  p90 {p90:6.3} ms  p99 {p99:6.3} ms  (+{added_p:.3} ms p50, +{added_m:.3} ms mean over webhook-none)",
                config.name
            );
            configs_json.insert(
                config.name.to_string(),
                json!({
                    "mean_ms": round(m, 3),
                    "p50_ms": round(p, 3),
                    "p90_ms": round(p90, 3),
                    "p99_ms": round(p99, 3),
                    "added_p50_ms": round(added_p, 3),
                    "added_mean_ms": round(added_m, 3),
                }),
            );
        }
        let ratio_p50 = med(&|r| r.figures.ratio("compiled", "webhook").0);
        let ratio_mean = med(&|r| r.figures.ratio("compiled", "webhook").1);
        // The rule's own cost in its namespace, on its plane.
        let own = |r: &ScaleRun, a: &str, none: &str, f: &dyn Fn(&Percentiles) -> f64| {
            stat(r, a, f) - stat(r, none, f)
        };
        let compiled_own_p50 = med(&|r| own(r, "compiled", "compiled-none", &p50));
        let webhook_own_p50 = med(&|r| own(r, "webhook", "webhook-none", &p50));
        let policy_ms = med(&|r| per_pod(r.compiled.policy_seconds, 2 * r.pods));
        // The checks of the policies whose binding matched (the tenant's own), per tenant Pod;
        // the rest of the plugin's time is matching every binding against every Pod.
        let check_ms = med(&|r| per_pod(r.compiled.check_seconds, r.pods));
        let checks = med(&|r| r.compiled.checks / r.pods as f64);
        let webhook_ms = med(&|r| per_pod(r.webhook.webhook_seconds, r.pods));
        let compiled_calls: f64 = step.runs.iter().map(|r| r.compiled.webhook_calls).sum();
        let webhook_calls = med(&|r| r.webhook.webhook_calls / r.pods as f64);
        println!(
            "    ratio (compiled - webhook-none) / (webhook - webhook-none): median p50 {ratio_p50:.2}, mean {ratio_mean:.2}"
        );
        println!(
            "    in its own plane, over its none: compiled +{compiled_own_p50:.3} ms p50, webhook +{webhook_own_p50:.3} ms p50"
        );
        println!(
            "    compiled plane's API server: plugin MutatingAdmissionPolicy {policy_ms:.3} ms per Pod (every Pod of the plane), of which policy checks {check_ms:.3} ms per tenant Pod ({checks:.3} checks per tenant Pod), {compiled_calls:.0} mutating webhook calls; webhook plane's: plugin MutatingAdmissionWebhook {webhook_ms:.3} ms per tenant Pod, {webhook_calls:.3} webhook calls per tenant Pod"
        );
        table.push((
            step.rules,
            med(&|r| r.figures.added("compiled", &p50)),
            med(&|r| r.figures.added("webhook", &p50)),
            med(&|r| r.figures.added("compiled-none", &p50)),
            policy_ms,
            check_ms,
        ));
        let runs_json: Vec<Value> = step
            .runs
            .iter()
            .map(|r| {
                let configs: serde_json::Map<String, Value> = r
                    .figures
                    .stats
                    .iter()
                    .map(|(name, s)| {
                        (
                            (*name).to_string(),
                            json!({
                                "mean_ms": round(s.mean_ms(), 3),
                                "p50_ms": round(s.ms(0.5), 3),
                                "p90_ms": round(s.ms(0.9), 3),
                                "p99_ms": round(s.ms(0.99), 3),
                                "n": s.len(),
                            }),
                        )
                    })
                    .collect();
                json!({
                    "seconds": round(r.seconds, 1),
                    "configs": configs,
                    "policy_plugin_ms_per_pod_compiled_plane": round(per_pod(r.compiled.policy_seconds, 2 * r.pods), 3),
                    "policy_check_ms_per_tenant_pod": round(per_pod(r.compiled.check_seconds, r.pods), 3),
                    "webhook_calls_compiled_plane": r.compiled.webhook_calls,
                    "webhook_plugin_ms_per_tenant_pod": round(per_pod(r.webhook.webhook_seconds, r.pods), 3),
                    "webhook_calls_per_tenant_pod": round(r.webhook.webhook_calls / r.pods as f64, 3),
                })
            })
            .collect();
        steps_json.push(json!({
            "rules": step.rules,
            "setup_seconds": round(step.setup_seconds, 1),
            "median": configs_json,
            "ratio_compiled_to_webhook_p50": round(ratio_p50, 2),
            "ratio_compiled_to_webhook_mean": round(ratio_mean, 2),
            "compiled_over_compiled_none_p50_ms": round(compiled_own_p50, 3),
            "webhook_over_webhook_none_p50_ms": round(webhook_own_p50, 3),
            "policy_plugin_ms_per_pod_compiled_plane": round(policy_ms, 3),
            "policy_check_ms_per_tenant_pod": round(check_ms, 3),
            "policy_checks_per_tenant_pod": round(checks, 3),
            "webhook_calls_compiled_plane": compiled_calls,
            "webhook_plugin_ms_per_tenant_pod": round(webhook_ms, 3),
            "runs": runs_json,
        }));
    }
    println!("  added p50 over webhook-none (median of runs):");
    println!(
        "         N   compiled    webhook  compiled-none  MAP plugin per Pod  MAP checks per tenant Pod"
    );
    for (n, compiled, webhook, none, policy, check) in &table {
        println!(
            "    {n:>6}  {compiled:7.3} ms {webhook:7.3} ms  {none:10.3} ms  {policy:15.3} ms  {check:21.3} ms"
        );
    }
    println!(
        "  peak memory (VmHWM): initium --compile-rules auto {:.1} MiB, --compile-rules off {:.1} MiB",
        peaks.first().copied().unwrap_or(f64::NAN),
        peaks.get(1).copied().unwrap_or(f64::NAN)
    );
    let line = json!({
        "bench": "e2e",
        "mode": "compiled-scale",
        "pods": args.pods,
        "concurrency": args.concurrency,
        "batch": args.batch,
        "runs": args.runs,
        "steps": steps_json,
        "initium_compiled_peak_rss_mib": peaks.first().map(|p| round(*p, 1)),
        "initium_webhook_peak_rss_mib": peaks.get(1).map(|p| round(*p, 1)),
    });
    println!("{line}");
}
