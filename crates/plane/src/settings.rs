//! The pinned versions and where things are: the binary cache, the Go wrapper modules, the
//! default plane directory, and the settings read from the environment.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// A supported Kubernetes minor and the patch release pinned for it. Its binaries are built
/// from the wrapper module scripts/control-plane.d/kubernetes/v1.MINOR, whose go.mod must
/// require `version` (`build` checks).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Release {
    pub(crate) minor: u32,
    pub(crate) version: &'static str,
}

/// Every supported minor, oldest first. The newest is the default; the oldest is what
/// initium compiles against (the `k8s-openapi` feature in Cargo.toml, which a test checks).
pub(crate) const RELEASES: [Release; 4] = [
    Release {
        minor: 34,
        version: "v1.34.4",
    },
    Release {
        minor: 35,
        version: "v1.35.4",
    },
    Release {
        minor: 36,
        version: "v1.36.3",
    },
    Release {
        minor: 37,
        version: "v1.37.2",
    },
];

/// The real node's kubelet: v1.34 whatever the control plane runs. From 1.35 the kubelet
/// refuses to start on cgroup v1 hosts, and the version-skew policy allows a kubelet three
/// minors older than the API server.
pub(crate) const KUBELET_MINOR: u32 = 34;

/// What picks the minor when `--version` is not given (tests and `scripts/matrix`).
pub(crate) const VERSION_VAR: &str = "INITIUM_KUBERNETES_VERSION";

/// A plane's directory records the release it runs (DIR/kubernetes-version), so that `env`,
/// `start-component` and the rest use its binaries.
pub(crate) const VERSION_FILE: &str = "kubernetes-version";

impl Release {
    /// "1.37"
    pub(crate) fn name(&self) -> String {
        format!("1.{}", self.minor)
    }

    /// The wrapper module's directory under scripts/control-plane.d.
    pub(crate) fn wrapper(&self) -> String {
        format!("kubernetes/v1.{}", self.minor)
    }

    /// MutatingAdmissionPolicy is GA (admissionregistration.k8s.io/v1, on by default) from
    /// 1.36; before, it is beta behind a feature gate and v1beta1.
    pub(crate) fn mutating_admission_policy_is_ga(&self) -> bool {
        self.minor >= 36
    }
}

/// The newest supported release: the default.
pub(crate) fn newest() -> &'static Release {
    &RELEASES[RELEASES.len() - 1]
}

/// The release of the real node's kubelet.
pub(crate) fn kubelet_release() -> &'static Release {
    RELEASES
        .iter()
        .find(|r| r.minor == KUBELET_MINOR)
        .unwrap_or(&RELEASES[0])
}

/// `--version`: a supported minor, as `1.35`, `v1.35`, or its pinned patch `1.35.4`.
pub(crate) fn parse_release(value: &str) -> Result<&'static Release> {
    let supported = || {
        RELEASES
            .iter()
            .map(Release::name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let trimmed = value.trim().trim_start_matches('v');
    let mut parts = trimmed.split('.');
    let (Some("1"), Some(minor), patch, None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        bail!(
            "a Kubernetes version is a minor such as {} (one of {}), not '{value}'",
            newest().name(),
            supported()
        );
    };
    let Some(release) = RELEASES.iter().find(|r| {
        minor.parse::<u32>().is_ok_and(|m| m == r.minor) && !minor.starts_with(['0', '+'])
    }) else {
        bail!(
            "Kubernetes {trimmed} is not supported here; choose one of {} (docs/control-plane.md says why these)",
            supported()
        );
    };
    if let Some(patch) = patch
        && format!("v1.{minor}.{patch}") != release.version
    {
        bail!(
            "Kubernetes 1.{minor} is pinned to {}, not 1.{minor}.{patch}; give the minor ({}) or that release",
            release.version,
            release.name()
        );
    }
    Ok(release)
}

/// The release `--version` names; without it, `$INITIUM_KUBERNETES_VERSION`, or the newest.
pub(crate) fn choose_release(flag: Option<&str>) -> Result<&'static Release> {
    match flag {
        Some(value) => parse_release(value),
        None => match var(VERSION_VAR) {
            Some(value) => parse_release(&value)
                .with_context(|| format!("{VERSION_VAR} names no supported release")),
            None => Ok(newest()),
        },
    }
}

/// Pinned versions of what does not follow the Kubernetes minor. They must match
/// scripts/control-plane.d/*/go.mod (`build` checks).
pub(crate) const ETCD_VERSION: &str = "v3.6.16";
pub(crate) const KWOK_VERSION: &str = "v0.8.0";
pub(crate) const HELM_VERSION: &str = "v3.22.0";
/// The real node's container runtime (scripts/control-plane.d/node and runc).
pub(crate) const CONTAINERD_VERSION: &str = "v2.2.9";
pub(crate) const RUNC_VERSION: &str = "v1.3.7";
pub(crate) const CNI_PLUGINS_VERSION: &str = "v1.9.1";

/// The commands built for each Kubernetes release, into its own directory. Everything else
/// (etcd, kwok, helm, the real node's kubelet and runtime) is built once into the tools
/// directory, and linked into each release's directory so that one directory has them all.
pub(crate) const RELEASE_COMMANDS: [&str; 4] = [
    "kube-apiserver",
    "kubectl",
    "kube-controller-manager",
    "kube-scheduler",
];

/// What the tools directory holds, each linked into every release's directory.
pub(crate) const TOOLS: [&str; 12] = [
    "etcd",
    "kwok",
    "helm",
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "runc",
    "cni",
    "pause",
    "pause.tar",
    "busybox",
];

/// Written by `up`; `down` only deletes directories that carry it.
pub(crate) const MARKER: &str = ".initium-control-plane";

/// The real node's processes (DIR/NAME.pid, DIR/NAME.log) and the hidden subcommands that
/// run them: `_node` under util-linux `unshare`, `_forward` (realnode.rs, forward.rs).
pub(crate) const REAL_NODE: &str = "real-node";
pub(crate) const FORWARD: &str = "apiserver-forward";
pub(crate) const NODE_ARG: &str = "_node";
pub(crate) const FORWARD_ARG: &str = "_forward";
/// DIR/real-node: the plane has a real node; it holds the node's index once it has one.
pub(crate) const REAL_NODE_FILE: &str = "real-node";

/// The processes of a plane with nodes, besides etcd and kube-apiserver, in the order they
/// start.
pub(crate) const NODE_COMPONENTS: [&str; 3] = ["kube-controller-manager", "kube-scheduler", "kwok"];

pub(crate) struct Settings {
    /// The Kubernetes release this command works with.
    pub(crate) release: &'static Release,
    /// `${INITIUM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/initium}/control-plane`.
    pub(crate) cache_dir: PathBuf,
    /// `<cache_dir>/v1.MINOR.PATCH/bin`: the release's commands, and links to the tools.
    pub(crate) bin_dir: PathBuf,
    /// `<cache_dir>/tools/bin`: what does not follow the release.
    pub(crate) tools_dir: PathBuf,
    /// scripts/control-plane.d: the Go wrapper modules and kwok's stages.
    pub(crate) wrappers: PathBuf,
    /// How users run this (scripts/control-plane, which says so in `INITIUM_PLANE_COMMAND`),
    /// for the commands the messages suggest.
    pub(crate) command: String,
    default_dir: PathBuf,
}

/// An environment variable, unless unset or empty (bash's `${VAR:-default}`).
pub(crate) fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Settings {
    pub(crate) fn from_env(release: &'static Release) -> Result<Settings> {
        let cache_root = match var("INITIUM_CACHE_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => {
                let cache = match var("XDG_CACHE_HOME") {
                    Some(dir) => PathBuf::from(dir),
                    None => PathBuf::from(var("HOME").context("HOME is not set")?).join(".cache"),
                };
                cache.join("initium")
            }
        };
        let cache_dir = cache_root.join("control-plane");
        let bin_dir = cache_dir.join(release.version).join("bin");
        let tools_dir = cache_dir.join("tools").join("bin");
        let wrappers = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/control-plane.d");
        let wrappers = wrappers.canonicalize().unwrap_or(wrappers);
        let command = var("INITIUM_PLANE_COMMAND").unwrap_or_else(|| {
            std::env::current_exe().map_or_else(
                |_| "scripts/control-plane".to_owned(),
                |exe| exe.display().to_string(),
            )
        });
        let default_dir = match var("INITIUM_PLANE_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => {
                let tmp = var("TMPDIR").unwrap_or_else(|| "/tmp".to_owned());
                let uid = rustix::process::getuid().as_raw();
                PathBuf::from(tmp).join(format!("initium-plane-{uid}"))
            }
        };
        Ok(Settings {
            release,
            cache_dir,
            bin_dir,
            tools_dir,
            wrappers,
            command,
            default_dir,
        })
    }

    /// `--dir`, or the default; absolute.
    pub(crate) fn plane_dir(&self, dir: Option<PathBuf>) -> Result<PathBuf> {
        absolute(dir.unwrap_or_else(|| self.default_dir.clone()))
    }

    /// The same settings for another release (a running plane's, as it recorded).
    pub(crate) fn with_release(self, release: &'static Release) -> Settings {
        let bin_dir = self.cache_dir.join(release.version).join("bin");
        Settings {
            release,
            bin_dir,
            ..self
        }
    }

    /// For a command on the plane in DIR: the release it recorded when it started, if any.
    pub(crate) fn for_plane(self, dir: &Path) -> Result<Settings> {
        let Ok(recorded) = std::fs::read_to_string(dir.join(VERSION_FILE)) else {
            return Ok(self);
        };
        let release = parse_release(recorded.trim()).with_context(|| {
            format!(
                "the plane in {} runs a release this checkout does not support",
                dir.display()
            )
        })?;
        Ok(self.with_release(release))
    }

    /// Where a command is: a release's command in the release's directory, anything else
    /// (`name` may be a path such as `cni/bridge`) in the tools directory.
    pub(crate) fn bin(&self, name: &str) -> PathBuf {
        if RELEASE_COMMANDS.contains(&name) {
            self.bin_dir.join(name)
        } else {
            self.tools_dir.join(name)
        }
    }

    /// How long `up` and `start-component` wait for the processes to be healthy.
    pub(crate) fn timeout(&self) -> Result<Duration> {
        match var("INITIUM_PLANE_TIMEOUT") {
            None => Ok(Duration::from_secs(60)),
            Some(value) => match value.parse::<u64>() {
                Ok(secs) => Ok(Duration::from_secs(secs)),
                Err(_) => bail!("INITIUM_PLANE_TIMEOUT is a number of seconds, not '{value}'"),
            },
        }
    }
}

/// Absolute (so that the processes' command lines and the kubeconfig name it from anywhere),
/// without a trailing slash, not resolved otherwise (as the bash script had it).
pub(crate) fn absolute(dir: PathBuf) -> Result<PathBuf> {
    if dir.as_os_str().is_empty() {
        bail!("--dir must not be empty");
    }
    let dir = if dir.is_absolute() {
        dir
    } else {
        std::env::current_dir()
            .context("cannot read the current directory")?
            .join(dir)
    };
    // PathBuf drops a trailing slash when it is rebuilt from its components; `.` and `..`
    // stay, as bash kept them.
    Ok(dir.components().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_is_a_supported_minor_or_its_pinned_release() {
        for value in ["1.35", "v1.35", "1.35.4", "v1.35.4", " 1.35 "] {
            assert_eq!(
                parse_release(value).ok().map(|r| r.version),
                Some("v1.35.4")
            );
        }
        let error = |value: &str| parse_release(value).err().map(|e| e.to_string());
        assert_eq!(
            error("1.33"),
            Some(
                "Kubernetes 1.33 is not supported here; choose one of 1.34, 1.35, 1.36, 1.37 (docs/control-plane.md says why these)"
                    .to_owned()
            )
        );
        assert_eq!(
            error("1.35.1"),
            Some(
                "Kubernetes 1.35 is pinned to v1.35.4, not 1.35.1; give the minor (1.35) or that release"
                    .to_owned()
            )
        );
        for bad in ["", "latest", "2.1", "1", "1.035", "1.3x", "1.35.4.1"] {
            assert!(
                error(bad).is_some_and(|e| e.contains("1.34")),
                "{bad:?} was taken: {:?}",
                parse_release(bad)
            );
        }
        assert_eq!(newest().minor, 37);
        assert_eq!(kubelet_release().version, "v1.34.4");
    }

    /// Oldest first, one per minor, each pin a release of its minor, each with its wrapper
    /// module requiring it.
    #[test]
    fn every_release_has_its_wrapper_module() {
        let wrappers = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/control-plane.d");
        for pair in RELEASES.windows(2) {
            assert_eq!(pair[0].minor + 1, pair[1].minor);
        }
        for release in &RELEASES {
            assert!(
                release
                    .version
                    .starts_with(&format!("v1.{}.", release.minor))
            );
            let go_mod = wrappers.join(release.wrapper()).join("go.mod");
            let text = std::fs::read_to_string(&go_mod).unwrap_or_default();
            let staging = format!("v0.{}", release.version.trim_start_matches("v1."));
            assert!(
                text.contains(&format!("k8s.io/kubernetes {}", release.version))
                    && text.contains(&format!("k8s.io/api => k8s.io/api {staging}")),
                "{} does not pin {} and its staging modules {staging}",
                go_mod.display(),
                release.version
            );
        }
    }

    /// initium compiles against the oldest supported API: the `k8s-openapi` feature of both
    /// crates that use it is the oldest release's.
    #[test]
    fn initium_compiles_against_the_oldest_release() {
        let oldest = format!("\"v1_{}\"", RELEASES[0].minor);
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for manifest in ["Cargo.toml", "crates/engine/Cargo.toml"] {
            let text = std::fs::read_to_string(root.join(manifest)).unwrap_or_default();
            let line = text
                .lines()
                .find(|l| l.starts_with("k8s-openapi"))
                .unwrap_or_default();
            assert!(
                line.contains(&oldest),
                "{manifest}: k8s-openapi must use the feature {oldest} (the oldest supported release), not: {line}"
            );
        }
    }
}
