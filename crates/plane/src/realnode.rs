//! `up --real-node`: one node whose kubelet runs real containers (containerd, runc, the CNI
//! bridge plugin), beside the plane and apart from the machine.
//!
//! What it is made of, and how `down` takes each part away again:
//! - a network namespace `initium-node-I` with a veth pair to the machine: the node's end
//!   has 10.89.I.2, the machine's end 10.89.I.1 and one route, to the node's Pod network
//!   10.90.I.0/24 (kube-apiserver calls webhooks at Pod IPs, `--enable-aggregator-routing`).
//!   The namespace has no other route: nothing a Pod sends leaves it but to the API server.
//!   `ip netns del` takes the namespace, its bridge, the veth pair and the route.
//! - `_forward` (forward.rs): 10.0.0.1:443, the `kubernetes` Service, inside the namespace,
//!   to kube-apiserver on 127.0.0.1.
//! - `_node`: containerd and the kubelet in their own PID and mount namespaces (util-linux
//!   `unshare`): /run is a tmpfs, /var/lib and /var/log are DIR/node's, and the kernel
//!   settings the kubelet checks are files of DIR/node bound over /proc/sys (the kubelet
//!   runs with `protectKernelDefaults`, so it never writes the machine's). When `_node`, PID
//!   1 of its namespace, is killed, the kernel kills every process in it (shims, containers);
//!   its mounts go with the mount namespace.
//! - cgroups: everything the kubelet creates is below `/initium-node-I` in each v1 hierarchy
//!   (`cgroupRoot`); `down` removes that tree once its processes are gone.

use std::fmt::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::launch::write_file;
use crate::log::log;
use crate::process;
use crate::settings::{
    FORWARD, FORWARD_ARG, NODE_ARG, REAL_NODE as NODE, REAL_NODE_FILE as FILE, Settings,
};

/// The ClusterIP of the `kubernetes` Service (the first of --service-cluster-ip-range).
pub(crate) const SERVICE_IP: &str = "10.0.0.1";
/// The Node's name.
pub(crate) const NODE_NAME: &str = "initium-node";
/// The pause image the sandboxes run, imported at start; a name no registry answers for.
pub(crate) const PAUSE_IMAGE: &str = "localhost/initium/pause:dev";
/// Real nodes that can run at once on this machine (one per plane).
const MAX_NODES: u8 = 32;

/// The values the kubelet requires of these kernel settings. It checks them
/// (`protectKernelDefaults`) and would write them otherwise; the node sees these files.
const KERNEL_DEFAULTS: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

pub(crate) struct Node {
    pub(crate) index: u8,
    pub(crate) netns: String,
}

impl Node {
    fn new(index: u8) -> Node {
        Node {
            index,
            netns: format!("initium-node-{index}"),
        }
    }

    pub(crate) fn read(dir: &Path) -> Result<Node> {
        let index = crate::launch::real_node_index(dir)
            .filter(|&i| i < MAX_NODES)
            .with_context(|| format!("{} does not hold a node index", dir.join(FILE).display()))?;
        Ok(Node::new(index))
    }

    pub(crate) fn netns_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.netns)
    }
    fn host_link(&self) -> String {
        format!("initium-h{}", self.index)
    }
    fn node_link(&self) -> String {
        format!("initium-n{}", self.index)
    }
    fn host_ip(&self) -> String {
        format!("10.89.{}.1", self.index)
    }
    pub(crate) fn node_ip(&self) -> String {
        format!("10.89.{}.2", self.index)
    }
    /// The node's Pod network, routed from the machine into the namespace: the real Pods'
    /// addresses (.2 to .126) and, beside `--nodes N`, kwok's simulated Pods' (.128/25, which
    /// answer nobody but stay inside the namespace).
    pub(crate) fn pod_cidr(&self) -> String {
        format!("10.90.{}.0/24", self.index)
    }
    fn pod_gateway(&self) -> String {
        format!("10.90.{}.1", self.index)
    }
    fn cgroup(&self) -> String {
        format!("initium-node-{}", self.index)
    }
}

/// Runs a command of the machine's (ip, mount), failing with what it printed.
fn run(program: &str, args: &[&str]) -> Result<()> {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !output.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// What the real node needs of the machine, checked before anything is created.
fn check_machine() -> Result<()> {
    for program in ["ip", "unshare", "nsenter", "mount"] {
        if !process::on_path(program) {
            bail!(
                "{program} is not installed; the real node needs iproute2 and util-linux (apt-get install iproute2 util-linux)"
            );
        }
    }
    if !rustix::process::geteuid().is_root() {
        bail!(
            "a real node needs root (network and mount namespaces, cgroups); run as root or leave out --real-node"
        );
    }
    if cgroup_hierarchies().is_empty() {
        bail!(
            "no cgroup v1 hierarchies under /sys/fs/cgroup; the real node's kubelet (v1.34, cgroupfs driver) is set up for cgroup v1 here"
        );
    }
    Ok(())
}

/// The mounted cgroup hierarchies: /sys/fs/cgroup/{cpu,memory,...,systemd,unified}.
fn cgroup_hierarchies() -> Vec<PathBuf> {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return Vec::new();
    };
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, at, kind) = (fields.next()?, fields.next()?, fields.next()?);
            (matches!(kind, "cgroup" | "cgroup2") && at.starts_with("/sys/fs/cgroup/"))
                .then(|| PathBuf::from(at))
        })
        .collect()
}

/// Creates the node's cgroup in every hierarchy (the kubelet requires that its cgroupRoot
/// exists); a v1 cpuset gets its parent's CPUs and memory nodes, without which no process
/// could join it.
fn create_cgroups(node: &Node) -> Result<()> {
    for hierarchy in cgroup_hierarchies() {
        let path = hierarchy.join(node.cgroup());
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create the cgroup {}", path.display()))?;
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(value) = std::fs::read_to_string(hierarchy.join(file)) {
                std::fs::write(path.join(file), value.trim())
                    .with_context(|| format!("cannot write {}", path.join(file).display()))?;
            }
        }
    }
    Ok(())
}

/// Removes the node's cgroup trees, deepest first; a cgroup whose last process is still
/// exiting is tried again for up to 10 s. Returns the ones left.
fn remove_cgroups(node: &Node) -> Vec<PathBuf> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut left = Vec::new();
        for hierarchy in cgroup_hierarchies() {
            let root = hierarchy.join(node.cgroup());
            if root.exists() {
                remove_tree(&root, &mut left);
            }
        }
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        sleep(Duration::from_millis(200));
    }
}

fn remove_tree(dir: &Path, left: &mut Vec<PathBuf>) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&entry.path(), left);
            }
        }
    }
    if std::fs::remove_dir(dir).is_err() && dir.exists() {
        left.push(dir.to_owned());
    }
}

fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Takes the first free index: `ip netns add` fails for a name that exists, so two planes
/// starting at once never share one.
fn claim(dir: &Path) -> Result<Node> {
    for index in 0..MAX_NODES {
        let node = Node::new(index);
        if node.netns_path().exists() {
            continue;
        }
        if run("ip", &["netns", "add", &node.netns]).is_ok() {
            write_file(&dir.join(FILE), &format!("{index}\n"))?;
            return Ok(node);
        }
    }
    bail!("{MAX_NODES} real nodes run on this machine already (network namespaces initium-node-*)")
}

/// The veth pair, addresses and routes.
fn wire(node: &Node) -> Result<()> {
    let (ns, host, inner) = (&node.netns, node.host_link(), node.node_link());
    run(
        "ip",
        &[
            "link", "add", &host, "type", "veth", "peer", "name", &inner, "netns", ns,
        ],
    )?;
    run(
        "ip",
        &[
            "addr",
            "add",
            &format!("{}/30", node.host_ip()),
            "dev",
            &host,
        ],
    )?;
    run("ip", &["link", "set", &host, "up"])?;
    run(
        "ip",
        &[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{}/30", node.node_ip()),
            "dev",
            &inner,
        ],
    )?;
    run("ip", &["-n", ns, "link", "set", &inner, "up"])?;
    run("ip", &["-n", ns, "link", "set", "lo", "up"])?;
    run(
        "ip",
        &[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{SERVICE_IP}/32"),
            "dev",
            "lo",
        ],
    )?;
    run(
        "ip",
        &[
            "route",
            "add",
            &node.pod_cidr(),
            "via",
            &node.node_ip(),
            "dev",
            &host,
        ],
    )?;
    Ok(())
}

/// The node's directory: DIR/node.
fn node_dir(dir: &Path) -> PathBuf {
    dir.join("node")
}

/// containerd's socket, reachable from the machine (scripts/image imports through it).
pub(crate) fn containerd_socket(dir: &Path) -> PathBuf {
    node_dir(dir).join("containerd.sock")
}

/// The files the node's processes read: containerd's configuration, the CNI network, the
/// kubelet's configuration and kubeconfig, the kernel settings it checks.
fn write_configuration(settings: &Settings, dir: &Path, node: &Node) -> Result<()> {
    let nd = node_dir(dir);
    for sub in ["lib", "log", "net.d", "sysctl"] {
        std::fs::create_dir_all(nd.join(sub))
            .with_context(|| format!("cannot create {}", nd.join(sub).display()))?;
    }
    let socket = containerd_socket(dir);
    // A unix socket's path has at most 107 bytes.
    if socket.as_os_str().len() > 100 {
        bail!(
            "the plane directory {} is too long for containerd's socket ({}); choose a shorter --dir",
            dir.display(),
            socket.display()
        );
    }
    let bin = &settings.tools_dir;
    write_file(
        &nd.join("containerd.toml"),
        &format!(
            r#"version = 3
root = "/var/lib/containerd"
state = "/run/containerd"

[debug]
  level = "{level}"

[grpc]
  address = "{socket}"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  # This machine withholds CAP_SYS_RESOURCE: no score below containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni}"]
    conf_dir = "{netd}"
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
"#,
            socket = socket.display(),
            level = crate::settings::var("INITIUM_PLANE_CONTAINERD_LOG_LEVEL")
                .unwrap_or_else(|| "info".to_owned()),
            cni = bin.join("cni").display(),
            netd = nd.join("net.d").display(),
            runc = bin.join("runc").display(),
        ),
    )?;
    write_file(
        &nd.join("net.d/10-initium.conflist"),
        &format!(
            r#"{{
  "cniVersion": "1.0.0",
  "name": "initium",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{"subnet": "{cidr}", "gateway": "{gateway}", "rangeStart": "10.90.{index}.2", "rangeEnd": "10.90.{index}.126"}}]],
        "routes": [{{"dst": "0.0.0.0/0"}}]
      }}
    }}
  ]
}}
"#,
            cidr = node.pod_cidr(),
            gateway = node.pod_gateway(),
            index = node.index,
        ),
    )?;
    // Pods resolve names against their own loopback: no DNS server runs, and nothing asks
    // the machine's.
    write_file(&nd.join("resolv.conf"), "nameserver 127.0.0.1\n")?;
    for (key, value) in KERNEL_DEFAULTS {
        write_file(&nd.join("sysctl").join(key.replace('/', ".")), value)?;
    }
    let pki = dir.join("pki");
    write_file(
        &nd.join("kubelet.yaml"),
        &format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: "{ca}"}}
authorization: {{mode: AlwaysAllow}}
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
failCgroupV1: false
failSwapOn: false
protectKernelDefaults: true
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://{socket}
address: {node_ip}
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
resolvConf: "{resolv}"
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
"#,
            ca = pki.join("ca.crt").display(),
            cgroup = node.cgroup(),
            socket = socket.display(),
            node_ip = node.node_ip(),
            resolv = nd.join("resolv.conf").display(),
        ),
    )?;
    Ok(())
}

/// Before kube-apiserver starts (its flags, and kwok's Pod addresses, depend on the node):
/// the node's index, network namespace, links and cgroups.
pub(crate) fn prepare(dir: &Path) -> Result<()> {
    check_machine()?;
    let node = claim(dir)?;
    log(format_args!(
        "preparing a real node ({NODE_NAME}: network namespace {}, Pods in {})",
        node.netns,
        node.pod_cidr()
    ));
    wire(&node)?;
    create_cgroups(&node)
}

/// Starts the prepared node in DIR: the forwarder, containerd and the kubelet; returns once
/// the Node is Ready.
pub(crate) fn start(settings: &Settings, dir: &Path, timeout: Duration) -> Result<()> {
    let node = Node::read(dir)?;
    log(format_args!(
        "starting the real node: containerd and kubelet {}",
        crate::settings::kubelet_release().version
    ));
    write_configuration(settings, dir, &node)?;
    let exe = std::env::current_exe().context("cannot find this program")?;
    let mut forward = Command::new(&exe);
    forward.arg(FORWARD_ARG).arg("--dir").arg(dir);
    process::spawn(dir, FORWARD, forward)?;
    let mut supervisor = Command::new("nsenter");
    supervisor
        .arg(format!("--net={}", node.netns_path().display()))
        .arg("--")
        .arg("unshare")
        .args([
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--propagation",
            "private",
            "--mount-proc",
            "--",
        ])
        .arg(&exe)
        .arg(NODE_ARG)
        .arg("--dir")
        .arg(dir)
        .env("PATH", path_with(&settings.tools_dir));
    process::spawn(dir, NODE, supervisor)?;
    let deadline = Instant::now() + timeout.max(Duration::from_secs(120));
    loop {
        if node_ready(settings, dir) {
            return Ok(());
        }
        if process::running(dir, NODE).is_none() {
            bail!("the real node's processes exited during startup");
        }
        if Instant::now() >= deadline {
            bail!(
                "the real node {NODE_NAME} was not Ready after {}s",
                timeout.max(Duration::from_secs(120)).as_secs()
            );
        }
        sleep(Duration::from_millis(500));
    }
}

/// $PATH with the plane's binaries first (containerd finds its shim there).
fn path_with(bin: &Path) -> String {
    match std::env::var("PATH") {
        Ok(path) if !path.is_empty() => format!("{}:{path}", bin.display()),
        _ => format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display()),
    }
}

fn node_ready(settings: &Settings, dir: &Path) -> bool {
    Command::new(settings.bin("kubectl"))
        .arg(format!("--kubeconfig={}", dir.join("kubeconfig").display()))
        .args([
            "get",
            "node",
            NODE_NAME,
            "--request-timeout=5s",
            "-o",
            r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
        ])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "True")
}

/// Stops the node of the plane in DIR and removes what `start` made: processes (the kernel
/// ends every process of the node's PID namespace with it), the network namespace with its
/// links and route, the cgroups. What it could not remove is said.
pub(crate) fn stop(dir: &Path) -> Result<()> {
    let Ok(node) = Node::read(dir) else {
        return Ok(());
    };
    process::kill_now(dir, NODE);
    process::stop(dir, FORWARD);
    // The PID namespace's processes die with its first process; wait until none is left in
    // the node's cgroups before removing them.
    let left = remove_cgroups(&node);
    let mut problems = String::new();
    if node.netns_path().exists()
        && let Err(error) = run("ip", &["netns", "del", &node.netns])
    {
        let _ = write!(problems, " {error:#};");
    }
    // The kernel frees the namespace, and with it the veth pair and the route, once its last
    // process is gone and its cleanup work has run: wait for the machine's end of the link.
    let link = node.host_link();
    let deadline = Instant::now() + Duration::from_secs(15);
    while link_exists(&link) {
        if Instant::now() >= deadline {
            let _ = write!(problems, " the link {link} is still there;");
            break;
        }
        sleep(Duration::from_millis(100));
    }
    for path in left {
        let _ = write!(problems, " cgroup {} is still in use;", path.display());
    }
    let _ = std::fs::remove_file(dir.join(FILE));
    if !problems.is_empty() {
        bail!("the real node was not removed completely:{problems}");
    }
    Ok(())
}

/// `_node`: PID 1 of the node's PID namespace, in its mount namespace and its network
/// namespace. Prepares the mounts, starts containerd, imports the pause image, starts the
/// kubelet, and reaps every process that ends in the namespace until one of the two exits.
pub(crate) fn supervise(settings: &Settings, dir: &Path) -> Result<()> {
    let node = Node::read(dir)?;
    let nd = node_dir(dir);
    let mount = |args: &[&str]| run("mount", args);
    mount(&["-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run"])?;
    // The kubelet's cAdvisor names containers (the `container` label of /metrics/cadvisor)
    // by asking containerd at its usual address.
    std::fs::create_dir_all("/run/containerd").context("cannot create /run/containerd")?;
    std::os::unix::fs::symlink(containerd_socket(dir), "/run/containerd/containerd.sock")
        .context("cannot link /run/containerd/containerd.sock")?;
    let lib = nd.join("lib").display().to_string();
    let logs = nd.join("log").display().to_string();
    mount(&["--bind", &lib, "/var/lib"])?;
    mount(&["--bind", &logs, "/var/log"])?;
    for (key, _) in KERNEL_DEFAULTS {
        let file = nd.join("sysctl").join(key.replace('/', "."));
        let target = format!("/proc/sys/{key}");
        mount(&["--bind", &file.display().to_string(), &target])?;
    }
    // This namespace's own setting (a Pod's packets to the API server's address are routed
    // by it); the machine's is untouched.
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        .context("cannot enable forwarding in the node's network namespace")?;

    let log_to = |name: &str| -> Result<(Stdio, Stdio)> {
        let path = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok((Stdio::from(file.try_clone()?), Stdio::from(file)))
    };
    let (out, err) = log_to("containerd")?;
    let containerd = Command::new(settings.bin("containerd"))
        .arg("--config")
        .arg(nd.join("containerd.toml"))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("cannot start containerd")?
        .id();
    let socket = containerd_socket(dir);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !socket.exists() {
        if Instant::now() >= deadline {
            bail!("containerd did not open {} within 60s", socket.display());
        }
        sleep(Duration::from_millis(200));
    }
    import_image(settings, dir, &settings.bin("pause.tar"))?;
    let (out, err) = log_to("kubelet")?;
    let kubelet = Command::new(settings.bin("kubelet"))
        .arg(format!("--config={}", nd.join("kubelet.yaml").display()))
        .arg(format!(
            "--kubeconfig={}",
            dir.join("kubelet.kubeconfig").display()
        ))
        .arg(format!("--hostname-override={NODE_NAME}"))
        .arg(format!("--node-ip={}", node.node_ip()))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        // The kubelet and containerd are not in the plane's process group: a signal to it
        // reaches this process only.
        .process_group(0)
        .spawn()
        .context("cannot start the kubelet")?
        .id();
    log(format_args!(
        "containerd (pid {containerd}) and the kubelet (pid {kubelet}) started"
    ));
    loop {
        match rustix::process::wait(rustix::process::WaitOptions::empty()) {
            Ok(Some((pid, status))) => {
                let pid = pid.as_raw_nonzero().get().unsigned_abs();
                if pid == containerd || pid == kubelet {
                    let name = if pid == kubelet {
                        "the kubelet"
                    } else {
                        "containerd"
                    };
                    bail!("{name} exited ({status:?}); the node stops");
                }
            }
            Ok(None) => {}
            Err(error) => bail!("waiting for the node's processes failed: {error}"),
        }
    }
}

/// `ctr images import` of an OCI archive into the node's containerd (namespace k8s.io, the
/// kubelet's), unpacked for its snapshotter.
pub(crate) fn import_image(settings: &Settings, dir: &Path, archive: &Path) -> Result<()> {
    let socket = containerd_socket(dir);
    let output = Command::new(settings.bin("ctr"))
        .arg(format!("--address={}", socket.display()))
        .args([
            "--namespace=k8s.io",
            "images",
            "import",
            "--platform=linux/amd64",
        ])
        .arg(archive)
        .stdin(Stdio::null())
        .output()
        .context("cannot run ctr")?;
    if !output.status.success() {
        bail!(
            "importing {} into the real node failed: {}",
            archive.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// The kubelet's kubeconfig: the API server at the `kubernetes` Service's address.
pub(crate) fn write_kubelet_kubeconfig(dir: &Path) -> Result<()> {
    crate::launch::write_kubeconfig_at(
        dir,
        &format!("https://{SERVICE_IP}:443"),
        "kubelet",
        &dir.join("kubelet.kubeconfig"),
    )
}
