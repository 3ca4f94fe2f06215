//! The controller's shared words: what every duty is handed, returns or writes the same way.
//! The duties import it; it imports no duty, so `mod.rs` stays the composition root alone.
//!
//! - [`ControllerError`]: what a duty returns, and what stops the controller;
//! - [`Stop`], [`Leader`], [`Readiness`]: the signals a duty is handed (shutdown, whether this
//!   replica writes, `/readyz`);
//! - [`FIELD_MANAGER`], [`READY`], [`json_hash`]: how initium writes and compares what it
//!   writes.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use crate::admission::state::Shared;
use crate::tls::TlsError;

/// The field manager of everything initium writes (server-side apply and status patches).
pub const FIELD_MANAGER: &str = "initium";

/// The condition type initium writes on every rule (`kubectl get` shows it in READY).
pub const READY: &str = "Ready";

/// A hash of `salt` and `value` as JSON: tells whether a spec or a status is the same as one
/// seen before without keeping a copy of it. Serializing a typed spec or status (string keys
/// only) cannot fail.
pub(crate) fn json_hash(salt: &Option<String>, value: &impl serde::Serialize) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    salt.hash(&mut hasher);
    serde_json::to_vec(value)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

/// What can stop the controller, or fail one of its calls, with the object and call involved.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The configuration cannot work; the message says which setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A call to the API server failed.
    #[error("cannot {action} {object}")]
    Api {
        /// What initium tried, e.g. `apply MutatingWebhookConfiguration`.
        action: &'static str,
        /// Which object, e.g. `initium` or `initium-system/initium-tls`.
        object: String,
        #[source]
        source: kube::Error,
    },
    /// The serving certificate could not be loaded or kept current.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A duty of the controller ended unexpectedly.
    #[error("controller task {task} stopped: {message}")]
    Task { task: &'static str, message: String },
    /// A duty failed again and again, restarts did not help: the controller stops.
    #[error(
        "the {duty} duty failed {failures} times in a row and restarts did not help (check that \
         the API server is reachable and that initium's RBAC allows what the duty does); the \
         last failure"
    )]
    Duty {
        duty: &'static str,
        failures: u32,
        #[source]
        source: Box<ControllerError>,
    },
}

impl ControllerError {
    /// Whether no retry can help: the configuration itself is wrong. The supervisor stops the
    /// controller at once on such an error instead of restarting the duty.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            ControllerError::Config(_) | ControllerError::Tls(TlsError::Config(_))
        )
    }

    pub(crate) fn api(
        action: &'static str,
        object: impl Into<String>,
        source: kube::Error,
    ) -> Self {
        ControllerError::Api {
            action,
            object: object.into(),
            source,
        }
    }
}

/// Tells the duties to stop: set once, on shutdown.
#[derive(Clone, Debug)]
pub(crate) struct Stop(watch::Receiver<bool>);

impl Stop {
    pub(crate) fn channel() -> (watch::Sender<bool>, Stop) {
        let (tx, rx) = watch::channel(false);
        (tx, Stop(rx))
    }

    /// Completes once shutdown has begun (or the controller is gone).
    pub(crate) async fn wait(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }

    pub(crate) fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    /// Sleeps for `duration`; returns `true` if shutdown began meanwhile.
    pub(crate) async fn sleep(&mut self, duration: Duration) -> bool {
        tokio::select! {
            () = tokio::time::sleep(duration) => self.is_set(),
            () = self.wait() => true,
        }
    }
}

/// Whether this replica holds the Lease now.
#[derive(Clone, Debug)]
pub(crate) struct Leader(watch::Receiver<bool>);

impl Leader {
    /// Follows what the `leader` duty publishes on the other end.
    pub(crate) fn new(leading: watch::Receiver<bool>) -> Leader {
        Leader(leading)
    }

    pub(crate) fn is_leader(&self) -> bool {
        *self.0.borrow()
    }

    /// Completes when leadership changes (never, once the election has stopped).
    pub(crate) async fn changed(&mut self) {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// `/readyz` turns ready once every watch has listed everything once.
pub(crate) struct Readiness {
    shared: Arc<Shared>,
    pending: Mutex<Vec<&'static str>>,
}

impl Readiness {
    pub(crate) const NAMESPACES: &'static str = "Namespaces";
    pub(crate) const CLUSTER_RULES: &'static str = "ClusterMutationRules";
    pub(crate) const RULES: &'static str = "MutationRules";
    pub(crate) const DISCOVERY: &'static str = "discovery";
    pub(crate) const GATED_PODS: &'static str = "gated Pods";
    pub(crate) const LOOKUPS: &'static str = "lookups";

    pub(crate) fn new(shared: Arc<Shared>) -> Readiness {
        Readiness {
            shared,
            pending: Mutex::new(vec![
                Self::NAMESPACES,
                Self::CLUSTER_RULES,
                Self::RULES,
                Self::DISCOVERY,
                Self::GATED_PODS,
                Self::LOOKUPS,
            ]),
        }
    }

    /// `part` has been listed completely; once all have, the replica is ready.
    pub(crate) fn done(&self, part: &'static str) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let before = pending.len();
        pending.retain(|p| *p != part);
        if before > 0 && pending.is_empty() {
            self.shared.mark_synced();
            tracing::info!(
                "rules, Namespaces, discovery, gated Pods and lookups are synced: ready"
            );
        }
    }
}
