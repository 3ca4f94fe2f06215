//! Webhook benchmark: a load generator against a running `initium serve`.
//!
//! It starts a real control plane (`scripts/control-plane`), creates N rules through the API
//! server (the 10 rules of the engine benchmark that match the Pod, and N−10 that a large
//! cluster holds for other kinds and namespaces), starts `initium serve` out of cluster and
//! waits until every rule is compiled and its status written. Then it sends AdmissionReviews
//! straight to the webhook, over keep-alive HTTPS connections (one request in flight per
//! connection, `--concurrency` connections): three Pod CREATEs (the recorded review from
//! tests/data/admission/ carrying the engine benchmark's 4 KB Pod; 10 rules change it) for
//! every Deployment CREATE (recorded as the API server sent it; no rule matches it).
//!
//! It reports throughput, client-side latency, server time (the `Server-Timing` header
//! initium puts on every answer), initium's CPU time per review, and its memory: the
//! resident set during the load and the peak since start (VmHWM). The last line of stdout is
//! one JSON object. Loopback only; the load stops after `--seconds` or `--max-requests`.
//!
//!     scripts/bench webhook --rules 1000 --seconds 10 --concurrency 32
//!     cargo bench --bench webhook -- --rules 1000 --seconds 10 --concurrency 32
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use clap::Parser;
use hyper::body::Bytes;
use serde_json::{Value, json};
use tokio_rustls::rustls;

use support::cluster::{create_rules, ready_rules};
use support::direct::{RssSampler, connect, cpu_seconds, send, tls_config};
use support::fixtures;
use support::measure::{Percentiles, machine, mib, round};
use support::plane::{Plane, root, run as run_command};
use support::process::{Initium, InitiumOptions};
use support::wait::poll;

/// Load generator for `initium serve`'s `/mutate` webhook.
#[derive(Parser, Debug)]
struct Args {
    /// Rules in the index (at least 10: the 10 that match the Pod).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(10..=20_000))]
    rules: u32,
    /// Measured seconds of load (after the warm-up).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600))]
    seconds: u64,
    /// Unmeasured seconds of load first (connections, caches, allocator).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=60))]
    warmup: u64,
    /// Keep-alive HTTPS connections, each with one request in flight.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    concurrency: u32,
    /// Threads of the load generator.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    client_threads: u32,
    /// Stop after this many requests (warm-up included), whatever the time.
    #[arg(long, default_value_t = 20_000_000)]
    max_requests: u64,
    /// Pin initium to CPU 0 and the load generator to CPU 1 (`taskset`), so they do not
    /// take turns on the same core.
    #[arg(long)]
    pin: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("webhook benchmark failed: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let setup = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    let plane = Plane::up("webhook")?;
    plane.install_crds()?;
    let rules = fixtures::rules(args.rules as usize);
    let client = setup.block_on(plane.client())?;
    let started = Instant::now();
    setup.block_on(create_rules(&client, &rules, 32))?;
    eprintln!(
        "bench: created {} rules through the API server in {:.1}s",
        rules.len(),
        started.elapsed().as_secs_f64()
    );

    let log =
        std::env::temp_dir().join(format!("initium-bench-webhook-{}.log", std::process::id()));
    let started = Instant::now();
    let initium = Initium::start(
        &plane,
        InitiumOptions {
            namespace: "initium-bench".into(),
            extra: vec![],
            cpus: args.pin.then(|| "0".to_string()),
            log: log.clone(),
        },
    )?;
    let want = rules.len() as f64;
    poll(
        "every rule compiled into initium's index",
        Duration::from_secs(600),
        Duration::from_millis(200),
        || {
            let ready = initium.metric("initium_rules{state=\"ready\"")?;
            let invalid = initium.metric("initium_rules{state=\"invalid\"")?;
            if invalid > 0.0 && ready + invalid >= want {
                bail!("{invalid} rules are not Ready; see {}", log.display());
            }
            Ok((ready >= want)
                .then_some(())
                .ok_or_else(|| format!("{ready} of {want} rules compiled")))
        },
    )?;
    let compiled_after = started.elapsed();
    // The Lease holder writes every rule's status once at start-up; wait for it, so the load
    // runs on a quiet process.
    poll(
        "every rule's Ready status",
        Duration::from_secs(900),
        Duration::from_secs(2),
        || {
            let ready = setup.block_on(ready_rules(&client))?;
            Ok((ready >= rules.len())
                .then_some(())
                .ok_or_else(|| format!("{ready} of {} rules Ready", rules.len())))
        },
    )?;
    let settled_after = started.elapsed();
    let memory_idle = initium.memory()?;
    eprintln!(
        "bench: initium (pid {}) compiled {} rules {:.1}s after start, all statuses written after {:.1}s; RSS {:.1} MiB, peak {:.1} MiB; log {}",
        initium.pid(),
        rules.len(),
        compiled_after.as_secs_f64(),
        settled_after.as_secs_f64(),
        mib(memory_idle.rss_kib),
        mib(memory_idle.peak_kib),
        log.display()
    );

    let ca = initium.ca_bundle(&plane)?;
    let bodies = Bodies::new()?;
    let tls = tls_config(&ca)?;
    // Before pinning: available_parallelism follows this process's CPU affinity.
    let machine = machine();
    if args.pin {
        run_command(std::process::Command::new("taskset").args([
            "-a",
            "-p",
            "-c",
            "1",
            &std::process::id().to_string(),
        ]))?;
    }
    let load = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.client_threads as usize)
        .enable_all()
        .build()?;
    load.block_on(check_answers(initium.webhook, tls.clone(), &bodies))?;

    let server_cpu_before = cpu_seconds(initium.pid())?;
    let requests_before = initium.metric("initium_admission_duration_seconds_count")?;
    let sampler = RssSampler::start(initium.pid());
    let report = load.block_on(generate(args, initium.webhook, tls, &bodies))?;
    let rss_during_load = sampler.stop();
    let server_cpu = cpu_seconds(initium.pid())? - server_cpu_before;
    let served = initium.metric("initium_admission_duration_seconds_count")? - requests_before;
    let memory = initium.memory()?;
    drop(initium);
    drop(plane);

    let latency = Percentiles::new(report.latency_us);
    let server = Percentiles::new(report.server_us);
    let measured = report.measured.as_secs_f64();
    let rps = latency.len() as f64 / measured;
    let cpu_us_per_review = server_cpu * 1e6 / served.max(1.0);
    let rss_mib = mib(rss_during_load.max(memory.rss_kib));
    let peak_mib = mib(memory.peak_kib);

    println!("webhook benchmark: {machine}");
    println!(
        "  {} rules ({} match the Pod), {} connections, {} client thread(s){}, {}s measured after {}s warm-up",
        rules.len(),
        fixtures::matching_rules().len(),
        args.concurrency,
        args.client_threads,
        if args.pin {
            ", initium on CPU 0 and the load on CPU 1"
        } else {
            ""
        },
        args.seconds,
        args.warmup
    );
    println!(
        "  reviews: {} ({} Pods, {} Deployments), errors: {}",
        latency.len(),
        report.pods,
        report.deployments,
        report.errors
    );
    println!("  throughput: {rps:.0} reviews/s");
    println!(
        "  client latency: p50 {:.3} ms, p99 {:.3} ms, p99.9 {:.3} ms, max {:.3} ms",
        latency.ms(0.5),
        latency.ms(0.99),
        latency.ms(0.999),
        latency.ms(1.0)
    );
    println!(
        "  server time:    p50 {:.3} ms, p99 {:.3} ms, p99.9 {:.3} ms ({:.2}% within 0.25 ms)",
        server.ms(0.5),
        server.ms(0.99),
        server.ms(0.999),
        server.share_at_most(250) * 100.0
    );
    println!(
        "  initium CPU: {cpu_us_per_review:.1} us per review ({server_cpu:.2} s for {served} reviews)"
    );
    println!(
        "  initium memory: {rss_mib:.1} MiB resident during the load, {peak_mib:.1} MiB peak since start"
    );
    let goals = json!({
        "rps_15000": rps >= 15_000.0,
        "server_p99_0_25ms": server.ms(0.99) <= 0.25,
        "rss_64mib": peak_mib <= 64.0,
    });
    println!("  goals: {goals}");
    let line = json!({
        "bench": "webhook",
        "rules": rules.len(),
        "concurrency": args.concurrency,
        "client_threads": args.client_threads,
        "pinned": args.pin,
        "seconds": args.seconds,
        "requests": latency.len(),
        "errors": report.errors,
        "rps": round(rps, 0),
        "p50_ms": round(latency.ms(0.5), 3),
        "p99_ms": round(latency.ms(0.99), 3),
        "p999_ms": round(latency.ms(0.999), 3),
        "server_p50_ms": round(server.ms(0.5), 3),
        "server_p99_ms": round(server.ms(0.99), 3),
        "server_p999_ms": round(server.ms(0.999), 3),
        "server_cpu_us_per_review": round(cpu_us_per_review, 1),
        "rss_mib": round(rss_mib, 1),
        "peak_rss_mib": round(peak_mib, 1),
        "goals_met": goals,
    });
    println!("{line}");
    if report.errors > 0 {
        bail!("{} requests failed", report.errors);
    }
    Ok(())
}

/// The two request bodies.
struct Bodies {
    pod: Bytes,
    deployment: Bytes,
}

impl Bodies {
    fn new() -> Result<Bodies> {
        let recorded = |name: &str| -> Result<Value> {
            let path = root()
                .join("tests/data/admission")
                .join(format!("{name}.json"));
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Ok(serde_json::from_str(&text)?)
        };
        let mut pod = recorded("pod-create")?;
        let object = fixtures::pod();
        pod["request"]["namespace"] = object["metadata"]["namespace"].clone();
        pod["request"]["object"] = object;
        let deployment = recorded("deployment-create")?;
        Ok(Bodies {
            pod: Bytes::from(serde_json::to_vec(&pod)?),
            deployment: Bytes::from(serde_json::to_vec(&deployment)?),
        })
    }

    /// Three Pods, then a Deployment.
    fn nth(&self, n: u64) -> (&Bytes, bool) {
        if n % 4 == 3 {
            (&self.deployment, false)
        } else {
            (&self.pod, true)
        }
    }
}

/// Before the load: the Pod review comes back allowed with the patch of all 10 rules, the
/// Deployment review allowed and unchanged. A benchmark of wrong answers measures nothing.
async fn check_answers(
    addr: std::net::SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    bodies: &Bodies,
) -> Result<()> {
    let mut sender = connect(addr, tls).await?;
    let review = |body: &Bytes| -> Result<Value> {
        serde_json::from_slice(body).context("the answer is not an AdmissionReview")
    };
    let (status, body, server) = send(&mut sender, addr, &bodies.pod).await?;
    let answer = review(&body)?;
    if status != 200 || answer["response"]["allowed"] != true {
        bail!("the Pod review was not allowed ({status}): {answer}");
    }
    if server.is_none() {
        bail!("initium's answer has no Server-Timing header");
    }
    let patch = answer["response"]["patch"]
        .as_str()
        .context("the Pod review got no patch")?;
    let patch = base64::engine::general_purpose::STANDARD.decode(patch)?;
    let patch: Value = serde_json::from_slice(&patch)?;
    let provenance = patch
        .as_array()
        .into_iter()
        .flatten()
        .find(|op| {
            op["path"]
                .as_str()
                .is_some_and(|p| p.contains("initium.dev~1mutated-by"))
        })
        .and_then(|op| op["value"].as_str())
        .context("the patch has no initium.dev/mutated-by annotation")?;
    let applied = provenance.split(',').count();
    let expected = fixtures::matching_rules().len();
    if applied != expected {
        bail!("{applied} rules changed the Pod, expected {expected}: {provenance}");
    }
    let (status, body, _) = send(&mut sender, addr, &bodies.deployment).await?;
    let answer = review(&body)?;
    if status != 200
        || answer["response"]["allowed"] != true
        || !answer["response"]["patch"].is_null()
    {
        bail!("the Deployment review was not allowed unchanged ({status}): {answer}");
    }
    Ok(())
}

#[derive(Default)]
struct Report {
    latency_us: Vec<u32>,
    server_us: Vec<u32>,
    pods: u64,
    deployments: u64,
    errors: u64,
    measured: Duration,
}

async fn generate(
    args: &Args,
    addr: std::net::SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    bodies: &Bodies,
) -> Result<Report> {
    let start = Instant::now();
    let measure_from = start + Duration::from_secs(args.warmup);
    let stop_at = measure_from + Duration::from_secs(args.seconds);
    let sent = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let bodies = Arc::new(Bodies {
        pod: bodies.pod.clone(),
        deployment: bodies.deployment.clone(),
    });
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency {
        let mut sender = connect(addr, tls.clone()).await?;
        let (sent, stop, bodies, tls) = (sent.clone(), stop.clone(), bodies.clone(), tls.clone());
        let max = args.max_requests;
        tasks.push(tokio::spawn(async move {
            let mut report = Report::default();
            loop {
                let n = sent.fetch_add(1, Ordering::Relaxed);
                if n >= max || stop.load(Ordering::Relaxed) {
                    break;
                }
                let (body, is_pod) = bodies.nth(n);
                let before = Instant::now();
                if before >= stop_at {
                    break;
                }
                let result = send(&mut sender, addr, body).await;
                let after = Instant::now();
                if before < measure_from {
                    continue;
                }
                match result {
                    Ok((200, _, Some(server))) => {
                        report
                            .latency_us
                            .push(u32::try_from((after - before).as_micros()).unwrap_or(u32::MAX));
                        report.server_us.push(server);
                        if is_pod {
                            report.pods += 1;
                        } else {
                            report.deployments += 1;
                        }
                    }
                    Ok(_) | Err(_) => {
                        report.errors += 1;
                        if result.is_err() {
                            // The connection is gone; a new one keeps the concurrency.
                            match connect(addr, tls.clone()).await {
                                Ok(s) => sender = s,
                                Err(_) => break,
                            }
                        }
                    }
                }
            }
            report
        }));
    }
    let watchdog = {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(stop_at.into()).await;
            stop.store(true, Ordering::Relaxed);
        })
    };
    let mut total = Report::default();
    for task in tasks {
        let part = task.await?;
        total.latency_us.extend(part.latency_us);
        total.server_us.extend(part.server_us);
        total.pods += part.pods;
        total.deployments += part.deployments;
        total.errors += part.errors;
    }
    watchdog.abort();
    let ended = Instant::now().min(stop_at);
    total.measured = ended.saturating_duration_since(measure_from);
    if total.measured.is_zero() {
        bail!("no measured requests: --max-requests ended the load during the warm-up");
    }
    Ok(total)
}
