//! Which kinds the API server serves (discovery), and which of them initium never intercepts.
//!
//! Kind patterns in rules (`Pod`, `apps/*/Deployment`, `*`) are expanded against discovery to
//! the resources listed in the webhook configuration, and a rule whose pattern matches
//! nothing served is not Ready (`KindNotServed`). Discovery is read again whenever a
//! CustomResourceDefinition changes and every `discovery_interval` otherwise.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::core::PartialObjectMeta;
use kube::core::discovery::v2::APIGroupDiscoveryList;
use kube::discovery::{self as api_discovery, Scope};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::Instant;

use super::duty::{Context, Duty};
use super::vocabulary::ControllerError;
use crate::report::report;
use initium_engine::{Gvk, KindPattern};

/// One top-level resource the API server serves (subresources such as `pods/status` are
/// never listed: rules match objects, not subresources).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServedResource {
    pub gvk: Gvk,
    /// The resource name used in webhook rules, e.g. `deployments`.
    pub plural: String,
    pub namespaced: bool,
    /// The resource can be created (so CREATE can be intercepted).
    pub create: bool,
    /// The resource can be updated or patched (so UPDATE can be intercepted).
    pub update: bool,
}

impl ServedResource {
    /// `deployments.apps`, `pods` (for messages).
    pub fn resource_name(&self) -> String {
        if self.gvk.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.gvk.group)
        }
    }

    /// Why initium never intercepts this resource, whatever a rule says; `None` if it may.
    pub fn never_intercepted(&self) -> Option<&'static str> {
        NEVER_INTERCEPTED
            .iter()
            .find(|(group, resource, _)| {
                *group == self.gvk.group && (*resource == "*" || *resource == self.plural)
            })
            .map(|(_, _, why)| *why)
    }
}

/// Resources initium never intercepts, even when a rule's kinds (including `*`) match them:
/// `(group, resource or "*" for the whole group, why)`. The list is about not locking the
/// cluster: with a `Fail` rule and initium down, nothing here may be blocked, because the API
/// server, the nodes or initium itself need it to work or to recover.
pub const NEVER_INTERCEPTED: &[(&str, &str, &str)] = &[
    (
        "initium.dev",
        "*",
        "initium's own rules are checked by its validating webhook and never mutated",
    ),
    (
        "admissionregistration.k8s.io",
        "*",
        "webhook and admission policy configurations must stay fixable while initium is down",
    ),
    (
        "apiextensions.k8s.io",
        "*",
        "CustomResourceDefinitions (initium's own included) must stay installable while initium is down",
    ),
    (
        "apiregistration.k8s.io",
        "*",
        "APIServices make up discovery; blocking them breaks aggregated APIs",
    ),
    (
        "authentication.k8s.io",
        "*",
        "token and identity reviews are requests, not stored objects",
    ),
    (
        "authorization.k8s.io",
        "*",
        "access reviews are requests, not stored objects",
    ),
    (
        "rbac.authorization.k8s.io",
        "*",
        "the API server reconciles its default roles at start and must not wait on a webhook",
    ),
    (
        "flowcontrol.apiserver.k8s.io",
        "*",
        "the API server maintains its own priority and fairness configuration",
    ),
    (
        "internal.apiserver.k8s.io",
        "*",
        "the API server's own bookkeeping",
    ),
    (
        "coordination.k8s.io",
        "leases",
        "node heartbeats and leader election must never wait on a webhook",
    ),
    (
        "certificates.k8s.io",
        "certificatesigningrequests",
        "nodes join and renew their certificates through them",
    ),
    (
        "",
        "nodes",
        "nodes register themselves; blocking them can keep initium from being scheduled",
    ),
    (
        "",
        "events",
        "events are high-volume records, not workloads",
    ),
    (
        "events.k8s.io",
        "events",
        "events are high-volume records, not workloads",
    ),
    (
        "",
        "bindings",
        "bindings are scheduling requests, not objects",
    ),
];

/// Everything served, sorted (so whatever is derived from it is deterministic).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Served {
    resources: Vec<ServedResource>,
}

impl Served {
    pub fn new(mut resources: Vec<ServedResource>) -> Served {
        resources.retain(|r| !r.plural.contains('/') && !r.gvk.kind.is_empty());
        resources.sort();
        resources.dedup();
        Served { resources }
    }

    pub fn resources(&self) -> &[ServedResource] {
        &self.resources
    }

    /// The served resources whose kind matches `pattern`.
    pub fn matching<'a>(
        &'a self,
        pattern: &'a KindPattern,
    ) -> impl Iterator<Item = &'a ServedResource> + 'a {
        self.resources.iter().filter(|r| pattern.matches(&r.gvk))
    }

    /// Whether `gvk` is served namespaced (`Some(true)`), cluster-scoped (`Some(false)`), or
    /// not at all (`None`).
    pub fn namespaced(&self, gvk: &Gvk) -> Option<bool> {
        self.resources
            .iter()
            .find(|r| r.gvk == *gvk)
            .map(|r| r.namespaced)
    }

    /// The versions in which `group`/`kind` is served (for "did you mean" messages).
    pub fn versions_of(&self, group: Option<&str>, kind: &str) -> BTreeSet<String> {
        self.resources
            .iter()
            .filter(|r| r.gvk.kind == kind && group.is_none_or(|g| g == r.gvk.group))
            .map(|r| r.gvk.api_version())
            .collect()
    }
}

impl Served {
    /// Whether the API server runs MutatingAdmissionPolicies (`admissionregistration.k8s.io/v1`,
    /// Kubernetes 1.36 and later), which compiled rules become.
    pub fn serves_mutating_policies(&self) -> bool {
        self.namespaced(&Gvk::new(
            "admissionregistration.k8s.io",
            "v1",
            "MutatingAdmissionPolicy",
        )) == Some(false)
            && self.namespaced(&Gvk::new(
                "admissionregistration.k8s.io",
                "v1",
                "MutatingAdmissionPolicyBinding",
            )) == Some(false)
    }
}

/// What a kind pattern names for the policy compiler: the served resources initium may
/// intercept (the ones it never intercepts are left out, as from the webhook configuration).
impl initium_engine::policy::Resources for Served {
    fn matching(&self, pattern: &KindPattern) -> Vec<initium_engine::policy::Resource> {
        Served::matching(self, pattern)
            .filter(|r| r.never_intercepted().is_none())
            .map(|r| initium_engine::policy::Resource {
                gvk: r.gvk.clone(),
                plural: r.plural.clone(),
                namespaced: r.namespaced,
            })
            .collect()
    }
}

/// Reads discovery: the aggregated documents (two requests), or group by group on API servers
/// without aggregated discovery (before Kubernetes 1.26).
pub async fn discover(client: &Client) -> Result<Served, kube::Error> {
    match aggregated(client).await {
        Ok(served) if served.resources.iter().any(|r| r.gvk.group.is_empty()) => Ok(served),
        Ok(_) => legacy(client).await,
        Err(e) => {
            tracing::debug!(error = %report(&e), "aggregated discovery failed; reading group by group");
            legacy(client).await
        }
    }
}

async fn aggregated(client: &Client) -> Result<Served, kube::Error> {
    let core = client.list_core_api_versions_aggregated().await?;
    let groups = client.list_api_groups_aggregated().await?;
    let mut resources = Vec::new();
    for list in [core, groups] {
        collect_aggregated(list, &mut resources);
    }
    Ok(Served::new(resources))
}

fn collect_aggregated(list: APIGroupDiscoveryList, out: &mut Vec<ServedResource>) {
    for group in list.items {
        let group_name = group.metadata.and_then(|m| m.name).unwrap_or_default();
        for version in group.versions {
            let Some(version_name) = version.version else {
                continue;
            };
            for resource in version.resources {
                let (Some(plural), Some(kind)) = (
                    resource.resource,
                    resource.response_kind.and_then(|k| k.kind),
                ) else {
                    continue;
                };
                let verb = |v: &str| resource.verbs.iter().any(|have| have == v);
                out.push(ServedResource {
                    gvk: Gvk::new(&group_name, &version_name, &kind),
                    plural,
                    namespaced: resource.scope.as_deref() == Some("Namespaced"),
                    create: verb("create"),
                    update: verb("update") || verb("patch"),
                });
            }
        }
    }
}

async fn legacy(client: &Client) -> Result<Served, kube::Error> {
    let discovery = api_discovery::Discovery::new(client.clone()).run().await?;
    let mut resources = Vec::new();
    for group in discovery.groups() {
        for version in group.versions() {
            for (resource, caps) in group.versioned_resources(version) {
                let verb = |v: &str| caps.operations.iter().any(|have| have == v);
                resources.push(ServedResource {
                    gvk: Gvk::new(&resource.group, &resource.version, &resource.kind),
                    plural: resource.plural.clone(),
                    namespaced: caps.scope == Scope::Namespaced,
                    create: verb("create"),
                    update: verb("update") || verb("patch"),
                });
            }
        }
    }
    Ok(Served::new(resources))
}

/// After a CustomResourceDefinition changes, discovery is read again after these delays: the
/// API server publishes a new kind shortly after the CRD is Established, not at once.
const AFTER_CRD_CHANGE: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(5)];

/// First retry after discovery failed; the wait doubles up to [`RETRY_MAX`] (and never
/// exceeds the discovery interval).
const RETRY_FIRST: Duration = Duration::from_secs(2);
const RETRY_MAX: Duration = Duration::from_secs(32);

/// The `discovery` duty: keeps `served` current. Reads discovery at start (retrying until it
/// works), after CustomResourceDefinition changes, and every `interval`. Only changes are
/// published.
pub(crate) struct Discovery {
    client: Client,
    interval: Duration,
    served: watch::Sender<Option<Arc<Served>>>,
}

impl Discovery {
    pub(crate) fn new(
        client: Client,
        interval: Duration,
        served: watch::Sender<Option<Arc<Served>>>,
    ) -> Discovery {
        Discovery {
            client,
            interval,
            served,
        }
    }
}

impl Duty for Discovery {
    const NAME: &'static str = "discovery";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let crds = Api::<PartialObjectMeta<CustomResourceDefinition>>::all(self.client.clone());
        let mut crd_changes = watcher(crds, watcher::Config::default())
            .default_backoff()
            .boxed();
        // The next periodic read, and earlier reads asked for by CRD changes or failures.
        let mut periodic = Instant::now();
        let mut soon: Vec<Instant> = Vec::new();
        let mut backoff = context.backoff(RETRY_FIRST, RETRY_MAX.min(self.interval));
        loop {
            let next = soon.iter().copied().fold(periodic, Instant::min);
            tokio::select! {
                () = context.stop.wait() => return Ok(()),
                event = crd_changes.next() => match event {
                    Some(Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_))) => {
                        let now = Instant::now();
                        soon.extend(AFTER_CRD_CHANGE.iter().map(|d| now + *d));
                    }
                    Some(Ok(_)) => {}
                    // The watch retries with its own backoff.
                    Some(Err(e)) => context.watch_failed("watching CustomResourceDefinitions failed; retrying", &e),
                    None => return Ok(()),
                },
                () = tokio::time::sleep_until(next) => {
                    let now = Instant::now();
                    soon.retain(|t| *t > now);
                    periodic = now + self.interval;
                    match discover(&self.client).await {
                        Ok(found) => {
                            backoff.succeeded();
                            self.served.send_if_modified(|current| {
                                if current.as_deref() == Some(&found) {
                                    return false;
                                }
                                tracing::debug!(resources = found.resources().len(), "discovery changed");
                                *current = Some(Arc::new(found));
                                true
                            });
                        }
                        Err(e) => soon.push(now + backoff.failed("discovery failed", &report(&e))),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
pub(crate) mod tests {
    use super::*;

    /// A small cluster: pods, namespaces, nodes, deployments, HPAs in two versions, leases,
    /// events, and a CRD-like `widgets.example.com`.
    pub(crate) fn served() -> Served {
        let r = |group: &str, version: &str, kind: &str, plural: &str, namespaced: bool| {
            ServedResource {
                gvk: Gvk::new(group, version, kind),
                plural: plural.into(),
                namespaced,
                create: true,
                update: true,
            }
        };
        Served::new(vec![
            r("", "v1", "Pod", "pods", true),
            r("", "v1", "Namespace", "namespaces", false),
            r("", "v1", "Node", "nodes", false),
            r("", "v1", "Event", "events", true),
            r("", "v1", "ConfigMap", "configmaps", true),
            r("apps", "v1", "Deployment", "deployments", true),
            r(
                "autoscaling",
                "v1",
                "HorizontalPodAutoscaler",
                "horizontalpodautoscalers",
                true,
            ),
            r(
                "autoscaling",
                "v2",
                "HorizontalPodAutoscaler",
                "horizontalpodautoscalers",
                true,
            ),
            r("coordination.k8s.io", "v1", "Lease", "leases", true),
            r(
                "initium.dev",
                "v1alpha1",
                "MutationRule",
                "mutationrules",
                true,
            ),
            r("example.com", "v1", "Widget", "widgets", false),
            ServedResource {
                create: false,
                ..r("", "v1", "ComponentStatus", "componentstatuses", false)
            },
            r("", "v1", "Pod", "pods/status", true),
        ])
    }

    #[test]
    fn subresources_are_never_served_resources() {
        assert!(served().resources().iter().all(|r| !r.plural.contains('/')));
    }

    #[test]
    fn matching_expands_wildcards() {
        let served = served();
        let names = |p: &str| -> Vec<String> {
            let pattern = KindPattern::parse(p).unwrap();
            served
                .matching(&pattern)
                .map(|r| r.gvk.to_string())
                .collect()
        };
        assert_eq!(names("Pod"), ["v1/Pod"]);
        assert_eq!(
            names("HorizontalPodAutoscaler"),
            [
                "autoscaling/v1/HorizontalPodAutoscaler",
                "autoscaling/v2/HorizontalPodAutoscaler"
            ]
        );
        assert_eq!(
            names("autoscaling/v2/HorizontalPodAutoscaler"),
            ["autoscaling/v2/HorizontalPodAutoscaler"]
        );
        assert!(
            names("v1/Deployment").is_empty(),
            "core group has no Deployment"
        );
        assert_eq!(names("*").len(), served.resources().len());
    }

    #[test]
    fn the_never_intercepted_list_covers_locks() {
        let served = served();
        let never: Vec<String> = served
            .resources()
            .iter()
            .filter(|r| r.never_intercepted().is_some())
            .map(ServedResource::resource_name)
            .collect();
        assert_eq!(
            never,
            [
                "events",
                "nodes",
                "leases.coordination.k8s.io",
                "mutationrules.initium.dev"
            ]
        );
    }
}
