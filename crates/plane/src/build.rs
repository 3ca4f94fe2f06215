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
use crate::settings::{ETCD_VERSION, HELM_VERSION, K8S_VERSION, KWOK_VERSION, Settings};

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
    let out = settings.bin(name);
    let tmp = settings.bin(&format!(".{name}.tmp.{}", std::process::id()));
    let start = Instant::now();
    log(format_args!("building {name} ({package}) ..."));
    let status = Command::new("go")
        .args([
            "build",
            "-mod=readonly",
            "-trimpath",
            "-buildvcs=false",
            "-ldflags",
        ])
        .arg(format!("-s -w {ldflags}"))
        .arg("-o")
        .arg(&tmp)
        .arg(package)
        .current_dir(settings.wrappers.join(wrapper))
        .env("GOWORK", "off")
        .env("CGO_ENABLED", "0")
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

/// The command `build [--nodes] [--helm]`: builds what is missing; with `nodes` also the
/// binaries of a plane with nodes, with `helm` also helm.
pub(crate) fn build(settings: &Settings, nodes: bool, helm: bool) -> Result<()> {
    let bin_dir = &settings.bin_dir;
    let complete = |settings: &Settings| {
        have_binaries(settings)
            && (!nodes || have_node_binaries(settings))
            && (!helm || have_helm(settings))
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
    drop(lock);
    log(format_args!(
        "done in {}s: {}",
        start.elapsed().as_secs(),
        bin_dir.display()
    ));
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
