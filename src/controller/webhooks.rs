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

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use serde_json::json;
use tokio::time::Instant;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ServiceReference,
    ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
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
use crate::admission::state::{NamespaceLabels, Shared};
use crate::admission::{MUTATE_PATH, VALIDATE_PATH};
use crate::metrics::ResultLabels;
use crate::report::report;
use initium_engine::api::{FailurePolicy, GROUP, Operation, VERSION};
use initium_engine::{CompiledRule, KindPattern};

/// Name of the webhook for `failurePolicy: Fail` rules that may apply in any namespace.
pub const FAIL_WEBHOOK: &str = "fail.initium.dev";
/// Name of the webhook for `failurePolicy: Fail` rules limited to namespaces, in the
/// namespaces labeled [`WebhookSettings::fail_rules_label`].
pub const FAIL_LABELED_WEBHOOK: &str = "fail-labeled.initium.dev";
/// Name of the webhook for `failurePolicy: Ignore` rules (and, outside the labeled
/// namespaces, Fail rules limited to namespaces).
pub const IGNORE_WEBHOOK: &str = "ignore.initium.dev";
/// Name of the webhook for `failurePolicy: Ignore` rules in the labeled namespaces.
pub const IGNORE_LABELED_WEBHOOK: &str = "ignore-labeled.initium.dev";
/// The prefix of the label initium keeps on every namespace a Ready `failurePolicy: Fail`
/// rule is limited to (value `"true"`), and removes from the others:
/// `fail-labeled.initium.dev` selects them. The label's name is the webhook configuration's
/// (`fail-rules.initium.dev/initium` by default), so two configurations never fight over one
/// label. Owned by initium; see [`desired_mutating`].
pub const FAIL_RULES_LABEL_PREFIX: &str = "fail-rules.initium.dev/";

/// The longest webhook configuration name: it is the name part of the label (63 characters
/// at most).
pub const MAX_CONFIGURATION_NAME: usize = 63;
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleNeeds {
    pub kinds: Vec<KindPattern>,
    pub operations: Vec<Operation>,
    /// The controllers whose Pod templates the rule also mutates (`spec.autogen`): covered at
    /// CREATE and UPDATE, since every write of a controller may change the Pods it makes.
    pub templates: Vec<KindPattern>,
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
            templates: rule.template_kinds().to_vec(),
            failure_policy: rule.failure_policy,
            namespaced_only: rule.id.namespace.is_some(),
            namespaces,
        }
    }
}

/// What the webhook configuration is derived from: the Ready rules and discovery.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Inputs {
    /// The Ready rules the webhook serves. Shared with the rule table, which works each out
    /// once per spec.
    pub rules: Vec<Arc<RuleNeeds>>,
    pub served: Option<Arc<Served>>,
    /// The Ready rules the API server serves through a generated policy
    /// (`--compile-rules auto`). The webhook configuration still covers each until its
    /// policy is in effect.
    pub compiled: Vec<CompiledPolicy>,
    /// `--compile-rules auto`: with nothing left for the webhook, the
    /// MutatingWebhookConfiguration is deleted rather than kept empty.
    pub compiling: bool,
}

/// A Ready rule compiled to a MutatingAdmissionPolicy.
#[derive(Clone, Debug, PartialEq)]
pub struct CompiledPolicy {
    pub rule: initium_engine::RuleId,
    pub generated: Arc<initium_engine::policy::Generated>,
    /// What the webhook configuration covers for it while its policy is not in effect.
    pub needs: Arc<RuleNeeds>,
}

impl Inputs {
    /// The rules the webhook configuration must cover: the webhook's, and the compiled ones
    /// whose policy is not in effect yet (`in_effect`: the policies written and settled).
    pub fn covered(&self, in_effect: &BTreeSet<String>) -> Vec<Arc<RuleNeeds>> {
        let mut rules = self.rules.clone();
        rules.extend(
            self.compiled
                .iter()
                .filter(|c| !in_effect.contains(&c.generated.name))
                .map(|c| c.needs.clone()),
        );
        rules
    }
}

/// `(group, version, resource)` → operations.
type Coverage = BTreeMap<(String, String, String), BTreeSet<Operation>>;

/// Which rules a coverage is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// `failurePolicy: Ignore` rules.
    Ignore,
    /// `failurePolicy: Fail` rules that may apply in any namespace (or to cluster-scoped
    /// objects).
    FailAnywhere,
    /// `failurePolicy: Fail` rules limited to known namespaces: what the namespaces carrying
    /// [`WebhookSettings::fail_rules_label`] need.
    FailInNamespaces,
}

impl Scope {
    fn of(rule: &RuleNeeds) -> Scope {
        match (rule.failure_policy, &rule.namespaces) {
            (FailurePolicy::Ignore, _) => Scope::Ignore,
            (FailurePolicy::Fail, None) => Scope::FailAnywhere,
            (FailurePolicy::Fail, Some(_)) => Scope::FailInNamespaces,
        }
    }
}

/// What the rules of one scope need intercepted, and which of those resources are
/// cluster-scoped other than Namespaces (a `namespaceSelector` never keeps those out).
fn coverage(rules: &[Arc<RuleNeeds>], served: &Served, scope: Scope) -> (Coverage, BTreeSet<Key>) {
    let mut coverage = Coverage::new();
    let mut unselectable = BTreeSet::new();
    const TEMPLATE_WRITES: [Operation; 2] = [Operation::Create, Operation::Update];
    for rule in rules.iter().filter(|r| Scope::of(r) == scope) {
        let patterns = rule
            .kinds
            .iter()
            .map(|p| (p, rule.operations.as_slice()))
            .chain(rule.templates.iter().map(|p| (p, &TEMPLATE_WRITES[..])));
        for (pattern, rule_operations) in patterns {
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
                let operations: BTreeSet<Operation> = rule_operations
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
                let key = (
                    resource.gvk.group.clone(),
                    resource.gvk.version.clone(),
                    resource.plural.clone(),
                );
                if !resource.namespaced && !namespace_object {
                    unselectable.insert(key.clone());
                }
                coverage.entry(key).or_default().extend(operations);
            }
        }
    }
    (coverage, unselectable)
}

type Key = (String, String, String);

/// `a` without what `b` covers.
fn minus(a: &Coverage, b: &Coverage) -> Coverage {
    let mut out = a.clone();
    for (key, operations) in b {
        if let Some(left) = out.get_mut(key) {
            left.retain(|op| !operations.contains(op));
        }
    }
    out.retain(|_, operations| !operations.is_empty());
    out
}

/// What `a` or `b` covers.
fn union(a: &Coverage, b: &Coverage) -> Coverage {
    let mut out = a.clone();
    for (key, operations) in b {
        out.entry(key.clone())
            .or_default()
            .extend(operations.iter().copied());
    }
    out
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

impl WebhookSettings {
    /// The label on the namespaces with Fail rules: [`FAIL_RULES_LABEL_PREFIX`] and the
    /// configuration's name.
    pub fn fail_rules_label(&self) -> String {
        format!("{FAIL_RULES_LABEL_PREFIX}{}", self.webhook_configuration)
    }
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

/// The namespaces that must carry [`WebhookSettings::fail_rules_label`]: those a Ready `failurePolicy: Fail`
/// rule is limited to (a MutationRule's own namespace, a ClusterMutationRule's literal
/// `namespaces`), minus initium's own and the excluded namespaces (never intercepted anyway).
pub fn fail_rule_namespaces(
    config: &WebhookSettings,
    rules: &[Arc<RuleNeeds>],
) -> BTreeSet<String> {
    let excluded = excluded_namespaces(config);
    rules
        .iter()
        .filter(|r| Scope::of(r) == Scope::FailInNamespaces)
        .flat_map(|r| r.namespaces.iter().flatten())
        .filter(|ns| excluded.binary_search(ns).is_err())
        .cloned()
        .collect()
}

/// The MutatingWebhookConfiguration for the Ready rules. Every field the API server would
/// default is set, so the result compares equal to what the API server stores. Its size
/// depends on the resources the rules need, never on how many namespaces have rules.
///
/// While initium is down, a webhook with `failurePolicy: Fail` rejects what it covers. A
/// namespace owner's Fail rule must put only namespaces with Fail rules at risk, never all of
/// them, so the namespaces those rules are limited to carry [`WebhookSettings::fail_rules_label`] (kept by the
/// `webhooks` duty) and up to four webhooks split every request between them, each request
/// going to exactly one:
///
/// | webhook | namespaces | covers |
/// |---|---|---|
/// | `fail.initium.dev` | all | what Fail rules that may apply anywhere need (FA) |
/// | `fail-labeled.initium.dev` | labeled | what Fail rules limited to namespaces need (FL), minus FA |
/// | `ignore.initium.dev` | not labeled, and cluster-scoped objects | what Ignore rules need (I) and FL, minus FA |
/// | `ignore-labeled.initium.dev` | labeled | I minus FA and FL, namespaced resources and Namespaces only |
///
/// FL is sent from namespaces without the label too (through the Ignore webhook), so a
/// namespace whose label is missing for a moment (just created, or the label removed by
/// hand) still has its rules applied while initium is up. A `namespaceSelector` decides a
/// Namespace object by its own labels and never keeps out other cluster-scoped objects,
/// which is why those only ever go to `fail.initium.dev` or `ignore.initium.dev`.
pub fn desired_mutating(
    config: &WebhookSettings,
    budget: Duration,
    ca_bundle: Option<&[u8]>,
    rules: &[Arc<RuleNeeds>],
    served: &Served,
) -> MutatingWebhookConfiguration {
    let (anywhere, _) = coverage(rules, served, Scope::FailAnywhere);
    let (in_namespaces, _) = coverage(rules, served, Scope::FailInNamespaces);
    let (ignore, unselectable) = coverage(rules, served, Scope::Ignore);
    let fail_labeled = minus(&in_namespaces, &anywhere);
    let ignore_unlabeled = minus(&union(&ignore, &in_namespaces), &anywhere);
    let mut ignore_labeled = minus(&minus(&ignore, &anywhere), &in_namespaces);
    ignore_labeled.retain(|key, _| !unselectable.contains(key));
    if in_namespaces.is_empty() {
        // Without Fail rules limited to namespaces `ignore.initium.dev` takes every
        // namespace, labeled or not.
        ignore_labeled.clear();
    }

    let excluded = LabelSelectorRequirement {
        key: NAMESPACE_NAME_LABEL.into(),
        operator: "NotIn".into(),
        values: Some(excluded_namespaces(config)),
    };
    let selector = |label: Option<&str>| {
        let mut expressions = vec![excluded.clone()];
        if let Some(operator) = label {
            expressions.push(LabelSelectorRequirement {
                key: config.fail_rules_label(),
                operator: operator.into(),
                values: None,
            });
        }
        LabelSelector {
            match_expressions: Some(expressions),
            match_labels: None,
        }
    };
    let webhook = |name: &str,
                   policy: FailurePolicy,
                   coverage: &Coverage,
                   namespace_selector: LabelSelector| MutatingWebhook {
        name: name.into(),
        admission_review_versions: vec!["v1".into()],
        client_config: config.endpoint.client_config(MUTATE_PATH, ca_bundle),
        failure_policy: Some(policy_name(policy).into()),
        match_conditions: None,
        match_policy: Some("Equivalent".into()),
        namespace_selector: Some(namespace_selector),
        object_selector: Some(LabelSelector::default()),
        reinvocation_policy: Some("IfNeeded".into()),
        rules: Some(webhook_rules(coverage)),
        side_effects: "None".into(),
        timeout_seconds: Some(webhook_timeout_seconds(budget)),
    };
    let all = [
        (FAIL_WEBHOOK, FailurePolicy::Fail, &anywhere, None),
        (
            FAIL_LABELED_WEBHOOK,
            FailurePolicy::Fail,
            &fail_labeled,
            Some("Exists"),
        ),
        (
            IGNORE_WEBHOOK,
            FailurePolicy::Ignore,
            &ignore_unlabeled,
            // No Fail rule limited to namespaces: the label means nothing (and a namespace
            // still carrying it for a moment must not lose its Ignore rules).
            (!in_namespaces.is_empty()).then_some("DoesNotExist"),
        ),
        (
            IGNORE_LABELED_WEBHOOK,
            FailurePolicy::Ignore,
            &ignore_labeled,
            Some("Exists"),
        ),
    ];
    let webhooks = all
        .into_iter()
        .filter(|(_, _, coverage, _)| !coverage.is_empty())
        .map(|(name, policy, coverage, label)| webhook(name, policy, coverage, selector(label)))
        .collect();
    MutatingWebhookConfiguration {
        metadata: ObjectMeta {
            name: Some(config.webhook_configuration.clone()),
            labels: Some(labels()),
            ..ObjectMeta::default()
        },
        webhooks: Some(webhooks),
    }
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

/// Deletes the MutatingWebhookConfiguration (every Ready rule is served by the API server);
/// `Ok(true)` when there was one.
async fn delete_configuration(
    api: &Api<MutatingWebhookConfiguration>,
    name: &str,
) -> Result<bool, ControllerError> {
    match api.delete(name, &kube::api::DeleteParams::default()).await {
        Ok(_) => {
            tracing::info!(
                configuration = name,
                "every Ready rule is served by the API server: deleted the MutatingWebhookConfiguration"
            );
            Ok(true)
        }
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(e) => Err(ControllerError::api(
            "delete",
            format!("MutatingWebhookConfiguration {name}"),
            e,
        )),
    }
}

/// At most one write of the webhook configurations (and one round of namespace labels) per
/// this interval: a bulk apply of thousands of rules, or one tenant patching a rule ten
/// times a second, costs the API server one write a second, each with the whole state.
pub const MIN_WRITE_INTERVAL: Duration = Duration::from_secs(1);
/// Namespace label patches in flight at once.
const CONCURRENT_LABEL_WRITES: usize = 16;
/// The longest API server message put in a log line or a rule's condition: a refusal can
/// quote the whole object (the API server once answered with 115 KB).
pub const MESSAGE_MAX_BYTES: usize = 1024;

/// Cuts `message` to [`MESSAGE_MAX_BYTES`] (at a character boundary), saying how much was
/// left out.
pub fn bounded(message: &str) -> String {
    if message.len() <= MESSAGE_MAX_BYTES {
        return message.to_string();
    }
    let mut end = MESSAGE_MAX_BYTES;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} more bytes)", &message[..end], message.len() - end)
}

/// The API server's answer that it will not store the configuration (invalid, forbidden by
/// an admission policy, too large): retrying the same object cannot help, so the rules it was
/// for are told, with the API server's message. Conflicts, throttling and server errors are
/// failures retried with backoff instead.
fn refusal(error: &ControllerError) -> Option<String> {
    let ControllerError::Api {
        source: kube::Error::Api(status),
        ..
    } = error
    else {
        return None;
    };
    matches!(status.code, 400 | 403 | 413 | 422).then(|| bounded(&status.message))
}

/// The API server refused the MutatingWebhookConfiguration built from `inputs`.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub inputs: Arc<Inputs>,
    /// The API server's message, cut to [`MESSAGE_MAX_BYTES`].
    pub message: String,
    /// The configuration's name.
    pub configuration: String,
}

/// What the labels of the namespaces should change: namespaces to label, namespaces to
/// unlabel. Only namespaces that exist are labeled; `pending` holds writes done that the
/// watch has not shown yet (not repeated meanwhile).
fn label_changes(
    label: &str,
    wanted: &BTreeSet<String>,
    namespaces: &NamespaceLabels,
    pending: &BTreeMap<String, bool>,
) -> (Vec<String>, Vec<String>) {
    let mut add = Vec::new();
    let mut remove = Vec::new();
    for (name, labels) in namespaces {
        let has = labels.get(label).is_some_and(|v| v == "true");
        let want = wanted.contains(name);
        if has == want || pending.get(name) == Some(&want) {
            continue;
        }
        if want {
            add.push(name.clone());
        } else if labels.contains_key(label) {
            remove.push(name.clone());
        }
    }
    add.sort();
    remove.sort();
    (add, remove)
}

/// Sets (`true`) or removes the label on one namespace, with a merge patch: it touches
/// nothing else, and unlike server-side apply never creates a namespace deleted meanwhile.
async fn write_label(
    api: &Api<Namespace>,
    label: &str,
    name: &str,
    on: bool,
) -> Result<(), kube::Error> {
    let value = if on { json!("true") } else { json!(null) };
    let patch = json!({"metadata": {"labels": {label: value}}});
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    match api.patch(name, &params, &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        // Deleted meanwhile: nothing to label.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// The `webhooks` duty: while this replica holds the Lease, keeps both configurations as
/// desired, and [`WebhookSettings::fail_rules_label`] on exactly the namespaces [`fail_rule_namespaces`]
/// names: after every change of the Ready rules, discovery, the caBundle or the namespaces,
/// on gaining the Lease, and every `resync_interval` (repairing edits and deletions), at most
/// once per [`MIN_WRITE_INTERVAL`]. Labels are written first, then the configuration: every
/// state in between sends each request to initium once (see [`desired_mutating`]).
///
/// After each successful pass it publishes the inputs the stored configuration now reflects
/// (`applied`; `None` while it does not hold the Lease), which the `status` duty waits for
/// before it calls a rule Ready. When the API server refuses the configuration, it publishes
/// the refusal instead (`refused`), and the `status` duty says so on the rules waiting for it.
pub(crate) struct Webhooks {
    client: Client,
    config: Arc<WebhookSettings>,
    budget: Duration,
    needs: watch::Receiver<Arc<Inputs>>,
    in_effect: watch::Receiver<Arc<BTreeSet<String>>>,
    namespaces: watch::Receiver<Option<Arc<NamespaceLabels>>>,
    ca_bundle: watch::Receiver<Option<Vec<u8>>>,
    leader: Leader,
    applied: watch::Sender<Option<Arc<Inputs>>>,
    refused: watch::Sender<Option<Arc<Refusal>>>,
    shared: Arc<Shared>,
}

/// What the `webhooks` duty follows: the Ready rules' needs, the namespaces' labels (`None`
/// until listed) and the caBundle.
pub(crate) struct Watched {
    pub needs: watch::Receiver<Arc<Inputs>>,
    /// The generated policies in effect (the `policies` duty's).
    pub in_effect: watch::Receiver<Arc<BTreeSet<String>>>,
    pub namespaces: watch::Receiver<Option<Arc<NamespaceLabels>>>,
    pub ca_bundle: watch::Receiver<Option<Vec<u8>>>,
}

/// Where the `webhooks` duty's results go.
pub(crate) struct Published {
    pub applied: watch::Sender<Option<Arc<Inputs>>>,
    pub refused: watch::Sender<Option<Arc<Refusal>>>,
}

impl Webhooks {
    pub(crate) fn new(
        client: Client,
        config: Arc<WebhookSettings>,
        budget: Duration,
        watched: Watched,
        leader: Leader,
        published: Published,
        shared: Arc<Shared>,
    ) -> Webhooks {
        Webhooks {
            client,
            config,
            budget,
            needs: watched.needs,
            in_effect: watched.in_effect,
            namespaces: watched.namespaces,
            ca_bundle: watched.ca_bundle,
            leader,
            applied: published.applied,
            refused: published.refused,
            shared,
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
            in_effect,
            namespaces,
            ca_bundle,
            leader,
            applied,
            refused,
            shared,
        } = self;
        let metrics = &shared.metrics;
        let mutating = Api::<MutatingWebhookConfiguration>::all(client.clone());
        let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone());
        let namespace_api = Api::<Namespace>::all(client.clone());
        let mut backoff = context.backoff(RETRY_FIRST, RETRY_MAX.min(config.resync_interval));
        let mut wait = Duration::ZERO;
        let mut last_pass: Option<Instant> = None;
        // Label writes done that the Namespace watch has not shown yet.
        let mut pending: BTreeMap<String, bool> = BTreeMap::new();
        loop {
            tokio::select! {
                () = context.stop.wait() => return Ok(()),
                () = tokio::time::sleep(wait) => {}
                Ok(()) = needs.changed() => {}
                Ok(()) = in_effect.changed() => {}
                Ok(()) = namespaces.changed() => {}
                Ok(()) = ca_bundle.changed() => {}
                () = leader.changed() => {}
            }
            wait = config.resync_interval;
            if !leader.is_leader() {
                // Another replica writes the configuration now: what this one wrote says
                // nothing about what is stored.
                applied.send_if_modified(|a| a.take().is_some());
                refused.send_if_modified(|r| r.take().is_some());
                metrics.webhook_configuration_refused.set(0);
                pending.clear();
                last_pass = None;
                continue;
            }
            // Changes that come faster than MIN_WRITE_INTERVAL wait and are written together.
            if let Some(last) = last_pass {
                let next = last + MIN_WRITE_INTERVAL;
                let now = Instant::now();
                if now < next {
                    wait = next - now;
                    continue;
                }
            }
            let inputs = needs.borrow_and_update().clone();
            let ca = ca_bundle.borrow_and_update().clone();
            let Some(labels) = namespaces.borrow_and_update().clone() else {
                // Namespaces not listed yet: which ones carry the label is not known.
                continue;
            };
            let Some(served) = &inputs.served else {
                continue;
            };
            last_pass = Some(Instant::now());
            // What the watch now shows needs no reminder.
            let label = config.fail_rules_label();
            pending.retain(|name, want| {
                labels
                    .get(name)
                    .is_some_and(|l| l.get(&label).is_some_and(|v| v == "true") != *want)
            });
            let covered = inputs.covered(&in_effect.borrow_and_update());
            let wanted = fail_rule_namespaces(config, &covered);
            let (add, remove) = label_changes(&label, &wanted, &labels, &pending);
            let desired_mutating =
                desired_mutating(config, *budget, ca.as_deref(), &covered, served);
            // Every Ready rule served by the API server: no webhook at all.
            let delete_mutating =
                inputs.compiling && desired_mutating.webhooks.as_ref().is_none_or(Vec::is_empty);
            let desired_validating = desired_validating(config, ca.as_deref());
            let label_result = {
                let writes: Vec<(String, bool)> = add
                    .iter()
                    .map(|n| (n.clone(), true))
                    .chain(remove.iter().map(|n| (n.clone(), false)))
                    .collect();
                let mut results = futures::stream::iter(writes)
                    .map(|(name, on): (String, bool)| {
                        let api = namespace_api.clone();
                        let label = label.clone();
                        async move {
                            let result = write_label(&api, &label, &name, on).await;
                            (name, on, result)
                        }
                    })
                    .buffer_unordered(CONCURRENT_LABEL_WRITES);
                let mut failed: Option<(String, kube::Error)> = None;
                let mut failures = 0usize;
                while let Some((name, on, result)) = results.next().await {
                    match result {
                        Ok(()) => {
                            pending.insert(name, on);
                            metrics
                                .namespace_label_writes
                                .get_or_create(&ResultLabels {
                                    result: if on { "added" } else { "removed" },
                                })
                                .inc();
                        }
                        Err(e) => {
                            failures += 1;
                            metrics
                                .namespace_label_writes
                                .get_or_create(&ResultLabels { result: "failed" })
                                .inc();
                            failed.get_or_insert((name, e));
                        }
                    }
                }
                match failed {
                    None => Ok(()),
                    Some((name, e)) => Err(ControllerError::api(
                        "label",
                        format!(
                            "Namespace {name} ({failures} of {} label writes failed)",
                            add.len() + remove.len()
                        ),
                        e,
                    )),
                }
            };
            if !add.is_empty() || !remove.is_empty() {
                tracing::info!(
                    labeled = add.len(),
                    unlabeled = remove.len(),
                    %label,
                    "updated the namespaces that have Fail rules"
                );
            }
            let result = async {
                label_result?;
                let wrote_mutating = if delete_mutating {
                    delete_configuration(&mutating, &config.webhook_configuration).await
                } else {
                    reconcile(&mutating, &desired_mutating, "MutatingWebhookConfiguration").await
                };
                let outcome = match &wrote_mutating {
                    Ok(true) => Some("applied"),
                    Ok(false) => None,
                    Err(e) if refusal(e).is_some() => Some("refused"),
                    Err(_) => Some("failed"),
                };
                if let Some(result) = outcome {
                    metrics
                        .webhook_configuration_writes
                        .get_or_create(&ResultLabels { result })
                        .inc();
                }
                let wrote_mutating = wrote_mutating?;
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
                    refused.send_if_modified(|r| r.take().is_some());
                    metrics.webhook_configuration_refused.set(0);
                    applied.send_if_modified(|current| {
                        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &inputs)) {
                            return false;
                        }
                        *current = Some(inputs.clone());
                        true
                    });
                    if wrote_mutating {
                        let webhooks = desired_mutating.webhooks.as_deref().unwrap_or_default();
                        let bytes = serde_json::to_vec(&desired_mutating)
                            .map(|b| b.len())
                            .unwrap_or_default();
                        metrics
                            .webhook_configuration_bytes
                            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
                        tracing::info!(
                            name = %config.webhook_configuration,
                            webhooks = ?webhooks.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(),
                            rules = inputs.rules.len(),
                            bytes,
                            "applied the MutatingWebhookConfiguration"
                        );
                    }
                    if wrote_validating {
                        tracing::info!(name = %config.webhook_configuration, "applied the ValidatingWebhookConfiguration");
                    }
                }
                Err(e) => {
                    if let Some(message) = refusal(&e) {
                        metrics.webhook_configuration_refused.set(1);
                        let refusal = Arc::new(Refusal {
                            inputs: inputs.clone(),
                            message,
                            configuration: config.webhook_configuration.clone(),
                        });
                        refused.send_if_modified(|current| {
                            if current.as_deref() == Some(&*refusal) {
                                return false;
                            }
                            *current = Some(refusal.clone());
                            true
                        });
                    }
                    wait = backoff.failed(
                        "updating the webhook configurations failed",
                        &bounded(&report(&e)),
                    );
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
            templates: Vec::new(),
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

    fn shared(rules: &[RuleNeeds]) -> Vec<Arc<RuleNeeds>> {
        rules.iter().cloned().map(Arc::new).collect()
    }

    fn mutating(rules: &[RuleNeeds]) -> MutatingWebhookConfiguration {
        desired_mutating(
            &config(),
            Duration::from_millis(200),
            Some(b"CA"),
            &shared(rules),
            &served(),
        )
    }

    fn labeled(rules: &[RuleNeeds]) -> BTreeSet<String> {
        fail_rule_namespaces(&config(), &shared(rules))
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
    fn an_autogen_rule_also_intercepts_every_write_of_its_controllers() {
        let mut rule = needs(&["Pod"], &[Operation::Create], FailurePolicy::Ignore);
        rule.templates = vec![
            KindPattern::parse("apps/*/Deployment").unwrap(),
            // Not served by this cluster: nothing to cover.
            KindPattern::parse("batch/*/CronJob").unwrap(),
        ];
        assert_eq!(
            summary(&mutating(&[rule])),
            [
                "ignore.initium.dev: /v1 pods [CREATE]",
                "ignore.initium.dev: apps/v1 deployments [CREATE,UPDATE]",
            ]
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

    fn limited(
        kinds: &[&str],
        policy: FailurePolicy,
        namespaces: &[&str],
        namespaced_only: bool,
    ) -> RuleNeeds {
        let mut rule = needs(kinds, &[Operation::Create, Operation::Update], policy);
        rule.namespaced_only = namespaced_only;
        rule.namespaces = Some(namespaces.iter().map(|n| n.to_string()).collect());
        rule
    }

    fn selector_of(configuration: &MutatingWebhookConfiguration, name: &str) -> serde_json::Value {
        let webhook = configuration
            .webhooks
            .iter()
            .flatten()
            .find(|w| w.name == name)
            .unwrap_or_else(|| panic!("no webhook {name}"));
        serde_json::to_value(&webhook.namespace_selector).unwrap()
    }

    #[test]
    fn fail_rules_of_namespace_owners_only_put_labeled_namespaces_at_risk() {
        let mut strict = needs(&["Pod"], &[Operation::Create], FailurePolicy::Fail);
        strict.namespaced_only = true;
        strict.namespaces = Some(vec!["strict".into()]);
        let soft = needs(&["Pod"], &[Operation::Create], FailurePolicy::Ignore);
        let configuration = mutating(&[strict.clone(), soft.clone()]);
        assert_eq!(
            summary(&configuration),
            [
                "fail-labeled.initium.dev: /v1 pods [CREATE]",
                "ignore.initium.dev: /v1 pods [CREATE]"
            ],
            "Pods of labeled namespaces go to the Fail webhook only, the others to Ignore"
        );
        let excluded = serde_json::json!({"key": NAMESPACE_NAME_LABEL, "operator": "NotIn", "values": ["initium-system", "kube-system"]});
        assert_eq!(
            selector_of(&configuration, FAIL_LABELED_WEBHOOK),
            serde_json::json!({"matchExpressions": [excluded, {"key": "fail-rules.initium.dev/initium", "operator": "Exists"}]})
        );
        assert_eq!(
            selector_of(&configuration, IGNORE_WEBHOOK),
            serde_json::json!({"matchExpressions": [excluded, {"key": "fail-rules.initium.dev/initium", "operator": "DoesNotExist"}]})
        );
        assert!(
            configuration
                .webhooks
                .iter()
                .flatten()
                .all(|w| w.match_conditions.is_none())
        );
        assert_eq!(
            labeled(&[strict.clone(), soft.clone()]),
            BTreeSet::from(["strict".to_string()])
        );
        // A Fail rule that may apply anywhere takes the whole resource, everywhere.
        let anywhere = needs(&["Pod"], &[Operation::Create], FailurePolicy::Fail);
        let configuration = mutating(&[strict, soft, anywhere]);
        assert_eq!(
            summary(&configuration),
            ["fail.initium.dev: /v1 pods [CREATE]"]
        );
        assert_eq!(
            selector_of(&configuration, FAIL_WEBHOOK),
            serde_json::json!({"matchExpressions": [excluded]})
        );
    }

    #[test]
    fn the_configuration_does_not_grow_with_the_tenants() {
        let tenants = |n: usize| -> Vec<RuleNeeds> {
            (0..n)
                .map(|i| {
                    let name = format!("{i:0>63}");
                    limited(&["Pod"], FailurePolicy::Fail, &[&name], true)
                })
                .collect()
        };
        let bytes = |rules: &[RuleNeeds]| serde_json::to_vec(&mutating(rules)).unwrap().len();
        assert_eq!(bytes(&tenants(10)), bytes(&tenants(10_000)));
        assert_eq!(labeled(&tenants(10_000)).len(), 10_000);
    }

    #[test]
    fn own_and_excluded_namespaces_are_never_labeled() {
        let rules = [
            limited(&["Pod"], FailurePolicy::Fail, &["initium-system"], true),
            limited(
                &["Pod"],
                FailurePolicy::Fail,
                &["kube-system", "team-a"],
                false,
            ),
            limited(&["Pod"], FailurePolicy::Ignore, &["team-b"], true),
        ];
        assert_eq!(labeled(&rules), BTreeSet::from(["team-a".to_string()]));
    }

    /// What the API server does with a request, from the configuration alone: the webhooks
    /// called, with their failure policies. `labeled`: whether the namespace (or, for a
    /// Namespace object, the object itself) carries the label.
    fn route(
        configuration: &MutatingWebhookConfiguration,
        request: (&str, &str, &str, Operation),
        namespace: Option<&str>,
        labeled: bool,
    ) -> Vec<(String, String)> {
        let (group, version, resource, operation) = request;
        let namespace_object = group.is_empty() && resource == "namespaces";
        let mut labels = BTreeMap::new();
        if labeled {
            labels.insert(config().fail_rules_label(), "true".to_string());
        }
        if let Some(ns) = namespace {
            labels.insert(NAMESPACE_NAME_LABEL.to_string(), ns.to_string());
        }
        let selected = |selector: &LabelSelector| {
            if namespace.is_none() && !namespace_object {
                return true; // never skipped for other cluster-scoped objects
            }
            selector.match_expressions.iter().flatten().all(|e| {
                let value = labels.get(&e.key);
                let values = e.values.clone().unwrap_or_default();
                match e.operator.as_str() {
                    "In" => value.is_some_and(|v| values.contains(v)),
                    "NotIn" => value.is_none_or(|v| !values.contains(v)),
                    "Exists" => value.is_some(),
                    "DoesNotExist" => value.is_none(),
                    other => panic!("operator {other}"),
                }
            })
        };
        configuration
            .webhooks
            .iter()
            .flatten()
            .filter(|w| w.namespace_selector.as_ref().is_none_or(selected))
            .filter(|w| {
                w.rules.iter().flatten().any(|r| {
                    r.api_groups.iter().flatten().any(|g| g == group)
                        && r.api_versions.iter().flatten().any(|v| v == version)
                        && r.resources.iter().flatten().any(|x| x == resource)
                        && r.operations
                            .iter()
                            .flatten()
                            .any(|o| o == operation.as_str())
                })
            })
            .map(|w| (w.name.clone(), w.failure_policy.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn every_request_reaches_initium_once_and_fails_closed_only_where_a_fail_rule_asks() {
        let pods_fail_a = limited(&["Pod"], FailurePolicy::Fail, &["team-a"], true);
        let maps_fail_b = limited(&["ConfigMap"], FailurePolicy::Fail, &["team-b"], true);
        let pods_ignore = needs(&["Pod"], &[Operation::Create], FailurePolicy::Ignore);
        let wildcard_ignore = needs(&["*"], &[Operation::Update], FailurePolicy::Ignore);
        let deployments_fail = needs(
            &["apps/v1/Deployment"],
            &[Operation::Create],
            FailurePolicy::Fail,
        );
        let namespaces_fail = limited(&["Namespace"], FailurePolicy::Fail, &["team-c"], false);
        let all = [
            pods_fail_a,
            maps_fail_b,
            pods_ignore,
            wildcard_ignore,
            deployments_fail,
            namespaces_fail,
        ];
        let requests = [
            ("", "v1", "pods"),
            ("", "v1", "configmaps"),
            ("", "v1", "namespaces"),
            ("apps", "v1", "deployments"),
            ("example.com", "v1", "widgets"),
        ];
        // Every subset of the rules, every request, labeled or not.
        for mask in 0u32..(1 << all.len()) {
            let rules: Vec<RuleNeeds> = (0..all.len())
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| all[i].clone())
                .collect();
            let configuration = mutating(&rules);
            let labeled_namespaces = labeled(&rules);
            for (group, version, resource) in requests {
                let cluster_scoped = resource == "namespaces" || resource == "widgets";
                let namespaces: &[&str] = if resource == "widgets" {
                    &[""]
                } else {
                    &["team-a", "team-b", "team-c", "other"]
                };
                for ns in namespaces {
                    for operation in [Operation::Create, Operation::Update] {
                        // The namespace a rule limited to namespaces looks at: the request's,
                        // or a Namespace object's own name.
                        let namespace = (!cluster_scoped).then_some(*ns);
                        let key = if resource == "namespaces" {
                            Some(*ns)
                        } else {
                            namespace
                        };
                        let labeled = key.is_some_and(|n| labeled_namespaces.contains(n));
                        for actually_labeled in [labeled, false] {
                            let routed = route(
                                &configuration,
                                (group, version, resource, operation),
                                if resource == "namespaces" {
                                    Some(ns)
                                } else {
                                    namespace
                                },
                                actually_labeled,
                            );
                            let served = served();
                            let applies = |r: &RuleNeeds| {
                                r.operations.contains(&operation)
                                    && r.kinds.iter().any(|k| {
                                        served.matching(k).any(|s| {
                                            s.plural == resource
                                                && s.gvk.group == group
                                                && s.never_intercepted().is_none()
                                                && (s.namespaced
                                                    || !(r.namespaced_only
                                                        || (r.namespaces.is_some()
                                                            && resource != "namespaces")))
                                        })
                                    })
                            };
                            let needed = rules.iter().any(applies);
                            let fail_closed = rules.iter().any(|r| {
                                applies(r)
                                    && r.failure_policy == FailurePolicy::Fail
                                    && match &r.namespaces {
                                        None => true,
                                        Some(_) => actually_labeled,
                                    }
                            });
                            let what = format!(
                                "rules {mask:06b}, {operation:?} {group}/{resource} in {ns:?}, labeled {actually_labeled}: {routed:?}"
                            );
                            assert_eq!(routed.len(), usize::from(needed), "{what}");
                            if let Some((_, policy)) = routed.first() {
                                assert_eq!(policy == "Fail", fail_closed, "{what}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn label_changes_add_where_wanted_and_remove_only_initiums_label() {
        const LABEL: &str = "fail-rules.initium.dev/initium";
        let ns = |labels: &[(&str, &str)]| {
            Arc::new(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            )
        };
        let namespaces: NamespaceLabels = [
            ("new".to_string(), ns(&[])),
            ("kept".to_string(), ns(&[(LABEL, "true")])),
            ("stale".to_string(), ns(&[(LABEL, "true")])),
            ("edited".to_string(), ns(&[(LABEL, "no")])),
            ("untouched".to_string(), ns(&[("team", "x")])),
        ]
        .into_iter()
        .collect();
        let wanted: BTreeSet<String> = ["new", "kept", "edited", "missing"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (add, remove) = label_changes(LABEL, &wanted, &namespaces, &BTreeMap::new());
        assert_eq!(
            add,
            ["edited", "new"],
            "a namespace that does not exist is not labeled"
        );
        assert_eq!(remove, ["stale"]);
        // A write the watch has not shown yet is not repeated.
        let pending = BTreeMap::from([("new".to_string(), true)]);
        let (add, _) = label_changes(LABEL, &wanted, &namespaces, &pending);
        assert_eq!(add, ["edited"]);
    }

    #[test]
    fn long_messages_are_bounded() {
        let long = "é".repeat(100_000);
        let cut = bounded(&long);
        assert!(cut.len() < MESSAGE_MAX_BYTES + 40, "{}", cut.len());
        assert!(cut.ends_with("more bytes)"), "{cut}");
        assert_eq!(bounded("short"), "short");
    }

    #[test]
    fn own_and_excluded_namespaces_are_never_sent() {
        let mut config = config();
        config.excluded_namespaces = vec!["kube-system".into(), "audit".into()];
        let configuration = desired_mutating(
            &config,
            Duration::from_millis(200),
            None,
            &shared(&[needs(&["Pod"], &[Operation::Create], FailurePolicy::Ignore)]),
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
