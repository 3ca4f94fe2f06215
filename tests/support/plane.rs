//! The control plane the tests and benchmarks run against: etcd + kube-apiserver started
//! with `scripts/control-plane up` (built from Go modules on first use, cached outside the
//! clone; see docs/control-plane.md), or a cluster named by `INITIUM_TEST_KUBECONFIG`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};

/// The repository root.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `scripts/control-plane` in this repository: a shim that runs the Rust harness
/// (`crates/plane`) through `cargo run`. The tests call the shim, the documented command,
/// rather than the binary: cargo does not hold its build lock while tests run, so the shim
/// builds the harness when it changed (no test depends on another package's binary).
pub fn control_plane_script() -> PathBuf {
    root().join("scripts/control-plane")
}

/// Runs a command; its stdout, or an error with everything it printed.
pub fn run(command: &mut Command) -> Result<String> {
    let output = command
        .output()
        .with_context(|| format!("cannot run {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({})\n--- stdout\n{}\n--- stderr\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A Kubernetes API server to run against.
pub struct Plane {
    /// Where `scripts/control-plane up` keeps this plane's processes and data; `None` for a
    /// cluster this process did not start, which it must never take down.
    dir: Option<PathBuf>,
    pub kubeconfig: PathBuf,
    kubectl: PathBuf,
    /// The outcome of installing `crds/` on this plane, shared by every caller.
    pub(super) crds: OnceLock<Result<(), String>>,
}

impl Plane {
    /// Starts a plane of its own for this process (in `$TMPDIR/initium-bench-NAME-PID`),
    /// building the binaries first if need be. It stops when dropped, and by itself if this
    /// process dies (`--owner-pid`).
    pub fn up(name: &str) -> Result<Plane> {
        let dir = std::env::temp_dir().join(format!("initium-bench-{name}-{}", std::process::id()));
        eprintln!("bench: starting etcd + kube-apiserver in {}", dir.display());
        Plane::start(dir)
    }

    /// [`Plane::up`] with `nodes` simulated nodes: a whole cluster (controller manager,
    /// scheduler, kwok) of this process's own, for benchmarks of what controllers do.
    pub fn up_cluster(name: &str, nodes: u32) -> Result<Plane> {
        Plane::up_cluster_with(name, nodes, &[])
    }

    /// [`Plane::up_cluster`] with extra environment for `scripts/control-plane up`: the
    /// components' extra flags (`INITIUM_PLANE_APISERVER_ARGS`, `..._CONTROLLER_MANAGER_ARGS`,
    /// `..._SCHEDULER_ARGS`, `..._KWOK_ARGS`; see docs/control-plane.md), e.g. an audit log.
    /// A variable set in this process's environment as well gets `env`'s value after its own.
    pub fn up_cluster_with(name: &str, nodes: u32, env: &[(&str, String)]) -> Result<Plane> {
        let dir = std::env::temp_dir().join(format!("initium-bench-{name}-{}", std::process::id()));
        eprintln!(
            "bench: starting a whole cluster ({nodes} simulated nodes) in {}",
            dir.display()
        );
        Plane::start_with(dir, Some(nodes), env)
    }

    /// The plane every test of this test binary shares: the cluster of
    /// `INITIUM_TEST_KUBECONFIG` if set, otherwise one started on first use that stops by
    /// itself when the test binary exits (a static is never dropped, so [`Drop`] does not
    /// take it down early).
    pub fn shared() -> &'static Plane {
        static SHARED: OnceLock<Plane> = OnceLock::new();
        SHARED.get_or_init(|| {
            let found = match std::env::var_os("INITIUM_TEST_KUBECONFIG") {
                Some(kubeconfig) => Plane::existing(kubeconfig.into()),
                None => {
                    let tmp = option_env!("CARGO_TARGET_TMPDIR")
                        .map_or_else(std::env::temp_dir, PathBuf::from);
                    Plane::start(tmp.join(format!("initium-plane-{}", std::process::id())))
                }
            };
            found.unwrap_or_else(|e| panic!("{e:#}"))
        })
    }

    /// A cluster someone else runs, reached through `kubeconfig`.
    fn existing(kubeconfig: PathBuf) -> Result<Plane> {
        let built = bin_dir()?.join("kubectl");
        Ok(Plane {
            dir: None,
            kubeconfig,
            kubectl: if built.exists() {
                built
            } else {
                "kubectl".into()
            },
            crds: OnceLock::new(),
        })
    }

    /// `scripts/control-plane up --dir DIR`, owned by this process: taken down when dropped.
    fn start(dir: PathBuf) -> Result<Plane> {
        Plane::start_cluster(dir, None)
    }

    /// `scripts/control-plane up --dir DIR [--nodes N]`, owned by this process (taken down
    /// when dropped, and by itself when this process dies): with `nodes`, a whole cluster
    /// (controller manager, scheduler, N nodes simulated by kwok) on the same API server.
    pub fn start_cluster(dir: PathBuf, nodes: Option<u32>) -> Result<Plane> {
        Plane::start_with(dir, nodes, &[])
    }

    /// `scripts/control-plane up --dir DIR --real-node`, owned by this process: a cluster
    /// whose one node runs real containers (containerd, runc, kubelet; root only).
    pub fn start_real_node(dir: PathBuf) -> Result<Plane> {
        Plane::start_options(dir, None, true, &[])
    }

    /// [`Plane::start_cluster`] with extra environment for `up` (see [`Plane::up_cluster_with`]).
    fn start_with(dir: PathBuf, nodes: Option<u32>, env: &[(&str, String)]) -> Result<Plane> {
        Plane::start_options(dir, nodes, false, env)
    }

    fn start_options(
        dir: PathBuf,
        nodes: Option<u32>,
        real_node: bool,
        env: &[(&str, String)],
    ) -> Result<Plane> {
        let script = control_plane_script();
        let bin_dir = bin_dir()?;
        let mut binaries = vec!["etcd", "kube-apiserver", "kubectl"];
        if nodes.is_some() {
            binaries.extend(["kube-controller-manager", "kube-scheduler", "kwok"]);
        }
        if real_node {
            binaries.extend(["kubelet", "containerd", "runc", "pause.tar", "busybox"]);
        }
        if !binaries.iter().all(|b| bin_dir.join(b).exists()) {
            // The first build takes minutes: its progress goes to stderr.
            let status = Command::new(&script)
                .arg("build")
                .args(nodes.map(|_| "--nodes"))
                .args(real_node.then_some("--real-node"))
                .stdout(Stdio::null())
                .status()
                .context("cannot run scripts/control-plane build")?;
            if !status.success() {
                bail!("scripts/control-plane build failed ({status})");
            }
        }
        let mut up = Command::new(&script);
        up.arg("up")
            .arg("--dir")
            .arg(&dir)
            .arg("--owner-pid")
            .arg(std::process::id().to_string());
        if let Some(nodes) = nodes {
            up.arg("--nodes").arg(nodes.to_string());
        }
        if real_node {
            up.arg("--real-node");
        }
        for (name, value) in env {
            let value = match std::env::var(name) {
                Ok(own) if !own.trim().is_empty() => format!("{own} {value}"),
                _ => value.clone(),
            };
            up.env(name, value);
        }
        run(&mut up)?;
        Ok(Plane {
            kubeconfig: dir.join("kubeconfig"),
            kubectl: bin_dir.join("kubectl"),
            dir: Some(dir),
            crds: OnceLock::new(),
        })
    }

    /// Where `scripts/control-plane` keeps this plane (for `restart --dir`); `None` for a
    /// cluster this process did not start.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// `kubectl --kubeconfig <this plane>`, with the kubectl built with the control plane.
    pub fn kubectl(&self) -> Command {
        let mut command = Command::new(&self.kubectl);
        command.arg("--kubeconfig").arg(&self.kubeconfig);
        command
    }

    /// `kubectl <args>` with `input` on its stdin; what it printed and how it ended.
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> Result<Output> {
        let mut child = self
            .kubectl()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot run kubectl")?;
        child
            .stdin
            .take()
            .context("kubectl has no stdin")?
            .write_all(input.as_bytes())?;
        Ok(child.wait_with_output()?)
    }

    /// `kubectl apply --server-side -f -` with `yaml` on stdin.
    pub fn apply(&self, yaml: &str) -> Result<()> {
        let output = self.kubectl_stdin(
            &["apply", "--server-side", "--force-conflicts", "-f", "-"],
            yaml,
        )?;
        if !output.status.success() {
            bail!(
                "kubectl apply failed: {}\n--- input\n{yaml}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }

    /// A client for this plane. kube's rustls TLS needs a crypto provider: the `kube`
    /// dependency must enable its `ring` (or `aws-lc-rs`) feature, otherwise this panics with
    /// "Could not automatically determine the process-level CryptoProvider".
    pub async fn client(&self) -> Result<kube::Client> {
        let path = &self.kubeconfig;
        let kubeconfig = kube::config::Kubeconfig::read_from(path)
            .with_context(|| format!("cannot read the kubeconfig {}", path.display()))?;
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .with_context(|| format!("cannot load the kubeconfig {}", path.display()))?;
        Ok(kube::Client::try_from(config)?)
    }

    /// Creates the namespace (with `labels`) unless it exists.
    pub fn ensure_namespace(&self, name: &str, labels: &[(&str, &str)]) -> Result<()> {
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
        let Some(dir) = &self.dir else {
            return;
        };
        let _ = Command::new(control_plane_script())
            .arg("down")
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Where `scripts/control-plane build` puts etcd, kube-apiserver and kubectl.
fn bin_dir() -> Result<PathBuf> {
    Ok(PathBuf::from(
        run(Command::new(control_plane_script()).arg("bin-dir"))?.trim(),
    ))
}

/// `helm`, built from Go modules by `scripts/control-plane build --helm` into the control
/// plane's cache on first use (minutes; later calls find it at once). It needs no cluster:
/// `helm template` and `helm lint` render offline. Its caches and configuration are this
/// process's own, so a developer's repositories and plugins play no part.
pub fn helm() -> Command {
    static HELM: OnceLock<Result<(PathBuf, PathBuf), String>> = OnceLock::new();
    let found = HELM.get_or_init(|| {
        let built = || -> Result<(PathBuf, PathBuf)> {
            // Quick when helm is there: the script checks its version stamp.
            let status = Command::new(control_plane_script())
                .args(["build", "--helm"])
                .stdout(Stdio::null())
                .status()
                .context("cannot run scripts/control-plane build --helm")?;
            if !status.success() {
                bail!("scripts/control-plane build --helm failed ({status})");
            }
            let home = option_env!("CARGO_TARGET_TMPDIR")
                .map_or_else(std::env::temp_dir, PathBuf::from)
                .join(format!("initium-helm-{}", std::process::id()));
            std::fs::create_dir_all(&home)
                .with_context(|| format!("cannot create {}", home.display()))?;
            Ok((bin_dir()?.join("helm"), home))
        };
        built().map_err(|e| format!("{e:#}"))
    });
    let (helm, home) = found.as_ref().unwrap_or_else(|e| panic!("{e}"));
    let mut command = Command::new(helm);
    for (variable, dir) in [
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ] {
        command.env(variable, home.join(dir));
    }
    command
        .env_remove("KUBECONFIG")
        .env_remove("HELM_NAMESPACE");
    command
}

/// The kubeconfig of the test cluster ([`Plane::shared`]).
pub fn kubeconfig_path() -> PathBuf {
    Plane::shared().kubeconfig.clone()
}

/// `kubectl --kubeconfig <test cluster>` ([`Plane::shared`]).
pub fn kubectl() -> Command {
    Plane::shared().kubectl()
}

/// A client for the test cluster ([`Plane::shared`]). Each `#[tokio::test]` has its own
/// runtime, so every call builds a new client.
pub async fn client() -> kube::Client {
    Plane::shared()
        .client()
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
}
