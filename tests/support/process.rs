//! `initium serve` as a process beside the control plane: free ports, starting and stopping
//! it, and what its ports answer (`/readyz`, `/metrics`, `/mutate`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::measure::{Memory, memory};
use super::plane::{Plane, run};
use super::wait::poll;

/// How long a stopped process has to exit after SIGTERM before it is killed.
pub const GRACE: Duration = Duration::from_secs(10);

/// A free port on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("no free port")?;
    Ok(listener.local_addr()?.port())
}

/// A free address on 127.0.0.1.
pub fn free_addr() -> Result<SocketAddr> {
    Ok(SocketAddr::from(([127, 0, 0, 1], free_port()?)))
}

/// GET on a plain-HTTP address: (status, body); status 0 if the answer has none.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr)?;
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

/// An `initium serve` process (the binary cargo built with this test or benchmark), out of
/// cluster: its webhook on 127.0.0.1, registered with the API server by URL. Stopped when
/// dropped.
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
    ///
    /// A port found free may be taken before initium binds it (by another test's process, or
    /// as the local port of an outgoing connection): when initium exits saying so, it is
    /// started again on other ports, up to three times in all.
    pub fn start(plane: &Plane, options: InitiumOptions) -> Result<Initium> {
        const ATTEMPTS: usize = 3;
        let mut attempt = 1;
        loop {
            let logged_before = std::fs::metadata(&options.log).map_or(0, |m| m.len());
            let mut initium = Initium::spawn_on_free_ports(plane, &options)?;
            let (webhook, ops) = (initium.webhook, initium.ops);
            match initium.wait_ready(Duration::from_secs(180)) {
                Ok(()) => return Ok(initium),
                Err(e) if attempt < ATTEMPTS && initium.port_was_taken(logged_before) => {
                    eprintln!(
                        "initium serve could not bind {webhook} or {ops} (taken since found \
                         free): starting it again on other ports ({e:#})"
                    );
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the process has exited and its log, after its first `logged_before` bytes,
    /// says a port it was given was in use.
    fn port_was_taken(&mut self, logged_before: u64) -> bool {
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            return false;
        }
        let Ok(log) = std::fs::read(&self.log) else {
            return false;
        };
        let start = usize::try_from(logged_before).unwrap_or(usize::MAX);
        log.get(start..)
            .is_some_and(|new| String::from_utf8_lossy(new).contains("Address already in use"))
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
        plane.ensure_namespace(&options.namespace, &[])?;
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
            // Tests stop it on purpose and wait for it: no drain time behind a Service.
            .arg("--shutdown-delay=0s")
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

    /// [`spawn`](Self::spawn) on free ports.
    pub fn spawn_on_free_ports(plane: &Plane, options: &InitiumOptions) -> Result<Initium> {
        Initium::spawn(plane, options, free_addr()?, free_addr()?)
    }

    /// Waits until `/readyz` answers 200; fails at once if the process exits first.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        poll(
            "initium /readyz",
            timeout,
            Duration::from_millis(100),
            || {
                if let Some(status) = self.child.try_wait()? {
                    bail!(
                        "initium serve exited ({status}); see {}",
                        self.log.display()
                    );
                }
                Ok(match self.get("/readyz") {
                    Ok((200, _)) => Ok(()),
                    Ok((status, body)) => Err(format!("{status} {body}")),
                    Err(e) => Err(e.to_string()),
                })
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

    /// Established TCP connections of the process to the API server of `plane` (each watch
    /// over HTTP/1.1 holds one of its own).
    pub fn api_server_connections(&self, plane: &Plane) -> Result<usize> {
        established_to(self.pid(), api_server_port(plane)?)
    }

    /// GET on the operations port: (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.ops, path)
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
        terminate(&mut self.child, GRACE);
    }
}

/// SIGTERM, up to `grace` to exit, then SIGKILL. Nothing if it has exited (and been reaped)
/// already: its pid may belong to another process by now.
pub fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let started = Instant::now();
    while started.elapsed() < grace {
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

/// POSTs an AdmissionReview straight to a replica's `/mutate` at `webhook` (`127.0.0.1:PORT`;
/// its certificate is from its own CA, hence `-k`) and returns the response.
pub fn post_review(
    webhook: impl std::fmt::Display,
    review: &serde_json::Value,
) -> serde_json::Value {
    let out = Command::new("curl")
        .args([
            "-sk",
            "--max-time",
            "5",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            "@-",
        ])
        .arg(format!("https://{webhook}/mutate"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(review.to_string().as_bytes())?;
            child.wait_with_output()
        })
        .expect("curl runs");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The port of the API server in `plane`'s kubeconfig (`server: https://127.0.0.1:PORT`).
pub fn api_server_port(plane: &Plane) -> Result<u16> {
    let config = std::fs::read_to_string(&plane.kubeconfig)
        .with_context(|| format!("cannot read {}", plane.kubeconfig.display()))?;
    config
        .lines()
        .find_map(|line| line.trim().strip_prefix("server:"))
        .and_then(|url| url.trim().rsplit(':').next())
        .and_then(|port| port.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no server URL in {}", plane.kubeconfig.display()))
}

/// Established TCP connections of process `pid` to `port` on any address: the sockets among
/// its file descriptors (`/proc/PID/fd`, `socket:[INODE]`) that `/proc/net/tcp` and `tcp6`
/// show in state 01 (ESTABLISHED) with that remote port.
pub fn established_to(pid: u32, port: u16) -> Result<usize> {
    let mut inodes = std::collections::HashSet::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("cannot list /proc/{pid}/fd"))?
    {
        let Ok(target) = std::fs::read_link(fd?.path()) else {
            continue; // closed meanwhile
        };
        if let Some(inode) = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
        {
            inodes.insert(inode.to_string());
        }
    }
    let mut count = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(remote), Some(state), Some(inode)) =
                (fields.get(2), fields.get(3), fields.get(9))
            else {
                continue;
            };
            let remote_port = remote
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if *state == "01" && remote_port == Some(port) && inodes.contains(*inode) {
                count += 1;
            }
        }
    }
    Ok(count)
}
