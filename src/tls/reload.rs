//! The `certificates` duty: keeps the served certificate and the published caBundle current.
//! Every `refresh_interval`, and whenever leadership changes, it re-reads the Secret (renewing
//! it while leading) or the files, reloads the rustls configuration when the certificate
//! changed, publishes the caBundle and sets `initium_certificate_expiry_timestamp_seconds`.
//! A failed refresh is retried at the next one; the last good certificate stays in use.

use std::path::PathBuf;

use axum_server::tls_rustls::RustlsConfig;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

use super::secret::refresh_secret;
use super::{
    CaBundleSource, Source, Tls, TlsError, ca_bundle_from_files, expiry, read, server_config,
};
use crate::controller::duty::{Context, Duty};
use crate::controller::{ControllerError, Leader};

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
        if let Some(not_after) = self.tls.not_after {
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
        let (refresh, failed) = match &self.tls.source {
            Source::SelfManaged { refresh, .. } => (*refresh, "refreshing the TLS Secret failed"),
            Source::Files { refresh, .. } => (
                *refresh,
                "reading the certificate files failed; serving the last good certificate",
            ),
        };
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
                    backoff.failed(failed, &e);
                }
            }
        }
    }
}

impl Tls {
    /// Re-reads the certificate's source; reloads the server configuration, the caBundle and
    /// the expiry when the certificate changed.
    async fn refresh(&mut self, leading: bool) -> Result<(), TlsError> {
        let Tls {
            server,
            ca_bundle,
            not_after,
            source,
        } = self;
        match source {
            Source::SelfManaged {
                api,
                name,
                origin,
                names,
                current,
                ..
            } => match refresh_secret(api, name, names, leading, current, origin).await? {
                Some(material) if material != *current => {
                    match server_config(
                        material.serving_cert.as_bytes(),
                        material.serving_key.as_bytes(),
                    ) {
                        Ok(config) => {
                            server.reload_from_config(config);
                            ca_bundle.send_replace(Some(material.ca_bundle.clone().into_bytes()));
                            *not_after = expiry(material.serving_cert.as_bytes(), origin);
                            tracing::info!(secret = %origin, "reloaded the serving certificate");
                            *current = material;
                        }
                        Err(e) => {
                            tracing::warn!(secret = %origin, error = %e, "cannot use the certificate in the Secret")
                        }
                    }
                }
                _ => {}
            },
            Source::Files {
                cert,
                key,
                ca,
                seen,
                ..
            } => {
                if refresh_files(server, ca_bundle, cert, key, ca, seen).await? {
                    *not_after = expiry(&seen.0, &cert.display().to_string());
                }
            }
        }
        Ok(())
    }
}

/// Reads the certificate files; reloads them if they changed and work together. Returns
/// whether it reloaded (`seen` then holds what is served).
async fn refresh_files(
    server: &RustlsConfig,
    ca_bundle: &watch::Sender<Option<Vec<u8>>>,
    cert: &PathBuf,
    key: &PathBuf,
    ca: &CaBundleSource,
    seen: &mut (Vec<u8>, Vec<u8>),
) -> Result<bool, TlsError> {
    let cert_pem = read(cert).await?;
    let key_pem = read(key).await?;
    let mut reloaded = false;
    if (&cert_pem, &key_pem) != (&seen.0, &seen.1) {
        match server_config(&cert_pem, &key_pem) {
            Ok(config) => {
                server.reload_from_config(config);
                reloaded = true;
                tracing::info!(cert = %cert.display(), "reloaded the serving certificate");
            }
            // Often the certificate is written before the key: the next poll sees both.
            Err(message) => tracing::warn!(
                cert = %cert.display(), key = %key.display(), problem = %message,
                "the certificate files changed but cannot be used yet; serving the previous ones"
            ),
        }
        *seen = (cert_pem.clone(), key_pem);
    }
    let bundle = ca_bundle_from_files(ca, &cert_pem).await?;
    ca_bundle.send_if_modified(|current| {
        if *current == bundle {
            return false;
        }
        *current = bundle;
        true
    });
    Ok(reloaded)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::controller::{ControllerConfig, WebhookEndpoint};
    use crate::tls::pki::tests::names;
    use crate::tls::pki::{Material, now_unix};
    use crate::tls::secret::tests::fake_secrets;
    use crate::tls::{TlsSource, load};

    #[tokio::test]
    async fn certificate_files_are_reloaded_when_they_change() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, ca) = (
            dir.path().join("tls.crt"),
            dir.path().join("tls.key"),
            dir.path().join("ca.crt"),
        );
        let write = |material: &Material| {
            std::fs::write(&cert, &material.serving_cert).unwrap();
            std::fs::write(&key, &material.serving_key).unwrap();
            std::fs::write(&ca, &material.ca_bundle).unwrap();
        };
        let first = Material::create(&names(), now_unix()).unwrap();
        write(&first);
        let server = RustlsConfig::from_config(
            server_config(first.serving_cert.as_bytes(), first.serving_key.as_bytes()).unwrap(),
        );
        let (bundle, _) = watch::channel(Some(first.ca_bundle.clone().into_bytes()));
        let mut seen = (
            first.serving_cert.clone().into_bytes(),
            first.serving_key.clone().into_bytes(),
        );
        let source = CaBundleSource::File(ca.clone());

        let before = server.get_inner();
        refresh_files(&server, &bundle, &cert, &key, &source, &mut seen)
            .await
            .unwrap();
        assert!(
            Arc::ptr_eq(&before, &server.get_inner()),
            "nothing changed: no reload"
        );

        let second = Material::create(&names(), now_unix()).unwrap();
        write(&second);
        refresh_files(&server, &bundle, &cert, &key, &source, &mut seen)
            .await
            .unwrap();
        assert!(!Arc::ptr_eq(&before, &server.get_inner()), "reloaded");
        assert_eq!(
            bundle.borrow().as_deref(),
            Some(second.ca_bundle.as_bytes())
        );

        // A key that does not match is not loaded; the previous configuration stays.
        let reloaded = server.get_inner();
        std::fs::write(&key, &first.serving_key).unwrap();
        refresh_files(&server, &bundle, &cert, &key, &source, &mut seen)
            .await
            .unwrap();
        assert!(Arc::ptr_eq(&reloaded, &server.get_inner()));

        std::fs::remove_file(&cert).unwrap();
        assert!(
            refresh_files(&server, &bundle, &cert, &key, &source, &mut seen)
                .await
                .is_err()
        );
    }

    fn config(tls: TlsSource) -> ControllerConfig {
        let mut config = ControllerConfig::new(
            "initium-system",
            WebhookEndpoint::Url("https://127.0.0.1:8443".into()),
        );
        config.tls = tls;
        config
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
        let tls = load(
            &client,
            &config(TlsSource::SelfManaged {
                secret: "initium-tls".into(),
                refresh_interval: Duration::from_secs(60),
            }),
        )
        .await
        .unwrap();
        let stored = store.lock().unwrap().clone().expect("the Secret created");
        let material = Material::from_secret(&stored).unwrap();
        let expected = material.meta.serving.not_after;
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
            .renew(
                crate::tls::pki::Plan::RenewServing,
                &names(),
                now_unix() - 3600,
            )
            .unwrap();
        assert_ne!(renewed.meta.serving.not_after, expected);
        let version = stored.metadata.resource_version.clone();
        *store.lock().unwrap() = Some(renewed.to_secret("initium-tls", version));
        certificates.refresh().await.unwrap();
        assert_eq!(gauge.get(), renewed.meta.serving.not_after, "set on reload");
    }

    #[tokio::test]
    async fn the_expiry_of_certificate_files_is_published() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let write = |material: &Material| {
            std::fs::write(&cert, &material.serving_cert).unwrap();
            std::fs::write(&key, &material.serving_key).unwrap();
        };
        let first = Material::create(&names(), now_unix()).unwrap();
        write(&first);
        // Files are read without the API server: a client that is never called will do.
        let (api, _) = fake_secrets();
        let tls = load(
            &api.into_client(),
            &config(TlsSource::files(&cert, &key, CaBundleSource::Unmanaged)),
        )
        .await
        .unwrap();
        let gauge = Gauge::default();
        let mut certificates = Certificates::new(tls, not_leading(), gauge.clone());
        assert_eq!(gauge.get(), first.meta.serving.not_after, "set on load");

        let second = Material::create(&names(), now_unix() - 7 * 24 * 3600).unwrap();
        write(&second);
        certificates.refresh().await.unwrap();
        assert_eq!(gauge.get(), second.meta.serving.not_after, "set on reload");
        assert_ne!(second.meta.serving.not_after, first.meta.serving.not_after);
    }
}
