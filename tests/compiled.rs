//! The field-for-field proof that a rule compiled to a MutatingAdmissionPolicy
//! (`initium_engine::policy`) does what initium does, on a real kube-apiserver (1.36+ serves
//! MutatingAdmissionPolicy v1; before that the tests say so and pass).
//!
//! For a set of rules that [`policy::plan`] serves wholly by the API server (a "round"), every
//! object is created in several ways, each a server-side dry run (`dryRun=All`: nothing is
//! stored, so names repeat), and the stored objects are compared without their volatile fields:
//!
//! - **A, webhook**: the rules as CRs, Ready, and `initium serve --compile-rules off`.
//! - **B, policies**: initium killed and its webhook configurations deleted, the policies and
//!   bindings `plan` generated created.
//! - **C′, `initium apply` on the object as admitted**: with nothing installed, the object is
//!   created (so the API server defaults it and its built-in admission plugins run), the
//!   engine's output for that (`RuleIndex::evaluate` with admission's at-most-once rule: a rule
//!   the object's `initium.dev/mutated-by` already lists is skipped) is created again.
//! - **C, `initium apply` on the object as written**: the engine's output for the object as
//!   written (its namespace filled in), created with nothing installed.
//!
//! A, B and C′ must be equal for every object, changed by a rule or not, stored or refused (two
//! refusals are equal whatever their messages); a mismatch fails the test naming the rules that
//! matched the object offline, the object, and the differing fields. C is compared too, but its
//! differences are reported, not failed: the engine then sees the object before the API server
//! defaulted it (`spec.securityContext: {}` on a Pod, `replicas: 1`, ...) and before the
//! built-in admission plugins ran (DefaultTolerationSeconds appends its tolerations before any
//! webhook or policy can append one), which no offline run can know.
//!
//! Before each path's dry runs, a sentinel rule (a MutationRule on ConfigMaps in a namespace of
//! its own) is written after every other rule (or policy) of the round, and the path starts once
//! it acts: what the API server reads in order (initium's configuration, written from every
//! Ready rule; the policies and bindings, each watched in order) then covers the whole round.
//!
//! Two sets of rules: every rule of `examples/*/rules.yaml` that compiles alone, grouped into
//! rounds `plan` compiles whole, with every example object; and 300 seeded rules
//! of the fuzzer's generators (tests/fuzz/generate.rs: a third from `rule`, the rest from
//! `compilable_rule`), each a MutationRule in a namespace of its own, with objects from `object`
//! and `compilable_object` in it. `cargo test --test compiled -- --nocapture` prints the counts;
//! every difference goes to `target/tmp/compiled-{examples,fuzz}.txt`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

mod support;

#[allow(dead_code)] // the fuzzer's generators: this test uses a few of them
#[path = "fuzz/generate.rs"]
mod generate;
#[allow(dead_code)]
#[path = "fuzz/rng.rs"]
mod rng;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use initium::engine::policy::{
    self, BuiltinResources, OWNER_LABEL, PolicySettings, RULE_NAMESPACE_LABEL, Serving,
};
use initium::engine::{
    Gvk, RanBefore, RuleId, RuleIndex, RuleSource, Subject, compile, parse_rule,
};
use initium_engine::api::Operation;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

use support::cluster::{ready_for, rule_resource};
use support::process::{Initium, InitiumOptions};
use support::{Plane, serial, unique};

use rng::Rng;

/// The installation: the policies' owner and initium's `--webhook-name` (its default).
const OWNER: &str = "initium";
/// Requests in flight at once.
const CONCURRENCY: usize = 16;
/// How long a webhook configuration or policy may take to act (or stop acting) once written.
const PROPAGATION: Duration = Duration::from_secs(60);
const READY: Duration = Duration::from_secs(120);
/// The label the sentinel rule sets.
const SENTINEL_LABEL: &str = "compiled.initium.dev/sentinel";

/// Seed and size of the fuzzed set: the same rules and objects on every run.
const FUZZ_SEED: u64 = 0x0c0_4d1e_2026;
const FUZZ_RULES: usize = 300;
/// Every third fuzzed rule from the fuzzer's plain `rule` generator.
const PLAIN_EVERY: usize = 3;
/// Objects per fuzzed rule: the first from `object`, the others from `compilable_object`.
const FUZZ_OBJECTS: usize = 6;
const FUZZ_PLAIN_OBJECTS: usize = 2;

// -------------------------------------------------------------------------------------------
// What is compared

/// What the API server answered to a dry-run create.
#[derive(Clone, Debug)]
enum Stored {
    Object(Value),
    Refused(String),
}

impl Stored {
    fn same(&self, other: &Stored) -> bool {
        match (self, other) {
            (Stored::Object(a), Stored::Object(b)) => a == b,
            (Stored::Refused(_), Stored::Refused(_)) => true,
            _ => false,
        }
    }
}

/// One object to create: where it came from, where it goes.
struct Input {
    origin: String,
    namespace: String,
    object: Value,
    gvk: Gvk,
    /// The collection's URL path (`/api/v1/namespaces/NS/pods`).
    collection: String,
}

/// A set of rules `plan` compiles whole, with the objects created under it.
struct Round {
    name: String,
    rules: Vec<(Value, RuleSource)>,
    inputs: Vec<usize>,
}

/// The engine's verdicts on one input of a round, before any rule is installed.
struct Offline {
    /// Rules that matched, changed and were skipped (C′).
    matched: Vec<String>,
    applied: Vec<String>,
    skipped: Vec<String>,
    /// C′: `initium apply` on the object as admitted, created.
    admitted: Stored,
    /// C: `initium apply` on the object as written, created.
    written: Stored,
}

/// One comparison that failed.
struct Mismatch {
    round: String,
    paths: &'static str,
    /// Whether it fails the test (C's differences are reported only).
    fails: bool,
    rules: Vec<String>,
    input: usize,
    diff: String,
}

#[derive(Default)]
struct Tally {
    rounds: usize,
    rules: usize,
    compared: usize,
    changed: usize,
    refused: usize,
    /// A few of the API server's refusals of A, to show why objects were refused.
    refusals: Vec<String>,
    mismatches: Vec<Mismatch>,
    /// Policies or bindings the API server refused: (rule, message).
    refused_policies: Vec<(String, String)>,
}

/// What a test shares between its rounds.
struct Env {
    plane: &'static Plane,
    client: kube::Client,
    /// The sentinel rule's namespace.
    sentinel: String,
}

// -------------------------------------------------------------------------------------------
// The API server

/// A dry-run create of `body` into `collection`.
async fn dry_run(client: &kube::Client, collection: &str, body: &Value) -> Stored {
    let bytes = serde_json::to_vec(body).unwrap();
    let mut attempt = 0;
    loop {
        let request = http::Request::post(format!("{collection}?dryRun=All"))
            .header("Content-Type", "application/json")
            .body(bytes.clone())
            .unwrap();
        match client.request::<Value>(request).await {
            Ok(object) => return Stored::Object(normalize(object)),
            Err(kube::Error::Api(status)) => {
                return Stored::Refused(format!(
                    "{} {}: {}",
                    status.code, status.reason, status.message
                ));
            }
            Err(e) if attempt < 3 => {
                eprintln!("compiled: dry run into {collection} failed ({e}); again");
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Stored::Refused(format!("no answer: {e}")),
        }
    }
}

/// The stored object without what differs between two creates of the same object: identity
/// and times the API server fills in, and the name it generates.
fn normalize(mut object: Value) -> Value {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        for field in [
            "uid",
            "creationTimestamp",
            "resourceVersion",
            "generation",
            "managedFields",
        ] {
            meta.remove(field);
        }
        if meta.contains_key("generateName") {
            meta.remove("name");
        }
        if let Some(annotations) = meta.get_mut("annotations").and_then(Value::as_object_mut) {
            annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
        }
    }
    // A gated Pod's PodScheduled condition, say.
    if let Some(conditions) = object
        .pointer_mut("/status/conditions")
        .and_then(Value::as_array_mut)
    {
        for condition in conditions.iter_mut().filter_map(Value::as_object_mut) {
            condition.remove("lastTransitionTime");
            condition.remove("lastProbeTime");
        }
    }
    object
}

/// Dry-runs every `(input, body)`, a few at a time.
async fn dry_run_all(
    client: &kube::Client,
    inputs: &[Input],
    bodies: Vec<(usize, Value)>,
) -> HashMap<usize, Stored> {
    futures::stream::iter(bodies.into_iter().map(|(i, body)| {
        let client = client.clone();
        let collection = inputs[i].collection.clone();
        async move { (i, dry_run(&client, &collection, &body).await) }
    }))
    .buffer_unordered(CONCURRENCY)
    .collect()
    .await
}

fn admission_api(client: &kube::Client, kind: &str) -> Api<DynamicObject> {
    let plural = match kind {
        "MutatingAdmissionPolicy" => "mutatingadmissionpolicies",
        "MutatingAdmissionPolicyBinding" => "mutatingadmissionpolicybindings",
        "MutatingWebhookConfiguration" => "mutatingwebhookconfigurations",
        _ => "validatingwebhookconfigurations",
    };
    Api::all_with(
        client.clone(),
        &ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "admissionregistration.k8s.io/v1".into(),
            kind: kind.into(),
            plural: plural.into(),
        },
    )
}

/// Whether the API server serves MutatingAdmissionPolicy v1 (Kubernetes 1.36 and later).
async fn serves_policies(client: &kube::Client) -> bool {
    client
        .list_api_group_resources("admissionregistration.k8s.io/v1")
        .await
        .is_ok_and(|list| {
            list.resources
                .iter()
                .any(|r| r.name == "mutatingadmissionpolicies")
        })
}

fn rule_api(client: &kube::Client, id: &RuleId) -> Api<DynamicObject> {
    let resource = rule_resource(id.kind()).unwrap();
    match &id.namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// Creates the rules; the spec the API server stored must read as the one sent.
async fn create_rules(client: &kube::Client, rules: &[(Value, RuleSource)]) {
    let results: Vec<Result<(), String>> =
        futures::stream::iter(rules.iter().map(|(doc, source)| {
            let api = rule_api(client, &source.id);
            async move {
                let object: DynamicObject = serde_json::from_value(doc.clone()).unwrap();
                let stored = api
                    .create(&PostParams::default(), &object)
                    .await
                    .map_err(|e| format!("create {}: {e}", source.id.describe()))?;
                let stored = serde_json::to_value(&stored).unwrap();
                let read = parse_rule(&stored, "default").map_err(|e| format!("{e:?}"))?;
                if read.spec != source.spec {
                    return Err(format!(
                        "{}: the API server stored another spec than was sent:\n{}",
                        source.id.describe(),
                        diff_values(&doc["spec"], &stored["spec"])
                    ));
                }
                Ok(())
            }
        }))
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let failed: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Waits until every rule's current generation is Ready.
async fn wait_ready(client: &kube::Client, rules: &[(Value, RuleSource)]) {
    let started = Instant::now();
    loop {
        let mut ready = BTreeSet::new();
        let mut last = String::new();
        for kind in ["MutationRule", "ClusterMutationRule"] {
            let api: Api<DynamicObject> =
                Api::all_with(client.clone(), &rule_resource(kind).unwrap());
            for rule in api.list(&ListParams::default()).await.unwrap().items {
                let name = rule.metadata.name.as_deref().unwrap_or_default();
                let id = match &rule.metadata.namespace {
                    Some(ns) => RuleId::namespaced(ns, name),
                    None => RuleId::cluster(name),
                };
                match ready_for(&rule.data["status"], rule.metadata.generation) {
                    Ok(()) => {
                        ready.insert(id);
                    }
                    Err(e) => last = format!("{}: {e}", id.describe()),
                }
            }
        }
        let waiting = rules.iter().filter(|(_, s)| !ready.contains(&s.id)).count();
        if waiting == 0 {
            return;
        }
        assert!(
            started.elapsed() < READY,
            "{waiting} of {} rules not Ready after {READY:?}; last: {last}",
            rules.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Creates `objects` (policies or bindings), a few at a time; the refused ones, with the
/// rule each came from.
async fn create_all(
    api: &Api<DynamicObject>,
    objects: Vec<(String, Value)>,
) -> Vec<(String, String)> {
    let results: Vec<Option<(String, String)>> =
        futures::stream::iter(objects.into_iter().map(|(rule, object)| {
            let api = api.clone();
            async move {
                let name = object["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let kind = object["kind"].as_str().unwrap_or_default().to_string();
                let object: DynamicObject = serde_json::from_value(object).unwrap();
                api.create(&PostParams::default(), &object)
                    .await
                    .err()
                    .map(|e| (rule, format!("{kind} {name}: {e}")))
            }
        }))
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    results.into_iter().flatten().collect()
}

// -------------------------------------------------------------------------------------------
// The sentinel

/// The sentinel rule: a MutationRule that labels ConfigMaps in its own namespace, after every
/// other rule (it never meets their objects).
fn sentinel_rule(namespace: &str) -> (Value, RuleSource) {
    let doc = json!({
        "apiVersion": "initium.dev/v1alpha1",
        "kind": "MutationRule",
        "metadata": {"name": "sentinel", "namespace": namespace},
        "spec": {
            "priority": 1000,
            "match": {"kinds": ["ConfigMap"]},
            "mutations": [{"merge": {"metadata": {"labels": {SENTINEL_LABEL: "yes"}}}}],
        },
    });
    let source = parse_rule(&doc, "default").unwrap();
    (doc, source)
}

/// Waits until a ConfigMap created in the sentinel's namespace carries its label (`acts`), or
/// does not.
async fn wait_sentinel(client: &kube::Client, namespace: &str, acts: bool, what: &str) {
    let collection = format!("/api/v1/namespaces/{namespace}/configmaps");
    let probe = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"}});
    let started = Instant::now();
    loop {
        let seen = dry_run(client, &collection, &probe).await;
        let labelled =
            matches!(&seen, Stored::Object(o) if o["metadata"]["labels"][SENTINEL_LABEL] == "yes");
        if labelled == acts {
            return;
        }
        assert!(
            started.elapsed() < PROPAGATION,
            "{what}: after {PROPAGATION:?} the sentinel {} act: {seen:?}",
            if acts { "does not" } else { "still does" }
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// -------------------------------------------------------------------------------------------
// Cleaning up

/// What a round installed: deleted by [`Leftovers::clean`] once the round is over, and by a
/// blocking `kubectl delete` when dropped before (a failed test leaves nothing behind).
struct Leftovers {
    plane: &'static Plane,
    sentinel: String,
    rules: Vec<RuleId>,
}

impl Leftovers {
    /// Deletes the round's policies and bindings, then the sentinel's; waits until the
    /// sentinel no longer acts (so neither does any other policy); deletes the rules.
    async fn clean(&mut self, client: &kube::Client) {
        let others = format!(
            "{OWNER_LABEL}={OWNER},{RULE_NAMESPACE_LABEL}!={}",
            self.sentinel
        );
        let sentinel = policy::policy_name(OWNER, &RuleId::namespaced(&self.sentinel, "sentinel"));
        for kind in ["MutatingAdmissionPolicyBinding", "MutatingAdmissionPolicy"] {
            let api = admission_api(client, kind);
            let _ = api
                .delete_collection(
                    &DeleteParams::default(),
                    &ListParams::default().labels(&others),
                )
                .await;
        }
        for kind in ["MutatingAdmissionPolicyBinding", "MutatingAdmissionPolicy"] {
            let _ = admission_api(client, kind)
                .delete(&sentinel, &DeleteParams::default())
                .await;
        }
        wait_sentinel(client, &self.sentinel, false, "the policies to be gone").await;
        let rules = std::mem::take(&mut self.rules);
        let namespaces: BTreeSet<&str> = rules
            .iter()
            .filter_map(|id| id.namespace.as_deref())
            .collect();
        let resource = rule_resource("MutationRule").unwrap();
        futures::stream::iter(namespaces.into_iter().map(|ns| {
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &resource);
            async move {
                let _ = api
                    .delete_collection(&DeleteParams::default(), &ListParams::default())
                    .await;
            }
        }))
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<()>>()
        .await;
        for id in rules.iter().filter(|id| id.namespace.is_none()) {
            let _ = rule_api(client, id)
                .delete(&id.name, &DeleteParams::default())
                .await;
        }
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        if self.rules.is_empty() {
            return;
        }
        let kubectl = |args: &[&str]| {
            let _ = self
                .plane
                .kubectl()
                .args(["delete", "--ignore-not-found", "--wait=false"])
                .args(args)
                .output();
        };
        let selector = format!("{OWNER_LABEL}={OWNER}");
        kubectl(&["mutatingadmissionpolicybindings", "-l", &selector]);
        kubectl(&["mutatingadmissionpolicies", "-l", &selector]);
        kubectl(&["mutatingwebhookconfiguration", OWNER]);
        kubectl(&["validatingwebhookconfiguration", OWNER]);
        let cluster: Vec<&str> = self
            .rules
            .iter()
            .filter(|id| id.namespace.is_none())
            .map(|id| &*id.name)
            .collect();
        if !cluster.is_empty() {
            let mut args = vec!["clustermutationrule"];
            args.extend(cluster);
            kubectl(&args);
        }
        let namespaces: BTreeSet<&str> = self
            .rules
            .iter()
            .filter_map(|id| id.namespace.as_deref())
            .collect();
        for ns in namespaces {
            kubectl(&["mutationrules", "--all", "-n", ns]);
        }
    }
}

// -------------------------------------------------------------------------------------------
// Inputs

/// Resolves kinds to collections.
struct Kinds {
    discovery: kube::Discovery,
}

impl Kinds {
    async fn new(client: &kube::Client) -> Kinds {
        Kinds {
            discovery: kube::Discovery::new(client.clone()).run().await.unwrap(),
        }
    }

    /// The object in `namespace`; `None` for what the API server does not serve or is not
    /// namespaced.
    fn input(&self, origin: String, namespace: &str, mut object: Value) -> Option<Input> {
        let api_version = object.get("apiVersion")?.as_str()?.to_string();
        let kind = object.get("kind")?.as_str()?.to_string();
        let gvk = Gvk::from_api_version(&api_version, &kind);
        let (resource, caps) = self.discovery.resolve_gvk(&GroupVersionKind::gvk(
            &gvk.group,
            &gvk.version,
            &gvk.kind,
        ))?;
        if caps.scope != kube::discovery::Scope::Namespaced {
            return None;
        }
        match object.get_mut("metadata") {
            Some(Value::Object(meta)) => {
                meta.insert("namespace".into(), json!(namespace));
            }
            None => object["metadata"] = json!({"namespace": namespace}),
            Some(_) => return None,
        }
        let base = if gvk.group.is_empty() {
            format!("/api/{}", gvk.version)
        } else {
            format!("/apis/{}/{}", gvk.group, gvk.version)
        };
        Some(Input {
            origin,
            namespace: namespace.to_string(),
            collection: format!("{base}/namespaces/{namespace}/{}", resource.plural),
            object,
            gvk,
        })
    }
}

/// The documents of a YAML file.
fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap()
        .into_iter()
        .filter(Value::is_object)
        .collect()
}

/// Creates the namespaces (with labels) that are not there yet.
async fn ensure_namespaces(client: &kube::Client, namespaces: BTreeMap<String, Value>) {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let results: Vec<Result<(), String>> =
        futures::stream::iter(namespaces.into_iter().map(|(name, labels)| {
            let api = api.clone();
            async move {
                let ns = serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": labels}
                }))
                .unwrap();
                match api.create(&PostParams::default(), &ns).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                    Err(e) => Err(format!("namespace {name}: {e}")),
                }
            }
        }))
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let failed: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The labels of every namespace, as the engine reads them for `namespaceSelector`.
async fn namespace_labels(client: &kube::Client) -> BTreeMap<String, BTreeMap<String, String>> {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|ns| {
            (
                ns.metadata.name.unwrap_or_default(),
                ns.metadata.labels.unwrap_or_default(),
            )
        })
        .collect()
}

fn describe(input: &Input) -> String {
    let o = &input.object;
    let name = o["metadata"]["name"]
        .as_str()
        .or(o["metadata"]["generateName"].as_str())
        .unwrap_or("(unnamed)");
    let name: String = name.chars().take(60).collect();
    format!(
        "{} {}/{name} ({})",
        input.gvk.kind, input.namespace, input.origin
    )
}

// -------------------------------------------------------------------------------------------
// Differences

fn short(v: Option<&Value>) -> String {
    match v {
        None => "(absent)".into(),
        Some(v) => {
            let text = v.to_string();
            if text.len() > 160 {
                format!("{}…", text.chars().take(160).collect::<String>())
            } else {
                text
            }
        }
    }
}

fn short_long(v: &Value) -> String {
    let text = v.to_string();
    if text.len() > 1500 {
        format!("{}…", text.chars().take(1500).collect::<String>())
    } else {
        text
    }
}

/// The differing fields, one per line: `pointer: left ≠ right`, at most 20.
fn diff_values(a: &Value, b: &Value) -> String {
    fn walk(a: Option<&Value>, b: Option<&Value>, at: &str, out: &mut Vec<String>) {
        if out.len() > 20 {
            return;
        }
        match (a, b) {
            (Some(Value::Object(x)), Some(Value::Object(y))) => {
                let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let child = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                    walk(x.get(k), y.get(k), &child, out);
                }
            }
            (Some(Value::Array(x)), Some(Value::Array(y))) if x.len() == y.len() => {
                for (i, (p, q)) in x.iter().zip(y).enumerate() {
                    walk(Some(p), Some(q), &format!("{at}/{i}"), out);
                }
            }
            (a, b) if a != b => out.push(format!("  {at}: {} ≠ {}", short(a), short(b))),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(Some(a), Some(b), "", &mut out);
    out.truncate(20);
    out.join("\n")
}

fn diff_stored(a: &Stored, b: &Stored) -> String {
    match (a, b) {
        (Stored::Object(x), Stored::Object(y)) => diff_values(x, y),
        (Stored::Refused(x), Stored::Object(_)) => format!("  refused ({x}) ≠ stored"),
        (Stored::Object(_), Stored::Refused(y)) => format!("  stored ≠ refused ({y})"),
        (Stored::Refused(x), Stored::Refused(y)) => format!("  refused ({x}) and ({y})"),
    }
}

// -------------------------------------------------------------------------------------------
// A round

fn settings(initium_namespace: &str) -> PolicySettings {
    PolicySettings {
        // Every round compiles whole: the cap is tested on its own (the engine's unit tests).
        max_compiled: usize::MAX,
        owner: OWNER.into(),
        excluded_namespaces: vec![initium_namespace.into(), "kube-system".into()],
    }
}

/// What `plan` generates for each of `rules` (`None`: served by the webhook).
fn compiled(rules: &[&RuleSource], settings: &PolicySettings) -> Vec<Option<policy::Generated>> {
    let pairs: Vec<(RuleId, &initium_engine::api::RuleSpec)> =
        rules.iter().map(|s| (s.id.clone(), &s.spec)).collect();
    policy::plan(&pairs, &BuiltinResources, settings)
        .into_iter()
        .map(|serving| match serving {
            Serving::ApiServer(generated) => Some(*generated),
            Serving::Webhook(_) => None,
        })
        .collect()
}

/// C and C′ for every input of a round, with nothing installed.
async fn offline(
    client: &kube::Client,
    inputs: &[Input],
    round: &Round,
    labels: &BTreeMap<String, BTreeMap<String, String>>,
) -> HashMap<usize, Offline> {
    let rules = round
        .rules
        .iter()
        .map(|(_, s)| compile(s.id.clone(), &s.spec).unwrap())
        .collect();
    let index = RuleIndex::new(rules);
    let none = BTreeMap::new();
    let originals = round
        .inputs
        .iter()
        .map(|&i| (i, inputs[i].object.clone()))
        .collect();
    let admitted = dry_run_all(client, inputs, originals).await;
    let names = |ids: &[RuleId]| ids.iter().map(RuleId::describe).collect::<Vec<_>>();
    let mut verdicts = HashMap::new();
    let mut as_written = Vec::new();
    let mut as_admitted = Vec::new();
    for &i in &round.inputs {
        let input = &inputs[i];
        let apply = |object: &Value| {
            let name = object["metadata"]["name"]
                .as_str()
                .filter(|s| !s.is_empty());
            let subject = Subject {
                gvk: &input.gvk,
                operation: Operation::Create,
                namespace: Some(&input.namespace),
                name,
                namespace_labels: Some(labels.get(&input.namespace).unwrap_or(&none)),
                // As at admission: a CREATE whose initium.dev/mutated-by lists a rule (copied
                // from a mutated object) ran it earlier in this request, and it is skipped.
                ran_before: RanBefore::Listed {
                    stored: None,
                    stored_template: None,
                },
                lookups: None,
            };
            index.evaluate(&subject, object.clone(), None)
        };
        let mut verdict = Offline {
            matched: Vec::new(),
            applied: Vec::new(),
            skipped: Vec::new(),
            admitted: Stored::Refused(String::new()),
            written: Stored::Refused(String::new()),
        };
        match apply(&input.object) {
            Ok(outcome) => as_written.push((i, outcome.object)),
            Err(denial) => {
                verdict.written = Stored::Refused(format!("denied offline: {}", denial.message));
            }
        }
        match &admitted[&i] {
            Stored::Refused(message) => verdict.admitted = Stored::Refused(message.clone()),
            Stored::Object(object) => match apply(object) {
                Ok(outcome) => {
                    verdict.matched = names(&outcome.matched);
                    verdict.applied = names(&outcome.applied);
                    verdict.skipped = names(&outcome.skipped);
                    as_admitted.push((i, outcome.object));
                }
                Err(denial) => {
                    verdict.matched = vec![denial.rule.describe()];
                    verdict.admitted =
                        Stored::Refused(format!("denied offline: {}", denial.message));
                }
            },
        }
        verdicts.insert(i, verdict);
    }
    for (i, stored) in dry_run_all(client, inputs, as_written).await {
        verdicts.get_mut(&i).unwrap().written = stored;
    }
    for (i, stored) in dry_run_all(client, inputs, as_admitted).await {
        verdicts.get_mut(&i).unwrap().admitted = stored;
    }
    verdicts
}

/// Dry-runs the round's objects; those that differ from `expected` once more a second later
/// (a transient failure is not a mismatch; what is installed acts already, by the sentinel).
async fn dry_run_round(
    client: &kube::Client,
    inputs: &[Input],
    round: &Round,
    expected: impl Fn(usize) -> Stored,
) -> HashMap<usize, Stored> {
    let bodies = round
        .inputs
        .iter()
        .map(|&i| (i, inputs[i].object.clone()))
        .collect();
    let mut results = dry_run_all(client, inputs, bodies).await;
    let differing: Vec<(usize, Value)> = results
        .iter()
        .filter(|(i, s)| !s.same(&expected(**i)))
        .map(|(i, _)| (*i, inputs[*i].object.clone()))
        .collect();
    if !differing.is_empty() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        results.extend(dry_run_all(client, inputs, differing).await);
    }
    results
}

/// Runs one round (C and C′ computed already): A with initium, then B with the policies;
/// compares.
async fn run_round(
    env: &Env,
    inputs: &[Input],
    round: &Round,
    c: &HashMap<usize, Offline>,
    tally: &mut Tally,
) {
    let client = &env.client;
    let started = Instant::now();
    let mut times = Vec::new();
    let mut mark =
        |what: &str| times.push(format!("{what} {:.1}s", started.elapsed().as_secs_f64()));
    // Its own namespace for each initium: no waiting for the previous one's lease.
    let initium_namespace = unique("initium");
    let settings = settings(&initium_namespace);
    let sentinel = sentinel_rule(&env.sentinel);
    let mut sources: Vec<&RuleSource> = round.rules.iter().map(|(_, s)| s).collect();
    sources.push(&sentinel.1);
    let generated: Vec<policy::Generated> = compiled(&sources, &settings)
        .into_iter()
        .zip(&sources)
        .map(|(g, s)| {
            g.unwrap_or_else(|| panic!("{} is not compiled in its round", s.id.describe()))
        })
        .collect();
    let mut leftovers = Leftovers {
        plane: env.plane,
        sentinel: env.sentinel.clone(),
        rules: sources.iter().map(|s| s.id.clone()).collect(),
    };

    // A: the webhook. The sentinel rule comes once every other rule is Ready.
    create_rules(client, &round.rules).await;
    let log = std::env::temp_dir().join(format!("{initium_namespace}.log"));
    let mut initium = Initium::start(
        env.plane,
        InitiumOptions {
            namespace: initium_namespace.clone(),
            extra: vec!["--compile-rules".into(), "off".into()],
            cpus: None,
            log,
        },
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    wait_ready(client, &round.rules).await;
    mark("rules Ready");
    create_rules(client, std::slice::from_ref(&sentinel)).await;
    wait_ready(client, std::slice::from_ref(&sentinel)).await;
    wait_sentinel(client, &env.sentinel, true, "the webhook").await;
    mark("webhook acts");
    let a = dry_run_round(client, inputs, round, |i| c[&i].admitted.clone()).await;
    mark("A");

    // B: the policies, initium gone. The sentinel's policy and binding come last.
    initium.kill();
    for kind in [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ] {
        let _ = admission_api(client, kind)
            .delete(OWNER, &DeleteParams::default())
            .await;
    }
    let (last, others) = generated.split_last().unwrap();
    let described: Vec<String> = sources.iter().map(|s| s.id.describe()).collect();
    let mut refused = Vec::new();
    for kind in ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"] {
        let pick = |g: &policy::Generated| {
            if kind == "MutatingAdmissionPolicy" {
                g.policy.clone()
            } else {
                g.binding.clone()
            }
        };
        let objects = others
            .iter()
            .zip(&described)
            .map(|(g, rule)| (rule.clone(), pick(g)))
            .collect();
        refused.extend(create_all(&admission_api(client, kind), objects).await);
    }
    mark("policies created");
    for kind in ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"] {
        let object = if kind == "MutatingAdmissionPolicy" {
            last.policy.clone()
        } else {
            last.binding.clone()
        };
        let failed = create_all(
            &admission_api(client, kind),
            vec![("sentinel".into(), object)],
        )
        .await;
        assert!(failed.is_empty(), "the sentinel's policy: {failed:?}");
    }
    wait_sentinel(client, &env.sentinel, true, "the policies").await;
    mark("policies act");
    let b = dry_run_round(client, inputs, round, |i| a[&i].clone()).await;
    mark("B");

    // Compare.
    let refused_rules: BTreeSet<String> = refused.iter().map(|(r, _)| r.clone()).collect();
    tally.refused_policies.extend(refused);
    for &i in &round.inputs {
        let offline = &c[&i];
        tally.compared += 1;
        if !offline.applied.is_empty() {
            tally.changed += 1;
        }
        if let Stored::Refused(why) = &a[&i] {
            tally.refused += 1;
            if tally.refusals.len() < 5 {
                let why: String = why.chars().take(240).collect();
                tally.refusals.push(format!("{}: {why}", inputs[i].origin));
            }
        }
        if offline.matched.iter().any(|r| refused_rules.contains(r)) {
            continue; // reported with the refused policies
        }
        let rules = if offline.matched.is_empty() {
            vec!["(no rule matched offline)".into()]
        } else {
            offline.matched.clone()
        };
        for (paths, fails, left, right) in [
            ("A (webhook) vs B (policy)", true, &a[&i], &b[&i]),
            (
                "A (webhook) vs C′ (apply on the object as admitted)",
                true,
                &a[&i],
                &offline.admitted,
            ),
            (
                "A (webhook) vs C (apply on the object as written)",
                false,
                &a[&i],
                &offline.written,
            ),
        ] {
            if !left.same(right) {
                tally.mismatches.push(Mismatch {
                    round: round.name.clone(),
                    paths,
                    fails,
                    rules: rules.clone(),
                    input: i,
                    diff: diff_stored(left, right),
                });
            }
        }
    }

    leftovers.clean(client).await;
    mark("clean");
    tally.rounds += 1;
    tally.rules += round.rules.len();
    eprintln!(
        "compiled: round {}: {} rules, {} objects: {}",
        round.name,
        round.rules.len(),
        round.inputs.len(),
        times.join(", ")
    );
}

/// Runs the rounds, reports, and fails on every difference of A, B and C′.
async fn run(env: &Env, label: &str, inputs: &[Input], rounds: &[Round]) {
    let started = Instant::now();
    let labels = namespace_labels(&env.client).await;
    // C and C′ for every round first, while nothing is installed.
    let mut offline_results = Vec::new();
    for round in rounds {
        offline_results.push(offline(&env.client, inputs, round, &labels).await);
    }
    eprintln!(
        "compiled: {label}: offline paths in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let mut tally = Tally::default();
    for (round, c) in rounds.iter().zip(&offline_results) {
        run_round(env, inputs, round, c, &mut tally).await;
    }
    let failing = tally.mismatches.iter().filter(|m| m.fails).count();
    eprintln!(
        "compiled: {label}: {} rounds, {} compiled rules, {} objects compared ({} changed by a rule, {} refused by the API server): {} differences that fail, {} reported only, {} policies refused, in {:.1}s",
        tally.rounds,
        tally.rules,
        tally.compared,
        tally.changed,
        tally.refused,
        failing,
        tally.mismatches.len() - failing,
        tally.refused_policies.len(),
        started.elapsed().as_secs_f64()
    );
    for why in &tally.refusals {
        eprintln!("compiled: {label}: refused by the API server (on every path): {why}");
    }

    let mut head = String::new();
    for (rule, message) in &tally.refused_policies {
        let _ = writeln!(
            head,
            "the API server refused the policy of {rule}: {message}"
        );
    }
    let mut by_paths: BTreeMap<(bool, &str), usize> = BTreeMap::new();
    for m in &tally.mismatches {
        *by_paths.entry((!m.fails, m.paths)).or_default() += 1;
    }
    for ((reported, paths), n) in &by_paths {
        let _ = writeln!(
            head,
            "{n} objects: {paths} differ{}",
            if *reported {
                " (reported, not failed)"
            } else {
                ""
            }
        );
    }
    let rules_by_id: HashMap<String, &Value> = rounds
        .iter()
        .flat_map(|r| &r.rules)
        .map(|(doc, s)| (s.id.describe(), doc))
        .collect();
    let entry = |m: &Mismatch| {
        let input = &inputs[m.input];
        let mut entry = format!(
            "\n{}: {} differ for {}\n  rules: {}\n{}\n",
            m.round,
            m.paths,
            describe(input),
            m.rules.join(", "),
            m.diff
        );
        for rule in &m.rules {
            if let Some(doc) = rules_by_id.get(rule) {
                let _ = writeln!(entry, "  {rule}: {}", short_long(&doc["spec"]));
            }
        }
        let _ = writeln!(entry, "  object: {}", short_long(&input.object));
        entry
    };
    let (failing, reported): (Vec<&Mismatch>, Vec<&Mismatch>) =
        tally.mismatches.iter().partition(|m| m.fails);
    let failing: Vec<String> = failing.into_iter().map(entry).collect();
    let reported: Vec<String> = reported.into_iter().map(entry).collect();
    let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("compiled-{label}.txt"));
    let _ = std::fs::write(
        &file,
        format!("{head}{}{}", failing.concat(), reported.concat()),
    );
    if !reported.is_empty() {
        eprintln!(
            "compiled: {label}: {} differences of C (apply on the object as written), reported only; e.g.:{}\n(all in {})",
            reported.len(),
            reported.iter().take(2).cloned().collect::<String>(),
            file.display()
        );
    }
    if failing.is_empty() && tally.refused_policies.is_empty() {
        return;
    }
    let shown: String = failing.iter().take(12).cloned().collect();
    panic!(
        "{label}: the paths disagree (every difference: {})\n{head}{shown}{}",
        file.display(),
        if failing.len() > 12 {
            format!("\n... and {} more", failing.len() - 12)
        } else {
            String::new()
        }
    );
}

/// The plane, ready for rules, with the sentinel's namespace; `None` (the test passes, saying
/// why) before Kubernetes 1.36.
async fn setup() -> Option<Env> {
    let plane = Plane::shared();
    plane.install_crds().unwrap();
    let client = plane.client().await.unwrap();
    if !serves_policies(&client).await {
        eprintln!(
            "compiled: the API server serves no MutatingAdmissionPolicy v1 (before Kubernetes 1.36): nothing to compare"
        );
        return None;
    }
    let sentinel = unique("sentinel");
    ensure_namespaces(&client, [(sentinel.clone(), Value::Null)].into()).await;
    Some(Env {
        plane,
        client,
        sentinel,
    })
}

// -------------------------------------------------------------------------------------------
// The tests

#[tokio::test]
async fn example_rules_compiled_store_what_the_webhook_and_apply_store() {
    let _serial = serial().await;
    let Some(env) = setup().await else {
        return;
    };
    let client = &env.client;
    // Which rules compile depends on the settings only through names: any initium namespace
    // gives the same rounds.
    let settings = settings("initium");
    let root = support::root().join("examples");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("rules.yaml").exists())
        .collect();
    dirs.sort();

    // The rules that compile in their own file, and every example object.
    let mut candidates: Vec<(Value, RuleSource)> = Vec::new();
    let mut total = 0;
    let mut objects: Vec<(String, Value)> = Vec::new();
    let mut namespaces: BTreeMap<String, Value> = BTreeMap::new();
    for dir in &dirs {
        let example = dir.file_name().unwrap().to_string_lossy().to_string();
        let sources: Vec<(Value, RuleSource)> = documents(&dir.join("rules.yaml"))
            .into_iter()
            .map(|doc| {
                let source = parse_rule(&doc, "default").unwrap();
                (doc, source)
            })
            .collect();
        total += sources.len();
        // Each rule that compiles alone (in its file an earlier rule may keep it on the webhook,
        // which says nothing about its compiled form); rounds are made of rules that compile
        // together below.
        let plan: Vec<_> = sources
            .iter()
            .map(|(_, s)| compiled(&[s], &settings).pop().flatten())
            .collect();
        candidates.extend(
            sources
                .into_iter()
                .zip(plan)
                .filter(|(_, g)| g.is_some())
                .map(|(rule, _)| rule),
        );
        for (n, doc) in documents(&dir.join("objects.yaml")).into_iter().enumerate() {
            let origin = format!("examples/{example}/objects.yaml#{}", n + 1);
            if doc["kind"] == "Namespace" {
                let name = doc["metadata"]["name"].as_str().unwrap().to_string();
                namespaces.insert(name, doc["metadata"]["labels"].clone());
                continue;
            }
            let ns = doc["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string();
            namespaces.entry(ns).or_insert(Value::Null);
            objects.push((origin, doc));
        }
    }
    ensure_namespaces(client, namespaces).await;
    let kinds = Kinds::new(client).await;
    let inputs: Vec<Input> = objects
        .into_iter()
        .filter_map(|(origin, doc)| {
            let ns = doc["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string();
            kinds.input(origin, &ns, doc)
        })
        .collect();

    // Rounds: each rule joins the first round that still compiles whole with it.
    let mut rounds: Vec<Round> = Vec::new();
    for (doc, source) in candidates {
        let fits = |round: &Round| {
            let mut all: Vec<&RuleSource> = round.rules.iter().map(|(_, s)| s).collect();
            all.push(&source);
            compiled(&all, &settings).iter().all(Option::is_some)
        };
        match rounds.iter().position(fits) {
            Some(r) => rounds[r].rules.push((doc, source)),
            None => rounds.push(Round {
                name: String::new(),
                rules: vec![(doc, source)],
                inputs: (0..inputs.len()).collect(),
            }),
        }
    }
    for round in &mut rounds {
        let names: Vec<String> = round.rules.iter().map(|(_, s)| s.id.to_string()).collect();
        round.name = format!("examples [{}]", names.join(", "));
    }
    eprintln!(
        "compiled: examples: {} rules in {} files, {} compile alone, in {} rounds; {} objects",
        total,
        dirs.len(),
        rounds.iter().map(|r| r.rules.len()).sum::<usize>(),
        rounds.len(),
        inputs.len()
    );
    assert!(!rounds.is_empty(), "no example rule compiles");
    run(&env, "examples", &inputs, &rounds).await;
}

#[tokio::test]
async fn fuzzed_rules_compiled_store_what_the_webhook_and_apply_store() {
    let _serial = serial().await;
    let Some(env) = setup().await else {
        return;
    };
    let client = &env.client;
    let settings = settings("initium");
    let prefix = unique("cmp");

    // The rules, each a MutationRule in a namespace of its own.
    let mut valid: Vec<(Value, RuleSource, Rng, bool)> = Vec::new();
    let mut plain_valid = 0;
    for index in 0..FUZZ_RULES {
        let mut rng = Rng::new(Rng::case_seed(FUZZ_SEED, index as u64));
        let plain = index.is_multiple_of(PLAIN_EVERY);
        let mut doc = if plain {
            generate::rule(&mut rng, index)
        } else {
            generate::compilable_rule(&mut rng, index)
        };
        if !doc.is_object() || !doc["metadata"].is_object() {
            continue;
        }
        doc["kind"] = json!("MutationRule");
        doc["metadata"]["namespace"] = json!(format!("{prefix}-{index}"));
        let Ok(source) = parse_rule(&doc, "default") else {
            continue;
        };
        if compile(source.id.clone(), &source.spec).is_err() {
            continue;
        }
        if plain {
            plain_valid += 1;
        }
        valid.push((doc, source, rng, plain));
    }
    let refs: Vec<&RuleSource> = valid.iter().map(|(_, s, _, _)| s).collect();
    let plan = compiled(&refs, &settings);
    let chosen: Vec<(Value, RuleSource, Rng, bool)> = valid
        .into_iter()
        .zip(&plan)
        .filter(|(_, g)| g.is_some())
        .map(|(rule, _)| rule)
        .collect();
    let plain_compiled = chosen.iter().filter(|(_, _, _, plain)| *plain).count();
    let for_each_compiled = chosen
        .iter()
        .filter(|(doc, _, _, _)| {
            doc["spec"]["mutations"]
                .as_array()
                .is_some_and(|m| m.iter().any(|m| m.get("forEach").is_some()))
        })
        .count();

    // Their namespaces, and objects in each.
    ensure_namespaces(
        client,
        chosen
            .iter()
            .map(|(_, s, _, _)| (s.id.namespace.as_deref().unwrap().to_string(), Value::Null))
            .collect(),
    )
    .await;
    let kinds = Kinds::new(client).await;
    let mut inputs = Vec::new();
    let mut unusable = 0;
    let mut rules = Vec::new();
    for (doc, source, mut rng, _) in chosen {
        let ns = source.id.namespace.as_deref().unwrap().to_string();
        let written = source.id.written();
        for n in 0..FUZZ_OBJECTS {
            let object = if n < FUZZ_PLAIN_OBJECTS {
                generate::object(&mut rng)
            } else {
                generate::compilable_object(&mut rng, &written)
            };
            let origin = format!("rule {written}, object {n}");
            match kinds.input(origin, &ns, object) {
                Some(input) => inputs.push(input),
                None => unusable += 1,
            }
        }
        rules.push((doc, source));
    }
    eprintln!(
        "compiled: fuzz: {FUZZ_RULES} rules (1 in {PLAIN_EVERY} from `rule`, the rest from `compilable_rule`): {} valid ({} plain), {} compiled ({} plain, {} with a forEach); {} objects ({} of kinds not served or not namespaced left out)",
        plan.len(),
        plain_valid,
        rules.len(),
        plain_compiled,
        for_each_compiled,
        inputs.len(),
        unusable
    );
    assert!(
        rules.len() >= 100,
        "only {} of {FUZZ_RULES} fuzzed rules compile",
        rules.len()
    );
    let rounds = [Round {
        name: "fuzz".into(),
        rules,
        inputs: (0..inputs.len()).collect(),
    }];
    run(&env, "fuzz", &inputs, &rounds).await;
}
