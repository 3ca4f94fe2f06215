//! The serving certificate of the webhook, and the caBundle the API server trusts it with.
//!
//! Two sources:
//!
//! - **Self-managed** (default): initium makes a CA and a serving certificate and keeps them
//!   in a Secret in its namespace, so every replica serves the same certificate and one
//!   caBundle fits them all. The first replica to start creates the Secret (a replica that
//!   loses the race reads the winner's). The Lease holder renews: the serving certificate
//!   (valid 1 year) after two thirds of its life or when the names it needs change; the CA
//!   (valid 10 years) after two thirds of its life, in two steps so no request fails: first
//!   the new CA joins the caBundle, ten minutes later it starts signing. Every replica reads
//!   the Secret again every `refresh_interval` and reloads what changed. A Secret deleted
//!   (or made unusable) while initium runs is written again by the Lease holder from the
//!   certificates it serves, so the CA the API servers trust stays the same; the other
//!   replicas keep serving what they have meanwhile.
//! - **Files** (`--tls-cert-file`, `--tls-key-file`, e.g. mounted from a cert-manager
//!   Secret): read at start, polled every `refresh_interval` and reloaded when their content
//!   changes. The caBundle comes from a CA file, is the serving certificate itself, or is left
//!   to someone else (cert-manager's CA injector).
//!
//! The serving certificate names what [`WebhookEndpoint::certificate_names`] says: the
//! Service's DNS names, or the host of the webhook URL (an IP address as an IP SAN). Its
//! notAfter is exported as `initium_certificate_expiry_timestamp_seconds`.
//!
//! - `pki.rs`: pure certificate logic: the CA and serving certificate, validity, renewal plan.
//! - `secret.rs`: the self-managed Secret: encoding, creation, conflicts, renewal writes.
//! - `reload.rs`: the `certificates` duty of the controller, keeping the served certificate,
//!   the caBundle and the expiry metric current.
//!
//! [`load`] runs once at start, before serving; its [`Tls`] goes to `controller::run`.
//!
//! [`WebhookEndpoint::certificate_names`]: crate::controller::WebhookEndpoint::certificate_names

pub(crate) mod pki;
mod reload;
pub(crate) mod secret;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::watch;

use pki::Material;

/// Where the serving certificate comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsSource {
    /// initium's own CA and certificate, kept in a Secret in initium's namespace.
    SelfManaged {
        /// Name of the Secret (`--tls-secret`; default `initium-tls`).
        secret: String,
        /// How often every replica reads the Secret again (renewals by the leader reach the
        /// others within this long) and the leader checks whether to renew. Default 60 s.
        refresh_interval: Duration,
    },
    /// A certificate and key from files, reloaded when they change.
    Files {
        /// PEM certificate chain, serving certificate first (`--tls-cert-file`).
        cert: PathBuf,
        /// PEM private key (`--tls-key-file`).
        key: PathBuf,
        /// What to publish as the webhooks' caBundle.
        ca: CaBundleSource,
        /// How often the files are read to notice a renewal. Default 5 s.
        refresh_interval: Duration,
    },
}

impl TlsSource {
    /// Certificate files, polled every 5 s.
    pub fn files(cert: impl Into<PathBuf>, key: impl Into<PathBuf>, ca: CaBundleSource) -> Self {
        TlsSource::Files {
            cert: cert.into(),
            key: key.into(),
            ca,
            refresh_interval: Duration::from_secs(5),
        }
    }

    /// Checks what would otherwise make the reload spin.
    pub fn validate(&self) -> Result<(), TlsError> {
        if self.refresh_interval().is_zero() {
            return Err(TlsError::Config(
                "the TLS refresh interval must be more than zero".into(),
            ));
        }
        Ok(())
    }

    fn refresh_interval(&self) -> Duration {
        match self {
            TlsSource::SelfManaged {
                refresh_interval, ..
            }
            | TlsSource::Files {
                refresh_interval, ..
            } => *refresh_interval,
        }
    }
}

/// The caBundle written into the webhook configurations when certificates come from files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaBundleSource {
    /// The certificates in this PEM file (`--ca-file`, e.g. cert-manager's `ca.crt`),
    /// re-read whenever the certificate files are.
    File(PathBuf),
    /// The serving certificate file itself: right for a self-signed certificate. With a
    /// certificate that rotates, the caBundle follows it one poll later, so requests may
    /// fail for a few seconds after each rotation; prefer [`CaBundleSource::File`].
    ServingCertificate,
    /// initium leaves caBundle alone: for a certificate from a CA the API server already
    /// trusts, or when cert-manager's CA injector fills it in (annotate the configurations
    /// with `cert-manager.io/inject-ca-from`).
    Unmanaged,
}

/// What can go wrong loading, renewing or reloading the serving certificate.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The TLS settings cannot work; the message says which setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A call to the API server about the Secret failed.
    #[error("cannot {action} {object}")]
    Api {
        /// What initium tried, e.g. `create`.
        action: &'static str,
        /// Which object, e.g. `Secret initium-system/initium-tls`.
        object: String,
        #[source]
        source: kube::Error,
    },
    /// A certificate or key file could not be read.
    #[error("read {}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A certificate could not be made or used.
    #[error("TLS certificate ({origin}): {message}")]
    Certificate {
        /// Where the certificate comes from: a Secret or a file.
        origin: String,
        message: String,
    },
}

impl TlsError {
    fn api(action: &'static str, object: impl Into<String>, source: kube::Error) -> Self {
        TlsError::Api {
            action,
            object: object.into(),
            source,
        }
    }
}

/// The live TLS state: the configuration the HTTPS server uses and the caBundle to publish.
/// Made by [`load`], kept current by the `certificates` duty of `controller::run`.
pub struct Tls {
    server: RustlsConfig,
    ca_bundle: watch::Sender<Option<Vec<u8>>>,
    /// The notAfter of the certificate served now, in seconds since the Unix epoch.
    not_after: Option<i64>,
    source: Source,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca_bundle", &self.ca_bundle.borrow().as_ref().map(Vec::len))
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// The rustls configuration to serve the webhook with. Clones share state: when the
    /// controller reloads the certificate, servers using any clone pick it up for new
    /// connections.
    pub fn rustls_config(&self) -> RustlsConfig {
        self.server.clone()
    }

    /// The PEM caBundle published in the webhook configurations now (`None` when unmanaged).
    pub fn ca_bundle(&self) -> Option<Vec<u8>> {
        self.ca_bundle.borrow().clone()
    }

    /// When the certificate served now expires (its notAfter), in seconds since the Unix
    /// epoch; `None` if it could not be read from the certificate.
    pub fn not_after(&self) -> Option<i64> {
        self.not_after
    }

    /// How often the source is read again.
    pub fn refresh_interval(&self) -> Duration {
        match &self.source {
            Source::SelfManaged { refresh, .. } | Source::Files { refresh, .. } => *refresh,
        }
    }

    /// What a failed [`refresh`](Tls::refresh) means for the person reading the log.
    pub fn refresh_failure(&self) -> &'static str {
        match &self.source {
            Source::SelfManaged { .. } => "refreshing the TLS Secret failed",
            Source::Files { .. } => {
                "reading the certificate files failed; serving the last good certificate"
            }
        }
    }

    pub(crate) fn ca_bundle_receiver(&self) -> watch::Receiver<Option<Vec<u8>>> {
        self.ca_bundle.subscribe()
    }
}

#[expect(clippy::large_enum_variant, reason = "one per process")]
enum Source {
    SelfManaged {
        api: Api<Secret>,
        name: String,
        /// `Secret <namespace>/<name>`, for messages.
        origin: String,
        names: Vec<String>,
        refresh: Duration,
        current: Material,
    },
    Files {
        cert: PathBuf,
        key: PathBuf,
        ca: CaBundleSource,
        refresh: Duration,
        /// What was last loaded, or last failed to load (not retried until it changes).
        seen: (Vec<u8>, Vec<u8>),
    },
}

/// Loads (or, self-managed, creates in a Secret of `namespace`) the serving certificate that
/// `source` names, for the DNS names or IP addresses `names`. Call once at start, before
/// serving; pass the result to `controller::run`, which keeps it current.
pub async fn load(
    client: &Client,
    namespace: &str,
    names: Vec<String>,
    source: &TlsSource,
) -> Result<Tls, TlsError> {
    source.validate()?;
    match source {
        TlsSource::SelfManaged {
            secret,
            refresh_interval,
        } => {
            let api = Api::<Secret>::namespaced(client.clone(), namespace);
            let origin = format!("Secret {namespace}/{secret}");
            let material = secret::load_or_create(&api, secret, &names, &origin).await?;
            let certificate = |message| TlsError::Certificate {
                origin: origin.clone(),
                message,
            };
            let server = RustlsConfig::from_config(
                server_config(
                    material.serving_cert.as_bytes(),
                    material.serving_key.as_bytes(),
                )
                .map_err(certificate)?,
            );
            let not_after = expiry(material.serving_cert.as_bytes(), &origin);
            let (ca_bundle, _) = watch::channel(Some(material.ca_bundle.clone().into_bytes()));
            Ok(Tls {
                server,
                ca_bundle,
                not_after,
                source: Source::SelfManaged {
                    api,
                    name: secret.clone(),
                    origin,
                    names,
                    refresh: *refresh_interval,
                    current: material,
                },
            })
        }
        TlsSource::Files {
            cert,
            key,
            ca,
            refresh_interval,
        } => {
            let cert_pem = read(cert).await?;
            let key_pem = read(key).await?;
            let certificate = |message| TlsError::Certificate {
                origin: format!("{} and {}", cert.display(), key.display()),
                message,
            };
            let config = server_config(&cert_pem, &key_pem).map_err(certificate)?;
            let not_after = expiry(&cert_pem, &cert.display().to_string());
            let bundle = ca_bundle_from_files(ca, &cert_pem).await?;
            let (ca_bundle, _) = watch::channel(bundle);
            Ok(Tls {
                server: RustlsConfig::from_config(config),
                ca_bundle,
                not_after,
                source: Source::Files {
                    cert: cert.clone(),
                    key: key.clone(),
                    ca: ca.clone(),
                    refresh: *refresh_interval,
                    seen: (cert_pem, key_pem),
                },
            })
        }
    }
}

/// The notAfter of the serving certificate (the first in `cert_pem`), for the expiry metric.
/// rustls accepted the certificate already: one whose validity cannot be read is still
/// served, only its expiry is unknown.
fn expiry(cert_pem: &[u8], origin: &str) -> Option<i64> {
    pki::not_after(cert_pem)
        .inspect_err(|problem| {
            tracing::warn!(%origin, %problem, "cannot read when the serving certificate expires")
        })
        .ok()
}

async fn read(path: &PathBuf) -> Result<Vec<u8>, TlsError> {
    tokio::fs::read(path)
        .await
        .map_err(|source| TlsError::File {
            path: path.clone(),
            source,
        })
}

async fn ca_bundle_from_files(
    ca: &CaBundleSource,
    cert_pem: &[u8],
) -> Result<Option<Vec<u8>>, TlsError> {
    Ok(match ca {
        CaBundleSource::File(path) => Some(read(path).await?),
        CaBundleSource::ServingCertificate => Some(cert_pem.to_vec()),
        CaBundleSource::Unmanaged => None,
    })
}

/// A rustls server configuration for a PEM chain and key, with the ring provider (whatever
/// the process default is) and HTTP/2 offered through ALPN.
fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, String> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the certificate is not PEM: {e}"))?;
    if chain.is_empty() {
        return Err("no certificate found in the PEM".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| format!("the private key is not PEM: {e}"))?;
    let mut config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| format!("the certificate and key do not work together: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
