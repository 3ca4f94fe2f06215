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
    CNI_PLUGINS_VERSION, CONTAINERD_VERSION, ETCD_VERSION, HELM_VERSION, KWOK_VERSION,
    RUNC_VERSION, Release, Settings, TOOLS, kubelet_release,
};

fn executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// What a stamp file in the tools directory says (the version of a tool there). A release's
/// directory is named after the release, so its commands need none.
fn stamp(settings: &Settings, name: &str) -> String {
    std::fs::read_to_string(settings.tools_dir.join(format!(".{name}.version")))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// What a tool's stamp says when it is current: its version and a digest (FNV-1a) of the
/// go.mod and go.sum of the wrapper modules it is built from, so that a raised dependency
/// rebuilds it too.
fn tool_stamp(settings: &Settings, version: &str, wrappers: &[&str]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for wrapper in wrappers {
        for file in ["go.mod", "go.sum"] {
            let bytes =
                std::fs::read(settings.wrappers.join(wrapper).join(file)).unwrap_or_default();
            for byte in bytes {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    format!("{version} {hash:016x}")
}

fn etcd_stamp(settings: &Settings) -> String {
    tool_stamp(settings, ETCD_VERSION, &["etcd"])
}

fn kwok_stamp(settings: &Settings) -> String {
    tool_stamp(settings, KWOK_VERSION, &["kwok"])
}

fn helm_stamp(settings: &Settings) -> String {
    tool_stamp(settings, HELM_VERSION, &["helm"])
}

fn write_stamp(settings: &Settings, name: &str, value: &str) -> Result<()> {
    let path = settings.tools_dir.join(format!(".{name}.version"));
    std::fs::write(&path, format!("{value}\n"))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// etcd, kube-apiserver and kubectl: what every plane needs.
pub(crate) fn have_binaries(settings: &Settings) -> bool {
    ["kube-apiserver", "kubectl", "etcd"]
        .iter()
        .all(|name| executable(&settings.bin(name)))
        && stamp(settings, "etcd") == etcd_stamp(settings)
}

/// The binaries only a plane with nodes needs; kwok's version is in a stamp file.
pub(crate) fn have_node_binaries(settings: &Settings) -> bool {
    ["kube-controller-manager", "kube-scheduler", "kwok"]
        .iter()
        .all(|name| executable(&settings.bin(name)))
        && stamp(settings, "kwok") == kwok_stamp(settings)
}

/// What `stamp(settings, "real-node")` says when the real node's binaries are current.
fn real_node_stamp(settings: &Settings) -> String {
    let version = format!(
        "kubelet {} containerd {CONTAINERD_VERSION} runc {RUNC_VERSION} cni-plugins {CNI_PLUGINS_VERSION}",
        kubelet_release().version
    );
    tool_stamp(
        settings,
        &version,
        &["node", "runc", &kubelet_release().wrapper()],
    )
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
        && stamp(settings, "real-node") == real_node_stamp(settings)
}

/// helm, for the chart's tests; like kwok, its version is in a stamp file.
fn have_helm(settings: &Settings) -> bool {
    executable(&settings.bin("helm")) && stamp(settings, "helm") == helm_stamp(settings)
}

/// The go.mod files require the versions pinned here.
fn check_pins(settings: &Settings) -> Result<()> {
    let release = settings.release.wrapper();
    let kubelet = kubelet_release().wrapper();
    for (wrapper, module, version) in [
        (
            release.as_str(),
            "k8s.io/kubernetes",
            settings.release.version,
        ),
        (
            kubelet.as_str(),
            "k8s.io/kubernetes",
            kubelet_release().version,
        ),
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

/// The version variables that kubernetes' hack/lib/version.sh sets, for RELEASE.
fn k8s_ldflags(settings: &Settings, release: &Release) -> String {
    let minor = release.minor;
    let version = release.version;
    // The release date of the module keeps the build reproducible.
    let date = go_output(
        settings,
        &release.wrapper(),
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
            " -X {pkg}.gitVersion={version} -X {pkg}.gitMajor=1 -X {pkg}.gitMinor={minor}"
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

/// Links every tool into the release's directory (`../../tools/bin/NAME`), so that the one
/// directory `bin-dir` prints and `env` puts on PATH has them all. A link to a tool not built
/// yet dangles until it is.
fn link_tools(settings: &Settings) -> Result<()> {
    for name in TOOLS {
        let link = settings.bin_dir.join(name);
        if std::fs::symlink_metadata(&link).is_ok() {
            continue;
        }
        let target = Path::new("../../tools/bin").join(name);
        std::os::unix::fs::symlink(&target, &link)
            .with_context(|| format!("cannot link {} to {}", link.display(), target.display()))?;
    }
    Ok(())
}

fn tools_linked(settings: &Settings) -> bool {
    TOOLS
        .iter()
        .all(|name| std::fs::symlink_metadata(settings.bin_dir.join(name)).is_ok())
}

/// Removes what an interrupted build left in DIR.
fn remove_leftovers(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') && name.contains(".tmp.") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// The command `build [--nodes] [--helm] [--real-node]` for the settings' release: builds
/// what is missing; with `nodes` also the binaries of a plane with nodes, with `helm` also
/// helm, with `real_node` also those of the real node (and the node binaries, which it needs
/// too).
pub(crate) fn build(settings: &Settings, nodes: bool, helm: bool, real_node: bool) -> Result<()> {
    let nodes = nodes || real_node;
    let bin_dir = &settings.bin_dir;
    let version = settings.release.version;
    let complete = |settings: &Settings| {
        have_binaries(settings)
            && (!nodes || have_node_binaries(settings))
            && (!helm || have_helm(settings))
            && (!real_node || have_real_node_binaries(settings))
            && tools_linked(settings)
    };
    if complete(settings) {
        log(format_args!(
            "using cached binaries of Kubernetes {version} in {}",
            bin_dir.display()
        ));
        return Ok(());
    }
    if !on_path("go") {
        bail!("go is not installed (needed once to build the control plane)");
    }
    check_pins(settings)?;
    for dir in [bin_dir, &settings.tools_dir] {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // Serialise concurrent builds (e.g. test binaries running in parallel, or two releases
    // sharing the tools); the lock goes with the file when this process ends, however it ends.
    let lock_path = settings.cache_dir.join(".build.lock");
    let lock =
        File::create(&lock_path).with_context(|| format!("cannot open {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("cannot lock {}", lock_path.display()))?;
    remove_leftovers(bin_dir);
    remove_leftovers(&settings.tools_dir);
    link_tools(settings)?;
    let start = Instant::now();
    if !have_binaries(settings) {
        log(format_args!(
            "building Kubernetes {version} (kube-apiserver, kubectl) into {}",
            bin_dir.display()
        ));
        log("(the first build compiles a lot of Go: about 5-7 minutes on 2 cores)");
    }
    if !executable(&settings.bin("etcd")) || stamp(settings, "etcd") != etcd_stamp(settings) {
        log(format_args!(
            "building etcd {ETCD_VERSION} into {}",
            settings.tools_dir.display()
        ));
        let _ = std::fs::remove_file(settings.tools_dir.join(".etcd.version"));
        go_build(settings, "etcd", "etcd", "go.etcd.io/etcd/server/v3", "")?;
        write_stamp(settings, "etcd", &etcd_stamp(settings))?;
    }
    let ldflags = k8s_ldflags(settings, settings.release);
    let wrapper = settings.release.wrapper();
    build_kubernetes(settings, &wrapper, &["kubectl", "kube-apiserver"], &ldflags)?;
    if nodes && !have_node_binaries(settings) {
        log(format_args!(
            "building kube-controller-manager, kube-scheduler {version} and kwok {KWOK_VERSION}"
        ));
        log("(once: a few minutes on 2 cores after kube-apiserver; about 9 on a busy machine)");
        build_kubernetes(
            settings,
            &wrapper,
            &["kube-controller-manager", "kube-scheduler"],
            &ldflags,
        )?;
        if !executable(&settings.bin("kwok")) || stamp(settings, "kwok") != kwok_stamp(settings) {
            let _ = std::fs::remove_file(settings.tools_dir.join(".kwok.version"));
            go_build(settings, "kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok", "")?;
            write_stamp(settings, "kwok", &kwok_stamp(settings))?;
        }
    }
    if helm && !have_helm(settings) {
        log(format_args!(
            "building helm {HELM_VERSION} into {} (once: 2-3 minutes on 2 cores)",
            settings.tools_dir.display()
        ));
        let _ = std::fs::remove_file(settings.tools_dir.join(".helm.version"));
        go_build(
            settings,
            "helm",
            "helm",
            "helm.sh/helm/v3/cmd/helm",
            &helm_ldflags(settings),
        )?;
        write_stamp(settings, "helm", &helm_stamp(settings))?;
    }
    if real_node && !have_real_node_binaries(settings) {
        build_real_node(settings)?;
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
fn build_real_node(settings: &Settings) -> Result<()> {
    let kubelet = kubelet_release();
    log(format_args!(
        "building the real node: kubelet {}, containerd {CONTAINERD_VERSION}, runc {RUNC_VERSION}, CNI plugins {CNI_PLUGINS_VERSION} (once: about 4 minutes on 2 cores)",
        kubelet.version
    ));
    if !on_path("gcc") {
        bail!(
            "gcc is not installed (needed once to build runc and the pause image): apt-get install gcc libc6-dev"
        );
    }
    let _ = std::fs::remove_file(settings.tools_dir.join(".real-node.version"));
    // The stamp changed (a wrapper did): the kubelet is built again too, not kept.
    let _ = std::fs::remove_file(settings.bin("kubelet"));
    build_kubernetes(
        settings,
        &kubelet.wrapper(),
        &["kubelet"],
        &k8s_ldflags(settings, kubelet),
    )?;
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
    write_stamp(settings, "real-node", &real_node_stamp(settings))
}

/// bin/pause from k8s.io/kubernetes' build/pause/linux/pause.c, and bin/pause.tar, its OCI
/// image.
fn build_pause(settings: &Settings) -> Result<()> {
    let kubelet = kubelet_release();
    let module = go_output(
        settings,
        &kubelet.wrapper(),
        &[
            "mod",
            "download",
            "-json",
            &format!("k8s.io/kubernetes@{}", kubelet.version),
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
        .arg(format!("-DVERSION={}-initium", kubelet.version))
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

/// Builds each of the Kubernetes commands `names` that is not in the cache yet, from the
/// wrapper module WRAPPER (a release's).
fn build_kubernetes(
    settings: &Settings,
    wrapper: &str,
    names: &[&str],
    ldflags: &str,
) -> Result<()> {
    for name in names {
        if !executable(&settings.bin(name)) {
            go_build(
                settings,
                wrapper,
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
