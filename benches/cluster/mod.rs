//! What the cluster benchmarks share: a real control plane (`scripts/control-plane`), the
//! CRDs, rules created through the API server, an `initium serve` process, its memory, and
//! latency statistics. Benchmarks are not tests: every failure here is an error with a
//! message, returned to `main`, which prints it and exits 1.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, PostParams};
use serde_json::Value;

/// The repository root.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Polls `f` every `every` until it returns `Some`, or fails after `timeout` naming `what`.
pub fn eventually<T>(
    timeout: Duration,
    every: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let started = Instant::now();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        if started.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(every);
    }
}

/// Runs a command; its stdout, or an error with its output.
pub fn run(command: &mut Command) -> Result<String> {
    let output = command
        .output()
        .with_context(|| format!("cannot run {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({})\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A free port on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("no free port")?;
    Ok(listener.local_addr()?.port())
}

/// An etcd + kube-apiserver started with `scripts/control-plane up` for this benchmark run
/// (built from Go modules on first use, cached outside the clone). It stops when dropped,
/// and by itself if this process dies (`--owner-pid`).
pub struct Plane {
    dir: PathBuf,
    pub kubeconfig: PathBuf,
    kubectl: PathBuf,
}

impl Plane {
    pub fn up(name: &str) -> Result<Plane> {
        let script = root().join("scripts/control-plane");
        let bin_dir = PathBuf::from(run(Command::new(&script).arg("bin-dir"))?.trim());
        eprintln!("bench: building (or reusing) the control plane ...");
        let status = Command::new(&script)
            .arg("build")
            .stdout(Stdio::null())
            .status()
            .context("cannot run scripts/control-plane build")?;
        if !status.success() {
            bail!("scripts/control-plane build failed ({status})");
        }
        let dir = std::env::temp_dir().join(format!("initium-bench-{name}-{}", std::process::id()));
        eprintln!("bench: starting etcd + kube-apiserver in {}", dir.display());
        run(Command::new(&script)
            .arg("up")
            .arg("--dir")
            .arg(&dir)
            .arg("--owner-pid")
            .arg(std::process::id().to_string()))?;
        Ok(Plane {
            kubeconfig: dir.join("kubeconfig"),
            kubectl: bin_dir.join("kubectl"),
            dir,
        })
    }

    /// `kubectl --kubeconfig <this plane>`.
    pub fn kubectl(&self) -> Command {
        let mut command = Command::new(&self.kubectl);
        command.arg("--kubeconfig").arg(&self.kubeconfig);
        command
    }

    /// `kubectl apply --server-side -f -` with `yaml` on stdin.
    pub fn apply(&self, yaml: &str) -> Result<()> {
        let mut child = self
            .kubectl()
            .args(["apply", "--server-side", "--force-conflicts", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot run kubectl")?;
        child
            .stdin
            .take()
            .context("kubectl stdin")?
            .write_all(yaml.as_bytes())?;
        let output = child.wait_with_output()?;
        if !output.status.success() {
            bail!(
                "kubectl apply failed: {}\n--- input\n{yaml}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }

    pub async fn client(&self) -> Result<kube::Client> {
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// Installs `crds/` and waits until both CRDs are Established.
    pub fn install_crds(&self) -> Result<()> {
        run(self
            .kubectl()
            .args(["apply", "--server-side", "-k"])
            .arg(root().join("crds")))?;
        for crd in [
            "mutationrules.initium.dev",
            "clustermutationrules.initium.dev",
        ] {
            // Not `kubectl wait`: it fails on a CRD so new that it has no conditions yet.
            eventually(
                Duration::from_secs(60),
                Duration::from_millis(100),
                &format!("CRD {crd} to be Established"),
                || {
                    // A filter on conditions that are not there yet is an error: not yet.
                    let status = run(self.kubectl().args([
                        "get",
                        "crd",
                        crd,
                        "-o",
                        "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
                    ]))
                    .unwrap_or_default();
                    Ok((status.trim() == "True").then_some(()))
                },
            )?;
        }
        Ok(())
    }

    /// Creates the namespace (with `labels`) unless it exists.
    pub fn namespace(&self, name: &str, labels: &[(&str, &str)]) -> Result<()> {
        let mut yaml = format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n");
        if !labels.is_empty() {
            yaml.push_str("  labels:\n");
            for (k, v) in labels {
                yaml.push_str(&format!("    {k}: \"{v}\"\n"));
            }
        }
        self.apply(&yaml)
    }
}

impl Drop for Plane {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/control-plane"))
            .arg("down")
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The API resource of a rule document's `kind`.
fn rule_resource(kind: &str) -> Result<ApiResource> {
    let (plural, kind) = match kind {
        "MutationRule" => ("mutationrules", "MutationRule"),
        "ClusterMutationRule" => ("clustermutationrules", "ClusterMutationRule"),
        other => bail!("not a rule kind: {other}"),
    };
    Ok(ApiResource {
        group: "initium.dev".into(),
        version: "v1alpha1".into(),
        api_version: "initium.dev/v1alpha1".into(),
        kind: kind.into(),
        plural: plural.into(),
    })
}

/// Creates every namespace the rules live in, then the rules, `concurrency` requests at a time.
pub async fn create_rules(
    client: &kube::Client,
    rules: &[Value],
    concurrency: usize,
) -> Result<()> {
    let mut namespaces: Vec<&str> = rules
        .iter()
        .filter_map(|r| r["metadata"]["namespace"].as_str())
        .collect();
    namespaces.sort_unstable();
    namespaces.dedup();
    let ns_api = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone());
    futures::stream::iter(namespaces.into_iter().map(|name| {
        let ns_api = ns_api.clone();
        async move {
            let ns = k8s_openapi::api::core::v1::Namespace {
                metadata: kube::api::ObjectMeta {
                    name: Some(name.to_string()),
                    ..Default::default()
                },
                ..Default::default()
            };
            match ns_api.create(&PostParams::default(), &ns).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
                Err(e) => Err(anyhow!("create namespace {name}: {e}")),
            }
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await?;

    futures::stream::iter(rules.iter().map(|rule| {
        let client = client.clone();
        async move {
            let kind = rule["kind"].as_str().unwrap_or_default();
            let resource = rule_resource(kind)?;
            let api: Api<DynamicObject> = match rule["metadata"]["namespace"].as_str() {
                Some(ns) => Api::namespaced_with(client, ns, &resource),
                None => Api::all_with(client, &resource),
            };
            let object: DynamicObject = serde_json::from_value(rule.clone())?;
            api.create(&PostParams::default(), &object)
                .await
                .with_context(|| format!("create {kind} {}", rule["metadata"]))?;
            Ok::<(), anyhow::Error>(())
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// How many rules of both kinds have `Ready=True` in their status.
pub async fn ready_rules(client: &kube::Client) -> Result<usize> {
    let mut ready = 0;
    for kind in ["MutationRule", "ClusterMutationRule"] {
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &rule_resource(kind)?);
        let list = api.list(&ListParams::default()).await?;
        ready += list
            .items
            .iter()
            .filter(|rule| {
                rule.data["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
            .count();
    }
    Ok(ready)
}

/// Memory of a process, from /proc/PID/status.
#[derive(Clone, Copy, Debug, Default)]
pub struct Memory {
    /// Resident set now (VmRSS).
    pub rss_kib: u64,
    /// Highest resident set since the process started (VmHWM).
    pub peak_kib: u64,
}

pub fn memory(pid: u32) -> Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("cannot read /proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok(Memory {
        rss_kib: field("VmRSS:")?,
        peak_kib: field("VmHWM:")?,
    })
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Options for one `initium serve` process.
pub struct InitiumOptions {
    /// initium's own namespace (created if missing).
    pub namespace: String,
    /// Extra flags, e.g. `--exclude-namespace x`.
    pub extra: Vec<String>,
    /// Run the process under `taskset -c CPUS`.
    pub cpus: Option<String>,
    /// Where its log goes.
    pub log: PathBuf,
}

/// An `initium serve` process (the binary cargo built with this benchmark), out of cluster:
/// its webhook on 127.0.0.1, registered with the API server by URL. Stopped when dropped.
pub struct Initium {
    child: Child,
    pub webhook: SocketAddr,
    pub ops: SocketAddr,
    pub namespace: String,
    /// Where its stderr goes.
    pub log: PathBuf,
}

impl Initium {
    /// Starts `initium serve` on free ports and waits (up to 180 s) until `/readyz` says ready.
    pub fn start(plane: &Plane, options: InitiumOptions) -> Result<Initium> {
        let webhook: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let ops: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let mut initium = Initium::spawn(plane, &options, webhook, ops)?;
        initium.wait_ready(Duration::from_secs(180))?;
        Ok(initium)
    }

    /// Starts `initium serve` with its webhook on `webhook` and its operations port on `ops`,
    /// without waiting for it to be ready ([`wait_ready`](Self::wait_ready)); the fault tests
    /// start a replica again on the ports it had, and watch what it does while starting.
    pub fn spawn(
        plane: &Plane,
        options: &InitiumOptions,
        webhook: SocketAddr,
        ops: SocketAddr,
    ) -> Result<Initium> {
        plane.namespace(&options.namespace, &[])?;
        // For profiling: INITIUM_BENCH_BINARY runs another build (e.g. one with the system
        // allocator), INITIUM_BENCH_WRAPPER runs it under a tool (`heaptrack -o FILE`). The
        // memory figures are then those of the wrapper's process.
        let binary = std::env::var("INITIUM_BENCH_BINARY")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_initium").into());
        let mut words: Vec<String> = Vec::new();
        if let Some(cpus) = &options.cpus {
            words.extend(["taskset".into(), "-c".into(), cpus.clone()]);
        }
        if let Ok(wrapper) = std::env::var("INITIUM_BENCH_WRAPPER") {
            words.extend(wrapper.split_whitespace().map(String::from));
        }
        words.push(binary);
        let mut command = Command::new(&words[0]);
        command.args(&words[1..]);
        command
            .arg("serve")
            .arg("--listen")
            .arg(webhook.to_string())
            .arg("--webhook-url")
            .arg(format!("https://{webhook}"))
            .arg("--ops-listen")
            .arg(ops.to_string())
            .arg("--namespace")
            .arg(&options.namespace)
            .args(&options.extra)
            .env("KUBECONFIG", &plane.kubeconfig)
            .env("RUST_LOG", "warn")
            // As deploy/deployment.yaml runs it.
            .env("MIMALLOC_ARENA_EAGER_COMMIT", "0")
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&options.log)
                    .with_context(|| format!("cannot write {}", options.log.display()))?,
            );
        let child = command.spawn().context("cannot start initium serve")?;
        Ok(Initium {
            child,
            webhook,
            ops,
            namespace: options.namespace.clone(),
            log: options.log.clone(),
        })
    }

    /// Waits until `/readyz` answers 200; fails if the process exits first.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        eventually(
            timeout,
            Duration::from_millis(100),
            "initium /readyz",
            || {
                if let Some(status) = self.child.try_wait()? {
                    bail!(
                        "initium serve exited ({status}); see {}",
                        self.log.display()
                    );
                }
                Ok((self.get("/readyz").map(|(s, _)| s).unwrap_or(0) == 200).then_some(()))
            },
        )
    }

    /// SIGKILL, as a crash or an OOM kill would end it, and reaps the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process is still running (not exited).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process whose memory counts: initium itself, also under `taskset` (which execs).
    pub fn memory(&self) -> Result<Memory> {
        memory(self.pid())
    }

    /// GET on the operations port: (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        let mut stream = TcpStream::connect(self.ops)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let status = response
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((status, body))
    }

    /// A sample (or the sum over label sets) of a metric on `/metrics`, e.g.
    /// `initium_rules{state="ready"}` or `initium_admission_duration_seconds_count`.
    pub fn metric(&self, name: &str) -> Result<f64> {
        let (_, body) = self.get("/metrics")?;
        Ok(metric_sum(&body, name))
    }

    /// The CA bundle initium publishes (the self-managed CA in its Secret), PEM.
    pub fn ca_bundle(&self, plane: &Plane) -> Result<Vec<u8>> {
        let out = run(plane.kubectl().args([
            "get",
            "secret",
            "-n",
            &self.namespace,
            "initium-tls",
            "-o",
            "jsonpath={.data.ca\\.crt}",
        ]))?;
        use base64::Engine as _;
        Ok(base64::engine::general_purpose::STANDARD.decode(out.trim())?)
    }
}

impl Drop for Initium {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// SIGTERM, up to 10 s to exit, then SIGKILL. Nothing if it has exited (and been reaped)
/// already: its pid may belong to another process by now.
pub fn terminate(child: &mut Child) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Sum of the samples of `name` in a Prometheus text exposition. `name` may carry a label
/// prefix: `initium_rules{state="ready"` matches `initium_rules{state="ready"} 3`.
pub fn metric_sum(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{', '}', ',']))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Latency percentiles over recorded durations in microseconds (nearest-rank).
#[derive(Clone, Debug, Default)]
pub struct Percentiles {
    sorted: Vec<u32>,
}

impl Percentiles {
    pub fn new(mut micros: Vec<u32>) -> Percentiles {
        micros.sort_unstable();
        Percentiles { sorted: micros }
    }

    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// The `q` quantile (0..=1) in milliseconds; 0 when empty.
    pub fn ms(&self, q: f64) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        let rank = ((q * self.sorted.len() as f64).ceil() as usize).clamp(1, self.sorted.len());
        f64::from(self.sorted[rank - 1]) / 1000.0
    }

    pub fn mean_ms(&self) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        self.sorted.iter().map(|&v| f64::from(v)).sum::<f64>() / self.sorted.len() as f64 / 1000.0
    }

    /// Share of samples at or below `micros`.
    pub fn share_at_most(&self, micros: u32) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        self.sorted.partition_point(|&v| v <= micros) as f64 / self.sorted.len() as f64
    }
}

/// Rounds for the JSON line.
pub fn round(value: f64, digits: i32) -> f64 {
    let factor = 10f64.powi(digits);
    (value * factor).round() / factor
}

/// A short description of the machine, for the summary.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    format!("{cores} cores ({cpu}), load average {}", load.join(" "))
}
