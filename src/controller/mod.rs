//! Everything in `initium serve` that talks to the API server.
//!
//! Every replica watches the rules (compiling them into the index the webhook reads), the
//! Namespaces (for `namespaceSelector`), discovery (which kinds exist) and the gated Pods with
//! what they wait on, and keeps its TLS certificate current. One replica at a time, the
//! holder of a Lease, also writes: rule status, the webhook configurations, renewals of the
//! self-managed certificate and the release of gated Pods.
//!
//! Each of these is a **duty**: one file (or folder), one type implementing `duty::Duty` (its
//! state, and a `run` that works until shutdown). [`run`] starts them all through one
//! supervisor (`duty.rs`), which restarts a duty that fails with backoff, counts its failures
//! in `initium_duty_failures_total{duty}` and its restarts in
//! `initium_duty_restarts_total{duty}`, and stops the controller when a duty cannot go on (an
//! invalid configuration, or failing again and again). Failures a duty retries in place go
//! through the same `duty::Backoff`, so they are logged with the duty's name and counted too.
//!
//! - [`leader`]: the Lease that elects the writer, and the `initium_leader` gauge.
//! - [`rules`]: watch both rule kinds, compile, swap the index, decide which rules are Ready.
//! - [`namespaces`]: watch Namespace labels.
//! - [`lookups`]: watch the objects the Ready rules look up (`spec.lookups`), one watch per
//!   namespace looked up in (and one for every namespace), started and stopped as rules
//!   change.
//! - `gate` (folder): the gate controller. Watches the gated Pods and, per kind, what they
//!   wait on; releases initium's scheduling gates (leader only) when the dependencies hold,
//!   on timeout, or when the rule is gone. `state/` is its pure half (the waiting Pods and
//!   the reverse index, the dependency facts, the decisions), `watch.rs` the dependency
//!   watches, `release.rs` the write (and the patch it writes), `telemetry.rs` its metrics.
//! - [`discovery`]: which kinds the API server serves, and which initium never intercepts.
//! - [`status`]: the `Ready` condition of every rule.
//! - [`webhooks`]: the MutatingWebhookConfiguration and ValidatingWebhookConfiguration.
//! - [`certificates`]: keeps the serving certificate and caBundle current ([`crate::tls`]
//!   loads and reloads them), and the `initium_certificate_expiry_timestamp_seconds` gauge.
//!
//! This file is only the composition root ([`ControllerConfig`], [`run`]): a duty imports the
//! words every duty shares from `vocabulary.rs` (the error, the stop and leader signals,
//! readiness, the field manager), never from here, and gets its settings as arguments.
//!
//! **Adding a duty**: write `src/controller/<duty>.rs` (or a folder, as `gate/`) with a type
//! that implements `duty::Duty` (`const NAME: &str = "gates"` and `async fn run(&mut self,
//! context: Context)`, returning `Ok(())` once `context.stop` is set; failures retried in
//! place go through `context.backoff(first, max)`), then add one line to [`run`]:
//! `duties.start(<duty>::<Type>::new(...));`. It is supervised, restarted and measured
//! like the others.
//!
//! Wiring (what `initium serve` does):
//!
//! ```no_run
//! # async fn serve(client: kube::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use initium::controller::{self, ControllerConfig, WebhookEndpoint};
//! use initium::admission::state::{AdmissionConfig, Shared};
//!
//! let shared = Shared::new(AdmissionConfig::default());
//! let config = ControllerConfig::new(
//!     "initium-system",
//!     WebhookEndpoint::Service { name: "initium".into(), namespace: "initium-system".into(), port: 443 },
//! );
//! let tls = config.load_tls(&client).await?;
//! let server_tls = tls.rustls_config(); // give this to the HTTPS server
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let controller = tokio::spawn(controller::run(client, shared, config, tls, async move {
//!     let _ = stopped.await;
//! }));
//! // ... serve until SIGTERM, then:
//! let _ = stop.send(());
//! # let _ = controller.await;
//! # Ok(())
//! # }
//! ```

pub mod audit;
pub mod certificates;
pub mod discovery;
pub(crate) mod duty;
pub(crate) mod gate;
pub mod leader;
pub mod lookups;
pub mod namespaces;
pub(crate) mod policies;
pub mod rules;
pub mod status;
pub(crate) mod vocabulary;
pub mod webhooks;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::admission::state::Shared;
use crate::tls::{Tls, TlsError, TlsSource};
use duty::Supervisor;
use initium_engine::api::FailurePolicy;
use vocabulary::{Leader, Readiness, Stop};

pub use leader::LeaseSettings;
pub use rules::Quotas;
pub use vocabulary::{ControllerError, FIELD_MANAGER};

pub use webhooks::{WebhookEndpoint, WebhookSettings, webhook_timeout_seconds};

/// Settings of the controller part of `initium serve`. [`ControllerConfig::new`] gives the
/// defaults; every field can be changed afterwards.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// The namespace initium runs in (`--namespace`, usually from `POD_NAMESPACE`). It holds
    /// the Lease and the TLS Secret, and initium never intercepts objects in it, so its own
    /// Pods can always start.
    pub namespace: String,
    /// Where the API server sends admission requests: the Service in front of the replicas
    /// (in-cluster) or a URL (out-of-cluster, e.g. `https://127.0.0.1:8443`). The paths
    /// `/mutate` and `/validate` are appended. Also decides the names in the self-managed
    /// certificate.
    pub endpoint: WebhookEndpoint,
    /// Namespaces whose objects are never intercepted, besides [`namespace`](Self::namespace)
    /// (`--exclude-namespace`; default `kube-system`).
    pub excluded_namespaces: Vec<String>,
    /// Name of the MutatingWebhookConfiguration and of the ValidatingWebhookConfiguration
    /// initium owns (`--webhook-name`; default `initium`).
    pub webhook_configuration: String,
    /// What the API server does with a rule (CREATE/UPDATE of a MutationRule or
    /// ClusterMutationRule) when initium cannot validate it. Default `Fail`: a bad rule is
    /// rejected at `kubectl apply` time as promised, at the price that nobody can create or
    /// change rules while initium is down (deleting rules always works). The CRD schema and
    /// its CEL rules still catch most mistakes, and a rule that slips through is only marked
    /// `Ready=False` and never run, so `Ignore` is safe too, just less helpful.
    pub rule_validation_policy: FailurePolicy,
    /// Where the serving certificate comes from.
    pub tls: TlsSource,
    /// The Lease that elects the replica that writes.
    pub lease: LeaseSettings,
    /// How often discovery is read again even when no CustomResourceDefinition changed
    /// (aggregated APIs come and go without one). Default 60 s.
    pub discovery_interval: Duration,
    /// How often the leader compares the webhook configurations with the API server even
    /// when nothing changed, to repair manual edits or deletions. Default 60 s.
    pub resync_interval: Duration,
    /// Pods the gate controller releases at once (`--gate-release-concurrency`; default
    /// [`DEFAULT_GATE_RELEASE_CONCURRENCY`]).
    pub gate_release_concurrency: usize,
    /// How often each replica publishes the audit Events (`--audit-report-interval`).
    pub audit_report_interval: Duration,
    /// What the MutationRules of one namespace may make initium hold.
    pub quotas: rules::Quotas,
    /// Audit Events per namespace and interval (`--max-audit-events-per-namespace`); more are
    /// summed up in one.
    pub max_audit_events_per_namespace: usize,
    /// Distinct ConfigMaps the MutationRules of one namespace may look up together
    /// (`--max-lookups-per-namespace`; default [`DEFAULT_MAX_LOOKUPS_PER_NAMESPACE`]);
    /// ClusterMutationRules are exempt.
    pub max_lookups_per_namespace: usize,
    /// Distinct objects the gates of one namespace's MutationRules may wait on together
    /// (`--max-gate-objects-per-namespace`); ClusterMutationRules are exempt.
    pub max_gate_objects_per_namespace: usize,
    /// Whether Ready rules that a MutatingAdmissionPolicy can serve exactly are compiled to
    /// one (`--compile-rules`; default [`CompileRules::Off`]).
    pub compile_rules: CompileRules,
    /// At most this many rules compiled (`--max-compiled-rules`).
    pub max_compiled_rules: usize,
}

/// `--compile-rules`: whether the API server serves the rules it can (docs/rules.md, "Served
/// by the API server").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CompileRules {
    /// Every rule is served by initium's webhook; generated policies left by an earlier run
    /// are deleted.
    #[default]
    Off,
    /// A Ready rule a MutatingAdmissionPolicy does exactly (and that no earlier rule may
    /// meet) is served by the API server through a generated policy.
    Auto,
}

pub use rules::{DEFAULT_MAX_GATE_OBJECTS_PER_NAMESPACE, DEFAULT_MAX_LOOKUPS_PER_NAMESPACE};

/// Default `--gate-release-concurrency`: on the 2-core test machine, 1,000 Pods released by
/// one dependency took 5.9 s at 16 and 3.9 s at 64 (`scripts/bench gate`, BENCHMARKS.md).
pub const DEFAULT_GATE_RELEASE_CONCURRENCY: u16 = 64;

impl ControllerConfig {
    /// The defaults: exclude `kube-system`, configurations and Lease named `initium`, rule
    /// validation `Fail`, a self-managed certificate in the Secret `initium-tls`.
    pub fn new(namespace: impl Into<String>, endpoint: WebhookEndpoint) -> ControllerConfig {
        ControllerConfig {
            namespace: namespace.into(),
            endpoint,
            excluded_namespaces: vec!["kube-system".into()],
            webhook_configuration: "initium".into(),
            rule_validation_policy: FailurePolicy::Fail,
            tls: TlsSource::SelfManaged {
                secret: "initium-tls".into(),
                refresh_interval: Duration::from_secs(60),
            },
            lease: LeaseSettings::default(),
            discovery_interval: Duration::from_secs(60),
            resync_interval: Duration::from_secs(60),
            gate_release_concurrency: usize::from(DEFAULT_GATE_RELEASE_CONCURRENCY),
            audit_report_interval: audit::DEFAULT_AUDIT_REPORT_INTERVAL,
            quotas: rules::Quotas::default(),
            max_audit_events_per_namespace: audit::DEFAULT_MAX_AUDIT_EVENTS_PER_NAMESPACE as usize,
            max_lookups_per_namespace: DEFAULT_MAX_LOOKUPS_PER_NAMESPACE,
            max_gate_objects_per_namespace: DEFAULT_MAX_GATE_OBJECTS_PER_NAMESPACE,
            compile_rules: CompileRules::Off,
            max_compiled_rules: initium_engine::policy::DEFAULT_MAX_COMPILED,
        }
    }

    /// Loads (or, self-managed, creates) the serving certificate this configuration names:
    /// from its [`tls`](Self::tls) source, for its endpoint's names. Call once at start,
    /// before serving; pass the result to [`run`], which keeps it current.
    pub async fn load_tls(&self, client: &kube::Client) -> Result<Tls, TlsError> {
        let names = self.endpoint.certificate_names();
        crate::tls::load(client, &self.namespace, names, &self.tls).await
    }

    /// What the `webhooks` duty builds the two webhook configurations from.
    pub fn webhook_settings(&self) -> WebhookSettings {
        WebhookSettings {
            namespace: self.namespace.clone(),
            endpoint: self.endpoint.clone(),
            excluded_namespaces: self.excluded_namespaces.clone(),
            webhook_configuration: self.webhook_configuration.clone(),
            rule_validation_policy: self.rule_validation_policy,
            resync_interval: self.resync_interval,
        }
    }

    /// Checks what the API server would otherwise reject later, or what would panic.
    pub fn validate(&self) -> Result<(), ControllerError> {
        let config = |message: String| Err(ControllerError::Config(message));
        if self.namespace.is_empty() {
            return config("the namespace initium runs in must be set (--namespace)".into());
        }
        if self.webhook_configuration.is_empty() {
            return config("the webhook configuration name must not be empty".into());
        }
        if self.webhook_configuration.len() > webhooks::MAX_CONFIGURATION_NAME
            || !self
                .webhook_configuration
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            || !self
                .webhook_configuration
                .starts_with(|c: char| c.is_ascii_alphanumeric())
            || !self
                .webhook_configuration
                .ends_with(|c: char| c.is_ascii_alphanumeric())
        {
            return config(format!(
                "the webhook configuration name {:?} (--webhook-name) must be at most {} lowercase letters, digits, '-' or '.', starting and ending with a letter or digit: it also names the label {} on the namespaces with Fail rules",
                self.webhook_configuration,
                webhooks::MAX_CONFIGURATION_NAME,
                webhooks::FAIL_RULES_LABEL_PREFIX
            ));
        }
        self.endpoint.validate()?;
        self.lease.validate()?;
        for (name, value) in [
            ("discovery interval", self.discovery_interval),
            ("resync interval", self.resync_interval),
            (
                "audit report interval (--audit-report-interval)",
                self.audit_report_interval,
            ),
        ] {
            if value.is_zero() {
                return config(format!("the {name} must be more than zero"));
            }
        }
        if self.gate_release_concurrency == 0 {
            return config("the gate release concurrency must be at least 1".into());
        }
        self.tls.validate()?;
        Ok(())
    }
}

/// Runs the controller until `shutdown` completes: the watches that feed `shared` (rule
/// index, Namespace labels, readiness), the leader election, and, while this replica holds
/// the Lease, the writers (rule status, webhook configurations, certificate renewal). `tls`
/// comes from [`ControllerConfig::load_tls`]; the controller keeps it current (reloading the
/// certificate the HTTPS server uses and publishing the caBundle).
///
/// Watches and writes that fail are retried with backoff, logged and counted per duty; a duty
/// that stops is restarted with backoff. An error is returned for an invalid configuration, or
/// when a duty fails `duty::MAX_CONSECUTIVE_FAILURES` (6) times in a row (see the module
/// documentation). On shutdown the Lease is released so another replica
/// takes over without waiting for it to expire; the webhook configurations are left in place
/// for the other replicas.
pub async fn run(
    client: kube::Client,
    shared: Arc<Shared>,
    config: ControllerConfig,
    tls: Tls,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ControllerError> {
    config.validate()?;
    let mut config = config;
    // One identity per process, for the Lease and for what the duties report (the gate
    // controller's Events name the replica that wrote).
    let identity = config.lease.identity();
    config.lease.identity = Some(identity.clone());
    let (stop_tx, stop) = Stop::channel();
    let (leader_tx, leader) = watch::channel(false);
    let leader = Leader::new(leader);
    let readiness = Arc::new(Readiness::new(shared.clone()));
    let (served_tx, served_rx) = watch::channel(None);
    let (snapshot_tx, snapshot_rx) = watch::channel(Arc::new(rules::Snapshot::default()));
    let (needs_tx, needs_rx) = watch::channel(Arc::new(webhooks::Inputs::default()));
    let (applied_tx, applied_rx) = watch::channel(None);
    let (refused_tx, refused_rx) = watch::channel(None);
    let (namespaces_tx, namespaces_rx) = watch::channel(None);
    let (in_effect_tx, in_effect_rx) = watch::channel(Arc::new(std::collections::BTreeSet::new()));
    let compile = (config.compile_rules == CompileRules::Auto).then(|| {
        let mut excluded = vec![config.namespace.clone()];
        excluded.extend(config.excluded_namespaces.iter().cloned());
        excluded.sort();
        excluded.dedup();
        Arc::new(initium_engine::policy::PolicySettings {
            owner: config.webhook_configuration.clone(),
            excluded_namespaces: excluded,
            max_compiled: config.max_compiled_rules,
        })
    });
    let ca_bundle = tls.ca_bundle_receiver();

    // Every duty of the controller, one line each.
    let mut duties = Supervisor::new(&shared.metrics, stop);
    duties.start(leader::Lease::new(
        client.clone(),
        &config.namespace,
        &config.lease,
        leader_tx,
        shared.metrics.leader.clone(),
    ));
    duties.start(namespaces::Namespaces::new(
        client.clone(),
        shared.clone(),
        readiness.clone(),
        namespaces_tx,
    ));
    duties.start(discovery::Discovery::new(
        client.clone(),
        config.discovery_interval,
        served_tx,
    ));
    duties.start(rules::Rules::new(
        client.clone(),
        rules::NamespaceQuotas {
            rules: config.quotas,
            lookups: rules::LookupQuota(config.max_lookups_per_namespace),
            gate_objects: rules::GateObjectQuota(config.max_gate_objects_per_namespace),
            compile,
        },
        shared.clone(),
        readiness.clone(),
        served_rx,
        snapshot_tx,
        needs_tx,
    ));
    duties.start(lookups::Lookups::new(
        client.clone(),
        shared.clone(),
        readiness.clone(),
        snapshot_rx.clone(),
    ));
    duties.start(gate::Gates::new(
        client.clone(),
        shared.clone(),
        readiness.clone(),
        snapshot_rx.clone(),
        leader.clone(),
        identity.clone(),
        config.gate_release_concurrency,
    ));
    duties.start(audit::Audit::new(
        client.clone(),
        shared.clone(),
        snapshot_rx.clone(),
        identity,
        config.audit_report_interval,
        config.max_audit_events_per_namespace,
    ));
    duties.start(status::Status::new(
        client.clone(),
        snapshot_rx,
        needs_rx.clone(),
        status::Effect {
            applied: applied_rx,
            refused: refused_rx,
            policies: in_effect_rx.clone(),
        },
        leader.clone(),
        shared.clone(),
    ));
    let client_for_policies = client.clone();
    duties.start(webhooks::Webhooks::new(
        client,
        Arc::new(config.webhook_settings()),
        shared.config.budget,
        webhooks::Watched {
            needs: needs_rx.clone(),
            in_effect: in_effect_rx,
            namespaces: namespaces_rx,
            ca_bundle,
        },
        leader.clone(),
        webhooks::Published {
            applied: applied_tx,
            refused: refused_tx,
        },
        shared.clone(),
    ));
    duties.start(policies::Policies::new(
        client_for_policies,
        needs_rx,
        leader.clone(),
        config.webhook_configuration.clone(),
        in_effect_tx,
    ));
    duties.start(certificates::Certificates::new(
        tls,
        leader,
        shared.metrics.certificate_expiry.clone(),
    ));
    duties.run(shutdown, stop_tx).await
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn named(name: &str) -> Result<(), ControllerError> {
        let mut config = ControllerConfig::new(
            "initium-system",
            WebhookEndpoint::Url("https://127.0.0.1:8443".into()),
        );
        config.webhook_configuration = name.into();
        config.validate()
    }

    #[test]
    fn the_webhook_configuration_name_must_fit_the_label_it_names() {
        assert!(named("initium").is_ok());
        assert!(named(&"a".repeat(63)).is_ok());
        for bad in [
            &"a".repeat(64),
            "Initium",
            "-initium",
            "initium.",
            "init_ium",
        ] {
            let message = named(bad).unwrap_err().to_string();
            assert!(
                message.contains("--webhook-name") && message.contains("fail-rules.initium.dev/"),
                "{bad}: {message}"
            );
        }
    }
}
