//! The cluster's side of a test: unique names and namespaces, the CRDs of `crds/`, rules
//! created through the API server and waited for until Ready, and waiting for an object's
//! conditions.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use futures::{StreamExt, TryStreamExt};
use initium::engine::RuleId;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, ObjectMeta, PostParams};
use serde_json::Value;

use super::plane::{Plane, root};
use super::wait::{eventually, poll};

/// The CRDs `crds/` installs.
pub const CRDS: [&str; 2] = [
    "mutationrules.initium.dev",
    "clustermutationrules.initium.dev",
];

/// How long a new CRD may take to be Established: the API server is slow right after it
/// starts, on a busy machine.
const ESTABLISHED_WITHIN: Duration = Duration::from_secs(60);

/// A suffix nobody else in this cluster uses: `<counter>-<random-ish hex>`.
fn suffix() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}-{:x}",
        COUNTER.fetch_add(1, Ordering::Relaxed),
        (nanos ^ std::process::id().rotate_left(16)) & 0xff_ffff
    )
}

/// A name nobody else in this cluster uses: `<prefix>-<counter>-<random-ish hex>`.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", suffix())
}

/// Creates a namespace named `<prefix>-<unique suffix>` (the prefix made a valid name) and
/// returns its name.
pub async fn namespace(client: &kube::Client, prefix: &str) -> String {
    let suffix = suffix();
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
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
    name
}

impl Plane {
    /// Installs `crds/` (server-side apply: harmless when they are there already) and waits
    /// until every CRD is Established. Once per plane: every caller gets the outcome of that
    /// one install.
    pub fn install_crds(&self) -> Result<()> {
        self.crds
            .get_or_init(|| self.apply_crds().map_err(|e| format!("{e:#}")))
            .clone()
            .map_err(|e| anyhow!(e))
    }

    fn apply_crds(&self) -> Result<()> {
        run_kubectl(
            self.kubectl()
                .args([
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    "--field-manager=initium-tests",
                    "-k",
                ])
                .arg(root().join("crds")),
        )
        .map_err(|e| anyhow!("the API server rejected crds/: {e}"))?;
        for crd in CRDS {
            self.wait_condition("crd", crd, "Established", ESTABLISHED_WITHIN)?;
        }
        Ok(())
    }

    /// Waits until the object `kind`/`name` has the condition `type_` with status True.
    ///
    /// Not `kubectl wait`, nor a jsonpath filter on the conditions: both fail on an object so
    /// new that it has no conditions yet (a CRD just applied, say). Here that, and a kubectl
    /// that cannot get the object yet, is "not yet".
    pub fn wait_condition(
        &self,
        kind: &str,
        name: &str,
        type_: &str,
        timeout: Duration,
    ) -> Result<()> {
        poll(
            &format!("{kind} {name} to be {type_}"),
            timeout,
            Duration::from_millis(100),
            || {
                Ok(
                    run_kubectl(self.kubectl().args(["get", kind, name, "-o", "json"]))
                        .and_then(|json| condition_true(&json, type_)),
                )
            },
        )
    }
}

/// Whether an object (its JSON as kubectl prints it) has the condition `type_` with status
/// True; if not, what its conditions are instead.
pub fn condition_true(object: &str, type_: &str) -> Result<(), String> {
    let object: Value =
        serde_json::from_str(object).map_err(|e| format!("not JSON ({e}): {object}"))?;
    let conditions = object["status"]["conditions"]
        .as_array()
        .filter(|c| !c.is_empty())
        .ok_or("no conditions yet")?;
    if conditions
        .iter()
        .any(|c| c["type"] == type_ && c["status"] == "True")
    {
        return Ok(());
    }
    let seen: Vec<String> = conditions
        .iter()
        .map(|c| {
            let field = |name: &str| c[name].as_str().unwrap_or_default().to_owned();
            format!(
                "{}={} ({})",
                field("type"),
                field("status"),
                field("message")
            )
        })
        .collect();
    Err(format!("conditions {}", seen.join(", ")))
}

/// Runs kubectl: its stdout, or what it printed on failure, as one line of text.
fn run_kubectl(command: &mut Command) -> Result<String, String> {
    let output = command
        .output()
        .map_err(|e| format!("cannot run kubectl: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "kubectl failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// The API resource of a rule document's `kind`.
pub fn rule_resource(kind: &str) -> Result<ApiResource> {
    let (plural, kind) = match kind {
        "MutationRule" => ("mutationrules", "MutationRule"),
        "ClusterMutationRule" => ("clustermutationrules", "ClusterMutationRule"),
        other => bail!("not a rule kind: {other}"),
    };
    Ok(ApiResource {
        group: "initium.dev".into(),
        version: "v1alpha1".into(),
        api_version: "initium.dev/v1alpha1".into(),
        kind: kind.into(),
        plural: plural.into(),
    })
}

/// Creates every namespace the rules live in, then the rules, `concurrency` requests at a time.
pub async fn create_rules(
    client: &kube::Client,
    rules: &[Value],
    concurrency: usize,
) -> Result<()> {
    let mut namespaces: Vec<&str> = rules
        .iter()
        .filter_map(|r| r["metadata"]["namespace"].as_str())
        .collect();
    namespaces.sort_unstable();
    namespaces.dedup();
    let ns_api = Api::<Namespace>::all(client.clone());
    futures::stream::iter(namespaces.into_iter().map(|name| {
        let ns_api = ns_api.clone();
        async move {
            let ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(name.to_string()),
                    ..Default::default()
                },
                ..Default::default()
            };
            match ns_api.create(&PostParams::default(), &ns).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
                Err(e) => Err(anyhow!("create namespace {name}: {e}")),
            }
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await?;

    futures::stream::iter(rules.iter().map(|rule| {
        let client = client.clone();
        async move {
            let kind = rule["kind"].as_str().unwrap_or_default();
            let resource = rule_resource(kind)?;
            let api: Api<DynamicObject> = match rule["metadata"]["namespace"].as_str() {
                Some(ns) => Api::namespaced_with(client, ns, &resource),
                None => Api::all_with(client, &resource),
            };
            let object: DynamicObject = serde_json::from_value(rule.clone())?;
            api.create(&PostParams::default(), &object)
                .await
                .with_context(|| format!("create {kind} {}", rule["metadata"]))?;
            Ok::<(), anyhow::Error>(())
        }
    }))
    .buffer_unordered(concurrency)
    .try_collect::<Vec<()>>()
    .await?;
    Ok(())
}

/// How many rules of both kinds have `Ready=True` in their status.
pub async fn ready_rules(client: &kube::Client) -> Result<usize> {
    let mut ready = 0;
    for kind in ["MutationRule", "ClusterMutationRule"] {
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &rule_resource(kind)?);
        let list = api.list(&ListParams::default()).await?;
        ready += list
            .items
            .iter()
            .filter(|rule| {
                rule.data["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
            .count();
    }
    Ok(ready)
}

/// Waits, at most `timeout`, until the status of the rule `name` (of `kind`, MutationRule or
/// ClusterMutationRule; in `namespace` if it has one) says its current generation is Ready.
pub async fn wait_rule_ready(
    client: &kube::Client,
    kind: &str,
    namespace: Option<&str>,
    name: &str,
    timeout: Duration,
) {
    let resource = rule_resource(kind).unwrap_or_else(|e| panic!("{e:#}"));
    let rules: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let described = match namespace {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    };
    eventually(&format!("{described} to be Ready"), timeout, || async {
        let rule = rules.get(name).await.map_err(|e| e.to_string())?;
        ready_for(&rule.data["status"], rule.metadata.generation)
    })
    .await;
}

/// Whether a rule's `status` says generation `generation` is Ready.
pub fn ready_for(status: &Value, generation: Option<i64>) -> Result<(), String> {
    let ready = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True");
    if ready && status["observedGeneration"].as_i64() == generation {
        Ok(())
    } else {
        Err(format!("generation {generation:?}, status {status}"))
    }
}

/// The holder of Lease `name` in `namespace`; `None` if there is none (or no answer).
pub async fn lease_holder(client: &kube::Client, namespace: &str, name: &str) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec?.holder_identity)
}

/// What a test created cluster-wide, deleted when dropped (also when the test fails), and on
/// [`Cleanup::run`]. Declare it before the `initium serve` processes or controllers: locals
/// drop in reverse order, so they stop first and cannot write the configurations again.
pub struct Cleanup {
    plane: &'static Plane,
    /// Every rule of the plane, not only those in `rules`.
    every_rule: bool,
    /// Rules to delete.
    pub rules: Vec<RuleId>,
    /// Webhook configurations, mutating and validating, to delete.
    pub configurations: Vec<String>,
    /// CRDs to delete.
    pub crds: Vec<String>,
}

impl Cleanup {
    /// Deletes what the test lists in it, on the test cluster ([`Plane::shared`]).
    pub fn new() -> Cleanup {
        Cleanup {
            plane: Plane::shared(),
            every_rule: false,
            rules: Vec::new(),
            configurations: Vec::new(),
            crds: Vec::new(),
        }
    }

    /// Deletes every rule of `plane` and the webhook configurations `configurations`: at
    /// once, and again when dropped. For a plane whose rules are all the test's own.
    pub fn every_rule(plane: &'static Plane, configurations: &[&str]) -> Cleanup {
        let mut cleanup = Cleanup {
            plane,
            every_rule: true,
            rules: Vec::new(),
            configurations: configurations.iter().map(|s| s.to_string()).collect(),
            crds: Vec::new(),
        };
        cleanup.run();
        cleanup
    }

    /// Deletes it all now (again when dropped: what is gone already is passed over).
    pub fn run(&mut self) {
        let delete = |args: &[&str]| {
            let output = self
                .plane
                .kubectl()
                .args(["delete", "--ignore-not-found", "--wait=false"])
                .args(args)
                .output();
            match output {
                Ok(o) if o.status.success() => {}
                other => eprintln!(
                    "cleanup `kubectl delete {}` failed: {other:?}",
                    args.join(" ")
                ),
            }
        };
        if self.every_rule {
            self.delete_every_rule();
        }
        for rule in &self.rules {
            match &rule.namespace {
                Some(ns) => delete(&["mutationrule", &rule.name, "-n", ns]),
                None => delete(&["clustermutationrule", &rule.name]),
            }
        }
        for name in &self.configurations {
            delete(&["mutatingwebhookconfiguration", name]);
            delete(&["validatingwebhookconfiguration", name]);
        }
        for name in &self.crds {
            delete(&["crd", name]);
        }
    }

    fn delete_every_rule(&self) {
        let _ = self
            .plane
            .kubectl()
            .args(["delete", "cmr", "--all", "--wait=true"])
            .output();
        // One DELETE of the collection per namespace (`kubectl delete --all` sends one request
        // per rule: minutes for a thousand).
        let namespaces = self
            .plane
            .kubectl()
            .args([
                "get",
                "mr",
                "--all-namespaces",
                "-o",
                "jsonpath={.items[*].metadata.namespace}",
            ])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let namespaces: BTreeSet<&str> = namespaces.split_whitespace().collect();
        for namespace in namespaces {
            let _ = self
                .plane
                .kubectl()
                .args([
                    "delete",
                    "--raw",
                    &format!("/apis/initium.dev/v1alpha1/namespaces/{namespace}/mutationrules"),
                ])
                .output();
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.run();
    }
}

/// Installs `crds/` on the test cluster ([`Plane::shared`]; once per test binary) or fails
/// the calling test with what went wrong.
pub fn install_crds() {
    Plane::shared()
        .install_crds()
        .unwrap_or_else(|e| panic!("{e:#}"));
}
