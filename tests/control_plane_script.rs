//! Tests for scripts/control-plane: it starts a real etcd + kube-apiserver
//! (and with `--nodes`, a whole cluster: controller manager, scheduler and
//! nodes simulated by kwok), and stops exactly what it started. Also
//! exercises tests/support.
//!
//! These tests fail (they do not skip) when the control plane cannot be
//! built or started. The first run builds the binaries (minutes); later runs
//! reuse them from the cache (see docs/control-plane.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use support::wait::{is, poll};
use support::{Plane, eventually_blocking, serial_blocking};

// Control planes are CPU hungry at startup: these tests run one at a time (`serial_blocking`).

fn script() -> Command {
    Command::new(support::control_plane_script())
}

fn check(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({})\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn build() {
    check(script().arg("build"));
}

fn kubectl_bin() -> PathBuf {
    PathBuf::from(stdout(&check(script().arg("bin-dir"))).trim()).join("kubectl")
}

/// A plane directory under target/tmp, downed on drop (even when the test
/// panics).
struct PlaneDir(PathBuf);

impl PlaneDir {
    fn new(name: &str) -> Self {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("control-plane-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        PlaneDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn read(&self, file: &str) -> String {
        let path = self.0.join(file);
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
            .trim()
            .to_owned()
    }

    fn pid(&self, name: &str) -> u32 {
        self.read(&format!("{name}.pid"))
            .parse()
            .expect("pid file holds a pid")
    }

    fn port(&self, name: &str) -> u16 {
        self.read(&format!("{name}.port"))
            .parse()
            .expect("port file holds a port")
    }
}

impl Drop for PlaneDir {
    fn drop(&mut self) {
        let _ = script().arg("down").arg("--dir").arg(&self.0).output();
    }
}

/// The process exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
            !matches!(state, Some(Some('Z' | 'X')))
        }
        Err(_) => false,
    }
}

fn port_open(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
}

#[test]
fn up_serves_kubernetes_and_down_stops_everything() {
    let _serial = serial_blocking();
    build();
    let plane = PlaneDir::new("updown");
    let dir = plane.path();
    let up = check(script().arg("up").arg("--dir").arg(dir));
    assert!(
        stdout(&up).contains("env --dir"),
        "up prints how to use the plane:\n{}",
        stdout(&up)
    );

    let pids = [plane.pid("etcd"), plane.pid("kube-apiserver")];
    let ports = [
        plane.port("etcd"),
        plane.port("etcd-peer"),
        plane.port("kube-apiserver"),
    ];
    for pid in pids {
        assert!(
            alive(pid),
            "process {pid} from {} is not running",
            dir.display()
        );
    }
    for port in ports {
        assert!(port_open(port), "nothing listens on 127.0.0.1:{port}");
    }
    for name in NODE_COMPONENTS {
        assert!(
            !dir.join(format!("{name}.pid")).exists(),
            "a plane without --nodes started {name}"
        );
    }

    let kubectl = kubectl_bin();
    let kubeconfig = dir.join("kubeconfig");
    let readyz = check(
        Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["get", "--raw", "/readyz"]),
    );
    assert_eq!(stdout(&readyz).trim(), "ok");
    let version = stdout(&check(
        Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("version"),
    ));
    // The release asked for ($INITIUM_KUBERNETES_VERSION, as scripts/matrix sets it), or the
    // newest `versions` lists; `up` records it, and both binaries are of it.
    let versions = stdout(&check(script().arg("versions")));
    let wanted = match std::env::var("INITIUM_KUBERNETES_VERSION") {
        Ok(minor) if !minor.trim().is_empty() => versions
            .lines()
            .find(|l| l.split_whitespace().next() == Some(minor.trim().trim_start_matches('v')))
            .map(str::to_owned),
        _ => versions.lines().last().map(str::to_owned),
    };
    let release = wanted
        .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        .expect("versions lists the release asked for");
    let recorded = std::fs::read_to_string(dir.join("kubernetes-version")).unwrap_or_default();
    assert_eq!(recorded.trim(), release);
    assert!(
        version.contains(&format!("Client Version: {release}\n")),
        "unexpected kubectl version (wanted {release}):\n{version}"
    );
    assert!(
        version.contains(&format!("Server Version: {release}\n")),
        "unexpected server version (wanted {release}):\n{version}"
    );
    let resources = stdout(&check(
        Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("api-resources"),
    ));
    assert!(
        resources.contains("mutatingadmissionpolicies"),
        "MutatingAdmissionPolicy API is not served:\n{resources}"
    );

    let env = stdout(&check(script().arg("env").arg("--dir").arg(dir)));
    assert!(
        env.contains("export KUBECONFIG=") && env.contains("export PATH="),
        "unexpected env output:\n{env}"
    );

    let again = script()
        .arg("up")
        .arg("--dir")
        .arg(dir)
        .output()
        .expect("run up again");
    assert!(
        !again.status.success(),
        "a second up on a live plane must be refused"
    );
    for pid in pids {
        assert!(alive(pid), "refused up must not touch the running plane");
    }

    check(script().arg("down").arg("--dir").arg(dir));
    for pid in pids {
        assert!(!alive(pid), "process {pid} survived down");
    }
    for port in ports {
        assert!(
            !port_open(port),
            "127.0.0.1:{port} still accepts connections after down"
        );
    }
    assert!(!dir.exists(), "down did not remove {}", dir.display());

    // down is idempotent.
    check(script().arg("down").arg("--dir").arg(dir));
}

#[test]
fn up_refuses_a_full_file_system_with_a_sentence_and_starts_nothing() {
    // A full disk used to show up as an etcd panic ("failed to create WAL: no
    // space left on device") deep in the log. Pretend the disk is full by
    // asking for more free space than any disk has.
    build();
    // The directory does not exist yet: the space is asked of its closest parent. Should up
    // start anyway, the plane is downed on drop and dies with this process.
    let plane = PlaneDir::new("full");
    let dir = plane.path();
    let up_wanting = |free_mib: &str| {
        let output = script()
            .arg("up")
            .arg("--dir")
            .arg(dir)
            .arg("--owner-pid")
            .arg(std::process::id().to_string())
            .env("INITIUM_PLANE_MIN_FREE_MIB", free_mib)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output.status.success(), stderr)
    };

    let (started, stderr) = up_wanting("999999999999");
    assert!(!started, "up started anyway:\n{stderr}");
    assert!(
        stderr.contains("MiB are free on the file system of")
            && stderr.contains("needs at least 999999999999 MiB")
            && stderr.contains("free some space there, or choose another --dir"),
        "up says what is wrong and what to do:\n{stderr}"
    );
    assert!(
        !stderr.contains("starting etcd"),
        "nothing starts:\n{stderr}"
    );
    assert!(!dir.exists(), "up leaves no directory behind");

    let (started, stderr) = up_wanting("lots");
    assert!(!started, "up accepted a bad setting:\n{stderr}");
    assert!(
        stderr.contains("INITIUM_PLANE_MIN_FREE_MIB is a number of MiB, not 'lots'"),
        "{stderr}"
    );
}

#[test]
fn owner_pid_takes_the_plane_down_when_the_owner_exits() {
    let _serial = serial_blocking();
    build();
    let plane = PlaneDir::new("owner");
    let dir = plane.path();
    let mut owner = Command::new("sleep")
        .arg("300")
        .spawn()
        .expect("spawn sleep");
    let up = script()
        .arg("up")
        .arg("--dir")
        .arg(dir)
        .arg("--owner-pid")
        .arg(owner.id().to_string())
        .output()
        .expect("run up");
    if !up.status.success() {
        let _ = owner.kill();
        let _ = owner.wait();
        panic!("up failed:\n{}", String::from_utf8_lossy(&up.stderr));
    }
    let pids = [
        plane.pid("etcd"),
        plane.pid("kube-apiserver"),
        plane.pid("watchdog"),
    ];
    let ports = [plane.port("etcd"), plane.port("kube-apiserver")];
    for pid in pids {
        assert!(
            alive(pid),
            "process {pid} from {} is not running",
            dir.display()
        );
    }

    // The owner exits; the watchdog notices within a second or so.
    owner.kill().expect("kill owner");
    owner.wait().expect("reap owner");
    eventually_blocking(
        "the plane directory to be removed",
        Duration::from_secs(30),
        || is(dir.exists(), false),
    );
    eventually_blocking(
        "the plane processes to exit",
        Duration::from_secs(30),
        || {
            let alive: Vec<u32> = pids.iter().copied().filter(|&pid| alive(pid)).collect();
            is(alive, Vec::<u32>::new())
        },
    );
    for port in ports {
        assert!(
            !port_open(port),
            "127.0.0.1:{port} still accepts connections"
        );
    }
}

#[test]
fn support_provides_a_shared_plane() {
    let _serial = serial_blocking();
    let kubeconfig = support::kubeconfig_path();
    assert!(kubeconfig.is_file(), "{} is missing", kubeconfig.display());
    assert_eq!(
        support::kubeconfig_path(),
        kubeconfig,
        "one plane per test binary"
    );

    let namespaces = check(support::kubectl().args(["get", "namespaces", "-o", "name"]));
    assert!(
        stdout(&namespaces).contains("namespace/default"),
        "{}",
        stdout(&namespaces)
    );

    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let created = runtime.block_on(async {
        let client = support::client().await;
        let first = support::namespace(&client, "support-Test_").await;
        let second = support::namespace(&client, "support-Test_").await;
        assert_ne!(first, second);
        assert!(first.starts_with("support-test-"), "{first}");
        let api = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client);
        api.get(&first).await.expect("the namespace exists");
        first
    });
    let got = check(support::kubectl().args(["get", "namespace", &created, "-o", "name"]));
    assert_eq!(stdout(&got).trim(), format!("namespace/{created}"));
}

/// The processes `up --nodes` adds to etcd and kube-apiserver.
const NODE_COMPONENTS: [&str; 3] = ["kube-controller-manager", "kube-scheduler", "kwok"];

#[test]
fn up_with_nodes_rolls_out_a_deployment_and_down_stops_everything() {
    let _serial = serial_blocking();
    check(script().args(["build", "--nodes"]));
    let plane = PlaneDir::new("nodes");
    let dir = plane.path();
    let started = Instant::now();
    check(
        script()
            .arg("up")
            .arg("--dir")
            .arg(dir)
            .args(["--nodes", "1"]),
    );
    eprintln!("up --nodes 1 took {:?}", started.elapsed());

    let names = ["etcd", "kube-apiserver"]
        .into_iter()
        .chain(NODE_COMPONENTS)
        .collect::<Vec<_>>();
    let pids = names.iter().map(|name| plane.pid(name)).collect::<Vec<_>>();
    for (name, pid) in names.iter().zip(&pids) {
        assert!(alive(*pid), "{name} (pid {pid}) is not running");
    }
    let status = stdout(&check(script().arg("status").arg("--dir").arg(dir)));
    for name in &names {
        assert!(
            status.contains(&format!("{name}: running")),
            "status does not report {name} running:\n{status}"
        );
    }
    let ports = NODE_COMPONENTS
        .into_iter()
        .chain(["etcd", "kube-apiserver"])
        .map(|name| plane.port(name))
        .collect::<Vec<_>>();

    let kubectl = || {
        let mut command = Command::new(kubectl_bin());
        command
            .arg("--kubeconfig")
            .arg(dir.join("kubeconfig"))
            .args(["--namespace", "default"]);
        command
    };
    // up returns once the node is Ready; nothing to wait for here.
    let ready = stdout(&check(kubectl().args([
        "get",
        "node",
        "kwok-node-1",
        "-o",
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
    ])));
    assert_eq!(ready.trim(), "True", "kwok-node-1 is not Ready after up");

    // The ReplicaSet controller creates the Pods, the scheduler binds them to
    // the node, kwok makes them Running and Ready: the Deployment is Available.
    check(kubectl().args([
        "create",
        "deployment",
        "web",
        "--image=nginx",
        "--replicas=2",
    ]));
    check(kubectl().args([
        "wait",
        "--for=condition=Available",
        "deployment/web",
        "--timeout=60s",
    ]));
    let pods = stdout(&check(kubectl().args([
        "get",
        "pods",
        "--selector=app=web",
        "-o",
        r#"jsonpath={range .items[*]}{.spec.nodeName} {.status.phase}{"\n"}{end}"#,
    ])));
    assert_eq!(
        pods.lines().collect::<Vec<_>>(),
        ["kwok-node-1 Running", "kwok-node-1 Running"],
        "the Deployment's Pods are not both Running on kwok-node-1"
    );

    check(script().arg("down").arg("--dir").arg(dir));
    for (name, pid) in names.iter().zip(&pids) {
        assert!(!alive(*pid), "{name} (pid {pid}) survived down");
    }
    for port in ports {
        assert!(
            !port_open(port),
            "127.0.0.1:{port} still accepts connections after down"
        );
    }
    assert!(!dir.exists(), "down did not remove {}", dir.display());
}

#[test]
fn a_condition_wait_takes_an_object_without_conditions_for_not_yet() {
    use support::cluster::condition_true;
    let crd = |status: &str| format!(r#"{{"kind": "CustomResourceDefinition"{status}}}"#);
    // What kubectl prints for a CRD applied a moment ago: no status, or no conditions yet.
    for fresh in [
        crd(""),
        crd(r#", "status": {}"#),
        crd(r#", "status": {"conditions": []}"#),
    ] {
        assert_eq!(
            condition_true(&fresh, "Established"),
            Err("no conditions yet".to_string()),
            "{fresh}"
        );
    }
    let names_accepted = crd(
        r#", "status": {"conditions": [{"type": "NamesAccepted", "status": "True", "message": "no conflicts"}]}"#,
    );
    let seen = condition_true(&names_accepted, "Established").expect_err("not Established");
    assert!(seen.contains("NamesAccepted"), "{seen}");
    let established = crd(
        r#", "status": {"conditions": [{"type": "NamesAccepted", "status": "True"}, {"type": "Established", "status": "True"}]}"#,
    );
    assert_eq!(condition_true(&established, "Established"), Ok(()));
}

#[test]
fn poll_retries_until_done_gives_up_at_once_on_an_error_and_times_out_naming_the_last_attempt() {
    let mut attempts = 0;
    let done = poll(
        "three attempts",
        Duration::from_secs(5),
        Duration::ZERO,
        || {
            attempts += 1;
            Ok(if attempts < 3 {
                Err(format!("attempt {attempts}"))
            } else {
                Ok(attempts)
            })
        },
    );
    assert_eq!(done.expect("done on the third attempt"), 3);

    let mut attempts = 0;
    let gone = poll::<()>("a process", Duration::from_secs(5), Duration::ZERO, || {
        attempts += 1;
        anyhow::bail!("the process exited")
    });
    assert_eq!(attempts, 1, "an error ends the wait at once");
    assert_eq!(
        format!("{:#}", gone.expect_err("fails")),
        "the process exited"
    );

    let never = poll::<()>(
        "the impossible",
        Duration::from_millis(50),
        Duration::from_millis(10),
        || Ok(Err("still impossible".into())),
    );
    let message = format!("{:#}", never.expect_err("times out"));
    assert!(
        message.contains("waiting for the impossible")
            && message.contains("last attempt: still impossible"),
        "{message}"
    );
}

#[test]
fn crds_installed_right_after_startup_are_established_and_usable() {
    let _serial = serial_blocking();
    // A fresh plane: its API server has just started, and the CRDs are applied at once, when
    // they have no conditions for a moment (the case a `scripts/bench webhook` run aborted on).
    let plane = Plane::up("crds").unwrap_or_else(|e| panic!("{e:#}"));
    plane.install_crds().unwrap_or_else(|e| panic!("{e:#}"));
    for crd in support::cluster::CRDS {
        let json = check(plane.kubectl().args(["get", "crd", crd, "-o", "json"]));
        assert_eq!(
            support::cluster::condition_true(&stdout(&json), "Established"),
            Ok(()),
            "{crd}"
        );
    }
    // Usable: a rule of each kind is stored and listed at once.
    plane
        .apply(
            "apiVersion: initium.dev/v1alpha1\nkind: ClusterMutationRule\nmetadata: {name: fresh}\nspec:\n  match: {kinds: [Pod]}\n  mutations: [{merge: {metadata: {labels: {fresh: \"yes\"}}}}]\n---\napiVersion: initium.dev/v1alpha1\nkind: MutationRule\nmetadata: {name: fresh, namespace: default}\nspec:\n  match: {kinds: [Pod]}\n  mutations: [{merge: {metadata: {labels: {fresh: \"yes\"}}}}]\n",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    let listed = check(
        plane
            .kubectl()
            .args(["get", "cmr,mr", "--all-namespaces", "-o", "name"]),
    );
    assert_eq!(
        stdout(&listed).lines().collect::<Vec<_>>(),
        [
            "clustermutationrule.initium.dev/fresh",
            "mutationrule.initium.dev/fresh"
        ],
    );
    // Installed once per plane: asking again is the same outcome, without a second apply.
    plane.install_crds().unwrap_or_else(|e| panic!("{e:#}"));

    // A CRD that is never Established (its kind is taken in its group): the wait gives up
    // after its timeout and says what the API server reports instead.
    plane
        .apply(
            "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata: {name: clashes.initium.dev}\nspec:\n  group: initium.dev\n  scope: Cluster\n  names: {plural: clashes, singular: clash, kind: MutationRule, listKind: MutationRuleList}\n  versions:\n  - name: v1alpha1\n    served: true\n    storage: true\n    schema: {openAPIV3Schema: {type: object}}\n",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    let never = plane
        .wait_condition(
            "crd",
            "clashes.initium.dev",
            "Established",
            Duration::from_secs(3),
        )
        .expect_err("a CRD whose kind is taken is never Established");
    let message = format!("{never:#}");
    assert!(
        message.contains("waiting for crd clashes.initium.dev to be Established")
            && message.contains("NamesAccepted"),
        "{message}"
    );
}
