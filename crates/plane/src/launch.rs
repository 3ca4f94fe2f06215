//! Starting one component of a plane: its command line (etcd, kube-apiserver and the node
//! components), the files it reads in DIR (ports, extra flags, kubeconfigs), and waiting until
//! it is healthy. `plane.rs` (up, down) and `nodes.rs` (a plane with nodes) and `component.rs`
//! (stop and start one) all start components through here.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use base64::Engine;

use crate::log::log;
use crate::probe::Probe;
use crate::process::{self, alive, read_pid};
use crate::settings::{REAL_NODE_FILE, Settings, var};

/// The plane in DIR was started with --real-node.
pub(crate) fn is_real_node(dir: &Path) -> bool {
    dir.join(REAL_NODE_FILE).exists()
}

/// The index of the plane's real node (DIR/real-node), once it has one.
pub(crate) fn real_node_index(dir: &Path) -> Option<u8> {
    std::fs::read_to_string(dir.join(REAL_NODE_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The plane in DIR was started with --nodes (DIR/nodes holds N).
pub(crate) fn has_nodes(dir: &Path) -> bool {
    std::fs::metadata(dir.join("nodes")).is_ok_and(|m| m.len() > 0)
}

pub(crate) fn read_port(dir: &Path, name: &str) -> Result<u16> {
    let path = dir.join(format!("{name}.port"));
    std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .trim()
        .parse()
        .with_context(|| format!("{} does not hold a port", path.display()))
}

pub(crate) fn write_file(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).with_context(|| format!("cannot write {}", path.display()))
}

/// The flags added to NAME (split on spaces): saved in DIR/NAME.extra-args at `up`, so that
/// `start-component` starts it with the same ones.
pub(crate) fn extra_args(dir: &Path, name: &str) -> Vec<String> {
    let saved = std::fs::read_to_string(dir.join(format!("{name}.extra-args")))
        .ok()
        .or_else(|| extra_args_var(name).and_then(var))
        .unwrap_or_default();
    saved.split_whitespace().map(str::to_owned).collect()
}

/// The environment variable that adds flags to NAME at `up`.
pub(crate) fn extra_args_var(name: &str) -> Option<&'static str> {
    match name {
        "kube-apiserver" => Some("INITIUM_PLANE_APISERVER_ARGS"),
        "kube-controller-manager" => Some("INITIUM_PLANE_CONTROLLER_MANAGER_ARGS"),
        "kube-scheduler" => Some("INITIUM_PLANE_SCHEDULER_ARGS"),
        "kwok" => Some("INITIUM_PLANE_KWOK_ARGS"),
        _ => None,
    }
}

/// Saves the flags `up` adds to NAME from its environment variable.
pub(crate) fn save_extra_args(dir: &Path, name: &str) -> Result<()> {
    let value = extra_args_var(name).and_then(var).unwrap_or_default();
    write_file(
        &dir.join(format!("{name}.extra-args")),
        &format!("{value}\n"),
    )
}

/// Starts NAME on the ports in DIR/*.port: etcd with its data in DIR/etcd-data (kept if it
/// exists: a restarted etcd has the same data), kube-apiserver storing in that etcd, or a
/// node component.
pub(crate) fn launch(settings: &Settings, dir: &Path, name: &str) -> Result<()> {
    let mut command;
    match name {
        "etcd" => {
            let port = read_port(dir, "etcd")?;
            let peer = read_port(dir, "etcd-peer")?;
            command = Command::new(settings.bin("etcd"));
            command
                .arg("--name=initium")
                .arg(format!("--data-dir={}", dir.join("etcd-data").display()))
                .arg(format!("--listen-client-urls=http://127.0.0.1:{port}"))
                .arg(format!("--advertise-client-urls=http://127.0.0.1:{port}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
                ))
                .arg(format!("--initial-cluster=initium=http://127.0.0.1:{peer}"))
                .arg("--unsafe-no-fsync")
                .arg(format!("--quota-backend-bytes={}", 512 * 1024 * 1024))
                .arg("--log-level=warn");
        }
        "kube-apiserver" => {
            let port = read_port(dir, "kube-apiserver")?;
            let etcd = read_port(dir, "etcd")?;
            let pki = dir.join("pki");
            let file = |name: &str| pki.join(name).display().to_string();
            command = Command::new(settings.bin("kube-apiserver"));
            command
                .arg(format!("--etcd-servers=http://127.0.0.1:{etcd}"))
                .arg("--bind-address=127.0.0.1")
                .arg("--advertise-address=127.0.0.1")
                .arg(format!("--secure-port={port}"))
                .arg(format!(
                    "--cert-dir={}",
                    dir.join("apiserver-certs").display()
                ))
                .arg(format!("--tls-cert-file={}", file("apiserver.crt")))
                .arg(format!("--tls-private-key-file={}", file("apiserver.key")))
                .arg(format!("--client-ca-file={}", file("ca.crt")))
                .arg("--service-account-issuer=https://kubernetes.default.svc")
                .arg(format!("--service-account-key-file={}", file("sa.pub")))
                .arg(format!(
                    "--service-account-signing-key-file={}",
                    file("sa.key")
                ))
                .arg("--service-cluster-ip-range=10.0.0.0/24")
                // The API server is reached at 127.0.0.1 (and, from a real node, through the
                // forwarder at the `kubernetes` Service's 10.0.0.1), and no Endpoints may
                // name a loopback address: the reconciler's every write of 127.0.0.1 failed
                // validation until 1.36, and from 1.37 the API server refuses to start with
                // it. No reconciler, then: the Service keeps no endpoints, as before.
                .arg("--endpoint-reconciler-type=none");
            // Without a controller manager nobody creates the `default` ServiceAccount that
            // the ServiceAccount admission plugin requires of every Pod, so a bare plane
            // disables the plugin. A plane with nodes has it, as real clusters do: Pods get
            // their service account and its token volume.
            if !has_nodes(dir) {
                command.arg("--disable-admission-plugins=ServiceAccount");
            }
            // With a real node: kubectl logs/exec and the kubelet's stats through the API
            // server (its client certificate, which the kubelet checks against the CA); the
            // Node authorizer for the kubelet's own requests, as in kubeadm's clusters; and
            // webhooks called at the Pod IP behind their Service (no kube-proxy runs).
            if is_real_node(dir) {
                command
                    .arg(format!(
                        "--kubelet-client-certificate={}",
                        file("apiserver-kubelet-client.crt")
                    ))
                    .arg(format!(
                        "--kubelet-client-key={}",
                        file("apiserver-kubelet-client.key")
                    ))
                    .arg("--kubelet-preferred-address-types=InternalIP")
                    .arg("--enable-aggregator-routing=true")
                    .arg("--authorization-mode=Node,RBAC");
            } else {
                command.arg("--authorization-mode=RBAC");
            }
            // MutatingAdmissionPolicy (the e2e benchmark's yardstick): GA and served as
            // admissionregistration.k8s.io/v1 from 1.36; before, beta behind its gate.
            if !settings.release.mutating_admission_policy_is_ga() {
                command
                    .arg("--feature-gates=MutatingAdmissionPolicy=true")
                    .arg("--runtime-config=admissionregistration.k8s.io/v1beta1=true");
            }
            command
                .arg("--allow-privileged=true")
                .arg("--profiling=false")
                .args(extra_args(dir, name));
        }
        _ => command = node_command(settings, dir, name)?,
    }
    process::spawn(dir, name, command)?;
    Ok(())
}

/// How NAME says it is healthy: a check to poll.
fn health(dir: &Path, name: &str) -> Result<Box<dyn Fn() -> bool>> {
    let port = read_port(dir, name)?;
    Ok(match name {
        "etcd" => Box::new(move || {
            Probe::Http
                .get(port, "/health")
                .is_ok_and(|body| body.contains(r#""health":"true""#))
        }),
        "kube-apiserver" => {
            let pki = dir.join("pki");
            let probe = Probe::with_client_cert(
                &pki.join("ca.crt"),
                &pki.join("admin.crt"),
                &pki.join("admin.key"),
            )?;
            Box::new(move || probe.get(port, "/readyz").is_ok_and(|b| b.trim() == "ok"))
        }
        // kwok serves /healthz over HTTP; the controller manager and the scheduler over
        // HTTPS with a certificate of their own.
        "kwok" => Box::new(move || {
            Probe::Http
                .get(port, "/healthz")
                .is_ok_and(|b| b.trim() == "ok")
        }),
        _ => {
            let probe = Probe::any_certificate()?;
            Box::new(move || probe.get(port, "/healthz").is_ok_and(|b| b.trim() == "ok"))
        }
    })
}

/// How a start ended.
#[derive(PartialEq, Eq)]
pub(crate) enum Started {
    Healthy,
    /// It died with "address already in use": try other ports.
    PortTaken,
    Failed,
}

/// Polls NAME's health until it answers, it dies, or the deadline passes.
pub(crate) fn wait_healthy(
    dir: &Path,
    name: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<Started> {
    let pid = read_pid(dir, name).with_context(|| format!("{name} has no pid file"))?;
    let healthy = health(dir, name)?;
    loop {
        if healthy() {
            return Ok(Started::Healthy);
        }
        if !alive(pid) {
            if process::port_was_taken(&dir.join(format!("{name}.log"))) {
                return Ok(Started::PortTaken);
            }
            log(format_args!("{name} exited during startup"));
            return Ok(Started::Failed);
        }
        if Instant::now() >= deadline {
            log(format_args!(
                "{name} was not healthy after {}s",
                timeout.as_secs()
            ));
            return Ok(Started::Failed);
        }
        sleep(Duration::from_millis(250));
    }
}

/// The Pod network kwok hands out Pod IPs from. Nothing routes to it (no container runs); it
/// is apart from the service range (10.0.0.0/24) so that EndpointSlices hold believable,
/// unique addresses.
const POD_CIDR: &str = "10.244.0.0/16";
/// kwok's Pod network: beside a real node, the upper half of that node's Pod network, which
/// the machine routes into the node's namespace (kube-apiserver calls webhooks at Pod IPs:
/// an address kwok made up must lead nowhere but there).
fn kwok_cidr(dir: &Path) -> String {
    match real_node_index(dir) {
        Some(index) => format!("10.90.{index}.128/25"),
        None => POD_CIDR.to_owned(),
    }
}

/// kwok manages the Nodes that carry this annotation (and only those).
pub(crate) const KWOK_NODE_ANNOTATION: (&str, &str) = ("kwok.x-k8s.io/node", "fake");

/// The command that starts node component NAME serving on the port in DIR/NAME.port, with
/// the extra flags saved in DIR/NAME.extra-args at `up`.
fn node_command(settings: &Settings, dir: &Path, name: &str) -> Result<Command> {
    let port = read_port(dir, name)?;
    let path = |file: String| dir.join(file).display().to_string();
    let kubeconfig = path(format!("{name}.kubeconfig"));
    let pki = |file: &str| dir.join("pki").join(file).display().to_string();
    let mut command = Command::new(settings.bin(name));
    command.arg(format!("--kubeconfig={kubeconfig}"));
    // The controller manager and the scheduler serve /healthz and /metrics over HTTPS on
    // 127.0.0.1 (a self-signed certificate in DIR/NAME-certs), checking tokens and
    // permissions with the API server. They do not look up client CAs in
    // kube-system/extension-apiserver-authentication: it has no request-header CA (the API
    // server has no front proxy), which they would log as an error every 20 seconds.
    let serving = [
        "--bind-address=127.0.0.1".to_owned(),
        format!("--secure-port={port}"),
        format!("--cert-dir={}", path(format!("{name}-certs"))),
        format!("--authentication-kubeconfig={kubeconfig}"),
        "--authentication-skip-lookup=true".to_owned(),
        format!("--authorization-kubeconfig={kubeconfig}"),
    ];
    match name {
        "kube-controller-manager" => {
            // All default controllers, each with its own service account
            // (--use-service-account-credentials), as kubeadm runs it: RBAC is then
            // exercised as in a real cluster. The tokens controller signs with the key
            // kube-apiserver verifies and issues with (sa.key), and puts the plane's CA into
            // every namespace (kube-root-ca.crt). The flex volume directory would otherwise
            // be created under /usr/libexec.
            command
                .args(serving)
                .arg("--leader-elect=false")
                .arg("--controllers=*")
                .arg("--use-service-account-credentials=true")
                .arg(format!(
                    "--service-account-private-key-file={}",
                    pki("sa.key")
                ))
                .arg(format!("--root-ca-file={}", pki("ca.crt")))
                .arg(format!("--cluster-signing-cert-file={}", pki("ca.crt")))
                .arg(format!("--cluster-signing-key-file={}", pki("ca.key")))
                .arg("--service-cluster-ip-range=10.0.0.0/24")
                .arg(format!(
                    "--flex-volume-plugin-dir={}",
                    path(format!("{name}-flexvolume"))
                ))
                .arg("--profiling=false");
        }
        "kube-scheduler" => {
            command
                .args(serving)
                .arg("--leader-elect=false")
                .arg("--profiling=false");
        }
        "kwok" => {
            // HOME is DIR/kwok-home: kwok would otherwise also load ~/.kwok/kwok.yaml,
            // whatever a developer keeps there. The node IP is loopback so that anything the
            // API server sends "to a kubelet" (kubectl logs, exec) stays on this machine and
            // is refused.
            let home = dir.join("kwok-home");
            std::fs::create_dir_all(&home)
                .with_context(|| format!("cannot create {}", home.display()))?;
            let (key, value) = KWOK_NODE_ANNOTATION;
            command
                .env("HOME", &home)
                .arg(format!(
                    "--config={}",
                    settings.wrappers.join("kwok/stages.yaml").display()
                ))
                .arg("--manage-all-nodes=false")
                .arg(format!(
                    "--manage-nodes-with-annotation-selector={key}={value}"
                ))
                .arg("--node-lease-duration-seconds=40")
                .arg("--node-ip=127.0.0.1")
                .arg(format!("--cidr={}", kwok_cidr(dir)))
                .arg(format!("--server-address=127.0.0.1:{port}"));
        }
        _ => bail!("unknown node component: {name}"),
    }
    command.args(extra_args(dir, name));
    Ok(command)
}

/// DIR/kubeconfig for the admin, or DIR/NAME.kubeconfig with the client certificate of node
/// component NAME.
pub(crate) fn write_kubeconfig(dir: &Path, port: u16, name: Option<&str>) -> Result<()> {
    let server = format!("https://127.0.0.1:{port}");
    match name {
        Some(name) => {
            write_kubeconfig_at(dir, &server, name, &dir.join(format!("{name}.kubeconfig")))
        }
        None => write_kubeconfig_at(dir, &server, "admin", &dir.join("kubeconfig")),
    }
}

/// FILE: a kubeconfig for SERVER with the client certificate DIR/pki/CERT.crt.
pub(crate) fn write_kubeconfig_at(dir: &Path, server: &str, cert: &str, file: &Path) -> Result<()> {
    let user = if cert == "admin" {
        "initium-admin"
    } else {
        cert
    };
    let b64 = |file: &str| -> Result<String> {
        let path = dir.join("pki").join(file);
        let bytes =
            std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: initium-plane
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: {user}
  user:
    client-certificate-data: {crt}
    client-key-data: {key}
contexts:
- name: initium-plane
  context:
    cluster: initium-plane
    user: {user}
current-context: initium-plane
",
        ca = b64("ca.crt")?,
        crt = b64(&format!("{cert}.crt"))?,
        key = b64(&format!("{cert}.key"))?,
    );
    write_file(file, &text)?;
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600))?;
    Ok(())
}
