//! Gate benchmark (issue 11): many Pods held by one gate rule, then released at once.
//!
//! On a whole cluster of its own (`up --nodes N`: controller manager, scheduler, kwok nodes of
//! 250 Pods each) with `initium serve` running out of cluster, one MutationRule in
//! `bench-gate` gates every Pod of the namespace but the backend's own until the Service
//! `backend` has a ready endpoint. Then:
//!
//! 1. **Wait.** `--deployments` Deployments of `--replicas` Pods are created; the benchmark
//!    waits until every Pod exists, carries the rule's gate and the gated label, and is
//!    `SchedulingGated`, then holds them `--hold-seconds` longer. Over that whole window
//!    (first Deployment created to the backend created) it counts initium's requests to the
//!    API server by verb, and samples initium's resident memory. Waiting must cost nothing
//!    per Pod: the goal is zero GET/LIST on pods in the window.
//! 2. **Release.** It creates the Service and a one-replica backend Deployment, and watches
//!    (its own watches) the Service's EndpointSlices and the Pods: the release latency of a
//!    Pod is the moment its `initium.dev/` gate is seen gone minus the moment the first ready
//!    endpoint is seen, both observed by the benchmark. It also reads initium's own
//!    `initium_gate_release_latency_seconds` histogram, and waits for every Pod to be Running.
//!    Goals: p99 ≤ 500 ms, every Pod released within 5 s.
//!
//! initium's requests are counted from kube-apiserver's audit log (`Metadata` level, the
//! plane's admin user only, enabled through `INITIUM_PLANE_APISERVER_ARGS`): initium and the
//! benchmark both use the plane's admin kubeconfig, and initium's requests are the ones with
//! its user agent, `initium/<version>` (the benchmark's own client sends
//! `initium-gate-bench`). The API server's `apiserver_request_total` has no user or
//! user-agent label, so it cannot tell them apart.
//!
//! The controller manager and the scheduler run with their client rate limits raised
//! (`--kube-api-qps 200`): at the default 20 requests/s the ReplicaSet controller needs a
//! minute to create 1,000 Pods, and the scheduler 20 s to bind them after release.
//!
//!     scripts/bench gate [--deployments 10] [--replicas 100] [--nodes 5] [--timeout-seconds S]
//!     cargo bench --bench gate -- --deployments 2 --replicas 20
//!
//! With `--floor`, the same run with the benchmark, not initium, removing the gates: the rule
//! waits for a Service that never gets an endpoint, so initium gates every Pod and holds it,
//! and the moment the backend's endpoint is seen ready the benchmark writes the same merge
//! patch initium writes (gate and gated label removed), `--floor-concurrency` writes in
//! flight (64, initium's default `--gate-release-concurrency`). Everything else is the same
//! cluster doing the same work, so its release latencies are what a plain client gets from
//! this API server on this machine: the floor under initium's figures.
//!
//! With `--compare N`, N runs of each, alternating (initium first), each its own process and
//! cluster, and the median of initium's release p99 over the floor's, pair by pair.
//!
//! If Pods are not released within `--timeout-seconds` of the endpoint being ready (no gate
//! controller running, say), it reports what it measured, says so, and exits with status 1.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};

use initium::api::{GATE_PREFIX, GATED_LABEL};
use support::cluster::{create_rules, ready_rules};
use support::measure::{Percentiles, machine, mib, round};
use support::plane::Plane;
use support::process::{Initium, InitiumOptions, metric_sum};
use support::workloads::service;

/// Many Pods held by one gate rule until a Service has a ready endpoint, then released: what
/// waiting costs initium, and how fast it releases.
#[derive(Parser, Debug)]
struct Args {
    /// Deployments whose Pods the rule gates.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100))]
    deployments: u32,
    /// Replicas of each Deployment.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    replicas: u32,
    /// Simulated nodes, 250 Pods each: enough for every Pod and the backend once released.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    nodes: u32,
    /// The deadline of each phase (Pods gated, endpoint ready, Pods released, Pods Running).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(5..=3_600))]
    timeout_seconds: u64,
    /// How long every Pod is held, all gated, before the backend is created: part of the
    /// window over which initium's requests are counted.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=3_600))]
    hold_seconds: u64,
    /// The benchmark removes the gates itself instead of initium (see the module
    /// documentation): the floor a plain client reaches on this machine.
    #[arg(long)]
    floor: bool,
    /// With --floor: release writes in flight.
    #[arg(long, default_value_t = 64, requires = "floor",
          value_parser = clap::value_parser!(u32).range(1..=1_000))]
    floor_concurrency: u32,
    /// Alternate initium and the floor (`--floor`), this many times each, each run on a
    /// cluster of its own with the other flags as given; report each run's release p99 and
    /// the median of initium's p99 over the floor's.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=20), conflicts_with = "floor")]
    compare: Option<u32>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The namespace of the rule, the gated Deployments, the backend and its Service.
const NAMESPACE: &str = "bench-gate";
/// The gate rule.
const RULE: &str = "wait-for-backend";
/// The Service the rule waits for, its Deployment and their Pods' `app` label.
const BACKEND: &str = "backend";
/// The label of every gated Pod (and nothing else): `initium-bench=gated`.
const GATED_POD_LABEL: (&str, &str) = ("initium-bench", "gated");
/// What a kwok node holds (docs/control-plane.md).
const PODS_PER_NODE: u32 = 250;
/// The benchmark client's user agent, to tell its requests from initium's in the audit log.
const BENCH_USER_AGENT: &str = "initium-gate-bench";
/// The plane's admin user, whose kubeconfig initium and the benchmark use.
const ADMIN_USER: &str = "initium-admin";
/// initium's own namespace.
const INITIUM_NAMESPACE: &str = "initium-bench";
/// The goals of issue 11.
const GOAL_P99_MS: f64 = 500.0;
const GOAL_ALL_RELEASED_S: f64 = 5.0;

/// Only the admin user's requests, at `Metadata` level (verb, resource, user agent, times);
/// the controllers' and nodes' requests are not logged at all.
const AUDIT_POLICY: &str = "\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: [initium-admin]
  - level: None
";

fn main() {
    let args = Args::parse();
    if let Some(runs) = args.compare {
        match compare(runs) {
            Ok(()) => return,
            Err(e) => {
                eprintln!("gate benchmark failed: {e:#}");
                std::process::exit(1);
            }
        }
    }
    match run(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("gate benchmark failed: {e:#}");
            std::process::exit(1);
        }
    }
}

/// `--compare N`: this benchmark run again, N times with initium releasing and N times with
/// `--floor`, alternating (initium first), each a process and a cluster of its own; then each
/// run's release figures and the median ratio of initium's p99 to the floor's (the ratio of
/// each pair, so both sides of a ratio ran minutes apart).
fn compare(runs: u32) -> Result<()> {
    let exe = std::env::current_exe().context("finding the benchmark's own binary")?;
    // The other flags as given, without --compare and its value.
    let mut passed = Vec::new();
    let mut given = std::env::args().skip(1);
    while let Some(arg) = given.next() {
        if arg == "--compare" {
            given.next();
        } else if !arg.starts_with("--compare=") {
            passed.push(arg);
        }
    }
    let mut pairs = Vec::new();
    for run in 1..=runs {
        let mut pair = Vec::new();
        for floor in [false, true] {
            let releaser = if floor { "floor" } else { "initium" };
            eprintln!("bench: compare: run {run} of {runs}, {releaser}");
            let mut command = std::process::Command::new(&exe);
            command.args(&passed);
            if floor {
                command.arg("--floor");
            }
            let out = command
                .stderr(std::process::Stdio::inherit())
                .output()
                .with_context(|| format!("running {}", exe.display()))?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            print!("{stdout}");
            let line: Value = stdout
                .lines()
                .rev()
                .find_map(|l| serde_json::from_str(l).ok())
                .with_context(|| format!("run {run} ({releaser}) printed no JSON summary"))?;
            if line["complete"] != true {
                bail!("run {run} ({releaser}) did not release every Pod: see its report above");
            }
            let writes = &line["release"]["writes"];
            pair.push((
                line["release"]["p99_ms"].as_f64().unwrap_or(f64::NAN),
                line["release"]["p50_ms"].as_f64().unwrap_or(f64::NAN),
                line["release"]["all_released_s"]
                    .as_f64()
                    .unwrap_or(f64::NAN),
                format!(
                    "first write {} ms after ready, {} in flight on average, server p50 {} ms, slot empty p50 {} ms",
                    writes["first_received_ms"],
                    writes["mean_in_flight"],
                    writes["server_p50_ms"],
                    writes["refill_p50_ms"]
                ),
            ));
        }
        let floor = pair.pop().context("no floor run")?;
        let initium = pair.pop().context("no initium run")?;
        pairs.push((initium, floor));
    }
    println!(
        "gate --compare {runs}: release latency after the endpoint was ready, initium then the floor"
    );
    let mut ratios = Vec::new();
    for (i, (initium, floor)) in pairs.iter().enumerate() {
        let ratio = initium.0 / floor.0;
        ratios.push(ratio);
        println!(
            "  run {}: initium p50 {:.0} ms p99 {:.0} ms (all {:.2} s); floor p50 {:.0} ms p99 {:.0} ms (all {:.2} s); p99 ratio {ratio:.2}",
            i + 1,
            initium.1,
            initium.0,
            initium.2,
            floor.1,
            floor.0,
            floor.2
        );
        println!(
            "    writes (audit log): initium {}; floor {}",
            initium.3, floor.3
        );
    }
    let mut sorted = ratios.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    println!(
        "  median p99 ratio initium / floor: {median:.2} (goal <= 1.00: {})",
        if median <= 1.0 { "met" } else { "not met" }
    );
    println!(
        "{}",
        json!({
            "bench": "gate-compare",
            "runs": runs,
            "p99_ratios": ratios.iter().map(|r| round(*r, 3)).collect::<Vec<_>>(),
            "median_p99_ratio": round(median, 3),
            "goal_met": median <= 1.0,
        })
    );
    Ok(())
}

/// The gate the rule adds (`engine::gate_name`: `initium.dev/<namespace>.<rule>`).
fn gate() -> String {
    format!("{GATE_PREFIX}{NAMESPACE}.{RULE}")
}

/// The Service the rule waits for with --floor: never created, so initium holds every Pod
/// and the benchmark is the only one to release them.
const NEVER_READY: &str = "never-ready";

/// The gate rule: every Pod of the namespace but the backend's waits for the Service
/// (`backend`, or with --floor one that never gets an endpoint).
fn rule(floor: bool) -> Value {
    let service = if floor { NEVER_READY } else { BACKEND };
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": RULE, "namespace": NAMESPACE},
        "spec": {
            "match": {"kinds": ["Pod"]},
            // The backend's Pods must not wait for themselves.
            "exclude": {"labels": {"matchLabels": {"app": BACKEND}}},
            "gate": {"waitFor": [{"service": {"name": service}}], "timeout": "10m"},
        }
    })
}

/// A Deployment of `replicas` Pods labelled `app: <name>` (plus `extra`).
fn deployment(name: &str, replicas: u32, extra: &[(&str, &str)]) -> Result<Deployment> {
    let mut labels = serde_json::Map::new();
    labels.insert("app".into(), name.into());
    for (k, v) in extra {
        labels.insert((*k).into(), (*v).into());
    }
    serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{
                    "name": "app",
                    "image": "registry.example.com/app:1",
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                }]},
            },
        }
    }))
    .context("the benchmark's Deployment")
}

/// Whether the Pod carries any `initium.dev/` scheduling gate.
fn has_initium_gate(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .into_iter()
        .flatten()
        .any(|g| g.name.starts_with(GATE_PREFIX))
}

/// Whether the scheduler reports the Pod `PodScheduled=False` with reason `SchedulingGated`.
fn scheduling_gated(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("SchedulingGated")
        })
}

/// What the benchmark's Pod watch saw of one gated Pod.
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// Whether the Pod carried the gate when first seen (created through admission, it must).
    gated_at_first_sight: bool,
    /// The first event without the gate.
    released: Option<Instant>,
    /// The first event in phase Running.
    running: Option<Instant>,
}

type PodsSeen = Arc<Mutex<BTreeMap<String, Seen>>>;

/// A client for the plane that sends `User-Agent: initium-gate-bench`.
async fn bench_client(kubeconfig: &Path) -> Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.headers.push((
        hyper::header::USER_AGENT,
        hyper::header::HeaderValue::from_static(BENCH_USER_AGENT),
    ));
    Ok(kube::Client::try_from(config)?)
}

/// Watches the gated Pods, recording when each is first seen without its gate and Running.
fn watch_pods(runtime: &tokio::runtime::Runtime, client: &kube::Client) -> PodsSeen {
    let seen: PodsSeen = Arc::default();
    let api: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let config =
        watcher::Config::default().labels(&format!("{}={}", GATED_POD_LABEL.0, GATED_POD_LABEL.1));
    let record = seen.clone();
    runtime.spawn(async move {
        let mut pods = std::pin::pin!(watcher(api, config).default_backoff().applied_objects());
        while let Some(pod) = pods.next().await {
            let pod = match pod {
                Ok(pod) => pod,
                Err(e) => {
                    eprintln!("bench: the Pod watch failed (it retries): {e}");
                    continue;
                }
            };
            let now = Instant::now();
            let gated = has_initium_gate(&pod);
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            let Some(name) = pod.metadata.name else {
                continue;
            };
            let mut map = record.lock().expect("not poisoned");
            let entry = map.entry(name).or_insert(Seen {
                gated_at_first_sight: gated,
                released: None,
                running: None,
            });
            if !gated && entry.released.is_none() {
                entry.released = Some(now);
            }
            if running && entry.running.is_none() {
                entry.running = Some(now);
            }
        }
    });
    seen
}

/// Watches the backend's EndpointSlices, recording when a ready endpoint is first seen.
fn watch_endpoints(
    runtime: &tokio::runtime::Runtime,
    client: &kube::Client,
) -> Arc<Mutex<Option<Instant>>> {
    let ready: Arc<Mutex<Option<Instant>>> = Arc::default();
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
    let config =
        watcher::Config::default().labels(&format!("kubernetes.io/service-name={BACKEND}"));
    let record = ready.clone();
    runtime.spawn(async move {
        let mut slices = std::pin::pin!(watcher(api, config).default_backoff().applied_objects());
        while let Some(slice) = slices.next().await {
            let Ok(slice) = slice else { continue };
            let now = Instant::now();
            let any_ready = slice
                .endpoints
                .iter()
                .any(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true));
            let mut first = record.lock().expect("not poisoned");
            if any_ready && first.is_none() {
                *first = Some(now);
            }
        }
    });
    ready
}

/// Polls `check` every `every` until it returns `Some`, for at most `timeout`; `None` then
/// (the caller says what it last saw).
async fn wait_for<T, F, Fut>(timeout: Duration, every: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// Microseconds since the Unix epoch.
fn epoch_micros(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// An audit event's timestamp (`2025-11-24T11:30:48.123456Z`, RFC 3339 in UTC) in
/// microseconds since the Unix epoch.
fn parse_timestamp(text: &str) -> Option<i64> {
    let (date, time) = text.split_once('T')?;
    let mut ymd = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, d) = (ymd.next()?.ok()?, ymd.next()?.ok()?, ymd.next()?.ok()?);
    let time = time.strip_suffix('Z')?;
    let (hms, fraction) = time.split_once('.').unwrap_or((time, ""));
    let mut hms = hms.split(':').map(|p| p.parse::<i64>());
    let (h, mi, s) = (hms.next()?.ok()?, hms.next()?.ok()?, hms.next()?.ok()?);
    let micros: String = fraction.chars().chain("000000".chars()).take(6).collect();
    let micros: i64 = micros.parse().ok()?;
    // Days from 1970-01-01 to the date (Howard Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3_600 + mi * 60 + s) * 1_000_000 + micros)
}

/// initium's requests in a time window, by verb: all of them, those on Pods, and all of them
/// by verb and resource (`patch leases`).
#[derive(Debug, Default)]
struct Requests {
    all: BTreeMap<String, u64>,
    pods: BTreeMap<String, u64>,
    by_resource: BTreeMap<String, u64>,
    /// The API server's time for each of initium's Pod patches (request received → response
    /// complete, from the audit log), in microseconds: how much of a release wave is the API
    /// server's.
    patch_pod_server_us: Vec<u32>,
}

impl Requests {
    fn pods(&self, verb: &str) -> u64 {
        self.pods.get(verb).copied().unwrap_or(0)
    }

    fn total(&self) -> u64 {
        self.all.values().sum()
    }

    /// `get 3, list 1, watch 5` (all verbs seen), for the summary.
    fn describe(counts: &BTreeMap<String, u64>) -> String {
        if counts.is_empty() {
            return "none".into();
        }
        counts
            .iter()
            .map(|(verb, n)| format!("{verb} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn json(&self) -> Value {
        let server = Percentiles::new(self.patch_pod_server_us.clone());
        let patch_pods_server_ms = (!server.is_empty()).then(|| {
            json!({"p50": round(server.ms(0.50), 1), "p99": round(server.ms(0.99), 1),
                   "mean": round(server.mean_ms(), 1)})
        });
        json!({
            "all": self.all,
            "pods": self.pods,
            "by_resource": self.by_resource,
            "total": self.total(),
            "patch_pods_server_ms": patch_pods_server_ms,
        })
    }
}

/// initium's requests in the audit log, in the windows `[from, to)` (epoch microseconds);
/// also the user agents initium's requests carried.
fn count_requests(log: &Path, windows: &[(i64, i64)]) -> Result<(Vec<Requests>, Vec<String>)> {
    let text = std::fs::read_to_string(log)
        .with_context(|| format!("cannot read the audit log {}", log.display()))?;
    let mut counted: Vec<Requests> = windows.iter().map(|_| Requests::default()).collect();
    let mut agents: Vec<String> = Vec::new();
    for line in text.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let verb = event["verb"].as_str().unwrap_or_default();
        let stage = event["stage"].as_str().unwrap_or_default();
        // One event per request: a watch when its response starts (it completes only when
        // the watch ends), anything else when it completes.
        let counts = if verb == "watch" {
            stage == "ResponseStarted"
        } else {
            stage == "ResponseComplete"
        };
        let agent = event["userAgent"].as_str().unwrap_or_default();
        // initium's requests carry `User-Agent: initium/<version>`.
        if !counts || event["user"]["username"] != ADMIN_USER || !agent.starts_with("initium/") {
            continue;
        }
        if !agents.iter().any(|a| a == agent) {
            agents.push(agent.to_owned());
        }
        let Some(at) = event["requestReceivedTimestamp"]
            .as_str()
            .and_then(parse_timestamp)
        else {
            continue;
        };
        let on_pods = event["objectRef"]["resource"] == "pods"
            && event["objectRef"]["apiGroup"]
                .as_str()
                .unwrap_or_default()
                .is_empty();
        for (requests, (from, to)) in counted.iter_mut().zip(windows) {
            if (*from..*to).contains(&at) {
                *requests.all.entry(verb.to_owned()).or_default() += 1;
                let resource = match event["objectRef"]["subresource"].as_str() {
                    Some(sub) => format!(
                        "{}/{sub}",
                        event["objectRef"]["resource"].as_str().unwrap_or("-")
                    ),
                    None => event["objectRef"]["resource"]
                        .as_str()
                        .unwrap_or("-")
                        .to_owned(),
                };
                *requests
                    .by_resource
                    .entry(format!("{verb} {resource}"))
                    .or_default() += 1;
                if on_pods {
                    *requests.pods.entry(verb.to_owned()).or_default() += 1;
                    let done = event["stageTimestamp"].as_str().and_then(parse_timestamp);
                    if verb == "patch"
                        && let Some(done) = done
                    {
                        requests
                            .patch_pod_server_us
                            .push(u32::try_from(done - at).unwrap_or(u32::MAX));
                    }
                }
            }
        }
    }
    Ok((counted, agents))
}

/// The release writes in the audit log, whoever wrote them (initium, or the benchmark with
/// --floor): Pod patches by the admin user in `[from, to)`, placed against the moment the
/// endpoint was seen ready. The same figures for both releasers, so a run and its floor can
/// be compared write by write.
#[derive(Debug, Default)]
struct Writes {
    count: usize,
    /// Endpoint seen ready to the first write received by the API server, ms.
    first_received_ms: f64,
    /// Endpoint seen ready to the last write completed, ms.
    last_done_ms: f64,
    /// Writes in the API server at once, averaged over first received to last completed.
    mean_in_flight: f64,
    /// The API server's time per write, microseconds.
    server_us: Vec<u32>,
    /// With `n` writes in flight, the k-th write received minus the (k-n)-th completed, in
    /// microseconds: how long a slot stays empty outside the API server (response to the
    /// writer, the writer's next request to the API server).
    refill_us: Vec<u32>,
}

fn release_writes(
    log: &Path,
    ready_us: i64,
    (from, to): (i64, i64),
    in_flight: usize,
) -> Result<Writes> {
    let text = std::fs::read_to_string(log)
        .with_context(|| format!("cannot read the audit log {}", log.display()))?;
    let mut spans = Vec::new();
    for line in text.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let agent = event["userAgent"].as_str().unwrap_or_default();
        if event["stage"] != "ResponseComplete"
            || event["verb"] != "patch"
            || event["objectRef"]["resource"] != "pods"
            || event["objectRef"]["subresource"].is_string()
            || !(agent.starts_with("initium/") || agent == BENCH_USER_AGENT)
        {
            continue;
        }
        let (Some(at), Some(done)) = (
            event["requestReceivedTimestamp"]
                .as_str()
                .and_then(parse_timestamp),
            event["stageTimestamp"].as_str().and_then(parse_timestamp),
        ) else {
            continue;
        };
        if (from..to).contains(&at) {
            spans.push((at, done));
        }
    }
    let (Some(first), Some(last)) = (
        spans.iter().map(|s| s.0).min(),
        spans.iter().map(|s| s.1).max(),
    ) else {
        return Ok(Writes::default());
    };
    let busy: i64 = spans.iter().map(|(at, done)| done - at).sum();
    let mut received: Vec<i64> = spans.iter().map(|s| s.0).collect();
    let mut completed: Vec<i64> = spans.iter().map(|s| s.1).collect();
    received.sort_unstable();
    completed.sort_unstable();
    let refill_us = received
        .iter()
        .skip(in_flight)
        .zip(&completed)
        .map(|(at, freed)| u32::try_from((at - freed).max(0)).unwrap_or(u32::MAX))
        .collect();
    Ok(Writes {
        count: spans.len(),
        first_received_ms: (first - ready_us) as f64 / 1000.0,
        last_done_ms: (last - ready_us) as f64 / 1000.0,
        mean_in_flight: busy as f64 / (last - first).max(1) as f64,
        server_us: spans
            .iter()
            .map(|(at, done)| u32::try_from(done - at).unwrap_or(u32::MAX))
            .collect(),
        refill_us,
    })
}

/// A Prometheus histogram on initium's `/metrics`, if it is there.
#[derive(Debug)]
struct Histogram {
    count: f64,
    sum: f64,
    /// (upper bound, cumulative count), summed over label sets, by bound.
    buckets: Vec<(f64, f64)>,
}

impl Histogram {
    fn parse(exposition: &str, name: &str) -> Option<Histogram> {
        let bucket = format!("{name}_bucket{{");
        let mut buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for line in exposition.lines().filter(|l| l.starts_with(&bucket)) {
            let Some(le) = line
                .split("le=\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
            else {
                continue;
            };
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::NAN)
            };
            let value: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            let slot = buckets.entry(bound.to_bits()).or_insert((bound, 0.0));
            slot.1 += value;
        }
        if buckets.is_empty() {
            return None;
        }
        let mut buckets: Vec<(f64, f64)> = buckets.into_values().collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Histogram {
            count: metric_sum(exposition, &format!("{name}_count")),
            sum: metric_sum(exposition, &format!("{name}_sum")),
            buckets,
        })
    }

    /// The upper bound of the bucket holding the `q` quantile, in seconds.
    fn quantile_bound(&self, q: f64) -> Option<f64> {
        let want = q * self.count;
        self.buckets
            .iter()
            .find(|(_, cumulative)| *cumulative >= want && *cumulative > 0.0)
            .map(|(bound, _)| *bound)
    }
}

/// A metric on initium's `/metrics`, if the exposition has it at all.
fn metric_opt(exposition: &str, name: &str) -> Option<f64> {
    exposition
        .lines()
        .any(|l| {
            !l.starts_with('#')
                && l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{']))
        })
        .then(|| metric_sum(exposition, name))
}

/// What the wait phase measured.
struct Wait {
    /// First Deployment created to every Pod gated.
    all_gated_s: f64,
    /// The whole counted window: first Deployment created to the backend created.
    window_s: f64,
    rss_max_kib: u64,
    rss_end_kib: u64,
    /// initium's `initium_gated_pods` at the end of the wait, if it has the metric.
    gated_pods_metric: Option<f64>,
}

/// What the release phase measured.
struct Release {
    /// Backend created to its first ready endpoint seen.
    endpoint_ready_s: f64,
    /// When the first ready endpoint was seen, in microseconds since the Unix epoch (to place
    /// the audit log's release writes against it).
    endpoint_ready_epoch_us: i64,
    /// Release latency per released Pod, microseconds.
    latencies: Percentiles,
    released: usize,
    /// Released Pods seen without their gate before the endpoint was seen ready.
    released_before_endpoint: usize,
    /// Endpoint ready to the last Pod released, if all were.
    all_released_s: Option<f64>,
    /// Endpoint ready to the last Pod Running, if all were.
    all_running_s: Option<f64>,
    running: usize,
    histogram: Option<Histogram>,
    releases_total_metric: Option<f64>,
    /// Why the phase ended early, if it did.
    incomplete: Option<String>,
}

fn run(args: &Args) -> Result<bool> {
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let pods = (args.deployments * args.replicas) as usize;
    let slots = args.nodes * PODS_PER_NODE;
    if (pods as u32) + 1 > slots {
        bail!(
            "{pods} Pods and the backend need {} nodes of {PODS_PER_NODE} Pods; --nodes {} hold {slots}",
            (pods as u32 + 1).div_ceil(PODS_PER_NODE),
            args.nodes
        );
    }
    let timeout = Duration::from_secs(args.timeout_seconds);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    let audit_dir = tempfile::Builder::new()
        .prefix("initium-bench-gate-audit-")
        .tempdir()?;
    let audit_policy = audit_dir.path().join("policy.yaml");
    let audit_log = audit_dir.path().join("audit.log");
    std::fs::write(&audit_policy, AUDIT_POLICY)?;
    let qps = "--kube-api-qps=200 --kube-api-burst=400".to_owned();
    let plane = Plane::up_cluster_with(
        "gate",
        args.nodes,
        &[
            (
                "INITIUM_PLANE_APISERVER_ARGS",
                format!(
                    "--audit-policy-file={} --audit-log-path={} --audit-log-maxbackup=0",
                    audit_policy.display(),
                    audit_log.display()
                ),
            ),
            ("INITIUM_PLANE_CONTROLLER_MANAGER_ARGS", qps.clone()),
            ("INITIUM_PLANE_SCHEDULER_ARGS", qps),
            ("INITIUM_PLANE_KWOK_ARGS", "-v=WARN".to_owned()),
        ],
    )?;
    plane.install_crds()?;
    plane.ensure_namespace(NAMESPACE, &[])?;
    let client = runtime.block_on(bench_client(&plane.kubeconfig))?;
    runtime.block_on(create_rules(&client, &[rule(args.floor)], 1))?;

    let log = std::env::temp_dir().join(format!("initium-bench-gate-{}.log", std::process::id()));
    let initium = Initium::start(
        &plane,
        InitiumOptions {
            namespace: INITIUM_NAMESPACE.into(),
            extra: vec!["--exclude-namespace".into(), "kube-system".into()],
            cpus: None,
            log: log.clone(),
        },
    )?;
    eprintln!(
        "bench: initium serving (pid {}), log {}",
        initium.pid(),
        log.display()
    );
    runtime.block_on(rule_in_effect(&client, timeout))?;
    eprintln!("bench: the gate rule is Ready and in effect ({})", gate());

    let seen = watch_pods(&runtime, &client);
    let endpoint_ready = watch_endpoints(&runtime, &client);
    let (wait, wait_window) =
        runtime.block_on(wait_phase(args, &client, &initium, &seen, timeout))?;
    let release_from = SystemTime::now();
    let release = runtime.block_on(release_phase(
        args,
        &client,
        &initium,
        &seen,
        &endpoint_ready,
        timeout,
    ))?;
    // Let the audit log catch up with the last requests of the window.
    std::thread::sleep(Duration::from_secs(1));
    let release_to = SystemTime::now();
    let peak_kib = initium.memory()?.peak_kib;
    let (requests, agents) = count_requests(
        &audit_log,
        &[
            wait_window,
            (epoch_micros(release_from), epoch_micros(release_to)),
        ],
    )?;
    let writes = release_writes(
        &audit_log,
        release.endpoint_ready_epoch_us,
        (epoch_micros(release_from), epoch_micros(release_to)),
        // initium's default --gate-release-concurrency is the floor's default too.
        args.floor_concurrency as usize,
    )?;
    // INITIUM_BENCH_GATE_KEEP=DIR keeps the audit log and initium's log of each run there.
    if let Some(keep) = std::env::var_os("INITIUM_BENCH_GATE_KEEP") {
        let keep = Path::new(&keep);
        std::fs::create_dir_all(keep)?;
        let run = format!(
            "{}-{}",
            if args.floor { "floor" } else { "initium" },
            std::process::id()
        );
        std::fs::copy(&audit_log, keep.join(format!("audit-{run}.log")))?;
        let _ = std::fs::copy(&log, keep.join(format!("initium-{run}.log")));
        eprintln!(
            "bench: kept the audit log as {}",
            keep.join(format!("audit-{run}.log")).display()
        );
    }
    drop(initium);
    runtime.shutdown_timeout(Duration::from_secs(1));
    drop(plane);
    drop(audit_dir);
    let mut requests = requests.into_iter();
    let (wait_requests, release_requests) = (
        requests.next().unwrap_or_default(),
        requests.next().unwrap_or_default(),
    );
    report(
        args,
        pods,
        &wait,
        &release,
        &wait_requests,
        &release_requests,
        &writes,
        &agents,
        peak_kib,
    );
    Ok(release.incomplete.is_none())
}

/// Waits until the rule is Ready and a dry-run Pod in the namespace comes back gated (the
/// webhook configuration follows the rule a moment later), and the namespace's `default`
/// ServiceAccount exists (the ServiceAccount admission plugin requires it).
async fn rule_in_effect(client: &kube::Client, timeout: Duration) -> Result<()> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let probe: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe", "labels": {"initium-bench": "probe"}},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]},
    }))?;
    let last = Mutex::new(String::from("nothing yet"));
    let done = wait_for(timeout, Duration::from_millis(500), || async {
        let say = |what: String| {
            *last.lock().expect("not poisoned") = what;
            None
        };
        match ready_rules(client).await {
            Ok(1) => {}
            Ok(n) => return say(format!("{n} rules Ready")),
            Err(e) => return say(format!("cannot list rules: {e}")),
        }
        match accounts.get_opt("default").await {
            Ok(Some(_)) => {}
            Ok(None) => return say("no default ServiceAccount yet".into()),
            Err(e) => return say(e.to_string()),
        }
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        match pods.create(&dry_run, &probe).await {
            Ok(pod) if has_initium_gate(&pod) => Some(()),
            Ok(pod) => say(format!(
                "a dry-run Pod came back without the gate: {:?}",
                pod.spec.and_then(|s| s.scheduling_gates)
            )),
            Err(e) => say(e.to_string()),
        }
    })
    .await;
    match done {
        Some(()) => Ok(()),
        None => bail!(
            "the gate rule was not in effect within {timeout:?}; last: {}",
            last.lock().expect("not poisoned")
        ),
    }
}

/// Creates the gated Deployments, waits until every Pod is gated, holds them; returns the
/// figures and the counted window (epoch microseconds).
async fn wait_phase(
    args: &Args,
    client: &kube::Client,
    initium: &Initium,
    seen: &PodsSeen,
    timeout: Duration,
) -> Result<(Wait, (i64, i64))> {
    let pods = (args.deployments * args.replicas) as usize;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let window_from = SystemTime::now();
    let started = Instant::now();
    let mut rss_max_kib = initium.memory()?.rss_kib;
    for i in 0..args.deployments {
        let name = format!("app-{i}");
        deployments
            .create(
                &PostParams::default(),
                &deployment(&name, args.replicas, &[GATED_POD_LABEL])?,
            )
            .await
            .with_context(|| format!("cannot create Deployment {NAMESPACE}/{name}"))?;
    }
    eprintln!(
        "bench: created {} Deployments of {} replicas; waiting for {pods} gated Pods",
        args.deployments, args.replicas
    );

    // Every Pod seen by the watch, each carrying the gate from its first sight on.
    let deadline = started + timeout;
    let mut last_report = Instant::now();
    loop {
        rss_max_kib = rss_max_kib.max(initium.memory()?.rss_kib);
        let (count, ungated) = {
            let map = seen.lock().expect("not poisoned");
            let ungated: Vec<String> = map
                .iter()
                .filter(|(_, s)| !s.gated_at_first_sight || s.released.is_some())
                .map(|(name, _)| name.clone())
                .take(5)
                .collect();
            (map.len(), ungated)
        };
        if !ungated.is_empty() {
            bail!(
                "Pods were created without initium's gate {} (or lost it): {}",
                gate(),
                ungated.join(", ")
            );
        }
        if count >= pods {
            break;
        }
        if Instant::now() >= deadline {
            bail!("only {count} of {pods} Pods were created within {timeout:?}");
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            eprintln!("bench: {count} of {pods} Pods created, all gated");
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Verified on the stored Pods: the gate, the gated label, and the scheduler's verdict.
    let api: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let selector = format!("{}={}", GATED_POD_LABEL.0, GATED_POD_LABEL.1);
    let gate = gate();
    loop {
        rss_max_kib = rss_max_kib.max(initium.memory()?.rss_kib);
        let listed = api
            .list(&ListParams::default().labels(&selector))
            .await
            .context("cannot list the gated Pods")?
            .items;
        let missing_gate: Vec<&str> = listed
            .iter()
            .filter(|p| {
                let gates = p.spec.as_ref().and_then(|s| s.scheduling_gates.as_ref());
                !gates.into_iter().flatten().any(|g| g.name == gate)
                    || p.metadata.labels.as_ref().and_then(|l| l.get(GATED_LABEL))
                        != Some(&"true".to_owned())
            })
            .filter_map(|p| p.metadata.name.as_deref())
            .collect();
        if !missing_gate.is_empty() {
            bail!(
                "{} Pods lack the gate {gate} or the label {GATED_LABEL}=true, e.g. {}",
                missing_gate.len(),
                missing_gate
                    .iter()
                    .take(5)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let gated = listed.iter().filter(|p| scheduling_gated(p)).count();
        if listed.len() == pods && gated == pods {
            break;
        }
        let last = format!(
            "{} Pods, {gated} of them PodScheduled=False/SchedulingGated",
            listed.len()
        );
        if Instant::now() >= deadline {
            bail!("the Pods were not all SchedulingGated within {timeout:?}: {last}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let all_gated_s = started.elapsed().as_secs_f64();
    eprintln!(
        "bench: all {pods} Pods SchedulingGated with {gate} after {all_gated_s:.1}s; holding them {}s",
        args.hold_seconds
    );
    let hold_until = Instant::now() + Duration::from_secs(args.hold_seconds);
    while Instant::now() < hold_until {
        rss_max_kib = rss_max_kib.max(initium.memory()?.rss_kib);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let rss_end_kib = initium.memory()?.rss_kib;
    rss_max_kib = rss_max_kib.max(rss_end_kib);
    let gated_pods_metric = initium
        .get("/metrics")
        .ok()
        .and_then(|(_, body)| metric_opt(&body, "initium_gated_pods"));
    let window = (epoch_micros(window_from), epoch_micros(SystemTime::now()));
    Ok((
        Wait {
            all_gated_s,
            window_s: started.elapsed().as_secs_f64(),
            rss_max_kib,
            rss_end_kib,
            gated_pods_metric,
        },
        window,
    ))
}

/// Creates the backend and its Service, and times the release of every gated Pod.
async fn release_phase(
    args: &Args,
    client: &kube::Client,
    initium: &Initium,
    seen: &PodsSeen,
    endpoint_ready: &Arc<Mutex<Option<Instant>>>,
    timeout: Duration,
) -> Result<Release> {
    let pods = (args.deployments * args.replicas) as usize;
    let started = Instant::now();
    Api::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &service(BACKEND, BACKEND))
        .await
        .context("cannot create the Service backend")?;
    Api::<Deployment>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &deployment(BACKEND, 1, &[])?)
        .await
        .context("cannot create the Deployment backend")?;
    eprintln!("bench: created the backend; waiting for its ready endpoint");
    let Some(ready_at) = wait_for(timeout, Duration::from_millis(20), || async {
        *endpoint_ready.lock().expect("not poisoned")
    })
    .await
    else {
        bail!(
            "the Service {NAMESPACE}/{BACKEND} had no ready endpoint within {timeout:?}: \
             is every component of the cluster running?"
        );
    };
    let endpoint_ready_s = ready_at.duration_since(started).as_secs_f64();
    let endpoint_ready_epoch_us = epoch_micros(SystemTime::now())
        - i64::try_from(ready_at.elapsed().as_micros()).unwrap_or(0);
    eprintln!(
        "bench: the backend's endpoint was ready after {endpoint_ready_s:.2}s; waiting for the releases"
    );
    if args.floor {
        release_all(client, seen, args.floor_concurrency as usize).await?;
    }

    let released =
        |map: &BTreeMap<String, Seen>| map.values().filter(|s| s.released.is_some()).count();
    let mut incomplete = None;
    let all_released = wait_for(timeout, Duration::from_millis(20), || async {
        let map = seen.lock().expect("not poisoned");
        (released(&map) >= pods).then_some(())
    })
    .await;
    let mut all_running = None;
    if all_released.is_none() {
        let n = released(&seen.lock().expect("not poisoned"));
        incomplete = Some(format!(
            "{n} of {pods} Pods were released within {timeout:?} of the backend's endpoint being \
             ready: is initium's gate controller running (and holding the Lease)? See {}",
            initium.log.display()
        ));
    } else {
        eprintln!("bench: every Pod released; waiting until they all run");
        all_running = wait_for(timeout, Duration::from_millis(100), || async {
            let map = seen.lock().expect("not poisoned");
            (map.values().filter(|s| s.running.is_some()).count() >= pods).then_some(())
        })
        .await;
    }

    let map = seen.lock().expect("not poisoned").clone();
    let mut micros = Vec::new();
    let mut released_before_endpoint = 0;
    let mut last_release = None::<Instant>;
    let mut last_running = None::<Instant>;
    let mut running = 0;
    for s in map.values() {
        if let Some(at) = s.released {
            if at < ready_at {
                released_before_endpoint += 1;
            }
            micros.push(
                u32::try_from(at.saturating_duration_since(ready_at).as_micros())
                    .unwrap_or(u32::MAX),
            );
            last_release = last_release.max(Some(at));
        }
        if let Some(at) = s.running {
            running += 1;
            last_running = last_running.max(Some(at));
        }
    }
    let metrics = initium
        .get("/metrics")
        .map(|(_, body)| body)
        .unwrap_or_default();
    Ok(Release {
        endpoint_ready_s,
        endpoint_ready_epoch_us,
        released: micros.len(),
        latencies: Percentiles::new(micros),
        released_before_endpoint,
        all_released_s: all_released
            .and(last_release)
            .map(|at| at.saturating_duration_since(ready_at).as_secs_f64()),
        all_running_s: all_running
            .and(last_running)
            .map(|at| at.saturating_duration_since(ready_at).as_secs_f64()),
        running,
        histogram: Histogram::parse(&metrics, "initium_gate_release_latency_seconds"),
        releases_total_metric: metric_opt(&metrics, "initium_gate_releases_total"),
        incomplete,
    })
}

/// With --floor: removes the gate and the gated label from every Pod seen, `concurrency`
/// writes in flight, with the merge patch initium writes (without its resourceVersion
/// precondition: nobody else writes these Pods).
async fn release_all(client: &kube::Client, seen: &PodsSeen, concurrency: usize) -> Result<()> {
    let names: Vec<String> = seen.lock().expect("not poisoned").keys().cloned().collect();
    let api: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let patch = json!({
        "metadata": {"labels": {GATED_LABEL: null}},
        "spec": {"schedulingGates": null},
    });
    let params = kube::api::PatchParams::default();
    let results: Vec<Result<()>> = futures::stream::iter(names.iter().map(|name| {
        let (api, patch, params) = (&api, &patch, &params);
        async move {
            api.patch(name, params, &kube::api::Patch::Merge(patch))
                .await
                .with_context(|| format!("cannot release Pod {NAMESPACE}/{name}"))?;
            Ok(())
        }
    }))
    .buffer_unordered(concurrency)
    .collect()
    .await;
    results.into_iter().collect()
}

/// The human summary, then one JSON line.
#[allow(clippy::too_many_arguments)]
fn report(
    args: &Args,
    pods: usize,
    wait: &Wait,
    release: &Release,
    wait_requests: &Requests,
    release_requests: &Requests,
    writes: &Writes,
    agents: &[String],
    peak_kib: u64,
) {
    let get_list_wait = wait_requests.pods("get") + wait_requests.pods("list");
    let get_list_per_pod = get_list_wait as f64 / pods as f64;
    let latencies = &release.latencies;
    let all_released = release.released == pods;
    let (p50, p99, max) = (latencies.ms(0.5), latencies.ms(0.99), latencies.ms(1.0));
    let goal_p99 = all_released && p99 <= GOAL_P99_MS;
    let goal_all_released = release
        .all_released_s
        .is_some_and(|s| s <= GOAL_ALL_RELEASED_S);
    // An initium that never releases (no gate controller) trivially makes no requests: the
    // goal is decided only by a run in which every Pod was released.
    let goal_zero_get_list = release.incomplete.is_none().then_some(get_list_wait == 0);

    println!("gate benchmark: {}", machine());
    if args.floor {
        println!(
            "  FLOOR: the benchmark, not initium, removes the gates ({} writes in flight); initium only holds the Pods",
            args.floor_concurrency
        );
    }
    println!(
        "  {} Deployments x {} replicas = {pods} Pods gated by one MutationRule until Service {BACKEND} has a ready endpoint; {} simulated nodes",
        args.deployments, args.replicas, args.nodes
    );
    println!(
        "  wait: every Pod created and SchedulingGated after {:.1} s; counted over {:.1} s (held {} s)",
        wait.all_gated_s, wait.window_s, args.hold_seconds
    );
    println!(
        "    initium's requests: {} (on pods: {})",
        Requests::describe(&wait_requests.by_resource),
        Requests::describe(&wait_requests.pods)
    );
    println!(
        "    GET/LIST on pods per waiting Pod: {get_list_wait} / {pods} = {get_list_per_pod:.3} (goal 0)"
    );
    println!(
        "    initium RSS: max {:.1} MiB, {:.1} MiB at the end of the wait; initium_gated_pods {}",
        mib(wait.rss_max_kib),
        mib(wait.rss_end_kib),
        wait.gated_pods_metric
            .map_or_else(|| "(no such metric)".to_owned(), |v| format!("{v}"))
    );
    println!(
        "  release: backend endpoint ready {:.2} s after the backend was created",
        release.endpoint_ready_s
    );
    println!(
        "    {} of {pods} Pods released; latency (gate seen gone - endpoint seen ready) p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms (goal p99 <= {GOAL_P99_MS} ms)",
        release.released
    );
    if release.released_before_endpoint > 0 {
        println!(
            "    {} Pods were seen released before the benchmark saw the endpoint ready (counted as 0 ms)",
            release.released_before_endpoint
        );
    }
    match release.all_released_s {
        Some(s) => println!(
            "    all released {s:.2} s after the endpoint was ready (goal <= {GOAL_ALL_RELEASED_S} s)"
        ),
        None => println!("    not all released"),
    }
    match release.all_running_s {
        Some(s) => println!("    all Running {s:.2} s after the endpoint was ready"),
        None => println!("    {} of {pods} Running", release.running),
    }
    match &release.histogram {
        Some(h) => println!(
            "    initium_gate_release_latency_seconds: {} releases, mean {:.1} ms, p50 <= {} ms, p99 <= {} ms (bucket bounds)",
            h.count,
            if h.count > 0.0 {
                h.sum / h.count * 1000.0
            } else {
                0.0
            },
            h.quantile_bound(0.5)
                .map_or("-".into(), |b| format!("{}", b * 1000.0)),
            h.quantile_bound(0.99)
                .map_or("-".into(), |b| format!("{}", b * 1000.0)),
        ),
        None => println!("    initium_gate_release_latency_seconds: not on initium's /metrics"),
    }
    println!(
        "    initium's requests: {} (on pods: {})",
        Requests::describe(&release_requests.by_resource),
        Requests::describe(&release_requests.pods)
    );
    let server = Percentiles::new(release_requests.patch_pod_server_us.clone());
    if !server.is_empty() {
        println!(
            "    the API server's time per Pod patch (audit log): p50 {:.1} ms, p99 {:.1} ms, mean {:.1} ms",
            server.ms(0.50),
            server.ms(0.99),
            server.mean_ms()
        );
    }
    let server = Percentiles::new(writes.server_us.clone());
    let refill = Percentiles::new(writes.refill_us.clone());
    println!(
        "    the release writes (audit log, whoever wrote them): {}, first received {:.0} ms and last completed {:.0} ms after the endpoint was seen ready, {:.1} in the API server at once on average, its time per write p50 {:.1} ms, p99 {:.1} ms; a slot empty between two writes p50 {:.1} ms",
        writes.count,
        writes.first_received_ms,
        writes.last_done_ms,
        writes.mean_in_flight,
        server.ms(0.50),
        server.ms(0.99),
        refill.ms(0.50)
    );
    println!(
        "  initium peak memory (VmHWM): {:.1} MiB; its user agent(s) in the audit log: {agents:?}",
        mib(peak_kib)
    );
    if let Some(why) = &release.incomplete {
        println!("  INCOMPLETE: {why}");
        println!(
            "  (the goals are not met; zero GET/LIST while waiting is undecided: an initium that releases nothing need not look)"
        );
    }
    let histogram = release.histogram.as_ref().map(|h| {
        json!({
            "count": h.count,
            "mean_ms": round(if h.count > 0.0 { h.sum / h.count * 1000.0 } else { 0.0 }, 1),
            "p50_le_ms": h.quantile_bound(0.5).filter(|b| b.is_finite()).map(|b| round(b * 1000.0, 1)),
            "p99_le_ms": h.quantile_bound(0.99).filter(|b| b.is_finite()).map(|b| round(b * 1000.0, 1)),
        })
    });
    let line = json!({
        "bench": "gate",
        "deployments": args.deployments,
        "replicas": args.replicas,
        "pods": pods,
        "nodes": args.nodes,
        "releaser": if args.floor { "benchmark" } else { "initium" },
        "floor_concurrency": args.floor.then_some(args.floor_concurrency),
        "complete": release.incomplete.is_none(),
        "wait": {
            "all_gated_s": round(wait.all_gated_s, 2),
            "window_s": round(wait.window_s, 2),
            "requests": wait_requests.json(),
            "get_list_on_pods": get_list_wait,
            "get_list_per_waiting_pod": round(get_list_per_pod, 4),
            "rss_max_mib": round(mib(wait.rss_max_kib), 1),
            "rss_end_mib": round(mib(wait.rss_end_kib), 1),
            "initium_gated_pods": wait.gated_pods_metric,
        },
        "release": {
            "endpoint_ready_s": round(release.endpoint_ready_s, 3),
            "released": release.released,
            "released_before_endpoint": release.released_before_endpoint,
            "p50_ms": round(p50, 1),
            "p99_ms": round(p99, 1),
            "max_ms": round(max, 1),
            "all_released_s": release.all_released_s.map(|s| round(s, 3)),
            "running": release.running,
            "all_running": release.all_running_s.is_some(),
            "all_running_s": release.all_running_s.map(|s| round(s, 3)),
            "requests": release_requests.json(),
            "initium_histogram": histogram,
            "initium_gate_releases_total": release.releases_total_metric,
            "writes": {
                "count": writes.count,
                "first_received_ms": round(writes.first_received_ms, 1),
                "last_done_ms": round(writes.last_done_ms, 1),
                "mean_in_flight": round(writes.mean_in_flight, 2),
                "server_p50_ms": round(server.ms(0.50), 1),
                "server_p99_ms": round(server.ms(0.99), 1),
                "refill_p50_ms": round(refill.ms(0.50), 1),
            },
        },
        "initium_peak_rss_mib": round(mib(peak_kib), 1),
        "goal_p99_met": goal_p99,
        "goal_all_released_met": goal_all_released,
        "goal_zero_get_list_met": goal_zero_get_list,
    });
    println!("{line}");
}
