//! The `certificates` duty: keeps the served certificate and the published caBundle current.
//! Every `refresh_interval`, and whenever leadership changes, it refreshes the [`Tls`] (the
//! Secret, renewed while leading, or the files) and sets
//! `initium_certificate_expiry_timestamp_seconds`. A failed refresh is retried at the next
//! one; the last good certificate stays in use.

use prometheus_client::metrics::gauge::Gauge;

use super::duty::{Context, Duty};
use super::vocabulary::{ControllerError, Leader};
use crate::report::report;
use crate::tls::{Tls, TlsError};

/// The duty keeping [`Tls`] current.
pub(crate) struct Certificates {
    tls: Tls,
    leader: Leader,
    /// `initium_certificate_expiry_timestamp_seconds`.
    expiry: Gauge,
}

impl Certificates {
    /// Takes over `tls` (as [`load`](super::load) made it) and publishes its expiry at once.
    pub(crate) fn new(tls: Tls, leader: Leader, expiry: Gauge) -> Certificates {
        let certificates = Certificates {
            tls,
            leader,
            expiry,
        };
        certificates.publish_expiry();
        certificates
    }

    fn publish_expiry(&self) {
        if let Some(not_after) = self.tls.not_after() {
            self.expiry.set(not_after);
        }
    }

    /// One refresh: reload what changed and publish the expiry of what is served.
    async fn refresh(&mut self) -> Result<(), TlsError> {
        let leading = self.leader.is_leader();
        let result = self.tls.refresh(leading).await;
        self.publish_expiry();
        result
    }
}

impl Duty for Certificates {
    const NAME: &'static str = "certificates";

    async fn run(&mut self, mut context: Context) -> Result<(), ControllerError> {
        let (refresh, failed) = (self.tls.refresh_interval(), self.tls.refresh_failure());
        // A failed refresh is retried by the next one, neither sooner nor later.
        let mut backoff = context.backoff(refresh, refresh);
        loop {
            tokio::select! {
                () = context.stop.wait() => return Ok(()),
                () = tokio::time::sleep(refresh) => {}
                () = self.leader.changed() => {}
            }
            match self.refresh().await {
                Ok(()) => backoff.succeeded(),
                Err(e) => {
                    backoff.failed(failed, &report(&e));
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::time::Duration;

    use tokio::sync::watch;

    use super::*;
    use crate::controller::{ControllerConfig, WebhookEndpoint};
    use crate::tls::pki::tests::names;
    use crate::tls::pki::{Material, Plan, now_unix};
    use crate::tls::secret::tests::fake_secrets;
    use crate::tls::{CaBundleSource, TlsSource, load};

    /// Loads `source` as `initium serve` does for an out-of-cluster endpoint.
    async fn load_source(client: &kube::Client, source: TlsSource) -> Result<Tls, TlsError> {
        let config = ControllerConfig::new(
            "initium-system",
            WebhookEndpoint::Url("https://127.0.0.1:8443".into()),
        );
        let names = config.endpoint.certificate_names();
        load(client, &config.namespace, names, &source).await
    }

    fn not_leading() -> Leader {
        let (leading, receiver) = watch::channel(false);
        // Dropping the sender would make `changed` pend forever: fine for these tests.
        drop(leading);
        Leader::new(receiver)
    }

    #[tokio::test]
    async fn the_expiry_of_a_self_managed_certificate_is_published() {
        let (api, store) = fake_secrets();
        let client: kube::Client = api.into_client();
        let tls = load_source(
            &client,
            TlsSource::SelfManaged {
                secret: "initium-tls".into(),
                refresh_interval: Duration::from_secs(60),
            },
        )
        .await
        .unwrap();
        let stored = store.lock().unwrap().clone().expect("the Secret created");
        let material = Material::from_secret(&stored).unwrap();
        let expected = material.serving_not_after();
        assert!(
            expected > now_unix() + 300 * 24 * 3600,
            "about a year ahead"
        );
        assert_eq!(tls.not_after(), Some(expected));

        let gauge = Gauge::default();
        let mut certificates = Certificates::new(tls, not_leading(), gauge.clone());
        assert_eq!(gauge.get(), expected, "set on load");

        // A renewal by the leader (here: written straight into the Secret) is reloaded, and
        // the gauge follows.
        let renewed = material
            .renew(Plan::RenewServing, &names(), now_unix() - 3600)
            .unwrap();
        assert_ne!(renewed.serving_not_after(), expected);
        let version = stored.metadata.resource_version.clone();
        *store.lock().unwrap() = Some(renewed.to_secret("initium-tls", version));
        certificates.refresh().await.unwrap();
        assert_eq!(gauge.get(), renewed.serving_not_after(), "set on reload");
    }

    #[tokio::test]
    async fn the_expiry_of_certificate_files_is_published() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let write = |material: &Material| {
            std::fs::write(&cert, material.serving_pem().0).unwrap();
            std::fs::write(&key, material.serving_pem().1).unwrap();
        };
        let first = Material::create(&names(), now_unix()).unwrap();
        write(&first);
        // Files are read without the API server: a client that is never called will do.
        let (api, _) = fake_secrets();
        let tls = load_source(
            &api.into_client(),
            TlsSource::files(&cert, &key, CaBundleSource::Unmanaged),
        )
        .await
        .unwrap();
        let gauge = Gauge::default();
        let mut certificates = Certificates::new(tls, not_leading(), gauge.clone());
        assert_eq!(gauge.get(), first.serving_not_after(), "set on load");

        let second = Material::create(&names(), now_unix() - 7 * 24 * 3600).unwrap();
        write(&second);
        certificates.refresh().await.unwrap();
        assert_eq!(gauge.get(), second.serving_not_after(), "set on reload");
        assert_ne!(second.serving_not_after(), first.serving_not_after());
    }
}
