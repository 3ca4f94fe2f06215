//! The pinned versions and where things are: the binary cache, the Go wrapper modules, the
//! default plane directory, and the settings read from the environment.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Pinned versions. They must match scripts/control-plane.d/*/go.mod (`build` checks).
pub(crate) const K8S_VERSION: &str = "v1.34.4";
pub(crate) const ETCD_VERSION: &str = "v3.6.16";
pub(crate) const KWOK_VERSION: &str = "v0.8.0";
pub(crate) const HELM_VERSION: &str = "v3.22.0";
/// The real node's container runtime (scripts/control-plane.d/node and runc).
pub(crate) const CONTAINERD_VERSION: &str = "v2.2.9";
pub(crate) const RUNC_VERSION: &str = "v1.3.7";
pub(crate) const CNI_PLUGINS_VERSION: &str = "v1.9.1";

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
    /// `${INITIUM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/initium}/control-plane/<k8s>-etcd<etcd>/bin`,
    /// as the bash script had it, so that existing caches stay valid.
    pub(crate) bin_dir: PathBuf,
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
    pub(crate) fn from_env() -> Result<Settings> {
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
        let bin_dir = cache_root
            .join("control-plane")
            .join(format!("{K8S_VERSION}-etcd{ETCD_VERSION}"))
            .join("bin");
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
            bin_dir,
            wrappers,
            command,
            default_dir,
        })
    }

    /// `--dir`, or the default; absolute.
    pub(crate) fn plane_dir(&self, dir: Option<PathBuf>) -> Result<PathBuf> {
        absolute(dir.unwrap_or_else(|| self.default_dir.clone()))
    }

    pub(crate) fn bin(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
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
