//! A whole cluster for tests (`scripts/control-plane up --nodes N`: controller manager,
//! scheduler, nodes simulated by kwok) and what users run on it: Deployments, Jobs,
//! Services, and waits for what the real controllers make of them (a Deployment Available,
//! a Job succeeded, Pods Running and Ready, a Service's ready endpoints).
//!
//! Every wait has a deadline and, when it runs out, says what it last saw: on a loaded
//! machine a rollout is slow, and "timed out" alone does not say whether it was stuck at 3
//! of 10 Pods or at none.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Container, Pod, PodSpec, PodTemplateSpec, Service, ServiceAccount, ServicePort, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, ListParams, ObjectMeta};

use super::plane::Plane;
use super::wait::eventually;

/// How many simulated nodes the whole cluster has: enough that a Deployment's Pods spread.
pub const NODES: u32 = 3;

/// The whole cluster this test binary shares, started on first use (`up --nodes`, in
/// `target/tmp/initium-cluster-<pid>`) and stopped by itself when the binary exits; or, with
/// `INITIUM_TEST_KUBECONFIG`, that cluster (which then must have nodes and controllers).
pub fn cluster() -> &'static Plane {
    if std::env::var_os("INITIUM_TEST_KUBECONFIG").is_some() {
        return Plane::shared();
    }
    static CLUSTER: OnceLock<Plane> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let tmp = option_env!("CARGO_TARGET_TMPDIR").map_or_else(std::env::temp_dir, PathBuf::from);
        let dir = tmp.join(format!("initium-cluster-{}", std::process::id()));
        Plane::start_cluster(dir, Some(NODES)).unwrap_or_else(|e| panic!("{e:#}"))
    })
}

/// A client for [`cluster`] (a new one per call: every `#[tokio::test]` has its own runtime).
pub async fn client() -> kube::Client {
    cluster().client().await.unwrap_or_else(|e| panic!("{e:#}"))
}

/// Creates a namespace named `<prefix>-<unique suffix>` and waits until its `default`
/// ServiceAccount exists: with nodes, the API server's ServiceAccount admission plugin
/// rejects Pods until it does.
pub async fn namespace(client: &kube::Client, prefix: &str) -> String {
    let name = super::cluster::namespace(client, prefix).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
    eventually(
        &format!("the default ServiceAccount of namespace {name}"),
        Duration::from_secs(60),
        || async {
            match accounts.get_opt("default").await {
                Ok(Some(_)) => Ok(()),
                Ok(None) => Err("not created yet".to_owned()),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    name
}

/// `app: <name>`: the labels of a workload's Pods and the selector that finds them.
pub fn app_labels(name: &str) -> BTreeMap<String, String> {
    [("app".to_owned(), name.to_owned())].into()
}

/// A Pod template: one container (kwok runs nothing, so the image is only a name).
fn template(labels: BTreeMap<String, String>, restart_policy: Option<&str>) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some("registry.example.com/app:1".into()),
                ..Container::default()
            }],
            restart_policy: restart_policy.map(String::from),
            ..PodSpec::default()
        }),
    }
}

/// A Deployment of `replicas` Pods labelled `app: <name>`.
pub fn deployment(name: &str, replicas: i32) -> Deployment {
    Deployment {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(app_labels(name)),
                ..LabelSelector::default()
            },
            template: template(app_labels(name), None),
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// A Job that needs `completions` Pods to succeed, one at a time (kwok completes each Pod
/// of a Job as soon as it runs).
pub fn job(name: &str, completions: i32) -> Job {
    Job {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            completions: Some(completions),
            parallelism: Some(1),
            template: template(app_labels(name), Some("Never")),
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}

/// A ClusterIP Service for the Pods labelled `app: <app>`.
pub fn service(name: &str, app: &str) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            selector: Some(app_labels(app)),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// Waits until the Deployment has rolled out its current generation: observed, every replica
/// updated and available, no old Pod left. Returns it as last seen.
pub async fn deployment_available(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Deployment {
    let api: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    eventually(
        &format!("Deployment {namespace}/{name} to be Available"),
        timeout,
        || async {
            let deployment = api.get(name).await.map_err(|e| e.to_string())?;
            let generation = deployment.metadata.generation;
            let wanted = deployment.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let status = deployment.status.clone().unwrap_or_default();
            let seen = format!(
                "generation {generation:?}, observed {:?}; {wanted} wanted, {} updated, {} available, {} in all",
                status.observed_generation,
                status.updated_replicas.unwrap_or(0),
                status.available_replicas.unwrap_or(0),
                status.replicas.unwrap_or(0),
            );
            let done = status.observed_generation == generation
                && status.updated_replicas == Some(wanted)
                && status.available_replicas == Some(wanted)
                && status.replicas == Some(wanted);
            if done { Ok(deployment) } else { Err(seen) }
        },
    )
    .await
}

/// Waits until the Job has succeeded: `status.succeeded` reached its completions. Returns it.
pub async fn job_succeeded(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Job {
    let api: Api<Job> = Api::namespaced(client.clone(), namespace);
    eventually(
        &format!("Job {namespace}/{name} to succeed"),
        timeout,
        || async {
            let job = api.get(name).await.map_err(|e| e.to_string())?;
            let completions = job.spec.as_ref().and_then(|s| s.completions).unwrap_or(1);
            let status = job.status.clone().unwrap_or_default();
            let conditions: Vec<String> = status
                .conditions
                .iter()
                .flatten()
                .map(|c| format!("{}={}", c.type_, c.status))
                .collect();
            let seen = format!(
                "{} of {completions} succeeded, {} active, {} failed, conditions [{}]",
                status.succeeded.unwrap_or(0),
                status.active.unwrap_or(0),
                status.failed.unwrap_or(0),
                conditions.join(", ")
            );
            if status.succeeded == Some(completions) {
                Ok(job)
            } else {
                Err(seen)
            }
        },
    )
    .await
}

/// The Pods of `namespace` matching the label `selector` (e.g. `app=web`) that are not being
/// deleted.
pub async fn pods(
    client: &kube::Client,
    namespace: &str,
    selector: &str,
) -> kube::Result<Vec<Pod>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = api.list(&ListParams::default().labels(selector)).await?;
    Ok(list
        .items
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .collect())
}

/// Whether the Pod is Running with its `Ready` condition True.
pub fn running_and_ready(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Waits until exactly `count` Pods match `selector` (none being deleted) and each is Running
/// and Ready. Returns them.
pub async fn pods_running_and_ready(
    client: &kube::Client,
    namespace: &str,
    selector: &str,
    count: usize,
    timeout: Duration,
) -> Vec<Pod> {
    eventually(
        &format!("{count} Pods {selector} in {namespace} to be Running and Ready"),
        timeout,
        || async {
            let pods = pods(client, namespace, selector)
                .await
                .map_err(|e| e.to_string())?;
            let ready = pods.iter().filter(|pod| running_and_ready(pod)).count();
            if pods.len() == count && ready == count {
                Ok(pods)
            } else {
                Err(format!(
                    "{} Pods, {ready} of them Running and Ready",
                    pods.len()
                ))
            }
        },
    )
    .await
}

/// Waits until the EndpointSlices of the Service list exactly `count` ready endpoints.
/// Returns the slices.
pub async fn ready_endpoints(
    client: &kube::Client,
    namespace: &str,
    service: &str,
    count: usize,
    timeout: Duration,
) -> Vec<EndpointSlice> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), namespace);
    let selector = format!("kubernetes.io/service-name={service}");
    eventually(
        &format!("Service {namespace}/{service} to have {count} ready endpoints"),
        timeout,
        || async {
            let slices = api
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|e| e.to_string())?
                .items;
            let endpoints: Vec<_> = slices.iter().flat_map(|s| &s.endpoints).collect();
            let ready = endpoints
                .iter()
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                .count();
            if ready == count && endpoints.len() == count {
                Ok(slices)
            } else {
                Err(format!(
                    "{} EndpointSlices, {} endpoints, {ready} of them ready",
                    slices.len(),
                    endpoints.len()
                ))
            }
        },
    )
    .await
}
