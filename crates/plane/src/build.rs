//! `build`: the plane's binaries, built from the Go wrapper modules in
//! scripts/control-plane.d into the cache (nothing is downloaded but Go modules).

use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::log::log;
use crate::process::on_path;
use crate::settings::{
    CNI_PLUGINS_VERSION, CONTAINERD_VERSION, ETCD_VERSION, HELM_VERSION, K8S_VERSION, KWOK_VERSION,
    RUNC_VERSION, Settings,
};

fn executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// What a stamp file beside the binaries says (kwok's and helm's versions).
fn stamp(settings: &Settings, name: &str) -> String {
    std::fs::read_to_string(settings.bin(&format!(".{name}.version")))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// etcd, kube-apiserver and kubectl: what every plane needs.
pub(crate) fn have_binaries(settings: &Settings) -> bool {
    ["kube-apiserver", "kubectl", "etcd"]
        .iter()
        .all(|name| executable(&settings.bin(name)))
}

/// The binaries only a plane with nodes needs. The cache directory is named after the
/// Kubernetes and etcd versions; kwok's version is in a stamp file beside it.
pub(crate) fn have_node_binaries(settings: &Settings) -> bool {
    ["kube-controller-manager", "kube-scheduler", "kwok"]
        .iter()
        .all(|name| executable(&settings.bin(name)))
        && stamp(settings, "kwok") == KWOK_VERSION
}

/// What `stamp(settings, "real-node")` says when the real node's binaries are current.
fn real_node_stamp() -> String {
    format!("containerd {CONTAINERD_VERSION} runc {RUNC_VERSION} cni-plugins {CNI_PLUGINS_VERSION}")
}

/// The commands of the real node (`up --real-node`): the kubelet, containerd with its shim
/// and ctr, runc, the CNI plugins, and the pause image its sandboxes run.
const REAL_NODE_BINARIES: [&str; 10] = [
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "runc",
    "cni/bridge",
    "cni/host-local",
    "cni/loopback",
    "pause",
    "busybox",
];

pub(crate) fn have_real_node_binaries(settings: &Settings) -> bool {
    REAL_NODE_BINARIES
        .iter()
        .all(|name| executable(&settings.bin(name)))
        && settings.bin("pause.tar").is_file()
        && stamp(settings, "real-node") == real_node_stamp()
}

/// helm, for the chart's tests; like kwok, its version is in a stamp file.
fn have_helm(settings: &Settings) -> bool {
    executable(&settings.bin("helm")) && stamp(settings, "helm") == HELM_VERSION
}

/// The go.mod files require the versions pinned here.
fn check_pins(settings: &Settings) -> Result<()> {
    for (wrapper, module, version) in [
        ("kubernetes", "k8s.io/kubernetes", K8S_VERSION),
        ("etcd", "go.etcd.io/etcd/server/v3", ETCD_VERSION),
        ("kwok", "sigs.k8s.io/kwok", KWOK_VERSION),
        ("helm", "helm.sh/helm/v3", HELM_VERSION),
        (
            "node",
            "github.com/containerd/containerd/v2",
            CONTAINERD_VERSION,
        ),
        (
            "node",
            "github.com/containernetworking/plugins",
            CNI_PLUGINS_VERSION,
        ),
        ("runc", "github.com/opencontainers/runc", RUNC_VERSION),
    ] {
        let go_mod = settings.wrappers.join(wrapper).join("go.mod");
        let text = std::fs::read_to_string(&go_mod)
            .with_context(|| format!("cannot read {}", go_mod.display()))?;
        if !requires(&text, module, version) {
            bail!("{} does not require {module} {version}", go_mod.display());
        }
    }
    Ok(())
}

/// `text` has `module version` followed by the end of a word.
fn requires(text: &str, module: &str, version: &str) -> bool {
    let needle = format!("{module} {version}");
    text.match_indices(&needle).any(|(at, _)| {
        text[at + needle.len()..]
            .chars()
            .next()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
    })
}

/// `go ARGS` in the wrapper module, its stdout, or `None` when it fails.
fn go_output(settings: &Settings, wrapper: &str, args: &[&str]) -> Option<String> {
    let output = Command::new("go")
        .args(args)
        .current_dir(settings.wrappers.join(wrapper))
        .env("GOWORK", "off")
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The version variables that kubernetes' hack/lib/version.sh sets.
fn k8s_ldflags(settings: &Settings) -> String {
    let minor = K8S_VERSION
        .trim_start_matches("v1.")
        .split('.')
        .next()
        .unwrap_or_default();
    // The release date of the module keeps the build reproducible.
    let date = go_output(
        settings,
        "kubernetes",
        &[
            "list",
            "-mod=readonly",
            "-m",
            "-f",
            r#"{{if .Time}}{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}{{end}}"#,
            "k8s.io/kubernetes",
        ],
    )
    .unwrap_or_default();
    let mut flags = String::new();
    for pkg in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        flags += &format!(
            " -X {pkg}.gitVersion={K8S_VERSION} -X {pkg}.gitMajor=1 -X {pkg}.gitMinor={minor}"
        );
        flags += &format!(" -X {pkg}.gitCommit= -X {pkg}.gitTreeState=clean");
        if !date.is_empty() {
            flags += &format!(" -X {pkg}.buildDate={date}");
        }
    }
    flags
}

/// The variables helm's Makefile sets: its version (`helm version`), and the Kubernetes
/// version `helm template` and `helm lint` assume without a cluster (its client-go's, as in
/// helm's releases; unset, helm would assume v1.20).
fn helm_ldflags(settings: &Settings) -> String {
    let mut flags = format!(
        "-X helm.sh/helm/v3/internal/version.version={HELM_VERSION} -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
    );
    let client_go = go_output(
        settings,
        "helm",
        &[
            "list",
            "-mod=readonly",
            "-m",
            "-f",
            "{{.Version}}",
            "k8s.io/client-go",
        ],
    )
    .unwrap_or_default();
    let minor = client_go
        .strip_prefix("v0.")
        .and_then(|rest| rest.split_once('.'))
        .map(|(minor, _)| minor)
        .filter(|minor| !minor.is_empty() && minor.bytes().all(|b| b.is_ascii_digit()));
    if let Some(minor) = minor {
        for pkg in [
            "helm.sh/helm/v3/pkg/lint/rules",
            "helm.sh/helm/v3/pkg/chartutil",
        ] {
            flags += &format!(" -X {pkg}.k8sVersionMajor=1 -X {pkg}.k8sVersionMinor={minor}");
        }
    }
    flags
}

fn stderr() -> Result<Stdio> {
    use std::os::fd::AsFd;
    Ok(Stdio::from(std::io::stderr().as_fd().try_clone_to_owned()?))
}

/// Builds PACKAGE inside the wrapper module to a temporary name, then moves it into place:
/// an interrupted build never leaves a broken binary behind.
fn go_build(
    settings: &Settings,
    wrapper: &str,
    name: &str,
    package: &str,
    ldflags: &str,
) -> Result<()> {
    go_build_with(settings, wrapper, name, package, ldflags, "", false)
}

/// `go_build` with build tags, and with cgo where the package needs it (runc).
fn go_build_with(
    settings: &Settings,
    wrapper: &str,
    name: &str,
    package: &str,
    ldflags: &str,
    tags: &str,
    cgo: bool,
) -> Result<()> {
    let out = settings.bin(name);
    let tmp = out.with_file_name(format!(
        ".{}.tmp.{}",
        out.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let start = Instant::now();
    log(format_args!("building {name} ({package}) ..."));
    let status = Command::new("go")
        .args([
            "build",
            "-mod=readonly",
            "-trimpath",
            "-buildvcs=false",
            "-tags",
            tags,
            "-ldflags",
        ])
        .arg(format!("-s -w {ldflags}"))
        .arg("-o")
        .arg(&tmp)
        .arg(package)
        .current_dir(settings.wrappers.join(wrapper))
        .env("GOWORK", "off")
        .env("CGO_ENABLED", if cgo { "1" } else { "0" })
        // Go's output to stderr: stdout is for what the commands print (`bin-dir`, `env`).
        .stdout(stderr()?)
        .status();
    if !status.is_ok_and(|s| s.success()) {
        let _ = std::fs::remove_file(&tmp);
        bail!("building {package} failed");
    }
    std::fs::rename(&tmp, &out)
        .with_context(|| format!("cannot move {} into place", out.display()))?;
    log(format_args!(
        "built {} in {}s",
        out.display(),
        start.elapsed().as_secs()
    ));
    Ok(())
}

/// The command `build [--nodes] [--helm] [--real-node]`: builds what is missing; with
/// `nodes` also the binaries of a plane with nodes, with `helm` also helm, with `real_node`
/// also those of the real node (and the node binaries, which it needs too).
pub(crate) fn build(settings: &Settings, nodes: bool, helm: bool, real_node: bool) -> Result<()> {
    let nodes = nodes || real_node;
    let bin_dir = &settings.bin_dir;
    let complete = |settings: &Settings| {
        have_binaries(settings)
            && (!nodes || have_node_binaries(settings))
            && (!helm || have_helm(settings))
            && (!real_node || have_real_node_binaries(settings))
    };
    if complete(settings) {
        log(format_args!(
            "using cached binaries in {}",
            bin_dir.display()
        ));
        return Ok(());
    }
    if !on_path("go") {
        bail!("go is not installed (needed once to build the control plane)");
    }
    check_pins(settings)?;
    std::fs::create_dir_all(bin_dir)
        .with_context(|| format!("cannot create {}", bin_dir.display()))?;
    // Serialise concurrent builds (e.g. test binaries running in parallel); the lock goes
    // with the file when this process ends, however it ends.
    let lock_path = bin_dir.join(".build.lock");
    let lock =
        File::create(&lock_path).with_context(|| format!("cannot open {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("cannot lock {}", lock_path.display()))?;
    // Leftovers of an interrupted build.
    if let Ok(entries) = std::fs::read_dir(bin_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') && name.contains(".tmp.") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let start = Instant::now();
    if !have_binaries(settings) {
        log(format_args!(
            "building kubernetes {K8S_VERSION} and etcd {ETCD_VERSION} into {}",
            bin_dir.display()
        ));
        log("(the first build compiles a lot of Go: about 5-7 minutes on 2 cores)");
    }
    if !executable(&settings.bin("etcd")) {
        go_build(settings, "etcd", "etcd", "go.etcd.io/etcd/server/v3", "")?;
    }
    let ldflags = k8s_ldflags(settings);
    build_kubernetes(settings, &["kubectl", "kube-apiserver"], &ldflags)?;
    if nodes && !have_node_binaries(settings) {
        log(format_args!(
            "building kube-controller-manager, kube-scheduler {K8S_VERSION} and kwok {KWOK_VERSION} into {}",
            bin_dir.display()
        ));
        log("(once: a few minutes on 2 cores after kube-apiserver; about 9 on a busy machine)");
        build_kubernetes(
            settings,
            &["kube-controller-manager", "kube-scheduler"],
            &ldflags,
        )?;
        if !executable(&settings.bin("kwok")) || stamp(settings, "kwok") != KWOK_VERSION {
            let _ = std::fs::remove_file(settings.bin(".kwok.version"));
            go_build(settings, "kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok", "")?;
            std::fs::write(settings.bin(".kwok.version"), format!("{KWOK_VERSION}\n"))?;
        }
    }
    if helm && !have_helm(settings) {
        log(format_args!(
            "building helm {HELM_VERSION} into {} (once: 2-3 minutes on 2 cores)",
            bin_dir.display()
        ));
        let _ = std::fs::remove_file(settings.bin(".helm.version"));
        go_build(
            settings,
            "helm",
            "helm",
            "helm.sh/helm/v3/cmd/helm",
            &helm_ldflags(settings),
        )?;
        std::fs::write(settings.bin(".helm.version"), format!("{HELM_VERSION}\n"))?;
    }
    if real_node && !have_real_node_binaries(settings) {
        build_real_node(settings, &ldflags)?;
    }
    drop(lock);
    log(format_args!(
        "done in {}s: {}",
        start.elapsed().as_secs(),
        bin_dir.display()
    ));
    Ok(())
}

/// The real node's binaries, and the pause image from Kubernetes' own pause.c (in the
/// k8s.io/kubernetes module the kubelet is built from), linked statically.
fn build_real_node(settings: &Settings, k8s_ldflags: &str) -> Result<()> {
    log(format_args!(
        "building the real node: kubelet {K8S_VERSION}, containerd {CONTAINERD_VERSION}, runc {RUNC_VERSION}, CNI plugins {CNI_PLUGINS_VERSION} (once: about 4 minutes on 2 cores)"
    ));
    if !on_path("gcc") {
        bail!(
            "gcc is not installed (needed once to build runc and the pause image): apt-get install gcc libc6-dev"
        );
    }
    let _ = std::fs::remove_file(settings.bin(".real-node.version"));
    build_kubernetes(settings, &["kubelet"], k8s_ldflags)?;
    // kind's tags: no storage drivers this node does not use.
    let tags = "no_aufs no_zfs no_btrfs no_devmapper";
    for name in ["containerd", "containerd-shim-runc-v2", "ctr"] {
        go_build_with(
            settings,
            "node",
            name,
            &format!("github.com/containerd/containerd/v2/cmd/{name}"),
            "",
            tags,
            false,
        )?;
    }
    for (name, path) in [
        ("bridge", "main/bridge"),
        ("host-local", "ipam/host-local"),
        ("loopback", "main/loopback"),
    ] {
        go_build_with(
            settings,
            "node",
            &format!("cni/{name}"),
            &format!("github.com/containernetworking/plugins/plugins/{path}"),
            "",
            "",
            false,
        )?;
    }
    // runc's nsenter is C: cgo; and seccomp (containerd gives every sandbox the runtime's
    // default profile) links libseccomp.
    apt_install("/usr/include/seccomp.h", "libseccomp-dev")?;
    go_build_with(
        settings,
        "runc",
        "runc",
        "github.com/opencontainers/runc",
        &format!("-X main.version={}", RUNC_VERSION.trim_start_matches('v')),
        "seccomp",
        true,
    )?;
    build_pause(settings)?;
    fetch_busybox(settings)?;
    std::fs::write(
        settings.bin(".real-node.version"),
        format!("{}\n", real_node_stamp()),
    )?;
    Ok(())
}

/// bin/pause from k8s.io/kubernetes' build/pause/linux/pause.c, and bin/pause.tar, its OCI
/// image.
fn build_pause(settings: &Settings) -> Result<()> {
    let module = go_output(
        settings,
        "kubernetes",
        &[
            "mod",
            "download",
            "-json",
            &format!("k8s.io/kubernetes@{K8S_VERSION}"),
        ],
    )
    .context("cannot find the k8s.io/kubernetes module (go mod download)")?;
    let module_dir = module
        .lines()
        .find_map(|line| {
            let line = line.trim();
            line.strip_prefix("\"Dir\": \"")
                .and_then(|rest| rest.strip_suffix("\","))
        })
        .context("go mod download did not say where k8s.io/kubernetes is")?;
    let source = Path::new(module_dir).join("build/pause/linux/pause.c");
    let out = settings.bin("pause");
    let status = Command::new("gcc")
        .args(["-Os", "-Wall", "-static"])
        .arg(format!("-DVERSION={K8S_VERSION}-initium"))
        .arg("-o")
        .arg(&out)
        .arg(&source)
        .stdout(stderr()?)
        .status()
        .context("cannot run gcc")?;
    if !status.success() {
        bail!(
            "building the pause image from {} failed (a static link needs libc6-dev)",
            source.display()
        );
    }
    crate::oci::Image {
        name: crate::realnode::PAUSE_IMAGE,
        files: vec![crate::oci::File::from_disk("pause", &out, 0o755)?],
        user: "65535:65535",
        entrypoint: vec!["/pause".to_owned()],
        cmd: Vec::new(),
        env: Vec::new(),
    }
    .write(&settings.bin("pause.tar"))
}

/// Installs Debian's PACKAGE unless FILE (which it provides) is there; an `apt-get update`
/// first when the package lists do not know it.
fn apt_install(file: &str, package: &str) -> Result<()> {
    if Path::new(file).exists() {
        return Ok(());
    }
    log(format_args!("installing Debian's {package} (for {file})"));
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends", package])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !install() {
        let _ = Command::new("apt-get")
            .args(["update", "-qq"])
            .stdout(stderr()?)
            .status();
        if !install() {
            bail!(
                "cannot install {package} (apt-get install {package}); the real node's runc needs it"
            );
        }
    }
    Ok(())
}

/// bin/busybox from Debian's busybox-static (the test toolbox's shell and tools): the
/// package is downloaded and unpacked into the cache, not installed.
fn fetch_busybox(settings: &Settings) -> Result<()> {
    let work = settings.bin(&format!(".busybox.tmp.{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let download = |work: &Path| {
        Command::new("apt-get")
            .args(["download", "busybox-static"])
            .current_dir(work)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !download(&work) {
        // A machine whose package lists were never fetched knows no package.
        log("apt-get download busybox-static failed; running apt-get update first");
        let _ = Command::new("apt-get")
            .args(["update", "-qq"])
            .stdout(stderr()?)
            .status();
        if !download(&work) {
            let _ = std::fs::remove_dir_all(&work);
            bail!(
                "cannot download Debian's busybox-static (apt-get download busybox-static), which the test toolbox image needs"
            );
        }
    }
    let deb = std::fs::read_dir(&work)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("apt-get download left no .deb")?;
    let status = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(work.join("root"))
        .status()
        .context("cannot run dpkg-deb")?;
    if !status.success() {
        bail!("dpkg-deb -x {} failed", deb.display());
    }
    std::fs::rename(work.join("root/bin/busybox"), settings.bin("busybox"))
        .context("busybox-static has no bin/busybox")?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(())
}

/// Builds each of the Kubernetes commands `names` that is not in the cache yet.
fn build_kubernetes(settings: &Settings, names: &[&str], ldflags: &str) -> Result<()> {
    for name in names {
        if !executable(&settings.bin(name)) {
            go_build(
                settings,
                "kubernetes",
                name,
                &format!("k8s.io/kubernetes/cmd/{name}"),
                ldflags,
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::requires;

    #[test]
    fn a_pin_is_a_whole_version() {
        let go_mod =
            "require (\n\tk8s.io/kubernetes v1.34.4\n\tk8s.io/api v0.34.4 // indirect\n)\n";
        assert!(requires(go_mod, "k8s.io/kubernetes", "v1.34.4"));
        // As `grep "... v1.34\b"` had it: the end of a word, not of the version.
        assert!(requires(go_mod, "k8s.io/kubernetes", "v1.34"));
        assert!(!requires(go_mod, "k8s.io/kubernetes", "v1.3"));
        assert!(!requires(go_mod, "k8s.io/kubernetes", "v1.34.5"));
        assert!(requires(
            "sigs.k8s.io/kwok v0.8.0",
            "sigs.k8s.io/kwok",
            "v0.8.0"
        ));
    }
}
