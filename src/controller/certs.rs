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
//! Service's DNS names, or the host of the webhook URL (an IP address as an IP SAN).
//!
//! [`WebhookEndpoint::certificate_names`]: super::WebhookEndpoint::certificate_names

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::{ControllerConfig, ControllerError, Leader, Stop};

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

/// The live TLS state: the configuration the HTTPS server uses and the caBundle to publish.
/// Made by [`tls`], kept current by [`run`](super::run).
pub struct Tls {
    server: RustlsConfig,
    ca_bundle: watch::Sender<Option<Vec<u8>>>,
    source: Source,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca_bundle", &self.ca_bundle.borrow().as_ref().map(Vec::len))
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

/// Loads (or, self-managed, creates) the serving certificate. Call once at start, before
/// serving; pass the result to [`run`](super::run).
pub async fn tls(client: &Client, config: &ControllerConfig) -> Result<Tls, ControllerError> {
    config.validate()?;
    match &config.tls {
        TlsSource::SelfManaged {
            secret,
            refresh_interval,
        } => {
            let api = Api::<Secret>::namespaced(client.clone(), &config.namespace);
            let names = config.endpoint.certificate_names();
            let origin = format!("Secret {}/{secret}", config.namespace);
            let material = load_or_create(&api, secret, &names, &origin).await?;
            let server = RustlsConfig::from_config(
                server_config(
                    material.serving_cert.as_bytes(),
                    material.serving_key.as_bytes(),
                )
                .map_err(|message| ControllerError::Certificate {
                    origin: origin.clone(),
                    message,
                })?,
            );
            let (ca_bundle, _) = watch::channel(Some(material.ca_bundle.clone().into_bytes()));
            Ok(Tls {
                server,
                ca_bundle,
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
            let config = server_config(&cert_pem, &key_pem).map_err(|message| {
                ControllerError::Certificate {
                    origin: format!("{} and {}", cert.display(), key.display()),
                    message,
                }
            })?;
            let bundle = ca_bundle_from_files(ca, &cert_pem).await?;
            let (ca_bundle, _) = watch::channel(bundle);
            Ok(Tls {
                server: RustlsConfig::from_config(config),
                ca_bundle,
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

async fn read(path: &PathBuf) -> Result<Vec<u8>, ControllerError> {
    tokio::fs::read(path)
        .await
        .map_err(|source| ControllerError::File {
            path: path.clone(),
            source,
        })
}

async fn ca_bundle_from_files(
    ca: &CaBundleSource,
    cert_pem: &[u8],
) -> Result<Option<Vec<u8>>, ControllerError> {
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

// ---------------------------------------------------------------------------------------------
// Self-managed: what is in the Secret

/// How long a serving certificate is valid.
const SERVING_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// How long a CA is valid.
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// A new CA is in the caBundle this long before it signs the serving certificate: time for
/// the leader to write the configurations and for every API server to see them.
const CA_PROPAGATION: Duration = Duration::from_secs(600);
/// Certificates start this much in the past, for clocks that are a little behind.
const BACKDATE: Duration = Duration::from_secs(3600);

/// The annotation with what initium knows about the certificates in the Secret (rcgen cannot
/// read certificates back, and this avoids parsing X.509 anyway).
const META_ANNOTATION: &str = "initium.dev/certificates";

/// Data keys of the Secret. `tls.crt`/`tls.key` make it usable as a `kubernetes.io/tls`
/// Secret; `ca.crt` is the caBundle (every CA to trust, the signing one first).
const TLS_CRT: &str = "tls.crt";
const TLS_KEY: &str = "tls.key";
const CA_BUNDLE: &str = "ca.crt";
const SIGNING_CA_CRT: &str = "signing-ca.crt";
const SIGNING_CA_KEY: &str = "signing-ca.key";
const NEXT_CA_CRT: &str = "next-ca.crt";
const NEXT_CA_KEY: &str = "next-ca.key";

/// Times are whole seconds since the Unix epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Validity {
    not_before: i64,
    not_after: i64,
}

impl Validity {
    fn new(now: i64, lifetime: Duration) -> Validity {
        Validity {
            not_before: now - BACKDATE.as_secs() as i64,
            not_after: now + lifetime.as_secs() as i64,
        }
    }

    /// Two thirds of the way through: time to renew.
    fn renew_at(&self) -> i64 {
        self.not_before + (self.not_after - self.not_before) * 2 / 3
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Authority {
    common_name: String,
    validity: Validity,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    signing_ca: Authority,
    /// A CA in the caBundle that has not signed anything yet, and since when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_ca: Option<(Authority, i64)>,
    serving: Validity,
    names: Vec<String>,
}

/// Everything in the Secret, PEM-encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Material {
    meta: Meta,
    serving_cert: String,
    serving_key: String,
    ca_bundle: String,
    signing_ca_cert: String,
    signing_ca_key: String,
    next_ca: Option<(String, String)>,
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn certificate_error(message: impl std::fmt::Display) -> String {
    format!("cannot make a certificate: {message}")
}

fn ca_params(common_name: &str, validity: &Validity) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before =
        (UNIX_EPOCH + Duration::from_secs(validity.not_before.max(0) as u64)).into();
    params.not_after = (UNIX_EPOCH + Duration::from_secs(validity.not_after.max(0) as u64)).into();
    params
}

/// A new CA: certificate PEM, key PEM and what to remember about it.
fn new_authority(now: i64) -> Result<(String, String, Authority), String> {
    let authority = Authority {
        // Unique per CA, so a caBundle holding the old and the new one is unambiguous.
        common_name: format!("initium-ca-{now}"),
        validity: Validity::new(now, CA_LIFETIME),
    };
    let key = KeyPair::generate().map_err(certificate_error)?;
    let cert = ca_params(&authority.common_name, &authority.validity)
        .self_signed(&key)
        .map_err(certificate_error)?;
    Ok((cert.pem(), key.serialize_pem(), authority))
}

/// A serving certificate for `names`, signed by the CA with this key; certificate PEM, key
/// PEM and validity. It never outlives its CA.
fn new_serving(
    names: &[String],
    ca: &Authority,
    ca_key_pem: &str,
    now: i64,
) -> Result<(String, String, Validity), String> {
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(certificate_error)?;
    // rcgen signs with the issuer's name, key identifier and key usages, all of which follow
    // from the CA's parameters and key: no need to parse its certificate back.
    let issuer = Issuer::new(ca_params(&ca.common_name, &ca.validity), ca_key);
    let mut validity = Validity::new(now, SERVING_LIFETIME);
    validity.not_after = validity.not_after.min(ca.validity.not_after);
    let mut params = CertificateParams::new(names.to_vec()).map_err(certificate_error)?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        names.first().map_or("initium", String::as_str),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before =
        (UNIX_EPOCH + Duration::from_secs(validity.not_before.max(0) as u64)).into();
    params.not_after = (UNIX_EPOCH + Duration::from_secs(validity.not_after.max(0) as u64)).into();
    let key = KeyPair::generate().map_err(certificate_error)?;
    let cert = params.signed_by(&key, &issuer).map_err(certificate_error)?;
    Ok((cert.pem(), key.serialize_pem(), validity))
}

/// What the leader does with the Secret's certificates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    Keep,
    /// Issue a new serving certificate from the signing CA (due, or the names changed).
    RenewServing,
    /// Put a new CA into the caBundle; it signs after [`CA_PROPAGATION`].
    StageCa,
    /// The staged CA has been in the caBundle long enough: let it sign a new serving
    /// certificate.
    PromoteCa,
}

fn plan(meta: &Meta, names: &[String], now: i64) -> Plan {
    if meta.names != names {
        return Plan::RenewServing;
    }
    match &meta.next_ca {
        Some((_, since)) if now >= since + CA_PROPAGATION.as_secs() as i64 => {
            return Plan::PromoteCa;
        }
        None if now >= meta.signing_ca.validity.renew_at() => return Plan::StageCa,
        _ => {}
    }
    if now >= meta.serving.renew_at() {
        return Plan::RenewServing;
    }
    Plan::Keep
}

impl Material {
    fn create(names: &[String], now: i64) -> Result<Material, String> {
        let (ca_cert, ca_key, authority) = new_authority(now)?;
        let (serving_cert, serving_key, serving) = new_serving(names, &authority, &ca_key, now)?;
        Ok(Material {
            meta: Meta {
                signing_ca: authority,
                next_ca: None,
                serving,
                names: names.to_vec(),
            },
            serving_cert,
            serving_key,
            ca_bundle: ca_cert.clone(),
            signing_ca_cert: ca_cert,
            signing_ca_key: ca_key,
            next_ca: None,
        })
    }

    /// Carries out `plan` (anything but `Keep`).
    fn renew(&self, plan: Plan, names: &[String], now: i64) -> Result<Material, String> {
        let mut next = self.clone();
        match plan {
            Plan::Keep => {}
            Plan::RenewServing => {
                let (cert, key, validity) =
                    new_serving(names, &self.meta.signing_ca, &self.signing_ca_key, now)?;
                next.serving_cert = cert;
                next.serving_key = key;
                next.meta.serving = validity;
                next.meta.names = names.to_vec();
            }
            Plan::StageCa => {
                let (cert, key, authority) = new_authority(now)?;
                // The old bundle may hold a CA from the previous rotation: drop it now.
                next.ca_bundle = format!("{}{cert}", self.signing_ca_cert);
                next.meta.next_ca = Some((authority, now));
                next.next_ca = Some((cert, key));
            }
            Plan::PromoteCa => {
                let (Some((authority, _)), Some((cert, key))) = (&self.meta.next_ca, &self.next_ca)
                else {
                    return Err("no staged CA to promote".into());
                };
                let (serving_cert, serving_key, validity) =
                    new_serving(names, authority, key, now)?;
                next.signing_ca_cert = cert.clone();
                next.signing_ca_key = key.clone();
                next.meta.signing_ca = authority.clone();
                next.meta.next_ca = None;
                next.next_ca = None;
                next.serving_cert = serving_cert;
                next.serving_key = serving_key;
                next.meta.serving = validity;
                next.meta.names = names.to_vec();
            }
        }
        Ok(next)
    }

    fn from_secret(secret: &Secret) -> Result<Material, String> {
        let data = secret.data.clone().unwrap_or_default();
        let text = |key: &str| -> Result<String, String> {
            let bytes = data
                .get(key)
                .ok_or_else(|| format!("the Secret has no {key}"))?;
            String::from_utf8(bytes.0.clone()).map_err(|_| format!("{key} is not PEM text"))
        };
        let meta_json = secret
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(META_ANNOTATION))
            .ok_or_else(|| format!("the Secret has no {META_ANNOTATION} annotation"))?;
        let meta: Meta = serde_json::from_str(meta_json)
            .map_err(|e| format!("the {META_ANNOTATION} annotation is not valid: {e}"))?;
        let next_ca = match meta.next_ca {
            Some(_) => Some((text(NEXT_CA_CRT)?, text(NEXT_CA_KEY)?)),
            None => None,
        };
        let material = Material {
            meta,
            serving_cert: text(TLS_CRT)?,
            serving_key: text(TLS_KEY)?,
            ca_bundle: text(CA_BUNDLE)?,
            signing_ca_cert: text(SIGNING_CA_CRT)?,
            signing_ca_key: text(SIGNING_CA_KEY)?,
            next_ca,
        };
        server_config(
            material.serving_cert.as_bytes(),
            material.serving_key.as_bytes(),
        )?;
        Ok(material)
    }

    /// The Secret holding this material (`resource_version` makes a replace conditional).
    fn to_secret(&self, name: &str, resource_version: Option<String>) -> Secret {
        let mut data = BTreeMap::new();
        let mut put = |key: &str, value: &str| {
            data.insert(key.to_string(), ByteString(value.as_bytes().to_vec()));
        };
        put(TLS_CRT, &self.serving_cert);
        put(TLS_KEY, &self.serving_key);
        put(CA_BUNDLE, &self.ca_bundle);
        put(SIGNING_CA_CRT, &self.signing_ca_cert);
        put(SIGNING_CA_KEY, &self.signing_ca_key);
        if let Some((cert, key)) = &self.next_ca {
            put(NEXT_CA_CRT, cert);
            put(NEXT_CA_KEY, key);
        }
        Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version,
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_string(),
                    "initium".to_string(),
                )])),
                annotations: Some(BTreeMap::from([(
                    META_ANNOTATION.to_string(),
                    serde_json::to_string(&self.meta).unwrap_or_default(),
                )])),
                ..ObjectMeta::default()
            },
            type_: Some("kubernetes.io/tls".into()),
            data: Some(data),
            ..Secret::default()
        }
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Reads the Secret, creating it if it is missing (or replacing it if it is unusable). The
/// first writer wins: a replica whose create or replace conflicts reads the winner's.
async fn load_or_create(
    api: &Api<Secret>,
    name: &str,
    names: &[String],
    origin: &str,
) -> Result<Material, ControllerError> {
    let make = |message: String| ControllerError::Certificate {
        origin: origin.to_string(),
        message,
    };
    let mut last_conflict = None;
    for _ in 0..5 {
        let existing = api
            .get_opt(name)
            .await
            .map_err(|e| ControllerError::api("get", origin, e))?;
        let resource_version = match &existing {
            None => None,
            Some(secret) => match Material::from_secret(secret) {
                Ok(material) => return Ok(material),
                Err(why) => {
                    tracing::warn!(secret = %origin, problem = %why, "the TLS Secret is unusable; replacing it");
                    secret.metadata.resource_version.clone()
                }
            },
        };
        let material = Material::create(names, now_unix()).map_err(make)?;
        let secret = material.to_secret(name, resource_version.clone());
        let written = match resource_version {
            None => api.create(&PostParams::default(), &secret).await,
            Some(_) => api.replace(name, &PostParams::default(), &secret).await,
        };
        match written {
            Ok(_) => {
                tracing::info!(secret = %origin, names = ?names, "created a CA and serving certificate");
                return Ok(material);
            }
            Err(e) if is_conflict(&e) => last_conflict = Some(e),
            Err(e) => return Err(ControllerError::api("create", origin, e)),
        }
    }
    Err(match last_conflict {
        Some(e) => ControllerError::api("create", origin, e),
        None => make("gave up after repeated conflicts".into()),
    })
}

// ---------------------------------------------------------------------------------------------
// Keeping it current

/// Keeps the certificate current until `stop`: re-reads the Secret (renewing it while
/// leading) or the files, reloads the server configuration and publishes the caBundle.
pub(crate) async fn keep(
    mut tls: Tls,
    mut leader: Leader,
    mut stop: Stop,
) -> Result<(), ControllerError> {
    let refresh = match &tls.source {
        Source::SelfManaged { refresh, .. } | Source::Files { refresh, .. } => *refresh,
    };
    loop {
        tokio::select! {
            () = stop.wait() => return Ok(()),
            () = tokio::time::sleep(refresh) => {}
            () = leader.changed() => {}
        }
        let leading = leader.is_leader();
        let Tls {
            server,
            ca_bundle,
            source,
        } = &mut tls;
        match source {
            Source::SelfManaged {
                api,
                name,
                origin,
                names,
                current,
                ..
            } => match refresh_secret(api, name, names, leading, current, origin).await {
                Ok(Some(material)) if material != *current => {
                    match server_config(
                        material.serving_cert.as_bytes(),
                        material.serving_key.as_bytes(),
                    ) {
                        Ok(config) => {
                            server.reload_from_config(config);
                            ca_bundle.send_replace(Some(material.ca_bundle.clone().into_bytes()));
                            tracing::info!(secret = %origin, "reloaded the serving certificate");
                            *current = material;
                        }
                        Err(e) => {
                            tracing::warn!(secret = %origin, error = %e, "cannot use the certificate in the Secret")
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "refreshing the TLS Secret failed"),
            },
            Source::Files {
                cert,
                key,
                ca,
                seen,
                ..
            } => {
                if let Err(e) = refresh_files(server, ca_bundle, cert, key, ca, seen).await {
                    tracing::warn!(error = %e, "reading the certificate files failed; serving the last good certificate");
                }
            }
        }
    }
}

/// Reads the Secret; while leading, renews what is due, and writes a missing or unusable
/// Secret again from `current`, the material this replica serves and publishes now. Returns
/// the material now in the Secret, if usable (`None`: keep `current`).
///
/// A lost Secret never makes a new CA here: `current` is what every API server trusts, so
/// writing it back changes nothing for them. Should `current` be due for a new CA (even
/// expired), the renewal below stages it like any rotation: the new CA joins the caBundle
/// first and signs only [`CA_PROPAGATION`] later. A replica that does not lead never writes
/// the Secret; it keeps serving `current` until the leader has written it again.
async fn refresh_secret(
    api: &Api<Secret>,
    name: &str,
    names: &[String],
    leading: bool,
    current: &Material,
    origin: &str,
) -> Result<Option<Material>, ControllerError> {
    let secret = api
        .get_opt(name)
        .await
        .map_err(|e| ControllerError::api("get", origin, e))?;
    let found = secret.as_ref().map(Material::from_secret);
    let resource_version = secret.and_then(|s| s.metadata.resource_version);
    let (mut material, mut resource_version) = match found {
        Some(Ok(material)) => (material, resource_version),
        _ if !leading => return Ok(None),
        problem => {
            match &problem {
                Some(Err(why)) => {
                    tracing::warn!(secret = %origin, problem = %why, "the TLS Secret is unusable; writing it again from the certificates in use")
                }
                _ => {
                    tracing::warn!(secret = %origin, "the TLS Secret is missing; writing it again from the certificates in use")
                }
            }
            let secret = current.to_secret(name, resource_version.clone());
            let (action, written) = match resource_version {
                None => ("create", api.create(&PostParams::default(), &secret).await),
                Some(_) => (
                    "replace",
                    api.replace(name, &PostParams::default(), &secret).await,
                ),
            };
            match written {
                Ok(written) => {
                    tracing::info!(secret = %origin, "wrote the TLS Secret again: same CA and serving certificate");
                    (current.clone(), written.metadata.resource_version)
                }
                // Someone else wrote it meanwhile: read theirs next time.
                Err(e) if is_conflict(&e) => return Ok(None),
                Err(e) => return Err(ControllerError::api(action, origin, e)),
            }
        }
    };
    if !leading {
        return Ok(Some(material));
    }
    let make = |message: String| ControllerError::Certificate {
        origin: origin.to_string(),
        message,
    };
    // At most a rename and a CA step; each step is written before the next is decided.
    for _ in 0..3 {
        let now = now_unix();
        let step = plan(&material.meta, names, now);
        if step == Plan::Keep {
            break;
        }
        let renewed = material.renew(step, names, now).map_err(make)?;
        match api
            .replace(
                name,
                &PostParams::default(),
                &renewed.to_secret(name, resource_version.clone()),
            )
            .await
        {
            Ok(written) => {
                tracing::info!(secret = %origin, step = ?step, "renewed the certificates");
                resource_version = written.metadata.resource_version;
                material = renewed;
            }
            // Someone else wrote meanwhile: look again next time.
            Err(e) if is_conflict(&e) => break,
            Err(e) => return Err(ControllerError::api("replace", origin, e)),
        }
    }
    Ok(Some(material))
}

async fn refresh_files(
    server: &RustlsConfig,
    ca_bundle: &watch::Sender<Option<Vec<u8>>>,
    cert: &PathBuf,
    key: &PathBuf,
    ca: &CaBundleSource,
    seen: &mut (Vec<u8>, Vec<u8>),
) -> Result<(), ControllerError> {
    let cert_pem = read(cert).await?;
    let key_pem = read(key).await?;
    if (&cert_pem, &key_pem) != (&seen.0, &seen.1) {
        match server_config(&cert_pem, &key_pem) {
            Ok(config) => {
                server.reload_from_config(config);
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::RootCertStore;
    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};
    use serde_json::json;

    fn names() -> Vec<String> {
        vec![
            "initium.initium-system.svc".into(),
            "initium.initium-system.svc.cluster.local".into(),
            "127.0.0.1".into(),
        ]
    }

    /// Whether a client trusting `ca_bundle` accepts `serving_cert` for `name`.
    fn trusted(ca_bundle: &str, serving_cert: &str, name: &str) -> Result<(), String> {
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca_bundle.as_bytes()) {
            roots
                .add(ca.map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        }
        let verifier = WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .map_err(|e| e.to_string())?;
        let leaf =
            CertificateDer::from_pem_slice(serving_cert.as_bytes()).map_err(|e| e.to_string())?;
        let server_name = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
        verifier
            .verify_server_cert(&leaf, &[], &server_name, &[], UnixTime::now())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_serving_certificate_carries_the_webhook_names() {
        let material = Material::create(&names(), now_unix()).unwrap();
        for name in names() {
            trusted(&material.ca_bundle, &material.serving_cert, &name)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(
            trusted(
                &material.ca_bundle,
                &material.serving_cert,
                "other.initium-system.svc"
            )
            .is_err()
        );
        assert!(trusted(&material.ca_bundle, &material.serving_cert, "127.0.0.2").is_err());
        server_config(
            material.serving_cert.as_bytes(),
            material.serving_key.as_bytes(),
        )
        .unwrap();
    }

    #[test]
    fn material_survives_the_secret() {
        let material = Material::create(&names(), now_unix()).unwrap();
        let secret = material.to_secret("initium-tls", None);
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(Material::from_secret(&secret).unwrap(), material);

        let mut broken = secret.clone();
        broken.data.as_mut().unwrap().remove(TLS_KEY);
        assert!(
            Material::from_secret(&broken)
                .unwrap_err()
                .contains("tls.key")
        );
        let mut mismatched = secret;
        let other = Material::create(&names(), now_unix()).unwrap();
        mismatched
            .data
            .as_mut()
            .unwrap()
            .insert(TLS_KEY.into(), ByteString(other.serving_key.into_bytes()));
        assert!(Material::from_secret(&mismatched).is_err());
    }

    #[test]
    fn renewal_is_planned_at_two_thirds_of_life() {
        let start = 1_000_000_000;
        let material = Material::create(&names(), start).unwrap();
        let meta = &material.meta;
        let day = 24 * 3600;
        assert_eq!(plan(meta, &names(), start), Plan::Keep);
        assert_eq!(plan(meta, &names(), start + 200 * day), Plan::Keep);
        assert_eq!(plan(meta, &names(), start + 244 * day), Plan::RenewServing);
        assert_eq!(
            plan(meta, &["other.svc".to_string()], start),
            Plan::RenewServing,
            "new names are needed at once"
        );
        assert_eq!(plan(meta, &names(), start + 2434 * day), Plan::StageCa);
    }

    #[test]
    fn a_ca_rotation_never_leaves_the_serving_certificate_untrusted() {
        let start = now_unix();
        let first = Material::create(&names(), start).unwrap();
        let name = "initium.initium-system.svc";

        let staged = first.renew(Plan::StageCa, &names(), start).unwrap();
        // The old certificate is still served and still trusted by the bundle...
        assert_eq!(staged.serving_cert, first.serving_cert);
        trusted(&staged.ca_bundle, &staged.serving_cert, name).unwrap();
        assert_eq!(plan(&staged.meta, &names(), start + 60), Plan::Keep);
        assert_eq!(
            plan(
                &staged.meta,
                &names(),
                start + CA_PROPAGATION.as_secs() as i64
            ),
            Plan::PromoteCa
        );

        let promoted = staged.renew(Plan::PromoteCa, &names(), start).unwrap();
        // ...and the new one is trusted by the bundle that was published before it.
        trusted(&staged.ca_bundle, &promoted.serving_cert, name).unwrap();
        trusted(&promoted.ca_bundle, &promoted.serving_cert, name).unwrap();
        assert!(
            trusted(&first.ca_bundle, &promoted.serving_cert, name).is_err(),
            "signed by the new CA"
        );
        assert_eq!(promoted.meta.next_ca, None);
        let reread = Material::from_secret(&promoted.to_secret("s", None)).unwrap();
        assert_eq!(reread, promoted);
    }

    /// An API server holding at most one Secret, enough for `refresh_secret`: get, create
    /// (409 if it exists) and replace (409 unless the resourceVersion matches).
    fn fake_secrets() -> (Api<Secret>, Arc<std::sync::Mutex<Option<Secret>>>) {
        use axum::http::{Method, Request, Response, StatusCode};
        use kube::client::Body;
        let store = Arc::new(std::sync::Mutex::new(None::<Secret>));
        let stored = store.clone();
        let service = tower::service_fn(move |request: Request<Body>| {
            let store = stored.clone();
            async move {
                let method = request.method().clone();
                let body = request.into_body().collect_bytes().await.unwrap();
                let mut store = store.lock().unwrap();
                let respond = |status: StatusCode, json: String| {
                    Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Body::from(json.into_bytes()))
                        .unwrap()
                };
                let status = |code: StatusCode| {
                    // kube tells "not found" from other errors by the reason.
                    let reason = match code {
                        StatusCode::NOT_FOUND => "NotFound",
                        StatusCode::CONFLICT => "Conflict",
                        _ => "MethodNotAllowed",
                    };
                    respond(
                        code,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                               "message": reason, "reason": reason, "code": code.as_u16()})
                        .to_string(),
                    )
                };
                let response = match method {
                    Method::GET => match &*store {
                        Some(secret) => {
                            respond(StatusCode::OK, serde_json::to_string(secret).unwrap())
                        }
                        None => status(StatusCode::NOT_FOUND),
                    },
                    Method::POST | Method::PUT => {
                        let mut secret: Secret = serde_json::from_slice(&body).unwrap();
                        let existing = store
                            .as_ref()
                            .and_then(|s| s.metadata.resource_version.clone());
                        let (ok, rv) = if method == Method::POST {
                            (existing.is_none(), 1)
                        } else {
                            let rv = existing.as_deref().map_or(0, |v| v.parse().unwrap());
                            (
                                existing.is_some() && secret.metadata.resource_version == existing,
                                rv + 1,
                            )
                        };
                        if ok {
                            secret.metadata.resource_version = Some(rv.to_string());
                            *store = Some(secret.clone());
                            respond(StatusCode::OK, serde_json::to_string(&secret).unwrap())
                        } else {
                            status(StatusCode::CONFLICT)
                        }
                    }
                    _ => status(StatusCode::METHOD_NOT_ALLOWED),
                };
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let client = Client::new(service, "initium-system");
        (Api::namespaced(client, "initium-system"), store)
    }

    #[tokio::test]
    async fn a_deleted_secret_is_written_again_with_the_same_ca() {
        let (api, store) = fake_secrets();
        let origin = "Secret initium-system/initium-tls";
        let current = Material::create(&names(), now_unix()).unwrap();

        // Not leading: nothing is written, the certificates in use stay.
        let found = refresh_secret(&api, "initium-tls", &names(), false, &current, origin)
            .await
            .unwrap();
        assert_eq!(found, None);
        assert!(store.lock().unwrap().is_none(), "only the leader writes");

        // Leading: the Secret is written again from what is served, not from a new CA.
        let found = refresh_secret(&api, "initium-tls", &names(), true, &current, origin)
            .await
            .unwrap();
        assert_eq!(
            found.as_ref(),
            Some(&current),
            "the same CA and serving certificate"
        );
        let written = store.lock().unwrap().clone().expect("the Secret again");
        assert_eq!(Material::from_secret(&written).unwrap(), current);

        // Unusable (the key lost): replaced with what is served, too.
        store
            .lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .data
            .as_mut()
            .unwrap()
            .remove(TLS_KEY);
        let found = refresh_secret(&api, "initium-tls", &names(), true, &current, origin)
            .await
            .unwrap();
        assert_eq!(found.as_ref(), Some(&current));
        let written = store.lock().unwrap().clone().unwrap();
        assert_eq!(Material::from_secret(&written).unwrap(), current);
        assert_eq!(written.metadata.resource_version.as_deref(), Some("2"));
    }

    #[tokio::test]
    async fn a_deleted_secret_with_a_ca_due_is_rotated_in_stages() {
        let (api, store) = fake_secrets();
        let origin = "Secret initium-system/initium-tls";
        let name = "initium.initium-system.svc";
        // Seven years old: the CA is due for renewal, the serving certificate has expired.
        let current = Material::create(&names(), now_unix() - 7 * 365 * 24 * 3600).unwrap();
        let found = refresh_secret(&api, "initium-tls", &names(), true, &current, origin)
            .await
            .unwrap()
            .expect("the Secret written and renewed");
        // The new CA is only staged: it is in the caBundle, next to the old one...
        assert_eq!(found.meta.signing_ca, current.meta.signing_ca);
        assert!(found.meta.next_ca.is_some() && found.next_ca.is_some());
        assert!(found.ca_bundle.starts_with(&current.signing_ca_cert));
        // ...and what is served is signed by the CA the published caBundle already trusts.
        trusted(&current.ca_bundle, &found.serving_cert, name).unwrap();
        let written = store.lock().unwrap().clone().unwrap();
        assert_eq!(Material::from_secret(&written).unwrap(), found);
    }

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
