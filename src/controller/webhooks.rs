//! The webhook configurations initium owns: which requests the API server sends it.
//!
//! - MutatingWebhookConfiguration `initium` (configurable) with up to two webhooks:
//!   `fail.initium.dev` for what rules with `failurePolicy: Fail` need, `ignore.initium.dev`
//!   for what only `Ignore` rules need. `/mutate` evaluates every rule whichever webhook
//!   called it; the webhook only decides what the API server does when initium cannot answer
//!   (reject, or admit unchanged). A resource and operation needed by both kinds of rule is
//!   therefore listed under `fail.initium.dev` only, so no request is sent twice.
//!   A webhook with nothing to intercept is left out; with no Ready rules the configuration
//!   exists with no webhooks and intercepts nothing.
//! - ValidatingWebhookConfiguration `initium` with `rules.initium.dev`: CREATE and UPDATE of
//!   both rule kinds go to `/validate` (failure policy from the configuration, default Fail).
//!
//! Kind patterns are expanded with discovery to explicit resources (never `*`), without
//! subresources and without anything in [`NEVER_INTERCEPTED`](super::discovery::NEVER_INTERCEPTED);
//! MutationRules only ever contribute namespaced resources. Requests from initium's own
//! namespace and the excluded namespaces are never sent (`namespaceSelector` on
//! `kubernetes.io/metadata.name`).
//!
//! Only the Lease holder writes, with server-side apply (field manager `initium`), and only
//! when the configuration on the API server differs from the desired one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations,
    ServiceReference, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::discovery::Served;
use super::duty::{Context, Duty};
use super::vocabulary::{ControllerError, FIELD_MANAGER, Leader};
use crate::admission::{MUTATE_PATH, VALIDATE_PATH};
use crate::report::report;
use initium_engine::api::{FailurePolicy, GROUP, Operation, VERSION};
use initium_engine::{CompiledRule, KindPattern};

/// Name of the webhook for rules with `failurePolicy: Fail`.
pub const FAIL_WEBHOOK: &str = "fail.initium.dev";
/// Name of the webhook for rules with `failurePolicy: Ignore`.
pub const IGNORE_WEBHOOK: &str = "ignore.initium.dev";
/// Name of the validating webhook for the rules themselves.
pub const RULES_WEBHOOK: &str = "rules.initium.dev";
/// Timeout of the validating webhook. Compiling a rule takes microseconds; rule changes are
/// not on any workload's path, so there is no reason to cut a slow connection short.
pub const VALIDATE_TIMEOUT_SECONDS: i32 = 10;
/// The label every namespace carries with its own name (Kubernetes 1.21+).
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";
/// First retry after applying the configurations failed; the wait doubles up to
/// [`RETRY_MAX`] (and never exceeds the resync interval).
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(32);

/// Where the API server reaches initium.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WebhookEndpoint {
    /// In-cluster: the Service in front of the replicas.
    Service {
        name: String,
        namespace: String,
        port: u16,
    },
    /// Out-of-cluster: a base URL such as `https://127.0.0.1:8443` (HTTPS; no query, fragment
    /// or user info). `/mutate` and `/validate` are appended.
    Url(String),
}

impl WebhookEndpoint {
    pub(crate) fn validate(&self) -> Result<(), ControllerError> {
        let fail = |m: String| Err(ControllerError::Config(m));
        match self {
            WebhookEndpoint::Service {
                name,
                namespace,
                port,
            } => {
                if name.is_empty() || namespace.is_empty() {
                    return fail("the webhook Service needs a name and a namespace".into());
                }
                if *port == 0 {
                    return fail("the webhook Service port must not be 0".into());
                }
                Ok(())
            }
            WebhookEndpoint::Url(url) => {
                if !url.starts_with("https://") {
                    return fail(format!(
                        "webhook URL {url:?} must start with https:// (the API server only calls webhooks over HTTPS)"
                    ));
                }
                if url.contains(['?', '#', '@']) {
                    return fail(format!(
                        "webhook URL {url:?} may not have a query, a fragment or user info"
                    ));
                }
                match url_host(url) {
                    Some(host) if !host.is_empty() => Ok(()),
                    _ => fail(format!("webhook URL {url:?} has no host")),
                }
            }
        }
    }

    /// The names the serving certificate must carry: for a Service
    /// `<name>.<namespace>.svc` (what the API server checks) and
    /// `<name>.<namespace>.svc.cluster.local`; for a URL its host (an IP address becomes an
    /// IP SAN).
    pub fn certificate_names(&self) -> Vec<String> {
        match self {
            WebhookEndpoint::Service {
                name, namespace, ..
            } => vec![
                format!("{name}.{namespace}.svc"),
                format!("{name}.{namespace}.svc.cluster.local"),
            ],
            WebhookEndpoint::Url(url) => url_host(url).map(str::to_string).into_iter().collect(),
        }
    }

    fn client_config(&self, path: &str, ca_bundle: Option<&[u8]>) -> WebhookClientConfig {
        let ca_bundle = ca_bundle.map(|pem| ByteString(pem.to_vec()));
        match self {
            WebhookEndpoint::Service {
                name,
                namespace,
                port,
            } => WebhookClientConfig {
                ca_bundle,
                service: Some(ServiceReference {
                    name: name.clone(),
                    namespace: namespace.clone(),
                    path: Some(path.into()),
                    port: Some((*port).into()),
                }),
                url: None,
            },
            WebhookEndpoint::Url(url) => WebhookClientConfig {
                ca_bundle,
                service: None,
                url: Some(format!("{}{path}", url.trim_end_matches('/'))),
            },
        }
    }
}

/// The host of an `https://` URL, without brackets for IPv6.
fn url_host(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("https://")?;
    let authority = rest.split('/').next()?;
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next();
    }
    authority.split(':').next()
}

/// The webhook timeout for a latency budget: twice the budget, rounded up to whole seconds,
/// at least 1 s and at most 30 s (the most Kubernetes allows). Twice, so a request that
/// waited for a connection still gets its full budget and an answer.
pub fn webhook_timeout_seconds(budget: Duration) -> i32 {
    let millis = budget.as_millis().saturating_mul(2).div_ceil(1000);
    i32::try_from(millis).unwrap_or(i32::MAX).clamp(1, 30)
}

/// What one Ready rule needs intercepted.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleNeeds {
    pub kinds: Vec<KindPattern>,
    pub operations: Vec<Operation>,
    pub failure_policy: FailurePolicy,
    /// A MutationRule: only namespaced objects of its namespace. (A ClusterMutationRule
    /// limited to namespaces also gets Namespace objects, by their own name.)
    pub namespaced_only: bool,
    /// The namespaces the rule is limited to, when they are known names (a MutationRule's
    /// own namespace, or a ClusterMutationRule's literal `namespaces`); `None`: any.
    pub namespaces: Option<Vec<String>>,
}

impl RuleNeeds {
    pub fn of(rule: &CompiledRule) -> RuleNeeds {
        let namespaces = match &rule.id.namespace {
            Some(ns) => Some(vec![ns.to_string()]),
            None => rule.literal_namespaces(),
        };
        RuleNeeds {
            kinds: rule.kinds().to_vec(),
            operations: rule.operations().to_vec(),
            failure_policy: rule.failure_policy,
            namespaced_only: rule.id.namespace.is_some(),
            namespaces,
        }
    }
}

/// What the webhook configuration is derived from: the Ready rules and discovery.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Inputs {
    pub rules: Vec<RuleNeeds>,
    pub served: Option<Arc<Served>>,
}

/// `(group, version, resource)` → operations.
type Coverage = BTreeMap<(String, String, String), BTreeSet<Operation>>;

fn coverage(rules: &[RuleNeeds], served: &Served, policy: FailurePolicy) -> Coverage {
    let mut coverage = Coverage::new();
    for rule in rules.iter().filter(|r| r.failure_policy == policy) {
        for pattern in &rule.kinds {
            for resource in served.matching(pattern) {
                // A rule limited to namespaces never applies to cluster-scoped objects,
                // except a ClusterMutationRule to Namespace objects (by their own name).
                let namespace_object =
                    resource.gvk.group.is_empty() && resource.gvk.kind == "Namespace";
                let cluster_scoped_excluded =
                    rule.namespaced_only || (rule.namespaces.is_some() && !namespace_object);
                if resource.never_intercepted().is_some()
                    || (!resource.namespaced && cluster_scoped_excluded)
                {
                    continue;
                }
                let operations: BTreeSet<Operation> = rule
                    .operations
                    .iter()
                    .copied()
                    .filter(|op| match op {
                        Operation::Create => resource.create,
                        Operation::Update => resource.update,
                    })
                    .collect();
                if operations.is_empty() {
                    continue;
                }
                coverage
                    .entry((
                        resource.gvk.group.clone(),
                        resource.gvk.version.clone(),
                        resource.plural.clone(),
                    ))
                    .or_default()
                    .extend(operations);
            }
        }
    }
    coverage
}

/// Webhook rules for a coverage: one entry per group, version and set of operations, with
/// the resources listed explicitly and sorted.
fn webhook_rules(coverage: &Coverage) -> Vec<RuleWithOperations> {
    let mut grouped: BTreeMap<(&str, &str, Vec<Operation>), Vec<String>> = BTreeMap::new();
    for ((group, version, resource), operations) in coverage {
        grouped
            .entry((group, version, operations.iter().copied().collect()))
            .or_default()
            .push(resource.clone());
    }
    grouped
        .into_iter()
        .map(
            |((group, version, operations), resources)| RuleWithOperations {
                api_groups: Some(vec![group.to_string()]),
                api_versions: Some(vec![version.to_string()]),
                operations: Some(operations.iter().map(|o| o.as_str().to_string()).collect()),
                resources: Some(resources),
                scope: Some("*".into()),
            },
        )
        .collect()
}

/// What the two webhook configurations are made of besides the rules: the part of the
/// controller's configuration this duty reads (`ControllerConfig::webhook_settings`).
#[derive(Clone, Debug)]
pub struct WebhookSettings {
    /// initium's own namespace: its objects are never sent.
    pub namespace: String,
    /// Where the API server sends admission requests.
    pub endpoint: WebhookEndpoint,
    /// Namespaces whose objects are never sent, besides initium's own.
    pub excluded_namespaces: Vec<String>,
    /// Name of the MutatingWebhookConfiguration and of the ValidatingWebhookConfiguration.
    pub webhook_configuration: String,
    /// What the API server does with a rule when initium cannot validate it.
    pub rule_validation_policy: FailurePolicy,
    /// How often the stored configurations are compared even when nothing changed.
    pub resync_interval: Duration,
}

/// Namespaces whose requests are never sent: initium's own and the excluded ones, sorted.
fn excluded_namespaces(config: &WebhookSettings) -> Vec<String> {
    let mut names: BTreeSet<String> = config.excluded_namespaces.iter().cloned().collect();
    names.insert(config.namespace.clone());
    names.retain(|n| !n.is_empty());
    names.into_iter().collect()
}

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "initium".to_string()),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "initium".to_string(),
        ),
    ])
}

/// The MutatingWebhookConfiguration for the Ready rules. Every field the API server would
/// default is set, so the result compares equal to what the API server stores.
pub fn desired_mutating(
    config: &WebhookSettings,
    budget: Duration,
    ca_bundle: Option<&[u8]>,
    rules: &[RuleNeeds],
    served: &Served,
) -> MutatingWebhookConfiguration {
    let fail = coverage(rules, served, FailurePolicy::Fail);
    let mut ignore = coverage(rules, served, FailurePolicy::Ignore);
    // While initium is down, `fail.initium.dev` rejects what it covers. A namespace owner's
    // Fail rule must not make that happen in every namespace, so when every Fail rule is
    // limited to known namespaces the webhook covers only those, and `ignore.initium.dev`
    // gets a match condition that leaves out exactly the requests `fail.initium.dev` takes
    // (those namespaces, those resources and operations): every request reaches initium
    // once, which is both cheaper for the API server and what `/mutate` expects (it
    // evaluates every rule, Fail and Ignore alike, whichever webhook called it). When some
    // Fail rule may apply anywhere, the Fail webhook covers everything it needs and the
    // Ignore webhook drops those resources and operations.
    let fail_namespaces: Option<BTreeSet<String>> = rules
        .iter()
        .filter(|r| r.failure_policy == FailurePolicy::Fail)
        .try_fold(BTreeSet::new(), |mut all, r| {
            all.extend(r.namespaces.clone()?);
            Some(all)
        });
    let mut ignore_conditions = None;
    match &fail_namespaces {
        None => {
            for (resource, operations) in &fail {
                if let Some(ignored) = ignore.get_mut(resource) {
                    ignored.retain(|op| !operations.contains(op));
                }
            }
        }
        Some(namespaces) => {
            ignore_conditions = not_sent_to_fail_webhook(namespaces, &fail, &ignore);
        }
    }
    ignore.retain(|_, operations| !operations.is_empty());

    let excluded = LabelSelectorRequirement {
        key: NAMESPACE_NAME_LABEL.into(),
        operator: "NotIn".into(),
        values: Some(excluded_namespaces(config)),
    };
    let namespace_selector = LabelSelector {
        match_expressions: Some(vec![excluded.clone()]),
        match_labels: None,
    };
    let fail_selector = match &fail_namespaces {
        None => namespace_selector.clone(),
        Some(names) => LabelSelector {
            match_expressions: Some(vec![
                LabelSelectorRequirement {
                    key: NAMESPACE_NAME_LABEL.into(),
                    operator: "In".into(),
                    values: Some(names.iter().cloned().collect()),
                },
                excluded,
            ]),
            match_labels: None,
        },
    };
    let webhook =
        |name: &str,
         policy: FailurePolicy,
         coverage: &Coverage,
         namespace_selector: &LabelSelector,
         match_conditions: Option<Vec<MatchCondition>>| MutatingWebhook {
            name: name.into(),
            admission_review_versions: vec!["v1".into()],
            client_config: config.endpoint.client_config(MUTATE_PATH, ca_bundle),
            failure_policy: Some(policy_name(policy).into()),
            match_conditions,
            match_policy: Some("Equivalent".into()),
            namespace_selector: Some(namespace_selector.clone()),
            object_selector: Some(LabelSelector::default()),
            reinvocation_policy: Some("IfNeeded".into()),
            rules: Some(webhook_rules(coverage)),
            side_effects: "None".into(),
            timeout_seconds: Some(webhook_timeout_seconds(budget)),
        };
    let mut webhooks = Vec::new();
    if !fail.is_empty() {
        webhooks.push(webhook(
            FAIL_WEBHOOK,
            FailurePolicy::Fail,
            &fail,
            &fail_selector,
            None,
        ));
    }
    if !ignore.is_empty() {
        webhooks.push(webhook(
            IGNORE_WEBHOOK,
            FailurePolicy::Ignore,
            &ignore,
            &namespace_selector,
            ignore_conditions,
        ));
    }
    MutatingWebhookConfiguration {
        metadata: ObjectMeta {
            name: Some(config.webhook_configuration.clone()),
            labels: Some(labels()),
            ..ObjectMeta::default()
        },
        webhooks: Some(webhooks),
    }
}

/// Name of the match condition that keeps `ignore.initium.dev` from the requests
/// `fail.initium.dev` already takes.
pub const NOT_SENT_TO_FAIL_WEBHOOK: &str = "not-sent-to-fail.initium.dev";

/// The match condition for `ignore.initium.dev` when `fail.initium.dev` covers only
/// `namespaces`: false for a request in one of them whose resource and operation both
/// webhooks cover. `None` when the two do not overlap. The API server evaluates it in CEL
/// before calling; names and groups are DNS names, so quoting them needs no escaping.
fn not_sent_to_fail_webhook(
    namespaces: &BTreeSet<String>,
    fail: &Coverage,
    ignore: &Coverage,
) -> Option<Vec<MatchCondition>> {
    let mut both: Vec<String> = Vec::new();
    for ((group, _version, resource), operations) in ignore {
        let covered = fail
            .iter()
            .filter(|((g, _, r), _)| g == group && r == resource)
            .flat_map(|(_, ops)| ops.iter());
        for op in covered.filter(|op| operations.contains(op)) {
            let key = format!("'{group}/{resource}/{}'", op.as_str());
            if !both.contains(&key) {
                both.push(key);
            }
        }
    }
    if both.is_empty() || namespaces.is_empty() {
        return None;
    }
    both.sort();
    let namespaces: Vec<String> = namespaces.iter().map(|n| format!("'{n}'")).collect();
    Some(vec![MatchCondition {
        name: NOT_SENT_TO_FAIL_WEBHOOK.into(),
        expression: format!(
            "!(request.namespace in [{}] && request.resource.group + '/' + request.resource.resource + '/' + request.operation in [{}])",
            namespaces.join(", "),
            both.join(", ")
        ),
    }])
}

/// The ValidatingWebhookConfiguration that sends every rule to `/validate`. Rules in every
/// namespace are validated, initium's own and excluded namespaces included: validating a
/// rule changes nothing, and a rule there is harmless anyway (its objects are never sent).
pub fn desired_validating(
    config: &WebhookSettings,
    ca_bundle: Option<&[u8]>,
) -> ValidatingWebhookConfiguration {
    ValidatingWebhookConfiguration {
        metadata: ObjectMeta {
            name: Some(config.webhook_configuration.clone()),
            labels: Some(labels()),
            ..ObjectMeta::default()
        },
        webhooks: Some(vec![ValidatingWebhook {
            name: RULES_WEBHOOK.into(),
            admission_review_versions: vec!["v1".into()],
            client_config: config.endpoint.client_config(VALIDATE_PATH, ca_bundle),
            failure_policy: Some(policy_name(config.rule_validation_policy).into()),
            match_conditions: None,
            match_policy: Some("Equivalent".into()),
            namespace_selector: Some(LabelSelector::default()),
            object_selector: Some(LabelSelector::default()),
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec![GROUP.into()]),
                api_versions: Some(vec![VERSION.into()]),
                operations: Some(vec!["CREATE".into(), "UPDATE".into()]),
                resources: Some(vec!["clustermutationrules".into(), "mutationrules".into()]),
                scope: Some("*".into()),
            }]),
            side_effects: "None".into(),
            timeout_seconds: Some(VALIDATE_TIMEOUT_SECONDS),
        }]),
    }
}

fn policy_name(policy: FailurePolicy) -> &'static str {
    match policy {
        FailurePolicy::Fail => "Fail",
        FailurePolicy::Ignore => "Ignore",
    }
}

/// A MutatingWebhookConfiguration or ValidatingWebhookConfiguration: the parts initium
/// owns, to compare the desired configuration with the API server's.
pub trait WebhookConfiguration {
    /// The webhooks as JSON; see [`up_to_date`].
    fn webhooks_json(&self, keep_ca_bundle_of: Option<&Self>) -> serde_json::Value;
    fn labels(&self) -> Option<&BTreeMap<String, String>>;
}

macro_rules! owned {
    ($configuration:ty) => {
        impl WebhookConfiguration for $configuration {
            /// The webhooks as JSON (`None` and `[]` alike). Where a desired webhook has no
            /// caBundle (someone else manages it), the actual one's is taken over, so it
            /// does not count as a difference.
            fn webhooks_json(&self, keep_ca_bundle_of: Option<&Self>) -> serde_json::Value {
                let mut webhooks = self.webhooks.clone().unwrap_or_default();
                if let Some(actual) = keep_ca_bundle_of {
                    for webhook in &mut webhooks {
                        if webhook.client_config.ca_bundle.is_none() {
                            webhook.client_config.ca_bundle = actual
                                .webhooks
                                .iter()
                                .flatten()
                                .find(|w| w.name == webhook.name)
                                .and_then(|w| w.client_config.ca_bundle.clone());
                        }
                    }
                }
                serde_json::to_value(webhooks).unwrap_or_default()
            }

            fn labels(&self) -> Option<&BTreeMap<String, String>> {
                self.metadata.labels.as_ref()
            }
        }
    };
}

owned!(MutatingWebhookConfiguration);
owned!(ValidatingWebhookConfiguration);

/// Whether `actual` (as the API server stores it) already is `desired`: same webhooks (a
/// caBundle initium does not manage is ignored) and `desired`'s labels present. Everything
/// the API server defaults is set in the desired configurations, so a stored configuration
/// compares equal to the one applied.
pub fn up_to_date<C: WebhookConfiguration>(actual: &C, desired: &C) -> bool {
    !differs(actual, desired)
}

fn differs<C: WebhookConfiguration>(actual: &C, desired: &C) -> bool {
    let labels_missing = desired.labels().into_iter().flatten().any(|(k, v)| {
        actual
            .labels()
            .and_then(|labels| labels.get(k))
            .is_none_or(|have| have != v)
    });
    labels_missing || actual.webhooks_json(None) != desired.webhooks_json(Some(actual))
}

/// Applies `desired` unless the API server already has it. Returns whether it wrote.
async fn reconcile<C>(
    api: &Api<C>,
    desired: &C,
    kind: &'static str,
) -> Result<bool, ControllerError>
where
    C: WebhookConfiguration
        + kube::Resource<DynamicType = ()>
        + Clone
        + Serialize
        + DeserializeOwned
        + std::fmt::Debug,
{
    let name = desired.meta().name.clone().unwrap_or_default();
    let actual = api
        .get_opt(&name)
        .await
        .map_err(|e| ControllerError::api("get", format!("{kind} {name}"), e))?;
    if actual
        .as_ref()
        .is_some_and(|actual| !differs(actual, desired))
    {
        return Ok(false);
    }
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(desired),
    )
    .await
    .map_err(|e| ControllerError::api("apply", format!("{kind} {name}"), e))?;
    Ok(true)
}

/// The `webhooks` duty: while this replica holds the Lease, keeps both configurations as
/// desired: after every change of the Ready rules, discovery or the caBundle, on gaining the
/// Lease, and every `resync_interval` (repairing edits and deletions). After each successful
/// pass it publishes the inputs the stored configuration now reflects (`applied`; `None`
/// while it does not hold the Lease), which the `status` duty waits for before it calls a
/// rule Ready.
pub(crate) struct Webhooks {
    client: Client,
    config: Arc<WebhookSettings>,
    budget: Duration,
    needs: watch::Receiver<Arc<Inputs>>,
    ca_bundle: watch::Receiver<Option<Vec<u8>>>,
    leader: Leader,
    applied: watch::Sender<Option<Arc<Inputs>>>,
}

impl Webhooks {
    pub(crate) fn new(
        client: Client,
        config: Arc<WebhookSettings>,
        budget: Duration,
        needs: watch::Receiver<Arc<Inputs>>,
        ca_bundle: watch::Receiver<Option<Vec<u8>>>,
        leader: Leader,
        applied: watch::Sender<Option<Arc<Inputs>>>,
    ) -> Webhooks {
        Webhooks {
            client,
            config,
            budget,
            needs,
            ca_bundle,
            leader,
            applied,
        }
    }
}

impl Duty for Webhooks {
    const NAME: &'static str = "webhooks";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let Webhooks {
            client,
            config,
            budget,
            needs,
            ca_bundle,
            leader,
            applied,
        } = self;
        let mutating = Api::<MutatingWebhookConfiguration>::all(client.clone());
        let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone());
        let mut backoff = context.backoff(RETRY_FIRST, RETRY_MAX.min(config.resync_interval));
        let mut wait = Duration::ZERO;
        loop {
            tokio::select! {
                () = context.stop.wait() => return Ok(()),
                () = tokio::time::sleep(wait) => {}
                Ok(()) = needs.changed() => {}
                Ok(()) = ca_bundle.changed() => {}
                () = leader.changed() => {}
            }
            wait = config.resync_interval;
            if !leader.is_leader() {
                // Another replica writes the configuration now: what this one wrote says
                // nothing about what is stored.
                applied.send_if_modified(|a| a.take().is_some());
                continue;
            }
            let inputs = needs.borrow_and_update().clone();
            let ca = ca_bundle.borrow_and_update().clone();
            let Some(served) = &inputs.served else {
                continue;
            };
            let desired_mutating =
                desired_mutating(config, *budget, ca.as_deref(), &inputs.rules, served);
            let desired_validating = desired_validating(config, ca.as_deref());
            let result = async {
                let wrote_mutating =
                    reconcile(&mutating, &desired_mutating, "MutatingWebhookConfiguration").await?;
                let wrote_validating = reconcile(
                    &validating,
                    &desired_validating,
                    "ValidatingWebhookConfiguration",
                )
                .await?;
                Ok::<_, ControllerError>((wrote_mutating, wrote_validating))
            }
            .await;
            match result {
                Ok((wrote_mutating, wrote_validating)) => {
                    backoff.succeeded();
                    applied.send_if_modified(|current| {
                        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &inputs)) {
                            return false;
                        }
                        *current = Some(inputs.clone());
                        true
                    });
                    if wrote_mutating {
                        let webhooks = desired_mutating.webhooks.as_deref().unwrap_or_default();
                        tracing::info!(
                            name = %config.webhook_configuration,
                            webhooks = ?webhooks.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(),
                            rules = inputs.rules.len(),
                            "applied the MutatingWebhookConfiguration"
                        );
                    }
                    if wrote_validating {
                        tracing::info!(name = %config.webhook_configuration, "applied the ValidatingWebhookConfiguration");
                    }
                }
                Err(e) => {
                    wait =
                        backoff.failed("updating the webhook configurations failed", &report(&e));
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::controller::discovery::tests::served;

    fn config() -> WebhookSettings {
        crate::controller::ControllerConfig::new(
            "initium-system",
            WebhookEndpoint::Service {
                name: "initium".into(),
                namespace: "initium-system".into(),
                port: 443,
            },
        )
        .webhook_settings()
    }

    fn needs(kinds: &[&str], operations: &[Operation], policy: FailurePolicy) -> RuleNeeds {
        RuleNeeds {
            kinds: kinds
                .iter()
                .map(|k| KindPattern::parse(k).unwrap())
                .collect(),
            operations: operations.to_vec(),
            failure_policy: policy,
            namespaced_only: false,
            namespaces: None,
        }
    }

    /// `name: group/version resources [ops]` per webhook rule, for readable assertions.
    fn summary(configuration: &MutatingWebhookConfiguration) -> Vec<String> {
        let mut lines = Vec::new();
        for webhook in configuration.webhooks.iter().flatten() {
            for rule in webhook.rules.iter().flatten() {
                lines.push(format!(
                    "{}: {}/{} {} [{}]",
                    webhook.name,
                    rule.api_groups.as_deref().unwrap_or_default().join(","),
                    rule.api_versions.as_deref().unwrap_or_default().join(","),
                    rule.resources.as_deref().unwrap_or_default().join(","),
                    rule.operations.as_deref().unwrap_or_default().join(","),
                ));
            }
        }
        lines
    }

    fn mutating(rules: &[RuleNeeds]) -> MutatingWebhookConfiguration {
        desired_mutating(
            &config(),
            Duration::from_millis(200),
            Some(b"CA"),
            rules,
            &served(),
        )
    }

    #[test]
    fn a_pod_rule_intercepts_pod_creation_only() {
        let configuration =
            mutating(&[needs(&["Pod"], &[Operation::Create], FailurePolicy::Ignore)]);
        assert_eq!(
            summary(&configuration),
            ["ignore.initium.dev: /v1 pods [CREATE]"]
        );
        let webhook = &configuration.webhooks.as_ref().unwrap()[0];
        assert_eq!(webhook.failure_policy.as_deref(), Some("Ignore"));
        assert_eq!(webhook.side_effects, "None");
        assert_eq!(webhook.admission_review_versions, ["v1"]);
        assert_eq!(webhook.match_policy.as_deref(), Some("Equivalent"));
        assert_eq!(webhook.reinvocation_policy.as_deref(), Some("IfNeeded"));
        assert_eq!(webhook.timeout_seconds, Some(1));
        assert_eq!(webhook.object_selector, Some(LabelSelector::default()));
        let service = webhook.client_config.service.as_ref().unwrap();
        assert_eq!(service.path.as_deref(), Some("/mutate"));
        assert_eq!(service.port, Some(443));
        assert_eq!(
            webhook
                .client_config
                .ca_bundle
                .as_ref()
                .map(|b| b.0.as_slice()),
            Some(&b"CA"[..])
        );
    }

    #[test]
    fn no_rules_intercept_nothing() {
        let configuration = mutating(&[]);
        assert_eq!(configuration.webhooks, Some(vec![]));
        assert_eq!(configuration.metadata.name.as_deref(), Some("initium"));
    }

    #[test]
    fn fail_and_ignore_rules_split_without_sending_a_request_twice() {
        let configuration = mutating(&[
            needs(
                &["Pod"],
                &[Operation::Create, Operation::Update],
                FailurePolicy::Ignore,
            ),
            needs(
                &["Pod", "apps/v1/Deployment"],
                &[Operation::Create],
                FailurePolicy::Fail,
            ),
        ]);
        assert_eq!(
            summary(&configuration),
            [
                "fail.initium.dev: /v1 pods [CREATE]",
                "fail.initium.dev: apps/v1 deployments [CREATE]",
                "ignore.initium.dev: /v1 pods [UPDATE]",
            ]
        );
    }

    #[test]
    fn wildcards_expand_to_served_kinds_minus_the_never_intercepted() {
        let configuration = mutating(&[needs(&["*"], &[Operation::Create], FailurePolicy::Fail)]);
        assert_eq!(
            summary(&configuration),
            [
                "fail.initium.dev: /v1 configmaps,namespaces,pods [CREATE]",
                "fail.initium.dev: apps/v1 deployments [CREATE]",
                "fail.initium.dev: autoscaling/v1 horizontalpodautoscalers [CREATE]",
                "fail.initium.dev: autoscaling/v2 horizontalpodautoscalers [CREATE]",
                "fail.initium.dev: example.com/v1 widgets [CREATE]",
            ],
            "no events, nodes, leases, initium rules, read-only componentstatuses or subresources"
        );
        let mut namespaced = needs(&["*"], &[Operation::Create], FailurePolicy::Fail);
        namespaced.namespaced_only = true;
        assert_eq!(
            summary(&mutating(&[namespaced])),
            [
                "fail.initium.dev: /v1 configmaps,pods [CREATE]",
                "fail.initium.dev: apps/v1 deployments [CREATE]",
                "fail.initium.dev: autoscaling/v1 horizontalpodautoscalers [CREATE]",
                "fail.initium.dev: autoscaling/v2 horizontalpodautoscalers [CREATE]",
            ],
            "a MutationRule never brings in cluster-scoped kinds"
        );
    }

    #[test]
    fn fail_rules_of_namespace_owners_only_put_their_namespaces_at_risk() {
        let mut strict = needs(&["Pod"], &[Operation::Create], FailurePolicy::Fail);
        strict.namespaced_only = true;
        strict.namespaces = Some(vec!["strict".into()]);
        let soft = needs(&["Pod"], &[Operation::Create], FailurePolicy::Ignore);
        let configuration = mutating(&[strict.clone(), soft.clone()]);
        let webhooks = configuration.webhooks.clone().unwrap_or_default();
        let selector = |i: usize| serde_json::to_value(&webhooks[i].namespace_selector).unwrap();
        assert_eq!(webhooks[0].name, FAIL_WEBHOOK);
        assert_eq!(
            selector(0)["matchExpressions"][0],
            serde_json::json!({"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": ["strict"]})
        );
        assert_eq!(selector(0)["matchExpressions"][1]["operator"], "NotIn");
        assert_eq!(
            webhooks[1].name, IGNORE_WEBHOOK,
            "pods elsewhere go to the Ignore webhook"
        );
        assert_eq!(
            summary(&configuration),
            [
                "fail.initium.dev: /v1 pods [CREATE]",
                "ignore.initium.dev: /v1 pods [CREATE]"
            ]
        );
        assert_eq!(webhooks[0].match_conditions, None);
        assert_eq!(
            webhooks[1].match_conditions,
            Some(vec![MatchCondition {
                name: NOT_SENT_TO_FAIL_WEBHOOK.into(),
                expression: "!(request.namespace in ['strict'] && request.resource.group + '/' + request.resource.resource + '/' + request.operation in ['/pods/CREATE'])".into(),
            }]),
            "a Pod created in `strict` goes to the Fail webhook only, not to both"
        );
        // Ignore rules for what no Fail rule needs get no condition.
        let mut updates = needs(&["Pod"], &[Operation::Update], FailurePolicy::Ignore);
        updates.namespaces = None;
        let configuration = mutating(&[strict.clone(), updates]);
        let webhooks = configuration.webhooks.unwrap_or_default();
        assert_eq!(webhooks[1].name, IGNORE_WEBHOOK);
        assert_eq!(webhooks[1].match_conditions, None);
        // A Fail rule that may apply anywhere takes the whole resource.
        let anywhere = needs(&["Pod"], &[Operation::Create], FailurePolicy::Fail);
        let configuration = mutating(&[strict, soft, anywhere]);
        assert_eq!(
            summary(&configuration),
            ["fail.initium.dev: /v1 pods [CREATE]"]
        );
        let selector =
            serde_json::to_value(&configuration.webhooks.unwrap_or_default()[0].namespace_selector)
                .unwrap();
        assert_eq!(
            selector["matchExpressions"].as_array().map(Vec::len),
            Some(1),
            "{selector}"
        );
    }

    #[test]
    fn own_and_excluded_namespaces_are_never_sent() {
        let mut config = config();
        config.excluded_namespaces = vec!["kube-system".into(), "audit".into()];
        let configuration = desired_mutating(
            &config,
            Duration::from_millis(200),
            None,
            &[needs(&["Pod"], &[Operation::Create], FailurePolicy::Ignore)],
            &served(),
        );
        let selector = configuration.webhooks.unwrap()[0]
            .namespace_selector
            .clone()
            .unwrap();
        let requirement = &selector.match_expressions.unwrap()[0];
        assert_eq!(requirement.key, "kubernetes.io/metadata.name");
        assert_eq!(requirement.operator, "NotIn");
        assert_eq!(
            requirement.values.as_deref().unwrap(),
            ["audit", "initium-system", "kube-system"]
        );
    }

    #[test]
    fn a_cluster_rule_limited_to_namespaces_still_gets_namespace_objects() {
        let mut limited = needs(&["*"], &[Operation::Create], FailurePolicy::Ignore);
        limited.namespaces = Some(vec!["team-a".into()]);
        assert_eq!(
            summary(&mutating(&[limited])),
            [
                "ignore.initium.dev: /v1 configmaps,namespaces,pods [CREATE]",
                "ignore.initium.dev: apps/v1 deployments [CREATE]",
                "ignore.initium.dev: autoscaling/v1 horizontalpodautoscalers [CREATE]",
                "ignore.initium.dev: autoscaling/v2 horizontalpodautoscalers [CREATE]",
            ],
            "namespaced kinds and Namespaces, no other cluster-scoped kind"
        );
    }

    #[test]
    fn urls_get_the_paths_appended() {
        let mut config = config();
        config.endpoint = WebhookEndpoint::Url("https://127.0.0.1:8443/".into());
        let validating = desired_validating(&config, Some(b"CA"));
        let webhook = &validating.webhooks.unwrap()[0];
        assert_eq!(
            webhook.client_config.url.as_deref(),
            Some("https://127.0.0.1:8443/validate")
        );
        assert_eq!(webhook.name, "rules.initium.dev");
        assert_eq!(webhook.failure_policy.as_deref(), Some("Fail"));
        let rule = &webhook.rules.as_ref().unwrap()[0];
        assert_eq!(rule.api_groups.as_deref().unwrap(), ["initium.dev"]);
        assert_eq!(
            rule.resources.as_deref().unwrap(),
            ["clustermutationrules", "mutationrules"]
        );
        assert_eq!(rule.operations.as_deref().unwrap(), ["CREATE", "UPDATE"]);
    }

    #[test]
    fn timeout_is_twice_the_budget_within_kubernetes_limits() {
        let t = |ms| webhook_timeout_seconds(Duration::from_millis(ms));
        assert_eq!(t(0), 1);
        assert_eq!(t(200), 1);
        assert_eq!(t(500), 1);
        assert_eq!(t(501), 2);
        assert_eq!(t(2_000), 4);
        assert_eq!(t(14_999), 30);
        assert_eq!(t(60_000), 30);
        assert_eq!(webhook_timeout_seconds(Duration::MAX), 30);
    }

    #[test]
    fn certificate_names_follow_the_endpoint() {
        assert_eq!(
            config().endpoint.certificate_names(),
            [
                "initium.initium-system.svc",
                "initium.initium-system.svc.cluster.local"
            ]
        );
        let names = |url: &str| WebhookEndpoint::Url(url.into()).certificate_names();
        assert_eq!(names("https://127.0.0.1:8443"), ["127.0.0.1"]);
        assert_eq!(names("https://[::1]:8443/x"), ["::1"]);
        assert_eq!(
            names("https://initium.example.com/hooks"),
            ["initium.example.com"]
        );
    }

    #[test]
    fn endpoints_are_checked() {
        let bad = |url: &str| WebhookEndpoint::Url(url.into()).validate().is_err();
        assert!(bad("http://127.0.0.1:8443"));
        assert!(bad("https://"));
        assert!(bad("https://host/?q=1"));
        assert!(bad("https://user@host/"));
        assert!(!bad("https://host:8443/prefix"));
    }

    #[test]
    fn what_the_api_server_adds_is_not_a_difference() {
        let desired = mutating(&[needs(&["Pod"], &[Operation::Create], FailurePolicy::Ignore)]);
        let mut actual = desired.clone();
        actual.metadata.resource_version = Some("7".into());
        actual
            .metadata
            .labels
            .get_or_insert_default()
            .insert("extra".into(), "label".into());
        assert!(!differs(&actual, &desired));

        let mut unmanaged = desired.clone();
        for webhook in unmanaged.webhooks.iter_mut().flatten() {
            webhook.client_config.ca_bundle = None;
        }
        assert!(
            !differs(&actual, &unmanaged),
            "a caBundle initium does not manage is left alone"
        );

        let mut edited = actual.clone();
        edited.webhooks.as_mut().unwrap()[0].timeout_seconds = Some(10);
        assert!(differs(&edited, &desired));
        let mut deleted = actual;
        deleted.webhooks = None;
        assert!(differs(&deleted, &desired));
    }
}
