//! Leader election with a Lease in initium's namespace: one replica at a time writes rule
//! status, the webhook configurations and certificate renewals; every replica keeps watching
//! and serving whether it leads or not.
//!
//! The writers are idempotent (they compare before writing and write the same desired state
//! from the same inputs), so the short overlap possible when a leader stalls past its Lease
//! is harmless; the Lease is there to avoid duplicate writes and flapping, not for safety.
//!
//! The `leader` duty publishes whether this replica leads to the writers and in the
//! `initium_leader` gauge.

use std::hash::{BuildHasher, RandomState};
use std::time::{Duration, SystemTime};

use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

use super::duty::{Context, Duty};
use super::vocabulary::ControllerError;
use crate::report::report;

/// First wait before the election starts over after a failure; it doubles up to
/// [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(32);

/// The Lease that elects the writer.
#[derive(Clone, Debug)]
pub struct LeaseSettings {
    /// Name of the Lease, in initium's namespace (`--lease-name`; default `initium`).
    pub name: String,
    /// This replica's identity in the Lease (`--identity`). Default: `POD_NAME` if set (a
    /// restarted container then gets its Lease back at once), otherwise the host name plus a
    /// random suffix (several processes on one host stay distinct).
    pub identity: Option<String>,
    /// How long the holder stays leader without renewing (whole seconds, at least 2; default
    /// 15 s). When the leader stops cleanly it releases the Lease; when it dies, another
    /// replica takes over within about this long.
    pub duration: Duration,
    /// How long before the Lease expires the holder renews it (whole seconds, at least 1,
    /// less than `duration`; default 5 s).
    pub grace: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            name: "initium".into(),
            identity: None,
            duration: Duration::from_secs(15),
            grace: Duration::from_secs(5),
        }
    }
}

impl LeaseSettings {
    pub(crate) fn validate(&self) -> Result<(), ControllerError> {
        if self.name.is_empty() {
            return Err(ControllerError::Config(
                "the Lease name must not be empty".into(),
            ));
        }
        let (duration, grace) = (self.duration.as_secs(), self.grace.as_secs());
        if grace < 1 || duration <= grace {
            return Err(ControllerError::Config(format!(
                "the Lease grace period ({grace}s) must be at least 1s and shorter than its duration ({duration}s)"
            )));
        }
        Ok(())
    }

    /// The identity this replica uses in the Lease.
    pub fn identity(&self) -> String {
        if let Some(identity) = self.identity.as_ref().filter(|i| !i.is_empty()) {
            return identity.clone();
        }
        if let Ok(pod) = std::env::var("POD_NAME")
            && !pod.is_empty()
        {
            return pod;
        }
        format!("{}-{}", host_name(), random_suffix())
    }
}

fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "initium".into())
}

fn random_suffix() -> String {
    // RandomState is seeded randomly per process: enough to tell two processes apart.
    let seed = RandomState::new().hash_one((SystemTime::now(), std::process::id()));
    format!("{:08x}", seed as u32)
}

/// The `leader` duty: takes part in the election until shutdown.
pub(crate) struct Lease {
    client: Client,
    settings: LeaseSettings,
    /// Chosen once: a restarted duty gets back the Lease it may still hold.
    identity: String,
    namespace: String,
    /// Whether this replica leads, for the writers.
    leading: watch::Sender<bool>,
    /// `initium_leader`.
    gauge: Gauge,
}

impl Lease {
    /// The election of the Lease `settings` names in `namespace` (initium's own).
    pub(crate) fn new(
        client: Client,
        namespace: &str,
        settings: &LeaseSettings,
        leading: watch::Sender<bool>,
        gauge: Gauge,
    ) -> Lease {
        Lease {
            client,
            settings: settings.clone(),
            identity: settings.identity(),
            namespace: namespace.to_string(),
            leading,
            gauge,
        }
    }

    /// Publishes whether this replica leads; returns what it published before.
    fn set_leading(&self, leading: bool) -> bool {
        self.gauge.set(i64::from(leading));
        self.leading.send_replace(leading)
    }
}

impl Duty for Lease {
    const NAME: &'static str = "leader";

    /// Takes part in the election until shutdown, publishing whether this replica leads.
    /// Errors talking to the API server count as not leading (a writer that cannot renew must
    /// assume it lost the Lease) and the election starts over after a backoff. On shutdown the
    /// Lease is released.
    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let settings = &self.settings;
        settings.validate()?;
        // A restart begins as a follower: whatever was published before is stale.
        self.set_leading(false);
        let identity = &self.identity;
        let namespace = &self.namespace;
        let lease = format!("{namespace}/{}", settings.name);
        tracing::info!(%lease, %identity, "joining the leader election");
        let mut backoff = context.backoff(RETRY_FIRST, RETRY_MAX);
        loop {
            let built = LeaseManagerBuilder::new(self.client.clone(), settings.name.clone())
                .with_namespace(namespace.clone())
                .with_identity(identity.clone())
                .with_duration(settings.duration.as_secs())
                .with_grace(settings.grace.as_secs())
                .with_field_manager(format!("initium-lease-{identity}"))
                .build()
                .await;
            let wait = match built {
                Ok(manager) => loop {
                    tokio::select! {
                        () = context.stop.wait() => {
                            let was_leading = self.set_leading(false);
                            if let Err(e) = manager.release().await {
                                tracing::warn!(%lease, error = %report(&e), "releasing the Lease failed; it expires by itself");
                            } else if was_leading {
                                tracing::info!(%lease, %identity, "released the Lease");
                            }
                            return Ok(());
                        }
                        changed = manager.changed() => match changed {
                            Ok(now_leading) => {
                                backoff.succeeded();
                                if self.set_leading(now_leading) != now_leading {
                                    if now_leading {
                                        tracing::info!(%lease, %identity, "leading: this replica writes");
                                    } else {
                                        tracing::info!(%lease, %identity, "no longer leading");
                                    }
                                }
                            }
                            Err(e) => {
                                self.set_leading(false);
                                break backoff.failed(
                                    "leader election failed; not leading until it works again",
                                    &format_args!("{lease}: {}", report(&e)),
                                );
                            }
                        }
                    }
                },
                Err(e) => {
                    self.set_leading(false);
                    backoff.failed(
                        "cannot set up the leader election",
                        &format_args!("{lease}: {}", report(&e)),
                    )
                }
            };
            if context.stop.sleep(wait).await {
                self.set_leading(false);
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn settings_that_would_panic_are_refused() {
        let with = |duration, grace| LeaseSettings {
            duration: Duration::from_secs(duration),
            grace: Duration::from_secs(grace),
            ..LeaseSettings::default()
        };
        assert!(with(15, 5).validate().is_ok());
        assert!(with(2, 1).validate().is_ok());
        assert!(with(5, 5).validate().is_err());
        assert!(with(5, 0).validate().is_err());
        assert!(with(0, 0).validate().is_err());
    }

    #[test]
    fn an_explicit_identity_wins() {
        let settings = LeaseSettings {
            identity: Some("replica-a".into()),
            ..LeaseSettings::default()
        };
        assert_eq!(settings.identity(), "replica-a");
    }
}
