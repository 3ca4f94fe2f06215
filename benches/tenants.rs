//! Tenants benchmark: N tenant namespaces (63-character names, the longest Kubernetes
//! allows), each with a `failurePolicy: Fail` MutationRule for Pods, on a real API server with
//! `initium serve` beside it.
//!
//! 1. Ten tenants' rules applied and Ready: the baseline ("N=10"), measured in the same run
//!    as everything else, so the ratios do not depend on how loaded the machine is today.
//! 2. The other N−10 tenants' rules in one bulk `kubectl apply --server-side`: time until
//!    every rule is Ready, MutatingWebhookConfiguration bytes and writes, namespace label
//!    writes.
//! 3. Pod latency at N: Pods created (server-side dry run) through the API server in a tenant
//!    namespace, one at a time, p50 against the baseline's; initium's own admission time
//!    (the `Server-Timing` of reviews sent straight to its webhook) likewise.
//! 4. Churn: one tenant's rule patched `--churn-rate` times a second for `--churn-seconds`,
//!    while reviews go straight to the webhook; admission p50 against a window of the same
//!    length without churn just before, and initium's CPU per update (CPU in the churn window
//!    minus CPU in the quiet one, over the updates).
//!
//! The last line of stdout is one JSON object. Loopback only; it stops by itself.
//!
//!     scripts/bench tenants --namespaces 10000
//!     cargo bench --bench tenants -- --namespaces 1000
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use hyper::body::Bytes;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::PostParams;
use kube::api::{Api, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams};
use serde_json::{Value, json};
use tokio_rustls::rustls;

use support::cluster::{ready_for, rule_resource};
use support::direct::{RssSampler, connect, cpu_seconds, send, tls_config};
use support::measure::{Percentiles, machine, mib, round};
use support::plane::{Plane, root, run as run_command};
use support::process::{Initium, InitiumOptions};
use support::wait::poll;

/// The webhook configuration's size and initium's admission under thousands of tenants.
#[derive(Parser, Debug)]
struct Args {
    /// Tenant namespaces, each with one Fail MutationRule for Pods.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(10..=20_000))]
    namespaces: u32,
    /// Pods created through the API server per latency measurement.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(10..=10_000))]
    pods: u32,
    /// Seconds of churn (and of the quiet window before it).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=600))]
    churn_seconds: u64,
    /// Updates of one tenant's rule per second during the churn.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100))]
    churn_rate: u32,
    /// Reviews sent straight to the webhook per second while measuring admission.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=5_000))]
    review_rate: u32,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("tenants benchmark failed: {e:#}");
        std::process::exit(1);
    }
}

/// The baseline: tenants applied before the bulk.
const BASE: usize = 10;

fn tenant(i: usize) -> String {
    let name = format!("tenant-{i:05}-");
    format!("{name}{}", "t".repeat(63 - name.len()))
}

fn rule(namespace: &str, value: &str) -> Value {
    json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": "stamp", "namespace": namespace},
        "spec": {
            "failurePolicy": "Fail",
            "match": {"kinds": ["Pod"]},
            "mutations": [{"merge": {"metadata": {"labels": {"example.com/tenant": value}}}}],
        },
    })
}

/// `kubectl apply --server-side` of `rules` in one call; its duration.
fn bulk_apply(plane: &Plane, rules: &[Value]) -> Result<Duration> {
    if rules.is_empty() {
        return Ok(Duration::ZERO);
    }
    let mut yaml = String::new();
    for rule in rules {
        yaml.push_str("---\n");
        yaml.push_str(&serde_json::to_string(rule)?);
        yaml.push('\n');
    }
    let file =
        std::env::temp_dir().join(format!("initium-bench-tenants-{}.yaml", std::process::id()));
    std::fs::write(&file, yaml)?;
    let started = Instant::now();
    let applied = run_command(plane.kubectl().args([
        "apply",
        "--server-side",
        "--field-manager=bench",
        "-f",
        &file.to_string_lossy(),
    ]));
    let took = started.elapsed();
    let _ = std::fs::remove_file(&file);
    applied?;
    Ok(took)
}

/// MutationRules whose status says their generation is Ready (listed from the API server's
/// cache: a poll must not weigh on what it measures).
async fn ready_count(client: &kube::Client) -> Result<usize> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &rule_resource("MutationRule")?);
    let list = api.list(&ListParams::default().match_any()).await?;
    Ok(list
        .items
        .iter()
        .filter(|r| ready_for(&r.data["status"], r.metadata.generation).is_ok())
        .count())
}

fn wait_ready(rt: &tokio::runtime::Runtime, client: &kube::Client, want: usize) -> Result<()> {
    poll(
        "every tenant's rule Ready",
        Duration::from_secs(1800),
        Duration::from_millis(500),
        || {
            let ready = rt.block_on(ready_count(client))?;
            Ok((ready >= want)
                .then_some(())
                .ok_or_else(|| format!("{ready} of {want} rules Ready")))
        },
    )
}

/// Unmeasured Pods first: connections, the API server's caches.
const WARM_UP: u32 = 50;

/// `pods` Pods created (dry run) one at a time in `namespace`; each one's latency, and
/// checks that initium mutated them.
async fn pod_latency(client: &kube::Client, namespace: &str, pods: u32) -> Result<Percentiles> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let probe: Pod = serde_json::from_value(json!({
        "metadata": {"generateName": "probe-"},
        "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1"}]}
    }))?;
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let mut micros = Vec::new();
    for i in 0..pods + WARM_UP {
        let started = Instant::now();
        let pod = api.create(&params, &probe).await?;
        let took = started.elapsed();
        let stamped = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("example.com/tenant"))
            .is_some();
        if !stamped {
            bail!("a Pod in {namespace} was not mutated: the benchmark would measure nothing");
        }
        if i >= WARM_UP {
            micros.push(took.as_micros() as u32);
        }
    }
    Ok(Percentiles::new(micros))
}

/// A Pod CREATE review for `namespace` (the recorded one from tests/data/admission/).
fn review(namespace: &str) -> Result<Bytes> {
    let path = root().join("tests/data/admission/pod-create.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut review: Value = serde_json::from_str(&text)?;
    review["request"]["namespace"] = json!(namespace);
    review["request"]["object"]["metadata"]["namespace"] = json!(namespace);
    Ok(Bytes::from(serde_json::to_vec(&review)?))
}

/// Reviews sent straight to the webhook, one at a time at `rate` a second for `seconds`:
/// initium's own time for each (`Server-Timing`), in microseconds.
async fn admission(
    addr: std::net::SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    body: &Bytes,
    rate: u32,
    seconds: u64,
) -> Result<Percentiles> {
    let mut sender = connect(addr, tls).await?;
    let every = Duration::from_secs_f64(1.0 / f64::from(rate));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut server = Vec::new();
    while Instant::now() < end {
        tick.tick().await;
        let (status, answer, server_us) = send(&mut sender, addr, body).await?;
        if status != 200 || !answer.windows(6).any(|w| w == b"\"patch") {
            bail!(
                "initium answered {status} without a patch: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        server.push(server_us.context("no Server-Timing on the answer")?);
    }
    Ok(Percentiles::new(server))
}

fn run(args: &Args) -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let n = args.namespaces as usize;
    let machine = machine();

    let plane = Plane::up("tenants")?;
    plane.install_crds()?;
    let client = rt.block_on(plane.client())?;
    let log =
        std::env::temp_dir().join(format!("initium-bench-tenants-{}.log", std::process::id()));
    let initium = Initium::start(
        &plane,
        InitiumOptions {
            namespace: "initium-bench".into(),
            extra: vec![],
            cpus: None,
            log: log.clone(),
        },
    )?;
    eprintln!(
        "bench: initium (pid {}) logs to {}",
        initium.pid(),
        log.display()
    );

    // The namespaces first (not measured).
    let started = Instant::now();
    let namespaces = Api::<Namespace>::all(client.clone());
    rt.block_on(
        futures::stream::iter((0..n).map(|i| {
            let namespaces = namespaces.clone();
            async move {
                let ns = Namespace {
                    metadata: ObjectMeta {
                        name: Some(tenant(i)),
                        ..ObjectMeta::default()
                    },
                    ..Namespace::default()
                };
                match namespaces.create(&PostParams::default(), &ns).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                    Err(e) => Err(anyhow::anyhow!("create namespace {}: {e}", tenant(i))),
                }
            }
        }))
        .buffer_unordered(32)
        .try_collect::<Vec<()>>(),
    )?;
    eprintln!(
        "bench: {n} namespaces created in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // 1. The baseline.
    let rules: Vec<Value> = (0..n).map(|i| rule(&tenant(i), "yes")).collect();
    bulk_apply(&plane, &rules[..BASE])?;
    wait_ready(&rt, &client, BASE)?;
    let tls = tls_config(&initium.ca_bundle(&plane)?)?;
    let body = review(&tenant(0))?;
    let base_pods = rt.block_on(pod_latency(&client, &tenant(0), args.pods))?;
    let base_admission = rt.block_on(admission(
        initium.webhook,
        tls.clone(),
        &body,
        args.review_rate,
        5,
    ))?;
    let writes_before =
        initium.metric("initium_webhook_configuration_writes_total{result=\"applied\"")?;
    eprintln!(
        "bench: baseline ({BASE} tenants): Pod p50 {:.2} ms, admission p50 {:.3} ms",
        base_pods.ms(0.5),
        base_admission.ms(0.5)
    );

    // 2. The bulk.
    let started = Instant::now();
    let apply = bulk_apply(&plane, &rules[BASE..])?;
    wait_ready(&rt, &client, n)?;
    let all_ready = started.elapsed();
    let after_apply = all_ready.saturating_sub(apply);
    let writes = initium.metric("initium_webhook_configuration_writes_total{result=\"applied\"")?
        - writes_before;
    let refused =
        initium.metric("initium_webhook_configuration_writes_total{result=\"refused\"")?;
    let label_writes = initium.metric("initium_namespace_label_writes_total{result=\"added\"")?;
    let stored =
        rt.block_on(Api::<MutatingWebhookConfiguration>::all(client.clone()).get("initium"))?;
    let configuration_bytes = serde_json::to_vec(&stored)?.len();
    eprintln!(
        "bench: {} rules applied in {:.1} s; all {n} Ready {:.1} s after the apply began ({:.1} s after it returned); configuration {configuration_bytes} bytes, {writes} writes during the bulk, {label_writes} namespace labels",
        n - BASE,
        apply.as_secs_f64(),
        all_ready.as_secs_f64(),
        after_apply.as_secs_f64(),
    );
    if refused > 0.0 {
        bail!(
            "the API server refused {refused} configuration writes; see {}",
            log.display()
        );
    }

    // 3. Pod latency at N.
    let pods = rt.block_on(pod_latency(&client, &tenant(0), args.pods))?;
    // One window of reviews: their server times, and initium's CPU seconds meanwhile.
    let window = || -> Result<(Percentiles, f64)> {
        let cpu_start = cpu_seconds(initium.pid())?;
        let times = rt.block_on(admission(
            initium.webhook,
            tls.clone(),
            &body,
            args.review_rate,
            args.churn_seconds,
        ))?;
        Ok((times, cpu_seconds(initium.pid())? - cpu_start))
    };
    let (quiet, quiet_cpu) = window()?;

    // 4. Churn: tenant 1's rule patched churn_rate times a second, reviews meanwhile.
    let rules_api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &tenant(1), &rule_resource("MutationRule")?);
    let updates = Arc::new(AtomicU64::new(0));
    let failed_updates = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let churn = rt.spawn({
        let updates = updates.clone();
        let failed_updates = failed_updates.clone();
        let stop = stop.clone();
        let every = Duration::from_secs_f64(1.0 / f64::from(args.churn_rate));
        async move {
            let mut tick = tokio::time::interval(every);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                i += 1;
                let patch = json!({"spec": {"mutations": [{"merge": {"metadata": {"labels": {"example.com/tenant": format!("v{i}")}}}}]}});
                match rules_api
                    .patch("stamp", &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => updates.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed_updates.fetch_add(1, Ordering::Relaxed),
                };
            }
        }
    });
    let writes_before_churn =
        initium.metric("initium_webhook_configuration_writes_total{result=\"applied\"")?;
    let sampler = RssSampler::start(initium.pid());
    let (churning, churn_cpu) = window()?;
    stop.store(true, Ordering::Relaxed);
    rt.block_on(churn)?;
    let rss_churn = sampler.stop();
    let updates = updates.load(Ordering::Relaxed);
    let failed_updates = failed_updates.load(Ordering::Relaxed);
    let churn_writes = initium
        .metric("initium_webhook_configuration_writes_total{result=\"applied\"")?
        - writes_before_churn;
    let memory = initium.memory()?;
    drop(initium);
    drop(plane);

    let cpu_per_update_ms = (churn_cpu - quiet_cpu).max(0.0) * 1000.0 / (updates.max(1) as f64);
    let pod_ratio = pods.ms(0.5) / base_pods.ms(0.5);
    let admission_ratio_n = quiet.ms(0.5) / base_admission.ms(0.5);
    let churn_ratio = churning.ms(0.5) / quiet.ms(0.5);
    let rss_mib = mib(rss_churn.max(memory.rss_kib));

    println!("tenants benchmark: {machine}");
    println!(
        "{n} tenant namespaces (63-character names), one Fail MutationRule each; baseline {BASE} tenants in the same run"
    );
    println!(
        "bulk apply of {} rules: {:.1} s; every rule Ready {:.1} s after it began, {:.2} s after it returned",
        n - BASE,
        apply.as_secs_f64(),
        all_ready.as_secs_f64(),
        after_apply.as_secs_f64()
    );
    println!(
        "MutatingWebhookConfiguration: {configuration_bytes} bytes stored; {writes} writes during the bulk; {label_writes} namespace labels written"
    );
    println!(
        "Pod CREATE through the API server (dry run, one at a time): p50 {:.2} ms at {BASE} tenants, {:.2} ms at {n}: ratio {:.2}",
        base_pods.ms(0.5),
        pods.ms(0.5),
        pod_ratio
    );
    println!(
        "initium's admission time (Server-Timing): p50 {:.3} ms at {BASE} tenants, {:.3} ms at {n} ({:.2}); under churn ({updates} updates, {failed_updates} failed, {:.0}/s) {:.3} ms: ratio to no churn {:.2}; {churn_writes} configuration writes during churn",
        base_admission.ms(0.5),
        quiet.ms(0.5),
        admission_ratio_n,
        updates as f64 / args.churn_seconds as f64,
        churning.ms(0.5),
        churn_ratio
    );
    println!(
        "initium CPU: {:.2} ms per update ({:.2} s in {} s of churn, {:.2} s in as long without); RSS {:.1} MiB, peak {:.1} MiB",
        cpu_per_update_ms,
        churn_cpu,
        args.churn_seconds,
        quiet_cpu,
        rss_mib,
        mib(memory.peak_kib)
    );
    let report = json!({
        "bench": "tenants",
        "machine": machine,
        "namespaces": n,
        "apply_seconds": round(apply.as_secs_f64(), 2),
        "all_ready_seconds": round(all_ready.as_secs_f64(), 2),
        "ready_after_apply_seconds": round(after_apply.as_secs_f64(), 2),
        "configuration_bytes": configuration_bytes,
        "configuration_writes_bulk": writes,
        "namespace_label_writes": label_writes,
        "pod_p50_ms": {"base": round(base_pods.ms(0.5), 3), "n": round(pods.ms(0.5), 3), "ratio": round(pod_ratio, 3)},
        "admission_p50_ms": {
            "base": round(base_admission.ms(0.5), 4),
            "n": round(quiet.ms(0.5), 4),
            "churn": round(churning.ms(0.5), 4),
            "churn_ratio": round(churn_ratio, 3),
        },
        "churn": {"updates": updates, "failed": failed_updates, "configuration_writes": churn_writes, "cpu_ms_per_update": round(cpu_per_update_ms, 3)},
        "rss_mib": round(rss_mib, 1),
        "peak_mib": round(mib(memory.peak_kib), 1),
    });
    println!("{report}");
    Ok(())
}
