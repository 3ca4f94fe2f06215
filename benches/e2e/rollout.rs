//! `--rollout`: what a user sees after admission. On a whole cluster (`up --nodes 3`:
//! controller manager, scheduler, nodes simulated by kwok, so Pods become Running and Ready
//! without containers), the time from creating a Deployment of `--replicas` Pods to its
//! rollout being complete: every replica updated and available, as `kubectl rollout status`
//! waits for. The configurations are those of the Pod CREATE benchmark, set up the same way;
//! each round rolls out one Deployment in every configuration's namespace, in an order that
//! rotates every round, and deletes it and waits for its Pods to go before the next, so every
//! rollout starts from an empty namespace.
//!
//! Every Pod the controllers create goes through admission (generateName, no name yet), so
//! the rollout time includes the mutation once per replica; the ReplicaSet controller
//! creates them in growing batches, rate-limited by the controller manager's client
//! (default 20 requests/s), which dominates the rollout.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::wait::await_condition;
use serde_json::json;

use super::support::measure::{machine, round};
use super::support::wait::poll;
use super::support::workloads::NODES;
use super::{Args, Config, INITIUM, MAP, Memory, NONE, is_mutated, pod_spec};

/// The label of the benchmark's Deployments and their Pods: `app: rollout`.
const APP: &str = "rollout";

/// How long one rollout, or its Pods going away, may take before the benchmark gives up.
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(600);

/// Rollout times in seconds, by configuration name, in the order measured.
pub type Rollouts = BTreeMap<&'static str, Vec<f64>>;

/// Waits until every configuration's namespace has its `default` ServiceAccount (created by
/// the controller manager a moment after the namespace).
pub fn service_accounts(
    runtime: &tokio::runtime::Runtime,
    client: &kube::Client,
    configs: &[Config],
) -> Result<()> {
    for config in configs {
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), config.namespace);
        poll(
            &format!(
                "the default ServiceAccount of namespace {}",
                config.namespace
            ),
            Duration::from_secs(60),
            Duration::from_millis(200),
            || {
                let found = runtime.block_on(accounts.get_opt("default"))?;
                Ok(found
                    .map(|_| ())
                    .ok_or_else(|| "not created yet".to_owned()))
            },
        )?;
    }
    Ok(())
}

/// A Deployment of `replicas` benchmark Pods labelled `app: rollout`.
fn deployment(name: &str, replicas: u32) -> Result<Deployment> {
    let value = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": APP}},
            "template": {"metadata": {"labels": {"app": APP}}, "spec": pod_spec()},
        }
    });
    serde_json::from_value(value).context("the benchmark's Deployment")
}

/// Whether the Deployment's current generation has rolled out: observed, every replica
/// updated and available, no old Pod left.
fn rolled_out(deployment: Option<&Deployment>) -> bool {
    let Some(deployment) = deployment else {
        return false;
    };
    let wanted = deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1);
    let Some(status) = &deployment.status else {
        return false;
    };
    status.observed_generation == deployment.metadata.generation
        && status.updated_replicas == Some(wanted)
        && status.available_replicas == Some(wanted)
        && status.replicas == Some(wanted)
}

/// Before measuring, a one-replica rollout per configuration whose Pod must come out mutated
/// exactly as expected (none: not at all); then `--rounds` measured rollouts per
/// configuration, alternating, every Pod of each checked the same way.
pub async fn measure(args: &Args, client: &kube::Client, configs: &[Config]) -> Result<Rollouts> {
    for config in configs {
        let seconds = rollout(client, config, "check", 1).await?;
        eprintln!(
            "bench: {}: a one-replica Deployment rolled out in {seconds:.2}s, its Pod {}",
            config.name,
            if config.mutates {
                "mutated"
            } else {
                "not mutated"
            }
        );
    }
    let mut measured: Rollouts = configs.iter().map(|c| (c.name, Vec::new())).collect();
    for round in 0..args.rounds {
        let first = round as usize % configs.len();
        for i in 0..configs.len() {
            let config = &configs[(first + i) % configs.len()];
            let seconds = rollout(client, config, &format!("web-{round}"), args.replicas).await?;
            eprintln!(
                "bench: round {}/{}: {} rolled out {} replicas in {seconds:.2}s",
                round + 1,
                args.rounds,
                config.name,
                args.replicas
            );
            if let Some(samples) = measured.get_mut(config.name) {
                samples.push(seconds);
            }
        }
    }
    Ok(measured)
}

/// One rollout in `config`'s namespace: creates the Deployment and times it to rolled out,
/// checks every Pod's mutation, then deletes it and waits until its Pods are gone. Returns
/// the rollout time in seconds.
async fn rollout(client: &kube::Client, config: &Config, name: &str, replicas: u32) -> Result<f64> {
    let namespace = config.namespace;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let started = Instant::now();
    deployments
        .create(&PostParams::default(), &deployment(name, replicas)?)
        .await
        .with_context(|| format!("cannot create Deployment {namespace}/{name}"))?;
    let done = tokio::time::timeout(
        ROLLOUT_TIMEOUT,
        await_condition(deployments.clone(), name, rolled_out),
    )
    .await;
    let seconds = started.elapsed().as_secs_f64();
    match done {
        Ok(watched) => {
            watched.with_context(|| format!("cannot watch Deployment {namespace}/{name}"))?;
        }
        Err(_) => {
            let status = deployments.get(name).await.map(|d| d.status);
            bail!(
                "Deployment {namespace}/{name} did not roll out within {ROLLOUT_TIMEOUT:?}; \
                 its status: {status:?}. Is every component of the cluster running? \
                 (scripts/control-plane status --dir <the plane's dir>)"
            );
        }
    }

    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let selector = format!("app={APP}");
    let listed = pods
        .list(&ListParams::default().labels(&selector))
        .await
        .with_context(|| format!("cannot list the Pods {selector} of {namespace}"))?
        .items;
    if listed.len() != replicas as usize {
        bail!(
            "Deployment {namespace}/{name} rolled out with {} Pods, not {replicas}",
            listed.len()
        );
    }
    if let Some(wrong) = listed
        .iter()
        .find(|pod| is_mutated(pod, namespace) != config.mutates)
    {
        bail!(
            "Pod {namespace}/{} of the {} configuration was {} mutated",
            wrong.metadata.name.as_deref().unwrap_or_default(),
            config.name,
            if config.mutates {
                "not"
            } else {
                "unexpectedly"
            }
        );
    }

    deployments
        .delete(name, &DeleteParams::background())
        .await
        .with_context(|| format!("cannot delete Deployment {namespace}/{name}"))?;
    let deadline = Instant::now() + ROLLOUT_TIMEOUT;
    loop {
        // Terminating Pods count too: the next rollout starts from an empty namespace.
        let left = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .with_context(|| format!("cannot list the Pods {selector} of {namespace}"))?
            .items
            .len();
        if left == 0 {
            break;
        }
        if Instant::now() >= deadline {
            return Err(anyhow!(
                "{left} Pods of the deleted Deployment {namespace}/{name} were still there after \
                 {ROLLOUT_TIMEOUT:?}; kwok removes deleted Pods: is it running?"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(seconds)
}

/// Median, mean, minimum and maximum of some seconds.
struct Summary {
    median: f64,
    mean: f64,
    min: f64,
    max: f64,
}

impl Summary {
    fn new(seconds: &[f64]) -> Result<Summary> {
        let mut sorted = seconds.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        if n == 0 {
            bail!("no rollout was measured");
        }
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Ok(Summary {
            median,
            mean: sorted.iter().sum::<f64>() / n as f64,
            min: sorted[0],
            max: sorted[n - 1],
        })
    }
}

/// The human summary, then one JSON line.
pub fn report(
    args: &Args,
    configs: &[Config],
    measured: &Rollouts,
    memory: &Memory,
    admission: &super::apiserver::Admission,
) -> Result<()> {
    let summaries: BTreeMap<&str, Summary> = measured
        .iter()
        .map(|(name, seconds)| Ok((*name, Summary::new(seconds)?)))
        .collect::<Result<_>>()?;
    let get = |name: &str| summaries.get(name).context("missing configuration");
    println!("e2e rollout benchmark: {}", machine());
    println!("  {}", super::served_line());
    println!(
        "  Deployment of {} replicas, created to rolled out, on {NODES} simulated nodes: {} rounds, configurations alternating",
        args.replicas, args.rounds
    );
    let none = get(NONE.name)?;
    let mut figures = serde_json::Map::new();
    for config in configs {
        let s = get(config.name)?;
        let added_median_ms = (s.median - none.median) * 1000.0;
        let added_mean_ms = (s.mean - none.mean) * 1000.0;
        println!(
            "  {:<13} median {:7.3} s  mean {:7.3} s  min {:7.3} s  max {:7.3} s  ({:+.0} ms median, {:+.0} ms mean over none)",
            config.name, s.median, s.mean, s.min, s.max, added_median_ms, added_mean_ms
        );
        let rounds: Vec<f64> = measured
            .get(config.name)
            .into_iter()
            .flatten()
            .map(|s| round(*s, 3))
            .collect();
        figures.insert(
            config.name.to_string(),
            json!({
                "median_s": round(s.median, 3),
                "mean_s": round(s.mean, 3),
                "min_s": round(s.min, 3),
                "max_s": round(s.max, 3),
                "added_median_ms": round(added_median_ms, 0),
                "added_mean_ms": round(added_mean_ms, 0),
                "rounds_s": rounds,
            }),
        );
    }
    let map = get(MAP.name)?;
    let initium = get(INITIUM.name)?;
    let ratio_median = (initium.median - none.median) / (map.median - none.median);
    let ratio_mean = (initium.mean - none.mean) / (map.mean - none.mean);
    let none_spread_ms = (none.max - none.min) * 1000.0;
    println!(
        "  ratio (initium - none) / (map - none): median {ratio_median:.2}, mean {ratio_mean:.2} (goal <= 1.5)"
    );
    println!("  none's own spread over the rounds: {none_spread_ms:.0} ms (max - min)");
    // Whether the ratio means anything: MAP's own added time must be told apart from zero,
    // or the ratio is one noise over another. Resampling whole rounds (each round rolled out
    // every configuration, in a rotating order) gives 90% intervals.
    let rounds = |name: &str| measured.get(name).map(Vec::as_slice).unwrap_or_default();
    let intervals = Intervals::of(rounds(NONE.name), rounds(MAP.name), rounds(INITIUM.name));
    let measurable = intervals.map_added_ms.0 > 0.0;
    println!(
        "  90% intervals ({BOOTSTRAP_RESAMPLES} resamples of whole rounds): map adds {:+.0}..{:+.0} ms (mean), initium - map {:+.0}..{:+.0} ms, ratio of means {:.2}..{:.2}",
        intervals.map_added_ms.0,
        intervals.map_added_ms.1,
        intervals.initium_minus_map_ms.0,
        intervals.initium_minus_map_ms.1,
        intervals.ratio_mean.0,
        intervals.ratio_mean.1,
    );
    if !measurable {
        println!(
            "  map's added time is not told apart from zero: the ratio is noise, the goal undecided"
        );
    }
    admission.print();
    let (initium_mib, kyverno_mib) = memory.print_peaks();
    let line = json!({
        "bench": "e2e-rollout",
        "apiserver": admission.json(),
        "replicas": args.replicas,
        "rounds": args.rounds,
        "nodes": NODES,
        "other_rules": args.other_rules,
        "configs": figures,
        "none_spread_ms": round(none_spread_ms, 0),
        "overhead_ratio_median": round(ratio_median, 2),
        "overhead_ratio_mean": round(ratio_mean, 2),
        "map_added_mean_ms_90": [round(intervals.map_added_ms.0, 0), round(intervals.map_added_ms.1, 0)],
        "initium_minus_map_mean_ms_90": [round(intervals.initium_minus_map_ms.0, 0), round(intervals.initium_minus_map_ms.1, 0)],
        "ratio_mean_90": [round(intervals.ratio_mean.0, 2), round(intervals.ratio_mean.1, 2)],
        "ratio_measurable": measurable,
        "goal_met": measurable.then_some(ratio_median <= 1.5 && ratio_mean <= 1.5),
        "goal_met_at_90": measurable.then_some(intervals.ratio_mean.1 <= 1.5),
        "initium_peak_rss_mib": round(initium_mib, 1),
        "kyverno_peak_rss_mib": kyverno_mib.map(|k| round(k, 1)),
    });
    println!("{line}");
    Ok(())
}

/// Resamples of the rounds for the 90% intervals.
const BOOTSTRAP_RESAMPLES: usize = 5_000;

/// 90% bootstrap intervals (5th and 95th percentiles) over whole rounds.
struct Intervals {
    /// mean(map) - mean(none), ms.
    map_added_ms: (f64, f64),
    /// mean(initium) - mean(map), ms.
    initium_minus_map_ms: (f64, f64),
    /// (mean(initium) - mean(none)) / (mean(map) - mean(none)); a resample where map adds
    /// nothing counts as an unbounded ratio.
    ratio_mean: (f64, f64),
}

impl Intervals {
    /// From the rollout times of each configuration, indexed by round. The resampling is
    /// seeded: the same rounds give the same intervals.
    fn of(none: &[f64], map: &[f64], initium: &[f64]) -> Intervals {
        let n = none.len().min(map.len()).min(initium.len());
        if n == 0 {
            return Intervals {
                map_added_ms: (f64::NAN, f64::NAN),
                initium_minus_map_ms: (f64::NAN, f64::NAN),
                ratio_mean: (f64::NAN, f64::NAN),
            };
        }
        // splitmix64: enough randomness for resampling, no dependency.
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let mut map_added = Vec::with_capacity(BOOTSTRAP_RESAMPLES);
        let mut initium_minus_map = Vec::with_capacity(BOOTSTRAP_RESAMPLES);
        let mut ratio = Vec::with_capacity(BOOTSTRAP_RESAMPLES);
        for _ in 0..BOOTSTRAP_RESAMPLES {
            let (mut sum_none, mut sum_map, mut sum_initium) = (0.0, 0.0, 0.0);
            for _ in 0..n {
                let i = (next() % n as u64) as usize;
                sum_none += none[i];
                sum_map += map[i];
                sum_initium += initium[i];
            }
            let (none, map, initium) = (
                sum_none / n as f64,
                sum_map / n as f64,
                sum_initium / n as f64,
            );
            map_added.push((map - none) * 1000.0);
            initium_minus_map.push((initium - map) * 1000.0);
            ratio.push(if map > none {
                (initium - none) / (map - none)
            } else {
                f64::INFINITY
            });
        }
        Intervals {
            map_added_ms: percentiles(&mut map_added),
            initium_minus_map_ms: percentiles(&mut initium_minus_map),
            ratio_mean: percentiles(&mut ratio),
        }
    }
}

/// The 5th and 95th percentiles.
fn percentiles(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    (at(0.05), at(0.95))
}
