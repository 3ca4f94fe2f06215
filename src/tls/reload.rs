//! Reloading: the certificate's source is read again; the rustls configuration, the published
//! caBundle and the expiry change when the certificate did. The `certificates` duty
//! (`controller/certificates.rs`) calls [`Tls::refresh`] on its schedule; a failed refresh
//! leaves the last good certificate in use.

use std::path::PathBuf;

use axum_server::tls_rustls::RustlsConfig;
use tokio::sync::watch;

use super::secret::refresh_secret;
use super::{
    CaBundleSource, Source, Tls, TlsError, ca_bundle_from_files, expiry, read, server_config,
};

impl Tls {
    /// Re-reads the certificate's source (renewing a self-managed one while `leading`);
    /// reloads the server configuration, the caBundle and the expiry when the certificate
    /// changed.
    pub async fn refresh(&mut self, leading: bool) -> Result<(), TlsError> {
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

    use super::*;
    use crate::tls::pki::tests::names;
    use crate::tls::pki::{Material, now_unix};

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
}
