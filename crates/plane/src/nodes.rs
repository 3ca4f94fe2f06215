//! A cluster with nodes (`up --nodes N`): kube-controller-manager, kube-scheduler and kwok
//! on the plane's API server, and N Nodes for kwok to simulate.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::launch::{self, KWOK_NODE_ANNOTATION, Started, read_port};
use crate::log::log;
use crate::process::free_ports;
use crate::settings::{KWOK_VERSION, NODE_COMPONENTS, Settings};

/// Starts them all at once on free ports, then waits until each is healthy (retrying one
/// whose port was taken).
fn start_components(
    settings: &Settings,
    dir: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    let mut pending: Vec<&str> = NODE_COMPONENTS.to_vec();
    for attempt in 1..=3 {
        for (name, port) in pending.iter().zip(free_ports(pending.len())?) {
            std::fs::write(dir.join(format!("{name}.port")), format!("{port}\n"))?;
            launch::launch(settings, dir, name)?;
        }
        let mut retry = Vec::new();
        for name in pending {
            match launch::wait_healthy(dir, name, deadline, timeout)? {
                Started::Healthy => {}
                Started::Failed => bail!("{name} did not start"),
                Started::PortTaken => {
                    log(format_args!(
                        "{name}: port taken, retrying (attempt {attempt})"
                    ));
                    let log_file = dir.join(format!("{name}.log"));
                    let _ = std::fs::rename(
                        &log_file,
                        log_file.with_extension(format!("log.{attempt}")),
                    );
                    retry.push(name);
                }
            }
        }
        if retry.is_empty() {
            return Ok(());
        }
        pending = retry;
    }
    bail!(
        "{} did not start: their ports were taken three times",
        pending.join(", ")
    )
}

/// The cached kubectl as the plane's administrator.
fn kubectl_admin(settings: &Settings, dir: &Path) -> Command {
    let mut command = Command::new(settings.bin("kubectl"));
    command
        .arg(format!("--kubeconfig={}", dir.join("kubeconfig").display()))
        .arg("--request-timeout=5s");
    command
}

/// Nodes kwok-node-1 ... kwok-node-N for kwok to manage. Their capacity fits a few hundred
/// Pods each (benchmarks roll out 100+ Pods); kwok's node-initialize stage keeps it and makes
/// the Node Ready.
fn create_nodes(settings: &Settings, dir: &Path, n: u32) -> Result<()> {
    let (key, value) = KWOK_NODE_ANNOTATION;
    let manifest: String = (1..=n)
        .map(|i| {
            format!(
                "---
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-{i}
  annotations:
    {key}: {value}
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: kwok-node-{i}
status:
  allocatable: {{cpu: '64', memory: 256Gi, pods: '250'}}
  capacity: {{cpu: '64', memory: 256Gi, pods: '250'}}
"
            )
        })
        .collect();
    let mut child = kubectl_admin(settings, dir)
        .args(["create", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run kubectl")?;
    child
        .stdin
        .take()
        .context("kubectl has no stdin")?
        .write_all(manifest.as_bytes())?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "kubectl create of the nodes failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// N kwok Nodes are Ready and untainted (the controller manager lifts the not-ready taint
/// once a Node is Ready).
fn nodes_schedulable(settings: &Settings, dir: &Path, n: u32) -> bool {
    let template = r#"go-template={{range .items}}{{if not .spec.taints}}{{range .status.conditions}}{{if and (eq .type "Ready") (eq .status "True")}}ready {{end}}{{end}}{{end}}{{end}}"#;
    let Ok(output) = kubectl_admin(settings, dir)
        .args(["get", "nodes", "-l", "type=kwok", "-o", template])
        .stderr(Stdio::null())
        .output()
    else {
        return false;
    };
    output.status.success()
        && String::from_utf8_lossy(&output.stdout)
            .split_whitespace()
            .count()
            == n as usize
}

/// Polls `check` every half second until it holds or the deadline passes.
fn wait_until(
    deadline: Instant,
    timeout: Duration,
    what: &str,
    check: impl Fn() -> bool,
) -> Result<()> {
    while !check() {
        if Instant::now() >= deadline {
            bail!("{what}: not after {}s", timeout.as_secs());
        }
        sleep(Duration::from_millis(500));
    }
    Ok(())
}

/// The node components, N Nodes, and a wait until Pods can be created (the default
/// ServiceAccount exists) and scheduled onto the Nodes.
pub(crate) fn start(settings: &Settings, dir: &Path, n: u32, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let apiserver = read_port(dir, "kube-apiserver")?;
    for name in NODE_COMPONENTS {
        launch::write_kubeconfig(dir, apiserver, Some(name))?;
        launch::save_extra_args(dir, name)?;
    }
    log(format_args!(
        "starting kube-controller-manager and kube-scheduler {}, kwok {KWOK_VERSION}",
        settings.release.version
    ));
    start_components(settings, dir, deadline, timeout)?;
    if n > 0 {
        log(format_args!("creating {n} simulated node(s)"));
        create_nodes(settings, dir, n)?;
    }
    wait_until(
        deadline,
        timeout,
        &format!("{n} node(s) Ready and schedulable"),
        || nodes_schedulable(settings, dir, n),
    )?;
    wait_until(
        deadline,
        timeout,
        "the default ServiceAccount in namespace default",
        || {
            kubectl_admin(settings, dir)
                .args(["get", "serviceaccount", "default", "--namespace=default"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        },
    )
}
