//! Test support: a real Kubernetes control plane for integration tests.
//!
//! Use it from an integration test with `mod support;`. The first call to
//! [`kubeconfig_path`] starts one control plane (etcd + kube-apiserver, see
//! `scripts/control-plane` and docs/control-plane.md) for the whole test
//! binary; it stops by itself when the test binary exits. Set
//! `INITIUM_TEST_KUBECONFIG` to run against an existing cluster instead.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ObjectMeta, PostParams};

/// `scripts/control-plane` in this repository.
pub fn control_plane_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/control-plane")
}

struct Plane {
    kubeconfig: PathBuf,
    kubectl: PathBuf,
}

fn plane() -> &'static Plane {
    static PLANE: OnceLock<Plane> = OnceLock::new();
    PLANE.get_or_init(|| {
        let bin_dir =
            PathBuf::from(run(Command::new(control_plane_script()).arg("bin-dir")).trim());
        let built_kubectl = bin_dir.join("kubectl");
        if let Some(kubeconfig) = std::env::var_os("INITIUM_TEST_KUBECONFIG") {
            let kubectl = if built_kubectl.exists() {
                built_kubectl
            } else {
                "kubectl".into()
            };
            return Plane {
                kubeconfig: kubeconfig.into(),
                kubectl,
            };
        }
        start_plane(&bin_dir)
    })
}

fn start_plane(bin_dir: &Path) -> Plane {
    let script = control_plane_script();
    let binaries = ["etcd", "kube-apiserver", "kubectl"];
    if !binaries.iter().all(|b| bin_dir.join(b).exists()) {
        // The first build takes minutes: let its progress reach the terminal.
        let status = Command::new(&script)
            .arg("build")
            .stdout(Stdio::null())
            .status()
            .expect("run scripts/control-plane build");
        assert!(
            status.success(),
            "scripts/control-plane build failed ({status})"
        );
    }
    let tmp = option_env!("CARGO_TARGET_TMPDIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let dir = tmp.join(format!("initium-plane-{}", std::process::id()));
    run(Command::new(&script)
        .arg("up")
        .arg("--dir")
        .arg(&dir)
        .arg("--owner-pid")
        .arg(std::process::id().to_string()));
    Plane {
        kubeconfig: dir.join("kubeconfig"),
        kubectl: bin_dir.join("kubectl"),
    }
}

/// Runs a command, panicking with its output unless it succeeds; returns stdout.
fn run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({})\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The kubeconfig of the test cluster: `INITIUM_TEST_KUBECONFIG` if set,
/// otherwise a control plane started once for this test binary.
pub fn kubeconfig_path() -> PathBuf {
    plane().kubeconfig.clone()
}

/// A client for the test cluster. Each `#[tokio::test]` has its own runtime,
/// so every call builds a new client.
///
/// kube's rustls TLS needs a crypto provider: the `kube` dependency must
/// enable its `ring` (or `aws-lc-rs`) feature, otherwise this panics with
/// "Could not automatically determine the process-level CryptoProvider".
pub async fn client() -> kube::Client {
    let path = kubeconfig_path();
    let kubeconfig = kube::config::Kubeconfig::read_from(&path)
        .unwrap_or_else(|e| panic!("read kubeconfig {}: {e}", path.display()));
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("load kubeconfig {}: {e}", path.display()));
    kube::Client::try_from(config).expect("build kube client")
}

/// A name nobody else in this cluster uses: `<prefix>-<counter>-<random-ish hex>`.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}-{}-{:x}",
        COUNTER.fetch_add(1, Ordering::Relaxed),
        (nanos ^ std::process::id().rotate_left(16)) & 0xff_ffff
    )
}

/// Creates a namespace named `<prefix>-<unique suffix>` and returns its name.
pub async fn namespace(client: &kube::Client, prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let suffix = format!(
        "{}-{:x}",
        COUNTER.fetch_add(1, Ordering::Relaxed),
        (nanos ^ std::process::id().rotate_left(16)) & 0xff_ffff
    );
    let prefix: String = prefix
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(63 - 1 - suffix.len())
        .collect();
    let prefix = match prefix.trim_matches('-') {
        "" => "test",
        trimmed => trimmed,
    };
    let name = format!("{prefix}-{suffix}");
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(
                [(
                    "app.kubernetes.io/created-by".to_owned(),
                    "initium-tests".to_owned(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    kube::Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
    name
}

/// `kubectl --kubeconfig <test cluster>`, using the kubectl built with the
/// control plane.
pub fn kubectl() -> Command {
    let plane = plane();
    let mut command = Command::new(&plane.kubectl);
    command.arg("--kubeconfig").arg(&plane.kubeconfig);
    command
}

/// Calls `attempt` until it returns `Ok`, at most for `timeout`; the panic says what was
/// awaited and what the last attempt saw.
pub async fn eventually<T, F, Fut>(what: &str, timeout: std::time::Duration, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match attempt().await {
            Ok(value) => return value,
            Err(last) if std::time::Instant::now() >= deadline => {
                panic!("timed out after {timeout:?} waiting for {what}; last attempt: {last}")
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    }
}

/// POSTs an AdmissionReview straight to a replica's `/mutate` at `webhook` (`127.0.0.1:PORT`;
/// its certificate is from its own CA, hence `-k`) and returns the response.
pub fn post_review(
    webhook: impl std::fmt::Display,
    review: &serde_json::Value,
) -> serde_json::Value {
    use std::io::Write;
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
